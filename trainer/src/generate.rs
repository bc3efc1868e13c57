//! Batched sampling with a KV cache: temperature, top-k, top-p, stop tokens and strings, a
//! token limit, and each sampled token's log-probability.

use crate::model::decode::DecodeStep;
use crate::model::vocab::log_softmax_last;
use crate::model::{Architecture, CausalLm, KvCache};
use crate::seeds::ReplayRng;
use crate::tokenizer::TextTokenizer;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{backend::Backend, Bool, FloatDType, Int, Tensor, TensorData};

mod running;
pub use running::{RunningBatch, TurnDone, TurnRequest};

/// How to sample.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f64,
    /// Nucleus mass kept (1.0 keeps everything).
    pub top_p: f64,
    /// Most likely tokens kept (0 keeps everything).
    pub top_k: usize,
    /// Tokens to generate at most per sequence.
    pub max_new_tokens: usize,
    /// Token ids that end a sequence (kept in the output).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a sequence once the decoded output contains them.
    pub stop_strings: Vec<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
        }
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// A stop token was sampled.
    StopToken,
    /// A stop string appeared.
    StopString,
    /// `max_new_tokens` was reached.
    Length,
}

/// One generated continuation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Sampled token ids.
    pub tokens: Vec<u32>,
    /// log p(token) under the temperature-scaled policy (before top-k/top-p truncation, the
    /// distribution PPO's ratio is computed against).
    pub logprobs: Vec<f32>,
    /// Why it stopped.
    pub finish: FinishReason,
}

/// Samples continuations of `prompts` (token ids; any lengths, left-padded internally).
pub fn generate<B: Backend>(
    lm: &CausalLm<B>,
    arch: &Architecture<B>,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    tokenizer: Option<&TextTokenizer>,
    seed: u64,
    device: &B::Device,
) -> Vec<Generation> {
    generate_observed(
        lm,
        arch,
        prompts,
        params,
        tokenizer,
        seed,
        device,
        &mut |_, _| {},
    )
}

/// [`generate`], calling `on_token(prompt index, token)` as each token is sampled (a server
/// streams them).
#[allow(clippy::too_many_arguments)]
pub fn generate_observed<B: Backend>(
    lm: &CausalLm<B>,
    arch: &Architecture<B>,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    tokenizer: Option<&TextTokenizer>,
    seed: u64,
    device: &B::Device,
    on_token: &mut dyn FnMut(usize, u32),
) -> Vec<Generation> {
    let prompts: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let run = Sampling {
        lm,
        arch,
        params,
        tokenizer,
        device,
    };
    let cache = KvCache::new(arch.config.num_hidden_layers);
    run.sample(cache, &prompts, seed, on_token, false).0
}

/// A conversation's keys and values kept between its turns, so that the next turn prefills
/// only what was added since (the tokens are the ones sampled and rendered, never text
/// encoded again, so the prefix matches token for token).
pub struct PrefixCache<B: Backend> {
    tokens: Vec<u32>,
    cache: KvCache<B>,
}

