//! A generated Qwen3.5-shaped gated delta-net hybrid (multimodal wrapper, MoE with a shared expert, vision tower
//! and MTP tensors) through the whole quantize pipeline, read back by our reader; and `dynamicExclusion` on a
//! hybrid: `auto`, `gdn` and `none` quantize exactly the documented module sets, and the written
//! `quantization_config` says so. The expected sets are derived here from the checkpoint's tensor names by the
//! documented rules, not by the engine's classifier.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::events::MemorySink;
use flexinfer_quant::job::{run, Outcome, QuantizeJob};
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::llama::logits;
use flexinfer_quant::model::{layer_modules, GptqReadConfig, ModelConfig};
use flexinfer_quant::params::{GateParams, GptqParams};
use flexinfer_quant::tensors::TensorStore;
use flexinfer_quant::testkit::{write_dataset, write_hybrid_model, HybridSize};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn quantize(model: &Path, out: &Path, mode: Option<&str>, group: i32) -> Outcome {
    let ds = out.with_extension("calib.jsonl");
    write_dataset(&ds, 8).unwrap();
    let job = QuantizeJob {
        params: GptqParams {
            group_size: group,
            ..Default::default()
        },
        gate: GateParams {
            max_rtn_fallback_percent: 100.0,
            min_modules: 1,
        },
        dynamic_exclusion: mode.map(str::to_string),
        ..QuantizeJob::new(
            model,
            out,
            &ds,
            CalibSettings {
                max_samples: 8,
                max_seq_len: 40,
            },
            "test",
        )
    };
    let sink = MemorySink::default();
    let o = run(&job, &CpuBackend::default(), &sink).unwrap_or_else(|e| panic!("{e}"));
    // The run announced the family's policies (every model here is a hybrid).
    let policies: Vec<String> = sink
        .named("model_policy")
        .iter()
        .filter_map(|f| f.get("policy").and_then(|p| p.as_str()).map(str::to_string))
        .collect();
    assert!(
        policies.iter().any(|p| p == "hybrid-linear-attention"),
        "{policies:?}"
    );
    o
}

/// What a decoder-layer linear is, by the documented naming (independent of the engine's classifier).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    LinearAttn,
    FullAttn,
    Expert,
    SharedExpert,
    DenseMlp,
    Router,
}

fn kind(name: &str) -> Kind {
    if name.ends_with(".mlp.gate") || name.ends_with(".mlp.shared_expert_gate") {
        Kind::Router
    } else if name.contains(".linear_attn.") {
        Kind::LinearAttn
    } else if name.contains(".self_attn.") {
        Kind::FullAttn
    } else if name.contains(".mlp.experts.") {
        Kind::Expert
    } else if name.contains(".mlp.shared_expert.") {
        Kind::SharedExpert
    } else if name.contains(".mlp.") {
        Kind::DenseMlp
    } else {
        panic!("unexpected decoder linear {name}")
    }
}

/// The decoder layers' linears of the source (2-D `.weight` tensors under the text stack's `layers.`).
fn decoder_linears(store: &TensorStore, cfg: &ModelConfig) -> BTreeSet<String> {
    let layers = format!("{}layers.", cfg.text_prefix);
    store
        .entries
        .iter()
        .filter(|(n, e)| n.starts_with(&layers) && e.shape.len() == 2 && n.ends_with(".weight"))
        .map(|(n, _)| n.trim_end_matches(".weight").to_string())
        .collect()
}

/// The modules quantized in a checkpoint: the stems of its `.qweight` tensors.
fn quantized(store: &TensorStore) -> BTreeSet<String> {
    store
        .entries
        .keys()
        .filter_map(|n| n.strip_suffix(".qweight").map(str::to_string))
        .collect()
}

fn generated(dir: &Path) -> PathBuf {
    let model = dir.join("hybrid-model");
    write_hybrid_model(&model, &HybridSize::TINY_MOE, 11).unwrap();
    model
}

