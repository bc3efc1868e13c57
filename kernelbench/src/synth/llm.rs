//! Synthesis by a model: requests to a chat-completions endpoint, each with a sample of seed
//! operators, run `concurrency` at a time; every answer is judged in turn (code extracted,
//! exact and near-duplicates refused, then the filters' worker), logged with its prompt and
//! verdict, and, when accepted, written as a task with a manifest line naming the model.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::chat::{CallFailed, ChatClient, ChatError, Completion, Message, TokenUsage};
use super::propose::{extract_code, prompt, sample_ops};
use super::worker::{JudgeWorker, SandboxReport, WorkerConfig, WorkerError};
use crate::similarity::{op_sequence, SimilarityIndex};
use crate::{validate_source, TaskSet};
use env_api::ErrorChain;

/// The log of prompts, answers and verdicts in the output directory.
pub const LOG_FILE: &str = "llm-log.jsonl";
/// The cost report in the output directory.
pub const COST_FILE: &str = "llm-cost.json";

/// Errors that stop a run (a bad answer is a verdict, not an error).
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// The endpoint cannot be used.
    #[error(transparent)]
    Chat(#[from] ChatError),
    /// No model was named and the endpoint lists none.
    #[error("finding the endpoint's model")]
    Model(#[source] CallFailed),
    /// The filters' worker failed.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// Writing the output failed.
    #[error("{path}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// The settings of a run.
#[derive(Debug, Clone)]
pub struct LlmSynthConfig {
    /// The endpoint's base URL (`http://127.0.0.1:8000/v1`).
    pub url: String,
    /// The model to ask (default: the first the endpoint lists).
    pub model: Option<String>,
    /// Bearer token.
    pub api_key: Option<String>,
    /// Tasks to accept.
    pub count: usize,
    /// Requests at most (the run ends there even if fewer were accepted).
    pub max_requests: usize,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Seed of the operator samples (the same seed gives the same prompts).
    pub seed: u64,
    /// Seed operators offered per prompt.
    pub ops_per_prompt: usize,
    /// Most completion tokens per answer.
    pub max_tokens: u64,
    /// Sampling temperature (the server's default when absent).
    pub temperature: Option<f64>,
    /// Longest wait for one attempt.
    pub request_timeout: Duration,
    /// Retries per request on 429, 5xx and connection errors.
    pub max_retries: u32,
    /// The output directory: `level2/*.py`, `manifest.jsonl`, [`LOG_FILE`], [`COST_FILE`].
    pub out: PathBuf,
    /// The device the filters run on (named in the prompt).
    pub device: String,
    /// Tasks a candidate must not nearly duplicate (with those already accepted).
    pub reference: TaskSet,
    /// The similarity at or above which a candidate is a near-duplicate.
    pub max_similarity: f64,
    /// The filters' worker.
    pub worker: WorkerConfig,
}

/// How an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Written as a task.
    Accepted,
    /// Judged and refused (the reason says why).
    Rejected,
    /// The request failed (no answer to judge).
    Failed,
}

/// One line of [`LOG_FILE`]: a request, its answer and the verdict.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogRecord {
    /// The request's number (0-based, counted on over reruns into the same directory; with
    /// the seed it picks the operator sample).
    pub request: u64,
    /// The model that answered (or was asked).
    pub model: String,
    /// The seed operators offered.
    pub seed_ops: Vec<String>,
    /// The conversation sent.
    pub prompt: Vec<Message>,
    /// The answer's text (none when the request failed).
    pub answer: Option<String>,
    /// Why the completion ended.
    pub finish_reason: Option<String>,
    /// Tokens of the call.
    pub usage: TokenUsage,
    /// Attempts retried.
    pub retries: u32,
    /// The outcome.
    pub verdict: Verdict,
    /// Why it was rejected or failed (`kind: detail`).
    pub reason: Option<String>,
    /// The most similar known task, when the similarity was checked.
    pub similar_to: Option<String>,
    /// Its similarity.
    pub similarity: Option<f64>,
    /// The candidate's operator sequence (see [`crate::similarity`]).
    pub ops: Vec<String>,
    /// SHA-256 of the candidate's source.
    pub hash: Option<String>,
    /// The task file, relative to the output directory, when accepted.
    pub file: Option<String>,
    /// Eager runtime, ms, when accepted.
    pub eager_ms: Option<f64>,
    /// The sandbox layers this host lacked when the proposal ran (empty: all in force).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sandbox_missing: Vec<String>,
}

