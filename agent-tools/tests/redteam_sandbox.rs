//! Red-team suite of the sandbox's process, channel and quota boundaries: each test is an
//! attack a policy (or a crash) can mount, run for real, and the defence asserted.
//!
//! - processes outliving their owner: a dropped step, a dead server, a previous run;
//! - uids shared between episodes, runs or servers;
//! - channels out: named unix sockets anywhere on the host, other processes' command lines;
//! - quotas: the temp dir, inode counts, memory and processes across a whole command.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use agent_tools::sandbox::{
    CgroupVersion, CpuPriority, KernelFeatures, ProcessView, UidLease, UidPool, Volume,
    VolumeLimits, BACKGROUND_CPU_SHARES, BACKGROUND_CPU_WEIGHT,
};
use agent_tools::{
    create_private_dir, Jail, ResourceLimits, Sandbox, SandboxConfig, ToolCall, ToolLimits,
    ToolOutput, Toolbox, Workspace,
};
use common::bash_data;
use serde_json::json;

fn features() -> KernelFeatures {
    KernelFeatures::detect()
}

/// Host processes (not zombies) whose command line contains `marker`.
fn with_marker(marker: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(true);
        if !zombie
            && String::from_utf8_lossy(&cmdline)
                .replace('\0', " ")
                .contains(marker)
        {
            found.push(pid);
        }
    }
    found
}

