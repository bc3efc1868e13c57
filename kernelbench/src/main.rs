//! `kernelbench`: list tasks, replay solutions through a server, and print the report.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use env_api::{ErrorChain, EvaluateRequest, SolutionRef, TaskRef};
use kernelbench::report::{
    by_level, markdown, speedup_distribution, ResultRecord, SPEEDUP_BUCKETS,
};
use kernelbench::{Task, TaskSet};

/// Tasks in KernelBench format: list, replay, report.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// List tasks (id, level, hash).
    List {
        /// A KernelBench checkout (level1/ level2/ level3/) or a directory of task files (default: the bundled suite).
        #[arg(long)]
        kernelbench_dir: Option<PathBuf>,
        /// Only this split (all, level1, level2, level3).
        #[arg(long, default_value = "all")]
        split: String,
    },
    /// Evaluate solutions through a running server's /v1/evaluate and print the report.
    Replay {
        /// Server URL.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        server: String,
        /// Bearer token.
        #[arg(long, env = "CUDA_AGENT_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Solutions: `<dir>/L1/1_ReLU.py`, `<dir>/L1_1_ReLU.py`, or KernelBench's
        /// `level_1_problem_1_sample_0_kernel.py`.
        #[arg(long, conflicts_with = "trajectories")]
        solutions: Option<PathBuf>,
        /// The server's trajectory logs (`<data-dir>/trajectories`): the files of each finished episode.
        #[arg(long)]
        trajectories: Option<PathBuf>,
        /// Task source (default: the bundled suite); must match the server's.
        #[arg(long)]
        kernelbench_dir: Option<PathBuf>,
        /// Tasks to score (a missing solution counts as a failure).
        #[arg(long, default_value = "all")]
        split: String,
        /// Evaluations at once.
        #[arg(long, default_value_t = 4)]
        jobs: usize,
        /// Results, one JSON object per line; tasks already in it are skipped (resume).
        #[arg(long, default_value = "replay-results.jsonl")]
        out: PathBuf,
        /// Write the report as JSON too.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Draw the speedup distribution per level as a PNG chart.
        #[arg(long)]
        png: Option<PathBuf>,
    },
    /// Synthesize fused tasks from PyTorch's own operators, filtered as the CUDA Agent recipe does.
    Synth {
        /// Tasks to accept.
        #[arg(long, default_value_t = 100)]
        count: usize,
        /// Seed of the composition (the same seed gives the same tasks).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Device the filters run on (cpu or cuda).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Output directory: level2/*.py and manifest.jsonl (appended: a rerun adds to it, skipping duplicates).
        #[arg(long, default_value = "synth-tasks")]
        out: PathBuf,
        /// Python interpreter with torch.
        #[arg(long, env = "CUDA_AGENT_PYTHON", default_value = "python3")]
        python: PathBuf,
        /// Input sizes the filters use (default: small on CPU, full on CUDA).
        #[arg(long, value_parser = ["small", "full"])]
        size: Option<String>,
        /// Shortest eager runtime kept, ms.
        #[arg(long, default_value_t = 1.0)]
        min_ms: f64,
        /// Longest eager runtime kept, ms.
        #[arg(long, default_value_t = 100.0)]
        max_ms: f64,
        /// torch.compile backend of the compile filter (`inductor`; `eager` only checks that it traces).
        #[arg(long, default_value = "inductor")]
        compile_backend: String,
        /// Also run a known non-deterministic and a known constant composition through the filters.
        #[arg(long, conflicts_with = "llm_url")]
        plant_bad: bool,
        #[command(flatten)]
        llm: LlmArgs,
    },
    /// Print the report of a results file.
    Report {
        /// Results (from replay), one JSON object per line.
        results: PathBuf,
        /// Write the report as JSON too.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Draw the speedup distribution per level as a PNG chart.
        #[arg(long)]
        png: Option<PathBuf>,
    },
}

