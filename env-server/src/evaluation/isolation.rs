//! What keeps a timed evaluation's CPU its own (`--timing-cores`).
//!
//! A judge times its contestants by its own clock, so every core taken from the judge, the
//! reference worker or the candidate's worker while they time is noise in the medians. Beside
//! a timed evaluation the server runs the next evaluations' start-up (with prestart: three
//! processes importing PyTorch each), candidate builds and the agent's commands. Measured on
//! an H100 host, evaluations submitted two at a time with prestart flipped the same
//! candidate's reward 3,3,3,2,2,2 (the compile baseline's median moved 28% between
//! evaluations); one at a time it was 8 of 8 the same.
//!
//! Two ways to keep them apart, whichever the host allows:
//!
//! - **pinned**: the host has enough cores and a cpuset cgroup (v1) the server may write.
//!   Each device slot gets cores of its own (a cpuset `timed<slot>`), and the server moves
//!   itself into a cpuset `shared` over the remaining cores, so everything it starts from then
//!   on (builds, the agent's commands, judges and workers while they start) inherits those.
//!   When an evaluation holds its lease and its judge waits at its gate, the server moves every
//!   process of the evaluation's two uids into its slot's cpuset before it opens the gate. The
//!   kernel keeps a process's affinity inside its cpuset, and the cgroup's files are root's, so
//!   neither the candidate nor a background command can reach the other set's cores.
//!   Affinity alone (`sched_setaffinity` from outside) is not used: any process may reset its
//!   own mask to every core, which would hand a candidate more cores than its baselines got.
//! - **priority**: too few cores to spare any (or no cpuset to write). Builds and the agent's
//!   commands already run below the evaluations (nice 10 and a low CPU weight,
//!   [`agent_tools::sandbox::CpuPriority::Background`]); with prestart, an evaluation's judge
//!   and worker also start at `SCHED_IDLE`, with their session's autogroup at nice 19, and the
//!   server raises every thread of theirs to the normal policy when they hold the lease, before
//!   the gate opens. Nothing of the candidate runs before the gate, and once raised a process
//!   cannot be lowered by anyone but itself.
//!
//! `/v1/info` says which is in force ([`TimingIsolationInfo`]).

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::runtime::Device;

/// What `--timing-cores` asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TimingCores {
    /// Pinned where the host has the cores and the cpuset controller, else priority.
    #[default]
    Auto,
    /// Neither: every evaluation's processes start at the server's priority.
    Off,
    /// Pinned to these cores (split evenly among the device slots); refused where the host
    /// cannot (then priority, with the reason).
    List(Vec<usize>),
}

/// A `--timing-cores` value that is not `auto`, `off` or a core list.
#[derive(Debug, thiserror::Error)]
#[error("bad --timing-cores {0:?}: use auto, off or a core list such as 8-15 or 2,3,6-7")]
pub struct BadTimingCores(String);

impl std::str::FromStr for TimingCores {
    type Err = BadTimingCores;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "off" | "none" => Ok(Self::Off),
            list => parse_cpu_list(list)
                .filter(|cores| !cores.is_empty())
                .map(Self::List)
                .ok_or_else(|| BadTimingCores(s.into())),
        }
    }
}

/// Cores a CUDA device slot's timed evaluation gets with `auto`: the judge, the reference
/// worker and the candidate's worker (each can spin in a device synchronize), and one for
/// their other threads.
pub const CORES_PER_GPU_SLOT: usize = 4;

/// Cores `auto` leaves to everything else at the least.
pub const MIN_SHARED_CORES: usize = 4;

/// The isolation mode in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IsolationMode {
    /// Timed evaluations on cores of their own (cpuset).
    Pinned,
    /// Evaluations' start-up below the timed evaluation (`SCHED_IDLE` until the lease).
    Priority,
    /// Nothing beyond the background priority of builds and commands.
    None,
}

