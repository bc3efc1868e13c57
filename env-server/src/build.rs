//! Building candidates: fast and fair.
//!
//! - [`BuildQueue`]: builds at once are bounded (cores and memory); waiting builds are served
//!   round robin by requester (an episode, or the API caller), so one agent submitting many
//!   evaluations cannot starve the others.
//! - [`Toolchain`]: the environment every build gets: the exact CUDA architectures of this
//!   machine's GPUs (a build sees no GPU, and torch would otherwise fail or compile for every
//!   architecture) and a directory of precompiled torch headers.
//! - [`Pch`]: `torch/extension.h` precompiled once per torch, compiler and flag set, so a
//!   one-kernel C++ build does not parse the torch headers again (gcc picks the first valid
//!   precompiled variant in `extension.h.gch/`; an invalid one is skipped, never wrong).
//!
//! The precompiled headers are made by the server from the installed torch headers only,
//! into a server-owned directory that every sandbox reads and none writes.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use tokio::sync::oneshot;

use crate::runtime::{Device, PythonInfo};

/// Memory one build may take (g++ or nvcc over the torch headers), for the default bound.
pub const BUILD_MEMORY_BYTES: u64 = 2 << 30;

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
}

/// Builds at once by default: one per core, as many as memory allows at
/// [`BUILD_MEMORY_BYTES`] each, at least one.
pub fn default_max_builds() -> usize {
    let cores = cores();
    let by_memory = available_memory_bytes()
        .map(|b| (b / BUILD_MEMORY_BYTES) as usize)
        .unwrap_or(cores);
    cores.min(by_memory).max(1)
}

/// Compile jobs inside one build (`MAX_JOBS`) when `max_builds` run at once: the cores
/// shared out, 1 to 4.
pub fn jobs_per_build(max_builds: usize) -> usize {
    (cores() / max_builds.max(1)).clamp(1, 4)
}

/// `MemAvailable` of /proc/meminfo.
fn available_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The SHA-256 of `parts`, each preceded by its length (8 bytes, little-endian) and the whole
/// by their count: two different lists of parts never hash the same bytes, whatever the parts
/// hold (a separator byte would be ambiguous, since solution files may contain it).
pub fn digest_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let parts: Vec<&[u8]> = parts.into_iter().collect();
    let mut h = Sha256::new();
    h.update((parts.len() as u64).to_le_bytes());
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().into()
}

/// The build cache's key of a solution: torch's version, the device, and every file's name
/// and contents, length-prefixed ([`digest_parts`]), as 32 hex digits. Equal keys mean equal
/// inputs to the build, so an entry is only ever reused for the sources that made it.
pub fn build_key(torch: &str, device: Device, files: &BTreeMap<String, String>) -> String {
    let mut parts: Vec<&[u8]> = vec![torch.as_bytes(), device.as_str().as_bytes()];
    for (name, text) in files {
        parts.push(name.as_bytes());
        parts.push(text.as_bytes());
    }
    hex::encode(digest_parts(parts))[..32].to_string()
}

/// A bounded set of build slots granted round robin over requesters.
#[derive(Debug)]
pub struct BuildQueue {
    capacity: usize,
    state: Mutex<QueueState>,
}

#[derive(Debug, Default)]
struct QueueState {
    running: usize,
    /// Waiters per requester, oldest first.
    waiting: HashMap<String, VecDeque<oneshot::Sender<()>>>,
    /// Requesters with waiters, in the order they are next served.
    turn: VecDeque<String>,
}

/// A build slot; released when dropped.
#[derive(Debug)]
pub struct BuildPermit {
    queue: Arc<BuildQueue>,
}

impl Drop for BuildPermit {
    fn drop(&mut self) {
        self.queue.release();
    }
}

/// Snapshot of the queue, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLoad {
    /// Builds running.
    pub running: usize,
    /// Builds waiting.
    pub waiting: usize,
    /// Builds at once.
    pub capacity: usize,
}

