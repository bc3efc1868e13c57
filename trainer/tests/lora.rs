//! Fitting large models: low-rank adapters (an adapted model starts as its base, trains its
//! adapters alone, merges and round-trips exactly; the critic's adapters sit on the same frozen
//! base; the optimiser's state resumes; the PEFT export is what `transformers` computes),
//! layer-by-layer backward passes that give the whole graph's gradients, and the memory plan.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData};
use trainer::config::TrainConfig;
use trainer::memory::{param_count, DeviceMemory, MemoryPlan};
use trainer::model::recompute::layerwise_grads;
use trainer::model::{Architecture, CausalLm, Critic, LoraSpec, LoraTarget, ModelConfig};
use trainer::optim::Trainable;
use trainer::stage::{Learner, StageOptions};

type B = NdArray<f32>;
type A = Autodiff<B>;

fn tiny_config(tied: bool) -> ModelConfig {
    ModelConfig::from_json(&format!(
        r#"{{"model_type":"qwen2","vocab_size":40,"hidden_size":16,"intermediate_size":24,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "tie_word_embeddings":{tied}}}"#
    ))
    .unwrap()
}

fn spec(targets: &[LoraTarget]) -> LoraSpec {
    LoraSpec {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: targets.to_vec(),
    }
}

/// Two rows, the second left-padded.
fn batch<Bk: Backend>() -> (Tensor<Bk, 2, Int>, Tensor<Bk, 2, Bool>) {
    let device = Default::default();
    let tokens = vec![1, 5, 9, 2, 7, 3, 0, 0, 4, 8, 6, 11];
    let valid = vec![
        true, true, true, true, true, true, false, false, true, true, true, true,
    ];
    (
        Tensor::from_data(TensorData::new(tokens, [2, 6]), &device),
        Tensor::from_data(TensorData::new(valid, [2, 6]), &device),
    )
}

fn logits<Bk: Backend>(lm: &CausalLm<Bk>, arch: &Architecture<Bk>) -> Vec<f32> {
    let (tokens, valid) = batch::<Bk>();
    lm.forward(tokens, valid, arch, None)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every float parameter's id, whether it requires a gradient, and its values.
struct Params(Vec<(ParamId, bool, Vec<f32>)>);

impl<Bk: Backend> ModuleVisitor<Bk> for Params {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Bk, D>>) {
        let t = p.val();
        let grad = t.is_require_grad();
        self.0
            .push((p.id, grad, t.into_data().convert::<f32>().to_vec().unwrap()));
    }
}

fn params<Bk: Backend, M: Module<Bk>>(m: &M) -> Vec<(ParamId, bool, Vec<f32>)> {
    let mut v = Params(Vec::new());
    m.visit(&mut v);
    v.0
}

/// One AdamW step on the adapted model's negative log-likelihood of [`batch`].
fn train_step(
    lm: CausalLm<A>,
    arch: &Architecture<A>,
    opt: &mut Trainable<A, CausalLm<A>>,
) -> CausalLm<A> {
    let (tokens, valid) = batch::<A>();
    let loss = lm
        .sequence_stats(tokens, valid, arch, 1.0)
        .logprobs
        .mean()
        .neg();
    opt.backward(&lm, loss);
    opt.step(5e-2, lm).0
}

fn arch<Bk: Backend>(tied: bool) -> Architecture<Bk> {
    Architecture::new(tiny_config(tied), 16, &Default::default())
}

