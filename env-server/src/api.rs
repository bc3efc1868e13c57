//! The HTTP layer: routes, JSON errors, auth, metrics and the OpenAPI document.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use env_api::*;
use futures_util::future::FutureExt as _;
use utoipa::OpenApi;

use crate::episode::EpisodeError;
use crate::error::ApiError;
use crate::idempotency::{body_digest, BodyDigest, KeyReused};
use crate::state::{AppState, EvaluationAnswer, EvaluationKey};

/// `Json` whose rejections are JSON errors too (malformed JSON, wrong types, too large).
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    Json<T>: FromRequest<S, Rejection = JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(Self(v)),
            Err(rej) => {
                let status = rej.status();
                let code = match &rej {
                    JsonRejection::JsonSyntaxError(_) => "malformed_json",
                    JsonRejection::JsonDataError(_) => "bad_request",
                    JsonRejection::MissingJsonContentType(_) => "unsupported_media_type",
                    _ if status == StatusCode::PAYLOAD_TOO_LARGE => "body_too_large",
                    _ => "bad_request",
                };
                Err(ApiError::new(status, code, rej.body_text()))
            }
        }
    }
}

/// `Path` whose rejections (a segment that is not UTF-8, say) are JSON errors too.
pub struct ApiPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    Path<T>: FromRequestParts<S, Rejection = axum::extract::rejection::PathRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(Self(v)),
            Err(rej) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_path",
                rej.body_text(),
            )),
        }
    }
}

type ApiResult<T> = Result<Json<T>, ApiError>;

/// Builds the router; tests drive it without a socket.
///
/// Around every route, outermost first: the request runs in a task of its own (a client
/// that hangs up cannot cancel a step halfway, and a panic is a 500 answer, not a lost
/// connection); the bearer token is checked before any body is read; the body is read whole,
/// bounded in size and in time, before a handler sees it.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.max_body_bytes;
    let mcp = crate::mcp::McpFront::new(state.clone());
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/ready", get(ready))
        .route(
            "/mcp",
            axum::routing::any(crate::mcp::handle).with_state(mcp),
        )
        .route("/v1/episodes", post(reset))
        .route("/v1/episodes/{id}", get(episode_state).delete(close))
        .route("/v1/episodes/{id}/step", post(step))
        .route("/v1/episodes/{id}/trajectory", get(trajectory))
        .route("/v1/evaluate", post(evaluate))
        .route("/v1/tasks", get(tasks))
        .route("/v1/info", get(info))
        .route("/metrics", get(metrics))
        .route("/v1/openapi.json", get(openapi))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                "no such route; see /v1/openapi.json",
            )
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "method not allowed on this route",
            )
        })
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), read_body))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn(programs_only))
        .layer(middleware::from_fn_with_state(state.clone(), detach))
        .with_state(state)
}

/// Refuses what a web browser sends: any request with an `Origin` header (browsers add it to
/// every POST, cross-site or not, and programs never do), and a body that is not JSON (a
/// page may send text/plain or a form to any address without asking first). A page the
/// operator visits then cannot start episodes or evaluations on a server it can reach.
async fn programs_only(req: Request, next: Next) -> Response {
    if req.headers().contains_key(header::ORIGIN) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "browser_request",
            "requests from web pages (with an Origin header) are refused: this API is for programs",
        )
        .into_response();
    }
    if let Some(kind) = req.headers().get(header::CONTENT_TYPE) {
        let essence = kind
            .to_str()
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if essence != "application/json" && !essence.ends_with("+json") {
            return ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!(
                    "request bodies are JSON (content-type: application/json), not {essence:?}"
                ),
            )
            .into_response();
        }
    }
    next.run(req).await
}

/// Aborts a spawned request when the connection's future is dropped (its client hung up).
struct AbortOnDrop(Option<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// Runs the rest of the request in its own task, holding one of the in-flight permits, and
/// waits for it. With no permit left (clients that send and hang up, again and again) the
/// answer is 503 `busy`; `/v1/health` and `/v1/ready` need none (probes must answer however
/// busy the server is). A step runs to its end whoever waits for it
/// (it is logged, and a retry gets its answer); an evaluation whose client hung up is
/// cancelled, its processes ended (nobody gets its result, and its device time is others').
async fn detach(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let permit = if is_probe(&path) {
        None
    } else {
        match state.in_flight.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => {
                return ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "busy",
                    "too many requests in flight",
                )
                .into_response()
            }
        }
    };
    let run = async move {
        let resp = next.run(req).await;
        drop(permit);
        resp
    };
    let cancel_on_hang_up = path == "/v1/evaluate";
    let task = tokio::spawn(run);
    let _abort = AbortOnDrop(cancel_on_hang_up.then(|| task.abort_handle()));
    match task.await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::error!(%method, %path, error = %e, "request handler failed");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the request failed inside the server",
            )
            .into_response()
        }
    }
}

