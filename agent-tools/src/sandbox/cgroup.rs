//! A cgroup per sandboxed command, in whatever hierarchies this host lets the server write:
//! cgroup v2 for `cgroup.kill` (all of a command's processes killed at once, even without
//! delegated controllers), memory and pids limits over all of a command's processes (v2
//! controllers where enabled, else cgroup v1), the v1 freezer to stop a command before
//! killing it where `cgroup.kill` is missing, and a low CPU weight for background commands
//! (the agent's commands and candidate builds) so they yield to an evaluation that holds a
//! device.
//!
//! Cgroups are named `cuda-agent.<server pid>.<server start time>.<n>` under the server's
//! own cgroup, so a later server can tell which were left by a server that is gone.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::process::start_time;
use super::Breach;

const PREFIX: &str = "cuda-agent.";

/// The leaf a server moves into to hand its cgroup v2 controllers to its commands. Not under
/// [`PREFIX`]: the sweep of leftover command cgroups must never reach the server itself.
const SERVER_LEAF: &str = "cuda-agent-server";

/// The cgroup v2 controllers commands need: memory and pids bound a whole command, cpu gives
/// background commands their low weight.
const WANTED_V2: [&str; 3] = ["memory", "pids", "cpu"];

/// Whether the server may move processes so that its cgroup v2 controllers reach its commands.
///
/// Cgroup v2 passes a controller to the children of a cgroup only while that cgroup holds no
/// process (the root excepted), and the server makes its commands' cgroups under its own: with
/// the server inside, memory and pids limits could never apply. Nesting moves the server's
/// processes into a leaf beside the commands' cgroups and enables the controllers for both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupNesting {
    /// Leave the cgroup as it is.
    Off,
    /// Nest only when the server is the only process in its cgroup (a service of its own,
    /// such as a systemd unit with `Delegate=yes`).
    #[default]
    Alone,
    /// Nest whatever else runs in the cgroup, moving those processes into the leaf too (a
    /// container whose cgroup holds its init and the server, as docker-in-docker entrypoints
    /// do).
    All,
}

/// What nesting did at start.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NestReport {
    /// Controllers now passed on to the commands' cgroups by nesting.
    pub enabled: Vec<String>,
    /// Processes moved into the server's leaf (the server's own included).
    pub moved: usize,
    /// Why nothing (or not everything) was enabled, when so.
    pub note: Option<String>,
}

/// Nests the server's cgroup v2 once per process (see [`CgroupNesting`]); later calls return
/// the first report.
pub fn nest(mode: CgroupNesting) -> NestReport {
    static DONE: std::sync::OnceLock<NestReport> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let Some(dir) = own_dirs().0 else {
            return NestReport {
                note: Some("no cgroup v2 hierarchy".into()),
                ..NestReport::default()
            };
        };
        let report = nest_in(&base_of(dir), mode, std::process::id(), &WANTED_V2);
        if !report.enabled.is_empty() {
            tracing::info!(enabled = ?report.enabled, moved = report.moved, "cgroup v2 controllers handed to the commands' cgroups");
        } else if let Some(note) = &report.note {
            tracing::debug!(%note, "cgroup v2 left as it is");
        }
        report
    })
    .clone()
}

/// The directory commands' cgroups are made in: the server's own, or its parent when the
/// server sits in its nesting leaf.
fn base_of(dir: PathBuf) -> PathBuf {
    match (dir.file_name(), dir.parent()) {
        (Some(n), Some(parent)) if n == SERVER_LEAF => parent.to_path_buf(),
        _ => dir,
    }
}