/// `timing_isolation` of `/v1/info`: what keeps timed evaluations' CPU their own. Fields in
/// alphabetical order (see `info.rs`).
#[derive(Debug, Clone, Serialize)]
pub struct TimingIsolationInfo {
    /// What the server was asked for: `auto`, `off` or the core list.
    pub asked: String,
    /// Cores the host lets the server use.
    pub host_cores: Vec<usize>,
    /// Below the timed evaluation by priority: what runs at a lower one (empty when pinned
    /// or off).
    pub lowered: Vec<&'static str>,
    /// `pinned`, `priority` or `none`.
    pub mode: IsolationMode,
    /// Why the mode is not what was asked for (or what `auto` chose), when so.
    pub note: Option<String>,
    /// What runs on `shared_cores` when pinned (empty otherwise).
    pub pinned_away: Vec<&'static str>,
    /// Each device slot's reserved cores when pinned (empty otherwise).
    pub reserved_cores: Vec<Vec<usize>>,
    /// The cores everything but the timed evaluations runs on when pinned (empty otherwise).
    pub shared_cores: Vec<usize>,
}

/// What an evaluation entering its timed phase had done to it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EnterReport {
    /// Processes moved onto the slot's cores (pinned).
    pub moved: usize,
    /// Threads raised from `SCHED_IDLE` (priority).
    pub raised: usize,
}

/// The errors of moving or raising an evaluation's processes.
#[derive(Debug, thiserror::Error)]
pub enum IsolationError {
    /// A cgroup or `/proc` file could not be written.
    #[error("timing isolation: {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Processes kept appearing while they were being moved (a fork storm at the gate).
    #[error("timing isolation: processes of the evaluation kept appearing after {0} passes")]
    Unsettled(usize),
}

/// The cpusets of a pinned server.
#[derive(Debug)]
struct Cpusets {
    /// `cuda-agent-cpus.<pid>.<start>` under the server's own cpuset.
    root: PathBuf,
    /// The cpuset the server was in (it moves back there when dropped).
    parent: PathBuf,
    /// `timed<slot>`, one per device slot.
    timed: Vec<PathBuf>,
}

/// The isolation in force, set up at start ([`TimingIsolation::set_up`]).
#[derive(Debug)]
pub struct TimingIsolation {
    info: TimingIsolationInfo,
    cpusets: Option<Cpusets>,
}

const PREFIX: &str = "cuda-agent-cpus.";

impl TimingIsolation {
    /// No isolation (what embedders get unless they ask).
    pub fn off() -> Self {
        Self::new(&TimingCores::Off, Device::Cpu, 1, false, true)
    }

    /// Sets up what `asked` asks for on `device` with `slots` device slots, evaluations
    /// started ahead of their lease or not (`prestart`); `can_raise` says whether the server
    /// may move and raise other uids' processes (root, with uids of the pool). Never fails:
    /// what the host does not allow falls back, with a note.
    pub fn new(
        asked: &TimingCores,
        device: Device,
        slots: usize,
        prestart: bool,
        can_raise: bool,
    ) -> Self {
        let host = allowed_cores();
        let mut info = TimingIsolationInfo {
            asked: match asked {
                TimingCores::Auto => "auto".into(),
                TimingCores::Off => "off".into(),
                TimingCores::List(l) => format_cpu_list(l),
            },
            host_cores: host.clone(),
            lowered: Vec::new(),
            mode: IsolationMode::None,
            note: None,
            pinned_away: Vec::new(),
            reserved_cores: Vec::new(),
            shared_cores: Vec::new(),
        };
        if *asked == TimingCores::Off {
            return Self {
                info,
                cpusets: None,
            };
        }
        if !can_raise {
            info.note = Some(
                "the server cannot move or raise the evaluations' processes (not root, or no uids of their own)"
                    .into(),
            );
            return Self {
                info,
                cpusets: None,
            };
        }
        let plan = match asked {
            TimingCores::List(list) => split_list(list, &host, slots),
            _ => auto_plan(&host, device, slots),
        };
        let pinned =
            plan.and_then(
                |(reserved, shared)| match Cpusets::create(&reserved, &shared) {
                    Ok(c) => Ok((c, reserved, shared)),
                    Err(e) => Err(e),
                },
            );
        match pinned {
            Ok((cpusets, reserved, shared)) => {
                tracing::info!(reserved = ?reserved, shared = ?shared, "timed evaluations pinned to cores of their own");
                info.mode = IsolationMode::Pinned;
                info.reserved_cores = reserved;
                info.shared_cores = shared;
                info.pinned_away = vec![
                    "the server",
                    "builds",
                    "agent commands",
                    "evaluations before their gate",
                ];
                Self {
                    info,
                    cpusets: Some(cpusets),
                }
            }
            Err(why) if !has_cap_sys_nice() => {
                // Raising another uid's threads from SCHED_IDLE needs CAP_SYS_NICE: lowered
                // without it, an evaluation would time at SCHED_IDLE.
                tracing::warn!(%why, "no timing isolation: not pinned, and without CAP_SYS_NICE the server cannot raise evaluations it started lowered");
                info.note = Some(format!(
                    "not pinned ({why}); no priority mode without CAP_SYS_NICE"
                ));
                Self {
                    info,
                    cpusets: None,
                }
            }
            Err(why) => {
                tracing::info!(%why, "timed evaluations kept apart by priority");
                info.mode = IsolationMode::Priority;
                info.note = Some(why);
                info.lowered = vec![
                    "builds (nice 10, low CPU weight)",
                    "agent commands (nice 10, low CPU weight)",
                ];
                if prestart {
                    info.lowered.push(
                        "evaluations before their lease (prestart: SCHED_IDLE, autogroup nice 19)",
                    );
                }
                Self {
                    info,
                    cpusets: None,
                }
            }
        }
    }

