//! `trainer serve`: the real binary on a free port with a tiny random model, called over HTTP
//! as an OpenAI client would.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};
use trainer::chat::{ChatTemplate, ChatTurn, ParsedToolCall};
use trainer::tokenizer::TextTokenizer;

/// A running `trainer serve`, killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(extra: &[&str]) -> Self {
        Self::start_with(&[&["--tiny-random", "--seed", "3"], extra].concat())
    }

    fn start_with(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_trainer"))
            .args(["serve", "--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start trainer serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read the first line");
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("first line: {line:?}"))
            .to_string();
        Self { child, url }
    }

    async fn post(&self, body: &Value) -> (u16, Value) {
        self.post_raw(body.to_string()).await
    }

    async fn post_raw(&self, body: String) -> (u16, Value) {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", self.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request");
        let status = r.status().as_u16();
        (status, r.json().await.expect("a JSON body"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tiny_tokenizer() -> TextTokenizer {
    TextTokenizer::from_file(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-tokenizer.json"),
    )
    .unwrap()
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "Submit", "description": "Finish.",
         "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "Write", "description": "Write a file.",
         "parameters": {"type": "object", "properties": {"file_path": {"type": "string"},
                        "content": {"type": "string"}}, "required": ["file_path", "content"]}}}
    ])
}

/// An OpenAI error body with the given status and code.
fn assert_error(got: (u16, Value), status: u16, code: &str) {
    let (s, body) = got;
    assert_eq!(s, status, "{body}");
    let e = &body["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e["type"].is_string(), "{body}");
    assert_eq!(e["code"], code, "{body}");
}

#[tokio::test]
async fn answers_have_the_openai_shape_and_count_tokens() {
    let server = Server::start(&[]);
    let models: Value = reqwest::get(format!("{}/v1/models", server.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tiny-random");
    assert_eq!(models["data"][0]["object"], "model");

    let messages = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Write red into answer.txt."}]}
    ]);
    let (status, r) = server
        .post(
            &json!({"model": "tiny-random", "messages": messages, "max_tokens": 6,
                      "seed": 7, "n": 2, "temperature": 1.0}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert!(r["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(r["object"], "chat.completion");
    assert!(r["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(r["model"], "tiny-random");
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut expected_completion = 0;
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["role"], "assistant");
        assert!(c["message"]["content"].is_string());
        let finish = c["finish_reason"].as_str().unwrap();
        assert!(finish == "stop" || finish == "length", "{finish}");
        // A choice that ran to the limit took all 6 tokens; one that stopped, 6 at most.
        expected_completion += if finish == "length" { 6 } else { 0 };
    }
    // The prompt is the conversation rendered with the trainer's template.
    let turns = [
        ChatTurn::System("You are terse.".into()),
        ChatTurn::User("Write red into answer.txt.".into()),
    ];
    let text = ChatTemplate::Chatml.render(&turns, &[], true);
    assert_eq!(
        text,
        ChatTemplate::Chatml.prompt("You are terse.", &[], "Write red into answer.txt.")
    );
    let prompt_tokens = tiny_tokenizer().encode(&text).unwrap().len();
    let usage = &r["usage"];
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    let completion = usage["completion_tokens"].as_u64().unwrap() as usize;
    assert!(
        completion <= 12 && completion >= expected_completion,
        "{usage}"
    );
    assert_eq!(usage["total_tokens"], prompt_tokens + completion);
}

/// Requests sent at once decode together (continuous batching: of different lengths, sampling
/// settings and `n`, one streamed) and each gets the answer it gets alone; a client that hangs
/// up mid-stream leaves the batch without holding up the others.
#[tokio::test]
async fn requests_at_once_decode_together_and_answer_as_they_would_alone() {
    let server = Server::start(&[]);
    let bodies: Vec<Value> = vec![
        json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "seed": 1, "top_p": 0.9}),
        json!({"messages": [{"role": "user", "content": "a longer question here"}], "max_tokens": 40, "seed": 2, "top_p": 0.9}),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "seed": 3, "top_p": 0.9, "n": 2}),
        json!({"messages": [{"role": "user", "content": "greedy"}], "max_tokens": 25, "temperature": 0}),
        json!({"messages": [{"role": "user", "content": "streamed"}], "max_tokens": 16, "seed": 5, "top_p": 0.9, "stream": true}),
        json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 30, "seed": 6}),
    ];
    let url = server.url.clone();
    let ask = |body: Value| {
        let url = url.clone();
        async move {
            let r = reqwest::Client::new()
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let raw = r.text().await.unwrap();
            if body["stream"] == json!(true) {
                // The deltas joined.
                return raw
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .filter(|d| *d != "[DONE]")
                    .filter_map(|d| {
                        let c: Value = serde_json::from_str(d).unwrap();
                        c["choices"][0]["delta"]["content"]
                            .as_str()
                            .map(String::from)
                    })
                    .collect::<Vec<_>>()
                    .join("");
            }
            let v: Value = serde_json::from_str(&raw).unwrap();
            v["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["message"]["content"].as_str().unwrap_or("").to_string())
                .collect::<Vec<_>>()
                .join("|")
        }
    };
    let mut alone = Vec::new();
    for b in &bodies {
        alone.push(ask(b.clone()).await);
    }
    // A long stream whose client hangs up after its first text.
    let mut dropped = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.url))
        .json(
            &json!({"messages": [{"role": "user", "content": "long"}], "max_tokens": 400,
                      "seed": 9, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let mut seen = String::new();
    while !seen.contains("\"delta\":{\"content\":\"") {
        let chunk = dropped
            .chunk()
            .await
            .unwrap()
            .expect("a chunk before the end");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(dropped);
    let handles: Vec<_> = bodies
        .iter()
        .map(|b| tokio::spawn(ask(b.clone())))
        .collect();
    let mut together = Vec::new();
    for h in handles {
        together.push(h.await.unwrap());
    }
    assert_eq!(together, alone);
    assert!(alone.iter().any(|t| !t.is_empty()), "{alone:?}");
}

#[tokio::test]
async fn a_fixed_seed_gives_the_same_answer_streamed_or_not() {
    let server = Server::start(&[]);
    let body = |seed: u64| {
        json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
               "seed": seed, "top_p": 0.9})
    };
    let (_, a) = server.post(&body(11)).await;
    let (_, b) = server.post(&body(11)).await;
    let (_, c) = server.post(&body(12)).await;
    let text = |r: &Value| {
        r["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(text(&a), text(&b));
    assert_ne!(text(&a), text(&c), "another seed, another sample");
    let greedy = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                        "temperature": 0});
    let (_, g1) = server.post(&greedy).await;
    let (_, g2) = server.post(&greedy).await;
    assert_eq!(text(&g1), text(&g2));

    // The same request streamed: role chunk, deltas that add up to the same text, a finishing
    // chunk, the usage chunk, then [DONE].
    let mut streamed = body(11);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let sse = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.url))
        .json(&streamed)
        .send()
        .await
        .unwrap();
    assert_eq!(sse.status(), 200);
    assert!(sse.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let raw = sse.text().await.unwrap();
    let data: Vec<&str> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let joined: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(joined, text(&a));
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(finish, &a["choices"][0]["finish_reason"]);
    assert_eq!(chunks[chunks.len() - 1]["usage"], a["usage"]);
}

