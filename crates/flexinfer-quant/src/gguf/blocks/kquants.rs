//! The K-quants: 256-value super-blocks with 6- or 4-bit sub-block scales (Q2_K … Q6_K).
//!
//! Each quantizer has ggml's two paths: without an importance matrix the `*_ref` search
//! (weights from `x` alone), with one the `*_impl` search (weights `importance·sqrt(σ² + x²)`, and the
//! sub-block scales themselves fitted by weighted least squares). Both end the same way: the codes
//! are recomputed against the scales as stored (f16 super-scale × integer sub-scale).
//!
//! Layouts (little-endian, byte offsets):
//! - `Q2_K` (84): `scales[16]` (low nibble scale, high nibble min) · `qs[64]` · `d` · `dmin`.
//! - `Q3_K` (110): `hmask[32]` · `qs[64]` · `scales[12]` (16 six-bit scales, biased by 32) · `d`.
//! - `Q4_K` (144): `d` · `dmin` · `scales[12]` (8 six-bit scale/min pairs) · `qs[128]`.
//! - `Q5_K` (176): `d` · `dmin` · `scales[12]` · `qh[32]` · `qs[128]`.
//! - `Q6_K` (210): `ql[128]` · `qh[64]` · `scales[16]` (int8) · `d`.
// Index loops mirror the block layouts (value i ↔ byte, bit) and keep the bounds in one place.
#![allow(clippy::needless_range_loop)]

use super::search::{
    asymmetric_grid, f16_value, nearest, positive_grid, symmetric_grid, symmetric_grid_refined,
    to_f16, SymWeights, GROUP_MAX_EPS,
};
use crate::gguf::types::{GgmlType, QK_K};

/// A super-block's grid after its scales are chosen: value i is `step[i]·(code − bias) + off[i]` with
/// `code ∈ 0..=cmax`. A value whose `step` is zero keeps the scale search's code (its value is `off`).
pub struct KGrid {
    pub step: [f32; QK_K],
    pub off: [f32; QK_K],
    pub bias: i32,
    pub cmax: i32,
}

impl KGrid {
    /// The code of `v` on value i's grid (ggml's rounding: `nearest((v − off)/step)`, clamped).
    #[inline(always)]
    pub fn code(&self, i: usize, v: f32) -> i32 {
        (nearest((v - self.off[i]) / self.step[i]) + self.bias).clamp(0, self.cmax)
    }
    /// The value code `c` stands for at position i.
    #[inline(always)]
    pub fn value(&self, i: usize, c: i32) -> f32 {
        self.step[i] * (c - self.bias) as f32 + self.off[i]
    }
}

/// The K-quant block types ([`choose_scales`], [`grid`], [`pack_codes`] apply to these).
pub fn is_kquant(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K
    )
}

/// Step one of a K-quant super-block: chooses its scales (and mins) from `x` (with the importance
/// weights, if any), writes them into `out` (the block's bytes; the code bytes are left for
/// [`pack_codes`]), and the scale search's own codes into `codes`.
pub fn choose_scales(
    ty: GgmlType,
    x: &[f32],
    importance: Option<&[f32]>,
    out: &mut [u8],
    codes: &mut [u8; QK_K],
) {
    match ty {
        GgmlType::Q2K => q2k_scales(x, importance, out, codes),
        GgmlType::Q3K => q3k_scales(x, importance, out, codes),
        GgmlType::Q4K => quantize_k4_scales(x, importance, 15, (-1.0, 0.1, 20), codes, out),
        GgmlType::Q5K => quantize_k4_scales(x, importance, 31, (-0.5, 0.1, 15), codes, out),
        _ => q6k_scales(x, importance, out, codes),
    }
}

/// Step two: the grid the scales in `b` (written by [`choose_scales`]) define.
pub fn grid(ty: GgmlType, b: &[u8]) -> KGrid {
    let mut g = KGrid {
        step: [0.0; QK_K],
        off: [0.0; QK_K],
        bias: 0,
        cmax: 0,
    };
    (g.bias, g.cmax) = match ty {
        GgmlType::Q2K => {
            q2k_grid(b, &mut g.step, &mut g.off);
            (0, 3)
        }
        GgmlType::Q3K => {
            q3k_grid(b, &mut g.step, &mut g.off);
            (4, 7)
        }
        GgmlType::Q4K => {
            k4_grid(b, &mut g.step, &mut g.off);
            (0, 15)
        }
        GgmlType::Q5K => {
            k4_grid(b, &mut g.step, &mut g.off);
            (0, 31)
        }
        _ => {
            q6k_grid(b, &mut g.step, &mut g.off);
            (32, 63)
        }
    };
    g
}

