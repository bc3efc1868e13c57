//! What a model is asked and what is read from its answer: the prompt (a sample of seed
//! operators and the task format) and the task's code (the fenced block that defines
//! `Model`).

use super::chat::{Message, Role};

/// The instructions every prompt starts with.
const SYSTEM: &str = "You write PyTorch benchmark tasks in KernelBench format: a Python file \
defining `Model(nn.Module)`, `get_inputs()` and `get_init_inputs()`. Engineers will write fast \
CUDA kernels for your tasks, so each task must be a realistic fused computation worth a kernel.";

/// The file layout a task must follow (the bundled suite's).
const TEMPLATE: &str = r#"import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SMALL = os.environ.get("CUDA_AGENT_TASK_SIZE") == "small"
BATCH, DIM = (61, 127) if SMALL else (8192, 4096)  # small sizes, full sizes


class Model(nn.Module):
    """One line: what the model computes."""

    def __init__(self, dim: int):
        super().__init__()
        ...  # layers, if any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...  # the fused operators


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return [DIM]


def get_inputs_alt():
    """A second shape: the batch odd and about half, the output's shape different."""
    return [torch.randn(BATCH // 2 | 1, DIM)]"#;

/// A random stream for sampling operators (SplitMix64: any seed spreads well).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// `k` distinct operators of `pool` for request `request`: the same seed and request give the
/// same sample.
pub fn sample_ops(pool: &[String], k: usize, seed: u64, request: u64) -> Vec<String> {
    let mut names: Vec<&String> = pool.iter().collect();
    names.sort();
    names.dedup();
    let mut rng = SplitMix(seed ^ request.wrapping_mul(0xD1B5_4A32_D192_ED03));
    let k = k.min(names.len());
    // The first k places of a Fisher-Yates shuffle.
    for i in 0..k {
        let j = i + (rng.next() % (names.len() - i) as u64) as usize;
        names.swap(i, j);
    }
    names[..k].iter().map(|s| s.to_string()).collect()
}

/// The conversation asking for one fused task built from `ops`, sized for `device`.
pub fn prompt(ops: &[String], device: &str) -> Vec<Message> {
    let list: String = ops.iter().map(|o| format!("- {o}\n")).collect();
    let device = match device {
        "cuda" => "GPU",
        "cpu" => "CPU",
        other => other,
    };
    let user = format!(
        "Seed operators (PyTorch; `Tensor.x` is a tensor method, `F` is torch.nn.functional):\n\
{list}\n\
Write one new task that fuses 2 to 5 operators, at least two of them from this list, into a \
single `Model.forward` (chains, parallel branches merged by arithmetic, residuals, a layer such \
as nn.Linear or nn.Conv2d where shapes call for one). Rules:\n\
- Follow this layout exactly, including SMALL, get_inputs_alt and the module-level size constants:\n\
```python\n{TEMPLATE}\n```\n\
- With the full sizes, eager PyTorch takes between 1 and 100 ms on a {device}; the small sizes \
run in a few ms on a CPU.\n\
- Deterministic: no random numbers in forward, no dropout.\n\
- The output depends on the inputs and is finite (no constant result, no NaN).\n\
- torch.compile must accept it; import only torch, math and os.\n\
- It must not be a plain copy of a well-known task (Linear+ReLU, Conv2d+BatchNorm+ReLU...).\n\
Answer with the whole file in one ```python block."
    );
    vec![
        Message {
            role: Role::System,
            content: SYSTEM.into(),
        },
        Message {
            role: Role::User,
            content: user,
        },
    ]
}

/// Why an answer yields no code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoCode {
    /// No fenced block at all.
    #[error("the answer holds no fenced code block")]
    NoBlock,
    /// A block opened and never closed (the completion was cut off).
    #[error("the answer's code block is not closed (cut off?)")]
    Unclosed,
    /// Blocks, none defining `class Model`.
    #[error("no code block defines class Model")]
    NoModel,
}

/// The task's code in an answer: the last fenced block that defines `class Model` (a model
/// that revises itself puts the revision last). Reasoning between `<think>` tags is skipped.
pub fn extract_code(answer: &str) -> Result<String, NoCode> {
    let text = match answer.rfind("</think>") {
        Some(i) => &answer[i + "</think>".len()..],
        None => answer,
    };
    let mut blocks = Vec::new();
    let mut lines = text.lines();
    let mut unclosed = false;
    while let Some(line) = lines.next() {
        if !line.trim_start().starts_with("```") {
            continue;
        }
        let mut body = String::new();
        let mut closed = false;
        for l in lines.by_ref() {
            if l.trim_start().starts_with("```") {
                closed = true;
                break;
            }
            body.push_str(l);
            body.push('\n');
        }
        if closed {
            blocks.push(body);
        } else {
            unclosed = true;
        }
    }
    if blocks.is_empty() {
        return Err(if unclosed {
            NoCode::Unclosed
        } else {
            NoCode::NoBlock
        });
    }
    blocks
        .into_iter()
        .rev()
        .find(|b| b.lines().any(|l| l.starts_with("class Model")))
        .ok_or(NoCode::NoModel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_block_defining_model_is_taken() {
        let answer = "<think>```python\nclass Model: draft\n```</think>Here:\n```python\nimport torch\nclass Model(nn.Module):\n    pass\n```\nand a usage example:\n```\nModel()(x)\n```\n";
        assert_eq!(
            extract_code(answer).unwrap(),
            "import torch\nclass Model(nn.Module):\n    pass\n"
        );
        assert_eq!(extract_code("just words"), Err(NoCode::NoBlock));
        assert_eq!(
            extract_code("```python\nclass Model:\n"),
            Err(NoCode::Unclosed)
        );
        assert_eq!(extract_code("```\nx = 1\n```"), Err(NoCode::NoModel));
    }

    #[test]
    fn samples_are_distinct_and_replayable() {
        let pool: Vec<String> = (0..50).map(|i| format!("op{i}")).collect();
        let a = sample_ops(&pool, 8, 3, 7);
        assert_eq!(a, sample_ops(&pool, 8, 3, 7));
        assert_ne!(a, sample_ops(&pool, 8, 3, 8));
        let mut d = a.clone();
        d.sort();
        d.dedup();
        assert_eq!(d.len(), 8);
        assert_eq!(sample_ops(&pool[..3], 8, 0, 0).len(), 3);
    }

    #[test]
    fn the_prompt_names_the_operators_and_the_device() {
        let m = prompt(&["F.gelu".into(), "Tensor.cumsum".into()], "cuda");
        assert_eq!(m.len(), 2);
        assert!(m[1].content.contains("- F.gelu\n- Tensor.cumsum\n"));
        assert!(m[1].content.contains("1 and 100 ms on a GPU"));
        assert!(m[1].content.contains("def get_inputs_alt():"));
    }
}
