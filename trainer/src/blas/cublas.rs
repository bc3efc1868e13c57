//! Matrix products of burn's CUDA backend through cuBLAS.
//!
//! burn 0.21 runs products on cubecl's generated kernels; measured on an H200 they averaged
//! about 100 TFLOP/s over a Qwen2.5-0.5B training pass, where cuBLAS (what PyTorch calls)
//! runs the same shapes several times faster. [`install`] registers [`product`] with the
//! vendored burn-cubecl, which then offers it every product and stops fusing products with
//! their neighbours. Each product is queued as an external operation of the vendored
//! cubecl-cuda, like a kernel launch: cuBLAS is called on cubecl's device thread, on the
//! launch's stream, when its turn comes, so it is ordered with cubecl's kernels and the
//! calling thread never waits for the device thread.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use burn::tensor::DType;
use burn_cubecl::kernel::{into_contiguous, matmul::register_external_matmul};
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cudarc::cublas::{result as blas, sys};
use cudarc::driver::{result as driver, sys as cuda};

use cubecl_cuda::external;

use super::plan::{copies_needed, plan, GemmPlan, Layout, PLAN_WORDS};

/// Why cuBLAS could not be set up; products then stay on cubecl's kernels.
#[derive(Debug, thiserror::Error)]
pub enum CublasError {
    /// No cuBLAS library where the dynamic loader looks.
    #[error("libcublas was found neither by the dynamic loader nor in a CUDA toolkit under /usr/local or $CUDA_PATH (add its directory to LD_LIBRARY_PATH)")]
    NotFound,
    /// A driver call made to create the handle failed.
    #[error("CUDA driver, device {device}")]
    Driver {
        /// CUDA device index.
        device: usize,
        /// The driver's error.
        #[source]
        source: driver::DriverError,
    },
    /// cuBLAS could not create a handle.
    #[error("cuBLAS handle for CUDA device {device}")]
    Handle {
        /// CUDA device index.
        device: usize,
        /// cuBLAS's error.
        #[source]
        source: blas::CublasError,
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

/// Products queued for cuBLAS, those it left to cubecl by reason, and calls cuBLAS refused
/// (see [`Counts`]).
static RUN: AtomicU64 = AtomicU64::new(0);
static DECLINED_DTYPE: AtomicU64 = AtomicU64::new(0);
static DECLINED_LAYOUT: AtomicU64 = AtomicU64::new(0);
static DECLINED_FAILED: AtomicU64 = AtomicU64::new(0);
static COPIED: AtomicU64 = AtomicU64::new(0);

/// What happened to the products offered to cuBLAS since start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Products cuBLAS computed (queued, less those that failed so far).
    pub run: u64,
    /// Left to cubecl: an element type cuBLAS is not given (integers, mixed types).
    pub declined_dtype: u64,
    /// Left to cubecl: operands or output no single strided-batched call can walk.
    pub declined_layout: u64,
    /// Operands copied into a contiguous layout first (a view no strided-batched call can
    /// walk, such as heads interleaved with positions); each copy is a kernel of its own.
    pub copied: u64,
    /// Calls cuBLAS refused on the device thread (warned once per message). Those products
    /// were not computed: the stream records the error and the next read reports it.
    pub failed: u64,
}

impl Counts {
    /// Every product left to cubecl's kernels.
    pub fn declined(&self) -> u64 {
        self.declined_dtype + self.declined_layout
    }
}

/// How many products cuBLAS ran and how many it left to cubecl's kernels, and why, since start.
pub fn counts() -> Counts {
    Counts {
        run: RUN.load(Ordering::Relaxed),
        declined_dtype: DECLINED_DTYPE.load(Ordering::Relaxed),
        declined_layout: DECLINED_LAYOUT.load(Ordering::Relaxed),
        failed: DECLINED_FAILED.load(Ordering::Relaxed),
        copied: COPIED.load(Ordering::Relaxed),
    }
}

/// How one offered product ended.
enum Outcome {
    Ran,
    Dtype,
    Layout,
}

/// Messages already warned about, so that a broken setup warns once per kind, not per product.
static WARNED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();

fn warn_once(message: String) {
    let warned = WARNED.get_or_init(Default::default);
    let mut warned = warned.lock().unwrap_or_else(|p| p.into_inner());
    if warned.insert(message.clone()) {
        tracing::warn!("{message}; the stream reports the failed product at its next read");
    }
}

fn device_blas(device: usize) -> Result<DeviceBlas, CublasError> {
    let fail = |source| CublasError::Driver { device, source };
    // SAFETY: plain driver calls on a device index that cubecl already opened.
    unsafe {
        // cuInit is idempotent; cubecl may not have opened the device yet.
        driver::init().map_err(fail)?;
        let dev = driver::device::get(device as i32).map_err(fail)?;
        let context = driver::primary_ctx::retain(dev).map_err(fail)?;
        driver::ctx::set_current(context).map_err(fail)?;
        let handle =
            blas::create_handle().map_err(|source| CublasError::Handle { device, source })?;
        Ok(DeviceBlas { handle, context })
    }
}

/// Where CUDA toolkits keep their libraries, for a machine whose loader does not list them.
fn toolkit_library_dirs() -> Vec<std::path::PathBuf> {
    use std::path::PathBuf;
    let mut dirs = Vec::new();
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        if let Some(root) = std::env::var_os(var) {
            dirs.push(PathBuf::from(&root).join("lib64"));
            dirs.push(PathBuf::from(&root).join("targets/x86_64-linux/lib"));
        }
    }
    let mut versioned: Vec<PathBuf> = std::fs::read_dir("/usr/local")
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("cuda"))
                })
                .collect()
        })
        .unwrap_or_default();
    // `cuda` (the symlink to the current toolkit) first, then the newest versioned one.
    versioned.sort_by_key(|p| std::cmp::Reverse((p.ends_with("cuda"), p.clone())));
    for root in versioned {
        dirs.push(root.join("lib64"));
        dirs.push(root.join("targets/x86_64-linux/lib"));
    }
    dirs
}

