//! Property tests (issue #15, class 1) over what a CLI user or a hub hands `flexinfer recommend`:
//! the `--params` text, a `config.json` (any JSON), the hub's model metadata, the source string
//! and any GPU memory figure. The estimate and the recommendation never panic; a parsed parameter
//! count is always finite and positive.
//!
//! 100 000 cases per property by default (`PROPTEST_CASES` overrides).

use flexinfer_cli::footprint::{
    arch_facts, from_hub_json, hub_id, params_from_config, parse_params, Footprint,
};
use flexinfer_cli::recommend::{recommend, GpuTarget};
use proptest::prelude::*;
use serde_json::Value;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<f64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        Just(Value::from(0)),
        Just(Value::from(-1)),
        Just(Value::from(f64::MAX)),
        ".{0,5}".prop_map(Value::from),
    ]
}

/// config.json-shaped objects with arbitrary (huge, negative, zero, non-numeric) sizes.
fn config() -> impl Strategy<Value = Value> {
    let keys = [
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts",
        "num_local_experts",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "tie_word_embeddings",
        "model_type",
        "layer_types",
    ];
    (
        prop::collection::btree_map(prop::sample::select(keys.to_vec()), number(), 0..14),
        any::<bool>(),
    )
        .prop_map(|(m, nested)| {
            let obj: serde_json::Map<String, Value> =
                m.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            if nested {
                serde_json::json!({"model_type": "x", "text_config": obj})
            } else {
                Value::Object(obj)
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn params_text_never_panics(s in prop_oneof![
        "\\PC{0,40}",
        "[0-9.eE+-]{0,30}[bBmMtTkK]?",
        "[1-9]e30[0-9][bBmMtTkK]",
    ]) {
        if let Ok(p) = parse_params(&s) {
            prop_assert!(p.is_finite() && p > 0.0, "{s:?} -> {p}");
        }
        let _ = hub_id(&s);
    }

    #[test]
    fn estimates_and_recommendations_never_panic(
        cfg in config(),
        total in number(),
        vram in prop::option::of(any::<i64>()),
        arch in prop::option::of(prop_oneof![
            Just("gfx1100".to_string()), Just("gfx906".to_string()), ".{0,10}".boxed(),
        ]),
        vendor in prop::option::of(".{0,8}"),
    ) {
        let _ = arch_facts(&cfg);
        let from_cfg = params_from_config(&cfg);
        let hub = serde_json::json!({"safetensors": {"total": total}, "config": cfg});
        let gpu = GpuTarget { arch, vendor, vram_mb: vram, source: "test".into() };
        let mut fps: Vec<Footprint> = Vec::new();
        if let Ok(f) = from_hub_json("org/m", &hub) {
            fps.push(f);
        }
        if let Some(p) = from_cfg {
            let (model_type, moe, hybrid) = arch_facts(&cfg);
            fps.push(Footprint { params: p, source: "config".into(), model_type, moe, hybrid });
        }
        for f in &fps {
            prop_assert!(f.params.is_finite() && f.params > 0.0, "params {}", f.params);
            let r = recommend(f, &gpu);
            prop_assert!((3600..=172_800).contains(&r.timeout_seconds), "timeout {}", r.timeout_seconds);
        }
    }
}
