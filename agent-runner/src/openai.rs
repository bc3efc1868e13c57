//! A client of an OpenAI-compatible chat-completions endpoint (vLLM, SGLang, llama.cpp's
//! server, `trainer serve`, a hosted API): request building, answer parsing, and retries with
//! backoff on 429, 5xx and connection errors.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Errors of a chat-completions call.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The conversation (plus the completion asked for) is longer than the model's context.
    #[error("context length exceeded: {message}")]
    ContextLength {
        /// The server's message.
        message: String,
        /// The model's context, when the message names it.
        limit: Option<u64>,
    },
    /// The server answered with an error that retrying does not fix (or retries ran out).
    #[error("HTTP {status}: {message}")]
    Api {
        /// HTTP status.
        status: u16,
        /// The server's message.
        message: String,
    },
    /// No answer (connection refused, reset, timed out), after the retries.
    #[error("transport: {0}")]
    Transport(#[source] reqwest::Error),
    /// An answer that is not a chat completion.
    #[error("unexpected answer: {0}")]
    Decode(String),
}

/// Sampling settings sent with every request.
#[derive(Debug, Clone, Serialize)]
pub struct Sampling {
    /// Temperature.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Most tokens per completion.
    pub max_tokens: u64,
    /// `auto` (the model decides), `required` (a tool call every reply) or `none`.
    pub tool_choice: String,
}

/// Backoff between retries: exponential from `base`, at most `max`, with jitter; a
/// `Retry-After` header is honoured up to `max`.
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
            max_retries: 8,
            base: Duration::from_millis(500),
            max: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// Whether an HTTP status is worth retrying: rate limits, overload and server errors.
    pub fn retryable_status(status: u16) -> bool {
        matches!(status, 408 | 409 | 429) || (500..600).contains(&status)
    }

    /// The delay before retry `attempt` (0-based): `Retry-After` when given, else
    /// `base * 2^attempt` capped at `max`, scaled by a jitter factor in [0.5, 1].
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

/// A number in [0, 1) that differs between calls and processes: retries of many episodes
/// that failed together should not come back together.
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

/// Token counts of one or many calls.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Model calls answered.
    pub calls: u64,
    /// Attempts retried (429, 5xx, connection errors).
    pub retries: u64,
}

impl Usage {
    /// Adds `other` to this.
    pub fn add(&mut self, other: &Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.calls += other.calls;
        self.retries += other.retries;
    }
}

/// A tool call the model made, as OpenAI's `tool_calls[i]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The call id (made up when the server gives none).
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments: a JSON string as the API defines it, or an object some servers send.
    pub arguments: Value,
}

/// What the model answered.
#[derive(Debug, Clone)]
pub struct Completion {
    /// Text content (empty if none).
    pub content: String,
    /// Tool calls (empty if none).
    pub tool_calls: Vec<ToolCall>,
    /// `stop`, `length`, `tool_calls`...
    pub finish_reason: String,
    /// This call's tokens.
    pub usage: Usage,
}

impl Completion {
    /// The assistant message to put back into the conversation.
    pub fn message(&self) -> Value {
        let mut m = json!({"role": "assistant", "content": self.content});
        if !self.tool_calls.is_empty() {
            m["tool_calls"] = Value::Array(
                self.tool_calls
                    .iter()
                    .map(|c| {
                        let arguments = match &c.arguments {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}})
                    })
                    .collect(),
            );
        }
        m
    }
}

/// The body of `POST /chat/completions`.
pub fn request_body(
    model: &str,
    messages: &[Value],
    tools: &[Value],
    sampling: &Sampling,
) -> Value {
    let mut body = json!({
        "model": model,
        "messages": messages,
        "max_tokens": sampling.max_tokens,
    });
    if !tools.is_empty() {
        body["tools"] = Value::Array(tools.to_vec());
        body["tool_choice"] = json!(sampling.tool_choice);
    }
    if let Some(t) = sampling.temperature {
        body["temperature"] = json!(t);
    }
    if let Some(p) = sampling.top_p {
        body["top_p"] = json!(p);
    }
    body
}

