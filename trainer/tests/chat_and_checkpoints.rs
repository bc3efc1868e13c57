//! Tool-call parsing, chat rendering, checkpoints that round-trip exactly, and sampling.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use burn::backend::NdArray;
use burn::tensor::{Bool, Int, Tensor, TensorData};
use serde_json::json;
use trainer::chat::{parse_tool_call, ChatTemplate, ToolCallParseError};
use trainer::generate::{
    draw_on_device, generate, generate_continuing, FinishReason, PrefixCache, SamplingParams,
};
use trainer::model::{Architecture, CausalLm, Critic, ModelConfig};

type B = NdArray<f32>;

#[test]
fn tool_calls_parse_in_both_forms_and_fail_clearly() {
    let c = parse_tool_call("Let me write it.\n<tool_call>\n{\"name\": \"Write\", \"arguments\": {\"file_path\": \"a.txt\", \"content\": \"x\"}}\n</tool_call>").unwrap();
    assert_eq!(c.name, "Write");
    assert_eq!(c.arguments, json!({"file_path": "a.txt", "content": "x"}));
    let c = parse_tool_call("{\"name\": \"Submit\", \"parameters\": {}} trailing").unwrap();
    assert_eq!(
        (c.name.as_str(), c.arguments.clone()),
        ("Submit", json!({}))
    );
    let c =
        parse_tool_call("{\"name\": \"Bash\", \"arguments\": \"{\\\"command\\\": \\\"ls\\\"}\"}")
            .unwrap();
    assert_eq!(c.arguments, json!({"command": "ls"}));
    assert_eq!(
        parse_tool_call("I am done."),
        Err(ToolCallParseError::Missing)
    );
    assert_eq!(
        parse_tool_call("<tool_call>{\"name\": \"Bash\"}"),
        Err(ToolCallParseError::Unclosed)
    );
    assert!(matches!(
        parse_tool_call("<tool_call>{name: Bash}</tool_call>"),
        Err(ToolCallParseError::Json(_))
    ));
    assert!(matches!(
        parse_tool_call("<tool_call>{\"arguments\": {}}</tool_call>"),
        Err(ToolCallParseError::Shape(_))
    ));
    // The error text tells the agent the expected form.
    assert!(ToolCallParseError::Missing
        .to_string()
        .contains("<tool_call>"));
}

#[test]
fn templates_render_turns_that_concatenate() {
    let tools = [json!({"type": "function", "function": {"name": "Submit"}})];
    let p = ChatTemplate::Chatml.prompt("sys", &tools, "task");
    assert!(p.starts_with("<|im_start|>system\nsys"));
    assert!(
        p.contains("<tools>\n{\"function\":{\"name\":\"Submit\"},\"type\":\"function\"}\n</tools>")
    );
    assert!(p.ends_with("<|im_start|>user\ntask<|im_end|>\n<|im_start|>assistant\n"));
    let o = ChatTemplate::Chatml.observation("ok", true);
    assert_eq!(o, "\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
    let p = ChatTemplate::Llama3.prompt("sys", &[], "task");
    assert_eq!(p, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nsys<|eot_id|><|start_header_id|>user<|end_header_id|>\n\ntask<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    assert_eq!(
        ChatTemplate::detect("{% ... <|im_start|> ... %}"),
        Some(ChatTemplate::Chatml)
    );
    assert_eq!(
        ChatTemplate::detect("<|start_header_id|>"),
        Some(ChatTemplate::Llama3)
    );
}

fn tiny_config(tied: bool) -> ModelConfig {
    ModelConfig::from_json(&format!(
        r#"{{"model_type":"qwen2","vocab_size":40,"hidden_size":16,"intermediate_size":24,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "tie_word_embeddings":{tied}}}"#
    ))
    .unwrap()
}

/// A random untied tiny policy with room for 64 positions.
fn tiny_policy() -> (Architecture<B>, CausalLm<B>) {
    let device = Default::default();
    let cfg = tiny_config(false);
    (
        Architecture::<B>::new(cfg.clone(), 64, &device),
        CausalLm::<B>::random(&cfg, &device),
    )
}

fn logits(lm: &CausalLm<B>, arch: &Architecture<B>) -> Vec<f32> {
    let device = Default::default();
    let tokens =
        Tensor::<B, 2, Int>::from_data(TensorData::new(vec![1, 5, 9, 2, 7, 3], [1, 6]), &device);
    let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; 6], [1, 6]), &device);
    lm.forward(tokens, valid, arch, None)
        .into_data()
        .to_vec()
        .unwrap()
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
        let back = CausalLm::<B>::random(&cfg, &device)
            .load_record(&rec, &device)
            .unwrap();
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
    let v: Vec<f32> = critic
        .values(tokens, valid, &arch)
        .into_data()
        .to_vec()
        .unwrap();
    assert_eq!(v, vec![0.0; 3]);
    let path = dir.path().join("critic.mpk");
    critic.save_record(&path).unwrap();
    Critic::from_policy(&CausalLm::<B>::random(&cfg, &device), &device)
        .load_record(&path, &device)
        .unwrap();
}

