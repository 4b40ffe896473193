//! GPTQ error feedback on the K-quant grids.
//!
//! A K-quant tensor is `rows × cols` with the super-blocks of 256 running along a row (the input
//! dimension), so a super-block is 256 consecutive Hessian columns. The sweep takes them in order,
//! one super-block of columns at a time, as GPTQ with groups does:
//! 1. each row's super-block scales (and mins) are chosen from the row's weights **as updated by the
//!    error of every earlier column** ([`choose_scales`], importance-weighted as without feedback):
//!    GPTQ's state of the block when it starts, recovered from the sweep-factor form by one
//!    triangular solve ([`block_state`]);
//! 2. the block's columns are rounded one by one onto that grid, each column's error `W₀ − Q` is fed
//!    to the block's later columns through the sweep factor of the layer's Hessian
//!    ([`SweepFactor`]: `w̃_j = W₀_j + Σ_{k<j} (W₀_k − Q_k)·F_kj`, the reference tools'
//!    `U = chol(H⁻¹)` update in one-Cholesky form);
//! 3. the block's errors update every later column at once (one matrix product).
//!
//! Rows are independent given the factor, so steps 1–2 run rows in parallel.

use super::kquants::{choose_scales, grid, is_kquant, pack_codes};
use super::{check_rows, quantize_tensor, BlockError};
use crate::gguf::types::FileType;
use crate::gguf::types::{GgmlType, QK_K};
use crate::numerics::linalg::SweepFactor;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef};
use rayon::prelude::*;

/// The GGUF types for which feedback is the default when a calibration set is given: those where it
/// measured a lower perplexity than llama-quantize + llama-imatrix (Q2_K by 0.6 %, Q3_K_M within
/// noise; Q4_K_M measured worse: docs/benchmarks.md, "GPTQ feedback on the K-quant grids").
pub const FEEDBACK_BY_DEFAULT: &[FileType] = &[FileType::Q3KM, FileType::Q2K];

/// Quantizes the `len / cols × cols` tensor `data` to `ty` with GPTQ error feedback through `f`, the
/// sweep factor of the Hessian of the tensor's input (`cols × cols`); `dead[c]` marks a column whose
/// input is always zero (its weights are zeroed first, as GPTQ does). Types other than the K-quants
/// are quantized without feedback ([`quantize_tensor`]).
pub fn quantize_tensor_feedback(
    ty: GgmlType,
    data: &[f32],
    cols: usize,
    importance: Option<&[f32]>,
    f: &SweepFactor,
    dead: &[bool],
) -> Result<Vec<u8>, BlockError> {
    if !is_kquant(ty) {
        return quantize_tensor(ty, data, cols, importance);
    }
    let row_bytes = check_rows(ty, data.len(), cols, importance)?;
    let coef = f.coef();
    if f.dim() != cols || coef.nrows() != cols || dead.len() != cols {
        return Err(BlockError::Hessian { dim: f.dim(), cols });
    }
    let rows = data.len() / cols;
    let bb = ty.block_bytes();
    let mut w0 = data.to_vec();
    for r in w0.chunks_exact_mut(cols) {
        for (v, _) in r.iter_mut().zip(dead).filter(|(_, d)| **d) {
            *v = 0.0;
        }
    }
    let mut w = w0.clone();
    let mut out = vec![0u8; rows * row_bytes];
    let mut delta = vec![0.0f32; rows * QK_K];
    let mut fblk = vec![0.0f32; QK_K * QK_K];
    for b in 0..cols / QK_K {
        let c0 = b * QK_K;
        for i in 0..QK_K {
            for j in i + 1..QK_K {
                fblk[i * QK_K + j] = coef[(c0 + i, c0 + j)];
            }
        }
        let fblk = &fblk;
        out.par_chunks_mut(row_bytes)
            .zip(w.par_chunks(cols))
            .zip(w0.par_chunks(cols))
            .zip(delta.par_chunks_mut(QK_K))
            .for_each(|(((o, wr), w0r), dr)| {
                let ob = &mut o[b * bb..(b + 1) * bb];
                let mut x = [0.0f32; QK_K];
                x.copy_from_slice(&wr[c0..c0 + QK_K]);
                sweep_block(
                    ty,
                    &mut x,
                    &w0r[c0..c0 + QK_K],
                    importance.map(|v| &v[c0..c0 + QK_K]),
                    fblk,
                    ob,
                    dr,
                );
            });
        let c1 = c0 + QK_K;
        if c1 < cols {
            // Dense copies: the factor is a reversed view, the weights row-major.
            let lhs = MatRef::from_row_major_slice(&delta, rows, QK_K).to_owned();
            let rhs = coef.submatrix(c0, c1, QK_K, cols - c1).to_owned();
            let mut prod = Mat::<f32>::zeros(rows, cols - c1);
            matmul(
                prod.as_mut(),
                Accum::Replace,
                lhs.as_ref(),
                rhs.as_ref(),
                1.0,
                faer::get_global_parallelism(),
            );
            w.par_chunks_mut(cols).enumerate().for_each(|(r, wr)| {
                for (j, v) in wr[c1..].iter_mut().enumerate() {
                    *v += prod[(r, j)];
                }
            });
        }
    }
    Ok(out)
}

