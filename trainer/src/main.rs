//! `trainer`: the CUDA Agent training stages against env-server, plus evaluation, plots and
//! the model benchmark.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use burn::tensor::backend::AutodiffBackend;
use clap::{Args, Parser, Subcommand, ValueEnum};

use trainer::config::TrainConfig;
use trainer::curation::{rft_filter, samples_from_dir};
use trainer::metrics::batch_summary;
use trainer::rollout::{run_episodes, EnvPool, RolloutSettings};
use trainer::sample::Sample;
use trainer::stage::ppo::{self, PpoMode};
use trainer::stage::rft::{run_rft, run_value_pretrain};
use trainer::stage::{seed_of, Learner, StageOptions};

#[derive(Parser)]
#[command(
    name = "trainer",
    version,
    about = "Train LLM agents that write CUDA kernels, against env-server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceKind {
    /// burn's ndarray CPU backend.
    Cpu,
    /// burn's CUDA backend (needs the `cuda` build feature and a GPU).
    Cuda,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Precision {
    /// 32-bit floats.
    F32,
    /// bfloat16 (CUDA only).
    Bf16,
}

#[derive(Args, Clone)]
struct Common {
    /// TOML config (every field defaults to the recipe's value).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Checkpoint directory (config.json, tokenizer.json, optional *.safetensors); overrides model.path.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Server base URL (repeatable); overrides server.urls.
    #[arg(long = "server")]
    servers: Vec<String>,
    /// Output directory; overrides run.out_dir.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Seed; overrides run.seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Compute device.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceKind,
    /// Float precision on CUDA.
    #[arg(long, value_enum, default_value = "f32")]
    precision: Precision,
    /// Start from an earlier stage's checkpoint directory (its final/ or a step-N/).
    #[arg(long)]
    init: Option<PathBuf>,
}

#[derive(Args, Clone)]
struct StageArgs {
    #[command(flatten)]
    common: Common,
    /// Continue from this stage's newest checkpoint.
    #[arg(long)]
    resume: bool,
    /// Training steps; overrides ppo.steps.
    #[arg(long)]
    steps: Option<usize>,
}

#[derive(Args, Clone)]
struct DataArgs {
    #[command(flatten)]
    stage: StageArgs,
    /// Trajectory logs (a server's <data-dir>/trajectories; repeatable). Without any, the
    /// stage rolls out rft.rollouts episodes with the starting policy.
    #[arg(long = "trajectories")]
    trajectories: Vec<PathBuf>,
}

#[derive(Args, Clone)]
struct EvalArgs {
    #[command(flatten)]
    common: Common,
    /// Episodes to run.
    #[arg(long, default_value_t = 32)]
    episodes: usize,
    /// Sample greedily instead of at the configured temperature.
    #[arg(long)]
    greedy: bool,
    /// Write the summary JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write every episode (task, outcome, reward, the decoded conversation) here, one JSON
    /// object per line: the quickest way to see what a checkpoint does.
    #[arg(long)]
    episodes_out: Option<PathBuf>,
}

