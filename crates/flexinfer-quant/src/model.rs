//! `config.json` of the supported Llama-family architectures and loading one decoder layer's weights
//! (from a source checkpoint, or dequantized from a `gptq` checkpoint with the consumer's rules).

use crate::error::{QuantError, Result};
use crate::moe::{Activation, Gemma4Moe, Mlp, MoeSpec, MoeStyle, MoeWeights};
use crate::pack::{dequantize_packed, PackedLinear, ZeroFormat};
use crate::tensors::TensorStore;
use faer::Mat;
use serde_json::Value;
use std::path::Path;

/// Architectures whose decoder is Llama-shaped (Qwen3 adds q/k RMSNorm; Qwen2 adds q/k/v bias), dense or
/// with a sparse-MoE MLP ([`crate::moe`]).
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
];

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

fn gemma_config(
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
    let sliding = match raw.get("layer_types").and_then(Value::as_array) {
        Some(a) => {
            if a.len() != num_layers {
                return Err(QuantError::Input(format!(
                    "config.json: layer_types has {} entries, num_hidden_layers is {num_layers}",
                    a.len()
                )));
            }
            a.iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    other => Err(QuantError::Input(format!(
                        "config.json: layer_types entry {other:?} is not sliding_attention or full_attention"
                    ))),
                })
                .collect::<Result<Vec<bool>>>()?
        }
        // Before `layer_types`: Gemma 2 alternates local / global from layer 0; Gemma 3 (and Gemma 4, which has
        // no such field) has one global layer in every `sliding_window_pattern` (6).
        None if gemma3 || gemma4 => {
            let pattern = raw
                .get("sliding_window_pattern")
                .or_else(|| raw.get("_sliding_window_pattern"))
                .and_then(Value::as_u64)
                .unwrap_or(6)
                .max(1) as usize;
            (0..num_layers)
                .map(|l| !(l + 1).is_multiple_of(pattern))
                .collect()
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

/// Query / key / value shape of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The values are the keys' projection (Gemma 4 `attention_k_eq_v` on global layers): no `v_proj` tensor.
    pub v_from_k: bool,
}

fn text_field_usize(raw: &Value, key: &str) -> Result<Option<usize>> {
    match raw.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
            QuantError::Input(format!(
                "config.json: {key} must be a non-negative integer, found {v}"
            ))
        }),
    }
}

/// The Gemma 4 parts of a (text) config: refuses what the forward does not implement, naming the field, and
/// returns the per-layer attention shapes.
fn gemma4_config(
    raw: &Value,
    num_layers: usize,
    base: AttnShape,
    sliding: &[bool],
) -> Result<(Gemma4Config, Vec<AttnShape>)> {
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
            return Err(QuantError::Input(format!(
                "config.json: {key} {n} ({what}, Gemma 4 E2B/E4B) is not supported by the calibration forward"
            )));
        }
    }
    if let Some(b) = raw
        .get("use_bidirectional_attention")
        .and_then(Value::as_str)
    {
        if b == "all" {
            return Err(QuantError::Input(
                "config.json: use_bidirectional_attention \"all\" (non-causal attention) is not supported".into(),
            ));
        }
    }
    if let Some(act) = raw.get("hidden_activation").and_then(Value::as_str) {
        if act != "gelu_pytorch_tanh" {
            return Err(QuantError::Input(format!(
                "config.json: hidden_activation {act:?} is not supported for Gemma 4 (gelu_pytorch_tanh)"
            )));
        }
    }
    let k_eq_v = raw
        .get("attention_k_eq_v")
        .and_then(Value::as_bool)
        .unwrap_or(false);
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
                        text_field_usize(o, k).map_err(|_| {
                            QuantError::Input(format!(
                                "config.json: per_layer_config.{l}.{k} must be a non-negative integer"
                            ))
                        })
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
            return Err(QuantError::Input(format!(
                "config.json: layer {l}: inconsistent attention shape (heads {}, kv heads {}, head_dim {})",
                s.heads, s.kv_heads, s.head_dim
            )));
        }
        shapes.push(s);
    }
    // Global layers that share one shape, and local ones: the rope tables are per attention type.
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
            return Err(QuantError::Input(format!(
                "config.json: the {what} layers have different head_dim values {dims:?}"
            )));
        }
    }
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
        return Err(QuantError::Input(format!(
            "config.json: rope_parameters.sliding_attention.rope_type {local_type:?} is not supported (default)"
        )));
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
            return Err(QuantError::Input(format!(
                "config.json: rope_parameters.full_attention.rope_type {other:?} is not supported \
                 (proportional, default)"
            )))
        }
    };
    let ok = |v: f32| v.is_finite() && v > 0.0;
    if !ok(cfg.global_rope_theta)
        || !ok(cfg.global_rope_factor)
        || !(0.0..=1.0).contains(&cfg.global_rotary_fraction)
    {
        return Err(QuantError::Input(format!(
            "config.json: rope_parameters.full_attention {:?} is out of range",
            g
        )));
    }
    Ok((cfg, shapes))
}

