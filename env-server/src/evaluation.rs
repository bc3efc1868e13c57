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

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_tools::sandbox::{CpuPriority, Outcome, ProcessView, SandboxedChild};
use agent_tools::{create_private_dir, Jail, Sandbox};
use env_api::{
    BuildDetails, EvaluationDetails, EvaluationPhases, EvaluationResult, Speedups, Times,
};
use kernelbench::Task;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

use crate::build::BuildQueue;
use crate::reward::milestone;
use crate::runtime::{Device, PythonInfo};

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
    #[error("evaluation harness failed: {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The sandbox refused (no uids, no ruleset).
    #[error("evaluation harness failed: {context}: {source}")]
    Sandbox {
        /// What was being done.
        context: &'static str,
        /// The error.
        #[source]
        source: agent_tools::SandboxError,
    },
    /// A process could not be started.
    #[error("evaluation harness failed: spawn {what}: {source}")]
    Spawn {
        /// Which process.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Blocking work on the runtime's pool panicked or was cancelled.
    #[error("evaluation harness failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    /// A device lease could not be taken (the evaluator is shutting down).
    #[error("evaluation harness failed: device lease: {0}")]
    Lease(#[from] tokio::sync::AcquireError),
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
    /// Most bytes one build-cache entry may hold, after the build and after the run; an entry
    /// over it fails its evaluation (`build_size`) and is removed.
    pub build_cache_entry_max_bytes: u64,
}

/// Evaluations per device whose judge and workers are alive at once with `prestart`, unless
/// configured: the one holding the lease and five starting or at their gates. A device keeps
/// busy while depth >= 1 + start / lease: a judge's side took 11-23 s to start on an H100
/// host (PyTorch imported in three processes, several judges starting at once) against a
/// 5 s lease with torch.compile on; with four, the device sat idle between waves of judges
/// (458 evaluations an hour where the lease allows about 700).
pub const DEFAULT_PRESTART_DEPTH: usize = 6;

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
    fn new(index: usize, prestart_depth: usize) -> Self {
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
    /// Held while the build cache is pruned (one pass at a time).
    pruning: Arc<Mutex<()>>,
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
        Self {
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
        if let kernelbench::TaskKind::Recall { file, value } = &task.kind {
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
        let layout = {
            let (dir, source, files) = (dir.to_path_buf(), task.source.clone(), files.clone());
            // Directory set-up is blocking file work: off the async workers.
            tokio::task::spawn_blocking(move || {
                EvalDirs::create(&dir, &source, &files, judge_owner, worker_owner)
                    .map_err(|e| io_err(&dir, e))
            })
            .await??
        };

        // Build: off the device, bounded, as the worker's uid. Extensions build into a
        // directory keyed by the solution's hash, the same path every time, so a rebuild of
        // the same sources is a no-op for ninja. Evaluations of one hash are serialised from
        // here to their end: the entry belongs to one evaluation's worker uid at a time (torch
        // takes a lock file in it on every load, so a second uid taking it over mid-evaluation
        // fails the first's load; and a build killed at its time limit leaves that lock stale).
        let digest = self.build_digest(files);
        let digest_lock = self.build_lock(&digest);
        let _same_sources = digest_lock.lock().await;
        let ext = self.cfg.data_dir.join("build-cache").join(&digest);
        let built_mark = self.cfg.data_dir.join("build-ok").join(&digest);
        let worker_jail = self.worker_jail(&layout, &ext, worker_owner);
        let mut phases = EvaluationPhases {
            setup_s: started.elapsed().as_secs_f64(),
            ..EvaluationPhases::default()
        };
        let (build, cache_hit) = {
            prepare_build_dir(&ext, worker_owner).map_err(|e| io_err(&ext, e))?;
            // Least recently used entries are pruned first (retention.rs).
            let _ = crate::retention::touch(&ext);
            match read_built_mark(&built_mark, &ext) {
                // These exact sources built before: the worker loads what is there (and
                // torch rebuilds it there, under the lease, if it was changed since).
                Some(report) => (report, true),
                None => {
                    let t = Instant::now();
                    let _permit = self.builds.acquire(requester).await;
                    phases.build_queue_s = t.elapsed().as_secs_f64();
                    let t = Instant::now();
                    let mut report = self.build(&worker_jail, &layout).await?;
                    phases.build_s = t.elapsed().as_secs_f64();
                    if let Some(reason) = self.entry_over_cap(&ext, &built_mark, "build").await {
                        report = build_failed(reason);
                    }
                    if report.built {
                        write_built_mark(&built_mark, &report);
                    }
                    (report, false)
                }
            }
        };
        let mut details = EvaluationDetails {
            task: task.id.clone(),
            device: Some(self.cfg.device.as_str().into()),
            build_cache_hit: Some(cache_hit),
            build: Some(build.clone()),
            ..EvaluationDetails::default()
        };
        let fail = crate::reward::failed;
        if !build.built {
            let reason = build
                .reason
                .clone()
                .unwrap_or_else(|| "compile: the build failed".into());
            details.phases = Some(phases);
            return Ok(fail(reason, details));
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
        if verdict.rule.as_deref() == Some("harness_error") {
            return Err(EvalError::Harness(verdict.reason.unwrap_or_default()));
        }
        details.check = verdict.details.clone();
        details.timing = verdict.timing.clone();
        details.noise_band = verdict.noise_band.clone();
        details.env = verdict.env.clone();
        // The worker may write into its entry too (at import, in the run).
        if let Some(reason) = self.entry_over_cap(&ext, &built_mark, "run").await {
            details.rule = Some("build_size".into());
            return Ok(fail(reason, details));
        }
        if !verdict.correct {
            details.rule = verdict.rule.clone();
            let reason = verdict.reason.unwrap_or_else(|| "evaluation failed".into());
            return Ok(fail(reason, details));
        }
        if let Some(observed) = observed {
            let (summary, broken) = observed.judge(
                verdict.run_windows.as_ref(),
                !self.cfg.allow_ops.is_empty() || !verdict.allowed_ops.is_empty(),
                self.cfg.device,
            );
            details.observed = Some(summary);
            if let Some(reason) = broken {
                details.rule = Some("pytorch_compute".into());
                return Ok(fail(format!("pytorch_compute: {reason}"), details));
            }
        }
        let times = verdict.times_ms.unwrap_or_default();
        let ratio = |b: Option<f64>| match (b, times.candidate) {
            (Some(b), Some(t)) if t > 0.0 => Some(b / t),
            _ => None,
        };
        Ok(EvaluationResult {
            reward: milestone(true, times.candidate, times.eager, times.compile),
            correct: true,
            reason: None,
            times_ms: Times {
                eager: times.eager,
                compile: times.compile,
                candidate: times.candidate,
            },
            speedup: Speedups {
                eager: ratio(times.eager),
                compile: ratio(times.compile),
            },
            details,
        })
    }

    /// The candidate worker's jail: its sources, its temp dir, the build cache entry, its
    /// output directory and the reply FIFO; the task and the harness read-only.
    fn worker_jail(&self, d: &EvalDirs, ext: &Path, owner: Option<(u32, u32)>) -> Jail {
        let mut j = Jail::standard(
            &d.candidate,
            &d.tmp,
            &self.python.path_dirs(),
            &self.cfg.extra_env,
            owner,
        );
        j.writable = vec![
            d.candidate.clone(),
            d.tmp.clone(),
            ext.to_path_buf(),
            d.out.clone(),
            d.rep.clone(),
        ];
        j.read_only
            .extend([d.root.clone(), self.harness_dir.clone()]);
        // The judge finds the worker's processes by uid in the host's process table; the
        // worker sees only its own.
        j.process_view = ProcessView::OwnUid;
        j.cuda = self.cfg.device == Device::Cuda;
        j.env.push(("TORCH_EXTENSIONS_DIR".into(), ext.into()));
        j.env.push(("OMP_WAIT_POLICY".into(), "PASSIVE".into()));
        j
    }

    async fn build(&self, jail: &Jail, d: &EvalDirs) -> Result<BuildDetails, EvalError> {
        let argv: Vec<OsString> = vec![
            self.harness_dir.join("cuda_agent_worker.py").into(),
            "build".into(),
            "--task".into(),
            d.task.clone().into(),
            "--candidate".into(),
            d.candidate.clone().into(),
            "--device".into(),
            self.cfg.device.as_str().into(),
        ];
        let mut jail = jail.clone();
        // A build only has to end in time; the judge holding the device must not wait on it.
        jail.cpu = CpuPriority::Background;
        // nvcc needs no GPU, so a build keeps /proc read-only (and its autogroup with it).
        jail.cuda = false;
        jail.env.push((
            "MAX_JOBS".into(),
            self.cfg.build_jobs.max(1).to_string().into(),
        ));
        if self.cfg.device == Device::Cuda {
            // nvcc needs no GPU; none is visible to a build (TORCH_CUDA_ARCH_LIST, from the
            // server's probe, says what to compile for).
            jail.env.push(("CUDA_VISIBLE_DEVICES".into(), "".into()));
        }
        let (out, err, outcome) = self.run_sandboxed(&jail, &argv, &d.candidate).await?;
        if outcome.timed_out {
            return Ok(build_failed(format!(
                "time_limit: the build ran past {} s",
                self.cfg.phase_timeout.as_secs()
            )));
        }
        // The build's own report can only claim a failure (which counts against it) or a
        // success that the run phase checks again: it decides nothing else.
        let text = String::from_utf8_lossy(&out);
        Ok(text
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<BuildDetails>(l).ok())
            .unwrap_or_else(|| {
                build_failed(format!(
                    "compile: the build process died ({}): {}",
                    describe_exit(&outcome),
                    tail(&err, 2000)
                ))
            }))
    }

    /// The check-and-time run: the verdict, the tail of the worker's output, and when the
    /// device lease was granted (the lease is held from then until the worker is killed).
    #[allow(clippy::too_many_arguments)]
    async fn judge_run(
        &self,
        d: &EvalDirs,
        worker_jail: &Jail,
        judge_owner: Option<(u32, u32)>,
        worker_owner: Option<(u32, u32)>,
        seeds: &str,
        tolerance: Option<f64>,
        shared_compile_cache: bool,
    ) -> Result<(Verdict, String, LeaseTimes, Option<Observed>), EvalError> {
        // Without prestart the lease comes first (nothing of this evaluation runs beside
        // another's timing); with it, a place among the device's warm evaluations.
        let (slot, mut lease, _warm, _pending) = if self.cfg.prestart {
            let slot = self.pick_slot();
            // Pending from before its place among the warm evaluations: waiting for one is
            // the starvation a deeper prestart removes.
            let pending = Pending::new(slot);
            let warm = slot.warm.acquire().await?;
            (slot, None, Some(warm), Some(pending))
        } else {
            let lease = self.lease_any().await?;
            (lease.slot, Some(lease), None, None)
        };
        let slot_index = slot.index;
        let visible = slot_index.to_string();
        let mut worker_jail = worker_jail.clone();
        let mut judge_jail = Jail::standard(
            &d.judge,
            &d.judge,
            &self.python.path_dirs(),
            &self.cfg.extra_env,
            judge_owner,
        );
        judge_jail.cuda = self.cfg.device == Device::Cuda;
        // torch.compile's caches persist across evaluations, so the compile baseline's
        // compilation is paid once per task and device. One directory per device slot, only
        // judges (never a worker) can write it, and it belongs to the judge that holds the
        // slot's lease: handed over when the lease is granted, not when the judge starts. With
        // prestart several judges wait at their gates at once, and a hand-over at start gave
        // the directory to the last one started while another timed: that one's torch.compile
        // could not write its cache (the evaluation failed with a harness error).
        // A task that came with the request is code of the caller's: what its torch.compile
        // leaves (or what the task's own code writes there) must not reach the judges after
        // it, so its cache is in its judge's directory, removed with the evaluation.
        let (compile_cache, cache_parts) = if shared_compile_cache {
            let dir = self
                .cfg
                .data_dir
                .join("judge-cache")
                .join(format!("slot{slot_index}"));
            let parts = compile_cache_parts(&dir).map_err(|e| io_err(&dir, e))?;
            (dir, parts.to_vec())
        } else {
            (d.judge.join("compile-cache"), Vec::new())
        };
        judge_jail.env.push((
            "TORCHINDUCTOR_CACHE_DIR".into(),
            compile_cache.join("inductor").into(),
        ));
        judge_jail.env.push((
            "TRITON_CACHE_DIR".into(),
            compile_cache.join("triton").into(),
        ));
        judge_jail.writable = vec![d.judge.clone(), d.inputs.clone(), d.req.clone()];
        if shared_compile_cache {
            judge_jail.writable.push(compile_cache.clone());
        }
        judge_jail
            .read_only
            .extend([d.root.clone(), self.harness_dir.clone()]);
        judge_jail.process_view = ProcessView::Host;
        judge_jail
            .env
            .push(("OMP_WAIT_POLICY".into(), "PASSIVE".into()));
        if self.cfg.device == Device::Cuda {
            worker_jail
                .env
                .push(("CUDA_VISIBLE_DEVICES".into(), visible.clone().into()));
            judge_jail
                .env
                .push(("CUDA_VISIBLE_DEVICES".into(), visible.into()));
        }
        let device = self.cfg.device.as_str();
        let mut wargv: Vec<OsString> = vec![self.harness_dir.join("cuda_agent_worker.py").into()];
        wargv.extend(["serve", "--role", "candidate", "--device", device].map(OsString::from));
        wargv.extend([
            "--task".into(),
            d.task.clone().into(),
            "--candidate".into(),
            d.candidate.clone().into(),
        ]);
        wargv.extend([
            "--req".into(),
            d.req.clone().into(),
            "--rep".into(),
            d.rep.clone().into(),
            "--out-dir".into(),
            d.out.clone().into(),
        ]);
        if !self.cfg.allow_ops.is_empty() {
            wargv.extend(["--allow-ops".into(), self.cfg.allow_ops.join(",").into()]);
        }
        let mut worker =
            self.spawn_jailed(&worker_jail, &wargv, &d.candidate, "the worker", false)?;
        let worker_pid = worker.id().unwrap_or(0);
        // The worker's prints go nowhere the verdict is read from: drained (so it never blocks
        // on a full pipe) and kept as a capped tail for the diagnostics.
        let wout = drain(worker.stdout.take(), 64 << 10);
        let werr = drain(worker.stderr.take(), 64 << 10);

        let mut jargv: Vec<OsString> = vec![
            self.harness_dir.join("evaluate.py").into(),
            "candidate".into(),
        ];
        jargv.extend([
            "--task".into(),
            d.task.clone().into(),
            "--candidate".into(),
            d.source.clone().into(),
            "--device".into(),
            device.into(),
        ]);
        jargv.extend([
            "--seeds".into(),
            seeds.into(),
            "--workdir".into(),
            d.judge.clone().into(),
            "--inputs-dir".into(),
            d.inputs.clone().into(),
        ]);
        jargv.extend([
            "--worker-req".into(),
            d.req.clone().into(),
            "--worker-rep".into(),
            d.rep.clone().into(),
            "--worker-out".into(),
            d.out.clone().into(),
        ]);
        jargv.extend(["--worker-pid".into(), worker_pid.to_string().into()]);
        if let Some((uid, _)) = worker_owner {
            jargv.extend(["--worker-uid".into(), uid.to_string().into()]);
        }
        let secs = self.cfg.phase_timeout.as_secs_f64();
        jargv.extend([
            "--setup-timeout".into(),
            format!("{secs}").into(),
            "--call-timeout".into(),
            format!("{}", secs.min(120.0)).into(),
        ]);
        if let Some(t) = tolerance {
            jargv.extend([
                "--atol".into(),
                t.to_string().into(),
                "--rtol".into(),
                t.to_string().into(),
            ]);
        }
        if self.cfg.skip_compile {
            jargv.push("--no-compile".into());
        }
        // The judge starts its side (workers, channels) and waits at the gate for the lease.
        jargv.push("--gate".into());
        let observe = self.cfg.observe;
        let judged = async {
            let deadline = Instant::now() + self.cfg.phase_timeout;
            let mut child = self.spawn_jailed(&judge_jail, &jargv, &d.judge, "the judge", true)?;
            let (at_gate_tx, at_gate) = tokio::sync::oneshot::channel();
            let out = drain_watching(child.stdout.take(), 8 << 20, Some(at_gate_tx));
            let err = drain(child.stderr.take(), 1 << 20);
            let mut gate = child.stdin.take();
            let lease = match lease.take() {
                // Without prestart: taken before anything of this evaluation started.
                Some(l) => Some(l),
                // With it, taken once the judge waits at its gate: a judge still importing
                // never holds the device, and one that ended before its gate (a verdict such
                // as a forbidden source) or never got there in time needs none.
                None => match tokio::time::timeout(self.cfg.phase_timeout, at_gate).await {
                    Ok(Ok(())) => Some(Self::lease(slot).await?),
                    Ok(Err(_)) | Err(_) => None,
                },
            };
            let leased_at = Instant::now();
            if lease.is_some() {
                let parts = cache_parts.clone();
                tokio::task::spawn_blocking(move || {
                    parts
                        .iter()
                        .try_for_each(|p| hand_over(p, judge_owner).map_err(|e| io_err(p, e)))
                })
                .await??;
            }
            // On the CPU the workers' forwards are observed from outside from here on: both
            // trees are quiet at the gate (imports done, nothing of the candidate's loaded).
            let observers = if observe && lease.is_some() {
                let judge_pid = child.id().unwrap_or(0);
                Some(
                    tokio::task::spawn_blocking(move || {
                        use crate::observe::{Observer, Tree};
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
                        .map_err(|e| e.to_string())
                    })
                    .await
                    .map_err(|e| EvalError::Harness(format!("observer: {e}")))?,
                )
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
            Ok::<_, EvalError>((
                out.await.unwrap_or_default(),
                err.await.unwrap_or_default(),
                outcome,
                times,
                lease,
                observers,
            ))
        }
        .await;
        // Whatever the judge decided, the worker and everything it started end here, before
        // the device goes to the next evaluation.
        let judge_ended = Instant::now();
        let _ = worker.kill_all().await;
        let log = {
            let mut log = wout.await.unwrap_or_default();
            log.extend(werr.await.unwrap_or_default());
            tail(&log, 2000)
        };
        let (out, err, outcome, mut times, lease, observers) = judged?;
        if lease.is_some() {
            times.teardown_s = judge_ended.elapsed().as_secs_f64();
            times.held_s = times.leased_at.elapsed().as_secs_f64();
        }
        drop(lease);
        // Resolving the samples is the server's own work: after the device is the next
        // evaluation's (the judge has ended; later samples fall outside its windows).
        let observed = match observers {
            Some(observer) => Some(
                tokio::task::spawn_blocking(move || {
                    let mut trees = observer.map(crate::observe::Observer::finish);
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
            ),
            None => None,
        };
        if outcome.timed_out {
            let v = Verdict::failed(
                "time_limit",
                format!("time_limit: the evaluation ran past {secs} s"),
            );
            return Ok((v, log, times, None));
        }
        // The judge is trusted code in its own sandbox; the worker cannot reach its stdout.
        let text = String::from_utf8_lossy(&out);
        match text
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<Verdict>(l).ok())
        {
            Some(v) => Ok((v, log, times, observed)),
            None => Err(EvalError::Harness(format!(
                "the judge gave no verdict ({}): {}",
                describe_exit(&outcome),
                tail(&err, 2000)
            ))),
        }
    }

    /// Runs one sandboxed process to its end or the phase time limit; returns its stdout,
    /// stderr (both capped) and how it ended.
    async fn run_sandboxed(
        &self,
        jail: &Jail,
        argv: &[OsString],
        cwd: &Path,
    ) -> Result<(Vec<u8>, Vec<u8>, Outcome), EvalError> {
        let mut child = self.spawn_jailed(jail, argv, cwd, "python", false)?;
        let out = drain(child.stdout.take(), 8 << 20);
        let err = drain(child.stderr.take(), 1 << 20);
        let outcome = child.wait_within(self.cfg.phase_timeout).await;
        Ok((
            out.await.unwrap_or_default(),
            err.await.unwrap_or_default(),
            outcome,
        ))
    }

    /// Starts the harness's Python in `jail`; `stdin` gives it a pipe (the judge's gate)
    /// instead of nothing.
    fn spawn_jailed(
        &self,
        jail: &Jail,
        argv: &[OsString],
        cwd: &Path,
        what: &'static str,
        stdin: bool,
    ) -> Result<SandboxedChild, EvalError> {
        let mut sc = self
            .sandbox
            .command(jail, &self.python.executable, argv, cwd)
            .map_err(|source| EvalError::Sandbox {
                context: what,
                source,
            })?;
        if stdin {
            sc.cmd.stdin(std::process::Stdio::piped());
        }
        sc.spawn()
            .map_err(|source| EvalError::Spawn { what, source })
    }

    /// When the build-cache entry `ext` holds more than its cap: the entry and its record of
    /// a finished build are removed, and the reason is returned.
    async fn entry_over_cap(&self, ext: &Path, mark: &Path, when: &str) -> Option<String> {
        let cap = self.cfg.build_cache_entry_max_bytes;
        let (ext, mark) = (ext.to_path_buf(), mark.to_path_buf());
        let over = tokio::task::spawn_blocking(move || {
            let bytes = crate::retention::tree_bytes(&ext, cap);
            if bytes <= cap {
                return false;
            }
            for p in [&ext, &mark] {
                if let Err(e) = crate::retention::remove_entry(p) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(path = %p.display(), error = %e, "removing a build-cache entry over its cap");
                    }
                }
            }
            true
        })
        .await
        .unwrap_or(false);
        over.then(|| {
            format!("build_size: the build directory holds more than {cap} bytes after the {when}")
        })
    }

    /// Brings the build cache back under its bound, least recently used entries first,
    /// sparing those of evaluations in flight (their hash's lock is held). One pass at a time;
    /// a pass waits for the one before, so the bound holds once a burst is over.
    async fn prune_build_cache(&self) {
        let in_use: std::collections::HashSet<String> = self
            .build_locks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, l)| Arc::strong_count(l) > 1)
            .map(|(d, _)| d.clone())
            .collect();
        let (dir, max, pruning) = (
            self.cfg.data_dir.join("build-cache"),
            self.cfg.build_cache_max_bytes,
            self.pruning.clone(),
        );
        let _ = tokio::task::spawn_blocking(move || {
            let _one = pruning.lock().unwrap_or_else(|e| e.into_inner());
            let removed = crate::retention::prune_build_cache_sparing(&dir, max, |entry, _| {
                entry
                    .file_name()
                    .is_some_and(|n| in_use.contains(&*n.to_string_lossy()))
            });
            if removed.entries > 0 {
                tracing::debug!(
                    entries = removed.entries,
                    bytes = removed.bytes,
                    "build cache pruned to its bound"
                );
            }
        })
        .await;
    }

    fn build_lock(&self, digest: &str) -> std::sync::Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.build_locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.retain(|_, l| std::sync::Arc::strong_count(l) > 1);
        locks.entry(digest.to_string()).or_default().clone()
    }

    fn build_digest(&self, files: &BTreeMap<String, String>) -> String {
        crate::build::build_key(&self.python.torch, self.cfg.device, files)
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
    async fn lease(slot: &DeviceSlot) -> Result<Lease<'_>, EvalError> {
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
struct Lease<'a> {
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

/// The report of an earlier successful build of the same sources, if its cache entry is
/// still there. The mark is the server's own file, in a directory no sandbox can write.
fn read_built_mark(mark: &Path, ext: &Path) -> Option<BuildDetails> {
    let text = std::fs::read(mark).ok()?;
    if !ext.is_dir() {
        let _ = std::fs::remove_file(mark);
        return None;
    }
    serde_json::from_slice::<BuildDetails>(&text)
        .ok()
        .filter(|r| r.built)
}

fn write_built_mark(mark: &Path, report: &BuildDetails) {
    let write = || -> std::io::Result<()> {
        if let Some(dir) = mark.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = mark.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(report).unwrap_or_default())?;
        std::fs::rename(&tmp, mark)
    };
    if let Err(e) = write() {
        tracing::warn!(path = %mark.display(), error = %e, "recording a finished build");
    }
}

