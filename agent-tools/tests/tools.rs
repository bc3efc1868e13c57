//! Semantics and errors of each tool.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use agent_tools::{tool_schemas, CallError, ToolCall};
use common::{bash_data, edit_data, fixture, glob_data, read_data, write_data};
use serde_json::json;

#[tokio::test]
async fn multi_edit_applies_edits_in_order() {
    let mut f = fixture();
    std::fs::write(f.root.join("a.py"), "x = 1\ny = 2\n").unwrap();
    let out = f
        .call(
            "MultiEdit",
            json!({"file_path": "a.py", "edits": [
                {"old_string": "x = 1", "new_string": "x = 10"},
                {"old_string": "x = 10\ny", "new_string": "x = 10\nz"}
            ]}),
        )
        .await;
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(
        std::fs::read_to_string(f.root.join("a.py")).unwrap(),
        "x = 10\nz = 2\n"
    );
    assert_eq!(edit_data(&out).replacements, 2);
}

#[tokio::test]
async fn multi_edit_is_atomic_and_names_the_failing_edit() {
    let mut f = fixture();
    std::fs::write(f.root.join("a.py"), "a\nb\n").unwrap();
    let out = f
        .call(
            "MultiEdit",
            json!({"file_path": "a.py", "edits": [
                {"old_string": "a", "new_string": "A"},
                {"old_string": "missing", "new_string": "M"}
            ]}),
        )
        .await;
    assert!(out.is_error);
    assert!(out.text.contains("edit 2 of 2"), "{}", out.text);
    assert!(out.text.contains("not found"), "{}", out.text);
    assert_eq!(
        std::fs::read_to_string(f.root.join("a.py")).unwrap(),
        "a\nb\n",
        "nothing written"
    );
}

#[tokio::test]
async fn multi_edit_refuses_ambiguous_strings_unless_replace_all() {
    let mut f = fixture();
    std::fs::write(f.root.join("a.py"), "t t t\n").unwrap();
    let out = f
        .call(
            "MultiEdit",
            json!({"file_path": "a.py", "edits": [{"old_string": "t", "new_string": "u"}]}),
        )
        .await;
    assert!(out.is_error);
    assert!(out.text.contains("appears 3 times"), "{}", out.text);
    let out =
        f.call("MultiEdit", json!({"file_path": "a.py", "edits": [{"old_string": "t", "new_string": "u", "replace_all": true}]})).await;
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(
        std::fs::read_to_string(f.root.join("a.py")).unwrap(),
        "u u u\n"
    );
    assert_eq!(edit_data(&out).replacements, 3);
}

#[tokio::test]
async fn multi_edit_rejects_identical_strings() {
    let mut f = fixture();
    std::fs::write(f.root.join("a.py"), "same\n").unwrap();
    let out = f
        .call(
            "MultiEdit",
            json!({"file_path": "a.py", "edits": [{"old_string": "same", "new_string": "same"}]}),
        )
        .await;
    assert!(out.is_error);
    assert!(out.text.contains("are the same"), "{}", out.text);
}

#[tokio::test]
async fn multi_edit_creates_a_missing_file_from_an_empty_old_string() {
    let mut f = fixture();
    let out = f
        .call(
            "MultiEdit",
            json!({"file_path": "kernels/add.cpp", "edits": [
                {"old_string": "", "new_string": "int add(int a, int b) { return a + b; }\n"},
                {"old_string": "a + b", "new_string": "b + a"}
            ]}),
        )
        .await;
    assert!(!out.is_error, "{}", out.text);
    assert!(edit_data(&out).created);
    assert_eq!(
        std::fs::read_to_string(f.root.join("kernels/add.cpp")).unwrap(),
        "int add(int a, int b) { return b + a; }\n"
    );
    // An empty old_string on an existing file is an error, not an overwrite.
    let out = f.call("MultiEdit", json!({"file_path": "kernels/add.cpp", "edits": [{"old_string": "", "new_string": "x"}]})).await;
    assert!(out.is_error);
    // A missing file with a non-empty old_string is an error too.
    let out = f
        .call(
            "MultiEdit",
            json!({"file_path": "nope.py", "edits": [{"old_string": "a", "new_string": "b"}]}),
        )
        .await;
    assert!(out.is_error);
    assert!(out.text.contains("does not exist"), "{}", out.text);
}

