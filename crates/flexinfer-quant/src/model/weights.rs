//! One decoder layer's weights: loading the modules of [`super::modules`] from a source checkpoint or
//! dequantized from a `gptq` checkpoint with the consumer's rules.
// Sizes, head counts and offsets come from untrusted model files: overflow must be an error or
// saturate, never wrap or panic (the numeric kernels are outside the lint).
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

use super::config::{AttnShape, ModelConfig, MoeConfig};
pub use super::modules::*;
use crate::error::{ConfigError, NumericError, Result, TensorError};
use crate::model::moe::{Gemma4Moe, Mlp, MoeStyle, MoeWeights};
use crate::model::tensors::TensorStore;
use crate::numerics::pack::{dequantize_packed, PackedLinear, ZeroFormat};
use faer::Mat;
use serde_json::Value;

#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out, in]`.
    pub w: Mat<f32>,
    pub b: Option<Vec<f32>>,
}

/// A gated delta-net layer's tensors beside its linears.
#[derive(Clone, Debug)]
pub struct GdnWeights {
    /// The causal depthwise convolution, `[conv_dim][kernel]` row-major (`conv1d.weight` `[conv_dim, 1, kernel]`).
    pub conv: Vec<f32>,
    /// `dt_bias` per value head.
    pub dt_bias: Vec<f32>,
    /// `-exp(A_log)` per value head: the decay rate.
    pub neg_a: Vec<f32>,
    /// The gated RMSNorm's weight (`norm.weight`, multiplied as `w`), per value-head dimension.
    pub norm: Vec<f32>,
}

/// One decoder layer in f32.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// The token mixer's modules (the first [`LayerWeights::mixer`]), then the dense MLP's gate, up, down.
    pub linears: Vec<Linear>,
    /// How many of `linears` belong to the token mixer (4 for attention).
    pub mixer: usize,
    /// A linear-attention layer's convolution, decay and norm (then `linears` starts with its projections).
    pub gdn: Option<GdnWeights>,
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// The sparse MLP of a MoE layer (then `linears` holds only q, k, v, o).
    pub moe: Option<MoeWeights>,
    /// Gemma: RMSNorm of the attention output before the residual (`post_attention_layernorm`; `post_norm`
    /// is then `pre_feedforward_layernorm`), and of the MLP output (`post_feedforward_layernorm`).
    pub attn_out_norm: Option<Vec<f32>>,
    pub mlp_out_norm: Option<Vec<f32>>,
    /// Sliding-window (local) attention layer.
    pub sliding: bool,
    /// The layer's attention shape (`linears[2]` is a copy of `linears[1]` when `v_from_k`).
    pub attn: AttnShape,
    /// Gemma 4: the values are RMS-normalised per head (no weight).
    pub v_norm: bool,
    /// Gemma 4: the layer output (residual included) is multiplied by this (`layer_scalar`).
    pub layer_scalar: Option<f32>,
}

impl LayerWeights {
    /// Module `i` of [`layer_modules`].
    pub fn module(&self, i: usize) -> Option<&Linear> {
        let n = self.mixer;
        match &self.moe {
            None => self.linears.get(i),
            Some(_) if i < n => self.linears.get(i),
            Some(m) => {
                let k = i.saturating_sub(n);
                let (e, j) = (k / 3, k % 3);
                let mlp = m.experts.get(e).or(if e == m.experts.len() {
                    m.shared.as_ref()
                } else {
                    None
                })?;
                Some([&mlp.gate, &mlp.up, &mlp.down][j])
            }
        }
    }

    pub fn module_mut(&mut self, i: usize) -> Option<&mut Linear> {
        let n = self.mixer;
        match &mut self.moe {
            None => self.linears.get_mut(i),
            Some(_) if i < n => self.linears.get_mut(i),
            Some(m) => {
                let k = i.saturating_sub(n);
                let (e, j) = (k / 3, k % 3);
                let n = m.experts.len();
                let mlp = if e < n {
                    m.experts.get_mut(e)
                } else if e == n {
                    m.shared.as_mut()
                } else {
                    None
                }?;
                Some(match j {
                    0 => &mut mlp.gate,
                    1 => &mut mlp.up,
                    _ => &mut mlp.down,
                })
            }
        }
    }

