//! The milestone reward of the CUDA Agent recipe.

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
        details: serde_json::json!({"task": task_id, "kind": "recall"}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
