//! The training configuration (TOML). Every field has the CUDA Agent recipe's default, so an
//! empty file is a valid config; `trainer <stage> --help` lists the command-line overrides.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::chat::ChatTemplate;
use crate::error::TrainError;
use crate::model::{LoraSpec, LoraTarget};

/// The whole configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Which checkpoint to start from.
    pub model: ModelSection,
    /// Low-rank adapters instead of full-parameter training.
    pub lora: LoraSection,
    /// Where the environment servers are.
    pub server: ServerSection,
    /// How episodes are sampled.
    pub rollout: RolloutSection,
    /// Optimiser settings shared by the stages.
    pub optim: OptimSection,
    /// PPO (warm-up and multi-turn).
    pub ppo: PpoSection,
    /// Rejection-sampling fine-tuning.
    pub rft: RftSection,
    /// Value pre-training.
    pub value: ValueSection,
    /// Output, checkpoints, seed.
    pub run: RunSection,
}

/// The starting checkpoint.
#[derive(Default, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// A Hugging Face checkpoint directory (`config.json`, `tokenizer.json`, `*.safetensors`).
    pub path: Option<PathBuf>,
    /// Ignore the weights in `path` and start from seeded random ones of its shape.
    pub random_init: bool,
    /// Chat template; detected from `tokenizer_config.json` when unset.
    pub template: Option<ChatTemplate>,
}

/// Low-rank adapters (LoRA). With `rank` 0 every weight of the policy and the critic is
/// trained; otherwise the checkpoint's weights stay frozen, shared by the policy, the critic
/// and the KL term's reference (the base with adapters off), and only the adapters (f32) and
/// the critic's value head are trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraSection {
    /// Adapter rank (0: full-parameter training).
    pub rank: usize,
    /// The update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Dropout on the adapters' inputs while training.
    pub dropout: f64,
    /// Adapted projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
    /// `down_proj`).
    pub targets: Vec<LoraTarget>,
}

impl Default for LoraSection {
    fn default() -> Self {
        Self {
            rank: 0,
            alpha: 32.0,
            dropout: 0.0,
            targets: LoraTarget::ALL.to_vec(),
        }
    }
}

impl LoraSection {
    /// The adapters' shape, or `None` for full-parameter training.
    pub fn spec(&self) -> Result<Option<LoraSpec>, TrainError> {
        if self.rank == 0 {
            return Ok(None);
        }
        if self.targets.is_empty() {
            return Err(TrainError::Config(
                "lora.targets is empty: name at least one projection, or set lora.rank = 0".into(),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(TrainError::Config(format!(
                "lora.dropout is {}: it must be in [0, 1)",
                self.dropout
            )));
        }
        Ok(Some(LoraSpec {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            targets: self.targets.clone(),
        }))
    }
}

/// The environment servers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    /// Base URLs, or `dns+http://NAME:PORT` for every address a name resolves to (a headless
    /// Service); new episodes are spread across them round-robin and moved off servers that
    /// are gone or draining, and an episode stays on its server.
    pub urls: Vec<String>,
    /// Bearer key, if the servers want one.
    pub api_key: Option<String>,
    /// Per-request timeout (a final evaluation can take minutes).
    pub timeout_s: f64,
    /// Retries of a failed request (steps carry a request id, so a retry never runs twice).
    pub retries: u32,
    /// Requests in flight at once, over all servers.
    pub concurrency: usize,
    /// Seconds between resolutions of `dns+http` names.
    pub resolve_every_s: f64,
    /// Seconds a multi-turn episode whose reset every server refused for want of room (503
    /// `host_busy`, `at_capacity`; 429) keeps trying, while the rest of the batch runs and
    /// frees room; past it the episode fails (left out of training).
    pub room_wait_s: f64,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            urls: vec!["http://127.0.0.1:8080".into()],
            api_key: None,
            timeout_s: 900.0,
            retries: 3,
            concurrency: 64,
            resolve_every_s: 30.0,
            room_wait_s: 300.0,
        }
    }
}

