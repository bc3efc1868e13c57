//! Evaluations write only to a volume of their own with size and inode limits: a candidate
//! that floods its disk in its build or its run fails (`disk_quota`), a burst of evaluations
//! cannot push the build cache past its bound at any moment, and a legitimate `load_inline`
//! candidate still builds once, is cached, and is reused without a rebuild.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::{bytes_under, call, state_from, test_config};
use env_server::ServerConfig;
use serde_json::json;

const ADD_CANDIDATE: &str = include_str!("../../tests/cpu_add_candidate.py");

/// Waits until nothing is left under `dir` (its removal runs after the answer); what is left.
async fn settled(dir: &Path) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = bytes_under(dir);
        if left == 0 || Instant::now() > deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The start of a candidate whose import writes `count` files of `kib` KiB into `target`
/// (`TMPDIR` or `TORCH_EXTENSIONS_DIR`), in the build (`when = "build"`), the run (`"run"`) or
/// both (`"both"`; the run's files are new ones). `tag` makes each its own solution.
fn flooder(tag: &str, target: &str, count: usize, kib: usize, when: &str) -> String {
    format!(
        "import os, sys\n\
         # {tag}\n\
         _in_build = 'build' in sys.argv\n\
         if {when:?} == 'both' or _in_build == ({when:?} == 'build'):\n\
         \x20   for _i in range({count}):\n\
         \x20       _name = ('build' if _in_build else 'run') + str(_i)\n\
         \x20       with open(os.path.join(os.environ[{target:?}], _name), 'wb') as _f:\n\
         \x20           for _ in range({kib} // 64):\n\
         \x20               _f.write(b'x' * 65536)\n"
    )
}

/// An add in PyTorch (judged `pytorch_compute`; enough where only the build cache matters).
const PLAIN_ADD: &str = "import torch\n\
                         class ModelNew(torch.nn.Module):\n\
                         \x20   def forward(self, a, b):\n\
                         \x20       return a + b\n";

/// The attack: a candidate writing 3 x 100 MiB at import, into its temp dir or its build
/// directory, in its build or in its run, or 100,000 empty files. Its evaluation may hold
/// 32 MiB and 65,536 files: each is failed for the disk limit (or the file-count limit), and neither the build cache nor anything else of the evaluation is
/// left on the host. Each is a working extension after its flood: without the volume the
/// temp-dir flood and the file flood were judged correct (reward 1 or more, their 300 MiB or
/// 100,000 files on the host's disk while they ran), and the build-directory floods failed
/// only after the fact, as `build_size`, with their 300 MiB written into the cache's
/// directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_that_floods_its_disk_fails_for_the_disk_limit() {
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(ServerConfig {
        eval_disk_quota_bytes: 32 << 20,
        build_cache_max_bytes: 4 << 20,
        build_cache_entry_max_bytes: 2 << 20,
        max_body_bytes: 1 << 20,
        ..test_config(dir.path())
    });
    let info = &s.info.capacity.evaluation_volume;
    assert_eq!(info.bytes, 32 << 20);
    for (target, when) in [
        ("TMPDIR", "both"),
        ("TORCH_EXTENSIONS_DIR", "build"),
        ("TORCH_EXTENSIONS_DIR", "run"),
    ] {
        let solution = format!(
            "{}{ADD_CANDIDATE}",
            flooder(&format!("{target} {when}"), target, 3, 100 << 10, when)
        );
        let (st, v) = call(
            &s,
            "POST",
            "/v1/evaluate",
            Some(json!({"task": "L1/2_Add", "solution": solution})),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["correct"], false, "{target} in the {when}: {v}");
        assert_eq!(v["reward"], -1.0, "{v}");
        let reason = v["reason"].as_str().unwrap_or("");
        assert!(
            reason.starts_with("disk_quota") && reason.contains("disk limit"),
            "{target} in the {when}: {v}"
        );
        let cache = bytes_under(&dir.path().join("build-cache"));
        assert!(cache <= 2 << 20, "{cache} bytes in the build cache");
    }
    // The same with files: more than the volume's 65,536 inodes, empty, in the temp dir.
    let many = format!(
        "import os\n\
         for _i in range(100_000):\n\
         \x20   open(os.path.join(os.environ['TMPDIR'], str(_i)), 'w').close()\n\
         {ADD_CANDIDATE}"
    );
    let (st, v) = call(
        &s,
        "POST",
        "/v1/evaluate",
        Some(json!({"task": "L1/2_Add", "solution": many})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["correct"], false, "{v}");
    let reason = v["reason"].as_str().unwrap_or("");
    assert!(reason.starts_with("inode_quota"), "{v}");
    for sub in ["eval-volumes", "evals"] {
        let left = settled(&dir.path().join(sub)).await;
        assert_eq!(left, 0, "{left} bytes left in {sub}/");
    }
}

