//! Key/value cache for incremental decoding of a batch of sequences.

use burn::tensor::{backend::Backend, Bool, Tensor};

use super::transformer::{positions_and_mask, Positions};

/// Slots a layer's storage grows by when new tokens do not fit. Tokens are written into free
/// slots in place, so a decode step copies nothing; growing by `cat` copies the cache once per
/// this many decode steps instead of at every step, where a context of thousands of tokens
/// made the copy the step's main cost.
pub const GROWTH: usize = 256;

/// Cached keys and values of one layer: storage `[batch, kv_heads, capacity, head_dim]` of
/// which the first `len` slots are filled.
#[derive(Debug, Clone, Default)]
pub struct LayerCache<B: Backend> {
    k: Option<Tensor<B, 4>>,
    v: Option<Tensor<B, 4>>,
    len: usize,
}

impl<B: Backend> LayerCache<B> {
    /// Appends new keys/values `[batch, kv_heads, t, head_dim]` and returns the filled ones.
    pub fn append(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let len = self.len + k.dims()[2];
        let k = Self::write(self.k.take(), self.len, k);
        let v = Self::write(self.v.take(), self.len, v);
        self.len = len;
        self.k = Some(k.clone());
        self.v = Some(v.clone());
        (k.narrow(2, 0, len), v.narrow(2, 0, len))
    }

    /// `new` written at slot `len` of `store`: in place when it fits (the storage is not
    /// shared), else into a copy with [`GROWTH`] free slots after it.
    fn write(store: Option<Tensor<B, 4>>, len: usize, new: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, h, t, d] = new.dims();
        match store {
            Some(store) if store.dims()[2] >= len + t => {
                store.slice_assign([0..b, 0..h, len..len + t, 0..d], new)
            }
            store => {
                let free = free_slots(&new, GROWTH);
                let mut parts: Vec<Tensor<B, 4>> =
                    store.map(|s| s.narrow(2, 0, len)).into_iter().collect();
                parts.extend([new, free]);
                Tensor::cat(parts, 2)
            }
        }
    }

    /// Filled slots.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no slot is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Shape of the key storage `[batch, kv_heads, capacity, head_dim]`, if any.
    pub fn storage_dims(&self) -> Option<[usize; 4]> {
        self.k.as_ref().map(|k| k.dims())
    }

    /// The whole storage of keys and values `[batch, kv_heads, capacity, head_dim]`, grown
    /// first where fewer than `extra` slots are free, taken out of the cache so that whoever
    /// writes the new tokens into slots `len..len + extra` holds the only reference (and may
    /// write in place). [`Self::put_storage`] gives it back. `None` for an empty cache.
    pub fn take_storage(&mut self, extra: usize) -> Option<(Tensor<B, 4>, Tensor<B, 4>)> {
        let grow = |store: Tensor<B, 4>, len: usize| {
            if store.dims()[2] >= len + extra {
                return store;
            }
            let free = free_slots(&store, GROWTH.max(extra));
            Tensor::cat(vec![store.narrow(2, 0, len), free], 2)
        };
        let (k, v) = (self.k.take()?, self.v.take()?);
        Some((grow(k, self.len), grow(v, self.len)))
    }

    /// Storage taken with [`Self::take_storage`], now holding `added` more filled slots.
    pub fn put_storage(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>, added: usize) {
        self.len += added;
        debug_assert!(k.dims()[2] >= self.len && v.dims()[2] >= self.len);
        self.k = Some(k);
        self.v = Some(v);
    }

    /// The filled keys and values, views of the storage.
    fn filled(&self) -> (Option<Tensor<B, 4>>, Option<Tensor<B, 4>>) {
        let view = |z: &Option<Tensor<B, 4>>| z.as_ref().map(|z| z.clone().narrow(2, 0, self.len));
        (view(&self.k), view(&self.v))
    }
}

