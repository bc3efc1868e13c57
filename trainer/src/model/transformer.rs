//! The decoder stack shared by the policy and the critic: embeddings, pre-norm blocks of
//! grouped-query attention and a SwiGLU MLP, and the final RMSNorm.

use burn::module::{Module, Param, ParamId};
use burn::tensor::activation::silu;
use burn::tensor::module::attention;
use burn::tensor::ops::{AttentionModuleOptions, FloatTensor};
use burn::tensor::{backend::Backend, Bool, DType, Int, Tensor, TensorPrimitive};

use super::cache::{KvCache, LayerCache};
use super::config::ModelConfig;
use super::lora::{Adapter, LoraSpec};
use super::rope::{RopeAngles, RopeTables};

/// A dense layer stored as `[in, out]` (Hugging Face stores `[out, in]`; the loader transposes).
#[derive(Module, Debug)]
pub struct Dense<B: Backend> {
    /// `[in, out]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[out]`, when the layer has one.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// A low-rank adapter on top of the (then frozen) weight.
    pub lora: Option<Adapter<B>>,
}

impl<B: Backend> Dense<B> {
    /// A layer with normally distributed weights (std 0.02, as Hugging Face initialises).
    pub fn random(d_in: usize, d_out: usize, bias: bool, std: f64, device: &B::Device) -> Self {
        let w = Tensor::random(
            [d_in, d_out],
            burn::tensor::Distribution::Normal(0.0, std),
            device,
        );
        Self {
            weight: Param::from_tensor(w),
            bias: bias.then(|| Param::from_tensor(Tensor::zeros([d_out], device))),
            lora: None,
        }
    }

    /// `x @ W + b` over the last dimension, plus the adapter's update when there is one.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let Some(adapter) = &self.lora else {
            return self.forward_base(x);
        };
        let mut dims = x.dims();
        let d_in = dims[D - 1];
        let delta = adapter.delta(x.clone().reshape([-1, d_in as i32]));
        dims[D - 1] = adapter.out_width;
        self.forward_base(x) + delta.reshape(dims)
    }

    /// `x @ W + b`, without the adapter.
    fn forward_base<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let bias = self.bias.as_ref().map(|b| b.val());
        if !B::ad_enabled(&x.device()) {
            return burn::tensor::module::linear(x, self.weight.val(), bias);
        }
        let mut dims = x.dims();
        let d_in = dims[D - 1];
        // When differentiating, as rows of a matrix: the weight's gradient is then one product
        // over every position rather than a product per sequence summed afterwards. (Without
        // gradients the reshapes would only add operations to every decoding step.)
        let rows: Tensor<B, 2> = x.reshape([-1, d_in as i32]);
        let y = rows.matmul(self.weight.val());
        let y = match bias {
            Some(b) => y + broadcast_rows(b, dims[..D - 1].iter().product()),
            None => y,
        };
        dims[D - 1] = y.dims()[1];
        y.reshape(dims)
    }

    /// One layer computing `parts` (weight `[in, width]`, optional bias) side by side, outputs
    /// concatenated in order. One wide matrix product instead of several narrow ones: the key
    /// and value projections of a grouped-query layer are only `kv_heads * head_dim` wide, too
    /// narrow to fill a GPU. Biases are kept only when every part has one.
    pub fn from_parts(parts: Vec<(Tensor<B, 2>, Option<Tensor<B, 1>>)>) -> Self {
        let with_bias = parts.iter().all(|(_, b)| b.is_some());
        let (weights, biases): (Vec<_>, Vec<_>) = parts.into_iter().unzip();
        Self {
            weight: Param::from_tensor(Tensor::cat(weights, 1)),
            bias: with_bias.then(|| {
                Param::from_tensor(Tensor::cat(biases.into_iter().flatten().collect(), 0))
            }),
            lora: None,
        }
    }

    /// Puts a fresh adapter on the parts `(offset, width)` of the output (the weight is
    /// frozen by the caller); no parts leaves the layer as it is.
    pub fn adapt(&mut self, parts: &[(usize, usize)], spec: &LoraSpec) {
        if parts.is_empty() {
            self.lora = None;
            return;
        }
        let [d_in, d_out] = self.weight.dims();
        let device = self.weight.device();
        self.lora = Some(Adapter::new(d_in, parts, d_out, spec, &device));
    }

    /// The layer with its adapter's update added into the weight (the merged model), and no
    /// adapter: for export and inference (its weight is not a trainable parameter).
    pub fn merged(&self) -> Self {
        let Some(adapter) = &self.lora else {
            return self.clone();
        };
        let w = self.weight.val().detach();
        let dtype = w.dtype();
        let mut merged = w.cast(DType::F32);
        for (offset, product) in adapter.products() {
            let width = product.dims()[1];
            let rows = merged.dims()[0];
            let part = merged.clone().narrow(1, offset, width) + product;
            merged = merged.slice_assign([0..rows, offset..offset + width], part);
        }
        Self {
            weight: Param::initialized(ParamId::new(), merged.cast(dtype).detach()),
            bias: self.bias.clone(),
            lora: None,
        }
    }

    /// The inverse of [`Dense::from_parts`]: weight `[in, width]` and bias of each part, as values
    /// detached from the graph (for export, not for training).
    pub fn split(&self, widths: &[usize]) -> Vec<(Tensor<B, 2>, Option<Tensor<B, 1>>)> {
        let mut start = 0;
        widths
            .iter()
            .map(|&w| {
                let part = (
                    self.weight.val().detach().narrow(1, start, w),
                    self.bias
                        .as_ref()
                        .map(|b| b.val().detach().narrow(0, start, w)),
                );
                start += w;
                part
            })
            .collect()
    }
}

