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
    let e = ModelConfig::from_json(json!({"architectures": ["Gemma4ForConditionalGeneration"]}))
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
