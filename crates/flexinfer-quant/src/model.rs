//! `config.json` of the supported Llama-family architectures and loading one decoder layer's weights
//! (from a source checkpoint, or dequantized from a `gptq` checkpoint with the consumer's rules).

use crate::error::{QuantError, Result};
use crate::moe::{Mlp, MoeSpec, MoeStyle, MoeWeights};
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
];

/// What Gemma 2 / Gemma 3 (text) do differently from Llama: norms scale by `1 + w`, the embeddings are
/// multiplied by `sqrt(hidden_size)`, GELU-tanh MLPs, an RMSNorm on the attention output and on the MLP output
/// (`post_attention_layernorm`, `post_feedforward_layernorm`; `pre_feedforward_layernorm` is the MLP input norm),
/// attention scaled by `query_pre_attn_scalar^-1/2`, optional tanh soft-capping of attention scores and logits,
/// sliding-window (local) layers, and (Gemma 3) a separate rope base for the local layers.
#[derive(Clone, Debug)]
pub struct GemmaConfig {
    pub query_pre_attn_scalar: f32,
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
    let gemma3 = match arch {
        "Gemma2ForCausalLM" => false,
        "Gemma3ForCausalLM" => true,
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
        // Before `layer_types`: Gemma 2 alternates local / global from layer 0; Gemma 3 has one global layer
        // in every `sliding_window_pattern`.
        None if gemma3 => {
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
    let local_rope_theta = if !gemma3 {
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
    let softcap = |k: &str| opt_f32(k).filter(|v| *v > 0.0 && v.is_finite());
    Ok(Some(GemmaConfig {
        query_pre_attn_scalar: opt_f32("query_pre_attn_scalar")
            .filter(|v| *v > 0.0 && v.is_finite())
            .unwrap_or(head_dim as f32),
        attn_softcap: softcap("attn_logit_softcapping"),
        final_softcap: softcap("final_logit_softcapping"),
        sliding_window: raw
            .get("sliding_window")
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .filter(|&v| v > 0),
        sliding,
        local_rope_theta,
    }))
}

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
        _ => return Ok(None),
    };
    let (experts_key, inter_key) = match style {
        MoeStyle::Mixtral => ("num_local_experts", "intermediate_size"),
        MoeStyle::Qwen => ("num_experts", "moe_intermediate_size"),
    };
    // transformers 5 writes Qwen3-MoE's count as `num_local_experts`; the hub checkpoints as `num_experts`.
    let alias = match style {
        MoeStyle::Mixtral => "num_experts",
        MoeStyle::Qwen => "num_local_experts",
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
        MoeStyle::Mixtral => true,
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
            MoeStyle::Mixtral => true,
            MoeStyle::Qwen => !mlp_only.contains(&l) && (l + 1).is_multiple_of(step),
        })
        .collect();
    Ok(Some(MoeConfig {
        spec: MoeSpec {
            style,
            top_k,
            renormalize,
        },
        num_experts,
        expert_intermediate,
        shared_intermediate,
        sparse,
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
    /// Gemma 2 / Gemma 3 text specifics.
    pub gemma: Option<GemmaConfig>,
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
        // transformers 5 writes `rope_parameters` (`rope_theta` and the scaling in one object) in place of
        // `rope_theta` / `rope_scaling`.
        // Gemma 3 under transformers 5: one object per attention type; the global layers' is the model's rope.
        let rope_by_type = raw
            .get("rope_parameters")
            .and_then(|v| v.get("full_attention"))
            .is_some();
        let rope_params = raw
            .get("rope_parameters")
            .map(|v| v.get("full_attention").unwrap_or(v))
            .filter(|v| v.is_object());
        let rope_scaling = match raw
            .get("rope_scaling")
            .filter(|v| !v.is_null())
            .or(rope_params)
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
        let num_layers = get_usize(&raw, "num_hidden_layers")?;
        let moe = moe_config(&raw, &arch, num_layers)?;
        let gemma = gemma_config(&raw, &arch, num_layers, head_dim, rope_by_type)?;
        let intermediate_size = match (&moe, raw.get("intermediate_size")) {
            (Some(m), None) => m.expert_intermediate,
            _ => get_usize(&raw, "intermediate_size")?,
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
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: get_f32(&raw, "rms_norm_eps", 1e-6),
            rope_theta: match (raw.get("rope_theta"), rope_params) {
                (None, Some(rp)) => get_f32(rp, "rope_theta", 10000.0),
                _ => get_f32(&raw, "rope_theta", 10000.0),
            },
            rope_scaling,
            vocab_size: get_usize(&raw, "vocab_size")?,
            tie_word_embeddings: raw
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            raw,
        })
    }

    /// Inverse frequencies of the local (sliding-window) layers, when their rope differs (Gemma 3).
    pub fn local_inv_freq(&self) -> Option<Vec<f32>> {
        let theta = self.gemma.as_ref()?.local_rope_theta?;
        Some(base_inv_freq(theta, self.head_dim))
    }

    /// Norm weights as multiplied: `1 + w` for Gemma, `w` otherwise.
    pub fn norm_weight(&self, mut w: Vec<f32>) -> Vec<f32> {
        if self.gemma.is_some() {
            w.iter_mut().for_each(|v| *v += 1.0);
        }
        w
    }

    /// Inverse frequencies after rope scaling.
    pub fn inv_freq(&self) -> Vec<f32> {
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
        format!("model.layers.{layer}.")
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
}

/// The linears of `layer` in true-sequential order: q, k, v, o, then the dense MLP's gate, up, down, or each
/// routed expert's gate, up, down and the shared expert's. Routers are not among them (never quantized).
/// Index `i` of this list is [`LayerWeights::module`] `i`.
pub fn layer_modules(cfg: &ModelConfig, layer: usize) -> Vec<ModuleSpec> {
    let mut out: Vec<ModuleSpec> = (0..4)
        .map(|i| ModuleSpec {
            name: LINEARS[i].to_string(),
            shape: linear_shape(cfg, i),
        })
        .collect();
    let h = cfg.hidden_size;
    match cfg.sparse_layer(layer) {
        None => out.extend((4..7).map(|i| ModuleSpec {
            name: LINEARS[i].to_string(),
            shape: linear_shape(cfg, i),
        })),
        Some(m) => {
            let base = m.spec.style.base();
            let [g, u, d] = m.spec.style.expert_names();
            let mut push = |stem: String, inter: usize| {
                out.push(ModuleSpec {
                    name: format!("{stem}{g}"),
                    shape: (inter, h),
                });
                out.push(ModuleSpec {
                    name: format!("{stem}{u}"),
                    shape: (inter, h),
                });
                out.push(ModuleSpec {
                    name: format!("{stem}{d}"),
                    shape: (h, inter),
                });
            };
            for e in 0..m.num_experts {
                push(format!("{base}experts.{e}."), m.expert_intermediate);
            }
            if let Some(si) = m.shared_intermediate {
                let [g, u, d] = MoeStyle::Qwen.expert_names();
                for (n, shape) in [(g, (si, h)), (u, (si, h)), (d, (h, si))] {
                    out.push(ModuleSpec {
                        name: format!("{base}shared_expert.{n}"),
                        shape,
                    });
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
    let specs = layer_modules(cfg, layer);
    let mut loaded = Vec::with_capacity(specs.len());
    for s in &specs {
        loaded.push(load_linear(store, &format!("{p}{}", s.name), s.shape, gq)?);
    }
    let opt = |n: &str| -> Result<Option<Vec<f32>>> {
        let name = format!("{p}{n}");
        if store.contains(&name) {
            Ok(Some(store.f32(&name)?))
        } else {
            Ok(None)
        }
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
            Some(MoeWeights {
                router: load_linear(
                    store,
                    &format!("{base}gate"),
                    (m.num_experts, cfg.hidden_size),
                    None,
                )?,
                experts,
                shared,
                shared_gate,
            })
        }
    };
    let norm =
        |n: &str| -> Result<Vec<f32>> { Ok(cfg.norm_weight(store.f32(&format!("{p}{n}"))?)) };
    let opt_norm =
        |n: &str| -> Result<Option<Vec<f32>>> { Ok(opt(n)?.map(|w| cfg.norm_weight(w))) };
    let (post_norm, attn_out_norm, mlp_out_norm) = match &cfg.gemma {
        Some(_) => (
            norm("pre_feedforward_layernorm.weight")?,
            Some(norm("post_attention_layernorm.weight")?),
            Some(norm("post_feedforward_layernorm.weight")?),
        ),
        None => (norm("post_attention_layernorm.weight")?, None, None),
    };
    Ok(LayerWeights {
        linears: loaded,
        input_norm: norm("input_layernorm.weight")?,
        post_norm,
        q_norm: opt_norm("self_attn.q_norm.weight")?,
        k_norm: opt_norm("self_attn.k_norm.weight")?,
        moe,
        attn_out_norm,
        mlp_out_norm,
        sliding: cfg.gemma.as_ref().is_some_and(|g| {
            g.sliding_window.is_some() && g.sliding.get(layer).copied().unwrap_or(false)
        }),
    })
}
