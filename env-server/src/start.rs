//! Starting the server: the data directory, the machine probed (Python, torch, the device),
//! the toolchain, the sandbox and the host's admission bounds, the harness, the tasks, the
//! evaluator and the episode manager, then what an earlier run left behind recovered or
//! removed. [`build_state`] runs those steps in their order; each step is a function here.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use agent_tools::sandbox::SandboxStatus;
use agent_tools::{Sandbox, SandboxConfig, ToolLimits};
use kernelbench::TaskSet;

use crate::admission::{Admission, AdmissionConfig, HostFacts};
use crate::config::{default_time_budget, ServerConfig, TaskSize};
use crate::drain::Drain;
use crate::episode::{EpisodeConfig, EpisodeManager};
use crate::evaluation::{Evaluator, EvaluatorConfig, TimingIsolation};
use crate::info::{Probed, ServerInfo};
use crate::retention::{BuildCacheRetention, Retention};
use crate::runtime::{Device, PythonInfo};
use crate::state::{AppState, McpLimits};
use crate::{build, episode, http, idempotency, observe, retention, runtime};

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
    #[error("data directory {0}")]
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

/// Makes the precompiled headers `cfg` asks for (its variants, or the device's defaults) in
/// its precompiled-header directory, one after another, and returns the include directory
/// builds put on `CPATH`: what `env-server --pch-only` does before a fleet or a test suite
/// starts servers that share the directory.
pub fn prepare_pch(cfg: &ServerConfig) -> Result<PathBuf, StartError> {
    let python = runtime::PythonInfo::probe(&cfg.python)?;
    let device = runtime::Device::choose(cfg.device, &python)?;
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
    let data_dir = prepare_data_dir(&cfg.data_dir)?;
    raise_open_file_limit();
    no_realtime_priority();
    // Before the server starts any process of its own (the precompiled headers' builds): in
    // `alone` mode a child still running would keep the server from nesting.
    agent_tools::sandbox::nest(cfg.cgroup_nesting);
    let python = PythonInfo::probe(&cfg.python)?;
    // Before anything is written there for others (the precompiled headers).
    check_private(
        &data_dir,
        &SandboxConfig::with_toolchains(python.toolchain_dirs()).read_only,
    )?;
    let device = Device::choose(cfg.device, &python)?;
    // Before the server starts any process of its own: pinned, the server moves into the
    // shared cores, and what it starts later inherits them.
    let isolation = timing_isolation(&cfg, device, &python);
    let variants = cfg.pch_variants_on(device);
    let (toolchain, toolchain_dirs) = toolchain(&cfg, &data_dir, &python, device, &variants);
    let (sandbox, status, admission) = confine(&cfg, toolchain_dirs)?;
    let (admission, eval_volume_memory) = split_volume_memory(&cfg, admission, status.disk_quota);
    let observer = probe_observer(cfg.observe);
    if !status.confined {
        tracing::warn!(?status, "running UNCONFINED: results are marked unconfined");
    }
    if status.uid_isolation {
        check_reachable(&data_dir)?;
    }
    let harness_dir = data_dir.join("harness");
    runtime::install_harness(&harness_dir, device)?;
    if device == Device::Cuda {
        runtime::check_cuda_ipc(&cfg.python, &harness_dir)?;
    }
    let tasks = load_tasks(&cfg)?;
    let task_size = cfg.task_size.unwrap_or(TaskSize::for_device(device));
    // What every agent command and evaluation of this server sees.
    let extra_env: Vec<(String, String)> = [(
        "CUDA_AGENT_TASK_SIZE".to_string(),
        task_size.as_str().to_string(),
    )]
    .into_iter()
    .chain(toolchain.env())
    .collect();
    let gpus = if device == Device::Cuda {
        python.gpus
    } else {
        0
    };
    let evaluator = Arc::new(Evaluator::new(
        EvaluatorConfig {
            volume_memory_bytes: eval_volume_memory,
            ..evaluator_config(
                &cfg,
                &data_dir,
                device,
                gpus,
                &extra_env,
                &observer,
                &tasks,
                isolation.clone(),
            )
        },
        sandbox.clone(),
        python.clone(),
        harness_dir.clone(),
    ));
    let drain = Arc::new(Drain::default());
    let episodes = EpisodeManager::new(
        episode_config(&cfg, &data_dir, device, admission, extra_env, gpus),
        tasks.clone(),
        sandbox.clone(),
        python.clone(),
        harness_dir,
        evaluator.clone(),
        drain.clone(),
    );
    let retention = recover(&cfg, &data_dir, &episodes, tasks.len(), device)?;
    let info = ServerInfo::new(
        &cfg,
        Probed {
            device,
            python: &python,
            toolchain: &toolchain,
            variants,
            admission,
            sandbox: status.clone(),
            observer: &observer,
            tasks: tasks.len(),
            task_size,
            prestart_depth: evaluator.prestart_depth(),
            evaluation_volume: evaluator.volume_info(status.disk_quota),
            timing_isolation: isolation.info(),
        },
    );
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
        mcp: McpLimits {
            max_sessions: cfg.max_episodes,
            session_idle: cfg.idle_timeout,
        },
        evaluation_keys: std::sync::Mutex::new(idempotency::Keys::new(
            env_api::caps::EVALUATION_KEYS,
        )),
    }))
}

