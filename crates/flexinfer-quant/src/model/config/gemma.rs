//! What the Gemma 2 / 3 / 4 (text) configs add to the Llama shape.

use super::{layer_types, one_full_layer_in_every, AttnShape, MAX_HEAD_DIM};
use crate::error::{ConfigError, Result};
use serde_json::Value;

/// What Gemma 2 / Gemma 3 (text) do differently from Llama: norms scale by `1 + w`, the embeddings are
/// multiplied by `sqrt(hidden_size)`, GELU-tanh MLPs, an RMSNorm on the attention output and on the MLP output
/// (`post_attention_layernorm`, `post_feedforward_layernorm`; `pre_feedforward_layernorm` is the MLP input norm),
/// attention scaled by `query_pre_attn_scalar^-1/2`, optional tanh soft-capping of attention scores and logits,
/// sliding-window (local) layers, and (Gemma 3) a separate rope base for the local layers.
///
/// Gemma 4 ([`Gemma4Config`]) keeps the four norms per layer but multiplies by `w` itself, normalises q and k per
/// head (and v, without a weight), scores with scale 1, and gives its global layers a wider head, their own kv
/// head count and a partial ("proportional") rope.
#[derive(Clone, Debug)]
pub struct GemmaConfig {
    pub query_pre_attn_scalar: f32,
    /// Multiplier of the attention scores: `query_pre_attn_scalar^-1/2` (Gemma 2/3), 1 (Gemma 4).
    pub attn_scale: f32,
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    pub sliding_window: Option<usize>,
    /// Per layer: sliding-window attention.
    pub sliding: Vec<bool>,
    /// Rope base of the local layers when it differs from the global one (Gemma 3; no scaling there).
    pub local_rope_theta: Option<f32>,
}

pub(super) fn gemma_config(
    raw: &Value,
    arch: &str,
    num_layers: usize,
    head_dim: usize,
    rope_by_type: bool,
) -> Result<Option<GemmaConfig>> {
    let (gemma3, gemma4) = match arch {
        "Gemma2ForCausalLM" => (false, false),
        "Gemma3ForCausalLM" => (true, false),
        "Gemma4ForCausalLM" | "Gemma4ForConditionalGeneration" => (false, true),
        _ => return Ok(None),
    };
    let opt_f32 = |k: &str| raw.get(k).and_then(Value::as_f64).map(|v| v as f32);
    let sliding = match layer_types(raw, num_layers, "sliding_attention")? {
        Some(l) => l,
        // Before `layer_types`: Gemma 2 alternates local / global from layer 0; Gemma 3 (and Gemma 4, which has
        // no such field) has one global layer in every `sliding_window_pattern` (6).
        None if gemma3 || gemma4 => {
            let pattern = raw
                .get("sliding_window_pattern")
                .or_else(|| raw.get("_sliding_window_pattern"))
                .and_then(Value::as_u64)
                .unwrap_or(6)
                .max(1) as usize;
            one_full_layer_in_every(pattern, num_layers)
        }
        None => (0..num_layers).map(|l| l.is_multiple_of(2)).collect(),
    };
    let local_rope_theta = if !gemma3 && !gemma4 {
        None
    } else if rope_by_type {
        raw.get("rope_parameters")
            .and_then(|r| r.get("sliding_attention"))
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .map(|v| v as f32)
            .or(Some(10000.0))
    } else {
        Some(opt_f32("rope_local_base_freq").unwrap_or(10000.0))
    };
    let mut sliding = sliding;
    if gemma4 {
        // transformers forces the last Gemma 4 layer to global attention whatever `layer_types` says.
        if let Some(last) = sliding.last_mut() {
            *last = false;
        }
    }
    let softcap = |k: &str| opt_f32(k).filter(|v| *v > 0.0 && v.is_finite());
    let query_pre_attn_scalar = opt_f32("query_pre_attn_scalar")
        .filter(|v| *v > 0.0 && v.is_finite())
        .unwrap_or(head_dim as f32);
    Ok(Some(GemmaConfig {
        query_pre_attn_scalar,
        attn_scale: if gemma4 {
            1.0
        } else {
            1.0 / query_pre_attn_scalar.sqrt()
        },
        attn_softcap: softcap("attn_logit_softcapping"),
        final_softcap: softcap("final_logit_softcapping"),
        sliding_window: raw
            .get("sliding_window")
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            // Absent: transformers' Gemma 4 default.
            .or(if gemma4 { Some(512) } else { None })
            .filter(|&v| v > 0),
        sliding,
        local_rope_theta,
    }))
}

