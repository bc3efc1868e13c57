//! The decode step on CUDA (`kernels::decode`, one operation per step) against
//! `CausalLm::forward_last` (burn operations), token by token from the same caches: padded
//! prompts, caches taken apart into rows and stacked again (left padding, storage without free
//! slots), rows retained mid-way, grouped and ungrouped heads, tied and untied heads, query/key/
//! value biases and low-rank adapters, in f32 and bf16; and the token choice kernel
//! (`kernels::sample`) against the composition it replaces. The CPU has no decode step (its
//! generation always runs `forward_last`, which the parity tests check).

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[cfg(feature = "cuda")]
#[allow(dead_code)] // shared with tests that use all of it
mod common;

#[cfg(feature = "cuda")]
mod cuda {
    use super::common::rel_diff;
    use burn::module::{Module, ModuleMapper, Param};
    use burn::tensor::backend::Backend;
    use burn::tensor::{Bool, DType, Distribution, Int, Tensor, TensorData};
    use trainer::model::{Architecture, CausalLm, KvCache, LoraSpec, LoraTarget, ModelConfig};

    fn config(heads: usize, kv_heads: usize, hidden: usize, tied: bool) -> ModelConfig {
        ModelConfig::from_json(&format!(
            r#"{{"model_type":"qwen2","vocab_size":1000,"hidden_size":{hidden},"intermediate_size":{},
                "num_hidden_layers":3,"num_attention_heads":{heads},"num_key_value_heads":{kv_heads},
                "tie_word_embeddings":{tied},"rope_theta":10000.0}}"#,
            2 * hidden + 64
        ))
        .expect("a valid config")
    }

    /// Adapters with non-zero `B` on `targets` (fresh adapters start at zero, which would
    /// test nothing).
    fn adapt<B: Backend>(lm: CausalLm<B>, targets: Vec<LoraTarget>) -> CausalLm<B> {
        let spec = LoraSpec {
            rank: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets,
        };
        let mut lm = CausalLm {
            backbone: lm.backbone.with_adapters(&spec, 7),
            lm_head: lm.lm_head,
        };
        for layer in &mut lm.backbone.layers {
            for dense in [
                &mut layer.self_attn.qkv_proj,
                &mut layer.self_attn.o_proj,
                &mut layer.mlp.gate_up_proj,
                &mut layer.mlp.down_proj,
            ] {
                if let Some(a) = dense.lora.as_mut() {
                    for b in &mut a.b {
                        let dims = b.dims();
                        *b = Param::from_tensor(Tensor::random(
                            dims,
                            Distribution::Normal(0.0, 0.05),
                            &b.device(),
                        ));
                    }
                }
            }
        }
        lm
    }

    /// Every float tensor of a module in one element type.
    struct CastTo(DType);

    impl<B: Backend> ModuleMapper<B> for CastTo {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let dtype = self.0;
            param.map(|t| t.cast(dtype))
        }
    }

    /// Steps both ways from one cache; returns the largest relative difference of the logits.
    fn compare<B: Backend>(lm: &CausalLm<B>, cfg: &ModelConfig, device: &B::Device) -> f32 {
        let mut arch = Architecture::<B>::new(cfg.clone(), 1024, device);
        let dtype = lm.backbone.embed_tokens.val().dtype();
        arch.rope = arch.rope.clone().cast(dtype);
        let decoder = lm.decoder(&arch).expect("the decode step takes this model");
        let lens = [300usize, 5, 41];
        let w = lens[0];
        let (mut ids, mut valid) = (Vec::new(), Vec::new());
        for (r, &n) in lens.iter().enumerate() {
            ids.extend((0..w).map(|i| ((i * 31 + r * 17 + 5) % 1000) as i32));
            valid.extend((0..w).map(|i| i >= w - n));
        }
        let rows = lens.len();
        let mut prefill = KvCache::new(cfg.num_hidden_layers);
        lm.forward_last(
            Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [rows, w]), device),
            Tensor::<B, 2, Bool>::from_data(TensorData::new(valid, [rows, w]), device),
            &arch,
            Some(&mut prefill),
        );
        // As a conversation's kept caches come back: rows apart, stacked with left padding and
        // no free slots (the first step grows the storage).
        let parts = (0..rows).map(|r| prefill.row(r, device)).collect();
        let stacked = KvCache::stack(parts, cfg.num_hidden_layers, device);
        // Shared storage: the decode step must copy before writing, leaving `theirs` intact.
        let (mut ours, mut theirs) = (stacked.clone(), stacked);
        let mut live: Vec<usize> = (0..rows).collect();
        let mut worst = 0.0f32;
        for step in 0..24 {
            if step == 9 {
                live = vec![0, 2];
                ours.retain(&[0, 2], device);
                theirs.retain(&[0, 2], device);
            }
            let n = live.len();
            let next: Vec<i32> = live
                .iter()
                .map(|&r| ((step * 13 + r * 101 + 7) % 1000) as i32)
                .collect();
            let a = decoder
                .step(
                    Tensor::<B, 1, Int>::from_data(TensorData::new(next.clone(), [n]), device),
                    &mut ours,
                )
                .expect("the step applies to this cache");
            let b = lm.forward_last(
                Tensor::<B, 2, Int>::from_data(TensorData::new(next, [n, 1]), device),
                Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; n], [n, 1]), device),
                &arch,
                Some(&mut theirs),
            );
            assert_eq!(a.dims(), b.dims());
            assert_eq!(ours.len(), theirs.len());
            worst = worst.max(rel_diff(a, b));
        }
        worst
    }

    /// The cases in `dtype`: a device keeps the element type of the first backend that used
    /// it as its default, so the models are cast explicitly.
    fn check<B: Backend>(device: &B::Device, dtype: DType, tol: f32) {
        let cases: Vec<(&str, ModelConfig, Option<Vec<LoraTarget>>)> = vec![
            (
                "7 query heads per key head, tied",
                config(14, 2, 896, true),
                None,
            ),
            ("ungrouped, untied", config(4, 4, 256, false), None),
            ("head width 128", config(8, 2, 1024, false), None),
            (
                "adapters on every projection",
                config(14, 2, 896, true),
                Some(LoraTarget::ALL.to_vec()),
            ),
            (
                "adapters on query and value only",
                config(8, 2, 512, false),
                Some(vec![LoraTarget::QProj, LoraTarget::VProj]),
            ),
        ];
        for (name, cfg, targets) in cases {
            let lm = CausalLm::<B>::random(&cfg, device).map(&mut CastTo(dtype));
            let lm = match targets {
                Some(t) => adapt(lm, t),
                None => lm,
            };
            assert_eq!(lm.backbone.embed_tokens.val().dtype(), dtype);
            let d = compare(&lm, &cfg, device);
            eprintln!("{name}: largest relative logit difference {d:.2e}");
            assert!(d < tol, "{name}: {d} against {tol}");
        }
    }

    fn install() {
        trainer::blas::cublas::install().expect("cuBLAS");
        assert!(
            trainer::kernels::decode::install(),
            "the decode kernels compile"
        );
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test -p trainer --features cuda --test decode -- --ignored"]
    fn the_decode_step_matches_forward_last_on_cuda() {
        install();
        let device = burn::backend::cuda::CudaDevice::new(0);
        check::<burn::backend::Cuda<f32>>(&device, DType::F32, 2e-3);
        check::<burn::backend::Cuda<half::bf16>>(&device, DType::BF16, 4e-2);
        let (steps, declined) = trainer::kernels::decode::counts();
        assert!(steps > 0);
        assert_eq!(declined, 0);
    }

    /// The token choice kernel (`kernels::sample`) against the composition of burn operations,
    /// from the same logits and draws: the same tokens, the same log-probabilities to rounding.
    fn check_choice<B: Backend>(dtype: DType, device: &B::Device) {
        for vocab in [151_936, 1000, 129] {
            let rows = 37;
            let logits =
                Tensor::<B, 2>::random([rows, vocab], Distribution::Normal(0.0, 3.0), device)
                    .cast(dtype);
            // Draws across [0, 1), the ends included.
            let us: Vec<f64> = (0..rows)
                .map(|r| match r {
                    0 => 0.0,
                    1 => 1.0 - f64::EPSILON,
                    _ => (r as f64 * 0.618_033_988_75).fract(),
                })
                .collect();
            let rows_f64: Vec<f64> = logits
                .clone()
                .cast(DType::F32)
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .expect("f32 logits")
                .into_iter()
                .map(f64::from)
                .collect();
            for temperature in [0.0, 0.7, 1.0, 1.6] {
                let fused = trainer::generate::choose_on_device(logits.clone(), temperature, &us);
                let composed = trainer::generate::choose_composed(logits.clone(), temperature, &us);
                assert_eq!(fused.len(), rows);
                for (r, (f, c)) in fused.iter().zip(&composed).enumerate() {
                    if f.0 != c.0 {
                        // Both sums round: the two may differ only where the draw lies on the
                        // boundary between the tokens, to rounding.
                        let (lo, hi) = (f.0.min(c.0), f.0.max(c.0));
                        let cdf = host_cdf(&rows_f64[r * vocab..(r + 1) * vocab], temperature);
                        assert!(
                            temperature > 0.0
                                && (cdf[lo + 1] - us[r]).abs() < 1e-5
                                && (cdf[hi] - us[r]).abs() < 1e-5,
                            "{dtype:?} vocab {vocab} temperature {temperature} row {r}: token {} against {} (draw {}, boundaries {} and {})",
                            f.0,
                            c.0,
                            us[r],
                            cdf[lo + 1],
                            cdf[hi]
                        );
                        continue;
                    }
                    assert!(
                        (f.1 - c.1).abs() <= 1e-4 * c.1.abs().max(1.0),
                        "{dtype:?} vocab {vocab} temperature {temperature} row {r}: log-probability {} against {}",
                        f.1,
                        c.1
                    );
                }
            }
        }
    }

    /// Cumulative probabilities of a row of logits at a temperature: `cdf[i]` is the mass of
    /// the tokens before `i` (`cdf[vocab]` is 1).
    fn host_cdf(logits: &[f64], temperature: f64) -> Vec<f64> {
        let x: Vec<f64> = logits.iter().map(|l| l / temperature).collect();
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut cdf = Vec::with_capacity(w.len() + 1);
        let mut acc = 0.0;
        cdf.push(0.0);
        for v in w {
            acc += v / total;
            cdf.push(acc);
        }
        cdf
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test -p trainer --features cuda --test decode -- --ignored"]
    fn the_token_choice_kernel_matches_the_composition_on_cuda() {
        assert!(
            trainer::kernels::sample::install(),
            "the token choice kernel compiles"
        );
        let device = burn::backend::cuda::CudaDevice::new(0);
        check_choice::<burn::backend::Cuda<f32>>(DType::F32, &device);
        check_choice::<burn::backend::Cuda<half::bf16>>(DType::BF16, &device);
    }
}
