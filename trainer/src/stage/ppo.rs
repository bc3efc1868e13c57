//! PPO: the single-turn warm-up and the multi-turn stage share one update.
//!
//! Each step rolls out a batch with the current policy, scores it once more with the
//! pre-update policy and critic (old log-probabilities, values, optional reference
//! log-probabilities), computes GAE over the policy's tokens, then runs `epochs` passes of
//! minibatch updates of the clipped surrogate and the clipped value loss.

use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;

use super::{inference, permutation, scalar, seed_of, trainable, Learner, TokenBatch};
use crate::error::TrainError;
use crate::metrics::{batch_summary, MetricsRecord, PpoRecord, PpoUpdate, Throughput, TimeSplit};
use crate::model::CausalLm;
use crate::objective::{
    clipped_mask, clipped_surrogate, clipped_value_loss, explained_variance, gae, kl_k3,
    masked_sum, whiten,
};
use crate::rollout::{run_episodes, run_single_turn, EnvPool, RolloutSettings, RolloutStats};
use crate::sample::Sample;

/// Which PPO stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PpoMode {
    /// One generation per task, scored by `/v1/evaluate`.
    SingleTurn,
    /// Full episodes.
    MultiTurn,
}

/// Per-sample quantities fixed for the whole update.
struct Prepared {
    sample: Sample,
    old_logprobs: Vec<f32>,
    old_values: Vec<f32>,
    ref_logprobs: Option<Vec<f32>>,
    advantages: Vec<f32>,
    returns: Vec<f32>,
}

/// Runs the PPO stage for `steps` steps (continuing from `learner.step`).
pub fn run<B: AutodiffBackend>(
    learner: &mut Learner<B>,
    rt: &tokio::runtime::Runtime,
    pool: &EnvPool,
    mode: PpoMode,
    steps: usize,
    reference: Option<CausalLm<B::InnerBackend>>,
) -> Result<(), TrainError> {
    let bar = progress(steps, learner.step, &learner.stage);
    while learner.step < steps {
        let t0 = Instant::now();
        let step = learner.step;
        let resets = learner.resets_for(step, learner.cfg.rollout.batch);
        let stop = learner.renderer.stop_ids().to_vec();
        let (samples, stats) = {
            let lm = inference(learner.policy());
            let mut generator = learner.generator(&lm);
            let seed = seed_of(learner.cfg.run.seed, step as u64, u64::MAX);
            match mode {
                PpoMode::SingleTurn => {
                    let settings = RolloutSettings::single_turn(&learner.cfg.rollout, &stop);
                    run_single_turn(
                        rt,
                        pool,
                        &learner.renderer,
                        &mut generator,
                        &resets,
                        &settings,
                        seed,
                    )
                }
                PpoMode::MultiTurn => {
                    let settings = RolloutSettings::multi_turn(&learner.cfg.rollout, &stop);
                    let tag = format!("{}-s{}-{step}", learner.stage, learner.cfg.run.seed);
                    run_episodes(
                        rt,
                        pool,
                        &learner.renderer,
                        &mut generator,
                        &resets,
                        &settings,
                        &tag,
                        seed,
                    )
                }
            }
        };
        let rollout_s = t0.elapsed().as_secs_f64();
        let batch = batch_summary(&samples);
        let tu = Instant::now();
        let update = update(learner, samples, step, steps, reference.as_ref());
        let update_s = tu.elapsed().as_secs_f64();
        let total_s = t0.elapsed().as_secs_f64();
        learner.step += 1;
        let warnings = warnings(
            &update,
            learner.cfg.ppo.entropy_warn,
            learner.cfg.ppo.kl_warn,
        );
        for w in &warnings {
            tracing::warn!(stage = %learner.stage, step = learner.step, "{w}");
        }
        bar.set_message(format!("reward {:.3}", batch.reward_mean));
        let record = PpoRecord {
            step: learner.step,
            batch,
            update,
            rates: throughput(&stats, rollout_s, update_s, total_s),
            warnings,
        };
        learner.metrics.write(&match mode {
            PpoMode::SingleTurn => MetricsRecord::Warmup(record),
            PpoMode::MultiTurn => MetricsRecord::Ppo(record),
        })?;
        bar.inc(1);
        if learner.checkpoint_due(steps) {
            learner.save_checkpoint(steps)?;
        }
    }
    bar.finish();
    learner.save_final()?;
    Ok(())
}