/// Synthesis by a model instead of random composition.
#[derive(Debug, clap::Args)]
struct LlmArgs {
    /// A chat-completions endpoint's base URL (`http://127.0.0.1:8000/v1`): a model proposes
    /// the tasks from samples of the seed operators, and the filters judge them.
    #[arg(long)]
    llm_url: Option<String>,
    /// The model to ask (default: the first `GET /models` lists).
    #[arg(long, requires = "llm_url")]
    model: Option<String>,
    /// The environment variable holding the endpoint's API key (sent as a bearer token).
    #[arg(long, requires = "llm_url")]
    api_key_env: Option<String>,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Requests at most (default: 5 per task asked for).
    #[arg(long)]
    max_requests: Option<usize>,
    /// Seed operators offered per prompt.
    #[arg(long, default_value_t = 8)]
    ops_per_prompt: usize,
    /// Most completion tokens per answer.
    #[arg(long, default_value_t = 2048)]
    max_tokens: u64,
    /// Sampling temperature (default: the server's).
    #[arg(long)]
    temperature: Option<f64>,
    /// Longest wait for one request attempt, seconds.
    #[arg(long, default_value_t = 300)]
    request_timeout_s: u64,
    /// Retries per request on 429, 5xx and connection errors (exponential backoff).
    #[arg(long, default_value_t = 5)]
    max_retries: u32,
    /// Operator-sequence similarity (0-1) at which a proposal is a near-duplicate of a
    /// reference or already accepted task.
    #[arg(long, default_value_t = kernelbench::similarity::DEFAULT_THRESHOLD)]
    max_similarity: f64,
    /// Tasks proposals must not nearly duplicate (default: the bundled suite).
    #[arg(long)]
    kernelbench_dir: Option<PathBuf>,
    /// Longest the filters may take over one proposal, seconds (then it is rejected).
    #[arg(long, default_value_t = 600)]
    judge_timeout_s: u64,
    /// Memory a proposal's run in the sandbox may hold, MiB (past it, it is rejected).
    #[arg(long, default_value_t = 4096)]
    judge_memory_mb: u64,
    /// Processes (threads included) a proposal's run may have at once.
    #[arg(long, default_value_t = 128)]
    judge_processes: u64,
}

fn load_tasks(dir: &Option<PathBuf>) -> anyhow::Result<TaskSet> {
    Ok(match dir {
        Some(d) => TaskSet::load_dir(d)?,
        None => TaskSet::bundled(),
    })
}

/// Finds the solution files for a task in a solutions directory.
fn solution_for(dir: &Path, task: &Task) -> Option<BTreeMap<String, String>> {
    let flat = task.id.replace('/', "_");
    let number = task.name.split('_').next().unwrap_or("");
    let mut candidates = vec![
        dir.join(format!("{}.py", task.id)),
        dir.join(format!("{flat}.py")),
    ];
    let prefix = format!("level_{}_problem_{number}_sample_", task.level);
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut kb: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix) && n.ends_with("_kernel.py"))
            })
            .collect();
        kb.sort();
        candidates.extend(kb);
    }
    let path = candidates.into_iter().find(|p| p.is_file())?;
    let text = std::fs::read_to_string(path).ok()?;
    Some([("model_new.py".to_string(), text)].into())
}

/// The last finished episode's files per task, from trajectory logs.
fn solutions_from_trajectories(
    dir: &Path,
) -> anyhow::Result<BTreeMap<String, BTreeMap<String, String>>> {
    let mut out = BTreeMap::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| dir.display().to_string())?
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    for f in files
        .into_iter()
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
    {
        let text = std::fs::read_to_string(&f)?;
        for line in text.lines() {
            let Ok(env_api::TrajectoryRecord::Final { body, .. }) = serde_json::from_str(line)
            else {
                continue;
            };
            // Final records older than the judged files carry neither task nor files.
            if body.task.is_empty() {
                continue;
            }
            out.insert(body.task, body.files);
        }
    }
    Ok(out)
}

