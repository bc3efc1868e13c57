//! The architecture description read from a Hugging Face `config.json`.

use serde::{Deserialize, Serialize};
use std::path::Path;

use crate::error::ModelError;

/// How rotary position frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// Positions divided by `factor` (Hugging Face's "linear").
    Linear {
        /// The position divisor.
        factor: f64,
    },
    /// Llama 3.1's frequency-band rescaling.
    Llama3 {
        /// Divisor applied to low frequencies.
        factor: f64,
        /// Wavelength band edges, as fractions of the original context.
        low_freq_factor: f64,
        /// See `low_freq_factor`.
        high_freq_factor: f64,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
}

/// A Llama- or Qwen2-family decoder, as far as the forward pass needs to know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// `llama` or `qwen2`.
    pub model_type: String,
    /// Tokens in the embedding table.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU hidden layer.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Optional RoPE rescaling.
    pub rope_scaling: Option<RopeScaling>,
    /// Longest position the RoPE table covers.
    pub max_position_embeddings: usize,
    /// The output projection shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2 always, Llama when `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias` only).
    pub o_bias: bool,
    /// Biases in the MLP (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// Token id that ends a turn or a document, when the config names one.
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    eos_token_id: Option<serde_json::Value>,
}

impl ModelConfig {
    /// Reads `config.json` from a checkpoint directory or a file path.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file).map_err(|e| ModelError::Io(file.clone(), e))?;
        Self::from_json(&text).map_err(|e| ModelError::InFile(file, Box::new(e)))
    }

    /// Parses the text of a Hugging Face `config.json`.
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let raw: RawConfig = serde_json::from_str(text).map_err(ModelError::Json)?;
        let model_type = raw.model_type.unwrap_or_else(|| "llama".into());
        let qwen = match model_type.as_str() {
            "qwen2" => true,
            "llama" => false,
            other => {
                return Err(ModelError::Config(format!(
                    "model_type {other:?} is not supported (llama, qwen2)"
                )))
            }
        };
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(ModelError::Config(format!(
                    "hidden_act {act:?}: only silu (SwiGLU) is supported"
                )));
            }
        }
        if raw.num_attention_heads == 0
            || !raw.hidden_size.is_multiple_of(raw.num_attention_heads) && raw.head_dim.is_none()
        {
            return Err(ModelError::Config(
                "hidden_size must divide into num_attention_heads".into(),
            ));
        }
        let kv = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if kv == 0 || !raw.num_attention_heads.is_multiple_of(kv) {
            return Err(ModelError::Config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {kv}",
                raw.num_attention_heads
            )));
        }
        let rope_scaling = match raw.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => Some(parse_rope_scaling(&v)?),
        };
        let attention_bias = raw.attention_bias.unwrap_or(false);
        let eos_token_ids = match raw.eos_token_id {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|n| vec![n as u32]).unwrap_or_default()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|n| n as u32)
                .collect(),
            _ => Vec::new(),
        };
        Ok(Self {
            model_type,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: kv,
            head_dim: raw
                .head_dim
                .unwrap_or(raw.hidden_size / raw.num_attention_heads),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: qwen || attention_bias,
            o_bias: !qwen && attention_bias,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            eos_token_ids,
        })
    }

    /// Writes the config back out as a Hugging Face `config.json` (what `from_json` reads).
    pub fn to_hf_json(&self) -> serde_json::Value {
        let rope_scaling = match &self.rope_scaling {
            None => serde_json::Value::Null,
            Some(RopeScaling::Linear { factor }) => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                serde_json::json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings})
            }
        };
        let mut v = serde_json::json!({
            "model_type": self.model_type,
            "architectures": [if self.model_type == "qwen2" { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "mlp_bias": self.mlp_bias,
            "eos_token_id": self.eos_token_ids,
        });
        if self.model_type == "llama" {
            v["attention_bias"] = serde_json::Value::Bool(self.qkv_bias);
        }
        v
    }

    /// Query heads per key/value head.
    pub fn gqa_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}

fn parse_rope_scaling(v: &serde_json::Value) -> Result<RopeScaling, ModelError> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let num = |k: &str| -> Result<f64, ModelError> {
        v.get(k)
            .and_then(|x| x.as_f64())
            .ok_or_else(|| ModelError::Config(format!("rope_scaling {kind:?} lacks {k}")))
    };
    match kind {
        "linear" => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        }),
        other => Err(ModelError::Config(format!(
            "rope_scaling type {other:?} is not supported (linear, llama3)"
        ))),
    }
}
