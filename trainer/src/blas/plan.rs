//! How a row-major, strided, batched product maps onto one column-major strided-batched
//! GEMM call (cuBLAS's `cublasGemmStridedBatchedEx`), without copying any operand.
//!
//! burn hands the backend `out[.., m, n] = lhs[.., m, k] @ rhs[.., k, n]` where either operand
//! may be a transposed or sliced view and leading (batch) dimensions may broadcast. A
//! column-major BLAS computes `C = op(A) op(B)`; reading the row-major output as column-major
//! gives `outᵀ = rhsᵀ lhsᵀ`, so `A` is `rhs` and `B` is `lhs`, each transposed or not by how
//! its matrix is stored. When the batch dimensions do not nest evenly (heads interleaved with
//! positions, as in a view of a fused QKV projection), the outermost one becomes a loop of
//! calls. Shapes that cannot be expressed even so (a batch that broadcasts in some dimensions
//! and not others, rows that are neither contiguous nor evenly strided) get `None`.

/// A tensor's shape and strides, in elements.
#[derive(Debug, Clone, Copy)]
pub struct Layout<'a> {
    /// Sizes, outermost first.
    pub shape: &'a [usize],
    /// Element strides, one per dimension.
    pub strides: &'a [usize],
}

/// One operand of the GEMM call, as a column-major BLAS sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operand {
    /// Whether BLAS must transpose the stored matrix (`CUBLAS_OP_T`).
    pub transpose: bool,
    /// Leading dimension of the stored matrix, in elements.
    pub ld: usize,
    /// Elements between consecutive batch entries (0 when the operand broadcasts).
    pub batch_stride: usize,
}

/// The arguments of one column-major strided-batched GEMM computing a burn product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmPlan {
    /// BLAS `m`: columns of the row-major output.
    pub m: usize,
    /// BLAS `n`: rows of the row-major output (times the batch when it was folded in).
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// Number of products.
    pub batch: usize,
    /// BLAS `A`: burn's right-hand side.
    pub a: Operand,
    /// BLAS `B`: burn's left-hand side.
    pub b: Operand,
    /// Leading dimension of the output (its row stride; wider than a row when the allocator
    /// pitched the rows).
    pub ldc: usize,
    /// Elements between consecutive outputs of the batch.
    pub stride_c: usize,
    /// Calls made one after another: 1, or the size of the outermost batch dimension when
    /// the batch dimensions do not nest into one stride.
    pub outer: usize,
    /// Elements between the calls' `A`, `B` and output.
    pub outer_strides: [usize; 3],
}

/// Row-major contiguous strides for `shape`, as a copy of the operand would have them.
fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// Which operands to copy into a contiguous layout, `(lhs, rhs)`, so that [`plan`] finds a
/// call, copying as few elements as possible: a transposed `[.., 2048, 2048]` beside an
/// unwalkable `[.., 2048, 64]` view must not be copied along with it. `None` when no copy
/// helps (or none is needed: check [`plan`] first).
pub fn copies_needed(lhs: Layout<'_>, rhs: Layout<'_>, out: Layout<'_>) -> Option<(bool, bool)> {
    let size = |l: &Layout<'_>| l.shape.iter().product::<usize>();
    let (lhs_copy, rhs_copy) = (contiguous_strides(lhs.shape), contiguous_strides(rhs.shape));
    let mut choices = [(false, true), (true, false), (true, true)];
    choices.sort_by_key(|&(l, r)| usize::from(l) * size(&lhs) + usize::from(r) * size(&rhs));
    choices.into_iter().find(|&(copy_lhs, copy_rhs)| {
        let l = if copy_lhs {
            Layout {
                shape: lhs.shape,
                strides: &lhs_copy,
            }
        } else {
            lhs
        };
        let r = if copy_rhs {
            Layout {
                shape: rhs.shape,
                strides: &rhs_copy,
            }
        } else {
            rhs
        };
        // A copy of an operand that is already contiguous changes nothing.
        let useful = (!copy_lhs || lhs.strides != &lhs_copy[..])
            && (!copy_rhs || rhs.strides != &rhs_copy[..]);
        useful && plan(l, r, out).is_some()
    })
}

