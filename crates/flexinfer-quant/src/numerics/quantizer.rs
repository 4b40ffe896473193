//! Per-row min/max quantizer with the reference tools' conventions (docs/dev/gptq.md, "The quantizer and groups").

/// Scale and integer zero-point for each output row of one group.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupParams {
    pub scale: Vec<f32>,
    pub zero: Vec<f32>,
}

/// `maxq = 2^bits - 1`.
pub fn maxq(bits: u32) -> f32 {
    ((1u32 << bits) - 1) as f32
}

/// Per-row parameters from the min/max of `cols` columns of a column-major matrix.
/// `col(c)` must return column `c` (one value per row).
pub fn find_params<'a>(
    rows: usize,
    columns: impl Iterator<Item = &'a [f32]>,
    bits: u32,
    sym: bool,
) -> GroupParams {
    let mut xmin = vec![0.0f32; rows];
    let mut xmax = vec![0.0f32; rows];
    // Starting from zero: the range always contains zero. `f32::min`/`max` skip NaN like the comparisons of
    // the reference, and vectorize (dispatched to the CPU's widest instruction set).
    pulp::Arch::new().dispatch(
        #[inline(always)]
        || {
            for col in columns {
                for ((lo, hi), &v) in xmin.iter_mut().zip(xmax.iter_mut()).zip(&col[..rows]) {
                    *lo = lo.min(v);
                    *hi = hi.max(v);
                }
            }
        },
    );
    params_from_range(&mut xmin, &mut xmax, bits, sym)
}

/// [`find_params`] with the clipping search: for each row, the range `[f·xmin, f·xmax]` for every shrink
/// factor `f` of `factors` (largest first), keeping the one whose quantization of the row's values has the
/// least `Σ_c weight[c]·(x − dequant(quant(x)))²` (ties keep the earlier, wider range). `weight[c]` is the
/// error weight of column `c` (the GPTQ loss weight `R_cc²` in the sweep; 1 gives plain MSE).
pub fn find_params_clipped(
    rows: usize,
    columns: &[&[f32]],
    weight: &[f32],
    bits: u32,
    sym: bool,
    factors: &[f32],
) -> GroupParams {
    let full = find_params(rows, columns.iter().copied(), bits, sym);
    let mut xmin = vec![0.0f32; rows];
    let mut xmax = vec![0.0f32; rows];
    for col in columns {
        for ((lo, hi), &v) in xmin.iter_mut().zip(xmax.iter_mut()).zip(&col[..rows]) {
            *lo = lo.min(v);
            *hi = hi.max(v);
        }
    }
    let maxq = maxq(bits);
    let mut best = full;
    let mut best_err = vec![f64::INFINITY; rows];
    let mut err = vec![0.0f64; rows];
    let (mut lo, mut hi) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    for &f in factors {
        for r in 0..rows {
            lo[r] = xmin[r] * f;
            hi[r] = xmax[r] * f;
        }
        let cand = params_from_range(&mut lo, &mut hi, bits, sym);
        err.fill(0.0);
        for (col, &wc) in columns.iter().zip(weight) {
            for (r, e) in err.iter_mut().enumerate() {
                let (sc, z) = (cand.scale[r], cand.zero[r]);
                let d = col[r] - dequantize(quantize_code(col[r], sc, z, maxq), sc, z);
                *e += f64::from(wc * d * d);
            }
        }
        for r in 0..rows {
            if err[r] < best_err[r] {
                best_err[r] = err[r];
                best.scale[r] = cand.scale[r];
                best.zero[r] = cand.zero[r];
            }
        }
    }
    best
}

