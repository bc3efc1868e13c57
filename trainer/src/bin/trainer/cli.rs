//! The command line: subcommands and their flags.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};

use trainer::config::TrainConfig;

/// `trainer`: parsed arguments.
#[derive(Parser)]
#[command(
    name = "trainer",
    version,
    about = "Train LLM agents that write CUDA kernels, against env-server"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand)]
pub enum Command {
    /// Single-turn PPO warm-up: one answer per task, reward from /v1/evaluate.
    Warmup(StageArgs),
    /// Rejection-sampling fine-tuning on filtered trajectories.
    Rft(DataArgs),
    /// Pre-train the critic on GAE targets of trajectories.
    ValuePretrain(DataArgs),
    /// Multi-turn PPO against the server.
    Ppo(StageArgs),
    /// Roll out episodes with a policy and print the reward summary.
    Evaluate(EvalArgs),
    /// Draw a stage's metrics.jsonl as PNG curves.
    Plot(PlotArgs),
    /// Measure training and generation throughput of a model shape (random weights).
    BenchModel(BenchArgs),
    /// Measure one whole multi-turn PPO step of a model shape (random weights): the rollout
    /// with kept caches (synthetic observations in place of the server), old log-probabilities
    /// and values, GAE and the clipped updates of actor and critic, with peak device memory.
    BenchPpo(BenchPpoArgs),
    /// Measure peak host memory of loading a checkpoint: memory-mapped against read whole.
    BenchLoad(BenchLoadArgs),
    /// Serve a policy behind an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models).
    Serve(ServeArgs),
    /// Print a stage's memory plan for a config and model (what every stage prints and checks
    /// at start), without loading anything.
    MemoryPlan(MemoryPlanArgs),
}

/// `memory-plan`'s flags.
#[derive(Args, Clone)]
pub struct MemoryPlanArgs {
    #[command(flatten)]
    pub common: Common,
    /// The stage whose context applies: `warmup` trains on rollout.single_turn_context, the
    /// others on rollout.context.
    #[arg(long, default_value = "ppo")]
    pub stage: String,
    /// Free device memory in GiB to check the plan against (exit status 1 when it does not fit).
    #[arg(long)]
    pub free_gib: Option<f64>,
}

/// Where tensors live.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    /// burn's ndarray CPU backend.
    Cpu,
    /// burn's CUDA backend (needs the `cuda` build feature and a GPU).
    Cuda,
}

/// Float precision of the weights and activations.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// 32-bit floats.
    F32,
    /// bfloat16 (CUDA only).
    Bf16,
}

/// Flags every stage takes.
#[derive(Args, Clone)]
pub struct Common {
    /// TOML config (every field defaults to the recipe's value).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Checkpoint directory (config.json, tokenizer.json, optional *.safetensors); overrides model.path.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Server base URL (repeatable); overrides server.urls.
    #[arg(long = "server")]
    pub servers: Vec<String>,
    /// Output directory; overrides run.out_dir.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Seed; overrides run.seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Compute device.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Float precision on CUDA.
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: Precision,
    /// Start from an earlier stage's checkpoint directory (its final/ or a step-N/).
    #[arg(long)]
    pub init: Option<PathBuf>,
}

/// A training stage's flags.
#[derive(Args, Clone)]
pub struct StageArgs {
    #[command(flatten)]
    pub common: Common,
    /// Continue from this stage's newest checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// Training steps; overrides ppo.steps.
    #[arg(long)]
    pub steps: Option<usize>,
}

/// RFT and value pre-training: a stage plus its data.
#[derive(Args, Clone)]
pub struct DataArgs {
    #[command(flatten)]
    pub stage: StageArgs,
    /// Trajectory logs (a server's <data-dir>/trajectories; repeatable). Without any, the
    /// stage rolls out rft.rollouts episodes with the starting policy.
    #[arg(long = "trajectories")]
    pub trajectories: Vec<PathBuf>,
}

/// `evaluate`'s flags.
#[derive(Args, Clone)]
pub struct EvalArgs {
    #[command(flatten)]
    pub common: Common,
    /// Episodes to run.
    #[arg(long, default_value_t = 32)]
    pub episodes: usize,
    /// Sample greedily instead of at the configured temperature.
    #[arg(long)]
    pub greedy: bool,
    /// Write the summary JSON here too.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write every episode (task, outcome, reward, the decoded conversation) here, one JSON
    /// object per line: the quickest way to see what a checkpoint does.
    #[arg(long)]
    pub episodes_out: Option<PathBuf>,
}

