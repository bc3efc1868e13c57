//! The memory plan of a training stage, made from the model's config before anything is
//! allocated: weights, adapters, gradients, optimiser moments, the training pass's activations
//! and the rollouts' KV cache. Printed at start; a plan larger than the device's free memory
//! stops the stage with what to change, instead of an out-of-memory error minutes in.

use std::fmt;

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::model::{LoraSpec, LoraTarget, ModelConfig};

/// Memory of the device a stage runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes free when the stage starts.
    pub free: u64,
    /// Bytes in all.
    pub total: u64,
    /// What it is ("GPU 0", "host").
    pub name: &'static str,
}

impl DeviceMemory {
    /// The host's memory (`MemAvailable` and `MemTotal` of `/proc/meminfo`), where readable.
    pub fn host() -> Option<Self> {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let field = |name: &str| -> Option<u64> {
            let line = text.lines().find(|l| l.starts_with(name))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        };
        Some(Self {
            free: field("MemAvailable:")?,
            total: field("MemTotal:")?,
            name: "host",
        })
    }
}

/// One line of the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanItem {
    /// What it holds.
    pub what: &'static str,
    /// Bytes.
    pub bytes: u64,
    /// How it was counted.
    pub how: String,
}

/// The estimated peak memory of a stage, by part.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    /// The parts.
    pub items: Vec<PlanItem>,
}

/// Parameters of the model.
pub fn param_count(c: &ModelConfig) -> u64 {
    let (d, hd, inner) = (
        c.hidden_size as u64,
        c.head_dim as u64,
        c.intermediate_size as u64,
    );
    let (h, kvh) = (c.num_attention_heads as u64, c.num_key_value_heads as u64);
    let qkv = d * (h + 2 * kvh) * hd + if c.qkv_bias { (h + 2 * kvh) * hd } else { 0 };
    let o = h * hd * d + if c.o_bias { d } else { 0 };
    let mlp = 3 * d * inner + if c.mlp_bias { 2 * inner + d } else { 0 };
    let layer = qkv + o + mlp + 2 * d;
    let embed = c.vocab_size as u64 * d;
    let head = if c.tie_word_embeddings { 0 } else { embed };
    embed + head + c.num_hidden_layers as u64 * layer + d
}

/// Parameters of one model's adapters.
pub fn adapter_param_count(c: &ModelConfig, spec: &LoraSpec) -> u64 {
    let (d, hd, inner) = (
        c.hidden_size as u64,
        c.head_dim as u64,
        c.intermediate_size as u64,
    );
    let (h, kvh) = (c.num_attention_heads as u64, c.num_key_value_heads as u64);
    let r = spec.rank as u64;
    let per_layer: u64 = spec
        .targets
        .iter()
        .map(|t| {
            let (d_in, d_out) = match t {
                LoraTarget::QProj => (d, h * hd),
                LoraTarget::KProj | LoraTarget::VProj => (d, kvh * hd),
                LoraTarget::OProj => (h * hd, d),
                LoraTarget::GateProj | LoraTarget::UpProj => (d, inner),
                LoraTarget::DownProj => (inner, d),
            };
            r * (d_in + d_out)
        })
        .sum();
    // A fused layer's parts share one input, but each part has an `A` of its own.
    c.num_hidden_layers as u64 * per_layer
}

const GIB: f64 = (1u64 << 30) as f64;

fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB
}

