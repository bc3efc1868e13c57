//! `kernelbench replay` against the real server: solutions found, missing and broken ones
//! counted as failures, the report printed, and a second run resumes without re-evaluating.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod server;

use std::process::Command;

use server::{binary_of, Server};

const ADD: &str = include_str!("cpu_add_candidate.py");

#[test]
fn replay_scores_a_solutions_dir_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &["--skip-compile"]);
    let solutions = dir.path().join("solutions");
    std::fs::create_dir_all(solutions.join("L1")).unwrap();
    std::fs::write(solutions.join("L1_2_Add.py"), ADD).unwrap();
    std::fs::write(solutions.join("L1/1_ReLU.py"), "this is not python\n").unwrap();
    let out = dir.path().join("results.jsonl");
    let bin = binary_of("kernelbench", "kernelbench");
    let run = || {
        let o = Command::new(&bin)
            .args([
                "replay",
                "--server",
                &server.url,
                "--split",
                "level1",
                "--jobs",
                "2",
                "--solutions",
            ])
            .arg(&solutions)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let listed = Command::new(&bin)
        .args(["list", "--split", "level1"])
        .output()
        .unwrap();
    let n = String::from_utf8_lossy(&listed.stdout).lines().count();
    assert!(n >= 5, "{n}");
    let report = run();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), n, "every level-1 task has a result");
    let by_task = |id: &str| lines.iter().find(|r| r["task"] == id).unwrap().clone();
    assert_eq!(by_task("L1/2_Add")["correct"], true, "{lines:?}");
    assert!(by_task("L1/1_ReLU")["reason"]
        .as_str()
        .unwrap()
        .starts_with("compile:"));
    assert!(by_task("L1/3_Matmul")["reason"]
        .as_str()
        .unwrap()
        .starts_with("missing_solution"));
    let pass = format!("{:.1}%", 100.0 / n as f64);
    assert!(
        report.contains(&format!("| level1 | {n} | {pass} |")),
        "{report}"
    );
    assert!(
        report.contains(&format!("| overall | {n} | {pass} |")),
        "{report}"
    );
    // Resume: nothing left to do, nothing evaluated again, the same report.
    let again = run();
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), n);
    assert_eq!(again, report);
}
