//! An episode's workspace: the directory the agent owns, the files in it it may not change,
//! the resolution of every path a tool is given, and the collection of the solution.
//!
//! The server acts on the workspace as root while the agent owns everything in it, so no
//! operation here goes through a path string: each works from the workspace's directory fd
//! and refuses links at every component ([`fsops`]).

pub(crate) mod fsops;

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use sha2::{Digest, Sha256};

pub use fsops::{read_state_file, Resolver};
use fsops::{Kind, OpenError};

use crate::ToolError;

/// Longest path a tool may be given (the kernel's PATH_MAX).
const MAX_PATH_BYTES: usize = 4096;
/// Deepest directory level under `kernels/` that is collected.
const SOLUTION_MAX_DEPTH: usize = 8;
/// Most directory entries looked at while collecting a solution.
const SOLUTION_MAX_ENTRIES: usize = 10_000;

/// A workspace directory and the protected files in it.
#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
    /// The root, open: every operation starts here rather than at a path.
    dir: Arc<OwnedFd>,
    resolver: Resolver,
    /// Protected files: normalised path relative to the root -> pristine contents.
    protected: Arc<BTreeMap<PathBuf, Vec<u8>>>,
    /// Owner for files the tools create, when processes run under their own uid.
    owner: Option<(u32, u32)>,
}

/// The candidate's files, read from a workspace for evaluation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Solution {
    /// Path relative to the workspace root -> text.
    pub files: BTreeMap<String, String>,
    /// Entries that were not collected, and why.
    pub skipped: Vec<SkippedFile>,
}

/// An entry left out of a [`Solution`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkippedFile {
    /// Path relative to the workspace root.
    pub path: String,
    /// Why it was left out.
    pub reason: String,
}

impl Solution {
    /// One line naming what was left out and why, for the agent and the log; `None` when
    /// nothing was.
    pub fn skipped_summary(&self) -> Option<String> {
        if self.skipped.is_empty() {
            return None;
        }
        let items: Vec<String> = self
            .skipped
            .iter()
            .map(|s| format!("{} ({})", s.path, s.reason))
            .collect();
        Some(format!(
            "not collected for evaluation: {}",
            items.join(", ")
        ))
    }
}