/// Waits (bounded) until no process carries `marker`; returns the survivors.
async fn gone(marker: &str) -> Vec<i32> {
    for _ in 0..200 {
        if with_marker(marker).is_empty() {
            return Vec::new();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    with_marker(marker)
}

/// Waits (bounded) until `n` processes carry `marker`.
async fn started(marker: &str, n: usize) {
    for _ in 0..400 {
        if with_marker(marker).len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the processes marked {marker} never started");
}

/// One episode as the server makes it: a volume holding the workspace and its temp dir,
/// a leased uid, and a toolbox over them. Fields drop in order: tools, volume, uid, dir.
struct Episode {
    toolbox: Toolbox,
    sandbox: Sandbox,
    root: PathBuf,
    tmp: PathBuf,
    volume: Arc<Volume>,
    lease: Option<UidLease>,
    dir: tempfile::TempDir,
}

fn episode(limits: ResourceLimits, quota: VolumeLimits, view: ProcessView) -> Episode {
    episode_with(limits, quota, view, true)
}

/// An episode whose sandbox uses cgroups or not (to exercise the fallbacks).
fn episode_with(
    limits: ResourceLimits,
    quota: VolumeLimits,
    view: ProcessView,
    cgroups: bool,
) -> Episode {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let (py_bin, py_prefixes) = common::python_dirs();
    let mut config = SandboxConfig::with_toolchains(py_prefixes);
    config.limits = limits;
    config.cgroups = cgroups;
    let sandbox = Sandbox::new(config).expect("sandbox");
    let lease = sandbox.lease_uid().expect("uid lease");
    let owner = lease.as_ref().map(UidLease::owner);
    let volume = Arc::new(Volume::create(&dir.path().join("ep"), quota).expect("volume"));
    let root = volume.path().join("workspace");
    let tmp = volume.path().join("tmp");
    create_private_dir(&root, owner).expect("workspace");
    create_private_dir(&tmp, owner).expect("tmp");
    let ws = Workspace::open(&root, owner).expect("workspace");
    let path = vec![
        py_bin,
        PathBuf::from("/usr/local/bin"),
        PathBuf::from("/usr/bin"),
        PathBuf::from("/bin"),
    ];
    let mut jail = Jail::standard(ws.root(), &tmp, &path, &[], owner);
    jail.process_view = view;
    jail.volume = Some(volume.clone());
    let toolbox = Toolbox::new(
        sandbox.clone(),
        ws,
        jail,
        tmp.clone(),
        ToolLimits::default(),
    );
    let root = toolbox.workspace().root().to_path_buf();
    Episode {
        toolbox,
        sandbox,
        root,
        tmp,
        volume,
        lease,
        dir,
    }
}

impl Episode {
    fn new() -> Self {
        episode(
            ResourceLimits::default(),
            VolumeLimits::bytes(256 << 20),
            ProcessView::Private,
        )
    }

    async fn call(&mut self, tool: &str, args: serde_json::Value) -> ToolOutput {
        let call = ToolCall::parse(tool, &args).expect("valid call");
        self.toolbox.run(&call, Duration::from_secs(600)).await
    }

    async fn bash(&mut self, command: &str) -> ToolOutput {
        self.call("Bash", json!({"command": command})).await
    }
}

// ---------------------------------------------------------------------------------------
// Processes die with their owner.
// ---------------------------------------------------------------------------------------

/// A client disconnects mid-step: the server drops the step's future. Every process of the
/// step must die, not only the shell tokio was told to kill on drop; also where the host
/// offers no pid namespace or cgroup (the fallbacks).
#[tokio::test]
async fn a_dropped_step_takes_every_process_with_it() {
    for (i, (view, cgroups)) in [
        (ProcessView::Private, true),
        (ProcessView::OwnUid, false),
        (ProcessView::Host, false),
        (ProcessView::Host, true),
    ]
    .into_iter()
    .enumerate()
    {
        let mut ep = episode_with(
            ResourceLimits::default(),
            VolumeLimits::bytes(64 << 20),
            view,
            cgroups,
        );
        let marker = format!("7001.{i}151");
        let cmd = format!("sleep {marker} & setsid sleep {marker} 2>/dev/null & nohup sleep {marker} >/dev/null 2>&1 & (trap '' TERM; sleep {marker}) & sleep {marker}");
        let call = ToolCall::parse("Bash", &json!({"command": cmd})).expect("call");
        {
            let step = ep.toolbox.run(&call, Duration::from_secs(600));
            tokio::pin!(step);
            tokio::select! {
                _ = &mut step => panic!("the step ended on its own"),
                _ = started(&marker, 4) => {}
            }
            // The step's future is dropped here, as axum drops a handler whose client left.
        }
        assert_eq!(
            gone(&marker).await,
            Vec::<i32>::new(),
            "{view:?}, cgroups {cgroups}: processes of a dropped step survived it"
        );
    }
}

/// The server dies (here: `sandbox-exec`, killed with SIGKILL, so no destructor runs). The
/// command and everything it started must die with it, whatever layers the host offers.
#[tokio::test]
async fn processes_die_with_the_server() {
    let uid = (400_000 + std::process::id() % 1000 * 4).to_string();
    let variants: Vec<Vec<&str>> = vec![
        vec![],
        vec!["--view", "host", "--no-cgroups", "--uid", &uid],
        vec!["--view", "own-uid", "--no-cgroups", "--uid", &uid],
    ];
    for (i, flags) in variants.into_iter().enumerate() {
        if !features().can_switch_uid && !flags.is_empty() {
            continue;
        }
        let marker = format!("7002.{i}151");
        let script = format!(
            "sleep {marker} & (sleep {marker} &) ; python3 -c 'import os,time\nos.setpgid(0,0)\ntime.sleep({marker})' & sleep {marker}"
        );
        let mut server = tokio::process::Command::new(env!("CARGO_BIN_EXE_sandbox-exec"))
            .args(&flags)
            .args(["--", "/bin/sh", "-c", &script])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("sandbox-exec runs");
        started(&marker, 4).await;
        server.start_kill().expect("kill");
        let _ = server.wait().await;
        assert_eq!(
            gone(&marker).await,
            Vec::<i32>::new(),
            "{flags:?}: processes outlived the server that started them"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Uids are never shared.
// ---------------------------------------------------------------------------------------

/// Starts `sleep <marker>` as `uid`, outside any sandbox: a process a previous run left.
fn leftover_as(uid: u32, marker: &str) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    std::process::Command::new("sleep")
        .arg(marker)
        .uid(uid)
        .gid(uid)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn as uid")
}

#[tokio::test]
async fn a_uid_with_a_live_process_or_another_servers_lock_is_never_leased() {
    if !features().can_switch_uid {
        eprintln!("skipped: uids are leased only when the server runs as root");
        return;
    }
    let locks = tempfile::tempdir().expect("tempdir");
    // A previous run's process still runs as the first uid of the range.
    let base = 300_000 + std::process::id() % 1000 * 8;
    let mut leftover = leftover_as(base, "7004.5151");
    let a = UidPool::new(locks.path(), base..base + 4).expect("pool");
    let b = UidPool::new(locks.path(), base..base + 4).expect("pool"); // another server
    let mut held = Vec::new();
    for pool in [&a, &b, &a] {
        held.push(pool.acquire().expect("a free uid"));
    }
    let uids: Vec<u32> = held.iter().map(UidLease::uid).collect();
    assert!(
        !uids.contains(&base),
        "leased a uid a live process runs as: {uids:?}"
    );
    let mut sorted = uids.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 3, "two leases share a uid: {uids:?}");
    // The range is exhausted: neither server gets one, rather than a shared one.
    assert!(matches!(
        b.acquire(),
        Err(agent_tools::SandboxError::NoFreeUid { .. })
    ));
    let _ = leftover.kill();
    let _ = leftover.wait();
}

#[tokio::test]
async fn an_evaluation_gets_two_distinct_uids_and_a_released_uid_is_emptied() {
    if !features().can_switch_uid {
        eprintln!("skipped: uids are leased only when the server runs as root");
        return;
    }
    let locks = tempfile::tempdir().expect("tempdir");
    let base = 310_000 + std::process::id() % 1000 * 8;
    let pool = UidPool::new(locks.path(), base..base + 2).expect("pool");
    let (judge, worker) = pool.acquire_pair().expect("two uids");
    assert_ne!(judge.uid(), worker.uid());
    let marker = "7005.5151";
    let mut child = leftover_as(worker.uid(), marker);
    drop(worker);
    let _ = child.wait();
    assert_eq!(
        gone(marker).await,
        Vec::<i32>::new(),
        "a process outlived its uid's lease"
    );
}

/// What a crashed server left (processes under unleased uids of the range) is killed by the
/// sweep a new server runs at start; a uid another live server holds is left alone.
#[tokio::test]
async fn the_start_sweep_kills_what_a_previous_run_left() {
    if !features().can_switch_uid {
        eprintln!("skipped: uids are leased only when the server runs as root");
        return;
    }
    let locks = tempfile::tempdir().expect("tempdir");
    let base = 320_000 + std::process::id() % 1000 * 8;
    let mut config = SandboxConfig::with_toolchains(Vec::new());
    config.uid_lock_dir = locks.path().to_path_buf();
    config.uid_range = base..base + 4;
    let other_server = UidPool::new(locks.path(), base..base + 4).expect("pool");
    let held = other_server.acquire().expect("uid");
    let orphan_uid = (base..base + 4)
        .find(|u| *u != held.uid())
        .expect("another uid");
    let mut orphan = leftover_as(orphan_uid, "7006.5151");
    let mut live = leftover_as(held.uid(), "7006.6161");
    let sandbox = Sandbox::new(config).expect("sandbox");
    let report = sandbox.sweep_leftovers();
    assert!(report.processes_killed >= 1, "{report:?}");
    let _ = orphan.wait();
    assert_eq!(
        gone("7006.5151").await,
        Vec::<i32>::new(),
        "a previous run's process survived the sweep"
    );
    assert_eq!(
        with_marker("7006.6161").len(),
        1,
        "the sweep killed a live server's process"
    );
    let _ = live.kill();
    let _ = live.wait();
}

// ---------------------------------------------------------------------------------------
// No channel out.
// ---------------------------------------------------------------------------------------

/// A named unix socket anywhere on the host, world-connectable: the sandbox must not reach
/// it, by stream or by datagram (a datagram socket pair can address any named socket).
#[tokio::test]
async fn named_unix_sockets_outside_cannot_be_reached() {
    let mut ep = Episode::new();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let stream_path = dir.path().join("host.sock");
    let dgram_path = dir.path().join("host.dgram");
    let listener = std::os::unix::net::UnixListener::bind(&stream_path).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let dgram = std::os::unix::net::UnixDatagram::bind(&dgram_path).expect("bind");
    dgram.set_nonblocking(true).expect("nonblocking");
    for p in [&stream_path, &dgram_path] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    }
    // A sequenced-packet listener too: the jail may make such sockets (CUDA's driver needs
    // them), so connect() itself must be what stops it.
    let seq_path = dir.path().join("host.seq");
    let seq = seqpacket_listener(&seq_path);
    std::fs::set_permissions(&seq_path, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let script = format!(
        r#"
import socket
for name, make in [("stream", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)),
                   ("dgram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)),
                   ("seqpacket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))]:
    try:
        s = make()
        s.connect({{"stream": "{stream}", "dgram": "{dgram}", "seqpacket": "{seq}"}}[name])
        s.send(b"leak")
        print(name, "REACHED")
    except OSError as e:
        print(name, "denied", e.errno)
try:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.sendto(b"leak", "{dgram}")
    print("pair-dgram REACHED")
except OSError as e:
    print("pair-dgram denied", e.errno)
a, b = socket.socketpair()
a.send(b"x")
print("pair-stream", b.recv(1))
socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC).close()
print("seqpacket-socket made")
"#,
        stream = stream_path.display(),
        dgram = dgram_path.display(),
        seq = seq_path.display()
    );
    std::fs::write(ep.root.join("probe.py"), script).expect("write");
    let out = ep.bash("python3 probe.py").await;
    assert!(!out.text.contains("REACHED"), "{}", out.text);
    assert!(
        out.text.contains("pair-stream b'x'"),
        "socketpair must keep working: {}",
        out.text
    );
    // CUDA's driver makes two of these in cuInit and fails without them.
    assert!(
        out.text.contains("seqpacket-socket made"),
        "AF_UNIX sequenced-packet sockets must still be made: {}",
        out.text
    );
    assert!(
        listener.accept().is_err(),
        "the host accepted a connection from inside"
    );
    let mut buf = [0u8; 16];
    assert!(
        dgram.recv(&mut buf).is_err(),
        "the host received a datagram from inside"
    );
    // SAFETY: accept on a valid non-blocking listening socket; null address arguments.
    let conn = unsafe { libc::accept(seq, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert!(
        conn < 0,
        "the host accepted a sequenced-packet connection from inside"
    );
    // SAFETY: closing the descriptor this test opened.
    unsafe { libc::close(seq) };
}

/// A non-blocking AF_UNIX sequenced-packet socket listening at `path` (std has none).
fn seqpacket_listener(path: &std::path::Path) -> libc::c_int {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: plain socket calls on a zeroed sockaddr_un whose path fits (checked).
    unsafe {
        let fd = libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        );
        assert!(fd >= 0, "socket");
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = path.as_os_str().as_bytes();
        assert!(bytes.len() < addr.sun_path.len(), "socket path too long");
        for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        assert_eq!(
            libc::bind(fd, (&addr as *const libc::sockaddr_un).cast(), len),
            0,
            "bind"
        );
        assert_eq!(libc::listen(fd, 4), 0, "listen");
        fd
    }
}

/// The server's command line (with whatever secret it was given) and other episodes'
/// processes are invisible from inside.
#[tokio::test]
async fn other_processes_and_their_command_lines_are_invisible() {
    for view in [ProcessView::Private, ProcessView::OwnUid] {
        let mut ep = episode(
            ResourceLimits::default(),
            VolumeLimits::bytes(64 << 20),
            view,
        );
        if ep.sandbox.effective_view(view) != view {
            eprintln!("skipped {view:?}: not available on this host");
            continue;
        }
        let secret = format!("--api-key=s3cret{}{:?}", std::process::id(), view);
        // The server's own command line, secret included (as an argv that stays visible).
        let mut host = std::process::Command::new("python3")
            .args(["-c", "import time; time.sleep(7007.5151)", &secret])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn");
        started("7007.5151", 1).await;
        // Another episode's process, running meanwhile.
        let other = Episode::new();
        let mut neighbour = other
            .sandbox
            .command(
                &other.toolbox_jail(),
                Path::new("/bin/sleep"),
                &["7007.6161".into()],
                &other.root,
            )
            .expect("command")
            .spawn()
            .expect("spawn");
        started("7007.6161", 1).await;
        let out = ep.bash("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; echo; ls /proc | grep -c '^[0-9]'").await;
        assert!(
            !out.text.contains("s3cret"),
            "{view:?}: the server's argv is readable: {}",
            out.text
        );
        assert!(
            !out.text.contains("7007.5151"),
            "{view:?}: a host process is visible: {}",
            out.text
        );
        assert!(
            !out.text.contains("7007.6161"),
            "{view:?}: another episode's process is visible: {}",
            out.text
        );
        assert!(
            out.text.contains("cat /proc"),
            "{view:?}: its own processes must stay visible: {}",
            out.text
        );
        let _ = host.kill();
        let _ = host.wait();
        neighbour.kill_all().await;
    }
}

/// Sandboxed processes (say a judge and a worker) talk over FIFOs the server made in a
/// directory all of them see, whatever their process view; the judge, in the host's view,
/// reads the worker's CPU time from /proc/<pid>/stat (the worker keeps host pids).
#[tokio::test]
async fn fifos_and_proc_stat_work_between_jails() {
    let ep_private = Episode::new();
    let ep_worker = episode(
        ResourceLimits::default(),
        VolumeLimits::bytes(64 << 20),
        ProcessView::OwnUid,
    );
    let ep_judge = episode(
        ResourceLimits::default(),
        VolumeLimits::bytes(64 << 20),
        ProcessView::Host,
    );
    let shared = ep_judge.dir.path().join("shared");
    std::fs::create_dir(&shared).expect("shared");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let fifos = [shared.join("from-private"), shared.join("from-worker")];
    for fifo in &fifos {
        let c = std::ffi::CString::new(fifo.to_str().expect("utf8")).expect("cstr");
        // SAFETY: NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
        std::fs::set_permissions(fifo, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    }
    // The system's interpreter: other uids cannot run one under root's home (pyenv).
    let python = PathBuf::from("/usr/bin/python3");
    let writer = |ep: &Episode, fifo: &Path| {
        let mut jail = ep.toolbox_jail();
        jail.writable.push(shared.clone());
        let code = format!(
            "import os\nwith open('{}', 'w') as f: f.write(str(os.getpid()) + ' hello')\nimport time\ntime.sleep(0.5)",
            fifo.display()
        );
        ep.sandbox
            .command(&jail, &python, &["-c".into(), code.into()], &ep.root)
            .expect("command")
            .spawn()
            .expect("spawn")
    };
    let mut judge_jail = ep_judge.toolbox_jail();
    judge_jail.read_only.push(shared.clone());
    let judge_code = format!(
        "with open('{}') as f: print(f.read().split()[1])\nwith open('{}') as f: pid, msg = f.read().split()\nprint(msg)\nprint('stat', len(open('/proc/%s/stat' % pid).read().split()) > 20)",
        fifos[0].display(),
        fifos[1].display()
    );
    let mut judge = ep_judge
        .sandbox
        .command(
            &judge_jail,
            &python,
            &["-c".into(), judge_code.into()],
            &ep_judge.root,
        )
        .expect("command")
        .spawn()
        .expect("judge");
    let mut private = writer(&ep_private, &fifos[0]);
    let mut worker = writer(&ep_worker, &fifos[1]);
    let mut out = String::new();
    let mut judge_out = judge.stdout.take().expect("stdout");
    let read = async {
        use tokio::io::AsyncReadExt;
        judge_out.read_to_string(&mut out).await
    };
    let (_, jo, po, wo) = tokio::join!(
        read,
        judge.wait_within(Duration::from_secs(60)),
        private.wait_within(Duration::from_secs(60)),
        worker.wait_within(Duration::from_secs(60))
    );
    assert_eq!(jo.status.and_then(|s| s.code()), Some(0), "judge: {out}");
    assert_eq!(po.status.and_then(|s| s.code()), Some(0));
    assert_eq!(wo.status.and_then(|s| s.code()), Some(0));
    assert_eq!(out, "hello\nhello\nstat True\n");
}

impl Episode {
    fn toolbox_jail(&self) -> Jail {
        let path = vec![PathBuf::from("/usr/bin"), PathBuf::from("/bin")];
        let mut j = Jail::standard(
            &self.root,
            &self.tmp,
            &path,
            &[],
            self.lease.as_ref().map(UidLease::owner),
        );
        j.volume = Some(self.volume.clone());
        j
    }
}

// ---------------------------------------------------------------------------------------
// The CPU: background work cannot take the share of an evaluation holding a device.
// ---------------------------------------------------------------------------------------

/// The cgroup of the CPU controller's hierarchy (v1) or the unified one (v2) among the lines
/// of a `/proc/<pid>/cgroup`.
fn cpu_cgroup<'a>(lines: impl Iterator<Item = &'a str>, version: CgroupVersion) -> Option<&'a str> {
    lines.into_iter().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctl, path) = (f.next()?, f.next()?, f.next()?);
        let hit = match version {
            CgroupVersion::V1 => ctl.split(',').any(|c| c == "cpu"),
            CgroupVersion::V2 => ctl.is_empty(),
        };
        hit.then_some(path)
    })
}

/// Runs `script` with bash in `jail` and returns its stdout and exit code.
async fn run_in(ep: &Episode, jail: &Jail, script: &str) -> (String, Option<i32>) {
    use tokio::io::AsyncReadExt;
    let mut child = ep
        .sandbox
        .command(
            jail,
            Path::new("/bin/bash"),
            &["-c".into(), script.into()],
            &ep.root,
        )
        .expect("command")
        .spawn()
        .expect("spawn");
    let mut out = String::new();
    let mut stdout = child.stdout.take().expect("stdout");
    let (_, outcome) = tokio::join!(
        stdout.read_to_string(&mut out),
        child.wait_within(Duration::from_secs(60))
    );
    (out, outcome.status.and_then(|s| s.code()))
}

/// The agent's commands and candidate builds run in the background: a hostile one tries to
/// win back the CPU by lowering its nice value (renice, setpriority), by resetting its
/// session's autogroup, by starting a new session (a new autogroup at nice 0), and by
/// leaving its CPU cgroup. Every attempt fails; a normal jail (the judge's) keeps nice 0.
#[tokio::test]
async fn a_background_command_cannot_raise_its_cpu_share() {
    let ep = Episode::new();
    let mut jail = ep.toolbox_jail();
    jail.cpu = CpuPriority::Background;
    let nice_of_self = "read -r -a st < /proc/self/stat; echo \"nice ${st[18]}\"";
    let script = format!(
        "{nice_of_self}
renice -n 0 -p $$ >/dev/null 2>&1 && echo renice-worked
python3 -c 'import os; os.setpriority(os.PRIO_PROCESS, 0, 0)' 2>/dev/null && echo setpriority-worked
python3 -c 'import os; os.nice(-5)' 2>/dev/null && echo nice-worked
if [ -e /proc/self/autogroup ]; then
    # The kernel answers EAGAIN to a write within 100 ms of any other: retry past that, so
    # that only a real refusal passes.
    for _ in 1 2 3 4 5; do
        if echo 0 2>/dev/null > /proc/self/autogroup; then echo autogroup-worked; break; fi
        sleep 0.2
    done
    grep -q 'nice 10' /proc/self/autogroup && echo autogroup-nice-10
fi
python3 -c 'import os; os.setsid()' 2>/dev/null && echo setsid-worked
for f in $(cut -d: -f3 /proc/self/cgroup | sort -u); do
    for m in /sys/fs/cgroup /sys/fs/cgroup/cpu /sys/fs/cgroup/cpu,cpuacct /sys/fs/cgroup/unified; do
        [ -w \"$m$f/../cgroup.procs\" ] && echo $$ 2>/dev/null > \"$m$f/../cgroup.procs\" && echo cgroup-left
    done
done
{nice_of_self}"
    );
    let (out, code) = run_in(&ep, &jail, &script).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        !out.contains("worked"),
        "a background command raised its share:\n{out}"
    );
    assert!(
        !out.contains("cgroup-left"),
        "a background command left its cgroup:\n{out}"
    );
    let nices: Vec<&str> = out.lines().filter(|l| l.starts_with("nice ")).collect();
    assert_eq!(nices, ["nice 10", "nice 10"], "{out}");
    if std::path::Path::new("/proc/self/autogroup").exists() {
        assert!(
            out.contains("autogroup-nice-10"),
            "the session's autogroup kept nice 0:\n{out}"
        );
    }

    let normal = ep.toolbox_jail();
    let (out, code) = run_in(&ep, &normal, nice_of_self).await;
    assert_eq!((out.trim(), code), ("nice 0", Some(0)));
}

/// Where the host has a CPU controller, a background command's cgroup has the low weight
/// (read from outside while the command runs, where the server wrote it).
#[tokio::test]
async fn a_background_command_has_the_low_cpu_weight() {
    use tokio::io::AsyncBufReadExt;
    let ep = Episode::new();
    let Some(version) = ep.sandbox.status().kernel.cgroups.cpu else {
        eprintln!("skipped: no CPU cgroup controller on this host (background commands rely on their nice value)");
        return;
    };
    let mut jail = ep.toolbox_jail();
    jail.cpu = CpuPriority::Background;
    let mut child = ep
        .sandbox
        .command(
            &jail,
            Path::new("/bin/bash"),
            &[
                "-c".into(),
                "cat /proc/self/cgroup; echo end; sleep 30".into(),
            ],
            &ep.root,
        )
        .expect("command")
        .spawn()
        .expect("spawn");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut membership = Vec::new();
    while let Some(l) = lines.next_line().await.expect("read") {
        if l == "end" {
            break;
        }
        membership.push(l);
    }
    let path = cpu_cgroup(membership.iter().map(String::as_str), version)
        .map(|p| p.trim_start_matches('/').to_string())
        .expect("a cpu cgroup line");
    assert!(
        path.contains("cuda-agent."),
        "not in a command cgroup: {membership:?}"
    );
    let (file, want) = match version {
        CgroupVersion::V2 => ("cpu.weight", BACKGROUND_CPU_WEIGHT),
        CgroupVersion::V1 => ("cpu.shares", BACKGROUND_CPU_SHARES),
    };
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let weight = mounts
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let left: Vec<&str> = left.split_whitespace().collect();
            let mut r = right.split_whitespace();
            let fstype = r.next()?;
            let opts = r.nth(1).unwrap_or("");
            let wanted = match version {
                CgroupVersion::V1 => fstype == "cgroup" && opts.split(',').any(|o| o == "cpu"),
                CgroupVersion::V2 => fstype == "cgroup2",
            };
            // The mount's root within the hierarchy, then where it is mounted.
            let rel = path.strip_prefix(left.get(3)?.trim_start_matches('/'))?;
            let mountpoint = PathBuf::from(left.get(4)?);
            wanted.then(|| mountpoint.join(rel.trim_start_matches('/')))
        })
        .find_map(|dir| std::fs::read_to_string(dir.join(file)).ok())
        .expect("the command's cpu weight file");
    child.kill_all().await;
    assert_eq!(weight.trim(), want.to_string(), "{file} of {path}");
}