#[test]
fn a_trainable_model_loads_steps_and_exports() {
    // The training backend: parameters are graph leaves there, so loading (which joins q/k/v
    // and gate/up) and exporting (which splits them) must not build on tracked tensors.
    type A = burn::backend::Autodiff<B>;
    use burn::module::AutodiffModule;
    let dir = tempfile::tempdir().unwrap();
    let device = Default::default();
    let cfg = tiny_config(false);
    let hf = dir.path().join("hf");
    CausalLm::<B>::random(&cfg, &device)
        .save_pretrained(&cfg, &hf)
        .unwrap();
    let (_, lm) = CausalLm::<A>::from_pretrained(&hf, &device).unwrap();
    let arch = Architecture::<A>::new(cfg.clone(), 16, &device);
    let tokens = Tensor::<A, 2, Int>::from_data(TensorData::new(vec![1, 5, 9, 2], [1, 4]), &device);
    let valid = Tensor::<A, 2, Bool>::from_data(TensorData::new(vec![true; 4], [1, 4]), &device);
    let loss = lm
        .sequence_stats(tokens, valid, &arch, 1.0)
        .logprobs
        .mean()
        .neg();
    let grads = loss.backward();
    let g = lm.backbone.layers[0]
        .self_attn
        .qkv_proj
        .weight
        .grad(&grads)
        .expect("q/k/v weights get a gradient");
    assert!(g.abs().sum().into_scalar() > 0.0);
    let out = dir.path().join("hf-again");
    lm.save_pretrained(&cfg, &out).unwrap();
    let (_, back) = CausalLm::<B>::from_pretrained(&out, &device).unwrap();
    let plain = Architecture::<B>::new(cfg.clone(), 16, &device);
    assert_eq!(logits(&back, &plain), logits(&lm.valid(), &plain));
}

