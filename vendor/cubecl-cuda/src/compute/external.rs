//! cuda-agent patch: host-side operations queued like kernels.
//!
//! A vendor library call (a cuBLAS product) on cubecl tensors needs the tensors' device
//! addresses and cubecl's stream. Asking the server for them (`ComputeClient::get_resource`)
//! is a blocking round trip to the device thread per tensor, which waits for every launch
//! queued before it: measured on an H200, three of them per product made token-by-token
//! decoding 2x slower. An external operation travels instead as an ordinary launch
//! ([`launch_external`]), non-blocking and in order with cubecl's kernels; when its turn
//! comes on the device thread the server resolves its buffers and calls the registered
//! function with their addresses and the stream, instead of compiling anything.

use crate::{CudaCompiler, CudaRuntime};
use cubecl_common::backtrace::BackTrace;
use cubecl_core::{
    ExecutionMode,
    ir::{ElemType, StorageType, UIntKind},
    prelude::{ComputeClient, CubeCount},
    server::{Binding, KernelArguments, MetadataBindingInfo},
};
use cubecl_runtime::{
    compiler::{CompilationError, Compiler, CubeTask},
    id::KernelId,
    kernel::{CompiledKernel, KernelMetadata},
};
use cudarc::driver::sys::CUstream;
use std::sync::RwLock;

/// What an external operation receives when its turn comes on the device thread.
pub struct ExternalCall<'a> {
    /// The stream the launch runs on: queue the work here to keep cubecl's ordering.
    pub stream: CUstream,
    /// Device addresses of the launch's buffers, in the order given, offsets applied.
    pub pointers: &'a [u64],
    /// The scalars given to [`launch_external`].
    pub data: &'a [u64],
}

/// A host function that queues work on [`ExternalCall::stream`]. An error is recorded on the
/// stream like a failed kernel launch (the next read or sync reports it).
pub type ExternalOp = fn(ExternalCall<'_>) -> Result<(), String>;

/// An operation registered with [`register_external_op`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExternalOpId(u64);

static OPS: RwLock<Vec<ExternalOp>> = RwLock::new(Vec::new());

/// Registers `op` (once; registering the same function again returns the same id).
pub fn register_external_op(op: ExternalOp) -> ExternalOpId {
    let mut ops = OPS.write().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(index) = ops.iter().position(|known| std::ptr::fn_addr_eq(*known, op)) {
        return ExternalOpId(index as u64);
    }
    ops.push(op);
    ExternalOpId(ops.len() as u64 - 1)
}

/// Queues `op` on `client`'s current stream after everything launched before it, with the
/// addresses of `buffers` and `data`. Returns at once.
pub fn launch_external(
    client: &ComputeClient<CudaRuntime>,
    op: ExternalOpId,
    buffers: Vec<Binding>,
    data: &[u64],
) {
    let mut info = Vec::with_capacity(data.len() + 1);
    info.push(op.0);
    info.extend_from_slice(data);
    let arguments = KernelArguments::new()
        .with_buffers(buffers)
        .with_info(MetadataBindingInfo::custom(info));
    client.launch(Box::new(ExternalTask), CubeCount::Static(1, 1, 1), arguments);
}

/// The launch's stand-in kernel: recognised by its id, never compiled.
struct ExternalTask;

impl KernelMetadata for ExternalTask {
    fn id(&self) -> KernelId {
        KernelId::new::<Self>()
    }

    fn address_type(&self) -> StorageType {
        ElemType::UInt(UIntKind::U32).into()
    }
}

impl CubeTask<CudaCompiler> for ExternalTask {
    fn compile(
        &self,
        _compiler: &mut CudaCompiler,
        _compilation_options: &<CudaCompiler as Compiler>::CompilationOptions,
        _mode: ExecutionMode,
        _address_type: StorageType,
    ) -> Result<CompiledKernel<CudaCompiler>, CompilationError> {
        Err(CompilationError::Generic {
            reason: "an external operation is called, not compiled".into(),
            backtrace: BackTrace::capture(),
        })
    }
}

/// Whether `kernel` is an external operation's launch (checked before the server sets the
/// execution mode on its id).
pub(crate) fn is_external(kernel: &dyn CubeTask<CudaCompiler>) -> bool {
    kernel.id() == KernelId::new::<ExternalTask>()
}

/// Calls the operation named by `data[0]`.
pub(crate) fn call(stream: CUstream, pointers: &[u64], data: &[u64]) -> Result<(), String> {
    let (&index, data) = data.split_first().ok_or("external launch without an operation")?;
    let op = {
        let ops = OPS.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        *ops.get(index as usize).ok_or("unregistered external operation")?
    };
    op(ExternalCall { stream, pointers, data })
}