#[test]
fn an_adapted_model_starts_as_its_base_and_trains_its_adapters_alone() {
    let device = Default::default();
    for tied in [true, false] {
        let cfg = tiny_config(tied);
        let base = CausalLm::<A>::random(&cfg, &device);
        let want = logits(&base.valid(), &arch(tied));
        let lm = base.clone().with_adapters(&spec(&LoraTarget::ALL));
        assert!(lm.has_adapters() && !base.has_adapters());
        // B starts at zero: the adapted model is its base, exactly.
        assert_eq!(logits(&lm.valid(), &arch(tied)), want);
        // Per layer: A [16, 3·4] and B [4, 16 + 8 + 8] on q/k/v; A [16, 4], B [4, 16] on o;
        // A [16, 2·4], B [4, 48] on gate/up; A [24, 4], B [4, 16] on down.
        let per_layer =
            (16 * 12 + 4 * 32) + (16 * 4 + 4 * 16) + (16 * 8 + 4 * 48) + (24 * 4 + 4 * 16);
        assert_eq!(lm.backbone.adapter_params(), 2 * per_layer);

        let before = params(&lm);
        let trained_with = before.iter().filter(|(_, g, _)| *g).count();
        // Two layers of four adapted slots, an A each and a B per adapted part (3, 1, 2, 1).
        assert_eq!(
            trained_with,
            2 * (4 + 7),
            "only adapter tensors require gradients"
        );
        let mut opt = Trainable::new(0.0, 1.0);
        let arch_a = arch::<A>(tied);
        // Two steps: with B at zero, A's gradient is zero in the first.
        let lm = train_step(lm, &arch_a, &mut opt);
        let lm = train_step(lm, &arch_a, &mut opt);
        let after = params(&lm);
        assert_eq!(before.len(), after.len());
        for ((id, grad, old), (id2, grad2, new)) in before.iter().zip(&after) {
            assert_eq!((id, grad), (id2, grad2));
            if *grad {
                continue;
            }
            assert_eq!(old, new, "a frozen weight moved");
        }
        let moved = before
            .iter()
            .zip(&after)
            .filter(|((_, g, old), (_, _, new))| *g && old != new)
            .count();
        assert_eq!(moved, trained_with, "every adapter tensor trains");
        assert_ne!(logits(&lm.valid(), &arch(tied)), want);
        // With adapters off it is the base again, sharing its weights.
        assert_eq!(logits(&lm.without_adapters().valid(), &arch(tied)), want);
    }
}

#[test]
fn merged_and_reloaded_adapters_give_the_adapted_model() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    // Every projection, and a subset whose fused layers hold parts without an adapter.
    let subset = [LoraTarget::QProj, LoraTarget::VProj, LoraTarget::UpProj];
    for (k, targets) in [&LoraTarget::ALL[..], &subset[..]].into_iter().enumerate() {
        let cfg = tiny_config(false);
        let base = CausalLm::<A>::random(&cfg, &device);
        let mut opt = Trainable::new(0.0, 1.0);
        let mut lm = base.clone().with_adapters(&spec(targets));
        for _ in 0..3 {
            lm = train_step(lm, &arch(false), &mut opt);
        }
        let want = logits(&lm.valid(), &arch(false));
        let merged = lm.merged();
        assert!(!merged.has_adapters());
        let diff = max_abs_diff(&logits(&merged.valid(), &arch(false)), &want);
        assert!(diff < 1e-4, "merged logits differ by {diff}");

        let path = dir.path().join(format!("adapter-{k}.safetensors"));
        lm.save_adapter(&path).unwrap();
        let back = base
            .clone()
            .with_adapters(&spec(targets))
            .load_adapter(&path)
            .unwrap();
        assert_eq!(logits(&back.valid(), &arch(false)), want);
        let ids = |m: &CausalLm<A>| params(m).into_iter().map(|p| p.0).collect::<Vec<_>>();
        assert_eq!(ids(&back), ids(&lm), "adapter parameter ids are stable");

        // An adapter of another shape is refused, naming what does not fit.
        let mut other = spec(targets);
        other.rank = 2;
        let e = base
            .clone()
            .with_adapters(&other)
            .load_adapter(&path)
            .unwrap_err();
        assert!(env_api::error_chain(&e).contains("shape"), "{e}");
        if k == 1 {
            let e = base
                .clone()
                .with_adapters(&spec(&[LoraTarget::QProj]))
                .load_adapter(&path)
                .unwrap_err();
            assert!(env_api::error_chain(&e).contains("no place"), "{e}");
        }
    }
}