    /// What `/v1/info` says.
    pub fn info(&self) -> TimingIsolationInfo {
        self.info.clone()
    }

    /// The mode in force.
    pub fn mode(&self) -> IsolationMode {
        self.info.mode
    }

    /// Whether an evaluation started ahead of its lease starts lowered (priority mode).
    pub fn lowers_prestart(&self) -> bool {
        self.info.mode == IsolationMode::Priority
    }

    /// Gives the processes of `uids` (an evaluation's judge and worker, which hold slot
    /// `slot`'s lease and wait at the judge's gate) the timed evaluation's CPU: moved onto the
    /// slot's cores, or raised to the normal policy. Repeated until a pass finds nothing left
    /// to do, so a process forked during a pass is not missed.
    pub fn enter_timed(&self, slot: usize, uids: &[u32]) -> Result<EnterReport, IsolationError> {
        let mut report = EnterReport::default();
        if uids.is_empty() || self.info.mode == IsolationMode::None {
            return Ok(report);
        }
        const PASSES: usize = 20;
        for _ in 0..PASSES {
            let pids = processes_of(uids);
            let done = match (&self.cpusets, self.info.mode) {
                (Some(c), IsolationMode::Pinned) => {
                    let dir = &c.timed[slot.min(c.timed.len() - 1)];
                    let n = move_into(dir, &pids)?;
                    report.moved += n;
                    n
                }
                _ => {
                    let n = raise(&pids)?;
                    report.raised += n;
                    n
                }
            };
            if done == 0 {
                return Ok(report);
            }
        }
        Err(IsolationError::Unsettled(PASSES))
    }
}

impl Drop for TimingIsolation {
    fn drop(&mut self) {
        if let Some(c) = &self.cpusets {
            c.remove();
        }
    }
}

impl Cpusets {
    /// Creates `timed<i>` per slot and `shared` under the server's cpuset, and moves the
    /// server into `shared`; Err says why not.
    fn create(reserved: &[Vec<usize>], shared: &[usize]) -> Result<Self, String> {
        let parent = own_cpuset()?;
        sweep(&parent);
        let root = parent.join(format!(
            "{PREFIX}{}.{}",
            std::process::id(),
            start_time(std::process::id()).unwrap_or(0)
        ));
        let io = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
        let mems = std::fs::read_to_string(parent.join("cpuset.mems"))
            .map_err(|e| io(&parent, e))?
            .trim()
            .to_string();
        let all: Vec<usize> = reserved.iter().flatten().chain(shared).copied().collect();
        let make = |dir: &Path, cores: &[usize]| -> Result<(), String> {
            match std::fs::create_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(dir, e)),
            }
            // A v1 cpuset holds no task until it has both its cores and its memory nodes.
            std::fs::write(dir.join("cpuset.cpus"), format_cpu_list(cores))
                .map_err(|e| io(dir, e))?;
            std::fs::write(dir.join("cpuset.mems"), &mems).map_err(|e| io(dir, e))
        };
        let mut this = Self {
            root: root.clone(),
            parent,
            timed: Vec::new(),
        };
        let made = (|| {
            make(&root, &all)?;
            for (i, cores) in reserved.iter().enumerate() {
                let dir = root.join(format!("timed{i}"));
                make(&dir, cores)?;
                this.timed.push(dir);
            }
            let shared_dir = root.join("shared");
            make(&shared_dir, shared)?;
            // The server itself, so that everything it starts from now on inherits the
            // shared cores (moving a process moves all its threads).
            std::fs::write(
                shared_dir.join("cgroup.procs"),
                std::process::id().to_string(),
            )
            .map_err(|e| io(&shared_dir, e))
        })();
        match made {
            Ok(()) => Ok(this),
            Err(e) => {
                remove_tree(&root);
                Err(e)
            }
        }
    }

    /// Moves the server back to where it was and removes the cpusets that hold no process.
    fn remove(&self) {
        let _ = std::fs::write(
            self.parent.join("cgroup.procs"),
            std::process::id().to_string(),
        );
        remove_tree(&self.root);
    }
}

