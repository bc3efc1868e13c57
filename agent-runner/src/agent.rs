//! One episode driven by a chat model: reset, then the multi-turn loop (the model's tool calls
//! become steps, the observations go back as tool messages) until the server ends the
//! episode or one of the runner's own limits does.

use std::time::Instant;

use env_api::{EvaluationResult, ResetOptions, ResetRequest, StepResponse};
use env_client::{ClientError, EnvClient};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::openai::wire::ToolDefinition;
use crate::openai::{ChatClient, ChatError, Sampling, ToolCall, Usage};

/// Errors that end an episode without a result.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The environment server failed (reset, or a step it could not answer).
    #[error("environment: {0}")]
    Env(#[from] ClientError),
    /// The model server failed after its retries.
    #[error("model: {0}")]
    Model(#[from] ChatError),
}

/// The system prompt: the rules of the game in short; the task prompt says the rest.
pub const SYSTEM_PROMPT: &str = "You are an expert GPU performance engineer working in a sandboxed workspace. \
Act only through the tools you are given: one or more tool calls per reply. \
Read SKILL.md and model.py, write ModelNew in model_new.py with your own kernels, check it with `python verify.py`, \
time it with `python profile.py --compare eager compile`, and call Submit when it is correct and fast.";

/// What the runner holds an episode to, beyond the server's own limits.
#[derive(Debug, Clone)]
pub struct AgentLimits {
    /// Turns (tool calls) per episode, sent as the reset's `max_turns` (None: the server's).
    pub max_turns: Option<u32>,
    /// Tool-time budget per episode, seconds (None: the server's).
    pub time_budget_s: Option<f64>,
    /// Model replies in a row without a tool call before the runner submits for the model.
    pub max_idle_replies: u32,
    /// Model calls per episode before the runner submits for the model.
    pub max_model_calls: u32,
    /// Characters of one observation put into the conversation (middle cut beyond).
    pub max_observation_chars: usize,
    /// The model's context in tokens, when known (else learned from its errors).
    pub context_tokens: Option<u64>,
    /// Completions this short are not worth asking for: the conversation is compacted instead.
    pub min_completion_tokens: u64,
    /// Offer the model only these tools (None: every tool of the episode). A call to another
    /// is refused by the runner, as the server refuses an unknown tool.
    pub tools: Option<Vec<String>>,
}

impl Default for AgentLimits {
    fn default() -> Self {
        Self {
            max_turns: None,
            time_budget_s: None,
            max_idle_replies: 3,
            max_model_calls: 400,
            max_observation_chars: 16_000,
            context_tokens: None,
            min_completion_tokens: 256,
            tools: None,
        }
    }
}

/// Which task an episode runs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum TaskChoice {
    /// A task the server serves, by id.
    Id(String),
    /// A user's own task: the source of a Python file with Model, get_inputs, get_init_inputs.
    Source(String),
}

/// How an episode ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpisodeRecord {
    /// The task id the server gave.
    pub task: String,
    /// The task's level (0 for a user's task).
    pub level: u8,
    /// Which sample of the task this is (0-based).
    pub sample: u32,
    /// The server's episode id: its trajectory log is the full record.
    pub episode_id: String,
    /// `terminated` (the model submitted), `truncated:<reason>` (the server's limits), or
    /// `runner:<reason>` (the runner submitted for the model: `idle`, `model_calls`,
    /// `context`).
    pub end: String,
    /// Final reward.
    pub reward: f64,
    /// The final evaluation.
    pub evaluation: Option<EvaluationResult>,
    /// Tool calls the server ran (turns).
    pub turns: u32,
    /// Tool calls the server refused (bad arguments, unknown tools): shown to the model as
    /// errors, no turn taken.
    pub refused_calls: u32,
    /// Model replies without a tool call.
    pub idle_replies: u32,
    /// Tool outputs elided to fit the context.
    pub elided: u32,
    /// Tokens and calls.
    pub usage: Usage,
    /// Wall time, seconds.
    pub wall_s: f64,
}

