//! Seccomp filters compiled once at start and installed in each child before exec.
//!
//! Denials return an errno instead of killing the process so that toolchains that probe for
//! a feature (a socket, a namespace) see a normal error and go on.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use super::SandboxError;

/// Whether the kernel can install filters that return an errno.
pub fn available() -> bool {
    const SECCOMP_GET_ACTION_AVAIL: libc::c_ulong = 2;
    let action: u32 = libc::SECCOMP_RET_ERRNO;
    // SAFETY: the query only reads `action`.
    let rc = unsafe { libc::syscall(libc::SYS_seccomp, SECCOMP_GET_ACTION_AVAIL, 0, &action) };
    rc == 0
}

/// Syscalls refused with EPERM whatever their arguments.
const DENIED: &[libc::c_long] = &[
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_unshare,
    libc::SYS_setns,
    // io_uring can open sockets and files without the syscalls filtered here.
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    // A new session would escape the process group the server kills on timeout.
    libc::SYS_setsid,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_userfaultfd,
    libc::SYS_acct,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_quotactl,
    libc::SYS_syslog,
    libc::SYS_fsopen,
    libc::SYS_fsmount,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
];

/// Namespace flags that `clone` may not carry.
const CLONE_NS_FLAGS: &[u64] = &[
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWCGROUP as u64,
];

fn arch() -> Result<TargetArch, SandboxError> {
    TargetArch::try_from(std::env::consts::ARCH).map_err(SandboxError::Seccomp)
}

fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, SandboxError> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value).map_err(SandboxError::Seccomp)
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, SandboxError> {
    SeccompRule::new(conds).map_err(SandboxError::Seccomp)
}

/// The syscall numbers of the names the filters govern (`socket`, `clone3`, `ptrace`, ...),
/// for diagnosis: `None` for a name the filters do not mention.
pub fn governed_syscall(name: &str) -> Option<libc::c_long> {
    let nr = match name {
        "socket" => libc::SYS_socket,
        "socketpair" => libc::SYS_socketpair,
        "connect" => libc::SYS_connect,
        "clone" => libc::SYS_clone,
        "clone3" => libc::SYS_clone3,
        "ioctl" => libc::SYS_ioctl,
        "ptrace" => libc::SYS_ptrace,
        "process_vm_readv" => libc::SYS_process_vm_readv,
        "process_vm_writev" => libc::SYS_process_vm_writev,
        "mount" => libc::SYS_mount,
        "bpf" => libc::SYS_bpf,
        "perf_event_open" => libc::SYS_perf_event_open,
        "keyctl" => libc::SYS_keyctl,
        "unshare" => libc::SYS_unshare,
        "setns" => libc::SYS_setns,
        "io_uring_setup" => libc::SYS_io_uring_setup,
        "setsid" => libc::SYS_setsid,
        "userfaultfd" => libc::SYS_userfaultfd,
        "name_to_handle_at" => libc::SYS_name_to_handle_at,
        _ => return None,
    };
    Some(nr)
}

/// Compiles the filters, in the order they are to be installed, with the rules for the
/// `allowed` syscalls left out: empty for every server, others for diagnosing what a
/// toolchain needs (`sandbox-exec --seccomp-allow`). `refuse_ipc` adds SysV IPC and POSIX
/// message queues, for hosts where commands cannot have IPC namespaces of their own.
pub fn compile(
    allowed: &[libc::c_long],
    refuse_ipc: bool,
) -> Result<Vec<BpfProgram>, SandboxError> {
    let ipc: &[libc::c_long] = if refuse_ipc {
        super::ipc::SYSCALLS
    } else {
        &[]
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED
        .iter()
        .chain(ipc)
        .map(|&nr| (nr, Vec::new()))
        .collect();
    // socket() only for AF_UNIX sequenced-packet sockets: CUDA's driver makes two in cuInit
    // (one probes the MPS control socket; measured on an H200, any error from socket() fails
    // cuInit with error 304). Network families are a way out, and stream and datagram AF_UNIX
    // sockets could reach the host's named sockets (landlock does not govern connect on a
    // socket file); listening sequenced-packet sockets are rare, and those a jail's uid may
    // write to are its own (abstract names are scoped by landlock and the network namespace).
    let mut socket_rules = vec![rule(vec![cond(
        0,
        SeccompCmpOp::Ne,
        libc::AF_UNIX as u64,
    )?])?];
    for ty in 0..16u64 {
        if ty != libc::SOCK_SEQPACKET as u64 {
            socket_rules.push(rule(vec![cond(1, SeccompCmpOp::MaskedEq(0xf), ty)?])?);
        }
    }
    rules.insert(libc::SYS_socket, socket_rules);
    let mut pair_rules = vec![rule(vec![cond(
        0,
        SeccompCmpOp::Ne,
        libc::AF_UNIX as u64,
    )?])?];
    for ty in 0..16u64 {
        if ty != libc::SOCK_STREAM as u64 && ty != libc::SOCK_SEQPACKET as u64 {
            pair_rules.push(rule(vec![cond(1, SeccompCmpOp::MaskedEq(0xf), ty)?])?);
        }
    }
    rules.insert(libc::SYS_socketpair, pair_rules);
    let clone_rules = CLONE_NS_FLAGS
        .iter()
        .map(|&flag| rule(vec![cond(0, SeccompCmpOp::MaskedEq(flag), flag)?]))
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_clone, clone_rules);
    // ioctl(TIOCSTI) pushes input into a terminal someone else reads.
    rules.insert(
        libc::SYS_ioctl,
        vec![rule(vec![cond(1, SeccompCmpOp::Eq, libc::TIOCSTI)?])?],
    );
    for nr in allowed {
        rules.remove(nr);
    }
    let deny = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch()?,
    )
    .map_err(SandboxError::Seccomp)?;

    // clone3 passes its flags in memory a filter cannot read: answer ENOSYS so that libc
    // falls back to clone, whose flags the first filter checks.
    let clone3 = refuse_with(libc::SYS_clone3, libc::ENOSYS, allowed)?;
    // No connect() at all, answered ENOENT: the only sockets a jail can make are AF_UNIX
    // sequenced-packet ones, and connect is how one would reach a named socket of the host.
    // ENOENT is what CUDA's driver gets when it probes /tmp/nvidia-mps/control on a machine
    // with no MPS server (measured on an H200), the answer it is known to go on from.
    let connect = refuse_with(libc::SYS_connect, libc::ENOENT, allowed)?;

    [deny, clone3, connect]
        .into_iter()
        .map(|f| BpfProgram::try_from(f).map_err(SandboxError::Seccomp))
        .collect()
}

/// A filter answering `errno` to every call of `nr` (none where `allowed` names it).
fn refuse_with(
    nr: libc::c_long,
    errno: libc::c_int,
    allowed: &[libc::c_long],
) -> Result<SeccompFilter, SandboxError> {
    let rules: BTreeMap<i64, Vec<SeccompRule>> = if allowed.contains(&nr) {
        BTreeMap::new()
    } else {
        [(nr, Vec::new())].into_iter().collect()
    };
    SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno as u32),
        arch()?,
    )
    .map_err(SandboxError::Seccomp)
}

/// Installs one compiled filter on the calling thread. Async-signal-safe: only a syscall.
pub fn install(prog: &BpfProgram) -> std::io::Result<()> {
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: fprog points at a live program for the duration of the call.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &fprog as *const _ as libc::c_ulong,
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}
