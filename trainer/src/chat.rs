//! Chat templates (ChatML as Qwen2.5 uses it, and Llama 3) and tool-call parsing.
//!
//! Rendering is split so that a rollout can append tokens turn by turn without
//! re-tokenising what the policy sampled: `prompt` renders the opening turns up to the first
//! assistant header, `observation` renders a tool result and the next assistant header.

use serde_json::Value;

/// A chat template family.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum ChatTemplate {
    /// `<|im_start|>role\n...<|im_end|>` (Qwen2 / Qwen2.5).
    Chatml,
    /// `<|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>` (Llama 3).
    Llama3,
}

impl ChatTemplate {
    /// Picks the template from a checkpoint's `tokenizer_config.json` chat template text.
    pub fn detect(chat_template: &str) -> Option<Self> {
        if chat_template.contains("<|im_start|>") {
            Some(Self::Chatml)
        } else if chat_template.contains("<|start_header_id|>") {
            Some(Self::Llama3)
        } else {
            None
        }
    }

    /// Reads `tokenizer_config.json` in `dir`, defaulting to ChatML.
    pub fn for_checkpoint(dir: &std::path::Path) -> Self {
        std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| {
                v.get("chat_template")
                    .and_then(|c| c.as_str())
                    .and_then(Self::detect)
            })
            .unwrap_or(Self::Chatml)
    }

    /// The text that ends an assistant turn (also the stop string for sampling).
    pub fn end_of_turn(self) -> &'static str {
        match self {
            Self::Chatml => "<|im_end|>",
            Self::Llama3 => "<|eot_id|>",
        }
    }

    /// System prompt with tool schemas, the user's task, and the opening of the assistant turn.
    pub fn prompt(self, system: &str, tools: &[Value], user: &str) -> String {
        let tool_lines: Vec<String> = tools.iter().map(|t| t.to_string()).collect();
        match self {
            Self::Chatml => {
                let mut s = format!("<|im_start|>system\n{system}");
                if !tools.is_empty() {
                    s.push_str("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n");
                    s.push_str(&tool_lines.join("\n"));
                    s.push_str("\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
                }
                s.push_str(&format!(
                    "<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
                ));
                s
            }
            Self::Llama3 => {
                let mut s = format!(
                    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{system}"
                );
                if !tools.is_empty() {
                    s.push_str("\n\nYou have access to the following functions. To call a function, respond with a JSON object of the form {\"name\": function name, \"parameters\": dictionary of argument name and its value}.\n\n");
                    s.push_str(&tool_lines.join("\n\n"));
                }
                s.push_str(&format!("<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"));
                s
            }
        }
    }

    /// A tool result after an assistant turn, and the opening of the next assistant turn.
    /// `after_turn` is whether the assistant turn already ended with `end_of_turn`.
    pub fn observation(self, result: &str, after_turn: bool) -> String {
        let close = if after_turn { "" } else { self.end_of_turn() };
        match self {
            Self::Chatml => format!("{close}\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
            Self::Llama3 => format!("{close}<|start_header_id|>ipython<|end_header_id|>\n\n{result}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
        }
    }
}

/// A tool call parsed out of an assistant turn.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedToolCall {
    /// Tool name.
    pub name: String,
    /// Arguments object.
    pub arguments: Value,
}

/// Why an assistant turn holds no usable tool call; the message is shown to the agent.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ToolCallParseError {
    /// Neither a `<tool_call>` block nor a JSON object was found.
    #[error("no tool call found: answer with <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call>")]
    Missing,
    /// A `<tool_call>` block was opened but never closed.
    #[error("<tool_call> is not closed by </tool_call>")]
    Unclosed,
    /// The call is not valid JSON (shared, so that the error stays cloneable). The JSON error
    /// is part of the message, not a source: the message is what the agent reads.
    #[error("tool call is not valid JSON: {0}")]
    Json(std::sync::Arc<serde_json::Error>),
    /// The JSON lacks `name` or its arguments are not an object.
    #[error("tool call must be {{\"name\": string, \"arguments\": object}}: {0}")]
    Shape(String),
}

/// Errors are equal when they say the same: the JSON error's source has no equality of its own.
impl PartialEq for ToolCallParseError {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

impl Eq for ToolCallParseError {}

/// Extracts the first tool call from `text`: a `<tool_call>{json}</tool_call>` block, or else
/// a bare JSON object with `name` and `arguments` (or Llama's `parameters`).
pub fn parse_tool_call(text: &str) -> Result<ParsedToolCall, ToolCallParseError> {
    if let Some(start) = text.find("<tool_call>") {
        let body = &text[start + "<tool_call>".len()..];
        let end = body
            .find("</tool_call>")
            .ok_or(ToolCallParseError::Unclosed)?;
        let json: Value = serde_json::from_str(body[..end].trim())
            .map_err(|e| ToolCallParseError::Json(e.into()))?;
        return shape(json);
    }
    // Bare JSON: try each '{' as the start of an object until one parses.
    for (i, _) in text.match_indices('{') {
        let mut de = serde_json::Deserializer::from_str(&text[i..]).into_iter::<Value>();
        if let Some(Ok(v)) = de.next() {
            if v.get("name").is_some() {
                return shape(v);
            }
        }
    }
    if text.contains('{') {
        let i = text.find('{').unwrap_or(0);
        if let Err(e) = serde_json::from_str::<Value>(text[i..].trim()) {
            return Err(ToolCallParseError::Json(e.into()));
        }
    }
    Err(ToolCallParseError::Missing)
}

fn shape(v: Value) -> Result<ParsedToolCall, ToolCallParseError> {
    let name = v
        .get("name")
        .and_then(|n| n.as_str())
        .ok_or_else(|| ToolCallParseError::Shape("missing string \"name\"".into()))?
        .to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None => Value::Object(Default::default()),
        Some(Value::Object(m)) => Value::Object(m.clone()),
        // Some models emit the arguments as a JSON string.
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => Value::Object(m),
            _ => {
                return Err(ToolCallParseError::Shape(
                    "\"arguments\" is a string that is not a JSON object".into(),
                ))
            }
        },
        Some(_) => {
            return Err(ToolCallParseError::Shape(
                "\"arguments\" is not an object".into(),
            ))
        }
    };
    Ok(ParsedToolCall { name, arguments })
}

