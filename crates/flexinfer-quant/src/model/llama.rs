//! Llama-family decoder forward in f32 (RMSNorm, RoPE, grouped-query causal attention, SwiGLU), one layer at a time.
//! The hybrids' linear-attention layers run the gated delta-net mixer ([`crate::model::gdn`]) in place of
//! attention; everything around it is shared.

use crate::error::Result;
use crate::model::tensors::TensorStore;
use crate::model::{load_layer, GptqReadConfig, LayerWeights, Linear, ModelConfig};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef};

pub use crate::model::nn::{gelu_tanh, linear, rms_norm};

/// Where a partial forward stops: the input of one shared-input module group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Input of q/k/v (after input_layernorm); of a linear-attention layer's input projections.
    Qkv = 0,
    /// Input of o_proj (attention output); of a linear-attention layer's `out_proj` (its gated-norm output).
    O = 1,
    /// Input of gate/up (after post_attention_layernorm).
    GateUp = 2,
    /// Input of down_proj (SwiGLU activation).
    Down = 3,
}

pub const STAGES: [Stage; 4] = [Stage::Qkv, Stage::O, Stage::GateUp, Stage::Down];

/// cos/sin tables for positions `0..len`.
pub struct Rope {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    /// cos/sin of the local (sliding-window) layers when their rope differs (Gemma 3, Gemma 4).
    pub local: Option<(Vec<f32>, Vec<f32>)>,
    /// Frequencies per position of the local tables (Gemma 4's local heads are narrower).
    pub local_half: usize,
}

fn rope_tables(inv: &[f32], len: usize) -> (Vec<f32>, Vec<f32>) {
    let half = inv.len();
    let mut cos = vec![0.0; len * half];
    let mut sin = vec![0.0; len * half];
    for p in 0..len {
        for (i, f) in inv.iter().enumerate() {
            let a = p as f32 * f;
            cos[p * half + i] = a.cos();
            sin[p * half + i] = a.sin();
        }
    }
    (cos, sin)
}

impl Rope {
    pub fn new(cfg: &ModelConfig, len: usize) -> Self {
        let inv = cfg.inv_freq();
        let (cos, sin) = rope_tables(&inv, len);
        let local_inv = cfg.local_inv_freq();
        Rope {
            half: inv.len(),
            cos,
            sin,
            local_half: local_inv.as_ref().map_or(inv.len(), Vec::len),
            local: local_inv.map(|l| rope_tables(&l, len)),
        }
    }

    /// The tables of a layer (`sliding`: a local layer) and their frequencies per position.
    fn tables(&self, sliding: bool) -> (usize, &[f32], &[f32]) {
        match (&self.local, sliding) {
            (Some((c, s)), true) => (self.local_half, c, s),
            _ => (self.half, &self.cos, &self.sin),
        }
    }
}

/// RMSNorm of each head of `x` (`w`: per-dimension weight, `None`: none).
fn head_norm(x: &mut Mat<f32>, heads: usize, d: usize, w: Option<&[f32]>, eps: f32) {
    for r in 0..x.nrows() {
        for h in 0..heads {
            let ss: f32 = (0..d)
                .map(|i| x[(r, h * d + i)] * x[(r, h * d + i)])
                .sum::<f32>()
                / d as f32;
            let s = 1.0 / (ss + eps).sqrt();
            for i in 0..d {
                x[(r, h * d + i)] *= s * w.map_or(1.0, |w| w[i]);
            }
        }
    }
}

fn apply_rope(x: &mut Mat<f32>, heads: usize, d: usize, rope: &Rope, sliding: bool) {
    let (half, cos, sin) = rope.tables(sliding);
    let half = half.min(d / 2);
    for r in 0..x.nrows() {
        for h in 0..heads {
            for i in 0..half {
                let (c, s) = (cos[r * half + i], sin[r * half + i]);
                let (a, b) = (x[(r, h * d + i)], x[(r, h * d + i + half)]);
                x[(r, h * d + i)] = a * c - b * s;
                x[(r, h * d + i + half)] = b * c + a * s;
            }
        }
    }
}

