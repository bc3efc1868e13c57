//! A client of an OpenAI-compatible chat-completions endpoint (vLLM, SGLang, `trainer serve`,
//! a hosted API behind a plain-HTTP proxy): one text completion per call, retried with
//! backoff on 429, 5xx and connection errors, each attempt bounded by a timeout.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Errors of a chat-completions call.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The endpoint URL cannot be used.
    #[error("endpoint {url}: {reason}")]
    Endpoint {
        /// The URL given.
        url: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The server answered with an error that retrying does not fix, or retries ran out.
    #[error("HTTP {status}: {message}")]
    Api {
        /// HTTP status.
        status: u16,
        /// The server's message (OpenAI's `error.message`, else the start of the body).
        message: String,
    },
    /// No answer (refused, reset, timed out) after the retries.
    #[error("transport")]
    Transport(#[source] reqwest::Error),
    /// An answer that is not what was asked for.
    #[error("unexpected answer ({what}): {excerpt}")]
    Decode {
        /// What was expected.
        what: &'static str,
        /// The start of the answer's body.
        excerpt: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// A chat completion without a choice.
    #[error("the answer holds no choice")]
    NoChoice,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: String,
}

/// The speakers of a conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions.
    System,
    /// The asker.
    User,
    /// The model.
    Assistant,
}

/// The body of `POST /chat/completions`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatRequest<'a> {
    /// The model.
    pub model: &'a str,
    /// The conversation.
    pub messages: &'a [Message],
    /// Most tokens of the completion.
    pub max_tokens: u64,
    /// Sampling temperature (the server's default when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
}

/// The answer to `POST /chat/completions` (not streamed), the fields read.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatResponse {
    /// The model that answered.
    #[serde(default)]
    pub model: Option<String>,
    /// The completions; the first is used.
    #[serde(default)]
    pub choices: Vec<Choice>,
    /// Tokens counted by the server.
    #[serde(default)]
    pub usage: Option<TokenUsage>,
}

/// One completion.
#[derive(Debug, Clone, Deserialize)]
pub struct Choice {
    /// The assistant's message.
    pub message: AssistantMessage,
    /// `stop`, `length`...
    #[serde(default)]
    pub finish_reason: Option<String>,
}

/// The assistant's message of a completion.
#[derive(Debug, Clone, Deserialize)]
pub struct AssistantMessage {
    /// Its text (absent or null for a message of tool calls only).
    #[serde(default)]
    pub content: Option<String>,
}

/// Token counts of an answer, as its `usage` field gives them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUsage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Completion tokens.
    #[serde(default)]
    pub completion_tokens: u64,
}

impl TokenUsage {
    /// Adds `other` to this.
    pub fn add(&mut self, other: TokenUsage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
    }
}

/// The answer to `GET /models`, the fields read.
#[derive(Debug, Clone, Deserialize)]
struct ModelList {
    #[serde(default)]
    data: Vec<ModelEntry>,
}

#[derive(Debug, Clone, Deserialize)]
struct ModelEntry {
    id: String,
}

/// An error answer: `{"error": {"message": ...}}` or `{"error": "..."}`.
#[derive(Debug, Clone, Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum ErrorDetail {
    Object { message: String },
    Text(String),
}

/// What one completion gave.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The model that answered (the one asked for when the answer names none).
    pub model: String,
    /// The text of the first choice (empty if none).
    pub content: String,
    /// Why the completion ended.
    pub finish_reason: Option<String>,
    /// Tokens of this call (zero when the server reports none).
    pub usage: TokenUsage,
    /// Attempts retried before the answer.
    pub retries: u32,
}

/// A failed call, with the attempts it retried.
#[derive(Debug, thiserror::Error)]
#[error("failed after {retries} retries")]
pub struct CallFailed {
    /// The last attempt's error.
    #[source]
    pub error: ChatError,
    /// Attempts retried.
    pub retries: u32,
}

/// Backoff between retries: exponential from `base`, at most `max`, with jitter; a
/// `Retry-After` header (seconds) is honoured up to `max`.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// The first delay.
    pub base: Duration,
    /// The longest delay.
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 5,
            base: Duration::from_millis(500),
            max: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// Whether an HTTP status is worth retrying: timeouts, rate limits, server errors.
    pub fn retryable(status: u16) -> bool {
        matches!(status, 408 | 429) || (500..600).contains(&status)
    }

    /// The delay before retry `attempt` (0-based): `Retry-After` when given, else
    /// `base * 2^attempt` capped at `max`, scaled by a factor in [0.5, 1].
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        if let Some(d) = retry_after {
            return d.min(self.max);
        }
        let exp = self
            .base
            .saturating_mul(1u32.checked_shl(attempt.min(20)).unwrap_or(u32::MAX))
            .min(self.max);
        exp.mul_f64(0.5 + 0.5 * jitter())
    }
}

/// A number in [0, 1) that differs between calls: requests that failed together should not
/// come back together.
fn jitter() -> f64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut z = nanos ^ COUNTER.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The start of a body, for messages about it.
fn excerpt(body: &[u8]) -> String {
    let s = String::from_utf8_lossy(body);
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.into_owned(),
    }
}

/// A chat-completions endpoint.
#[derive(Debug, Clone)]
pub struct ChatClient {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
    /// Retries.
    pub retry: RetryPolicy,
}

