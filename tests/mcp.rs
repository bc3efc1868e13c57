//! The MCP front (`/mcp`) of the real server binary, driven by rmcp's own client over
//! Streamable HTTP: one session per episode, the same tools, limits and trajectory log as
//! the HTTP API.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod server;

use std::time::{Duration, Instant};

use rmcp::model::{
    CallToolRequestParams, CallToolResult, ProtocolVersion, ReadResourceRequestParams,
    ResourceContents,
};
use rmcp::service::{ClientLifecycleMode, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{ClientServiceExt as _, RoleClient, ServiceExt as _};
use serde_json::{json, Value};
use server::Server;

type Client = RunningService<RoleClient, ()>;

fn params(name: &str, args: Value) -> CallToolRequestParams {
    let Value::Object(map) = args else {
        panic!("arguments must be an object")
    };
    CallToolRequestParams::new(name.to_string()).with_arguments(map)
}

async fn call(client: &Client, name: &str, args: Value) -> CallToolResult {
    client
        .call_tool(params(name, args))
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn text(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Polls the HTTP state until the episode is no longer running.
async fn wait_not_running(c: &env_client::EnvClient, id: &str) -> Option<env_api::EpisodeStatus> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        match c.state(id).await {
            Ok(s) if s.status == env_api::EpisodeStatus::Running => {}
            Ok(s) => return Some(s.status),
            Err(_) => return None,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("episode {id} still running after its MCP session ended");
}

/// The status line of an `initialize` POSTed with the given `Host` header.
fn raw_initialize(url: &str, host: &str) -> String {
    use std::io::{Read as _, Write as _};
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}"#;
    let mut s = std::net::TcpStream::connect(url.trim_start_matches("http://")).unwrap();
    write!(
        s,
        "POST /mcp HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\naccept: application/json, text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut head = [0u8; 64];
    let n = s.read(&mut head).unwrap();
    String::from_utf8_lossy(&head[..n])
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn mcp_sessions_are_episodes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &["--skip-compile", "--max-episodes", "1"],
    );
    let http = server.client();

    // Without an API key, only loopback Host names are served (a rebound name is refused;
    // the sessions below, at 127.0.0.1, are served).
    let status = raw_initialize(&server.url, "evil.example");
    assert!(status.starts_with("HTTP/1.1 4"), "{status}");

    // A client of the session-less revision probes server/discover, is told to use
    // initialize, and opens a session whose episode starts from the URL's query.
    let uri = format!("{}/mcp?task=L1/2_Add&max_turns=5", server.url);
    let a = ()
        .serve_with_lifecycle(
            StreamableHttpClientTransport::from_uri(uri),
            ClientLifecycleMode::Auto {
                preferred_versions: vec![ProtocolVersion::LATEST],
                legacy_version: None,
            },
        )
        .await
        .expect("MCP session");
    let info = a.peer_info().expect("server info");
    assert!(info.protocol_version.has_initialize(), "{info:?}");
    // The task prompt reaches the model: as the session's instructions and as a resource.
    let instructions = info.instructions.clone().unwrap_or_default();
    assert!(
        instructions.contains("Task L1/2_Add") && instructions.contains("--- model.py ---"),
        "{instructions}"
    );
    let resources = a.list_all_resources().await.unwrap();
    let uris: Vec<&str> = resources.iter().map(|r| r.uri.as_str()).collect();
    assert_eq!(
        uris,
        [
            "cuda-agent://episode/prompt",
            "cuda-agent://episode/SKILL.md",
            "cuda-agent://episode/SKILL_REFERENCE.md"
        ]
    );
    let read = |uri: &str| {
        let uri = uri.to_string();
        let a = &a;
        async move {
            let r = a
                .read_resource(ReadResourceRequestParams::new(uri.clone()))
                .await
                .unwrap_or_else(|e| panic!("{uri}: {e}"));
            match &r.contents[0] {
                ResourceContents::TextResourceContents { text, .. } => text.clone(),
                other => panic!("{uri}: not text: {other:?}"),
            }
        }
    };
    let prompt = read("cuda-agent://episode/prompt").await;
    assert!(prompt.starts_with("Task L1/2_Add:"), "{prompt}");
    let skill = read("cuda-agent://episode/SKILL.md").await;
    assert!(skill.contains("(this server's device)"), "{skill}");
    // The first page leaves the other device's section to the reference, which has both.
    assert!(!skill.contains("(not this server's device"), "{skill}");
    let reference = read("cuda-agent://episode/SKILL_REFERENCE.md").await;
    assert!(
        reference.contains("(this server's device)")
            && reference.contains("(not this server's device"),
        "{reference}"
    );
    assert!(a
        .read_resource(ReadResourceRequestParams::new("cuda-agent://nothing"))
        .await
        .is_err());
    let tools = a.list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    for want in ["reset", "Bash", "Glob", "MultiEdit", "TodoWrite", "Submit"] {
        assert!(names.contains(&want), "{names:?}");
    }
    // MCP and HTTP share the episode limit: with the session's episode open, HTTP is refused.
    let over_http = http
        .reset(&env_api::ResetRequest {
            task: Some("L1/1_ReLU".into()),
            ..Default::default()
        })
        .await;
    assert!(
        matches!(
            &over_http,
            Err(env_client::ClientError::Api { status: 503, .. })
        ),
        "{over_http:?}"
    );

    let r = call(&a, "Bash", json!({"command": "echo from-mcp"})).await;
    assert_eq!(r.is_error, Some(false), "{r:?}");
    assert!(text(&r).contains("from-mcp"), "{r:?}");
    let step = r
        .structured_content
        .clone()
        .expect("structured step answer");
    let id = step["episode_id"].as_str().unwrap().to_string();
    assert_eq!(step["info"]["turn"], 1);
    assert_eq!(step["done"], false);

    // Arguments the tool rejects: an error result the agent reads, no turn taken.
    let bad = call(&a, "Bash", json!({"no_command": 1})).await;
    assert_eq!(bad.is_error, Some(true), "{bad:?}");
    // A tool that does not exist: an error result the model reads (some clients raise a
    // protocol error to the user instead), naming the tools; no turn taken.
    let unknown = call(&a, "NoSuchTool", json!({})).await;
    assert_eq!(unknown.is_error, Some(true), "{unknown:?}");
    assert!(
        text(&unknown).contains("unknown tool \"NoSuchTool\"") && text(&unknown).contains("Bash"),
        "{}",
        text(&unknown)
    );

    let r = call(&a, "Submit", json!({})).await;
    let done = r.structured_content.clone().unwrap();
    assert_eq!(done["terminated"], true, "{done}");
    assert_eq!(
        done["info"]["turn"], 2,
        "the bad and the unknown calls took no turn: {done}"
    );
    assert_eq!(done["reward"], -1.0, "an empty model_new.py fails: {done}");
    let after = call(&a, "Bash", json!({"command": "true"})).await;
    assert_eq!(after.is_error, Some(true));
    assert!(text(&after).contains("reset"), "{after:?}");

    // The HTTP API sees the same episode and the same log.
    let state = http.state(&id).await.unwrap();
    assert_eq!(state.status, env_api::EpisodeStatus::Terminated);
    assert_eq!(state.task.id, "L1/2_Add");
    assert_eq!(state.limits.max_turns, 5);
    let t = http.trajectory(&id).await.unwrap();
    let kinds: Vec<&str> = t.records.iter().map(|r| r.kind()).collect();
    assert_eq!(kinds, ["reset", "step", "step", "final"]);
    let env_api::TrajectoryRecord::Step { body, .. } = &t.records[1] else {
        panic!("not a step: {:?}", t.records[1]);
    };
    assert!(body.request_id.as_deref().unwrap().starts_with("mcp-"));
    a.cancel().await.unwrap();

    // A legacy client: no episode until `reset`; the episode closes with the session.
    let b = ()
        .serve(StreamableHttpClientTransport::from_uri(format!(
            "{}/mcp",
            server.url
        )))
        .await
        .expect("second session");
    let early = call(&b, "Glob", json!({"pattern": "*"})).await;
    assert_eq!(early.is_error, Some(true));
    assert!(text(&early).contains("reset"), "{early:?}");
    // No prompt before the episode starts; SKILL.md and its reference are there all along.
    let listed = b.list_all_resources().await.unwrap();
    let uris: Vec<&str> = listed.iter().map(|r| r.uri.as_str()).collect();
    assert_eq!(
        uris,
        [
            "cuda-agent://episode/SKILL.md",
            "cuda-agent://episode/SKILL_REFERENCE.md"
        ]
    );
    assert!(b
        .read_resource(ReadResourceRequestParams::new(
            "cuda-agent://episode/prompt"
        ))
        .await
        .is_err());
    // A task of the user's own is capped in size, and must be a task file.
    let big = call(&b, "reset", json!({"task_source": "#".repeat(2 << 20)})).await;
    assert_eq!(big.is_error, Some(true));
    assert!(text(&big).contains("task_source"), "{}", text(&big));
    let bad = call(
        &b,
        "reset",
        json!({"task_source": "print('no Model here')"}),
    )
    .await;
    assert_eq!(bad.is_error, Some(true));
    assert!(text(&bad).contains("class Model"), "{}", text(&bad));
    let r = call(&b, "reset", json!({"task": "L1/1_ReLU"})).await;
    assert_eq!(r.is_error, Some(false), "{r:?}");
    assert!(text(&r).contains("L1/1_ReLU"), "{}", text(&r));
    let reset = r.structured_content.clone().unwrap();
    let tools_http: Vec<&str> = reset["info"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(tools_http, names[1..], "the same tools as HTTP");
    let b_id = reset["episode_id"].as_str().unwrap().to_string();
    let r = call(&b, "Glob", json!({"pattern": "*.py"})).await;
    assert!(text(&r).contains("model.py"), "{r:?}");

    // The session cap (the server's episode limit): a third session is refused.
    let c = ()
        .serve(StreamableHttpClientTransport::from_uri(format!(
            "{}/mcp",
            server.url
        )))
        .await;
    assert!(c.is_err(), "a session over the cap was opened");

    b.cancel().await.unwrap();
    let status = wait_not_running(&http, &b_id).await;
    assert_ne!(status, Some(env_api::EpisodeStatus::Running));
    let log = std::fs::read_to_string(
        server
            .data_dir
            .join("trajectories")
            .join(format!("{b_id}.jsonl")),
    )
    .unwrap();
    assert!(log.contains("\"closed\""), "{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn mcp_needs_the_servers_bearer_token() {
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &["--skip-compile", "--api-key", "mcp-key"],
    );
    let url = format!("{}/mcp?task=L1/1_ReLU", server.url);
    let refused = ().serve(StreamableHttpClientTransport::from_uri(url.clone())).await;
    assert!(refused.is_err(), "a session without the token was opened");
    let config = StreamableHttpClientTransportConfig::with_uri(url).auth_header("mcp-key");
    let client =
        ().serve(StreamableHttpClientTransport::from_config(config))
            .await
            .expect("a session with the token");
    let r = call(&client, "Glob", json!({"pattern": "model.py"})).await;
    assert!(text(&r).contains("model.py"), "{r:?}");
    client.cancel().await.unwrap();
}