/// A build that failed for `reason` (the worker's own report is its last JSON line, a
/// [`BuildDetails`]; it can only claim a failure or a success that the run checks again).
fn build_failed(reason: String) -> BuildDetails {
    BuildDetails {
        built: false,
        reason: Some(reason),
        ..BuildDetails::default()
    }
}

/// The judge's verdict (evaluate.py's one JSON line).
#[derive(Debug, Clone, Default, serde::Deserialize)]
struct Verdict {
    correct: bool,
    #[serde(default)]
    rule: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    times_ms: Option<VerdictTimes>,
    #[serde(default)]
    noise_band: BTreeMap<String, [f64; 2]>,
    #[serde(default)]
    timing: Option<Value>,
    #[serde(default)]
    details: Option<Value>,
    #[serde(default)]
    env: Option<Value>,
    #[serde(default)]
    run_windows: Option<RunWindows>,
    /// Aten operators the task itself allows (its `ALLOW_OPS`), as the judge read them.
    #[serde(default)]
    allowed_ops: Vec<String>,
}

/// When each worker ran a forward, in `CLOCK_MONOTONIC` nanoseconds (the judge's clock, and
/// the observer's).
#[derive(Debug, Clone, Default, serde::Deserialize)]
struct RunWindows {
    candidate: Vec<[u64; 2]>,
    reference: Vec<[u64; 2]>,
}

