//! Red team: a hostile HTTP client against the real connection loop and router. Each test
//! is an attack; it passes when the defence holds. Time limits here are short so the
//! attacks are quick; the bounds the tests wait for are long, so that a slow machine never
//! fails them (a defence that is missing makes them wait out the bound and fail).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::*;
use env_server::ServerConfig;
use serde_json::{json, Value};

/// How long a test waits for the server to do what a defence promises.
const BOUND: Duration = Duration::from_secs(30);

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(BOUND)).expect("timeout");
    s
}

/// Reads until the server closes the connection (or the bound passes: then panics).
fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let started = Instant::now();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return out,
            Err(e) => panic!(
                "the server kept the connection open for {:?} ({e})",
                started.elapsed()
            ),
        }
    }
}

/// Reads one answer with a Content-Length; returns (status, body).
fn read_answer(s: &mut TcpStream) -> (u16, Vec<u8>) {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&data[..end]).to_string();
            let status: u16 = head
                .split(' ')
                .nth(1)
                .and_then(|c| c.parse().ok())
                .expect("status line");
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap_or(0))
                })
                .unwrap_or(0);
            while data.len() < end + 4 + len {
                let n = s.read(&mut buf).expect("body");
                assert!(n > 0, "closed mid-body");
                data.extend_from_slice(&buf[..n]);
            }
            return (status, data[end + 4..end + 4 + len].to_vec());
        }
        let n = s.read(&mut buf).expect("head");
        assert!(
            n > 0,
            "closed before an answer: {:?}",
            String::from_utf8_lossy(&data)
        );
        data.extend_from_slice(&buf[..n]);
    }
}

fn get(addr: SocketAddr, path: &str) -> (u16, Vec<u8>) {
    let mut s = connect(addr);
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .expect("send");
    read_answer(&mut s)
}

/// A POST with a body and extra header lines (each ending in CRLF) over a fresh connection.
fn post(addr: SocketAddr, path: &str, headers: &str, body: &str) -> (u16, Vec<u8>) {
    let mut s = connect(addr);
    // An evaluation's answer takes its build and judge: minutes on a busy machine.
    s.set_read_timeout(Some(Duration::from_secs(900)))
        .expect("timeout");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{headers}content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    read_answer(&mut s)
}

/// [`post`] of JSON, parsed back.
fn post_json(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (st, bytes) = post(
        addr,
        path,
        "content-type: application/json\r\n",
        &body.to_string(),
    );
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (st, v)
}

async fn server(
    limits: env_server::http::HttpLimits,
    cfg: impl FnOnce(ServerConfig) -> ServerConfig,
) -> (
    tempfile::TempDir,
    std::sync::Arc<env_server::AppState>,
    SocketAddr,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state_from(cfg(ServerConfig {
        http: limits.clone(),
        ..test_config(dir.path())
    }));
    let addr = serve(state.clone(), limits).await;
    (dir, state, addr)
}

fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    tokio::task::spawn_blocking(f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_sent_slowly_are_cut_off() {
    let (_dir, _state, addr) = server(short_limits(), |c| c).await;
    blocking(move || {
        let mut s = connect(addr);
        s.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n")
            .expect("send");
        // Never the blank line that ends the head.
        let answer = read_to_close(&mut s);
        let text = String::from_utf8_lossy(&answer);
        assert!(
            text.is_empty() || text.starts_with("HTTP/1.1 408"),
            "{text}"
        );
    })
    .await
    .expect("attack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_are_closed() {
    let (_dir, _state, addr) = server(short_limits(), |c| c).await;
    blocking(move || {
        let mut s = connect(addr);
        s.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n")
            .expect("send");
        assert_eq!(read_answer(&mut s).0, 200);
        // Kept alive, then left idle: the server closes it.
        assert!(read_to_close(&mut s).is_empty());
    })
    .await
    .expect("attack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_sent_slowly_gets_408() {
    let (_dir, _state, addr) = server(short_limits(), |c| c).await;
    blocking(move || {
        let mut s = connect(addr);
        s.write_all(b"POST /v1/episodes HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"task\":").expect("send");
        let (status, body) = read_answer(&mut s);
        assert_eq!(status, 408, "{}", String::from_utf8_lossy(&body));
        let v: Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["error"]["code"], "body_timeout");
    })
    .await
    .expect("attack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_body_over_the_cap_is_refused_before_it_is_read() {
    let (_dir, _state, addr) = server(short_limits(), |c| c).await;
    blocking(move || {
        let mut s = connect(addr);
        s.write_all(b"POST /v1/episodes HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 999999999\r\n\r\n").expect("send");
        let (status, body) = read_answer(&mut s);
        assert_eq!(status, 413, "{}", String::from_utf8_lossy(&body));
    })
    .await
    .expect("attack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_headers_are_refused() {
    let (_dir, _state, addr) = server(short_limits(), |c| c).await;
    blocking(move || {
        let mut s = connect(addr);
        let big = "a".repeat(64 * 1024);
        let _ = write!(
            s,
            "GET /v1/health HTTP/1.1\r\nhost: x\r\nx-big: {big}\r\n\r\n"
        );
        let answer = read_to_close(&mut s);
        let text = String::from_utf8_lossy(&answer);
        assert!(
            text.is_empty() || text.starts_with("HTTP/1.1 431"),
            "{text}"
        );
    })
    .await
    .expect("attack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_refused_and_the_server_recovers() {
    let limits = env_server::http::HttpLimits {
        max_connections: 8,
        ..short_limits()
    };
    let (_dir, state, addr) = server(limits, |c| c).await;
    blocking(move || {
        // Slowloris: every slot held by a head that never ends.
        let holders: Vec<TcpStream> = (0..8)
            .map(|_| {
                let mut s = connect(addr);
                s.write_all(b"GET /v1/health HTTP/1.1\r\n").expect("send");
                s
            })
            .collect();
        // Wait until the server has taken all of them.
        let started = Instant::now();
        while state.http.open.load(Ordering::Relaxed) < 8 {
            assert!(
                started.elapsed() < BOUND,
                "the server did not take the connections"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // More connections: each is answered 503 (or closed) at once, not left hanging.
        for _ in 0..50 {
            let mut s = connect(addr);
            let _ = s.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n");
            let answer = read_to_close(&mut s);
            let text = String::from_utf8_lossy(&answer);
            assert!(
                text.is_empty() || text.starts_with("HTTP/1.1 503"),
                "{text}"
            );
        }
        assert!(state.http.refused.load(Ordering::Relaxed) >= 50);
        // The held slots are freed by the header timeout; then others are answered again.
        let started = Instant::now();
        loop {
            let mut s = connect(addr);
            let _ = s.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
            let answer = read_to_close(&mut s);
            if answer.starts_with(b"HTTP/1.1 200") {
                break;
            }
            assert!(started.elapsed() < BOUND, "the server never recovered");
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(holders);
    })
    .await
    .expect("attack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_loses_its_connection() {
    // A trajectory of many megabytes, asked for and never read.
    let (_dir, state, addr) = server(short_limits(), |c| ServerConfig {
        max_body_bytes: 2 << 20,
        ..c
    })
    .await;
    let id = tiny_episode(&state).await;
    let content = "z".repeat(900 * 1024);
    for i in 0..16 {
        let body = json!({"action": {"tool": "Write", "arguments": {"file_path": format!("f{i}.txt"), "content": content}}});
        let (st, v) = call(
            &state,
            "POST",
            &format!("/v1/episodes/{id}/step"),
            Some(body),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
    }
    blocking(move || {
        let mut s = connect(addr);
        write!(
            s,
            "GET /v1/episodes/{id}/trajectory HTTP/1.1\r\nhost: x\r\n\r\n"
        )
        .expect("send");
        let started = Instant::now();
        // The answer is larger than the socket buffers hold: the server's write stalls, and
        // the connection is dropped once it has stalled for the write timeout.
        while state.http.open.load(Ordering::Relaxed) > 0 {
            assert!(
                started.elapsed() < BOUND,
                "a stalled answer held its connection"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(s);
    })
    .await
    .expect("attack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_mid_step_does_not_cancel_the_step() {
    let (_dir, state, addr) = server(short_limits(), |c| c).await;
    let id = tiny_episode(&state).await;
    let id2 = id.clone();
    blocking(move || {
        let mut s = connect(addr);
        let body = json!({"action": {"tool": "Bash", "arguments": {"command": "sleep 1; echo done > marker.txt"}}, "request_id": "hang-up"}).to_string();
        write!(s, "POST /v1/episodes/{id2}/step HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len())
            .expect("send");
        std::thread::sleep(Duration::from_millis(200));
        drop(s);
    })
    .await
    .expect("hang up");
    // The step runs to its end and is logged: a retry gets its answer.
    let started = Instant::now();
    loop {
        let (_, v) = call(&state, "GET", &format!("/v1/episodes/{id}"), None).await;
        if v["turn"] == 1 {
            break;
        }
        assert!(started.elapsed() < BOUND, "the step was cancelled: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let retry = json!({"action": {"tool": "Bash", "arguments": {"command": "sleep 1; echo done > marker.txt"}}, "request_id": "hang-up"});
    let (st, v) = call(
        &state,
        "POST",
        &format!("/v1/episodes/{id}/step"),
        Some(retry),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["info"]["replayed"], true, "{v}");
    let (_, v) = call(
        &state,
        "POST",
        &format!("/v1/episodes/{id}/step"),
        Some(json!({"action": {"tool": "Read", "arguments": {"file_path": "marker.txt"}}})),
    )
    .await;
    assert!(
        v["observation"]["text"]
            .as_str()
            .unwrap_or("")
            .contains("done"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_left_running_by_clients_that_hung_up_are_bounded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let limits = env_server::http::HttpLimits {
        max_requests_in_flight: 2,
        ..short_limits()
    };
    let state = state_from(ServerConfig {
        http: limits,
        ..test_config(dir.path())
    });
    let id = tiny_episode(&state).await;
    // Two slow steps whose clients are gone (their calls dropped once the server took them):
    // both go on running, each holding a permit.
    for i in 0..2 {
        let (st, body) = (
            state.clone(),
            json!({"action": {"tool": "Bash", "arguments": {"command": "sleep 2"}}, "request_id": format!("slow-{i}")}),
        );
        let uri = format!("/v1/episodes/{id}/step");
        let pending = tokio::spawn(async move { call(&st, "POST", &uri, Some(body)).await });
        let started = Instant::now();
        while state.in_flight.available_permits() > 1 - i {
            assert!(started.elapsed() < BOUND, "the step did not start");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        pending.abort();
    }
    // No permit left: refused at once, not queued; health still answers.
    let (st, v) = call(&state, "GET", "/v1/tasks", None).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("busy")),
        "{v}"
    );
    assert_eq!(
        call(&state, "GET", "/v1/health", None).await.0,
        StatusCode::OK
    );
    // Once they end, the permits come back and both steps are in the log.
    let started = Instant::now();
    while state.in_flight.available_permits() < 2 {
        assert!(started.elapsed() < BOUND, "the permits never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (st, v) = call(&state, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!((st, v["turn"].as_u64()), (StatusCode::OK, Some(2)), "{v}");
}

#[tokio::test]
async fn every_string_field_has_a_cap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state_from(ServerConfig {
        max_body_bytes: 8 << 20,
        ..test_config(dir.path())
    });
    let id = tiny_episode(&state).await;
    let step = format!("/v1/episodes/{id}/step");
    let long = "x".repeat(10_000);
    let many_files: serde_json::Map<String, Value> = (0..100)
        .map(|i| (format!("kernels/{i}.cu"), json!("")))
        .collect();
    let cases: Vec<(&str, String, Value)> = vec![
        (
            "POST",
            step.clone(),
            json!({"action": {"tool": "Glob", "arguments": {"pattern": "*"}}, "request_id": long}),
        ),
        (
            "POST",
            step.clone(),
            json!({"action": {"tool": long, "arguments": {}}}),
        ),
        (
            "POST",
            step.clone(),
            json!({"action": {"id": long, "type": "function", "function": {"name": "Glob", "arguments": "{}"}}}),
        ),
        (
            "POST",
            step.clone(),
            json!({"action": {"tool": "Write", "arguments": {"file_path": "a", "content": "y".repeat(2 << 20)}}}),
        ),
        (
            "POST",
            step.clone(),
            json!({"action": {"tool": "Write", "arguments": format!("{{\"file_path\": \"a\", \"content\": \"{}\"}}", "y".repeat(2 << 20))}}),
        ),
        ("POST", "/v1/episodes".into(), json!({"task": long})),
        ("POST", "/v1/episodes".into(), json!({"split": long})),
        (
            "POST",
            "/v1/episodes".into(),
            json!({"options": {"max_turns": 4_000_000_000u64}}),
        ),
        (
            "POST",
            "/v1/evaluate".into(),
            json!({"task": long, "solution": "x"}),
        ),
        (
            "POST",
            "/v1/evaluate".into(),
            json!({"task": {"source": "y".repeat(2 << 20)}, "solution": "x"}),
        ),
        (
            "POST",
            "/v1/evaluate".into(),
            json!({"task": "tiny/0_red", "solution": {"files": many_files}}),
        ),
        (
            "POST",
            "/v1/evaluate".into(),
            json!({"task": "tiny/0_red", "solution": {"files": {long.clone(): "x"}}}),
        ),
        (
            "POST",
            "/v1/evaluate".into(),
            json!({"task": "tiny/0_red", "solution": "x", "options": {"device": long}}),
        ),
    ];
    for (method, uri, body) in cases {
        let (st, v) = call(&state, method, &uri, Some(body)).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{method} {uri}: {v}");
        assert_eq!(v["error"]["code"], "field_too_long", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("the most accepted")),
            "{v}"
        );
    }
    // Ids in paths are checked by form before they name anything.
    for bad in [
        long.as_str(),
        "..%2F..%2Fetc%2Fpasswd",
        "%2e%2e",
        "0123456789abcdef0123456789ABCDEF",
    ] {
        let (st, v) = call(&state, "GET", &format!("/v1/episodes/{bad}"), None).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{bad}: {v}");
        assert_eq!(v["error"]["code"], "unknown_episode", "{v}");
    }
    let (st, v) = raw(&state, "GET", "/v1/episodes/%FF%FE", None).await;
    assert!(st.is_client_error(), "{v}");
    assert!(v["error"]["code"].is_string(), "a JSON error: {v}");
    // Nothing above took a turn.
    let (_, v) = call(&state, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(v["turn"], 0, "{v}");
}

/// A small deterministic generator (xorshift64*), so the fuzz cases are the same every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
}

fn random_string(r: &mut Rng) -> String {
    let alphabets: [&[&str]; 3] = [
        &[
            "a", "Z", "0", "/", ".", "..", "*", "\\", "\"", "%", "\u{0}", "\u{202e}", "é", "😀",
            " ", "\n", "$(", "`", ";",
        ],
        &[
            "Bash",
            "Glob",
            "Read",
            "Write",
            "MultiEdit",
            "TodoWrite",
            "Submit",
            "model_new.py",
            "answer.txt",
            "../",
            "/etc/passwd",
        ],
        &[
            "red",
            "tiny/0_red",
            "L9/none",
            "all",
            "level1",
            "cpu",
            "function",
            "-1",
            "1e999",
            "null",
        ],
    ];
    let alphabet = r.pick(&alphabets);
    let n = match r.below(10) {
        0 => 300 + r.below(3000),
        _ => r.below(8),
    };
    (0..n).map(|_| *r.pick(alphabet)).collect()
}

fn random_json(r: &mut Rng, depth: u32) -> Value {
    match r.below(if depth > 4 { 5 } else { 8 }) {
        0 => Value::Null,
        1 => json!(r.below(2) == 0),
        2 => json!(r.next() as i64),
        3 => {
            let f = f64::from_bits(r.next());
            json!(if f.is_finite() { f } else { 0.5 })
        }
        4 => json!(random_string(r)),
        5 => Value::Array((0..r.below(4)).map(|_| random_json(r, depth + 1)).collect()),
        _ => {
            let keys = [
                "task",
                "split",
                "seed",
                "options",
                "max_turns",
                "time_budget_s",
                "action",
                "tool",
                "arguments",
                "request_id",
                "function",
                "name",
                "id",
                "type",
                "solution",
                "files",
                "source",
                "device",
                "tolerance",
                "command",
                "pattern",
                "file_path",
                "content",
                "edits",
                "todos",
                "x",
            ];
            let mut m = serde_json::Map::new();
            for _ in 0..r.below(5) {
                let k = if r.below(6) == 0 {
                    random_string(r)
                } else {
                    r.pick(&keys).to_string()
                };
                m.insert(k, random_json(r, depth + 1));
            }
            Value::Object(m)
        }
    }
}

/// Percent-encodes every byte, within what a request line may hold (the real server answers
/// longer ones 414 before routing; here the request could not even be built).
fn encoded(s: &str) -> String {
    s.bytes().take(2000).map(|b| format!("%{b:02X}")).collect()
}

/// Bodies that are nearly valid: the shapes a real client sends, for the fuzz to mutate.
fn seeds() -> Vec<Value> {
    vec![
        json!({"task": "tiny/1_blue"}),
        json!({"split": "tiny", "seed": 3, "options": {"max_turns": 5, "time_budget_s": 30.0}}),
        json!({"action": {"tool": "Glob", "arguments": {"pattern": "**/*"}}, "request_id": "r1"}),
        json!({"action": {"tool": "Read", "arguments": {"file_path": "answer.txt", "offset": 1, "limit": 2}}}),
        json!({"action": {"tool": "Write", "arguments": {"file_path": "answer.txt", "content": "red"}}}),
        json!({"action": {"tool": "MultiEdit", "arguments": {"file_path": "answer.txt", "edits": [{"old_string": "r", "new_string": "b", "replace_all": true}]}}}),
        json!({"action": {"tool": "TodoWrite", "arguments": {"todos": [{"content": "c", "status": "pending", "activeForm": "a"}]}}}),
        json!({"action": {"tool": "Bash", "arguments": {"command": "true", "timeout": 1000}}}),
        json!({"action": {"id": "c1", "type": "function", "function": {"name": "Glob", "arguments": "{\"pattern\": \"*\"}"}}}),
        json!({"action": {"tool": "Submit", "arguments": {}}}),
        json!({"task": "tiny/0_red", "solution": "red"}),
        json!({"task": "tiny/0_red", "solution": {"files": {"answer.txt": "red"}}, "options": {"tolerance": 0.1}}),
    ]
}

/// Mutates a JSON value: replaces, drops or adds a node somewhere in it.
fn mutate(r: &mut Rng, v: &mut Value) {
    match v {
        Value::Object(m) if !m.is_empty() && r.below(3) > 0 => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = r.pick(&keys).clone();
            match r.below(4) {
                0 => {
                    m.remove(&k);
                }
                1 => {
                    m.insert(k, random_json(r, 2));
                }
                _ => {
                    if let Some(child) = m.get_mut(&k) {
                        mutate(r, child);
                    }
                }
            }
        }
        Value::Array(a) if !a.is_empty() && r.below(2) == 0 => {
            let i = r.below(a.len());
            mutate(r, &mut a[i]);
        }
        _ => *v = random_json(r, 2),
    }
}

/// Byte-level damage to a serialized body.
fn damage(r: &mut Rng, bytes: &mut Vec<u8>) {
    for _ in 0..=r.below(4) {
        if bytes.is_empty() {
            bytes.push(b'{');
        }
        let i = r.below(bytes.len());
        match r.below(5) {
            0 => bytes.truncate(i),
            1 => bytes[i] = (r.next() & 0xff) as u8,
            2 => bytes.insert(i, *r.pick(b"{}[]\",:\\\0\xff")),
            3 => {
                let chunk: Vec<u8> = bytes[i..].iter().take(64).copied().collect();
                bytes.splice(i..i, chunk);
            }
            _ => {
                bytes.remove(i);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_requests_never_fail_the_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state_from(ServerConfig {
        max_body_bytes: 256 * 1024,
        max_episodes: 10_000,
        // Hundreds of fuzzed resets: the answers are tested here, not the volume budget
        // (`volumes_are_admitted_against_the_memory_they_may_take`).
        volume_memory_bytes: Some(u64::MAX),
        ..test_config(dir.path())
    });
    let mut r = Rng(0x5eed_c0de_1234_5678);
    let seeds = seeds();
    let mut id = tiny_episode(&state).await;
    let methods = ["GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD"];
    let mut statuses = std::collections::BTreeMap::new();
    for case in 0..3000 {
        if case % 250 == 0 {
            id = tiny_episode(&state).await;
        }
        let path = match r.below(10) {
            0..=3 => format!("/v1/episodes/{id}/step"),
            4 => "/v1/episodes".to_string(),
            5 => "/v1/evaluate".to_string(),
            6 => format!(
                "/v1/episodes/{id}{}",
                r.pick(&["", "/trajectory", "/step/x", "/"])
            ),
            7 => format!("/v1/episodes/{}/step", encoded(&random_string(&mut r))),
            8 => r
                .pick(&[
                    "/v1/health",
                    "/v1/info",
                    "/v1/tasks",
                    "/metrics",
                    "/v1/openapi.json",
                    "/",
                    "//v1//episodes",
                    "/v1/episodes/%00",
                    "/v2",
                ])
                .to_string(),
            _ => format!("/{}", encoded(&random_string(&mut r))),
        };
        let method = if r.below(4) == 0 {
            *r.pick(&methods)
        } else if path.ends_with("/step")
            || path.ends_with("/episodes")
            || path.ends_with("/evaluate")
        {
            "POST"
        } else {
            "GET"
        };
        let body = match r.below(6) {
            0 => None,
            1 => Some(serde_json::to_vec(&random_json(&mut r, 0)).expect("json")),
            2 | 3 => {
                let mut v = r.pick(&seeds).clone();
                mutate(&mut r, &mut v);
                Some(serde_json::to_vec(&v).expect("json"))
            }
            4 => {
                let mut b = serde_json::to_vec(r.pick(&seeds)).expect("json");
                damage(&mut r, &mut b);
                Some(b)
            }
            _ => Some(serde_json::to_vec(r.pick(&seeds)).expect("json")),
        };
        let shown = body
            .as_ref()
            .map(|b| String::from_utf8_lossy(&b[..b.len().min(300)]).to_string());
        let (st, v) = raw(&state, method, &path, body).await;
        assert!(
            st.is_success() || st.is_client_error() || st == StatusCode::SERVICE_UNAVAILABLE,
            "case {case}: {method} {path} {shown:?} -> {st} {v}"
        );
        if st.is_client_error() && method != "HEAD" {
            assert!(
                v["error"]["code"].is_string(),
                "case {case}: {method} {path} {shown:?} -> {st}: not a JSON error: {v}"
            );
        }
        *statuses.entry(st.as_u16()).or_insert(0u32) += 1;
    }
    let (st, _) = call(&state, "GET", "/v1/health", None).await;
    assert_eq!(st, StatusCode::OK);
    // The cases reached the handlers, not only the parsers.
    assert!(
        statuses.get(&200).copied().unwrap_or(0) > 300,
        "{statuses:?}"
    );
    eprintln!("fuzz statuses: {statuses:?}");
}

/// Starts the real binary with extra arguments and environment on a free port; waits until it answers.
fn start_binary(
    dir: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Child, SocketAddr) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let log = std::fs::File::create(dir.join("server.log")).expect("log");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_env-server"));
    cmd.args(["--bind", &addr.to_string(), "--device", "cpu", "--data-dir"])
        .arg(dir.join("data"))
        .arg("--python")
        .arg(python())
        .args(args);
    cmd.env_remove("CUDA_AGENT_API_KEY");
    // A test that asks for precompiled headers (`--pch`) has them made in its own data
    // directory, not found ready in the suite's shared one.
    if args.contains(&"--pch") {
        cmd.env_remove("CUDA_AGENT_PCH_DIR");
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start env-server");
    let started = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "env-server did not come up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (child, addr)
}

fn authorized(addr: SocketAddr, key: &str) -> u16 {
    let mut s = connect(addr);
    write!(s, "GET /v1/tasks HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\nconnection: close\r\n\r\n").expect("send");
    read_answer(&mut s).0
}

#[test]
fn the_api_key_is_not_readable_from_the_servers_proc_files() {
    let key = "k3y-that-must-not-leak-7f9c2e";
    for way in ["env", "file"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let key_file = dir.path().join("key");
        std::fs::write(&key_file, format!("{key}\n")).expect("key file");
        let file_arg = key_file.display().to_string();
        let (mut child, addr) = match way {
            "env" => start_binary(dir.path(), &[], &[("CUDA_AGENT_API_KEY", key)]),
            _ => start_binary(dir.path(), &["--api-key-file", &file_arg], &[]),
        };
        let pid = child.id();
        assert_eq!(authorized(addr, key), 200, "{way}");
        assert_eq!(authorized(addr, "wrong"), 401, "{way}");
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let _ = child.kill();
        let _ = child.wait();
        let leaks = |b: &[u8]| b.windows(key.len()).any(|w| w == key.as_bytes());
        assert!(!leaks(&cmdline), "{way}: key in cmdline");
        assert!(!leaks(&environ), "{way}: key in environ");
        assert!(!status.is_empty());
    }
}

#[test]
fn a_key_on_the_command_line_still_works_and_is_warned_about() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut child, addr) = start_binary(dir.path(), &["--api-key", "argv-key"], &[]);
    let status = authorized(addr, "argv-key");
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(status, 200);
    let log = std::fs::read_to_string(dir.path().join("server.log")).expect("log");
    assert!(log.contains("readable by every local process"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_still_answers_after_the_attacks() {
    let (_dir, _state, addr) = server(short_limits(), |c| c).await;
    blocking(move || {
        // Garbage in place of HTTP, a request line that never ends, a bad method.
        for junk in [
            &b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"[..],
            b"GET /",
            b"BREW /v1/health HTTP/1.1\r\nhost: x\r\n\r\n",
            b"GET /v1/health HTTP/9.9\r\n\r\n",
        ] {
            let mut s = connect(addr);
            let _ = s.write_all(junk);
            let _ = read_to_close(&mut s);
        }
        assert_eq!(get(addr, "/v1/health").0, 200);
    })
    .await
    .expect("attack");
}

/// A task of the caller's own, posted with `/v1/evaluate`, whose code (run by the judge) writes
/// into the torch.compile cache it is given: later judges of every task load that cache, so a
/// task could slow (or change) everyone's compile baseline. Its cache must be its own and be
/// gone with it. The task raises if it has no cache to write, so a judged result shows that
/// the write happened; the shared cache must not hold it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_posted_task_cannot_write_the_shared_compile_cache() {
    let (dir, _state, addr) = server(short_limits(), |c| c).await;
    let task = r#"import os
import torch
import torch.nn as nn


def _plant():
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        d = os.environ.get(var)
        if d is None:
            continue
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "planted-by-task"), "w") as f:
            f.write("x")
        return
    raise RuntimeError("no compile cache to plant in")


class Model(nn.Module):
    def forward(self, a, b):
        return a + b


def get_inputs():
    _plant()
    return [torch.randn(1000), torch.randn(1000)]


def get_init_inputs():
    return []
"#;
    let model = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, a, b):\n        return a + b\n";
    let body = json!({"task": {"source": task}, "solution": model});
    let (st, v) = blocking(move || post_json(addr, "/v1/evaluate", &body))
        .await
        .expect("post");
    assert_eq!(st, 200, "{v}");
    assert_ne!(v["details"]["rule"], "harness_error", "{v}");
    let planted: Vec<_> = walkdir::WalkDir::new(dir.path())
        .into_iter()
        .flatten()
        .filter(|e| e.file_name() == "planted-by-task")
        .map(|e| e.path().to_path_buf())
        .collect();
    assert!(
        planted.is_empty(),
        "the task's files were kept: {planted:?}"
    );
}

/// Resident and peak resident memory of a process, in bytes (`VmRSS`, `VmHWM`).
fn memory_of(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .expect("a memory field")
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Many clients read a finished episode with a large log at once: the server used to read
/// and parse the whole log for every request (48 reads of a 62 MB log took it to 4 GiB).
/// Now a finished episode's state comes from a small summary read once, and its trajectory
/// streams from the log: the server's peak memory grows by less than half of the log while
/// 24 clients read it in parallel, each getting all of it.
#[test]
fn parallel_reads_of_a_large_log_keep_the_servers_memory_flat() {
    const READERS: usize = 24;
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    // A real finished episode, its one large step then copied until the log is large.
    let id = tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async {
            let state = state_from(test_config(&data));
            let id = tiny_episode(&state).await;
            let step = format!("/v1/episodes/{id}/step");
            let big = json!({"action": {"tool": "Bash", "arguments": {"command": "head -c 20000 /dev/zero | tr '\\0' x"}}});
            let (st, v) = call(&state, "POST", &step, Some(big)).await;
            assert_eq!(st, StatusCode::OK, "{v}");
            let submit = json!({"action": {"tool": "Submit", "arguments": {}}});
            let (st, v) = call(&state, "POST", &step, Some(submit)).await;
            assert_eq!((st, &v["done"]), (StatusCode::OK, &json!(true)), "{v}");
            id
        });
    let log = data.join("trajectories").join(format!("{id}.jsonl"));
    let text = std::fs::read_to_string(&log).expect("log");
    let lines: Vec<&str> = text.lines().collect();
    let step = lines
        .iter()
        .find(|l| l.starts_with(r#"{"kind":"step""#) && l.len() > 20_000)
        .expect("the large step");
    let mut big = String::from(lines[0]);
    big.push('\n');
    let copies = (48 << 20) / step.len() + 1;
    for _ in 0..copies {
        big.push_str(step);
        big.push('\n');
    }
    for l in &lines[1..] {
        big.push_str(l);
        big.push('\n');
    }
    std::fs::write(&log, &big).expect("write the log");
    let log_bytes = big.len() as u64;
    let records = lines.len() + copies;
    drop(big);
    drop(text);

    let (mut child, addr) = start_binary(dir.path(), &[], &[]);
    let pid = child.id();
    let get_body = move |path: String| -> (u16, Vec<u8>) {
        let mut s = connect(addr);
        write!(
            s,
            "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        .expect("send");
        let raw = read_to_close(&mut s);
        let end = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("head");
        let status = String::from_utf8_lossy(&raw[..end])
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .expect("status");
        (status, raw[end + 4..].to_vec())
    };
    // One of each first: the summary is read, the allocator warmed; the answer is whole.
    let (st, body) = get_body(format!("/v1/episodes/{id}"));
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let (st, body) = get_body(format!("/v1/episodes/{id}/trajectory"));
    assert_eq!(st, 200);
    let decoded = dechunk(&body);
    let whole: Value = serde_json::from_slice(&decoded).expect("the trajectory is JSON");
    assert_eq!(whole["episode_id"], json!(id));
    assert_eq!(whole["records"].as_array().map(Vec::len), Some(records));
    let answer_bytes = decoded.len();
    drop((whole, decoded, body));
    let (_, peak_before) = memory_of(pid);

    let readers: Vec<_> = (0..READERS)
        .map(|i| {
            let (get_body, id) = (get_body, id.clone());
            std::thread::spawn(move || {
                let path = if i % 4 == 0 {
                    format!("/v1/episodes/{id}")
                } else {
                    format!("/v1/episodes/{id}/trajectory")
                };
                let (st, body) = get_body(path.clone());
                assert_eq!(st, 200, "{path}");
                (path, dechunk(&body).len())
            })
        })
        .collect();
    for r in readers {
        let (path, n) = r.join().expect("reader");
        if path.ends_with("/trajectory") {
            assert_eq!(n, answer_bytes, "a reader got part of the log");
        }
    }
    let (_, peak_after) = memory_of(pid);
    let _ = child.kill();
    let _ = child.wait();
    let grew = peak_after.saturating_sub(peak_before);
    eprintln!(
        "log {} MiB; peak {} -> {} MiB with {READERS} readers",
        log_bytes >> 20,
        peak_before >> 20,
        peak_after >> 20
    );
    assert!(
        grew < log_bytes / 2,
        "the server's peak memory grew by {} MiB reading a {} MiB log",
        grew >> 20,
        log_bytes >> 20
    );
}

/// The body of a chunked answer, its chunks joined (a body without chunking as is).
fn dechunk(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len());
    let mut rest = body;
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return body.to_vec();
        };
        let Ok(size) = usize::from_str_radix(
            String::from_utf8_lossy(&rest[..eol])
                .split(';')
                .next()
                .unwrap_or("")
                .trim(),
            16,
        ) else {
            return body.to_vec();
        };
        if size == 0 {
            return out;
        }
        let start = eol + 2;
        out.extend_from_slice(&rest[start..start + size]);
        rest = &rest[start + size + 2..];
    }
}

/// A web page the operator visits can send a "simple" cross-site POST (text/plain, no
/// preflight) to a server on localhost, and used to start episodes with a task of its own.
/// A text/plain body is refused, and so is any request a browser sends (it carries Origin);
/// a program's JSON request and an empty reset still start episodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_cannot_start_episodes() {
    let (_dir, state, addr) = server(short_limits(), |c| c).await;
    let body = json!({"task": "tiny/0_red"}).to_string();
    let answers = blocking(move || {
        [
            post(addr, "/v1/episodes", "content-type: text/plain\r\n", &body),
            post(
                addr,
                "/v1/episodes",
                "content-type: application/x-www-form-urlencoded\r\n",
                &body,
            ),
            post(
                addr,
                "/v1/episodes",
                "content-type: application/json\r\norigin: http://evil.example\r\n",
                &body,
            ),
            post(
                addr,
                "/v1/episodes",
                "content-type: text/plain\r\norigin: null\r\n",
                &body,
            ),
            post(
                addr,
                "/v1/episodes",
                "content-type: application/json\r\n",
                &body,
            ),
            post(addr, "/v1/episodes", "", ""),
        ]
    })
    .await
    .expect("posts");
    let statuses: Vec<u16> = answers.iter().map(|(s, _)| *s).collect();
    assert_eq!(statuses, [415, 415, 403, 403, 200, 200], "{answers:?}");
    for (_, body) in &answers[..4] {
        let v: Value = serde_json::from_slice(body).expect("a JSON error");
        assert!(v["error"]["message"].as_str().is_some(), "{v}");
    }
    assert_eq!(
        state.episodes.live_ids().len(),
        2,
        "a refused request started an episode"
    );
}

/// Solution file names that are directories (`kernels/`), or a file and a directory at once,
/// used to fail while the files were written: a 500 that named the server's own paths. They
/// are a 400 that names the file alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn solution_names_that_are_directories_are_refused_plainly() {
    let (dir, _state, addr) = server(short_limits(), |c| c).await;
    let model = "import torch\nclass ModelNew(torch.nn.Module):\n    pass\n";
    let bad = [
        json!({"model_new.py": model, "kernels/": "x"}),
        json!({"model_new.py": model, "kernels/a.cu": "x", "kernels/a.cu/b.cu": "y"}),
        json!({"model_new.py": model, "kernels": "x"}),
    ];
    let root = dir.path().display().to_string();
    for files in bad {
        let body = json!({"task": "L1/2_Add", "solution": {"files": files}});
        let (st, v) = blocking(move || post_json(addr, "/v1/evaluate", &body))
            .await
            .expect("post");
        assert_eq!(
            (st, v["error"]["code"].as_str()),
            (400, Some("bad_solution")),
            "{v}"
        );
        let text = v.to_string();
        assert!(!text.contains(&root) && !text.contains("/evals/"), "{text}");
    }
}

/// Terminal controls in a command's output (ESC sequences that clear or retitle a screen,
/// BEL, NUL) used to reach observations raw, to whatever shows or parses them. They arrive
/// escaped, visible as text; tabs and newlines stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_bytes_reach_observations_escaped() {
    let (_dir, state, addr) = server(short_limits(), |c| c).await;
    let id = tiny_episode(&state).await;
    let body = json!({"action": {"tool": "Bash", "arguments": {"command": r"printf 'a\033[2Jb\007c\000d\te\x9bf\n'"}}});
    let (st, v) = blocking(move || post_json(addr, &format!("/v1/episodes/{id}/step"), &body))
        .await
        .expect("step");
    assert_eq!(st, 200, "{v}");
    let text = v["observation"]["text"].as_str().expect("text");
    for c in ['\u{1b}', '\u{7}', '\u{0}', '\u{9b}'] {
        assert!(!text.contains(c), "{c:?} reached the observation: {text:?}");
    }
    assert!(text.contains(r"a\x1b[2Jb\x07c\x00d"), "{text:?}");
    assert!(text.contains("d\te"), "{text:?}");
}

/// Processes whose command line names the data directory's evaluations.
fn evaluation_processes(data_dir: &std::path::Path) -> Vec<String> {
    let evals = data_dir.join("evals").display().to_string();
    std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&evals))
        .collect()
}

/// A client that posts evaluations and hangs up at once used to leave each running to its
/// time limit (a thousand in seconds). One whose client is gone is cancelled: its processes
/// end and its directory goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evaluation_whose_client_hung_up_is_cancelled() {
    let (dir, _state, addr) = server(short_limits(), |c| c).await;
    // Its build would take ten minutes.
    let slow = "import time\ntime.sleep(600)\n";
    let body = json!({"task": "L1/2_Add", "solution": slow}).to_string();
    let data = dir.path().to_path_buf();
    blocking(move || {
        let mut s = connect(addr);
        write!(
            s,
            "POST /v1/evaluate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("send");
        let started = Instant::now();
        while evaluation_processes(&data).is_empty() {
            assert!(started.elapsed() < BOUND, "the build never started");
            std::thread::sleep(Duration::from_millis(50));
        }
        drop(s);
        let started = Instant::now();
        loop {
            let left = evaluation_processes(&data);
            let dirs = std::fs::read_dir(data.join("evals")).map(|d| d.count()).unwrap_or(0);
            if left.is_empty() && dirs == 0 {
                break;
            }
            assert!(
                started.elapsed() < BOUND,
                "still running after the client left: {left:?}, {dirs} evaluation dirs"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .expect("hang up");
}

/// Episode volumes are tmpfs (RAM) and a command may start hundreds of processes: the caps
/// alone admitted 4096 episodes of 1 GiB on a 23 GiB host and 256 commands of 512 processes
/// against a pid_max of 32768. A reset that finds the host's memory under the reserve is a 503
/// with Retry-After (here a reserve no host meets), and commands at once are bounded by the
/// host's pids; both shown in /v1/info.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_is_bounded_by_the_host() {
    let (_dir, state, addr) = server(short_limits(), |c| ServerConfig {
        min_available_memory_bytes: Some(u64::MAX / 4),
        ..c
    })
    .await;
    let raw = blocking(move || {
        let mut s = connect(addr);
        let body = json!({"task": "tiny/0_red"}).to_string();
        write!(
            s,
            "POST /v1/episodes HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("send");
        read_to_close(&mut s)
    })
    .await
    .expect("reset");
    let text = String::from_utf8_lossy(&raw).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 503"), "{text}");
    assert!(text.contains("\r\nretry-after:"), "{text}");
    assert!(
        text.contains("host_busy") && text.contains("memory"),
        "{text}"
    );
    assert_eq!(state.episodes.live_ids().len(), 0);

    let pid_max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .expect("pid_max")
        .trim()
        .parse()
        .expect("a number");
    let (_, info) = call(&state, "GET", "/v1/info", None).await;
    let cap = &info["capacity"];
    assert_eq!(cap["admission"]["host"]["pid_max"], json!(pid_max), "{cap}");
    let per_command = ServerConfig::default().limits.total_processes;
    let max_commands = cap["max_commands"].as_u64().expect("max_commands");
    assert!(
        max_commands * per_command <= pid_max / 2,
        "{max_commands} commands of {per_command} processes against pid_max {pid_max}"
    );
}

/// Processes (the compiler's driver and its cc1plus) precompiling the torch headers for the
/// server under `data_dir`.
fn header_compilers(data_dir: &std::path::Path) -> Vec<u32> {
    let pch = data_dir.join("pch").display().to_string();
    std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .is_ok_and(|c| c.contains(&pch))
        })
        .collect()
}

/// The server precompiles torch's headers in the background (a core-minute each); a server
/// stopped meanwhile left its compiler running, orphaned. It ends with the server.
#[test]
fn the_header_precompile_ends_with_the_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut child, _addr) = start_binary(dir.path(), &["--pch", "-O3"], &[]);
    let data = dir.path().join("data");
    let started = Instant::now();
    while header_compilers(&data).is_empty() {
        assert!(
            started.elapsed() < BOUND,
            "no header precompile started: {}",
            std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: kill sends a signal to the server this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let _ = child.wait();
    let stopped = Instant::now();
    loop {
        let left = header_compilers(&data);
        if left.is_empty() {
            break;
        }
        assert!(
            stopped.elapsed() < BOUND,
            "the compiler outlived the server: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A reset sent over the real connection loop; the whole answer, head and body, lowercased.
async fn reset_over_http(addr: SocketAddr, body: Value) -> String {
    let raw = blocking(move || {
        let mut s = connect(addr);
        let body = body.to_string();
        write!(
            s,
            "POST /v1/episodes HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("send");
        read_to_close(&mut s)
    })
    .await
    .expect("reset");
    String::from_utf8_lossy(&raw).to_ascii_lowercase()
}

/// What the open episodes' volumes reserve now, from /v1/info (None: nothing is reserved
/// here, as where volumes are measured directories on disk).
async fn volume_reserved(state: &std::sync::Arc<env_server::AppState>) -> Option<u64> {
    let (_, info) = call(state, "GET", "/v1/info", None).await;
    info["capacity"]["admission"]["volume_memory_reserved_bytes"].as_u64()
}

/// Episode volumes are tmpfs: two episodes writing 1 GB each raised the host's Shmem by
/// 1.9 GB, and 4096 episodes of 1 GiB were admitted on a 23 GiB host. Each tmpfs volume now
/// reserves its quota against a budget: with room for three, the fourth reset is a 503
/// `host_busy` with Retry-After naming the budget, and a DELETE or an episode's end gives its
/// quota back (the next reset is admitted). Budget and reservations in /v1/info and /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_are_admitted_against_the_memory_they_may_take() {
    const QUOTA: u64 = 8 << 20;
    let (_dir, state, addr) = server(short_limits(), |c| ServerConfig {
        disk_quota_bytes: QUOTA,
        volume_memory_bytes: Some(3 * QUOTA),
        ..c
    })
    .await;
    let (_, info) = call(&state, "GET", "/v1/info", None).await;
    if info["sandbox"]["disk_quota"] != json!("tmpfs") {
        eprintln!("skipped: volumes are measured here (not root?), and reserve no memory");
        assert_eq!(volume_reserved(&state).await, None);
        return;
    }
    assert_eq!(
        info["capacity"]["admission"]["volume_memory_bytes"],
        json!(3 * QUOTA),
        "{info}"
    );
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(tiny_episode(&state).await);
    }
    let text = reset_over_http(addr, json!({"task": "tiny/0_red"})).await;
    assert!(text.starts_with("http/1.1 503"), "{text}");
    assert!(text.contains("\r\nretry-after:"), "{text}");
    assert!(
        text.contains("host_busy") && text.contains("24 mib of their 24 mib budget"),
        "{text}"
    );
    assert_eq!(volume_reserved(&state).await, Some(3 * QUOTA));
    assert_eq!(state.episodes.live_ids().len(), 3);
    let (st, _) = call(&state, "GET", "/v1/ready", None).await;
    assert_eq!(
        st,
        StatusCode::SERVICE_UNAVAILABLE,
        "readiness says no room"
    );
    let (_, metrics) = call(&state, "GET", "/metrics", None).await;
    let metrics = metrics.as_str().unwrap_or_default().to_string();
    assert!(
        metrics.contains(&format!(
            "cuda_agent_volume_memory_reserved_bytes {}",
            3 * QUOTA
        )) && metrics.contains(&format!(
            "cuda_agent_volume_memory_budget_bytes {}",
            3 * QUOTA
        )),
        "{metrics}"
    );

    // A DELETE gives its volume's quota back.
    let (st, v) = call(&state, "DELETE", &format!("/v1/episodes/{}", ids[0]), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(volume_reserved(&state).await, Some(2 * QUOTA));
    ids[0] = tiny_episode(&state).await;
    let text = reset_over_http(addr, json!({"task": "tiny/0_red"})).await;
    assert!(text.starts_with("http/1.1 503"), "{text}");

    // So does an episode's end (here a Submit).
    let (st, v) = call(
        &state,
        "POST",
        &format!("/v1/episodes/{}/step", ids[1]),
        Some(json!({"action": {"tool": "Submit", "arguments": {}}})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["done"], json!(true), "{v}");
    assert_eq!(volume_reserved(&state).await, Some(2 * QUOTA));
    tiny_episode(&state).await;
    assert_eq!(volume_reserved(&state).await, Some(3 * QUOTA));
}

/// A reset that fails half-way (its volume mounted, its workspace not finished: here a
/// harness file is missing) gives its volume's reservation back: with room for one volume,
/// the next reset is admitted. Before, nothing was reserved; a leak here would refuse every
/// reset after a few failures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_failing_half_way_gives_its_reservation_back() {
    const QUOTA: u64 = 8 << 20;
    let (dir, state, _addr) = server(short_limits(), |c| ServerConfig {
        disk_quota_bytes: QUOTA,
        volume_memory_bytes: Some(QUOTA),
        ..c
    })
    .await;
    if volume_reserved(&state).await.is_none() {
        eprintln!("skipped: volumes are measured here (not root?), and reserve no memory");
        return;
    }
    let harness_file = dir.path().join("harness").join("verify.py");
    std::fs::remove_file(&harness_file).expect("a harness file to lose");
    for _ in 0..3 {
        let (st, v) = call(
            &state,
            "POST",
            "/v1/episodes",
            Some(json!({"task": "L1/1_ReLU"})),
        )
        .await;
        assert_eq!(st, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
        assert_eq!(volume_reserved(&state).await, Some(0), "{v}");
    }
    assert!(state.episodes.live_ids().is_empty());
    tiny_episode(&state).await;
    assert_eq!(volume_reserved(&state).await, Some(QUOTA));
}