/// One line of `manifest.jsonl` for a judged candidate (random synthesis writes its own).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ManifestRecord {
    /// SHA-256 of the source.
    pub hash: String,
    /// Always `llm`: proposed by a model.
    pub pattern: String,
    /// The model that proposed it.
    pub model: String,
    /// Its operator sequence.
    pub ops: Vec<String>,
    /// The seed operators the prompt offered.
    pub seed_ops: Vec<String>,
    /// `accepted` or `rejected`.
    pub verdict: Verdict,
    /// Why it was rejected.
    pub reason: Option<String>,
    /// The task file, when accepted.
    pub file: Option<String>,
    /// Eager runtime, ms, when accepted.
    pub eager_ms: Option<f64>,
    /// Tokens of the call that proposed it.
    pub usage: TokenUsage,
    /// The sandbox layers this host lacked when it ran (empty: all in force).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sandbox_missing: Vec<String>,
}

/// What a run cost and gave.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CostReport {
    /// The model asked.
    pub model: String,
    /// Requests answered.
    pub answered: u64,
    /// Requests that failed after their retries.
    pub failed: u64,
    /// Attempts retried, over all requests.
    pub retries: u64,
    /// Tasks accepted.
    pub accepted: u64,
    /// Rejections by kind (the part of the reason before `:`).
    pub rejected: BTreeMap<String, u64>,
    /// Tokens over all answers.
    pub usage: TokenUsage,
    /// Prompt tokens per accepted task.
    pub prompt_tokens_per_accepted: Option<f64>,
    /// Completion tokens per accepted task.
    pub completion_tokens_per_accepted: Option<f64>,
    /// The confinement the proposals ran under on this host.
    #[serde(default)]
    pub sandbox: Option<SandboxReport>,
}

impl CostReport {
    fn record(&mut self, rec: &LogRecord) {
        self.usage.add(rec.usage);
        self.retries += u64::from(rec.retries);
        match rec.verdict {
            Verdict::Accepted => self.accepted += 1,
            Verdict::Failed => self.failed += 1,
            Verdict::Rejected => {
                let reason = rec.reason.as_deref().unwrap_or("?");
                let kind = reason.split(':').next().unwrap_or(reason);
                *self.rejected.entry(kind.to_string()).or_default() += 1;
            }
        }
        if rec.verdict != Verdict::Failed {
            self.answered += 1;
        }
        let per = |n: u64| (self.accepted > 0).then(|| n as f64 / self.accepted as f64);
        self.prompt_tokens_per_accepted = per(self.usage.prompt_tokens);
        self.completion_tokens_per_accepted = per(self.usage.completion_tokens);
    }

    /// The report as Markdown tables.
    pub fn markdown(&self) -> String {
        let per = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
        let mut s = format!(
            "model: {}\naccepted {} of {} answers ({} requests failed, {} retries)\n\
             | tokens | total | per accepted task |\n| --- | --- | --- |\n\
             | prompt | {} | {} |\n| completion | {} | {} |\n",
            self.model,
            self.accepted,
            self.answered,
            self.failed,
            self.retries,
            self.usage.prompt_tokens,
            per(self.prompt_tokens_per_accepted),
            self.usage.completion_tokens,
            per(self.completion_tokens_per_accepted),
        );
        s.push_str("| rejection | answers |\n| --- | --- |\n");
        for (r, n) in &self.rejected {
            s.push_str(&format!("| {r} | {n} |\n"));
        }
        s
    }
}

/// An answer (or failure) waiting to be judged.
struct Answered {
    request: u64,
    seed_ops: Vec<String>,
    prompt: Vec<Message>,
    result: Result<Completion, CallFailed>,
}

/// The judging side of a run: what is known, and where it goes.
struct Judge {
    worker: JudgeWorker,
    out: PathBuf,
    reference: SimilarityIndex,
    accepted: SimilarityIndex,
    hashes: BTreeSet<String>,
    max_similarity: f64,
    log: std::fs::File,
    manifest: std::fs::File,
    report: CostReport,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn append(path: &Path) -> Result<std::fs::File, SynthError> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io_err(path))
}

/// A manifest line's hash (any mode's manifest has one).
#[derive(Deserialize)]
struct Hashed {
    hash: String,
}

