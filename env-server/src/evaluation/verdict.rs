//! The verdict: the judge's one JSON line, what the server observed of the workers from
//! outside (the CPU's `pytorch_compute` rule), and the evaluation's result from both.

use std::collections::BTreeMap;
use std::path::Path;

use agent_tools::sandbox::Outcome;
use env_api::{EvaluationDetails, EvaluationResult, Speedups, Times};
use serde_json::Value;

use super::process::{describe_exit, tail};
use super::{EvalError, Evaluator};
use crate::reward::milestone;
use crate::runtime::Device;

impl Evaluator {
    /// The result of a judged run: a harness error is the server's; a build directory grown
    /// past an entry's cap in the run, an incorrect verdict or (on the CPU) an observation that breaks
    /// `pytorch_compute` fail it; else the milestone reward of its times.
    pub(super) async fn decide(
        &self,
        verdict: Verdict,
        observed: Option<Observed>,
        mut details: EvaluationDetails,
        ext: &Path,
    ) -> Result<EvaluationResult, EvalError> {
        let fail = crate::reward::failed;
        if verdict.rule.as_deref() == Some("harness_error") {
            return Err(EvalError::Harness(verdict.reason.unwrap_or_default()));
        }
        details.check = verdict.details.clone();
        details.timing = verdict.timing.clone();
        details.noise_band = verdict.noise_band.clone();
        details.env = verdict.env.clone();
        // The worker may write into its build directory too (at import, in the run); a full
        // volume (the run was ended for it) says more than the directory's size.
        let volume_full = matches!(verdict.rule.as_deref(), Some("disk_quota" | "inode_quota"));
        if !volume_full {
            if let Some(reason) = self.entry_over_cap(ext, "run").await {
                details.rule = Some("build_size".into());
                return Ok(fail(reason, details));
            }
        }
        if !verdict.correct {
            details.rule = verdict.rule.clone();
            let reason = verdict.reason.unwrap_or_else(|| "evaluation failed".into());
            return Ok(fail(reason, details));
        }
        if let Some(observed) = observed {
            let (summary, broken) = observed.judge(
                verdict.run_windows.as_ref(),
                !self.cfg.allow_ops.is_empty() || !verdict.allowed_ops.is_empty(),
                self.cfg.device,
            );
            details.observed = Some(summary);
            if let Some(reason) = broken {
                details.rule = Some("pytorch_compute".into());
                return Ok(fail(format!("pytorch_compute: {reason}"), details));
            }
        }
        let times = verdict.times_ms.unwrap_or_default();
        let ratio = |b: Option<f64>| match (b, times.candidate) {
            (Some(b), Some(t)) if t > 0.0 => Some(b / t),
            _ => None,
        };
        Ok(EvaluationResult {
            reward: milestone(true, times.candidate, times.eager, times.compile),
            correct: true,
            reason: None,
            times_ms: Times {
                eager: times.eager,
                compile: times.compile,
                candidate: times.candidate,
            },
            speedup: Speedups {
                eager: ratio(times.eager),
                compile: ratio(times.compile),
            },
            details,
        })
    }
}

/// The judge's verdict (evaluate.py's one JSON line).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub(super) struct Verdict {
    correct: bool,
    #[serde(default)]
    rule: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    times_ms: Option<VerdictTimes>,
    #[serde(default)]
    noise_band: BTreeMap<String, [f64; 2]>,
    #[serde(default)]
    timing: Option<Value>,
    #[serde(default)]
    details: Option<Value>,
    #[serde(default)]
    env: Option<Value>,
    #[serde(default)]
    run_windows: Option<RunWindows>,
    /// Aten operators the task itself allows (its `ALLOW_OPS`), as the judge read them.
    #[serde(default)]
    allowed_ops: Vec<String>,
}

/// When each worker ran a forward, in `CLOCK_MONOTONIC` nanoseconds (the judge's clock, and
/// the observer's).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub(super) struct RunWindows {
    candidate: Vec<[u64; 2]>,
    reference: Vec<[u64; 2]>,
}

/// What the server recorded of the two trees' CPU from outside: the candidate worker's, and
/// the judge's with the reference worker in it.
pub(super) struct Observed {
    pub candidate: Result<crate::observe::Recording, String>,
    pub reference: Result<crate::observe::Recording, String>,
}

