//! `kernelbench synth --llm-url` end to end: the real binary against a scripted chat server
//! (a real HTTP server in this process answering in turn: a good task, one that does not run,
//! a copy of a bundled KernelBench task, a non-deterministic one, an answer without code, a
//! 500 followed by a second good task, and a renamed copy of the first good task), with the
//! filters on real torch. Checked: each verdict and its reason, the log's lines, the
//! manifest's model field, the retry and the cost report. Then the plumbing against `trainer
//! serve --tiny-random` when `CUDA_AGENT_TRAINER_BIN` names a trainer binary, and the filters'
//! worker alone against candidates that end or hang it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, VecDeque};
use std::io::BufRead as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kernelbench::synth::llm::{CostReport, LogRecord, ManifestRecord, Verdict};
use kernelbench::TaskSet;
use serde_json::{json, Value};

/// A fused task that passes the filters on a CPU: [cumsum, logsigmoid, *, cos, softmax].
const GOOD: &str = r#"import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
BATCH, DIM = (61, 127) if SMALL else (8192, 4096)


class Model(nn.Module):
    """GOOD-1: a running sum gated by log-sigmoid and cosine, then a row softmax."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cumsum(x, dim=1)
        return F.softmax(F.logsigmoid(y) * torch.cos(x), dim=1)


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return []


def get_inputs_alt():
    """A second shape: the batch odd and about half."""
    return [torch.randn(BATCH // 2 | 1, DIM)]
"#;

/// A second good task, of images: [conv2d, hardswish, -, mean].
const GOOD_2: &str = r#"import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
BATCH, C, H, W = (2, 4, 8, 8) if SMALL else (16, 64, 128, 128)


class Model(nn.Module):
    """GOOD-2: a 3x3 convolution, hard-swish, and the channel mean taken out."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.hardswish(self.conv(x))
        return y - y.mean(dim=1, keepdim=True)


def get_inputs():
    return [torch.randn(BATCH, C, H, W)]


def get_init_inputs():
    return [C]


def get_inputs_alt():
    return [torch.randn(BATCH // 2 | 1, C, H, W)]
"#;

/// The model's answer around a source.
fn fenced(words: &str, source: &str) -> String {
    format!("{words}\n\n```python\n{source}```\n\nThis fuses the operators.")
}

/// One scripted reply: an answer (with its token counts) or an HTTP error.
#[derive(Clone)]
enum Reply {
    Answer(String, u64, u64),
    Error(StatusCode),
}

#[derive(Default)]
struct Script {
    replies: VecDeque<Reply>,
    /// (model, authorization header) of every chat request.
    seen: Vec<(String, String)>,
}

type Shared = Arc<Mutex<Script>>;

async fn chat(State(s): State<Shared>, headers: HeaderMap, Json(req): Json<Value>) -> Response {
    let mut s = s.lock().unwrap();
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let model = req["model"].as_str().unwrap_or("").to_string();
    s.seen.push((model.clone(), auth));
    match s.replies.pop_front() {
        Some(Reply::Answer(content, p, c)) => Json(json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
        }))
        .into_response(),
        Some(Reply::Error(code)) => (
            code,
            Json(json!({"error": {"message": "scripted failure"}})),
        )
            .into_response(),
        None => (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": {"message": "the script is over"}})),
        )
            .into_response(),
    }
}

/// Starts the scripted server on a free port; returns its base URL.
async fn scripted_server(script: Shared) -> String {
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route(
            "/v1/models",
            get(|| async { Json(json!({"data": [{"id": "scripted-model"}]})) }),
        )
        .with_state(script);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/v1")
}

/// `kernelbench synth` with the CPU filters kept cheap (any runtime, compile only traced).
fn synth(url: &str, out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kernelbench"));
    c.args(["synth", "--llm-url", url])
        .args(common::CPU_FILTERS)
        .args(["--python", &common::python(), "--out"])
        .arg(out)
        .args(extra);
    c
}

