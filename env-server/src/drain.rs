//! Draining before the server goes away (a node taken from a cluster, a restart): readiness
//! turns false first, new episodes, steps and evaluations are refused (503 `draining` with
//! `Retry-After`, so a client takes them to another server), the work already admitted gets
//! a grace period to finish, and whatever is left is ended with a stated reason.
//!
//! Every admitted reset, step and evaluation holds a [`Work`] guard for as long as it runs;
//! the drain waits for the guards to be gone. Answered steps stay answerable while draining
//! (a retry of a step whose answer was lost in transit is a replay, not new work).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// The reason logged for episodes still open when a drain ends.
pub const DRAIN_REASON: &str = "server_drain";

/// Why work was refused: the server is draining.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the server is draining before it stops: it takes no new work; retry on another server")]
pub struct Draining;

/// Whether the server admits work, and how much admitted work still runs.
#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
    /// Set when the grace period is over: work still running is given up.
    expired: AtomicBool,
    running: AtomicUsize,
    /// Woken when `running` falls to zero and when the grace expires.
    changed: Notify,
}

/// One admitted piece of work (a reset, a step, an evaluation); the drain waits for it.
#[derive(Debug)]
pub struct Work(Arc<Drain>);

impl Drop for Work {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.changed.notify_waiters();
        }
    }
}

impl Drain {
    /// Admits one piece of work unless the server is draining.
    pub fn admit(self: &Arc<Self>) -> Result<Work, Draining> {
        // Counted before the flag is read: a drain that starts in between sees this work
        // (both are SeqCst), so nothing admitted slips past the wait.
        self.running.fetch_add(1, Ordering::SeqCst);
        let work = Work(self.clone());
        match self.draining.load(Ordering::SeqCst) {
            true => Err(Draining),
            false => Ok(work),
        }
    }

    /// Whether the server is draining (readiness is false from the first moment).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Admitted work still running.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Stops admitting work; returns false if a drain had already begun.
    pub fn begin(&self) -> bool {
        !self.draining.swap(true, Ordering::SeqCst)
    }

    /// Waits until no admitted work runs.
    pub async fn idle(&self) {
        loop {
            // Created before the check: a guard dropped in between still wakes it.
            let woken = self.changed.notified();
            if self.running() == 0 {
                return;
            }
            woken.await;
        }
    }

    /// Gives up on the work still running: evaluations waiting in [`Drain::expired`] answer
    /// at once.
    pub fn expire(&self) {
        self.expired.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Resolves once the grace period is over.
    pub async fn expired(&self) {
        loop {
            let woken = self.changed.notified();
            if self.expired.load(Ordering::SeqCst) {
                return;
            }
            woken.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_admitted_before_the_drain_is_waited_for_and_new_work_is_refused() {
        let d = Arc::new(Drain::default());
        let work = d.admit().expect("admitted");
        assert!(d.begin());
        assert!(!d.begin(), "a second drain is no new drain");
        assert!(d.admit().is_err());
        assert_eq!(d.running(), 1, "a refusal leaves no work behind");
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.idle().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(work);
        waiter.await.expect("idle once the work is gone");
    }

    #[tokio::test]
    async fn expiry_wakes_whoever_waits_for_it() {
        let d = Arc::new(Drain::default());
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.expired().await }
        });
        tokio::task::yield_now().await;
        d.expire();
        waiter.await.expect("woken");
        d.expired().await;
    }
}