/// Removes a cpuset and its children (those still holding a process stay).
fn remove_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Removes the cpusets left by servers that are gone (named by pid and start time).
fn sweep(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let mut parts = rest.split('.');
        let (Some(Ok(pid)), Some(Ok(start))) = (
            parts.next().map(str::parse::<u32>),
            parts.next().map(str::parse::<u64>),
        ) else {
            continue;
        };
        if start_time(pid) != Some(start) {
            remove_tree(&e.path());
        }
    }
}

/// The directory of this process's cpuset, where the host has a cgroup v1 cpuset hierarchy
/// of its own that the server may write; Err says why not.
fn own_cpuset() -> Result<PathBuf, String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    let cgroups = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("/proc/self/cgroup: {e}"))?;
    cpuset_dir(&mountinfo, &cgroups)
}

/// [`own_cpuset`] from the texts of `/proc/self/mountinfo` and `/proc/self/cgroup`.
fn cpuset_dir(mountinfo: &str, cgroups: &str) -> Result<PathBuf, String> {
    // A mountinfo line: id parent dev root mountpoint options [optional...] - fstype source super
    let mount = mountinfo.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        let supers: Vec<&str> = post.get(2)?.split(',').collect();
        (post.first() == Some(&"cgroup") && supers.contains(&"cpuset")).then(|| {
            (
                pre.get(3).copied().unwrap_or("/").to_string(),
                PathBuf::from(pre.get(4).copied().unwrap_or("")),
                supers.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            )
        })
    });
    let Some((root, mountpoint, supers)) = mount else {
        return Err(
            "no cgroup v1 cpuset hierarchy (cgroup v2 cpusets would have to be the commands' own cgroups)"
                .into(),
        );
    };
    // The sandbox puts each command into cgroups of its own in the memory, pids, freezer and
    // cpu hierarchies: one shared with cpuset would take it out of the cpuset it inherited.
    if let Some(other) = supers
        .iter()
        .find(|s| ["cpu", "memory", "pids", "freezer"].contains(&s.as_str()))
    {
        return Err(format!(
            "the cpuset hierarchy is mounted with {other}, where the sandbox makes each command's cgroup"
        ));
    }
    let path = cgroups
        .lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
            ctrl.split(',').any(|c| c == "cpuset").then_some(path)
        })
        .ok_or("this process is in no cpuset")?;
    let rel = path
        .strip_prefix(root.as_str())
        .unwrap_or(path)
        .trim_start_matches('/');
    let dir = mountpoint.join(rel);
    let probe = dir.join(format!("{PREFIX}probe.{}", std::process::id()));
    match std::fs::create_dir(&probe) {
        Ok(()) => {
            let _ = std::fs::remove_dir(&probe);
            Ok(dir)
        }
        Err(e) => Err(format!("cannot make a cpuset in {}: {e}", dir.display())),
    }
}