#[derive(Args, Clone)]
struct PlotArgs {
    /// A metrics.jsonl.
    metrics: PathBuf,
    /// PNG to write (default: beside the metrics file).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args, Clone)]
struct BenchArgs {
    /// A config.json giving the shape (default: Qwen2.5-0.5B's).
    #[arg(long)]
    shape: Option<PathBuf>,
    /// Compute device.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceKind,
    /// Float precision.
    #[arg(long, value_enum, default_value = "f32")]
    precision: Precision,
    /// Sequence length of the training passes.
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// Sequences per training pass.
    #[arg(long, default_value_t = 1)]
    train_batch: usize,
    /// Timed training passes (after one untimed); 0 skips training.
    #[arg(long, default_value_t = 5)]
    train_iters: usize,
    /// Batch sizes of the generation runs.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    gen_batch: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// New tokens per sequence.
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Also time each decoding step's matrix products (one row per sequence of each
    /// generation batch) written four ways: plain, split along the inner dimension, rows as
    /// a batch of vector products, transposed.
    #[arg(long)]
    products: bool,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Command::Plot(a) = &cli.command {
        let out = a
            .out
            .clone()
            .unwrap_or_else(|| a.metrics.with_extension("png"));
        trainer::plot::plot_metrics(&a.metrics, &out)?;
        println!("{}", out.display());
        return Ok(());
    }
    if let Command::BenchModel(b) = &cli.command {
        return match (b.device, b.precision) {
            (DeviceKind::Cpu, Precision::F32) => bench::<
                burn::backend::Autodiff<burn::backend::NdArray<f32>>,
            >(b, Default::default(), ""),
            (DeviceKind::Cpu, Precision::Bf16) => bail!("--precision bf16 needs --device cuda"),
            (DeviceKind::Cuda, p) => bench_cuda(b, p),
        };
    }
    let common = match &cli.command {
        Command::Warmup(s) | Command::Ppo(s) => &s.common,
        Command::Rft(d) | Command::ValuePretrain(d) => &d.stage.common,
        Command::Evaluate(e) => &e.common,
        Command::Plot(_) | Command::BenchModel(_) => unreachable!("handled above"),
    };
    match (common.device, common.precision) {
        (DeviceKind::Cpu, Precision::F32) => run::<
            burn::backend::Autodiff<burn::backend::NdArray<f32>>,
        >(&cli.command, Default::default()),
        (DeviceKind::Cpu, Precision::Bf16) => bail!("--precision bf16 needs --device cuda"),
        (DeviceKind::Cuda, p) => run_cuda(&cli.command, p),
    }
}

#[cfg(feature = "cuda")]
fn run_cuda(cmd: &Command, p: Precision) -> Result<()> {
    probe_libcuda()?;
    configure_kernel_caches();
    configure_matmul();
    configure_kernels();
    let device = burn::backend::cuda::CudaDevice::new(0);
    match p {
        Precision::F32 => run::<burn::backend::Autodiff<burn::backend::Cuda<f32>>>(cmd, device),
        Precision::Bf16 => {
            run::<burn::backend::Autodiff<burn::backend::Cuda<half::bf16>>>(cmd, device)
        }
    }
}

#[cfg(feature = "cuda")]
fn bench_cuda(b: &BenchArgs, p: Precision) -> Result<()> {
    probe_libcuda()?;
    configure_kernel_caches();
    let note = format!(", matmul {}, {}", configure_matmul(), configure_kernels());
    let device = burn::backend::cuda::CudaDevice::new(0);
    let result = match p {
        Precision::F32 => {
            bench::<burn::backend::Autodiff<burn::backend::Cuda<f32>>>(b, device, &note)
        }
        Precision::Bf16 => {
            bench::<burn::backend::Autodiff<burn::backend::Cuda<half::bf16>>>(b, device, &note)
        }
    };
    let counts = trainer::blas::cublas::counts();
    if counts.run + counts.declined() > 0 {
        tracing::info!(
            "cuBLAS ran {} products ({} operands copied first) and left {} to cubecl's kernels ({} by element type, {} by layout); {} calls failed",
            counts.run,
            counts.copied,
            counts.declined(),
            counts.declined_dtype,
            counts.declined_layout,
            counts.failed
        );
    }
    result
}

#[cfg(not(feature = "cuda"))]
fn bench_cuda(_: &BenchArgs, _: Precision) -> Result<()> {
    bail!("this trainer was built without CUDA: rebuild with `cargo build --release -p trainer --features cuda`")
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &Command, _: Precision) -> Result<()> {
    bail!("this trainer was built without CUDA: rebuild with `cargo build --release -p trainer --features cuda`")
}

/// Chooses who runs matrix products on CUDA and returns the choice's name: cuBLAS by default
/// (`CUDA_AGENT_MATMUL=cublas` or unset) when the library loads, else cubecl's kernels;
/// `CUDA_AGENT_MATMUL=mma` or `auto` keep cubecl's kernels (vendor/burn-cubecl's fixed choice
/// or upstream's). Measured on an H200 (docs/BENCHMARKS.md), cuBLAS made training passes 10%
/// faster and batched decoding about twice as fast as `mma`.
#[cfg(feature = "cuda")]
fn configure_matmul() -> &'static str {
    match std::env::var("CUDA_AGENT_MATMUL").as_deref() {
        Ok("mma") => "mma",
        Ok("auto") => "auto",
        other => {
            if let Ok(unknown) = other {
                if unknown != "cublas" {
                    tracing::warn!(
                        "CUDA_AGENT_MATMUL={unknown} is not one of cublas, mma, auto; using cublas"
                    );
                }
            }
            match trainer::blas::cublas::install() {
                Ok(()) => {
                    tracing::info!("matrix products run on cuBLAS");
                    "cublas"
                }
                Err(e) => {
                    tracing::warn!("{e}; matrix products run on cubecl's kernels");
                    "mma"
                }
            }
        }
    }
}

