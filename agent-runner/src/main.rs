//! `agent-runner`: cuda-agent episodes driven by an OpenAI-compatible model.
//!
//! ```sh
//! agent-runner --base-url http://127.0.0.1:8000/v1 --tasks level1 --samples 4 --out runs/m
//! kernelbench report runs/m/results.jsonl
//! agent-runner optimize my_module.py --input-shape 16,1024 --episodes 4 --out optimized
//! ```

use std::path::PathBuf;
use std::time::Duration;

use agent_runner::agent::{Agent, AgentLimits, PromptStyle};
use agent_runner::openai::{ChatClient, Sampling};
use agent_runner::optimize::{optimize, task_source, with_allowed_ops, OptimizeError};
use agent_runner::run::{jobs_for, result_record, run_jobs, select_tasks, totals};
use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};

/// Runs cuda-agent episodes with an OpenAI-compatible chat model: `--tasks SPLIT --samples N`
/// for a KernelBench table, or `optimize FILE` for a faster version of your own module.
#[derive(Debug, Parser)]
#[command(version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Make a PyTorch module faster: register it as a task, run episodes on it, write the
    /// best correct model_new.py with its verified speedups, report.md and speedup.png.
    Optimize(OptimizeArgs),
}

/// Where the environment and the model are, and how episodes run.
#[derive(Debug, Args)]
struct Common {
    /// The environment server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    server: String,
    /// Variable holding the environment server's API key, if it needs one.
    #[arg(long, default_value = "CUDA_AGENT_API_KEY")]
    server_api_key_env: String,
    /// The model server's OpenAI-compatible base URL (the part before /chat/completions).
    #[arg(long, default_value = "http://127.0.0.1:8000/v1")]
    base_url: String,
    /// The model name (default: the first one the server's /models lists).
    #[arg(long)]
    model: Option<String>,
    /// Variable holding the model server's API key (sent as a bearer token when set).
    #[arg(long, default_value = "OPENAI_API_KEY")]
    api_key_env: String,
    /// Sampling temperature (default: the model server's).
    #[arg(long)]
    temperature: Option<f64>,
    /// Nucleus sampling (default: the model server's).
    #[arg(long)]
    top_p: Option<f64>,
    /// `auto` (the model decides; vLLM needs --enable-auto-tool-choice and a tool-call
    /// parser for it), `required` (a tool call every reply) or `none`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "required", "none"])]
    tool_choice: String,
    /// Offer the model only these tools (comma separated; default: every tool of the episode).
    #[arg(long, value_delimiter = ',')]
    tools: Vec<String>,
    /// Most tokens per model reply.
    #[arg(long, default_value_t = 4096)]
    max_tokens: u64,
    /// The model's context in tokens (default: learned from its context-length errors).
    #[arg(long)]
    context_tokens: Option<u64>,
    /// The first prompt: `full` (every tool, whole descriptions), `compact` (Bash, Read,
    /// Write, Edit and Submit, short descriptions: for small contexts) or `auto` (compact
    /// where the full one would take over a third of the context, or does not fit it).
    #[arg(long, default_value = "auto")]
    prompt: PromptStyle,
    /// Tool calls per episode (default: the environment server's).
    #[arg(long)]
    max_turns: Option<u32>,
    /// Tool-time budget per episode, seconds (default: the environment server's).
    #[arg(long)]
    time_budget_s: Option<f64>,
    /// Model replies in a row without a tool call before the runner submits for the model.
    #[arg(long, default_value_t = 3)]
    max_idle_replies: u32,
    /// Model calls per episode before the runner submits for the model.
    #[arg(long, default_value_t = 400)]
    max_model_calls: u32,
    /// Characters of one tool output put into the conversation (the middle is cut beyond).
    #[arg(long, default_value_t = 16000)]
    max_observation_chars: usize,
    /// Episodes at once.
    #[arg(long, default_value_t = 8)]
    jobs: usize,
    /// Seconds one model call may take.
    #[arg(long, default_value_t = 600)]
    request_timeout_s: u64,
    /// Retries of a model call on 429, 5xx and connection errors (exponential backoff).
    #[arg(long, default_value_t = 8)]
    max_retries: u32,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// A split (all, level1, level2, level3, tiny) or task ids separated by commas.
    #[arg(long, default_value = "level1")]
    tasks: String,
    /// Episodes per task.
    #[arg(long, default_value_t = 1)]
    samples: u32,
    /// Output: episodes.jsonl, results.jsonl (for `kernelbench report`), trajectories/.
    #[arg(long, default_value = "agent-runs")]
    out: PathBuf,
    /// Do not save each episode's trajectory log and messages.
    #[arg(long)]
    no_trajectories: bool,
    #[command(flatten)]
    common: Common,
}

#[derive(Debug, Args)]
struct OptimizeArgs {
    /// A Python file with an nn.Module (KernelBench style: Model, get_inputs, get_init_inputs;
    /// or any module class with --input-shape).
    module: PathBuf,
    /// Episodes to run on it.
    #[arg(long, default_value_t = 4)]
    episodes: u32,
    /// Shape of an input tensor (float32, random), such as 16,1024; repeat for more inputs.
    #[arg(long, value_parser = parse_shape)]
    input_shape: Vec<Vec<usize>>,
    /// The module class to optimize, when the file has several.
    #[arg(long)]
    class: Option<String>,
    /// Aten operators ModelNew may still call (comma separated, such as `mm,addmm` to keep
    /// PyTorch's matmul for an nn.Linear): written into the task as its ALLOW_OPS, which the
    /// evaluation and the agent's verify.py read.
    #[arg(long, value_delimiter = ',')]
    allow_ops: Vec<String>,
    /// Output: model_new.py (and its kernels), report.md, speedup.png, episodes/.
    #[arg(long, default_value = "optimized")]
    out: PathBuf,
    #[command(flatten)]
    common: Common,
}