/// `n` empty slots `[batch, kv_heads, n, head_dim]` shaped like `like`'s, to append to a
/// storage.
fn free_slots<B: Backend>(like: &Tensor<B, 4>, n: usize) -> Tensor<B, 4> {
    let [b, h, _, d] = like.dims();
    like.clone()
        .narrow(2, 0, 1)
        .zeros_like()
        .expand([b, h, n, d])
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
            layers: (0..n_layers).map(|_| LayerCache::default()).collect(),
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

    /// Which cached slots hold real tokens, `[batch, len]`.
    pub fn valid(&self) -> Option<&Tensor<B, 2, Bool>> {
        self.valid.as_ref()
    }

    /// Records one real token more per row (a decode step's) without deriving positions or a
    /// mask (a decode step that derives its own), and returns every slot's flags.
    pub fn push_real_tokens(&mut self, device: &B::Device) -> Option<Tensor<B, 2, Bool>> {
        let past = self.valid.take()?;
        let rows = past.dims()[0];
        let new = Tensor::<B, 2, Bool>::from_data(
            burn::tensor::TensorData::new(vec![true; rows], [rows, 1]),
            device,
        );
        let all = Tensor::cat(vec![past, new], 1);
        self.valid = Some(all.clone());
        Some(all)
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
                .map(|l| {
                    let (k, v) = l.filled();
                    LayerCache {
                        k: take(&k),
                        v: take(&v),
                        len: n,
                    }
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
        // The slots past `len` are free again: the next tokens are written over them.
        for l in &mut self.layers {
            l.len = l.len.min(len);
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
                        #[allow(
                            clippy::expect_used,
                            reason = "a row with filled slots has keys and values in every layer: \
                                      append fills both, and only a decode step takes them out \
                                      (take_storage), putting them back before it returns"
                        )]
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
                let (k, v) = l.filled();
                layers_k[i].push(pad(k, &template[i].0, len));
                layers_v[i].push(pad(v, &template[i].1, len));
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
                    len: longest,
                })
                .collect(),
            valid: Some(Tensor::cat(valid, 0)),
        }
    }
}

impl<B: Backend> KvCache<B> {
    /// Batch rows: how many rows the cache holds (none while empty, whatever the batch).
    pub fn rows(&self) -> usize {
        self.valid.as_ref().map(|v| v.dims()[0]).unwrap_or(0)
    }

    /// Two batches side by side, `self`'s rows first, the shorter one padded on the left with
    /// empty slots (masked out, as a left-padded prompt's are): conversations joining a batch
    /// that is already decoding. An empty cache holds no rows, so joining one changes nothing.
    pub fn join(self, other: KvCache<B>, device: &B::Device) -> KvCache<B> {
        if other.is_empty() {
            return self;
        }
        if self.is_empty() {
            return other;
        }
        let longest = self.len().max(other.len());
        let n_layers = self.layers.len();
        let mut k_parts: Vec<Vec<Tensor<B, 4>>> = vec![Vec::with_capacity(2); n_layers];
        let mut v_parts: Vec<Vec<Tensor<B, 4>>> = vec![Vec::with_capacity(2); n_layers];
        let mut valid = Vec::with_capacity(2);
        for part in [self, other] {
            let (rows, len) = (part.rows(), part.len());
            let pad = longest - len;
            let widen = |z: Tensor<B, 4>| {
                if pad == 0 {
                    return z;
                }
                let [_, h, _, d] = z.dims();
                let fill = z
                    .clone()
                    .narrow(2, 0, 1)
                    .zeros_like()
                    .expand([rows, h, pad, d]);
                Tensor::cat(vec![fill, z], 2)
            };
            for (i, l) in part.layers.iter().enumerate() {
                let (k, v) = l.filled();
                // A non-empty cache has every layer filled (the model writes them together).
                if let (Some(k), Some(v)) = (k, v) {
                    k_parts[i].push(widen(k));
                    v_parts[i].push(widen(v));
                }
            }
            if let Some(flags) = part.valid {
                valid.push(if pad == 0 {
                    flags
                } else {
                    let none = Tensor::<B, 2, Bool>::from_data(
                        burn::tensor::TensorData::new(vec![false; rows * pad], [rows, pad]),
                        device,
                    );
                    Tensor::cat(vec![none, flags], 1)
                });
            }
        }
        KvCache {
            layers: k_parts
                .into_iter()
                .zip(v_parts)
                .map(|(k, v)| LayerCache {
                    k: Some(Tensor::cat(k, 0)),
                    v: Some(Tensor::cat(v, 0)),
                    len: longest,
                })
                .collect(),
            valid: Some(Tensor::cat(valid, 0)),
        }
    }

