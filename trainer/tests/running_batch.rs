//! Continuous batching: conversations join a running batch between decode steps and leave it
//! as soon as their turn ends, and each turn samples what a generation of that conversation
//! alone would.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use burn::backend::NdArray;
use trainer::generate::{
    generate, FinishReason, Generation, RunningBatch, SamplingParams, TurnDone, TurnRequest,
};
use trainer::model::{Architecture, CausalLm, ModelConfig};

type B = NdArray<f32>;

fn tiny_config() -> ModelConfig {
    ModelConfig::from_json(
        r#"{"model_type":"qwen2","vocab_size":40,"hidden_size":16,"intermediate_size":24,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "tie_word_embeddings":false}"#,
    )
    .unwrap()
}

/// What a greedy generation of `context` alone samples, at most `max_new` tokens.
fn alone(
    lm: &CausalLm<B>,
    arch: &Architecture<B>,
    params: &SamplingParams,
    context: &[u32],
    max_new: usize,
) -> Generation {
    let params = SamplingParams {
        max_new_tokens: max_new,
        ..params.clone()
    };
    let device = Default::default();
    generate(lm, arch, &[context.to_vec()], &params, None, 0, &device)
        .pop()
        .unwrap()
}

fn assert_same(got: &TurnDone<B>, want: &Generation, what: &str) {
    let g = &got.generation;
    assert_eq!((&g.tokens, g.finish), (&want.tokens, want.finish), "{what}");
    for (x, y) in g.logprobs.iter().zip(&want.logprobs) {
        assert!((x - y).abs() < 1e-4, "{what}: {x} against {y}");
    }
}

/// Three conversations: the first decodes alone for two steps, then the other two join
/// (one of them continuing from a kept cache). Every turn samples what it would alone, ends
/// at its own stop token or limit, and leaves with a cache of every token fed; its next
/// turn prefills only the last sampled token and the observation.
#[test]
fn turns_join_between_steps_and_leave_when_they_end() {
    let device = Default::default();
    let cfg = tiny_config();
    let arch = Architecture::<B>::new(cfg.clone(), 512, &device);
    let lm = CausalLm::<B>::random(&cfg, &device);
    let params = SamplingParams {
        temperature: 0.0,
        stop_token_ids: vec![3, 11, 17, 29],
        ..Default::default()
    };
    let mut batch = RunningBatch::new(&lm, &arch, params.clone(), None, device);
    let contexts: Vec<Vec<u32>> = vec![vec![1, 2, 4, 5], vec![7], vec![9, 8, 7, 6, 5, 4, 2]];
    let limits = [8, 5, 7];
    let request = |key: usize| TurnRequest {
        key,
        context: contexts[key].clone(),
        prefix: None,
        max_new_tokens: limits[key],
        seed: key as u64,
    };
    assert_eq!(batch.admit(vec![request(0)]), (4, 0));
    let mut done: Vec<TurnDone<B>> = Vec::new();
    for _ in 0..2 {
        done.extend(batch.step());
    }
    assert_eq!(batch.admit(vec![request(1), request(2)]), (8, 0));
    while !batch.is_empty() {
        done.extend(batch.step());
    }
    assert_eq!(done.len(), 3);
    for d in &done {
        let want = alone(&lm, &arch, &params, &contexts[d.key], limits[d.key]);
        assert_same(d, &want, &format!("conversation {}", d.key));
        let fed = d.generation.tokens.len() - 1;
        assert_eq!(d.cache.tokens().len(), contexts[d.key].len() + fed);
    }
    // Their next turns: the kept caches take all but the last sampled token and the
    // observation.
    let mut next = Vec::new();
    let mut turn_two = Vec::new();
    for d in done {
        let mut ctx = contexts[d.key].clone();
        ctx.extend(&d.generation.tokens);
        ctx.extend([30, 31]);
        turn_two.push((d.key, ctx.clone()));
        next.push(TurnRequest {
            key: d.key,
            context: ctx,
            prefix: Some(d.cache),
            max_new_tokens: 6,
            seed: 9,
        });
    }
    let reused: usize = next.iter().map(|t| t.context.len() - 3).sum();
    assert_eq!(batch.admit(next), (3 * 3, reused));
    let mut done = Vec::new();
    while !batch.is_empty() {
        done.extend(batch.step());
    }
    for d in &done {
        let ctx = &turn_two.iter().find(|(k, _)| *k == d.key).unwrap().1;
        let want = alone(&lm, &arch, &params, ctx, 6);
        assert_same(d, &want, &format!("conversation {}, turn 2", d.key));
    }
}

/// A long conversation leaves after one token while a short one goes on: the padding the
/// short row no longer needs is dropped, and it still samples what it would alone.
#[test]
fn padding_left_by_a_long_conversation_is_dropped() {
    let device = Default::default();
    let cfg = tiny_config();
    let arch = Architecture::<B>::new(cfg.clone(), 512, &device);
    let lm = CausalLm::<B>::random(&cfg, &device);
    let params = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let long: Vec<u32> = (0..300).map(|i| (i * 7 % 37) as u32 + 1).collect();
    let short = vec![5u32, 6, 2];
    let mut batch = RunningBatch::new(&lm, &arch, params.clone(), None, device);
    batch.admit(vec![
        TurnRequest {
            key: 0,
            context: long.clone(),
            prefix: None,
            max_new_tokens: 1,
            seed: 0,
        },
        TurnRequest {
            key: 1,
            context: short.clone(),
            prefix: None,
            max_new_tokens: 12,
            seed: 1,
        },
    ]);
    let first = batch.step();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].key, 0);
    assert_eq!(first[0].generation.finish, FinishReason::Length);
    // The 300 slots of padding went with it: the short row and its first new token remain.
    assert_eq!(batch.cache_len(), short.len() + 1);
    let mut rest = Vec::new();
    while !batch.is_empty() {
        rest.extend(batch.step());
    }
    assert_eq!(rest.len(), 1);
    assert_same(&rest[0], &alone(&lm, &arch, &params, &short, 12), "short");
    assert_eq!(rest[0].cache.tokens().len(), short.len() + 11);
}
