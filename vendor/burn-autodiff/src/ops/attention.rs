// cuda-agent: this file is not part of upstream burn-autodiff 0.21.0 (see vendor/README.md).
//
// Gradients of `softmax(Q Kᵗ · scale + mask) V` computed from the inputs and the output
// alone. Upstream's autodiff decomposes attention into a dozen tracked operations, so a
// training pass keeps every `[batch, heads, q, k]` intermediate of every layer (scores,
// maxima, exponentials, probabilities) alive until the backward pass, and walks each one's
// backward separately. Here the forward runs the same decomposition untracked on the inner
// backend (where a fusing backend fuses it) and keeps only Q, K, V and the output; the
// backward recomputes the probabilities of one layer at a time, the way flash attention's
// backward does:
//
//   P  = softmax(Q Kᵗ · scale, masked)      dV = Pᵗ dO
//   dP = dO Vᵗ                               D  = rowsum(dO ∘ O)
//   dS = P ∘ (dP − D)                        dQ = dS K · scale,  dK = dSᵗ Q · scale

use burn_backend::ops::AttentionModuleOptions;
use burn_backend::tensor::{BoolTensor, FloatTensor};
use burn_backend::{Backend, TensorMetadata, get_device_settings};
use burn_std::Shape;

/// Attention computed by kernels the application provides for backend `B` (hand-written
/// CUDA kernels, say), tried before the decomposition below. Each returns `None` to leave
/// the work to the decomposition. Both get the scale and causality already resolved.
pub struct ExternalAttention<B: Backend> {
    /// `softmax(Q Kᵗ · scale, masked) V` from `[batch, heads, seq, dim]` query, key, value.
    #[allow(clippy::type_complexity)]
    pub forward: fn(
        &FloatTensor<B>,
        &FloatTensor<B>,
        &FloatTensor<B>,
        Option<&BoolTensor<B>>,
        f64,
        bool,
    ) -> Option<FloatTensor<B>>,
    /// Gradients of query, key and value from query, key, value, the forward output, the
    /// mask, scale, causality and the output's gradient.
    #[allow(clippy::type_complexity)]
    pub backward: fn(
        &FloatTensor<B>,
        &FloatTensor<B>,
        &FloatTensor<B>,
        &FloatTensor<B>,
        Option<&BoolTensor<B>>,
        f64,
        bool,
        &FloatTensor<B>,
    ) -> Option<(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>)>,
}

impl<B: Backend> Clone for ExternalAttention<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for ExternalAttention<B> {}

#[cfg(feature = "std")]
type Registry = std::sync::RwLock<
    alloc::vec::Vec<(
        core::any::TypeId,
        alloc::boxed::Box<dyn core::any::Any + Send + Sync>,
    )>,
>;

#[cfg(feature = "std")]
static REGISTRY: Registry = std::sync::RwLock::new(alloc::vec::Vec::new());

/// Uses `kernels` for every differentiable attention on backend `B` from now on.
#[cfg(feature = "std")]
pub fn register_external_attention<B: Backend>(kernels: ExternalAttention<B>) {
    let id = core::any::TypeId::of::<B>();
    let mut registry = REGISTRY.write().unwrap_or_else(|p| p.into_inner());
    registry.retain(|(known, _)| *known != id);
    registry.push((id, alloc::boxed::Box::new(kernels)));
}

/// The kernels registered for backend `B`, if any.
pub(crate) fn external_attention<B: Backend>() -> Option<ExternalAttention<B>> {
    #[cfg(feature = "std")]
    {
        let id = core::any::TypeId::of::<B>();
        let registry = REGISTRY.read().unwrap_or_else(|p| p.into_inner());
        registry
            .iter()
            .find(|(known, _)| *known == id)
            .and_then(|(_, k)| k.downcast_ref::<ExternalAttention<B>>().copied())
    }
    #[cfg(not(feature = "std"))]
    None
}

/// The forward output through registered kernels, if there are any and they take it.
pub(crate) fn external_forward<B: Backend>(
    query: &FloatTensor<B>,
    key: &FloatTensor<B>,
    value: &FloatTensor<B>,
    mask: Option<&BoolTensor<B>>,
    options: &AttentionModuleOptions,
) -> Option<FloatTensor<B>> {
    let kernels = external_attention::<B>()?;
    let scale = attention_scale(query, options);
    (kernels.forward)(query, key, value, mask, scale, options.is_causal)
}

