//! Timing isolation, pinned (`--timing-cores 1` on the 2-core CPU host, with prestart): two
//! evaluations submitted together and a CPU-hungry agent command beside them. While one
//! evaluation times, its judge and workers run on the reserved core alone, and everything
//! else the server started (the other evaluation starting ahead of its lease, the builds, the
//! agent's command) on the other; a candidate that widens its own affinity, or reaches for
//! another process's or for the cpuset's files, stays where it was put. Read from `/proc`
//! while the evaluations run.

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
use serde_json::{json, Value};

const ADD_CANDIDATE: &str = include_str!("../../tests/cpu_add_candidate.py");

/// What the candidate tries once its module is imported (after the gate, so while its
/// evaluation holds the lease): its affinity widened to every core, other processes' affinity
/// (its keeper, pid 1, and every pid near its own that is not a thread of its own), its own
/// move into the shared cpuset, a real-time policy and a nice value below 0 (either would put
/// it above its baselines). It prints what came of each.
const ESCAPE: &str = r#"
import json as _json
import os as _os

def _errno(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return e.errno

_before = sorted(_os.sched_getaffinity(0))
_widen = _errno(lambda: _os.sched_setaffinity(0, set(range(_os.cpu_count()))))
_after = sorted(_os.sched_getaffinity(0))
_mine = {int(t) for t in _os.listdir("/proc/self/task")}
_me = _os.getpid()
_others = [p for p in [_os.getppid(), 1] + list(range(max(2, _me - 64), _me + 256)) if p not in _mine and _errno(lambda: _os.sched_setaffinity(p, {0})) == "ok"]
_cpuset = open("/proc/self/cpuset").read().strip()
def _move():
    with open("/sys/fs/cgroup/cpuset" + _cpuset.rsplit("/", 1)[0] + "/shared/cgroup.procs", "w") as f:
        f.write(str(_me))
_moved = _errno(_move)
_fifo = _errno(lambda: _os.sched_setscheduler(0, _os.SCHED_FIFO, _os.sched_param(1)))
_nice = _errno(lambda: _os.setpriority(_os.PRIO_PROCESS, 0, -5))
print("ISOLATION " + _json.dumps({"before": _before, "widen": _widen, "after": _after, "others": _others, "moved": _moved, "cpuset": _cpuset, "fifo": _fifo, "nice": _nice}), flush=True)
"#;

/// One process the sampler saw.
#[derive(Debug, Clone)]
struct Seen {
    pid: u32,
    uid: u32,
    cpus: String,
    what: String,
}

/// The harness's processes and the agent's marked command now (zombies and root's keepers
/// left out).
fn snapshot() -> Vec<Seen> {
    let mut out = Vec::new();
    for (pid, cmd) in processes() {
        let what = if cmd.contains("evaluate.py") {
            "judge"
        } else if cmd.contains("cuda_agent_worker.py") && cmd.contains(" build") {
            "build"
        } else if cmd.contains("cuda_agent_worker.py") {
            "worker"
        } else if cmd.contains("isolation-hog") {
            "agent command"
        } else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        let uid: u32 = field("Uid:")
            .split_whitespace()
            .next()
            .and_then(|u| u.parse().ok())
            .unwrap_or(0);
        if uid == 0 || !ours(pid) || field("State:").starts_with('Z') {
            continue;
        }
        out.push(Seen {
            pid,
            uid,
            cpus: field("Cpus_allowed_list:"),
            what: what.into(),
        });
    }
    out
}

/// Samples [`snapshot`] every 20 ms until `stop`.
fn sample(stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Vec<Vec<Seen>>> {
    std::thread::spawn(move || {
        let mut all = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            all.push(snapshot());
            std::thread::sleep(Duration::from_millis(20));
        }
        all
    })
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[tokio::test]
async fn a_timed_evaluation_has_its_core_and_nothing_else_reaches_it() {
    if cores() < 2 || unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root and 2 cores");
        return;
    }
    // A host that allows real-time priorities, where the test may raise the limit
    // (CAP_SYS_RESOURCE): the server takes the allowance away from everything it starts.
    let rt = libc::rlimit {
        rlim_cur: 10,
        rlim_max: 10,
    };
    if unsafe { libc::setrlimit(libc::RLIMIT_RTPRIO, &rt) } != 0 {
        eprintln!("RLIMIT_RTPRIO not raised: the real-time check sees the host's own limit");
    }
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(ServerConfig {
        prestart: Some(true),
        timing_cores: TimingCores::List(vec![1]),
        ..test_config(dir.path())
    });
    let (st, info) = call(&s, "GET", "/v1/info", None).await;
    assert_eq!(st, StatusCode::OK, "{info}");
    let iso = &info["timing_isolation"];
    if iso["mode"] != "pinned" {
        // A host without a cpuset the server may write: said, and nothing to check here.
        assert_eq!(iso["mode"], "priority", "{iso}");
        assert!(iso["note"].is_string(), "{iso}");
        eprintln!("skipped: {iso}");
        return;
    }
    assert_eq!(iso["reserved_cores"], json!([[1]]), "{iso}");
    assert_eq!(iso["shared_cores"], json!([0]), "{iso}");

    let (st, reset) = call(
        &s,
        "POST",
        "/v1/episodes",
        Some(json!({"task": "L1/2_Add"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{reset}");
    let step = format!(
        "/v1/episodes/{}/step",
        reset["episode_id"].as_str().unwrap()
    );
    // The agent's command: busy for a while, after asking for every core.
    let hog = "python3 -c 'import os, time  # isolation-hog\nos.sched_setaffinity(0, {0, 1})\nt = time.time()\nwhile time.time() - t < 20: pass\nprint(\"affinity\", sorted(os.sched_getaffinity(0)))'";
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample(stop.clone());
    let escaping = json!({"task": "L1/2_Add", "solution": format!("{ADD_CANDIDATE}\n{ESCAPE}")});
    let plain = json!({"task": "L1/2_Add", "solution": format!("{ADD_CANDIDATE}\n# the second\n")});
    let (ra, rb, rh) = tokio::join!(
        call(&s, "POST", "/v1/evaluate", Some(escaping)),
        call(&s, "POST", "/v1/evaluate", Some(plain)),
        call(
            &s,
            "POST",
            &step,
            Some(json!({"action": {"tool": "Bash", "arguments": {"command": hog}}}))
        ),
    );
    stop.store(true, Ordering::Relaxed);
    let snaps = sampler.join().unwrap();
    for (st, r) in [&ra, &rb] {
        assert_eq!(*st, StatusCode::OK, "{r}");
        assert_eq!(r["correct"], true, "{r}");
    }
    let (st, h) = rh;
    assert_eq!(st, StatusCode::OK, "{h}");
    let text = h["observation"]["text"].as_str().unwrap_or_default();
    assert!(
        text.contains("affinity [0]"),
        "the agent's command reached the reserved core: {text}"
    );

    // Every process the server started was on one side or the other, never on both.
    let mut on_reserved: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
    let mut beside = 0;
    for snap in &snaps {
        for p in snap {
            assert!(
                p.cpus == "0" || p.cpus == "1",
                "{} {} (uid {}) ran on cores {}: not isolated",
                p.what,
                p.pid,
                p.uid,
                p.cpus
            );
            if p.cpus == "1" {
                assert!(
                    p.what == "judge" || p.what == "worker",
                    "{} {} on the reserved core",
                    p.what,
                    p.pid
                );
                on_reserved.entry(p.uid).or_default().insert(p.what.clone());
            }
        }
        // On the reserved core, one evaluation at a time (its two uids).
        let timed: BTreeSet<u32> = snap
            .iter()
            .filter(|p| p.cpus == "1")
            .map(|p| p.uid)
            .collect();
        assert!(
            timed.len() <= 2,
            "three uids on the reserved core: {snap:?}"
        );
        if !timed.is_empty()
            && snap
                .iter()
                .any(|p| p.cpus == "0" && !timed.contains(&p.uid))
        {
            beside += 1;
        }
    }
    eprintln!(
        "{} snapshots; on the reserved core: {on_reserved:?}; {beside} with other work beside a timed evaluation",
        snaps.len()
    );
    // Both evaluations' judges and workers timed there.
    let judges = on_reserved.values().filter(|w| w.contains("judge")).count();
    assert!(
        judges >= 2,
        "judges seen on the reserved core: {on_reserved:?}"
    );
    assert!(
        beside > 0,
        "never saw a timed evaluation with other work beside it: the test proves nothing"
    );

    // The candidate that tried to leave stayed where it was put.
    let log = ra.1["details"]["worker_log"].as_str().unwrap_or_default();
    let line = log
        .lines()
        .find_map(|l| l.strip_prefix("ISOLATION "))
        .unwrap_or_else(|| panic!("the candidate's report is missing: {log}"));
    let tried: Value = serde_json::from_str(line).unwrap();
    eprintln!("the candidate's attempts: {tried}");
    assert_eq!(tried["before"], json!([1]), "{tried}");
    assert_eq!(
        tried["after"],
        json!([1]),
        "the candidate widened its affinity: {tried}"
    );
    assert_eq!(
        tried["others"],
        json!([]),
        "the candidate set another process's affinity: {tried}"
    );
    assert_ne!(
        tried["moved"], "ok",
        "the candidate moved itself into another cpuset: {tried}"
    );
    assert_ne!(
        tried["fifo"], "ok",
        "the candidate took a real-time policy: {tried}"
    );
    assert_ne!(
        tried["nice"], "ok",
        "the candidate raised its priority: {tried}"
    );
}
