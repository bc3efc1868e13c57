//! `Bash`: one command in the sandbox, with a persistent working directory, capped output
//! and the whole session killed when the command ends or times out.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use env_api::observation::{BashData, StreamLayout, ToolData};
use tokio::io::AsyncReadExt;

use super::{ToolError, ToolOutput, Toolbox};
use crate::sandbox::{Outcome, SandboxedChild};

/// The wrapper records the final working directory on exit, whatever way the command ends.
const WRAPPER: &str = r#"trap 'pwd -P > "$CUDA_AGENT_CWD_FILE" 2>/dev/null' EXIT
eval "$1""#;

/// A command's wall time is capped at this many times its limit of charged time: time it
/// spends waiting for a CPU while none of its processes runs is not charged (the host's
/// load, not the agent's doing) and so does not bring its deadline closer, but a command
/// starved for ever must still end.
pub const WALL_CAP_FACTOR: u32 = 3;

/// Waits shorter than this are not worth a line in the observation.
const WAIT_WORTH_SAYING: Duration = Duration::from_millis(500);

/// Bytes kept from the start and from the end of a stream.
#[derive(Default)]
struct Capped {
    head: Vec<u8>,
    tail: Vec<u8>,
    total: usize,
}

impl Capped {
    fn push(&mut self, buf: &[u8], cap: usize) {
        self.total += buf.len();
        let room = cap.saturating_sub(self.head.len());
        let (to_head, rest) = buf.split_at(room.min(buf.len()));
        self.head.extend_from_slice(to_head);
        self.tail.extend_from_slice(rest);
        if self.tail.len() > 2 * cap {
            self.tail.drain(..self.tail.len() - cap);
        }
    }

    /// Renders at most `cap` characters: all of it when it fits, else the start and the end
    /// with a marker saying how much was cut.
    fn render(&self, cap: usize) -> (String, bool) {
        let mut all = self.head.clone();
        if self.total <= self.head.len() + self.tail.len() {
            all.extend_from_slice(&self.tail);
            let text = String::from_utf8_lossy(&all).into_owned();
            if text.chars().count() <= cap {
                return (text, false);
            }
        }
        let head = String::from_utf8_lossy(&self.head);
        let tail = String::from_utf8_lossy(&self.tail);
        let half = cap / 2;
        let head: String = head.chars().take(half).collect();
        let tail_chars: Vec<char> = tail.chars().collect();
        let tail: String = tail_chars[tail_chars.len().saturating_sub(half)..]
            .iter()
            .collect();
        let cut = self.total.saturating_sub(head.len() + tail.len());
        (
            format!("{head}\n[... {cut} bytes of output truncated ...]\n{tail}"),
            true,
        )
    }
}

/// A reader task that is cancelled with the step.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn read_capped<R: tokio::io::AsyncRead + Unpin>(mut r: R, cap: usize) -> Capped {
    let mut c = Capped::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => c.push(&buf[..n], cap),
        }
    }
    c
}

pub(super) async fn run(
    tb: &mut Toolbox,
    command: &str,
    timeout: Duration,
    by_budget: bool,
    may_raise_to: Option<Duration>,
) -> Result<ToolOutput, ToolError> {
    if command.trim().is_empty() {
        return Err(ToolError::InvalidArgument("command is empty".into()));
    }
    if timeout.is_zero() {
        return Err(ToolError::InvalidArgument(
            "no tool time is left in this episode (the tool-time budget is spent)".into(),
        ));
    }
    let cwd_file = tb.state_dir.join("bash.cwd");
    let (mut child, started) = spawn(tb, command, &cwd_file)?;
    let cap = tb.limits.max_output_chars;
    // Readers keep draining so a chatty process never blocks on a full pipe.
    let out_task = child
        .stdout
        .take()
        .map(|s| AbortOnDrop(tokio::spawn(read_capped(s, cap))));
    let err_task = child
        .stderr
        .take()
        .map(|s| AbortOnDrop(tokio::spawn(read_capped(s, cap))));
    // Whatever happened, nothing the command started outlives the step. Its deadline is in
    // charged time (wall time less its wait for a CPU), up to a cap in wall time.
    let outcome = child
        .wait_charged(timeout, timeout.saturating_mul(WALL_CAP_FACTOR))
        .await;
    let elapsed = started.elapsed();
    let cpu_wait = outcome.cpu_wait.min(elapsed);
    let stdout = collect(out_task).await;
    let stderr = collect(err_task).await;
    let exit_code = outcome.status.map(|s| {
        use std::os::unix::process::ExitStatusExt;
        s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
    });
    let cwd_note = follow_cwd(tb, &cwd_file);

    let (out_text, out_cut) = stdout.render(cap);
    let (err_text, err_cut) = stderr.render(cap);
    let mut text = out_text;
    if !err_text.is_empty() {
        end_line(&mut text);
        text.push_str("[stderr]\n");
        text.push_str(&err_text);
    }
    let limit = Limit {
        timeout,
        by_budget,
        may_raise_to,
    };
    if let Some(line) = ending(&outcome, exit_code, elapsed, &limit) {
        end_line(&mut text);
        text.push_str(&line);
    }
    if let Some(n) = cwd_note {
        text.push('\n');
        text.push_str(n);
    }
    if cpu_wait >= WAIT_WORTH_SAYING {
        tracing::debug!(
            wall_s = elapsed.as_secs_f64(),
            cpu_wait_s = cpu_wait.as_secs_f64(),
            "the host kept a command waiting for a CPU"
        );
        end_line(&mut text);
        text.push_str(&format!(
            "[the host was busy: {:.1} s of this command's {:.1} s were spent waiting for a CPU and not charged]",
            cpu_wait.as_secs_f64(),
            elapsed.as_secs_f64()
        ));
    }
    if text.is_empty() {
        text.push_str("(no output)");
    }
    let timed_out = outcome.timed_out;
    Ok(ToolOutput {
        text,
        is_error: timed_out || outcome.breach.is_some() || exit_code != Some(0),
        data: ToolData::Bash(BashData {
            breach: outcome.breach.map(|b| b.reason().to_string()),
            budget_cut: timed_out && by_budget,
            cwd: tb.workspace.display(&tb.cwd),
            duration_ms: elapsed.as_millis() as u64,
            exit_code,
            processes_killed: outcome.killed,
            stderr_bytes: stderr.total as u64,
            stdout: StreamLayout::Separate,
            stdout_bytes: stdout.total as u64,
            timed_out,
            truncated: out_cut || err_cut,
        })
        .into(),
        cpu_wait,
    })
}

