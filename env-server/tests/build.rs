//! The build toolchain against the real compiler and torch: precompiled torch headers are
//! made, checked with the compiler, used by a real candidate's build; an unchanged solution is
//! not built twice.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::{bytes_under, call, state_from, test_config};
use env_server::build::Pch;
use env_server::runtime::{Device, PythonInfo};
use env_server::ServerConfig;
use serde_json::json;

const ADD_CANDIDATE: &str = include_str!("../../tests/cpu_add_candidate.py");
/// The same add through `<torch/extension.h>`, the header the server precompiles.
const ADD_CANDIDATE_TORCH_HEADERS: &str =
    include_str!("../../tests/cpu_add_candidate_torch_headers.py");

fn variant(data_dir: &Path) -> Option<PathBuf> {
    let root = data_dir.join("pch");
    std::fs::read_dir(root).ok()?.flatten().find_map(|e| {
        let p = e.path().join("torch/extension.h.gch/O3.gch");
        p.is_file().then_some(p)
    })
}

#[tokio::test]
async fn precompiled_headers_are_checked_and_builds_use_them() {
    let dir = tempfile::tempdir().unwrap();
    // Made in this server's own data directory, not the suite's shared one.
    let s = state_from(ServerConfig {
        pch_variants: Some(vec!["-O3".into()]),
        pch_dir: None,
        ..test_config(dir.path())
    });
    assert_eq!(
        s.info.build.precompiled_headers.as_deref(),
        Some(&["-O3".to_string()][..])
    );

    // The server precompiles in the background; a core-minute on a small machine.
    let deadline = Instant::now() + Duration::from_secs(600);
    let made = loop {
        if let Some(p) = variant(dir.path()) {
            break p;
        }
        assert!(Instant::now() < deadline, "no precompiled header made");
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    // Read-only for everyone, and in the directory sandboxes read and none writes.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&made).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o444, "{made:?}");

    // The compiler uses it for `-O3` (and `-O2`: same macros) and rightly not for a build
    // without optimisation, whose predefined macros differ: that one parses the headers.
    let python = PythonInfo::probe(&common::python()).unwrap();
    let path = std::env::join_paths(python.path_dirs()).unwrap();
    let pch = Pch::layout(&dir.path().join("pch"), &python, Device::Cpu, &path, &[]).unwrap();
    assert!(pch.has("-O3"));
    // Checks overlapping in one process (the server checks each variant it makes while
    // callers may check it too) each see the header used: they once shared a probe file that
    // the first to finish removed or the next rewrote under the compiler reading it.
    let checks: Vec<_> = (0..3)
        .map(|i| {
            let (pch, path) = (pch.clone(), path.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(150 * i));
                pch.used_for("-O3", &path).unwrap()
            })
        })
        .collect();
    for c in checks {
        assert!(
            c.join().unwrap(),
            "an overlapping check did not see the header used"
        );
    }
    assert!(pch.used_for("-O2", &path).unwrap());
    assert!(!pch.used_for("", &path).unwrap());

    // A real C++ candidate builds with the headers on its CPATH and is judged correct.
    let solution = json!({"task": "L1/2_Add", "solution": ADD_CANDIDATE_TORCH_HEADERS});
    let (st, first) = call(&s, "POST", "/v1/evaluate", Some(solution.clone())).await;
    assert_eq!(st, StatusCode::OK, "{first}");
    assert_eq!(first["correct"], true, "{first}");
    assert_eq!(first["details"]["build_cache_hit"], false);
    let phases = &first["details"]["phases"];
    assert!(phases["build_s"].as_f64().unwrap() > 0.0, "{phases}");
    println!(
        "first build with the precompiled header: {} s",
        phases["build_s"]
    );

    // The same sources again: no build at all, the judged result as before.
    let (st, second) = call(&s, "POST", "/v1/evaluate", Some(solution)).await;
    assert_eq!(st, StatusCode::OK, "{second}");
    assert_eq!(second["correct"], true, "{second}");
    assert_eq!(second["details"]["build_cache_hit"], true);
    assert_eq!(second["details"]["phases"]["build_s"], 0.0);
    assert_eq!(second["details"]["phases"]["build_queue_s"], 0.0);

    // The attack: a candidate that works, and on import (in its build and in its run) tries to
    // forge the server's record of a finished build, to replace or add a precompiled header
    // every later build would read, and to write into other solutions' build entries.
    let gch_dir = made.parent().unwrap().to_path_buf();
    let before = std::fs::metadata(&made).unwrap();
    let entries_before: Vec<_> = std::fs::read_dir(dir.path().join("build-cache"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    let attacker = format!("{ATTACK}\n{ADD_CANDIDATE_TORCH_HEADERS}");
    let (st, third) = call(
        &s,
        "POST",
        "/v1/evaluate",
        Some(json!({"task": "L1/2_Add", "solution": attacker})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{third}");
    let log = third["details"]["worker_log"].as_str().unwrap_or("");
    assert!(log.contains("ATTEMPTS"), "the attack did not run: {third}");
    assert!(!log.contains("DONE"), "an attempt succeeded: {log}");
    let after = std::fs::metadata(&made).unwrap();
    assert_eq!(
        (before.len(), before.modified().unwrap()),
        (after.len(), after.modified().unwrap())
    );
    let variants: Vec<_> = std::fs::read_dir(&gch_dir).unwrap().flatten().collect();
    assert_eq!(variants.len(), 1, "{variants:?}");
    assert!(!dir.path().join("build-ok").join("f".repeat(32)).exists());
    for entry in entries_before {
        assert!(
            !entry.join("pwned").exists(),
            "wrote into {}",
            entry.display()
        );
    }
}

/// Prepended to a working candidate: every write it tries must fail.
const ATTACK: &str = r#"
import os, pathlib
_ext = pathlib.Path(os.environ.get("TORCH_EXTENSIONS_DIR", "/nonexistent"))
_data = _ext.parent.parent
_tried = {}
def _attempt(name, fn):
    try:
        fn()
        _tried[name] = "DONE"
    except Exception as e:
        _tried[name] = type(e).__name__
def _mark():
    (_data / "build-ok").mkdir(exist_ok=True)
    (_data / "build-ok" / ("f" * 32)).write_text('{"built": true}')
def _each(pattern, act):
    found = list(_data.glob(pattern))
    if not found:
        raise FileNotFoundError(pattern)
    for p in found:
        act(p)
_attempt("mark", _mark)
_attempt("pch_replace", lambda: _each("pch/*/torch/extension.h.gch/*.gch", lambda p: p.write_bytes(b"x")))
_attempt("pch_add", lambda: _each("pch/*/torch/extension.h.gch", lambda p: (p / "a.gch").write_bytes(b"x")))
_attempt("pch_link", lambda: _each("pch/*/torch", lambda p: os.replace(p / "extension.h", p / "x")))
def _siblings():
    others = [p for p in _data.glob("build-cache/*") if p != _ext]
    if not others:
        raise FileNotFoundError("no other entry visible")
    for p in others:
        (p / "pwned").write_text("x")
_attempt("siblings", _siblings)
print("ATTEMPTS", _tried, flush=True)
"#;

/// The same sources submitted twice at once (an RL batch often samples one kernel twice): one
/// build, and both evaluations judged. The build-cache entry used to be handed to the second
/// evaluation's uid while the first's worker was loading from it: torch's lock file could not
/// be created and a correct candidate got a compile error.
#[tokio::test]
async fn identical_sources_submitted_together_are_both_judged() {
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(test_config(dir.path()));
    let body = json!({"task": "L1/2_Add", "solution": ADD_CANDIDATE});
    let (a, b) = tokio::join!(
        call(&s, "POST", "/v1/evaluate", Some(body.clone())),
        call(&s, "POST", "/v1/evaluate", Some(body)),
    );
    let mut hits = Vec::new();
    for (st, r) in [&a, &b] {
        assert_eq!(*st, StatusCode::OK, "{r}");
        assert_eq!(r["correct"], true, "{r}");
        hits.push(r["details"]["build_cache_hit"].as_bool().unwrap());
    }
    hits.sort();
    assert_eq!(hits, [false, true], "one build, one cache hit");
}

/// A build is background work, the evaluation's run is not: a candidate reports the nice value
/// its import sees, in the build (where it fails the build on purpose, so the reason carries
/// it) and in the worker that runs it (its log).
#[tokio::test]
async fn builds_run_in_the_background_and_the_run_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(test_config(dir.path()));
    let report = "import os, sys\nNICE = os.getpriority(os.PRIO_PROCESS, 0)\n";
    let in_build = format!(
        "{report}if 'build' in sys.argv:\n    raise RuntimeError(f'NICE {{NICE}} in the build')\n"
    );
    let (st, built) = call(
        &s,
        "POST",
        "/v1/evaluate",
        Some(json!({"task": "L1/2_Add", "solution": in_build})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{built}");
    let reason = built["reason"].as_str().unwrap_or("");
    assert!(reason.contains("NICE 10 in the build"), "{built}");

    let in_run = format!("{report}print(f'NICE {{NICE}} in the run', flush=True)\n{ADD_CANDIDATE}");
    let (st, ran) = call(
        &s,
        "POST",
        "/v1/evaluate",
        Some(json!({"task": "L1/2_Add", "solution": in_run})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{ran}");
    let log = ran["details"]["worker_log"].as_str().unwrap_or("");
    assert!(log.contains("NICE 0 in the run"), "{ran}");
    assert_eq!(ran["correct"], true, "{ran}");
}

/// The attack on the build cache's key: names and contents used to be joined with NUL, which
/// a file may hold, so a two-file solution whose kernel file spells out a second file's name
/// and text had the key of a different three-file solution, and the second was handed the
/// first's build (its report, and whatever the first planted in the entry). Each must get its
/// own entry: the second is built, not a cache hit.
#[tokio::test]
async fn solutions_whose_joined_files_are_equal_get_distinct_build_entries() {
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(test_config(dir.path()));
    // Builds at once (nothing to compile); the judge's verdict does not matter here.
    let model = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, a, b):\n        return a + b\n";
    let two = json!({"task": "L1/2_Add", "solution": {"files": {
        "model_new.py": model,
        "kernels/a.txt": "P\u{0}kernels/b.txt\u{0}Q",
    }}});
    let three = json!({"task": "L1/2_Add", "solution": {"files": {
        "model_new.py": model,
        "kernels/a.txt": "P",
        "kernels/b.txt": "Q",
    }}});
    let (st, first) = call(&s, "POST", "/v1/evaluate", Some(two)).await;
    assert_eq!(st, StatusCode::OK, "{first}");
    assert_eq!(first["details"]["build_cache_hit"], false, "{first}");
    assert_eq!(first["details"]["build"]["built"], true, "{first}");
    let (st, second) = call(&s, "POST", "/v1/evaluate", Some(three)).await;
    assert_eq!(st, StatusCode::OK, "{second}");
    assert_eq!(
        second["details"]["build_cache_hit"], false,
        "the three-file solution was given the two-file one's build: {second}"
    );
    let entries = std::fs::read_dir(dir.path().join("build-cache"))
        .unwrap()
        .count();
    assert_eq!(entries, 2, "one build-cache entry per solution");
}

/// A candidate that writes `mib` MiB into its build-cache entry on import, in the build
/// (`when = "build"`) or in the run (`when = "run"`), and then fails its build or not.
fn filler(tag: usize, mib: usize, when: &str, fail_build: bool) -> String {
    format!(
        "import os, sys\n\
         # {tag}\n\
         _in_build = 'build' in sys.argv\n\
         if _in_build == ({when:?} == 'build'):\n\
         \x20   with open(os.path.join(os.environ['TORCH_EXTENSIONS_DIR'], 'fill'), 'wb') as f:\n\
         \x20       f.write(b'x' * ({mib} << 20))\n\
         if _in_build and {fail_build}:\n\
         \x20   raise RuntimeError('this build fails')\n\
         import torch\n\
         class ModelNew(torch.nn.Module):\n\
         \x20   def forward(self, a, b):\n\
         \x20       return a + b\n",
        fail_build = if fail_build { "True" } else { "False" },
    )
}

/// The build cache's bounds under attack: a flood of evaluations, each leaving 1.5 MiB in its
/// entry, used to stay on disk past the cache's bound (retention spares entries used in the
/// last two evaluation timeouts); an entry over its own cap, written in the build or in the
/// run, used to stay too. The cache is back under its bound once the flood is over, and an
/// entry over its cap fails its evaluation (`build_size`) and is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_build_cache_holds_its_bounds_under_a_flood() {
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(ServerConfig {
        build_cache_max_bytes: 4 << 20,
        build_cache_entry_max_bytes: 2 << 20,
        max_body_bytes: 1 << 20,
        ..test_config(dir.path())
    });
    let cache = dir.path().join("build-cache");
    let flood: Vec<_> = (0..8)
        .map(|i| {
            let s = s.clone();
            let body = json!({"task": "L1/2_Add", "solution": filler(i, 1, "build", true)});
            tokio::spawn(async move { call(&s, "POST", "/v1/evaluate", Some(body)).await })
        })
        .collect();
    for f in flood {
        let (st, v) = f.await.unwrap();
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["details"]["build"]["built"], false, "{v}");
    }
    let left = bytes_under(&cache);
    assert!(left <= 4 << 20, "{left} bytes left in the build cache");

    for when in ["build", "run"] {
        let body = json!({"task": "L1/2_Add", "solution": filler(100, 3, when, false)});
        let (st, v) = call(&s, "POST", "/v1/evaluate", Some(body)).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["correct"], false, "{v}");
        assert!(
            v["reason"].as_str().unwrap_or("").starts_with("build_size"),
            "a {when} over the entry's cap: {v}"
        );
        let big: Vec<_> = walkdir::WalkDir::new(&cache)
            .into_iter()
            .flatten()
            .filter(|e| e.file_name() == "fill")
            .filter(|e| e.metadata().is_ok_and(|m| m.len() > 2 << 20))
            .map(|e| e.path().to_path_buf())
            .collect();
        assert!(big.is_empty(), "an entry over its cap was kept: {big:?}");
    }
}
