//! The gated delta-net hybrids (Qwen3-Next, Qwen3.5 dense and MoE): which layers use linear attention, the
//! linear-attention shape, and how its input projections are laid out in the checkpoint.

use super::{get_usize, layer_types, one_full_layer_in_every, MAX_HEAD_DIM};
use crate::error::{ConfigError, Result};
use serde_json::Value;

/// Largest head count accepted for the linear-attention layers.
const MAX_LINEAR_HEADS: usize = 1 << 16;
/// Largest causal-convolution kernel accepted (published models use 4).
const MAX_CONV_KERNEL: usize = 1 << 10;

/// How a linear-attention layer's input projections are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnLayout {
    /// Qwen3-Next: `in_proj_qkvz` (per key head: q, k, then its value heads' v and z) and `in_proj_ba` (per key
    /// head: its value heads' b, then a).
    Fused,
    /// Qwen3.5: `in_proj_qkv` (all q, all k, all v), `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split,
}

/// The linear-attention (gated delta-net) part of a hybrid config.
#[derive(Clone, Debug)]
pub struct GdnConfig {
    pub layout: GdnLayout,
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub head_k_dim: usize,
    pub head_v_dim: usize,
    pub conv_kernel: usize,
    /// `num_k_heads × head_k_dim`.
    pub key_dim: usize,
    /// `num_v_heads × head_v_dim`.
    pub value_dim: usize,
    /// Channels of the causal convolution: `2 × key_dim + value_dim` (q, k and v).
    pub conv_dim: usize,
    /// Per layer: linear attention (else gated full attention).
    pub linear: Vec<bool>,
}

impl GdnConfig {
    /// Value heads per key head.
    pub fn group(&self) -> usize {
        self.num_v_heads
            .checked_div(self.num_k_heads.max(1))
            .unwrap_or(self.num_v_heads)
    }
}

fn checked(what: &str, v: Option<usize>) -> Result<usize> {
    v.ok_or_else(|| {
        ConfigError::TooLarge {
            field: what.to_string(),
        }
        .into()
    })
}

/// Which layers are linear attention: `layer_types`, else transformers' default of one full-attention layer
/// in every `full_attention_interval` (4).
fn linear_layers(text: &Value, num_layers: usize) -> Result<Vec<bool>> {
    if let Some(l) = layer_types(text, num_layers, "linear_attention")? {
        return Ok(l);
    }
    let interval = match text.get("full_attention_interval") {
        None | Some(Value::Null) => 4,
        Some(v) => v
            .as_u64()
            .filter(|&n| n > 0)
            .ok_or_else(|| ConfigError::WrongType {
                field: "full_attention_interval".into(),
                expected: "a positive integer",
                found: Some(v.clone()),
            })? as usize,
    };
    Ok(one_full_layer_in_every(interval, num_layers))
}

/// The linear-attention heads and sizes in range: value heads a multiple of key heads, each count at most
/// [`MAX_LINEAR_HEADS`], head dimensions at most [`MAX_HEAD_DIM`], the convolution at most [`MAX_CONV_KERNEL`].
fn check_linear_shape(
    num_k_heads: usize,
    num_v_heads: usize,
    head_k_dim: usize,
    head_v_dim: usize,
    conv_kernel: usize,
) -> Result<()> {
    if num_k_heads == 0
        || num_v_heads == 0
        || num_k_heads > MAX_LINEAR_HEADS
        || num_v_heads > MAX_LINEAR_HEADS
        || !num_v_heads.is_multiple_of(num_k_heads)
    {
        return Err(ConfigError::LinearHeads {
            value_heads: num_v_heads,
            key_heads: num_k_heads,
            max: MAX_LINEAR_HEADS,
        }
        .into());
    }
    for (key, d) in [
        ("linear_key_head_dim", head_k_dim),
        ("linear_value_head_dim", head_v_dim),
    ] {
        if d == 0 || d > MAX_HEAD_DIM {
            return Err(ConfigError::OutOfRange {
                field: key.to_string(),
                value: d.to_string(),
                range: format!("(1..={MAX_HEAD_DIM})"),
            }
            .into());
        }
    }
    if conv_kernel == 0 || conv_kernel > MAX_CONV_KERNEL {
        return Err(ConfigError::OutOfRange {
            field: "linear_conv_kernel_dim".into(),
            value: conv_kernel.to_string(),
            range: format!("(1..={MAX_CONV_KERNEL})"),
        }
        .into());
    }
    Ok(())
}

