//! The milestone reward of the CUDA Agent recipe.

use env_api::{EvaluationDetails, EvaluationResult, Speedups, Times};

/// The reward of an evaluation that failed or broke a rule.
pub const FAILURE: f64 = -1.0;

/// An evaluation that ended without a verdict of the judge's, or with a failing one: reward
/// [`FAILURE`], not correct, no times, `reason` naming the rule (`bad_solution: ...`).
pub fn failed(reason: String, details: EvaluationDetails) -> EvaluationResult {
    EvaluationResult {
        reward: FAILURE,
        correct: false,
        reason: Some(reason),
        times_ms: Times::default(),
        speedup: Speedups::default(),
        details,
    }
}

/// `b(t, t') = (t' - t) / t' > 0.05`: the candidate is more than 5% faster than a baseline.
pub fn beats(candidate_ms: f64, baseline_ms: f64) -> bool {
    baseline_ms > 0.0 && (baseline_ms - candidate_ms) / baseline_ms > 0.05
}

/// -1 for a failure or a rule break, 1 for correct, 2 for >5% faster than eager, 3 for >5%
/// faster than both eager and torch.compile. A missing time counts as not beaten.
pub fn milestone(
    correct: bool,
    candidate_ms: Option<f64>,
    eager_ms: Option<f64>,
    compile_ms: Option<f64>,
) -> f64 {
    if !correct {
        return -1.0;
    }
    let Some(t) = candidate_ms else { return 1.0 };
    let faster_eager = eager_ms.is_some_and(|e| beats(t, e));
    let faster_compile = compile_ms.is_some_and(|c| beats(t, c));
    match (faster_eager, faster_compile) {
        (true, true) => 3.0,
        (true, false) => 2.0,
        _ => 1.0,
    }
}

/// Characters of the candidate worker's output shown after a crash.
const WORKER_LOG_CHARS: usize = 2_000;

/// The final evaluation as the agent reads it: the reward and what it means, the verdict (the
/// reason, as the judge wrote it, for a failure), the median times and speedups with their
/// noise bands. After a crash or a hang, the tail of the candidate worker's own output follows
/// (a Python traceback from faulthandler): the worker's words are shown as diagnostics only,
/// never read for the verdict.
pub fn describe(result: &env_api::EvaluationResult) -> String {
    let mut out = format!("Evaluation: reward {}", result.reward);
    if !result.correct {
        out.push_str(
            " (failed)
",
        );
        out.push_str(result.reason.as_deref().unwrap_or("evaluation failed"));
        let rule = result.details.rule.as_deref();
        let crashed = matches!(rule, Some("worker_died" | "time_limit" | "runtime_error"));
        if let Some(log) = result.details.worker_log.as_deref() {
            let log = log.trim();
            if crashed && !log.is_empty() {
                let start = log
                    .char_indices()
                    .rev()
                    .nth(WORKER_LOG_CHARS)
                    .map_or(0, |(i, _)| i);
                out.push_str(&format!(
                    "\n--- the candidate worker's output (last lines; a crash's Python traceback is here) ---\n{}",
                    &log[start..]
                ));
            }
        }
        return out;
    }
    let what = match result.reward as i64 {
        3 => "correct, and more than 5% faster than eager and than torch.compile",
        2 => "correct, and more than 5% faster than eager (not than torch.compile)",
        _ => "correct, not more than 5% faster than eager",
    };
    out.push_str(&format!(" ({what})"));
    let t = &result.times_ms;
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4} ms"));
    out.push_str(&format!(
        "\nmedian times: candidate {}, eager {}, torch.compile {}",
        ms(t.candidate),
        ms(t.eager),
        ms(t.compile)
    ));
    let band = |base: &str| {
        result
            .details
            .noise_band
            .get(base)
            .map(|&[low, high]| (low, high))
    };
    let mut speedups = Vec::new();
    for (name, key, v) in [
        ("eager", "eager", result.speedup.eager),
        ("torch.compile", "compile", result.speedup.compile),
    ] {
        if let Some(v) = v {
            let mut s = format!("{v:.3}x over {name}");
            if let Some((lo, hi)) = band(key) {
                s.push_str(&format!(" (90% band {lo:.3}-{hi:.3})"));
            }
            speedups.push(s);
        }
    }
    if !speedups.is_empty() {
        out.push_str(&format!("\nspeedup: {}", speedups.join(", ")));
    }
    out
}

