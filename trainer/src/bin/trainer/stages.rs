//! The training stages and `evaluate`, on the backend the flags pick.

use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::tensor::backend::AutodiffBackend;

use trainer::config::TrainConfig;
use trainer::curation::{rft_filter, samples_from_dir};
use trainer::memory::DeviceMemory;
use trainer::metrics::{batch_summary, EvalSummary};
use trainer::rollout::{run_episodes, EnvPool, RolloutSettings};
use trainer::sample::{Outcome, Sample, TurnRecord};
use trainer::stage::ppo::{self, PpoMode};
use trainer::stage::rft::{run_rft, run_value_pretrain};
use trainer::stage::{seed_of, Learner, StageOptions};

use crate::cli::{load_config, Command};
use crate::device::{DeviceEnv, Job};

/// A stage or `evaluate`, as a [`Job`].
pub struct Stage<'a>(pub &'a Command);

impl Job for Stage<'_> {
    fn run<B: AutodiffBackend>(self, device: B::Device, env: &DeviceEnv) -> Result<()> {
        run::<B>(self.0, device, env.memory)
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("tokio runtime")
}

fn run<B: AutodiffBackend>(
    cmd: &Command,
    device: B::Device,
    device_memory: Option<DeviceMemory>,
) -> Result<()> {
    let rt = runtime()?;
    match cmd {
        Command::Warmup(a) | Command::Ppo(a) => {
            let warm = matches!(cmd, Command::Warmup(_));
            let (stage, mode, context) = if warm {
                ("warmup", PpoMode::SingleTurn, 0)
            } else {
                ("ppo", PpoMode::MultiTurn, 0)
            };
            let cfg = load_config(&a.common)?;
            let context = if warm {
                cfg.rollout.single_turn_context
            } else {
                cfg.rollout.context.max(context)
            };
            let steps = a.steps.unwrap_or(cfg.ppo.steps);
            let pool = EnvPool::new(&cfg.server)?;
            let opts = StageOptions {
                init: a.common.init.clone(),
                resume: a.resume,
                device_memory,
            };
            let kl = cfg.ppo.kl_coef > 0.0;
            let mut learner = Learner::<B>::new(cfg, stage, &opts, context, device)?;
            // The reference policy is the one the stage started from (before any resume); with
            // adapters it is the frozen base with adapters off, which costs no copy.
            let reference = kl
                .then(|| match learner.policy().has_adapters() {
                    true => learner.policy().without_adapters(),
                    false => learner.policy().clone(),
                })
                .map(|p| burn::module::AutodiffModule::valid(&p));
            ppo::run(&mut learner, &rt, &pool, mode, steps, reference)?;
            println!("{}", learner.stage_dir.join("final").display());
        }
        Command::Rft(d) | Command::ValuePretrain(d) => {
            let value = matches!(cmd, Command::ValuePretrain(_));
            let cfg = load_config(&d.stage.common)?;
            let opts = StageOptions {
                init: d.stage.common.init.clone(),
                resume: d.stage.resume,
                device_memory,
            };
            let context = cfg.rollout.context;
            let mut learner = Learner::<B>::new(
                cfg.clone(),
                if value { "value" } else { "rft" },
                &opts,
                context,
                device,
            )?;
            let samples = gather(&learner, &rt, &cfg, &d.trajectories)?;
            let (kept, summary) = rft_filter(samples, cfg.rft.min_reward, context);
            tracing::info!(kept = summary.kept, rejected = ?summary.rejected, "RFT filter");
            std::fs::write(
                learner.stage_dir.join("filter.json"),
                serde_json::to_string_pretty(&summary)?,
            )?;
            if value {
                run_value_pretrain(&mut learner, &kept)?;
            } else {
                run_rft(&mut learner, &kept)?;
            }
            println!("{}", learner.stage_dir.join("final").display());
        }
        Command::Evaluate(e) => {
            let mut cfg = load_config(&e.common)?;
            if e.greedy {
                cfg.rollout.temperature = 0.0;
            }
            let pool = EnvPool::new(&cfg.server)?;
            let context = cfg.rollout.context;
            let learner = Learner::<B>::new(
                cfg.clone(),
                "evaluate",
                &StageOptions {
                    init: e.common.init.clone(),
                    resume: false,
                    device_memory,
                },
                context,
                device,
            )?;
            let (samples, stats) = rollout(&learner, &rt, &pool, e.episodes, u64::MAX - 1);
            let summary = EvalSummary {
                batch: batch_summary(&samples),
                rollout: stats,
            };
            let text = serde_json::to_string_pretty(&summary)?;
            if let Some(p) = &e.json {
                std::fs::write(p, &text)?;
            }
            if let Some(p) = &e.episodes_out {
                let tok = learner.renderer.tokenizer();
                let mut out = String::new();
                for s in &samples {
                    let line = EpisodeLine {
                        task: &s.task,
                        episode_id: &s.episode_id,
                        outcome: s.outcome,
                        reward: s.reward,
                        reason: s.reason.as_deref(),
                        turns: &s.turns,
                        text: tok.decode(&s.tokens),
                    };
                    out.push_str(&serde_json::to_string(&line)?);
                    out.push('\n');
                }
                std::fs::write(p, out)?;
            }
            println!("{text}");
        }
        Command::Plot(_)
        | Command::BenchModel(_)
        | Command::BenchPpo(_)
        | Command::BenchLoad(_)
        | Command::Serve(_)
        | Command::MemoryPlan(_) => {
            unreachable!("not a stage")
        }
    }
    Ok(())
}

