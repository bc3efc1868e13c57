//! Wire types of the environment API (`/v1`). Field names follow Gymnasium
//! (`observation, reward, terminated, truncated, done, info`); tool schemas are OpenAI
//! function tools. The server derives its OpenAPI document from these types; the tools'
//! argument types ([`tools`]) derive the JSON schemas the tools are advertised with.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

mod chain;
pub mod observation;
pub mod tools;

pub use chain::{error_chain, ErrorChain};

/// Episode options a reset may set.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResetOptions {
    /// Most tool calls before the episode is truncated (default 200).
    pub max_turns: Option<u32>,
    /// Seconds of tool time before the episode is truncated (default 300).
    pub time_budget_s: Option<f64>,
}

/// `POST /v1/episodes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResetRequest {
    /// A task id; when absent one is sampled from `split`.
    pub task: Option<String>,
    /// Split to sample from (default `all`).
    pub split: Option<String>,
    /// Seed for sampling the task.
    pub seed: Option<u64>,
    /// Limits for this episode.
    pub options: Option<ResetOptions>,
    /// A task of the user's own, in place of `task`: the text of a Python file defining
    /// `Model`, `get_inputs` and `get_init_inputs` (as `POST /v1/evaluate` takes it), at most
    /// [`caps::TASK_SOURCE_BYTES`]. Its id is `custom/<hash>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_source: Option<String>,
    /// Idempotency key: a retried reset with the same key gets the first answer (the same
    /// episode) instead of a second episode, while the server that answered it remembers the
    /// key (the most recent [`caps::RESET_KEYS`]; not across restarts, which end the
    /// episode anyway). A client that fails over to another server sends the same key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// What the agent sees after a reset or a step.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Observation {
    /// The text for the agent: the task prompt after a reset, the tool output after a step.
    pub text: String,
    /// The tool that ran (absent after a reset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The tool call failed.
    #[serde(default)]
    pub is_error: bool,
    /// Structured details of the tool's result (the workspace's files after a reset).
    #[serde(default)]
    pub data: observation::ObservationData,
}

/// A task as listed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct TaskInfo {
    /// Stable id, such as `L1/1_ReLU`.
    pub id: String,
    /// Difficulty level.
    pub level: u8,
    /// SHA-256 of the task source.
    pub hash: String,
}

/// The limits an episode runs under.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct EpisodeLimits {
    /// Most tool calls.
    pub max_turns: u32,
    /// Seconds of tool time.
    pub time_budget_s: f64,
    /// Characters of tool output kept per stream.
    pub max_output_chars: usize,
    /// Workspace disk quota in bytes.
    pub disk_quota_bytes: u64,
}

/// `info` of a reset.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ResetInfo {
    /// The task.
    pub task: TaskInfo,
    /// OpenAI function-tool schemas of the tools.
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    /// The limits.
    pub limits: EpisodeLimits,
    /// Evaluation device (`cpu` or `cuda`).
    pub device: String,
    /// This answer is a replay of an earlier reset with the same `request_id`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
}

/// `POST /v1/episodes` answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ResetResponse {
    /// The new episode's id.
    pub episode_id: String,
    /// The task prompt and workspace listing.
    pub observation: Observation,
    /// Task, tools and limits.
    pub info: ResetInfo,
}

/// A tool call in the plain form.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PlainAction {
    /// Tool name.
    pub tool: String,
    /// Arguments: an object (or a JSON string holding one).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub arguments: Value,
}

/// The function part of an OpenAI tool call.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FunctionCall {
    /// Tool name.
    pub name: String,
    /// Arguments, usually a JSON string.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub arguments: Value,
}

/// A tool call in OpenAI's `tool_calls[i]` form.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OpenAiToolCall {
    /// The call id.
    #[serde(default)]
    pub id: Option<String>,
    /// Always `function`.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// The function.
    pub function: FunctionCall,
}

/// A tool call, in either form.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Action {
    /// `{tool, arguments}`.
    Plain(PlainAction),
    /// `{id, type, function: {name, arguments}}`.
    OpenAi(OpenAiToolCall),
}

