//! Starts the real `env-server` binary on a free port.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use env_client::EnvClient;

pub fn python() -> PathBuf {
    std::env::var_os("CUDA_AGENT_PYTHON")
        .map(Into::into)
        .unwrap_or_else(|| "python3".into())
}

/// The path of a workspace binary. `CUDA_AGENT_BIN_DIR` names the directory of binaries built
/// with the test build's features (scripts/test.sh builds them in the same step as the tests);
/// without it the binary is built here first, since Cargo does not build another package's
/// binary for these tests. That build resolves the package's features on its own, unlike
/// `cargo test --workspace`, so it may rebuild shared dependencies.
pub fn binary_of(package: &str, name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("CUDA_AGENT_BIN_DIR") {
        let bin = PathBuf::from(dir).join(name);
        assert!(
            bin.is_file(),
            "CUDA_AGENT_BIN_DIR has no {name}: build it with `cargo build --workspace --bins --tests`"
        );
        return bin;
    }
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let exe = std::env::current_exe().expect("test exe");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join(name);
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "-p", package, "--bin", name]);
    if bin.parent().is_some_and(|d| d.ends_with("release")) {
        cmd.arg("--release");
    }
    let ok = cmd.status().expect("cargo build");
    assert!(ok.success(), "building {name} failed");
    bin
}

fn binary() -> PathBuf {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| binary_of("env-server", "env-server"))
        .clone()
}

pub struct Server {
    pub child: Child,
    pub url: String,
    pub data_dir: PathBuf,
}

impl Server {
    pub fn start(data_dir: &Path, extra: &[&str]) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let log = std::fs::File::create(data_dir.with_extension("log")).unwrap();
        let mut cmd = Command::new(binary());
        // Precompiled headers cost a core-minute and 0.7 GB a variant: a server makes none of
        // its own unless a test asks (`--pch`); the suite's runner makes a set once that every
        // server shares (CUDA_AGENT_PCH_DIR with the variants in CUDA_AGENT_PCH).
        if std::env::var_os("CUDA_AGENT_PCH_DIR").is_none() {
            cmd.env("CUDA_AGENT_PCH", "none");
        }
        let child = cmd
            .args(["--bind", &format!("127.0.0.1:{port}"), "--data-dir"])
            .arg(data_dir)
            .arg("--python")
            .arg(python())
            .args(["--device", "cpu"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start env-server");
        let s = Self {
            child,
            url,
            data_dir: data_dir.to_path_buf(),
        };
        s.wait_ready();
        s
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(self.url.trim_start_matches("http://")).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "env-server did not come up; see {}",
            self.data_dir.with_extension("log").display()
        );
    }

    pub fn client(&self) -> EnvClient {
        EnvClient::new(&self.url, Duration::from_secs(600)).unwrap()
    }

    /// SIGKILL: no chance to flush or clean up, as in a crash.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}
