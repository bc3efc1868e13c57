//! Admission against the host: what the machine offers (memory, pid_max), read at start, and
//! the bounds derived from it. Episode volumes are tmpfs (RAM) and every command may start
//! hundreds of processes, so the configured caps alone could admit more than the host has:
//!
//! - a new episode is refused (503 `host_busy`, `Retry-After`) while the host's available
//!   memory is under a reserve, and while its volume's quota does not fit in what is left of
//!   the volume-memory budget ([`VolumeBudget`]: every open tmpfs volume holds a
//!   [`VolumeReservation`] of its quota until it is unmounted);
//! - a command does not start while the host's available memory is under the reserve (the
//!   agent gets a tool error and may retry; [`Admission::refuse_command`]);
//! - each command's memory cap is at most the memory the host can give
//!   ([`Admission::command_memory_bytes`]), and all commands together are held under it by a
//!   parent cgroup where the host has a memory controller;
//! - commands at once are bounded by the pids the host has.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use agent_tools::sandbox::QuotaEnforcement;
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

/// Why the host takes no more work now: a reset answered 503 `host_busy` with `Retry-After`,
/// or a command refused with a tool error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostBusy {
    /// The host's available memory is under the reserve kept free.
    #[error(
        "the host has {available_mib} MiB of memory available, under the {reserve_mib} MiB kept free; retry later"
    )]
    MemoryShort {
        /// `MemAvailable`, MiB.
        available_mib: u64,
        /// The reserve, MiB.
        reserve_mib: u64,
    },
    /// Another episode's volume does not fit in the volume-memory budget.
    #[error(
        "episode volumes (tmpfs, held in memory) have {reserved_mib} MiB of their {budget_mib} MiB budget reserved; another of {quota_mib} MiB does not fit; retry later"
    )]
    VolumeBudget {
        /// Reserved by the open episodes' volumes, MiB.
        reserved_mib: u64,
        /// The budget, MiB.
        budget_mib: u64,
        /// The quota asked for, MiB.
        quota_mib: u64,
    },
}

/// What admission is asked to apply (the server's flags).
#[derive(Debug, Clone, Copy)]
pub struct AdmissionConfig {
    /// Bound admission by the host; without, the configured caps alone.
    pub from_host: bool,
    /// Memory kept free (None: a tenth of the host's, at least 1 GiB).
    pub min_available_memory_bytes: Option<u64>,
    /// Memory the tmpfs volumes of open episodes may reserve together (None: the host's
    /// memory less the reserve).
    pub volume_memory_bytes: Option<u64>,
    /// The configured cap on commands at once.
    pub max_commands: usize,
    /// Processes one command may hold (its cgroup's pids limit).
    pub processes_per_command: u64,
    /// The configured memory cap of one command (its cgroup's memory limit).
    pub command_memory_bytes: u64,
}

/// The bounds the server admits work by, after the host was asked.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Admission {
    /// What the host offers.
    pub host: HostFacts,
    /// Whether the bounds below come from the host (else: the configured caps alone).
    pub from_host: bool,
    /// A reset is refused, and a command does not start, while the host's available memory
    /// is under this (0: never).
    pub min_available_memory_bytes: u64,
    /// Memory the host can give sandboxed work: its memory less the reserve (None without
    /// host admission). All commands together are held under it by a parent cgroup where
    /// the host has a memory controller (`sandbox.commands_memory_bytes`).
    pub memory_budget_bytes: Option<u64>,
    /// Memory the tmpfs volumes of open episodes may reserve together (each its disk quota);
    /// None: nothing reserved (host admission off, or volumes are measured directories on
    /// disk, which take no memory).
    pub volume_memory_bytes: Option<u64>,
    /// One command's memory cap (cgroup), as applied: the configured one, at most
    /// `memory_budget_bytes`.
    pub command_memory_bytes: u64,
    /// Commands at once the host's pids allow (the command cap is at most this).
    pub commands_by_pids: usize,
    /// Commands at once, as applied.
    pub max_commands: usize,
}

