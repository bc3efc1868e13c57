//! The sandbox every tool process runs in: landlock, seccomp, rlimits, its own session,
//! no_new_privs, a scrubbed environment and, when the server runs as root, a leased uid,
//! its own pid namespace and `/proc`, cgroups bounding memory and processes over the whole
//! command, and a size- and inode-limited volume for everything it writes.
//!
//! Nothing a command starts outlives it: not the command's end (its namespace or cgroup is
//! killed), not a dropped handle ([`SandboxedChild`] kills on drop), not the server's death
//! (the keeper process watches a lifeline pipe), not a server restart ([`Sandbox::sweep_leftovers`]).
//!
//! The parent does all the work that allocates (compiling filters, building the landlock
//! ruleset, building argv and env); the child, between fork and exec, only makes syscalls.

mod cgroup;
mod cpu_wait;
mod features;
mod ipc;
mod landlock;
mod namespace;
mod process;
mod quota;
mod seccomp;
pub use seccomp::governed_syscall;
mod uid;

use std::ffi::OsString;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use cgroup::{
    nest, CgroupNesting, CgroupSupport, CgroupVersion, NestReport, BACKGROUND_CPU_SHARES,
    BACKGROUND_CPU_WEIGHT,
};
pub use cpu_wait::CpuAccounting;
pub use features::KernelFeatures;
pub use ipc::IpcIsolation;
pub use landlock::Access;
pub use namespace::ProcessView;
pub use process::{kill_session, kill_uid};
pub use quota::{sweep_volumes, QuotaEnforcement, Volume, VolumeLimits, VolumeUsage};
pub use uid::{UidLease, UidPool, DEFAULT_LOCK_DIR, DEFAULT_RANGE};

/// Errors from setting up a sandboxed process.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The kernel lacks a feature the sandbox needs.
    #[error("the kernel does not support {0}")]
    Unsupported(&'static str),
    /// The sandbox would run unconfined and nobody allowed it.
    #[error(
        "refusing to run unconfined: this kernel lacks {0}; pass --allow-unconfined to run anyway (results are then marked unconfined)"
    )]
    Unconfined(String),
    /// A system call failed while preparing the sandbox.
    #[error("{0} failed")]
    Os(&'static str, #[source] std::io::Error),
    /// The seccomp filter could not be compiled.
    #[error("seccomp filter")]
    Seccomp(#[source] seccompiler::BackendError),
    /// Every uid of the pool is leased or runs a process.
    #[error("no free uid left in {start}..{end}: every one is leased or runs a process")]
    NoFreeUid {
        /// First uid of the pool.
        start: u32,
        /// One past the last.
        end: u32,
    },
}

/// Resource limits applied to every sandboxed process (and inherited by its children).
#[derive(Debug, Clone, Serialize)]
pub struct ResourceLimits {
    /// CPU seconds per process (RLIMIT_CPU).
    pub cpu_seconds: u64,
    /// Writable private memory per process in bytes (RLIMIT_DATA). RLIMIT_DATA rather than
    /// RLIMIT_AS because CUDA reserves terabytes of address space it never touches.
    pub memory_bytes: u64,
    /// Largest file a process may write, in bytes (RLIMIT_FSIZE).
    pub file_size_bytes: u64,
    /// Open files per process (RLIMIT_NOFILE).
    pub open_files: u64,
    /// Processes per uid (RLIMIT_NPROC); only binding when the process runs as a non-root uid.
    pub processes: u64,
    /// Memory of all of a command's processes together, in bytes (a cgroup limit, where the
    /// host provides one; past it the kernel kills a process and the command is ended).
    pub total_memory_bytes: u64,
    /// Processes of a command at once (a cgroup limit, where the host provides one; whatever
    /// their uid).
    pub total_processes: u64,
}

impl Default for ResourceLimits {
    fn default() -> Self {
        Self {
            cpu_seconds: 900,
            memory_bytes: 8 << 30,
            file_size_bytes: 1 << 30,
            open_files: 4096,
            processes: 512,
            total_memory_bytes: 16 << 30,
            total_processes: 512,
        }
    }
}

/// Machine-wide sandbox settings, fixed at server start.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Paths every tool process may read and execute (system, toolchains, Python, CUDA).
    pub read_only: Vec<PathBuf>,
    /// Device nodes every tool process may read, write and ioctl.
    pub devices: Vec<PathBuf>,
    /// Trees whose existing files tool processes may write (but where they create nothing).
    pub write_existing: Vec<PathBuf>,
    /// Resource limits.
    pub limits: ResourceLimits,
    /// Run without the missing kernel features instead of refusing to start.
    pub allow_unconfined: bool,
    /// Apply landlock (turning it off is for diagnosis, and makes the sandbox unconfined).
    pub landlock: bool,
    /// Apply seccomp (turning it off is for diagnosis, and makes the sandbox unconfined).
    pub seccomp: bool,
    /// Syscalls whose seccomp rules are left out (diagnosis only; empty for every server).
    pub seccomp_allow: Vec<libc::c_long>,
    /// Put each command in cgroups where the host allows (turning it off is for diagnosis
    /// and measurement: the memory and process limits over a whole command go with them).
    pub cgroups: bool,
    /// Whether the server may move its processes into a leaf so that cgroup v2 controllers
    /// reach its commands' cgroups ([`CgroupNesting`]).
    pub cgroup_nesting: CgroupNesting,
    /// Memory every command together may hold: a parent cgroup with this limit over all
    /// commands' cgroups, where the host has a memory controller (None: no parent; each command
    /// has its own limit alone).
    pub commands_memory_bytes: Option<u64>,
    /// Where uid leases are locked; shared by every server on the host.
    pub uid_lock_dir: PathBuf,
    /// The uids leased to jails.
    pub uid_range: Range<u32>,
}

