//! ggml block quantizers and dequantizers, row by row and for whole tensors.
//!
//! A tensor is `rows × cols` f32 values, row-major (ggml's `ne[0] = cols`); each row is quantized
//! on its own into `cols / block_len` blocks. The optional importance vector has one entry per
//! column (what `llama-imatrix` collects and what our calibration's Hessian diagonal is) and steers
//! the scale search of the types that use one (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K … Q6_K, IQ4_NL, IQ4_XS), as `llama-quantize --imatrix`
//! does. F16, BF16, F32 and Q8_0 ignore it.

pub mod feedback;
pub mod iq4;
pub mod kquants;
pub mod legacy;
pub mod search;

use super::types::GgmlType;
use rayon::prelude::*;

/// A tensor that cannot be stored as the requested type.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BlockError {
    #[error("a row of {cols} values is not a multiple of {ty}'s block of {block}")]
    RowNotBlockMultiple {
        ty: &'static str,
        cols: usize,
        block: usize,
    },
    #[error("{len} values are not a whole number of rows of {cols}")]
    Shape { len: usize, cols: usize },
    #[error("importance vector has {len} entries for rows of {cols}")]
    Importance { len: usize, cols: usize },
    #[error("a Hessian factor of dimension {dim} does not fit rows of {cols} values")]
    Hessian { dim: usize, cols: usize },
    #[error("{len} bytes are not a whole number of {ty} rows of {cols} values")]
    Bytes {
        ty: &'static str,
        len: usize,
        cols: usize,
    },
}

/// Quantizes one row. `x.len()` must be a multiple of the block length, `out` exactly the row's
/// bytes, `importance` (if any) as long as `x`; [`quantize_tensor`] checks these.
pub fn quantize_row(ty: GgmlType, x: &[f32], importance: Option<&[f32]>, out: &mut [u8]) {
    let n = ty.block_len();
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => legacy::quantize_f32(x, out),
        GgmlType::F16 => legacy::quantize_f16(x, out),
        GgmlType::BF16 => legacy::quantize_bf16(x, out),
        GgmlType::Q8_0 => {
            for (xb, ob) in x.chunks_exact(n).zip(out.chunks_exact_mut(bb)) {
                legacy::quantize_q8_0(xb, ob);
            }
        }
        GgmlType::Q4_0 => match importance {
            None => {
                for (xb, ob) in x.chunks_exact(n).zip(out.chunks_exact_mut(bb)) {
                    legacy::quantize_q4_0_plain(xb, ob);
                }
            }
            Some(qw) => {
                // σ² over the whole row for Q4_0 (per super-block for the K-quants).
                let sigma2 = x.iter().fold(0.0f32, |s, v| s + v * v) / x.len() as f32;
                for ((xb, ob), wb) in x
                    .chunks_exact(n)
                    .zip(out.chunks_exact_mut(bb))
                    .zip(qw.chunks_exact(n))
                {
                    legacy::quantize_q4_0_weighted(xb, wb, sigma2, ob);
                }
            }
        },
        GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let f = match ty {
                GgmlType::Q4_1 => legacy::quantize_q4_1,
                GgmlType::Q5_0 => legacy::quantize_q5_0,
                _ => legacy::quantize_q5_1,
            };
            let sigma2 = importance
                .map(|_| x.iter().fold(0.0f32, |s, v| s + v * v) / x.len() as f32)
                .unwrap_or(0.0);
            for (k, (xb, ob)) in x.chunks_exact(n).zip(out.chunks_exact_mut(bb)).enumerate() {
                f(xb, importance.map(|w| (&w[k * n..k * n + n], sigma2)), ob);
            }
        }
        GgmlType::Q2K
        | GgmlType::Q3K
        | GgmlType::Q4K
        | GgmlType::Q5K
        | GgmlType::Q6K
        | GgmlType::IQ4NL
        | GgmlType::IQ4XS => {
            let f = match ty {
                GgmlType::IQ4NL => iq4::quantize_iq4_nl,
                GgmlType::IQ4XS => iq4::quantize_iq4_xs,
                GgmlType::Q2K => kquants::quantize_q2k,
                GgmlType::Q3K => kquants::quantize_q3k,
                GgmlType::Q4K => kquants::quantize_q4k,
                GgmlType::Q5K => kquants::quantize_q5k,
                _ => kquants::quantize_q6k,
            };
            for (k, (xb, ob)) in x.chunks_exact(n).zip(out.chunks_exact_mut(bb)).enumerate() {
                f(xb, importance.map(|w| &w[k * n..k * n + n]), ob);
            }
        }
    }
}

