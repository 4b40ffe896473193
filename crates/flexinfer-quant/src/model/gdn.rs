//! The gated delta-net token mixer of the Qwen3-Next / Qwen3.5 linear-attention layers, in f32, one sequence
//! at a time.
//!
//! From the normalised residual `h` (`[tokens, hidden]`):
//! 1. the input projections give q, k, v (`key_dim`, `key_dim`, `value_dim` channels), the output gate z
//!    (`value_dim`) and, per value head, b and a ([`GdnLayout`] says how they are packed);
//! 2. q, k and v go through a causal depthwise convolution (kernel `conv_kernel`, each channel sees itself and
//!    the `kernel - 1` tokens before it) and SiLU;
//! 3. per head, q and k are L2-normalised (q also scaled by `head_k_dim^-1/2`); each value head reads the key head
//!    it shares with `num_v_heads / num_k_heads - 1` others;
//! 4. the gated delta rule, per value head with a state `S` (`head_k_dim × head_v_dim`, zero at the start): for
//!    each token, `S ← exp(g)·S`, then `S ← S + k ⊗ β(v − Sᵀk)`, and the output is `Sᵀq`, where
//!    `β = sigmoid(b)` and `g = −exp(A_log)·softplus(a + dt_bias)`;
//! 5. the gated RMSNorm per value head: `rmsnorm(o)·w·silu(z)`, the input of `out_proj`.
//!
//! transformers computes step 4 in chunks of 64 tokens (the same sums regrouped); this is the token-by-token
//! recurrence, which is what the chunked form is exact for.

use crate::model::config::{GdnConfig, GdnLayout};
use crate::model::nn::linear;
use crate::model::{GdnWeights, LayerWeights, ModelConfig};
use faer::{Mat, MatRef};
use rayon::prelude::*;

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's `softplus` (β 1, linear above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The projections of one sequence, unpacked: `qkv` `[tokens, conv_dim]` (all q, all k, all v), `z`
/// `[tokens, value_dim]`, `b` and `a` `[tokens, num_v_heads]`.
struct Projected {
    qkv: Mat<f32>,
    z: Mat<f32>,
    b: Mat<f32>,
    a: Mat<f32>,
}

fn project(g: &GdnConfig, lw: &LayerWeights, h: MatRef<'_, f32>) -> Projected {
    let t = h.nrows();
    match g.layout {
        GdnLayout::Split => Projected {
            qkv: linear(h, &lw.linears[0]),
            z: linear(h, &lw.linears[1]),
            b: linear(h, &lw.linears[2]),
            a: linear(h, &lw.linears[3]),
        },
        GdnLayout::Fused => {
            // Per key head: [q (dk) | k (dk) | v (r·dv) | z (r·dv)] and [b (r) | a (r)].
            let qkvz = linear(h, &lw.linears[0]);
            let ba = linear(h, &lw.linears[1]);
            let (dk, r, dv) = (g.head_k_dim, g.group(), g.head_v_dim);
            let rv = r * dv;
            let block = 2 * dk + 2 * rv;
            let mut qkv = Mat::<f32>::zeros(t, g.conv_dim);
            let mut z = Mat::<f32>::zeros(t, g.value_dim);
            let mut b = Mat::<f32>::zeros(t, g.num_v_heads);
            let mut a = Mat::<f32>::zeros(t, g.num_v_heads);
            for kh in 0..g.num_k_heads {
                let src = kh * block;
                for i in 0..dk {
                    qkv.col_mut(kh * dk + i).copy_from(qkvz.col(src + i));
                    qkv.col_mut(g.key_dim + kh * dk + i)
                        .copy_from(qkvz.col(src + dk + i));
                }
                for i in 0..rv {
                    qkv.col_mut(2 * g.key_dim + kh * rv + i)
                        .copy_from(qkvz.col(src + 2 * dk + i));
                    z.col_mut(kh * rv + i)
                        .copy_from(qkvz.col(src + 2 * dk + rv + i));
                }
                for i in 0..r {
                    b.col_mut(kh * r + i).copy_from(ba.col(kh * 2 * r + i));
                    a.col_mut(kh * r + i).copy_from(ba.col(kh * 2 * r + r + i));
                }
            }
            Projected { qkv, z, b, a }
        }
    }
}

/// Causal depthwise convolution of every channel, then SiLU, in place (`w`: `[channels][kernel]`).
fn causal_conv_silu(x: &mut Mat<f32>, w: &[f32], kernel: usize) {
    let t = x.nrows();
    let mut out = vec![0f32; t];
    for c in 0..x.ncols() {
        let wc = &w[c * kernel..(c + 1) * kernel];
        let col = x.col_as_slice_mut(c);
        for (s, o) in out.iter_mut().enumerate() {
            // Output s reads inputs s − (kernel − 1) ..= s; tap j multiplies input s + j − (kernel − 1).
            let mut acc = 0f32;
            for (j, &wj) in wc.iter().enumerate() {
                if let Some(src) = (s + j).checked_sub(kernel - 1) {
                    acc += wj * col[src];
                }
            }
            *o = silu(acc);
        }
        col.copy_from_slice(&out);
    }
}

