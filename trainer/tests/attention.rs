//! Attention as the models train it against burn's decomposed reference
//! (`attention_fallback`, differentiated op by op): outputs and the gradients of query, key
//! and value. The autodiff backend computes attention as one operation whose backward
//! recomputes the probabilities (vendor/burn-autodiff); this keeps that honest on the CPU
//! and, with `--features cuda -- --ignored`, on a GPU.

use burn::backend::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::module::{attention, attention_fallback};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Tensor, TensorData};
use trainer::model::transformer::positions_and_mask;

mod common;
use common::rel_diffs;

/// Query, key, value and a weighting of the output (so every output element gets its own
/// gradient), on `device`, the same on every call. Drawn from a local generator: the
/// backend's random state is global, and tests running in parallel would interleave on it.
fn inputs<B: Backend>(shape: [usize; 4], seq_k: usize, device: &B::Device) -> [Tensor<B, 4>; 4] {
    let mut rng = trainer::seeds::ReplayRng::new(7);
    let [b, h, t, d] = shape;
    let mut normal = |dims: [usize; 4]| {
        // Sum of uniforms: roughly normal, mean 0, variance 1.
        let n: usize = dims.iter().product();
        let data: Vec<f32> = (0..n)
            .map(|_| (0..12).map(|_| rng.unit_f64() as f32).sum::<f32>() - 6.0)
            .collect();
        Tensor::<B, 4>::from_data(TensorData::new(data, dims), device)
    };
    [
        normal([b, h, t, d]),
        normal([b, h, seq_k, d]),
        normal([b, h, seq_k, d]),
        normal([b, h, t, d]),
    ]
}

/// A padding-and-causal mask like the models build: row 0 left-padded by 3, row 1 full.
fn padded_causal_mask<B: Backend>(
    b: usize,
    h: usize,
    t: usize,
    device: &B::Device,
) -> Tensor<B, 4, Bool> {
    let valid: Vec<bool> = (0..b * t).map(|i| !(i / t == 0 && i % t < 3)).collect();
    let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(valid, [b, t]), device);
    positions_and_mask(valid, None).mask.expand([b, h, t, t])
}

/// Relative differences between the fused op and the reference: output, then dQ, dK, dV.
fn compare<B: AutodiffBackend>(
    shape: [usize; 4],
    seq_k: usize,
    mask: Option<Tensor<B, 4, Bool>>,
    options: AttentionModuleOptions,
    device: &B::Device,
) -> [f32; 4] {
    let run = |fallback: bool| {
        let [q, k, v, w] = inputs::<B>(shape, seq_k, device);
        let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
        let f = if fallback {
            attention_fallback
        } else {
            attention
        };
        let out = f(q.clone(), k.clone(), v.clone(), mask.clone(), None, options);
        let grads = (out.clone() * w).sum().backward();
        let g = |x: &Tensor<B, 4>| x.grad(&grads).expect("a gradient");
        [out.inner(), g(&q), g(&k), g(&v)]
    };
    let (ours, reference) = (run(false), run(true));
    rel_diffs(ours, reference)
}

fn assert_close(what: &str, diffs: [f32; 4], tol: f32) {
    for (d, name) in diffs.iter().zip(["output", "dQ", "dK", "dV"]) {
        assert!(
            d.is_finite() && *d <= tol,
            "{what}: {name} differs by {d} of its largest magnitude (tolerance {tol})"
        );
    }
}

fn check_all<B: AutodiffBackend>(device: &B::Device, tol: f32) {
    let (b, h, t, d) = (2, 3, 13, 16);
    let mask = padded_causal_mask::<B>(b, h, t, device);
    assert_close(
        "padding + causal mask",
        compare::<B>([b, h, t, d], t, Some(mask), Default::default(), device),
        tol,
    );
    assert_close(
        "no mask",
        compare::<B>([b, h, t, d], t, None, Default::default(), device),
        tol,
    );
    let causal = AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    assert_close(
        "is_causal",
        compare::<B>([b, h, t, d], t, None, causal, device),
        tol,
    );
    // Decoding shape: fewer queries than keys (a cached prefix), causal at the bottom right.
    assert_close(
        "is_causal, 4 queries on 13 keys",
        compare::<B>([b, h, 4, d], t, None, causal, device),
        tol,
    );
    let scaled = AttentionModuleOptions {
        scale: Some(0.3),
        ..Default::default()
    };
    assert_close(
        "explicit scale",
        compare::<B>([b, h, t, d], t, None, scaled, device),
        tol,
    );
}