/// A jail that runs CUDA needs `/proc` writable, so its background command can set its
/// session's autogroup back to nice 0. What it must not gain by that: where the host has a
/// CPU controller, the command sits in a CPU cgroup of its own (autogroups weigh only tasks
/// of the root group); everywhere, its processes keep nice 10.
#[tokio::test]
async fn a_cuda_command_that_resets_its_autogroup_keeps_its_low_priority() {
    let ep = Episode::new();
    let mut jail = ep.toolbox_jail();
    jail.cpu = CpuPriority::Background;
    jail.cuda = true;
    let script = "read -r -a st < /proc/self/stat; echo \"nice ${st[18]}\"
for _ in 1 2 3 4 5; do
    if echo 0 2>/dev/null > /proc/self/autogroup; then echo autogroup-reset; break; fi
    sleep 0.2
done
cat /proc/self/cgroup";
    let (out, code) = run_in(&ep, &jail, script).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.starts_with("nice 10\n"), "{out}");
    let Some(version) = ep.sandbox.status().kernel.cgroups.cpu else {
        eprintln!("no CPU controller: the CUDA command's session competes at nice 0 ({out})");
        return;
    };
    let cpu_group = cpu_cgroup(out.lines(), version).unwrap_or("");
    assert!(
        cpu_group.contains("cuda-agent."),
        "the command is in the root CPU group, where its autogroup counts: {out}"
    );
}

