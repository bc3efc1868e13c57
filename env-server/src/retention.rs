//! What the server keeps on disk, and for how long: trajectory logs by count, age and bytes;
//! the build cache as a least-recently-used set bounded in bytes; and, at start, whatever a
//! crash left in `episodes/` and `evals/`.
//!
//! Everything here is blocking file work: call it from a blocking thread. Removal never
//! follows a symbolic link (`std::fs::remove_dir_all` removes a link, not its target), and
//! sizes count the blocks a file holds (a sparse file counts what it uses).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// How many trajectory logs to keep. Each bound is optional; the newest logs are kept first.
/// Logs of live episodes are never removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrajectoryRetention {
    /// Keep at most this many logs.
    pub keep: Option<usize>,
    /// Remove logs last written longer ago than this.
    pub max_age: Option<Duration>,
    /// Keep at most this many bytes of logs.
    pub max_bytes: Option<u64>,
}

impl TrajectoryRetention {
    /// Whether any bound is set.
    pub fn is_bounded(&self) -> bool {
        self.keep.is_some() || self.max_age.is_some() || self.max_bytes.is_some()
    }
}

/// The build cache's bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildCacheRetention {
    /// Most bytes of compiled extensions kept.
    pub max_bytes: u64,
    /// An entry used (its directory's mtime) this recently is never removed, even over the
    /// bound: an evaluation may be building into it.
    pub in_use_window: Duration,
}

/// What a pass removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removed {
    /// Entries (files or directories) removed.
    pub entries: usize,
    /// Their bytes.
    pub bytes: u64,
}

impl Removed {
    fn add(&mut self, bytes: u64) {
        self.entries += 1;
        self.bytes += bytes;
    }
}

/// Bytes a tree holds on disk, not following links. Stops counting past `limit` (a walk of a
/// hostile tree is bounded by what the caller wants to know).
pub fn tree_bytes(root: &Path, limit: u64) -> u64 {
    let mut total = 0u64;
    for e in walkdir::WalkDir::new(root)
        .follow_links(false)
        .into_iter()
        .flatten()
    {
        if let Ok(m) = e.metadata() {
            if m.is_file() {
                total = total.saturating_add(m.blocks() * 512);
                if total > limit {
                    break;
                }
            }
        }
    }
    total
}

fn mtime(m: &std::fs::Metadata) -> SystemTime {
    m.modified().unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Removes a directory entry of the server's: a tree, or a file or link as itself.
pub fn remove_entry(path: &Path) -> std::io::Result<()> {
    let m = std::fs::symlink_metadata(path)?;
    if m.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

/// Applies `policy` to the logs in `dir` (`<id>.jsonl`), sparing the ids in `live`.
pub fn prune_trajectories(
    dir: &Path,
    policy: &TrajectoryRetention,
    live: &HashSet<String>,
) -> Removed {
    let mut removed = Removed::default();
    if !policy.is_bounded() {
        return removed;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return removed;
    };
    let mut logs: Vec<(SystemTime, u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let path = e.path();
            let id = path.file_stem()?.to_str()?;
            if path.extension().is_none_or(|x| x != "jsonl") || live.contains(id) {
                return None;
            }
            let m = std::fs::symlink_metadata(&path).ok()?;
            m.is_file().then(|| (mtime(&m), m.len(), path))
        })
        .collect();
    // Newest first: what is kept is a prefix.
    logs.sort_by_key(|e| std::cmp::Reverse(e.0));
    let now = SystemTime::now();
    let mut kept_bytes = 0u64;
    for (i, (time, len, path)) in logs.iter().enumerate() {
        let too_many = policy.keep.is_some_and(|k| i >= k);
        let too_old = policy
            .max_age
            .is_some_and(|a| now.duration_since(*time).unwrap_or_default() > a);
        let too_big = policy
            .max_bytes
            .is_some_and(|b| kept_bytes.saturating_add(*len) > b);
        if too_many || too_old || too_big {
            match std::fs::remove_file(path) {
                Ok(()) => removed.add(*len),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "removing a trajectory log")
                }
            }
        } else {
            kept_bytes += len;
        }
    }
    removed
}