fn params_from_range(xmin: &mut [f32], xmax: &mut [f32], bits: u32, sym: bool) -> GroupParams {
    let maxq = maxq(bits);
    let rows = xmin.len();
    let mut scale = vec![0.0f32; rows];
    let mut zero = vec![0.0f32; rows];
    for r in 0..rows {
        let (mut lo, mut hi) = (xmin[r], xmax[r]);
        if sym {
            hi = hi.max(lo.abs());
            if lo < 0.0 {
                lo = -hi;
            }
        }
        if lo == 0.0 && hi == 0.0 {
            lo = -1.0;
            hi = 1.0;
        }
        let s = (hi - lo) / maxq;
        scale[r] = s;
        zero[r] = if sym {
            (maxq + 1.0) / 2.0
        } else {
            (-lo / s).round_ties_even()
        };
    }
    GroupParams { scale, zero }
}

/// Integer code of one value: `clamp(round(x/scale) + zero, 0, maxq)` (a NaN input gives code 0).
#[inline(always)]
pub fn quantize_code(x: f32, scale: f32, zero: f32, maxq: f32) -> f32 {
    // max/min rather than `clamp`: same result for every number, and it vectorizes.
    ((x / scale).round_ties_even() + zero).max(0.0).min(maxq)
}

/// Dequantized value of a code.
#[inline(always)]
pub fn dequantize(code: f32, scale: f32, zero: f32) -> f32 {
    scale * (code - zero)
}

#[cfg(test)]
mod tests {
    use super::{dequantize, find_params, find_params_clipped, maxq, quantize_code, GroupParams};

    /// `Σ_c weight[c]·(x − dequant)²` of row `r` under `p`.
    fn row_error(cols: &[Vec<f32>], weight: &[f32], p: &GroupParams, r: usize, bits: u32) -> f64 {
        cols.iter()
            .zip(weight)
            .map(|(c, &w)| {
                let (s, z) = (p.scale[r], p.zero[r]);
                let d = c[r] - dequantize(quantize_code(c[r], s, z, maxq(bits)), s, z);
                f64::from(w) * f64::from(d) * f64::from(d)
            })
            .sum()
    }

    fn columns(rows: usize, n: usize, seed: u32) -> Vec<Vec<f32>> {
        // A deterministic spread of values with a heavy tail (every 7th value five times larger).
        (0..n)
            .map(|c| {
                (0..rows)
                    .map(|r| {
                        let k = (c * rows + r) as u32 ^ seed;
                        let u = (k.wrapping_mul(2_654_435_761) >> 8) as f32 / (1u32 << 24) as f32;
                        let v = 2.0 * u - 1.0;
                        if (c * rows + r).is_multiple_of(7) {
                            5.0 * v
                        } else {
                            v
                        }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn clipping_search_never_raises_the_weighted_error_and_shrinks_where_it_pays() {
        let (rows, n) = (16, 64);
        let weight: Vec<f32> = (0..n).map(|c| 0.5 + (c % 5) as f32).collect();
        let factors: Vec<f32> = crate::params::clip_factors().collect();
        for (bits, sym) in [(2, true), (3, true), (2, false), (4, true)] {
            let cols = columns(rows, n, bits * 31 + u32::from(sym));
            let views: Vec<&[f32]> = cols.iter().map(|c| c.as_slice()).collect();
            let plain = find_params(rows, views.iter().copied(), bits, sym);
            // With the full range as the only factor the search is min/max.
            assert_eq!(
                find_params_clipped(rows, &views, &weight, bits, sym, &[1.0]),
                plain
            );
            let clipped = find_params_clipped(rows, &views, &weight, bits, sym, &factors);
            let mut shrunk = 0;
            for r in 0..rows {
                let (e0, e1) = (
                    row_error(&cols, &weight, &plain, r, bits),
                    row_error(&cols, &weight, &clipped, r, bits),
                );
                assert!(e1 <= e0, "{bits} bits sym={sym} row {r}: {e1} > {e0}");
                if clipped.scale[r] < plain.scale[r] {
                    shrunk += 1;
                    assert!(e1 < e0, "row {r}: a shrunk range must be strictly better");
                }
            }
            // Heavy-tailed rows at 2 bits: clipping the outliers pays on most rows.
            if bits == 2 {
                assert!(
                    shrunk > rows / 2,
                    "{bits} bits sym={sym}: only {shrunk} rows shrunk"
                );
            }
        }
    }
}
