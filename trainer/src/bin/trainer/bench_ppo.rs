//! `bench-ppo`: one whole multi-turn PPO step of a model shape with random weights, timed by
//! phase, with the device memory it took. The stage's own code runs every part: the
//! [`Learner`] (memory plan, adapters, optimisers), the policy generator that keeps each
//! episode's cache between turns, and [`ppo::update`]. Only the server is left out: each
//! observation is a fixed synthetic run of tokens and each episode's reward a fixed value, so
//! the numbers are the trainer's alone.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use trainer::config::TrainConfig;
use trainer::generate::SamplingParams;
use trainer::memory::MemoryPlan;
use trainer::model::{LoraTarget, ModelConfig};
use trainer::rollout::{Generator, TurnStart};
use trainer::sample::{Outcome, Sample};
use trainer::seeds::{derive, ReplayRng};
use trainer::stage::{ppo, Learner, StageOptions};

use crate::bench::QWEN25_05B;
use crate::cli::{BenchPpoArgs, Schedule};
use crate::device::{DeviceEnv, Job};

/// The benchmark, as a [`Job`].
pub struct BenchPpo<'a>(pub &'a BenchPpoArgs);

impl Job for BenchPpo<'_> {
    fn run<B: AutodiffBackend>(self, device: B::Device, env: &DeviceEnv) -> Result<()> {
        bench::<B>(self.0, device, env)
    }
}

/// A tokenizer whose vocabulary fits every shape: rendering is not measured here, but the
/// learner loads a model directory as a stage does.
const TOKENIZER: &str = include_str!("../../../assets/tiny-tokenizer.json");

/// Rewards the episodes get in turn: the milestones' spread, so that advantages are not zero.
const REWARDS: [f32; 4] = [-1.0, 1.0, 2.0, 3.0];

/// A model directory of `shape` with no weights (the learner draws them at random), removed
/// when dropped.
struct ShapeDir(PathBuf);

impl ShapeDir {
    fn new(shape: Option<&Path>) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("trainer-bench-ppo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let config = match shape {
            Some(p) => {
                std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?
            }
            None => QWEN25_05B.to_string(),
        };
        std::fs::write(dir.join("config.json"), config)?;
        std::fs::write(dir.join("tokenizer.json"), TOKENIZER)?;
        Ok(Self(dir))
    }
}

impl Drop for ShapeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The run's configuration: the file given (or the defaults) with the flags applied.
fn config(a: &BenchPpoArgs, model: &Path) -> Result<TrainConfig> {
    let mut cfg = match &a.config {
        Some(p) => TrainConfig::from_file(p)?,
        None => TrainConfig::default(),
    };
    cfg.model.path = Some(model.to_path_buf());
    cfg.model.random_init = true;
    cfg.lora.rank = a.lora_rank;
    cfg.lora.alpha = 2.0 * a.lora_rank as f64;
    cfg.lora.targets = LoraTarget::ALL.to_vec();
    cfg.optim.activation_checkpointing = a.checkpointing;
    cfg.optim.micro_batch = a.micro_batch.max(1);
    cfg.rollout.batch = a.episodes;
    cfg.rollout.context = a.context;
    cfg.rollout.temperature = 1.0;
    cfg.run.out_dir = model.join("out");
    cfg.run.checkpoint_every = 0;
    if !a.reference {
        cfg.ppo.kl_coef = 0.0;
    }
    Ok(cfg)
}