    /// Re-derives tied modules from their source (after the source was quantized or replaced).
    pub fn sync_tied(&mut self) {
        if self.attn.v_from_k && self.linears.len() > 2 {
            self.linears[2] = self.linears[1].clone();
        }
    }
}

fn mat_from_row_major(data: &[f32], rows: usize, cols: usize) -> Mat<f32> {
    // The caller checked data.len() == rows × cols.
    Mat::from_fn(rows, cols, |r, c| {
        data[r.saturating_mul(cols).saturating_add(c)]
    })
}

/// How a `gptq` checkpoint's quantized linears are read back.
#[derive(Clone, Copy, Debug)]
pub struct GptqReadConfig {
    pub bits: u32,
    pub format: ZeroFormat,
}

impl GptqReadConfig {
    /// From `config.json`'s `quantization_config`, if present.
    pub fn from_config(cfg: &ModelConfig) -> Option<Self> {
        let qc = cfg.raw.get("quantization_config")?;
        let bits = qc.get("bits")?.as_u64()? as u32;
        let format = match qc.get("checkpoint_format").and_then(Value::as_str) {
            Some("gptq_v2") => ZeroFormat::V2,
            _ => ZeroFormat::V1,
        };
        Some(GptqReadConfig { bits, format })
    }
}

/// Loads linear `name` (`prefix` + module) as f32, dequantizing `qweight/qzeros/scales/g_idx` when present.
pub fn load_linear(
    store: &TensorStore,
    name: &str,
    shape: (usize, usize),
    gq: Option<GptqReadConfig>,
) -> Result<Linear> {
    let (rows, cols) = shape;
    let b = if store.contains(&format!("{name}.bias")) {
        Some(store.f32(&format!("{name}.bias"))?)
    } else {
        None
    };
    if let (Some(gq), true) = (gq, store.contains(&format!("{name}.qweight"))) {
        let scales_raw = store.raw(&format!("{name}.scales"))?;
        let scales: Vec<half::f16> = scales_raw
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
            .collect();
        let groups = scales.len().checked_div(rows.max(1)).unwrap_or(0);
        let packed = PackedLinear {
            qweight: store.i32(&format!("{name}.qweight"))?,
            qzeros: store.i32(&format!("{name}.qzeros"))?,
            scales,
            g_idx: store.i32(&format!("{name}.g_idx"))?,
            rows,
            cols,
            groups,
            bits: gq.bits,
        };
        if packed.g_idx.len() != cols || packed.g_idx.iter().any(|&g| g < 0 || g as usize >= groups)
        {
            return Err(TensorError::GroupIndex {
                module: name.to_string(),
            }
            .into());
        }
        let w = dequantize_packed(&packed, gq.format);
        return Ok(Linear {
            w: mat_from_row_major(&w, rows, cols),
            b,
        });
    }
    check_weight_shape(store, name, rows, cols)?;
    let w = store.f32(&format!("{name}.weight"))?;
    Ok(Linear {
        w: mat_from_row_major(&w, rows, cols),
        b,
    })
}

/// The fused expert tensors of a Gemma 4 MoE layer in the hub layout (`experts.gate_up_proj` `[E, 2I, H]`,
/// `experts.down_proj` `[E, H, I]`), when the checkpoint has them (a quantized one has per-expert modules).
pub fn fused_expert_names(
    store: &TensorStore,
    cfg: &ModelConfig,
    layer: usize,
) -> Option<[String; 2]> {
    let m = cfg.sparse_layer(layer)?;
    if m.spec.style != MoeStyle::Gemma4 {
        return None;
    }
    let p = cfg.layer_prefix(layer);
    let names = [
        format!("{p}experts.gate_up_proj"),
        format!("{p}experts.down_proj"),
    ];
    names.iter().all(|n| store.contains(n)).then_some(names)
}

