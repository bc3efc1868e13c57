//! Matrix products of burn's CUDA backend through cuBLAS.
//!
//! burn 0.21 runs products on cubecl's generated kernels; measured on an H200 they averaged
//! about 100 TFLOP/s over a Qwen2.5-0.5B training pass, where cuBLAS (what PyTorch calls)
//! runs the same shapes several times faster. [`install`] registers [`product`] with the
//! vendored burn-cubecl, which then offers it every product and stops fusing products with
//! their neighbours. The call goes on the stream cubecl allocated the output on, so it is
//! ordered with cubecl's kernels without any host synchronisation.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use burn::tensor::DType;
use burn_cubecl::kernel::{into_contiguous, matmul::register_external_matmul};
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cudarc::cublas::{result as blas, sys};
use cudarc::driver::{result as driver, sys as cuda};

use super::plan::{plan, GemmPlan, Layout};

/// Why cuBLAS could not be set up; products then stay on cubecl's kernels.
#[derive(Debug, thiserror::Error)]
pub enum CublasError {
    /// No cuBLAS library where the dynamic loader looks.
    #[error("libcublas was not found by the dynamic loader (add its directory to LD_LIBRARY_PATH)")]
    NotFound,
    /// Creating a handle failed.
    #[error("cuBLAS handle for CUDA device {device}: {message}")]
    Handle {
        /// CUDA device index.
        device: usize,
        /// cuBLAS's or the driver's message.
        message: String,
    },
}

/// A cuBLAS handle and the primary context it was created in.
struct DeviceBlas {
    handle: sys::cublasHandle_t,
    context: cuda::CUcontext,
}

// SAFETY: the handle is only used under `HANDLES`' lock, one call at a time, after making its
// context current on the calling thread.
unsafe impl Send for DeviceBlas {}

/// One handle per CUDA device index, created on first use.
static HANDLES: Mutex<Vec<(usize, DeviceBlas)>> = Mutex::new(Vec::new());

/// Products cuBLAS ran, and those it left to cubecl by reason (see [`Counts`]).
static RUN: AtomicU64 = AtomicU64::new(0);
static DECLINED_DTYPE: AtomicU64 = AtomicU64::new(0);
static DECLINED_LAYOUT: AtomicU64 = AtomicU64::new(0);
static DECLINED_FAILED: AtomicU64 = AtomicU64::new(0);

/// What happened to the products offered to cuBLAS since start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Products cuBLAS computed.
    pub run: u64,
    /// Left to cubecl: an element type cuBLAS is not given (integers, mixed types).
    pub declined_dtype: u64,
    /// Left to cubecl: operands or output no single strided-batched call can walk.
    pub declined_layout: u64,
    /// Left to cubecl: the call itself failed (warned once per message).
    pub failed: u64,
}

impl Counts {
    /// Every product left to cubecl's kernels.
    pub fn declined(&self) -> u64 {
        self.declined_dtype + self.declined_layout + self.failed
    }
}

/// How many products cuBLAS ran and how many it left to cubecl's kernels, and why, since start.
pub fn counts() -> Counts {
    Counts {
        run: RUN.load(Ordering::Relaxed),
        declined_dtype: DECLINED_DTYPE.load(Ordering::Relaxed),
        declined_layout: DECLINED_LAYOUT.load(Ordering::Relaxed),
        failed: DECLINED_FAILED.load(Ordering::Relaxed),
    }
}

/// How one offered product ended.
enum Outcome {
    Ran,
    Dtype,
    Layout,
    Failed,
}

/// Calls that failed once, so that a broken setup warns once per kind instead of per product.
static WARNED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();

fn warn_once(message: String) {
    let warned = WARNED.get_or_init(Default::default);
    let mut warned = warned.lock().unwrap_or_else(|p| p.into_inner());
    if warned.insert(message.clone()) {
        tracing::warn!("{message}; this product runs on cubecl's kernels instead");
    }
}

fn device_blas(device: usize) -> Result<DeviceBlas, CublasError> {
    let fail = |message: String| CublasError::Handle { device, message };
    // SAFETY: plain driver calls on a device index that cubecl already opened.
    unsafe {
        // cuInit is idempotent; cubecl may not have opened the device yet.
        driver::init().map_err(|e| fail(e.to_string()))?;
        let dev = driver::device::get(device as i32).map_err(|e| fail(e.to_string()))?;
        let context = driver::primary_ctx::retain(dev).map_err(|e| fail(e.to_string()))?;
        driver::ctx::set_current(context).map_err(|e| fail(e.to_string()))?;
        let handle = blas::create_handle().map_err(|e| fail(format!("{e:?}")))?;
        Ok(DeviceBlas { handle, context })
    }
}

/// Registers cuBLAS for every product of burn's CUDA backend. Call once, before the first CUDA
/// tensor exists (the fusion engine reads the registration when a device starts).
pub fn install() -> Result<(), CublasError> {
    // SAFETY: only probes the dynamic loader.
    if !unsafe { sys::is_culib_present() } {
        return Err(CublasError::NotFound);
    }
    let first = device_blas(0)?;
    HANDLES.lock().unwrap_or_else(|p| p.into_inner()).push((0, first));
    register_external_matmul::<CudaRuntime>(product);
    Ok(())
}

