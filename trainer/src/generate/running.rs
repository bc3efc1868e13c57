//! Continuous batching: conversations decode together in one batch, new turns join it between
//! decode steps (their new tokens prefilled, their kept caches reused), and a turn that ends
//! leaves at once with its cache, so nobody waits for the longest generation of a batch.
//!
//! Each turn draws from a generator of its own, seeded by the caller: the tokens a turn samples
//! do not depend on which other conversations shared its steps (up to the floating-point
//! order of a different batch shape).

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};

use super::{
    choose_rows, decode_one, prefill, resume, stop_reason, Draws, FinishReason, Generation,
    PrefixCache, SamplingParams,
};
use crate::model::decode::DecodeStep;
use crate::model::{Architecture, CausalLm, KvCache};
use crate::seeds::ReplayRng;
use crate::tokenizer::TextTokenizer;

/// Padding slots every row must share before a running batch drops them: trimming copies the
/// whole cache, so it waits until the waste is worth a copy.
const TRIM_AT_LEAST: usize = crate::model::cache::GROWTH;

/// One conversation's next turn, to join a [`RunningBatch`].
pub struct TurnRequest<B: Backend> {
    /// The caller's name for the conversation, returned with its turn.
    pub key: usize,
    /// The whole context so far.
    pub context: Vec<u32>,
    /// What was kept of the conversation's cache after its last turn, if anything.
    pub prefix: Option<PrefixCache<B>>,
    /// Tokens this turn may sample at most (at least one is sampled).
    pub max_new_tokens: usize,
    /// Seeds this turn's draws.
    pub seed: u64,
}

/// A turn that has ended, with what to keep for the conversation's next one.
pub struct TurnDone<B: Backend> {
    /// The conversation's key, as its [`TurnRequest`] gave it.
    pub key: usize,
    /// The turn's tokens and their log-probabilities.
    pub generation: Generation,
    /// The conversation's cache after the turn: every token fed to the model (the context and
    /// all sampled tokens but the last).
    pub cache: PrefixCache<B>,
}

/// A row of the batch: a turn being sampled.
struct Row {
    key: usize,
    context: Vec<u32>,
    generation: Generation,
    max_new_tokens: usize,
}

/// Conversations decoding together, joined and left between steps.
pub struct RunningBatch<'a, B: Backend> {
    lm: &'a CausalLm<B>,
    arch: &'a Architecture<B>,
    params: SamplingParams,
    tokenizer: Option<&'a TextTokenizer>,
    device: B::Device,
    decoder: Option<Box<dyn DecodeStep<B>>>,
    cache: KvCache<B>,
    /// Logits after each row's last fed token, `[rows, vocab]`; `None` while empty.
    last: Option<Tensor<B, 2>>,
    rows: Vec<Row>,
    /// Each row's draws, in row order.
    rngs: Vec<ReplayRng>,
}

impl<'a, B: Backend> RunningBatch<'a, B> {
    /// An empty batch sampling with `params` (its `max_new_tokens` is per turn, in each
    /// [`TurnRequest`]).
    pub fn new(
        lm: &'a CausalLm<B>,
        arch: &'a Architecture<B>,
        params: SamplingParams,
        tokenizer: Option<&'a TextTokenizer>,
        device: B::Device,
    ) -> Self {
        Self {
            lm,
            arch,
            params,
            tokenizer,
            device,
            decoder: lm.decoder(arch),
            cache: KvCache::new(arch.config.num_hidden_layers),
            last: None,
            rows: Vec::new(),
            rngs: Vec::new(),
        }
    }

    /// The sampling settings the batch was made with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Slots per row of the batch's cache: its longest row and the padding shorter rows
    /// share.
    pub fn cache_len(&self) -> usize {
        self.cache.len()
    }

    /// Turns being sampled now.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether no turn is being sampled.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Adds `turns` to the batch: each reuses its kept cache for the prefix its context shares
    /// with it and prefills the rest (all newcomers in one pass). Returns the tokens prefilled
    /// and the tokens reused.
    pub fn admit(&mut self, turns: Vec<TurnRequest<B>>) -> (usize, usize) {
        if turns.is_empty() {
            return (0, 0);
        }
        let layers = self.arch.config.num_hidden_layers;
        let (mut prefilled, mut reused) = (0, 0);
        let mut caches = Vec::with_capacity(turns.len());
        let mut starts = Vec::with_capacity(turns.len());
        let mut rows = Vec::with_capacity(turns.len());
        for t in turns {
            let (cache, common) = resume(t.prefix, &t.context, layers);
            caches.push(cache);
            starts.push(common);
            reused += common;
            prefilled += t.context.len() - common;
            self.rngs.push(ReplayRng::new(t.seed));
            rows.push(Row {
                key: t.key,
                context: t.context,
                generation: Generation {
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    finish: FinishReason::Length,
                },
                max_new_tokens: t.max_new_tokens.max(1),
            });
        }
        let mut joining = KvCache::stack(caches, layers, &self.device);
        let suffixes: Vec<&[u32]> = rows
            .iter()
            .zip(&starts)
            .map(|(r, &s)| &r.context[s..])
            .collect();
        let logits = prefill(self.lm, self.arch, &mut joining, &suffixes, &self.device);
        let cache = std::mem::replace(&mut self.cache, KvCache::new(layers));
        self.cache = cache.join(joining, &self.device);
        self.last = Some(match self.last.take() {
            Some(last) => Tensor::cat(vec![last, logits], 0),
            None => logits,
        });
        self.rows.extend(rows);
        (prefilled, reused)
    }