/// Pids listed in a `cgroup.procs` file.
fn procs_in(dir: &Path) -> Vec<u32> {
    words(&dir.join("cgroup.procs"))
        .iter()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Nests in `dir` for the controllers `want`, `me` being the server's pid.
fn nest_in(dir: &Path, mode: CgroupNesting, me: u32, want: &[&str]) -> NestReport {
    let mut report = NestReport::default();
    let offered = words(&dir.join("cgroup.controllers"));
    let enabled = words(&dir.join("cgroup.subtree_control"));
    let wanted: Vec<&str> = want
        .iter()
        .copied()
        .filter(|c| offered.iter().any(|o| o == c) && !enabled.iter().any(|e| e == c))
        .collect();
    if wanted.is_empty() {
        report.note = Some(format!(
            "nothing to enable: offered [{}], already passed on [{}]",
            offered.join(" "),
            enabled.join(" ")
        ));
        return report;
    }
    if mode == CgroupNesting::Off {
        report.note = Some(format!(
            "nesting is off; not passed on: {}",
            wanted.join(" ")
        ));
        return report;
    }
    // The root cgroup (the only one without `cgroup.type`) may pass controllers on with
    // processes in it: nothing is moved there, least of all every process of the host.
    let root = !dir.join("cgroup.type").exists();
    let leaf = dir.join(SERVER_LEAF);
    // Processes fork while they are moved: a few rounds, until none is left behind.
    for _ in 0..if root { 0 } else { 5 } {
        let here = procs_in(dir);
        if here.is_empty() {
            break;
        }
        if mode == CgroupNesting::Alone && here.iter().any(|&p| p != me) {
            report.note = Some(format!(
                "{} other processes share the server's cgroup; not passed on: {} (the server's \
                 --cgroup-nesting all moves them too)",
                here.iter().filter(|&&p| p != me).count(),
                wanted.join(" ")
            ));
            return report;
        }
        if let Err(e) = std::fs::create_dir(&leaf) {
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                report.note = Some(format!("cannot make {}: {e}", leaf.display()));
                return report;
            }
        }
        for pid in here {
            // A process that exited meanwhile is no longer there to move.
            if std::fs::write(leaf.join("cgroup.procs"), pid.to_string()).is_ok() {
                report.moved += 1;
            }
        }
    }
    let mut refused = Vec::new();
    for c in wanted {
        match std::fs::write(dir.join("cgroup.subtree_control"), format!("+{c}")) {
            Ok(()) => report.enabled.push(c.to_string()),
            Err(e) => refused.push(format!("{c} ({e})")),
        }
    }
    if !refused.is_empty() {
        report.note = Some(format!("refused: {}", refused.join(", ")));
    }
    report
}

/// Which cgroup version provides a controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupVersion {
    /// The legacy per-controller hierarchies.
    V1,
    /// The unified hierarchy.
    V2,
}

/// The cgroup layers in force for sandboxed commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CgroupSupport {
    /// Every process of a command is killed at once through cgroup v2 `cgroup.kill`.
    pub kill: bool,
    /// The v1 freezer stops a command's processes before they are killed (used without `kill`).
    pub freezer: bool,
    /// A memory limit over all of a command's processes.
    pub memory: Option<CgroupVersion>,
    /// A process-count limit over all of a command's processes.
    pub pids: Option<CgroupVersion>,
    /// A CPU weight over all of a background command's processes (without one, background
    /// commands run at a higher nice value, which a process cannot undo either).
    pub cpu: Option<CgroupVersion>,
}

/// A background command's CPU weight against a normal one's (cgroup v2 `cpu.weight`, default
/// 100).
pub const BACKGROUND_CPU_WEIGHT: u32 = 10;
/// The same in cgroup v1 `cpu.shares` (default 1024).
pub const BACKGROUND_CPU_SHARES: u32 = 102;

/// The server's own cgroup directory in each usable hierarchy.
#[derive(Debug, Clone, Default)]
pub(crate) struct Hierarchies {
    v2: Option<PathBuf>,
    memory: Option<(PathBuf, CgroupVersion)>,
    pids: Option<(PathBuf, CgroupVersion)>,
    cpu: Option<(PathBuf, CgroupVersion)>,
    freezer: Option<PathBuf>,
    /// Where commands' cgroups were made before [`Hierarchies::cap_commands_memory`] moved
    /// them under a parent: swept too (an earlier server's parent, with its commands, is there).
    swept: Vec<PathBuf>,
}

