//! A client of an OpenAI-compatible chat-completions endpoint (vLLM, SGLang, llama.cpp's
//! server, `trainer serve`, a hosted API): request building, answer parsing, and retries with
//! backoff on 429, 5xx and connection errors. [`wire`] holds the parts of the chat-completions
//! wire format the runner sends and reads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use env_api::ErrorChain;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use wire::{ChatCompletion, ChatRequest, ErrorBody, ModelList, ToolDefinition};

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
    #[error("transport")]
    Transport(#[source] reqwest::Error),
    /// An answer that is not a chat completion (or not JSON at all).
    #[error("unexpected answer: {message}")]
    Decode {
        /// What is wrong, with the start of the answer.
        message: String,
        /// The JSON error, when reading the answer failed.
        #[source]
        source: Option<serde_json::Error>,
    },
}

impl ChatError {
    /// An answer that is not what was asked for, named by the start of its body.
    fn decode(what: &str, body: &[u8], source: Option<serde_json::Error>) -> Self {
        // The JSON error, if any, is the source: the chain prints it after the message.
        let message = format!("{what}: {}", excerpt(body));
        ChatError::Decode { message, source }
    }
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

/// The body of `POST /chat/completions`: `tool_choice` goes only with tools.
pub fn request_body<'a>(
    model: &'a str,
    messages: &'a [Value],
    tools: &'a [ToolDefinition],
    sampling: &'a Sampling,
) -> ChatRequest<'a> {
    ChatRequest {
        model,
        messages,
        max_tokens: sampling.max_tokens,
        tools,
        tool_choice: (!tools.is_empty()).then_some(sampling.tool_choice.as_str()),
        temperature: sampling.temperature,
        top_p: sampling.top_p,
    }
}

/// Parses a chat-completions answer (the first choice). `call_base` numbers tool calls that
/// come without an id.
pub fn parse_completion(body: &[u8], call_base: usize) -> Result<Completion, ChatError> {
    let answer: ChatCompletion = serde_json::from_slice(body)
        .map_err(|e| ChatError::decode("not a chat completion", body, Some(e)))?;
    answer
        .into_completion(call_base)
        .ok_or_else(|| ChatError::decode("no choices", body, None))
}

/// The message of an error answer: OpenAI's `error.message`, else the start of the body.
fn error_message(body: &str) -> String {
    serde_json::from_str::<ErrorBody>(body)
        .ok()
        .and_then(|b| b.error)
        .and_then(|e| e.message)
        .unwrap_or_else(|| truncate(body))
}

/// The start of an answer's body, for messages about it.
fn excerpt(body: &[u8]) -> String {
    truncate(&String::from_utf8_lossy(body))
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
        let body = self
            .send_with_retries(|| self.req(reqwest::Method::GET, "/models"), &mut 0)
            .await?;
        let list: ModelList = serde_json::from_slice(&body)
            .map_err(|e| ChatError::decode("not a model list", &body, Some(e)))?;
        list.data
            .into_iter()
            .next()
            .and_then(|m| m.id)
            .ok_or_else(|| ChatError::decode("no model listed", &body, None))
    }

    /// One completion of `messages` with `tools`, retried on 429, 5xx and connection errors.
    pub async fn complete(
        &self,
        messages: &[Value],
        tools: &[ToolDefinition],
        sampling: &Sampling,
        call_base: usize,
    ) -> Result<Completion, ChatError> {
        let body = request_body(&self.model, messages, tools, sampling);
        let mut retries = 0u64;
        let answer = self
            .send_with_retries(
                || {
                    self.req(reqwest::Method::POST, "/chat/completions")
                        .json(&body)
                },
                &mut retries,
            )
            .await?;
        let mut c = parse_completion(&answer, call_base)?;
        c.usage.retries = retries;
        Ok(c)
    }

    /// The body of a successful answer, a whole JSON document.
    async fn send_with_retries(
        &self,
        make: impl Fn() -> reqwest::RequestBuilder,
        retries: &mut u64,
    ) -> Result<Vec<u8>, ChatError> {
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
                        match resp.bytes().await {
                            // Whole JSON: what it holds is for the caller to read.
                            Ok(body) => match serde_json::from_slice::<IgnoredAny>(&body) {
                                Ok(_) => return Ok(body.to_vec()),
                                // Not JSON, as a body cut off mid-way: the connection
                                // failed, worth a retry.
                                Err(e) => (ChatError::decode("not JSON", &body, Some(e)), None),
                            },
                            Err(e) => (ChatError::Transport(e), None),
                        }
                    } else {
                        let text = resp.text().await.unwrap_or_default();
                        let message = error_message(&text);
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
            tracing::debug!(error = %ErrorChain(&err), attempt, delay_s = delay.as_secs_f64(), "model call retried");
            tokio::time::sleep(delay).await;
            attempt += 1;
            *retries += 1;
        }
    }
}

