//! Batched sampling with a KV cache: temperature, top-k, top-p, stop tokens and strings, a
//! token limit, and each sampled token's log-probability.

use burn::tensor::activation::log_softmax;
use burn::tensor::{backend::Backend, Bool, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};

use crate::model::{Architecture, CausalLm, KvCache};
use crate::tokenizer::TextTokenizer;

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
        Self { temperature: 1.0, top_p: 1.0, top_k: 0, max_new_tokens: 256, stop_token_ids: Vec::new(), stop_strings: Vec::new() }
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
    let n = prompts.len();
    let mut out: Vec<Generation> =
        (0..n).map(|_| Generation { tokens: Vec::new(), logprobs: Vec::new(), finish: FinishReason::Length }).collect();
    if n == 0 || params.max_new_tokens == 0 {
        return out;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let max_len = prompts.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut ids = Vec::with_capacity(n * max_len);
    let mut valid = Vec::with_capacity(n * max_len);
    for p in prompts {
        let pad = max_len - p.len();
        ids.extend(std::iter::repeat_n(0i32, pad).chain(p.iter().map(|&t| t as i32)));
        valid.extend(std::iter::repeat_n(false, pad).chain(std::iter::repeat_n(true, p.len())));
    }
    let mut cache = KvCache::new(arch.config.num_hidden_layers);
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, max_len]), device);
    let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(valid, [n, max_len]), device);
    let logits = lm.forward(tokens, valid, arch, Some(&mut cache));
    let vocab = logits.dims()[2];
    let mut last = logits.narrow(1, max_len - 1, 1).reshape([n, vocab]);
    // Rows still generating, as indices into `out`.
    let mut live: Vec<usize> = (0..n).collect();
    for step in 0..params.max_new_tokens {
        let rows = live.len();
        let scaled = if params.temperature > 0.0 { last / params.temperature } else { last };
        let lp = log_softmax(scaled, 1);
        let host: Vec<f32> = lp.into_data().convert::<f32>().to_vec().unwrap_or_default();
        let mut next = Vec::with_capacity(rows);
        let mut keep = Vec::with_capacity(rows);
        for (r, &seq) in live.iter().enumerate() {
            let row = &host[r * vocab..(r + 1) * vocab];
            let tok = pick(row, params, &mut rng);
            let g = &mut out[seq];
            g.tokens.push(tok as u32);
            g.logprobs.push(row[tok]);
            let mut done = None;
            if params.stop_token_ids.contains(&(tok as u32)) {
                done = Some(FinishReason::StopToken);
            } else if let (Some(tk), false) = (tokenizer, params.stop_strings.is_empty()) {
                // Only the tail can newly complete a stop string.
                let from = g.tokens.len().saturating_sub(32);
                let tail = tk.decode(&g.tokens[from..]);
                if params.stop_strings.iter().any(|s| tail.contains(s.as_str())) {
                    done = Some(FinishReason::StopString);
                }
            }
            match done {
                Some(reason) => g.finish = reason,
                None => {
                    keep.push(r);
                    next.push(tok as i32);
                }
            }
        }
        if keep.is_empty() || step + 1 == params.max_new_tokens {
            break;
        }
        if keep.len() < rows {
            cache.retain(&keep, device);
        }
        live = keep.iter().map(|&r| live[r]).collect();
        let rows = live.len();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(next, [rows, 1]), device);
        let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; rows], [rows, 1]), device);
        last = lm.forward(tokens, valid, arch, Some(&mut cache)).reshape([rows, vocab]);
    }
    out
}

/// Chooses a token from one row of log-probabilities.
fn pick(row: &[f32], params: &SamplingParams, rng: &mut impl Rng) -> usize {
    if params.temperature <= 0.0 {
        return argmax(row);
    }
    let full = params.top_k == 0 && params.top_p >= 1.0;
    if full {
        let u: f32 = rng.random::<f32>();
        let mut acc = 0.0f32;
        for (i, &l) in row.iter().enumerate() {
            acc += l.exp();
            if acc >= u {
                return i;
            }
        }
        return argmax(row);
    }
    let mut idx: Vec<usize> = (0..row.len()).collect();
    let k = if params.top_k == 0 { row.len() } else { params.top_k.min(row.len()) };
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
    let u = rng.random::<f64>() * total;
    let mut acc = 0.0;
    for &i in &kept {
        acc += f64::from(row[i].exp());
        if acc >= u {
            return i;
        }
    }
    kept[0]
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap_or(0)
}