/// Grouped-query causal self-attention of one sequence (input already normalised); returns the o_proj input.
pub fn attention(
    cfg: &ModelConfig,
    lw: &LayerWeights,
    h: MatRef<'_, f32>,
    rope: &Rope,
) -> Mat<f32> {
    let t = h.nrows();
    let (nh, nkv, d) = (lw.attn.heads, lw.attn.kv_heads, lw.attn.head_dim);
    let qg = linear(h, &lw.linears[0]);
    // Qwen3-Next / Qwen3.5: each head's q_proj rows are [query | output gate].
    let (mut q, gate) = if lw.attn.output_gate && qg.ncols() == 2 * nh * d {
        let half =
            |off: usize| Mat::from_fn(t, nh * d, |r, c| qg[(r, (c / d) * 2 * d + off + c % d)]);
        (half(0), Some(half(d)))
    } else {
        (qg, None)
    };
    let mut k = linear(h, &lw.linears[1]);
    // Gemma 4 `attention_k_eq_v`: the values are the keys' projection before the key norm and rope.
    let mut v = if lw.attn.v_from_k {
        k.clone()
    } else {
        linear(h, &lw.linears[2])
    };
    if let Some(w) = &lw.q_norm {
        head_norm(&mut q, nh, d, Some(w), cfg.rms_norm_eps);
    }
    if let Some(w) = &lw.k_norm {
        head_norm(&mut k, nkv, d, Some(w), cfg.rms_norm_eps);
    }
    if lw.v_norm {
        head_norm(&mut v, nkv, d, None, cfg.rms_norm_eps);
    }
    apply_rope(&mut q, nh, d, rope, lw.sliding);
    apply_rope(&mut k, nkv, d, rope, lw.sliding);
    let gemma = cfg.gemma.as_ref();
    let scale = gemma.map_or(1.0 / (d as f32).sqrt(), |g| g.attn_scale);
    let softcap = gemma.and_then(|g| g.attn_softcap);
    // Sliding-window layers: query i sees keys i - window < j ≤ i.
    let window = gemma.and_then(|g| g.sliding_window).filter(|_| lw.sliding);
    let mut out = Mat::<f32>::zeros(t, nh * d);
    let par = faer::get_global_parallelism();
    // Scores transposed (`st[j][i]` = key j · query i), so each query's causal softmax runs over one
    // contiguous column, keys 0..=i only.
    let mut st = Mat::<f32>::zeros(t, t);
    for head in 0..nh {
        let kvh = head / (nh / nkv);
        let qh = q.subcols(head * d, d);
        let kh = k.subcols(kvh * d, d);
        let vh = v.subcols(kvh * d, d);
        matmul(st.as_mut(), Accum::Replace, kh, qh.transpose(), scale, par);
        for i in 0..t {
            causal_softmax(st.col_as_slice_mut(i), i, window, softcap);
        }
        matmul(
            out.subcols_mut(head * d, d),
            Accum::Replace,
            st.transpose(),
            vh,
            1.0,
            par,
        );
    }
    if let Some(g) = gate {
        for c in 0..out.ncols() {
            let gc = g.col_as_slice(c);
            for (o, &gv) in out.col_as_slice_mut(c).iter_mut().zip(gc) {
                *o /= 1.0 + (-gv).exp();
            }
        }
    }
    out
}

/// Query `i`'s scores over the keys (`c[j]` = key j · query i) turned into its attention weights in place: keys
/// after `i` and, on a sliding-window layer, keys at or before `i − window` get 0; the others are soft-capped
/// (Gemma 2) and softmaxed.
fn causal_softmax(c: &mut [f32], i: usize, window: Option<usize>, softcap: Option<f32>) {
    let (live, masked) = c.split_at_mut(i + 1);
    let lo = window.map_or(0, |w| (i + 1).saturating_sub(w));
    let (before, live) = live.split_at_mut(lo);
    before.fill(0.0);
    if let Some(cap) = softcap {
        live.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
    }
    let m = live.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0;
    for v in live.iter_mut() {
        let e = (*v - m).exp();
        *v = e;
        sum += e;
    }
    for v in live.iter_mut() {
        *v /= sum;
    }
    masked.fill(0.0);
}

