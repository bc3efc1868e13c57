//! The evaluation's volume: everything the candidate's build and run may write (its sources'
//! copy, its temp dir, its build directory and its outputs) lives on one volume with a size
//! and an inode limit, the same kind as an episode's (a tmpfs where the server may mount, else
//! a measured directory). A tmpfs reserves its whole size against the evaluations' memory
//! budget from before it is mounted until it is gone; an evaluation that finds no room waits
//! for it (evaluations are queued work; nothing they hold is needed by those ahead of them).
//!
//! The build directory torch uses (`TORCH_EXTENSIONS_DIR`, `ext/` on the volume) is at a path
//! fixed by the sources' hash, `eval-volumes/<hash>/ext`, so that ninja finds a cached build
//! up to date; evaluations of one hash run one at a time, so the path is one evaluation's. The
//! build cache itself is the server's alone: an entry is copied onto the volume before the
//! build or run, and a finished build's directory is copied back into the cache by the server
//! ([`copy_tree`]: no link followed, regular files and directories only, size-capped) after
//! the build, never after the run.

use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use agent_tools::create_private_dir;
use agent_tools::sandbox::{QuotaEnforcement, Volume, VolumeLimits};
use serde::Serialize;
use tokio::sync::{OwnedMutexGuard, OwnedSemaphorePermit, Semaphore};

use super::{io_err, EvalError, Evaluator};

/// The evaluations' volumes: where they are mounted, their limits, and the memory budget
/// their tmpfs reserve against.
#[derive(Debug)]
pub(super) struct EvalVolumes {
    /// `eval-volumes/` in the data directory.
    root: PathBuf,
    limits: VolumeLimits,
    budget: Option<Arc<MemoryBudget>>,
}

/// The memory the evaluations' tmpfs volumes may reserve together, in MiB permits (each
/// volume takes its size, rounded up).
#[derive(Debug)]
pub struct MemoryBudget {
    permits: Arc<Semaphore>,
    mib: u32,
}

impl MemoryBudget {
    /// The budget, in bytes.
    pub fn bytes(&self) -> u64 {
        u64::from(self.mib) << 20
    }

    /// Bytes reserved now by volumes that exist or are being made.
    pub fn reserved_bytes(&self) -> u64 {
        let free = u64::try_from(self.permits.available_permits()).unwrap_or(u64::MAX);
        u64::from(self.mib).saturating_sub(free) << 20
    }
}

/// What `/v1/info` tells of the evaluations' volumes (`capacity.evaluation_volume`). Fields in
/// alphabetical order (the answer's keys are sorted).
#[derive(Debug, Clone, Serialize)]
pub struct EvaluationVolumeInfo {
    /// Bytes of file data one evaluation's volume holds: its sources, temp dir, build
    /// directory and outputs together.
    pub bytes: u64,
    /// How the limits are enforced: `tmpfs` (the kernel refuses the write past them) or
    /// `measured` (no right to mount: the directory is walked and the candidate's processes
    /// are ended once it is over).
    pub enforcement: QuotaEnforcement,
    /// Files, directories and other inodes one volume holds.
    pub inodes: u64,
    /// Memory the evaluations' tmpfs volumes may reserve together (None: nothing is
    /// reserved: host admission is off, or the volumes are measured directories on disk).
    pub memory_budget_bytes: Option<u64>,
    /// Reserved now (read when the answer is written; None where nothing is reserved).
    pub memory_reserved_bytes: ReservedNow,
}

/// The evaluations' reserved volume memory, read when serialised.
#[derive(Debug, Clone)]
pub struct ReservedNow(Option<Arc<MemoryBudget>>);

impl Serialize for ReservedNow {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.as_ref().map(|b| b.reserved_bytes()).serialize(s)
    }
}

/// The paths of one evaluation's volume, each the worker's but the root (the server's, 0711:
/// the worker can neither replace nor add its parts).
#[derive(Debug, Clone)]
pub(super) struct VolumeDirs {
    pub root: PathBuf,
    pub candidate: PathBuf,
    pub tmp: PathBuf,
    pub out: PathBuf,
    /// The build directory (`TORCH_EXTENSIONS_DIR`).
    pub ext: PathBuf,
}

