//! The 32-value blocks (Q8_0, Q4_0) and the plain 16-bit types (F16, BF16).
//!
//! Layouts (little-endian):
//! - `Q8_0`: `d: f16`, `qs: [i8; 32]`; `x = d·q`.
//! - `Q4_0`: `d: f16`, `qs: [u8; 16]`; value `j` is the low nibble of byte `j`, value `j+16` the high
//!   nibble; `x = d·(q − 8)`.
// Index loops mirror the block layouts (value i ↔ byte, bit) and keep the bounds in one place.
#![allow(clippy::needless_range_loop)]

use super::search::{asymmetric_grid, f16_value, symmetric_grid, to_f16, SymWeights};
use crate::gguf::types::QK_LEGACY;

pub fn quantize_q8_0(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[0..2].copy_from_slice(&to_f16(d).0.to_le_bytes());
    for (o, &v) in out[2..34].iter_mut().zip(x) {
        // ggml rounds Q8_0 with roundf: half away from zero.
        *o = ((v * id).round() as i8) as u8;
    }
}

pub fn dequantize_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_value(u16::from_le_bytes([b[0], b[1]]));
    for (o, &q) in y.iter_mut().zip(&b[2..34]) {
        *o = d * (q as i8) as f32;
    }
}

/// Q4_0 without an importance matrix: the scale through the value of largest |x| mapped to −8
/// (ggml's `quantize_row_q4_0_ref`).
pub fn quantize_q4_0_plain(x: &[f32], out: &mut [u8]) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[0..2].copy_from_slice(&to_f16(d).0.to_le_bytes());
    let half = QK_LEGACY / 2;
    for j in 0..half {
        // ggml truncates (x·id + 8.5) to int8, caps at 15.
        let lo = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let hi = ((x[j + half] * id + 8.5) as i8).min(15) as u8;
        out[2 + j] = lo | (hi << 4);
    }
}

/// Q4_0 with importance weights (ggml's `quantize_row_q4_0_impl`): weights
/// `importance·sqrt(σ² + x²)` with σ² the row's mean square, symmetric grid search.
pub fn quantize_q4_0_weighted(x: &[f32], importance: &[f32], row_sigma2: f32, out: &mut [u8]) {
    let mut w = [0.0f32; QK_LEGACY];
    for j in 0..QK_LEGACY {
        w[j] = importance[j] * (row_sigma2 + x[j] * x[j]).sqrt();
    }
    let mut l = [0i8; QK_LEGACY];
    let d = symmetric_grid(x, 8, &mut l, SymWeights::Given(&w));
    out[0..2].copy_from_slice(&to_f16(d).0.to_le_bytes());
    let half = QK_LEGACY / 2;
    for j in 0..half {
        out[2 + j] = (l[j] as u8) | ((l[j + half] as u8) << 4);
    }
}