/// When the device lease of one evaluation was taken and how its time split.
#[derive(Debug, Clone, Copy)]
struct LeaseTimes {
    /// When the lease was granted (when the judge's gate was reached, without one).
    leased_at: Instant,
    /// Lease to the judge's go (about 0 without a lease).
    to_go_s: f64,
    /// The judge's end to the lease's release; 0 without a lease.
    teardown_s: f64,
    /// Lease to release; 0 without a lease.
    held_s: f64,
}

/// What the server recorded of the two trees' CPU from outside: the candidate worker's, and
/// the judge's with the reference worker in it.
struct Observed {
    candidate: Result<crate::observe::Recording, String>,
    reference: Result<crate::observe::Recording, String>,
}

impl Observed {
    /// The summary for the details and, where the candidate's forwards spent about as much of
    /// their time in PyTorch's compute library as the reference's did, why that breaks
    /// `pytorch_compute`.
    fn judge(
        &self,
        windows: Option<&RunWindows>,
        compute_allowed: bool,
        device: Device,
    ) -> (env_api::ObservedCompute, Option<String>) {
        use crate::observe::{pytorch_compute, Finding, KERNEL_TIME_RATIO};
        let mut s = env_api::ObservedCompute::default();
        let (cand, reference, windows) = match (&self.candidate, &self.reference, windows) {
            (Ok(c), Ok(r), Some(w)) => (c, r, w),
            (Err(e), _, _) | (_, Err(e), _) => {
                s.reason = Some(format!("not observed: {e}"));
                return (s, None);
            }
            (_, _, None) => {
                s.reason = Some("the judge reported no forwards".into());
                return (s, None);
            }
        };
        s.available = true;
        // One observation holds both trees: its count of lost records is theirs together.
        s.lost = cand.lost.max(reference.lost);
        let (c, r) = (
            cand.profile(&windows.candidate),
            reference.profile(&windows.reference),
        );
        let finding = pytorch_compute(&c, &r);
        s.candidate_forwards = c.forwards;
        s.reference_forwards = r.forwards;
        s.candidate_samples = c.samples;
        s.reference_samples = r.samples;
        s.candidate_torch_share = finding.candidate_share;
        s.reference_torch_share = finding.reference_share;
        s.candidate_kernel_share = finding.candidate_kernel_share;
        s.reference_kernel_share = finding.reference_kernel_share;
        s.kernel_time_ratio = finding.kernel_time_ratio;
        let top = |p: &crate::observe::Profile| {
            p.top(5)
                .into_iter()
                .map(|(library, share)| env_api::LibraryShare { library, share })
                .collect()
        };
        s.candidate_top = top(&c);
        s.reference_top = top(&r);
        // The lines the rule draws, shown wherever the rule is applied.
        s.kernel_time_threshold = Some(KERNEL_TIME_RATIO);
        s.library_threshold = Some(finding.library_threshold);
        let unjudged = |mut s: env_api::ObservedCompute, why: String| {
            s.kernel_time_threshold = None;
            s.library_threshold = None;
            s.reason = Some(why);
            (s, None)
        };
        match finding.outcome {
            // Operators the server (`--allow-ops`) or the task (its `ALLOW_OPS`) allows run
            // PyTorch's kernels by right.
            Finding::Broken if compute_allowed => unjudged(
                s,
                "the server (--allow-ops) or the task (ALLOW_OPS) allows PyTorch compute operators: reported, not judged"
                    .into(),
            ),
            // On a GPU the host's samples are launches and waits: what they say of who wrote
            // the kernels is measured, not yet believed.
            Finding::Broken | Finding::Clear if device == Device::Cuda => {
                s.reason = Some("on a GPU the observation is reported, not judged".into());
                (s, None)
            }
            // Rings overflow only under a flood of records (thousands of mappings in 50 ms;
            // an honest worker writes about one a millisecond), and what was lost may be the
            // very compute the rule looks for: a forward the server could not see is not paid.
            Finding::Inconclusive(_) | Finding::Clear | Finding::Broken
                if s.lost > 0 && !compute_allowed && device != Device::Cuda =>
            {
                let why = format!(
                    "the server's outside observation of the workers lost {} records (its ring buffers overflowed, as under a flood of memory mappings or processes): a forward it could not see is not paid",
                    s.lost
                );
                (s, Some(why))
            }
            Finding::Inconclusive(why) => unjudged(s, why),
            Finding::Clear => (s, None),
            Finding::Broken => {
                let why = format!(
                    "observed from outside the worker, the candidate's forwards spent {:.0}% as much CPU time per call in the code of the eager reference's own PyTorch kernels as the reference did ({:.0}% breaks the rule), and {:.0}% of their time in PyTorch's compute library libtorch_cpu.so (the reference {:.0}%; {:.0}% breaks it): the forward computes with PyTorch",
                    100.0 * finding.kernel_time_ratio,
                    100.0 * KERNEL_TIME_RATIO,
                    100.0 * finding.candidate_share,
                    100.0 * finding.reference_share,
                    100.0 * finding.library_threshold,
                );
                (s, Some(why))
            }
        }
    }
}

