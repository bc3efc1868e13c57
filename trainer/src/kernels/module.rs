//! Compiling, loading and launching the kernels of one CUDA C source.

use std::ffi::{c_void, CString, NulError};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as driver, sys as cuda};
use cudarc::nvrtc::result as nvrtc;
use env_api::ErrorChain;

/// Why a source's kernels could not be compiled, loaded or launched.
#[derive(Debug, thiserror::Error)]
pub(crate) enum KernelError {
    /// A driver call failed.
    #[error("{call} failed")]
    Driver {
        /// The call.
        call: String,
        /// The driver's error.
        #[source]
        source: driver::DriverError,
    },
    /// NVRTC failed outside compilation (creating the program, reading its PTX).
    #[error("NVRTC, {name}")]
    Nvrtc {
        /// The source.
        name: &'static str,
        /// NVRTC's error.
        #[source]
        source: nvrtc::NvrtcError,
    },
    /// The source does not compile.
    #[error("NVRTC could not compile {name}:\n{log}")]
    Compile {
        /// The source.
        name: &'static str,
        /// The compiler's log.
        log: String,
        /// NVRTC's error.
        #[source]
        source: nvrtc::NvrtcError,
    },
    /// A source or its name holds a NUL byte.
    #[error("{name} holds a NUL byte")]
    Nul {
        /// The source.
        name: &'static str,
        /// Where.
        #[source]
        source: NulError,
    },
    /// A launch named a kernel the source does not define.
    #[error("{name} has no kernel number {kernel}")]
    NoKernel {
        /// The source.
        name: &'static str,
        /// The number asked for.
        kernel: usize,
    },
    /// Loading failed earlier; the first error is kept for every later launch.
    #[error(transparent)]
    Cached(Arc<KernelError>),
}

fn driver_error(call: impl Into<String>) -> impl FnOnce(driver::DriverError) -> KernelError {
    let call = call.into();
    move |source| KernelError::Driver { call, source }
}

/// A CUDA C source and the kernels it defines.
pub(crate) struct Source {
    /// Name for compiler messages.
    pub name: &'static str,
    /// The code.
    pub code: &'static str,
    /// Kernel names, in the order [`launch`] numbers them.
    pub kernels: &'static [&'static str],
}

/// Loaded functions per (source, device). Modules stay loaded for the life of the process.
struct Loaded(Vec<cuda::CUfunction>);

// SAFETY: CUfunction handles are plain driver handles, valid from any thread of the process.
unsafe impl Send for Loaded {}

