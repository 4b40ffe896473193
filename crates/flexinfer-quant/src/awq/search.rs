//! AWQ's two searches on one group of linears that share an input `x` (`[tokens, in]`):
//! - [`search_scales`]: per-input-channel scales `s = x̄^α / w̄^(1−α)` (normalised by
//!   `sqrt(max · min)`), α over a grid, the one whose pseudo-quantized `W·diag(s)` (then `/s`) gives the
//!   outputs closest to the full-precision ones on `x`; `s = 1` (plain rounding) is a candidate too, so
//!   the choice is never worse than round-to-nearest on the calibration tokens;
//! - [`search_clip`]: per output row and group, the range bound `max|w| · (1 − i/20)`, `i < 10`, whose
//!   pseudo-quantized group output is closest to the original on (a sample of) `x`.
//!
//! Both measure the error of the linears' own outputs (not of the whole attention/MLP block as
//! AutoAWQ does for q/k/v and gate/up): the same quantity for every group, and no block forward per
//! candidate.

use super::gemm::{fake_group, fake_quantize};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef};

/// Candidates of α: `0, 1/GRID, …, (GRID−1)/GRID` (AutoAWQ's grid).
pub const GRID: usize = 20;
/// Range bounds tried by the clipping search: `1 − i/CLIP_GRID` for `i < CLIP_STEPS`.
const CLIP_GRID: usize = 20;
const CLIP_STEPS: usize = 10;

/// What the scale search chose.
#[derive(Clone, Debug)]
pub struct ScaleChoice {
    /// Per input channel; all ones when plain rounding won.
    pub scales: Vec<f32>,
    /// α of the chosen scales, `None` for plain rounding.
    pub ratio: Option<f32>,
    /// Mean squared output error of the choice, and of plain rounding, on `x`.
    pub loss: f64,
    pub plain_loss: f64,
}

/// `x·Wᵀ` (`[tokens, out]`).
fn outputs(x: MatRef<'_, f32>, w: MatRef<'_, f32>) -> Mat<f32> {
    outputs_par(x, w, faer::get_global_parallelism())
}

fn outputs_par(x: MatRef<'_, f32>, w: MatRef<'_, f32>, par: faer::Par) -> Mat<f32> {
    let mut y = Mat::<f32>::zeros(x.nrows(), w.nrows());
    matmul(y.as_mut(), Accum::Replace, x, w.transpose(), 1.0, par);
    y
}

fn row_major(w: MatRef<'_, f32>) -> Vec<f32> {
    let (rows, cols) = (w.nrows(), w.ncols());
    let mut v = vec![0f32; rows * cols];
    for c in 0..cols {
        for r in 0..rows {
            v[r * cols + c] = w[(r, c)];
        }
    }
    v
}

/// Mean |x| per input channel.
pub fn activation_mean(x: MatRef<'_, f32>) -> Vec<f32> {
    let t = x.nrows().max(1) as f32;
    (0..x.ncols())
        .map(|c| x.col(c).iter().map(|v| v.abs()).sum::<f32>() / t)
        .collect()
}

/// Mean over all rows of the group-normalised `|w| / max_group |w|` per input channel.
pub fn weight_mean(linears: &[&Mat<f32>], group: usize) -> Vec<f32> {
    let cols = linears.first().map_or(0, |w| w.ncols());
    let mut sum = vec![0f64; cols];
    let mut rows = 0usize;
    for w in linears {
        for r in 0..w.nrows() {
            for g in 0..cols / group {
                let span = g * group..(g + 1) * group;
                let max = span
                    .clone()
                    .map(|c| w[(r, c)].abs())
                    .fold(0f32, f32::max)
                    .max(1e-12);
                for c in span {
                    sum[c] += f64::from(w[(r, c)].abs() / max);
                }
            }
            rows += 1;
        }
    }
    sum.iter()
        .map(|s| (s / rows.max(1) as f64) as f32)
        .collect()
}

/// The scales of ratio α: `x̄^α / w̄^(1−α)`, floored at 1e-4 and divided by `sqrt(max · min)`.
pub fn scales_for(x_mean: &[f32], w_mean: &[f32], ratio: f32) -> Vec<f32> {
    let mut s: Vec<f32> = x_mean
        .iter()
        .zip(w_mean)
        .map(|(&x, &w)| (x.powf(ratio) / w.max(1e-12).powf(1.0 - ratio)).max(1e-4))
        .collect();
    let max = s.iter().copied().fold(f32::MIN, f32::max);
    let min = s.iter().copied().fold(f32::MAX, f32::min);
    let norm = (max * min).sqrt();
    if norm.is_finite() && norm > 0.0 {
        s.iter_mut().for_each(|v| *v /= norm);
    }
    s
}

