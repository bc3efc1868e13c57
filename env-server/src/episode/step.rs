//! One step of an episode: a retried request answered again, the tool call run within the
//! episode's budget, the limits checked, the episode ended (its solution collected and
//! judged) when it submits or runs out, and the answer logged before it leaves.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use agent_tools::{ToolCall, ToolOutput};
use env_api::{
    error_chain, EpisodeStatus, EvaluationDetails, EvaluationResult, FinalRecord, Observation,
    PlainAction, StepInfo, StepRecord, StepResponse, TrajectoryRecord,
};
use kernelbench::Task;
use serde_json::Value;

use super::{
    blocking, budget_line, command_refused, escape_controls, internal, internal_msg,
    relative_paths, solution_files, Episode, EpisodeError, EpisodeManager, Found, Slot, Summary,
};
use crate::reward;
use crate::trajectory;

/// How an ended step's episode came out: its reward, its evaluation and the files judged.
struct Ending {
    reward: f64,
    evaluation: Option<EvaluationResult>,
    submitted: BTreeMap<String, String>,
}

impl EpisodeManager {
    /// Runs one step. Replays the first answer for a request_id seen before.
    pub async fn step(
        &self,
        id: &str,
        tool: &str,
        arguments: &Value,
        request_id: Option<String>,
    ) -> Result<StepResponse, EpisodeError> {
        let slot = match self.find(id).await? {
            Found::Live(slot) => slot,
            Found::Logged(l) => return self.replay_logged(id, &l, request_id.as_deref()).await,
        };
        let mut ep = slot.episode.lock().await;
        if let Some(rid) = request_id
            .as_deref()
            .filter(|rid| ep.answered.contains(*rid))
        {
            let mut prev = self.logged_answer(id, rid).await?.ok_or_else(|| {
                internal_msg(format!("request {rid} is answered but not in the log"))
            })?;
            self.counters.replays.fetch_add(1, Ordering::Relaxed);
            prev.info.replayed = true;
            return Ok(prev);
        }
        if ep.is_done() {
            return Err(EpisodeError::Ended(id.to_string()));
        }
        // After the replay: an answered step stays answerable while draining.
        let _work = self.drain.admit()?;
        let call = ToolCall::parse(tool, arguments)?;
        let out = self.run_tool(&mut ep, id, &call).await?;
        let cpu_wait_s = out.cpu_wait.as_secs_f64();
        let mut observation = Observation {
            text: relative_paths(&out.text, &self.cfg().data_dir, &ep.dir),
            tool: Some(call.name().into()),
            is_error: out.is_error,
            data: out.data,
        };
        let terminated = matches!(call, ToolCall::Submit(_));
        let truncation_reason = match terminated {
            true => None,
            false => self.over_limit(&ep, &mut observation.text).await,
        };
        let truncated = truncation_reason.is_some();
        let ending = match terminated || truncated {
            true => Some(
                self.end(&slot, &mut ep, &truncation_reason, &mut observation.text)
                    .await,
            ),
            false => None,
        };
        if ep.task.is_kernel() {
            if !observation.text.ends_with('\n') {
                observation.text.push('\n');
            }
            observation
                .text
                .push_str(&budget_line(&ep, terminated || truncated));
        }
        // Terminal controls the command printed (or a file held) are shown, not obeyed, by
        // whatever displays or parses the observation.
        observation.text = escape_controls(&observation.text);
        let (reward, evaluation, submitted) = match ending {
            Some(e) => (e.reward, e.evaluation, e.submitted),
            None => (0.0, None, BTreeMap::new()),
        };
        let resp = StepResponse {
            observation,
            reward,
            terminated,
            truncated,
            done: terminated || truncated,
            info: StepInfo {
                turn: ep.turn,
                tool_time_s: ep.tool_time.as_secs_f64(),
                turns_left: ep.limits.max_turns.saturating_sub(ep.turn),
                tool_time_left_s: (ep.limits.time_budget_s - ep.tool_time.as_secs_f64()).max(0.0),
                truncation_reason,
                evaluation,
                replayed: false,
                cpu_wait_s,
            },
        };
        self.record(&mut ep, tool, arguments, request_id, &resp, submitted)
            .await?;
        slot.publish(&ep);
        Ok(resp)
    }

    /// A step for an episode that ended and left memory: only a retry of an answered step
    /// has an answer (from the log).
    async fn replay_logged(
        &self,
        id: &str,
        logged: &Summary,
        request_id: Option<&str>,
    ) -> Result<StepResponse, EpisodeError> {
        let prev = match request_id {
            Some(rid) if logged.answered.contains(rid) => self.logged_answer(id, rid).await?,
            _ => None,
        };
        match prev {
            Some(mut prev) => {
                self.counters.replays.fetch_add(1, Ordering::Relaxed);
                prev.info.replayed = true;
                Ok(prev)
            }
            None => Err(EpisodeError::Ended(id.to_string())),
        }
    }

