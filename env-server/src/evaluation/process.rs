//! The evaluation's sandboxed processes: the candidate worker's and the judge's jails, their
//! command lines, starting them, and reading their output (capped, never blocking them).

use std::ffi::OsString;
use std::path::Path;

use agent_tools::sandbox::{Outcome, ProcessView, SandboxedChild};
use agent_tools::Jail;
use tokio::io::AsyncReadExt;

use super::dirs::EvalDirs;
use super::volume::EvalVolume;
use super::{EvalError, Evaluator};
use crate::runtime::Device;

/// Where the judges' torch.compile caches are for one evaluation.
pub(super) struct CompileCache {
    /// The directory (`TORCHINDUCTOR_CACHE_DIR` and `TRITON_CACHE_DIR` are inside it).
    pub dir: std::path::PathBuf,
    /// Whether it is the device slot's, shared by the judges of the server's own tasks (else
    /// the judge's own, removed with the evaluation).
    pub shared: bool,
}

impl Evaluator {
    /// The candidate worker's jail: its sources, its temp dir, its build directory and its
    /// output directory (all on the evaluation's volume, whose limits end its commands) and
    /// the reply FIFO; the task and the harness read-only. The build cache is not in reach:
    /// the build directory is the volume's copy of an entry.
    pub(super) fn worker_jail(
        &self,
        d: &EvalDirs,
        volume: &EvalVolume,
        owner: Option<(u32, u32)>,
    ) -> Jail {
        let ext = &volume.dirs.ext;
        let mut j = Jail::standard(
            &d.candidate,
            &d.tmp,
            &self.python.path_dirs(),
            &self.cfg.extra_env,
            owner,
        );
        j.writable = vec![
            d.candidate.clone(),
            d.tmp.clone(),
            ext.to_path_buf(),
            d.out.clone(),
            d.rep.clone(),
        ];
        j.volume = volume.volume();
        j.read_only
            .extend([d.root.clone(), self.harness_dir.clone()]);
        // The judge finds the worker's processes by uid in the host's process table; the
        // worker sees only its own.
        j.process_view = ProcessView::OwnUid;
        j.cuda = self.cfg.device == Device::Cuda;
        j.env.push(("TORCH_EXTENSIONS_DIR".into(), ext.into()));
        j.env.push(("OMP_WAIT_POLICY".into(), "PASSIVE".into()));
        j
    }

    /// The judge's jail on device slot `slot`: its work directory, the inputs it writes for
    /// the worker, the request FIFO and (shared) the compile cache; the task, the solution's
    /// copy and the harness read-only; the host's process table, to find its worker's.
    pub(super) fn judge_jail(
        &self,
        d: &EvalDirs,
        owner: Option<(u32, u32)>,
        cache: &CompileCache,
        slot: usize,
    ) -> Jail {
        let mut judge_jail = Jail::standard(
            &d.judge,
            &d.judge,
            &self.python.path_dirs(),
            &self.cfg.extra_env,
            owner,
        );
        judge_jail.cuda = self.cfg.device == Device::Cuda;
        judge_jail.env.push((
            "TORCHINDUCTOR_CACHE_DIR".into(),
            cache.dir.join("inductor").into(),
        ));
        judge_jail
            .env
            .push(("TRITON_CACHE_DIR".into(), cache.dir.join("triton").into()));
        judge_jail.writable = vec![d.judge.clone(), d.inputs.clone(), d.req.clone()];
        if cache.shared {
            judge_jail.writable.push(cache.dir.clone());
        }
        // The worker's outputs are on its volume.
        judge_jail
            .read_only
            .extend([d.root.clone(), d.out.clone(), self.harness_dir.clone()]);
        judge_jail.process_view = ProcessView::Host;
        judge_jail
            .env
            .push(("OMP_WAIT_POLICY".into(), "PASSIVE".into()));
        if self.cfg.device == Device::Cuda {
            judge_jail
                .env
                .push(("CUDA_VISIBLE_DEVICES".into(), slot.to_string().into()));
        }
        judge_jail
    }

