//! The router driven in-process (no socket): every route, bad input, idempotency, limits.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use env_server::{router, AppState, ServerConfig};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

mod common;

use common::{state_from, test_config};

fn state(dir: &std::path::Path, api_key: Option<&str>) -> Arc<AppState> {
    state_with(dir, api_key, std::time::Duration::from_secs(300))
}

fn state_with(
    dir: &std::path::Path,
    api_key: Option<&str>,
    eval_timeout: std::time::Duration,
) -> Arc<AppState> {
    state_from(ServerConfig {
        data_dir: dir.to_path_buf(),
        api_key: api_key.map(str::to_string),
        eval_timeout,
        ..test_config(dir)
    })
}

async fn call(
    state: &Arc<AppState>,
    method: &str,
    uri: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    raw(state, method, uri, body.map(|b| b.to_string()), None).await
}

async fn raw(
    state: &Arc<AppState>,
    method: &str,
    uri: &str,
    body: Option<String>,
    auth: Option<&str>,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    if let Some(a) = auth {
        req = req.header(header::AUTHORIZATION, a);
    }
    let req = req
        .body(body.map(Body::from).unwrap_or_else(Body::empty))
        .unwrap();
    let resp = router(state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v)
}

/// A GET's status and its body as text, unparsed.
async fn text_of(state: &Arc<AppState>, uri: &str) -> (StatusCode, String) {
    let req = Request::builder().uri(uri).body(Body::empty()).unwrap();
    let resp = router(state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

#[tokio::test]
async fn discovery_routes() {
    let dir = tempfile::tempdir().unwrap();
    let s = state(dir.path(), None);
    let (st, v) = call(&s, "GET", "/v1/health", None).await;
    assert_eq!((st, v["status"].as_str()), (StatusCode::OK, Some("ok")));
    let (st, v) = call(&s, "GET", "/v1/info", None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["device"], "cpu");
    // The answer's bytes are what clients always got: every object's keys sorted, as a
    // `serde_json::Value` writes them.
    let (_, text) = text_of(&s, "/v1/info").await;
    assert_eq!(text, v.to_string(), "/v1/info's keys are out of order");
    assert_eq!(v["sandbox"]["confined"], true, "{v}");
    assert!(v["torch"].as_str().unwrap().starts_with("2."), "{v}");
    let (_, v) = call(&s, "GET", "/v1/tasks", None).await;
    assert!(v["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["id"] == "L1/1_ReLU"));
    let (st, v) = call(&s, "GET", "/v1/openapi.json", None).await;
    assert_eq!(st, StatusCode::OK);
    for path in [
        "/v1/episodes",
        "/v1/episodes/{id}/step",
        "/v1/evaluate",
        "/v1/tasks",
    ] {
        assert!(v["paths"].get(path).is_some(), "openapi lacks {path}");
    }
    assert!(v["components"]["schemas"].get("StepResponse").is_some());
    let (st, text) = raw(&s, "GET", "/metrics", None, None).await;
    assert_eq!(st, StatusCode::OK);
    let text = text.as_str().unwrap();
    for line in [
        "cuda_agent_resets_total 0",
        "cuda_agent_device_leases_total{device=\"0\"} 0",
        "cuda_agent_device_busy_seconds_total{device=\"0\"} 0",
        "cuda_agent_device_starved_seconds_total{device=\"0\"} 0",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing: {text}");
    }
}

#[tokio::test]
async fn the_default_budget_is_the_devices_and_is_said() {
    let dir = tempfile::tempdir().unwrap();
    let s = state(dir.path(), None);
    let (_, info) = call(&s, "GET", "/v1/info", None).await;
    let d = &info["episode_defaults"];
    assert_eq!(d["time_budget_s"], 900.0, "{info}");
    assert_eq!(d["time_budget_from"], "the device's default");
    assert_eq!(d["device_default_time_budget_s"]["cuda"], 1200.0);
    assert_eq!(d["max_turns"], 200);
    let (st, reset) = call(
        &s,
        "POST",
        "/v1/episodes",
        Some(json!({"task": "L1/1_ReLU"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{reset}");
    assert_eq!(reset["info"]["limits"]["time_budget_s"], 900.0, "{reset}");
    let prompt = reset["observation"]["text"].as_str().unwrap();
    assert!(prompt.contains("900 s of tool time"), "{prompt}");
    // A budget given to the server replaces the device's, and /v1/info says so.
    let dir2 = tempfile::tempdir().unwrap();
    let s2 = state_from(ServerConfig {
        time_budget: Some(std::time::Duration::from_secs(60)),
        ..test_config(dir2.path())
    });
    let (_, info) = call(&s2, "GET", "/v1/info", None).await;
    assert_eq!(info["episode_defaults"]["time_budget_s"], 60.0, "{info}");
    assert_eq!(
        info["episode_defaults"]["time_budget_from"],
        "--time-budget-s"
    );
}

#[tokio::test]
async fn every_kind_of_bad_input_gets_a_json_4xx() {
    let dir = tempfile::tempdir().unwrap();
    let s = state(dir.path(), None);
    let (_, reset) = call(
        &s,
        "POST",
        "/v1/episodes",
        Some(json!({"task": "L1/1_ReLU"})),
    )
    .await;
    let id = reset["episode_id"].as_str().unwrap().to_string();
    let step = format!("/v1/episodes/{id}/step");
    let cases: Vec<(&str, String, Option<String>, StatusCode, &str)> = vec![
        ("POST", step.clone(), Some("{not json".into()), StatusCode::BAD_REQUEST, "malformed_json"),
        ("POST", "/v1/episodes".into(), Some("{\"task\": ".into()), StatusCode::BAD_REQUEST, "malformed_json"),
        ("POST", "/v1/episodes/nope/step".into(), Some(json!({"action": {"tool": "Glob", "arguments": {"pattern": "*"}}}).to_string()), StatusCode::NOT_FOUND, "unknown_episode"),
        ("GET", "/v1/episodes/nope".into(), None, StatusCode::NOT_FOUND, "unknown_episode"),
        ("POST", step.clone(), Some(json!({"action": {"tool": "rm", "arguments": {}}}).to_string()), StatusCode::BAD_REQUEST, "unknown_tool"),
        ("POST", step.clone(), Some(json!({"action": {"tool": "Bash", "arguments": {"command": 42}}}).to_string()), StatusCode::UNPROCESSABLE_ENTITY, "bad_arguments"),
        ("POST", step.clone(), Some(json!({"act": {}}).to_string()), StatusCode::UNPROCESSABLE_ENTITY, "bad_request"),
        ("POST", "/v1/episodes".into(), Some(json!({"task": "L9/none"}).to_string()), StatusCode::NOT_FOUND, "unknown_task"),
        ("POST", "/v1/episodes".into(), Some(json!({"options": {"max_turns": 0}}).to_string()), StatusCode::BAD_REQUEST, "bad_request"),
        ("POST", step.clone(), Some(json!({"action": {"tool": "Write", "arguments": {"file_path": "x", "content": "y".repeat(100_000)}}}).to_string()), StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
        ("POST", "/v1/evaluate".into(), Some(json!({"task": "L1/1_ReLU", "solution": {"files": {"../evil.py": "x", "model_new.py": ""}}}).to_string()), StatusCode::BAD_REQUEST, "bad_solution"),
        ("GET", "/v1/nothing".into(), None, StatusCode::NOT_FOUND, "not_found"),
        ("PUT", "/v1/tasks".into(), None, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
    ];
    for (method, uri, body, want, code) in cases {
        let (st, v) = raw(&s, method, &uri, body, None).await;
        assert_eq!(st, want, "{method} {uri}: {v}");
        assert_eq!(v["error"]["code"], code, "{method} {uri}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
    }
    // Nothing above took a turn.
    let (_, v) = call(&s, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(v["turn"], 0);
    // A failing tool is an observation, not an HTTP error.
    let (st, v) = call(
        &s,
        "POST",
        &step,
        Some(json!({"action": {"tool": "Read", "arguments": {"file_path": "/etc/shadow"}}})),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["observation"]["is_error"], true);
}

#[tokio::test]
async fn auth_is_required_when_a_key_is_set() {
    let dir = tempfile::tempdir().unwrap();
    let s = state(dir.path(), Some("sekrit"));
    let (st, v) = raw(&s, "GET", "/v1/tasks", None, None).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("unauthorized"))
    );
    let (st, _) = raw(&s, "GET", "/v1/tasks", None, Some("Bearer wrong")).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, _) = raw(&s, "GET", "/v1/tasks", None, Some("Bearer sekrit")).await;
    assert_eq!(st, StatusCode::OK);
    let (st, _) = raw(&s, "GET", "/v1/health", None, None).await;
    assert_eq!(st, StatusCode::OK, "health stays open");
}

#[tokio::test]
async fn steps_todos_idempotency_and_the_turn_limit() {
    let dir = tempfile::tempdir().unwrap();
    let s = state(dir.path(), None);
    let (st, reset) = call(
        &s,
        "POST",
        "/v1/episodes",
        Some(json!({"split": "level1", "seed": 3, "options": {"max_turns": 4}})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{reset}");
    let id = reset["episode_id"].as_str().unwrap();
    assert_eq!(reset["info"]["limits"]["max_turns"], 4);
    assert_eq!(reset["info"]["tools"].as_array().unwrap().len(), 9);
    assert!(reset["observation"]["text"]
        .as_str()
        .unwrap()
        .contains("class Model"));
    let step = format!("/v1/episodes/{id}/step");

    // OpenAI tool_calls shape, arguments as a string.
    let (_, v) = call(&s, "POST", &step, Some(json!({"action": {"id": "call_1", "type": "function", "function": {"name": "Glob", "arguments": "{\"pattern\": \"*.py\"}"}}}))).await;
    assert_eq!(v["reward"], 0.0);
    assert_eq!(v["done"], false);
    let paths = v["observation"]["data"]["paths"].as_array().unwrap();
    assert!(
        paths.iter().any(|p| p == "model_new.py") && paths.iter().any(|p| p == "verify.py"),
        "{v}"
    );

    // A retried step with the same request_id runs once.
    // The command also prints its nice value: the agent's commands run in the background.
    let body = json!({"action": {"tool": "Bash", "arguments": {"command": "echo ran >> runs.txt; wc -l < runs.txt; cut -d' ' -f19 /proc/self/stat"}}, "request_id": "r-1"});
    let (_, first) = call(&s, "POST", &step, Some(body.clone())).await;
    let (_, second) = call(&s, "POST", &step, Some(body)).await;
    assert_eq!(first["observation"], second["observation"]);
    assert_eq!(second["info"]["replayed"], true);
    // The command's output, then the budget left.
    let text = first["observation"]["text"].as_str().unwrap();
    assert!(text.starts_with("1\n10\n["), "{text}");

    let (_, v) = call(&s, "POST", &step, Some(json!({"action": {"tool": "TodoWrite", "arguments": {"todos": [{"content": "Profile", "status": "in_progress", "activeForm": "Profiling"}]}}}))).await;
    assert_eq!(v["info"]["turn"], 3);
    let (_, st) = call(&s, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(st["todos"][0]["content"], "Profile");
    assert_eq!(st["status"], "running");

    // The fourth turn is the last: truncated, and the empty model_new.py scores -1.
    let (_, v) = call(
        &s,
        "POST",
        &step,
        Some(json!({"action": {"tool": "Read", "arguments": {"file_path": "model.py"}}})),
    )
    .await;
    assert_eq!(v["truncated"], true, "{v}");
    assert_eq!(v["done"], true);
    assert_eq!(v["info"]["truncation_reason"], "max_turns");
    assert_eq!(v["reward"], -1.0);
    assert!(
        v["info"]["evaluation"]["reason"]
            .as_str()
            .unwrap()
            .contains("missing_solution"),
        "{v}"
    );
    let (st, v) = call(
        &s,
        "POST",
        &step,
        Some(json!({"action": {"tool": "Glob", "arguments": {"pattern": "*"}}})),
    )
    .await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("episode_ended"))
    );

    let (_, t) = call(&s, "GET", &format!("/v1/episodes/{id}/trajectory"), None).await;
    let kinds: Vec<&str> = t["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["reset", "step", "step", "step", "step", "final"],
        "the replay is not logged twice"
    );
    // The workspace is gone once the episode ended.
    assert!(!dir.path().join("episodes").join(id).exists());
}

#[tokio::test]
async fn delete_closes_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let s = state(dir.path(), None);
    let (_, reset) = call(&s, "POST", "/v1/episodes", None).await;
    let id = reset["episode_id"].as_str().unwrap();
    assert!(dir
        .path()
        .join("episodes")
        .join(id)
        .join("workspace/model.py")
        .exists());
    let (st, v) = call(&s, "DELETE", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["status"], "closed");
    assert!(!dir.path().join("episodes").join(id).exists());
    let (st, _) = call(&s, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_runaway_candidate_hits_the_time_limit() {
    let dir = tempfile::tempdir().unwrap();
    let s = state_with(dir.path(), None, std::time::Duration::from_secs(20));
    let solution = "import time\nwhile True:\n    time.sleep(1)\n";
    let (st, v) = call(
        &s,
        "POST",
        "/v1/evaluate",
        Some(json!({"task": "L1/2_Add", "solution": solution})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["reward"], -1.0);
    assert!(
        v["reason"].as_str().unwrap().starts_with("time_limit:"),
        "{v}"
    );
    // Nothing of it is left running (other evaluations on the machine are not this test's).
    let leftovers = std::process::Command::new("pgrep")
        .arg("-f")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&leftovers.stdout).trim().is_empty());
}

#[tokio::test]
async fn a_full_server_answers_503_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(ServerConfig {
        max_episodes: 2,
        ..test_config(dir.path())
    });
    let (_, a) = call(&s, "POST", "/v1/episodes", None).await;
    let (st, _) = call(&s, "POST", "/v1/episodes", None).await;
    assert_eq!(st, StatusCode::OK);
    let (st, v) = call(&s, "POST", "/v1/episodes", None).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("at_capacity")),
        "{v}"
    );
    let (_, info) = call(&s, "GET", "/v1/info", None).await;
    assert_eq!(info["open_episodes"], 2);
    call(
        &s,
        "DELETE",
        &format!("/v1/episodes/{}", a["episode_id"].as_str().unwrap()),
        None,
    )
    .await;
    let (st, _) = call(&s, "POST", "/v1/episodes", None).await;
    assert_eq!(st, StatusCode::OK, "a slot is free again");
}

#[tokio::test]
async fn idle_episodes_expire_and_are_cleaned_up() {
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(ServerConfig {
        idle_timeout: std::time::Duration::from_millis(200),
        ..test_config(dir.path())
    });
    let (_, r) = call(&s, "POST", "/v1/episodes", None).await;
    let id = r["episode_id"].as_str().unwrap().to_string();
    assert_eq!(s.episodes.expire_idle().await, 0, "not idle yet");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(s.episodes.expire_idle().await, 1);
    let (_, v) = call(&s, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(v["status"], "truncated");
    assert_eq!(v["truncation_reason"], "idle_timeout");
    assert!(!dir.path().join("episodes").join(&id).exists());
    let (_, t) = call(&s, "GET", &format!("/v1/episodes/{id}/trajectory"), None).await;
    assert_eq!(
        t["records"].as_array().unwrap().last().unwrap()["kind"],
        "truncated"
    );
}

/// A `request_id` names one request. Sent again with the same body it gets the first answer
/// (the same episode, the same verdict); sent with another body it is refused, so a verdict is
/// never handed to a solution it was not judged on and an episode never to a reset that asked
/// for another task.
#[tokio::test]
async fn a_request_id_reused_for_another_request_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = state(dir.path(), None);
    let reset = json!({"task": "L1/1_ReLU", "request_id": "k"});
    let (st, first) = call(&s, "POST", "/v1/episodes", Some(reset.clone())).await;
    assert_eq!(st, StatusCode::OK, "{first}");
    let (st, again) = call(&s, "POST", "/v1/episodes", Some(reset)).await;
    assert_eq!(st, StatusCode::OK, "{again}");
    assert_eq!(again["episode_id"], first["episode_id"]);
    assert_eq!(again["info"]["replayed"], true, "{again}");
    let other = json!({"task": "L1/2_Add", "request_id": "k"});
    let (st, v) = call(&s, "POST", "/v1/episodes", Some(other)).await;
    assert_eq!(st, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "request_id_reused", "{v}");

    let evaluate = |solution: &str| json!({"task": "L1/2_Add", "solution": solution, "options": {"request_id": "e"}});
    let failing = "raise SystemExit(3)\n";
    let (st, judged) = call(&s, "POST", "/v1/evaluate", Some(evaluate(failing))).await;
    assert_eq!(st, StatusCode::OK, "{judged}");
    assert_eq!(judged["reward"], -1.0, "{judged}");
    let (st, replayed) = call(&s, "POST", "/v1/evaluate", Some(evaluate(failing))).await;
    assert_eq!(st, StatusCode::OK, "{replayed}");
    assert_eq!(replayed, judged);
    let other = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, a, b):\n        return a + b\n";
    let (st, v) = call(&s, "POST", "/v1/evaluate", Some(evaluate(other))).await;
    assert_eq!(st, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "request_id_reused", "{v}");
}