    /// Runs `call` in the episode's toolbox within what is left of its tool time, and counts
    /// the turn (and the tool time, but for Submit).
    async fn run_tool(
        &self,
        ep: &mut Episode,
        id: &str,
        call: &ToolCall,
    ) -> Result<ToolOutput, EpisodeError> {
        ep.last_active = Instant::now();
        let budget = Duration::from_secs_f64(ep.limits.time_budget_s).saturating_sub(ep.tool_time);
        // Commands wait for a slot (not counted as tool time): starting a sandboxed command
        // takes dozens of descriptors for a moment, and a thousand at once exhaust them.
        let command_slot = match call {
            ToolCall::Bash(_) => Some(
                self.commands
                    .acquire()
                    .await
                    .map_err(|e| internal("waiting for a command slot", e))?,
            ),
            _ => None,
        };
        // A command does not start while the host is short of memory: the agent is told and may
        // retry, and the episode goes on (a tool error, no tool time).
        let refused = command_slot
            .as_ref()
            .and_then(|_| self.cfg().admission.refuse_command());
        let started = Instant::now();
        let out = match (ep.toolbox.as_mut(), refused) {
            (None, _) => return Err(EpisodeError::Ended(id.to_string())),
            (Some(_), Some(busy)) => {
                self.counters
                    .commands_refused_host_busy
                    .fetch_add(1, Ordering::Relaxed);
                tracing::info!(episode = %id, reason = %busy, "command not started: the host is short of memory");
                command_refused(&busy)
            }
            (Some(tb), None) => tb.run(call, budget).await,
        };
        drop(command_slot);
        // Idle time starts when the answer leaves: a command the host starved may have run
        // for up to three times its limit.
        ep.last_active = Instant::now();
        if !matches!(call, ToolCall::Submit(_)) {
            // The time the host kept the command waiting for a CPU (while none of its
            // processes ran) is the host's load, not the agent's doing: not charged.
            ep.tool_time += started.elapsed().saturating_sub(out.cpu_wait);
        }
        ep.turn += 1;
        {
            let mut steps = self
                .counters
                .steps
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            *steps.entry(call.name().to_string()).or_default() += 1;
        }
        if out.is_error {
            self.counters.tool_errors.fetch_add(1, Ordering::Relaxed);
        }
        Ok(out)
    }

    /// The limit the episode ran past after a step, if any (the reason it is truncated for),
    /// said at the end of the observation's `text`: its disk quota, its log's, its turns or
    /// its tool time.
    async fn over_limit(&self, ep: &Episode, text: &mut String) -> Option<String> {
        let quota = ep.limits.disk_quota_bytes;
        // A measurement that does not finish in time (a tree of millions of files on a
        // measured volume) counts as over the quota.
        let breach = match ep.volume.as_ref().map(|v| v.volume.clone()) {
            Some(v) => blocking(
                self.cfg().io_timeout,
                "measuring the workspace",
                move || v.breach().map(|b| (b.reason(), b.to_string())),
            )
            .await
            .unwrap_or_else(|_| {
                Some((
                    "disk_quota",
                    "the workspace could not be measured in time".into(),
                ))
            }),
            None => None,
        };
        if let Some((reason, what)) = breach {
            text.push_str(&format!("\n[{what} (quota {quota} bytes): episode ended]"));
            Some(reason.to_string())
        } else if ep.log_bytes >= self.cfg().max_log_bytes {
            text.push_str(&format!(
                "\n[the episode's log is over {} bytes: episode ended]",
                self.cfg().max_log_bytes
            ));
            Some("log_quota".to_string())
        } else if ep.turn >= ep.limits.max_turns {
            if ep.task.is_kernel() {
                text.push_str(&format!(
                    "\n[all {} tool calls are used: the episode ends and model_new.py is submitted as it is]",
                    ep.limits.max_turns
                ));
            }
            Some("max_turns".to_string())
        } else if ep.tool_time.as_secs_f64() >= ep.limits.time_budget_s {
            if ep.task.is_kernel() {
                text.push_str(&format!(
                    "\n[the tool-time budget of {:.0} s is spent: the episode ends and model_new.py is submitted as it is]",
                    ep.limits.time_budget_s
                ));
            }
            Some("time_budget".to_string())
        } else {
            None
        }
    }