/// Starts the command in the sandbox from the episode's working directory, the shell's exit
/// trap recording the directory it ended in (`cwd_file`); also when it started.
fn spawn(
    tb: &Toolbox,
    command: &str,
    cwd_file: &Path,
) -> Result<(SandboxedChild, Instant), ToolError> {
    let _ = std::fs::remove_file(cwd_file);
    let mut jail = tb.jail.clone();
    jail.env
        .push(("CUDA_AGENT_CWD_FILE".into(), cwd_file.to_path_buf().into()));
    // The recorded directory is the agent's to shape (it can write the record): it is kept
    // only while it is a directory beneath the workspace reached without a link.
    let cwd = match tb.cwd.strip_prefix(tb.workspace.root()) {
        Ok(rel) if rel.as_os_str().is_empty() || tb.workspace.open_dir(rel).is_ok() => {
            tb.cwd.clone()
        }
        _ => tb.workspace.root().to_path_buf(),
    };
    let args: Vec<OsString> = vec![
        "--noprofile".into(),
        "--norc".into(),
        "-c".into(),
        WRAPPER.into(),
        "bash".into(),
        command.into(),
    ];
    let sc = tb
        .sandbox
        .command(&jail, Path::new("/bin/bash"), &args, &cwd)?;
    let started = Instant::now();
    // Dropping the child (the step's future cancelled, say by a client that went away) kills
    // the command and everything it started.
    let child = sc
        .spawn()
        .map_err(|e| ToolError::io(Path::new("/bin/bash"), e))?;
    Ok((child, started))
}

/// What a reader collected, waiting a little for the last of it (a grandchild may hold the
/// pipe open after the command was killed).
async fn collect(t: Option<AbortOnDrop<Capped>>) -> Capped {
    match t {
        Some(mut t) => tokio::time::timeout(Duration::from_secs(5), &mut t.0)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default(),
        None => Capped::default(),
    }
}

/// Takes the directory the command ended in as the episode's working directory when it is
/// inside the workspace; else goes back to the workspace root and says so.
fn follow_cwd(tb: &mut Toolbox, cwd_file: &Path) -> Option<&'static str> {
    let new_cwd =
        crate::workspace::read_state_file(cwd_file, 8192).map(|s| PathBuf::from(s.trim_end()))?;
    if new_cwd.starts_with(tb.workspace.root()) {
        tb.cwd = new_cwd;
        None
    } else {
        tb.cwd = tb.workspace.root().to_path_buf();
        Some("[working directory was outside the workspace; reset to the workspace root]")
    }
}

/// The call's time limit and where it came from.
struct Limit {
    timeout: Duration,
    /// The episode's remaining tool-time budget set it, not the call.
    by_budget: bool,
    /// The largest `timeout` the call could have asked for instead, if larger.
    may_raise_to: Option<Duration>,
}

