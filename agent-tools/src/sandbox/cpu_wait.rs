//! How long a command was held back by the host: the wall-clock time during which it waited
//! for a CPU and made no progress, so that its tool time can leave that time out.
//!
//! The measure is a lower bound of the time during which at least one of the command's tasks
//! was runnable but waiting for a CPU while none of them ran. Over each sampling window, for
//! every task `j` of the command, `runnable_j` = its CPU time + its run-queue delay
//! (`/proc/<tid>/schedstat`, fields 1 and 2) in the window. While task `j` was runnable, either
//! some task of the command ran (at most the command cgroup's CPU time in the window, which
//! counts tasks that exited too) or none did; so
//! `waited >= max_j(runnable_j) - cpu_time`, and that is what is counted (clamped to the
//! window). Why this and not the kernel's pressure figures:
//!
//! - cgroup v2 `cpu.pressure` "some" counts time during which any task waited, also while
//!   others of the command ran: a command that starts more runnable threads than it has CPUs
//!   waits on itself and would look starved on an idle host.
//! - "full" is a per-CPU figure averaged over CPUs by their busy time: a command whose work
//!   runs unhindered on one CPU while a spinning thread of it waits on a busy other CPU is
//!   credited half its time. The bound above credits nothing there (its work ran).
//!
//! No schedule of the command's own can raise the bound above the time it really made no
//! progress: its own tasks waiting on each other leave `max_j(runnable_j) <= window` and
//! the CPU time they got fills it. The kernel adds a run-queue delay when the wait ends, so a
//! wait begun in one window may count in the next: each window's credit is capped at the
//! window less the CPU time the command used in it, so a command is charged at least its
//! CPU time (up to its wall time) whatever the timing of its waits. What it misses, to the command's cost (it is then charged
//! more, as before): the run-queue delay of a task in the window in which it exits (its
//! counters go with it, between two samples), of tasks that live less than a window, and the
//! waits of a parallel command beyond one task's (overlapping waits count once). What it
//! cannot tell apart: a task waiting for a CPU while the command's other tasks sleep (say on
//! the GPU) is counted, whatever that sleep achieves.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

/// How this host measures a command's wait for a CPU, as `/v1/info` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuAccounting {
    /// Per-task run-queue delays (`/proc/<tid>/schedstat`) sampled over the tasks of the
    /// command's cgroup, against the cgroup's CPU time: a command's time waiting for a CPU
    /// while none of its tasks ran is not charged.
    Schedstat,
    /// Neither is readable here (no scheduler statistics, or no cgroup with CPU time for
    /// commands): a command is charged its wall time.
    Wall,
}

/// Whether the kernel fills `/proc/<tid>/schedstat` (without scheduler info it reads
/// `0 0 0`; a process that has run has a non-zero CPU time there).
pub(crate) fn schedstat_readable() -> bool {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| parse_schedstat(&s))
        .is_some_and(|(cpu, _)| cpu > 0)
}

/// CPU time and run-queue delay (ns) from a schedstat line.
fn parse_schedstat(text: &str) -> Option<(u64, u64)> {
    let mut f = text.split_whitespace();
    Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
}

/// Where a cgroup says how much CPU its tasks (living and exited) used.
#[derive(Debug, Clone)]
pub(crate) enum CpuCounter {
    /// cgroup v2 `cpu.stat`, `usage_usec` (present without the cpu controller).
    V2(PathBuf),
    /// cgroup v1 `cpuacct.usage` (ns), where cpuacct shares the cpu hierarchy.
    V1(PathBuf),
}

impl CpuCounter {
    /// The counter a cgroup directory offers, if any.
    pub(crate) fn of(dir: &Path) -> Option<Self> {
        let v2 = dir.join("cpu.stat");
        if read_usage_usec(&v2).is_some() {
            return Some(Self::V2(v2));
        }
        let v1 = dir.join("cpuacct.usage");
        v1.exists().then_some(Self::V1(v1))
    }

    /// CPU time used so far.
    fn read(&self) -> Option<Duration> {
        match self {
            Self::V2(f) => read_usage_usec(f).map(Duration::from_micros),
            Self::V1(f) => std::fs::read_to_string(f)
                .ok()?
                .trim()
                .parse()
                .ok()
                .map(Duration::from_nanos),
        }
    }
}

fn read_usage_usec(file: &Path) -> Option<u64> {
    std::fs::read_to_string(file).ok()?.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == "usage_usec").then(|| v.trim().parse().ok()).flatten()
    })
}

/// A command's tasks in one sample: CPU time and run-queue delay (ns) by tid.
type Counters = HashMap<i32, (u64, u64)>;

/// Samples a running command's tasks and adds up the time it was held back.
#[derive(Debug)]
pub(crate) struct CpuWaitMeter {
    /// The file listing the command's threads (`cgroup.threads` or v1 `tasks`).
    threads: PathBuf,
    cpu: CpuCounter,
    last: Counters,
    last_cpu: Duration,
    last_at: Instant,
    waited: Duration,
}

