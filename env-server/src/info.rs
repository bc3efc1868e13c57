//! What `GET /v1/info` answers: the server's version, device, capacity, limits, sandbox and
//! defaults (fixed at start), and the moment's counts (open episodes, evaluations, device
//! leases, reserved volume memory).
//!
//! The answer was once a `serde_json::Value`, whose objects serialise with their keys sorted.
//! Clients may compare or hash it, so the typed answer keeps those bytes: each struct below
//! declares its fields in alphabetical order, and the foreign structs inside it (the sandbox's
//! status, the admission bounds) go through [`sorted`]. A test checks the whole answer against
//! its own sorted re-serialisation.

use std::sync::atomic::Ordering;
use std::time::Duration;

use agent_tools::sandbox::SandboxStatus;
use serde::{Serialize, Serializer};

use crate::admission::Admission;
use crate::build::Toolchain;
use crate::config::{default_time_budget, ServerConfig, TaskSize};
use crate::evaluation::{DeviceSlot, EvaluationVolumeInfo, TimingIsolationInfo};
use crate::http::HttpLimits;
use crate::retention::TrajectoryRetention;
use crate::runtime::{Device, PythonInfo};

/// The whole `/v1/info` answer. Fields in alphabetical order (see the module's docs).
#[derive(Debug, Clone, Serialize)]
pub struct ServerInfo {
    /// The API's version: `v1`.
    pub api: &'static str,
    /// Whether calls need a bearer token.
    pub auth: bool,
    /// How candidates are built.
    pub build: BuildInfo,
    /// Bounds on the work the server takes.
    pub capacity: Capacity,
    /// The evaluation device.
    pub device: Device,
    /// Each device lease's use so far (filled per answer).
    pub device_slots: Vec<SlotUse>,
    /// What a reset without options gets.
    pub episode_defaults: EpisodeDefaults,
    /// Evaluations waiting or running (filled per answer).
    pub evaluations_in_flight: usize,
    /// The GPUs' names torch reports (empty on the CPU host).
    pub gpus: Vec<String>,
    /// Limits of the HTTP layer.
    pub http: HttpInfo,
    /// What the judge times.
    pub judge: JudgeInfo,
    /// The server's name.
    pub name: &'static str,
    /// Whether the workers are observed from outside, and whether that is judged.
    pub observer: ObserverInfo,
    /// Episodes open now (filled per answer).
    pub open_episodes: usize,
    /// What stays on disk and in memory, and for how long.
    pub retention: RetentionInfo,
    /// What the sandbox enforces on this host.
    #[serde(serialize_with = "sorted")]
    pub sandbox: SandboxStatus,
    /// The tasks' input sizes in force: `small` or `full`.
    pub task_size: TaskSize,
    /// Tasks served.
    pub tasks: usize,
    /// What keeps a timed evaluation's CPU its own: its cores (`pinned`), its priority
    /// (`priority`) or nothing beyond the background priority of builds and commands (`none`).
    pub timing_isolation: TimingIsolationInfo,
    /// torch's version.
    pub torch: String,
    /// The CUDA version torch was built for, if any.
    pub torch_cuda: Option<String>,
    /// The server's crate version.
    pub version: &'static str,
}

/// `build` of [`ServerInfo`].
#[derive(Debug, Clone, Serialize)]
pub struct BuildInfo {
    /// `TORCH_CUDA_ARCH_LIST` builds compile for (None on the CPU).
    pub cuda_arch_list: Option<String>,
    /// The flag sets torch/extension.h is precompiled for (None: no precompiled headers).
    pub precompiled_headers: Option<Vec<String>>,
}

/// `capacity` of [`ServerInfo`].
#[derive(Debug, Clone, Serialize)]
pub struct Capacity {
    /// The bounds admission derived from the host.
    #[serde(serialize_with = "sorted")]
    pub admission: AdmissionInfo,
    /// Device leases (GPUs; 1 on the CPU).
    pub device_slots: usize,
    /// Each evaluation's volume (what its build and run may write) and the memory the
    /// volumes reserve.
    pub evaluation_volume: EvaluationVolumeInfo,
    /// Builds at once.
    pub max_builds: usize,
    /// Commands at once, as applied.
    pub max_commands: usize,
    /// Most open episodes.
    pub max_episodes: usize,
    /// Most evaluations waiting.
    pub max_eval_queue: usize,
    /// Evaluations per device started ahead of their lease (None: prestart off).
    pub prestart_depth: Option<usize>,
}

/// `capacity.admission` of [`ServerInfo`]: the bounds, and what the volumes reserve now.
#[derive(Debug, Clone, Serialize)]
pub struct AdmissionInfo {
    /// The bounds.
    #[serde(flatten)]
    pub bounds: Admission,
    /// Memory the open episodes' tmpfs volumes reserve now (filled per answer; absent where
    /// volumes reserve none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume_memory_reserved_bytes: Option<u64>,
}

/// One entry of `device_slots` in [`ServerInfo`].
#[derive(Debug, Clone, Serialize)]
pub struct SlotUse {
    /// Seconds the lease was held.
    pub busy_s: f64,
    /// GPU ordinal, or 0 for the CPU.
    pub index: usize,
    /// Leases granted.
    pub leases: u64,
    /// Seconds the device sat free while an evaluation of it waited.
    pub starved_s: f64,
}

