//! `trainer serve`: the policy behind an OpenAI-compatible HTTP API, so that any agent
//! runner speaking that API can drive episodes with a checkpoint of this trainer.
//!
//! - `POST /v1/chat/completions`: messages (system, developer, user, assistant with
//!   `tool_calls`, tool), function `tools`, `tool_choice`, `max_tokens` /
//!   `max_completion_tokens`, `temperature`, `top_p`, `seed`, `n`, `stop`, `stream`.
//!   The conversation is rendered with the trainer's chat template ([`crate::chat`]), so a
//!   policy sees what it saw in rollouts; a `<tool_call>` block it writes comes back as
//!   OpenAI `tool_calls`, and text that does not parse as one comes back as content.
//! - `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`.
//!
//! Generation runs on one thread fed by a bounded queue ([`engine`]); a full queue is a 429.
//! Bodies are size-limited; every refusal is a 4xx with OpenAI's error body.

pub mod api;
pub mod engine;
pub mod model;
pub mod request;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::mpsc;

use api::{
    ApiError, AssistantMessage, ChatCompletion, ChatRequest, Choice, FunctionCall, ModelCard,
    ModelList, ToolCall, Usage,
};
use engine::{Delta, Engine, Outcome};
use request::{prepare, Limits, Prepared};

use crate::render::Renderer;
use crate::seeds::derive;

/// Settings of the HTTP side.
#[derive(Debug, Clone)]
pub struct ServeSettings {
    /// The name `GET /v1/models` lists and requests may name.
    pub model_name: String,
    /// Request limits.
    pub limits: Limits,
    /// Request body size limit in bytes.
    pub max_body_bytes: usize,
}

/// What the handlers share.
struct AppState {
    settings: ServeSettings,
    renderer: Renderer,
    engine: Engine,
    created: u64,
    /// Mixed into ids and unseeded requests' seeds.
    boot: u64,
    counter: AtomicU64,
}

impl AppState {
    fn next(&self) -> u64 {
        derive(self.boot, self.counter.fetch_add(1, Ordering::Relaxed), 0)
    }
}

/// The API's routes over a started engine; `renderer` must be the served model's.
pub fn router(settings: ServeSettings, renderer: Renderer, engine: Engine) -> Router {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let limit = settings.max_body_bytes;
    let state = Arc::new(AppState {
        settings,
        renderer,
        engine,
        created: now.as_secs(),
        boot: now.as_nanos() as u64 ^ u64::from(std::process::id()),
        counter: AtomicU64::new(0),
    });
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(list_models))
        // Names may be paths (`runs/x/ppo/step-000010`): the id takes the rest of the path.
        .route("/v1/models/{*id}", get(get_model))
        .route("/health", get(|| async { "ok" }))
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                message: "no such route; this server answers /v1/chat/completions and /v1/models"
                    .into(),
                kind: "invalid_request_error",
                code: "not_found",
                param: None,
            }
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

fn card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.settings.model_name.clone(),
        object: "model".into(),
        created: state.created,
        owned_by: "cuda-agent".into(),
    }
}

async fn list_models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![card(&state)],
    })
}

async fn get_model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    if id == state.settings.model_name {
        Ok(Json(card(&state)))
    } else {
        Err(model_not_found(&id))
    }
}

fn model_not_found(id: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("the model {id:?} does not exist; GET /v1/models lists the served one"),
        kind: "invalid_request_error",
        code: "model_not_found",
        param: Some("model"),
    }
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| ApiError {
        status: e.status(),
        message: e.body_text(),
        kind: "invalid_request_error",
        code: if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            "payload_too_large"
        } else {
            "invalid_body"
        },
        param: None,
    })?;
    let req: ChatRequest = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(
            "invalid_json",
            None,
            format!("the body is not a valid chat completion request: {e}"),
        )
    })?;
    if let Some(m) = req.model.as_deref() {
        if m != state.settings.model_name {
            return Err(model_not_found(m));
        }
    }
    let stream = req.stream;
    let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
    // Rendering and tokenising a long conversation is CPU work: off the async threads.
    let seed = state.next();
    let job = {
        let state = state.clone();
        tokio::task::spawn_blocking(move || {
            prepare(req, &state.renderer, &state.settings.limits, seed)
        })
        .await
        .map_err(|e| internal(format!("request preparation failed: {e}")))??
    };
    let id = format!("chatcmpl-{:016x}", state.next());
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let prompt_tokens = job.prompt.len();
    if !stream {
        let rx = state.engine.submit(job, None)?;
        let outcome = rx
            .await
            .map_err(|_| internal("the generation thread dropped the request".into()))??;
        let completion = completion_of(&state, id, created, prompt_tokens, outcome);
        return Ok(Json(completion).into_response());
    }
    Ok(stream_response(state, job, id, created, include_usage)?.into_response())
}