impl SandboxConfig {
    /// The usual system locations plus the given toolchain directories.
    pub fn with_toolchains(toolchains: impl IntoIterator<Item = PathBuf>) -> Self {
        let mut read_only: Vec<PathBuf> = [
            "/usr",
            "/bin",
            "/sbin",
            "/lib",
            "/lib32",
            "/lib64",
            "/etc",
            "/opt",
            "/sys",
            // Writable only for jails that run CUDA (`Jail::cuda`).
            "/proc",
            "/dev/shm",
            "/run/nvidia-persistenced",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        read_only.extend(toolchains);
        let mut devices: Vec<PathBuf> = [
            "/dev/null",
            "/dev/zero",
            "/dev/full",
            "/dev/random",
            "/dev/urandom",
            "/dev/tty",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        if let Ok(entries) = std::fs::read_dir("/dev") {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("nvidia") {
                    devices.push(e.path());
                }
            }
        }
        Self {
            read_only,
            devices,
            write_existing: Vec::new(),
            limits: ResourceLimits::default(),
            allow_unconfined: false,
            landlock: true,
            seccomp: true,
            seccomp_allow: Vec::new(),
            cgroups: true,
            cgroup_nesting: CgroupNesting::default(),
            commands_memory_bytes: None,
            uid_lock_dir: PathBuf::from(DEFAULT_LOCK_DIR),
            uid_range: DEFAULT_RANGE,
        }
    }
}

/// What the sandbox enforces on this machine, as reported in `/v1/info`.
#[derive(Debug, Clone, Serialize)]
pub struct SandboxStatus {
    /// Kernel features found.
    pub kernel: KernelFeatures,
    /// Landlock is applied to every tool process.
    pub landlock: bool,
    /// Seccomp filters are applied to every tool process.
    pub seccomp: bool,
    /// Tool processes run under a per-episode uid.
    pub uid_isolation: bool,
    /// Every confinement layer the sandbox needs is in force.
    pub confined: bool,
    /// Resource limits in force.
    pub limits: ResourceLimits,
    /// What a jail asking for [`ProcessView::Private`] gets on this host (less where the
    /// kernel or the server's privileges do not allow it).
    pub process_view: ProcessView,
    /// How a command's processes are all killed at its end: `pid_namespace`, `cgroup_kill`,
    /// `freezer` or `session` (a scan of the process table, which a process can escape by
    /// leaving the session only where setsid is allowed, which seccomp forbids).
    pub kill_method: &'static str,
    /// A command's processes die when the server dies (a keeper watching a lifeline pipe).
    pub die_with_server: bool,
    /// Unix sockets: `socketpair_only` (socket() is denied, so no named socket anywhere can
    /// be reached) or `unrestricted` without seccomp.
    pub unix_sockets: &'static str,
    /// Cgroup layers in force.
    pub cgroups: CgroupSupport,
    /// What moving the server into a leaf of its cgroup v2 did at start (`None` without
    /// cgroups).
    pub cgroup_nesting: Option<NestReport>,
    /// Memory all commands together may hold, as applied by a parent cgroup over theirs
    /// (None: not asked for, or the host has no memory controller the server may use).
    pub commands_memory_bytes: Option<u64>,
    /// How background commands ([`CpuPriority::Background`]) yield the CPU: `cpu_weight`
    /// (cgroup v2), `cpu_shares` (cgroup v1), or `nice` alone (their nice value and their
    /// session's autogroup).
    pub background_cpu: &'static str,
    /// How commands are kept from each other's SysV IPC objects and message queues.
    pub ipc: IpcIsolation,
    /// How a command's time waiting for a CPU is measured, so that the time the host held it
    /// back is not charged to it ([`SandboxedChild::wait_charged`]).
    pub cpu_accounting: CpuAccounting,
    /// How volumes ([`Volume`]) enforce their size and inode limits.
    pub disk_quota: QuotaEnforcement,
    /// The uids leased to jails, when uids are switched.
    pub uid_pool: Option<Range<u32>>,
}

/// A limit a command ran into; the command is ended when it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Breach {
    /// Its volume's bytes are used up.
    DiskQuota,
    /// Its volume's inodes are used up.
    Inodes,
    /// Its processes together went past the memory limit (the kernel killed one).
    Memory,
    /// It tried to run more processes at once than allowed.
    Processes,
}