// ---------------------------------------------------------------------------------------
// Quotas cover everything and hold while a command runs.
// ---------------------------------------------------------------------------------------

/// The temp dir counts against the quota, and a command filling it is stopped then, not
/// after the step; the result says why.
#[tokio::test]
async fn the_temp_dir_counts_and_a_full_quota_ends_the_command() {
    let mut ep = episode(
        ResourceLimits::default(),
        VolumeLimits::bytes(32 << 20),
        ProcessView::Private,
    );
    let out = ep
        .call("Bash", json!({"command": "head -c 200000000 /dev/zero > \"$TMPDIR/fill\"; echo wrote; sleep 7008.5151", "timeout": 300000}))
        .await;
    assert_eq!(
        bash_data(&out).breach.as_deref(),
        Some("disk_quota"),
        "{}",
        out.text
    );
    assert!(!bash_data(&out).timed_out, "{}", out.text);
    assert!(out.text.contains("disk quota"), "{}", out.text);
    let size = std::fs::metadata(ep.tmp.join("fill"))
        .map(|m| m.len())
        .unwrap_or(0);
    assert!(
        size <= 32 << 20,
        "{size} bytes written against a 32 MiB quota"
    );
    assert!(ep.volume.usage().bytes <= 32 << 20);
    assert_eq!(gone("7008.5151").await, Vec::<i32>::new());
}