/// The mounts of a `/proc/self/mountinfo` text as (root within the filesystem, mountpoint,
/// filesystem type, superblock options).
fn mounts(mountinfo: &str) -> Vec<(String, PathBuf, String, String)> {
    // mountinfo: id parent major:minor root mountpoint opts... - fstype source superopts
    mountinfo
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let left: Vec<&str> = left.split_whitespace().collect();
            let right: Vec<&str> = right.split_whitespace().collect();
            Some((
                left.get(3)?.to_string(),
                PathBuf::from(left.get(4)?),
                right.first()?.to_string(),
                right.get(2).unwrap_or(&"").to_string(),
            ))
        })
        .collect()
}

/// The whitespace-separated words of a cgroup file (none when it cannot be read).
fn words(file: &Path) -> Vec<String> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Where each hierarchy is mounted and where this process sits in it.
fn own_dirs() -> (Option<PathBuf>, Vec<(String, PathBuf)>) {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return (None, Vec::new());
    };
    let Ok(membership) = std::fs::read_to_string("/proc/self/cgroup") else {
        return (None, Vec::new());
    };
    let mounts = mounts(&mountinfo);
    let join = |mount_root: &str, mountpoint: &Path, path: &str| -> Option<PathBuf> {
        let rel = path
            .strip_prefix(mount_root.trim_end_matches('/'))
            .unwrap_or(path);
        let dir = mountpoint.join(rel.trim_start_matches('/'));
        dir.is_dir().then_some(dir)
    };
    let mut v2 = None;
    let mut v1 = Vec::new();
    for line in membership.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if controllers.is_empty() {
            if let Some((root, mp, _, _)) = mounts.iter().find(|m| m.2 == "cgroup2") {
                v2 = join(root, mp, path).map(base_of);
            }
            continue;
        }
        for c in controllers.split(',') {
            if let Some((root, mp, _, _)) = mounts
                .iter()
                .find(|m| m.2 == "cgroup" && m.3.split(',').any(|o| o == c))
            {
                if let Some(dir) = join(root, mp, path) {
                    v1.push((c.to_string(), dir));
                }
            }
        }
    }
    (v2, v1)
}

/// Whether a cgroup can be created (and removed) under `dir`.
fn writable(dir: &Path) -> bool {
    let probe = dir.join(format!("{PREFIX}probe.{}", std::process::id()));
    let ok = std::fs::create_dir(&probe).is_ok();
    let _ = std::fs::remove_dir(&probe);
    ok
}

impl Hierarchies {
    /// Finds the hierarchies this process may create cgroups in.
    pub fn detect() -> Self {
        let (v2, v1) = own_dirs();
        let v2 = v2.filter(|d| writable(d));
        let v2_controllers = v2
            .as_ref()
            .map(|d| words(&d.join("cgroup.subtree_control")))
            .unwrap_or_default();
        let v2_has = |c: &str| v2_controllers.iter().any(|x| x == c);
        let v1_dir = |c: &str| {
            v1.iter()
                .find(|(name, _)| name == c)
                .map(|(_, d)| d.clone())
                .filter(|d| writable(d))
        };
        let pick = |c: &str| -> Option<(PathBuf, CgroupVersion)> {
            match &v2 {
                Some(d) if v2_has(c) => Some((d.clone(), CgroupVersion::V2)),
                _ => v1_dir(c).map(|d| (d, CgroupVersion::V1)),
            }
        };
        let v2_kill = v2.clone().filter(|_| {
            // cgroup.kill exists in every non-root v2 cgroup since Linux 5.14; check on a probe.
            let probe = v2
                .as_ref()
                .map(|d| d.join(format!("{PREFIX}probe-kill.{}", std::process::id())));
            let ok = probe
                .as_ref()
                .is_some_and(|p| std::fs::create_dir(p).is_ok() && p.join("cgroup.kill").exists());
            if let Some(p) = probe {
                let _ = std::fs::remove_dir(p);
            }
            ok
        });
        Self {
            memory: pick("memory"),
            pids: pick("pids"),
            cpu: pick("cpu"),
            freezer: v1_dir("freezer"),
            v2: v2_kill,
            swept: Vec::new(),
        }
    }

