//! Differentiable attention on burn's CUDA backend: products on cuBLAS (or cubecl's kernels),
//! the masked softmax and the scores' gradient as one kernel each (`attention.cu`).
//!
//! The vendored burn-autodiff treats attention as one operation whose backward recomputes
//! the probabilities, but runs both directions as burn primitives on the inner backend. On a
//! Qwen2.5-0.5B training pass (batch 4 x 2048, measured on an H200) the backward's
//! subtractions, divisions and packed copies of `[4, 14, 2048, 2048]` tensors took about
//! 150 ms of a 470 ms profiled pass, because they run beneath the fusion engine's reach.
//! Here each direction is one custom operation of the fusion stream, which on execution
//! runs, per layer:
//!
//!   forward:  S = Q Kᵗ;  P = softmax(S · scale, masked) in place;  O = P V
//!   backward: P as above;  dV = Pᵗ dO;  dP = dO Vᵗ;  dS = P ∘ (dP − rowsum(dO ∘ O)) · scale
//!             in place;  dQ = dS K;  dK = dSᵗ Q
//!
//! so every scores-sized tensor is written once by a product and rewritten once by a kernel.
//!
//! With `CUDA_AGENT_ATTENTION=flash`, bf16 attention of head width 64 or 128 instead runs
//! [`super::flash`]'s kernels (no scores in device memory; key and value heads shared by
//! query heads read in place).

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_autodiff::ops::{register_external_attention, ExternalAttention};
use burn_cubecl::FloatElement;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_ir::{CustomOpIr, OperationIr, TensorIr};
use std::marker::PhantomData;

use super::flash;
use super::module::Source;
use super::stream::{
    enabled, queue, stride, Cube, CudaTensor as Cuda, FusionTensor as Tensor, Handles, Runtime,
};

pub(super) static SOURCE: Source = Source {
    name: "attention.cu",
    code: concat!(include_str!("common.cuh"), include_str!("attention.cu")),
    kernels: &[
        "softmax_rows_f32",
        "softmax_rows_bf16",
        "grad_scores_f32",
        "grad_scores_bf16",
    ],
};

/// Rows per block (a warp each) and threads per block, as `attention.cu` defines them.
const ROWS_PER_BLOCK: u64 = 8;
const THREADS: u32 = 32 * ROWS_PER_BLOCK as u32;

/// Runs every differentiable attention of burn's CUDA backend (f32 and bf16) through these
/// kernels from now on, and returns true; false (nothing registered) when
/// `CUDA_AGENT_ATTENTION=decomposed` asks for burn primitives or the kernels do not compile.
pub fn install() -> bool {
    if !enabled(&SOURCE, "CUDA_AGENT_ATTENTION", "attention") {
        return false;
    }
    register_external_attention::<super::stream::Cuda<f32>>(ExternalAttention {
        forward: forward::<f32>,
        backward: backward::<f32>,
    });
    register_external_attention::<super::stream::Cuda<half::bf16>>(ExternalAttention {
        forward: forward::<half::bf16>,
        backward: backward::<half::bf16>,
    });
    if flash::on() {
        use crate::model::{fused, transformer::GroupedAttention};
        use burn::backend::Autodiff;
        type Cuda<F> = super::stream::Cuda<F>;
        fused::register::<Autodiff<Cuda<f32>>, GroupedAttention>(flash::takes_shape);
        fused::register::<Autodiff<Cuda<half::bf16>>, GroupedAttention>(flash::takes_shape);
    }
    true
}

/// Whether the score kernels take these inputs: f32 or bf16 throughout, as many key and
/// value heads as query heads, rows countable by a grid.
fn supported(q: &Tensor, others: &[&Tensor]) -> bool {
    let dtype_ok =
        matches!(q.dtype, DType::F32 | DType::BF16) && others.iter().all(|t| t.dtype == q.dtype);
    let dims = q.shape.dims::<4>();
    dtype_ok
        && dims[0] * dims[1] * dims[2] <= i32::MAX as usize
        && others
            .iter()
            .all(|t| t.shape.num_dims() == 4 && t.shape.dims::<4>()[1] == dims[1])
}

