//! The SwiGLU gate (`model::transformer::Mlp`) on burn's CUDA backend as one kernel per
//! direction (`swiglu.cu`): the forward reads the fused gate-and-up projection once and writes
//! `silu(gate) · up`; the backward writes the gradient of both halves into one tensor, where
//! the composition of burn operations zero-filled and slice-assigned each half and added them.
//! Each direction is one custom operation of the fusion stream; on the autodiff backend the
//! pair is one tracked operation whose state is the projection.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::NoCheckpointing;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::FloatElement;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_ir::{CustomOpIr, OperationIr, TensorIr};
use std::marker::PhantomData;

use super::module::Source;
use super::stream::{
    enabled, queue, rows_contiguous, stride, Cube, Cuda, FusionTensor as Tensor, Handles, Runtime,
};
use crate::model::fused;
use crate::model::transformer::FusedSwiGlu;

pub(super) static SOURCE: Source = Source {
    name: "swiglu.cu",
    code: concat!(include_str!("common.cuh"), include_str!("swiglu.cu")),
    kernels: &[
        "swiglu_f32",
        "swiglu_bf16",
        "swiglu_grad_f32",
        "swiglu_grad_bf16",
    ],
};

const THREADS: u64 = 256;

/// Makes the SwiGLU gate on burn's CUDA backends (f32 and bf16, with and without autodiff)
/// run these kernels, and returns true; false (nothing registered) when
/// `CUDA_AGENT_SWIGLU=decomposed` asks for burn operations or the kernels do not compile.
pub fn install() -> bool {
    if !enabled(&SOURCE, "CUDA_AGENT_SWIGLU", "the SwiGLU gate") {
        return false;
    }
    fused::register::<Cuda<f32>, FusedSwiGlu<Cuda<f32>>>(|gu| gate::<f32>(&gu));
    fused::register::<Cuda<half::bf16>, FusedSwiGlu<Cuda<half::bf16>>>(|gu| {
        gate::<half::bf16>(&gu)
    });
    fused::register::<Autodiff<Cuda<f32>>, FusedSwiGlu<Autodiff<Cuda<f32>>>>(tracked::<f32>);
    fused::register::<Autodiff<Cuda<half::bf16>>, FusedSwiGlu<Autodiff<Cuda<half::bf16>>>>(
        tracked::<half::bf16>,
    );
    true
}

/// Whether the kernels take this input: f32 or bf16 `[rows, 2n]`, elements countable by a grid.
fn supported(gu: &Tensor) -> bool {
    let s = gu.shape.as_slice();
    s.len() == 2
        && s[1].is_multiple_of(2)
        && s[1] > 0
        && matches!(gu.dtype, DType::F32 | DType::BF16)
        && (s[0] * s[1] / 2).div_ceil(THREADS as usize) <= u32::MAX as usize
}

fn gate<F: FloatElement>(gu: &Tensor) -> Option<Tensor> {
    if !supported(gu) {
        return None;
    }
    let client = gu.client.clone();
    let out = TensorIr::uninit(
        client.create_empty_handle(),
        Shape::new([gu.shape[0], gu.shape[1] / 2]),
        gu.dtype,
    );
    let streams = OperationStreams::with_inputs([gu]);
    let desc = CustomOpIr::new("cuda_agent_swiglu", &[gu.clone().into_ir()], &[out]);
    let op = GateOp::<F> {
        desc: desc.clone(),
        _f: PhantomData,
    };
    client
        .register(streams, OperationIr::Custom(desc), op)
        .pop()
}

