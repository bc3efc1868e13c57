//! Watching a process tree's CPU from outside it: which libraries its threads execute, sampled
//! by the kernel (`perf_event_open`, a software CPU clock, user space only).
//!
//! The candidate worker reports its own aten trace, and a candidate can rewrite that report
//! inside its own process. What the kernel samples it cannot: the server (root) opens one
//! sampling event per CPU for the whole machine and reads the instruction pointers out of ring
//! buffers the tree never sees, keeping the samples of the processes of the observed trees:
//! those there when attached and every child any of them forks later (the kernel's fork
//! records). Each sample's address is resolved against the process's executable mappings (read
//! from `/proc` when attached, then followed through the kernel's mmap, fork and exec records),
//! so the judge can tell time spent in PyTorch's own kernels from time spent in the
//! candidate's.
//!
//! One event per CPU, not one per task: a task's own sampling event is switched out and in
//! with the task (a timer cancelled and armed at every context switch, about 8 us each in a
//! virtual machine), which charged a worker that wakes its thread pool between calls a
//! millisecond of CPU outside its calls and failed honest candidates on `late_work`. A CPU's
//! event costs every task on it the same interrupt per millisecond of CPU time, and nothing
//! per switch.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Why a tree could not be observed.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// The kernel refused a sampling event (no permission, no perf support, a seccomp filter).
    #[error("perf_event_open on cpu {cpu}")]
    Open {
        /// The CPU.
        cpu: usize,
        /// The kernel's answer.
        #[source]
        source: std::io::Error,
    },
    /// Mapping or redirecting a ring buffer failed.
    #[error("perf ring buffer")]
    Ring(#[source] std::io::Error),
    /// The tree's root is gone.
    #[error("process {0} is gone")]
    Gone(u32),
    /// The probe's own process could not start.
    #[error("starting the probe's process")]
    Probe(#[source] std::io::Error),
}

/// Observes a short-lived process of the server's own: whether this machine lets the server
/// observe at all (root, perf events, no filter in the way).
pub fn probe() -> Result<(), ObserveError> {
    let mut child = std::process::Command::new("sleep")
        .arg("5")
        .stdin(std::process::Stdio::null())
        .spawn()
        .map_err(ObserveError::Probe)?;
    let attached = Observer::attach(&[Tree {
        root: child.id(),
        uid: None,
    }]);
    let _ = child.kill();
    let _ = child.wait();
    attached.map(|o| drop(o.finish()))
}

/// The CPU time between two samples of a CPU's clock.
pub const SAMPLE_PERIOD: Duration = Duration::from_millis(1);
/// Records kept per observation (about 40 bytes each); later ones are counted as lost (a
/// 600 s evaluation on every core of a large host would otherwise grow without bound).
const MAX_RECORDS: usize = 2 << 20;
/// Mapping records kept (each carries a file name the tree chose).
const MAX_MAPS: usize = 1 << 16;
/// Data pages per CPU ring (256 KiB: 8 s of samples at the full rate, drained every 50 ms).
const RING_PAGES: usize = 64;

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_CPU_CLOCK: u64 = 0;
const SAMPLE_IP: u64 = 1;
const SAMPLE_TID: u64 = 2;
const SAMPLE_TIME: u64 = 4;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
const IOC_DISABLE: libc::c_ulong = 0x2401;
const RECORD_LOST: u32 = 2;
const RECORD_COMM: u32 = 3;
const RECORD_FORK: u32 = 7;
const RECORD_SAMPLE: u32 = 9;
const RECORD_MMAP2: u32 = 10;
const MISC_COMM_EXEC: u16 = 1 << 13;

/// `struct perf_event_attr` as of its 128-byte version, the fields this module sets.
fn attr() -> [u8; 128] {
    let mut a = [0u8; 128];
    a[0..4].copy_from_slice(&PERF_TYPE_SOFTWARE.to_ne_bytes());
    a[4..8].copy_from_slice(&128u32.to_ne_bytes());
    a[8..16].copy_from_slice(&PERF_COUNT_SW_CPU_CLOCK.to_ne_bytes());
    let period = SAMPLE_PERIOD.as_nanos() as u64;
    a[16..24].copy_from_slice(&period.to_ne_bytes());
    a[24..32].copy_from_slice(&(SAMPLE_IP | SAMPLE_TID | SAMPLE_TIME).to_ne_bytes());
    // exclude_kernel, exclude_hv, exclude_idle, mmap, comm, task, sample_id_all, mmap2,
    // comm_exec, use_clockid. Enabled from the start: a mapping made between the event's
    // opening and an enable would be in neither the `/proc` snapshot nor the records.
    let flags: u64 = (1 << 5)
        | (1 << 6)
        | (1 << 7)
        | (1 << 8)
        | (1 << 9)
        | (1 << 13)
        | (1 << 18)
        | (1 << 23)
        | (1 << 24)
        | (1 << 25);
    a[40..48].copy_from_slice(&flags.to_ne_bytes());
    // The same clock as Python's time.monotonic_ns(), which the judge's windows are in.
    a[92..96].copy_from_slice(&libc::CLOCK_MONOTONIC.to_ne_bytes());
    a
}

/// The sampling event of one CPU, for every task that runs on it.
fn perf_open(cpu: usize) -> std::io::Result<OwnedFd> {
    let a = attr();
    // SAFETY: a valid attr of the size it declares; the kernel copies it.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            a.as_ptr(),
            -1 as libc::pid_t,
            cpu as libc::c_int,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just gave us, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

fn ioctl(fd: &OwnedFd, req: libc::c_ulong, arg: libc::c_ulong) -> std::io::Result<()> {
    // SAFETY: perf ioctls on a perf descriptor; none reads memory through `arg`.
    if unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// One CPU's ring buffer, mapped from its event.
struct Ring {
    base: *mut u8,
    len: usize,
    data_offset: usize,
    data_size: usize,
}

// SAFETY: the mapping is only read and its tail written by the one thread holding the lock.
unsafe impl Send for Ring {}

impl Ring {
    fn map(fd: &OwnedFd) -> std::io::Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let len = page * (1 + RING_PAGES);
        // SAFETY: mapping a perf descriptor's ring, as perf_event_open(2) describes.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = base as *mut u8;
        // SAFETY: the metadata page is mapped; data_offset/data_size are at 1040/1048.
        let (off, size) = unsafe {
            (
                std::ptr::read_volatile(base.add(1040) as *const u64) as usize,
                std::ptr::read_volatile(base.add(1048) as *const u64) as usize,
            )
        };
        let (data_offset, data_size) = if size == 0 {
            (page, page * RING_PAGES)
        } else {
            (off, size)
        };
        Ok(Self {
            base,
            len,
            data_offset,
            data_size,
        })
    }

    /// Moves every record written since the last drain into `out`.
    fn drain(&mut self, out: &mut Vec<Vec<u8>>) {
        use std::sync::atomic::AtomicU64;
        // SAFETY: data_head (1024) and data_tail (1032) are u64s of the mapped metadata page,
        // shared with the kernel: read and written atomically as perf_event_open(2) says.
        let (head_p, tail_p) = unsafe {
            (
                &*(self.base.add(1024) as *const AtomicU64),
                &*(self.base.add(1032) as *const AtomicU64),
            )
        };
        let head = head_p.load(Ordering::Acquire);
        let mut tail = tail_p.load(Ordering::Relaxed);
        // SAFETY: the data area is mapped for data_size bytes from data_offset.
        let data =
            unsafe { std::slice::from_raw_parts(self.base.add(self.data_offset), self.data_size) };
        let at = |pos: u64, n: usize| -> Vec<u8> {
            (0..n)
                .map(|i| data[(pos as usize + i) % self.data_size])
                .collect()
        };
        while tail + 8 <= head {
            let hdr = at(tail, 8);
            let size = u16::from_ne_bytes([hdr[6], hdr[7]]) as u64;
            if size < 8 || tail + size > head {
                break;
            }
            out.push(at(tail, size as usize));
            tail += size;
        }
        tail_p.store(tail, Ordering::Release);
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmapping what `map` mapped, once.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
        }
    }
}

/// An executable mapping: `[start, end)` of library `lib` (an index into the library names),
/// `start` at file offset `offset`.
#[derive(Debug, Clone, Copy)]
struct Range {
    start: u64,
    end: u64,
    offset: u64,
    lib: usize,
}

/// A process tree to observe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tree {
    /// Its root process.
    pub root: u32,
    /// The uid the tree's processes run as, where no other process has it (the candidate
    /// worker's slot uid): a process of that uid belongs to the tree even where its fork
    /// record was lost (a ring overflowed by a flood of records).
    pub uid: Option<u32>,
}