/// The layer's token mixer on the normalised residual `h`: attention, or a linear-attention layer's gated
/// delta net; returns the input of its output projection.
pub fn token_mixer(
    cfg: &ModelConfig,
    lw: &LayerWeights,
    h: MatRef<'_, f32>,
    rope: &Rope,
) -> Mat<f32> {
    if lw.gdn.is_some() {
        crate::model::gdn::gdn_mixer(cfg, lw, h)
    } else {
        attention(cfg, lw, h, rope)
    }
}

/// SwiGLU input of down_proj for the residual stream `x1` (after attention).
pub fn mlp_activation(cfg: &ModelConfig, lw: &LayerWeights, x1: MatRef<'_, f32>) -> Mat<f32> {
    let h2 = rms_norm(x1, &lw.post_norm, cfg.rms_norm_eps);
    let mut g = linear(h2.as_ref(), &lw.linears[lw.mixer]);
    let u = linear(h2.as_ref(), &lw.linears[lw.mixer + 1]);
    drop(h2);
    // act(g)·u, written over g (no third intermediate-sized matrix): SiLU, or GELU-tanh for Gemma.
    let gelu = cfg.gemma.is_some();
    for c in 0..g.ncols().min(u.ncols()) {
        let uc = u.col_as_slice(c);
        for (gv, &uv) in g.col_as_slice_mut(c).iter_mut().zip(uc) {
            *gv = if gelu {
                gelu_tanh(*gv) * uv
            } else {
                *gv / (1.0 + (-*gv).exp()) * uv
            };
        }
    }
    g
}

/// What attention adds to the residual stream: `o_proj(att)` (`out_proj` on a linear-attention layer),
/// RMS-normalised for Gemma.
pub fn attention_delta(cfg: &ModelConfig, lw: &LayerWeights, att: MatRef<'_, f32>) -> Mat<f32> {
    let o = linear(att, &lw.linears[lw.mixer - 1]);
    match &lw.attn_out_norm {
        Some(w) => rms_norm(o.as_ref(), w, cfg.rms_norm_eps),
        None => o,
    }
}

/// Residual stream after attention: `x + attention_delta(att)`.
pub fn attention_residual(
    cfg: &ModelConfig,
    lw: &LayerWeights,
    x: MatRef<'_, f32>,
    att: MatRef<'_, f32>,
) -> Mat<f32> {
    let o = attention_delta(cfg, lw, att);
    x + &o
}

/// The MLP's contribution for the residual stream `x1` (after attention): `down_proj(mlp_activation(x1))`, or
/// the routed experts' weighted sum on a MoE layer.
pub fn mlp_output(cfg: &ModelConfig, lw: &LayerWeights, x1: MatRef<'_, f32>) -> Mat<f32> {
    match (&lw.moe, cfg.moe.as_ref()) {
        (Some(m), Some(mc)) => {
            let y = m.forward_residual(x1, &lw.post_norm, cfg.rms_norm_eps, &mc.spec);
            match &lw.mlp_out_norm {
                Some(w) => rms_norm(y.as_ref(), w, cfg.rms_norm_eps),
                None => y,
            }
        }
        _ => {
            let act = mlp_activation(cfg, lw, x1);
            mlp_down(cfg, lw, act.as_ref())
        }
    }
}

/// A dense MLP's contribution from its down_proj input `act` ([`mlp_activation`]).
pub fn mlp_down(cfg: &ModelConfig, lw: &LayerWeights, act: MatRef<'_, f32>) -> Mat<f32> {
    let dn = linear(act, &lw.linears[lw.mixer + 2]);
    match &lw.mlp_out_norm {
        Some(w) => rms_norm(dn.as_ref(), w, cfg.rms_norm_eps),
        None => dn,
    }
}

