//! `Glob`: files matching a pattern, newest first, never outside the workspace. The walk
//! goes through directory fds without following links, and the pattern, the depth and the
//! number of entries looked at are all capped.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use env_api::observation::{GlobData, ToolData};

use super::{GlobArgs, ToolError, ToolLimits, ToolOutput};
use crate::workspace::fsops::{self, Kind};
use crate::workspace::Workspace;

/// What a walk found and where it stopped.
struct Walk<'a> {
    ws: &'a Workspace,
    matcher: globset::GlobMatcher,
    limits: &'a ToolLimits,
    /// (mtime seconds, nanoseconds, path shown) of each match.
    hits: Vec<(i64, i64, String)>,
    entries: usize,
    too_deep: bool,
    stopped: bool,
}

impl Walk<'_> {
    /// Walks the open directory `dir`, which is `rel` below the search base and `shown`
    /// relative to the workspace root, `depth` levels down.
    fn dir(&mut self, dir: &OwnedFd, rel: &Path, shown: &Path, depth: usize) {
        let room = self.limits.max_glob_entries.saturating_sub(self.entries);
        let Ok((entries, stopped)) = fsops::list_dir(dir, room) else {
            return;
        };
        self.entries += entries.len();
        self.stopped |= stopped;
        for e in entries {
            let child = rel.join(&e.name);
            match e.kind {
                Kind::Regular if self.matcher.is_match(&child) => {
                    let Ok(name) = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(
                        e.name.as_os_str(),
                    )) else {
                        continue;
                    };
                    // The entry may have changed since it was listed: only a regular file counts.
                    if let Ok(Some(st)) = fsops::stat_at(dir, &name) {
                        if Kind::of_mode(st.st_mode) == Kind::Regular {
                            self.hits.push((
                                st.st_mtime,
                                st.st_mtime_nsec,
                                shown.join(&e.name).display().to_string(),
                            ));
                        }
                    }
                }
                Kind::Directory if depth >= self.limits.max_glob_depth => self.too_deep = true,
                Kind::Directory => {
                    if let Ok(sub) = fsops::open_dir(self.ws.resolver(), dir, Path::new(&e.name)) {
                        self.dir(&sub, &child, &shown.join(&e.name), depth + 1);
                    }
                }
                _ => {}
            }
            if self.stopped {
                return;
            }
        }
    }
}

/// Refuses patterns too long or too wild to match cheaply.
fn check_pattern(pattern: &str, limits: &ToolLimits) -> Result<(), ToolError> {
    if pattern.len() > limits.max_glob_pattern_len {
        return Err(ToolError::InvalidArgument(format!(
            "the pattern is {} bytes long, over the limit of {}",
            pattern.len(),
            limits.max_glob_pattern_len
        )));
    }
    let wildcards = pattern
        .chars()
        .filter(|c| matches!(c, '*' | '?' | '[' | '{'))
        .count();
    if wildcards > limits.max_glob_wildcards {
        return Err(ToolError::InvalidArgument(format!(
            "the pattern has {wildcards} wildcards, over the limit of {}; use a simpler pattern",
            limits.max_glob_wildcards
        )));
    }
    Ok(())
}

pub(super) fn run(
    ws: &Workspace,
    args: &GlobArgs,
    limits: &ToolLimits,
) -> Result<ToolOutput, ToolError> {
    check_pattern(&args.pattern, limits)?;
    let base_rel = match &args.path {
        Some(p) => ws.rel_path(p)?,
        None => PathBuf::new(),
    };
    let base_fd = ws.open_dir(&base_rel)?;
    // A pattern given as an absolute path inside the workspace is taken relative to it.
    let base_abs = ws.root().join(&base_rel);
    let pattern = match args
        .pattern
        .strip_prefix(&format!("{}/", base_abs.display()))
    {
        Some(rel) => rel.to_string(),
        None if args.pattern.starts_with('/') => {
            return Err(ToolError::OutsideWorkspace(args.pattern.clone()));
        }
        None => args.pattern.clone(),
    };
    if pattern.split('/').any(|c| c == "..") {
        return Err(ToolError::OutsideWorkspace(args.pattern.clone()));
    }
    let matcher = globset::GlobBuilder::new(&pattern)
        .literal_separator(true)
        .build()
        .map_err(|e| ToolError::InvalidArgument(format!("bad glob pattern: {e}")))?
        .compile_matcher();
    let mut walk = Walk {
        ws,
        matcher,
        limits,
        hits: Vec::new(),
        entries: 0,
        too_deep: false,
        stopped: false,
    };
    walk.dir(&base_fd, Path::new(""), &base_rel, 1);
    let mut hits = walk.hits;
    hits.sort_by(|a, b| (b.0, b.1).cmp(&(a.0, a.1)).then_with(|| a.2.cmp(&b.2)));
    let total = hits.len();
    let max = limits.max_glob_results;
    let paths: Vec<String> = hits.into_iter().take(max).map(|(_, _, p)| p).collect();
    let mut text = if paths.is_empty() {
        "No files found".to_string()
    } else {
        paths.join("\n")
    };
    if total > max {
        text.push_str(&format!(
            "\n[{} more matches not shown; narrow the pattern]",
            total - max
        ));
    }
    if walk.too_deep {
        text.push_str(&format!(
            "\n[directories deeper than {} levels were not searched]",
            limits.max_glob_depth
        ));
    }
    if walk.stopped {
        text.push_str(&format!(
            "\n[the search stopped after {} entries; narrow the path]",
            limits.max_glob_entries
        ));
    }
    Ok(ToolOutput::ok(
        text,
        ToolData::Glob(GlobData {
            complete: !walk.too_deep && !walk.stopped,
            paths,
            total,
        }),
    ))
}
