//! The MCP front (`/mcp`): the episode's tools over the Model Context Protocol's Streamable
//! HTTP transport, for agent frameworks whose tool transport is MCP.
//!
//! One MCP session is one episode. The session starts it either at `initialize`, from the
//! URL's query (`/mcp?task=L1/1_ReLU&max_turns=50`, or `split` and `seed`), or later through
//! the `reset` tool (the arguments of `POST /v1/episodes`). `tools/list` gives `reset` and
//! the episode's tools with the schemas `POST /v1/episodes` reports; `tools/call` runs one
//! step through [`EpisodeManager::step`](crate::episode::EpisodeManager::step), so the budget,
//! the limits and the trajectory log are those of the HTTP API. A tool's output is the
//! result's text; the whole step answer (reward, terminated, truncated, info) and the
//! `episode_id` are its `structuredContent`. A call with arguments the tool rejects, or of a
//! tool that does not exist, is an error result the model reads and takes no turn, as a 4xx
//! does over HTTP. A session opened with a task in its URL gets the task prompt in the
//! `initialize` answer's instructions (clients put those before the model); the prompt and
//! the workspace's `SKILL.md` and `SKILL_REFERENCE.md` are also resources ([`PROMPT_URI`],
//! [`SKILL_URI`], [`REFERENCE_URI`]). A `reset` in a session that already has an episode
//! closes that one first if it is still running; a session that ends (DELETE, or idle past the
//! server's idle timeout) closes its episode if it is still running.
//!
//! Sessions need the `initialize` handshake: the server speaks the protocol versions that
//! have it (up to 2025-11-25) and answers `server/discover` with "method not found", as a
//! server without it does, which clients of the session-less 2026-07-28 revision take as the
//! sign to fall back to `initialize`. An episode is state on the server, and the session is what names it.
//!
//! The route sits behind the same connection loop, bearer token, body limits and in-flight
//! permits as `/v1` ([`crate::api::router`]); sessions are capped at the server's episode
//! limit, and without an API key only loopback `Host` names are served (DNS rebinding).

use std::borrow::Cow;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use env_api::{
    error_chain, Capped as _, EpisodeStatus, ErrorChain, PlainAction, ResetOptions, ResetRequest,
    StepRequest,
};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, DiscoverResult,
    ErrorCode, ErrorData, Implementation, InitializeRequestParams, InitializeResult, JsonObject,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ProtocolVersion,
    ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult, Resource,
    ResourceContents, ServerCapabilities, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::{LocalSessionManager, SessionConfig};
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{RoleServer, ServerHandler};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::episode::EpisodeError;
use crate::state::AppState;

/// The name of the tool that starts (or restarts) the session's episode.
pub const RESET_TOOL: &str = "reset";

/// The resource holding the running episode's task prompt (the reset's observation).
pub const PROMPT_URI: &str = "cuda-agent://episode/prompt";

/// The resource holding the workspace's `SKILL.md` (as laid out for this server's device).
pub const SKILL_URI: &str = "cuda-agent://episode/SKILL.md";

/// The resource holding the workspace's `SKILL_REFERENCE.md` (as laid out for this server's
/// device): the detail `SKILL.md` points to.
pub const REFERENCE_URI: &str = "cuda-agent://episode/SKILL_REFERENCE.md";

/// What every session is told at `initialize`; a session opened with a task in its URL gets
/// the task prompt after it, since that prompt is otherwise never shown to the model.
const INSTRUCTIONS: &str = "One session is one episode of writing a faster ModelNew. Open the session at /mcp?task=ID or call `reset`, then use the tools; Submit ends the episode and its result carries the reward. The task prompt is also the resource cuda-agent://episode/prompt, SKILL.md the resource cuda-agent://episode/SKILL.md (its detail in cuda-agent://episode/SKILL_REFERENCE.md).";

/// The newest protocol revision served: the last with the `initialize` handshake, which
/// sessions (and so episodes) rest on.
const NEWEST_VERSION: ProtocolVersion = ProtocolVersion::V_2025_11_25;

