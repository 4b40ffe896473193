//! Bit packing of the `gptq` checkpoint (docs/dev/gptq.md, "Packing" and "Zero points (v1)").
//!
//! Every bit width uses the same little-endian bit stream: value `k` along the packed dimension occupies bits
//! `k·bits .. (k+1)·bits` of the stream, words in order. For 2/4/8 bits this is the usual nibble order; for
//! 3 bits it is exactly the 10|1|10|1|10 scheme of the reference packers.

use crate::numerics::gptq::QuantizedLinear;

/// Zero-point convention on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroFormat {
    /// `checkpoint_format: "gptq"`: stores `zero − 1`.
    V1,
    /// `checkpoint_format: "gptq_v2"`: stores the real zero.
    V2,
}

impl ZeroFormat {
    /// v1 for symmetric (widest compatibility), v2 for asymmetric (no underflow of a zero of 0).
    pub fn for_sym(sym: bool) -> Self {
        if sym {
            ZeroFormat::V1
        } else {
            ZeroFormat::V2
        }
    }

    pub fn checkpoint_format(self) -> &'static str {
        match self {
            ZeroFormat::V1 => "gptq",
            ZeroFormat::V2 => "gptq_v2",
        }
    }
}

/// The packed tensors of one linear.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedLinear {
    /// `[cols·bits/32, rows]`.
    pub qweight: Vec<i32>,
    /// `[groups, rows·bits/32]`.
    pub qzeros: Vec<i32>,
    /// `[groups, rows]` as f16.
    pub scales: Vec<half::f16>,
    /// `[cols]`.
    pub g_idx: Vec<i32>,
    pub rows: usize,
    pub cols: usize,
    pub groups: usize,
    pub bits: u32,
}

fn put(words: &mut [u32], word_stride: usize, lane: usize, pos: usize, bits: u32, value: u32) {
    let w = pos / 32;
    let off = (pos % 32) as u32;
    words[w * word_stride + lane] |= value << off;
    if off + bits > 32 {
        words[(w + 1) * word_stride + lane] |= value >> (32 - off);
    }
}

fn get(words: &[u32], word_stride: usize, lane: usize, pos: usize, bits: u32) -> u32 {
    let mask = (1u32 << bits) - 1;
    let w = pos / 32;
    let off = (pos % 32) as u32;
    let mut v = words[w * word_stride + lane] >> off;
    if off + bits > 32 {
        v |= words[(w + 1) * word_stride + lane] << (32 - off);
    }
    v & mask
}

/// Packs the codes along the input dim and the zeros along the output dim.
pub fn pack(q: &QuantizedLinear, format: ZeroFormat) -> PackedLinear {
    let bits = q.bits;
    let (rows, cols) = (q.rows, q.cols);
    let groups = q.groups();
    let qw_rows = cols * bits as usize / 32;
    let mut qweight = vec![0u32; qw_rows * rows];
    for c in 0..cols {
        let pos = c * bits as usize;
        for r in 0..rows {
            put(
                &mut qweight,
                rows,
                r,
                pos,
                bits,
                q.codes[c * rows + r] as u32,
            );
        }
    }
    let zw = rows * bits as usize / 32;
    let mut qzeros = vec![0u32; groups * zw];
    let maxq = (1u32 << bits) - 1;
    for g in 0..groups {
        for r in 0..rows {
            let z = q.zeros[g * rows + r] as u32;
            let stored = match format {
                ZeroFormat::V1 => z.saturating_sub(1),
                ZeroFormat::V2 => z,
            }
            .min(maxq);
            put(
                &mut qzeros[g * zw..(g + 1) * zw],
                1,
                0,
                r * bits as usize,
                bits,
                stored,
            );
        }
    }
    PackedLinear {
        qweight: qweight.into_iter().map(|w| w as i32).collect(),
        qzeros: qzeros.into_iter().map(|w| w as i32).collect(),
        scales: q.scales.iter().map(|&s| half::f16::from_f32(s)).collect(),
        g_idx: q.g_idx.clone(),
        rows,
        cols,
        groups,
        bits,
    }
}

/// Unpacked integer codes `[cols][rows]` from a qweight `[cols·bits/32, rows]`.
pub fn unpack_qweight(qweight: &[i32], rows: usize, cols: usize, bits: u32) -> Vec<u8> {
    let words: Vec<u32> = qweight.iter().map(|&w| w as u32).collect();
    let mut codes = vec![0u8; rows * cols];
    for c in 0..cols {
        for r in 0..rows {
            codes[c * rows + r] = get(&words, rows, r, c * bits as usize, bits) as u8;
        }
    }
    codes
}

/// Real zero-points `[groups][rows]` from qzeros, undoing the v1 offset like the loaders do.
pub fn unpack_qzeros(
    qzeros: &[i32],
    rows: usize,
    groups: usize,
    bits: u32,
    format: ZeroFormat,
) -> Vec<u8> {
    let zw = rows * bits as usize / 32;
    let words: Vec<u32> = qzeros.iter().map(|&w| w as u32).collect();
    let mut out = vec![0u8; groups * rows];
    for g in 0..groups {
        for r in 0..rows {
            let v = get(&words[g * zw..(g + 1) * zw], 1, 0, r * bits as usize, bits);
            out[g * rows + r] = match format {
                ZeroFormat::V1 => v + 1,
                ZeroFormat::V2 => v,
            } as u8;
        }
    }
    out
}

/// Dequantizes packed tensors with the consumer's rules: `W[r, c] = scale[g, r] · (code[c, r] − zero[g, r])`.
/// Returns `[rows][cols]` row-major (nn.Linear layout).
pub fn dequantize_packed(p: &PackedLinear, format: ZeroFormat) -> Vec<f32> {
    let codes = unpack_qweight(&p.qweight, p.rows, p.cols, p.bits);
    let zeros = unpack_qzeros(&p.qzeros, p.rows, p.groups, p.bits, format);
    let mut w = vec![0f32; p.rows * p.cols];
    for c in 0..p.cols {
        let g = p.g_idx[c] as usize;
        for r in 0..p.rows {
            let s = p.scales[g * p.rows + r].to_f32();
            w[r * p.cols + c] = s * (codes[c * p.rows + r] as f32 - zeros[g * p.rows + r] as f32);
        }
    }
    w
}