impl BuildQueue {
    /// A queue of `capacity` slots (at least one).
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            capacity: capacity.max(1),
            state: Mutex::new(QueueState::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Running and waiting builds.
    pub fn load(&self) -> QueueLoad {
        let s = self.lock();
        QueueLoad {
            running: s.running,
            waiting: s.waiting.values().map(VecDeque::len).sum(),
            capacity: self.capacity,
        }
    }

    /// Waits for a slot for `requester`. Slots go round robin over the requesters that are
    /// waiting, oldest request first within one requester. Cancel-safe: a waiter dropped
    /// before or after being granted gives its slot on.
    pub async fn acquire(self: &Arc<Self>, requester: &str) -> BuildPermit {
        let rx = {
            let mut s = self.lock();
            if s.running < self.capacity && s.turn.is_empty() {
                s.running += 1;
                return BuildPermit {
                    queue: self.clone(),
                };
            }
            let (tx, rx) = oneshot::channel();
            let q = s.waiting.entry(requester.to_string()).or_default();
            q.push_back(tx);
            if q.len() == 1 {
                s.turn.push_back(requester.to_string());
            }
            rx
        };
        let mut waiter = Waiter {
            queue: self.clone(),
            rx: Some(rx),
        };
        let ok = match waiter.rx.as_mut() {
            Some(rx) => rx.await.is_ok(),
            None => false,
        };
        waiter.rx = None;
        if !ok {
            // The queue dropped the sender without granting: cannot happen while `self` lives;
            // take a slot the plain way rather than fail the build.
            self.lock().running += 1;
        }
        BuildPermit {
            queue: self.clone(),
        }
    }

    /// A slot is free: hand it to the next requester in turn whose waiter is still there.
    fn release(&self) {
        let mut s = self.lock();
        s.running = s.running.saturating_sub(1);
        while s.running < self.capacity {
            let Some(who) = s.turn.pop_front() else {
                break;
            };
            let Some(q) = s.waiting.get_mut(&who) else {
                continue;
            };
            let mut granted = false;
            while let Some(tx) = q.pop_front() {
                if tx.send(()).is_ok() {
                    granted = true;
                    break;
                }
            }
            let more = !q.is_empty();
            if more {
                s.turn.push_back(who);
            } else {
                s.waiting.remove(&who);
            }
            if granted {
                s.running += 1;
            }
        }
    }
}

/// A waiting acquire; if dropped after its slot was granted, the slot is given on.
struct Waiter {
    queue: Arc<BuildQueue>,
    rx: Option<oneshot::Receiver<()>>,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if rx.try_recv().is_ok() {
                self.queue.release();
            }
        }
    }
}