/// Mean squared error over `tokens` inputs of the pseudo-quantized `W·diag(s)` (then `/s`) outputs:
/// `Σ_r d_r · H · d_rᵀ / (rows · tokens)` with `d = W_q − W` and the Gram matrix `H = xᵀx` (the same sum as
/// over the tokens, at `in²` instead of `tokens · in` per row).
fn scaled_loss(
    gram: MatRef<'_, f32>,
    tokens: usize,
    linears: &[&Mat<f32>],
    scales: &[f32],
    group: usize,
) -> f64 {
    let (mut err, mut n) = (0f64, 0usize);
    for w in linears {
        let (rows, cols) = (w.nrows(), w.ncols());
        let scaled = Mat::from_fn(rows, cols, |r, c| w[(r, c)] * scales[c]);
        let q = fake_quantize(&row_major(scaled.as_ref()), rows, cols, group);
        let d = Mat::from_fn(rows, cols, |r, c| q[r * cols + c] / scales[c] - w[(r, c)]);
        let mut dh = Mat::<f32>::zeros(rows, cols);
        matmul(
            dh.as_mut(),
            Accum::Replace,
            d.as_ref(),
            gram,
            1.0,
            faer::get_global_parallelism(),
        );
        for c in 0..cols {
            for (a, b) in d.col(c).iter().zip(dh.col(c).iter()) {
                err += f64::from(a * b);
            }
        }
        n += rows * tokens;
    }
    err / n.max(1) as f64
}

/// Searches the per-channel scales of the group `linears` (each `[out, in]`) on the input `x`.
pub fn search_scales(x: MatRef<'_, f32>, linears: &[&Mat<f32>], group: usize) -> ScaleChoice {
    let cols = x.ncols();
    let gram = outputs(x.transpose(), x.transpose());
    let tokens = x.nrows();
    let ones = vec![1f32; cols];
    let plain_loss = scaled_loss(gram.as_ref(), tokens, linears, &ones, group);
    let (x_mean, w_mean) = (activation_mean(x), weight_mean(linears, group));
    let mut best = ScaleChoice {
        scales: ones,
        ratio: None,
        loss: plain_loss,
        plain_loss,
    };
    for k in 0..GRID {
        let ratio = k as f32 / GRID as f32;
        let s = scales_for(&x_mean, &w_mean, ratio);
        if s.iter().any(|v| !v.is_finite() || *v <= 0.0) {
            continue;
        }
        let loss = scaled_loss(gram.as_ref(), tokens, linears, &s, group);
        if loss < best.loss {
            best = ScaleChoice {
                scales: s,
                ratio: Some(ratio),
                loss,
                plain_loss,
            };
        }
    }
    best
}

/// Per output row and group (`clip[r·groups + g]`), the range bound whose pseudo-quantized group output
/// on `x` is closest to the original's; `f32::INFINITY` where no bound beats the full range. Each
/// candidate bound of a group is one product `x_g · W_gᵀ` over all rows at once.
pub fn search_clip(x: MatRef<'_, f32>, w: &Mat<f32>, group: usize) -> Vec<f32> {
    let (rows, cols) = (w.nrows(), w.ncols());
    let groups = cols / group;
    let mut clip = vec![f32::INFINITY; rows * groups];
    let mut best_err = vec![f64::INFINITY; rows];
    let (mut span, mut fq) = (vec![0f32; group], vec![0f32; group]);
    let mut wq = Mat::<f32>::zeros(rows, group);
    for g in 0..groups {
        let xg = x.subcols(g * group, group);
        let wg = w.as_ref().subcols(g * group, group);
        let org = outputs_par(xg, wg, faer::Par::Seq);
        let max: Vec<f32> = (0..rows)
            .map(|r| (0..group).fold(0f32, |m, i| m.max(wg[(r, i)].abs())))
            .collect();
        best_err.iter_mut().for_each(|e| *e = f64::INFINITY);
        for i in 0..CLIP_STEPS {
            for r in 0..rows {
                let bound = if i == 0 {
                    f32::INFINITY
                } else {
                    max[r] * (1.0 - i as f32 / CLIP_GRID as f32)
                };
                for (k, v) in span.iter_mut().enumerate() {
                    *v = wg[(r, k)];
                }
                fake_group(&span, bound, &mut fq);
                for (k, v) in fq.iter().enumerate() {
                    wq[(r, k)] = *v;
                }
            }
            // One group's product is small: threads would mostly wait on each other.
            let y = outputs_par(xg, wq.as_ref(), faer::Par::Seq);
            for r in 0..rows {
                let err: f64 = y
                    .col(r)
                    .iter()
                    .zip(org.col(r).iter())
                    .map(|(a, b)| f64::from(a - b).powi(2))
                    .sum();
                if err < best_err[r] {
                    best_err[r] = err;
                    clip[r * groups + g] = if i == 0 {
                        f32::INFINITY
                    } else {
                        max[r] * (1.0 - i as f32 / CLIP_GRID as f32)
                    };
                }
            }
        }
    }
    clip
}