#[test]
fn bad_configs_and_checkpoints_are_clear_errors() {
    let e = ModelConfig::from_json(r#"{"model_type":"gpt2","vocab_size":1,"hidden_size":4,"intermediate_size":4,"num_hidden_layers":1,"num_attention_heads":1}"#).unwrap_err();
    assert!(env_api::error_chain(&e).contains("gpt2"), "{e}");
    let e = ModelConfig::from_json(r#"{"vocab_size":1,"hidden_size":8,"intermediate_size":4,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":3}"#).unwrap_err();
    assert!(env_api::error_chain(&e).contains("multiple"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        tiny_config(true).to_hf_json().to_string(),
    )
    .unwrap();
    let e = CausalLm::<B>::from_pretrained(dir.path(), &Default::default()).unwrap_err();
    assert!(env_api::error_chain(&e).contains("no *.safetensors"), "{e}");
}

#[test]
fn sampling_is_seeded_and_honours_limits_and_stop_tokens() {
    let device = Default::default();
    let (arch, lm) = tiny_policy();
    let prompts = vec![vec![1, 2, 3], vec![4]];
    let p = SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        top_k: 10,
        max_new_tokens: 8,
        ..Default::default()
    };
    let a = generate(&lm, &arch, &prompts, &p, None, 7, &device);
    let b = generate(&lm, &arch, &prompts, &p, None, 7, &device);
    assert_eq!(a, b);
    for g in &a {
        assert_eq!(g.tokens.len(), 8);
        assert_eq!(g.finish, FinishReason::Length);
        assert!(g.logprobs.iter().all(|l| *l <= 0.0 && l.is_finite()));
    }
    // Every token is a stop token: each sequence ends after one.
    let stop = SamplingParams {
        stop_token_ids: (0..40).collect(),
        ..p
    };
    for g in generate(&lm, &arch, &prompts, &stop, None, 7, &device) {
        assert_eq!((g.tokens.len(), g.finish), (1, FinishReason::StopToken));
    }
}

#[test]
fn device_draw_inverts_the_whole_rows_distribution() {
    use burn::tensor::activation::log_softmax;
    // 300 tokens: not a multiple of the 128-token block, so the padded tail is exercised too.
    let (rows, vocab) = (3, 300);
    let logits: Vec<f32> = (0..rows * vocab)
        .map(|i| ((i * 37 % 101) as f32) / 12.0 - 4.0)
        .collect();
    let lp = log_softmax(
        Tensor::<B, 2>::from_data(TensorData::new(logits, [rows, vocab]), &Default::default()),
        1,
    );
    let host: Vec<f32> = lp.clone().into_data().to_vec().unwrap();
    let mut rng = trainer::seeds::ReplayRng::new(3);
    let mut counts = vec![0usize; vocab];
    let draws = 400;
    for _ in 0..draws {
        let us: Vec<f64> = (0..rows).map(|_| rng.unit_f64()).collect();
        let got = draw_on_device(lp.clone(), &us);
        for r in 0..rows {
            let row = &host[r * vocab..(r + 1) * vocab];
            // The reference: the first token whose cumulative probability passes u.
            let cdf: Vec<f64> = row
                .iter()
                .scan(0.0, |acc, l| {
                    *acc += f64::from(l.exp());
                    Some(*acc)
                })
                .collect();
            let target = us[r] * cdf[vocab - 1];
            let want = cdf.iter().position(|&c| c > target).unwrap_or(vocab - 1);
            let (tok, logprob) = got[r];
            // Block sums round differently from one running sum: a draw within 1e-5 of a
            // boundary may land on its neighbour, nowhere else.
            let boundary = cdf[tok.min(want)];
            assert!(
                tok == want || (tok.abs_diff(want) == 1 && (boundary - target).abs() < 1e-5),
                "u {} row {r}: got {tok}, want {want}",
                us[r]
            );
            assert_eq!(logprob, row[tok]);
            if r == 0 {
                counts[tok] += 1;
            }
        }
    }
    // The most likely token of row 0 is drawn about as often as its probability says.
    let top = (0..vocab)
        .max_by(|&a, &b| host[a].total_cmp(&host[b]))
        .unwrap();
    let expected = f64::from(host[top].exp()) * draws as f64;
    assert!(
        (counts[top] as f64 - expected).abs() < 4.0 * expected.sqrt() + 1.0,
        "{} vs {expected}",
        counts[top]
    );
}

#[test]
fn greedy_and_full_sampling_agree_with_the_model() {
    let device = Default::default();
    let (arch, lm) = tiny_policy();
    let prompts = vec![vec![1, 2, 3], vec![4]];
    // Greedy: the first token is the argmax of the model's last-position logits.
    let greedy = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 4,
        ..Default::default()
    };
    let out = generate(&lm, &arch, &prompts, &greedy, None, 0, &device);
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![1i32, 2, 3], [1, 3]), &device);
    let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; 3], [1, 3]), &device);
    let logits: Vec<f32> = lm
        .forward(tokens, valid, &arch, None)
        .narrow(1, 2, 1)
        .into_data()
        .to_vec()
        .unwrap();
    let best = (0..logits.len())
        .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
        .unwrap();
    assert_eq!(out[0].tokens[0] as usize, best);
    // Full-distribution sampling (drawn on the device) is seeded and reports true log-probabilities.
    let full = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 6,
        ..Default::default()
    };
    let a = generate(&lm, &arch, &prompts, &full, None, 11, &device);
    assert_eq!(a, generate(&lm, &arch, &prompts, &full, None, 11, &device));
    assert_ne!(a, generate(&lm, &arch, &prompts, &full, None, 12, &device));
    for g in &a {
        assert_eq!(g.tokens.len(), 6);
        assert!(g.logprobs.iter().all(|l| *l <= 0.0 && l.is_finite()));
    }
}