/// The attack as a burst: six evaluations at once, each leaving 2.5 MiB in its build
/// directory in its build (under the 3 MiB entry cap: admitted) and writing 2.5 MiB more there
/// in its run, against a 4 MiB cache. The cache is measured all through the burst and never
/// holds more than its bound. Before, entries of evaluations in flight were spared by the
/// pruning and written by their runs, so the cache held several times its bound until the
/// burst was over. The evaluations' volumes reserve 2 x 32 MiB of a 64 MiB budget: the
/// others wait for room, and all are judged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_evaluations_cannot_push_the_build_cache_past_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(ServerConfig {
        eval_disk_quota_bytes: 32 << 20,
        eval_volume_memory_bytes: Some(64 << 20),
        build_cache_max_bytes: 4 << 20,
        build_cache_entry_max_bytes: 3 << 20,
        max_body_bytes: 1 << 20,
        ..test_config(dir.path())
    });
    assert_eq!(
        s.info.capacity.evaluation_volume.memory_budget_bytes,
        Some(64 << 20)
    );
    let cache = dir.path().join("build-cache");
    let (done, peak) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let sampler = {
        let (done, peak, cache) = (done.clone(), peak.clone(), cache.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(bytes_under(&cache), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let burst: Vec<_> = (0..6)
        .map(|i| {
            let s = s.clone();
            // 2.5 MiB in the build and 2.5 MiB more in the run: two files of 1.25 MiB each.
            let solution = format!(
                "{}{PLAIN_ADD}",
                flooder(
                    &format!("burst {i}"),
                    "TORCH_EXTENSIONS_DIR",
                    2,
                    1280,
                    "both"
                )
            );
            let body = json!({"task": "L1/2_Add", "solution": solution});
            tokio::spawn(async move { call(&s, "POST", "/v1/evaluate", Some(body)).await })
        })
        .collect();
    for b in burst {
        let (st, v) = b.await.unwrap();
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["details"]["build"]["built"], true, "{v}");
    }
    done.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let peak = peak.load(Ordering::Relaxed);
    assert!(peak > 0, "nothing was ever cached");
    assert!(
        peak <= 4 << 20,
        "the build cache held {peak} bytes during the burst"
    );
    let left = settled(&dir.path().join("eval-volumes")).await;
    assert_eq!(left, 0, "{left} bytes left on evaluation volumes");
}

/// A legitimate `load_inline` C++ candidate: built once, its build cached (the server's own
/// entry, out of the candidate's reach), and the second evaluation of the same sources copies
/// it onto its volume and loads it without a rebuild (the library it loads is the very one the
/// first build made, to the nanosecond), judged correct both times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_legitimate_extension_is_built_cached_and_reused() {
    let dir = tempfile::tempdir().unwrap();
    let s = state_from(test_config(dir.path()));
    let solution = format!(
        "{ADD_CANDIDATE}\nimport os as _os\nprint('LIBRARY', _os.stat(ext.__file__).st_mtime_ns, flush=True)\n"
    );
    let body = json!({"task": "L1/2_Add", "solution": solution});
    let mut libraries = Vec::new();
    for hit in [false, true] {
        let (st, v) = call(&s, "POST", "/v1/evaluate", Some(body.clone())).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["correct"], true, "{v}");
        assert!(v["reward"].as_f64().unwrap() >= 1.0, "{v}");
        assert_eq!(v["details"]["build_cache_hit"], hit, "{v}");
        println!(
            "cache hit {hit}: {} s in all, phases {}",
            v["details"]["elapsed_s"], v["details"]["phases"]
        );
        let log = v["details"]["worker_log"].as_str().unwrap_or("");
        let library = log
            .lines()
            .find_map(|l| l.strip_prefix("LIBRARY "))
            .unwrap_or_else(|| panic!("no library reported: {v}"))
            .to_string();
        libraries.push(library);
    }
    assert_eq!(
        libraries[0], libraries[1],
        "the run rebuilt the cached extension"
    );
    // The entry is the server's: root's, private, and not on any evaluation's volume.
    let entries: Vec<_> = std::fs::read_dir(dir.path().join("build-cache"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(entries[0].path()).unwrap();
    // SAFETY: geteuid only reads the calling process's id.
    assert_eq!(m.uid(), unsafe { libc::geteuid() });
    assert_eq!(m.mode() & 0o777, 0o700);
}
