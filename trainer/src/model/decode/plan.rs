//! The layout of one decode step as the device thread reads it: which of the launch's buffers
//! is which, and the shapes and strides around them. Built where the step is queued and
//! travelling as the launch's scalar words (the device thread has nothing else), so that the
//! encoding is plain data, tested on any machine.

/// Marks an absent buffer (no bias, a tied output head).
pub const NONE: u64 = u64::MAX;

/// A low-rank adapter on one projection: `y += scale · (x · A) · B_i` into each part's columns.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterPlan {
    /// Buffer of `A` `[in, parts · rank]`, in the model's element type.
    pub a: u64,
    /// Rank of each part.
    pub rank: usize,
    /// `alpha / rank`.
    pub scale: f64,
    /// Per part: buffer of `B` `[rank, width]`, first output column, width.
    pub parts: Vec<(u64, usize, usize)>,
}

/// One decoder layer's buffers (indices into the launch's buffers).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    /// Scale of the norm before attention.
    pub input_norm: u64,
    /// Query, key and value projection `[hidden, (h + 2 kvh) · d]`.
    pub qkv: u64,
    /// Its bias, or [`NONE`].
    pub qkv_bias: u64,
    /// Output projection `[h · d, hidden]`.
    pub o: u64,
    /// Scale of the norm before the MLP.
    pub post_norm: u64,
    /// Gate and up projections side by side `[hidden, 2 · inter]`.
    pub gate_up: u64,
    /// Down projection `[inter, hidden]`.
    pub down: u64,
    /// Key storage `[b, kvh, capacity, d]`.
    pub k: u64,
    /// Value storage.
    pub v: u64,
    /// Element strides of the key storage along batch, head and slot.
    pub k_strides: [usize; 3],
    /// The same for the value storage.
    pub v_strides: [usize; 3],
    /// Adapters on the query/key/value, output, gate/up and down projections.
    pub adapters: [Option<AdapterPlan>; 4],
    /// Which of those four projections' weights are stored transposed (bit `i` for the
    /// `i`-th): `[in, out]` as a view of the checkpoint's `[out, in]`, column-major.
    pub transposed: u64,
}

/// Buffers every layer shares: inputs, the output and scratch rows.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedBuffers {
    /// Token ids `[b]` (i32).
    pub tokens: u64,
    /// Slot flags `[b, s]`.
    pub valid: u64,
    /// Rotary cosines `[positions, d]`.
    pub cos: u64,
    /// Rotary sines.
    pub sin: u64,
    /// Embedding table `[vocab, hidden]`.
    pub embed: u64,
    /// Final norm's scale.
    pub final_norm: u64,
    /// Untied output head `[hidden, vocab]`, or [`NONE`] (the embedding, transposed).
    pub head: u64,
    /// Whether the untied head is stored transposed (column-major `[hidden, vocab]`).
    pub head_transposed: bool,
    /// Residual stream `[b, hidden]`.
    pub x: u64,
    /// Normalised rows `[b, hidden]`.
    pub normed: u64,
    /// Projection output `[b, (h + 2 kvh) · d]`.
    pub qkv_out: u64,
    /// Rotated queries `[b, h, d]`.
    pub q: u64,
    /// Attention output `[b, h · d]`.
    pub attn: u64,
    /// Gate and up `[b, 2 · inter]`.
    pub gate_up_out: u64,
    /// SwiGLU output `[b, inter]`.
    pub act: u64,
    /// Adapter rows `[b, widest parts · rank]`, or [`NONE`] without adapters.
    pub adapter_rows: u64,
    /// The norms' inverse root-mean-squares `[b]` (f32, unused).
    pub inv_rms: u64,
    /// Positions of the new tokens `[b]` (i32).
    pub positions: u64,
    /// Split attention's partial results (f32), or [`NONE`] with one split.
    pub partial: u64,
    /// Logits `[b, vocab]`.
    pub logits: u64,
}

/// The whole step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPlan {
    /// CUDA device index.
    pub device: usize,
    /// Elements are bf16 (else f32).
    pub bf16: bool,
    /// Rows (sequences).
    pub rows: usize,
    /// Slots of every row's cache after the step (the new token's is the last).
    pub slots: usize,
    /// Model width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// MLP width.
    pub inter: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Norm epsilon.
    pub eps: f64,
    /// Key ranges each row's attention is split into.
    pub splits: usize,
    /// Byte strides of the flags along rows and slots.
    pub valid_strides: [usize; 2],
    /// Shared buffers.
    pub shared: SharedBuffers,
    /// Layers in order.
    pub layers: Vec<LayerPlan>,
}

const VERSION: u64 = 1;

struct Reader<'a>(std::slice::Iter<'a, u64>);

impl Reader<'_> {
    fn word(&mut self) -> Option<u64> {
        self.0.next().copied()
    }
    fn size(&mut self) -> Option<usize> {
        usize::try_from(self.word()?).ok()
    }
}

