//! Scale refinement after the sweep: with the codes fixed, each row's group scales are refitted by least
//! squares to the layer's output error `(w − q)·H·(w − q)ᵀ`, the objective GPTQ itself approximates one
//! column at a time. The sweep picks every group's scale from min/max of the weights as it reaches the
//! group, before its codes exist; once they do, the output error is a quadratic in the row's scales
//! (`q_c = s_{g(c)}·(code_c − zero_g)`), whose minimum is one small solve per row.

use crate::numerics::linalg::SweepFactor;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, Par};
use rayon::prelude::*;

/// What the refinement did to one module.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RefineStats {
    /// Rows whose scales were replaced (the others kept the sweep's: no gain, or a degenerate solve).
    pub rows_refined: usize,
    /// `Σ_rows (w − q)·H·(w − q)ᵀ` before and after (H the damped, sweep-order Hessian of the factor).
    pub error_before: f64,
    pub error_after: f64,
    /// Each row's error after the refit (H undamped as given), for keeping each row's best round.
    pub row_error: Vec<f64>,
}

/// The damped Hessian in sweep order from its sweep factor: `H = R·Rᵀ` with `R_ij = F_ij·R_jj` (i < j) and
/// `R_jj` on the diagonal (see [`crate::numerics::linalg`]).
pub(crate) fn hessian_from_factor(f: &SweepFactor) -> Mat<f32> {
    let n = f.dim();
    let (coef, rd) = (f.coef(), f.r_diag());
    let r = Mat::<f32>::from_fn(n, n, |i, j| match i.cmp(&j) {
        std::cmp::Ordering::Less => coef[(i, j)] * rd[j],
        std::cmp::Ordering::Equal => rd[j],
        std::cmp::Ordering::Greater => 0.0,
    });
    let mut h = Mat::<f32>::zeros(n, n);
    matmul(
        h.as_mut(),
        Accum::Replace,
        r.as_ref(),
        r.as_ref().transpose(),
        1.0,
        Par::rayon(0),
    );
    h
}

/// Refits the scales of every row and group with the codes fixed (module docs).
///
/// Everything is in sweep order: `w_col(k)` is column `k` of W (after the dead-column fix), `codes[k * rows +
/// r]` its codes, `col_group[k]` its group; `scales`/`zeros` are laid out `[g * rows + r]` and only `scales`
/// changes. `h` is the Hessian in sweep order. A row's new scales are kept only when they are all finite and
/// positive and lower the row's error with the scales rounded to f16 as the checkpoint stores them.
#[allow(clippy::too_many_arguments)] // the sweep's result, its layout and the Hessian
pub(crate) fn refine_scales<'a>(
    rows: usize,
    w_col: &(dyn Fn(usize) -> &'a [f32] + Sync),
    codes: &[u8],
    col_group: &[usize],
    groups: usize,
    scales: &mut [f32],
    zeros: &[u8],
    h: &Mat<f32>,
) -> RefineStats {
    let n = col_group.len();
    if rows == 0 || n == 0 || groups == 0 {
        return RefineStats::default();
    }
    let gg = groups * groups;
    // Row-major copies (`[r * n + k]`), so the per-row sums below read memory in order: `a` = code − zero,
    // the row's dequantized value per unit of its group's scale, and `w`.
    let mut a = vec![0f32; rows * n];
    let mut w = vec![0f32; rows * n];
    a.par_chunks_mut(n)
        .zip(w.par_chunks_mut(n))
        .enumerate()
        .for_each(|(r, (ar, wr))| {
            for k in 0..n {
                let g = col_group[k];
                ar[k] = f32::from(codes[k * rows + r]) - f32::from(zeros[g * rows + r]);
                wr[k] = w_col(k)[r];
            }
        });
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); groups];
    for (k, &g) in col_group.iter().enumerate() {
        members[g].push(k);
    }
    // Per row: M[g][h] = a_g·H_gh·a_hᵀ and b[g] = a_g·H_g:·wᵀ, the normal equations of the row's scales.
    let mut m = vec![0f64; rows * gg];
    let mut b = vec![0f64; rows * groups];
    let mut t = Mat::<f32>::zeros(n, rows);
    for (g, cols) in members.iter().enumerate() {
        if cols.is_empty() {
            continue;
        }
        let a_gt = Mat::<f32>::from_fn(cols.len(), rows, |i, r| a[r * n + cols[i]]);
        let h_g = Mat::<f32>::from_fn(n, cols.len(), |j, i| h[(j, cols[i])]);
        // Tᵀ = H[:, g]·A_gᵀ: column r holds Σ_{i∈g} H_ji·a_ri for every j (H is symmetric).
        matmul(
            t.as_mut(),
            Accum::Replace,
            h_g.as_ref(),
            a_gt.as_ref(),
            1.0,
            Par::rayon(0),
        );
        let t_ref = t.as_ref();
        m.par_chunks_mut(gg)
            .zip(b.par_chunks_mut(groups))
            .enumerate()
            .for_each(|(r, (mr, br))| {
                let (ar, wr) = (&a[r * n..(r + 1) * n], &w[r * n..(r + 1) * n]);
                let Some(tr) = t_ref.col(r).try_as_col_major() else {
                    return;
                };
                let mut bg = 0f64;
                for (j, &tv) in tr.as_slice().iter().enumerate() {
                    let tv = f64::from(tv);
                    mr[g * groups + col_group[j]] += tv * f64::from(ar[j]);
                    bg += tv * f64::from(wr[j]);
                }
                br[g] += bg;
            });
    }
    let old: Vec<f32> = scales.to_vec();
    let results: Vec<(Option<Vec<f32>>, f64, f64)> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let mr = &m[r * gg..(r + 1) * gg];
            let br = &b[r * groups..(r + 1) * groups];
            let s_old: Vec<f64> = (0..groups)
                .map(|g| f64::from(half::f16::from_f32(old[g * rows + r]).to_f32()))
                .collect();
            let e_old = quadratic(mr, br, &s_old);
            let Some(s_new) = solve_row(mr, br, &s_old) else {
                return (None, e_old, e_old);
            };
            let s16: Vec<f64> = s_new
                .iter()
                .map(|&s| f64::from(half::f16::from_f32(s as f32).to_f32()))
                .collect();
            let ok = s16.iter().all(|&s| s.is_finite() && s > 0.0);
            let e_new = quadratic(mr, br, &s16);
            if ok && e_new < e_old {
                (Some(s16.iter().map(|&s| s as f32).collect()), e_old, e_new)
            } else {
                (None, e_old, e_old)
            }
        })
        .collect();
    // The quadratic leaves out the constant `w·H·wᵀ`; it is the same before and after, so only the difference
    // is reported faithfully: the totals below add it back per row.
    let mut stats = RefineStats::default();
    let wt_h_w = row_energy(rows, n, &w, h);
    for (r, (new, e_old, e_new)) in results.into_iter().enumerate() {
        stats.error_before += e_old + wt_h_w[r];
        stats.error_after += e_new + wt_h_w[r];
        stats.row_error.push(e_new + wt_h_w[r]);
        if let Some(s) = new {
            stats.rows_refined += 1;
            for (g, v) in s.into_iter().enumerate() {
                scales[g * rows + r] = v;
            }
        }
    }
    stats
}

