//! Escape tests: real commands in the real sandbox, each denial asserted by its own failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::TcpListener;
use std::time::Duration;

use agent_tools::sandbox::KernelFeatures;
use agent_tools::ResourceLimits;
use common::{bash_data, cuda_fixture, fixture, fixture_with};
use serde_json::json;

fn features() -> KernelFeatures {
    KernelFeatures::detect()
}

#[tokio::test]
async fn writing_outside_the_workspace_is_denied() {
    let mut f = fixture();
    let target = f.dir.path().join("escaped.txt");
    let out = f.bash(&format!("echo pwned > {}", target.display())).await;
    assert!(out.text.contains("Permission denied"), "{}", out.text);
    assert!(!target.exists());
    let out = f.bash("touch /tmp/cuda-agent-escape-test").await;
    assert!(out.text.contains("Permission denied"), "{}", out.text);
    assert!(!std::path::Path::new("/tmp/cuda-agent-escape-test").exists());
    // The temp dir is writable, as is the workspace.
    let out = f
        .bash("echo ok > \"$TMPDIR/t\" && echo ok > w && cat \"$TMPDIR/t\" w")
        .await;
    assert_eq!(out.text, "ok\nok\n", "{}", out.text);
}

#[tokio::test]
async fn other_workspaces_and_server_files_are_unreadable() {
    let mut f = fixture();
    let out = f
        .bash(&format!("cat {}/model_new.py", f.other_workspace.display()))
        .await;
    assert!(out.text.contains("Permission denied"), "{}", out.text);
    assert!(!out.text.contains("secret kernel"));
    let out = f.bash(&format!("ls {}", f.other_workspace.display())).await;
    assert!(out.text.contains("Permission denied"), "{}", out.text);
    let out = f.bash(&format!("cat {}", f.secret.display())).await;
    assert!(out.text.contains("Permission denied"), "{}", out.text);
    assert!(!out.text.contains("[1, 2, 3]"));
    let out = f.bash("ls /root").await;
    assert!(out.text.contains("Permission denied"), "{}", out.text);
}

/// `/proc` is read-only to a jail that does not run CUDA: its own entries too (the autogroup
/// among them, whose nice value a background command would reset).
#[tokio::test]
async fn proc_is_read_only_without_cuda() {
    let mut f = fixture();
    let out = f.bash("echo mine > /proc/self/comm && echo wrote").await;
    assert!(out.is_error, "{}", out.text);
    assert!(out.text.contains("Permission denied"), "{}", out.text);
    let out = f.bash("head -c 100 /proc/self/status").await;
    assert!(out.text.starts_with("Name:"), "{}", out.text);
}

/// CUDA's driver names its threads through `/proc`: a CUDA jail writes its own entries, and
/// nothing else there.
#[tokio::test]
async fn proc_is_writable_only_for_the_process_itself() {
    let mut f = cuda_fixture();
    let out = f
        .bash("echo mine > /proc/self/comm && echo wrote; echo evil > /proc/1/comm")
        .await;
    assert!(out.text.starts_with("wrote\n"), "{}", out.text);
    // pid 1 is the command's namespace's init, hidden from it, or (without a pid namespace)
    // the host's, whose entries are not the command's to write.
    assert!(
        out.text.contains("Permission denied") || out.text.contains("No such file"),
        "{}",
        out.text
    );
    let out = f.bash("echo evil > /proc/sys/kernel/hostname").await;
    assert!(out.is_error, "{}", out.text);
    assert!(
        out.text.contains("Permission denied") || out.text.contains("Read-only"),
        "{}",
        out.text
    );
    let out = f.bash("touch /proc/newfile").await;
    assert!(out.is_error, "{}", out.text);
}

#[tokio::test]
async fn a_planted_symlink_does_not_lead_out() {
    let mut f = fixture();
    let out = f
        .bash(&format!(
            "ln -s {} leak && cat leak/model_new.py",
            f.other_workspace.display()
        ))
        .await;
    assert!(out.text.contains("Permission denied"), "{}", out.text);
    let out = f
        .bash(&format!("ln -s {} seeds && cat seeds", f.secret.display()))
        .await;
    assert!(out.text.contains("Permission denied"), "{}", out.text);
    let out = f.call("Read", json!({"file_path": "seeds"})).await;
    assert!(out.is_error, "{}", out.text);
    assert!(!out.text.contains("[1, 2, 3]"), "{}", out.text);
}