impl AdapterPlan {
    fn write(plan: &Option<AdapterPlan>, out: &mut Vec<u64>) {
        let Some(p) = plan else {
            out.push(0);
            return;
        };
        out.extend([
            1,
            p.a,
            p.rank as u64,
            p.scale.to_bits(),
            p.parts.len() as u64,
        ]);
        for &(b, offset, width) in &p.parts {
            out.extend([b, offset as u64, width as u64]);
        }
    }

    fn read(r: &mut Reader<'_>) -> Option<Option<AdapterPlan>> {
        if r.word()? == 0 {
            return Some(None);
        }
        let (a, rank, scale) = (r.word()?, r.size()?, f64::from_bits(r.word()?));
        let n = r.size()?;
        let mut parts = Vec::with_capacity(n.min(16));
        for _ in 0..n {
            parts.push((r.word()?, r.size()?, r.size()?));
        }
        Some(Some(AdapterPlan {
            a,
            rank,
            scale,
            parts,
        }))
    }
}

impl StepPlan {
    /// The plan as the launch's scalar words.
    pub fn to_words(&self) -> Vec<u64> {
        let s = &self.shared;
        let mut out = vec![
            VERSION,
            self.device as u64,
            u64::from(self.bf16),
            self.rows as u64,
            self.slots as u64,
            self.hidden as u64,
            self.heads as u64,
            self.kv_heads as u64,
            self.head_dim as u64,
            self.inter as u64,
            self.vocab as u64,
            self.eps.to_bits(),
            self.splits as u64,
            self.valid_strides[0] as u64,
            self.valid_strides[1] as u64,
        ];
        out.extend([
            s.tokens,
            s.valid,
            s.cos,
            s.sin,
            s.embed,
            s.final_norm,
            s.head,
            u64::from(s.head_transposed),
            s.x,
            s.normed,
            s.qkv_out,
            s.q,
            s.attn,
            s.gate_up_out,
            s.act,
            s.adapter_rows,
            s.inv_rms,
            s.positions,
            s.partial,
            s.logits,
        ]);
        out.push(self.layers.len() as u64);
        for l in &self.layers {
            out.extend([
                l.input_norm,
                l.qkv,
                l.qkv_bias,
                l.o,
                l.post_norm,
                l.gate_up,
                l.down,
                l.k,
                l.v,
            ]);
            out.extend(l.k_strides.iter().chain(&l.v_strides).map(|&x| x as u64));
            out.push(l.transposed);
            for a in &l.adapters {
                AdapterPlan::write(a, &mut out);
            }
        }
        out
    }

    /// The plan back from [`Self::to_words`]' output; `None` when truncated or of another
    /// version.
    pub fn from_words(words: &[u64]) -> Option<StepPlan> {
        let mut r = Reader(words.iter());
        if r.word()? != VERSION {
            return None;
        }
        let device = r.size()?;
        let bf16 = r.word()? != 0;
        let [rows, slots, hidden, heads, kv_heads, head_dim, inter, vocab] = [
            r.size()?,
            r.size()?,
            r.size()?,
            r.size()?,
            r.size()?,
            r.size()?,
            r.size()?,
            r.size()?,
        ];
        let eps = f64::from_bits(r.word()?);
        let splits = r.size()?;
        let valid_strides = [r.size()?, r.size()?];
        let mut w = || r.word();
        let shared = SharedBuffers {
            tokens: w()?,
            valid: w()?,
            cos: w()?,
            sin: w()?,
            embed: w()?,
            final_norm: w()?,
            head: w()?,
            head_transposed: w()? != 0,
            x: w()?,
            normed: w()?,
            qkv_out: w()?,
            q: w()?,
            attn: w()?,
            gate_up_out: w()?,
            act: w()?,
            adapter_rows: w()?,
            inv_rms: w()?,
            positions: w()?,
            partial: w()?,
            logits: w()?,
        };
        let n = r.size()?;
        let mut layers = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let [input_norm, qkv, qkv_bias, o, post_norm, gate_up, down, k, v] = [
                r.word()?,
                r.word()?,
                r.word()?,
                r.word()?,
                r.word()?,
                r.word()?,
                r.word()?,
                r.word()?,
                r.word()?,
            ];
            let k_strides = [r.size()?, r.size()?, r.size()?];
            let v_strides = [r.size()?, r.size()?, r.size()?];
            let transposed = r.word()?;
            let adapters = [
                AdapterPlan::read(&mut r)?,
                AdapterPlan::read(&mut r)?,
                AdapterPlan::read(&mut r)?,
                AdapterPlan::read(&mut r)?,
            ];
            layers.push(LayerPlan {
                input_norm,
                qkv,
                qkv_bias,
                o,
                post_norm,
                gate_up,
                down,
                k,
                v,
                k_strides,
                v_strides,
                adapters,
                transposed,
            });
        }
        if r.word().is_some() {
            return None;
        }
        Some(StepPlan {
            device,
            bf16,
            rows,
            slots,
            hidden,
            heads,
            kv_heads,
            head_dim,
            inter,
            vocab,
            eps,
            splits,
            valid_strides,
            shared,
            layers,
        })
    }
}

