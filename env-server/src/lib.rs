//! The cuda-agent environment server: gym-style episodes over HTTP, each a sandboxed
//! workspace in which an agent calls tools until it submits, then a final evaluation and a
//! milestone reward.
//!
//! - [`admission`]: what the host offers and the bounds derived from it.
//! - [`api`]: routes, errors, auth, metrics, OpenAPI ([`api::router`] builds the app).
//! - [`http`]: serving the app over TCP with connection, header, idle and write limits.
//! - [`mcp`]: the MCP front (`/mcp`): one MCP session per episode, the same tools and log.
//! - [`drain`]: draining before a stop (readiness false, new work refused, a grace period).
//! - [`episode`]: the episode manager (workspaces, limits, idle expiry, recovery).
//! - [`retention`]: what stays on disk (trajectory logs, the build cache, crash leftovers).
//! - [`evaluation`]: the evaluation queue, device leases, the harness runs.
//! - [`build`]: the fair build queue, the build toolchain (CUDA architectures, precompiled
//!   torch headers).
//! - [`trajectory`]: the durable JSON Lines log.
//! - [`reward`]: the milestone reward.
//! - [`runtime`]: Python/torch/device discovery and the pristine harness.

pub mod admission;
pub mod api;
pub mod build;
pub mod drain;
pub mod episode;
pub mod evaluation;
pub mod http;
pub mod idempotency;
pub mod info;
pub mod mcp;
pub mod observe;
pub mod retention;
pub mod reward;
pub mod runtime;
pub mod trajectory;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agent_tools::sandbox::CgroupNesting;
use agent_tools::{ResourceLimits, Sandbox, SandboxConfig, ToolLimits};
use kernelbench::TaskSet;

pub use api::{router, AppState};
pub use evaluation::DEFAULT_PRESTART_DEPTH;

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
    /// Whether the server may move into a leaf of its cgroup v2 so that its commands get the
    /// memory, pids and cpu controllers.
    pub cgroup_nesting: CgroupNesting,
    /// Most open episodes.
    pub max_episodes: usize,
    /// Builds at once.
    pub max_builds: usize,
    /// Flag sets (`extra_cflags` as candidates pass them) to precompile torch/extension.h
    /// for; None: the device's defaults ([`build::default_pch_variants`], what the binary
    /// uses); empty (the default here, for embedders and tests): none.
    pub pch_variants: Option<Vec<String>>,
    /// Where the precompiled headers are kept; None: `pch/` in the data directory. Servers of
    /// one machine may share one (they take turns making a variant, and use each other's).
    pub pch_dir: Option<PathBuf>,
    /// Most evaluations waiting.
    pub max_eval_queue: usize,
    /// Default turn limit.
    pub max_turns: u32,
    /// Default tool-time budget; None: the device's ([`default_time_budget`]).
    pub time_budget: Option<Duration>,
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
    /// Observe the workers' forwards from outside on the CPU (perf events; needs root).
    pub observe: bool,
    /// Start the next evaluation's judge and workers while the device still times the last
    /// one (`None`: on CUDA, not on CPU, where the lease is the whole machine).
    pub prestart: Option<bool>,
    /// With prestart, evaluations per device with processes alive at once.
    pub prestart_depth: usize,
    /// Aten operators candidates may dispatch beyond allocation, views and copies.
    pub allow_ops: Vec<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Limits of the HTTP layer (connections, header, body, idle and write timeouts).
    pub http: http::HttpLimits,
    /// A finished episode stays in memory this long (then its log answers for it).
    pub finished_grace: Duration,
    /// Time limit of blocking file work in a request before it fails.
    pub io_timeout: Duration,
    /// An episode whose trajectory log grows past this is truncated (`log_quota`).
    pub max_log_bytes: u64,
    /// How many trajectory logs are kept.
    pub trajectory_retention: retention::TrajectoryRetention,
    /// Most bytes of compiled extensions kept in the build cache.
    pub build_cache_max_bytes: u64,
    /// Most bytes one build-cache entry may hold (after its build, and after its run).
    pub build_cache_entry_max_bytes: u64,
    /// Most commands (Bash steps) running at once over all episodes (with `host_admission`,
    /// at most what the host's pids allow).
    pub max_commands: usize,
    /// Bound admission by the host (memory kept free, pids): on by default.
    pub host_admission: bool,
    /// With `host_admission`, memory a new episode must find available on the host; None: a
    /// tenth of the host's memory, at least 1 GiB.
    pub min_available_memory_bytes: Option<u64>,
    /// With `host_admission`, memory the tmpfs volumes of open episodes may reserve together,
    /// each its disk quota; None: the host's memory less the reserve.
    pub volume_memory_bytes: Option<u64>,
    /// How often retention runs (it also runs at start).
    pub retention_interval: Duration,
}

