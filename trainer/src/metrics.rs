//! Per-step metrics as JSON Lines, written and read as the typed records below, and the batch
//! summaries that go into them.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::TrainError;
use crate::rollout::RolloutStats;
use crate::sample::{Outcome, Sample};

/// An append-only `metrics.jsonl`, one record per step.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
}

/// The one field the resume filter reads of any line.
#[derive(Deserialize)]
struct StepOf {
    step: usize,
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
                    .filter(|l| serde_json::from_str::<StepOf>(l).is_ok_and(|r| r.step <= step))
                    .collect();
                let mut out = kept.join("\n");
                if !out.is_empty() {
                    out.push('\n');
                }
                crate::checkpoint::write_atomic(path, out.as_bytes())?;
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
    pub fn write(&mut self, record: &MetricsRecord) -> Result<(), TrainError> {
        let io = |e| TrainError::Io(self.path.clone(), e);
        let line =
            serde_json::to_string(record).map_err(|e| TrainError::Json(self.path.clone(), e))?;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)
            .map_err(io)?;
        writeln!(f, "{line}").map_err(io)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every record of a metrics file; a line that is not a record (cut short by a crash)
/// is skipped.
pub fn read_metrics(path: &Path) -> Result<Vec<MetricsRecord>, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::Io(path.to_path_buf(), e))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// One line of a stage's `metrics.jsonl`, tagged by its `stage` field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "stage", rename_all = "lowercase")]
pub enum MetricsRecord {
    /// A single-turn PPO step.
    Warmup(PpoRecord),
    /// A multi-turn PPO step.
    Ppo(PpoRecord),
    /// A rejection-sampling fine-tuning step.
    Rft(RftRecord),
    /// A value pre-training step.
    Value(ValueRecord),
}

impl MetricsRecord {
    /// Steps completed when the record was written.
    pub fn step(&self) -> usize {
        match self {
            Self::Warmup(r) | Self::Ppo(r) => r.step,
            Self::Rft(r) => r.step,
            Self::Value(r) => r.step,
        }
    }

    /// The PPO record, for the warm-up and PPO stages.
    pub fn ppo(&self) -> Option<&PpoRecord> {
        match self {
            Self::Warmup(r) | Self::Ppo(r) => Some(r),
            _ => None,
        }
    }
}

/// A PPO step (warm-up or multi-turn): the batch, the update, the rates and warnings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PpoRecord {
    /// Steps completed.
    pub step: usize,
    /// The batch's rewards and episodes.
    #[serde(flatten)]
    pub batch: BatchSummary,
    /// What the update measured.
    #[serde(flatten)]
    pub update: PpoUpdate,
    /// Throughput and where the time went.
    #[serde(flatten)]
    pub rates: Throughput,
    /// Run-away warnings (entropy, KL) raised at this step.
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// Reward and episode statistics of a batch (failed episodes counted apart).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BatchSummary {
    /// Episodes started.
    pub episodes: usize,
    /// Episodes lost to server errors (left out of the statistics).
    pub failed: usize,
    /// Mean reward.
    pub reward_mean: f64,
    /// Standard deviation of the rewards.
    pub reward_std: f64,
    /// Episodes per reward value.
    pub reward_hist: BTreeMap<String, usize>,
    /// Episodes per outcome.
    pub outcomes: BTreeMap<String, usize>,
    /// Assistant turns per episode.
    pub turns_per_episode: f64,
    /// Tokens per episode.
    pub tokens_per_episode: f64,
    /// Policy tokens per episode.
    pub policy_tokens_per_episode: f64,
    /// Share of turns that were a well-formed tool call.
    pub valid_call_share: f64,
}