impl SlotUse {
    /// `slot`'s counters now.
    pub fn of(slot: &DeviceSlot) -> Self {
        Self {
            busy_s: slot.busy_ms.load(Ordering::Relaxed) as f64 / 1e3,
            index: slot.index,
            leases: slot.leases.load(Ordering::Relaxed),
            starved_s: slot.starved_ms.load(Ordering::Relaxed) as f64 / 1e3,
        }
    }
}

/// `episode_defaults` of [`ServerInfo`]: what a reset without options gets, and each device's
/// default budget (a budget given to the server replaces its device's).
#[derive(Debug, Clone, Serialize)]
pub struct EpisodeDefaults {
    /// The default tool-time budget of each device.
    pub device_default_time_budget_s: PerDevice,
    /// The turn limit.
    pub max_turns: u32,
    /// Where the budget comes from: `--time-budget-s` or `the device's default`.
    pub time_budget_from: &'static str,
    /// The tool-time budget.
    pub time_budget_s: f64,
}

/// `judge` of [`ServerInfo`]: what an evaluation times.
#[derive(Debug, Clone, Serialize)]
pub struct JudgeInfo {
    /// Whether torch.compile is timed as a baseline (`--skip-compile` turns it off; the
    /// compile milestone is then never reached).
    pub compile_baseline: bool,
    /// Seconds the contestants are timed for, rounds interleaved (`--timing-budget-s`).
    pub timing_budget_s: f64,
}

/// A number per device.
#[derive(Debug, Clone, Serialize)]
pub struct PerDevice {
    /// On the CPU.
    pub cpu: f64,
    /// On CUDA.
    pub cuda: f64,
}

/// `http` of [`ServerInfo`].
#[derive(Debug, Clone, Serialize)]
pub struct HttpInfo {
    /// Seconds a client has to send a body.
    pub body_timeout_s: f64,
    /// Seconds a client has to send its headers.
    pub header_timeout_s: f64,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Most connections at once.
    pub max_connections: usize,
    /// Most connections of one client address at once.
    pub max_connections_per_client: usize,
    /// Most requests handled at once.
    pub max_requests_in_flight: usize,
    /// Seconds an answer waits for a client that stopped reading.
    pub write_timeout_s: f64,
}

impl HttpInfo {
    /// The HTTP layer's `limits` and the body bound.
    pub fn new(limits: &HttpLimits, max_body_bytes: usize) -> Self {
        Self {
            body_timeout_s: limits.body_timeout.as_secs_f64(),
            header_timeout_s: limits.header_timeout.as_secs_f64(),
            max_body_bytes,
            max_connections: limits.max_connections,
            max_connections_per_client: limits.max_connections_per_client,
            max_requests_in_flight: limits.max_requests_in_flight,
            write_timeout_s: limits.write_timeout.as_secs_f64(),
        }
    }
}

/// `observer` of [`ServerInfo`].
#[derive(Debug, Clone, Serialize)]
pub struct ObserverInfo {
    /// Whether its finding can fail a verdict (`pytorch_compute`).
    pub judged: bool,
    /// Whether the workers are observed from outside.
    pub on: bool,
    /// Why it is off or not judged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl ObserverInfo {
    /// What the observer does: `probed` is whether the kernel lets the server observe (Err:
    /// why not), `asked` whether it was asked to, on `device`.
    pub fn new(probed: &Result<(), String>, asked: bool, device: Device) -> Self {
        let (on, judged, reason) = match probed {
            Err(e) => (false, false, Some(e.clone())),
            Ok(()) if !asked => (false, false, Some("turned off (--no-observe)".into())),
            Ok(()) if device != Device::Cpu => (
                true,
                false,
                Some("on a GPU the observation is reported, not judged".into()),
            ),
            Ok(()) => (true, true, None),
        };
        Self { judged, on, reason }
    }
}

/// `retention` of [`ServerInfo`].
#[derive(Debug, Clone, Serialize)]
pub struct RetentionInfo {
    /// Most bytes one build-cache entry may hold.
    pub build_cache_entry_max_bytes: u64,
    /// Most bytes of the build cache.
    pub build_cache_max_bytes: u64,
    /// Seconds a finished episode stays in memory.
    pub finished_grace_s: f64,
    /// Most trajectory logs kept.
    pub keep_trajectories: Option<usize>,
    /// Largest trajectory log of an episode.
    pub max_log_bytes: u64,
    /// Oldest trajectory log kept, seconds.
    pub trajectory_max_age_s: Option<f64>,
    /// Most bytes of trajectory logs.
    pub trajectory_max_bytes: Option<u64>,
}