/// Largest attention head dimension accepted from a `config.json` (published models use up to 512).
pub const MAX_HEAD_DIM: usize = 1 << 16;

/// Largest decoder layer count accepted from a `config.json` (published models have at most a few hundred).
pub const MAX_LAYERS: usize = 4096;

/// Largest expert count accepted from a `config.json` (the largest published models have a few hundred).
pub const MAX_EXPERTS: usize = 4096;

/// The sparse-MoE part of a config.
#[derive(Clone, Debug)]
pub struct MoeConfig {
    pub spec: MoeSpec,
    pub num_experts: usize,
    /// Inner width of each routed expert.
    pub expert_intermediate: usize,
    /// Inner width of the always-on shared expert (Qwen2-MoE), if there is one.
    pub shared_intermediate: Option<usize>,
    /// Per layer: whether it has the sparse MLP (the others have a dense one of `intermediate_size`).
    pub sparse: Vec<bool>,
}

fn moe_config(raw: &Value, arch: &str, num_layers: usize) -> Result<Option<MoeConfig>> {
    let style = match arch {
        "MixtralForCausalLM" => MoeStyle::Mixtral,
        "Qwen2MoeForCausalLM" | "Qwen3MoeForCausalLM" => MoeStyle::Qwen,
        "Gemma4ForCausalLM" | "Gemma4ForConditionalGeneration" => {
            return gemma4_moe_config(raw, num_layers)
        }
        _ => return Ok(None),
    };
    let (experts_key, inter_key) = match style {
        MoeStyle::Mixtral => ("num_local_experts", "intermediate_size"),
        _ => ("num_experts", "moe_intermediate_size"),
    };
    // transformers 5 writes Qwen3-MoE's count as `num_local_experts`; the hub checkpoints as `num_experts`.
    let alias = match style {
        MoeStyle::Mixtral => "num_experts",
        _ => "num_local_experts",
    };
    let experts_key = if raw.get(experts_key).is_none() && raw.get(alias).is_some() {
        alias
    } else {
        experts_key
    };
    let num_experts = get_usize(raw, experts_key)?;
    let top_k = get_usize(raw, "num_experts_per_tok")?;
    if num_experts == 0 || num_experts > MAX_EXPERTS || top_k == 0 || top_k > num_experts {
        return Err(QuantError::Input(format!(
            "config.json: {experts_key} {num_experts} / num_experts_per_tok {top_k} is not a valid routing \
             (1 ≤ top-k ≤ experts ≤ {MAX_EXPERTS})"
        )));
    }
    let expert_intermediate = get_usize(raw, inter_key)?;
    // transformers: Mixtral always renormalises the top-k weights; the Qwen MoE blocks only with norm_topk_prob.
    let renormalize = match style {
        MoeStyle::Mixtral | MoeStyle::Gemma4 => true,
        MoeStyle::Qwen => raw
            .get("norm_topk_prob")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    };
    let shared_intermediate = match arch {
        "Qwen2MoeForCausalLM" => Some(get_usize(raw, "shared_expert_intermediate_size")?),
        _ => None,
    }
    .filter(|&i| i > 0);
    let step = raw
        .get("decoder_sparse_step")
        .and_then(Value::as_u64)
        .unwrap_or(1)
        .max(1) as usize;
    let mlp_only: Vec<usize> = raw
        .get("mlp_only_layers")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|v| v as usize)
                .collect()
        })
        .unwrap_or_default();
    let sparse = (0..num_layers)
        .map(|l| match style {
            MoeStyle::Qwen => !mlp_only.contains(&l) && (l + 1).is_multiple_of(step),
            _ => true,
        })
        .collect();
    Ok(Some(MoeConfig {
        spec: MoeSpec {
            style,
            top_k,
            renormalize,
            act: Activation::Silu,
        },
        num_experts,
        expert_intermediate,
        shared_intermediate,
        sparse,
    }))
}

