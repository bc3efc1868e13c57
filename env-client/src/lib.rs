//! Rust client of the environment API. Steps carry a `request_id`, so a step retried after a
//! transport error never runs twice on the server. [`fleet::Fleet`] spreads episodes and
//! evaluations over several servers and moves new work off servers that go away.

pub mod fleet;

pub use fleet::{Fleet, FleetConfig, FleetError, ServerHandle};

use std::time::Duration;

use env_api::{
    Action, EpisodeState, ErrorBody, EvaluateRequest, EvaluationResult, PlainAction, ProbeAnswer,
    ResetRequest, ResetResponse, StepRequest, StepResponse, TaskList, Trajectory,
};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error.
    #[error("HTTP {status} {code}: {message}")]
    Api {
        /// HTTP status.
        status: u16,
        /// The error code (`unknown_episode`, ...).
        code: String,
        /// The message.
        message: String,
    },
    /// The request did not get an answer.
    #[error("transport")]
    Transport(#[from] reqwest::Error),
}

impl ClientError {
    /// Whether retrying may help (transport failure, 429, 503).
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Transport(_) => true,
            ClientError::Api { status, .. } => matches!(status, 429 | 502 | 503 | 504),
        }
    }

    /// Whether the server is draining or has stopped (503 `draining` or `drained`): it takes
    /// no new work, and retrying there is futile.
    pub fn is_draining(&self) -> bool {
        matches!(self, ClientError::Api { status: 503, code, .. } if code == "draining" || code == "drained")
    }

    /// Whether the server is gone or going: no connection, a connection lost mid-request, or
    /// draining. An episode on it is lost (not failed); new work belongs on another server.
    /// A timeout is not this: the server may only be slow.
    pub fn is_server_gone(&self) -> bool {
        match self {
            ClientError::Transport(e) => is_connection_failure(e),
            ClientError::Api { .. } => self.is_draining(),
        }
    }

    /// Whether the request may have reached the server but its answer did not come back (the
    /// connection broke after it was sent): retry there with the same `request_id`.
    pub fn is_lost_answer(&self) -> bool {
        matches!(self, ClientError::Transport(e) if is_connection_failure(e) && !e.is_connect() && !e.is_timeout())
    }

    /// Whether the server refused the work for want of room (503 `at_capacity`, `host_busy`,
    /// `busy`, `too_many_connections`; 429): another server may have it.
    pub fn is_full(&self) -> bool {
        match self {
            ClientError::Api { status: 429, .. } => true,
            ClientError::Api {
                status: 503, code, ..
            } => matches!(
                code.as_str(),
                "at_capacity" | "host_busy" | "busy" | "too_many_connections"
            ),
            ClientError::Transport(_) => false,
            ClientError::Api { .. } => false,
        }
    }
}

/// How long a connection may take to open.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A client of one server.
#[derive(Debug, Clone)]
pub struct EnvClient {
    base: String,
    http: reqwest::Client,
    api_key: Option<String>,
    retries: u32,
}