/// The line that says why the command ended, unless it simply exited 0: a limit it broke,
/// the wall-clock cap, the budget, its timeout, or its exit code.
fn ending(
    outcome: &Outcome,
    exit_code: Option<i32>,
    elapsed: Duration,
    limit: &Limit,
) -> Option<String> {
    let timeout_s = limit.timeout.as_secs_f64();
    if let Some(b) = outcome.breach {
        return Some(format!(
            "[stopped: {b}; the command and every process it started were killed]"
        ));
    }
    if outcome.wall_capped {
        return Some(format!(
            "[stopped after {:.1} s of wall time, {WALL_CAP_FACTOR}x its {timeout_s:.1} s limit, before its tool time ran out: the host kept it waiting for a CPU; the command and every process it started were killed]",
            elapsed.as_secs_f64(),
        ));
    }
    if outcome.timed_out && limit.by_budget {
        return Some(format!(
            "[cut after {timeout_s:.1} s: the episode's tool-time budget ran out; the command and every process it started were killed]"
        ));
    }
    if outcome.timed_out {
        let raise = match limit.may_raise_to {
            Some(max) => format!(
                "; a longer command needs a larger `timeout` (milliseconds, at most {})",
                max.as_millis()
            ),
            None => String::new(),
        };
        return Some(format!(
            "[timed out after {timeout_s:.1} s; the command and every process it started were killed{raise}]"
        ));
    }
    exit_code
        .filter(|c| *c != 0)
        .map(|code| format!("[exit code {code}{}]", signal_note(code)))
}

/// Ends the text's last line, if it has an unfinished one, so the next note starts a line.
fn end_line(text: &mut String) {
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
}

/// What an exit code above 128 means (a process killed by a signal, as the shell reports it),
/// with a pointer to the traceback a Python crash prints.
fn signal_note(code: i32) -> String {
    let name = match code - 128 {
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        15 => "SIGTERM",
        _ => return String::new(),
    };
    let hint = match name {
        "SIGKILL" => "; out of memory or a limit?",
        "SIGTERM" => "",
        _ => "; a Python process prints its traceback above (faulthandler)",
    };
    format!(": killed by {name}{hint}")
}

#[cfg(test)]
mod tests {
    use super::Capped;

    #[test]
    fn signals_are_named() {
        assert_eq!(
            super::signal_note(139),
            ": killed by SIGSEGV; a Python process prints its traceback above (faulthandler)"
        );
        assert_eq!(super::signal_note(1), "");
        assert_eq!(super::signal_note(130), "");
    }

    #[test]
    fn short_output_is_kept_whole() {
        let mut c = Capped::default();
        c.push(b"hello\n", 100);
        assert_eq!(c.render(100), ("hello\n".to_string(), false));
    }

    #[test]
    fn long_output_keeps_head_and_tail() {
        let mut c = Capped::default();
        for i in 0..10_000 {
            c.push(format!("line {i}\n").as_bytes(), 1000);
        }
        let (text, cut) = c.render(1000);
        assert!(cut);
        assert!(text.starts_with("line 0\n"));
        assert!(text.trim_end().ends_with("line 9999"));
        assert!(text.contains("bytes of output truncated"));
        assert!(text.len() < 1100);
    }

    /// Each way a command ends has its line, in the order the observation checks them.
    #[test]
    fn the_ending_line_says_why_in_order() {
        use super::{ending, Limit, Outcome};
        use crate::sandbox::Breach;
        use std::time::Duration;
        let ended = |code: i32| Outcome {
            status: Some(std::os::unix::process::ExitStatusExt::from_raw(code << 8)),
            timed_out: false,
            breach: None,
            killed: 0,
            cpu_wait: Duration::ZERO,
            wall_capped: false,
        };
        let limit = |by_budget, may_raise_to| Limit {
            timeout: Duration::from_secs(120),
            by_budget,
            may_raise_to,
        };
        let secs = Duration::from_secs;
        assert_eq!(
            ending(&ended(0), Some(0), secs(1), &limit(false, None)),
            None
        );
        assert_eq!(
            ending(&ended(3), Some(3), secs(1), &limit(false, None)).as_deref(),
            Some("[exit code 3]")
        );
        let timed_out = Outcome {
            timed_out: true,
            status: None,
            ..ended(0)
        };
        assert_eq!(
            ending(&timed_out, None, secs(120), &limit(false, Some(secs(600)))).as_deref(),
            Some("[timed out after 120.0 s; the command and every process it started were killed; a longer command needs a larger `timeout` (milliseconds, at most 600000)]")
        );
        assert_eq!(
            ending(&timed_out, None, secs(120), &limit(false, None)).as_deref(),
            Some("[timed out after 120.0 s; the command and every process it started were killed]")
        );
        let budget = ending(&timed_out, None, secs(120), &limit(true, Some(secs(600)))).unwrap();
        assert!(
            budget.starts_with("[cut after 120.0 s: the episode's tool-time budget ran out"),
            "{budget}"
        );
        let capped = Outcome {
            wall_capped: true,
            ..timed_out
        };
        let line = ending(&capped, None, secs(360), &limit(true, None)).unwrap();
        assert!(
            line.starts_with("[stopped after 360.0 s of wall time, 3x its 120.0 s limit"),
            "{line}"
        );
        // A broken limit is named first, whatever else happened.
        let breach = Outcome {
            breach: Some(Breach::Memory),
            ..capped
        };
        let line = ending(&breach, Some(137), secs(5), &limit(false, None)).unwrap();
        assert!(
            line.starts_with("[stopped: ") && line.ends_with("were killed]"),
            "{line}"
        );
    }
}