impl VolumeDirs {
    fn at(root: PathBuf) -> Self {
        Self {
            candidate: root.join("candidate"),
            tmp: root.join("tmp"),
            out: root.join("out"),
            ext: root.join("ext"),
            root,
        }
    }
}

/// One evaluation's volume, with its memory reservation and its hash's lock. Dropped, it is
/// unmounted and its directory removed on a blocking thread, and only then are the
/// reservation and the lock given back (the next evaluation of the hash mounts at the same
/// path).
#[derive(Debug)]
pub(super) struct EvalVolume {
    pub dirs: VolumeDirs,
    volume: Option<Arc<Volume>>,
    permit: Option<OwnedSemaphorePermit>,
    same_sources: Option<OwnedMutexGuard<()>>,
}

impl EvalVolume {
    /// The volume, for the jails that write it (their commands end when it is full).
    pub fn volume(&self) -> Option<Arc<Volume>> {
        self.volume.clone()
    }

    /// The limit it has reached, if any (a statvfs, or a walk of a measured one).
    pub async fn breach(&self) -> Option<agent_tools::sandbox::Breach> {
        let v = self.volume.clone()?;
        tokio::task::spawn_blocking(move || v.breach())
            .await
            .ok()
            .flatten()
    }
}

impl Drop for EvalVolume {
    fn drop(&mut self) {
        let (volume, permit, guard, root) = (
            self.volume.take(),
            self.permit.take(),
            self.same_sources.take(),
            self.dirs.root.clone(),
        );
        let work = move || {
            // Unmounted (detached) when the last handle goes: the jails' went before this.
            drop(volume);
            if let Err(e) = std::fs::remove_dir_all(&root) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(dir = %root.display(), error = %e, "removing an evaluation's volume");
                }
            }
            drop(permit);
            drop(guard);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(work)),
            Err(_) => work(),
        }
    }
}

