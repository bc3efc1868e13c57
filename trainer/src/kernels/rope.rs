//! Rotary position embedding (`model::rope::RopeAngles::apply`) on burn's CUDA backend as one
//! kernel (`rope.cu`) per direction: the forward reads the query and key heads where the
//! fused projection left them (a strided view) and writes them rotated, contiguous; the
//! backward applies the transposed rotation to the gradient. Each direction is one custom
//! operation of the fusion stream; on the autodiff backend the pair is one tracked operation
//! whose state is the angles.

use burn::tensor::ops::FloatTensor;
use burn::tensor::DType;
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
use crate::model::rope::FusedRope;

pub(super) static SOURCE: Source = Source {
    name: "rope.cu",
    code: concat!(include_str!("common.cuh"), include_str!("rope.cu")),
    kernels: &["rope_f32", "rope_bf16"],
};

const THREADS: u64 = 256;

/// Makes rotary embeddings on burn's CUDA backends (f32 and bf16, with and without autodiff)
/// run this kernel, and returns true; false (nothing registered) when
/// `CUDA_AGENT_ROPE=decomposed` asks for burn operations or the kernel does not compile.
pub fn install() -> bool {
    if !enabled(&SOURCE, "CUDA_AGENT_ROPE", "rotary embeddings") {
        return false;
    }
    fused::register::<Cuda<f32>, FusedRope<Cuda<f32>>>(|x, c, s| rotate::<f32>(&x, &c, &s, false));
    fused::register::<Cuda<half::bf16>, FusedRope<Cuda<half::bf16>>>(|x, c, s| {
        rotate::<half::bf16>(&x, &c, &s, false)
    });
    fused::register::<Autodiff<Cuda<f32>>, FusedRope<Autodiff<Cuda<f32>>>>(tracked::<f32>);
    fused::register::<Autodiff<Cuda<half::bf16>>, FusedRope<Autodiff<Cuda<half::bf16>>>>(
        tracked::<half::bf16>,
    );
    true
}

/// Whether the kernel takes these inputs: `x` `[b, t, heads, d]` with `d` even, angles
/// `[b, t, d]`, one float dtype, pairs countable by a grid.
fn supported(x: &Tensor, cos: &Tensor, sin: &Tensor) -> bool {
    let xs = x.shape.as_slice();
    xs.len() == 4
        && xs[3].is_multiple_of(2)
        && xs[3] > 0
        && matches!(x.dtype, DType::F32 | DType::BF16)
        && [cos, sin]
            .iter()
            .all(|a| a.dtype == x.dtype && a.shape.as_slice() == [xs[0], xs[1], xs[3]])
        && (x.shape.num_elements() / 2).div_ceil(THREADS as usize) <= u32::MAX as usize
}

/// `x` rotated (`inverse == false`) or rotated back (the gradient), contiguous.
fn rotate<F: FloatElement>(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    inverse: bool,
) -> Option<Tensor> {
    if !supported(x, cos, sin) {
        return None;
    }
    let client = x.client.clone();
    let out = TensorIr::uninit(client.create_empty_handle(), x.shape.clone(), x.dtype);
    let inputs = [x, cos, sin];
    let streams = OperationStreams::with_inputs(inputs);
    let desc = CustomOpIr::new(
        "cuda_agent_rope",
        &inputs.map(|t| t.clone().into_ir()),
        &[out],
    );
    let op = RopeOp::<F> {
        desc: desc.clone(),
        inverse,
        _f: PhantomData,
    };
    client
        .register(streams, OperationIr::Custom(desc), op)
        .pop()
}

/// The tracked operation on the autodiff backend.
fn tracked<F: FloatElement>(
    x: FloatTensor<Autodiff<Cuda<F>>>,
    cos: FloatTensor<Autodiff<Cuda<F>>>,
    sin: FloatTensor<Autodiff<Cuda<F>>>,
) -> Option<FloatTensor<Autodiff<Cuda<F>>>> {
    let y = rotate::<F>(&x.primitive, &cos.primitive, &sin.primitive, false)?;
    let prep = RopeBackward::<F>(PhantomData)
        .prepare::<NoCheckpointing>([x.node.clone()])
        .compute_bound()
        .stateful();
    Some(match prep {
        OpsKind::Tracked(prep) => prep.finish((cos.primitive, sin.primitive), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    })
}

#[derive(Debug)]
struct RopeBackward<F>(PhantomData<F>);

impl<F: FloatElement> Backward<Cuda<F>, 1> for RopeBackward<F> {
    /// Cosines and sines.
    type State = (Tensor, Tensor);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<Cuda<F>>(&ops.node);
        let [parent] = ops.parents;
        if let Some(parent) = parent {
            let (cos, sin) = ops.state;
            #[allow(
                clippy::expect_used,
                reason = "the gradient has the forward's shape and dtype, which `rotate` took"
            )]
            let dx = rotate::<F>(&grad, &cos, &sin, true).expect("the forward's shapes and dtypes");
            grads.register::<Cuda<F>>(parent.id, dx);
        }
    }
}

/// One direction as an operation of the fusion stream.
#[derive(Debug)]
struct RopeOp<F> {
    desc: CustomOpIr,
    inverse: bool,
    _f: PhantomData<F>,
}

impl<F: FloatElement> Operation<Runtime> for RopeOp<F> {
    fn execute(&self, handles: &mut Handles) {
        let inputs = &self.desc.inputs;
        let x = rows_contiguous(handles.get_float_tensor::<Cube<F>>(&inputs[0]));
        let cos = rows_contiguous(handles.get_float_tensor::<Cube<F>>(&inputs[1]));
        let sin = rows_contiguous(handles.get_float_tensor::<Cube<F>>(&inputs[2]));
        // The kernel indexes sines with the cosines' strides: when they differ, both contiguous.
        let (cos, sin) = if (0..2).all(|d| stride(&sin, d) == stride(&cos, d)) {
            (cos, sin)
        } else {
            (
                burn_cubecl::kernel::into_contiguous(cos),
                burn_cubecl::kernel::into_contiguous(sin),
            )
        };
        let shape = x.meta.shape().clone();
        let [_, t, heads, d] = [shape[0], shape[1], shape[2], shape[3]];
        let pairs = (shape.num_elements() / 2) as u64;
        let y = empty_device_contiguous_dtype(x.client.clone(), x.device.clone(), shape, x.dtype);
        let scalars = [
            pairs,
            t as u64,
            heads as u64,
            (d / 2) as u64,
            stride(&x, 0),
            stride(&x, 1),
            stride(&x, 2),
            stride(&cos, 0),
            stride(&cos, 1),
            u64::from(self.inverse),
        ];
        let buffers = [&x, &cos, &sin, &y]
            .map(|t| t.handle.clone().binding())
            .into();
        queue(
            &x.client,
            &SOURCE,
            u64::from(x.dtype == DType::BF16) as usize,
            pairs.div_ceil(THREADS),
            THREADS as u32,
            buffers,
            0,
            &scalars,
        );
        handles.register_float_tensor::<Cube<F>>(&self.desc.outputs[0].id, y);
    }
}
