//! Device slots and their leases: one exclusive lease per device (one per GPU, one for the
//! CPU), the warm evaluations of a device with prestart, and the time a device sat free while
//! an evaluation of it waited (`starved_ms`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use tokio::sync::{Semaphore, SemaphorePermit};

use super::{EvalError, Evaluator};

/// One device lease; `busy_ms` and `leases` feed `/metrics`.
#[derive(Debug)]
pub struct DeviceSlot {
    /// Index (GPU ordinal or 0 for the CPU).
    pub index: usize,
    lock: Semaphore,
    /// Evaluations of this device with processes alive (`prestart`).
    warm: Semaphore,
    /// Leases granted.
    pub leases: AtomicU64,
    /// Milliseconds held.
    pub busy_ms: AtomicU64,
    /// Milliseconds the device sat free while an evaluation of it was waiting for its place
    /// or still starting its judge (prestart): each is time a deeper `--prestart-depth`
    /// would have given back. 0 with prestart off.
    pub starved_ms: AtomicU64,
    /// Evaluations of this device past their build and not finished (prestart).
    pending: AtomicUsize,
    /// When the lease was last released with another evaluation pending, until the next
    /// lease (or until none is pending).
    released_waiting: Mutex<Option<Instant>>,
}

impl DeviceSlot {
    pub(super) fn new(index: usize, prestart_depth: usize) -> Self {
        Self {
            index,
            lock: Semaphore::new(1),
            warm: Semaphore::new(prestart_depth),
            leases: AtomicU64::new(0),
            busy_ms: AtomicU64::new(0),
            starved_ms: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            released_waiting: Mutex::new(None),
        }
    }

    fn released_waiting(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.released_waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// One evaluation counted as pending on its device slot until dropped.
struct Pending<'a>(&'a DeviceSlot);

impl<'a> Pending<'a> {
    fn new(slot: &'a DeviceSlot) -> Self {
        slot.pending.fetch_add(1, Ordering::SeqCst);
        Self(slot)
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        // The last pending evaluation gone: a free device from here on starves nobody.
        if self.0.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            *self.0.released_waiting() = None;
        }
    }
}

/// Where one evaluation runs: its device slot and what it holds there until it ends.
/// Without prestart that is the lease, taken before anything of the evaluation starts; with
/// it, a place among the device's warm evaluations (the lease is taken at the judge's gate).
pub(super) struct Place<'a> {
    /// The device slot.
    pub slot: &'a DeviceSlot,
    /// The lease, while this evaluation holds it and has not handed it on.
    pub lease: Option<Lease<'a>>,
    // Dropped in this order at the evaluation's end, the pending count first.
    _pending: Option<Pending<'a>>,
    _warm: Option<SemaphorePermit<'a>>,
}

impl Evaluator {
    /// A place for one evaluation: without prestart the lease comes first (nothing of this
    /// evaluation runs beside another's timing); with it, a place among the device's warm
    /// evaluations.
    pub(super) async fn take_place(&self) -> Result<Place<'_>, EvalError> {
        if self.cfg.prestart {
            let slot = self.pick_slot();
            // Pending from before its place among the warm evaluations: waiting for one is
            // the starvation a deeper prestart removes.
            let pending = Pending::new(slot);
            let warm = slot.warm.acquire().await?;
            Ok(Place {
                slot,
                lease: None,
                _pending: Some(pending),
                _warm: Some(warm),
            })
        } else {
            let lease = self.lease_any().await?;
            Ok(Place {
                slot: lease.slot,
                lease: Some(lease),
                _pending: None,
                _warm: None,
            })
        }
    }

    /// The least-recently-picked free device slot's lease, else a wait on the round-robin one.
    async fn lease_any(&self) -> Result<Lease<'_>, EvalError> {
        let n = self.slots.len();
        let start = self.next_slot.fetch_add(1, Ordering::Relaxed) % n;
        for i in 0..n {
            let slot = &self.slots[(start + i) % n];
            if let Ok(permit) = slot.lock.try_acquire() {
                return Ok(Lease::new(slot, permit));
            }
        }
        Self::lease(&self.slots[start]).await
    }

    /// `slot`'s lease, waiting for it.
    pub(super) async fn lease(slot: &DeviceSlot) -> Result<Lease<'_>, EvalError> {
        let permit = slot.lock.acquire().await?;
        Ok(Lease::new(slot, permit))
    }

    /// The device with the most room for a warm evaluation (round robin among equals).
    fn pick_slot(&self) -> &DeviceSlot {
        let n = self.slots.len();
        let start = self.next_slot.fetch_add(1, Ordering::Relaxed) % n;
        let room = |s: &DeviceSlot| (s.warm.available_permits(), s.lock.available_permits());
        let mut best = &self.slots[start];
        for i in 1..n {
            let s = &self.slots[(start + i) % n];
            if room(s) > room(best) {
                best = s;
            }
        }
        best
    }
}