/// Step three: writes the codes (`0..=cmax` of [`grid`]) into the block's code bytes.
pub fn pack_codes(ty: GgmlType, codes: &[u8; QK_K], out: &mut [u8]) {
    match ty {
        GgmlType::Q2K => pack_2bit(codes, &mut out[16..80]),
        GgmlType::Q3K => pack_q3k(codes, out),
        GgmlType::Q4K => pack_q4k(codes, out),
        GgmlType::Q5K => pack_q5k(codes, out),
        _ => pack_q6k(codes, out),
    }
}

/// One K-quant super-block, each value rounded on its own: the three steps with every code the
/// nearest level of `x` itself (ggml's quantizers).
fn quantize_k(ty: GgmlType, x: &[f32], importance: Option<&[f32]>, out: &mut [u8]) {
    let mut codes = [0u8; QK_K];
    choose_scales(ty, x, importance, out, &mut codes);
    let g = grid(ty, out);
    for i in 0..QK_K {
        if g.step[i] != 0.0 {
            codes[i] = g.code(i, x[i]) as u8;
        }
    }
    pack_codes(ty, &codes, out);
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_value(u16::from_le_bytes([b[at], b[at + 1]]))
}

fn put_f16(out: &mut [u8], at: usize, v: f32) -> f32 {
    let (bits, back) = to_f16(v);
    out[at..at + 2].copy_from_slice(&bits.to_le_bytes());
    back
}

/// Sum of squares of a super-block.
fn sum_sq(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |s, v| s + v * v)
}

/// ggml's importance weights of a sub-block, `w_l = qw_l·sqrt(σ² + x_l²)`; returns their sum.
fn importance_weights(xs: &[f32], qs: &[f32], sigma2: f32, w: &mut [f32]) -> f32 {
    for l in 0..xs.len() {
        w[l] = qs[l] * (sigma2 + xs[l] * xs[l]).sqrt();
    }
    w.iter().sum()
}

/// The asymmetric fits (scale, min) of a super-block's `N` sub-blocks of `L` values.
struct SubFits<const N: usize> {
    scales: [f32; N],
    mins: [f32; N],
    /// Each sub-block's total weight.
    weights: [f32; N],
    max_scale: f32,
    max_min: f32,
}

/// Fits each `L`-value sub-block of `x` with [`asymmetric_grid`] (`nmax`; the search codes to `codes`).
/// Without `importance` the weights are `plain.0(xs)` and the search `plain.1` (`use_mad` `plain.2`), as in
/// ggml's `*_ref`; with it ggml's `*_impl` weights ([`importance_weights`], σ² = `sigma_scale`·mean square of
/// `x`) and search `(-0.9, 0.05, 36)`.
#[allow(clippy::type_complexity)]
fn fit_subblocks<const N: usize, const L: usize>(
    x: &[f32],
    importance: Option<&[f32]>,
    sigma_scale: f32,
    nmax: i32,
    plain: (fn(&[f32], &mut [f32; L]), (f32, f32, i32), bool),
    codes: &mut [u8; QK_K],
) -> SubFits<N> {
    let mut w = [0.0f32; L];
    let mut aux = [0u8; L];
    let mut fits = SubFits {
        scales: [0.0f32; N],
        mins: [0.0f32; N],
        weights: [0.0f32; N],
        max_scale: 0.0,
        max_min: 0.0,
    };
    let sigma2 = importance.map(|_| sigma_scale * sum_sq(x) / QK_K as f32);
    for j in 0..N {
        let xs = &x[L * j..L * j + L];
        let (search, use_mad) = match (importance, sigma2) {
            (Some(qw), Some(sigma2)) => {
                let qs = &qw[L * j..L * j + L];
                fits.weights[j] = importance_weights(xs, qs, sigma2, &mut w);
                ((-0.9, 0.05, 36), false)
            }
            _ => {
                (plain.0)(xs, &mut w);
                (plain.1, plain.2)
            }
        };
        let (s, m) = asymmetric_grid(
            xs,
            &w,
            nmax,
            &mut codes[L * j..L * j + L],
            &mut aux,
            search,
            use_mad,
        );
        fits.scales[j] = s;
        fits.mins[j] = m;
        if s > fits.max_scale {
            fits.max_scale = s;
        }
        if m > fits.max_min {
            fits.max_min = m;
        }
    }
    fits
}