impl Verdict {
    fn failed(rule: &str, reason: String) -> Self {
        Self {
            correct: false,
            rule: Some(rule.into()),
            reason: Some(reason),
            ..Self::default()
        }
    }
}

/// Median times in the verdict.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
struct VerdictTimes {
    #[serde(default)]
    eager: Option<f64>,
    #[serde(default)]
    compile: Option<f64>,
    #[serde(default)]
    candidate: Option<f64>,
}

/// One evaluation's directory. The root, `task.py`, `source/` (the judge's copy of the
/// solution, for its static check) and `xfer/` belong to the server; `candidate/`, `tmp/` and
/// `xfer/out/` to the worker's uid; `judge/` and `xfer/in/` to the judge's. The two FIFOs are
/// each writable by one side and readable by the other.
struct EvalDirs {
    root: PathBuf,
    task: PathBuf,
    candidate: PathBuf,
    source: PathBuf,
    tmp: PathBuf,
    judge: PathBuf,
    inputs: PathBuf,
    out: PathBuf,
    req: PathBuf,
    rep: PathBuf,
}

impl EvalDirs {
    fn create(
        dir: &Path,
        task_source: &str,
        files: &BTreeMap<String, String>,
        judge: Option<(u32, u32)>,
        worker: Option<(u32, u32)>,
    ) -> std::io::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let d = Self {
            root: dir.to_path_buf(),
            task: dir.join("task.py"),
            candidate: dir.join("candidate"),
            source: dir.join("source"),
            tmp: dir.join("tmp"),
            judge: dir.join("judge"),
            inputs: dir.join("xfer/in"),
            out: dir.join("xfer/out"),
            req: dir.join("xfer/req"),
            rep: dir.join("xfer/rep"),
        };
        let mode =
            |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m));
        std::fs::create_dir_all(dir)?;
        mode(dir, 0o755)?;
        std::fs::create_dir_all(dir.join("xfer"))?;
        mode(&dir.join("xfer"), 0o755)?;
        for p in [&d.tmp, &d.candidate] {
            create_private_dir(p, worker)?;
        }
        create_private_dir(&d.judge, judge)?;
        // Readable by the other side: the judge reads the worker's outputs, the worker the
        // judge's inputs (each file inside says who may read it).
        create_private_dir(&d.inputs, judge)?;
        mode(&d.inputs, 0o755)?;
        create_private_dir(&d.out, worker)?;
        mode(&d.out, 0o755)?;
        std::fs::write(&d.task, task_source)?;
        mode(&d.task, 0o444)?;
        std::fs::create_dir_all(&d.source)?;
        for (name, text) in files {
            for (base, owner) in [(&d.candidate, worker), (&d.source, None)] {
                let p = base.join(name);
                if let Some(parent) = p.parent() {
                    std::fs::create_dir_all(parent)?;
                    chown(parent, owner);
                }
                std::fs::write(&p, text)?;
                chown(&p, owner);
            }
        }
        make_fifo(&d.req, judge, worker)?;
        make_fifo(&d.rep, worker, judge)?;
        Ok(d)
    }
}