impl Action {
    /// Tool name and arguments, whichever the form.
    pub fn parts(&self) -> (&str, &Value) {
        match self {
            Action::Plain(a) => (&a.tool, &a.arguments),
            Action::OpenAi(a) => (&a.function.name, &a.function.arguments),
        }
    }
}

/// `POST /v1/episodes/{id}/step`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StepRequest {
    /// The tool call.
    pub action: Action,
    /// Idempotency key: a retried step with the same key returns the first answer.
    #[serde(default)]
    pub request_id: Option<String>,
}

/// `info` of a step.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StepInfo {
    /// Turns taken so far, this one included.
    pub turn: u32,
    /// Seconds of tool time used so far.
    pub tool_time_s: f64,
    /// Tool calls left before the episode ends by itself (model_new.py is then submitted).
    #[serde(default)]
    pub turns_left: u32,
    /// Seconds of tool time left before the episode ends by itself (a command still running
    /// is cut and model_new.py is submitted). The observation's last line says the same.
    #[serde(default)]
    pub tool_time_left_s: f64,
    /// Why the episode was truncated, if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncation_reason: Option<String>,
    /// The final evaluation, on the step that ended the episode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<EvaluationResult>,
    /// This answer is a replay of an earlier one with the same request_id.
    #[serde(default)]
    pub replayed: bool,
    /// Seconds this step's command spent waiting for a CPU while none of its processes ran:
    /// the host was busy, and that time is not in `tool_time_s` (0 where nothing waited or
    /// the host cannot measure it: `/v1/info` `sandbox.cpu_accounting`). Left out when 0, so
    /// that answers logged before it replay as they were.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cpu_wait_s: f64,
}

/// Whether a figure is 0 (a field left out of an answer when it is).
fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// `POST /v1/episodes/{id}/step` answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StepResponse {
    /// The tool's output.
    pub observation: Observation,
    /// 0 on non-terminal steps; the final reward on the last.
    pub reward: f64,
    /// The agent submitted.
    pub terminated: bool,
    /// Turns, time or quota ran out.
    pub truncated: bool,
    /// `terminated || truncated`.
    pub done: bool,
    /// Turn count, timing, evaluation.
    pub info: StepInfo,
}

/// Lifecycle of an episode.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EpisodeStatus {
    /// Taking steps.
    Running,
    /// The final evaluation is running.
    Evaluating,
    /// Ended by Submit.
    Terminated,
    /// Ended by a limit, an idle timeout or a server restart.
    Truncated,
    /// Closed by DELETE before it ended.
    Closed,
}

/// `GET /v1/episodes/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EpisodeState {
    /// The id.
    pub episode_id: String,
    /// The task.
    pub task: TaskInfo,
    /// Status.
    pub status: EpisodeStatus,
    /// Turns taken.
    pub turn: u32,
    /// Seconds of tool time used.
    pub tool_time_s: f64,
    /// The limits.
    pub limits: EpisodeLimits,
    /// The current todo list.
    pub todos: Vec<tools::TodoItem>,
    /// Why it was truncated, if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncation_reason: Option<String>,
    /// The final evaluation, once done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<EvaluationResult>,
}

/// One record of a trajectory log: `{"kind", "time", "body"}`, the body's shape set by the
/// kind. The kind is written first: a reader can tell a log's last kind from the head of its
/// last line.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
// Most records are steps, as large as the largest kind: boxing would only add an allocation
// to each.
#[allow(clippy::large_enum_variant)]
pub enum TrajectoryRecord {
    /// The episode started.
    Reset {
        /// Seconds since the Unix epoch.
        time: f64,
        /// The request, the answer and the task.
        body: ResetRecord,
    },
    /// A tool call was answered.
    Step {
        /// Seconds since the Unix epoch.
        time: f64,
        /// The call and its answer.
        body: StepRecord,
    },
    /// The episode ended and was judged.
    Final {
        /// Seconds since the Unix epoch.
        time: f64,
        /// The result and the files judged.
        body: FinalRecord,
    },
    /// The episode was cut short by the server (idle timeout, restart).
    Truncated {
        /// Seconds since the Unix epoch.
        time: f64,
        /// Why, and when.
        body: TruncatedRecord,
    },
    /// The episode was closed by a DELETE: it is gone for the API, across restarts too.
    Closed {
        /// Seconds since the Unix epoch.
        time: f64,
        /// When.
        body: ClosedRecord,
    },
}