/// Removes the least recently used entries of the build cache (`dir/<hash>/`, by the mtime of
/// the entry's directory, which the evaluator touches on every use) until the cache holds at
/// most `policy.max_bytes`, sparing entries used within `policy.in_use_window`.
pub fn prune_build_cache(dir: &Path, policy: &BuildCacheRetention) -> Removed {
    let now = SystemTime::now();
    prune_build_cache_sparing(dir, policy.max_bytes, |_, used| {
        now.duration_since(used).unwrap_or_default() < policy.in_use_window
    })
}

/// Removes the least recently used entries of the build cache until it holds at most
/// `max_bytes`, sparing those for which `spare(entry, last_used)` holds (the evaluator spares
/// the entries of evaluations in flight, whatever their age).
pub fn prune_build_cache_sparing(
    dir: &Path,
    max_bytes: u64,
    spare: impl Fn(&Path, SystemTime) -> bool,
) -> Removed {
    let mut removed = Removed::default();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return removed;
    };
    let mut all: Vec<(SystemTime, u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let path = e.path();
            let m = std::fs::symlink_metadata(&path).ok()?;
            let bytes = if m.is_dir() {
                tree_bytes(&path, u64::MAX)
            } else {
                m.blocks() * 512
            };
            Some((mtime(&m), bytes, path))
        })
        .collect();
    let mut total: u64 = all.iter().map(|e| e.1).sum();
    // Oldest first: what is removed is a prefix.
    all.sort_by_key(|e| e.0);
    for (time, bytes, path) in all {
        if total <= max_bytes {
            break;
        }
        if spare(&path, time) {
            continue;
        }
        match remove_entry(&path) {
            Ok(()) => {
                total -= bytes;
                removed.add(bytes);
                // The server's record that these sources built (evaluation/build_cache.rs) goes too.
                if let (Some(parent), Some(name)) = (dir.parent(), path.file_name()) {
                    let _ = std::fs::remove_file(parent.join("build-ok").join(name));
                }
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "removing a build cache entry")
            }
        }
    }
    removed
}

/// Marks a build cache entry as used now (its directory's mtime), for [`prune_build_cache`].
pub fn touch(entry: &Path) -> std::io::Result<()> {
    std::fs::File::open(entry)?.set_modified(SystemTime::now())
}

/// At start, before serving: nothing is live yet, so everything under `episodes/` (the
/// workspaces of episodes a crash interrupted, already marked truncated by recovery, or of
/// closed ones whose removal did not finish) and `evals/` (evaluations a crash cut short) is
/// a leftover.
pub fn sweep_leftovers(data_dir: &Path) -> Removed {
    let mut removed = Removed::default();
    for sub in ["episodes", "evals"] {
        let Ok(entries) = std::fs::read_dir(data_dir.join(sub)) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            let bytes = tree_bytes(&path, u64::MAX);
            match remove_entry(&path) {
                Ok(()) => removed.add(bytes),
                Err(err) => {
                    tracing::warn!(path = %path.display(), error = %err, "removing a leftover")
                }
            }
        }
    }
    removed
}

/// The retention policy and where it applies.
#[derive(Debug, Clone)]
pub struct Retention {
    /// The data directory.
    pub data_dir: PathBuf,
    /// Trajectory logs kept.
    pub trajectories: TrajectoryRetention,
    /// The build cache's bound.
    pub build_cache: BuildCacheRetention,
    /// How often it runs.
    pub interval: Duration,
}

impl Retention {
    /// One pass over trajectory logs (sparing `live` episodes) and the build cache. Blocking.
    pub fn run(&self, live: &std::collections::HashSet<String>) {
        let logs = prune_trajectories(
            &self.data_dir.join("trajectories"),
            &self.trajectories,
            live,
        );
        let builds = prune_build_cache(&self.data_dir.join("build-cache"), &self.build_cache);
        if logs.entries + builds.entries > 0 {
            tracing::info!(
                logs = logs.entries,
                log_bytes = logs.bytes,
                builds = builds.entries,
                build_bytes = builds.bytes,
                "retention removed"
            );
        }
    }
}
