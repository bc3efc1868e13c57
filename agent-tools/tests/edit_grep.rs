//! `Edit` and `Grep`: Claude Code's single-replacement edit and ripgrep-style search, with
//! the workspace's path rules.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::symlink;

use agent_tools::{CallError, ToolCall};
use common::{fixture, grep_data};
use serde_json::json;

#[tokio::test]
async fn edit_replaces_exactly_one_occurrence_or_nothing() {
    let mut f = fixture();
    std::fs::write(f.root.join("a.py"), "x = 1\ny = 1\n").unwrap();
    let out = f
        .call(
            "Edit",
            json!({"file_path": "a.py", "old_string": "x = 1", "new_string": "x = 2"}),
        )
        .await;
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(out.text, "Edited a.py: 1 replacement(s)");
    // "= 1" is now on one line only; "y" twice would be ambiguous.
    std::fs::write(f.root.join("b.py"), "t t\n").unwrap();
    let out = f
        .call(
            "Edit",
            json!({"file_path": "b.py", "old_string": "t", "new_string": "u"}),
        )
        .await;
    assert!(out.is_error);
    assert!(out.text.contains("appears 2 times"), "{}", out.text);
    assert!(out.text.contains("b.py was not changed"), "{}", out.text);
    assert_eq!(
        std::fs::read_to_string(f.root.join("b.py")).unwrap(),
        "t t\n"
    );
    let out = f
        .call(
            "Edit",
            json!({"file_path": "b.py", "old_string": "t", "new_string": "u", "replace_all": true}),
        )
        .await;
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(
        std::fs::read_to_string(f.root.join("b.py")).unwrap(),
        "u u\n"
    );
    // An empty old_string creates a missing file; a missing string is named.
    let out = f
        .call(
            "Edit",
            json!({"file_path": "kernels/k.cpp", "old_string": "", "new_string": "int k;\n"}),
        )
        .await;
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(out.text, "Created kernels/k.cpp");
    let out = f
        .call(
            "Edit",
            json!({"file_path": "a.py", "old_string": "zzz", "new_string": "w"}),
        )
        .await;
    assert!(
        out.is_error && out.text.contains("not found"),
        "{}",
        out.text
    );
}

#[tokio::test]
async fn an_edit_that_cannot_place_old_string_shows_it_and_the_closest_text() {
    let mut f = fixture();
    let src = "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n";
    std::fs::write(f.root.join("m.py"), src).unwrap();
    // Indented other than the file: the same text, found, and said to differ in whitespace.
    let out = f
        .call(
            "Edit",
            json!({"file_path": "m.py", "old_string": "  def forward(self, x):\n      return torch.relu(x)", "new_string": "pass"}),
        )
        .await;
    assert!(out.is_error);
    assert!(out.text.contains("m.py was not changed"), "{}", out.text);
    assert!(
        out.text.contains("    |  def forward(self, x):"),
        "the old_string is echoed: {}",
        out.text
    );
    assert!(
        out.text
            .contains("other indentation or spacing in m.py, lines 4-5:"),
        "{}",
        out.text
    );
    assert!(
        out.text.contains("     4|    def forward(self, x):"),
        "{}",
        out.text
    );
    // A near miss: the closest line, with its number.
    let out = f
        .call(
            "Edit",
            json!({"file_path": "m.py", "old_string": "return torch.relu(y)", "new_string": "pass"}),
        )
        .await;
    assert!(
        out.text.contains("the closest text in m.py, line 5:"),
        "{}",
        out.text
    );
    assert!(
        out.text.contains("     5|        return torch.relu(x)"),
        "{}",
        out.text
    );
    // Nothing like it.
    let out = f
        .call(
            "Edit",
            json!({"file_path": "m.py", "old_string": "qqqq wwww", "new_string": "pass"}),
        )
        .await;
    assert!(
        out.text.contains("nothing in m.py resembles it"),
        "{}",
        out.text
    );
    // Not unique: where each copy starts.
    let out = f
        .call(
            "Edit",
            json!({"file_path": "m.py", "old_string": "torch", "new_string": "T"}),
        )
        .await;
    assert!(out.text.contains("appears 3 times"), "{}", out.text);
    assert!(out.text.contains("    |torch\n"), "{}", out.text);
    assert!(
        out.text.contains("starts at lines 1, 3, 5 of m.py"),
        "{}",
        out.text
    );
    // MultiEdit: the failing edit's lines count in the text the edits before it left.
    let out = f
        .call(
            "MultiEdit",
            json!({"file_path": "m.py", "edits": [
                {"old_string": "import torch\n\n", "new_string": ""},
                {"old_string": "return torch.relu(y)", "new_string": "pass"}
            ]}),
        )
        .await;
    assert!(out.text.contains("edit 2 of 2 failed"), "{}", out.text);
    assert!(
        out.text
            .contains("m.py (as the edits before it left it), line 3:"),
        "{}",
        out.text
    );
    assert_eq!(std::fs::read_to_string(f.root.join("m.py")).unwrap(), src);
}

