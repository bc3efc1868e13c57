//! The multi-turn rollout with continuous batching. The generator keeps one running batch:
//! a turn that ends leaves it at once and its tool call goes to the server while the other
//! turns go on decoding; when the server answers, the conversation's next turn joins the
//! batch at the next decode step. The GPU waits for the servers only when no turn at all is
//! ready to run, and the time it waits is what `RolloutStats::env_s` counts.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::Instant;

use env_api::{ResetRequest, ResetResponse, StepResponse};
use env_client::{ClientError, ServerHandle};
use serde_json::Value;

use super::{
    apply_answer, close_by_trainer, finish, multi_turn_prompt, open, opened_live, parse_turn,
    reset_when_room, Generator, Live, RolloutStats, Round, TurnStart,
};
use crate::sample::{Outcome, Sample};

/// A server's answer to one tool call: the episode, the call, and the answer with how long
/// the request took.
type Answer = (usize, String, Value, Result<StepResponse, ClientError>, f64);

/// What the servers send back while the batch decodes.
enum Event {
    /// A tool call's answer.
    Answer(Box<Answer>),
    /// The reset of an episode that waited for room, at last answered (or given up on).
    Opened(
        usize,
        Box<Result<(ServerHandle, ResetResponse), ClientError>>,
    ),
}

/// Runs one multi-turn episode per reset request until every one ends; `tag` makes request
/// ids unique across the steps of a run.
pub(super) fn rollout(
    round: &Round<'_>,
    generator: &mut dyn Generator,
    resets: &[ResetRequest],
    seed: u64,
    tag: &str,
) -> (Vec<Sample>, RolloutStats) {
    let Round {
        rt,
        renderer,
        settings,
        ..
    } = *round;
    let mut stats = RolloutStats {
        episodes: resets.len(),
        ..Default::default()
    };
    let mut live = open(round, resets, multi_turn_prompt, true, &mut stats);
    let (answers_tx, answers) = mpsc::channel::<Event>();
    let mut closes = Vec::new();
    let mut released = vec![false; live.len()];
    let mut ready: VecDeque<usize> = (0..live.len())
        .filter(|&i| !live[i].done && !live[i].waiting_for_room)
        .collect();
    // Tool calls and resets sent and not yet answered.
    let mut at_server = 0usize;
    // Episodes every server refused for want of room keep trying while the others run (and,
    // as they end, free room); one that never finds room fails as before.
    let until = Instant::now() + round.pool.room_wait;
    let waiting: Vec<usize> = (0..live.len())
        .filter(|&i| live[i].waiting_for_room)
        .collect();
    if !waiting.is_empty() {
        tracing::info!(
            episodes = waiting.len(),
            "resets refused for want of room; they are tried again as the batch runs"
        );
    }
    for i in waiting {
        let (pool, req, tx) = (round.pool.clone(), resets[i].clone(), answers_tx.clone());
        at_server += 1;
        rt.spawn(async move {
            let opened = reset_when_room(&pool, &req, until).await;
            let _ = tx.send(Event::Opened(i, Box::new(opened)));
        });
    }
    loop {
        // Answers that came in while the batch decoded.
        while let Ok(event) = answers.try_recv() {
            at_server -= 1;
            on_event(round, resets, &mut live, &mut ready, &mut stats, event);
        }
        release(round, generator, &mut live, &mut released, &mut closes);
        // Ready turns join while the batch has room.
        let room = settings
            .generation_batch
            .saturating_sub(generator.running());
        let mut joining = Vec::new();
        while joining.len() < room {
            let Some(i) = ready.pop_front() else { break };
            let l = &mut live[i];
            if l.sample.tokens.len() + 8 >= settings.context {
                close_by_trainer(l, Outcome::ContextLimit, settings.failure_reward);
                continue;
            }
            joining.push(TurnStart {
                key: i,
                context: l.sample.tokens.clone(),
                max_new_tokens: settings
                    .max_turn_tokens
                    .min(settings.context.saturating_sub(l.sample.tokens.len()))
                    .max(1),
                seed: crate::seeds::derive(seed, i as u64, l.sample.turns.len() as u64),
            });
        }
        let tg = Instant::now();
        if !joining.is_empty() {
            let (prefilled, reused) = generator.admit(joining, &settings.sampling);
            stats.prefilled_tokens += prefilled;
            stats.reused_tokens += reused;
        }
        if generator.running() == 0 {
            stats.generate_s += tg.elapsed().as_secs_f64();
            if at_server == 0 {
                break;
            }
            // Nothing to decode: wait for the servers.
            let tw = Instant::now();
            let Ok(event) = answers.recv() else { break };
            stats.env_s += tw.elapsed().as_secs_f64();
            at_server -= 1;
            on_event(round, resets, &mut live, &mut ready, &mut stats, event);
            continue;
        }
        let ended = generator.step();
        stats.generate_s += tg.elapsed().as_secs_f64();
        for (i, g) in ended {
            stats.turns += 1;
            stats.policy_tokens += g.tokens.len();
            let l = &mut live[i];
            l.sample.push_policy(&g.tokens, Some(&g.logprobs));
            l.last_turn = g.tokens;
            let Some((name, arguments)) = parse_turn(renderer, l, settings.context) else {
                after_turn(l, i, &mut ready, round);
                continue;
            };
            let Some(server) = l.server.clone() else {
                after_turn(l, i, &mut ready, round);
                continue;
            };
            let (permits, tx) = (round.pool.permits.clone(), answers_tx.clone());
            let id = l.sample.episode_id.clone();
            let request_id = format!("{tag}-{i}-{}", l.sample.turns.len());
            at_server += 1;
            rt.spawn(async move {
                let _permit = permits.acquire_owned().await;
                let t0 = Instant::now();
                let answer = server
                    .client()
                    .step_with_id(&id, &name, arguments.clone(), &request_id)
                    .await;
                // The loop may have ended early (it never does while calls are out).
                let seconds = t0.elapsed().as_secs_f64();
                let _ = tx.send(Event::Answer(Box::new((
                    i, name, arguments, answer, seconds,
                ))));
            });
        }
    }
    release(round, generator, &mut live, &mut released, &mut closes);
    let te = Instant::now();
    rt.block_on(async {
        for close in closes {
            let _ = close.await;
        }
    });
    stats.env_s += te.elapsed().as_secs_f64();
    finish(live, stats)
}