/// Dequantizes one row: `b` is the row's bytes, `y` its `cols` values.
pub fn dequantize_row(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    let n = ty.block_len();
    let bb = ty.block_bytes();
    let f: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => return legacy::dequantize_f32(b, y),
        GgmlType::F16 => return legacy::dequantize_f16(b, y),
        GgmlType::BF16 => return legacy::dequantize_bf16(b, y),
        GgmlType::Q8_0 => legacy::dequantize_q8_0,
        GgmlType::Q4_0 => legacy::dequantize_q4_0,
        GgmlType::Q4_1 => legacy::dequantize_q4_1,
        GgmlType::Q5_0 => legacy::dequantize_q5_0,
        GgmlType::Q5_1 => legacy::dequantize_q5_1,
        GgmlType::Q2K => kquants::dequantize_q2k,
        GgmlType::Q3K => kquants::dequantize_q3k,
        GgmlType::Q4K => kquants::dequantize_q4k,
        GgmlType::Q5K => kquants::dequantize_q5k,
        GgmlType::Q6K => kquants::dequantize_q6k,
        GgmlType::IQ4NL => iq4::dequantize_iq4_nl,
        GgmlType::IQ4XS => iq4::dequantize_iq4_xs,
    };
    for (bb, yb) in b.chunks_exact(bb).zip(y.chunks_exact_mut(n)) {
        f(bb, yb);
    }
}

/// The checks of [`quantize_tensor`]: the row's byte size.
pub fn check_rows(
    ty: GgmlType,
    len: usize,
    cols: usize,
    importance: Option<&[f32]>,
) -> Result<usize, BlockError> {
    let row_bytes = ty.row_bytes(cols).ok_or(BlockError::RowNotBlockMultiple {
        ty: ty.name(),
        cols,
        block: ty.block_len(),
    })?;
    if !len.is_multiple_of(cols) {
        return Err(BlockError::Shape { len, cols });
    }
    if let Some(w) = importance {
        if w.len() != cols {
            return Err(BlockError::Importance { len: w.len(), cols });
        }
    }
    Ok(row_bytes)
}

/// Quantizes a `len / cols × cols` tensor, rows in parallel on the rayon pool.
pub fn quantize_tensor(
    ty: GgmlType,
    data: &[f32],
    cols: usize,
    importance: Option<&[f32]>,
) -> Result<Vec<u8>, BlockError> {
    let row_bytes = check_rows(ty, data.len(), cols, importance)?;
    let rows = data.len() / cols;
    let mut out = vec![0u8; rows * row_bytes];
    out.par_chunks_mut(row_bytes)
        .zip(data.par_chunks(cols))
        .for_each(|(o, x)| quantize_row(ty, x, importance, o));
    Ok(out)
}

/// Dequantizes a tensor of rows of `cols` values.
pub fn dequantize_tensor(ty: GgmlType, bytes: &[u8], cols: usize) -> Result<Vec<f32>, BlockError> {
    let row_bytes = ty.row_bytes(cols).ok_or(BlockError::RowNotBlockMultiple {
        ty: ty.name(),
        cols,
        block: ty.block_len(),
    })?;
    if !bytes.len().is_multiple_of(row_bytes) {
        return Err(BlockError::Bytes {
            ty: ty.name(),
            len: bytes.len(),
            cols,
        });
    }
    let rows = bytes.len() / row_bytes;
    let mut out = vec![0.0f32; rows * cols];
    out.par_chunks_mut(cols)
        .zip(bytes.par_chunks(row_bytes))
        .for_each(|(y, b)| dequantize_row(ty, b, y));
    Ok(out)
}

#[cfg(test)]
mod tests;
