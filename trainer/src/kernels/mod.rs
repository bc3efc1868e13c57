//! Hand-written CUDA kernels for steps burn's CUDA backend runs as many small unfused
//! operations (feature `cuda`).
//!
//! The kernels are CUDA C compiled at run time with NVRTC (which burn's CUDA backend needs
//! anyway), loaded once per device, and queued as external operations of the vendored
//! cubecl-cuda: in order with cubecl's own kernels, on its stream, without the calling thread
//! waiting. [`attention`] registers them with the vendored burn-autodiff, which then runs
//! every differentiable attention through them; [`vocab`], [`norm`], [`rope`] and [`swiglu`]
//! register the next-token statistics of a training pass, RMSNorm, rotary embeddings and the
//! SwiGLU gate with `model::fused`; [`decode`] runs a whole decode step and [`sample`] chooses
//! the next tokens from its logits.

pub mod attention;
pub mod decode;
pub mod flash;
mod module;
pub mod norm;
pub mod rope;
pub mod sample;
mod stream;
pub mod swiglu;
pub mod vocab;