/// `auto`: on CUDA [`CORES_PER_GPU_SLOT`] cores per slot, from the highest-numbered down
/// (the lowest tend to take the host's interrupts), when at least [`MIN_SHARED_CORES`] are
/// left; on the CPU the timed evaluation is the device, so it keeps three quarters of the
/// cores, when that leaves at least two and the host has at least eight.
fn auto_plan(
    host: &[usize],
    device: Device,
    slots: usize,
) -> Result<(Vec<Vec<usize>>, Vec<usize>), String> {
    let n = host.len();
    let (per_slot, shared_min, slots) = match device {
        Device::Cuda => (CORES_PER_GPU_SLOT, MIN_SHARED_CORES, slots.max(1)),
        Device::Cpu if n >= 8 => (n - n / 4, 2, 1),
        Device::Cpu => {
            return Err(format!(
                "{n} cores: too few to spare any for the timed evaluation on the CPU (8 needed)"
            ))
        }
    };
    if n < per_slot * slots + shared_min {
        return Err(format!(
            "{n} cores: {per_slot} per device slot ({slots}) and {shared_min} for the rest need {}",
            per_slot * slots + shared_min
        ));
    }
    let shared = host[..n - per_slot * slots].to_vec();
    let reserved = host[n - per_slot * slots..]
        .chunks(per_slot)
        .map(<[usize]>::to_vec)
        .collect();
    Ok((reserved, shared))
}

/// A core list given: split evenly among the slots (each at least one core), the host's other
/// cores shared.
fn split_list(
    list: &[usize],
    host: &[usize],
    slots: usize,
) -> Result<(Vec<Vec<usize>>, Vec<usize>), String> {
    let mut list = list.to_vec();
    list.sort_unstable();
    list.dedup();
    if let Some(c) = list.iter().find(|c| !host.contains(c)) {
        return Err(format!(
            "core {c} is not among the host's ({})",
            format_cpu_list(host)
        ));
    }
    let shared: Vec<usize> = host.iter().copied().filter(|c| !list.contains(c)).collect();
    if shared.is_empty() {
        return Err("the list leaves no core for the rest".into());
    }
    let slots = slots.max(1);
    if list.len() < slots {
        return Err(format!("{} cores for {slots} device slots", list.len()));
    }
    let per = list.len() / slots;
    let reserved = (0..slots)
        .map(|i| {
            let end = if i + 1 == slots {
                list.len()
            } else {
                (i + 1) * per
            };
            list[i * per..end].to_vec()
        })
        .collect();
    Ok((reserved, shared))
}

/// Whether this process holds `CAP_SYS_NICE` (bit 23 of `CapEff` in its status).
fn has_cap_sys_nice() -> bool {
    const CAP_SYS_NICE: u32 = 23;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_string();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_NICE) != 0)
}

/// The cores this process may run on.
fn allowed_cores() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t filled by the kernel.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Parses a kernel cpu list (`0-3,8,10-11`).
pub fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b || b >= libc::CPU_SETSIZE as usize {
                    return None;
                }
                out.extend(a..=b);
            }
            None => {
                let c: usize = part.trim().parse().ok()?;
                if c >= libc::CPU_SETSIZE as usize {
                    return None;
                }
                out.push(c);
            }
        }
    }
    Some(out)
}

/// Writes cores as a kernel cpu list.
pub fn format_cpu_list(cores: &[usize]) -> String {
    let mut cores = cores.to_vec();
    cores.sort_unstable();
    cores.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cores.len() {
        let mut j = i;
        while j + 1 < cores.len() && cores[j + 1] == cores[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cores[i].to_string()
        } else {
            format!("{}-{}", cores[i], cores[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// A process's start time (field 22 of its stat), None when it is gone.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest starts at field 3.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The pids whose real uid is one of `uids`: an evaluation's uids are leased to it alone, and
/// no process can change its uid, so this is exactly the evaluation's processes.
fn processes_of(uids: &[u32]) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| uid_of(&format!("/proc/{pid}/status")).is_some_and(|u| uids.contains(&u)))
        .collect()
}

/// The real uid in a `status` file.
fn uid_of(status: &str) -> Option<u32> {
    let text = std::fs::read_to_string(status).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Moves the processes `pids` into the cpuset `dir`; how many were not there yet.
fn move_into(dir: &Path, pids: &[u32]) -> Result<usize, IsolationError> {
    let want = dir.join("cgroup.procs");
    let there: Vec<u32> = std::fs::read_to_string(&want)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    let mut moved = 0;
    for pid in pids.iter().filter(|p| !there.contains(p)) {
        match std::fs::write(&want, pid.to_string()) {
            Ok(()) => moved += 1,
            // Gone meanwhile: nothing to move.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(source) => {
                return Err(IsolationError::Io {
                    path: want.clone(),
                    source,
                })
            }
        }
    }
    Ok(moved)
}

/// Raises every thread of `pids` still at `SCHED_IDLE` to the normal policy at nice 0, and
/// their sessions' autogroups to nice 0; how many threads were raised.
fn raise(pids: &[u32]) -> Result<usize, IsolationError> {
    let mut raised = 0;
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        let mut any = false;
        for tid in tasks
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        {
            // SAFETY: plain syscalls on a thread id.
            let policy = unsafe { libc::sched_getscheduler(tid) };
            if policy != libc::SCHED_IDLE {
                continue;
            }
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: as above; param lives across the call.
            let ok = unsafe {
                libc::sched_setscheduler(tid, libc::SCHED_OTHER, &param) == 0
                    && libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 0) == 0
            };
            if ok {
                raised += 1;
                any = true;
            } else {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::ESRCH) {
                    return Err(IsolationError::Io {
                        path: format!("/proc/{pid}/task/{tid}").into(),
                        source: e,
                    });
                }
            }
        }
        if any {
            // The session's autogroup (shared by the keeper and the command) back to nice 0;
            // a kernel without autogroups has no such file.
            let _ = std::fs::write(format!("/proc/{pid}/autogroup"), "0");
        }
    }
    Ok(raised)
}

