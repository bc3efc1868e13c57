//! Matrix products on burn's CUDA backend through cuBLAS (`trainer::blas::cublas`) against the
//! same products on the CPU backend: plain, transposed and sliced views, batched attention
//! shapes, a weight shared by a batch, and the views the model makes. GPU only:
//! `cargo test --release -p trainer --features cuda --test cublas -- --ignored`.
//! The layout mapping itself is unit-tested on the CPU (`blas::plan`).

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(feature = "cuda")]

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use std::sync::Once;

type Gpu<F> = burn::backend::Cuda<F>;
type Cpu = NdArray<f32>;

fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| trainer::blas::cublas::install().expect("cuBLAS loads"));
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = trainer::seeds::ReplayRng::new(seed);
    (0..n).map(|_| rng.unit_f64() as f32 * 2.0 - 1.0).collect()
}

/// A tensor with the same values on both backends.
fn pair<B: Backend, const D: usize>(
    shape: [usize; D],
    seed: u64,
    device: &B::Device,
) -> (Tensor<B, D>, Tensor<Cpu, D>) {
    let n = shape.iter().product();
    let data = TensorData::new(values(n, seed), shape);
    (
        Tensor::from_data(data.clone(), device),
        Tensor::from_data(data, &Default::default()),
    )
}

fn max_rel_diff<B: Backend, const D: usize>(got: Tensor<B, D>, want: Tensor<Cpu, D>) -> f32 {
    assert_eq!(got.dims(), want.dims());
    let got: Vec<f32> = got.into_data().convert::<f32>().to_vec().unwrap();
    let want: Vec<f32> = want.into_data().to_vec().unwrap();
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    got.iter()
        .zip(&want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

/// Every layout case; `tol` is relative to the largest output.
fn check_products<G: Backend<Device = burn::backend::cuda::CudaDevice>>(tol: f32) {
    install();
    let dev = burn::backend::cuda::CudaDevice::new(0);
    let runs_before = trainer::blas::cublas::counts().run;
    let mut cases = 0u64;
    let mut check = |what: &str, diff: f32| {
        cases += 1;
        assert!(
            diff < tol,
            "{what}: relative difference {diff} (tolerance {tol})"
        );
    };

    // Plain 2-D, with k not a multiple of anything.
    let (a, ca) = pair::<G, 2>([33, 77], 1, &dev);
    let (b, cb) = pair::<G, 2>([77, 65], 2, &dev);
    check(
        "2-D",
        max_rel_diff(a.clone().matmul(b.clone()), ca.clone().matmul(cb.clone())),
    );
    // Transposed operands, as the backward pass makes them.
    check(
        "lhsᵀ",
        max_rel_diff(
            a.clone().transpose().matmul(a.clone()),
            ca.clone().transpose().matmul(ca.clone()),
        ),
    );
    check(
        "rhsᵀ",
        max_rel_diff(
            a.clone().matmul(a.clone().transpose()),
            ca.clone().matmul(ca.clone().transpose()),
        ),
    );
    // A column slice: rows of a wider buffer.
    check(
        "narrowed lhs",
        max_rel_diff(
            a.clone()
                .narrow(1, 7, 65)
                .matmul(b.clone().narrow(0, 3, 65)),
            ca.clone()
                .narrow(1, 7, 65)
                .matmul(cb.clone().narrow(0, 3, 65)),
        ),
    );
    // Matrix-vector, as at decoding time.
    let (v, cv) = pair::<G, 2>([1, 77], 3, &dev);
    check(
        "one row",
        max_rel_diff(v.matmul(b.clone()), cv.matmul(cb.clone())),
    );

    // A batch against a shared weight (folded into one tall product) and a broadcast lhs.
    let (x, cx) = pair::<G, 3>([3, 17, 77], 4, &dev);
    check(
        "shared weight",
        max_rel_diff(
            x.clone().matmul(b.clone().unsqueeze()),
            cx.clone().matmul(cb.clone().unsqueeze()),
        ),
    );
    let (y, cy) = pair::<G, 3>([3, 77, 29], 5, &dev);
    check(
        "broadcast lhs",
        max_rel_diff(
            a.clone().unsqueeze::<3>().matmul(y.clone()),
            ca.clone().unsqueeze::<3>().matmul(cy.clone()),
        ),
    );

    // Attention: [b, t, h, d] projections seen as [b, h, t, d] (not walkable: copied), and
    // K transposed.
    let (q, cq) = pair::<G, 4>([2, 19, 3, 16], 6, &dev);
    let (k, ck) = pair::<G, 4>([2, 23, 3, 16], 7, &dev);
    let scores = q
        .clone()
        .swap_dims(1, 2)
        .matmul(k.clone().swap_dims(1, 2).swap_dims(2, 3));
    let cscores = cq
        .clone()
        .swap_dims(1, 2)
        .matmul(ck.clone().swap_dims(1, 2).swap_dims(2, 3));
    check(
        "attention scores",
        max_rel_diff(scores.clone(), cscores.clone()),
    );
    check(
        "probabilities @ V",
        max_rel_diff(
            scores.matmul(k.clone().swap_dims(1, 2)),
            cscores.matmul(ck.clone().swap_dims(1, 2)),
        ),
    );

    // The model's own layer on rows: what Dense::forward does.
    let rows: Tensor<G, 2> = x.clone().reshape([-1, 77]);
    let crows: Tensor<Cpu, 2> = cx.clone().reshape([-1, 77]);
    check(
        "flattened rows",
        max_rel_diff(rows.matmul(b.clone()), crows.matmul(cb.clone())),
    );

    // A dependent chain of products and elementwise kernels, its temporaries dropped while
    // still queued: products run in launch order on the device thread, behind the kernels
    // that produce their operands and ahead of those that read their outputs.
    let (w, cw) = pair::<G, 2>([77, 77], 8, &dev);
    let (mut h, mut ch) = pair::<G, 2>([33, 77], 9, &dev);
    for step in 0..8 {
        h = (h.matmul(w.clone()) * 0.25).sin() + (step as f32);
        ch = (ch.matmul(cw.clone()) * 0.25).sin() + (step as f32);
    }
    check("chain of products and kernels", max_rel_diff(h, ch));

    let runs_after = trainer::blas::cublas::counts().run;
    assert!(
        runs_after - runs_before >= cases,
        "cuBLAS ran {} products for {cases} cases",
        runs_after - runs_before
    );
}

// One test: the counters are global, and both precisions must reach cuBLAS.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p trainer --features cuda --test cublas -- --ignored"]
fn cublas_products_match_the_cpu_in_f32_and_bf16() {
    check_products::<Gpu<f32>>(1e-5);
    check_products::<Gpu<half::bf16>>(2e-2);
}