    /// Makes every later command's cgroups under one parent,
    /// `cuda-agent.<server pid>.<server start time>.commands`, whose memory limit is `bytes`:
    /// all commands together can then hold no more, whatever each one's own limit (past it the
    /// kernel kills a process of one of them, a memory breach of that command). Pages a command
    /// wrote to a tmpfs stay charged to the parent after the command's cgroup is removed, so the
    /// limit covers what the commands left in their volumes too. On cgroup v2 the parent passes
    /// on the controllers its base did, and every v2 cgroup of a command moves under it (a
    /// process is in one cgroup per hierarchy). Needs a memory hierarchy; returns the parent.
    pub fn cap_commands_memory(&mut self, bytes: u64) -> std::io::Result<PathBuf> {
        let Some((base, version)) = self.memory.clone() else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "no memory controller the server may use",
            ));
        };
        let me = std::process::id();
        let dir = base.join(format!(
            "{PREFIX}{me}.{}.commands",
            start_time(me as i32).unwrap_or(0)
        ));
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let configured = (|| -> std::io::Result<()> {
            match version {
                CgroupVersion::V1 => {
                    std::fs::write(dir.join("memory.limit_in_bytes"), bytes.to_string())?;
                    let memsw = dir.join("memory.memsw.limit_in_bytes");
                    if memsw.exists() {
                        let _ = std::fs::write(memsw, bytes.to_string());
                    }
                }
                CgroupVersion::V2 => {
                    std::fs::write(dir.join("memory.max"), bytes.to_string())?;
                    let _ = std::fs::write(dir.join("memory.swap.max"), "0");
                    let passed = words(&base.join("cgroup.subtree_control"));
                    for c in WANTED_V2.iter().filter(|c| passed.iter().any(|p| p == *c)) {
                        std::fs::write(dir.join("cgroup.subtree_control"), format!("+{c}"))?;
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = configured {
            let _ = std::fs::remove_dir(&dir);
            return Err(e);
        }
        if !self.swept.contains(&base) {
            self.swept.push(base.clone());
        }
        let under = |d: &mut PathBuf| {
            if *d == base {
                *d = dir.clone();
            }
        };
        if let Some(d) = self.v2.as_mut() {
            under(d);
        }
        for (d, _) in [&mut self.memory, &mut self.pids, &mut self.cpu]
            .into_iter()
            .flatten()
        {
            under(d);
        }
        Ok(dir)
    }

    /// Whether a background command's cgroups count their CPU time (cgroup v2 `cpu.stat`,
    /// or v1 `cpuacct.usage` where cpuacct shares the cpu hierarchy), as the measure of its
    /// wait for a CPU needs.
    pub fn count_cpu_time(&self) -> bool {
        let counts = |d: &Path| {
            d.join("cpuacct.usage").exists()
                || std::fs::read_to_string(d.join("cpu.stat"))
                    .is_ok_and(|s| s.lines().any(|l| l.starts_with("usage_usec ")))
        };
        // The v2 directory's own cpu.stat: its children's have the same fields.
        self.bases(true).iter().any(|d| counts(d))
    }

    /// What these hierarchies provide.
    pub fn support(&self) -> CgroupSupport {
        CgroupSupport {
            kill: self.v2.is_some(),
            freezer: self.freezer.is_some(),
            memory: self.memory.as_ref().map(|(_, v)| *v),
            pids: self.pids.as_ref().map(|(_, v)| *v),
            cpu: self.cpu.as_ref().map(|(_, v)| *v),
        }
    }

    /// The directories a command's cgroups are made in; the CPU hierarchy only for a
    /// background command (a normal one keeps the weight of the server's own cgroup).
    fn bases(&self, background: bool) -> Vec<PathBuf> {
        let mut b: Vec<PathBuf> = Vec::new();
        for d in [
            self.v2.clone(),
            self.memory.clone().map(|m| m.0),
            self.pids.clone().map(|p| p.0),
            self.cpu.clone().map(|c| c.0).filter(|_| background),
            self.freezer.clone(),
        ]
        .into_iter()
        .flatten()
        {
            if !b.contains(&d) {
                b.push(d);
            }
        }
        b
    }

    /// Creates the cgroups of one command with its limits (`None` without any usable
    /// hierarchy); a `background` command also gets the low CPU weight. Fails only if a
    /// hierarchy that was usable at start refuses.
    pub fn create(
        &self,
        total_memory: u64,
        total_processes: u64,
        background: bool,
    ) -> std::io::Result<Option<CommandCgroup>> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let bases = self.bases(background);
        if bases.is_empty() {
            return Ok(None);
        }
        let me = std::process::id();
        let name = format!(
            "{PREFIX}{me}.{}.{}",
            start_time(me as i32).unwrap_or(0),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut cg = CommandCgroup {
            dirs: Vec::new(),
            kill: None,
            memory: None,
            pids: None,
            freezer: None,
        };
        for base in bases {
            let dir = base.join(&name);
            if let Err(e) = std::fs::create_dir(&dir) {
                cg.remove();
                return Err(e);
            }
            cg.dirs.push(dir);
        }
        if let Err(e) = self.configure(&mut cg, &name, total_memory, total_processes, background) {
            cg.remove();
            return Err(e);
        }
        Ok(Some(cg))
    }

    fn configure(
        &self,
        cg: &mut CommandCgroup,
        name: &str,
        total_memory: u64,
        total_processes: u64,
        background: bool,
    ) -> std::io::Result<()> {
        if let Some(v2) = &self.v2 {
            cg.kill = Some(v2.join(name));
        }
        if let Some((base, v)) = &self.memory {
            let dir = base.join(name);
            match v {
                CgroupVersion::V1 => {
                    std::fs::write(dir.join("memory.limit_in_bytes"), total_memory.to_string())?;
                    // Swap counts too where the kernel accounts it.
                    let memsw = dir.join("memory.memsw.limit_in_bytes");
                    if memsw.exists() {
                        let _ = std::fs::write(memsw, total_memory.to_string());
                    }
                }
                CgroupVersion::V2 => {
                    std::fs::write(dir.join("memory.max"), total_memory.to_string())?;
                    let _ = std::fs::write(dir.join("memory.swap.max"), "0");
                }
            }
            cg.memory = Some((dir, *v));
        }
        if let Some((base, v)) = &self.pids {
            let dir = base.join(name);
            std::fs::write(dir.join("pids.max"), total_processes.to_string())?;
            cg.pids = Some((dir, *v));
        }
        if let (Some((base, v)), true) = (&self.cpu, background) {
            let dir = base.join(name);
            match v {
                CgroupVersion::V1 => {
                    std::fs::write(dir.join("cpu.shares"), BACKGROUND_CPU_SHARES.to_string())?
                }
                CgroupVersion::V2 => {
                    std::fs::write(dir.join("cpu.weight"), BACKGROUND_CPU_WEIGHT.to_string())?
                }
            }
        }
        if let Some(base) = &self.freezer {
            cg.freezer = Some(base.join(name));
        }
        Ok(())
    }

    /// Kills the processes of and removes every cgroup a server that is no longer running
    /// left behind. Returns (cgroups removed, processes killed).
    pub fn sweep(&self) -> (usize, usize) {
        let (mut removed, mut killed) = (0, 0);
        let mut bases = self.bases(true);
        bases.extend(
            self.swept
                .iter()
                .filter(|d| !bases.contains(d))
                .cloned()
                .collect::<Vec<_>>(),
        );
        for base in bases {
            let Ok(entries) = std::fs::read_dir(&base) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(rest) = name.strip_prefix(PREFIX) else {
                    continue;
                };
                let mut f = rest.split('.');
                let owner = match (
                    f.next().and_then(|p| p.parse::<i32>().ok()),
                    f.next().and_then(|s| s.parse::<u64>().ok()),
                ) {
                    (Some(pid), Some(start)) => Some((pid, start)),
                    _ => None, // a probe: removable once empty
                };
                if owner.is_some_and(|(pid, start)| start_time(pid) == Some(start)) {
                    continue; // its server is alive
                }
                let (r, k) = remove_tree(&e.path());
                removed += r;
                killed += k;
            }
        }
        (removed, killed)
    }
}

/// Kills the processes of and removes a cgroup left behind and every cgroup under it (a gone
/// server's commands' parent holds their cgroups). Returns (cgroups removed, processes killed).
fn remove_tree(dir: &Path) -> (usize, usize) {
    let (mut removed, mut killed) = (0, 0);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                let (r, k) = remove_tree(&e.path());
                removed += r;
                killed += k;
            }
        }
    }
    let cg = CommandCgroup {
        dirs: vec![dir.to_path_buf()],
        kill: dir.join("cgroup.kill").exists().then(|| dir.to_path_buf()),
        memory: None,
        pids: None,
        freezer: dir
            .join("freezer.state")
            .exists()
            .then(|| dir.to_path_buf()),
    };
    killed += cg.kill_all();
    if cg.remove() {
        removed += 1;
    }
    (removed, killed)
}

