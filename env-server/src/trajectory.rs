//! The durable trajectory log: one JSON Lines file per episode, each record fsynced before
//! the answer that it records is sent.
//!
//! Record kinds: `reset`, `step`, `final` (the result and the files judged), `truncated`
//! (idle timeout, server restart) and `closed` (a DELETE: the episode is gone for the API, and
//! stays gone across restarts; the log itself is kept for training until retention removes it).

use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use env_api::TrajectoryRecord;

/// Errors of the log.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// Reading or writing failed.
    #[error("trajectory log {path}")]
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
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Whether `id` has the form of an episode id (32 lowercase hex digits, as the server makes
/// them). Anything else is refused before it can name a file.
pub fn is_episode_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Mode of a trajectory log: the server's alone.
pub const LOG_MODE: u32 = 0o600;

/// The log file of an episode under `dir`.
pub fn path_of(dir: &Path, episode_id: &str) -> PathBuf {
    dir.join(format!("{episode_id}.jsonl"))
}

/// An episode's log file, opened for appending. Clones share the file, so a clone can be
/// moved to a blocking thread for the write and fsync.
#[derive(Debug, Clone)]
pub struct TrajectoryLog {
    path: Arc<PathBuf>,
    file: Arc<std::fs::File>,
}

impl TrajectoryLog {
    /// Opens (creating) the log of an episode, readable and writable by the server alone: a
    /// log holds the agent's solutions and the judge's verdicts, which no sandbox may read.
    pub fn open(dir: &Path, episode_id: &str) -> Result<Self, LogError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = path_of(dir, episode_id);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(LOG_MODE)
            .open(&path)
            .map_err(|source| LogError::Io {
                path: path.clone(),
                source,
            })?;
        Ok(Self {
            path: Arc::new(path),
            file: Arc::new(file),
        })
    }

    /// Appends one record and fsyncs it; returns the bytes written. Blocking: call it off the
    /// async workers.
    pub fn append(&self, record: &TrajectoryRecord) -> Result<u64, LogError> {
        let mut line = serde_json::to_vec(record).unwrap_or_default();
        line.push(b'\n');
        (&*self.file)
            .write_all(&line)
            .and_then(|_| self.file.sync_data())
            .map_err(|source| LogError::Io {
                path: self.path.to_path_buf(),
                source,
            })?;
        Ok(line.len() as u64)
    }

    /// The file's size now.
    pub fn len(&self) -> u64 {
        self.file.metadata().map(|m| m.len()).unwrap_or(0)
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every record of a log. A torn last line (a crash mid-write) is skipped; so is any
/// other line that is not a record, with a warning, since only the last line can be torn.
pub fn read(path: &Path) -> Result<Vec<TrajectoryRecord>, LogError> {
    let text = std::fs::read_to_string(path).map_err(|source| LogError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let lines = text.lines().count();
    Ok(text
        .lines()
        .enumerate()
        .filter_map(|(i, l)| match serde_json::from_str(l) {
            Ok(r) => Some(r),
            Err(e) => {
                if i + 1 < lines {
                    tracing::warn!(log = %path.display(), line = i + 1, error = %e, "skipping a line that is not a trajectory record");
                }
                None
            }
        })
        .collect())
}

/// Calls `line` with each line of a log (without its newline) that is a record, in order, one
/// line in memory at a time, until it returns false. Reads at most `limit` bytes, so a reader
/// of a log being appended to stops at the length it was given. A line that is not a record
/// is skipped, as in [`read`].
pub fn for_each_line(
    path: &Path,
    limit: u64,
    mut line: impl FnMut(&[u8], TrajectoryRecord) -> bool,
) -> Result<(), LogError> {
    use std::io::BufRead as _;
    let io = |source| LogError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut reader = std::io::BufReader::with_capacity(64 << 10, file.take(limit));
    let mut buf = Vec::new();
    // A line that is not a record is reported once another follows it (only the last line
    // may be torn).
    let mut bad: Option<(usize, serde_json::Error)> = None;
    for n in 1.. {
        buf.clear();
        if reader.read_until(b'\n', &mut buf).map_err(io)? == 0 {
            break;
        }
        if let Some((at, e)) = bad.take() {
            tracing::warn!(log = %path.display(), line = at, error = %e, "skipping a line that is not a trajectory record");
        }
        let text = buf.strip_suffix(b"\n").unwrap_or(&buf);
        match serde_json::from_slice::<TrajectoryRecord>(text) {
            Ok(record) => {
                if !line(text, record) {
                    break;
                }
            }
            Err(e) => bad = Some((n, e)),
        }
    }
    Ok(())
}

/// [`for_each_line`] over the whole log, with the records alone.
pub fn for_each(
    path: &Path,
    mut record: impl FnMut(TrajectoryRecord) -> bool,
) -> Result<(), LogError> {
    for_each_line(path, u64::MAX, |_, r| record(r))
}

/// The kind of the last record of a log, read from its end without reading the whole file
/// (so that a restart does not read every log it keeps). None when the last line is torn or
/// not a record: read the whole log then.
pub fn last_kind(path: &Path) -> Result<Option<String>, LogError> {
    let io = |source| LogError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    if len < 2 {
        return Ok(None);
    }
    // The last byte must end a line; then look back for the newline before the last line.
    let mut last = [0u8; 1];
    f.seek(SeekFrom::Start(len - 1))
        .and_then(|_| f.read_exact(&mut last))
        .map_err(io)?;
    if last[0] != b'\n' {
        return Ok(None);
    }
    const CHUNK: u64 = 64 * 1024;
    let mut end = len - 1;
    let mut start = 0;
    let mut buf = Vec::new();
    'search: while end > 0 {
        let from = end.saturating_sub(CHUNK);
        buf.resize((end - from) as usize, 0);
        f.seek(SeekFrom::Start(from))
            .and_then(|_| f.read_exact(&mut buf))
            .map_err(io)?;
        if let Some(i) = buf.iter().rposition(|&b| b == b'\n') {
            start = from + i as u64 + 1;
            break 'search;
        }
        end = from;
    }
    let mut head = [0u8; 64];
    f.seek(SeekFrom::Start(start)).map_err(io)?;
    let n = f.read(&mut head).map_err(io)?;
    // Records are written by serde in field order: `{"kind":"<kind>",...`.
    let Some(rest) = head[..n].strip_prefix(b"{\"kind\":\"") else {
        return Ok(None);
    };
    let Some(q) = rest.iter().position(|&b| b == b'"') else {
        return Ok(None);
    };
    Ok(std::str::from_utf8(&rest[..q]).ok().map(str::to_string))
}