fn parse_shape(s: &str) -> Result<Vec<usize>, String> {
    let dims: Result<Vec<usize>, _> = s
        .split([',', 'x'])
        .map(|d| d.trim().parse::<usize>())
        .collect();
    match dims {
        Ok(d) if !d.is_empty() && d.iter().all(|&x| x > 0) => Ok(d),
        _ => Err(format!(
            "{s:?} is not a shape (positive sizes separated by commas)"
        )),
    }
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

async fn agent(c: &Common) -> anyhow::Result<Agent> {
    let mut env = env_client::EnvClient::new(&c.server, Duration::from_secs(3600))?;
    if let Some(k) = env_var(&c.server_api_key_env) {
        env = env.with_api_key(k);
    }
    env.health()
        .await
        .with_context(|| format!("environment server {}", c.server))?;
    let timeout = Duration::from_secs(c.request_timeout_s.max(1));
    let key = env_var(&c.api_key_env);
    let mut chat = ChatClient::new(&c.base_url, c.model.as_deref().unwrap_or(""), key, timeout)?;
    chat.retry.max_retries = c.max_retries;
    if c.model.is_none() {
        chat.model = chat
            .first_model()
            .await
            .with_context(|| format!("listing the models of {}", c.base_url))?;
    }
    tracing::info!(model = %chat.model, base_url = %c.base_url, "model");
    Ok(Agent {
        env,
        chat,
        sampling: Sampling {
            temperature: c.temperature,
            top_p: c.top_p,
            max_tokens: c.max_tokens.max(1),
            tool_choice: c.tool_choice.clone(),
        },
        limits: AgentLimits {
            max_turns: c.max_turns,
            time_budget_s: c.time_budget_s,
            max_idle_replies: c.max_idle_replies.max(1),
            max_model_calls: c.max_model_calls.max(1),
            max_observation_chars: c.max_observation_chars.max(256),
            context_tokens: c.context_tokens,
            tools: (!c.tools.is_empty()).then(|| c.tools.clone()),
            prompt: c.prompt,
            ..AgentLimits::default()
        },
    })
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let agent = agent(&args.common).await?;
    let listed = agent.env.tasks().await.context("listing the tasks")?;
    let tasks = select_tasks(&listed.tasks, &args.tasks)?;
    let jobs = jobs_for(&tasks, args.samples.max(1));
    eprintln!(
        "{} tasks x {} samples with {} ({} at once) into {}",
        tasks.len(),
        args.samples.max(1),
        agent.chat.model,
        args.common.jobs,
        args.out.display()
    );
    let summary = run_jobs(
        agent,
        jobs,
        &args.out,
        args.common.jobs,
        !args.no_trajectories,
    )
    .await?;
    let wanted: std::collections::BTreeSet<&str> = tasks.iter().map(|t| t.id.as_str()).collect();
    let results: Vec<_> = summary
        .records
        .iter()
        .filter(|r| wanted.contains(r.task.as_str()))
        .map(result_record)
        .collect();
    print!(
        "{}",
        kernelbench::report::markdown(&kernelbench::report::by_level(&results))
    );
    eprint!("{}", totals(&summary));
    eprintln!(
        "the same table: kernelbench report {}",
        args.out.join("results.jsonl").display()
    );
    Ok(())
}

async fn optimize_cmd(args: OptimizeArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.module)
        .with_context(|| format!("reading {}", args.module.display()))?;
    let source = with_allowed_ops(
        task_source(&text, &args.input_shape, args.class.as_deref())?,
        &args.allow_ops,
    )?;
    let agent = agent(&args.common).await?;
    let name = args
        .module
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    eprintln!(
        "{} episodes on {name} with {} into {}",
        args.episodes,
        agent.chat.model,
        args.out.display()
    );
    match optimize(
        agent,
        &source,
        &name,
        args.episodes.max(1),
        args.common.jobs,
        &args.out,
    )
    .await
    {
        Ok(o) => {
            let v = &o.verified;
            println!(
                "best: {} (speedup {:.2}x over eager, {} over torch.compile; correct {})",
                args.out.join("model_new.py").display(),
                v.speedup.eager.unwrap_or(0.0),
                v.speedup
                    .compile
                    .map_or("-".to_string(), |s| format!("{s:.2}x")),
                v.correct
            );
            println!("report: {}", o.report.display());
            Ok(())
        }
        Err(e @ OptimizeError::NoCorrect { .. }) => Err(e.into()),
        Err(e) => Err(e).context("optimize"),
    }
}

/// Errors are the user's to act on (a missing file, a module without a class, a server that
/// does not answer): printed as their chain of causes on one line, never with a backtrace,
/// whatever `RUST_BACKTRACE` says (panics still get theirs).
fn main() -> std::process::ExitCode {
    match run_cli() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agent-runner: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_cli() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,agent_runner=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.cmd {
        Some(Cmd::Optimize(a)) => rt.block_on(optimize_cmd(a)),
        None => rt.block_on(run(cli.run)),
    }
}