/// Gemma 4 with `enable_moe_block`: every layer has the routed experts (`num_experts`, `top_k_experts`,
/// `moe_intermediate_size`, renormalised top-k) beside its dense MLP of `intermediate_size`, which is kept as the
/// layer's always-on unit ([`MoeConfig::shared_intermediate`], ungated).
fn gemma4_moe_config(raw: &Value, num_layers: usize) -> Result<Option<MoeConfig>> {
    if !raw
        .get("enable_moe_block")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        return Ok(None);
    }
    let num_experts = get_usize(raw, "num_experts")?;
    let top_k = get_usize(raw, "top_k_experts")?;
    if num_experts == 0 || num_experts > MAX_EXPERTS || top_k == 0 || top_k > num_experts {
        return Err(QuantError::Input(format!(
            "config.json: num_experts {num_experts} / top_k_experts {top_k} is not a valid routing \
             (1 ≤ top-k ≤ experts ≤ {MAX_EXPERTS})"
        )));
    }
    Ok(Some(MoeConfig {
        spec: MoeSpec {
            style: MoeStyle::Gemma4,
            top_k,
            renormalize: true,
            act: Activation::GeluTanh,
        },
        num_experts,
        expert_intermediate: get_usize(raw, "moe_intermediate_size")?,
        shared_intermediate: Some(get_usize(raw, "intermediate_size")?),
        sparse: vec![true; num_layers],
    }))
}

/// Gated delta-net hybrids: some layers use linear attention (`layer_types` names `linear_attention`).
fn is_hybrid(raw: &Value) -> bool {
    let model_type = raw.get("model_type").and_then(Value::as_str).unwrap_or("");
    let text = raw.get("text_config").unwrap_or(raw);
    model_type.starts_with("qwen3_next")
        || model_type.starts_with("qwen3_5")
        || text
            .get("layer_types")
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|t| t.as_str() == Some("linear_attention")))
}

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f32,
    },
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub architecture: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    /// `config.json`'s `model_type`.
    pub model_type: String,
    /// Linear-attention layers beside full attention (see [`crate::exclusion`]).
    pub hybrid: bool,
    pub moe: Option<MoeConfig>,
    /// Gemma 2 / Gemma 3 / Gemma 4 text specifics.
    pub gemma: Option<GemmaConfig>,
    /// Gemma 4 specifics (then `gemma` is set too).
    pub gemma4: Option<Gemma4Config>,
    /// Per layer: the attention shape (the same for every layer but on Gemma 4's global layers).
    pub layer_attn: Vec<AttnShape>,
    /// Where the text stack's tensors are: `model.`, or `model.language_model.` in a multimodal checkpoint.
    pub text_prefix: String,
    /// The parsed config.json, kept to write it back with `quantization_config`.
    pub raw: Value,
}

fn get_usize(v: &Value, key: &str) -> Result<usize> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| {
            QuantError::Input(format!(
                "config.json: missing or invalid integer field {key:?}"
            ))
        })
}

fn get_f32(v: &Value, key: &str, default: f32) -> f32 {
    v.get(key)
        .and_then(Value::as_f64)
        .map(|x| x as f32)
        .unwrap_or(default)
}

impl ModelConfig {
    pub fn load(model_dir: &Path) -> Result<Self> {
        let path = model_dir.join("config.json");
        if path.symlink_metadata().is_err() {
            return Err(QuantError::Input(format!(
                "config.json not found in model directory {}",
                model_dir.display()
            )));
        }
        let raw = crate::fsutil::read_json_within(
            model_dir,
            "config.json",
            flexinfer_fsutil::limits::CONFIG_JSON,
        )?;
        Self::from_json(raw)
    }

