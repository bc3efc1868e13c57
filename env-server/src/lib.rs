//! The cuda-agent environment server: gym-style episodes over HTTP, each a sandboxed
//! workspace in which an agent calls tools until it submits, then a final evaluation and a
//! milestone reward.
//!
//! - [`api`]: routes, errors, auth, metrics, OpenAPI ([`api::router`] builds the app).
//! - [`episode`]: the episode manager (workspaces, limits, idle expiry, recovery).
//! - [`evaluation`]: the evaluation queue, device leases, the harness runs.
//! - [`trajectory`]: the durable JSON Lines log.
//! - [`reward`]: the milestone reward.
//! - [`runtime`]: Python/torch/device discovery and the pristine harness.

pub mod api;
pub mod episode;
pub mod evaluation;
pub mod reward;
pub mod runtime;
pub mod trajectory;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agent_tools::{ResourceLimits, Sandbox, SandboxConfig, ToolLimits};
use kernelbench::TaskSet;
use serde_json::json;

pub use api::{router, AppState};

/// Everything the server is started with.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// State directory: trajectories, workspaces, caches, the harness.
    pub data_dir: PathBuf,
    /// `auto`, `cpu` or `cuda`.
    pub device: String,
    /// Task directory (a KernelBench checkout or a directory of task files); bundled if None.
    pub tasks_dir: Option<PathBuf>,
    /// Bearer token.
    pub api_key: Option<String>,
    /// Python interpreter with torch.
    pub python: PathBuf,
    /// Run even where landlock or seccomp is missing.
    pub allow_unconfined: bool,
    /// Most open episodes.
    pub max_episodes: usize,
    /// Builds at once.
    pub max_builds: usize,
    /// Most evaluations waiting.
    pub max_eval_queue: usize,
    /// Default turn limit.
    pub max_turns: u32,
    /// Default tool-time budget.
    pub time_budget: Duration,
    /// Idle episodes are truncated after this.
    pub idle_timeout: Duration,
    /// Per-phase evaluation time limit.
    pub eval_timeout: Duration,
    /// Workspace disk quota.
    pub disk_quota_bytes: u64,
    /// Resource limits of tool processes.
    pub limits: ResourceLimits,
    /// `small` selects the tasks' small (CPU-sized) inputs; None picks by device.
    pub task_size: Option<String>,
    /// Skip torch.compile baselines.
    pub skip_compile: bool,
    /// Aten operators candidates may dispatch beyond allocation, views and copies.
    pub allow_ops: Vec<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("data"),
            device: "auto".into(),
            tasks_dir: None,
            api_key: None,
            python: PathBuf::from("python3"),
            allow_unconfined: false,
            max_episodes: 4096,
            max_builds: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2),
            max_eval_queue: 1024,
            max_turns: 200,
            time_budget: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(1800),
            eval_timeout: Duration::from_secs(300),
            disk_quota_bytes: 1 << 30,
            limits: ResourceLimits::default(),
            task_size: None,
            skip_compile: false,
            allow_ops: Vec::new(),
            max_body_bytes: 8 << 20,
        }
    }
}