/// Layer output from the residual stream after attention: `x1 + mlp_output(x1)` (times Gemma 4's
/// `layer_scalar`).
pub fn mlp_residual(cfg: &ModelConfig, lw: &LayerWeights, x1: MatRef<'_, f32>) -> Mat<f32> {
    let dn = mlp_output(cfg, lw, x1);
    let mut out = x1 + &dn;
    scale_layer_output(lw, &mut out);
    out
}

/// Gemma 4: multiplies the finished layer output (residual included) by `layer_scalar`.
pub fn scale_layer_output(lw: &LayerWeights, x: &mut Mat<f32>) {
    if let Some(s) = lw.layer_scalar {
        for c in 0..x.ncols() {
            x.col_as_slice_mut(c).iter_mut().for_each(|v| *v *= s);
        }
    }
}

/// Runs one decoder layer on one sequence `x` (`[tokens, hidden]`). With `stop`, returns the input of that
/// module group instead of the layer output; the arithmetic up to that point is the same in both cases. A MoE
/// layer has no single `down` input (each expert sees its own tokens): `Stage::Down` returns the `GateUp` input
/// there.
pub fn layer_forward(
    cfg: &ModelConfig,
    lw: &LayerWeights,
    x: MatRef<'_, f32>,
    rope: &Rope,
    stop: Option<Stage>,
) -> Mat<f32> {
    let h = rms_norm(x, &lw.input_norm, cfg.rms_norm_eps);
    if stop == Some(Stage::Qkv) {
        return h;
    }
    let att = token_mixer(cfg, lw, h.as_ref(), rope);
    if stop == Some(Stage::O) {
        return att;
    }
    let x1 = attention_residual(cfg, lw, x, att.as_ref());
    if stop == Some(Stage::GateUp) || (stop == Some(Stage::Down) && lw.moe.is_some()) {
        return rms_norm(x1.as_ref(), &lw.post_norm, cfg.rms_norm_eps);
    }
    if stop == Some(Stage::Down) {
        return mlp_activation(cfg, lw, x1.as_ref());
    }
    mlp_residual(cfg, lw, x1.as_ref())
}