    pub fn from_json(raw: Value) -> Result<Self> {
        let arch = raw
            .get("architectures")
            .and_then(|a| a.as_array())
            .and_then(|a| a.first())
            .and_then(|a| a.as_str())
            .unwrap_or("")
            .to_string();
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(QuantError::Input(format!(
                "unsupported architecture {arch:?} in config.json; supported: {}",
                SUPPORTED_ARCHITECTURES.join(", ")
            )));
        }
        // Multimodal Gemma 4: the text stack's fields are under `text_config`, its tensors under
        // `model.language_model.`; the vision / audio towers are not read (the writer copies them).
        let multimodal = arch == "Gemma4ForConditionalGeneration";
        let text_owned;
        let text: &Value = if multimodal {
            text_owned = raw
                .get("text_config")
                .filter(|t| t.is_object())
                .cloned()
                .ok_or_else(|| {
                    QuantError::Input(format!("config.json: {arch} has no text_config object"))
                })?;
            &text_owned
        } else {
            &raw
        };
        let text_prefix = if multimodal {
            "model.language_model."
        } else {
            "model."
        };
        let is_gemma4 = arch.starts_with("Gemma4");
        let hidden_size = get_usize(text, "hidden_size")?;
        let num_heads = get_usize(text, "num_attention_heads")?;
        let num_kv_heads = text
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .unwrap_or(num_heads);
        let head_dim = match text.get("head_dim").and_then(Value::as_u64) {
            Some(d) => d as usize,
            // transformers' Gemma4TextConfig default.
            None if is_gemma4 => 256,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        if num_heads == 0
            || num_kv_heads == 0
            || num_heads % num_kv_heads != 0
            || head_dim == 0
            || head_dim % 2 != 0
            || head_dim > MAX_HEAD_DIM
        {
            return Err(QuantError::Input(format!(
                "config.json: inconsistent attention shape (heads {num_heads}, kv heads {num_kv_heads}, head_dim {head_dim})"
            )));
        }
        // transformers 5 writes `rope_parameters` (`rope_theta` and the scaling in one object) in place of
        // `rope_theta` / `rope_scaling`.
        // Gemma 3 under transformers 5: one object per attention type; the global layers' is the model's rope.
        let rope_by_type = text
            .get("rope_parameters")
            .and_then(|v| v.get("full_attention"))
            .is_some();
        let rope_params = text
            .get("rope_parameters")
            .map(|v| v.get("full_attention").unwrap_or(v))
            .filter(|v| v.is_object());
        // Gemma 4's two ropes are read by `gemma4_config`.
        let rope_scaling = match text
            .get("rope_scaling")
            .filter(|v| !v.is_null())
            .or(rope_params)
            .filter(|_| !is_gemma4)
        {
            None | Some(Value::Null) => RopeScaling::None,
            Some(rs) => {
                let kind = rs
                    .get("rope_type")
                    .or_else(|| rs.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                match kind {
                    "default" => RopeScaling::None,
                    // Dynamic NTK only changes frequencies beyond the trained length; calibration stays inside it.
                    "dynamic" => RopeScaling::None,
                    "linear" => RopeScaling::Linear { factor: get_f32(rs, "factor", 1.0) },
                    "llama3" => RopeScaling::Llama3 {
                        factor: get_f32(rs, "factor", 8.0),
                        low_freq_factor: get_f32(rs, "low_freq_factor", 1.0),
                        high_freq_factor: get_f32(rs, "high_freq_factor", 4.0),
                        original_max_position_embeddings: get_f32(rs, "original_max_position_embeddings", 8192.0),
                    },
                    other => {
                        return Err(QuantError::Input(format!(
                            "config.json: rope_scaling type {other:?} is not supported (default, linear, dynamic, llama3)"
                        )))
                    }
                }
            }
        };
        let num_layers = get_usize(text, "num_hidden_layers")?;
        if num_layers > MAX_LAYERS {
            return Err(QuantError::Input(format!(
                "config.json: num_hidden_layers {num_layers} is larger than {MAX_LAYERS}"
            )));
        }
        let moe = moe_config(text, &arch, num_layers)?;
        let gemma = gemma_config(text, &arch, num_layers, head_dim, rope_by_type)?;
        let base_shape = AttnShape {
            heads: num_heads,
            kv_heads: num_kv_heads,
            head_dim,
            v_from_k: false,
        };
        let (gemma4, layer_attn) = match &gemma {
            Some(g) if is_gemma4 => {
                let (g4, shapes) = gemma4_config(text, num_layers, base_shape, &g.sliding)?;
                (Some(g4), shapes)
            }
            _ => (None, vec![base_shape; num_layers]),
        };
        let intermediate_size = match (&moe, text.get("intermediate_size")) {
            (Some(m), None) => m.expert_intermediate,
            _ => get_usize(text, "intermediate_size")?,
        };
        Ok(ModelConfig {
            architecture: arch,
            hidden_size,
            intermediate_size,
            num_layers,
            model_type: raw
                .get("model_type")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            hybrid: is_hybrid(&raw),
            moe,
            gemma,
            gemma4,
            layer_attn,
            text_prefix: text_prefix.to_string(),
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: get_f32(text, "rms_norm_eps", 1e-6),
            rope_theta: match (text.get("rope_theta"), rope_params) {
                (None, Some(rp)) => get_f32(rp, "rope_theta", 10000.0),
                _ => get_f32(text, "rope_theta", 10000.0),
            },
            rope_scaling,
            vocab_size: get_usize(text, "vocab_size")?,
            tie_word_embeddings: text
                .get("tie_word_embeddings")
                .or_else(|| raw.get("tie_word_embeddings"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
            raw,
        })
    }

    /// Inverse frequencies of the local (sliding-window) layers, when their rope differs (Gemma 3).
    pub fn local_inv_freq(&self) -> Option<Vec<f32>> {
        let theta = self.gemma.as_ref()?.local_rope_theta?;
        let d = self.local_head_dim();
        Some(base_inv_freq(theta, d))
    }

    /// Head dimension of the sliding-window layers (all layers but Gemma 4's global ones).
    fn local_head_dim(&self) -> usize {
        let sliding = |l: usize| {
            self.gemma
                .as_ref()
                .is_some_and(|g| g.sliding.get(l).copied().unwrap_or(false))
        };
        (0..self.num_layers)
            .find(|&l| sliding(l))
            .and_then(|l| self.layer_attn.get(l))
            .map_or(self.head_dim, |a| a.head_dim)
    }

    /// Head dimension of the global layers.
    fn global_head_dim(&self) -> usize {
        let global = |l: usize| {
            !self
                .gemma
                .as_ref()
                .is_some_and(|g| g.sliding.get(l).copied().unwrap_or(false))
        };
        (0..self.num_layers)
            .find(|&l| global(l))
            .and_then(|l| self.layer_attn.get(l))
            .map_or(self.head_dim, |a| a.head_dim)
    }

    /// The attention shape of `layer`.
    pub fn attn(&self, layer: usize) -> AttnShape {
        self.layer_attn.get(layer).copied().unwrap_or(AttnShape {
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            v_from_k: false,
        })
    }

    /// The token embedding table's tensor name.
    pub fn embed_name(&self) -> String {
        format!("{}embed_tokens.weight", self.text_prefix)
    }

    /// The final norm's tensor name.
    pub fn final_norm_name(&self) -> String {
        format!("{}norm.weight", self.text_prefix)
    }

    /// Norm weights as multiplied: `1 + w` for Gemma 2/3, `w` otherwise (Gemma 4 included).
    pub fn norm_weight(&self, mut w: Vec<f32>) -> Vec<f32> {
        if self.gemma.is_some() && self.gemma4.is_none() {
            w.iter_mut().for_each(|v| *v += 1.0);
        }
        w
    }

    /// Inverse frequencies after rope scaling (of the global layers where local and global differ).
    pub fn inv_freq(&self) -> Vec<f32> {
        if let Some(g4) = &self.gemma4 {
            // Proportional rope: the first `fraction × d/2` pairs rotate with the usual frequencies of a
            // d-dimensional head, the remaining pairs get frequency 0 (they pass unchanged).
            let d = self.global_head_dim();
            let rotated = ((g4.global_rotary_fraction as f64 * d as f64) / 2.0).floor() as usize;
            let base = base_inv_freq(g4.global_rope_theta, d);
            return base
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    if i < rotated {
                        f / g4.global_rope_factor
                    } else {
                        0.0
                    }
                })
                .collect();
        }
        let base = base_inv_freq(self.rope_theta, self.head_dim);
        match self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let low_wl = original_max_position_embeddings / low_freq_factor;
                let high_wl = original_max_position_embeddings / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wl = 2.0 * std::f32::consts::PI / f;
                        if wl < high_wl {
                            f
                        } else if wl > low_wl {
                            f / factor
                        } else {
                            let smooth = (original_max_position_embeddings / wl - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    pub fn layer_prefix(&self, layer: usize) -> String {
        format!("{}layers.{layer}.", self.text_prefix)
    }

    /// The MoE config when `layer` has a sparse MLP.
    pub fn sparse_layer(&self, layer: usize) -> Option<&MoeConfig> {
        self.moe
            .as_ref()
            .filter(|m| m.sparse.get(layer).copied().unwrap_or(false))
    }
}

fn base_inv_freq(theta: f32, d: usize) -> Vec<f32> {
    (0..d / 2)
        .map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / d as f64) as f32)
        .collect()
}

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

/// The linears of `layer` in true-sequential order: q, k, v, o, then the dense MLP's gate, up, down, or each
/// routed expert's gate, up, down and the shared expert's (Gemma 4: the dense MLP beside the experts, named
/// `mlp.*`). Routers are not among them (never quantized). Index `i` of this list is [`LayerWeights::module`] `i`.
pub fn layer_modules(cfg: &ModelConfig, layer: usize) -> Vec<ModuleSpec> {
    let a = cfg.attn(layer);
    let mut out: Vec<ModuleSpec> = (0..4)
        .map(|i| ModuleSpec {
            name: LINEARS[i].to_string(),
            shape: linear_shape(cfg, layer, i),
            tied: i == 2 && a.v_from_k,
        })
        .collect();
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

#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out, in]`.
    pub w: Mat<f32>,
    pub b: Option<Vec<f32>>,
}

/// One decoder layer in f32.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub linears: Vec<Linear>,
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
        match &self.moe {
            None => self.linears.get(i),
            Some(_) if i < 4 => self.linears.get(i),
            Some(m) => {
                let (e, j) = ((i - 4) / 3, (i - 4) % 3);
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
        match &mut self.moe {
            None => self.linears.get_mut(i),
            Some(_) if i < 4 => self.linears.get_mut(i),
            Some(m) => {
                let (e, j) = ((i - 4) / 3, (i - 4) % 3);
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
    Mat::from_fn(rows, cols, |r, c| data[r * cols + c])
}

/// Expected `[out, in]` of each of the seven dense linears of `layer`.
pub fn linear_shape(cfg: &ModelConfig, layer: usize, idx: usize) -> (usize, usize) {
    let h = cfg.hidden_size;
    let a = cfg.attn(layer);
    let (q, kv) = (
        a.heads.saturating_mul(a.head_dim),
        a.kv_heads.saturating_mul(a.head_dim),
    );
    match idx {
        0 => (q, h),
        1 | 2 => (kv, h),
        3 => (h, q),
        4 | 5 => (cfg.intermediate_size, h),
        _ => (h, cfg.intermediate_size),
    }
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
        let groups = scales.len() / rows.max(1);
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
            return Err(QuantError::Input(format!(
                "{name}.g_idx is inconsistent with its scales"
            )));
        }
        let w = dequantize_packed(&packed, gq.format);
        return Ok(Linear {
            w: mat_from_row_major(&w, rows, cols),
            b,
        });
    }
    let e = store.entry(&format!("{name}.weight"))?;
    if e.shape != [rows, cols] {
        return Err(QuantError::Input(format!(
            "{name}.weight has shape {:?}, config.json implies [{rows}, {cols}]",
            e.shape
        )));
    }
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
    let two_i = i.checked_mul(2).ok_or_else(|| {
        QuantError::Input("config.json: moe_intermediate_size is too large".into())
    })?;
    for (name, want) in names.iter().zip([[e, two_i, h], [e, h, i]]) {
        let got = &store.entry(name)?.shape;
        if got.as_slice() != want {
            return Err(QuantError::Input(format!(
                "{name} has shape {got:?}, config.json implies {want:?}"
            )));
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
    let e = store.entry(&format!("{name}.weight"))?;
    if e.shape != [rows, cols] {
        return Err(QuantError::Input(format!(
            "{name}.weight has shape {:?}, config.json implies [{rows}, {cols}]",
            e.shape
        )));
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
                return Err(QuantError::Input(format!(
                    "{fused}: expert {e} has {} values where config.json implies {rows} × {cols}",
                    w.len()
                )));
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
        return Err(QuantError::Input(format!(
            "{name} has {} values, config.json implies {len}",
            v.len()
        )));
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
    let opt = |n: &str| -> Result<Option<Vec<f32>>> {
        let name = format!("{p}{n}");
        if store.contains(&name) {
            Ok(Some(store.f32(&name)?))
        } else {
            Ok(None)
        }
    };
    let h = cfg.hidden_size;
    let norm_of = |n: &str| -> Result<Vec<f32>> {
        Ok(cfg.norm_weight(load_vec(store, &format!("{p}{n}"), h)?))
    };
    let moe = match cfg.sparse_layer(layer) {
        None => None,
        Some(m) => {
            let base = format!("{p}{}", m.spec.style.base());
            let mut rest = loaded.split_off(4).into_iter();
            let mut next = || -> Result<Linear> {
                rest.next().ok_or_else(|| {
                    QuantError::Numeric(format!(
                        "layer {layer}: expert list shorter than its config"
                    ))
                })
            };
            let mut experts = Vec::with_capacity(m.num_experts);
            for _ in 0..m.num_experts + usize::from(m.shared_intermediate.is_some()) {
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
                MoeStyle::Gemma4 => {
                    // The router normalises its input itself and multiplies it by `scale / sqrt(hidden)`.
                    let inv_sqrt = 1.0 / (h as f32).sqrt();
                    let scale = load_vec(store, &format!("{p}router.scale"), h)?
                        .into_iter()
                        .map(|v| v * inv_sqrt)
                        .collect();
                    Some(Gemma4Moe {
                        router_scale: scale,
                        per_expert_scale: load_vec(
                            store,
                            &format!("{p}router.per_expert_scale"),
                            m.num_experts,
                        )?,
                        shared_out_norm: norm_of("post_feedforward_layernorm_1.weight")?,
                        experts_in_norm: norm_of("pre_feedforward_layernorm_2.weight")?,
                        experts_out_norm: norm_of("post_feedforward_layernorm_2.weight")?,
                    })
                }
                _ => None,
            };
            Some(MoeWeights {
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
        Some(_) => match opt("layer_scalar")? {
            Some(v) if v.len() == 1 => Some(v[0]),
            Some(v) => {
                return Err(QuantError::Input(format!(
                    "{p}layer_scalar has {} values; expected 1",
                    v.len()
                )))
            }
            // Absent: transformers initialises it to 1.
            None => None,
        },
        None => None,
    };
    let mut lw = LayerWeights {
        linears: loaded,
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A Gemma 4 text config as the hub writes it (`global_head_dim`, `num_global_key_value_heads`, no
    /// `per_layer_config`); `extra` overrides fields.
    fn gemma4_hub(extra: Value) -> Value {
        let mut v = json!({
            "architectures": ["Gemma4ForCausalLM"],
            "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": true,
            "vocab_size": 96, "sliding_window": 8, "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0,
            "rope_parameters": {
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}
            }
        });
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            for (k, x) in e {
                o.insert(k.clone(), x.clone());
            }
        }
        v
    }

    #[test]
    fn gemma4_hub_config_global_layers() {
        let cfg = ModelConfig::from_json(gemma4_hub(json!({}))).unwrap();
        // No layer_types: one global layer in six, the last one.
        let g = cfg.gemma.as_ref().unwrap();
        assert_eq!(g.sliding, [true, true, true, true, true, false]);
        assert_eq!(g.attn_scale, 1.0);
        let global = cfg.attn(5);
        assert_eq!(
            (
                global.heads,
                global.kv_heads,
                global.head_dim,
                global.v_from_k
            ),
            (4, 1, 32, true)
        );
        let local = cfg.attn(0);
        assert_eq!(
            (local.kv_heads, local.head_dim, local.v_from_k),
            (2, 16, false)
        );
        let mods = layer_modules(&cfg, 5);
        assert!(mods[2].tied && mods[2].name == "self_attn.v_proj");
        assert_eq!(mods[0].shape, (128, 64));
        assert_eq!(mods[3].shape, (64, 128));
        // Proportional rope: 32-dim heads, a quarter of the 16 pairs rotate.
        let inv = cfg.inv_freq();
        assert_eq!(inv.len(), 16);
        assert!(inv[..4].iter().all(|&f| f > 0.0) && inv[4..].iter().all(|&f| f == 0.0));
        assert_eq!(cfg.local_inv_freq().unwrap().len(), 8);
        // Without keys-as-values the global layers keep the model's kv heads.
        let cfg = ModelConfig::from_json(gemma4_hub(json!({"attention_k_eq_v": false}))).unwrap();
        assert_eq!((cfg.attn(5).kv_heads, cfg.attn(5).v_from_k), (2, false));
    }

    #[test]
    fn gemma4_absent_fields_take_the_transformers_defaults() {
        let mut v = gemma4_hub(json!({}));
        let o = v.as_object_mut().unwrap();
        for k in ["rope_parameters", "sliding_window", "head_dim"] {
            o.remove(k);
        }
        let cfg = ModelConfig::from_json(v.clone()).unwrap();
        let g = cfg.gemma.as_ref().unwrap();
        assert_eq!(g.sliding_window, Some(512));
        assert_eq!(cfg.attn(0).head_dim, 256);
        let g4 = cfg.gemma4.as_ref().unwrap();
        assert_eq!(
            (g4.global_rope_theta, g4.global_rotary_fraction),
            (1_000_000.0, 0.25)
        );
        assert_eq!(g.local_rope_theta, Some(10000.0));
        // Per-layer inputs are on by default in transformers: refused when the field is absent.
        v.as_object_mut()
            .unwrap()
            .remove("hidden_size_per_layer_input");
        let e = ModelConfig::from_json(v).unwrap_err().to_string();
        assert!(e.contains("hidden_size_per_layer_input 256"), "{e}");
    }

    #[test]
    fn gemma4_refuses_what_the_forward_lacks_naming_the_field() {
        for (extra, field) in [
            (json!({"num_kv_shared_layers": 2}), "num_kv_shared_layers"),
            (
                json!({"hidden_size_per_layer_input": 256}),
                "hidden_size_per_layer_input",
            ),
            (
                json!({"use_bidirectional_attention": "all"}),
                "use_bidirectional_attention",
            ),
            (json!({"hidden_activation": "silu"}), "hidden_activation"),
            (json!({"num_global_key_value_heads": 3}), "layer 5"),
            (json!({"global_head_dim": -1}), "global_head_dim"),
            (
                json!({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}),
                "rope_type",
            ),
            (
                json!({"enable_moe_block": true, "num_experts": 4, "top_k_experts": 5,
                       "moe_intermediate_size": 8}),
                "top_k_experts",
            ),
        ] {
            let e = ModelConfig::from_json(gemma4_hub(extra.clone()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(field), "{extra}: {e}");
        }
        // The multimodal wrapper without its text stack.
        let e =
            ModelConfig::from_json(json!({"architectures": ["Gemma4ForConditionalGeneration"]}))
                .unwrap_err()
                .to_string();
        assert!(e.contains("text_config"), "{e}");
    }

    #[test]
    fn gemma4_multimodal_reads_the_nested_text_config() {
        let text = gemma4_hub(json!({}));
        let cfg = ModelConfig::from_json(json!({
            "architectures": ["Gemma4ForConditionalGeneration"],
            "model_type": "gemma4",
            "text_config": text,
            "vision_config": {"hidden_size": 16},
        }))
        .unwrap();
        assert_eq!(cfg.hidden_size, 64);
        assert_eq!(cfg.layer_prefix(2), "model.language_model.layers.2.");
        assert_eq!(cfg.embed_name(), "model.language_model.embed_tokens.weight");
        assert_eq!(cfg.final_norm_name(), "model.language_model.norm.weight");
    }
}