fn read_results(path: &Path) -> anyhow::Result<Vec<ResultRecord>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

fn print_report(
    results: &[ResultRecord],
    json: Option<&Path>,
    png: Option<&Path>,
) -> anyhow::Result<()> {
    let table = by_level(results);
    print!("{}", markdown(&table));
    if let Some(p) = json {
        std::fs::write(p, serde_json::to_vec_pretty(&table)?)?;
    }
    if let Some(p) = png {
        speedup_chart(results).render(720, 360).save_png(p)?;
        eprintln!("chart written to {}", p.display());
    }
    Ok(())
}

/// Bars per speedup bucket, one series per level, in percent of the level's tasks.
fn speedup_chart(results: &[ResultRecord]) -> charts::BarChart {
    charts::BarChart {
        title: format!("speedup over eager ({} tasks)", results.len()),
        y_label: "% of the tasks of each level".into(),
        categories: SPEEDUP_BUCKETS.iter().map(|s| s.to_string()).collect(),
        series: speedup_distribution(results)
            .into_iter()
            .map(|(level, shares)| (level, shares.iter().map(|x| x * 100.0).collect()))
            .collect(),
    }
}

fn failure(task: &Task, reason: &str) -> ResultRecord {
    ResultRecord {
        task: task.id.clone(),
        level: task.level,
        reward: -1.0,
        correct: false,
        speedup_eager: None,
        speedup_compile: None,
        reason: Some(reason.into()),
    }
}

#[allow(clippy::too_many_arguments)]
async fn replay(
    server: String,
    api_key: Option<String>,
    solutions: Option<PathBuf>,
    trajectories: Option<PathBuf>,
    tasks: TaskSet,
    split: String,
    jobs: usize,
    out: PathBuf,
) -> anyhow::Result<Vec<ResultRecord>> {
    let mut client = env_client::EnvClient::new(&server, Duration::from_secs(3600))?;
    if let Some(k) = api_key {
        client = client.with_api_key(k);
    }
    client
        .health()
        .await
        .with_context(|| format!("server {server}"))?;
    let done: BTreeSet<String> = if out.exists() {
        read_results(&out)?.into_iter().map(|r| r.task).collect()
    } else {
        BTreeSet::new()
    };
    let from_logs = match &trajectories {
        Some(d) => solutions_from_trajectories(d)?,
        None => BTreeMap::new(),
    };
    let todo: Vec<Task> = tasks
        .split(&split)
        .into_iter()
        .filter(|t| !done.contains(&t.id))
        .cloned()
        .collect();
    let bar = indicatif::ProgressBar::new(todo.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg} [{elapsed}<{eta}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let file = Arc::new(std::sync::Mutex::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&out)?,
    ));
    let sem = Arc::new(tokio::sync::Semaphore::new(jobs.max(1)));
    let mut handles = Vec::new();
    for task in todo {
        let files = match (&solutions, from_logs.get(&task.id)) {
            (Some(dir), _) => solution_for(dir, &task),
            (None, Some(f)) => Some(f.clone()),
            _ => None,
        };
        let (client, sem, file, bar) = (client.clone(), sem.clone(), file.clone(), bar.clone());
        handles.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await;
            let rec = match files {
                None => failure(&task, "missing_solution: no solution file for this task"),
                Some(files) => {
                    let req = EvaluateRequest {
                        task: TaskRef::Id(task.id.clone()),
                        solution: SolutionRef::Files { files },
                        options: None,
                    };
                    match client.evaluate(&req).await {
                        Ok(r) => ResultRecord {
                            task: task.id.clone(),
                            level: task.level,
                            reward: r.reward,
                            correct: r.correct,
                            speedup_eager: r.speedup.eager,
                            speedup_compile: r.speedup.compile,
                            reason: r.reason,
                        },
                        Err(e) => failure(&task, &format!("evaluation_error: {}", ErrorChain(&e))),
                    }
                }
            };
            if let Ok(mut f) = file.lock() {
                let _ = writeln!(f, "{}", serde_json::to_string(&rec).unwrap_or_default());
            }
            bar.set_message(task.id.clone());
            bar.inc(1);
        }));
    }
    for h in handles {
        h.await?;
    }
    bar.finish_and_clear();
    // Every task of the split, in the order of the file (resumed runs included).
    let wanted: BTreeSet<String> = tasks
        .split(&split)
        .into_iter()
        .map(|t| t.id.clone())
        .collect();
    Ok(read_results(&out)?
        .into_iter()
        .filter(|r| wanted.contains(&r.task))
        .collect())
}