/// Errors preparing precompiled headers (the server then builds without them).
#[derive(Debug, thiserror::Error)]
pub enum PchError {
    /// The probe of torch's build flags failed.
    #[error("probing torch's extension flags with {python}: {message}")]
    Probe {
        /// The interpreter.
        python: String,
        /// What failed.
        message: String,
    },
    /// The interpreter could not be run for the probe.
    #[error("probing torch's extension flags: running {python}")]
    ProbeSpawn {
        /// The interpreter.
        python: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The probe printed something other than its JSON.
    #[error("probing torch's extension flags with {python}: bad probe output")]
    ProbeOutput {
        /// The interpreter.
        python: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The compiler failed on the header.
    #[error("precompiling torch/extension.h with `{flags}`: {message}")]
    Compile {
        /// The variant's flags.
        flags: String,
        /// The compiler's complaint (its last lines).
        message: String,
    },
    /// The compiler made a header that it then refused to use.
    #[error("the precompiled header for `{0}` is not used by the compiler; removed")]
    NotUsed(String),
    /// A file operation.
    #[error("{path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// What torch's extension builder passes the C++ compiler, as the probe reports it.
#[derive(Debug, Clone, Deserialize)]
struct ExtensionFlags {
    header: PathBuf,
    cxx: String,
    compiler: String,
    cflags: Vec<String>,
}

/// Prints torch's C++ flags for an extension (those of `load_inline`, without the extension's
/// name, which the header does not use) and the compiler it would call.
const FLAGS_PROBE: &str = r#"import json, os, shutil, subprocess, sys, sysconfig
from torch.utils import cpp_extension as ce
cuda = sys.argv[1] == 'cuda'
inc = ce.include_paths('cuda' if cuda else 'cpu')
py = sysconfig.get_path('include', scheme='posix_prefix')
if py:
    inc.append(py)
cxx = shutil.which(os.environ.get('CXX', 'c++')) or 'c++'
ver = subprocess.run([cxx, '--version'], capture_output=True, text=True).stdout.splitlines()
header = os.path.join(inc[0], 'torch', 'extension.h')
flags = ['-DTORCH_API_INCLUDE_EXTENSION_H']
for d in inc:
    flags += ['-isystem', d]
flags += ['-fPIC', '-std=c++17']
print(json.dumps({'header': header, 'cxx': cxx, 'compiler': ver[0] if ver else '', 'cflags': flags}))
"#;

/// The flag sets precompiled by default: what candidates pass most (`extra_cflags`).
pub fn default_pch_variants(device: Device) -> Vec<String> {
    match device {
        Device::Cpu => vec![
            "-O3".into(),
            "-O3 -march=native".into(),
            "-O3 -fopenmp".into(),
            "-O3 -march=native -fopenmp".into(),
            String::new(),
        ],
        Device::Cuda => vec!["-O3".into(), String::new()],
    }
}

/// A directory of precompiled torch headers to put on `CPATH`: `torch/extension.h` (a link to
/// torch's own) and `torch/extension.h.gch/<variant>.gch`.
#[derive(Debug, Clone)]
pub struct Pch {
    /// The include directory.
    pub dir: PathBuf,
    flags: ExtensionFlags,
}

impl Pch {
    /// Finds torch's flags and lays out the include directory under `root` (keyed by torch,
    /// compiler and device; other keys' directories are removed). Builds nothing yet.
    pub fn layout(
        root: &Path,
        python: &PythonInfo,
        device: Device,
        path: &std::ffi::OsStr,
        env: &[(String, String)],
    ) -> Result<Self, PchError> {
        let probe_err = |message: String| PchError::Probe {
            python: python.executable.display().to_string(),
            message,
        };
        let out = Command::new(&python.executable)
            .args(["-c", FLAGS_PROBE, device.as_str()])
            .env("PATH", path)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .output()
            .map_err(|source| PchError::ProbeSpawn {
                python: python.executable.display().to_string(),
                source,
            })?;
        if !out.status.success() {
            return Err(probe_err(last_lines(&out.stderr, 3)));
        }
        let flags: ExtensionFlags = serde_json::from_slice(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .last()
                .unwrap_or("")
                .as_bytes(),
        )
        .map_err(|source| PchError::ProbeOutput {
            python: python.executable.display().to_string(),
            source,
        })?;
        let key = {
            let mut parts = vec![
                python.torch.as_bytes(),
                flags.compiler.as_bytes(),
                device.as_str().as_bytes(),
            ];
            parts.extend(flags.cflags.iter().map(|f| f.as_bytes()));
            hex::encode(digest_parts(parts))[..16].to_string()
        };
        let io = |path: &Path, source| PchError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.flatten() {
                if e.file_name() != key.as_str() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let dir = root.join(&key);
        let torch_dir = dir.join("torch");
        let gch = torch_dir.join("extension.h.gch");
        std::fs::create_dir_all(&gch).map_err(|e| io(&gch, e))?;
        let link = torch_dir.join("extension.h");
        if std::fs::read_link(&link).ok().as_deref() != Some(flags.header.as_path()) {
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&flags.header, &link).map_err(|e| io(&link, e))?;
        }
        // Unfinished variants of an interrupted run; only while no other server sharing the
        // directory (`--pch-dir`) is making one, whose file this would take from under it.
        let lock = Self::lock_file(&dir)?;
        if lock.try_lock().is_ok() {
            if let Ok(entries) = std::fs::read_dir(&torch_dir) {
                for e in entries.flatten() {
                    if e.file_name().to_string_lossy().ends_with(".tmp") {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
        drop(lock);
        for p in [root, dir.as_path(), torch_dir.as_path(), gch.as_path()] {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| io(p, e))?;
        }
        Ok(Self { dir, flags })
    }

    /// The lock servers sharing a directory hold while they make a variant or clean up.
    fn lock_file(dir: &Path) -> Result<std::fs::File, PchError> {
        let path = dir.join(".lock");
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| PchError::Io { path, source })
    }

    fn variant_path(&self, flags: &str) -> PathBuf {
        let name = if flags.trim().is_empty() {
            "default".to_string()
        } else {
            flags
                .split_whitespace()
                .map(|f| {
                    f.trim_start_matches('-')
                        .replace(|c: char| !c.is_ascii_alphanumeric(), "_")
                })
                .collect::<Vec<_>>()
                .join("-")
        };
        self.dir
            .join("torch/extension.h.gch")
            .join(format!("{name}.gch"))
    }

    /// The compiler with torch's extension flags and the variant's own `flags`, in a process
    /// group of its own ([`run_compiler`] runs it).
    fn compiler(&self, flags: &str, path: &std::ffi::OsStr) -> Command {
        use std::os::unix::process::CommandExt;
        let mut c = Command::new(&self.flags.cxx);
        c.args(&self.flags.cflags)
            .args(flags.split_whitespace())
            .env("PATH", path)
            .process_group(0);
        // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of the
        // parent's; the closure runs in the child between fork and exec.
        unsafe {
            c.pre_exec(|| {
                // The driver ends with the thread that started it (a server killed outright);
                // its own children (cc1plus) are ended by [`stop_compilers`].
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        c
    }

    /// Whether the variant for `flags` is built.
    pub fn has(&self, flags: &str) -> bool {
        self.variant_path(flags).is_file()
    }

    /// Precompiles the header for `flags` (nothing if already there), then checks that the
    /// compiler uses it for an extension built with those flags; one it would not use is
    /// removed and reported.
    pub fn build(&self, flags: &str, path: &std::ffi::OsStr) -> Result<(), PchError> {
        let out = self.variant_path(flags);
        if out.is_file() {
            return Ok(());
        }
        let io = |path: &Path, source| PchError::Io {
            path: path.to_path_buf(),
            source,
        };
        // One maker per directory: a second server sharing it waits, then finds it made.
        let lock = Self::lock_file(&self.dir)?;
        lock.lock().map_err(|e| io(&self.dir.join(".lock"), e))?;
        if out.is_file() {
            return Ok(());
        }
        // Written beside the directory gcc reads, then renamed in: never seen half made.
        let tmp = self.dir.join("torch").join(scratch_name("variant", "tmp"));
        let mut cmd = self.compiler(flags, path);
        cmd.args(["-x", "c++-header"])
            .arg(&self.flags.header)
            .arg("-o")
            .arg(&tmp);
        let run = run_compiler(cmd).map_err(|e| io(Path::new(&self.flags.cxx), e))?;
        if !run.status.success() {
            let _ = std::fs::remove_file(&tmp);
            return Err(PchError::Compile {
                flags: flags.into(),
                message: last_lines(&run.stderr, 5),
            });
        }
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o444))
                .map_err(|e| io(&tmp, e))?;
        }
        std::fs::rename(&tmp, &out).map_err(|e| io(&out, e))?;
        if !self.used_for(flags, path)? {
            let _ = std::fs::remove_file(&out);
            return Err(PchError::NotUsed(flags.into()));
        }
        Ok(())
    }

    /// Whether the compiler, given this directory on `CPATH`, loads a precompiled header for
    /// a translation unit shaped like `load_inline`'s (`-H` marks a used one with `!`).
    pub fn used_for(&self, flags: &str, path: &std::ffi::OsStr) -> Result<bool, PchError> {
        let src = self.dir.join(scratch_name("probe", "cpp"));
        std::fs::write(
            &src,
            "#include <torch/extension.h>\nint cuda_agent_pch_probe;\n",
        )
        .map_err(|e| PchError::Io {
            path: src.clone(),
            source: e,
        })?;
        let mut cmd = self.compiler(flags, path);
        cmd.args(["-fsyntax-only", "-H", "-DTORCH_EXTENSION_NAME=probe"])
            .arg(&src)
            .env("CPATH", &self.dir);
        let run = run_compiler(cmd).map_err(|e| PchError::Io {
            path: PathBuf::from(&self.flags.cxx),
            source: e,
        })?;
        let _ = std::fs::remove_file(&src);
        let err = String::from_utf8_lossy(&run.stderr);
        Ok(err
            .lines()
            .any(|l| l.starts_with("! ") && l.contains("extension.h.gch")))
    }
}

/// Puts the calling thread, and every process it starts from now on, below everything else
/// on the CPU: nice 19 and `SCHED_IDLE`. The precompiled headers a server builds at start
/// are worth a few core-minutes to later builds, not one second of the first episodes'
/// commands or a timed evaluation.
pub fn yield_the_cpu() -> std::io::Result<()> {
    // SAFETY: both calls act on the calling thread alone (who = 0, pid = 0) and touch no
    // memory but the parameter block passed in; a forked child inherits the thread's values.
    unsafe {
        if libc::setpriority(libc::PRIO_PROCESS as _, 0, 19) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Process groups of the compilers running for the precompiled headers.
static COMPILERS: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// Runs a compiler made by [`Pch::compiler`] to its end, its process group known to
/// [`stop_compilers`] meanwhile.
fn run_compiler(mut cmd: Command) -> std::io::Result<std::process::Output> {
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn()?;
    let group = child.id() as i32;
    COMPILERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(group);
    let out = child.wait_with_output();
    COMPILERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|g| *g != group);
    out
}

/// Ends every compiler still precompiling headers, with all its processes: a precompile
/// takes a core-minute, and a stopped server's must not run on, orphaned. Called as the
/// server stops.
pub fn stop_compilers() {
    for group in COMPILERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain(..)
    {
        // SAFETY: killpg only sends a signal, to a process group this server made.
        unsafe {
            libc::killpg(group, libc::SIGKILL);
        }
    }
}

/// A file name no other call in any process shares: the server checks a variant it has just
/// made while another caller in the same process (a test) may check the same one, and each
/// removes its probe when done.
fn scratch_name(stem: &str, ext: &str) -> String {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{stem}-{}-{n}.{ext}", std::process::id())
}

fn last_lines(bytes: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The environment builds get, on top of the standard one: the CUDA architectures to compile
/// for and the precompiled headers.
#[derive(Debug, Clone, Default)]
pub struct Toolchain {
    /// `TORCH_CUDA_ARCH_LIST` for this machine's GPUs (None on the CPU).
    pub cuda_arch_list: Option<String>,
    /// The precompiled headers' include directory, when enabled.
    pub pch_dir: Option<PathBuf>,
}

impl Toolchain {
    /// The architecture list: the server's own `TORCH_CUDA_ARCH_LIST` if set, else exactly the
    /// architectures of the GPUs torch sees (no PTX: the kernels run on this machine only).
    pub fn for_device(device: Device, python: &PythonInfo) -> Self {
        let cuda_arch_list = match device {
            Device::Cpu => None,
            Device::Cuda => std::env::var("TORCH_CUDA_ARCH_LIST")
                .ok()
                .filter(|v| !v.trim().is_empty())
                .or_else(|| (!python.gpu_archs.is_empty()).then(|| python.gpu_archs.join(";"))),
        };
        Self {
            cuda_arch_list,
            pch_dir: None,
        }
    }

    /// Variables for every tool and build process.
    pub fn env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if let Some(a) = &self.cuda_arch_list {
            env.push(("TORCH_CUDA_ARCH_LIST".into(), a.clone()));
        }
        if let Some(d) = &self.pch_dir {
            env.push(("CPATH".into(), d.display().to_string()));
        }
        env
    }
}

/// Builds the precompiled header variants one after another on a background thread (each
/// takes a core for half a minute); builds before they are ready just parse the headers.
pub fn spawn_pch_builds(pch: Pch, variants: Vec<String>, path: std::ffi::OsString) {
    std::thread::Builder::new()
        .name("pch".into())
        .spawn(move || {
            if let Err(e) = yield_the_cpu() {
                tracing::warn!(error = %e, "precompiled headers built at normal priority");
            }
            for flags in variants {
                if pch.has(&flags) {
                    continue;
                }
                let t0 = std::time::Instant::now();
                match pch.build(&flags, &path) {
                    Ok(()) => tracing::info!(
                        flags = %flags,
                        seconds = t0.elapsed().as_secs_f64(),
                        "precompiled torch/extension.h"
                    ),
                    Err(e) => tracing::warn!(error = %env_api::ErrorChain(&e), "precompiled header not made"),
                }
            }
        })
        .map(drop)
        .unwrap_or_else(|e| tracing::warn!(error = %e, "no thread for precompiled headers"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A thread that yields the CPU runs at nice 19 under `SCHED_IDLE`, and so does a compiler
    /// it starts (read from the child's own /proc stat); the rest of the process keeps its
    /// priority.
    #[test]
    fn background_header_builds_yield_the_cpu() {
        let stat_of_child = std::thread::spawn(|| {
            yield_the_cpu().unwrap();
            let out = std::process::Command::new("cat")
                .arg("/proc/self/stat")
                .output()
                .unwrap();
            String::from_utf8(out.stdout).unwrap()
        })
        .join()
        .unwrap();
        // Fields after the command's closing parenthesis: state is field 3, nice 19,
        // policy 41.
        let fields: Vec<&str> = stat_of_child
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        assert_eq!(fields[19 - 3], "19", "{stat_of_child}");
        assert_eq!(
            fields[41 - 3],
            libc::SCHED_IDLE.to_string(),
            "{stat_of_child}"
        );
        let own = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let own: Vec<&str> = own.rsplit_once(')').unwrap().1.split_whitespace().collect();
        assert_ne!(own[41 - 3], libc::SCHED_IDLE.to_string());
    }

    /// Grants in the order they happen, for one capacity-1 queue with waiters from two
    /// requesters: `a` queues three before `b` queues one; `b` must not wait for all of `a`'s.
    #[tokio::test]
    async fn round_robin_over_requesters() {
        let q = BuildQueue::new(1);
        let first = q.acquire("a").await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (i, who) in ["a", "a", "a", "b"].into_iter().enumerate() {
            let (q, order) = (q.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let p = q.acquire(who).await;
                order.lock().unwrap().push(format!("{who}{i}"));
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(p);
            }));
            // Queue in a known order.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(q.load().waiting, 4);
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["a0", "b3", "a1", "a2"]);
        assert_eq!(
            q.load(),
            QueueLoad {
                running: 0,
                waiting: 0,
                capacity: 1
            }
        );
    }

    /// A waiter cancelled while queued, and one cancelled right after being granted, leak
    /// no slot.
    #[tokio::test]
    async fn cancelled_waiters_give_their_slot_on() {
        let q = BuildQueue::new(1);
        let held = q.acquire("a").await;
        let gone = {
            let q = q.clone();
            tokio::spawn(async move {
                let _p = q.acquire("b").await;
                tokio::time::sleep(Duration::from_secs(3600)).await;
            })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        let cancelled = tokio::time::timeout(Duration::from_millis(10), q.acquire("c")).await;
        assert!(cancelled.is_err(), "c cannot have a slot yet");
        drop(held);
        tokio::time::sleep(Duration::from_millis(10)).await;
        // b holds the slot; ending b frees it.
        assert_eq!(q.load().running, 1);
        gone.abort();
        let _ = gone.await;
        let again = tokio::time::timeout(Duration::from_secs(5), q.acquire("d")).await;
        assert!(again.is_ok(), "the slot came back");
        assert_eq!(q.load().running, 1);
    }

    /// The collision that NUL-joined keys had: a two-file solution whose first file spells out
    /// a second file's name and text, against the three-file solution it spells.
    #[test]
    fn build_keys_of_different_solutions_differ() {
        let files = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let two = files(&[("kernels/a", "P\0kernels/b\0Q"), ("model_new.py", "M")]);
        let three = files(&[
            ("kernels/a", "P"),
            ("kernels/b", "Q"),
            ("model_new.py", "M"),
        ]);
        let key = |f| build_key("2.5", Device::Cpu, f);
        assert_ne!(key(&two), key(&three));
        // A name's end moved into its contents; another device.
        let moved = files(&[("kernels/aP", ""), ("model_new.py", "M")]);
        let kept = files(&[("kernels/a", "P"), ("model_new.py", "M")]);
        assert_ne!(key(&moved), key(&kept));
        assert_ne!(build_key("2.5", Device::Cuda, &kept), key(&kept));
        // The same inputs, the same key.
        assert_eq!(key(&three), key(&three.clone()));
    }

    /// More capacity than requests: nobody waits.
    #[tokio::test]
    async fn free_slots_are_taken_at_once() {
        let q = BuildQueue::new(3);
        let a = q.acquire("x").await;
        let b = q.acquire("x").await;
        let c = q.acquire("y").await;
        assert_eq!(q.load().running, 3);
        drop((a, b, c));
        assert_eq!(q.load().running, 0);
    }
}
