//! cuda-agent patch: a matrix-product implementation registered from outside burn.
//!
//! A runtime may have a vendor library (cuBLAS on CUDA) whose products beat cubecl's
//! kernels by a wide margin. The application registers a function per runtime; every
//! product of that runtime is offered to it first, and when one is registered the fusion
//! engine stops fusing products with their neighbours so that every product reaches it.

use crate::{CubeRuntime, tensor::CubeTensor};
use std::any::{Any, TypeId};
use std::sync::RwLock;

/// Computes `out = lhs @ rhs` (batched over the leading dimensions, broadcasting as burn
/// does) into `out`, a tensor of the product's shape as cubecl allocates it (its rows may be
/// pitched). Returns `false`, having written nothing, to leave the product to cubecl's kernels.
pub type ExternalMatmul<R> = fn(&CubeTensor<R>, &CubeTensor<R>, &CubeTensor<R>) -> bool;

type Entry = (TypeId, Box<dyn Any + Send + Sync>);

static REGISTRY: RwLock<Vec<Entry>> = RwLock::new(Vec::new());

/// Offers every matrix product of runtime `R` to `product` from now on.
///
/// Register before the first tensor of the runtime is created: the fusion engine reads the
/// registry when a device's fusion client starts.
pub fn register_external_matmul<R: CubeRuntime + 'static>(product: ExternalMatmul<R>) {
    let mut registry = REGISTRY.write().unwrap_or_else(|poisoned| poisoned.into_inner());
    registry.retain(|(id, _)| *id != TypeId::of::<R>());
    registry.push((TypeId::of::<R>(), Box::new(product)));
}

/// The product registered for runtime `R`, if any.
pub fn external_matmul<R: CubeRuntime + 'static>() -> Option<ExternalMatmul<R>> {
    let registry = REGISTRY.read().unwrap_or_else(|poisoned| poisoned.into_inner());
    registry
        .iter()
        .find(|(id, _)| *id == TypeId::of::<R>())
        .and_then(|(_, product)| product.downcast_ref::<ExternalMatmul<R>>().copied())
}