/// Trees being observed. Dropping it stops the observation.
pub struct Observer {
    fds: Vec<OwnedFd>,
    stop: Arc<AtomicBool>,
    drain: Option<std::thread::JoinHandle<()>>,
    store: Arc<Mutex<Store>>,
    rings: Arc<Mutex<Vec<Ring>>>,
    libs: Vec<String>,
    maps: HashMap<u32, Vec<Range>>,
}

/// A library (an index into the names) and a page of its file.
type Location = (usize, u64);

/// What an observation saw of one tree, resolved to libraries.
#[derive(Debug, Default)]
pub struct Recording {
    /// (time, where) per sample.
    samples: Vec<(u64, Option<Location>)>,
    libs: Vec<String>,
    /// Records the kernel could not write (a full ring) or that were over the cap, for all
    /// the trees observed together.
    pub lost: u64,
}

/// The granularity of code locations: a page of a library file (a kernel's loop is within
/// one or two).
const PAGE: u64 = 4096;

/// Where one set of windows' samples fell.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    /// The windows (forwards) it covers.
    pub forwards: u64,
    /// Samples inside the windows.
    pub samples: u64,
    /// Samples per library file name (`[unknown]` for addresses outside any file mapping).
    pub by_library: BTreeMap<String, u64>,
    /// Samples per (library file name, page of the file) in PyTorch's compute libraries.
    pub torch_pages: BTreeMap<(String, u64), u64>,
}