#[test]
fn generated_hybrid_quantizes_end_to_end_and_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let model = generated(tmp.path());
    let out = tmp.path().join("hybrid-gptq");
    let o = quantize(&model, &out, None, 32);
    let scfg = ModelConfig::load(&model).unwrap();
    assert!(scfg.hybrid && scfg.gdn.is_some());
    assert_eq!(scfg.text_prefix, "model.language_model.");
    let cfg = ModelConfig::load(&o.output_dir).unwrap();
    assert!(GptqReadConfig::from_config(&cfg).is_some());
    let (sstore, qstore) = (
        TensorStore::open_dir(&model).unwrap(),
        TensorStore::open_dir(&o.output_dir).unwrap(),
    );
    // Every decoder linear but the routers is packed; the linear-attention layers' projections included.
    let want: BTreeSet<String> = decoder_linears(&sstore, &scfg)
        .into_iter()
        .filter(|n| kind(n) != Kind::Router)
        .collect();
    assert_eq!(quantized(&qstore), want);
    assert!(want.iter().any(|n| n.ends_with("linear_attn.in_proj_qkv")));
    // The engine's own module list names the same modules.
    let listed: BTreeSet<String> = (0..cfg.num_layers)
        .flat_map(|l| {
            let p = cfg.layer_prefix(l);
            layer_modules(&cfg, l)
                .into_iter()
                .map(move |s| format!("{p}{}", s.name))
        })
        .collect();
    assert_eq!(listed, want);
    // Everything else is copied byte for byte: the conv / decay / norm tensors, routers, vision tower, MTP.
    for (name, _) in sstore.entries.iter() {
        if want.contains(name.trim_end_matches(".weight")) {
            continue;
        }
        assert_eq!(
            qstore.raw(name).unwrap(),
            sstore.raw(name).unwrap(),
            "{name}"
        );
    }
    for stem in [
        "model.visual.",
        "mtp.",
        "model.language_model.layers.0.linear_attn.conv1d",
    ] {
        assert!(qstore.entries.keys().any(|n| n.starts_with(stem)), "{stem}");
    }
    // Our reader runs the quantized checkpoint; its logits stay close to the source's (every linear at 4 bits,
    // the decay / write-strength projections included: see oracle.rs `min_cosine`).
    let cos = logits_cosine(&qstore, &cfg, &sstore, &scfg);
    assert!(cos > 0.85, "quantized logits cosine {cos}");
    let side: Value = serde_json::from_slice(
        &std::fs::read(
            o.output_dir
                .join(flexinfer_contract::files::QUANTIZATION_QUALITY),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(side["expertCoverage"]["experts"], 4 * 8, "{side}");
}

/// Cosine between the logits of the quantized and the source checkpoint on fixed tokens.
fn logits_cosine(q: &TensorStore, qcfg: &ModelConfig, s: &TensorStore, scfg: &ModelConfig) -> f64 {
    let tokens: Vec<u32> = (0..24).map(|i| (i * 7 % 26) as u32).collect();
    let lq = logits(q, qcfg, &tokens).unwrap();
    let ls = logits(s, scfg, &tokens).unwrap();
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for r in 0..lq.nrows() {
        for c in 0..lq.ncols() {
            let (x, y) = (lq[(r, c)] as f64, ls[(r, c)] as f64);
            assert!(x.is_finite());
            dot += x * y;
            na += x * x;
            nb += y * y;
        }
    }
    dot / (na.sqrt() * nb.sqrt())
}

/// Runs `mode` on `model` and checks the quantized set against `keep(kind)` (true: full precision) and the
/// written `quantization_config` against it. Returns the config.
fn check_mode(model: &Path, out: &Path, mode: &str, group: i32, keep: fn(Kind) -> bool) -> Value {
    let o = quantize(model, out, Some(mode), group);
    let scfg = ModelConfig::load(model).unwrap();
    let sstore = TensorStore::open_dir(model).unwrap();
    let qstore = TensorStore::open_dir(&o.output_dir).unwrap();
    let linears = decoder_linears(&sstore, &scfg);
    let want: BTreeSet<String> = linears
        .iter()
        .filter(|n| kind(n) != Kind::Router && !keep(kind(n)))
        .cloned()
        .collect();
    let got = quantized(&qstore);
    assert_eq!(got, want, "{mode}: quantized modules");
    // Nothing outside the decoder layers is quantized (vision tower, MTP, embeddings, lm_head).
    assert!(got.iter().all(|n| linears.contains(n)), "{mode}");
    let qc: Value =
        serde_json::from_slice(&std::fs::read(o.output_dir.join("config.json")).unwrap()).unwrap();
    let qc = qc["quantization_config"].clone();
    // Every kept decoder linear (routers are never candidates) has its negative `dynamic` override, and only those.
    let kept: BTreeSet<String> = linears
        .iter()
        .filter(|n| kind(n) != Kind::Router && keep(kind(n)))
        .map(|n| format!("-:^{}$", n.replace('.', "\\.")))
        .collect();
    let dynamic: BTreeSet<String> = qc
        .get("dynamic")
        .and_then(Value::as_object)
        .map(|d| d.keys().cloned().collect())
        .unwrap_or_default();
    assert_eq!(dynamic, kept, "{mode}: dynamic overrides");
    // `modules_in_block_to_quantize`, when written, is the union of the layers' quantized lists: each layer's
    // candidates that are listed are exactly the ones it quantized.
    if let Some(blocks) = qc.get("modules_in_block_to_quantize") {
        let listed: BTreeSet<String> = blocks[0]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        for l in 0..scfg.num_layers {
            let p = scfg.layer_prefix(l);
            let layer: BTreeSet<String> = want
                .iter()
                .filter_map(|n| n.strip_prefix(&p).map(str::to_string))
                .collect();
            let listed_here: BTreeSet<String> = linears
                .iter()
                .filter(|n| kind(n) != Kind::Router)
                .filter_map(|n| n.strip_prefix(&p).map(str::to_string))
                .filter(|n| listed.contains(n))
                .collect();
            assert_eq!(layer, listed_here, "{mode}: layer {l}");
        }
    }
    // The quantized checkpoint reads back; with the linear attention in full precision its logits stay close.
    let cfg = ModelConfig::load(&o.output_dir).unwrap();
    let cos = logits_cosine(&qstore, &cfg, &sstore, &scfg);
    eprintln!("{mode}: quantized logits cosine {cos:.4}");
    let floor = if mode == "none" { 0.85 } else { 0.95 };
    assert!(cos > floor, "{mode}: quantized logits cosine {cos}");
    qc
}

#[test]
fn dynamic_exclusion_modes_on_a_generated_hybrid() {
    let tmp = tempfile::tempdir().unwrap();
    let model = generated(tmp.path());
    // auto: attention of both kinds, the shared expert, routers, vision and MTP in full precision.
    let qc = check_mode(&model, &tmp.path().join("auto"), "auto", 32, |k| {
        matches!(k, Kind::LinearAttn | Kind::FullAttn | Kind::SharedExpert)
    });
    // Every layer quantizes the same routed experts: the block list is written.
    assert!(qc.get("modules_in_block_to_quantize").is_some(), "{qc}");
    // gdn: the linear-attention modules in full precision; full attention and every FFN quantized.
    let qc = check_mode(&model, &tmp.path().join("gdn"), "gdn", 32, |k| {
        k == Kind::LinearAttn
    });
    // Linear and full-attention layers quantize different modules, and no listed module is kept anywhere: the
    // union is written.
    assert!(qc.get("modules_in_block_to_quantize").is_some(), "{qc}");
    // none: every decoder linear (routers aside); nothing to override.
    let qc = check_mode(&model, &tmp.path().join("none"), "none", 32, |_| false);
    assert!(qc.get("dynamic").is_none(), "{qc}");
}

/// The Qwen3-Next oracle fixture (fused projections, a dense-MLP layer among the MoE ones) under `auto` and
/// `gdn`: the dense MLP is quantized in both.
#[test]
fn dynamic_exclusion_on_qwen3_next() {
    let tmp = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle/qwen3_next");
    let model = tmp.path().join("qwen3_next");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), model.join(f)).unwrap();
    }
    flexinfer_quant::testkit::write_char_tokenizer(&model).unwrap();
    check_mode(&model, &tmp.path().join("auto"), "auto", 16, |k| {
        matches!(k, Kind::LinearAttn | Kind::FullAttn | Kind::SharedExpert)
    });
    check_mode(&model, &tmp.path().join("gdn"), "gdn", 16, |k| {
        k == Kind::LinearAttn
    });
}

