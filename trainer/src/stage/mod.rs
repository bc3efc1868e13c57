//! The four training stages. A `Learner` holds what they share: the policy and critic with
//! their optimisers, the renderer, checkpoints and metrics of one stage's output directory.
//!
//! - `warmup`: single-turn PPO, reward from `POST /v1/evaluate` ([`ppo`]).
//! - `rft`: rejection-sampling fine-tuning on filtered trajectories ([`rft`]).
//! - `value-pretrain`: the critic on GAE targets of those trajectories ([`rft`]).
//! - `ppo`: multi-turn PPO against the server ([`ppo`]).

pub mod ppo;
pub mod rft;

use std::path::{Path, PathBuf};

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Int, Tensor, TensorData};
use env_api::{ResetOptions, ResetRequest};

use crate::checkpoint::{self, CheckpointFiles, StageState};
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::memory::{DeviceMemory, MemoryPlan};
use crate::metrics::MetricsLog;
use crate::model::recompute::layerwise_grads;
use crate::model::{Architecture, CausalLm, Critic, ModelConfig, SequenceStats};
use crate::optim::Trainable;
use crate::policy::{load_policy, PolicyGenerator};
use crate::render::Renderer;
use crate::sample::Sample;
use crate::tokenizer::TextTokenizer;

/// How a stage starts.
#[derive(Debug, Clone, Default)]
pub struct StageOptions {
    /// A checkpoint directory of an earlier stage (its `final/` or a `step-N/`) to start from.
    pub init: Option<PathBuf>,
    /// Continue from this stage's newest checkpoint.
    pub resume: bool,
    /// The device's memory, to check the stage's memory plan against (not checked if unknown).
    pub device_memory: Option<DeviceMemory>,
}

/// The policy, the critic, their optimisers and the bookkeeping of one stage.
pub struct Learner<B: AutodiffBackend> {
    /// The configuration.
    pub cfg: TrainConfig,
    /// Where tensors live.
    pub device: B::Device,
    /// The policy's architecture.
    pub model_config: ModelConfig,
    /// RoPE tables for training passes.
    pub arch: Architecture<B>,
    /// RoPE tables for sampling and scoring passes.
    pub infer_arch: Architecture<B::InnerBackend>,
    policy: Option<CausalLm<B>>,
    critic: Option<Critic<B>>,
    actor_opt: Trainable<B, CausalLm<B>>,
    critic_opt: Trainable<B, Critic<B>>,
    /// Conversation rendering.
    pub renderer: Renderer,
    /// Stage name.
    pub stage: String,
    /// `<out_dir>/<stage>`.
    pub stage_dir: PathBuf,
    /// Steps completed (restored by `--resume`).
    pub step: usize,
    /// The stage's metrics.
    pub metrics: MetricsLog,
}