/// The block's weights as GPTQ holds them when the block starts, from `x = w0 + u` (`u`: the earlier
/// blocks' feedback in the sweep-factor form, [`quantize_tensor_feedback`]).
///
/// The sweep-factor form gives each column its exact GPTQ value at the moment *it* is rounded, but
/// not the intermediate state of the block's later columns: with `H = R·Rᵀ` split at the block start
/// into done columns `A` and the rest `B`, GPTQ's state is `w0_B + (W₀ − Q)_A·R_AB·R_BB⁻¹` (the
/// optimal-brain-surgeon compensation of the rest for the done columns' error), while the sweep holds
/// `w0_B + (W₀ − Q)_A·R_AB·diag(R_BB)⁻¹`. They agree on the block's first column only. `R_BB⁻¹` is
/// upper triangular, so the block's own columns need only its diagonal block: the state is
/// `w0 + u·(I + F_blk)⁻¹` (`I + F_blk = R_blk·diag(R_blk)⁻¹`), one unit-triangular solve per row and
/// block, as cheap as the sweep itself. The scales are chosen from this state, as GPTQ with groups
/// chooses them from its updated weights.
fn block_state(x: &[f32; QK_K], w0: &[f32], fblk: &[f32]) -> [f32; QK_K] {
    // z·(I + F) = u, solved row by row of F (forward substitution, contiguous rows).
    let mut z = [0.0f32; QK_K];
    for ((z, x), w) in z.iter_mut().zip(x).zip(w0) {
        *z = x - w;
    }
    for i in 0..QK_K {
        let zi = z[i];
        if zi != 0.0 {
            let row = &fblk[i * QK_K..(i + 1) * QK_K];
            for j in i + 1..QK_K {
                z[j] -= zi * row[j];
            }
        }
    }
    let mut s = [0.0f32; QK_K];
    for ((s, z), w) in s.iter_mut().zip(z).zip(w0) {
        *s = w + z;
    }
    s
}