impl Breach {
    /// A short machine-readable name, usable as a truncation reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Breach::DiskQuota => "disk_quota",
            Breach::Inodes => "inode_quota",
            Breach::Memory => "memory_limit",
            Breach::Processes => "process_limit",
        }
    }
}

impl std::fmt::Display for Breach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Breach::DiskQuota => "the disk quota (workspace and temp dir together) is used up",
            Breach::Inodes => "the file-count quota (workspace and temp dir together) is used up",
            Breach::Memory => "the processes together went past the memory limit",
            Breach::Processes => "too many processes at once",
        })
    }
}

/// How a sandboxed command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Its exit status (signals as 128 + signal number, as a shell reports them); `None`
    /// when it could not be collected.
    pub status: Option<std::process::ExitStatus>,
    /// It ran out of time and was killed.
    pub timed_out: bool,
    /// The limit it ran into, if any (it was killed if still running).
    pub breach: Option<Breach>,
    /// Processes killed after the command ended or was stopped.
    pub killed: usize,
    /// Wall-clock time during which the command waited for a CPU while none of its tasks ran
    /// ([`CpuAccounting`]; zero where not measured).
    pub cpu_wait: Duration,
    /// It was killed at its wall-clock cap ([`SandboxedChild::wait_charged`]) before its
    /// charged time ran out (`timed_out` is set too).
    pub wall_capped: bool,
}

/// What [`Sandbox::sweep_leftovers`] found and ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SweepReport {
    /// Processes of unleased uids of the pool killed.
    pub processes_killed: usize,
    /// Cgroups of servers no longer running removed.
    pub cgroups_removed: usize,
    /// Processes in those cgroups killed.
    pub cgroup_processes_killed: usize,
    /// Volumes of servers no longer running unmounted.
    pub volumes_unmounted: Vec<PathBuf>,
    /// SysV IPC objects of unleased uids removed from the host's namespace.
    pub ipc_objects_removed: usize,
}

/// One confined place to run processes: a workspace and what it may touch.
#[derive(Debug, Clone)]
pub struct Jail {
    /// Directories the process may write (the workspace and its temp dir).
    pub writable: Vec<PathBuf>,
    /// Extra read-only paths for this jail only (such as a pristine harness copy).
    pub read_only: Vec<PathBuf>,
    /// The complete environment; nothing of the server's leaks through.
    pub env: Vec<(OsString, OsString)>,
    /// Uid and gid to run as, when the server can switch (from a [`UidLease`]).
    pub uid: Option<(u32, u32)>,
    /// What the processes see of the host's process table. Every path above stays at the
    /// same absolute path whatever the view (only `/proc` is replaced).
    pub process_view: ProcessView,
    /// The volume holding what the jail may write, whose limits end a command that reaches them.
    pub volume: Option<Arc<Volume>>,
    /// The share of the CPU its processes get when the machine is busy.
    pub cpu: CpuPriority,
    /// Whether its processes may start CUDA. The driver names its threads by writing
    /// `/proc/<pid>/task/<tid>/comm` and fails to initialise without (measured on an H200:
    /// cudaGetDeviceCount answers error 304), so such a jail may write the existing `/proc`
    /// entries its uid owns; other processes' entries stay out of reach (file modes, the
    /// per-episode uid, landlock's ptrace scoping). That also lets it rewrite its session's
    /// autogroup nice: [`CpuPriority`] says what that gains. Every other jail sees `/proc`
    /// read-only.
    pub cuda: bool,
}

