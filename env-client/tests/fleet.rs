//! A fleet on loopback: three real env-server processes behind one [`Fleet`], driving cheap
//! episodes (the tiny family: a few tool calls, judged in Rust) and evaluations, with one
//! server killed (SIGKILL) and one drained (SIGTERM) mid-run. Every episode ends with a
//! verdict or a stated loss (its server gone or draining), new work moves to the survivor,
//! a retried reset or evaluation with the same key never makes a second episode or a second
//! evaluation, and nothing waits past the client's timeout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use env_api::{EvaluateOptions, EvaluateRequest, ResetRequest, SolutionRef, TaskRef};
use env_client::{ClientError, EnvClient, Fleet, FleetConfig, ServerHandle};
use serde_json::json;

/// The client's per-request timeout: nothing in this test may take longer.
const TIMEOUT: Duration = Duration::from_secs(120);

/// The tiny family's words (`kernelbench::TINY_WORDS`): task `tiny/{i}_{word}`.
const WORDS: [&str; 8] = [
    "red", "blue", "green", "amber", "violet", "cyan", "olive", "pearl",
];

fn python() -> PathBuf {
    std::env::var_os("CUDA_AGENT_PYTHON")
        .map(Into::into)
        .unwrap_or_else(|| "python3".into())
}

/// The env-server binary: from `CUDA_AGENT_BIN_DIR`, else built here (Cargo builds no other
/// package's binary for a test).
fn server_binary() -> PathBuf {
    if let Some(dir) = std::env::var_os("CUDA_AGENT_BIN_DIR") {
        return PathBuf::from(dir).join("env-server");
    }
    let exe = std::env::current_exe().expect("test exe");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("env-server");
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "-p", "env-server", "--bin", "env-server"]);
    if bin.parent().is_some_and(|d| d.ends_with("release")) {
        cmd.arg("--release");
    }
    assert!(
        cmd.status().expect("cargo build").success(),
        "building env-server failed"
    );
    bin
}

