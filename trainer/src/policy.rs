//! Loading the starting checkpoint, and the policy as a rollout `Generator`.

use std::path::Path;

use burn::tensor::backend::Backend;

use crate::chat::ChatTemplate;
use crate::config::ModelSection;
use crate::error::{ModelError, TrainError};
use crate::generate::{generate, Generation, SamplingParams};
use crate::model::{Architecture, CausalLm, ModelConfig};
use crate::rollout::Generator;
use crate::tokenizer::TextTokenizer;

/// A checkpoint loaded for training.
pub struct LoadedPolicy<B: Backend> {
    /// Its architecture.
    pub config: ModelConfig,
    /// The weights.
    pub lm: CausalLm<B>,
    /// Its tokenizer.
    pub tokenizer: TextTokenizer,
    /// Its chat template.
    pub template: ChatTemplate,
}

/// Loads `section.path` (config, tokenizer and weights, or seeded random weights of the
/// config's shape when `random_init` is set or the directory holds no weights).
pub fn load_policy<B: Backend>(
    section: &ModelSection,
    seed: u64,
    device: &B::Device,
) -> Result<LoadedPolicy<B>, TrainError> {
    let dir = section
        .path
        .as_deref()
        .ok_or_else(|| TrainError::Config("model.path is not set".into()))?;
    let tokenizer = TextTokenizer::from_file(dir)?;
    let template = section
        .template
        .unwrap_or_else(|| ChatTemplate::for_checkpoint(dir));
    let (config, lm) = if section.random_init || !has_weights(dir) {
        let config = ModelConfig::from_file(dir)?;
        B::seed(device, seed);
        let lm = CausalLm::random(&config, device);
        (config, lm)
    } else {
        CausalLm::from_pretrained(dir, device)?
    };
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(ModelError::Config(format!(
            "the tokenizer has {} tokens but the model only {}",
            tokenizer.vocab_size(),
            config.vocab_size
        ))
        .into());
    }
    Ok(LoadedPolicy {
        config,
        lm,
        tokenizer,
        template,
    })
}

fn has_weights(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        })
        .unwrap_or(false)
}

/// The policy sampling turns for rollouts (on a non-autodiff backend).
pub struct PolicyGenerator<'a, B: Backend> {
    /// Weights.
    pub lm: &'a CausalLm<B>,
    /// Config and RoPE tables.
    pub arch: &'a Architecture<B>,
    /// For stop strings.
    pub tokenizer: &'a TextTokenizer,
    /// Where it runs.
    pub device: B::Device,
}

impl<B: Backend> Generator for PolicyGenerator<'_, B> {
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
        seed: u64,
    ) -> Vec<Generation> {
        generate(
            self.lm,
            self.arch,
            prompts,
            params,
            Some(self.tokenizer),
            seed,
            &self.device,
        )
    }
}
