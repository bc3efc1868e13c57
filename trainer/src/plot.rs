//! Training curves drawn to PNG (placeholder until the charts crate lands).