/// Loads cuBLAS (and cuBLASLt, which it needs) by full path from a CUDA toolkit directory and
/// keeps them loaded, so that the loader's later lookup by name finds the loaded copy. Returns
/// whether it loaded one.
fn preload_from_toolkit() -> bool {
    let versioned = |dir: &std::path::Path, stem: &str| -> Option<std::path::PathBuf> {
        let mut found: Vec<_> = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix(stem))
                    .is_some_and(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_digit()))
            })
            .collect();
        found.sort();
        found.pop()
    };
    for dir in toolkit_library_dirs() {
        let (Some(lt), Some(blas)) = (
            versioned(&dir, "libcublasLt.so."),
            versioned(&dir, "libcublas.so."),
        ) else {
            continue;
        };
        // SAFETY: loading NVIDIA's libraries runs only their initialisers.
        let loaded = unsafe {
            libloading::Library::new(&lt).and_then(|lt| Ok((lt, libloading::Library::new(&blas)?)))
        };
        match loaded {
            Ok(libraries) => {
                tracing::info!("cuBLAS loaded from {}", dir.display());
                // Kept for the life of the process: cudarc resolves its symbols from it.
                std::mem::forget(libraries);
                return true;
            }
            Err(e) => tracing::debug!("cuBLAS in {} did not load: {e}", dir.display()),
        }
    }
    false
}

/// Registers cuBLAS for every product of burn's CUDA backend. Call once, before the first CUDA
/// tensor exists (the fusion engine reads the registration when a device starts).
pub fn install() -> Result<(), CublasError> {
    // SAFETY: only probes the dynamic loader.
    let present = || unsafe { sys::is_culib_present() };
    // Where the loader does not find it, the toolkit's copy is loaded first, then probed again.
    let found = present() || (preload_from_toolkit() && present());
    if !found {
        return Err(CublasError::NotFound);
    }
    let first = device_blas(0)?;
    HANDLES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((0, first));
    register_external_matmul::<CudaRuntime>(product);
    Ok(())
}

/// Device `device`'s handle from `handles`, created on first use.
fn device_handle(
    handles: &mut Vec<(usize, DeviceBlas)>,
    device: usize,
) -> Result<&DeviceBlas, String> {
    if !handles.iter().any(|(d, _)| *d == device) {
        let blas = device_blas(device).map_err(|e| env_api::error_chain(&e))?;
        handles.push((device, blas));
    }
    handles
        .iter()
        .find(|(d, _)| *d == device)
        .map(|(_, blas)| blas)
        .ok_or_else(|| format!("cuBLAS: no handle for device {device}"))
}

