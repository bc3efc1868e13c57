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
    let names = tool_names(&req)?;
    let choice = tool_choice(&req, &names)?;
    let knobs = Knobs::of(&req, limits)?;
    let tools: Vec<Value> = req.tools.iter().map(|t| t.0.clone()).collect();
    let text = renderer.template().render(&turns, &tools, true);
    let tokenizer = renderer.tokenizer();
    let encode = |t: &str| {
        tokenizer.encode(t).map_err(|e| {
            ApiError::invalid("invalid_value", Some("messages"), env_api::error_chain(&e))
        })
    };
    let prompt = encode(&text)?;
    let mut forced = if choice.forced_text.is_empty() {
        Vec::new()
    } else {
        encode(&choice.forced_text)?
    };
    if choice.forced_whole {
        forced.extend(renderer.stop_ids().first());
    }
    let max_tokens = max_tokens(&req, limits, prompt.len())?;
    let stream_text = req.stream && !choice.parse && knobs.stop.is_empty();
    Ok(Prepared {
        prompt,
        forced,
        forced_whole: choice.forced_whole,
        max_tokens,
        temperature: knobs.temperature,
        top_p: knobs.top_p,
        seed: req.seed.unwrap_or(fresh_seed),
        n: knobs.n,
        stop: knobs.stop,
        tool_names: choice.parse.then_some(names),
        stream_text,
    })
}

/// The declared tools' names, in order.
fn tool_names(req: &ChatRequest) -> Result<Vec<String>, ApiError> {
    req.tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            tool.name().map(str::to_string).ok_or_else(|| {
                ApiError::invalid(
                    "invalid_value",
                    Some("tools"),
                    format!("tools[{i}] is not {{\"type\": \"function\", \"function\": {{\"name\": string, ...}}}}"),
                )
            })
        })
        .collect()
}

/// What `tool_choice` makes of the answer.
struct Choice {
    /// Tool calls are parsed out of the answer.
    parse: bool,
    /// Text the answer is forced to start with (a tool call's opening).
    forced_text: String,
    /// The forced text is the whole answer (a call with nothing left to sample).
    forced_whole: bool,
}

/// No parsing, parsing, or a forced opening, from `tool_choice` and the tools declared.
fn tool_choice(req: &ChatRequest, names: &[String]) -> Result<Choice, ApiError> {
    let invalid = |msg: String| ApiError::invalid("invalid_value", Some("tool_choice"), msg);
    let parse_only = |parse| Choice {
        parse,
        forced_text: String::new(),
        forced_whole: false,
    };
    match &req.tool_choice {
        None => Ok(parse_only(!names.is_empty())),
        Some(ToolChoice::Mode(m)) => match m.as_str() {
            "none" => Ok(parse_only(false)),
            "auto" => Ok(parse_only(!names.is_empty())),
            "required" if names.is_empty() => {
                Err(invalid("tool_choice \"required\" needs tools".into()))
            }
            "required" => Ok(Choice {
                parse: true,
                forced_text: "<tool_call>\n".into(),
                forced_whole: false,
            }),
            other => Err(invalid(format!(
                "tool_choice {other:?} is not none, auto, required or a function"
            ))),
        },
        Some(ToolChoice::Named { kind, function }) => {
            let tool = req
                .tools
                .iter()
                .find(|t| t.name() == Some(function.name.as_str()))
                .filter(|_| kind == "function")
                .ok_or_else(|| {
                    invalid(format!(
                        "tool_choice names function {:?}, which is not among the tools",
                        function.name
                    ))
                })?;
            Ok(if tool.takes_no_arguments() {
                // Nothing is left to sample: the call is determined by its name.
                Choice {
                    parse: true,
                    forced_text: call_block(&function.name, &Value::Object(Default::default())),
                    forced_whole: true,
                }
            } else {
                // The call's opening as the template's instructions write it; the model
                // samples the arguments.
                let name = Value::String(function.name.clone());
                Choice {
                    parse: true,
                    forced_text: format!("<tool_call>\n{{\"name\": {name}, \"arguments\": "),
                    forced_whole: false,
                }
            })
        }
    }
}

/// The sampling knobs of a request, each checked against its range.
struct Knobs {
    n: usize,
    temperature: f64,
    top_p: f64,
    stop: Vec<String>,
}

impl Knobs {
    fn of(req: &ChatRequest, limits: &Limits) -> Result<Self, ApiError> {
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
        let stop = req.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
        if stop.len() > 4 || stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "invalid_value",
                Some("stop"),
                "stop must be up to 4 non-empty strings".into(),
            ));
        }
        Ok(Self {
            n: n as usize,
            temperature,
            top_p,
            stop,
        })
    }
}

