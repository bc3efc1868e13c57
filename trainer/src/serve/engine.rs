//! The generation thread: it owns the model and answers prepared requests off the async
//! runtime, so the HTTP side stays responsive while it samples. Requests decode together with
//! continuous batching ([`RunningBatch`]): up to `max_batch` choices share each decode step,
//! a request joins between two steps and leaves the step its last choice ends, so a short
//! answer never waits for a long one; requests beyond that wait in a bounded queue.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use axum::http::StatusCode;
use burn::tensor::backend::Backend;
use tokio::sync::{mpsc, oneshot};

use super::api::ApiError;
use super::request::Prepared;
use crate::chat::{split_tool_calls, ParsedToolCall};
use crate::generate::{FinishReason, Generation, RunningBatch, SamplingParams, TurnRequest};
use crate::model::{Architecture, CausalLm};
use crate::render::Renderer;
use crate::seeds::derive;

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
    /// Requests admitted and not yet answered (those decoding included). Admission is
    /// counted here rather than by a bounded channel: a rendezvous channel refuses a request
    /// sent in the moment between one answer and the thread's next `recv`, which would make
    /// an idle server answer 429.
    admitted: Arc<AtomicUsize>,
    /// At most this many admitted: `max_batch` decoding plus `queue` waiting.
    limit: usize,
}

impl Engine {
    /// Starts the generation thread: requests decode together up to `max_batch` choices at a
    /// time (at least one request always decodes), and `queue` more may wait.
    pub fn start<B: Backend>(
        model: ServedModel<B>,
        max_batch: usize,
        queue: usize,
    ) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Work>();
        let admitted = Arc::new(AtomicUsize::new(0));
        let done = admitted.clone();
        let max_batch = max_batch.max(1);
        std::thread::Builder::new()
            .name("generate".into())
            .spawn(move || Batcher::new(&model, max_batch, done).run(&rx))?;
        Ok(Self {
            tx,
            admitted,
            limit: max_batch + queue,
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

fn generation_failed() -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: "generation failed".into(),
        kind: "server_error",
        code: "generation_failed",
        param: None,
    }
}

/// A request whose choices are decoding.
struct Active {
    work: Work,
    /// Tokens every choice starts with (`tool_choice`), cut at the limit.
    forced: Vec<u32>,
    /// Each choice's generation once it has ended.
    ended: Vec<Option<Generation>>,
    /// Streaming: each choice's sampled tokens and the bytes of text already sent.
    sampled: Vec<Vec<u32>>,
    sent: Vec<usize>,
    /// The sampling settings of its batch.
    params: SamplingParams,
    /// The batch its choices decode in.
    batch: usize,
}

/// The generation thread's state: the running batches (one per set of sampling settings, as
/// a batch samples all its rows alike), the requests decoding in them and those waiting.
struct Batcher<'m, B: Backend> {
    model: &'m ServedModel<B>,
    max_batch: usize,
    /// Requests admitted and not answered, shared with [`Engine`].
    done: Arc<AtomicUsize>,
    batches: Vec<RunningBatch<'m, B>>,
    active: HashMap<u64, Active>,
    /// Row key to (request, choice).
    rows: HashMap<usize, (u64, usize)>,
    waiting: VecDeque<Work>,
    next_request: u64,
    next_row: usize,
}

impl<'m, B: Backend> Batcher<'m, B> {
    fn new(model: &'m ServedModel<B>, max_batch: usize, done: Arc<AtomicUsize>) -> Self {
        Self {
            model,
            max_batch,
            done,
            batches: Vec::new(),
            active: HashMap::new(),
            rows: HashMap::new(),
            waiting: VecDeque::new(),
            next_request: 0,
            next_row: 0,
        }
    }

    /// Until the engine is dropped and nothing is left to answer.
    fn run(mut self, rx: &Receiver<Work>) {
        loop {
            if self.rows.is_empty() && self.waiting.is_empty() {
                // Idle: wait for the next request.
                match rx.recv() {
                    Ok(work) => self.waiting.push_back(work),
                    Err(_) => return,
                }
            }
            while let Ok(work) = rx.try_recv() {
                self.waiting.push_back(work);
            }
            self.admit_waiting();
            self.step_all();
            self.cancel_abandoned();
        }
    }

    /// Answers a request and frees its slot (before the answer: a client that sends its
    /// next request as soon as this one ends finds the room).
    fn answer(&self, work: Work, result: Result<Outcome, ApiError>) {
        drop(work.deltas);
        self.done.fetch_sub(1, Ordering::AcqRel);
        let _ = work.reply.send(result);
    }