fn bench<B: AutodiffBackend>(a: &BenchPpoArgs, device: B::Device, env: &DeviceEnv) -> Result<()> {
    anyhow::ensure!(
        a.turns > 0 && a.episodes > 0,
        "--turns and --episodes must be positive"
    );
    let per_turn = a.context.saturating_sub(a.prompt) / a.turns;
    anyhow::ensure!(
        per_turn > a.new_tokens,
        "--context {} leaves {per_turn} tokens a turn after the {}-token prompt: fewer than --new-tokens {} plus an observation",
        a.context,
        a.prompt,
        a.new_tokens
    );
    let observation = per_turn - a.new_tokens;
    let dir = ShapeDir::new(a.shape.as_deref())?;
    let cfg = config(a, &dir.0)?;
    let shape = ModelConfig::from_file(&dir.0)?;
    let elem = <B::FloatElem as burn::tensor::Element>::dtype().size();
    let plan = MemoryPlan::new(&shape, &cfg, elem, a.context);
    eprintln!("{plan}");
    let sync = |d: &B::Device| B::sync(d).map_err(|e| anyhow::anyhow!("device sync: {e:?}"));
    let opts = StageOptions {
        device_memory: env.memory,
        ..Default::default()
    };
    let t_init = Instant::now();
    let mut learner = Learner::<B>::new(cfg, "bench-ppo", &opts, a.context + 1, device.clone())?;
    sync(&device)?;
    eprintln!("learner ready in {:.1} s", t_init.elapsed().as_secs_f64());
    let reference = a.reference.then(|| {
        let p = learner.policy();
        let base = match p.has_adapters() {
            true => p.without_adapters(),
            false => p.clone(),
        };
        base.valid()
    });
    // The lowest free memory seen at the end of a phase: the allocator keeps what a phase took.
    let mut min_free = (env.read_memory)().map(|m| m.free);
    let sample_memory = |min_free: &mut Option<u64>| {
        if let Some(m) = (env.read_memory)() {
            *min_free = Some(min_free.map_or(m.free, |f| f.min(m.free)));
        }
    };
    let vocab = shape.vocab_size;
    let mut rows = Vec::new();
    for step in 0..a.steps.max(1) {
        // Rollout: every episode's turns through the generator the stage uses.
        sync(&device)?;
        let t0 = Instant::now();
        let mut samples: Vec<Sample> = (0..a.episodes)
            .map(|e| {
                let mut s = Sample::new("bench", &format!("bench-{step}-{e}"));
                s.tokens = (0..a.prompt)
                    .map(|i| ((i * 7919 + 13 + e + step) % vocab) as u32)
                    .collect();
                s.policy = vec![false; a.prompt];
                s.logprobs = vec![0.0; a.prompt];
                s
            })
            .collect();
        let rolled = {
            let lm = learner.policy().valid();
            let mut generator = learner.generator(&lm);
            roll(&mut generator, &mut samples, a, observation, vocab, step)
        };
        sync(&device)?;
        let rollout_s = t0.elapsed().as_secs_f64();
        sample_memory(&mut min_free);
        for (e, s) in samples.iter_mut().enumerate() {
            s.reward = REWARDS[e % REWARDS.len()];
            s.outcome = Some(Outcome::Finished);
        }
        let tokens: usize = samples.iter().map(|s| s.tokens.len()).sum();
        // The update: scoring with the pre-update models, GAE, clipped updates.
        let t1 = Instant::now();
        let update = ppo::update(&mut learner, samples, step, a.steps, reference.as_ref());
        sync(&device)?;
        let update_s = t1.elapsed().as_secs_f64();
        sample_memory(&mut min_free);
        let peak_memory_gib = env
            .memory
            .zip(min_free)
            .map(|(m, free)| (m.total - free) as f64 / (1u64 << 30) as f64);
        let sampled = rolled.sampled;
        eprintln!(
            "step {step}: rollout {rollout_s:.2} s ({sampled} sampled, {} prefilled, {} reused, {:.2} s waiting for tool calls), update {update_s:.2} s over {tokens} tokens, peak {}",
            rolled.prefilled,
            rolled.reused,
            rolled.env_wait_s,
            peak_memory_gib.map_or("unknown".into(), |g| format!("{g:.1} GiB"))
        );
        rows.push(StepRow {
            step,
            rollout_s,
            sampled_tokens: sampled,
            sampled_tokens_per_s: sampled as f64 / rollout_s,
            prefilled_per_turn: rolled.prefilled_per_round,
            prefilled_tokens: rolled.prefilled,
            reused_tokens: rolled.reused,
            env_wait_s: rolled.env_wait_s,
            update_s,
            episode_tokens: tokens,
            trained_tokens_per_s: (tokens * learner.cfg.ppo.epochs.max(1)) as f64 / update_s,
            step_s: rollout_s + update_s,
            peak_memory_gib,
            policy_loss: update.policy_loss,
            value_loss: update.value_loss,
            approx_kl: update.approx_kl,
            sampling_logprob_mismatch: update.sampling_logprob_mismatch,
        });
    }
    eprintln!(
        "| step | rollout s | sampled tok/s | update s | trained tok/s | step s | peak GiB |"
    );
    eprintln!("|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        eprintln!(
            "| {} | {:.2} | {:.0} | {:.2} | {:.0} | {:.2} | {} |",
            r.step,
            r.rollout_s,
            r.sampled_tokens_per_s,
            r.update_s,
            r.trained_tokens_per_s,
            r.step_s,
            r.peak_memory_gib.map_or("-".into(), |g| format!("{g:.1}"))
        );
    }
    let report = Report {
        engine: format!("burn {}{}", B::name(&device), env.note),
        params: trainer::memory::param_count(&shape),
        planned_gib: plan.total() as f64 / (1u64 << 30) as f64,
        episodes: a.episodes,
        context: a.context,
        prompt: a.prompt,
        turns: a.turns,
        new_tokens: a.new_tokens,
        observation,
        lora_rank: a.lora_rank,
        checkpointing: a.checkpointing,
        micro_batch: a.micro_batch.max(1),
        reference: a.reference,
        schedule: a.schedule,
        env_latency_s: a.env_latency_s,
        turn_spread: a.turn_spread,
        steps: rows,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// What `bench-ppo` prints on stdout.
#[derive(serde::Serialize)]
struct Report {
    engine: String,
    params: u64,
    /// The stage's memory plan for this run, GiB.
    planned_gib: f64,
    episodes: usize,
    context: usize,
    prompt: usize,
    turns: usize,
    new_tokens: usize,
    /// Tokens of each synthetic observation.
    observation: usize,
    lora_rank: usize,
    checkpointing: bool,
    micro_batch: usize,
    reference: bool,
    schedule: Schedule,
    env_latency_s: f64,
    turn_spread: f64,
    steps: Vec<StepRow>,
}

/// One PPO step, by phase.
#[derive(serde::Serialize)]
struct StepRow {
    step: usize,
    /// Every turn of every episode, sampled with the kept caches.
    rollout_s: f64,
    sampled_tokens: usize,
    sampled_tokens_per_s: f64,
    /// With `rounds`, context tokens prefilled per turn, all episodes together (after the
    /// first turn: the last sampled token and the observation of each); with `continuous`,
    /// per admission to the running batch.
    prefilled_per_turn: Vec<usize>,
    /// Context tokens prefilled in all.
    prefilled_tokens: usize,
    /// Context tokens taken from kept caches instead.
    reused_tokens: usize,
    /// Seconds the generator sat idle waiting for simulated tool calls.
    env_wait_s: f64,
    /// Scoring, GAE and the clipped updates of actor and critic.
    update_s: f64,
    /// Tokens of all episodes at their end.
    episode_tokens: usize,
    /// Episode tokens times PPO epochs per second of the update.
    trained_tokens_per_s: f64,
    step_s: f64,
    /// Device memory in use at the lowest point seen (GiB).
    peak_memory_gib: Option<f64>,
    policy_loss: Option<f64>,
    value_loss: Option<f64>,
    approx_kl: Option<f64>,
    sampling_logprob_mismatch: Option<f64>,
}

/// What one step's rollout did.
struct Rolled {
    /// Context tokens prefilled by each admission (a round's, with `rounds`).
    prefilled_per_round: Vec<usize>,
    prefilled: usize,
    reused: usize,
    sampled: usize,
    /// Seconds the generator sat idle, no turn to decode, waiting for tool calls.
    env_wait_s: f64,
}

/// Every episode's turns through `generator`, on the schedule asked for: each turn sampled at
/// its length (see `--turn-spread`), each tool call answered by a simulated server after its
/// latency (`--env-latency-s`), each answer a fixed synthetic observation appended.
fn roll(
    generator: &mut dyn Generator,
    samples: &mut [Sample],
    a: &BenchPpoArgs,
    observation: usize,
    vocab: usize,
    step: usize,
) -> Rolled {
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: a.new_tokens,
        ..Default::default()
    };
    let episodes = samples.len();
    // Deterministic per (step, episode, turn): the same work on both schedules.
    let draw = |e: usize, turn: usize, what: u64| {
        let key = derive(step as u64, e as u64, (turn as u64) << 1 | what);
        ReplayRng::new(key).unit_f64()
    };
    let turn_tokens = |e: usize, turn: usize| {
        let cut = (a.turn_spread.clamp(0.0, 1.0) * a.new_tokens as f64 * draw(e, turn, 0)) as usize;
        (a.new_tokens - cut).max(1)
    };
    let latency = |e: usize, turn: usize| {
        std::time::Duration::from_secs_f64(
            -a.env_latency_s.max(0.0) * (1.0 - draw(e, turn, 1)).ln(),
        )
    };
    let start = |e: usize, s: &Sample, turn: usize| TurnStart {
        key: e,
        context: s.tokens.clone(),
        max_new_tokens: turn_tokens(e, turn),
        seed: derive(step as u64, e as u64, turn as u64),
    };
    let mut out = Rolled {
        prefilled_per_round: Vec::new(),
        prefilled: 0,
        reused: 0,
        sampled: 0,
        env_wait_s: 0.0,
    };
    let mut turns_done = vec![0usize; episodes];
    // Episodes waiting for their tool call's answer, with when it comes.
    let mut at_server: Vec<(Instant, usize)> = Vec::new();
    let mut ready: Vec<usize> = (0..episodes).collect();
    loop {
        let now = Instant::now();
        at_server.retain(|&(at, e)| {
            let due = at <= now;
            if due {
                ready.push(e);
            }
            !due
        });
        // Rounds admit a whole round at once, when every call of the last one is answered.
        let admit_now = match a.schedule {
            Schedule::Continuous => !ready.is_empty(),
            Schedule::Rounds => {
                generator.running() == 0 && at_server.is_empty() && !ready.is_empty()
            }
        };
        if admit_now {
            ready.sort_unstable();
            let turns: Vec<TurnStart> = ready
                .drain(..)
                .map(|e| start(e, &samples[e], turns_done[e]))
                .collect();
            let (prefilled, reused) = generator.admit(turns, &params);
            out.prefilled_per_round.push(prefilled);
            out.prefilled += prefilled;
            out.reused += reused;
        }
        if generator.running() == 0 {
            let Some(next) = at_server.iter().map(|&(at, _)| at).min() else {
                break;
            };
            let wait = next.saturating_duration_since(Instant::now());
            std::thread::sleep(wait);
            out.env_wait_s += wait.as_secs_f64();
            continue;
        }
        for (e, g) in generator.step() {
            let turn = turns_done[e];
            let s = &mut samples[e];
            out.sampled += g.tokens.len();
            s.tokens.extend(&g.tokens);
            s.policy.extend(std::iter::repeat_n(true, g.tokens.len()));
            s.logprobs.extend(&g.logprobs);
            turns_done[e] += 1;
            if turns_done[e] < a.turns {
                s.tokens.extend(
                    (0..observation).map(|i| ((i * 104_729 + turn * 31 + e) % vocab) as u32),
                );
                s.policy.extend(std::iter::repeat_n(false, observation));
                s.logprobs.extend(std::iter::repeat_n(0.0, observation));
                at_server.push((Instant::now() + latency(e, turn), e));
            }
        }
    }
    for e in 0..episodes {
        generator.end_conversation(e);
    }
    out
}