fn progress(steps: usize, done: usize, stage: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(steps as u64);
    bar.set_position(done as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix} {bar:30} {pos}/{len} steps {elapsed_precise} eta {eta} {msg}",
    ) {
        bar.set_style(style);
    }
    bar.set_prefix(stage.to_string());
    bar
}

fn throughput(stats: &RolloutStats, rollout_s: f64, update_s: f64, total_s: f64) -> Throughput {
    let minutes = (total_s / 60.0).max(1e-9);
    Throughput {
        episodes_per_min: stats.episodes as f64 / minutes,
        tokens_per_min: stats.total_tokens as f64 / minutes,
        policy_tokens_per_min: stats.policy_tokens as f64 / minutes,
        prefilled_tokens: stats.prefilled_tokens,
        reused_tokens: stats.reused_tokens,
        lost_episodes: stats.lost,
        time_s: TimeSplit {
            generate: stats.generate_s,
            env: stats.env_s,
            env_requests: stats.env_requests_s,
            rollout: rollout_s,
            update: update_s,
            total: total_s,
        },
    }
}

/// The run-away warnings the recipe watches for: entropy blowing up or the policy moving far
/// from the one that sampled the batch.
fn warnings(update: &PpoUpdate, entropy_warn: f64, kl_warn: f64) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(e) = update.entropy {
        if e > entropy_warn {
            out.push(format!("entropy {e:.3} per token is above {entropy_warn}: the policy may be collapsing into noise"));
        }
    }
    if let Some(k) = update.approx_kl {
        if k > kl_warn {
            out.push(format!(
                "KL {k:.4} to the rollout policy is above {kl_warn}: updates are too large"
            ));
        }
    }
    out
}

/// One PPO update on a rolled-out batch, as each step of the stage runs it after its rollout:
/// old log-probabilities and values (and the reference's, given one), GAE, then `ppo.epochs`
/// passes of clipped actor and critic updates. `step` of `total` sets the learning rates.
/// Returns the update's metrics.
pub fn update<B: AutodiffBackend>(
    learner: &mut Learner<B>,
    samples: Vec<Sample>,
    step: usize,
    total: usize,
    reference: Option<&CausalLm<B::InnerBackend>>,
) -> PpoUpdate {
    let samples = trainable(samples);
    if samples.is_empty() {
        return PpoUpdate::default();
    }
    let cfg = learner.cfg.clone();
    let ppo = &cfg.ppo;
    let temperature = if cfg.rollout.temperature > 0.0 {
        cfg.rollout.temperature
    } else {
        1.0
    };
    let mut prepared = prepare(learner, samples, temperature, reference);
    let explained = whiten_and_explain(&mut prepared, ppo.normalize_advantages);
    let lr_a = cfg.optim.lr_at(cfg.optim.actor_lr, step, total);
    let lr_c = cfg.optim.lr_at(cfg.optim.critic_lr, step, total);
    let micro = cfg.optim.micro_batch.max(1);
    let mb = ppo.minibatch.max(1).min(prepared.len());
    let mut sums = Losses::default();
    let mut n_mb = 0usize;
    let (mut gn_a, mut gn_c) = (Vec::new(), Vec::new());
    for epoch in 0..ppo.epochs.max(1) {
        let order = permutation(
            prepared.len(),
            seed_of(cfg.run.seed, step as u64, 1_000 + epoch as u64),
        );
        for chunk in order.chunks(mb) {
            // Losses are sums over the minibatch's policy tokens, whatever its micro-batches.
            let tokens: f32 = chunk
                .iter()
                .map(|&i| prepared[i].sample.policy_tokens() as f32)
                .sum();
            for micro_rows in chunk.chunks(micro) {
                let rows: Vec<&Prepared> = micro_rows.iter().map(|&i| &prepared[i]).collect();
                sums.add(&backward(learner, &rows, tokens, temperature, ppo));
            }
            if let Some(n) = learner.policy_step(lr_a) {
                gn_a.push(n as f64);
            }
            if let Some(n) = learner.critic_step(lr_c) {
                gn_c.push(n as f64);
            }
            n_mb += 1;
        }
    }
    let n = n_mb.max(1) as f64;
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    PpoUpdate {
        trained_episodes: prepared.len(),
        policy_loss: Some(sums.policy / n),
        value_loss: Some(sums.value / n),
        entropy: Some(sums.entropy / n),
        approx_kl: Some(sums.kl / n),
        ref_kl: (ppo.kl_coef > 0.0).then_some(sums.ref_kl / n),
        clip_fraction: Some(sums.clipped / n),
        explained_variance: explained,
        grad_norm_actor: mean(&gn_a),
        grad_norm_critic: mean(&gn_c),
        lr_actor: Some(lr_a),
        lr_critic: Some(lr_c),
        sampling_logprob_mismatch: logprob_mismatch(&prepared),
    }
}