#[tokio::test]
async fn paths_escaping_through_dotdot_absolute_or_symlink_are_refused() {
    let mut f = fixture();
    let outside = f.other_workspace.join("model_new.py");
    for path in [
        "../other-ws/model_new.py".to_string(),
        outside.display().to_string(),
        "/etc/passwd".to_string(),
    ] {
        for (tool, args) in [
            ("Read", json!({"file_path": path})),
            ("Write", json!({"file_path": path, "content": "x"})),
            (
                "MultiEdit",
                json!({"file_path": path, "edits": [{"old_string": "", "new_string": "x"}]}),
            ),
        ] {
            let out = f.call(tool, args).await;
            assert!(out.is_error, "{tool} {path}");
            assert!(
                out.text.contains("outside the workspace"),
                "{tool} {path}: {}",
                out.text
            );
        }
    }
    // Links are refused wherever they are, whatever they point to.
    std::os::unix::fs::symlink(&f.other_workspace, f.root.join("link")).unwrap();
    let out = f
        .call("Read", json!({"file_path": "link/model_new.py"}))
        .await;
    assert!(
        out.is_error && out.text.contains("symbolic link"),
        "{}",
        out.text
    );
    let out = f
        .call(
            "Write",
            json!({"file_path": "link/evil.py", "content": "x"}),
        )
        .await;
    assert!(
        out.is_error && out.text.contains("symbolic link"),
        "{}",
        out.text
    );
    assert!(!f.other_workspace.join("evil.py").exists());
    let out = f
        .call("Glob", json!({"pattern": "*", "path": "link"}))
        .await;
    assert!(
        out.is_error && out.text.contains("symbolic link"),
        "{}",
        out.text
    );
    // A path that climbs out and back in is fine.
    std::fs::write(f.root.join("ok.txt"), "fine").unwrap();
    let out = f.call("Read", json!({"file_path": "../ws/ok.txt"})).await;
    assert!(!out.is_error, "{}", out.text);
}

#[tokio::test]
async fn protected_files_cannot_be_changed_by_file_tools() {
    let mut f = fixture();
    for (tool, args) in [
        (
            "Write",
            json!({"file_path": "verify.py", "content": "print('hacked')"}),
        ),
        (
            "MultiEdit",
            json!({"file_path": "verify.py", "edits": [{"old_string": "pristine", "new_string": "hacked"}]}),
        ),
        (
            "MultiEdit",
            json!({"file_path": "./model.py", "edits": [{"old_string": "Model", "new_string": "M"}]}),
        ),
    ] {
        let out = f.call(tool, args).await;
        assert!(out.is_error, "{tool}");
        assert!(out.text.contains("read-only"), "{}", out.text);
    }
    assert_eq!(
        std::fs::read_to_string(f.root.join("verify.py")).unwrap(),
        "print('pristine verify')\n"
    );
}

#[tokio::test]
async fn read_numbers_lines_and_pages() {
    let mut f = fixture();
    let body: String = (1..=50).map(|i| format!("line {i}\n")).collect();
    std::fs::write(f.root.join("a.txt"), body).unwrap();
    let out = f
        .call(
            "Read",
            json!({"file_path": "a.txt", "offset": 10, "limit": 3}),
        )
        .await;
    assert!(!out.is_error);
    assert!(
        out.text
            .starts_with("    10\tline 10\n    11\tline 11\n    12\tline 12\n"),
        "{}",
        out.text
    );
    assert!(out.text.contains("lines 10-12 of 50"));
    let out = f.call("Read", json!({"file_path": "missing.txt"})).await;
    assert!(out.is_error);
}

#[tokio::test]
async fn write_creates_and_replaces() {
    let mut f = fixture();
    let out = f
        .call(
            "Write",
            json!({"file_path": "dir/sub/x.py", "content": "a"}),
        )
        .await;
    assert!(!out.is_error, "{}", out.text);
    assert!(write_data(&out).created);
    let out = f
        .call(
            "Write",
            json!({"file_path": "dir/sub/x.py", "content": "b"}),
        )
        .await;
    assert!(!write_data(&out).created);
    assert_eq!(
        std::fs::read_to_string(f.root.join("dir/sub/x.py")).unwrap(),
        "b"
    );
    // The agent's processes can edit what the tools wrote.
    let out = f.bash("echo c >> dir/sub/x.py && cat dir/sub/x.py").await;
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(out.text, "bc\n");
}

