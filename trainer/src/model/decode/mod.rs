//! A decode step a backend runs as one operation (the CUDA kernels of `crate::kernels::decode`
//! do): every layer's work for one new token per row queued by a single call, instead of the
//! few hundred burn operations of [`CausalLm::forward_last`], whose per-operation cost bounds
//! token-by-token decoding.

use burn::tensor::{backend::Backend, Int, Tensor};

use super::cache::KvCache;
use super::lm::{Architecture, CausalLm};

/// One model's decode step, prepared once per generation (weights gathered, adapters cast).
pub trait DecodeStep<B: Backend> {
    /// Logits `[rows, vocab]` for one new real token per row of `cache` (`tokens` `[rows]`),
    /// whose keys and values are appended to `cache`: what [`CausalLm::forward_last`] returns
    /// for those tokens. `None`, with `cache` untouched, where this step does not apply to the
    /// cache as it is (the caller then runs `forward_last`).
    fn step(&self, tokens: Tensor<B, 1, Int>, cache: &mut KvCache<B>) -> Option<Tensor<B, 2>>;
}

/// A backend's decode step for a model (registered with [`super::fused`]), or `None` where the
/// model is outside what it runs (then every step is `forward_last`).
pub type FusedDecoder<B> = fn(&CausalLm<B>, &Architecture<B>) -> Option<Box<dyn DecodeStep<B>>>;

impl<B: Backend> CausalLm<B> {
    /// The backend's decode step for this model, where one is registered and takes it.
    pub fn decoder(&self, arch: &Architecture<B>) -> Option<Box<dyn DecodeStep<B>>> {
        super::fused::get::<B, FusedDecoder<B>>()?(self, arch)
    }
}

pub mod plan;
