//! What the agent reads: a scripted episode played as a model would play it, against the real
//! server binary (real sandbox, real harness, real torch on CPU), with every observation's text
//! checked: compiler errors once, located in the agent's files and capped; crashes with their
//! stage, signal and traceback; wrong outputs with count, first index, kind and input set;
//! weights that were not the reference's named; Edit and Grep; `import kernels_ext` in the
//! agent's own script; Submit's text with reward, verdict and times; the budget left at the end
//! of every observation; a command cut by the budget and the automatic submission; no host
//! paths anywhere.
//!
//! Builds are kept few and cheap: kernels bound with pybind11 alone (no torch headers), one
//! failing build, one kernels/ build shared by verify.py and the agent's own script, and the
//! final evaluation's build.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod server;

use env_api::{ResetOptions, ResetRequest, StepResponse};
use serde_json::{json, Value};
use server::Server;

/// Largest observation of a failing build: the error lines with their context, 4 KB of it
/// at most, plus the JSON verdict and the budget line.
const MAX_BUILD_ERROR_OBSERVATION: usize = 5_000;

/// A load_inline source without torch headers (pybind11 alone, the fast path SKILL.md
/// describes), with a compile error on the line that holds `n_rows * 2;` (no such name).
const INLINE_BROKEN: &str = r#"import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <cstdint>
#include <pybind11/pybind11.h>
static void scale(std::uintptr_t x, std::int64_t n) {
    float* p = reinterpret_cast<float*>(x);
    for (std::int64_t i = 0; i < n; ++i) p[i] *= 2.0f;
    return n_rows * 2;
}
PYBIND11_MODULE(obs_inline, m) { m.def("scale", &scale); }
"""
ext = load_inline(name="obs_inline", cpp_sources=SRC, no_implicit_headers=True)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return ext.scale(x.data_ptr(), x.numel())
"#;

/// kernels/linear.cpp: y = x W^T + b on raw pointers, a version that skips the tail of each
/// row (columns past the last multiple of 8), and one that crashes.
const KERNEL: &str = r#"#include <cstdint>
#include <pybind11/pybind11.h>

using P = std::uintptr_t;
using I = std::int64_t;

static void linear(P x, P w, P b, P y, I rows, I in, I out, I step) {
    auto px = reinterpret_cast<const float*>(x), pw = reinterpret_cast<const float*>(w);
    auto pb = reinterpret_cast<const float*>(b);
    auto py = reinterpret_cast<float*>(y);
    I cols = out / step * step;
    for (I r = 0; r < rows; ++r)
        for (I c = 0; c < cols; ++c) {
            float acc = pb[c];
            for (I k = 0; k < in; ++k) acc += px[r * in + k] * pw[c * in + k];
            py[r * out + c] = acc;
        }
}

static void crash(P y) { *reinterpret_cast<volatile float*>(y & 0) = 1.0f; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("linear", &linear);
    m.def("crash", &crash);
}
"#;

/// model_new.py over kernels/: `step` selects the tail bug (8) or none (1); `name` the
/// attribute the nn.Linear lives under (the reference's is `linear`; another name with one
/// more random draw before it gets other weights, as an agent's rewrite easily does).
fn model_new(step: u32, name: &str, crash: bool) -> String {
    let call = if crash {
        "kernels_ext.crash(y.data_ptr())\n        "
    } else {
        ""
    };
    let draw = if name == "linear" {
        ""
    } else {
        "torch.randn(1)\n        "
    };
    format!(
        r#"import torch
import torch.nn as nn
import kernels_ext


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        {draw}self.{name} = nn.Linear(in_features, out_features)

    def forward(self, x):
        x = x.contiguous()
        lin = self.{name}
        y = torch.full((x.shape[0], lin.out_features), float("nan"))
        {call}kernels_ext.linear(x.data_ptr(), lin.weight.data_ptr(), lin.bias.data_ptr(), y.data_ptr(),
                           x.shape[0], lin.in_features, lin.out_features, {step})
        return y
"#
    )
}

/// Checks every observation shares: it ends with the budget line, and no path of the server
/// shows.
fn common(s: &StepResponse, data_dir: &str) -> String {
    let text = s.observation.text.clone();
    // Shown with --nocapture: what the agent read, and its size.
    eprintln!(
        "--- {} ({} bytes)\n{text}",
        s.observation.tool.as_deref().unwrap_or("reset"),
        text.len()
    );
    let last = text.lines().last().unwrap_or_default();
    assert!(
        last.starts_with('[')
            && last.contains("tool calls left;")
            && last.contains("tool time left]"),
        "the last line is the budget: {text}"
    );
    assert!(!text.contains(data_dir), "a host path: {text}");
    assert!(!text.contains("/episodes/"), "a host path: {text}");
    text
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_reads_what_it_needs() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &["--skip-compile"]);
    let data_dir = std::fs::canonicalize(&data).unwrap().display().to_string();
    let c = server.client();
    let reset = c
        .reset(&ResetRequest {
            task: Some("L1/17_Linear".into()),
            options: Some(ResetOptions {
                max_turns: Some(40),
                time_budget_s: Some(900.0),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = reset.episode_id.clone();
    let prompt = &reset.observation.text;
    assert!(prompt.contains("submitted as it is"), "{prompt}");
    assert!(
        prompt
            .trim_end()
            .ends_with("[40 of 40 tool calls left; 900 s of 900 s tool time left]"),
        "{prompt}"
    );
    let names: Vec<&str> = reset
        .info
        .tools
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"Edit") && names.contains(&"Grep"),
        "{names:?}"
    );
    let step = |tool: &'static str, args: Value| {
        let c = c.clone();
        let id = id.clone();
        async move { c.step(&id, tool, args).await.unwrap() }
    };
    let verify = json!({"command": "python verify.py --trials 1", "timeout": 300000});

    // 1. A compile error in a load_inline source: once, raw, at its line in model_new.py.
    let s = step(
        "Write",
        json!({"file_path": "model_new.py", "content": INLINE_BROKEN}),
    )
    .await;
    let t = common(&s, &data_dir);
    assert!(t.starts_with("Updated model_new.py"), "{t}");
    let s = step("Bash", verify.clone()).await;
    let t = common(&s, &data_dir);
    let broken_line = INLINE_BROKEN
        .lines()
        .position(|l| l.contains("n_rows * 2"))
        .unwrap()
        + 1;
    let located = format!("model_new.py:{broken_line}:");
    assert!(t.contains(&located), "error located at {located}: {t}");
    assert!(t.contains("error:") && t.contains("n_rows"), "{t}");
    assert_eq!(
        t.matches("n_rows’ was not declared").count()
            + t.matches("n_rows' was not declared").count(),
        1,
        "once: {t}"
    );
    assert!(!t.contains("\\n"), "not JSON-escaped: {t}");
    assert!(!t.contains("main.cpp"), "no generated file: {t}");
    assert!(
        t.len() < MAX_BUILD_ERROR_OBSERVATION,
        "{} bytes: {t}",
        t.len()
    );

    // 2. Edit fixes it (the build then passes; the forward is no linear, so it is wrong).
    let s = step(
        "Edit",
        json!({"file_path": "model_new.py", "old_string": "    return n_rows * 2;\n", "new_string": ""}),
    )
    .await;
    let t = common(&s, &data_dir);
    assert!(
        t.starts_with("Edited model_new.py: 1 replacement(s)"),
        "{t}"
    );

    // 3. kernels/ with a missing tail: count, share, first index, NaN, which input set.
    step(
        "Write",
        json!({"file_path": "kernels/linear.cpp", "content": KERNEL}),
    )
    .await;
    let s = step(
        "Write",
        json!({"file_path": "model_new.py", "content": model_new(8, "linear", false)}),
    )
    .await;
    common(&s, &data_dir);
    // The agent's own script imports the same build.
    let s = step(
        "Bash",
        json!({"command": "python -c 'import kernels_ext; print(\"bound:\", sorted(n for n in dir(kernels_ext) if not n.startswith(\"_\")))'", "timeout": 300000}),
    )
    .await;
    let t = common(&s, &data_dir);
    assert!(t.contains("bound: ['crash', 'linear']"), "{t}");
    let s = step("Bash", verify.clone()).await;
    let t = common(&s, &data_dir);
    // 687 columns, 680 written per row: 7 NaN in each of 509 rows.
    assert!(
        t.contains(
            "FAIL: wrong_output: input set 1 of 1: output 0: 3563 of 349683 elements (1.02%)"
        ),
        "{t}"
    );
    assert!(t.contains("NaN where the reference has numbers"), "{t}");
    assert!(t.contains("first at index [0, 680]"), "{t}");
    assert!(
        !t.contains("[weights:"),
        "the weights were the reference's: {t}"
    );

    // 4. The weights under another name: a wrong output that says so.
    let s = step(
        "Write",
        json!({"file_path": "model_new.py", "content": model_new(1, "fc", false)}),
    )
    .await;
    common(&s, &data_dir);
    let s = step("Bash", verify.clone()).await;
    let t = common(&s, &data_dir);
    assert!(t.contains("FAIL: wrong_output"), "{t}");
    assert!(
        t.contains("the reference's linear.bias, linear.weight matched no parameter of ModelNew"),
        "{t}"
    );
    assert!(
        t.contains("ModelNew's fc.bias, fc.weight kept their own initialisation"),
        "{t}"
    );

    // 5. A segfault in the forward: stage, signal, the Python frame that called the kernel.
    let s = step(
        "Write",
        json!({"file_path": "model_new.py", "content": model_new(1, "linear", true)}),
    )
    .await;
    common(&s, &data_dir);
    let s = step("Bash", verify.clone()).await;
    let t = common(&s, &data_dir);
    assert!(t.contains("FAIL: worker_died"), "{t}");
    assert!(t.contains("during check (run)"), "the stage: {t}");
    assert!(t.contains("SIGSEGV"), "the signal: {t}");
    assert!(t.contains("Fatal Python error: Segmentation fault"), "{t}");
    let crash_line = model_new(1, "linear", true)
        .lines()
        .position(|l| l.contains("kernels_ext.crash"))
        .unwrap()
        + 1;
    assert!(
        t.contains(&format!("model_new.py\", line {crash_line} in forward")),
        "the frame: {t}"
    );

    // 6. Grep finds the call; Edit removes it.
    let s = step(
        "Grep",
        json!({"pattern": "crash", "output_mode": "content", "-n": true, "path": "model_new.py"}),
    )
    .await;
    let t = common(&s, &data_dir);
    assert!(
        t.starts_with(&format!(
            "model_new.py:{crash_line}:        kernels_ext.crash(y.data_ptr())\n["
        )),
        "{t}"
    );
    let s = step(
        "Edit",
        json!({"file_path": "model_new.py", "old_string": "kernels_ext.crash(y.data_ptr())\n        ", "new_string": ""}),
    )
    .await;
    common(&s, &data_dir);

    // 7. Submit: the reward, the verdict and the times, in the text.
    let s = step("Submit", json!({})).await;
    assert!(s.terminated, "{:?}", s.info);
    let t = common(&s, &data_dir);
    let eval = s.info.evaluation.clone().unwrap();
    assert!(eval.correct, "{eval:?}");
    assert!(
        t.contains(&format!("Evaluation: reward {}", eval.reward)),
        "{t}"
    );
    assert!(t.contains("correct"), "{t}");
    assert!(
        t.contains("median times: candidate ") && t.contains(" ms, eager "),
        "{t}"
    );
    assert!(t.contains("x over eager (90% band "), "{t}");
    assert!(t.contains("[episode ended; "), "{t}");
    assert!(t.len() < 1_000, "{} bytes: {t}", t.len());

    // 8. A command cut by the budget: it says so, and the episode submits by itself.
    let reset = c
        .reset(&ResetRequest {
            task: Some("L1/2_Add".into()),
            options: Some(ResetOptions {
                max_turns: Some(10),
                time_budget_s: Some(2.0),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let s = c
        .step(
            &reset.episode_id,
            "Bash",
            json!({"command": "echo working; sleep 60", "timeout": 120000}),
        )
        .await
        .unwrap();
    assert!(s.truncated && s.done, "{:?}", s.info);
    let t = common(&s, &data_dir);
    assert!(t.starts_with("working\n"), "{t}");
    assert!(t.contains("the episode's tool-time budget ran out"), "{t}");
    assert!(t.contains("the tool-time budget of 2 s is spent: the episode ends and model_new.py is submitted as it is"), "{t}");
    assert!(
        t.contains("Evaluation: reward -1 (failed)\nmissing_solution"),
        "{t}"
    );
    assert!(
        t.contains("[episode ended; 9 of 10 tool calls left; 0 s of 2 s tool time left]"),
        "{t}"
    );
    // The same in `info`, for frameworks that show it.
    assert_eq!((s.info.turns_left, s.info.tool_time_left_s), (9, 0.0));
}
