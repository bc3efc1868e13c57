//! Trajectory records: logs written before records were typed still read, every record says
//! the same when written again, and the kind stays first on the line.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use env_api::observation::ToolData;
use env_api::{ClosedRecord, FinalRecord, TrajectoryRecord, TruncatedRecord};
use serde_json::Value;

fn old_log(name: &str) -> Vec<(String, TrajectoryRecord)> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/old_logs")
        .join(name);
    std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| {
            let r = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{}: {e}: {}", path.display(), &l[..l.len().min(300)]));
            (l.to_string(), r)
        })
        .collect()
}

fn kinds(log: &[(String, TrajectoryRecord)]) -> Vec<&'static str> {
    log.iter().map(|(_, r)| r.kind()).collect()
}

#[test]
fn old_logs_read_and_write_back_the_same() {
    for name in ["submitted.jsonl", "restarted.jsonl", "closed.jsonl"] {
        for (line, record) in old_log(name) {
            let again = serde_json::to_string(&record).unwrap();
            assert_eq!(
                serde_json::from_str::<Value>(&again).unwrap(),
                serde_json::from_str::<Value>(&line).unwrap(),
                "{name}: {}",
                record.kind()
            );
            // The head of a line names its kind, then its time, as before.
            let head = format!(r#"{{"kind":"{}","time":"#, record.kind());
            assert!(line.starts_with(&head), "{name}: {}", &line[..80]);
            let head = format!("{head}{},", record.time());
            assert!(again.starts_with(&head), "{name}: {}", &again[..80]);
        }
    }
}

#[test]
fn an_old_log_of_every_tool_reads_as_typed_records() {
    let log = old_log("submitted.jsonl");
    assert_eq!(kinds(&log)[0], "reset");
    assert_eq!(kinds(&log)[log.len() - 1], "final");
    let TrajectoryRecord::Reset { body: reset, .. } = &log[0].1 else {
        unreachable!()
    };
    assert_eq!(reset.request.task.as_deref(), Some("tiny/0_red"));
    assert_eq!(reset.response.info.task.id, "tiny/0_red");
    assert!(reset.task_source.is_some());
    assert!(matches!(
        reset.response.observation.data.details,
        ToolData::Reset(_)
    ));
    let steps: Vec<_> = log
        .iter()
        .filter_map(|(_, r)| match r {
            TrajectoryRecord::Step { body, .. } => Some(body),
            _ => None,
        })
        .collect();
    let shapes: Vec<(&str, &str)> = steps
        .iter()
        .map(|s| {
            let shape = match &s.response.observation.data.details {
                ToolData::Bash(_) => "bash",
                ToolData::Edit(_) => "edit",
                ToolData::Write(_) => "write",
                ToolData::Read(_) => "read",
                ToolData::Grep(_) => "grep",
                ToolData::Glob(_) => "glob",
                ToolData::TodoWrite(_) => "todos",
                ToolData::Reset(_) => "reset",
                ToolData::Empty(_) => "empty",
                ToolData::Other(_) => "other",
            };
            (s.action.tool.as_str(), shape)
        })
        .collect();
    assert_eq!(
        shapes,
        [
            ("TodoWrite", "todos"),
            ("Write", "write"),
            ("Glob", "glob"),
            ("Grep", "grep"),
            ("Read", "read"),
            ("Edit", "edit"),
            ("MultiEdit", "edit"),
            ("Bash", "bash"),
            ("Read", "empty"),
            ("Glob", "glob"),
            ("Submit", "empty"),
        ]
    );
    let ids: Vec<Option<&str>> = steps.iter().map(|s| s.request_id.as_deref()).collect();
    assert_eq!(ids[0], Some("t1"));
    assert_eq!(ids[1], None);
    assert_eq!(ids[10], Some("s"));
    // Arguments sent as a JSON string stay a string.
    assert!(steps[9].action.arguments.is_string());
    assert!(steps[10].response.done);
    let TrajectoryRecord::Final { body, .. } = &log[log.len() - 1].1 else {
        unreachable!()
    };
    assert_eq!(body.task, "tiny/0_red");
    assert_eq!(body.files["answer.txt"], "red\n");
    assert!(body.result.as_ref().unwrap().correct);
}

#[test]
fn an_old_restart_and_close_read_as_typed_records() {
    let log = old_log("restarted.jsonl");
    assert_eq!(kinds(&log), ["reset", "step", "truncated"]);
    let TrajectoryRecord::Step { body, .. } = &log[1].1 else {
        unreachable!()
    };
    assert!(matches!(
        body.response.observation.data.details,
        ToolData::Bash(_)
    ));
    assert_eq!(
        body.response.observation.data.restored_read_only,
        ["model.py"]
    );
    let TrajectoryRecord::Truncated { body, .. } = &log[2].1 else {
        unreachable!()
    };
    assert_eq!((body.reason.as_str(), body.turn), ("server_restart", 1));

    let log = old_log("closed.jsonl");
    assert_eq!(kinds(&log), ["reset", "step", "closed"]);
}

#[test]
fn small_records_keep_their_bytes() {
    let golden = r#"{"kind":"truncated","time":1796446291.5776808,"body":{"reason":"server_restart","turn":1}}"#;
    let typed = TrajectoryRecord::Truncated {
        time: 1796446291.5776808,
        body: TruncatedRecord {
            reason: "server_restart".into(),
            turn: 1,
        },
    };
    assert_eq!(serde_json::to_string(&typed).unwrap(), golden);
    let golden = r#"{"kind":"closed","time":1.5,"body":{"turn":4}}"#;
    let typed = TrajectoryRecord::Closed {
        time: 1.5,
        body: ClosedRecord { turn: 4 },
    };
    assert_eq!(serde_json::to_string(&typed).unwrap(), golden);
    let read: TrajectoryRecord = serde_json::from_str(golden).unwrap();
    assert_eq!((read.kind(), read.time()), ("closed", 1.5));
}

#[test]
fn the_first_final_records_had_only_the_result() {
    let read: TrajectoryRecord =
        serde_json::from_str(r#"{"kind":"final","time":1.0,"body":{"result":null}}"#).unwrap();
    let TrajectoryRecord::Final { body, .. } = read else {
        panic!("{read:?}")
    };
    assert_eq!(body, FinalRecord::default());
}

#[test]
fn unknown_kinds_are_refused() {
    assert!(
        serde_json::from_str::<TrajectoryRecord>(r#"{"kind":"paused","time":1.0,"body":{}}"#)
            .is_err()
    );
}
