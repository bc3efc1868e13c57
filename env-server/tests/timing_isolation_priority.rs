//! Timing isolation by priority (`--timing-cores auto` on a host with too few cores to spare,
//! such as the 2-core CPU host, with prestart): two evaluations submitted together. Each
//! starts its judge and workers at `SCHED_IDLE`, below the evaluation that times, and the
//! server raises them to the normal policy once they hold the lease; so while one times, the
//! other's start-up runs only on what it leaves idle. Read from `/proc` while they run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use common::{call, descends_from_this_process as ours, processes, state_from, test_config};
use env_server::evaluation::TimingCores;
use env_server::ServerConfig;
use serde_json::json;

const ADD_CANDIDATE: &str = include_str!("../../tests/cpu_add_candidate.py");

/// `SCHED_IDLE` as `/proc/<pid>/stat` reports a policy.
const IDLE: i64 = 5;

/// One judge or worker process the sampler saw: its uid and its threads' policies.
#[derive(Debug, Clone)]
struct Seen {
    uid: u32,
    what: &'static str,
    policies: BTreeSet<i64>,
}

/// The policy (field 41) in a stat line.
fn policy(stat: &str) -> Option<i64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(38)?.parse().ok()
}

/// The evaluations' judges and serving workers now (not builds, not zombies, not keepers).
fn snapshot() -> Vec<Seen> {
    let mut out = Vec::new();
    for (pid, cmd) in processes() {
        let what = if cmd.contains("evaluate.py") {
            "judge"
        } else if cmd.contains("cuda_agent_worker.py") && cmd.contains(" serve") {
            "worker"
        } else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let uid: u32 = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        let zombie = status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains('Z'));
        if uid == 0 || !ours(pid) || zombie {
            continue;
        }
        let policies: BTreeSet<i64> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
            .filter_map(|s| policy(&s))
            .collect();
        if !policies.is_empty() {
            out.push(Seen {
                uid,
                what,
                policies,
            });
        }
    }
    out
}

#[tokio::test]
async fn evaluations_start_below_the_timed_one_and_are_raised_with_the_lease() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(ServerConfig {
        prestart: Some(true),
        timing_cores: TimingCores::Auto,
        ..test_config(dir.path())
    });
    let (st, info) = call(&s, "GET", "/v1/info", None).await;
    assert_eq!(st, StatusCode::OK, "{info}");
    let iso = &info["timing_isolation"];
    if iso["mode"] != "priority" {
        // A host with cores to spare pins instead (timing_isolation.rs checks that).
        eprintln!("skipped: {iso}");
        return;
    }
    assert!(iso["note"].is_string(), "{iso}");
    assert!(
        iso["lowered"].as_array().is_some_and(|l| !l.is_empty()),
        "{iso}"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut all = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                all.push(snapshot());
                std::thread::sleep(Duration::from_millis(20));
            }
            all
        })
    };
    let a = json!({"task": "L1/2_Add", "solution": ADD_CANDIDATE});
    let b = json!({"task": "L1/2_Add", "solution": format!("{ADD_CANDIDATE}\n# the second\n")});
    let (ra, rb) = tokio::join!(
        call(&s, "POST", "/v1/evaluate", Some(a)),
        call(&s, "POST", "/v1/evaluate", Some(b)),
    );
    stop.store(true, Ordering::Relaxed);
    let snaps = sampler.join().unwrap();
    for (st, r) in [&ra, &rb] {
        assert_eq!(*st, StatusCode::OK, "{r}");
        assert_eq!(r["correct"], true, "{r}");
    }

    // Each judge's uid: first seen at SCHED_IDLE (started ahead of the lease), later at the
    // normal policy alone (raised with the lease).
    let mut history: BTreeMap<u32, Vec<BTreeSet<i64>>> = BTreeMap::new();
    let mut beside = 0;
    for snap in &snaps {
        for p in snap.iter().filter(|p| p.what == "judge") {
            history.entry(p.uid).or_default().push(p.policies.clone());
        }
        let raised: BTreeSet<u32> = snap
            .iter()
            .filter(|p| !p.policies.contains(&IDLE))
            .map(|p| p.uid)
            .collect();
        // One evaluation raised at a time: its judge's uid and its worker's.
        assert!(
            raised.len() <= 2,
            "more than one evaluation at the normal policy at once: {snap:?}"
        );
        if !raised.is_empty()
            && snap
                .iter()
                .any(|p| p.policies == BTreeSet::from([IDLE]) && !raised.contains(&p.uid))
        {
            beside += 1;
        }
    }
    eprintln!(
        "{} snapshots; {beside} with a lowered evaluation beside a raised one; judges: {:?}",
        snaps.len(),
        history
            .iter()
            .map(|(uid, h)| (uid, h.first().cloned(), h.last().cloned()))
            .collect::<Vec<_>>()
    );
    assert_eq!(history.len(), 2, "two judges expected: {history:?}");
    for (uid, h) in &history {
        assert_eq!(
            h.first(),
            Some(&BTreeSet::from([IDLE])),
            "judge uid {uid} did not start at SCHED_IDLE"
        );
        assert!(
            h.iter().any(|p| p == &BTreeSet::from([0])),
            "judge uid {uid} was never raised to the normal policy"
        );
    }
    assert!(
        beside > 0,
        "never saw an evaluation start beside a timed one: the test proves nothing"
    );
}
