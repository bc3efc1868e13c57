//! Fused versions of model steps that a backend may register at run time (the CUDA kernels
//! of `crate::kernels` do), tried before the composition of burn operations that every
//! backend runs.
//!
//! The models are generic over burn's `Backend`, and a step's fused version exists for a few
//! concrete backends only, so the lookup is by type at run time: each kind of step has a
//! function-pointer type generic over the backend ([`crate::model::vocab::FusedTokenStats`],
//! [`crate::model::transformer::FusedRmsNorm`], ...), and the pair (backend, function type)
//! is the key. The function type alone would not do: backends that differ only in their
//! element type share tensor primitives (burn's CUDA backend in f32 and in bf16), so their
//! function types are the same type.

use std::any::{Any, TypeId};
use std::sync::RwLock;

/// Registered functions, keyed by backend and function type.
#[allow(clippy::type_complexity)]
static REGISTRY: RwLock<Vec<((TypeId, TypeId), Box<dyn Any + Send + Sync>)>> =
    RwLock::new(Vec::new());

/// Registers `f` for backend `B`, replacing any function of the same type registered for it
/// before.
pub fn register<B: 'static, F: Any + Copy + Send + Sync>(f: F) {
    let key = (TypeId::of::<B>(), TypeId::of::<F>());
    let mut registry = REGISTRY.write().unwrap_or_else(|p| p.into_inner());
    registry.retain(|(known, _)| *known != key);
    registry.push((key, Box::new(f)));
}

/// The function of type `F` registered last for backend `B`, if any.
pub fn get<B: 'static, F: Any + Copy + Send + Sync>() -> Option<F> {
    let key = (TypeId::of::<B>(), TypeId::of::<F>());
    let registry = REGISTRY.read().unwrap_or_else(|p| p.into_inner());
    registry
        .iter()
        .find(|(known, _)| *known == key)
        .and_then(|(_, f)| f.downcast_ref::<F>().copied())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn functions_are_found_by_backend_and_type_and_replaced() {
        struct One;
        struct Two;
        type Twice = fn(u8) -> u8;
        type Named = fn(&'static str) -> usize;
        assert!(get::<One, Twice>().is_none());
        register::<One, Twice>(|x| x * 2);
        register::<Two, Twice>(|x| x * 3);
        register::<One, Named>(|s| s.len());
        assert_eq!(get::<One, Twice>().map(|f| f(4)), Some(8));
        assert_eq!(get::<Two, Twice>().map(|f| f(4)), Some(12));
        register::<One, Twice>(|x| x + 2);
        assert_eq!(get::<One, Twice>().map(|f| f(4)), Some(6));
        assert_eq!(get::<Two, Twice>().map(|f| f(4)), Some(12));
        assert_eq!(get::<One, Named>().map(|f| f("abc")), Some(3));
        assert!(get::<Two, Named>().is_none());
    }
}