/// A FIFO its `writer` may write and its `reader` read (group permission: each uid's group
/// is its own), or the server's own when uids cannot be switched.
fn make_fifo(
    path: &Path,
    writer: Option<(u32, u32)>,
    reader: Option<(u32, u32)>,
) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: c is a valid NUL-terminated path.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if let (Some((wu, _)), Some((_, rg))) = (writer, reader) {
        std::os::unix::fs::lchown(path, Some(wu), Some(rg))?;
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o640))?;
    }
    Ok(())
}

/// Reads a pipe to its end on a task of its own, keeping at most `cap` bytes.
fn drain<R>(pipe: Option<R>, cap: usize) -> tokio::task::JoinHandle<Vec<u8>>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    drain_watching(pipe, cap, None)
}

/// The line the judge prints on its stdout when it waits at its gate (`wait_for_go` in
/// `cuda_agent_judge.py`).
const JUDGE_AT_GATE: &[u8] = br#"{"gate": "waiting"}"#;

/// [`drain`], telling `at_gate` as soon as a whole line read is [`JUDGE_AT_GATE`] (the sender
/// is dropped unsent if the pipe ends first).
fn drain_watching<R>(
    pipe: Option<R>,
    cap: usize,
    mut at_gate: Option<tokio::sync::oneshot::Sender<()>>,
) -> tokio::task::JoinHandle<Vec<u8>>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut buf = Vec::new();
        let Some(mut p) = pipe else { return buf };
        // Whole lines before this offset were looked at already.
        let mut seen = 0;
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            let n = match p.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            // Past the cap, keep reading (and dropping) so the writer never blocks.
            buf.extend_from_slice(&chunk[..n.min(cap.saturating_sub(buf.len()))]);
            while at_gate.is_some() {
                let Some(end) = buf[seen..].iter().position(|&b| b == b'\n') else {
                    break;
                };
                let line = &buf[seen..seen + end];
                seen += end + 1;
                if line.trim_ascii() == JUDGE_AT_GATE {
                    let _ = at_gate.take().map(|tx| tx.send(()));
                }
            }
        }
        buf
    })
}

