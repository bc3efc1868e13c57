//! The cuda-agent trainer: Llama/Qwen2 policy and critic models in burn, and the CUDA Agent
//! training stages (single-turn warm-up, rejection-sampling fine-tuning, value pre-training,
//! multi-turn PPO) run against env-server over HTTP.

pub mod blas;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod curation;
pub mod error;
pub mod generate;
#[cfg(feature = "cuda")]
pub mod kernels;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod objective;
pub mod optim;
pub mod plot;
pub mod policy;
pub mod render;
pub mod rollout;
pub mod sample;
pub mod seeds;
pub mod serve;
pub mod stage;
pub mod tokenizer;

pub use error::{ModelError, TrainError};
