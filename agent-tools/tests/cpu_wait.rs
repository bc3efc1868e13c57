//! Tool time is what a command used, not what the host's load cost it: a command the host
//! keeps waiting for a CPU is charged less than its wall time and told so, one that runs
//! alone (or waits on its own threads) is charged its wall time, and a starved command is not
//! killed at its limit of wall time but at the cap.
//!
//! Each test makes its own contention: the test's thread pins itself to one CPU before it
//! starts busy-looping hog processes and the command (both inherit the affinity), so the
//! relations hold on an idle host and on a loaded one alike. Needs root (cgroups) and a
//! kernel with scheduler statistics; elsewhere the tests say why and pass.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use agent_tools::sandbox::CpuAccounting;
use agent_tools::ToolCall;
use common::{bash_data, fixture, Fixture};

/// Whether the sandbox measures waits here; prints why not otherwise.
fn measured(f: &Fixture) -> bool {
    let acc = f.toolbox.sandbox().status().cpu_accounting;
    if acc != CpuAccounting::Schedstat {
        eprintln!("skipped: this host charges wall time ({acc:?})");
    }
    acc == CpuAccounting::Schedstat
}

/// Pins the calling thread (and what it spawns from now on) to one CPU of its set.
fn pin_to_one_cpu() -> usize {
    // SAFETY: cpu_set_t is plain data; the calls get valid pointers and sizes.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
            0
        );
        let cpu = (0..libc::CPU_SETSIZE as usize)
            .rev()
            .find(|&c| libc::CPU_ISSET(c, &set))
            .expect("some CPU");
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one),
            0
        );
        cpu
    }
}

/// Busy-looping processes at nice 0 (the command runs at nice 0 too), each in its own
/// session, killed when dropped.
struct Hogs(Vec<Child>);

