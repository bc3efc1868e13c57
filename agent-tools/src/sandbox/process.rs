//! The host's process table as the sandbox needs it: who is in a session, who runs as a uid,
//! and killing and reaping them.

/// One line of `/proc/<pid>/stat` (and the real uid from `/proc/<pid>/status`).
pub(crate) struct ProcEntry {
    pub pid: i32,
    pub ppid: i32,
    pub session: i32,
    pub zombie: bool,
    /// Real and effective uid; `None` when the status file could not be read.
    pub uids: Option<(u32, u32)>,
}

fn parse_stat(pid: i32) -> Option<(i32, i32, bool)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces:
    // state ppid pgrp session ...
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?;
    let ppid = f.next()?.parse().ok()?;
    let _pgrp = f.next()?;
    let session = f.next()?.parse().ok()?;
    Some((ppid, session, state == "Z"))
}

fn parse_uids(pid: i32) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    let mut f = line.split_whitespace().skip(1);
    Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
}

fn pids() -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .collect()
}

/// Every process on the host, without uids (cheaper).
pub(crate) fn processes() -> Vec<ProcEntry> {
    pids()
        .into_iter()
        .filter_map(|pid| {
            let (ppid, session, zombie) = parse_stat(pid)?;
            Some(ProcEntry {
                pid,
                ppid,
                session,
                zombie,
                uids: None,
            })
        })
        .collect()
}

/// Every process on the host, with its real and effective uid.
pub(crate) fn processes_with_uids() -> Vec<ProcEntry> {
    pids()
        .into_iter()
        .filter_map(|pid| {
            let (ppid, session, zombie) = parse_stat(pid)?;
            Some(ProcEntry {
                pid,
                ppid,
                session,
                zombie,
                uids: parse_uids(pid),
            })
        })
        .collect()
}

/// The start time of `pid` in clock ticks since boot (field 22 of its stat), which with the
/// pid names a process uniquely across pid reuse.
pub(crate) fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest starts at field 3 (state); start time is field 22.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Reaps zombies that were reparented to this process (the sandbox makes the server a
/// subreaper) and match `keep`. Direct children someone else waits for must not match.
pub(crate) fn reap_orphans(procs: &[ProcEntry], keep: impl Fn(&ProcEntry) -> bool) {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    for p in procs.iter().filter(|p| p.zombie && p.ppid == me && keep(p)) {
        let mut status = 0;
        // SAFETY: waitpid on a specific zombie child of ours.
        unsafe { libc::waitpid(p.pid, &mut status, libc::WNOHANG) };
    }
}

/// Kills every process in session `sid` (the child's own session, whose id is its pid),
/// including ones that moved to another process group, and reaps the orphans. The leader
/// itself is signalled only when `leader_unreaped` (the caller has not waited for it). Repeats until
/// none is left, so a process forking while being killed is caught on the next pass.
pub fn kill_session(sid: i32, leader_unreaped: bool) -> usize {
    if leader_unreaped {
        // Not reaped yet, so the pid cannot have been reused. (Once reaped it could be, so
        // then only the processes /proc shows in the session are signalled.)
        // SAFETY: kill has no memory preconditions.
        unsafe { libc::kill(sid, libc::SIGKILL) };
    }
    let mut killed = 0;
    for _ in 0..100 {
        let procs = processes();
        let members: Vec<&ProcEntry> = procs
            .iter()
            .filter(|p| p.session == sid && p.pid != sid)
            .collect();
        if members.is_empty() {
            break;
        }
        for p in members.iter().filter(|p| !p.zombie) {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(p.pid, libc::SIGKILL) };
            killed += 1;
        }
        // The leader (pid `sid`) is the direct child its spawner waits for.
        reap_orphans(&procs, |p| p.session == sid && p.pid != sid);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    killed
}

/// Kills every process whose real or saved uid is `uid`, atomically with respect to forks:
/// a helper process takes that uid and calls `kill(-1, SIGKILL)`, which the kernel applies
/// to all of them under one lock. Repeats until none is left alive; returns how many there
/// were. Only for uids nothing else on the host uses (a leased sandbox uid).
pub fn kill_uid(uid: u32) -> usize {
    if uid == 0 {
        return 0; // never root's processes
    }
    let mut found = 0;
    for _ in 0..50 {
        let procs = processes_with_uids();
        let alive = procs
            .iter()
            .filter(|p| !p.zombie && p.uids.is_some_and(|(r, e)| r == uid || e == uid))
            .count();
        reap_orphans(&procs, |p| {
            p.uids.is_some_and(|(r, e)| r == uid || e == uid)
        });
        if alive == 0 {
            break;
        }
        found = found.max(alive);
        // SAFETY: the child makes only raw syscalls (no allocation, no locks) and exits.
        unsafe {
            let pid = libc::fork();
            if pid == 0 {
                // Raw syscalls: glibc's setresuid would try to sync other threads, which do
                // not exist in the child.
                if libc::syscall(libc::SYS_setresgid, uid, uid, uid) == 0
                    && libc::syscall(libc::SYS_setresuid, uid, uid, uid) == 0
                {
                    libc::kill(-1, libc::SIGKILL);
                }
                libc::_exit(0);
            }
            if pid > 0 {
                let mut status = 0;
                libc::waitpid(pid, &mut status, 0);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    found
}