/// The cgroups of one command (one directory per hierarchy).
#[derive(Debug)]
pub(crate) struct CommandCgroup {
    dirs: Vec<PathBuf>,
    kill: Option<PathBuf>,
    memory: Option<(PathBuf, CgroupVersion)>,
    pids: Option<(PathBuf, CgroupVersion)>,
    freezer: Option<PathBuf>,
}

fn cstring(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap_or_default()
}

fn members(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// The value of `key` in a flat-keyed cgroup file such as `memory.events`.
fn counter(file: &Path, key: &str) -> u64 {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok()).flatten()
        })
        .unwrap_or(0)
}

impl CommandCgroup {
    /// A meter of the time the command waits for a CPU ([`super::cpu_wait`]), where one of
    /// its cgroups lists its threads and one counts their CPU time.
    pub fn cpu_wait_meter(&self) -> Option<super::cpu_wait::CpuWaitMeter> {
        let threads = self.dirs.iter().find_map(|d| {
            ["cgroup.threads", "tasks"]
                .iter()
                .map(|f| d.join(f))
                .find(|f| f.exists())
        })?;
        let cpu = self
            .dirs
            .iter()
            .find_map(|d| super::cpu_wait::CpuCounter::of(d))?;
        super::cpu_wait::CpuWaitMeter::new(threads, cpu)
    }

