//! How an edit changes a tensor: the orthogonalization of a residual writer (optionally through its output
//! norm) or of a reader against the refusal direction, in f64 accumulation, written back in the source dtype.

use flexinfer_quant::tensors::TensorStore;

use super::dtype::tensor_dtype;
use super::edit::{Edit, EditKind};
use crate::common::{AbliterateError, WorkerError};

/// `W ← W − r (rᵀ W)` for row-major `[rows, cols]` with `rows == r.len()` (a bias has `cols == 1`).
pub fn orthogonalize_write(w: &mut [f32], cols: usize, r: &[f32]) {
    let rows = r.len();
    let mut proj = vec![0f64; cols];
    for (i, &ri) in r.iter().enumerate() {
        let row = &w[i * cols..(i + 1) * cols];
        for (p, &v) in proj.iter_mut().zip(row) {
            *p += ri as f64 * v as f64;
        }
    }
    for i in 0..rows {
        let ri = r[i] as f64;
        for (v, p) in w[i * cols..(i + 1) * cols].iter_mut().zip(&proj) {
            *v = (*v as f64 - ri * p) as f32;
        }
    }
}

/// The direction a writer's output `x` must be orthogonal to so that what it adds to the residual has no
/// component along the unit direction `r`.
///
/// Without an output norm the residual receives `x` itself: that direction is `r`. With one (Gemma) it receives
/// `g ⊙ x / rms(x)` for the per-channel scale `g`, whose component along `r` is `(g ⊙ r)ᵀ x / rms(x)`: the
/// direction is the unit vector of `g ⊙ r`. `None` when `g ⊙ r` is zero (the writer cannot reach `r` at all).
pub fn writer_direction(r: &[f32], g: Option<&[f32]>) -> Option<Vec<f32>> {
    let Some(g) = g else {
        return Some(r.to_vec());
    };
    let v: Vec<f64> = r
        .iter()
        .zip(g)
        .map(|(&a, &b)| a as f64 * b as f64)
        .collect();
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    (n.is_finite() && n > 0.0).then(|| v.iter().map(|x| (x / n) as f32).collect())
}

/// Orthogonalizes a residual writer (row-major `[rows, cols]`, `rows == r.len()`; a bias has `cols == 1`) so
/// that its contribution to the residual stream, after the optional per-channel output scale `g`, has no
/// component along `r`: `W ← W − v (vᵀ W)` with `v` = [`writer_direction`]`(r, g)`. With `g` absent this is
/// exactly [`orthogonalize_write`] with `r`.
pub fn orthogonalize_writer(w: &mut [f32], cols: usize, r: &[f32], g: Option<&[f32]>) {
    match g {
        None => orthogonalize_write(w, cols, r),
        Some(_) => {
            if let Some(v) = writer_direction(r, g) {
                orthogonalize_write(w, cols, &v)
            }
        }
    }
}

/// `W ← W − (W r) rᵀ` for row-major `[rows, cols]` with `cols == r.len()`.
pub fn orthogonalize_read(w: &mut [f32], r: &[f32]) {
    let cols = r.len();
    for row in w.chunks_exact_mut(cols) {
        let d: f64 = row.iter().zip(r).map(|(&a, &b)| a as f64 * b as f64).sum();
        for (v, &rj) in row.iter_mut().zip(r) {
            *v = (*v as f64 - d * rj as f64) as f32;
        }
    }
}

/// The edited tensor: its bytes in the source dtype, and those bytes decoded back to f32 (what a
/// consumer of the written model computes with).
pub fn edited_tensor(
    store: &TensorStore,
    edit: &Edit,
    r: &[f32],
) -> Result<(Vec<u8>, Vec<f32>), WorkerError> {
    let dtype = tensor_dtype(store, &edit.tensor)?;
    let e = store.entry(&edit.tensor).map_err(super::quant_err)?;
    let shape = e.shape.clone();
    let mut w = store.f32(&edit.tensor).map_err(super::quant_err)?;
    let g = edit.out_norm.as_ref().map(|n| n.scale.as_slice());
    match (edit.kind, shape.as_slice()) {
        (EditKind::Write, [rows, cols]) if *rows == r.len() => {
            orthogonalize_writer(&mut w, *cols, r, g)
        }
        (EditKind::Write, [rows]) if *rows == r.len() => orthogonalize_writer(&mut w, 1, r, g),
        (EditKind::Read, [_, cols]) if *cols == r.len() => orthogonalize_read(&mut w, r),
        _ => {
            return Err(AbliterateError::DirectionShape {
                tensor: edit.tensor.clone(),
                shape,
                len: r.len(),
            }
            .into())
        }
    }
    let bytes = dtype.encode(&w);
    let back = dtype.decode(&bytes);
    Ok((bytes, back))
}
