//! The scale searches behind ggml's block quantizers, restated: for one group of values `x` with
//! per-value weights `w`, find the scale (and, for the asymmetric grids, the min) that minimises the
//! weighted squared (or absolute) error, and the codes that go with it. The weights are ggml's:
//! without an importance matrix a function of `x` itself, with one `importance[col] · sqrt(σ² + x²)`.
//!
//! Every rounding is ggml's `nearest_int` (ties to even), so our codes and scales are the ones
//! `llama-quantize` chooses for the same input.
// Index loops mirror the block layouts (value i ↔ byte, bit) and keep the bounds in one place.
#![allow(clippy::needless_range_loop)]

/// Groups whose largest |x| is below this are all zero (ggml's `GROUP_MAX_EPS`).
pub const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`, the same way: adding 1.5·2^23 leaves the value rounded half-to-even in the
/// low mantissa bits (exact for |v| < 2^22, which every caller's range is within). Bit-identical to
/// ggml and several times faster than `round_ties_even`, a libm call on baseline x86-64.
#[inline(always)]
pub fn nearest(v: f32) -> i32 {
    let shifted = v + 12_582_912.0;
    (shifted.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// An f32 stored as f16, and the value that comes back.
#[inline(always)]
pub fn to_f16(v: f32) -> (u16, f32) {
    let h = half::f16::from_f32(v);
    (h.to_bits(), h.to_f32())
}

#[inline(always)]
pub fn f16_value(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Asymmetric grid `x ≈ scale·l − min_out`, `l ∈ 0..=nmax` (ggml's `make_qkx2_quants` /
/// `make_qkx3_quants`, which differ only in their arguments): start from the min/max grid, then try
/// `nstep+1` widened or narrowed grids (`(nmax + rmin + rdelta·k)/(max − min)`), refitting scale and
/// min by weighted least squares for each, and keep the best. Writes the codes to `codes`, returns
/// `(scale, min_out)` with `min_out = −min ≥ 0`.
#[allow(clippy::too_many_arguments)]
pub fn asymmetric_grid(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    codes: &mut [u8],
    scratch: &mut [u8],
    (rmin, rdelta, nstep): (f32, f32, i32),
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w[0];
    let mut sum_x = w[0] * x[0];
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    // ggml compares with `<` / `>`; a NaN never wins there, and `f32::min` skips NaN the same way.
    if min > 0.0 {
        min = 0.0;
    }
    if max <= min {
        codes[..n].fill(0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let err = |d: f32| if use_mad { d.abs() } else { d * d };
    let mut best = 0.0f32;
    for i in 0..n {
        let l = nearest(iscale * (x[i] - min)).clamp(0, nmax);
        codes[i] = l as u8;
        best += w[i] * err(scale * l as f32 + min - x[i]);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for step in 0..=nstep {
        iscale = (rmin + rdelta * step as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest(iscale * (x[i] - min)).clamp(0, nmax);
            scratch[i] = l as u8;
            let lf = l as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur = 0.0f32;
            for i in 0..n {
                cur += w[i] * err(this_scale * scratch[i] as f32 + this_min - x[i]);
            }
            if cur < best {
                codes[..n].copy_from_slice(&scratch[..n]);
                best = cur;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// How [`symmetric_grid`] weighs each value when no explicit weights are given.
#[derive(Clone, Copy)]
pub enum SymWeights<'a> {
    /// `x²` (ggml's `rmse_type == 1` without quant weights).
    Square,
    Given(&'a [f32]),
}

/// Symmetric signed grid `x ≈ scale·(l − nmax)`, `l − nmax ∈ −nmax..nmax` (ggml's `make_qx_quants`
/// with `rmse_type = 1`): the grid through the value of largest |x| (mapped to −nmax), refit by
/// weighted least squares, then 18 neighbouring grids `−(nmax ± 0.1k)/max`, keeping the one with the
/// largest `(Σw·x·l)²/Σw·l²`. Codes are stored offset by `nmax`. Returns the scale.
pub fn symmetric_grid(x: &[f32], nmax: i32, codes: &mut [i8], weights: SymWeights<'_>) -> f32 {
    let n = x.len();
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        codes[..n].fill(0);
        return 0.0;
    }
    let weight = |i: usize| match weights {
        SymWeights::Square => x[i] * x[i],
        SymWeights::Given(w) => w[i],
    };
    let nmaxf = nmax as f32;
    let fit = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest(iscale * x[i]).clamp(-nmax, nmax - 1) as f32;
            let w = weight(i);
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let store = |iscale: f32, codes: &mut [i8]| {
        for i in 0..n {
            codes[i] = (nearest(iscale * x[i]).clamp(-nmax, nmax - 1) + nmax) as i8;
        }
    };
    let iscale0 = -nmaxf / max;
    let (sumlx, suml2) = fit(iscale0);
    store(iscale0, codes);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for k in -9..=9 {
        if k == 0 {
            continue;
        }
        let iscale = -(nmaxf + 0.1 * k as f32) / max;
        let (sumlx, suml2) = fit(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            store(iscale, codes);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Symmetric 3-bit grid for the un-weighted Q3_K path (ggml's `make_q3_quants` with `do_rmse`):
/// the grid through the largest |x| (→ −nmax), then up to five passes moving single codes where that
/// raises `(Σw·x·l)²/Σw·l²` with `w = x²`. Codes offset by `nmax`; returns the scale.
pub fn symmetric_grid_refined(x: &[f32], nmax: i32, codes: &mut [i8]) -> f32 {
    let n = x.len();
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        codes[..n].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut l = [0i32; 32];
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..n {
        l[i] = nearest(iscale * x[i]).clamp(-nmax, nmax - 1);
        let w = x[i] * x[i];
        sumlx += w * x[i] * l[i] as f32;
        suml2 += w * (l[i] * l[i]) as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for i in 0..n {
            let w = x[i] * x[i];
            let li = l[i] as f32;
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for i in 0..n {
        codes[i] = (l[i] + nmax) as i8;
    }
    sumlx / suml2
}

/// Non-negative grid for the super-block's sub-scales and sub-mins, `x ≈ scale·l`, `l ∈ 0..=nmax`,
/// weighted by each sub-block's total weight (ggml's `make_qp_quants`): the max grid, eight
/// neighbours `(nmax ± 0.1k)/max`, then up to five passes of single-code moves. Returns the scale.
pub fn positive_grid(x: &[f32], nmax: i32, codes: &mut [u8], w: &[f32]) -> f32 {
    let n = x.len();
    let mut max = 0.0f32;
    for &v in x {
        max = max.max(v);
    }
    if max < GROUP_MAX_EPS {
        codes[..n].fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / max;
    let scale0 = 1.0 / iscale;
    // The first pass does not cap at nmax (ggml stores the uncapped code, then measures it).
    let mut best = 0.0f32;
    for i in 0..n {
        let l = nearest(iscale * x[i]);
        let d = x[i] - scale0 * (l as u8) as f32;
        best += w[i] * d * d;
    }
    for k in -4..=4 {
        if k == 0 {
            continue;
        }
        let is = (0.1 * k as f32 + nmaxf) / max;
        let s = 1.0 / is;
        let mut mse = 0.0f32;
        for i in 0..n {
            let l = nearest(is * x[i]).min(nmax);
            let d = x[i] - s * l as f32;
            mse += w[i] * d * d;
        }
        if mse < best {
            best = mse;
            iscale = is;
        }
    }
    let mut l = [0i32; 16];
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..n {
        l[i] = nearest(iscale * x[i]).min(nmax);
        let lf = l[i] as f32;
        sumlx += w[i] * x[i] * lf;
        suml2 += w[i] * lf * lf;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for i in 0..n {
            let li = l[i] as f32;
            let mut slx = sumlx - w[i] * x[i] * li;
            let mut sl2 = suml2 - w[i] * li * li;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest(x[i] * sl2 / slx).min(nmax);
                if new_l != l[i] {
                    let nl = new_l as f32;
                    slx += w[i] * x[i] * nl;
                    sl2 += w[i] * nl * nl;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for i in 0..n {
        codes[i] = l[i] as u8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}