/// Checks the fused expert tensors' shapes against the config.
pub fn check_fused_experts(store: &TensorStore, cfg: &ModelConfig, layer: usize) -> Result<()> {
    let (Some(names), Some(m)) = (
        fused_expert_names(store, cfg, layer),
        cfg.sparse_layer(layer),
    ) else {
        return Ok(());
    };
    let (e, i, h) = (m.num_experts, m.expert_intermediate, cfg.hidden_size);
    let two_i = i.checked_mul(2).ok_or_else(|| ConfigError::TooLarge {
        field: "moe_intermediate_size".into(),
    })?;
    for (name, want) in names.iter().zip([[e, two_i, h], [e, h, i]]) {
        let got = &store.entry(name)?.shape;
        if got.as_slice() != want {
            return Err(TensorError::Shape {
                name: name.clone(),
                shape: got.clone(),
                expected: want.to_vec(),
            }
            .into());
        }
    }
    Ok(())
}

/// Where module `spec` of `layer` comes from in a fused Gemma 4 expert tensor: (tensor, expert, first row).
fn fused_source(
    store: &TensorStore,
    cfg: &ModelConfig,
    layer: usize,
    spec: &ModuleSpec,
) -> Option<(String, usize, usize)> {
    let [gate_up, down] = fused_expert_names(store, cfg, layer)?;
    let m = cfg.sparse_layer(layer)?;
    let rest = spec.name.strip_prefix("experts.")?;
    let (e, which) = rest.split_once('.')?;
    let e: usize = e.parse().ok()?;
    match which {
        "gate_proj" => Some((gate_up, e, 0)),
        "up_proj" => Some((gate_up, e, m.expert_intermediate)),
        "down_proj" => Some((down, e, 0)),
        _ => None,
    }
}

/// A module's source tensor: name (`….weight`), dtype, shape, raw bytes.
pub type SourceModule<'a> = (String, safetensors::Dtype, Vec<usize>, &'a [u8]);

/// Module `spec` of `layer` as it is stored in the source: `(tensor, dtype, shape, raw bytes)` for a
/// per-module `.weight`, or the expert's rows of a fused tensor. `None` for a tied module.
pub fn source_module_bytes<'a>(
    store: &'a TensorStore,
    cfg: &ModelConfig,
    layer: usize,
    spec: &ModuleSpec,
) -> Result<Option<SourceModule<'a>>> {
    if spec.tied {
        return Ok(None);
    }
    let name = format!("{}{}.weight", cfg.layer_prefix(layer), spec.name);
    match fused_source(store, cfg, layer, spec) {
        Some((fused, e, row0)) => {
            let (bytes, cols) = store.raw_block(&fused, e, row0, spec.shape.0)?;
            Ok(Some((
                name,
                store.entry(&fused)?.dtype,
                vec![spec.shape.0, cols],
                bytes,
            )))
        }
        None => {
            let e = store.entry(&name)?;
            Ok(Some((
                name.clone(),
                e.dtype,
                e.shape.clone(),
                store.raw(&name)?,
            )))
        }
    }
}

/// Checks that module `spec` of `layer` exists in the source with the shape the config implies.
pub fn check_source_module(
    store: &TensorStore,
    cfg: &ModelConfig,
    layer: usize,
    spec: &ModuleSpec,
) -> Result<()> {
    if spec.tied || fused_source(store, cfg, layer, spec).is_some() {
        // Fused experts: checked as a whole by `check_fused_experts`.
        return Ok(());
    }
    let name = format!("{}{}", cfg.layer_prefix(layer), spec.name);
    let (rows, cols) = spec.shape;
    check_weight_shape(store, &name, rows, cols)
}

/// `{name}.weight` exists and is `rows × cols`; the error names the tensor and both shapes.
fn check_weight_shape(store: &TensorStore, name: &str, rows: usize, cols: usize) -> Result<()> {
    let e = store.entry(&format!("{name}.weight"))?;
    if e.shape != [rows, cols] {
        return Err(TensorError::Shape {
            name: format!("{name}.weight"),
            shape: e.shape.clone(),
            expected: vec![rows, cols],
        }
        .into());
    }
    Ok(())
}