impl Profile {
    /// The share of samples in libraries whose file name `is` picks, out of all samples but
    /// those where threads wait (OpenMP's runtime, the CUDA driver), in PyTorch's forwards and
    /// in candidates' alike.
    pub fn share(&self, is: impl Fn(&str) -> bool) -> f64 {
        self.of_busy(
            self.by_library
                .iter()
                .filter(|(l, _)| is(l))
                .map(|(_, n)| n)
                .sum(),
        )
    }

    /// `hit` as a share of the samples outside the libraries where threads wait.
    fn of_busy(&self, hit: u64) -> f64 {
        match self.busy() {
            0 => 0.0,
            busy => hit as f64 / busy as f64,
        }
    }

    /// Samples outside the libraries where threads wait.
    fn busy(&self) -> u64 {
        self.by_library
            .iter()
            .filter(|(l, _)| !is_waiting(l))
            .map(|(_, n)| n)
            .sum()
    }

    /// The `n` libraries with the most samples, with their shares of all samples.
    pub fn top(&self, n: usize) -> Vec<(String, f64)> {
        let mut v: Vec<_> = self.by_library.iter().collect();
        v.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        v.into_iter()
            .take(n)
            .map(|(l, c)| (l.clone(), *c as f64 / self.samples.max(1) as f64))
            .collect()
    }
}

