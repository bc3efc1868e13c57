//! Serving the router over TCP to clients that may be hostile: a cap on open connections
//! and a smaller one per client address, so that one client cannot hold them all (excess
//! ones get a 503 and are closed at once), a time limit on a request's headers that is
//! also the idle keep-alive limit, a limit on how long a response may wait for a client that
//! stops reading, and bounded headers. Request bodies are bounded in size and time by the
//! router itself (`api::router`), so the same limits hold in-process.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

/// Limits of the HTTP layer.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// Most connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Most connections one client address may hold open at once (IPv4-mapped IPv6
    /// addresses count as their IPv4 address); more are answered 503 and closed. Under
    /// `max_connections`, so that one client cannot take every slot from the others.
    pub max_connections_per_client: usize,
    /// Most requests being handled at once (a request goes on after its client hangs up, so
    /// this can exceed the open connections); more are answered 503 `busy`. Enforced by the
    /// router (`api::router`).
    pub max_requests_in_flight: usize,
    /// Time a client has to send a request's headers, counted from the connection's start or
    /// the end of the previous answer: it is also the idle keep-alive limit.
    pub header_timeout: Duration,
    /// Time a client has to send a request's body.
    pub body_timeout: Duration,
    /// Time an answer may wait, unsent, for a client that stopped reading.
    pub write_timeout: Duration,
    /// Largest request head (request line plus headers), bytes.
    pub max_header_bytes: usize,
    /// Most headers in a request.
    pub max_headers: usize,
    /// Time open connections get to finish at shutdown.
    pub shutdown_grace: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            max_connections_per_client: HttpLimits::default_per_client(4096),
            max_requests_in_flight: 4096,
            header_timeout: Duration::from_secs(20),
            body_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            max_header_bytes: 16 * 1024,
            max_headers: 64,
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

impl HttpLimits {
    /// The default per-client cap for a global cap of `max_connections`: a quarter of it
    /// (at least 1). A trainer host runs hundreds of episodes over keep-alive connections,
    /// which fit; three quarters of the slots stay for the other clients.
    pub fn default_per_client(max_connections: usize) -> usize {
        (max_connections / 4).max(1)
    }
}

/// Counters of the HTTP layer, for `/metrics`.
#[derive(Debug, Default)]
pub struct HttpCounters {
    /// Connections accepted and served.
    pub accepted: AtomicU64,
    /// Connections refused because too many were open.
    pub refused: AtomicU64,
    /// Connections refused because their client address held too many open.
    pub refused_per_client: AtomicU64,
    /// Connections open now.
    pub open: AtomicU64,
}

/// The answer to a connection over the cap.
static REFUSAL: std::sync::LazyLock<Vec<u8>> =
    std::sync::LazyLock::new(|| refusal("too_many_connections", "too many open connections"));

/// The answer to a connection over its client's cap.
static REFUSAL_PER_CLIENT: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    refusal(
        "too_many_connections_from_client",
        "too many open connections from this address",
    )
});

