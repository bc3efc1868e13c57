//! The generation thread: it owns the model and answers prepared requests one at a time
//! from a bounded queue, off the async runtime, so the HTTP side stays responsive while it
//! samples.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

use axum::http::StatusCode;
use burn::tensor::backend::Backend;
use tokio::sync::{mpsc, oneshot};

use super::api::ApiError;
use super::request::Prepared;
use crate::chat::{split_tool_calls, ParsedToolCall};
use crate::generate::{generate_observed, FinishReason, Generation, SamplingParams};
use crate::model::{Architecture, CausalLm};
use crate::render::Renderer;

/// The policy as the engine runs it.
pub struct ServedModel<B: Backend> {
    /// Weights.
    pub lm: CausalLm<B>,
    /// Config and RoPE tables up to the served context.
    pub arch: Architecture<B>,
    /// Template, tokenizer and stop tokens.
    pub renderer: Renderer,
    /// Where it runs.
    pub device: B::Device,
}

/// Text sampled so far for one choice (streaming).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    /// The choice.
    pub index: usize,
    /// New text.
    pub text: String,
}

/// One finished choice.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceOutcome {
    /// Text (before the calls, when there are calls).
    pub content: String,
    /// Calls parsed out of the text.
    pub calls: Vec<ParsedToolCall>,
    /// `stop`, `length` or `tool_calls`.
    pub finish: &'static str,
    /// Tokens of the answer (forced ones and the stop token included).
    pub tokens: usize,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// One per `n`.
    pub choices: Vec<ChoiceOutcome>,
}

struct Work {
    job: Prepared,
    deltas: Option<mpsc::UnboundedSender<Delta>>,
    reply: oneshot::Sender<Result<Outcome, ApiError>>,
}

/// The queue to the generation thread.
#[derive(Clone)]
pub struct Engine {
    tx: Sender<Work>,
    /// Requests admitted and not yet answered (the one generating included). Admission is
    /// counted here rather than by a bounded channel: a rendezvous channel refuses a request
    /// sent in the moment between one answer and the thread's next `recv`, which would make
    /// an idle server answer 429.
    admitted: Arc<AtomicUsize>,
    /// At most this many admitted: the one generating plus `queue` waiting.
    limit: usize,
}

impl Engine {
    /// Starts the generation thread with room for `queue` waiting requests.
    pub fn start<B: Backend>(model: ServedModel<B>, queue: usize) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Work>();
        let admitted = Arc::new(AtomicUsize::new(0));
        let done = admitted.clone();
        std::thread::Builder::new()
            .name("generate".into())
            .spawn(move || {
                while let Ok(work) = rx.recv() {
                    // The client went away while the request waited.
                    if work.reply.is_closed() {
                        done.fetch_sub(1, Ordering::AcqRel);
                        continue;
                    }
                    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        complete(&model, &work.job, work.deltas.as_ref())
                    }))
                    .unwrap_or_else(|_| {
                        tracing::error!("generation panicked");
                        Err(ApiError {
                            status: StatusCode::INTERNAL_SERVER_ERROR,
                            message: "generation failed".into(),
                            kind: "server_error",
                            code: "generation_failed",
                            param: None,
                        })
                    });
                    drop(work.deltas);
                    // Free the slot before answering: a client that sends its next request as
                    // soon as this one ends finds the server idle.
                    done.fetch_sub(1, Ordering::AcqRel);
                    let _ = work.reply.send(result);
                }
            })?;
        Ok(Self {
            tx,
            admitted,
            limit: queue + 1,
        })
    }

    /// Queues `job`; the answer comes on the returned channel, text as it is sampled on
    /// `deltas` when the job streams. A full queue is a 429.
    pub fn submit(
        &self,
        job: Prepared,
        deltas: Option<mpsc::UnboundedSender<Delta>>,
    ) -> Result<oneshot::Receiver<Result<Outcome, ApiError>>, ApiError> {
        let (reply, rx) = oneshot::channel();
        let limit = self.limit;
        if self
            .admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_err()
        {
            return Err(ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: "the server is busy: too many requests are waiting; retry later".into(),
                kind: "rate_limit_error",
                code: "server_busy",
                param: None,
            });
        }
        match self.tx.send(Work { job, deltas, reply }) {
            Ok(()) => Ok(rx),
            Err(_) => Err(ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "the generation thread has stopped".into(),
                kind: "server_error",
                code: "engine_stopped",
                param: None,
            }),
        }
    }
}

