//! Sandbox uids that no two owners share: not two episodes, not a previous run's leftovers,
//! not another server on the same host.
//!
//! A uid is leased by taking an exclusive `flock` on `<dir>/<uid>.lock` (released by the
//! kernel when the holder dies, so a crashed server frees its uids) and only if no live
//! process runs under it. Dropping a lease kills whatever still runs under the uid.

use std::ops::Range;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use super::process::{kill_uid, processes_with_uids};
use super::SandboxError;

/// Where servers on one host keep their uid locks (shared by all of them).
pub const DEFAULT_LOCK_DIR: &str = "/run/cuda-agent/uids";

/// The uids sandboxes lease from by default.
pub const DEFAULT_RANGE: Range<u32> = 100_000..200_000;

/// A range of uids to lease from, coordinated through lock files.
#[derive(Debug)]
pub struct UidPool {
    dir: PathBuf,
    range: Range<u32>,
    next: AtomicU32,
}

/// One leased uid (its gid is the same number). Dropping it kills every process still
/// running under the uid and frees it.
#[derive(Debug)]
pub struct UidLease {
    uid: u32,
    _lock: std::fs::File,
}

impl UidLease {
    /// The uid.
    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// (uid, gid) as a [`Jail`](super::Jail) takes them.
    pub fn owner(&self) -> (u32, u32) {
        (self.uid, self.uid)
    }
}

impl Drop for UidLease {
    fn drop(&mut self) {
        let killed = kill_uid(self.uid);
        if killed > 0 {
            tracing::debug!(uid = self.uid, killed, "processes of a released uid killed");
        }
        // Objects in the host's IPC namespace (none where commands get their own): the next
        // holder of this uid must not find them.
        let removed = super::ipc::sweep(|owner| owner == self.uid);
        if removed > 0 {
            tracing::debug!(
                uid = self.uid,
                removed,
                "IPC objects of a released uid removed"
            );
        }
        // The lock goes with the file.
    }
}

fn try_lock(path: &Path) -> Option<std::fs::File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .ok()?;
    // SAFETY: flock on a descriptor we own.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    (rc == 0).then_some(file)
}

impl UidPool {
    /// A pool over `range`, with its lock files in `dir` (created 0700 if missing).
    pub fn new(dir: &Path, range: Range<u32>) -> Result<Self, SandboxError> {
        if range.is_empty() || range.start == 0 {
            return Err(SandboxError::Os(
                "uid pool",
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "empty uid range or root in it",
                ),
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| SandboxError::Os("uid lock dir", e))?;
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(|e| SandboxError::Os("uid lock dir", e))?;
        // Start at a point that differs between servers and runs, so that servers sharing
        // the host rarely probe the same uids.
        let seed = std::process::id().wrapping_mul(2_654_435_761)
            ^ (std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0));
        let len = range.end - range.start;
        Ok(Self {
            dir: dir.to_path_buf(),
            next: AtomicU32::new(seed % len),
            range,
        })
    }

    /// The range leased from.
    pub fn range(&self) -> Range<u32> {
        self.range.clone()
    }

    fn lock_path(&self, uid: u32) -> PathBuf {
        self.dir.join(format!("{uid}.lock"))
    }

    fn busy_uids() -> std::collections::HashSet<u32> {
        processes_with_uids()
            .iter()
            .filter_map(|p| p.uids)
            .flat_map(|(r, e)| [r, e])
            .collect()
    }

    /// Leases `n` distinct uids.
    fn acquire_n(&self, n: usize) -> Result<Vec<UidLease>, SandboxError> {
        let busy = Self::busy_uids();
        let len = self.range.end - self.range.start;
        let mut leases = Vec::with_capacity(n);
        for _ in 0..len {
            if leases.len() == n {
                break;
            }
            let uid = self.range.start + self.next.fetch_add(1, Ordering::Relaxed) % len;
            if busy.contains(&uid) {
                continue; // a live process (a previous run's?) still runs under it
            }
            if let Some(lock) = try_lock(&self.lock_path(uid)) {
                leases.push(UidLease { uid, _lock: lock });
            }
        }
        if leases.len() < n {
            return Err(SandboxError::NoFreeUid {
                start: self.range.start,
                end: self.range.end,
            });
        }
        Ok(leases)
    }

    /// Leases one uid (for an episode).
    pub fn acquire(&self) -> Result<UidLease, SandboxError> {
        Ok(self.acquire_n(1)?.remove(0))
    }

    /// Leases two distinct uids (for an evaluation: the judge's and the worker's).
    pub fn acquire_pair(&self) -> Result<(UidLease, UidLease), SandboxError> {
        let mut v = self.acquire_n(2)?;
        let b = v.remove(1);
        Ok((v.remove(0), b))
    }

    /// Kills every process running under a uid of the range that no running server holds
    /// (what a crashed server or an earlier run left). Returns how many were killed.
    pub fn sweep(&self) -> usize {
        let mut leftover: Vec<u32> = Self::busy_uids()
            .into_iter()
            .filter(|u| self.range.contains(u))
            .collect();
        leftover.sort_unstable();
        let mut killed = 0;
        for uid in leftover {
            // Held by a live server (or by us): its processes are not leftovers.
            let Some(_lock) = try_lock(&self.lock_path(uid)) else {
                continue;
            };
            killed += kill_uid(uid);
        }
        killed
    }

    /// Removes SysV objects of the range's uids that no running server holds from the host's
    /// IPC namespace (an older server's episodes, or a crashed one's). Returns how many.
    pub fn sweep_ipc(&self) -> usize {
        super::ipc::sweep(|owner| {
            self.range.contains(&owner) && try_lock(&self.lock_path(owner)).is_some()
        })
    }
}
