//! Rotary position embedding (`model::rope::RopeAngles::apply`) on burn's CUDA backend as one
//! kernel (`rope.cu`) per direction: the forward reads the query and key heads where the
//! fused projection left them (a strided view) and writes them rotated, contiguous; the
//! backward applies the transposed rotation to the gradient. Each direction is one custom
//! operation of the fusion stream; on the autodiff backend the pair is one tracked operation
//! whose state is the angles.

use std::marker::PhantomData;
use std::sync::OnceLock;

use burn::tensor::ops::FloatTensor;
use burn::tensor::DType;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::NoCheckpointing;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, FloatElement};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};
use cubecl_cuda::{external, CudaRuntime};

use super::module::{self, Source};
use crate::model::fused;
use crate::model::rope::FusedRope;

type Cube<F> = CubeBackend<CudaRuntime, F, i32, u8>;
type Cuda<F> = Fusion<Cube<F>>;
type Runtime = FusionCubeRuntime<CudaRuntime>;
type Handles = HandleContainer<<Cube<f32> as burn_ir::BackendIr>::Handle>;
type Tensor = FusionTensor<Runtime>;

static SOURCE: Source = Source {
    name: "rope.cu",
    code: concat!(include_str!("common.cuh"), include_str!("rope.cu")),
    kernels: &["rope_f32", "rope_bf16"],
};

const THREADS: u64 = 256;

/// Makes rotary embeddings on burn's CUDA backends (f32 and bf16, with and without autodiff)
/// run this kernel, and returns true; false (nothing registered) when
/// `CUDA_AGENT_ROPE=decomposed` asks for burn operations or the kernel does not compile.
pub fn install() -> bool {
    if std::env::var("CUDA_AGENT_ROPE").as_deref() == Ok("decomposed") {
        return false;
    }
    if let Err(e) = module::check(&SOURCE) {
        tracing::warn!("{e}; rotary embeddings stay decomposed into burn operations");
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
        && xs[3] % 2 == 0
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

type CudaTensor = CubeTensor<CudaRuntime>;

/// Element stride of dimension `d`, 0 along a dimension of size 1.
fn stride(t: &CudaTensor, d: usize) -> u64 {
    if t.meta.shape()[d] == 1 {
        0
    } else {
        t.meta.strides()[d] as u64
    }
}

/// `t` with a unit-stride last dimension.
fn rows_contiguous(t: CudaTensor) -> CudaTensor {
    let n = t.meta.shape().len();
    if t.meta.strides()[n - 1] == 1 {
        t
    } else {
        burn_cubecl::kernel::into_contiguous(t)
    }
}

impl<F: FloatElement> Operation<Runtime> for RopeOp<F> {
    fn execute(&self, handles: &mut Handles) {
        let inputs = &self.desc.inputs;
        let x = rows_contiguous(handles.get_float_tensor::<Cube<F>>(&inputs[0]));
        let cos = rows_contiguous(handles.get_float_tensor::<Cube<F>>(&inputs[1]));
        let sin = rows_contiguous(handles.get_float_tensor::<Cube<F>>(&inputs[2]));
        // The kernel indexes sines with the cosines' strides.
        let sin = if (0..2).all(|d| stride(&sin, d) == stride(&cos, d)) {
            sin
        } else {
            burn_cubecl::kernel::into_contiguous(sin)
        };
        let cos = if (0..2).all(|d| stride(&sin, d) == stride(&cos, d)) {
            cos
        } else {
            burn_cubecl::kernel::into_contiguous(cos)
        };
        let shape = x.meta.shape().clone();
        let [_, t, heads, d] = [shape[0], shape[1], shape[2], shape[3]];
        let pairs = (shape.num_elements() / 2) as u64;
        let y = empty_device_contiguous_dtype(x.client.clone(), x.device.clone(), shape, x.dtype);
        let data = [
            u64::from(x.dtype == DType::BF16),
            pairs.div_ceil(THREADS),
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
        external::launch_external(&x.client, op(), buffers, &data);
        handles.register_float_tensor::<Cube<F>>(&self.desc.outputs[0].id, y);
    }
}

/// The kernel as registered with cubecl.
static OP: OnceLock<external::ExternalOpId> = OnceLock::new();

fn op() -> external::ExternalOpId {
    *OP.get_or_init(|| external::register_external_op(run))
}

/// On cubecl's device thread: `data` is [kernel, blocks, kernel scalars...]; the pointers are
/// the kernel's pointer parameters in order.
fn run(call: external::ExternalCall<'_>) -> Result<(), String> {
    let [kernel, blocks, scalars @ ..] = call.data else {
        return Err("rotary kernel: truncated launch".into());
    };
    let mut args: Vec<u64> = call.pointers.to_vec();
    args.extend_from_slice(scalars);
    module::launch(
        &SOURCE,
        *kernel as usize,
        *blocks as u32,
        THREADS as u32,
        call.stream,
        &args,
    )
}