/// At most `max` rows of `x`, evenly strided (the searches' token sample).
pub fn sample_rows(x: MatRef<'_, f32>, max: usize) -> Mat<f32> {
    let n = x.nrows();
    if n <= max {
        return x.to_owned();
    }
    Mat::from_fn(max, x.ncols(), |r, c| x[(r * n / max, c)])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    use super::super::test_rand as rand;

    /// Activations with a few outlier channels (what AWQ is for) and a random weight.
    fn case(tokens: usize, rows: usize, cols: usize) -> (Mat<f32>, Mat<f32>) {
        let mut s = 7u64;
        let x = Mat::from_fn(tokens, cols, |_, c| {
            rand(&mut s) * if c % 16 == 3 { 20.0 } else { 1.0 }
        });
        let w = Mat::from_fn(rows, cols, |_, _| rand(&mut s) * 0.1);
        (x, w)
    }

    /// Straightforward recomputation of the loss for the scales the search returned.
    fn loss_of(x: &Mat<f32>, w: &Mat<f32>, s: &[f32], group: usize) -> f64 {
        let (rows, cols) = (w.nrows(), w.ncols());
        let mut err = 0f64;
        let mut deq = vec![0f32; rows * cols];
        for r in 0..rows {
            for g in 0..cols / group {
                let span: Vec<f32> = (0..group)
                    .map(|i| w[(r, g * group + i)] * s[g * group + i])
                    .collect();
                let mut out = vec![0f32; group];
                fake_group(&span, f32::INFINITY, &mut out);
                for i in 0..group {
                    deq[r * cols + g * group + i] = out[i] / s[g * group + i];
                }
            }
        }
        for t in 0..x.nrows() {
            for r in 0..rows {
                let (mut a, mut b) = (0f64, 0f64);
                for c in 0..cols {
                    a += f64::from(x[(t, c)]) * f64::from(w[(r, c)]);
                    b += f64::from(x[(t, c)]) * f64::from(deq[r * cols + c]);
                }
                err += (a - b).powi(2);
            }
        }
        err / (rows * x.nrows()) as f64
    }

    #[test]
    fn the_chosen_scales_beat_plain_rounding_on_outlier_channels() {
        let (x, w) = case(64, 16, 64);
        let c = search_scales(x.as_ref(), &[&w], 32);
        assert!(c.ratio.is_some(), "plain rounding chosen: {c:?}");
        assert!(
            c.loss < c.plain_loss * 0.9,
            "{} vs {}",
            c.loss,
            c.plain_loss
        );
        let ones = vec![1f32; 64];
        let plain = loss_of(&x, &w, &ones, 32);
        let chosen = loss_of(&x, &w, &c.scales, 32);
        assert!(
            (plain - c.plain_loss).abs() <= plain * 1e-3,
            "{plain} {}",
            c.plain_loss
        );
        assert!(
            (chosen - c.loss).abs() <= chosen * 1e-3,
            "{chosen} {}",
            c.loss
        );
        // Outlier channels get the larger scales.
        assert!(c.scales[3] > c.scales[4] && c.scales[19] > c.scales[20]);
    }

    #[test]
    fn scales_are_normalised_and_alpha_zero_ignores_activations() {
        let xm = vec![1.0, 4.0, 0.5, 2.0];
        let wm = vec![0.5, 0.5, 0.25, 1.0];
        let s = scales_for(&xm, &wm, 0.0);
        let max = s.iter().copied().fold(f32::MIN, f32::max);
        let min = s.iter().copied().fold(f32::MAX, f32::min);
        assert!((max * min - 1.0).abs() < 1e-5);
        // α = 0: s ∝ 1 / w̄.
        assert!((s[0] / s[3] - 2.0).abs() < 1e-5 && (s[0] - s[1]).abs() < 1e-6);
        let s1 = scales_for(&xm, &wm, 1.0);
        assert!((s1[1] / s1[0] - 4.0).abs() < 1e-4);
    }

    #[test]
    fn the_clip_never_raises_the_group_output_error() {
        let (x, w) = case(48, 8, 64);
        let clip = search_clip(x.as_ref(), &w, 32);
        assert_eq!(clip.len(), 16);
        let mut clipped_any = false;
        for r in 0..8 {
            for g in 0..2 {
                let span: Vec<f32> = (0..32).map(|i| w[(r, g * 32 + i)]).collect();
                let err = |bound: f32| {
                    let mut q = vec![0f32; 32];
                    fake_group(&span, bound, &mut q);
                    (0..48)
                        .map(|t| {
                            let d: f32 =
                                (0..32).map(|i| x[(t, g * 32 + i)] * (q[i] - span[i])).sum();
                            f64::from(d).powi(2)
                        })
                        .sum::<f64>()
                };
                let b = clip[r * 2 + g];
                clipped_any |= b.is_finite();
                assert!(
                    err(b) <= err(f32::INFINITY) * (1.0 + 1e-4),
                    "[{r},{g}] bound {b}"
                );
                let max = span.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(!b.is_finite() || (b < max && b >= max * 0.5));
            }
        }
        assert!(clipped_any, "no group clipped");
    }
}