/// Words in [`GemmPlan::to_words`].
pub const PLAN_WORDS: usize = 16;

impl GemmPlan {
    /// The plan as integers, to travel with a queued launch to the thread that makes the call.
    pub fn to_words(&self) -> [u64; PLAN_WORDS] {
        let w = |v: usize| v as u64;
        [
            w(self.m),
            w(self.n),
            w(self.k),
            w(self.batch),
            u64::from(self.a.transpose),
            w(self.a.ld),
            w(self.a.batch_stride),
            u64::from(self.b.transpose),
            w(self.b.ld),
            w(self.b.batch_stride),
            w(self.ldc),
            w(self.stride_c),
            w(self.outer),
            w(self.outer_strides[0]),
            w(self.outer_strides[1]),
            w(self.outer_strides[2]),
        ]
    }

    /// The plan [`GemmPlan::to_words`] wrote, from the start of `words`.
    pub fn from_words(words: &[u64]) -> Option<GemmPlan> {
        let w: &[u64; PLAN_WORDS] = words.get(..PLAN_WORDS)?.try_into().ok()?;
        let u = |v: u64| v as usize;
        Some(GemmPlan {
            m: u(w[0]),
            n: u(w[1]),
            k: u(w[2]),
            batch: u(w[3]),
            a: Operand {
                transpose: w[4] != 0,
                ld: u(w[5]),
                batch_stride: u(w[6]),
            },
            b: Operand {
                transpose: w[7] != 0,
                ld: u(w[8]),
                batch_stride: u(w[9]),
            },
            ldc: u(w[10]),
            stride_c: u(w[11]),
            outer: u(w[12]),
            outer_strides: [u(w[13]), u(w[14]), u(w[15])],
        })
    }
}

/// A matrix's storage: row-major (`transpose == false` for BLAS) or column-major, with its
/// leading dimension.
fn matrix(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Option<(bool, usize)> {
    if cols == 1 || col_stride == 1 {
        let ld = if rows == 1 { cols } else { row_stride };
        if ld >= cols.max(1) {
            return Some((false, ld));
        }
    }
    if rows == 1 || row_stride == 1 {
        let ld = if cols == 1 { rows } else { col_stride };
        if ld >= rows.max(1) {
            return Some((true, ld));
        }
    }
    None
}

/// The single stride that walks an operand's batch entries in the output's batch order: 0 if
/// the operand broadcasts over every batch dimension, else the stride of its innermost batch
/// dimension when its batch dimensions nest evenly. `None` otherwise.
fn batch_stride(out_batch: &[usize], shape: &[usize], strides: &[usize]) -> Option<usize> {
    // Only dimensions that actually iterate matter; size-1 ones may carry any stride.
    let live: Vec<(usize, usize)> = out_batch
        .iter()
        .zip(shape.iter().zip(strides))
        .filter(|(out, _)| **out > 1)
        .map(|(out, (size, stride))| (*out, if *size == 1 { usize::MAX } else { *stride }))
        .collect();
    if live.iter().all(|(_, stride)| *stride == usize::MAX) {
        return Some(0);
    }
    if live.iter().any(|(_, stride)| *stride == usize::MAX) {
        return None;
    }
    for pair in live.windows(2) {
        let ((_, outer), (inner_size, inner)) = (pair[0], pair[1]);
        if outer != inner * inner_size {
            return None;
        }
    }
    live.last().map(|(_, stride)| *stride)
}

/// The GEMM calls computing `lhs @ rhs` into `out`: one strided-batched call, else a loop
/// over the outermost batch dimension of such calls; `None` when neither can express it.
/// The output may have pitched rows and evenly spaced batch entries (what the backend's
/// allocator hands out) but its rows must be unit-stride. Empty products are `None` too
/// (nothing for BLAS to do; the backend fills an empty inner dimension with zeros).
pub fn plan(lhs: Layout<'_>, rhs: Layout<'_>, out: Layout<'_>) -> Option<GemmPlan> {
    if let Some(p) = plan_single(lhs, rhs, out) {
        return Some(p);
    }
    let rank = lhs.shape.len();
    let ranked = |l: &Layout<'_>| l.shape.len() == rank && l.strides.len() == rank;
    if rank < 4 || !ranked(&rhs) || !ranked(&out) {
        return None;
    }
    let n = out.shape[0];
    let fits = |l: &Layout<'_>| l.shape[0] == n || l.shape[0] == 1;
    // Every call writes its own part of the output.
    if n < 2 || !fits(&lhs) || !fits(&rhs) || out.strides[0] == 0 {
        return None;
    }
    fn inner<'a>(l: Layout<'a>) -> Layout<'a> {
        Layout {
            shape: &l.shape[1..],
            strides: &l.strides[1..],
        }
    }
    let mut p = plan_single(inner(lhs), inner(rhs), inner(out))?;
    let stride = |l: &Layout<'_>| if l.shape[0] == 1 { 0 } else { l.strides[0] };
    p.outer = n;
    p.outer_strides = [stride(&rhs), stride(&lhs), stride(&out)];
    Some(p)
}

