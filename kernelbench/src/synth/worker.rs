//! The filters for proposed task sources, in two parts that never share a process:
//!
//! - the filters' worker, `synth/synth.py --judge`: one long-lived trusted Python process with
//!   torch that mines the seed operators once, screens each source statically and computes
//!   each verdict from a run's results. It never runs proposed code.
//! - the run, `synth/synth.py --run DIR`: one fresh process per proposal, inside the tool
//!   sandbox the server uses for agent commands (`agent_tools::sandbox`: landlock, seccomp,
//!   rlimits, a leased uid, its own pid namespace, cgroups, as this host allows), with a scratch
//!   directory as the only place it may write, no network (socket() is refused), and time,
//!   memory and process limits. It writes its outputs (`results.pt`) or why it failed.
//!
//! Inside the run, the proposal's code runs in a child process (`--candidate`) of our driver:
//! the driver receives its outputs, times its forward from outside (round trips on a pipe),
//! kills whatever of it is left, and only then writes the results file. What the proposal
//! prints, its exit status and the files it writes can only reject it: the verdict is the
//! worker's, from the driver's results file (read with torch's weights-only unpickler) and
//! the sandbox's own account of the run (time, limits hit, processes left behind). A layer
//! this host lacks is logged and named in [`SandboxReport::missing`], which the run's log,
//! manifest and cost report carry.
//!
//! What is left: the outputs the driver checks are what the proposal's process answered. Code
//! that speaks the driver's pipe protocol itself could answer with outputs its forward does
//! not compute (cached, or faster than it runs); it gains a task file that is then evaluated
//! for real, and nothing of the host.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use agent_tools::sandbox::{ProcessView, ResourceLimits, UidLease};
use agent_tools::{create_private_dir, Jail, Sandbox, SandboxConfig};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Errors of the filters' machinery itself (a candidate's failure is a verdict, not an error).
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The interpreter could not be started.
    #[error("starting {python}")]
    Spawn {
        /// The interpreter.
        python: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Talking to the worker failed.
    #[error("the filters' worker")]
    Io(#[source] std::io::Error),
    /// The worker ended or stalled before listing the seed operators.
    #[error("the filters' worker did not start: {0}")]
    Start(String),
    /// The sandbox for proposals could not be set up.
    #[error("the sandbox for proposed code")]
    Sandbox(#[source] agent_tools::SandboxError),
    /// A proposal's scratch directory could not be prepared or read.
    #[error("the scratch directory {path}")]
    Scratch {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// Limits of one proposal's run.
#[derive(Debug, Clone)]
pub struct RunLimits {
    /// Memory of the run's processes together (a cgroup limit where the host has one) and of
    /// each process alone (RLIMIT_DATA), bytes.
    pub memory_bytes: u64,
    /// Processes at once (a cgroup limit where the host has one; RLIMIT_NPROC of the leased
    /// uid where the uid is switched).
    pub processes: u64,
    /// Largest file the run may write, bytes (its results included).
    pub file_bytes: u64,
}

impl Default for RunLimits {
    fn default() -> Self {
        Self {
            memory_bytes: 4 << 30,
            // Torch's import and inductor start a few dozen threads (a thread counts as a
            // process for both limits).
            processes: 128,
            file_bytes: 1 << 30,
        }
    }
}

/// How to run the filters.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Python with torch.
    pub python: PathBuf,
    /// The worker script (written out by the caller; copied where the sandbox may read it).
    pub script: PathBuf,
    /// The filters' settings: `--device`, `--size`, `--min-ms`, `--max-ms`, `--compile-backend`.
    pub args: Vec<String>,
    /// Longest wait for one proposal's run (torch's import included) and for one verdict.
    pub timeout: Duration,
    /// Longest wait for the start (torch's import and the mining of the seeds).
    pub start_timeout: Duration,
    /// Limits of each proposal's run.
    pub limits: RunLimits,
}

/// A seed operator the worker mined.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeedOp {
    /// How the operator is written (`F.gelu`, `Tensor.cumsum`, `nn.LayerNorm(64)`).
    pub name: String,
    /// The shape family it was mined on (`vec`, `img`).
    pub family: String,
}

/// The filters' verdict on one source.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterVerdict {
    /// Why it was rejected (`kind: detail`), or `None` if it passed every filter.
    pub reason: Option<String>,
    /// Its eager runtime, ms (when accepted).
    pub eager_ms: Option<f64>,
}

impl FilterVerdict {
    fn rejected(reason: String) -> Self {
        Self {
            reason: Some(reason),
            eager_ms: None,
        }
    }
}

/// The confinement proposals run under on this host, as detected at start.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxReport {
    /// Landlock confines the files a run may read and write.
    pub landlock: bool,
    /// Seccomp filters are applied (network sockets, namespaces, ptrace... refused).
    pub seccomp: bool,
    /// Runs are under a uid of their own (a leased one).
    pub uid_isolation: bool,
    /// What a run sees of the host's processes (`private`: a pid namespace of its own).
    pub process_view: String,
    /// A memory limit over all of a run's processes (cgroup).
    pub memory_cgroup: bool,
    /// A process-count limit over all of a run's processes (cgroup).
    pub pids_cgroup: bool,
    /// How a run's leftover processes are killed.
    pub kill_method: String,
    /// The layers not in force here, by name; empty when every one is.
    pub missing: Vec<String>,
}