impl<B: Backend> PrefixCache<B> {
    /// The token ids whose keys and values are held, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// What [`generate_continuing`] returns.
pub struct Continued<B: Backend> {
    /// One generation per context.
    pub generations: Vec<Generation>,
    /// Each conversation's cache after its turn, to hand back with its next context.
    pub caches: Vec<PrefixCache<B>>,
    /// Tokens run through the model before sampling (the new part of each context).
    pub prefilled_tokens: usize,
    /// Context tokens taken from the caches instead.
    pub reused_tokens: usize,
}

/// [`generate`] for conversations that continue: row `i` reuses `prefixes[i]` for the part
/// of `contexts[i]` it holds (the longest common prefix; a cache that diverged is cut there)
/// and prefills only the rest. The result is what [`generate`] gives from scratch, up to
/// floating-point order.
#[allow(clippy::too_many_arguments)]
pub fn generate_continuing<B: Backend>(
    lm: &CausalLm<B>,
    arch: &Architecture<B>,
    contexts: &[Vec<u32>],
    prefixes: Vec<Option<PrefixCache<B>>>,
    params: &SamplingParams,
    tokenizer: Option<&TextTokenizer>,
    seed: u64,
    device: &B::Device,
) -> Continued<B> {
    let layers = arch.config.num_hidden_layers;
    let (mut prefilled_tokens, mut reused_tokens) = (0, 0);
    let mut rows = Vec::with_capacity(contexts.len());
    let mut suffixes = Vec::with_capacity(contexts.len());
    let mut prefixes = prefixes.into_iter();
    for ctx in contexts {
        let (cache, common) = resume(prefixes.next().flatten(), ctx, layers);
        reused_tokens += common;
        prefilled_tokens += ctx.len() - common;
        rows.push(cache);
        suffixes.push(&ctx[common..]);
    }
    let run = Sampling {
        lm,
        arch,
        params,
        tokenizer,
        device,
    };
    let cache = KvCache::stack(rows, layers, device);
    let (generations, ended) = run.sample(cache, &suffixes, seed, &mut |_, _| {}, true);
    let caches = contexts
        .iter()
        .zip(&generations)
        .zip(ended)
        .map(|((ctx, g), cache)| {
            let fed = g.tokens.len().saturating_sub(1);
            let tokens: Vec<u32> = ctx.iter().chain(&g.tokens[..fed]).copied().collect();
            let cache = cache.unwrap_or_else(|| KvCache::new(layers));
            debug_assert_eq!(cache.len(), tokens.len());
            PrefixCache { tokens, cache }
        })
        .collect();
    Continued {
        generations,
        caches,
        prefilled_tokens,
        reused_tokens,
    }
}

/// A conversation's kept cache cut to the longest prefix it shares with `ctx` (a fresh cache
/// where none is kept or nothing is shared), and that prefix's length. At least one token of
/// `ctx` is left to feed: the first sample is drawn from its logits.
fn resume<B: Backend>(
    prefix: Option<PrefixCache<B>>,
    ctx: &[u32],
    layers: usize,
) -> (KvCache<B>, usize) {
    let Some(PrefixCache { tokens, mut cache }) = prefix else {
        return (KvCache::new(layers), 0);
    };
    let common = tokens
        .iter()
        .zip(ctx)
        .take_while(|(a, b)| a == b)
        .count()
        .min(ctx.len().saturating_sub(1));
    if common == 0 {
        return (KvCache::new(layers), 0);
    }
    cache.truncate(common);
    (cache, common)
}

/// Runs each row's `prompts` through the model after what `cache` holds for it (left-padded
/// to the longest), appending their keys and values, and returns the logits after each
/// row's last token, `[rows, vocab]`.
fn prefill<B: Backend>(
    lm: &CausalLm<B>,
    arch: &Architecture<B>,
    cache: &mut KvCache<B>,
    prompts: &[&[u32]],
    device: &B::Device,
) -> Tensor<B, 2> {
    let n = prompts.len();
    let max_len = prompts.iter().map(|p| p.len()).max().unwrap_or(0).max(1);
    let mut ids = Vec::with_capacity(n * max_len);
    let mut valid = Vec::with_capacity(n * max_len);
    for p in prompts {
        let pad = max_len - p.len();
        ids.extend(std::iter::repeat_n(0i32, pad).chain(p.iter().map(|&t| t as i32)));
        valid.extend(std::iter::repeat_n(false, pad).chain(std::iter::repeat_n(true, p.len())));
    }
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, max_len]), device);
    let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(valid, [n, max_len]), device);
    lm.forward_last(tokens, valid, arch, Some(cache))
}

/// Logits `[rows, vocab]` after one more token per row of `cache` (`next`, appended to it):
/// the backend's decode step where it has one and takes the cache, else the model's forward.
fn decode_one<B: Backend>(
    lm: &CausalLm<B>,
    arch: &Architecture<B>,
    decoder: Option<&dyn DecodeStep<B>>,
    cache: &mut KvCache<B>,
    next: Vec<i32>,
    device: &B::Device,
) -> Tensor<B, 2> {
    let rows = next.len();
    let fused = decoder.and_then(|d| {
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(next.clone(), [rows]), device);
        d.step(ids, cache)
    });
    fused.unwrap_or_else(|| {
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(next, [rows, 1]), device);
        let valid =
            Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; rows], [rows, 1]), device);
        lm.forward_last(tokens, valid, arch, Some(cache))
    })
}

/// One call's model, settings and device.
struct Sampling<'a, B: Backend> {
    lm: &'a CausalLm<B>,
    arch: &'a Architecture<B>,
    params: &'a SamplingParams,
    tokenizer: Option<&'a TextTokenizer>,
    device: &'a B::Device,
}