/// One vector per token.
type Rows = Vec<Vec<f32>>;

/// Row `r`'s columns `c0..c0 + n` of `x`, L2-normalised (`x / sqrt(Σx² + 1e-6)`) and multiplied by `scale`.
fn l2_row(x: &Mat<f32>, r: usize, c0: usize, n: usize, scale: f32) -> Vec<f32> {
    let v: Vec<f32> = (0..n).map(|i| x[(r, c0 + i)]).collect();
    let ss: f32 = v.iter().map(|a| a * a).sum();
    let s = scale / (ss + 1e-6).sqrt();
    v.into_iter().map(|a| a * s).collect()
}

/// The gated delta rule of one value head over the sequence: `[tokens][head_v_dim]` outputs, row-major.
fn delta_rule_head(
    g: &GdnConfig,
    w: &GdnWeights,
    p: &Projected,
    q: &[Vec<f32>],
    k: &[Vec<f32>],
    head: usize,
) -> Vec<f32> {
    let (t, dk, dv) = (p.qkv.nrows(), g.head_k_dim, g.head_v_dim);
    let v0 = 2 * g.key_dim + head * dv;
    let mut state = vec![0f32; dk * dv]; // S[i][j] at i·dv + j
    let mut out = vec![0f32; t * dv];
    let mut delta = vec![0f32; dv];
    for s in 0..t {
        let (qs, ks) = (&q[s], &k[s]);
        let beta = sigmoid(p.b[(s, head)]);
        let decay = (w.neg_a[head] * softplus(p.a[(s, head)] + w.dt_bias[head])).exp();
        state.iter_mut().for_each(|x| *x *= decay);
        // delta = β (v − Sᵀk), Sᵀk summed row by row (contiguous rows of S).
        delta.fill(0.0);
        for (i, &ki) in ks.iter().enumerate() {
            let row = &state[i * dv..(i + 1) * dv];
            delta.iter_mut().zip(row).for_each(|(d, &sv)| *d += sv * ki);
        }
        for (j, d) in delta.iter_mut().enumerate() {
            *d = (p.qkv[(s, v0 + j)] - *d) * beta;
        }
        for (i, &ki) in ks.iter().enumerate() {
            let row = &mut state[i * dv..(i + 1) * dv];
            row.iter_mut().zip(&delta).for_each(|(x, &d)| *x += ki * d);
        }
        let o = &mut out[s * dv..(s + 1) * dv];
        for (i, &qi) in qs.iter().enumerate() {
            let row = &state[i * dv..(i + 1) * dv];
            o.iter_mut().zip(row).for_each(|(x, &sv)| *x += qi * sv);
        }
    }
    out
}

/// The input of `out_proj` for the normalised residual `h` of one sequence (`[tokens, value_dim]`).
pub fn gdn_mixer(cfg: &ModelConfig, lw: &LayerWeights, h: MatRef<'_, f32>) -> Mat<f32> {
    let (Some(g), Some(w)) = (&cfg.gdn, &lw.gdn) else {
        return Mat::zeros(h.nrows(), 0);
    };
    let t = h.nrows();
    let mut p = project(g, lw, h);
    causal_conv_silu(&mut p.qkv, &w.conv, g.conv_kernel);
    let (dk, dv, r) = (g.head_k_dim, g.head_v_dim, g.group());
    let q_scale = 1.0 / (dk as f32).sqrt();
    // Per key head, per token: the normalised query and key.
    let qk: Vec<(Rows, Rows)> = (0..g.num_k_heads)
        .map(|kh| {
            let q = (0..t)
                .map(|s| l2_row(&p.qkv, s, kh * dk, dk, q_scale))
                .collect();
            let k = (0..t)
                .map(|s| l2_row(&p.qkv, s, g.key_dim + kh * dk, dk, 1.0))
                .collect();
            (q, k)
        })
        .collect();
    let heads: Vec<Vec<f32>> = (0..g.num_v_heads)
        .into_par_iter()
        .map(|head| {
            let (q, k) = &qk[head / r];
            delta_rule_head(g, w, &p, q, k, head)
        })
        .collect();
    let eps = cfg.rms_norm_eps;
    let mut out = Mat::<f32>::zeros(t, g.value_dim);
    for (head, o) in heads.iter().enumerate() {
        for s in 0..t {
            let row = &o[s * dv..(s + 1) * dv];
            let ms = row.iter().map(|x| x * x).sum::<f32>() / dv as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for (j, &x) in row.iter().enumerate() {
                let c = head * dv + j;
                out[(s, c)] = x * inv * w.norm[j] * silu(p.z[(s, c)]);
            }
        }
    }
    out
}
