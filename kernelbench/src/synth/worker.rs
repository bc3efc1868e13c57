//! The filters' worker: `synth/synth.py --judge`, one long-lived Python process with torch
//! that mines the seed operators once and then judges proposed task sources one at a time.
//! A candidate that hangs or takes the worker down (a model asking for a huge tensor) is
//! rejected and the worker is started again.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Errors of the worker itself (a candidate's failure is a verdict, not an error).
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The interpreter could not be started.
    #[error("starting {python}")]
    Spawn {
        /// The interpreter.
        python: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Talking to the worker failed.
    #[error("the filters' worker")]
    Io(#[source] std::io::Error),
    /// The worker ended or stalled before listing the seed operators.
    #[error("the filters' worker did not start: {0}")]
    Start(String),
}

/// How to run the worker.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Python with torch.
    pub python: PathBuf,
    /// The worker script (written out by the caller).
    pub script: PathBuf,
    /// The filters' settings: `--device`, `--size`, `--min-ms`, `--max-ms`, `--compile-backend`.
    pub args: Vec<String>,
    /// Longest wait for one verdict.
    pub timeout: Duration,
    /// Longest wait for the start (torch's import and the mining of the seeds).
    pub start_timeout: Duration,
}

/// A seed operator the worker mined.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeedOp {
    /// How the operator is written (`F.gelu`, `Tensor.cumsum`, `nn.LayerNorm(64)`).
    pub name: String,
    /// The shape family it was mined on (`vec`, `img`).
    pub family: String,
}

/// The filters' verdict on one source.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterVerdict {
    /// Why it was rejected (`kind: detail`), or `None` if it passed every filter.
    pub reason: Option<String>,
    /// Its eager runtime, ms (when accepted).
    pub eager_ms: Option<f64>,
}

impl FilterVerdict {
    fn rejected(reason: String) -> Self {
        Self {
            reason: Some(reason),
            eager_ms: None,
        }
    }
}

/// A line of the worker's protocol.
#[derive(Debug, Deserialize)]
#[serde(tag = "event", rename_all = "lowercase")]
enum Event {
    Seeds {
        ops: Vec<SeedOp>,
    },
    Verdict {
        id: u64,
        reason: Option<String>,
        eager_ms: Option<f64>,
    },
}

/// A candidate's verdict request.
#[derive(Debug, Serialize)]
struct JudgeRequest<'a> {
    id: u64,
    source: &'a str,
}

/// A running worker.
#[derive(Debug)]
pub struct JudgeWorker {
    config: WorkerConfig,
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    seeds: Vec<SeedOp>,
    next_id: u64,
}

impl JudgeWorker {
    /// Starts the worker and waits for its seed operators.
    pub async fn start(config: WorkerConfig) -> Result<Self, WorkerError> {
        let mut child = Command::new(&config.python)
            .arg(&config.script)
            .arg("--judge")
            .args(&config.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| WorkerError::Spawn {
                python: config.python.clone(),
                source,
            })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(WorkerError::Start("no pipes".into()));
        };
        let mut stdout = BufReader::new(stdout).lines();
        let seeds = tokio::time::timeout(config.start_timeout, async {
            while let Some(line) = stdout.next_line().await.map_err(WorkerError::Io)? {
                if let Ok(Event::Seeds { ops }) = serde_json::from_str(&line) {
                    return Ok(ops);
                }
            }
            Err(WorkerError::Start(format!(
                "{} exited before listing the seed operators",
                config.python.display()
            )))
        })
        .await
        .map_err(|_| {
            WorkerError::Start(format!("no seed operators in {:?}", config.start_timeout))
        })??;
        tracing::info!(seeds = seeds.len(), "filters' worker started");
        Ok(Self {
            config,
            child,
            stdin,
            stdout,
            seeds,
            next_id: 0,
        })
    }

    /// The seed operators mined.
    pub fn seeds(&self) -> &[SeedOp] {
        &self.seeds
    }

    /// Runs `source` through the filters. A candidate that outlasts the timeout, or ends the
    /// worker, is rejected (`judge_timeout`, `worker_died`) and the worker started again.
    pub async fn judge(&mut self, source: &str) -> Result<FilterVerdict, WorkerError> {
        self.next_id += 1;
        let id = self.next_id;
        let mut line = serde_json::to_string(&JudgeRequest { id, source })
            .map_err(|e| WorkerError::Io(e.into()))?;
        line.push('\n');
        let asked = async {
            self.stdin.write_all(line.as_bytes()).await?;
            self.stdin.flush().await?;
            while let Some(l) = self.stdout.next_line().await? {
                if let Ok(Event::Verdict {
                    id: got,
                    reason,
                    eager_ms,
                }) = serde_json::from_str(&l)
                {
                    if got == id {
                        return Ok(Some(FilterVerdict { reason, eager_ms }));
                    }
                }
            }
            Ok::<_, std::io::Error>(None)
        };
        let reason = match tokio::time::timeout(self.config.timeout, asked).await {
            Ok(Ok(Some(v))) => return Ok(v),
            Ok(Ok(None)) | Ok(Err(_)) => {
                let status = self.child.wait().await.map_err(WorkerError::Io)?;
                format!("worker_died: {status}")
            }
            Err(_) => {
                let _ = self.child.kill().await;
                format!("judge_timeout: {} s", self.config.timeout.as_secs())
            }
        };
        tracing::warn!(%reason, "the filters' worker is started again");
        let next_id = self.next_id;
        *self = Self::start(self.config.clone()).await?;
        self.next_id = next_id;
        Ok(FilterVerdict::rejected(reason))
    }
}