impl Admission {
    /// The bounds for `host`: with `from_host`, the reserve given (or a tenth of memory), a
    /// volume budget (given, or memory less the reserve), each command's memory cap at most
    /// memory less the reserve and `max_commands` at most what the pids allow; without, the
    /// configured caps alone. Volumes are assumed to be tmpfs until [`Admission::with_volumes`]
    /// says otherwise.
    pub fn derive(host: HostFacts, cfg: &AdmissionConfig) -> Self {
        let by_pids = host.commands_by_pids(cfg.processes_per_command);
        if !cfg.from_host {
            return Self {
                host,
                from_host: false,
                min_available_memory_bytes: 0,
                memory_budget_bytes: None,
                volume_memory_bytes: None,
                command_memory_bytes: cfg.command_memory_bytes,
                commands_by_pids: by_pids,
                max_commands: cfg.max_commands.max(1),
            };
        }
        let reserve = cfg
            .min_available_memory_bytes
            .unwrap_or_else(|| host.default_reserve_bytes());
        // At least a page: a budget of nothing would refuse every command's cgroup.
        let budget = host.mem_total_bytes.saturating_sub(reserve).max(4096);
        Self {
            host,
            from_host: true,
            min_available_memory_bytes: reserve,
            memory_budget_bytes: Some(budget),
            volume_memory_bytes: Some(cfg.volume_memory_bytes.unwrap_or(budget)),
            command_memory_bytes: cfg.command_memory_bytes.min(budget),
            commands_by_pids: by_pids,
            max_commands: cfg.max_commands.min(by_pids).max(1),
        }
    }

    /// The same bounds once the volumes' kind is known: measured volumes live on disk and
    /// reserve no memory.
    pub fn with_volumes(self, volumes: QuotaEnforcement) -> Self {
        match volumes {
            QuotaEnforcement::Tmpfs => self,
            QuotaEnforcement::Measured => Self {
                volume_memory_bytes: None,
                ..self
            },
        }
    }

    /// Why a new episode cannot start now, if the host's memory says so.
    pub fn refuse_episode(&self) -> Option<HostBusy> {
        self.memory_short(self.wants_meminfo().then(available_memory).flatten())
    }

    /// Why a command cannot start now, if the host's memory says so (the agent gets a tool
    /// error and may retry; the episode goes on).
    pub fn refuse_command(&self) -> Option<HostBusy> {
        self.memory_short(self.wants_meminfo().then(available_memory).flatten())
    }

    fn wants_meminfo(&self) -> bool {
        self.min_available_memory_bytes > 0
    }

    /// The decision for a host with `available` bytes of memory available (None: unknown,
    /// admitted): short when under the reserve.
    pub fn memory_short(&self, available: Option<u64>) -> Option<HostBusy> {
        let reserve = self.min_available_memory_bytes;
        match available {
            Some(available) if reserve > 0 && available < reserve => Some(HostBusy::MemoryShort {
                available_mib: available >> 20,
                reserve_mib: reserve >> 20,
            }),
            _ => None,
        }
    }
}

/// The memory the tmpfs volumes of open episodes may hold together, and how much of it they
/// reserved: each volume reserves its whole quota while it is mounted, whether it fills it or
/// not, so volumes filling up at once never take the host past its budget.
#[derive(Debug)]
pub struct VolumeBudget {
    budget: u64,
    reserved: AtomicU64,
}

/// A volume's part of the [`VolumeBudget`], given back when dropped. Held beside the volume
/// and dropped after it, so it is given back exactly when the volume goes.
#[derive(Debug)]
#[must_use = "the reservation is given back when dropped"]
pub struct VolumeReservation {
    budget: Arc<VolumeBudget>,
    bytes: u64,
}

impl VolumeBudget {
    /// A budget of `budget` bytes, none reserved.
    pub fn new(budget: u64) -> Arc<Self> {
        Arc::new(Self {
            budget,
            reserved: AtomicU64::new(0),
        })
    }

    /// The budget, in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes reserved now.
    pub fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Acquire)
    }

    fn full(&self, reserved: u64, bytes: u64) -> HostBusy {
        HostBusy::VolumeBudget {
            reserved_mib: reserved >> 20,
            budget_mib: self.budget >> 20,
            quota_mib: bytes.div_ceil(1 << 20),
        }
    }

    /// Whether `bytes` would fit now (reserves nothing: readiness asks this).
    pub fn fits(&self, bytes: u64) -> Result<(), HostBusy> {
        let reserved = self.reserved();
        match reserved.checked_add(bytes) {
            Some(total) if total <= self.budget => Ok(()),
            _ => Err(self.full(reserved, bytes)),
        }
    }

    /// Reserves `bytes` if they fit, at once: concurrent resets never reserve past the budget.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Result<VolumeReservation, HostBusy> {
        self.reserved
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                r.checked_add(bytes).filter(|&t| t <= self.budget)
            })
            .map(|_| VolumeReservation {
                budget: self.clone(),
                bytes,
            })
            .map_err(|reserved| self.full(reserved, bytes))
    }
}