/// One real server process.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(bin: &Path, dir: &Path) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .expect("port")
            .local_addr()
            .expect("addr")
            .port();
        std::fs::create_dir_all(dir).expect("dir");
        let log = std::fs::File::create(dir.join("server.log")).expect("log");
        let child = Command::new(bin)
            .args(["--bind", &format!("127.0.0.1:{port}"), "--device", "cpu"])
            .args(["--skip-compile", "--drain-grace-s", "100"])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--python")
            .arg(python())
            .env_remove("CUDA_AGENT_API_KEY")
            .env("CUDA_AGENT_PCH", "none")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start env-server");
        let url = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(started.elapsed() < TIMEOUT, "env-server did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, url }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(rc, 0, "signalling the server");
    }

    fn client(&self) -> EnvClient {
        EnvClient::new(&self.url, TIMEOUT).expect("client")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A counter from `/metrics`.
async fn metric(url: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

/// An episode of the test: where it lives, and how it ended.
struct Episode {
    server: ServerHandle,
    id: String,
    word: &'static str,
    /// The reward of its verdict.
    reward: Option<f64>,
    /// Why it was lost.
    lost: Option<String>,
}

/// Opens an episode of tiny task `i` through the fleet.
async fn open(fleet: &Fleet, i: usize) -> Episode {
    let k = i % WORDS.len();
    let (server, r) = fleet
        .reset(&ResetRequest {
            task: Some(format!("tiny/{k}_{}", WORDS[k])),
            ..Default::default()
        })
        .await
        .expect("a reset lands on a live server");
    Episode {
        server,
        id: r.episode_id,
        word: WORDS[k],
        reward: None,
        lost: None,
    }
}

/// One step of an episode on its own server; a loss is recorded, anything else fails.
async fn step(ep: &mut Episode, tool: &str, args: serde_json::Value) {
    if ep.reward.is_some() || ep.lost.is_some() {
        return;
    }
    match ep.server.client().step(&ep.id, tool, args).await {
        Ok(a) if a.done => ep.reward = Some(a.reward),
        Ok(_) => {}
        Err(e) if e.is_server_gone() => ep.lost = Some(e.to_string()),
        // Ended by its server's drain between two steps: the state says so, or the server
        // is gone by now.
        Err(ClientError::Api { status: 409, .. }) => {
            ep.lost = Some(match ep.server.client().state(&ep.id).await {
                Ok(s) => {
                    let why = s.truncation_reason.unwrap_or_default();
                    assert_eq!(why, "server_drain", "episode {} ended early", ep.id);
                    why
                }
                Err(e) if e.is_server_gone() => e.to_string(),
                Err(e) => panic!("episode {}: {e}", ep.id),
            })
        }
        Err(e) => panic!("episode {} on {}: {e}", ep.id, ep.server.base()),
    }
}

/// Plays an episode to its verdict (or its loss).
async fn finish(ep: &mut Episode) {
    step(
        ep,
        "Write",
        json!({"file_path": "answer.txt", "content": ep.word}),
    )
    .await;
    step(ep, "Submit", json!({})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_survives_a_killed_and_a_drained_server() {
    let bin = server_binary();
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = Server::start(&bin, &tmp.path().join("a"));
    let mut b = Server::start(&bin, &tmp.path().join("b"));
    let c = Server::start(&bin, &tmp.path().join("c"));
    let fleet = Fleet::new(FleetConfig {
        urls: vec![a.url.clone(), b.url.clone(), c.url.clone()],
        timeout: TIMEOUT,
        retries: 2,
        ..Default::default()
    })
    .expect("fleet");

    // A reset retried with its key is the same episode, not a second one.
    let keyed = ResetRequest {
        task: Some("tiny/0_red".into()),
        request_id: Some("fleet-test-reset".into()),
        ..Default::default()
    };
    let first = a.client().reset(&keyed).await.expect("reset");
    let again = a.client().reset(&keyed).await.expect("retried reset");
    assert_eq!(first.episode_id, again.episode_id);
    assert!(!first.info.replayed && again.info.replayed);
    assert_eq!(metric(&a.url, "cuda_agent_resets_total").await, 1.0);

    // Nine episodes, sent round robin: three on each server, one step each.
    let mut episodes = Vec::new();
    for i in 0..9 {
        episodes.push(open(&fleet, i).await);
    }
    for s in [&a, &b, &c] {
        let n = episodes.iter().filter(|e| e.server.base() == s.url).count();
        assert_eq!(n, 3, "{} has {n} episodes", s.url);
    }
    for ep in &mut episodes {
        step(ep, "Bash", json!({"command": "echo before"})).await;
        assert!(ep.lost.is_none() && ep.reward.is_none());
    }

    // A long step on b holds its drain open while the rest of the test runs.
    let held = episodes
        .iter()
        .position(|e| e.server.base() == b.url)
        .expect("an episode on b");
    let long_step = {
        let (client, id) = (b.client(), episodes[held].id.clone());
        tokio::spawn(async move {
            client
                .step(&id, "Bash", json!({"command": "sleep 12; echo held"}))
                .await
        })
    };
    // Its request is in flight once b counts two (this /metrics read is the other).
    while metric(&b.url, "cuda_agent_requests_in_flight").await < 2.0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    b.signal(libc::SIGTERM);
    while reqwest::get(format!("{}/v1/ready", b.url))
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.signal(libc::SIGKILL);

    // The episodes left on b and c are lost, with the reason; a's run to their verdicts.
    for (i, ep) in episodes.iter_mut().enumerate() {
        if i != held {
            step(ep, "Bash", json!({"command": "echo after"})).await;
        }
    }
    for ep in &mut episodes {
        finish(ep).await;
    }
    let answer = long_step.await.expect("the long step's task");
    let held_answer = answer.expect("the step admitted before the drain is answered");
    assert!(held_answer.observation.text.contains("held"));
    // Its episode ends with the drain: a stated loss too.
    finish(&mut episodes[held]).await;
    for ep in &episodes {
        let on_a = ep.server.base() == a.url;
        match (&ep.reward, &ep.lost) {
            (Some(r), None) => {
                assert!(on_a, "only a's episodes get verdicts");
                assert_eq!(*r, 1.0, "the right word is paid");
            }
            (None, Some(why)) => assert!(!on_a, "{} lost on a: {why}", ep.id),
            other => panic!("episode {} ended neither way: {other:?}", ep.id),
        }
    }
    assert_eq!(episodes.iter().filter(|e| e.lost.is_some()).count(), 6);

    // New episodes all land on the survivor: b refuses them (draining), c is gone.
    for i in 0..6 {
        let mut ep = open(&fleet, i).await;
        assert_eq!(ep.server.base(), a.url, "new work goes to the survivor");
        finish(&mut ep).await;
        assert_eq!(ep.reward, Some(1.0));
    }

    // An evaluation through the fleet lands on a; the same key again is answered from its
    // verdict, not judged a second time.
    let before = metric(&a.url, "cuda_agent_evaluations_total").await;
    let eval = EvaluateRequest {
        task: TaskRef::Id("L1/2_Add".into()),
        solution: SolutionRef::Text(
            "import torch\n\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, a, b):\n        return a + b\n"
                .into(),
        ),
        options: Some(EvaluateOptions {
            request_id: Some("fleet-test-eval".into()),
            ..Default::default()
        }),
    };
    let verdict = fleet.evaluate(&eval).await.expect("a verdict from a");
    assert_eq!(
        metric(&a.url, "cuda_agent_evaluations_total").await,
        before + 1.0
    );
    let replay = a
        .client()
        .evaluate(&eval)
        .await
        .expect("the retried evaluation");
    assert_eq!(replay, verdict);
    assert_eq!(
        metric(&a.url, "cuda_agent_evaluations_total").await,
        before + 1.0,
        "a retry with the same key is not judged again"
    );

    // b finishes its drain and exits 0; c refuses connections: gone, not slow.
    let status = loop {
        match b.child.try_wait().expect("b's status") {
            Some(status) => break status,
            None => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    assert_eq!(status.code(), Some(0), "a drained server exits 0");
    let gone = c.client().health().await.unwrap_err();
    assert!(gone.is_server_gone(), "{gone}");
    assert!(matches!(gone, ClientError::Transport(_)));
}
