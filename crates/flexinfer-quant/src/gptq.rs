//! The GPTQ column sweep (lazy batch updates) and the RTN fallback (GPTQ-NOTES §1.7–§1.10, §1.12).

use crate::hessian::PreparedFactor;
use crate::linalg::LinalgBackend;
use crate::params::GptqParams;
use crate::quantizer::{dequantize, find_params, maxq, quantize_code, GroupParams};
use faer::{Mat, MatMut, MatRef};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Columns per outer block of the two-level sweep (rounded up to a multiple of the block and group size).
pub const OUTER_BLOCK: usize = 1024;

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// How a module was quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    Gptq,
    Rtn,
}

/// One quantized linear layer: integer codes plus per-group parameters, everything in original column order.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedLinear {
    /// Output features (rows of W).
    pub rows: usize,
    /// Input features (columns of W).
    pub cols: usize,
    pub bits: u32,
    pub sym: bool,
    /// Integer codes, input-major: `codes[c * rows + r]`.
    pub codes: Vec<u8>,
    /// `scales[g * rows + r]` in group-index order.
    pub scales: Vec<f32>,
    /// Integer zero-points, same layout as `scales`.
    pub zeros: Vec<u8>,
    /// Group of each input column.
    pub g_idx: Vec<i32>,
    pub method: Method,
    /// `Σ (w−q)²/d²/2` (0 for RTN).
    pub loss: f64,
    pub damp: f32,
}

impl QuantizedLinear {
    pub fn groups(&self) -> usize {
        self.scales.len() / self.rows.max(1)
    }
}

fn col_slices(w: &Mat<f32>, start: usize, end: usize) -> impl Iterator<Item = &[f32]> {
    (start..end).map(move |c| w.col_as_slice(c))
}

fn push_group(scales: &mut [f32], zeros: &mut [u8], g: usize, rows: usize, p: &GroupParams) {
    scales[g * rows..(g + 1) * rows].copy_from_slice(&p.scale);
    for r in 0..rows {
        zeros[g * rows + r] = p.zero[r] as u8;
    }
}

