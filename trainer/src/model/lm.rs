//! The policy (a causal LM head on the backbone) and the critic (a scalar value head).

use std::path::Path;

use burn::module::{Module, Param, ParamId};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::{backend::Backend, Bool, Int, Tensor, TensorData};

use super::cache::KvCache;
use super::config::ModelConfig;
use super::lora::LoraSpec;
use super::rope::RopeTables;
use super::transformer::{Backbone, Dense};
use super::vocab::token_stats;
use super::weights::{read_safetensors, write_safetensors, NamedTensors, WeightMap};
use crate::error::ModelError;

/// What every forward pass needs besides the weights: the config and the RoPE tables.
#[derive(Debug, Clone)]
pub struct Architecture<B: Backend> {
    /// The architecture.
    pub config: ModelConfig,
    /// cos/sin tables up to the context length.
    pub rope: RopeTables<B>,
}

impl<B: Backend> Architecture<B> {
    /// Tables for `max_positions` positions (capped at the config's maximum).
    pub fn new(config: ModelConfig, max_positions: usize, device: &B::Device) -> Self {
        let n = max_positions.max(1);
        let rope = RopeTables::new(&config, n, device);
        Self { config, rope }
    }
}

/// A causal language model: backbone plus output projection (tied when `lm_head` is `None`).
#[derive(Module, Debug)]
pub struct CausalLm<B: Backend> {
    /// The decoder.
    pub backbone: Backbone<B>,
    /// Untied output projection `[hidden, vocab]`.
    pub lm_head: Option<Dense<B>>,
}

/// Per-token statistics of given sequences under the policy.
pub struct SequenceStats<B: Backend> {
    /// `[batch, seq - 1]`: log p(token t+1 | tokens ..= t).
    pub logprobs: Tensor<B, 2>,
    /// `[batch, seq - 1]`: entropy of the next-token distribution at t.
    pub entropy: Tensor<B, 2>,
}

impl<B: Backend> CausalLm<B> {
    /// Random weights of the given shape.
    pub fn random(cfg: &ModelConfig, device: &B::Device) -> Self {
        Self {
            backbone: Backbone::random(cfg, device),
            lm_head: (!cfg.tie_word_embeddings)
                .then(|| Dense::random(cfg.hidden_size, cfg.vocab_size, false, 0.02, device)),
        }
    }

    /// Loads a Hugging Face checkpoint directory (`config.json` + `*.safetensors`).
    pub fn from_pretrained(
        dir: &Path,
        device: &B::Device,
    ) -> Result<(ModelConfig, Self), ModelError> {
        let cfg = ModelConfig::from_file(dir)?;
        let mut w = WeightMap::from_dir(dir)?;
        let backbone = w.backbone(&cfg, device)?;
        let lm_head = w.lm_head(&cfg, device)?;
        Ok((cfg, Self { backbone, lm_head }))
    }