fn data_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::F16 => Some(sys::cudaDataType::CUDA_R_16F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

fn layout(t: &CubeTensor<CudaRuntime>) -> Layout<'_> {
    Layout { shape: &t.meta.shape()[..], strides: &t.meta.strides()[..] }
}

/// `out = lhs @ rhs` through cuBLAS; `false` (nothing written) for what it does not handle:
/// other dtypes, quantised tensors, empty products, batches that broadcast unevenly.
pub fn product(lhs: &CubeTensor<CudaRuntime>, rhs: &CubeTensor<CudaRuntime>, out: &CubeTensor<CudaRuntime>) -> bool {
    let outcome = run_product(lhs, rhs, out);
    let counter = match outcome {
        Outcome::Ran => &RUN,
        Outcome::Dtype => &DECLINED_DTYPE,
        Outcome::Layout => &DECLINED_LAYOUT,
        Outcome::Failed => &DECLINED_FAILED,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    matches!(outcome, Outcome::Ran)
}

fn run_product(lhs: &CubeTensor<CudaRuntime>, rhs: &CubeTensor<CudaRuntime>, out: &CubeTensor<CudaRuntime>) -> Outcome {
    let Some(ty) = data_type(out.dtype) else { return Outcome::Dtype };
    if lhs.dtype != out.dtype || rhs.dtype != out.dtype {
        return Outcome::Dtype;
    }
    // A view BLAS cannot walk (heads interleaved with positions, say) is copied once.
    let (mut lhs, mut rhs) = (lhs.clone(), rhs.clone());
    let gemm = match plan(layout(&lhs), layout(&rhs), layout(out)) {
        Some(gemm) => gemm,
        // Contiguous operands that still do not fit: copying changes nothing.
        None if lhs.is_contiguous() && rhs.is_contiguous() => return Outcome::Layout,
        None => {
            if !lhs.is_contiguous() {
                lhs = into_contiguous(lhs);
            }
            if !rhs.is_contiguous() {
                rhs = into_contiguous(rhs);
            }
            match plan(layout(&lhs), layout(&rhs), layout(out)) {
                Some(gemm) => gemm,
                None => return Outcome::Layout,
            }
        }
    };
    match launch(&gemm, ty, &lhs, &rhs, out) {
        Ok(()) => Outcome::Ran,
        Err(message) => {
            warn_once(message);
            Outcome::Failed
        }
    }
}

fn launch(
    gemm: &GemmPlan,
    ty: sys::cudaDataType,
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
    out: &CubeTensor<CudaRuntime>,
) -> Result<(), String> {
    let resource = |t: &CubeTensor<CudaRuntime>| {
        t.client.get_resource(t.handle.clone()).map_err(|e| format!("cubecl resource: {e:?}"))
    };
    // Held until the call is queued: they keep the allocations from being recycled before.
    let (l, r, o) = (resource(lhs)?, resource(rhs)?, resource(out)?);
    let (l, r, o) = (l.resource(), r.resource(), o.resource());
    let device = out.device.index;
    let mut handles = HANDLES.lock().unwrap_or_else(|p| p.into_inner());
    if !handles.iter().any(|(d, _)| *d == device) {
        let blas = device_blas(device).map_err(|e| e.to_string())?;
        handles.push((device, blas));
    }
    let blas = &handles.iter().find(|(d, _)| *d == device).expect("inserted above").1;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let op = |t: bool| if t { sys::cublasOperation_t::CUBLAS_OP_T } else { sys::cublasOperation_t::CUBLAS_OP_N };
    // f32 accumulation for every input type, and no TF32 for f32 inputs (as PyTorch's default).
    let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
    // SAFETY: the pointers are live cubecl allocations of the right sizes (the plan only
    // reads inside each operand's shape and strides and writes inside the output's), the
    // stream is the output's own, and the handle belongs to this device's primary context,
    // made current here.
    unsafe {
        driver::ctx::set_current(blas.context).map_err(|e| format!("cuCtxSetCurrent: {e}"))?;
        blas::set_stream(blas.handle, o.stream as sys::cudaStream_t).map_err(|e| format!("cublasSetStream: {e:?}"))?;
        blas::gemm_strided_batched_ex(
            blas.handle,
            op(gemm.a.transpose),
            op(gemm.b.transpose),
            gemm.m as i32,
            gemm.n as i32,
            gemm.k as i32,
            (&alpha as *const f32).cast(),
            r.ptr as *const std::ffi::c_void,
            ty,
            gemm.a.ld as i32,
            gemm.a.batch_stride as i64,
            l.ptr as *const std::ffi::c_void,
            ty,
            gemm.b.ld as i32,
            gemm.b.batch_stride as i64,
            (&beta as *const f32).cast(),
            o.ptr as *mut std::ffi::c_void,
            ty,
            gemm.ldc as i32,
            gemm.stride_c as i64,
            gemm.batch as i32,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| format!("cublasGemmStridedBatchedEx: {e:?}"))
    }
}