fn tail(bytes: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let chars: Vec<char> = text.chars().collect();
    chars[chars.len().saturating_sub(n)..].iter().collect()
}

fn describe_exit(o: &Outcome) -> String {
    use std::os::unix::process::ExitStatusExt;
    match o.status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exit status {c}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            _ => "ended".into(),
        },
        None => "did not end".into(),
    }
}

/// The compile cache of one device slot: the slot directory (root's, searchable by all, so
/// that a judge waiting at its gate can import torch.compile's modules, which only check that
/// their directory exists) and its `inductor` and `triton` parts, which are handed to the judge
/// holding the lease. A part that is not a plain directory (a link left by an older layout,
/// where judges owned the slot directory) is removed, never followed.
fn compile_cache_parts(slot_dir: &Path) -> std::io::Result<[PathBuf; 2]> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(slot_dir)?;
    // The server's own again (judges owned it in the older layout).
    // SAFETY: geteuid and getegid only read the calling process's ids.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    std::os::unix::fs::lchown(slot_dir, Some(uid), Some(gid))?;
    std::fs::set_permissions(slot_dir, std::fs::Permissions::from_mode(0o711))?;
    let parts = [slot_dir.join("inductor"), slot_dir.join("triton")];
    for p in &parts {
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => std::fs::remove_file(p)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::fs::create_dir(p)?;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(parts)
}