/// One row's super-block: scales from the block's GPTQ state ([`block_state`]), then the columns in
/// order, each rounded on the grid and its error `w0 − q` (written to `delta`) fed to the block's later
/// columns with the row-major strict upper `fblk`.
fn sweep_block(
    ty: GgmlType,
    x: &mut [f32; QK_K],
    w0: &[f32],
    importance: Option<&[f32]>,
    fblk: &[f32],
    out: &mut [u8],
    delta: &mut [f32],
) {
    let mut codes = [0u8; QK_K];
    let state = block_state(x, w0, fblk);
    choose_scales(ty, &state, importance, out, &mut codes);
    let g = grid(ty, out);
    for i in 0..QK_K {
        let q = if g.step[i] != 0.0 {
            let c = g.code(i, x[i]);
            codes[i] = c as u8;
            g.value(i, c)
        } else {
            g.off[i]
        };
        let d = w0[i] - q;
        delta[i] = d;
        if d != 0.0 {
            let row = &fblk[i * QK_K..(i + 1) * QK_K];
            for j in i + 1..QK_K {
                x[j] += d * row[j];
            }
        }
    }
    pack_codes(ty, &codes, out);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::gguf::blocks::dequantize_tensor;
    use crate::numerics::linalg::{CpuBackend, LinalgBackend};

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const KTYPES: [GgmlType; 5] = [
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];
    const DAMP: f64 = 0.05;
    /// A code the fast path rounds the other way from the reference must be this close to the
    /// midpoint, in grid steps (the f32 sweep's error is about 1e-4 steps here).
    const TIE: f64 = 1e-3;
    /// The relative error difference under which two scale choices are a tie of the scale search.
    const SCALE_TIE: f64 = 1e-3;
    /// At most this many ties (codes and scales) per type in the 6 × 768 reference test.
    const MAX_TIES: usize = 2;

    fn gauss(rng: &mut StdRng) -> f32 {
        crate::testkit::gauss(rng)
    }

    /// `rows × cols` weights and `tokens × cols` activations whose columns are correlated (each is a
    /// mix of its neighbour and a shared component) and of varied scale, as layer inputs are.
    fn problem(rows: usize, cols: usize, tokens: usize, seed: u64) -> (Vec<f32>, Mat<f32>) {
        let mut rng = StdRng::seed_from_u64(seed);
        let w: Vec<f32> = (0..rows * cols).map(|_| 0.05 * gauss(&mut rng)).collect();
        let scale: Vec<f32> = (0..cols).map(|_| 0.3 + 2.0 * rng.random::<f32>()).collect();
        let mut x = Mat::<f32>::zeros(tokens, cols);
        for t in 0..tokens {
            let common = gauss(&mut rng);
            let mut prev = gauss(&mut rng);
            for c in 0..cols {
                let g = gauss(&mut rng);
                prev = 0.7 * prev + 0.5 * g;
                x[(t, c)] = scale[c] * (prev + 0.6 * common);
            }
        }
        (w, x)
    }

    /// `XᵀX` in f64 and the factor of it damped by `DAMP·mean(diag)`.
    fn hessian(x: &Mat<f32>) -> (Vec<f64>, SweepFactor) {
        let n = x.ncols();
        let mut h = vec![0.0f64; n * n];
        for t in 0..x.nrows() {
            for i in 0..n {
                let xi = f64::from(x[(t, i)]);
                for j in 0..n {
                    h[i * n + j] += xi * f64::from(x[(t, j)]);
                }
            }
        }
        let mean = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
        let hf = Mat::<f32>::from_fn(n, n, |i, j| h[i * n + j] as f32);
        let diag: Vec<f32> = (0..n)
            .map(|i| (h[i * n + i] + DAMP * mean) as f32)
            .collect();
        let mut f = SweepFactor::new(n);
        assert!(CpuBackend::default().sweep_factor(hf.as_ref(), &diag, &mut f));
        (h, f)
    }

    /// `tr((W − Q)·H·(W − Q)ᵀ)`: the output error `‖(W − Q)Xᵀ‖²` over the calibration tokens.
    fn output_error(w: &[f32], q: &[f32], h: &[f64], cols: usize) -> f64 {
        w.chunks_exact(cols)
            .zip(q.chunks_exact(cols))
            .map(|(wr, qr)| {
                let e: Vec<f64> = wr.iter().zip(qr).map(|(a, b)| f64::from(a - b)).collect();
                (0..cols)
                    .map(|i| e[i] * (0..cols).map(|j| h[i * cols + j] * e[j]).sum::<f64>())
                    .sum::<f64>()
            })
            .sum()
    }

    /// The Hessian that `f` factors exactly, in f64: `(I + F)·(I + F)ᵀ`. GPTQ's result depends on the
    /// Hessian through `F` alone (the sweep values and every block's state are functions of `F`,
    /// `crate::numerics::linalg`), so the reference run on it sees the same problem as the fast path
    /// without the rounding of our f32 factorisation (tested on its own in `numerics::linalg`).
    fn factored_hessian(f: &SweepFactor) -> Vec<f64> {
        let n = f.dim();
        let coef = f.coef();
        let r = |i: usize, j: usize| match i.cmp(&j) {
            std::cmp::Ordering::Less => f64::from(coef[(i, j)]),
            std::cmp::Ordering::Equal => 1.0,
            std::cmp::Ordering::Greater => 0.0,
        };
        let mut h = vec![0.0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] = (i.max(j)..n).map(|k| r(i, k) * r(j, k)).sum();
            }
        }
        h
    }

    /// The straightforward O(n³) reference: the explicit inverse of the Hessian `h` in f64
    /// (Gauss–Jordan), the optimal-brain-surgeon update column by column (`w_k −= e·H⁻¹_jk / H⁻¹_jj`,
    /// then column j eliminated from H⁻¹), each super-block's scales chosen from the weights so
    /// updated as it starts (GPTQ with groups). Returns the tensor's bytes and how many codes it took
    /// from `follow`.
    ///
    /// `follow` is the fast path's tensor. The fast path sweeps in f32, the reference in f64, so a
    /// decision at a tie may go the other way; the reference then checks that it is a tie and
    /// continues with the fast path's choice (one tie does not make the rest of the row differ), and
    /// counts it; any other difference panics, naming the value or block:
    /// - a code: the reference's `x` lies within `TIE` grid steps of the midpoint between the two
    ///   levels;
    /// - a super-block's scales: the importance-weighted error of rounding the reference's state onto
    ///   the fast path's grid is within `SCALE_TIE` of the error onto its own (the scale searches
    ///   compare candidates by such an error).
    fn reference(
        ty: GgmlType,
        w: &[f32],
        cols: usize,
        h: &[f64],
        imp: &[f32],
        follow: &[u8],
    ) -> (Vec<u8>, usize) {
        let mut ties = 0;
        let follow_values = dequantize_tensor(ty, follow, cols).unwrap();
        let n = cols;
        // [H | I] → [I | H⁻¹].
        let mut a = vec![0.0f64; n * 2 * n];
        for i in 0..n {
            a[i * 2 * n..i * 2 * n + n].copy_from_slice(&h[i * n..(i + 1) * n]);
            a[i * 2 * n + n + i] = 1.0;
        }
        for p in 0..n {
            let piv = a[p * 2 * n + p];
            for j in 0..2 * n {
                a[p * 2 * n + j] /= piv;
            }
            for i in 0..n {
                if i != p {
                    let f = a[i * 2 * n + p];
                    if f != 0.0 {
                        for j in 0..2 * n {
                            a[i * 2 * n + j] -= f * a[p * 2 * n + j];
                        }
                    }
                }
            }
        }
        let rows = w.len() / cols;
        let (bb, nb) = (ty.block_bytes(), cols / QK_K);
        let mut out = vec![0u8; rows * nb * bb];
        let mut hinv: Vec<f64> = (0..n * n).map(|k| a[(k / n) * 2 * n + n + k % n]).collect();
        let mut ws: Vec<Vec<f64>> = w
            .chunks_exact(cols)
            .map(|r| r.iter().map(|&v| f64::from(v)).collect())
            .collect();
        let mut grids: Vec<Option<super::super::kquants::KGrid>> =
            (0..rows).map(|_| None).collect();
        let mut codes = vec![[0u8; QK_K]; rows];
        for j in 0..n {
            let (blk, i) = (j / QK_K, j % QK_K);
            if i == 0 {
                for r in 0..rows {
                    let x: Vec<f32> = ws[r][j..j + QK_K].iter().map(|&v| v as f32).collect();
                    let at = (r * nb + blk) * bb;
                    let block = &mut out[at..at + bb];
                    let imp = &imp[j..j + QK_K];
                    choose_scales(ty, &x, Some(imp), block, &mut codes[r]);
                    let mine = grid(ty, block);
                    let theirs = grid(ty, &follow[at..at + bb]);
                    if mine.step != theirs.step || mine.off != theirs.off {
                        // The scale search chose other scales: a tie of its objective, if the
                        // importance-weighted error of rounding this state onto their grid is
                        // within `SCALE_TIE` of the error onto ours.
                        let err = |g: &super::super::kquants::KGrid| -> f64 {
                            (0..QK_K)
                                .map(|i| {
                                    let q = if g.step[i] != 0.0 {
                                        g.value(i, g.code(i, x[i]))
                                    } else {
                                        g.off[i]
                                    };
                                    f64::from(imp[i]) * f64::from(x[i] - q).powi(2)
                                })
                                .sum()
                        };
                        let (e_mine, e_theirs) = (err(&mine), err(&theirs));
                        assert!(
                            e_theirs <= (1.0 + SCALE_TIE) * e_mine,
                            "{} row {r} super-block {blk}: other scales, error {e_theirs} against \
                             the reference's {e_mine} (not a tie)",
                            ty.name()
                        );
                        ties += 1;
                        block.copy_from_slice(&follow[at..at + bb]);
                        grids[r] = Some(theirs);
                    } else {
                        grids[r] = Some(mine);
                    }
                }
            }
            let d = hinv[j * n + j];
            for r in 0..rows {
                let g = grids[r].as_ref().unwrap();
                let v = ws[r][j] as f32;
                let q = if g.step[i] != 0.0 {
                    let mut c = g.code(i, v);
                    let theirs = g.code(i, follow_values[r * cols + j]);
                    if theirs != c {
                        let x = ws[r][j];
                        let dist = |c: i32| (x - f64::from(g.value(i, c))).abs();
                        let excess = (dist(theirs) - dist(c)) / f64::from(g.step[i]).abs();
                        assert!(
                            excess <= TIE,
                            "{} row {r} col {j}: code {theirs} where the reference rounds {x} to {c} \
                             ({excess} steps further, not a tie)",
                            ty.name()
                        );
                        ties += 1;
                        c = theirs;
                    }
                    codes[r][i] = c as u8;
                    g.value(i, c)
                } else {
                    g.off[i]
                };
                let e = (ws[r][j] - f64::from(q)) / d;
                for k in j + 1..n {
                    ws[r][k] -= e * hinv[j * n + k];
                }
                if i == QK_K - 1 {
                    let at = (r * nb + blk) * bb;
                    pack_codes(ty, &codes[r], &mut out[at..at + bb]);
                }
            }
            // Eliminate column j: H⁻¹ ← H⁻¹ − H⁻¹[:, j]·H⁻¹[j, :] / H⁻¹[j, j].
            let rowj: Vec<f64> = hinv[j * n..(j + 1) * n].to_vec();
            for i in j + 1..n {
                let f = hinv[i * n + j] / d;
                for k in j + 1..n {
                    hinv[i * n + k] -= f * rowj[k];
                }
            }
        }
        (out, ties)
    }

    /// Against the naive reference, on rows of three super-blocks: every super-block of every row is
    /// byte for byte the reference's (scales, mins and codes), up to at most `MAX_TIES` codes per type
    /// that round the other way at a rounding tie (f32 against f64, [`reference`]); and the output
    /// error is well below rounding each value on its own with the same importance.
    #[test]
    fn feedback_equals_the_naive_reference_and_lowers_the_output_error() {
        let (rows, cols) = (6, 3 * QK_K);
        let (w, x) = problem(rows, cols, 1024, 7);
        let (h, f) = hessian(&x);
        let imp: Vec<f32> = (0..cols)
            .map(|i| (h[i * cols + i] / 1024.0) as f32)
            .collect();
        let dead = vec![false; cols];
        let hf = factored_hessian(&f);
        for ty in KTYPES {
            let bytes = quantize_tensor_feedback(ty, &w, cols, Some(&imp), &f, &dead).unwrap();
            let (want, ties) = reference(ty, &w, cols, &hf, &imp, &bytes);
            assert!(ties <= MAX_TIES, "{}: {ties} ties", ty.name());
            assert_eq!(bytes.len(), want.len(), "{}", ty.name());
            let bb = ty.block_bytes();
            for (k, (g, r)) in bytes.chunks(bb).zip(want.chunks(bb)).enumerate() {
                assert_eq!(
                    g,
                    r,
                    "{} row {} super-block {}",
                    ty.name(),
                    k / (cols / QK_K),
                    k % (cols / QK_K)
                );
            }
            let got = dequantize_tensor(ty, &bytes, cols).unwrap();
            let e_got = output_error(&w, &got, &h, cols);
            let plain = dequantize_tensor(
                ty,
                &quantize_tensor(ty, &w, cols, Some(&imp)).unwrap(),
                cols,
            )
            .unwrap();
            let e_plain = output_error(&w, &plain, &h, cols);
            assert!(
                e_got < 0.6 * e_plain,
                "{}: feedback {e_got} vs independent rounding {e_plain}",
                ty.name()
            );
        }
    }

    /// With uncorrelated inputs (a diagonal Hessian) there is nothing to feed back: the bytes are
    /// exactly the independent quantizer's, which also pins the shared scale path.
    #[test]
    fn a_diagonal_hessian_gives_the_independent_quantizers_bytes() {
        let (rows, cols) = (5, 2 * QK_K);
        let mut rng = StdRng::seed_from_u64(3);
        let w: Vec<f32> = (0..rows * cols).map(|_| 0.05 * gauss(&mut rng)).collect();
        let d: Vec<f32> = (0..cols).map(|_| 0.1 + rng.random::<f32>()).collect();
        let h = Mat::<f32>::from_fn(cols, cols, |i, j| if i == j { d[i] } else { 0.0 });
        let mut f = SweepFactor::new(cols);
        assert!(CpuBackend::default().sweep_factor(h.as_ref(), &d, &mut f));
        for ty in KTYPES {
            let fb =
                quantize_tensor_feedback(ty, &w, cols, Some(&d), &f, &vec![false; cols]).unwrap();
            assert_eq!(
                fb,
                quantize_tensor(ty, &w, cols, Some(&d)).unwrap(),
                "{}",
                ty.name()
            );
        }
    }

    #[test]
    fn dead_columns_are_zeroed_and_a_factor_of_the_wrong_size_is_an_error() {
        let (rows, cols) = (3, QK_K);
        let (w, x) = problem(rows, cols, 256, 11);
        let (_, f) = hessian(&x);
        let mut dead = vec![false; cols];
        dead[5] = true;
        let b = quantize_tensor_feedback(GgmlType::Q6K, &w, cols, None, &f, &dead).unwrap();
        let q = dequantize_tensor(GgmlType::Q6K, &b, cols).unwrap();
        assert!((0..rows).all(|r| q[r * cols + 5] == 0.0));
        let (_, f2) = hessian(&problem(1, 2 * QK_K, 64, 1).1);
        assert_eq!(
            quantize_tensor_feedback(GgmlType::Q4K, &w, cols, None, &f2, &dead),
            Err(BlockError::Hessian {
                dim: 2 * QK_K,
                cols
            })
        );
        // Non-K-quant types fall back to the independent quantizer.
        assert_eq!(
            quantize_tensor_feedback(GgmlType::Q8_0, &w, cols, None, &f, &dead).unwrap(),
            quantize_tensor(GgmlType::Q8_0, &w, cols, None).unwrap()
        );
    }
}