/// The `/mcp` service: the rmcp Streamable HTTP service and its session manager.
#[derive(Clone)]
pub struct McpFront {
    service: StreamableHttpService<EpisodeSession, LocalSessionManager>,
    sessions: Arc<LocalSessionManager>,
    max_sessions: usize,
    max_body_bytes: usize,
}

impl McpFront {
    /// The service for `state`'s episodes.
    pub fn new(state: Arc<AppState>) -> Self {
        let limits = state.mcp.clone();
        let mut session_config = SessionConfig::default();
        session_config.keep_alive = Some(limits.session_idle);
        let mut manager = LocalSessionManager::default();
        manager.session_config = session_config;
        let sessions = Arc::new(manager);
        let mut config = StreamableHttpServerConfig::default()
            .with_legacy_session_mode(true)
            // The router has read the body within its own cap already.
            .with_max_request_body_bytes(state.max_body_bytes);
        if state.api_key.is_some() {
            // A bearer token already stops a page that rebinds a name to this host.
            config = config.disable_allowed_hosts();
        }
        let factory_state = state.clone();
        let service = StreamableHttpService::new(
            move || Ok(EpisodeSession::new(factory_state.clone())),
            sessions.clone(),
            config,
        );
        Self {
            service,
            sessions,
            max_sessions: limits.max_sessions,
            max_body_bytes: state.max_body_bytes,
        }
    }

    /// Sessions open now.
    pub async fn open_sessions(&self) -> usize {
        self.sessions.sessions.read().await.len()
    }
}

/// Axum handler of `/mcp` (every method): a request that would open a session is refused
/// with 503 while the cap is reached; everything else goes to rmcp's service.
pub async fn handle(State(front): State<McpFront>, req: Request) -> Response {
    let opens_session =
        req.method() == axum::http::Method::POST && !req.headers().contains_key("mcp-session-id");
    if opens_session && front.open_sessions().await >= front.max_sessions {
        let body = json!({"error": {"code": "at_capacity", "message": format!("{} MCP sessions are open; retry later", front.max_sessions)}});
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(axum::http::header::RETRY_AFTER, "5")],
            axum::Json(body),
        )
            .into_response();
    }
    if opens_session {
        // rmcp checks a `server/discover`'s protocol version before any handler sees it; a
        // client of the session-less revision falls back to `initialize` only on the answer a
        // server without `server/discover` gives, so that is the answer.
        let (parts, body) = req.into_parts();
        let bytes = match axum::body::to_bytes(body, front.max_body_bytes).await {
            Ok(b) => b,
            Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
        };
        if let Ok(msg) = serde_json::from_slice::<Value>(&bytes) {
            if msg["method"] == "server/discover" {
                let body = json!({"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32601, "message": "Method not found: this server needs the initialize handshake (one session per episode)"}});
                return axum::Json(body).into_response();
            }
        }
        let req = Request::from_parts(parts, axum::body::Body::from(bytes));
        return front.service.handle(req).await.into_response();
    }
    front.service.handle(req).await.into_response()
}

/// The URL query a session may start its episode from.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StartQuery {
    task: Option<String>,
    split: Option<String>,
    seed: Option<u64>,
    max_turns: Option<u32>,
    time_budget_s: Option<f64>,
}

impl StartQuery {
    fn is_empty(&self) -> bool {
        self.task.is_none()
            && self.split.is_none()
            && self.seed.is_none()
            && self.max_turns.is_none()
            && self.time_budget_s.is_none()
    }

    fn into_reset(self) -> ResetRequest {
        let options =
            (self.max_turns.is_some() || self.time_budget_s.is_some()).then_some(ResetOptions {
                max_turns: self.max_turns,
                time_budget_s: self.time_budget_s,
            });
        ResetRequest {
            task: self.task,
            split: self.split,
            seed: self.seed,
            options,
            task_source: None,
            request_id: None,
        }
    }
}

/// What one MCP session holds: its episode, if started. Closes a still-running episode when
/// the session ends (its last handle is dropped).
struct SessionEpisode {
    state: Arc<AppState>,
    id: tokio::sync::Mutex<Option<String>>,
    /// The task prompt of the session's latest episode (its reset's observation).
    prompt: std::sync::Mutex<Option<String>>,
    /// Prefix of the request ids of this session's steps (retries of one JSON-RPC request
    /// replay the first answer, as `request_id` does over HTTP).
    prefix: String,
}

