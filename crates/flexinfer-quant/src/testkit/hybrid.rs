//! A generated Qwen3.5-style gated delta-net hybrid ([`write_hybrid_model`]).

use serde_json::json;
use std::path::Path;

use super::*;

/// Shape of a generated Qwen3.5-style gated delta-net hybrid ([`write_hybrid_model`]).
#[derive(Clone, Debug)]
pub struct HybridSize {
    pub hidden: usize,
    pub layers: usize,
    /// One full-attention layer in every `full_attention_interval` (the others are linear attention).
    pub full_attention_interval: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub linear_k_heads: usize,
    pub linear_v_heads: usize,
    pub linear_k_dim: usize,
    pub linear_v_dim: usize,
    /// Dense MLP width (no experts), or the routed experts' width with `experts > 0`.
    pub inter: usize,
    /// Routed experts per layer (0: dense Qwen3.5); with experts, a shared expert of `inter` and top-`top_k`.
    pub experts: usize,
    pub top_k: usize,
    pub vocab: usize,
    /// `Qwen3_5MoeForConditionalGeneration` / `Qwen3_5ForConditionalGeneration`: `text_config`,
    /// `model.language_model.*`, a small vision tower and MTP tensors.
    pub multimodal: bool,
}

impl HybridSize {
    /// A small MoE hybrid for the pipeline tests: 4 layers (3 linear, 1 full), 8 experts top 2, multimodal.
    pub const TINY_MOE: HybridSize = HybridSize {
        hidden: 128,
        layers: 4,
        full_attention_interval: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        linear_k_heads: 2,
        linear_v_heads: 8,
        linear_k_dim: 32,
        linear_v_dim: 16,
        inter: 64,
        experts: 8,
        top_k: 2,
        vocab: VOCAB,
        multimodal: true,
    };
}

