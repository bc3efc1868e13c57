//! Typed errors of the trainer crate.

use std::path::PathBuf;

/// Errors from building, loading or saving models and tokenizers.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{0}: {1}")]
    Io(PathBuf, #[source] std::io::Error),
    /// `config.json` is malformed or describes an unsupported architecture.
    #[error("model config: {0}")]
    Config(String),
    /// A weight is missing, has the wrong shape or an unsupported dtype.
    #[error("weights: {0}")]
    Weights(String),
    /// The tokenizer could not be loaded or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A checkpoint could not be saved or restored.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The requested compute device is not available.
    #[error("device: {0}")]
    Device(String),
}

/// Errors of the training stages and rollouts.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Loading or saving a model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The environment server could not be reached or answered an error.
    #[error("environment: {0}")]
    Env(#[from] env_client::ClientError),
    /// A file could not be read or written.
    #[error("{0}: {1}")]
    Io(PathBuf, #[source] std::io::Error),
    /// The training configuration is invalid.
    #[error("config: {0}")]
    Config(String),
    /// Training data (trajectories) is missing or malformed.
    #[error("data: {0}")]
    Data(String),
    /// A JSON file could not be written or parsed.
    #[error("{0}: {1}")]
    Json(PathBuf, #[source] serde_json::Error),
    /// A checkpoint pointer or directory is not a complete checkpoint.
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The pointer or directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}
