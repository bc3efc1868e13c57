//! `sandbox-exec`: run one command in the tool sandbox, for diagnosing what a toolchain needs.
//!
//!     sandbox-exec [--rw DIR]... [--ro DIR]... [--no-landlock] [--no-seccomp] [--seccomp-allow SYSCALL]... [--no-cgroups] [--cuda]
//!                  [--view private|own-uid|host] [--uid N] [--timeout SECS] -- CMD ARGS...
//!
//! The working directory (and first writable directory) is a fresh temp dir unless `--rw` is
//! given. Prints the command's output, then (on stderr) any limit it ran into, and exits
//! with its status. Killing `sandbox-exec` kills the command and everything it started.

use std::ffi::OsString;
use std::path::PathBuf;

use agent_tools::sandbox::ProcessView;
use agent_tools::{create_private_dir, Jail, Sandbox, SandboxConfig};
use env_api::ErrorChain;

fn usage() -> ! {
    eprintln!("usage: sandbox-exec [--rw DIR]... [--ro DIR]... [--no-landlock] [--no-seccomp] [--seccomp-allow SYSCALL]... [--no-cgroups] [--cuda] [--view private|own-uid|host] [--uid N] [--timeout SECS] -- CMD ARGS...");
    std::process::exit(2)
}

/// Says what could not be set up, with its causes, and exits with status 2.
fn fail(what: &str, e: &(dyn std::error::Error + 'static)) -> ! {
    eprintln!("sandbox-exec: {what}: {}", ErrorChain(e));
    std::process::exit(2)
}

fn main() {
    let mut args = std::env::args_os().skip(1);
    let (mut rw, mut ro, mut landlock, mut seccomp, mut uid) = (
        Vec::<PathBuf>::new(),
        Vec::<PathBuf>::new(),
        true,
        true,
        None,
    );
    let (mut cgroups, mut view, mut timeout) = (true, ProcessView::Private, 30 * 86_400u64);
    let mut cmd: Vec<OsString> = Vec::new();
    let mut seccomp_allow = Vec::new();
    // The /proc writes CUDA needs (`Jail::cuda`).
    let mut cuda = false;
    while let Some(a) = args.next() {
        match a.to_str() {
            Some("--rw") => rw.push(args.next().unwrap_or_else(|| usage()).into()),
            Some("--ro") => ro.push(args.next().unwrap_or_else(|| usage()).into()),
            Some("--no-landlock") => landlock = false,
            Some("--no-seccomp") => seccomp = false,
            Some("--seccomp-allow") => seccomp_allow.push(
                args.next()
                    .and_then(|s| agent_tools::sandbox::governed_syscall(s.to_str()?))
                    .unwrap_or_else(|| usage()),
            ),
            Some("--no-cgroups") => cgroups = false,
            Some("--cuda") => cuda = true,
            Some("--view") => {
                view = match args.next().and_then(|s| s.into_string().ok()).as_deref() {
                    Some("private") => ProcessView::Private,
                    Some("own-uid") => ProcessView::OwnUid,
                    Some("host") => ProcessView::Host,
                    _ => usage(),
                }
            }
            Some("--timeout") => {
                timeout = args
                    .next()
                    .and_then(|s| s.to_str()?.parse::<u64>().ok())
                    .unwrap_or_else(|| usage())
            }
            Some("--uid") => {
                uid = args
                    .next()
                    .and_then(|s| s.to_str()?.parse::<u32>().ok())
                    .or_else(|| usage())
            }
            Some("--") => {
                cmd.extend(args.by_ref());
                break;
            }
            _ => usage(),
        }
    }
    if cmd.is_empty() {
        usage();
    }
    let owner = uid.map(|u| (u, u));
    let scratch = std::env::temp_dir().join(format!("sandbox-exec-{}", std::process::id()));
    if rw.is_empty() {
        std::fs::create_dir_all(&scratch)
            .unwrap_or_else(|e| fail(&format!("creating {}", scratch.display()), &e));
        std::fs::set_permissions(
            &scratch,
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )
        .unwrap_or_else(|e| fail(&format!("chmod {}", scratch.display()), &e));
        let ws = scratch.join("ws");
        create_private_dir(&ws, owner)
            .unwrap_or_else(|e| fail(&format!("creating {}", ws.display()), &e));
        rw.push(ws);
    }
    let mut cfg = SandboxConfig::with_toolchains(ro);
    cfg.landlock = landlock;
    cfg.seccomp = seccomp;
    cfg.seccomp_allow = seccomp_allow;
    cfg.cgroups = cgroups;
    cfg.allow_unconfined = !(landlock && seccomp);
    let sandbox = match Sandbox::new(cfg) {
        Ok(s) => s,
        Err(e) => fail("the sandbox", &e),
    };
    let path: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let mut jail = Jail::standard(&rw[0], &rw[0], &path, &[], owner);
    jail.writable = rw.clone();
    jail.process_view = view;
    jail.cuda = cuda;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail("the async runtime", &e));
    let code = rt.block_on(async {
        let mut sc = match sandbox.command(&jail, std::path::Path::new(&cmd[0]), &cmd[1..], &rw[0])
        {
            Ok(c) => c,
            Err(e) => {
                eprintln!("sandbox-exec: {}", ErrorChain(&e));
                return 2;
            }
        };
        sc.cmd
            .stdout(std::process::Stdio::inherit())
            .stderr(std::process::Stdio::inherit());
        match sc.spawn() {
            Ok(mut child) => {
                let outcome = child
                    .wait_within(std::time::Duration::from_secs(timeout))
                    .await;
                if outcome.timed_out {
                    eprintln!("sandbox-exec: timed out after {timeout} s");
                }
                if let Some(b) = outcome.breach {
                    eprintln!("sandbox-exec: stopped: {b} ({})", b.reason());
                }
                outcome.status.and_then(|s| s.code()).unwrap_or(1)
            }
            Err(e) => {
                eprintln!("sandbox-exec: {}: {e}", cmd[0].to_string_lossy());
                127
            }
        }
    });
    let _ = std::fs::remove_dir_all(&scratch);
    std::process::exit(code)
}