/// Many empty files (which slow every later walk of the workspace) hit the inode quota.
#[tokio::test]
async fn empty_files_hit_the_inode_quota() {
    let mut ep = episode(
        ResourceLimits::default(),
        VolumeLimits {
            bytes: 64 << 20,
            inodes: 500,
        },
        ProcessView::Private,
    );
    let out = ep.bash("python3 -c 'import os\nfor i in range(5000): open(\"f%d\" % i, \"w\").close()'; ls | wc -l").await;
    assert_eq!(
        bash_data(&out).breach.as_deref(),
        Some("inode_quota"),
        "{}",
        out.text
    );
    assert!(ep.volume.usage().inodes <= 500);
}

/// Many processes, each under the per-process memory limit, together past the command's.
#[tokio::test]
async fn memory_across_all_processes_is_bounded() {
    let f = features();
    if f.cgroups.memory.is_none() {
        eprintln!("skipped: no memory cgroup on this host");
        return;
    }
    let limits = ResourceLimits {
        total_memory_bytes: 256 << 20,
        ..ResourceLimits::default()
    };
    let mut ep = episode(limits, VolumeLimits::bytes(64 << 20), ProcessView::Private);
    // Bytes built by repetition are written, so their pages are really used.
    let hog = "python3 -c 'x = b\"y\" * (120 << 20); import time; time.sleep(7009.5151)'";
    let out = ep
        .call(
            "Bash",
            json!({"command": format!("{hog} & {hog} & {hog} & {hog} & wait"), "timeout": 300000}),
        )
        .await;
    assert_eq!(
        bash_data(&out).breach.as_deref(),
        Some("memory_limit"),
        "{}",
        out.text
    );
    assert_eq!(gone("7009.5151").await, Vec::<i32>::new());
}

