//! `env-server`: serve the environment over HTTP.
//!
//! The API key is read from `--api-key-file` or the `CUDA_AGENT_API_KEY` variable. `--api-key`
//! still works but puts the key in the process's arguments, which every local process can read
//! (`/proc/<pid>/cmdline`); the server warns when it is used.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use agent_tools::sandbox::CgroupNesting;
use anyhow::Context as _;
use clap::parser::ValueSource;
use clap::{CommandFactory as _, FromArgMatches as _, Parser};
use env_server::http::HttpLimits;
use env_server::retention::TrajectoryRetention;
use env_server::{
    build_state, prepare_pch, router, spawn_janitor, DeviceChoice, ServerConfig, TaskSize,
    DEFAULT_TIMING_BUDGET,
};

/// `--cgroup-nesting`, as the command line spells [`CgroupNesting`] (see that flag's help).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Nesting {
    /// Leave the cgroup as it is.
    Off,
    /// Nest only when the server is the only process in its cgroup.
    Alone,
    /// Nest whatever else runs in the cgroup too.
    All,
}

impl From<Nesting> for CgroupNesting {
    fn from(n: Nesting) -> Self {
        match n {
            Nesting::Off => CgroupNesting::Off,
            Nesting::Alone => CgroupNesting::Alone,
            Nesting::All => CgroupNesting::All,
        }
    }
}

/// A setting turned `on` or `off` (`--prestart`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Switch {
    On,
    Off,
}

/// The variable the API key may come from.
const API_KEY_VAR: &str = "CUDA_AGENT_API_KEY";

