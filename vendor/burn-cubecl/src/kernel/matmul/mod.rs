mod base;
mod external;
mod selection;
mod tune;

/// Contains utilities for matmul operation
pub mod utils;

pub use base::*;
pub use external::{ExternalMatmul, external_matmul, register_external_matmul};
#[cfg(feature = "autotune")]
pub use tune::*;
pub use utils::*;
