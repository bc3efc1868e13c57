//! Which trajectories fine-tuning may learn from, and turning the server's trajectory logs
//! into samples.
//!
//! The RFT filter keeps successful episodes without wasted or rule-breaking steps: the recipe
//! drops trajectories with redundant steps (the same call twice in a row, an edit later
//! undone) and malformed calls, so fine-tuning does not teach them.

use std::collections::HashMap;
use std::path::Path;

use env_api::TrajectoryRecord;
use serde_json::Value;

use crate::error::TrainError;
use crate::render::Renderer;
use crate::sample::{Outcome, Sample, TurnRecord};

/// Why a trajectory is not used for fine-tuning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rejection {
    /// The reward is not above the threshold.
    LowReward,
    /// The episode did not finish on the server (trainer limits, errors).
    Unfinished,
    /// A turn held no parseable call or the server refused it.
    MalformedCall,
    /// The same call twice in a row.
    RepeatedCall,
    /// An edit that puts back what an earlier edit replaced.
    UndoneEdit,
    /// Longer than the training context (logs from a longer-context run).
    TooLong,
}

/// The RFT verdict on one sample: `Ok` when it is kept.
pub fn rft_verdict(s: &Sample, min_reward: f32, max_tokens: usize) -> Result<(), Rejection> {
    if s.tokens.len() > max_tokens {
        return Err(Rejection::TooLong);
    }
    if s.outcome != Some(Outcome::Finished) {
        return Err(Rejection::Unfinished);
    }
    if s.reward <= min_reward {
        return Err(Rejection::LowReward);
    }
    if s.turns
        .iter()
        .any(|t| t.tool.is_none() || t.parse_error.is_some())
    {
        return Err(Rejection::MalformedCall);
    }
    if s.turns
        .windows(2)
        .any(|w| w[0].tool == w[1].tool && w[0].arguments == w[1].arguments)
    {
        return Err(Rejection::RepeatedCall);
    }
    if has_undone_edit(&s.turns) {
        return Err(Rejection::UndoneEdit);
    }
    Ok(())
}

/// A call's arguments in the one form every log source agrees on: an object. Clients that
/// follow OpenAI's wire format (agent-runner among them) send and log `arguments` as a JSON
/// string; the trainer's own turns and MCP clients give the object. A string that holds an
/// object becomes that object; anything else is left as it is (and fails the calls' checks
/// like any malformed argument).
pub fn canonical_arguments(arguments: Value) -> Value {
    match &arguments {
        Value::String(text) => match serde_json::from_str::<Value>(text) {
            Ok(object @ Value::Object(_)) => object,
            _ => arguments,
        },
        _ => arguments,
    }
}

/// Whether some edit reverses an earlier one on the same file: an Edit or a MultiEdit whose
/// (old, new) pair is an earlier pair swapped, or a Write that restores the content the file
/// had before its previous Write.
fn has_undone_edit(turns: &[TurnRecord]) -> bool {
    let mut pairs: HashMap<String, Vec<(String, String)>> = HashMap::new();
    let mut writes: HashMap<String, Vec<String>> = HashMap::new();
    for t in turns {
        let Some(tool) = t.tool.as_deref() else {
            continue;
        };
        let file = t
            .arguments
            .get("file_path")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        match tool {
            "Edit" | "MultiEdit" => {
                // An Edit is a MultiEdit of one pair.
                let edits = match tool {
                    "Edit" => vec![t.arguments.clone()],
                    _ => t
                        .arguments
                        .get("edits")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default(),
                };
                let seen = pairs.entry(file).or_default();
                for e in edits {
                    let old = e
                        .get("old_string")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    let new = e
                        .get("new_string")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    if seen.iter().any(|(o, n)| *o == new && *n == old) {
                        return true;
                    }
                    seen.push((old, new));
                }
            }
            "Write" => {
                let content = t
                    .arguments
                    .get("content")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                let history = writes.entry(file).or_default();
                if history.len() >= 2
                    && history[history.len() - 2] == content
                    && history[history.len() - 1] != content
                {
                    return true;
                }
                history.push(content);
            }
            _ => {}
        }
    }
    false
}