/// Runs one decoder layer on `x` in place (the layer output replaces it), handing each module group's
/// input to `visit` on the way: the same arithmetic as [`layer_forward`] (each stage computed once). A MoE
/// layer has no single `down` input: it visits `Qkv`, `O` and `GateUp` only.
pub fn layer_forward_visit(
    cfg: &ModelConfig,
    lw: &LayerWeights,
    x: &mut Mat<f32>,
    rope: &Rope,
    visit: &mut dyn FnMut(Stage, MatRef<'_, f32>),
) {
    let h = rms_norm(x.as_ref(), &lw.input_norm, cfg.rms_norm_eps);
    visit(Stage::Qkv, h.as_ref());
    let att = token_mixer(cfg, lw, h.as_ref(), rope);
    drop(h);
    visit(Stage::O, att.as_ref());
    let o = attention_delta(cfg, lw, att.as_ref());
    drop(att);
    *x += &o;
    drop(o);
    let h2 = rms_norm(x.as_ref(), &lw.post_norm, cfg.rms_norm_eps);
    visit(Stage::GateUp, h2.as_ref());
    drop(h2);
    let dn = if lw.moe.is_some() {
        mlp_output(cfg, lw, x.as_ref())
    } else {
        let act = mlp_activation(cfg, lw, x.as_ref());
        visit(Stage::Down, act.as_ref());
        mlp_down(cfg, lw, act.as_ref())
    };
    *x += &dn;
    scale_layer_output(lw, x);
}

/// Token embeddings `[tokens, hidden]`.
pub fn embed(
    store: &TensorStore,
    cfg: &ModelConfig,
    embed_table: Option<&[f32]>,
    tokens: &[u32],
) -> Result<Mat<f32>> {
    let name = cfg.embed_name();
    let name = name.as_str();
    let hsz = cfg.hidden_size;
    let mut out = Mat::<f32>::zeros(tokens.len(), hsz);
    let scale = embed_scale(store, cfg);
    match embed_table {
        Some(table) => {
            let vocab = table.len() / hsz.max(1);
            for (r, &tok) in tokens.iter().enumerate() {
                let t = (tok as usize).min(vocab.saturating_sub(1));
                for c in 0..hsz {
                    out[(r, c)] = table[t * hsz + c] * scale;
                }
            }
        }
        None => {
            // Row by row from the mapping: the f32 table (vocabulary × hidden) is never built.
            let vocab = store.entry(name)?.shape.first().copied().unwrap_or(0);
            for (r, &tok) in tokens.iter().enumerate() {
                let t = (tok as usize).min(vocab.saturating_sub(1));
                let row = store.f32_row(name, t)?;
                if row.len() != hsz {
                    return Err(crate::error::TensorError::RowWidth {
                        name: name.to_string(),
                        len: row.len(),
                        hidden_size: hsz,
                    }
                    .into());
                }
                for (c, v) in row.into_iter().enumerate() {
                    out[(r, c)] = v * scale;
                }
            }
        }
    }
    Ok(out)
}

/// Gemma multiplies the embeddings by `sqrt(hidden_size)`, rounded to the embedding table's dtype as
/// transformers does; 1 otherwise.
pub fn embed_scale(store: &TensorStore, cfg: &ModelConfig) -> f32 {
    if cfg.gemma.is_none() {
        return 1.0;
    }
    let s = (cfg.hidden_size as f32).sqrt();
    match store.entry(&cfg.embed_name()).map(|e| e.dtype) {
        Ok(safetensors::Dtype::BF16) => half::bf16::from_f32(s).to_f32(),
        Ok(safetensors::Dtype::F16) => half::f16::from_f32(s).to_f32(),
        _ => s,
    }
}

/// The final norm's weight as multiplied (`1 + w` for Gemma).
pub fn final_norm_weight(store: &TensorStore, cfg: &ModelConfig) -> Result<Vec<f32>> {
    Ok(cfg.norm_weight(store.f32(&cfg.final_norm_name())?))
}

/// Gemma 2 / Gemma 4's final soft-capping of the logits, in place (nothing for other families).
pub fn cap_logits(cfg: &ModelConfig, logits: &mut Mat<f32>) {
    if let Some(cap) = cfg.gemma.as_ref().and_then(|g| g.final_softcap) {
        for c in 0..logits.ncols() {
            logits
                .col_as_slice_mut(c)
                .iter_mut()
                .for_each(|v| *v = cap * (*v / cap).tanh());
        }
    }
}

/// Full-model logits `[tokens, vocab]` (used to compare a quantized artifact against its source).
pub fn logits(store: &TensorStore, cfg: &ModelConfig, tokens: &[u32]) -> Result<Mat<f32>> {
    let gq = GptqReadConfig::from_config(cfg);
    let rope = Rope::new(cfg, tokens.len());
    let mut x = embed(store, cfg, None, tokens)?;
    for layer in 0..cfg.num_layers {
        let lw = load_layer(store, cfg, layer, gq)?;
        x = layer_forward(cfg, &lw, x.as_ref(), &rope, None);
    }
    let xn = rms_norm(
        x.as_ref(),
        &final_norm_weight(store, cfg)?,
        cfg.rms_norm_eps,
    );
    let mut l = linear(xn.as_ref(), &lm_head(store, cfg)?);
    cap_logits(cfg, &mut l);
    Ok(l)
}

/// The output projection `[vocab, hidden]`: `lm_head.weight`, or the embeddings when they are tied.
pub fn lm_head(store: &TensorStore, cfg: &ModelConfig) -> Result<Linear> {
    let embed_name = cfg.embed_name();
    let head_name = if store.contains("lm_head.weight") {
        "lm_head.weight"
    } else {
        embed_name.as_str()
    };
    let w = store.f32(head_name)?;
    let hs = cfg.hidden_size.max(1);
    let vocab = w.len() / hs;
    Ok(Linear {
        w: Mat::from_fn(vocab, hs, |r, c| w[r * hs + c]),
        b: None,
    })
}