/// Runs attention, the next-token statistics, RMSNorm, rotary embeddings and the SwiGLU gate
/// through the trainer's CUDA kernels (`kernels::{attention, vocab, norm, rope, swiglu}`)
/// unless `CUDA_AGENT_{ATTENTION,VOCAB,NORM,ROPE,SWIGLU}` is `decomposed`; returns the
/// choices for the bench's note.
#[cfg(feature = "cuda")]
fn configure_kernels() -> String {
    let name = |on: bool| if on { "kernels" } else { "decomposed" };
    let attention = trainer::kernels::attention::install();
    let vocab = trainer::kernels::vocab::install();
    let norm = trainer::kernels::norm::install();
    let rope = trainer::kernels::rope::install();
    let swiglu = trainer::kernels::swiglu::install();
    tracing::info!(
        "trainer CUDA kernels: attention {}, next-token statistics {}, RMSNorm {}, rotary embeddings {}, SwiGLU {}",
        name(attention),
        name(vocab),
        name(norm),
        name(rope),
        name(swiglu)
    );
    format!(
        "attention {}, vocabulary {}, RMSNorm {}, rotary {}, SwiGLU {}",
        name(attention),
        name(vocab),
        name(norm),
        name(rope),
        name(swiglu)
    )
}

/// Keeps what burn's CUDA backend compiles. Every kernel is JIT-compiled on first use (NVRTC,
/// then the driver's PTX compiler: about 0.4 s each, measured on an H200); the first pass of a
/// 0.5B model spends about 24 s on it, so without a cache every run starts with that. cubecl's
/// PTX cache and autotune results go to `$CUDA_AGENT_KERNEL_CACHE` (default
/// `$XDG_CACHE_HOME/cuda-agent/kernels`, else `~/.cache/cuda-agent/kernels`); the driver keeps
/// the machine code in its own cache (`CUDA_CACHE_PATH`, `CUDA_CACHE_MAXSIZE`). A `cubecl.toml`
/// or `burn.toml` in the working directory or above it wins: then nothing is changed.
#[cfg(feature = "cuda")]
fn configure_kernel_caches() {
    use cubecl_runtime::config::{cache::CacheConfig, CubeClRuntimeConfig, RuntimeConfig};
    let cwd = std::env::current_dir().unwrap_or_default();
    if cwd.ancestors().any(|d| {
        ["cubecl.toml", "CubeCL.toml", "burn.toml", "Burn.toml"]
            .iter()
            .any(|f| d.join(f).exists())
    }) {
        tracing::info!(
            "kernel caches: as the cubecl.toml / burn.toml found above {} says",
            cwd.display()
        );
        return;
    }
    let dir = match std::env::var_os("CUDA_AGENT_KERNEL_CACHE") {
        Some(d) => PathBuf::from(d),
        None => match (std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME")) {
            (Some(x), _) => PathBuf::from(x).join("cuda-agent/kernels"),
            (None, Some(h)) => PathBuf::from(h).join(".cache/cuda-agent/kernels"),
            (None, None) => std::env::temp_dir().join("cuda-agent-kernels"),
        },
    };
    // Without a cache the run still works, it only compiles everything again: warn, go on.
    if let Err(e) = std::fs::create_dir_all(&dir) {
        tracing::warn!("kernel cache {} unusable ({e}); kernels will be compiled afresh (set CUDA_AGENT_KERNEL_CACHE)", dir.display());
        return;
    }
    tracing::info!("kernel cache: {}", dir.display());
    let mut config = CubeClRuntimeConfig::default().override_from_env();
    config.compilation.cache = Some(CacheConfig::File(dir.clone()));
    config.autotune.cache = CacheConfig::File(dir);
    // Where the GPU time goes, kernel by kernel: cubecl times each kernel and appends a table
    // (name, calls, total time) at every device sync. Slows the run; for diagnosis only.
    if let Some(file) = std::env::var_os("CUDA_AGENT_KERNEL_PROFILE") {
        tracing::info!("kernel profile: {}", PathBuf::from(&file).display());
        config.profiling.logger.level = cubecl_runtime::config::profiling::ProfilingLogLevel::Basic;
        config.profiling.logger.file = Some(PathBuf::from(file));
    }
    CubeClRuntimeConfig::set(config);
}