impl<B: Backend> Sampling<'_, B> {
    /// Continues each row of `cache` with its `prompts` row (left-padded internally), then
    /// samples. With `keep_rows`, also returns each row's cache as it ended: every token fed
    /// to the model, which is all but the last one sampled.
    fn sample(
        &self,
        mut cache: KvCache<B>,
        prompts: &[&[u32]],
        seed: u64,
        on_token: &mut dyn FnMut(usize, u32),
        keep_rows: bool,
    ) -> (Vec<Generation>, Vec<Option<KvCache<B>>>) {
        let Sampling {
            lm,
            arch,
            params,
            tokenizer,
            device,
        } = *self;
        let n = prompts.len();
        let mut ended: Vec<Option<KvCache<B>>> = (0..n).map(|_| None).collect();
        let mut out: Vec<Generation> = (0..n)
            .map(|_| Generation {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                finish: FinishReason::Length,
            })
            .collect();
        if n == 0 || params.max_new_tokens == 0 {
            return (out, ended);
        }
        let mut rng = ReplayRng::new(seed);
        let mut last = prefill(lm, arch, &mut cache, prompts, device);
        // Each later step feeds one token per row: the backend's decode step where it has one.
        let decoder = lm.decoder(arch);
        // Rows still generating, as indices into `out`.
        let mut live: Vec<usize> = (0..n).collect();
        // Where a decode step's time goes, at debug level only: the device is synchronised
        // around each part, which costs a little and tells choosing from computing.
        let mut split = tracing::enabled!(tracing::Level::DEBUG).then(StepSplit::default);
        for step in 0..params.max_new_tokens {
            let choose_start = split.as_ref().map(|_| {
                // A failed sync shows in the next read; the split is only a diagnosis.
                let _ = B::sync(device);
                std::time::Instant::now()
            });
            let rows = live.len();
            let picks = choose_rows(last, params, &mut Draws::Shared(&mut rng));
            if let (Some(split), Some(start)) = (split.as_mut(), choose_start) {
                split.choose += start.elapsed();
                split.steps += 1;
            }
            let mut next = Vec::with_capacity(rows);
            let mut keep = Vec::with_capacity(rows);
            for (r, (&seq, &(tok, logprob))) in live.iter().zip(&picks).enumerate() {
                let g = &mut out[seq];
                g.tokens.push(tok as u32);
                on_token(seq, tok as u32);
                g.logprobs.push(logprob);
                match stop_reason(g, params, tokenizer) {
                    Some(reason) => g.finish = reason,
                    None => {
                        keep.push(r);
                        next.push(tok as i32);
                    }
                }
            }
            let last_step = keep.is_empty() || step + 1 == params.max_new_tokens;
            if keep_rows {
                for r in 0..rows {
                    if last_step || !keep.contains(&r) {
                        ended[live[r]] = Some(cache.row(r, device));
                    }
                }
            }
            if last_step {
                break;
            }
            if keep.len() < rows {
                cache.retain(&keep, device);
            }
            live = keep.iter().map(|&r| live[r]).collect();
            let step_start = split.as_ref().map(|_| std::time::Instant::now());
            last = decode_one(lm, arch, decoder.as_deref(), &mut cache, next, device);
            if let (Some(split), Some(start)) = (split.as_mut(), step_start) {
                split.queue += start.elapsed();
                let _ = B::sync(device);
                split.compute += start.elapsed();
            }
        }
        if let Some(split) = split {
            split.report(n);
        }
        (out, ended)
    }
}

/// Where each row's random draws come from: one generator for the whole batch (a call of
/// [`generate`]), or one per row (conversations of a running batch, whose draws must not
/// depend on which others share their steps).
enum Draws<'r> {
    Shared(&'r mut ReplayRng),
    PerRow(&'r mut [ReplayRng]),
}

impl Draws<'_> {
    fn rng(&mut self, row: usize) -> &mut ReplayRng {
        match self {
            Draws::Shared(rng) => rng,
            Draws::PerRow(rngs) => &mut rngs[row],
        }
    }
}

