//! One linear's weight → E4M3 codes and f32 scales, the way compressed-tensors' min-max observer and
//! `quantize` make them: `scale = max|w| / 448` per output row (`channel`) or over the whole matrix
//! (`tensor`), `code = e4m3(clamp(w / scale, ±448))`, dequantized as `f32(code) × scale`.

use super::e4m3;
use crate::error::{SpecError, TensorError};
use rayon::prelude::*;

/// Where the scales live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleStrategy {
    /// One scale per output row, tensor `[rows, 1]` (the default; compressed-tensors `channel`).
    Channel,
    /// One scale for the matrix, tensor `[1]` (compressed-tensors `tensor`).
    Tensor,
}

impl ScaleStrategy {
    pub const ALL: [ScaleStrategy; 2] = [ScaleStrategy::Channel, ScaleStrategy::Tensor];

    /// compressed-tensors' `strategy` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ScaleStrategy::Channel => "channel",
            ScaleStrategy::Tensor => "tensor",
        }
    }

    /// `channel` or `tensor` (case-insensitive); `field` names the setting in the error.
    pub fn parse(field: &str, value: &str) -> Result<Self, SpecError> {
        parse_named(field, value, &Self::ALL, Self::as_str)
    }

    /// The scale tensor's shape for a `[rows, cols]` weight.
    pub fn scale_shape(self, rows: usize) -> Vec<usize> {
        match self {
            ScaleStrategy::Channel => vec![rows, 1],
            ScaleStrategy::Tensor => vec![1],
        }
    }
}

/// The choice of `all` whose `name` is `value` (case-insensitive, trimmed); else an error naming `field`
/// and every choice (`a or b`). The FP8 settings' one parser.
pub(super) fn parse_named<T: Copy>(
    field: &str,
    value: &str,
    all: &[T],
    name: fn(T) -> &'static str,
) -> Result<T, SpecError> {
    all.iter()
        .copied()
        .find(|c| name(*c).eq_ignore_ascii_case(value.trim()))
        .ok_or_else(|| SpecError::Value {
            field: field.to_string(),
            value: value.to_string(),
            expected: all
                .iter()
                .map(|c| name(*c))
                .collect::<Vec<_>>()
                .join(" or "),
        })
}

/// A quantized weight.
#[derive(Clone, Debug)]
pub struct Fp8Weight {
    /// Row-major E4M3 codes, `rows × cols`.
    pub codes: Vec<u8>,
    /// One per row (`channel`) or one (`tensor`).
    pub scales: Vec<f32>,
    /// `‖W − deq(W)‖ / ‖W‖` (Frobenius; 0 for an all-zero weight).
    pub relative_error: f64,
}

/// The scale of a block whose largest magnitude is `amax`: `amax / 448`, never below the smallest
/// normal f32 (an all-zero or vanishing block keeps a usable scale; its codes are zero).
fn scale_of(amax: f32) -> f32 {
    (amax / e4m3::MAX).max(f32::MIN_POSITIVE)
}

/// The dequantized value of `code` under `scale` (what compressed-tensors' `dequantize` computes).
pub fn dequantize(code: u8, scale: f32) -> f32 {
    e4m3::decode(code) * scale
}

