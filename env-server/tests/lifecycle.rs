//! The episode lifecycle against a client that opens, ends and deletes many episodes and a
//! server that crashes: what leaves memory, what survives a restart, what stays on disk.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, SystemTime};

use axum::http::StatusCode;
use common::*;
use env_api::{FinalRecord, TrajectoryRecord, TruncatedRecord};
use env_server::retention::{self, BuildCacheRetention, TrajectoryRetention};
use env_server::ServerConfig;
use serde_json::json;

async fn submit_red(state: &std::sync::Arc<env_server::AppState>, id: &str) -> serde_json::Value {
    let step = format!("/v1/episodes/{id}/step");
    let (st, v) =
        call(state, "POST", &step, Some(json!({"action": {"tool": "Write", "arguments": {"file_path": "answer.txt", "content": "red"}}, "request_id": "w"})))
            .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = call(
        state,
        "POST",
        &step,
        Some(json!({"action": {"tool": "Submit", "arguments": {}}, "request_id": "s"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["done"], true, "{v}");
    v
}

#[tokio::test]
async fn a_delete_is_not_undone_by_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let state = state_from(test_config(dir.path()));
    // One deleted while running, one deleted after it ended.
    let running = tiny_episode(&state).await;
    let ended = tiny_episode(&state).await;
    submit_red(&state, &ended).await;
    for id in [&running, &ended] {
        let (st, v) = call(&state, "DELETE", &format!("/v1/episodes/{id}"), None).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        let (st, _) = call(&state, "GET", &format!("/v1/episodes/{id}"), None).await;
        assert_eq!(st, StatusCode::NOT_FOUND);
    }
    drop(state);

    let state = state_from(test_config(dir.path()));
    for id in [&running, &ended] {
        for uri in [
            format!("/v1/episodes/{id}"),
            format!("/v1/episodes/{id}/trajectory"),
        ] {
            let (st, v) = call(&state, "GET", &uri, None).await;
            assert_eq!(st, StatusCode::NOT_FOUND, "{uri} after a restart: {v}");
        }
        let (st, _) = call(
            &state,
            "POST",
            &format!("/v1/episodes/{id}/step"),
            Some(json!({"action": {"tool": "Submit", "arguments": {}}, "request_id": "s"})),
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        // The log stays for training, ending in the record that closed it.
        let records = env_server::trajectory::read(
            &dir.path().join("trajectories").join(format!("{id}.jsonl")),
        )
        .unwrap();
        assert_eq!(records.last().unwrap().kind(), "closed");
    }
    assert_eq!(state.episodes.in_memory(), 0);
}

#[tokio::test]
async fn finished_episodes_leave_memory_and_stay_readable() {
    let dir = tempfile::tempdir().unwrap();
    let state = state_from(ServerConfig {
        finished_grace: Duration::ZERO,
        ..test_config(dir.path())
    });
    let mut ids = Vec::new();
    for _ in 0..20 {
        let id = tiny_episode(&state).await;
        submit_red(&state, &id).await;
        ids.push(id);
    }
    let open = tiny_episode(&state).await;
    assert_eq!(state.episodes.in_memory(), 21);
    assert_eq!(state.episodes.evict_finished(), 20);
    assert_eq!(
        state.episodes.in_memory(),
        1,
        "only the running episode stays"
    );
    // Out of memory, still answered from the logs: state, trajectory, a retried step.
    let id = &ids[3];
    let (st, v) = call(&state, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "terminated");
    assert_eq!(v["result"]["reward"], 1.0, "{v}");
    let (_, t) = call(
        &state,
        "GET",
        &format!("/v1/episodes/{id}/trajectory"),
        None,
    )
    .await;
    assert_eq!(t["records"].as_array().unwrap().len(), 4, "{t}");
    let (st, v) = call(
        &state,
        "POST",
        &format!("/v1/episodes/{id}/step"),
        Some(json!({"action": {"tool": "Submit", "arguments": {}}, "request_id": "s"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["info"]["replayed"], true);
    assert_eq!(v["reward"], 1.0);
    let (st, v) = call(
        &state,
        "POST",
        &format!("/v1/episodes/{id}/step"),
        Some(json!({"action": {"tool": "Glob", "arguments": {"pattern": "*"}}})),
    )
    .await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("episode_ended"))
    );
    // A DELETE of an episode out of memory is final too.
    let (st, _) = call(&state, "DELETE", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(st, StatusCode::OK);
    let (st, _) = call(&state, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (_, v) = call(&state, "GET", &format!("/v1/episodes/{open}"), None).await;
    assert_eq!(v["status"], "running");
}

#[tokio::test]
async fn a_restart_loads_nothing_into_memory_and_sweeps_crash_leftovers() {
    let dir = tempfile::tempdir().unwrap();
    let state = state_from(test_config(dir.path()));
    let ended = tiny_episode(&state).await;
    submit_red(&state, &ended).await;
    let interrupted = tiny_episode(&state).await;
    drop(state);
    // What a crash leaves: an evaluation directory, a workspace, a stray file.
    let eval_left = dir.path().join("evals/0123abcd/candidate");
    std::fs::create_dir_all(&eval_left).unwrap();
    std::fs::write(eval_left.join("model_new.py"), "x").unwrap();
    std::fs::write(dir.path().join("evals/stray"), "x").unwrap();
    let orphan = dir
        .path()
        .join("episodes/ffffffffffffffffffffffffffffffff/workspace");
    std::fs::create_dir_all(&orphan).unwrap();
    assert!(dir.path().join("episodes").join(&interrupted).exists());

    let state = state_from(test_config(dir.path()));
    assert_eq!(state.episodes.in_memory(), 0);
    assert_eq!(
        std::fs::read_dir(dir.path().join("evals")).unwrap().count(),
        0,
        "evals/ swept"
    );
    assert_eq!(
        std::fs::read_dir(dir.path().join("episodes"))
            .unwrap()
            .count(),
        0,
        "episodes/ swept"
    );
    let (_, v) = call(&state, "GET", &format!("/v1/episodes/{interrupted}"), None).await;
    assert_eq!(
        (v["status"].as_str(), v["truncation_reason"].as_str()),
        (Some("truncated"), Some("server_restart")),
        "{v}"
    );
    let (_, v) = call(&state, "GET", &format!("/v1/episodes/{ended}"), None).await;
    assert_eq!(v["status"], "terminated", "{v}");
    // A second restart does not log the interruption twice.
    drop(state);
    let state = state_from(test_config(dir.path()));
    let (_, t) = call(
        &state,
        "GET",
        &format!("/v1/episodes/{interrupted}/trajectory"),
        None,
    )
    .await;
    let kinds: Vec<&str> = t["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["reset", "truncated"]);
}

#[tokio::test]
async fn an_episode_whose_log_outgrows_its_cap_is_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let state = state_from(ServerConfig {
        max_log_bytes: 200 * 1024,
        ..test_config(dir.path())
    });
    let id = tiny_episode(&state).await;
    let content = "q".repeat(50 * 1024);
    let mut last = serde_json::Value::Null;
    for i in 0..20 {
        let body = json!({"action": {"tool": "Write", "arguments": {"file_path": format!("f{i}"), "content": content}}});
        let (st, v) = call(
            &state,
            "POST",
            &format!("/v1/episodes/{id}/step"),
            Some(body),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        last = v;
        if last["done"] == true {
            break;
        }
    }
    assert_eq!(last["info"]["truncation_reason"], "log_quota", "{last}");
    let len = std::fs::metadata(dir.path().join("trajectories").join(format!("{id}.jsonl")))
        .unwrap()
        .len();
    assert!(
        len < 400 * 1024,
        "the cap is exceeded by one step at most: {len}"
    );
}

#[test]
fn trajectory_retention_keeps_the_newest_and_spares_live_episodes() {
    let dir = tempfile::tempdir().unwrap();
    let now = SystemTime::now();
    let ids: Vec<String> = (0..10).map(|i| format!("{i:032x}")).collect();
    for (i, id) in ids.iter().enumerate() {
        let p = dir.path().join(format!("{id}.jsonl"));
        std::fs::write(&p, vec![b'x'; 1000]).unwrap();
        // Episode i was last written i hours ago.
        std::fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(now - Duration::from_secs(3600 * i as u64))
            .unwrap();
    }
    std::fs::write(dir.path().join("notes.txt"), "kept").unwrap();
    let live: std::collections::HashSet<String> = [ids[9].clone()].into();
    let kept = |dir: &std::path::Path| {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    // No bound: nothing goes.
    assert_eq!(
        retention::prune_trajectories(dir.path(), &TrajectoryRetention::default(), &live).entries,
        0
    );
    // By age: older than 5.5 hours goes, except the live one.
    let r = retention::prune_trajectories(
        dir.path(),
        &TrajectoryRetention {
            max_age: Some(Duration::from_secs(5 * 3600 + 1800)),
            ..Default::default()
        },
        &live,
    );
    assert_eq!(r.entries, 3, "{:?}", kept(dir.path()));
    // By count: the three newest.
    retention::prune_trajectories(
        dir.path(),
        &TrajectoryRetention {
            keep: Some(3),
            ..Default::default()
        },
        &live,
    );
    let names = kept(dir.path());
    assert_eq!(
        names,
        [
            format!("{}.jsonl", ids[0]),
            format!("{}.jsonl", ids[1]),
            format!("{}.jsonl", ids[2]),
            format!("{}.jsonl", ids[9]),
            "notes.txt".into()
        ]
    );
    // By bytes: two files' worth.
    retention::prune_trajectories(
        dir.path(),
        &TrajectoryRetention {
            max_bytes: Some(2000),
            ..Default::default()
        },
        &live,
    );
    assert_eq!(kept(dir.path()).len(), 4);
}

#[test]
fn the_build_cache_is_pruned_least_recently_used_first() {
    let dir = tempfile::tempdir().unwrap();
    let now = SystemTime::now();
    for i in 0..5u64 {
        let entry = dir.path().join(format!("hash{i}"));
        std::fs::create_dir_all(entry.join("build")).unwrap();
        std::fs::write(entry.join("build/ext.so"), vec![1u8; 256 * 1024]).unwrap();
        // hash0 used longest ago; hash4 just now.
        std::fs::File::open(&entry)
            .unwrap()
            .set_modified(now - Duration::from_secs(3600 * (5 - i)))
            .unwrap();
    }
    // A link planted in an entry pointing outside is removed as a link, never followed.
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("precious"), "keep").unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("hash0/build/escape")).unwrap();
    let policy = BuildCacheRetention {
        max_bytes: 700 * 1024,
        in_use_window: Duration::from_secs(60),
    };
    let r = retention::prune_build_cache(dir.path(), &policy);
    assert_eq!(r.entries, 3);
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["hash3", "hash4"]);
    assert!(outside.path().join("precious").exists());
    // An entry in use is spared even over the bound; touching one makes it recent.
    retention::touch(&dir.path().join("hash3")).unwrap();
    let tight = BuildCacheRetention {
        max_bytes: 0,
        in_use_window: Duration::from_secs(60),
    };
    assert_eq!(retention::prune_build_cache(dir.path(), &tight).entries, 1);
    assert!(dir.path().join("hash3").exists() && !dir.path().join("hash4").exists());
}

#[test]
fn the_tail_of_a_log_names_how_it_ended() {
    let dir = tempfile::tempdir().unwrap();
    let log = env_server::trajectory::TrajectoryLog::open(dir.path(), "e").unwrap();
    log.append(&TrajectoryRecord::Truncated {
        time: 1.0,
        body: TruncatedRecord {
            reason: "r".repeat(200_000),
            turn: 1,
        },
    })
    .unwrap();
    assert_eq!(
        env_server::trajectory::last_kind(log.path())
            .unwrap()
            .as_deref(),
        Some("truncated")
    );
    log.append(&TrajectoryRecord::Final {
        time: 2.0,
        body: FinalRecord {
            files: [("model_new.py".to_string(), "f".repeat(300_000))].into(),
            ..FinalRecord::default()
        },
    })
    .unwrap();
    assert_eq!(
        env_server::trajectory::last_kind(log.path())
            .unwrap()
            .as_deref(),
        Some("final")
    );
    // A torn last line is not trusted.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(log.path())
        .unwrap();
    std::io::Write::write_all(&mut f, b"{\"kind\":\"clo").unwrap();
    assert_eq!(env_server::trajectory::last_kind(log.path()).unwrap(), None);
}

#[tokio::test]
async fn commands_start_while_the_server_holds_more_descriptors_than_a_command_may() {
    // A thousand open episodes and their connections hold thousands of descriptors; a command
    // may open at most 4096 of its own. Starting one must not fail for the server's.
    let dir = tempfile::tempdir().unwrap();
    let state = state_from(test_config(dir.path()));
    let id = tiny_episode(&state).await;
    let held: Vec<std::fs::File> = (0..4200)
        .map(|_| std::fs::File::open("/dev/null").expect("a descriptor"))
        .collect();
    let (st, v) = call(
        &state,
        "POST",
        &format!("/v1/episodes/{id}/step"),
        Some(json!({"action": {"tool": "Bash", "arguments": {"command": "echo started"}}})),
    )
    .await;
    drop(held);
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["observation"]["is_error"], false, "{v}");
    assert_eq!(v["observation"]["text"], "started\n", "{v}");
}

/// The old logs in env-api's fixtures: (file, episode id, lines as JSON).
fn old_log(name: &str) -> (std::path::PathBuf, String, Vec<serde_json::Value>) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../env-api/tests/fixtures/old_logs")
        .join(name);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let id = lines[0]["body"]["response"]["episode_id"]
        .as_str()
        .unwrap()
        .to_string();
    (path, id, lines)
}

/// Logs written before records were typed (bodies as sorted JSON maps) serve after a restart
/// as they did: state, trajectory, retried steps; one cut short is truncated by the restart.
#[tokio::test]
async fn logs_of_the_untyped_server_load_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("trajectories");
    std::fs::create_dir_all(&logs).unwrap();
    let mut old = std::collections::BTreeMap::new();
    for name in ["submitted", "restarted", "closed"] {
        let (path, id, lines) = old_log(&format!("{name}.jsonl"));
        std::fs::copy(&path, logs.join(format!("{id}.jsonl"))).unwrap();
        old.insert(name, (id, lines));
    }
    // An episode the old server was running when it stopped: the closed one, before its close.
    let interrupted = "0123456789abcdef0123456789abcdef";
    let text = std::fs::read_to_string(old_log("closed.jsonl").0).unwrap();
    let head: Vec<&str> = text.lines().collect();
    std::fs::write(
        logs.join(format!("{interrupted}.jsonl")),
        head[..head.len() - 1].join("\n") + "\n",
    )
    .unwrap();

    let state = state_from(test_config(dir.path()));
    let trajectory = |id: String| {
        let state = state.clone();
        async move {
            let (st, t) = call(
                &state,
                "GET",
                &format!("/v1/episodes/{id}/trajectory"),
                None,
            )
            .await;
            assert_eq!(st, StatusCode::OK, "{t}");
            t["records"].as_array().unwrap().clone()
        }
    };
    let retry = |id: String, rid: &'static str| {
        let state = state.clone();
        async move {
            let (st, v) = call(
                &state,
                "POST",
                &format!("/v1/episodes/{id}/step"),
                Some(json!({"action": {"tool": "Glob", "arguments": {"pattern": "*"}}, "request_id": rid})),
            )
            .await;
            assert_eq!(st, StatusCode::OK, "{v}");
            assert_eq!(v["info"]["replayed"], true, "{v}");
            v
        }
    };

    let (id, lines) = &old["submitted"];
    let (_, v) = call(&state, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(
        (v["status"].as_str(), v["result"]["reward"].as_f64()),
        (Some("terminated"), Some(1.0)),
        "{v}"
    );
    assert_eq!(&trajectory(id.clone()).await, lines, "the same records");
    for (rid, line) in [("t1", 1), ("g2", 10), ("s", 11)] {
        let mut v = retry(id.clone(), rid).await;
        v["info"]["replayed"] = json!(false);
        assert_eq!(v, lines[line]["body"]["response"], "{rid}");
    }

    let (id, lines) = &old["restarted"];
    let (_, v) = call(&state, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(
        (v["status"].as_str(), v["truncation_reason"].as_str()),
        (Some("truncated"), Some("server_restart")),
        "{v}"
    );
    assert_eq!(&trajectory(id.clone()).await, lines);
    let v = retry(id.clone(), "b1").await;
    assert_eq!(
        v["observation"]["data"]["restored_read_only"],
        json!(["model.py"])
    );
    assert_eq!(v["observation"]["data"]["exit_code"], 0);

    let (id, _) = &old["closed"];
    let (st, _) = call(&state, "GET", &format!("/v1/episodes/{id}"), None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);

    let (_, v) = call(&state, "GET", &format!("/v1/episodes/{interrupted}"), None).await;
    assert_eq!(
        (
            v["status"].as_str(),
            v["truncation_reason"].as_str(),
            v["turn"].as_u64()
        ),
        (Some("truncated"), Some("server_restart"), Some(1)),
        "{v}"
    );
    let records = trajectory(interrupted.to_string()).await;
    let kinds: Vec<&str> = records
        .iter()
        .map(|r| r["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["reset", "step", "truncated"]);
    // The old records and the new one read back together, typed.
    let typed = env_server::trajectory::read(&logs.join(format!("{interrupted}.jsonl"))).unwrap();
    assert_eq!(typed.len(), 3);
}
