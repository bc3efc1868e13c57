//! The check-and-time run: the candidate's worker and the judge start (with prestart, while
//! the device still times another evaluation), the judge waits at its gate, the device lease
//! is taken and the gate opened, the workers are observed from outside from there on, and
//! everything of the candidate's ends before the lease goes to the next evaluation.

use std::ffi::OsString;
use std::time::Instant;

use agent_tools::sandbox::{Outcome, SandboxedChild};
use agent_tools::Jail;
use tokio::io::AsyncWriteExt;

use super::dirs::{compile_cache_parts, hand_over, EvalDirs};
use super::lease::{Lease, LeaseTimes, Place};
use super::process::{drain, drain_watching, tail, CompileCache};
use super::verdict::{Observed, Verdict};
use super::volume::EvalVolume;
use super::{io_err, EvalError, Evaluator};
use crate::observe::Observer;

/// The observer of both workers' trees (Err: why they could not be observed), None where
/// they are not observed.
type Observers = Option<Result<Observer, String>>;

/// What the judge's side of the run left: its output, how it ended, the lease's times, the
/// lease itself (until the worker is gone) and the observers.
struct JudgeRun<'a> {
    out: Vec<u8>,
    err: Vec<u8>,
    outcome: Outcome,
    times: LeaseTimes,
    lease: Option<Lease<'a>>,
    observers: Observers,
}

/// The judge's process and what the run needs of it beside its command line.
struct JudgeSide<'j> {
    jail: &'j Jail,
    argv: Vec<OsString>,
    owner: Option<(u32, u32)>,
    /// The compile cache's parts to hand to the judge with the lease.
    cache_parts: Vec<std::path::PathBuf>,
}