/// cuBLAS's name for reading an operand transposed or not.
fn operation(transposed: bool) -> sys::cublasOperation_t {
    if transposed {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// Whether [`install`] ran and found cuBLAS.
pub fn installed() -> bool {
    !HANDLES.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
}

/// One column-major product `C = alpha · op(A) · op(B) + beta · C` on operands already on the
/// device (addresses), for callers that queue their own work on cubecl's stream.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawGemm {
    /// Whether `A` is read transposed.
    pub transpose_a: bool,
    /// Rows of `op(A)` and of `C`.
    pub m: usize,
    /// Columns of `op(B)` and of `C`.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// `A`'s address and leading dimension.
    pub a: (u64, usize),
    /// `B`'s address and leading dimension (never transposed).
    pub b: (u64, usize),
    /// `C`'s address and leading dimension.
    pub c: (u64, usize),
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of `C`'s old value (1 accumulates into it).
    pub beta: f32,
}

/// Runs `g` on `stream` with every operand of `dtype` (f32 or bf16) and f32 accumulation, on
/// the handle of CUDA device `device` (made current here). For external operations, on
/// cubecl's device thread.
pub(crate) fn raw_gemm(
    device: usize,
    stream: cuda::CUstream,
    dtype: DType,
    g: &RawGemm,
) -> Result<(), String> {
    let ty = data_type(dtype).ok_or_else(|| format!("cuBLAS product: no {dtype:?} products"))?;
    let mut handles = HANDLES.lock().unwrap_or_else(|p| p.into_inner());
    let blas = device_handle(&mut handles, device)?;
    // SAFETY: the caller passes live device allocations large enough for the shapes and
    // leading dimensions given, and the stream cubecl queued its launch on; the handle belongs
    // to this device's primary context, made current here.
    unsafe {
        driver::ctx::set_current(blas.context).map_err(|e| format!("cuCtxSetCurrent: {e}"))?;
        blas::set_stream(blas.handle, stream as sys::cudaStream_t)
            .map_err(|e| format!("cublasSetStream: {e:?}"))?;
        blas::gemm_ex(
            blas.handle,
            operation(g.transpose_a),
            operation(false),
            g.m as i32,
            g.n as i32,
            g.k as i32,
            (&g.alpha as *const f32).cast(),
            g.a.0 as *const std::ffi::c_void,
            ty,
            g.a.1 as i32,
            g.b.0 as *const std::ffi::c_void,
            ty,
            g.b.1 as i32,
            (&g.beta as *const f32).cast(),
            g.c.0 as *mut std::ffi::c_void,
            ty,
            g.c.1 as i32,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| format!("cublasGemmEx: {e:?}"))
    }
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
    Layout {
        shape: &t.meta.shape()[..],
        strides: &t.meta.strides()[..],
    }
}

/// `out = lhs @ rhs` through cuBLAS; `false` (nothing written) for what it does not handle:
/// other dtypes, quantised tensors, empty products, batches that broadcast unevenly.
pub fn product(
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
    out: &CubeTensor<CudaRuntime>,
) -> bool {
    let outcome = run_product(lhs, rhs, out);
    let counter = match outcome {
        Outcome::Ran => &RUN,
        Outcome::Dtype => &DECLINED_DTYPE,
        Outcome::Layout => &DECLINED_LAYOUT,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    matches!(outcome, Outcome::Ran)
}

/// Logs (at debug level, once per layout) the operands of a product that is copied first,
/// so that the views that cost a copy can be found.
fn log_copy(
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
    out: &CubeTensor<CudaRuntime>,
) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    let describe = |t: &CubeTensor<CudaRuntime>| {
        format!(
            "{:?} strides {:?}",
            &t.meta.shape()[..],
            &t.meta.strides()[..]
        )
    };
    let key = format!(
        "lhs {}, rhs {}, out {}",
        describe(lhs),
        describe(rhs),
        describe(out)
    );
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if seen.insert(key.clone()) {
        tracing::debug!("product operands copied before cuBLAS: {key}");
    }
}

fn run_product(
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
    out: &CubeTensor<CudaRuntime>,
) -> Outcome {
    let Some(ty) = data_type(out.dtype) else {
        return Outcome::Dtype;
    };
    if lhs.dtype != out.dtype || rhs.dtype != out.dtype {
        return Outcome::Dtype;
    }
    // A view BLAS cannot walk (heads interleaved with positions, say) is copied once; only
    // that operand, never a walkable one beside it (a transposed `[.., 2048, 2048]`).
    let (mut lhs, mut rhs) = (lhs.clone(), rhs.clone());
    let gemm = match plan(layout(&lhs), layout(&rhs), layout(out)) {
        Some(gemm) => gemm,
        None => {
            let Some((copy_lhs, copy_rhs)) = copies_needed(layout(&lhs), layout(&rhs), layout(out))
            else {
                return Outcome::Layout;
            };
            log_copy(&lhs, &rhs, out);
            if copy_lhs {
                lhs = into_contiguous(lhs);
                COPIED.fetch_add(1, Ordering::Relaxed);
            }
            if copy_rhs {
                rhs = into_contiguous(rhs);
                COPIED.fetch_add(1, Ordering::Relaxed);
            }
            match plan(layout(&lhs), layout(&rhs), layout(out)) {
                Some(gemm) => gemm,
                None => return Outcome::Layout,
            }
        }
    };
    launch(&gemm, ty, &lhs, &rhs, out);
    Outcome::Ran
}

/// Queues the product behind every kernel launched before it; cuBLAS is called on cubecl's
/// device thread when its turn comes (see [`queued_gemm`]).
fn launch(
    gemm: &GemmPlan,
    ty: sys::cudaDataType,
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
    out: &CubeTensor<CudaRuntime>,
) {
    let op = *GEMM_OP.get_or_init(|| external::register_external_op(queued_gemm));
    let mut words = [0u64; PLAN_WORDS + 2];
    words[..PLAN_WORDS].copy_from_slice(&gemm.to_words());
    words[PLAN_WORDS] = ty as u64;
    words[PLAN_WORDS + 1] = out.device.index as u64;
    let buffers = [lhs, rhs, out].map(|t| t.handle.clone().binding()).into();
    external::launch_external(&out.client, op, buffers, &words);
}

/// [`queued_gemm`] as registered with cubecl.
static GEMM_OP: OnceLock<external::ExternalOpId> = OnceLock::new();

fn data_type_from_word(word: u64) -> Option<sys::cudaDataType> {
    [
        sys::cudaDataType::CUDA_R_32F,
        sys::cudaDataType::CUDA_R_16F,
        sys::cudaDataType::CUDA_R_16BF,
    ]
    .into_iter()
    .find(|ty| *ty as u64 == word)
}

/// The cuBLAS call, on cubecl's device thread with the operands' addresses (`lhs`, `rhs`,
/// `out`) and the plan, element type and device index that [`launch`] packed.
fn queued_gemm(call: external::ExternalCall<'_>) -> Result<(), String> {
    let result = call_gemm(&call);
    if let Err(message) = &result {
        DECLINED_FAILED.fetch_add(1, Ordering::Relaxed);
        RUN.fetch_sub(1, Ordering::Relaxed);
        warn_once(message.clone());
    }
    result
}

fn call_gemm(call: &external::ExternalCall<'_>) -> Result<(), String> {
    let gemm = GemmPlan::from_words(call.data).ok_or("cuBLAS product: truncated plan")?;
    let ty = call
        .data
        .get(PLAN_WORDS)
        .copied()
        .and_then(data_type_from_word)
        .ok_or("cuBLAS product: no element type")?;
    let device = call
        .data
        .get(PLAN_WORDS + 1)
        .copied()
        .ok_or("cuBLAS product: no device")? as usize;
    let &[l, r, o] = call.pointers else {
        return Err("cuBLAS product: expected three buffers".into());
    };
    let mut handles = HANDLES.lock().unwrap_or_else(|p| p.into_inner());
    let blas = device_handle(&mut handles, device)?;
    let (alpha, beta) = (1.0f32, 0.0f32);
    // f32 accumulation for every input type, and no TF32 for f32 inputs (as PyTorch's default).
    let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
    let bytes = if ty == sys::cudaDataType::CUDA_R_32F {
        4
    } else {
        2
    };
    // SAFETY: the pointers are live cubecl allocations of the right sizes (the plan only
    // reads inside each operand's shape and strides and writes inside the output's, each
    // outer call at its own offsets), the stream is the one cubecl queued this launch on, and
    // the handle belongs to this device's primary context, made current here.
    unsafe {
        driver::ctx::set_current(blas.context).map_err(|e| format!("cuCtxSetCurrent: {e}"))?;
        blas::set_stream(blas.handle, call.stream as sys::cudaStream_t)
            .map_err(|e| format!("cublasSetStream: {e:?}"))?;
        for outer in 0..gemm.outer as u64 {
            let [ra, lb, oc] = gemm.outer_strides.map(|s| outer * s as u64 * bytes);
            blas::gemm_strided_batched_ex(
                blas.handle,
                operation(gemm.a.transpose),
                operation(gemm.b.transpose),
                gemm.m as i32,
                gemm.n as i32,
                gemm.k as i32,
                (&alpha as *const f32).cast(),
                (r + ra) as *const std::ffi::c_void,
                ty,
                gemm.a.ld as i32,
                gemm.a.batch_stride as i64,
                (l + lb) as *const std::ffi::c_void,
                ty,
                gemm.b.ld as i32,
                gemm.b.batch_stride as i64,
                (&beta as *const f32).cast(),
                (o + oc) as *mut std::ffi::c_void,
                ty,
                gemm.ldc as i32,
                gemm.stride_c as i64,
                gemm.batch as i32,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(|e| format!("cublasGemmStridedBatchedEx: {e:?}"))?;
        }
        Ok(())
    }
}
