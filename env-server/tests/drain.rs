//! Draining on SIGTERM, against the real binary: readiness turns false while admitted work
//! still runs, new episodes, steps and evaluations are refused with 503 and Retry-After, the
//! evaluation already running gets its verdict, answered steps stay answerable, the process
//! exits 0 within its grace period, and the episode it cut short is in its log, truncated
//! with the drain's reason, for the next server. A second signal exits at once; an evaluation
//! still running when the grace is over is answered 503 `drained`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::*;
use env_server::ServerConfig;
use serde_json::{json, Value};

/// A generous upper bound on anything that must not hang.
const BOUND: Duration = Duration::from_secs(240);

/// A candidate for L1/2_Add that takes seconds to import (the worker imports it after the
/// gate), so that its evaluation is still running when the test signals the server.
const SLOW_CANDIDATE: &str = "import time\ntime.sleep(15)\nimport torch\n\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, a, b):\n        return a + b\n";

/// Starts the real binary on a free port with `args`; waits until it answers.
fn start(dir: &Path, args: &[&str]) -> (Child, SocketAddr) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let log = std::fs::File::create(dir.join("server.log")).expect("log");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_env-server"));
    // The suite's shared precompiled headers where its runner made them, else none.
    if std::env::var_os("CUDA_AGENT_PCH_DIR").is_none() {
        cmd.env("CUDA_AGENT_PCH", "none");
    }
    let child = cmd
        .args([
            "--bind",
            &addr.to_string(),
            "--device",
            "cpu",
            "--skip-compile",
        ])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--python")
        .arg(python())
        .args(args)
        .env_remove("CUDA_AGENT_API_KEY")
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start env-server");
    let started = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(started.elapsed() < BOUND, "env-server did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    (child, addr)
}

/// One answer: status, headers (lower-cased names), body as JSON (or a string).
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Value,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn code(&self) -> Option<&str> {
        self.body["error"]["code"].as_str()
    }
}

/// One request on its own connection (closed after the answer).
fn request(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> Answer {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(BOUND)).expect("timeout");
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let kind = match body.is_empty() {
        true => "",
        false => "content-type: application/json\r\n",
    };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: x\r\n{kind}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut data = Vec::new();
    s.read_to_end(&mut data).expect("answer");
    let end = data
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let head = String::from_utf8_lossy(&data[..end]).to_string();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let raw = &data[end + 4..];
    let body = serde_json::from_slice(raw)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(raw).into()));
    Answer {
        status,
        headers,
        body,
    }
}

fn signal(child: &Child, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).expect("pid");
    // SAFETY: kill only sends a signal, to the process this test started.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill");
}

/// Waits for the process to exit, within `bound`.
fn exit_within(child: &mut Child, bound: Duration) -> ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if started.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the server did not exit within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts the slow evaluation on a thread; returns once the server counts it in flight.
fn slow_evaluation(addr: SocketAddr) -> std::thread::JoinHandle<Answer> {
    let eval = std::thread::spawn(move || {
        request(
            addr,
            "POST",
            "/v1/evaluate",
            Some(json!({"task": "L1/2_Add", "solution": SLOW_CANDIDATE})),
        )
    });
    let started = Instant::now();
    while request(addr, "GET", "/v1/info", None).body["evaluations_in_flight"] != 1 {
        assert!(
            !eval.is_finished(),
            "the evaluation ended before it was seen"
        );
        assert!(started.elapsed() < BOUND, "the evaluation never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    eval
}

/// Waits until readiness says 503; returns that answer.
fn unready(addr: SocketAddr) -> Answer {
    let started = Instant::now();
    loop {
        let a = request(addr, "GET", "/v1/ready", None);
        if a.status != 200 {
            return a;
        }
        assert!(started.elapsed() < BOUND, "readiness never turned false");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn step(tool: &str, arguments: Value, request_id: &str) -> Value {
    json!({"action": {"tool": tool, "arguments": arguments}, "request_id": request_id})
}

#[test]
fn sigterm_mid_episode_and_mid_evaluation_drains_and_exits_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut child, addr) = start(dir.path(), &["--drain-grace-s", "600"]);
    let ready = request(addr, "GET", "/v1/ready", None);
    assert_eq!(ready.status, 200, "{}", ready.body);

    // Mid-episode: one step answered.
    let reset = request(
        addr,
        "POST",
        "/v1/episodes",
        Some(json!({"task": "tiny/0_red"})),
    );
    assert_eq!(reset.status, 200, "{}", reset.body);
    let id = reset.body["episode_id"].as_str().expect("id").to_string();
    let step_path = format!("/v1/episodes/{id}/step");
    let write = step(
        "Write",
        json!({"file_path": "answer.txt", "content": "blue"}),
        "w",
    );
    let written = request(addr, "POST", &step_path, Some(write.clone()));
    assert_eq!(written.status, 200, "{}", written.body);

    // Mid-evaluation.
    let eval = slow_evaluation(addr);
    signal(&child, libc::SIGTERM);

    // Readiness turns false while the evaluation still runs; liveness stays true.
    let not_ready = unready(addr);
    assert_eq!(not_ready.status, 503, "{}", not_ready.body);
    assert_eq!(not_ready.code(), Some("draining"), "{}", not_ready.body);
    assert!(!eval.is_finished(), "the drain waited for nothing");
    assert_eq!(request(addr, "GET", "/v1/health", None).status, 200);

    // New work is refused, typed and with Retry-After.
    let refused = [
        request(
            addr,
            "POST",
            "/v1/episodes",
            Some(json!({"task": "tiny/0_red"})),
        ),
        request(
            addr,
            "POST",
            "/v1/evaluate",
            Some(json!({"task": "L1/2_Add", "solution": SLOW_CANDIDATE})),
        ),
        request(
            addr,
            "POST",
            &step_path,
            Some(step("Glob", json!({"pattern": "*"}), "g")),
        ),
    ];
    for a in &refused {
        assert_eq!((a.status, a.code()), (503, Some("draining")), "{}", a.body);
        assert!(a.header("retry-after").is_some(), "{:?}", a.headers);
    }
    // What was answered stays answerable: a retried step is replayed.
    let again = request(addr, "POST", &step_path, Some(write));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body["info"]["replayed"], true, "{}", again.body);

    // The evaluation admitted before the signal gets its verdict.
    let verdict = eval.join().expect("evaluation thread");
    assert_eq!(verdict.status, 200, "{}", verdict.body);
    assert!(verdict.body["reward"].is_number(), "{}", verdict.body);
    assert!(verdict.body["correct"].is_boolean(), "{}", verdict.body);

    // Nothing hangs: with its work done the server exits 0, far inside its grace period.
    let status = exit_within(&mut child, BOUND);
    let log = std::fs::read_to_string(dir.path().join("server.log")).expect("log");
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("every admitted request finished"), "{log}");
    assert!(log.contains("durable on disk"), "{log}");

    // A restarted server serves the episode from its log: its answered step, and the drain's
    // truncation (not a restart's: the log was complete when the server stopped).
    let state = state_from(test_config(&dir.path().join("data")));
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (st, v) = rt.block_on(call(&state, "GET", &format!("/v1/episodes/{id}"), None));
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "truncated", "{v}");
    assert_eq!(v["truncation_reason"], "server_drain", "{v}");
    let records = env_server::trajectory::read(
        &dir.path()
            .join("data/trajectories")
            .join(format!("{id}.jsonl")),
    )
    .expect("log");
    let kinds: Vec<&str> = records.iter().map(|r| r.kind()).collect();
    assert_eq!(kinds, ["reset", "step", "truncated"], "{records:?}");
    let (st, v) = rt.block_on(call(
        &state,
        "POST",
        &step_path,
        Some(step(
            "Write",
            json!({"file_path": "answer.txt", "content": "blue"}),
            "w",
        )),
    ));
    assert_eq!(
        (st, &v["info"]["replayed"]),
        (StatusCode::OK, &json!(true)),
        "{v}"
    );
}