impl EvalVolumes {
    /// Volumes under `root` with `limits`, reserving against `budget_bytes` of memory (None:
    /// nothing reserved). A budget under one volume's size is raised to it (else no evaluation
    /// could ever run). Leftovers of an earlier run under `root` are removed (called at start,
    /// after the sandbox swept the mounts of servers that are gone).
    pub fn new(root: PathBuf, limits: VolumeLimits, budget_bytes: Option<u64>) -> Self {
        if let Ok(entries) = std::fs::read_dir(&root) {
            for e in entries.flatten() {
                let _ = crate::retention::remove_entry(&e.path());
            }
        }
        let budget = budget_bytes.map(|b| {
            let mib = u32::try_from(b >> 20)
                .unwrap_or(u32::MAX)
                .max(quota_mib(limits.bytes))
                .min(u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
            Arc::new(MemoryBudget {
                permits: Arc::new(Semaphore::new(mib as usize)),
                mib,
            })
        });
        Self {
            root,
            limits,
            budget,
        }
    }

    /// What `/v1/info` says of them; `enforcement` as the sandbox found the host.
    pub fn info(&self, enforcement: QuotaEnforcement) -> EvaluationVolumeInfo {
        EvaluationVolumeInfo {
            bytes: self.limits.bytes,
            enforcement,
            inodes: self.limits.inodes,
            memory_budget_bytes: self.budget.as_ref().map(|b| b.bytes()),
            memory_reserved_bytes: ReservedNow(self.budget.clone()),
        }
    }

    /// The volume of an evaluation of the sources `digest` (whose lock `same_sources` it
    /// holds until it is gone), laid out for the worker `owner`: waits for room in the memory
    /// budget, then mounts.
    pub async fn take(
        &self,
        digest: &str,
        same_sources: OwnedMutexGuard<()>,
        owner: Option<(u32, u32)>,
    ) -> Result<EvalVolume, EvalError> {
        let permit = match &self.budget {
            Some(b) => Some(
                b.permits
                    .clone()
                    .acquire_many_owned(quota_mib(self.limits.bytes))
                    .await
                    .map_err(|source| EvalError::VolumeBudget { source })?,
            ),
            None => None,
        };
        let root = self.root.join(digest);
        let limits = self.limits;
        let parent = self.root.clone();
        let made = tokio::task::spawn_blocking(move || -> Result<Arc<Volume>, EvalError> {
            std::fs::create_dir_all(&parent).map_err(|e| io_err(&parent, e))?;
            // Searchable, not listable: no sandbox learns which sources are being evaluated.
            std::fs::set_permissions(&parent, std::os::unix::fs::PermissionsExt::from_mode(0o711))
                .map_err(|e| io_err(&parent, e))?;
            // A leftover of a cancelled evaluation whose removal failed: never mounted over.
            if std::fs::symlink_metadata(&root).is_ok() {
                crate::retention::remove_entry(&root).map_err(|e| io_err(&root, e))?;
            }
            let volume = Volume::create(&root, limits).map_err(|source| EvalError::Sandbox {
                context: "the evaluation's volume",
                source,
            })?;
            let d = VolumeDirs::at(root.clone());
            for p in [&d.candidate, &d.tmp, &d.ext, &d.out] {
                create_private_dir(p, owner).map_err(|e| io_err(p, e))?;
            }
            // The judge reads the outputs (each file says who may).
            std::fs::set_permissions(&d.out, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .map_err(|e| io_err(&d.out, e))?;
            Ok(Arc::new(volume))
        })
        .await?;
        let dirs = VolumeDirs::at(self.root.join(digest));
        let volume = match made {
            Ok(v) => v,
            Err(e) => {
                // Nothing of it is kept; the lock and the reservation go with this.
                drop(EvalVolume {
                    dirs,
                    volume: None,
                    permit,
                    same_sources: Some(same_sources),
                });
                return Err(e);
            }
        };
        // A measured volume is a directory on disk: it holds no memory.
        let permit = permit.filter(|_| volume.enforcement() == QuotaEnforcement::Tmpfs);
        Ok(EvalVolume {
            dirs,
            volume: Some(volume),
            permit,
            same_sources: Some(same_sources),
        })
    }
}

impl Evaluator {
    /// The reason an evaluation fails when its volume reached `breach` in the `when` (build or
    /// run): the candidate wrote past what an evaluation may hold. None for limits that are
    /// not the volume's.
    pub(super) fn volume_breach_reason(
        &self,
        breach: agent_tools::sandbox::Breach,
        when: &str,
    ) -> Option<String> {
        use agent_tools::sandbox::Breach;
        let l = self.cfg.volume_limits;
        match breach {
            Breach::DiskQuota => Some(format!(
                "disk_quota: the candidate filled its evaluation's disk limit of {} bytes in the {when} (its sources, temp dir, build directory and outputs together)",
                l.bytes
            )),
            Breach::Inodes => Some(format!(
                "inode_quota: the candidate made more than the {} files its evaluation may hold in the {when} (its sources, temp dir, build directory and outputs together)",
                l.inodes
            )),
            Breach::Memory | Breach::Processes => None,
        }
    }
}

/// A volume's size in MiB permits, rounded up.
fn quota_mib(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1 << 20).max(1)).unwrap_or(u32::MAX)
}

/// What [`copy_tree`] copied, or that it stopped at the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Copied {
    /// All of it: this many bytes of file data (apparent sizes).
    All(u64),
    /// More than the cap's bytes or entries: stopped there (what was copied is the caller's
    /// to remove).
    OverCap,
}