/// A fused [`RmsNorm`] for backend `B` (registered with [`super::fused`]): rows `[rows, d]`,
/// scale `[d]` and epsilon to `x / sqrt(mean(x²) + eps) · scale`, or `None` to decline (the
/// composition of burn operations then runs). Differentiable in both on autodiff backends.
pub type FusedRmsNorm<B> = fn(FloatTensor<B>, FloatTensor<B>, f64) -> Option<FloatTensor<B>>;

/// Root-mean-square normalisation with a learned scale.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// `[hidden]`.
    pub weight: Param<Tensor<B, 1>>,
    /// Added to the mean square.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// A norm with unit scale.
    pub fn ones(d: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::ones([d], device)),
            eps,
        }
    }

    /// Normalises the last dimension.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        if let Some(fused) = super::fused::get::<B, FusedRmsNorm<B>>() {
            let rows = x.clone().reshape([b * t, d]).into_primitive().tensor();
            if let Some(y) = fused(rows, self.weight.val().into_primitive().tensor(), self.eps) {
                return Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y))
                    .reshape([b, t, d]);
            }
        }
        self.forward_decomposed(x)
    }

    /// [`Self::forward`] as burn operations, whatever is registered.
    pub fn forward_decomposed(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let ms = x.clone().powi_scalar(2).mean_dim(2);
        let inv = (ms + self.eps).sqrt().recip();
        if !B::ad_enabled(&x.device()) {
            return x * inv * self.weight.val().reshape([1, 1, d]);
        }
        (x * inv) * broadcast_rows(self.weight.val(), b * t).reshape([b, t, d])
    }
}

/// `v` (`[n]`) repeated as `rows` rows (`[rows, n]`), made as the product of a column of ones
/// and `v` so that its gradient is a product too: `onesᵗ · grad`, one matrix product, where
/// the gradient of a broadcast sums over the rows with a reduction along the strided axis.
/// At 8192 rows that reduction took 1.2 ms for a 1152-wide bias (0.23 ms for a 896-wide norm
/// scale), the product tens of microseconds, measured on an H200.
fn broadcast_rows<B: Backend>(v: Tensor<B, 1>, rows: usize) -> Tensor<B, 2> {
    let n = v.dims()[0];
    let ones = Tensor::<B, 2>::ones([rows, 1], &v.device()).cast(v.dtype());
    ones.matmul(v.reshape([1, n]))
}