    /// Starts waiting requests while their choices fit the batch (one always starts on an
    /// idle thread, whatever its `n`).
    fn admit_waiting(&mut self) {
        while let Some(work) = self.waiting.pop_front() {
            // The client went away while the request waited.
            if work.reply.is_closed() {
                self.done.fetch_sub(1, Ordering::AcqRel);
                continue;
            }
            let n = work.job.n.max(1);
            if !self.rows.is_empty() && self.rows.len() + n > self.max_batch {
                self.waiting.push_front(work);
                return;
            }
            self.start(work);
        }
    }

    /// A request's choices into the running batch of its sampling settings; an answer with
    /// nothing to sample is given at once.
    fn start(&mut self, work: Work) {
        let model = self.model;
        let job = &work.job;
        let forced: Vec<u32> = job.forced.iter().copied().take(job.max_tokens).collect();
        if job.forced_whole || forced.len() >= job.max_tokens {
            // Nothing left to sample: the answer is the forced tokens (cut at the limit).
            let finish = if forced.len() == job.forced.len() && job.forced_whole {
                FinishReason::StopToken
            } else {
                FinishReason::Length
            };
            let generations = (0..job.n)
                .map(|_| Generation {
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    finish,
                })
                .collect();
            let outcome = outcome_of(&model.renderer, job, &forced, generations);
            self.answer(work, Ok(outcome));
            return;
        }
        let params = SamplingParams {
            temperature: job.temperature,
            top_p: job.top_p,
            top_k: 0,
            // Each choice carries its own limit.
            max_new_tokens: 0,
            stop_token_ids: model.renderer.stop_ids().to_vec(),
            stop_strings: job.stop.clone(),
        };
        let batch = match self.batches.iter().position(|b| b.params() == &params) {
            Some(i) => i,
            None => {
                self.batches.push(RunningBatch::new(
                    &model.lm,
                    &model.arch,
                    params.clone(),
                    Some(model.renderer.tokenizer()),
                    model.device.clone(),
                ));
                self.batches.len() - 1
            }
        };
        let id = self.next_request;
        self.next_request += 1;
        let mut context = job.prompt.clone();
        context.extend(&forced);
        let mut turns = Vec::with_capacity(job.n);
        for choice in 0..job.n {
            let key = self.next_row;
            self.next_row += 1;
            self.rows.insert(key, (id, choice));
            turns.push(TurnRequest {
                key,
                context: context.clone(),
                prefix: None,
                max_new_tokens: job.max_tokens - forced.len(),
                seed: derive(job.seed, 0, choice as u64),
            });
        }
        let n = job.n;
        self.active.insert(
            id,
            Active {
                work,
                forced,
                ended: vec![None; n],
                sampled: vec![Vec::new(); n],
                sent: vec![0; n],
                params,
                batch,
            },
        );
        let admitted = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.batches[batch].admit(turns);
        }));
        if admitted.is_err() {
            tracing::error!("prefill panicked");
            self.fail_batch(batch);
        }
    }

    /// One decode step of every batch with rows; requests whose last choice ended are
    /// answered.
    fn step_all(&mut self) {
        for b in 0..self.batches.len() {
            if self.batches[b].is_empty() {
                continue;
            }
            let Self {
                batches,
                active,
                rows,
                model,
                ..
            } = self;
            let tokenizer = model.renderer.tokenizer();
            let stops = model.renderer.stop_ids();
            let mut on_token = |key: usize, token: u32| {
                let Some(&(id, choice)) = rows.get(&key) else {
                    return;
                };
                if let Some(a) = active.get_mut(&id) {
                    stream(a, choice, token, tokenizer, stops);
                }
            };
            let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| {
                batches[b].step_observed(&mut on_token)
            }));
            let ended = match stepped {
                Ok(ended) => ended,
                Err(_) => {
                    tracing::error!("generation panicked");
                    self.fail_batch(b);
                    continue;
                }
            };
            for t in ended {
                let Some((id, choice)) = self.rows.remove(&t.key) else {
                    continue;
                };
                let finished = self.active.get_mut(&id).is_some_and(|a| {
                    a.ended[choice] = Some(t.generation);
                    a.ended.iter().all(Option::is_some)
                });
                if finished {
                    if let Some(a) = self.active.remove(&id) {
                        let generations = a.ended.into_iter().flatten().collect();
                        let outcome =
                            outcome_of(&self.model.renderer, &a.work.job, &a.forced, generations);
                        self.answer(a.work, Ok(outcome));
                    }
                }
            }
        }
        if self.batches.iter().any(RunningBatch::is_empty) {
            self.batches.retain(|b| !b.is_empty());
            self.reindex();
        }
    }

    /// Each active request's batch index, found again by its sampling settings (after
    /// batches were dropped).
    fn reindex(&mut self) {
        for a in self.active.values_mut() {
            a.batch = self
                .batches
                .iter()
                .position(|b| b.params() == &a.params)
                .unwrap_or(usize::MAX);
        }
    }

    /// Requests whose clients went away: their rows leave the batch.
    fn cancel_abandoned(&mut self) {
        let gone: Vec<u64> = self
            .active
            .iter()
            .filter(|(_, a)| a.work.reply.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            let keys: Vec<usize> = self
                .rows
                .iter()
                .filter(|(_, &(r, _))| r == id)
                .map(|(&k, _)| k)
                .collect();
            if let Some(a) = self.active.remove(&id) {
                if let Some(batch) = self.batches.get_mut(a.batch) {
                    batch.cancel(&keys);
                }
                self.done.fetch_sub(1, Ordering::AcqRel);
            }
            for k in keys {
                self.rows.remove(&k);
            }
        }
    }

    /// A batch whose step panicked: every request with rows in it is answered 500 and the
    /// batch is dropped.
    fn fail_batch(&mut self, b: usize) {
        let ids: Vec<u64> = self
            .active
            .iter()
            .filter(|(_, a)| a.batch == b)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.rows.retain(|_, (r, _)| *r != id);
            if let Some(a) = self.active.remove(&id) {
                self.answer(a.work, Err(generation_failed()));
            }
        }
        if b < self.batches.len() {
            self.batches.remove(b);
        }
        self.reindex();
    }
}