/// burn's CUDA backend panics in a worker thread when the driver library is missing; check
/// for it first so the error is a sentence.
#[cfg(feature = "cuda")]
fn probe_libcuda() -> Result<()> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/compat",
            "/usr/lib/wsl/lib",
        ]
        .map(PathBuf::from),
    );
    if dirs
        .iter()
        .any(|d| d.join("libcuda.so.1").exists() || d.join("libcuda.so").exists())
    {
        return Ok(());
    }
    let listed = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so"))
        .unwrap_or(false);
    if listed {
        return Ok(());
    }
    bail!("--device cuda: libcuda.so.1 (the NVIDIA driver library) was not found; is there a GPU and a driver on this machine?")
}

fn load_config(c: &Common) -> Result<TrainConfig> {
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

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("tokio runtime")
}

fn run<B: AutodiffBackend>(cmd: &Command, device: B::Device) -> Result<()> {
    let rt = runtime()?;
    match cmd {
        Command::Warmup(a) | Command::Ppo(a) => {
            let warm = matches!(cmd, Command::Warmup(_));
            let (stage, mode, context) = if warm {
                ("warmup", PpoMode::SingleTurn, 0)
            } else {
                ("ppo", PpoMode::MultiTurn, 0)
            };
            let cfg = load_config(&a.common)?;
            let context = if warm {
                cfg.rollout.single_turn_context
            } else {
                cfg.rollout.context.max(context)
            };
            let steps = a.steps.unwrap_or(cfg.ppo.steps);
            let pool = EnvPool::new(&cfg.server)?;
            let opts = StageOptions {
                init: a.common.init.clone(),
                resume: a.resume,
            };
            let kl = cfg.ppo.kl_coef > 0.0;
            let mut learner = Learner::<B>::new(cfg, stage, &opts, context, device)?;
            // The reference policy is the one the stage started from (before any resume).
            let reference = kl
                .then(|| learner.policy().clone())
                .map(|p| burn::module::AutodiffModule::valid(&p));
            ppo::run(&mut learner, &rt, &pool, mode, steps, reference)?;
            println!("{}", learner.stage_dir.join("final").display());
        }
        Command::Rft(d) | Command::ValuePretrain(d) => {
            let value = matches!(cmd, Command::ValuePretrain(_));
            let cfg = load_config(&d.stage.common)?;
            let opts = StageOptions {
                init: d.stage.common.init.clone(),
                resume: d.stage.resume,
            };
            let context = cfg.rollout.context;
            let mut learner = Learner::<B>::new(
                cfg.clone(),
                if value { "value" } else { "rft" },
                &opts,
                context,
                device,
            )?;
            let samples = gather(&learner, &rt, &cfg, &d.trajectories)?;
            let (kept, summary) = rft_filter(samples, cfg.rft.min_reward, context);
            tracing::info!(kept = summary.kept, rejected = ?summary.rejected, "RFT filter");
            std::fs::write(
                learner.stage_dir.join("filter.json"),
                serde_json::to_string_pretty(&summary)?,
            )?;
            if value {
                run_value_pretrain(&mut learner, &kept)?;
            } else {
                run_rft(&mut learner, &kept)?;
            }
            println!("{}", learner.stage_dir.join("final").display());
        }
        Command::Evaluate(e) => {
            let mut cfg = load_config(&e.common)?;
            if e.greedy {
                cfg.rollout.temperature = 0.0;
            }
            let pool = EnvPool::new(&cfg.server)?;
            let context = cfg.rollout.context;
            let learner = Learner::<B>::new(
                cfg.clone(),
                "evaluate",
                &StageOptions {
                    init: e.common.init.clone(),
                    resume: false,
                },
                context,
                device,
            )?;
            let (samples, stats) = rollout(&learner, &rt, &pool, e.episodes, u64::MAX - 1);
            let mut summary = batch_summary(&samples);
            summary["rollout"] = serde_json::to_value(&stats)?;
            let text = serde_json::to_string_pretty(&summary)?;
            if let Some(p) = &e.json {
                std::fs::write(p, &text)?;
            }
            if let Some(p) = &e.episodes_out {
                let tok = learner.renderer.tokenizer();
                let mut out = String::new();
                for s in &samples {
                    let line = serde_json::json!({
                        "task": s.task, "episode_id": s.episode_id, "outcome": s.outcome, "reward": s.reward,
                        "reason": s.reason, "turns": s.turns, "text": tok.decode(&s.tokens),
                    });
                    out.push_str(&line.to_string());
                    out.push('\n');
                }
                std::fs::write(p, out)?;
            }
            println!("{text}");
        }
        Command::Plot(_) | Command::BenchModel(_) => unreachable!("handled in main"),
    }
    Ok(())
}