impl Judge {
    fn open(cfg: &LlmSynthConfig, worker: JudgeWorker, model: &str) -> Result<Self, SynthError> {
        let level2 = cfg.out.join("level2");
        std::fs::create_dir_all(&level2).map_err(io_err(&level2))?;
        // Tasks accepted by earlier runs into the same directory count as accepted.
        let mut accepted = SimilarityIndex::default();
        let mut files: Vec<PathBuf> = std::fs::read_dir(&level2)
            .map_err(io_err(&level2))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "py"))
            .collect();
        files.sort();
        for f in files {
            let source = std::fs::read_to_string(&f).map_err(io_err(&f))?;
            let name = f.file_name().map(|n| n.to_string_lossy().into_owned());
            accepted.insert(&format!("level2/{}", name.unwrap_or_default()), &source);
        }
        let manifest_path = cfg.out.join("manifest.jsonl");
        let hashes = match std::fs::read_to_string(&manifest_path) {
            Ok(text) => text
                .lines()
                .filter_map(|l| serde_json::from_str::<Hashed>(l).ok())
                .map(|h| h.hash)
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeSet::new(),
            Err(e) => return Err(io_err(&manifest_path)(e)),
        };
        Ok(Self {
            out: cfg.out.clone(),
            reference: SimilarityIndex::of_tasks(&cfg.reference),
            accepted,
            hashes,
            max_similarity: cfg.max_similarity,
            log: append(&cfg.out.join(LOG_FILE))?,
            manifest: append(&manifest_path)?,
            report: CostReport {
                model: model.to_string(),
                sandbox: Some(worker.sandbox_report().clone()),
                ..CostReport::default()
            },
            worker,
        })
    }

    /// Judges one answer, writes the task if accepted, logs it; returns the log record.
    async fn judge(&mut self, a: Answered, model: &str) -> Result<LogRecord, SynthError> {
        let mut rec = LogRecord {
            request: a.request,
            model: model.to_string(),
            seed_ops: a.seed_ops,
            prompt: a.prompt,
            answer: None,
            finish_reason: None,
            usage: TokenUsage::default(),
            retries: 0,
            verdict: Verdict::Rejected,
            reason: None,
            similar_to: None,
            similarity: None,
            ops: Vec::new(),
            hash: None,
            file: None,
            eager_ms: None,
            sandbox_missing: self.worker.sandbox_report().missing.clone(),
        };
        let mut in_manifest = false;
        match a.result {
            Err(e) => {
                rec.retries = e.retries;
                rec.verdict = Verdict::Failed;
                rec.reason = Some(format!("request_failed: {}", ErrorChain(&e)));
            }
            Ok(c) => {
                rec.model = c.model;
                rec.usage = c.usage;
                rec.retries = c.retries;
                rec.finish_reason = c.finish_reason;
                in_manifest = self.judge_answer(&mut rec, &c.content).await?;
                rec.answer = Some(c.content);
            }
        }
        if in_manifest {
            let m = ManifestRecord {
                hash: rec.hash.clone().unwrap_or_default(),
                pattern: "llm".into(),
                model: rec.model.clone(),
                ops: rec.ops.clone(),
                seed_ops: rec.seed_ops.clone(),
                verdict: rec.verdict,
                reason: rec.reason.clone(),
                file: rec.file.clone(),
                eager_ms: rec.eager_ms,
                usage: rec.usage,
                sandbox_missing: rec.sandbox_missing.clone(),
            };
            write_line(&mut self.manifest, &m, &self.out.join("manifest.jsonl"))?;
        }
        write_line(&mut self.log, &rec, &self.out.join(LOG_FILE))?;
        self.report.record(&rec);
        tracing::info!(
            request = rec.request,
            verdict = ?rec.verdict,
            reason = rec.reason.as_deref().unwrap_or(""),
            "answer judged"
        );
        Ok(rec)
    }

    /// The verdict on an answer's text, filled into `rec`; whether the candidate gets a
    /// manifest line (it has code, and that code was not judged before).
    async fn judge_answer(
        &mut self,
        rec: &mut LogRecord,
        content: &str,
    ) -> Result<bool, SynthError> {
        let source = match extract_code(content) {
            Ok(s) => s,
            Err(e) => {
                rec.reason = Some(format!("no_code: {e}"));
                return Ok(false);
            }
        };
        let hash = hex::encode(Sha256::digest(source.as_bytes()));
        rec.hash = Some(hash.clone());
        rec.ops = op_sequence(&source);
        if let Err(e) = validate_source("proposed task", &source) {
            rec.reason = Some(format!("not_a_task: {e}"));
            return Ok(true);
        }
        if self.hashes.contains(&hash) {
            rec.reason = Some("duplicate: the same source was judged before".into());
            return Ok(false);
        }
        self.hashes.insert(hash.clone());
        // The reference first: on a tie, the bundled task is the one named.
        let nearest = match (
            self.reference.nearest(&source),
            self.accepted.nearest(&source),
        ) {
            (Some(r), Some(a)) if a.similarity > r.similarity => Some(a),
            (Some(r), _) => Some(r),
            (None, a) => a,
        };
        if let Some(n) = nearest {
            rec.similar_to = Some(n.name.clone());
            rec.similarity = Some(n.similarity);
            if n.similarity >= self.max_similarity {
                rec.reason = Some(format!("near_duplicate: {} ({:.2})", n.name, n.similarity));
                return Ok(true);
            }
        }
        let v = self.worker.judge(&source).await?;
        if let Some(reason) = v.reason {
            rec.reason = Some(reason);
            return Ok(true);
        }
        let level2 = self.out.join("level2");
        let n = std::fs::read_dir(&level2)
            .map_err(io_err(&level2))?
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "py"))
            .count();
        let mut path = level2.join(format!("{}_llm_{}.py", n + 1, &hash[..10]));
        let mut k = 1;
        while path.exists() {
            k += 1;
            path = level2.join(format!("{}_llm_{}_{k}.py", n + 1, &hash[..10]));
        }
        std::fs::write(&path, &source).map_err(io_err(&path))?;
        let rel = format!(
            "level2/{}",
            path.file_name().unwrap_or_default().to_string_lossy()
        );
        self.accepted.insert(&rel, &source);
        rec.file = Some(rel);
        rec.eager_ms = v.eager_ms;
        rec.verdict = Verdict::Accepted;
        Ok(true)
    }
}

