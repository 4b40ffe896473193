//! Scale refinement after the sweep: with the codes fixed, each row's group scales are refitted by least
//! squares to the layer's output error `(w − q)·H·(w − q)ᵀ`, the objective GPTQ itself approximates one
//! column at a time. The sweep picks every group's scale from min/max of the weights as it reaches the
//! group, before its codes exist; once they do, the output error is a quadratic in the row's scales
//! (`q_c = s_{g(c)}·(code_c − zero_g)`), whose minimum is one small solve per row.

use crate::numerics::linalg::SweepFactor;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatMut, MatRef, Par};
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
/// `R_jj` on the diagonal (see [`crate::numerics::linalg`]). A triangular product (a sixth of the full
/// product's work) fills the lower half, which is then mirrored.
pub(crate) fn hessian_from_factor(f: &SweepFactor) -> Mat<f32> {
    use faer::linalg::matmul::triangular::{matmul as tri_matmul, BlockStructure};
    let n = f.dim();
    let (coef, rd) = (f.coef(), f.r_diag());
    let r = Mat::<f32>::from_fn(n, n, |i, j| match i.cmp(&j) {
        std::cmp::Ordering::Less => coef[(i, j)] * rd[j],
        std::cmp::Ordering::Equal => rd[j],
        std::cmp::Ordering::Greater => 0.0,
    });
    let mut h = Mat::<f32>::zeros(n, n);
    tri_matmul(
        h.as_mut(),
        BlockStructure::TriangularLower,
        Accum::Replace,
        r.as_ref(),
        BlockStructure::TriangularUpper,
        r.as_ref().transpose(),
        BlockStructure::TriangularLower,
        1.0,
        Par::rayon(0),
    );
    drop(r);
    for j in 1..n {
        for i in 0..j {
            h[(i, j)] = h[(j, i)];
        }
    }
    h
}

/// What the refit of one module needs that stays the same from round to round: the Hessian and `H·Wᵀ` in a
/// column order where each group is one contiguous segment, and each row's `w·H·wᵀ`.
pub(crate) struct RefineSetup {
    rows: usize,
    n: usize,
    groups: usize,
    /// `order[j]` = the sweep position at position `j` of the working order; `None` = the sweep order itself
    /// (the usual case: the sweep reaches each group's columns one after another).
    order: Option<Vec<usize>>,
    /// `(start, end, group)` of each group's columns in the working order.
    segs: Vec<(usize, usize, usize)>,
    /// The group of each position of the working order.
    seg_of: Vec<usize>,
    /// H in the working order.
    h: Mat<f32>,
    /// `hw[r * n + j]` = `(H·w_rᵀ)_j`: column-major `n × rows`, one row of W per column.
    hw: Vec<f32>,
    /// `w_r·H·w_rᵀ` of every row: the constant of each row's error.
    wt_h_w: Vec<f64>,
    /// See [`REFIT_BLOCK_BYTES`] (smaller in tests, to run several blocks).
    block_bytes: usize,
}

