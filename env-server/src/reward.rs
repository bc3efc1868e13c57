//! The milestone reward of the CUDA Agent recipe.

/// `b(t, t') = (t' - t) / t' > 0.05`: the candidate is more than 5% faster than a baseline.
pub fn beats(candidate_ms: f64, baseline_ms: f64) -> bool {
    baseline_ms > 0.0 && (baseline_ms - candidate_ms) / baseline_ms > 0.05
}

/// -1 for a failure or a rule break, 1 for correct, 2 for >5% faster than eager, 3 for >5%
/// faster than both eager and torch.compile. A missing time counts as not beaten.
pub fn milestone(correct: bool, candidate_ms: Option<f64>, eager_ms: Option<f64>, compile_ms: Option<f64>) -> f64 {
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
}