/// The served tasks (`--tasks DIR`, else the bundled suite) and the tiny family.
fn load_tasks(cfg: &ServerConfig) -> Result<Arc<TaskSet>, StartError> {
    let tasks = match &cfg.tasks_dir {
        Some(d) => TaskSet::load_dir(d)?,
        None => TaskSet::bundled(),
    };
    Ok(Arc::new(tasks.with_tiny_family()))
}

/// The timed evaluations' CPU isolation (`--timing-cores`): a slot per GPU on a CUDA server,
/// one on a CPU server.
fn timing_isolation(
    cfg: &ServerConfig,
    device: Device,
    python: &PythonInfo,
) -> Arc<TimingIsolation> {
    let slots = if device == Device::Cuda {
        python.gpus.max(1)
    } else {
        1
    };
    Arc::new(TimingIsolation::new(
        &cfg.timing_cores,
        device,
        slots,
        cfg.prestart.unwrap_or(device == Device::Cuda),
        // Moving and raising other uids' processes, found by the uids leased to them.
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() } == 0,
    ))
}

/// What a previous run left: its episodes recovered (or ended as interrupted), leftovers
/// swept, retention applied to what is live. Returns the retention policy the server keeps.
fn recover(
    cfg: &ServerConfig,
    data_dir: &Path,
    episodes: &EpisodeManager,
    tasks: usize,
    device: Device,
) -> Result<Retention, StartError> {
    let interrupted = episodes.recover()?;
    // Nothing is live before the first request: what is under episodes/ and evals/ was left
    // by a crash.
    let swept = retention::sweep_leftovers(data_dir);
    let retention = retention_of(cfg, data_dir);
    retention.run(&episodes.live_ids());
    tracing::info!(
        interrupted,
        swept = swept.entries,
        swept_bytes = swept.bytes,
        tasks,
        device = device.as_str(),
        "server state ready"
    );
    Ok(retention)
}

/// Creates the data directory and its parts with their modes; returns its canonical path.
fn prepare_data_dir(dir: &Path) -> Result<PathBuf, StartError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|e| StartError::DataDir(dir.to_path_buf(), e))?;
    let data_dir = dir
        .canonicalize()
        .map_err(|e| StartError::DataDir(dir.to_path_buf(), e))?;
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
    Ok(data_dir)
}

/// The build toolchain for `device` and the directories sandboxes read it from; with
/// precompiled-header `variants`, their directory laid out and their builds started in the
/// background (a server goes on without them when that fails).
fn toolchain(
    cfg: &ServerConfig,
    data_dir: &Path,
    python: &PythonInfo,
    device: Device,
    variants: &[String],
) -> (build::Toolchain, Vec<PathBuf>) {
    let mut toolchain = build::Toolchain::for_device(device, python);
    let tool_path = std::env::join_paths(python.path_dirs()).unwrap_or_default();
    let mut toolchain_dirs = python.toolchain_dirs();
    if !variants.is_empty() {
        let env = toolchain.env();
        match build::Pch::layout(&cfg.pch_root(data_dir), python, device, &tool_path, &env) {
            Ok(pch) => {
                toolchain.pch_dir = Some(pch.dir.clone());
                toolchain_dirs.push(pch.dir.clone());
                build::spawn_pch_builds(pch, variants.to_vec(), tool_path.clone());
            }
            Err(e) => {
                tracing::warn!(error = %env_api::ErrorChain(&e), "building without precompiled headers")
            }
        }
    }
    (toolchain, toolchain_dirs)
}

