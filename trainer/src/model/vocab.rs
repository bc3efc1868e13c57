//! Reductions across the vocabulary (150k entries for Qwen2.5): the statistics of each next
//! token that training needs, and the two-stage log-softmax and sum they fall back on.
//!
//! A reduction along one long row gives the GPU one row of work per sequence position: at
//! decoding time (32 rows) that left most of an H200 idle, and a single log-softmax over a
//! `[32, 151936]` batch cost several milliseconds a step, measured on an H200. Splitting the
//! row into blocks (`[rows, blocks, width]`), reducing the blocks, then the block results,
//! gives `rows * blocks` independent pieces of work instead.
//!
//! [`token_stats`] is what a training pass asks for. Decomposed into burn operations it walks
//! the `[rows, vocab]` logits a dozen times in f32 (about 70 ms of a 290 ms Qwen2.5-0.5B pass
//! at 4 x 2048 tokens, measured on an H200), so a backend may register a fused version
//! ([`register_token_stats`]; the CUDA kernels in `crate::kernels::vocab` do).

use burn::tensor::activation::log_softmax;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{backend::Backend, FloatDType, Int, Tensor, TensorPrimitive};

/// A fused [`token_stats`] for backend `B`: logits `[rows, vocab]` (any float dtype), target
/// ids `[rows]` and the temperature, to `[rows, 2]` f32; `None` declines (the decomposition
/// then runs). On an autodiff backend it must be differentiable with respect to the logits.
pub type FusedTokenStats<B> = fn(FloatTensor<B>, IntTensor<B>, f64) -> Option<FloatTensor<B>>;

/// Makes [`token_stats`] on backend `B` try `fused` first from now on.
pub fn register_token_stats<B: Backend>(fused: FusedTokenStats<B>) {
    super::fused::register::<B, _>(fused);
}

/// Per row of `logits` (`[rows, vocab]`), with the logits divided by `temperature`: the
/// log-probability of `targets[row]` and the entropy of the distribution, as `[rows, 2]` f32
/// (column 0 the log-probability, column 1 the entropy), computed in f32 whatever the
/// logits' dtype. Differentiable on autodiff backends.
pub fn token_stats<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    temperature: f64,
) -> Tensor<B, 2> {
    if let Some(fused) = super::fused::get::<B, FusedTokenStats<B>>() {
        if let Some(out) = fused(
            logits.clone().into_primitive().tensor(),
            targets.clone().into_primitive(),
            temperature,
        ) {
            return Tensor::from_primitive(TensorPrimitive::Float(out));
        }
    }
    token_stats_decomposed(logits, targets, temperature)
}

/// [`token_stats`] as burn operations (every backend).
pub fn token_stats_decomposed<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    temperature: f64,
) -> Tensor<B, 2> {
    let rows = logits.dims()[0];
    let x = logits.cast(FloatDType::F32);
    let x = if (temperature - 1.0).abs() > f64::EPSILON {
        x / temperature
    } else {
        x
    };
    let lp = log_softmax_last(x);
    let logprobs = lp.clone().gather(1, targets.reshape([rows, 1]));
    let entropy = sum_last(lp.clone().exp() * lp).neg();
    Tensor::cat(vec![logprobs, entropy], 1)
}

/// The block width for a row of `n`: a divisor of `n` (so no padding copy is needed), or
/// `None` when `n` has none worth splitting by.
fn block_width(n: usize) -> Option<usize> {
    [128, 256, 64, 512, 32, 1024]
        .into_iter()
        .find(|&w| n.is_multiple_of(w) && n / w >= 2)
}

/// `log_softmax` over the last dimension.
pub fn log_softmax_last<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let dims = x.dims();
    let n = dims[D - 1];
    let Some(w) = block_width(n) else {
        return log_softmax(x, D - 1);
    };
    let rows = dims[..D - 1].iter().product::<usize>();
    let x3: Tensor<B, 3> = x.reshape([rows, n / w, w]);
    // The shift only keeps `exp` in range; as a constant it leaves the gradient exact
    // (d logsumexp / dx = softmax whatever the shift) and spares a max's backward.
    let shift = x3.clone().detach().max_dim(2).max_dim(1);
    let sum = (x3.clone() - shift.clone()).exp().sum_dim(2).sum_dim(1);
    (x3 - (shift + sum.log())).reshape(dims)
}

