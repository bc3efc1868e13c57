//! Attention as the models train it against burn's decomposed reference
//! (`attention_fallback`, differentiated op by op): outputs and the gradients of query, key
//! and value. The autodiff backend computes attention as one operation whose backward
//! recomputes the probabilities (vendor/burn-autodiff); this keeps that honest on the CPU
//! and, with `--features cuda -- --ignored`, on a GPU.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use burn::backend::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::module::{attention, attention_fallback};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Tensor, TensorData};
#[cfg(feature = "cuda")]
use burn::tensor::{DType, FloatDType};
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

/// Values of `t` on `device` in backend `C` (through host memory).
#[cfg(feature = "cuda")]
fn moved<B: Backend, C: Backend, const D: usize>(
    t: Tensor<B, D>,
    device: &C::Device,
) -> Tensor<C, D> {
    Tensor::from_data(t.into_data().convert::<f32>(), device)
}

/// Keys or values `[b, kvh, s, d]` repeated for each of `h` query heads (query head `j` reads
/// key head `j / (h / kvh)`), differentiably: the reference's grouped-query attention.
#[cfg(feature = "cuda")]
fn expand_heads<B: Backend>(z: Tensor<B, 4>, h: usize) -> Tensor<B, 4> {
    let [b, kvh, s, d] = z.dims();
    z.unsqueeze_dim::<5>(2)
        .expand([b, kvh, h / kvh, s, d])
        .reshape([b, h, s, d])
}

/// The mask a grouped-query case describes: `valid` `[b, s]` builds the models' padding and
/// causal mask, `hidden` `[t, s]` one mask shared by every row.
#[cfg(feature = "cuda")]
fn mask_of<B: Backend>(
    valid: &Option<Vec<bool>>,
    hidden: &Option<Vec<bool>>,
    [b, h, t, s]: [usize; 4],
    device: &B::Device,
) -> Option<Tensor<B, 4, Bool>> {
    if let Some(valid) = valid {
        let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(valid.clone(), [b, s]), device);
        return Some(positions_and_mask(valid, None).mask.expand([b, h, t, s]));
    }
    hidden.as_ref().map(|hidden| {
        Tensor::<B, 2, Bool>::from_data(TensorData::new(hidden.clone(), [t, s]), device)
            .reshape([1, 1, t, s])
            .expand([b, h, t, s])
    })
}

/// burn's decomposed attention on backend `R` in f32 over `inputs` (Q, K, V, the output's
/// weighting), K and V expanded to every query head as leaves and their gradients summed
/// over each group by hand: output, dQ, dK, dV, on the CPU.
#[cfg(feature = "cuda")]
fn decomposed_reference<R: AutodiffBackend>(
    inputs: &[TensorData; 4],
    [b, h, kvh, t, s, d]: [usize; 6],
    valid: &Option<Vec<bool>>,
    hidden: &Option<Vec<bool>>,
    options: AttentionModuleOptions,
    device: &R::Device,
) -> [Tensor<burn::backend::NdArray<f32>, 4>; 4] {
    let [q, k, v, w] = inputs
        .clone()
        .map(|x| Tensor::<R, 4>::from_data(x.convert::<f32>(), device));
    let q = q.require_grad();
    let k = expand_heads(k, h).detach().require_grad();
    let v = expand_heads(v, h).detach().require_grad();
    let mask = mask_of::<R>(valid, hidden, [b, h, t, s], device);
    let out = attention_fallback(q.clone(), k.clone(), v.clone(), mask, None, options);
    let grads = (out.clone() * w).sum().backward();
    let g = |x: &Tensor<R, 4>| x.grad(&grads).expect("a gradient");
    let grouped = |x: Tensor<R::InnerBackend, 4>| {
        x.reshape([b, kvh, h / kvh, s, d])
            .sum_dim(2)
            .reshape([b, kvh, s, d])
    };
    [out.inner(), g(&q), grouped(g(&k)), grouped(g(&v))].map(|x| moved(x, &Default::default()))
}

/// One grouped-query case for the flash kernels: Q `[b, h, t, d]` against K, V
/// `[b, kvh, s, d]` in bf16 through `attention` (the trainer's kernels, K and V unexpanded)
/// against burn's decomposed attention in f32 on the same bf16-rounded inputs, computed on
/// the CPU, so that the reference shares no kernel with what it checks; relative differences
/// of the output, dQ, dK, dV. The same reference computed on the GPU is compared with the
/// CPU's too (second array): a disagreement there is the GPU's decomposed path, which the
/// models take where the trainer's kernels do not. `valid` `[b, s]` (with `t == s`) builds
/// the models' padding-and-causal mask; `hidden` `[t, s]` a mask shared by every row.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn compare_grouped(
    [b, h, kvh, t, s, d]: [usize; 6],
    valid: Option<Vec<bool>>,
    hidden: Option<Vec<bool>>,
    options: AttentionModuleOptions,
    seed: u64,
) -> ([f32; 4], [f32; 4]) {
    type Bf = Autodiff<burn::backend::Cuda<half::bf16>>;
    type F32 = Autodiff<burn::backend::Cuda<f32>>;
    type Cpu = Autodiff<burn::backend::NdArray<f32>>;
    let device = burn::backend::cuda::CudaDevice::new(0);
    let mut rng = trainer::seeds::ReplayRng::new(seed);
    let mut normal = |dims: [usize; 4]| -> TensorData {
        let n: usize = dims.iter().product();
        let data: Vec<f32> = (0..n)
            .map(|_| (0..12).map(|_| rng.unit_f64() as f32).sum::<f32>() - 6.0)
            .collect();
        // Rounded to bf16 once, so every side reads the same values.
        let rounded: Vec<f32> = data
            .into_iter()
            .map(|x| half::bf16::from_f32(x).to_f32())
            .collect();
        TensorData::new(rounded, dims)
    };
    let inputs = [
        normal([b, h, t, d]),
        normal([b, kvh, s, d]),
        normal([b, kvh, s, d]),
        normal([b, h, t, d]),
    ];
    // Ours: bf16, K and V as they are.
    let ours = {
        // from_data keeps the data's f32: cast, or the kernels would see f32 operands.
        let [q, k, v, w] = inputs
            .clone()
            .map(|x| Tensor::<Bf, 4>::from_data(x, &device).cast(FloatDType::BF16));
        let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
        let mask = mask_of::<Bf>(&valid, &hidden, [b, h, t, s], &device);
        let out = attention(q.clone(), k.clone(), v.clone(), mask, None, options);
        let grads = (out.clone() * w).sum().backward();
        let g = |x: &Tensor<Bf, 4>| x.grad(&grads).expect("a gradient");
        [out.inner(), g(&q), g(&k), g(&v)].map(|x| moved(x, &Default::default()))
    };
    let shape = [b, h, kvh, t, s, d];
    let cpu = decomposed_reference::<Cpu>(
        &inputs,
        shape,
        &valid,
        &hidden,
        options,
        &Default::default(),
    );
    let gpu = decomposed_reference::<F32>(&inputs, shape, &valid, &hidden, options, &device);
    (rel_diffs(ours, cpu.clone()), rel_diffs(gpu, cpu))
}