/// Reads the whole body within the size cap and the body timeout (a client that sends its
/// body slowly, or never, is answered 408 and its connection closed).
async fn read_body(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    use http_body_util::BodyExt as _;
    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the request body is over {} bytes", state.max_body_bytes),
        )
        .into_response()
    };
    if declared.is_some_and(|n| n > state.max_body_bytes as u64) {
        return too_large();
    }
    let limited = http_body_util::Limited::new(body, state.max_body_bytes);
    let bytes = match tokio::time::timeout(state.body_timeout, limited.collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return too_large(),
        Ok(Err(e)) => {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_body",
                format!("reading the request body: {e}"),
            )
            .into_response()
        }
        Err(_) => {
            let msg = format!(
                "the request body did not arrive within {} s",
                state.body_timeout.as_secs_f64()
            );
            let mut resp =
                ApiError::new(StatusCode::REQUEST_TIMEOUT, "body_timeout", msg).into_response();
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return resp;
        }
    };
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await
}

/// Liveness and readiness: answered without a token (a cluster's probes carry none) and
/// without an in-flight permit. They tell only whether the server is up and takes work.
fn is_probe(path: &str) -> bool {
    matches!(path, "/v1/health" | "/v1/ready")
}

async fn auth(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if is_probe(req.uri().path()) {
        return next.run(req).await;
    }
    if let Some(key) = &state.api_key {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| constant_time_eq(given.as_bytes(), key.as_bytes()));
        if !ok {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or wrong bearer token",
            )
            .into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[utoipa::path(post, path = "/v1/episodes", request_body = ResetRequest,
    responses((status = 200, body = ResetResponse), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn reset(
    State(s): State<Arc<AppState>>,
    body: axum::body::Bytes,
) -> ApiResult<ResetResponse> {
    // An empty body is a reset with every default.
    let req: ResetRequest = if body.iter().all(u8::is_ascii_whitespace) {
        ResetRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            let code = if e.is_syntax() || e.is_eof() {
                "malformed_json"
            } else {
                "bad_request"
            };
            ApiError::new(StatusCode::BAD_REQUEST, code, format!("reset body: {e}"))
        })?
    };
    req.check_caps()?;
    Ok(Json(s.episodes.reset(req).await?))
}

#[utoipa::path(post, path = "/v1/episodes/{id}/step", request_body = StepRequest,
    params(("id" = String, Path, description = "episode id")),
    responses((status = 200, body = StepResponse), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn step(
    State(s): State<Arc<AppState>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<StepRequest>,
) -> ApiResult<StepResponse> {
    req.check_caps()?;
    let (tool, args) = req.action.parts();
    Ok(Json(
        s.episodes
            .step(&id, tool, args, req.request_id.clone())
            .await?,
    ))
}

#[utoipa::path(get, path = "/v1/episodes/{id}", params(("id" = String, Path, description = "episode id")),
    responses((status = 200, body = EpisodeState), (status = 404, body = ErrorBody)))]
async fn episode_state(
    State(s): State<Arc<AppState>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<EpisodeState> {
    Ok(Json(s.episodes.state(&id).await?))
}

#[utoipa::path(get, path = "/v1/episodes/{id}/trajectory", params(("id" = String, Path, description = "episode id")),
    responses((status = 200, body = Trajectory), (status = 404, body = ErrorBody)))]
async fn trajectory(
    State(s): State<Arc<AppState>>,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    // Streamed from the log as it is read: a large log never sits whole in memory, however
    // many read it at once.
    let chunks = s.episodes.trajectory(&id).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        axum::body::Body::new(ChunkBody(chunks)),
    )
        .into_response())
}

/// A response body fed chunk by chunk from a channel; an error ends the response short.
struct ChunkBody(tokio::sync::mpsc::Receiver<crate::episode::TrajectoryChunk>);

impl hyper::body::Body for ChunkBody {
    type Data = hyper::body::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| c.map(|bytes| hyper::body::Frame::data(bytes.into()))))
    }
}