/// The live processes of the tree under `root` (itself included).
fn tree(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(ppid) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    // The command name may hold spaces and parentheses: fields follow the last ')'.
                    let rest = &s[s.rfind(')')? + 2..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
            {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut out = Vec::new();
    let mut todo = vec![root];
    let mut seen = HashSet::new();
    while let Some(pid) = todo.pop() {
        if !seen.insert(pid) {
            continue;
        }
        if Path::new(&format!("/proc/{pid}")).exists() {
            out.push(pid);
        }
        todo.extend(children.get(&pid).into_iter().flatten());
    }
    out
}

/// The real uid of a process, from `/proc/<pid>/status`; `None` once it is gone.
fn process_uid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The CPUs that are online (`/sys/devices/system/cpu/online`, such as `0-3,6-7`): an event
/// on an offline one fails, and a virtual machine may count CPUs it does not have.
fn online_cpus() -> Vec<usize> {
    let listed = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .map(|s| parse_cpu_list(s.trim()))
        .unwrap_or_default();
    if !listed.is_empty() {
        return listed;
    }
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    (0..n.max(1) as usize).collect()
}

/// `0-3,6,8-9` as the CPUs it names; empty where it is not such a list.
pub fn parse_cpu_list(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let bounds: Option<(usize, usize)> = match part.split_once('-') {
            Some((a, b)) => a.parse().ok().zip(b.parse().ok()),
            None => part.parse().ok().map(|a| (a, a)),
        };
        match bounds {
            Some((a, b)) if a <= b && b < 1 << 16 => out.extend(a..=b),
            _ => return Vec::new(),
        }
    }
    out
}

fn lib_index(libs: &mut Vec<String>, index: &mut HashMap<String, usize>, path: &str) -> usize {
    let name = Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.to_string());
    *index.entry(name.clone()).or_insert_with(|| {
        libs.push(name);
        libs.len() - 1
    })
}

/// The executable file mappings of `pid`, from `/proc/<pid>/maps`.
fn read_maps(pid: u32, libs: &mut Vec<String>, index: &mut HashMap<String, usize>) -> Vec<Range> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let mut out = Vec::new();
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let offset = f
            .next()
            .and_then(|o| u64::from_str_radix(o, 16).ok())
            .unwrap_or(0);
        let path = f.nth(2).unwrap_or("");
        if !perms.contains('x') || !path.starts_with('/') {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        out.push(Range {
            start,
            end,
            offset,
            lib: lib_index(libs, index, path),
        });
    }
    out
}

impl Observer {
    /// Starts observing `trees` (each root and its descendants, and every thread or child any
    /// of them starts later) with one sampling event per CPU. Fails where the kernel refuses
    /// (not root, no perf events) or a root is gone: the caller says so instead of pretending
    /// to observe.
    pub fn attach(trees: &[Tree]) -> Result<Self, ObserveError> {
        let mut fds: Vec<OwnedFd> = Vec::new();
        let mut rings = Vec::new();
        for cpu in online_cpus() {
            let fd = match perf_open(cpu) {
                Ok(fd) => fd,
                // A CPU that went offline since the listing.
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => continue,
                Err(source) => return Err(ObserveError::Open { cpu, source }),
            };
            rings.push(Ring::map(&fd).map_err(ObserveError::Ring)?);
            fds.push(fd);
        }
        // Listed after the events are on: a process forked from now on has its fork record,
        // and what a process maps from now on is recorded, what it mapped before is here
        // (both, for a mapping made in between: harmless).
        let (mut libs, mut index) = (Vec::new(), HashMap::new());
        let mut maps = HashMap::new();
        let mut members = HashMap::new();
        for (t, root) in trees.iter().enumerate() {
            let procs = tree(root.root);
            if procs.is_empty() {
                return Err(ObserveError::Gone(root.root));
            }
            for pid in procs {
                maps.insert(pid, read_maps(pid, &mut libs, &mut index));
                members.insert(pid, t);
            }
        }
        let rings = Arc::new(Mutex::new(rings));
        let store = Arc::new(Mutex::new(Store {
            members,
            owners: trees.iter().map(|t| t.uid).collect(),
            ..Store::default()
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let drain = {
            let (rings, store, stop) = (rings.clone(), store.clone(), stop.clone());
            std::thread::Builder::new()
                .name("observe".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(50));
                        drain_all(&rings, &store);
                    }
                })
                .ok()
        };
        Ok(Self {
            fds,
            stop,
            drain,
            store,
            rings,
            libs,
            maps,
        })
    }

    /// Stops sampling and resolves every sample to the library it fell in: one recording per
    /// root, in the order of `attach`.
    pub fn finish(mut self) -> Vec<Recording> {
        for fd in &self.fds {
            let _ = ioctl(fd, IOC_DISABLE, 0);
        }
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.drain.take() {
            let _ = t.join();
        }
        drain_all(&self.rings, &self.store);
        // Twice: events of a child whose fork record came a drain late wait one drain.
        drain_all(&self.rings, &self.store);
        let store = std::mem::take(&mut *self.store.lock().unwrap_or_else(|e| e.into_inner()));
        resolve(
            store,
            std::mem::take(&mut self.libs),
            std::mem::take(&mut self.maps),
        )
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.drain.take() {
            let _ = t.join();
        }
    }
}

