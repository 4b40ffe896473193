//! Test data shared by tests/device.rs, tests/gpu_session.rs and tests/kernels.rs.
#![allow(dead_code)]

use faer::Mat;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub fn random(rows: usize, cols: usize, seed: u64) -> Mat<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    Mat::from_fn(rows, cols, |_, _| rng.random_range(-1.0f32..1.0))
}

/// Correlated activations (low-rank signal plus noise), a dead input column, split into batches.
pub fn batches(tokens: usize, n: usize, seed: u64) -> Vec<Mat<f32>> {
    let latent = random(tokens, 8, seed);
    let mix = random(8, n, seed + 1);
    let noise = random(tokens, n, seed + 2);
    let x = Mat::from_fn(tokens, n, |t, c| {
        if c == n / 3 {
            return 0.0;
        }
        let s: f32 = (0..8).map(|k| latent[(t, k)] * mix[(k, c)]).sum();
        s + 0.1 * noise[(t, c)]
    });
    let step = tokens.div_ceil(3);
    (0..tokens)
        .step_by(step)
        .map(|t0| x.subrows(t0, step.min(tokens - t0)).to_owned())
        .collect()
}