/// `plot`'s flags.
#[derive(Args, Clone)]
pub struct PlotArgs {
    /// One or more metrics.jsonl files: with several, each panel draws one curve per run.
    #[arg(required = true, num_args = 1..)]
    pub metrics: Vec<PathBuf>,
    /// A name per metrics file, in order, for the legend (default: the file's path).
    #[arg(long)]
    pub label: Vec<String>,
    /// PNG to write (default: beside the first metrics file).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// `bench-model`'s flags.
#[derive(Args, Clone)]
pub struct BenchArgs {
    /// A config.json giving the shape (default: Qwen2.5-0.5B's).
    #[arg(long)]
    pub shape: Option<PathBuf>,
    /// Compute device.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Float precision.
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: Precision,
    /// Sequence length of the training passes.
    #[arg(long, default_value_t = 2048)]
    pub seq: usize,
    /// Sequences per training pass.
    #[arg(long, default_value_t = 1)]
    pub train_batch: usize,
    /// Timed training passes (after one untimed); 0 skips training.
    #[arg(long, default_value_t = 5)]
    pub train_iters: usize,
    /// Batch sizes of the generation runs.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub gen_batch: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub prompt: usize,
    /// New tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// Also time each decoding step's matrix products (one row per sequence of each
    /// generation batch) written four ways: plain, split along the inner dimension, rows as
    /// a batch of vector products, transposed.
    #[arg(long)]
    pub products: bool,
    /// Turns of a synthetic multi-turn episode (0: none): every conversation of the first
    /// generation batch size samples `new_tokens`, gets `observation` tokens appended, and
    /// goes on, once from each context's first token every turn and once continuing from
    /// the caches kept between turns.
    #[arg(long, default_value_t = 0)]
    pub turns: usize,
    /// Tokens of each synthetic observation (with `--turns`).
    #[arg(long, default_value_t = 64)]
    pub observation: usize,
    /// Train adapters of this rank on every projection (alpha twice the rank) instead of every
    /// weight (0).
    #[arg(long, default_value_t = 0)]
    pub lora_rank: usize,
    /// Training passes layer by layer, recomputing each layer in the backward pass.
    #[arg(long)]
    pub checkpointing: bool,
}

/// `bench-ppo`'s flags.
#[derive(Args, Clone)]
pub struct BenchPpoArgs {
    /// A config.json giving the shape (default: Qwen2.5-0.5B's).
    #[arg(long)]
    pub shape: Option<PathBuf>,
    /// A training configuration (TOML) for everything the flags below do not set.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Compute device.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Float precision.
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: Precision,
    /// Episodes rolled out and trained on per step.
    #[arg(long, default_value_t = 8)]
    pub episodes: usize,
    /// Tokens of each episode at its end: the prompt, then every turn's sampled tokens and
    /// observation (the observations are sized to reach it).
    #[arg(long, default_value_t = 8192)]
    pub context: usize,
    /// Prompt tokens each episode starts with.
    #[arg(long, default_value_t = 1024)]
    pub prompt: usize,
    /// Assistant turns per episode.
    #[arg(long, default_value_t = 8)]
    pub turns: usize,
    /// Tokens the policy samples per turn.
    #[arg(long, default_value_t = 256)]
    pub new_tokens: usize,
    /// Adapter rank on every projection (alpha twice the rank); 0 trains every weight.
    #[arg(long, default_value_t = 16)]
    pub lora_rank: usize,
    /// Training passes layer by layer, recomputing each layer in the backward pass.
    #[arg(long)]
    pub checkpointing: bool,
    /// Sequences per forward/backward pass (and per scoring pass).
    #[arg(long, default_value_t = 1)]
    pub micro_batch: usize,
    /// PPO steps, each timed on its own (the first also compiles kernels).
    #[arg(long, default_value_t = 2)]
    pub steps: usize,
    /// Score a KL reference too (the base with adapters off, or a copy of the policy).
    #[arg(long)]
    pub reference: bool,
    /// How turns share the generator: `rounds` (every episode's turn, then every tool call,
    /// then the next round) or `continuous` (a turn joins the running batch as soon as its
    /// tool call is answered, and leaves it as soon as it ends).
    #[arg(long, value_enum, default_value = "rounds")]
    pub schedule: Schedule,
    /// Mean seconds a simulated server takes to answer a tool call (drawn per call from an
    /// exponential distribution; 0: at once).
    #[arg(long, default_value_t = 0.0)]
    pub env_latency_s: f64,
    /// Spread of turn lengths: each turn samples between (1 - spread) x --new-tokens and
    /// --new-tokens tokens (0: all the same).
    #[arg(long, default_value_t = 0.0)]
    pub turn_spread: f64,
}

/// How a rollout's turns share the generator.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Round by round: each round's turns decode together, then wait for every tool call.
    Rounds,
    /// Continuous batching: turns join and leave the running batch between decode steps.
    Continuous,
}

