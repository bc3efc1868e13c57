//! `trainer`: the CUDA Agent training stages against env-server, plus evaluation, plots, the
//! model benchmark and an OpenAI-compatible model server.

mod bench;
mod bench_load;
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
                .unwrap_or_else(|| a.metrics.with_extension("png"));
            trainer::plot::plot_metrics(&a.metrics, &out)?;
            println!("{}", out.display());
            Ok(())
        }
        Command::BenchModel(b) => device::run_on(b.device, b.precision, bench::Bench(b)),
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
        Command::Evaluate(e) => device::run_on(
            e.common.device,
            e.common.precision,
            stages::Stage(&cli.command),
        ),
    }
}