/// Grouped-query self-attention with rotary positions.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query, key and value projections as one layer: outputs `[q (heads) | k | v (kv heads)]`.
    pub qkv_proj: Dense<B>,
    /// Output projection.
    pub o_proj: Dense<B>,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
}

impl<B: Backend> Attention<B> {
    /// Output widths of the query, key and value parts of `qkv_proj`.
    pub fn qkv_widths(&self) -> [usize; 3] {
        [
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        ]
    }

    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeAngles<B>,
        mask: &Tensor<B, 4, Bool>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let [b, t, _] = x.dims();
        let (h, kvh, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        // [b, t, heads of q, k and v, hd]: splitting along the head axis keeps every part a view.
        let qkv = self.qkv_proj.forward(x).reshape([b, t, h + 2 * kvh, hd]);
        // Queries and keys rotate together: one rotation instead of two.
        let qk = rope.apply(qkv.clone().narrow(2, 0, h + kvh));
        let q = qk.clone().narrow(2, 0, h).swap_dims(1, 2);
        let k = qk.narrow(2, h, kvh).swap_dims(1, 2);
        let v = qkv.narrow(2, h + kvh, kvh).swap_dims(1, 2);
        let (k, v) = match cache {
            Some(c) => c.append(k, v),
            None => (k, v),
        };
        let out = grouped_query_attention(q, k, v, mask, kvh);
        self.o_proj
            .forward(out.swap_dims(1, 2).reshape([b, t, h * hd]))
    }
}

/// Query counts up to which [`grouped_query_attention`] regroups the queries: decode steps
/// and short continuations. Regrouping materialises the mask per query head (`[batch, heads,
/// queries, keys]` bytes); expanding materialises the keys and values per query head (`2 x
/// [batch, heads, keys, head_dim]` elements), which costs more below about `2 x head_dim`
/// queries. Long prefills and training passes keep the broadcast mask the fused kernels read
/// with a zero stride.
const REGROUP_MAX_QUERIES: usize = 16;

/// Attention of `q` `[b, h, t, d]` over keys and values shared by groups of query heads (`k`,
/// `v` `[b, kvh, s, d]`; query head `j` reads key head `j / (h / kvh)`), `mask` `[b, 1, t, s]`
/// true where hidden. Returns `[b, h, t, d]`.
///
/// With a few queries against a long cache (a decode step), the queries of each group are
/// stacked as rows of one key head, `[b, kvh, groups * t, d]`, so the cache is read as it is
/// stored: expanding it to every query head copied the whole cache `groups` times per layer
/// and step (7x for Qwen2.5's 0.5B and 7B shapes), the main cost of decoding at long context.
fn grouped_query_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &Tensor<B, 4, Bool>,
    kvh: usize,
) -> Tensor<B, 4> {
    grouped_query_attention_in_blocks(q, k, v, mask, kvh, MAX_SCORE_ELEMENTS)
}

/// Whether backend `B`'s differentiable attention (registered with [`super::fused`]) takes
/// keys and values `[b, kvh, s, d]` shared by groups of query heads as they are, for queries
/// of head width `d` and this element type, at any length: flash kernels that never hold the
/// scores. Where it does, [`grouped_query_attention`] neither expands the keys nor splits
/// the queries.
pub type GroupedAttention = fn(usize, DType) -> bool;