impl TrajectoryRecord {
    /// The kind as written: `reset`, `step`, `final`, `truncated` or `closed`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Reset { .. } => "reset",
            Self::Step { .. } => "step",
            Self::Final { .. } => "final",
            Self::Truncated { .. } => "truncated",
            Self::Closed { .. } => "closed",
        }
    }

    /// Seconds since the Unix epoch when it was written.
    pub fn time(&self) -> f64 {
        match self {
            Self::Reset { time, .. }
            | Self::Step { time, .. }
            | Self::Final { time, .. }
            | Self::Truncated { time, .. }
            | Self::Closed { time, .. } => *time,
        }
    }
}

// Record bodies: fields in alphabetical order, the order the server wrote them in when they
// were JSON maps.

/// The body of a `reset` record.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ResetRecord {
    /// The reset as asked.
    pub request: ResetRequest,
    /// The answer given.
    pub response: ResetResponse,
    /// The task's Python source, so that an inline task can be rebuilt from the log alone
    /// (absent in logs older than this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_source: Option<String>,
}

/// The body of a `step` record.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StepRecord {
    /// The call as sent (arguments as given: an object or a JSON string).
    pub action: PlainAction,
    /// The call's idempotency key, if it had one (null otherwise).
    pub request_id: Option<String>,
    /// The answer given.
    pub response: StepResponse,
}

/// The body of a `final` record.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct FinalRecord {
    /// The files judged, by relative path (empty in logs older than this field).
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// The final evaluation.
    pub result: Option<EvaluationResult>,
    /// The task's id.
    #[serde(default)]
    pub task: String,
}

/// The body of a `truncated` record.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct TruncatedRecord {
    /// `idle_timeout` or `server_restart`.
    pub reason: String,
    /// Turns taken by then.
    pub turn: u32,
}

/// The body of a `closed` record.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ClosedRecord {
    /// Turns taken by then.
    pub turn: u32,
}

/// `GET /v1/episodes/{id}/trajectory`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Trajectory {
    /// The episode.
    pub episode_id: String,
    /// Every record so far, in order.
    pub records: Vec<TrajectoryRecord>,
}

/// A task to evaluate against: an id, or an inline source.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum TaskRef {
    /// A task id.
    Id(String),
    /// A Python file defining Model, get_inputs and get_init_inputs.
    Source {
        /// The source.
        source: String,
    },
}

/// A solution: the text of `model_new.py`, or a set of files.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum SolutionRef {
    /// The text of model_new.py.
    Text(String),
    /// Files by relative path (model_new.py plus, say, kernels/add.cu).
    Files {
        /// Path -> contents.
        files: BTreeMap<String, String>,
    },
}

/// Options of an evaluation.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EvaluateOptions {
    /// `cpu` or `cuda` (default: the server's device).
    pub device: Option<String>,
    /// Absolute and relative tolerance (default by dtype).
    pub tolerance: Option<f64>,
    /// Idempotency key: a retry with the same key joins the evaluation still running under
    /// it, or gets its verdict once it has one, instead of paying for a second evaluation
    /// (the most recent [`caps::EVALUATION_KEYS`] keys, in the server's memory). A client
    /// that fails over to another server sends the same key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// `POST /v1/evaluate`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EvaluateRequest {
    /// The task.
    pub task: TaskRef,
    /// The solution.
    pub solution: SolutionRef,
    /// Options.
    #[serde(default)]
    pub options: Option<EvaluateOptions>,
}

/// Median times in milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Times {
    /// Eager PyTorch.
    pub eager: Option<f64>,
    /// torch.compile.
    pub compile: Option<f64>,
    /// The candidate.
    pub candidate: Option<f64>,
}

