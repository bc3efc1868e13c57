//! Episodes: a workspace, a toolbox, limits and a trajectory log each; many at once.
//!
//! This file holds the episodes' life around their steps (reset, state, close, expiry,
//! recovery); one step, from the tool call to its logged answer, is [`step`]'s.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as SyncMutex, RwLock};
use std::time::{Duration, Instant};

use agent_tools::sandbox::{CpuPriority, QuotaEnforcement, UidLease, Volume, VolumeLimits};
use agent_tools::{create_private_dir, CallError, Jail, Sandbox, ToolLimits, Toolbox, Workspace};
use env_api::{
    observation::{ResetData, ToolData},
    ClosedRecord, EpisodeLimits, EpisodeState, EpisodeStatus, ErrorChain, EvaluationResult,
    Observation, ResetInfo, ResetRecord, ResetRequest, ResetResponse, TaskInfo, TrajectoryRecord,
    TruncatedRecord,
};
use kernelbench::{Task, TaskSet};
use tokio::sync::Mutex;

mod step;

use crate::admission::{HostBusy, VolumeBudget, VolumeReservation};
use crate::drain::Drain;
use crate::evaluation::Evaluator;
use crate::idempotency::{body_digest, BodyDigest, KeyReused, Keys};
use crate::retention;
use crate::runtime::{Device, PythonInfo, WORKSPACE_FILES};
use crate::trajectory::{self, is_episode_id, TrajectoryLog};

