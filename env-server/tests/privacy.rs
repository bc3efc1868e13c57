//! What the data directory keeps from the agents: trajectory logs and the record of finished
//! builds are the server's alone (0600 files in 0700 directories, also for logs an older
//! server left readable), an agent's command cannot read another episode's log, and the server
//! refuses a data directory that every sandbox may read.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt;

use axum::http::StatusCode;
use common::*;
use serde_json::json;

fn mode(p: &std::path::Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[tokio::test]
async fn logs_are_the_servers_alone_and_another_episode_cannot_read_them() {
    let dir = tempfile::tempdir().unwrap();
    // An older server's log and directory, readable by everyone.
    let logs = dir.path().join("trajectories");
    std::fs::create_dir_all(&logs).unwrap();
    std::fs::set_permissions(&logs, std::fs::Permissions::from_mode(0o755)).unwrap();
    let old = logs.join(format!("{}.jsonl", "a".repeat(32)));
    std::fs::write(&old, "").unwrap();
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o644)).unwrap();

    let state = state_from(test_config(dir.path()));
    assert_eq!(mode(&logs), 0o700);
    assert_eq!(mode(&old), 0o600, "an older log stayed readable");
    assert_eq!(mode(&dir.path().join("build-ok")), 0o700);

    let victim = tiny_episode(&state).await;
    let secret = "the-victims-answer-5b1f";
    let (st, v) = call(
        &state,
        "POST",
        &format!("/v1/episodes/{victim}/step"),
        Some(json!({"action": {"tool": "Write", "arguments": {"file_path": "answer.txt", "content": secret}}})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let log = logs.join(format!("{victim}.jsonl"));
    assert_eq!(mode(&log), 0o600);

    // Another agent goes for the victim's log by its path, and for the directory's listing.
    let thief = tiny_episode(&state).await;
    let command = format!(
        "cat {log} ; ls {dir} ; grep -r {secret} {dir} ; echo END",
        log = log.display(),
        dir = logs.display()
    );
    let (st, v) = call(
        &state,
        "POST",
        &format!("/v1/episodes/{thief}/step"),
        Some(json!({"action": {"tool": "Bash", "arguments": {"command": command}}})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let text = v["observation"]["text"].as_str().unwrap_or("");
    assert!(text.contains("END"), "the command did not run: {v}");
    assert!(!text.contains(secret), "read another episode's log: {text}");
    // The id is in cat's own complaint about the path it was given, and nowhere else.
    assert_eq!(text.matches(&victim).count(), 1, "listed the logs: {text}");
}

/// A data directory under a path that every sandbox reads (here /dev/shm, on the sandbox's
/// read-only list like /usr, /opt and /etc) is refused at start, with the reason.
#[test]
fn a_data_dir_every_sandbox_can_read_is_refused() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("no /dev/shm on this host: nothing to try");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    let err = env_server::build_state(test_config(dir.path()))
        .err()
        .expect("a data dir under /dev/shm was accepted");
    let message = err.to_string();
    assert!(
        message.contains("readable by sandboxed processes") && message.contains("/dev/shm"),
        "{message}"
    );
    // Nothing of the server's was left there to read.
    assert!(!dir.path().join("pch").exists());
}