impl<B: AutodiffBackend> Learner<B> {
    /// Loads the starting checkpoint, then `init` weights, then this stage's newest
    /// checkpoint when resuming; `context` sizes the RoPE tables.
    pub fn new(
        cfg: TrainConfig,
        stage: &str,
        opts: &StageOptions,
        context: usize,
        device: B::Device,
    ) -> Result<Self, TrainError> {
        // The plan first: a stage that cannot fit stops before it allocates anything.
        if let Some(dir) = &cfg.model.path {
            let model = ModelConfig::from_file(dir)?;
            let elem = <B::FloatElem as burn::tensor::Element>::dtype().size();
            let plan = MemoryPlan::new(&model, &cfg, elem, context);
            tracing::info!("{stage}: {plan}");
            if let (true, Some(memory)) = (cfg.run.check_memory, &opts.device_memory) {
                plan.check(memory)?;
            }
        }
        let loaded = load_policy::<B>(&cfg.model, cfg.run.seed, &device)?;
        let lora = cfg.lora.spec()?;
        let mut policy = loaded.lm;
        let init = opts.init.as_ref().map(CheckpointFiles::new);
        // A full-parameter checkpoint to start from replaces the weights (with adapters, it
        // becomes the frozen base).
        if let Some(files) = init.as_ref().filter(|f| f.policy().exists()) {
            policy = policy.load_record(&files.policy(), &device)?;
        }
        let mut critic = match &lora {
            Some(spec) => {
                policy = policy.with_adapters(spec);
                Critic::with_adapters(&policy, spec, &device)
            }
            None => Critic::from_policy(&policy, &device),
        };
        if let Some(files) = &init {
            if lora.is_some() {
                if files.policy_adapter().exists() {
                    policy = policy.load_adapter(&files.policy_adapter())?;
                }
                if files.critic_adapter().exists() {
                    critic = critic.load_adapter(&files.critic_adapter(), &device)?;
                }
            } else if files.policy_adapter().exists() {
                return Err(TrainError::Config(format!(
                    "{} holds adapters, not full weights: set lora.rank (and the targets) as the run that wrote it did",
                    files.dir.display()
                )));
            } else if files.critic().exists() {
                critic = critic.load_record(&files.critic(), &device)?;
            } else {
                // A policy-only checkpoint: the critic starts from the policy, as the recipe does.
                critic = Critic::from_policy(&policy, &device);
            }
        }
        let stage_dir = cfg.run.out_dir.join(stage);
        std::fs::create_dir_all(&stage_dir).map_err(|e| TrainError::Io(stage_dir.clone(), e))?;
        let mut actor_opt = Trainable::new(cfg.optim.weight_decay, cfg.optim.grad_clip);
        let mut critic_opt = Trainable::new(cfg.optim.weight_decay, cfg.optim.grad_clip);
        let mut step = 0;
        if opts.resume {
            match checkpoint::latest(&stage_dir)? {
                Some(files) => {
                    let state = files.read_state()?;
                    if state.stage != stage {
                        return Err(TrainError::Data(format!(
                            "{} holds a {} checkpoint, not {stage}",
                            files.dir.display(),
                            state.stage
                        )));
                    }
                    if lora.is_some() {
                        policy = policy.load_adapter(&files.policy_adapter())?;
                        critic = critic.load_adapter(&files.critic_adapter(), &device)?;
                    } else {
                        policy = policy.load_record(&files.policy(), &device)?;
                        critic = critic.load_record(&files.critic(), &device)?;
                    }
                    actor_opt = actor_opt.load(&files.actor_optim(), &policy, &device)?;
                    critic_opt = critic_opt.load(&files.critic_optim(), &critic, &device)?;
                    step = state.step;
                    tracing::info!(stage, step, dir = %files.dir.display(), "resumed");
                }
                None => {
                    tracing::warn!(stage, dir = %stage_dir.display(), "--resume: no checkpoint yet, starting fresh")
                }
            }
        }
        let metrics = MetricsLog::open(
            &stage_dir.join("metrics.jsonl"),
            opts.resume.then_some(step),
        )?;
        let max_pos = context.max(16);
        let arch = Architecture::new(loaded.config.clone(), max_pos, &device);
        let infer_arch = Architecture::new(loaded.config.clone(), max_pos, &device);
        let renderer = Renderer::new(
            loaded.template,
            loaded.tokenizer,
            cfg.system_prompt(),
            cfg.rollout.tools_in_prompt,
            cfg.rollout.max_observation_tokens,
            &loaded.config.eos_token_ids,
        )?;
        Ok(Self {
            cfg,
            device,
            model_config: loaded.config,
            arch,
            infer_arch,
            policy: Some(policy),
            critic: Some(critic),
            actor_opt,
            critic_opt,
            renderer,
            stage: stage.into(),
            stage_dir,
            step,
            metrics,
        })
    }

    /// The policy.
    pub fn policy(&self) -> &CausalLm<B> {
        present(&self.policy)
    }

    /// The critic.
    pub fn critic(&self) -> &Critic<B> {
        present(&self.critic)
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        self.renderer.tokenizer()
    }

