//! compressed-tensors' `pack-quantized` tensors of one linear, from the GPTQ solve's packed output.
//!
//! The library's `pack_to_int32` stores each signed code `q ∈ [−2^(b−1), 2^(b−1))` as `q + 2^(b−1)`,
//! densely along the packed dimension: element `i` of a row occupies bits `i·b .. (i+1)·b` of the
//! row's little-endian bit stream, 32 elements in exactly `b` words, the row cut to
//! `ceil(cols·b/32)` words. `weight_packed` is `[rows, ceil(cols·b/32)]` (packed along the input
//! dimension); an asymmetric `weight_zero_point` `[rows, groups]` is packed along the output dimension
//! (`packed_dim=0`): `[ceil(rows·b/32), groups]`. Dequantization is `(q − zp) · scale` in the scale's
//! dtype, rounded to it.
//!
//! Our codes are unsigned (`c ∈ [0, 2^b)`, zero `z`): the library's `q = c − 2^(b−1)` and
//! `zp = z − 2^(b−1)`, so the stored bits are `c` and `z` themselves and `q − zp = c − z`. A symmetric
//! quantization has `z = 2^(b−1)` (zero point 0), which the library does not store.

use crate::error::{SpecError, TensorError};
use crate::numerics::pack::{unpack_qweight, unpack_qzeros, ZeroFormat};
use safetensors::Dtype;

/// The bit widths the container takes here: vLLM's compressed-tensors `WNA16` kernels have 4 and 8.
pub const BITS: [u32; 2] = [4, 8];

/// Words of a row of `n` `bits`-bit values.
pub fn packed_words(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(32)
}

/// Packs `rows` rows of `cols` unsigned `bits`-bit values (row-major) along the rows:
/// `[rows, packed_words(cols, bits)]`.
pub fn pack_rows(values: &[u8], rows: usize, cols: usize, bits: u32) -> Vec<i32> {
    let words = packed_words(cols, bits);
    let mut out = vec![0u32; rows * words];
    let mask = (1u32 << bits) - 1;
    for r in 0..rows {
        let row = &mut out[r * words..(r + 1) * words];
        for (i, &v) in values[r * cols..(r + 1) * cols].iter().enumerate() {
            let v = u32::from(v) & mask;
            let pos = i * bits as usize;
            let (w, off) = (pos / 32, (pos % 32) as u32);
            row[w] |= v << off;
            if off + bits > 32 {
                row[w + 1] |= v >> (32 - off);
            }
        }
    }
    out.into_iter().map(|w| w as i32).collect()
}

/// The inverse of [`pack_rows`]: `rows × cols` unsigned values.
pub fn unpack_rows(packed: &[i32], rows: usize, cols: usize, bits: u32) -> Vec<u8> {
    let words = packed_words(cols, bits);
    let mask = (1u32 << bits) - 1;
    let mut out = vec![0u8; rows * cols];
    for r in 0..rows {
        let row = &packed[r * words..(r + 1) * words];
        for i in 0..cols {
            let pos = i * bits as usize;
            let (w, off) = (pos / 32, (pos % 32) as u32);
            let mut v = (row[w] as u32) >> off;
            if off + bits > 32 {
                v |= (row[w + 1] as u32) << (32 - off);
            }
            out[r * cols + i] = (v & mask) as u8;
        }
    }
    out
}

/// Zero points `[rows][groups]` packed along the output dimension: `[packed_words(rows), groups]`.
pub fn pack_zero_points(zeros: &[u8], rows: usize, groups: usize, bits: u32) -> Vec<i32> {
    let transposed: Vec<u8> = (0..groups * rows)
        .map(|k| zeros[(k % rows) * groups + k / rows])
        .collect();
    let by_group = pack_rows(&transposed, groups, rows, bits);
    let words = packed_words(rows, bits);
    (0..words * groups)
        .map(|k| by_group[(k % groups) * words + k / groups])
        .collect()
}

