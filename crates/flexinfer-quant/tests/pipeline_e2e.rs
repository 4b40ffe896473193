//! End to end on a generated tiny Llama model: quantize, read the artifact back with the consumer's rules,
//! compare logits; resume after an abort; corrupted cache; RTN gate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod common;

use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::events::MemorySink;
use flexinfer_quant::job::{run, QuantizeJob};
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::llama::logits;
use flexinfer_quant::model::ModelConfig;
use flexinfer_quant::params::{GateParams, GptqParams, RecoveryParams};
use flexinfer_quant::tensors::TensorStore;
use flexinfer_quant::QuantError;
use std::path::{Path, PathBuf};

pub fn job(model: &Path, out: &Path, dataset: &Path, params: GptqParams) -> QuantizeJob {
    QuantizeJob {
        params,
        max_shard_bytes: 200_000,
        ..QuantizeJob::new(
            model,
            out,
            dataset,
            CalibSettings {
                max_samples: 16,
                max_seq_len: 48,
            },
            "test",
        )
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn flat_logits(dir: &Path, tokens: &[u32]) -> Vec<f32> {
    let cfg = ModelConfig::load(dir).expect("config");
    let store = TensorStore::open_dir(dir).expect("store");
    let l = logits(&store, &cfg, tokens).expect("logits");
    (0..l.nrows())
        .flat_map(|r| (0..l.ncols()).map(move |c| (r, c)))
        .map(|(r, c)| l[(r, c)])
        .collect()
}

fn setup(name: &str, arch: &str) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::Builder::new()
        .prefix(name)
        .tempdir()
        .expect("tmp");
    let model = tmp.path().join("model");
    common::write_model(&model, arch, 42);
    let ds = tmp.path().join("calib.jsonl");
    common::write_dataset(&ds, 24);
    (tmp, model, ds)
}

#[test]
fn quantize_tiny_llama_and_read_back_with_consumer_rules() {
    let (tmp, model, ds) = setup("e2e", "LlamaForCausalLM");
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 7 + 3) % 150).collect();
    let reference = flat_logits(&model, &tokens);
    for (bits, gs, desc_act, sym, min_cos) in [
        (4u32, 32i32, false, true, 0.97),
        (8, 128, true, true, 0.999),
        (3, 64, true, false, 0.85),
    ] {
        // OUT_DIR is the artifact directory itself.
        let out = tmp.path().join(format!("out{bits}/gptq-w{bits}-g{gs}"));
        let sink = MemorySink::default();
        let params = GptqParams {
            bits,
            group_size: gs,
            desc_act,
            sym,
            ..Default::default()
        };
        let outcome = run(
            &job(&model, &out, &ds, params),
            &CpuBackend::default(),
            &sink,
        )
        .expect("quantize");
        let dir = out.clone();
        assert_eq!(outcome.output_dir, dir);
        for f in [
            "config.json",
            "quantize_config.json",
            "model.safetensors.index.json",
            ".save-complete",
            ".quantization-quality.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            assert!(dir.join(f).exists(), "{f} missing");
        }
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).expect("read"))
                .expect("json");
        let qc = &cfg["quantization_config"];
        assert_eq!(qc["quant_method"], "gptq");
        assert_eq!(qc["bits"], bits);
        assert_eq!(qc["group_size"], gs);
        assert_eq!(qc["desc_act"], desc_act);
        assert_eq!(qc["sym"], sym);
        assert_eq!(
            qc["checkpoint_format"],
            if sym { "gptq" } else { "gptq_v2" }
        );
        assert_eq!(qc["lm_head"], false);
        let store = TensorStore::open_dir(&dir).expect("artifact opens");
        assert!(store.files.len() > 1, "sharded");
        let qw = store
            .entry("model.layers.0.mlp.down_proj.qweight")
            .expect("qweight");
        assert_eq!(qw.dtype, safetensors::Dtype::I32);
        assert_eq!(
            qw.shape,
            vec![common::INTER * bits as usize / 32, common::HIDDEN]
        );
        assert_eq!(
            store
                .entry("model.layers.0.mlp.down_proj.scales")
                .expect("scales")
                .dtype,
            safetensors::Dtype::F16
        );
        assert!(!store.contains("model.layers.0.mlp.down_proj.weight"));
        let src = TensorStore::open_dir(&model).expect("source");
        assert_eq!(
            store.raw("lm_head.weight").expect("lm_head"),
            src.raw("lm_head.weight").expect("lm_head")
        );
        assert_eq!(
            store.entry("model.norm.weight").expect("norm").dtype,
            safetensors::Dtype::BF16
        );
        if bits == 4 {
            assert!(store
                .i32("model.layers.1.self_attn.q_proj.qzeros")
                .expect("qzeros")
                .iter()
                .all(|&w| w as u32 == 0x7777_7777));
        }
        let q = outcome.quality.expect("quality");
        assert_eq!(
            (q.gptq_modules, q.rtn_fallback_modules, q.gate.as_str()),
            (21, 0, "insufficient-sample")
        );
        let cos = cosine(&reference, &flat_logits(&dir, &tokens));
        eprintln!("logit cosine {bits}-bit g{gs} desc_act={desc_act} sym={sym}: {cos:.5}");
        assert!(cos > min_cos, "{bits}-bit cosine {cos}");
        let progress: Vec<f64> = sink
            .named("progress")
            .iter()
            .filter_map(|e| e["percent"].as_f64())
            .collect();
        assert!(
            progress.windows(2).all(|w| w[0] <= w[1]) && progress.last() == Some(&100.0),
            "{progress:?}"
        );
        assert_eq!(
            sink.named("quantization_layer_cached").len(),
            common::LAYERS
        );
        assert!(
            !model.join(".flexinfer-gptq-cache").exists(),
            "cache removed after a successful save"
        );

        // A restarted job short-circuits on the verified artifact and reports the same quality.
        let sink2 = MemorySink::default();
        let again = run(
            &job(
                &model,
                &out,
                &ds,
                GptqParams {
                    bits,
                    group_size: gs,
                    desc_act,
                    sym,
                    ..Default::default()
                },
            ),
            &CpuBackend::default(),
            &sink2,
        )
        .expect("cached");
        assert!(again.cached);
        assert_eq!(sink2.named("quantization_cached").len(), 1);
    }
}