/// Errors of episode calls (mapped to HTTP answers by the API layer).
#[derive(Debug, thiserror::Error)]
pub enum EpisodeError {
    /// No episode with that id.
    #[error("no episode {0}")]
    Unknown(String),
    /// The task id or split is unknown.
    #[error(transparent)]
    Task(#[from] kernelbench::TaskError),
    /// The call is not a valid tool call.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The episode has ended.
    #[error("episode {0} has ended; reset a new one")]
    Ended(String),
    /// Too many episodes are open.
    #[error("the server is at capacity ({0} open episodes); retry later")]
    AtCapacity(usize),
    /// The host is short of memory for another episode (available memory under the reserve,
    /// or no room for its volume in the volume-memory budget).
    #[error(transparent)]
    HostBusy(#[from] HostBusy),
    /// A resource episodes share (the uid pool) is used up.
    #[error("no uid for a new episode (retry later)")]
    Exhausted(#[source] agent_tools::SandboxError),
    /// A bad option value.
    #[error("{0}")]
    BadRequest(String),
    /// Something on the server's side failed: what it was doing, and the error it met, if
    /// one (its source, printed after the message by the chain).
    #[error("internal error: {what}")]
    Internal {
        /// What failed.
        what: String,
        /// The error met.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The server is draining before it stops: no new episodes or steps.
    #[error(transparent)]
    Draining(#[from] crate::drain::Draining),
    /// A reset's `request_id` came again with another request.
    #[error(transparent)]
    KeyReused(#[from] crate::idempotency::KeyReused),
}

/// Settings of the episode manager.
#[derive(Debug, Clone)]
pub struct EpisodeConfig {
    /// The data directory (episodes/, trajectories/ below it).
    pub data_dir: PathBuf,
    /// Default turn limit.
    pub max_turns: u32,
    /// Default tool-time budget.
    pub time_budget: Duration,
    /// Most open episodes.
    pub max_episodes: usize,
    /// Workspace disk quota.
    pub disk_quota_bytes: u64,
    /// An episode idle this long is truncated and cleaned up.
    pub idle_timeout: Duration,
    /// A finished episode stays in memory this long; after that its state and trajectory are
    /// read back from its log when asked for.
    pub finished_grace: Duration,
    /// Time limit of blocking file work in a request (the log's fsync, the quota walk,
    /// creating and removing a workspace); past it the request fails instead of waiting.
    pub io_timeout: Duration,
    /// An episode whose trajectory log has grown past this is truncated (`log_quota`); the
    /// step that crosses it and the final record are still logged.
    pub max_log_bytes: u64,
    /// Most commands (Bash steps) running at once over all episodes; more wait their turn.
    pub max_commands: usize,
    /// What the host admits (a new episode is refused while its memory is short).
    pub admission: crate::admission::Admission,
    /// Tool output limits.
    pub tool_limits: ToolLimits,
    /// Environment every tool process gets on top of the standard one.
    pub extra_env: Vec<(String, String)>,
    /// GPUs to spread episodes' own processes over (0 on CPU machines).
    pub gpus: usize,
}

struct Episode {
    id: String,
    task: Task,
    dir: PathBuf,
    toolbox: Option<Toolbox>,
    limits: EpisodeLimits,
    turn: u32,
    tool_time: Duration,
    status: EpisodeStatus,
    truncation_reason: Option<String>,
    result: Option<EvaluationResult>,
    /// request_ids answered so far. The answers themselves stay in the trajectory log (read
    /// back on the rare retry), so memory does not grow with the output of every turn.
    answered: HashSet<String>,
    log: Option<TrajectoryLog>,
    /// Bytes of the trajectory log so far.
    log_bytes: u64,
    last_active: Instant,
    /// The storage the workspace lives on, bounded by the disk quota, with the host memory
    /// reserved for it.
    volume: Option<HeldVolume>,
    /// The uid the episode's processes run as; released (its processes killed) at cleanup.
    uid: Option<UidLease>,
}

/// What a reset made on disk.
struct Started {
    toolbox: Toolbox,
    log: TrajectoryLog,
    response: ResetResponse,
    volume: HeldVolume,
    uid: Option<UidLease>,
}

/// An episode's volume and the host memory reserved for it (a tmpfs's quota; nothing for a
/// measured volume, which is on disk). The reservation is declared after the volume, so it is
/// given back only once the volume is dropped: whichever way the volume goes (a cleanup, a
/// reset failing half-way, a dropped episode), its reservation goes with it. The toolbox's
/// jail holds the volume too; every owner drops the toolbox first.
struct HeldVolume {
    volume: Arc<Volume>,
    _reserved: Option<VolumeReservation>,
}

struct Slot {
    episode: Mutex<Episode>,
    /// Readable while a step (or the final evaluation) holds the episode.
    snapshot: SyncMutex<EpisodeState>,
    /// When the episode ended: it leaves memory `finished_grace` later.
    ended_at: SyncMutex<Option<Instant>>,
}

impl Slot {
    fn new(ep: Episode) -> Self {
        let state = ep.state();
        Self {
            episode: Mutex::new(ep),
            snapshot: SyncMutex::new(state),
            ended_at: SyncMutex::new(None),
        }
    }

    fn publish(&self, ep: &Episode) {
        *self.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = ep.state();
        if ep.is_done() {
            self.ended_at
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(Instant::now);
        }
    }
}

/// An episode that is no longer in memory, as its log tells it: what its state, a retried
/// step and a close are answered from. Small (no records), so that many are kept
/// ([`MAX_SUMMARIES`]) and a request for a finished episode does not read its log again.
#[derive(Debug)]
struct Summary {
    state: EpisodeState,
    closed: bool,
    /// request_ids answered (their answers are in the log).
    answered: HashSet<String>,
}

/// Finished episodes' summaries kept in memory.
pub const MAX_SUMMARIES: usize = 4096;

/// Where an episode was found.
enum Found {
    Live(Arc<Slot>),
    Logged(Arc<Summary>),
}

/// One chunk of a trajectory's JSON answer, or the error that ends it.
pub type TrajectoryChunk = Result<Vec<u8>, std::io::Error>;

/// Bytes of a trajectory answer gathered before they are sent.
const TRAJECTORY_CHUNK: usize = 64 << 10;

/// What building a workspace needs, shared with the blocking threads that build them.
struct Setup {
    cfg: EpisodeConfig,
    sandbox: Sandbox,
    path_dirs: Vec<PathBuf>,
    harness_dir: PathBuf,
    device: Device,
}

/// All episodes.
pub struct EpisodeManager {
    setup: Arc<Setup>,
    tasks: Arc<TaskSet>,
    evaluator: Arc<Evaluator>,
    episodes: RwLock<HashMap<String, Arc<Slot>>>,
    /// Summaries of episodes out of memory, read from their logs once.
    summaries: SyncMutex<HashMap<String, Arc<Summary>>>,
    /// Episodes started, to spread their processes over the GPUs.
    next_episode: AtomicU64,
    /// Slots for commands running at once, over all episodes.
    commands: tokio::sync::Semaphore,
    /// The memory tmpfs volumes of open episodes may reserve together (None: nothing is
    /// reserved: host admission is off, or volumes are measured directories on disk).
    volumes: Option<Arc<VolumeBudget>>,
    /// Whether new episodes and steps are admitted (not while draining), and the work the
    /// drain waits for.
    drain: Arc<Drain>,
    /// Resets' idempotency keys: each key's episode id once its reset answered (the answer
    /// itself is the first record of the episode's log), unset while it runs.
    reset_keys: SyncMutex<Keys<(BodyDigest, ResetKey)>>,
    /// Counters for `/metrics`.
    pub counters: Counters,
}

/// A reset's idempotency key: its episode's id once known. Concurrent resets with one key
/// wait on the same cell, so only the first creates an episode.
type ResetKey = Arc<tokio::sync::OnceCell<String>>;

/// What [`EpisodeManager::truncate_open`] ended.
#[derive(Debug, Default, Clone, Copy)]
pub struct Truncated {
    /// Open episodes truncated, the reason logged.
    pub truncated: usize,
    /// Open episodes left as they were: a step still held them.
    pub busy: usize,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    /// Resets.
    pub resets: AtomicU64,
    /// Steps, by tool.
    pub steps: SyncMutex<BTreeMap<String, u64>>,
    /// Steps whose tool reported an error.
    pub tool_errors: AtomicU64,
    /// Replayed steps (request_id seen before).
    pub replays: AtomicU64,
    /// Episodes ended, by how.
    pub ended: SyncMutex<BTreeMap<String, u64>>,
    /// Final rewards, by value.
    pub rewards: SyncMutex<BTreeMap<String, u64>>,
    /// Finished episodes moved out of memory.
    pub evicted: AtomicU64,
    /// Commands not started because the host's available memory was under the reserve.
    pub commands_refused_host_busy: AtomicU64,
}

/// What the agent sees of a command that did not start because the host is short of memory:
/// a tool error it may retry.
fn command_refused(busy: &HostBusy) -> agent_tools::ToolOutput {
    agent_tools::ToolOutput {
        text: format!(
            "Error: the command was not run: {busy}. Nothing in the workspace changed; run it again in a while."
        ),
        is_error: true,
        data: Default::default(),
        cpu_wait: Duration::ZERO,
    }
}

fn task_info(t: &Task) -> TaskInfo {
    TaskInfo {
        id: t.id.clone(),
        level: t.level,
        hash: t.hash.clone(),
    }
}

/// What the reset's prompt says of the tool-time budget beside its seconds: whether it is
/// this device's default (sized for about ten verify/profile iterations with a build in each,
/// [`crate::config::default_time_budget`]) or set for the episode, with the default beside.
fn budget_note(limits: &EpisodeLimits, device: Device) -> String {
    let default = crate::config::default_time_budget(device).as_secs_f64();
    let server = match device {
        Device::Cpu => "a CPU server",
        Device::Cuda => "a GPU server",
    };
    if (limits.time_budget_s - default).abs() < 0.5 {
        format!("the default on {server}: about ten verify/profile iterations with a build in each")
    } else {
        format!("set for this episode; the default on {server} is {default:.0} s")
    }
}

fn prompt(task: &Task, limits: &EpisodeLimits, device: Device) -> String {
    if !task.is_kernel() {
        return format!(
            "Task {}: {} Limits: {} tool calls.",
            task.id, task.source, limits.max_turns
        );
    }
    format!(
        "Task {id}: write ModelNew in model_new.py, a faster drop-in replacement for Model in model.py, using your own {lang} kernels (device: {device}).\n\
         Read SKILL.md first: it describes the loop (profile, implement, verify, tune), the rules and the reward.\n\
         Check with `python verify.py`, time with `python profile.py --compare eager compile`, then call Submit.\n\
         Budget: {turns} tool calls and {secs:.0} s of tool time ({note}; the time your commands and file tools run). \
         Every observation ends with what is left. When either runs out, the running command is cut (it says so) \
         and model_new.py is submitted as it is: the episode ends with its evaluation.\n\n--- model.py ---\n{source}\n\
         [{turns} of {turns} tool calls left; {secs:.0} s of {secs:.0} s tool time left]",
        id = task.id,
        device = device.as_str(),
        lang = if device == Device::Cuda { "CUDA" } else { "C++" },
        note = budget_note(limits, device),
        turns = limits.max_turns,
        secs = limits.time_budget_s,
        source = task.source
    )
}

/// `text` with control characters escaped (`\x1b`, `\x07`, `\x00`, C1 controls as `\u{9b}`):
/// tabs, newlines and carriage returns stay.
pub fn escape_controls(text: &str) -> String {
    if !text
        .chars()
        .any(|c| c.is_control() && !matches!(c, '\t' | '\n' | '\r'))
    {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match c {
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x80 && c.is_control() => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// `text` with the server's paths made relative to the workspace: the episode's workspace
/// (`.`), its temp dir (`$TMPDIR`), the harness (its files are in the workspace too), an
/// evaluation's copy of the solution (the workspace's files) and the build cache (`build/`).
fn relative_paths(text: &str, data_dir: &Path, episode_dir: &Path) -> String {
    let (ws, tmp) = (episode_dir.join("workspace"), episode_dir.join("tmp"));
    let mut out = text.to_string();
    for (from, to) in [
        (format!("{}/", ws.display()), String::new()),
        (ws.display().to_string(), ".".to_string()),
        (tmp.display().to_string(), "$TMPDIR".to_string()),
        (
            format!("{}/", data_dir.join("harness").display()),
            String::new(),
        ),
    ] {
        if out.contains(&from) {
            out = out.replace(&from, &to);
        }
    }
    // evals/<id>/{candidate,source}/ hold the solution's files; build-cache/<hash>/ its build.
    for (dir, keep) in [("evals", false), ("build-cache", true)] {
        let prefix = format!("{}/", data_dir.join(dir).display());
        while let Some(at) = out.find(&prefix) {
            let rest = &out[at + prefix.len()..];
            let id_end = rest.find('/').unwrap_or(rest.len());
            let after = &rest[id_end..];
            let (skip, to) = if keep {
                (id_end + 1, "build/")
            } else if let Some(sub) = ["/candidate/", "/source/"]
                .iter()
                .find(|s| after.starts_with(**s))
            {
                (id_end + sub.len(), "")
            } else {
                (id_end + 1, "<evaluation>/")
            };
            let skip = skip.min(rest.len());
            out.replace_range(at..at + prefix.len() + skip, to);
        }
    }
    out
}

/// The line every observation ends with: turns and tool time left.
fn budget_line(ep: &Episode, done: bool) -> String {
    let turns_left = ep.limits.max_turns.saturating_sub(ep.turn);
    let time_left = (ep.limits.time_budget_s - ep.tool_time.as_secs_f64()).max(0.0);
    format!(
        "[{}{turns_left} of {} tool calls left; {time_left:.0} s of {:.0} s tool time left]",
        if done { "episode ended; " } else { "" },
        ep.limits.max_turns,
        ep.limits.time_budget_s
    )
}

/// Runs blocking file work on a blocking thread, waiting at most `timeout` for it (the work
/// itself cannot be cancelled and finishes in the background).
async fn blocking<T: Send + 'static>(
    timeout: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, EpisodeError> {
    match tokio::time::timeout(timeout, tokio::task::spawn_blocking(f)).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(internal(what, e)),
        Err(_) => Err(internal_msg(format!(
            "{what} took longer than {} s",
            timeout.as_secs_f64()
        ))),
    }
}

/// An internal error: `what` failed with `source`.
fn internal(
    what: impl Into<String>,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> EpisodeError {
    EpisodeError::Internal {
        what: what.into(),
        source: Some(source.into()),
    }
}

/// An internal error with no error of another kind behind it.
fn internal_msg(what: impl Into<String>) -> EpisodeError {
    EpisodeError::Internal {
        what: what.into(),
        source: None,
    }
}

/// Rebuilds an episode's summary from its log, one record in memory at a time; None when the
/// log lacks a usable reset record.
fn replay(
    id: &str,
    path: &Path,
    tasks: &TaskSet,
    data_dir: &Path,
) -> Result<Option<Summary>, trajectory::LogError> {
    let mut ep: Option<Episode> = None;
    let mut closed = false;
    let mut usable = true;
    trajectory::for_each(path, |r| {
        match (r, ep.as_mut()) {
            (TrajectoryRecord::Reset { body, .. }, None) => {
                ep = episode_from_reset(id, &body, tasks, data_dir);
                usable = ep.is_some();
            }
            (TrajectoryRecord::Step { body, .. }, Some(ep)) => {
                let resp = &body.response;
                ep.turn = resp.info.turn;
                ep.tool_time = Duration::from_secs_f64(resp.info.tool_time_s);
                if let Some(rid) = &body.request_id {
                    ep.answered.insert(rid.clone());
                }
                if resp.done {
                    ep.status = if resp.terminated {
                        EpisodeStatus::Terminated
                    } else {
                        EpisodeStatus::Truncated
                    };
                    ep.truncation_reason = resp.info.truncation_reason.clone();
                    ep.result = resp.info.evaluation.clone();
                }
            }
            (TrajectoryRecord::Truncated { body, .. }, Some(ep)) => {
                ep.status = EpisodeStatus::Truncated;
                ep.truncation_reason = Some(body.reason);
            }
            (TrajectoryRecord::Closed { .. }, Some(ep)) => {
                closed = true;
                if !ep.is_done() {
                    ep.status = EpisodeStatus::Closed;
                }
            }
            _ => {}
        }
        usable
    })?;
    Ok(ep.map(|ep| Summary {
        state: ep.state(),
        closed,
        answered: ep.answered,
    }))
}

/// The episode a reset record started (before any step), or None when its task is neither
/// the server's (same id and hash) nor in the record.
fn episode_from_reset(
    id: &str,
    reset: &env_api::ResetRecord,
    tasks: &TaskSet,
    data_dir: &Path,
) -> Option<Episode> {
    let info = &reset.response.info;
    let (task_id, hash) = (info.task.id.as_str(), info.task.hash.as_str());
    let known = tasks.get(task_id).ok().filter(|t| t.hash == hash).cloned();
    let task = match (known, reset.task_source.as_deref()) {
        (Some(t), _) => t,
        (None, Some(src)) => Task {
            id: task_id.into(),
            level: 0,
            name: task_id.into(),
            source: src.into(),
            hash: hash.into(),
            kind: kernelbench::TaskKind::Kernel,
        },
        (None, None) => return None,
    };
    Some(Episode::new(
        id.to_string(),
        task,
        data_dir.join("episodes").join(id),
        info.limits.clone(),
        None,
        None,
    ))
}

/// Streams an episode's log as the JSON of a [`env_api::Trajectory`], up to the length the log
/// had when it was opened (a record being appended is left for the next read), a chunk at a
/// time: what a reader holds stays a chunk or two whatever the log's size. Stops when the
/// receiver is gone (the client hung up).
fn stream_log(path: &Path, id: &str, tx: &tokio::sync::mpsc::Sender<TrajectoryChunk>) {
    let limit = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) => {
            let _ = tx.blocking_send(Err(e));
            return;
        }
    };
    let mut chunk = format!(
        "{{\"episode_id\":{},\"records\":[",
        serde_json::Value::from(id)
    )
    .into_bytes();
    let mut first = true;
    let mut gone = false;
    let read = trajectory::for_each_line(path, limit, |line, _| {
        if !std::mem::take(&mut first) {
            chunk.push(b',');
        }
        chunk.extend_from_slice(line);
        if chunk.len() >= TRAJECTORY_CHUNK {
            gone = tx.blocking_send(Ok(std::mem::take(&mut chunk))).is_err();
        }
        !gone
    });
    if gone {
        return;
    }
    let last = match read {
        Ok(()) => {
            chunk.extend_from_slice(b"]}");
            Ok(chunk)
        }
        Err(e) => Err(std::io::Error::other(e)),
    };
    let _ = tx.blocking_send(last);
}

/// The candidate's files from a workspace: model_new.py and kernels/ (or a recall task's
/// answer file), never through a link, at most the evaluator's size cap.
fn solution_files(
    ws: &Workspace,
    kind: &kernelbench::TaskKind,
) -> Result<agent_tools::workspace::Solution, agent_tools::ToolError> {
    let max = crate::evaluation::MAX_SOLUTION_BYTES as u64;
    let collected = match kind {
        kernelbench::TaskKind::Recall { file, .. } => ws.collect(&[file.as_str()], &[], max),
        kernelbench::TaskKind::Kernel => ws.collect_solution(max),
    };
    collected
}

impl Episode {
    /// A running episode at turn 0 (`toolbox` and `log` are None for one rebuilt from its log).
    fn new(
        id: String,
        task: Task,
        dir: PathBuf,
        limits: EpisodeLimits,
        toolbox: Option<Toolbox>,
        log: Option<TrajectoryLog>,
    ) -> Self {
        Self {
            id,
            task,
            dir,
            toolbox,
            limits,
            turn: 0,
            tool_time: Duration::ZERO,
            status: EpisodeStatus::Running,
            truncation_reason: None,
            result: None,
            answered: HashSet::new(),
            log_bytes: log.as_ref().map_or(0, TrajectoryLog::len),
            log,
            last_active: Instant::now(),
            volume: None,
            uid: None,
        }
    }

    fn state(&self) -> EpisodeState {
        EpisodeState {
            episode_id: self.id.clone(),
            task: task_info(&self.task),
            status: self.status,
            turn: self.turn,
            tool_time_s: self.tool_time.as_secs_f64(),
            limits: self.limits.clone(),
            todos: self
                .toolbox
                .as_ref()
                .map(|t| t.todos().to_vec())
                .unwrap_or_default(),
            truncation_reason: self.truncation_reason.clone(),
            result: self.result.clone(),
        }
    }

    fn is_done(&self) -> bool {
        !matches!(
            self.status,
            EpisodeStatus::Running | EpisodeStatus::Evaluating
        )
    }
}

impl Setup {
    fn trajectories_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("trajectories")
    }

    /// Creates the workspace, opens the log and writes the reset record: everything a reset
    /// does on disk, on a blocking thread.
    fn start_episode(
        &self,
        id: &str,
        task: &Task,
        limits: &EpisodeLimits,
        req: &ResetRequest,
        n: u64,
        reserved: Option<VolumeReservation>,
    ) -> Result<Started, EpisodeError> {
        let uid = self.sandbox.lease_uid().map_err(EpisodeError::Exhausted)?;
        let owner = uid.as_ref().map(UidLease::owner);
        let dir = self.cfg.data_dir.join("episodes").join(id);
        let made = self
            .make_workspace(&dir, task, owner, n, reserved)
            .and_then(|(toolbox, listing, volume)| {
                let device = self.device.as_str().to_string();
                let observation = Observation {
                    text: prompt(task, limits, self.device),
                    tool: None,
                    is_error: false,
                    data: ToolData::Reset(ResetData { files: listing }).into(),
                };
                let resp = ResetResponse {
                    episode_id: id.to_string(),
                    observation,
                    info: ResetInfo {
                        task: task_info(task),
                        tools: agent_tools::tool_schemas(),
                        limits: limits.clone(),
                        device,
                        replayed: false,
                    },
                };
                let log = TrajectoryLog::open(&self.trajectories_dir(), id)
                    .map_err(|e| internal("opening the trajectory log", e))?;
                log.append(&TrajectoryRecord::Reset {
                    time: trajectory::now(),
                    body: ResetRecord {
                        request: req.clone(),
                        response: resp.clone(),
                        task_source: Some(task.source.clone()),
                    },
                })
                .map_err(|e| internal("writing the trajectory log", e))?;
                Ok(Started {
                    toolbox,
                    log,
                    response: resp,
                    volume,
                    uid: None,
                })
            });
        match made {
            Ok(started) => Ok(Started { uid, ..started }),
            Err(e) => {
                let _ = retention::remove_entry(&dir);
                Err(e)
            }
        }
    }

    fn make_workspace(
        &self,
        dir: &Path,
        task: &Task,
        owner: Option<(u32, u32)>,
        n: u64,
        reserved: Option<VolumeReservation>,
    ) -> Result<(Toolbox, Vec<String>, HeldVolume), EpisodeError> {
        let root = dir.join("workspace");
        let tmp = dir.join("tmp");
        // Everything the episode may write (workspace and temp dir) lives on one volume
        // bounded by the disk quota.
        let volume = Arc::new(
            Volume::create(dir, VolumeLimits::bytes(self.cfg.disk_quota_bytes))
                .map_err(|e| internal("creating the episode's volume", e))?,
        );
        // A volume that could not be mounted is a measured directory on disk: it holds no
        // memory, and gives its reservation back at once.
        let volume = HeldVolume {
            _reserved: reserved.filter(|_| volume.enforcement() == QuotaEnforcement::Tmpfs),
            volume,
        };
        create_private_dir(&root, owner)
            .map_err(|e| internal(format!("creating {}", root.display()), e))?;
        create_private_dir(&tmp, owner)
            .map_err(|e| internal(format!("creating {}", tmp.display()), e))?;
        let mut ws =
            Workspace::open(&root, owner).map_err(|e| internal("opening the workspace", e))?;
        let mut listing: Vec<String> = Vec::new();
        if task.is_kernel() {
            ws.add_protected("model.py", task.source.as_bytes())
                .map_err(|e| internal("writing model.py", e))?;
            for name in WORKSPACE_FILES {
                let text = std::fs::read(self.harness_dir.join(name))
                    .map_err(|e| internal(format!("harness file {name}"), e))?;
                ws.add_protected(name, &text)
                    .map_err(|e| internal(format!("writing {name}"), e))?;
            }
            ws.write_atomic(&ws.root().join("model_new.py"), b"")
                .map_err(|e| internal("writing model_new.py", e))?;
            listing.extend(WORKSPACE_FILES.iter().map(|s| s.to_string()));
            listing.extend(["model.py".to_string(), "model_new.py".to_string()]);
        }
        // A recall task's given files (the `clue` family's clue.txt): read-only, so the
        // answer cannot be planted by rewriting the clue.
        if let kernelbench::TaskKind::Recall { given, .. } = &task.kind {
            for (name, text) in given {
                ws.add_protected(name, text.as_bytes())
                    .map_err(|e| internal(format!("writing {name}"), e))?;
                listing.push(name.clone());
            }
        }
        let mut env = self.cfg.extra_env.clone();
        if self.cfg.gpus > 0 {
            env.push((
                "CUDA_VISIBLE_DEVICES".into(),
                (n % self.cfg.gpus as u64).to_string(),
            ));
        }
        env.push(("CUDA_AGENT_DEVICE".into(), self.device.as_str().into()));
        // A segfault in the agent's own Python scripts prints a traceback, not just a signal.
        env.push(("PYTHONFAULTHANDLER".into(), "1".into()));
        let mut jail = Jail::standard(ws.root(), &tmp, &self.path_dirs, &env, owner);
        jail.volume = Some(volume.volume.clone());
        // The agent's commands yield the CPU to evaluations (whose judge may hold a device).
        jail.cpu = CpuPriority::Background;
        // The agent may run its own CUDA checks; on a CPU server /proc stays read-only.
        jail.cuda = self.device == Device::Cuda;
        listing.sort();
        Ok((
            Toolbox::new(
                self.sandbox.clone(),
                ws,
                jail,
                tmp,
                self.cfg.tool_limits.clone(),
            ),
            listing,
            volume,
        ))
    }
}

impl EpisodeManager {
    /// A manager; call [`EpisodeManager::recover`] once before serving. Resets and steps are
    /// admitted through `drain`.
    pub fn new(
        cfg: EpisodeConfig,
        tasks: Arc<TaskSet>,
        sandbox: Sandbox,
        python: PythonInfo,
        harness_dir: PathBuf,
        evaluator: Arc<Evaluator>,
        drain: Arc<Drain>,
    ) -> Self {
        let cfg_commands = cfg.max_commands.max(1);
        let volumes = cfg.admission.volume_memory_bytes.map(VolumeBudget::new);
        let setup = Setup {
            path_dirs: python.path_dirs(),
            device: evaluator.device(),
            cfg,
            sandbox,
            harness_dir,
        };
        Self {
            setup: Arc::new(setup),
            tasks,
            evaluator,
            episodes: RwLock::new(HashMap::new()),
            summaries: SyncMutex::new(HashMap::new()),
            next_episode: AtomicU64::new(0),
            commands: tokio::sync::Semaphore::new(cfg_commands),
            volumes,
            drain,
            reset_keys: SyncMutex::new(Keys::new(env_api::caps::RESET_KEYS)),
            counters: Counters::default(),
        }
    }

    /// The workspaces' `SKILL.md`, as laid out for this server's device.
    pub fn skill_md(&self) -> String {
        crate::runtime::render_skill(self.setup.device)
    }

    /// The workspaces' `SKILL_REFERENCE.md`, as laid out for this server's device.
    pub fn skill_reference_md(&self) -> String {
        crate::runtime::render_skill_reference(self.setup.device)
    }

    fn cfg(&self) -> &EpisodeConfig {
        &self.setup.cfg
    }

    /// The volume-memory budget and what open episodes' volumes reserve of it now, in bytes
    /// (None: nothing is reserved).
    pub fn volume_memory(&self) -> Option<(u64, u64)> {
        self.volumes.as_ref().map(|b| (b.budget(), b.reserved()))
    }

    fn trajectories_dir(&self) -> PathBuf {
        self.setup.trajectories_dir()
    }

    /// The tasks served.
    pub fn tasks(&self) -> &TaskSet {
        &self.tasks
    }

    /// Number of open (running) episodes.
    pub fn open_count(&self) -> usize {
        self.episodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|s| {
                matches!(
                    s.snapshot.lock().unwrap_or_else(|e| e.into_inner()).status,
                    EpisodeStatus::Running | EpisodeStatus::Evaluating
                )
            })
            .count()
    }

    /// Number of episodes held in memory (open ones and those finished within the grace
    /// period).
    pub fn in_memory(&self) -> usize {
        self.episodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Ids of the episodes in memory (their logs are never pruned).
    pub fn live_ids(&self) -> HashSet<String> {
        self.episodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// After a restart: marks every episode that was mid-flight truncated (`server_restart`)
    /// in its log, and returns how many were. Nothing is loaded into memory: an ended
    /// episode's state and trajectory are read from its log when asked for, and a closed one
    /// stays closed. Only the end of each log is read, unless that is not a record that ends
    /// an episode.
    pub fn recover(&self) -> Result<usize, EpisodeError> {
        let dir = self.trajectories_dir();
        let in_dir = |e| internal(format!("trajectory directory {}", dir.display()), e);
        std::fs::create_dir_all(&dir).map_err(in_dir)?;
        let mut n = 0;
        for e in std::fs::read_dir(&dir).map_err(in_dir)?.flatten() {
            let path = e.path();
            // Logs an older server made readable by all become the server's alone.
            if e.file_type().is_ok_and(|t| t.is_file()) {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::Permissions::from_mode(trajectory::LOG_MODE);
                if let Err(e) = std::fs::set_permissions(&path, mode) {
                    tracing::warn!(log = %path.display(), error = %e, "cannot make the log private");
                }
            }
            let Some(id) = path
                .file_stem()
                .and_then(|s| s.to_str())
                .filter(|s| is_episode_id(s))
                .map(str::to_string)
            else {
                continue;
            };
            if path.extension().is_none_or(|x| x != "jsonl") {
                continue;
            }
            if matches!(
                trajectory::last_kind(&path).ok().flatten().as_deref(),
                Some("final" | "truncated" | "closed")
            ) {
                continue;
            }
            let Ok(Some(ep)) = replay(&id, &path, &self.tasks, &self.cfg().data_dir) else {
                continue;
            };
            let running = matches!(
                ep.state.status,
                EpisodeStatus::Running | EpisodeStatus::Evaluating
            );
            if ep.closed || !running {
                continue;
            }
            let log = TrajectoryLog::open(&dir, &id)
                .map_err(|e| internal("opening the trajectory log", e))?;
            log.append(&TrajectoryRecord::Truncated {
                time: trajectory::now(),
                body: TruncatedRecord {
                    reason: "server_restart".into(),
                    turn: ep.state.turn,
                },
            })
            .map_err(|e| internal("writing the trajectory log", e))?;
            n += 1;
        }
        Ok(n)
    }

    /// Finds an episode: in memory, or (ended, not closed) in its log.
    async fn find(&self, id: &str) -> Result<Found, EpisodeError> {
        if !is_episode_id(id) {
            return Err(EpisodeError::Unknown(id.to_string()));
        }
        if let Some(slot) = self
            .episodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
        {
            return Ok(Found::Live(slot));
        }
        if let Some(summary) = self.summary(id) {
            return match summary.closed {
                false => Ok(Found::Logged(summary)),
                true => Err(EpisodeError::Unknown(id.to_string())),
            };
        }
        let path = trajectory::path_of(&self.trajectories_dir(), id);
        let (tasks, data_dir, owned_id) = (
            self.tasks.clone(),
            self.cfg().data_dir.clone(),
            id.to_string(),
        );
        let summary = blocking(
            self.cfg().io_timeout,
            "reading a trajectory log",
            move || replay(&owned_id, &path, &tasks, &data_dir).ok().flatten(),
        )
        .await?;
        match summary {
            Some(summary) => {
                let summary = Arc::new(summary);
                self.remember(id, summary.clone());
                match summary.closed {
                    false => Ok(Found::Logged(summary)),
                    true => Err(EpisodeError::Unknown(id.to_string())),
                }
            }
            None => Err(EpisodeError::Unknown(id.to_string())),
        }
    }

    fn summary(&self, id: &str) -> Option<Arc<Summary>> {
        self.summaries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    /// Keeps a summary; when [`MAX_SUMMARIES`] are kept, half of them go first (any half:
    /// one that is asked for again is read from its log again).
    fn remember(&self, id: &str, summary: Arc<Summary>) {
        let mut map = self.summaries.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_SUMMARIES && !map.contains_key(id) {
            let drop: Vec<String> = map.keys().take(MAX_SUMMARIES / 2).cloned().collect();
            for k in drop {
                map.remove(&k);
            }
        }
        map.insert(id.to_string(), summary);
    }

    /// Appends a record to the episode's log on a blocking thread.
    async fn log(&self, ep: &mut Episode, record: TrajectoryRecord) -> Result<(), EpisodeError> {
        let Some(log) = ep.log.clone() else {
            return Ok(());
        };
        let n = blocking(
            self.cfg().io_timeout,
            "writing the trajectory log",
            move || log.append(&record),
        )
        .await?
        .map_err(|e| internal("writing the trajectory log", e))?;
        ep.log_bytes += n;
        Ok(())
    }

    /// Appends a record to a log that is not held open (an ended episode's).
    async fn log_detached(&self, id: &str, record: TrajectoryRecord) -> Result<(), EpisodeError> {
        let (dir, id) = (self.trajectories_dir(), id.to_string());
        blocking(
            self.cfg().io_timeout,
            "writing the trajectory log",
            move || TrajectoryLog::open(&dir, &id)?.append(&record),
        )
        .await?
        .map_err(|e| internal("writing the trajectory log", e))?;
        Ok(())
    }

    /// Whether a new episode would be admitted now (what readiness answers): not while the
    /// server drains, is at its episode cap, or the host's memory is short.
    pub fn admits(&self) -> Result<(), EpisodeError> {
        if self.drain.is_draining() {
            return Err(crate::drain::Draining.into());
        }
        self.room()
    }

    /// Room for one more episode: under the cap, the host's memory over its reserve, and its
    /// volume's quota within what is left of the volume-memory budget (checked, not reserved).
    fn room(&self) -> Result<(), EpisodeError> {
        let open = self.open_count();
        if open >= self.cfg().max_episodes {
            return Err(EpisodeError::AtCapacity(open));
        }
        // Volumes are tmpfs: an episode takes host memory as it writes.
        if let Some(why) = self.cfg().admission.refuse_episode() {
            return Err(why.into());
        }
        if let Some(budget) = &self.volumes {
            budget.fits(self.cfg().disk_quota_bytes)?;
        }
        Ok(())
    }

    /// Starts an episode. A reset whose `request_id` was seen before gets the first answer
    /// (marked `replayed`), also while the server drains: it is no new work.
    pub async fn reset(&self, req: ResetRequest) -> Result<ResetResponse, EpisodeError> {
        let Some(key) = req.request_id.clone() else {
            return self.start(req).await;
        };
        let digest = body_digest(&ResetRequest {
            request_id: None,
            ..req.clone()
        });
        let cell: ResetKey = {
            let mut keys = self.reset_keys.lock().unwrap_or_else(|e| e.into_inner());
            match keys.get(&key) {
                Some((d, _)) if d != digest => return Err(KeyReused(key).into()),
                Some((_, cell)) => cell,
                None => {
                    let cell = ResetKey::default();
                    keys.insert(&key, (digest, cell.clone()));
                    cell
                }
            }
        };
        let mut fresh = None;
        let started = cell
            .get_or_try_init(|| {
                let fresh = &mut fresh;
                async move {
                    let resp = self.start(req).await?;
                    let id = resp.episode_id.clone();
                    *fresh = Some(resp);
                    Ok::<_, EpisodeError>(id)
                }
            })
            .await;
        match (started, fresh) {
            (Ok(_), Some(resp)) => Ok(resp),
            (Ok(id), None) => self.replayed_reset(id).await,
            (Err(e), _) => {
                // Nothing was started: the key may be used again. Left alone while another
                // request with it waits on the cell (it will try in its turn).
                let mut keys = self.reset_keys.lock().unwrap_or_else(|e| e.into_inner());
                keys.remove_if(&key, |(_, c)| {
                    Arc::ptr_eq(c, &cell) && c.get().is_none() && Arc::strong_count(c) <= 2
                });
                Err(e)
            }
        }
    }

    /// The first answer to a reset, from the first record of its episode's log.
    async fn replayed_reset(&self, id: &str) -> Result<ResetResponse, EpisodeError> {
        let path = trajectory::path_of(&self.trajectories_dir(), id);
        let found = blocking(
            self.cfg().io_timeout,
            "reading the trajectory log",
            move || {
                let mut found = None;
                trajectory::for_each(&path, |r| {
                    if let TrajectoryRecord::Reset { body, .. } = r {
                        found = Some(body.response);
                    }
                    // The reset is the first record.
                    found.is_none()
                })
                .map(|()| found)
            },
        )
        .await?;
        match found {
            Ok(Some(mut resp)) => {
                self.counters.replays.fetch_add(1, Ordering::Relaxed);
                resp.info.replayed = true;
                Ok(resp)
            }
            // The log is gone (retention): the episode with it.
            Ok(None) => Err(EpisodeError::Unknown(id.to_string())),
            Err(trajectory::LogError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Err(EpisodeError::Unknown(id.to_string()))
            }
            Err(e) => Err(internal("reading the trajectory log", e)),
        }
    }

    /// Starts a new episode.
    async fn start(&self, req: ResetRequest) -> Result<ResetResponse, EpisodeError> {
        let _work = self.drain.admit()?;
        self.room()?;
        let task = match (&req.task_source, &req.task) {
            (Some(_), Some(_)) => {
                return Err(EpisodeError::BadRequest(
                    "give task or task_source, not both".into(),
                ))
            }
            (Some(source), None) => Task::inline(source)?,
            (None, Some(id)) => self.tasks.get(id)?.clone(),
            (None, None) => self
                .tasks
                .sample(
                    req.split.as_deref().unwrap_or("all"),
                    req.seed.unwrap_or_else(crate::evaluation::random_u64),
                )?
                .clone(),
        };
        let opts = req.options.clone().unwrap_or_default();
        let max_turns = opts.max_turns.unwrap_or(self.cfg().max_turns);
        let budget = opts
            .time_budget_s
            .unwrap_or(self.cfg().time_budget.as_secs_f64());
        if max_turns == 0
            || max_turns > env_api::caps::MAX_TURNS
            || !(budget.is_finite() && budget > 0.0 && budget <= 86_400.0)
        {
            return Err(EpisodeError::BadRequest(format!(
                "options: max_turns must be in 1..={} and time_budget_s in (0, 86400]",
                env_api::caps::MAX_TURNS
            )));
        }
        let limits = EpisodeLimits {
            max_turns,
            time_budget_s: budget,
            max_output_chars: self.cfg().tool_limits.max_output_chars,
            disk_quota_bytes: self.cfg().disk_quota_bytes,
        };
        // The volume's quota, reserved before it is mounted: resets at once never reserve past
        // the budget. The reservation lives as long as the volume, however the reset ends.
        let reserved = match &self.volumes {
            Some(budget) => Some(budget.reserve(self.cfg().disk_quota_bytes).inspect_err(
                |e| tracing::info!(error = %e, "reset refused: no room for another volume"),
            )?),
            None => None,
        };
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = self.cfg().data_dir.join("episodes").join(&id);
        let n = self.next_episode.fetch_add(1, Ordering::Relaxed);
        let (setup, owned) = (
            self.setup.clone(),
            (id.clone(), task.clone(), limits.clone(), req),
        );
        let started = blocking(self.cfg().io_timeout, "creating the workspace", move || {
            let (id, task, limits, req) = owned;
            setup.start_episode(&id, &task, &limits, &req, n, reserved)
        })
        .await??;
        let mut ep = Episode::new(
            id.clone(),
            task,
            dir,
            limits,
            Some(started.toolbox),
            Some(started.log),
        );
        ep.volume = Some(started.volume);
        ep.uid = started.uid;
        let resp = started.response;
        self.episodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, Arc::new(Slot::new(ep)));
        self.counters.resets.fetch_add(1, Ordering::Relaxed);
        Ok(resp)
    }

    /// Drops the toolbox and the log and removes the episode's directory (on a blocking
    /// thread; a removal slower than the I/O limit goes on in the background).
    async fn cleanup(&self, ep: &mut Episode) {
        ep.log = None;
        // The uid's release kills whatever still runs under it; the volume's drop unmounts
        // it. Both block, so they go with the removal to a blocking thread.
        let (toolbox, volume, uid, dir) = (
            ep.toolbox.take(),
            ep.volume.take(),
            ep.uid.take(),
            ep.dir.clone(),
        );
        let removal = move || {
            drop(toolbox);
            drop(uid);
            drop(volume);
            retention::remove_entry(&dir)
        };
        match blocking(self.cfg().io_timeout, "removing the workspace", removal).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
            Ok(Err(e)) => tracing::warn!(episode = %ep.id, error = %e, "removing the workspace"),
            Err(e) => {
                tracing::warn!(episode = %ep.id, error = %ErrorChain(&e), "removing the workspace")
            }
        }
    }

    /// The state of an episode (answers even while a step runs).
    pub async fn state(&self, id: &str) -> Result<EpisodeState, EpisodeError> {
        match self.find(id).await? {
            Found::Live(slot) => Ok(slot
                .snapshot
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()),
            Found::Logged(l) => Ok(l.state.clone()),
        }
    }

    /// The trajectory of an episode, as the chunks of its JSON answer ([`stream_log`]): read
    /// from its log on a blocking thread while the receiver takes them.
    pub async fn trajectory(
        &self,
        id: &str,
    ) -> Result<tokio::sync::mpsc::Receiver<TrajectoryChunk>, EpisodeError> {
        self.find(id).await?;
        let path = trajectory::path_of(&self.trajectories_dir(), id);
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let id = id.to_string();
        tokio::task::spawn_blocking(move || stream_log(&path, &id, &tx));
        Ok(rx)
    }

    /// Closes an episode: a running one is marked closed and its workspace removed. The
    /// `closed` record makes it final: the episode is unknown to the API from then on, across
    /// restarts too (its log stays on disk for training, under the retention policy).
    pub async fn close(&self, id: &str) -> Result<EpisodeState, EpisodeError> {
        let slot = match self.find(id).await? {
            Found::Live(slot) => slot,
            Found::Logged(l) => {
                let record = TrajectoryRecord::Closed {
                    time: trajectory::now(),
                    body: ClosedRecord { turn: l.state.turn },
                };
                self.log_detached(id, record).await?;
                self.remember(
                    id,
                    Arc::new(Summary {
                        state: l.state.clone(),
                        closed: true,
                        answered: HashSet::new(),
                    }),
                );
                return Ok(l.state.clone());
            }
        };
        let mut ep = slot.episode.lock().await;
        if !ep.is_done() {
            ep.status = EpisodeStatus::Closed;
            *self
                .counters
                .ended
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry("closed".into())
                .or_default() += 1;
        }
        let record = TrajectoryRecord::Closed {
            time: trajectory::now(),
            body: ClosedRecord { turn: ep.turn },
        };
        if ep.log.is_some() {
            self.log(&mut ep, record).await?;
        } else {
            self.log_detached(id, record).await?;
        }
        self.cleanup(&mut ep).await;
        let state = ep.state();
        drop(ep);
        self.episodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        Ok(state)
    }

    /// Every episode's slot, taken out of the map's lock (work on them may await).
    fn all_slots(&self) -> Vec<Arc<Slot>> {
        self.episodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Truncates and cleans up episodes idle past the timeout; returns how many.
    pub async fn expire_idle(&self) -> usize {
        let slots = self.all_slots();
        let mut n = 0;
        for slot in slots {
            let Ok(mut ep) = slot.episode.try_lock() else {
                continue;
            };
            if ep.is_done() || ep.last_active.elapsed() < self.cfg().idle_timeout {
                continue;
            }
            self.truncate(&slot, &mut ep, "idle_timeout").await;
            n += 1;
        }
        n
    }

    /// Truncates every open episode that no step holds, logging `reason` (a drain's end).
    /// One a step still holds is counted as busy and left as it is: its log ends in its last
    /// answered step, and the next start marks it truncated (`server_restart`).
    pub async fn truncate_open(&self, reason: &str) -> Truncated {
        let slots = self.all_slots();
        let mut out = Truncated::default();
        for slot in slots {
            let Ok(mut ep) = slot.episode.try_lock() else {
                out.busy += 1;
                continue;
            };
            if !ep.is_done() {
                self.truncate(&slot, &mut ep, reason).await;
                out.truncated += 1;
            }
        }
        out
    }

    /// Ends an open episode as truncated for `reason`: logged, counted, cleaned up.
    async fn truncate(&self, slot: &Slot, ep: &mut Episode, reason: &str) {
        ep.status = EpisodeStatus::Truncated;
        ep.truncation_reason = Some(reason.into());
        let record = TrajectoryRecord::Truncated {
            time: trajectory::now(),
            body: TruncatedRecord {
                reason: reason.into(),
                turn: ep.turn,
            },
        };
        if let Err(e) = self.log(ep, record).await {
            tracing::warn!(episode = %ep.id, reason, error = %e, "logging a truncation");
        }
        *self
            .counters
            .ended
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(format!("truncated_{reason}"))
            .or_default() += 1;
        self.cleanup(ep).await;
        slot.publish(ep);
    }

    /// Moves episodes that ended more than the grace period ago out of memory; returns how
    /// many. Their state and trajectory are read from their logs from then on.
    pub fn evict_finished(&self) -> usize {
        let grace = self.cfg().finished_grace;
        let mut map = self.episodes.write().unwrap_or_else(|e| e.into_inner());
        let before = map.len();
        map.retain(|_, s| {
            s.ended_at
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_none_or(|t| t.elapsed() < grace)
        });
        // A map that held thousands of episodes keeps its table otherwise.
        if map.capacity() > 2 * map.len() + 64 {
            map.shrink_to_fit();
        }
        let n = before - map.len();
        self.counters.evicted.fetch_add(n as u64, Ordering::Relaxed);
        n
    }
}

#[cfg(test)]
mod prompt_tests {
    use super::*;

    fn limits(secs: f64) -> EpisodeLimits {
        EpisodeLimits {
            max_turns: 50,
            time_budget_s: secs,
            max_output_chars: 16_000,
            disk_quota_bytes: 1 << 30,
        }
    }

    fn task() -> Task {
        Task {
            id: "L1/2_Add".into(),
            level: 1,
            name: "2_Add".into(),
            source: "class Model: ...".into(),
            hash: String::new(),
            kind: kernelbench::TaskKind::Kernel,
        }
    }

    #[test]
    fn the_prompt_says_the_budget_is_the_devices_default() {
        let gpu = prompt(&task(), &limits(1200.0), Device::Cuda);
        assert!(gpu.contains("1200 s of tool time (the default on a GPU server: about ten verify/profile iterations"), "{gpu}");
        assert!(
            gpu.contains("your own CUDA kernels (device: cuda)"),
            "{gpu}"
        );
        let cpu = prompt(&task(), &limits(900.0), Device::Cpu);
        assert!(
            cpu.contains("900 s of tool time (the default on a CPU server"),
            "{cpu}"
        );
    }

    #[test]
    fn a_budget_set_for_the_episode_says_so_with_the_default_beside() {
        let short = prompt(&task(), &limits(60.0), Device::Cuda);
        assert!(
            short.contains(
                "60 s of tool time (set for this episode; the default on a GPU server is 1200 s"
            ),
            "{short}"
        );
        // The last line is the budget, as in every observation.
        assert!(
            short.ends_with("[50 of 50 tool calls left; 60 s of 60 s tool time left]"),
            "{short}"
        );
    }
}

#[cfg(test)]
mod observation_tests {
    use super::relative_paths;
    use std::path::Path;

    #[test]
    fn server_paths_become_workspace_paths() {
        let data = Path::new("/srv/data");
        let ep = data.join("episodes/abc");
        let text = "/srv/data/episodes/abc/workspace/model_new.py:3: error\n\
                    cd /srv/data/episodes/abc/workspace; ls /srv/data/episodes/abc/tmp/x\n\
                    File \"/srv/data/evals/0123abcd/candidate/model_new.py\", line 8\n\
                    /srv/data/build-cache/feed42/kernels_ext_1/main.cpp\n\
                    /srv/data/harness/cuda_agent_worker.py /srv/data/evals/0123abcd/judge/x";
        assert_eq!(
            relative_paths(text, data, &ep),
            "model_new.py:3: error\n\
             cd .; ls $TMPDIR/x\n\
             File \"model_new.py\", line 8\n\
             build/kernels_ext_1/main.cpp\n\
             cuda_agent_worker.py <evaluation>/judge/x"
        );
    }
}
