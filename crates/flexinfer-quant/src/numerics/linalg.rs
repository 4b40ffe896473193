//! The three dense linear-algebra steps of GPTQ behind a small device interface, so that GPU backends
//! (HIP/CUDA) can replace the CPU one without touching the solver.
//!
//! ## The sweep factor
//! The reference tools compute `U = chol_upper(H⁻¹)` and propagate each column's scaled error
//! `e_i = (w_i − q_i)/U_ii` to later columns with row `i` of `U`. Writing `E` for those errors and `W` for the
//! weights before the sweep, the recurrence says `W − Q = E·U`, so `E = (W − Q)·R` with `R = U⁻¹`, and the value
//! column `j` holds when it is quantized is
//!
//! ```text
//! w̃_j = W_j + Σ_{k<j} (W_k − Q_k) · R_kj / R_jj
//! ```
//!
//! `R` is upper triangular with `H = R·Rᵀ`: the Cholesky factor of `H` with rows and columns reversed. The sweep
//! therefore needs one Cholesky factorisation and no triangular inverse (half the factor flops of the explicit
//! inverse), and is the same algorithm up to float rounding.
//!
//! A [`SweepFactor`] holds the coefficients `F[i][j] = R_ij / R_jj` (i < j) and the diagonal `R_ii`. With
//! `L = chol_lower(J·H·J)` (J reverses rows and columns), `R = J·L·J`, so `F = J·M·J` where `M` is `L` with each
//! column divided by its diagonal entry: the factor is `L`, scaled in place, seen through a reversed view.

use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::cholesky::llt::factor::{cholesky_in_place, cholesky_in_place_scratch};
use faer::linalg::matmul::matmul;
use faer::linalg::matmul::triangular::{self, BlockStructure};
use faer::linalg::triangular_inverse::invert_upper_triangular;
use faer::{Accum, Mat, MatMut, MatRef, Par, Side};
use rayon::prelude::*;

/// `len` zeros, written by all threads (the first touch of a large buffer costs a page fault per page).
pub fn par_zeros(len: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(len);
    v.par_extend(rayon::iter::repeat_n(0.0f32, len));
    v
}

/// A `rows × cols` column-major buffer whose column `j` is written by `fill(j, column)`, all columns in
/// parallel: each page of a large new buffer is first touched by the thread that fills it, and the memory is
/// written once (no zeroing pass over the whole buffer first).
pub fn par_columns(rows: usize, cols: usize, fill: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    let len = rows * cols;
    let mut v: Vec<f32> = Vec::with_capacity(len);
    if rows > 0 {
        v.spare_capacity_mut()[..len]
            .par_chunks_mut(rows)
            .enumerate()
            .for_each(|(j, col)| {
                // Zeroing one column while it is in cache is cheap; after it the column is initialised.
                for x in col.iter_mut() {
                    x.write(0.0);
                }
                // SAFETY: every element of `col` was initialised just above, and `MaybeUninit<f32>` has the
                // layout of `f32`.
                let col = unsafe { &mut *(col as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) };
                fill(j, col);
            });
    }
    // SAFETY: with `rows > 0` the loop above initialised all `len` elements (every chunk of the first `len`
    // slots); with `rows == 0`, `len` is 0.
    unsafe { v.set_len(len) };
    v
}

/// The sweep coefficients of one Hessian (module docs): `coef()[(i, j)]` for `i < j`, and `r_diag()[i]`.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepFactor {
    n: usize,
    /// Column-major n × n; its strict lower triangle is `M` (module docs); the rest is scratch.
    m: Vec<f32>,
    r: Vec<f32>,
}

impl SweepFactor {
    /// A factor buffer for an n × n Hessian (its storage is allocated by the first factorisation).
    pub fn new(n: usize) -> Self {
        SweepFactor {
            n,
            m: Vec::new(),
            r: vec![0.0; n],
        }
    }
    pub fn dim(&self) -> usize {
        self.n
    }
    /// `F` as an n × n view (a reversed view of `M`); only entries above the diagonal are meaningful.
    pub fn coef(&self) -> MatRef<'_, f32> {
        if self.m.len() != self.n * self.n {
            // Not factored yet: a zero-sized view keeps every index check honest.
            return MatRef::from_column_major_slice(&[], 0, 0);
        }
        MatRef::from_column_major_slice(&self.m, self.n, self.n).reverse_rows_and_cols()
    }
    /// `R_ii`: the reciprocal of the reference tools' `U_ii`.
    pub fn r_diag(&self) -> &[f32] {
        &self.r
    }
    /// The upper-triangular `R` with `H = R·Rᵀ` (tests and diagnostics).
    pub fn r_matrix(&self) -> Mat<f32> {
        let f = self.coef();
        Mat::from_fn(self.n, self.n, |i, j| match i.cmp(&j) {
            std::cmp::Ordering::Less if f.nrows() == self.n => f[(i, j)] * self.r[j],
            std::cmp::Ordering::Less => 0.0,
            std::cmp::Ordering::Equal => self.r[i],
            std::cmp::Ordering::Greater => 0.0,
        })
    }
    fn m_mut(&mut self) -> MatMut<'_, f32> {
        if self.m.len() != self.n * self.n {
            self.m = par_zeros(self.n * self.n);
        }
        MatMut::from_column_major_slice_mut(&mut self.m, self.n, self.n)
    }
}

