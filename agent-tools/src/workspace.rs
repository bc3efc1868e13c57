//! An episode's workspace: the directory the agent owns, the files in it it may not change,
//! and the resolution of every path a tool is given.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::ToolError;

/// A workspace directory and the protected files in it.
#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
    /// Protected files: path relative to the root -> pristine contents.
    protected: BTreeMap<PathBuf, Vec<u8>>,
    /// Owner for files the tools create, when processes run under their own uid.
    owner: Option<(u32, u32)>,
}

impl Workspace {
    /// Opens an existing directory as a workspace. `owner` is the uid/gid the agent's processes
    /// run as (files the tools write are given to it).
    pub fn open(root: &Path, owner: Option<(u32, u32)>) -> Result<Self, ToolError> {
        let root = root.canonicalize().map_err(|e| ToolError::io(root, e))?;
        Ok(Self { root, protected: BTreeMap::new(), owner })
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
        let path = self.root.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| ToolError::io(parent, e))?;
        }
        write_with_mode(&path, contents, 0o444)?;
        self.protected.insert(PathBuf::from(rel), contents.to_vec());
        Ok(())
    }

    /// The protected files, relative to the root.
    pub fn protected_files(&self) -> impl Iterator<Item = &Path> {
        self.protected.keys().map(PathBuf::as_path)
    }

    /// Resolves a path a tool was given to a path inside the workspace. Relative paths are
    /// taken from the workspace root; `..` that climbs out, absolute paths elsewhere and
    /// symlinks that lead out are refused.
    pub fn resolve(&self, given: &str) -> Result<PathBuf, ToolError> {
        self.resolve_from(&self.root, given)
    }

    /// Like [`Workspace::resolve`], with relative paths taken from `base` (inside the workspace).
    pub fn resolve_from(&self, base: &Path, given: &str) -> Result<PathBuf, ToolError> {
        if given.is_empty() {
            return Err(ToolError::InvalidArgument("path is empty".into()));
        }
        if given.contains('\0') {
            return Err(ToolError::InvalidArgument("path contains a NUL byte".into()));
        }
        let joined = if Path::new(given).is_absolute() { PathBuf::from(given) } else { base.join(given) };
        let lexical = normalize(&joined);
        if !lexical.starts_with(&self.root) {
            return Err(ToolError::OutsideWorkspace(given.to_string()));
        }
        // Resolve symlinks through the longest prefix that exists; the rest cannot be a link.
        let mut existing = lexical.as_path();
        let mut tail = Vec::new();
        while std::fs::symlink_metadata(existing).is_err() {
            match (existing.parent(), existing.file_name()) {
                (Some(parent), Some(name)) => {
                    tail.push(name.to_owned());
                    existing = parent;
                }
                _ => break,
            }
        }
        let mut real = existing.canonicalize().map_err(|e| ToolError::io(existing, e))?;
        for name in tail.iter().rev() {
            real.push(name);
        }
        if !real.starts_with(&self.root) {
            return Err(ToolError::OutsideWorkspace(given.to_string()));
        }
        Ok(real)
    }

    /// The path relative to the root, for messages.
    pub fn display(&self, path: &Path) -> String {
        path.strip_prefix(&self.root).unwrap_or(path).display().to_string()
    }

    /// Refuses a write to a protected file.
    pub fn check_writable(&self, path: &Path) -> Result<(), ToolError> {
        let rel = path.strip_prefix(&self.root).unwrap_or(path);
        if self.protected.contains_key(rel) {
            return Err(ToolError::ReadOnly(rel.display().to_string()));
        }
        Ok(())
    }

    /// Writes `contents` to `path` atomically (temp file in the same directory, then rename),
    /// keeping an existing file's mode and giving new files to the workspace owner.
    pub fn write_atomic(&self, path: &Path, contents: &[u8]) -> Result<(), ToolError> {
        self.check_writable(path)?;
        let parent = path.parent().ok_or_else(|| ToolError::InvalidArgument("no parent directory".into()))?;
        if !parent.exists() {
            std::fs::create_dir_all(parent).map_err(|e| ToolError::io(parent, e))?;
            self.give_to_owner(parent)?;
        }
        let mode = std::fs::metadata(path).map(|m| m.permissions().mode() & 0o7777).unwrap_or(0o644);
        write_with_mode(path, contents, mode)?;
        self.give_to_owner(path)
    }

    fn give_to_owner(&self, path: &Path) -> Result<(), ToolError> {
        if let Some((uid, gid)) = self.owner {
            std::os::unix::fs::lchown(path, Some(uid), Some(gid)).map_err(|e| ToolError::io(path, e))?;
        }
        Ok(())
    }

    /// Puts back any protected file that was changed, removed or replaced (by a process
    /// running as the workspace owner, say). Returns the files restored.
    pub fn restore_protected(&self) -> Result<Vec<String>, ToolError> {
        let mut restored = Vec::new();
        for (rel, pristine) in &self.protected {
            let path = self.root.join(rel);
            let intact = std::fs::symlink_metadata(&path)
                .ok()
                .filter(|m| m.file_type().is_file() && m.mode() & 0o7777 == 0o444)
                .and_then(|_| std::fs::read(&path).ok())
                .is_some_and(|now| now == *pristine);
            if !intact {
                if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
                    std::fs::remove_dir_all(&path).map_err(|e| ToolError::io(&path, e))?;
                }
                write_with_mode(&path, pristine, 0o444)?;
                restored.push(rel.display().to_string());
            }
        }
        Ok(restored)
    }

    /// Total bytes of regular files in the workspace (for the disk quota).
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

fn write_with_mode(path: &Path, contents: &[u8], mode: u32) -> Result<(), ToolError> {
    let parent = path.parent().ok_or_else(|| ToolError::InvalidArgument("no parent directory".into()))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = parent.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(contents)?;
        // No fsync: a workspace does not outlive a server restart (the episode is truncated),
        // and the rename alone keeps readers from seeing a half-written file.
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(ToolError::io(path, e));
    }
    Ok(())
}

/// Hex SHA-256 of some bytes (used for content hashes across the crate's users).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}
