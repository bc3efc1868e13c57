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

impl<B: Backend> KvCache<B> {
    /// Row `row`'s cached tokens as a cache of its own (batch 1), its padding slots left out:
    /// what a conversation keeps between its turns.
    pub fn row(&self, row: usize, device: &B::Device) -> KvCache<B> {
        let Some(valid) = &self.valid else {
            return KvCache::new(self.layers.len());
        };
        let s = valid.dims()[1];
        let flags = valid
            .clone()
            .slice([row..row + 1, 0..s])
            .into_data()
            .convert::<bool>()
            .to_vec::<bool>()
            .unwrap_or_default();
        let kept: Vec<i32> = (0..s as i32).filter(|&j| flags[j as usize]).collect();
        let n = kept.len();
        let idx = Tensor::<B, 1, burn::tensor::Int>::from_data(
            burn::tensor::TensorData::new(kept, [n]),
            device,
        );
        let take = |z: &Option<Tensor<B, 4>>| {
            z.as_ref().map(|z| {
                let [b, h, s, d] = z.dims();
                debug_assert!(row < b);
                z.clone()
                    .slice([row..row + 1, 0..h, 0..s, 0..d])
                    .select(2, idx.clone())
            })
        };
        KvCache {
            layers: self
                .layers
                .iter()
                .map(|l| LayerCache {
                    k: take(&l.k),
                    v: take(&l.v),
                })
                .collect(),
            valid: Some(Tensor::from_data(
                burn::tensor::TensorData::new(vec![true; n], [1, n]),
                device,
            )),
        }
    }

    /// The first `len` cached slots of a one-row cache (a conversation whose context diverged
    /// from what was cached after them).
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len() {
            return;
        }
        for l in &mut self.layers {
            l.k = l.k.take().map(|k| k.narrow(2, 0, len));
            l.v = l.v.take().map(|v| v.narrow(2, 0, len));
        }
        self.valid = self.valid.take().map(|v| v.narrow(1, 0, len));
    }

    /// One-row caches side by side as one batch, the shorter ones padded on the left with
    /// empty slots (masked out, as a left-padded prompt's are).
    pub fn stack(rows: Vec<KvCache<B>>, n_layers: usize, device: &B::Device) -> KvCache<B> {
        let longest = rows.iter().map(KvCache::len).max().unwrap_or(0);
        if longest == 0 {
            return KvCache::new(n_layers);
        }
        // A one-slot zero of each layer's keys and values, for padding rows of any length.
        let template: Vec<(Tensor<B, 4>, Tensor<B, 4>)> = rows
            .iter()
            .find(|r| !r.is_empty())
            .map(|r| {
                r.layers
                    .iter()
                    .map(|l| {
                        let zero = |z: &Option<Tensor<B, 4>>| {
                            z.as_ref()
                                .map(|z| z.clone().narrow(2, 0, 1).zeros_like())
                                .expect("a non-empty cache has every layer")
                        };
                        (zero(&l.k), zero(&l.v))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let pad = |z: Option<Tensor<B, 4>>, zero: &Tensor<B, 4>, len: usize| {
            let [_, h, _, d] = zero.dims();
            let fill = || zero.clone().expand([1, h, longest - len, d]);
            match z {
                Some(z) if len == longest => z,
                Some(z) => Tensor::cat(vec![fill(), z], 2),
                None => fill(),
            }
        };
        let mut layers_k: Vec<Vec<Tensor<B, 4>>> = vec![Vec::with_capacity(rows.len()); n_layers];
        let mut layers_v: Vec<Vec<Tensor<B, 4>>> = vec![Vec::with_capacity(rows.len()); n_layers];
        let mut valid = Vec::with_capacity(rows.len());
        for r in rows {
            let len = r.len();
            for (i, l) in r.layers.into_iter().enumerate() {
                layers_k[i].push(pad(l.k, &template[i].0, len));
                layers_v[i].push(pad(l.v, &template[i].1, len));
            }
            let flags: Vec<bool> = std::iter::repeat_n(false, longest - len)
                .chain(std::iter::repeat_n(true, len))
                .collect();
            valid.push(Tensor::<B, 2, Bool>::from_data(
                burn::tensor::TensorData::new(flags, [1, longest]),
                device,
            ));
        }
        KvCache {
            layers: layers_k
                .into_iter()
                .zip(layers_v)
                .map(|(k, v)| LayerCache {
                    k: Some(Tensor::cat(k, 0)),
                    v: Some(Tensor::cat(v, 0)),
                })
                .collect(),
            valid: Some(Tensor::cat(valid, 0)),
        }
    }
}
