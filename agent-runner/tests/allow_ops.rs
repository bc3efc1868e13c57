//! `optimize --allow-ops`: the operators a user lets ModelNew keep are written into the task
//! (its ALLOW_OPS), checked as names first.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use agent_runner::optimize::{task_source, with_allowed_ops};

const PLAIN: &str = "import torch\nimport torch.nn as nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n\n    def forward(self, x):\n        return torch.relu(self.fc(x))\n";

#[test]
fn allowed_operators_become_the_tasks_allow_ops() {
    let source = task_source(PLAIN, &[vec![4, 8]], None).unwrap();
    let ops = [
        "mm".to_string(),
        " aten::addmm".to_string(),
        "mm".to_string(),
    ];
    let with = with_allowed_ops(source.clone(), &ops).unwrap();
    assert!(with.starts_with(&source));
    assert!(
        with.ends_with("ALLOW_OPS = (\"mm\", \"addmm\",)\n"),
        "{with}"
    );
    kernelbench::validate_source("module", &with).unwrap();
    assert_eq!(with_allowed_ops(source.clone(), &[]).unwrap(), source);
}

#[test]
fn a_bad_operator_name_or_a_second_list_is_refused() {
    let source = task_source(PLAIN, &[vec![4, 8]], None).unwrap();
    let err = with_allowed_ops(source.clone(), &["mm; import os".to_string()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("not an aten operator name"), "{err}");
    let own = format!("{source}\nALLOW_OPS = ('mm',)\n");
    let err = with_allowed_ops(own, &["addmm".to_string()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("sets ALLOW_OPS itself"), "{err}");
}