impl Drop for SessionEpisode {
    fn drop(&mut self) {
        let Some(id) = self.id.get_mut().take() else {
            return;
        };
        let state = self.state.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { close_if_running(&state, &id).await });
        }
    }
}

async fn close_if_running(state: &AppState, id: &str) {
    let running = state
        .episodes
        .state(id)
        .await
        .is_ok_and(|s| s.status == EpisodeStatus::Running);
    if running {
        match state.episodes.close(id).await {
            Ok(_) => tracing::info!(episode = id, "MCP session ended: episode closed"),
            Err(e) => {
                tracing::warn!(episode = id, error = %ErrorChain(&e), "closing an MCP session's episode")
            }
        }
    }
}

/// The handler of one MCP session.
#[derive(Clone)]
pub struct EpisodeSession {
    inner: Arc<SessionEpisode>,
}

impl EpisodeSession {
    fn new(state: Arc<AppState>) -> Self {
        let prefix = format!("mcp-{}", uuid::Uuid::new_v4().simple());
        Self {
            inner: Arc::new(SessionEpisode {
                state,
                id: tokio::sync::Mutex::new(None),
                prompt: std::sync::Mutex::new(None),
                prefix,
            }),
        }
    }

    /// Starts the session's episode, closing a running one first.
    async fn reset(&self, req: ResetRequest) -> Result<env_api::ResetResponse, EpisodeError> {
        req.check_caps()
            .map_err(|e| EpisodeError::BadRequest(e.to_string()))?;
        let mut id = self.inner.id.lock().await;
        if let Some(old) = id.take() {
            close_if_running(&self.inner.state, &old).await;
        }
        let resp = self.inner.state.episodes.reset(req).await?;
        *id = Some(resp.episode_id.clone());
        *self.prompt_slot() = Some(resp.observation.text.clone());
        Ok(resp)
    }

    fn prompt_slot(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        // A panic while holding it cannot leave a half-written prompt: take the value.
        self.inner
            .prompt
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn call_reset(&self, args: Value) -> CallToolResult {
        let req: ResetRequest = match serde_json::from_value(args) {
            Ok(r) => r,
            Err(e) => return error_result(format!("reset arguments: {e}")),
        };
        match self.reset(req).await {
            Ok(resp) => {
                let text = resp.observation.text.clone();
                structured(
                    text,
                    false,
                    serde_json::to_value(&resp).unwrap_or(Value::Null),
                )
            }
            Err(e) => error_result(error_chain(&e)),
        }
    }

    async fn call_step(
        &self,
        tool: &str,
        args: Value,
        request_id: String,
    ) -> Result<CallToolResult, ErrorData> {
        let Some(id) = self.inner.id.lock().await.clone() else {
            return Ok(error_result(format!(
                "no episode in this session yet: call `{RESET_TOOL}` first (task, split, seed, options), or open the session at /mcp?task=ID"
            )));
        };
        let req = StepRequest {
            action: env_api::Action::Plain(PlainAction {
                tool: tool.to_string(),
                arguments: args,
            }),
            request_id: Some(request_id),
        };
        if let Err(e) = req.check_caps() {
            return Ok(error_result(e.to_string()));
        }
        let (tool, arguments) = req.action.parts();
        match self
            .inner
            .state
            .episodes
            .step(&id, tool, arguments, req.request_id.clone())
            .await
        {
            Ok(resp) => {
                let text = resp.observation.text.clone();
                let is_error = resp.observation.is_error;
                let mut data = serde_json::to_value(&resp).unwrap_or(Value::Null);
                data["episode_id"] = json!(id);
                Ok(structured(text, is_error, data))
            }
            // A result the model reads, not a protocol error: some clients raise those to the
            // user instead of showing them to the model, which then cannot correct the call.
            // No turn is taken, as over HTTP.
            Err(EpisodeError::Call(agent_tools::CallError::UnknownTool { name, available })) => {
                Ok(error_result(format!(
                    "unknown tool {name:?} (no turn taken); the tools are {RESET_TOOL}, {available}"
                )))
            }
            Err(EpisodeError::Ended(_)) => Ok(error_result(format!(
                "the episode has ended; call `{RESET_TOOL}` to start another"
            ))),
            // Bad arguments (no turn taken), capacity and internal errors: the agent reads them.
            Err(e) => Ok(error_result(error_chain(&e))),
        }
    }
}

fn error_result(text: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text)])
}

