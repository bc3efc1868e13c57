//! An evaluation's directory (its parts owned by the server, the judge's uid and the worker's),
//! its FIFOs and removal; the build-cache entry's preparation; the judges' compile cache per
//! device slot and its hand-over to the judge holding the lease.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use agent_tools::create_private_dir;
use kernelbench::Task;

use super::volume::VolumeDirs;
use super::{io_err, EvalError};

/// One evaluation's directory. The root, `task.py`, `source/` (the judge's copy of the
/// solution, for its static check) and `xfer/` belong to the server; `judge/` and `xfer/in/`
/// to the judge's uid. The two FIFOs are each writable by one side and readable by the other.
/// What the worker writes (`candidate`, `tmp`, `out`) is on the evaluation's volume
/// (`volume.rs`), not here.
pub(super) struct EvalDirs {
    pub root: PathBuf,
    pub task: PathBuf,
    pub candidate: PathBuf,
    pub source: PathBuf,
    pub tmp: PathBuf,
    pub judge: PathBuf,
    pub inputs: PathBuf,
    pub out: PathBuf,
    pub req: PathBuf,
    pub rep: PathBuf,
}

impl EvalDirs {
    fn create(
        dir: &Path,
        w: &VolumeDirs,
        task_source: &str,
        files: &BTreeMap<String, String>,
        judge: Option<(u32, u32)>,
        worker: Option<(u32, u32)>,
    ) -> std::io::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let d = Self {
            root: dir.to_path_buf(),
            task: dir.join("task.py"),
            candidate: w.candidate.clone(),
            source: dir.join("source"),
            tmp: w.tmp.clone(),
            judge: dir.join("judge"),
            inputs: dir.join("xfer/in"),
            out: w.out.clone(),
            req: dir.join("xfer/req"),
            rep: dir.join("xfer/rep"),
        };
        let mode =
            |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m));
        std::fs::create_dir_all(dir)?;
        mode(dir, 0o755)?;
        std::fs::create_dir_all(dir.join("xfer"))?;
        mode(&dir.join("xfer"), 0o755)?;
        create_private_dir(&d.judge, judge)?;
        // Readable by the other side: the judge reads the worker's outputs, the worker the
        // judge's inputs (each file inside says who may read it).
        create_private_dir(&d.inputs, judge)?;
        mode(&d.inputs, 0o755)?;
        std::fs::write(&d.task, task_source)?;
        mode(&d.task, 0o444)?;
        std::fs::create_dir_all(&d.source)?;
        for (name, text) in files {
            for (base, owner) in [(&d.candidate, worker), (&d.source, None)] {
                let p = base.join(name);
                if let Some(parent) = p.parent() {
                    std::fs::create_dir_all(parent)?;
                    chown(parent, owner);
                }
                std::fs::write(&p, text)?;
                chown(&p, owner);
            }
        }
        make_fifo(&d.req, judge, worker)?;
        make_fifo(&d.rep, worker, judge)?;
        Ok(d)
    }
}

impl EvalDirs {
    /// [`EvalDirs::create`] for `task` and `files` in `dir` and on the volume `w`, on a
    /// blocking thread (directory set-up is blocking file work: off the async workers).
    pub(super) async fn lay_out(
        dir: &Path,
        w: &VolumeDirs,
        task: &Task,
        files: &BTreeMap<String, String>,
        judge_owner: Option<(u32, u32)>,
        worker_owner: Option<(u32, u32)>,
    ) -> Result<Self, EvalError> {
        let (dir, source, files) = (dir.to_path_buf(), task.source.clone(), files.clone());
        let w = w.clone();
        tokio::task::spawn_blocking(move || {
            EvalDirs::create(&dir, &w, &source, &files, judge_owner, worker_owner)
                .map_err(|e| io_err(&dir, e))
        })
        .await?
    }
}

/// A FIFO its `writer` may write and its `reader` read (group permission: each uid's group
/// is its own), or the server's own when uids cannot be switched.
fn make_fifo(
    path: &Path,
    writer: Option<(u32, u32)>,
    reader: Option<(u32, u32)>,
) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: c is a valid NUL-terminated path.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if let (Some((wu, _)), Some((_, rg))) = (writer, reader) {
        std::os::unix::fs::lchown(path, Some(wu), Some(rg))?;
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o640))?;
    }
    Ok(())
}

/// The compile cache of one device slot: the slot directory (root's, searchable by all, so
/// that a judge waiting at its gate can import torch.compile's modules, which only check that
/// their directory exists) and its `inductor` and `triton` parts, which are handed to the judge
/// holding the lease. A part that is not a plain directory (a link left by an older layout,
/// where judges owned the slot directory) is removed, never followed.
pub(super) fn compile_cache_parts(slot_dir: &Path) -> std::io::Result<[PathBuf; 2]> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(slot_dir)?;
    // The server's own again (judges owned it in the older layout).
    // SAFETY: geteuid and getegid only read the calling process's ids.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    std::os::unix::fs::lchown(slot_dir, Some(uid), Some(gid))?;
    std::fs::set_permissions(slot_dir, std::fs::Permissions::from_mode(0o711))?;
    let parts = [slot_dir.join("inductor"), slot_dir.join("triton")];
    for p in &parts {
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => std::fs::remove_file(p)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::fs::create_dir(p)?;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(parts)
}

/// Gives a directory tree the judges share to this evaluation's judge uid (links are
/// changed, never followed; only judges ever write there).
pub(super) fn hand_over(dir: &Path, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    if owner.is_some() {
        for e in walkdir::WalkDir::new(dir).follow_links(false) {
            chown(e.map_err(std::io::Error::other)?.path(), owner);
        }
    }
    Ok(())
}

/// A directory removed, on a blocking thread, when this is dropped still holding it (its
/// processes, dropped before it, are ended by then).
pub(super) struct RemoveOnDrop(pub Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let Some(dir) = self.0.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || remove_eval_dir(&dir))),
            Err(_) => remove_eval_dir(&dir),
        }
    }
}

pub(super) fn remove_eval_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(dir = %dir.display(), error = %e, "removing an evaluation directory");
        }
    }
}

fn chown(p: &Path, owner: Option<(u32, u32)>) {
    if let Some((u, g)) = owner {
        let _ = std::os::unix::fs::lchown(p, Some(u), Some(g));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Attack: a judge of the older layout owned the slot directory and left `inductor` as a
    /// link to a directory of its choosing; the server must not chmod or chown through it.
    #[test]
    fn a_cache_part_that_is_a_link_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let slot = dir.path().join("judge-cache").join("slot0");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&slot).unwrap();
        std::fs::create_dir(&outside).unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink(&outside, slot.join("inductor")).unwrap();
        let parts = compile_cache_parts(&slot).unwrap();
        for p in &parts {
            let m = std::fs::symlink_metadata(p).unwrap();
            assert!(m.is_dir() && !m.file_type().is_symlink(), "{p:?}");
            hand_over(p, None).unwrap();
        }
        let mode = std::fs::metadata(&outside).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755, "the link's target was changed");
        // The slot directory stays searchable, so a judge at its gate can import
        // torch.compile's modules (they only check that their directory exists).
        let mode = std::fs::metadata(&slot).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o711);
    }
}
