//! The vendor math libraries' self-test: each one a [`Vendor`] offers is run once on a 2 × 2 problem with a
//! known, exactly representable answer before a session relies on it. A library that does not work on the
//! card (no kernels for its architecture, a broken install) is found at open, not in the middle of an
//! accumulation, which cannot be replayed after a failed call.

use super::launch::{DevPtr, Gemm, Syrk, Vendor};
use crate::error::device::DeviceError;

/// The outcome per library: `Ok` when it is absent or answered right, else what went wrong.
#[derive(Debug)]
pub struct MathSelfTest {
    pub blas: Result<(), SelfTestError>,
    pub solver: Result<(), SelfTestError>,
}

/// Why a vendor library failed its self-test.
#[derive(Debug, thiserror::Error)]
pub enum SelfTestError {
    /// A device call of the test failed; the text is the device's message (the device and the
    /// operation are the test's own).
    #[error("{}", .0.message)]
    Device(DeviceError),
    /// `ssyrk` and `sgemm` gave `syrk` and `gemm` (column-major 2 × 2).
    #[error("ssyrk gave {syrk:?} (want 10, 14, ·, 20), sgemm {gemm:?} (want 19, 43, 22, 50)")]
    Blas { syrk: Vec<f32>, gemm: Vec<f32> },
    /// `spotrf` gave the factor `l` with `info`, and `indefinite_info` for an indefinite matrix.
    #[error(
        "spotrf gave L {l:?} with info {info} (want 2, 1, ·, 2 and 0), and info {indefinite_info} for an indefinite matrix (want 2)"
    )]
    Solver {
        l: Vec<f32>,
        info: i32,
        indefinite_info: i32,
    },
}

/// Tests the libraries `v.math()` names: `ssyrk` and `sgemm` (BLAS), `spotrf` on a positive definite and an
/// indefinite matrix (solver: the factor and LAPACK's `info`).
pub fn math_self_test<V: Vendor>(v: &mut V) -> MathSelfTest {
    let has = v.math();
    MathSelfTest {
        blas: if has.blas { test_blas(v) } else { Ok(()) },
        solver: if has.solver { test_solver(v) } else { Ok(()) },
    }
}

/// Uploads `data` (one buffer each), runs `f` on them, frees them either way.
fn with_buffers<V: Vendor, T>(
    v: &mut V,
    data: &[&[f32]],
    f: impl FnOnce(&mut V, &[DevPtr]) -> Result<T, SelfTestError>,
) -> Result<T, SelfTestError> {
    let mut bufs = Vec::new();
    let run = |v: &mut V| -> Result<T, SelfTestError> {
        for d in data {
            let p = v.alloc(d.len() * 4).map_err(SelfTestError::Device)?;
            bufs.push(p);
            v.upload(p, bytemuck::cast_slice(d))
                .map_err(SelfTestError::Device)?;
        }
        f(v, &bufs)
    };
    let r = run(v);
    for p in bufs {
        v.free(p);
    }
    r
}

fn read<V: Vendor>(v: &mut V, p: DevPtr, len: usize) -> Result<Vec<f32>, SelfTestError> {
    let mut out = vec![0f32; len];
    v.download(p, bytemuck::cast_slice_mut(&mut out))
        .map_err(SelfTestError::Device)?;
    Ok(out)
}

/// `C += AᵀA` (lower) and `C += A·B` with A = [[1, 2], [3, 4]], B = [[5, 6], [7, 8]] (column-major).
fn test_blas<V: Vendor>(v: &mut V) -> Result<(), SelfTestError> {
    let (a, b) = ([1.0f32, 3.0, 2.0, 4.0], [5.0f32, 7.0, 6.0, 8.0]);
    with_buffers(v, &[&a, &b, &[0.0; 4], &[0.0; 4]], |v, p| {
        let syrk = Syrk {
            c: p[2],
            ldc: 2,
            a: p[0],
            lda: 2,
            n: 2,
            k: 2,
            alpha: 1.0,
        };
        v.syrk_lower(&syrk).map_err(SelfTestError::Device)?;
        let gemm = Gemm {
            m: 2,
            n: 2,
            k: 2,
            a: p[0],
            lda: 2,
            b: p[1],
            ldb: 2,
            c: p[3],
            ldc: 2,
        };
        v.gemm_acc(&gemm).map_err(SelfTestError::Device)?;
        let (c, d) = (read(v, p[2], 4)?, read(v, p[3], 4)?);
        // AᵀA = [[10, 14], [14, 20]] (its lower triangle: 10, 14, ·, 20); A·B = [[19, 22], [43, 50]].
        if [c[0], c[1], c[3]] == [10.0, 14.0, 20.0] && d == [19.0, 43.0, 22.0, 50.0] {
            Ok(())
        } else {
            Err(SelfTestError::Blas { syrk: c, gemm: d })
        }
    })
}

/// `spotrf` of [[4, 2], [2, 5]] → L = [[2, 0], [1, 2]] with info 0; of [[1, 2], [2, 1]] → info 2.
fn test_solver<V: Vendor>(v: &mut V) -> Result<(), SelfTestError> {
    let (good, bad) = ([4.0f32, 2.0, 2.0, 5.0], [1.0f32, 2.0, 2.0, 1.0]);
    with_buffers(v, &[&good, &bad, &[0.0; 2]], |v, p| {
        let info = p[2];
        v.potrf_lower(p[0], 2, 2, info)
            .map_err(SelfTestError::Device)?;
        let l = read(v, p[0], 4)?;
        let i0 = read(v, info, 1)?[0].to_bits() as i32;
        v.potrf_lower(p[1], 2, 2, info + 4)
            .map_err(SelfTestError::Device)?;
        let i1 = read(v, info + 4, 1)?[0].to_bits() as i32;
        if [l[0], l[1], l[3]] == [2.0, 1.0, 2.0] && i0 == 0 && i1 == 2 {
            Ok(())
        } else {
            Err(SelfTestError::Solver {
                l,
                info: i0,
                indefinite_info: i1,
            })
        }
    })
}