/// How a jail's processes compete for the CPU. None of them can raise its own: the nice
/// value only goes up without privileges (and `RLIMIT_NICE` is 0), a new session (and so a
/// new autogroup) is refused by seccomp, the cgroup is the server's to write, and
/// `/proc/self/autogroup` is read-only under landlock. The exception is a jail that runs CUDA
/// ([`Jail::cuda`]), which can write its autogroup back to nice 0 (the kernel lets any
/// process raise its autogroup's priority up to 0). Where the host has a CPU controller that
/// gains nothing: autogroups only weigh tasks of the root CPU group, and the command has a
/// group of its own. Without one, its processes keep nice 10 and its session then competes
/// as one at the judge's weight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuPriority {
    /// The server's own priority: an evaluation's judge and workers, whose lease on a device
    /// and whose timings suffer from every core taken from them.
    #[default]
    Normal,
    /// Work that only has to end in time: the agent's commands and candidate builds. A low
    /// cgroup CPU weight where the host has the controller, and a nice value of
    /// [`BACKGROUND_NICE`] always.
    Background,
}

/// The nice value of a background jail's processes (the weight ratio to nice 0 is about 1:9,
/// as [`cgroup::BACKGROUND_CPU_WEIGHT`] is to the default).
pub const BACKGROUND_NICE: i32 = 10;

impl Jail {
    /// A jail over a workspace and its temp dir with the standard scrubbed environment:
    /// `PATH` from `path_dirs`, `HOME` the workspace, `TMPDIR` the temp dir, plus `extra_env`.
    pub fn standard(
        workspace: &Path,
        tmp: &Path,
        path_dirs: &[PathBuf],
        extra_env: &[(String, String)],
        uid: Option<(u32, u32)>,
    ) -> Self {
        let path = std::env::join_paths(path_dirs).unwrap_or_default();
        let mut env: Vec<(OsString, OsString)> = vec![
            ("PATH".into(), path),
            ("HOME".into(), workspace.into()),
            ("TMPDIR".into(), tmp.into()),
            ("LANG".into(), "C.UTF-8".into()),
            ("LC_ALL".into(), "C.UTF-8".into()),
            ("TERM".into(), "dumb".into()),
            ("USER".into(), "agent".into()),
            ("SHELL".into(), "/bin/bash".into()),
            ("PYTHONUNBUFFERED".into(), "1".into()),
            (
                "TORCH_EXTENSIONS_DIR".into(),
                tmp.join("torch_extensions").into(),
            ),
            // Inductor's compile workers start their own sessions, which the sandbox forbids.
            ("TORCHINDUCTOR_COMPILE_THREADS".into(), "1".into()),
        ];
        env.extend(extra_env.iter().map(|(k, v)| (k.into(), v.into())));
        Self {
            writable: vec![workspace.to_path_buf(), tmp.to_path_buf()],
            read_only: Vec::new(),
            env,
            uid,
            process_view: ProcessView::Private,
            volume: None,
            cpu: CpuPriority::Normal,
            cuda: false,
        }
    }
}

/// Creates a directory private to `owner` (mode 0700), for a workspace or temp dir.
pub fn create_private_dir(path: &Path, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
    }
    Ok(())
}

/// The sandbox: compiled filters and machine-wide settings, shared by all episodes.
#[derive(Clone)]
pub struct Sandbox {
    inner: Arc<Inner>,
}

struct Inner {
    config: SandboxConfig,
    features: KernelFeatures,
    filters: Vec<seccompiler::BpfProgram>,
    cgroups: cgroup::Hierarchies,
    nesting: Option<NestReport>,
    commands_memory: Option<u64>,
    uids: Option<UidPool>,
    cpu_accounting: CpuAccounting,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("status", &self.status())
            .finish()
    }
}