fn forward<F: FloatElement>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    causal: bool,
) -> Option<Tensor> {
    let flash = flash::takes(q, k, v, mask);
    if !flash && !supported(q, &[k, v]) {
        return None;
    }
    let [b, h, t, _] = q.shape.dims::<4>();
    let dv = v.shape.dims::<4>()[3];
    let client = q.client.clone();
    let out = TensorIr::uninit(
        client.create_empty_handle(),
        Shape::new([b, h, t, dv]),
        q.dtype,
    );
    let mut streams = OperationStreams::with_inputs([q, k, v]);
    let mut inputs = vec![
        q.clone().into_ir(),
        k.clone().into_ir(),
        v.clone().into_ir(),
    ];
    if let Some(mask) = mask {
        streams.tensor(mask);
        inputs.push(mask.clone().into_ir());
    }
    let desc = CustomOpIr::new("cuda_agent_attention_forward", &inputs, &[out]);
    let op = AttentionOp::<F> {
        desc: desc.clone(),
        scale,
        causal,
        backward: false,
        flash,
        _f: PhantomData,
    };
    client
        .register(streams, OperationIr::Custom(desc), op)
        .pop()
}

#[allow(clippy::too_many_arguments)]
fn backward<F: FloatElement>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    causal: bool,
    grad: &Tensor,
) -> Option<(Tensor, Tensor, Tensor)> {
    let flash = flash::takes(q, k, v, mask);
    if !flash && !supported(q, &[k, v, out, grad]) {
        return None;
    }
    let client = q.client.clone();
    let like =
        |t: &Tensor| TensorIr::uninit(client.create_empty_handle(), t.shape.clone(), t.dtype);
    let outputs = [like(q), like(k), like(v)];
    let mut streams = OperationStreams::with_inputs([q, k, v, out, grad]);
    let mut inputs: Vec<TensorIr> = [q, k, v, out, grad]
        .iter()
        .map(|t| (*t).clone().into_ir())
        .collect();
    if let Some(mask) = mask {
        streams.tensor(mask);
        inputs.push(mask.clone().into_ir());
    }
    let desc = CustomOpIr::new("cuda_agent_attention_backward", &inputs, &outputs);
    let op = AttentionOp::<F> {
        desc: desc.clone(),
        scale,
        causal,
        backward: true,
        flash,
        _f: PhantomData,
    };
    let mut grads = client
        .register(streams, OperationIr::Custom(desc), op)
        .into_iter();
    Some((grads.next()?, grads.next()?, grads.next()?))
}

/// One direction of attention as an operation of the fusion stream.
#[derive(Debug)]
struct AttentionOp<F> {
    desc: CustomOpIr,
    scale: f64,
    causal: bool,
    backward: bool,
    /// Through [`flash`]'s kernels rather than the score kernels.
    flash: bool,
    _f: PhantomData<F>,
}

impl<F: FloatElement> Operation<Runtime> for AttentionOp<F> {
    fn execute(&self, handles: &mut Handles) {
        let inputs = &self.desc.inputs;
        let mut float = |i: usize| handles.get_float_tensor::<Cube<F>>(&inputs[i]);
        if !self.backward {
            let (q, k, v) = (float(0), float(1), float(2));
            let mask = inputs.get(3).map(|m| handles.get_bool_tensor::<Cube<F>>(m));
            let out = if self.flash {
                flash::forward(q, k, v, mask.as_ref(), self.scale, self.causal)
            } else {
                forward_cube::<F>(q, k, v, mask.as_ref(), self.scale, self.causal)
            };
            handles.register_float_tensor::<Cube<F>>(&self.desc.outputs[0].id, out);
        } else {
            let (q, k, v, out, grad) = (float(0), float(1), float(2), float(3), float(4));
            let mask = inputs.get(5).map(|m| handles.get_bool_tensor::<Cube<F>>(m));
            let (dq, dk, dv) = if self.flash {
                flash::backward(q, k, v, out, mask.as_ref(), self.scale, self.causal, grad)
            } else {
                backward_cube::<F>(q, k, v, out, mask.as_ref(), self.scale, self.causal, grad)
            };
            for (ir, grad) in self.desc.outputs.iter().zip([dq, dk, dv]) {
                handles.register_float_tensor::<Cube<F>>(&ir.id, grad);
            }
        }
    }
}

fn transposed<F: FloatElement>(t: Cuda) -> Cuda {
    Cube::<F>::float_swap_dims(t, 2, 3)
}