/// Hessian accumulation, the sweep factor (Cholesky), and the lazy-batch block update.
pub trait LinalgBackend: Send + Sync {
    /// `h += alpha · xᵀx` for activations `x` of shape `[tokens, in]`, on the lower triangle only (half the
    /// flops); call [`LinalgBackend::finish_hessian`] once after the last batch.
    fn accumulate_hessian(&self, h: MatMut<'_, f32>, x: MatRef<'_, f32>, alpha: f32);
    /// Mirrors the accumulated lower triangle into the upper one.
    fn finish_hessian(&self, mut h: MatMut<'_, f32>) {
        let n = h.nrows();
        for j in 0..n {
            for i in j + 1..n {
                h[(j, i)] = h[(i, j)];
            }
        }
    }
    /// Writes the sweep factor (module docs) of the symmetric matrix whose strict upper triangle is `h`'s and
    /// whose diagonal is `diag` into `out` (of the same dimension; its previous content is ignored). `h` is not
    /// modified, so a caller can retry with another diagonal. Returns `false` when the matrix is not
    /// numerically positive definite or the factor is not finite; `out` is then unspecified.
    fn sweep_factor(&self, h: MatRef<'_, f32>, diag: &[f32], out: &mut SweepFactor) -> bool;
    /// `w_tail += delta · coef` (rows × B times B × tail).
    fn block_update(&self, w_tail: MatMut<'_, f32>, delta: MatRef<'_, f32>, coef: MatRef<'_, f32>);
    /// `w += delta · coef` where only the strict upper triangle of the square `coef` is read (it is zero
    /// elsewhere); backends may skip the zero half.
    fn block_update_strict_upper(
        &self,
        w: MatMut<'_, f32>,
        delta: MatRef<'_, f32>,
        coef: MatRef<'_, f32>,
    ) {
        let m = coef.nrows();
        let strict = Mat::<f32>::from_fn(m, m, |i, j| if i < j { coef[(i, j)] } else { 0.0 });
        self.block_update(w, delta, strict.as_ref());
    }
    fn name(&self) -> &'static str;
}

/// How the CPU backend computes the sweep factor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FactorRoute {
    /// The reference tools' chain `U = chol_upper(chol_inverse(chol_lower(H)))`, then `R = U⁻¹`: about 2n³
    /// flops and three n × n temporaries. Kept as the oracle for tests.
    Reference,
    /// One in-place Cholesky of the reversed matrix: n³/3 flops, one n × n buffer (the output).
    Reversed,
}

/// faer on the CPU, using faer's global parallelism (rayon).
#[derive(Clone, Debug)]
pub struct CpuBackend {
    pub route: FactorRoute,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend {
            route: FactorRoute::Reversed,
        }
    }
}

fn par() -> Par {
    faer::get_global_parallelism()
}

/// Column `j` of a column-major matrix as a slice (faer matrices owned by this crate have unit row stride);
/// empty for a view without unit row stride.
pub(crate) fn col(m: MatRef<'_, f32>, j: usize) -> &[f32] {
    m.col(j)
        .try_as_col_major()
        .map(|c| c.as_slice())
        .unwrap_or(&[])
}

/// Divides each column of the lower-triangular `l` below the diagonal by its diagonal entry, collecting the
/// diagonal (reversed: `r[i] = l[n-1-i][n-1-i]`). `false` when an entry is not finite or a pivot not positive.
fn scale_columns(l: MatMut<'_, f32>, r: &mut [f32]) -> bool {
    let n = l.nrows();
    let diag: Vec<Option<f32>> = l
        .par_col_iter_mut()
        .enumerate()
        .map(|(j, c)| {
            let c = c.try_as_col_major_mut()?.as_slice_mut();
            let d = c[j];
            if !(d > 0.0 && d.is_finite()) {
                return None;
            }
            let inv = 1.0 / d;
            let mut ok = true;
            for v in &mut c[j + 1..] {
                *v *= inv;
                ok &= v.is_finite();
            }
            ok.then_some(d)
        })
        .collect();
    for (j, d) in diag.into_iter().enumerate() {
        match d {
            Some(d) => r[n - 1 - j] = d,
            None => return false,
        }
    }
    true
}