impl SandboxReport {
    fn of(sandbox: &Sandbox) -> Self {
        let st = sandbox.status();
        let view = match st.process_view {
            ProcessView::Private => "private",
            ProcessView::OwnUid => "own_uid",
            ProcessView::Host => "host",
        };
        let layers = [
            ("landlock", st.landlock),
            ("seccomp", st.seccomp),
            ("uid_isolation", st.uid_isolation),
            ("pid_namespace", st.process_view == ProcessView::Private),
            ("memory_cgroup", st.cgroups.memory.is_some()),
            ("pids_cgroup", st.cgroups.pids.is_some()),
        ];
        Self {
            landlock: st.landlock,
            seccomp: st.seccomp,
            uid_isolation: st.uid_isolation,
            process_view: view.into(),
            memory_cgroup: st.cgroups.memory.is_some(),
            pids_cgroup: st.cgroups.pids.is_some(),
            kill_method: st.kill_method.into(),
            missing: layers
                .iter()
                .filter(|(_, on)| !on)
                .map(|(n, _)| n.to_string())
                .collect(),
        }
    }
}

/// A line of the worker's protocol.
#[derive(Debug, Deserialize)]
#[serde(tag = "event", rename_all = "lowercase")]
enum Event {
    Seeds {
        ops: Vec<SeedOp>,
        /// Python's prefixes, which the sandbox must let a run read.
        #[serde(default)]
        prefixes: Vec<PathBuf>,
    },
    Screened {
        id: u64,
        reason: Option<String>,
    },
    Verdict {
        id: u64,
        reason: Option<String>,
        eager_ms: Option<f64>,
    },
}

/// A request to the worker.
#[derive(Debug, Serialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Request<'a> {
    Screen { id: u64, source: &'a str },
    Check { id: u64, results: &'a Path },
}

/// The directory holding the runs' scratch directories and the script they run; removed when
/// dropped. Under the system's temp dir (mode 0711) so that a leased uid can reach its own
/// scratch directory (mode 0700, its own) and nothing else there.
#[derive(Debug)]
struct ScratchRoot {
    path: PathBuf,
}

impl ScratchRoot {
    fn create() -> Result<Self, WorkerError> {
        use std::os::unix::fs::PermissionsExt as _;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path =
            std::env::temp_dir().join(format!("kernelbench-synth-{}-{nanos}", std::process::id()));
        let err = |source| WorkerError::Scratch {
            path: path.clone(),
            source,
        };
        std::fs::create_dir(&path).map_err(err)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o711)).map_err(err)?;
        Ok(Self { path })
    }
}