/// Quantizes the row-major `rows × cols` weight `name`. A NaN or ±∞ in the weight is an error naming
/// the tensor and the element.
pub fn quantize_weight(
    name: &str,
    values: &[f32],
    rows: usize,
    cols: usize,
    strategy: ScaleStrategy,
) -> Result<Fp8Weight, TensorError> {
    if rows.checked_mul(cols) != Some(values.len()) || cols == 0 {
        return Err(TensorError::Length {
            name: name.to_string(),
            len: values.len(),
            expected: rows.saturating_mul(cols),
        });
    }
    if let Some(element) = values.iter().position(|v| !v.is_finite()) {
        return Err(TensorError::NonFinite {
            name: name.to_string(),
            element,
        });
    }
    let row_amax: Vec<f32> = values
        .par_chunks(cols)
        .map(|r| r.iter().fold(0f32, |m, v| m.max(v.abs())))
        .collect();
    let scales: Vec<f32> = match strategy {
        ScaleStrategy::Channel => row_amax.iter().map(|&a| scale_of(a)).collect(),
        ScaleStrategy::Tensor => vec![scale_of(row_amax.iter().fold(0f32, |m, &a| m.max(a)))],
    };
    let mut codes = vec![0u8; values.len()];
    let (err, norm) = codes
        .par_chunks_mut(cols)
        .zip(values.par_chunks(cols))
        .enumerate()
        .map(|(r, (out, row))| {
            let scale = match strategy {
                ScaleStrategy::Channel => scales[r],
                ScaleStrategy::Tensor => scales[0],
            };
            let (mut err, mut norm) = (0f64, 0f64);
            for (c, &w) in out.iter_mut().zip(row) {
                // Division, not a reciprocal product: the same rounding as torch's `w / scale`.
                *c = e4m3::encode((w / scale).clamp(-e4m3::MAX, e4m3::MAX));
                let d = f64::from(w) - f64::from(dequantize(*c, scale));
                err += d * d;
                norm += f64::from(w) * f64::from(w);
            }
            (err, norm)
        })
        .reduce(|| (0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    let relative_error = if norm > 0.0 { (err / norm).sqrt() } else { 0.0 };
    Ok(Fp8Weight {
        codes,
        scales,
        relative_error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward reference: per block max, divide, nearest code by search over the decoded table.
    fn reference(values: &[f32], rows: usize, cols: usize, per_row: bool) -> (Vec<u8>, Vec<f32>) {
        let amax = |s: &[f32]| s.iter().map(|v| v.abs()).fold(0f32, f32::max);
        let scales: Vec<f32> = if per_row {
            values
                .chunks(cols)
                .map(|r| (amax(r) / 448.0).max(f32::MIN_POSITIVE))
                .collect()
        } else {
            vec![(amax(values) / 448.0).max(f32::MIN_POSITIVE)]
        };
        let table: Vec<(u8, f32)> = (0..=255u8)
            .map(|c| (c, e4m3::decode(c)))
            .filter(|(_, v)| v.is_finite())
            .collect();
        let mut codes = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            let s = if per_row { scales[r] } else { scales[0] };
            for &w in &values[r * cols..(r + 1) * cols] {
                let x = (w / s).clamp(-448.0, 448.0);
                let mut best = (f32::INFINITY, 0u8);
                for &(c, v) in &table {
                    if v == 0.0 && (c & 0x80 != 0) != x.is_sign_negative() {
                        continue;
                    }
                    let d = (x - v).abs();
                    if d < best.0 || (d == best.0 && c & 1 == 0) {
                        best = (d, c);
                    }
                }
                codes.push(best.1);
            }
        }
        (codes, scales)
    }

    fn matrix(rows: usize, cols: usize) -> Vec<f32> {
        let mut state = 7u64;
        (0..rows * cols)
            .map(|i| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1442695040888963407);
                let u = ((state >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
                // Rows of very different magnitudes, one all-zero row.
                if i / cols == 2 {
                    0.0
                } else {
                    u * 10f32.powi((i / cols) as i32 % 5 - 3)
                }
            })
            .collect()
    }

    #[test]
    fn codes_and_scales_match_the_reference_for_both_strategies() {
        let (rows, cols) = (9, 33);
        let w = matrix(rows, cols);
        for (strategy, per_row) in [
            (ScaleStrategy::Channel, true),
            (ScaleStrategy::Tensor, false),
        ] {
            let q = quantize_weight("m.weight", &w, rows, cols, strategy).unwrap();
            let (codes, scales) = reference(&w, rows, cols, per_row);
            assert_eq!(q.scales, scales, "{strategy:?}");
            assert_eq!(q.codes, codes, "{strategy:?}");
            assert_eq!(
                q.scales.len(),
                strategy.scale_shape(rows).iter().product::<usize>()
            );
        }
    }

    #[test]
    fn per_channel_error_is_small_and_each_row_max_hits_448() {
        let (rows, cols) = (9, 33);
        let w = matrix(rows, cols);
        let q = quantize_weight("m.weight", &w, rows, cols, ScaleStrategy::Channel).unwrap();
        // E4M3 has 3 mantissa bits: a relative step of at most 2⁻⁴ away from the subnormals.
        assert!(
            q.relative_error > 0.0 && q.relative_error < 0.0625,
            "{}",
            q.relative_error
        );
        for r in (0..rows).filter(|&r| r != 2) {
            let row = &q.codes[r * cols..(r + 1) * cols];
            assert!(
                row.iter().any(|&c| c & 0x7F == 0x7E),
                "row {r}: the max maps to ±448"
            );
        }
        assert!(q.codes[2 * cols..3 * cols].iter().all(|&c| c & 0x7F == 0));
        // Per tensor: the small rows lose precision, the error is larger.
        let t = quantize_weight("m.weight", &w, rows, cols, ScaleStrategy::Tensor).unwrap();
        assert!(t.relative_error >= q.relative_error);
    }

    #[test]
    fn bad_input_names_the_tensor() {
        let mut w = matrix(2, 4);
        w[5] = f32::NAN;
        let e = quantize_weight("layers.0.q.weight", &w, 2, 4, ScaleStrategy::Channel).unwrap_err();
        assert!(
            matches!(e, TensorError::NonFinite { ref name, element: 5 } if name == "layers.0.q.weight"),
            "{e}"
        );
        let e = quantize_weight("x.weight", &w[..7], 2, 4, ScaleStrategy::Channel).unwrap_err();
        assert!(
            flexinfer_contract::error::chain(&e).contains("x.weight"),
            "{e}"
        );
        let e = ScaleStrategy::parse("FP8_SCALE", "block")
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err();
        assert!(e.contains("FP8_SCALE") && e.contains("block"), "{e}");
        assert_eq!(
            ScaleStrategy::parse("FP8_SCALE", " Tensor ").unwrap(),
            ScaleStrategy::Tensor
        );
    }
}