/// Loads module `spec` of `layer` (a placeholder for a tied module, filled by [`LayerWeights::sync_tied`]).
fn load_module(
    store: &TensorStore,
    cfg: &ModelConfig,
    layer: usize,
    spec: &ModuleSpec,
    gq: Option<GptqReadConfig>,
) -> Result<Linear> {
    let (rows, cols) = spec.shape;
    if spec.tied {
        return Ok(Linear {
            w: Mat::zeros(rows, cols),
            b: None,
        });
    }
    let name = format!("{}{}", cfg.layer_prefix(layer), spec.name);
    if !store.contains(&format!("{name}.qweight")) {
        if let Some((fused, e, row0)) = fused_source(store, cfg, layer, spec) {
            let w = store.f32_block(&fused, e, row0, rows)?;
            if w.len() != rows.saturating_mul(cols) {
                return Err(TensorError::ExpertSize {
                    name: fused,
                    expert: e,
                    len: w.len(),
                    rows,
                    cols,
                }
                .into());
            }
            return Ok(Linear {
                w: mat_from_row_major(&w, rows, cols),
                b: None,
            });
        }
    }
    load_linear(store, &name, spec.shape, gq)
}

fn load_vec(store: &TensorStore, name: &str, len: usize) -> Result<Vec<f32>> {
    let v = store.f32(name)?;
    if v.len() != len {
        return Err(TensorError::Length {
            name: name.to_string(),
            len: v.len(),
            expected: len,
        }
        .into());
    }
    Ok(v)
}

pub fn load_layer(
    store: &TensorStore,
    cfg: &ModelConfig,
    layer: usize,
    gq: Option<GptqReadConfig>,
) -> Result<LayerWeights> {
    let p = cfg.layer_prefix(layer);
    let specs = layer_modules(cfg, layer);
    let attn = cfg.attn(layer);
    let mut loaded = Vec::with_capacity(specs.len());
    for s in &specs {
        loaded.push(load_module(store, cfg, layer, s, gq)?);
    }
    let h = cfg.hidden_size;
    let norm_of = |n: &str| -> Result<Vec<f32>> {
        Ok(cfg.norm_weight(load_vec(store, &format!("{p}{n}"), h)?))
    };
    let mixer = mixer_len(cfg, layer);
    let moe = match cfg.sparse_layer(layer) {
        None => None,
        Some(m) => Some(load_moe(store, cfg, layer, m, loaded.split_off(mixer))?),
    };
    let gdn = if cfg.is_linear_attention(layer) {
        Some(load_gdn(store, cfg, &p)?)
    } else {
        None
    };
    let head_norm = |n: &str| -> Result<Option<Vec<f32>>> {
        let name = format!("{p}{n}");
        if !store.contains(&name) {
            return Ok(None);
        }
        Ok(Some(cfg.norm_weight(load_vec(
            store,
            &name,
            attn.head_dim,
        )?)))
    };
    let (post_norm, attn_out_norm, mlp_out_norm) = match &cfg.gemma {
        Some(_) => (
            norm_of("pre_feedforward_layernorm.weight")?,
            Some(norm_of("post_attention_layernorm.weight")?),
            Some(norm_of("post_feedforward_layernorm.weight")?),
        ),
        None => (norm_of("post_attention_layernorm.weight")?, None, None),
    };
    let layer_scalar = match &cfg.gemma4 {
        Some(_) => layer_scalar(store, &p)?,
        None => None,
    };
    let mut lw = LayerWeights {
        linears: loaded,
        mixer,
        gdn,
        input_norm: norm_of("input_layernorm.weight")?,
        post_norm,
        q_norm: head_norm("self_attn.q_norm.weight")?,
        k_norm: head_norm("self_attn.k_norm.weight")?,
        moe,
        attn_out_norm,
        mlp_out_norm,
        sliding: cfg.gemma.as_ref().is_some_and(|g| {
            g.sliding_window.is_some() && g.sliding.get(layer).copied().unwrap_or(false)
        }),
        attn,
        v_norm: cfg.gemma4.is_some(),
        layer_scalar,
    };
    lw.sync_tied();
    Ok(lw)
}

/// Gemma 4's per-layer `layer_scalar` (one value; absent: transformers initialises it to 1, `None`).
fn layer_scalar(store: &TensorStore, p: &str) -> Result<Option<f32>> {
    let name = format!("{p}layer_scalar");
    if !store.contains(&name) {
        return Ok(None);
    }
    match store.f32(&name)? {
        v if v.len() == 1 => Ok(Some(v[0])),
        v => Err(TensorError::Count {
            name,
            len: v.len(),
            expected: 1,
        }
        .into()),
    }
}

