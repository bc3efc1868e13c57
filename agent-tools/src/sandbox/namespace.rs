//! What runs between fork and exec: the keeper, the pid and mount namespaces, the private
//! `/proc`, joining the command's cgroups, and the confinement of the command itself.
//!
//! Three processes (two without a pid namespace):
//! - the **keeper**, the spawner's direct child: root, in the host's pid namespace, running
//!   no foreign code. It waits for the command and, when the command ends or the server dies
//!   (its lifeline pipe hangs up), kills what is left (`cgroup.kill`) and exits with the
//!   command's status.
//! - the **init** (pid namespace only): pid 1 of the command's namespace, reaping orphans.
//!   When the command exits, init exits and the kernel kills everything else in the
//!   namespace; when the keeper dies, init gets `SIGKILL` (parent-death signal), same effect.
//! - the **command**: joins the cgroups, drops to the jail's uid, applies rlimits,
//!   no_new_privs, landlock and seccomp, then execs.
//!
//! Everything here is async-signal-safe: raw syscalls on memory prepared by the parent.

use std::ffi::CString;
use std::os::fd::RawFd;

use serde::{Deserialize, Serialize};

use super::landlock;

/// How much of the host's process table a jail's processes see.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessView {
    /// Their own pid namespace and `/proc`: only the command's processes, and everything in
    /// it dies with the command. The default for episodes.
    Private,
    /// The host's pid namespace, with `/proc` showing only processes of the jail's uid
    /// (`hidepid=invisible`): for processes that must find each other by host pid.
    OwnUid,
    /// The host's `/proc` as it is (for trusted processes such as an evaluation's judge,
    /// which reads its worker's CPU time from `/proc/<pid>/stat`).
    Host,
}

/// Everything the child needs, prepared (allocated) by the parent before fork.
pub(crate) struct ChildPlan {
    pub view: ProcessView,
    /// Whether the command gets an IPC namespace of its own ([`super::ipc`]).
    pub ipc_namespace: bool,
    /// `cgroup.procs` files the command joins (by writing "0").
    pub cgroup_procs: Vec<CString>,
    /// A cgroup v2 `cgroup.kill` the keeper writes when the command ends.
    pub cgroup_kill: Option<CString>,
    /// Read end of the server's lifeline: hangs up when the server dies.
    pub lifeline: Option<RawFd>,
    pub rlimits: [(libc::__rlimit_resource_t, u64); 7],
    /// Nice value of the command and of its session's autogroup (0: left as it is).
    pub nice: libc::c_int,
    /// `nice` as the decimal text written to the autogroup file.
    pub nice_text: Vec<u8>,
    pub uid: Option<(u32, u32)>,
    pub ruleset_fd: Option<RawFd>,
    /// Landlock rights for a `/proc` mounted in the child (0: none).
    pub proc_rights: u64,
    /// Where the server's command line lies in memory; the keeper and the init, copies of
    /// the server that never exec, blank it so their `/proc/<pid>/cmdline` shows nothing.
    pub argv_area: Option<(usize, usize)>,
    /// The command's working directory, entered after the uid drop.
    pub cwd: CString,
}

const PROC: &[u8] = b"/proc\0";
const ROOT: &[u8] = b"/\0";
const PROC_FS: &[u8] = b"proc\0";
const HIDEPID: &[u8] = b"hidepid=2\0";
const AUTOGROUP: &std::ffi::CStr = c"/proc/self/autogroup";