/// The verdict on a tiny-family task: the file must hold exactly `value` (whitespace around
/// it ignored). Same reward shape as a kernel task: -1 on failure, 1 when correct (no speed
/// milestones: there is nothing to time).
pub fn judge_recall(
    task_id: &str,
    file: &str,
    value: &str,
    files: &std::collections::BTreeMap<String, String>,
) -> env_api::EvaluationResult {
    let (correct, reason) = match files.get(file) {
        None => (
            false,
            Some(format!("missing_solution: {file} was not written")),
        ),
        Some(t) if t.trim() == value => (true, None),
        Some(t) => {
            let shown: String = t.trim().chars().take(80).collect();
            (
                false,
                Some(format!(
                    "wrong_output: {file} holds {shown:?}, expected the task's word"
                )),
            )
        }
    };
    env_api::EvaluationResult {
        reward: milestone(correct, None, None, None),
        correct,
        reason,
        times_ms: Default::default(),
        speedup: Default::default(),
        details: EvaluationDetails {
            task: task_id.to_string(),
            kind: Some("recall".into()),
            ..EvaluationDetails::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failed evaluation pays the failure reward and keeps its reason and details.
    #[test]
    fn failures_pay_the_failure_reward() {
        let details = EvaluationDetails {
            task: "L1/2_Add".into(),
            server_error: true,
            ..EvaluationDetails::default()
        };
        let r = failed("evaluation_error: gone".into(), details.clone());
        assert_eq!(r.reward, FAILURE);
        assert!(!r.correct);
        assert_eq!(r.reason.as_deref(), Some("evaluation_error: gone"));
        assert_eq!(r.details, details);
    }

    /// Rewards are decided here alone: no other source file of the server writes a reward
    /// literal into a result.
    #[test]
    fn no_other_file_writes_a_reward() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut stack = vec![src];
        let mut offenders = Vec::new();
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).expect("the source directory") {
                let path = entry.expect("an entry").path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs")
                    && !path.ends_with("reward.rs")
                {
                    let text = std::fs::read_to_string(&path).expect("a source file");
                    for (i, line) in text.lines().enumerate() {
                        let t = line.trim_start();
                        let literal = t.strip_prefix("reward: ").is_some_and(|rest| {
                            rest.starts_with(|c: char| c.is_ascii_digit() || c == '-')
                        });
                        if literal {
                            offenders.push(format!("{}:{}", path.display(), i + 1));
                        }
                    }
                }
            }
        }
        assert!(
            offenders.is_empty(),
            "reward literals outside reward.rs: {offenders:?}"
        );
    }

    #[test]
    fn milestones() {
        assert_eq!(milestone(false, Some(1.0), Some(10.0), Some(10.0)), -1.0);
        assert_eq!(milestone(true, Some(1.0), Some(1.0), Some(1.0)), 1.0);
        // 4.9% faster is not more than 5%.
        assert_eq!(milestone(true, Some(0.951), Some(1.0), Some(1.0)), 1.0);
        assert_eq!(milestone(true, Some(0.94), Some(1.0), Some(0.5)), 2.0);
        assert_eq!(milestone(true, Some(0.94), Some(1.0), Some(1.0)), 3.0);
        // Faster than compile alone is not a milestone: eager comes first.
        assert_eq!(milestone(true, Some(0.94), Some(0.5), Some(1.0)), 1.0);
        assert_eq!(milestone(true, Some(0.5), Some(1.0), None), 2.0);
        assert_eq!(milestone(true, None, Some(1.0), Some(1.0)), 1.0);
    }

    #[test]
    fn results_read_as_text() {
        let ok = env_api::EvaluationResult {
            reward: 2.0,
            correct: true,
            reason: None,
            times_ms: env_api::Times {
                eager: Some(2.0),
                compile: Some(0.5),
                candidate: Some(1.0),
            },
            speedup: env_api::Speedups {
                eager: Some(2.0),
                compile: Some(0.5),
            },
            details: EvaluationDetails {
                noise_band: [("eager".to_string(), [1.9, 2.1])].into(),
                ..EvaluationDetails::default()
            },
        };
        assert_eq!(
            describe(&ok),
            "Evaluation: reward 2 (correct, and more than 5% faster than eager (not than torch.compile))\n\
             median times: candidate 1.0000 ms, eager 2.0000 ms, torch.compile 0.5000 ms\n\
             speedup: 2.000x over eager (90% band 1.900-2.100), 0.500x over torch.compile"
        );
        let crashed = env_api::EvaluationResult {
            reward: -1.0,
            correct: false,
            reason: Some("worker_died: the candidate worker died during check (run)".into()),
            times_ms: Default::default(),
            speedup: Default::default(),
            details: EvaluationDetails {
                rule: Some("worker_died".into()),
                worker_log: Some(
                    "Fatal Python error: Segmentation fault\n  File \"model_new.py\", line 8 in forward"
                        .into(),
                ),
                ..EvaluationDetails::default()
            },
        };
        let text = describe(&crashed);
        assert!(
            text.starts_with("Evaluation: reward -1 (failed)\nworker_died: "),
            "{text}"
        );
        assert!(text.contains("line 8 in forward"), "{text}");
    }

    #[test]
    fn recall_verdicts() {
        let files =
            |t: &str| std::collections::BTreeMap::from([("answer.txt".to_string(), t.to_string())]);
        assert_eq!(
            judge_recall("tiny/1_blue", "answer.txt", "blue", &files(" blue\n")).reward,
            1.0
        );
        let wrong = judge_recall("tiny/1_blue", "answer.txt", "blue", &files("red"));
        assert_eq!((wrong.reward, wrong.correct), (-1.0, false));
        assert!(wrong.reason.unwrap().starts_with("wrong_output"));
        let missing = judge_recall("tiny/1_blue", "answer.txt", "blue", &Default::default());
        assert!(missing.reason.unwrap().starts_with("missing_solution"));
    }
}