/// Speedups of the candidate (baseline time / candidate time).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Speedups {
    /// Over eager.
    pub eager: Option<f64>,
    /// Over torch.compile.
    pub compile: Option<f64>,
}

/// The result of a final evaluation.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct EvaluationResult {
    /// Milestone reward: -1, 1, 2 or 3.
    pub reward: f64,
    /// Correct on every input set and no rule broken.
    pub correct: bool,
    /// Why not, naming the rule (`wrong_output: input set 3 of 5: ...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Median times.
    pub times_ms: Times,
    /// Speedups.
    pub speedup: Speedups,
    /// Where and how it was judged: task, device, the build, where the time went, the judge's
    /// checks and timing.
    pub details: EvaluationDetails,
}

/// The details of an evaluation. What the server itself knows is typed; what the judge
/// reports about its checks and timing (`check`, `timing`, `env`) is the judge's own
/// diagnostic JSON, passed through.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct EvaluationDetails {
    /// The task's id.
    #[serde(default)]
    pub task: String,
    /// `cpu` or `cuda`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The same sources had been built before: no build step ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_cache_hit: Option<bool>,
    /// The build's report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<BuildDetails>,
    /// Where the evaluation's time went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases: Option<EvaluationPhases>,
    /// Seconds from the request to the verdict.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elapsed_s: Option<f64>,
    /// Judged under landlock and seccomp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confined: Option<bool>,
    /// The rule the candidate broke.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// The tail of the candidate worker's own output: diagnostics, never evidence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_log: Option<String>,
    /// The 90% band of each speedup (`eager`, `compile`): `[low, high]`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub noise_band: BTreeMap<String, [f64; 2]>,
    /// The judge's checks (errors, input sets, stages' seconds, memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub check: Option<Value>,
    /// The judge's per-contestant timing statistics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub timing: Option<Value>,
    /// The judge's environment (versions, device name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub env: Option<Value>,
    /// The task's kind where it is not a kernel (`recall`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The server, not the candidate, failed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub server_error: bool,
    /// Where the forwards' CPU time went, sampled by the kernel from outside the workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<ObservedCompute>,
}

/// What the server saw of the workers' CPU from outside their processes while they ran
/// forwards: the share of samples in PyTorch's own compute library (`libtorch_cpu.so`) and in
/// the code of the reference's own kernels there, for the candidate and for the eager
/// reference. A candidate whose time is where the reference's is computed with PyTorch
/// (`pytorch_compute`), whatever its own trace said.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ObservedCompute {
    /// The kernel let the server observe; where not, `reason` says why and no rule rests on it.
    pub available: bool,
    /// Why the observation is missing or decided nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The candidate's forwards (the judge's calls) the samples are from.
    #[serde(default)]
    pub candidate_forwards: u64,
    /// Samples inside the candidate's forwards.
    pub candidate_samples: u64,
    /// Their share in PyTorch's compute library (OpenMP's idle spinning left out).
    pub candidate_torch_share: f64,
    /// The eager reference's forwards.
    #[serde(default)]
    pub reference_forwards: u64,
    /// Samples inside the eager reference's forwards.
    pub reference_samples: u64,
    /// Their share in PyTorch's compute library.
    pub reference_torch_share: f64,
    /// The candidate's share in the code of the reference's own kernels (the pages of
    /// `libtorch_cpu.so` where the reference's forwards spent their time there).
    pub candidate_kernel_share: f64,
    /// The reference's share in that code.
    pub reference_kernel_share: f64,
    /// The candidate's CPU time per forward in that code over the reference's (about 1 for a
    /// forward that runs the reference's kernels, 0 for one that runs its own).
    #[serde(default)]
    pub kernel_time_ratio: f64,
    /// `kernel_time_ratio` at or above this breaks `pytorch_compute`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_time_threshold: Option<f64>,
    /// `candidate_torch_share` at or above this breaks `pytorch_compute`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub library_threshold: Option<f64>,
    /// The libraries where the candidate's forwards spent the most samples.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidate_top: Vec<LibraryShare>,
    /// The libraries where the reference's forwards spent the most samples.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reference_top: Vec<LibraryShare>,
    /// Samples the kernel could not record (a full ring buffer).
    #[serde(default)]
    pub lost: u64,
}