/// Per (source name, device): the loaded functions, or why loading failed.
type LoadedTable = Vec<((&'static str, i32), Result<Loaded, Arc<KernelError>>)>;

static LOADED: Mutex<LoadedTable> = Mutex::new(Vec::new());

/// The device's compute capability as NVRTC spells it (`90` for an H200).
fn architecture(device: i32) -> Result<String, KernelError> {
    use cuda::CUdevice_attribute::{
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
    };
    // SAFETY: attribute queries on a device the context belongs to.
    unsafe {
        let dev = driver::device::get(device).map_err(driver_error("cuDeviceGet"))?;
        let major = driver::device::get_attribute(dev, MAJOR)
            .map_err(driver_error("cuDeviceGetAttribute"))?;
        let minor = driver::device::get_attribute(dev, MINOR)
            .map_err(driver_error("cuDeviceGetAttribute"))?;
        Ok(format!("{major}{minor}"))
    }
}

fn compile(source: &Source, device: i32) -> Result<Vec<u8>, KernelError> {
    let nul = |source_error| KernelError::Nul {
        name: source.name,
        source: source_error,
    };
    let nvrtc_error = |e| KernelError::Nvrtc {
        name: source.name,
        source: e,
    };
    let code = CString::new(source.code).map_err(nul)?;
    let name = CString::new(source.name).map_err(nul)?;
    let program = nvrtc::create_program(&code, Some(&name)).map_err(nvrtc_error)?;
    // PTX for the device's own architecture (each NVRTC release drops old ones: CUDA 13's
    // starts at 7.5), which the driver then compiles.
    let arch = format!("--gpu-architecture=compute_{}", architecture(device)?);
    let options = [arch.as_str(), "-default-device"];
    // SAFETY: the program was just created and is destroyed below.
    unsafe {
        let compiled = nvrtc::compile_program(program, &options);
        let result = match compiled {
            Ok(()) => nvrtc::get_ptx(program)
                .map(|ptx| ptx.iter().map(|c| *c as u8).collect::<Vec<u8>>())
                .map_err(nvrtc_error),
            Err(e) => {
                let log = nvrtc::get_program_log(program)
                    .map(|l| l.iter().map(|c| *c as u8 as char).collect::<String>())
                    .unwrap_or_default();
                Err(KernelError::Compile {
                    name: source.name,
                    log,
                    source: e,
                })
            }
        };
        let _ = nvrtc::destroy_program(program);
        result
    }
}

/// PTX per (source, architecture), compiled once.
/// Per (source name, architecture): the PTX.
type PtxTable = Vec<((&'static str, String), Vec<u8>)>;

static PTX: Mutex<PtxTable> = Mutex::new(Vec::new());

fn ptx(source: &Source, device: i32) -> Result<Vec<u8>, KernelError> {
    let key = (source.name, architecture(device)?);
    let mut cache = PTX.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, ptx)) = cache.iter().find(|(k, _)| *k == key) {
        return Ok(ptx.clone());
    }
    let ptx = compile(source, device)?;
    cache.push((key, ptx.clone()));
    Ok(ptx)
}

/// Compiles `source` for the first CUDA device, so that a source that does not compile is
/// found before any work depends on it (NVRTC needs no context).
pub(crate) fn check(source: &Source) -> Result<(), KernelError> {
    // cuInit is idempotent.
    driver::init().map_err(driver_error("cuInit"))?;
    ptx(source, 0).map(|_| ())
}

fn load(source: &Source, device: i32) -> Result<Loaded, KernelError> {
    let mut ptx = ptx(source, device)?;
    if ptx.last() != Some(&0) {
        ptx.push(0);
    }
    // SAFETY: called on cubecl's device thread, whose current context is the device's
    // primary context; the image is NUL-terminated PTX.
    unsafe {
        let module = driver::module::load_data(ptx.as_ptr() as *const c_void)
            .map_err(driver_error("cuModuleLoadData"))?;
        source
            .kernels
            .iter()
            .map(|k| {
                let name = CString::new(*k).map_err(|e| KernelError::Nul {
                    name: source.name,
                    source: e,
                })?;
                driver::module::get_function(module, name)
                    .map_err(driver_error(format!("cuModuleGetFunction {k}")))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Loaded)
    }
}

/// The current device's ordinal (the device thread's context is current).
fn current_device() -> Result<i32, KernelError> {
    let mut device = 0;
    // SAFETY: writes one int.
    unsafe { cuda::cuCtxGetDevice(&mut device) }
        .result()
        .map_err(driver_error("cuCtxGetDevice"))?;
    Ok(device)
}

/// Launches kernel number `kernel` of `source` with `rows` blocks of `threads` threads on
/// `stream`; `args` are the kernel's parameters, each 8 bytes (pointers, `long long`, or a
/// `double`'s bits). Compiles and loads the source on the device's first call.
pub(crate) fn launch(
    source: &'static Source,
    kernel: usize,
    rows: u32,
    threads: u32,
    stream: cuda::CUstream,
    args: &[u64],
) -> Result<(), KernelError> {
    launch_shared(source, kernel, rows, threads, 0, stream, args)
}

/// [`launch`] with `shared` bytes of dynamic shared memory per block (past the 48 KiB a
/// kernel gets unasked, the function is allowed that much first).
pub(crate) fn launch_shared(
    source: &'static Source,
    kernel: usize,
    rows: u32,
    threads: u32,
    shared: u32,
    stream: cuda::CUstream,
    args: &[u64],
) -> Result<(), KernelError> {
    let device = current_device()?;
    let function = {
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        let key = (source.name, device);
        let at = match loaded.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                let module = load(source, device).map_err(Arc::new);
                if let Err(e) = &module {
                    tracing::error!("{}", ErrorChain(e.as_ref()));
                }
                loaded.push((key, module));
                loaded.len() - 1
            }
        };
        let module = loaded[at]
            .1
            .as_ref()
            .map_err(|e| KernelError::Cached(e.clone()))?;
        *module.0.get(kernel).ok_or(KernelError::NoKernel {
            name: source.name,
            kernel,
        })?
    };
    if shared > 48 * 1024 {
        // SAFETY: a function of a loaded module; the attribute takes a byte count.
        unsafe {
            cuda::cuFuncSetAttribute(
                function,
                cuda::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared as i32,
            )
        }
        .result()
        .map_err(driver_error(format!(
            "cuFuncSetAttribute {}",
            source.kernels[kernel]
        )))?;
    }
    let mut values: Vec<u64> = args.to_vec();
    let mut params: Vec<*mut c_void> = values
        .iter_mut()
        .map(|v| v as *mut u64 as *mut c_void)
        .collect();
    // SAFETY: the parameters match the kernel's signature (every one 8 bytes, in order, as
    // the kernel's caller builds them) and point at `values`, alive until the call returns.
    unsafe {
        driver::launch_kernel(
            function,
            (rows, 1, 1),
            (threads, 1, 1),
            shared,
            stream,
            &mut params,
        )
    }
    .map_err(driver_error(format!(
        "cuLaunchKernel {}",
        source.kernels[kernel]
    )))
}
