//! Picking the backend: burn's ndarray on the CPU, or burn's CUDA backend with the trainer's
//! set-up (kernel caches, who runs matrix products, the trainer's own kernels). The CUDA
//! set-up reads `CUDA_AGENT_KERNEL_CACHE`, `CUDA_AGENT_KERNEL_PROFILE`, `CUDA_AGENT_MATMUL`
//! and `CUDA_AGENT_{ATTENTION,VOCAB,NORM,ROPE,SWIGLU}`.

#[cfg(feature = "cuda")]
use std::path::PathBuf;

use anyhow::{bail, Result};
use burn::tensor::backend::AutodiffBackend;

use trainer::memory::DeviceMemory;

use crate::cli::{DeviceKind, Precision};

/// What a job learns about the device it runs on.
pub struct DeviceEnv {
    /// The CUDA set-up's choices (empty on the CPU).
    pub note: String,
    /// The device's memory, where it could be read.
    pub memory: Option<DeviceMemory>,
    /// Reads the device's memory now (for peaks over a run).
    pub read_memory: fn() -> Option<DeviceMemory>,
}

/// Work generic over the backend, run on the one the flags pick.
pub trait Job {
    /// Runs on backend `B`.
    fn run<B: AutodiffBackend>(self, device: B::Device, env: &DeviceEnv) -> Result<()>;
}

/// Runs `job` on `kind` at `precision`.
pub fn run_on(kind: DeviceKind, precision: Precision, job: impl Job) -> Result<()> {
    match (kind, precision) {
        (DeviceKind::Cpu, Precision::F32) => {
            let env = DeviceEnv {
                note: String::new(),
                memory: DeviceMemory::host(),
                read_memory: DeviceMemory::host,
            };
            job.run::<burn::backend::Autodiff<burn::backend::NdArray<f32>>>(
                Default::default(),
                &env,
            )
        }
        (DeviceKind::Cpu, Precision::Bf16) => bail!("--precision bf16 needs --device cuda"),
        (DeviceKind::Cuda, p) => run_cuda(p, job),
    }
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: Precision, _: impl Job) -> Result<()> {
    bail!("this trainer was built without CUDA: rebuild with `cargo build --release -p trainer --features cuda`")
}

#[cfg(feature = "cuda")]
fn run_cuda(p: Precision, job: impl Job) -> Result<()> {
    probe_libcuda()?;
    configure_kernel_caches();
    let note = format!(", matmul {}, {}", configure_matmul(), configure_kernels());
    let env = DeviceEnv {
        note,
        memory: gpu_memory(),
        read_memory: gpu_memory,
    };
    let device = burn::backend::cuda::CudaDevice::new(0);
    let result = match p {
        Precision::F32 => {
            job.run::<burn::backend::Autodiff<burn::backend::Cuda<f32>>>(device, &env)
        }
        Precision::Bf16 => {
            job.run::<burn::backend::Autodiff<burn::backend::Cuda<half::bf16>>>(device, &env)
        }
    };
    let counts = trainer::blas::cublas::counts();
    if counts.run + counts.declined() > 0 {
        tracing::info!(
            "cuBLAS ran {} products ({} operands copied first) and left {} to cubecl's kernels ({} by element type, {} by layout); {} calls failed",
            counts.run,
            counts.copied,
            counts.declined(),
            counts.declined_dtype,
            counts.declined_layout,
            counts.failed
        );
    }
    result
}

/// Free and total memory of GPU 0 (through its primary context, the one burn's runtime uses).
#[cfg(feature = "cuda")]
fn gpu_memory() -> Option<DeviceMemory> {
    let ctx = cudarc::driver::CudaContext::new(0)
        .map_err(|e| tracing::warn!("GPU memory unknown, the memory plan goes unchecked: {e}"))
        .ok()?;
    let (free, total) = ctx.mem_get_info().ok()?;
    Some(DeviceMemory {
        free: free as u64,
        total: total as u64,
        name: "GPU 0",
    })
}

/// Chooses who runs matrix products on CUDA and returns the choice's name: cuBLAS by default
/// (`CUDA_AGENT_MATMUL=cublas` or unset) when the library loads, else cubecl's kernels;
/// `CUDA_AGENT_MATMUL=mma` or `auto` keep cubecl's kernels (vendor/burn-cubecl's fixed choice
/// or upstream's). Measured on an H200 (docs/BENCHMARKS.md), cuBLAS made training passes 10%
/// faster and batched decoding about twice as fast as `mma`.
#[cfg(feature = "cuda")]
fn configure_matmul() -> &'static str {
    match std::env::var("CUDA_AGENT_MATMUL").as_deref() {
        Ok("mma") => "mma",
        Ok("auto") => "auto",
        other => {
            if let Ok(unknown) = other {
                if unknown != "cublas" {
                    tracing::warn!(
                        "CUDA_AGENT_MATMUL={unknown} is not one of cublas, mma, auto; using cublas"
                    );
                }
            }
            match trainer::blas::cublas::install() {
                Ok(()) => {
                    tracing::info!("matrix products run on cuBLAS");
                    "cublas"
                }
                Err(e) => {
                    tracing::warn!(
                        "{}; matrix products run on cubecl's kernels",
                        env_api::ErrorChain(&e)
                    );
                    "mma"
                }
            }
        }
    }
}