#[tokio::test]
async fn glob_lists_matches_newest_first() {
    let mut f = fixture();
    std::fs::create_dir_all(f.root.join("kernels/sub")).unwrap();
    for (i, name) in ["kernels/a.cu", "kernels/sub/b.cu", "kernels/c.cpp"]
        .iter()
        .enumerate()
    {
        let p = f.root.join(name);
        std::fs::write(&p, "x").unwrap();
        let t = std::time::SystemTime::UNIX_EPOCH
            + std::time::Duration::from_secs(1_000_000 + i as u64 * 100);
        std::fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(t)
            .unwrap();
    }
    let out = f.call("Glob", json!({"pattern": "**/*.cu"})).await;
    assert_eq!(glob_data(&out).paths, ["kernels/sub/b.cu", "kernels/a.cu"]);
    let out = f
        .call("Glob", json!({"pattern": "*.cu", "path": "kernels"}))
        .await;
    assert_eq!(
        glob_data(&out).paths,
        ["kernels/a.cu"],
        "* does not cross directories"
    );
    let out = f.call("Glob", json!({"pattern": "../**/*"})).await;
    assert!(out.is_error);
    let out = f.call("Glob", json!({"pattern": "*.nothing"})).await;
    assert_eq!(out.text, "No files found");
}

#[tokio::test]
async fn todo_write_replaces_the_list_and_accepts_both_forms() {
    let mut f = fixture();
    let out = f
        .call(
            "TodoWrite",
            json!({"todos": [
                {"content": "Profile the reference", "status": "completed", "activeForm": "Profiling the reference"},
                {"content": "Write the kernel", "status": "in_progress", "activeForm": "Writing the kernel"}
            ]}),
        )
        .await;
    assert!(!out.is_error, "{}", out.text);
    assert!(
        out.text.contains("0 pending, 1 in progress, 1 completed"),
        "{}",
        out.text
    );
    assert_eq!(f.toolbox.todos().len(), 2);
    let out = f.call("TodoWrite", json!({"todos": [{"id": "1", "content": "Tune", "status": "pending", "priority": "high"}]})).await;
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(
        f.toolbox.todos().len(),
        1,
        "the list is replaced, not appended"
    );
    assert_eq!(f.toolbox.todos()[0].priority.as_deref(), Some("high"));
    let bad = ToolCall::parse(
        "TodoWrite",
        &json!({"todos": [{"content": "x", "status": "doing"}]}),
    );
    assert!(matches!(bad, Err(CallError::BadArguments { .. })));
}

#[test]
fn calls_are_checked_against_their_schema() {
    assert!(matches!(
        ToolCall::parse("Rm", &json!({})),
        Err(CallError::UnknownTool { .. })
    ));
    assert!(matches!(
        ToolCall::parse("Bash", &json!({"command": 5})),
        Err(CallError::BadArguments { .. })
    ));
    assert!(matches!(
        ToolCall::parse("Bash", &json!({"cmd": "ls"})),
        Err(CallError::BadArguments { .. })
    ));
    // OpenAI sends arguments as a JSON string.
    let call = ToolCall::parse("Bash", &json!("{\"command\": \"ls\"}")).unwrap();
    assert_eq!(call.name(), "Bash");
    assert!(matches!(
        ToolCall::parse("Submit", &json!(null)),
        Ok(ToolCall::Submit(_))
    ));
}

#[test]
fn schemas_are_openai_function_tools() {
    let schemas = tool_schemas();
    let names: Vec<&str> = schemas
        .iter()
        .map(|s| s["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "Bash",
            "Glob",
            "MultiEdit",
            "TodoWrite",
            "Read",
            "Write",
            "Edit",
            "Grep",
            "Submit"
        ]
    );
    for s in &schemas {
        assert_eq!(s["type"], "function");
        assert_eq!(s["function"]["parameters"]["type"], "object", "{s}");
    }
    let bash = &schemas[0]["function"]["parameters"];
    assert_eq!(bash["required"], json!(["command"]));
    // Optional by not being required: no `null` type, no `default: null`, no `$defs`.
    assert_eq!(bash["properties"]["timeout"]["type"], json!("integer"));
    assert!(bash["properties"]["timeout"].get("default").is_none());
    for s in &schemas {
        let text = s.to_string();
        assert!(
            !text.contains("$ref") && !text.contains("\"null\"") && !text.contains("\"format\""),
            "{text}"
        );
    }
    let grep = &schemas[7]["function"]["parameters"];
    assert_eq!(
        grep["properties"]["output_mode"]["enum"],
        json!(["content", "files_with_matches", "count"])
    );
    let todo = &schemas[3]["function"]["parameters"];
    assert_eq!(
        todo["properties"]["todos"]["items"]["properties"]["status"]["enum"],
        json!(["pending", "in_progress", "completed"])
    );
    let edit = &schemas[2]["function"]["parameters"];
    assert_eq!(edit["required"], json!(["file_path", "edits"]));
}

