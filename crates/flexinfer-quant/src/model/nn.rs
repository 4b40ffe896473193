//! The forward's building blocks that the decoder layers share (the attention and MLP of [`super::llama`],
//! the experts of [`super::moe`], the linear attention of [`super::gdn`]).

use crate::model::Linear;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef};

pub fn rms_norm(x: MatRef<'_, f32>, w: &[f32], eps: f32) -> Mat<f32> {
    let (t, d) = (x.nrows(), x.ncols());
    let mut inv = vec![0.0f32; t];
    for c in 0..d {
        for r in 0..t {
            let v = x[(r, c)];
            inv[r] += v * v;
        }
    }
    for s in inv.iter_mut() {
        *s = 1.0 / (*s / d as f32 + eps).sqrt();
    }
    Mat::from_fn(t, d, |r, c| x[(r, c)] * inv[r] * w[c])
}

pub fn linear(x: MatRef<'_, f32>, l: &Linear) -> Mat<f32> {
    let mut y = Mat::<f32>::zeros(x.nrows(), l.w.nrows());
    matmul(
        y.as_mut(),
        Accum::Replace,
        x,
        l.w.transpose(),
        1.0,
        faer::get_global_parallelism(),
    );
    if let Some(b) = &l.b {
        for (c, bv) in b.iter().enumerate() {
            y.col_mut(c).iter_mut().for_each(|v| *v += bv);
        }
    }
    y
}

/// GELU with the tanh approximation (`gelu_pytorch_tanh`).
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}