    /// Adds the policy loss `loss` makes of the statistics of one micro-batch of `tokens`:
    /// one backward pass, or layer by layer with `optim.activation_checkpointing`.
    pub fn policy_backward_stats(
        &mut self,
        tokens: Tensor<B, 2, Int>,
        valid: Tensor<B, 2, Bool>,
        temperature: f64,
        loss: impl FnOnce(SequenceStats<B>) -> Tensor<B, 1>,
    ) {
        let p = present(&self.policy);
        if self.cfg.optim.activation_checkpointing {
            let parts = layerwise_grads(
                p,
                &p.backbone,
                tokens.clone(),
                valid,
                &self.arch.rope,
                |h| loss(p.stats_of_hidden(h, tokens, temperature)),
            );
            self.actor_opt.backward_parts(p, parts);
        } else {
            let stats = p.sequence_stats(tokens, valid, &self.arch, temperature);
            self.actor_opt.backward(p, loss(stats));
        }
    }

    /// Adds the critic loss `loss` makes of the values `[batch, seq]` of one micro-batch of
    /// `tokens`: one backward pass, or layer by layer with `optim.activation_checkpointing`.
    pub fn critic_backward_values(
        &mut self,
        tokens: Tensor<B, 2, Int>,
        valid: Tensor<B, 2, Bool>,
        loss: impl FnOnce(Tensor<B, 2>) -> Tensor<B, 1>,
    ) {
        let c = present(&self.critic);
        if self.cfg.optim.activation_checkpointing {
            let parts = layerwise_grads(c, &c.backbone, tokens, valid, &self.arch.rope, |h| {
                loss(c.values_of_hidden(h))
            });
            self.critic_opt.backward_parts(c, parts);
        } else {
            let values = c.values(tokens, valid, &self.arch);
            self.critic_opt.backward(c, loss(values));
        }
    }

    /// Applies the policy's accumulated gradients; returns the gradient norm.
    pub fn policy_step(&mut self, lr: f64) -> Option<f32> {
        let (p, norm) = self.actor_opt.step(lr, take_present(&mut self.policy));
        self.policy = Some(p);
        norm
    }

    /// Applies the critic's accumulated gradients; returns the gradient norm.
    pub fn critic_step(&mut self, lr: f64) -> Option<f32> {
        let (c, norm) = self.critic_opt.step(lr, take_present(&mut self.critic));
        self.critic = Some(c);
        norm
    }