/// The tool-time budget of an episode when neither the reset nor the server says: enough for
/// about ten verify/profile iterations of a `load_inline` candidate on the device, with a
/// build in each. On an H100 host one iteration measured 91 s (verify.py 65 s with its build,
/// profile.py 26 s), so 1200 s on CUDA. On the 2-core CPU host, quiet, verify.py after a
/// one-line `load_inline` change took 27.6 s and profile.py 31.7 s (docs/BENCHMARKS.md), so
/// 900 s there; while other builds loaded the host the same verify.py took 289 s.
pub fn default_time_budget(device: runtime::Device) -> Duration {
    match device {
        runtime::Device::Cpu => Duration::from_secs(900),
        runtime::Device::Cuda => Duration::from_secs(1200),
    }
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
            cgroup_nesting: CgroupNesting::default(),
            max_episodes: 4096,
            max_builds: build::default_max_builds(),
            pch_variants: Some(Vec::new()),
            pch_dir: None,
            max_eval_queue: 1024,
            max_turns: 200,
            time_budget: None,
            idle_timeout: Duration::from_secs(1800),
            eval_timeout: Duration::from_secs(300),
            disk_quota_bytes: 1 << 30,
            limits: ResourceLimits::default(),
            task_size: None,
            skip_compile: false,
            observe: true,
            prestart: None,
            prestart_depth: DEFAULT_PRESTART_DEPTH,
            allow_ops: Vec::new(),
            max_body_bytes: 8 << 20,
            http: http::HttpLimits::default(),
            finished_grace: Duration::from_secs(60),
            io_timeout: Duration::from_secs(30),
            max_log_bytes: 64 << 20,
            trajectory_retention: retention::TrajectoryRetention {
                keep: None,
                max_age: None,
                max_bytes: Some(16 << 30),
            },
            build_cache_max_bytes: 8 << 30,
            build_cache_entry_max_bytes: 1 << 30,
            max_commands: 256,
            host_admission: true,
            min_available_memory_bytes: None,
            volume_memory_bytes: None,
            retention_interval: Duration::from_secs(300),
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
    /// The precompiled headers (`--pch-only`; a server goes on without them).
    #[error(transparent)]
    Pch(#[from] build::PchError),
    /// The data directory.
    #[error("data directory {0}: {1}")]
    DataDir(PathBuf, #[source] std::io::Error),
    /// The data directory lies under a path that every sandboxed process may read.
    #[error("data directory {data_dir} is readable by sandboxed processes: it lies under {root}, which every sandbox may read, so agents could read each other's trajectories and builds; choose a --data-dir outside {root}")]
    Readable {
        /// The data directory.
        data_dir: PathBuf,
        /// The sandbox's read-only path that holds it.
        root: PathBuf,
    },
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

impl ServerConfig {
    /// The directory the precompiled headers are kept in: `pch_dir`, else `pch/` in the data
    /// directory (`data_dir`, as the server resolved it).
    fn pch_root(&self, data_dir: &std::path::Path) -> PathBuf {
        self.pch_dir.clone().unwrap_or_else(|| data_dir.join("pch"))
    }

    /// The flag sets to precompile for on `device`: the configured ones, else its defaults.
    fn pch_variants_on(&self, device: runtime::Device) -> Vec<String> {
        self.pch_variants
            .clone()
            .unwrap_or_else(|| build::default_pch_variants(device))
    }
}

/// Makes the precompiled headers `cfg` asks for (its variants, or the device's defaults) in
/// its precompiled-header directory, one after another, and returns the include directory
/// builds put on `CPATH`: what `env-server --pch-only` does before a fleet or a test suite
/// starts servers that share the directory.
pub fn prepare_pch(cfg: &ServerConfig) -> Result<PathBuf, StartError> {
    let python = runtime::PythonInfo::probe(&cfg.python)?;
    let device = runtime::Device::choose(&cfg.device, &python)?;
    let toolchain = build::Toolchain::for_device(device, &python);
    let tool_path = std::env::join_paths(python.path_dirs()).unwrap_or_default();
    let root = cfg.pch_root(&cfg.data_dir);
    std::fs::create_dir_all(&root).map_err(|e| StartError::DataDir(root.clone(), e))?;
    let pch = build::Pch::layout(&root, &python, device, &tool_path, &toolchain.env())?;
    for flags in &cfg.pch_variants_on(device) {
        let t0 = std::time::Instant::now();
        pch.build(flags, &tool_path)?;
        tracing::info!(flags = %flags, seconds = t0.elapsed().as_secs_f64(), "precompiled torch/extension.h");
    }
    Ok(pch.dir)
}

/// Probes the machine, installs the harness, recovers episodes and returns the app state.
pub fn build_state(cfg: ServerConfig) -> Result<Arc<AppState>, StartError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(&cfg.data_dir)
        .map_err(|e| StartError::DataDir(cfg.data_dir.clone(), e))?;
    let data_dir = cfg
        .data_dir
        .canonicalize()
        .map_err(|e| StartError::DataDir(cfg.data_dir.clone(), e))?;
    // Tool processes under their own uids must traverse (not list) the data dir to reach
    // their workspace, evaluation directory, build-cache entry or compile cache; what only
    // the server reads (trajectory logs, the record of finished builds) is its alone. The
    // harness and the precompiled headers are readable by all (they hold nothing private).
    for (sub, mode) in [
        ("", 0o711),
        ("episodes", 0o711),
        ("evals", 0o711),
        ("build-cache", 0o711),
        ("judge-cache", 0o711),
        ("trajectories", 0o700),
        ("build-ok", 0o700),
    ] {
        let d = data_dir.join(sub);
        std::fs::create_dir_all(&d).map_err(|e| StartError::DataDir(d.clone(), e))?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode))
            .map_err(|e| StartError::DataDir(d.clone(), e))?;
    }
    raise_open_file_limit();
    // Before the server starts any process of its own (the precompiled headers' builds): in
    // `alone` mode a child still running would keep the server from nesting.
    agent_tools::sandbox::nest(cfg.cgroup_nesting);
    let python = runtime::PythonInfo::probe(&cfg.python)?;
    // Before anything is written there for others (the precompiled headers).
    check_private(
        &data_dir,
        &SandboxConfig::with_toolchains(python.toolchain_dirs()).read_only,
    )?;
    let device = runtime::Device::choose(&cfg.device, &python)?;
    let mut toolchain = build::Toolchain::for_device(device, &python);
    let tool_path = std::env::join_paths(python.path_dirs()).unwrap_or_default();
    let variants = cfg.pch_variants_on(device);
    let mut toolchain_dirs = python.toolchain_dirs();
    if !variants.is_empty() {
        let env = toolchain.env();
        match build::Pch::layout(&cfg.pch_root(&data_dir), &python, device, &tool_path, &env) {
            Ok(pch) => {
                toolchain.pch_dir = Some(pch.dir.clone());
                toolchain_dirs.push(pch.dir.clone());
                build::spawn_pch_builds(pch, variants.clone(), tool_path.clone());
            }
            Err(e) => tracing::warn!(error = %e, "building without precompiled headers"),
        }
    }
    // What the host can give, before the sandbox: each command's memory cap is at most that,
    // and all commands together are held to it by a parent cgroup where the host allows.
    let admission = admission::Admission::derive(
        admission::HostFacts::probe(),
        &admission::AdmissionConfig {
            from_host: cfg.host_admission,
            min_available_memory_bytes: cfg.min_available_memory_bytes,
            volume_memory_bytes: cfg.volume_memory_bytes,
            max_commands: cfg.max_commands,
            processes_per_command: cfg.limits.total_processes,
            command_memory_bytes: cfg.limits.total_memory_bytes,
        },
    );
    let mut sandbox_cfg = SandboxConfig::with_toolchains(toolchain_dirs);
    sandbox_cfg.limits = cfg.limits.clone();
    sandbox_cfg.limits.total_memory_bytes = admission.command_memory_bytes;
    sandbox_cfg.commands_memory_bytes = admission.memory_budget_bytes;
    sandbox_cfg.allow_unconfined = cfg.allow_unconfined;
    sandbox_cfg.cgroup_nesting = cfg.cgroup_nesting;
    let sandbox = Sandbox::new(sandbox_cfg)?;
    // Processes, cgroups and volumes an earlier run of a server left behind (a crash): ended
    // before anything new starts.
    sandbox.sweep_leftovers();
    let status = sandbox.status();
    // Measured volumes live on disk: they reserve no memory.
    let admission = admission.with_volumes(status.disk_quota);
    tracing::info!(?admission, "admission bounds");
    // Whether the kernel lets the server observe workers from outside (the CPU's
    // pytorch_compute check): found out now, and said, rather than at the first evaluation.
    let observer = if cfg.observe {
        observe::probe().map_err(|e| e.to_string())
    } else {
        Ok(())
    };
    if let Err(e) = &observer {
        tracing::warn!(error = %e, "cannot observe the workers from outside: pytorch_compute rests on the workers' own traces");
    }
    if !status.confined {
        tracing::warn!(?status, "running UNCONFINED: results are marked unconfined");
    }
    if status.uid_isolation {
        check_reachable(&data_dir)?;
    }
    let harness_dir = data_dir.join("harness");
    runtime::install_harness(&harness_dir, device)?;
    if device == runtime::Device::Cuda {
        runtime::check_cuda_ipc(&cfg.python, &harness_dir)?;
    }
    let tasks = Arc::new(
        match &cfg.tasks_dir {
            Some(d) => TaskSet::load_dir(d)?,
            None => TaskSet::bundled(),
        }
        .with_tiny_family(),
    );
    let task_size = cfg.task_size.clone().unwrap_or_else(|| {
        if device == runtime::Device::Cpu {
            "small".into()
        } else {
            "full".into()
        }
    });
    let mut extra_env = vec![("CUDA_AGENT_TASK_SIZE".to_string(), task_size.clone())];
    extra_env.extend(toolchain.env());
    let gpus = if device == runtime::Device::Cuda {
        python.gpus
    } else {
        0
    };
    let evaluator = Arc::new(evaluation::Evaluator::new(
        evaluation::EvaluatorConfig {
            data_dir: data_dir.clone(),
            device,
            devices: gpus.max(1),
            max_builds: cfg.max_builds,
            build_jobs: build::jobs_per_build(cfg.max_builds),
            max_queue: cfg.max_eval_queue,
            phase_timeout: cfg.eval_timeout,
            extra_env: extra_env.clone(),
            skip_compile: cfg.skip_compile,
            allow_ops: cfg.allow_ops.clone(),
            prestart: cfg.prestart.unwrap_or(device == runtime::Device::Cuda),
            prestart_depth: cfg.prestart_depth,
            observe: cfg.observe && observer.is_ok(),
            shared_cache_tasks: Arc::new(tasks.iter().map(|t| t.hash.clone()).collect()),
            build_cache_max_bytes: cfg.build_cache_max_bytes,
            build_cache_entry_max_bytes: cfg.build_cache_entry_max_bytes,
        },
        sandbox.clone(),
        python.clone(),
        harness_dir.clone(),
    ));
    let tool_limits = ToolLimits::default();
    let drain = Arc::new(drain::Drain::default());
    let episodes = episode::EpisodeManager::new(
        episode::EpisodeConfig {
            data_dir: data_dir.clone(),
            max_turns: cfg.max_turns,
            time_budget: cfg.time_budget.unwrap_or(default_time_budget(device)),
            max_episodes: cfg.max_episodes,
            disk_quota_bytes: cfg.disk_quota_bytes,
            idle_timeout: cfg.idle_timeout,
            finished_grace: cfg.finished_grace,
            io_timeout: cfg.io_timeout,
            max_log_bytes: cfg.max_log_bytes,
            max_commands: admission.max_commands,
            admission,
            tool_limits,
            extra_env,
            gpus,
        },
        tasks.clone(),
        sandbox.clone(),
        python.clone(),
        harness_dir,
        evaluator.clone(),
        drain.clone(),
    );
    let interrupted = episodes.recover()?;
    // Nothing is live before the first request: what is under episodes/ and evals/ was left
    // by a crash.
    let swept = retention::sweep_leftovers(&data_dir);
    let retention = Retention {
        data_dir: data_dir.clone(),
        trajectories: cfg.trajectory_retention.clone(),
        build_cache: retention::BuildCacheRetention {
            max_bytes: cfg.build_cache_max_bytes,
            in_use_window: cfg.eval_timeout * 2,
        },
        interval: cfg.retention_interval,
    };
    retention.run(&episodes.live_ids());
    tracing::info!(
        interrupted,
        swept = swept.entries,
        swept_bytes = swept.bytes,
        tasks = tasks.len(),
        device = device.as_str(),
        "server state ready"
    );
    let time_budget = cfg.time_budget.unwrap_or(default_time_budget(device));
    let info = info::ServerInfo {
        api: "v1",
        auth: cfg.api_key.is_some(),
        build: info::BuildInfo {
            cuda_arch_list: toolchain.cuda_arch_list.clone(),
            precompiled_headers: toolchain.pch_dir.as_ref().map(|_| variants.clone()),
        },
        capacity: info::Capacity {
            admission: info::AdmissionInfo {
                bounds: admission,
                volume_memory_reserved_bytes: None,
            },
            device_slots: gpus.max(1),
            max_builds: cfg.max_builds,
            max_commands: admission.max_commands,
            max_episodes: cfg.max_episodes,
            max_eval_queue: cfg.max_eval_queue,
            prestart_depth: evaluator.prestart_depth(),
        },
        device,
        device_slots: Vec::new(),
        episode_defaults: info::EpisodeDefaults {
            device_default_time_budget_s: info::PerDevice {
                cpu: default_time_budget(runtime::Device::Cpu).as_secs_f64(),
                cuda: default_time_budget(runtime::Device::Cuda).as_secs_f64(),
            },
            max_turns: cfg.max_turns,
            time_budget_from: if cfg.time_budget.is_some() {
                "--time-budget-s"
            } else {
                "the device's default"
            },
            time_budget_s: time_budget.as_secs_f64(),
        },
        evaluations_in_flight: 0,
        gpus: python.gpu_names.clone(),
        http: info::HttpInfo::new(&cfg.http, cfg.max_body_bytes),
        name: "cuda-agent env-server",
        observer: info::ObserverInfo::new(&observer, cfg.observe, device),
        open_episodes: 0,
        retention: info::RetentionInfo::new(
            &cfg.trajectory_retention,
            cfg.finished_grace,
            cfg.max_log_bytes,
            cfg.build_cache_max_bytes,
            cfg.build_cache_entry_max_bytes,
        ),
        sandbox: status,
        task_size,
        tasks: tasks.len(),
        torch: python.torch.clone(),
        torch_cuda: python.torch_cuda.clone(),
        version: env!("CARGO_PKG_VERSION"),
    };
    Ok(Arc::new(AppState {
        episodes,
        evaluator,
        drain,
        api_key: cfg.api_key,
        info,
        max_body_bytes: cfg.max_body_bytes,
        body_timeout: cfg.http.body_timeout,
        http: Arc::new(http::HttpCounters::default()),
        in_flight: Arc::new(tokio::sync::Semaphore::new(cfg.http.max_requests_in_flight)),
        max_in_flight: cfg.http.max_requests_in_flight,
        retention,
        mcp: mcp::McpLimits {
            max_sessions: cfg.max_episodes,
            session_idle: cfg.idle_timeout,
        },
        evaluation_keys: std::sync::Mutex::new(idempotency::Keys::new(
            env_api::caps::EVALUATION_KEYS,
        )),
    }))
}

