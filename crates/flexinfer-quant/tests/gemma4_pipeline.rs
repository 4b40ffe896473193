//! The whole quantize job on generated Gemma 4 models (testkit: BF16, two shards + index): dense, MoE with the
//! hub's fused expert tensors, and the multimodal wrapper. The artifact is read back with the consumer's rules
//! (every candidate linear packed, keys-as-values `v_proj` absent, fused experts replaced by per-expert
//! modules, everything else byte for byte), its logits stay close to the source's, and a run killed after a
//! layer resumes to a byte-identical artifact. The forward itself is checked against transformers in
//! `oracle.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod common;

use faer::Mat;
use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::events::MemorySink;
use flexinfer_quant::job::{run, QuantizeJob};
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::llama::logits;
use flexinfer_quant::model::{layer_modules, GptqReadConfig, ModelConfig};
use flexinfer_quant::params::{GateParams, GptqParams};
use flexinfer_quant::tensors::TensorStore;
use flexinfer_quant::testkit::{write_gemma4_model, Gemma4Options};
use flexinfer_quant::QuantError;
use std::path::Path;

fn job(model: &Path, out: &Path, ds: &Path) -> QuantizeJob {
    QuantizeJob {
        params: GptqParams {
            group_size: 32,
            ..Default::default()
        },
        gate: GateParams {
            max_rtn_fallback_percent: 100.0,
            min_modules: 1,
        },
        ..QuantizeJob::new(
            model,
            out,
            ds,
            CalibSettings {
                max_samples: 16,
                max_seq_len: 40,
            },
            "test",
        )
    }
}

fn cosine(a: &Mat<f32>, b: &Mat<f32>) -> f64 {
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for r in 0..a.nrows() {
        for c in 0..a.ncols() {
            let (x, y) = (a[(r, c)] as f64, b[(r, c)] as f64);
            dot += x * y;
            na += x * x;
            nb += y * y;
        }
    }
    dot / (na.sqrt() * nb.sqrt())
}

const VARIANTS: [(&str, Gemma4Options); 3] = [
    (
        "dense",
        Gemma4Options {
            moe: false,
            multimodal: false,
        },
    ),
    (
        "moe",
        Gemma4Options {
            moe: true,
            multimodal: false,
        },
    ),
    (
        "moe-multimodal",
        Gemma4Options {
            moe: true,
            multimodal: true,
        },
    ),
];

#[test]
fn generated_gemma4_models_quantize_and_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("calib.jsonl");
    common::write_dataset(&ds, 24);
    let tokens: Vec<u32> = (0..30).map(|i| (i * 7 % 26) as u32).collect();
    for (name, opts) in VARIANTS {
        let model = tmp.path().join(format!("{name}-model"));
        write_gemma4_model(&model, opts, 7).unwrap();
        let out = tmp.path().join(format!("{name}-gptq"));
        let o = run(
            &job(&model, &out, &ds),
            &CpuBackend::default(),
            &MemorySink::default(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let q = o.quality.unwrap();
        assert_eq!(q.rtn_fallback_modules, 0, "{name}: {q:?}");
        let cfg = ModelConfig::load(&out).unwrap();
        assert!(GptqReadConfig::from_config(&cfg).is_some(), "{name}");
        let qs = TensorStore::open_dir(&out).unwrap();
        let ss = TensorStore::open_dir(&model).unwrap();
        let mut candidates = 0;
        for layer in 0..cfg.num_layers {
            let p = cfg.layer_prefix(layer);
            for spec in layer_modules(&cfg, layer) {
                let n = format!("{p}{}", spec.name);
                if spec.tied {
                    assert!(
                        !qs.contains(&format!("{n}.qweight"))
                            && !qs.contains(&format!("{n}.weight")),
                        "{name}: {n}"
                    );
                    continue;
                }
                assert!(qs.contains(&format!("{n}.qweight")), "{name}: {n}");
                assert!(!qs.contains(&format!("{n}.weight")), "{name}: {n}");
                candidates += 1;
            }
        }
        assert_eq!(q.gptq_modules, candidates as u64, "{name}");
        for (n, _) in ss.entries.iter() {
            if n.ends_with("experts.gate_up_proj") || n.ends_with("experts.down_proj") {
                assert!(!qs.contains(n), "{name}: {n}");
            } else if !qs.contains(&format!("{}.qweight", n.trim_end_matches(".weight"))) {
                assert_eq!(qs.raw(n).unwrap(), ss.raw(n).unwrap(), "{name}: {n}");
            }
        }
        if opts.multimodal {
            assert!(qs.contains("model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight"));
            assert_eq!(cfg.text_prefix, "model.language_model.");
        }
        let lq = logits(&qs, &cfg, &tokens).unwrap();
        let ls = logits(&ss, &ModelConfig::load(&model).unwrap(), &tokens).unwrap();
        let cos = cosine(&lq, &ls);
        eprintln!(
            "{name}: {} GPTQ modules, logits cosine {cos:.5}",
            q.gptq_modules
        );
        // Random MoE models are sensitive (a 4-bit change flips some routing choices), hence 0.9.
        assert!(cos > 0.9, "{name}: quantized logits cosine {cos}");
        if opts.moe && !opts.multimodal {
            // The experts' Hessians come from the tokens routed to them: GPTQ on them must beat RTN.
            let rtn_out = tmp.path().join(format!("{name}-rtn-experts"));
            let mut j = job(&model, &rtn_out, &ds);
            j.expert_min_token_percent = 101.0;
            run(&j, &CpuBackend::default(), &MemorySink::default()).unwrap();
            let lr = logits(&TensorStore::open_dir(&rtn_out).unwrap(), &cfg, &tokens).unwrap();
            let cos_rtn = cosine(&lr, &ls);
            eprintln!("{name}: experts by RTN, logits cosine {cos_rtn:.5}");
            assert!(
                cos > cos_rtn,
                "{name}: GPTQ experts {cos} vs RTN experts {cos_rtn}"
            );
        }
    }
}

#[test]
fn gemma4_moe_resume_after_abort_is_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("calib.jsonl");
    common::write_dataset(&ds, 12);
    let model = tmp.path().join("model");
    write_gemma4_model(
        &model,
        Gemma4Options {
            moe: true,
            multimodal: true,
        },
        11,
    )
    .unwrap();
    let straight = tmp.path().join("straight");
    run(
        &job(&model, &straight, &ds),
        &CpuBackend::default(),
        &MemorySink::default(),
    )
    .unwrap();
    // Killed after layer 1 (a global layer, keys as values), then resumed: layers 0-1 come from the cache and
    // layers 2-3 see their outputs.
    let resumed = tmp.path().join("resumed");
    let mut j = job(&model, &resumed, &ds);
    j.abort_after_layer = Some(1);
    assert!(matches!(
        run(&j, &CpuBackend::default(), &MemorySink::default()),
        Err(QuantError::TestAbort(1))
    ));
    j.abort_after_layer = None;
    let sink = MemorySink::default();
    run(&j, &CpuBackend::default(), &sink).unwrap();
    assert_eq!(sink.named("quantization_layer_cached").len(), 2);
    assert_eq!(
        common::artifact_files(&resumed),
        common::artifact_files(&straight),
        "resumed artifact differs"
    );
}