    /// Ends the episode: submitted (`truncation_reason` None) or truncated. Its solution is
    /// collected from the workspace and judged; the result is said at the end of the
    /// observation's `text` (kernel tasks) and counted.
    async fn end(
        &self,
        slot: &Slot,
        ep: &mut Episode,
        truncation_reason: &Option<String>,
        text: &mut String,
    ) -> Ending {
        let terminated = truncation_reason.is_none();
        ep.status = EpisodeStatus::Evaluating;
        *slot.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = ep.state();
        let mut submitted = BTreeMap::new();
        let collected = match ep.toolbox.as_ref().map(|t| t.workspace().clone()) {
            Some(ws) => {
                let kind = ep.task.kind.clone();
                // The reason the agent reads: the error with its causes.
                match blocking(
                    self.cfg().io_timeout,
                    "collecting the solution",
                    move || solution_files(&ws, &kind),
                )
                .await
                {
                    Ok(collected) => collected.map_err(|e| error_chain(&e)),
                    Err(e) => Err(error_chain(&e)),
                }
            }
            None => Err("the workspace is gone".to_string()),
        };
        let result = match collected {
            Ok(solution) => {
                if let Some(skipped) = solution.skipped_summary() {
                    text.push_str(&format!("\n[{skipped}]"));
                }
                submitted = solution.files;
                self.final_evaluation(&ep.id, &ep.task, &submitted).await
            }
            Err(e) => reward::failed(
                format!("bad_solution: {e}"),
                EvaluationDetails {
                    task: ep.task.id.clone(),
                    ..EvaluationDetails::default()
                },
            ),
        };
        let reward = result.reward;
        // Kernel tasks only: the tiny family's observations stay as its policies learnt them.
        if ep.task.is_kernel() {
            text.push('\n');
            text.push_str(&relative_paths(
                &reward::describe(&result),
                &self.cfg().data_dir,
                &ep.dir,
            ));
        }
        let evaluation = Some(result.clone());
        ep.result = Some(result);
        ep.status = if terminated {
            EpisodeStatus::Terminated
        } else {
            EpisodeStatus::Truncated
        };
        ep.truncation_reason = truncation_reason.clone();
        let how = if terminated {
            "terminated".to_string()
        } else {
            format!("truncated_{}", truncation_reason.as_deref().unwrap_or(""))
        };
        *self
            .counters
            .ended
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(how)
            .or_default() += 1;
        *self
            .counters
            .rewards
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(format!("{reward}"))
            .or_default() += 1;
        Ending {
            reward,
            evaluation,
            submitted,
        }
    }

    /// Logs the step's answer (and, when the episode ended, the files judged) before it
    /// leaves, and cleans up an ended episode.
    async fn record(
        &self,
        ep: &mut Episode,
        tool: &str,
        arguments: &Value,
        request_id: Option<String>,
        resp: &StepResponse,
        submitted: BTreeMap<String, String>,
    ) -> Result<(), EpisodeError> {
        let record = TrajectoryRecord::Step {
            time: trajectory::now(),
            body: StepRecord {
                action: PlainAction {
                    tool: tool.to_string(),
                    arguments: arguments.clone(),
                },
                request_id: request_id.clone(),
                response: resp.clone(),
            },
        };
        self.log(ep, record).await?;
        if let Some(rid) = request_id {
            ep.answered.insert(rid);
        }
        if resp.done {
            // The files judged, so replay and fine-tuning can use the solution itself.
            let record = TrajectoryRecord::Final {
                time: trajectory::now(),
                body: FinalRecord {
                    files: submitted,
                    result: ep.result.clone(),
                    task: ep.task.id.clone(),
                },
            };
            self.log(ep, record).await?;
            self.cleanup(ep).await;
        }
        Ok(())
    }

    /// The answer first given to `request_id`, from the trajectory log (read a record at a
    /// time, up to that answer).
    async fn logged_answer(
        &self,
        id: &str,
        request_id: &str,
    ) -> Result<Option<StepResponse>, EpisodeError> {
        let path = trajectory::path_of(&self.trajectories_dir(), id);
        let rid = request_id.to_string();
        blocking(
            self.cfg().io_timeout,
            "reading the trajectory log",
            move || {
                let mut found = None;
                trajectory::for_each(&path, |r| {
                    if let TrajectoryRecord::Step { body, .. } = r {
                        if body.request_id.as_deref() == Some(rid.as_str()) {
                            found = Some(body.response);
                        }
                    }
                    found.is_none()
                })
                .map(|()| found)
            },
        )
        .await?
        .map_err(|e| internal("reading the trajectory log", e))
    }

    async fn final_evaluation(
        &self,
        episode: &str,
        task: &Task,
        files: &BTreeMap<String, String>,
    ) -> EvaluationResult {
        let missing = task.is_kernel()
            && files
                .get("model_new.py")
                .is_none_or(|t| t.trim().is_empty());
        if missing {
            return reward::failed(
                "missing_solution: model_new.py is empty".into(),
                EvaluationDetails {
                    task: task.id.clone(),
                    ..EvaluationDetails::default()
                },
            );
        }
        match self
            .evaluator
            .evaluate_for(episode, task, files, None)
            .await
        {
            Ok(r) => r,
            Err(e) => reward::failed(
                format!("evaluation_error: {}", error_chain(&e)),
                EvaluationDetails {
                    task: task.id.clone(),
                    server_error: true,
                    ..EvaluationDetails::default()
                },
            ),
        }
    }
}
