//! Flash attention (`flash.cu`) for bf16 training passes: the scores never reach device
//! memory. [`super::attention`] runs it, inside its operation of the fusion stream, for every
//! attention it takes ([`takes`]); the rest keep the score-materialising kernels.
//!
//! Per direction, on execution:
//!
//!   both:     each 64 x 64 tile of (query, key) pairs classed from the mask as hidden
//!             (skipped), visible (no mask read) or mixed (one small kernel)
//!   forward:  O (and each row's log-sum-exp, unused by the hook) in one kernel
//!   backward: the log-sum-exp again, D = rowsum(dO ∘ O), dQ's f32 sum zeroed (one kernel);
//!             dK, dV per query head and dQ added atomically (one kernel); dQ, and dK, dV
//!             summed over each key head's query heads, to bf16 (three small launches)
//!
//! The autodiff hook keeps only Q, K, V and O, so the backward recomputes the log-sum-exp
//! (the forward's score products without P V) rather than reading a saved one.

use std::sync::OnceLock;

use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;

use super::module::Source;
use super::stream::{queue, queue_shared, stride, CudaTensor as Cuda, FusionTensor as Tensor};

pub(super) static SOURCE: Source = Source {
    name: "flash.cu",
    code: concat!(include_str!("common.cuh"), include_str!("flash.cu")),
    kernels: &[
        "flash_fwd_64",
        "flash_fwd_128",
        "flash_stats_64",
        "flash_stats_128",
        "flash_bwd_64",
        "flash_bwd_128",
        "flash_finish",
        "flash_classes",
    ],
};

/// Queries per query tile and keys per key tile, threads per block (`flash.cu`).
const TILE: usize = 64;
const THREADS: u32 = 128;
const FINISH_THREADS: u32 = 256;

/// Whether bf16 attention may take the flash kernels: `CUDA_AGENT_ATTENTION=flash` asks for
/// them (off by default while their GPU test fails its ungrouped single-tile dK cases; unset or
/// `kernels` keeps the score-materialising kernels, `decomposed` turns every attention
/// kernel off) and `flash.cu` compiles for the first device. Read once.
pub fn on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if std::env::var("CUDA_AGENT_ATTENTION").as_deref() != Ok("flash") {
            return false;
        }
        super::stream::enabled(&SOURCE, "CUDA_AGENT_ATTENTION", "flash attention")
    })
}

/// Whether the flash kernels take attention of this head width and element type: bf16,
/// head width 64 or 128. What `model::transformer` asks before handing over key and value
/// heads shared by groups of query heads, unexpanded and with no limit on the query count.
pub fn takes_shape(head_dim: usize, dtype: DType) -> bool {
    dtype == DType::BF16 && matches!(head_dim, 64 | 128) && on()
}