fn gate_backward<F: FloatElement>(gu: &Tensor, grad: &Tensor) -> Tensor {
    let client = gu.client.clone();
    let out = TensorIr::uninit(client.create_empty_handle(), gu.shape.clone(), gu.dtype);
    let inputs = [gu, grad];
    let streams = OperationStreams::with_inputs(inputs);
    let desc = CustomOpIr::new(
        "cuda_agent_swiglu_backward",
        &inputs.map(|t| t.clone().into_ir()),
        &[out],
    );
    let op = GateOp::<F> {
        desc: desc.clone(),
        _f: PhantomData,
    };
    #[allow(
        clippy::expect_used,
        reason = "the fusion client returns one tensor per output the description names: one"
    )]
    let out = client
        .register(streams, OperationIr::Custom(desc), op)
        .pop()
        .expect("one output registered");
    out
}

/// The tracked operation on the autodiff backend.
fn tracked<F: FloatElement>(
    gu: FloatTensor<Autodiff<Cuda<F>>>,
) -> Option<FloatTensor<Autodiff<Cuda<F>>>> {
    let y = gate::<F>(&gu.primitive)?;
    let prep = GateBackward::<F>(PhantomData)
        .prepare::<NoCheckpointing>([gu.node.clone()])
        .compute_bound()
        .stateful();
    Some(match prep {
        OpsKind::Tracked(prep) => prep.finish(gu.primitive, y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    })
}

#[derive(Debug)]
struct GateBackward<F>(PhantomData<F>);

impl<F: FloatElement> Backward<Cuda<F>, 1> for GateBackward<F> {
    /// The gate-and-up projection.
    type State = Tensor;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<Cuda<F>>(&ops.node);
        let [parent] = ops.parents;
        if let Some(parent) = parent {
            grads.register::<Cuda<F>>(parent.id, gate_backward::<F>(&ops.state, &grad));
        }
    }
}

/// One direction as an operation of the fusion stream: the forward when it has one input,
/// the backward (projection, output gradient) when two.
#[derive(Debug)]
struct GateOp<F> {
    desc: CustomOpIr,
    _f: PhantomData<F>,
}

impl<F: FloatElement> Operation<Runtime> for GateOp<F> {
    fn execute(&self, handles: &mut Handles) {
        let inputs = &self.desc.inputs;
        let gu = rows_contiguous(handles.get_float_tensor::<Cube<F>>(&inputs[0]));
        let [rows, n] = [gu.meta.shape()[0], gu.meta.shape()[1] / 2];
        let bf16 = u64::from(gu.dtype == DType::BF16);
        let blocks = ((rows * n) as u64).div_ceil(THREADS);
        let (client, device) = (gu.client.clone(), gu.device.clone());
        if inputs.len() == 1 {
            let y = empty_device_contiguous_dtype(
                client.clone(),
                device,
                Shape::new([rows, n]),
                gu.dtype,
            );
            let scalars = [rows as u64, n as u64, stride(&gu, 0), stride(&y, 0)];
            let buffers = [&gu, &y].map(|t| t.handle.clone().binding()).into();
            queue(
                &client,
                &SOURCE,
                bf16 as usize,
                blocks,
                THREADS as u32,
                buffers,
                0,
                &scalars,
            );
            handles.register_float_tensor::<Cube<F>>(&self.desc.outputs[0].id, y);
        } else {
            let dy = rows_contiguous(handles.get_float_tensor::<Cube<F>>(&inputs[1]));
            let dy = if dy.dtype == gu.dtype {
                dy
            } else {
                burn_cubecl::kernel::cast(dy, gu.dtype)
            };
            let dgu = empty_device_contiguous_dtype(
                client.clone(),
                device,
                Shape::new([rows, 2 * n]),
                gu.dtype,
            );
            let scalars = [
                rows as u64,
                n as u64,
                stride(&gu, 0),
                stride(&dy, 0),
                stride(&dgu, 0),
            ];
            let buffers = [&gu, &dy, &dgu].map(|t| t.handle.clone().binding()).into();
            queue(
                &client,
                &SOURCE,
                (2 + bf16) as usize,
                blocks,
                THREADS as u32,
                buffers,
                0,
                &scalars,
            );
            handles.register_float_tensor::<Cube<F>>(&self.desc.outputs[0].id, dgu);
        }
    }
}
