//! Episodes against env-server: many at once over one or more servers, the policy sampling
//! every assistant turn in batches, the servers running the tools and paying the reward.
//!
//! Generation is synchronous (it owns the device); HTTP is async and runs on a tokio runtime
//! between generations, all live episodes' steps at once under a concurrency bound.

use std::sync::Arc;
use std::time::{Duration, Instant};

use env_api::{
    error_chain, ErrorChain, EvaluateRequest, ResetRequest, ResetResponse, SolutionRef,
    StepResponse, TaskRef,
};
use env_client::{ClientError, Fleet, FleetConfig, FleetError, ServerHandle};
use serde_json::Value;
use tokio::sync::Semaphore;

use crate::chat::parse_tool_call;
use crate::config::{RolloutSection, ServerSection};
use crate::error::{ModelError, TrainError};
use crate::generate::{Generation, SamplingParams};
use crate::render::Renderer;
use crate::sample::{Outcome, Sample, TurnRecord};

mod continuous;

/// Samples assistant turns for a batch of token contexts.
pub trait Generator {
    /// One continuation per prompt, seeded by `seed`.
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
        seed: u64,
    ) -> Vec<Generation>;

    /// One turn for each conversation `keys[i]`, whose whole context so far is
    /// `contexts[i]`. A generator that keeps each conversation's cache between turns
    /// prefills only what was added since its last one; by default, the whole context.
    fn continue_conversations(
        &mut self,
        keys: &[usize],
        contexts: &[Vec<u32>],
        params: &SamplingParams,
        seed: u64,
    ) -> TurnBatch {
        let _ = keys;
        TurnBatch {
            generations: self.generate(contexts, params, seed),
            prefilled_tokens: contexts.iter().map(Vec::len).sum(),
            reused_tokens: 0,
        }
    }

    /// Conversation `key` has ended: what was kept for it can go.
    fn end_conversation(&mut self, key: usize) {
        let _ = key;
    }

    /// Continuous batching: `turns` join the running batch, sampled with `params` (each with
    /// its own token limit and seed). Returns the context tokens prefilled and those reused
    /// from kept caches.
    fn admit(&mut self, turns: Vec<TurnStart>, params: &SamplingParams) -> (usize, usize);

    /// One decode step of the running batch: the turns that ended in it, by key.
    fn step(&mut self) -> Vec<(usize, Generation)>;

    /// Turns in the running batch.
    fn running(&self) -> usize;
}

/// A conversation's next turn, for [`Generator::admit`].
#[derive(Debug, Clone, PartialEq)]
pub struct TurnStart {
    /// The conversation.
    pub key: usize,
    /// Its whole context so far.
    pub context: Vec<u32>,
    /// Tokens the turn may sample at most.
    pub max_new_tokens: usize,
    /// Seeds the turn's draws.
    pub seed: u64,
}

/// The turns of one [`Generator::continue_conversations`] call.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnBatch {
    /// One generation per conversation.
    pub generations: Vec<Generation>,
    /// Context tokens run through the model before sampling.
    pub prefilled_tokens: usize,
    /// Context tokens taken from kept caches instead.
    pub reused_tokens: usize,
}

/// The environment servers (a fleet: URLs, or `dns+http://NAME:PORT` for every address of a
/// name), with new episodes spread across them and moved off servers that go away, and
/// requests bounded in number.
#[derive(Debug, Clone)]
pub struct EnvPool {
    fleet: Fleet,
    sources: usize,
    permits: Arc<Semaphore>,
    /// How long a reset refused for want of room keeps trying (multi-turn rollouts).
    room_wait: Duration,
}

impl EnvPool {
    /// The fleet of the configured URLs.
    pub fn new(section: &ServerSection) -> Result<Self, TrainError> {
        if section.urls.is_empty() {
            return Err(TrainError::Config("server.urls is empty".into()));
        }
        let fleet = Fleet::new(FleetConfig {
            urls: section.urls.clone(),
            api_key: section.api_key.clone(),
            timeout: Duration::from_secs_f64(section.timeout_s.max(1.0)),
            retries: section.retries,
            resolve_every: Duration::from_secs_f64(section.resolve_every_s.max(0.0)),
            ..FleetConfig::default()
        })
        .map_err(TrainError::Fleet)?;
        Ok(Self {
            fleet,
            sources: section.urls.len(),
            permits: Arc::new(Semaphore::new(section.concurrency.max(1))),
            room_wait: Duration::from_secs_f64(section.room_wait_s.max(0.0)),
        })
    }