/// Elements of one attention's score tensor (`[batch, heads, queries, keys]`) above which
/// [`grouped_query_attention`] takes the queries a block at a time. The scores are made
/// whole: 8 rows of 10,112 tokens on Qwen2.5-0.5B's 14 heads are 1.1e10 elements (23 GB per
/// layer in bf16), past what a CUDA kernel's 32-bit indices reach (a 50-turn rollout bench
/// panicked there on an H100). 2^30 elements are 2 GB in bf16.
const MAX_SCORE_ELEMENTS: usize = 1 << 30;

/// [`grouped_query_attention`] with queries in blocks whose scores hold at most `max_scores`
/// elements each (softmax is per query, so the blocks' outputs side by side are the whole
/// output; on autodiff backends each block is its own differentiable attention).
fn grouped_query_attention_in_blocks<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &Tensor<B, 4, Bool>,
    kvh: usize,
    max_scores: usize,
) -> Tensor<B, 4> {
    let [b, h, t, d] = q.dims();
    let s = k.dims()[2];
    if t > REGROUP_MAX_QUERIES {
        if let Some(takes) = super::fused::get::<B, GroupedAttention>() {
            if takes(d, q.dtype()) {
                // Flash kernels: the shared key heads read in place, the scores never whole.
                let mask = mask.clone().expand([b, h, t, s]);
                return attention(q, k, v, Some(mask), None, AttentionModuleOptions::default());
            }
        }
    }
    let per_query = (b * h * s).max(1);
    if t <= 1 || per_query.saturating_mul(t) <= max_scores {
        return grouped_query_attention_as(q, k, v, mask, kvh, t <= REGROUP_MAX_QUERIES);
    }
    let block = (max_scores / per_query).max(1);
    // Expanded once for all blocks where the blocks would expand them each (reshaping an
    // expanded tensor copies it).
    let (k, v, kvh) = if h > kvh && block > REGROUP_MAX_QUERIES {
        (expand_to_heads(k, h), expand_to_heads(v, h), h)
    } else {
        (k, v, kvh)
    };
    let mut outs = Vec::with_capacity(t.div_ceil(block));
    let mut start = 0;
    while start < t {
        let n = block.min(t - start);
        outs.push(grouped_query_attention_as(
            q.clone().narrow(2, start, n),
            k.clone(),
            v.clone(),
            &mask.clone().narrow(2, start, n),
            kvh,
            n <= REGROUP_MAX_QUERIES,
        ));
        start += n;
    }
    Tensor::cat(outs, 2)
}

/// [`grouped_query_attention`] with the way of sharing the keys chosen by the caller.
fn grouped_query_attention_as<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &Tensor<B, 4, Bool>,
    kvh: usize,
    regroup: bool,
) -> Tensor<B, 4> {
    let [b, h, t, d] = q.dims();
    let s = k.dims()[2];
    let groups = h / kvh;
    if groups == 1 {
        let mask = mask.clone().expand([b, h, t, s]);
        return attention(q, k, v, Some(mask), None, AttentionModuleOptions::default());
    }
    if regroup {
        // Head kv * groups + g, query i -> row g * t + i of key head kv: a plain reshape.
        let q = q.reshape([b, kvh, groups * t, d]);
        let mask = mask
            .clone()
            .unsqueeze_dim::<5>(2)
            .expand([b, kvh, groups, t, s])
            .reshape([b, kvh, groups * t, s]);
        let out = attention(q, k, v, Some(mask), None, AttentionModuleOptions::default());
        return out.reshape([b, h, t, d]);
    }
    let mask = mask.clone().expand([b, h, t, s]);
    attention(
        q,
        expand_to_heads(k, h),
        expand_to_heads(v, h),
        Some(mask),
        None,
        AttentionModuleOptions::default(),
    )
}

/// Keys or values `[b, kvh, s, d]` repeated for each of `h` query heads, `[b, h, s, d]`
/// (query head `j` reads key head `j / (h / kvh)`); a copy, since the reshape of an expanded
/// tensor copies it.
fn expand_to_heads<B: Backend>(z: Tensor<B, 4>, h: usize) -> Tensor<B, 4> {
    let [b, kvh, s, d] = z.dims();
    z.unsqueeze_dim::<5>(2)
        .expand([b, kvh, h / kvh, s, d])
        .reshape([b, h, s, d])
}

/// SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// Gate and up projections as one layer: outputs `[gate | up]`.
    pub gate_up_proj: Dense<B>,
    /// Down projection.
    pub down_proj: Dense<B>,
}

/// A fused SwiGLU gate for backend `B` (registered with [`super::fused`]): the gate-and-up
/// projection `[rows, 2n]` (gate first) to `silu(gate) · up` `[rows, n]`, or `None` to
/// decline. Differentiable on autodiff backends.
pub type FusedSwiGlu<B> = fn(FloatTensor<B>) -> Option<FloatTensor<B>>;

impl<B: Backend> Mlp<B> {
    /// `down(silu(gate(x)) · up(x))`, the gate fused where a backend registered it.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let Some(fused) = super::fused::get::<B, FusedSwiGlu<B>>() else {
            return self.forward_decomposed(x);
        };
        // As rows: the fused gate takes a matrix.
        let [b, t, d] = x.dims();
        let gu = self.gate_up_proj.forward(x.reshape([b * t, d]));
        let n = gu.dims()[1] / 2;
        let h = match fused(gu.clone().into_primitive().tensor()) {
            Some(h) => Tensor::from_primitive(TensorPrimitive::Float(h)),
            None => silu(gu.clone().narrow(1, 0, n)) * gu.narrow(1, n, n),
        };
        let y = self.down_proj.forward(h);
        let out = y.dims()[1];
        y.reshape([b, t, out])
    }

    /// [`Self::forward`] as burn operations, whatever is registered.
    pub fn forward_decomposed(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gu = self.gate_up_proj.forward(x);
        let inner = gu.dims()[2] / 2;
        let gate = gu.clone().narrow(2, 0, inner);
        let up = gu.narrow(2, inner, inner);
        self.down_proj.forward(silu(gate) * up)
    }
}

/// One pre-norm decoder block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Self-attention.
    pub self_attn: Attention<B>,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm<B>,
    /// Feed-forward.
    pub mlp: Mlp<B>,
}

/// The decoder without an output head: token ids in, final hidden states out.
#[derive(Module, Debug)]
pub struct Backbone<B: Backend> {
    /// `[vocab, hidden]`.
    pub embed_tokens: Param<Tensor<B, 2>>,
    /// Decoder blocks.
    pub layers: Vec<Block<B>>,
    /// Final norm.
    pub norm: RmsNorm<B>,
}

/// Token positions and the attention mask derived from a padding mask.
pub struct Positions<B: Backend> {
    /// `[batch, seq]` position of each new token (pads get 0).
    pub positions: Tensor<B, 2, Int>,
    /// `[batch, 1, seq, keys]`, true where attention is forbidden.
    pub mask: Tensor<B, 4, Bool>,
}

impl<B: Backend> Backbone<B> {
    /// A randomly initialised backbone (std 0.02 weights, unit norms).
    pub fn random(cfg: &ModelConfig, device: &B::Device) -> Self {
        let std = 0.02;
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| Block {
                input_layernorm: RmsNorm::ones(d, cfg.rms_norm_eps, device),
                self_attn: Attention {
                    qkv_proj: Dense::random(
                        d,
                        (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd,
                        cfg.qkv_bias,
                        std,
                        device,
                    ),
                    o_proj: Dense::random(cfg.num_attention_heads * hd, d, cfg.o_bias, std, device),
                    n_heads: cfg.num_attention_heads,
                    n_kv_heads: cfg.num_key_value_heads,
                    head_dim: hd,
                },
                post_attention_layernorm: RmsNorm::ones(d, cfg.rms_norm_eps, device),
                mlp: Mlp {
                    gate_up_proj: Dense::random(
                        d,
                        2 * cfg.intermediate_size,
                        cfg.mlp_bias,
                        std,
                        device,
                    ),
                    down_proj: Dense::random(cfg.intermediate_size, d, cfg.mlp_bias, std, device),
                },
            })
            .collect();
        Self {
            embed_tokens: Param::from_tensor(Tensor::random(
                [cfg.vocab_size, d],
                burn::tensor::Distribution::Normal(0.0, std),
                device,
            )),
            layers,
            norm: RmsNorm::ones(d, cfg.rms_norm_eps, device),
        }
    }

