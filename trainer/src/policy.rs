//! Loading the starting checkpoint, and the policy as a rollout `Generator`.

use std::path::Path;

use burn::tensor::backend::Backend;

use crate::chat::ChatTemplate;
use crate::config::ModelSection;
use crate::error::{ModelError, TrainError};
use std::collections::HashMap;

use crate::generate::{
    generate, generate_continuing, Generation, PrefixCache, RunningBatch, SamplingParams,
    TurnRequest,
};
use crate::model::{Architecture, CausalLm, ModelConfig};
use crate::rollout::{Generator, TurnBatch, TurnStart};
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

/// The policy sampling turns for rollouts (on a non-autodiff backend). It keeps each live
/// conversation's keys and values between turns, within a budget of cached tokens; past it,
/// the least recently continued conversations lose theirs and prefill again next turn.
pub struct PolicyGenerator<'a, B: Backend> {
    lm: &'a CausalLm<B>,
    arch: &'a Architecture<B>,
    tokenizer: &'a TextTokenizer,
    device: B::Device,
    /// Kept caches by conversation, with the call that last continued each.
    prefixes: HashMap<usize, (u64, PrefixCache<B>)>,
    calls: u64,
    budget_tokens: usize,
    /// Turns being sampled together (continuous batching).
    running: Option<RunningBatch<'a, B>>,
}

impl<'a, B: Backend> PolicyGenerator<'a, B> {
    /// A generator keeping at most `kv_budget_bytes` of conversations' caches between turns.
    pub fn new(
        lm: &'a CausalLm<B>,
        arch: &'a Architecture<B>,
        tokenizer: &'a TextTokenizer,
        device: B::Device,
        kv_budget_bytes: u64,
    ) -> Self {
        let c = &arch.config;
        // Keys and values of every layer, at the model's element size.
        let per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim;
        let elem = lm.element_bytes().max(1);
        Self {
            lm,
            arch,
            tokenizer,
            device,
            prefixes: HashMap::new(),
            calls: 0,
            budget_tokens: (kv_budget_bytes / (per_token * elem).max(1) as u64) as usize,
            running: None,
        }
    }

    /// Tokens whose keys and values are kept now.
    pub fn cached_tokens(&self) -> usize {
        self.prefixes.values().map(|(_, p)| p.tokens().len()).sum()
    }

    /// Drops the least recently continued caches until the kept ones fit the budget.
    fn evict(&mut self) {
        let mut total = self.cached_tokens();
        while total > self.budget_tokens {
            let Some((&key, _)) = self.prefixes.iter().min_by_key(|(_, (used, _))| *used) else {
                break;
            };
            if let Some((_, p)) = self.prefixes.remove(&key) {
                total -= p.tokens().len();
                tracing::debug!(
                    conversation = key,
                    tokens = p.tokens().len(),
                    "KV cache dropped for the budget"
                );
            }
        }
    }
}

impl<B: Backend> Generator for PolicyGenerator<'_, B> {
    fn continue_conversations(
        &mut self,
        keys: &[usize],
        contexts: &[Vec<u32>],
        params: &SamplingParams,
        seed: u64,
    ) -> TurnBatch {
        self.calls += 1;
        let prefixes = keys
            .iter()
            .map(|k| self.prefixes.remove(k).map(|(_, p)| p))
            .collect();
        let out = generate_continuing(
            self.lm,
            self.arch,
            contexts,
            prefixes,
            params,
            Some(self.tokenizer),
            seed,
            &self.device,
        );
        for (&k, p) in keys.iter().zip(out.caches) {
            self.prefixes.insert(k, (self.calls, p));
        }
        self.evict();
        TurnBatch {
            generations: out.generations,
            prefilled_tokens: out.prefilled_tokens,
            reused_tokens: out.reused_tokens,
        }
    }

    fn end_conversation(&mut self, key: usize) {
        self.prefixes.remove(&key);
    }

    fn admit(&mut self, turns: Vec<TurnStart>, params: &SamplingParams) -> (usize, usize) {
        // A new batch takes the settings given; a running one keeps its own until it empties.
        let fresh = self
            .running
            .as_ref()
            .is_none_or(|r| r.is_empty() && r.params() != params);
        if fresh {
            self.running = Some(RunningBatch::new(
                self.lm,
                self.arch,
                params.clone(),
                Some(self.tokenizer),
                self.device.clone(),
            ));
        }
        let requests = turns
            .into_iter()
            .map(|t| TurnRequest {
                prefix: self.prefixes.remove(&t.key).map(|(_, p)| p),
                key: t.key,
                context: t.context,
                max_new_tokens: t.max_new_tokens,
                seed: t.seed,
            })
            .collect();
        self.running.as_mut().map_or((0, 0), |r| r.admit(requests))
    }

    fn step(&mut self) -> Vec<(usize, Generation)> {
        let Some(running) = self.running.as_mut() else {
            return Vec::new();
        };
        let ended = running.step();
        if ended.is_empty() {
            return Vec::new();
        }
        self.calls += 1;
        let mut out = Vec::with_capacity(ended.len());
        for t in ended {
            self.prefixes.insert(t.key, (self.calls, t.cache));
            out.push((t.key, t.generation));
        }
        self.evict();
        out
    }

    fn running(&self) -> usize {
        self.running.as_ref().map_or(0, RunningBatch::len)
    }

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