    /// Drops the first `n` slots of every row: padding that every row has once the longest
    /// conversations of a running batch have left it (never a real token: the caller knows
    /// each row's length). The storage keeps no free slots, so the next write grows it.
    pub fn trim_front(&mut self, n: usize) {
        let len = self.len();
        if n == 0 || n >= len {
            return;
        }
        for l in &mut self.layers {
            let (k, v) = l.filled();
            l.k = k.map(|k| k.narrow(2, n, len - n));
            l.v = v.map(|v| v.narrow(2, n, len - n));
            l.len = len - n;
        }
        self.valid = self.valid.take().map(|v| v.narrow(1, n, len - n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, TensorData};

    type B = NdArray<f32>;

    fn max_diff(a: Tensor<B, 4>, b: Tensor<B, 4>) -> f32 {
        assert_eq!(a.dims(), b.dims());
        (a - b).abs().max().into_scalar()
    }

    /// Appends past the storage's growth step, a truncation written over, and a row taken out
    /// keep exactly the keys and values a concatenation of every append would.
    #[test]
    fn appends_in_place_hold_what_concatenation_would() {
        let device = Default::default();
        let (b, h, d) = (2, 3, 4);
        let mut cache = LayerCache::<B>::default();
        let mut want_k: Vec<Tensor<B, 4>> = Vec::new();
        let mut want_v: Vec<Tensor<B, 4>> = Vec::new();
        let draw =
            |t| Tensor::<B, 4>::random([b, h, t, d], Distribution::Normal(0.0, 1.0), &device);
        for step in 0..(GROWTH + 40) {
            let t = if step == 0 { 5 } else { 1 };
            let (k, v) = (draw(t), draw(t));
            want_k.push(k.clone());
            want_v.push(v.clone());
            let (got_k, got_v) = cache.append(k, v);
            if step % 97 == 0 || step == GROWTH - 5 || step == GROWTH - 4 {
                assert_eq!(max_diff(got_k, Tensor::cat(want_k.clone(), 2)), 0.0);
                assert_eq!(max_diff(got_v, Tensor::cat(want_v.clone(), 2)), 0.0);
            }
        }
        let filled = 5 + GROWTH + 39;
        assert_eq!(cache.len, filled);
        assert!(cache.k.as_ref().unwrap().dims()[2] >= filled);
        // Cut back, then append: the new tokens take the freed slots.
        cache.len = 100;
        let (k, v) = (draw(3), draw(3));
        let (got_k, _) = cache.append(k.clone(), v);
        let want = Tensor::cat(vec![Tensor::cat(want_k.clone(), 2).narrow(2, 0, 100), k], 2);
        assert_eq!(max_diff(got_k, want), 0.0);
        assert_eq!(cache.len, 103);
    }

    /// Storage taken for a decode step that writes its own slots: room for the new token
    /// (grown only when full, the filled slots kept), and back with one more slot filled; the
    /// flags gain one real token per row.
    #[test]
    fn storage_taken_for_writing_has_room_and_comes_back_longer() {
        let device = Default::default();
        let (h, d) = (2, 4);
        let mut cache = KvCache::<B>::new(1);
        cache.extend(Tensor::<B, 2, Bool>::from_data(
            TensorData::new(vec![false, true, true], [1, 3]),
            &device,
        ));
        let k = Tensor::<B, 4>::random([1, h, 3, d], Distribution::Normal(0.0, 1.0), &device);
        cache.layers[0].append(k.clone(), k.clone());
        // Appended storage has free slots: taken as it is.
        let (sk, sv) = cache.layers[0].take_storage(1).unwrap();
        assert_eq!(sk.dims()[2], 3 + GROWTH);
        cache.layers[0].put_storage(sk, sv, 0);
        // A stacked cache has none: the first take grows it, keeping the filled slots.
        let mut stacked = KvCache::stack(vec![cache.row(0, &device)], 1, &device);
        assert_eq!(stacked.layers[0].storage_dims().unwrap()[2], 2);
        let (sk, sv) = stacked.layers[0].take_storage(1).unwrap();
        assert_eq!(sk.dims()[2], 2 + GROWTH);
        assert_eq!(max_diff(sk.clone().narrow(2, 0, 2), k.narrow(2, 1, 2)), 0.0);
        let flags = stacked.push_real_tokens(&device).unwrap();
        stacked.layers[0].put_storage(sk, sv, 1);
        assert_eq!(stacked.len(), 3);
        assert_eq!(stacked.layers[0].len(), 3);
        let flags: Vec<bool> = flags.into_data().to_vec().unwrap();
        assert_eq!(flags, vec![true, true, true]);
        // An empty cache has nothing to take or flag.
        let mut empty = KvCache::<B>::new(1);
        assert!(empty.layers[0].take_storage(1).is_none());
        assert!(empty.push_real_tokens(&device).is_none());
    }

    /// A batch cache's row, truncated and stacked back with another, keeps its tokens.
    #[test]
    fn rows_truncate_and_stack_through_the_storage() {
        let device = Default::default();
        let (b, h, d) = (2, 2, 4);
        let mut cache = KvCache::<B>::new(1);
        let mut keys = Vec::new();
        for t in [4, 1, 1] {
            let valid = Tensor::<B, 2, Bool>::from_data(
                TensorData::new(vec![true; b * t], [b, t]),
                &device,
            );
            cache.extend(valid);
            let k = Tensor::<B, 4>::random([b, h, t, d], Distribution::Normal(0.0, 1.0), &device);
            keys.push(k.clone());
            cache.layers[0].append(k.clone(), k);
        }
        let all = Tensor::cat(keys, 2);
        let mut row = cache.row(1, &device);
        assert_eq!(row.len(), 6);
        let (k, _) = row.layers[0].filled();
        assert_eq!(max_diff(k.unwrap(), all.clone().narrow(0, 1, 1)), 0.0);
        row.truncate(5);
        let short = cache.row(0, &device);
        let stacked = KvCache::stack(vec![row, short], 1, &device);
        assert_eq!(stacked.len(), 6);
        let (k, _) = stacked.layers[0].filled();
        let k = k.unwrap();
        // Row 0 (the truncated one) is padded by one slot on the left.
        assert_eq!(
            max_diff(
                k.clone().narrow(0, 0, 1).narrow(2, 1, 5),
                all.clone().narrow(0, 1, 1).narrow(2, 0, 5)
            ),
            0.0
        );
        assert_eq!(max_diff(k.narrow(0, 1, 1), all.narrow(0, 0, 1)), 0.0);
    }

    /// Two batches of different lengths joined: the shorter padded on the left with masked
    /// slots, rows in order; trimming padding every row has gives back each row's tokens.
    #[test]
    fn batches_join_padded_on_the_left_and_trim_back() {
        let device = Default::default();
        let (h, d) = (2, 4);
        let batch = |rows: usize, t: usize| {
            let mut c = KvCache::<B>::new(1);
            c.extend(Tensor::<B, 2, Bool>::from_data(
                TensorData::new(vec![true; rows * t], [rows, t]),
                &device,
            ));
            let k =
                Tensor::<B, 4>::random([rows, h, t, d], Distribution::Normal(0.0, 1.0), &device);
            c.layers[0].append(k.clone(), k.clone() * 2.0);
            (c, k)
        };
        let (long, long_k) = batch(2, 7);
        let (short, short_k) = batch(1, 3);
        let mut joined = long.join(short, &device);
        assert_eq!((joined.rows(), joined.len()), (3, 7));
        let flags: Vec<bool> = joined
            .valid()
            .unwrap()
            .clone()
            .into_data()
            .to_vec()
            .unwrap();
        let mut want = vec![true; 14];
        want.extend([false, false, false, false, true, true, true]);
        assert_eq!(flags, want);
        let (k, v) = joined.layers[0].filled();
        let (k, v) = (k.unwrap(), v.unwrap());
        assert_eq!(max_diff(k.clone().narrow(0, 0, 2), long_k.clone()), 0.0);
        assert_eq!(
            max_diff(k.clone().narrow(0, 2, 1).narrow(2, 4, 3), short_k.clone()),
            0.0
        );
        assert_eq!(
            k.clone()
                .narrow(0, 2, 1)
                .narrow(2, 0, 4)
                .abs()
                .max()
                .into_scalar(),
            0.0
        );
        assert_eq!(
            max_diff(v.narrow(0, 2, 1).narrow(2, 4, 3), short_k.clone() * 2.0),
            0.0
        );
        // The long rows leave; the short row's four padding slots go.
        joined.retain(&[2], &device);
        joined.trim_front(4);
        assert_eq!((joined.rows(), joined.len()), (1, 3));
        let (k, _) = joined.layers[0].filled();
        assert_eq!(max_diff(k.unwrap(), short_k), 0.0);
        let flags: Vec<bool> = joined
            .valid()
            .unwrap()
            .clone()
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(flags, vec![true; 3]);
        // Joining an empty cache changes nothing.
        let (one, _) = batch(1, 2);
        assert_eq!(one.join(KvCache::new(1), &device).rows(), 1);
    }
}