/// Run in a process about to exec an evaluation's judge or worker started ahead of its lease
/// (priority mode): `SCHED_IDLE` for it and everything it starts. Lowering its own policy
/// needs no privilege; it cannot be undone without `CAP_SYS_NICE` (`RLIMIT_NICE` is 0).
pub(super) fn lower_self() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler on the calling process with a valid param.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Lowers the autogroup of `pid`'s session (its keeper's, shared by the command) to nice 19:
/// with autogroups, the scheduler weighs sessions against each other before their threads.
pub(super) fn lower_autogroup(pid: u32) {
    let _ = std::fs::write(format!("/proc/{pid}/autogroup"), "19");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_read_and_write_as_the_kernel_does() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(format_cpu_list(&[11, 0, 1, 2, 3, 8, 10]), "0-3,8,10-11");
        assert_eq!(parse_cpu_list("3-1"), None);
        assert!("x".parse::<TimingCores>().is_err());
        assert_eq!("off".parse::<TimingCores>().unwrap(), TimingCores::Off);
        assert_eq!(
            "6-7".parse::<TimingCores>().unwrap(),
            TimingCores::List(vec![6, 7])
        );
    }

    /// `auto` reserves the top cores per GPU slot only where enough are left for the rest,
    /// and on the CPU only on hosts of eight cores or more.
    #[test]
    fn auto_reserves_only_what_the_host_can_spare() {
        let host: Vec<usize> = (0..16).collect();
        let (reserved, shared) = auto_plan(&host, Device::Cuda, 2).unwrap();
        assert_eq!(reserved, vec![vec![8, 9, 10, 11], vec![12, 13, 14, 15]]);
        assert_eq!(shared, (0..8).collect::<Vec<_>>());
        assert!(auto_plan(&host[..7], Device::Cuda, 1).is_err());
        assert!(auto_plan(&[0, 1], Device::Cpu, 1).is_err());
        let (reserved, shared) = auto_plan(&host, Device::Cpu, 1).unwrap();
        assert_eq!((reserved[0].len(), shared.len()), (12, 4));
        let (reserved, shared) = split_list(&[1], &[0, 1], 1).unwrap();
        assert_eq!((reserved, shared), (vec![vec![1]], vec![0]));
        assert!(split_list(&[0, 1], &[0, 1], 1).is_err());
        assert!(split_list(&[5], &[0, 1], 1).is_err());
    }

    /// The cpuset hierarchy is found from the mount table and the process's own cgroup, and
    /// refused where it shares its hierarchy with a controller the sandbox gives each command.
    #[test]
    fn the_cpuset_hierarchy_is_found_and_a_shared_one_refused() {
        let cgroups = "3:cpuset:/\n1:cpu:/\n0::/\n";
        let shared = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuset rw - cgroup cgroup rw,cpu,cpuset\n";
        let e = cpuset_dir(shared, cgroups).unwrap_err();
        assert!(e.contains("mounted with cpu"), "{e}");
        assert!(cpuset_dir("", cgroups)
            .unwrap_err()
            .contains("no cgroup v1"));
    }
}
