//! The quantizable modules of a decoder layer in true-sequential order, their shapes and which of them
//! share an input: the plan every quantize run and every artifact check follows (loading them is
//! [`super::weights`]).
// Sizes and head counts come from untrusted model files: overflow must saturate, never wrap or panic.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

use super::config::{GdnLayout, ModelConfig};
use crate::model::moe::MoeStyle;

/// One quantizable linear of a decoder layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleSpec {
    /// Block-relative name (`self_attn.q_proj`, `mlp.experts.3.down_proj`).
    pub name: String,
    /// `[out, in]`.
    pub shape: (usize, usize),
    /// Not a tensor of its own: the same weights as another module of the layer (Gemma 4 `attention_k_eq_v`:
    /// `self_attn.v_proj` is `self_attn.k_proj`). Never quantized, checked or written.
    pub tied: bool,
}

/// The linear-attention modules of a gated delta-net layer, in forward order (the input projections, then
/// `out_proj`), with their `[out, in]` shapes.
pub fn gdn_modules(cfg: &ModelConfig) -> Vec<(&'static str, (usize, usize))> {
    let Some(g) = &cfg.gdn else {
        return Vec::new();
    };
    let h = cfg.hidden_size;
    let out = ("linear_attn.out_proj", (h, g.value_dim));
    match g.layout {
        GdnLayout::Fused => vec![
            (
                "linear_attn.in_proj_qkvz",
                (g.conv_dim.saturating_add(g.value_dim), h),
            ),
            (
                "linear_attn.in_proj_ba",
                (g.num_v_heads.saturating_mul(2), h),
            ),
            out,
        ],
        GdnLayout::Split => vec![
            ("linear_attn.in_proj_qkv", (g.conv_dim, h)),
            ("linear_attn.in_proj_z", (g.value_dim, h)),
            ("linear_attn.in_proj_b", (g.num_v_heads, h)),
            ("linear_attn.in_proj_a", (g.num_v_heads, h)),
            out,
        ],
    }
}

/// How many of `layer`'s modules belong to its token mixer (attention: q, k, v, o; linear attention: its input
/// projections and `out_proj`); the MLP's follow them.
pub fn mixer_len(cfg: &ModelConfig, layer: usize) -> usize {
    if cfg.is_linear_attention(layer) {
        gdn_modules(cfg).len()
    } else {
        4
    }
}

/// Module indices of `layer` that share an input (one Hessian each), in forward order: the token mixer's input
/// projections, its output projection, the dense MLP's gate/up, its down (cf. [`INPUT_GROUPS`]).
pub fn input_groups(cfg: &ModelConfig, layer: usize) -> [Vec<usize>; 4] {
    let n = mixer_len(cfg, layer);
    [
        (0..n.saturating_sub(1)).collect(),
        vec![n.saturating_sub(1)],
        vec![n, n.saturating_add(1)],
        vec![n.saturating_add(2)],
    ]
}

/// The linears of `layer` in true-sequential order: q, k, v, o (or a linear-attention layer's projections, see
/// [`gdn_modules`]), then the dense MLP's gate, up, down, or each routed expert's gate, up, down and the shared
/// expert's (Gemma 4: the dense MLP beside the experts, named `mlp.*`). Routers and the shared expert's gate are
/// not among them (never quantized). Index `i` of this list is [`LayerWeights::module`] `i`.
pub fn layer_modules(cfg: &ModelConfig, layer: usize) -> Vec<ModuleSpec> {
    let a = cfg.attn(layer);
    let mut out: Vec<ModuleSpec> = if cfg.is_linear_attention(layer) {
        gdn_modules(cfg)
            .into_iter()
            .map(|(name, shape)| ModuleSpec {
                name: name.to_string(),
                shape,
                tied: false,
            })
            .collect()
    } else {
        (0..4)
            .map(|i| ModuleSpec {
                name: LINEARS[i].to_string(),
                shape: linear_shape(cfg, layer, i),
                tied: i == 2 && a.v_from_k,
            })
            .collect()
    };
    let h = cfg.hidden_size;
    let spec = |name: String, shape: (usize, usize)| ModuleSpec {
        name,
        shape,
        tied: false,
    };
    match cfg.sparse_layer(layer) {
        None => {
            out.extend((4..7).map(|i| spec(LINEARS[i].to_string(), linear_shape(cfg, layer, i))))
        }
        Some(m) => {
            let base = m.spec.style.base();
            let [g, u, d] = m.spec.style.expert_names();
            for e in 0..m.num_experts {
                let stem = format!("{base}experts.{e}.");
                let inter = m.expert_intermediate;
                out.push(spec(format!("{stem}{g}"), (inter, h)));
                out.push(spec(format!("{stem}{u}"), (inter, h)));
                out.push(spec(format!("{stem}{d}"), (h, inter)));
            }
            if let Some(si) = m.shared_intermediate {
                let stem = m.spec.style.shared_prefix();
                let [g, u, d] = MoeStyle::Qwen.expert_names();
                for (n, shape) in [(g, (si, h)), (u, (si, h)), (d, (h, si))] {
                    out.push(spec(format!("{stem}{n}"), shape));
                }
            }
        }
    }
    out
}

/// The seven linears of a Llama decoder layer, in the order they are quantized (true sequential).
pub const LINEARS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// Modules that share an input (one Hessian each), in forward order.
pub const INPUT_GROUPS: [&[usize]; 4] = [&[0, 1, 2], &[3], &[4, 5], &[6]];

/// Expected `[out, in]` of each of the seven dense linears of `layer`.
pub fn linear_shape(cfg: &ModelConfig, layer: usize, idx: usize) -> (usize, usize) {
    let h = cfg.hidden_size;
    let a = cfg.attn(layer);
    let (q, kv) = (
        a.heads.saturating_mul(a.head_dim),
        a.kv_heads.saturating_mul(a.head_dim),
    );
    match idx {
        0 if a.output_gate => (q.saturating_mul(2), h),
        0 => (q, h),
        1 | 2 => (kv, h),
        3 => (h, q),
        4 | 5 => (cfg.intermediate_size, h),
        _ => (h, cfg.intermediate_size),
    }
}
