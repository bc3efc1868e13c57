//! The learning signals and the RFT filter against values worked out by hand.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use burn::backend::NdArray;
use burn::tensor::{Tensor, TensorData};
use serde_json::json;
use trainer::chat::{parse_tool_call, ChatTemplate};
use trainer::curation::{rft_filter, rft_verdict, Rejection};
use trainer::objective::{
    clipped_mask, clipped_surrogate, clipped_value_loss, explained_variance, gae, kl_k3,
    masked_sum, whiten,
};
use trainer::render::Renderer;
use trainer::rollout::solution_of;
use trainer::sample::{Outcome, Sample, TurnRecord};
use trainer::tokenizer::TextTokenizer;

type B = NdArray<f32>;

fn t2(rows: &[&[f32]]) -> Tensor<B, 2> {
    let w = rows[0].len();
    let data: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_data(TensorData::new(data, [rows.len(), w]), &Default::default())
}

fn values(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().to_vec().unwrap()
}

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
    }
}

#[test]
fn gae_skips_observation_tokens_and_bootstraps_from_the_next_action() {
    // Actions at 1, 2 and 4; position 3 is an observation token; the reward sits on the last action.
    let mask = [false, true, true, false, true];
    let rewards = [0.0, 0.0, 0.0, 0.0, 1.0];
    let v = [9.0, 0.5, 0.2, 9.0, 0.4];
    let g = gae(&rewards, &v, &mask, 1.0, 0.5);
    // i=4: delta = 1 - 0.4 = 0.6.  i=2: delta = 0.4 - 0.2 = 0.2, A = 0.2 + 0.5 * 0.6 = 0.5.
    // i=1: delta = 0.2 - 0.5 = -0.3, A = -0.3 + 0.5 * 0.5 = -0.05.
    close(&g.advantages, &[0.0, -0.05, 0.5, 0.0, 0.6]);
    close(&g.returns, &[0.0, 0.45, 0.7, 0.0, 1.0]);
    // gamma < 1 discounts per action, not per token: lambda 1 gives discounted Monte Carlo.
    let g = gae(&rewards, &v, &mask, 0.9, 1.0);
    close(&g.returns, &[0.0, 0.81, 0.9, 0.0, 1.0]);
}

#[test]
fn whitening_uses_only_masked_positions() {
    let mut seqs = vec![vec![1.0, 100.0, 2.0], vec![3.0]];
    let masks = vec![vec![true, false, true], vec![true]];
    whiten(&mut seqs, &masks);
    // mean 2, sample std 1.
    close(&seqs[0], &[-1.0, 100.0, 0.0]);
    close(&seqs[1], &[1.0]);
}

#[test]
fn clipped_surrogate_takes_the_pessimistic_side_of_an_asymmetric_clip() {
    let up = 1.5f32.ln();
    let down = 0.5f32.ln();
    let new = t2(&[&[up, up, down, down, 0.1f32.ln_1p()]]);
    let old = t2(&[&[0.0; 5]]);
    let adv = t2(&[&[2.0, -2.0, 2.0, -2.0, 1.0]]);
    let loss = values(clipped_surrogate(new.clone(), old.clone(), adv, 0.2, 0.28));
    // r = 1.5: A>0 is clipped to 1.28 * 2; A<0 keeps 1.5 * -2.  r = 0.5: A>0 keeps 0.5 * 2;
    // A<0 is clipped to 0.8 * -2.  r = 1.1 lies inside the range.
    close(&loss, &[-2.56, 3.0, -1.0, 1.6, -1.1]);
    close(
        &values(clipped_mask(new, old, 0.2, 0.28)),
        &[1.0, 1.0, 1.0, 1.0, 0.0],
    );
}

#[test]
fn value_loss_is_the_larger_of_clipped_and_unclipped() {
    let v = t2(&[&[1.0, 0.0, 0.9]]);
    let v_old = t2(&[&[0.5, 0.5, 0.5]]);
    let ret = t2(&[&[0.0, 1.0, 1.0]]);
    // (1) unclipped 1.0 vs clipped (0.7)^2: 0.5 * 1.0.  (2) 1.0 vs (0.3 - 1)^2 = 0.49: 0.5.
    // (3) 0.01 vs (0.7 - 1)^2 = 0.09: 0.5 * 0.09.
    close(
        &values(clipped_value_loss(v, v_old, ret, 0.2)),
        &[0.5, 0.5, 0.045],
    );
}

#[test]
fn masked_sums_and_kl() {
    let x = t2(&[&[1.0, 2.0], &[3.0, 4.0]]);
    let m = t2(&[&[1.0, 0.0], &[1.0, 1.0]]);
    let s: Vec<f32> = masked_sum(x, m, 4.0).into_data().to_vec().unwrap();
    close(&s, &[2.0]);
    let kl = values(kl_k3(t2(&[&[0.0, 0.5f32.ln()]]), t2(&[&[0.0, 0.0]])));
    close(&kl, &[0.0, 2.0 - 2.0f32.ln() - 1.0]);
    assert_eq!(
        explained_variance(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]),
        Some(1.0)
    );
    assert_eq!(
        explained_variance(&[0.0, 0.0, 0.0], &[1.0, 2.0, 3.0]),
        Some(0.0)
    );
    assert_eq!(explained_variance(&[0.0, 1.0], &[1.0, 1.0]), None);
}

#[test]
fn sample_masks_align_with_next_token_statistics() {
    let mut s = Sample::new("t", "e");
    s.push_context(&[1, 2]);
    s.push_policy(&[3, 4], Some(&[-0.1, -0.2]));
    s.push_context(&[5]);
    s.push_policy(&[6], Some(&[-0.3]));
    s.reward = 2.0;
    assert_eq!(s.shifted_mask(), vec![false, true, true, false, true]);
    assert_eq!(s.shifted_logprobs(), vec![0.0, -0.1, -0.2, 0.0, -0.3]);
    assert_eq!(s.shifted_rewards(), vec![0.0, 0.0, 0.0, 0.0, 2.0]);
    assert_eq!(s.policy_tokens(), 3);
}