/// A Qwen3.5-shaped gated delta-net hybrid (split linear-attention projections, output-gated full attention,
/// zero-centred norms, partial rope; with experts: routed experts, a shared expert and its gate), BF16 in two
/// shards + index, with the char tokenizer. Random weights: for the pipeline's plumbing; the forward is checked
/// against transformers by the oracle fixtures.
pub fn write_hybrid_model(dir: &Path, size: &HybridSize, seed: u64) -> Result<(), String> {
    let h = size.hidden;
    let (kd, vd) = (
        size.linear_k_heads * size.linear_k_dim,
        size.linear_v_heads * size.linear_v_dim,
    );
    let nv = size.linear_v_heads;
    let (mut rng, text, mut tensors) =
        start_model(dir, seed, size.multimodal, (size.vocab, h, 1.0))?;
    let mut randn = |n: usize, std: f32| normal_samples(&mut rng, n, std);
    let mut push = |name: String, shape: Vec<usize>, v: Vec<f32>| tensors.push((name, shape, v));
    push(
        "lm_head.weight".into(),
        vec![size.vocab, h],
        randn(size.vocab * h, 0.05),
    );
    // Zero-centred norms (multiplied by 1 + w): small weights.
    let small = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| 0.05 * ((i * 37 % 11) as f32 / 11.0 - 0.5))
            .collect()
    };
    push(format!("{text}norm.weight"), vec![h], small(h));
    let mut layer_types = Vec::with_capacity(size.layers);
    for l in 0..size.layers {
        let p = format!("{text}layers.{l}.");
        let linear = !(l + 1).is_multiple_of(size.full_attention_interval.max(1));
        layer_types.push(if linear {
            "linear_attention"
        } else {
            "full_attention"
        });
        let mut lin = |m: &str, out: usize, inp: usize| {
            (
                format!("{p}{m}.weight"),
                vec![out, inp],
                randn(out * inp, 1.0 / (inp as f32).sqrt()),
            )
        };
        let mut layer = Vec::new();
        if linear {
            layer.push(lin("linear_attn.in_proj_qkv", 2 * kd + vd, h));
            layer.push(lin("linear_attn.in_proj_z", vd, h));
            layer.push(lin("linear_attn.in_proj_b", nv, h));
            layer.push(lin("linear_attn.in_proj_a", nv, h));
            layer.push(lin("linear_attn.out_proj", h, vd));
        } else {
            let q = size.heads * size.head_dim;
            let kv = size.kv_heads * size.head_dim;
            layer.push(lin("self_attn.q_proj", 2 * q, h));
            layer.push(lin("self_attn.k_proj", kv, h));
            layer.push(lin("self_attn.v_proj", kv, h));
            layer.push(lin("self_attn.o_proj", h, q));
        }
        if size.experts == 0 {
            layer.push(lin("mlp.gate_proj", size.inter, h));
            layer.push(lin("mlp.up_proj", size.inter, h));
            layer.push(lin("mlp.down_proj", h, size.inter));
        } else {
            for e in 0..size.experts {
                layer.push(lin(&format!("mlp.experts.{e}.gate_proj"), size.inter, h));
                layer.push(lin(&format!("mlp.experts.{e}.up_proj"), size.inter, h));
                layer.push(lin(&format!("mlp.experts.{e}.down_proj"), h, size.inter));
            }
            layer.push(lin("mlp.shared_expert.gate_proj", size.inter, h));
            layer.push(lin("mlp.shared_expert.up_proj", size.inter, h));
            layer.push(lin("mlp.shared_expert.down_proj", h, size.inter));
            layer.push(lin("mlp.shared_expert_gate", 1, h));
            let mut router = lin("mlp.gate", size.experts, h);
            router.2.iter_mut().for_each(|v| *v *= 3.0);
            layer.push(router);
        }
        for t in layer {
            push(t.0, t.1, t.2);
        }
        push(format!("{p}input_layernorm.weight"), vec![h], small(h));
        push(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            small(h),
        );
        if linear {
            let k = 4;
            push(
                format!("{p}linear_attn.conv1d.weight"),
                vec![2 * kd + vd, 1, k],
                randn((2 * kd + vd) * k, 0.5),
            );
            push(format!("{p}linear_attn.dt_bias"), vec![nv], vec![1.0; nv]);
            push(
                format!("{p}linear_attn.A_log"),
                vec![nv],
                (0..nv).map(|i| (1.0 + i as f32).ln()).collect(),
            );
            push(
                format!("{p}linear_attn.norm.weight"),
                vec![size.linear_v_dim],
                vec![1.0; size.linear_v_dim],
            );
        } else {
            push(
                format!("{p}self_attn.q_norm.weight"),
                vec![size.head_dim],
                small(size.head_dim),
            );
            push(
                format!("{p}self_attn.k_norm.weight"),
                vec![size.head_dim],
                small(size.head_dim),
            );
        }
    }
    if size.multimodal {
        for (n, shape) in [
            ("model.visual.blocks.0.attn.qkv.weight", vec![96, 32]),
            ("model.visual.blocks.0.mlp.linear_fc1.weight", vec![32, 32]),
            ("model.visual.merger.linear_fc2.weight", vec![h, 32]),
            ("mtp.fc.weight", vec![h, 2 * h]),
            ("mtp.layers.0.self_attn.q_proj.weight", vec![2 * h, h]),
            (
                "mtp.layers.0.mlp.experts.0.up_proj.weight",
                vec![size.inter, h],
            ),
        ] {
            let len = shape.iter().product();
            push(n.to_string(), shape, randn(len, 0.1));
        }
    }
    write_shards(dir, tensors)?;
    let moe = size.experts > 0;
    let mut text_cfg = json!({
        "model_type": if moe { "qwen3_5_moe_text" } else { "qwen3_5_text" },
        "hidden_size": h, "num_hidden_layers": size.layers, "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads, "head_dim": size.head_dim, "vocab_size": size.vocab,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 4096,
        "tie_word_embeddings": false, "layer_types": layer_types,
        "linear_num_key_heads": size.linear_k_heads, "linear_num_value_heads": nv,
        "linear_key_head_dim": size.linear_k_dim, "linear_value_head_dim": size.linear_v_dim,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": true},
    });
    if moe {
        text_cfg["num_experts"] = json!(size.experts);
        text_cfg["num_experts_per_tok"] = json!(size.top_k);
        text_cfg["moe_intermediate_size"] = json!(size.inter);
        text_cfg["shared_expert_intermediate_size"] = json!(size.inter);
    } else {
        text_cfg["intermediate_size"] = json!(size.inter);
    }
    let (causal, cond) = if moe {
        (
            "Qwen3_5MoeForCausalLM",
            "Qwen3_5MoeForConditionalGeneration",
        )
    } else {
        ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    };
    let cfg = if size.multimodal {
        json!({"architectures": [cond], "model_type": if moe { "qwen3_5_moe" } else { "qwen3_5" },
               "text_config": text_cfg, "vision_config": {"hidden_size": 32, "depth": 1},
               "tie_word_embeddings": false})
    } else {
        text_cfg["architectures"] = json!([causal]);
        text_cfg
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&cfg).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())
}