/// GPTQ on `w` (`[rows=out, cols=in]`) with a prepared inverse-Hessian factor.
pub fn gptq_quantize(
    backend: &dyn LinalgBackend,
    w_in: &Mat<f32>,
    factor: &PreparedFactor,
    p: &GptqParams,
) -> QuantizedLinear {
    let rows = w_in.nrows();
    let cols = w_in.ncols();
    let gs = p.effective_group(cols);
    let n_groups = cols.div_ceil(gs);
    let maxq = maxq(p.bits);
    let mut w = w_in.clone();

    // With one group per row the parameters come from W before the dead-column fix (IST order).
    let mut current: Option<GroupParams> = if p.group_size <= 0 {
        Some(find_params(rows, col_slices(&w, 0, cols), p.bits, p.sym))
    } else {
        None
    };
    for (c, &dead) in factor.dead.iter().enumerate() {
        if dead {
            w.col_mut(c).fill(0.0);
        }
    }
    let static_groups: Vec<GroupParams> = if p.static_groups && p.group_size > 0 {
        (0..n_groups)
            .map(|g| {
                find_params(
                    rows,
                    col_slices(&w, g * gs, ((g + 1) * gs).min(cols)),
                    p.bits,
                    p.sym,
                )
            })
            .collect()
    } else {
        Vec::new()
    };
    let perm: Vec<usize> = factor.perm.clone().unwrap_or_else(|| (0..cols).collect());
    if factor.perm.is_some() {
        w = Mat::from_fn(rows, cols, |r, k| w[(r, perm[k])]);
    }

    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0f32; n_groups * rows];
    let mut zeros = vec![0u8; n_groups * rows];
    let mut g_idx = vec![0i32; cols];
    let u = &factor.u;
    let mut loss = 0.0f64;
    if let (Some(cur), true) = (&current, p.group_size <= 0) {
        push_group(&mut scales, &mut zeros, 0, rows, cur);
    }
    for (g, sg) in static_groups.iter().enumerate() {
        push_group(&mut scales, &mut zeros, g, rows, sg);
    }

    let bs = p.block_size;
    // Two-level lazy batching: inner blocks of `bs` columns (the reference's semantics, including where group
    // parameters are read), and the update of the columns beyond an outer block deferred to one wide GEMM.
    // Columns inside the outer block get every inner update before their block starts, and an outer block is a
    // multiple of the group size, so each group still sees W exactly as the single-level sweep would.
    let lcm = |a: usize, b: usize| a / gcd(a, b) * b;
    let unit = if p.group_size > 0 && !p.static_groups {
        lcm(bs, gs)
    } else {
        bs
    };
    let outer = unit * OUTER_BLOCK.div_ceil(unit).max(1);
    let mut o1 = 0;
    while o1 < cols {
        let o2 = (o1 + outer).min(cols);
        let mut err_outer = Mat::<f32>::zeros(rows, o2 - o1);
        let mut i1 = o1;
        while i1 < o2 {
            let i2 = (i1 + bs).min(o2);
            let count = i2 - i1;
            let mut w1 = w.subcols(i1, count).to_owned();
            let mut err1 = err_outer.subcols_mut(i1 - o1, count);
            // Group parameters of every column of the block are fixed before the sweep: they are read from the
            // global W, which the block's own updates never touch (the reference's quirk, kept for parity).
            let mut block_params: Vec<GroupParams> = Vec::new();
            let mut col_param: Vec<Option<usize>> = vec![None; count];
            let mut cur_idx: Option<usize> = current.as_ref().map(|c| {
                block_params.push(c.clone());
                0
            });
            let mut cur_static: Option<usize> = None;
            for (i, slot) in col_param.iter_mut().enumerate() {
                let k = i1 + i;
                let orig = perm[k];
                let group_of_k;
                if p.group_size > 0 {
                    if p.static_groups {
                        group_of_k = orig / gs;
                        if cur_static != Some(group_of_k) {
                            block_params.push(static_groups[group_of_k].clone());
                            cur_idx = Some(block_params.len() - 1);
                            cur_static = Some(group_of_k);
                        }
                    } else {
                        group_of_k = k / gs;
                        if k % gs == 0 {
                            let gp = find_params(
                                rows,
                                col_slices(&w, k, (k + gs).min(cols)),
                                p.bits,
                                p.sym,
                            );
                            push_group(&mut scales, &mut zeros, group_of_k, rows, &gp);
                            block_params.push(gp);
                            cur_idx = Some(block_params.len() - 1);
                        }
                    }
                } else {
                    group_of_k = 0;
                }
                g_idx[orig] = group_of_k as i32;
                *slot = cur_idx;
            }
            current = cur_idx.map(|i| block_params[i].clone());
            // Rows are independent inside a block: sweep row chunks in parallel.
            let u_blk = u.submatrix(i1, i1, count, count);
            let parts_n = if rows >= 256 {
                rayon::current_num_threads().clamp(1, rows / 128)
            } else {
                1
            };
            let mut parts = Vec::with_capacity(parts_n);
            let (mut wr, mut er) = (w1.as_mut(), err1.as_mut());
            let mut r0 = 0;
            for t in 0..parts_n {
                let len = (rows - r0) / (parts_n - t);
                let (wa, wb) = wr.split_at_row_mut(len);
                let (ea, eb) = er.split_at_row_mut(len);
                parts.push((r0, wa, ea));
                wr = wb;
                er = eb;
                r0 += len;
            }
            let swept: Vec<(usize, Vec<u8>, f64)> = parts
                .into_par_iter()
                .map(|(r0, wp, ep)| {
                    let (c, l) = sweep_rows(wp, ep, u_blk, &block_params, &col_param, r0, maxq);
                    (r0, c, l)
                })
                .collect();
            for (r0, local, l) in swept {
                loss += l;
                let len = local.len() / count.max(1);
                for i in 0..count {
                    let orig = perm[i1 + i];
                    codes[orig * rows + r0..orig * rows + r0 + len]
                        .copy_from_slice(&local[i * len..(i + 1) * len]);
                }
            }
            if i2 < o2 {
                backend.block_update(
                    w.subcols_mut(i2, o2 - i2),
                    err1.as_ref(),
                    u.submatrix(i1, i2, count, o2 - i2),
                );
            }
            i1 = i2;
        }
        if o2 < cols {
            backend.block_update(
                w.subcols_mut(o2, cols - o2),
                err_outer.as_ref(),
                u.submatrix(o1, o2, o2 - o1, cols - o2),
            );
        }
        o1 = o2;
    }
    if p.static_groups && p.group_size > 0 {
        for (c, gi) in g_idx.iter_mut().enumerate() {
            *gi = (c / gs) as i32;
        }
    }
    QuantizedLinear {
        rows,
        cols,
        bits: p.bits,
        sym: p.sym,
        codes,
        scales,
        zeros,
        g_idx,
        method: Method::Gptq,
        loss,
        damp: factor.damp,
    }
}