#[utoipa::path(delete, path = "/v1/episodes/{id}", params(("id" = String, Path, description = "episode id")),
    responses((status = 200, body = EpisodeState), (status = 404, body = ErrorBody)))]
async fn close(
    State(s): State<Arc<AppState>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<EpisodeState> {
    Ok(Json(s.episodes.close(&id).await?))
}

#[utoipa::path(post, path = "/v1/evaluate", request_body = EvaluateRequest,
    responses((status = 200, body = EvaluationResult), (status = 400, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn evaluate(
    State(s): State<Arc<AppState>>,
    ApiJson(req): ApiJson<EvaluateRequest>,
) -> ApiResult<EvaluationResult> {
    req.check_caps()?;
    let Some(key) = req.options.as_ref().and_then(|o| o.request_id.clone()) else {
        let work = s.drain.admit()?;
        return Ok(Json(judge(s, req, work, None).await?));
    };
    let digest = body_digest(&EvaluateRequest {
        options: req.options.clone().map(|o| EvaluateOptions {
            request_id: None,
            ..o
        }),
        ..req.clone()
    });
    // A key seen before is answered from its verdict or joins its evaluation, also while
    // draining (no new work); only a new key is admitted. A key seen with another request is
    // refused: the verdict it holds is another solution's.
    let running = {
        let mut keys = s.evaluation_keys.lock().unwrap_or_else(|e| e.into_inner());
        let joined = match keys.get(&key) {
            Some((d, _)) if d != digest => return Err(KeyReused(key).into()),
            Some((_, EvaluationKey::Done(verdict))) => return Ok(Json((*verdict).clone())),
            Some((_, EvaluationKey::Running(weak))) => weak.upgrade(),
            None => None,
        };
        match joined {
            Some(running) => running,
            None => {
                let work = s.drain.admit()?;
                let running = judge(s.clone(), req, work, Some((key.clone(), digest)))
                    .boxed()
                    .shared();
                if let Some(weak) = running.downgrade() {
                    keys.insert(&key, (digest, EvaluationKey::Running(weak)));
                }
                running
            }
        }
    };
    Ok(Json(running.await?))
}

/// Judges one evaluation request holding `work` (the drain waits for it), and records the
/// verdict under `key`. Dropping it cancels the evaluation, its processes ended.
async fn judge(
    s: Arc<AppState>,
    req: EvaluateRequest,
    work: crate::drain::Work,
    key: Option<(String, BodyDigest)>,
) -> EvaluationAnswer {
    let answer = judge_admitted(&s, req).await;
    drop(work);
    if let Some((key, digest)) = key {
        let mut keys = s.evaluation_keys.lock().unwrap_or_else(|e| e.into_inner());
        match &answer {
            Ok(verdict) => keys.insert(
                &key,
                (digest, EvaluationKey::Done(Arc::new(verdict.clone()))),
            ),
            // An error (a drain's end, a harness failure, a bad request) is not a verdict:
            // a retry with the key is judged afresh.
            Err(_) => keys.remove_if(&key, |(_, k)| matches!(k, EvaluationKey::Running(_))),
        }
    }
    answer
}

async fn judge_admitted(s: &AppState, req: EvaluateRequest) -> EvaluationAnswer {
    let task = match &req.task {
        TaskRef::Id(id) => s
            .episodes
            .tasks()
            .get(id)
            .map_err(EpisodeError::from)?
            .clone(),
        TaskRef::Source { source } => {
            kernelbench::Task::inline(source).map_err(EpisodeError::from)?
        }
    };
    let files: BTreeMap<String, String> = match req.solution {
        SolutionRef::Text(t) => match &task.kind {
            kernelbench::TaskKind::Recall { file, .. } => [(file.clone(), t)].into(),
            kernelbench::TaskKind::Kernel => [("model_new.py".to_string(), t)].into(),
        },
        SolutionRef::Files { files } => files,
    };
    let opts = req.options.unwrap_or_default();
    if let Some(d) = &opts.device {
        if d != s.evaluator.device().as_str() {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_device",
                format!(
                    "this server evaluates on {}, not {d}",
                    s.evaluator.device().as_str()
                ),
            ));
        }
    }
    if opts.tolerance.is_some_and(|t| !(t.is_finite() && t > 0.0)) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "tolerance must be a positive number",
        ));
    }
    // Past a drain's grace the evaluation is given up (dropping it ends its processes) and
    // its client told so, to take it to another server.
    tokio::select! {
        r = s.evaluator.evaluate(&task, &files, opts.tolerance) => Ok(r?),
        () = s.drain.expired() => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "drained",
            "the server stopped before this evaluation finished; retry on another server",
        )),
    }
}

