//! The evaluation queue: final evaluations and `POST /v1/evaluate`.
//!
//! Each evaluation gets a fresh directory and a fresh sandbox with the server's pristine
//! harness. Builds run in parallel up to a bound and hold no device; timing runs hold an
//! exclusive lease on one device (one per GPU, one for the CPU), so no two timings share a
//! device. Eager/compile baselines are cached per (task hash, device, torch version).

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use agent_tools::{create_private_dir, Jail, Sandbox};
use env_api::{EvaluationResult, Speedups, Times};
use kernelbench::Task;
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::sync::Semaphore;

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
    /// The harness itself failed to run.
    #[error("evaluation harness failed: {0}")]
    Harness(String),
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
    /// Builds at once.
    pub max_builds: usize,
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
}

/// One device lease; `busy_ms` and `leases` feed `/metrics`.
#[derive(Debug)]
pub struct DeviceSlot {
    /// Index (GPU ordinal or 0 for the CPU).
    pub index: usize,
    lock: Semaphore,
    /// Leases granted.
    pub leases: AtomicU64,
    /// Milliseconds held.
    pub busy_ms: AtomicU64,
}

/// The evaluator shared by all episodes.
#[derive(Debug)]
pub struct Evaluator {
    cfg: EvaluatorConfig,
    sandbox: Sandbox,
    python: PythonInfo,
    harness_dir: PathBuf,
    builds: Semaphore,
    slots: Vec<DeviceSlot>,
    next_slot: AtomicUsize,
    waiting: AtomicUsize,
    baselines: Mutex<HashMap<String, Value>>,
    next_uid: AtomicU64,
    build_locks: Mutex<HashMap<String, std::sync::Arc<tokio::sync::Mutex<()>>>>,
    /// Evaluations finished.
    pub finished: AtomicU64,
}

fn io_err(p: &Path, e: std::io::Error) -> EvalError {
    EvalError::Harness(format!("{}: {e}", p.display()))
}

impl Evaluator {
    /// An evaluator over an installed harness.
    pub fn new(cfg: EvaluatorConfig, sandbox: Sandbox, python: PythonInfo, harness_dir: PathBuf) -> Self {
        let slots = (0..cfg.devices.max(1))
            .map(|index| DeviceSlot { index, lock: Semaphore::new(1), leases: AtomicU64::new(0), busy_ms: AtomicU64::new(0) })
            .collect();
        let baselines = std::fs::read_to_string(cfg.data_dir.join("cache/baselines.json"))
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or_default();
        Self {
            builds: Semaphore::new(cfg.max_builds.max(1)),
            cfg,
            sandbox,
            python,
            harness_dir,
            slots,
            next_slot: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            baselines: Mutex::new(baselines),
            next_uid: AtomicU64::new(0),
            build_locks: Mutex::new(HashMap::new()),
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
            return Err(EvalError::BadSolution("solution has no model_new.py".into()));
        }
        for name in files.keys() {
            let p = Path::new(name);
            let ok = !name.is_empty()
                && p.is_relative()
                && p.components().all(|c| matches!(c, std::path::Component::Normal(_)))
                && (name == "model_new.py" || name.starts_with("kernels/"));
            if !ok {
                return Err(EvalError::BadSolution(format!("bad solution path {name:?}: use model_new.py and kernels/...")));
            }
        }
        Ok(())
    }

    /// Evaluates `files` (model_new.py plus kernels/...) against `task`. A broken candidate
    /// is a result with reward -1, not an error.
    pub async fn evaluate(&self, task: &Task, files: &BTreeMap<String, String>, tolerance: Option<f64>) -> Result<EvaluationResult, EvalError> {
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
        let result = self.evaluate_in(&dir, task, files, tolerance).await;
        let _ = std::fs::remove_dir_all(&dir);
        self.finished.fetch_add(1, Ordering::Relaxed);
        result
    }

