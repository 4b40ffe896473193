//! The three dense linear-algebra steps of GPTQ behind a small device interface, so that GPU backends
//! (HIP/CUDA) can replace the CPU one without touching the solver.

use faer::linalg::matmul::matmul;
use faer::linalg::matmul::triangular::{self, BlockStructure};
use faer::linalg::triangular_inverse::invert_lower_triangular;
use faer::{Accum, Mat, MatMut, MatRef, Par, Side};

/// Hessian accumulation, inverse-Hessian upper Cholesky factor, and the lazy-batch block update.
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
    /// Upper-triangular `U` with `H⁻¹ = UᵀU`, or `None` when `H` is not numerically positive definite.
    fn inverse_cholesky_factor(&self, h: MatRef<'_, f32>) -> Option<Mat<f32>>;
    /// `w_tail -= err · u_rows` (rows × B times B × tail).
    fn block_update(&self, w_tail: MatMut<'_, f32>, err: MatRef<'_, f32>, u_rows: MatRef<'_, f32>);
    fn name(&self) -> &'static str;
}

/// How the CPU backend computes `U`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FactorRoute {
    /// The reference chain `chol_upper(chol_inverse(chol_lower(H)))`, about 4n³/3 flops.
    Reference,
    /// `U = R⁻¹` with `R = J·chol_lower(J H J)·J` (J = reversal), about 2n³/3 flops; same U up to rounding.
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

fn all_finite(m: MatRef<'_, f32>) -> bool {
    (0..m.ncols()).all(|j| (0..m.nrows()).all(|i| m[(i, j)].is_finite()))
}

impl LinalgBackend for CpuBackend {
    fn accumulate_hessian(&self, mut h: MatMut<'_, f32>, x: MatRef<'_, f32>, alpha: f32) {
        triangular::matmul(
            h.as_mut(),
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

    fn inverse_cholesky_factor(&self, h: MatRef<'_, f32>) -> Option<Mat<f32>> {
        let n = h.nrows();
        let u = match self.route {
            FactorRoute::Reference => {
                let llt = h.llt(Side::Lower).ok()?;
                let hinv = faer::linalg::solvers::DenseSolveCore::inverse(&llt);
                let l2 = hinv.llt(Side::Lower).ok()?;
                l2.L().transpose().to_owned()
            }
            FactorRoute::Reversed => {
                let llt = h.reverse_rows_and_cols().llt(Side::Lower).ok()?;
                let mut linv = Mat::<f32>::zeros(n, n);
                invert_lower_triangular(linv.as_mut(), llt.L(), par());
                let mut u = linv.reverse_rows_and_cols().to_owned();
                // Keep only the upper triangle (the inverse routine leaves the other half untouched at zero).
                for j in 0..n {
                    for i in j + 1..n {
                        u[(i, j)] = 0.0;
                    }
                }
                u
            }
        };
        let diag_ok = (0..n).all(|i| u[(i, i)] > 0.0 && u[(i, i)].is_finite());
        if diag_ok && all_finite(u.as_ref()) {
            Some(u)
        } else {
            None
        }
    }

    fn block_update(&self, w_tail: MatMut<'_, f32>, err: MatRef<'_, f32>, u_rows: MatRef<'_, f32>) {
        matmul(w_tail, Accum::Add, err, u_rows, -1.0, par());
    }

    fn name(&self) -> &'static str {
        "cpu-faer"
    }
}