    /// Number of configured URLs (a name may stand for many servers).
    pub fn len(&self) -> usize {
        self.sources
    }

    /// Whether there are no servers (never: `new` refuses that).
    pub fn is_empty(&self) -> bool {
        self.sources == 0
    }

    /// The fleet.
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }
}

/// A fleet's failure as the client error the rollout reports (a fleet with no server to ask
/// included).
fn client_error(e: FleetError) -> ClientError {
    match e {
        FleetError::Server { source, .. } => source,
        other => ClientError::Api {
            status: 0,
            code: "no_server".into(),
            message: other.to_string(),
        },
    }
}

/// Counts and times of one batch of episodes.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RolloutStats {
    /// Episodes started.
    pub episodes: usize,
    /// Episodes that failed on a server error (left out of training), not counting `lost`.
    pub failed: usize,
    /// Episodes lost with their server: it went away or drained while they ran (left out of
    /// training; nothing was wrong with them).
    #[serde(default)]
    pub lost: usize,
    /// Assistant turns sampled.
    pub turns: usize,
    /// Tokens the policy sampled.
    pub policy_tokens: usize,
    /// All tokens of all conversations.
    pub total_tokens: usize,
    /// Seconds spent generating.
    pub generate_s: f64,
    /// Context tokens the policy prefilled (with caches kept across turns, only what each
    /// turn added).
    #[serde(default)]
    pub prefilled_tokens: usize,
    /// Context tokens taken from caches kept across turns.
    #[serde(default)]
    pub reused_tokens: usize,
    /// Seconds the generator sat waiting for the servers (tools and evaluations), with no
    /// turn to decode.
    pub env_s: f64,
    /// Seconds of the servers' answers to tool calls, summed over calls: with turns decoding
    /// while calls are out, more than `env_s` (the time the two overlapped).
    #[serde(default)]
    pub env_requests_s: f64,
}

/// What the rollout needs from the config.
#[derive(Debug, Clone)]
pub struct RolloutSettings {
    /// Sampling (the token limit is set per turn).
    pub sampling: SamplingParams,
    /// Tokens per assistant turn at most.
    pub max_turn_tokens: usize,
    /// Tokens per conversation at most.
    pub context: usize,
    /// Assistant turns at most.
    pub max_turns: u32,
    /// Reward of an episode the trainer closes.
    pub failure_reward: f32,
    /// Conversations per batched generation.
    pub generation_batch: usize,
}

impl RolloutSettings {
    /// Settings of the multi-turn rollout from the config.
    pub fn multi_turn(r: &RolloutSection, stop_ids: &[u32]) -> Self {
        Self {
            sampling: SamplingParams {
                temperature: r.temperature,
                top_p: r.top_p,
                top_k: r.top_k,
                max_new_tokens: r.max_turn_tokens,
                stop_token_ids: stop_ids.to_vec(),
                stop_strings: Vec::new(),
            },
            max_turn_tokens: r.max_turn_tokens,
            context: r.context,
            max_turns: r.max_turns,
            failure_reward: r.failure_reward,
            generation_batch: r.generation_batch.max(1),
        }
    }

    /// Settings of the single-turn warm-up: one turn in the shorter context.
    pub fn single_turn(r: &RolloutSection, stop_ids: &[u32]) -> Self {
        Self {
            context: r.single_turn_context,
            max_turns: 1,
            ..Self::multi_turn(r, stop_ids)
        }
    }
}

/// One conversation of a rollout.
struct Live {
    sample: Sample,
    /// The server the episode lives on (none when its reset failed).
    server: Option<ServerHandle>,
    /// Ended because its server went away or drained.
    lost: bool,
    done: bool,
    last_turn: Vec<u32>,
    /// Its reset was refused for want of room: it is opened again while the batch runs.
    waiting_for_room: bool,
}