/// How episodes are sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutSection {
    /// The task split to draw from.
    pub split: String,
    /// Explicit task ids (overrides `split` when non-empty).
    pub tasks: Vec<String>,
    /// Episodes per training step (the recipe's batch).
    pub batch: usize,
    /// Assistant turns per episode at most.
    pub max_turns: u32,
    /// Sampling temperature.
    pub temperature: f64,
    /// Nucleus mass.
    pub top_p: f64,
    /// Top-k (0: off).
    pub top_k: usize,
    /// Tokens per assistant turn at most.
    pub max_turn_tokens: usize,
    /// Context of a multi-turn episode, in tokens.
    pub context: usize,
    /// Context of a single-turn warm-up sample, in tokens.
    pub single_turn_context: usize,
    /// System prompt; the default one explains the tool-call format.
    pub system_prompt: Option<String>,
    /// Whether the tool schemas go into the system prompt (small models with short contexts
    /// may leave them out and describe the tools in `system_prompt`).
    pub tools_in_prompt: bool,
    /// Observation tokens kept per tool result (the middle of longer ones is cut).
    pub max_observation_tokens: usize,
    /// Reward for an episode the trainer had to close (context or turn limit).
    pub failure_reward: f32,
    /// Conversations sampled together in one batched generation.
    pub generation_batch: usize,
    /// Memory for live conversations' keys and values kept between turns, in GiB (each turn
    /// then prefills only what it added); past it, the least recently continued lose theirs.
    pub kv_cache_gib: f64,
}

impl Default for RolloutSection {
    fn default() -> Self {
        Self {
            split: "all".into(),
            tasks: Vec::new(),
            batch: 1024,
            max_turns: 150,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_turn_tokens: 8192,
            context: 131_072,
            single_turn_context: 32_768,
            system_prompt: None,
            tools_in_prompt: true,
            max_observation_tokens: 4096,
            failure_reward: -1.0,
            generation_batch: 32,
            kv_cache_gib: 16.0,
        }
    }
}

/// Learning-rate schedule shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Linear warm-up, then constant.
    Constant,
    /// Linear warm-up, then cosine decay to `min_lr_ratio`.
    Cosine,
}

/// Optimiser settings (AdamW).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimSection {
    /// Policy learning rate.
    pub actor_lr: f64,
    /// Critic learning rate.
    pub critic_lr: f64,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Global gradient-norm clip (0: off).
    pub grad_clip: f32,
    /// Linear warm-up steps of the schedule.
    pub warmup_steps: usize,
    /// Schedule after warm-up.
    pub schedule: Schedule,
    /// Floor of the cosine schedule, as a share of the peak.
    pub min_lr_ratio: f64,
    /// Sequences per forward/backward (gradients accumulate over a minibatch).
    pub micro_batch: usize,
    /// Keep only each decoder layer's input through a training pass and recompute the layer
    /// in the backward pass: activation memory of one layer instead of all, for about a third
    /// more compute. What long contexts on large models need.
    pub activation_checkpointing: bool,
}

impl Default for OptimSection {
    fn default() -> Self {
        Self {
            actor_lr: 3e-6,
            critic_lr: 6e-6,
            weight_decay: 0.0,
            grad_clip: 1.0,
            warmup_steps: 0,
            schedule: Schedule::Constant,
            min_lr_ratio: 0.1,
            micro_batch: 4,
            activation_checkpointing: false,
        }
    }
}

