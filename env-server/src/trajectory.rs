//! The durable trajectory log: one JSON Lines file per episode, each record fsynced before
//! the answer that it records is sent.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use env_api::TrajectoryRecord;
use serde_json::Value;

/// Errors of the log.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// Reading or writing failed.
    #[error("trajectory log {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Seconds since the Unix epoch.
pub fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// An episode's log file, opened for appending.
#[derive(Debug)]
pub struct TrajectoryLog {
    path: PathBuf,
    file: std::fs::File,
}

impl TrajectoryLog {
    /// Opens (creating) the log of an episode.
    pub fn open(dir: &Path, episode_id: &str) -> Result<Self, LogError> {
        let path = dir.join(format!("{episode_id}.jsonl"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|source| LogError::Io { path: path.clone(), source })?;
        Ok(Self { path, file })
    }

    /// Appends one record and fsyncs it.
    pub fn append(&mut self, kind: &str, body: Value) -> Result<(), LogError> {
        let rec = TrajectoryRecord { kind: kind.into(), time: now(), body };
        let mut line = serde_json::to_vec(&rec).unwrap_or_default();
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|_| self.file.sync_data())
            .map_err(|source| LogError::Io { path: self.path.clone(), source })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every record of a log. A torn last line (a crash mid-write) is skipped.
pub fn read(path: &Path) -> Result<Vec<TrajectoryRecord>, LogError> {
    let text = std::fs::read_to_string(path).map_err(|source| LogError::Io { path: path.to_path_buf(), source })?;
    Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
}