impl Evaluator {
    /// The check-and-time run: the verdict, the tail of the worker's output, and when the
    /// device lease was granted (the lease is held from then until the worker is killed).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn judge_run(
        &self,
        d: &EvalDirs,
        worker_jail: &Jail,
        volume: &EvalVolume,
        judge_owner: Option<(u32, u32)>,
        worker_owner: Option<(u32, u32)>,
        seeds: &str,
        tolerance: Option<f64>,
        shared_compile_cache: bool,
    ) -> Result<(Verdict, String, LeaseTimes, Option<Observed>), EvalError> {
        let mut place = self.take_place().await?;
        let slot_index = place.slot.index;
        let worker_jail = self.worker_jail_on(worker_jail, slot_index);
        let (cache, cache_parts) = self.compile_cache(d, slot_index, shared_compile_cache)?;
        let judge_jail = self.judge_jail(d, judge_owner, &cache, slot_index);
        // Started ahead of the lease in priority mode: below the evaluation that times now,
        // raised when this one holds the lease. Only with uids of their own, by which the
        // server finds every process to raise.
        let lowered = place.lease.is_none()
            && self.cfg.isolation.lowers_prestart()
            && judge_owner.is_some()
            && worker_owner.is_some();
        let mut worker = self.spawn_jailed(
            &worker_jail,
            &self.worker_argv(d),
            &d.candidate,
            "the worker",
            false,
            lowered,
        )?;
        let worker_pid = worker.id().unwrap_or(0);
        // The worker's prints go nowhere the verdict is read from: drained (so it never blocks
        // on a full pipe) and kept as a capped tail for the diagnostics.
        let wout = drain(worker.stdout.take(), 64 << 10);
        let werr = drain(worker.stderr.take(), 64 << 10);
        let judge = JudgeSide {
            jail: &judge_jail,
            argv: self.judge_argv(d, seeds, worker_pid, worker_owner, tolerance),
            owner: judge_owner,
            cache_parts,
        };
        // The worker's volume is watched while the judge runs: once it is full the run is
        // over (the judge and its side are ended with their handles), the candidate's fault.
        let judged = tokio::select! {
            j = self.judge_through_gate(d, judge, &mut place, worker_pid, worker_owner, lowered) => Ok(j),
            b = watch_volume(volume) => Err(b),
        };
        // Whatever the judge decided, the worker and everything it started end here, before
        // the device goes to the next evaluation.
        let judge_ended = Instant::now();
        let _ = worker.kill_all().await;
        let log = {
            let mut log = wout.await.unwrap_or_default();
            log.extend(werr.await.unwrap_or_default());
            tail(&log, 2000)
        };
        // Filled and then emptied before the watch looked again: still the limit's verdict.
        let breach = match judged {
            Err(b) => Some(b),
            Ok(_) => volume.breach().await,
        };
        if let Some(reason) = breach.and_then(|b| self.volume_breach_reason(b, "run")) {
            let times = LeaseTimes {
                leased_at: judge_ended,
                to_go_s: 0.0,
                teardown_s: 0.0,
                held_s: 0.0,
            };
            let rule = reason.split(':').next().unwrap_or("disk_quota").to_string();
            return Ok((Verdict::failed(&rule, reason), log, times, None));
        }
        let Ok(judged) = judged else {
            return Err(EvalError::Harness("the volume watch ended".into()));
        };
        let JudgeRun {
            out,
            err,
            outcome,
            mut times,
            lease,
            observers,
        } = judged?;
        if lease.is_some() {
            times.teardown_s = judge_ended.elapsed().as_secs_f64();
            times.held_s = times.leased_at.elapsed().as_secs_f64();
        }
        drop(lease);
        // Resolving the samples is the server's own work: after the device is the next
        // evaluation's (the judge has ended; later samples fall outside its windows).
        let observed = finish_observing(observers).await?;
        if outcome.timed_out {
            let secs = self.cfg.phase_timeout.as_secs_f64();
            let v = Verdict::failed(
                "time_limit",
                format!("time_limit: the evaluation ran past {secs} s"),
            );
            return Ok((v, log, times, None));
        }
        let verdict = Verdict::of_judge(&out, &err, &outcome)?;
        Ok((verdict, log, times, observed))
    }

    /// The compile cache of this evaluation's judge, and the parts of it handed over with the
    /// lease. torch.compile's caches persist across evaluations, so the compile baseline's
    /// compilation is paid once per task and device. One directory per device slot, only
    /// judges (never a worker) can write it, and it belongs to the judge that holds the
    /// slot's lease: handed over when the lease is granted, not when the judge starts. With
    /// prestart several judges wait at their gates at once, and a hand-over at start gave
    /// the directory to the last one started while another timed: that one's torch.compile
    /// could not write its cache (the evaluation failed with a harness error).
    /// A task that came with the request is code of the caller's: what its torch.compile
    /// leaves (or what the task's own code writes there) must not reach the judges after
    /// it, so its cache is in its judge's directory, removed with the evaluation.
    fn compile_cache(
        &self,
        d: &EvalDirs,
        slot_index: usize,
        shared: bool,
    ) -> Result<(CompileCache, Vec<std::path::PathBuf>), EvalError> {
        if shared {
            let dir = self
                .cfg
                .data_dir
                .join("judge-cache")
                .join(format!("slot{slot_index}"));
            let parts = compile_cache_parts(&dir).map_err(|e| io_err(&dir, e))?;
            Ok((CompileCache { dir, shared }, parts.to_vec()))
        } else {
            let dir = d.judge.join("compile-cache");
            Ok((CompileCache { dir, shared }, Vec::new()))
        }
    }

    /// Starts the judge, which starts its side (workers, channels) and waits at the gate;
    /// takes the lease (unless the place came with it), hands the compile cache over, starts
    /// observing and opens the gate; then waits for the judge's end.
    async fn judge_through_gate<'a>(
        &'a self,
        d: &EvalDirs,
        judge: JudgeSide<'_>,
        place: &mut Place<'a>,
        worker_pid: u32,
        worker_owner: Option<(u32, u32)>,
        lowered: bool,
    ) -> Result<JudgeRun<'a>, EvalError> {
        let deadline = Instant::now() + self.cfg.phase_timeout;
        let mut child = self.spawn_jailed(
            judge.jail,
            &judge.argv,
            &d.judge,
            "the judge",
            true,
            lowered,
        )?;
        let (at_gate_tx, at_gate) = tokio::sync::oneshot::channel();
        let out = drain_watching(child.stdout.take(), 8 << 20, Some(at_gate_tx));
        let err = drain(child.stderr.take(), 1 << 20);
        let mut gate = child.stdin.take();
        let lease = match place.lease.take() {
            // Without prestart: taken before anything of this evaluation started.
            Some(l) => Some(l),
            // With it, taken once the judge waits at its gate: a judge still importing
            // never holds the device, and one that ended before its gate (a verdict such
            // as a forbidden source) or never got there in time needs none.
            None => match tokio::time::timeout(self.cfg.phase_timeout, at_gate).await {
                Ok(Ok(())) => Some(Self::lease(place.slot).await?),
                Ok(Err(_)) | Err(_) => None,
            },
        };
        let leased_at = Instant::now();
        if lease.is_some() {
            // The timed evaluation's CPU: its processes onto the slot's own cores, or raised
            // above everything else, before the gate opens (both trees are quiet there:
            // imports done, nothing of the candidate's loaded, so nothing forks meanwhile).
            let uids: Vec<u32> = [judge.owner, worker_owner]
                .into_iter()
                .flatten()
                .map(|(uid, _)| uid)
                .collect();
            let isolation = self.cfg.isolation.clone();
            let slot = place.slot.index;
            let entered =
                tokio::task::spawn_blocking(move || isolation.enter_timed(slot, &uids)).await??;
            tracing::debug!(
                slot,
                moved = entered.moved,
                raised = entered.raised,
                "timed evaluation isolated"
            );
        }
        if lease.is_some() {
            let (parts, owner) = (judge.cache_parts.clone(), judge.owner);
            tokio::task::spawn_blocking(move || {
                parts
                    .iter()
                    .try_for_each(|p| hand_over(p, owner).map_err(|e| io_err(p, e)))
            })
            .await??;
        }
        // On the CPU the workers' forwards are observed from outside from here on: both
        // trees are quiet at the gate (imports done, nothing of the candidate's loaded).
        let observers = if self.cfg.observe && lease.is_some() {
            Some(start_observing(worker_pid, worker_owner, &child).await?)
        } else {
            None
        };
        // A judge that already ended (a verdict before the gate, such as a forbidden
        // source) has closed its end: nothing to say to it then. Without a lease its gate
        // is closed unopened (it ends, or it is past its time and is stopped below).
        match gate.take() {
            Some(mut g) if lease.is_some() => {
                let _ = g.write_all(b"go\n").await;
                let _ = g.flush().await;
            }
            _ => {}
        }
        let go_at = Instant::now();
        // The judge's time runs from its lease; one that got none had its time to reach
        // the gate.
        let limit = match lease {
            Some(_) => self.cfg.phase_timeout,
            None => deadline.saturating_duration_since(Instant::now()),
        };
        let outcome = child.wait_within(limit).await;
        let times = LeaseTimes {
            leased_at,
            to_go_s: (go_at - leased_at).as_secs_f64(),
            teardown_s: 0.0,
            held_s: 0.0,
        };
        Ok(JudgeRun {
            out: out.await.unwrap_or_default(),
            err: err.await.unwrap_or_default(),
            outcome,
            times,
            lease,
            observers,
        })
    }
}