/// The next token of each row of logits `[rows, vocab]` and its log-probability. Sampling
/// from the whole distribution (PPO's default) and greedy decoding choose on the device and
/// bring back a few numbers per row; top-k / top-p bring back whole rows.
fn choose_rows<B: Backend>(
    last: Tensor<B, 2>,
    params: &SamplingParams,
    draws: &mut Draws<'_>,
) -> Vec<(usize, f32)> {
    let [rows, vocab] = last.dims();
    let on_device = params.temperature <= 0.0 || (params.top_k == 0 && params.top_p >= 1.0);
    if on_device {
        let us: Vec<f64> = if params.temperature > 0.0 {
            (0..rows).map(|r| draws.rng(r).unit_f64()).collect()
        } else {
            Vec::new()
        };
        return choose_on_device(last, params.temperature, &us);
    }
    let lp = scaled_log_probs(last, params.temperature);
    let host: Vec<f32> = lp.into_data().convert::<f32>().to_vec().unwrap_or_default();
    host.chunks_exact(vocab.max(1))
        .take(rows)
        .enumerate()
        .map(|(r, row)| {
            let tok = pick(row, params, draws.rng(r));
            (tok, row[tok])
        })
        .collect()
}

/// Why `g` ends with the token it has just taken, if it does: a stop token, or a stop string
/// completed in its tail.
fn stop_reason(
    g: &Generation,
    params: &SamplingParams,
    tokenizer: Option<&TextTokenizer>,
) -> Option<FinishReason> {
    let last = *g.tokens.last()?;
    if params.stop_token_ids.contains(&last) {
        return Some(FinishReason::StopToken);
    }
    let tk = tokenizer?;
    if params.stop_strings.is_empty() {
        return None;
    }
    // Only the tail can newly complete a stop string.
    let from = g.tokens.len().saturating_sub(32);
    let tail = tk.decode(&g.tokens[from..]);
    params
        .stop_strings
        .iter()
        .any(|s| tail.contains(s.as_str()))
        .then_some(FinishReason::StopString)
}

/// Log-probabilities `[rows, vocab]` of logits at a temperature (none when it is 0, greedy),
/// in f32 whatever the model's precision: a bf16 log-softmax over a large vocabulary is too
/// coarse to sample from.
fn scaled_log_probs<B: Backend>(logits: Tensor<B, 2>, temperature: f64) -> Tensor<B, 2> {
    let logits = logits.cast(FloatDType::F32);
    log_softmax_last(if temperature > 0.0 {
        logits / temperature
    } else {
        logits
    })
}

/// The next token of each row of logits `[rows, vocab]` and its log-probability, chosen on the
/// device: greedy when `temperature` is 0, else drawn from the whole distribution at
/// `temperature` with `us[row]` uniform in [0, 1). The backend's [`FusedChoice`] where it has
/// one (one read of the device), else [`choose_composed`].
pub fn choose_on_device<B: Backend>(
    logits: Tensor<B, 2>,
    temperature: f64,
    us: &[f64],
) -> Vec<(usize, f32)> {
    match choose_fused(&logits, temperature, us) {
        Some(picks) => picks,
        None => choose_composed(logits, temperature, us),
    }
}

/// [`choose_on_device`] composed of burn operations, on every backend.
pub fn choose_composed<B: Backend>(
    logits: Tensor<B, 2>,
    temperature: f64,
    us: &[f64],
) -> Vec<(usize, f32)> {
    let lp = scaled_log_probs(logits, temperature);
    if temperature > 0.0 {
        draw_on_device(lp, us)
    } else {
        greedy_on_device(lp)
    }
}

/// A backend's choice of the next tokens as one operation (registered with
/// [`crate::model::fused`]; the CUDA kernel of `kernels::sample`): logits `[rows, vocab]`,
/// the temperature (0: greedy) and each row's uniform draw as the bits of an `f64` (`[rows,
/// 2]` ints, low word first) to `[rows, 2]` ints, each row's token and its log-probability's
/// `f32` bits: the choice [`greedy_on_device`] and [`draw_on_device`] make from
/// [`scaled_log_probs`]. `None` to decline.
pub type FusedChoice<B> = fn(FloatTensor<B>, f64, IntTensor<B>) -> Option<IntTensor<B>>;