/// The decoded records of the observed trees' processes, bounded: a tree that floods the
/// rings (thousands of mappings, a long run on many cores) loses records, counted, never the
/// server's memory.
#[derive(Default)]
struct Store {
    events: Vec<(u64, Event)>,
    maps: usize,
    lost: u64,
    /// The observed processes and the tree each belongs to: those listed when attached and
    /// every child one of them forked since.
    members: HashMap<u32, usize>,
    /// Records of processes not (yet) known, from the last drain: the rings are read one
    /// after the other, so a child's first records can arrive a drain before its fork
    /// record. Kept for one more drain, then dropped (another process of the machine).
    pending: Vec<(u64, Event)>,
    /// Each tree's uid, where it has its own.
    owners: Vec<Option<u32>>,
    /// Processes outside the trees whose uid was read, with it (read once each).
    checked: HashMap<u32, Option<u32>>,
}

impl Store {
    /// The tree `pid` belongs to: by the fork records, or by its uid. A process found by its
    /// uid alone (its fork record lost) gets its mappings from `/proc` now, placed before
    /// every record.
    fn tree_of(&mut self, pid: u32) -> Option<usize> {
        if let Some(&t) = self.members.get(&pid) {
            return Some(t);
        }
        if self.owners.iter().all(Option::is_none) {
            return None;
        }
        let uid = *self.checked.entry(pid).or_insert_with(|| process_uid(pid));
        let t = self.owners.iter().position(|o| o.is_some() && *o == uid)?;
        self.members.insert(pid, t);
        let (mut libs, mut index) = (Vec::new(), HashMap::new());
        for r in read_maps(pid, &mut libs, &mut index) {
            self.keep(
                0,
                Event::Map {
                    pid,
                    range: (r.start, r.end),
                    offset: r.offset,
                    path: libs[r.lib].clone(),
                },
            );
        }
        Some(t)
    }

    fn keep(&mut self, time: u64, e: Event) {
        let is_map = matches!(e, Event::Map { .. });
        if self.events.len() >= MAX_RECORDS || (is_map && self.maps >= MAX_MAPS) {
            self.lost += 1;
            return;
        }
        self.maps += usize::from(is_map);
        self.events.push((time, e));
    }
}

