//! Tool-call parsing, chat rendering, checkpoints that round-trip exactly, and sampling.

use burn::backend::NdArray;
use burn::tensor::{Bool, Int, Tensor, TensorData};
use serde_json::json;
use trainer::chat::{parse_tool_call, ChatTemplate, ToolCallParseError};
use trainer::generate::{generate, FinishReason, SamplingParams};
use trainer::model::{Architecture, CausalLm, Critic, ModelConfig};

type B = NdArray<f32>;

#[test]
fn tool_calls_parse_in_both_forms_and_fail_clearly() {
    let c = parse_tool_call("Let me write it.\n<tool_call>\n{\"name\": \"Write\", \"arguments\": {\"file_path\": \"a.txt\", \"content\": \"x\"}}\n</tool_call>").unwrap();
    assert_eq!(c.name, "Write");
    assert_eq!(c.arguments, json!({"file_path": "a.txt", "content": "x"}));
    let c = parse_tool_call("{\"name\": \"Submit\", \"parameters\": {}} trailing").unwrap();
    assert_eq!((c.name.as_str(), c.arguments.clone()), ("Submit", json!({})));
    let c = parse_tool_call("{\"name\": \"Bash\", \"arguments\": \"{\\\"command\\\": \\\"ls\\\"}\"}").unwrap();
    assert_eq!(c.arguments, json!({"command": "ls"}));
    assert_eq!(parse_tool_call("I am done."), Err(ToolCallParseError::Missing));
    assert_eq!(parse_tool_call("<tool_call>{\"name\": \"Bash\"}"), Err(ToolCallParseError::Unclosed));
    assert!(matches!(parse_tool_call("<tool_call>{name: Bash}</tool_call>"), Err(ToolCallParseError::Json(_))));
    assert!(matches!(parse_tool_call("<tool_call>{\"arguments\": {}}</tool_call>"), Err(ToolCallParseError::Shape(_))));
    // The error text tells the agent the expected form.
    assert!(ToolCallParseError::Missing.to_string().contains("<tool_call>"));
}

#[test]
fn templates_render_turns_that_concatenate() {
    let tools = [json!({"type": "function", "function": {"name": "Submit"}})];
    let p = ChatTemplate::Chatml.prompt("sys", &tools, "task");
    assert!(p.starts_with("<|im_start|>system\nsys"));
    assert!(p.contains("<tools>\n{\"function\":{\"name\":\"Submit\"},\"type\":\"function\"}\n</tools>"));
    assert!(p.ends_with("<|im_start|>user\ntask<|im_end|>\n<|im_start|>assistant\n"));
    let o = ChatTemplate::Chatml.observation("ok", true);
    assert_eq!(o, "\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
    let p = ChatTemplate::Llama3.prompt("sys", &[], "task");
    assert_eq!(p, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nsys<|eot_id|><|start_header_id|>user<|end_header_id|>\n\ntask<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    assert_eq!(ChatTemplate::detect("{% ... <|im_start|> ... %}"), Some(ChatTemplate::Chatml));
    assert_eq!(ChatTemplate::detect("<|start_header_id|>"), Some(ChatTemplate::Llama3));
}

fn tiny_config(tied: bool) -> ModelConfig {
    ModelConfig::from_json(&format!(
        r#"{{"model_type":"qwen2","vocab_size":40,"hidden_size":16,"intermediate_size":24,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "tie_word_embeddings":{tied}}}"#
    ))
    .unwrap()
}

fn logits(lm: &CausalLm<B>, arch: &Architecture<B>) -> Vec<f32> {
    let device = Default::default();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![1, 5, 9, 2, 7, 3], [1, 6]), &device);
    let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; 6], [1, 6]), &device);
    lm.forward(tokens, valid, arch, None).into_data().to_vec().unwrap()
}