/// The gated delta-net config of `arch` (none for the other architectures). `text` is the text config.
pub(super) fn gdn_config(text: &Value, arch: &str, num_layers: usize) -> Result<Option<GdnConfig>> {
    let layout = match arch {
        "Qwen3NextForCausalLM" => GdnLayout::Fused,
        "Qwen3_5ForCausalLM"
        | "Qwen3_5ForConditionalGeneration"
        | "Qwen3_5MoeForCausalLM"
        | "Qwen3_5MoeForConditionalGeneration" => GdnLayout::Split,
        _ => return Ok(None),
    };
    let linear = linear_layers(text, num_layers)?;
    if let Some(act) = text.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(ConfigError::Unsupported {
                field: "hidden_act".into(),
                value: format!("{act:?}"),
                model: Some(arch.to_string()),
                supported: "silu",
            }
            .into());
        }
    }
    let num_k_heads = get_usize(text, "linear_num_key_heads")?;
    let num_v_heads = get_usize(text, "linear_num_value_heads")?;
    let head_k_dim = get_usize(text, "linear_key_head_dim")?;
    let head_v_dim = get_usize(text, "linear_value_head_dim")?;
    let conv_kernel = get_usize(text, "linear_conv_kernel_dim")?;
    check_linear_shape(
        num_k_heads,
        num_v_heads,
        head_k_dim,
        head_v_dim,
        conv_kernel,
    )?;
    let key_dim = checked(
        "linear_num_key_heads × linear_key_head_dim",
        num_k_heads.checked_mul(head_k_dim),
    )?;
    let value_dim = checked(
        "linear_num_value_heads × linear_value_head_dim",
        num_v_heads.checked_mul(head_v_dim),
    )?;
    let conv_dim = checked(
        "the linear-attention projection width",
        key_dim
            .checked_mul(2)
            .and_then(|k| k.checked_add(value_dim))
            // The fused qkvz projection (2 key_dim + 2 value_dim) must fit too.
            .filter(|c| c.checked_add(value_dim).is_some()),
    )?;
    Ok(Some(GdnConfig {
        layout,
        num_k_heads,
        num_v_heads,
        head_k_dim,
        head_v_dim,
        conv_kernel,
        key_dim,
        value_dim,
        conv_dim,
        linear,
    }))
}

/// Dimensions of each head that rotate: all of `head_dim`, but on the hybrids (`gated`)
/// `floor(partial_rotary_factor × head_dim)`, which must be even, non-zero and at most `head_dim`.
pub(super) fn rotary_dim(
    text: &Value,
    rope_params: Option<&Value>,
    head_dim: usize,
    gated: bool,
) -> Result<usize> {
    if !gated {
        return Ok(head_dim);
    }
    let f = partial_rotary_factor(text, rope_params)?;
    let d = (head_dim as f64 * f as f64).floor() as usize;
    if d == 0 || !d.is_multiple_of(2) || d > head_dim {
        return Err(ConfigError::RotaryDims {
            factor: f,
            head_dim,
            dims: d,
        }
        .into());
    }
    Ok(d)
}

/// A gated full attention (`gated`: the hybrids) has `2 × heads × head_dim` query rows (query and
/// output gate): an error when that count overflows.
pub(super) fn check_gated_query(num_heads: usize, head_dim: usize, gated: bool) -> Result<()> {
    if gated
        && (num_heads
            .checked_mul(head_dim)
            .and_then(|q| q.checked_mul(2)))
        .is_none()
    {
        return Err(ConfigError::TooLarge {
            field: "num_attention_heads × head_dim".into(),
        }
        .into());
    }
    Ok(())
}

/// The fraction of each full-attention head's dimensions that rotate (`partial_rotary_factor`, in
/// `rope_parameters` or at the top of the text config); 1 when absent.
fn partial_rotary_factor(text: &Value, rope_params: Option<&Value>) -> Result<f32> {
    let v = rope_params
        .and_then(|r| r.get("partial_rotary_factor"))
        .or_else(|| text.get("partial_rotary_factor"));
    match v {
        None | Some(Value::Null) => Ok(1.0),
        Some(x) => x
            .as_f64()
            .map(|f| f as f32)
            .filter(|f| *f > 0.0 && *f <= 1.0)
            .ok_or_else(|| {
                ConfigError::OutOfRange {
                    field: "partial_rotary_factor".into(),
                    value: x.to_string(),
                    range: "(0, 1]".into(),
                }
                .into()
            }),
    }
}