/// The parts of OpenAI's chat-completions wire format the runner uses: the request, the
/// answer (not streamed: the runner asks for none), the error body and `GET /models`.
///
/// Answers are read the way servers other than OpenAI's need: fields the runner does not use
/// are ignored, missing ones are empty, and a field of another type than the API's reads as
/// missing rather than failing the whole answer (as `content: 5` or an `id` of `3`).
pub mod wire {
    use serde::{Deserialize, Serialize};
    use serde_json::{Map, Number, Value};

    use super::{Completion, ToolCall, Usage};

    /// Field readers that take a value of an unexpected type as a missing one.
    mod lenient {
        use serde::de::{Deserializer, IgnoredAny};
        use serde::Deserialize;

        /// A `T`, or anything else.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OrNot<T> {
            Is(T),
            Not(IgnoredAny),
        }

        impl<T: Default> OrNot<T> {
            fn or_default(self) -> T {
                match self {
                    OrNot::Is(t) => t,
                    OrNot::Not(_) => T::default(),
                }
            }
        }

        /// A field that is `T`'s default unless it reads as a `T`.
        pub fn field<'de, D, T>(d: D) -> Result<T, D::Error>
        where
            D: Deserializer<'de>,
            T: Deserialize<'de> + Default,
        {
            OrNot::deserialize(d).map(OrNot::or_default)
        }

