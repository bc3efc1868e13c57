//! The first prompt for small contexts, the per-episode transcript of messages, and the
//! binary's handling of a user's error.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use agent_runner::agent::{
    compact_tool, first_prompt_chars, full_prompt_too_long, observation_chars, Conversation,
    PromptStyle, Transcript, COMPACT_SYSTEM_PROMPT, COMPACT_TOOLS, SYSTEM_PROMPT,
};
use agent_runner::openai::wire::ToolDefinition;
use serde_json::{json, Value};

/// The episode's tools as the server offers them.
fn tools() -> Vec<ToolDefinition> {
    agent_tools::tool_schemas()
        .iter()
        .map(|t| serde_json::from_value(t.clone()).unwrap())
        .collect()
}

/// A task prompt of an L1 task's size (the server's prompt with model.py: 1.4 KB).
fn task_prompt() -> String {
    format!(
        "Task L1/1_ReLU: write ModelNew in model_new.py ...\n--- model.py ---\n{}",
        "x".repeat(1400)
    )
}

#[test]
fn the_compact_prompt_fits_a_third_of_an_8k_context_where_the_full_one_does_not() {
    let all = tools();
    let prompt = task_prompt();
    let full = first_prompt_chars(SYSTEM_PROMPT, &prompt, &all);
    let compact_tools: Vec<ToolDefinition> = all
        .iter()
        .filter(|t| COMPACT_TOOLS.contains(&t.function.name.as_str()))
        .map(compact_tool)
        .collect();
    let compact = first_prompt_chars(COMPACT_SYSTEM_PROMPT, &prompt, &compact_tools);
    assert!(full_prompt_too_long(full, 8192), "full: {full} chars");
    assert!(
        !full_prompt_too_long(compact, 8192),
        "compact: {compact} chars"
    );
    assert!(
        !full_prompt_too_long(full, 128_000),
        "a large context takes the full prompt"
    );
    // The full prompt's schemas are compacted too (8.9 KB with an L1 task's prompt), so the
    // compact one is under half of it, not a third as before.
    assert!(compact * 2 < full, "compact {compact} chars, full {full}");
    eprintln!("first prompt: full {full} chars, compact {compact} chars");
    assert_eq!(compact_tools.len(), COMPACT_TOOLS.len());
}

#[test]
fn a_compact_tool_keeps_its_schema_but_not_its_prose() {
    let bash = tools()
        .into_iter()
        .find(|t| t.function.name == "Bash")
        .unwrap();
    let c = compact_tool(&bash);
    let desc = c.function.description.clone().unwrap();
    assert!(desc.ends_with('.') && !desc.contains(". "), "{desc}");
    assert!(desc.len() < bash.function.description.clone().unwrap().len());
    let params = c.function.parameters.clone().unwrap();
    let full = bash.function.parameters.clone().unwrap();
    assert_eq!(params["required"], full["required"]);
    for (name, p) in params["properties"].as_object().unwrap() {
        assert!(p.get("description").is_none(), "{name}: {p}");
        assert_eq!(p["type"], full["properties"][name]["type"], "{name}");
    }
}

#[test]
fn prompt_styles_parse_and_say_what_they_are() {
    assert_eq!("auto".parse::<PromptStyle>(), Ok(PromptStyle::Auto));
    assert_eq!("compact".parse::<PromptStyle>(), Ok(PromptStyle::Compact));
    let err = "small".parse::<PromptStyle>().unwrap_err();
    assert!(err.contains("auto, full and compact"), "{err}");
}

#[test]
fn the_transcript_holds_every_message_as_it_entered_the_conversation() {
    let dir = tempfile::tempdir().unwrap();
    let mut conv = Conversation::new("sys", "task");
    conv.record_to(Transcript::create(dir.path(), "ep1").unwrap());
    conv.push(json!({"role": "assistant", "content": "thinking", "tool_calls": []}));
    conv.push(json!({"role": "tool", "tool_call_id": "c0", "content": "out0"}));
    conv.replace_system("short sys");
    assert!(conv.elide_oldest());
    let text = std::fs::read_to_string(dir.path().join("ep1.messages.jsonl")).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let roles: Vec<&str> = lines.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "system"]);
    assert_eq!(
        lines[3]["content"], "out0",
        "as it was, not as elided later"
    );
    assert_eq!(lines[4]["replaces_message"], 0);
    assert_eq!(conv.messages[0]["content"], "short sys");
}

#[test]
fn a_users_error_prints_one_line_without_a_backtrace() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-runner"))
        .args(["optimize", "/nonexistent/module.py"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.trim(),
        "agent-runner: reading /nonexistent/module.py: No such file or directory (os error 2)"
    );
}

#[test]
fn one_tool_output_takes_at_most_a_quarter_of_a_known_context() {
    // Unknown context: the configured cap.
    assert_eq!(observation_chars(16_000, None), 16_000);
    // 8k tokens: a quarter is 2,048 tokens, about 3,150 characters.
    let small = observation_chars(16_000, Some(8192));
    assert!((3000..3300).contains(&small), "{small}");
    // A large context keeps the cap; a tiny one keeps an error's first lines.
    assert_eq!(observation_chars(16_000, Some(128_000)), 16_000);
    assert_eq!(observation_chars(16_000, Some(700)), 1024);
}