    /// The worker's jail (from [`Evaluator::worker_jail`]) for the run on device slot
    /// `slot`: the build saw no device, the run sees its slot's.
    pub(super) fn worker_jail_on(&self, jail: &Jail, slot: usize) -> Jail {
        let mut jail = jail.clone();
        if self.cfg.device == Device::Cuda {
            jail.env
                .push(("CUDA_VISIBLE_DEVICES".into(), slot.to_string().into()));
        }
        jail
    }

    /// The candidate worker's command line: it serves the judge's requests over the FIFOs.
    pub(super) fn worker_argv(&self, d: &EvalDirs) -> Vec<OsString> {
        let device = self.cfg.device.as_str();
        let mut wargv: Vec<OsString> = vec![self.harness_dir.join("cuda_agent_worker.py").into()];
        wargv.extend(["serve", "--role", "candidate", "--device", device].map(OsString::from));
        wargv.extend([
            "--task".into(),
            d.task.clone().into(),
            "--candidate".into(),
            d.candidate.clone().into(),
        ]);
        wargv.extend([
            "--req".into(),
            d.req.clone().into(),
            "--rep".into(),
            d.rep.clone().into(),
            "--out-dir".into(),
            d.out.clone().into(),
        ]);
        if !self.cfg.allow_ops.is_empty() {
            wargv.extend(["--allow-ops".into(), self.cfg.allow_ops.join(",").into()]);
        }
        wargv
    }

    /// The judge's command line: `evaluate.py candidate` against the worker `worker_pid`
    /// (running as `worker_owner`), with the `seeds`, the tolerance and the time limits, and
    /// a gate it waits at for the lease.
    pub(super) fn judge_argv(
        &self,
        d: &EvalDirs,
        seeds: &str,
        worker_pid: u32,
        worker_owner: Option<(u32, u32)>,
        tolerance: Option<f64>,
    ) -> Vec<OsString> {
        let device = self.cfg.device.as_str();
        let mut jargv: Vec<OsString> = vec![
            self.harness_dir.join("evaluate.py").into(),
            "candidate".into(),
        ];
        jargv.extend([
            "--task".into(),
            d.task.clone().into(),
            "--candidate".into(),
            d.source.clone().into(),
            "--device".into(),
            device.into(),
        ]);
        jargv.extend([
            "--seeds".into(),
            seeds.into(),
            "--workdir".into(),
            d.judge.clone().into(),
            "--inputs-dir".into(),
            d.inputs.clone().into(),
        ]);
        jargv.extend([
            "--worker-req".into(),
            d.req.clone().into(),
            "--worker-rep".into(),
            d.rep.clone().into(),
            "--worker-out".into(),
            d.out.clone().into(),
        ]);
        jargv.extend(["--worker-pid".into(), worker_pid.to_string().into()]);
        if let Some((uid, _)) = worker_owner {
            jargv.extend(["--worker-uid".into(), uid.to_string().into()]);
        }
        let secs = self.cfg.phase_timeout.as_secs_f64();
        jargv.extend([
            "--setup-timeout".into(),
            format!("{secs}").into(),
            "--call-timeout".into(),
            format!("{}", secs.min(120.0)).into(),
        ]);
        if let Some(t) = tolerance {
            jargv.extend([
                "--atol".into(),
                t.to_string().into(),
                "--rtol".into(),
                t.to_string().into(),
            ]);
        }
        if self.cfg.skip_compile {
            jargv.push("--no-compile".into());
        }
        jargv.extend([
            "--budget-s".into(),
            format!("{}", self.cfg.timing_budget.as_secs_f64()).into(),
        ]);
        // The judge starts its side (workers, channels) and waits at the gate for the lease.
        jargv.push("--gate".into());
        jargv
    }

