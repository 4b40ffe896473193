//! Property tests over what a CLI user or a hub hands `flexinfer recommend`:
//! the `--params` text, a `config.json` (any JSON), the hub's model metadata, the source string
//! and any GPU memory figure. The estimate and the recommendation never panic; a parsed parameter
//! count is always finite and positive. A GGUF header the engine wrote, with bytes and words overwritten,
//! cut short or judged against any file length, gives defects naming the file and never panics
//! (a tenth of the cases).
//!
//! 100 000 cases per property by default (`PROPTEST_CASES` overrides).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

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

/// The header of a GGUF file the engine writes (the generated wide Llama at Q4_K_M) and the file's
/// length.
fn engine_gguf_header() -> &'static (Vec<u8>, u64) {
    static H: std::sync::OnceLock<(Vec<u8>, u64)> = std::sync::OnceLock::new();
    H.get_or_init(|| {
        use flexinfer_quant::gguf::{write_gguf_artifact, FileType, GgufArtifactJob};
        use flexinfer_quant::testkit::{self, ModelSize};
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("m");
        testkit::write_model_sized(&src, "LlamaForCausalLM", 1, &ModelSize::GGUF_WIDE).unwrap();
        testkit::write_byte_level_tokenizer(&src).unwrap();
        let out = d.path().join("g");
        let o = write_gguf_artifact(
            &GgufArtifactJob {
                model_dir: &src,
                out_dir: &out,
                file_type: FileType::Q4KM,
                importance: None,
                prequantized: None,
                script_version: "t",
                verify_save_sha256: false,
            },
            &flexinfer_quant::events::NullSink,
        )
        .unwrap();
        let b = std::fs::read(out.join(o.file_name)).unwrap();
        assert!(
            flexinfer_cli::artifact::gguf::check_header_bytes("m.gguf", &b, b.len() as u64)
                .is_empty()
        );
        // everything up to the first tensor's data: the header and its padding
        let header_len = b.len().min(64 * 1024);
        (b[..header_len].to_vec(), b.len() as u64)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases() / 10))]

    /// A GGUF header with bytes overwritten (counts, lengths, types, offsets), cut short, or judged
    /// against any file length: the validator returns defects naming the file, never panics.
    #[test]
    fn gguf_headers_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        words in prop::collection::vec((any::<prop::sample::Index>(), any::<u64>()), 0..2),
        cut in any::<prop::sample::Index>(),
        file_len in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
    ) {
        let (header, len) = engine_gguf_header();
        let mut b = header.clone();
        for (i, v) in edits {
            let i = i.index(b.len());
            b[i] = v;
        }
        for (i, v) in words {
            let i = i.index(b.len() - 8);
            b[i..i + 8].copy_from_slice(&v.to_le_bytes());
        }
        let keep = cut.index(b.len() + 1);
        let short = &b[..keep.max(b.len() / 2)];
        let defects = flexinfer_cli::artifact::gguf::check_header_bytes(
            "m.gguf",
            short,
            file_len.unwrap_or(*len),
        );
        prop_assert!(defects.iter().all(|d| d.starts_with("m.gguf: ")), "{defects:?}");
    }
}
