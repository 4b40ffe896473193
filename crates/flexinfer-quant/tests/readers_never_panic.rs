//! Property tests of the readers of untrusted model files: the safetensors header parser, the
//! `model.safetensors.index.json` reader and the `config.json` reader return an error or a value
//! for any input, and never panic (100 000 cases each; `PROPTEST_CASES` overrides).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::path::Path;

use flexinfer_quant::model::ModelConfig;
use flexinfer_quant::tensors::{index_names, parse_header};
use proptest::prelude::*;
use serde_json::{json, Value};

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000)
}

/// Numbers around the edges of every integer width, and small ones.
fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u64..64).prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        prop::sample::select(vec![
            0u64,
            1,
            u64::from(u32::MAX),
            u64::from(u32::MAX) + 1,
            i64::MAX as u64,
            u64::MAX,
            u64::MAX - 1
        ])
        .prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
    ]
}

/// Any JSON value, biased to the shapes the readers look at.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        number(),
        ".{0,12}".prop_map(Value::from),
        prop::sample::select(vec![
            "F32",
            "F16",
            "BF16",
            "I32",
            "U8",
            "F8_E4M3",
            "F4",
            "../x",
            "/abs",
            "",
            "a/../../b",
            "model-00001.safetensors",
            "LlamaForCausalLM",
            "Qwen3ForCausalLM",
            "llama3",
            "linear",
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(
                prop::sample::select(vec![
                    "dtype",
                    "shape",
                    "data_offsets",
                    "__metadata__",
                    "weight_map",
                    "t",
                    "architectures",
                    "hidden_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "rope_scaling",
                    "rope_type",
                    "factor",
                    "vocab_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "tie_word_embeddings",
                ])
                .prop_map(String::from),
                inner,
                0..6,
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A tensor entry whose fields are plausible or extreme.
fn tensor() -> impl Strategy<Value = Value> {
    (
        prop::sample::select(vec!["F32", "F16", "BF16", "I32", "U8", "F4", "XX"]),
        prop::collection::vec(
            prop_oneof![0u64..8, any::<u64>(), Just(u64::MAX), Just(1u64 << 32)],
            0..4,
        ),
        prop_oneof![0u64..64, any::<u64>(), Just(u64::MAX)],
        prop_oneof![0u64..64, any::<u64>(), Just(u64::MAX)],
    )
        .prop_map(
            |(dtype, shape, a, b)| json!({"dtype": dtype, "shape": shape, "data_offsets": [a, b]}),
        )
}

/// A safetensors file: a length prefix (right, off by a little, or wild), a JSON header (valid
/// shape with extreme numbers, or any JSON) and some data bytes.
fn safetensors_file() -> impl Strategy<Value = Vec<u8>> {
    let header = prop_oneof![
        prop::collection::btree_map("[a-c]{1,2}", tensor(), 0..4)
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        value(),
    ];
    (
        header,
        prop_oneof![Just(0i64), -3i64..3, any::<i64>()],
        prop::collection::vec(any::<u8>(), 0..128),
        prop::collection::vec(any::<u8>(), 0..4),
    )
        .prop_map(|(h, skew, data, junk)| {
            let text = h.to_string();
            let n = (text.len() as i64).wrapping_add(skew) as u64;
            let mut b = n.to_le_bytes().to_vec();
            b.extend_from_slice(text.as_bytes());
            b.extend_from_slice(&junk);
            b.extend_from_slice(&data);
            b
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn safetensors_headers(bytes in prop_oneof![safetensors_file(), prop::collection::vec(any::<u8>(), 0..64)]) {
        if let Ok(entries) = parse_header(&bytes, 0) {
            for (_, e) in entries {
                prop_assert!(e.start <= e.end && e.end <= bytes.len());
            }
        }
    }

    #[test]
    fn index_json(v in prop_oneof![
        value(),
        prop::collection::btree_map(".{0,6}", value(), 0..5).prop_map(|m| json!({"weight_map": m})),
    ]) {
        if let Ok(names) = index_names(Path::new("model.safetensors.index.json"), &v) {
            for n in names {
                prop_assert!(!n.is_empty() && !n.starts_with('/') && !n.split('/').any(|c| c == ".."));
            }
        }
    }

    #[test]
    fn config_json(v in prop_oneof![
        value(),
        prop::collection::btree_map(
            prop::sample::select(vec![
                "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta",
                "rope_scaling", "tie_word_embeddings",
            ]).prop_map(String::from),
            prop_oneof![number(), value()],
            0..11,
        ).prop_map(|m| {
            let mut o: serde_json::Map<String, Value> = m.into_iter().collect();
            o.insert("architectures".into(), json!(["LlamaForCausalLM"]));
            Value::Object(o)
        }),
    ]) {
        let _ = ModelConfig::from_json(v);
    }

    /// Gemma 4 configs (text, or nested under `text_config` of the multimodal wrapper): a valid one with a few
    /// fields replaced by arbitrary values.
    #[test]
    fn gemma4_config_json(
        over in prop::collection::btree_map(
            prop::sample::select(vec![
                "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
                "num_global_key_value_heads", "attention_k_eq_v", "num_hidden_layers", "intermediate_size",
                "layer_types", "per_layer_config", "rope_parameters", "enable_moe_block", "num_experts",
                "top_k_experts", "moe_intermediate_size", "sliding_window", "num_kv_shared_layers",
                "hidden_size_per_layer_input", "final_logit_softcapping", "use_bidirectional_attention",
            ]).prop_map(String::from),
            prop_oneof![number(), value()],
            0..5,
        ),
        wrapped in any::<bool>(),
    ) {
        let mut text = json!({
            "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
            "attention_k_eq_v": true, "vocab_size": 96, "sliding_window": 8, "enable_moe_block": true,
            "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
            "per_layer_config": {"2": {"head_dim": 32}, "3": {"head_dim": 32, "num_key_value_heads": 1}},
            "rope_parameters": {
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}
            }
        });
        for (k, v) in over {
            text[k] = v;
        }
        let v = if wrapped {
            json!({"architectures": ["Gemma4ForConditionalGeneration"], "text_config": text})
        } else {
            text["architectures"] = json!(["Gemma4ForCausalLM"]);
            text
        };
        if let Ok(cfg) = ModelConfig::from_json(v) {
            // What the engine derives from a config it accepted must not panic either.
            let _ = cfg.inv_freq();
            let _ = cfg.local_inv_freq();
            for l in 0..cfg.num_layers.min(8) {
                let _ = flexinfer_quant::model::layer_modules(&cfg, l);
            }
        }
    }
}
