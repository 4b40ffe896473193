//! `config.json` of the supported Llama-family architectures: the attention and rope shape
//! ([`ModelConfig`]), the Gemma specifics ([`gemma`]), the sparse-MoE routing ([`moe`]) and the gated
//! delta-net hybrids' linear attention ([`hybrid`]).
// Sizes, head counts and offsets come from untrusted model files: overflow must be an error or
// saturate, never wrap or panic (the numeric kernels are outside the lint).
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

mod gemma;
mod hybrid;
mod moe;
#[cfg(test)]
mod tests;

pub use gemma::{Gemma4Config, GemmaConfig};
pub use hybrid::{GdnConfig, GdnLayout};
pub use moe::MoeConfig;

use crate::error::{ConfigError, Result};
use gemma::{attention_shapes, gemma_config};
use hybrid::{check_gated_query, gdn_config, rotary_dim};
use moe::{intermediate_size, moe_config};
use serde_json::Value;
use std::borrow::Cow;
use std::path::Path;

/// Architectures whose decoder is Llama-shaped (Qwen3 adds q/k RMSNorm; Qwen2 adds q/k/v bias), dense or
/// with a sparse-MoE MLP ([`crate::model::moe`]).
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
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
];

/// Query / key / value shape of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The values are the keys' projection (Gemma 4 `attention_k_eq_v` on global layers): no `v_proj` tensor.
    pub v_from_k: bool,
    /// `q_proj` also gives a per-head output gate (Qwen3-Next / Qwen3.5 full attention): `[query | gate]` per
    /// head, `2 × heads × head_dim` rows; the attention output is multiplied by `sigmoid(gate)` before `o_proj`.
    pub output_gate: bool,
}

/// Largest attention head dimension accepted from a `config.json` (published models use up to 512).
pub const MAX_HEAD_DIM: usize = 1 << 16;

/// Largest decoder layer count accepted from a `config.json` (published models have at most a few hundred).
pub const MAX_LAYERS: usize = 4096;

/// Largest expert count accepted from a `config.json` (the largest published models have a few hundred).
pub const MAX_EXPERTS: usize = 4096;

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
    /// Gated delta-net hybrids (Qwen3-Next, Qwen3.5): the linear-attention layers' shape.
    pub gdn: Option<GdnConfig>,
    /// Dimensions of each head that rotate (`partial_rotary_factor × head_dim`; `head_dim` but on the hybrids).
    pub rotary_dim: usize,
    /// The parsed config.json, kept to write it back with `quantization_config`.
    pub raw: Value,
}

pub(super) fn get_usize(v: &Value, key: &str) -> Result<usize> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| {
            ConfigError::MissingInteger {
                field: key.to_string(),
            }
            .into()
        })
}

/// `layer_types` as one flag per layer (`true`: `other`, e.g. `sliding_attention`; `false`:
/// `full_attention`); `None` when the config has none. Any other entry, or a count that is not
/// the layer count, is an error naming the field.
pub(super) fn layer_types(
    text: &Value,
    num_layers: usize,
    other: &str,
) -> Result<Option<Vec<bool>>> {
    let Some(a) = text.get("layer_types").and_then(Value::as_array) else {
        return Ok(None);
    };
    if a.len() != num_layers {
        return Err(ConfigError::LayerTypesCount {
            entries: a.len(),
            layers: num_layers,
        }
        .into());
    }
    a.iter()
        .map(|t| match t.as_str() {
            Some(s) if s == other => Ok(true),
            Some("full_attention") => Ok(false),
            found => Err(ConfigError::LayerTypesEntry {
                found: found.map(str::to_string),
                other: other.to_string(),
            }
            .into()),
        })
        .collect::<Result<Vec<bool>>>()
        .map(Some)
}

/// The layer pattern "one full-attention layer in every `n`" (layers n-1, 2n-1, … are full):
/// `true` for the other layers.
pub(super) fn one_full_layer_in_every(n: usize, num_layers: usize) -> Vec<bool> {
    (0..num_layers)
        .map(|l| !l.saturating_add(1).is_multiple_of(n.max(1)))
        .collect()
}

pub(super) fn get_f32(v: &Value, key: &str, default: f32) -> f32 {
    v.get(key)
        .and_then(Value::as_f64)
        .map(|x| x as f32)
        .unwrap_or(default)
}

impl ModelConfig {
    pub fn load(model_dir: &Path) -> Result<Self> {
        crate::fsutil::require_in_model_dir(model_dir, "config.json")?;
        let raw = crate::fsutil::read_json_within(
            model_dir,
            "config.json",
            flexinfer_fsutil::limits::CONFIG_JSON,
        )?;
        let mut cfg = Self::from_json(raw)?;
        cfg.text_prefix_from_checkpoint(model_dir);
        Ok(cfg)
    }