fn write_line(
    file: &mut std::fs::File,
    value: &impl Serialize,
    path: &Path,
) -> Result<(), SynthError> {
    let mut line = serde_json::to_string(value).map_err(|e| io_err(path)(e.into()))?;
    line.push('\n');
    file.write_all(line.as_bytes()).map_err(io_err(path))
}

/// Runs the synthesis; `progress` hears of every judged answer. Returns the cost report (also
/// written to [`COST_FILE`]).
pub async fn run(
    cfg: LlmSynthConfig,
    mut progress: impl FnMut(&LogRecord, &CostReport),
) -> Result<CostReport, SynthError> {
    let mut client = ChatClient::new(&cfg.url, cfg.api_key.clone(), cfg.request_timeout)?;
    client.retry.max_retries = cfg.max_retries;
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => client.first_model().await.map_err(SynthError::Model)?,
    };
    std::fs::create_dir_all(&cfg.out).map_err(io_err(&cfg.out))?;
    let worker = JudgeWorker::start(cfg.worker.clone()).await?;
    let pool: Vec<String> = worker.seeds().iter().map(|s| s.name.clone()).collect();
    tracing::info!(%model, seeds = pool.len(), "asking the model for tasks");
    let mut judge = Judge::open(&cfg, worker, &model)?;

    // A rerun into the same directory goes on with the next requests' operator samples.
    let first = std::fs::read_to_string(cfg.out.join(LOG_FILE))
        .map(|t| t.lines().count() as u64)
        .unwrap_or(0);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Answered>(cfg.concurrency.max(1));
    let issuer = {
        let (client, model, device) = (client.clone(), model.clone(), cfg.device.clone());
        let sem = Arc::new(tokio::sync::Semaphore::new(cfg.concurrency.max(1)));
        let (requests, k, seed) = (cfg.max_requests as u64, cfg.ops_per_prompt, cfg.seed);
        let (max_tokens, temperature) = (cfg.max_tokens, cfg.temperature);
        tokio::spawn(async move {
            let mut set = tokio::task::JoinSet::new();
            for request in first..first + requests {
                let Ok(permit) = sem.clone().acquire_owned().await else {
                    break;
                };
                let seed_ops = sample_ops(&pool, k, seed, request);
                let messages = prompt(&seed_ops, &device);
                let (tx, client, model) = (tx.clone(), client.clone(), model.clone());
                set.spawn(async move {
                    let result = client
                        .complete(&model, &messages, max_tokens, temperature)
                        .await;
                    let _ = tx
                        .send(Answered {
                            request,
                            seed_ops,
                            prompt: messages,
                            result,
                        })
                        .await;
                    drop(permit);
                });
            }
            drop(tx);
            while set.join_next().await.is_some() {}
        })
    };
    let mut outcome = Ok(());
    while let Some(a) = rx.recv().await {
        match judge.judge(a, &model).await {
            Ok(rec) => progress(&rec, &judge.report),
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
        if judge.report.accepted as usize >= cfg.count {
            break;
        }
    }
    // Enough accepted (or a failure): the requests still in flight are dropped with the
    // issuer's task set.
    issuer.abort();
    outcome?;
    let report = judge.report;
    let path = cfg.out.join(COST_FILE);
    let text = serde_json::to_vec_pretty(&report).map_err(|e| io_err(&path)(e.into()))?;
    std::fs::write(&path, text).map_err(io_err(&path))?;
    Ok(report)
}