/// Errors at start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Python, torch or the device.
    #[error(transparent)]
    Runtime(#[from] runtime::RuntimeError),
    /// The sandbox.
    #[error(transparent)]
    Sandbox(#[from] agent_tools::SandboxError),
    /// Tasks.
    #[error(transparent)]
    Tasks(#[from] kernelbench::TaskError),
    /// Episode recovery.
    #[error(transparent)]
    Episodes(#[from] episode::EpisodeError),
    /// The data directory.
    #[error("data directory {0}: {1}")]
    DataDir(PathBuf, #[source] std::io::Error),
    /// Sandboxed processes (under their own uids) could not reach the data directory.
    #[error("data directory {data_dir} is unreachable for sandboxed processes: {blocker} is not searchable by other users (mode {mode:o}); choose a --data-dir whose parents are, or chmod o+x {blocker}")]
    Unreachable {
        /// The data directory.
        data_dir: PathBuf,
        /// The ancestor that blocks.
        blocker: PathBuf,
        /// Its mode.
        mode: u32,
    },
}

/// Probes the machine, installs the harness, recovers episodes and returns the app state.
pub fn build_state(cfg: ServerConfig) -> Result<Arc<AppState>, StartError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(&cfg.data_dir).map_err(|e| StartError::DataDir(cfg.data_dir.clone(), e))?;
    let data_dir = cfg.data_dir.canonicalize().map_err(|e| StartError::DataDir(cfg.data_dir.clone(), e))?;
    // Tool processes under their own uids must traverse (not list) the data dir to reach
    // their workspace.
    for sub in ["", "episodes", "evals"] {
        let d = data_dir.join(sub);
        std::fs::create_dir_all(&d).map_err(|e| StartError::DataDir(d.clone(), e))?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711)).map_err(|e| StartError::DataDir(d.clone(), e))?;
    }
    raise_open_file_limit();
    let python = runtime::PythonInfo::probe(&cfg.python)?;
    let device = runtime::Device::choose(&cfg.device, &python)?;
    let mut sandbox_cfg = SandboxConfig::with_toolchains(python.toolchain_dirs());
    sandbox_cfg.limits = cfg.limits.clone();
    sandbox_cfg.allow_unconfined = cfg.allow_unconfined;
    let sandbox = Sandbox::new(sandbox_cfg)?;
    let status = sandbox.status();
    if !status.confined {
        tracing::warn!(?status, "running UNCONFINED: results are marked unconfined");
    }
    if status.uid_isolation {
        check_reachable(&data_dir)?;
    }
    let harness_dir = data_dir.join("harness");
    runtime::install_harness(&harness_dir)?;
    let tasks = Arc::new(match &cfg.tasks_dir {
        Some(d) => TaskSet::load_dir(d)?,
        None => TaskSet::bundled(),
    }
    .with_tiny_family());
    let task_size = cfg.task_size.clone().unwrap_or_else(|| if device == runtime::Device::Cpu { "small".into() } else { "full".into() });
    let extra_env = vec![("CUDA_AGENT_TASK_SIZE".to_string(), task_size.clone())];
    let gpus = if device == runtime::Device::Cuda { python.gpus } else { 0 };
    let evaluator = Arc::new(evaluation::Evaluator::new(
        evaluation::EvaluatorConfig {
            data_dir: data_dir.clone(),
            device,
            devices: gpus.max(1),
            max_builds: cfg.max_builds,
            max_queue: cfg.max_eval_queue,
            phase_timeout: cfg.eval_timeout,
            extra_env: extra_env.clone(),
            skip_compile: cfg.skip_compile,
            allow_ops: cfg.allow_ops.clone(),
        },
        sandbox.clone(),
        python.clone(),
        harness_dir.clone(),
    ));
    let tool_limits = ToolLimits::default();
    let episodes = episode::EpisodeManager::new(
        episode::EpisodeConfig {
            data_dir: data_dir.clone(),
            max_turns: cfg.max_turns,
            time_budget: cfg.time_budget,
            max_episodes: cfg.max_episodes,
            disk_quota_bytes: cfg.disk_quota_bytes,
            idle_timeout: cfg.idle_timeout,
            tool_limits,
            extra_env,
            gpus,
        },
        tasks.clone(),
        sandbox.clone(),
        python.clone(),
        harness_dir,
        evaluator.clone(),
    );
    let recovered = episodes.recover()?;
    tracing::info!(recovered, tasks = tasks.len(), device = device.as_str(), "server state ready");
    let info = json!({
        "name": "cuda-agent env-server",
        "version": env!("CARGO_PKG_VERSION"),
        "api": "v1",
        "device": device.as_str(),
        "gpus": python.gpu_names,
        "torch": python.torch,
        "torch_cuda": python.torch_cuda,
        "task_size": task_size,
        "tasks": tasks.len(),
        "capacity": {"max_episodes": cfg.max_episodes, "max_builds": cfg.max_builds, "max_eval_queue": cfg.max_eval_queue, "device_slots": gpus.max(1)},
        "sandbox": status,
        "auth": cfg.api_key.is_some(),
    });
    Ok(Arc::new(AppState { episodes, evaluator, api_key: cfg.api_key, info, max_body_bytes: cfg.max_body_bytes }))
}

/// Expires idle episodes every 30 s, for as long as the state lives.
pub fn spawn_janitor(state: Arc<AppState>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(30));
        loop {
            tick.tick().await;
            let n = state.episodes.expire_idle().await;
            if n > 0 {
                tracing::info!(expired = n, "idle episodes truncated");
            }
        }
    });
}

/// Each open episode keeps its trajectory log open: lift the soft descriptor limit to the hard one.
fn raise_open_file_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Tool processes run under their own uids, so every ancestor of the data directory must be
/// searchable by others (they still cannot list it: 0711 is enough).
fn check_reachable(data_dir: &std::path::Path) -> Result<(), StartError> {
    use std::os::unix::fs::PermissionsExt;
    for dir in data_dir.ancestors().skip(1) {
        let mode = std::fs::metadata(dir).map(|m| m.permissions().mode()).unwrap_or(0o755);
        if mode & 0o001 == 0 {
            return Err(StartError::Unreachable { data_dir: data_dir.to_path_buf(), blocker: dir.to_path_buf(), mode: mode & 0o7777 });
        }
    }
    Ok(())
}