/// Sum over the last dimension, kept as a dimension of size 1.
pub fn sum_last<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let dims = x.dims();
    let n = dims[D - 1];
    let Some(w) = block_width(n) else {
        return x.sum_dim(D - 1);
    };
    let rows = dims[..D - 1].iter().product::<usize>();
    let mut out = dims;
    out[D - 1] = 1;
    x.reshape([rows, n / w, w])
        .sum_dim(2)
        .sum_dim(1)
        .reshape(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::Distribution;

    type B = NdArray<f32>;

    fn max_diff<const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    #[test]
    fn two_stage_log_softmax_and_sum_match_the_one_stage_ones() {
        let device = Default::default();
        // 640 = 5 blocks of 128; 97 has no divisor and takes the one-stage path.
        for n in [640, 97] {
            let x = Tensor::<B, 3>::random([2, 3, n], Distribution::Normal(0.0, 4.0), &device);
            assert!(
                max_diff(log_softmax_last(x.clone()), log_softmax(x.clone(), 2)) < 1e-5,
                "log_softmax, n = {n}"
            );
            assert!(
                max_diff(sum_last(x.clone()), x.clone().sum_dim(2)) < 1e-3,
                "sum, n = {n}"
            );
        }
    }

    #[test]
    fn the_gradient_of_the_two_stage_log_softmax_is_exact() {
        type A = Autodiff<B>;
        let device = Default::default();
        let x = Tensor::<A, 2>::random([3, 512], Distribution::Normal(0.0, 3.0), &device);
        let w = Tensor::<A, 2>::random([3, 512], Distribution::Normal(0.0, 1.0), &device);
        let grad = |two_stage: bool| {
            let x = x.clone().require_grad();
            let lp = if two_stage {
                log_softmax_last(x.clone())
            } else {
                log_softmax(x.clone(), 1)
            };
            let grads = (lp * w.clone()).sum().backward();
            x.grad(&grads).unwrap()
        };
        // Exact up to f32 rounding, relative to the gradient's size (the inputs are unseeded
        // draws: an absolute bound failed about once in a few hundred at 1.2e-5).
        let reference = grad(false);
        let scale = reference.clone().abs().max().into_scalar().max(1.0);
        let d = (grad(true) - reference).abs().max().into_scalar() / scale;
        assert!(d < 1e-5, "gradients differ by {d} of their largest");
    }

    #[test]
    fn token_stats_are_the_target_log_probability_and_the_entropy() {
        let device = Default::default();
        let logits =
            Tensor::<B, 2>::from_floats([[1.0, 2.0, 3.0, 0.5], [0.0, 0.0, 0.0, 0.0]], &device);
        let targets = Tensor::<B, 1, Int>::from_ints([2, 0], &device);
        for temperature in [1.0, 2.0] {
            let stats = token_stats(logits.clone(), targets.clone(), temperature)
                .into_data()
                .to_vec::<f32>()
                .unwrap();
            let rows = [[1.0f64, 2.0, 3.0, 0.5], [0.0; 4]];
            for (r, (row, target)) in rows.iter().zip([2usize, 0]).enumerate() {
                let x: Vec<f64> = row.iter().map(|z| z / temperature).collect();
                let lse = x.iter().map(|v| v.exp()).sum::<f64>().ln();
                let entropy = -x.iter().map(|v| (v - lse).exp() * (v - lse)).sum::<f64>();
                assert!(
                    (stats[2 * r] as f64 - (x[target] - lse)).abs() < 1e-5,
                    "log-probability, row {r}, temperature {temperature}"
                );
                assert!(
                    (stats[2 * r + 1] as f64 - entropy).abs() < 1e-5,
                    "entropy, row {r}, temperature {temperature}"
                );
            }
        }
    }

    #[test]
    fn a_registered_fused_version_runs_first_and_may_decline() {
        // A backend type no other test uses: the registry is process-wide.
        type B64 = NdArray<f64>;
        fn shifted(
            logits: FloatTensor<B64>,
            targets: IntTensor<B64>,
            temperature: f64,
        ) -> Option<FloatTensor<B64>> {
            let logits = Tensor::<B64, 2>::from_primitive(TensorPrimitive::Float(logits));
            // Declines rows of 3, to show the fallback.
            if logits.dims()[1] == 3 {
                return None;
            }
            let out = token_stats_decomposed(logits, Tensor::from_primitive(targets), temperature)
                + 100.0;
            Some(out.into_primitive().tensor())
        }
        register_token_stats::<B64>(shifted);
        let device = Default::default();
        for vocab in [4, 3] {
            let logits =
                Tensor::<B64, 2>::random([5, vocab], Distribution::Normal(0.0, 1.0), &device);
            let targets = Tensor::<B64, 1, Int>::from_ints([0, 1, 2, 1, 0], &device);
            let plain = token_stats_decomposed(logits.clone(), targets.clone(), 1.0);
            let got = token_stats(logits, targets, 1.0);
            let shift = if vocab == 4 { 100.0 } else { 0.0 };
            let d = (got - plain - shift).abs().max().into_scalar();
            assert!(d < 1e-4, "vocab {vocab}: {d}");
        }
    }
}