fn structured(text: String, is_error: bool, data: Value) -> CallToolResult {
    let mut r = if is_error {
        CallToolResult::error(vec![ContentBlock::text(text)])
    } else {
        CallToolResult::success(vec![ContentBlock::text(text)])
    };
    r.structured_content = Some(data);
    r
}

/// `reset` and the episode's tools, as MCP tools.
pub fn tools() -> Vec<Tool> {
    let mut out = vec![reset_tool()];
    for t in agent_tools::tool_schemas() {
        let f = &t["function"];
        let (Some(name), Some(schema)) = (f["name"].as_str(), f["parameters"].as_object()) else {
            continue;
        };
        let description = f["description"].as_str().unwrap_or_default().to_string();
        out.push(Tool::new(name.to_string(), description, schema.clone()));
    }
    out
}

fn reset_tool() -> Tool {
    let schema = json!({
        "type": "object",
        "properties": {
            "task": {"type": "string", "description": "A task id (GET /v1/tasks); when absent one is sampled from `split`."},
            "split": {"type": "string", "description": "Split to sample from (default `all`)."},
            "seed": {"type": "integer", "minimum": 0, "description": "Seed for sampling the task."},
            "task_source": {"type": "string", "description": "A task of your own instead of `task`: a Python file defining Model, get_inputs and get_init_inputs."},
            "options": {
                "type": "object",
                "properties": {
                    "max_turns": {"type": "integer", "minimum": 1},
                    "time_budget_s": {"type": "number", "exclusiveMinimum": 0}
                },
                "additionalProperties": false
            }
        },
        "additionalProperties": false
    });
    let schema: JsonObject = match schema {
        Value::Object(m) => m,
        _ => JsonObject::new(),
    };
    Tool::new(
        RESET_TOOL,
        "Start this session's episode (closing a running one): the answer is the task prompt; structuredContent holds episode_id, the tools and the limits.",
        schema,
    )
}

impl ServerHandler for EpisodeSession {
    fn get_info(&self) -> InitializeResult {
        let mut info = InitializeResult::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(Implementation::new(
            "cuda-agent env-server",
            env!("CARGO_PKG_VERSION"),
        ))
        .with_instructions(INSTRUCTIONS);
        info.protocol_version = NEWEST_VERSION;
        info
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(ProtocolVersion::known_up_to(&NEWEST_VERSION))
    }