/// Episodes from trajectory logs, or rolled out with the learner's policy when none are given.
fn gather<B: AutodiffBackend>(
    learner: &Learner<B>,
    rt: &tokio::runtime::Runtime,
    cfg: &TrainConfig,
    dirs: &[PathBuf],
) -> Result<Vec<Sample>> {
    if dirs.is_empty() {
        let pool = EnvPool::new(&cfg.server)?;
        let (samples, stats) = rollout(learner, rt, &pool, cfg.rft.rollouts, u64::MAX - 2);
        tracing::info!(
            episodes = stats.episodes,
            failed = stats.failed,
            "rolled out trajectories for {}",
            learner.stage
        );
        return Ok(samples);
    }
    let mut all = Vec::new();
    for d in dirs {
        let (samples, bad) = samples_from_dir(d, &learner.renderer)?;
        tracing::info!(dir = %d.display(), read = samples.len(), unreadable = bad, "trajectory logs");
        all.extend(samples);
    }
    Ok(all)
}

fn rollout<B: AutodiffBackend>(
    learner: &Learner<B>,
    rt: &tokio::runtime::Runtime,
    pool: &EnvPool,
    n: usize,
    step: u64,
) -> (Vec<Sample>, trainer::rollout::RolloutStats) {
    let lm = burn::module::AutodiffModule::valid(learner.policy());
    let mut generator = learner.generator(&lm);
    let resets = learner.resets_for(step as usize, n);
    let settings = RolloutSettings::multi_turn(&learner.cfg.rollout, learner.renderer.stop_ids());
    let seed = seed_of(learner.cfg.run.seed, step, 0);
    run_episodes(
        rt,
        pool,
        &learner.renderer,
        &mut generator,
        &resets,
        &settings,
        &format!("eval-{seed:x}"),
        seed,
    )
}

/// Qwen2.5-0.5B's architecture (the shape the benchmark defaults to).
const QWEN25_05B: &str = r#"{"model_type":"qwen2","vocab_size":151936,"hidden_size":896,"intermediate_size":4864,
"num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,"max_position_embeddings":32768,
"rope_theta":1000000.0,"rms_norm_eps":1e-6,"tie_word_embeddings":true}"#;