#[tokio::test]
async fn a_missing_file_is_named_with_what_to_do() {
    let mut f = fixture();
    let out = f.call("Read", json!({"file_path": "model_ne.py"})).await;
    assert!(out.is_error);
    assert!(
        out.text
            .contains("model_ne.py: no such file or directory in the workspace"),
        "{}",
        out.text
    );
    assert!(out.text.contains("Glob"), "{}", out.text);
    assert!(!out.text.contains("entity not found"), "{}", out.text);
    let out = f
        .call("Grep", json!({"pattern": "x", "path": "nowhere"}))
        .await;
    assert!(out.is_error);
    assert!(!out.text.contains("entity not found"), "{}", out.text);
    assert!(out.text.contains("nowhere"), "{}", out.text);
}

#[tokio::test]
async fn edit_keeps_the_path_rules() {
    let mut f = fixture();
    let out = f
        .call(
            "Edit",
            json!({"file_path": "model.py", "old_string": "Model", "new_string": "M"}),
        )
        .await;
    assert!(
        out.is_error && out.text.contains("read-only"),
        "{}",
        out.text
    );
    let out = f
        .call(
            "Edit",
            json!({"file_path": "../other-ws/model_new.py", "old_string": "other", "new_string": "x"}),
        )
        .await;
    assert!(out.is_error && out.text.contains("outside"), "{}", out.text);
    symlink(&f.secret, f.root.join("link.json")).unwrap();
    let out = f
        .call(
            "Edit",
            json!({"file_path": "link.json", "old_string": "seeds", "new_string": "x"}),
        )
        .await;
    assert!(out.is_error && out.text.contains("link"), "{}", out.text);
    assert!(std::fs::read_to_string(&f.secret)
        .unwrap()
        .contains("seeds"));
    assert!(matches!(
        ToolCall::parse("Edit", &json!({"file_path": "a", "old_string": "x"})),
        Err(CallError::BadArguments { .. })
    ));
}

fn tree(f: &common::Fixture) {
    std::fs::create_dir_all(f.root.join("kernels/sub")).unwrap();
    std::fs::write(
        f.root.join("model_new.py"),
        "import torch\nclass ModelNew:\n    def forward(self, x):\n        return relu(x)\n",
    )
    .unwrap();
    std::fs::write(
        f.root.join("kernels/relu.cpp"),
        "// relu\nfloat relu(float x) {\n  return x > 0 ? x : 0;\n}\n",
    )
    .unwrap();
    std::fs::write(f.root.join("kernels/sub/RELU.h"), "#define RELU 1\n").unwrap();
    std::fs::write(f.root.join(".hidden.py"), "relu\n").unwrap();
    std::fs::write(f.root.join("blob.bin"), b"relu\0\0\0").unwrap();
}

#[tokio::test]
async fn grep_lists_files_counts_and_shows_lines_with_context() {
    let mut f = fixture();
    tree(&f);
    // Default: files with matches; hidden and binary files skipped.
    let out = f.call("Grep", json!({"pattern": "relu"})).await;
    assert!(!out.is_error, "{}", out.text);
    let lines: Vec<&str> = out.text.lines().collect();
    assert_eq!(lines[0], "Found 2 files", "{}", out.text);
    let mut files = lines[1..].to_vec();
    files.sort();
    assert_eq!(files, ["kernels/relu.cpp", "model_new.py"]);
    // -i reaches the header; a glob narrows by name; type by extension.
    let out = f
        .call(
            "Grep",
            json!({"pattern": "relu", "-i": true, "glob": "*.h"}),
        )
        .await;
    assert_eq!(
        out.text, "Found 1 files\nkernels/sub/RELU.h",
        "{}",
        out.text
    );
    let out = f
        .call(
            "Grep",
            json!({"pattern": "relu", "type": "cpp", "output_mode": "count"}),
        )
        .await;
    assert_eq!(
        out.text, "kernels/relu.cpp:2\n[2 matching lines in 1 files]",
        "{}",
        out.text
    );
    // Content: path:line:text, context with '-', groups split by '--'.
    let out = f
        .call(
            "Grep",
            json!({"pattern": "return", "output_mode": "content", "-B": 1, "path": "kernels"}),
        )
        .await;
    assert_eq!(
        out.text,
        "kernels/relu.cpp-2-float relu(float x) {\nkernels/relu.cpp:3:  return x > 0 ? x : 0;",
        "{}",
        out.text
    );
    let out = f
        .call(
            "Grep",
            json!({"pattern": "def|return", "output_mode": "content", "path": "model_new.py", "-n": false}),
        )
        .await;
    assert_eq!(
        out.text, "model_new.py:    def forward(self, x):\nmodel_new.py:        return relu(x)",
        "{}",
        out.text
    );
    // head_limit keeps the first lines and says so.
    let out = f
        .call(
            "Grep",
            json!({"pattern": "x", "output_mode": "content", "head_limit": 1, "glob": "*.py"}),
        )
        .await;
    assert_eq!(out.text.lines().count(), 2, "{}", out.text);
    assert!(
        out.text.contains("[stopped at head_limit 1]"),
        "{}",
        out.text
    );
    // multiline: a match across lines.
    let out = f
        .call(
            "Grep",
            json!({"pattern": "forward.*\\n.*return", "multiline": true, "output_mode": "content"}),
        )
        .await;
    assert!(out.text.contains("model_new.py:3:"), "{}", out.text);
    assert!(out.text.contains("model_new.py:4:"), "{}", out.text);
    let out = f.call("Grep", json!({"pattern": "no such text"})).await;
    assert_eq!(out.text, "No matches found");
}

