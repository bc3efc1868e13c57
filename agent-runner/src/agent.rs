//! One episode driven by a chat model: reset, then the multi-turn loop (the model's tool calls
//! become steps, the observations go back as tool messages) until the server ends the
//! episode or one of the runner's own limits does.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use env_api::{ErrorChain, EvaluationResult, ResetOptions, ResetRequest, StepResponse};
use env_client::{ClientError, EnvClient};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::openai::wire::ToolDefinition;
use crate::openai::{ChatClient, ChatError, Sampling, ToolCall, Usage};

/// Errors that end an episode without a result.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The environment server failed (reset, or a step it could not answer).
    #[error("environment")]
    Env(#[from] ClientError),
    /// The model server failed after its retries.
    #[error("model")]
    Model(#[from] ChatError),
}

/// The system prompt: the rules of the game in short; the task prompt says the rest.
pub const SYSTEM_PROMPT: &str = "You are an expert GPU performance engineer working in a sandboxed workspace. \
Act only through the tools you are given: one or more tool calls per reply. \
Read SKILL.md and model.py, write ModelNew in model_new.py with your own kernels, check it with `python verify.py`, \
time it with `python profile.py --compare eager compile`, and call Submit when it is correct and fast.";

/// The system prompt of the compact first prompt, for models of small context.
pub const COMPACT_SYSTEM_PROMPT: &str = "You write fast kernels in a sandboxed workspace, acting only through tool calls. \
Write ModelNew in model_new.py, run `python verify.py` until it passes, then call Submit. SKILL.md has the details.";

/// The tools the compact prompt offers: enough to read, write, run and submit (Bash lists and
/// searches files where Glob and Grep would).
pub const COMPACT_TOOLS: &[&str] = &["Bash", "Read", "Write", "Edit", "Submit"];

/// Share of the model's context the first prompt may take: the rest, two thirds, is the
/// episode's work. Past it (where the context is known) the compact prompt is used: an L1
/// task's compact prompt fits a third of 8k tokens, its full prompt (7,623 tokens measured
/// before the tools' schemas were compacted, 8.9 KB of text since) does not.
pub const FIRST_PROMPT_SHARE: f64 = 1.0 / 3.0;

/// Tokens per character assumed for a prompt before the model has reported any. JSON
/// schemas tokenize densely: the full first prompt of an L1 task, 11.7 KB (9.8 KB of it the
/// tools' schemas, before they were compacted to 7 KB), measured 7,623 tokens, 0.65 a
/// character.
pub const TOKENS_PER_CHAR_GUESS: f64 = 0.65;

/// Which first prompt an episode starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PromptStyle {
    /// Compact where the full prompt would take more than [`FIRST_PROMPT_SHARE`] of a known
    /// context, or where the model's context turns out too small for it.
    #[default]
    Auto,
    /// Every tool with its whole description, and the full system prompt.
    Full,
    /// [`COMPACT_SYSTEM_PROMPT`], [`COMPACT_TOOLS`] with the first sentence of each
    /// description and no parameter descriptions.
    Compact,
}

impl std::str::FromStr for PromptStyle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "full" => Ok(Self::Full),
            "compact" => Ok(Self::Compact),
            other => Err(format!(
                "{other:?}: the prompt styles are auto, full and compact"
            )),
        }
    }
}

/// A tool as the compact prompt offers it: the first sentence of its description, its
/// parameters' names and types (no descriptions, defaults or formats).
pub fn compact_tool(t: &ToolDefinition) -> ToolDefinition {
    let mut t = t.clone();
    if let Some(d) = &t.function.description {
        t.function.description = Some(first_sentence(d).to_string());
    }
    if let Some(p) = &mut t.function.parameters {
        if let Value::Object(map) = p {
            map.remove("description");
        }
        strip_descriptions(p);
    }
    t
}

fn first_sentence(text: &str) -> &str {
    match text.find(". ") {
        Some(i) => &text[..=i],
        None => text,
    }
}