/// A device slot held exclusively; its time is added to the slot's `busy_ms` when dropped.
pub(super) struct Lease<'a> {
    slot: &'a DeviceSlot,
    _permit: tokio::sync::SemaphorePermit<'a>,
    since: Instant,
}

impl<'a> Lease<'a> {
    fn new(slot: &'a DeviceSlot, permit: tokio::sync::SemaphorePermit<'a>) -> Self {
        slot.leases.fetch_add(1, Ordering::Relaxed);
        if let Some(t) = slot.released_waiting().take() {
            slot.starved_ms
                .fetch_add(t.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
        tracing::debug!(slot = slot.index, "device lease taken");
        Self {
            slot,
            _permit: permit,
            since: Instant::now(),
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.slot
            .busy_ms
            .fetch_add(self.since.elapsed().as_millis() as u64, Ordering::Relaxed);
        // Another evaluation pending besides the one releasing (still counted until its end):
        // the device is free while it waits or starts, until it takes the lease.
        if self.slot.pending.load(Ordering::SeqCst) > 1 {
            *self.slot.released_waiting() = Some(Instant::now());
        }
    }
}

/// When the device lease of one evaluation was taken and how its time split.
#[derive(Debug, Clone, Copy)]
pub(super) struct LeaseTimes {
    /// When the lease was granted (when the judge's gate was reached, without one).
    pub leased_at: Instant,
    /// Lease to the judge's go (about 0 without a lease).
    pub to_go_s: f64,
    /// The judge's end to the lease's release; 0 without a lease.
    pub teardown_s: f64,
    /// Lease to release; 0 without a lease.
    pub held_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The device counts as starved from a release with another evaluation pending until the
    /// next lease; never when the releasing evaluation was the only one, and not past the
    /// moment the last pending one ended without the device.
    #[tokio::test]
    async fn starvation_is_counted_only_while_an_evaluation_waits() {
        let slot = DeviceSlot::new(0, 2);
        let ms = |s: &DeviceSlot| s.starved_ms.load(Ordering::Relaxed);
        // Alone: a release and a later lease of its own starve nobody.
        {
            let _a = Pending::new(&slot);
            drop(Evaluator::lease(&slot).await.unwrap());
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        drop(Evaluator::lease(&slot).await.unwrap());
        assert_eq!(ms(&slot), 0);
        // Two pending: the gap between one's release and the other's lease is counted.
        let a = Pending::new(&slot);
        let b = Pending::new(&slot);
        drop(Evaluator::lease(&slot).await.unwrap());
        drop(a);
        tokio::time::sleep(Duration::from_millis(60)).await;
        drop(Evaluator::lease(&slot).await.unwrap());
        let starved = ms(&slot);
        assert!(starved >= 60, "{starved} ms");
        // The waiting one ends without the device (a verdict before its gate): the idle time
        // after that is nobody's.
        let c = Pending::new(&slot);
        drop(Evaluator::lease(&slot).await.unwrap());
        drop(b);
        drop(c);
        tokio::time::sleep(Duration::from_millis(30)).await;
        drop(Evaluator::lease(&slot).await.unwrap());
        assert_eq!(ms(&slot), starved);
    }
}
