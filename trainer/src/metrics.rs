//! Per-step metrics as JSON Lines, and the batch summaries that go into them.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::error::TrainError;
use crate::sample::{Outcome, Sample};

/// An append-only `metrics.jsonl`, one object per step.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
}

impl MetricsLog {
    /// Opens `path`; on resume from `resume_step`, lines of later steps (written after that
    /// checkpoint, then lost with the run) are dropped so the log matches the state.
    pub fn open(path: &Path, resume_step: Option<usize>) -> Result<Self, TrainError> {
        let io = |e| TrainError::Io(path.to_path_buf(), e);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| TrainError::Io(parent.to_path_buf(), e))?;
        }
        match resume_step {
            Some(step) if path.exists() => {
                let text = std::fs::read_to_string(path).map_err(io)?;
                let kept: Vec<&str> = text
                    .lines()
                    .filter(|l| {
                        serde_json::from_str::<Value>(l)
                            .ok()
                            .and_then(|v| v["step"].as_u64())
                            .is_some_and(|s| s as usize <= step)
                    })
                    .collect();
                let mut out = kept.join("\n");
                if !out.is_empty() {
                    out.push('\n');
                }
                std::fs::write(path, out).map_err(io)?;
            }
            Some(_) => {}
            None => {
                std::fs::write(path, "").map_err(io)?;
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
        })
    }

    /// Appends one record.
    pub fn write(&mut self, record: &Value) -> Result<(), TrainError> {
        let io = |e| TrainError::Io(self.path.clone(), e);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)
            .map_err(io)?;
        writeln!(f, "{record}").map_err(io)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every record of a metrics file.
pub fn read_metrics(path: &Path) -> Result<Vec<Value>, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::Io(path.to_path_buf(), e))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// Reward and episode statistics of a batch (failed episodes counted apart).
pub fn batch_summary(samples: &[Sample]) -> Value {
    let used: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.outcome != Some(Outcome::Failed))
        .collect();
    let n = used.len().max(1) as f64;
    let rewards: Vec<f64> = used.iter().map(|s| s.reward as f64).collect();
    let mean = rewards.iter().sum::<f64>() / n;
    let std = (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt();
    let mut hist: BTreeMap<String, usize> = BTreeMap::new();
    for r in &rewards {
        *hist.entry(format!("{r}")).or_default() += 1;
    }
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for s in samples {
        let key = s
            .outcome
            .map(|o| format!("{o:?}"))
            .unwrap_or_else(|| "None".into());
        *outcomes.entry(key).or_default() += 1;
    }
    let turns = used.iter().map(|s| s.turns.len()).sum::<usize>() as f64 / n;
    let tokens = used.iter().map(|s| s.tokens.len()).sum::<usize>() as f64 / n;
    let policy_tokens = used.iter().map(|s| s.policy_tokens()).sum::<usize>() as f64 / n;
    let all_turns: usize = used.iter().map(|s| s.turns.len()).sum();
    let valid_turns: usize = used
        .iter()
        .map(|s| {
            s.turns
                .iter()
                .filter(|t| t.tool.is_some() && t.parse_error.is_none())
                .count()
        })
        .sum();
    json!({
        "episodes": samples.len(),
        "failed": samples.len() - used.len(),
        "reward_mean": mean,
        "reward_std": std,
        "reward_hist": hist,
        "outcomes": outcomes,
        "turns_per_episode": turns,
        "tokens_per_episode": tokens,
        "policy_tokens_per_episode": policy_tokens,
        "valid_call_share": if all_turns == 0 { 0.0 } else { valid_turns as f64 / all_turns as f64 },
    })
}
