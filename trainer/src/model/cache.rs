//! Key/value cache for incremental decoding of a batch of sequences.

use burn::tensor::{backend::Backend, Bool, Tensor};

use super::transformer::{positions_and_mask, Positions};

/// Cached keys and values of one layer, `[batch, kv_heads, seq, head_dim]`.
#[derive(Debug, Clone, Default)]
pub struct LayerCache<B: Backend> {
    k: Option<Tensor<B, 4>>,
    v: Option<Tensor<B, 4>>,
}

impl<B: Backend> LayerCache<B> {
    /// Appends new keys/values and returns the full ones.
    pub fn append(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let k = match self.k.take() {
            Some(old) => Tensor::cat(vec![old, k], 2),
            None => k,
        };
        let v = match self.v.take() {
            Some(old) => Tensor::cat(vec![old, v], 2),
            None => v,
        };
        self.k = Some(k.clone());
        self.v = Some(v.clone());
        (k, v)
    }
}

/// The cache of every layer plus which cached slots hold real tokens.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    /// One per decoder layer.
    pub layers: Vec<LayerCache<B>>,
    valid: Option<Tensor<B, 2, Bool>>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self {
            layers: (0..n_layers)
                .map(|_| LayerCache { k: None, v: None })
                .collect(),
            valid: None,
        }
    }

    /// Cached length (including padding slots).
    pub fn len(&self) -> usize {
        self.valid.as_ref().map(|v| v.dims()[1]).unwrap_or(0)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records new tokens' validity and returns their positions and attention mask.
    pub fn extend(&mut self, valid: Tensor<B, 2, Bool>) -> Positions<B> {
        let past = self.valid.take();
        let out = positions_and_mask(valid.clone(), past.clone());
        self.valid = Some(match past {
            Some(p) => Tensor::cat(vec![p, valid], 1),
            None => valid,
        });
        out
    }
}

impl<B: Backend> KvCache<B> {
    /// Keeps only the batch rows `rows` (sequences that are still generating).
    pub fn retain(&mut self, rows: &[usize], device: &B::Device) {
        let idx = Tensor::<B, 1, burn::tensor::Int>::from_data(
            burn::tensor::TensorData::new(
                rows.iter().map(|&r| r as i32).collect::<Vec<_>>(),
                [rows.len()],
            ),
            device,
        );
        for l in &mut self.layers {
            l.k = l.k.take().map(|k| k.select(0, idx.clone()));
            l.v = l.v.take().map(|v| v.select(0, idx.clone()));
        }
        self.valid = self.valid.take().map(|v| v.select(0, idx));
    }
}
