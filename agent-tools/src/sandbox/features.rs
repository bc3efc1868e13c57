//! What the running kernel offers for confinement, probed once at start.

use serde::Serialize;

/// Kernel confinement features found on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KernelFeatures {
    /// Landlock ABI version (0 when landlock is missing or disabled).
    pub landlock_abi: u32,
    /// Seccomp filter mode with `SECCOMP_RET_ERRNO` is available.
    pub seccomp: bool,
    /// Unprivileged user namespaces are enabled (reported; the sandbox does not rely on them).
    pub user_namespaces: bool,
    /// Network namespaces exist (reported; the sandbox does not rely on them).
    pub network_namespaces: bool,
    /// The server runs as root, so tool processes can drop to a per-episode uid.
    pub can_switch_uid: bool,
    /// A command can get its own pid namespace and `/proc` (root, pidfds, mount namespaces).
    pub pid_namespace: bool,
    /// A command can get a `/proc` hiding other uids' processes (a mount namespace and a
    /// `hidepid` proc mount); also tells that the server may mount (tmpfs volumes).
    pub hidepid: bool,
    /// A command can get an IPC namespace of its own (SysV objects and POSIX message queues
    /// no other command can reach).
    pub ipc_namespace: bool,
    /// Cgroup layers the server can use.
    pub cgroups: super::CgroupSupport,
}

impl KernelFeatures {
    /// Probes the kernel. Never fails: a missing feature is reported as absent.
    pub fn detect() -> Self {
        let (pid_namespace, hidepid) = super::namespace::probe();
        Self {
            landlock_abi: super::landlock::abi_version(),
            seccomp: super::seccomp::available(),
            user_namespaces: std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .is_some_and(|n| n > 0),
            network_namespaces: std::path::Path::new("/proc/self/ns/net").exists(),
            // SAFETY: geteuid has no preconditions.
            can_switch_uid: unsafe { libc::geteuid() } == 0,
            pid_namespace,
            hidepid,
            ipc_namespace: super::ipc::probe_namespace(),
            cgroups: super::cgroup::Hierarchies::detect().support(),
        }
    }

    /// The features the sandbox needs and this kernel lacks, by name.
    pub fn missing(&self) -> Vec<&'static str> {
        let mut missing = Vec::new();
        if self.landlock_abi == 0 {
            missing.push("landlock");
        }
        if !self.seccomp {
            missing.push("seccomp");
        }
        missing
    }
}