/// Streaming: a choice's new token decoded with its earlier ones, and the text not yet sent
/// sent (text that ends inside a multi-byte character waits for the next token).
fn stream(
    a: &mut Active,
    choice: usize,
    token: u32,
    tokenizer: &crate::tokenizer::TextTokenizer,
    stops: &[u32],
) {
    let Some(tx) = a.work.deltas.as_ref().filter(|_| a.work.job.stream_text) else {
        return;
    };
    if stops.contains(&token) {
        return;
    }
    a.sampled[choice].push(token);
    let text = tokenizer.decode(&a.sampled[choice]);
    if text.ends_with('\u{FFFD}') || text.len() <= a.sent[choice] {
        return;
    }
    if let Some(new) = text.get(a.sent[choice]..) {
        let _ = tx.send(Delta {
            index: choice,
            text: new.to_string(),
        });
        a.sent[choice] = text.len();
    }
}

/// The answer to `job` from its choices' generations: text after the forced tokens, and the
/// calls parsed out of it where the job takes calls.
fn outcome_of(
    renderer: &Renderer,
    job: &Prepared,
    forced: &[u32],
    generations: Vec<Generation>,
) -> Outcome {
    let choices = generations
        .into_iter()
        .map(|g| {
            let mut tokens = forced.to_vec();
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
    Outcome { choices }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::model::{load, ModelSource};

    type B = burn::backend::NdArray<f32>;

    fn model() -> ServedModel<B> {
        let src = ModelSource {
            tiny_random: true,
            seed: 3,
            model: None,
            checkpoint: None,
            adapter: None,
            template: None,
        };
        load::<B>(&src, Some(256), &Default::default())
            .unwrap_or_else(|e| panic!("the tiny model: {e}"))
            .model
    }

    fn job(prompt: &[u32], max_tokens: usize, seed: u64, n: usize, temperature: f64) -> Prepared {
        Prepared {
            prompt: prompt.to_vec(),
            forced: Vec::new(),
            forced_whole: false,
            max_tokens,
            temperature,
            top_p: 0.9,
            seed,
            n,
            stop: Vec::new(),
            tool_names: None,
            stream_text: false,
        }
    }

    type Answer = oneshot::Receiver<Result<Outcome, ApiError>>;

    fn work(job: Prepared) -> (Work, Answer) {
        let (reply, rx) = oneshot::channel();
        (
            Work {
                job,
                deltas: None,
                reply,
            },
            rx,
        )
    }

    /// `jobs` waiting in `b`, in order; their answers to come.
    fn enqueue(b: &mut Batcher<'_, B>, jobs: &[Prepared]) -> Vec<Answer> {
        jobs.iter()
            .map(|j| {
                let (w, rx) = work(j.clone());
                b.waiting.push_back(w);
                rx
            })
            .collect()
    }

    /// Runs `b` until it has answered everything given to it.
    fn drain(b: &mut Batcher<'_, B>) {
        while !(b.rows.is_empty() && b.waiting.is_empty()) {
            b.admit_waiting();
            b.step_all();
        }
    }

    fn answer(rx: Answer) -> Outcome {
        match rx.blocking_recv() {
            Ok(Ok(o)) => o,
            _ => panic!("no answer"),
        }
    }

    /// Waiting requests start together, as many choices as the batch holds (two sampling
    /// settings, two batches), the rest when rows free up; every request's answer is the one
    /// it gets alone, and every slot is given back.
    #[test]
    fn requests_share_the_batch_up_to_its_size_and_answer_as_alone() {
        let model = model();
        let jobs = vec![
            job(&[5, 6, 7], 4, 1, 1, 1.0),
            job(&[9, 10, 11, 12, 13, 14], 30, 2, 2, 1.0),
            job(&[20], 12, 3, 1, 0.0),
            job(&[30, 31], 20, 4, 1, 1.0),
            job(&[40, 41, 42], 7, 5, 1, 0.0),
        ];
        let mut alone = Vec::new();
        for j in &jobs {
            let done = Arc::new(AtomicUsize::new(1));
            let mut b = Batcher::new(&model, 16, done.clone());
            let (w, rx) = work(j.clone());
            b.waiting.push_back(w);
            drain(&mut b);
            alone.push(answer(rx));
            assert_eq!(done.load(Ordering::Acquire), 0);
        }
        let done = Arc::new(AtomicUsize::new(jobs.len()));
        let mut b = Batcher::new(&model, 16, done.clone());
        let answers = enqueue(&mut b, &jobs);
        b.admit_waiting();
        assert_eq!(b.rows.len(), 6, "every choice decodes at once");
        assert_eq!(b.batches.len(), 2, "one batch per sampling setting");
        drain(&mut b);
        let together: Vec<Outcome> = answers.into_iter().map(answer).collect();
        assert_eq!(together, alone);
        assert_eq!(done.load(Ordering::Acquire), 0);

        // A batch of three: the first three one-choice requests start, the others wait.
        let one_choice: Vec<Prepared> = jobs.iter().filter(|j| j.n == 1).cloned().collect();
        let mut b = Batcher::new(&model, 3, Arc::new(AtomicUsize::new(one_choice.len())));
        let answers = enqueue(&mut b, &one_choice);
        b.admit_waiting();
        assert_eq!((b.rows.len(), b.waiting.len()), (3, 1));
        drain(&mut b);
        let bounded: Vec<Outcome> = answers.into_iter().map(answer).collect();
        let want: Vec<Outcome> = jobs
            .iter()
            .zip(&alone)
            .filter(|(j, _)| j.n == 1)
            .map(|(_, a)| a.clone())
            .collect();
        assert_eq!(bounded, want);
    }

    /// A request whose client went away leaves the batch: its rows go, the others finish as
    /// they would alone.
    #[test]
    fn an_abandoned_request_leaves_the_batch() {
        let model = model();
        let keep = job(&[5, 6, 7], 20, 1, 1, 1.0);
        let (w, rx) = work(keep.clone());
        let mut b = Batcher::new(&model, 16, Arc::new(AtomicUsize::new(1)));
        b.waiting.push_back(w);
        drain(&mut b);
        let alone = answer(rx);

        let done = Arc::new(AtomicUsize::new(2));
        let mut b = Batcher::new(&model, 16, done.clone());
        let (w1, rx1) = work(keep);
        let (w2, rx2) = work(job(&[8, 9], 60, 2, 2, 1.0));
        b.waiting.push_back(w1);
        b.waiting.push_back(w2);
        b.admit_waiting();
        assert_eq!(b.rows.len(), 3);
        b.step_all();
        drop(rx2);
        b.cancel_abandoned();
        assert_eq!(b.rows.len(), 1);
        drain(&mut b);
        assert_eq!(answer(rx1), alone);
        assert_eq!(done.load(Ordering::Acquire), 0);
    }
}
