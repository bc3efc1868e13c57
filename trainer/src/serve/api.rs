//! Wire types of the OpenAI-compatible API: what `POST /v1/chat/completions` accepts and
//! answers, `GET /v1/models`, and the error body.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `POST /v1/chat/completions` body. Fields OpenAI defines that the server does not use
/// (`user`, `frequency_penalty`, ...) are accepted and ignored, as clients send them freely.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The model's name; when given it must be the served one.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Function tools the model may call.
    #[serde(default)]
    pub tools: Vec<Tool>,
    /// `none`, `auto` (the default), `required`, or `{"type": "function", "function": {"name"}}`.
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
    /// Completion tokens per choice at most (older name).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Completion tokens per choice at most.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// Softmax temperature in [0, 2]; 0 is greedy. Default 1.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1]. Default 1.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Sampling seed: the same request with the same seed gives the same answer.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Choices to sample.
    #[serde(default)]
    pub n: Option<u64>,
    /// Stop sequences (a string or up to 4 strings), not included in the answer.
    #[serde(default)]
    pub stop: Option<Stop>,
    /// Answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop sequence.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Stop {
    /// The sequences.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// One message; the role picks the variant, and an unknown role does not parse.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "role", rename_all = "lowercase")]
pub enum Message {
    /// Instructions.
    System {
        /// Text.
        content: Content,
    },
    /// Instructions (OpenAI's newer name for `system`).
    Developer {
        /// Text.
        content: Content,
    },
    /// A user turn.
    User {
        /// Text.
        content: Content,
    },
    /// An earlier assistant turn.
    Assistant {
        /// Text (null when the turn only calls tools).
        #[serde(default)]
        content: Option<Content>,
        /// Calls it made.
        #[serde(default)]
        tool_calls: Vec<ToolCall>,
    },
    /// A tool's result.
    Tool {
        /// The result.
        content: Content,
        /// The call it answers.
        #[serde(default)]
        tool_call_id: Option<String>,
    },
}

/// Message content: a string, or an array of parts of which the text parts are used.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// `[{"type": "text", "text": ...}]`.
    Parts(Vec<ContentPart>),
}

/// One part of an array content.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Part type; only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

impl Content {
    /// The text, or what is wrong with it (a part that is not text).
    pub fn text(&self) -> Result<String, String> {
        match self {
            Self::Text(s) => Ok(s.clone()),
            Self::Parts(parts) => parts
                .iter()
                .map(|p| match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => Ok(t.as_str()),
                    (kind, _) => Err(format!("content part of type {kind:?} is not supported")),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|v| v.concat()),
        }
    }
}

/// A function tool: `{"type": "function", "function": {"name", "description"?, "parameters"?}}`.
/// Kept as JSON: it is rendered into the prompt as given, as rollouts render env-server's.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Tool(pub Value);

impl Tool {
    /// The function's name, when the tool is a well-formed function tool.
    pub fn name(&self) -> Option<&str> {
        (self.0.get("type")?.as_str()? == "function")
            .then(|| self.0.get("function")?.get("name")?.as_str())
            .flatten()
    }

    /// Whether the function takes no arguments (its parameters declare no properties), so
    /// that a call to it is fully determined by its name.
    pub fn takes_no_arguments(&self) -> bool {
        match self.0.get("function").and_then(|f| f.get("parameters")) {
            None | Some(Value::Null) => true,
            Some(p) => p
                .get("properties")
                .and_then(Value::as_object)
                .is_none_or(|m| m.is_empty()),
        }
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    /// `none`, `auto` or `required`.
    Mode(String),
    /// A named function.
    Named {
        /// `function`.
        #[serde(rename = "type")]
        kind: String,
        /// `{"name": ...}`.
        function: NamedFunction,
    },
}

/// The function of a named `tool_choice`.
#[derive(Debug, Clone, Deserialize)]
pub struct NamedFunction {
    /// Its name.
    pub name: String,
}

/// A tool call, in requests (an assistant turn's) and answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Call id (`call_...`).
    #[serde(default)]
    pub id: String,
    /// `function`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// Name and arguments.
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

/// Name and arguments of a call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// Function name.
    pub name: String,
    /// Arguments as a JSON object, serialised to a string.
    pub arguments: String,
}

/// `POST /v1/chat/completions` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatCompletion {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// One per `n`.
    pub choices: Vec<Choice>,
    /// Token counts.
    pub usage: Usage,
}

/// One choice of an answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Choice {
    /// Its index.
    pub index: usize,
    /// The assistant's message.
    pub message: AssistantMessage,
    /// Always null (log-probabilities are not returned).
    pub logprobs: Option<Value>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: String,
}

/// The assistant message of a choice.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: String,
    /// Text; null when the turn is only tool calls.
    pub content: Option<String>,
    /// Calls, when the model made any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// Token counts of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the rendered conversation.
    pub prompt_tokens: usize,
    /// Tokens of all choices.
    pub completion_tokens: usize,
    /// The sum.
    pub total_tokens: usize,
}

/// `GET /v1/models` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelList {
    /// `list`.
    pub object: String,
    /// The served model.
    pub data: Vec<ModelCard>,
}

/// One model of the list.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelCard {
    /// Its name, what requests put in `model`.
    pub id: String,
    /// `model`.
    pub object: String,
    /// Unix seconds when the server started.
    pub created: u64,
    /// `cuda-agent`.
    pub owned_by: String,
}

/// An error answer: status plus OpenAI's `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, ...).
    pub kind: &'static str,
    /// A short machine-readable code.
    pub code: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn invalid(code: &'static str, param: Option<&'static str>, message: String) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message,
            kind: "invalid_request_error",
            code,
            param,
        }
    }
}

/// The body of an error answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// `error` of an error body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// What went wrong.
    pub message: String,
    /// Error type.
    #[serde(rename = "type")]
    pub kind: String,
    /// The field at fault.
    pub param: Option<String>,
    /// Machine-readable code.
    pub code: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                message: self.message,
                kind: self.kind.into(),
                param: self.param.map(String::from),
                code: Some(self.code.into()),
            },
        };
        (self.status, axum::Json(body)).into_response()
    }
}