fn synth(python: &Path, args: &[String], count: usize, out: &Path) -> anyhow::Result<()> {
    use std::io::BufRead as _;
    std::fs::create_dir_all(out)?;
    let script = out.join(".synth.py");
    std::fs::write(&script, kernelbench::synth::SYNTH_PY)?;
    let started = std::time::Instant::now();
    let mut child = std::process::Command::new(python)
        .arg(&script)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", python.display()))?;
    let bar = indicatif::ProgressBar::new(count as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} accepted, {msg} [{elapsed}<{eta}]",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let (mut accepted, mut rejected, mut seeds) = (0usize, BTreeMap::<String, usize>::new(), 0u64);
    let mut patterns = BTreeMap::<String, usize>::new();
    for line in std::io::BufReader::new(child.stdout.take().context("stdout")?).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line?) else {
            continue;
        };
        match v["event"].as_str() {
            Some("seeds") => seeds = v["count"].as_u64().unwrap_or(0),
            Some("candidate") if v["verdict"] == "accepted" => {
                accepted += 1;
                *patterns
                    .entry(v["pattern"].as_str().unwrap_or("?").to_string())
                    .or_default() += 1;
                bar.inc(1);
            }
            Some("candidate") => {
                let reason = v["reason"].as_str().unwrap_or("?");
                let kind = reason.split(':').next().unwrap_or(reason).to_string();
                *rejected.entry(kind).or_default() += 1;
                bar.set_message(format!("{} rejected", rejected.values().sum::<usize>()));
            }
            _ => {}
        }
    }
    let status = child.wait()?;
    bar.finish_and_clear();
    let _ = std::fs::remove_file(&script);
    anyhow::ensure!(status.success(), "the synthesis worker failed ({status})");
    let total_rejected: usize = rejected.values().sum();
    println!("seed operators mined: {seeds}");
    println!(
        "accepted {accepted} of {} candidates in {:.1} s -> {}",
        accepted + total_rejected,
        started.elapsed().as_secs_f64(),
        out.display()
    );
    println!("| pattern | accepted |\n| --- | --- |");
    for (p, n) in &patterns {
        println!("| {p} | {n} |");
    }
    println!("| rejection | candidates |\n| --- | --- |");
    for (r, n) in &rejected {
        println!("| {r} | {n} |");
    }
    Ok(())
}