#[tokio::test]
async fn grep_refuses_bad_patterns_and_never_leaves_the_workspace() {
    let mut f = fixture();
    tree(&f);
    let out = f.call("Grep", json!({"pattern": "("})).await;
    assert!(
        out.is_error && out.text.contains("bad regular expression"),
        "{}",
        out.text
    );
    let out = f
        .call("Grep", json!({"pattern": "x", "type": "cobol"}))
        .await;
    assert!(
        out.is_error && out.text.contains("unknown type"),
        "{}",
        out.text
    );
    let out = f
        .call("Grep", json!({"pattern": "secret", "path": "../other-ws"}))
        .await;
    assert!(out.is_error && out.text.contains("outside"), "{}", out.text);
    // A link to a file or a directory outside is never followed.
    symlink(&f.secret, f.root.join("seeds.json")).unwrap();
    symlink(&f.other_workspace, f.root.join("other")).unwrap();
    let out = f.call("Grep", json!({"pattern": "seeds|secret"})).await;
    assert_eq!(out.text, "No matches found", "{}", out.text);
    let out = f
        .call("Grep", json!({"pattern": "seeds", "path": "seeds.json"}))
        .await;
    assert!(!out.text.contains("1, 2, 3"), "{}", out.text);
    let out = f
        .call("Grep", json!({"pattern": "secret", "path": "other"}))
        .await;
    assert!(out.is_error, "{}", out.text);
}

/// A file tool aimed at a protected file names the file and where the agent's code goes;
/// the same tools on the agent's own file work.
#[tokio::test]
async fn a_write_to_a_protected_file_names_it_and_where_code_goes() {
    let mut f = fixture();
    for (tool, args) in [
        (
            "Write",
            json!({"file_path": "verify.py", "content": "print('PASS')"}),
        ),
        (
            "Edit",
            json!({"file_path": "verify.py", "old_string": "pristine", "new_string": "PASS"}),
        ),
        (
            "MultiEdit",
            json!({"file_path": "./model.py", "edits": [{"old_string": "pass", "new_string": "x = 1"}]}),
        ),
    ] {
        let out = f.call(tool, args).await;
        assert!(out.is_error, "{tool}: {}", out.text);
        assert!(
            out.text.contains("is read-only")
                && out
                    .text
                    .contains("your code goes in model_new.py and kernels/"),
            "{tool}: {}",
            out.text
        );
        assert!(
            out.text.contains("verify.py") || out.text.contains("model.py"),
            "{tool}: {}",
            out.text
        );
    }
    assert_eq!(
        std::fs::read_to_string(f.root.join("verify.py")).unwrap(),
        "print('pristine verify')\n"
    );
    let out = f
        .call(
            "Write",
            json!({"file_path": "model_new.py", "content": "class ModelNew: pass\n"}),
        )
        .await;
    assert!(!out.is_error, "{}", out.text);
}

/// Output past the cap is cut at a whole line and says how many lines it left out; the details
/// say the answer is incomplete only then.
#[tokio::test]
async fn grep_output_over_the_cap_ends_at_a_whole_line_and_says_so() {
    let mut f = fixture();
    let line = "x".repeat(39);
    let many: String = (0..4000).map(|i| format!("{line}{i:05}\n")).collect();
    std::fs::write(f.root.join("big.txt"), many).unwrap();
    std::fs::write(f.root.join("small.txt"), "one x\n").unwrap();
    let out = f
        .call(
            "Grep",
            json!({"pattern": "x", "output_mode": "content", "path": "big.txt"}),
        )
        .await;
    assert!(!out.is_error, "{}", out.text);
    let lines: Vec<&str> = out.text.lines().collect();
    let note = lines.last().unwrap();
    assert!(note.contains("more lines not shown (output cap)"), "{note}");
    let shown = &lines[..lines.len() - 1];
    assert!(shown.len() < 4000 && !shown.is_empty());
    for (i, l) in shown.iter().enumerate() {
        assert_eq!(
            *l,
            format!("big.txt:{}:{line}{i:05}", i + 1),
            "a line cut or out of order"
        );
    }
    let left: usize = note
        .trim_start_matches('[')
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(shown.len() + left, 4000, "{note}");
    let d = grep_data(&out);
    assert!(!d.complete);
    assert_eq!((d.matching_files, d.matching_lines), (1, 4000));
    let out = f
        .call(
            "Grep",
            json!({"pattern": "x", "output_mode": "count", "path": "small.txt"}),
        )
        .await;
    assert_eq!(out.text, "small.txt:1\n[1 matching lines in 1 files]");
    assert!(grep_data(&out).complete);
}