    async fn evaluate_in(&self, dir: &Path, task: &Task, files: &BTreeMap<String, String>, tolerance: Option<f64>) -> Result<EvaluationResult, EvalError> {
        let started = Instant::now();
        let owner = self.sandbox.can_switch_uid().then(|| {
            let uid = 150_000 + (self.next_uid.fetch_add(1, Ordering::Relaxed) % 50_000) as u32;
            (uid, uid)
        });
        // The evaluation dir and the reference task.py belong to the server (readable, not
        // writable, by the evaluation uid): a candidate runs as that uid and must not be able
        // to replace the reference it is judged against. Only candidate/ and tmp/ are its own.
        let tmp = dir.join("tmp");
        let cand = dir.join("candidate");
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).map_err(|e| io_err(dir, e))?;
        for d in [&tmp, &cand] {
            create_private_dir(d, owner).map_err(|e| io_err(d, e))?;
        }
        let task_path = dir.join("task.py");
        std::fs::write(&task_path, &task.source).map_err(|e| io_err(&task_path, e))?;
        std::fs::set_permissions(&task_path, std::os::unix::fs::PermissionsExt::from_mode(0o444)).map_err(|e| io_err(&task_path, e))?;
        for (name, text) in files {
            let p = cand.join(name);
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
                chown(parent, owner);
            }
            std::fs::write(&p, text).map_err(|e| io_err(&p, e))?;
            chown(&p, owner);
        }
        let jail = {
            let mut j = Jail::standard(&cand, &tmp, &self.python.path_dirs(), &self.cfg.extra_env, owner);
            j.writable = vec![cand.clone(), tmp.clone()];
            j.read_only.extend([dir.to_path_buf(), self.harness_dir.clone()]);
            j
        };

        let baseline = self.baseline(task, &jail, dir).await?;
        let eager = baseline.pointer("/eager/median_ms").and_then(Value::as_f64);
        let compile = baseline.pointer("/compile/median_ms").and_then(Value::as_f64);

        // Build: off the device, bounded. Extensions build into a directory keyed by the
        // solution's hash, the same path every time, so a rebuild of the same sources is a
        // no-op for ninja; builds of one hash are serialised (torch's own lock file would
        // otherwise be left stale by a build killed at its time limit).
        let digest = self.build_digest(files);
        let ext = self.cfg.data_dir.join("build-cache").join(&digest);
        let cache_hit = ext.is_dir();
        let jail = {
            let mut j = jail;
            j.writable.push(ext.clone());
            j.env.push(("TORCH_EXTENSIONS_DIR".into(), ext.clone().into()));
            j
        };
        let build = {
            let digest_lock = self.build_lock(&digest);
            let _same_sources = digest_lock.lock().await;
            let _permit = self.builds.acquire().await.map_err(|e| EvalError::Harness(e.to_string()))?;
            prepare_build_dir(&ext, owner).map_err(|e| io_err(&ext, e))?;
            self.run_harness(&jail, dir, &["candidate", "--phase", "build"], None).await?
        };
        let mut details = json!({"task": task.id, "device": self.cfg.device.as_str(), "baseline": baseline, "build_cache_hit": cache_hit});
        let fail = |reason: String, mut details: Value, extra: &Value| {
            if let Some(o) = extra.as_object() {
                for (k, v) in o {
                    details[k] = v.clone();
                }
            }
            EvaluationResult {
                reward: -1.0,
                correct: false,
                reason: Some(reason),
                times_ms: Times { eager, compile, candidate: None },
                speedup: Speedups::default(),
                details,
            }
        };
        if build.get("built").and_then(Value::as_bool) != Some(true) {
            let reason = build.get("reason").and_then(Value::as_str).unwrap_or("build failed").to_string();
            return Ok(fail(reason, details, &json!({})));
        }

        // Check and time: on a leased device, with seeds the agent never saw.
        let seeds: Vec<String> = (0..5).map(|_| (random_u64() % 1_000_000_007).to_string()).collect();
        let seeds = seeds.join(",");
        let mut args: Vec<String> = vec!["candidate".into(), "--phase".into(), "run".into(), "--seeds".into(), seeds];
        if let Some(t) = tolerance {
            args.extend(["--atol".into(), t.to_string(), "--rtol".into(), t.to_string()]);
        }
        if !self.cfg.allow_ops.is_empty() {
            args.extend(["--allow-ops".into(), self.cfg.allow_ops.join(",")]);
        }
        let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
        let run = self.with_lease(|slot| self.run_harness(&jail, dir, &args_ref, Some(slot))).await?;
        details["elapsed_s"] = json!(started.elapsed().as_secs_f64());
        details["confined"] = json!(self.sandbox.is_confined());
        if run.get("correct").and_then(Value::as_bool) != Some(true) {
            let reason = run.get("reason").and_then(Value::as_str).unwrap_or("evaluation failed").to_string();
            return Ok(fail(reason, details, &json!({"rule": run.get("rule")})));
        }
        let t = run.pointer("/candidate/median_ms").and_then(Value::as_f64);
        details["candidate"] = run.get("candidate").cloned().unwrap_or(Value::Null);
        details["check"] = run.get("details").cloned().unwrap_or(Value::Null);
        let ratio = |b: Option<f64>| match (b, t) {
            (Some(b), Some(t)) if t > 0.0 => Some(b / t),
            _ => None,
        };
        Ok(EvaluationResult {
            reward: milestone(true, t, eager, compile),
            correct: true,
            reason: None,
            times_ms: Times { eager, compile, candidate: t },
            speedup: Speedups { eager: ratio(eager), compile: ratio(compile) },
            details,
        })
    }

    fn build_lock(&self, digest: &str) -> std::sync::Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.build_locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.retain(|_, l| std::sync::Arc::strong_count(l) > 1);
        locks.entry(digest.to_string()).or_default().clone()
    }

    fn build_digest(&self, files: &BTreeMap<String, String>) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.python.torch.as_bytes());
        h.update(self.cfg.device.as_str().as_bytes());
        for (k, v) in files {
            h.update(k.as_bytes());
            h.update([0]);
            h.update(v.as_bytes());
            h.update([0]);
        }
        hex::encode(h.finalize())[..32].to_string()
    }

    async fn baseline(&self, task: &Task, jail: &Jail, dir: &Path) -> Result<Value, EvalError> {
        let key = format!("{}|{}|{}|{}", task.hash, self.cfg.device.as_str(), self.python.torch, self.cfg.skip_compile);
        if let Some(v) = self.baselines.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(v.clone());
        }
        let mut args = vec!["baseline"];
        if self.cfg.skip_compile {
            args.push("--no-compile");
        }
        let v = self.with_lease(|slot| self.run_harness(jail, dir, &args, Some(slot))).await?;
        if v.get("eager").is_none() {
            let reason = v.get("reason").and_then(Value::as_str).unwrap_or("no eager time");
            return Err(EvalError::Harness(format!("baseline of {}: {reason}", task.id)));
        }
        let mut cache = self.baselines.lock().unwrap_or_else(|e| e.into_inner());
        cache.insert(key, v.clone());
        let path = self.cfg.data_dir.join("cache/baselines.json");
        if let Some(parent) = path.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = std::fs::write(&path, serde_json::to_vec_pretty(&*cache).unwrap_or_default());
        Ok(v)
    }

    /// Runs `f` holding the least-recently-picked free device slot exclusively.
    async fn with_lease<F, Fut>(&self, f: F) -> Result<Value, EvalError>
    where
        F: FnOnce(usize) -> Fut,
        Fut: std::future::Future<Output = Result<Value, EvalError>>,
    {
        let n = self.slots.len();
        let start = self.next_slot.fetch_add(1, Ordering::Relaxed) % n;
        // Prefer a free slot; otherwise wait on the round-robin one.
        let mut chosen = None;
        for i in 0..n {
            let slot = &self.slots[(start + i) % n];
            if let Ok(p) = slot.lock.try_acquire() {
                chosen = Some((slot, p));
                break;
            }
        }
        let (slot, permit) = match chosen {
            Some(c) => c,
            None => {
                let slot = &self.slots[start];
                (slot, slot.lock.acquire().await.map_err(|e| EvalError::Harness(e.to_string()))?)
            }
        };
        let t0 = Instant::now();
        slot.leases.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(slot = slot.index, "device lease taken");
        let out = f(slot.index).await;
        slot.busy_ms.fetch_add(t0.elapsed().as_millis() as u64, Ordering::Relaxed);
        drop(permit);
        out
    }

    async fn run_harness(&self, jail: &Jail, dir: &Path, args: &[&str], slot: Option<usize>) -> Result<Value, EvalError> {
        let mut jail = jail.clone();
        if self.cfg.device == Device::Cuda {
            let visible = slot.map(|s| s.to_string()).unwrap_or_else(|| "0".into());
            jail.env.push(("CUDA_VISIBLE_DEVICES".into(), visible.into()));
        }
        let mut argv: Vec<OsString> = vec![self.harness_dir.join("evaluate.py").into()];
        argv.extend(args.iter().take(1).map(OsString::from));
        argv.extend(["--task".into(), dir.join("task.py").into(), "--device".into(), self.cfg.device.as_str().into()]);
        if args.first() == Some(&"candidate") {
            argv.extend(["--candidate".into(), dir.join("candidate").into()]);
        }
        argv.extend(args.iter().skip(1).map(OsString::from));
        let sc = self.sandbox.command(&jail, &self.python.executable, &argv, dir).map_err(|e| EvalError::Harness(e.to_string()))?;
        let mut child = sc.spawn().map_err(|e| EvalError::Harness(format!("spawn python: {e}")))?;
        let pid = child.id().map(|p| p as i32);
        let mut stdout = child.stdout.take();
        let mut stderr = child.stderr.take();
        let read_out = async {
            let mut buf = Vec::new();
            if let Some(s) = stdout.as_mut() {
                let _ = s.take(8 << 20).read_to_end(&mut buf).await;
            }
            buf
        };
        let read_err = async {
            let mut buf = Vec::new();
            if let Some(s) = stderr.as_mut() {
                let _ = s.take(1 << 20).read_to_end(&mut buf).await;
            }
            buf
        };
        let work = async { tokio::join!(read_out, read_err, child.wait()) };
        let outcome = tokio::time::timeout(self.cfg.phase_timeout, work).await;
        if let Some(sid) = pid {
            let unreaped = outcome.is_err();
            let _ = tokio::task::spawn_blocking(move || agent_tools::sandbox::kill_session(sid, unreaped)).await;
        }
        let Ok((out, err, _status)) = outcome else {
            let _ = child.wait().await;
            return Ok(json!({"correct": false, "rule": "time_limit", "reason": format!("time_limit: {} ran past {} s", args[0], self.cfg.phase_timeout.as_secs())}));
        };
        let text = String::from_utf8_lossy(&out);
        match text.lines().rev().find_map(|l| serde_json::from_str::<Value>(l).ok()) {
            Some(v) => Ok(v),
            None => {
                let err = String::from_utf8_lossy(&err);
                let tail: String = err.chars().rev().take(2000).collect::<Vec<_>>().into_iter().rev().collect();
                Ok(json!({"correct": false, "rule": "runtime_error", "reason": format!("runtime_error: the evaluation process died: {tail}")}))
            }
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
    std::fs::create_dir_all(dir)?;
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
        return Err(EvalError::BadSolution(format!("solution is {total} bytes; the limit is {MAX_SOLUTION_BYTES}")));
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
