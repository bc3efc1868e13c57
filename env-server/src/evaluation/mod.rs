//! The evaluation queue: final evaluations and `POST /v1/evaluate`.
//!
//! Each evaluation gets a fresh directory and a fresh sandbox with the server's pristine
//! harness. Builds run in parallel up to a bound and hold no device; timing runs hold an
//! exclusive lease on one device (one per GPU, one for the CPU), so no two timings share a
//! device. The check-and-time run is two sandboxed processes under two uids: the judge
//! (`evaluate.py`, trusted, never imports candidate code) and the candidate's worker
//! (`cuda_agent_worker.py`), talking over two FIFOs; eager and torch.compile are timed next to
//! the candidate in the same run, never cached (docs/EVALUATION.md).
//!
//! With `prestart` (the default on CUDA), the next evaluation of a device starts its judge and
//! workers while the device still times the current one: they import PyTorch and open their
//! channels, then the judge waits at a gate until the lease is its own. No candidate code runs
//! and nothing touches the device before the gate. The lease is taken when the judge says it
//! waits at its gate, so a judge still importing never holds the device (nor does one that
//! ended before its gate, such as on a forbidden source); at most
//! [`EvaluatorConfig::prestart_depth`] evaluations per device have processes alive.
//!
//! The parts, one job each: [`lease`] (device slots, leases, places among the warm
//! evaluations), [`dirs`] (an evaluation's directory, FIFOs, the judges' compile cache),
//! [`build_cache`] (the build phase and its cache entry), [`volume`] (the evaluation's
//! size- and inode-limited volume, everything the candidate writes, and the copies between it
//! and the cache), [`process`] (the sandboxed
//! processes: jails, command lines, their output), [`judge`] (the check-and-time run through
//! the judge's gate) and [`verdict`] (the judge's verdict, the outside observation, the
//! result). This file holds the queue and the order of the phases.

mod build_cache;
mod dirs;
pub mod isolation;
mod judge;
mod lease;
mod process;
mod verdict;
mod volume;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_tools::Sandbox;
use env_api::{EvaluationDetails, EvaluationPhases, EvaluationResult};
use kernelbench::Task;

use crate::build::BuildQueue;
use crate::runtime::{Device, PythonInfo};

pub use isolation::{TimingCores, TimingIsolation, TimingIsolationInfo};
pub use lease::DeviceSlot;
pub use volume::{EvaluationVolumeInfo, MemoryBudget, ReservedNow};

use dirs::{remove_eval_dir, EvalDirs, RemoveOnDrop};

/// Largest solution accepted, all files together.
pub const MAX_SOLUTION_BYTES: usize = 4 << 20;