/// One library's share of a set of samples.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct LibraryShare {
    /// The library's file name.
    pub library: String,
    /// Its share of the samples.
    pub share: f64,
}

/// What the build step of an evaluation reported.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct BuildDetails {
    /// It built.
    pub built: bool,
    /// Why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Seconds the build took, by the builder's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_s: Option<f64>,
    /// The extensions built.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extensions: Vec<String>,
}

/// Where one evaluation's time went, in seconds.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct EvaluationPhases {
    /// Directories, uids, files.
    pub setup_s: f64,
    /// Waiting for a build slot (0 on a cache hit).
    pub build_queue_s: f64,
    /// The build (0 on a cache hit).
    pub build_s: f64,
    /// Waiting for the device: with prestart, from the judge's start until it waits at its
    /// gate and the device is free (or until it ended without needing the device).
    pub lease_wait_s: f64,
    /// Checking and timing on the device: from the lease to the judge's end.
    pub judge_s: f64,
    /// How long the device lease was held (lease to release): what the evaluation cost the
    /// device, the figure throughput depends on. 0 when the judge ended without the device.
    #[serde(default)]
    pub lease_held_s: f64,
    /// Of the lease: before the judge was told to go (the compile cache handed over, the
    /// outside observer attached).
    #[serde(default)]
    pub lease_to_go_s: f64,
    /// Of the lease: after the judge ended (the candidate's worker killed and reaped).
    #[serde(default)]
    pub teardown_s: f64,
}

/// `GET /v1/health` and `GET /v1/ready` when the answer is yes (a 503 [`ErrorBody`] says
/// why not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ProbeAnswer {
    /// `ok` (alive) or `ready` (takes new episodes and evaluations).
    pub status: ProbeStatus,
}

/// What a probe that answers 200 says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProbeStatus {
    /// The process serves (`/v1/health`).
    Ok,
    /// A new episode would be admitted (`/v1/ready`).
    Ready,
}

/// Error answer body.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Machine-readable code (`unknown_episode`, `bad_request`, ...).
    pub code: String,
    /// Human-readable message.
    pub message: String,
}

/// `GET /v1/tasks`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TaskList {
    /// Every task.
    pub tasks: Vec<TaskInfo>,
    /// Split names.
    pub splits: Vec<String>,
}

/// Caps on the fields of requests. The server checks them (through [`Capped`]) before it
/// looks at anything else, so that no field can grow its memory, its logs or its metrics
/// beyond these sizes.
pub mod caps {
    /// Ids: task ids, request ids, OpenAI call ids (bytes).
    pub const ID: usize = 256;
    /// Split names and small enumerations such as a device or the OpenAI call type (bytes).
    pub const NAME: usize = 64;
    /// A tool name (bytes).
    pub const TOOL_NAME: usize = 64;
    /// A tool call's arguments, as JSON (bytes).
    pub const ARGUMENTS_BYTES: usize = 1 << 20;
    /// An inline task source of `POST /v1/evaluate` (bytes).
    pub const TASK_SOURCE_BYTES: usize = 1 << 20;
    /// Files in one solution.
    pub const SOLUTION_FILES: usize = 64;
    /// A solution file's path (bytes).
    pub const SOLUTION_PATH: usize = 256;
    /// A solution file's contents (bytes).
    pub const SOLUTION_FILE_BYTES: usize = 4 << 20;
    /// The largest `options.max_turns` of a reset.
    pub const MAX_TURNS: u32 = 100_000;
    /// Reset idempotency keys a server remembers (each with its episode's id): the oldest
    /// is forgotten beyond this, so memory stays bounded whatever clients send.
    pub const RESET_KEYS: usize = 65_536;
    /// Evaluation idempotency keys a server remembers (each with its verdict, some KiB).
    pub const EVALUATION_KEYS: usize = 1_024;
}

