mod base;
mod mask_fill;
mod mask_where;

pub(crate) use base::*;

pub use mask_fill::*;
pub use mask_where::*;
