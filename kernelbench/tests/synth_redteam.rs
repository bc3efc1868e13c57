//! Red team for `kernelbench synth --llm-url`'s filters: proposals written as an attacker
//! would (`tests/synth_attacks/`, each past the static screen), judged by the real filters on
//! real torch. Each must be rejected with a reason that names what stopped it, its effect must
//! not have happened (no secret read, no file written outside its scratch directory, no
//! connection made, no process left running), and its legitimate twin must be accepted.
//!
//! Before proposals ran in the sandbox (the worker ran them in its own process, as the
//! invoking user), every one of these was accepted with its effect done.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read as _;
use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kernelbench::synth::worker::{FilterVerdict, JudgeWorker, RunLimits};

mod common;

const ATTACKS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/synth_attacks");

/// The memory bound of a run here, and what the memory attack asks for past it.
const MEMORY_BOUND: u64 = 2 << 30;
/// The process bound of a run here, and how many processes the fork attack starts at once.
const PROCESS_BOUND: u64 = 128;
const FORKS: u64 = 300;

/// Where an attack aims, outside every scratch directory.
struct Targets {
    _dir: tempfile::TempDir,
    canary: String,
    outside: String,
    port: u16,
    connections: Arc<AtomicUsize>,
}

impl Targets {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let canary = dir.path().join("secret");
        std::fs::write(&canary, "secret").unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(AtomicUsize::new(0));
        let seen = connections.clone();
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                seen.fetch_add(1, Ordering::SeqCst);
                drop(s);
            }
        });
        Self {
            canary: canary.display().to_string(),
            outside: dir.path().join("planted.pt").display().to_string(),
            _dir: dir,
            port,
            connections,
        }
    }

    /// `_base.py` with the attack (or twin) `name` spliced in and its targets filled.
    fn source(&self, name: &str) -> String {
        let read = |f: &str| std::fs::read_to_string(Path::new(ATTACKS).join(f)).ok();
        let base = read("_base.py").unwrap();
        let body = read(&format!("{name}.body.pyfrag")).unwrap();
        let mut s = base.replace("# @BODY@\n", &body);
        if let Some(fwd) = read(&format!("{name}.forward.pyfrag")) {
            let indented: String = fwd.lines().map(|l| format!("        {l}\n")).collect();
            s = s.replace("        # @FORWARD@\n", &indented);
        }
        s.replace("@CANARY@", &self.canary)
            .replace("@OUTSIDE@", &self.outside)
            .replace("@PORT@", &self.port.to_string())
            .replace("@FORKS@", &FORKS.to_string())
            .replace("@MEMORY_BYTES@", &(MEMORY_BOUND + (1 << 30)).to_string())
    }
}

async fn worker() -> (tempfile::TempDir, JudgeWorker) {
    // A run imports torch afresh: long enough for that on a busy machine.
    let limits = RunLimits {
        memory_bytes: MEMORY_BOUND,
        processes: PROCESS_BOUND,
        ..RunLimits::default()
    };
    common::cpu_worker(Duration::from_secs(60), limits).await
}

fn reason(v: &FilterVerdict) -> &str {
    v.reason.as_deref().unwrap_or("<accepted>")
}

/// Every attack rejected with its reason, its effect undone, its twin accepted.
#[tokio::test(flavor = "multi_thread")]
async fn attacks_from_proposed_code_are_rejected_and_their_twins_accepted() {
    let (_dir, mut w) = worker().await;
    let report = w.sandbox_report().clone();
    eprintln!("sandbox: {report:?}");
    // Landlock and seccomp are what stop the file and network attacks; a host without them
    // must say so (the server refuses to start there unless told to run unconfined).
    if !(report.landlock && report.seccomp) {
        assert!(!report.missing.is_empty());
        eprintln!("skipped: this host lacks {:?}", report.missing);
        return;
    }
    let t = Targets::new();
    // (attack, the start of the reason it must be rejected with)
    let cases: &[(&str, &[&str])] = &[
        // landlock: the file is outside every path the run may read
        (
            "read_home",
            &["sandbox_denied: RuntimeError: Permission denied"],
        ),
        (
            "write_outside",
            &["sandbox_denied: RuntimeError: Permission denied"],
        ),
        // seccomp: socket() for a network family is refused
        ("network", &["sandbox_denied: PermissionError"]),
        // the cgroup's pids limit ends the run, or fork fails first (RLIMIT_NPROC)
        (
            "fork_many",
            &[
                "sandbox_limit: process_limit",
                "sandbox_denied: BlockingIOError",
            ],
        ),
        // the cgroup's memory limit ends the run, or the allocation fails first (RLIMIT_DATA)
        ("memory", &["sandbox_limit: memory_limit", "memory_limit: "]),
        // the sandbox kills what a run leaves, and a run that leaves anything is rejected
        ("spin_forever", &["left_processes: "]),
        // the run's output is not the worker's protocol: the forged verdicts reach the run's
        // driver at most, which takes them for a malformed message
        (
            "forge_verdict",
            &["malformed_results", "eager_error: ValueError"],
        ),
        // the checks run in the worker, where the proposal's patches do not reach
        ("patch_checks", &["nondeterministic"]),
    ];
    let mut failures = Vec::new();
    for (name, want) in cases {
        let v = w.judge(&t.source(name)).await.unwrap();
        let got = reason(&v);
        eprintln!("{name}: {got}");
        if !want.iter().any(|p| got.starts_with(p)) {
            failures.push(format!(
                "{name}: rejected with {got:?}, wanted one of {want:?}"
            ));
        }
        let twin = w.judge(&t.source(&format!("{name}.twin"))).await.unwrap();
        eprintln!("{name}.twin: {}", reason(&twin));
        if twin.reason.is_some() || twin.eager_ms.is_none() {
            failures.push(format!("{name}.twin: {}", reason(&twin)));
        }
    }
    assert!(
        !Path::new(&t.outside).exists(),
        "a file was planted outside"
    );
    assert_eq!(
        t.connections.load(Ordering::SeqCst),
        0,
        "a run reached the network"
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A proposal cannot plant its own results: whatever it leaves in its scratch directory as
/// `results.pt` (a link to a host file, or results that would pass every check) is never
/// read, since only the run's driver writes that file, after the proposal's process is gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_cannot_plant_its_results() {
    let (_dir, mut w) = worker().await;
    let t = Targets::new();
    let plant = |code: &str| t.source("_plant").replace("# @PLANT@", code);
    let link = plant("getattr(os, \"symlink\")(\"@CANARY@\", \"results.pt\")\nraise SystemExit(0)")
        .replace("@CANARY@", &t.canary);
    let v = w.judge(&link).await.unwrap();
    assert_eq!(reason(&v), "malformed_results: no results");
    let passing = plant(
        "_o = torch.ones(2)\n\
         torch.save({\"ys\": [_o * i for i in range(1, 6)], \"y1b\": _o, \"alt\": torch.ones(3), \
         \"yc\": _o, \"ms\": 5.0}, \"results.pt\")\nraise SystemExit(0)",
    );
    let v = w.judge(&passing).await.unwrap();
    assert_eq!(reason(&v), "malformed_results: no results");
    let mut s = String::new();
    std::fs::File::open(&t.canary)
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    assert_eq!(s, "secret");
}