impl RetentionInfo {
    /// The trajectories' retention and the other bounds on what stays.
    pub fn new(
        trajectories: &TrajectoryRetention,
        finished_grace: Duration,
        max_log_bytes: u64,
        build_cache_max_bytes: u64,
        build_cache_entry_max_bytes: u64,
    ) -> Self {
        Self {
            build_cache_entry_max_bytes,
            build_cache_max_bytes,
            finished_grace_s: finished_grace.as_secs_f64(),
            keep_trajectories: trajectories.keep,
            max_log_bytes,
            trajectory_max_age_s: trajectories.max_age.map(|d| d.as_secs_f64()),
            trajectory_max_bytes: trajectories.max_bytes,
        }
    }
}

/// What start found that `/v1/info` reports beside the configuration.
#[derive(Debug)]
pub struct Probed<'a> {
    /// The evaluation device.
    pub device: Device,
    /// Python and torch.
    pub python: &'a PythonInfo,
    /// The build toolchain.
    pub toolchain: &'a Toolchain,
    /// The precompiled headers' flag sets asked for.
    pub variants: Vec<String>,
    /// The admission bounds.
    pub admission: Admission,
    /// What the sandbox enforces.
    pub sandbox: SandboxStatus,
    /// Whether the workers can be observed from outside (Err: why not).
    pub observer: &'a Result<(), String>,
    /// Tasks served.
    pub tasks: usize,
    /// The tasks' input sizes in force.
    pub task_size: TaskSize,
    /// Evaluations per device started ahead of their lease (None: prestart off).
    pub prestart_depth: Option<usize>,
    /// The evaluations' volumes.
    pub evaluation_volume: EvaluationVolumeInfo,
    /// The timing isolation in force.
    pub timing_isolation: TimingIsolationInfo,
}

impl ServerInfo {
    /// The answer for a server started with `cfg` on what start `found`; the counts are
    /// filled per answer ([`ServerInfo::at`]).
    pub fn new(cfg: &ServerConfig, found: Probed<'_>) -> Self {
        let device = found.device;
        let gpus = if device == Device::Cuda {
            found.python.gpus
        } else {
            0
        };
        let time_budget = cfg.time_budget.unwrap_or(default_time_budget(device));
        ServerInfo {
            api: "v1",
            auth: cfg.api_key.is_some(),
            build: BuildInfo {
                cuda_arch_list: found.toolchain.cuda_arch_list.clone(),
                precompiled_headers: found.toolchain.pch_dir.as_ref().map(|_| found.variants),
            },
            capacity: Capacity {
                admission: AdmissionInfo {
                    bounds: found.admission,
                    volume_memory_reserved_bytes: None,
                },
                device_slots: gpus.max(1),
                evaluation_volume: found.evaluation_volume,
                max_builds: cfg.max_builds,
                max_commands: found.admission.max_commands,
                max_episodes: cfg.max_episodes,
                max_eval_queue: cfg.max_eval_queue,
                prestart_depth: found.prestart_depth,
            },
            device,
            device_slots: Vec::new(),
            // What a reset without options gets, and what each device's default is (a budget
            // given to the server replaces the default of its device).
            episode_defaults: EpisodeDefaults {
                device_default_time_budget_s: PerDevice {
                    cpu: default_time_budget(Device::Cpu).as_secs_f64(),
                    cuda: default_time_budget(Device::Cuda).as_secs_f64(),
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
            gpus: found.python.gpu_names.clone(),
            http: HttpInfo::new(&cfg.http, cfg.max_body_bytes),
            judge: JudgeInfo {
                compile_baseline: !cfg.skip_compile,
                timing_budget_s: cfg.timing_budget.as_secs_f64(),
            },
            name: "cuda-agent env-server",
            observer: ObserverInfo::new(found.observer, cfg.observe, device),
            open_episodes: 0,
            retention: RetentionInfo::new(
                &cfg.trajectory_retention,
                cfg.finished_grace,
                cfg.max_log_bytes,
                cfg.build_cache_max_bytes,
                cfg.build_cache_entry_max_bytes,
            ),
            sandbox: found.sandbox,
            task_size: found.task_size,
            tasks: found.tasks,
            timing_isolation: found.timing_isolation,
            torch: found.python.torch.clone(),
            torch_cuda: found.python.torch_cuda.clone(),
            version: env!("CARGO_PKG_VERSION"),
        }
    }

    /// This answer with the moment's counts filled in.
    pub fn at(
        &self,
        open_episodes: usize,
        volume_memory_reserved_bytes: Option<u64>,
        evaluations_in_flight: usize,
        slots: &[DeviceSlot],
    ) -> Self {
        let mut now = self.clone();
        now.open_episodes = open_episodes;
        now.capacity.admission.volume_memory_reserved_bytes = volume_memory_reserved_bytes;
        now.evaluations_in_flight = evaluations_in_flight;
        now.device_slots = slots.iter().map(SlotUse::of).collect();
        now
    }
}

/// Serialises `value` with every object's keys sorted, as a `serde_json::Value` would: for
/// the structs of other modules and crates, whose field order is theirs.
fn sorted<T: Serialize, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
    serde_json::to_value(value)
        .map_err(serde::ser::Error::custom)?
        .serialize(s)
}

/// The answer's JSON, as logged at start.
impl std::fmt::Display for ServerInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = serde_json::to_string(self).map_err(|_| std::fmt::Error)?;
        f.write_str(&text)
    }
}
