//! `agent-runner` end to end: the real environment server, a real model server (`trainer
//! serve --tiny-random`: seeded random weights, so its replies are noise), the runner's
//! binary. What is checked is the runner's contract, not a reward: episodes end, refused
//! calls become observations, tokens are counted, trajectories are kept, `kernelbench report`
//! reads the results, and `optimize` writes its report (and, given a correct episode, the
//! verified solution).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod server;

use std::io::BufRead as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use agent_runner::agent::{Agent, AgentLimits, EpisodeRecord, Executed};
use agent_runner::openai::{ChatClient, Sampling, ToolCall, Usage};
use agent_runner::optimize::write_outcome;
use agent_runner::run::RunSummary;
use serde_json::{json, Value};
use server::{binary_of, Server};

const ADD: &str = include_str!("cpu_add_candidate.py");
const ADD_TASK: &str = include_str!("../kernelbench/tasks/level1/2_Add.py");

/// `trainer serve --tiny-random` on a free port.
struct ModelServer {
    child: Child,
    url: String,
}

impl ModelServer {
    fn start(extra: &[&str]) -> Self {
        let mut child = Command::new(binary_of("trainer", "trainer"))
            .args(["serve", "--tiny-random", "--port", "0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start trainer serve");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("trainer serve said {line:?}"))
            .to_string();
        Self { child, url }
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn runner() -> Command {
    let mut c = Command::new(binary_of("agent-runner", "agent-runner"));
    c.env_remove("OPENAI_API_KEY")
        .env_remove("CUDA_AGENT_API_KEY");
    c
}

/// The runner's flags for a tiny model: few tools and short replies keep its prompts (one
/// token per character) short enough for a CPU.
fn small(server: &Server, model: &ModelServer, idle: &str) -> Vec<String> {
    [
        "--server",
        &server.url,
        "--base-url",
        &format!("{}/v1", model.url),
        "--tools",
        "Write,Submit",
        "--max-tokens",
        "24",
        "--max-turns",
        "4",
        "--max-idle-replies",
        idle,
        "--jobs",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_runner_drives_episodes_with_a_real_model_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &["--skip-compile"]);
    let model = ModelServer::start(&[]);
    let env = server.client();
    let tiny: Vec<String> = env
        .tasks()
        .await
        .unwrap()
        .tasks
        .into_iter()
        .map(|t| t.id)
        .filter(|id| id.starts_with("tiny/"))
        .take(2)
        .collect();

    // Tool calls the server or the runner refuses are observations; no turn is taken.
    let chat = ChatClient::new(
        &format!("{}/v1", model.url),
        "tiny-random",
        None,
        std::time::Duration::from_secs(60),
    )
    .unwrap();
    let agent = Agent {
        env: env.clone(),
        chat,
        sampling: Sampling {
            temperature: None,
            top_p: None,
            max_tokens: 16,
            tool_choice: "auto".into(),
        },
        limits: AgentLimits {
            tools: Some(vec!["Write".into(), "Submit".into()]),
            ..AgentLimits::default()
        },
    };
    let reset = env
        .reset(&env_api::ResetRequest {
            task: Some(tiny[0].clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = reset.episode_id.as_str();
    let call = |name: &str, arguments: Value| ToolCall {
        id: "call_0".into(),
        name: name.into(),
        arguments,
    };
    for (c, why) in [
        (call("Write", json!("{\"file_path\": ")), "bad_arguments"),
        (call("Write", json!({"content": 3})), "bad_arguments"),
        (
            call("Bash", json!({"command": "ls"})),
            "not one of your tools",
        ),
    ] {
        match agent.execute(id, &c).await.unwrap() {
            Executed::Refused(text) => assert!(text.contains(why), "{text}"),
            other => panic!("{c:?} was not refused: {other:?}"),
        }
    }
    assert_eq!(
        env.state(id).await.unwrap().turn,
        0,
        "refused calls take no turn"
    );
    let Executed::Observed(done) = agent.execute(id, &call("Submit", json!({}))).await.unwrap()
    else {
        panic!("Submit was not run")
    };
    assert!(done.terminated && done.reward == -1.0, "{done:?}");

    // The runner's binary: episodes with the model, to their end.
    let out = dir.path().join("run");
    let run = |extra: &[&str]| {
        let o = runner()
            .args(small(&server, &model, "2"))
            .args(["--tasks", &tiny.join(","), "--samples", "1", "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let table = run(&[]);
    let episodes = lines(&out.join("episodes.jsonl"));
    assert_eq!(episodes.len(), 2, "{episodes:?}");
    for e in &episodes {
        let rec: EpisodeRecord = serde_json::from_value(e.clone()).unwrap();
        assert!(
            rec.end == "terminated"
                || rec.end.starts_with("truncated:")
                || rec.end.starts_with("runner:"),
            "{rec:?}"
        );
        assert!(
            rec.evaluation.is_some(),
            "every episode was judged: {rec:?}"
        );
        assert!(
            rec.usage.calls >= 1 && rec.usage.prompt_tokens > 0,
            "{rec:?}"
        );
        assert!(rec.usage.completion_tokens > 0, "{rec:?}");
        let t: Value = serde_json::from_slice(
            &std::fs::read(
                out.join("trajectories")
                    .join(format!("{}.json", rec.episode_id)),
            )
            .unwrap(),
        )
        .unwrap();
        let kinds: Vec<&str> = t["records"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["kind"].as_str().unwrap())
            .collect();
        assert_eq!(kinds.first(), Some(&"reset"));
        assert_eq!(kinds.last(), Some(&"final"), "{kinds:?}");
        // Beside it, every message the model saw and sent: system, the task, its replies.
        let messages: Vec<Value> = lines(
            &out.join("trajectories")
                .join(format!("{}.messages.jsonl", rec.episode_id)),
        );
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles[..2], ["system", "user"], "{roles:?}");
        assert_eq!(
            roles.iter().filter(|r| **r == "assistant").count() as u64,
            rec.usage.calls,
            "one assistant message per model call: {roles:?}"
        );
        // The server's own log agrees.
        let logged = env.trajectory(&rec.episode_id).await.unwrap();
        assert_eq!(logged.records.len(), kinds.len());
    }
    let results = lines(&out.join("results.jsonl"));
    assert_eq!(results.len(), 2);
    assert!(table.contains("| overall | 2 |"), "{table}");
    // A rerun resumes: nothing is left to do.
    run(&[]);
    assert_eq!(lines(&out.join("episodes.jsonl")).len(), 2);
    // The benchmarkers' table from the results.
    let report = Command::new(binary_of("kernelbench", "kernelbench"))
        .arg("report")
        .arg(out.join("results.jsonl"))
        .output()
        .unwrap();
    assert!(report.status.success());
    assert_eq!(String::from_utf8_lossy(&report.stdout), table);

    // A model whose context the full prompt (every tool's schema) does not fit, held to that
    // prompt: the runner asks for shorter replies, then submits for the model; the episode
    // still ends and is judged.
    let short = ModelServer::start(&["--context", "700"]);
    let out_short = dir.path().join("short");
    let o = runner()
        .args([
            "--server",
            &server.url,
            "--base-url",
            &format!("{}/v1", short.url),
            "--tasks",
            &tiny[0],
            "--max-tokens",
            "64",
            "--prompt",
            "full",
            "--out",
        ])
        .arg(&out_short)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rec: EpisodeRecord =
        serde_json::from_value(lines(&out_short.join("episodes.jsonl"))[0].clone()).unwrap();
    assert_eq!(rec.end, "runner:context", "{rec:?}");
    assert!(rec.evaluation.is_some(), "{rec:?}");

    // optimize on a module of the user's, given as a class and an input shape.
    let module = dir.path().join("scale.py");
    std::fs::write(
        &module,
        "import torch\nimport torch.nn as nn\n\n\nclass Scale(nn.Module):\n    def forward(self, x):\n        return x * 2.0 + 1.0\n",
    )
    .unwrap();
    let opt = dir.path().join("optimized");
    let o = runner()
        .arg("optimize")
        .arg(&module)
        .args(["--input-shape", "256", "--episodes", "1", "--out"])
        .arg(&opt)
        .args(small(&server, &model, "1"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    // Noise writes no kernel: the run says so and leaves its report.
    assert!(
        !o.status.success() && stderr.contains("no correct ModelNew"),
        "{stderr}"
    );
    let md = std::fs::read_to_string(opt.join("report.md")).unwrap();
    assert!(
        md.contains("No correct ModelNew") && md.contains("| 0 |"),
        "{md}"
    );
    assert!(std::fs::read_to_string(opt.join("task.py"))
        .unwrap()
        .contains("class Model(Scale):"));
    assert!(std::fs::read(opt.join("speedup.png"))
        .unwrap()
        .starts_with(b"\x89PNG"));
}

/// optimize's outcome given a correct episode (the test writes the kernel, as no tiny model
/// can): the best solution is evaluated again and written with its speedups, report and
/// chart. Its own server, so that it runs beside the test above.
#[tokio::test(flavor = "multi_thread")]
async fn optimize_writes_the_best_correct_solution_verified() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &["--skip-compile"]);
    let env = server.client();
    let reset = env
        .reset(&env_api::ResetRequest {
            task_source: Some(ADD_TASK.into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = reset.episode_id.clone();
    assert!(reset.info.task.id.starts_with("custom/"));
    env.step(
        &id,
        "Write",
        json!({"file_path": "model_new.py", "content": ADD}),
    )
    .await
    .unwrap();
    let done = env.step(&id, "Submit", json!({})).await.unwrap();
    let evaluation = done.info.evaluation.clone().unwrap();
    assert!(evaluation.correct, "{evaluation:?}");
    let rec = EpisodeRecord {
        task: reset.info.task.id.clone(),
        level: 0,
        sample: 0,
        episode_id: id,
        end: "terminated".into(),
        reward: done.reward,
        evaluation: Some(evaluation),
        turns: done.info.turn,
        refused_calls: 0,
        idle_replies: 0,
        elided: 0,
        usage: Usage::default(),
        wall_s: 0.0,
    };
    let summary = RunSummary {
        records: vec![rec],
        ..Default::default()
    };
    let best_dir = dir.path().join("best");
    let o = write_outcome(&env, ADD_TASK, "2_Add.py", &summary, &best_dir)
        .await
        .unwrap();
    assert!(o.verified.correct, "{:?}", o.verified);
    assert!(o.verified.times_ms.eager.is_some() && o.verified.times_ms.candidate.is_some());
    assert_eq!(
        std::fs::read_to_string(best_dir.join("model_new.py")).unwrap(),
        ADD
    );
    let md = std::fs::read_to_string(best_dir.join("report.md")).unwrap();
    assert!(md.contains("## Best") && md.contains("| eager |"), "{md}");
    assert!(std::fs::read(best_dir.join("speedup.png"))
        .unwrap()
        .starts_with(b"\x89PNG"));
}