    /// Logits `[batch, seq, vocab]` from final hidden states.
    pub fn project(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => {
                let [b, t, d] = hidden.dims();
                let e = self.backbone.embed_tokens.val();
                let v = e.dims()[0];
                hidden
                    .reshape([b * t, d])
                    .matmul(e.transpose())
                    .reshape([b, t, v])
            }
        }
    }

    /// Logits of positions given as rows: `[rows, hidden]` to `[rows, vocab]`. The logits
    /// stay a matrix: the product's output rows may be padded for alignment, and reshaping
    /// such a `[batch, seq, vocab]` tensor copies it (4.6 ms for 8k rows of Qwen2.5's vocabulary,
    /// measured on an H200).
    pub fn project_rows(&self, hidden: Tensor<B, 2>) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => hidden.matmul(self.backbone.embed_tokens.val().transpose()),
        }
    }

    /// Logits of `tokens`, optionally continuing a KV cache.
    pub fn forward(
        &self,
        tokens: Tensor<B, 2, Int>,
        valid: Tensor<B, 2, Bool>,
        arch: &Architecture<B>,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        self.project(self.backbone.forward(tokens, valid, &arch.rope, cache))
    }

    /// Bytes per element of the weights, and so of the keys and values it caches.
    pub fn element_bytes(&self) -> usize {
        self.backbone.embed_tokens.val().dtype().size()
    }

    /// Logits `[batch, vocab]` of the last position only, continuing a KV cache: what
    /// decoding needs (projecting every prompt position onto the vocabulary would cost
    /// `prompt_len` times more).
    pub fn forward_last(
        &self,
        tokens: Tensor<B, 2, Int>,
        valid: Tensor<B, 2, Bool>,
        arch: &Architecture<B>,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 2> {
        let hidden = self.backbone.forward(tokens, valid, &arch.rope, cache);
        let [b, t, _] = hidden.dims();
        let logits = self.project(hidden.narrow(1, t - 1, 1));
        let vocab = logits.dims()[2];
        logits.reshape([b, vocab])
    }

    /// Log-probabilities and entropies of each next token of `tokens`, with logits divided
    /// by `temperature` (the sampling temperature, so PPO ratios compare like with like).
    pub fn sequence_stats(
        &self,
        tokens: Tensor<B, 2, Int>,
        valid: Tensor<B, 2, Bool>,
        arch: &Architecture<B>,
        temperature: f64,
    ) -> SequenceStats<B> {
        let hidden = self
            .backbone
            .forward(tokens.clone(), valid, &arch.rope, None);
        self.stats_of_hidden(hidden, tokens, temperature)
    }

    /// [`Self::sequence_stats`] from the backbone's final hidden states `[batch, seq, hidden]`.
    pub fn stats_of_hidden(
        &self,
        hidden: Tensor<B, 3>,
        tokens: Tensor<B, 2, Int>,
        temperature: f64,
    ) -> SequenceStats<B> {
        let [b, t] = tokens.dims();
        // The last position predicts nothing here: cut it before the vocabulary-wide projection.
        let hidden = hidden.narrow(1, 0, t - 1);
        // Log-probabilities in f32 whatever the model's precision, as sampling computes them.
        let d = hidden.dims()[2];
        let logits = self.project_rows(hidden.reshape([b * (t - 1), d]));
        let targets = tokens.narrow(1, 1, t - 1).reshape([b * (t - 1)]);
        let stats = token_stats(logits, targets, temperature);
        let logprobs = stats.clone().narrow(1, 0, 1).reshape([b, t - 1]);
        let entropy = stats.narrow(1, 1, 1).reshape([b, t - 1]);
        // Back to the model's precision, which every tensor they meet in the losses has.
        let dtype = self.backbone.embed_tokens.val().dtype();
        SequenceStats {
            logprobs: logprobs.cast(dtype),
            entropy: entropy.cast(dtype),
        }
    }

    /// Writes the weights as a Hugging Face checkpoint (`config.json` + `model.safetensors`),
    /// loadable by `from_pretrained` and by `transformers`.
    pub fn save_pretrained(&self, cfg: &ModelConfig, dir: &Path) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::Io(dir.to_path_buf(), e))?;
        let cfg_path = dir.join("config.json");
        let text = serde_json::to_string_pretty(&cfg.to_hf_json()).map_err(ModelError::Json)?;
        std::fs::write(&cfg_path, text).map_err(|e| ModelError::Io(cfg_path, e))?;
        let mut out = Vec::new();
        self.backbone.export("model", &mut out);
        if let Some(head) = &self.lm_head {
            head.export("lm_head", &mut out);
        }
        write_safetensors(&dir.join("model.safetensors"), &out)
    }

    /// Saves the exact burn record (full precision).
    pub fn save_record(&self, path: &Path) -> Result<(), ModelError> {
        save_record(self, path)
    }

    /// The model with the PEFT adapter directory `dir` (written by [`Self::save_peft`] or by
    /// PEFT) on it.
    pub fn with_peft(self, dir: &Path) -> Result<Self, ModelError> {
        let spec = LoraSpec::from_peft_config(&dir.join("adapter_config.json"))?;
        self.with_adapters(&spec)
            .load_adapter(&dir.join("adapter_model.safetensors"))
    }

    /// The model with every weight frozen and fresh adapters (see [`Backbone::with_adapters`]).
    pub fn with_adapters(self, spec: &LoraSpec) -> Self {
        Self {
            backbone: self.backbone.with_adapters(spec, POLICY_ADAPTERS),
            lm_head: self.lm_head.map(Module::no_grad),
        }
    }

    /// Whether the model carries adapters.
    pub fn has_adapters(&self) -> bool {
        self.backbone.has_adapters()
    }

    /// The base model: a copy without adapters, sharing the weights.
    pub fn without_adapters(&self) -> Self {
        Self {
            backbone: self.backbone.without_adapters(),
            lm_head: self.lm_head.clone(),
        }
    }

    /// A copy with the adapters merged into the weights.
    pub fn merged(&self) -> Self {
        Self {
            backbone: self.backbone.merged(),
            lm_head: self.lm_head.clone(),
        }
    }

    /// Writes the adapters alone, in f32, named as PEFT names them.
    pub fn save_adapter(&self, path: &Path) -> Result<(), ModelError> {
        write_safetensors(path, &self.backbone.adapter_tensors(PEFT_PREFIX))
    }

    /// Loads adapters written by [`Self::save_adapter`] (or by PEFT) into this model's
    /// adapters; every adapter must be in the file, and nothing else may be.
    pub fn load_adapter(self, path: &Path) -> Result<Self, ModelError> {
        let mut tensors = read_safetensors(path)?;
        let backbone = self
            .backbone
            .load_adapter_tensors(PEFT_PREFIX, &mut tensors)?;
        no_leftovers(path, &tensors)?;
        Ok(Self {
            backbone,
            lm_head: self.lm_head,
        })
    }

    /// Writes the adapters as a PEFT adapter directory (`adapter_config.json` and
    /// `adapter_model.safetensors`), which `peft.PeftModel.from_pretrained` loads onto the base
    /// checkpoint `base` names (and [`Self::with_peft`] here).
    pub fn save_peft(
        &self,
        spec: &LoraSpec,
        base: Option<&Path>,
        dir: &Path,
    ) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::Io(dir.to_path_buf(), e))?;
        self.save_adapter(&dir.join("adapter_model.safetensors"))?;
        let config = spec.peft_config(base);
        let path = dir.join("adapter_config.json");
        let text = serde_json::to_string_pretty(&config).map_err(ModelError::Json)?;
        std::fs::write(&path, text).map_err(|e| ModelError::Io(path, e))
    }

    /// Loads a record saved by `save_record` into a model of the same shape.
    pub fn load_record(self, path: &Path, device: &B::Device) -> Result<Self, ModelError> {
        load_record(self, path, device)
    }
}