/// Gemma 4 (text) specifics beyond [`GemmaConfig`].
#[derive(Clone, Debug)]
pub struct Gemma4Config {
    /// Rope of the global layers: base, the fraction of each head's dimension pairs that rotate
    /// (`partial_rotary_factor`; the rest keep their values), and the frequency divisor (`factor`).
    pub global_rope_theta: f32,
    pub global_rotary_fraction: f32,
    pub global_rope_factor: f32,
}

fn text_field_usize(raw: &Value, key: &str) -> Result<Option<usize>> {
    field_usize(raw, key, || key.to_string())
}

/// `raw[key]` as a non-negative integer (none when absent); `field` names it in the error.
fn field_usize(raw: &Value, key: &str, field: impl FnOnce() -> String) -> Result<Option<usize>> {
    match raw.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
            ConfigError::WrongType {
                field: field(),
                expected: "a non-negative integer",
                found: Some(v.clone()),
            }
            .into()
        }),
    }
}

/// The Gemma 4 parts of a (text) config: refuses what the forward does not implement, naming the field, and
/// returns the per-layer attention shapes.
pub(super) fn gemma4_config(
    raw: &Value,
    num_layers: usize,
    base: AttnShape,
    sliding: &[bool],
) -> Result<(Gemma4Config, Vec<AttnShape>)> {
    refuse_unsupported(raw)?;
    let k_eq_v = raw
        .get("attention_k_eq_v")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let shapes = layer_shapes(raw, num_layers, base, sliding, k_eq_v)?;
    let cfg = global_rope(raw)?;
    Ok((cfg, shapes))
}

/// Per layer: the attention shape, and the Gemma 4 config (`is_gemma4` with a Gemma config `gemma`; then
/// [`gemma4_config`] reads them); `base` on every layer otherwise.
pub(super) fn attention_shapes(
    text: &Value,
    num_layers: usize,
    base: AttnShape,
    gemma: Option<&GemmaConfig>,
    is_gemma4: bool,
) -> Result<(Option<Gemma4Config>, Vec<AttnShape>)> {
    match gemma {
        Some(g) if is_gemma4 => {
            let (g4, shapes) = gemma4_config(text, num_layers, base, &g.sliding)?;
            Ok((Some(g4), shapes))
        }
        _ => Ok((None, vec![base; num_layers])),
    }
}

/// What the calibration forward does not implement: shared key/value layers, per-layer input
/// embeddings, bidirectional attention, another activation.
fn refuse_unsupported(raw: &Value) -> Result<()> {
    // Absent fields take transformers' Gemma4TextConfig defaults (per-layer inputs of 256 are on by default).
    for (key, what, default) in [
        (
            "num_kv_shared_layers",
            "layers reusing an earlier layer's keys and values",
            0,
        ),
        (
            "hidden_size_per_layer_input",
            "per-layer input embeddings (PLE)",
            256,
        ),
    ] {
        if let Some(n) = Some(text_field_usize(raw, key)?.unwrap_or(default)).filter(|&n| n > 0) {
            return Err(ConfigError::UnsupportedFeature {
                field: key.to_string(),
                value: n.to_string(),
                feature: format!("{what}, Gemma 4 E2B/E4B"),
            }
            .into());
        }
    }
    if let Some(b) = raw
        .get("use_bidirectional_attention")
        .and_then(Value::as_str)
    {
        if b == "all" {
            return Err(ConfigError::UnsupportedFeature {
                field: "use_bidirectional_attention".into(),
                value: format!("{b:?}"),
                feature: "non-causal attention".into(),
            }
            .into());
        }
    }
    if let Some(act) = raw.get("hidden_activation").and_then(Value::as_str) {
        if act != "gelu_pytorch_tanh" {
            return Err(ConfigError::Unsupported {
                field: "hidden_activation".into(),
                value: format!("{act:?}"),
                model: Some("Gemma 4".into()),
                supported: "gelu_pytorch_tanh",
            }
            .into());
        }
    }
    Ok(())
}

