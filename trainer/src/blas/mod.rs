//! Matrix products through a vendor BLAS on GPUs: cuBLAS behind burn's CUDA backend.
//!
//! [`plan`] (compiled everywhere, tested on the CPU) maps burn's strided, batched, row-major
//! products onto one column-major GEMM call; `cublas` (feature `cuda`) makes the call on
//! cubecl's stream.

#[cfg(feature = "cuda")]
pub mod cublas;
pub mod plan;
