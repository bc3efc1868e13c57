//! Comparisons shared by the trainer's kernel tests (each test file compiles its own copy).

use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, FloatDType, Tensor};

/// Largest difference relative to the reference's largest magnitude, in f32.
pub fn rel_diff<B: Backend, const D: usize>(a: Tensor<B, D>, reference: Tensor<B, D>) -> f32 {
    let (a, reference) = (a.cast(FloatDType::F32), reference.cast(FloatDType::F32));
    let scale = reference
        .clone()
        .abs()
        .max()
        .into_scalar()
        .elem::<f32>()
        .max(1e-6);
    (a - reference).abs().max().into_scalar().elem::<f32>() / scale
}

/// [`rel_diff`] of each pair.
pub fn rel_diffs<B: Backend, const D: usize, const N: usize>(
    ours: [Tensor<B, D>; N],
    reference: [Tensor<B, D>; N],
) -> [f32; N] {
    let mut out = [0.0; N];
    for (i, (a, r)) in ours.into_iter().zip(reference).enumerate() {
        out[i] = rel_diff(a, r);
    }
    out
}
