//! The trainer's fused model steps on CUDA against their decompositions into burn operations:
//! the next-token statistics (`kernels::vocab` against `model::vocab::token_stats_decomposed`:
//! per-row log-probabilities and entropies, and the logits' gradient through both) and RMSNorm
//! (`kernels::norm` against `RmsNorm::forward_decomposed`: output, and the gradients of input
//! and scale). The CPU always takes the decompositions, which the unit and parity tests check.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "cuda")]
mod cuda {
    use super::common::{rel_diff, rel_diffs};
    use burn::backend::Autodiff;
    use burn::tensor::backend::{AutodiffBackend, Backend};
    use burn::tensor::{Int, Tensor, TensorData};
    use trainer::model::vocab::{token_stats, token_stats_decomposed};

    /// Logits `[rows, vocab]` (spread like a trained model's, with a few large entries),
    /// targets, and a weighting of the two statistics, the same on every call.
    fn inputs<B: Backend>(
        rows: usize,
        vocab: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2>, Tensor<B, 1, Int>, Tensor<B, 2>) {
        let mut rng = trainer::seeds::ReplayRng::new(11);
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| 3.0 * ((rng.unit_f64() as f32) - 0.5) + if i % 97 == 0 { 12.0 } else { 0.0 })
            .collect();
        let targets: Vec<i32> = (0..rows).map(|r| ((r * 7919 + 3) % vocab) as i32).collect();
        let weights: Vec<f32> = (0..rows * 2)
            .map(|_| (rng.unit_f64() as f32) - 0.5)
            .collect();
        (
            Tensor::from_data(TensorData::new(logits, [rows, vocab]), device),
            Tensor::from_data(TensorData::new(targets, [rows]), device),
            Tensor::from_data(TensorData::new(weights, [rows, 2]), device),
        )
    }

    /// Relative differences of the statistics and of the logits' gradient.
    fn compare<B: AutodiffBackend>(
        rows: usize,
        vocab: usize,
        temperature: f64,
        device: &B::Device,
    ) -> [f32; 2] {
        let run = |fused: bool| {
            let (logits, targets, w) = inputs::<B>(rows, vocab, device);
            let logits = logits.require_grad();
            let f = if fused {
                token_stats::<B>
            } else {
                token_stats_decomposed::<B>
            };
            let stats = f(logits.clone(), targets, temperature);
            let grads = (stats.clone() * w.cast(burn::tensor::FloatDType::F32))
                .sum()
                .backward();
            [stats.inner(), logits.grad(&grads).expect("a gradient")]
        };
        let (ours, reference) = (run(true), run(false));
        let [s, g] = ours;
        let [rs, rg] = reference;
        [rel_diff(s, rs), rel_diff(g, rg)]
    }

    fn check<B: AutodiffBackend>(device: &B::Device, stats_tol: f32, grad_tol: f32) {
        // 1001: rows walked element by element; 4096: sixteen bytes at a time; 151,936: a
        // Qwen2.5 row.
        for (rows, vocab) in [(37, 1001), (37, 4096), (5, 151_936)] {
            for temperature in [1.0, 0.7] {
                let [s, g] = compare::<B>(rows, vocab, temperature, device);
                let what = format!("{rows} rows of {vocab}, temperature {temperature}");
                assert!(
                    s.is_finite() && s <= stats_tol,
                    "{what}: statistics differ by {s} of their largest magnitude"
                );
                assert!(
                    g.is_finite() && g <= grad_tol,
                    "{what}: gradients differ by {g} of their largest magnitude"
                );
            }
        }
        // Without autodiff (reference log-probabilities in PPO) the forward alone runs.
        let (logits, targets, _) = inputs::<B::InnerBackend>(37, 4096, device);
        let d = rel_diff(
            token_stats(logits.clone(), targets.clone(), 1.0),
            token_stats_decomposed(logits, targets, 1.0),
        );
        assert!(d <= stats_tol, "untracked statistics differ by {d}");
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test -p trainer --features cuda --test fused -- --ignored"]
    fn fused_token_stats_match_the_decomposition_on_cuda() {
        type Cuda<F> = burn::backend::Cuda<F>;
        let device = burn::backend::cuda::CudaDevice::new(0);
        assert!(
            trainer::kernels::vocab::install(),
            "CUDA_AGENT_VOCAB=decomposed is set, or the kernels did not compile"
        );
        // Both sides compute in f32; bf16 logits' gradients are rounded to bf16 on both.
        check::<Autodiff<Cuda<f32>>>(&device, 1e-4, 1e-4);
        check::<Autodiff<Cuda<half::bf16>>>(&device, 1e-4, 1e-2);
    }

    /// Relative differences of RMSNorm's output and of the input's and scale's gradients.
    fn compare_norm<B: AutodiffBackend>(shape: [usize; 3], device: &B::Device) -> [f32; 3] {
        use trainer::model::transformer::RmsNorm;
        let [b, t, d] = shape;
        let mut rng = trainer::seeds::ReplayRng::new(5);
        let x: Vec<f32> = (0..b * t * d)
            .map(|_| 4.0 * ((rng.unit_f64() as f32) - 0.5))
            .collect();
        let w: Vec<f32> = (0..d).map(|_| 0.5 + (rng.unit_f64() as f32)).collect();
        let g: Vec<f32> = (0..b * t * d)
            .map(|_| (rng.unit_f64() as f32) - 0.5)
            .collect();
        let run = |fused: bool| {
            let x = Tensor::<B, 3>::from_data(TensorData::new(x.clone(), [b, t, d]), device)
                .require_grad();
            let norm = RmsNorm {
                weight: burn::module::Param::from_tensor(Tensor::<B, 1>::from_data(
                    TensorData::new(w.clone(), [d]),
                    device,
                )),
                eps: 1e-6,
            };
            let y = if fused {
                norm.forward(x.clone())
            } else {
                norm.forward_decomposed(x.clone())
            };
            let g = Tensor::<B, 3>::from_data(TensorData::new(g.clone(), [b, t, d]), device);
            let grads = (y.clone() * g).sum().backward();
            let dw = norm
                .weight
                .grad(&grads)
                .expect("the scale's gradient")
                .reshape([1, d]);
            [
                y.inner().reshape([b * t, d]),
                x.grad(&grads)
                    .expect("the input's gradient")
                    .reshape([b * t, d]),
                dw,
            ]
        };
        rel_diffs(run(true), run(false))
    }

    fn check_norm<B: AutodiffBackend>(device: &B::Device, tol: f32) {
        // 896: a Qwen2.5-0.5B row, sixteen bytes at a time; 100 and 13: element by element in
        // bf16 (and 13 in f32 too).
        for shape in [[2, 37, 896], [2, 5, 100], [3, 4, 13]] {
            let diffs = compare_norm::<B>(shape, device);
            for (d, name) in diffs
                .iter()
                .zip(["output", "input gradient", "scale gradient"])
            {
                assert!(d.is_finite() && *d <= tol, "RMSNorm {shape:?}: {name} differs by {d} of its largest magnitude (tolerance {tol})");
            }
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test -p trainer --features cuda --test fused -- --ignored"]
    fn fused_rms_norm_matches_the_decomposition_on_cuda() {
        type Cuda<F> = burn::backend::Cuda<F>;
        let device = burn::backend::cuda::CudaDevice::new(0);
        assert!(
            trainer::kernels::norm::install(),
            "CUDA_AGENT_NORM=decomposed is set, or the kernels did not compile"
        );
        // The scale's gradient is a sum over rows computed by a product: TF32 for f32 inputs.
        check_norm::<Autodiff<Cuda<f32>>>(&device, 2e-3);
        check_norm::<Autodiff<Cuda<half::bf16>>>(&device, 2e-2);
    }

    /// Relative differences of the rotated heads and of their gradient, for `x` a strided view
    /// (the query and key heads of a fused projection) as the models pass it.
    fn compare_rope<B: AutodiffBackend>(
        b: usize,
        t: usize,
        heads: usize,
        hd: usize,
        device: &B::Device,
    ) -> [f32; 2] {
        use trainer::model::rope::RopeTables;
        let mut rng = trainer::seeds::ReplayRng::new(3);
        let width = heads + 1; // one more head beside them, as the value heads are
        let x: Vec<f32> = (0..b * t * width * hd)
            .map(|_| (rng.unit_f64() as f32) - 0.5)
            .collect();
        let g: Vec<f32> = (0..b * t * heads * hd)
            .map(|_| (rng.unit_f64() as f32) - 0.5)
            .collect();
        let cfg = trainer::model::ModelConfig::from_json(&format!(
            r#"{{"model_type":"qwen2","vocab_size":40,"hidden_size":{},"intermediate_size":24,"num_hidden_layers":1,
                "num_attention_heads":{heads},"num_key_value_heads":{heads},"rope_theta":10000.0}}"#,
            heads * hd
        ))
        .unwrap();
        let tables = RopeTables::<B>::new(&cfg, t + 3, device);
        // Row 0 left-padded by 3 (positions start late), row 1 from 0.
        let positions: Vec<i32> = (0..b * t)
            .map(|i| (i % t + if i / t == 0 { 3 } else { 0 }) as i32)
            .collect();
        let angles = tables.angles(&Tensor::<B, 2, Int>::from_data(
            TensorData::new(positions, [b, t]),
            device,
        ));
        let run = |fused: bool| {
            let all =
                Tensor::<B, 4>::from_data(TensorData::new(x.clone(), [b, t, width, hd]), device)
                    .require_grad();
            let view = all.clone().narrow(2, 0, heads);
            let y = if fused {
                angles.apply(view)
            } else {
                angles.apply_decomposed(view)
            };
            let g =
                Tensor::<B, 4>::from_data(TensorData::new(g.clone(), [b, t, heads, hd]), device);
            let grads = (y.clone() * g).sum().backward();
            let dx = all.grad(&grads).expect("a gradient");
            [
                y.inner().reshape([b * t * heads, hd]),
                dx.reshape([b * t * width, hd]),
            ]
        };
        let (ours, reference) = (run(true), run(false));
        let [y, dx] = ours;
        let [ry, rdx] = reference;
        [rel_diff(y, ry), rel_diff(dx, rdx)]
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test -p trainer --features cuda --test fused -- --ignored"]
    fn fused_rope_matches_the_decomposition_on_cuda() {
        type Cuda<F> = burn::backend::Cuda<F>;
        let device = burn::backend::cuda::CudaDevice::new(0);
        assert!(
            trainer::kernels::rope::install(),
            "CUDA_AGENT_ROPE=decomposed is set, or the kernel did not compile"
        );
        for (tol, bf16) in [(1e-5, false), (1e-2, true)] {
            for (b, t, heads, hd) in [(2, 37, 3, 64), (2, 5, 2, 16)] {
                let [y, dx] = if bf16 {
                    compare_rope::<Autodiff<Cuda<half::bf16>>>(b, t, heads, hd, &device)
                } else {
                    compare_rope::<Autodiff<Cuda<f32>>>(b, t, heads, hd, &device)
                };
                let what = format!("rope {b}x{t}x{heads}x{hd}, bf16 {bf16}");
                assert!(y.is_finite() && y <= tol, "{what}: output differs by {y}");
                assert!(
                    dx.is_finite() && dx <= tol,
                    "{what}: gradient differs by {dx}"
                );
            }
        }
    }

    /// Relative differences of the MLP's output and of the gradients of its input and of the
    /// gate-and-up weight, with the SwiGLU gate fused and composed.
    fn compare_mlp<B: AutodiffBackend>(
        shape: [usize; 3],
        n: usize,
        device: &B::Device,
    ) -> [f32; 3] {
        use trainer::model::transformer::{Dense, Mlp};
        let [b, t, d] = shape;
        B::seed(device, 9);
        let mlp = Mlp {
            gate_up_proj: Dense::<B>::random(d, 2 * n, false, 0.3, device),
            down_proj: Dense::<B>::random(n, d, false, 0.3, device),
        };
        let mut rng = trainer::seeds::ReplayRng::new(13);
        let x: Vec<f32> = (0..b * t * d)
            .map(|_| 2.0 * ((rng.unit_f64() as f32) - 0.5))
            .collect();
        let run = |fused: bool| {
            let x = Tensor::<B, 3>::from_data(TensorData::new(x.clone(), [b, t, d]), device)
                .require_grad();
            let y = if fused {
                mlp.forward(x.clone())
            } else {
                mlp.forward_decomposed(x.clone())
            };
            let grads = (y.clone() * y.clone()).sum().backward();
            let dw = mlp
                .gate_up_proj
                .weight
                .grad(&grads)
                .expect("the weight's gradient");
            [
                y.inner().reshape([b * t, d]),
                x.grad(&grads)
                    .expect("the input's gradient")
                    .reshape([b * t, d]),
                dw,
            ]
        };
        rel_diffs(run(true), run(false))
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test -p trainer --features cuda --test fused -- --ignored"]
    fn fused_swiglu_matches_the_decomposition_on_cuda() {
        type Cuda<F> = burn::backend::Cuda<F>;
        let device = burn::backend::cuda::CudaDevice::new(0);
        assert!(
            trainer::kernels::swiglu::install(),
            "CUDA_AGENT_SWIGLU=decomposed is set, or the kernels did not compile"
        );
        for shape in [[2, 37, 64], [1, 3, 16]] {
            for (tol, diffs) in [
                (3e-3, compare_mlp::<Autodiff<Cuda<f32>>>(shape, 96, &device)),
                (
                    3e-2,
                    compare_mlp::<Autodiff<Cuda<half::bf16>>>(shape, 96, &device),
                ),
            ] {
                for (d, name) in diffs
                    .iter()
                    .zip(["output", "input gradient", "weight gradient"])
                {
                    assert!(d.is_finite() && *d <= tol, "MLP {shape:?}: {name} differs by {d} of its largest magnitude (tolerance {tol})");
                }
            }
        }
    }
}