// ---------------------------------------------------------------- Q4_K / Q5_K shared parts

/// Packs eight 6-bit (scale, min) pairs into 12 bytes: pairs 0..4 in the low 6 bits of bytes 0..4 and
/// 4..8; pairs 4..8 as nibbles in bytes 8..12 with their top 2 bits in the top bits of bytes 0..8.
fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8], s: &mut [u8]) {
    s[..12].fill(0);
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
}

/// Sub-block `j`'s (scale, min) from the 12 packed bytes (ggml's `get_scale_min_k4`).
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K / Q5_K codes and their packed scales for one super-block; `codes` gets one code per value.
fn quantize_k4_scales(
    x: &[f32],
    importance: Option<&[f32]>,
    nmax: i32,
    plain_search: (f32, f32, i32),
    codes: &mut [u8; QK_K],
    head: &mut [u8],
) {
    let plain_weights: fn(&[f32], &mut [f32; 32]) = |xs, w| {
        let av_x = (sum_sq(xs) / 32.0).sqrt();
        for l in 0..32 {
            w[l] = av_x + xs[l].abs();
        }
    };
    let fits: SubFits<8> = fit_subblocks(
        x,
        importance,
        2.0,
        nmax,
        (plain_weights, plain_search, false),
        codes,
    );
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    let (d, dmin);
    match importance {
        None => {
            let (max_scale, max_min) = (fits.max_scale, fits.max_min);
            let inv_scale = if max_scale > 0.0 {
                63.0 / max_scale
            } else {
                0.0
            };
            let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
            for j in 0..8 {
                ls[j] = (nearest(inv_scale * fits.scales[j]) as u8).min(63);
                lm[j] = (nearest(inv_min * fits.mins[j]) as u8).min(63);
            }
            d = max_scale / 63.0;
            dmin = max_min / 63.0;
        }
        Some(_) => {
            d = positive_grid(&fits.scales, 63, &mut ls, &fits.weights);
            dmin = positive_grid(&fits.mins, 63, &mut lm, &fits.weights);
            for j in 0..8 {
                ls[j] = ls[j].min(63);
                lm[j] = lm[j].min(63);
            }
        }
    }
    put_f16(head, 0, d);
    put_f16(head, 2, dmin);
    pack_scale_min_k4(&ls, &lm, &mut head[4..16]);
}

/// Q4_K / Q5_K grid of value i: `d·sc_j·code − dmin·m_j`.
fn k4_grid(head: &[u8], step: &mut [f32; QK_K], off: &mut [f32; QK_K]) {
    let d = f16_at(head, 0);
    let dmin = f16_at(head, 2);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &head[4..16]);
        let (dj, dm) = (d * sc as f32, dmin * m as f32);
        step[32 * j..32 * j + 32].fill(dj);
        off[32 * j..32 * j + 32].fill(-dm);
    }
}

pub fn quantize_q4k(x: &[f32], importance: Option<&[f32]>, out: &mut [u8]) {
    quantize_k(GgmlType::Q4K, x, importance, out);
}

fn pack_q4k(codes: &[u8; QK_K], out: &mut [u8]) {
    let qs = &mut out[16..144];
    for (chunk, q) in codes.chunks_exact(64).zip(qs.chunks_exact_mut(32)) {
        for l in 0..32 {
            q[l] = chunk[l] | (chunk[l + 32] << 4);
        }
    }
}