    /// Hidden states `[batch, seq, hidden]` of `tokens` `[batch, seq]`.
    ///
    /// `valid` `[batch, seq]` marks real tokens (false for padding, left or right). With a
    /// cache, the tokens continue the cached sequences and are appended to the cache.
    pub fn forward(
        &self,
        tokens: Tensor<B, 2, Int>,
        valid: Tensor<B, 2, Bool>,
        rope: &RopeTables<B>,
        mut cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let pos = match cache.as_deref_mut() {
            Some(c) => c.extend(valid),
            None => positions_and_mask(valid, None),
        };
        let mut x = burn::tensor::module::embedding(self.embed_tokens.val(), tokens);
        // The rotation angles depend only on the positions: looked up once for every layer.
        let angles = rope.angles(&pos.positions);
        for (i, layer) in self.layers.iter().enumerate() {
            let lc = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = layer.forward(x, &angles, &pos.mask, lc);
        }
        self.norm.forward(x)
    }
}

impl<B: Backend> Block<B> {
    /// The layer's output for input `x` `[batch, seq, hidden]`.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        angles: &RopeAngles<B>,
        mask: &Tensor<B, 4, Bool>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let h =
            self.self_attn
                .forward(self.input_layernorm.forward(x.clone()), angles, mask, cache);
        let x = x + h;
        x.clone() + self.mlp.forward(self.post_attention_layernorm.forward(x))
    }
}