#[test]
fn the_critic_adapts_the_policys_frozen_base_and_round_trips() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(true);
    let policy = CausalLm::<A>::random(&cfg, &device).with_adapters(&spec(&LoraTarget::ALL));
    let critic = Critic::with_adapters(&policy, &spec(&LoraTarget::ALL), &device);
    let arch_a = arch::<A>(true);
    let (tokens, valid) = batch::<A>();
    let v: Vec<f32> = critic
        .values(tokens.clone(), valid.clone(), &arch_a)
        .into_data()
        .to_vec()
        .unwrap();
    assert_eq!(v, vec![0.0; 12], "values start at zero");
    // The frozen base is the policy's; the adapters are the critic's own.
    let (p, c) = (params(&policy), params(&critic));
    let frozen = |ps: &[(ParamId, bool, Vec<f32>)]| -> Vec<Vec<f32>> {
        ps.iter().filter(|q| !q.1).map(|q| q.2.clone()).collect()
    };
    assert_eq!(frozen(&p), frozen(&c));
    let trained = |ps: &[(ParamId, bool, Vec<f32>)]| -> Vec<ParamId> {
        ps.iter().filter(|q| q.1).map(|q| q.0).collect()
    };
    let (pt, ct) = (trained(&p), trained(&c));
    assert!(
        pt.iter().all(|id| !ct.contains(id)),
        "critic adapters have ids of their own"
    );
    // Adapters plus the value head's weight and bias.
    assert_eq!(ct.len(), pt.len() + 2);

    let mut opt = Trainable::new(0.0, 1.0);
    let loss = (critic.values(tokens.clone(), valid.clone(), &arch_a) - 1.0)
        .powi_scalar(2)
        .mean();
    opt.backward(&critic, loss);
    let (critic, _) = opt.step(5e-2, critic);
    let want: Vec<f32> = critic
        .values(tokens.clone(), valid.clone(), &arch_a)
        .into_data()
        .to_vec()
        .unwrap();
    assert!(want.iter().any(|&x| x != 0.0));
    let path = dir.path().join("critic_adapter.safetensors");
    critic.save_adapter(&path).unwrap();
    let back = Critic::with_adapters(&policy, &spec(&LoraTarget::ALL), &device)
        .load_adapter(&path, &device)
        .unwrap();
    let got: Vec<f32> = back
        .values(tokens, valid, &arch_a)
        .into_data()
        .to_vec()
        .unwrap();
    assert_eq!(got, want);
}

#[test]
fn the_adapters_optimiser_state_resumes_exactly() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(false);
    let base = CausalLm::<A>::random(&cfg, &device);
    let mut opt = Trainable::new(0.01, 1.0);
    let mut lm = base.clone().with_adapters(&spec(&LoraTarget::ALL));
    for _ in 0..2 {
        lm = train_step(lm, &arch(false), &mut opt);
    }
    let (adapter, state) = (dir.path().join("a.safetensors"), dir.path().join("o.mpk"));
    lm.save_adapter(&adapter).unwrap();
    opt.save(&state).unwrap();
    let continued = train_step(lm, &arch(false), &mut opt);

    // A fresh process's view: the base rebuilt, the adapters and the moments read back.
    let resumed = base
        .with_adapters(&spec(&LoraTarget::ALL))
        .load_adapter(&adapter)
        .unwrap();
    let mut opt2 = Trainable::new(0.01, 1.0)
        .load(&state, &resumed, &device)
        .unwrap();
    let resumed = train_step(resumed, &arch(false), &mut opt2);
    assert_eq!(
        logits(&resumed.valid(), &arch(false)),
        logits(&continued.valid(), &arch(false))
    );
}

fn python() -> PathBuf {
    std::env::var_os("CUDA_AGENT_PYTHON")
        .map(Into::into)
        .unwrap_or_else(|| "python3".into())
}