/// The value model: the same backbone with a scalar head per token.
#[derive(Module, Debug)]
pub struct Critic<B: Backend> {
    /// The decoder.
    pub backbone: Backbone<B>,
    /// `[hidden, 1]`.
    pub value_head: Dense<B>,
}

impl<B: Backend> Critic<B> {
    /// A critic whose backbone starts as a copy of the policy's (the recipe's initialisation)
    /// and whose head starts at zero, so initial values are 0.
    pub fn from_policy(policy: &CausalLm<B>, device: &B::Device) -> Self {
        Self {
            backbone: policy.backbone.clone(),
            value_head: zero_value_head(policy, device),
        }
    }

    /// A critic on the policy's frozen base (shared, not copied) with adapters of its own and
    /// a zero value head: with adapters, one base serves the policy, the critic and the
    /// reference.
    pub fn with_adapters(policy: &CausalLm<B>, spec: &LoraSpec, device: &B::Device) -> Self {
        Self {
            backbone: policy
                .backbone
                .without_adapters()
                .with_adapters(spec, CRITIC_ADAPTERS),
            value_head: zero_value_head(policy, device),
        }
    }

    /// Whether the critic carries adapters.
    pub fn has_adapters(&self) -> bool {
        self.backbone.has_adapters()
    }

    /// Writes the adapters and the value head alone, in f32.
    pub fn save_adapter(&self, path: &Path) -> Result<(), ModelError> {
        let mut tensors = self.backbone.adapter_tensors(PEFT_PREFIX);
        let mut head = Vec::new();
        self.value_head.export("value_head", &mut head);
        tensors.extend(head);
        write_safetensors(path, &tensors)
    }

