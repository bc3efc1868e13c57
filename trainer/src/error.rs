//! Typed errors of the trainer crate. Errors from libraries are kept as sources and left out
//! of the message (the chain is printed by the binary, or joined by `env_api::ErrorChain`);
//! variants holding only a sentence are problems found by the trainer itself.

use std::path::PathBuf;

/// Errors from building, loading or saving models and tokenizers.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{0}")]
    Io(PathBuf, #[source] std::io::Error),
    /// An error about the contents of a file.
    #[error("{0}")]
    InFile(PathBuf, #[source] Box<ModelError>),
    /// `config.json` describes an unsupported architecture or is inconsistent.
    #[error("model config: {0}")]
    Config(String),
    /// A JSON document (`config.json`, a shard index, an export) does not parse or serialise.
    #[error("JSON")]
    Json(#[source] serde_json::Error),
    /// A weight is missing, has the wrong shape or an unsupported dtype.
    #[error("weights: {0}")]
    Weights(String),
    /// A safetensors file or tensor could not be read or written.
    #[error("safetensors {what}")]
    Safetensors {
        /// The file or tensor.
        what: String,
        /// What the safetensors crate said.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// The tokenizer lacks something the trainer needs.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The tokenizers library failed (loading, encoding).
    #[error("tokenizer {what}")]
    TokenizerLib {
        /// The file or operation.
        what: String,
        /// What the tokenizers crate said.
        #[source]
        source: tokenizers::Error,
    },
    /// A burn record (weights or optimiser state) could not be saved or restored.
    #[error("record {0}")]
    Record(PathBuf, #[source] burn::record::RecorderError),
}

/// Errors of the training stages and rollouts.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Loading or saving a model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The environment servers' addresses (`server.urls`) cannot be used.
    #[error("server.urls")]
    Fleet(#[source] env_client::FleetError),
    /// The environment server could not be reached or answered an error.
    #[error("environment")]
    Env(#[from] env_client::ClientError),
    /// A file could not be read or written.
    #[error("{0}")]
    Io(PathBuf, #[source] std::io::Error),
    /// An error about the contents of a file.
    #[error("{0}")]
    InFile(PathBuf, #[source] Box<TrainError>),
    /// The training configuration is invalid.
    #[error("config: {0}")]
    Config(String),
    /// The TOML configuration does not parse.
    #[error("config")]
    Toml(#[source] toml::de::Error),
    /// Training data (trajectories) is missing or malformed.
    #[error("data: {0}")]
    Data(String),
    /// A record of training data does not parse.
    #[error("data: {what}")]
    DataJson {
        /// Which record.
        what: String,
        /// What serde_json said.
        #[source]
        source: serde_json::Error,
    },
    /// A JSON file could not be written or parsed.
    #[error("{0}")]
    Json(PathBuf, #[source] serde_json::Error),
    /// A chart could not be drawn or written.
    #[error("plot")]
    Plot(#[from] charts::ChartError),
    /// A checkpoint pointer or directory is not a complete checkpoint.
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The pointer or directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}