/// Attaches the observer to the worker's tree (`worker_pid`, running as its uid) and the
/// judge's (with the reference worker in it).
async fn start_observing(
    worker_pid: u32,
    worker_owner: Option<(u32, u32)>,
    judge: &SandboxedChild,
) -> Result<Result<Observer, String>, EvalError> {
    let judge_pid = judge.id().unwrap_or(0);
    tokio::task::spawn_blocking(move || {
        use crate::observe::Tree;
        Observer::attach(&[
            Tree {
                root: worker_pid,
                uid: worker_owner.map(|(uid, _)| uid),
            },
            Tree {
                root: judge_pid,
                uid: None,
            },
        ])
        .map_err(|e| env_api::error_chain(&e))
    })
    .await
    .map_err(|e| EvalError::Harness(format!("observer: {e}")))
}

/// Stops observing and resolves the samples of both trees.
async fn finish_observing(observers: Observers) -> Result<Option<Observed>, EvalError> {
    match observers {
        Some(observer) => Ok(Some(
            tokio::task::spawn_blocking(move || {
                let mut trees = observer.map(Observer::finish);
                let mut take = |i: usize| match &mut trees {
                    Ok(r) => Ok(std::mem::take(&mut r[i])),
                    Err(e) => Err(e.clone()),
                };
                Observed {
                    candidate: take(0),
                    reference: take(1),
                }
            })
            .await
            .map_err(|e| EvalError::Harness(format!("observer: {e}")))?,
        )),
        None => Ok(None),
    }
}

/// Waits until the evaluation's volume reaches a limit; the limit. A tmpfs is asked every
/// 100 ms (one statvfs), a measured directory every 2 s (a walk).
async fn watch_volume(volume: &EvalVolume) -> agent_tools::sandbox::Breach {
    let every = match volume.volume().map(|v| v.enforcement()) {
        Some(agent_tools::sandbox::QuotaEnforcement::Tmpfs) => 100,
        _ => 2000,
    };
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(every)).await;
        if let Some(b) = volume.breach().await {
            return b;
        }
    }
}