impl Sandbox {
    /// Probes the kernel and compiles the filters; refuses to go on unconfined unless allowed.
    pub fn new(config: SandboxConfig) -> Result<Self, SandboxError> {
        let mut features = KernelFeatures::detect();
        if !config.landlock {
            features.landlock_abi = 0;
        }
        if !config.seccomp {
            features.seccomp = false;
        }
        let missing = features.missing();
        if !missing.is_empty() && !config.allow_unconfined {
            return Err(SandboxError::Unconfined(missing.join(", ")));
        }
        let filters = if features.seccomp {
            seccomp::compile(&config.seccomp_allow, !features.ipc_namespace)?
        } else {
            Vec::new()
        };
        let (mut cgroups, nesting) = if config.cgroups {
            let nesting = cgroup::nest(config.cgroup_nesting);
            (cgroup::Hierarchies::detect(), Some(nesting))
        } else {
            (cgroup::Hierarchies::default(), None)
        };
        let commands_memory = match config.commands_memory_bytes.filter(|_| config.cgroups) {
            Some(bytes) => match cgroups.cap_commands_memory(bytes) {
                Ok(dir) => {
                    tracing::info!(bytes, parent = %dir.display(), "every command's cgroup is made under a parent holding all of them to a memory limit");
                    Some(bytes)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "no parent cgroup over all commands: each command has its own memory limit alone");
                    None
                }
            },
            None => None,
        };
        features.cgroups = cgroups.support();
        let uids = if features.can_switch_uid {
            Some(UidPool::new(
                &config.uid_lock_dir,
                config.uid_range.clone(),
            )?)
        } else {
            None
        };
        become_subreaper();
        let cpu_accounting = if cpu_wait::schedstat_readable() && cgroups.count_cpu_time() {
            CpuAccounting::Schedstat
        } else {
            CpuAccounting::Wall
        };
        tracing::info!(
            ?cpu_accounting,
            "how a command's wait for a CPU is measured"
        );
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                features,
                filters,
                cgroups,
                nesting,
                commands_memory,
                uids,
                cpu_accounting,
            }),
        })
    }

    /// The uid pool, when tool processes can run under their own uids.
    pub fn uid_pool(&self) -> Option<&UidPool> {
        self.inner.uids.as_ref()
    }

    /// Leases a uid for an episode; `None` when the server cannot switch uids.
    pub fn lease_uid(&self) -> Result<Option<UidLease>, SandboxError> {
        self.inner.uids.as_ref().map(UidPool::acquire).transpose()
    }

    /// Leases two uids for an evaluation (judge, worker); `None` when the server cannot
    /// switch uids.
    pub fn lease_uid_pair(&self) -> Result<Option<(UidLease, UidLease)>, SandboxError> {
        self.inner
            .uids
            .as_ref()
            .map(UidPool::acquire_pair)
            .transpose()
    }

    /// Ends what a previous run (or a crashed server) left: processes of the pool's uids no
    /// running server holds, cgroups and volumes of servers that are gone. Call once at start.
    pub fn sweep_leftovers(&self) -> SweepReport {
        let processes_killed = self.inner.uids.as_ref().map(UidPool::sweep).unwrap_or(0);
        let (cgroups_removed, cgroup_processes_killed) = self.inner.cgroups.sweep();
        let volumes_unmounted = sweep_volumes();
        let ipc_objects_removed = self
            .inner
            .uids
            .as_ref()
            .map(UidPool::sweep_ipc)
            .unwrap_or(0);
        let report = SweepReport {
            processes_killed,
            ipc_objects_removed,
            cgroups_removed,
            cgroup_processes_killed,
            volumes_unmounted,
        };
        if report != SweepReport::default() {
            tracing::warn!(?report, "ended what an earlier run left behind");
        }
        report
    }

    /// The process view a jail asking for `wanted` gets on this host.
    pub fn effective_view(&self, wanted: ProcessView) -> ProcessView {
        let f = &self.inner.features;
        match wanted {
            ProcessView::Private if f.pid_namespace => ProcessView::Private,
            ProcessView::Private | ProcessView::OwnUid if f.hidepid => ProcessView::OwnUid,
            _ => ProcessView::Host,
        }
    }

    /// What is enforced.
    pub fn status(&self) -> SandboxStatus {
        let f = self.inner.features;
        SandboxStatus {
            kernel: f,
            landlock: f.landlock_abi > 0,
            seccomp: f.seccomp,
            uid_isolation: f.can_switch_uid,
            confined: f.missing().is_empty(),
            limits: self.inner.config.limits.clone(),
            process_view: self.effective_view(ProcessView::Private),
            kill_method: if f.pid_namespace {
                "pid_namespace"
            } else if f.cgroups.kill {
                "cgroup_kill"
            } else if f.cgroups.freezer {
                "freezer"
            } else {
                "session"
            },
            die_with_server: namespace::lifeline().is_some(),
            unix_sockets: if f.seccomp {
                "socketpair_only"
            } else {
                "unrestricted"
            },
            cgroups: f.cgroups,
            cgroup_nesting: self.inner.nesting.clone(),
            commands_memory_bytes: self.inner.commands_memory,
            ipc: if f.ipc_namespace {
                IpcIsolation::Namespace
            } else if f.seccomp {
                IpcIsolation::Refused
            } else {
                IpcIsolation::Shared
            },
            background_cpu: match f.cgroups.cpu {
                Some(CgroupVersion::V2) => "cpu_weight",
                Some(CgroupVersion::V1) => "cpu_shares",
                None => "nice",
            },
            disk_quota: if f.hidepid {
                QuotaEnforcement::Tmpfs
            } else {
                QuotaEnforcement::Measured
            },
            uid_pool: self.inner.uids.as_ref().map(UidPool::range),
            cpu_accounting: self.inner.cpu_accounting,
        }
    }

    /// Whether every layer is in force.
    pub fn is_confined(&self) -> bool {
        self.inner.features.missing().is_empty()
    }

    /// Whether tool processes can run under their own uid.
    pub fn can_switch_uid(&self) -> bool {
        self.inner.features.can_switch_uid
    }

    /// Builds a command that runs `program args` inside `jail` with `cwd` as working directory.
    /// The returned value must stay alive until the child is spawned.
    pub fn command(
        &self,
        jail: &Jail,
        program: &Path,
        args: &[OsString],
        cwd: &Path,
    ) -> Result<SandboxedCommand, SandboxError> {
        let inner = &self.inner;
        // A /proc mounted in the child is a new filesystem: it needs its own landlock rule.
        let proc_path = Path::new("/proc");
        let ruleset = if inner.features.landlock_abi > 0 {
            let mut rules: Vec<(&Path, Access)> = Vec::new();
            rules.extend(
                inner
                    .config
                    .read_only
                    .iter()
                    .map(|p| (p.as_path(), Access::ReadOnly)),
            );
            rules.extend(
                jail.read_only
                    .iter()
                    .map(|p| (p.as_path(), Access::ReadOnly)),
            );
            rules.extend(
                inner
                    .config
                    .devices
                    .iter()
                    .map(|p| (p.as_path(), Access::Device)),
            );
            rules.extend(
                inner
                    .config
                    .write_existing
                    .iter()
                    .map(|p| (p.as_path(), Access::WriteExisting)),
            );
            if jail.cuda {
                rules.push((proc_path, Access::WriteExisting));
            }
            rules.extend(
                jail.writable
                    .iter()
                    .map(|p| (p.as_path(), Access::ReadWrite)),
            );
            Some(landlock::Ruleset::build(
                inner.features.landlock_abi,
                &rules,
            )?)
        } else {
            None
        };
        // The working directory is entered by the command itself after it dropped to the
        // jail's uid (`ChildPlan::cwd`), never by root: an agent could have made it a link.
        let cwd = std::ffi::CString::new(cwd.as_os_str().as_encoded_bytes()).map_err(|e| {
            SandboxError::Os(
                "working directory",
                std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
            )
        })?;
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args)
            .env_clear()
            .envs(jail.env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);

        let limits = &inner.config.limits;
        let rlimits: [(libc::__rlimit_resource_t, u64); 7] = [
            (libc::RLIMIT_CPU, limits.cpu_seconds),
            // No process of a jail may lower its nice value (0: the ceiling stays at 20).
            (libc::RLIMIT_NICE, 0),
            (libc::RLIMIT_DATA, limits.memory_bytes),
            (libc::RLIMIT_FSIZE, limits.file_size_bytes),
            (libc::RLIMIT_NOFILE, limits.open_files),
            (libc::RLIMIT_NPROC, limits.processes),
            (libc::RLIMIT_CORE, 0),
        ];
        let cgroup = match inner.cgroups.create(
            limits.total_memory_bytes,
            limits.total_processes,
            jail.cpu == CpuPriority::Background,
        ) {
            Ok(cg) => cg,
            Err(e) => {
                tracing::warn!(error = %e, "no cgroup for this command; falling back to the session kill and per-process limits");
                None
            }
        };
        let proc_rights = if jail.cuda || inner.config.write_existing.iter().any(|p| p == proc_path)
        {
            landlock::dir_rights(inner.features.landlock_abi, Access::WriteExisting)
        } else if inner.config.read_only.iter().any(|p| p == proc_path) {
            landlock::dir_rights(inner.features.landlock_abi, Access::ReadOnly)
        } else {
            0
        };
        let nice = match jail.cpu {
            CpuPriority::Normal => 0,
            CpuPriority::Background => BACKGROUND_NICE,
        };
        let plan = namespace::ChildPlan {
            view: self.effective_view(jail.process_view),
            ipc_namespace: inner.features.ipc_namespace,
            cgroup_procs: cgroup
                .as_ref()
                .map(cgroup::CommandCgroup::procs_files)
                .unwrap_or_default(),
            cgroup_kill: cgroup.as_ref().and_then(cgroup::CommandCgroup::kill_file),
            lifeline: namespace::lifeline(),
            rlimits,
            nice,
            nice_text: nice.to_string().into_bytes(),
            uid: if inner.features.can_switch_uid {
                jail.uid
            } else {
                None
            },
            ruleset_fd: ruleset.as_ref().map(|r| r.raw_fd()),
            proc_rights,
            argv_area: namespace::argv_area(),
            cwd,
        };
        let view = plan.view;
        let this = self.clone();
        // SAFETY: the closure makes only async-signal-safe syscalls and touches memory that
        // was allocated before fork; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || plan.run(&this.inner.filters));
        }
        Ok(SandboxedCommand {
            cmd,
            _ruleset: ruleset,
            cgroup,
            view,
            volume: jail.volume.clone(),
        })
    }
}