#[test]
fn the_peft_export_is_what_transformers_computes() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(false);
    let base = CausalLm::<A>::random(&cfg, &device);
    let base_dir = dir.path().join("base");
    base.valid().save_pretrained(&cfg, &base_dir).unwrap();
    let targets = [
        LoraTarget::QProj,
        LoraTarget::KProj,
        LoraTarget::OProj,
        LoraTarget::GateProj,
        LoraTarget::DownProj,
    ];
    let mut opt = Trainable::new(0.0, 1.0);
    let mut lm = base.with_adapters(&spec(&targets));
    for _ in 0..3 {
        lm = train_step(lm, &arch(false), &mut opt);
    }
    let adapter_dir = dir.path().join("adapter");
    lm.save_peft(&spec(&targets), Some(&base_dir), &adapter_dir)
        .unwrap();
    let merged_dir = dir.path().join("merged");
    lm.merged()
        .valid()
        .save_pretrained(&cfg, &merged_dir)
        .unwrap();
    // One unpadded row: Hugging Face numbers positions by index, not by the mask.
    let row = vec![1, 5, 9, 2, 7, 3];
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(row.clone(), [1, 6]), &device);
    let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; 6], [1, 6]), &device);
    let ours: Vec<f32> = lm
        .valid()
        .forward(tokens, valid, &arch(false), None)
        .into_data()
        .to_vec()
        .unwrap();
    let expected = dir.path().join("ours.json");
    let json = serde_json::json!({"tokens": row, "logits": ours});
    std::fs::write(&expected, json.to_string()).unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/peft_check.py");
    let out = Command::new(python())
        .arg(script)
        .args([&base_dir, &adapter_dir, &merged_dir, &expected])
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "peft_check.py failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in ["adapter_vs_ours", "merged_vs_ours"] {
        let d = report[key].as_f64().unwrap();
        assert!(d < 1e-4, "{key}: {d} ({report})");
    }
}

/// A tiny checkpoint directory: config, tokenizer and random weights.
fn tiny_model_dir(dir: &Path) -> PathBuf {
    let m = dir.join("model");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-tokenizer.json"),
        m.join("tokenizer.json"),
    )
    .unwrap();
    let cfg = serde_json::json!({"model_type": "qwen2", "vocab_size": 512, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "tie_word_embeddings": true,
        "eos_token_id": 2});
    // Weights on disk: a stage loads the same base however the test threads share burn's
    // random generator (a seeded random init would race with the other tests' draws).
    let config = ModelConfig::from_json(&cfg.to_string()).unwrap();
    CausalLm::<B>::random(&config, &Default::default())
        .save_pretrained(&config, &m)
        .unwrap();
    std::fs::write(m.join("config.json"), cfg.to_string()).unwrap();
    m
}

fn stage_logits(learner: &Learner<A>) -> Vec<f32> {
    logits(&learner.policy().valid(), &learner.infer_arch)
}

#[test]
fn a_stage_with_adapters_checkpoints_resumes_and_exports() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = TrainConfig::default();
    cfg.model.path = Some(tiny_model_dir(dir.path()));
    cfg.run.out_dir = dir.path().join("runs");
    cfg.lora.rank = 4;
    cfg.lora.alpha = 8.0;
    cfg.optim.activation_checkpointing = true;
    let device = Default::default();
    let mut learner =
        Learner::<A>::new(cfg.clone(), "ppo", &StageOptions::default(), 32, device).unwrap();
    assert!(learner.policy().has_adapters() && learner.critic().has_adapters());
    for _ in 0..2 {
        let (tokens, valid) = batch::<A>();
        learner.policy_backward_stats(tokens.clone(), valid.clone(), 1.0, |stats| {
            stats.logprobs.mean().neg()
        });
        learner.policy_step(5e-2).unwrap();
        learner.critic_backward_values(tokens, valid, |v| (v - 1.0).powi_scalar(2).mean());
        learner.critic_step(5e-2).unwrap();
    }
    learner.step = 2;
    let want = stage_logits(&learner);
    let ckpt = learner.save_checkpoint(10).unwrap();
    // Adapters alone: no full records of either model.
    for name in ["policy_adapter.safetensors", "critic_adapter.safetensors"] {
        assert!(ckpt.join(name).is_file(), "{name}");
    }
    for name in ["policy.mpk", "critic.mpk"] {
        assert!(!ckpt.join(name).exists(), "{name}");
    }

    let resumed = Learner::<A>::new(
        cfg.clone(),
        "ppo",
        &StageOptions {
            resume: true,
            ..Default::default()
        },
        32,
        device,
    )
    .unwrap();
    assert_eq!(resumed.step, 2);
    assert_eq!(stage_logits(&resumed), want);

    let fin = learner.save_final().unwrap();
    for f in [
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "hf/model.safetensors",
    ] {
        assert!(fin.join(f).is_file(), "{f}");
    }
    let (_, merged) = CausalLm::<B>::from_pretrained(&fin.join("hf"), &device).unwrap();
    let arch_b = Architecture::<B>::new(learner.model_config.clone(), 32, &device);
    let diff = max_abs_diff(&logits(&merged, &arch_b), &want);
    assert!(diff < 1e-4, "merged export differs by {diff}");

    // The next stage starts from the adapters; a full-parameter stage refuses them.
    let next = Learner::<A>::new(
        cfg.clone(),
        "rft",
        &StageOptions {
            init: Some(fin.clone()),
            ..Default::default()
        },
        32,
        device,
    )
    .unwrap();
    assert_eq!(stage_logits(&next), want);
    let mut full = cfg.clone();
    full.lora.rank = 0;
    let e = Learner::<A>::new(
        full,
        "rft",
        &StageOptions {
            init: Some(fin),
            ..Default::default()
        },
        32,
        device,
    )
    .err()
    .expect("an error");
    assert!(env_api::error_chain(&e).contains("adapters"), "{e}");
}

