//! The sandbox every tool process runs in: landlock, seccomp, rlimits, its own session and
//! process group, no_new_privs, a scrubbed environment and, when the server runs as root, a
//! per-episode uid.
//!
//! The parent does all the work that allocates (compiling filters, building the landlock
//! ruleset, building argv and env); the child, between fork and exec, only makes syscalls.

mod features;
mod landlock;
mod seccomp;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

pub use features::KernelFeatures;
pub use landlock::Access;

/// Errors from setting up a sandboxed process.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The kernel lacks a feature the sandbox needs.
    #[error("the kernel does not support {0}")]
    Unsupported(&'static str),
    /// The sandbox would run unconfined and nobody allowed it.
    #[error("refusing to run unconfined: this kernel lacks {0}; pass --allow-unconfined to run anyway (results are then marked unconfined)")]
    Unconfined(String),
    /// A system call failed while preparing the sandbox.
    #[error("{0} failed: {1}")]
    Os(&'static str, #[source] std::io::Error),
    /// The seccomp filter could not be compiled.
    #[error("seccomp filter: {0}")]
    Seccomp(String),
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
}

impl Default for ResourceLimits {
    fn default() -> Self {
        Self {
            cpu_seconds: 900,
            memory_bytes: 8 << 30,
            file_size_bytes: 1 << 30,
            open_files: 4096,
            processes: 512,
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
}

impl SandboxConfig {
    /// The usual system locations plus the given toolchain directories.
    pub fn with_toolchains(toolchains: impl IntoIterator<Item = PathBuf>) -> Self {
        let mut read_only: Vec<PathBuf> = [
            "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/opt",
            "/sys", "/dev/shm", "/run/nvidia-persistenced",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        read_only.extend(toolchains);
        let mut devices: Vec<PathBuf> =
            ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"]
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
        // CUDA's runtime writes to the process's own /proc entries during initialisation
        // (measured on an H200: without it cudaGetDeviceCount fails with error 304). Other
        // processes' entries stay out of reach: file modes, the per-episode uid, and
        // landlock's ptrace scoping guard them.
        let write_existing = vec![PathBuf::from("/proc")];
        Self { read_only, devices, write_existing, limits: ResourceLimits::default(), allow_unconfined: false, landlock: true, seccomp: true }
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
    /// Uid and gid to run as, when the server can switch.
    pub uid: Option<(u32, u32)>,
}

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
            ("TORCH_EXTENSIONS_DIR".into(), tmp.join("torch_extensions").into()),
            // Inductor's compile workers start their own sessions, which the sandbox forbids.
            ("TORCHINDUCTOR_COMPILE_THREADS".into(), "1".into()),
        ];
        env.extend(extra_env.iter().map(|(k, v)| (k.into(), v.into())));
        Self { writable: vec![workspace.to_path_buf(), tmp.to_path_buf()], read_only: Vec::new(), env, uid }
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
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox").field("status", &self.status()).finish()
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
        let filters = if features.seccomp { seccomp::compile()? } else { Vec::new() };
        become_subreaper();
        Ok(Self { inner: Arc::new(Inner { config, features, filters }) })
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
        let ruleset = if inner.features.landlock_abi > 0 {
            let mut rules: Vec<(&Path, Access)> = Vec::new();
            rules.extend(inner.config.read_only.iter().map(|p| (p.as_path(), Access::ReadOnly)));
            rules.extend(jail.read_only.iter().map(|p| (p.as_path(), Access::ReadOnly)));
            rules.extend(inner.config.devices.iter().map(|p| (p.as_path(), Access::Device)));
            rules.extend(inner.config.write_existing.iter().map(|p| (p.as_path(), Access::WriteExisting)));
            rules.extend(jail.writable.iter().map(|p| (p.as_path(), Access::ReadWrite)));
            Some(landlock::Ruleset::build(inner.features.landlock_abi, &rules)?)
        } else {
            None
        };
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args)
            .current_dir(cwd)
            .env_clear()
            .envs(jail.env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);

        let limits = &inner.config.limits;
        let rlimits: [(libc::__rlimit_resource_t, u64); 6] = [
            (libc::RLIMIT_CPU, limits.cpu_seconds),
            (libc::RLIMIT_DATA, limits.memory_bytes),
            (libc::RLIMIT_FSIZE, limits.file_size_bytes),
            (libc::RLIMIT_NOFILE, limits.open_files),
            (libc::RLIMIT_NPROC, limits.processes),
            (libc::RLIMIT_CORE, 0),
        ];
        let uid = if inner.features.can_switch_uid { jail.uid } else { None };
        let ruleset_fd = ruleset.as_ref().map(|r| r.raw_fd());
        let this = self.clone();
        // SAFETY: the closure makes only async-signal-safe syscalls and touches memory that
        // was allocated before fork; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                for (res, value) in rlimits {
                    let lim = libc::rlimit { rlim_cur: value, rlim_max: value };
                    if libc::setrlimit(res, &lim) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some((uid, gid)) = uid {
                    if libc::setgroups(0, std::ptr::null()) < 0
                        || libc::setresgid(gid, gid, gid) < 0
                        || libc::setresuid(uid, uid, uid) < 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(fd) = ruleset_fd {
                    landlock::restrict_self(fd)?;
                }
                for prog in &this.inner.filters {
                    seccomp::install(prog)?;
                }
                Ok(())
            });
        }
        Ok(SandboxedCommand { cmd, _ruleset: ruleset })
    }
}

/// A command ready to spawn, holding the landlock ruleset open until then.
pub struct SandboxedCommand {
    /// The command; spawn it with [`SandboxedCommand::spawn`] or adjust it first.
    pub cmd: tokio::process::Command,
    _ruleset: Option<landlock::Ruleset>,
}

impl SandboxedCommand {
    /// Spawns the process; the ruleset is closed in the parent afterwards.
    pub fn spawn(mut self) -> std::io::Result<tokio::process::Child> {
        self.cmd.spawn()
    }
}

/// Makes this process the reaper of its orphaned descendants, so killed tool processes are
/// reaped here instead of piling up as zombies under an init that may never reap them
/// (zombies would count against the episode uid's process limit).
fn become_subreaper() {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}

struct ProcEntry {
    pid: i32,
    ppid: i32,
    session: i32,
    zombie: bool,
}

fn processes() -> Vec<ProcEntry> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // Fields after the command name, which is in parentheses and may hold spaces:
            // state ppid pgrp session ...
            let rest = &stat[stat.rfind(')')? + 1..];
            let mut f = rest.split_whitespace();
            let state = f.next()?;
            let ppid = f.next()?.parse().ok()?;
            let _pgrp = f.next()?;
            let session = f.next()?.parse().ok()?;
            Some(ProcEntry { pid, ppid, session, zombie: state == "Z" })
        })
        .collect()
}

/// Reaps zombies of session `sid` that were reparented to this process. The session leader
/// (pid `sid`) is left alone: it is the direct child its spawner waits for.
fn reap_orphans(procs: &[ProcEntry], sid: i32) {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    for p in procs.iter().filter(|p| p.zombie && p.ppid == me && p.session == sid && p.pid != sid) {
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
        let members: Vec<&ProcEntry> = procs.iter().filter(|p| p.session == sid && p.pid != sid).collect();
        if members.is_empty() {
            break;
        }
        for p in members.iter().filter(|p| !p.zombie) {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(p.pid, libc::SIGKILL) };
            killed += 1;
        }
        reap_orphans(&procs, sid);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    killed
}