fn internal(message: String) -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message,
        kind: "server_error",
        code: "internal_error",
        param: None,
    }
}

fn completion_of(
    state: &AppState,
    id: String,
    created: u64,
    prompt_tokens: usize,
    outcome: Outcome,
) -> ChatCompletion {
    let completion_tokens = outcome.choices.iter().map(|c| c.tokens).sum();
    let choices = outcome
        .choices
        .into_iter()
        .enumerate()
        .map(|(index, c)| Choice {
            index,
            message: message_of(state, c.content, &c.calls),
            logprobs: None,
            finish_reason: c.finish.into(),
        })
        .collect();
    ChatCompletion {
        id,
        object: "chat.completion".into(),
        created,
        model: state.settings.model_name.clone(),
        choices,
        usage: Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        },
    }
}

fn message_of(
    state: &AppState,
    content: String,
    calls: &[crate::chat::ParsedToolCall],
) -> AssistantMessage {
    if calls.is_empty() {
        return AssistantMessage {
            role: "assistant".into(),
            content: Some(content),
            tool_calls: None,
        };
    }
    let tool_calls = calls
        .iter()
        .map(|c| ToolCall {
            id: format!("call_{:016x}", state.next()),
            kind: "function".into(),
            function: FunctionCall {
                name: c.name.clone(),
                arguments: c.arguments.to_string(),
            },
        })
        .collect();
    AssistantMessage {
        role: "assistant".into(),
        content: (!content.is_empty()).then_some(content),
        tool_calls: Some(tool_calls),
    }
}

/// Server-sent events: a role chunk per choice, text deltas as they are sampled (or the whole
/// text at the end when tools or stop sequences have to see it first), a finishing chunk per
/// choice, the usage chunk when asked, then `data: [DONE]`.
fn stream_response(
    state: Arc<AppState>,
    job: Prepared,
    id: String,
    created: u64,
    include_usage: bool,
) -> Result<impl IntoResponse, ApiError> {
    let n = job.n;
    let prompt_tokens = job.prompt.len();
    let streamed_text = job.stream_text;
    let (dtx, mut drx) = mpsc::unbounded_channel::<Delta>();
    let rx = state.engine.submit(job, Some(dtx))?;
    let (etx, erx) = mpsc::channel::<Event>(64);
    let model = state.settings.model_name.clone();
    tokio::spawn(async move {
        let chunk = |choices: serde_json::Value| {
            Event::default().data(
                json!({"id": id, "object": "chat.completion.chunk", "created": created,
                       "model": model, "choices": choices})
                .to_string(),
            )
        };
        for index in 0..n {
            let first = json!([{"index": index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": null, "finish_reason": null}]);
            if etx.send(chunk(first)).await.is_err() {
                return;
            }
        }
        while let Some(d) = drx.recv().await {
            let c = json!([{"index": d.index, "delta": {"content": d.text},
                            "logprobs": null, "finish_reason": null}]);
            if etx.send(chunk(c)).await.is_err() {
                return;
            }
        }
        let outcome = match rx.await {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => {
                let body = json!({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}});
                let _ = etx.send(Event::default().data(body.to_string())).await;
                return;
            }
            Err(_) => return,
        };
        let completion = completion_of(&state, id.clone(), created, prompt_tokens, outcome);
        for choice in &completion.choices {
            let mut delta = serde_json::Map::new();
            if !streamed_text {
                if let Some(text) = &choice.message.content {
                    delta.insert("content".into(), json!(text));
                }
            }
            if let Some(calls) = &choice.message.tool_calls {
                let calls: Vec<_> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| json!({"index": i, "id": c.id, "type": "function", "function": c.function}))
                    .collect();
                delta.insert("tool_calls".into(), json!(calls));
            }
            let c = json!([{"index": choice.index, "delta": delta, "logprobs": null,
                            "finish_reason": choice.finish_reason}]);
            if etx.send(chunk(c)).await.is_err() {
                return;
            }
        }
        if include_usage {
            let mut last = json!({"id": id, "object": "chat.completion.chunk", "created": created,
                                  "model": completion.model, "choices": []});
            last["usage"] = json!(completion.usage);
            let _ = etx.send(Event::default().data(last.to_string())).await;
        }
        let _ = etx.send(Event::default().data("[DONE]")).await;
    });
    let events = futures_util::stream::unfold(erx, |mut erx| async move {
        erx.recv().await.map(|e| (Ok::<_, Infallible>(e), erx))
    });
    Ok(Sse::new(events))
}