impl EnvClient {
    /// A client of `base` (such as `http://127.0.0.1:8080`). Requests time out after `timeout`
    /// (which must cover a final evaluation).
    pub fn new(base: &str, timeout: Duration) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            // An address whose server is gone may drop packets rather than refuse them: give
            // up on connecting long before the request's own timeout.
            .connect_timeout(timeout.min(CONNECT_TIMEOUT))
            .pool_max_idle_per_host(1024)
            .build()?;
        Ok(Self {
            base: base.trim_end_matches('/').to_string(),
            http,
            api_key: None,
            retries: 3,
        })
    }

    /// The server's base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Sends `Authorization: Bearer KEY`.
    pub fn with_api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// How many times a step is retried on retryable errors.
    pub fn with_retries(mut self, n: u32) -> Self {
        self.retries = n;
        self
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.api_key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    async fn send<T: DeserializeOwned>(
        &self,
        rb: reqwest::RequestBuilder,
    ) -> Result<T, ClientError> {
        let resp = rb.send().await?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp.json().await?);
        }
        let text = resp.text().await.unwrap_or_default();
        let (code, message) = match serde_json::from_str::<ErrorBody>(&text) {
            Ok(e) => (e.error.code, e.error.message),
            Err(_) => ("http_error".into(), text),
        };
        Err(ClientError::Api {
            status: status.as_u16(),
            code,
            message,
        })
    }

    /// `GET /v1/health`.
    pub async fn health(&self) -> Result<ProbeAnswer, ClientError> {
        self.send(self.req(reqwest::Method::GET, "/v1/health"))
            .await
    }

    /// `GET /v1/info`.
    pub async fn info(&self) -> Result<Value, ClientError> {
        self.send(self.req(reqwest::Method::GET, "/v1/info")).await
    }

    /// `GET /v1/tasks`.
    pub async fn tasks(&self) -> Result<TaskList, ClientError> {
        self.send(self.req(reqwest::Method::GET, "/v1/tasks")).await
    }

    /// `POST /v1/episodes`.
    pub async fn reset(&self, req: &ResetRequest) -> Result<ResetResponse, ClientError> {
        self.send(self.req(reqwest::Method::POST, "/v1/episodes").json(req))
            .await
    }

    /// `POST /v1/episodes/{id}/step` with a fresh request_id, retried on retryable errors.
    pub async fn step(
        &self,
        id: &str,
        tool: &str,
        arguments: Value,
    ) -> Result<StepResponse, ClientError> {
        self.step_with_id(id, tool, arguments, &new_request_id())
            .await
    }

    /// A step with a given request_id (the server answers a repeat with the first answer).
    /// Not retried once the server drains: it takes no new step.
    pub async fn step_with_id(
        &self,
        id: &str,
        tool: &str,
        arguments: Value,
        request_id: &str,
    ) -> Result<StepResponse, ClientError> {
        let body = StepRequest {
            action: Action::Plain(PlainAction {
                tool: tool.into(),
                arguments,
            }),
            request_id: Some(request_id.into()),
        };
        let mut attempt = 0;
        loop {
            let r = self
                .send(
                    self.req(reqwest::Method::POST, &format!("/v1/episodes/{id}/step"))
                        .json(&body),
                )
                .await;
            match r {
                Err(e) if e.is_retryable() && !e.is_draining() && attempt < self.retries => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
                }
                other => return other,
            }
        }
    }

    /// `GET /v1/episodes/{id}`.
    pub async fn state(&self, id: &str) -> Result<EpisodeState, ClientError> {
        self.send(self.req(reqwest::Method::GET, &format!("/v1/episodes/{id}")))
            .await
    }

    /// `GET /v1/episodes/{id}/trajectory`.
    pub async fn trajectory(&self, id: &str) -> Result<Trajectory, ClientError> {
        self.send(self.req(
            reqwest::Method::GET,
            &format!("/v1/episodes/{id}/trajectory"),
        ))
        .await
    }

    /// `DELETE /v1/episodes/{id}`.
    pub async fn close(&self, id: &str) -> Result<EpisodeState, ClientError> {
        self.send(self.req(reqwest::Method::DELETE, &format!("/v1/episodes/{id}")))
            .await
    }

    /// `POST /v1/evaluate`.
    pub async fn evaluate(&self, req: &EvaluateRequest) -> Result<EvaluationResult, ClientError> {
        self.send(self.req(reqwest::Method::POST, "/v1/evaluate").json(req))
            .await
    }
}

/// Whether the connection failed (refused, reset, closed mid-answer), as against a timeout or
/// an answer that was not what was expected.
fn is_connection_failure(e: &reqwest::Error) -> bool {
    // A connect timeout is a failure to connect: an address whose pod is gone may drop
    // packets rather than refuse them.
    e.is_connect() || (!e.is_timeout() && (e.is_request() || e.is_body()))
}

/// A fresh idempotency key (32 hex digits).
pub fn new_request_id() -> String {
    format!("{:016x}{:016x}", rand_u64(), rand_u64())
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS; mixing in a counter keeps ids distinct in one process.
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.finish()
}