/// Tasks read per sample at most: a command's process limit is far below it, and a sample
/// must stay cheap however many threads a command starts.
const MAX_TASKS: usize = 8192;

impl CpuWaitMeter {
    /// A meter over the tasks listed in `threads`, whose cgroup counts CPU time in `cpu`.
    /// Starts at the command's start (nothing waited, no task seen).
    pub(crate) fn new(threads: PathBuf, cpu: CpuCounter) -> Option<Self> {
        let last_cpu = cpu.read()?;
        Some(Self {
            threads,
            cpu,
            last: Counters::new(),
            last_cpu,
            last_at: Instant::now(),
            waited: Duration::ZERO,
        })
    }

    /// Takes a sample: adds the window since the last one. Returns the time waited so far.
    pub(crate) fn sample(&mut self) -> Duration {
        let now = Instant::now();
        let window = now.saturating_duration_since(self.last_at);
        let tids: Vec<i32> = std::fs::read_to_string(&self.threads)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .take(MAX_TASKS)
            .collect();
        let mut counters = Counters::with_capacity(tids.len());
        let mut runnable = Vec::with_capacity(tids.len());
        for tid in tids {
            let Some(now_c) = std::fs::read_to_string(format!("/proc/{tid}/schedstat"))
                .ok()
                .and_then(|s| parse_schedstat(&s))
            else {
                continue; // exited since the list was read
            };
            // A task not seen before was born in this window (counters from zero); one
            // whose counters went back is a new task under a reused tid.
            let before = self
                .last
                .get(&tid)
                .copied()
                .filter(|b| b.0 <= now_c.0 && b.1 <= now_c.1)
                .unwrap_or((0, 0));
            runnable.push((now_c.0 - before.0) + (now_c.1 - before.1));
            counters.insert(tid, now_c);
        }
        // Read after the tasks: CPU time they got up to their reading is in it, so the
        // bound errs towards charging.
        let cpu = self.cpu.read().unwrap_or(self.last_cpu);
        let used = cpu.saturating_sub(self.last_cpu);
        self.waited += held(window, &runnable, used);
        self.last = counters;
        self.last_cpu = cpu.max(self.last_cpu);
        self.last_at = now;
        self.waited
    }

    /// The time waited up to the last sample.
    pub(crate) fn waited(&self) -> Duration {
        self.waited
    }
}

/// The time a command was held back in a window of `window`, given each task's runnable time
/// in it (ns: CPU time plus run-queue delay) and the CPU time all its tasks used (`used`).
fn held(window: Duration, runnable: &[u64], used: Duration) -> Duration {
    let longest = Duration::from_nanos(runnable.iter().copied().max().unwrap_or(0));
    // A task's run-queue delay is added when it gets a CPU, so a wait can land in the window
    // in which it ends, on top of that window's own: capped at the window's time not spent
    // running the command's work, no window is credited past its progress.
    longest
        .saturating_sub(used)
        .min(window.saturating_sub(used))
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_millis(200);

    fn ms(n: u64) -> u64 {
        n * 1_000_000
    }

    #[test]
    fn a_task_given_a_fifth_of_a_cpu_waited_the_rest() {
        assert_eq!(
            held(W, &[ms(200)], Duration::from_millis(40)),
            Duration::from_millis(160)
        );
    }

    #[test]
    fn tasks_waiting_on_each_other_were_not_held_back() {
        // Eight tasks on one free CPU: each runnable all the window, the CPU all theirs.
        assert_eq!(held(W, &[ms(200); 8], W), Duration::ZERO);
        // Two tasks sharing a CPU for half the window, then sleeping: each runnable 100 ms,
        // together 100 ms of CPU. A sum of their delays (50 ms each) would credit 100 ms.
        assert_eq!(
            held(W, &[ms(100), ms(100)], Duration::from_millis(100)),
            Duration::ZERO
        );
        // Parallel work on two free CPUs.
        assert_eq!(held(W, &[ms(200), ms(200)], W * 2), Duration::ZERO);
    }

    #[test]
    fn a_wait_that_lands_late_credits_no_more_than_the_window_left_after_the_work() {
        // 500 ms of delay added at the task's arrival, in a window in which the command ran
        // 60 ms.
        assert_eq!(
            held(W, &[ms(560)], Duration::from_millis(60)),
            Duration::from_millis(140)
        );
    }

    #[test]
    fn a_window_without_tasks_credits_nothing() {
        assert_eq!(held(W, &[], Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn schedstat_lines_parse() {
        assert_eq!(
            parse_schedstat("71245281 1936454543 20\n"),
            Some((71245281, 1936454543))
        );
        assert_eq!(parse_schedstat(""), None);
    }

    #[test]
    fn this_host_says_whether_it_has_scheduler_statistics() {
        // Either answer is a host's; the call must not fail or hang.
        let _ = schedstat_readable();
    }
}