#[tokio::test]
async fn tool_calls_round_trip_through_the_template() {
    let server = Server::start(&[]);
    let user = json!({"role": "user", "content": "Finish the task."});
    // A named function that takes no arguments: the call is determined, so the server writes
    // it in the template's syntax and returns it parsed.
    let (status, r) = server
        .post(
            &json!({"messages": [user], "tools": tools(), "max_tokens": 64,
                      "tool_choice": {"type": "function", "function": {"name": "Submit"}}}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert!(choice["message"]["content"].is_null());
    let call = &choice["message"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "Submit");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({}));

    // The call and its result go back in: the conversation renders as a rollout's context
    // would (prompt, canonical call, observation).
    let followup = json!([
        user,
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Submitted."}
    ]);
    let (status, r2) = server
        .post(&json!({"messages": followup, "tools": tools(), "max_tokens": 4, "seed": 1}))
        .await;
    assert_eq!(status, 200, "{r2}");
    let tools_v: Vec<Value> = tools().as_array().unwrap().clone();
    let turns = [
        ChatTurn::User("Finish the task.".into()),
        ChatTurn::Assistant {
            content: String::new(),
            calls: vec![ParsedToolCall {
                name: "Submit".into(),
                arguments: json!({}),
            }],
        },
        ChatTurn::Tool("Submitted.".into()),
    ];
    let text = ChatTemplate::Chatml.render(&turns, &tools_v, true);
    let rollout = format!(
        "{}<tool_call>\n{{\"arguments\":{{}},\"name\":\"Submit\"}}\n</tool_call><|im_end|>{}",
        ChatTemplate::Chatml.prompt("", &tools_v, "Finish the task."),
        ChatTemplate::Chatml.observation("Submitted.", true)
    );
    assert_eq!(text, rollout);
    assert_eq!(
        r2["usage"]["prompt_tokens"],
        tiny_tokenizer().encode(&text).unwrap().len()
    );

    // A function with arguments: the server opens the call and the model writes the rest.
    // Whatever the random model writes, the answer is a 200: a parsed call to Write, or the
    // text as content when it does not parse.
    let (status, r3) = server
        .post(
            &json!({"messages": [user], "tools": tools(), "max_tokens": 40, "seed": 5,
                      "tool_choice": {"type": "function", "function": {"name": "Write"}}}),
        )
        .await;
    assert_eq!(status, 200, "{r3}");
    let m = &r3["choices"][0]["message"];
    match m["tool_calls"].as_array() {
        Some(calls) => assert_eq!(calls[0]["function"]["name"], "Write"),
        None => assert!(
            m["content"]
                .as_str()
                .unwrap()
                .starts_with("<tool_call>\n{\"name\": \"Write\""),
            "{r3}"
        ),
    }
}

#[tokio::test]
async fn bad_requests_are_openai_errors() {
    let server = Server::start(&["--context", "256", "--max-body-bytes", "65536"]);
    let user = json!([{"role": "user", "content": "hi"}]);
    assert_error(
        server.post_raw("{\"messages\": [".into()).await,
        400,
        "invalid_json",
    );
    assert_error(
        server
            .post(&json!({"messages": [{"role": "wizard", "content": "hi"}]}))
            .await,
        400,
        "invalid_json",
    );
    assert_error(
        server.post(&json!({"messages": []})).await,
        400,
        "invalid_value",
    );
    assert_error(
        server
            .post(&json!({"messages": user, "max_tokens": 1_000_000_000u64}))
            .await,
        400,
        "context_length_exceeded",
    );
    assert_error(
        server
            .post(&json!({"messages": [{"role": "user", "content": "red ".repeat(400)}]}))
            .await,
        400,
        "context_length_exceeded",
    );
    assert_error(
        server.post(&json!({"messages": user, "n": 0})).await,
        400,
        "invalid_value",
    );
    assert_error(
        server
            .post(&json!({"messages": user, "temperature": 5.0}))
            .await,
        400,
        "invalid_value",
    );
    assert_error(
        server
            .post(&json!({"messages": user, "tools": tools(),
                          "tool_choice": {"type": "function", "function": {"name": "Nope"}}}))
            .await,
        400,
        "invalid_value",
    );
    assert_error(
        server
            .post(&json!({"messages": [{"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "Write", "arguments": "[1]"}}]}]}))
            .await,
        400,
        "invalid_value",
    );
    assert_error(
        server
            .post(&json!({"messages": user, "model": "gpt-4o"}))
            .await,
        404,
        "model_not_found",
    );
    assert_error(
        server
            .post(&json!({"messages": [{"role": "user", "content": "x".repeat(100_000)}]}))
            .await,
        413,
        "payload_too_large",
    );
    let r = reqwest::get(format!("{}/v1/nothing", server.url))
        .await
        .unwrap();
    let status = r.status().as_u16();
    assert_error((status, r.json().await.unwrap()), 404, "not_found");
    // Still serving after all that.
    let (status, _) = server
        .post(&json!({"messages": user, "max_tokens": 2}))
        .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_stage_checkpoint_is_served_with_its_weights() {
    use burn::backend::NdArray;
    use burn::tensor::backend::Backend;
    use trainer::checkpoint::{save, StageState};
    use trainer::generate::{generate, SamplingParams};
    use trainer::model::{Architecture, CausalLm, ModelConfig};
    type B = NdArray<f32>;
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-tokenizer.json"),
        model.join("tokenizer.json"),
    )
    .unwrap();
    let config = json!({"model_type": "qwen2", "vocab_size": 512, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": true,
        "eos_token_id": 2});
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    // Trained weights stand-in: random ones of another seed than the server would draw.
    let device = Default::default();
    B::seed(&device, 99);
    let cfg = ModelConfig::from_json(&config.to_string()).unwrap();
    let lm = CausalLm::<B>::random(&cfg, &device);
    let stage = dir.path().join("ppo");
    std::fs::create_dir_all(&stage).unwrap();
    let state = StageState {
        stage: "ppo".into(),
        step: 3,
        total_steps: 3,
        seed: 0,
    };
    let step_dir = save(&stage, &state, |f| Ok(lm.save_record(&f.policy())?)).unwrap();

    let latest = stage.join("latest");
    let server = Server::start_with(&[
        "--model",
        model.to_str().unwrap(),
        "--checkpoint",
        latest.to_str().unwrap(),
    ]);
    let (status, r) = server
        .post(
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                      "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["model"], step_dir.display().to_string());
    let card: Value = reqwest::get(format!("{}/v1/models/{}", server.url, step_dir.display()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(card["id"], step_dir.display().to_string());
    // The same greedy decoding in this process, on the checkpoint's weights.
    let tok = tiny_tokenizer();
    let text = ChatTemplate::Chatml.render(&[ChatTurn::User("hi".into())], &[], true);
    let arch = Architecture::<B>::new(cfg.clone(), 256, &device);
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 6,
        stop_token_ids: vec![2],
        ..Default::default()
    };
    let g = generate(
        &lm,
        &arch,
        &[tok.encode(&text).unwrap()],
        &params,
        None,
        0,
        &device,
    );
    let tokens: Vec<u32> = g[0].tokens.iter().copied().filter(|&t| t != 2).collect();
    assert_eq!(r["choices"][0]["message"]["content"], tok.decode(&tokens));
}

#[tokio::test]
async fn a_busy_generation_thread_refuses_beyond_its_queue_and_the_server_still_answers() {
    // No room for waiting requests: while one generates, another chat request is a 429.
    let server = Server::start(&["--max-batch", "1", "--max-queue", "0"]);
    let http = reqwest::Client::new();
    let mut long = http
        .post(format!("{}/v1/chat/completions", server.url))
        .json(
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 150,
                      "seed": 2, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    // Read until the first sampled text: the generation thread is busy from here on.
    let mut seen = String::new();
    while !seen.contains("\"delta\":{\"content\":\"") {
        let chunk = long.chunk().await.unwrap().expect("a chunk before the end");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let models = http
        .get(format!("{}/v1/models", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    assert_error(
        server
            .post(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
            .await,
        429,
        "server_busy",
    );
    while let Some(chunk) = long.chunk().await.unwrap() {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.trim_end().ends_with("data: [DONE]"), "{seen}");
    // Idle again: served.
    let (status, r) = server
        .post(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .await;
    assert_eq!(status, 200, "{r}");
}

#[tokio::test]
async fn a_peft_adapter_is_served_on_its_base() {
    use burn::backend::{Autodiff, NdArray};
    use burn::module::AutodiffModule;
    use burn::tensor::backend::Backend;
    use burn::tensor::{Bool, Int, Tensor, TensorData};
    use trainer::generate::{generate, SamplingParams};
    use trainer::model::{Architecture, CausalLm, LoraSpec, LoraTarget, ModelConfig};
    use trainer::optim::Trainable;
    type B = NdArray<f32>;
    type A = Autodiff<B>;
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let config = json!({"model_type": "qwen2", "vocab_size": 512, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": true,
        "eos_token_id": 2});
    let cfg = ModelConfig::from_json(&config.to_string()).unwrap();
    let device = Default::default();
    A::seed(&device, 5);
    let base = CausalLm::<A>::random(&cfg, &device);
    base.valid().save_pretrained(&cfg, &model).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-tokenizer.json"),
        model.join("tokenizer.json"),
    )
    .unwrap();
    // Adapters moved off zero by a few steps on some tokens.
    let spec = LoraSpec {
        rank: 4,
        alpha: 16.0,
        dropout: 0.0,
        targets: LoraTarget::ALL.to_vec(),
    };
    let arch = Architecture::<A>::new(cfg.clone(), 256, &device);
    let mut lm = base.with_adapters(&spec);
    let mut opt = Trainable::new(0.0, 0.0);
    for _ in 0..3 {
        let tokens =
            Tensor::<A, 2, Int>::from_data(TensorData::new(vec![7, 9, 11, 13], [1, 4]), &device);
        let valid =
            Tensor::<A, 2, Bool>::from_data(TensorData::new(vec![true; 4], [1, 4]), &device);
        let loss = lm
            .sequence_stats(tokens, valid, &arch, 1.0)
            .logprobs
            .mean()
            .neg();
        opt.backward(&lm, loss);
        lm = opt.step(0.2, lm).0;
    }
    let adapter = dir.path().join("adapter");
    lm.save_peft(&spec, Some(&model), &adapter).unwrap();

    let server = Server::start_with(&[
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
    ]);
    let (status, r) = server
        .post(
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                      "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["model"], adapter.display().to_string());
    // The same greedy decoding in this process, on base plus adapter.
    let tok = tiny_tokenizer();
    let text = ChatTemplate::Chatml.render(&[ChatTurn::User("hi".into())], &[], true);
    let inner = lm.valid();
    let inner_arch = Architecture::<B>::new(cfg.clone(), 256, &device);
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 8,
        stop_token_ids: vec![2],
        ..Default::default()
    };
    let g = generate(
        &inner,
        &inner_arch,
        &[tok.encode(&text).unwrap()],
        &params,
        None,
        0,
        &device,
    );
    let tokens: Vec<u32> = g[0].tokens.iter().copied().filter(|&t| t != 2).collect();
    assert_eq!(r["choices"][0]["message"]["content"], tok.decode(&tokens));

    // A directory that is not a LoRA adapter is a clear error at start.
    std::fs::write(
        adapter.join("adapter_config.json"),
        r#"{"peft_type":"IA3","r":1,"lora_alpha":1,"target_modules":[]}"#,
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args([
            "serve",
            "--port",
            "0",
            "--model",
            model.to_str().unwrap(),
            "--adapter",
        ])
        .arg(&adapter)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("IA3"), "{err}");
}