/// A whole fixed 503 answer with error `code`, sent before closing.
fn refusal(code: &str, message: &str) -> Vec<u8> {
    let body = format!(r#"{{"error":{{"code":"{code}","message":"{message}; retry later"}}}}"#);
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The address a client's connections are counted under: an IPv4-mapped IPv6 address
/// (`::ffff:a.b.c.d`, what a dual-stack listener sees of an IPv4 peer) is its IPv4 address,
/// so one client is one count whichever listener it reaches.
pub fn client_key(addr: IpAddr) -> IpAddr {
    addr.to_canonical()
}

/// Open connections per client address. Only addresses with a connection open have an
/// entry, so it is bounded by the global cap.
#[derive(Debug)]
struct PerClient {
    cap: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

impl PerClient {
    /// One connection more for `ip`, or None when it already holds `cap`.
    fn try_acquire(self: &Arc<Self>, ip: IpAddr) -> Option<ClientSlot> {
        // A panic cannot leave the map half-updated (each update is one statement), so a
        // poisoned lock's map is still right.
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let n = open.entry(ip).or_insert(0);
        if *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            table: self.clone(),
            ip,
        })
    }
}

/// One open connection of a client; dropping it (however the connection ends, the task
/// finishing or being dropped at shutdown) gives it back.
#[derive(Debug)]
struct ClientSlot {
    table: Arc<PerClient>,
    ip: IpAddr,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self
            .table
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                // Gone at zero: addresses seen once leave nothing behind.
                open.remove(&self.ip);
            }
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets open connections finish
/// their requests for up to `limits.shutdown_grace`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    counters: Arc<HttpCounters>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let per_client = Arc::new(PerClient {
        cap: limits.max_connections_per_client.max(1),
        open: Mutex::new(HashMap::new()),
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_headers(limits.max_headers)
        .max_header_size(limits.max_header_bytes)
        .keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: never fatal,
                    // and no busy loop while descriptors are short.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // The client's own cap first: a client over it is told so, and takes no global slot.
        let Some(client_slot) = per_client.try_acquire(client_key(peer.ip())) else {
            counters.refused_per_client.fetch_add(1, Ordering::Relaxed);
            let _ = stream.try_write(&REFUSAL_PER_CLIENT);
            drop(stream);
            continue;
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(client_slot);
            counters.refused.fetch_add(1, Ordering::Relaxed);
            // One non-blocking write of a fixed answer, then close: a refused client costs
            // the server nothing that lasts.
            let _ = stream.try_write(&REFUSAL);
            drop(stream);
            continue;
        };
        counters.accepted.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let io = TokioIo::new(StallLimit::new(stream, limits.write_timeout));
        let conn = builder.serve_connection(io, service);
        let mut stop = stop_rx.clone();
        let counters = counters.clone();
        let grace = limits.shutdown_grace;
        tokio::spawn(async move {
            let _slot = slot;
            let _client_slot = client_slot;
            counters.open.fetch_add(1, Ordering::Relaxed);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "connection ended");
                    }
                }
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(grace, conn).await;
                }
            }
            counters.open.fetch_sub(1, Ordering::Relaxed);
        });
    }
    let _ = stop_tx.send(true);
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(
        limits.shutdown_grace + Duration::from_secs(1),
        slots.acquire_many(all),
    )
    .await;
    Ok(())
}

/// A connection whose writes fail once they have been blocked for `limit` in a row: a client
/// that stops reading its answer cannot hold a connection (and its handler's memory) forever.
struct StallLimit {
    io: TcpStream,
    limit: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl StallLimit {
    fn new(io: TcpStream, limit: Duration) -> Self {
        Self {
            io,
            limit,
            stalled: None,
        }
    }

    fn progress<T>(&mut self, r: Poll<io::Result<T>>, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        match r {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let limit = self.limit;
                let timer = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client stopped reading",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl AsyncRead for StallLimit {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for StallLimit {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.progress(r, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.progress(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.progress(r, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn an_ipv4_mapped_address_counts_as_its_ipv4_address() {
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3));
        let mapped = IpAddr::V6(Ipv4Addr::new(10, 1, 2, 3).to_ipv6_mapped());
        assert_eq!(client_key(mapped), v4);
        assert_eq!(client_key(v4), v4);
        // Other IPv6 addresses stay themselves, the IPv4-compatible form (`::a.b.c.d`,
        // deprecated and never a dual-stack peer) included.
        let v6 = IpAddr::V6("2001:db8::1".parse::<Ipv6Addr>().expect("v6"));
        assert_eq!(client_key(v6), v6);
        let compat = IpAddr::V6(Ipv4Addr::new(10, 1, 2, 3).to_ipv6_compatible());
        assert_eq!(client_key(compat), compat);
        let loopback = IpAddr::V6(Ipv6Addr::LOCALHOST);
        assert_eq!(client_key(loopback), loopback);
    }

    #[test]
    fn a_client_slot_is_given_back_when_dropped() {
        let table = Arc::new(PerClient {
            cap: 2,
            open: Mutex::new(HashMap::new()),
        });
        let a = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1));
        let b = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        let first = table.try_acquire(a).expect("first");
        let second = table.try_acquire(a).expect("second");
        assert!(table.try_acquire(a).is_none(), "over the cap");
        let other = table
            .try_acquire(b)
            .expect("another client has its own count");
        drop(first);
        let third = table
            .try_acquire(a)
            .expect("a slot given back is usable again");
        drop((second, third, other));
        assert!(
            table.open.lock().expect("lock").is_empty(),
            "addresses with nothing open leave no entry"
        );
    }
}