/// The next token of each row and its log-probability through the backend's [`FusedChoice`],
/// where it has one and takes these logits: one read of the device.
fn choose_fused<B: Backend>(
    logits: &Tensor<B, 2>,
    temperature: f64,
    us: &[f64],
) -> Option<Vec<(usize, f32)>> {
    let choose = crate::model::fused::get::<B, FusedChoice<B>>()?;
    let rows = logits.dims()[0];
    let bits: Vec<i32> = if temperature > 0.0 {
        us.iter()
            .take(rows)
            .flat_map(|u| {
                let b = u.to_bits();
                [b as u32 as i32, (b >> 32) as u32 as i32]
            })
            .collect()
    } else {
        vec![0; 2 * rows]
    };
    if bits.len() != 2 * rows {
        return None;
    }
    let device = logits.device();
    let draws = Tensor::<B, 2, Int>::from_data(TensorData::new(bits, [rows, 2]), &device);
    let out = choose(
        logits.clone().into_primitive().tensor(),
        temperature,
        draws.into_primitive(),
    )?;
    let out: Vec<i32> = Tensor::<B, 2, Int>::from_primitive(out)
        .into_data()
        .convert::<i32>()
        .to_vec()
        .ok()?;
    Some(
        out.chunks_exact(2)
            .map(|p| (p[0] as u32 as usize, f32::from_bits(p[1] as u32)))
            .collect(),
    )
}

/// A generation's decode time in parts (debug level): choosing each step's tokens from its
/// logits, queueing the next step, and the step until the device has finished it.
#[derive(Default)]
struct StepSplit {
    steps: u32,
    choose: std::time::Duration,
    queue: std::time::Duration,
    compute: std::time::Duration,
}

impl StepSplit {
    fn report(&self, rows: usize) {
        let per = |d: std::time::Duration| d.as_secs_f64() * 1e3 / f64::from(self.steps.max(1));
        tracing::debug!(
            rows,
            steps = self.steps,
            choose_ms = per(self.choose),
            queue_ms = per(self.queue),
            step_ms = per(self.compute),
            "decode time per step"
        );
    }
}

/// Width of the blocks of [`draw_on_device`]'s two-stage draw.
const DRAW_BLOCK: usize = 128;

/// The most likely token of each row of log-probabilities `[rows, vocab]`, and its
/// log-probability: the best block of [`DRAW_BLOCK`] tokens by its maximum, then the best
/// token inside it (two short reductions instead of one across the vocabulary; ties go to
/// the lowest index, as a one-stage argmax breaks them).
fn greedy_on_device<B: Backend>(lp: Tensor<B, 2>) -> Vec<(usize, f32)> {
    let rows = lp.dims()[0];
    let lp3 = pad_to_blocks(lp);
    let block = lp3.clone().max_dim(2).argmax(1); // [rows, 1, 1]
    let inside = lp3.gather(1, block.clone().expand([rows, 1, DRAW_BLOCK])); // [rows, 1, DRAW_BLOCK]
    let pos = inside.clone().argmax(2); // [rows, 1, 1]
    let chosen = inside.gather(2, pos.clone());
    let block: Vec<i64> = block
        .into_data()
        .convert::<i64>()
        .to_vec()
        .unwrap_or_default();
    let pos: Vec<i64> = pos
        .into_data()
        .convert::<i64>()
        .to_vec()
        .unwrap_or_default();
    let chosen: Vec<f32> = chosen
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap_or_default();
    (0..rows)
        .map(|r| (block[r] as usize * DRAW_BLOCK + pos[r] as usize, chosen[r]))
        .collect()
}

/// `[rows, vocab]` as `[rows, blocks, DRAW_BLOCK]`, the tail block padded with `-inf`
/// (probability 0).
fn pad_to_blocks<B: Backend>(lp: Tensor<B, 2>) -> Tensor<B, 3> {
    let [rows, vocab] = lp.dims();
    let blocks = vocab.div_ceil(DRAW_BLOCK);
    let padded = if blocks * DRAW_BLOCK > vocab {
        let pad = Tensor::<B, 2>::full(
            [rows, blocks * DRAW_BLOCK - vocab],
            f32::NEG_INFINITY,
            &lp.device(),
        )
        .cast(lp.dtype());
        Tensor::cat(vec![lp, pad], 1)
    } else {
        lp
    };
    padded.reshape([rows, blocks, DRAW_BLOCK])
}