/// The flash kernels (bf16, head widths 64 and 128; `CUDA_AGENT_ATTENTION=flash`) against the
/// decomposed reference in f32:
/// grouped-query heads read unexpanded, the models' padding (left and right) with
/// causality, lengths that are not multiples of the 64-row tiles, `is_causal` with fewer
/// queries than keys, no mask, and a query whose every key is hidden.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p trainer --features cuda --test attention -- --ignored"]
fn flash_attention_matches_the_decomposed_reference_on_cuda() {
    assert!(
        trainer::kernels::attention::install(),
        "CUDA_AGENT_ATTENTION=decomposed is set"
    );
    for d in [64, 128] {
        assert!(
            trainer::kernels::flash::takes_shape(d, DType::BF16),
            "flash attention is off (CUDA_AGENT_ATTENTION=kernels or decomposed)"
        );
    }
    let tol = 2e-2;
    let mut seed = 11;
    // Every case runs and prints before the first failure is reported.
    let mut failed = Vec::new();
    let mut check = |what: String, shape: [usize; 6], valid, hidden, options| {
        seed += 1;
        let (diffs, gpu_reference) = compare_grouped(shape, valid, hidden, options, seed);
        let ok = diffs.iter().all(|d| d.is_finite() && *d <= tol);
        // The GPU's decomposed path in f32 (TF32 products) against the CPU's.
        let reference_ok = gpu_reference.iter().all(|d| d.is_finite() && *d <= 3e-3);
        eprintln!(
            "{what}: {diffs:?}{}; decomposed on the GPU: {gpu_reference:?}{}",
            if ok { "" } else { "  FAILED" },
            if reference_ok { "" } else { "  DIFFERS" }
        );
        if !ok {
            failed.push((what.clone(), diffs));
        }
        if !reference_ok {
            failed.push((
                format!("{what} (burn's decomposed attention on the GPU)"),
                gpu_reference,
            ));
        }
    };
    let causal = AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    for d in [64, 128] {
        for (h, kvh) in [(7, 1), (4, 2), (2, 2)] {
            for t in [64, 100, 200] {
                let b = 3;
                // Row 0 left-padded by 5, row 1 right-padded by 7, row 2 full.
                let valid: Vec<bool> = (0..b * t)
                    .map(|i| match i / t {
                        0 => i % t >= 5,
                        1 => i % t < t - 7,
                        _ => true,
                    })
                    .collect();
                check(
                    format!("flash d={d} h={h} kvh={kvh} t={t}, padding + causal"),
                    [b, h, kvh, t, t, d],
                    Some(valid),
                    None,
                    Default::default(),
                );
            }
        }
        check(
            format!("flash d={d}, no mask"),
            [2, 4, 2, 130, 130, d],
            None,
            None,
            Default::default(),
        );
        // One whole tile of queries and keys, ungrouped and grouped, with and without a mask.
        for (h, kvh) in [(1, 1), (2, 2), (2, 1), (4, 4)] {
            check(
                format!("flash d={d} h={h} kvh={kvh}, one whole tile, no mask"),
                [2, h, kvh, 64, 64, d],
                None,
                None,
                Default::default(),
            );
            check(
                format!("flash d={d} h={h} kvh={kvh}, one whole tile, causal"),
                [2, h, kvh, 64, 64, d],
                None,
                None,
                causal,
            );
        }
        check(
            format!("flash d={d} h=2 kvh=2, two whole tiles, no mask"),
            [2, 2, 2, 128, 128, d],
            None,
            None,
            Default::default(),
        );
        check(
            format!("flash d={d}, is_causal, 70 queries on 150 keys"),
            [2, 4, 1, 70, 150, d],
            None,
            None,
            causal,
        );
        // Query 40 sees nothing; the rest see a band.
        let (t, s) = (90, 90);
        let hidden: Vec<bool> = (0..t * s)
            .map(|i| {
                let (qi, kj) = (i / s, i % s);
                qi == 40 || kj > qi || kj + 50 < qi
            })
            .collect();
        check(
            format!("flash d={d}, a fully hidden query"),
            [1, 4, 2, t, s, d],
            None,
            Some(hidden),
            Default::default(),
        );
    }
    if let Some((what, diffs)) = failed.first() {
        assert_close(what, *diffs, tol);
    }
}