impl ChatClient {
    /// A client of `base` (such as `http://127.0.0.1:8000/v1`); each attempt may take up to
    /// `timeout`.
    pub fn new(base: &str, api_key: Option<String>, timeout: Duration) -> Result<Self, ChatError> {
        let endpoint = |reason: &str| ChatError::Endpoint {
            url: base.to_string(),
            reason: reason.to_string(),
        };
        // The workspace's reqwest is built without TLS (no heavy dependency for it).
        if base.starts_with("https://") {
            return Err(endpoint(
                "https is not built in; reach a hosted API through a local plain-HTTP proxy",
            ));
        }
        if !base.starts_with("http://") {
            return Err(endpoint("not an http:// URL"));
        }
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(ChatError::Transport)?;
        Ok(Self {
            http,
            base: base.trim_end_matches('/').to_string(),
            api_key,
            retry: RetryPolicy::default(),
        })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.api_key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    /// The first model `GET /models` lists (for when none was named).
    pub async fn first_model(&self) -> Result<String, CallFailed> {
        let (body, retries) = self
            .send(|| self.request(reqwest::Method::GET, "/models"))
            .await?;
        let list: ModelList = serde_json::from_slice(&body).map_err(|source| CallFailed {
            error: ChatError::Decode {
                what: "a model list",
                excerpt: excerpt(&body),
                source,
            },
            retries,
        })?;
        list.data
            .into_iter()
            .next()
            .map(|m| m.id)
            .ok_or(CallFailed {
                error: ChatError::NoChoice,
                retries,
            })
    }

    /// One completion of `messages`.
    pub async fn complete(
        &self,
        model: &str,
        messages: &[Message],
        max_tokens: u64,
        temperature: Option<f64>,
    ) -> Result<Completion, CallFailed> {
        let body = ChatRequest {
            model,
            messages,
            max_tokens,
            temperature,
        };
        let (answer, retries) = self
            .send(|| {
                self.request(reqwest::Method::POST, "/chat/completions")
                    .json(&body)
            })
            .await?;
        let failed = |error| CallFailed { error, retries };
        let parsed: ChatResponse = serde_json::from_slice(&answer).map_err(|source| {
            failed(ChatError::Decode {
                what: "a chat completion",
                excerpt: excerpt(&answer),
                source,
            })
        })?;
        let choice = parsed
            .choices
            .into_iter()
            .next()
            .ok_or_else(|| failed(ChatError::NoChoice))?;
        Ok(Completion {
            model: parsed
                .model
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| model.to_string()),
            content: choice.message.content.unwrap_or_default(),
            finish_reason: choice.finish_reason,
            usage: parsed.usage.unwrap_or_default(),
            retries,
        })
    }

    /// The body of a successful answer and the attempts retried before it.
    async fn send(
        &self,
        make: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<(Vec<u8>, u32), CallFailed> {
        let mut attempt = 0u32;
        loop {
            let (error, retry_after) = match make().send().await {
                Ok(resp) => {
                    let status = resp.status();
                    let retry_after = resp
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<f64>().ok())
                        .and_then(|s| Duration::try_from_secs_f64(s).ok());
                    match resp.bytes().await {
                        Ok(body) if status.is_success() => return Ok((body.to_vec(), attempt)),
                        Ok(body) => {
                            let message = serde_json::from_slice::<ErrorBody>(&body)
                                .map(|b| match b.error {
                                    ErrorDetail::Object { message }
                                    | ErrorDetail::Text(message) => message,
                                })
                                .unwrap_or_else(|_| excerpt(&body));
                            let error = ChatError::Api {
                                status: status.as_u16(),
                                message,
                            };
                            if !RetryPolicy::retryable(status.as_u16()) {
                                return Err(CallFailed {
                                    error,
                                    retries: attempt,
                                });
                            }
                            (error, retry_after)
                        }
                        // The body broke off: the connection failed, worth a retry.
                        Err(e) => (ChatError::Transport(e), None),
                    }
                }
                Err(e) => (ChatError::Transport(e), None),
            };
            if attempt >= self.retry.max_retries {
                return Err(CallFailed {
                    error,
                    retries: attempt,
                });
            }
            let delay = self.retry.delay(attempt, retry_after);
            tracing::warn!(%error, attempt, delay_s = delay.as_secs_f64(), "model call retried");
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_and_honours_retry_after() {
        let p = RetryPolicy {
            max_retries: 5,
            base: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        for attempt in 0..8 {
            let d = p.delay(attempt, None);
            let full = Duration::from_millis(100 << attempt.min(4)).min(p.max);
            assert!(d >= full / 2 && d <= full, "{attempt}: {d:?}");
        }
        assert_eq!(
            p.delay(0, Some(Duration::from_secs(9))),
            Duration::from_secs(1)
        );
        assert!(RetryPolicy::retryable(429) && RetryPolicy::retryable(503));
        assert!(!RetryPolicy::retryable(400) && !RetryPolicy::retryable(401));
    }

    #[test]
    fn answers_of_other_servers_read() {
        let r: ChatResponse = serde_json::from_str(
            r#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[]},"finish_reason":"stop"}]}"#,
        )
        .unwrap();
        assert!(r.usage.is_none() && r.model.is_none());
        assert_eq!(r.choices[0].message.content, None);
        let e: ErrorBody = serde_json::from_str(r#"{"error":"overloaded"}"#).unwrap();
        assert!(matches!(e.error, ErrorDetail::Text(m) if m == "overloaded"));
    }

    #[test]
    fn https_and_other_schemes_are_refused_up_front() {
        for url in ["https://api.example.com/v1", "ftp://x"] {
            let e = ChatClient::new(url, None, Duration::from_secs(1)).unwrap_err();
            assert!(matches!(e, ChatError::Endpoint { .. }), "{e}");
        }
    }
}
