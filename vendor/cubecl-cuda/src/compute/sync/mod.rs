mod fence;

pub use fence::*;
