//! What the server is started with ([`ServerConfig`]) and the defaults that depend on the
//! device.

use std::path::{Path, PathBuf};
use std::time::Duration;

use agent_tools::sandbox::CgroupNesting;
use agent_tools::ResourceLimits;
use serde::{Deserialize, Serialize};

use crate::evaluation::{TimingCores, DEFAULT_PRESTART_DEPTH};
use crate::{build, http, retention, runtime};

/// How long the judge times an evaluation's contestants unless told otherwise: on a GPU,
/// tens to hundreds of rounds of millisecond-scale calls.
pub const DEFAULT_TIMING_BUDGET: Duration = Duration::from_secs(2);

/// Everything the server is started with.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// State directory: trajectories, workspaces, caches, the harness.
    pub data_dir: PathBuf,
    /// The device asked for.
    pub device: runtime::DeviceChoice,
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
    /// The tasks' input sizes; None picks by device ([`TaskSize::for_device`]).
    pub task_size: Option<TaskSize>,
    /// Skip torch.compile baselines.
    pub skip_compile: bool,
    /// How long the judge times one evaluation's contestants (rounds interleaved; at least
    /// the judge's minimum of rounds).
    pub timing_budget: Duration,
    /// Observe the workers' forwards from outside on the CPU (perf events; needs root).
    pub observe: bool,
    /// Start the next evaluation's judge and workers while the device still times the last
    /// one (`None`: on CUDA, not on CPU, where the lease is the whole machine).
    pub prestart: Option<bool>,
    /// With prestart, evaluations per device with processes alive at once.
    pub prestart_depth: usize,
    /// Aten operators candidates may dispatch beyond allocation, views and copies.
    pub allow_ops: Vec<String>,
    /// What keeps a timed evaluation's CPU its own (`--timing-cores`: the binary's default
    /// is `auto`; embedders and tests get `off` unless they ask, since pinning moves the
    /// whole process into a cpuset).
    pub timing_cores: TimingCores,
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
    /// What one evaluation's volume holds (bytes): everything its build and run may write.
    pub eval_disk_quota_bytes: u64,
    /// Memory the evaluations' tmpfs volumes may reserve together; None: with host
    /// admission, a quarter of the volume-memory budget (at least one volume), taken out of
    /// the episodes' default budget; without, nothing reserved.
    pub eval_volume_memory_bytes: Option<u64>,
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
            device: runtime::DeviceChoice::Auto,
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
            timing_budget: DEFAULT_TIMING_BUDGET,
            observe: true,
            prestart: None,
            prestart_depth: DEFAULT_PRESTART_DEPTH,
            allow_ops: Vec::new(),
            timing_cores: TimingCores::Off,
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
            eval_disk_quota_bytes: 2 << 30,
            eval_volume_memory_bytes: None,
        }
    }
}

/// The tasks' input sizes (`--task-size`), as the harness takes them
/// (`CUDA_AGENT_TASK_SIZE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TaskSize {
    /// The small, CPU-sized inputs.
    Small,
    /// The tasks' own inputs.
    Full,
}

impl TaskSize {
    /// Its name as the harness takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskSize::Small => "small",
            TaskSize::Full => "full",
        }
    }

    /// The size timing is meaningful at on `device`: small on the CPU, full on CUDA.
    pub fn for_device(device: runtime::Device) -> Self {
        match device {
            runtime::Device::Cpu => TaskSize::Small,
            runtime::Device::Cuda => TaskSize::Full,
        }
    }
}

impl ServerConfig {
    /// The directory the precompiled headers are kept in: `pch_dir`, else `pch/` in the data
    /// directory (`data_dir`, as the server resolved it).
    pub(crate) fn pch_root(&self, data_dir: &Path) -> PathBuf {
        self.pch_dir.clone().unwrap_or_else(|| data_dir.join("pch"))
    }

    /// The flag sets to precompile for on `device`: the configured ones, else its defaults.
    pub(crate) fn pch_variants_on(&self, device: runtime::Device) -> Vec<String> {
        self.pch_variants
            .clone()
            .unwrap_or_else(|| build::default_pch_variants(device))
    }
}