#[utoipa::path(get, path = "/v1/tasks", responses((status = 200, body = TaskList)))]
async fn tasks(State(s): State<Arc<AppState>>) -> Json<TaskList> {
    let t = s.episodes.tasks();
    Json(TaskList {
        tasks: t
            .iter()
            .map(|t| TaskInfo {
                id: t.id.clone(),
                level: t.level,
                hash: t.hash.clone(),
            })
            .collect(),
        splits: t.splits(),
    })
}

#[utoipa::path(get, path = "/v1/health", responses((status = 200, body = ProbeAnswer, description = "alive")))]
async fn health() -> Json<ProbeAnswer> {
    Json(ProbeAnswer {
        status: ProbeStatus::Ok,
    })
}

/// Readiness, apart from liveness: 200 while a new episode would be admitted; 503 with the
/// reason (`draining`, `at_capacity`, `host_busy`) otherwise, so a load balancer sends new
/// work elsewhere while the server finishes what it has.
#[utoipa::path(get, path = "/v1/ready", responses((status = 200, body = ProbeAnswer, description = "takes new episodes and evaluations"), (status = 503, body = ErrorBody)))]
async fn ready(State(s): State<Arc<AppState>>) -> Result<Json<ProbeAnswer>, ApiError> {
    s.episodes.admits()?;
    Ok(Json(ProbeAnswer {
        status: ProbeStatus::Ready,
    }))
}

#[utoipa::path(get, path = "/v1/info", responses((status = 200, description = "version, devices, capacity, sandbox")))]
async fn info(State(s): State<Arc<AppState>>) -> Json<crate::info::ServerInfo> {
    Json(s.info.at(
        s.episodes.open_count(),
        s.episodes.volume_memory().map(|(_, reserved)| reserved),
        s.evaluator.in_flight(),
        s.evaluator.slots(),
    ))
}

async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    let c = &s.episodes.counters;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_resets_total counter\ncuda_agent_resets_total {}",
        c.resets.load(Ordering::Relaxed)
    );
    let _ = writeln!(out, "# TYPE cuda_agent_steps_total counter");
    for (tool, n) in c.steps.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let _ = writeln!(out, "cuda_agent_steps_total{{tool=\"{tool}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_tool_errors_total counter\ncuda_agent_tool_errors_total {}",
        c.tool_errors.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_step_replays_total counter\ncuda_agent_step_replays_total {}",
        c.replays.load(Ordering::Relaxed)
    );
    let _ = writeln!(out, "# TYPE cuda_agent_episodes_ended_total counter");
    for (how, n) in c.ended.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let _ = writeln!(out, "cuda_agent_episodes_ended_total{{how=\"{how}\"}} {n}");
    }
    let _ = writeln!(out, "# TYPE cuda_agent_final_rewards_total counter");
    for (r, n) in c.rewards.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let _ = writeln!(out, "cuda_agent_final_rewards_total{{reward=\"{r}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_open_episodes gauge\ncuda_agent_open_episodes {}",
        s.episodes.open_count()
    );
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_episodes_in_memory gauge\ncuda_agent_episodes_in_memory {}",
        s.episodes.in_memory()
    );
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_episodes_evicted_total counter\ncuda_agent_episodes_evicted_total {}",
        c.evicted.load(Ordering::Relaxed)
    );
    if let Some((budget, reserved)) = s.episodes.volume_memory() {
        let _ = writeln!(
            out,
            "# TYPE cuda_agent_volume_memory_budget_bytes gauge\ncuda_agent_volume_memory_budget_bytes {budget}"
        );
        let _ = writeln!(
            out,
            "# TYPE cuda_agent_volume_memory_reserved_bytes gauge\ncuda_agent_volume_memory_reserved_bytes {reserved}"
        );
    }
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_commands_refused_host_busy_total counter\ncuda_agent_commands_refused_host_busy_total {}",
        c.commands_refused_host_busy.load(Ordering::Relaxed)
    );
    let h = &s.http;
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_requests_in_flight gauge\ncuda_agent_requests_in_flight {}",
        s.max_in_flight
            .saturating_sub(s.in_flight.available_permits())
    );
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_http_connections gauge\ncuda_agent_http_connections {}",
        h.open.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_http_connections_accepted_total counter\ncuda_agent_http_connections_accepted_total {}",
        h.accepted.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_http_connections_refused_total counter\ncuda_agent_http_connections_refused_total {}",
        h.refused.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_http_connections_refused_per_client_total counter\ncuda_agent_http_connections_refused_per_client_total {}",
        h.refused_per_client.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_evaluations_in_flight gauge\ncuda_agent_evaluations_in_flight {}",
        s.evaluator.in_flight()
    );
    let _ = writeln!(
        out,
        "# TYPE cuda_agent_evaluations_total counter\ncuda_agent_evaluations_total {}",
        s.evaluator.finished.load(Ordering::Relaxed)
    );
    let slots = s.evaluator.slots();
    let secs = |ms: &std::sync::atomic::AtomicU64| ms.load(Ordering::Relaxed) as f64 / 1e3;
    device_counter(&mut out, "cuda_agent_device_leases_total", slots, |d| {
        d.leases.load(Ordering::Relaxed) as f64
    });
    device_counter(
        &mut out,
        "cuda_agent_device_busy_seconds_total",
        slots,
        |d| secs(&d.busy_ms),
    );
    // Free while an evaluation of it waited for its place or started its judge (prestart):
    // the time a deeper --prestart-depth would give back.
    device_counter(
        &mut out,
        "cuda_agent_device_starved_seconds_total",
        slots,
        |d| secs(&d.starved_ms),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}