/// Key ranges to split each (row, key head)'s attention into: enough blocks to give every
/// multiprocessor eight, each range at least `min_keys` long, at most `max_splits`. A block
/// walks its keys a chunk at a time, each chunk waiting on memory, so many short ranges side by
/// side beat a few long ones (measured on an H100: three chunks in a row took 80 us a layer).
pub fn attention_splits(
    blocks: usize,
    slots: usize,
    multiprocessors: usize,
    min_keys: usize,
    max_splits: usize,
) -> usize {
    let wanted = (8 * multiprocessors).div_ceil(blocks.max(1));
    let longest = slots.div_ceil(min_keys.max(1));
    wanted.min(longest).clamp(1, max_splits.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> StepPlan {
        let adapter = |base: u64, parts: usize| AdapterPlan {
            a: base,
            rank: 16,
            scale: 2.0,
            parts: (0..parts)
                .map(|i| (base + 1 + i as u64, 64 * i, 64))
                .collect(),
        };
        StepPlan {
            device: 3,
            bf16: true,
            rows: 8,
            slots: 4097,
            hidden: 896,
            heads: 14,
            kv_heads: 2,
            head_dim: 64,
            inter: 4864,
            vocab: 151_936,
            eps: 1e-6,
            splits: 4,
            valid_strides: [4097, 1],
            shared: SharedBuffers {
                tokens: 0,
                valid: 1,
                cos: 2,
                sin: 3,
                embed: 4,
                final_norm: 5,
                head: NONE,
                head_transposed: false,
                x: 6,
                normed: 7,
                qkv_out: 8,
                q: 9,
                attn: 10,
                gate_up_out: 11,
                act: 12,
                adapter_rows: 13,
                inv_rms: 14,
                positions: 15,
                partial: 16,
                logits: 17,
            },
            layers: vec![
                LayerPlan {
                    input_norm: 20,
                    qkv: 21,
                    qkv_bias: 22,
                    o: 23,
                    post_norm: 24,
                    gate_up: 25,
                    down: 26,
                    k: 27,
                    v: 28,
                    k_strides: [2 * 256 * 64, 256 * 64, 64],
                    v_strides: [2 * 512 * 64, 512 * 64, 64],
                    adapters: [Some(adapter(40, 3)), None, Some(adapter(50, 2)), None],
                    transposed: 0,
                },
                LayerPlan {
                    input_norm: 30,
                    qkv: 31,
                    qkv_bias: NONE,
                    o: 33,
                    post_norm: 34,
                    gate_up: 35,
                    down: 36,
                    k: 37,
                    v: 38,
                    k_strides: [1, 2, 3],
                    v_strides: [4, 5, 6],
                    adapters: [None, Some(adapter(60, 1)), None, Some(adapter(70, 1))],
                    transposed: 0b1010,
                },
            ],
        }
    }

    #[test]
    fn plans_survive_their_words() {
        let p = plan();
        assert_eq!(StepPlan::from_words(&p.to_words()), Some(p));
    }

    #[test]
    fn truncated_extended_or_foreign_words_are_refused() {
        let words = plan().to_words();
        for cut in [0, 1, 14, 34, words.len() - 1] {
            assert_eq!(StepPlan::from_words(&words[..cut]), None, "cut at {cut}");
        }
        let mut longer = words.clone();
        longer.push(0);
        assert_eq!(StepPlan::from_words(&longer), None);
        let mut other = words;
        other[0] = VERSION + 1;
        assert_eq!(StepPlan::from_words(&other), None);
    }

    #[test]
    fn attention_splits_fill_the_machine_without_tiny_ranges() {
        // Batch 1 of a 2-key-head model on 132 multiprocessors with 4k keys: 32 ranges of 128.
        assert_eq!(attention_splits(2, 4096, 132, 128, 64), 32);
        // Batch 32 with 4k keys: 17 ranges, eight blocks a multiprocessor.
        assert_eq!(attention_splits(64, 4224, 132, 128, 64), 17);
        // Short contexts are not split below the minimum range.
        assert_eq!(attention_splits(2, 100, 132, 128, 64), 1);
        assert_eq!(attention_splits(16, 384, 132, 128, 64), 3);
        // Enough blocks already: no split.
        assert_eq!(attention_splits(2048, 32768, 132, 128, 64), 1);
        // Long context at batch 1: capped.
        assert_eq!(attention_splits(1, 1 << 20, 132, 128, 64), 64);
    }
}
