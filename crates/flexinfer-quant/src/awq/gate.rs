//! The AWQ quality gate, the analogue of GPTQ's RTN-fallback gate: for each quantized linear, the mean
//! squared output error of what the artifact computes (its 4-bit weights with the searched scales and
//! clipping, the scales undone through the folded norm or linear) over that of plain round-to-nearest of
//! the source weight (the same 4-bit groups, no scales, no clipping), both on a sample of the calibration
//! tokens that reach the linear in the full-precision model. Below 1 the search helped; the run fails
//! when the mean over the linears exceeds `AWQ_MAX_OUTPUT_ERROR_RATIO`, i.e. when AWQ did worse on the
//! calibration data than the rounding it is meant to improve on.

use super::gemm::fake_quantize;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef};

/// Default of `AWQ_MAX_OUTPUT_ERROR_RATIO`: no worse, on average, than plain rounding.
pub const DEFAULT_MAX_OUTPUT_ERROR_RATIO: f64 = 1.0;
/// Calibration tokens (evenly strided) each linear's output error is measured on.
pub const GATE_TOKENS: usize = 512;

/// Mean squared entry of `x·(a − b)ᵀ` (`a`, `b`: `[out, in]`).
fn output_mse(x: MatRef<'_, f32>, a: MatRef<'_, f32>, b: MatRef<'_, f32>) -> f64 {
    let d = Mat::from_fn(a.nrows(), a.ncols(), |r, c| a[(r, c)] - b[(r, c)]);
    let mut y = Mat::<f32>::zeros(x.nrows(), d.nrows());
    matmul(
        y.as_mut(),
        Accum::Replace,
        x,
        d.transpose(),
        1.0,
        faer::get_global_parallelism(),
    );
    let n = (y.nrows() * y.ncols()).max(1) as f64;
    let mut sum = 0f64;
    for c in 0..y.ncols() {
        for v in y.col(c).iter() {
            sum += f64::from(*v).powi(2);
        }
    }
    sum / n
}

/// (output error of `effective`) / (output error of plain rounding of `source`) on `x`: `source` the
/// linear's full-precision weight `[out, in]`, `effective` what the artifact computes in its place (same
/// shape, same input), `group` the quantization group size. Two exact zeros give 0; a finite ratio always.
pub fn output_error_ratio(
    x: MatRef<'_, f32>,
    source: &Mat<f32>,
    effective: &Mat<f32>,
    group: usize,
) -> f64 {
    let (rows, cols) = (source.nrows(), source.ncols());
    let flat: Vec<f32> = (0..rows * cols)
        .map(|i| source[(i / cols, i % cols)])
        .collect();
    let rtn = fake_quantize(&flat, rows, cols, group);
    let rtn = Mat::from_fn(rows, cols, |r, c| rtn[r * cols + c]);
    let awq = output_mse(x, source.as_ref(), effective.as_ref());
    let plain = output_mse(x, source.as_ref(), rtn.as_ref());
    let tiny = f64::MIN_POSITIVE;
    (awq / plain.max(tiny)).min(f64::MAX)
}

/// [`output_error_ratio`] of one linear in the source model's terms: `folded` (its weight after the folds,
/// `[rows, cols]`) and `deq` (its dequantized codes, row-major) mapped back through `col_scale` and
/// `row_scale` (`W = diag(row) · W_folded · diag(1/col)`), measured on the unfolded tokens `x`.
pub fn folded_ratio(
    x: &Mat<f32>,
    folded: &Mat<f32>,
    deq: &[f32],
    col_scale: Option<&[f32]>,
    row_scale: Option<&[f32]>,
    group: usize,
) -> f64 {
    let (rows, cols) = (folded.nrows(), folded.ncols());
    let back = |r: usize, c: usize, v: f32| {
        let v = row_scale.map_or(v, |s| v * s[r]);
        col_scale.map_or(v, |s| v / s[c])
    };
    let source = Mat::from_fn(rows, cols, |r, c| back(r, c, folded[(r, c)]));
    let effective = Mat::from_fn(rows, cols, |r, c| back(r, c, deq[r * cols + c]));
    output_error_ratio(x.as_ref(), &source, &effective, group)
}

/// The gate's figures over a run's linears.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// Mean of the per-linear ratios (0 without linears).
    pub mean_ratio: f64,
    /// The largest ratio and its linear.
    pub worst_ratio: f64,
    pub worst_module: String,
    /// `passed` or `failed`.
    pub gate: &'static str,
}