/// Lets an ended conversation's cache go at once, making room for the live ones, and closes
/// on its server an episode the trainer ended (turn or context limit).
fn release(
    round: &Round<'_>,
    generator: &mut dyn Generator,
    live: &mut [Live],
    released: &mut [bool],
    closes: &mut Vec<tokio::task::JoinHandle<()>>,
) {
    for (i, l) in live.iter_mut().enumerate() {
        if !l.done || released[i] {
            continue;
        }
        generator.end_conversation(i);
        released[i] = true;
        if let (Some(Outcome::TurnLimit | Outcome::ContextLimit), Some(server)) =
            (l.sample.outcome, l.server.clone())
        {
            let id = l.sample.episode_id.clone();
            closes.push(round.rt.spawn(async move {
                if let Err(e) = server.client().close(&id).await {
                    tracing::warn!(episode = %id, "close failed: {}", env_api::ErrorChain(&e));
                }
            }));
        }
    }
}

/// What came back from the servers, applied: a tool call's answer, or a late reset.
fn on_event(
    round: &Round<'_>,
    resets: &[ResetRequest],
    live: &mut [Live],
    ready: &mut VecDeque<usize>,
    stats: &mut RolloutStats,
    event: Event,
) {
    match event {
        Event::Answer(answer) => answered(round, live, ready, stats, *answer),
        Event::Opened(i, opened) => {
            // No more waiting: a refusal now fails the episode.
            let renderer = round.renderer;
            live[i] = opened_live(
                renderer,
                &resets[i],
                *opened,
                multi_turn_prompt,
                true,
                false,
            );
            if !live[i].done {
                ready.push_back(i);
            }
        }
    }
}

/// A server's answer applied to its episode, which then waits for its next turn unless it
/// ended.
fn answered(
    round: &Round<'_>,
    live: &mut [Live],
    ready: &mut VecDeque<usize>,
    stats: &mut RolloutStats,
    (i, name, arguments, answer, seconds): Answer,
) {
    stats.env_requests_s += seconds;
    let l = &mut live[i];
    apply_answer(
        round.renderer,
        l,
        name,
        arguments,
        answer,
        round.settings.context,
    );
    after_turn(l, i, ready, round);
}

/// After a turn was answered: the episode ends at the turn or context limit, or waits for
/// its next turn.
fn after_turn(l: &mut Live, i: usize, ready: &mut VecDeque<usize>, round: &Round<'_>) {
    let settings = round.settings;
    if l.done {
        return;
    }
    if l.sample.turns.len() as u32 >= settings.max_turns {
        close_by_trainer(l, Outcome::TurnLimit, settings.failure_reward);
    } else if l.sample.tokens.len() + 8 >= settings.context {
        close_by_trainer(l, Outcome::ContextLimit, settings.failure_reward);
    } else {
        ready.push_back(i);
    }
}