impl RefineSetup {
    /// `w_col(k)` is column `k` of W in sweep order (after the dead-column fix), `col_group[k]` its group,
    /// `h` the Hessian in sweep order.
    pub(crate) fn new<'a>(
        rows: usize,
        w_col: &(dyn Fn(usize) -> &'a [f32] + Sync),
        col_group: &[usize],
        groups: usize,
        h: Mat<f32>,
    ) -> Self {
        let n = col_group.len();
        let runs = segments(col_group.iter().copied());
        let mut seen = vec![false; groups];
        let contiguous = runs
            .iter()
            .all(|&(_, _, g)| seen.get_mut(g).is_some_and(|v| !std::mem::replace(v, true)));
        let (order, segs, h) = if contiguous {
            (None, runs, h)
        } else {
            // A group's columns are not one run of the sweep (act-order): sort the positions by group.
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by_key(|&k| col_group[k]);
            let segs = segments(order.iter().map(|&k| col_group[k]));
            let hp = Mat::<f32>::from_fn(n, n, |i, j| h[(order[i], order[j])]);
            (Some(order), segs, hp)
        };
        let pos = |j: usize| order.as_ref().map_or(j, |o| o[j]);
        // W in the working order, one row of W per column.
        let w = rows_major(n, rows, |j, r0, out| {
            out.copy_from_slice(&w_col(pos(j))[r0..r0 + out.len()]);
        });
        let mut seg_of = vec![0usize; n];
        for &(s, e, g) in &segs {
            seg_of[s..e].fill(g);
        }
        let mut hw = vec![0f32; n * rows];
        if rows > 0 && n > 0 {
            matmul(
                MatMut::from_column_major_slice_mut(&mut hw, n, rows),
                Accum::Replace,
                h.as_ref(),
                MatRef::from_column_major_slice(&w, n, rows),
                1.0,
                Par::rayon(0),
            );
        }
        let wt_h_w = (0..rows)
            .into_par_iter()
            .map(|r| dot(&hw[r * n..(r + 1) * n], &w[r * n..(r + 1) * n]))
            .collect();
        RefineSetup {
            rows,
            n,
            groups,
            order,
            segs,
            seg_of,
            h,
            hw,
            wt_h_w,
            block_bytes: REFIT_BLOCK_BYTES,
        }
    }