/// What one PPO update measured. Only `trained_episodes` is there when the batch held nothing
/// to train on; a value that is not a number is written as null and read back as `None`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PpoUpdate {
    /// Episodes the update trained on.
    pub trained_episodes: usize,
    /// Clipped surrogate loss, mean over minibatches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_loss: Option<f64>,
    /// Clipped value loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_loss: Option<f64>,
    /// Entropy per policy token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<f64>,
    /// KL to the rollout policy (k3 estimate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approx_kl: Option<f64>,
    /// KL to the reference policy, when the KL penalty is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ref_kl: Option<f64>,
    /// Share of policy tokens whose ratio was clipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_fraction: Option<f64>,
    /// Explained variance of the critic's values against the returns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explained_variance: Option<f64>,
    /// Mean gradient norm of the policy's steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm_actor: Option<f64>,
    /// Mean gradient norm of the critic's steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm_critic: Option<f64>,
    /// Policy learning rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_actor: Option<f64>,
    /// Critic learning rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_critic: Option<f64>,
    /// Mean |sampling-time - recomputed| log-probability of the policy's tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_logprob_mismatch: Option<f64>,
}

/// Throughput of a step and where its time went.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    /// Episodes per minute of the whole step.
    pub episodes_per_min: f64,
    /// Tokens per minute.
    pub tokens_per_min: f64,
    /// Policy tokens per minute.
    pub policy_tokens_per_min: f64,
    /// Context tokens the policy prefilled during the rollout (with caches kept across
    /// turns, only what each turn added).
    #[serde(default)]
    pub prefilled_tokens: usize,
    /// Context tokens taken from caches kept across turns instead.
    #[serde(default)]
    pub reused_tokens: usize,
    /// Of the batch's failed episodes, those lost with their server (it went away or drained
    /// while they ran): a fleet's health, not the policy's.
    #[serde(default)]
    pub lost_episodes: usize,
    /// Seconds per phase.
    pub time_s: TimeSplit,
}

/// Seconds per phase of a step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TimeSplit {
    /// Sampling.
    pub generate: f64,
    /// Waiting for the servers with nothing to decode.
    pub env: f64,
    /// The servers' answers to tool calls, summed over calls (with continuous batching most
    /// of it overlaps sampling: `env_requests - env` is the overlap).
    #[serde(default)]
    pub env_requests: f64,
    /// The whole rollout.
    pub rollout: f64,
    /// The update.
    pub update: f64,
    /// The step.
    pub total: f64,
}

/// A rejection-sampling fine-tuning step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RftRecord {
    /// Steps completed.
    pub step: usize,
    /// Negative log-likelihood per policy token.
    pub nll: Option<f64>,
    /// Policy tokens trained on.
    pub tokens: usize,
    /// Episodes in the minibatch.
    pub episodes: usize,
    /// Learning rate.
    pub lr: f64,
    /// Gradient norm.
    pub grad_norm: Option<f32>,
}

/// A value pre-training step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValueRecord {
    /// Steps completed.
    pub step: usize,
    /// Squared-error loss per policy token.
    pub value_loss: Option<f64>,
    /// Explained variance of the values against the targets.
    pub explained_variance: Option<f64>,
    /// Episodes in the minibatch.
    pub episodes: usize,
    /// Learning rate.
    pub lr: f64,
    /// Gradient norm.
    pub grad_norm: Option<f32>,
}

/// `trainer evaluate`'s summary: the batch's statistics and the rollout's counters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalSummary {
    /// Rewards and episodes.
    #[serde(flatten)]
    pub batch: BatchSummary,
    /// Rollout counters and times.
    pub rollout: RolloutStats,
}

/// Reward and episode statistics of a batch (failed episodes counted apart).
pub fn batch_summary(samples: &[Sample]) -> BatchSummary {
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
    BatchSummary {
        episodes: samples.len(),
        failed: samples.len() - used.len(),
        reward_mean: mean,
        reward_std: std,
        reward_hist: hist,
        outcomes,
        turns_per_episode: turns,
        tokens_per_episode: tokens,
        policy_tokens_per_episode: policy_tokens,
        valid_call_share: if all_turns == 0 {
            0.0
        } else {
            valid_turns as f64 / all_turns as f64
        },
    }
}