/// Draws one token per row of log-probabilities `[rows, vocab]` by inverting the cumulative
/// distribution at `us[row]` (uniform in [0, 1)): the first token whose cumulative probability
/// passes it. Only a block total per 128 tokens and then the one block that holds the draw
/// move to the host (a whole row of a 150k vocabulary is 600 KB per sequence and step).
pub fn draw_on_device<B: Backend>(lp: Tensor<B, 2>, us: &[f64]) -> Vec<(usize, f32)> {
    let rows = lp.dims()[0];
    let device = lp.device();
    let lp3 = pad_to_blocks(lp);
    let blocks = lp3.dims()[1];
    let mass: Vec<f32> = lp3
        .clone()
        .exp()
        .sum_dim(2)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap_or_default();
    // Stage one: the block where the cumulative mass passes u (scaled by the row's total, which
    // rounding keeps from being exactly 1).
    let (chosen, remainder): (Vec<i32>, Vec<f64>) = us
        .iter()
        .take(rows)
        .enumerate()
        .map(|(r, &u)| {
            let row = &mass[r * blocks..(r + 1) * blocks];
            let target = u * row.iter().map(|&m| f64::from(m)).sum::<f64>();
            let (block, rest) = invert_cdf(row.iter().map(|&m| f64::from(m)), target);
            (block as i32, rest)
        })
        .unzip();
    // Stage two: that block's log-probabilities, walked on the host.
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(chosen.clone(), [rows]), &device)
        .reshape([rows, 1, 1])
        .expand([rows, 1, DRAW_BLOCK]);
    let vals: Vec<f32> = lp3
        .gather(1, idx)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap_or_default();
    (0..rows)
        .map(|r| {
            let row = &vals[r * DRAW_BLOCK..(r + 1) * DRAW_BLOCK];
            let (k, _) = invert_cdf(row.iter().map(|l| f64::from(l.exp())), remainder[r]);
            (chosen[r] as usize * DRAW_BLOCK + k, row[k])
        })
        .collect()
}

/// The first index whose weight takes the running sum past `target`, and how much of `target`
/// is left after the weights before it. Zero weights are never chosen; when rounding leaves
/// `target` beyond the total, the last positive weight is.
fn invert_cdf(weights: impl Iterator<Item = f64>, target: f64) -> (usize, f64) {
    let mut acc = 0.0;
    let mut last = (0, 0.0);
    for (i, w) in weights.enumerate() {
        if w > 0.0 {
            if acc + w > target {
                return (i, target - acc);
            }
            last = (i, target - acc);
        }
        acc += w;
    }
    last
}

/// Chooses a token from one row of log-probabilities under top-k / top-p (greedy decoding and
/// whole-distribution sampling choose on the device).
fn pick(row: &[f32], params: &SamplingParams, rng: &mut ReplayRng) -> usize {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    let k = if params.top_k == 0 {
        row.len()
    } else {
        params.top_k.min(row.len())
    };
    if k < row.len() {
        idx.select_nth_unstable_by(k - 1, |&a, &b| row[b].total_cmp(&row[a]));
        idx.truncate(k);
    }
    idx.sort_unstable_by(|&a, &b| row[b].total_cmp(&row[a]));
    let mut kept = Vec::with_capacity(idx.len());
    let mut mass = 0.0f64;
    for &i in &idx {
        kept.push(i);
        mass += f64::from(row[i].exp());
        if mass >= params.top_p {
            break;
        }
    }
    let total: f64 = kept.iter().map(|&i| f64::from(row[i].exp())).sum();
    let u = rng.unit_f64() * total;
    let mut acc = 0.0;
    for &i in &kept {
        acc += f64::from(row[i].exp());
        if acc >= u {
            return i;
        }
    }
    kept[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn greedy_finds_the_maximum_in_any_block_and_breaks_ties_low() {
        // 300 tokens: two full blocks and a padded third.
        let vocab = 300;
        let mut rows = vec![-5.0f32; 2 * vocab];
        rows[257] = -0.1; // row 0: in the padded tail block
        rows[vocab + 5] = -0.2; // row 1: tied with a later block's entry
        rows[vocab + 200] = -0.2;
        let lp = Tensor::<NdArray<f32>, 2>::from_data(
            TensorData::new(rows, [2, vocab]),
            &Default::default(),
        );
        assert_eq!(greedy_on_device(lp), vec![(257, -0.1), (5, -0.2)]);
    }
}