#[test]
fn pruning_keeps_the_newest_step_checkpoints_and_latest() {
    use trainer::checkpoint::{latest, prune, save, StageState};
    let dir = tempfile::tempdir().unwrap();
    for step in [2, 4, 6, 8, 10] {
        let state = StageState {
            stage: "ppo".into(),
            step,
            total_steps: 10,
            seed: 0,
        };
        save(dir.path(), &state, |f| {
            std::fs::write(f.policy(), b"weights")
                .map_err(|e| trainer::TrainError::Io(f.policy(), e))
        })
        .unwrap();
    }
    std::fs::create_dir(dir.path().join("final")).unwrap();
    assert_eq!(prune(dir.path(), 2).unwrap(), 3);
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["final", "latest", "step-000008", "step-000010"]);
    assert!(latest(dir.path())
        .unwrap()
        .unwrap()
        .dir
        .ends_with("step-000010"));
    assert_eq!(prune(dir.path(), 0).unwrap(), 0, "0 keeps everything");
}

#[test]
fn assistant_turns_split_into_text_and_calls_or_stay_text() {
    use trainer::chat::{split_tool_calls, ParsedToolCall};
    let call = |name: &str, arguments: serde_json::Value| ParsedToolCall {
        name: name.into(),
        arguments,
    };
    let text = "Writing it.\n<tool_call>\n{\"name\": \"Write\", \"arguments\": {\"file_path\": \"a\", \"content\": \"b\"}}\n</tool_call>\n<tool_call>\n{\"arguments\":{},\"name\":\"Submit\"}\n</tool_call>";
    assert_eq!(
        split_tool_calls(text),
        Some((
            "Writing it.".to_string(),
            vec![
                call("Write", json!({"file_path": "a", "content": "b"})),
                call("Submit", json!({}))
            ]
        ))
    );
    // Malformed, unclosed, trailing text, or bare JSON: plain text.
    for text in [
        "<tool_call>\n{\"name\": \"Write\", \"arguments\": {\"file_path\": }\n</tool_call>",
        "<tool_call>\n{\"name\": \"Submit\", \"arguments\": {}}",
        "<tool_call>{\"name\": \"Submit\"}</tool_call> and then more",
        "{\"name\": \"Submit\", \"arguments\": {}}",
        "no call at all",
    ] {
        assert_eq!(split_tool_calls(text), None, "{text}");
    }
}

#[test]
fn whole_conversations_render_as_rollouts_build_them() {
    use trainer::chat::{call_block, ChatTurn, ParsedToolCall};
    let tools = [json!({"type": "function", "function": {"name": "Submit"}})];
    let call = ParsedToolCall {
        name: "Submit".into(),
        arguments: json!({}),
    };
    for t in [ChatTemplate::Chatml, ChatTemplate::Llama3] {
        let turns = [
            ChatTurn::System("sys".into()),
            ChatTurn::User("task".into()),
            ChatTurn::Assistant {
                content: String::new(),
                calls: vec![call.clone()],
            },
            ChatTurn::Tool("done".into()),
        ];
        let rollout = format!(
            "{}{}{}{}",
            t.prompt("sys", &tools, "task"),
            call_block("Submit", &json!({})),
            t.end_of_turn(),
            t.observation("done", true)
        );
        assert_eq!(t.render(&turns, &tools, true), rollout, "{t:?}");
        // Without a system message the tools still get a system turn to live in.
        assert_eq!(
            t.render(&turns[1..2], &tools, true),
            t.prompt("", &tools, "task")
        );
    }
}