/// The cuda-agent environment server.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    bind: String,
    /// State directory: trajectory logs, workspaces, build cache, baselines.
    #[arg(long, default_value = "./data")]
    data_dir: PathBuf,
    /// Evaluation device.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Tasks: a KernelBench checkout or a directory of task files (default: the bundled suite).
    #[arg(long)]
    tasks: Option<PathBuf>,
    /// Require `Authorization: Bearer KEY` on every call but /v1/health. Prefer the
    /// CUDA_AGENT_API_KEY variable or --api-key-file: a key given here is visible to every
    /// local process in /proc/<pid>/cmdline.
    #[arg(long, env = API_KEY_VAR, hide_env_values = true, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// Read the API key from this file (its first line; keep it mode 0600).
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Python interpreter with torch, used for the harness and inside workspaces.
    #[arg(long, env = "CUDA_AGENT_PYTHON", default_value = "python3")]
    python: PathBuf,
    /// Run even where landlock or seccomp is missing (results are marked unconfined).
    #[arg(long)]
    allow_unconfined: bool,
    /// Most open episodes.
    #[arg(long, default_value_t = 4096)]
    max_episodes: usize,
    /// Default turn limit of an episode.
    #[arg(long, default_value_t = 200)]
    max_turns: u32,
    /// Default tool-time budget of an episode, seconds (default: the device's, 900 on CPU and
    /// 1200 on CUDA: about ten verify/profile iterations of a load_inline candidate; /v1/info
    /// `episode_defaults` says which is in force).
    #[arg(long)]
    time_budget_s: Option<f64>,
    /// Idle episodes are truncated after this many seconds.
    #[arg(long, default_value_t = 1800)]
    idle_timeout_s: u64,
    /// Time limit of each evaluation phase (build; check and time), seconds.
    #[arg(long, default_value_t = 300)]
    eval_timeout_s: u64,
    /// Builds at once (default: one per core, at most one per 2 GiB of available memory).
    #[arg(long)]
    max_builds: Option<usize>,
    /// Compiler flag sets to precompile torch/extension.h for, `;` separated, as candidates
    /// pass them in `extra_cflags` (such as `-O3;-O3 -march=native`); `none` for no
    /// precompiled headers (default: the flags candidates use most on the device).
    #[arg(long, env = "CUDA_AGENT_PCH", allow_hyphen_values = true)]
    pch: Option<String>,
    /// Keep the precompiled headers here instead of `pch/` in the data directory: servers of
    /// one machine (a test suite, several servers per host) can share one set.
    #[arg(long, env = "CUDA_AGENT_PCH_DIR")]
    pch_dir: Option<PathBuf>,
    /// Make the precompiled headers (`--pch`'s variants, in `--pch-dir`), print their include
    /// directory and exit: for an image or a host prepared before its servers start.
    #[arg(long)]
    pch_only: bool,
    /// Task input sizes: `small` (CPU-sized) or `full` (default: small on CPU, full on CUDA).
    #[arg(long, value_enum)]
    task_size: Option<TaskSize>,
    /// Skip torch.compile baselines (the compile milestone is then never reached).
    #[arg(long)]
    skip_compile: bool,
    /// Seconds the judge times each evaluation's contestants for, their calls interleaved
    /// round by round (it times at least its minimum of rounds whatever the budget). More
    /// rounds narrow the speedups' bands; fewer make evaluations quicker (a test suite).
    #[arg(long, env = "CUDA_AGENT_TIMING_BUDGET_S", default_value_t = DEFAULT_TIMING_BUDGET.as_secs_f64())]
    timing_budget_s: f64,
    /// Do not observe the workers' forwards from outside (on the CPU the server samples their
    /// threads with perf events, where the kernel lets it, to catch PyTorch compute hidden
    /// from the worker's own trace).
    #[arg(long)]
    no_observe: bool,
    /// Cgroup v2 passes memory, pids and cpu to the commands' cgroups only once the server's
    /// own cgroup holds no process: `alone` moves the server into a leaf of its cgroup when it
    /// is the only process there (a service of its own), `all` moves whatever else runs there
    /// too (a container's init), `off` leaves the cgroup as it is.
    #[arg(long, value_enum, default_value_t = Nesting::Alone)]
    cgroup_nesting: Nesting,
    /// Start the next evaluation's judge and workers (imports and channels only: no candidate
    /// code, no device work) while the device still times the last one: `on` or `off`
    /// (default: on with CUDA, off on CPU, where timing has the whole machine).
    #[arg(long, value_enum)]
    prestart: Option<Switch>,
    /// With prestart, evaluations per device whose judge and workers are alive at once: the
    /// one holding the device, the rest starting or waiting at their gates. Each costs host
    /// memory (three processes with PyTorch imported) and none touches the device.
    #[arg(long, default_value_t = env_server::DEFAULT_PRESTART_DEPTH as u32, value_parser = clap::value_parser!(u32).range(2..=64))]
    prestart_depth: u32,
    /// What keeps a timed evaluation's CPU its own. `auto`: cores of its own per device slot
    /// (4 per GPU, the highest-numbered, when at least 4 are left for the rest; on the CPU
    /// three quarters of a host of 8 cores or more) where the host has a cgroup v1 cpuset the
    /// server may write, everything else the server starts on the other cores; else by
    /// priority (evaluations started ahead of their lease run at SCHED_IDLE until they hold
    /// it). A core list (such as `8-15`) reserves those cores, split among the device slots.
    /// `off`: neither. `/v1/info` `timing_isolation` says what is in force.
    #[arg(long, default_value = "auto", value_parser = clap::value_parser!(env_server::evaluation::TimingCores))]
    timing_cores: env_server::evaluation::TimingCores,
    /// Aten operators candidates may dispatch in their forward beyond allocation, views and
    /// copies (comma separated, such as `mm,addmm` to allow PyTorch's matmul).
    #[arg(long, value_delimiter = ',')]
    allow_ops: Vec<String>,
    /// Most commands (Bash steps) running at once over all episodes; more wait their turn
    /// (the wait is not tool time).
    #[arg(long, default_value_t = 256)]
    max_commands: usize,
    /// Admit by the configured caps alone, not bounded by the host's memory and pids.
    #[arg(long)]
    no_host_admission: bool,
    /// Memory a new episode must find available on the host (default: a tenth of the host's,
    /// at least 1 GiB); below it a reset is answered 503 with Retry-After.
    #[arg(long)]
    min_available_memory_bytes: Option<u64>,
    /// Memory the tmpfs volumes of open episodes may reserve together, each its disk quota
    /// (default: the host's memory less the reserve); a reset whose quota does not fit is
    /// answered 503 with Retry-After. Measured volumes (on disk) reserve nothing.
    #[arg(long)]
    volume_memory_bytes: Option<u64>,
    /// Most HTTP connections open at once; more are answered 503 and closed.
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Most HTTP connections one client address may hold open at once, so that one client
    /// cannot take every slot; more are answered 503 and closed (default: a quarter of
    /// --max-connections).
    #[arg(long)]
    max_connections_per_client: Option<usize>,
    /// Most requests being handled at once (one goes on after its client hangs up); more are
    /// answered 503.
    #[arg(long, default_value_t = 4096)]
    max_requests_in_flight: usize,
    /// Seconds a client has to send a request's headers, counted from the connection's start
    /// or the end of the previous answer (so also the idle keep-alive limit).
    #[arg(long, default_value_t = 20.0)]
    header_timeout_s: f64,
    /// Seconds a client has to send a request's body.
    #[arg(long, default_value_t = 30.0)]
    body_timeout_s: f64,
    /// Seconds an answer may wait for a client that stopped reading.
    #[arg(long, default_value_t = 30.0)]
    write_timeout_s: f64,
    /// Largest request body, bytes.
    #[arg(long, default_value_t = 8 << 20)]
    max_body_bytes: usize,
    /// Seconds a finished episode stays in memory; its log answers for it after that.
    #[arg(long, default_value_t = 60)]
    finished_grace_s: u64,
    /// An episode whose trajectory log grows past this many bytes is truncated (`log_quota`).
    #[arg(long, default_value_t = 64 << 20)]
    max_log_bytes: u64,
    /// Keep at most this many trajectory logs (newest first; live episodes' always kept).
    #[arg(long)]
    keep_trajectories: Option<usize>,
    /// Remove trajectory logs last written more than this many seconds ago.
    #[arg(long)]
    trajectory_max_age_s: Option<u64>,
    /// Keep at most this many bytes of trajectory logs (0: no bound).
    #[arg(long, default_value_t = 16 << 30)]
    trajectory_max_bytes: u64,
    /// Keep at most this many bytes of compiled extensions in the build cache, removing the
    /// least recently used first.
    #[arg(long, default_value_t = 8 << 30)]
    build_cache_max_bytes: u64,
    /// Most bytes one build-cache entry may hold after its build and after its run; an
    /// evaluation over it fails (`build_size`) and its entry is removed.
    #[arg(long, default_value_t = 1 << 30)]
    build_cache_entry_max_bytes: u64,
    /// Bytes one evaluation's volume holds: everything its build and run may write (the
    /// sources' copy, temp dir, build directory, outputs). A tmpfs where the server may mount;
    /// a candidate that fills it fails (`disk_quota`, `inode_quota`).
    #[arg(long, default_value_t = 2 << 30)]
    eval_disk_quota_bytes: u64,
    /// Memory the evaluations' tmpfs volumes may reserve together, each its size; an
    /// evaluation waits for room (default, with host admission: a quarter of the
    /// volume-memory budget, at least one volume, taken out of the episodes' default budget).
    #[arg(long)]
    eval_volume_memory_bytes: Option<u64>,
    /// Seconds between retention passes (logs, build cache); one also runs at start.
    #[arg(long, default_value_t = 300)]
    retention_interval_s: u64,
    /// On SIGTERM or SIGINT: seconds the work already admitted (evaluations, steps) gets to
    /// finish while new work is refused and readiness is false; then what is left is ended
    /// and the server exits 0. A second signal exits at once. Keep it under the scheduler's
    /// own grace (Kubernetes' terminationGracePeriodSeconds).
    #[arg(long, default_value_t = 120.0)]
    drain_grace_s: f64,
}

