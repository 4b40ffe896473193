//! The llama.cpp mapping of the dense Llama family (`LlamaForCausalLM`, `MistralForCausalLM` → the
//! `llama` architecture; `Qwen2ForCausalLM` → `qwen2`): tensor names, the row permutation of the
//! query/key projections, the generated `rope_freqs` of Llama 3 rope scaling, and the `general.*` /
//! `<arch>.*` metadata, as llama.cpp's `convert_hf_to_gguf.py` writes them.
//!
//! Why the permutation: transformers' Llama rotates the two halves of each head (`rotate_half`),
//! llama.cpp's `llama` architecture rotates adjacent pairs; the converter reorders the rows of
//! `q_proj`/`k_proj` within each head so that half `i`, element `j` becomes row `2j + i`. Qwen2 uses
//! llama.cpp's NeoX rope, which rotates halves: no permutation.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

use super::error::GgufError;
use super::types::FileType;
use super::writer::MetaValue;
use crate::model::config::{ModelConfig, RopeScaling};
use crate::model::tensors::TensorStore;

/// The `architectures` entries written as GGUF.
pub const SUPPORTED_ARCHITECTURES: &[&str] =
    &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufArch {
    Llama,
    Qwen2,
}

impl GgufArch {
    /// `general.architecture` and the prefix of the architecture's keys.
    pub fn name(self) -> &'static str {
        match self {
            GgufArch::Llama => "llama",
            GgufArch::Qwen2 => "qwen2",
        }
    }

    /// The GGUF architecture of a model, or the error naming what cannot be mapped.
    pub fn of(cfg: &ModelConfig) -> Result<Self, GgufError> {
        let arch = match cfg.architecture.as_str() {
            "LlamaForCausalLM" | "MistralForCausalLM" => GgufArch::Llama,
            "Qwen2ForCausalLM" => GgufArch::Qwen2,
            other => {
                return Err(GgufError::Architecture {
                    arch: other.to_string(),
                    supported: SUPPORTED_ARCHITECTURES,
                })
            }
        };
        if cfg.moe.is_some() || cfg.gemma.is_some() || cfg.hybrid {
            return Err(GgufError::Architecture {
                arch: format!("{} with sparse-MoE or hybrid layers", cfg.architecture),
                supported: SUPPORTED_ARCHITECTURES,
            });
        }
        if cfg
            .layer_attn
            .iter()
            .any(|a| a.v_from_k || a.output_gate || *a != cfg.attn(0))
        {
            return Err(GgufError::Unsupported {
                key: "config.json attention".into(),
                reason: "per-layer attention shapes are not mapped".into(),
            });
        }
        if cfg.rotary_dim != cfg.head_dim {
            return Err(GgufError::Unsupported {
                key: "config.json partial_rotary_factor".into(),
                reason: "partial rotary embeddings are not mapped for this architecture".into(),
            });
        }
        Ok(arch)
    }
}

/// Where a GGUF tensor's values come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// A checkpoint tensor, by name.
    Checkpoint(String),
    /// Values computed from the config (Llama 3's `rope_freqs`).
    Computed(Vec<f32>),
}

/// One tensor of the GGUF: its name, ggml dims (ne[0] = row length first), its source, the layer it
/// belongs to, and whether its rows are permuted per head (`Some(heads)`).
#[derive(Clone, Debug, PartialEq)]
pub struct MappedTensor {
    pub gguf: String,
    pub dims: Vec<u64>,
    pub source: Source,
    pub layer: Option<usize>,
    pub permute_heads: Option<usize>,
}