/// Errors that stop an evaluation before the candidate is judged (the server's fault or
/// the request's, never the candidate's).
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The solution is malformed (paths, sizes).
    #[error("{0}")]
    BadSolution(String),
    /// Too many evaluations are waiting.
    #[error("the evaluation queue is full ({0} waiting); retry later")]
    QueueFull(usize),
    /// The harness ran and reported its own failure, or gave no verdict.
    #[error("evaluation harness failed: {0}")]
    Harness(String),
    /// A file operation on the evaluation's own directories.
    #[error("evaluation harness failed: {path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The sandbox refused (no uids, no ruleset).
    #[error("evaluation harness failed: {context}")]
    Sandbox {
        /// What was being done.
        context: &'static str,
        /// The error.
        #[source]
        source: agent_tools::SandboxError,
    },
    /// A process could not be started.
    #[error("evaluation harness failed: spawn {what}")]
    Spawn {
        /// Which process.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Blocking work on the runtime's pool panicked or was cancelled.
    #[error("evaluation harness failed")]
    Join(#[from] tokio::task::JoinError),
    /// A device lease could not be taken (the evaluator is shutting down).
    #[error("evaluation harness failed: device lease")]
    Lease(#[from] tokio::sync::AcquireError),
    /// The timed evaluation's processes could not be moved onto their cores or raised.
    #[error("evaluation harness failed")]
    Isolation(#[from] isolation::IsolationError),
    /// Room for the evaluation's volume in the memory budget could not be waited for (the
    /// evaluator is shutting down).
    #[error("evaluation harness failed: volume memory")]
    VolumeBudget {
        /// The error.
        #[source]
        source: tokio::sync::AcquireError,
    },
}

/// Settings of the evaluator.
#[derive(Debug, Clone)]
pub struct EvaluatorConfig {
    /// Where evaluation directories, caches and the harness live.
    pub data_dir: PathBuf,
    /// The device.
    pub device: Device,
    /// Number of device leases (GPUs; 1 for the CPU).
    pub devices: usize,
    /// Builds at once (granted round robin over requesters).
    pub max_builds: usize,
    /// Compile jobs inside one build (`MAX_JOBS` of torch's extension builder).
    pub build_jobs: usize,
    /// Most evaluations waiting before new ones are refused.
    pub max_queue: usize,
    /// Time limit of each harness phase.
    pub phase_timeout: Duration,
    /// Environment every harness process gets on top of the standard one.
    pub extra_env: Vec<(String, String)>,
    /// Skip torch.compile baselines (faster CPU test runs; compile speedup then unknown).
    pub skip_compile: bool,
    /// How long the judge times the contestants (its `--budget-s`).
    pub timing_budget: Duration,
    /// Aten operators candidates may dispatch beyond the harness's allocation/view/copy list.
    pub allow_ops: Vec<String>,
    /// Start the next evaluation's processes while the device is still leased (see the
    /// module's docs). Off on CPU by default: there the lease is the whole machine, and
    /// importing PyTorch beside a timing run would disturb it.
    pub prestart: bool,
    /// With `prestart`, evaluations per device whose processes are alive at once (at least 2:
    /// the one holding the lease and one at its gate).
    pub prestart_depth: usize,
    /// Observe the workers' forwards from outside on the CPU (`observe.rs`), where the kernel
    /// lets the server.
    pub observe: bool,
    /// Hashes of the server's own tasks: only their judges write the compile cache that later
    /// judges load. A task whose source came with the request gets a cache of its own,
    /// removed with its evaluation.
    pub shared_cache_tasks: Arc<std::collections::HashSet<String>>,
    /// Most bytes the build cache holds once the evaluations in flight are done (each of
    /// those may add up to `build_cache_entry_max_bytes` until it ends).
    pub build_cache_max_bytes: u64,
    /// Most bytes one build-cache entry may hold, after the build and after the run; a build
    /// over it fails its evaluation (`build_size`) and is not admitted.
    pub build_cache_entry_max_bytes: u64,
    /// What one evaluation's volume holds: everything its build and run may write (sources'
    /// copy, temp dir, build directory, outputs).
    pub volume_limits: agent_tools::sandbox::VolumeLimits,
    /// Memory the evaluations' tmpfs volumes may reserve together (None: nothing reserved);
    /// an evaluation waits for room.
    pub volume_memory_bytes: Option<u64>,
    /// What keeps a timed evaluation's CPU its own (`--timing-cores`).
    pub isolation: Arc<TimingIsolation>,
}

/// Evaluations per device whose judge and workers are alive at once with `prestart`, unless
/// configured: the one holding the lease and five starting or at their gates. A device keeps
/// busy while depth >= 1 + start / lease: a judge's side took 11-23 s to start on an H100
/// host (PyTorch imported in three processes, several judges starting at once) against a
/// 5 s lease with torch.compile on; with four, the device sat idle between waves of judges
/// (458 evaluations an hour where the lease allows about 700).
pub const DEFAULT_PRESTART_DEPTH: usize = 6;

/// The evaluator shared by all episodes.
#[derive(Debug)]
pub struct Evaluator {
    cfg: EvaluatorConfig,
    sandbox: Sandbox,
    python: PythonInfo,
    harness_dir: PathBuf,
    builds: Arc<BuildQueue>,
    slots: Vec<DeviceSlot>,
    next_slot: AtomicUsize,
    waiting: AtomicUsize,
    build_locks: Mutex<HashMap<String, std::sync::Arc<tokio::sync::Mutex<()>>>>,
    /// Held while the build cache is pruned, an entry admitted into it or copied out of it
    /// (one at a time).
    pruning: Arc<Mutex<()>>,
    /// The evaluations' volumes.
    volumes: volume::EvalVolumes,
    /// Evaluations finished.
    pub finished: AtomicU64,
}

fn io_err(p: &Path, e: std::io::Error) -> EvalError {
    EvalError::Io {
        path: p.to_path_buf(),
        source: e,
    }
}

impl Evaluator {
    /// Evaluations per device started ahead of their lease; `None` with prestart off.
    pub fn prestart_depth(&self) -> Option<usize> {
        self.cfg.prestart.then_some(self.cfg.prestart_depth)
    }

    /// An evaluator over an installed harness.
    pub fn new(
        cfg: EvaluatorConfig,
        sandbox: Sandbox,
        python: PythonInfo,
        harness_dir: PathBuf,
    ) -> Self {
        let cfg = EvaluatorConfig {
            prestart_depth: cfg.prestart_depth.max(2),
            ..cfg
        };
        let slots = (0..cfg.devices.max(1))
            .map(|index| DeviceSlot::new(index, cfg.prestart_depth))
            .collect();
        // Copies of builds on their way into the cache that a crash left behind.
        let _ = crate::retention::remove_entry(&cfg.data_dir.join("build-staging"));
        let volumes = volume::EvalVolumes::new(
            cfg.data_dir.join("eval-volumes"),
            cfg.volume_limits,
            cfg.volume_memory_bytes,
        );
        Self {
            volumes,
            builds: BuildQueue::new(cfg.max_builds),
            cfg,
            sandbox,
            python,
            harness_dir,
            slots,
            next_slot: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            build_locks: Mutex::new(HashMap::new()),
            pruning: Arc::new(Mutex::new(())),
            finished: AtomicU64::new(0),
        }
    }

    /// The device leases.
    pub fn slots(&self) -> &[DeviceSlot] {
        &self.slots
    }

    /// What `/v1/info` says of the evaluations' volumes, enforced as `enforcement` (what the
    /// sandbox found the host allows).
    pub fn volume_info(
        &self,
        enforcement: agent_tools::sandbox::QuotaEnforcement,
    ) -> EvaluationVolumeInfo {
        self.volumes.info(enforcement)
    }

    /// Evaluations waiting or running.
    pub fn in_flight(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.cfg.device
    }

    /// Checks a solution's files: relative paths inside the candidate dir, text, size bound.
    pub fn check_files(files: &BTreeMap<String, String>) -> Result<(), EvalError> {
        check_size(files)?;
        if !files.contains_key("model_new.py") {
            return Err(EvalError::BadSolution(
                "solution has no model_new.py".into(),
            ));
        }
        for name in files.keys() {
            let p = Path::new(name);
            // Each name is a file's: no trailing `/`, no `.` or `..`, no empty part.
            let ok = !name.is_empty()
                && !name.ends_with('/')
                && !name.contains("//")
                && p.is_relative()
                && p.components()
                    .all(|c| matches!(c, std::path::Component::Normal(_)))
                && (name == "model_new.py"
                    || name.strip_prefix("kernels/").is_some_and(|f| !f.is_empty()));
            if !ok {
                return Err(EvalError::BadSolution(format!(
                    "bad solution path {name:?}: use model_new.py and kernels/<file>"
                )));
            }
            // A file cannot also be a directory of another file.
            if let Some(dir) = p
                .ancestors()
                .skip(1)
                .find(|a| files.contains_key(&*a.to_string_lossy()))
            {
                return Err(EvalError::BadSolution(format!(
                    "bad solution path {name:?}: {:?} is a file, not a directory",
                    dir.display()
                )));
            }
        }
        Ok(())
    }

    /// Evaluates `files` (model_new.py plus kernels/...) against `task`. A broken candidate
    /// is a result with reward -1, not an error.
    pub async fn evaluate(
        &self,
        task: &Task,
        files: &BTreeMap<String, String>,
        tolerance: Option<f64>,
    ) -> Result<EvaluationResult, EvalError> {
        self.evaluate_for("api", task, files, tolerance).await
    }

    /// [`Evaluator::evaluate`] on behalf of `requester` (an episode id, an API caller): build
    /// slots go round robin over requesters, so one cannot starve the others.
    pub async fn evaluate_for(
        &self,
        requester: &str,
        task: &Task,
        files: &BTreeMap<String, String>,
        tolerance: Option<f64>,
    ) -> Result<EvaluationResult, EvalError> {
        if let kernelbench::TaskKind::Recall { file, value, .. } = &task.kind {
            check_size(files)?;
            self.finished.fetch_add(1, Ordering::Relaxed);
            return Ok(crate::reward::judge_recall(&task.id, file, value, files));
        }
        Self::check_files(files)?;
        let waiting = self.waiting.fetch_add(1, Ordering::SeqCst);
        let _guard = Decrement(&self.waiting);
        if waiting >= self.cfg.max_queue {
            return Err(EvalError::QueueFull(waiting));
        }
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = self.cfg.data_dir.join("evals").join(&id);
        // Removed however the evaluation ends: here once it has, or by the guard when it is
        // cancelled (its client hung up).
        let mut remove = RemoveOnDrop(Some(dir.clone()));
        let result = self
            .evaluate_in(&dir, requester, task, files, tolerance)
            .await;
        if let Some(gone) = remove.0.take() {
            let _ = tokio::task::spawn_blocking(move || remove_eval_dir(&gone)).await;
        }
        self.prune_build_cache().await;
        self.finished.fetch_add(1, Ordering::Relaxed);
        result
    }

    async fn evaluate_in(
        &self,
        dir: &Path,
        requester: &str,
        task: &Task,
        files: &BTreeMap<String, String>,
        tolerance: Option<f64>,
    ) -> Result<EvaluationResult, EvalError> {
        let started = Instant::now();
        // Two uids: the judge's and the candidate worker's. Neither can read or signal the
        // other's processes, and only the judge's can read the reference's outputs.
        let leases = self
            .sandbox
            .lease_uid_pair()
            .map_err(|source| EvalError::Sandbox {
                context: "no uids for the evaluation",
                source,
            })?;
        let (judge_owner, worker_owner) = match &leases {
            Some((j, w)) => (Some(j.owner()), Some(w.owner())),
            None => (None, None),
        };

        // Build: off the device, bounded, as the worker's uid. Extensions build into a
        // directory at a path fixed by the solution's hash, so that a cached build of the same
        // sources is up to date for ninja. Evaluations of one hash are serialised from here to
        // their end (and their volume's removal): the path is one evaluation's at a time.
        let digest = self.build_digest(files);
        let same_sources = self.build_lock(&digest).lock_owned().await;
        // Everything the candidate writes, in its build and its run, is on this volume.
        let volume = self
            .volumes
            .take(&digest, same_sources, worker_owner)
            .await?;
        let layout =
            EvalDirs::lay_out(dir, &volume.dirs, task, files, judge_owner, worker_owner).await?;
        let ext = volume.dirs.ext.clone();
        let entry = self.cfg.data_dir.join("build-cache").join(&digest);
        let built_mark = self.cfg.data_dir.join("build-ok").join(&digest);
        let worker_jail = self.worker_jail(&layout, &volume, worker_owner);
        let mut phases = EvaluationPhases {
            setup_s: started.elapsed().as_secs_f64(),
            ..EvaluationPhases::default()
        };
        let (build, cache_hit) = self
            .build_once(
                requester,
                &worker_jail,
                &layout,
                &ext,
                &entry,
                &built_mark,
                worker_owner,
                &mut phases,
            )
            .await?;
        let mut details = EvaluationDetails {
            task: task.id.clone(),
            device: Some(self.cfg.device.as_str().into()),
            build_cache_hit: Some(cache_hit),
            build: Some(build.clone()),
            ..EvaluationDetails::default()
        };
        if !build.built {
            let reason = build
                .reason
                .clone()
                .unwrap_or_else(|| "compile: the build failed".into());
            details.phases = Some(phases);
            return Ok(crate::reward::failed(reason, details));
        }

        // Check and time: on a leased device, with seeds the agent never saw; the judge and
        // the candidate's worker in two sandboxes under two uids, talking over two FIFOs.
        let seeds: Vec<String> = (0..5)
            .map(|_| (random_u64() % 1_000_000_007).to_string())
            .collect();
        let seeds = seeds.join(",");
        let lease_asked = Instant::now();
        let (verdict, worker_log, lease, observed) = self
            .judge_run(
                &layout,
                &worker_jail,
                &volume,
                judge_owner,
                worker_owner,
                &seeds,
                tolerance,
                self.cfg.shared_cache_tasks.contains(&task.hash),
            )
            .await?;
        phases.lease_wait_s = (lease.leased_at - lease_asked).as_secs_f64();
        phases.judge_s = lease.leased_at.elapsed().as_secs_f64();
        phases.lease_held_s = lease.held_s;
        phases.lease_to_go_s = lease.to_go_s;
        phases.teardown_s = lease.teardown_s;
        drop(leases);
        details.elapsed_s = Some(started.elapsed().as_secs_f64());
        details.phases = Some(phases);
        details.confined = Some(self.sandbox.is_confined());
        details.worker_log = (!worker_log.is_empty()).then_some(worker_log);
        let result = self.decide(verdict, observed, details, &ext).await;
        drop(worker_jail);
        drop(volume);
        result
    }
}

struct Decrement<'a>(&'a AtomicUsize);

impl Drop for Decrement<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Rejects a solution over the size bound.
fn check_size(files: &BTreeMap<String, String>) -> Result<(), EvalError> {
    let total: usize = files.values().map(String::len).sum();
    if total > MAX_SOLUTION_BYTES {
        return Err(EvalError::BadSolution(format!(
            "solution is {total} bytes; the limit is {MAX_SOLUTION_BYTES}"
        )));
    }
    Ok(())
}

/// 64 random bits from the kernel.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into b.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
    u64::from_le_bytes(b)
}