/// One Prometheus counter with a value per device slot.
fn device_counter(
    out: &mut String,
    name: &str,
    slots: &[crate::evaluation::DeviceSlot],
    value: impl Fn(&crate::evaluation::DeviceSlot) -> f64,
) {
    let _ = writeln!(out, "# TYPE {name} counter");
    for d in slots {
        let _ = writeln!(out, "{name}{{device=\"{}\"}} {}", d.index, value(d));
    }
}

/// The OpenAPI document, generated from the wire types and handlers.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "cuda-agent environment",
        description = "Gym-style episodes for writing fast CUDA kernels."
    ),
    paths(
        reset,
        step,
        episode_state,
        trajectory,
        close,
        evaluate,
        tasks,
        health,
        ready,
        info
    ),
    components(schemas(
        ResetRequest,
        ResetOptions,
        ResetResponse,
        ResetInfo,
        Observation,
        TaskInfo,
        EpisodeLimits,
        StepRequest,
        Action,
        PlainAction,
        OpenAiToolCall,
        FunctionCall,
        StepResponse,
        StepInfo,
        EpisodeState,
        EpisodeStatus,
        Trajectory,
        TrajectoryRecord,
        env_api::ResetRecord,
        env_api::StepRecord,
        env_api::FinalRecord,
        env_api::TruncatedRecord,
        env_api::ClosedRecord,
        EvaluateRequest,
        EvaluateOptions,
        TaskRef,
        SolutionRef,
        EvaluationResult,
        Times,
        Speedups,
        env_api::ObservedCompute,
        env_api::LibraryShare,
        ErrorBody,
        ErrorDetail,
        ProbeAnswer,
        ProbeStatus,
        TaskList,
        // The tools' arguments (`info.tools` carries the same as OpenAI function schemas).
        env_api::tools::BashArgs,
        env_api::tools::GlobArgs,
        env_api::tools::GrepArgs,
        env_api::tools::GrepOutputMode,
        env_api::tools::ReadArgs,
        env_api::tools::WriteArgs,
        env_api::tools::EditArgs,
        env_api::tools::Edit,
        env_api::tools::MultiEditArgs,
        env_api::tools::TodoItem,
        env_api::tools::TodoStatus,
        env_api::tools::TodoWriteArgs,
        env_api::tools::SubmitArgs,
        // What each tool reports in `observation.data`.
        env_api::observation::ObservationData,
        env_api::observation::ToolData,
        env_api::observation::BashData,
        env_api::observation::StreamLayout,
        env_api::observation::EditData,
        env_api::observation::WriteData,
        env_api::observation::ReadData,
        env_api::observation::GrepData,
        env_api::observation::GlobData,
        env_api::observation::TodoWriteData,
        env_api::observation::ResetData,
        env_api::observation::NoData
    ))
)]
pub struct ApiDoc;

async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
