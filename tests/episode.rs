//! Whole episodes against the real server binary over a real socket.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod server;

use env_api::{EvaluateRequest, ProbeStatus, ResetOptions, ResetRequest, SolutionRef, TaskRef};
use serde_json::json;
use server::Server;

/// A correct C++ candidate for L1/2_Add (CPU): one compiled loop, no PyTorch compute.
const ADD_CANDIDATE: &str = include_str!("cpu_add_candidate.py");

/// A server over a data directory in `dir` (no torch.compile baselines) and an episode on
/// L1/2_Add: the server and the episode's id.
async fn add_episode(dir: &std::path::Path) -> (Server, String) {
    let server = Server::start(&dir.join("data"), &["--skip-compile"]);
    let id = server
        .client()
        .reset(&ResetRequest {
            task: Some("L1/2_Add".into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .episode_id;
    (server, id)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_episode_with_every_tool_then_submit() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &["--skip-compile"]);
    let c = server.client();
    assert_eq!(c.health().await.unwrap().status, ProbeStatus::Ok);
    let reset = c
        .reset(&ResetRequest {
            task: Some("L1/2_Add".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = reset.episode_id.clone();
    assert_eq!(reset.info.task.id, "L1/2_Add");

    let s = c.step(&id, "TodoWrite", json!({"todos": [
        {"content": "Write the kernel", "status": "in_progress", "activeForm": "Writing the kernel"},
        {"content": "Verify", "status": "pending", "activeForm": "Verifying"}]})).await.unwrap();
    assert!(!s.observation.is_error, "{}", s.observation.text);
    let s = c
        .step(&id, "Glob", json!({"pattern": "*.py"}))
        .await
        .unwrap();
    assert!(
        s.observation.text.contains("verify.py"),
        "{}",
        s.observation.text
    );
    let s = c
        .step(&id, "Read", json!({"file_path": "model.py"}))
        .await
        .unwrap();
    assert!(
        s.observation.text.contains("class Model"),
        "{}",
        s.observation.text
    );
    // SKILL.md's detail is a workspace file, laid out for the device and read-only.
    let s = c
        .step(&id, "Read", json!({"file_path": "SKILL_REFERENCE.md"}))
        .await
        .unwrap();
    assert!(
        s.observation.text.contains("(this server's device)"),
        "{}",
        s.observation.text
    );
    let s = c
        .step(
            &id,
            "Write",
            json!({"file_path": "SKILL_REFERENCE.md", "content": "nothing"}),
        )
        .await
        .unwrap();
    assert!(
        s.observation.is_error
            && s.observation
                .text
                .contains("SKILL_REFERENCE.md is read-only"),
        "{}",
        s.observation.text
    );
    let s = c.step(&id, "Write", json!({"file_path": "model_new.py", "content": ADD_CANDIDATE.replace("pa[i] + pb[i]", "pa[i] - pb[i]")})).await.unwrap();
    assert!(!s.observation.is_error, "{}", s.observation.text);
    let s = c.step(&id, "MultiEdit", json!({"file_path": "model_new.py", "edits": [{"old_string": "pa[i] - pb[i]", "new_string": "pa[i] + pb[i]"}]})).await.unwrap();
    assert!(!s.observation.is_error, "{}", s.observation.text);
    // The agent's own check, inside the sandbox, with the workspace's harness copy.
    let s = c
        .step(
            &id,
            "Bash",
            json!({"command": "python verify.py --device cpu", "timeout": 300000}),
        )
        .await
        .unwrap();
    assert!(
        s.observation.text.contains("PASS: ModelNew matches Model"),
        "{}",
        s.observation.text
    );
    let s = c.step(&id, "Submit", json!({})).await.unwrap();
    assert!(s.terminated && s.done && !s.truncated);
    let eval = s.info.evaluation.clone().expect("final evaluation");
    assert!(eval.correct, "{eval:?}");
    assert!(s.reward >= 1.0, "{eval:?}");
    assert!(eval.times_ms.candidate.unwrap() > 0.0 && eval.times_ms.eager.unwrap() > 0.0);

    let state = c.state(&id).await.unwrap();
    assert_eq!(state.status, env_api::EpisodeStatus::Terminated);
    assert_eq!(state.result.as_ref().map(|r| r.reward), Some(s.reward));
    let t = c.trajectory(&id).await.unwrap();
    let kinds: Vec<&str> = t.records.iter().map(|r| r.kind()).collect();
    assert_eq!(
        kinds,
        [
            "reset", "step", "step", "step", "step", "step", "step", "step", "step", "step",
            "final"
        ]
    );
    let tools: Vec<&str> = t
        .records
        .iter()
        .filter_map(|r| match r {
            env_api::TrajectoryRecord::Step { body, .. } => Some(body.action.tool.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        tools,
        [
            "TodoWrite",
            "Glob",
            "Read",
            "Read",
            "Write",
            "Write",
            "MultiEdit",
            "Bash",
            "Submit"
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restart_mid_episode_loses_no_step() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut server = Server::start(&data, &["--skip-compile"]);
    let c = server.client();
    let reset = c
        .reset(&ResetRequest {
            task: Some("L1/1_ReLU".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = reset.episode_id;
    c.step_with_id(&id, "Bash", json!({"command": "echo one"}), "req-1")
        .await
        .unwrap();
    c.step(&id, "Glob", json!({"pattern": "*"})).await.unwrap();
    server.kill();

    let server = Server::start(&data, &["--skip-compile"]);
    let c = server.client();
    let state = c.state(&id).await.unwrap();
    assert_eq!(state.status, env_api::EpisodeStatus::Truncated);
    assert_eq!(state.truncation_reason.as_deref(), Some("server_restart"));
    assert_eq!(state.turn, 2);
    let t = c.trajectory(&id).await.unwrap();
    let kinds: Vec<&str> = t.records.iter().map(|r| r.kind()).collect();
    assert_eq!(kinds, ["reset", "step", "step", "truncated"]);
    // The retried request still answers as before; a new step is refused.
    let again = c
        .step_with_id(&id, "Bash", json!({"command": "echo one"}), "req-1")
        .await
        .unwrap();
    assert!(again.info.replayed);
    assert!(
        again.observation.text.starts_with("one\n[199 of 200"),
        "{}",
        again.observation.text
    );
    let err = c
        .step(&id, "Glob", json!({"pattern": "*"}))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("episode_ended"), "{err}");
    // The workspace of the interrupted episode is cleaned up.
    assert!(!data.join("episodes").join(&id).exists());
    // And a new episode works.
    let reset = c
        .reset(&ResetRequest {
            options: Some(ResetOptions {
                max_turns: Some(3),
                time_budget_s: None,
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(reset.info.limits.max_turns, 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn evaluate_scores_right_wrong_and_inline_tasks() {
    let dir = tempfile::tempdir().unwrap();
    // A timing budget shorter than any round: the judge times its minimum of rounds.
    let server = Server::start(&dir.path().join("data"), &["--timing-budget-s", "0.001"]);
    let c = server.client();
    let right = c
        .evaluate(&EvaluateRequest {
            task: TaskRef::Id("L1/2_Add".into()),
            solution: SolutionRef::Text(ADD_CANDIDATE.into()),
            options: None,
        })
        .await
        .unwrap();
    assert!(right.correct, "{right:?}");
    assert!(right.reward >= 1.0);
    assert!(
        right.times_ms.compile.is_some(),
        "torch.compile baseline timed: {right:?}"
    );
    assert!(right.speedup.eager.is_some());
    // `Options.min_rounds` of skills/cuda_agent_judge.py.
    let rounds = right.details.check.as_ref().map(|c| c["rounds"].clone());
    assert_eq!(rounds, Some(json!(10)), "{right:?}");
    // The same sources again: the build is found in the cache.
    let again = c
        .evaluate(&EvaluateRequest {
            task: TaskRef::Id("L1/2_Add".into()),
            solution: SolutionRef::Text(ADD_CANDIDATE.into()),
            options: None,
        })
        .await
        .unwrap();
    assert!(again.correct, "{again:?}");
    assert_eq!(again.details.build_cache_hit, Some(true), "{again:?}");

    // The kernels/ layout: sources and a header compiled into one module, `import kernels_ext`.
    let files = [
        ("kernels/add.h".to_string(), "#pragma once\n#include <torch/extension.h>\ntorch::Tensor add(torch::Tensor a, torch::Tensor b);\n".to_string()),
        (
            "kernels/add.cpp".to_string(),
            "#include \"add.h\"\ntorch::Tensor add(torch::Tensor a, torch::Tensor b) {\n  auto o = torch::empty_like(a);\n  const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* z = o.data_ptr<float>();\n  for (int64_t i = 0; i < a.numel(); ++i) z[i] = x[i] + y[i];\n  return o;\n}\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"add\", &add); }\n".to_string(),
        ),
        (
            "model_new.py".to_string(),
            "import torch\nimport kernels_ext\nclass ModelNew(torch.nn.Module):\n    def forward(self, a, b):\n        return kernels_ext.add(a.contiguous(), b.contiguous())\n".to_string(),
        ),
    ];
    let layout = c
        .evaluate(&EvaluateRequest {
            task: TaskRef::Id("L1/2_Add".into()),
            solution: SolutionRef::Files {
                files: files.into_iter().collect(),
            },
            options: None,
        })
        .await
        .unwrap();
    assert!(layout.correct, "{layout:?}");
    assert!(layout.reward >= 1.0);

    let wrong = c
        .evaluate(&EvaluateRequest {
            task: TaskRef::Id("L1/2_Add".into()),
            solution: SolutionRef::Text(
                ADD_CANDIDATE
                    .replace("pa[i] + pb[i]", "pa[i] + pb[i] * 1.001f")
                    .replace("e2e_add", "e2e_add_wrong"),
            ),
            options: None,
        })
        .await
        .unwrap();
    assert!(!wrong.correct);
    assert_eq!(wrong.reward, -1.0);
    let reason = wrong.reason.unwrap();
    assert!(
        reason.starts_with("wrong_output: input set 1 of 5"),
        "{reason}"
    );

    let broken = c
        .evaluate(&EvaluateRequest {
            task: TaskRef::Id("L1/2_Add".into()),
            solution: SolutionRef::Text("import nonexistent_module\n".into()),
            options: None,
        })
        .await
        .unwrap();
    assert_eq!(broken.reward, -1.0);
    assert!(broken.reason.unwrap().starts_with("compile:"));

    // A user's own module, inline; PyTorch compute in the forward breaks rule 1.
    let source = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x * 2\ndef get_inputs():\n    return [torch.randn(64)]\ndef get_init_inputs():\n    return []\n";
    let cheat = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x * 2\n";
    let r = c
        .evaluate(&EvaluateRequest {
            task: TaskRef::Source {
                source: source.into(),
            },
            solution: SolutionRef::Text(cheat.into()),
            options: None,
        })
        .await
        .unwrap();
    assert_eq!(r.reward, -1.0);
    assert!(
        r.reason
            .as_deref()
            .unwrap_or("")
            .starts_with("pytorch_compute"),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tampering_with_the_workspace_harness_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (server, id) = add_episode(dir.path()).await;
    let c = server.client();
    // A wrong candidate (a * b) that, when imported in the evaluation sandbox, tries to
    // replace the reference task with one that agrees with it, and to rewrite the harness.
    let tamper = r#"
import pathlib
_here = pathlib.Path(__file__).resolve().parent
_task = _here.parent / "task.py"
def _fake():
    _task.write_text(_task.read_text().replace("return a + b", "return a * b"))
def _swap():
    fake = _task.read_text().replace("return a + b", "return a * b")
    _task.unlink()
    _task.write_text(fake)
for _attempt in (_fake, _swap):
    try:
        _attempt()
    except OSError:
        pass
import sys
for _f in pathlib.Path(sys.argv[0]).resolve().parent.glob("*.py"):
    if _f.name == "model_new.py":
        continue
    try:
        _f.write_text("print('{}')")
    except OSError:
        pass
"#;
    let wrong = ADD_CANDIDATE
        .replace("pa[i] + pb[i]", "pa[i] * pb[i]")
        .replace("e2e_add", "e2e_mul")
        + tamper;
    c.step(
        &id,
        "Write",
        json!({"file_path": "model_new.py", "content": wrong}),
    )
    .await
    .unwrap();
    let fake = "import json; print(json.dumps({'correct': True}))";
    let s = c
        .step(&id, "Bash", json!({"command": format!("chmod u+w verify.py cuda_agent_harness.py; rm -f verify.py cuda_agent_harness.py; echo \"{fake}\" > verify.py; cat verify.py")}))
        .await
        .unwrap();
    assert!(
        s.observation.text.contains("restored"),
        "{}",
        s.observation.text
    );
    let s = c
        .step(
            &id,
            "Bash",
            json!({"command": "python verify.py --device cpu", "timeout": 300000}),
        )
        .await
        .unwrap();
    assert!(
        s.observation.text.contains("FAIL: wrong_output"),
        "the workspace copy is pristine again: {}",
        s.observation.text
    );
    let s = c.step(&id, "Submit", json!({})).await.unwrap();
    assert_eq!(s.reward, -1.0, "{:?}", s.info.evaluation);
    let reason = s.info.evaluation.unwrap().reason.unwrap();
    assert!(
        reason.starts_with("wrong_output: input set 1 of 5"),
        "{reason}"
    );
}

/// A task may allow PyTorch operators (`ALLOW_OPS` in its model.py); the agent's copy of
/// model.py is its own to edit, and widening the list there allows nothing: the judge reads
/// the server's copy of the task. A candidate whose sum is PyTorch's `add`, with a no-op call
/// into its extension, fails `pytorch_compute` after the agent allowed `add` in its workspace.
#[tokio::test(flavor = "multi_thread")]
async fn widening_allow_ops_in_the_workspace_allows_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (server, id) = add_episode(dir.path()).await;
    let c = server.client();
    let s = c
        .step(
            &id,
            "Bash",
            json!({"command": "cat model.py > m.py && rm -f model.py && { cat m.py; printf '\\nALLOW_OPS = (\"add\",)\\n'; } > model.py; tail -n 1 model.py"}),
        )
        .await
        .unwrap();
    assert!(
        s.observation.text.contains("ALLOW_OPS = (\"add\",)"),
        "{}",
        s.observation.text
    );
    let torch_add =
        ADD_CANDIDATE.replace("        return out\n", "        return torch.add(a, b)\n");
    assert_ne!(torch_add, ADD_CANDIDATE);
    c.step(
        &id,
        "Write",
        json!({"file_path": "model_new.py", "content": torch_add}),
    )
    .await
    .unwrap();
    let s = c.step(&id, "Submit", json!({})).await.unwrap();
    assert_eq!(s.reward, -1.0, "{:?}", s.info.evaluation);
    let reason = s.info.evaluation.unwrap().reason.unwrap();
    assert!(reason.starts_with("pytorch_compute"), "{reason}");
}

/// The tiny family: same tools, flow and reward shape, judged without PyTorch.
#[tokio::test(flavor = "multi_thread")]
async fn tiny_family_episodes_and_evaluate() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &["--skip-compile"]);
    let c = server.client();
    let tasks = c.tasks().await.unwrap();
    assert!(
        tasks.splits.contains(&"tiny".to_string()),
        "{:?}",
        tasks.splits
    );
    let reset = c
        .reset(&ResetRequest {
            split: Some("tiny".into()),
            seed: Some(3),
            ..Default::default()
        })
        .await
        .unwrap();
    let task = reset.info.task.id.clone();
    assert!(task.starts_with("tiny/"), "{task}");
    let word = task.rsplit('_').next().unwrap().to_string();
    assert!(
        reset
            .observation
            .text
            .contains(&format!("Write the word {word} into answer.txt")),
        "{}",
        reset.observation.text
    );
    let s = c
        .step(
            &reset.episode_id,
            "Write",
            json!({"file_path": "answer.txt", "content": word}),
        )
        .await
        .unwrap();
    assert!(!s.observation.is_error, "{}", s.observation.text);
    let s = c
        .step(&reset.episode_id, "Submit", json!({}))
        .await
        .unwrap();
    assert!(s.terminated);
    assert_eq!(s.reward, 1.0, "{:?}", s.info.evaluation);

    // Submitting without the file, and with the wrong word, both cost -1 with a reason.
    let reset = c
        .reset(&ResetRequest {
            task: Some(task.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    let s = c
        .step(&reset.episode_id, "Submit", json!({}))
        .await
        .unwrap();
    assert_eq!(s.reward, -1.0);
    assert!(s
        .info
        .evaluation
        .unwrap()
        .reason
        .unwrap()
        .starts_with("missing_solution"));
    let r = c
        .evaluate(&EvaluateRequest {
            task: TaskRef::Id(task.clone()),
            solution: SolutionRef::Text("nope".into()),
            options: None,
        })
        .await
        .unwrap();
    assert_eq!((r.reward, r.correct), (-1.0, false));
    let r = c
        .evaluate(&EvaluateRequest {
            task: TaskRef::Id(task),
            solution: SolutionRef::Text(format!("{word}\n")),
            options: None,
        })
        .await
        .unwrap();
    assert_eq!(r.reward, 1.0);
    // Kernel tasks stay the default split.
    let reset = c
        .reset(&ResetRequest {
            seed: Some(3),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        reset.info.task.id.starts_with('L'),
        "{}",
        reset.info.task.id
    );
}
