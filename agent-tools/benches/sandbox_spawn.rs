//! The sandbox's own cost: spawning `/bin/true` and `python -c "import torch"` bare and
//! inside the sandbox with each process view, with and without cgroups, median of many.
//! Run with `cargo bench -p agent-tools --bench sandbox_spawn`; `SPAWN_RUNS` and
//! `TORCH_RUNS` set the repetitions, `CUDA_AGENT_PYTHON` the Python (default `python3`).

// A benchmark that cannot set up has nothing to measure: it stops with the reason.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent_tools::sandbox::ProcessView;
use agent_tools::{create_private_dir, Jail, Sandbox, SandboxConfig};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The Python's bin dir and install prefixes.
fn python_dirs(python: &str) -> (PathBuf, Vec<PathBuf>) {
    let out = std::process::Command::new(python)
        .args(["-c", "import sys,os;print(os.path.realpath(sys.executable));print(sys.prefix);print(sys.base_prefix)"])
        .output()
        .expect("python runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut lines = text.lines().map(PathBuf::from);
    let exe = lines.next().expect("python path");
    (
        exe.parent().expect("bin dir").to_path_buf(),
        lines.collect(),
    )
}

struct Case<'a> {
    label: String,
    sandbox: Option<&'a Sandbox>,
    view: ProcessView,
}

fn main() {
    let runs: usize = std::env::var("SPAWN_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let torch_runs: usize = std::env::var("TORCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let python = std::env::var("CUDA_AGENT_PYTHON").unwrap_or_else(|_| "python3".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let ws = dir.path().join("ws");
    let tmp = dir.path().join("tmp");
    let owner = agent_tools::sandbox::KernelFeatures::detect()
        .can_switch_uid
        .then_some((61_999, 61_999));
    create_private_dir(&ws, owner).expect("ws");
    create_private_dir(&tmp, owner).expect("tmp");
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .expect("chmod");
    let (py_bin, prefixes) = python_dirs(&python);
    let with_cgroups =
        Sandbox::new(SandboxConfig::with_toolchains(prefixes.clone())).expect("sandbox");
    let mut config = SandboxConfig::with_toolchains(prefixes);
    config.cgroups = false;
    let without_cgroups = Sandbox::new(config).expect("sandbox");
    let given_bin = Path::new(&python)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| py_bin.clone());
    let path = [
        given_bin,
        py_bin.clone(),
        PathBuf::from("/usr/bin"),
        PathBuf::from("/bin"),
    ];
    // The interpreter as given (a venv's python finds its packages through its own path).
    let python_exe = if Path::new(&python).is_absolute() {
        PathBuf::from(&python)
    } else {
        py_bin.join("python3")
    };

    let time = |case: &Case, program: &Path, args: &[OsString], n: usize| -> Duration {
        rt.block_on(async {
            let mut t = Vec::with_capacity(n);
            for _ in 0..n {
                let s = Instant::now();
                let ok = match case.sandbox {
                    None => tokio::process::Command::new(program)
                        .args(args)
                        .stdout(std::process::Stdio::null())
                        .status()
                        .await
                        .expect("spawn")
                        .success(),
                    Some(sandbox) => {
                        let mut jail = Jail::standard(&ws, &tmp, &path, &[], owner);
                        jail.process_view = case.view;
                        let mut cmd = sandbox.command(&jail, program, args, &ws).expect("command");
                        cmd.cmd
                            .stdout(std::process::Stdio::null())
                            .stderr(std::process::Stdio::null());
                        let mut child = cmd.spawn().expect("spawn");
                        let outcome = child.wait_within(Duration::from_secs(120)).await;
                        outcome.status.is_some_and(|s| s.success())
                    }
                };
                assert!(ok, "{} failed", case.label);
                t.push(s.elapsed());
            }
            median(t)
        })
    };

    let mut cases = vec![Case {
        label: "bare".into(),
        sandbox: None,
        view: ProcessView::Host,
    }];
    for (sandbox, cg) in [(&with_cgroups, "cgroups"), (&without_cgroups, "no cgroups")] {
        for view in [ProcessView::Private, ProcessView::OwnUid, ProcessView::Host] {
            let effective = sandbox.effective_view(view);
            if effective == view {
                cases.push(Case {
                    label: format!("sandboxed, {view:?} view, {cg}"),
                    sandbox: Some(sandbox),
                    view,
                });
            }
        }
    }
    println!("| spawn and wait (median) | /bin/true ({runs} runs) | python -c \"import torch\" ({torch_runs} runs) |");
    println!("| --- | --- | --- |");
    let import: Vec<OsString> = vec!["-c".into(), "import torch".into()];
    for case in &cases {
        let t = time(case, Path::new("/bin/true"), &[], runs);
        let py = time(case, &python_exe, &import, torch_runs);
        println!(
            "| {} | {:.3} ms | {:.1} ms |",
            case.label,
            t.as_secs_f64() * 1e3,
            py.as_secs_f64() * 1e3
        );
    }
    println!(
        "sandbox status: {}",
        serde_json::to_string(&with_cgroups.status()).unwrap_or_default()
    );
}