    /// A text-only Qwen3.5 checkpoint saved by transformers 5 keeps the multimodal prefix
    /// (`model.language_model.*`) although its config names `*ForCausalLM`: the prefix follows the tensors
    /// when the embeddings are found only there. Nothing changes when the weights cannot be opened.
    fn text_prefix_from_checkpoint(&mut self, model_dir: &Path) {
        const WRAPPED: &str = "model.language_model.";
        if self.gdn.is_none() || self.text_prefix == WRAPPED {
            return;
        }
        let Ok(store) = crate::model::tensors::TensorStore::open_dir(model_dir) else {
            return;
        };
        let wrapped = format!("{WRAPPED}embed_tokens.weight");
        if !store.contains(&self.embed_name()) && store.contains(&wrapped) {
            self.text_prefix = WRAPPED.to_string();
        }
    }

    pub fn from_json(raw: Value) -> Result<Self> {
        let arch = architecture(&raw)?;
        let (text, text_prefix) = text_stack(&raw, &arch)?;
        let text: &Value = &text;
        let is_gemma4 = arch.starts_with("Gemma4");
        let (hidden_size, num_heads, num_kv_heads, head_dim) = attention_dims(text, is_gemma4)?;
        let (rope_params, rope_by_type) = rope_parameters(text);
        // Gemma 4's two ropes are read by `gemma4_config`.
        let rope_scaling = rope_scaling(text, rope_params, is_gemma4)?;
        let num_layers = layer_count(text)?;
        let moe = moe_config(text, &arch, num_layers)?;
        let gemma = gemma_config(text, &arch, num_layers, head_dim, rope_by_type)?;
        let gdn = gdn_config(text, &arch, num_layers)?;
        let rotary_dim = rotary_dim(text, rope_params, head_dim, gdn.is_some())?;
        let gated = gdn.is_some();
        check_gated_query(num_heads, head_dim, gated)?;
        let base_shape = AttnShape {
            heads: num_heads,
            kv_heads: num_kv_heads,
            head_dim,
            v_from_k: false,
            output_gate: gated,
        };
        let (gemma4, layer_attn) =
            attention_shapes(text, num_layers, base_shape, gemma.as_ref(), is_gemma4)?;
        let intermediate_size = intermediate_size(text, moe.as_ref())?;
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
            hybrid: gdn.is_some() || is_hybrid(&raw),
            gdn,
            rotary_dim,
            moe,
            gemma,
            gemma4,
            layer_attn,
            text_prefix: text_prefix.to_string(),
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: get_f32(text, "rms_norm_eps", 1e-6),
            rope_theta: rope_theta(text, rope_params),
            rope_scaling,
            vocab_size: get_usize(text, "vocab_size")?,
            tie_word_embeddings: tie_word_embeddings(text, &raw),
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
        self.first_head_dim(true)
    }

    /// Head dimension of the global layers.
    fn global_head_dim(&self) -> usize {
        self.first_head_dim(false)
    }