/// Gives a directory tree the judges share to this evaluation's judge uid (links are
/// changed, never followed; only judges ever write there).
fn hand_over(dir: &Path, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    if owner.is_some() {
        for e in walkdir::WalkDir::new(dir).follow_links(false) {
            chown(e.map_err(std::io::Error::other)?.path(), owner);
        }
    }
    Ok(())
}

/// A directory removed, on a blocking thread, when this is dropped still holding it (its
/// processes, dropped before it, are ended by then).
struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let Some(dir) = self.0.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || remove_eval_dir(&dir))),
            Err(_) => remove_eval_dir(&dir),
        }
    }
}

fn remove_eval_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(dir = %dir.display(), error = %e, "removing an evaluation directory");
        }
    }
}

struct Decrement<'a>(&'a AtomicUsize);

impl Drop for Decrement<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn chown(p: &Path, owner: Option<(u32, u32)>) {
    if let Some((u, g)) = owner {
        let _ = std::os::unix::fs::lchown(p, Some(u), Some(g));
    }
}

/// Makes a build directory usable by this evaluation's uid and drops lock files a killed
/// build left behind (the caller holds the per-hash lock, so none is live).
fn prepare_build_dir(dir: &Path, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    // Its evaluation's worker's alone: no other uid reads what another solution built.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    for e in walkdir::WalkDir::new(dir).follow_links(false) {
        let e = e.map_err(std::io::Error::other)?;
        if e.file_type().is_file() && e.file_name() == "lock" {
            std::fs::remove_file(e.path())?;
            continue;
        }
        chown(e.path(), owner);
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

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

    /// Attack: a judge of the older layout owned the slot directory and left `inductor` as a
    /// link to a directory of its choosing; the server must not chmod or chown through it.
    #[test]
    fn a_cache_part_that_is_a_link_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let slot = dir.path().join("judge-cache").join("slot0");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&slot).unwrap();
        std::fs::create_dir(&outside).unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink(&outside, slot.join("inductor")).unwrap();
        let parts = compile_cache_parts(&slot).unwrap();
        for p in &parts {
            let m = std::fs::symlink_metadata(p).unwrap();
            assert!(m.is_dir() && !m.file_type().is_symlink(), "{p:?}");
            hand_over(p, None).unwrap();
        }
        let mode = std::fs::metadata(&outside).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755, "the link's target was changed");
        // The slot directory stays searchable, so a judge at its gate can import
        // torch.compile's modules (they only check that their directory exists).
        let mode = std::fs::metadata(&slot).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o711);
    }
}