pub fn dequantize_q4k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let s = &b[4..16];
    for (k, q) in b[16..144].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * k, s);
        let (sc2, m2) = scale_min_k4(2 * k + 1, s);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let out = &mut y[64 * k..64 * k + 64];
        for l in 0..32 {
            out[l] = d1 * (q[l] & 0xF) as f32 - m1;
            out[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

pub fn quantize_q5k(x: &[f32], importance: Option<&[f32]>, out: &mut [u8]) {
    quantize_k(GgmlType::Q5K, x, importance, out);
}

fn pack_q5k(codes: &[u8; QK_K], out: &mut [u8]) {
    let (qh, ql) = out[16..176].split_at_mut(32);
    qh.fill(0);
    for (n, q) in ql.chunks_exact_mut(32).enumerate() {
        let (m1, m2) = (1u8 << (2 * n), 2u8 << (2 * n));
        for j in 0..32 {
            let mut l1 = codes[64 * n + j];
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            let mut l2 = codes[64 * n + j + 32];
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            q[j] = l1 | (l2 << 4);
        }
    }
}

pub fn dequantize_q5k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let s = &b[4..16];
    let qh = &b[16..48];
    for (k, ql) in b[48..176].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * k, s);
        let (sc2, m2) = scale_min_k4(2 * k + 1, s);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * k), 2u8 << (2 * k));
        let out = &mut y[64 * k..64 * k + 64];
        for l in 0..32 {
            let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            out[l] = d1 * ((ql[l] & 0xF) + hi1) as f32 - m1;
            out[l + 32] = d2 * ((ql[l] >> 4) + hi2) as f32 - m2;
        }
    }
}

// ---------------------------------------------------------------- Q6_K

pub fn quantize_q6k(x: &[f32], importance: Option<&[f32]>, out: &mut [u8]) {
    quantize_k(GgmlType::Q6K, x, importance, out);
}

/// Q6_K's scale search: writes `scales` and `d`, the search's codes (offset by 32) to `codes_out`.
fn q6k_scales(x: &[f32], importance: Option<&[f32]>, out: &mut [u8], codes_out: &mut [u8; QK_K]) {
    let mut codes = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut max_abs) = (0.0f32, 0.0f32);
    for ib in 0..16 {
        let xs = &x[16 * ib..16 * ib + 16];
        let w = match importance {
            Some(qw) => SymWeights::Given(&qw[16 * ib..16 * ib + 16]),
            None => SymWeights::Square,
        };
        let s = symmetric_grid(xs, 32, &mut codes[16 * ib..16 * ib + 16], w);
        scales[ib] = s;
        if s.abs() > max_abs {
            max_abs = s.abs();
            max_scale = s;
        }
    }
    out[..210].fill(0);
    if max_abs < GROUP_MAX_EPS {
        // All zero bytes: codes 0 with d = 0.
        codes_out.fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    put_f16(out, 208, 1.0 / iscale);
    for ib in 0..16 {
        out[192 + ib] = nearest(iscale * scales[ib]).min(127) as i8 as u8;
    }
    for (o, c) in codes_out.iter_mut().zip(codes) {
        *o = c as u8;
    }
}

/// Q6_K grid of value i: `d·sc_j·(code − 32)`.
fn q6k_grid(b: &[u8], step: &mut [f32; QK_K], off: &mut [f32; QK_K]) {
    let d = f16_at(b, 208);
    for j in 0..16 {
        step[16 * j..16 * j + 16].fill(d * (b[192 + j] as i8) as f32);
    }
    off.fill(0.0);
}

fn pack_q6k(codes: &[u8; QK_K], out: &mut [u8]) {
    let (ql, rest) = out.split_at_mut(128);
    let qh = &mut rest[..64];
    for half in 0..2 {
        let l0 = &codes[128 * half..128 * half + 128];
        let ql = &mut ql[64 * half..64 * half + 64];
        let qh = &mut qh[32 * half..32 * half + 32];
        for l in 0..32 {
            let (a, b, c, e) = (l0[l], l0[l + 32], l0[l + 64], l0[l + 96]);
            ql[l] = (a & 0xF) | ((c & 0xF) << 4);
            ql[l + 32] = (b & 0xF) | ((e & 0xF) << 4);
            qh[l] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
        }
    }
}

pub fn dequantize_q6k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    let sc = &b[192..208];
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &sc[8 * half..8 * half + 8];
        let out = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

