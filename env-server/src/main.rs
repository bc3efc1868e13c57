//! `env-server`: serve the environment over HTTP.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use env_server::{build_state, router, spawn_janitor, ServerConfig};

/// The cuda-agent environment server.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    bind: String,
    /// State directory: trajectory logs, workspaces, build cache, baselines.
    #[arg(long, default_value = "./data")]
    data_dir: PathBuf,
    /// Evaluation device.
    #[arg(long, default_value = "auto", value_parser = ["auto", "cpu", "cuda"])]
    device: String,
    /// Tasks: a KernelBench checkout or a directory of task files (default: the bundled suite).
    #[arg(long)]
    tasks: Option<PathBuf>,
    /// Require `Authorization: Bearer KEY` on every call but /v1/health.
    #[arg(long, env = "CUDA_AGENT_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Python interpreter with torch, used for the harness and inside workspaces.
    #[arg(long, env = "CUDA_AGENT_PYTHON", default_value = "python3")]
    python: PathBuf,
    /// Run even where landlock or seccomp is missing (results are marked unconfined).
    #[arg(long)]
    allow_unconfined: bool,
    /// Most open episodes.
    #[arg(long, default_value_t = 4096)]
    max_episodes: usize,
    /// Default turn limit of an episode.
    #[arg(long, default_value_t = 200)]
    max_turns: u32,
    /// Default tool-time budget of an episode, seconds.
    #[arg(long, default_value_t = 300.0)]
    time_budget_s: f64,
    /// Idle episodes are truncated after this many seconds.
    #[arg(long, default_value_t = 1800)]
    idle_timeout_s: u64,
    /// Time limit of each evaluation phase (build; check and time), seconds.
    #[arg(long, default_value_t = 300)]
    eval_timeout_s: u64,
    /// Builds at once (default: the number of cores).
    #[arg(long)]
    max_builds: Option<usize>,
    /// Task input sizes: `small` (CPU-sized) or `full` (default: small on CPU, full on CUDA).
    #[arg(long, value_parser = ["small", "full"])]
    task_size: Option<String>,
    /// Skip torch.compile baselines (the compile milestone is then never reached).
    #[arg(long)]
    skip_compile: bool,
    /// Aten operators candidates may dispatch in their forward beyond allocation, views and
    /// copies (comma separated, such as `mm,addmm` to allow PyTorch's matmul).
    #[arg(long, value_delimiter = ',')]
    allow_ops: Vec<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let args = Args::parse();
    let mut cfg = ServerConfig {
        data_dir: args.data_dir,
        device: args.device,
        tasks_dir: args.tasks,
        api_key: args.api_key,
        python: args.python,
        allow_unconfined: args.allow_unconfined,
        max_episodes: args.max_episodes,
        max_turns: args.max_turns,
        time_budget: Duration::from_secs_f64(args.time_budget_s),
        idle_timeout: Duration::from_secs(args.idle_timeout_s),
        eval_timeout: Duration::from_secs(args.eval_timeout_s),
        task_size: args.task_size,
        skip_compile: args.skip_compile,
        allow_ops: args.allow_ops,
        ..ServerConfig::default()
    };
    if let Some(n) = args.max_builds {
        cfg.max_builds = n;
    }
    let state = build_state(cfg).context("starting the server")?;
    tracing::info!(info = %state.info, "configuration");
    spawn_janitor(state.clone());
    let listener = tokio::net::TcpListener::bind(&args.bind).await.with_context(|| format!("binding {}", args.bind))?;
    tracing::info!(addr = %listener.local_addr()?, "listening");
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
