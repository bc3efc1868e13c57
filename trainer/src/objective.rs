//! The learning signals: GAE over the policy's own tokens, the asymmetric clipped surrogate,
//! the clipped value loss and masked means. Pure functions so the numbers can be checked by hand.

use burn::tensor::{backend::Backend, Tensor};

/// Advantages and value targets for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Gae {
    /// One per position; zero where the mask is off.
    pub advantages: Vec<f32>,
    /// `advantage + value` at policy positions; zero elsewhere.
    pub returns: Vec<f32>,
}

/// Generalised advantage estimation over the masked positions of one sequence.
///
/// Only positions where `mask` is true are actions; observation and prompt tokens in between
/// are transitions of the environment, so the recursion skips them: for the k-th action
/// `delta_k = r_k + gamma * V(next action) - V(k)`, with `V = 0` after the last one, and
/// `A_k = delta_k + gamma * lambda * A_{k+1}`. `rewards` is per position (the episode reward
/// sits on the last action).
pub fn gae(rewards: &[f32], values: &[f32], mask: &[bool], gamma: f32, lambda: f32) -> Gae {
    let n = mask.len();
    assert!(
        rewards.len() == n && values.len() == n,
        "gae: rewards, values and mask differ in length"
    );
    let mut advantages = vec![0.0; n];
    let mut returns = vec![0.0; n];
    let mut next_value = 0.0f32;
    let mut next_adv = 0.0f32;
    for i in (0..n).rev() {
        if !mask[i] {
            continue;
        }
        let delta = rewards[i] + gamma * next_value - values[i];
        let adv = delta + gamma * lambda * next_adv;
        advantages[i] = adv;
        returns[i] = adv + values[i];
        next_value = values[i];
        next_adv = adv;
    }
    Gae {
        advantages,
        returns,
    }
}

/// Whitens `values` in place over the masked positions of all sequences (mean 0, std 1).
pub fn whiten(seqs: &mut [Vec<f32>], masks: &[Vec<bool>]) {
    let (mut n, mut sum) = (0usize, 0f64);
    for (s, m) in seqs.iter().zip(masks) {
        for (&v, &on) in s.iter().zip(m) {
            if on {
                n += 1;
                sum += v as f64;
            }
        }
    }
    if n < 2 {
        return;
    }
    let mean = sum / n as f64;
    let var = seqs
        .iter()
        .zip(masks)
        .flat_map(|(s, m)| {
            s.iter()
                .zip(m)
                .filter(|(_, &on)| on)
                .map(|(&v, _)| (v as f64 - mean).powi(2))
        })
        .sum::<f64>()
        / (n - 1) as f64;
    let std = var.sqrt().max(1e-8);
    for (s, m) in seqs.iter_mut().zip(masks) {
        for (v, &on) in s.iter_mut().zip(m) {
            if on {
                *v = ((*v as f64 - mean) / std) as f32;
            }
        }
    }
}

/// Sum of `x * mask` divided by `denominator` (the token count of the whole minibatch, so
/// micro-batches add up to a token-level mean).
pub fn masked_sum<B: Backend>(
    x: Tensor<B, 2>,
    mask: Tensor<B, 2>,
    denominator: f32,
) -> Tensor<B, 1> {
    (x * mask).sum() / denominator.max(1.0)
}

/// The PPO surrogate loss per token, `-min(r A, clip(r, 1 - low, 1 + high) A)`, with the ratio
/// `r = exp(new - old)` (asymmetric clipping as in the recipe: 0.2 low, 0.28 high).
pub fn clipped_surrogate<B: Backend>(
    new_logprobs: Tensor<B, 2>,
    old_logprobs: Tensor<B, 2>,
    advantages: Tensor<B, 2>,
    clip_low: f32,
    clip_high: f32,
) -> Tensor<B, 2> {
    let ratio = (new_logprobs - old_logprobs).exp();
    let unclipped = ratio.clone() * advantages.clone();
    let clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages;
    unclipped.min_pair(clipped).neg()
}

/// Whether each token's ratio lies outside the clip range (1.0) or not (0.0).
pub fn clipped_mask<B: Backend>(
    new_logprobs: Tensor<B, 2>,
    old_logprobs: Tensor<B, 2>,
    clip_low: f32,
    clip_high: f32,
) -> Tensor<B, 2> {
    let ratio = (new_logprobs - old_logprobs).exp();
    let low = ratio.clone().lower_elem(1.0 - clip_low).float();
    let high = ratio.greater_elem(1.0 + clip_high).float();
    low + high
}

/// The clipped value loss per token, `0.5 * max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2)`.
pub fn clipped_value_loss<B: Backend>(
    values: Tensor<B, 2>,
    old_values: Tensor<B, 2>,
    returns: Tensor<B, 2>,
    clip: f32,
) -> Tensor<B, 2> {
    let unclipped = (values.clone() - returns.clone()).powi_scalar(2);
    let clipped_v = old_values.clone() + (values - old_values).clamp(-clip, clip);
    let clipped = (clipped_v - returns).powi_scalar(2);
    unclipped.max_pair(clipped) * 0.5
}

/// The low-variance KL estimate `exp(ref - new) - (ref - new) - 1` per token (k3), >= 0.
pub fn kl_k3<B: Backend>(new_logprobs: Tensor<B, 2>, ref_logprobs: Tensor<B, 2>) -> Tensor<B, 2> {
    let d = ref_logprobs - new_logprobs;
    d.clone().exp() - d - 1.0
}

/// `1 - Var(returns - values) / Var(returns)` over pairs; `None` when returns do not vary.
pub fn explained_variance(values: &[f32], returns: &[f32]) -> Option<f64> {
    let n = values.len();
    if n < 2 {
        return None;
    }
    let var = |xs: &mut dyn Iterator<Item = f64>| {
        let v: Vec<f64> = xs.collect();
        let m = v.iter().sum::<f64>() / v.len() as f64;
        v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / v.len() as f64
    };
    let var_r = var(&mut returns.iter().map(|&r| r as f64));
    if var_r < 1e-12 {
        return None;
    }
    let var_d = var(&mut returns.iter().zip(values).map(|(&r, &v)| (r - v) as f64));
    Some(1.0 - var_d / var_r)
}
