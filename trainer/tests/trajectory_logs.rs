//! Fine-tuning samples from the server's trajectory logs, as logs written before the records
//! were typed (env-api's fixtures) still give them.

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