#[tokio::test]
async fn bash_keeps_the_working_directory_and_reports_exit_codes() {
    let mut f = fixture();
    let out = f.bash("mkdir -p build && cd build && pwd").await;
    assert!(!out.is_error, "{}", out.text);
    let out = f.bash("pwd; echo oops >&2; exit 3").await;
    assert!(
        out.text
            .starts_with(&format!("{}/build\n", f.root.display())),
        "{}",
        out.text
    );
    assert!(out.text.contains("[stderr]\noops"), "{}", out.text);
    assert_eq!(bash_data(&out).exit_code, Some(3));
    assert!(out.is_error);
    let out = f.bash("cd /usr").await;
    assert!(
        out.text.contains("reset to the workspace root"),
        "{}",
        out.text
    );
    let out = f.bash("pwd").await;
    assert_eq!(out.text.trim(), f.root.display().to_string());
}

#[tokio::test]
async fn bash_caps_huge_output() {
    let mut f = fixture();
    let out = f.bash("seq 1 2000000").await;
    assert!(bash_data(&out).truncated);
    assert!(out.text.len() < 31_000, "{}", out.text.len());
    assert!(out.text.starts_with("1\n2\n"));
    assert!(out.text.trim_end().ends_with("2000000"));
    assert!(out.text.contains("bytes of output truncated"));
}

#[tokio::test]
async fn bash_environment_is_scrubbed() {
    std::env::set_var("CUDA_AGENT_TEST_SECRET", "leak");
    let mut f = fixture();
    let out = f.bash("env").await;
    assert!(!out.text.contains("CUDA_AGENT_TEST_SECRET"), "{}", out.text);
    assert!(
        out.text.contains(&format!("HOME={}", f.root.display())),
        "{}",
        out.text
    );
    assert!(
        out.text.contains(&format!("TMPDIR={}", f.tmp.display())),
        "{}",
        out.text
    );
}

#[tokio::test]
async fn file_tools_name_directories_and_keep_todo_lists_small() {
    let mut f = fixture();
    std::fs::create_dir_all(f.root.join("kernels")).unwrap();
    let out = f.call("Read", json!({"file_path": "kernels"})).await;
    assert!(
        out.is_error && out.text.contains("kernels is a directory; use Glob"),
        "{}",
        out.text
    );
    let out = f
        .call("Write", json!({"file_path": "kernels", "content": "x"}))
        .await;
    assert!(
        out.is_error && out.text.contains("kernels is a directory"),
        "{}",
        out.text
    );
    let out = f
        .call("Write", json!({"file_path": ".", "content": "x"}))
        .await;
    assert!(out.is_error, "{}", out.text);
    let many: Vec<_> = (0..101)
        .map(|i| json!({"content": format!("step {i}"), "status": "pending"}))
        .collect();
    let out = f.call("TodoWrite", json!({"todos": many})).await;
    assert!(
        out.is_error && out.text.contains("over the limit"),
        "{}",
        out.text
    );
    let out = f
        .call(
            "TodoWrite",
            json!({"todos": [{"content": "x".repeat(1_001), "status": "pending"}]}),
        )
        .await;
    assert!(
        out.is_error && out.text.contains("longer than"),
        "{}",
        out.text
    );
    assert!(f.toolbox.todos().is_empty());
}

#[tokio::test]
async fn multi_edit_counts_its_edits_and_read_marks_a_cut_file() {
    let mut f = fixture();
    std::fs::write(f.root.join("a.py"), "a").unwrap();
    let edits: Vec<_> = (0..257)
        .map(|i| json!({"old_string": "a", "new_string": format!("a{i}")}))
        .collect();
    let out = f
        .call("MultiEdit", json!({"file_path": "a.py", "edits": edits}))
        .await;
    assert!(
        out.is_error && out.text.contains("257 edits"),
        "{}",
        out.text
    );
    assert_eq!(std::fs::read_to_string(f.root.join("a.py")).unwrap(), "a");
    // A file within the cap reads whole, and says so.
    let out = f.call("Read", json!({"file_path": "a.py"})).await;
    assert!(!read_data(&out).truncated);
    assert_eq!(out.text, "     1\ta\n");
}