#[test]
fn save_complete_sha256_is_checked_when_asked() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    common::write_model(&model, "LlamaForCausalLM", 2);
    let ds = tmp.path().join("calib.jsonl");
    common::write_dataset(&ds, 24);
    let out = tmp.path().join("out");
    let params = GptqParams::default();
    let mut j = job(&model, &out, &ds, params);
    let first = run(&j, &CpuBackend::default(), &MemorySink::default()).expect("quantize");
    assert!(!first.cached);
    let dir = j.output_dir();
    let sc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(".save-complete")).unwrap()).unwrap();
    let shard = dir.join(sc["shards"][0]["name"].as_str().unwrap());
    let good = std::fs::read(&shard).unwrap();
    // Same size, one byte flipped at the end (tensor data, not the header).
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0xff;
    std::fs::write(&shard, &bad).unwrap();
    // Sizes only (opt-out): the damage is not seen.
    j.verify_save_sha256 = false;
    assert!(
        run(&j, &CpuBackend::default(), &MemorySink::default())
            .unwrap()
            .cached
    );
    // With sha256 verification the artifact is rebuilt and the shard is whole again.
    j.verify_save_sha256 = true;
    let again = run(&j, &CpuBackend::default(), &MemorySink::default()).expect("rebuild");
    assert!(
        !again.cached,
        "a shard whose sha256 differs must not short-circuit"
    );
    assert_eq!(std::fs::read(&shard).unwrap(), good);
    assert!(
        run(&j, &CpuBackend::default(), &MemorySink::default())
            .unwrap()
            .cached
    );
}

