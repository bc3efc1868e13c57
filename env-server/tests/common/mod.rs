//! Shared by the integration tests: the server state over a temporary data directory, the
//! router driven in-process, and the real connection loop on a loopback socket.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use env_server::http::HttpLimits;
use env_server::{build_state, router, AppState, ServerConfig};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

/// The Python with torch the tests run the harness with.
pub fn python() -> std::path::PathBuf {
    std::env::var_os("CUDA_AGENT_PYTHON")
        .map(Into::into)
        .unwrap_or_else(|| "python3".into())
}

/// The precompiled headers the suite's runner made once for every server it starts
/// (`scripts/test.sh`: `CUDA_AGENT_PCH_DIR` and the variants in `CUDA_AGENT_PCH`); none
/// without them, as a server embedded with the default configuration has.
pub fn suite_pch() -> (Option<Vec<String>>, Option<std::path::PathBuf>) {
    let Some(dir) = std::env::var_os("CUDA_AGENT_PCH_DIR") else {
        return (Some(Vec::new()), None);
    };
    let variants = std::env::var("CUDA_AGENT_PCH")
        .ok()
        .filter(|v| v.trim() != "none")
        .map(|v| v.split(';').map(|f| f.trim().to_string()).collect());
    (Some(variants.unwrap_or_default()), Some(dir.into()))
}

/// A CPU configuration over `dir` with small bodies.
pub fn test_config(dir: &std::path::Path) -> ServerConfig {
    let (pch_variants, pch_dir) = suite_pch();
    ServerConfig {
        data_dir: dir.to_path_buf(),
        device: env_server::DeviceChoice::Cpu,
        python: python(),
        skip_compile: true,
        max_body_bytes: 64 * 1024,
        pch_variants,
        pch_dir,
        timing_budget: suite_timing_budget(),
        ..ServerConfig::default()
    }
}

/// The judge's timing budget the suite's runner asks for (`CUDA_AGENT_TIMING_BUDGET_S`, as
/// the server binary reads it), else the server's default.
pub fn suite_timing_budget() -> std::time::Duration {
    std::env::var("CUDA_AGENT_TIMING_BUDGET_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
        .unwrap_or(env_server::DEFAULT_TIMING_BUDGET)
}

/// The state for `cfg`.
pub fn state_from(cfg: ServerConfig) -> Arc<AppState> {
    build_state(cfg).expect("server state")
}

/// One request through the router, in-process; the body is parsed as JSON when it is.
pub async fn raw(
    state: &Arc<AppState>,
    method: &str,
    uri: &str,
    body: Option<Vec<u8>>,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(body.map(Body::from).unwrap_or_else(Body::empty))
        .expect("request");
    let resp = router(state.clone())
        .oneshot(req)
        .await
        .expect("infallible");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v)
}

/// A JSON request through the router.
pub async fn call(
    state: &Arc<AppState>,
    method: &str,
    uri: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    raw(state, method, uri, body.map(|b| b.to_string().into_bytes())).await
}

/// A tiny-family episode (judged without PyTorch); its id.
pub async fn tiny_episode(state: &Arc<AppState>) -> String {
    let (st, v) = call(
        state,
        "POST",
        "/v1/episodes",
        Some(serde_json::json!({"task": "tiny/0_red"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    v["episode_id"].as_str().expect("id").to_string()
}

/// The real connection loop over `state` on a free loopback port; its address.
pub async fn serve(state: Arc<AppState>, limits: HttpLimits) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let counters = state.http.clone();
    tokio::spawn(env_server::http::serve(
        listener,
        router(state),
        limits,
        counters,
        std::future::pending(),
    ));
    addr
}

/// Limits small enough for tests to reach.
pub fn short_limits() -> HttpLimits {
    HttpLimits {
        max_connections: 64,
        header_timeout: Duration::from_millis(300),
        body_timeout: Duration::from_millis(300),
        write_timeout: Duration::from_millis(300),
        ..HttpLimits::default()
    }
}

/// Bytes under `dir` (apparent sizes of its files; 0 where it does not exist).
pub fn bytes_under(dir: &std::path::Path) -> u64 {
    walkdir::WalkDir::new(dir)
        .into_iter()
        .flatten()
        .filter(|e| e.file_type().is_file())
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// Whether `pid` descends from this test process (the server runs in it): the host may run
/// other people's servers and harnesses at the same time.
pub fn descends_from_this_process(pid: u32) -> bool {
    let me = std::process::id();
    let mut p = pid;
    for _ in 0..64 {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            return false;
        };
        let Some(ppid) = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
            .and_then(|v| v.parse::<u32>().ok())
        else {
            return false;
        };
        if ppid == me {
            return true;
        }
        if ppid <= 1 {
            return false;
        }
        p = ppid;
    }
    false
}

/// Every process now, as its pid and its command line with spaces for the NULs (processes
/// gone while read are left out).
pub fn processes() -> Vec<(u32, String)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            Some((pid, String::from_utf8_lossy(&cmd).replace('\0', " ")))
        })
        .collect()
}