/// A fork bomb is bounded across the whole command, whatever the uid.
#[tokio::test]
async fn processes_across_the_command_are_bounded() {
    let f = features();
    if f.cgroups.pids.is_none() {
        eprintln!("skipped: no pids cgroup on this host");
        return;
    }
    let limits = ResourceLimits {
        total_processes: 32,
        ..ResourceLimits::default()
    };
    let mut ep = episode(limits, VolumeLimits::bytes(64 << 20), ProcessView::Private);
    let out = ep.call("Bash", json!({"command": "for i in $(seq 1 100); do sleep 7010.5151 & done; wait", "timeout": 300000})).await;
    assert_eq!(
        bash_data(&out).breach.as_deref(),
        Some("process_limit"),
        "{}",
        out.text
    );
    assert_eq!(gone("7010.5151").await, Vec::<i32>::new());
}

/// The layers in force are reported for /v1/info.
#[test]
fn the_status_names_every_layer() {
    let sandbox = Sandbox::new(SandboxConfig::with_toolchains(Vec::new())).expect("sandbox");
    let status = serde_json::to_value(sandbox.status()).expect("json");
    for key in [
        "process_view",
        "kill_method",
        "die_with_server",
        "unix_sockets",
        "cgroups",
        "background_cpu",
        "ipc",
        "disk_quota",
        "uid_pool",
    ] {
        assert!(status.get(key).is_some(), "{key} missing from {status}");
    }
    assert_eq!(status["unix_sockets"], "socketpair_only");
    if features().pid_namespace {
        assert_eq!(status["process_view"], "private");
        assert_eq!(status["kill_method"], "pid_namespace");
    }
}