// ---------------------------------------------------------------- Q2_K / Q3_K shared parts

/// Packs 256 two-bit codes: byte `32h + l` of `qs` holds codes `128h + l + 32s` in bits `2s..2s+2`.
fn pack_2bit(codes: &[u8; QK_K], qs: &mut [u8]) {
    for h in 0..2 {
        let c = &codes[128 * h..128 * h + 128];
        for l in 0..32 {
            qs[32 * h + l] = c[l] | (c[l + 32] << 2) | (c[l + 64] << 4) | (c[l + 96] << 6);
        }
    }
}

/// The two-bit code of value `i` of a super-block and the index of the 16-value sub-block it is in.
fn code_2bit(qs: &[u8], i: usize) -> u8 {
    let (h, r) = (i / 128, i % 128);
    (qs[32 * h + r % 32] >> (2 * (r / 32))) & 3
}

// ---------------------------------------------------------------- Q2_K

pub fn quantize_q2k(x: &[f32], importance: Option<&[f32]>, out: &mut [u8]) {
    quantize_k(GgmlType::Q2K, x, importance, out);
}

/// Q2_K's scale search: writes `scales`, `d` and `dmin`, the search's codes to `codes`.
fn q2k_scales(x: &[f32], importance: Option<&[f32]>, out: &mut [u8], codes: &mut [u8; QK_K]) {
    let plain_weights: fn(&[f32], &mut [f32; 16]) = |xs, w| {
        for l in 0..16 {
            w[l] = xs[l].abs();
        }
    };
    // ggml's Q2_K takes σ² as the mean square (the other K-quants twice it).
    let fits: SubFits<16> = fit_subblocks(
        x,
        importance,
        1.0,
        3,
        (plain_weights, (-0.5, 0.1, 15), true),
        codes,
    );
    let mut packed = [0u8; 16];
    let (d, dmin);
    match importance {
        None => {
            let (max_scale, max_min) = (fits.max_scale, fits.max_min);
            if max_scale > 0.0 {
                let iscale = 15.0 / max_scale;
                for j in 0..16 {
                    packed[j] = nearest(iscale * fits.scales[j]) as u8;
                }
                d = max_scale / 15.0;
            } else {
                d = 0.0;
            }
            if max_min > 0.0 {
                let iscale = 15.0 / max_min;
                for j in 0..16 {
                    packed[j] |= (nearest(iscale * fits.mins[j]) << 4) as u8;
                }
                dmin = max_min / 15.0;
            } else {
                dmin = 0.0;
            }
        }
        Some(_) => {
            let mut ls = [0u8; 16];
            let mut lm = [0u8; 16];
            d = positive_grid(&fits.scales, 15, &mut ls, &fits.weights);
            dmin = positive_grid(&fits.mins, 15, &mut lm, &fits.weights);
            for j in 0..16 {
                packed[j] = ls[j] | (lm[j] << 4);
            }
        }
    }
    put_f16(out, 80, d);
    put_f16(out, 82, dmin);
    out[..16].copy_from_slice(&packed);
}

/// Q2_K grid of value i: `d·sc_j·code − dmin·m_j`.
fn q2k_grid(b: &[u8], step: &mut [f32; QK_K], off: &mut [f32; QK_K]) {
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for j in 0..16 {
        step[16 * j..16 * j + 16].fill(d * (b[j] & 0xF) as f32);
        off[16 * j..16 * j + 16].fill(-(dmin * (b[j] >> 4) as f32));
    }
}

pub fn dequantize_q2k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    let qs = &b[16..80];
    for (i, o) in y.iter_mut().enumerate().take(QK_K) {
        // Sub-blocks of 16 follow the value order: value i is in sub-block i / 16.
        let sc = b[i / 16];
        *o = d * (sc & 0xF) as f32 * code_2bit(qs, i) as f32 - dmin * (sc >> 4) as f32;
    }
}

// ---------------------------------------------------------------- Q3_K