#[test]
fn checkpoints_round_trip_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let device = Default::default();
    for tied in [true, false] {
        let cfg = tiny_config(tied);
        let arch = Architecture::<B>::new(cfg.clone(), 16, &device);
        let lm = CausalLm::<B>::random(&cfg, &device);
        let want = logits(&lm, &arch);
        // burn record
        let rec = dir.path().join(format!("policy-{tied}.mpk"));
        lm.save_record(&rec).unwrap();
        let back = CausalLm::<B>::random(&cfg, &device).load_record(&rec, &device).unwrap();
        assert_eq!(logits(&back, &arch), want);
        // Hugging Face layout
        let hf = dir.path().join(format!("hf-{tied}"));
        lm.save_pretrained(&cfg, &hf).unwrap();
        let (cfg2, back) = CausalLm::<B>::from_pretrained(&hf, &device).unwrap();
        assert_eq!(cfg2, cfg);
        assert_eq!(logits(&back, &arch), want);
    }
    // The critic starts from the policy's backbone with a zero head: values start at 0.
    let cfg = tiny_config(true);
    let arch = Architecture::<B>::new(cfg.clone(), 16, &device);
    let critic = Critic::from_policy(&CausalLm::<B>::random(&cfg, &device), &device);
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![1, 2, 3], [1, 3]), &device);
    let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; 3], [1, 3]), &device);
    let v: Vec<f32> = critic.values(tokens, valid, &arch).into_data().to_vec().unwrap();
    assert_eq!(v, vec![0.0; 3]);
    let path = dir.path().join("critic.mpk");
    critic.save_record(&path).unwrap();
    Critic::from_policy(&CausalLm::<B>::random(&cfg, &device), &device).load_record(&path, &device).unwrap();
}

#[test]
fn bad_configs_and_checkpoints_are_clear_errors() {
    let e = ModelConfig::from_json(r#"{"model_type":"gpt2","vocab_size":1,"hidden_size":4,"intermediate_size":4,"num_hidden_layers":1,"num_attention_heads":1}"#).unwrap_err();
    assert!(e.to_string().contains("gpt2"), "{e}");
    let e = ModelConfig::from_json(r#"{"vocab_size":1,"hidden_size":8,"intermediate_size":4,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":3}"#).unwrap_err();
    assert!(e.to_string().contains("multiple"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), tiny_config(true).to_hf_json().to_string()).unwrap();
    let e = CausalLm::<B>::from_pretrained(dir.path(), &Default::default()).unwrap_err();
    assert!(e.to_string().contains("no *.safetensors"), "{e}");
}

#[test]
fn sampling_is_seeded_and_honours_limits_and_stop_tokens() {
    let device = Default::default();
    let cfg = tiny_config(false);
    let arch = Architecture::<B>::new(cfg.clone(), 64, &device);
    let lm = CausalLm::<B>::random(&cfg, &device);
    let prompts = vec![vec![1, 2, 3], vec![4]];
    let p = SamplingParams { temperature: 1.0, top_p: 0.9, top_k: 10, max_new_tokens: 8, ..Default::default() };
    let a = generate(&lm, &arch, &prompts, &p, None, 7, &device);
    let b = generate(&lm, &arch, &prompts, &p, None, 7, &device);
    assert_eq!(a, b);
    for g in &a {
        assert_eq!(g.tokens.len(), 8);
        assert_eq!(g.finish, FinishReason::Length);
        assert!(g.logprobs.iter().all(|l| *l <= 0.0 && l.is_finite()));
    }
    // Every token is a stop token: each sequence ends after one.
    let stop = SamplingParams { stop_token_ids: (0..40).collect(), ..p };
    for g in generate(&lm, &arch, &prompts, &stop, None, 7, &device) {
        assert_eq!((g.tokens.len(), g.finish), (1, FinishReason::StopToken));
    }
}

#[test]
fn pruning_keeps_the_newest_step_checkpoints_and_latest() {
    use trainer::checkpoint::{latest, prune, save, StageState};
    let dir = tempfile::tempdir().unwrap();
    for step in [2, 4, 6, 8, 10] {
        let state = StageState { stage: "ppo".into(), step, total_steps: 10, seed: 0 };
        save(dir.path(), &state, |f| std::fs::write(f.policy(), b"weights").map_err(|e| trainer::TrainError::Io(f.policy(), e))).unwrap();
    }
    std::fs::create_dir(dir.path().join("final")).unwrap();
    assert_eq!(prune(dir.path(), 2).unwrap(), 3);
    let mut left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, ["final", "latest", "step-000008", "step-000010"]);
    assert!(latest(dir.path()).unwrap().dir.ends_with("step-000010"));
    assert_eq!(prune(dir.path(), 0).unwrap(), 0, "0 keeps everything");
}