/// The API key, from wherever it was given. A key on the command line is visible to every
/// local process, so that way is warned about.
fn api_key(args: &Args, source: Option<ValueSource>) -> anyhow::Result<Option<String>> {
    if let Some(path) = &args.api_key_file {
        return read_key_file(path).map(Some);
    }
    if args.api_key.is_some() && source == Some(ValueSource::CommandLine) {
        tracing::warn!("--api-key puts the key in the process's arguments, readable by every local process; use {API_KEY_VAR} or --api-key-file");
    }
    Ok(args.api_key.clone().filter(|k| !k.is_empty()))
}

fn read_key_file(path: &Path) -> anyhow::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let meta =
        std::fs::metadata(path).with_context(|| format!("--api-key-file {}", path.display()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!(path = %path.display(), "the API key file is readable by others; chmod 600 it");
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--api-key-file {}", path.display()))?;
    let key = text.lines().next().unwrap_or("").trim().to_string();
    anyhow::ensure!(
        !key.is_empty(),
        "--api-key-file {} holds no key",
        path.display()
    );
    Ok(key)
}

/// Removes the key's variable from the environment, overwriting its value in place first:
/// the original environment block stays readable in /proc/<pid>/environ otherwise. Runs
/// before any other thread exists.
fn scrub_env(name: &str) {
    extern "C" {
        static mut environ: *mut *mut libc::c_char;
    }
    let prefix = format!("{name}=");
    // SAFETY: single-threaded at this point; every entry of `environ` is a NUL-terminated
    // string owned by the process, overwritten within its own length.
    unsafe {
        let mut p = environ;
        while !p.is_null() && !(*p).is_null() {
            let entry = *p;
            let len = libc::strlen(entry);
            let bytes = std::slice::from_raw_parts_mut(entry.cast::<u8>(), len);
            if bytes.starts_with(prefix.as_bytes()) {
                bytes[prefix.len()..].fill(b'x');
            }
            p = p.add(1);
        }
        std::env::remove_var(name);
    }
}

/// The server's memory and /proc files become unreadable to processes of its own uid (the
/// sandboxed tools run under other uids when the server is root; this covers the case where
/// they cannot).
fn deny_inspection() {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    if rc != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "PR_SET_DUMPABLE");
    }
}

