//! Checkpoint layout of a stage's output directory:
//!
//! ```text
//! <out>/<stage>/step-000010/{policy.mpk, critic.mpk, actor_optim.mpk, critic_optim.mpk, state.json}
//!                           with adapters: {policy,critic}_adapter.safetensors for the .mpk weights
//! <out>/<stage>/latest          name of the newest complete step directory
//! <out>/<stage>/final/          the weights at the end of the stage (what the next stage loads)
//! ```
//!
//! A step directory is written under a temporary name, fsynced, and renamed when complete;
//! `latest` is replaced atomically the same way (temporary file, fsync, rename, fsync of the
//! directory). A crash mid-save leaves the previous checkpoint as `latest`, and a `latest`
//! that is empty or names no complete checkpoint is an error, never a silent fresh start.

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
    /// The policy's adapters (adapter training; the base stays the starting checkpoint).
    pub fn policy_adapter(&self) -> PathBuf {
        self.dir.join("policy_adapter.safetensors")
    }
    /// The adapters' shape, as PEFT's `adapter_config.json` (adapter training).
    pub fn adapter_config(&self) -> PathBuf {
        self.dir.join("adapter_config.json")
    }
    /// The critic's adapters and value head (adapter training).
    pub fn critic_adapter(&self) -> PathBuf {
        self.dir.join("critic_adapter.safetensors")
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
        serde_json::from_str(&text).map_err(|e| TrainError::Json(p, e))
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

/// Writes a checkpoint through `write` into a temporary directory, makes every file in it
/// durable, renames it into place and then points `latest` at it, each step fsynced: after a
/// crash at any point, `latest` names a complete checkpoint (the new one or the one before).
pub fn save(
    stage_dir: &Path,
    state: &StageState,
    write: impl FnOnce(&CheckpointFiles) -> Result<(), TrainError>,
) -> Result<PathBuf, TrainError> {
    let name = format!("step-{:06}", state.step);
    let dir = publish(stage_dir, &name, |files| {
        write(files)?;
        let text =
            serde_json::to_string_pretty(state).map_err(|e| TrainError::Json(files.state(), e))?;
        std::fs::write(files.state(), text).map_err(|e| io(&files.state(), e))
    })?;
    write_atomic(&stage_dir.join(LATEST), name.as_bytes())?;
    Ok(dir)
}

/// Writes directory `stage_dir/name` through `write` durably: into a temporary directory,
/// every file and the directory fsynced, then renamed into place (an older copy moved aside
/// first and removed after) and `stage_dir` fsynced. Readers and a crash see the old
/// directory or the complete new one.
pub fn publish(
    stage_dir: &Path,
    name: &str,
    write: impl FnOnce(&CheckpointFiles) -> Result<(), TrainError>,
) -> Result<PathBuf, TrainError> {
    let final_dir = stage_dir.join(name);
    let tmp = stage_dir.join(format!(".tmp-{name}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    write(&CheckpointFiles::new(&tmp))?;
    // The files' data and the directory's entries reach the disk before the rename makes the
    // directory visible under its final name.
    sync_tree(&tmp)?;
    if final_dir.exists() {
        // Replacing: the old copy is moved aside, not deleted first, so that a crash in
        // between leaves one of the two in place.
        let old = stage_dir.join(format!(".old-{name}"));
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
        }
        std::fs::rename(&final_dir, &old).map_err(|e| io(&final_dir, e))?;
        std::fs::rename(&tmp, &final_dir).map_err(|e| io(&final_dir, e))?;
        sync_dir(stage_dir)?;
        std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
    } else {
        std::fs::rename(&tmp, &final_dir).map_err(|e| io(&final_dir, e))?;
    }
    sync_dir(stage_dir)?;
    Ok(final_dir)
}

/// Name of the pointer file in a stage directory.
pub const LATEST: &str = "latest";

fn io(p: &Path, e: std::io::Error) -> TrainError {
    TrainError::Io(p.to_path_buf(), e)
}

/// Replaces `path` with `bytes` atomically and durably: a temporary file beside it is written
/// and fsynced, renamed over `path`, and the directory fsynced. Readers see the old content
/// or the new, never a part; after a crash the same holds.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))?;
    sync_dir(dir)
}

/// fsyncs a directory, so that the entries created or renamed in it are durable.
pub fn sync_dir(dir: &Path) -> Result<(), TrainError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, e))
}

/// fsyncs every file under `dir`, then every directory, `dir` last.
fn sync_tree(dir: &Path) -> Result<(), TrainError> {
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let path = entry.map_err(|e| io(dir, e))?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            std::fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| io(&path, e))?;
        }
    }
    sync_dir(dir)
}

/// Removes all but the newest `keep` step checkpoints of a stage (`keep == 0` keeps all).
/// Returns how many were removed. Disk use stays bounded on long runs; the one `latest`
/// names is never removed.
pub fn prune(stage_dir: &Path, keep: usize) -> Result<usize, TrainError> {
    if keep == 0 {
        return Ok(0);
    }
    let current = latest(stage_dir)?.map(|f| f.dir);
    let entries = std::fs::read_dir(stage_dir).map_err(|e| io(stage_dir, e))?;
    let mut steps: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| Some((step_of(&p)?, p)))
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    let mut removed = 0;
    for (_, p) in &steps[..excess] {
        if current.as_deref() == Some(p.as_path()) {
            continue;
        }
        std::fs::remove_dir_all(p).map_err(|e| io(p, e))?;
        removed += 1;
    }
    Ok(removed)
}

/// The newest complete checkpoint of a stage: `None` when the stage has no `latest` pointer
/// yet (a fresh start), an error when the pointer is empty, unreadable, or names a directory
/// that is not a complete checkpoint (a resume must not silently start over).
pub fn latest(stage_dir: &Path) -> Result<Option<CheckpointFiles>, TrainError> {
    let pointer = stage_dir.join(LATEST);
    if !pointer.exists() {
        return Ok(None);
    }
    read_pointer(&pointer).map(|dir| Some(CheckpointFiles::new(dir)))
}

/// The checkpoint directory a `latest` pointer file names, checked to be complete.
pub fn read_pointer(pointer: &Path) -> Result<PathBuf, TrainError> {
    let text = std::fs::read_to_string(pointer).map_err(|e| io(pointer, e))?;
    let name = text.trim();
    let corrupt = |why: &str| TrainError::Checkpoint {
        path: pointer.to_path_buf(),
        reason: why.to_string(),
    };
    if name.is_empty() {
        return Err(corrupt("the pointer is empty"));
    }
    if step_of(Path::new(name)).is_none() || name.contains('/') {
        return Err(corrupt(&format!("{name:?} is not a step-N directory name")));
    }
    let dir = pointer.parent().unwrap_or(Path::new(".")).join(name);
    if !CheckpointFiles::new(&dir).state().exists() {
        return Err(corrupt(&format!(
            "it names {}, which holds no state.json",
            dir.display()
        )));
    }
    Ok(dir)
}

/// A checkpoint path as a user gives it: a `latest` pointer file, a stage directory holding
/// one, or a checkpoint directory itself.
pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
    if path.is_file() {
        return read_pointer(path);
    }
    let files = CheckpointFiles::new(path);
    let is_checkpoint = files.policy().exists() || path.join("config.json").exists();
    if !is_checkpoint && path.join(LATEST).is_file() {
        return read_pointer(&path.join(LATEST));
    }
    if !path.exists() {
        return Err(io(path, std::io::Error::from(std::io::ErrorKind::NotFound)));
    }
    Ok(path.to_path_buf())
}