#[test]
fn qwen_variants_quantize() {
    for arch in ["Qwen2ForCausalLM", "Qwen3ForCausalLM"] {
        let (tmp, model, ds) = setup("qwen", arch);
        let tokens: Vec<u32> = (0..24u32).map(|i| (i * 5 + 1) % 150).collect();
        let reference = flat_logits(&model, &tokens);
        let out = tmp.path().join("out");
        let o = run(
            &job(
                &model,
                &out,
                &ds,
                GptqParams::default().clone_with_group(32),
            ),
            &CpuBackend::default(),
            &MemorySink::default(),
        )
        .expect("quantize");
        let store = TensorStore::open_dir(&o.output_dir).expect("open");
        if arch == "Qwen2ForCausalLM" {
            assert!(store.contains("model.layers.0.self_attn.q_proj.bias"));
        } else {
            assert!(store.contains("model.layers.0.self_attn.q_norm.weight"));
        }
        let cos = cosine(&reference, &flat_logits(&o.output_dir, &tokens));
        assert!(cos > 0.95, "{arch}: cosine {cos}");
    }
}

trait WithGroup {
    fn clone_with_group(&self, gs: i32) -> GptqParams;
}
impl WithGroup for GptqParams {
    fn clone_with_group(&self, gs: i32) -> GptqParams {
        GptqParams {
            group_size: gs,
            ..self.clone()
        }
    }
}

#[test]
fn resume_after_abort_is_byte_identical_and_corrupt_cache_is_wiped() {
    let (tmp, model, ds) = setup("resume", "LlamaForCausalLM");
    let params = GptqParams {
        bits: 4,
        group_size: 64,
        ..Default::default()
    };
    let straight = tmp.path().join("straight");
    run(
        &job(&model, &straight, &ds, params.clone()),
        &CpuBackend::default(),
        &MemorySink::default(),
    )
    .expect("uninterrupted");
    let expected = common::artifact_files(&straight);

    // Killed after layer 1, restarted: layers 0-1 come from the cache.
    let resumed = tmp.path().join("resumed");
    let mut j = job(&model, &resumed, &ds, params.clone());
    j.abort_after_layer = Some(1);
    assert!(matches!(
        run(&j, &CpuBackend::default(), &MemorySink::default()),
        Err(QuantError::TestAbort(1))
    ));
    assert!(!resumed.exists(), "no output before save");
    assert!(model
        .join(".flexinfer-gptq-cache/layers/layer-001.safetensors")
        .exists());
    j.abort_after_layer = None;
    let sink = MemorySink::default();
    run(&j, &CpuBackend::default(), &sink).expect("resumed run");
    assert_eq!(
        sink.named("quantization_resume_loaded")
            .first()
            .and_then(|e| e["layers"].as_u64()),
        Some(2)
    );
    assert_eq!(
        sink.named("quantization_layer_cached").len(),
        1,
        "only layer 2 is quantized again"
    );
    assert_eq!(
        common::artifact_files(&resumed),
        expected,
        "resumed artifact differs"
    );

    // A corrupted cache file is detected, the cache wiped, and the run completes with the same artifact.
    let corrupt = tmp.path().join("corrupt");
    let mut j = job(&model, &corrupt, &ds, params);
    j.abort_after_layer = Some(0);
    assert!(run(&j, &CpuBackend::default(), &MemorySink::default()).is_err());
    let f = model.join(".flexinfer-gptq-cache/layers/layer-000.safetensors");
    let mut bytes = std::fs::read(&f).expect("read cache");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&f, bytes).expect("corrupt");
    j.abort_after_layer = None;
    let sink = MemorySink::default();
    run(&j, &CpuBackend::default(), &sink).expect("run after corruption");
    let fb = sink.named("quantization_resume_fallback");
    assert!(
        fb.first()
            .and_then(|e| e["reason"].as_str())
            .is_some_and(|r| r.contains("sha256")),
        "{fb:?}"
    );
    assert_eq!(sink.named("quantization_layer_cache_reset").len(), 1);
    assert_eq!(
        sink.named("quantization_layer_cached").len(),
        common::LAYERS
    );
    assert_eq!(common::artifact_files(&corrupt), expected);
}