/// A command ready to spawn, holding the landlock ruleset open until then.
pub struct SandboxedCommand {
    /// The command; spawn it with [`SandboxedCommand::spawn`] or adjust it first.
    pub cmd: tokio::process::Command,
    _ruleset: Option<landlock::Ruleset>,
    cgroup: Option<cgroup::CommandCgroup>,
    view: ProcessView,
    volume: Option<Arc<Volume>>,
}

impl SandboxedCommand {
    /// Spawns the process; the ruleset is closed in the parent afterwards.
    pub fn spawn(mut self) -> std::io::Result<SandboxedChild> {
        match self.cmd.spawn() {
            Ok(child) => {
                let sid = child.id().map(|p| p as i32);
                Ok(SandboxedChild {
                    child,
                    sid,
                    cgroup: self.cgroup.take(),
                    view: self.view,
                    volume: self.volume.take(),
                    exited: false,
                    cleaned: false,
                })
            }
            Err(e) => {
                if let Some(cg) = self.cgroup.take() {
                    cg.remove();
                }
                Err(e)
            }
        }
    }
}

/// A running sandboxed command. Everything it started is killed when it ends (see
/// [`SandboxedChild::wait_within`]), when [`SandboxedChild::kill_all`] is called, and when
/// this handle is dropped (such as when the future driving it is cancelled).
///
/// Dereferences to the spawned process (the command's keeper, whose pid is the session id
/// and whose exit status is the command's) for its pipes and `wait`.
#[derive(Debug)]
pub struct SandboxedChild {
    child: tokio::process::Child,
    sid: Option<i32>,
    cgroup: Option<cgroup::CommandCgroup>,
    view: ProcessView,
    volume: Option<Arc<Volume>>,
    exited: bool,
    cleaned: bool,
}

