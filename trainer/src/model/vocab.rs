//! Reductions across the vocabulary (150k entries for Qwen2.5), done in two stages.
//!
//! A reduction along one long row gives the GPU one row of work per sequence position: at
//! decoding time (32 rows) that left most of an H200 idle, and a single log-softmax over a
//! `[32, 151936]` batch cost several milliseconds a step, measured on an H200. Splitting the
//! row into blocks (`[rows, blocks, width]`), reducing the blocks, then the block results,
//! gives `rows * blocks` independent pieces of work instead.

use burn::tensor::activation::log_softmax;
use burn::tensor::{backend::Backend, Tensor};

/// The block width for a row of `n`: a divisor of `n` (so no padding copy is needed), or
/// `None` when `n` has none worth splitting by.
fn block_width(n: usize) -> Option<usize> {
    [128, 256, 64, 512, 32, 1024].into_iter().find(|&w| n % w == 0 && n / w >= 2)
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
    x.reshape([rows, n / w, w]).sum_dim(2).sum_dim(1).reshape(out)
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
            assert!(max_diff(log_softmax_last(x.clone()), log_softmax(x.clone(), 2)) < 1e-5, "log_softmax, n = {n}");
            assert!(max_diff(sum_last(x.clone()), x.clone().sum_dim(2)) < 1e-3, "sum, n = {n}");
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
            let lp = if two_stage { log_softmax_last(x.clone()) } else { log_softmax(x.clone(), 1) };
            let grads = (lp * w.clone()).sum().backward();
            x.grad(&grads).unwrap()
        };
        let d = (grad(true) - grad(false)).abs().max().into_scalar();
        assert!(d < 1e-5, "gradients differ by {d}");
    }
}