/// Too few tokens for a full-rank Hessian and no damping or floor allowed: every factorisation fails, and
/// a gate over at least 5 modules with a 10 % limit rejects the run.
fn every_factorisation_fails(j: &mut QuantizeJob) {
    j.calib = CalibSettings {
        max_samples: 1,
        max_seq_len: 6,
    };
    j.recovery = RecoveryParams {
        damp_percent: 0.0,
        damp_auto_increment: 0.0,
        max_floor_attempts: 0,
        ..RecoveryParams::default()
    };
    j.gate = GateParams {
        max_rtn_fallback_percent: 10.0,
        min_modules: 5,
    };
}

#[test]
fn exhausted_hessians_fall_back_to_rtn_and_fail_the_gate() {
    let (tmp, model, ds) = setup("gate", "LlamaForCausalLM");
    let out = tmp.path().join("out");
    let mut j = job(
        &model,
        &out,
        &ds,
        GptqParams {
            bits: 4,
            group_size: 32,
            ..Default::default()
        },
    );
    every_factorisation_fails(&mut j);
    let sink = MemorySink::default();
    let q = match run(&j, &CpuBackend::default(), &sink) {
        Err(QuantError::GateFailed(q)) => q,
        other => panic!("expected the gate to reject the run, got {other:?}"),
    };
    assert!(q.rtn_fallback_modules > 0, "{q:?}");
    assert_eq!(q.gate, "failed");
    assert_eq!(sink.named("quantization_quality")[0]["gate"], "failed");
    assert!(sink
        .named("hessian_recovery")
        .iter()
        .any(|e| e["result"] == "exhausted"));
    // Nothing was promoted: no artifact, no staging; a second run is rejected again (no cached pass).
    assert!(!out.exists(), "a gated run must not write the artifact");
    assert!(!tmp.path().join(".out.partial").exists());
    assert!(matches!(
        run(&j, &CpuBackend::default(), &MemorySink::default()),
        Err(QuantError::GateFailed(_))
    ));
}