/// `engine_note` is appended to the backend's name in the report (the CUDA path names its
/// matmul choice).
fn bench<B: AutodiffBackend>(a: &BenchArgs, device: B::Device, engine_note: &str) -> Result<()> {
    use burn::tensor::{Bool, ElementConversion, Int, Tensor, TensorData};
    use std::time::Instant;
    use trainer::generate::{generate, SamplingParams};
    use trainer::model::{Architecture, CausalLm, ModelConfig};
    let cfg = match &a.shape {
        Some(p) => ModelConfig::from_file(p)?,
        None => ModelConfig::from_json(QWEN25_05B)?,
    };
    let sync = |d: &B::Device| B::sync(d).map_err(|e| anyhow::anyhow!("device sync: {e:?}"));
    B::seed(&device, 0);
    let t_init = Instant::now();
    let lm = CausalLm::<B>::random(&cfg, &device);
    let positions = a.seq.max(a.prompt + a.new_tokens) + 1;
    let arch = Architecture::<B>::new(cfg.clone(), positions, &device);
    sync(&device)?;
    // Printed apart from the passes: on a fresh GPU machine kernel compilation lands here first.
    eprintln!(
        "model initialised in {:.3} s",
        t_init.elapsed().as_secs_f64()
    );
    let tokens_of = |b: usize, t: usize| -> Vec<i32> {
        (0..b * t)
            .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as i32)
            .collect()
    };
    // Training: forward (log-probabilities of every next token) and backward.
    let (b, t) = (a.train_batch, a.seq);
    let mut times = Vec::new();
    let mut first_loss = 0.0;
    let train_passes = if a.train_iters == 0 {
        0
    } else {
        a.train_iters + 1
    };
    for i in 0..train_passes {
        let tokens =
            Tensor::<B, 2, Int>::from_data(TensorData::new(tokens_of(b, t), [b, t]), &device);
        let valid =
            Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; b * t], [b, t]), &device);
        sync(&device)?;
        let t0 = Instant::now();
        let stats = lm.sequence_stats(tokens, valid, &arch, 1.0);
        let loss = stats.logprobs.mean().neg();
        let grads = loss.backward();
        drop(grads);
        sync(&device)?;
        if i > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
        // The same weights and tokens every pass: kernel choices that change the numbers show
        // here. Read once, outside the timed region.
        if i == 0 {
            first_loss = loss.into_scalar().elem::<f64>();
        }
        eprintln!("train pass {i}: {:.3} s", t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let train = times.get(times.len() / 2).map(|&train_s| {
        serde_json::json!({"batch": b, "seq": t, "seconds": train_s, "tokens_per_s": (b * t) as f64 / train_s, "loss": first_loss})
    });
    let mut gen_rows = Vec::new();
    let inner = burn::module::AutodiffModule::valid(&lm);
    let inner_arch = Architecture::<B::InnerBackend>::new(cfg.clone(), positions, &device);
    for &gb in &a.gen_batch {
        let prompts: Vec<Vec<u32>> = (0..gb)
            .map(|r| {
                tokens_of(1, a.prompt)
                    .iter()
                    .map(|&x| ((x as usize + r) % cfg.vocab_size) as u32)
                    .collect()
            })
            .collect();
        let params = SamplingParams {
            temperature: 1.0,
            max_new_tokens: a.new_tokens,
            ..Default::default()
        };
        let mut best = f64::INFINITY;
        for rep in 0..2 {
            sync(&device)?;
            let t0 = Instant::now();
            let out = generate(&inner, &inner_arch, &prompts, &params, None, rep, &device);
            sync(&device)?;
            let dt = t0.elapsed().as_secs_f64();
            let n: usize = out.iter().map(|g| g.tokens.len()).sum();
            eprintln!("generate batch {gb} run {rep}: {n} tokens in {dt:.3} s");
            if rep > 0 || a.gen_batch.len() == 1 {
                best = best.min(dt);
            }
            if rep == 1 {
                gen_rows.push(serde_json::json!({"batch": gb, "prompt": a.prompt, "new_tokens": a.new_tokens, "seconds": best, "tokens_per_s": n as f64 / best}));
            }
        }
    }
    let products = if a.products {
        bench_products::<B::InnerBackend>(&cfg, &a.gen_batch, &device)?
    } else {
        Vec::new()
    };
    let report = serde_json::json!({
        "products": products,
        "engine": format!("burn {}{engine_note}", B::name(&device)),
        "params": param_count(&cfg),
        "train": train,
        "generate": gen_rows,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// A named way to compute one product.
type Formulation<'a, B> = (
    &'static str,
    Box<dyn Fn() -> burn::tensor::Tensor<B, 2> + 'a>,
);

/// Times `[rows, k] x [k, n]` for the products of one decoding step (per layer: q/k/v,
/// output, gate/up, down; then the tied head) in four formulations, and prints a table.
fn bench_products<B: burn::tensor::backend::Backend>(
    cfg: &trainer::model::ModelConfig,
    batches: &[usize],
    device: &B::Device,
) -> Result<Vec<serde_json::Value>> {
    use burn::tensor::{Distribution, ElementConversion, Tensor};
    use std::time::Instant;
    let (d, hd) = (cfg.hidden_size, cfg.head_dim);
    let qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd;
    let shapes = [
        ("qkv", d, qkv),
        ("o", cfg.num_attention_heads * hd, d),
        ("gate_up", d, 2 * cfg.intermediate_size),
        ("down", cfg.intermediate_size, d),
        ("head", d, cfg.vocab_size),
    ];
    let sync = || B::sync(device).map_err(|e| anyhow::anyhow!("device sync: {e:?}"));
    let mut rows = Vec::new();
    eprintln!("| rows | product | k | n | plain us | split-k 8 us | rows as batch us | transposed us | max diff |");
    eprintln!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for &m in batches {
        for (name, k, n) in shapes {
            let x = Tensor::<B, 2>::random([m, k], Distribution::Normal(0.0, 1.0), device);
            let w = Tensor::<B, 2>::random([k, n], Distribution::Normal(0.0, 0.02), device);
            let split = 8;
            let forms: [Formulation<'_, B>; 4] = [
                ("plain", Box::new(|| x.clone().matmul(w.clone()))),
                (
                    "split-k",
                    Box::new(|| {
                        let xs = x.clone().reshape([m, split, k / split]).swap_dims(0, 1);
                        let ws = w.clone().reshape([split, k / split, n]);
                        xs.matmul(ws).sum_dim(0).reshape([m, n])
                    }),
                ),
                (
                    "rows-as-batch",
                    Box::new(|| {
                        x.clone()
                            .reshape([m, 1, k])
                            .matmul(w.clone().unsqueeze::<3>())
                            .reshape([m, n])
                    }),
                ),
                (
                    "transposed",
                    Box::new(|| {
                        w.clone()
                            .transpose()
                            .matmul(x.clone().transpose())
                            .transpose()
                    }),
                ),
            ];
            let mut times = Vec::new();
            let reference = forms[0].1();
            let mut worst = 0.0f64;
            for (form, f) in &forms {
                if *form == "split-k" && k % split != 0 {
                    times.push(f64::NAN);
                    continue;
                }
                // Warm-up compiles the kernels (and checks the formulation); then 20 back to back.
                let diff: f64 = (f() - reference.clone()).abs().max().into_scalar().elem();
                worst = worst.max(diff);
                sync()?;
                let t0 = Instant::now();
                // Results are kept until the sync so that none is skipped as unused.
                let outs: Vec<_> = (0..20).map(|_| f()).collect();
                sync()?;
                drop(outs);
                times.push(t0.elapsed().as_secs_f64() / 20.0 * 1e6);
            }
            eprintln!(
                "| {m} | {name} | {k} | {n} | {:.0} | {:.0} | {:.0} | {:.0} | {worst:.2e} |",
                times[0], times[1], times[2], times[3]
            );
            rows.push(serde_json::json!({"rows": m, "product": name, "k": k, "n": n, "max_diff": worst, "us": {"plain": times[0], "split_k8": times[1], "rows_as_batch": times[2], "transposed": times[3]}}));
        }
    }
    Ok(rows)
}

fn param_count(c: &trainer::model::ModelConfig) -> usize {
    let hd = c.head_dim;
    let attn = c.hidden_size * hd * (c.num_attention_heads * 2 + c.num_key_value_heads * 2);
    let mlp = 3 * c.hidden_size * c.intermediate_size;
    let emb = c.vocab_size * c.hidden_size * if c.tie_word_embeddings { 1 } else { 2 };
    c.num_hidden_layers * (attn + mlp) + emb
}