    /// Samples one token for every row; turns that end (a stop token or string, or their
    /// token limit) leave the batch with their caches, and the rest are fed their new token.
    pub fn step(&mut self) -> Vec<TurnDone<B>> {
        self.step_observed(&mut |_, _| {})
    }

    /// [`Self::step`], telling `on_token` each row's new token (by key) as it is sampled.
    pub fn step_observed(&mut self, on_token: &mut dyn FnMut(usize, u32)) -> Vec<TurnDone<B>> {
        let Some(last) = self.last.take() else {
            return Vec::new();
        };
        let picks = choose_rows(last, &self.params, &mut Draws::PerRow(&mut self.rngs));
        for (row, &(tok, _)) in self.rows.iter().zip(&picks) {
            on_token(row.key, tok as u32);
        }
        let mut keep = Vec::with_capacity(self.rows.len());
        let mut next = Vec::with_capacity(self.rows.len());
        let mut ended = Vec::new();
        for (r, (row, &(tok, logprob))) in self.rows.iter_mut().zip(&picks).enumerate() {
            let g = &mut row.generation;
            g.tokens.push(tok as u32);
            g.logprobs.push(logprob);
            match stop_reason(g, &self.params, self.tokenizer) {
                Some(reason) => g.finish = reason,
                None if g.tokens.len() >= row.max_new_tokens => g.finish = FinishReason::Length,
                None => {
                    keep.push(r);
                    next.push(tok as i32);
                    continue;
                }
            }
            ended.push(r);
        }
        // A row the choice did not return (a failed read of the device) ends as it is.
        ended.extend(picks.len()..self.rows.len());
        let mut done = Vec::with_capacity(ended.len());
        for &r in &ended {
            let cache = self.cache.row(r, &self.device);
            let row = &self.rows[r];
            let fed = row.generation.tokens.len().saturating_sub(1);
            let tokens: Vec<u32> = row
                .context
                .iter()
                .chain(&row.generation.tokens[..fed])
                .copied()
                .collect();
            done.push((r, tokens, cache));
        }
        let mut out = Vec::with_capacity(done.len());
        let mut rows: Vec<Option<Row>> = std::mem::take(&mut self.rows)
            .into_iter()
            .map(Some)
            .collect();
        for (r, tokens, cache) in done {
            if let Some(row) = rows[r].take() {
                out.push(TurnDone {
                    key: row.key,
                    generation: row.generation,
                    cache: PrefixCache { tokens, cache },
                });
            }
        }
        let rngs = std::mem::take(&mut self.rngs);
        for (row, rng) in rows.into_iter().zip(rngs) {
            if let Some(row) = row {
                self.rows.push(row);
                self.rngs.push(rng);
            }
        }
        if self.rows.is_empty() {
            self.cache = KvCache::new(self.arch.config.num_hidden_layers);
            return out;
        }
        if !ended.is_empty() {
            self.cache.retain(&keep, &self.device);
        }
        self.trim_padding();
        self.last = Some(decode_one(
            self.lm,
            self.arch,
            self.decoder.as_deref(),
            &mut self.cache,
            next,
            &self.device,
        ));
        out
    }

    /// Takes the rows of `keys` out of the batch unfinished (whoever asked for them went
    /// away); the others go on as they were.
    pub fn cancel(&mut self, keys: &[usize]) {
        let keep: Vec<usize> = (0..self.rows.len())
            .filter(|&r| !keys.contains(&self.rows[r].key))
            .collect();
        if keep.len() == self.rows.len() {
            return;
        }
        if keep.is_empty() {
            self.cache = KvCache::new(self.arch.config.num_hidden_layers);
            self.last = None;
            self.rows.clear();
            self.rngs.clear();
            return;
        }
        self.cache.retain(&keep, &self.device);
        let idx = Tensor::<B, 1, Int>::from_data(
            TensorData::new(
                keep.iter().map(|&r| r as i32).collect::<Vec<_>>(),
                [keep.len()],
            ),
            &self.device,
        );
        self.last = self.last.take().map(|l| l.select(0, idx));
        let mut r = 0;
        self.rows.retain(|_| {
            r += 1;
            keep.contains(&(r - 1))
        });
        let mut r = 0;
        self.rngs.retain(|_| {
            r += 1;
            keep.contains(&(r - 1))
        });
    }

    /// Drops the leading slots no row uses any more (the longest conversations left), once
    /// they are worth a copy of the cache.
    fn trim_padding(&mut self) {
        let longest = self
            .rows
            .iter()
            .map(|r| r.context.len() + r.generation.tokens.len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        let spare = self.cache.len().saturating_sub(longest);
        if spare >= TRIM_AT_LEAST && spare * 4 >= self.cache.len() {
            self.cache.trim_front(spare);
        }
    }
}