/// sha256 of every file under `dir` (name → digest).
fn tree_digest(dir: &Path) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().to_string(),
                flexinfer_fsutil::sha256_file(&e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_gated_requantization_leaves_the_served_artifact_untouched() {
    let (tmp, model, ds) = setup("gatekeep", "LlamaForCausalLM");
    let out = tmp.path().join("out");
    let params = GptqParams {
        bits: 4,
        group_size: 32,
        ..Default::default()
    };
    let good = job(&model, &out, &ds, params.clone());
    run(&good, &CpuBackend::default(), &MemorySink::default()).expect("first run");
    let before = tree_digest(&out);
    assert!(before.iter().any(|(n, _)| n == ".save-complete"));
    // A re-quantization with another configuration whose factorisations all fail and whose gate fails.
    let mut bad = job(&model, &out, &ds, params);
    every_factorisation_fails(&mut bad);
    let r = run(&bad, &CpuBackend::default(), &MemorySink::default());
    assert!(matches!(r, Err(QuantError::GateFailed(_))), "{r:?}");
    assert_eq!(
        tree_digest(&out),
        before,
        "the artifact that passed its gate must survive a rejected re-run byte for byte"
    );
    // And it is still reusable by its own configuration.
    assert!(
        run(&good, &CpuBackend::default(), &MemorySink::default())
            .unwrap()
            .cached
    );
}

#[test]
fn an_artifact_is_reused_only_by_the_configuration_that_made_it() {
    let (tmp, model, ds) = setup("digest", "LlamaForCausalLM");
    let out = tmp.path().join("out");
    let params = GptqParams {
        bits: 4,
        group_size: 32,
        ..Default::default()
    };
    let base = job(&model, &out, &ds, params.clone());
    let first = run(&base, &CpuBackend::default(), &MemorySink::default()).expect("first");
    assert!(!first.cached);
    let sc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join(".save-complete")).unwrap()).unwrap();
    assert_eq!(sc["config_digest"], first.config_digest.as_str());
    let again = run(&base, &CpuBackend::default(), &MemorySink::default()).unwrap();
    assert!(again.cached && again.config_digest == first.config_digest);

    let other_ds = tmp.path().join("other.jsonl");
    common::write_dataset(&other_ds, 30);
    let mut digests = vec![first.config_digest.clone()];
    let variants: Vec<(&str, QuantizeJob)> = vec![
        (
            "sym",
            job(
                &model,
                &out,
                &ds,
                GptqParams {
                    sym: false,
                    ..params.clone()
                },
            ),
        ),
        ("dataset", job(&model, &out, &other_ds, params.clone())),
        (
            "maxSamples",
            QuantizeJob {
                calib: CalibSettings {
                    max_samples: 8,
                    max_seq_len: 48,
                },
                ..job(&model, &out, &ds, params.clone())
            },
        ),
        (
            "damping",
            QuantizeJob {
                recovery: RecoveryParams {
                    damp_percent: 0.02,
                    ..RecoveryParams::default()
                },
                ..job(&model, &out, &ds, params.clone())
            },
        ),
        (
            "exclusion",
            QuantizeJob {
                dynamic_exclusion: Some("o_proj".into()),
                ..job(&model, &out, &ds, params.clone())
            },
        ),
    ];
    for (what, j) in variants {
        let sink = MemorySink::default();
        let o = run(&j, &CpuBackend::default(), &sink).expect(what);
        assert!(
            !o.cached,
            "a changed {what} must not reuse the old artifact"
        );
        assert_eq!(sink.named("quantization_reuse_rejected").len(), 1, "{what}");
        assert!(
            !digests.contains(&o.config_digest),
            "{what}: digest must change"
        );
        digests.push(o.config_digest);
    }
    // The last variant's artifact is what `out` holds now, with its own configuration.
    let qc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("quantize_config.json")).unwrap()).unwrap();
    assert!(qc["dynamic"].is_object(), "{qc}");
}

#[test]
fn dynamic_exclusion_keeps_modules_in_full_precision() {
    let (tmp, model, ds) = setup("excl", "LlamaForCausalLM");
    let out = tmp.path().join("out");
    let mut j = job(
        &model,
        &out,
        &ds,
        GptqParams {
            group_size: 32,
            ..Default::default()
        },
    );
    j.dynamic_exclusion = Some("mlp.down_proj,layers.1.self_attn.o_proj".into());
    let o = run(&j, &CpuBackend::default(), &MemorySink::default()).expect("quantize");
    let store = TensorStore::open_dir(&o.output_dir).expect("open");
    let src = TensorStore::open_dir(&model).expect("source");
    for name in [
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
    ] {
        assert_eq!(
            store.raw(name).expect("kept"),
            src.raw(name).expect("source"),
            "{name}"
        );
    }
    assert!(store.contains("model.layers.0.self_attn.o_proj.qweight"));
    assert!(!store.contains("model.layers.2.mlp.down_proj.qweight"));
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(o.output_dir.join("config.json")).expect("read"))
            .expect("json");
    let dynamic = cfg["quantization_config"]["dynamic"]
        .as_object()
        .expect("dynamic");
    assert_eq!(dynamic.len(), 4);
    assert!(dynamic.contains_key("-:^model\\.layers\\.0\\.mlp\\.down_proj$"));
    let q = o.quality.expect("quality");
    assert_eq!(q.gptq_modules, 21 - 4);
}