/// `failed` when the mean ratio exceeds `max_mean_ratio`.
pub fn evaluate(ratios: &[(String, f64)], max_mean_ratio: f64) -> Verdict {
    let mean_ratio = if ratios.is_empty() {
        0.0
    } else {
        ratios.iter().map(|r| r.1).sum::<f64>() / ratios.len() as f64
    };
    let (worst_module, worst_ratio) = ratios
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .cloned()
        .unwrap_or_default();
    Verdict {
        mean_ratio,
        worst_ratio,
        worst_module,
        gate: if mean_ratio > max_mean_ratio {
            "failed"
        } else {
            "passed"
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    use super::super::test_rand as rand;

    /// Straightforward `Σ (x·(a−b)ᵀ)² / n`, loop by loop.
    fn naive_mse(x: &Mat<f32>, a: &Mat<f32>, b: &Mat<f32>) -> f64 {
        let mut s = 0f64;
        for t in 0..x.nrows() {
            for o in 0..a.nrows() {
                let mut y = 0f64;
                for i in 0..x.ncols() {
                    y += f64::from(x[(t, i)]) * f64::from(a[(o, i)] - b[(o, i)]);
                }
                s += y * y;
            }
        }
        s / (x.nrows() * a.nrows()) as f64
    }

    /// Plain rounding itself scores 1; the source scores 0; a weight farther off than rounding scores
    /// above 1, by the amount an independent loop computes.
    #[test]
    fn ratios_against_an_independent_computation() {
        let mut seed = 7;
        let (tokens, rows, cols, group) = (24, 16, 64, 32);
        let x = Mat::from_fn(tokens, cols, |_, _| rand(&mut seed));
        let w = Mat::from_fn(rows, cols, |_, _| rand(&mut seed));
        let flat: Vec<f32> = (0..rows * cols).map(|i| w[(i / cols, i % cols)]).collect();
        let rtn = fake_quantize(&flat, rows, cols, group);
        let rtn = Mat::from_fn(rows, cols, |r, c| rtn[r * cols + c]);
        let r = output_error_ratio(x.as_ref(), &w, &rtn, group);
        assert!((r - 1.0).abs() < 1e-9, "{r}");
        assert_eq!(output_error_ratio(x.as_ref(), &w, &w, group), 0.0);
        let worse = Mat::from_fn(rows, cols, |r, c| rtn[(r, c)] + 0.05 * rand(&mut seed));
        let got = output_error_ratio(x.as_ref(), &w, &worse, group);
        let want = naive_mse(&x, &w, &worse) / naive_mse(&x, &w, &rtn);
        assert!((got - want).abs() < 1e-4 * want, "{got} vs {want}");
        assert!(got > 1.0, "{got}");
        // A zero weight: rounding is exact, and so is the source.
        let z = Mat::<f32>::zeros(rows, cols);
        assert_eq!(output_error_ratio(x.as_ref(), &z, &z, group), 0.0);
        assert!(output_error_ratio(x.as_ref(), &z, &w, group).is_finite());
    }

    /// A linear whose input columns were multiplied by `s` and outputs divided by `r` (the folds), then
    /// quantized: its ratio in the source's terms equals the one computed loop by loop on the source model's
    /// outputs (`x·Wᵀ` against `((x ⊘ s)·deqᵀ) ⊙ r`, and against plain rounding `x·RTN(W)ᵀ`).
    #[test]
    fn folded_ratio_is_measured_in_the_source_models_terms() {
        let mut seed = 11;
        let (tokens, rows, cols, group) = (20, 16, 64, 32);
        let x = Mat::from_fn(tokens, cols, |_, _| rand(&mut seed));
        let w = Mat::from_fn(rows, cols, |_, _| rand(&mut seed));
        // Scales far from 1, so that leaving either out changes the figure.
        let s: Vec<f32> = (0..cols)
            .map(|c| 0.2 + 4.0 * (c % 7) as f32 / 7.0)
            .collect();
        let r: Vec<f32> = (0..rows)
            .map(|i| 0.1 + 9.0 * (i % 5) as f32 / 5.0)
            .collect();
        let folded = Mat::from_fn(rows, cols, |i, c| w[(i, c)] * s[c] / r[i]);
        let flat: Vec<f32> = (0..rows * cols)
            .map(|i| folded[(i / cols, i % cols)])
            .collect();
        let deq = super::super::gemm::quantize(&flat, rows, cols, group, None).dequantize();
        let got = folded_ratio(&x, &folded, &deq, Some(&s), Some(&r), group);

        let wf: Vec<f32> = (0..rows * cols).map(|i| w[(i / cols, i % cols)]).collect();
        let rtn = fake_quantize(&wf, rows, cols, group);
        let (mut awq, mut plain) = (0f64, 0f64);
        for t in 0..tokens {
            for o in 0..rows {
                let (mut y, mut ya, mut yr) = (0f64, 0f64, 0f64);
                for c in 0..cols {
                    let xv = f64::from(x[(t, c)]);
                    y += xv * f64::from(w[(o, c)]);
                    ya += xv / f64::from(s[c]) * f64::from(deq[o * cols + c]);
                    yr += xv * f64::from(rtn[o * cols + c]);
                }
                awq += (y - ya * f64::from(r[o])).powi(2);
                plain += (y - yr).powi(2);
            }
        }
        let want = awq / plain;
        assert!((got - want).abs() < 1e-3 * want, "{got} vs {want}");
        // Without folds it is plain rounding against itself.
        let deq1 = super::super::gemm::quantize(&wf, rows, cols, group, None).dequantize();
        let one = folded_ratio(&x, &w, &deq1, None, None, group);
        assert!((one - 1.0).abs() < 1e-9, "{one}");
    }

    #[test]
    fn the_mean_decides_and_the_worst_is_named() {
        let ratios = vec![
            ("a".to_string(), 0.5),
            ("b".to_string(), 1.4),
            ("c".to_string(), 0.9),
        ];
        let v = evaluate(&ratios, 1.0);
        assert!((v.mean_ratio - 0.9333).abs() < 1e-3);
        assert_eq!((v.worst_module.as_str(), v.worst_ratio), ("b", 1.4));
        assert_eq!(v.gate, "passed");
        assert_eq!(evaluate(&ratios, 0.9).gate, "failed");
        assert_eq!(evaluate(&[], 1.0).gate, "passed");
    }
}