impl Drop for ScratchRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The trusted worker's process and pipes.
#[derive(Debug)]
struct Process {
    _child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

/// The filters: the trusted worker, and the sandbox each proposal runs in.
#[derive(Debug)]
pub struct JudgeWorker {
    config: WorkerConfig,
    process: Process,
    seeds: Vec<SeedOp>,
    next_id: u64,
    sandbox: Sandbox,
    report: SandboxReport,
    scratch: ScratchRoot,
    /// The script's copy the runs read (`scratch/bin/synth.py`).
    script: PathBuf,
    path_dirs: Vec<PathBuf>,
}

/// A sandbox's rejection or a results file to check.
enum Ran {
    Rejected(String),
    Results(PathBuf),
}

/// The most of a run's own reason read (it can only reject; more is noise).
const MAX_REASON_BYTES: u64 = 1024;

impl JudgeWorker {
    /// Starts the worker, waits for its seed operators and sets up the sandbox for proposals
    /// (logging the layers this host lacks).
    pub async fn start(config: WorkerConfig) -> Result<Self, WorkerError> {
        let (process, seeds, prefixes) = Self::spawn(&config).await?;
        let scratch = ScratchRoot::create()?;
        let bin = scratch.path.join("bin");
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| WorkerError::Scratch { path, source }
        };
        std::fs::create_dir(&bin).map_err(err(&bin))?;
        let script = bin.join("synth.py");
        std::fs::copy(&config.script, &script).map_err(err(&script))?;
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = |m| std::fs::Permissions::from_mode(m);
            std::fs::set_permissions(&bin, mode(0o755)).map_err(err(&bin))?;
            std::fs::set_permissions(&script, mode(0o644)).map_err(err(&script))?;
        }
        let mut read_only = prefixes.clone();
        read_only.push(bin.clone());
        let mut sc = SandboxConfig::with_toolchains(read_only);
        sc.limits = ResourceLimits {
            cpu_seconds: config.timeout.as_secs().max(1) + 5,
            memory_bytes: config.limits.memory_bytes,
            file_size_bytes: config.limits.file_bytes,
            open_files: 1024,
            processes: config.limits.processes,
            total_memory_bytes: config.limits.memory_bytes,
            total_processes: config.limits.processes,
        };
        // A host without landlock or seccomp still runs the proposals, confined by what it
        // has; the report says what is missing, in the log and in every manifest line.
        sc.allow_unconfined = true;
        let sandbox = Sandbox::new(sc).map_err(WorkerError::Sandbox)?;
        let report = SandboxReport::of(&sandbox);
        if report.missing.is_empty() {
            tracing::info!(
                ?report,
                "proposals run in the sandbox, every layer in force"
            );
        } else {
            tracing::warn!(missing = ?report.missing, ?report, "proposals run in the sandbox without some of its layers: this host lacks them");
        }
        let mut path_dirs: Vec<PathBuf> = config
            .python
            .parent()
            .map(Path::to_path_buf)
            .into_iter()
            .collect();
        path_dirs.extend(["/usr/bin", "/bin"].map(PathBuf::from));
        tracing::info!(seeds = seeds.len(), "filters' worker started");
        Ok(Self {
            config,
            process,
            seeds,
            next_id: 0,
            sandbox,
            report,
            scratch,
            script,
            path_dirs,
        })
    }

    async fn spawn(
        config: &WorkerConfig,
    ) -> Result<(Process, Vec<SeedOp>, Vec<PathBuf>), WorkerError> {
        let mut child = Command::new(&config.python)
            .arg(&config.script)
            .arg("--judge")
            .args(&config.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| WorkerError::Spawn {
                python: config.python.clone(),
                source,
            })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(WorkerError::Start("no pipes".into()));
        };
        let mut stdout = BufReader::new(stdout).lines();
        let (seeds, prefixes) = tokio::time::timeout(config.start_timeout, async {
            while let Some(line) = stdout.next_line().await.map_err(WorkerError::Io)? {
                if let Ok(Event::Seeds { ops, prefixes }) = serde_json::from_str(&line) {
                    return Ok((ops, prefixes));
                }
            }
            Err(WorkerError::Start(format!(
                "{} exited before listing the seed operators",
                config.python.display()
            )))
        })
        .await
        .map_err(|_| {
            WorkerError::Start(format!("no seed operators in {:?}", config.start_timeout))
        })??;
        let process = Process {
            _child: child,
            stdin,
            stdout,
        };
        Ok((process, seeds, prefixes))
    }

    /// The seed operators mined.
    pub fn seeds(&self) -> &[SeedOp] {
        &self.seeds
    }

    /// The confinement proposals run under here.
    pub fn sandbox_report(&self) -> &SandboxReport {
        &self.report
    }

    /// Runs `source` through the filters: the static screen, its run in the sandbox, the
    /// checks of its results. A run that outlasts the timeout, hits a limit, dies or leaves
    /// processes behind is rejected (`judge_timeout`, `sandbox_limit`, `worker_died`,
    /// `left_processes`).
    pub async fn judge(&mut self, source: &str) -> Result<FilterVerdict, WorkerError> {
        self.next_id += 1;
        let id = self.next_id;
        match self.ask(&Request::Screen { id, source }, id).await? {
            Err(reason) => return Ok(FilterVerdict::rejected(reason)),
            Ok(Event::Screened {
                reason: Some(reason),
                ..
            }) => return Ok(FilterVerdict::rejected(reason)),
            Ok(_) => {}
        }
        let results = match self.run(id, source).await? {
            Ran::Rejected(reason) => return Ok(FilterVerdict::rejected(reason)),
            Ran::Results(path) => path,
        };
        let asked = self
            .ask(
                &Request::Check {
                    id,
                    results: &results,
                },
                id,
            )
            .await;
        let _ = std::fs::remove_file(&results);
        Ok(match asked? {
            Ok(Event::Verdict {
                reason, eager_ms, ..
            }) => FilterVerdict { reason, eager_ms },
            Ok(_) => FilterVerdict::rejected("worker_died: no verdict".into()),
            Err(reason) => FilterVerdict::rejected(reason),
        })
    }

    /// Sends a request and waits for the worker's answer to `id`; a worker that dies or stalls
    /// is started again, and the request answered with the reason (`Err`).
    async fn ask(
        &mut self,
        req: &Request<'_>,
        id: u64,
    ) -> Result<Result<Event, String>, WorkerError> {
        let mut line = serde_json::to_string(req).map_err(|e| WorkerError::Io(e.into()))?;
        line.push('\n');
        let p = &mut self.process;
        let asked = async {
            p.stdin.write_all(line.as_bytes()).await?;
            p.stdin.flush().await?;
            while let Some(l) = p.stdout.next_line().await? {
                match serde_json::from_str(&l) {
                    Ok(e @ (Event::Screened { id: got, .. } | Event::Verdict { id: got, .. }))
                        if got == id =>
                    {
                        return Ok(Some(e));
                    }
                    _ => {}
                }
            }
            Ok::<_, std::io::Error>(None)
        };
        let reason = match tokio::time::timeout(self.config.timeout, asked).await {
            Ok(Ok(Some(e))) => return Ok(Ok(e)),
            Ok(Ok(None)) | Ok(Err(_)) => "worker_died: the filters' worker ended".to_string(),
            Err(_) => format!("judge_timeout: {} s", self.config.timeout.as_secs()),
        };
        tracing::warn!(%reason, "the filters' worker is started again");
        let (process, _, _) = Self::spawn(&self.config).await?;
        self.process = process;
        Ok(Err(reason))
    }

    /// Runs a proposal in the sandbox, in a scratch directory of its own.
    async fn run(&mut self, id: u64, source: &str) -> Result<Ran, WorkerError> {
        let lease: Option<UidLease> = self.sandbox.lease_uid().map_err(WorkerError::Sandbox)?;
        let owner = lease.as_ref().map(UidLease::owner);
        let dir = self.scratch.path.join(id.to_string());
        let tmp = dir.join("tmp");
        let scratch_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| WorkerError::Scratch { path, source }
        };
        create_private_dir(&dir, owner).map_err(scratch_err(&dir))?;
        create_private_dir(&tmp, owner).map_err(scratch_err(&tmp))?;
        let candidate = dir.join("candidate.py");
        std::fs::write(&candidate, source).map_err(scratch_err(&candidate))?;
        let ran = self.run_in(id, &dir, &tmp, owner).await;
        // Whatever the run left there goes (remove_dir_all does not follow links); then the
        // lease is dropped, which kills anything still running under its uid.
        let _ = std::fs::remove_dir_all(&dir);
        drop(lease);
        ran
    }

    async fn run_in(
        &mut self,
        id: u64,
        dir: &Path,
        tmp: &Path,
        owner: Option<(u32, u32)>,
    ) -> Result<Ran, WorkerError> {
        let mut jail = Jail::standard(dir, tmp, &self.path_dirs, &[], owner);
        jail.cuda = self
            .config
            .args
            .windows(2)
            .any(|w| w[0] == "--device" && w[1].starts_with("cuda"));
        let mut args: Vec<OsString> = vec![
            self.script.clone().into(),
            "--run".into(),
            dir.as_os_str().to_owned(),
        ];
        // Only with its own pid namespace and uid may the run's driver take every other
        // process of the uid for the proposal's and kill them.
        if self.report.uid_isolation && self.report.process_view == "private" {
            args.push("--isolated".into());
        }
        args.extend(self.config.args.iter().map(OsString::from));
        let mut cmd = self
            .sandbox
            .command(&jail, &self.config.python, &args, dir)
            .map_err(WorkerError::Sandbox)?;
        cmd.cmd.stdout(Stdio::null());
        let mut child = cmd.spawn().map_err(|source| WorkerError::Spawn {
            python: self.config.python.clone(),
            source,
        })?;
        // Drained as it comes (a full pipe would stall the run); the tail goes to the log.
        let stderr = child.stderr.take().map(|mut s| {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                while let Ok(n) = s.read(&mut chunk).await {
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if buf.len() > 16_384 {
                        buf.drain(..buf.len() - 8192);
                    }
                }
                String::from_utf8_lossy(&buf).into_owned()
            })
        });
        let outcome = child.wait_within(self.config.timeout).await;
        let tail = match stderr {
            Some(t) => tokio::time::timeout(Duration::from_secs(2), t)
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default(),
            None => String::new(),
        };
        tracing::debug!(id, ?outcome, stderr = %tail, "a proposal's run ended");
        let status_ok = outcome.status.is_some_and(|s| s.success());
        if outcome.timed_out {
            return Ok(Ran::Rejected(format!(
                "judge_timeout: {} s",
                self.config.timeout.as_secs()
            )));
        }
        if let Some(b) = outcome.breach {
            return Ok(Ran::Rejected(format!("sandbox_limit: {}: {b}", b.reason())));
        }
        if !status_ok {
            let status = outcome
                .status
                .map_or_else(|| "no exit status".to_string(), |s| s.to_string());
            return Ok(Ran::Rejected(format!("worker_died: {status}")));
        }
        if outcome.killed > 0 {
            return Ok(Ran::Rejected(format!(
                "left_processes: {} still running when the run ended",
                outcome.killed
            )));
        }
        if let Some(reason) = read_reason(&dir.join("reason.txt")) {
            return Ok(Ran::Rejected(reason));
        }
        // The results are copied out of the scratch directory before the worker reads them:
        // the run is over, so what is copied is what the run left, and the worker never opens
        // a path the run could have made a link, a FIFO or a device.
        let results = dir.join("results.pt");
        match std::fs::symlink_metadata(&results) {
            Ok(m) if m.file_type().is_file() && m.len() <= self.config.limits.file_bytes => {}
            Ok(_) => return Ok(Ran::Rejected("malformed_results: not a plain file".into())),
            Err(_) => return Ok(Ran::Rejected("malformed_results: no results".into())),
        }
        let copy = self.scratch.path.join(format!("results-{id}.pt"));
        std::fs::copy(&results, &copy).map_err(|source| WorkerError::Scratch {
            path: copy.clone(),
            source,
        })?;
        Ok(Ran::Results(copy))
    }
}

/// A run's own reason for failing (`reason.txt`): a plain file, its first line, printable,
/// at most 200 characters. `None` when there is none.
fn read_reason(path: &Path) -> Option<String> {
    use std::io::Read as _;
    let meta = std::fs::symlink_metadata(path).ok()?;
    if !meta.file_type().is_file() {
        return Some("malformed_results: reason.txt is not a plain file".into());
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(MAX_REASON_BYTES)
        .read_to_string(&mut text)
        .ok()?;
    let line: String = text
        .lines()
        .next()
        .unwrap_or("")
        .chars()
        .filter(|c| !c.is_control())
        .take(200)
        .collect();
    Some(if line.trim().is_empty() {
        "eager_error: the run gave no reason".into()
    } else {
        line
    })
}