    /// The policy on the inference backend, as a rollout generator.
    pub fn generator<'a>(
        &'a self,
        lm: &'a CausalLm<B::InnerBackend>,
    ) -> PolicyGenerator<'a, B::InnerBackend> {
        PolicyGenerator::new(
            lm,
            &self.infer_arch,
            self.renderer.tokenizer(),
            self.device.clone(),
            (self.cfg.rollout.kv_cache_gib * (1u64 << 30) as f64) as u64,
        )
    }

    /// Writes a checkpoint of the current step.
    pub fn save_checkpoint(&self, total_steps: usize) -> Result<PathBuf, TrainError> {
        let state = StageState {
            stage: self.stage.clone(),
            step: self.step,
            total_steps,
            seed: self.cfg.run.seed,
        };
        let dir = checkpoint::save(&self.stage_dir, &state, |f| {
            self.save_weights(f)?;
            self.actor_opt.save(&f.actor_optim())?;
            self.critic_opt.save(&f.critic_optim())?;
            Ok(())
        })?;
        checkpoint::prune(&self.stage_dir, self.cfg.run.keep_checkpoints)?;
        Ok(dir)
    }

    /// The policy's and the critic's weights: their records, or with adapters the adapters
    /// alone (the base is the starting checkpoint).
    fn save_weights(&self, files: &CheckpointFiles) -> Result<(), TrainError> {
        if let Some(spec) = self.cfg.lora.spec()? {
            self.policy().save_adapter(&files.policy_adapter())?;
            self.critic().save_adapter(&files.critic_adapter())?;
            // The adapters' shape beside them, so that the checkpoint alone can be served.
            let path = files.adapter_config();
            let text =
                serde_json::to_string_pretty(&spec.peft_config(self.cfg.model.path.as_deref()))
                    .map_err(|e| TrainError::Json(path.clone(), e))?;
            std::fs::write(&path, text).map_err(|e| TrainError::Io(path, e))?;
        } else {
            self.policy().save_record(&files.policy())?;
            self.critic().save_record(&files.critic())?;
        }
        Ok(())
    }

    /// Writes `<stage>/final/`: the policy and critic weights as a step checkpoint holds them,
    /// the policy as a Hugging Face checkpoint with its tokenizer under `final/hf/` (adapters
    /// merged), and with adapters the policy's as a PEFT adapter under `final/adapter/`.
    pub fn save_final(&self) -> Result<PathBuf, TrainError> {
        // Written like a step checkpoint: a crash leaves the old `final/` or the new one whole.
        checkpoint::publish(&self.stage_dir, "final", |files| {
            self.save_weights(files)?;
            if let Some(spec) = self.cfg.lora.spec()? {
                self.policy().save_peft(
                    &spec,
                    self.cfg.model.path.as_deref(),
                    &files.dir.join("adapter"),
                )?;
            }
            let hf = files.dir.join("hf");
            let merged;
            let exported = if self.policy().has_adapters() {
                merged = self.policy().merged();
                &merged
            } else {
                self.policy()
            };
            exported.save_pretrained(&self.model_config, &hf)?;
            if let Some(src) = &self.cfg.model.path {
                for name in ["tokenizer.json", "tokenizer_config.json"] {
                    let from = src.join(name);
                    if from.exists() {
                        std::fs::copy(&from, hf.join(name))
                            .map_err(|e| TrainError::Io(from.clone(), e))?;
                    }
                }
            }
            Ok(())
        })
    }

    /// Whether step `self.step` is due a checkpoint.
    pub fn checkpoint_due(&self, total_steps: usize) -> bool {
        let every = self.cfg.run.checkpoint_every;
        self.step == total_steps || (every > 0 && self.step.is_multiple_of(every))
    }

    /// Reset requests of training step `step`: explicit tasks in turn, else seeded draws from
    /// the split (so a resumed run draws the same tasks).
    pub fn resets_for(&self, step: usize, n: usize) -> Vec<ResetRequest> {
        let r = &self.cfg.rollout;
        let options = Some(ResetOptions {
            max_turns: Some(r.max_turns),
            time_budget_s: None,
        });
        (0..n)
            .map(|k| {
                if r.tasks.is_empty() {
                    ResetRequest {
                        split: Some(r.split.clone()),
                        seed: Some(seed_of(self.cfg.run.seed, step as u64, k as u64)),
                        options: options.clone(),
                        ..Default::default()
                    }
                } else {
                    ResetRequest {
                        task: Some(
                            r.tasks[step.wrapping_mul(n).wrapping_add(k) % r.tasks.len()].clone(),
                        ),
                        options: options.clone(),
                        ..Default::default()
                    }
                }
            })
            .collect()
    }
}

/// The model in a learner's slot. The slots are options only so that an optimiser step can
/// take the model by value: `policy_step` and `critic_step` empty their slot and fill it again
/// before they return, so between calls (everywhere this is used) the model is there.
#[allow(
    clippy::expect_used,
    reason = "only policy_step and critic_step empty a slot, and each refills it before returning"
)]
fn present<T>(slot: &Option<T>) -> &T {
    slot.as_ref()
        .expect("the model is in its slot between steps")
}

/// The model out of a learner's slot, for an optimiser step that puts it back.
#[allow(
    clippy::expect_used,
    reason = "only policy_step and critic_step empty a slot, and each refills it before returning"
)]
fn take_present<T>(slot: &mut Option<T>) -> T {
    slot.take().expect("the model is in its slot between steps")
}

pub use crate::seeds::{derive as seed_of, permutation};

