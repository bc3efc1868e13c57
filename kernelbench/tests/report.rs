//! The report's numbers on a small made-up result set, worked by hand.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kernelbench::report::{by_level, markdown, ResultRecord};

fn r(
    task: &str,
    level: u8,
    correct: bool,
    eager: Option<f64>,
    compile: Option<f64>,
) -> ResultRecord {
    let reward = if !correct {
        -1.0
    } else if eager.unwrap_or(0.0) > 1.0 / 0.95 {
        2.0
    } else {
        1.0
    };
    ResultRecord {
        task: task.into(),
        level,
        reward,
        correct,
        speedup_eager: eager,
        speedup_compile: compile,
        reason: None,
    }
}

#[test]
fn metrics_match_hand_computation() {
    let results = vec![
        r("L1/a", 1, true, Some(2.0), Some(1.0)),
        r("L1/b", 1, true, Some(0.5), Some(0.25)),
        r("L1/c", 1, false, None, None),
        r("L1/d", 1, true, Some(1.6), None),
        r("L2/a", 2, true, Some(4.0), Some(2.0)),
        r("L2/b", 2, false, None, None),
    ];
    let t = by_level(&results);
    let l1 = &t["level1"];
    assert_eq!(l1.tasks, 4);
    assert_eq!(l1.pass_rate, 0.75);
    assert_eq!(l1.faster_than_eager, 0.5); // a (2.0) and d (1.6)
    assert_eq!(l1.faster_than_compile, 0.0); // a is exactly 1.0, not faster
                                             // geomean of 2.0, 0.5, 1.6 = (1.6)^(1/3)
    assert!((l1.geomean_speedup_eager - 1.6f64.powf(1.0 / 3.0)).abs() < 1e-12);
    // geomean of 1.0 and 0.25 = 0.5
    assert!((l1.geomean_speedup_compile - 0.5).abs() < 1e-12);
    assert_eq!(l1.fast_p, vec![(1.0, 0.5), (1.5, 0.5), (2.0, 0.0)]);
    // rewards: 2, 1, -1, 2 -> 1.0
    assert_eq!(l1.mean_reward, 1.0);
    let all = &t["overall"];
    assert_eq!(all.tasks, 6);
    assert!((all.pass_rate - 4.0 / 6.0).abs() < 1e-12);
    assert_eq!(all.fast_p[2], (2.0, 1.0 / 6.0)); // only L2/a (4.0) is more than 2x
    let md = markdown(&t);
    let rows: Vec<&str> = md.lines().collect();
    assert_eq!(rows.len(), 5);
    assert!(
        rows[2].starts_with(
            "| level1 | 4 | 75.0% | 50.0% | 0.0% | 1.170x | 0.500x | 50.0% | 50.0% | 0.0% | 1.00 |"
        ),
        "{}",
        rows[2]
    );
    assert!(rows[4].starts_with("| overall | 6 |"), "{}", rows[4]);
}

#[test]
fn speedup_distribution_buckets_by_hand() {
    use kernelbench::report::speedup_distribution;
    let results = vec![
        r("L1/a", 1, true, Some(2.0), None), // on the 2.0 edge: >=2x
        r("L1/b", 1, true, Some(0.5), None), // on the 0.5 edge: 0.5-1x
        r("L1/c", 1, false, None, None),     // failed
        r("L1/d", 1, true, Some(1.2), None), // 1-1.5x
        r("L2/a", 2, true, Some(0.1), None), // <0.5x
        r("L2/b", 2, true, None, None),      // correct but untimed: failed
    ];
    let d = speedup_distribution(&results);
    assert_eq!(d.len(), 2);
    assert_eq!(d["level1"], [0.25, 0.0, 0.25, 0.25, 0.0, 0.25]);
    assert_eq!(d["level2"], [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]);
}

#[test]
fn report_command_prints_the_table_and_draws_the_chart() {
    let dir = tempfile::tempdir().unwrap();
    let results = dir.path().join("results.jsonl");
    let lines: Vec<String> = [
        r("L1/a", 1, true, Some(2.5), Some(1.2)),
        r("L1/b", 1, false, None, None),
        r("L2/a", 2, true, Some(0.8), Some(0.6)),
    ]
    .iter()
    .map(|x| serde_json::to_string(x).unwrap())
    .collect();
    std::fs::write(&results, lines.join("\n")).unwrap();
    let png = dir.path().join("speedup.png");
    let json = dir.path().join("report.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kernelbench"))
        .arg("report")
        .arg(&results)
        .arg("--png")
        .arg(&png)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("| level1 | 2 | 50.0% |")),
        "{table}"
    );
    assert!(
        table.lines().any(|l| l.starts_with("| overall | 3 |")),
        "{table}"
    );
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["level2"]["tasks"], 1);
}