/// Counts of kept and rejected samples.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct FilterSummary {
    /// Samples kept.
    pub kept: usize,
    /// Rejections by reason.
    pub rejected: HashMap<Rejection, usize>,
}

/// Keeps the samples that pass `rft_verdict`.
pub fn rft_filter(
    samples: Vec<Sample>,
    min_reward: f32,
    max_tokens: usize,
) -> (Vec<Sample>, FilterSummary) {
    let mut summary = FilterSummary::default();
    let kept = samples
        .into_iter()
        .filter(|s| match rft_verdict(s, min_reward, max_tokens) {
            Ok(()) => {
                summary.kept += 1;
                true
            }
            Err(r) => {
                *summary.rejected.entry(r).or_default() += 1;
                false
            }
        })
        .collect();
    (kept, summary)
}

/// A sample from one trajectory log (the server's `trajectories/{id}.jsonl` records): the
/// prompt and observations as context, each logged call rendered in the canonical form as the
/// policy's tokens (their sampling log-probabilities are unknown, so such samples serve
/// fine-tuning and value pre-training, not PPO).
pub fn sample_from_log(
    records: &[TrajectoryRecord],
    renderer: &Renderer,
) -> Result<Sample, TrainError> {
    let resp = records
        .iter()
        .find_map(|r| match r {
            TrajectoryRecord::Reset { body, .. } => Some(&body.response),
            _ => None,
        })
        .ok_or_else(|| TrainError::Data("log has no reset record".into()))?;
    let mut s = Sample::new(&resp.info.task.id, &resp.episode_id);
    s.push_context(&renderer.prompt(&resp.observation.text, &resp.info.tools)?);
    let steps = records.iter().filter_map(|r| match r {
        TrajectoryRecord::Step { body, .. } => Some(body),
        _ => None,
    });
    for body in steps {
        let tool = body.action.tool.as_str();
        let arguments = canonical_arguments(body.action.arguments.clone());
        let step = &body.response;
        let call = renderer.call_tokens(tool, &arguments)?;
        s.push_policy(&call, None);
        s.turns.push(TurnRecord {
            tool: Some(tool.into()),
            arguments,
            parse_error: None,
            tool_error: step.observation.is_error,
        });
        if step.done {
            s.reward = step.reward as f32;
            s.outcome = Some(Outcome::Finished);
            s.reason = step.info.evaluation.as_ref().and_then(|e| e.reason.clone());
            break;
        }
        s.push_context(&renderer.observation(
            &step.observation.text,
            step.observation.is_error,
            &call,
        )?);
    }
    if s.outcome.is_none() {
        s.outcome = Some(Outcome::TurnLimit);
        s.reason = Some("the log ends before the episode did".into());
    }
    Ok(s)
}

/// Reads every `*.jsonl` trajectory log in `dir` (a server's `<data-dir>/trajectories`),
/// in file-name order. Unreadable logs are reported and skipped, counted in the second value.
pub fn samples_from_dir(
    dir: &Path,
    renderer: &Renderer,
) -> Result<(Vec<Sample>, usize), TrainError> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| TrainError::Io(dir.to_path_buf(), e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    let mut bad = 0;
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(|e| TrainError::Io(f.clone(), e))?;
        let records: Result<Vec<TrajectoryRecord>, _> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(serde_json::from_str)
            .collect();
        match records
            .map_err(|e| TrainError::DataJson {
                what: f.display().to_string(),
                source: e,
            })
            .and_then(|r| sample_from_log(&r, renderer))
        {
            Ok(s) => out.push(s),
            Err(e) => {
                tracing::warn!(log = %f.display(), "skipping trajectory log: {}", env_api::ErrorChain(&e));
                bad += 1;
            }
        }
    }
    Ok((out, bad))
}