/// Whether the flash kernels take these operands: [`takes_shape`], Q `[b, h, t, d]`, K and V
/// `[b, kvh, s, d]` with `kvh` dividing `h`, a mask of `[b, h, t, s]` (booleans of one or
/// four bytes, any strides) or none, and blocks countable by a grid.
pub(super) fn takes(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> bool {
    if [q, k, v].iter().any(|t| t.shape.num_dims() != 4) {
        return false;
    }
    let [b, h, t, d] = q.shape.dims::<4>();
    let [kb, kvh, s, kd] = k.shape.dims::<4>();
    let mask_ok = mask.is_none_or(|m| {
        matches!(m.dtype.size(), 1 | 4)
            && m.shape.num_dims() == 4
            && m.shape.dims::<4>() == [b, h, t, s]
    });
    takes_shape(d, q.dtype)
        && k.dtype == q.dtype
        && v.dtype == q.dtype
        && v.shape.dims::<4>() == [kb, kvh, s, kd]
        && kb == b
        && kd == d
        && kvh > 0
        && h % kvh == 0
        && mask_ok
        && t > 0
        && s > 0
        && b * h * t.div_ceil(TILE).max(s.div_ceil(TILE)) < u32::MAX as usize
}

/// `t` as the kernels read it: unit stride along the head width, other strides and the start
/// on sixteen-byte boundaries (copied into a contiguous tensor otherwise).
fn vector_ready(t: Cuda) -> Cuda {
    let strides = t.meta.strides();
    let aligned = strides[3] == 1
        && strides[..3].iter().all(|s| s % 8 == 0)
        && t.handle.offset_start.unwrap_or(0).is_multiple_of(16);
    if aligned {
        t
    } else {
        burn_cubecl::kernel::into_contiguous(t)
    }
}

/// Contiguous `t` (the kernels index O and dO as `[b, h, t, d]` rows).
fn contiguous(t: Cuda) -> Cuda {
    if t.is_contiguous() && t.handle.offset_start.unwrap_or(0).is_multiple_of(16) {
        t
    } else {
        burn_cubecl::kernel::into_contiguous(t)
    }
}

/// The scalars the attention launches pass after their pointers: shape, strides of Q, K,
/// V and the mask, causality, scale, and the heads of the tile classes.
fn scalars(
    q: &Cuda,
    k: &Cuda,
    v: &Cuda,
    mask: Option<&Cuda>,
    scale: f64,
    causal: bool,
    class_heads: usize,
) -> Vec<u64> {
    let qd = q.meta.shape();
    let kd = k.meta.shape();
    let mut out = vec![qd[1] as u64, kd[1] as u64, qd[2] as u64, kd[2] as u64];
    for t in [q, k, v] {
        out.extend((0..3).map(|d| stride(t, d)));
    }
    out.extend(mask_strides(mask));
    out.extend([u64::from(causal), scale.to_bits(), class_heads as u64]);
    out
}

/// The mask's strides in bytes, as the kernels read it: one byte per element, or the low
/// (first, little-endian) byte of a four-byte boolean, which holds its whole value (0 or 1).
fn mask_strides(mask: Option<&Cuda>) -> [u64; 4] {
    match mask {
        Some(m) => {
            let bytes = m.dtype.size() as u64;
            [0, 1, 2, 3].map(|d| stride(m, d) * bytes)
        }
        None => [0; 4],
    }
}

/// Each 64 x 64 tile's class (`flash.cu`'s `flash_classes`), `[b, class heads, query tiles,
/// key tiles]` bytes, and the class heads: 1 where the mask is the same for every head.
fn classes(q: &Cuda, k: &Cuda, mask: Option<&Cuda>, causal: bool) -> (Cuda, usize) {
    let [b, h, t, _] = dims(q);
    let s = dims(k)[2];
    let heads = match mask {
        Some(m) if stride(m, 1) != 0 => h,
        _ => 1,
    };
    let tiles = [b, heads, t.div_ceil(TILE), s.div_ceil(TILE)];
    let out = empty(q, tiles.to_vec(), DType::U8);
    let mut scalars = vec![heads as u64, t as u64, s as u64];
    scalars.extend(mask_strides(mask));
    scalars.push(u64::from(causal));
    let mut buffers = vec![out.handle.clone().binding()];
    if let Some(m) = mask {
        buffers.push(m.handle.clone().binding());
    }
    let nulls = 2 - buffers.len();
    queue(
        &q.client,
        &SOURCE,
        7,
        tiles.iter().product::<usize>() as u64,
        THREADS,
        buffers,
        nulls,
        &scalars,
    );
    (out, heads)
}

fn empty(like: &Cuda, shape: Vec<usize>, dtype: DType) -> Cuda {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape),
        dtype,
    )
}

/// Kernel number of `first` (the width-64 variant) for head width `d`.
fn variant(first: usize, d: usize) -> usize {
    first + usize::from(d == 128)
}