    /// Head dimension of the first layer that is (`sliding`) or is not a sliding-window layer; the
    /// config's `head_dim` when there is none.
    fn first_head_dim(&self, sliding: bool) -> usize {
        let is_sliding = |l: usize| {
            self.gemma
                .as_ref()
                .is_some_and(|g| g.sliding.get(l).copied().unwrap_or(false))
        };
        (0..self.num_layers)
            .find(|&l| is_sliding(l) == sliding)
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
            output_gate: self.gdn.is_some(),
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

    /// Norm weights as multiplied: `1 + w` for Gemma 2/3 and the Qwen3-Next / Qwen3.5 hybrids (zero-centred
    /// RMSNorm weights), `w` otherwise (Gemma 4 included). Not the hybrids' gated RMSNorm, which multiplies by `w`.
    pub fn norm_weight(&self, mut w: Vec<f32>) -> Vec<f32> {
        if (self.gemma.is_some() && self.gemma4.is_none()) || self.gdn.is_some() {
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
        // Partial rope (the hybrids): the first `rotary_dim` dimensions of each head rotate, in pairs
        // (i, i + rotary_dim / 2); the rest pass unchanged.
        let base = base_inv_freq(self.rope_theta, self.rotary_dim);
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

    /// Whether `layer` is a gated delta-net (linear-attention) layer.
    pub fn is_linear_attention(&self, layer: usize) -> bool {
        self.gdn
            .as_ref()
            .is_some_and(|g| g.linear.get(layer).copied().unwrap_or(false))
    }

    /// The MoE config when `layer` has a sparse MLP.
    pub fn sparse_layer(&self, layer: usize) -> Option<&MoeConfig> {
        self.moe
            .as_ref()
            .filter(|m| m.sparse.get(layer).copied().unwrap_or(false))
    }
}

/// The first of `architectures`, when it is supported.
fn architecture(raw: &Value) -> Result<String> {
    let arch = raw
        .get("architectures")
        .and_then(|a| a.as_array())
        .and_then(|a| a.first())
        .and_then(|a| a.as_str())
        .unwrap_or("")
        .to_string();
    if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
        return Err(ConfigError::Architecture {
            arch,
            supported: SUPPORTED_ARCHITECTURES,
        }
        .into());
    }
    Ok(arch)
}

/// The text stack's fields and tensor prefix: the config itself under `model.`, or, for a multimodal
/// Gemma 4 / Qwen3.5 (`*ForConditionalGeneration`), its `text_config` under `model.language_model.` (the
/// vision / audio towers and MTP heads are not read; the writer copies them). A multimodal config
/// without a `text_config` object is an error.
fn text_stack<'a>(raw: &'a Value, arch: &str) -> Result<(Cow<'a, Value>, &'static str)> {
    if !arch.ends_with("ForConditionalGeneration") {
        return Ok((Cow::Borrowed(raw), "model."));
    }
    let text = raw
        .get("text_config")
        .filter(|t| t.is_object())
        .cloned()
        .ok_or_else(|| ConfigError::NoTextConfig {
            arch: arch.to_string(),
        })?;
    Ok((Cow::Owned(text), "model.language_model."))
}

/// transformers 5's `rope_parameters` (`rope_theta` and the scaling in one object, in place of
/// `rope_theta` / `rope_scaling`), when it is an object, and whether it is given per attention type
/// (Gemma 3 under transformers 5: then the global layers' object is the model's rope).
fn rope_parameters(text: &Value) -> (Option<&Value>, bool) {
    let rope_by_type = text
        .get("rope_parameters")
        .and_then(|v| v.get("full_attention"))
        .is_some();
    let rope_params = text
        .get("rope_parameters")
        .map(|v| v.get("full_attention").unwrap_or(v))
        .filter(|v| v.is_object());
    (rope_params, rope_by_type)
}

/// `num_hidden_layers`, refused above [`MAX_LAYERS`].
fn layer_count(text: &Value) -> Result<usize> {
    let num_layers = get_usize(text, "num_hidden_layers")?;
    if num_layers > MAX_LAYERS {
        return Err(ConfigError::TooManyLayers {
            layers: num_layers,
            max: MAX_LAYERS,
        }
        .into());
    }
    Ok(num_layers)
}

/// `rope_theta`; from `rope_parameters` when only that has it; 10000 when neither does.
fn rope_theta(text: &Value, rope_params: Option<&Value>) -> f32 {
    match (text.get("rope_theta"), rope_params) {
        (None, Some(rp)) => get_f32(rp, "rope_theta", 10000.0),
        _ => get_f32(text, "rope_theta", 10000.0),
    }
}

/// `tie_word_embeddings` of the text config, else of the top-level config; false when neither has it.
fn tie_word_embeddings(text: &Value, raw: &Value) -> bool {
    text.get("tie_word_embeddings")
        .or_else(|| raw.get("tie_word_embeddings"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// `(hidden_size, heads, kv heads, head_dim)` of the text config, checked for a usable attention.
fn attention_dims(text: &Value, is_gemma4: bool) -> Result<(usize, usize, usize, usize)> {
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
        None if num_heads > 0 => hidden_size.checked_div(num_heads).unwrap_or(0),
        None => 0,
    };
    if num_heads == 0
        || num_kv_heads == 0
        || !num_heads.is_multiple_of(num_kv_heads)
        || head_dim == 0
        || head_dim % 2 != 0
        || head_dim > MAX_HEAD_DIM
    {
        return Err(ConfigError::AttentionShape {
            layer: None,
            heads: num_heads,
            kv_heads: num_kv_heads,
            head_dim,
        }
        .into());
    }
    Ok((hidden_size, num_heads, num_kv_heads, head_dim))
}

/// `rope_scaling` (or transformers 5's `rope_parameters`); none for Gemma 4, whose two ropes
/// [`gemma4_config`](gemma::gemma4_config) reads.
fn rope_scaling(text: &Value, rope_params: Option<&Value>, is_gemma4: bool) -> Result<RopeScaling> {
    let scaling = match text
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
                "linear" => RopeScaling::Linear {
                    factor: get_f32(rs, "factor", 1.0),
                },
                "llama3" => RopeScaling::Llama3 {
                    factor: get_f32(rs, "factor", 8.0),
                    low_freq_factor: get_f32(rs, "low_freq_factor", 1.0),
                    high_freq_factor: get_f32(rs, "high_freq_factor", 4.0),
                    original_max_position_embeddings: get_f32(
                        rs,
                        "original_max_position_embeddings",
                        8192.0,
                    ),
                },
                other => {
                    return Err(ConfigError::Unsupported {
                        field: "rope_scaling type".into(),
                        value: format!("{other:?}"),
                        model: None,
                        supported: "default, linear, dynamic, llama3",
                    }
                    .into())
                }
            }
        }
    };
    Ok(scaling)
}

fn base_inv_freq(theta: f32, d: usize) -> Vec<f32> {
    (0..d / 2)
        .map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / d as f64) as f32)
        .collect()
}
