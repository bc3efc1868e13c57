//! Fine-tuning samples from the server's trajectory logs, as logs written before the records
//! were typed (env-api's fixtures) still give them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use trainer::chat::ChatTemplate;
use trainer::curation::samples_from_dir;
use trainer::render::Renderer;
use trainer::sample::Outcome;
use trainer::tokenizer::TextTokenizer;

fn tiny_renderer() -> Renderer {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-tokenizer.json");
    let tok = TextTokenizer::from_file(&path).unwrap();
    Renderer::new(ChatTemplate::Chatml, tok, "sys".into(), false, 256, &[0]).unwrap()
}

#[test]
fn old_logs_give_samples() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../env-api/tests/fixtures/old_logs");
    let (samples, bad) = samples_from_dir(&dir, &tiny_renderer()).unwrap();
    assert_eq!((samples.len(), bad), (3, 0));
    // In file-name order: closed, restarted, submitted.
    let tasks: Vec<&str> = samples.iter().map(|s| s.task.as_str()).collect();
    assert_eq!(tasks, ["tiny/0_red", "L1/1_ReLU", "tiny/0_red"]);
    for s in &samples[..2] {
        assert_eq!(s.outcome, Some(Outcome::TurnLimit), "{:?}", s.reason);
        assert_eq!(s.turns.len(), 1);
    }
    let s = &samples[2];
    assert_eq!(s.outcome, Some(Outcome::Finished));
    assert_eq!(s.reward, 1.0);
    let tools: Vec<&str> = s.turns.iter().filter_map(|t| t.tool.as_deref()).collect();
    assert_eq!(
        tools,
        [
            "TodoWrite",
            "Write",
            "Glob",
            "Grep",
            "Read",
            "Edit",
            "MultiEdit",
            "Bash",
            "Read",
            "Glob",
            "Submit"
        ]
    );
    let errors: Vec<bool> = s.turns.iter().map(|t| t.tool_error).collect();
    assert!(
        errors[7] && errors[8],
        "the failing Bash and Read: {errors:?}"
    );
    assert!(s.policy_tokens() > 0);
}

/// The RFT filter gives one verdict whoever wrote the log: arguments logged as an object (the
/// trainer's own turns, MCP clients) or as a JSON string (agent-runner, which speaks OpenAI's
/// wire format). A reverted `Edit` is an undone edit in both.
#[test]
fn the_filter_reads_string_and_object_arguments_alike() {
    use serde_json::Value;
    use trainer::curation::{rft_verdict, Rejection};
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../env-api/tests/fixtures/old_logs/submitted.jsonl");
    let records: Vec<Value> = std::fs::read_to_string(fixture)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tool_of = |r: &Value| r["body"]["action"]["tool"].as_str().map(str::to_owned);
    // The same episode with its Edit put back just before the Submit.
    let edit = records
        .iter()
        .find(|r| tool_of(r).as_deref() == Some("Edit"))
        .expect("the fixture has an Edit")
        .clone();
    let mut undo = edit;
    let args = &mut undo["body"]["action"]["arguments"];
    let (old, new) = (args["old_string"].clone(), args["new_string"].clone());
    args["old_string"] = new;
    args["new_string"] = old;
    undo["body"]["request_id"] = "undo".into();
    let mut reverted = records.clone();
    let submit_at = reverted
        .iter()
        .position(|r| tool_of(r).as_deref() == Some("Submit"))
        .expect("the fixture submits");
    reverted.insert(submit_at, undo);
    let as_strings = |log: &[Value]| -> Vec<Value> {
        log.iter()
            .cloned()
            .map(|mut r| {
                // The fixture already holds one call logged as a string: left as it is.
                if let Some(a) = r["body"]["action"]
                    .get_mut("arguments")
                    .filter(|a| a.is_object())
                {
                    *a = Value::String(a.to_string());
                }
                r
            })
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    for (name, log) in [
        ("a_objects", records.clone()),
        ("b_strings", as_strings(&records)),
        ("c_reverted_objects", reverted.clone()),
        ("d_reverted_strings", as_strings(&reverted)),
    ] {
        let text: Vec<String> = log.iter().map(Value::to_string).collect();
        std::fs::write(
            dir.path().join(format!("{name}.jsonl")),
            text.join("\n") + "\n",
        )
        .unwrap();
    }
    let (samples, bad) = samples_from_dir(dir.path(), &tiny_renderer()).unwrap();
    assert_eq!((samples.len(), bad), (4, 0));
    let verdicts: Vec<_> = samples
        .iter()
        .map(|s| rft_verdict(s, 0.0, 1_000_000))
        .collect();
    assert_eq!(verdicts[0], Ok(()));
    assert_eq!(verdicts[1], verdicts[0]);
    assert_eq!(verdicts[2], Err(Rejection::UndoneEdit));
    assert_eq!(verdicts[3], verdicts[2]);
    // Both forms become the same turns and the same tokens.
    for (a, b) in [(0, 1), (2, 3)] {
        let args =
            |i: usize| -> Vec<&Value> { samples[i].turns.iter().map(|t| &t.arguments).collect() };
        assert_eq!(args(a), args(b));
        assert!(args(a).iter().all(|v| v.is_object()));
        assert_eq!(samples[a].tokens, samples[b].tokens);
    }
}