    /// Loads what [`Self::save_adapter`] wrote (parameter ids stay).
    pub fn load_adapter(self, path: &Path, device: &B::Device) -> Result<Self, ModelError> {
        let mut tensors = read_safetensors(path)?;
        let backbone = self
            .backbone
            .load_adapter_tensors(PEFT_PREFIX, &mut tensors)?;
        let mut value_head = self.value_head;
        let d = value_head.weight.dims()[0];
        let dtype = value_head.weight.val().dtype();
        let mut take = |name: &str, shape: Vec<usize>| {
            let (s, data) = tensors
                .remove(name)
                .ok_or_else(|| ModelError::Weights(format!("{} lacks {name}", path.display())))?;
            if s != shape {
                return Err(ModelError::Weights(format!(
                    "{name}: shape {s:?}, the critic expects {shape:?}"
                )));
            }
            Ok(TensorData::new(data, s))
        };
        // Saved `[1, hidden]` (Hugging Face's layout); a `[hidden, 1]` column holds the same
        // values in the same order.
        let w = take("value_head.weight", vec![1, d])?;
        let w = Tensor::<B, 2>::from_data(
            TensorData::new(w.to_vec::<f32>().unwrap_or_default(), [d, 1]),
            (device, dtype),
        );
        value_head.weight = Param::initialized(value_head.weight.id, w.require_grad());
        if let Some(b) = value_head.bias.as_mut() {
            let v = Tensor::<B, 1>::from_data(take("value_head.bias", vec![1])?, (device, dtype));
            *b = Param::initialized(b.id, v.require_grad());
        }
        no_leftovers(path, &tensors)?;
        Ok(Self {
            backbone,
            value_head,
        })
    }

    /// Values `[batch, seq]`, one per token position.
    pub fn values(
        &self,
        tokens: Tensor<B, 2, Int>,
        valid: Tensor<B, 2, Bool>,
        arch: &Architecture<B>,
    ) -> Tensor<B, 2> {
        self.values_of_hidden(self.backbone.forward(tokens, valid, &arch.rope, None))
    }

    /// [`Self::values`] from the backbone's final hidden states `[batch, seq, hidden]`.
    pub fn values_of_hidden(&self, hidden: Tensor<B, 3>) -> Tensor<B, 2> {
        let [b, t, _] = hidden.dims();
        self.value_head.forward(hidden).reshape([b, t])
    }

    /// Saves the exact burn record.
    pub fn save_record(&self, path: &Path) -> Result<(), ModelError> {
        save_record(self, path)
    }

    /// Loads a record saved by `save_record`.
    pub fn load_record(self, path: &Path, device: &B::Device) -> Result<Self, ModelError> {
        load_record(self, path, device)
    }
}

/// Where adapter tensors live in PEFT's naming of a causal LM (`base_model.model.` before the
/// model's own `model.layers...`).
const PEFT_PREFIX: &str = "base_model.model.model";

/// Tags keeping the policy's and the critic's adapter parameter ids apart.
const POLICY_ADAPTERS: u64 = 0x706f_6c69_6379;
const CRITIC_ADAPTERS: u64 = 0x6372_6974_6963;

/// A `[hidden, 1]` value head at zero, with parameter ids that are the same in every run (an
/// adapter-only checkpoint restores the head's values, and its optimiser state by these ids).
fn zero_value_head<B: Backend>(policy: &CausalLm<B>, device: &B::Device) -> Dense<B> {
    let d = policy.backbone.norm.weight.dims()[0];
    let mut head = Dense::random(d, 1, true, 0.0, device);
    head.weight = Param::initialized(
        ParamId::from(CRITIC_ADAPTERS ^ 1),
        Tensor::zeros([d, 1], device).require_grad(),
    );
    if let Some(b) = head.bias.as_mut() {
        *b = Param::initialized(ParamId::from(CRITIC_ADAPTERS ^ 2), b.val());
    }
    head
}