/// `sᵀ·M·s − 2·bᵀ·s`: the row's output error less its constant `w·H·wᵀ`.
fn quadratic(m: &[f64], b: &[f64], s: &[f64]) -> f64 {
    let g = b.len();
    let mut e = 0.0;
    for i in 0..g {
        let mut ms = 0.0;
        for j in 0..g {
            ms += m[i * g + j] * s[j];
        }
        e += s[i] * ms - 2.0 * b[i] * s[i];
    }
    e
}

/// The minimiser of [`quadratic`] over the groups whose codes are not all at the zero-point (those keep
/// `s_old`: their scale does not change the row), by Cholesky; `None` when the system is not positive definite.
fn solve_row(m: &[f64], b: &[f64], s_old: &[f64]) -> Option<Vec<f64>> {
    let g = b.len();
    let free: Vec<usize> = (0..g).filter(|&i| m[i * g + i] > 0.0).collect();
    let nf = free.len();
    if nf == 0 {
        return None;
    }
    // Right-hand side with the fixed groups' contribution moved over.
    let mut rhs: Vec<f64> = free
        .iter()
        .map(|&i| {
            b[i] - (0..g)
                .filter(|j| m[*j * g + *j] <= 0.0)
                .map(|j| m[i * g + j] * s_old[j])
                .sum::<f64>()
        })
        .collect();
    let mut l = vec![0f64; nf * nf];
    for i in 0..nf {
        for j in 0..=i {
            let mut s = m[free[i] * g + free[j]];
            for k in 0..j {
                s -= l[i * nf + k] * l[j * nf + k];
            }
            if i == j {
                if !s.is_finite() || s <= 0.0 {
                    return None;
                }
                l[i * nf + i] = s.sqrt();
            } else {
                l[i * nf + j] = s / l[j * nf + j];
            }
        }
    }
    for i in 0..nf {
        let mut s = rhs[i];
        for k in 0..i {
            s -= l[i * nf + k] * rhs[k];
        }
        rhs[i] = s / l[i * nf + i];
    }
    for i in (0..nf).rev() {
        let mut s = rhs[i];
        for k in i + 1..nf {
            s -= l[k * nf + i] * rhs[k];
        }
        rhs[i] = s / l[i * nf + i];
    }
    let mut out = s_old.to_vec();
    for (idx, &i) in free.iter().enumerate() {
        out[i] = rhs[idx];
    }
    Some(out)
}

/// `w_r·H·w_rᵀ` of every row (the constant of each row's error); `w` row-major.
fn row_energy(rows: usize, n: usize, w: &[f32], h: &Mat<f32>) -> Vec<f64> {
    let wm = Mat::<f32>::from_fn(n, rows, |k, r| w[r * n + k]);
    let mut hw = Mat::<f32>::zeros(n, rows);
    matmul(
        hw.as_mut(),
        Accum::Replace,
        h.as_ref(),
        wm.as_ref(),
        1.0,
        Par::rayon(0),
    );
    (0..rows)
        .into_par_iter()
        .map(|r| {
            (0..n)
                .map(|k| f64::from(hw[(k, r)]) * f64::from(w[r * n + k]))
                .sum()
        })
        .collect()
}