/// The retention policy and where it applies.
#[derive(Debug, Clone)]
pub struct Retention {
    /// The data directory.
    pub data_dir: PathBuf,
    /// Trajectory logs kept.
    pub trajectories: retention::TrajectoryRetention,
    /// The build cache's bound.
    pub build_cache: retention::BuildCacheRetention,
    /// How often it runs.
    pub interval: Duration,
}

impl Retention {
    /// One pass over trajectory logs (sparing `live` episodes) and the build cache. Blocking.
    pub fn run(&self, live: &std::collections::HashSet<String>) {
        let logs = retention::prune_trajectories(
            &self.data_dir.join("trajectories"),
            &self.trajectories,
            live,
        );
        let builds =
            retention::prune_build_cache(&self.data_dir.join("build-cache"), &self.build_cache);
        if logs.entries + builds.entries > 0 {
            tracing::info!(
                logs = logs.entries,
                log_bytes = logs.bytes,
                builds = builds.entries,
                build_bytes = builds.bytes,
                "retention removed"
            );
        }
    }
}

/// Every 30 s, for as long as the state lives: truncates idle episodes, moves finished ones
/// out of memory; every retention interval, prunes logs and the build cache (on a blocking
/// thread, one pass at a time).
pub fn spawn_janitor(state: Arc<AppState>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(30));
        let mut last_retention = tokio::time::Instant::now();
        let mut last_in_memory = 0;
        loop {
            tick.tick().await;
            let n = state.episodes.expire_idle().await;
            if n > 0 {
                tracing::info!(expired = n, "idle episodes truncated");
            }
            let evicted = state.episodes.evict_finished();
            if evicted > 0 {
                tracing::debug!(evicted, "finished episodes left memory");
            }
            // Episodes left memory since the last tick (closed or evicted): give the pages back.
            let in_memory = state.episodes.in_memory();
            if in_memory < last_in_memory {
                release_free_memory();
            }
            last_in_memory = in_memory;
            if last_retention.elapsed() >= state.retention.interval {
                last_retention = tokio::time::Instant::now();
                let (retention, live) = (state.retention.clone(), state.episodes.live_ids());
                if let Err(e) = tokio::task::spawn_blocking(move || retention.run(&live)).await {
                    tracing::warn!(error = %e, "retention pass failed");
                }
            }
        }
    });
}