/// [`plan`] as one call.
fn plan_single(lhs: Layout<'_>, rhs: Layout<'_>, out: Layout<'_>) -> Option<GemmPlan> {
    let rank = lhs.shape.len();
    let ranked = |l: &Layout<'_>| l.shape.len() == rank && l.strides.len() == rank;
    if rank < 2 || !ranked(&rhs) || !ranked(&out) {
        return None;
    }
    let (rows, k) = (lhs.shape[rank - 2], lhs.shape[rank - 1]);
    let (k_rhs, cols) = (rhs.shape[rank - 2], rhs.shape[rank - 1]);
    if k != k_rhs || rows == 0 || cols == 0 || k == 0 {
        return None;
    }
    let mut out_batch = Vec::with_capacity(rank - 2);
    for (l, r) in lhs.shape[..rank - 2].iter().zip(&rhs.shape[..rank - 2]) {
        out_batch.push(match (*l, *r) {
            (l, r) if l == r => l,
            (1, r) => r,
            (l, 1) => l,
            _ => return None,
        });
    }
    let batch: usize = out_batch.iter().product();
    if batch == 0 || out.shape[..rank - 2] != out_batch[..] || out.shape[rank - 2..] != [rows, cols]
    {
        return None;
    }
    // BLAS writes column-major `outᵀ`: the output's rows must be unit-stride.
    let (out_t, ldc) = matrix(rows, cols, out.strides[rank - 2], out.strides[rank - 1])?;
    if out_t {
        return None;
    }
    let out_batch_stride =
        batch_stride(&out_batch, &out.shape[..rank - 2], &out.strides[..rank - 2])?;
    // Batch entries that overlap would race.
    if batch > 1 && out_batch_stride < (rows - 1) * ldc + cols {
        return None;
    }
    let (lhs_t, lhs_ld) = matrix(rows, k, lhs.strides[rank - 2], lhs.strides[rank - 1])?;
    let (rhs_t, rhs_ld) = matrix(k, cols, rhs.strides[rank - 2], rhs.strides[rank - 1])?;
    let lhs_batch = batch_stride(&out_batch, &lhs.shape[..rank - 2], &lhs.strides[..rank - 2])?;
    let rhs_batch = batch_stride(&out_batch, &rhs.shape[..rank - 2], &rhs.strides[..rank - 2])?;

    let mut gemm = GemmPlan {
        m: cols,
        n: rows,
        k,
        batch,
        a: Operand {
            transpose: rhs_t,
            ld: rhs_ld,
            batch_stride: rhs_batch,
        },
        b: Operand {
            transpose: lhs_t,
            ld: lhs_ld,
            batch_stride: lhs_batch,
        },
        ldc,
        stride_c: out_batch_stride,
        outer: 1,
        outer_strides: [0; 3],
    };
    // A weight shared by the whole batch against row-major activations whose batches follow
    // each other evenly: one tall product instead of a batch of short ones.
    if batch > 1
        && rhs_batch == 0
        && !lhs_t
        && lhs_batch == rows * lhs_ld
        && out_batch_stride == rows * ldc
    {
        gemm.n = rows * batch;
        gemm.batch = 1;
        gemm.b.batch_stride = 0;
        gemm.stride_c = 0;
    }
    let fits = |x: usize| x <= i32::MAX as usize;
    let fits_stride = |x: usize| x <= i64::MAX as usize;
    let ok = [
        gemm.m, gemm.n, gemm.k, gemm.batch, gemm.a.ld, gemm.b.ld, gemm.ldc,
    ]
    .into_iter()
    .all(fits)
        && [gemm.a.batch_stride, gemm.b.batch_stride, gemm.stride_c]
            .into_iter()
            .all(fits_stride);
    ok.then_some(gemm)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row-major strides of a contiguous tensor.
    fn contiguous(shape: &[usize]) -> Vec<usize> {
        let mut strides = vec![1; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        strides
    }

    /// Element of a strided tensor at a multi-index.
    fn at(data: &[f64], strides: &[usize], index: &[usize]) -> f64 {
        data[index.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>()]
    }

    /// What a column-major BLAS computes for the plan, over raw buffers.
    fn run_plan(p: &GemmPlan, lhs: &[f64], rhs: &[f64], out_len: usize) -> Vec<f64> {
        let mut c = vec![f64::NAN; out_len];
        // `op(X)(i, j)` of a stored column-major matrix with leading dimension `ld`.
        let op = |x: &[f64], o: &Operand, base: usize, i: usize, j: usize| {
            if o.transpose {
                x[base + i * o.ld + j]
            } else {
                x[base + j * o.ld + i]
            }
        };
        for o in 0..p.outer {
            let [oa, ob, oc] = p.outer_strides.map(|s| s * o);
            for b in 0..p.batch {
                for i in 0..p.m {
                    for j in 0..p.n {
                        let mut acc = 0.0;
                        for l in 0..p.k {
                            acc += op(rhs, &p.a, oa + b * p.a.batch_stride, i, l)
                                * op(lhs, &p.b, ob + b * p.b.batch_stride, l, j);
                        }
                        c[oc + b * p.stride_c + j * p.ldc + i] = acc;
                    }
                }
            }
        }
        c
    }

    /// Checks the plan against a direct row-major batched product with broadcasting, into a
    /// contiguous output.
    fn check(
        lhs_shape: &[usize],
        lhs_strides: &[usize],
        rhs_shape: &[usize],
        rhs_strides: &[usize],
    ) -> GemmPlan {
        check_into(lhs_shape, lhs_strides, rhs_shape, rhs_strides, None)
    }

    /// [`check`] into an output with the given strides (contiguous when `None`).
    fn check_into(
        lhs_shape: &[usize],
        lhs_strides: &[usize],
        rhs_shape: &[usize],
        rhs_strides: &[usize],
        out_strides: Option<&[usize]>,
    ) -> GemmPlan {
        let span = |shape: &[usize], strides: &[usize]| {
            1 + shape
                .iter()
                .zip(strides)
                .map(|(n, s)| (n - 1) * s)
                .sum::<usize>()
        };
        let lhs: Vec<f64> = (0..span(lhs_shape, lhs_strides))
            .map(|i| (i % 7) as f64 - 3.0 + i as f64 * 0.01)
            .collect();
        let rhs: Vec<f64> = (0..span(rhs_shape, rhs_strides))
            .map(|i| (i % 5) as f64 - 2.0 - i as f64 * 0.02)
            .collect();
        let rank = lhs_shape.len();
        let out_batch: Vec<usize> = (0..rank - 2)
            .map(|d| lhs_shape[d].max(rhs_shape[d]))
            .collect();
        let (m, k, n) = (
            lhs_shape[rank - 2],
            lhs_shape[rank - 1],
            rhs_shape[rank - 1],
        );
        let mut out_shape = out_batch.clone();
        out_shape.extend([m, n]);
        let out_strides = out_strides
            .map(<[usize]>::to_vec)
            .unwrap_or_else(|| contiguous(&out_shape));
        let p = plan(
            Layout {
                shape: lhs_shape,
                strides: lhs_strides,
            },
            Layout {
                shape: rhs_shape,
                strides: rhs_strides,
            },
            Layout {
                shape: &out_shape,
                strides: &out_strides,
            },
        )
        .expect("a plan");
        let got = run_plan(&p, &lhs, &rhs, span(&out_shape, &out_strides));
        let batches: usize = out_batch.iter().product();
        for flat in 0..batches {
            let mut bi = vec![0; rank - 2];
            let mut rest = flat;
            for d in (0..rank - 2).rev() {
                bi[d] = rest % out_batch[d];
                rest /= out_batch[d];
            }
            let pick = |shape: &[usize], d: usize| if shape[d] == 1 { 0 } else { bi[d] };
            for i in 0..m {
                for j in 0..n {
                    let mut want = 0.0;
                    for l in 0..k {
                        let mut li: Vec<usize> =
                            (0..rank - 2).map(|d| pick(lhs_shape, d)).collect();
                        li.extend([i, l]);
                        let mut ri: Vec<usize> =
                            (0..rank - 2).map(|d| pick(rhs_shape, d)).collect();
                        ri.extend([l, j]);
                        want += at(&lhs, lhs_strides, &li) * at(&rhs, rhs_strides, &ri);
                    }
                    let mut oi = bi.clone();
                    oi.extend([i, j]);
                    let idx: usize = oi.iter().zip(&out_strides).map(|(a, b)| a * b).sum();
                    assert!(
                        (got[idx] - want).abs() < 1e-9,
                        "out{oi:?}: {} vs {want} with {p:?}",
                        got[idx]
                    );
                }
            }
        }
        p
    }

    #[test]
    fn contiguous_two_dimensional() {
        let p = check(&[3, 4], &[4, 1], &[4, 5], &[5, 1]);
        assert_eq!((p.m, p.n, p.k, p.batch), (5, 3, 4, 1));
        assert!(!p.a.transpose && !p.b.transpose);
    }

    #[test]
    fn transposed_views() {
        // lhs = xᵀ of a [4, 3] x; rhs = wᵀ of a [5, 4] w.
        let p = check(&[3, 4], &[1, 3], &[4, 5], &[1, 4]);
        assert!(p.a.transpose && p.b.transpose);
        check(&[3, 4], &[1, 3], &[4, 5], &[5, 1]);
        check(&[3, 4], &[4, 1], &[4, 5], &[1, 4]);
    }

    #[test]
    fn shared_weight_folds_the_batch_into_rows() {
        let p = check(&[2, 3, 4], &[12, 4, 1], &[1, 4, 5], &[20, 5, 1]);
        assert_eq!((p.n, p.batch), (6, 1));
        // A weight transposed in place folds too.
        let p = check(&[2, 3, 4], &[12, 4, 1], &[1, 4, 5], &[20, 1, 4]);
        assert_eq!((p.n, p.batch), (6, 1));
    }

    #[test]
    fn batched_attention_shapes() {
        // [b, h, t, d] @ [b, h, d, s] with K given as a transposed view of [b, h, s, d].
        let p = check(
            &[2, 3, 4, 5],
            &[60, 20, 5, 1],
            &[2, 3, 5, 6],
            &[90, 30, 1, 5],
        );
        assert_eq!(p.batch, 6);
        assert_eq!(p.a.batch_stride, 30);
        // A batch of one in front of the heads: only the heads iterate.
        let p = check(
            &[1, 3, 4, 5],
            &[999, 20, 5, 1],
            &[1, 3, 5, 6],
            &[7, 30, 6, 1],
        );
        assert_eq!((p.batch, p.b.batch_stride), (3, 20));
    }

    #[test]
    fn broadcast_lhs_and_sliced_rows() {
        // The left side broadcasts over the batch: no fold, batch stride 0.
        let p = check(&[1, 3, 4], &[12, 4, 1], &[2, 4, 5], &[20, 5, 1]);
        assert_eq!((p.b.batch_stride, p.batch), (0, 2));
        // Rows of a wider buffer (a narrow along the last dimension): leading dimension 10.
        let p = check(&[2, 3, 4], &[30, 10, 1], &[1, 4, 5], &[20, 5, 1]);
        assert_eq!(p.b.ld, 10);
        // Single-row and single-column operands with arbitrary strides on their unit dims.
        check(&[1, 4], &[99, 1], &[4, 1], &[1, 77]);
    }

    #[test]
    fn heads_interleaved_with_positions_loop_over_the_batch() {
        // dV = Pᵀ dO: P transposed, dO a view [b, h, t, d] of a [b, t, h, d] buffer, whose
        // batch dimensions do not nest into one stride: one call per batch entry.
        let p = check(
            &[2, 3, 8, 8],
            &[192, 64, 1, 8],
            &[2, 3, 8, 4],
            &[96, 4, 12, 1],
        );
        assert_eq!(
            (p.outer, p.outer_strides, p.batch, p.a.ld, p.a.batch_stride),
            (2, [96, 192, 96], 3, 12, 4)
        );
        // Heads interleaved with positions on the left, and a right side broadcast over the
        // heads but not over the batch.
        let p = check(
            &[2, 3, 4, 5],
            &[60, 5, 15, 1],
            &[2, 3, 5, 6],
            &[90, 30, 6, 1],
        );
        assert_eq!((p.outer, p.batch), (2, 3));
        let p = check(
            &[2, 3, 4, 5],
            &[60, 20, 5, 1],
            &[2, 1, 5, 6],
            &[30, 30, 6, 1],
        );
        assert_eq!((p.outer, p.a.batch_stride), (2, 0));
        // Q Kᵀ with such a Q, and a grouped broadcast K over the batch.
        let p = check(
            &[2, 3, 8, 4],
            &[96, 4, 12, 1],
            &[1, 3, 4, 8],
            &[0, 32, 1, 4],
        );
        assert_eq!((p.outer, p.outer_strides[0]), (2, 0));
        assert_eq!(GemmPlan::from_words(&p.to_words()), Some(p));
    }

    #[test]
    fn only_the_unwalkable_operand_is_copied() {
        let l = |shape: &'static [usize], strides: &'static [usize]| Layout { shape, strides };
        // Three batch dimensions, the inner two interleaved with the rows: no loop of calls
        // expresses them, so the unwalkable operand (alone) is copied.
        let p_t = l(&[2, 2, 3, 8, 8], &[384, 192, 64, 1, 8]);
        let d_o = l(&[2, 2, 3, 8, 4], &[192, 4, 8, 24, 1]);
        let out = l(&[2, 2, 3, 8, 4], &[192, 96, 32, 4, 1]);
        assert!(plan(p_t, d_o, out).is_none());
        assert_eq!(copies_needed(p_t, d_o, out), Some((false, true)));
        // The mirror case, and both unwalkable.
        let q = l(&[2, 2, 3, 8, 4], &[192, 4, 8, 24, 1]);
        let k_t = l(&[2, 2, 3, 4, 8], &[192, 96, 32, 1, 4]);
        assert_eq!(
            copies_needed(q, k_t, l(&[2, 2, 3, 8, 8], &[384, 192, 64, 8, 1])),
            Some((true, false))
        );
        assert_eq!(
            copies_needed(
                q,
                l(&[2, 2, 3, 4, 4], &[96, 4, 8, 24, 1]),
                l(&[2, 2, 3, 8, 4], &[192, 96, 32, 4, 1])
            ),
            Some((true, true))
        );
        // Contiguous operands that do not fit: no copy helps.
        let a = l(&[3, 4], &[4, 1]);
        assert_eq!(
            copies_needed(a, l(&[5, 5], &[5, 1]), l(&[3, 5], &[5, 1])),
            None
        );
    }

    #[test]
    fn plans_survive_their_words() {
        let p = check_into(
            &[2, 3, 4],
            &[12, 4, 1],
            &[1, 4, 5],
            &[20, 5, 1],
            Some(&[30, 8, 1]),
        );
        assert_eq!(GemmPlan::from_words(&p.to_words()), Some(p));
        let p = check(&[2, 3, 4], &[12, 1, 3], &[2, 4, 5], &[20, 1, 4]);
        assert!(p.a.transpose && p.b.transpose);
        assert_eq!(GemmPlan::from_words(&p.to_words()), Some(p));
        assert_eq!(GemmPlan::from_words(&p.to_words()[..PLAN_WORDS - 1]), None);
    }

    #[test]
    fn pitched_outputs() {
        // Rows padded to 8 elements, batch entries 32 apart: written in place.
        let p = check_into(
            &[2, 3, 4],
            &[12, 4, 1],
            &[2, 4, 5],
            &[20, 5, 1],
            Some(&[32, 8, 1]),
        );
        assert_eq!((p.ldc, p.stride_c, p.batch), (8, 32, 2));
        // A shared weight still folds when the padded batches follow each other evenly...
        let p = check_into(
            &[2, 3, 4],
            &[12, 4, 1],
            &[1, 4, 5],
            &[20, 5, 1],
            Some(&[24, 8, 1]),
        );
        assert_eq!((p.n, p.batch, p.ldc), (6, 1, 8));
        // ...and stays batched when they do not.
        let p = check_into(
            &[2, 3, 4],
            &[12, 4, 1],
            &[1, 4, 5],
            &[20, 5, 1],
            Some(&[30, 8, 1]),
        );
        assert_eq!((p.n, p.batch, p.stride_c), (3, 2, 30));
    }

    #[test]
    fn inexpressible_layouts_are_declined() {
        let out = |shape: &'static [usize], strides: &'static [usize]| Layout { shape, strides };
        // A transposed output, and batch entries that overlap.
        assert!(plan(
            Layout {
                shape: &[3, 4],
                strides: &[4, 1]
            },
            Layout {
                shape: &[4, 5],
                strides: &[5, 1]
            },
            out(&[3, 5], &[1, 3]),
        )
        .is_none());
        assert!(plan(
            Layout {
                shape: &[2, 3, 4],
                strides: &[12, 4, 1]
            },
            Layout {
                shape: &[2, 4, 5],
                strides: &[20, 5, 1]
            },
            out(&[2, 3, 5], &[10, 5, 1]),
        )
        .is_none());
        // Broadcast in one inner batch dimension but not the other (the outermost one may
        // differ: it becomes the loop).
        assert!(plan(
            Layout {
                shape: &[2, 2, 3, 4, 5],
                strides: &[120, 60, 20, 5, 1]
            },
            Layout {
                shape: &[2, 2, 1, 5, 6],
                strides: &[60, 30, 30, 6, 1]
            },
            out(&[2, 2, 3, 4, 6], &[144, 72, 24, 6, 1]),
        )
        .is_none());
        // Neither dimension of the matrix is unit-stride.
        assert!(plan(
            Layout {
                shape: &[3, 4],
                strides: &[8, 2]
            },
            Layout {
                shape: &[4, 5],
                strides: &[5, 1]
            },
            out(&[3, 5], &[5, 1]),
        )
        .is_none());
        // Empty and mismatched products.
        let empty = Layout {
            shape: &[3, 0],
            strides: &[0, 1],
        };
        assert!(plan(
            empty,
            Layout {
                shape: &[0, 5],
                strides: &[5, 1]
            },
            out(&[3, 5], &[5, 1])
        )
        .is_none());
        let lhs = Layout {
            shape: &[3, 4],
            strides: &[4, 1],
        };
        assert!(plan(
            lhs,
            Layout {
                shape: &[5, 5],
                strides: &[5, 1]
            },
            out(&[3, 5], &[5, 1])
        )
        .is_none());
    }
}