impl OptimSection {
    /// The learning rate at `step` of `total` for a peak of `peak`.
    pub fn lr_at(&self, peak: f64, step: usize, total: usize) -> f64 {
        if self.warmup_steps > 0 && step < self.warmup_steps {
            return peak * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.schedule {
            Schedule::Constant => peak,
            Schedule::Cosine => {
                let span = total.saturating_sub(self.warmup_steps).max(1) as f64;
                let t = ((step - self.warmup_steps.min(step)) as f64 / span).min(1.0);
                let floor = peak * self.min_lr_ratio;
                floor + (peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
            }
        }
    }
}

/// PPO settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PpoSection {
    /// Training steps (each: one batch of episodes, then the updates).
    pub steps: usize,
    /// Lower clip of the ratio (1 - low).
    pub clip_low: f32,
    /// Upper clip of the ratio (1 + high).
    pub clip_high: f32,
    /// Value clip around the rollout's values.
    pub value_clip: f32,
    /// GAE discount.
    pub gamma: f32,
    /// GAE lambda.
    pub lambda: f32,
    /// Weight of the value loss (c1).
    pub vf_coef: f32,
    /// Weight of the entropy bonus (c2).
    pub entropy_coef: f32,
    /// Weight of the KL penalty to the starting policy (0: off, no reference copy kept); with
    /// adapters, to the base (the adapters off), which costs no copy.
    pub kl_coef: f32,
    /// Passes over each batch.
    pub epochs: usize,
    /// Episodes per minibatch (one optimiser step each).
    pub minibatch: usize,
    /// Whiten advantages over the batch.
    pub normalize_advantages: bool,
    /// Warn when the mean entropy per token exceeds this (a run-away policy).
    pub entropy_warn: f64,
    /// Warn when the KL to the rollout policy exceeds this.
    pub kl_warn: f64,
}

impl Default for PpoSection {
    fn default() -> Self {
        Self {
            steps: 150,
            clip_low: 0.2,
            clip_high: 0.28,
            value_clip: 0.2,
            gamma: 1.0,
            lambda: 0.95,
            vf_coef: 1.0,
            entropy_coef: 0.0,
            kl_coef: 0.0,
            epochs: 1,
            minibatch: 256,
            normalize_advantages: true,
            entropy_warn: 4.0,
            kl_warn: 0.1,
        }
    }
}

/// Rejection-sampling fine-tuning settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RftSection {
    /// Keep trajectories whose reward is above this.
    pub min_reward: f32,
    /// Passes over the kept trajectories.
    pub epochs: usize,
    /// Trajectories per optimiser step.
    pub minibatch: usize,
    /// Learning rate (the actor's when unset).
    pub lr: Option<f64>,
    /// Episodes to roll out when no trajectory logs are given.
    pub rollouts: usize,
}

impl Default for RftSection {
    fn default() -> Self {
        Self {
            min_reward: 0.0,
            epochs: 1,
            minibatch: 64,
            lr: None,
            rollouts: 1024,
        }
    }
}

/// Value pre-training settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValueSection {
    /// Passes over the trajectories.
    pub epochs: usize,
    /// Trajectories per optimiser step.
    pub minibatch: usize,
}

impl Default for ValueSection {
    fn default() -> Self {
        Self {
            epochs: 1,
            minibatch: 64,
        }
    }
}

/// Output and bookkeeping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunSection {
    /// Directory for checkpoints, metrics and plots.
    pub out_dir: PathBuf,
    /// Save a checkpoint every this many steps (and at the end).
    pub checkpoint_every: usize,
    /// Step checkpoints kept per stage, newest first (0 keeps all); `final/` is never removed.
    pub keep_checkpoints: usize,
    /// Seed of weights, data order and sampling.
    pub seed: u64,
    /// Refuse to start a stage whose memory plan exceeds the device's free memory.
    pub check_memory: bool,
}

impl Default for RunSection {
    fn default() -> Self {
        Self {
            out_dir: "runs/default".into(),
            checkpoint_every: 10,
            keep_checkpoints: 3,
            seed: 0,
            check_memory: true,
        }
    }
}

impl TrainConfig {
    /// Reads a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, TrainError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| TrainError::Io(path.to_path_buf(), e))?;
        Self::from_toml(&text).map_err(|e| TrainError::InFile(path.to_path_buf(), Box::new(e)))
    }

    /// Parses TOML text.
    pub fn from_toml(text: &str) -> Result<Self, TrainError> {
        toml::from_str(text).map_err(TrainError::Toml)
    }

    /// The system prompt used for every conversation.
    pub fn system_prompt(&self) -> String {
        self.rollout
            .system_prompt
            .clone()
            .unwrap_or_else(|| DEFAULT_SYSTEM_PROMPT.to_string())
    }
}

/// The default system prompt: the agent's role and how to call tools.
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are a CUDA kernel engineer working in a sandboxed workspace. Follow SKILL.md: profile, implement, verify, tune. Act only through tool calls, one per turn, and call Submit when model_new.py is correct and fast.";