#[test]
fn the_memory_plan_counts_a_7b_model_and_refuses_what_cannot_fit() {
    let shape = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/shapes/qwen2.5-7b.json");
    let model = ModelConfig::from_json(&std::fs::read_to_string(shape).unwrap()).unwrap();
    // Qwen2.5-7B's published parameter count.
    assert_eq!(param_count(&model), 7_615_616_512);
    let h100 = DeviceMemory {
        free: 79 << 30,
        total: 80 << 30,
        name: "GPU 0",
    };
    // Issue-sized run: 8 episodes at 8k tokens, one sequence per micro-batch.
    let mut cfg = TrainConfig::default();
    cfg.rollout.generation_batch = 8;
    cfg.rollout.batch = 8;
    cfg.rollout.context = 8192;
    cfg.optim.micro_batch = 1;
    let full = MemoryPlan::new(&model, &cfg, 2, 8192);
    let e = full.check(&h100).unwrap_err().to_string();
    assert!(e.contains("lora.rank") && e.contains("GPU 0"), "{e}");
    cfg.lora.rank = 16;
    let adapters = MemoryPlan::new(&model, &cfg, 2, 8192);
    assert!(adapters.total() < full.total() / 2, "{adapters}\n{full}");
    // Without checkpointing an 8k-token pass keeps tens of GiB of activations.
    assert!(adapters.check(&h100).is_err(), "{adapters}");
    cfg.optim.activation_checkpointing = true;
    let fits = MemoryPlan::new(&model, &cfg, 2, 8192);
    fits.check(&h100).unwrap();
    let text = fits.to_string();
    assert!(
        text.contains("base weights") && text.contains("checkpointed"),
        "{text}"
    );

    // A stage whose plan exceeds the device stops before it loads anything.
    let dir = tempfile::tempdir().unwrap();
    let mut small = TrainConfig::default();
    small.model.path = Some(tiny_model_dir(dir.path()));
    small.run.out_dir = dir.path().join("runs");
    let tiny = DeviceMemory {
        free: 1 << 10,
        total: 1 << 20,
        name: "host",
    };
    let opts = StageOptions {
        device_memory: Some(tiny),
        ..Default::default()
    };
    let e = Learner::<A>::new(small.clone(), "ppo", &opts, 32, Default::default())
        .err()
        .expect("an error");
    assert!(env_api::error_chain(&e).contains("memory plan"), "{e}");
    small.run.check_memory = false;
    Learner::<A>::new(small, "ppo", &opts, 32, Default::default()).unwrap();
}

/// Each parameter's gradient summed over `parts` (absent: no gradient).
struct Summed<'a>(&'a [GradientsParams], Vec<(ParamId, Option<Vec<f32>>)>);

impl ModuleVisitor<A> for Summed<'_> {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<A, D>>) {
        let mut sum: Option<Tensor<B, D>> = None;
        for part in self.0 {
            if let Some(g) = part.get::<B, D>(p.id) {
                sum = Some(match sum {
                    Some(s) => s + g,
                    None => g,
                });
            }
        }
        self.1
            .push((p.id, sum.map(|s| s.into_data().to_vec::<f32>().unwrap())));
    }
}