/// What a rollout round needs besides the conversations.
struct Round<'a> {
    rt: &'a tokio::runtime::Runtime,
    pool: &'a EnvPool,
    renderer: &'a Renderer,
    settings: &'a RolloutSettings,
}

/// Runs one multi-turn episode per reset request until every one ends. `tag` makes request
/// ids unique across steps of a run (`{tag}-{episode}-{turn}`), so retries are idempotent.
#[allow(clippy::too_many_arguments)]
pub fn run_episodes(
    rt: &tokio::runtime::Runtime,
    pool: &EnvPool,
    renderer: &Renderer,
    generator: &mut dyn Generator,
    resets: &[ResetRequest],
    settings: &RolloutSettings,
    tag: &str,
    seed: u64,
) -> (Vec<Sample>, RolloutStats) {
    let round = Round {
        rt,
        pool,
        renderer,
        settings,
    };
    continuous::rollout(&round, generator, resets, seed, tag)
}

/// The single-turn warm-up: each task's prompt (from a reset, so it is the same text the
/// multi-turn agent sees, then closed), one generated answer, scored by `/v1/evaluate` with
/// the answer's code block as `model_new.py` (the whole answer when it has no block).
pub fn run_single_turn(
    rt: &tokio::runtime::Runtime,
    pool: &EnvPool,
    renderer: &Renderer,
    generator: &mut dyn Generator,
    resets: &[ResetRequest],
    settings: &RolloutSettings,
    seed: u64,
) -> (Vec<Sample>, RolloutStats) {
    let round = Round {
        rt,
        pool,
        renderer,
        settings,
    };
    single_turn(&round, generator, resets, seed)
}

/// The warm-up's one round: reset (and close) every episode, generate each answer in batches,
/// and have every answer's code block judged; a prompt with no room to answer in is closed
/// at the context limit (with the failure reward).
fn single_turn(
    round: &Round<'_>,
    generator: &mut dyn Generator,
    resets: &[ResetRequest],
    seed: u64,
) -> (Vec<Sample>, RolloutStats) {
    let settings = round.settings;
    let mut stats = RolloutStats {
        episodes: resets.len(),
        ..Default::default()
    };
    let mut live = open(round, resets, single_turn_prompt, false, &mut stats);
    let (full, rows): (Vec<usize>, Vec<usize>) = (0..live.len())
        .filter(|&i| !live[i].done)
        .partition(|&i| live[i].sample.tokens.len() + 8 >= settings.context);
    for i in full {
        close_by_trainer(&mut live[i], Outcome::ContextLimit, settings.failure_reward);
    }
    let tg = Instant::now();
    generate_turns(generator, &mut live, &rows, settings, seed, 0, &mut stats);
    stats.generate_s += tg.elapsed().as_secs_f64();
    stats.env_s += evaluate_answers(round, &mut live, &rows);
    for i in rows {
        generator.end_conversation(i);
    }
    finish(live, stats)
}

/// The samples of a rollout's conversations, and its stats completed with what ended them.
fn finish(live: Vec<Live>, mut stats: RolloutStats) -> (Vec<Sample>, RolloutStats) {
    stats.lost = live.iter().filter(|l| l.lost).count();
    stats.failed = live
        .iter()
        .filter(|l| !l.lost && l.sample.outcome == Some(Outcome::Failed))
        .count();
    if stats.lost > 0 {
        tracing::warn!(
            lost = stats.lost,
            "episodes lost with their servers (gone or draining)"
        );
    }
    let samples: Vec<Sample> = live.into_iter().map(|l| l.sample).collect();
    stats.total_tokens = samples.iter().map(|s| s.tokens.len()).sum();
    (samples, stats)
}

/// The opening prompt of an episode, from its reset.
type Prompt = fn(&Renderer, &ResetResponse) -> Result<Vec<u32>, ModelError>;