fn check(rc: libc::c_long) -> std::io::Result<()> {
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A mount namespace of our own whose mounts do not propagate back to the host.
fn private_mounts() -> std::io::Result<()> {
    // SAFETY: constant NUL-terminated strings.
    check(unsafe {
        libc::mount(
            std::ptr::null(),
            ROOT.as_ptr().cast(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    } as libc::c_long)
}

/// Mounts a fresh proc over `/proc` that hides processes of other uids.
fn mount_proc() -> std::io::Result<()> {
    // SAFETY: constant NUL-terminated strings.
    check(unsafe {
        libc::mount(
            PROC_FS.as_ptr().cast(),
            PROC.as_ptr().cast(),
            PROC_FS.as_ptr().cast(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            HIDEPID.as_ptr().cast(),
        )
    } as libc::c_long)
}

fn close_all_but(keep: Option<RawFd>) {
    // SAFETY: close_range on descriptor numbers; nothing else in this process uses them.
    unsafe {
        match keep {
            Some(fd) if fd > 0 => {
                libc::syscall(libc::SYS_close_range, 0u32, (fd - 1) as u32, 0u32);
                libc::syscall(libc::SYS_close_range, (fd + 1) as u32, u32::MAX, 0u32);
            }
            Some(_) => {
                libc::syscall(libc::SYS_close_range, 1u32, u32::MAX, 0u32);
            }
            None => {
                libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32);
            }
        }
    }
}

/// The exit code a shell would report for a wait status.
fn exit_code(status: libc::c_int) -> libc::c_int {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        1
    }
}

fn write_file(path: &std::ffi::CStr, data: &[u8]) -> std::io::Result<()> {
    // SAFETY: path is NUL-terminated; data outlives the call.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = libc::write(fd, data.as_ptr().cast(), data.len());
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if n < 0 {
            return Err(err);
        }
    }
    Ok(())
}

impl ChildPlan {
    /// Runs in the spawner's child between fork and exec. Returns only in the process that
    /// is to exec the command; the keeper and the init never return.
    pub fn run(&self, filters: &[seccompiler::BpfProgram]) -> std::io::Result<()> {
        // SAFETY (whole function): raw syscalls on memory allocated before fork.
        unsafe {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let ipc = if self.ipc_namespace {
                libc::CLONE_NEWIPC
            } else {
                0
            };
            match self.view {
                ProcessView::Private => {
                    check(
                        libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWPID | ipc) as libc::c_long
                    )?;
                    private_mounts()?;
                }
                ProcessView::OwnUid => {
                    check(libc::unshare(libc::CLONE_NEWNS | ipc) as libc::c_long)?;
                    private_mounts()?;
                    mount_proc()?;
                }
                ProcessView::Host if ipc != 0 => {
                    check(libc::unshare(ipc) as libc::c_long)?;
                }
                ProcessView::Host => {}
            }
            let keeper = libc::getpid();
            let pid = libc::fork();
            if pid < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if pid > 0 {
                self.rename(c"sandbox-keeper");
                self.keep(pid);
            }
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            // In a new pid namespace the parent is invisible (getppid is 0); outside it, a
            // keeper that died before the prctl leaves us reparented.
            if self.view != ProcessView::Private && libc::getppid() != keeper {
                libc::_exit(137);
            }
            for procs in &self.cgroup_procs {
                write_file(procs, b"0")?;
            }
            if self.view == ProcessView::Private {
                mount_proc()?;
                let pid = libc::fork();
                if pid < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if pid > 0 {
                    self.rename(c"sandbox-init");
                    init(pid);
                }
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            }
            self.confine(filters)
        }
    }

    /// The keeper: waits for `child`, kills what the command left, relays its status.
    fn keep(&self, child: libc::pid_t) -> ! {
        // SAFETY: raw syscalls on our own descriptors and memory prepared before fork.
        unsafe {
            close_all_but(self.lifeline);
            let pidfd = libc::syscall(libc::SYS_pidfd_open, child, 0u32) as libc::c_int;
            let lifeline = self.lifeline.unwrap_or(-1);
            if pidfd >= 0 {
                loop {
                    let mut fds = [
                        libc::pollfd {
                            fd: pidfd,
                            events: libc::POLLIN,
                            revents: 0,
                        },
                        libc::pollfd {
                            fd: lifeline,
                            events: libc::POLLIN,
                            revents: 0,
                        },
                    ];
                    let n = libc::poll(fds.as_mut_ptr(), if lifeline >= 0 { 2 } else { 1 }, -1);
                    if n < 0 {
                        if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                            continue;
                        }
                        break;
                    }
                    if fds[1].revents != 0 {
                        // The server is gone: nothing of the command may outlive it, and
                        // nobody is left to collect its status.
                        self.orphaned(child);
                    }
                    if fds[0].revents != 0 {
                        break;
                    }
                }
            }
            let mut status = 0;
            loop {
                let r = libc::waitpid(child, &mut status, 0);
                if r == child {
                    break;
                }
                if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                    status = 1 << 8;
                    break;
                }
            }
            self.kill_cgroup();
            libc::_exit(exit_code(status))
        }
    }

    /// Blanks the inherited command line and names the process (keeper, init).
    fn rename(&self, name: &std::ffi::CStr) {
        if let Some((start, end)) = self.argv_area {
            // SAFETY: [start, end) is this process's own copy of the server's argv strings
            // (read from /proc/self/stat before fork); nothing here reads them again.
            unsafe { std::ptr::write_bytes(start as *mut u8, 0, end.saturating_sub(start)) };
        }
        // SAFETY: prctl with a NUL-terminated name.
        unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr(), 0, 0, 0) };
    }

    /// The server died: kills the command's cgroup, then (without one) every process of the
    /// jail's own uid and the command's process group, this keeper included.
    fn orphaned(&self, child: libc::pid_t) -> ! {
        // SAFETY: raw syscalls.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            self.kill_cgroup();
            if let Some((uid, gid)) = self.uid {
                // The uid is the jail's alone (leased); kill(-1) as that uid reaches every
                // process running as it at once, wherever it moved.
                if uid != 0
                    && libc::syscall(libc::SYS_setresgid, gid, gid, gid) == 0
                    && libc::syscall(libc::SYS_setresuid, uid, uid, uid) == 0
                {
                    libc::kill(-1, libc::SIGKILL);
                }
            }
            libc::kill(-libc::getpid(), libc::SIGKILL);
            libc::_exit(137)
        }
    }

    fn kill_cgroup(&self) {
        if let Some(kill) = &self.cgroup_kill {
            let _ = write_file(kill, b"1");
        }
    }

    /// The command's own confinement, in the order that keeps each step possible.
    fn confine(&self, filters: &[seccompiler::BpfProgram]) -> std::io::Result<()> {
        // SAFETY: raw syscalls on memory prepared before fork.
        unsafe {
            // Before the descriptor limit: until exec the child still holds every descriptor
            // of the server's, which may number more than the limit allows a new one.
            if let (Some(ruleset), true) = (
                self.ruleset_fd,
                self.proc_rights != 0 && self.view != ProcessView::Host,
            ) {
                // The /proc mounted here is a new filesystem the parent's rule cannot name.
                let fd = libc::open(PROC.as_ptr().cast(), libc::O_PATH | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let rc = landlock::add_path_rule(ruleset, fd, self.proc_rights);
                libc::close(fd);
                rc?;
            }
            if self.nice != 0 {
                if libc::setpriority(libc::PRIO_PROCESS, 0, self.nice) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // With autogroups (and no CPU cgroup) the scheduler weighs sessions against
                // each other first: the command's own session gets the same nice value. A
                // kernel without autogroups has no such file, and the nice value is all.
                let _ = write_file(AUTOGROUP, &self.nice_text);
            }
            for &(res, value) in &self.rlimits {
                let lim = libc::rlimit {
                    rlim_cur: value,
                    rlim_max: value,
                };
                if libc::setrlimit(res, &lim) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some((uid, gid)) = self.uid {
                if libc::setgroups(0, std::ptr::null()) < 0
                    || libc::setresgid(gid, gid, gid) < 0
                    || libc::setresuid(uid, uid, uid) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // As the jail's uid: a directory the agent turned into a link is followed with
            // its rights, not root's.
            if libc::chdir(self.cwd.as_ptr()) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        if let Some(fd) = self.ruleset_fd {
            landlock::restrict_self(fd)?;
        }
        for prog in filters {
            super::seccomp::install(prog)?;
        }
        Ok(())
    }
}

/// Pid 1 of the command's namespace: reaps everything; exits with the command's status when
/// the command ends, which makes the kernel kill every other process in the namespace.
fn init(command: libc::pid_t) -> ! {
    close_all_but(None);
    // SAFETY: raw syscalls.
    unsafe {
        loop {
            let mut status = 0;
            let r = libc::waitpid(-1, &mut status, 0);
            if r == command {
                libc::_exit(exit_code(status));
            }
            if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                libc::_exit(1);
            }
        }
    }
}

/// Where this process's command line lies in memory (fields 48 and 49 of its stat).
pub(crate) fn argv_area() -> Option<(usize, usize)> {
    static AREA: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    *AREA.get_or_init(|| {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let rest = &stat[stat.rfind(')')? + 1..];
        // rest starts at field 3: arg_start is field 48, arg_end field 49.
        let mut f = rest.split_whitespace().skip(45);
        let start: usize = f.next()?.parse().ok()?;
        let end: usize = f.next()?.parse().ok()?;
        (start > 0 && end > start).then_some((start, end))
    })
}

/// What this kernel and privilege level allow: (pid namespace with its own /proc, a
/// hidepid /proc in a mount namespace). Probed in a forked child that only makes syscalls.
pub(crate) fn probe() -> (bool, bool) {
    let try_in_child = |flags: libc::c_int| -> bool {
        // SAFETY: raw syscalls on constant strings.
        succeeds_in_child(|| unsafe {
            libc::unshare(flags) == 0 && private_mounts().is_ok() && mount_proc().is_ok()
        })
    };
    let pidfd = {
        // SAFETY: pidfd_open of ourselves, closed right away.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0u32) };
        if fd >= 0 {
            // SAFETY: we own it.
            unsafe { libc::close(fd as i32) };
        }
        fd >= 0
    };
    let hidepid = try_in_child(libc::CLONE_NEWNS);
    let pid_ns = pidfd && hidepid && try_in_child(libc::CLONE_NEWNS | libc::CLONE_NEWPID);
    (pid_ns, hidepid)
}

/// Whether `test` returns true in a forked child (which exits right after): for probing what
/// the kernel lets this process do without changing the process itself. `test` must make only
/// async-signal-safe calls.
pub(crate) fn succeeds_in_child(test: impl FnOnce() -> bool) -> bool {
    // SAFETY: the child runs `test` (raw syscalls) and exits without unwinding.
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            libc::_exit(if test() { 0 } else { 1 });
        }
        if pid < 0 {
            return false;
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0) == pid
            && libc::WIFEXITED(status)
            && libc::WEXITSTATUS(status) == 0
    }
}

/// The read end of this process's lifeline: a pipe whose write end only this process holds
/// (close-on-exec), so it hangs up exactly when the process dies. Keepers poll it.
pub(crate) fn lifeline() -> Option<RawFd> {
    static LIFELINE: std::sync::OnceLock<Option<(RawFd, RawFd)>> = std::sync::OnceLock::new();
    LIFELINE
        .get_or_init(|| {
            let mut fds = [0; 2];
            // SAFETY: pipe2 fills the array.
            let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
            // Both ends live as long as the process: deliberately never closed.
            (rc == 0).then_some((fds[0], fds[1]))
        })
        .map(|(r, _)| r)
}