    /// The `cgroup.procs` files the command joins.
    pub fn procs_files(&self) -> Vec<CString> {
        self.dirs
            .iter()
            .map(|d| cstring(&d.join("cgroup.procs")))
            .collect()
    }

    /// The `cgroup.kill` file, where there is one.
    pub fn kill_file(&self) -> Option<CString> {
        self.kill.as_ref().map(|d| cstring(&d.join("cgroup.kill")))
    }

    /// Kills every process in the cgroup; returns how many there were.
    pub fn kill_all(&self) -> usize {
        let mut seen = 0;
        for round in 0..200 {
            let pids: Vec<i32> = self.dirs.iter().flat_map(|d| members(d)).collect();
            seen = seen.max(pids.len());
            if pids.is_empty() {
                break;
            }
            if let Some(k) = &self.kill {
                let _ = std::fs::write(k.join("cgroup.kill"), "1");
            } else {
                // Stop them first so none can fork while the list is walked.
                let frozen = self
                    .freezer
                    .as_ref()
                    .is_some_and(|f| std::fs::write(f.join("freezer.state"), "FROZEN").is_ok());
                for pid in &pids {
                    // SAFETY: kill has no memory preconditions.
                    unsafe { libc::kill(*pid, libc::SIGKILL) };
                }
                if frozen {
                    if let Some(f) = &self.freezer {
                        let _ = std::fs::write(f.join("freezer.state"), "THAWED");
                    }
                }
            }
            let procs = super::process::processes();
            super::process::reap_orphans(&procs, |p| pids.contains(&p.pid));
            std::thread::sleep(std::time::Duration::from_micros(if round < 10 {
                200
            } else {
                2000
            }));
        }
        seen
    }

