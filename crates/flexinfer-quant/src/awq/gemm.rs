//! 4-bit asymmetric group quantization and AutoAWQ's GEMM packing (`version: gemm`, what vLLM's
//! `awq` method and transformers' AWQ loader read): `qweight` `[in, out / 8]` I32 and `qzeros`
//! `[in / group, out / 8]` I32, eight output columns per word in the interleaved order
//! [`AWQ_ORDER`], `scales` `[in / group, out]` F16; a weight is `(code − zero) × scale`.

use half::f16;

/// Bits of a code: the GEMM layout holds 4-bit codes only.
pub const BITS: u32 = 4;
/// Codes in one I32 word.
pub const PACK: usize = 8;
/// Word slot `i` holds output column `8·j + AWQ_ORDER[i]` (slot `i` at bits `4i..4i+4`).
pub const AWQ_ORDER: [usize; PACK] = [0, 2, 4, 6, 1, 3, 5, 7];
const MAX_CODE: f32 = 15.0;

/// One linear's quantized form, by output row: `codes[r·cols + c]`, `zeros[r·groups + g]`,
/// `scales[r·groups + g]` (already F16, the codes computed against the stored scale).
#[derive(Clone, Debug, PartialEq)]
pub struct GroupQuant {
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    pub codes: Vec<u8>,
    pub zeros: Vec<u8>,
    pub scales: Vec<f16>,
}

impl GroupQuant {
    pub fn groups(&self) -> usize {
        self.cols / self.group
    }

    /// The dequantized weight `[rows, cols]` row-major, in f32 (`(code − zero) × scale`).
    pub fn dequantize(&self) -> Vec<f32> {
        let groups = self.groups();
        let mut w = vec![0f32; self.rows * self.cols];
        for r in 0..self.rows {
            for c in 0..self.cols {
                let k = r * groups + c / self.group;
                let q = f32::from(self.codes[r * self.cols + c]) - f32::from(self.zeros[k]);
                w[r * self.cols + c] = q * self.scales[k].to_f32();
            }
        }
        w
    }
}

/// Scale and zero of one group from its range (the range always holds 0, as AutoAWQ's min/max
/// quantizer does not, but a zero that lands on a code keeps exact zeros exact).
fn scale_zero(lo: f32, hi: f32) -> (f16, u8) {
    let (lo, hi) = (lo.min(0.0), hi.max(0.0));
    let s = ((hi - lo) / MAX_CODE).max(1e-5);
    let s16 = f16::from_f32(s);
    let s = s16.to_f32();
    let z = (-lo / s).round().clamp(0.0, MAX_CODE);
    (s16, z as u8)
}

/// Quantizes `w` (`[rows, cols]` row-major) in groups of `group` input columns per row.
/// `clip[r·groups + g]`, when given, bounds the group's range to `[-clip, clip]` (the clipping search's
/// result). The caller checks that `group` divides `cols`.
pub fn quantize(
    w: &[f32],
    rows: usize,
    cols: usize,
    group: usize,
    clip: Option<&[f32]>,
) -> GroupQuant {
    let groups = cols / group;
    let mut out = GroupQuant {
        rows,
        cols,
        group,
        codes: vec![0; rows * cols],
        zeros: vec![0; rows * groups],
        scales: vec![f16::ZERO; rows * groups],
    };
    for r in 0..rows {
        for g in 0..groups {
            let k = r * groups + g;
            let span = &w[r * cols + g * group..r * cols + (g + 1) * group];
            let (mut lo, mut hi) = span
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
                    (a.min(v), b.max(v))
                });
            if let Some(c) = clip {
                lo = lo.max(-c[k]);
                hi = hi.min(c[k]);
            }
            let (s16, z) = scale_zero(lo, hi);
            let s = s16.to_f32();
            out.scales[k] = s16;
            out.zeros[k] = z;
            for (i, &v) in span.iter().enumerate() {
                let q = (v / s).round() + f32::from(z);
                out.codes[r * cols + g * group + i] = q.clamp(0.0, MAX_CODE) as u8;
            }
        }
    }
    out
}

/// One group quantized within `[-clip, clip]` and dequantized again into `out` (the clipping search's
/// pseudo-quantization; `f32::INFINITY` for no clip).
pub fn fake_group(span: &[f32], clip: f32, out: &mut [f32]) {
    let (lo, hi) = span
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let (s16, z) = scale_zero(lo.max(-clip), hi.min(clip));
    let (s, z) = (s16.to_f32(), f32::from(z));
    for (o, &v) in out.iter_mut().zip(span) {
        *o = (((v / s).round() + z).clamp(0.0, MAX_CODE) - z) * s;
    }
}

/// The group-quantized-then-dequantized copy of `w` (the search's pseudo-quantization), f32.
/// The same values as `quantize(..).dequantize()`, in one pass without the codes.
pub fn fake_quantize(w: &[f32], rows: usize, cols: usize, group: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    for (src, dst) in w.chunks_exact(group).zip(out.chunks_exact_mut(group)) {
        fake_group(src, f32::INFINITY, dst);
    }
    out
}

/// Packs `v[n·cols + c]` (4-bit values, `cols` a multiple of 8) into words `[n, cols / 8]` in the
/// AWQ order.
fn pack_awq(v: &[u8], n: usize, cols: usize) -> Vec<i32> {
    let words = cols / PACK;
    let mut out = vec![0i32; n * words];
    for r in 0..n {
        for j in 0..words {
            let mut word = 0u32;
            for (slot, &col) in AWQ_ORDER.iter().enumerate() {
                word |= u32::from(v[r * cols + j * PACK + col] & 0xF) << (4 * slot);
            }
            out[r * words + j] = word as i32;
        }
    }
    out
}