/// The stage configuration: the TOML file (or the defaults), then the flags that override it.
pub fn load_config(c: &Common) -> Result<TrainConfig> {
    let mut cfg = match &c.config {
        Some(p) => TrainConfig::from_file(p)?,
        None => TrainConfig::default(),
    };
    if let Some(m) = &c.model {
        cfg.model.path = Some(m.clone());
    }
    if !c.servers.is_empty() {
        cfg.server.urls = c.servers.clone();
    }
    if let Some(o) = &c.out {
        cfg.run.out_dir = o.clone();
    }
    if let Some(s) = c.seed {
        cfg.run.seed = s;
    }
    Ok(cfg)
}

/// `serve`'s flags. The model is `--tiny-random`, `--model DIR`, or `--checkpoint PATH`
/// (on top of `--model DIR` or `--tiny-random` when it is a stage checkpoint).
#[derive(Args, Clone)]
pub struct ServeArgs {
    /// Serve a tiny model with seeded random weights and the built-in 512-token vocabulary.
    #[arg(long)]
    pub tiny_random: bool,
    /// Seed of random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A Hugging Face directory (config.json, tokenizer.json, *.safetensors): the served
    /// model, or the shape and tokenizer under a stage checkpoint.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A checkpoint: a Hugging Face directory (a stage's final/hf), or this trainer's stage
    /// checkpoint (step-N/ or final/ with policy.mpk, a stage directory, or its `latest`).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// A PEFT adapter directory (a stage's final/adapter, or one PEFT wrote) served on the
    /// model.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Chat template (detected from tokenizer_config.json when unset).
    #[arg(long, value_enum)]
    pub template: Option<trainer::chat::ChatTemplate>,
    /// Name listed by /v1/models and accepted in requests' `model` (default: the path, or
    /// `tiny-random`).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the first line of stdout names it).
    #[arg(long, default_value_t = 8100)]
    pub port: u16,
    /// Positions served, prompt plus completion (default: the model's maximum).
    #[arg(long)]
    pub context: Option<usize>,
    /// Completion tokens when a request names no limit.
    #[arg(long, default_value_t = 512)]
    pub default_max_tokens: usize,
    /// Choices per request at most (`n`).
    #[arg(long, default_value_t = 8)]
    pub max_n: usize,
    /// Choices decoding together at most (continuous batching: requests join and leave the
    /// running batch between decode steps).
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Requests waiting for a place in the batch at most; more are answered 429.
    #[arg(long, default_value_t = 32)]
    pub max_queue: usize,
    /// Request body size limit in bytes.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Compute device.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Float precision on CUDA.
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: Precision,
}

/// `bench-load`'s flags.
#[derive(Args, Clone)]
pub struct BenchLoadArgs {
    /// A config.json giving the shape (default: Qwen2.5-0.5B's).
    #[arg(long)]
    pub shape: Option<PathBuf>,
    /// Element type of the checkpoint written for the measurement.
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: WeightDtype,
    /// Where to write the checkpoint (default: a temporary directory, removed after).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Measure one way in this process (what the benchmark runs as its children).
    #[arg(long, value_enum, hide = true)]
    pub child: Option<LoadWay>,
}

/// Element type of the benchmark's checkpoint.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WeightDtype {
    /// bfloat16, as Hugging Face ships most checkpoints.
    Bf16,
    /// 32-bit floats.
    F32,
}

impl WeightDtype {
    /// Its name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F32 => "f32",
        }
    }
}

/// A way of loading, measured by `bench-load`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LoadWay {
    /// Every file read whole and every tensor widened to f32 up front.
    ReadWhole,
    /// Memory-mapped, one tensor converted at a time.
    Mapped,
}

impl LoadWay {
    /// Its name on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::ReadWhole => "read-whole",
            Self::Mapped => "mapped",
        }
    }
}