#[test]
fn a_second_signal_exits_at_once_and_an_expired_grace_answers_drained() {
    // A second signal: the running evaluation is not waited for.
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut child, addr) = start(dir.path(), &["--drain-grace-s", "600"]);
    let eval = slow_evaluation(addr);
    signal(&child, libc::SIGTERM);
    assert_eq!(unready(addr).code(), Some("draining"));
    signal(&child, libc::SIGINT);
    let status = exit_within(&mut child, BOUND);
    let log = std::fs::read_to_string(dir.path().join("server.log")).expect("log");
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("second stop signal"), "{log}");
    // Its client sees the connection end, not a hang.
    let _ = eval.join();

    // A grace period too short for the evaluation: it is answered 503 drained (its client
    // may retry it elsewhere), and the server still exits 0.
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut child, addr) = start(dir.path(), &["--drain-grace-s", "1"]);
    let eval = slow_evaluation(addr);
    signal(&child, libc::SIGTERM);
    let answer = eval.join().expect("evaluation thread");
    assert_eq!(
        (answer.status, answer.code()),
        (503, Some("drained")),
        "{}",
        answer.body
    );
    assert!(
        answer.header("retry-after").is_some(),
        "{:?}",
        answer.headers
    );
    let status = exit_within(&mut child, BOUND);
    let log = std::fs::read_to_string(dir.path().join("server.log")).expect("log");
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("grace period is over"), "{log}");
}

#[tokio::test]
async fn readiness_says_whether_a_new_episode_would_be_admitted() {
    // Open to a cluster's probes, which carry no token, like liveness.
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state_from(ServerConfig {
        api_key: Some("sekrit".into()),
        max_episodes: 1,
        ..test_config(dir.path())
    });
    let (st, v) = call(&state, "GET", "/v1/ready", None).await;
    assert_eq!((st, v["status"].as_str()), (StatusCode::OK, Some("ready")));
    // At its episode cap the server is alive but not ready.
    let state = state_from(ServerConfig {
        max_episodes: 1,
        ..test_config(dir.path())
    });
    tiny_episode(&state).await;
    let (st, v) = call(&state, "GET", "/v1/ready", None).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("at_capacity"))
    );
    let (st, _) = call(&state, "GET", "/v1/health", None).await;
    assert_eq!(st, StatusCode::OK);
    // Host admission: a memory reserve the host cannot have.
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state_from(ServerConfig {
        min_available_memory_bytes: Some(u64::MAX),
        ..test_config(dir.path())
    });
    let (st, v) = call(&state, "GET", "/v1/ready", None).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("host_busy"))
    );
    let (_, v) = call(&state, "GET", "/v1/openapi.json", None).await;
    assert!(
        v["paths"].get("/v1/ready").is_some(),
        "openapi lacks /v1/ready"
    );
}