/// Copies the tree under `src` into the new directory `dst` (which must not exist), as the
/// server: every component opened relative to its parent's descriptor without following links
/// (`O_NOFOLLOW`), only regular files of one name and directories copied (links, hard-linked
/// files, FIFOs, sockets skipped),
/// modification times kept to the nanosecond (ninja decides by them), modes kept but for
/// set-id bits, everything owned by `owner` (None: the server). torch's lock files are left
/// out. Stops once more than `max_bytes` of file data or `max_entries` entries were met.
pub(super) fn copy_tree(
    src: &Path,
    dst: &Path,
    owner: Option<(u32, u32)>,
    max_bytes: u64,
    max_entries: u64,
) -> std::io::Result<Copied> {
    let src_fd = open_path(src, libc::O_DIRECTORY)?;
    let parent = dst
        .parent()
        .ok_or_else(|| std::io::Error::other("no parent"))?;
    let parent_fd = open_path(parent, libc::O_DIRECTORY)?;
    let name = dst
        .file_name()
        .ok_or_else(|| std::io::Error::other("no name"))?;
    let mut left = Left {
        bytes: max_bytes,
        entries: max_entries,
        used: 0,
    };
    let dst_fd = make_dir(&parent_fd, &cname(name.as_bytes())?, owner)?;
    match copy_dir(&src_fd, &dst_fd, owner, &mut left, 0) {
        Ok(()) => {
            finish(&src_fd, &dst_fd, owner, true)?;
            Ok(Copied::All(left.used))
        }
        Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => Ok(Copied::OverCap),
        Err(e) => Err(e),
    }
}

/// What a copy may still take.
struct Left {
    bytes: u64,
    entries: u64,
    used: u64,
}

impl Left {
    fn over() -> std::io::Error {
        std::io::Error::from(std::io::ErrorKind::FileTooLarge)
    }
}

/// Deeper trees than this are not copied (torch's build directories are two levels deep).
const MAX_DEPTH: u32 = 32;

fn copy_dir(
    src: &OwnedFd,
    dst: &OwnedFd,
    owner: Option<(u32, u32)>,
    left: &mut Left,
    depth: u32,
) -> std::io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(Left::over());
    }
    // The names of the open directory itself (its descriptor, not a path, is listed).
    let mut names: Vec<OsString> = Vec::new();
    for e in std::fs::read_dir(format!("/proc/self/fd/{}", src.as_raw_fd()))? {
        left.entries = left.entries.checked_sub(1).ok_or_else(Left::over)?;
        names.push(e?.file_name());
    }
    for name in names {
        // torch's baton: a stale one makes every later load wait for it.
        if name == "lock" {
            continue;
        }
        let c = cname(name.as_bytes())?;
        let fd = match open_at(
            src,
            &c,
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY,
        ) {
            Ok(fd) => fd,
            // A link (ELOOP under O_NOFOLLOW), or gone: not copied.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOENT)) => continue,
            Err(e) => return Err(e),
        };
        let st = fstat(&fd)?;
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                let sub = make_dir(dst, &c, owner)?;
                copy_dir(&fd, &sub, owner, left, depth + 1)?;
                finish(&fd, &sub, owner, true)?;
            }
            // A file with other names is not copied: on a measured volume (a directory on the
            // data disk) another name could be a file of someone else's.
            libc::S_IFREG if st.st_nlink > 1 => {}
            libc::S_IFREG => {
                let size = u64::try_from(st.st_size).unwrap_or(u64::MAX);
                left.bytes = left.bytes.checked_sub(size).ok_or_else(Left::over)?;
                let out = open_at(
                    dst,
                    &c,
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
                )?;
                let mut from = std::fs::File::from(fd.try_clone()?);
                let mut to = std::fs::File::from(out.try_clone()?);
                // At most the size seen: a file growing meanwhile is cut there.
                let n = std::io::copy(&mut std::io::Read::take(&mut from, size), &mut to)?;
                left.used = left.used.saturating_add(n);
                finish(&fd, &out, owner, false)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Creates directory `name` in `dir` (private to the server while it is filled) and opens it.
fn make_dir(dir: &OwnedFd, name: &CString, _owner: Option<(u32, u32)>) -> std::io::Result<OwnedFd> {
    // SAFETY: a valid descriptor and NUL-terminated name.
    if unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o700) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    open_at(
        dir,
        name,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
    )
}