/// A listener the sandbox must not reach; returns whether anything connected.
fn listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

fn nobody_connected(l: &TcpListener) -> bool {
    matches!(l.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

#[tokio::test]
async fn tcp_to_localhost_is_denied_from_python_bash_and_curl() {
    let mut f = fixture();
    let (l, port) = listener();
    let out =
        f.bash(&format!("python3 -c 'import socket; s=socket.socket(); s.connect((\"127.0.0.1\", {port})); print(\"connected\")'")).await;
    assert!(out.text.contains("PermissionError"), "{}", out.text);
    let out = f
        .bash("python3 -c 'import socket; socket.socket(socket.AF_INET6)'")
        .await;
    assert!(out.text.contains("PermissionError"), "{}", out.text);
    let out = f
        .bash(&format!("echo hi > /dev/tcp/127.0.0.1/{port}"))
        .await;
    assert!(out.text.contains("Operation not permitted"), "{}", out.text);
    if std::path::Path::new("/usr/bin/curl").exists() {
        let out = f
            .bash(&format!("curl -sS --max-time 3 http://127.0.0.1:{port}/"))
            .await;
        assert!(out.is_error, "{}", out.text);
        assert!(out.text.contains("curl: ("), "{}", out.text);
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        nobody_connected(&l),
        "a sandboxed process reached the listener"
    );
    // Unix sockets still work (toolchains use socketpairs).
    let out = f
        .bash(
            "python3 -c 'import socket; a,b=socket.socketpair(); a.send(b\"x\"); print(b.recv(1))'",
        )
        .await;
    assert_eq!(out.text.trim(), "b'x'", "{}", out.text);
}

#[tokio::test]
async fn ptrace_mount_unshare_and_io_uring_are_denied() {
    let mut f = fixture();
    let script = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    r = getattr(libc, name)(*args)
    return r, os.strerror(ctypes.get_errno())
print("ptrace", *call("ptrace", 16, os.getppid(), 0, 0))
print("mount", *call("mount", b"none", b"/mnt", b"tmpfs", 0, None))
print("unshare", *call("unshare", 0x10000000))
print("io_uring", *call("syscall", 425, 8, None))
print("setsid", *call("setsid"))
"#;
    std::fs::write(f.root.join("probe.py"), script).unwrap();
    let out = f.bash("python3 probe.py").await;
    for name in ["ptrace", "mount", "unshare", "io_uring", "setsid"] {
        let line = out
            .text
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_default();
        assert!(
            line.contains("-1 Operation not permitted"),
            "{name}: {}",
            out.text
        );
    }
    if std::path::Path::new("/usr/bin/strace").exists() {
        let out = f.bash("strace -f true").await;
        assert!(out.is_error, "{}", out.text);
        assert!(out.text.contains("Operation not permitted"), "{}", out.text);
    }
}

#[tokio::test]
async fn no_new_privs_and_seccomp_are_set() {
    let mut f = fixture();
    let out = f
        .bash("grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status")
        .await;
    assert!(out.text.contains("NoNewPrivs:\t1"), "{}", out.text);
    assert!(out.text.contains("Seccomp:\t2"), "{}", out.text);
    if features().can_switch_uid {
        let out = f.bash("id -u").await;
        assert_ne!(out.text.trim(), "0", "tool processes must not run as root");
    }
}

#[tokio::test]
async fn a_fork_bomb_is_bounded_by_the_process_limit() {
    if !features().can_switch_uid {
        eprintln!(
            "skipped: RLIMIT_NPROC only binds a non-root uid, and this server cannot switch uids"
        );
        return;
    }
    let mut f = fixture_with(ResourceLimits {
        processes: 64,
        ..ResourceLimits::default()
    });
    let out = f.call("Bash", json!({"command": "bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", "timeout": 8000})).await;
    assert!(
        out.text.contains("Resource temporarily unavailable") || out.text.contains("retry"),
        "{}",
        out.text
    );
    // Nothing of it is left after the step.
    let out = f.bash("ps -u $(id -u) -o pid= | wc -l").await;
    let procs: usize = out.text.trim().parse().unwrap_or(usize::MAX);
    assert!(procs < 5, "{}", out.text);
}

#[tokio::test]
async fn memory_past_the_limit_fails_to_allocate() {
    let mut f = fixture_with(ResourceLimits {
        memory_bytes: 512 << 20,
        ..ResourceLimits::default()
    });
    let out = f
        .bash("python3 -c 'x = bytearray(2 << 30); print(len(x))'")
        .await;
    assert!(out.text.contains("MemoryError"), "{}", out.text);
    let out = f
        .bash("python3 -c 'x = bytearray(64 << 20); print(len(x))'")
        .await;
    assert_eq!(out.text.trim(), "67108864", "{}", out.text);
}

#[tokio::test]
async fn a_huge_file_is_cut_at_the_file_size_limit() {
    let mut f = fixture_with(ResourceLimits {
        file_size_bytes: 8 << 20,
        ..ResourceLimits::default()
    });
    let out = f.bash("head -c 100000000 /dev/zero > big.bin").await;
    assert!(out.is_error);
    assert!(
        out.text.contains("File size limit exceeded") || bash_data(&out).exit_code == Some(153),
        "{}",
        out.text
    );
    let size = std::fs::metadata(f.root.join("big.bin")).unwrap().len();
    assert!(size <= 8 << 20, "{size}");
}

/// Host processes whose command line contains `marker`.
fn with_marker(marker: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
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

#[tokio::test]
async fn nothing_outlives_a_timeout_or_the_end_of_a_command() {
    let mut f = fixture();
    let out =
        f.call("Bash", json!({"command": "sleep 1000.4711 & nohup sleep 1001.4711 >/dev/null 2>&1 & sleep 100", "timeout": 1000})).await;
    assert!(bash_data(&out).timed_out, "{}", out.text);
    assert!(out.text.contains("timed out"), "{}", out.text);
    // The timeout could have been longer: the message says how long it may be.
    assert!(
        out.text
            .contains("a longer command needs a larger `timeout` (milliseconds, at most 600000)"),
        "{}",
        out.text
    );
    assert_eq!(
        with_marker(".4711"),
        Vec::<i32>::new(),
        "background processes survived the timeout"
    );
    // A background process of a command that ended normally is gone too, also one that left
    // its process group.
    let out = f
        .bash("python3 -c 'import os,time\nif os.fork()==0:\n  os.setpgid(0,0); time.sleep(1000.4712)\nelse: print(\"parent done\")' ; sleep 0.2; true")
        .await;
    assert!(out.text.contains("parent done"), "{}", out.text);
    assert_eq!(
        with_marker("1000.4712"),
        Vec::<i32>::new(),
        "a process in its own group survived"
    );
}

#[tokio::test]
async fn verify_py_cannot_be_changed_from_bash() {
    let mut f = fixture();
    let out = f.bash("echo 'print(1)' >> verify.py").await;
    assert!(out.is_error);
    assert!(out.text.contains("Permission denied"), "{}", out.text);
    // Whatever the agent manages (chmod as owner, delete and re-create), the pristine file is put back.
    let out = f.bash("chmod u+w verify.py 2>/dev/null; rm -f verify.py; echo 'print(\"hacked\")' > verify.py; cat verify.py").await;
    assert_eq!(
        std::fs::read_to_string(f.root.join("verify.py")).unwrap(),
        "print('pristine verify')\n"
    );
    assert!(out.text.contains("restored: verify.py"), "{}", out.text);
}

#[tokio::test]
async fn toolchains_still_work_inside() {
    let mut f = fixture();
    let out = f
        .bash("python3 -c 'import sys; print(sys.version_info[0])'")
        .await;
    assert_eq!(out.text.trim(), "3", "{}", out.text);
    std::fs::write(
        f.root.join("hello.cpp"),
        "#include <cstdio>\nint main(){std::puts(\"hello from g++\");}\n",
    )
    .unwrap();
    let out = f.bash("g++ -O2 -o hello hello.cpp && ./hello").await;
    assert_eq!(out.text.trim(), "hello from g++", "{}", out.text);
    if std::path::Path::new("/usr/local/cuda/bin/nvcc").exists() {
        std::fs::write(
            f.root.join("k.cu"),
            "__global__ void k(){}\nint main(){k<<<1,1>>>(); return 0;}\n",
        )
        .unwrap();
        let out = f
            .bash("/usr/local/cuda/bin/nvcc -o k k.cu && ./k && echo nvcc-ok")
            .await;
        assert!(out.text.contains("nvcc-ok"), "{}", out.text);
    }
}