// ---------------------------------------------------------------------------------------
// Kernel objects two sandboxes could share.
// ---------------------------------------------------------------------------------------

/// A helper in one episode (a long command) makes SysV shared memory, a message queue and a
/// semaphore set under fixed keys, world-writable, as a channel to hand work to another
/// sandbox (an evaluation's candidate copying its inputs there and waiting for the answer).
/// While the helper runs, a command of another episode (another uid) finds none of them: not
/// by key, not by guessing ids, not in `/proc/sysvipc`. When the helper's command ends, none
/// of its objects is left on the host.
#[tokio::test]
async fn sysv_ipc_objects_are_not_shared_between_sandboxes() {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let helper_ep = Episode::new();
    let other = Episode::new();
    let ipc = serde_json::to_value(helper_ep.sandbox.status().ipc).expect("json");
    let helper = r#"
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(0x7a11, 1 << 20, 0o1666)
if shm < 0:
    print("shmget refused", ctypes.get_errno(), flush=True)
    sys.exit(0)
libc.shmat.restype = ctypes.c_void_p
ctypes.memmove(libc.shmat(shm, None, 0), b"helper-ready", 12)
print("msg", libc.msgget(0x7a12, 0o1666), "sem", libc.semget(0x7a13, 1, 0o1666), flush=True)
print("ready", shm, flush=True)
time.sleep(30)
"#;
    let mut jail = helper_ep.toolbox_jail();
    jail.cpu = CpuPriority::Background;
    let mut child = helper_ep
        .sandbox
        .command(
            &jail,
            Path::new("/usr/bin/python3"),
            &["-c".into(), helper.into()],
            &helper_ep.root,
        )
        .expect("command")
        .spawn()
        .expect("spawn");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut said = Vec::new();
    while let Some(l) = lines.next_line().await.expect("read") {
        let done = l.starts_with("ready") || l.starts_with("shmget refused");
        said.push(l);
        if done {
            break;
        }
    }
    let said = said.join("\n");
    if ipc == "refused" {
        assert!(said.contains("shmget refused 1"), "{said}");
    } else {
        assert_eq!(ipc, "namespace", "commands share the host's IPC objects");
        assert!(
            said.contains("ready"),
            "the helper could not make its segment: {said}"
        );
    }
    let client = r#"
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
found = []
for key in (0x7a11, 0x7a12, 0x7a13):
    for get in (lambda k: libc.shmget(k, 0, 0), lambda k: libc.msgget(k, 0), lambda k: libc.semget(k, 0, 0)):
        if get(key) >= 0:
            found.append(hex(key))
for shm_id in range(0, 4096):
    a = libc.shmat(shm_id, None, 0)
    if a not in (None, ctypes.c_void_p(-1).value) and ctypes.string_at(a, 12) == b"helper-ready":
        found.append("id %d" % shm_id)
for table in ("shm", "msg", "sem"):
    try:
        rows = open("/proc/sysvipc/" + table).read().splitlines()[1:]
    except OSError:
        rows = []
    found += [table + " listed" for r in rows if r.split()[0] in ("31249", "31250", "31251")]
print("found", found)
"#;
    let (out, code) = run_in(
        &other,
        &other.toolbox_jail(),
        &format!("python3 -c '{}'", client.replace('\'', "'\\''")),
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(
        out.trim(),
        "found []",
        "another sandbox reached the helper's objects"
    );

    let _ = child.start_kill();
    let mut rest = String::new();
    let _ = child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut rest)
        .await;
    let _ = child.wait_within(Duration::from_secs(30)).await;
    let helper_uid = helper_ep.lease.as_ref().map(|l| l.owner().0);
    // The objects died with the helper's namespace; none is left in the host's.
    for table in ["shm", "msg", "sem"] {
        let listed = std::fs::read_to_string(format!("/proc/sysvipc/{table}")).unwrap_or_default();
        for row in listed.lines().skip(1) {
            let key = row.split_whitespace().next().unwrap_or("");
            assert!(
                !["31249", "31250", "31251"].contains(&key),
                "the helper's {table} object outlived its command: {row} (helper uid {helper_uid:?})"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Paths the agent shapes are never followed by root.
// ---------------------------------------------------------------------------------------

/// The Bash working directory is the agent's to shape: it can write the record the server
/// reads it from and make the directory a link to a place only root may enter. The next
/// command starts in the workspace root instead; and a command whose working directory is
/// such a link enters it only with the jail's rights, so it does not start at all.
#[tokio::test]
async fn a_working_directory_made_a_link_is_never_entered_as_root() {
    let mut ep = Episode::new();
    let secret = ep.dir.path().join("root-only");
    std::fs::create_dir(&secret).expect("mkdir");
    std::fs::write(secret.join("s3cret"), "x").expect("write");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let out = ep
        .bash(&format!(
            "ln -s {} lnk && echo \"$PWD/lnk\" > \"$CUDA_AGENT_CWD_FILE\"; trap - EXIT",
            secret.display()
        ))
        .await;
    assert!(!out.is_error, "{}", out.text);
    let out = ep.bash("pwd -P; ls 2>&1").await;
    assert!(
        !out.text.contains("root-only") && !out.text.contains("s3cret"),
        "the command started in the link's target: {}",
        out.text
    );
    assert!(
        out.text.starts_with(&format!("{}\n", ep.root.display())),
        "{}",
        out.text
    );
    if ep.lease.is_some() {
        // Straight through the sandbox: root does not enter the link for the command.
        let spawned = ep
            .sandbox
            .command(
                &ep.toolbox_jail(),
                Path::new("/bin/bash"),
                &["-c".into(), "pwd -P".into()],
                &ep.root.join("lnk"),
            )
            .expect("command")
            .spawn();
        match spawned {
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}"),
            Ok(mut child) => {
                use tokio::io::AsyncReadExt;
                let mut text = String::new();
                let _ = child
                    .stdout
                    .take()
                    .expect("stdout")
                    .read_to_string(&mut text)
                    .await;
                panic!("the command started in a directory only root may enter: {text}");
            }
        }
    }
}
