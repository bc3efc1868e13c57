//! The storage an episode can fill, bounded while its commands run.
//!
//! A [`Volume`] is a directory holding everything an episode may write (its workspace and
//! its temp dir). As root it is a tmpfs of its own with a size and an inode limit, enforced
//! by the kernel on every write; the sandbox also ends a command as soon as the volume is
//! full. Without the right to mount, the volume is the plain directory and its usage is
//! measured by walking it (slower, and only between checks).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::process::start_time;
use super::{Breach, SandboxError};

/// The mount source naming volumes, followed by `.<server pid>.<server start time>`.
const SOURCE: &str = "cuda-agent-volume";

/// How much a volume may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct VolumeLimits {
    /// Bytes of file data.
    pub bytes: u64,
    /// Files, directories and other inodes.
    pub inodes: u64,
}

impl VolumeLimits {
    /// A byte limit with the default inode limit (64Ki: ample for builds, far below what
    /// slows the server's directory walks).
    pub fn bytes(bytes: u64) -> Self {
        Self {
            bytes,
            inodes: 65_536,
        }
    }
}

/// What a volume holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct VolumeUsage {
    /// Bytes used.
    pub bytes: u64,
    /// Inodes used.
    pub inodes: u64,
}

/// How a volume's limits are enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuotaEnforcement {
    /// A tmpfs with `size` and `nr_inodes`: writes past the limit fail at once.
    Tmpfs,
    /// Usage measured by walking the directory; a command is ended once it is over.
    Measured,
}

/// A bounded directory for one episode. Unmounted when dropped.
#[derive(Debug)]
pub struct Volume {
    path: PathBuf,
    limits: VolumeLimits,
    mounted: bool,
}

fn cstr(p: &Path) -> Result<CString, SandboxError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| {
        SandboxError::Os(
            "volume path",
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"),
        )
    })
}

impl Volume {
    /// Makes `path` (created if missing, mode 0711, owned by the server) a volume with
    /// `limits`: a tmpfs when the server may mount one, else the plain directory, measured.
    pub fn create(path: &Path, limits: VolumeLimits) -> Result<Self, SandboxError> {
        std::fs::create_dir_all(path).map_err(|e| SandboxError::Os("volume dir", e))?;
        let me = std::process::id();
        let source = CString::new(format!(
            "{SOURCE}.{me}.{}",
            start_time(me as i32).unwrap_or(0)
        ))
        .unwrap_or_default();
        let opts = CString::new(format!(
            "size={},nr_inodes={},mode=0711",
            limits.bytes.max(4096),
            limits.inodes.max(16)
        ))
        .unwrap_or_default();
        let target = cstr(path)?;
        // SAFETY: NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                opts.as_ptr().cast(),
            )
        };
        let mounted = rc == 0;
        if !mounted {
            let err = std::io::Error::last_os_error();
            tracing::debug!(path = %path.display(), %err, "no tmpfs for the volume; its usage is measured instead");
        }
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o711))
            .map_err(|e| SandboxError::Os("volume dir", e))?;
        Ok(Self {
            path: path.to_path_buf(),
            limits,
            mounted,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its limits.
    pub fn limits(&self) -> VolumeLimits {
        self.limits
    }

    /// How the limits are enforced.
    pub fn enforcement(&self) -> QuotaEnforcement {
        if self.mounted {
            QuotaEnforcement::Tmpfs
        } else {
            QuotaEnforcement::Measured
        }
    }

    /// What it holds now: one `statvfs` on a tmpfs, a walk otherwise.
    pub fn usage(&self) -> VolumeUsage {
        if self.mounted {
            if let Ok(path) = cstr(&self.path) {
                // SAFETY: statvfs fills the zeroed struct.
                let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
                if unsafe { libc::statvfs(path.as_ptr(), &mut st) } == 0 {
                    return VolumeUsage {
                        bytes: (st.f_blocks - st.f_bfree) * st.f_frsize,
                        inodes: st.f_files - st.f_ffree,
                    };
                }
            }
        }
        let (mut bytes, mut inodes) = (0u64, 0u64);
        for e in walkdir::WalkDir::new(&self.path)
            .follow_links(false)
            .into_iter()
            .flatten()
        {
            inodes += 1;
            if let Ok(m) = e.metadata() {
                use std::os::unix::fs::MetadataExt;
                bytes += m.blocks() * 512;
            }
        }
        VolumeUsage { bytes, inodes }
    }

    /// Which limit the volume has reached, if any. A tmpfs counts as full when less than a
    /// page (or no inode) is left: the next write would fail.
    pub fn breach(&self) -> Option<Breach> {
        let u = self.usage();
        if u.inodes >= self.limits.inodes {
            Some(Breach::Inodes)
        } else if u.bytes + 4096 > self.limits.bytes.max(4096) {
            Some(Breach::DiskQuota)
        } else {
            None
        }
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        if self.mounted {
            if let Ok(path) = cstr(&self.path) {
                // Detached: a process still inside must not keep the server from going on.
                // SAFETY: NUL-terminated path.
                unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
            }
        }
    }
}

/// Unmounts the volumes a server that is no longer running left mounted (their contents
/// are lost with them). Returns the mount points.
pub fn sweep_volumes() -> Vec<PathBuf> {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut swept = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let Some(mountpoint) = left.split_whitespace().nth(4) else {
            continue;
        };
        let Some(source) = right.split_whitespace().nth(1) else {
            continue;
        };
        let Some(owner) = source
            .strip_prefix(SOURCE)
            .and_then(|s| s.strip_prefix('.'))
        else {
            continue;
        };
        let mut f = owner.split('.');
        let (Some(pid), Some(start)) = (
            f.next().and_then(|p| p.parse::<i32>().ok()),
            f.next().and_then(|s| s.parse::<u64>().ok()),
        ) else {
            continue;
        };
        if start_time(pid) == Some(start) {
            continue; // its server runs
        }
        // mountinfo escapes spaces and the like as octal.
        let path = PathBuf::from(unescape(mountpoint));
        if let Ok(c) = cstr(&path) {
            // SAFETY: NUL-terminated path.
            if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
                swept.push(path);
            }
        }
    }
    swept
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