/// The inverse of [`pack_zero_points`]: `[rows][groups]`.
pub fn unpack_zero_points(packed: &[i32], rows: usize, groups: usize, bits: u32) -> Vec<u8> {
    let words = packed_words(rows, bits);
    let by_group: Vec<i32> = (0..groups * words)
        .map(|k| packed[(k % words) * groups + k / words])
        .collect();
    let t = unpack_rows(&by_group, groups, rows, bits);
    (0..rows * groups)
        .map(|k| t[(k % groups) * rows + k / groups])
        .collect()
}

/// A scale in `dtype` (the model's: BF16, F16 or F32), little-endian bytes.
fn scale_bytes(s: f32, dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => half::bf16::from_f32(s).to_le_bytes().to_vec(),
        Dtype::F16 => half::f16::from_f32(s).to_le_bytes().to_vec(),
        _ => s.to_le_bytes().to_vec(),
    }
}

fn scale_value(b: &[u8], dtype: Dtype) -> f32 {
    match dtype {
        Dtype::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        Dtype::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// `x` rounded to `dtype` (what torch's arithmetic in that dtype gives from the exact f32 result).
fn round_to(x: f32, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::BF16 => half::bf16::from_f32(x).to_f32(),
        Dtype::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// The scale dtype of a model whose weights are `dtype`: the model's dtype where it is a float torch
/// computes in, else BF16.
pub fn scale_dtype(dtype: Dtype) -> Dtype {
    match dtype {
        Dtype::BF16 | Dtype::F16 | Dtype::F32 => dtype,
        _ => Dtype::BF16,
    }
}

/// One tensor of the artifact.
#[derive(Clone, Debug, PartialEq)]
pub struct CtTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// The GPTQ solve's packed tensors of one linear (as the layer cache holds them).
pub struct GptqTensors<'a> {
    pub qweight: &'a [i32],
    pub qzeros: &'a [i32],
    /// `[groups, rows]` f16.
    pub scales: &'a [half::f16],
    pub g_idx: &'a [i32],
}

/// The `pack-quantized` tensors of linear `module` (`[rows, cols]`, `groups` groups of `group`
/// columns) from its GPTQ tensors. The container has no column permutation: every column must be in
/// group `c / group` (input order, group-aware order, or act-order with static groups), else an error.
#[allow(clippy::too_many_arguments)]
pub fn convert(
    module: &str,
    g: &GptqTensors<'_>,
    rows: usize,
    cols: usize,
    group: usize,
    bits: u32,
    sym: bool,
    dtype: Dtype,
) -> Result<Vec<CtTensor>, TensorError> {
    let groups = cols.div_ceil(group.max(1));
    if g.g_idx.len() != cols || g.scales.len() != groups * rows {
        return Err(TensorError::GroupIndex {
            module: module.to_string(),
        });
    }
    if let Some(c) = (0..cols).find(|&c| g.g_idx[c] as usize != c / group.max(1)) {
        return Err(TensorError::PackQuantized {
            module: module.to_string(),
            why: format!(
                "input column {c} is in group {}, not {} (the layout has no column permutation)",
                g.g_idx[c],
                c / group.max(1)
            ),
        });
    }
    // codes [cols][rows] → [rows][cols].
    let codes_cr = unpack_qweight(g.qweight, rows, cols, bits);
    let codes: Vec<u8> = (0..rows * cols)
        .map(|k| codes_cr[(k % cols) * rows + k / cols])
        .collect();
    let i32_bytes = |v: &[i32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let mut out = vec![CtTensor {
        name: format!("{module}.weight_packed"),
        dtype: Dtype::I32,
        shape: vec![rows, packed_words(cols, bits)],
        data: i32_bytes(&pack_rows(&codes, rows, cols, bits)),
    }];
    // scales [groups][rows] → [rows][groups].
    let scale: Vec<u8> = (0..rows * groups)
        .flat_map(|k| scale_bytes(g.scales[(k % groups) * rows + k / groups].to_f32(), dtype))
        .collect();
    out.push(CtTensor {
        name: format!("{module}.weight_scale"),
        dtype,
        shape: vec![rows, groups],
        data: scale,
    });
    let shape: Vec<u8> = [rows as i64, cols as i64]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    out.push(CtTensor {
        name: format!("{module}.weight_shape"),
        dtype: Dtype::I64,
        shape: vec![2],
        data: shape,
    });
    let zeros_gr = unpack_qzeros(g.qzeros, rows, groups, bits, ZeroFormat::for_sym(sym));
    if sym {
        let mid = 1u8 << (bits - 1);
        if let Some(z) = zeros_gr.iter().find(|&&z| z != mid) {
            return Err(TensorError::PackQuantized {
                module: module.to_string(),
                why: format!("a symmetric group has the zero point {z}, not {mid}"),
            });
        }
    } else {
        let zeros: Vec<u8> = (0..rows * groups)
            .map(|k| zeros_gr[(k % groups) * rows + k / groups])
            .collect();
        out.push(CtTensor {
            name: format!("{module}.weight_zero_point"),
            dtype: Dtype::I32,
            shape: vec![packed_words(rows, bits), groups],
            data: i32_bytes(&pack_zero_points(&zeros, rows, groups, bits)),
        });
    }
    Ok(out)
}

/// The bits and group settings the container takes; `bits_field`/`desc_act_field` name the settings.
pub fn check_settings(
    bits: u32,
    desc_act: bool,
    static_groups: bool,
    bits_field: &str,
    desc_act_field: &str,
) -> Result<(), SpecError> {
    if !BITS.contains(&bits) {
        return Err(SpecError::Value {
            field: bits_field.to_string(),
            value: bits.to_string(),
            expected: "4 or 8 (compressed-tensors pack-quantized weights as vLLM serves them)"
                .into(),
        });
    }
    if desc_act && !static_groups {
        return Err(SpecError::Value {
            field: desc_act_field.to_string(),
            value: "true".into(),
            expected: "false for compressed-tensors (the library no longer reads a column \
                       permutation, weight_g_idx; the group-aware order, actGroupAware, keeps \
                       every column in its own group)"
                .into(),
        });
    }
    Ok(())
}

/// The dequantized `[rows][cols]` weight of a `pack-quantized` linear, the way compressed-tensors
/// computes it: `(q − zp)` in the scale's dtype, times the scale, rounded to that dtype.
pub fn dequantize(
    packed: &[i32],
    scale: &[u8],
    scale_dtype: Dtype,
    zero_point: Option<&[i32]>,
    rows: usize,
    cols: usize,
    bits: u32,
) -> Vec<f32> {
    let size = scale_dtype.bitsize() / 8;
    let groups = scale.len() / size / rows.max(1);
    let group = cols / groups.max(1);
    let codes = unpack_rows(packed, rows, cols, bits);
    let zeros = zero_point.map(|z| unpack_zero_points(z, rows, groups, bits));
    let mid = 1i32 << (bits - 1);
    (0..rows * cols)
        .map(|k| {
            let (r, c) = (k / cols, k % cols);
            let g = c / group.max(1);
            let s = scale_value(&scale[(r * groups + g) * size..], scale_dtype);
            let z = zeros.as_ref().map_or(mid, |z| i32::from(z[r * groups + g]));
            let q = i32::from(codes[k]) - z;
            round_to(q as f32 * s, scale_dtype)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The library's rule written out bit by bit: element `i` of a row at bit `i·b` of the row's stream.
    fn reference_pack(values: &[u8], rows: usize, cols: usize, bits: u32) -> Vec<i32> {
        let words = packed_words(cols, bits);
        let mut out = vec![0u32; rows * words];
        for r in 0..rows {
            for i in 0..cols {
                for bit in 0..bits as usize {
                    if (values[r * cols + i] >> bit) & 1 == 1 {
                        let p = i * bits as usize + bit;
                        out[r * words + p / 32] |= 1 << (p % 32);
                    }
                }
            }
        }
        out.into_iter().map(|w| w as i32).collect()
    }

    fn values(n: usize, bits: u32, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((s >> 33) % (1 << bits)) as u8
            })
            .collect()
    }

    #[test]
    fn packing_matches_the_bitwise_reference_and_round_trips() {
        for bits in [1, 2, 3, 4, 5, 6, 7, 8] {
            for (rows, cols) in [(3, 32), (2, 64), (5, 40), (1, 7)] {
                let v = values(rows * cols, bits, u64::from(bits) * 31 + cols as u64);
                let p = pack_rows(&v, rows, cols, bits);
                assert_eq!(
                    p,
                    reference_pack(&v, rows, cols, bits),
                    "{bits} {rows}x{cols}"
                );
                assert_eq!(p.len(), rows * packed_words(cols, bits));
                assert_eq!(unpack_rows(&p, rows, cols, bits), v);
            }
        }
        // 4 bits: the nibble order the library's byte split reads (low nibble first).
        let p = pack_rows(&[1, 2, 3, 4, 5, 6, 7, 15], 1, 8, 4);
        assert_eq!(p, vec![0xF765_4321_u32 as i32]);
        // 8 bits: one byte per value, little-endian.
        assert_eq!(
            pack_rows(&[0x80, 1, 2, 0xFF], 1, 4, 8),
            vec![0xFF02_0180_u32 as i32]
        );
    }

    #[test]
    fn zero_points_pack_along_the_output_dimension() {
        let (rows, groups, bits) = (16, 3, 4);
        let z = values(rows * groups, bits, 9);
        let p = pack_zero_points(&z, rows, groups, bits);
        assert_eq!(p.len(), 2 * groups);
        // Word w of group g holds rows 8w..8w+8 of that group.
        for g in 0..groups {
            let col: Vec<u8> = (0..rows).map(|r| z[r * groups + g]).collect();
            let want = reference_pack(&col, 1, rows, bits);
            assert_eq!(vec![p[g], p[groups + g]], want, "group {g}");
        }
        assert_eq!(unpack_zero_points(&p, rows, groups, bits), z);
    }

    #[test]
    fn convert_keeps_the_codes_and_refuses_a_column_permutation() {
        let (rows, cols, bits) = (8, 64, 4);
        let q = crate::numerics::gptq::rtn_quantize(
            &faer::Mat::from_fn(rows, cols, |r, c| ((r * 7 + c * 3) % 11) as f32 - 5.0),
            &crate::params::GptqParams {
                bits,
                group_size: 32,
                ..Default::default()
            },
        );
        let p = crate::numerics::pack::pack(&q, ZeroFormat::for_sym(true));
        let g = GptqTensors {
            qweight: &p.qweight,
            qzeros: &p.qzeros,
            scales: &p.scales,
            g_idx: &p.g_idx,
        };
        let t = convert("m", &g, rows, cols, 32, bits, true, Dtype::F16).unwrap();
        let names: Vec<&str> = t.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            ["m.weight_packed", "m.weight_scale", "m.weight_shape"]
        );
        let words: Vec<i32> = t[0]
            .data
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let codes = unpack_rows(&words, rows, cols, bits);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(codes[r * cols + c], q.codes[c * rows + r], "[{r}, {c}]");
            }
        }
        let mut permuted = p.g_idx.clone();
        permuted.swap(0, 40);
        let e = convert(
            "m",
            &GptqTensors {
                g_idx: &permuted,
                ..g
            },
            rows,
            cols,
            32,
            bits,
            true,
            Dtype::F16,
        )
        .unwrap_err();
        assert!(
            flexinfer_contract::error::chain(&e).contains("input column 0 is in group 1"),
            "{e}"
        );
    }

    #[test]
    fn settings_outside_the_container_name_the_field() {
        for bits in [2, 3, 5] {
            let e = check_settings(bits, false, false, "BITS", "DESC_ACT").unwrap_err();
            assert!(
                flexinfer_contract::error::chain(&e).starts_with(&format!("BITS=\"{bits}\"")),
                "{e}"
            );
        }
        let e = check_settings(4, true, false, "BITS", "DESC_ACT").unwrap_err();
        assert!(
            flexinfer_contract::error::chain(&e).contains("DESC_ACT"),
            "{e}"
        );
        check_settings(4, true, true, "BITS", "DESC_ACT").unwrap();
        check_settings(8, false, false, "BITS", "DESC_ACT").unwrap();
    }
}
