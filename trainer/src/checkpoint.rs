//! Checkpoint layout of a stage's output directory:
//!
//! ```text
//! <out>/<stage>/step-000010/{policy.mpk, critic.mpk, actor_optim.mpk, critic_optim.mpk, state.json}
//! <out>/<stage>/latest          name of the newest complete step directory
//! <out>/<stage>/final/          the weights at the end of the stage (what the next stage loads)
//! ```
//!
//! A step directory is written under a temporary name and renamed when complete, so a crash
//! mid-save never leaves a half checkpoint that `--resume` would pick up.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// What a checkpoint records besides the weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageState {
    /// Stage name (`warmup`, `rft`, `value`, `ppo`).
    pub stage: String,
    /// Steps completed.
    pub step: usize,
    /// Steps the stage runs in all.
    pub total_steps: usize,
    /// The run's seed (data order and sampling derive from it and the step).
    pub seed: u64,
}

/// Files of one checkpoint directory.
#[derive(Debug, Clone)]
pub struct CheckpointFiles {
    /// The directory.
    pub dir: PathBuf,
}

impl CheckpointFiles {
    /// Paths inside `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }
    /// Policy weights.
    pub fn policy(&self) -> PathBuf {
        self.dir.join("policy.mpk")
    }
    /// Critic weights.
    pub fn critic(&self) -> PathBuf {
        self.dir.join("critic.mpk")
    }
    /// Policy optimiser state.
    pub fn actor_optim(&self) -> PathBuf {
        self.dir.join("actor_optim.mpk")
    }
    /// Critic optimiser state.
    pub fn critic_optim(&self) -> PathBuf {
        self.dir.join("critic_optim.mpk")
    }
    /// `state.json`.
    pub fn state(&self) -> PathBuf {
        self.dir.join("state.json")
    }
    /// Reads `state.json`.
    pub fn read_state(&self) -> Result<StageState, TrainError> {
        let p = self.state();
        let text = std::fs::read_to_string(&p).map_err(|e| TrainError::Io(p.clone(), e))?;
        serde_json::from_str(&text).map_err(|e| TrainError::Data(format!("{}: {e}", p.display())))
    }
}

/// Directory name of step `step`.
pub fn step_dir(stage_dir: &Path, step: usize) -> PathBuf {
    stage_dir.join(format!("step-{step:06}"))
}

/// The step a `step_dir` path names, if it is one.
fn step_of(dir: &Path) -> Option<usize> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("step-")?
        .parse()
        .ok()
}

/// Writes a checkpoint through `write` into a temporary directory, then renames it into place
/// and points `latest` at it.
pub fn save(
    stage_dir: &Path,
    state: &StageState,
    write: impl FnOnce(&CheckpointFiles) -> Result<(), TrainError>,
) -> Result<PathBuf, TrainError> {
    let final_dir = step_dir(stage_dir, state.step);
    let tmp = stage_dir.join(format!(".tmp-step-{:06}", state.step));
    let io = |p: &Path, e| TrainError::Io(p.to_path_buf(), e);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    let files = CheckpointFiles::new(&tmp);
    write(&files)?;
    let text = serde_json::to_string_pretty(state).map_err(|e| TrainError::Data(e.to_string()))?;
    std::fs::write(files.state(), text).map_err(|e| io(&files.state(), e))?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(|e| io(&final_dir, e))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| io(&final_dir, e))?;
    let latest = stage_dir.join("latest");
    let name = final_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    std::fs::write(&latest, name).map_err(|e| io(&latest, e))?;
    Ok(final_dir)
}

/// Removes all but the newest `keep` step checkpoints of a stage (`keep == 0` keeps all).
/// Returns how many were removed. Disk use stays bounded on long runs; `latest` always names
/// one that is kept.
pub fn prune(stage_dir: &Path, keep: usize) -> Result<usize, TrainError> {
    if keep == 0 {
        return Ok(0);
    }
    let entries =
        std::fs::read_dir(stage_dir).map_err(|e| TrainError::Io(stage_dir.to_path_buf(), e))?;
    let mut steps: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| Some((step_of(&p)?, p)))
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for (_, p) in &steps[..excess] {
        std::fs::remove_dir_all(p).map_err(|e| TrainError::Io(p.clone(), e))?;
    }
    Ok(excess)
}

/// The newest complete checkpoint of a stage, if any.
pub fn latest(stage_dir: &Path) -> Option<CheckpointFiles> {
    let name = std::fs::read_to_string(stage_dir.join("latest")).ok()?;
    let dir = stage_dir.join(name.trim());
    dir.join("state.json")
        .exists()
        .then(|| CheckpointFiles::new(dir))
}