/// Packs 16 six-bit values (already biased by 32): low nibbles of 0..8 in the low halves of bytes
/// 0..8, of 8..16 in their high halves; the top 2 bits of value `j` in byte `8 + j % 4` at bit `2(j/4)`.
fn pack_q3_scales(l: &[u8; 16], s: &mut [u8]) {
    s[..12].fill(0);
    for j in 0..16 {
        if j < 8 {
            s[j] = l[j] & 0xF;
        } else {
            s[j - 8] |= (l[j] & 0xF) << 4;
        }
        s[8 + j % 4] |= (l[j] >> 4) << (2 * (j / 4));
    }
}

/// Sub-block `j`'s signed scale (−32..=31) from the 12 packed bytes.
pub fn q3_scale(j: usize, s: &[u8]) -> i32 {
    let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
    let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    (low | (high << 4)) as i32 - 32
}

pub fn quantize_q3k(x: &[f32], importance: Option<&[f32]>, out: &mut [u8]) {
    quantize_k(GgmlType::Q3K, x, importance, out);
}

/// Q3_K's scale search: writes `scales` and `d`, the search's codes (offset by 4) to `codes_out`.
fn q3k_scales(x: &[f32], importance: Option<&[f32]>, out: &mut [u8], codes_out: &mut [u8; QK_K]) {
    let mut codes = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let mut biased = [0u8; 16];
    let d;
    match importance {
        None => {
            let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
            for j in 0..16 {
                let s = symmetric_grid_refined(
                    &x[16 * j..16 * j + 16],
                    4,
                    &mut codes[16 * j..16 * j + 16],
                );
                scales[j] = s;
                if s.abs() > amax {
                    amax = s.abs();
                    max_scale = s;
                }
            }
            if max_scale != 0.0 {
                let iscale = -32.0 / max_scale;
                for j in 0..16 {
                    let l = (nearest(iscale * scales[j]) as i8).clamp(-32, 31) + 32;
                    biased[j] = l as u8;
                }
                d = 1.0 / iscale;
            } else {
                d = 0.0;
            }
        }
        Some(qw) => {
            let sigma2 = 2.0 * sum_sq(x) / QK_K as f32;
            let mut w = [0.0f32; 16];
            let mut sw = [0.0f32; 16];
            for j in 0..16 {
                let xs = &x[16 * j..16 * j + 16];
                sw[j] = importance_weights(xs, &qw[16 * j..16 * j + 16], sigma2, &mut w);
                scales[j] = symmetric_grid(
                    xs,
                    4,
                    &mut codes[16 * j..16 * j + 16],
                    SymWeights::Given(&w),
                );
            }
            let mut ls = [0i8; 16];
            d = symmetric_grid(&scales, 32, &mut ls, SymWeights::Given(&sw));
            for j in 0..16 {
                biased[j] = ls[j] as u8;
            }
        }
    }
    out[..110].fill(0);
    pack_q3_scales(&biased, &mut out[96..108]);
    put_f16(out, 108, d);
    for (o, c) in codes_out.iter_mut().zip(codes) {
        *o = c as u8;
    }
}

/// Q3_K grid of value i: `d·s_j·(code − 4)`.
fn q3k_grid(b: &[u8], step: &mut [f32; QK_K], off: &mut [f32; QK_K]) {
    let d = f16_at(b, 108);
    for j in 0..16 {
        step[16 * j..16 * j + 16].fill(d * q3_scale(j, &b[96..108]) as f32);
    }
    off.fill(0.0);
}

fn pack_q3k(codes: &[u8; QK_K], out: &mut [u8]) {
    // The high bit of value i goes to hmask byte i % 32, bit i / 32.
    out[..32].fill(0);
    let mut low = [0u8; QK_K];
    for i in 0..QK_K {
        let mut c = codes[i];
        if c > 3 {
            out[i % 32] |= 1 << (i / 32);
            c -= 4;
        }
        low[i] = c;
    }
    pack_2bit(&low, &mut out[32..96]);
}

pub fn dequantize_q3k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 108);
    let hmask = &b[..32];
    let qs = &b[32..96];
    let s = &b[96..108];
    for (i, o) in y.iter_mut().enumerate().take(QK_K) {
        let high = hmask[i % 32] & (1 << (i / 32)) != 0;
        let q = code_2bit(qs, i) as i32 - if high { 0 } else { 4 };
        *o = d * q3_scale(i / 16, s) as f32 * q as f32;
    }
}