        /// A list (empty unless it is one) whose items are `T`'s default unless they read as
        /// a `T`: a list keeps its length, as positions may count.
        pub fn items<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
        where
            D: Deserializer<'de>,
            T: Deserialize<'de> + Default,
        {
            let items: Vec<OrNot<T>> = field(d)?;
            Ok(items.into_iter().map(OrNot::or_default).collect())
        }
    }

    /// The body of `POST /chat/completions`.
    #[derive(Debug, Clone, Serialize)]
    pub struct ChatRequest<'a> {
        /// The model.
        pub model: &'a str,
        /// The conversation.
        pub messages: &'a [Value],
        /// Most tokens of the completion.
        pub max_tokens: u64,
        /// The tools offered (left out when none).
        #[serde(skip_serializing_if = "<[_]>::is_empty")]
        pub tools: &'a [ToolDefinition],
        /// `auto`, `required` or `none` (only with tools).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub tool_choice: Option<&'a str>,
        /// Temperature.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub temperature: Option<f64>,
        /// Nucleus sampling.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub top_p: Option<f64>,
    }

    /// A tool offered to the model: `{"type": "function", "function": {...}}`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct ToolDefinition {
        /// Always `function`.
        #[serde(rename = "type")]
        pub kind: ToolKind,
        /// The function.
        pub function: FunctionDefinition,
    }

    /// The kinds of tool: functions only.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub enum ToolKind {
        /// A function the model calls with JSON arguments.
        Function,
    }

    /// A function tool.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct FunctionDefinition {
        /// The tool's name.
        pub name: String,
        /// What it does, for the model.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub description: Option<String>,
        /// The JSON Schema of its arguments.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub parameters: Option<Value>,
    }

    /// A chat-completions answer.
    #[derive(Debug, Clone, Default, Deserialize)]
    pub struct ChatCompletion {
        /// The completions (the runner asks for one).
        #[serde(default, deserialize_with = "lenient::items")]
        pub choices: Vec<Choice>,
        /// Tokens of the call; some servers leave them out.
        #[serde(default, deserialize_with = "lenient::field")]
        pub usage: Option<TokenUsage>,
    }

    /// One completion.
    #[derive(Debug, Clone, Default, Deserialize)]
    pub struct Choice {
        /// What the model said.
        #[serde(default, deserialize_with = "lenient::field")]
        pub message: ResponseMessage,
        /// `stop`, `length`, `tool_calls`...
        #[serde(default, deserialize_with = "lenient::field")]
        pub finish_reason: Option<String>,
    }

    /// The assistant's message.
    #[derive(Debug, Clone, Default, Deserialize)]
    pub struct ResponseMessage {
        /// Text, as a string or as content parts; null with tool calls.
        #[serde(default, deserialize_with = "lenient::field")]
        pub content: Option<MessageContent>,
        /// The tool calls.
        #[serde(default, deserialize_with = "lenient::items")]
        pub tool_calls: Vec<ResponseToolCall>,
    }

    /// A message's content.
    #[derive(Debug, Clone, PartialEq, Deserialize)]
    #[serde(untagged)]
    pub enum MessageContent {
        /// Text.
        Text(String),
        /// Content parts (a content of any other type reads as no parts).
        Parts(#[serde(deserialize_with = "lenient::items")] Vec<ContentPart>),
    }

    impl MessageContent {
        /// The text: the text of every part that has some, joined.
        pub fn text(self) -> String {
            match self {
                MessageContent::Text(t) => t,
                MessageContent::Parts(parts) => parts.into_iter().filter_map(|p| p.text).collect(),
            }
        }
    }

    /// A content part (`{"type": "text", "text": ...}`).
    #[derive(Debug, Clone, Default, PartialEq, Deserialize)]
    pub struct ContentPart {
        /// `text`, `image_url`...
        #[serde(rename = "type", default, deserialize_with = "lenient::field")]
        pub kind: Option<String>,
        /// The text, in a text part.
        #[serde(default, deserialize_with = "lenient::field")]
        pub text: Option<String>,
    }

    /// A tool call the model made.
    #[derive(Debug, Clone, Default, PartialEq, Deserialize)]
    pub struct ResponseToolCall {
        /// The call's id, which its answer names; some servers give none.
        #[serde(default, deserialize_with = "lenient::field")]
        pub id: Option<String>,
        /// `function`.
        #[serde(rename = "type", default, deserialize_with = "lenient::field")]
        pub kind: Option<String>,
        /// The function called.
        #[serde(default, deserialize_with = "lenient::field")]
        pub function: FunctionCall,
    }

    /// The function of a tool call.
    #[derive(Debug, Clone, Default, PartialEq, Deserialize)]
    pub struct FunctionCall {
        /// The tool's name.
        #[serde(default, deserialize_with = "lenient::field")]
        pub name: Option<String>,
        /// The arguments; none when missing or null.
        #[serde(default)]
        pub arguments: Option<Arguments>,
    }

    /// A tool call's arguments.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(untagged)]
    pub enum Arguments {
        /// A string holding a JSON object, as the API defines them.
        Text(String),
        /// An object, as some servers send.
        Object(Map<String, Value>),
        /// Anything else (a number, a list): passed on as it came, for the environment to
        /// refuse with a reason the model reads.
        Other(Value),
    }

    impl From<Arguments> for Value {
        fn from(a: Arguments) -> Self {
            match a {
                Arguments::Text(s) => Value::String(s),
                Arguments::Object(m) => Value::Object(m),
                Arguments::Other(v) => v,
            }
        }
    }

    /// Tokens of one call.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
    pub struct TokenUsage {
        /// Prompt tokens.
        #[serde(default, deserialize_with = "lenient::field")]
        pub prompt_tokens: u64,
        /// Completion tokens.
        #[serde(default, deserialize_with = "lenient::field")]
        pub completion_tokens: u64,
    }

    impl ChatCompletion {
        /// The runner's reading of the first choice; None without one. `call_base` numbers
        /// tool calls that come without an id.
        pub fn into_completion(self, call_base: usize) -> Option<Completion> {
            let choice = self.choices.into_iter().next()?;
            let usage = self.usage.unwrap_or_default();
            let tool_calls = choice
                .message
                .tool_calls
                .into_iter()
                .enumerate()
                .map(|(i, c)| ToolCall {
                    id: c
                        .id
                        .filter(|id| !id.is_empty())
                        .unwrap_or_else(|| format!("call_{}", call_base + i)),
                    name: c.function.name.unwrap_or_default(),
                    arguments: c.function.arguments.map_or(Value::Null, Value::from),
                })
                .collect();
            Some(Completion {
                content: choice
                    .message
                    .content
                    .map(MessageContent::text)
                    .unwrap_or_default(),
                tool_calls,
                finish_reason: choice.finish_reason.unwrap_or_default(),
                usage: Usage {
                    prompt_tokens: usage.prompt_tokens,
                    completion_tokens: usage.completion_tokens,
                    calls: 1,
                    retries: 0,
                },
            })
        }
    }

    /// An error answer: `{"error": {"message", "type", "code"}}`.
    #[derive(Debug, Clone, Default, Deserialize)]
    pub struct ErrorBody {
        /// The error; servers that answer otherwise leave it out.
        #[serde(default, deserialize_with = "lenient::field")]
        pub error: Option<ApiError>,
    }

    /// What went wrong.
    #[derive(Debug, Clone, Default, PartialEq, Deserialize)]
    pub struct ApiError {
        /// For people.
        #[serde(default, deserialize_with = "lenient::field")]
        pub message: Option<String>,
        /// `invalid_request_error`...
        #[serde(rename = "type", default, deserialize_with = "lenient::field")]
        pub kind: Option<String>,
        /// `context_length_exceeded`..., or an HTTP status some servers repeat.
        #[serde(default, deserialize_with = "lenient::field")]
        pub code: Option<ErrorCode>,
    }

    /// An error's code.
    #[derive(Debug, Clone, PartialEq, Deserialize)]
    #[serde(untagged)]
    pub enum ErrorCode {
        /// A name.
        Name(String),
        /// A number.
        Number(Number),
    }

    /// `GET /models`.
    #[derive(Debug, Clone, Default, Deserialize)]
    pub struct ModelList {
        /// The models.
        #[serde(default, deserialize_with = "lenient::items")]
        pub data: Vec<Model>,
    }

    /// A model served.
    #[derive(Debug, Clone, Default, Deserialize)]
    pub struct Model {
        /// Its name, for requests.
        #[serde(default, deserialize_with = "lenient::field")]
        pub id: Option<String>,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::wire::{ApiError, Arguments, ErrorCode, FunctionDefinition, ToolKind};

    fn parse(v: Value, call_base: usize) -> Result<Completion, ChatError> {
        parse_completion(v.to_string().as_bytes(), call_base)
    }

    #[test]
    fn a_request_carries_the_tools_and_the_sampling() {
        // As the environment sends its tools.
        let sent = json!({"type": "function", "function": {"name": "Bash", "description": "Runs a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}});
        let tool = ToolDefinition::deserialize(&sent).unwrap();
        assert_eq!(tool.kind, ToolKind::Function);
        assert_eq!(tool.function.name, "Bash");
        let tools = vec![tool];
        let s = Sampling {
            temperature: Some(0.7),
            top_p: None,
            max_tokens: 512,
            tool_choice: "auto".into(),
        };
        let messages = [json!({"role": "user", "content": "hi"})];
        let b = serde_json::to_value(request_body("m", &messages, &tools, &s)).unwrap();
        assert_eq!(b["model"], "m");
        assert_eq!(b["messages"][0]["content"], "hi");
        assert_eq!(b["tools"][0], sent, "a tool goes to the model as it came");
        assert_eq!(b["tool_choice"], "auto");
        assert_eq!(b["temperature"], 0.7);
        assert_eq!(b["max_tokens"], 512);
        assert!(b.get("top_p").is_none());
        let none = serde_json::to_value(request_body("m", &[], &[], &s)).unwrap();
        assert!(none.get("tools").is_none() && none.get("tool_choice").is_none());
        // A function without a description or parameters stays without them.
        let bare = ToolDefinition {
            kind: ToolKind::Function,
            function: FunctionDefinition {
                name: "Submit".into(),
                description: None,
                parameters: None,
            },
        };
        assert_eq!(
            serde_json::to_value(&bare).unwrap(),
            json!({"type": "function", "function": {"name": "Submit"}})
        );
        assert!(ToolDefinition::deserialize(&json!({"type": "retrieval"})).is_err());
    }

    #[test]
    fn a_response_with_tool_calls_is_read() {
        let body = br#"{"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "logprobs": null, "finish_reason": "tool_calls",
                "message": {"role": "assistant", "content": null, "refusal": null, "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "Bash", "arguments": "{\"command\": \"ls\"}"}},
                    {"id": "call_b", "type": "function", "function": {"name": "Read", "arguments": "{\"file_path\": \"model.py\"}"}}]}}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150,
                "prompt_tokens_details": {"cached_tokens": 0}},
            "system_fingerprint": "fp"}"#;
        let c = parse_completion(body, 0).unwrap();
        assert_eq!(c.content, "");
        assert_eq!(c.finish_reason, "tool_calls");
        assert_eq!(
            c.tool_calls,
            vec![
                ToolCall {
                    id: "call_a".into(),
                    name: "Bash".into(),
                    arguments: json!("{\"command\": \"ls\"}"),
                },
                ToolCall {
                    id: "call_b".into(),
                    name: "Read".into(),
                    arguments: json!("{\"file_path\": \"model.py\"}"),
                },
            ]
        );
        assert_eq!(
            c.usage,
            Usage {
                prompt_tokens: 120,
                completion_tokens: 30,
                calls: 1,
                retries: 0
            }
        );
        let m = c.message();
        assert_eq!(m["role"], "assistant");
        assert_eq!(m["tool_calls"][0]["type"], "function");
        assert_eq!(
            m["tool_calls"][1]["function"],
            json!({"name": "Read", "arguments": "{\"file_path\": \"model.py\"}"})
        );
    }

    #[test]
    fn a_response_with_content_only_is_read() {
        let body = br#"{"choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "Done."}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2}}"#;
        let c = parse_completion(body, 3).unwrap();
        assert_eq!(c.content, "Done.");
        assert_eq!(c.finish_reason, "stop");
        assert!(c.tool_calls.is_empty());
        assert_eq!((c.usage.prompt_tokens, c.usage.completion_tokens), (7, 2));
        assert_eq!(
            c.message(),
            json!({"role": "assistant", "content": "Done."})
        );
        // An empty list of tool calls is none.
        let empty = parse(
            json!({"choices": [{"message": {"content": "x", "tool_calls": []}}]}),
            0,
        )
        .unwrap();
        assert!(empty.tool_calls.is_empty() && empty.message().get("tool_calls").is_none());
    }

    #[test]
    fn a_response_without_usage_counts_no_tokens() {
        for usage in [json!(null), json!({}), json!("n/a")] {
            let mut v =
                json!({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]});
            if !usage.is_null() {
                v["usage"] = usage;
            }
            let c = parse(v, 0).unwrap();
            assert_eq!(
                c.usage,
                Usage {
                    calls: 1,
                    ..Usage::default()
                }
            );
        }
        let c = parse(
            json!({"choices": [{"message": {"content": "hi"}}], "usage": null}),
            0,
        )
        .unwrap();
        assert_eq!((c.usage.prompt_tokens, c.finish_reason.as_str()), (0, ""));
    }

    #[test]
    fn arguments_sent_as_an_object_are_kept_and_go_back_as_a_string() {
        let c = parse(
            json!({"choices": [{"finish_reason": "tool_calls", "message": {"tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "Glob", "arguments": {"pattern": "*.py"}}}]}}]}),
            0,
        )
        .unwrap();
        assert_eq!(c.tool_calls[0].arguments, json!({"pattern": "*.py"}));
        assert_eq!(
            c.message()["tool_calls"][0]["function"]["arguments"],
            "{\"pattern\":\"*.py\"}"
        );
        let a: Arguments = serde_json::from_str(r#"{"pattern": "*"}"#).unwrap();
        assert!(matches!(a, Arguments::Object(_)));
        let a: Arguments = serde_json::from_str(r#""{\"pattern\": \"*\"}""#).unwrap();
        assert_eq!(a, Arguments::Text("{\"pattern\": \"*\"}".into()));
    }

    #[test]
    fn tool_calls_are_parsed_in_every_shape_servers_send() {
        let v = json!({"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "Bash", "arguments": "{\"command\": \"ls\"}"}},
                {"type": "function", "function": {"name": "Glob", "arguments": {"pattern": "*"}}},
                {"id": "", "function": {"name": "Submit"}},
                {"id": 5, "index": 3, "function": {"name": "Read", "arguments": 7}},
                {"id": null, "function": {"name": null, "arguments": null}},
                "not a call"
            ]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}});
        let c = parse(v, 7).unwrap();
        assert_eq!(c.content, "");
        assert_eq!(c.finish_reason, "tool_calls");
        assert_eq!(c.tool_calls.len(), 6);
        assert_eq!(c.tool_calls[0].id, "call_a");
        assert_eq!(c.tool_calls[0].arguments, json!("{\"command\": \"ls\"}"));
        assert_eq!(c.tool_calls[1].id, "call_8");
        assert_eq!(c.tool_calls[1].arguments, json!({"pattern": "*"}));
        assert_eq!(c.tool_calls[2].id, "call_9");
        assert_eq!(c.tool_calls[2].arguments, Value::Null);
        // Arguments of another shape go on as they came, for the environment to refuse.
        assert_eq!(
            (c.tool_calls[3].id.as_str(), c.tool_calls[3].name.as_str()),
            ("call_10", "Read")
        );
        assert_eq!(c.tool_calls[3].arguments, json!(7));
        for call in &c.tool_calls[4..] {
            assert_eq!((call.name.as_str(), &call.arguments), ("", &Value::Null));
        }
        assert_eq!(c.tool_calls[5].id, "call_12");
        assert_eq!(c.usage.prompt_tokens, 10);
        assert_eq!(c.usage.completion_tokens, 5);
        // Back into the conversation: arguments as strings, as the API defines them.
        let m = c.message();
        assert_eq!(
            m["tool_calls"][1]["function"]["arguments"],
            "{\"pattern\":\"*\"}"
        );
        assert_eq!(m["tool_calls"][2]["function"]["arguments"], "null");
        assert_eq!(m["tool_calls"][3]["function"]["arguments"], "7");
        // Text only, and content parts (the text ones, joined).
        let t = parse(json!({"choices": [{"message": {"content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}, 3, {"type": "text", "text": "b"}]}, "finish_reason": "stop"}]}), 0).unwrap();
        assert_eq!(t.content, "ab");
        assert!(t.tool_calls.is_empty() && t.message().get("tool_calls").is_none());
        // Fields of other types than the API's read as missing.
        let odd = parse(
            json!({"choices": [{"message": {"content": 5, "tool_calls": "none"}, "finish_reason": 1}],
                "usage": {"prompt_tokens": -1, "completion_tokens": 2.5}}),
            0,
        )
        .unwrap();
        assert_eq!((odd.content.as_str(), odd.finish_reason.as_str()), ("", ""));
        assert!(odd.tool_calls.is_empty());
        assert_eq!(
            (odd.usage.prompt_tokens, odd.usage.completion_tokens),
            (0, 0)
        );
        let no_message = parse(json!({"choices": [{"finish_reason": "stop"}]}), 0).unwrap();
        assert_eq!(no_message.content, "");
    }

    #[test]
    fn answers_that_are_not_completions_are_decode_errors_with_their_cause() {
        for body in [
            json!({"error": "x"}),
            json!({"choices": []}),
            json!({"choices": {"0": {}}}),
            json!({"object": "error", "message": "overloaded"}),
        ] {
            match parse(body.clone(), 0) {
                Err(ChatError::Decode { message, source }) => {
                    assert!(message.starts_with("no choices: {"), "{message}");
                    assert!(source.is_none());
                }
                other => panic!("{body}: {other:?}"),
            }
        }
        for body in [&b"\"hello\""[..], b"5", b"null"] {
            match parse_completion(body, 0) {
                Err(
                    e @ ChatError::Decode {
                        source: Some(_), ..
                    },
                ) => {
                    assert!(std::error::Error::source(&e).is_some());
                    let text = String::from_utf8_lossy(body);
                    assert!(e.to_string().ends_with(&*text), "{e}");
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(parse_completion(b"{\"choices\": [", 0).is_err());
    }

    #[test]
    fn an_error_body_gives_its_message() {
        let openai = r#"{"error": {"message": "This model's maximum context length is 8192 tokens.",
            "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}"#;
        let body: ErrorBody = serde_json::from_str(openai).unwrap();
        assert_eq!(
            body.error,
            Some(ApiError {
                message: Some("This model's maximum context length is 8192 tokens.".into()),
                kind: Some("invalid_request_error".into()),
                code: Some(ErrorCode::Name("context_length_exceeded".into())),
            })
        );
        assert_eq!(
            error_message(openai),
            "This model's maximum context length is 8192 tokens."
        );
        // A number for a code, as some servers send.
        let numbered: ErrorBody =
            serde_json::from_str(r#"{"error": {"message": "busy", "code": 503}}"#).unwrap();
        assert!(matches!(
            numbered.error.and_then(|e| e.code),
            Some(ErrorCode::Number(n)) if n.as_u64() == Some(503)
        ));
        // Anything else: the start of the body.
        let vllm = r#"{"object":"error","message":"bad","type":"BadRequestError","code":400}"#;
        assert_eq!(error_message(vllm), vllm);
        assert_eq!(error_message(r#"{"error": "x"}"#), r#"{"error": "x"}"#);
        assert_eq!(
            error_message(r#"{"error": {"message": 3}}"#),
            r#"{"error": {"message": 3}}"#
        );
        assert_eq!(error_message("Bad Gateway"), "Bad Gateway");
        let long = "x".repeat(400);
        assert_eq!(error_message(&long), format!("{}...", &long[..300]));
    }

    #[test]
    fn the_first_listed_model_is_read() {
        let list: ModelList = serde_json::from_str(
            r#"{"object": "list", "data": [{"id": "qwen", "object": "model", "owned_by": "vllm"}, {"id": "other"}]}"#,
        )
        .unwrap();
        assert_eq!(list.data[0].id.as_deref(), Some("qwen"));
        let empty: ModelList = serde_json::from_str(r#"{"data": null}"#).unwrap();
        assert!(empty.data.is_empty());
    }

    /// A chat server on a local port that gives `answers` (status, body) in turn, one per
    /// connection, and sends on the body of each request.
    async fn canned_server(
        answers: Vec<(u16, &'static str)>,
    ) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/v1", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            for (status, body) in answers {
                let (mut sock, _) = listener.accept().await.unwrap();
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                let body_at = loop {
                    let n = sock.read(&mut buf).await.unwrap();
                    req.extend_from_slice(&buf[..n]);
                    if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&req[..body_at]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                while req.len() < body_at + len {
                    let n = sock.read(&mut buf).await.unwrap();
                    req.extend_from_slice(&buf[..n]);
                }
                tx.send(String::from_utf8_lossy(&req[body_at..]).into_owned())
                    .unwrap();
                let answer = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                sock.write_all(answer.as_bytes()).await.unwrap();
                sock.shutdown().await.ok();
            }
        });
        (base, rx)
    }

    fn client(base: &str) -> ChatClient {
        let mut c = ChatClient::new(base, "m", None, Duration::from_secs(10)).unwrap();
        c.retry = RetryPolicy {
            max_retries: 2,
            base: Duration::from_millis(1),
            max: Duration::from_millis(5),
        };
        c
    }

    #[tokio::test]
    async fn a_call_retries_what_is_not_json_and_reads_errors() {
        let ok = r#"{"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}"#;
        let (base, mut requests) = canned_server(vec![
            (200, r#"{"choices": [{"mess"#),
            (503, r#"{"error": {"message": "overloaded", "type": "server_error"}}"#),
            (200, ok),
            (401, r#"{"error": {"message": "bad key", "type": "auth", "code": null}}"#),
            (400, r#"{"error": {"message": "This model's maximum context length is 4096 tokens.", "code": "context_length_exceeded"}}"#),
            (200, r#"{"data": [{"id": "served", "object": "model"}]}"#),
            (200, r#"{"error": {"message": "upstream failed"}}"#),
        ])
        .await;
        let chat = client(&base);
        let tools = [ToolDefinition::deserialize(
            &json!({"type": "function", "function": {"name": "Submit", "parameters": {"type": "object"}}}),
        )
        .unwrap()];
        let s = Sampling {
            temperature: None,
            top_p: None,
            max_tokens: 8,
            tool_choice: "required".into(),
        };
        let messages = [json!({"role": "user", "content": "hi"})];
        let c = chat.complete(&messages, &tools, &s, 0).await.unwrap();
        assert_eq!(c.content, "hi");
        assert_eq!((c.usage.prompt_tokens, c.usage.retries), (3, 2));
        let sent: Value = serde_json::from_str(&requests.recv().await.unwrap()).unwrap();
        assert_eq!(
            sent,
            json!({"model": "m", "messages": messages, "max_tokens": 8, "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "Submit", "parameters": {"type": "object"}}}]})
        );
        match chat.complete(&messages, &tools, &s, 0).await {
            Err(ChatError::Api { status, message }) => {
                assert_eq!((status, message.as_str()), (401, "bad key"))
            }
            other => panic!("{other:?}"),
        }
        match chat.complete(&messages, &tools, &s, 0).await {
            Err(ChatError::ContextLength { limit, .. }) => assert_eq!(limit, Some(4096)),
            other => panic!("{other:?}"),
        }
        assert_eq!(chat.first_model().await.unwrap(), "served");
        match chat.complete(&messages, &tools, &s, 0).await {
            Err(ChatError::Decode { message, source }) => {
                assert!(
                    message.contains("upstream failed") && source.is_none(),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
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