/// Gives the copy `to` its owner, `from`'s mode (no set-id bits; a directory 0700, as the
/// server's entries and the worker's directories are) and times.
fn finish(
    from: &OwnedFd,
    to: &OwnedFd,
    owner: Option<(u32, u32)>,
    dir: bool,
) -> std::io::Result<()> {
    let st = fstat(from)?;
    let mode = if dir {
        0o700
    } else {
        (st.st_mode & 0o755) | 0o600
    };
    // SAFETY: valid descriptors; the times array has two entries.
    unsafe {
        if let Some((u, g)) = owner {
            if libc::fchown(to.as_raw_fd(), u, g) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        if libc::fchmod(to.as_raw_fd(), mode) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let times = [
            libc::timespec {
                tv_sec: st.st_atime,
                tv_nsec: st.st_atime_nsec,
            },
            libc::timespec {
                tv_sec: st.st_mtime,
                tv_nsec: st.st_mtime_nsec,
            },
        ];
        if libc::futimens(to.as_raw_fd(), times.as_ptr()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn cname(b: &[u8]) -> std::io::Result<CString> {
    CString::new(b).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}

/// Opens a path of the server's own (no component the candidate could have shaped), not
/// following a link at its end.
fn open_path(p: &Path, flags: i32) -> std::io::Result<OwnedFd> {
    let c = cname(p.as_os_str().as_bytes())?;
    // SAFETY: NUL-terminated path.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            flags | libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_at(dir: &OwnedFd, name: &CString, flags: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: a valid descriptor and NUL-terminated name; mode used only with O_CREAT.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_CLOEXEC,
            0o600 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn fstat(fd: &OwnedFd) -> std::io::Result<libc::stat> {
    // SAFETY: fstat fills the zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attack: a build directory holding links to the server's files, a FIFO and a file past
    /// the cap. The copy follows no link, skips what is not a file or directory, keeps the
    /// modification times ninja needs, and stops at the cap.
    #[test]
    fn the_copy_follows_no_link_and_stops_at_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::write(src.join("sub/a.o"), b"object").unwrap();
        std::fs::write(src.join("lock"), b"").unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, b"the server's").unwrap();
        std::os::unix::fs::symlink(&secret, src.join("link")).unwrap();
        std::os::unix::fs::symlink(dir.path(), src.join("dirlink")).unwrap();
        std::fs::hard_link(&secret, src.join("hardlink")).unwrap();
        let fifo = cname(src.join("fifo").as_os_str().as_bytes()).unwrap();
        // SAFETY: NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let old =
            std::time::SystemTime::UNIX_EPOCH + std::time::Duration::new(1_000_000, 123_456_789);
        std::fs::File::options()
            .write(true)
            .open(src.join("sub/a.o"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        let dst = dir.path().join("dst");
        assert_eq!(
            copy_tree(&src, &dst, None, 1 << 20, 100).unwrap(),
            Copied::All(6)
        );
        assert_eq!(std::fs::read(dst.join("sub/a.o")).unwrap(), b"object");
        let copied = std::fs::metadata(dst.join("sub/a.o"))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(copied, old, "ninja needs the times to the nanosecond");
        for gone in ["link", "dirlink", "hardlink", "fifo", "lock"] {
            assert!(std::fs::symlink_metadata(dst.join(gone)).is_err(), "{gone}");
        }
        // Over the cap: stopped.
        std::fs::write(src.join("big"), vec![0u8; 4096]).unwrap();
        let dst2 = dir.path().join("dst2");
        assert_eq!(
            copy_tree(&src, &dst2, None, 1000, 100).unwrap(),
            Copied::OverCap
        );
        // A source that is itself a link is refused.
        let linked = dir.path().join("linked");
        std::os::unix::fs::symlink(&src, &linked).unwrap();
        assert!(copy_tree(&linked, &dir.path().join("dst3"), None, 1 << 20, 100).is_err());
    }
}