/// A linear-attention layer's convolution, decay and gated-norm tensors (prefix `p`: the layer's).
fn load_gdn(store: &TensorStore, cfg: &ModelConfig, p: &str) -> Result<GdnWeights> {
    let Some(g) = &cfg.gdn else {
        return Err(NumericError::NotHybrid {
            layer_prefix: p.to_string(),
        }
        .into());
    };
    let conv_len = g
        .conv_dim
        .checked_mul(g.conv_kernel)
        .ok_or_else(|| ConfigError::TooLarge {
            field: "the linear-attention convolution".into(),
        })?;
    let conv_name = format!("{p}linear_attn.conv1d.weight");
    let conv = load_vec(store, &conv_name, conv_len)?;
    let nv = g.num_v_heads;
    let neg_a = load_vec(store, &format!("{p}linear_attn.A_log"), nv)?
        .into_iter()
        .map(|a| -a.exp())
        .collect();
    Ok(GdnWeights {
        conv,
        dt_bias: load_vec(store, &format!("{p}linear_attn.dt_bias"), nv)?,
        neg_a,
        norm: load_vec(store, &format!("{p}linear_attn.norm.weight"), g.head_v_dim)?,
    })
}

/// The sparse MLP of `layer`: the routed experts (and the shared one) from `experts`, the modules
/// after attention in [`layer_modules`] order, the router, the shared expert's gate, Gemma 4's extras.
fn load_moe(
    store: &TensorStore,
    cfg: &ModelConfig,
    layer: usize,
    m: &MoeConfig,
    experts_in: Vec<Linear>,
) -> Result<MoeWeights> {
    let p = cfg.layer_prefix(layer);
    let base = format!("{p}{}", m.spec.style.base());
    let mut rest = experts_in.into_iter();
    let mut next = || -> Result<Linear> {
        rest.next()
            .ok_or_else(|| NumericError::ExpertListShort { layer }.into())
    };
    let mut experts = Vec::with_capacity(m.num_experts);
    for _ in 0..m
        .num_experts
        .saturating_add(usize::from(m.shared_intermediate.is_some()))
    {
        experts.push(Mlp {
            gate: next()?,
            up: next()?,
            down: next()?,
        });
    }
    let shared = if m.shared_intermediate.is_some() {
        experts.pop()
    } else {
        None
    };
    let shared_gate_name = format!("{base}shared_expert_gate");
    let shared_gate = if store.contains(&format!("{shared_gate_name}.weight")) {
        Some(load_linear(
            store,
            &shared_gate_name,
            (1, cfg.hidden_size),
            None,
        )?)
    } else {
        None
    };
    let gemma4 = match m.spec.style {
        MoeStyle::Gemma4 => Some(load_gemma4_moe(store, cfg, &p, m)?),
        _ => None,
    };
    Ok(MoeWeights {
        router: load_linear(
            store,
            &format!("{p}{}", m.spec.style.router_name()),
            (m.num_experts, cfg.hidden_size),
            None,
        )?,
        experts,
        shared,
        shared_gate,
        gemma4,
    })
}

/// Gemma 4's router scales and the norms around its experts and dense unit.
fn load_gemma4_moe(
    store: &TensorStore,
    cfg: &ModelConfig,
    p: &str,
    m: &MoeConfig,
) -> Result<Gemma4Moe> {
    let h = cfg.hidden_size;
    let norm_of = |n: &str| -> Result<Vec<f32>> {
        Ok(cfg.norm_weight(load_vec(store, &format!("{p}{n}"), h)?))
    };
    // The router normalises its input itself and multiplies it by `scale / sqrt(hidden)`.
    let inv_sqrt = 1.0 / (h as f32).sqrt();
    let scale = load_vec(store, &format!("{p}router.scale"), h)?
        .into_iter()
        .map(|v| v * inv_sqrt)
        .collect();
    Ok(Gemma4Moe {
        router_scale: scale,
        per_expert_scale: load_vec(store, &format!("{p}router.per_expert_scale"), m.num_experts)?,
        shared_out_norm: norm_of("post_feedforward_layernorm_1.weight")?,
        experts_in_norm: norm_of("pre_feedforward_layernorm_2.weight")?,
        experts_out_norm: norm_of("post_feedforward_layernorm_2.weight")?,
    })
}
