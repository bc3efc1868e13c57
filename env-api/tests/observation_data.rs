//! `Observation.data` keeps the JSON the server sent before it was typed: each golden literal
//! below is what the untyped server wrote for that tool, byte for byte.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use env_api::observation::{
    BashData, EditData, GlobData, GrepData, NoData, ObservationData, ReadData, ResetData,
    StreamLayout, TodoWriteData, ToolData, WriteData,
};
use env_api::tools::{TodoItem, TodoStatus};
use env_api::Observation;
use serde_json::Value;

/// `typed` serialises to `golden` exactly, and `golden` reads back as `typed`.
fn same_bytes(typed: impl Into<ObservationData>, golden: &str) {
    let typed = typed.into();
    assert_eq!(serde_json::to_string(&typed).unwrap(), golden);
    let read: ObservationData = serde_json::from_str(golden).unwrap();
    assert_eq!(read, typed, "{golden}");
}

/// The same as JSON values: for objects whose keys the untyped server sorted where a typed
/// struct keeps its own order (nested items, `restored_read_only`).
fn same_value(typed: impl Into<ObservationData>, golden: &str) {
    let typed = typed.into();
    let golden_value: Value = serde_json::from_str(golden).unwrap();
    assert_eq!(serde_json::to_value(&typed).unwrap(), golden_value);
    let read: ObservationData = serde_json::from_str(golden).unwrap();
    assert_eq!(read, typed, "{golden}");
    let again: Value = serde_json::to_value(&read).unwrap();
    assert_eq!(again, golden_value);
}

fn bash(exit_code: Option<i32>, breach: Option<&str>) -> BashData {
    BashData {
        breach: breach.map(str::to_string),
        budget_cut: false,
        cwd: ".".into(),
        duration_ms: 28,
        exit_code,
        processes_killed: 0,
        stderr_bytes: 5,
        stdout: StreamLayout::Separate,
        stdout_bytes: 4,
        timed_out: false,
        truncated: false,
    }
}

#[test]
fn bash_round_trips() {
    same_bytes(
        ToolData::Bash(bash(Some(3), None)),
        r#"{"breach":null,"budget_cut":false,"cwd":".","duration_ms":28,"exit_code":3,"processes_killed":0,"stderr_bytes":5,"stdout":"separate","stdout_bytes":4,"timed_out":false,"truncated":false}"#,
    );
    // Stopped by a limit, no exit status collected.
    same_bytes(
        ToolData::Bash(bash(None, Some("disk_quota"))),
        r#"{"breach":"disk_quota","budget_cut":false,"cwd":".","duration_ms":28,"exit_code":null,"processes_killed":0,"stderr_bytes":5,"stdout":"separate","stdout_bytes":4,"timed_out":false,"truncated":false}"#,
    );
}

#[test]
fn edit_and_multi_edit_round_trip() {
    same_bytes(
        ToolData::Edit(EditData {
            created: false,
            edits: 2,
            path: "answer.txt".into(),
            replacements: 2,
        }),
        r#"{"created":false,"edits":2,"path":"answer.txt","replacements":2}"#,
    );
}

#[test]
fn write_round_trips() {
    same_bytes(
        ToolData::Write(WriteData {
            bytes: 5,
            created: true,
            path: "answer.txt".into(),
        }),
        r#"{"bytes":5,"created":true,"path":"answer.txt"}"#,
    );
}

#[test]
fn read_round_trips() {
    same_bytes(
        ToolData::Read(ReadData {
            bytes_read: 5,
            lines: 1,
            size: 5,
            truncated: false,
        }),
        r#"{"bytes_read":5,"lines":1,"size":5,"truncated":false}"#,
    );
}

#[test]
fn grep_round_trips() {
    same_bytes(
        ToolData::Grep(GrepData {
            complete: true,
            files_searched: 1,
            matching_files: 1,
            matching_lines: 1,
        }),
        r#"{"complete":true,"files_searched":1,"matching_files":1,"matching_lines":1}"#,
    );
}

