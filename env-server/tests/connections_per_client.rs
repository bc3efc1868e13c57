//! Red team: one client that opens connections until it holds every slot, starving the
//! others. The per-client cap (`HttpLimits::max_connections_per_client`) refuses it past
//! its share with a fixed 503, while other clients are still served; its share comes back
//! when its connections close.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use env_server::http::HttpLimits;
use env_server::ServerConfig;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};

/// How long a test waits for the server to do what a defence promises.
const BOUND: Duration = Duration::from_secs(30);

/// The attacker's address, and another client's (Linux routes all of 127/8 to loopback).
const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// A server with `limits` on a fresh data directory (kept alive by the caller), its state
/// and address.
async fn start(
    limits: HttpLimits,
) -> (
    tempfile::TempDir,
    std::sync::Arc<env_server::AppState>,
    SocketAddr,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state_from(ServerConfig {
        http: limits.clone(),
        ..test_config(dir.path())
    });
    let addr = serve(state.clone(), limits).await;
    (dir, state, addr)
}

/// A connection to `addr` from the local address `from`.
async fn connect_from(from: Ipv4Addr, addr: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(IpAddr::V4(from), 0))
        .expect("bind the client's address");
    socket.connect(addr).await.expect("connect")
}

/// Everything the server sends until it closes the connection (panics past the bound).
async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    match tokio::time::timeout(BOUND, s.read_to_end(&mut out)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Ok(Err(e)) => panic!("read: {e}"),
        Err(_) => panic!("the server kept the connection open for {BOUND:?}"),
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `GET /v1/health` from `from` over a fresh connection; the whole answer.
async fn health_from(from: Ipv4Addr, addr: SocketAddr) -> String {
    let mut s = connect_from(from, addr).await;
    s.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("send");
    read_to_close(&mut s).await
}

/// Waits until the server counts `n` connections open.
async fn wait_open(state: &env_server::AppState, n: u64) {
    let started = Instant::now();
    while state.http.open.load(Ordering::Relaxed) != n {
        assert!(
            started.elapsed() < BOUND,
            "the server counts {} connections open, not {n}",
            state.http.open.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_hold_every_connection() {
    const CAP: usize = 4;
    // Without the per-client cap the attacker's connections would take every slot.
    let limits = HttpLimits {
        max_connections: 2 * CAP,
        max_connections_per_client: CAP,
        // Idle connections stay open for the whole test: only the cap can refuse.
        header_timeout: Duration::from_secs(120),
        ..short_limits()
    };
    let (_dir, state, addr) = start(limits).await;

    // The attacker opens its share of connections and sends nothing.
    let mut holders = Vec::new();
    for _ in 0..CAP {
        holders.push(connect_from(ATTACKER, addr).await);
    }
    wait_open(&state, CAP as u64).await;

    // More from the same address, enough to take every slot: each gets the fixed 503 with
    // its own code and is closed.
    for _ in 0..20 {
        let mut s = connect_from(ATTACKER, addr).await;
        let answer = read_to_close(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(
            answer.contains("\"code\":\"too_many_connections_from_client\""),
            "{answer}"
        );
        assert!(answer.contains("retry-after: 1"), "{answer}");
    }
    assert_eq!(state.http.refused_per_client.load(Ordering::Relaxed), 20);
    assert_eq!(state.http.refused.load(Ordering::Relaxed), 0);
    // Refused connections took nothing: the attacker still holds just its share.
    wait_open(&state, CAP as u64).await;

    // Another client is served while the attacker holds its share.
    let answer = health_from(OTHER, addr).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // The attacker's own open connections still work.
    let held = &mut holders[0];
    held.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("send");
    let mut buf = [0u8; 12];
    tokio::time::timeout(BOUND, held.read_exact(&mut buf))
        .await
        .expect("an answer in time")
        .expect("read");
    assert_eq!(&buf, b"HTTP/1.1 200");

    // Its connections closed, the attacker's address is served again.
    drop(holders);
    wait_open(&state, 0).await;
    let answer = health_from(ATTACKER, addr).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_client_refusals_are_on_the_metrics_page() {
    let limits = HttpLimits {
        max_connections: 64,
        max_connections_per_client: 1,
        header_timeout: Duration::from_secs(120),
        ..short_limits()
    };
    let (_dir, state, addr) = start(limits).await;
    let holder = connect_from(ATTACKER, addr).await;
    wait_open(&state, 1).await;
    let mut s = connect_from(ATTACKER, addr).await;
    let answer = read_to_close(&mut s).await;
    assert!(
        answer.contains("too_many_connections_from_client"),
        "{answer}"
    );
    let (st, body) = raw(&state, "GET", "/metrics", None).await;
    assert!(st.is_success(), "{st}");
    let text = body.as_str().expect("the metrics page is text");
    assert!(
        text.contains("cuda_agent_http_connections_refused_per_client_total 1"),
        "{text}"
    );
    drop(holder);
}
