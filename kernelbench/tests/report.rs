//! The report's numbers on a small made-up result set, worked by hand.

use kernelbench::report::{by_level, markdown, ResultRecord};

fn r(task: &str, level: u8, correct: bool, eager: Option<f64>, compile: Option<f64>) -> ResultRecord {
    let reward = if !correct { -1.0 } else if eager.unwrap_or(0.0) > 1.0 / 0.95 { 2.0 } else { 1.0 };
    ResultRecord { task: task.into(), level, reward, correct, speedup_eager: eager, speedup_compile: compile, reason: None }
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
    assert!(rows[2].starts_with("| level1 | 4 | 75.0% | 50.0% | 0.0% | 1.170x | 0.500x | 50.0% | 50.0% | 0.0% | 1.00 |"), "{}", rows[2]);
    assert!(rows[4].starts_with("| overall | 6 |"), "{}", rows[4]);
}