impl Hogs {
    fn start(n: usize) -> Self {
        Self(
            (0..n)
                .map(|_| {
                    let mut c = Command::new("/bin/sh");
                    c.args(["-c", "while :; do :; done"]);
                    // A session each: the kernel weighs sessions (autogroups) against each
                    // other, and the command has one of its own.
                    // SAFETY: setsid is async-signal-safe and touches no memory.
                    unsafe {
                        c.pre_exec(|| {
                            libc::setsid();
                            Ok(())
                        });
                    }
                    c.spawn().expect("hog starts")
                })
                .collect(),
        )
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn bash_within(f: &mut Fixture, command: &str, budget: Duration) -> agent_tools::ToolOutput {
    let call = ToolCall::parse("Bash", &serde_json::json!({ "command": command })).expect("call");
    f.toolbox.run(&call, budget).await
}

#[tokio::test]
async fn a_command_the_host_starves_is_charged_less_than_its_wall_time_and_told_so() {
    let mut f = fixture();
    if !measured(&f) {
        return;
    }
    let cpu = pin_to_one_cpu();
    let _hogs = Hogs::start(4);
    // A fixed amount of work: about a second alone, several under 4:1 contention.
    let out = bash_within(
        &mut f,
        "i=0; while [ $i -lt 150000 ]; do i=$((i+1)); done; echo done",
        Duration::from_secs(600),
    )
    .await;
    let wall = Duration::from_millis(bash_data(&out).duration_ms);
    let charged = wall.saturating_sub(out.cpu_wait);
    eprintln!(
        "cpu {cpu}: wall {wall:?}, waited {:?}, charged {charged:?}\n{}",
        out.cpu_wait, out.text
    );
    assert!(out.text.starts_with("done"), "{}", out.text);
    assert!(
        charged.as_secs_f64() < 0.6 * wall.as_secs_f64(),
        "a command given a fifth of a CPU is charged {charged:?} of {wall:?}"
    );
    assert!(
        out.text.contains("[the host was busy: ")
            && out.text.contains("waiting for a CPU and not charged]"),
        "{}",
        out.text
    );
}

#[tokio::test]
async fn a_command_that_runs_alone_is_charged_its_wall_time() {
    let mut f = fixture();
    if !measured(&f) {
        return;
    }
    let out = bash_within(&mut f, "sleep 3; echo done", Duration::from_secs(600)).await;
    let wall = Duration::from_millis(bash_data(&out).duration_ms);
    eprintln!("wall {wall:?}, waited {:?}", out.cpu_wait);
    assert!(out.text.starts_with("done"), "{}", out.text);
    assert!(
        out.cpu_wait.as_secs_f64() < 0.2 * wall.as_secs_f64(),
        "a sleeping command waited {:?} of {wall:?}",
        out.cpu_wait
    );
}

#[tokio::test]
async fn threads_that_wait_on_each_other_do_not_lower_their_commands_charge() {
    let mut f = fixture();
    if !measured(&f) {
        return;
    }
    let cpu = pin_to_one_cpu();
    // Eight busy loops on one CPU, each runnable for 3 s and waiting most of it, for each
    // other: nothing of the host held the command back but the host's own load on that CPU.
    charged_at_least_its_cpu_time(
        &mut f,
        cpu,
        "for k in 1 2 3 4 5 6 7 8; do ( end=$((SECONDS+3)); while [ $SECONDS -lt $end ]; do :; done ) & done; wait; times",
    )
    .await;
}

/// Runs `script` (which ends with `times`, so that its output says the CPU time its children
/// used) and asserts the command is charged at least 0.8 of that CPU time: what ran was its
/// progress, whatever its tasks' waits.
async fn charged_at_least_its_cpu_time(f: &mut Fixture, cpu: usize, script: &str) {
    let out = bash_within(f, script, Duration::from_secs(600)).await;
    let wall = Duration::from_millis(bash_data(&out).duration_ms);
    let charged = wall.saturating_sub(out.cpu_wait);
    eprintln!(
        "cpu {cpu}: wall {wall:?}, waited {:?}, charged {charged:?}\n{}",
        out.cpu_wait, out.text
    );
    let used = children_cpu(&out.text);
    assert!(used > 0.3, "the loops used {used} s of CPU: {}", out.text);
    assert!(
        charged.as_secs_f64() >= 0.8 * used,
        "a command that used {used:.2} s of CPU on one CPU is charged {charged:?} of {wall:?}"
    );
}

#[tokio::test]
async fn a_starved_command_is_killed_at_the_wall_cap_not_at_its_limit_of_wall_time() {
    let mut f = fixture();
    if !measured(&f) {
        return;
    }
    let cpu = pin_to_one_cpu();
    let _hogs = Hogs::start(5);
    let budget = Duration::from_secs(2);
    let cap = budget * agent_tools::tools::WALL_CAP_FACTOR;
    let started = Instant::now();
    let out = bash_within(&mut f, "while :; do :; done", budget).await;
    let took = started.elapsed();
    let data = bash_data(&out);
    eprintln!(
        "cpu {cpu}: took {took:?}, waited {:?}\n{}",
        out.cpu_wait, out.text
    );
    assert!(data.timed_out, "{}", out.text);
    assert!(
        took >= budget.mul_f64(1.5),
        "a command given a sixth of a CPU was killed after {took:?}, its budget being {budget:?} of tool time"
    );
    assert!(
        took <= cap + Duration::from_secs(3),
        "a starved command ran {took:?}, past its cap of {cap:?}"
    );
    assert!(out.text.contains("[stopped after "), "{}", out.text);
}

#[tokio::test]
async fn work_done_by_processes_that_come_and_go_counts_as_progress() {
    let mut f = fixture();
    if !measured(&f) {
        return;
    }
    let cpu = pin_to_one_cpu();
    // A busy loop that waits for a CPU while short-lived processes, each gone before the
    // next sample, take it: their CPU time is the command's progress even though no sample
    // sees them (the cgroup counts it).
    charged_at_least_its_cpu_time(
        &mut f,
        cpu,
        "end=$((SECONDS+3)); ( while [ $SECONDS -lt $end ]; do :; done ) & while [ $SECONDS -lt $end ]; do /bin/sh -c 'i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done'; done; wait; times",
    )
    .await;
}

/// The CPU time of a shell's children from the output of `times` at its end: its last line
/// of two times ("0m2.871s 0m0.012s", user and system; the shell's own come first).
fn children_cpu(text: &str) -> f64 {
    let secs = |w: &str| -> Option<f64> {
        let (m, s) = w.strip_suffix('s')?.split_once('m')?;
        Some(m.parse::<f64>().ok()? * 60.0 + s.parse::<f64>().ok()?)
    };
    text.lines()
        .filter_map(|l| {
            let t: Vec<f64> = l.split_whitespace().map(secs).collect::<Option<_>>()?;
            (t.len() == 2).then(|| t.iter().sum())
        })
        .next_back()
        .expect("the output of times")
}
