//! `kernelbench synth` on CPU with real torch: 20 tasks, the filters' verdicts checked (a
//! planted non-deterministic op and a constant-output composition are rejected), the output
//! loadable as a task directory, and a rerun appending without duplicates. (Each task costs a
//! trace and a timing; the checks below need no more than 20.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use kernelbench::TaskSet;

mod common;

#[test]
fn synth_tasks_on_cpu() {
    let python = common::python();
    let out = tempfile::tempdir().unwrap();
    let run = |count: &str, seed: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_kernelbench"))
            .args(["synth", "--count", count, "--seed", seed])
            .args(common::CPU_FILTERS)
            .args(["--plant-bad", "--python", &python, "--out"])
            .arg(out.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let summary = run("20", "7");
    let seeds: usize = summary
        .lines()
        .next()
        .unwrap()
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(seeds >= 200, "{summary}");
    assert!(summary.contains("accepted 20 of"), "{summary}");
    let manifest: Vec<serde_json::Value> =
        std::fs::read_to_string(out.path().join("manifest.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    let planted = |kind: &str| {
        manifest
            .iter()
            .find(|r| r["planted"] == kind)
            .unwrap()
            .clone()
    };
    assert_eq!(planted("nondeterministic")["reason"], "nondeterministic");
    assert_eq!(planted("constant")["reason"], "constant_output");
    let accepted: Vec<&serde_json::Value> = manifest
        .iter()
        .filter(|r| r["verdict"] == "accepted")
        .collect();
    assert_eq!(accepted.len(), 20);
    for r in &accepted {
        let ops = r["ops"].as_array().unwrap();
        assert!((3..=5).contains(&ops.len()), "{r}");
        assert!(
            ["serial", "parallel", "residual"].contains(&r["pattern"].as_str().unwrap()),
            "{r}"
        );
    }
    let hashes: std::collections::BTreeSet<&str> = manifest
        .iter()
        .map(|r| r["hash"].as_str().unwrap())
        .collect();
    assert_eq!(hashes.len(), manifest.len(), "deduplicated by hash");
    let tasks = TaskSet::load_dir(out.path()).unwrap();
    assert_eq!(tasks.split("level2").len(), 20);
    // A rerun with another seed appends and never repeats a task.
    run("5", "8");
    let tasks = TaskSet::load_dir(out.path()).unwrap();
    assert_eq!(tasks.split("level2").len(), 25);
}