/// Resets every episode and renders its `prompt`; an episode whose reset or prompt failed is
/// born done (`Outcome::Failed`, left out of training). Without `keep`, episodes are closed on
/// the server as soon as they open (the warm-up only needs the task's text); with it, one
/// refused for want of room is left `waiting_for_room`.
fn open(
    round: &Round<'_>,
    resets: &[ResetRequest],
    prompt: Prompt,
    keep: bool,
    stats: &mut RolloutStats,
) -> Vec<Live> {
    let t0 = Instant::now();
    let opened = round.rt.block_on(reset_all(round.pool, resets, !keep));
    stats.env_s += t0.elapsed().as_secs_f64();
    opened
        .into_iter()
        .enumerate()
        .map(|(i, r)| opened_live(round.renderer, &resets[i], r, prompt, keep, keep))
        .collect()
}

/// The conversation a reset's answer starts: its prompt rendered, or born done (`Failed`)
/// where the reset or the prompt failed. An episode every server refused for want of room
/// waits for room instead (`waiting_for_room`) when it `may_wait`.
fn opened_live(
    renderer: &Renderer,
    req: &ResetRequest,
    r: Result<(ServerHandle, ResetResponse), ClientError>,
    prompt: Prompt,
    keep: bool,
    may_wait: bool,
) -> Live {
    match r {
        Ok((server, resp)) => {
            let episode = if keep { resp.episode_id.as_str() } else { "" };
            let mut sample = Sample::new(&resp.info.task.id, episode);
            match prompt(renderer, &resp) {
                Ok(p) => sample.push_context(&p),
                Err(e) => {
                    let e = error_chain(&e);
                    tracing::warn!(episode = %resp.episode_id, "prompt rendering failed: {e}");
                    sample.outcome = Some(Outcome::Failed);
                    sample.reason = Some(e);
                }
            }
            Live {
                done: sample.outcome.is_some(),
                sample,
                server: Some(server),
                lost: false,
                last_turn: Vec::new(),
                waiting_for_room: false,
            }
        }
        Err(e) => {
            let waiting = may_wait && e.is_full();
            let e = error_chain(&e);
            let task = req.task.as_deref().unwrap_or("");
            if waiting {
                tracing::debug!(
                    task,
                    "reset refused for want of room; it waits for room: {e}"
                );
            } else {
                tracing::warn!(task, "reset failed: {e}");
            }
            let mut sample = Sample::new(task, "");
            if !waiting {
                sample.outcome = Some(Outcome::Failed);
            }
            sample.reason = Some(e);
            Live {
                sample,
                server: None,
                lost: false,
                done: !waiting,
                last_turn: Vec::new(),
                waiting_for_room: waiting,
            }
        }
    }
}

/// One turn for each of `rows`, generated in batches of `generation_batch`; each batch is
/// limited by its longest member's room. Seeds derive from (seed, round, batch).
fn generate_turns(
    generator: &mut dyn Generator,
    live: &mut [Live],
    rows: &[usize],
    settings: &RolloutSettings,
    seed: u64,
    round: u64,
    stats: &mut RolloutStats,
) {
    for (c, chunk) in rows.chunks(settings.generation_batch).enumerate() {
        let prompts: Vec<Vec<u32>> = chunk
            .iter()
            .map(|&i| live[i].sample.tokens.clone())
            .collect();
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let mut params = settings.sampling.clone();
        params.max_new_tokens = settings
            .max_turn_tokens
            .min(settings.context.saturating_sub(longest))
            .max(1);
        let batch = generator.continue_conversations(
            chunk,
            &prompts,
            &params,
            crate::seeds::derive(seed, round, c as u64),
        );
        stats.prefilled_tokens += batch.prefilled_tokens;
        stats.reused_tokens += batch.reused_tokens;
        for (&i, g) in chunk.iter().zip(batch.generations) {
            stats.turns += 1;
            stats.policy_tokens += g.tokens.len();
            live[i].sample.push_policy(&g.tokens, Some(&g.logprobs));
            live[i].last_turn = g.tokens;
        }
    }
}

