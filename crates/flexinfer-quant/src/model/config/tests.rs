use super::*;
use crate::model::layer_modules;
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
    let e = ModelConfig::from_json(v)
        .map_err(|e| flexinfer_contract::error::chain(&e))
        .unwrap_err();
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
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err();
        assert!(e.contains(field), "{extra}: {e}");
    }
    // The multimodal wrapper without its text stack.
    let e = ModelConfig::from_json(json!({"architectures": ["Gemma4ForConditionalGeneration"]}))
        .map_err(|e| flexinfer_contract::error::chain(&e))
        .unwrap_err();
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

/// A Qwen3.5-MoE hub config (multimodal wrapper, no `layer_types`); `extra` overrides text fields.
fn qwen35_moe_hub(extra: Value) -> Value {
    let mut text = json!({
        "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 96,
        "hidden_act": "silu", "linear_num_key_heads": 2, "linear_num_value_heads": 8,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": true}
    });
    if let (Some(o), Some(e)) = (text.as_object_mut(), extra.as_object()) {
        for (k, x) in e {
            o.insert(k.clone(), x.clone());
        }
    }
    json!({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "vision_config": {"depth": 1}})
}

#[test]
fn qwen35_moe_hub_config() {
    let cfg = ModelConfig::from_json(qwen35_moe_hub(json!({}))).unwrap();
    assert!(cfg.hybrid);
    assert_eq!(cfg.text_prefix, "model.language_model.");
    let g = cfg.gdn.as_ref().unwrap();
    // No layer_types: one full-attention layer in every four.
    assert_eq!(g.linear, [true, true, true, false, true, true, true, false]);
    assert_eq!(
        (g.key_dim, g.value_dim, g.conv_dim, g.group()),
        (32, 128, 192, 4)
    );
    // Partial rope: a quarter of the 32 dimensions rotate.
    assert_eq!(cfg.rotary_dim, 8);
    assert_eq!(cfg.inv_freq().len(), 4);
    // Zero-centred norms.
    assert_eq!(cfg.norm_weight(vec![0.5]), [1.5]);
    // Every layer sparse, top-k renormalised, a shared expert.
    let m = cfg.moe.as_ref().unwrap();
    assert!(m.sparse.iter().all(|s| *s) && m.spec.renormalize);
    assert_eq!(m.shared_intermediate, Some(64));
    // Linear-attention modules first (split layout), then the experts; full attention has the gated q_proj.
    let lin = layer_modules(&cfg, 0);
    let names: Vec<&str> = lin.iter().take(5).map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "linear_attn.in_proj_qkv",
            "linear_attn.in_proj_z",
            "linear_attn.in_proj_b",
            "linear_attn.in_proj_a",
            "linear_attn.out_proj"
        ]
    );
    assert_eq!(lin[0].shape, (192, 64));
    assert_eq!(lin[4].shape, (64, 128));
    assert_eq!(lin[5].name, "mlp.experts.0.gate_proj");
    assert_eq!(lin.len(), 5 + 3 * 8 + 3);
    let full = layer_modules(&cfg, 3);
    assert_eq!(full[0].name, "self_attn.q_proj");
    assert_eq!(full[0].shape, (2 * 4 * 32, 64));
    assert_eq!(full[3].shape, (64, 4 * 32));
    assert_eq!(crate::model::input_groups(&cfg, 0)[0], [0, 1, 2, 3]);
    assert_eq!(crate::model::input_groups(&cfg, 3)[1], [3]);
}

#[test]
fn qwen3_next_fused_layout_and_defaults() {
    let raw = json!({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "mlp_only_layers": [1],
        "rope_theta": 1e6, "partial_rotary_factor": 0.5,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    });
    let cfg = ModelConfig::from_json(raw.clone()).unwrap();
    assert_eq!(cfg.text_prefix, "model.");
    assert_eq!(cfg.rotary_dim, 8);
    let m = cfg.moe.as_ref().unwrap();
    // norm_topk_prob defaults to true on Qwen3-Next; mlp_only_layers are dense.
    assert!(m.spec.renormalize);
    assert_eq!(m.sparse, [true, false, true, true]);
    let mods = layer_modules(&cfg, 1);
    let names: Vec<&str> = mods.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "linear_attn.in_proj_qkvz",
            "linear_attn.in_proj_ba",
            "linear_attn.out_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj"
        ]
    );
    assert_eq!(mods[0].shape, (2 * 32 + 2 * 32, 64));
    assert_eq!(mods[1].shape, (8, 64));
    assert_eq!(mods[3].shape, (96, 64));
    // No experts: a dense hybrid.
    let mut dense = raw.clone();
    dense["num_experts"] = json!(0);
    assert!(ModelConfig::from_json(dense).unwrap().moe.is_none());
}

#[test]
fn bad_hybrid_fields_are_named_and_never_panic() {
    for (extra, field) in [
        (
            json!({"linear_num_value_heads": 3}),
            "linear_num_value_heads",
        ),
        (json!({"linear_num_key_heads": 0}), "linear_num_key_heads"),
        (json!({"linear_key_head_dim": 0}), "linear_key_head_dim"),
        (
            json!({"linear_value_head_dim": u64::MAX}),
            "linear_value_head_dim",
        ),
        (
            json!({"linear_conv_kernel_dim": 0}),
            "linear_conv_kernel_dim",
        ),
        (
            json!({"linear_conv_kernel_dim": u64::MAX}),
            "linear_conv_kernel_dim",
        ),
        (json!({"hidden_act": "gelu"}), "hidden_act"),
        (json!({"layer_types": ["linear_attention"]}), "layer_types"),
        (
            json!({"layer_types": ["mamba", "linear_attention", "linear_attention", "full_attention",
                                   "linear_attention", "linear_attention", "linear_attention", "full_attention"]}),
            "layer_types",
        ),
        (
            json!({"full_attention_interval": 0}),
            "full_attention_interval",
        ),
        (
            json!({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}}),
            "partial_rotary_factor",
        ),
        (
            json!({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.01}}),
            "partial_rotary_factor",
        ),
        (json!({"linear_key_head_dim": 65537}), "linear_key_head_dim"),
        (
            json!({"linear_num_value_heads": 1u64 << 20}),
            "linear_num_value_heads",
        ),
        (
            json!({"linear_num_value_heads": null}),
            "linear_num_value_heads",
        ),
    ] {
        let e = ModelConfig::from_json(qwen35_moe_hub(extra.clone()))
            .map(|_| ())
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err();
        assert!(e.contains(field), "{extra}: {e}");
    }
}