fn turn(tool: &str, args: serde_json::Value) -> TurnRecord {
    TurnRecord {
        tool: Some(tool.into()),
        arguments: args,
        parse_error: None,
        tool_error: false,
    }
}

fn finished(reward: f32, turns: Vec<TurnRecord>) -> Sample {
    let mut s = Sample::new("t", "e");
    s.push_context(&[1]);
    s.push_policy(&[2], None);
    s.reward = reward;
    s.outcome = Some(Outcome::Finished);
    s.turns = turns;
    s
}

#[test]
fn rft_filter_keeps_clean_successes_only() {
    let w = |c: &str| turn("Write", json!({"file_path": "a.py", "content": c}));
    let edit = |o: &str, n: &str| {
        turn(
            "MultiEdit",
            json!({"file_path": "a.py", "edits": [{"old_string": o, "new_string": n}]}),
        )
    };
    let submit = turn("Submit", json!({}));
    let good = finished(1.0, vec![w("x"), edit("x", "y"), w("z"), submit.clone()]);
    assert_eq!(rft_verdict(&good, 0.0, 10_000), Ok(()));
    assert_eq!(
        rft_verdict(&finished(-1.0, vec![submit.clone()]), 0.0, 10_000),
        Err(Rejection::LowReward)
    );
    assert_eq!(
        rft_verdict(&finished(1.0, vec![submit.clone()]), 1.0, 10_000),
        Err(Rejection::LowReward)
    );
    let mut closed = finished(1.0, vec![submit.clone()]);
    closed.outcome = Some(Outcome::ContextLimit);
    assert_eq!(
        rft_verdict(&closed, 0.0, 10_000),
        Err(Rejection::Unfinished)
    );
    let bad_call = TurnRecord {
        tool: None,
        arguments: json!(null),
        parse_error: Some("no tool call".into()),
        tool_error: true,
    };
    assert_eq!(
        rft_verdict(&finished(3.0, vec![bad_call, submit.clone()]), 0.0, 10_000),
        Err(Rejection::MalformedCall)
    );
    assert_eq!(
        rft_verdict(
            &finished(3.0, vec![w("x"), w("x"), submit.clone()]),
            0.0,
            10_000
        ),
        Err(Rejection::RepeatedCall)
    );
    // An edit put back, and a file rewritten to what it held two writes ago.
    assert_eq!(
        rft_verdict(
            &finished(2.0, vec![edit("a", "b"), edit("b", "a"), submit.clone()]),
            0.0,
            10_000
        ),
        Err(Rejection::UndoneEdit)
    );
    assert_eq!(
        rft_verdict(
            &finished(2.0, vec![w("v1"), w("v2"), w("v1"), submit.clone()]),
            0.0,
            10_000
        ),
        Err(Rejection::UndoneEdit)
    );
    // The same edit on another file is not an undo.
    let other = turn(
        "MultiEdit",
        json!({"file_path": "b.py", "edits": [{"old_string": "b", "new_string": "a"}]}),
    );
    assert_eq!(
        rft_verdict(
            &finished(2.0, vec![edit("a", "b"), other, submit.clone()]),
            0.0,
            10_000
        ),
        Ok(())
    );
    // Two tokens do not fit a one-token context.
    assert_eq!(rft_verdict(&good, 0.0, 1), Err(Rejection::TooLong));
    let (kept, summary) = rft_filter(vec![good, finished(-1.0, vec![submit])], 0.0, 10_000);
    assert_eq!(
        (
            kept.len(),
            summary.kept,
            summary.rejected[&Rejection::LowReward]
        ),
        (1, 1, 1)
    );
}

fn tiny_renderer(max_obs: usize) -> Renderer {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-tokenizer.json");
    let tok = TextTokenizer::from_file(&path).unwrap();
    Renderer::new(
        ChatTemplate::Chatml,
        tok,
        "sys".into(),
        false,
        max_obs,
        &[0],
    )
    .unwrap()
}

#[test]
fn rendered_calls_parse_back_and_long_observations_keep_head_and_tail() {
    let r = tiny_renderer(32);
    let args = json!({"file_path": "answer.txt", "content": "amber"});
    let call = r.call_tokens("Write", &args).unwrap();
    assert!(
        call.len() < 40,
        "the tiny vocabulary makes a call short ({} tokens)",
        call.len()
    );
    assert!(
        r.stop_ids().contains(call.last().unwrap()),
        "a canonical call ends the turn"
    );
    let parsed = parse_tool_call(&r.turn_text(&call)).unwrap();
    assert_eq!((parsed.name.as_str(), parsed.arguments), ("Write", args));
    let long: String = (0..400).map(|i| format!("line {i}\n")).collect();
    let obs = r
        .tokenizer()
        .decode(&r.observation(&long, true, &call).unwrap());
    assert!(
        obs.contains("Error: line 0") && obs.contains("line 399") && obs.contains("tokens cut"),
        "{obs}"
    );
    assert!(!obs.contains("line 200"), "the middle is cut");
    // After a turn the policy ended itself, the template does not close it again.
    assert!(!obs.starts_with("<|im_end|>"), "{obs}");
}

#[test]
fn single_turn_answers_yield_their_code_block() {
    assert_eq!(
        solution_of("Here:\n```python\nimport torch\n```\nDone."),
        "import torch\n"
    );
    assert_eq!(solution_of("  blue \n"), "blue");
    assert_eq!(solution_of("```\nunclosed"), "unclosed");
}