/// The opening prompt of a multi-turn episode: the task and the tools.
fn multi_turn_prompt(renderer: &Renderer, reset: &ResetResponse) -> Result<Vec<u32>, ModelError> {
    renderer.prompt(&reset.observation.text, &reset.info.tools)
}

/// Parses the turn just sampled for `l` as a tool call (name and arguments); one that does
/// not parse is recorded with a local error observation, the agent's to read next turn.
fn parse_turn(renderer: &Renderer, l: &mut Live, context: usize) -> Option<(String, Value)> {
    let text = renderer.turn_text(&l.last_turn);
    match parse_tool_call(&text) {
        Ok(call) => Some((call.name, call.arguments)),
        Err(e) => {
            let msg = e.to_string();
            l.sample.turns.push(TurnRecord {
                tool: None,
                arguments: Value::Null,
                parse_error: Some(msg.clone()),
                tool_error: true,
            });
            append_observation(renderer, l, &msg, true, context);
            None
        }
    }
}

/// What the server answered to the tool call `name(arguments)`: the episode ends (with its
/// reward), or its observation is appended; a call the server refused is an error the agent
/// reads; a failed request ends the episode as failed (lost when its server went away).
fn apply_answer(
    renderer: &Renderer,
    l: &mut Live,
    name: String,
    arguments: Value,
    answer: Result<StepResponse, ClientError>,
    context: usize,
) {
    match answer {
        Ok(resp) => {
            l.sample.turns.push(TurnRecord {
                tool: Some(name),
                arguments,
                parse_error: None,
                tool_error: resp.observation.is_error,
            });
            if resp.done {
                l.sample.reward = resp.reward as f32;
                l.sample.outcome = Some(Outcome::Finished);
                l.sample.reason = resp
                    .info
                    .evaluation
                    .as_ref()
                    .and_then(|e| e.reason.clone())
                    .or(resp.info.truncation_reason.clone());
                l.done = true;
            } else {
                append_observation(
                    renderer,
                    l,
                    &resp.observation.text,
                    resp.observation.is_error,
                    context,
                );
            }
        }
        // The server refused the call itself (unknown tool, bad arguments): the agent sees
        // why, as it would see a tool error.
        Err(ClientError::Api {
            status: 400 | 422,
            code,
            message,
        }) => {
            l.sample.turns.push(TurnRecord {
                tool: Some(name),
                arguments,
                parse_error: Some(format!("{code}: {message}")),
                tool_error: true,
            });
            append_observation(renderer, l, &message, true, context);
        }
        Err(e) => {
            tracing::warn!(episode = %l.sample.episode_id, "step failed: {}", ErrorChain(&e));
            l.lost = e.is_server_gone();
            l.sample.outcome = Some(Outcome::Failed);
            l.sample.reason = Some(error_chain(&e));
            l.done = true;
        }
    }
}

/// Ends `l` as the trainer closes it (turn or context limit), with the failure reward.
fn close_by_trainer(l: &mut Live, outcome: Outcome, failure_reward: f32) {
    l.sample.outcome = Some(outcome);
    l.sample.reward = failure_reward;
    l.sample.reason = Some(format!("{outcome:?} reached by the trainer"));
    l.done = true;
}

/// The warm-up's prompt: the task, asked for the whole solution in one answer.
fn single_turn_prompt(renderer: &Renderer, reset: &ResetResponse) -> Result<Vec<u32>, ModelError> {
    let text = format!("{}\n\n{SINGLE_TURN_INSTRUCTION}", reset.observation.text);
    renderer.prompt(&text, &[])
}