/// Cuts the middle out of `text` beyond `max` characters.
pub fn middle_cut(text: &str, max: usize) -> String {
    let n = text.chars().count();
    if n <= max {
        return text.to_string();
    }
    let keep = max / 2;
    let head: String = text.chars().take(keep).collect();
    let tail: String = text.chars().skip(n - keep).collect();
    format!("{head}\n[... {} characters cut ...]\n{tail}", n - 2 * keep)
}

/// The conversation, with what it takes to fit it into the model's context.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// The messages, system first.
    pub messages: Vec<Value>,
    /// Index of the next tool message that may be elided.
    next_elidable: usize,
}

/// What an elided tool output is replaced with.
pub const ELIDED: &str = "[output elided to fit the context]";

impl Conversation {
    /// A conversation: the system prompt and the task prompt.
    pub fn new(system: &str, prompt: &str) -> Self {
        Self {
            messages: vec![
                json!({"role": "system", "content": system}),
                json!({"role": "user", "content": prompt}),
            ],
            next_elidable: 2,
        }
    }

    /// Elides the oldest tool output not yet elided; false when none is left.
    pub fn elide_oldest(&mut self) -> bool {
        while self.next_elidable < self.messages.len() {
            let i = self.next_elidable;
            self.next_elidable += 1;
            let m = &mut self.messages[i];
            if m["role"] == "tool" && m["content"] != ELIDED {
                m["content"] = json!(ELIDED);
                return true;
            }
        }
        false
    }

    /// Characters in the conversation (a token is a few of them).
    pub fn chars(&self) -> usize {
        self.messages.iter().map(|m| m.to_string().len()).sum()
    }
}

/// The text a step's answer puts back into the conversation.
fn observation_text(resp: &StepResponse, max: usize) -> String {
    let mut t = middle_cut(&resp.observation.text, max);
    if resp.done {
        t.push_str(&format!("\n[episode ended: reward {}]", resp.reward));
    }
    t
}

/// What became of one tool call.
#[derive(Debug)]
pub enum Executed {
    /// The server ran it.
    Observed(Box<StepResponse>),
    /// Refused (no turn taken): why, for the model.
    Refused(String),
    /// The episode had ended by the server's doing; its state.
    EndedElsewhere(Box<env_api::EpisodeState>),
}

/// One episode of `task` with the model behind `chat`.
#[derive(Debug, Clone)]
pub struct Agent {
    /// The environment.
    pub env: EnvClient,
    /// The model.
    pub chat: ChatClient,
    /// Sampling settings.
    pub sampling: Sampling,
    /// Limits.
    pub limits: AgentLimits,
}