/// Runs attention, the next-token statistics, RMSNorm, rotary embeddings, the SwiGLU gate, the
/// decode step and the choice of each generated token through the trainer's CUDA kernels
/// (`kernels::{attention, vocab, norm, rope, swiglu, decode, sample}`) unless
/// `CUDA_AGENT_{ATTENTION,VOCAB,NORM,ROPE,SWIGLU,DECODE,SAMPLE}` is `decomposed`; returns the
/// choices for the bench's note.
#[cfg(feature = "cuda")]
fn configure_kernels() -> String {
    let name = |on: bool| if on { "kernels" } else { "decomposed" };
    let attention = trainer::kernels::attention::install();
    let vocab = trainer::kernels::vocab::install();
    let norm = trainer::kernels::norm::install();
    let rope = trainer::kernels::rope::install();
    let swiglu = trainer::kernels::swiglu::install();
    let decode = trainer::kernels::decode::install();
    let sample = trainer::kernels::sample::install();
    tracing::info!(
        "trainer CUDA kernels: attention {}, next-token statistics {}, RMSNorm {}, rotary embeddings {}, SwiGLU {}, decode step {}, token choice {}",
        name(attention),
        name(vocab),
        name(norm),
        name(rope),
        name(swiglu),
        name(decode),
        name(sample)
    );
    format!(
        "attention {}, vocabulary {}, RMSNorm {}, rotary {}, SwiGLU {}, decode step {}, token choice {}",
        name(attention),
        name(vocab),
        name(norm),
        name(rope),
        name(swiglu),
        name(decode),
        name(sample)
    )
}

/// Keeps what burn's CUDA backend compiles. Every kernel is JIT-compiled on first use (NVRTC,
/// then the driver's PTX compiler: about 0.4 s each, measured on an H200); the first pass of a
/// 0.5B model spends about 24 s on it, so without a cache every run starts with that. cubecl's
/// PTX cache and autotune results go to `$CUDA_AGENT_KERNEL_CACHE` (default
/// `$XDG_CACHE_HOME/cuda-agent/kernels`, else `~/.cache/cuda-agent/kernels`); the driver keeps
/// the machine code in its own cache (`CUDA_CACHE_PATH`, `CUDA_CACHE_MAXSIZE`). A `cubecl.toml`
/// or `burn.toml` in the working directory or above it wins: then nothing is changed.
#[cfg(feature = "cuda")]
fn configure_kernel_caches() {
    use cubecl_runtime::config::{cache::CacheConfig, CubeClRuntimeConfig, RuntimeConfig};
    let cwd = std::env::current_dir().unwrap_or_default();
    if cwd.ancestors().any(|d| {
        ["cubecl.toml", "CubeCL.toml", "burn.toml", "Burn.toml"]
            .iter()
            .any(|f| d.join(f).exists())
    }) {
        tracing::info!(
            "kernel caches: as the cubecl.toml / burn.toml found above {} says",
            cwd.display()
        );
        return;
    }
    let dir = match std::env::var_os("CUDA_AGENT_KERNEL_CACHE") {
        Some(d) => PathBuf::from(d),
        None => match (std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME")) {
            (Some(x), _) => PathBuf::from(x).join("cuda-agent/kernels"),
            (None, Some(h)) => PathBuf::from(h).join(".cache/cuda-agent/kernels"),
            (None, None) => std::env::temp_dir().join("cuda-agent-kernels"),
        },
    };
    // Without a cache the run still works, it only compiles everything again: warn, go on.
    if let Err(e) = std::fs::create_dir_all(&dir) {
        tracing::warn!("kernel cache {} unusable ({e}); kernels will be compiled afresh (set CUDA_AGENT_KERNEL_CACHE)", dir.display());
        return;
    }
    tracing::info!("kernel cache: {}", dir.display());
    let mut config = CubeClRuntimeConfig::default().override_from_env();
    config.compilation.cache = Some(CacheConfig::File(dir.clone()));
    config.autotune.cache = CacheConfig::File(dir);
    // Where the GPU time goes, kernel by kernel: cubecl times each kernel and appends a table
    // (name, calls, total time) at every device sync. Slows the run; for diagnosis only.
    if let Some(file) = std::env::var_os("CUDA_AGENT_KERNEL_PROFILE") {
        tracing::info!("kernel profile: {}", PathBuf::from(&file).display());
        config.profiling.logger.level = cubecl_runtime::config::profiling::ProfilingLogLevel::Basic;
        config.profiling.logger.file = Some(PathBuf::from(file));
    }
    CubeClRuntimeConfig::set(config);
}

/// burn's CUDA backend panics in a worker thread when the driver library is missing; check
/// for it first so the error is a sentence.
#[cfg(feature = "cuda")]
fn probe_libcuda() -> Result<()> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/compat",
            "/usr/lib/wsl/lib",
        ]
        .map(PathBuf::from),
    );
    if dirs
        .iter()
        .any(|d| d.join("libcuda.so.1").exists() || d.join("libcuda.so").exists())
    {
        return Ok(());
    }
    let listed = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so"))
        .unwrap_or(false);
    if listed {
        return Ok(());
    }
    bail!("--device cuda: libcuda.so.1 (the NVIDIA driver library) was not found; is there a GPU and a driver on this machine?")
}
