//! Token bookkeeping for one episode: the policy's own tokens apart from context tokens
//! (prompt, observations), with the log-probability each was sampled with.

use serde::{Deserialize, Serialize};

/// One assistant turn as the environment saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    /// The tool called, or `None` when the turn held no parseable call.
    pub tool: Option<String>,
    /// Its arguments (`null` when unparsed).
    pub arguments: serde_json::Value,
    /// The parse error shown to the agent, if any.
    pub parse_error: Option<String>,
    /// Whether the tool reported an error.
    pub tool_error: bool,
}

/// How an episode ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The server ended it (Submit, turn or time limit) and paid a reward.
    Finished,
    /// The trainer's context limit was reached first; closed with the failure reward.
    ContextLimit,
    /// The trainer's turn limit was reached through unparseable turns; closed with the failure reward.
    TurnLimit,
    /// A server error ended it; it is left out of training.
    Failed,
}

/// One episode's tokens and what the trainer knows about each.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Sample {
    /// Task id.
    pub task: String,
    /// Server episode id (empty for single-turn samples).
    pub episode_id: String,
    /// Every token of the conversation, in order.
    pub tokens: Vec<u32>,
    /// `true` where the policy sampled the token (the only tokens any loss sees).
    pub policy: Vec<bool>,
    /// Sampling log-probability of each policy token (0 for context tokens).
    pub logprobs: Vec<f32>,
    /// The episode reward.
    pub reward: f32,
    /// Assistant turns.
    pub turns: Vec<TurnRecord>,
    /// How it ended (`None` while running).
    pub outcome: Option<Outcome>,
    /// Final evaluation's reason, when it failed.
    pub reason: Option<String>,
}

impl Sample {
    /// A sample for `task` with no tokens yet.
    pub fn new(task: &str, episode_id: &str) -> Self {
        Self {
            task: task.into(),
            episode_id: episode_id.into(),
            ..Self::default()
        }
    }

    /// Appends context tokens (prompt, observation, template glue): masked out of every loss.
    pub fn push_context(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        self.policy.extend(std::iter::repeat_n(false, tokens.len()));
        self.logprobs.extend(std::iter::repeat_n(0.0, tokens.len()));
    }

    /// Appends tokens the policy sampled, with their sampling log-probabilities (`None`: taken
    /// from a log, probabilities unknown, so only usable for fine-tuning).
    pub fn push_policy(&mut self, tokens: &[u32], logprobs: Option<&[f32]>) {
        self.tokens.extend_from_slice(tokens);
        self.policy.extend(std::iter::repeat_n(true, tokens.len()));
        match logprobs {
            Some(lp) => {
                assert_eq!(
                    lp.len(),
                    tokens.len(),
                    "one log-probability per sampled token"
                );
                self.logprobs.extend_from_slice(lp);
            }
            None => self.logprobs.extend(std::iter::repeat_n(0.0, tokens.len())),
        }
    }

    /// Number of policy tokens.
    pub fn policy_tokens(&self) -> usize {
        self.policy.iter().filter(|&&p| p).count()
    }

    /// Loss mask aligned with next-token statistics: entry `j` is whether token `j + 1` is the
    /// policy's (`CausalLm::sequence_stats` returns the statistics of token `j + 1` at `j`).
    pub fn shifted_mask(&self) -> Vec<bool> {
        self.policy.iter().skip(1).copied().collect()
    }

    /// Sampling log-probabilities aligned like `shifted_mask`.
    pub fn shifted_logprobs(&self) -> Vec<f32> {
        self.logprobs.iter().skip(1).copied().collect()
    }

    /// Per-position rewards aligned like `shifted_mask`: the episode reward on the last policy
    /// token, zero elsewhere.
    pub fn shifted_rewards(&self) -> Vec<f32> {
        let mask = self.shifted_mask();
        let mut r = vec![0.0; mask.len()];
        if let Some(last) = mask.iter().rposition(|&m| m) {
            r[last] = self.reward;
        }
        r
    }

    /// Share of turns whose call parsed and ran without a tool error.
    pub fn valid_call_share(&self) -> f64 {
        if self.turns.is_empty() {
            return 0.0;
        }
        self.turns
            .iter()
            .filter(|t| t.tool.is_some() && t.parse_error.is_none())
            .count() as f64
            / self.turns.len() as f64
    }

    /// Whether the sample can be trained on.
    pub fn usable(&self) -> bool {
        self.outcome != Some(Outcome::Failed) && self.policy_tokens() > 0
    }
}