/// Parses a chat-completions answer (the first choice). `call_base` numbers tool calls that
/// come without an id.
pub fn parse_completion(v: &Value, call_base: usize) -> Result<Completion, ChatError> {
    let choice = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or_else(|| ChatError::Decode(format!("no choices in {}", truncate(&v.to_string()))))?;
    let msg = &choice["message"];
    let content = match &msg["content"] {
        Value::String(s) => s.clone(),
        // Content parts: the text ones, joined.
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    };
    let tool_calls = msg["tool_calls"]
        .as_array()
        .map(|calls| {
            calls
                .iter()
                .enumerate()
                .map(|(i, c)| ToolCall {
                    id: c["id"]
                        .as_str()
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .unwrap_or_else(|| format!("call_{}", call_base + i)),
                    name: c["function"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    arguments: c["function"]["arguments"].clone(),
                })
                .collect()
        })
        .unwrap_or_default();
    let usage = Usage {
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        calls: 1,
        retries: 0,
    };
    Ok(Completion {
        content,
        tool_calls,
        finish_reason: choice["finish_reason"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        usage,
    })
}

fn truncate(s: &str) -> String {
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// Whether an error answer says the context is too long, as vLLM, SGLang, llama.cpp and
/// OpenAI word it.
pub fn is_context_error(status: u16, body: &str) -> bool {
    if !(status == 400 || status == 413 || status == 422) {
        return false;
    }
    let b = body.to_ascii_lowercase();
    [
        "context_length_exceeded",
        "context length",
        "maximum context",
        "context window",
        "exceeds the available context",
        "prompt is too long",
        "too many tokens",
    ]
    .iter()
    .any(|p| b.contains(p))
}

/// The context size an error message names (`maximum context length is 32768 tokens`).
pub fn context_limit_in(message: &str) -> Option<u64> {
    let lower = message.to_ascii_lowercase();
    let at = lower.find("maximum context length is")? + "maximum context length is".len();
    lower[at..]
        .trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|d| d.parse().ok())
}

/// A chat-completions endpoint.
#[derive(Debug, Clone)]
pub struct ChatClient {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
    /// The model name sent with each request.
    pub model: String,
    /// Retries.
    pub retry: RetryPolicy,
}

impl ChatClient {
    /// A client of `base` (such as `http://127.0.0.1:8000/v1`); each request may take up to
    /// `timeout`.
    pub fn new(
        base: &str,
        model: &str,
        api_key: Option<String>,
        timeout: Duration,
    ) -> Result<Self, ChatError> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(ChatError::Transport)?;
        Ok(Self {
            http,
            base: base.trim_end_matches('/').to_string(),
            api_key,
            model: model.to_string(),
            retry: RetryPolicy::default(),
        })
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.api_key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    /// The first model `GET /models` lists (for when no model was named).
    pub async fn first_model(&self) -> Result<String, ChatError> {
        let v: Value = self
            .send_with_retries(|| self.req(reqwest::Method::GET, "/models"), &mut 0)
            .await?;
        v["data"]
            .as_array()
            .and_then(|d| d.first())
            .and_then(|m| m["id"].as_str())
            .map(str::to_string)
            .ok_or_else(|| {
                ChatError::Decode(format!("no model listed: {}", truncate(&v.to_string())))
            })
    }

    /// One completion of `messages` with `tools`, retried on 429, 5xx and connection errors.
    pub async fn complete(
        &self,
        messages: &[Value],
        tools: &[Value],
        sampling: &Sampling,
        call_base: usize,
    ) -> Result<Completion, ChatError> {
        let body = request_body(&self.model, messages, tools, sampling);
        let mut retries = 0u64;
        let v = self
            .send_with_retries(
                || {
                    self.req(reqwest::Method::POST, "/chat/completions")
                        .json(&body)
                },
                &mut retries,
            )
            .await?;
        let mut c = parse_completion(&v, call_base)?;
        c.usage.retries = retries;
        Ok(c)
    }

    async fn send_with_retries(
        &self,
        make: impl Fn() -> reqwest::RequestBuilder,
        retries: &mut u64,
    ) -> Result<Value, ChatError> {
        let mut attempt = 0u32;
        loop {
            let (err, retry_after) = match make().send().await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let retry_after = resp
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<f64>().ok())
                        .and_then(|s| Duration::try_from_secs_f64(s).ok());
                    if resp.status().is_success() {
                        match resp.json::<Value>().await {
                            Ok(v) => return Ok(v),
                            // A body cut off mid-way: the connection failed, worth a retry.
                            Err(e) => (ChatError::Transport(e), None),
                        }
                    } else {
                        let text = resp.text().await.unwrap_or_default();
                        let message = serde_json::from_str::<Value>(&text)
                            .ok()
                            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                            .unwrap_or_else(|| truncate(&text));
                        if is_context_error(status, &text) {
                            return Err(ChatError::ContextLength {
                                limit: context_limit_in(&message),
                                message,
                            });
                        }
                        let e = ChatError::Api { status, message };
                        if !RetryPolicy::retryable_status(status) {
                            return Err(e);
                        }
                        (e, retry_after)
                    }
                }
                Err(e) => (ChatError::Transport(e), None),
            };
            if attempt >= self.retry.max_retries {
                return Err(err);
            }
            let delay = self.retry.delay(attempt, retry_after);
            tracing::debug!(error = %err, attempt, delay_s = delay.as_secs_f64(), "model call retried");
            tokio::time::sleep(delay).await;
            attempt += 1;
            *retries += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_carries_the_tools_and_the_sampling() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}),
        ];
        let s = Sampling {
            temperature: Some(0.7),
            top_p: None,
            max_tokens: 512,
            tool_choice: "auto".into(),
        };
        let b = request_body("m", &[json!({"role": "user", "content": "hi"})], &tools, &s);
        assert_eq!(b["model"], "m");
        assert_eq!(b["tools"][0]["function"]["name"], "Bash");
        assert_eq!(b["tool_choice"], "auto");
        assert_eq!(b["temperature"], 0.7);
        assert_eq!(b["max_tokens"], 512);
        assert!(b.get("top_p").is_none());
        let none = request_body("m", &[], &[], &s);
        assert!(none.get("tools").is_none() && none.get("tool_choice").is_none());
    }

    #[test]
    fn tool_calls_are_parsed_in_every_shape_servers_send() {
        let v = json!({"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "Bash", "arguments": "{\"command\": \"ls\"}"}},
                {"type": "function", "function": {"name": "Glob", "arguments": {"pattern": "*"}}},
                {"id": "", "function": {"name": "Submit"}}
            ]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}});
        let c = parse_completion(&v, 7).unwrap();
        assert_eq!(c.content, "");
        assert_eq!(c.finish_reason, "tool_calls");
        assert_eq!(c.tool_calls.len(), 3);
        assert_eq!(c.tool_calls[0].id, "call_a");
        assert_eq!(c.tool_calls[0].arguments, json!("{\"command\": \"ls\"}"));
        assert_eq!(c.tool_calls[1].id, "call_8");
        assert_eq!(c.tool_calls[1].arguments, json!({"pattern": "*"}));
        assert_eq!(c.tool_calls[2].id, "call_9");
        assert_eq!(c.tool_calls[2].arguments, Value::Null);
        assert_eq!(c.usage.prompt_tokens, 10);
        assert_eq!(c.usage.completion_tokens, 5);
        // Back into the conversation: arguments as strings, as the API defines them.
        let m = c.message();
        assert_eq!(
            m["tool_calls"][1]["function"]["arguments"],
            "{\"pattern\":\"*\"}"
        );
        // Text only, and content parts.
        let t = parse_completion(&json!({"choices": [{"message": {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, "finish_reason": "stop"}]}), 0).unwrap();
        assert_eq!(t.content, "ab");
        assert!(t.tool_calls.is_empty() && t.message().get("tool_calls").is_none());
        assert!(parse_completion(&json!({"error": "x"}), 0).is_err());
    }

    #[test]
    fn context_errors_are_recognised_and_their_limit_read() {
        let vllm = r#"{"object":"error","message":"This model's maximum context length is 32768 tokens. However, you requested 40000 tokens.","type":"BadRequestError","code":400}"#;
        assert!(is_context_error(400, vllm));
        assert_eq!(
            context_limit_in("This model's maximum context length is 32768 tokens. However"),
            Some(32768)
        );
        assert!(is_context_error(
            400,
            r#"{"error":{"code":"context_length_exceeded","message":"x"}}"#
        ));
        assert!(!is_context_error(
            400,
            r#"{"error":{"message":"unknown model"}}"#
        ));
        assert!(!is_context_error(500, "maximum context length"));
        assert_eq!(context_limit_in("too long"), None);
    }

    #[test]
    fn the_retry_policy_backs_off_and_honours_retry_after() {
        let p = RetryPolicy {
            max_retries: 5,
            base: Duration::from_millis(100),
            max: Duration::from_secs(2),
        };
        for status in [408, 429, 500, 502, 503, 504] {
            assert!(RetryPolicy::retryable_status(status), "{status}");
        }
        for status in [400, 401, 403, 404, 422] {
            assert!(!RetryPolicy::retryable_status(status), "{status}");
        }
        for attempt in 0..8 {
            let d = p.delay(attempt, None);
            let full = Duration::from_millis(100 << attempt.min(20)).min(p.max);
            assert!(d >= full / 2 && d <= full, "{attempt}: {d:?}");
        }
        assert_eq!(
            p.delay(0, Some(Duration::from_secs(1))),
            Duration::from_secs(1)
        );
        assert_eq!(p.delay(0, Some(Duration::from_secs(90))), p.max);
    }
}