impl MemoryPlan {
    /// The plan of a stage training on sequences of up to `train_tokens` tokens, with floats
    /// of `element_bytes` bytes.
    pub fn new(
        model: &ModelConfig,
        cfg: &TrainConfig,
        element_bytes: usize,
        train_tokens: usize,
    ) -> Self {
        let elem = element_bytes as u64;
        let n = param_count(model);
        let (d, hd, inner) = (
            model.hidden_size as u64,
            model.head_dim as u64,
            model.intermediate_size as u64,
        );
        let (h, kvh, layers) = (
            model.num_attention_heads as u64,
            model.num_key_value_heads as u64,
            model.num_hidden_layers as u64,
        );
        let lora: Option<LoraSpec> = cfg.lora.spec().ok().flatten();
        let mut items = Vec::new();
        let value_head = d + 1;
        // What is trained, and at which precision its gradients and moments are kept.
        let (trained, trained_bytes) = match &lora {
            Some(spec) => {
                items.push(PlanItem {
                    what: "base weights",
                    bytes: n * elem,
                    how: format!(
                        "{:.2}B parameters x {elem} bytes, frozen, shared by policy, critic and reference",
                        n as f64 / 1e9
                    ),
                });
                let a = adapter_param_count(model, spec);
                items.push(PlanItem {
                    what: "adapters",
                    bytes: (2 * a + value_head) * 4,
                    how: format!(
                        "rank {} on {} projections: {:.1}M parameters x 2 (policy, critic) in f32",
                        spec.rank,
                        spec.targets.len(),
                        a as f64 / 1e6
                    ),
                });
                (2 * a + value_head, 4)
            }
            None => {
                let copies = if cfg.ppo.kl_coef > 0.0 { 3 } else { 2 };
                items.push(PlanItem {
                    what: "weights",
                    bytes: copies * n * elem,
                    how: format!(
                        "{:.2}B parameters x {elem} bytes x {copies} (policy, critic{})",
                        n as f64 / 1e9,
                        if copies == 3 { ", reference" } else { "" }
                    ),
                });
                (2 * n + value_head, elem)
            }
        };
        items.push(PlanItem {
            what: "gradients",
            bytes: 2 * trained * trained_bytes,
            how: "the accumulated sum and one micro-batch's, per trained parameter".into(),
        });
        items.push(PlanItem {
            what: "optimiser moments",
            bytes: 2 * trained * trained_bytes,
            how: "AdamW's two moments per trained parameter".into(),
        });
        let rows = cfg.optim.micro_batch.max(1) as u64;
        let t = train_tokens.max(1) as u64;
        // Tensors a decoder layer keeps for its backward pass, per token: the residual and
        // normalised inputs, q/k/v and the rotated q/k, the attention output, the MLP's
        // gate/up and product.
        let per_token_layer = 4 * d + (2 * h + 3 * kvh) * hd + h * hd + 3 * inner;
        let checkpointing = cfg.optim.activation_checkpointing;
        // With checkpointing: each layer's input, and one layer's tensors while it is
        // recomputed.
        let saved = if checkpointing {
            rows * t * (layers * d + per_token_layer) * elem
        } else {
            rows * t * layers * per_token_layer * elem
        };
        // Log-probabilities are taken in f32 over the vocabulary: logits, softmax, gradient.
        let vocab = rows * t * model.vocab_size as u64 * 4 * 3;
        items.push(PlanItem {
            what: "activations",
            bytes: saved + vocab,
            how: format!(
                "training pass: {rows} sequences x {t} tokens, {:.1} GiB kept by the layers{} + {:.1} GiB over the vocabulary",
                gib(saved),
                if checkpointing { " (checkpointed)" } else { "" },
                gib(vocab)
            ),
        });
        let scores = rows * h * t * t * 4;
        items.push(PlanItem {
            what: "attention scores",
            bytes: scores,
            how: "one layer's scores at a time, where attention materialises them".into(),
        });
        let per_token_kv = 2 * layers * kvh * hd * elem;
        let r = &cfg.rollout;
        // A batch's cache holds up to the growth step of free slots past its longest row.
        let slots = r.context as u64 + crate::model::cache::GROWTH as u64;
        let active = r.generation_batch.max(1) as u64 * slots * per_token_kv;
        let kept = ((r.kv_cache_gib * GIB) as u64)
            .min(r.batch.max(1) as u64 * r.context as u64 * per_token_kv);
        items.push(PlanItem {
            what: "KV cache",
            bytes: active + kept,
            how: format!(
                "rollouts: a batch of {} at up to {} tokens ({:.1} GiB) + kept conversations within rollout.kv_cache_gib ({:.1} GiB)",
                r.generation_batch,
                r.context,
                gib(active),
                gib(kept)
            ),
        });
        Self { items }
    }

    /// The whole plan, in bytes.
    pub fn total(&self) -> u64 {
        self.items.iter().map(|i| i.bytes).sum()
    }

    /// An error naming what to change when the plan does not fit `memory`'s free bytes.
    pub fn check(&self, memory: &DeviceMemory) -> Result<(), TrainError> {
        if self.total() <= memory.free {
            return Ok(());
        }
        let mut parts = self.items.clone();
        parts.sort_by_key(|i| std::cmp::Reverse(i.bytes));
        let largest: Vec<String> = parts
            .iter()
            .take(3)
            .map(|i| format!("{} {:.1} GiB", i.what, gib(i.bytes)))
            .collect();
        Err(TrainError::Config(format!(
            "the memory plan needs {:.1} GiB but {} has {:.1} GiB free ({:.1} GiB in all); the largest parts: {}. \
             Lower rollout.generation_batch, rollout.context or rollout.kv_cache_gib, or optim.micro_batch, \
             turn on optim.activation_checkpointing, or train adapters (lora.rank); run.check_memory = false starts anyway",
            gib(self.total()),
            memory.name,
            gib(memory.free),
            gib(memory.total),
            largest.join(", ")
        )))
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memory plan:")?;
        for i in &self.items {
            writeln!(f, "  {:<18} {:>8.2} GiB  {}", i.what, gib(i.bytes), i.how)?;
        }
        write!(f, "  {:<18} {:>8.2} GiB", "total", gib(self.total()))
    }
}