/// A request field over its cap (see [`caps`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldTooLong {
    /// The field, as a JSON path (`action.tool`, `solution.files["kernels/a.cu"]`).
    pub field: String,
    /// Its size (bytes, entries or value).
    pub len: usize,
    /// The cap.
    pub max: usize,
}

impl std::fmt::Display for FieldTooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is {} long; the most accepted is {}",
            self.field, self.len, self.max
        )
    }
}

impl std::error::Error for FieldTooLong {}

/// A request whose fields have caps.
pub trait Capped {
    /// The first field over its cap, if any.
    fn check_caps(&self) -> Result<(), FieldTooLong>;
}

fn cap(field: impl FnOnce() -> String, len: usize, max: usize) -> Result<(), FieldTooLong> {
    if len > max {
        return Err(FieldTooLong {
            field: field(),
            len,
            max,
        });
    }
    Ok(())
}

fn cap_opt(field: &str, value: Option<&String>, max: usize) -> Result<(), FieldTooLong> {
    cap(|| field.to_string(), value.map_or(0, String::len), max)
}

/// Bytes of `v` as compact JSON, counted without building the text and stopped soon after
/// `max`.
fn json_len(v: &Value, max: usize) -> usize {
    struct Counter {
        n: usize,
        max: usize,
    }
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.n += buf.len();
            if self.n > self.max {
                return Err(std::io::Error::other("over the cap"));
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Counter { n: 0, max };
    let _ = serde_json::to_writer(&mut c, v);
    c.n
}

impl Capped for ResetRequest {
    fn check_caps(&self) -> Result<(), FieldTooLong> {
        cap_opt("task", self.task.as_ref(), caps::ID)?;
        cap_opt("split", self.split.as_ref(), caps::NAME)?;
        cap_opt("request_id", self.request_id.as_ref(), caps::ID)?;
        cap_opt(
            "task_source",
            self.task_source.as_ref(),
            caps::TASK_SOURCE_BYTES,
        )?;
        let turns = self.options.as_ref().and_then(|o| o.max_turns).unwrap_or(0);
        cap(
            || "options.max_turns".into(),
            turns as usize,
            caps::MAX_TURNS as usize,
        )
    }
}

impl Capped for StepRequest {
    fn check_caps(&self) -> Result<(), FieldTooLong> {
        cap_opt("request_id", self.request_id.as_ref(), caps::ID)?;
        if let Action::OpenAi(a) = &self.action {
            cap_opt("action.id", a.id.as_ref(), caps::ID)?;
            cap_opt("action.type", a.kind.as_ref(), caps::NAME)?;
        }
        let (tool, arguments) = self.action.parts();
        cap(|| "action.tool".into(), tool.len(), caps::TOOL_NAME)?;
        cap(
            || "action.arguments".into(),
            json_len(arguments, caps::ARGUMENTS_BYTES),
            caps::ARGUMENTS_BYTES,
        )
    }
}

impl Capped for EvaluateRequest {
    fn check_caps(&self) -> Result<(), FieldTooLong> {
        match &self.task {
            TaskRef::Id(id) => cap(|| "task".into(), id.len(), caps::ID)?,
            TaskRef::Source { source } => cap(
                || "task.source".into(),
                source.len(),
                caps::TASK_SOURCE_BYTES,
            )?,
        }
        match &self.solution {
            SolutionRef::Text(t) => cap(|| "solution".into(), t.len(), caps::SOLUTION_FILE_BYTES)?,
            SolutionRef::Files { files } => {
                cap(
                    || "solution.files".into(),
                    files.len(),
                    caps::SOLUTION_FILES,
                )?;
                for (path, text) in files {
                    cap(
                        || "solution.files (a path)".into(),
                        path.len(),
                        caps::SOLUTION_PATH,
                    )?;
                    cap(
                        || format!("solution.files[{path:?}]"),
                        text.len(),
                        caps::SOLUTION_FILE_BYTES,
                    )?;
                }
            }
        }
        if let Some(o) = &self.options {
            cap_opt("options.device", o.device.as_ref(), caps::NAME)?;
            cap_opt("options.request_id", o.request_id.as_ref(), caps::ID)?;
        }
        Ok(())
    }
}