impl std::ops::Deref for SandboxedChild {
    type Target = tokio::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.child
    }
}

impl std::ops::DerefMut for SandboxedChild {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.child
    }
}

/// Kills what is left of a command and removes its cgroups. `keeper_done`: the keeper has
/// exited, so in a pid namespace nothing can be left.
fn clean_up(
    sid: Option<i32>,
    keeper_done: bool,
    view: ProcessView,
    cgroup: Option<cgroup::CommandCgroup>,
) -> usize {
    let mut killed = 0;
    if let Some(cg) = &cgroup {
        killed += cg.kill_all();
    }
    // Once the init of a pid namespace is gone, the kernel has killed and reaped the rest.
    // Otherwise the session is walked: for processes the cgroups missed, and to reap the
    // killed orphans that were reparented to the server.
    let contained = view == ProcessView::Private && keeper_done;
    if let (Some(sid), false) = (sid, contained) {
        killed += kill_session(sid, false);
    }
    if let Some(cg) = cgroup {
        cg.remove();
    }
    killed
}

impl SandboxedChild {
    /// The limit the command has run into, if any.
    pub fn breach(&self) -> Option<Breach> {
        self.cgroup
            .as_ref()
            .and_then(cgroup::CommandCgroup::breach)
            .or_else(|| self.volume.as_ref().and_then(|v| v.breach()))
    }

    /// Waits for the command to end, at most `timeout`, checking its limits meanwhile; a
    /// command that runs out of time or into a limit is killed. Then kills everything it left.
    pub async fn wait_within(&mut self, timeout: Duration) -> Outcome {
        self.wait_charged(timeout, timeout).await
    }

