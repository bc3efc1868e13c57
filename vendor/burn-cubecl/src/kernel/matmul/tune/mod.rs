#[cfg(feature = "autotune")]
mod base;

#[cfg(feature = "autotune")]
pub use base::matmul_autotune;
