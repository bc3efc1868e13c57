//! A step's tool time leaves out the time the host kept its command waiting for a CPU: the
//! step's `info` says how long, the trajectory log keeps it, and `/v1/info` says how this
//! host measures it. The test makes its own contention (its thread, where the in-process
//! server starts the command, pinned to one CPU beside busy-looping processes), so it holds
//! on an idle host and on a loaded one alike.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

use axum::http::StatusCode;
use common::{call, state_from, test_config, tiny_episode};
use serde_json::{json, Value};

/// Busy-looping processes at nice 0, each in its own session (the kernel weighs sessions
/// against each other), killed when dropped.
struct Hogs(Vec<Child>);

impl Hogs {
    fn start(n: usize) -> Self {
        Self(
            (0..n)
                .map(|_| {
                    let mut c = Command::new("/bin/sh");
                    c.args(["-c", "while :; do :; done"]);
                    // SAFETY: setsid is async-signal-safe and touches no memory.
                    unsafe {
                        c.pre_exec(|| {
                            libc::setsid();
                            Ok(())
                        });
                    }
                    c.spawn().expect("hog starts")
                })
                .collect(),
        )
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Pins the calling thread (and what it spawns from now on) to one CPU of its set.
fn pin_to_one_cpu() -> usize {
    // SAFETY: cpu_set_t is plain data; the calls get valid pointers and sizes.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
            0
        );
        let cpu = (0..libc::CPU_SETSIZE as usize)
            .rev()
            .find(|&c| libc::CPU_ISSET(c, &set))
            .expect("some CPU");
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one),
            0
        );
        cpu
    }
}

#[tokio::test]
async fn a_step_starved_by_the_host_is_charged_less_and_says_so_in_its_info_and_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state_from(test_config(dir.path()));
    let (st, info) = call(&state, "GET", "/v1/info", None).await;
    assert_eq!(st, StatusCode::OK, "{info}");
    let accounting = info["sandbox"]["cpu_accounting"]
        .as_str()
        .expect("typed field");
    assert!(["schedstat", "wall"].contains(&accounting), "{accounting}");
    if accounting != "schedstat" {
        eprintln!("skipped: this host charges wall time");
        return;
    }
    let id = tiny_episode(&state).await;
    // The server starts the command from this thread (a current-thread runtime).
    let cpu = pin_to_one_cpu();
    let _hogs = Hogs::start(4);
    let (st, v) = call(
        &state,
        "POST",
        &format!("/v1/episodes/{id}/step"),
        Some(json!({"action": {"tool": "Bash", "arguments": {
            "command": "i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done; echo done"
        }}})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let wall = v["observation"]["data"]["duration_ms"]
        .as_f64()
        .expect("duration")
        / 1000.0;
    let charged = v["info"]["tool_time_s"].as_f64().expect("tool time");
    let waited = v["info"]["cpu_wait_s"].as_f64().expect("typed field");
    eprintln!("cpu {cpu}: wall {wall} s, waited {waited} s, charged {charged} s\n{v}");
    assert!(
        charged < 0.6 * wall,
        "a command given a fraction of a CPU is charged {charged} s of {wall} s"
    );
    assert!(waited > 0.4 * wall, "{v}");
    let text = v["observation"]["text"].as_str().expect("text");
    assert!(text.contains("[the host was busy: "), "{text}");

    // The log has the step's wait as answered.
    let log = std::fs::read_to_string(dir.path().join("trajectories").join(format!("{id}.jsonl")))
        .expect("trajectory log");
    let logged: Vec<f64> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|r| find(&r, "cpu_wait_s"))
        .collect();
    assert_eq!(logged, vec![waited], "{log}");
}

/// The first number under `key` anywhere in `v`.
fn find(v: &Value, key: &str) -> Option<f64> {
    match v {
        Value::Object(m) => m
            .get(key)
            .and_then(Value::as_f64)
            .or_else(|| m.values().find_map(|x| find(x, key))),
        Value::Array(a) => a.iter().find_map(|x| find(x, key)),
        _ => None,
    }
}