#[test]
fn attention_and_its_gradients_match_the_decomposed_reference_on_the_cpu() {
    check_all::<Autodiff<burn::backend::NdArray<f32>>>(&Default::default(), 1e-5);
}

#[test]
fn a_fully_masked_row_gets_zero_output_and_zero_gradients() {
    type B = Autodiff<burn::backend::NdArray<f32>>;
    let device = Default::default();
    let (b, h, t, d) = (1, 2, 5, 8);
    // Query 2 may see nothing.
    let hidden: Vec<bool> = (0..t * t).map(|i| i / t == 2).collect();
    let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(hidden, [t, t]), &device)
        .reshape([1, 1, t, t])
        .expand([b, h, t, t]);
    assert_close(
        "fully masked row",
        compare::<B>(
            [b, h, t, d],
            t,
            Some(mask.clone()),
            Default::default(),
            &device,
        ),
        1e-5,
    );
    let [q, k, v, _] = inputs::<B>([b, h, t, d], t, &device);
    let q = q.require_grad();
    let out = attention(q.clone(), k, v, Some(mask), None, Default::default());
    let row = out.clone().narrow(2, 2, 1).abs().max().into_scalar();
    assert_eq!(row, 0.0, "the fully masked query's output");
    let grads = out.sum().backward();
    let dq_row = q
        .grad(&grads)
        .unwrap()
        .narrow(2, 2, 1)
        .abs()
        .max()
        .into_scalar();
    assert_eq!(dq_row, 0.0, "the fully masked query's gradient");
}

/// On a GPU, in f32 and bf16. The GPU's matrix units round differently from the CPU, hence
/// the looser tolerances: cubecl's f32 products run through TF32 (10-bit mantissa), which
/// measured on an H200 put the gradients up to 1.01e-3 of their magnitude from the reference.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p trainer --features cuda --test attention -- --ignored"]
fn attention_and_its_gradients_match_the_decomposed_reference_on_cuda() {
    type Cuda<F> = burn::backend::Cuda<F>;
    let device = burn::backend::cuda::CudaDevice::new(0);
    // burn primitives on the inner backend first, then the trainer's kernels (registered
    // for the rest of the process: one test, so the order is fixed).
    check_all::<Autodiff<Cuda<f32>>>(&device, 3e-3);
    check_all::<Autodiff<Cuda<half::bf16>>>(&device, 3e-2);
    assert!(
        trainer::kernels::attention::install(),
        "CUDA_AGENT_ATTENTION=decomposed is set"
    );
    check_all::<Autodiff<Cuda<f32>>>(&device, 3e-3);
    check_all::<Autodiff<Cuda<half::bf16>>>(&device, 3e-2);
    // Rows longer than a thread block, a model's head width, and the padding mask.
    let (b, h, t, d) = (2, 4, 300, 64);
    let mask = padded_causal_mask::<Autodiff<Cuda<f32>>>(b, h, t, &device);
    assert_close(
        "kernels, 300 keys",
        compare::<Autodiff<Cuda<f32>>>([b, h, t, d], t, Some(mask), Default::default(), &device),
        3e-3,
    );
    let mask = padded_causal_mask::<Autodiff<Cuda<half::bf16>>>(b, h, t, &device);
    assert_close(
        "kernels, 300 keys, bf16",
        compare::<Autodiff<Cuda<half::bf16>>>(
            [b, h, t, d],
            t,
            Some(mask),
            Default::default(),
            &device,
        ),
        3e-2,
    );
    // Rows the kernels walk sixteen bytes at a time, kept in registers (256, 1040 keys).
    for t in [256, 1040] {
        let mask = padded_causal_mask::<Autodiff<Cuda<f32>>>(b, h, t, &device);
        assert_close(
            &format!("kernels, {t} keys"),
            compare::<Autodiff<Cuda<f32>>>(
                [b, h, t, d],
                t,
                Some(mask),
                Default::default(),
                &device,
            ),
            3e-3,
        );
        let mask = padded_causal_mask::<Autodiff<Cuda<half::bf16>>>(b, h, t, &device);
        assert_close(
            &format!("kernels, {t} keys, bf16"),
            compare::<Autodiff<Cuda<half::bf16>>>(
                [b, h, t, d],
                t,
                Some(mask),
                Default::default(),
                &device,
            ),
            3e-2,
        );
    }
}
