//! `config.json` of the supported Llama-family architectures and loading one decoder layer's weights
//! (from a source checkpoint, or dequantized from a `gptq` checkpoint with the consumer's rules).

use crate::error::{QuantError, Result};
use crate::pack::{dequantize_packed, PackedLinear, ZeroFormat};
use crate::tensors::TensorStore;
use faer::Mat;
use serde_json::Value;
use std::path::Path;

/// Architectures whose decoder is Llama-shaped (Qwen3 adds q/k RMSNorm; Qwen2 adds q/k/v bias).
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
];

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
        let hidden_size = get_usize(&raw, "hidden_size")?;
        let num_heads = get_usize(&raw, "num_attention_heads")?;
        let num_kv_heads = raw
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .unwrap_or(num_heads);
        let head_dim = match raw.get("head_dim").and_then(Value::as_u64) {
            Some(d) => d as usize,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        if num_heads == 0
            || num_kv_heads == 0
            || num_heads % num_kv_heads != 0
            || head_dim == 0
            || head_dim % 2 != 0
        {
            return Err(QuantError::Input(format!(
                "config.json: inconsistent attention shape (heads {num_heads}, kv heads {num_kv_heads}, head_dim {head_dim})"
            )));
        }
        let rope_scaling = match raw.get("rope_scaling") {
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
        Ok(ModelConfig {
            architecture: arch,
            hidden_size,
            intermediate_size: get_usize(&raw, "intermediate_size")?,
            num_layers: get_usize(&raw, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: get_f32(&raw, "rms_norm_eps", 1e-6),
            rope_theta: get_f32(&raw, "rope_theta", 10000.0),
            rope_scaling,
            vocab_size: get_usize(&raw, "vocab_size")?,
            tie_word_embeddings: raw
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            raw,
        })
    }

    /// Inverse frequencies after rope scaling.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / (self.rope_theta as f64).powf(2.0 * i as f64 / d as f64) as f32)
            .collect();
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
        format!("model.layers.{layer}.")
    }
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
}

fn mat_from_row_major(data: &[f32], rows: usize, cols: usize) -> Mat<f32> {
    Mat::from_fn(rows, cols, |r, c| data[r * cols + c])
}

/// Expected `[out, in]` of each linear.
pub fn linear_shape(cfg: &ModelConfig, idx: usize) -> (usize, usize) {
    let h = cfg.hidden_size;
    let (q, kv) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
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

pub fn load_layer(
    store: &TensorStore,
    cfg: &ModelConfig,
    layer: usize,
    gq: Option<GptqReadConfig>,
) -> Result<LayerWeights> {
    let p = cfg.layer_prefix(layer);
    let mut linears = Vec::with_capacity(7);
    for (i, m) in LINEARS.iter().enumerate() {
        linears.push(load_linear(
            store,
            &format!("{p}{m}"),
            linear_shape(cfg, i),
            gq,
        )?);
    }
    let opt = |n: &str| -> Result<Option<Vec<f32>>> {
        let name = format!("{p}{n}");
        if store.contains(&name) {
            Ok(Some(store.f32(&name)?))
        } else {
            Ok(None)
        }
    };
    Ok(LayerWeights {
        linears,
        input_norm: store.f32(&format!("{p}input_layernorm.weight"))?,
        post_norm: store.f32(&format!("{p}post_attention_layernorm.weight"))?,
        q_norm: opt("self_attn.q_norm.weight")?,
        k_norm: opt("self_attn.k_norm.weight")?,
    })
}
