//! The sandbox's own cost: spawning `/bin/true` bare and inside the sandbox, median of many.
//! Run with `cargo bench -p agent-tools --bench sandbox_spawn`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent_tools::{create_private_dir, Jail, Sandbox, SandboxConfig};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let runs: usize = std::env::var("SPAWN_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let ws = dir.path().join("ws");
    let tmp = dir.path().join("tmp");
    let owner = agent_tools::sandbox::KernelFeatures::detect().can_switch_uid.then_some((61_999, 61_999));
    create_private_dir(&ws, owner).expect("ws");
    create_private_dir(&tmp, owner).expect("tmp");
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711)).expect("chmod");
    let sandbox = Sandbox::new(SandboxConfig::with_toolchains(Vec::new())).expect("sandbox");
    let jail = Jail::standard(&ws, &tmp, &[PathBuf::from("/usr/bin"), PathBuf::from("/bin")], &[], owner);
    let truebin = Path::new("/bin/true");

    let bare = rt.block_on(async {
        let mut t = Vec::with_capacity(runs);
        for _ in 0..runs {
            let s = Instant::now();
            let st = tokio::process::Command::new(truebin).status().await.expect("spawn");
            assert!(st.success());
            t.push(s.elapsed());
        }
        t
    });
    let boxed = rt.block_on(async {
        let mut t = Vec::with_capacity(runs);
        for _ in 0..runs {
            let s = Instant::now();
            let mut cmd = sandbox.command(&jail, truebin, &[] as &[OsString], &ws).expect("command");
            cmd.cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
            let st = cmd.spawn().expect("spawn").wait().await.expect("wait");
            assert!(st.success());
            t.push(s.elapsed());
        }
        t
    });
    let (b, s) = (median(bare), median(boxed));
    println!("| spawn of /bin/true ({runs} runs) | median |");
    println!("| --- | --- |");
    println!("| bare | {:.3} ms |", b.as_secs_f64() * 1e3);
    println!("| sandboxed (landlock + seccomp + rlimits + uid) | {:.3} ms |", s.as_secs_f64() * 1e3);
    println!("| added by the sandbox | {:.3} ms |", (s.as_secs_f64() - b.as_secs_f64()) * 1e3);
    println!("| ratio | {:.2}x |", s.as_secs_f64() / b.as_secs_f64());
    println!("sandbox status: {:?}", sandbox.status());
}
