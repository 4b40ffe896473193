//! The sparse-MoE part of a config: expert count, top-k and renormalisation, expert widths, which
//! layers are sparse (Mixtral, Qwen2/3-MoE, Gemma 4's `enable_moe_block`).

use super::{get_usize, MAX_EXPERTS};
use crate::error::{ConfigError, Result};
use crate::model::moe::{Activation, MoeSpec, MoeStyle};
use serde_json::Value;

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

/// `intermediate_size` (the dense MLP's width); a sparse-MoE config without it uses its experts' width.
pub(super) fn intermediate_size(text: &Value, moe: Option<&MoeConfig>) -> Result<usize> {
    match (moe, text.get("intermediate_size")) {
        (Some(m), None) => Ok(m.expert_intermediate),
        _ => get_usize(text, "intermediate_size"),
    }
}

pub(super) fn moe_config(raw: &Value, arch: &str, num_layers: usize) -> Result<Option<MoeConfig>> {
    // Qwen3-Next and Qwen3.5-MoE: Qwen's layout with a gated shared expert beside the routed ones.
    let (qwen_next, qwen35_moe) = (
        arch == "Qwen3NextForCausalLM",
        matches!(
            arch,
            "Qwen3_5MoeForCausalLM" | "Qwen3_5MoeForConditionalGeneration"
        ),
    );
    if qwen_next && raw.get("num_experts").and_then(Value::as_u64) == Some(0) {
        // transformers: no experts, every layer has the dense MLP.
        return Ok(None);
    }
    let style = match arch {
        "MixtralForCausalLM" => MoeStyle::Mixtral,
        "Qwen2MoeForCausalLM" | "Qwen3MoeForCausalLM" => MoeStyle::Qwen,
        _ if qwen_next || qwen35_moe => MoeStyle::Qwen,
        "Gemma4ForCausalLM" | "Gemma4ForConditionalGeneration" => {
            return gemma4_moe_config(raw, num_layers)
        }
        _ => return Ok(None),
    };
    let inter_key = match style {
        MoeStyle::Mixtral => "intermediate_size",
        _ => "moe_intermediate_size",
    };
    let (num_experts, top_k) = routing(raw, style)?;
    let expert_intermediate = get_usize(raw, inter_key)?;
    // transformers: Mixtral and Qwen3.5-MoE always renormalise the top-k weights; the other Qwen MoE blocks only
    // with norm_topk_prob (default false, true on Qwen3-Next).
    let renormalize = match style {
        MoeStyle::Mixtral | MoeStyle::Gemma4 => true,
        MoeStyle::Qwen if qwen35_moe => true,
        MoeStyle::Qwen => raw
            .get("norm_topk_prob")
            .and_then(Value::as_bool)
            .unwrap_or(qwen_next),
    };
    let shared_intermediate = match arch {
        "Qwen2MoeForCausalLM" => Some(get_usize(raw, "shared_expert_intermediate_size")?),
        _ if qwen_next || qwen35_moe => Some(get_usize(raw, "shared_expert_intermediate_size")?),
        _ => None,
    }
    .filter(|&i| i > 0);
    let sparse = sparse_layers(raw, style, qwen35_moe, num_layers);
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

/// The expert count (`num_local_experts` for Mixtral, `num_experts` for Qwen, each accepting the other's
/// name) and `num_experts_per_tok`, checked: at least one expert, at most [`MAX_EXPERTS`], and
/// `1 ≤ top_k ≤ experts`.
fn routing(raw: &Value, style: MoeStyle) -> Result<(usize, usize)> {
    let (experts_key, alias) = match style {
        MoeStyle::Mixtral => ("num_local_experts", "num_experts"),
        // transformers 5 writes Qwen3-MoE's count as `num_local_experts`; the hub checkpoints as `num_experts`.
        _ => ("num_experts", "num_local_experts"),
    };
    let experts_key = if raw.get(experts_key).is_none() && raw.get(alias).is_some() {
        alias
    } else {
        experts_key
    };
    let num_experts = get_usize(raw, experts_key)?;
    let top_k = get_usize(raw, "num_experts_per_tok")?;
    if num_experts == 0 || num_experts > MAX_EXPERTS || top_k == 0 || top_k > num_experts {
        return Err(ConfigError::Routing {
            experts_field: experts_key.to_string(),
            experts: num_experts,
            top_k_field: "num_experts_per_tok",
            top_k,
            max: MAX_EXPERTS,
        }
        .into());
    }
    Ok((num_experts, top_k))
}

/// Which decoder layers have the sparse block: all of them, except for Qwen2/3-MoE, where a layer is sparse
/// when it is not in `mlp_only_layers` and its 1-based index is a multiple of `decoder_sparse_step`.
fn sparse_layers(raw: &Value, style: MoeStyle, qwen35_moe: bool, num_layers: usize) -> Vec<bool> {
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
    (0..num_layers)
        .map(|l| match style {
            // Qwen3.5-MoE: every decoder layer has the sparse block.
            MoeStyle::Qwen if qwen35_moe => true,
            MoeStyle::Qwen => !mlp_only.contains(&l) && l.saturating_add(1).is_multiple_of(step),
            _ => true,
        })
        .collect()
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
        return Err(ConfigError::Routing {
            experts_field: "num_experts".into(),
            experts: num_experts,
            top_k_field: "top_k_experts",
            top_k,
            max: MAX_EXPERTS,
        }
        .into());
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