    /// Refits the scales of every row and group with the codes fixed (module docs).
    ///
    /// `codes[k * rows + r]` are the codes in sweep order; `scales`/`zeros` are laid out `[g * rows + r]` and
    /// only `scales` changes. A row's new scales are kept only when they are all finite and positive and
    /// lower the row's error with the scales rounded to f16 as the checkpoint stores them.
    pub(crate) fn refine(&self, codes: &[u8], scales: &mut [f32], zeros: &[u8]) -> RefineStats {
        let (rows, n, groups) = (self.rows, self.n, self.groups);
        if rows == 0 || n == 0 || groups == 0 {
            return RefineStats::default();
        }
        let gg = groups * groups;
        let pos = |j: usize| self.order.as_ref().map_or(j, |o| o[j]);
        // `a[r * n + j]` = code − zero: the row's dequantized value per unit of its group's scale.
        let a = rows_major(n, rows, |j, r0, out| {
            let (base, zbase) = (pos(j) * rows + r0, self.seg_of[j] * rows + r0);
            let (cs, zs) = (&codes[base..], &zeros[zbase..]);
            for ((o, &q), &z) in out.iter_mut().zip(cs).zip(zs) {
                *o = f32::from(q) - f32::from(z);
            }
        });
        // By blocks of rows, so the per-row systems (`groups²` f64 each: 0.9 MiB per row at 344 groups) and the
        // product below stay within a bound whatever the module's shape.
        let block = (self.block_bytes / (8 * gg))
            .min(self.block_bytes / (4 * n))
            .clamp(ROW_CHUNK, rows.max(ROW_CHUNK))
            .min(rows);
        let mut m = vec![0f64; block * gg];
        let mut t = vec![0f32; n * block];
        let old: Vec<f32> = scales.to_vec();
        let mut results: Vec<(Option<Vec<f32>>, f64, f64)> = Vec::with_capacity(rows);
        for r0 in (0..rows).step_by(block) {
            let cnt = block.min(rows - r0);
            let m = &mut m[..cnt * gg];
            m.fill(0.0);
            let a_blk = &a[r0 * n..(r0 + cnt) * n];
            let a_mat = MatRef::from_column_major_slice(a_blk, n, cnt);
            // Per row, the normal equations of its scales: M[g][h] = a_g·H_gh·a_hᵀ. For the group at [s, e):
            // T = H[s.., s..e]·A_gᵀ, enough for M[g][h] of the groups from it on (M is symmetric), about half
            // the work of the full product.
            for (i, &(s, e, g)) in self.segs.iter().enumerate() {
                let len = n - s;
                matmul(
                    MatMut::from_column_major_slice_mut(&mut t[..len * cnt], len, cnt),
                    Accum::Replace,
                    self.h.as_ref().submatrix(s, s, len, e - s),
                    a_mat.subrows(s, e - s),
                    1.0,
                    Par::rayon(0),
                );
                let t = &t[..len * cnt];
                let later = &self.segs[i..];
                m.par_chunks_mut(gg).enumerate().for_each(|(k, mr)| {
                    let (tr, ar) = (&t[k * len..(k + 1) * len], &a_blk[k * n..(k + 1) * n]);
                    for &(s2, e2, g2) in later {
                        let v = dot(&tr[s2 - s..e2 - s], &ar[s2..e2]);
                        mr[g * groups + g2] += v;
                        if g2 != g {
                            mr[g2 * groups + g] += v;
                        }
                    }
                });
            }
            let m = &*m;
            let block_results: Vec<(Option<Vec<f32>>, f64, f64)> = (0..cnt)
                .into_par_iter()
                .map(|k| {
                    let r = r0 + k;
                    let mr = &m[k * gg..(k + 1) * gg];
                    // b[g] = a_g·(H·wᵀ)_g.
                    let (ar, hwr) = (&a_blk[k * n..(k + 1) * n], &self.hw[r * n..(r + 1) * n]);
                    let mut br = vec![0f64; groups];
                    for &(s, e, g) in &self.segs {
                        br[g] = dot(&ar[s..e], &hwr[s..e]);
                    }
                    let s_old: Vec<f64> = (0..groups)
                        .map(|g| f64::from(half::f16::from_f32(old[g * rows + r]).to_f32()))
                        .collect();
                    let e_old = quadratic(mr, &br, &s_old);
                    let Some(s_new) = solve_row(mr, &br, &s_old) else {
                        return (None, e_old, e_old);
                    };
                    let s16: Vec<f64> = s_new
                        .iter()
                        .map(|&s| f64::from(half::f16::from_f32(s as f32).to_f32()))
                        .collect();
                    let ok = s16.iter().all(|&s| s.is_finite() && s > 0.0);
                    let e_new = quadratic(mr, &br, &s16);
                    if ok && e_new < e_old {
                        (Some(s16.iter().map(|&s| s as f32).collect()), e_old, e_new)
                    } else {
                        (None, e_old, e_old)
                    }
                })
                .collect();
            results.extend(block_results);
        }
        // The quadratic leaves out the constant `w·H·wᵀ`; it is the same before and after, so only the
        // difference is reported faithfully: the totals below add it back per row.
        let mut stats = RefineStats::default();
        for (r, (new, e_old, e_new)) in results.into_iter().enumerate() {
            stats.error_before += e_old + self.wt_h_w[r];
            stats.error_after += e_new + self.wt_h_w[r];
            stats.row_error.push(e_new + self.wt_h_w[r]);
            if let Some(s) = new {
                stats.rows_refined += 1;
                for (g, v) in s.into_iter().enumerate() {
                    scales[g * rows + r] = v;
                }
            }
        }
        stats
    }
}

/// Rows of W per task when a row-major copy is built from columns: each column's reads stay contiguous.
const ROW_CHUNK: usize = 64;

/// An `n × rows` column-major buffer (one row of W per column, `[r * n + j]`) filled from columns: `fill(j, r0,
/// out)` writes position `j`'s values of rows `r0..r0 + out.len()`. By chunks of [`ROW_CHUNK`] rows, so each
/// column is read contiguously.
fn rows_major(n: usize, rows: usize, fill: impl Fn(usize, usize, &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = vec![0f32; n * rows];
    if n == 0 || rows == 0 {
        return out;
    }
    out.par_chunks_mut(n * ROW_CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let cnt = chunk.len() / n;
            let mut col = [0f32; ROW_CHUNK];
            for j in 0..n {
                fill(j, c * ROW_CHUNK, &mut col[..cnt]);
                for (i, &v) in col[..cnt].iter().enumerate() {
                    chunk[i * n + j] = v;
                }
            }
        });
    out
}