fn lines<T: serde::de::DeserializeOwned>(path: &Path) -> Vec<T> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn scripted_answers_get_their_verdicts_logs_and_costs() {
    let linear_gelu = TaskSet::bundled()
        .get("L2/11_Linear_GELU")
        .unwrap()
        .source
        .replace(
            "A linear layer then GELU.",
            "DUPLICATE: a projection and a GELU.",
        )
        .replace("self.linear", "self.proj")
        .replace("(4096, 4096, 8192)", "(2048, 1024, 1024)");
    let broken = GOOD.replace("GOOD-1", "BROKEN").replace(
        "return F.softmax(F.logsigmoid(y) * torch.cos(x), dim=1)",
        "return torch.erf(y) @ torch.ones(3, 3)",
    );
    let nondeterministic = GOOD.replace("GOOD-1", "NONDET").replace(
        "return F.softmax(F.logsigmoid(y) * torch.cos(x), dim=1)",
        "return torch.tanh(y) + torch.rand_like(y)",
    );
    let copy = GOOD
        .replace("GOOD-1", "COPY")
        .replace("y = torch.cumsum(x, dim=1)", "z = x.cumsum(1)")
        .replace("F.logsigmoid(y)", "F.logsigmoid(z)");
    let replies = vec![
        Reply::Answer(fenced("Here is a task (GOOD-1).", GOOD), 900, 300),
        Reply::Answer(fenced("A task.", &broken), 910, 310),
        Reply::Answer(fenced("A task.", &linear_gelu), 920, 320),
        Reply::Answer(fenced("A task.", &nondeterministic), 930, 330),
        Reply::Answer(
            "MALFORMED: I would fuse a cumsum with a softmax.".into(),
            940,
            10,
        ),
        Reply::Error(StatusCode::INTERNAL_SERVER_ERROR),
        Reply::Answer(fenced("A task.", GOOD_2), 950, 350),
        Reply::Answer(fenced("A task.", &copy), 960, 360),
    ];
    let script: Shared = Arc::new(Mutex::new(Script {
        replies: replies.into(),
        ..Script::default()
    }));
    let url = scripted_server(script.clone()).await;
    let out = tempfile::tempdir().unwrap();
    let o = synth(&url, out.path(), &[])
        .args([
            "--model",
            "scripted-model",
            "--api-key-env",
            "SYNTH_TEST_KEY",
        ])
        .args(["--count", "5", "--max-requests", "7", "--concurrency", "2"])
        .env("SYNTH_TEST_KEY", "sk-scripted")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stdout}\n{stderr}");

    // Seven requests and one retry reached the server, each with the model and the key.
    let seen = script.lock().unwrap().seen.clone();
    assert_eq!(seen.len(), 8, "{seen:?}");
    for (model, auth) in &seen {
        assert_eq!(model, "scripted-model");
        assert_eq!(auth, "Bearer sk-scripted");
    }

    // The log: one line per request, with its prompt, answer and verdict.
    let log: Vec<LogRecord> = lines(&out.path().join("llm-log.jsonl"));
    assert_eq!(log.len(), 7);
    let by_marker = |marker: &str| -> Vec<&LogRecord> {
        log.iter()
            .filter(|r| r.answer.as_deref().is_some_and(|a| a.contains(marker)))
            .collect()
    };
    let one = |marker: &str| -> &LogRecord {
        let found = by_marker(marker);
        assert_eq!(found.len(), 1, "{marker}");
        found[0]
    };
    for r in &log {
        assert_eq!(r.model, "scripted-model");
        assert_eq!(r.prompt.len(), 2);
        assert_eq!(r.seed_ops.len(), 8);
        for op in &r.seed_ops {
            assert!(r.prompt[1].content.contains(&format!("- {op}\n")), "{op}");
        }
    }
    let requests: std::collections::BTreeSet<u64> = log.iter().map(|r| r.request).collect();
    assert_eq!(requests, (0..7).collect());

    let broken = one("BROKEN");
    assert_eq!(broken.verdict, Verdict::Rejected);
    assert_eq!(broken.reason.as_deref(), Some("eager_error: RuntimeError"));
    let dup = one("DUPLICATE");
    assert_eq!(dup.verdict, Verdict::Rejected);
    assert_eq!(
        dup.reason.as_deref(),
        Some("near_duplicate: L2/11_Linear_GELU (1.00)")
    );
    assert_eq!(dup.ops, ["linear", "gelu"]);
    let nondet = one("NONDET");
    assert_eq!(nondet.reason.as_deref(), Some("nondeterministic"));
    let malformed = one("MALFORMED");
    assert_eq!(
        malformed.reason.as_deref(),
        Some("no_code: the answer holds no fenced code block")
    );
    assert!(malformed.hash.is_none());
    // The answer after the 500 came with the retry.
    let good_2 = one("GOOD-2");
    assert_eq!(good_2.verdict, Verdict::Accepted, "{good_2:?}");
    assert!(good_2.eager_ms.is_some());
    let retried: Vec<&LogRecord> = log.iter().filter(|r| r.retries > 0).collect();
    assert_eq!(retried.len(), 1);
    assert_eq!(retried[0].retries, 1);
    // GOOD-1 and its renamed copy: whichever was judged first is accepted, the other is a
    // near-duplicate of it.
    let (first, second) = {
        let (g, c) = (one("GOOD-1"), one("COPY"));
        if g.verdict == Verdict::Accepted {
            (g, c)
        } else {
            (c, g)
        }
    };
    assert_eq!(first.verdict, Verdict::Accepted, "{first:?}");
    let file = first.file.clone().unwrap();
    assert_eq!(
        second.reason.clone().unwrap(),
        format!("near_duplicate: {file} (1.00)")
    );
    assert_eq!(first.ops, ["cumsum", "logsigmoid", "*", "cos", "softmax"]);

    // The manifest: every candidate with code, each naming the model; the accepted ones load
    // as tasks.
    let manifest: Vec<ManifestRecord> = lines(&out.path().join("manifest.jsonl"));
    assert_eq!(manifest.len(), 6);
    for m in &manifest {
        assert_eq!(m.model, "scripted-model");
        assert_eq!(m.pattern, "llm");
    }
    let accepted: Vec<&ManifestRecord> = manifest
        .iter()
        .filter(|m| m.verdict == Verdict::Accepted)
        .collect();
    assert_eq!(accepted.len(), 2);
    let tasks = TaskSet::load_dir(out.path()).unwrap();
    assert_eq!(tasks.split("level2").len(), 2);
    for m in accepted {
        let file = m.file.as_deref().unwrap();
        let stem = file.trim_start_matches("level2/").trim_end_matches(".py");
        assert!(tasks.get(&format!("L2/{stem}")).is_ok(), "{file}");
    }

    // The cost report: tokens of the seven answers, per accepted task.
    let report: CostReport =
        serde_json::from_slice(&std::fs::read(out.path().join("llm-cost.json")).unwrap()).unwrap();
    let prompt: u64 = [900, 910, 920, 930, 940, 950, 960].iter().sum();
    let completion: u64 = [300, 310, 320, 330, 10, 350, 360].iter().sum();
    assert_eq!(report.usage.prompt_tokens, prompt);
    assert_eq!(report.usage.completion_tokens, completion);
    assert_eq!((report.answered, report.failed, report.retries), (7, 0, 1));
    assert_eq!(report.accepted, 2);
    assert_eq!(report.prompt_tokens_per_accepted, Some(prompt as f64 / 2.0));
    assert_eq!(
        report.completion_tokens_per_accepted,
        Some(completion as f64 / 2.0)
    );
    let rejected: BTreeMap<&str, u64> = report
        .rejected
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(
        rejected,
        BTreeMap::from([
            ("eager_error", 1),
            ("near_duplicate", 2),
            ("no_code", 1),
            ("nondeterministic", 1)
        ])
    );
    assert!(
        stdout.contains("accepted 2 of 7 answers (0 requests failed, 1 retries)"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "| prompt | {prompt} | {:.1} |",
            prompt as f64 / 2.0
        )),
        "{stdout}"
    );

    // A rerun into the same directory goes on counting requests and knows what was judged.
    script
        .lock()
        .unwrap()
        .replies
        .push_back(Reply::Answer(fenced("Again (GOOD-1).", GOOD), 1, 1));
    let o = synth(&url, out.path(), &["--model", "scripted-model"])
        .args(["--count", "1", "--max-requests", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let log: Vec<LogRecord> = lines(&out.path().join("llm-log.jsonl"));
    let again = log.last().unwrap();
    assert_eq!((log.len(), again.request), (8, 7));
    assert_eq!(
        again.reason.as_deref(),
        Some("duplicate: the same source was judged before")
    );
    assert_eq!(
        lines::<ManifestRecord>(&out.path().join("manifest.jsonl")).len(),
        6
    );
}

/// The plumbing against the trainer's own server: the model found through `/v1/models`,
/// answers (noise from random weights) judged and logged, tokens counted.
#[test]
fn trainer_serve_answers_are_judged() {
    let Some(bin) = std::env::var_os("CUDA_AGENT_TRAINER_BIN") else {
        eprintln!(
            "skipped: CUDA_AGENT_TRAINER_BIN does not name a trainer binary \
             (cargo build --release -p trainer, then target/release/trainer)"
        );
        return;
    };
    let mut server = Command::new(&bin)
        .args(["serve", "--tiny-random", "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start trainer serve");
    let mut line = String::new();
    std::io::BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("trainer serve said {line:?}"))
        .to_string();
    let out = tempfile::tempdir().unwrap();
    let o = synth(&format!("{base}/v1"), out.path(), &[])
        .args(["--count", "1", "--max-requests", "2", "--concurrency", "2"])
        .args(["--max-tokens", "16", "--ops-per-prompt", "3"])
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let log: Vec<LogRecord> = lines(&out.path().join("llm-log.jsonl"));
    assert_eq!(log.len(), 2);
    for r in &log {
        assert_eq!(r.model, "tiny-random");
        assert_eq!(r.verdict, Verdict::Rejected, "{r:?}");
        assert!(r.usage.prompt_tokens > 0, "{r:?}");
        assert!((1..=16).contains(&r.usage.completion_tokens), "{r:?}");
    }
    let report: CostReport =
        serde_json::from_slice(&std::fs::read(out.path().join("llm-cost.json")).unwrap()).unwrap();
    assert_eq!(report.model, "tiny-random");
    assert_eq!(report.answered, 2);
    assert_eq!(
        report.usage.prompt_tokens,
        log.iter().map(|r| r.usage.prompt_tokens).sum::<u64>()
    );
}

/// The filters' worker survives its candidates: one that ends the process and one that hangs
/// are rejected, and the restarted worker judges the next one; a forbidden import never runs.
#[tokio::test(flavor = "multi_thread")]
async fn the_worker_outlives_candidates_that_kill_or_hang_it() {
    use std::time::Duration;
    // Long enough for a good candidate on a busy machine (each run imports torch twice: its
    // driver and the proposal's process); the hang costs this much.
    let (_dir, mut worker) = common::cpu_worker(
        Duration::from_secs(30),
        kernelbench::synth::worker::RunLimits::default(),
    )
    .await;
    assert!(worker.seeds().len() >= 200);
    let forward = "return F.softmax(F.logsigmoid(y) * torch.cos(x), dim=1)";
    let exits = GOOD.replace(forward, "raise SystemExit(3)");
    let v = worker.judge(&exits).await.unwrap();
    assert_eq!(v.reason.as_deref(), Some("worker_died: exit status: 3"));
    let hangs = GOOD.replace(forward, "while True:\n            y = y + 1");
    let v = worker.judge(&hangs).await.unwrap();
    assert_eq!(v.reason.as_deref(), Some("judge_timeout: 30 s"));
    let imports = GOOD.replace("import os\n", "import os\nimport subprocess\n");
    let v = worker.judge(&imports).await.unwrap();
    assert_eq!(v.reason.as_deref(), Some("forbidden_import: subprocess"));
    let v = worker.judge(GOOD).await.unwrap();
    assert_eq!(v.reason, None);
    assert!(v.eager_ms.is_some());
}