/// `softmax(Q Kᵗ · scale, masked) V`, `[b, h, t, d]`.
pub(super) fn forward(
    q: Cuda,
    k: Cuda,
    v: Cuda,
    mask: Option<&Cuda>,
    scale: f64,
    causal: bool,
) -> Cuda {
    let (q, k, v) = (vector_ready(q), vector_ready(k), vector_ready(v));
    let [b, h, t, d] = dims(&q);
    let out = empty(&q, vec![b, h, t, d], q.dtype);
    let (classes, class_heads) = classes(&q, &k, mask, causal);
    let mut buffers = vec![
        q.handle.clone().binding(),
        k.handle.clone().binding(),
        v.handle.clone().binding(),
        out.handle.clone().binding(),
        classes.handle.clone().binding(),
    ];
    if let Some(m) = mask {
        buffers.push(m.handle.clone().binding());
    }
    let nulls = 6 - buffers.len();
    queue(
        &q.client,
        &SOURCE,
        variant(0, d),
        (b * h * t.div_ceil(TILE)) as u64,
        THREADS,
        buffers,
        nulls,
        &scalars(&q, &k, &v, mask, scale, causal, class_heads),
    );
    out
}

/// Gradients of Q, K and V (K and V `[b, kvh, s, d]`, summed over each group's query heads).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    q: Cuda,
    k: Cuda,
    v: Cuda,
    out: Cuda,
    mask: Option<&Cuda>,
    scale: f64,
    causal: bool,
    grad: Cuda,
) -> (Cuda, Cuda, Cuda) {
    let (q, k, v) = (vector_ready(q), vector_ready(k), vector_ready(v));
    let (out, grad) = (contiguous(out), contiguous(grad));
    let [b, h, t, d] = dims(&q);
    let [_, kvh, s, _] = dims(&k);
    let lse = empty(&q, vec![b, h, t], DType::F32);
    let delta = empty(&q, vec![b, h, t], DType::F32);
    let dq_acc = empty(&q, vec![b, h, t, d], DType::F32);
    let dk_acc = empty(&q, vec![b, h, s, d], DType::F32);
    let dv_acc = empty(&q, vec![b, h, s, d], DType::F32);
    let (classes, class_heads) = classes(&q, &k, mask, causal);
    let scalars = scalars(&q, &k, &v, mask, scale, causal, class_heads);
    let bind = |ts: &[&Cuda]| -> Vec<_> { ts.iter().map(|t| t.handle.clone().binding()).collect() };

    let mut buffers = bind(&[&q, &k, &v, &out, &grad, &delta, &dq_acc, &lse, &classes]);
    if let Some(m) = mask {
        buffers.push(m.handle.clone().binding());
    }
    let nulls = 10 - buffers.len();
    queue(
        &q.client,
        &SOURCE,
        variant(2, d),
        (b * h * t.div_ceil(TILE)) as u64,
        THREADS,
        buffers,
        nulls,
        &scalars,
    );

    let mut buffers = bind(&[
        &q, &k, &v, &grad, &lse, &delta, &dq_acc, &dk_acc, &dv_acc, &classes,
    ]);
    if let Some(m) = mask {
        buffers.push(m.handle.clone().binding());
    }
    let nulls = 11 - buffers.len();
    // K, V, Q, dO tiles of [64][d + 8] bf16, dSᵀ [64][72] bf16, the mask tile, two rows of
    // statistics (flash.cu's flash_bwd).
    let shared = 4 * TILE * (d + 8) * 2 + TILE * (TILE + 8) * 2 + TILE * TILE + 2 * TILE * 4;
    queue_shared(
        &q.client,
        &SOURCE,
        variant(4, d),
        (b * h * s.div_ceil(TILE)) as u64,
        THREADS,
        shared as u32,
        buffers,
        nulls,
        &scalars,
    );

    let finish = |src: &Cuda, heads: usize, n: usize, groups: usize| {
        let dst = empty(&q, vec![b, heads, n, d], q.dtype);
        let total = b * heads * n * d;
        queue(
            &q.client,
            &SOURCE,
            6,
            total.div_ceil(FINISH_THREADS as usize) as u64,
            FINISH_THREADS,
            bind(&[src, &dst]),
            0,
            &[total as u64, (n * d) as u64, groups as u64],
        );
        dst
    };
    let dq = finish(&dq_acc, h, t, 1);
    let dk = finish(&dk_acc, kvh, s, h / kvh);
    let dv = finish(&dv_acc, kvh, s, h / kvh);
    (dq, dk, dv)
}

fn dims(t: &Cuda) -> [usize; 4] {
    let s = t.meta.shape();
    [s[0], s[1], s[2], s[3]]
}
