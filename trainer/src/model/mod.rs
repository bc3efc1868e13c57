//! Llama/Qwen2-architecture decoders in burn: config, weights, KV cache, policy and critic.

pub mod cache;
pub mod config;
pub mod decode;
pub mod fused;
pub mod lm;
pub mod lora;
pub mod recompute;
pub mod rope;
pub mod transformer;
pub mod vocab;
pub mod weights;

pub use cache::KvCache;
pub use config::{ModelConfig, RopeScaling};
pub use lm::{Architecture, CausalLm, Critic, SequenceStats};
pub use lora::{LoraSpec, LoraTarget};