/// Probabilities `[b, h, t, s]` of `q` against `k`.
fn probabilities<F: FloatElement>(
    q: Cuda,
    k: Cuda,
    mask: Option<&Cuda>,
    scale: f64,
    causal: bool,
) -> Cuda {
    let scores = Cube::<F>::float_matmul(q, transposed::<F>(k));
    softmax_in_place(&scores, mask, scale, causal);
    scores
}

fn forward_cube<F: FloatElement>(
    q: Cuda,
    k: Cuda,
    v: Cuda,
    mask: Option<&Cuda>,
    scale: f64,
    causal: bool,
) -> Cuda {
    let probs = probabilities::<F>(q, k, mask, scale, causal);
    Cube::<F>::float_matmul(probs, v)
}

#[allow(clippy::too_many_arguments)]
fn backward_cube<F: FloatElement>(
    q: Cuda,
    k: Cuda,
    v: Cuda,
    out: Cuda,
    mask: Option<&Cuda>,
    scale: f64,
    causal: bool,
    grad: Cuda,
) -> (Cuda, Cuda, Cuda) {
    let probs = probabilities::<F>(q.clone(), k.clone(), mask, scale, causal);
    let dv = Cube::<F>::float_matmul(transposed::<F>(probs.clone()), grad.clone());
    let dp = Cube::<F>::float_matmul(grad.clone(), transposed::<F>(v));
    grad_scores_in_place(&dp, &probs, &grad, &out, scale);
    let dq = Cube::<F>::float_matmul(dp.clone(), k);
    let dk = Cube::<F>::float_matmul(transposed::<F>(dp), q);
    (dq, dk, dv)
}

/// Element strides of `t`'s first `n` dimensions, 0 along dimensions of size 1 (broadcast).
fn strides(t: &Cuda, n: usize) -> Vec<u64> {
    (0..n).map(|d| stride(t, d)).collect()
}

fn dims(t: &Cuda) -> [usize; 4] {
    let s = t.meta.shape();
    [s[0], s[1], s[2], s[3]]
}

/// Kernel number in [`SOURCE`]: the softmax (`grad == false`) or the gradient, by dtype.
fn kernel(t: &Cuda, grad: bool) -> usize {
    let bf16 = usize::from(t.dtype == DType::BF16);
    if grad {
        2 + bf16
    } else {
        bf16
    }
}

fn softmax_in_place(scores: &Cuda, mask: Option<&Cuda>, scale: f64, causal: bool) {
    let [b, h, t, s] = dims(scores);
    assert_eq!(
        scores.meta.strides()[3],
        1,
        "products write their rows contiguously"
    );
    let rows = (b * h * t) as u64;
    let mut scalars = vec![rows, h as u64, t as u64, s as u64];
    scalars.extend(strides(scores, 3));
    let mut buffers = vec![scores.handle.clone().binding()];
    match mask {
        Some(m) => {
            scalars.push(m.dtype.size() as u64);
            scalars.extend(strides(m, 4));
            buffers.push(m.handle.clone().binding());
        }
        None => scalars.extend([0, 0, 0, 0, 0]),
    }
    scalars.extend([u64::from(causal), scale.to_bits()]);
    let nulls = 2 - buffers.len();
    queue(
        &scores.client,
        &SOURCE,
        kernel(scores, false),
        rows.div_ceil(ROWS_PER_BLOCK),
        THREADS,
        buffers,
        nulls,
        &scalars,
    );
}

fn grad_scores_in_place(dp: &Cuda, probs: &Cuda, grad: &Cuda, out: &Cuda, scale: f64) {
    let [b, h, t, s] = dims(dp);
    assert!(
        dp.meta.strides()[3] == 1 && probs.meta.strides()[3] == 1,
        "products write their rows contiguously"
    );
    let dim = dims(grad)[3];
    let rows = (b * h * t) as u64;
    let mut scalars = vec![rows, h as u64, t as u64, s as u64, dim as u64];
    scalars.extend(strides(dp, 3));
    scalars.extend(strides(probs, 3));
    scalars.extend(strides(grad, 4));
    scalars.extend(strides(out, 4));
    scalars.push(scale.to_bits());
    let buffers = [dp, probs, grad, out]
        .map(|t| t.handle.clone().binding())
        .into();
    queue(
        &dp.client,
        &SOURCE,
        kernel(dp, true),
        rows.div_ceil(ROWS_PER_BLOCK),
        THREADS,
        buffers,
        0,
        &scalars,
    );
}
