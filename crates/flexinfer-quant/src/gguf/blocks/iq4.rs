//! IQ4_NL (32-value blocks) and IQ4_XS (256-value super-blocks of eight 32-value blocks): 4-bit codes
//! indexing a fixed non-uniform grid of 16 values (ggml's `kvalues_iq4nl`), one scale per block.
//!
//! Layouts: `IQ4_NL` (18) = `d: f16`, `qs[16]` (value `j` the low nibble of byte `j`, value `j+16`
//! the high nibble); `IQ4_XS` (136) = `d: f16`, `scales_h: u16`, `scales_l[4]`, `qs[128]`, block `b`'s
//! 6-bit scale `ls` = low nibble `(scales_l[b/2] >> 4(b%2)) & 15` | high bits
//! `((scales_h >> 2b) & 3) << 4`, its values `d·(ls − 32)·grid[code]`.
//!
//! The search is ggml's `quantize_row_iq4_nl_impl`: per block the grid through the value of largest
//! |x|, refit by weighted least squares, and 15 more grids `(grid[0] ± k)/max`; IQ4_XS then stores
//! the block scales as 6-bit multiples of the super-block's `d = −max_scale/32` and recomputes the
//! codes against them.
// Index loops mirror the block layouts (value i ↔ byte, bit) and keep the bounds in one place.
#![allow(clippy::needless_range_loop)]

use super::search::{f16_value, nearest, to_f16, GROUP_MAX_EPS};

/// ggml's `kvalues_iq4nl`.
pub const GRID: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// How many grids either side of the first one the search tries (ggml's `ntry`).
const NTRY: i32 = 7;

/// The grid index nearest `x` (ties to the upper one, as ggml's `best_index_int8`).
fn best_index(x: f32) -> u8 {
    if x <= GRID[0] as f32 {
        return 0;
    }
    if x >= GRID[15] as f32 {
        return 15;
    }
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < GRID[mid] as f32 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - (GRID[hi - 1] as f32) < GRID[hi] as f32 - x {
        (hi - 1) as u8
    } else {
        hi as u8
    }
}

/// One 32-value block's scale and codes; `None` for an all-zero block (scale 0, codes untouched).
fn block_scale(xb: &[f32], w: &[f32], codes: &mut [u8]) -> Option<f32> {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in xb {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return None;
    }
    let g0 = GRID[0] as f32;
    let fit = |id: f32| {
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for j in 0..32 {
            let q = GRID[best_index(id * xb[j]) as usize] as f32;
            sumqx += w[j] * q * xb[j];
            sumq2 += w[j] * q * q;
        }
        (sumqx, sumq2)
    };
    let d0 = -max / g0;
    let id0 = 1.0 / d0;
    for j in 0..32 {
        codes[j] = best_index(id0 * xb[j]);
    }
    let (sumqx, sumq2) = fit(id0);
    let mut d = sumqx / sumq2;
    let mut best = d * sumqx;
    for k in -NTRY..=NTRY {
        let id = (k as f32 + g0) / max;
        let (sumqx, sumq2) = fit(id);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    Some(d)
}

/// Per-value weights: `importance·sqrt(σ² + x²)` (σ² twice the mean square of the (super-)block),
/// or `x²` without importance.
fn weights(xb: &[f32], importance: Option<&[f32]>, sigma2: f32, w: &mut [f32]) {
    for j in 0..xb.len() {
        w[j] = match importance {
            Some(qw) => qw[j] * (sigma2 + xb[j] * xb[j]).sqrt(),
            None => xb[j] * xb[j],
        };
    }
}

fn sigma2_of(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |s, v| s + v * v) * (2.0 / x.len() as f32)
}

fn pack_nibbles(codes: &[u8], qs: &mut [u8]) {
    for (c, q) in codes.chunks_exact(32).zip(qs.chunks_exact_mut(16)) {
        for j in 0..16 {
            q[j] = c[j] | (c[16 + j] << 4);
        }
    }
}

pub fn quantize_iq4_nl(x: &[f32], importance: Option<&[f32]>, out: &mut [u8]) {
    let mut w = [0.0f32; 32];
    weights(x, importance, sigma2_of(x), &mut w);
    let mut codes = [0u8; 32];
    let d = block_scale(x, &w, &mut codes).unwrap_or(0.0);
    out[0..2].copy_from_slice(&to_f16(d).0.to_le_bytes());
    // The codes are recomputed against the unrounded scale (as ggml does for a lone block).
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for j in 0..32 {
        codes[j] = best_index(id * x[j]);
    }
    pack_nibbles(&codes, &mut out[2..18]);
}

pub fn dequantize_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_value(u16::from_le_bytes([b[0], b[1]]));
    for j in 0..16 {
        y[j] = d * GRID[(b[2 + j] & 0xF) as usize] as f32;
        y[j + 16] = d * GRID[(b[2 + j] >> 4) as usize] as f32;
    }
}

pub fn quantize_iq4_xs(x: &[f32], importance: Option<&[f32]>, out: &mut [u8]) {
    let sigma2 = sigma2_of(x);
    let mut w = [0.0f32; 32];
    let mut codes = [0u8; 256];
    let mut scales = [0.0f32; 8];
    let (mut max_scale, mut amax_scale) = (0.0f32, 0.0f32);
    for b in 0..8 {
        let xb = &x[32 * b..32 * b + 32];
        weights(
            xb,
            importance.map(|q| &q[32 * b..32 * b + 32]),
            sigma2,
            &mut w,
        );
        let s = block_scale(xb, &w, &mut codes[32 * b..32 * b + 32]).unwrap_or(0.0);
        scales[b] = s;
        if s.abs() > amax_scale {
            amax_scale = s.abs();
            max_scale = s;
        }
    }
    out[..136].fill(0);
    let d = -max_scale / 32.0;
    out[0..2].copy_from_slice(&to_f16(d).0.to_le_bytes());
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut scales_h = 0u16;
    for b in 0..8 {
        let l = nearest(id * scales[b]).clamp(-32, 31);
        let dl = d * l as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        for j in 32 * b..32 * b + 32 {
            codes[j] = best_index(idl * x[j]);
        }
        let l = (l + 32) as u8;
        out[4 + b / 2] |= (l & 0xF) << (4 * (b % 2));
        scales_h |= u16::from(l >> 4) << (2 * b);
    }
    out[2..4].copy_from_slice(&scales_h.to_le_bytes());
    pack_nibbles(&codes, &mut out[8..136]);
}

pub fn dequantize_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_value(u16::from_le_bytes([b[0], b[1]]));
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    for ib in 0..8 {
        let low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
        let high = ((scales_h >> (2 * ib)) & 3) as u8;
        let dl = d * ((low | (high << 4)) as i32 - 32) as f32;
        let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
        let out = &mut y[32 * ib..32 * ib + 32];
        for j in 0..16 {
            out[j] = dl * GRID[(qs[j] & 0xF) as usize] as f32;
            out[j + 16] = dl * GRID[(qs[j] >> 4) as usize] as f32;
        }
    }
}