/// Whitens the advantages over the whole batch's policy tokens (when asked), and returns how
/// much of the returns' variance the pre-update values explained.
fn whiten_and_explain(prepared: &mut [Prepared], normalize: bool) -> Option<f64> {
    let masks: Vec<Vec<bool>> = prepared.iter().map(|p| p.sample.shifted_mask()).collect();
    if normalize {
        let mut advs: Vec<Vec<f32>> = prepared.iter().map(|p| p.advantages.clone()).collect();
        whiten(&mut advs, &masks);
        for (p, a) in prepared.iter_mut().zip(advs) {
            p.advantages = a;
        }
    }
    let (mut v_all, mut r_all) = (Vec::new(), Vec::new());
    for (p, m) in prepared.iter().zip(&masks) {
        for (j, &on) in m.iter().enumerate() {
            if on {
                v_all.push(p.old_values[j]);
                r_all.push(p.returns[j]);
            }
        }
    }
    explained_variance(&v_all, &r_all)
}

/// One minibatch's loss terms, summed over its micro-batches (each already divided by the
/// minibatch's policy tokens).
#[derive(Default)]
struct Losses {
    policy: f64,
    value: f64,
    entropy: f64,
    kl: f64,
    ref_kl: f64,
    clipped: f64,
}

impl Losses {
    fn add(&mut self, o: &Losses) {
        self.policy += o.policy;
        self.value += o.value;
        self.entropy += o.entropy;
        self.kl += o.kl;
        self.ref_kl += o.ref_kl;
        self.clipped += o.clipped;
    }
}

/// One micro-batch's backward passes, the policy's (clipped surrogate, entropy bonus, KL to the
/// reference) then the critic's (clipped value loss), gradients accumulated for the
/// minibatch's step; its loss terms.
fn backward<B: AutodiffBackend>(
    learner: &mut Learner<B>,
    rows: &[&Prepared],
    tokens: f32,
    temperature: f64,
    ppo: &crate::config::PpoSection,
) -> Losses {
    let device = learner.device.clone();
    let samples: Vec<&Sample> = rows.iter().map(|p| &p.sample).collect();
    let batch = TokenBatch::<B>::new(&samples, &device);
    let column = |f: fn(&Prepared) -> &[f32]| {
        batch.shifted(&rows.iter().map(|p| f(p)).collect::<Vec<_>>(), &device)
    };
    let old_lp = column(|p| &p.old_logprobs);
    let adv = column(|p| &p.advantages);
    let ref_lp = (ppo.kl_coef > 0.0 && rows[0].ref_logprobs.is_some())
        .then(|| column(|p| p.ref_logprobs.as_deref().unwrap_or(&[])));
    let old_v = column(|p| &p.old_values);
    let ret = column(|p| &p.returns);
    let mut l = Losses::default();
    let mask = batch.mask.clone();
    learner.policy_backward_stats(
        batch.tokens.clone(),
        batch.valid.clone(),
        temperature,
        |stats| {
            let surrogate = clipped_surrogate(
                stats.logprobs.clone(),
                old_lp.clone(),
                adv,
                ppo.clip_low,
                ppo.clip_high,
            );
            let pg_loss = masked_sum(surrogate, mask.clone(), tokens);
            let entropy = masked_sum(stats.entropy, mask.clone(), tokens);
            let mut loss = pg_loss.clone() - entropy.clone() * ppo.entropy_coef;
            if let Some(ref_lp) = ref_lp {
                let ref_kl =
                    masked_sum(kl_k3(stats.logprobs.clone(), ref_lp), mask.clone(), tokens);
                l.ref_kl = scalar(ref_kl.clone().detach());
                loss = loss + ref_kl * ppo.kl_coef;
            }
            l.kl = scalar(masked_sum(
                kl_k3(stats.logprobs.clone().detach(), old_lp.clone()),
                mask.clone(),
                tokens,
            ));
            l.clipped = scalar(masked_sum(
                clipped_mask(stats.logprobs.detach(), old_lp, ppo.clip_low, ppo.clip_high),
                mask,
                tokens,
            ));
            l.policy = scalar(pg_loss.detach());
            l.entropy = scalar(entropy.detach());
            loss
        },
    );
    let mask = batch.mask;
    learner.critic_backward_values(batch.tokens, batch.valid, |values| {
        let values = values.narrow(1, 0, batch.width - 1);
        let v_loss = masked_sum(
            clipped_value_loss(values, old_v, ret, ppo.value_clip),
            mask,
            tokens,
        ) * ppo.vf_coef;
        l.value = scalar(v_loss.clone().detach());
        v_loss
    });
    l
}

