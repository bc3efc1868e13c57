//! How the kernels join burn's CUDA backend: the backend's types, the operands' layouts as
//! the kernels take them, and a launch queued on cubecl's stream as an external operation
//! (run on cubecl's device thread in order with its own kernels, the caller not waiting).

use std::sync::OnceLock;

use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use burn_fusion::Fusion;
use burn_ir::HandleContainer;
use cubecl_cuda::{external, CudaRuntime};
use cubecl_runtime::server::Binding;
use env_api::ErrorChain;

use super::module::{self, Source};

/// burn's CUDA backend without fusion, element type `F`: what an operation executes on.
pub(crate) type Cube<F> = CubeBackend<CudaRuntime, F, i32, u8>;
/// burn's CUDA backend (`burn::backend::Cuda<F>`).
pub(crate) type Cuda<F> = Fusion<Cube<F>>;
/// The fusion runtime of [`Cuda`].
pub(crate) type Runtime = FusionCubeRuntime<CudaRuntime>;
/// The tensors an operation of the fusion stream reads and registers.
pub(crate) type Handles = HandleContainer<<Cube<f32> as burn_ir::BackendIr>::Handle>;
/// A tensor of [`Cuda`].
pub(crate) type FusionTensor = burn_fusion::FusionTensor<Runtime>;
/// A tensor as an operation executes on it.
pub(crate) type CudaTensor = CubeTensor<CudaRuntime>;

/// Element stride of dimension `d`, 0 along a dimension of size 1 (which the kernels read as
/// a broadcast).
pub(crate) fn stride(t: &CudaTensor, d: usize) -> u64 {
    if t.meta.shape()[d] == 1 {
        0
    } else {
        t.meta.strides()[d] as u64
    }
}

/// `t` with a unit-stride last dimension, copied only when it has none: the kernels walk
/// rows element by element and take any other stride as a parameter.
pub(crate) fn rows_contiguous(t: CudaTensor) -> CudaTensor {
    let n = t.meta.shape().len();
    if t.meta.strides()[n - 1] == 1 || t.meta.shape()[n - 1] == 1 {
        t
    } else {
        burn_cubecl::kernel::into_contiguous(t)
    }
}

/// Whether `source`'s kernels may run: `env` (say `CUDA_AGENT_NORM`) is not `decomposed`,
/// and the source compiles for the first device; one that does not compile is reported, with
/// `what` (say `RMSNorm`) named as falling back to burn operations.
pub(crate) fn enabled(source: &Source, env: &str, what: &str) -> bool {
    if std::env::var(env).as_deref() == Ok("decomposed") {
        return false;
    }
    match module::check(source) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!("{}; {what}: burn operations instead", ErrorChain(&e));
            false
        }
    }
}

/// Every source launched through [`queue`], by number (the number travels with the launch).
fn sources() -> [&'static Source; 7] {
    [
        &super::attention::SOURCE,
        &super::flash::SOURCE,
        &super::vocab::SOURCE,
        &super::norm::SOURCE,
        &super::rope::SOURCE,
        &super::swiglu::SOURCE,
        &super::sample::SOURCE,
    ]
}

/// Queues kernel number `kernel` of `source` on `client`'s stream, `blocks` blocks of
/// `threads` threads. Its parameters are the device addresses of `buffers`, then `nulls`
/// null pointers (absent optional operands), then `scalars` (each 8 bytes).
#[allow(clippy::too_many_arguments)]
pub(crate) fn queue(
    client: &cubecl_runtime::client::ComputeClient<CudaRuntime>,
    source: &'static Source,
    kernel: usize,
    blocks: u64,
    threads: u32,
    buffers: Vec<Binding>,
    nulls: usize,
    scalars: &[u64],
) {
    queue_shared(
        client, source, kernel, blocks, threads, 0, buffers, nulls, scalars,
    )
}

/// [`queue`] with `shared` bytes of dynamic shared memory per block.
#[allow(clippy::too_many_arguments)]
pub(crate) fn queue_shared(
    client: &cubecl_runtime::client::ComputeClient<CudaRuntime>,
    source: &'static Source,
    kernel: usize,
    blocks: u64,
    threads: u32,
    shared: u32,
    buffers: Vec<Binding>,
    nulls: usize,
    scalars: &[u64],
) {
    #[allow(
        clippy::expect_used,
        reason = "every source this module queues is in `sources`, a fixed list beside it"
    )]
    let number = sources()
        .iter()
        .position(|s| std::ptr::eq(*s, source))
        .expect("every source is listed in `sources`");
    let mut data = vec![
        number as u64,
        kernel as u64,
        blocks,
        u64::from(threads),
        u64::from(shared),
        (buffers.len() + nulls) as u64,
    ];
    data.extend_from_slice(scalars);
    external::launch_external(client, op(), buffers, &data);
}

/// The launches as registered with cubecl.
static OP: OnceLock<external::ExternalOpId> = OnceLock::new();

fn op() -> external::ExternalOpId {
    *OP.get_or_init(|| external::register_external_op(run))
}

/// On cubecl's device thread: `data` is [source, kernel, blocks, threads, shared bytes,
/// pointer count, scalars...]; pointers beyond the buffers resolved are passed as null.
fn run(call: external::ExternalCall<'_>) -> Result<(), String> {
    let [source, kernel, blocks, threads, shared, pointers, scalars @ ..] = call.data else {
        return Err("trainer kernel: truncated launch".into());
    };
    let source = *sources()
        .get(*source as usize)
        .ok_or("trainer kernel: unknown source")?;
    let blocks = u32::try_from(*blocks)
        .map_err(|_| format!("{}: {blocks} blocks do not fit a grid", source.name))?;
    let mut args: Vec<u64> = call.pointers.to_vec();
    args.resize(*pointers as usize, 0);
    args.extend_from_slice(scalars);
    // cubecl's external operations report failures as text.
    module::launch_shared(
        source,
        *kernel as usize,
        blocks,
        *threads as u32,
        *shared as u32,
        call.stream,
        &args,
    )
    .map_err(|e| ErrorChain(&e).to_string())
}