    /// Waits for the command to end while its charged time (wall time less the time it
    /// waited for a CPU while none of its tasks ran, [`CpuAccounting`]) stays under `limit`
    /// and its wall time under `wall_cap`, checking its limits meanwhile; a command past
    /// either, or in a limit, is killed. Then kills everything it left. A host that keeps a
    /// command waiting for a CPU thus moves its deadline, up to the cap; where the wait is
    /// not measured (or `wall_cap` is not above `limit`) the deadline is `limit` of wall time.
    pub async fn wait_charged(&mut self, limit: Duration, wall_cap: Duration) -> Outcome {
        let start = tokio::time::Instant::now();
        let hard = start + wall_cap;
        // Sampled every other tick, at the deadline and at the end.
        let mut meter = match wall_cap > limit {
            true => self
                .cgroup
                .as_ref()
                .and_then(cgroup::CommandCgroup::cpu_wait_meter),
            false => None,
        };
        // Charged time grows at most as fast as wall time: the charged limit is reached no
        // sooner than `limit` plus what was waited so far.
        let deadline = |waited: Duration| (start + limit + waited).min(hard);
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A measured volume costs a directory walk: checked every 2 s only.
        let walk_every = match self.volume.as_ref().map(|v| v.enforcement()) {
            Some(QuotaEnforcement::Measured) => 20,
            _ => 1,
        };
        let mut ticks = 0u64;
        let (mut timed_out, mut breach, mut wall_capped) = (false, None, false);
        let status = loop {
            let until = deadline(meter.as_ref().map_or(Duration::ZERO, |m| m.waited()));
            tokio::select! {
                st = self.child.wait() => break st.ok(),
                _ = tokio::time::sleep_until(until) => {
                    let waited = meter.as_mut().map_or(Duration::ZERO, |m| m.sample());
                    let now = tokio::time::Instant::now();
                    if now >= deadline(waited) {
                        timed_out = true;
                        wall_capped = now >= hard && now < start + limit + waited;
                        break None;
                    }
                }
                _ = tick.tick() => {
                    ticks += 1;
                    if ticks.is_multiple_of(2) {
                        if let Some(m) = meter.as_mut() {
                            m.sample();
                        }
                    }
                    let b = self.cgroup.as_ref().and_then(cgroup::CommandCgroup::breach).or_else(|| {
                        ticks.is_multiple_of(walk_every).then(|| self.volume.as_ref().and_then(|v| v.breach())).flatten()
                    });
                    if b.is_some() {
                        breach = b;
                        break None;
                    }
                }
            }
        };
        // The last window: tasks that exited in it took their counters with them.
        let cpu_wait = match meter.as_mut() {
            Some(m) if status.is_some() => m.sample(),
            Some(m) => m.waited(),
            None => Duration::ZERO,
        };
        let status = match status {
            Some(s) => {
                self.exited = true;
                Some(s)
            }
            None => None,
        };
        let killed = self.kill_all().await;
        let status = match status {
            Some(s) => Some(s),
            None => self.child.wait().await.ok(),
        };
        // A command that filled its volume and then exited still ran into the limit.
        let breach = breach.or_else(|| self.breach());
        Outcome {
            status,
            timed_out,
            breach,
            killed,
            cpu_wait,
            wall_capped,
        }
    }

    /// Kills the command and everything it started; returns how many processes were killed
    /// besides the command's keeper. Safe to call more than once.
    pub async fn kill_all(&mut self) -> usize {
        // A keeper that exited on its own did so after the namespace's init; one killed here
        // leaves the init to die of its parent-death signal a moment later.
        let ended_itself = self.exited;
        if !self.exited {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
            self.exited = true;
        }
        if self.cleaned {
            return 0;
        }
        self.cleaned = true;
        let (sid, view, cgroup) = (self.sid, self.view, self.cgroup.take());
        tokio::task::spawn_blocking(move || clean_up(sid, ended_itself, view, cgroup))
            .await
            .unwrap_or(0)
    }
}

impl Drop for SandboxedChild {
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        let (sid, view, cgroup, exited) = (self.sid, self.view, self.cgroup.take(), self.exited);
        if exited && cgroup.is_none() && view == ProcessView::Private {
            return; // nothing can be left
        }
        if !exited {
            // Its death takes down the command's pid namespace (parent-death signal).
            let _ = self.child.start_kill();
        }
        let work = move || {
            clean_up(sid, exited, view, cgroup);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(work);
            }
            Err(_) => work(),
        }
    }
}

/// Makes this process the reaper of its orphaned descendants, so killed tool processes are
/// reaped here instead of piling up as zombies under an init that may never reap them
/// (zombies would count against the episode uid's process limit).
fn become_subreaper() {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}
