//! Turning a chat request into token ids and sampling settings: validation (every refusal a
//! 4xx [`ApiError`]), rendering with the trainer's chat template, and the limits.

use serde_json::Value;

use super::api::{ApiError, ChatRequest, Message, ToolChoice};
use crate::chat::{call_block, ChatTurn, ParsedToolCall};
use crate::render::Renderer;

/// Limits a request must fit.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Positions the model serves (prompt plus completion).
    pub context: usize,
    /// Completion tokens when the request names no limit (capped by what the context leaves).
    pub default_max_tokens: usize,
    /// Choices per request at most.
    pub max_n: usize,
}

/// A request ready for the engine.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The rendered conversation's tokens, ending with the assistant header.
    pub prompt: Vec<u32>,
    /// Tokens the answer starts with, decided by `tool_choice` rather than sampled.
    pub forced: Vec<u32>,
    /// Whether `forced` is the whole answer (a named function that takes no arguments).
    pub forced_whole: bool,
    /// Completion tokens per choice at most, `forced` included.
    pub max_tokens: usize,
    /// Softmax temperature; 0 is greedy.
    pub temperature: f64,
    /// Nucleus mass.
    pub top_p: f64,
    /// Sampling seed.
    pub seed: u64,
    /// Choices.
    pub n: usize,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Function names the answer may call; `None` when calls are not parsed (`tool_choice`
    /// `none`, or no tools).
    pub tool_names: Option<Vec<String>>,
    /// Stream text as it is sampled (no tools to parse and no stop sequence to hold back).
    pub stream_text: bool,
}