/// The sandbox, what it enforces here, and the admission bounds: derived from what the host
/// can give before the sandbox exists (each command's memory cap is at most that, and all
/// commands together are held to it by a parent cgroup where the host allows), then told
/// whether volumes take memory.
fn confine(
    cfg: &ServerConfig,
    toolchain_dirs: Vec<PathBuf>,
) -> Result<(Sandbox, SandboxStatus, Admission), StartError> {
    let admission = Admission::derive(
        HostFacts::probe(),
        &AdmissionConfig {
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
    Ok((sandbox, status, admission))
}

/// Whether the kernel lets the server observe workers from outside (the CPU's
/// pytorch_compute check), when `asked`: found out now, and said, rather than at the first
/// evaluation.
fn probe_observer(asked: bool) -> Result<(), String> {
    let observer = if asked {
        observe::probe().map_err(|e| env_api::error_chain(&e))
    } else {
        Ok(())
    };
    if let Err(e) = &observer {
        tracing::warn!(error = %e, "cannot observe the workers from outside: pytorch_compute rests on the workers' own traces");
    }
    observer
}

/// The evaluator's settings.
#[allow(clippy::too_many_arguments)]
fn evaluator_config(
    cfg: &ServerConfig,
    data_dir: &Path,
    device: Device,
    gpus: usize,
    extra_env: &[(String, String)],
    observer: &Result<(), String>,
    tasks: &TaskSet,
    isolation: Arc<TimingIsolation>,
) -> EvaluatorConfig {
    EvaluatorConfig {
        data_dir: data_dir.to_path_buf(),
        device,
        devices: gpus.max(1),
        max_builds: cfg.max_builds,
        build_jobs: build::jobs_per_build(cfg.max_builds),
        max_queue: cfg.max_eval_queue,
        phase_timeout: cfg.eval_timeout,
        extra_env: extra_env.to_vec(),
        skip_compile: cfg.skip_compile,
        timing_budget: cfg.timing_budget,
        allow_ops: cfg.allow_ops.clone(),
        prestart: cfg.prestart.unwrap_or(device == Device::Cuda),
        prestart_depth: cfg.prestart_depth,
        observe: cfg.observe && observer.is_ok(),
        shared_cache_tasks: Arc::new(tasks.iter().map(|t| t.hash.clone()).collect()),
        build_cache_max_bytes: cfg.build_cache_max_bytes,
        build_cache_entry_max_bytes: cfg.build_cache_entry_max_bytes,
        volume_limits: agent_tools::sandbox::VolumeLimits::bytes(cfg.eval_disk_quota_bytes),
        volume_memory_bytes: cfg.eval_volume_memory_bytes,
        isolation,
    }
}

/// The evaluations' volume memory budget, and the admission bounds with the episodes' part:
/// none where volumes are measured directories (on disk); the one given; else, with host
/// admission, a quarter of the volume-memory budget (at least one evaluation's volume), which
/// the episodes' default budget gives up so that both together stay within it.
fn split_volume_memory(
    cfg: &ServerConfig,
    mut admission: Admission,
    volumes: agent_tools::sandbox::QuotaEnforcement,
) -> (Admission, Option<u64>) {
    if volumes != agent_tools::sandbox::QuotaEnforcement::Tmpfs {
        return (admission, None);
    }
    if let Some(given) = cfg.eval_volume_memory_bytes {
        return (admission, Some(given));
    }
    let Some(all) = admission.volume_memory_bytes else {
        return (admission, None);
    };
    let evals = (all / 4).max(cfg.eval_disk_quota_bytes);
    if cfg.volume_memory_bytes.is_none() {
        admission.volume_memory_bytes = Some(all.saturating_sub(evals).max(4096));
    }
    (admission, Some(evals))
}

/// The episode manager's settings.
fn episode_config(
    cfg: &ServerConfig,
    data_dir: &Path,
    device: Device,
    admission: Admission,
    extra_env: Vec<(String, String)>,
    gpus: usize,
) -> EpisodeConfig {
    EpisodeConfig {
        data_dir: data_dir.to_path_buf(),
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
        tool_limits: ToolLimits::default(),
        extra_env,
        gpus,
    }
}

/// What the janitor prunes, and how often.
fn retention_of(cfg: &ServerConfig, data_dir: &Path) -> Retention {
    Retention {
        data_dir: data_dir.to_path_buf(),
        trajectories: cfg.trajectory_retention.clone(),
        build_cache: BuildCacheRetention {
            max_bytes: cfg.build_cache_max_bytes,
            in_use_window: cfg.eval_timeout * 2,
        },
        interval: cfg.retention_interval,
    }
}

/// Sets `RLIMIT_RTPRIO` to 0, soft and hard, for the server and so for everything it starts:
/// the sandbox fixes a command's nice ceiling but not this one, and a host that lets the
/// server's processes take a real-time policy would let a candidate's worker run `SCHED_FIFO`
/// above its own baselines (the reference worker at the normal policy) and above its judge.
/// The server itself keeps what root's `CAP_SYS_NICE` allows (raising an evaluation to the
/// normal policy needs no real-time priority).
fn no_realtime_priority() {
    let none = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit with a valid struct; lowering a limit is always allowed.
    if unsafe { libc::setrlimit(libc::RLIMIT_RTPRIO, &none) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "RLIMIT_RTPRIO left as it is");
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