    /// Which limit, if any, the command ran into.
    pub fn breach(&self) -> Option<Breach> {
        if let Some((dir, v)) = &self.memory {
            let kills = match v {
                CgroupVersion::V1 => counter(&dir.join("memory.oom_control"), "oom_kill"),
                CgroupVersion::V2 => counter(&dir.join("memory.events"), "oom_kill"),
            };
            if kills > 0 {
                return Some(Breach::Memory);
            }
        }
        if let Some((dir, _)) = &self.pids {
            if counter(&dir.join("pids.events"), "max") > 0 {
                return Some(Breach::Processes);
            }
        }
        None
    }

    /// Removes the cgroup directories; false if one is still busy.
    pub fn remove(&self) -> bool {
        let mut all = true;
        for d in &self.dirs {
            let mut gone = false;
            for _ in 0..50 {
                match std::fs::remove_dir(d) {
                    Ok(()) => {
                        gone = true;
                        break;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        gone = true;
                        break;
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(2)),
                }
            }
            all &= gone;
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory laid out like a cgroup v2 directory (plain files): only the decisions taken
    /// before anything is moved are checked here, the kernel's part needs a real hierarchy.
    fn fake(controllers: &str, subtree: &str, procs: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), controllers).unwrap();
        std::fs::write(d.path().join("cgroup.subtree_control"), subtree).unwrap();
        std::fs::write(d.path().join("cgroup.procs"), procs).unwrap();
        std::fs::write(d.path().join("cgroup.type"), "domain\n").unwrap();
        d
    }

    #[test]
    fn nesting_moves_nothing_unless_it_would_enable_a_controller_it_may() {
        // Everything wanted is already passed on (or not offered at all).
        let d = fake("cpuset cpu io memory pids", "cpu memory pids", "7\n");
        let r = nest_in(d.path(), CgroupNesting::All, 7, &WANTED_V2);
        assert_eq!((r.moved, r.enabled.len()), (0, 0), "{r:?}");
        let d = fake("io", "", "7\n");
        assert_eq!(
            nest_in(d.path(), CgroupNesting::All, 7, &WANTED_V2).moved,
            0
        );

        // Off: reported, not done.
        let d = fake("cpu memory pids", "", "7\n");
        let r = nest_in(d.path(), CgroupNesting::Off, 7, &WANTED_V2);
        assert_eq!(r.moved, 0);
        assert!(r.note.unwrap().contains("memory pids cpu"));

        // Alone, with another process beside the server: nothing moved, no leaf made.
        let d = fake("cpu memory pids", "", "7\n8\n");
        let r = nest_in(d.path(), CgroupNesting::Alone, 7, &WANTED_V2);
        assert_eq!(r.moved, 0);
        assert!(r.note.unwrap().contains("1 other processes"));
        assert!(!d.path().join(SERVER_LEAF).exists());

        // The root cgroup (no `cgroup.type`): even `all` moves no process of the host.
        let d = fake("cpu memory pids", "", "1\n2\n7\n");
        std::fs::remove_file(d.path().join("cgroup.type")).unwrap();
        let r = nest_in(d.path(), CgroupNesting::All, 7, &WANTED_V2);
        assert_eq!(r.moved, 0, "{r:?}");
        assert!(!d.path().join(SERVER_LEAF).exists());
    }