/// One turn of a whole conversation, for [`ChatTemplate::render`].
#[derive(Debug, Clone, PartialEq)]
pub enum ChatTurn {
    /// Instructions; the tool schemas are rendered after the first one.
    System(String),
    /// A user message.
    User(String),
    /// An earlier assistant turn: its text, then its tool calls.
    Assistant {
        /// Text before the calls (may be empty).
        content: String,
        /// Calls, rendered in the canonical `<tool_call>` form.
        calls: Vec<ParsedToolCall>,
    },
    /// A tool's result.
    Tool(String),
}

impl ChatTemplate {
    /// A whole conversation, ending with the opening of the next assistant turn when
    /// `generation_prompt` is set. Rendered exactly as a rollout builds its context: a
    /// system turn and a user turn give [`ChatTemplate::prompt`]'s text; an assistant turn is
    /// its content and canonical calls closed by the end-of-turn marker; a tool turn is
    /// [`ChatTemplate::observation`]'s result turn. A conversation with tools but no system
    /// message gets an empty system turn to hold the tool schemas.
    pub fn render(self, turns: &[ChatTurn], tools: &[Value], generation_prompt: bool) -> String {
        let mut s = String::new();
        if self == Self::Llama3 {
            s.push_str("<|begin_of_text|>");
        }
        let has_system = matches!(turns.first(), Some(ChatTurn::System(_)));
        if !has_system && !tools.is_empty() {
            s.push_str(&self.system_turn("", tools));
        }
        for (i, turn) in turns.iter().enumerate() {
            match turn {
                // Only a leading system turn carries the tools; a later one is plain text.
                ChatTurn::System(text) => {
                    s.push_str(&self.system_turn(text, if i == 0 { tools } else { &[] }))
                }
                ChatTurn::User(text) => s.push_str(&self.turn("user", text)),
                ChatTurn::Assistant { content, calls } => {
                    let mut body = content.clone();
                    for call in calls {
                        if !body.is_empty() {
                            body.push('\n');
                        }
                        body.push_str(&call_block(&call.name, &call.arguments));
                    }
                    s.push_str(&self.turn("assistant", &body));
                }
                ChatTurn::Tool(result) => match self {
                    Self::Chatml => s.push_str(&self.turn(
                        "user",
                        &format!("<tool_response>\n{result}\n</tool_response>"),
                    )),
                    Self::Llama3 => s.push_str(&self.turn("ipython", result)),
                },
            }
        }
        if generation_prompt {
            s.push_str(&self.header("assistant"));
        }
        s
    }

    fn header(self, role: &str) -> String {
        match self {
            Self::Chatml => format!("<|im_start|>{role}\n"),
            Self::Llama3 => format!("<|start_header_id|>{role}<|end_header_id|>\n\n"),
        }
    }

    fn turn(self, role: &str, body: &str) -> String {
        let close = match self {
            Self::Chatml => "<|im_end|>\n",
            Self::Llama3 => "<|eot_id|>",
        };
        format!("{}{body}{close}", self.header(role))
    }

    /// The system turn as [`ChatTemplate::prompt`] writes it.
    fn system_turn(self, system: &str, tools: &[Value]) -> String {
        let full = self.prompt(system, tools, "");
        let full = full.strip_prefix("<|begin_of_text|>").unwrap_or(&full);
        let user = self.header("user");
        let end = full.rfind(&user).unwrap_or(full.len());
        full[..end].to_string()
    }
}

/// The canonical text of one tool call, as rollouts render logged calls and as
/// [`parse_tool_call`] reads it back.
pub fn call_block(name: &str, arguments: &Value) -> String {
    let call = serde_json::json!({"name": name, "arguments": arguments});
    format!("<tool_call>\n{call}\n</tool_call>")
}

/// Splits an assistant turn into its text and its `<tool_call>` blocks. `None` when the
/// turn has no such block or any block does not parse: then the whole turn is plain text.
/// The bare-JSON form that [`parse_tool_call`] also accepts is not read as a call here, so
/// that a model writing JSON as an answer is not taken to call a tool.
pub fn split_tool_calls(text: &str) -> Option<(String, Vec<ParsedToolCall>)> {
    let first = text.find("<tool_call>")?;
    let content = text[..first].trim_end().to_string();
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(start) = rest.find("<tool_call>") {
        // Only whitespace may sit between calls.
        if !rest[..start].trim().is_empty() {
            return None;
        }
        let end = rest.find("</tool_call>")?;
        calls.push(parse_tool_call(&rest[start..end + "</tool_call>".len()]).ok()?);
        rest = &rest[end + "</tool_call>".len()..];
    }
    rest.trim().is_empty().then_some((content, calls))
}