#[test]
fn glob_round_trips() {
    same_bytes(
        ToolData::Glob(GlobData {
            complete: true,
            paths: vec!["answer.txt".into()],
            total: 1,
        }),
        r#"{"complete":true,"paths":["answer.txt"],"total":1}"#,
    );
}

#[test]
fn todo_write_round_trips() {
    same_value(
        ToolData::TodoWrite(TodoWriteData {
            todos: vec![
                TodoItem {
                    content: "Write the answer".into(),
                    status: TodoStatus::InProgress,
                    active_form: Some("Writing the answer".into()),
                    id: None,
                    priority: None,
                },
                TodoItem {
                    content: "Submit".into(),
                    status: TodoStatus::Pending,
                    active_form: None,
                    id: Some("2".into()),
                    priority: Some("high".into()),
                },
            ],
        }),
        r#"{"todos":[{"activeForm":"Writing the answer","content":"Write the answer","status":"in_progress"},{"content":"Submit","id":"2","priority":"high","status":"pending"}]}"#,
    );
}

#[test]
fn reset_listing_round_trips() {
    same_bytes(
        ToolData::Reset(ResetData {
            files: vec!["model.py".into(), "model_new.py".into()],
        }),
        r#"{"files":["model.py","model_new.py"]}"#,
    );
    same_bytes(
        ToolData::Reset(ResetData { files: vec![] }),
        r#"{"files":[]}"#,
    );
}

#[test]
fn submit_and_errors_are_an_empty_object() {
    same_bytes(ToolData::Empty(NoData {}), "{}");
    same_bytes(ObservationData::default(), "{}");
}

#[test]
fn restored_files_sit_beside_the_details() {
    let mut data = ObservationData::from(ToolData::Bash(bash(Some(0), None)));
    data.restored_read_only = vec!["model.py".into()];
    same_value(
        data,
        r#"{"breach":null,"budget_cut":false,"cwd":".","duration_ms":28,"exit_code":0,"processes_killed":0,"restored_read_only":["model.py"],"stderr_bytes":5,"stdout":"separate","stdout_bytes":4,"timed_out":false,"truncated":false}"#,
    );
    // A failed call that still changed a protected file.
    same_bytes(
        ObservationData {
            details: ToolData::Empty(NoData {}),
            restored_read_only: vec!["model.py".into()],
        },
        r#"{"restored_read_only":["model.py"]}"#,
    );
}

#[test]
fn shapes_of_other_versions_are_kept_as_they_came() {
    // Read and Glob as the first servers reported them, and a field no version has.
    for golden in [
        r#"{"lines":3}"#,
        r#"{"paths":["a.py"],"total":1}"#,
        r#"{"unheard_of":{"x":[1,2]}}"#,
    ] {
        let read: ObservationData = serde_json::from_str(golden).unwrap();
        assert!(
            matches!(read.details, ToolData::Other(_)),
            "{golden}: {read:?}"
        );
        assert_eq!(serde_json::to_string(&read).unwrap(), golden);
    }
    // A newer field on a known shape is ignored, not an error.
    let read: ObservationData =
        serde_json::from_str(r#"{"bytes":5,"created":true,"path":"a","mode":"0644"}"#).unwrap();
    assert!(matches!(read.details, ToolData::Write(_)), "{read:?}");
}

#[test]
fn observations_keep_their_layout() {
    let golden = r#"{"text":"answer.txt","tool":"Glob","is_error":false,"data":{"complete":true,"paths":["answer.txt"],"total":1}}"#;
    let o: Observation = serde_json::from_str(golden).unwrap();
    assert!(matches!(o.data.details, ToolData::Glob(_)), "{o:?}");
    assert_eq!(serde_json::to_string(&o).unwrap(), golden);
    // An observation without data (a client's own, say) reads as empty data.
    let o: Observation = serde_json::from_str(r#"{"text":"t"}"#).unwrap();
    assert_eq!(o.data, ObservationData::default());
}