impl Workspace {
    /// Opens an existing directory as a workspace. `owner` is the uid/gid the agent's processes
    /// run as (files the tools write are given to it).
    pub fn open(root: &Path, owner: Option<(u32, u32)>) -> Result<Self, ToolError> {
        let root = root.canonicalize().map_err(|e| ToolError::io(root, e))?;
        let c = CString::new(root.as_os_str().as_bytes())
            .map_err(|_| ToolError::InvalidArgument("workspace path contains a NUL byte".into()))?;
        // SAFETY: a valid C string; the fd returned is owned below.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(ToolError::io(&root, std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh fd nothing else owns.
        let dir = Arc::new(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        Ok(Self {
            root,
            dir,
            resolver: Resolver::detect(),
            protected: Arc::default(),
            owner,
        })
    }

    /// The same workspace resolving paths with `resolver` (to exercise the fallback walk).
    pub fn with_resolver(mut self, resolver: Resolver) -> Self {
        self.resolver = resolver;
        self
    }

    /// How paths are resolved beneath the root.
    pub fn resolver(&self) -> Resolver {
        self.resolver
    }

    /// The canonical root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The uid/gid that owns the agent's files, if any.
    pub fn owner(&self) -> Option<(u32, u32)> {
        self.owner
    }

    /// Writes a file that no tool may change (mode 0444, owned by the server). Its pristine
    /// contents are kept so that any change made behind the tools' backs can be undone.
    pub fn add_protected(&mut self, rel: &str, contents: &[u8]) -> Result<(), ToolError> {
        let rel = self.rel_path(rel)?;
        let (parent, name) = split(&rel)?;
        let dir = fsops::make_dirs(&self.dir, parent, None, false)
            .map_err(|e| self.fs_error(parent, e))?;
        fsops::write_replace(&dir, &name, contents, 0o444, None)
            .map_err(|e| self.fs_error(&rel, e))?;
        Arc::make_mut(&mut self.protected).insert(rel, contents.to_vec());
        Ok(())
    }

    /// The protected files, relative to the root.
    pub fn protected_files(&self) -> impl Iterator<Item = &Path> {
        self.protected.keys().map(PathBuf::as_path)
    }

    /// Maps a path a tool was given to a path inside the workspace, lexically: relative paths
    /// are taken from the root, `..` folds, and a path that ends up outside is refused. It
    /// does not look at the filesystem; the operations on the result refuse links.
    pub fn resolve(&self, given: &str) -> Result<PathBuf, ToolError> {
        self.resolve_from(&self.root, given)
    }

    /// Like [`Workspace::resolve`], with relative paths taken from `base` (inside the workspace).
    pub fn resolve_from(&self, base: &Path, given: &str) -> Result<PathBuf, ToolError> {
        if given.is_empty() {
            return Err(ToolError::InvalidArgument("path is empty".into()));
        }
        if given.contains('\0') {
            return Err(ToolError::InvalidArgument(
                "path contains a NUL byte".into(),
            ));
        }
        if given.len() > MAX_PATH_BYTES {
            return Err(ToolError::InvalidArgument(format!(
                "path is {} bytes long, over the limit of {MAX_PATH_BYTES}",
                given.len()
            )));
        }
        let joined = if Path::new(given).is_absolute() {
            PathBuf::from(given)
        } else {
            base.join(given)
        };
        let lexical = normalize(&joined);
        if !lexical.starts_with(&self.root) {
            return Err(ToolError::OutsideWorkspace(given.to_string()));
        }
        Ok(lexical)
    }

    /// The path a tool was given, relative to the root and normalised (empty for the root).
    pub(crate) fn rel_path(&self, given: &str) -> Result<PathBuf, ToolError> {
        let abs = self.resolve(given)?;
        Ok(abs
            .strip_prefix(&self.root)
            .map(Path::to_path_buf)
            .unwrap_or_default())
    }

    /// The path relative to the root, for messages.
    pub fn display(&self, path: &Path) -> String {
        let rel = path.strip_prefix(&self.root).unwrap_or(path);
        if rel.as_os_str().is_empty() {
            ".".into()
        } else {
            rel.display().to_string()
        }
    }

    /// Refuses a write to a protected file (`path` absolute inside the root, or relative).
    pub fn check_writable(&self, path: &Path) -> Result<(), ToolError> {
        let rel = normalize(path.strip_prefix(&self.root).unwrap_or(path));
        if self.protected.contains_key(&rel) {
            return Err(ToolError::ReadOnly(rel.display().to_string()));
        }
        Ok(())
    }

    /// Writes `contents` to `path` (absolute inside the root, or relative to it) atomically,
    /// keeping an existing file's permission bits and giving new files and directories to
    /// the workspace owner. Links are never followed, nor replaced.
    pub fn write_atomic(&self, path: &Path, contents: &[u8]) -> Result<(), ToolError> {
        let given = path
            .to_str()
            .ok_or_else(|| ToolError::InvalidArgument("path is not UTF-8".into()))?;
        self.write_rel(&self.rel_path(given)?, contents).map(|_| ())
    }

    /// Writes a file given by its normalised relative path; returns whether it was created.
    pub(crate) fn write_rel(&self, rel: &Path, contents: &[u8]) -> Result<bool, ToolError> {
        self.check_writable(rel)?;
        let (parent, name) = split(rel)?;
        let dir = fsops::make_dirs(&self.dir, parent, self.owner, false)
            .map_err(|e| self.fs_error(parent, e))?;
        let existing = fsops::stat_at(&dir, &name).map_err(|e| self.fs_error(rel, e))?;
        let mode = match existing.map(|st| (Kind::of_mode(st.st_mode), st.st_mode)) {
            None => 0o644,
            Some((Kind::Regular, mode)) => mode & 0o777,
            Some((Kind::Symlink, _)) => return Err(ToolError::Link(rel.display().to_string())),
            Some((kind, _)) => {
                return Err(ToolError::NotRegular {
                    path: rel.display().to_string(),
                    kind: kind.describe(),
                })
            }
        };
        fsops::write_replace(&dir, &name, contents, mode, self.owner)
            .map_err(|e| self.fs_error(rel, e))?;
        Ok(existing.is_none())
    }

    /// Opens a regular file for reading (never through a link, never a FIFO or device).
    pub(crate) fn open_file(&self, rel: &Path) -> Result<(File, u64), ToolError> {
        match fsops::open_regular(self.resolver, &self.dir, rel) {
            Ok((_, st)) if self.foreign_hard_link(&st) => {
                Err(ToolError::HardLink(self.display(rel)))
            }
            Ok((file, st)) => Ok((file, st.st_size as u64)),
            Err(e) => Err(self.open_error(rel, e)),
        }
    }

    /// A second name for a file the agent does not own: where the kernel lets users hard-link
    /// files they cannot write (`fs.protected_hardlinks` off), a link to a host file would
    /// otherwise be read as root. Files the agent or the tools made are the owner's, and
    /// protected files have a single name.
    fn foreign_hard_link(&self, st: &libc::stat) -> bool {
        self.owner
            .is_some_and(|(uid, _)| st.st_nlink > 1 && st.st_uid != uid)
    }

    /// Reads at most `cap` bytes of a regular file; `None` when it does not exist.
    pub(crate) fn read_capped(
        &self,
        rel: &Path,
        cap: u64,
    ) -> Result<Option<fsops::Capped>, ToolError> {
        let (mut file, size) = match self.open_file(rel) {
            Ok(f) => f,
            Err(ToolError::Io { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        fsops::read_capped(&mut file, size, cap)
            .map(Some)
            .map_err(|e| self.fs_error(rel, e))
    }

    /// Opens a directory beneath the root (never through a link).
    pub(crate) fn open_dir(&self, rel: &Path) -> Result<OwnedFd, ToolError> {
        fsops::open_dir(self.resolver, &self.dir, rel).map_err(|e| match self.fs_error(rel, e) {
            ToolError::Io { error, .. } if error.raw_os_error() == Some(libc::ENOTDIR) => {
                ToolError::InvalidArgument(format!("{} is not a directory", self.display(rel)))
            }
            other => other,
        })
    }

    fn open_error(&self, rel: &Path, e: OpenError) -> ToolError {
        let path = self.display(rel);
        match e {
            OpenError::Missing => ToolError::Io {
                path,
                error: std::io::ErrorKind::NotFound.into(),
            },
            OpenError::Link => ToolError::Link(
                self.first_link(rel)
                    .map(|l| self.display(&l))
                    .unwrap_or(path),
            ),
            OpenError::NotRegular(kind) => ToolError::NotRegular {
                path,
                kind: kind.describe(),
            },
            OpenError::Io(e) => self.fs_error(rel, e),
        }
    }

    /// An I/O error on a relative path, with a link in the way said as such (and named:
    /// the kernel reports a link met where a directory was wanted as ENOTDIR).
    fn fs_error(&self, rel: &Path, e: std::io::Error) -> ToolError {
        match e.raw_os_error() {
            Some(libc::ELOOP | libc::ENOTDIR) => match self.first_link(rel) {
                Some(link) => ToolError::Link(self.display(&link)),
                None if e.raw_os_error() == Some(libc::ELOOP) => ToolError::Link(self.display(rel)),
                None => ToolError::Io {
                    path: self.display(rel),
                    error: e,
                },
            },
            Some(libc::EXDEV) => ToolError::OutsideWorkspace(self.display(rel)),
            _ => ToolError::Io {
                path: self.display(rel),
                error: e,
            },
        }
    }

    /// The first component of `rel` that is a symbolic link, if any (for messages only).
    fn first_link(&self, rel: &Path) -> Option<PathBuf> {
        let mut cur = fsops::open_dir(self.resolver, &self.dir, Path::new("")).ok()?;
        let mut prefix = PathBuf::new();
        for part in rel.iter() {
            prefix.push(part);
            let name = CString::new(part.as_bytes()).ok()?;
            let st = fsops::stat_at(&cur, &name).ok()??;
            match Kind::of_mode(st.st_mode) {
                Kind::Symlink => return Some(prefix),
                Kind::Directory => {
                    cur = fsops::open_dir(self.resolver, &cur, Path::new(part)).ok()?
                }
                _ => return None,
            }
        }
        None
    }

    /// Puts back any protected file that was changed, removed or replaced (by a process
    /// running as the workspace owner, say). Whatever is in its place (a link, a FIFO, a
    /// directory) is replaced or moved aside, never followed. Returns the files restored.
    pub fn restore_protected(&self) -> Result<Vec<String>, ToolError> {
        let mut restored = Vec::new();
        for (rel, pristine) in self.protected.iter() {
            let (parent, name) = split(rel)?;
            let dir = fsops::make_dirs(&self.dir, parent, None, true)
                .map_err(|e| self.fs_error(parent, e))?;
            if self.is_intact(&dir, &name, pristine) {
                continue;
            }
            if fsops::stat_at(&dir, &name)
                .ok()
                .flatten()
                .is_some_and(|st| Kind::of_mode(st.st_mode) == Kind::Directory)
            {
                let aside = fsops::move_aside(&dir, &name).map_err(|e| self.fs_error(rel, e))?;
                tracing::debug!(file = %rel.display(), moved_to = %aside, "a directory stood in place of a protected file");
            }
            fsops::write_replace(&dir, &name, pristine, 0o444, None)
                .map_err(|e| self.fs_error(rel, e))?;
            restored.push(rel.display().to_string());
        }
        Ok(restored)
    }

    /// The protected file is the server's own regular 0444 file with the pristine bytes.
    fn is_intact(&self, dir: &OwnedFd, name: &std::ffi::CStr, pristine: &[u8]) -> bool {
        let Ok((mut file, st)) = fsops::open_regular(
            self.resolver,
            dir,
            Path::new(OsStr::from_bytes(name.to_bytes())),
        ) else {
            return false;
        };
        // SAFETY: geteuid has no preconditions.
        let server = unsafe { libc::geteuid() };
        if st.st_mode & 0o7777 != 0o444
            || st.st_uid != server
            || st.st_size as usize != pristine.len()
        {
            return false;
        }
        fsops::read_capped(&mut file, st.st_size as u64, pristine.len() as u64)
            .is_ok_and(|c| !c.truncated && c.bytes == pristine)
    }

    /// The candidate's files for evaluation: `model_new.py` and everything under `kernels/`,
    /// read as regular text files only, never through a link, at most `max_bytes` in all.
    /// What is left out (links, FIFOs, binary files, directories too deep) is listed in
    /// [`Solution::skipped`]; more than `max_bytes` is an error.
    pub fn collect_solution(&self, max_bytes: u64) -> Result<Solution, ToolError> {
        self.collect(&["model_new.py"], &["kernels"], max_bytes)
    }

    /// Like [`Workspace::collect_solution`] for any files and directories (relative to the
    /// root): a recall task's answer file, say.
    pub fn collect(
        &self,
        files: &[&str],
        dirs: &[&str],
        max_bytes: u64,
    ) -> Result<Solution, ToolError> {
        let mut c = Collector {
            ws: self,
            solution: Solution::default(),
            left: max_bytes,
            limit: max_bytes,
            entries: 0,
        };
        for f in files {
            let rel = self.rel_path(f)?;
            let (parent, name) = split(&rel)?;
            match fsops::open_dir(self.resolver, &self.dir, parent) {
                Ok(dir) => c.file(&dir, &rel, Path::new(OsStr::from_bytes(name.to_bytes())))?,
                Err(e) => c.skip_dir_error(&rel, e),
            }
        }
        for d in dirs {
            let rel = self.rel_path(d)?;
            match fsops::open_dir(self.resolver, &self.dir, &rel) {
                Ok(dir) => c.dir(&dir, &rel, 1)?,
                Err(e) => c.skip_dir_error(&rel, e),
            }
        }
        Ok(c.solution)
    }

    /// Total bytes of regular files in the workspace (for the disk quota). Never follows a link.
    pub fn disk_usage(&self) -> u64 {
        walkdir::WalkDir::new(&self.root)
            .into_iter()
            .flatten()
            .filter_map(|e| e.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.blocks() * 512)
            .sum()
    }
}

/// Walks the solution's files, keeping the byte budget.
struct Collector<'a> {
    ws: &'a Workspace,
    solution: Solution,
    left: u64,
    limit: u64,
    entries: usize,
}

impl Collector<'_> {
    fn skip(&mut self, rel: &Path, reason: impl Into<String>) {
        self.solution.skipped.push(SkippedFile {
            path: rel.display().to_string(),
            reason: reason.into(),
        });
    }

    /// Records why `rel` (or the directory it is in) could not be opened.
    fn skip_dir_error(&mut self, rel: &Path, e: std::io::Error) {
        match self.ws.fs_error(rel, e) {
            ToolError::Io { error, .. } if error.kind() == std::io::ErrorKind::NotFound => {}
            ToolError::Io { error, .. } if error.raw_os_error() == Some(libc::ENOTDIR) => {
                self.skip(rel, "not a directory")
            }
            ToolError::Link(link) if link == rel.display().to_string() => {
                self.skip(rel, "a symbolic link (links are not followed)")
            }
            ToolError::Link(link) => self.skip(
                rel,
                format!("{link} is a symbolic link (links are not followed)"),
            ),
            other => self.skip(rel, other.to_string()),
        }
    }

    /// Collects one file, `name` inside the open `dir`, shown as `rel`.
    fn file(&mut self, dir: &OwnedFd, rel: &Path, name: &Path) -> Result<(), ToolError> {
        let (mut file, st) = match fsops::open_regular(self.ws.resolver, dir, name) {
            Ok(f) => f,
            Err(OpenError::Missing) => return Ok(()),
            Err(OpenError::Link) => {
                self.skip(rel, "a symbolic link (links are not followed)");
                return Ok(());
            }
            Err(OpenError::NotRegular(kind)) => {
                self.skip(rel, kind.describe());
                return Ok(());
            }
            Err(OpenError::Io(e)) => {
                self.skip(rel, e.to_string());
                return Ok(());
            }
        };
        if self.ws.foreign_hard_link(&st) {
            self.skip(rel, "a hard link to a file the agent does not own");
            return Ok(());
        }
        let too_large = || ToolError::TooLarge {
            what: format!("the solution's files (at {})", rel.display()),
            limit: self.limit,
        };
        if st.st_size as u64 > self.left {
            return Err(too_large());
        }
        let capped = fsops::read_capped(&mut file, st.st_size as u64, self.left)
            .map_err(|e| self.ws.fs_error(rel, e))?;
        if capped.truncated {
            return Err(too_large());
        }
        self.left -= capped.bytes.len() as u64;
        match String::from_utf8(capped.bytes) {
            Ok(text) if !text.contains('\0') => {
                self.solution.files.insert(rel.display().to_string(), text);
            }
            _ => self.skip(rel, "not UTF-8 text"),
        }
        Ok(())
    }

    fn dir(&mut self, dir: &OwnedFd, rel: &Path, depth: usize) -> Result<(), ToolError> {
        let room = SOLUTION_MAX_ENTRIES.saturating_sub(self.entries);
        let (mut entries, stopped) =
            fsops::list_dir(dir, room).map_err(|e| self.ws.fs_error(rel, e))?;
        self.entries += entries.len();
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        for e in entries {
            let child = rel.join(&e.name);
            match e.kind {
                Kind::Regular => self.file(dir, &child, Path::new(&e.name))?,
                Kind::Directory if depth >= SOLUTION_MAX_DEPTH => {
                    self.skip(&child, format!("deeper than {SOLUTION_MAX_DEPTH} levels"));
                }
                Kind::Directory => match fsops::open_dir(self.ws.resolver, dir, Path::new(&e.name))
                {
                    Ok(sub) => self.dir(&sub, &child, depth + 1)?,
                    Err(err) => self.skip_dir_error(&child, err),
                },
                Kind::Symlink => self.skip(&child, "a symbolic link (links are not followed)"),
                other => self.skip(&child, other.describe()),
            }
        }
        if stopped {
            self.skip(
                rel,
                format!("more than {SOLUTION_MAX_ENTRIES} entries; the rest were not looked at"),
            );
        }
        Ok(())
    }
}

/// Splits a normalised relative path into its parent and its last name.
fn split(rel: &Path) -> Result<(&Path, CString), ToolError> {
    let name = rel.file_name().ok_or_else(|| {
        ToolError::InvalidArgument("the path names the workspace itself, not a file".into())
    })?;
    let name = CString::new(name.as_bytes())
        .map_err(|_| ToolError::InvalidArgument("path contains a NUL byte".into()))?;
    Ok((rel.parent().unwrap_or(Path::new("")), name))
}

/// Lexical normalisation: removes `.` and folds `..` without touching the filesystem.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// Hex SHA-256 of some bytes (used for content hashes across the crate's users).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}
