//! Admission against the host: what the machine offers (memory, pid_max), read at start, and
//! the bounds derived from it. Episode volumes are tmpfs (RAM) and every command may start
//! hundreds of processes, so the configured caps alone could admit more than the host has:
//! a new episode is refused (503, `Retry-After`) while the host's available memory is under a
//! reserve, and commands at once are bounded by the pids the host has.

use serde::Serialize;

/// What the host offers, as read at start.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct HostFacts {
    /// `MemTotal` of /proc/meminfo.
    pub mem_total_bytes: u64,
    /// `/proc/sys/kernel/pid_max`: pids (and threads) the whole host may hold at once.
    pub pid_max: u64,
}

impl HostFacts {
    /// Reads the host's memory and pid_max (generous stand-ins where /proc does not say).
    pub fn probe() -> Self {
        let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(32768);
        Self {
            mem_total_bytes: meminfo("MemTotal:").unwrap_or(u64::MAX),
            pid_max,
        }
    }

    /// The memory kept free by default: a tenth of the host's, at least 1 GiB.
    pub fn default_reserve_bytes(&self) -> u64 {
        (self.mem_total_bytes / 10).max(1 << 30)
    }

    /// Commands at once whose processes fit in half of the host's pids, each command holding
    /// at most `processes_per_command`; at least one.
    pub fn commands_by_pids(&self, processes_per_command: u64) -> usize {
        usize::try_from(self.pid_max / 2 / processes_per_command.max(1))
            .unwrap_or(usize::MAX)
            .max(1)
    }
}

/// The bounds the server admits work by, after the host was asked.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Admission {
    /// What the host offers.
    pub host: HostFacts,
    /// Whether the bounds below come from the host (else: the configured caps alone).
    pub from_host: bool,
    /// A reset is refused while the host's available memory is under this (0: never).
    pub min_available_memory_bytes: u64,
    /// Commands at once the host's pids allow (the command cap is at most this).
    pub commands_by_pids: usize,
    /// Commands at once, as applied.
    pub max_commands: usize,
}

impl Admission {
    /// The bounds for `host`: with `from_host`, the reserve given (or a tenth of memory) and
    /// `max_commands` at most what the pids allow; without, the configured cap alone.
    pub fn derive(
        host: HostFacts,
        from_host: bool,
        reserve: Option<u64>,
        max_commands: usize,
        processes_per_command: u64,
    ) -> Self {
        let by_pids = host.commands_by_pids(processes_per_command);
        Self {
            host,
            from_host,
            min_available_memory_bytes: match from_host {
                true => reserve.unwrap_or_else(|| host.default_reserve_bytes()),
                false => 0,
            },
            commands_by_pids: by_pids,
            max_commands: match from_host {
                true => max_commands.min(by_pids).max(1),
                false => max_commands.max(1),
            },
        }
    }

    /// Why a new episode cannot start now, if the host's memory says so.
    pub fn refuse_episode(&self) -> Option<String> {
        if self.min_available_memory_bytes == 0 {
            return None;
        }
        let available = meminfo("MemAvailable:")?;
        (available < self.min_available_memory_bytes).then(|| {
            format!(
                "the host has {} MiB of memory available, under the {} MiB kept free; retry later",
                available >> 20,
                self.min_available_memory_bytes >> 20
            )
        })
    }
}

/// A field of /proc/meminfo, in bytes.
fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