/// Scores the batch with the pre-update models and computes GAE.
fn prepare<B: AutodiffBackend>(
    learner: &Learner<B>,
    samples: Vec<Sample>,
    temperature: f64,
    reference: Option<&CausalLm<B::InnerBackend>>,
) -> Vec<Prepared> {
    let policy = inference(learner.policy());
    let critic = inference(learner.critic());
    let device = learner.device.clone();
    let ppo = &learner.cfg.ppo;
    let mut out = Vec::with_capacity(samples.len());
    let micro = learner.cfg.optim.micro_batch.max(1);
    let mut it = samples.into_iter().peekable();
    while it.peek().is_some() {
        let chunk: Vec<Sample> = it.by_ref().take(micro).collect();
        let refs: Vec<&Sample> = chunk.iter().collect();
        let batch = TokenBatch::<B::InnerBackend>::new(&refs, &device);
        let lp = policy
            .sequence_stats(
                batch.tokens.clone(),
                batch.valid.clone(),
                &learner.infer_arch,
                temperature,
            )
            .logprobs;
        let lp = batch.unpack(lp);
        let v = critic
            .values(
                batch.tokens.clone(),
                batch.valid.clone(),
                &learner.infer_arch,
            )
            .narrow(1, 0, batch.width - 1);
        let v = batch.unpack(v);
        let rl = reference.map(|r| {
            batch.unpack(
                r.sequence_stats(
                    batch.tokens.clone(),
                    batch.valid.clone(),
                    &learner.infer_arch,
                    temperature,
                )
                .logprobs,
            )
        });
        for (k, s) in chunk.into_iter().enumerate() {
            let mask = s.shifted_mask();
            let g = gae(&s.shifted_rewards(), &v[k], &mask, ppo.gamma, ppo.lambda);
            out.push(Prepared {
                old_logprobs: lp[k].clone(),
                old_values: v[k].clone(),
                ref_logprobs: rl.as_ref().map(|r| r[k].clone()),
                advantages: g.advantages,
                returns: g.returns,
                sample: s,
            });
        }
    }
    out
}

/// Mean absolute difference between the log-probabilities recorded while sampling and the
/// ones the training forward pass computes (a check that the two paths agree).
fn logprob_mismatch(prepared: &[Prepared]) -> Option<f64> {
    let (mut sum, mut n) = (0.0f64, 0usize);
    for p in prepared {
        let sampled = p.sample.shifted_logprobs();
        for ((&on, &a), &b) in p
            .sample
            .shifted_mask()
            .iter()
            .zip(&sampled)
            .zip(&p.old_logprobs)
        {
            if on && a != 0.0 {
                sum += (a - b).abs() as f64;
                n += 1;
            }
        }
    }
    (n > 0).then(|| sum / n as f64)
}