    /// The kernel's part, on a real cgroup v2 hierarchy: a process in a cgroup with a controller
    /// offered and not passed on is moved into the leaf and the controller passed on. Any
    /// controller the host offers on v2 will do (this machine's v2 offers only hugetlb); needs
    /// root and a writable v2 mount, else skipped.
    #[test]
    fn nesting_moves_the_processes_and_passes_the_controller_on() {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let Some(mount) = mounts(&mountinfo)
            .into_iter()
            .find(|(root, _, fstype, _)| fstype == "cgroup2" && root == "/")
            .map(|m| m.1)
        else {
            eprintln!("skipped: no cgroup v2 mount of the whole hierarchy");
            return;
        };
        let Some(ctl) = words(&mount.join("cgroup.controllers")).into_iter().next() else {
            eprintln!("skipped: the v2 root offers no controller here");
            return;
        };
        // The root may pass a controller on with processes in it.
        if std::fs::write(mount.join("cgroup.subtree_control"), format!("+{ctl}")).is_err() {
            eprintln!("skipped: cannot pass {ctl} on at the v2 root");
            return;
        }
        let dir = mount.join(format!("cuda-agent-nest-test.{}", std::process::id()));
        std::fs::create_dir(&dir).expect("a test cgroup");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        std::fs::write(dir.join("cgroup.procs"), child.id().to_string())
            .expect("into the test cgroup");

        // Alone with the process as the "server": moved into the leaf, controller passed on.
        let r = nest_in(&dir, CgroupNesting::Alone, child.id(), &[ctl.as_str()]);
        let membership = std::fs::read_to_string(format!("/proc/{}/cgroup", child.id())).unwrap();
        let passed = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        let leaf = dir.join(SERVER_LEAF);
        for _ in 0..100 {
            if std::fs::remove_dir(&leaf).is_ok() || !leaf.exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = std::fs::remove_dir(&dir);
        assert_eq!(
            (r.moved, r.enabled.clone()),
            (1, vec![ctl.clone()]),
            "{r:?}"
        );
        assert!(
            membership.contains(&format!("/{SERVER_LEAF}")),
            "{membership}"
        );
        assert!(passed.split_whitespace().any(|c| c == ctl), "{passed}");
    }

    /// The parent over all commands, on this host's memory hierarchy: a command allowed 1 GiB
    /// of its own is killed when all commands together pass the parent's 64 MiB (its peak stays
    /// near 64 MiB), and the kill is that command's memory breach. Needs root and a memory
    /// hierarchy the server may write, else skipped.
    #[test]
    fn commands_together_are_held_to_the_parents_memory_limit() {
        use std::os::unix::process::ExitStatusExt;
        let mut h = Hierarchies::detect();
        if h.memory.is_none() {
            eprintln!("skipped: no memory hierarchy this process may write");
            return;
        }
        let parent = h.cap_commands_memory(64 << 20).expect("a parent cgroup");
        let cg = h
            .create(1 << 30, 64, false)
            .expect("cgroups")
            .expect("some");
        let (mdir, version) = cg.memory.clone().expect("a memory cgroup");
        assert_eq!(mdir.parent(), Some(parent.as_path()));
        // The shell joins the command's cgroups, then reads a line that never ends.
        let join: Vec<String> = cg
            .dirs
            .iter()
            .map(|d| format!("echo $$ > {}", d.join("cgroup.procs").display()))
            .collect();
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("{} && exec tail /dev/zero", join.join(" && ")))
            .status()
            .expect("sh");
        let peak_file = match version {
            CgroupVersion::V1 => "memory.max_usage_in_bytes",
            CgroupVersion::V2 => "memory.peak",
        };
        let peak: Option<u64> = std::fs::read_to_string(mdir.join(peak_file))
            .ok()
            .and_then(|s| s.trim().parse().ok());
        let breach = cg.breach();
        cg.kill_all();
        cg.remove();
        let _ = std::fs::remove_dir(&parent);
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
        assert_eq!(breach, Some(Breach::Memory));
        if let Some(peak) = peak {
            assert!(peak <= 80 << 20, "the command reached {peak} bytes");
        }
    }

    #[test]
    fn commands_are_made_beside_the_servers_leaf_never_in_it() {
        let d = PathBuf::from("/sys/fs/cgroup/svc");
        assert_eq!(base_of(d.join(SERVER_LEAF)), d);
        assert_eq!(base_of(d.clone()), d);
        // The sweep of leftover command cgroups never matches the leaf.
        assert!(!SERVER_LEAF.starts_with(PREFIX));
    }
}