/// Has the answers just generated for `rows` judged (their code blocks through
/// `/v1/evaluate`, on any server) and ends their episodes with the reward. Returns the seconds
/// spent waiting for the servers.
fn evaluate_answers(round: &Round<'_>, live: &mut [Live], rows: &[usize]) -> f64 {
    let jobs: Vec<(usize, EvaluateRequest)> = rows
        .iter()
        .map(|&i| {
            let answer = round.renderer.turn_text(&live[i].last_turn);
            let req = EvaluateRequest {
                task: TaskRef::Id(live[i].sample.task.clone()),
                solution: SolutionRef::Text(solution_of(&answer)),
                options: None,
            };
            (i, req)
        })
        .collect();
    let te = Instant::now();
    // An evaluation every server refuses for want of room (its queue full) waits for room.
    let until = te + round.pool.room_wait;
    let results = round.rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for (k, (_, req)) in jobs.iter().enumerate() {
            // Any server judges it, under one key for every try.
            let pool = round.pool.clone();
            let mut req = req.clone();
            req.options.get_or_insert_with(Default::default).request_id =
                Some(env_client::new_request_id());
            set.spawn(async move {
                let req = &req;
                (
                    k,
                    when_room(&pool, until, || pool.fleet.evaluate(req)).await,
                )
            });
        }
        collect(set, jobs.len()).await
    });
    for ((i, _), r) in jobs.iter().zip(results) {
        let l = &mut live[*i];
        match r {
            Ok(res) => {
                l.sample.reward = res.reward as f32;
                l.sample.outcome = Some(Outcome::Finished);
                l.sample.reason = res.reason;
            }
            Err(e) => {
                l.lost = e.is_server_gone();
                l.sample.outcome = Some(Outcome::Failed);
                l.sample.reason = Some(error_chain(&e));
            }
        }
        l.done = true;
    }
    te.elapsed().as_secs_f64()
}

/// What the single-turn prompt adds to the task text.
pub const SINGLE_TURN_INSTRUCTION: &str =
    "Answer in one message, without tool calls: the complete solution file in a single fenced code block.";

/// The solution text of a single-turn answer: the first fenced code block, or the whole answer.
pub fn solution_of(answer: &str) -> String {
    if let Some(start) = answer.find("```") {
        let rest = &answer[start + 3..];
        // Skip the info string (```python).
        let body = rest.split_once('\n').map(|(_, b)| b).unwrap_or("");
        if let Some(end) = body.find("```") {
            return body[..end].to_string();
        }
        return body.to_string();
    }
    answer.trim().to_string()
}

fn append_observation(
    renderer: &Renderer,
    l: &mut Live,
    text: &str,
    is_error: bool,
    context: usize,
) {
    match renderer.observation(text, is_error, &l.last_turn) {
        Ok(t) => {
            // What does not fit the context is never seen: the conversation closes at the
            // context limit next round, and no sample grows past what the model is trained on.
            let room = context.saturating_sub(l.sample.tokens.len());
            l.sample.push_context(&t[..t.len().min(room)]);
        }
        Err(e) => {
            l.sample.outcome = Some(Outcome::Failed);
            l.sample.reason = Some(format!("observation rendering: {}", ErrorChain(&e)));
            l.done = true;
        }
    }
}

/// Resets every request at once. An episode wanted only for its prompt (`close_at_once`: the
/// single-turn warm-up) is closed as soon as it opens, which gives its room back, and its reset
/// waits for room like an evaluation. A kept episode is tried a few times: one still refused
/// for want of room is answered so, and the rollout opens it later, as its batch frees room.
async fn reset_all(
    pool: &EnvPool,
    resets: &[ResetRequest],
    close_at_once: bool,
) -> Vec<Result<(ServerHandle, ResetResponse), ClientError>> {
    let until = Instant::now() + pool.room_wait;
    let mut set = tokio::task::JoinSet::new();
    for (k, req) in resets.iter().enumerate() {
        let pool = pool.clone();
        let mut req = req.clone();
        // One key for every try: a server that got the reset answers a retry with the same
        // episode, so no retry leaves a second one behind.
        req.request_id
            .get_or_insert_with(env_client::new_request_id);
        set.spawn(async move {
            if close_at_once {
                let opened = when_room(&pool, until, || pool.fleet.reset(&req)).await;
                if let Ok((server, resp)) = &opened {
                    let _ = server.client().close(&resp.episode_id).await;
                }
                return (k, opened);
            }
            let _permit = pool.permits.acquire().await;
            // The fleet tries every server; when all are full, wait a little and try again.
            let mut attempt = 0;
            loop {
                match pool.fleet.reset(&req).await.map_err(client_error) {
                    Err(e) if e.is_retryable() && attempt < 2 => {
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(300 << attempt)).await;
                    }
                    other => return (k, other),
                }
            }
        });
    }
    collect(set, resets.len()).await
}