/// An adapter file holding tensors the model has no place for is the wrong file.
fn no_leftovers(path: &Path, tensors: &NamedTensors) -> Result<(), ModelError> {
    let mut names: Vec<&String> = tensors.keys().collect();
    if names.is_empty() {
        return Ok(());
    }
    names.sort();
    Err(ModelError::Weights(format!(
        "{} holds tensors this model's adapters have no place for (another rank or targets?): {}",
        path.display(),
        names
            .iter()
            .take(4)
            .map(|n| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// Saves any module as an exact full-precision burn record.
fn save_record<B: Backend, M: Module<B>>(module: &M, path: &Path) -> Result<(), ModelError> {
    module
        .clone()
        .save_file(
            path.to_path_buf(),
            &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
        )
        .map_err(|e| ModelError::Record(path.to_path_buf(), e))
}

/// Loads a record written by `save_record` into a module of the same shape.
fn load_record<B: Backend, M: Module<B>>(
    module: M,
    path: &Path,
    device: &B::Device,
) -> Result<M, ModelError> {
    module
        .load_file(
            path.to_path_buf(),
            &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
            device,
        )
        .map_err(|e| ModelError::Record(path.to_path_buf(), e))
}

type Named = Vec<(String, Vec<usize>, Vec<f32>)>;

/// A tensor's shape and values as f32 (for export).
pub(crate) fn tensor_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> (Vec<usize>, Vec<f32>) {
    let shape = t.dims().to_vec();
    let data = t
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap_or_default();
    (shape, data)
}

impl<B: Backend> Dense<B> {
    fn export(&self, prefix: &str, out: &mut Named) {
        export_dense(
            prefix,
            self.weight.val(),
            self.bias.as_ref().map(|b| b.val()),
            out,
        );
    }
}

/// One layer in Hugging Face's layout: `[out, in]` weight, optional bias.
fn export_dense<B: Backend>(
    prefix: &str,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    out: &mut Named,
) {
    let (s, d) = tensor_f32(weight.transpose());
    out.push((format!("{prefix}.weight"), s, d));
    if let Some(b) = bias {
        let (s, d) = tensor_f32(b);
        out.push((format!("{prefix}.bias"), s, d));
    }
}

impl<B: Backend> Backbone<B> {
    fn export(&self, prefix: &str, out: &mut Named) {
        let (s, d) = tensor_f32(self.embed_tokens.val());
        out.push((format!("{prefix}.embed_tokens.weight"), s, d));
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("{prefix}.layers.{i}");
            let (s, d) = tensor_f32(l.input_layernorm.weight.val());
            out.push((format!("{p}.input_layernorm.weight"), s, d));
            let (s, d) = tensor_f32(l.post_attention_layernorm.weight.val());
            out.push((format!("{p}.post_attention_layernorm.weight"), s, d));
            let qkv = l.self_attn.qkv_proj.split(&l.self_attn.qkv_widths());
            for ((w, b), name) in qkv.into_iter().zip(["q_proj", "k_proj", "v_proj"]) {
                export_dense(&format!("{p}.self_attn.{name}"), w, b, out);
            }
            l.self_attn
                .o_proj
                .export(&format!("{p}.self_attn.o_proj"), out);
            let inner = l.mlp.down_proj.weight.dims()[0];
            for ((w, b), name) in l
                .mlp
                .gate_up_proj
                .split(&[inner, inner])
                .into_iter()
                .zip(["gate_proj", "up_proj"])
            {
                export_dense(&format!("{p}.mlp.{name}"), w, b, out);
            }
            l.mlp.down_proj.export(&format!("{p}.mlp.down_proj"), out);
        }
        let (s, d) = tensor_f32(self.norm.weight.val());
        out.push((format!("{prefix}.norm.weight"), s, d));
    }
}
