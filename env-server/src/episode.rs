//! Episodes: a workspace, a toolbox, limits and a trajectory log each; many at once.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as SyncMutex, RwLock};
use std::time::{Duration, Instant};

use agent_tools::{create_private_dir, CallError, Jail, Sandbox, ToolCall, ToolLimits, Toolbox, Workspace};
use env_api::{
    EpisodeLimits, EpisodeState, EpisodeStatus, EvaluationResult, Observation, ResetInfo, ResetRequest, ResetResponse,
    StepInfo, StepResponse, TaskInfo,
};
use kernelbench::{Task, TaskSet};
use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::evaluation::Evaluator;
use crate::runtime::{PythonInfo, WORKSPACE_FILES};
use crate::trajectory::{self, TrajectoryLog};

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
    /// A bad option value.
    #[error("{0}")]
    BadRequest(String),
    /// Something on the server's side failed.
    #[error("internal error: {0}")]
    Internal(String),
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
    last_active: Instant,
}

struct Slot {
    episode: Mutex<Episode>,
    /// Readable while a step (or the final evaluation) holds the episode.
    snapshot: SyncMutex<EpisodeState>,
}

/// All episodes.
pub struct EpisodeManager {
    cfg: EpisodeConfig,
    tasks: Arc<TaskSet>,
    sandbox: Sandbox,
    python: PythonInfo,
    harness_dir: PathBuf,
    evaluator: Arc<Evaluator>,
    episodes: RwLock<HashMap<String, Arc<Slot>>>,
    next_uid: AtomicU64,
    /// Counters for `/metrics`.
    pub counters: Counters,
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
}

fn task_info(t: &Task) -> TaskInfo {
    TaskInfo { id: t.id.clone(), level: t.level, hash: t.hash.clone() }
}

fn prompt(task: &Task, limits: &EpisodeLimits, device: &str) -> String {
    if !task.is_kernel() {
        return format!("Task {}: {} Limits: {} tool calls.", task.id, task.source, limits.max_turns);
    }
    format!(
        "Task {id}: write ModelNew in model_new.py, a faster drop-in replacement for Model in model.py, using your own {lang} kernels (device: {device}).\n\
         Read SKILL.md first: it describes the loop (profile, implement, verify, tune), the rules and the reward.\n\
         Check with `python verify.py`, time with `python profile.py --compare eager compile`, then call Submit.\n\
         Limits: {turns} tool calls, {secs:.0} s of tool time.\n\n--- model.py ---\n{source}",
        id = task.id,
        lang = if device == "cuda" { "CUDA" } else { "C++" },
        turns = limits.max_turns,
        secs = limits.time_budget_s,
        source = task.source
    )
}

impl Episode {
    /// A running episode at turn 0 (`toolbox` and `log` are None for one rebuilt from its log).
    fn new(id: String, task: Task, dir: PathBuf, limits: EpisodeLimits, toolbox: Option<Toolbox>, log: Option<TrajectoryLog>) -> Self {
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
            log,
            last_active: Instant::now(),
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
                .map(|t| t.todos().iter().filter_map(|x| serde_json::to_value(x).ok()).collect())
                .unwrap_or_default(),
            truncation_reason: self.truncation_reason.clone(),
            result: self.result.clone(),
        }
    }

    fn is_done(&self) -> bool {
        !matches!(self.status, EpisodeStatus::Running | EpisodeStatus::Evaluating)
    }

    fn log(&mut self, kind: &str, body: Value) -> Result<(), EpisodeError> {
        match self.log.as_mut() {
            Some(l) => l.append(kind, body).map_err(|e| EpisodeError::Internal(e.to_string())),
            None => Ok(()),
        }
    }

    /// The candidate's files from the workspace: model_new.py and kernels/.
    fn solution_files(&self) -> BTreeMap<String, String> {
        let mut files = BTreeMap::new();
        let root = self.dir.join("workspace");
        if let kernelbench::TaskKind::Recall { file, .. } = &self.task.kind {
            if let Ok(text) = std::fs::read_to_string(root.join(file)) {
                files.insert(file.clone(), text);
            }
            return files;
        }
        if let Ok(text) = std::fs::read_to_string(root.join("model_new.py")) {
            files.insert("model_new.py".to_string(), text);
        }
        let kernels = root.join("kernels");
        for e in walkdir::WalkDir::new(&kernels).follow_links(false).max_depth(4).into_iter().flatten() {
            if !e.file_type().is_file() || e.metadata().map(|m| m.len() > 1 << 20).unwrap_or(true) {
                continue;
            }
            let Ok(rel) = e.path().strip_prefix(&root) else { continue };
            if let Ok(text) = std::fs::read_to_string(e.path()) {
                files.insert(rel.display().to_string(), text);
            }
        }
        files
    }
}