/// A text-only Qwen3.5 checkpoint written with the multimodal tensor prefix (as transformers 5 saves
/// `Qwen3_5ForCausalLM`): the text stack is found under `model.language_model.*` and quantizes.
#[test]
fn text_only_qwen35_with_the_wrapped_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("wrapped");
    let size = HybridSize {
        experts: 0,
        ..HybridSize::TINY_MOE
    };
    write_hybrid_model(&model, &size, 5).unwrap();
    // Turn the multimodal config into the text-only one, keeping the tensors' names.
    let path = model.join("config.json");
    let raw: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let mut text = raw["text_config"].clone();
    text["architectures"] = serde_json::json!(["Qwen3_5ForCausalLM"]);
    std::fs::write(&path, serde_json::to_vec(&text).unwrap()).unwrap();
    let cfg = ModelConfig::load(&model).unwrap();
    assert_eq!(cfg.text_prefix, "model.language_model.");
    assert!(cfg.moe.is_none());
    // From the JSON alone (no weights to look at) the prefix is the text-only one.
    assert_eq!(ModelConfig::from_json(text).unwrap().text_prefix, "model.");
    let o = quantize(&model, &tmp.path().join("out"), Some("gdn"), 32);
    let q = TensorStore::open_dir(&o.output_dir).unwrap();
    assert!(q.contains("model.language_model.layers.3.self_attn.q_proj.qweight"));
    assert!(q.contains("model.language_model.layers.0.mlp.down_proj.qweight"));
    assert!(q.contains("model.language_model.layers.0.linear_attn.in_proj_qkv.weight"));
}