/// Synthesis by a model: the filters' settings go to the worker, the rest to the run.
async fn synth_llm(
    llm: LlmArgs,
    count: usize,
    seed: u64,
    device: String,
    out: PathBuf,
    python: PathBuf,
    filter_args: Vec<String>,
) -> anyhow::Result<()> {
    use kernelbench::synth::llm::{self, LlmSynthConfig, Verdict};
    use kernelbench::synth::worker::WorkerConfig;
    let url = llm.llm_url.context("--llm-url")?;
    let api_key = match &llm.api_key_env {
        Some(var) => Some(std::env::var(var).with_context(|| format!("--api-key-env {var}"))?),
        None => None,
    };
    std::fs::create_dir_all(&out)?;
    let script = out.join(".synth.py");
    std::fs::write(&script, kernelbench::synth::SYNTH_PY)?;
    let cfg = LlmSynthConfig {
        url,
        model: llm.model,
        api_key,
        count,
        max_requests: llm.max_requests.unwrap_or(5 * count),
        concurrency: llm.concurrency.max(1),
        seed,
        ops_per_prompt: llm.ops_per_prompt,
        max_tokens: llm.max_tokens,
        temperature: llm.temperature,
        request_timeout: Duration::from_secs(llm.request_timeout_s),
        max_retries: llm.max_retries,
        out: out.clone(),
        device,
        reference: load_tasks(&llm.kernelbench_dir)?,
        max_similarity: llm.max_similarity,
        worker: WorkerConfig {
            python,
            script: script.clone(),
            args: filter_args,
            timeout: Duration::from_secs(llm.judge_timeout_s),
            start_timeout: Duration::from_secs(300),
            limits: kernelbench::synth::worker::RunLimits {
                memory_bytes: llm.judge_memory_mb << 20,
                processes: llm.judge_processes,
                ..Default::default()
            },
        },
    };
    let bar = indicatif::ProgressBar::new(count as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} accepted, {msg} [{elapsed}<{eta}]",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let started = std::time::Instant::now();
    let result = llm::run(cfg, |rec, report| {
        if rec.verdict == Verdict::Accepted {
            bar.inc(1);
        }
        let rejected: u64 = report.rejected.values().sum();
        let tokens = report.usage.prompt_tokens + report.usage.completion_tokens;
        bar.set_message(format!(
            "{rejected} rejected, {} failed, {tokens} tokens",
            report.failed
        ));
    })
    .await;
    bar.finish_and_clear();
    let _ = std::fs::remove_file(&script);
    let report = result?;
    print!("{}", report.markdown());
    println!(
        "in {:.1} s -> {}",
        started.elapsed().as_secs_f64(),
        out.display()
    );
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    match Cli::parse().cmd {
        Cmd::List {
            kernelbench_dir,
            split,
        } => {
            let tasks = load_tasks(&kernelbench_dir)?;
            for t in tasks.split(&split) {
                println!("{}\tlevel {}\t{}", t.id, t.level, &t.hash[..16]);
            }
            eprintln!("{} tasks", tasks.split(&split).len());
        }
        Cmd::Replay {
            server,
            api_key,
            solutions,
            trajectories,
            kernelbench_dir,
            split,
            jobs,
            out,
            json,
            png,
        } => {
            anyhow::ensure!(
                solutions.is_some() || trajectories.is_some(),
                "give --solutions DIR or --trajectories DIR"
            );
            let tasks = load_tasks(&kernelbench_dir)?;
            let results = replay(
                server,
                api_key,
                solutions,
                trajectories,
                tasks,
                split,
                jobs,
                out,
            )
            .await?;
            print_report(&results, json.as_deref(), png.as_deref())?;
        }
        Cmd::Report { results, json, png } => {
            print_report(&read_results(&results)?, json.as_deref(), png.as_deref())?
        }
        Cmd::Synth {
            count,
            seed,
            device,
            out,
            python,
            size,
            min_ms,
            max_ms,
            compile_backend,
            plant_bad,
            llm,
        } => {
            // The filters' settings, the same for tasks composed at random and by a model.
            let mut filter_args: Vec<String> = vec![
                "--device".into(),
                device.clone(),
                "--min-ms".into(),
                min_ms.to_string(),
                "--max-ms".into(),
                max_ms.to_string(),
                "--compile-backend".into(),
                compile_backend,
            ];
            if let Some(s) = size {
                filter_args.extend(["--size".into(), s]);
            }
            if llm.llm_url.is_some() {
                return synth_llm(llm, count, seed, device, out, python, filter_args).await;
            }
            let mut args: Vec<String> = vec![
                "--count".into(),
                count.to_string(),
                "--seed".into(),
                seed.to_string(),
                "--out".into(),
                out.display().to_string(),
            ];
            args.extend(filter_args);
            if plant_bad {
                args.push("--plant-bad".into());
            }
            synth(&python, &args, count, &out)?;
        }
    }
    Ok(())
}