/// Few malloc arenas: with one per thread (glibc's default, up to 8 per core) the memory of
/// a thousand finished episodes stays scattered over dozens of arenas that cannot be trimmed;
/// the server's own work is light (tools run in their own processes), so contention is not a
/// cost worth that.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 4);
    }
}

fn main() -> anyhow::Result<()> {
    // Logs on stderr: stdout carries what a command is asked for (`--pch-only`'s directory).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let matches = Args::command().get_matches();
    let args = Args::from_arg_matches(&matches)?;
    let key = api_key(&args, matches.value_source("api_key"))?;
    scrub_env(API_KEY_VAR);
    deny_inspection();
    limit_malloc_arenas();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args, key))
}

async fn run(args: Args, api_key: Option<String>) -> anyhow::Result<()> {
    let secs =
        |s: f64, name: &str| Duration::try_from_secs_f64(s).with_context(|| format!("--{name}"));
    let drain_grace = secs(args.drain_grace_s, "drain-grace-s")?;
    // Installed before anything starts: a signal that comes during start-up is then a drain
    // too, never the default action (an exit that skips the drain's log lines).
    let mut signals = Signals::new()?;
    let http = HttpLimits {
        max_connections: args.max_connections.max(1),
        max_connections_per_client: args
            .max_connections_per_client
            .unwrap_or_else(|| HttpLimits::default_per_client(args.max_connections.max(1)))
            .max(1),
        max_requests_in_flight: args.max_requests_in_flight.max(1),
        header_timeout: secs(args.header_timeout_s, "header-timeout-s")?,
        body_timeout: secs(args.body_timeout_s, "body-timeout-s")?,
        write_timeout: secs(args.write_timeout_s, "write-timeout-s")?,
        ..HttpLimits::default()
    };
    let mut cfg = ServerConfig {
        data_dir: args.data_dir,
        device: args.device,
        tasks_dir: args.tasks,
        api_key,
        python: args.python,
        allow_unconfined: args.allow_unconfined,
        cgroup_nesting: args.cgroup_nesting.into(),
        max_episodes: args.max_episodes,
        max_turns: args.max_turns,
        time_budget: args
            .time_budget_s
            .map(|s| secs(s, "time-budget-s"))
            .transpose()?,
        idle_timeout: Duration::from_secs(args.idle_timeout_s),
        eval_timeout: Duration::from_secs(args.eval_timeout_s),
        task_size: args.task_size,
        skip_compile: args.skip_compile,
        timing_budget: secs(args.timing_budget_s, "timing-budget-s")?,
        observe: !args.no_observe,
        prestart: args.prestart.map(|v| v == Switch::On),
        prestart_depth: args.prestart_depth as usize,
        allow_ops: args.allow_ops,
        timing_cores: args.timing_cores,
        max_body_bytes: args.max_body_bytes,
        http: http.clone(),
        finished_grace: Duration::from_secs(args.finished_grace_s),
        max_log_bytes: args.max_log_bytes,
        trajectory_retention: TrajectoryRetention {
            keep: args.keep_trajectories,
            max_age: args.trajectory_max_age_s.map(Duration::from_secs),
            max_bytes: Some(args.trajectory_max_bytes).filter(|&b| b > 0),
        },
        build_cache_max_bytes: args.build_cache_max_bytes,
        build_cache_entry_max_bytes: args.build_cache_entry_max_bytes,
        max_commands: args.max_commands,
        host_admission: !args.no_host_admission,
        min_available_memory_bytes: args.min_available_memory_bytes,
        volume_memory_bytes: args.volume_memory_bytes,
        eval_disk_quota_bytes: args.eval_disk_quota_bytes,
        eval_volume_memory_bytes: args.eval_volume_memory_bytes,
        retention_interval: Duration::from_secs(args.retention_interval_s.max(1)),
        ..ServerConfig::default()
    };
    if let Some(n) = args.max_builds {
        cfg.max_builds = n;
    }
    cfg.pch_variants = match args.pch.as_deref().map(str::trim) {
        None => None,
        Some("none") => Some(Vec::new()),
        Some(v) => Some(v.split(';').map(|f| f.trim().to_string()).collect()),
    };
    cfg.pch_dir = args.pch_dir;
    if args.pch_only {
        let dir = tokio::task::spawn_blocking(move || prepare_pch(&cfg))
            .await?
            .context("making the precompiled headers")?;
        println!("{}", dir.display());
        return Ok(());
    }
    let state = tokio::task::spawn_blocking(move || build_state(cfg))
        .await?
        .context("starting the server")?;
    tracing::info!(info = %state.info, "configuration");
    spawn_janitor(state.clone());
    let listener = tokio::net::TcpListener::bind(&args.bind)
        .await
        .with_context(|| format!("binding {}", args.bind))?;
    tracing::info!(addr = %listener.local_addr()?, "listening");
    let counters = Arc::clone(&state.http);
    let drained = {
        let state = state.clone();
        async move {
            let first = signals.next().await;
            tracing::info!(signal = first, "stop asked");
            // An operator who asks twice does not want to wait for the grace period.
            tokio::spawn(async move {
                let second = signals.next().await;
                tracing::warn!(signal = second, "second stop signal: exiting at once; every answered step is in its episode's log, and the next start marks the episodes in flight truncated (server_restart)");
                env_server::build::stop_compilers();
                std::process::exit(1);
            });
            state.drain_before_stop(drain_grace).await;
        }
    };
    env_server::http::serve(listener, router(state), http, counters, drained).await?;
    // A header precompile still running would outlive the server otherwise.
    env_server::build::stop_compilers();
    tracing::info!("stopped");
    Ok(())
}

/// SIGTERM and SIGINT, both taken from their default action for the life of the process.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("handling SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("handling SIGINT")?,
        })
    }

    /// The next signal's name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