    async fn discover(
        &self,
        _context: RequestContext<RoleServer>,
    ) -> Result<DiscoverResult, ErrorData> {
        // Inside a session: the session is the lifecycle, discovery has nothing to add.
        Err(ErrorData::new(
            ErrorCode::METHOD_NOT_FOUND,
            "server/discover: this server needs the initialize handshake (one session per episode)",
            None,
        ))
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        context.peer.set_peer_info(request.clone());
        let mut info = self.negotiate_initialize(&request)?;
        let query = context
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|p| p.uri.query().map(str::to_string));
        if let Some(q) = query.filter(|q| !q.is_empty()) {
            let start: StartQuery = serde_urlencoded_query(&q)
                .map_err(|e| ErrorData::invalid_params(format!("/mcp query: {e}"), None))?;
            if !start.is_empty() {
                let resp = self.reset(start.into_reset()).await.map_err(|e| {
                    ErrorData::invalid_params(
                        format!("starting the episode: {}", ErrorChain(&e)),
                        None,
                    )
                })?;
                tracing::info!(episode = %resp.episode_id, task = %resp.info.task.id, "MCP session started its episode");
                // Clients put the instructions before the model; the prompt is the task.
                info.instructions = Some(format!(
                    "{INSTRUCTIONS}\n\nThis session's episode has started (episode {}). Its task:\n\n{}",
                    resp.episode_id, resp.observation.text
                ));
            }
        }
        Ok(info)
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let mut out = Vec::new();
        if self.prompt_slot().is_some() {
            out.push(
                Resource::new(PROMPT_URI, "task prompt")
                    .with_description(
                        "The running episode's task: what to write, the budget, and model.py",
                    )
                    .with_mime_type("text/plain"),
            );
        }
        out.push(
            Resource::new(SKILL_URI, "SKILL.md")
                .with_description("The loop (profile, implement, verify, tune), how the evaluation judges, the rules and the reward")
                .with_mime_type("text/markdown"),
        );
        out.push(
            Resource::new(REFERENCE_URI, "SKILL_REFERENCE.md")
                .with_description("SKILL.md's detail: measured build times, examples, what verify.py and profile.py print, the other device's advice")
                .with_mime_type("text/markdown"),
        );
        Ok(ListResourcesResult::with_all_items(out))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let text = match request.uri.as_str() {
            PROMPT_URI => self.prompt_slot().clone().ok_or_else(|| {
                ErrorData::resource_not_found(
                    format!("{PROMPT_URI}: no episode in this session yet; call `{RESET_TOOL}` or open the session at /mcp?task=ID"),
                    None,
                )
            })?,
            SKILL_URI => self.inner.state.episodes.skill_md(),
            REFERENCE_URI => self.inner.state.episodes.skill_reference_md(),
            other => {
                return Err(ErrorData::resource_not_found(
                    format!("no resource {other:?}; the resources are {PROMPT_URI}, {SKILL_URI} and {REFERENCE_URI}"),
                    None,
                ))
            }
        };
        let mime = if request.uri == SKILL_URI || request.uri == REFERENCE_URI {
            "text/markdown"
        } else {
            "text/plain"
        };
        Ok(ReadResourceResult::new(vec![
            ResourceContents::text(text, request.uri).with_mime_type(mime)
        ])
        .into())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = Value::Object(request.arguments.unwrap_or_default());
        if request.name == RESET_TOOL {
            return Ok(self.call_reset(args).await.into());
        }
        let request_id = format!("{}-{}", self.inner.prefix, context.id);
        Ok(self
            .call_step(&request.name, args, request_id)
            .await?
            .into())
    }
}

/// The query string parsed the way axum's `Query` does.
fn serde_urlencoded_query(q: &str) -> Result<StartQuery, String> {
    let uri: axum::http::Uri = format!("/?{q}").parse().map_err(|e| format!("{e}"))?;
    axum::extract::Query::<StartQuery>::try_from_uri(&uri)
        .map(|axum::extract::Query(v)| v)
        .map_err(|e| e.body_text())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tools_are_reset_and_the_episode_tools_with_their_schemas() {
        let tools = tools();
        assert_eq!(tools[0].name, RESET_TOOL);
        let schemas = agent_tools::tool_schemas();
        assert_eq!(tools.len(), schemas.len() + 1);
        for (tool, schema) in tools[1..].iter().zip(&schemas) {
            assert_eq!(tool.name, schema["function"]["name"].as_str().unwrap());
            assert_eq!(
                Value::Object((*tool.input_schema).clone()),
                schema["function"]["parameters"]
            );
        }
    }

    /// `tools/list` is in every MCP episode's first prompt: 10,403 bytes before the schemas
    /// were compacted (agent_tools' `schema::compact`) and their repeated prose cut, 8,081
    /// after (JSON with a space after each separator; 7,692 without).
    #[test]
    fn the_tools_list_stays_compact() {
        let text = serde_json::to_string(&tools()).unwrap();
        assert!(text.len() < 8_500, "tools/list is {} bytes", text.len());
        assert!(
            !text.contains("$defs") && !text.contains("Arguments of"),
            "{text}"
        );
    }

    #[test]
    fn a_start_query_becomes_a_reset() {
        let q = serde_urlencoded_query("task=L1/1_ReLU&max_turns=7").unwrap();
        let r = q.into_reset();
        assert_eq!(r.task.as_deref(), Some("L1/1_ReLU"));
        assert_eq!(r.options.unwrap().max_turns, Some(7));
        assert!(serde_urlencoded_query("tsk=x").is_err());
        assert!(serde_urlencoded_query("").unwrap().is_empty());
    }
}