impl CpuBackend {
    fn reference_factor(h: MatRef<'_, f32>, diag: &[f32], out: &mut SweepFactor) -> bool {
        let n = h.nrows();
        let full = Mat::from_fn(n, n, |i, j| match i.cmp(&j) {
            std::cmp::Ordering::Equal => diag[i],
            std::cmp::Ordering::Less => h[(i, j)],
            std::cmp::Ordering::Greater => h[(j, i)],
        });
        let Ok(llt) = full.llt(Side::Lower) else {
            return false;
        };
        let hinv = faer::linalg::solvers::DenseSolveCore::inverse(&llt);
        let Ok(l2) = hinv.llt(Side::Lower) else {
            return false;
        };
        let u = l2.L().transpose().to_owned();
        let mut r = Mat::<f32>::zeros(n, n);
        invert_upper_triangular(r.as_mut(), u.as_ref(), par());
        // L = J·R·J (lower), then the same column scaling as the fast route.
        let mut m = out.m_mut();
        for j in 0..n {
            for i in j..n {
                m[(i, j)] = r[(n - 1 - i, n - 1 - j)];
            }
        }
        let mut rd = std::mem::take(&mut out.r);
        let ok = scale_columns(out.m_mut(), &mut rd);
        out.r = rd;
        ok
    }

    fn reversed_factor(h: MatRef<'_, f32>, diag: &[f32], out: &mut SweepFactor) -> bool {
        let n = h.nrows();
        if n > 0 && h.row_stride() != 1 {
            return Self::reversed_factor(h.to_owned().as_ref(), diag, out);
        }
        // Lower triangle of J·H·J: out[i][j] = H[n-1-i][n-1-j], read from H's strict upper triangle. Column j
        // of the strict lower is column n-1-j of H's strict upper, reversed.
        let fill = |j: usize, dst: &mut [f32]| {
            let c = n - 1 - j;
            dst[j] = diag[c];
            for (d, s) in dst[j + 1..].iter_mut().zip(col(h, c)[..c].iter().rev()) {
                *d = *s;
            }
        };
        if out.m.len() == n * n {
            // A retry: refill the buffer of the failed attempt.
            out.m
                .par_chunks_mut(n.max(1))
                .enumerate()
                .for_each(|(j, dst)| fill(j, dst));
        } else {
            out.m = par_columns(n, n, fill);
        }
        let p = par();
        let mut mem = MemBuffer::new(cholesky_in_place_scratch::<f32>(n, p, Default::default()));
        if cholesky_in_place(
            out.m_mut(),
            Default::default(),
            p,
            MemStack::new(&mut mem),
            Default::default(),
        )
        .is_err()
        {
            return false;
        }
        let mut rd = std::mem::take(&mut out.r);
        let ok = scale_columns(out.m_mut(), &mut rd);
        out.r = rd;
        ok
    }
}

impl LinalgBackend for CpuBackend {
    fn accumulate_hessian(&self, h: MatMut<'_, f32>, x: MatRef<'_, f32>, alpha: f32) {
        triangular::matmul(
            h,
            BlockStructure::TriangularLower,
            Accum::Add,
            x.transpose(),
            BlockStructure::Rectangular,
            x,
            BlockStructure::Rectangular,
            alpha,
            par(),
        );
    }

    fn sweep_factor(&self, h: MatRef<'_, f32>, diag: &[f32], out: &mut SweepFactor) -> bool {
        let n = h.nrows();
        if h.ncols() != n || diag.len() != n || out.dim() != n {
            return false;
        }
        match self.route {
            FactorRoute::Reference => Self::reference_factor(h, diag, out),
            FactorRoute::Reversed => Self::reversed_factor(h, diag, out),
        }
    }

    fn block_update(&self, w_tail: MatMut<'_, f32>, delta: MatRef<'_, f32>, coef: MatRef<'_, f32>) {
        matmul(w_tail, Accum::Add, delta, coef, 1.0, par());
    }

    fn block_update_strict_upper(
        &self,
        w: MatMut<'_, f32>,
        delta: MatRef<'_, f32>,
        coef: MatRef<'_, f32>,
    ) {
        triangular::matmul(
            w,
            BlockStructure::Rectangular,
            Accum::Add,
            delta,
            BlockStructure::Rectangular,
            coef,
            BlockStructure::StrictTriangularUpper,
            1.0,
            par(),
        );
    }

    fn name(&self) -> &'static str {
        "cpu-faer"
    }
}
