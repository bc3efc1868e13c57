//! Seeds derived from the run's seed, so data order and sampling depend only on (seed, step,
//! item) and a resumed run repeats them exactly; and the generator they seed.
//!
//! Everything that must replay draws from [`ReplayRng`]: ChaCha8 (`rand_chacha`, whose
//! output stream is fixed by the cipher's specification), keyed from the seed by splitmix64,
//! with floats and ranges derived here rather than by `rand`'s distributions (whose
//! algorithms may change between versions, as `StdRng`'s generator itself may).

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A well-mixed seed for item `k` of step `step` of a run seeded `seed` (splitmix64 finaliser).
pub fn derive(seed: u64, step: u64, k: u64) -> u64 {
    let mut z = seed
        .wrapping_add(step.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(k.wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seeded generator whose sequence is the same on every platform and version: ChaCha8
/// keyed by `derive(seed, i, 0x6b65_79)` for the key's four words.
#[derive(Debug, Clone)]
pub struct ReplayRng(ChaCha8Rng);

impl ReplayRng {
    /// The generator of `seed`.
    pub fn new(seed: u64) -> Self {
        let mut key = [0u8; 32];
        for (i, chunk) in key.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&derive(seed, i as u64, 0x6b_6579).to_le_bytes());
        }
        Self(ChaCha8Rng::from_seed(key))
    }

    /// The next 64 bits of the stream.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [0, 1): the top 53 bits of the next word.
    pub fn unit_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n > 0`), without bias: words in the incomplete last block of
    /// `n` are drawn again.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        let zone = u64::MAX - (u64::MAX % n + 1) % n;
        loop {
            let x = self.next_u64();
            if x <= zone {
                return x % n;
            }
        }
    }
}

/// A seeded permutation of `0..n` (Fisher-Yates).
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = ReplayRng::new(seed);
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
    v
}