/// The in-block column loop for rows `r0 .. r0 + w.nrows()`: quantize each column, record its scaled error,
/// and apply the rank-1 update to the block's later columns. Returns the codes (`[count][rows]`) and the loss.
fn sweep_rows(
    mut w: MatMut<'_, f32>,
    mut e: MatMut<'_, f32>,
    u_blk: MatRef<'_, f32>,
    params: &[GroupParams],
    col_param: &[Option<usize>],
    r0: usize,
    maxq: f32,
) -> (Vec<u8>, f64) {
    let (len, count) = (w.nrows(), w.ncols());
    let mut codes = vec![0u8; len * count];
    let mut loss = 0.0f64;
    for i in 0..count {
        let Some(gp) = col_param[i].map(|pi| &params[pi]) else {
            continue;
        };
        let (scale, zero) = (&gp.scale[r0..r0 + len], &gp.zero[r0..r0 + len]);
        let d = u_blk[(i, i)];
        let mut sq = 0.0f64;
        {
            let (Some(wcol), Some(ecol)) = (
                w.as_ref().col(i).try_as_col_major(),
                e.as_mut().col_mut(i).try_as_col_major_mut(),
            ) else {
                continue;
            };
            let (wcol, ecol) = (wcol.as_slice(), ecol.as_slice_mut());
            let out = &mut codes[i * len..(i + 1) * len];
            for r in 0..len {
                let x = wcol[r];
                let q = quantize_code(x, scale[r], zero[r], maxq);
                out[r] = q as u8;
                let diff = x - dequantize(q, scale[r], zero[r]);
                sq += (diff * diff) as f64;
                ecol[r] = diff / d;
            }
        }
        loss += sq / (d as f64 * d as f64) / 2.0;
        let Some(left) = e.as_ref().col(i).try_as_col_major() else {
            continue;
        };
        let left = left.as_slice();
        for j in i + 1..count {
            let coef = u_blk[(i, j)];
            if coef == 0.0 {
                continue;
            }
            let Some(right) = w.as_mut().col_mut(j).try_as_col_major_mut() else {
                continue;
            };
            for (wv, ev) in right.as_slice_mut().iter_mut().zip(left) {
                *wv -= ev * coef;
            }
        }
    }
    (codes, loss)
}

/// Round-to-nearest per group, no Hessian (the fallback when recovery is exhausted).
pub fn rtn_quantize(w: &Mat<f32>, p: &GptqParams) -> QuantizedLinear {
    let rows = w.nrows();
    let cols = w.ncols();
    let gs = p.effective_group(cols);
    let n_groups = cols.div_ceil(gs);
    let maxq = maxq(p.bits);
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0f32; n_groups * rows];
    let mut zeros = vec![0u8; n_groups * rows];
    let mut g_idx = vec![0i32; cols];
    for g in 0..n_groups {
        let (start, end) = (g * gs, ((g + 1) * gs).min(cols));
        let gp = find_params(rows, col_slices(w, start, end), p.bits, p.sym);
        push_group(&mut scales, &mut zeros, g, rows, &gp);
        for c in start..end {
            g_idx[c] = g as i32;
            let col = w.col_as_slice(c);
            for r in 0..rows {
                codes[c * rows + r] = quantize_code(col[r], gp.scale[r], gp.zero[r], maxq) as u8;
            }
        }
    }
    QuantizedLinear {
        rows,
        cols,
        bits: p.bits,
        sym: p.sym,
        codes,
        scales,
        zeros,
        g_idx,
        method: Method::Rtn,
        loss: 0.0,
        damp: 0.0,
    }
}

/// The weight the consumer reconstructs: `scale_f16 · (code − zero)` with the group from `g_idx`.
pub fn dequantize_weight(q: &QuantizedLinear) -> Mat<f32> {
    let rows = q.rows;
    Mat::from_fn(rows, q.cols, |r, c| {
        let g = q.g_idx[c] as usize;
        let s = half::f16::from_f32(q.scales[g * rows + r]).to_f32();
        s * (q.codes[c * rows + r] as f32 - q.zeros[g * rows + r] as f32)
    })
}