/// Hands freed heap pages back to the system, so that the server's resident memory falls
/// after many episodes end (glibc keeps them otherwise).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Each open episode holds descriptors (its log, its workspace, its uid lease) and each
/// command being started many more for a moment (its sandbox's rules and pipes): lift the
/// descriptor limit as far as the kernel allows (root may raise the hard limit up to
/// `fs.nr_open`), else the soft limit to the hard one. The sandbox sets its own limit for
/// tool processes.
fn raise_open_file_limit() {
    const WANTED: libc::rlim_t = 1 << 20;
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<libc::rlim_t>().ok())
        .unwrap_or(WANTED);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return;
        }
        let target = WANTED.min(nr_open);
        if lim.rlim_max < target {
            let raised = libc::rlimit {
                rlim_cur: target,
                rlim_max: target,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                return;
            }
        }
        if lim.rlim_cur < lim.rlim_max {
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
        let mode = std::fs::metadata(dir)
            .map(|m| m.permissions().mode())
            .unwrap_or(0o755);
        if mode & 0o001 == 0 {
            return Err(StartError::Unreachable {
                data_dir: data_dir.to_path_buf(),
                blocker: dir.to_path_buf(),
                mode: mode & 0o7777,
            });
        }
    }
    Ok(())
}

/// Refuses a data directory under any of `readable`, the paths every sandbox may read
/// (landlock's read-only list: /usr, /opt, /etc, the toolchains, ...): file modes alone would
/// then keep agents from other episodes' logs and builds, and not at all where sandboxed
/// processes share the server's uid. Paths inside the data directory (its precompiled
/// headers) are the server's own choice and are skipped.
fn check_private(data_dir: &std::path::Path, readable: &[PathBuf]) -> Result<(), StartError> {
    for root in readable {
        let root = root.canonicalize().unwrap_or_else(|_| root.clone());
        if data_dir.starts_with(&root) && !root.starts_with(data_dir) {
            return Err(StartError::Readable {
                data_dir: data_dir.to_path_buf(),
                root,
            });
        }
    }
    Ok(())
}