/// The most bytes the refit's per-row systems, and separately its product, take for one block of rows (at least
/// [`ROW_CHUNK`] rows a block).
const REFIT_BLOCK_BYTES: usize = 256 << 20;

/// `(start, end, value)` of each run of equal values.
fn segments(values: impl Iterator<Item = usize>) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (k, g) in values.enumerate() {
        match out.last_mut() {
            Some(last) if last.2 == g => last.1 = k + 1,
            _ => out.push((k, k + 1, g)),
        }
    }
    out
}

/// `x·y`, eight lanes in f32 (vectorised), summed in f64.
fn dot(x: &[f32], y: &[f32]) -> f64 {
    let mut acc = [0f32; 8];
    let (xs, ys) = (x.chunks_exact(8), y.chunks_exact(8));
    let (xr, yr) = (xs.remainder(), ys.remainder());
    for (a, b) in xs.zip(ys) {
        for l in 0..8 {
            acc[l] += a[l] * b[l];
        }
    }
    let mut s: f64 = acc.iter().map(|&v| f64::from(v)).sum();
    for (a, b) in xr.iter().zip(yr) {
        s += f64::from(*a) * f64::from(*b);
    }
    s
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Blocks of rows give the same refit as one block: 150 rows in blocks of 64 (the smallest block).
    #[test]
    fn blocks_of_rows_refit_as_one_block() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (rows, n, gs) = (150usize, 96usize, 16usize);
        let groups = n / gs;
        let x = Mat::<f32>::from_fn(4 * n, n, |_, _| rng.random_range(-1.0f32..1.0));
        let mut h = Mat::<f32>::zeros(n, n);
        matmul(
            h.as_mut(),
            Accum::Replace,
            x.transpose(),
            x.as_ref(),
            1.0,
            Par::Seq,
        );
        let w: Vec<Vec<f32>> = (0..n)
            .map(|_| (0..rows).map(|_| rng.random_range(-1.0f32..1.0)).collect())
            .collect();
        let col_group: Vec<usize> = (0..n).map(|k| k / gs).collect();
        let zeros = vec![2u8; groups * rows];
        let scales: Vec<f32> = (0..groups * rows)
            .map(|_| rng.random_range(0.3f32..0.6))
            .collect();
        // Round to nearest with those scales (2 bits): codes that fit W, as a sweep's would.
        let codes: Vec<u8> = (0..n * rows)
            .map(|i| {
                let (k, r) = (i / rows, i % rows);
                let q = (w[k][r] / scales[(k / gs) * rows + r]).round() + 2.0;
                q.clamp(0.0, 3.0) as u8
            })
            .collect();
        let w_col = |k: usize| w[k].as_slice();
        let one = RefineSetup::new(rows, &w_col, &col_group, groups, h.clone());
        let mut blocks = RefineSetup::new(rows, &w_col, &col_group, groups, h);
        blocks.block_bytes = 1;
        let (mut s1, mut s2) = (scales.clone(), scales.clone());
        let a = one.refine(&codes, &mut s1, &zeros);
        let b = blocks.refine(&codes, &mut s2, &zeros);
        assert!(
            a.rows_refined > rows / 2,
            "{} of {rows} rows refined",
            a.rows_refined
        );
        assert_eq!(a.rows_refined, b.rows_refined);
        for (k, (p, q)) in s1.iter().zip(&s2).enumerate() {
            assert!((p - q).abs() <= 1e-3 * p.abs(), "scale {k}: {p} vs {q}");
        }
        for (r, (p, q)) in a.row_error.iter().zip(&b.row_error).enumerate() {
            assert!(
                (p - q).abs() <= 1e-4 * p.abs().max(1.0),
                "row {r}: {p} vs {q}"
            );
        }
    }
}