/// Checks `req`, renders its conversation with `renderer`'s template and tokenises it.
/// `fresh_seed` is used when the request names no seed.
pub fn prepare(
    req: ChatRequest,
    renderer: &Renderer,
    limits: &Limits,
    fresh_seed: u64,
) -> Result<Prepared, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("messages"),
            "messages must hold at least one message".into(),
        ));
    }
    let turns = req
        .messages
        .iter()
        .map(turn_of)
        .collect::<Result<Vec<_>, _>>()?;
    let mut names = Vec::with_capacity(req.tools.len());
    for (i, tool) in req.tools.iter().enumerate() {
        let name = tool.name().ok_or_else(|| {
            ApiError::invalid(
                "invalid_value",
                Some("tools"),
                format!("tools[{i}] is not {{\"type\": \"function\", \"function\": {{\"name\": string, ...}}}}"),
            )
        })?;
        names.push(name.to_string());
    }
    // What tool_choice makes of the answer: no parsing, parsing, or a forced opening.
    let mut forced_text = String::new();
    let mut forced_whole = false;
    let parse = match &req.tool_choice {
        None => !names.is_empty(),
        Some(ToolChoice::Mode(m)) => match m.as_str() {
            "none" => false,
            "auto" => !names.is_empty(),
            "required" => {
                if names.is_empty() {
                    return Err(ApiError::invalid(
                        "invalid_value",
                        Some("tool_choice"),
                        "tool_choice \"required\" needs tools".into(),
                    ));
                }
                forced_text.push_str("<tool_call>\n");
                true
            }
            other => {
                return Err(ApiError::invalid(
                    "invalid_value",
                    Some("tool_choice"),
                    format!("tool_choice {other:?} is not none, auto, required or a function"),
                ))
            }
        },
        Some(ToolChoice::Named { kind, function }) => {
            let tool = req
                .tools
                .iter()
                .find(|t| t.name() == Some(function.name.as_str()));
            let tool = match (kind.as_str(), tool) {
                ("function", Some(t)) => t,
                _ => {
                    return Err(ApiError::invalid(
                        "invalid_value",
                        Some("tool_choice"),
                        format!(
                            "tool_choice names function {:?}, which is not among the tools",
                            function.name
                        ),
                    ))
                }
            };
            if tool.takes_no_arguments() {
                // Nothing is left to sample: the call is determined by its name.
                forced_text = call_block(&function.name, &Value::Object(Default::default()));
                forced_whole = true;
            } else {
                // The call's opening as the template's instructions write it; the model
                // samples the arguments.
                let name = Value::String(function.name.clone());
                forced_text = format!("<tool_call>\n{{\"name\": {name}, \"arguments\": ");
            }
            true
        }
    };
    let n = req.n.unwrap_or(1);
    if n == 0 || n > limits.max_n as u64 {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("n"),
            format!("n must be between 1 and {}", limits.max_n),
        ));
    }
    let temperature = req.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("temperature"),
            format!("temperature {temperature} is not in [0, 2]"),
        ));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if top_p <= 0.0 || top_p > 1.0 {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("top_p"),
            format!("top_p {top_p} is not in (0, 1]"),
        ));
    }
    let stop = req.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("stop"),
            "stop must be up to 4 non-empty strings".into(),
        ));
    }
    let tools: Vec<Value> = req.tools.iter().map(|t| t.0.clone()).collect();
    let text = renderer.template().render(&turns, &tools, true);
    let tokenizer = renderer.tokenizer();
    let encode = |t: &str| {
        tokenizer.encode(t).map_err(|e| {
            ApiError::invalid("invalid_value", Some("messages"), env_api::error_chain(&e))
        })
    };
    let prompt = encode(&text)?;
    let mut forced = if forced_text.is_empty() {
        Vec::new()
    } else {
        encode(&forced_text)?
    };
    if forced_whole {
        forced.extend(renderer.stop_ids().first());
    }
    let room = limits.context.saturating_sub(prompt.len());
    if room == 0 {
        return Err(ApiError::invalid(
            "context_length_exceeded",
            Some("messages"),
            format!(
                "This model's maximum context length is {} tokens; the messages take {}",
                limits.context,
                prompt.len()
            ),
        ));
    }
    let requested = req.max_completion_tokens.or(req.max_tokens);
    let max_tokens = match requested {
        Some(0) => {
            return Err(ApiError::invalid(
                "invalid_value",
                Some("max_tokens"),
                "max_tokens must be at least 1".into(),
            ))
        }
        Some(m) if m > room as u64 => {
            return Err(ApiError::invalid(
                "context_length_exceeded",
                Some("max_tokens"),
                format!(
                    "This model's maximum context length is {} tokens; you requested {} ({} in the messages, {m} in the completion)",
                    limits.context,
                    prompt.len() as u64 + m,
                    prompt.len()
                ),
            ))
        }
        Some(m) => m as usize,
        None => limits.default_max_tokens.min(room),
    };
    let stream_text = req.stream && !parse && stop.is_empty();
    Ok(Prepared {
        prompt,
        forced,
        forced_whole,
        max_tokens,
        temperature,
        top_p,
        seed: req.seed.unwrap_or(fresh_seed),
        n: n as usize,
        stop,
        tool_names: parse.then_some(names),
        stream_text,
    })
}

fn turn_of(m: &Message) -> Result<ChatTurn, ApiError> {
    let text = |c: &super::api::Content| {
        c.text()
            .map_err(|e| ApiError::invalid("invalid_value", Some("messages"), e))
    };
    Ok(match m {
        Message::System { content } | Message::Developer { content } => {
            ChatTurn::System(text(content)?)
        }
        Message::User { content } => ChatTurn::User(text(content)?),
        Message::Tool { content, .. } => ChatTurn::Tool(text(content)?),
        Message::Assistant {
            content,
            tool_calls,
        } => {
            let calls = tool_calls
                .iter()
                .map(|c| {
                    let arguments: Value = if c.function.arguments.trim().is_empty() {
                        Value::Object(Default::default())
                    } else {
                        serde_json::from_str(&c.function.arguments).map_err(|e| {
                            ApiError::invalid(
                                "invalid_value",
                                Some("messages"),
                                format!(
                                    "tool call {:?}: arguments are not JSON: {e}",
                                    c.function.name
                                ),
                            )
                        })?
                    };
                    if !arguments.is_object() {
                        return Err(ApiError::invalid(
                            "invalid_value",
                            Some("messages"),
                            format!(
                                "tool call {:?}: arguments are not a JSON object",
                                c.function.name
                            ),
                        ));
                    }
                    Ok(ParsedToolCall {
                        name: c.function.name.clone(),
                        arguments,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            ChatTurn::Assistant {
                content: content.as_ref().map(text).transpose()?.unwrap_or_default(),
                calls,
            }
        }
    })
}