impl EpisodeManager {
    /// A manager; call [`EpisodeManager::recover`] once before serving.
    pub fn new(cfg: EpisodeConfig, tasks: Arc<TaskSet>, sandbox: Sandbox, python: PythonInfo, harness_dir: PathBuf, evaluator: Arc<Evaluator>) -> Self {
        Self {
            cfg,
            tasks,
            sandbox,
            python,
            harness_dir,
            evaluator,
            episodes: RwLock::new(HashMap::new()),
            next_uid: AtomicU64::new(0),
            counters: Counters::default(),
        }
    }

    fn trajectories_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("trajectories")
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
            .filter(|s| matches!(s.snapshot.lock().unwrap_or_else(|e| e.into_inner()).status, EpisodeStatus::Running | EpisodeStatus::Evaluating))
            .count()
    }

    /// Reloads episodes from the trajectory logs after a restart. Finished ones come back as
    /// they ended; one that was mid-flight is marked truncated (`server_restart`) in its log.
    pub fn recover(&self) -> Result<usize, EpisodeError> {
        let dir = self.trajectories_dir();
        std::fs::create_dir_all(&dir).map_err(|e| EpisodeError::Internal(e.to_string()))?;
        let mut n = 0;
        let entries = std::fs::read_dir(&dir).map_err(|e| EpisodeError::Internal(e.to_string()))?;
        for e in entries.flatten() {
            let path = e.path();
            let Some(id) = path.file_stem().and_then(|s| s.to_str()).map(str::to_string) else { continue };
            if path.extension().is_none_or(|x| x != "jsonl") {
                continue;
            }
            let Ok(records) = trajectory::read(&path) else { continue };
            let Some(reset) = records.iter().find(|r| r.kind == "reset") else { continue };
            let task_id = reset.body.pointer("/response/info/task/id").and_then(Value::as_str).unwrap_or_default();
            let hash = reset.body.pointer("/response/info/task/hash").and_then(Value::as_str).unwrap_or_default();
            let known = self.tasks.get(task_id).ok().filter(|t| t.hash == hash).cloned();
            let task = match (known, reset.body.get("task_source").and_then(Value::as_str)) {
                (Some(t), _) => t,
                (None, Some(src)) => Task { id: task_id.into(), level: 0, name: task_id.into(), source: src.into(), hash: hash.into(), kind: kernelbench::TaskKind::Kernel },
                (None, None) => continue,
            };
            let limits: EpisodeLimits = match reset.body.pointer("/response/info/limits").cloned().map(serde_json::from_value) {
                Some(Ok(l)) => l,
                _ => continue,
            };
            let mut ep = Episode::new(id.clone(), task, self.cfg.data_dir.join("episodes").join(&id), limits, None, None);
            for r in &records {
                match r.kind.as_str() {
                    "step" => {
                        if let Ok(resp) = serde_json::from_value::<StepResponse>(r.body["response"].clone()) {
                            ep.turn = resp.info.turn;
                            ep.tool_time = Duration::from_secs_f64(resp.info.tool_time_s);
                            if let Some(rid) = r.body.get("request_id").and_then(Value::as_str) {
                                ep.answered.insert(rid.to_string());
                            }
                            if resp.done {
                                ep.status = if resp.terminated { EpisodeStatus::Terminated } else { EpisodeStatus::Truncated };
                                ep.truncation_reason = resp.info.truncation_reason.clone();
                                ep.result = resp.info.evaluation.clone();
                            }
                        }
                    }
                    "truncated" => {
                        ep.status = EpisodeStatus::Truncated;
                        ep.truncation_reason = r.body.get("reason").and_then(Value::as_str).map(str::to_string);
                    }
                    "closed" => ep.status = EpisodeStatus::Closed,
                    _ => {}
                }
            }
            if !ep.is_done() {
                ep.status = EpisodeStatus::Truncated;
                ep.truncation_reason = Some("server_restart".into());
                if let Ok(mut log) = TrajectoryLog::open(&dir, &id) {
                    let _ = log.append("truncated", json!({"reason": "server_restart", "turn": ep.turn}));
                }
                let _ = std::fs::remove_dir_all(&ep.dir);
            }
            let state = ep.state();
            self.episodes
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, Arc::new(Slot { episode: Mutex::new(ep), snapshot: SyncMutex::new(state) }));
            n += 1;
        }
        Ok(n)
    }

    fn slot(&self, id: &str) -> Result<Arc<Slot>, EpisodeError> {
        self.episodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| EpisodeError::Unknown(id.to_string()))
    }

    /// Starts an episode.
    pub async fn reset(&self, req: ResetRequest) -> Result<ResetResponse, EpisodeError> {
        let open = self.open_count();
        if open >= self.cfg.max_episodes {
            return Err(EpisodeError::AtCapacity(open));
        }
        let task = match &req.task {
            Some(id) => self.tasks.get(id)?.clone(),
            None => self.tasks.sample(req.split.as_deref().unwrap_or("all"), req.seed.unwrap_or_else(crate::evaluation::random_u64))?.clone(),
        };
        let opts = req.options.clone().unwrap_or_default();
        let max_turns = opts.max_turns.unwrap_or(self.cfg.max_turns);
        let budget = opts.time_budget_s.unwrap_or(self.cfg.time_budget.as_secs_f64());
        if max_turns == 0 || !(budget.is_finite() && budget > 0.0 && budget <= 86_400.0) {
            return Err(EpisodeError::BadRequest("options: max_turns must be > 0 and time_budget_s in (0, 86400]".into()));
        }
        let limits = EpisodeLimits {
            max_turns,
            time_budget_s: budget,
            max_output_chars: self.cfg.tool_limits.max_output_chars,
            disk_quota_bytes: self.cfg.disk_quota_bytes,
        };
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = self.cfg.data_dir.join("episodes").join(&id);
        let n = self.next_uid.fetch_add(1, Ordering::Relaxed);
        let owner = self.sandbox.can_switch_uid().then(|| {
            let uid = 100_000 + (n % 50_000) as u32;
            (uid, uid)
        });
        let (toolbox, listing) = self.make_workspace(&dir, &task, owner, n).map_err(EpisodeError::Internal)?;
        let device = self.evaluator.device().as_str().to_string();
        let observation = Observation {
            text: prompt(&task, &limits, &device),
            tool: None,
            is_error: false,
            data: json!({"files": listing}),
        };
        let resp = ResetResponse {
            episode_id: id.clone(),
            observation,
            info: ResetInfo { task: task_info(&task), tools: agent_tools::tool_schemas(), limits: limits.clone(), device },
        };
        let mut log = TrajectoryLog::open(&self.trajectories_dir(), &id).map_err(|e| EpisodeError::Internal(e.to_string()))?;
        log.append("reset", json!({"request": req, "response": resp, "task_source": task.source}))
            .map_err(|e| EpisodeError::Internal(e.to_string()))?;
        let ep = Episode::new(id.clone(), task, dir, limits, Some(toolbox), Some(log));
        let state = ep.state();
        self.episodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, Arc::new(Slot { episode: Mutex::new(ep), snapshot: SyncMutex::new(state) }));
        self.counters.resets.fetch_add(1, Ordering::Relaxed);
        Ok(resp)
    }

    fn make_workspace(&self, dir: &Path, task: &Task, owner: Option<(u32, u32)>, n: u64) -> Result<(Toolbox, Vec<String>), String> {
        let root = dir.join("workspace");
        let tmp = dir.join("tmp");
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        create_private_dir(&root, owner).map_err(|e| e.to_string())?;
        create_private_dir(&tmp, owner).map_err(|e| e.to_string())?;
        let mut ws = Workspace::open(&root, owner).map_err(|e| e.to_string())?;
        let mut listing: Vec<String> = Vec::new();
        if task.is_kernel() {
            ws.add_protected("model.py", task.source.as_bytes()).map_err(|e| e.to_string())?;
            for name in WORKSPACE_FILES {
                let text = std::fs::read(self.harness_dir.join(name)).map_err(|e| format!("harness file {name}: {e}"))?;
                ws.add_protected(name, &text).map_err(|e| e.to_string())?;
            }
            ws.write_atomic(&ws.root().join("model_new.py"), b"").map_err(|e| e.to_string())?;
            listing.extend(WORKSPACE_FILES.iter().map(|s| s.to_string()));
            listing.extend(["model.py".to_string(), "model_new.py".to_string()]);
        }
        let mut env = self.cfg.extra_env.clone();
        if self.cfg.gpus > 0 {
            env.push(("CUDA_VISIBLE_DEVICES".into(), (n % self.cfg.gpus as u64).to_string()));
        }
        env.push(("CUDA_AGENT_DEVICE".into(), self.evaluator.device().as_str().into()));
        let jail = Jail::standard(ws.root(), &tmp, &self.python.path_dirs(), &env, owner);
        listing.sort();
        Ok((Toolbox::new(self.sandbox.clone(), ws, jail, tmp, self.cfg.tool_limits.clone()), listing))
    }

    /// Runs one step. Replays the first answer for a request_id seen before.
    pub async fn step(&self, id: &str, tool: &str, arguments: &Value, request_id: Option<String>) -> Result<StepResponse, EpisodeError> {
        let slot = self.slot(id)?;
        let mut ep = slot.episode.lock().await;
        if let Some(rid) = request_id.as_deref().filter(|rid| ep.answered.contains(*rid)) {
            let mut prev = self.logged_answer(id, rid)?;
            self.counters.replays.fetch_add(1, Ordering::Relaxed);
            prev.info.replayed = true;
            return Ok(prev);
        }
        if ep.is_done() {
            return Err(EpisodeError::Ended(id.to_string()));
        }
        let call = ToolCall::parse(tool, arguments)?;
        ep.last_active = Instant::now();
        let budget = Duration::from_secs_f64(ep.limits.time_budget_s).saturating_sub(ep.tool_time);
        let started = Instant::now();
        let out = match ep.toolbox.as_mut() {
            Some(tb) => tb.run(&call, budget).await,
            None => return Err(EpisodeError::Ended(id.to_string())),
        };
        if !matches!(call, ToolCall::Submit(_)) {
            ep.tool_time += started.elapsed();
        }
        ep.turn += 1;
        {
            let mut steps = self.counters.steps.lock().unwrap_or_else(|e| e.into_inner());
            *steps.entry(call.name().to_string()).or_default() += 1;
        }
        if out.is_error {
            self.counters.tool_errors.fetch_add(1, Ordering::Relaxed);
        }
        let mut observation = Observation { text: out.text, tool: Some(call.name().into()), is_error: out.is_error, data: out.data };
        let terminated = matches!(call, ToolCall::Submit(_));
        let mut truncation_reason = None;
        if !terminated {
            let usage = ep.toolbox.as_ref().map(|t| t.workspace().disk_usage()).unwrap_or(0);
            if usage > ep.limits.disk_quota_bytes {
                truncation_reason = Some("disk_quota".to_string());
                observation.text.push_str(&format!("\n[workspace uses {usage} bytes, over its quota of {} bytes: episode ended]", ep.limits.disk_quota_bytes));
            } else if ep.turn >= ep.limits.max_turns {
                truncation_reason = Some("max_turns".to_string());
            } else if ep.tool_time.as_secs_f64() >= ep.limits.time_budget_s {
                truncation_reason = Some("time_budget".to_string());
            }
        }
        let truncated = truncation_reason.is_some();
        let mut reward = 0.0;
        let mut evaluation = None;
        let mut submitted = BTreeMap::new();
        if terminated || truncated {
            ep.status = EpisodeStatus::Evaluating;
            *slot.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = ep.state();
            submitted = ep.solution_files();
            let result = self.final_evaluation(&ep.task, &submitted).await;
            reward = result.reward;
            evaluation = Some(result.clone());
            ep.result = Some(result);
            ep.status = if terminated { EpisodeStatus::Terminated } else { EpisodeStatus::Truncated };
            ep.truncation_reason = truncation_reason.clone();
            let how = if terminated { "terminated".to_string() } else { format!("truncated_{}", truncation_reason.as_deref().unwrap_or("")) };
            *self.counters.ended.lock().unwrap_or_else(|e| e.into_inner()).entry(how).or_default() += 1;
            *self.counters.rewards.lock().unwrap_or_else(|e| e.into_inner()).entry(format!("{reward}")).or_default() += 1;
        }
        let resp = StepResponse {
            observation,
            reward,
            terminated,
            truncated,
            done: terminated || truncated,
            info: StepInfo { turn: ep.turn, tool_time_s: ep.tool_time.as_secs_f64(), truncation_reason, evaluation, replayed: false },
        };
        let action = json!({"tool": tool, "arguments": arguments});
        ep.log("step", json!({"request_id": request_id, "action": action, "response": resp}))?;
        if let Some(rid) = request_id {
            ep.answered.insert(rid);
        }
        if resp.done {
            // The files judged, so replay and fine-tuning can use the solution itself.
            let body = json!({"result": ep.result, "task": ep.task.id, "files": submitted});
            ep.log("final", body)?;
            self.cleanup(&mut ep);
        }
        *slot.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = ep.state();
        Ok(resp)
    }

    /// The answer first given to `request_id`, from the trajectory log.
    fn logged_answer(&self, id: &str, request_id: &str) -> Result<StepResponse, EpisodeError> {
        let records = trajectory::read(&self.trajectories_dir().join(format!("{id}.jsonl"))).map_err(|e| EpisodeError::Internal(e.to_string()))?;
        records
            .iter()
            .filter(|r| r.kind == "step" && r.body.get("request_id").and_then(Value::as_str) == Some(request_id))
            .find_map(|r| serde_json::from_value(r.body["response"].clone()).ok())
            .ok_or_else(|| EpisodeError::Internal(format!("request {request_id} is answered but not in the log")))
    }

    async fn final_evaluation(&self, task: &Task, files: &BTreeMap<String, String>) -> EvaluationResult {
        let missing = task.is_kernel() && files.get("model_new.py").is_none_or(|t| t.trim().is_empty());
        if missing {
            return EvaluationResult {
                reward: -1.0,
                correct: false,
                reason: Some("missing_solution: model_new.py is empty".into()),
                times_ms: Default::default(),
                speedup: Default::default(),
                details: json!({"task": task.id}),
            };
        }
        match self.evaluator.evaluate(task, files, None).await {
            Ok(r) => r,
            Err(e) => EvaluationResult {
                reward: -1.0,
                correct: false,
                reason: Some(format!("evaluation_error: {e}")),
                times_ms: Default::default(),
                speedup: Default::default(),
                details: json!({"task": task.id, "server_error": true}),
            },
        }
    }

    fn cleanup(&self, ep: &mut Episode) {
        ep.toolbox = None;
        ep.log = None;
        let _ = std::fs::remove_dir_all(&ep.dir);
    }

    /// The state of an episode (answers even while a step runs).
    pub fn state(&self, id: &str) -> Result<EpisodeState, EpisodeError> {
        let slot = self.slot(id)?;
        let s = slot.snapshot.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Ok(s)
    }

    /// The trajectory log of an episode.
    pub fn trajectory(&self, id: &str) -> Result<Vec<env_api::TrajectoryRecord>, EpisodeError> {
        self.slot(id)?;
        trajectory::read(&self.trajectories_dir().join(format!("{id}.jsonl"))).map_err(|e| EpisodeError::Internal(e.to_string()))
    }

    /// Closes an episode: a running one is marked closed and its workspace removed.
    pub async fn close(&self, id: &str) -> Result<EpisodeState, EpisodeError> {
        let slot = self.slot(id)?;
        let mut ep = slot.episode.lock().await;
        if !ep.is_done() {
            ep.status = EpisodeStatus::Closed;
            let body = json!({"turn": ep.turn});
            ep.log("closed", body)?;
        }
        self.cleanup(&mut ep);
        let state = ep.state();
        drop(ep);
        self.episodes.write().unwrap_or_else(|e| e.into_inner()).remove(id);
        Ok(state)
    }

    /// Truncates and cleans up episodes idle past the timeout; returns how many.
    pub async fn expire_idle(&self) -> usize {
        let slots: Vec<Arc<Slot>> = self.episodes.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        let mut n = 0;
        for slot in slots {
            let Ok(mut ep) = slot.episode.try_lock() else { continue };
            if ep.is_done() || ep.last_active.elapsed() < self.cfg.idle_timeout {
                continue;
            }
            ep.status = EpisodeStatus::Truncated;
            ep.truncation_reason = Some("idle_timeout".into());
            let body = json!({"reason": "idle_timeout", "turn": ep.turn});
            let _ = ep.log("truncated", body);
            self.cleanup(&mut ep);
            *slot.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = ep.state();
            n += 1;
        }
        n
    }
}
