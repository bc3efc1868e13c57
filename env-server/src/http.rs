//! Serving the router over TCP to clients that may be hostile: a cap on open connections
//! (excess ones get a 503 and are closed at once), a time limit on a request's headers that is
//! also the idle keep-alive limit, a limit on how long a response may wait for a client that
//! stops reading, and bounded headers. Request bodies are bounded in size and time by the
//! router itself (`api::router`), so the same limits hold in-process.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
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

/// Counters of the HTTP layer, for `/metrics`.
#[derive(Debug, Default)]
pub struct HttpCounters {
    /// Connections accepted and served.
    pub accepted: AtomicU64,
    /// Connections refused because too many were open.
    pub refused: AtomicU64,
    /// Connections open now.
    pub open: AtomicU64,
}

/// The answer to a connection over the cap.
static REFUSAL: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    let body = r#"{"error":{"code":"too_many_connections","message":"too many open connections; retry later"}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
});

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
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
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
        let Ok(slot) = slots.clone().try_acquire_owned() else {
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