fn drain_all(rings: &Mutex<Vec<Ring>>, store: &Mutex<Store>) {
    let mut got = Vec::new();
    {
        let mut rings = rings.lock().unwrap_or_else(|e| e.into_inner());
        for r in rings.iter_mut() {
            r.drain(&mut got);
        }
    }
    let mut store = store.lock().unwrap_or_else(|e| e.into_inner());
    let mut batch: Vec<(u64, Event, bool)> = std::mem::take(&mut store.pending)
        .into_iter()
        .map(|(t, e)| (t, e, true))
        .collect();
    for r in got {
        match decode(&r) {
            Decoded::Event(time, e) => batch.push((time, e, false)),
            Decoded::Lost(n) => store.lost += n,
            Decoded::Other => {}
        }
    }
    // In time order, so that a fork makes its child a member before the child's records.
    batch.sort_by_key(|(t, _, _)| *t);
    for (time, e, waited) in batch {
        let member = match &e {
            Event::Fork { pid, ppid } => match store.members.get(ppid).copied() {
                Some(t) => {
                    store.members.insert(*pid, t);
                    true
                }
                None => false,
            },
            Event::Sample { pid, .. } | Event::Map { pid, .. } | Event::Exec { pid } => {
                store.tree_of(*pid).is_some()
            }
        };
        if member {
            store.keep(time, e);
        } else if !waited && store.pending.len() < MAX_RECORDS {
            store.pending.push((time, e));
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map(|s| u32::from_ne_bytes(s.try_into().unwrap_or_default()))
        .unwrap_or(0)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .map(|s| u64::from_ne_bytes(s.try_into().unwrap_or_default()))
        .unwrap_or(0)
}

/// An event of the record stream, in time order.
enum Event {
    Sample {
        pid: u32,
        ip: u64,
    },
    Map {
        pid: u32,
        range: (u64, u64),
        offset: u64,
        path: String,
    },
    Fork {
        pid: u32,
        ppid: u32,
    },
    Exec {
        pid: u32,
    },
}

enum Decoded {
    Event(u64, Event),
    Lost(u64),
    Other,
}

/// One ring record, as perf_event_open(2) lays it out for this module's attributes.
fn decode(r: &[u8]) -> Decoded {
    if r.len() < 8 {
        return Decoded::Other;
    }
    let kind = u32_at(r, 0);
    let misc = u16::from_ne_bytes([r[4], r[5]]);
    // With sample_id_all every other record ends with pid, tid (8 bytes) and time (8).
    let trailer_time = u64_at(r, r.len().saturating_sub(8));
    match kind {
        RECORD_SAMPLE => Decoded::Event(
            u64_at(r, 24),
            Event::Sample {
                pid: u32_at(r, 16),
                ip: u64_at(r, 8),
            },
        ),
        RECORD_MMAP2 => {
            let pid = u32_at(r, 8);
            let (addr, len) = (u64_at(r, 16), u64_at(r, 24));
            // pgoff 32, maj 40, min 44, ino 48, ino_generation 56, prot 64, flags 68, name 72.
            if u32_at(r, 64) & libc::PROT_EXEC as u32 == 0 {
                return Decoded::Other;
            }
            let name = r.get(72..r.len().saturating_sub(16)).unwrap_or_default();
            let name = &name[..name.iter().position(|&c| c == 0).unwrap_or(name.len())];
            Decoded::Event(
                trailer_time,
                Event::Map {
                    pid,
                    range: (addr, addr.saturating_add(len)),
                    offset: u64_at(r, 32),
                    path: String::from_utf8_lossy(name).into_owned(),
                },
            )
        }
        RECORD_FORK => {
            let (pid, ppid, tid) = (u32_at(r, 8), u32_at(r, 12), u32_at(r, 16));
            // A new thread is a fork record too; only a new process has its own maps.
            if pid == tid && pid != ppid {
                Decoded::Event(u64_at(r, 24), Event::Fork { pid, ppid })
            } else {
                Decoded::Other
            }
        }
        RECORD_COMM if misc & MISC_COMM_EXEC != 0 => {
            Decoded::Event(trailer_time, Event::Exec { pid: u32_at(r, 8) })
        }
        RECORD_LOST => Decoded::Lost(u64_at(r, 16)),
        _ => Decoded::Other,
    }
}

/// Replays the records in time order: mappings, forks and execs change what an address of a
/// process means from then on. One recording per tree.
fn resolve(
    store: Store,
    mut libs: Vec<String>,
    mut maps: HashMap<u32, Vec<Range>>,
) -> Vec<Recording> {
    let mut index: HashMap<String, usize> = libs
        .iter()
        .enumerate()
        .map(|(i, l)| (l.clone(), i))
        .collect();
    let Store {
        mut events,
        lost,
        members,
        owners,
        ..
    } = store;
    events.sort_by_key(|(t, _)| *t);
    let mut samples: Vec<Vec<(u64, Option<Location>)>> = vec![Vec::new(); owners.len()];
    for (time, e) in events {
        match e {
            Event::Sample { pid, ip } => {
                let Some(&tree) = members.get(&pid) else {
                    continue;
                };
                let at = maps.get(&pid).and_then(|rs| {
                    rs.iter()
                        .rev()
                        .find(|r| r.start <= ip && ip < r.end)
                        .map(|r| (r.lib, (ip - r.start + r.offset) / PAGE))
                });
                samples[tree].push((time, at));
            }
            Event::Map {
                pid,
                range,
                offset,
                path,
            } => {
                let lib = lib_index(&mut libs, &mut index, &path);
                maps.entry(pid).or_default().push(Range {
                    start: range.0,
                    end: range.1,
                    offset,
                    lib,
                });
            }
            Event::Fork { pid, ppid } => {
                let inherited = maps.get(&ppid).cloned().unwrap_or_default();
                maps.insert(pid, inherited);
            }
            Event::Exec { pid } => {
                maps.insert(pid, Vec::new());
            }
        }
    }
    samples
        .into_iter()
        .map(|samples| Recording {
            samples,
            libs: libs.clone(),
            lost,
        })
        .collect()
}

impl Recording {
    /// Where the samples inside `windows` (`[start, end]` in `CLOCK_MONOTONIC` nanoseconds)
    /// fell.
    pub fn profile(&self, windows: &[[u64; 2]]) -> Profile {
        let mut w: Vec<[u64; 2]> = windows.to_vec();
        w.sort_unstable();
        let mut p = Profile {
            forwards: w.len() as u64,
            ..Profile::default()
        };
        for &(time, at) in &self.samples {
            let i = w.partition_point(|x| x[0] <= time);
            if i == 0 || time > w[i - 1][1] {
                continue;
            }
            p.samples += 1;
            let name = at.map_or("[unknown]", |(l, _)| self.libs[l].as_str());
            *p.by_library.entry(name.to_string()).or_default() += 1;
            if let Some((_, page)) = at.filter(|_| is_torch_compute(name)) {
                *p.torch_pages.entry((name.to_string(), page)).or_default() += 1;
            }
        }
        p
    }
}

/// Samples below which a share says nothing.
pub const MIN_SAMPLES: u64 = 50;
/// The reference's share below which the observation cannot tell PyTorch's compute from the
/// rest (a forward of Python and copies): no rule rests on it then.
pub const MIN_REFERENCE_SHARE: f64 = 0.4;
/// The candidate's CPU time per forward in the reference's own kernels' code, as a share of
/// the reference's, that breaks the rule. Measured on the red-team corpus (2-core machine):
/// candidates that hide PyTorch's add 0.81-1.08, honest ones 0.00 with their allowed copies and
/// fills; at about 100 samples a side one standard deviation of the ratio is about 0.14.
pub const KERNEL_TIME_RATIO: f64 = 0.35;
/// Nor does the share of all of PyTorch's compute library.
pub const MIN_LIBRARY_THRESHOLD: f64 = 0.6;
/// The share of the reference's samples in PyTorch that its hot pages cover.
const HOT_COVER: f64 = 0.9;

/// What the outside observation says of a candidate's forwards.
#[derive(Debug, Clone, PartialEq)]
pub enum Finding {
    /// Too few samples, or a reference whose own compute the observation could not see.
    Inconclusive(String),
    /// Below both thresholds.
    Clear,
    /// At or above one: it computes with PyTorch.
    Broken,
}

/// The finding with the shares it rests on.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgement {
    /// The candidate's share of samples in `libtorch_cpu.so`.
    pub candidate_share: f64,
    /// The eager reference's.
    pub reference_share: f64,
    /// The candidate's share in the pages of `libtorch_cpu.so` where the reference spent its
    /// time there (the task's own kernels).
    pub candidate_kernel_share: f64,
    /// The reference's share in those pages.
    pub reference_kernel_share: f64,
    /// The candidate's samples per forward in those pages over the reference's: about 1 for a
    /// forward that runs the reference's kernels, whatever else it does; [`KERNEL_TIME_RATIO`]
    /// or more breaks the rule.
    pub kernel_time_ratio: f64,
    /// `candidate_share` at or above this breaks the rule.
    pub library_threshold: f64,
    /// What it means.
    pub outcome: Finding,
}

/// Whether a library file name is one of PyTorch's compute libraries: the CPU one (its
/// kernels, oneDNN and MKL are linked into it) and the CUDA one (the host side of its
/// kernels: the launches).
pub fn is_torch_compute(name: &str) -> bool {
    name.starts_with("libtorch_cpu.so") || name.starts_with("libtorch_cuda.so")
}

/// Libraries where a thread's samples are waiting, not working, in anyone's forward: OpenMP's
/// runtime (idle workers spin there after a parallel region) and the CUDA driver (a
/// synchronize spins there until the GPU is done).
fn is_waiting(name: &str) -> bool {
    name.starts_with("libgomp") || name.starts_with("libiomp") || name.starts_with("libcuda.so")
}

impl Profile {
    /// The pages of PyTorch's compute library that hold `cover` of this profile's samples
    /// there, most sampled first.
    pub fn hot_pages(&self, cover: f64) -> BTreeSet<(String, u64)> {
        let total: u64 = self.torch_pages.values().sum();
        let mut pages: Vec<_> = self.torch_pages.iter().collect();
        pages.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let mut hot = BTreeSet::new();
        let mut got = 0;
        for (page, n) in pages {
            if got as f64 >= cover * total as f64 {
                break;
            }
            hot.insert(page.clone());
            got += n;
        }
        hot
    }

    /// The share of samples (where threads wait left out) in the given pages of PyTorch's
    /// compute library.
    pub fn share_in_pages(&self, pages: &BTreeSet<(String, u64)>) -> f64 {
        self.of_busy(self.samples_in_pages(pages))
    }

    /// The samples in the given pages of PyTorch's compute library.
    fn samples_in_pages(&self, pages: &BTreeSet<(String, u64)>) -> u64 {
        self.torch_pages
            .iter()
            .filter(|(p, _)| pages.contains(p))
            .map(|(_, n)| n)
            .sum()
    }

    /// The samples in the given pages per forward.
    fn per_forward_in_pages(&self, pages: &BTreeSet<(String, u64)>) -> f64 {
        self.samples_in_pages(pages) as f64 / self.forwards.max(1) as f64
    }
}

/// The rule. An honest candidate's forwards spend their time in its own extension: PyTorch's
/// dispatcher and allocator for its outputs, and the copies and fills it may call, are small
/// and run other code than the task's kernels. A candidate that calls PyTorch's kernels,
/// however it hides the calls from its own process's trace, spends as much CPU time per
/// forward where the eager reference spends its own as the reference does (the judge asks
/// both for the same forwards on the same inputs): it breaks the rule when that time is at
/// least [`KERNEL_TIME_RATIO`] of the reference's. Time, not share: busy work of its own
/// around the hidden call makes PyTorch's kernels a smaller share of the forward but leaves
/// their time as it was, and the judge's own checks in the candidate's windows (its inputs
/// compared after every call) dilute no one. It also breaks the rule when its share in the
/// whole library is at least 90% of the reference's (at least [`MIN_LIBRARY_THRESHOLD`]:
/// other kernels doing all the work).
pub fn pytorch_compute(candidate: &Profile, reference: &Profile) -> Judgement {
    let (c, r) = (
        candidate.share(is_torch_compute),
        reference.share(is_torch_compute),
    );
    let hot = reference.hot_pages(HOT_COVER);
    let (ck, rk) = (
        candidate.share_in_pages(&hot),
        reference.share_in_pages(&hot),
    );
    let reference_time = reference.per_forward_in_pages(&hot);
    let kernel_time_ratio = if reference_time > 0.0 {
        candidate.per_forward_in_pages(&hot) / reference_time
    } else {
        0.0
    };
    let library_threshold = (0.9 * r).max(MIN_LIBRARY_THRESHOLD);
    let outcome = if candidate.samples < MIN_SAMPLES || reference.samples < MIN_SAMPLES {
        Finding::Inconclusive(format!(
            "too few samples ({} of the candidate's forwards, {} of the reference's; {MIN_SAMPLES} needed)",
            candidate.samples, reference.samples
        ))
    } else if r < MIN_REFERENCE_SHARE {
        Finding::Inconclusive(format!(
            "the reference's forwards showed only {:.0}% of their time in PyTorch's compute library",
            100.0 * r
        ))
    } else if kernel_time_ratio >= KERNEL_TIME_RATIO || c >= library_threshold {
        Finding::Broken
    } else {
        Finding::Clear
    };
    Judgement {
        candidate_share: c,
        reference_share: r,
        candidate_kernel_share: ck,
        reference_kernel_share: rk,
        kernel_time_ratio,
        library_threshold,
        outcome,
    }
}