/// The completion's token limit: the one asked for if the context has room for it, else the
/// default within the room left; an error where the prompt alone fills the context.
fn max_tokens(req: &ChatRequest, limits: &Limits, prompt: usize) -> Result<usize, ApiError> {
    let room = limits.context.saturating_sub(prompt);
    if room == 0 {
        return Err(ApiError::invalid(
            "context_length_exceeded",
            Some("messages"),
            format!(
                "This model's maximum context length is {} tokens; the messages take {prompt}",
                limits.context,
            ),
        ));
    }
    match req.max_completion_tokens.or(req.max_tokens) {
        Some(0) => Err(ApiError::invalid(
            "invalid_value",
            Some("max_tokens"),
            "max_tokens must be at least 1".into(),
        )),
        Some(m) if m > room as u64 => Err(ApiError::invalid(
            "context_length_exceeded",
            Some("max_tokens"),
            format!(
                "This model's maximum context length is {} tokens; you requested {} ({prompt} in the messages, {m} in the completion)",
                limits.context,
                prompt as u64 + m,
            ),
        )),
        Some(m) => Ok(m as usize),
        None => Ok(limits.default_max_tokens.min(room)),
    }
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{max_tokens, tool_choice, tool_names, ChatRequest, Knobs, Limits};

    fn request(extra: serde_json::Value) -> ChatRequest {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        serde_json::from_value(body).unwrap()
    }

    const LIMITS: Limits = Limits {
        context: 100,
        default_max_tokens: 64,
        max_n: 4,
    };

    #[test]
    fn tool_choice_modes() {
        let tools = json!([{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]);
        let choose = |extra| {
            let req = request(extra);
            let names = tool_names(&req).unwrap();
            tool_choice(&req, &names).map(|c| (c.parse, c.forced_text, c.forced_whole))
        };
        assert_eq!(choose(json!({})).unwrap(), (false, String::new(), false));
        assert_eq!(
            choose(json!({"tools": tools})).unwrap(),
            (true, String::new(), false)
        );
        assert_eq!(
            choose(json!({"tools": tools, "tool_choice": "none"})).unwrap(),
            (false, String::new(), false)
        );
        assert_eq!(
            choose(json!({"tools": tools, "tool_choice": "auto"})).unwrap(),
            (true, String::new(), false)
        );
        assert_eq!(
            choose(json!({"tools": tools, "tool_choice": "required"})).unwrap(),
            (true, "<tool_call>\n".to_string(), false)
        );
        let e = choose(json!({"tool_choice": "required"})).err().unwrap();
        assert_eq!((e.code, e.param), ("invalid_value", Some("tool_choice")));
        assert!(choose(json!({"tools": tools, "tool_choice": "always"})).is_err());
        let named = choose(json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "Bash"}}})).unwrap();
        assert_eq!(
            named,
            (
                true,
                "<tool_call>\n{\"name\": \"Bash\", \"arguments\": ".to_string(),
                false
            )
        );
        assert!(choose(
            json!({"tools": tools, "tool_choice": {"type": "other", "function": {"name": "Bash"}}})
        )
        .is_err());
        let e = tool_names(&request(json!({"tools": [{"type": "function"}]})))
            .err()
            .unwrap();
        assert!(e.message.starts_with("tools[0] is not"), "{}", e.message);
    }

    #[test]
    fn sampling_knobs_are_checked_against_their_ranges() {
        let knobs = Knobs::of(&request(json!({})), &LIMITS).unwrap();
        assert_eq!((knobs.n, knobs.temperature, knobs.top_p), (1, 1.0, 1.0));
        assert!(knobs.stop.is_empty());
        for (bad, param) in [
            (json!({"n": 0}), "n"),
            (json!({"n": 5}), "n"),
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"top_p": 0.0}), "top_p"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"stop": [""]}), "stop"),
        ] {
            let e = Knobs::of(&request(bad.clone()), &LIMITS).err().unwrap();
            assert_eq!(e.param, Some(param), "{bad}");
        }
    }

    #[test]
    fn the_token_limit_fits_the_context() {
        assert_eq!(max_tokens(&request(json!({})), &LIMITS, 90).unwrap(), 10);
        assert_eq!(max_tokens(&request(json!({})), &LIMITS, 10).unwrap(), 64);
        assert_eq!(
            max_tokens(&request(json!({"max_tokens": 7})), &LIMITS, 10).unwrap(),
            7
        );
        let e = max_tokens(&request(json!({"max_completion_tokens": 11})), &LIMITS, 90)
            .err()
            .unwrap();
        assert_eq!(
            (e.code, e.param),
            ("context_length_exceeded", Some("max_tokens"))
        );
        assert!(
            e.message
                .contains("you requested 101 (90 in the messages, 11 in the completion)"),
            "{}",
            e.message
        );
        let e = max_tokens(&request(json!({"max_tokens": 0})), &LIMITS, 10)
            .err()
            .unwrap();
        assert_eq!(e.code, "invalid_value");
        let e = max_tokens(&request(json!({})), &LIMITS, 100).err().unwrap();
        assert_eq!(
            (e.code, e.param),
            ("context_length_exceeded", Some("messages"))
        );
    }
}
