//! `env-bench`: load test of a running env-server from a second process.
//!
//! For each concurrency level, that many episodes run at once: reset, `--steps` Glob steps,
//! `--steps` Bash `true` steps, close. Prints p50/p99 latency per call kind and throughput as
//! a Markdown table; with `--server-pid`, also the server's memory per idle episode.

use std::time::{Duration, Instant};

use clap::Parser;
use env_api::{ErrorChain, ResetRequest};
use env_client::EnvClient;
use serde_json::json;

/// Load test of env-server.
#[derive(Debug, Parser)]
struct Args {
    /// Server URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Concurrency levels (episodes at once), comma separated.
    #[arg(long, default_value = "1,16,64,256,1000", value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Glob steps and Bash steps per episode.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Server pid, to measure resident memory per idle episode.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Idle episodes opened for the memory measurement.
    #[arg(long, default_value_t = 1000)]
    idle_episodes: usize,
}

#[derive(Default)]
struct Samples {
    reset: Vec<Duration>,
    glob: Vec<Duration>,
    bash: Vec<Duration>,
    errors: usize,
    requests: usize,
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

async fn episode(c: EnvClient, steps: usize) -> Samples {
    let mut s = Samples::default();
    let t = Instant::now();
    s.requests += 1;
    let id = match c
        .reset(&ResetRequest {
            task: Some("L1/1_ReLU".into()),
            ..Default::default()
        })
        .await
    {
        Ok(r) => r.episode_id,
        Err(e) => {
            eprintln!("reset: {}", ErrorChain(&e));
            s.errors += 1;
            return s;
        }
    };
    s.reset.push(t.elapsed());
    for (tool, args, bucket) in [
        ("Glob", json!({"pattern": "*.py"}), 0),
        ("Bash", json!({"command": "true"}), 1),
    ] {
        for _ in 0..steps {
            let t = Instant::now();
            s.requests += 1;
            match c.step(&id, tool, args.clone()).await {
                Ok(r) if !r.observation.is_error => {
                    if bucket == 0 {
                        s.glob.push(t.elapsed())
                    } else {
                        s.bash.push(t.elapsed())
                    }
                }
                Ok(r) => {
                    eprintln!("{tool}: {}", r.observation.text);
                    s.errors += 1;
                }
                Err(e) => {
                    eprintln!("{tool}: {}", ErrorChain(&e));
                    s.errors += 1;
                }
            }
        }
    }
    s.requests += 1;
    if c.close(&id).await.is_err() {
        s.errors += 1;
    }
    s
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = EnvClient::new(&args.url, Duration::from_secs(600))?.with_retries(0);
    client.health().await?;
    // Memory first, on a fresh server: later load leaves the allocator holding freed memory.
    if let Some(pid) = args.server_pid {
        let before = rss_kib(pid).unwrap_or(0);
        let mut ids = Vec::new();
        for _ in 0..args.idle_episodes {
            ids.push(client.reset(&ResetRequest::default()).await?.episode_id);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after = rss_kib(pid).unwrap_or(0);
        for id in &ids {
            client.close(id).await?;
        }
        let per = (after.saturating_sub(before)) as f64 / args.idle_episodes as f64;
        println!("server resident memory: {before} KiB before, {after} KiB with {} idle episodes open: {per:.1} KiB per idle episode", args.idle_episodes);
    }
    println!("| episodes at once | reset p50 / p99 ms | Glob step p50 / p99 ms | Bash `true` step p50 / p99 ms | requests/s | errors |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for &n in &args.concurrency {
        let start = Instant::now();
        let handles: Vec<_> = (0..n)
            .map(|_| tokio::spawn(episode(client.clone(), args.steps)))
            .collect();
        let mut all = Samples::default();
        for h in handles {
            let s = h.await?;
            all.reset.extend(s.reset);
            all.glob.extend(s.glob);
            all.bash.extend(s.bash);
            all.errors += s.errors;
            all.requests += s.requests;
        }
        let wall = start.elapsed().as_secs_f64();
        println!(
            "| {n} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} | {} |",
            pct(&mut all.reset, 0.5),
            pct(&mut all.reset, 0.99),
            pct(&mut all.glob, 0.5),
            pct(&mut all.glob, 0.99),
            pct(&mut all.bash, 0.5),
            pct(&mut all.bash, 0.99),
            all.requests as f64 / wall,
            all.errors
        );
    }
    Ok(())
}
