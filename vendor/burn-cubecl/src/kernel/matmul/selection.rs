//! cuda-agent patch: choose the matmul kernel without autotune.
//!
//! Upstream burn-cubecl 0.21.0 launches `Strategy::Auto` (a simple, synchronously loaded
//! CMMA kernel) whenever autotune is compiled out, and autotune compiles and benchmarks every
//! variant per shape (minutes before a 0.5B model's first step). Measured by cubecl's own
//! autotune on an H200, the Hopper kernels (TMA loads, PTX `mma`) were 3-5x faster on the
//! large products of a transformer. `CUDA_AGENT_MATMUL` picks:
//!
//! - `mma` (default): general products whose strides suit TMA use the specialised TMA `mma`
//!   kernel, other general products the double-buffered cyclic `mma` kernel; matrix-vector
//!   shapes keep `Auto`.
//! - `auto`: upstream behaviour, `Auto` everywhere.
//! - `cublas`: read by the application, which registers cuBLAS for products
//!   (`register_external_matmul`); whatever cuBLAS declines comes here and gets `mma`.
//!
//! A choice that cannot launch (a setup error, before anything runs) falls back to `Auto`.

use std::sync::OnceLock;

use burn_backend::DType;
use cubek::matmul::{
    components::tile::TileMatmulKind,
    definition::MatmulKind,
    launch::{MatmulAutotuneKey, Strategy},
    routines::{BlueprintStrategy, double_buffering::DoubleBufferingArgs},
};

use crate::{CubeRuntime, tensor::CubeTensor};

fn hopper_kernels() -> bool {
    static CHOICE: OnceLock<bool> = OnceLock::new();
    *CHOICE.get_or_init(|| match std::env::var("CUDA_AGENT_MATMUL").as_deref() {
        Ok("auto") => false,
        Ok("mma" | "cublas") | Err(_) => true,
        Ok(other) => {
            log::warn!("CUDA_AGENT_MATMUL={other} is not `cublas`, `mma` or `auto`; using `mma`");
            true
        }
    })
}

/// The strategy to try first for `lhs @ rhs`, or `None` to go straight to `Auto`.
pub(crate) fn chosen_strategy<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    out_dtype: DType,
) -> Option<Strategy> {
    if !hopper_kernels() || lhs.qparams.is_some() || rhs.qparams.is_some() {
        return None;
    }
    let key = MatmulAutotuneKey::generate(
        &lhs.client,
        lhs.meta.shape(),
        rhs.meta.shape(),
        lhs.meta.strides(),
        rhs.meta.strides(),
        lhs.dtype.into(),
        rhs.dtype.into(),
        out_dtype.into(),
        lhs.try_scheme(),
        rhs.try_scheme(),
    );
    if !matches!(key.analysis.kind, MatmulKind::General) {
        return None;
    }
    // The same condition under which autotune considers TMA kernels at all.
    if key.definition.lhs_stride_factor >= 4 && key.definition.rhs_stride_factor >= 4 {
        Some(Strategy::SpecializedTmaMma(BlueprintStrategy::Inferred(().into())))
    } else {
        Some(Strategy::DoubleCyclicMma(BlueprintStrategy::Inferred(DoubleBufferingArgs {
            specialized: false,
            tile_matmul: TileMatmulKind::Mma,
        })))
    }
}