fn summed<M: Module<A>>(m: &M, parts: &[GradientsParams]) -> Vec<(ParamId, Option<Vec<f32>>)> {
    let mut v = Summed(parts, Vec::new());
    m.visit(&mut v);
    v.1
}

fn assert_same_grads(
    what: &str,
    whole: Vec<(ParamId, Option<Vec<f32>>)>,
    layered: Vec<(ParamId, Option<Vec<f32>>)>,
) {
    assert_eq!(whole.len(), layered.len());
    let mut compared = 0;
    for ((id, a), (id2, b)) in whole.into_iter().zip(layered) {
        assert_eq!(id, id2);
        match (a, b) {
            (None, None) => {}
            (Some(a), Some(b)) => {
                let scale = a.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
                let diff = max_abs_diff(&a, &b) / scale;
                assert!(
                    diff < 1e-4,
                    "{what}: parameter {id}: relative difference {diff}"
                );
                compared += 1;
            }
            (a, b) => panic!(
                "{what}: parameter {id} has a gradient in one pass only ({} vs {})",
                a.is_some(),
                b.is_some()
            ),
        }
    }
    assert!(compared > 0, "{what}: no gradients compared");
}

#[test]
fn layer_by_layer_backward_gives_the_whole_graphs_gradients() {
    let device = Default::default();
    for (tied, lora) in [(true, false), (false, false), (true, true)] {
        let what = format!("tied {tied}, adapters {lora}");
        let cfg = tiny_config(tied);
        let arch = arch::<A>(tied);
        let mut lm = CausalLm::<A>::random(&cfg, &device);
        if lora {
            // Adapters with non-zero B, so that every adapter tensor has a gradient.
            let mut opt = Trainable::new(0.0, 1.0);
            lm = lm.with_adapters(&spec(&LoraTarget::ALL));
            lm = train_step(lm, &arch, &mut opt);
        }
        // A loss that uses log-probabilities and entropies, as PPO's does.
        let loss = |stats: trainer::model::SequenceStats<A>| {
            (stats.logprobs * 0.7 - stats.entropy * 0.3).mean()
        };
        let (tokens, valid) = batch::<A>();
        let whole = GradientsParams::from_grads(
            loss(lm.sequence_stats(tokens.clone(), valid.clone(), &arch, 0.9)).backward(),
            &lm,
        );
        let parts = layerwise_grads(
            &lm,
            &lm.backbone,
            tokens.clone(),
            valid.clone(),
            &arch.rope,
            |h| loss(lm.stats_of_hidden(h, tokens.clone(), 0.9)),
        );
        assert_eq!(parts.len(), 1 + 2 + usize::from(!lora), "{what}");
        assert_same_grads(&what, summed(&lm, &[whole]), summed(&lm, &parts));

        let mut critic = if lora {
            Critic::with_adapters(&lm, &spec(&LoraTarget::ALL), &device)
        } else {
            Critic::from_policy(&lm, &device)
        };
        // A non-zero head, so that gradients reach the backbone.
        critic.value_head.weight = Param::from_tensor(Tensor::random(
            [16, 1],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        ));
        let v_loss = |v: Tensor<A, 2>| (v - 0.5).powi_scalar(2).mean();
        let whole = GradientsParams::from_grads(
            v_loss(critic.values(tokens.clone(), valid.clone(), &arch)).backward(),
            &critic,
        );
        let parts = layerwise_grads(
            &critic,
            &critic.backbone,
            tokens.clone(),
            valid.clone(),
            &arch.rope,
            |h| v_loss(critic.values_of_hidden(h)),
        );
        assert_same_grads(
            &format!("critic, {what}"),
            summed(&critic, &[whole]),
            summed(&critic, &parts),
        );
    }
}