/// Sends `req` until a server has room for it, or `until` has passed; the last answer then.
/// One key for every try: a try whose answer is lost never leaves a second episode behind
/// (a refused reset frees its key on the server).
async fn reset_when_room(
    pool: &EnvPool,
    req: &ResetRequest,
    until: Instant,
) -> Result<(ServerHandle, ResetResponse), ClientError> {
    let mut req = req.clone();
    req.request_id = Some(env_client::new_request_id());
    let req = &req;
    when_room(pool, until, || pool.fleet.reset(req)).await
}

/// Makes `call` (within the pool's bound on requests in flight) until it is not refused for
/// want of room (503 `host_busy`, `at_capacity`; 429 on every server) or `until` has passed,
/// waiting a little longer after each refusal; the last answer then.
async fn when_room<T, F, Fut>(pool: &EnvPool, until: Instant, call: F) -> Result<T, ClientError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, FleetError>>,
{
    let mut wait = Duration::from_millis(250);
    loop {
        let answer = {
            let _permit = pool.permits.acquire().await;
            call().await.map_err(client_error)
        };
        match answer {
            Err(e) if e.is_full() && Instant::now() + wait < until => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
            other => return other,
        }
    }
}

async fn collect<T: Send + 'static>(
    mut set: tokio::task::JoinSet<(usize, Result<T, ClientError>)>,
    n: usize,
) -> Vec<Result<T, ClientError>> {
    let mut out: Vec<Option<Result<T, ClientError>>> = (0..n).map(|_| None).collect();
    while let Some(joined) = set.join_next().await {
        if let Ok((k, r)) = joined {
            out[k] = Some(r);
        }
    }
    out.into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(ClientError::Api {
                    status: 0,
                    code: "panicked".into(),
                    message: "request task panicked".into(),
                })
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use env_client::{ClientError, FleetError};

    use super::{when_room, EnvPool};
    use crate::config::ServerSection;

    fn refused(status: u16, code: &str) -> FleetError {
        FleetError::Server {
            server: "http://127.0.0.1:1".into(),
            source: ClientError::Api {
                status,
                code: code.into(),
                message: "retry later".into(),
            },
        }
    }

    fn pool(room_wait_s: f64) -> EnvPool {
        EnvPool::new(&ServerSection {
            urls: vec!["http://127.0.0.1:1".into()],
            room_wait_s,
            ..ServerSection::default()
        })
        .expect("pool")
    }

    /// Refusals for want of room are tried again until one is taken; any other failure, or the
    /// deadline, ends the wait with that answer.
    #[tokio::test(flavor = "current_thread")]
    async fn a_call_refused_for_room_is_tried_until_room_or_the_deadline() {
        let pool = pool(300.0);
        let tries = AtomicUsize::new(0);
        let until = Instant::now() + Duration::from_secs(300);
        let call = || async {
            match tries.fetch_add(1, Ordering::SeqCst) {
                0 => Err(refused(503, "host_busy")),
                1 => Err(refused(503, "at_capacity")),
                2 => Err(refused(429, "queue_full")),
                n => Ok(n),
            }
        };
        assert_eq!(when_room(&pool, until, call).await.unwrap(), 3);

        // A failure that more time does not mend is the answer at once.
        let tries = AtomicUsize::new(0);
        let call = || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(refused(400, "bad_request"))
        };
        let e = when_room(&pool, until, call).await.unwrap_err();
        assert!(matches!(e, ClientError::Api { status: 400, .. }));
        assert_eq!(tries.load(Ordering::SeqCst), 1);

        // Past the deadline, the refusal is the answer.
        let tries = AtomicUsize::new(0);
        let call = || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(refused(503, "host_busy"))
        };
        let e = when_room(&pool, Instant::now(), call).await.unwrap_err();
        assert!(e.is_full());
        assert_eq!(tries.load(Ordering::SeqCst), 1);
    }
}