impl VolumeReservation {
    /// Bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for VolumeReservation {
    fn drop(&mut self) {
        self.budget.reserved.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn available_memory() -> Option<u64> {
    meminfo("MemAvailable:")
}

/// A field of /proc/meminfo, in bytes.
fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn host(mem_total_bytes: u64) -> HostFacts {
        HostFacts {
            mem_total_bytes,
            pid_max: 32768,
        }
    }

    fn knobs() -> AdmissionConfig {
        AdmissionConfig {
            from_host: true,
            min_available_memory_bytes: None,
            volume_memory_bytes: None,
            max_commands: 256,
            processes_per_command: 512,
            command_memory_bytes: 16 * GIB,
        }
    }

    /// The measured hole: a 24 GiB host admitted commands capped at 16 GiB each and 4096
    /// volumes of 1 GiB. Derived from the host, commands are capped at what it can give and
    /// volumes reserve against memory less the reserve.
    #[test]
    fn bounds_come_from_the_hosts_memory() {
        let a = Admission::derive(host(4 * GIB), &knobs());
        assert_eq!(a.min_available_memory_bytes, GIB);
        assert_eq!(a.memory_budget_bytes, Some(3 * GIB));
        assert_eq!(a.command_memory_bytes, 3 * GIB);
        assert_eq!(a.volume_memory_bytes, Some(3 * GIB));
        assert_eq!(a.max_commands, 32);
        let a = Admission::derive(
            host(64 * GIB),
            &AdmissionConfig {
                volume_memory_bytes: Some(5 * GIB),
                ..knobs()
            },
        );
        assert_eq!(a.command_memory_bytes, 16 * GIB);
        assert_eq!(a.volume_memory_bytes, Some(5 * GIB));
        // Measured volumes are on disk: nothing to reserve.
        assert_eq!(
            a.with_volumes(QuotaEnforcement::Measured)
                .volume_memory_bytes,
            None
        );
        // Off: the configured caps alone.
        let off = Admission::derive(
            host(4 * GIB),
            &AdmissionConfig {
                from_host: false,
                ..knobs()
            },
        );
        assert_eq!(off.command_memory_bytes, 16 * GIB);
        assert_eq!(off.volume_memory_bytes, None);
        assert_eq!(off.memory_short(Some(0)), None);
    }

    /// A command (and a reset) is refused while the host's available memory is under the
    /// reserve, admitted at or over it, and admitted when the host does not say.
    #[test]
    fn commands_are_refused_while_memory_is_under_the_reserve() {
        let a = Admission::derive(host(24 * GIB), &knobs());
        let reserve = a.min_available_memory_bytes;
        assert_eq!(reserve, 24 * GIB / 10);
        let short = a.memory_short(Some(reserve - 1)).expect("refused");
        assert!(
            short.to_string().contains("kept free") && short.to_string().contains("retry"),
            "{short}"
        );
        assert_eq!(a.memory_short(Some(reserve)), None);
        assert_eq!(a.memory_short(Some(20 * GIB)), None);
        assert_eq!(a.memory_short(None), None);
    }

    /// Reservations never pass the budget, and each is given back when dropped.
    #[test]
    fn volume_reservations_stay_within_the_budget() {
        let b = VolumeBudget::new(3 * GIB);
        let mut held: Vec<_> = (0..3).map(|_| b.reserve(GIB).expect("fits")).collect();
        assert_eq!(b.reserved(), 3 * GIB);
        let err = b.reserve(GIB).expect_err("a fourth does not fit");
        assert_eq!(
            err,
            HostBusy::VolumeBudget {
                reserved_mib: 3072,
                budget_mib: 3072,
                quota_mib: 1024
            }
        );
        assert!(b.fits(1).is_err());
        drop(held.pop());
        assert_eq!(b.reserved(), 2 * GIB);
        let again = b.reserve(GIB).expect("fits after one is given back");
        assert!(b.reserve(u64::MAX).is_err(), "no overflow");
        drop(again);
        assert_eq!(b.reserved(), 2 * GIB);
    }
}