impl Observed {
    /// The summary for the details and, where the candidate's forwards spent about as much of
    /// their time in PyTorch's compute library as the reference's did, why that breaks
    /// `pytorch_compute`.
    fn judge(
        &self,
        windows: Option<&RunWindows>,
        compute_allowed: bool,
        device: Device,
    ) -> (env_api::ObservedCompute, Option<String>) {
        use crate::observe::{pytorch_compute, Finding, KERNEL_TIME_RATIO};
        let mut s = env_api::ObservedCompute::default();
        let (cand, reference, windows) = match (&self.candidate, &self.reference, windows) {
            (Ok(c), Ok(r), Some(w)) => (c, r, w),
            (Err(e), _, _) | (_, Err(e), _) => {
                s.reason = Some(format!("not observed: {e}"));
                return (s, None);
            }
            (_, _, None) => {
                s.reason = Some("the judge reported no forwards".into());
                return (s, None);
            }
        };
        s.available = true;
        // One observation holds both trees: its count of lost records is theirs together.
        s.lost = cand.lost.max(reference.lost);
        let (c, r) = (
            cand.profile(&windows.candidate),
            reference.profile(&windows.reference),
        );
        let finding = pytorch_compute(&c, &r);
        s.candidate_forwards = c.forwards;
        s.reference_forwards = r.forwards;
        s.candidate_samples = c.samples;
        s.reference_samples = r.samples;
        s.candidate_torch_share = finding.candidate_share;
        s.reference_torch_share = finding.reference_share;
        s.candidate_kernel_share = finding.candidate_kernel_share;
        s.reference_kernel_share = finding.reference_kernel_share;
        s.kernel_time_ratio = finding.kernel_time_ratio;
        let top = |p: &crate::observe::Profile| {
            p.top(5)
                .into_iter()
                .map(|(library, share)| env_api::LibraryShare { library, share })
                .collect()
        };
        s.candidate_top = top(&c);
        s.reference_top = top(&r);
        // The lines the rule draws, shown wherever the rule is applied.
        s.kernel_time_threshold = Some(KERNEL_TIME_RATIO);
        s.library_threshold = Some(finding.library_threshold);
        let unjudged = |mut s: env_api::ObservedCompute, why: String| {
            s.kernel_time_threshold = None;
            s.library_threshold = None;
            s.reason = Some(why);
            (s, None)
        };
        match finding.outcome {
            // Operators the server (`--allow-ops`) or the task (its `ALLOW_OPS`) allows run
            // PyTorch's kernels by right.
            Finding::Broken if compute_allowed => unjudged(
                s,
                "the server (--allow-ops) or the task (ALLOW_OPS) allows PyTorch compute operators: reported, not judged"
                    .into(),
            ),
            // On a GPU the host's samples are launches and waits: what they say of who wrote
            // the kernels is measured, not yet believed.
            Finding::Broken | Finding::Clear if device == Device::Cuda => {
                s.reason = Some("on a GPU the observation is reported, not judged".into());
                (s, None)
            }
            // Rings overflow only under a flood of records (thousands of mappings in 50 ms;
            // an honest worker writes about one a millisecond), and what was lost may be the
            // very compute the rule looks for: a forward the server could not see is not paid.
            Finding::Inconclusive(_) | Finding::Clear | Finding::Broken
                if s.lost > 0 && !compute_allowed && device != Device::Cuda =>
            {
                let why = format!(
                    "the server's outside observation of the workers lost {} records (its ring buffers overflowed, as under a flood of memory mappings or processes): a forward it could not see is not paid",
                    s.lost
                );
                (s, Some(why))
            }
            Finding::Inconclusive(why) => unjudged(s, why),
            Finding::Clear => (s, None),
            Finding::Broken => {
                let why = format!(
                    "observed from outside the worker, the candidate's forwards spent {:.0}% as much CPU time per call in the code of the eager reference's own PyTorch kernels as the reference did ({:.0}% breaks the rule), and {:.0}% of their time in PyTorch's compute library libtorch_cpu.so (the reference {:.0}%; {:.0}% breaks it): the forward computes with PyTorch",
                    100.0 * finding.kernel_time_ratio,
                    100.0 * KERNEL_TIME_RATIO,
                    100.0 * finding.candidate_share,
                    100.0 * finding.reference_share,
                    100.0 * finding.library_threshold,
                );
                (s, Some(why))
            }
        }
    }
}

impl Verdict {
    pub(super) fn failed(rule: &str, reason: String) -> Self {
        Self {
            correct: false,
            rule: Some(rule.into()),
            reason: Some(reason),
            ..Self::default()
        }
    }
}

impl Verdict {
    /// The verdict in the judge's stdout `out`: its last line that is one. The judge is
    /// trusted code in its own sandbox; the worker cannot reach its stdout. None there is the
    /// harness's failure, told with how the judge ended and its stderr's tail.
    pub(super) fn of_judge(out: &[u8], err: &[u8], outcome: &Outcome) -> Result<Self, EvalError> {
        let text = String::from_utf8_lossy(out);
        text.lines()
            .rev()
            .find_map(|l| serde_json::from_str::<Verdict>(l).ok())
            .ok_or_else(|| {
                EvalError::Harness(format!(
                    "the judge gave no verdict ({}): {}",
                    describe_exit(outcome),
                    tail(err, 2000)
                ))
            })
    }
}

/// Median times in the verdict.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
struct VerdictTimes {
    #[serde(default)]
    eager: Option<f64>,
    #[serde(default)]
    compile: Option<f64>,
    #[serde(default)]
    candidate: Option<f64>,
}