#[test]
fn mapped_and_whole_file_loading_give_the_same_weights() {
    use trainer::model::weights::{LoadMode, WeightMap};
    let (_, lm) = tiny_policy();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(false);
    lm.save_pretrained(&cfg, dir.path()).unwrap();
    let device = Default::default();
    let load = |mode| {
        let mut w = WeightMap::open(dir.path(), mode).unwrap();
        let backbone = w.backbone::<B>(&cfg, &device).unwrap();
        let head = w.lm_head::<B>(&cfg, &device).unwrap();
        assert!(w.names().is_empty(), "every tensor taken: {:?}", w.names());
        CausalLm {
            backbone,
            lm_head: head,
        }
    };
    let (arch, _) = tiny_policy();
    let want = logits(&lm, &arch);
    assert_eq!(logits(&load(LoadMode::Mapped), &arch), want);
    assert_eq!(logits(&load(LoadMode::ReadWhole), &arch), want);
}

/// A multi-turn conversation continued from its kept cache samples what a from-scratch
/// generation over the whole context samples (greedy: the same tokens; log-probabilities to
/// float order), and each turn prefills only the tokens it added: the last sampled token,
/// which was never fed, and the observation. Rows end at different steps (stop tokens), and
/// one conversation's context is cut where it diverged from its cache.
#[test]
fn conversations_continue_from_their_kept_caches() {
    let device = Default::default();
    let cfg = tiny_config(false);
    let arch = Architecture::<B>::new(cfg.clone(), 256, &device);
    let lm = CausalLm::<B>::random(&cfg, &device);
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 6,
        stop_token_ids: vec![3, 11, 17, 29],
        ..Default::default()
    };
    let mut contexts: Vec<Vec<u32>> =
        vec![vec![1, 2, 3, 4, 5], vec![7], vec![9, 8, 7, 6, 5, 4, 3, 2]];
    let mut kept: Vec<Option<PrefixCache<B>>> = vec![None, None, None];
    for turn in 0..5u32 {
        let before: Vec<usize> = contexts.iter().map(Vec::len).collect();
        let cached: Vec<usize> = kept
            .iter()
            .map(|k| k.as_ref().map_or(0, |p| p.tokens().len()))
            .collect();
        let scratch = generate(&lm, &arch, &contexts, &params, None, 5, &device);
        let out = generate_continuing(
            &lm,
            &arch,
            &contexts,
            std::mem::take(&mut kept),
            &params,
            None,
            5,
            &device,
        );
        for (a, b) in out.generations.iter().zip(&scratch) {
            assert_eq!((&a.tokens, a.finish), (&b.tokens, b.finish), "turn {turn}");
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-4, "turn {turn}: {x} against {y}");
            }
        }
        let reused: usize = cached.iter().sum();
        assert_eq!(out.reused_tokens, reused, "turn {turn}");
        assert_eq!(
            out.prefilled_tokens,
            before.iter().sum::<usize>() - reused,
            "turn {turn}"
        );
        if turn > 0 {
            // Only the last sampled token and the observation were new.
            assert_eq!(out.prefilled_tokens, 3 * (1 + 2), "turn {turn}");
        }
        for (i, (g, cache)) in out.generations.iter().zip(out.caches).enumerate() {
            assert_eq!(cache.tokens().len(), before[i] + g.tokens.len() - 1);
            contexts[i].extend(&g.tokens);
            contexts[i].extend([30 + turn, 31]);
            kept.push(Some(cache));
        }
    }
    // A context that no longer extends its cache (the conversation was cut and rewritten)
    // continues from the common prefix only, and still matches a fresh generation.
    contexts[1].truncate(3);
    contexts[1].extend([12, 13]);
    let scratch = generate(&lm, &arch, &contexts, &params, None, 9, &device);
    let out = generate_continuing(&lm, &arch, &contexts, kept, &params, None, 9, &device);
    for (a, b) in out.generations.iter().zip(&scratch) {
        assert_eq!(a.tokens, b.tokens);
    }
    assert_eq!(out.prefilled_tokens, 2 * (1 + 2) + 2);
}