/// Positions and mask for new tokens `valid` `[batch, t]` following `past` `[batch, s]` (both
/// true on real tokens). Position = count of real tokens before it; a key is hidden when it is
/// in the future or padding. A pad query sees only itself so no row is fully masked.
pub fn positions_and_mask<B: Backend>(
    valid: Tensor<B, 2, Bool>,
    past: Option<Tensor<B, 2, Bool>>,
) -> Positions<B> {
    let [b, t] = valid.dims();
    let device = valid.device();
    let past_len = past.as_ref().map(|p| p.dims()[1]).unwrap_or(0);
    let all = match past {
        Some(p) => Tensor::cat(vec![p, valid.clone()], 1),
        None => valid.clone(),
    };
    let s = all.dims()[1];
    let counts = all.clone().int().cumsum(1);
    // Position of token j = real tokens before j, i.e. cumsum - 1 on real tokens.
    let positions = (counts.narrow(1, past_len, t) - 1).clamp_min(0);
    let positions = positions.mask_fill(valid.clone().bool_not(), 0);
    // tril_mask(o) is true where k > q + o: the future of query q at absolute index past_len + q.
    let tri = |o: i64| Tensor::<B, 2, Bool>::tril_mask([t, s], o, &device).reshape([1, 1, t, s]);
    let future = tri(past_len as i64);
    let diag = tri(past_len as i64 - 1)
        .bool_and(future.clone().bool_not())
        .expand([b, 1, t, s]);
    let key_pad = all.bool_not().reshape([b, 1, 1, s]).expand([b, 1, t, s]);
    let mask = future
        .expand([b, 1, t, s])
        .bool_or(key_pad)
        .bool_and(diag.bool_not());
    Positions { positions, mask }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, TensorData};

    type B = NdArray<f32>;

    /// Regrouped queries read the shared keys exactly as the expanded keys do: the same
    /// output for decode steps and multi-token continuations, padding and causality included.
    #[test]
    fn regrouped_queries_attend_as_expanded_keys_do() {
        let device = Default::default();
        let (b, h, kvh, d) = (3, 6, 2, 8);
        for (t, past) in [(1, 11), (4, 7), (5, 0)] {
            let s = past + t;
            let q = Tensor::<B, 4>::random([b, h, t, d], Distribution::Normal(0.0, 1.0), &device);
            let k = Tensor::<B, 4>::random([b, kvh, s, d], Distribution::Normal(0.0, 1.0), &device);
            let v = Tensor::<B, 4>::random([b, kvh, s, d], Distribution::Normal(0.0, 1.0), &device);
            // Row r has r padding slots on the left of its past, then real tokens.
            let flags: Vec<bool> = (0..b)
                .flat_map(|r| {
                    (0..past)
                        .map(move |j| j >= r)
                        .chain(std::iter::repeat_n(true, t))
                })
                .collect();
            let all = Tensor::<B, 2, Bool>::from_data(TensorData::new(flags, [b, s]), &device);
            let valid = all.clone().narrow(1, past, t);
            let past = (past > 0).then(|| all.narrow(1, 0, past));
            let mask = positions_and_mask(valid, past).mask;
            let want =
                grouped_query_attention_as(q.clone(), k.clone(), v.clone(), &mask, kvh, false);
            let got = grouped_query_attention_as(q, k, v, &mask, kvh, true);
            assert_eq!(got.dims(), [b, h, t, d]);
            let diff = (got - want).abs().max().into_scalar();
            assert!(diff < 1e-5, "t {t}: regrouped differs by {diff}");
        }
    }

    /// Queries taken a block at a time give the whole attention and its gradients: grouped
    /// and ungrouped heads, blocks that regroup and blocks that expand, a last block shorter
    /// than the others, left padding and causality.
    #[test]
    fn attention_in_query_blocks_matches_the_whole() {
        type A = burn::backend::Autodiff<B>;
        let device = Default::default();
        let (b, d, t) = (2, 8, 41);
        for (h, kvh) in [(6, 2), (4, 4)] {
            for block in [3usize, 17, 40] {
                let flags: Vec<bool> = (0..b)
                    .flat_map(|r| (0..t).map(move |j| j >= 3 * r))
                    .collect();
                let valid =
                    Tensor::<A, 2, Bool>::from_data(TensorData::new(flags, [b, t]), &device);
                let mask = positions_and_mask(valid, None).mask;
                let make = |heads| {
                    Tensor::<A, 4>::random(
                        [b, heads, t, d],
                        Distribution::Normal(0.0, 1.0),
                        &device,
                    )
                    .require_grad()
                };
                let (q, k, v) = (make(h), make(kvh), make(kvh));
                let whole = grouped_query_attention_in_blocks(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    &mask,
                    kvh,
                    usize::MAX,
                );
                let blocks = grouped_query_attention_in_blocks(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    &mask,
                    kvh,
                    block * b * h * t,
                );
                let diff = (blocks.clone() - whole.clone()).abs().max().into_scalar();
                assert!(diff < 1e-5, "h {h} block {block}: outputs differ by {diff}");
                // A weighted sum, so that every output element has its own gradient.
                let weights =
                    Tensor::<A, 4>::random([b, h, t, d], Distribution::Normal(0.0, 1.0), &device);
                let g_whole = (whole * weights.clone()).sum().backward();
                let g_blocks = (blocks * weights).sum().backward();
                for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
                    let a = x.grad(&g_whole).expect("a gradient");
                    let c = x.grad(&g_blocks).expect("a gradient");
                    let diff = (a - c).abs().max().into_scalar();
                    assert!(
                        diff < 1e-4,
                        "h {h} block {block}: d{name} differs by {diff}"
                    );
                }
            }
        }
    }
}