/// Per decoder layer: checkpoint suffix → GGUF name suffix.
const LAYER_TENSORS: &[(&str, &str)] = &[
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.o_proj.bias", "attn_output.bias"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

/// The GGUF name of layer `layer`'s checkpoint tensor `suffix` (block-relative, e.g.
/// `self_attn.q_proj.weight` → `blk.0.attn_q.weight`), as [`map_tensors`] names it.
pub fn layer_tensor_name(layer: usize, suffix: &str) -> Option<String> {
    LAYER_TENSORS
        .iter()
        .find(|(hf, _)| *hf == suffix)
        .map(|(_, gguf)| format!("blk.{layer}.{gguf}"))
}

/// Tensors of every layer that must exist.
const REQUIRED: &[&str] = &[
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

fn ggml_dims(shape: &[usize]) -> Vec<u64> {
    shape.iter().rev().map(|d| *d as u64).collect()
}

/// Llama 3 rope scaling as per-frequency divisors (`rope_freqs.weight`, `head_dim / 2` values).
pub fn llama3_rope_factors(
    theta: f32,
    head_dim: usize,
    factor: f32,
    low: f32,
    high: f32,
    original: f32,
) -> Vec<f32> {
    let (factor, low, high, original) = (
        f64::from(factor),
        f64::from(low),
        f64::from(high),
        f64::from(original),
    );
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    (0..head_dim / 2)
        .map(|i| {
            #[allow(clippy::arithmetic_side_effects)]
            let exponent = (2 * i) as f32 / head_dim as f32;
            let freq = f64::from(1.0 / theta.powf(exponent));
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}

/// The GGUF tensors of a model, in the order they are written: embeddings, `rope_freqs` (Llama 3
/// scaling), the layers, the final norm and the output head. Every checkpoint tensor must be
/// mapped (rotary `inv_freq` buffers excepted); a missing or unknown one is an error.
pub fn map_tensors(
    cfg: &ModelConfig,
    store: &TensorStore,
    arch: GgufArch,
) -> Result<Vec<MappedTensor>, GgufError> {
    let mut out = Vec::new();
    let mut used = std::collections::HashSet::new();
    let mut add = |hf: String,
                   gguf: String,
                   layer: Option<usize>,
                   permute_heads: Option<usize>,
                   out: &mut Vec<MappedTensor>|
     -> Result<(), GgufError> {
        let entry = store
            .entries
            .get(&hf)
            .ok_or_else(|| GgufError::MissingTensor {
                name: hf.clone(),
                gguf: gguf.clone(),
            })?;
        if let Some(heads) = permute_heads {
            let rows = entry.shape.first().copied().unwrap_or(0);
            let per_head = rows.checked_div(heads).unwrap_or(0);
            if heads == 0 || !rows.is_multiple_of(heads) || !per_head.is_multiple_of(2) {
                return Err(GgufError::Unsupported {
                    key: hf,
                    reason: format!("{rows} rows do not split into {heads} heads of even size"),
                });
            }
        }
        out.push(MappedTensor {
            gguf,
            dims: ggml_dims(&entry.shape),
            source: Source::Checkpoint(hf.clone()),
            layer,
            permute_heads,
        });
        used.insert(hf);
        Ok(())
    };
    add(
        cfg.embed_name(),
        "token_embd.weight".into(),
        None,
        None,
        &mut out,
    )?;
    if let RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings,
    } = cfg.rope_scaling
    {
        let v = llama3_rope_factors(
            cfg.rope_theta,
            cfg.head_dim,
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        );
        out.push(MappedTensor {
            gguf: "rope_freqs.weight".into(),
            dims: vec![v.len() as u64],
            source: Source::Computed(v),
            layer: None,
            permute_heads: None,
        });
    }
    for l in 0..cfg.num_layers {
        let p = cfg.layer_prefix(l);
        for (hf, gguf) in LAYER_TENSORS {
            let name = format!("{p}{hf}");
            if !REQUIRED.contains(hf) && !store.contains(&name) {
                continue;
            }
            let permute = match (arch, *hf) {
                (GgufArch::Llama, "self_attn.q_proj.weight" | "self_attn.q_proj.bias") => {
                    Some(cfg.num_heads)
                }
                (GgufArch::Llama, "self_attn.k_proj.weight" | "self_attn.k_proj.bias") => {
                    Some(cfg.num_kv_heads)
                }
                _ => None,
            };
            add(name, format!("blk.{l}.{gguf}"), Some(l), permute, &mut out)?;
        }
    }
    add(
        cfg.final_norm_name(),
        "output_norm.weight".into(),
        None,
        None,
        &mut out,
    )?;
    if store.contains("lm_head.weight") {
        add(
            "lm_head.weight".into(),
            "output.weight".into(),
            None,
            None,
            &mut out,
        )?;
    } else if !cfg.tie_word_embeddings {
        return Err(GgufError::MissingTensor {
            name: "lm_head.weight".into(),
            gguf: "output.weight".into(),
        });
    }
    if let Some(extra) = store
        .entries
        .keys()
        .find(|k| !used.contains(*k) && !k.ends_with("rotary_emb.inv_freq"))
    {
        return Err(GgufError::Unsupported {
            key: extra.clone(),
            reason: format!("no llama.cpp {} tensor corresponds to it", arch.name()),
        });
    }
    Ok(out)
}

/// Reorders the rows of a `[rows, cols]` projection per head as the converter's `permute` does:
/// in each head of `rows / heads` rows, row `i·half + j` moves to `2j + i`.
pub fn permute_heads(data: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; data.len()];
    let per_head = rows.checked_div(heads).unwrap_or(0);
    let half = per_head / 2;
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..half {
                #[allow(clippy::arithmetic_side_effects)]
                let (src, dst) = (h * per_head + i * half + j, h * per_head + 2 * j + i);
                #[allow(clippy::arithmetic_side_effects)]
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn u32_of(key: &str, v: usize) -> Result<MetaValue, GgufError> {
    u32::try_from(v)
        .map(MetaValue::U32)
        .map_err(|_| GgufError::Unsupported {
            key: key.to_string(),
            reason: format!("{v} does not fit in 32 bits"),
        })
}

/// The `general.*` and `<arch>.*` metadata (the tokenizer's is [`super::tokenizer`]'s).
pub fn model_metadata(
    cfg: &ModelConfig,
    arch: GgufArch,
    ftype: FileType,
    name: &str,
) -> Result<Vec<(String, MetaValue)>, GgufError> {
    let a = arch.name();
    let ctx = cfg
        .raw
        .get("max_position_embeddings")
        .and_then(serde_json::Value::as_u64)
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| GgufError::Unsupported {
            key: format!("{a}.context_length"),
            reason: "config.json has no max_position_embeddings".into(),
        })?;
    let k = |s: &str| format!("{a}.{s}");
    let mut md = vec![
        ("general.architecture".to_string(), MetaValue::Str(a.into())),
        ("general.type".into(), MetaValue::Str("model".into())),
        ("general.name".into(), MetaValue::Str(name.into())),
        (k("block_count"), u32_of("block_count", cfg.num_layers)?),
        (k("context_length"), u32_of("context_length", ctx)?),
        (
            k("embedding_length"),
            u32_of("embedding_length", cfg.hidden_size)?,
        ),
        (
            k("feed_forward_length"),
            u32_of("feed_forward_length", cfg.intermediate_size)?,
        ),
        (
            k("attention.head_count"),
            u32_of("head_count", cfg.num_heads)?,
        ),
        (
            k("attention.head_count_kv"),
            u32_of("head_count_kv", cfg.num_kv_heads)?,
        ),
        (k("rope.freq_base"), MetaValue::F32(cfg.rope_theta)),
        (
            k("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(cfg.rms_norm_eps),
        ),
    ];
    if cfg.num_heads.checked_mul(cfg.head_dim) != Some(cfg.hidden_size) {
        md.push((
            k("attention.key_length"),
            u32_of("key_length", cfg.head_dim)?,
        ));
        md.push((
            k("attention.value_length"),
            u32_of("value_length", cfg.head_dim)?,
        ));
    }
    if arch == GgufArch::Llama {
        md.push((k("vocab_size"), u32_of("vocab_size", cfg.vocab_size)?));
        md.push((
            k("rope.dimension_count"),
            u32_of("rope.dimension_count", cfg.head_dim)?,
        ));
    }
    if let RopeScaling::Linear { factor } = cfg.rope_scaling {
        md.push((k("rope.scaling.type"), MetaValue::Str("linear".into())));
        md.push((k("rope.scaling.factor"), MetaValue::F32(factor)));
    }
    md.push(("general.file_type".into(), MetaValue::U32(ftype.id())));
    md.push(("general.quantization_version".into(), MetaValue::U32(2)));
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_interleaves_the_halves_of_each_head() {
        // 2 heads of 4 rows, 1 column: head rows [a0 a1 b0 b1] → [a0 b0 a1 b1]
        let x: Vec<f32> = (0..8).map(|v| v as f32).collect();
        assert_eq!(
            permute_heads(&x, 8, 1, 2),
            vec![0., 2., 1., 3., 4., 6., 5., 7.]
        );
        // columns travel with their row
        let x: Vec<f32> = (0..8).map(|v| v as f32).collect();
        assert_eq!(
            permute_heads(&x, 4, 2, 1),
            vec![0., 1., 4., 5., 2., 3., 6., 7.]
        );
    }

    #[test]
    fn llama3_rope_factors_keep_high_and_scale_low_frequencies() {
        let f = llama3_rope_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192.0);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[63], 8.0);
        assert!(f.windows(2).all(|w| w[0] <= w[1]));
        assert!(f.iter().any(|v| *v > 1.0 && *v < 8.0));
    }
}