impl Agent {
    /// Runs one episode to its end. An error leaves no result; the episode is closed.
    pub async fn run(&self, task: &TaskChoice, sample: u32) -> Result<EpisodeRecord, AgentError> {
        let started = Instant::now();
        let options = (self.limits.max_turns.is_some() || self.limits.time_budget_s.is_some())
            .then_some(ResetOptions {
                max_turns: self.limits.max_turns,
                time_budget_s: self.limits.time_budget_s,
            });
        let (task_id, task_source) = match task {
            TaskChoice::Id(id) => (Some(id.clone()), None),
            TaskChoice::Source(s) => (None, Some(s.clone())),
        };
        let req = ResetRequest {
            task: task_id,
            task_source,
            options,
            ..Default::default()
        };
        // A full server (503 at capacity, 429) takes new episodes again as others end.
        let mut attempt = 0;
        let reset = loop {
            match self.env.reset(&req).await {
                Err(e) if e.is_retryable() && attempt < self.chat.retry.max_retries => {
                    let delay = self.chat.retry.delay(attempt, None);
                    tracing::debug!(error = %e, delay_s = delay.as_secs_f64(), "reset retried");
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
                r => break r?,
            }
        };
        let id = reset.episode_id.clone();
        let mut rec = EpisodeRecord {
            task: reset.info.task.id.clone(),
            level: reset.info.task.level,
            sample,
            episode_id: id.clone(),
            end: String::new(),
            reward: 0.0,
            evaluation: None,
            turns: 0,
            refused_calls: 0,
            idle_replies: 0,
            elided: 0,
            usage: Usage::default(),
            wall_s: 0.0,
        };
        let result = self.drive(&reset, &mut rec).await;
        rec.wall_s = started.elapsed().as_secs_f64();
        match result {
            Ok(()) => Ok(rec),
            Err(e) => {
                // No result: free the server's workspace now rather than at its idle timeout.
                if let Err(close) = self.env.close(&id).await {
                    tracing::warn!(episode = %id, error = %close, "closing a failed episode");
                }
                Err(e)
            }
        }
    }

    async fn drive(
        &self,
        reset: &env_api::ResetResponse,
        rec: &mut EpisodeRecord,
    ) -> Result<(), AgentError> {
        let id = reset.episode_id.as_str();
        let tools: Vec<ToolDefinition> = reset
            .info
            .tools
            .iter()
            .filter_map(|t| match ToolDefinition::deserialize(t) {
                Ok(tool) => Some(tool),
                Err(e) => {
                    tracing::warn!(episode = id, error = %e, "tool not offered: not a function tool");
                    None
                }
            })
            .filter(|t| self.offered(&t.function.name))
            .collect();
        let tools = &tools;
        let max_obs = self.limits.max_observation_chars;
        let mut conv = Conversation::new(
            SYSTEM_PROMPT,
            &middle_cut(&reset.observation.text, max_obs.max(4096) * 2),
        );
        let mut context = self.limits.context_tokens;
        let mut max_tokens = self.sampling.max_tokens;
        let mut idle_in_a_row = 0u32;
        let mut calls_made = 0usize;
        // Tokens per character of this conversation, learned from the model's usage reports.
        let mut tokens_per_char = 0.3f64;
        loop {
            if rec.usage.calls >= u64::from(self.limits.max_model_calls) {
                return self.submit_for_model(id, rec, "model_calls").await;
            }
            // Leave room for the completion where the context is known.
            let mut sampling = self.sampling.clone();
            sampling.max_tokens = max_tokens;
            if let Some(ctx) = context {
                let estimate = (conv.chars() as f64 * tokens_per_char) as u64;
                let room = ctx.saturating_sub(estimate + 32);
                if room < self.limits.min_completion_tokens {
                    if conv.elide_oldest() {
                        rec.elided += 1;
                        continue;
                    }
                    return self.submit_for_model(id, rec, "context").await;
                }
                sampling.max_tokens = max_tokens.min(room);
            }
            let completion = match self
                .chat
                .complete(&conv.messages, tools, &sampling, calls_made)
                .await
            {
                Ok(c) => c,
                Err(ChatError::ContextLength { message, limit }) => {
                    tracing::debug!(episode = id, %message, "context exceeded");
                    if limit.is_some() {
                        context = limit;
                    }
                    if conv.elide_oldest() {
                        rec.elided += 1;
                        continue;
                    }
                    if max_tokens > self.limits.min_completion_tokens {
                        max_tokens = (max_tokens / 2).max(self.limits.min_completion_tokens);
                        continue;
                    }
                    return self.submit_for_model(id, rec, "context").await;
                }
                Err(e) => return Err(e.into()),
            };
            rec.usage.add(&completion.usage);
            if completion.usage.prompt_tokens > 0 {
                tokens_per_char =
                    completion.usage.prompt_tokens as f64 / conv.chars().max(1) as f64;
            }
            calls_made += completion.tool_calls.len();
            conv.messages.push(completion.message());
            if completion.tool_calls.is_empty() {
                rec.idle_replies += 1;
                idle_in_a_row += 1;
                if idle_in_a_row >= self.limits.max_idle_replies {
                    return self.submit_for_model(id, rec, "idle").await;
                }
                let nudge = if completion.finish_reason == "length" {
                    "Your reply was cut off at the token limit. Reply with a tool call."
                } else {
                    "Reply with a tool call: the tools are the only way to act. Call Submit when you are done."
                };
                conv.messages
                    .push(json!({"role": "user", "content": nudge}));
                continue;
            }
            idle_in_a_row = 0;
            for call in &completion.tool_calls {
                let text = match self.execute(id, call).await? {
                    Executed::Observed(resp) => {
                        rec.turns = resp.info.turn;
                        let text = observation_text(&resp, max_obs);
                        if resp.done {
                            conv.messages.push(
                                json!({"role": "tool", "tool_call_id": call.id, "content": text}),
                            );
                            finish(rec, &resp);
                            return Ok(());
                        }
                        text
                    }
                    Executed::Refused(text) => {
                        rec.refused_calls += 1;
                        text
                    }
                    Executed::EndedElsewhere(state) => {
                        rec.turns = state.turn;
                        rec.reward = state.result.as_ref().map_or(-1.0, |r| r.reward);
                        rec.evaluation = state.result;
                        rec.end = format!(
                            "truncated:{}",
                            state.truncation_reason.as_deref().unwrap_or("unknown")
                        );
                        return Ok(());
                    }
                };
                conv.messages
                    .push(json!({"role": "tool", "tool_call_id": call.id, "content": text}));
            }
        }
    }

    fn offered(&self, tool: &str) -> bool {
        self.limits
            .tools
            .as_ref()
            .is_none_or(|only| only.iter().any(|t| t == tool))
    }

    /// Runs one tool call of the model as a step of episode `id`. A call the server refuses
    /// (unknown tool, arguments that are not JSON or do not fit the tool) comes back as the
    /// text the model reads, as a tool error would; the server takes no turn for it.
    pub async fn execute(&self, id: &str, call: &ToolCall) -> Result<Executed, AgentError> {
        if !self.offered(&call.name) {
            return Ok(Executed::Refused(format!(
                "error (unknown_tool): {} is not one of your tools",
                call.name
            )));
        }
        match self.env.step(id, &call.name, call.arguments.clone()).await {
            Ok(resp) => Ok(Executed::Observed(Box::new(resp))),
            Err(ClientError::Api {
                status,
                code,
                message,
            }) if (400..500).contains(&status) && status != 404 && status != 409 => {
                Ok(Executed::Refused(format!("error ({code}): {message}")))
            }
            // Ended by the server meanwhile (idle timeout, a restart): its state says how.
            Err(ClientError::Api { status: 409, .. }) => Ok(Executed::EndedElsewhere(Box::new(
                self.env.state(id).await?,
            ))),
            Err(e) => Err(e.into()),
        }
    }

    /// Ends the episode with a Submit the runner makes for the model (it stopped calling
    /// tools, ran out of model calls, or of context): the workspace is judged as it is.
    async fn submit_for_model(
        &self,
        id: &str,
        rec: &mut EpisodeRecord,
        why: &str,
    ) -> Result<(), AgentError> {
        let resp = self.env.step(id, "Submit", json!({})).await?;
        rec.turns = resp.info.turn;
        finish(rec, &resp);
        rec.end = format!("runner:{why}");
        Ok(())
    }
}

fn finish(rec: &mut EpisodeRecord, resp: &StepResponse) {
    rec.reward = resp.reward;
    rec.evaluation = resp.info.evaluation.clone();
    rec.end = if resp.terminated {
        "terminated".into()
    } else {
        format!(
            "truncated:{}",
            resp.info.truncation_reason.as_deref().unwrap_or("unknown")
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_observations_lose_their_middle() {
        let t = "a".repeat(50) + &"b".repeat(100) + &"c".repeat(50);
        let cut = middle_cut(&t, 100);
        assert!(cut.starts_with(&"a".repeat(50)) && cut.ends_with(&"c".repeat(50)));
        assert!(cut.contains("100 characters cut"), "{cut}");
        assert_eq!(middle_cut("short", 100), "short");
    }

    #[test]
    fn compaction_elides_tool_outputs_oldest_first_and_keeps_the_prompt() {
        let mut c = Conversation::new("sys", "task");
        for i in 0..3 {
            c.messages
                .push(json!({"role": "assistant", "content": "", "tool_calls": []}));
            c.messages
                .push(json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": format!("out{i} {}", "x".repeat(100))}));
        }
        let before = c.chars();
        assert!(c.elide_oldest());
        assert_eq!(c.messages[3]["content"], ELIDED);
        assert!(c.messages[5]["content"]
            .as_str()
            .unwrap()
            .starts_with("out1"));
        assert!(c.elide_oldest() && c.elide_oldest());
        assert!(!c.elide_oldest(), "nothing left to elide");
        assert_eq!(c.messages[1]["content"], "task");
        assert!(c.chars() < before);
    }
}
