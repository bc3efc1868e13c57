//! Rejection-sampling fine-tuning (negative log-likelihood of the policy's own tokens in the
//! kept trajectories) and value pre-training (the critic regressed on GAE targets).
//!
//! Both step through `epochs` seeded shuffles of the samples in minibatches; the order
//! depends only on the seed and the epoch, so a resumed run sees the same minibatches.

use crate::metrics::{MetricsRecord, RftRecord, ValueRecord};
use burn::tensor::backend::AutodiffBackend;

use super::{inference, permutation, scalar, seed_of, Learner, TokenBatch};
use crate::error::TrainError;
use crate::objective::{explained_variance, gae, masked_sum};
use crate::sample::Sample;

/// The minibatches of `epochs` passes over `n` samples, in order.
fn schedule(n: usize, minibatch: usize, epochs: usize, seed: u64) -> Vec<Vec<usize>> {
    let mb = minibatch.max(1);
    (0..epochs.max(1))
        .flat_map(|e| {
            let order = permutation(n, seed_of(seed, e as u64, 7));
            order.chunks(mb).map(<[usize]>::to_vec).collect::<Vec<_>>()
        })
        .collect()
}

/// Optimiser steps the RFT stage takes on `n` samples.
pub fn rft_steps(n: usize, minibatch: usize, epochs: usize) -> usize {
    n.div_ceil(minibatch.max(1)) * epochs.max(1)
}

/// Fine-tunes the policy on `samples` (already filtered).
pub fn run_rft<B: AutodiffBackend>(
    learner: &mut Learner<B>,
    samples: &[Sample],
) -> Result<(), TrainError> {
    if samples.is_empty() {
        return Err(TrainError::Data(
            "no trajectories passed the RFT filter".into(),
        ));
    }
    let cfg = learner.cfg.clone();
    let plan = schedule(
        samples.len(),
        cfg.rft.minibatch,
        cfg.rft.epochs,
        cfg.run.seed,
    );
    let total = plan.len();
    let peak = cfg.rft.lr.unwrap_or(cfg.optim.actor_lr);
    let bar = bar(total, learner.step, "rft");
    let device = learner.device.clone();
    while learner.step < total {
        let rows = &plan[learner.step];
        let tokens: f32 = rows
            .iter()
            .map(|&i| samples[i].policy_tokens() as f32)
            .sum();
        let mut nll_sum = 0.0;
        for micro in rows.chunks(cfg.optim.micro_batch.max(1)) {
            let refs: Vec<&Sample> = micro.iter().map(|&i| &samples[i]).collect();
            let batch = TokenBatch::<B>::new(&refs, &device);
            let mask = batch.mask;
            learner.policy_backward_stats(batch.tokens, batch.valid, 1.0, |stats| {
                let nll = masked_sum(stats.logprobs, mask, tokens).neg();
                nll_sum += scalar(nll.clone().detach());
                nll
            });
        }
        let lr = cfg.optim.lr_at(peak, learner.step, total);
        let norm = learner.policy_step(lr);
        learner.step += 1;
        learner.metrics.write(&MetricsRecord::Rft(RftRecord {
            step: learner.step,
            nll: Some(nll_sum),
            tokens: tokens as usize,
            episodes: rows.len(),
            lr,
            grad_norm: norm,
        }))?;
        bar.set_message(format!("nll {nll_sum:.4}"));
        bar.inc(1);
        if learner.checkpoint_due(total) {
            learner.save_checkpoint(total)?;
        }
    }
    bar.finish();
    learner.save_final()?;
    Ok(())
}

/// Pre-trains the critic on `samples`: each minibatch's targets are GAE returns under the
/// current critic (gamma, lambda from the PPO config), regressed with a squared loss.
pub fn run_value_pretrain<B: AutodiffBackend>(
    learner: &mut Learner<B>,
    samples: &[Sample],
) -> Result<(), TrainError> {
    if samples.is_empty() {
        return Err(TrainError::Data(
            "no trajectories to pre-train the critic on".into(),
        ));
    }
    let cfg = learner.cfg.clone();
    let plan = schedule(
        samples.len(),
        cfg.value.minibatch,
        cfg.value.epochs,
        cfg.run.seed,
    );
    let total = plan.len();
    let bar = bar(total, learner.step, "value");
    let device = learner.device.clone();
    while learner.step < total {
        let rows = &plan[learner.step];
        let tokens: f32 = rows
            .iter()
            .map(|&i| samples[i].policy_tokens() as f32)
            .sum();
        let critic = inference(learner.critic());
        let (mut loss_sum, mut v_all, mut r_all) = (0.0, Vec::new(), Vec::new());
        for micro in rows.chunks(cfg.optim.micro_batch.max(1)) {
            let refs: Vec<&Sample> = micro.iter().map(|&i| &samples[i]).collect();
            let inner = TokenBatch::<B::InnerBackend>::new(&refs, &device);
            let w = inner.width - 1;
            let old = inner.unpack(
                critic
                    .values(
                        inner.tokens.clone(),
                        inner.valid.clone(),
                        &learner.infer_arch,
                    )
                    .narrow(1, 0, w),
            );
            let mut returns = Vec::with_capacity(refs.len());
            for (s, v) in refs.iter().zip(&old) {
                let mask = s.shifted_mask();
                let g = gae(
                    &s.shifted_rewards(),
                    v,
                    &mask,
                    cfg.ppo.gamma,
                    cfg.ppo.lambda,
                );
                for (j, &on) in mask.iter().enumerate() {
                    if on {
                        v_all.push(v[j]);
                        r_all.push(g.returns[j]);
                    }
                }
                returns.push(g.returns);
            }
            let batch = TokenBatch::<B>::new(&refs, &device);
            let ret = batch.shifted(
                &returns.iter().map(Vec::as_slice).collect::<Vec<_>>(),
                &device,
            );
            let mask = batch.mask;
            learner.critic_backward_values(batch.tokens, batch.valid, |values| {
                let values = values.narrow(1, 0, w);
                let loss = masked_sum((values - ret).powi_scalar(2) * 0.5, mask, tokens);
                loss_sum += scalar(loss.clone().detach());
                loss
            });
        }
        let lr = cfg.optim.lr_at(cfg.optim.critic_lr, learner.step, total);
        let norm = learner.critic_step(lr);
        learner.step += 1;
        learner.metrics.write(&MetricsRecord::Value(ValueRecord {
            step: learner.step,
            value_loss: Some(loss_sum),
            explained_variance: explained_variance(&v_all, &r_all),
            episodes: rows.len(),
            lr,
            grad_norm: norm,
        }))?;
        bar.set_message(format!("value loss {loss_sum:.4}"));
        bar.inc(1);
        if learner.checkpoint_due(total) {
            learner.save_checkpoint(total)?;
        }
    }
    bar.finish();
    learner.save_final()?;
    Ok(())
}

fn bar(total: usize, done: usize, stage: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_position(done as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix} {bar:30} {pos}/{len} steps {elapsed_precise} {msg}",
    ) {
        bar.set_style(style);
    }
    bar.set_prefix(stage.to_string());
    bar
}
