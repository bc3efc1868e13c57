//! Landlock through raw syscalls: the parent builds a ruleset per spawn, the child only calls
//! `landlock_restrict_self` (async-signal-safe, so it can run between fork and exec).

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::SandboxError;

const CREATE_RULESET_VERSION: u32 = 1;
const RULE_PATH_BENEATH: libc::c_int = 1;

const EXECUTE: u64 = 1 << 0;
const WRITE_FILE: u64 = 1 << 1;
const READ_FILE: u64 = 1 << 2;
const READ_DIR: u64 = 1 << 3;
const REFER: u64 = 1 << 13;
const TRUNCATE: u64 = 1 << 14;
const IOCTL_DEV: u64 = 1 << 15;
/// Rights that apply to a regular or device file (not only to directories).
const FILE_RIGHTS: u64 = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV;

const NET_BIND_TCP: u64 = 1 << 0;
const NET_CONNECT_TCP: u64 = 1 << 1;
const SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1 << 0;
const SCOPE_SIGNAL: u64 = 1 << 1;

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// The landlock ABI the kernel speaks, 0 when it has none.
pub fn abi_version() -> u32 {
    // SAFETY: the version query takes no attribute pointer.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            CREATE_RULESET_VERSION,
        )
    };
    if v < 0 {
        0
    } else {
        v as u32
    }
}

/// Filesystem rights a given ABI can handle.
fn handled_fs(abi: u32) -> u64 {
    let mut all = (1u64 << 13) - 1; // ABI 1: EXECUTE ..= MAKE_SYM
    if abi >= 2 {
        all |= REFER;
    }
    if abi >= 3 {
        all |= TRUNCATE;
    }
    if abi >= 5 {
        all |= IOCTL_DEV;
    }
    all
}

/// How much of a path a rule grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read and execute.
    ReadOnly,
    /// Read, write and ioctl on a device node (such as `/dev/null` or `/dev/nvidia0`).
    Device,
    /// Read, execute and write existing files, but create, remove or rename nothing.
    WriteExisting,
    /// Everything beneath.
    ReadWrite,
}

/// A ruleset ready to be applied in a child; closes itself when dropped.
pub struct Ruleset {
    fd: OwnedFd,
}

impl Ruleset {
    /// Builds a ruleset for `abi` granting `rules`; paths that do not exist are skipped.
    pub fn build(abi: u32, rules: &[(&Path, Access)]) -> Result<Self, SandboxError> {
        let handled = handled_fs(abi);
        let attr = RulesetAttr {
            handled_access_fs: handled,
            // TCP bind/connect is also denied by seccomp; landlock is a second, independent wall.
            handled_access_net: if abi >= 4 {
                NET_BIND_TCP | NET_CONNECT_TCP
            } else {
                0
            },
            scoped: if abi >= 6 {
                SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
            } else {
                0
            },
        };
        let size = match abi {
            0 => return Err(SandboxError::Unsupported("landlock")),
            1..=3 => std::mem::size_of::<u64>(),
            4 | 5 => 2 * std::mem::size_of::<u64>(),
            _ => std::mem::size_of::<RulesetAttr>(),
        };
        // SAFETY: attr outlives the call and `size` never exceeds its size.
        let fd = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, &attr, size, 0u32) };
        if fd < 0 {
            return Err(SandboxError::Os(
                "landlock_create_ruleset",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: the kernel just returned this descriptor to us.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        for (path, access) in rules {
            let Ok(cpath) = CString::new(path.as_os_str().as_bytes()) else {
                continue;
            };
            // SAFETY: cpath is a valid NUL-terminated string.
            let pfd = unsafe { libc::open(cpath.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
            if pfd < 0 {
                continue; // a path missing on this machine grants nothing
            }
            // SAFETY: just opened.
            let pfd = unsafe { OwnedFd::from_raw_fd(pfd) };
            let is_dir = std::fs::metadata(path).map(|m| m.is_dir()).unwrap_or(false);
            let mut rights = dir_rights(abi, *access);
            if !is_dir {
                rights &= FILE_RIGHTS;
            }
            let rule = PathBeneathAttr {
                allowed_access: rights,
                parent_fd: pfd.as_raw_fd(),
            };
            // SAFETY: rule is a valid path-beneath attribute that outlives the call.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_landlock_add_rule,
                    fd.as_raw_fd(),
                    RULE_PATH_BENEATH,
                    &rule,
                    0u32,
                )
            };
            if rc < 0 {
                return Err(SandboxError::Os(
                    "landlock_add_rule",
                    std::io::Error::last_os_error(),
                ));
            }
        }
        Ok(Self { fd })
    }

    /// The raw descriptor, for the child's `restrict_self`.
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }
}

/// The rights a rule of `access` grants on a directory under `abi`.
pub fn dir_rights(abi: u32, access: Access) -> u64 {
    let handled = handled_fs(abi);
    let rights = match access {
        Access::ReadOnly => EXECUTE | READ_FILE | READ_DIR,
        Access::Device => READ_FILE | WRITE_FILE | IOCTL_DEV | TRUNCATE,
        // TRUNCATE too: fopen(path, "w") opens with O_TRUNC.
        Access::WriteExisting => EXECUTE | READ_FILE | READ_DIR | WRITE_FILE | TRUNCATE,
        Access::ReadWrite => handled,
    };
    rights & handled
}

/// Adds a path-beneath rule for the object `path_fd` refers to. Async-signal-safe (only a
/// syscall), for a child that mounted something the parent could not name.
pub fn add_path_rule(ruleset: i32, path_fd: i32, rights: u64) -> std::io::Result<()> {
    let rule = PathBeneathAttr {
        allowed_access: rights,
        parent_fd: path_fd,
    };
    // SAFETY: rule is a valid path-beneath attribute that outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset,
            RULE_PATH_BENEATH,
            &rule,
            0u32,
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Applies a ruleset to the calling thread. Async-signal-safe: only a syscall.
pub fn restrict_self(fd: i32) -> std::io::Result<()> {
    // SAFETY: plain syscall on a descriptor the parent keeps open across fork.
    let rc = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}
