//! What `trainer serve` loads: a tiny random model (tests, agent-runner development), a
//! Hugging Face checkpoint directory (a base model, or a stage's `final/hf/` export), or a
//! stage checkpoint of this trainer (`step-N/`, `final/`, or a `latest` pointer) on top of
//! the model directory the run started from.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;

use super::engine::ServedModel;
use crate::chat::ChatTemplate;
use crate::checkpoint::{self, CheckpointFiles};
use crate::config::ModelSection;
use crate::error::{ModelError, TrainError};
use crate::model::{Architecture, CausalLm, LoraSpec, ModelConfig};
use crate::policy::load_policy;
use crate::render::Renderer;
use crate::tokenizer::TextTokenizer;

/// The tiny model's shape: the one `tests/learning.rs` trains on the `tiny` task family,
/// with room for the longer prompts of real tasks.
const TINY_CONFIG: &str = r#"{"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64,
"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
"num_key_value_heads": 2, "max_position_embeddings": 8192, "rope_theta": 10000.0,
"tie_word_embeddings": true, "eos_token_id": 2}"#;

/// A 512-token byte-level BPE vocabulary with the ChatML markers (`assets/`).
const TINY_TOKENIZER: &str = include_str!("../../assets/tiny-tokenizer.json");

/// Where the served weights come from.
#[derive(Debug, Clone, Default)]
pub struct ModelSource {
    /// Seeded random weights of the tiny shape, with the tiny tokenizer.
    pub tiny_random: bool,
    /// Seed of random weights.
    pub seed: u64,
    /// A Hugging Face directory: `config.json`, `tokenizer.json`, and `*.safetensors` (random
    /// weights of its shape when it has none).
    pub model: Option<PathBuf>,
    /// A checkpoint: a Hugging Face directory, or a stage checkpoint of this trainer (a
    /// directory with `policy.mpk`, a stage directory, or its `latest` pointer), whose shape
    /// and tokenizer come from `model` or `tiny_random`.
    pub checkpoint: Option<PathBuf>,
    /// A PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) to serve
    /// on the model.
    pub adapter: Option<PathBuf>,
    /// Chat template; detected from the tokenizer config when unset.
    pub template: Option<ChatTemplate>,
}

/// The loaded model and the name it is served under by default.
pub struct Loaded<B: Backend> {
    /// Ready for the engine.
    pub model: ServedModel<B>,
    /// A name for `GET /v1/models`.
    pub name: String,
    /// Positions served (prompt plus completion).
    pub context: usize,
}

/// Loads `src` with RoPE tables for `context` positions (default: the config's maximum).
pub fn load<B: Backend>(
    src: &ModelSource,
    context: Option<usize>,
    device: &B::Device,
) -> Result<Loaded<B>, TrainError> {
    let checkpoint = src
        .checkpoint
        .as_deref()
        .map(checkpoint::resolve)
        .transpose()?;
    let hf_checkpoint = checkpoint
        .as_deref()
        .filter(|d| d.join("config.json").exists());
    let (config, mut lm, tokenizer, template, mut name) = if let Some(dir) = hf_checkpoint {
        let p = hf(dir, src, device)?;
        (p.0, p.1, p.2, p.3, dir.display().to_string())
    } else if let Some(dir) = &src.model {
        let p = hf(dir, src, device)?;
        (p.0, p.1, p.2, p.3, dir.display().to_string())
    } else if src.tiny_random {
        let config = ModelConfig::from_json(TINY_CONFIG)?;
        let tokenizer = TINY_TOKENIZER
            .parse::<tokenizers::Tokenizer>()
            .map(TextTokenizer::from_tokenizer)
            .map_err(|e| ModelError::TokenizerLib {
                what: "the built-in tiny tokenizer".into(),
                source: e,
            })?;
        B::seed(device, src.seed);
        let lm = CausalLm::random(&config, device);
        let template = src.template.unwrap_or(ChatTemplate::Chatml);
        (config, lm, tokenizer, template, "tiny-random".to_string())
    } else {
        return Err(TrainError::Config(
            "serve needs --tiny-random, --model DIR, or --checkpoint PATH (a Hugging Face directory)"
                .into(),
        ));
    };
    if let (Some(dir), None) = (&checkpoint, hf_checkpoint) {
        let files = CheckpointFiles::new(dir);
        if files.policy().exists() {
            lm = lm.load_record(&files.policy(), device)?;
        } else if files.policy_adapter().exists() {
            // An adapter-training checkpoint: its adapters on the base.
            let spec = LoraSpec::from_peft_config(&files.adapter_config())?;
            lm = lm
                .with_adapters(&spec)
                .load_adapter(&files.policy_adapter())?;
        } else {
            return Err(TrainError::Config(format!(
                "{} holds neither config.json (a Hugging Face checkpoint) nor policy.mpk or policy_adapter.safetensors (a stage checkpoint)",
                dir.display()
            )));
        }
        name = dir.display().to_string();
    }
    if let Some(adapter) = &src.adapter {
        lm = lm.with_peft(adapter)?;
        name = adapter.display().to_string();
    }
    let context = context
        .unwrap_or(config.max_position_embeddings)
        .min(config.max_position_embeddings)
        .max(2);
    let arch = Architecture::new(config.clone(), context, device);
    let renderer = Renderer::new(
        template,
        tokenizer,
        String::new(),
        true,
        usize::MAX,
        &config.eos_token_ids,
    )?;
    Ok(Loaded {
        model: ServedModel {
            lm,
            arch,
            renderer,
            device: device.clone(),
        },
        name,
        context,
    })
}

type Parts<B> = (ModelConfig, CausalLm<B>, TextTokenizer, ChatTemplate);

fn hf<B: Backend>(
    dir: &Path,
    src: &ModelSource,
    device: &B::Device,
) -> Result<Parts<B>, TrainError> {
    let section = ModelSection {
        path: Some(dir.to_path_buf()),
        random_init: false,
        template: src.template,
    };
    let p = load_policy::<B>(&section, src.seed, device)?;
    Ok((p.config, p.lm, p.tokenizer, p.template))
}