/// The attention shape of every layer: the base shape on sliding layers, the global shape (from
/// `per_layer_config`, or `global_head_dim` and `num_global_key_value_heads`) on the others; each
/// kind shares one head dimension.
fn layer_shapes(
    raw: &Value,
    num_layers: usize,
    base: AttnShape,
    sliding: &[bool],
    k_eq_v: bool,
) -> Result<Vec<AttnShape>> {
    // The global layers' shape: transformers writes `per_layer_config` (layer index → head_dim /
    // num_key_value_heads); the hub configs give `global_head_dim` (default 512) and, when keys are
    // values, `num_global_key_value_heads`.
    let per_layer = raw.get("per_layer_config").and_then(Value::as_object);
    let global_head_dim = text_field_usize(raw, "global_head_dim")?.unwrap_or(512);
    let global_kv = if k_eq_v {
        text_field_usize(raw, "num_global_key_value_heads")?
    } else {
        None
    };
    let mut shapes = Vec::with_capacity(num_layers);
    for (l, &is_sliding) in sliding.iter().enumerate().take(num_layers) {
        let mut s = base;
        match per_layer {
            Some(map) => {
                if let Some(o) = map.get(&l.to_string()) {
                    let field = |k: &str| -> Result<Option<usize>> {
                        field_usize(o, k, || format!("per_layer_config.{l}.{k}"))
                    };
                    if let Some(d) = field("head_dim")? {
                        s.head_dim = d;
                    }
                    if let Some(k) = field("num_key_value_heads")? {
                        s.kv_heads = k;
                    }
                }
            }
            None if !is_sliding => {
                s.head_dim = global_head_dim;
                if let Some(k) = global_kv {
                    s.kv_heads = k;
                }
            }
            None => {}
        }
        s.v_from_k = k_eq_v && !is_sliding;
        if s.kv_heads == 0
            || !s.heads.is_multiple_of(s.kv_heads)
            || s.head_dim == 0
            || !s.head_dim.is_multiple_of(2)
            || s.head_dim > MAX_HEAD_DIM
            || s.heads.checked_mul(s.head_dim).is_none()
        {
            return Err(ConfigError::AttentionShape {
                layer: Some(l),
                heads: s.heads,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
            }
            .into());
        }
        shapes.push(s);
    }
    check_one_head_dim_per_kind(&shapes, sliding)?;
    Ok(shapes)
}

/// Global layers share one head dimension, and so do the sliding ones: the rope tables are per attention type.
fn check_one_head_dim_per_kind(shapes: &[AttnShape], sliding: &[bool]) -> Result<()> {
    let global_dims: Vec<usize> = shapes
        .iter()
        .zip(sliding)
        .filter(|(_, s)| !**s)
        .map(|(a, _)| a.head_dim)
        .collect();
    let local_dims: Vec<usize> = shapes
        .iter()
        .zip(sliding)
        .filter(|(_, s)| **s)
        .map(|(a, _)| a.head_dim)
        .collect();
    for (what, dims) in [("global", &global_dims), ("sliding", &local_dims)] {
        if dims.windows(2).any(|w| w[0] != w[1]) {
            return Err(ConfigError::MixedHeadDims {
                kind: what,
                dims: dims.clone(),
            }
            .into());
        }
    }
    Ok(())
}

/// The rope of the global layers (the sliding layers' must be the default one).
fn global_rope(raw: &Value) -> Result<Gemma4Config> {
    // Without `rope_parameters`: transformers' defaults (sliding: default rope, base 10 000; global:
    // proportional, a quarter of the pairs rotating, base 1 000 000).
    let defaults = serde_json::json!({
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    });
    let params = raw
        .get("rope_parameters")
        .filter(|r| r.is_object())
        .unwrap_or(&defaults);
    let rope = |t: &str| params.get(t);
    let rope_type = |t: &str| {
        rope(t)
            .and_then(|r| r.get("rope_type"))
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string()
    };
    let local_type = rope_type("sliding_attention");
    if local_type != "default" {
        return Err(ConfigError::Unsupported {
            field: "rope_parameters.sliding_attention.rope_type".into(),
            value: format!("{local_type:?}"),
            model: None,
            supported: "default",
        }
        .into());
    }
    let global_type = rope_type("full_attention");
    let g = rope("full_attention");
    let gf = |k: &str, d: f32| {
        g.and_then(|r| r.get(k))
            .and_then(Value::as_f64)
            .map_or(d, |v| v as f32)
    };
    let cfg = match global_type.as_str() {
        "proportional" => Gemma4Config {
            global_rope_theta: gf("rope_theta", 1_000_000.0),
            global_rotary_fraction: gf("partial_rotary_factor", 1.0),
            global_rope_factor: gf("factor", 1.0),
        },
        "default" => Gemma4Config {
            global_rope_theta: gf("rope_theta", 10000.0),
            global_rotary_fraction: 1.0,
            global_rope_factor: 1.0,
        },
        other => {
            return Err(ConfigError::Unsupported {
                field: "rope_parameters.full_attention.rope_type".into(),
                value: format!("{other:?}"),
                model: None,
                supported: "proportional, default",
            }
            .into())
        }
    };
    let ok = |v: f32| v.is_finite() && v > 0.0;
    if !ok(cfg.global_rope_theta)
        || !ok(cfg.global_rope_factor)
        || !(0.0..=1.0).contains(&cfg.global_rotary_fraction)
    {
        return Err(ConfigError::Invalid {
            field: "rope_parameters.full_attention".into(),
            value: format!("{g:?}"),
        }
        .into());
    }
    Ok(cfg)
}