/// Removes every `description`, `default` and `format` of a JSON Schema's properties, at any
/// depth: prose and hints the model can do without, the types and required names kept.
fn strip_descriptions(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            if let Some(Value::Object(props)) = map.get_mut("properties") {
                for p in props.values_mut() {
                    if let Value::Object(pm) = p {
                        for key in ["description", "default", "format"] {
                            pm.remove(key);
                        }
                    }
                    strip_descriptions(p);
                }
            }
            for key in ["items", "anyOf", "oneOf", "allOf", "$defs", "definitions"] {
                if let Some(v) = map.get_mut(key) {
                    strip_descriptions(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(strip_descriptions),
        _ => {}
    }
}

/// Share of the model's context one tool output may take, where the context is known: a
/// verify.py log of 16,000 characters (the default cap, about 10,000 tokens) would fill an
/// 8k context by itself.
pub const OBSERVATION_SHARE: f64 = 0.25;

/// Characters of one tool output put into the conversation: `max`, or less where a known
/// `context` (tokens) is small, so that one output takes at most [`OBSERVATION_SHARE`] of
/// it; never below 1,024 (an error's first lines).
pub fn observation_chars(max: usize, context: Option<u64>) -> usize {
    match context {
        Some(ctx) => {
            let fits = (ctx as f64 * OBSERVATION_SHARE / TOKENS_PER_CHAR_GUESS) as usize;
            max.min(fits.max(1024))
        }
        None => max,
    }
}

/// Characters of a first prompt: the system prompt, the task prompt and the tools' schemas
/// (what the model's chat template renders, give or take its own markup).
pub fn first_prompt_chars(system: &str, prompt: &str, tools: &[ToolDefinition]) -> usize {
    system.len()
        + prompt.len()
        + tools
            .iter()
            .map(|t| serde_json::to_string(t).map_or(0, |s| s.len()))
            .sum::<usize>()
}

/// Whether the full first prompt of `chars` characters is over its share of a `context`
/// of tokens.
pub fn full_prompt_too_long(chars: usize, context: u64) -> bool {
    chars as f64 * TOKENS_PER_CHAR_GUESS > context as f64 * FIRST_PROMPT_SHARE
}

/// Every message of an episode's conversation as it entered the context (the model's replies,
/// the tool results, the runner's nudges), one JSON line each, written as they come: a run
/// that ends early or fails still leaves what the model saw and said.
#[derive(Debug)]
pub struct Transcript {
    path: PathBuf,
    file: Option<std::fs::File>,
}

impl Transcript {
    /// `<dir>/<episode_id>.messages.jsonl`, created (or appended to).
    pub fn create(dir: &Path, episode_id: &str) -> std::io::Result<Self> {
        let path = dir.join(format!("{episode_id}.messages.jsonl"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        Ok(Self {
            path,
            file: Some(file),
        })
    }

    /// Appends one message; after a write error (a full disk) the transcript stops, with a
    /// warning, rather than ending the episode.
    pub fn append(&mut self, message: &Value) {
        let Some(f) = &mut self.file else {
            return;
        };
        if let Err(e) = writeln!(f, "{message}") {
            tracing::warn!(path = %self.path.display(), error = %e, "the transcript stops here");
            self.file = None;
        }
    }
}

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
    /// Characters of one observation put into the conversation (middle cut beyond); less
    /// where a known context is small ([`observation_chars`]).
    pub max_observation_chars: usize,
    /// The model's context in tokens, when known (else learned from its errors).
    pub context_tokens: Option<u64>,
    /// Completions this short are not worth asking for: the conversation is compacted instead.
    pub min_completion_tokens: u64,
    /// Offer the model only these tools (None: every tool of the episode). A call to another
    /// is refused by the runner, as the server refuses an unknown tool.
    pub tools: Option<Vec<String>>,
    /// Which first prompt to start with.
    pub prompt: PromptStyle,
    /// Where each episode's messages go (`<episode_id>.messages.jsonl`); None: nowhere.
    pub transcripts: Option<PathBuf>,
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
            prompt: PromptStyle::Auto,
            transcripts: None,
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
    // The model reads what was cut and how to get it: a file read whole into a small context
    // (SKILL.md's rules sit in its middle) is read again in parts.
    format!(
        "{head}\n[... {} characters cut to fit the context: Read with offset and limit, or Bash with sed -n or grep, shows a part ...]\n{tail}",
        n - 2 * keep
    )
}

/// The conversation, with what it takes to fit it into the model's context.
#[derive(Debug)]
pub struct Conversation {
    /// The messages, system first.
    pub messages: Vec<Value>,
    /// Index of the next tool message that may be elided.
    next_elidable: usize,
    /// Where each message is also written as it is added.
    transcript: Option<Transcript>,
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
            transcript: None,
        }
    }

    /// Writes every message, the ones there now and each one added, to `transcript`.
    pub fn record_to(&mut self, mut transcript: Transcript) {
        for m in &self.messages {
            transcript.append(m);
        }
        self.transcript = Some(transcript);
    }

    /// Puts `system` in place of the system message; the transcript gets the new one as a
    /// line of its own, marked as replacing the first.
    pub fn replace_system(&mut self, system: &str) {
        let m = json!({"role": "system", "content": system});
        if let Some(t) = &mut self.transcript {
            let mut noted = m.clone();
            noted["replaces_message"] = json!(0);
            t.append(&noted);
        }
        self.messages[0] = m;
    }

    /// Adds a message (and writes it to the transcript).
    pub fn push(&mut self, message: Value) {
        if let Some(t) = &mut self.transcript {
            t.append(&message);
        }
        self.messages.push(message);
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
                    tracing::debug!(error = %ErrorChain(&e), delay_s = delay.as_secs_f64(), "reset retried");
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
                    tracing::warn!(episode = %id, error = %ErrorChain(&close), "closing a failed episode");
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
        let compact_tools: Vec<ToolDefinition> = tools
            .iter()
            .filter(|t| COMPACT_TOOLS.contains(&t.function.name.as_str()))
            .map(compact_tool)
            .collect();
        let max_obs = self.limits.max_observation_chars;
        let prompt = middle_cut(&reset.observation.text, max_obs.max(4096) * 2);
        let mut compact = match self.limits.prompt {
            PromptStyle::Full => false,
            PromptStyle::Compact => true,
            PromptStyle::Auto => self.limits.context_tokens.is_some_and(|ctx| {
                full_prompt_too_long(first_prompt_chars(SYSTEM_PROMPT, &prompt, &tools), ctx)
            }),
        };
        let mut conv = Conversation::new(
            if compact {
                COMPACT_SYSTEM_PROMPT
            } else {
                SYSTEM_PROMPT
            },
            &prompt,
        );
        if let Some(dir) = &self.limits.transcripts {
            match Transcript::create(dir, id) {
                Ok(t) => conv.record_to(t),
                Err(e) => {
                    tracing::warn!(episode = id, dir = %dir.display(), error = %e, "no transcript")
                }
            }
        }
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
            let offered = if compact { &compact_tools } else { &tools };
            let completion = match self
                .chat
                .complete(&conv.messages, offered, &sampling, calls_made)
                .await
            {
                Ok(c) => c,
                Err(ChatError::ContextLength { message, limit }) => {
                    tracing::debug!(episode = id, %message, "context exceeded");
                    if limit.is_some() {
                        context = limit;
                    }
                    // Too small a context for the full prompt: the compact one, before
                    // anything the episode did is given up.
                    if !compact && self.limits.prompt == PromptStyle::Auto {
                        compact = true;
                        conv.replace_system(COMPACT_SYSTEM_PROMPT);
                        continue;
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
            conv.push(completion.message());
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
                conv.push(json!({"role": "user", "content": nudge}));
                continue;
            }
            idle_in_a_row = 0;
            for call in &completion.tool_calls {
                let text = match self.execute(id, call).await? {
                    Executed::Observed(resp) => {
                        rec.turns = resp.info.turn;
                        let text = observation_text(&resp, observation_chars(max_obs, context));
                        if resp.done {
                            conv.push(
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
                conv.push(json!({"role": "tool", "tool_call_id": call.id, "content": text}));
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
        assert!(cut.contains("Read with offset and limit"), "{cut}");
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