/// Softmax probabilities of the scores, NaN-safe on fully masked rows exactly as
/// `attention_fallback` computes them (a fully masked row gets zeros).
fn probabilities<B: Backend>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    mask: Option<BoolTensor<B>>,
    scale: f64,
    is_causal: bool,
) -> FloatTensor<B> {
    let scores = B::float_mul_scalar(
        B::float_matmul(query, B::float_transpose(key)),
        scale.into(),
    );
    let scores = match mask {
        Some(mask) => B::float_mask_fill(scores, mask, f32::NEG_INFINITY.into()),
        None => scores,
    };
    let scores = if is_causal {
        let causal = causal_mask::<B>(&scores);
        B::float_mask_fill(scores, causal, f32::NEG_INFINITY.into())
    } else {
        scores
    };
    let finfo = scores.dtype().finfo().expect("float tensor");
    let max = B::float_clamp_min(B::float_max_dim(scores.clone(), 3), finfo.min.into());
    let numerator = B::float_exp(B::float_sub(scores, max));
    let sum = B::float_clamp_min(
        B::float_sum_dim(numerator.clone(), 3),
        finfo.min_positive.into(),
    );
    B::float_div(numerator, sum)
}

/// True above the diagonal aligned at the bottom-right corner (the same convention as
/// `attention_fallback`, so `seq_k > seq_q` continues a cached prefix).
fn causal_mask<B: Backend>(scores: &FloatTensor<B>) -> BoolTensor<B> {
    let device = B::float_device(scores);
    let [batch, heads, seq_q, seq_k] = scores.shape().dims::<4>();
    let settings = get_device_settings::<B>(&device);
    let offset = seq_k as i64 - seq_q as i64;
    let rows = B::int_reshape(
        B::int_arange(0..seq_q as i64, &device, settings.int_dtype),
        Shape::new([seq_q, 1]),
    );
    let cols = B::int_reshape(
        B::int_arange(0..seq_k as i64, &device, settings.int_dtype),
        Shape::new([1, seq_k]),
    );
    let mask = B::int_lower(B::int_add_scalar(rows, offset.into()), cols, settings.bool_dtype);
    let mask = B::bool_reshape(mask, Shape::new([1, 1, seq_q, seq_k]));
    B::bool_expand(mask, Shape::new([batch, heads, seq_q, seq_k]))
}

/// The scale the forward pass used.
fn attention_scale(query: &impl TensorMetadata, options: &AttentionModuleOptions) -> f64 {
    let head_dim = query.shape().dims::<4>()[3];
    options
        .scale
        .unwrap_or_else(|| 1.0 / (head_dim as f64).sqrt())
}

/// Gradients of query, key and value given the output's gradient `grad` (all
/// `[batch, heads, seq, dim]`; `out` is the forward output).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward<B: Backend>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    out: FloatTensor<B>,
    mask: Option<BoolTensor<B>>,
    options: AttentionModuleOptions,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let scale = attention_scale(&query, &options);
    if let Some(kernels) = external_attention::<B>() {
        if let Some(grads) = (kernels.backward)(
            &query,
            &key,
            &value,
            &out,
            mask.as_ref(),
            scale,
            options.is_causal,
            &grad,
        ) {
            return grads;
        }
    }
    let probs = probabilities::<B>(query.clone(), key.clone(), mask, scale, options.is_causal);
    let grad_value = B::float_matmul(B::float_transpose(probs.clone()), grad.clone());
    let grad_probs = B::float_matmul(grad.clone(), B::float_transpose(value));
    // rowsum(dP ∘ P) equals rowsum(dO ∘ O): the second is `[.., q, dim]` wide, not `[.., q, k]`.
    let row = B::float_sum_dim(B::float_mul(grad, out), 3);
    let grad_scores = B::float_mul(probs, B::float_sub(grad_probs, row));
    let grad_scores = B::float_mul_scalar(grad_scores, scale.into());
    let grad_query = B::float_matmul(grad_scores.clone(), key);
    let grad_key = B::float_matmul(B::float_transpose(grad_scores), query);
    (grad_query, grad_key, grad_value)
}