/// Episodes from trajectory logs, or rolled out with the learner's policy when none are given.
fn gather<B: AutodiffBackend>(
    learner: &Learner<B>,
    rt: &tokio::runtime::Runtime,
    cfg: &TrainConfig,
    dirs: &[PathBuf],
) -> Result<Vec<Sample>> {
    if dirs.is_empty() {
        let pool = EnvPool::new(&cfg.server)?;
        let (samples, stats) = rollout(learner, rt, &pool, cfg.rft.rollouts, u64::MAX - 2);
        tracing::info!(
            episodes = stats.episodes,
            failed = stats.failed,
            "rolled out trajectories for {}",
            learner.stage
        );
        return Ok(samples);
    }
    let mut all = Vec::new();
    for d in dirs {
        let (samples, bad) = samples_from_dir(d, &learner.renderer)?;
        tracing::info!(dir = %d.display(), read = samples.len(), unreadable = bad, "trajectory logs");
        all.extend(samples);
    }
    Ok(all)
}

fn rollout<B: AutodiffBackend>(
    learner: &Learner<B>,
    rt: &tokio::runtime::Runtime,
    pool: &EnvPool,
    n: usize,
    step: u64,
) -> (Vec<Sample>, trainer::rollout::RolloutStats) {
    let lm = burn::module::AutodiffModule::valid(learner.policy());
    let mut generator = learner.generator(&lm);
    let resets = learner.resets_for(step as usize, n);
    let settings = RolloutSettings::multi_turn(&learner.cfg.rollout, learner.renderer.stop_ids());
    let seed = seed_of(learner.cfg.run.seed, step, 0);
    run_episodes(
        rt,
        pool,
        &learner.renderer,
        &mut generator,
        &resets,
        &settings,
        &format!("eval-{seed:x}"),
        seed,
    )
}

/// One line of `evaluate --episodes-out`: an episode and its decoded conversation.
#[derive(serde::Serialize)]
struct EpisodeLine<'a> {
    task: &'a str,
    episode_id: &'a str,
    outcome: Option<Outcome>,
    reward: f32,
    reason: Option<&'a str>,
    turns: &'a [TurnRecord],
    text: String,
}