pub fn dequantize_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_value(u16::from_le_bytes([b[0], b[1]]));
    let half = QK_LEGACY / 2;
    for j in 0..half {
        let q = b[2 + j];
        y[j] = ((q & 0xF) as i32 - 8) as f32 * d;
        y[j + half] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

pub fn quantize_f16(x: &[f32], out: &mut [u8]) {
    for (o, &v) in out.chunks_exact_mut(2).zip(x) {
        o.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
    }
}

pub fn dequantize_f16(b: &[u8], y: &mut [f32]) {
    for (o, c) in y.iter_mut().zip(b.chunks_exact(2)) {
        *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

/// f32 → bf16 rounding to nearest even, NaN kept quiet (ggml's `ggml_compute_fp32_to_bf16`).
pub fn quantize_bf16(x: &[f32], out: &mut [u8]) {
    for (o, &v) in out.chunks_exact_mut(2).zip(x) {
        let u = v.to_bits();
        let b = if v.is_nan() {
            ((u >> 16) | 64) as u16
        } else {
            (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
        };
        o.copy_from_slice(&b.to_le_bytes());
    }
}

pub fn dequantize_bf16(b: &[u8], y: &mut [f32]) {
    for (o, c) in y.iter_mut().zip(b.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
    }
}

pub fn quantize_f32(x: &[f32], out: &mut [u8]) {
    for (o, &v) in out.chunks_exact_mut(4).zip(x) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

pub fn dequantize_f32(b: &[u8], y: &mut [f32]) {
    for (o, c) in y.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

// ---------------------------------------------------------------- Q4_1, Q5_0, Q5_1
//
// Layouts: `Q4_1` = `d`, `m` (f16), `qs[16]`, `x = d·q + m`; `Q5_0` = `d`, `qh: u32`, `qs[16]`,
// `x = d·(q − 16)`; `Q5_1` = `d`, `m`, `qh: u32`, `qs[16]`, `x = d·q + m`. Nibbles as in Q4_0; the
// fifth bit of value `j` is bit `j` of `qh`. llama.cpp uses them where a row does not split into
// K-quant super-blocks, and Q4_1 for the first `ffn_down` layers of Q4_0 with an importance matrix.

fn put_f16(out: &mut [u8], at: usize, v: f32) {
    out[at..at + 2].copy_from_slice(&to_f16(v).0.to_le_bytes());
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_value(u16::from_le_bytes([b[at], b[at + 1]]))
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::MAX, -f32::MAX), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

/// Nibbles and the fifth bits of 32 codes.
fn pack5(l: &[u8], qs: &mut [u8]) -> u32 {
    let mut qh = 0u32;
    for j in 0..16 {
        let (a, b) = (l[j], l[j + 16]);
        qs[j] = (a & 0xF) | ((b & 0xF) << 4);
        qh |= u32::from((a & 0x10) >> 4) << j;
        qh |= u32::from((b & 0x10) >> 4) << (j + 16);
    }
    qh
}

fn weights_of(x: &[f32], importance: &[f32], row_sigma2: f32) -> [f32; QK_LEGACY] {
    let mut w = [0.0f32; QK_LEGACY];
    for j in 0..QK_LEGACY {
        w[j] = importance[j] * (row_sigma2 + x[j] * x[j]).sqrt();
    }
    w
}

/// `importance` is the block's slice and the row's mean square.
pub fn quantize_q4_1(x: &[f32], importance: Option<(&[f32], f32)>, out: &mut [u8]) {
    let mut l = [0u8; QK_LEGACY];
    match importance {
        None => {
            let (min, max) = min_max(x);
            let d = (max - min) / 15.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            put_f16(out, 0, d);
            put_f16(out, 2, min);
            for j in 0..QK_LEGACY {
                l[j] = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
            }
        }
        Some((qw, sigma2)) => {
            let w = weights_of(x, qw, sigma2);
            let mut aux = [0u8; QK_LEGACY];
            let (d, min_out) =
                asymmetric_grid(x, &w, 15, &mut l, &mut aux, (-0.9, 0.05, 36), false);
            put_f16(out, 0, d);
            put_f16(out, 2, -min_out);
        }
    }
    for j in 0..16 {
        out[4 + j] = l[j] | (l[j + 16] << 4);
    }
}

pub fn dequantize_q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        y[j] = (b[4 + j] & 0xF) as f32 * d + m;
        y[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
    }
}

pub fn quantize_q5_0(x: &[f32], importance: Option<(&[f32], f32)>, out: &mut [u8]) {
    let mut l = [0u8; QK_LEGACY];
    match importance {
        None => {
            let (mut amax, mut max) = (0.0f32, 0.0f32);
            for &v in x {
                if amax < v.abs() {
                    amax = v.abs();
                    max = v;
                }
            }
            let d = max / -16.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            put_f16(out, 0, d);
            for j in 0..QK_LEGACY {
                l[j] = ((x[j] * id + 16.5) as i8).min(31) as u8;
            }
        }
        Some((qw, sigma2)) => {
            let w = weights_of(x, qw, sigma2);
            let mut li = [0i8; QK_LEGACY];
            let d = symmetric_grid(x, 16, &mut li, SymWeights::Given(&w));
            put_f16(out, 0, d);
            for j in 0..QK_LEGACY {
                l[j] = li[j] as u8;
            }
        }
    }
    let (head, qs) = out.split_at_mut(6);
    let qh = pack5(&l, qs);
    head[2..6].copy_from_slice(&qh.to_le_bytes());
}

pub fn dequantize_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        let q0 = ((b[6 + j] & 0xF) as u32 | h0) as i32 - 16;
        let q1 = ((b[6 + j] >> 4) as u32 | h1) as i32 - 16;
        y[j] = q0 as f32 * d;
        y[j + 16] = q1 as f32 * d;
    }
}

pub fn quantize_q5_1(x: &[f32], importance: Option<(&[f32], f32)>, out: &mut [u8]) {
    let mut l = [0u8; QK_LEGACY];
    match importance {
        None => {
            let (min, max) = min_max(x);
            let d = (max - min) / 31.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            put_f16(out, 0, d);
            put_f16(out, 2, min);
            for j in 0..QK_LEGACY {
                l[j] = ((x[j] - min) * id + 0.5) as u8;
            }
        }
        Some((qw, sigma2)) => {
            let w = weights_of(x, qw, sigma2);
            let mut aux = [0u8; QK_LEGACY];
            let (d, min_out) =
                asymmetric_grid(x, &w, 31, &mut l, &mut aux, (-0.9, 0.05, 36), false);
            put_f16(out, 0, d);
            put_f16(out, 2, -min_out);
        }
    }
    let (head, qs) = out.split_at_mut(8);
    let qh = pack5(&l, qs);
    head[4..8].copy_from_slice(&qh.to_le_bytes());
}

pub fn dequantize_q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((b[8 + j] & 0xF) as u32 | h0) as f32 * d + m;
        y[j + 16] = ((b[8 + j] >> 4) as u32 | h1) as f32 * d + m;
    }
}