/// `trainer bench-ppo` runs the stage's whole step with adapters: each turn after the first
/// prefills only what it added (the last sampled token and the observation), the episodes
/// have the lengths asked for, the update scores what was sampled with the same
/// log-probabilities, and both losses are finite.
#[test]
fn the_ppo_step_bench_runs_the_stage_with_kept_caches() {
    let dir = tempfile::tempdir().unwrap();
    let shape = dir.path().join("shape.json");
    std::fs::write(
        &shape,
        r#"{"model_type":"qwen2","vocab_size":512,"hidden_size":16,"intermediate_size":32,
            "num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,
            "max_position_embeddings":256,"tie_word_embeddings":true}"#,
    )
    .unwrap();
    let (episodes, prompt, turns, new_tokens, context) = (2, 24, 3, 6, 96);
    let out = Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(["bench-ppo", "--device", "cpu", "--shape"])
        .arg(&shape)
        .args([
            "--lora-rank",
            "4",
            "--checkpointing",
            "--reference",
            "--steps",
            "1",
        ])
        .args(["--episodes", &episodes.to_string()])
        .args([
            "--prompt",
            &prompt.to_string(),
            "--turns",
            &turns.to_string(),
        ])
        .args(["--new-tokens", &new_tokens.to_string()])
        .args(["--context", &context.to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let observation = (context - prompt) / turns - new_tokens;
    assert_eq!(report["observation"], observation);
    let step = &report["steps"][0];
    let prefilled: Vec<u64> = serde_json::from_value(step["prefilled_per_turn"].clone()).unwrap();
    assert_eq!(prefilled[0], (episodes * prompt) as u64, "{report}");
    for p in &prefilled[1..] {
        assert_eq!(*p, (episodes * (observation + 1)) as u64, "{report}");
    }
    assert_eq!(step["sampled_tokens"], episodes * turns * new_tokens);
    assert_eq!(
        step["episode_tokens"],
        episodes * (prompt + turns * new_tokens + (turns - 1) * observation)
    );
    let gap = step["sampling_logprob_mismatch"].as_f64().unwrap();
    assert!(
        gap < 1e-4,
        "sampled and scored log-probabilities differ by {gap}"
    );
    for key in ["policy_loss", "value_loss"] {
        assert!(step[key].as_f64().unwrap().is_finite(), "{key}: {report}");
    }
}

/// `bench-ppo --schedule continuous`: turns of different lengths join the running batch as
/// their simulated tool calls are answered and leave it as they end; every episode still gets
/// all its turns, each turn after the first prefills only what it added, and the update
/// scores what was sampled with the same log-probabilities.
#[test]
fn the_ppo_step_bench_runs_turns_continuously() {
    let dir = tempfile::tempdir().unwrap();
    let shape = dir.path().join("shape.json");
    std::fs::write(
        &shape,
        r#"{"model_type":"qwen2","vocab_size":512,"hidden_size":16,"intermediate_size":32,
            "num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,
            "max_position_embeddings":256,"tie_word_embeddings":true}"#,
    )
    .unwrap();
    let (episodes, prompt, turns, new_tokens, context) = (3, 20, 4, 8, 120);
    let out = Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(["bench-ppo", "--device", "cpu", "--shape"])
        .arg(&shape)
        .args(["--lora-rank", "4", "--steps", "1"])
        .args(["--schedule", "continuous", "--env-latency-s", "0.02"])
        .args(["--turn-spread", "0.75"])
        .args(["--episodes", &episodes.to_string()])
        .args(["--prompt", &prompt.to_string()])
        .args(["--turns", &turns.to_string()])
        .args(["--new-tokens", &new_tokens.to_string()])
        .args(["--context", &context.to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["schedule"], "continuous");
    let observation = (context - prompt) / turns - new_tokens;
    let step = &report["steps"][0];
    let sampled = step["sampled_tokens"].as_u64().unwrap() as usize;
    // Turns of 2..=8 tokens: shorter than the longest some of the time.
    assert!(sampled >= episodes * turns * 2, "{report}");
    assert!(sampled < episodes * turns * new_tokens, "{report}");
    assert_eq!(
        step["episode_tokens"],
        episodes * (prompt + (turns - 1) * observation) + sampled
    );
    assert_eq!(
        step["prefilled_tokens"],
        episodes * prompt + episodes * (turns - 1) * (observation + 1)
    );
    let gap = step["sampling_logprob_mismatch"].as_f64().unwrap();
    assert!(
        gap < 1e-4,
        "sampled and scored log-probabilities differ by {gap}"
    );
}
