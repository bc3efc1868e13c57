//! Rotary position embeddings in Hugging Face's (non-interleaved, `rotate_half`) layout.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Int, Tensor, TensorData, TensorPrimitive};

use super::config::{ModelConfig, RopeScaling};

/// Inverse frequencies of each rotary pair, after the checkpoint's scaling.
pub fn inverse_frequencies(cfg: &ModelConfig) -> Vec<f64> {
    let half = cfg.head_dim / 2;
    let base: Vec<f64> = (0..half)
        .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / cfg.head_dim as f64))
        .collect();
    match &cfg.rope_scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let old = *original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// Precomputed cos/sin tables, `[max_positions, head_dim]` each.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    len: usize,
}

impl<B: Backend> RopeTables<B> {
    /// Builds tables for positions `0..max_positions`, computed in f64 and then cast.
    pub fn new(cfg: &ModelConfig, max_positions: usize, device: &B::Device) -> Self {
        let inv = inverse_frequencies(cfg);
        let d = cfg.head_dim;
        let mut cos = Vec::with_capacity(max_positions * d);
        let mut sin = Vec::with_capacity(max_positions * d);
        for p in 0..max_positions {
            // Both halves of a head share the frequencies (rotate_half layout).
            for _half in 0..2 {
                for f in &inv {
                    let a = p as f64 * f;
                    cos.push(a.cos() as f32);
                    sin.push(a.sin() as f32);
                }
            }
        }
        let shape = [max_positions, d];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
            len: max_positions,
        }
    }

    /// The tables in `dtype` (a model whose element type is not its device's default, such
    /// as a bf16 model on a device first used in f32, reads them in its own).
    pub fn cast(self, dtype: burn::tensor::DType) -> Self {
        Self {
            cos: self.cos.cast(dtype),
            sin: self.sin.cast(dtype),
            len: self.len,
        }
    }

    /// The cosine and sine tables `[positions, head_dim]`, for kernels that look positions up
    /// themselves.
    pub fn tables(&self) -> (&Tensor<B, 2>, &Tensor<B, 2>) {
        (&self.cos, &self.sin)
    }

    /// Positions the tables cover.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tables are empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The cos/sin rows of per-token `positions` `[batch, seq]`, ready for [`RopeAngles::apply`].
    pub fn angles(&self, positions: &Tensor<B, 2, Int>) -> RopeAngles<B> {
        let [b, t] = positions.dims();
        let d = self.cos.dims()[1];
        let flat = positions.clone().reshape([b * t]);
        RopeAngles {
            cos: self
                .cos
                .clone()
                .select(0, flat.clone())
                .reshape([b, t, 1, d]),
            sin: self.sin.clone().select(0, flat).reshape([b, t, 1, d]),
        }
    }
}

/// The rotation of one batch of tokens, shared by every layer of a forward pass.
#[derive(Debug, Clone)]
pub struct RopeAngles<B: Backend> {
    /// `[batch, seq, 1, head_dim]`.
    cos: Tensor<B, 4>,
    /// `[batch, seq, 1, head_dim]`.
    sin: Tensor<B, 4>,
}

/// A fused [`RopeAngles::apply`] for backend `B` (registered with [`super::fused`]): `x`
/// `[batch, seq, heads, head_dim]` and the angles' cosines and sines `[batch, seq, head_dim]`
/// to the rotated `x`, or `None` to decline. Differentiable in `x` on autodiff backends (the
/// angles are constants).
pub type FusedRope<B> =
    fn(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) -> Option<FloatTensor<B>>;

impl<B: burn::tensor::backend::AutodiffBackend> RopeAngles<B> {
    /// The same angles on the backend without autodiff (they are constants).
    pub fn inner(&self) -> RopeAngles<B::InnerBackend> {
        RopeAngles {
            cos: self.cos.clone().inner(),
            sin: self.sin.clone().inner(),
        }
    }
}

impl<B: Backend> RopeAngles<B> {
    /// Rotates `x` `[batch, seq, heads, head_dim]` (every head by its token's angles).
    pub fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        if let Some(fused) = super::fused::get::<B, FusedRope<B>>() {
            let [b, t, _, d] = x.dims();
            let angles = |a: &Tensor<B, 4>| a.clone().reshape([b, t, d]).into_primitive().tensor();
            if let Some(y) = fused(
                x.clone().into_primitive().tensor(),
                angles(&self.cos),
                angles(&self.sin),
            ) {
                return Tensor::from_primitive(TensorPrimitive::Float(y));
            }
        }
        self.apply_decomposed(x)
    }

    /// [`Self::apply`] as burn operations, whatever is registered.
    pub fn apply_decomposed(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let d = x.dims()[3];
        let x1 = x.clone().narrow(3, 0, d / 2);
        let x2 = x.clone().narrow(3, d / 2, d / 2);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        x * self.cos.clone() + rotated * self.sin.clone()
    }
}
