//! System V IPC (shared memory, message queues, semaphores) and POSIX message queues: kernel
//! objects that outlive the processes that made them and that any process of the same IPC
//! namespace can find by key or guess by id. Two sandboxes sharing them could hand work to
//! each other (a helper left running by one episode serving another's candidate), so every
//! command gets an IPC namespace of its own where the kernel allows, or none of these calls
//! where it does not; and objects that leased uids left in the host's namespace (an older
//! server, a host without namespaces) are removed at start and when a uid is released.

use serde::Serialize;

/// How commands are kept from each other's IPC objects, as reported in `/v1/info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IpcIsolation {
    /// Each command has its own IPC namespace: its objects die with it and no other
    /// command can name them.
    Namespace,
    /// No namespaces here: seccomp refuses every SysV IPC and POSIX message-queue call.
    Refused,
    /// Neither (an unconfined diagnosis run): commands share the host's objects.
    Shared,
}

/// Whether this process may give a child its own IPC namespace. Probed in a forked child.
pub(crate) fn probe_namespace() -> bool {
    // SAFETY: a raw syscall with no pointer arguments.
    super::namespace::succeeds_in_child(|| unsafe { libc::unshare(libc::CLONE_NEWIPC) == 0 })
}

/// The syscalls seccomp refuses where commands cannot have IPC namespaces of their own.
pub(crate) const SYSCALLS: &[libc::c_long] = &[
    libc::SYS_shmget,
    libc::SYS_shmat,
    libc::SYS_shmdt,
    libc::SYS_shmctl,
    libc::SYS_msgget,
    libc::SYS_msgsnd,
    libc::SYS_msgrcv,
    libc::SYS_msgctl,
    libc::SYS_semget,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_semctl,
    libc::SYS_mq_open,
    libc::SYS_mq_unlink,
    libc::SYS_mq_timedsend,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_notify,
    libc::SYS_mq_getsetattr,
];

/// The kinds of SysV object, with the `/proc/sysvipc` table that lists them, the column of
/// the owner's uid there, and how one is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Shm,
    Msg,
    Sem,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Shm, Kind::Msg, Kind::Sem];

    fn table(self) -> &'static str {
        match self {
            Kind::Shm => "/proc/sysvipc/shm",
            Kind::Msg => "/proc/sysvipc/msg",
            Kind::Sem => "/proc/sysvipc/sem",
        }
    }

    /// The table's name for an object's id.
    fn id_column(self) -> &'static str {
        match self {
            Kind::Shm => "shmid",
            Kind::Msg => "msqid",
            Kind::Sem => "semid",
        }
    }

    /// Each listed object's id and owner uid, the columns found by their names in the
    /// header (their positions differ between kinds and kernel versions).
    fn ids_and_owners(self, table: &str) -> Vec<(i32, u32)> {
        let mut lines = table.lines();
        let Some(header) = lines.next() else {
            return Vec::new();
        };
        let cols: Vec<&str> = header.split_whitespace().collect();
        let (Some(id_col), Some(uid_col)) = (
            cols.iter().position(|c| *c == self.id_column()),
            cols.iter().position(|c| *c == "uid"),
        ) else {
            return Vec::new();
        };
        lines
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                Some((f.get(id_col)?.parse().ok()?, f.get(uid_col)?.parse().ok()?))
            })
            .collect()
    }

    fn remove(self, id: i32) -> bool {
        // SAFETY: IPC_RMID takes no buffer worth reading; a null pointer is accepted.
        let rc = unsafe {
            match self {
                Kind::Shm => libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()),
                Kind::Msg => libc::msgctl(id, libc::IPC_RMID, std::ptr::null_mut()),
                Kind::Sem => libc::semctl(id, 0, libc::IPC_RMID),
            }
        };
        rc == 0
    }
}

/// Removes every SysV object in this process's IPC namespace whose owner `swept` accepts;
/// returns how many went. A shared-memory segment still attached somewhere is only marked
/// (the kernel frees it at the last detach, and no process can attach it any more).
pub(crate) fn sweep(swept: impl Fn(u32) -> bool) -> usize {
    let mut removed = 0;
    for kind in Kind::ALL {
        let Ok(table) = std::fs::read_to_string(kind.table()) else {
            continue;
        };
        for (id, owner) in kind.ids_and_owners(&table) {
            if swept(owner) && kind.remove(id) {
                removed += 1;
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_read_by_their_header() {
        let shm = "       key      shmid perms                  size  cpid  lpid nattch   uid   gid  cuid  cgid      atime      dtime      ctime                   rss                  swap\n        42          7   666             268435456  100   100      0 60001 60001 60001 60001          0          0 1700000000                     0                     0\n";
        assert_eq!(Kind::Shm.ids_and_owners(shm), [(7, 60001)]);
        let msg = "       key      msqid perms      cbytes       qnum lspid lrpid   uid   gid  cuid  cgid      stime      rtime      ctime\n         5          3   600           0          0     0     0    17    17    17    17          0          0 1700000000\n";
        assert_eq!(Kind::Msg.ids_and_owners(msg), [(3, 17)]);
        let sem = "       key      semid perms      nsems   uid   gid  cuid  cgid      otime      ctime\n         9          2   600          1  1000  1000  1000  1000          0 1700000000\n";
        assert_eq!(Kind::Sem.ids_and_owners(sem), [(2, 1000)]);
        assert!(Kind::Sem.ids_and_owners("").is_empty());
    }

    #[test]
    fn the_sweep_removes_a_segment_of_a_pool_uid_and_spares_others() {
        // SAFETY: a private segment of this test's own, removed below whatever happens.
        let id = unsafe { libc::shmget(libc::IPC_PRIVATE, 4096, libc::IPC_CREAT | 0o600) };
        assert!(id >= 0, "shmget: {}", std::io::Error::last_os_error());
        let me = unsafe { libc::geteuid() };
        let listed = |id| {
            Kind::Shm
                .ids_and_owners(&std::fs::read_to_string(Kind::Shm.table()).unwrap_or_default())
                .iter()
                .any(|&(i, _)| i == id)
        };
        assert!(listed(id));
        sweep(|u| u == me + 1);
        let spared = listed(id);
        sweep(|u| u == me);
        let gone = !listed(id);
        Kind::Shm.remove(id);
        assert!(spared, "a segment of a uid outside the range was removed");
        assert!(gone, "the segment of a uid in the range stayed");
    }
}