    /// Runs one sandboxed process to its end or the phase time limit; returns its stdout,
    /// stderr (both capped) and how it ended.
    pub(super) async fn run_sandboxed(
        &self,
        jail: &Jail,
        argv: &[OsString],
        cwd: &Path,
    ) -> Result<(Vec<u8>, Vec<u8>, Outcome), EvalError> {
        let mut child = self.spawn_jailed(jail, argv, cwd, "python", false, false)?;
        let out = drain(child.stdout.take(), 8 << 20);
        let err = drain(child.stderr.take(), 1 << 20);
        let outcome = child.wait_within(self.cfg.phase_timeout).await;
        Ok((
            out.await.unwrap_or_default(),
            err.await.unwrap_or_default(),
            outcome,
        ))
    }

    /// Starts the harness's Python in `jail`; `stdin` gives it a pipe (the judge's gate)
    /// instead of nothing; `lowered` starts it at `SCHED_IDLE` with its session's autogroup
    /// at nice 19 (an evaluation started ahead of its lease, in priority mode: raised by
    /// [`super::isolation::TimingIsolation::enter_timed`] once it holds the lease).
    pub(super) fn spawn_jailed(
        &self,
        jail: &Jail,
        argv: &[OsString],
        cwd: &Path,
        what: &'static str,
        stdin: bool,
        lowered: bool,
    ) -> Result<SandboxedChild, EvalError> {
        let mut sc = self
            .sandbox
            .command(jail, &self.python.executable, argv, cwd)
            .map_err(|source| EvalError::Sandbox {
                context: what,
                source,
            })?;
        if stdin {
            sc.cmd.stdin(std::process::Stdio::piped());
        }
        if lowered {
            // Runs after the sandbox's own steps, in the process about to exec (the keeper
            // never gets here): the policy is inherited by every thread and child it starts,
            // so no thread of the start-up runs at the normal policy, however early.
            // SAFETY: `lower_self` makes one async-signal-safe syscall.
            unsafe {
                sc.cmd.pre_exec(super::isolation::lower_self);
            }
        }
        let child = sc
            .spawn()
            .map_err(|source| EvalError::Spawn { what, source })?;
        if lowered {
            // The keeper made the session and shares its autogroup with the command.
            if let Some(pid) = child.id() {
                super::isolation::lower_autogroup(pid);
            }
        }
        Ok(child)
    }
}

/// Reads a pipe to its end on a task of its own, keeping at most `cap` bytes.
pub(super) fn drain<R>(pipe: Option<R>, cap: usize) -> tokio::task::JoinHandle<Vec<u8>>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    drain_watching(pipe, cap, None)
}

/// The line the judge prints on its stdout when it waits at its gate (`wait_for_go` in
/// `cuda_agent_judge.py`).
const JUDGE_AT_GATE: &[u8] = br#"{"gate": "waiting"}"#;

/// [`drain`], telling `at_gate` as soon as a whole line read is [`JUDGE_AT_GATE`] (the sender
/// is dropped unsent if the pipe ends first).
pub(super) fn drain_watching<R>(
    pipe: Option<R>,
    cap: usize,
    mut at_gate: Option<tokio::sync::oneshot::Sender<()>>,
) -> tokio::task::JoinHandle<Vec<u8>>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut buf = Vec::new();
        let Some(mut p) = pipe else { return buf };
        // Whole lines before this offset were looked at already.
        let mut seen = 0;
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            let n = match p.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            // Past the cap, keep reading (and dropping) so the writer never blocks.
            buf.extend_from_slice(&chunk[..n.min(cap.saturating_sub(buf.len()))]);
            while at_gate.is_some() {
                let Some(end) = buf[seen..].iter().position(|&b| b == b'\n') else {
                    break;
                };
                let line = &buf[seen..seen + end];
                seen += end + 1;
                if line.trim_ascii() == JUDGE_AT_GATE {
                    let _ = at_gate.take().map(|tx| tx.send(()));
                }
            }
        }
        buf
    })
}

pub(super) fn tail(bytes: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let chars: Vec<char> = text.chars().collect();
    chars[chars.len().saturating_sub(n)..].iter().collect()
}

pub(super) fn describe_exit(o: &Outcome) -> String {
    use std::os::unix::process::ExitStatusExt;
    match o.status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exit status {c}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            _ => "ended".into(),
        },
        None => "did not end".into(),
    }
}