/// Right-padded token tensors of some samples, and the loss mask aligned with next-token
/// statistics (`[rows, width - 1]`, 1.0 on the policy's tokens).
pub struct TokenBatch<B: Backend> {
    /// `[rows, width]`.
    pub tokens: Tensor<B, 2, Int>,
    /// `[rows, width]`, true on real tokens.
    pub valid: Tensor<B, 2, Bool>,
    /// `[rows, width - 1]`.
    pub mask: Tensor<B, 2>,
    /// Longest sample.
    pub width: usize,
    /// Length of each sample.
    pub lengths: Vec<usize>,
}

impl<B: Backend> TokenBatch<B> {
    /// Packs `samples` (each at least two tokens long).
    pub fn new(samples: &[&Sample], device: &B::Device) -> Self {
        let width = samples
            .iter()
            .map(|s| s.tokens.len())
            .max()
            .unwrap_or(2)
            .max(2);
        let rows = samples.len();
        let mut ids = Vec::with_capacity(rows * width);
        let mut valid = Vec::with_capacity(rows * width);
        let mut mask = Vec::with_capacity(rows * (width - 1));
        for s in samples {
            let pad = width - s.tokens.len();
            ids.extend(
                s.tokens
                    .iter()
                    .map(|&t| t as i32)
                    .chain(std::iter::repeat_n(0, pad)),
            );
            valid.extend(
                std::iter::repeat_n(true, s.tokens.len()).chain(std::iter::repeat_n(false, pad)),
            );
            let m = s.shifted_mask();
            let mpad = width - 1 - m.len();
            mask.extend(
                m.iter()
                    .map(|&b| if b { 1.0f32 } else { 0.0 })
                    .chain(std::iter::repeat_n(0.0, mpad)),
            );
        }
        Self {
            tokens: Tensor::from_data(TensorData::new(ids, [rows, width]), device),
            valid: Tensor::from_data(TensorData::new(valid, [rows, width]), device),
            mask: Tensor::from_data(TensorData::new(mask, [rows, width - 1]), device),
            width,
            lengths: samples.iter().map(|s| s.tokens.len()).collect(),
        }
    }

    /// A `[rows, width - 1]` tensor from per-sample shifted rows (zero padded).
    pub fn shifted(&self, rows: &[&[f32]], device: &B::Device) -> Tensor<B, 2> {
        let w = self.width - 1;
        let mut data = Vec::with_capacity(rows.len() * w);
        for r in rows {
            data.extend(
                r.iter()
                    .copied()
                    .chain(std::iter::repeat_n(0.0, w - r.len())),
            );
        }
        Tensor::from_data(TensorData::new(data, [rows.len(), w]), device)
    }

    /// Splits a `[rows, width - 1]` tensor back into per-sample rows of length `len - 1`.
    pub fn unpack(&self, t: Tensor<B, 2>) -> Vec<Vec<f32>> {
        let w = self.width - 1;
        let host: Vec<f32> = t.into_data().convert::<f32>().to_vec().unwrap_or_default();
        self.lengths
            .iter()
            .enumerate()
            .map(|(r, &len)| host[r * w..r * w + len - 1].to_vec())
            .collect()
    }
}

/// Samples that can be trained on: finished or closed, with at least one policy token.
pub fn trainable(samples: Vec<Sample>) -> Vec<Sample> {
    samples
        .into_iter()
        .filter(|s| s.usable() && s.tokens.len() >= 2)
        .collect()
}

/// Mean of a module-free scalar.
pub(crate) fn scalar<B: Backend>(t: Tensor<B, 1>) -> f64 {
    use burn::tensor::ElementConversion;
    t.into_scalar().elem::<f64>()
}

/// The inference copy of a module.
pub(crate) fn inference<B: AutodiffBackend, M: AutodiffModule<B>>(m: &M) -> M::InnerModule {
    m.valid()
}

/// Checks that a path given on the command line exists.
pub fn require_dir(p: &Path) -> Result<(), TrainError> {
    if p.is_dir() {
        Ok(())
    } else {
        Err(TrainError::Data(format!(
            "{} is not a directory",
            p.display()
        )))
    }
}
