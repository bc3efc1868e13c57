//! `trainer`: the CUDA Agent training stages against env-server, plus evaluation, plots, the
//! model benchmark and an OpenAI-compatible model server.

mod bench;
mod bench_load;
mod bench_ppo;
mod cli;
mod device;
mod serve;
mod stages;

use anyhow::Result;
use clap::Parser;

use cli::{Cli, Command};

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match &cli.command {
        Command::Plot(a) => {
            let out = a
                .out
                .clone()
                .unwrap_or_else(|| a.metrics[0].with_extension("png"));
            anyhow::ensure!(
                a.label.is_empty() || a.label.len() == a.metrics.len(),
                "{} labels for {} metrics files: give one per file or none",
                a.label.len(),
                a.metrics.len()
            );
            let runs: Vec<(String, &std::path::Path)> = a
                .metrics
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let label = match (a.label.get(i), a.metrics.len()) {
                        (Some(l), _) => l.clone(),
                        (None, 1) => String::new(),
                        (None, _) => p.display().to_string(),
                    };
                    (label, p.as_path())
                })
                .collect();
            trainer::plot::plot_runs(&runs, &out)?;
            println!("{}", out.display());
            Ok(())
        }
        Command::BenchModel(b) => device::run_on(b.device, b.precision, bench::Bench(b)),
        Command::BenchPpo(b) => device::run_on(b.device, b.precision, bench_ppo::BenchPpo(b)),
        Command::BenchLoad(b) => bench_load::run(b),
        Command::Serve(s) => device::run_on(s.device, s.precision, serve::Serve(s)),
        Command::Warmup(s) | Command::Ppo(s) => device::run_on(
            s.common.device,
            s.common.precision,
            stages::Stage(&cli.command),
        ),
        Command::Rft(d) | Command::ValuePretrain(d) => device::run_on(
            d.stage.common.device,
            d.stage.common.precision,
            stages::Stage(&cli.command),
        ),
        Command::MemoryPlan(m) => memory_plan(m),
        Command::Evaluate(e) => device::run_on(
            e.common.device,
            e.common.precision,
            stages::Stage(&cli.command),
        ),
    }
}

/// `memory-plan`: the plan of a stage, printed, and checked against `--free-gib`.
fn memory_plan(m: &cli::MemoryPlanArgs) -> Result<()> {
    use anyhow::Context;
    let cfg = cli::load_config(&m.common)?;
    let dir = cfg
        .model
        .path
        .as_deref()
        .context("the plan needs the model's config.json: set model.path or --model")?;
    let model = trainer::model::ModelConfig::from_file(dir)?;
    let context = match m.stage.as_str() {
        "warmup" => cfg.rollout.single_turn_context,
        _ => cfg.rollout.context,
    };
    let elem = match m.common.precision {
        cli::Precision::F32 => 4,
        cli::Precision::Bf16 => 2,
    };
    let plan = trainer::memory::MemoryPlan::new(&model, &cfg, elem, context);
    println!("{plan}");
    if let Some(free) = m.free_gib {
        let bytes = (free * (1u64 << 30) as f64) as u64;
        plan.check(&trainer::memory::DeviceMemory {
            free: bytes,
            total: bytes,
            name: "the device",
        })?;
    }
    Ok(())
}