/// The GEMM tensors of `q`: `qweight` `[cols, rows / 8]`, `qzeros` `[groups, rows / 8]`, `scales`
/// `[groups, rows]` (row-major, the in-dimension first). `rows` must be a multiple of 8.
pub fn pack_gemm(q: &GroupQuant) -> (Vec<i32>, Vec<i32>, Vec<f16>) {
    let (rows, cols, groups) = (q.rows, q.cols, q.groups());
    // Transpose to in-major: element (c, r) = code of output r, input c.
    let mut t = vec![0u8; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = q.codes[r * cols + c];
        }
    }
    let mut zt = vec![0u8; rows * groups];
    let mut st = vec![f16::ZERO; rows * groups];
    for r in 0..rows {
        for g in 0..groups {
            zt[g * rows + r] = q.zeros[r * groups + g];
            st[g * rows + r] = q.scales[r * groups + g];
        }
    }
    (pack_awq(&t, cols, rows), pack_awq(&zt, groups, rows), st)
}

/// Unpacks words `[n, cols / 8]` of [`pack_awq`] back to `[n, cols]` values.
pub fn unpack_awq(words: &[i32], n: usize, cols: usize) -> Vec<u8> {
    let per_row = cols / PACK;
    let mut out = vec![0u8; n * cols];
    for r in 0..n {
        for j in 0..per_row {
            let word = words[r * per_row + j] as u32;
            for (slot, &col) in AWQ_ORDER.iter().enumerate() {
                out[r * cols + j * PACK + col] = ((word >> (4 * slot)) & 0xF) as u8;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn weights(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..rows * cols)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.2
            })
            .collect()
    }

    /// AutoAWQ's packing written out plainly: word j of row n has output column 8j + [0,2,4,6,1,3,5,7][i]
    /// at bits 4i (the reverse order [0,4,1,5,2,6,3,7] maps a nibble index back to its column).
    #[test]
    fn packing_puts_each_column_where_the_reverse_order_reads_it() {
        const REVERSE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];
        let (n, cols) = (3, 16);
        let v: Vec<u8> = (0..n * cols)
            .map(|i| ((i * 7 + i / 5) % 16) as u8)
            .collect();
        let words = pack_awq(&v, n, cols);
        for r in 0..n {
            for c in 0..cols {
                let (j, within) = (c / 8, c % 8);
                // Unpacked nibble by nibble, column `within` is nibble REVERSE[within] of its word.
                let got = (words[r * (cols / 8) + j] as u32 >> (4 * REVERSE[within])) & 0xF;
                assert_eq!(got as u8, v[r * cols + c], "[{r}, {c}]");
            }
        }
        assert_eq!(unpack_awq(&words, n, cols), v);
    }

    #[test]
    fn quantization_error_is_at_most_half_a_step_and_codes_fit() {
        let (rows, cols, group) = (8, 64, 32);
        let w = weights(rows, cols, 1);
        let q = quantize(&w, rows, cols, group, None);
        let d = q.dequantize();
        for r in 0..rows {
            for c in 0..cols {
                let k = r * (cols / group) + c / group;
                let s = q.scales[k].to_f32();
                assert!(q.codes[r * cols + c] <= 15);
                let err = (d[r * cols + c] - w[r * cols + c]).abs();
                assert!(err <= s * 0.5 + 1e-6, "[{r},{c}] err {err} step {s}");
            }
        }
        // The group's extremes are reached (min/max grid).
        let s0 = q.scales[0].to_f32();
        let span = &w[0..group];
        let (lo, hi) = span
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        assert!(((hi - lo.min(0.0)) / 15.0 - s0).abs() <= s0 * 1e-3);
    }

    #[test]
    fn fake_quantize_is_quantize_then_dequantize() {
        let (rows, cols, group) = (8, 64, 32);
        let w = weights(rows, cols, 4);
        assert_eq!(
            fake_quantize(&w, rows, cols, group),
            quantize(&w, rows, cols, group, None).dequantize()
        );
    }

    #[test]
    fn a_clip_bounds_the_range() {
        let (rows, cols, group) = (8, 32, 32);
        let w = weights(rows, cols, 2);
        let clip = vec![0.03f32; rows];
        let d = quantize(&w, rows, cols, group, Some(&clip)).dequantize();
        let limit = 0.03 + 0.06 / 15.0;
        assert!(d.iter().all(|v| v.abs() <= limit), "clipped range exceeded");
    }

    #[test]
    fn gemm_tensors_are_in_major_and_round_trip() {
        let (rows, cols, group) = (16, 64, 32);
        let q = quantize(&weights(rows, cols, 3), rows, cols, group, None);
        let (qw, qz, s) = pack_gemm(&q);
        assert_eq!(
            (qw.len(), qz.len(), s.len()),
            (cols * rows / 8, 2 * rows / 8, 2 * rows)
        );
        let codes = unpack_awq(&qw, cols, rows);
        let zeros = unpack_awq(&qz, 2, rows);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(codes[c * rows + r], q.codes[r * cols + c]);
            }
            for g in 0..2 {
                assert_eq!(zeros[g * rows + r], q.zeros[r * 2 + g]);
                assert_eq!(s[g * rows + r], q.scales[r * 2 + g]);
            }
        }
    }
}