/// Samples the job's choices and turns them into text and calls.
fn complete<B: Backend>(
    model: &ServedModel<B>,
    job: &Prepared,
    deltas: Option<&mpsc::UnboundedSender<Delta>>,
) -> Result<Outcome, ApiError> {
    let renderer = &model.renderer;
    let tokenizer = renderer.tokenizer();
    let stops = renderer.stop_ids();
    let forced: Vec<u32> = job.forced.iter().copied().take(job.max_tokens).collect();
    let generations: Vec<Generation> = if job.forced_whole || forced.len() >= job.max_tokens {
        // Nothing left to sample: the answer is the forced tokens (cut at the limit).
        let finish = if forced.len() == job.forced.len() && job.forced_whole {
            FinishReason::StopToken
        } else {
            FinishReason::Length
        };
        (0..job.n)
            .map(|_| Generation {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                finish,
            })
            .collect()
    } else {
        let mut prompt = job.prompt.clone();
        prompt.extend(&forced);
        let prompts = vec![prompt; job.n];
        let params = SamplingParams {
            temperature: job.temperature,
            top_p: job.top_p,
            top_k: 0,
            max_new_tokens: job.max_tokens - forced.len(),
            stop_token_ids: stops.to_vec(),
            stop_strings: job.stop.clone(),
        };
        // Streaming: decode each choice's tokens so far and send what is new; text that ends
        // inside a multi-byte character waits for the next token.
        let mut sampled: Vec<Vec<u32>> = vec![Vec::new(); job.n];
        let mut sent: Vec<usize> = vec![0; job.n];
        let mut on_token = |row: usize, token: u32| {
            let Some(tx) = deltas.filter(|_| job.stream_text) else {
                return;
            };
            if stops.contains(&token) {
                return;
            }
            sampled[row].push(token);
            let text = tokenizer.decode(&sampled[row]);
            if text.ends_with('\u{FFFD}') || text.len() <= sent[row] {
                return;
            }
            if let Some(new) = text.get(sent[row]..) {
                let _ = tx.send(Delta {
                    index: row,
                    text: new.to_string(),
                });
                sent[row] = text.len();
            }
        };
        generate_observed(
            &model.lm,
            &model.arch,
            &prompts,
            &params,
            Some(tokenizer),
            job.seed,
            &model.device,
            &mut on_token,
        )
    };
    let choices = generations
        .into_iter()
        .map(|g| {
            let mut tokens = forced.clone();
            tokens.extend(&g.tokens);
            let mut text = renderer.turn_text(&tokens);
            if g.finish == FinishReason::StopString {
                if let Some(cut) = job.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
                    text.truncate(cut);
                }
            }
            let finish = match g.finish {
                FinishReason::Length => "length",
                FinishReason::StopToken | FinishReason::StopString => "stop",
            };
            let parsed = match (&job.tool_names, finish) {
                (Some(names), "stop") => split_tool_calls(&text)
                    .filter(|(_, calls)| calls.iter().all(|c| names.contains(&c.name))),
                _ => None,
            };
            match parsed {
                Some((content, calls)) => ChoiceOutcome {
                    content,
                    calls,
                    finish: "tool_calls",
                    tokens: tokens.len(),
                },
                None => ChoiceOutcome {
                    content: text,
                    calls: Vec::new(),
                    finish,
                    tokens: tokens.len(),
                },
            }
        })
        .collect();
    Ok(Outcome { choices })
}
