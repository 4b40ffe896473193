//! AWQ artifacts of generated Llama / Qwen2 models in AutoAWQ's GEMM layout: the tensors,
//! `quantization_config`, folded norms, `.save-complete`, sidecar and reuse by the safetensors rules;
//! bad settings and families refused before any output; and — when `FLEXINFER_AWQ_PYTHON` names a python
//! with GPTQModel and transformers (scripts/awq/make-venv.sh) — dequantized by GPTQModel's AWQ reader
//! and loaded by transformers (scripts/awq/check_awq.py), both equal to our dequantization.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_contract::files::{self, AwqQuality};
use flexinfer_quant::awq::{write_awq_artifact, AwqJob};
use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::events::NullSink;
use flexinfer_quant::model::modules::LINEARS;
use flexinfer_quant::tensors::TensorStore;
use flexinfer_quant::testkit::{self, ModelSize};
use flexinfer_quant::writer::verify_save_complete;
use safetensors::Dtype;
use std::path::{Path, PathBuf};

/// Full multi-head attention (v's outputs are o's inputs: o's scales fold into v).
const MHA: ModelSize = ModelSize {
    hidden: 128,
    inter: 256,
    layers: 2,
    heads: 4,
    kv_heads: 4,
    vocab: 256,
};

fn model(dir: &Path, arch: &str, size: &ModelSize) -> PathBuf {
    testkit::write_model_sized(dir, arch, 3, size).unwrap();
    let ds = dir.with_file_name("calib.jsonl");
    testkit::write_dataset(&ds, 4).unwrap();
    ds
}

fn job<'a>(model: &'a Path, out: &'a Path, ds: &'a Path, bits: u32, group: i32) -> AwqJob<'a> {
    AwqJob {
        model_dir: model,
        out_dir: out,
        dataset: ds,
        calib: CalibSettings {
            max_samples: 4,
            max_seq_len: 32,
        },
        bits,
        group_size: group,
        script_version: "test",
        verify_save_sha256: true,
        max_shard_bytes: 1 << 20,
        max_output_error_ratio: flexinfer_quant::awq::gate::DEFAULT_MAX_OUTPUT_ERROR_RATIO,
    }
}

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// The AWQ GEMM tensors of `m` unpacked the way AutoAWQ's reader does, written out here: word `j` of a
/// row holds its eight columns `8j + k` at nibble `REVERSE[k]`; a weight is `f16((code − zero) × scale)`.
/// Returns `[out, in]` row-major.
fn dequantize(art: &TensorStore, m: &str, group: usize) -> (Vec<f32>, usize, usize) {
    const REVERSE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];
    let qw = art.entry(&format!("{m}.qweight")).unwrap();
    let (cols, words) = (qw.shape[0], qw.shape[1]);
    let rows = words * 8;
    let qweight = art.i32(&format!("{m}.qweight")).unwrap();
    let qzeros = art.i32(&format!("{m}.qzeros")).unwrap();
    let scales = art.raw(&format!("{m}.scales")).unwrap();
    let nib = |w: &[i32], row: usize, col: usize| {
        ((w[row * words + col / 8] as u32) >> (4 * REVERSE[col % 8])) & 0xF
    };
    let mut out = vec![0f32; rows * cols];
    for c in 0..cols {
        let g = c / group;
        for r in 0..rows {
            let k = g * rows + r;
            let s = half::f16::from_le_bytes([scales[2 * k], scales[2 * k + 1]]).to_f32();
            let q = nib(&qweight, c, r) as f32 - nib(&qzeros, g, r) as f32;
            out[r * cols + c] = half::f16::from_f32(q * s).to_f32();
        }
    }
    (out, rows, cols)
}

fn write_expected(art: &TensorStore, group: usize, path: &Path) {
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in art.entries.keys().filter(|n| n.ends_with(".qweight")) {
        let m = name.trim_end_matches(".qweight");
        let (w, rows, cols) = dequantize(art, m, group);
        data.push((
            format!("{m}.weight"),
            vec![rows, cols],
            w.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    let (mut err, mut norm) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        err += f64::from(x - y).powi(2);
        norm += f64::from(*x).powi(2);
    }
    (err / norm).sqrt()
}

#[test]
fn awq_artifact_has_the_gemm_layout_and_folded_norms() {
    for (arch, size, group) in [
        ("LlamaForCausalLM", ModelSize::TINY, 32),
        ("Qwen2ForCausalLM", MHA, 64),
    ] {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("model");
        let ds = model(&src, arch, &size);
        let out = d.path().join("awq");
        let o = write_awq_artifact(&job(&src, &out, &ds, 4, group), &NullSink).unwrap();
        assert!(!o.cached);
        let source = TensorStore::open_dir(&src).unwrap();
        let art = TensorStore::open_dir(&out).unwrap();
        let g = group as usize;
        let mut norms_changed = 0;
        for l in 0..size.layers {
            for lin in LINEARS {
                let m = format!("model.layers.{l}.{lin}");
                let sw = source.entry(&format!("{m}.weight")).unwrap();
                let (rows, cols) = (sw.shape[0], sw.shape[1]);
                assert!(!art.contains(&format!("{m}.weight")), "{m}");
                let qw = art.entry(&format!("{m}.qweight")).unwrap();
                assert_eq!(
                    (qw.dtype, qw.shape.clone()),
                    (Dtype::I32, vec![cols, rows / 8])
                );
                let qz = art.entry(&format!("{m}.qzeros")).unwrap();
                assert_eq!(
                    (qz.dtype, qz.shape.clone()),
                    (Dtype::I32, vec![cols / g, rows / 8])
                );
                let s = art.entry(&format!("{m}.scales")).unwrap();
                assert_eq!(
                    (s.dtype, s.shape.clone()),
                    (Dtype::F16, vec![cols / g, rows])
                );
                // The scales move weight between a linear and the one before it, not its size: the
                // dequantized weight of a module no scale was folded out of (q/k/v/gate, their inputs
                // scaled by a norm) need not be near the source, but gate·diag(n) is.
                let (deq, _, _) = dequantize(&art, &m, g);
                let orig = source.f32(&format!("{m}.weight")).unwrap();
                let norm_name = match lin {
                    "self_attn.q_proj" | "self_attn.k_proj" | "self_attn.v_proj" => {
                        Some("input_layernorm")
                    }
                    "mlp.gate_proj" | "mlp.up_proj" => Some("post_attention_layernorm"),
                    _ => None,
                };
                if let Some(n) = norm_name {
                    let n_src = source.f32(&format!("model.layers.{l}.{n}.weight")).unwrap();
                    let n_art = art.f32(&format!("model.layers.{l}.{n}.weight")).unwrap();
                    let eff = |w: &[f32], nv: &[f32]| -> Vec<f32> {
                        w.iter()
                            .enumerate()
                            .map(|(i, v)| v * nv[i % cols])
                            .collect()
                    };
                    let rel = rel_error(&eff(&orig, &n_src), &eff(&deq, &n_art));
                    // Only for the linears whose following module's scales did not fold into them.
                    if !matches!(lin, "self_attn.v_proj" | "mlp.up_proj") {
                        assert!(rel > 0.0 && rel < 0.25, "{m}: relative error {rel}");
                        // The folded norm undoes the scales: column c of the weight grew by s_c (its norm ratio
                        // to the source's) where the norm shrank by s_c, so the two ratios multiply to about 1
                        // (q, k and gate: no other scale touches them).
                        let col = |w: &[f32], c: usize| -> f64 {
                            (0..rows)
                                .map(|r| f64::from(w[r * cols + c]).powi(2))
                                .sum::<f64>()
                                .sqrt()
                        };
                        let dev = (0..cols)
                            .map(|c| {
                                let ratio = col(&deq, c) / col(&orig, c);
                                (ratio * f64::from(n_art[c]) / f64::from(n_src[c]))
                                    .ln()
                                    .abs()
                            })
                            .sum::<f64>()
                            / cols as f64;
                        assert!(dev < 0.03, "{m}: mean |log| of weight × norm ratios {dev}");
                    }
                }
                if let Ok(b) = art.entry(&format!("{m}.bias")) {
                    assert_eq!(b.shape, vec![rows], "{m}.bias");
                }
            }
            // A linear's output scales fold into the one before it: down's input channel r grew by s_r
            // (its column norm ratio to the source), up's output row r shrank by s_r (with the norm before up
            // folded back), so the ratios multiply to about 1 — closer than down's alone.
            let pairs: &[(&str, &str, Option<&str>)] = if size.kv_heads == size.heads {
                &[
                    (
                        "mlp.up_proj",
                        "mlp.down_proj",
                        Some("post_attention_layernorm"),
                    ),
                    (
                        "self_attn.v_proj",
                        "self_attn.o_proj",
                        Some("input_layernorm"),
                    ),
                ]
            } else {
                &[(
                    "mlp.up_proj",
                    "mlp.down_proj",
                    Some("post_attention_layernorm"),
                )]
            };
            for (before, after, norm) in pairs {
                let pm = format!("model.layers.{l}.{before}");
                let am = format!("model.layers.{l}.{after}");
                let (bdeq, brows, bcols) = dequantize(&art, &pm, g);
                let (adeq, arows, acols) = dequantize(&art, &am, g);
                assert_eq!(brows, acols);
                let bsrc = source.f32(&format!("{pm}.weight")).unwrap();
                let asrc = source.f32(&format!("{am}.weight")).unwrap();
                let (n_src, n_art) = match norm {
                    Some(n) => (
                        source.f32(&format!("model.layers.{l}.{n}.weight")).unwrap(),
                        art.f32(&format!("model.layers.{l}.{n}.weight")).unwrap(),
                    ),
                    None => (vec![1.0; bcols], vec![1.0; bcols]),
                };
                let (mut prod_dev, mut after_dev) = (0f64, 0f64);
                for r in 0..brows {
                    let row = |w: &[f32], n: &[f32]| -> f64 {
                        (0..bcols)
                            .map(|c| f64::from(w[r * bcols + c] * n[c]).powi(2))
                            .sum::<f64>()
                            .sqrt()
                    };
                    let col = |w: &[f32]| -> f64 {
                        (0..arows)
                            .map(|o| f64::from(w[o * acols + r]).powi(2))
                            .sum::<f64>()
                            .sqrt()
                    };
                    let b_ratio = row(&bdeq, &n_art) / row(&bsrc, &n_src);
                    let a_ratio = col(&adeq) / col(&asrc);
                    prod_dev += (b_ratio * a_ratio).ln().abs();
                    after_dev += a_ratio.ln().abs();
                }
                assert!(
                    prod_dev < after_dev * 0.5,
                    "{pm} → {am}: mean |log| of the product {}, of {after} alone {}",
                    prod_dev / brows as f64,
                    after_dev / brows as f64
                );
            }
            for n in ["input_layernorm", "post_attention_layernorm"] {
                let name = format!("model.layers.{l}.{n}.weight");
                norms_changed += usize::from(art.raw(&name).unwrap() != source.raw(&name).unwrap());
            }
        }
        assert!(norms_changed > 0, "{arch}: no scale folded into a norm");
        for name in [
            "lm_head.weight",
            "model.embed_tokens.weight",
            "model.norm.weight",
        ] {
            assert_eq!(art.raw(name).unwrap(), source.raw(name).unwrap(), "{name}");
        }
        let qc = read_json(&out.join("config.json"))["quantization_config"].clone();
        assert_eq!(qc["quant_method"], "awq");
        assert_eq!(qc["version"], "gemm");
        assert_eq!(
            (qc["bits"].as_u64(), qc["group_size"].as_i64()),
            (Some(4), Some(group as i64))
        );
        assert_eq!(qc["zero_point"], true);
        assert_eq!(qc["modules_to_not_convert"], serde_json::json!(["lm_head"]));
        assert!(!out.join("quantize_config.json").exists());
        let sc = verify_save_complete(&out, true).expect(".save-complete verifies");
        assert_eq!(sc.config_digest.as_deref(), Some(o.config_digest.as_str()));
        assert_eq!(
            o.compressed_size_bytes,
            sc.shards.iter().map(|s| s.size_bytes).sum::<u64>()
        );
        assert!(o.compressed_size_bytes < o.original_size_bytes);
        let q: AwqQuality =
            serde_json::from_value(read_json(&out.join(files::QUANTIZATION_QUALITY))).unwrap();
        // The sidecar is the outcome's summary (the floats through JSON, to the last bit or one off).
        let mut oq = o.quality.clone().unwrap();
        for (a, b) in [
            (&mut oq.mean_loss_ratio, q.mean_loss_ratio),
            (&mut oq.max_relative_error, q.max_relative_error),
            (&mut oq.mean_relative_error, q.mean_relative_error),
            (&mut oq.output_error_ratio, q.output_error_ratio),
            (&mut oq.worst_output_error_ratio, q.worst_output_error_ratio),
        ] {
            assert!((*a - b).abs() <= b.abs() * 1e-12, "{a} vs {b}");
            *a = b;
        }
        assert_eq!(q, oq);
        assert_eq!(q.quantized_modules, (size.layers * 7) as u64);
        // Four module groups a layer; o's only where there is no grouped-query sharing.
        let groups = if size.kv_heads == size.heads { 4 } else { 3 };
        assert_eq!(
            q.scaled_groups + q.unscaled_groups,
            (size.layers * groups) as u64,
            "{q:?}"
        );
        assert!(q.mean_loss_ratio > 0.0 && q.mean_loss_ratio <= 1.0, "{q:?}");
        // The gate: the artifact's output error against plain rounding's, on the calibration tokens.
        assert_eq!(q.gate, "passed", "{q:?}");
        assert_eq!(q.max_output_error_ratio, 1.0);
        assert!(
            q.output_error_ratio > 0.0
                && q.output_error_ratio <= 1.0
                && q.worst_output_error_ratio >= q.output_error_ratio,
            "{q:?}"
        );
        assert!(
            q.worst_output_error_module.starts_with("model.layers."),
            "{q:?}"
        );
        assert!(q.searched_clip_groups > 0 && q.clipped_groups <= q.searched_clip_groups);
        assert!(
            q.max_relative_error > 0.0 && q.max_relative_error < 0.25,
            "{q:?}"
        );
        eprintln!("{arch}: {q:?}");
        // Nothing but the model, the dataset and the artifact is left.
        let names: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 3, "{names:?}");
        let again = write_awq_artifact(&job(&src, &out, &ds, 4, group), &NullSink).unwrap();
        assert!(again.cached);
        assert_eq!(again.config_digest, o.config_digest);
    }
}

#[test]
fn settings_and_families_awq_cannot_take_are_refused_before_any_output() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    let ds = model(&src, "LlamaForCausalLM", &ModelSize::TINY);
    let out = d.path().join("awq");
    for (bits, group, needle) in [
        (3, 32, "BITS=\"3\""),
        (8, 32, "BITS=\"8\""),
        (4, 100, "GROUP_SIZE=\"100\""),
        (4, -1, "GROUP_SIZE=\"-1\""),
        (4, 256, "GROUP_SIZE=\"256\""),
    ] {
        let e = write_awq_artifact(&job(&src, &out, &ds, bits, group), &NullSink).unwrap_err();
        assert!(e.is_bad_input(), "{e}");
        assert!(
            flexinfer_contract::error::chain(&e).contains(needle),
            "{needle}: {e}"
        );
        assert!(!out.exists());
    }
    // A family whose norms the scales cannot fold into.
    let gemma = d.path().join("gemma");
    testkit::write_gemma4_model(
        &gemma,
        testkit::Gemma4Options {
            moe: false,
            multimodal: false,
        },
        1,
    )
    .unwrap();
    let e = write_awq_artifact(&job(&gemma, &out, &ds, 4, 32), &NullSink).unwrap_err();
    assert!(e.is_bad_input(), "{e}");
    assert!(
        flexinfer_contract::error::chain(&e).contains("config.json architectures"),
        "{e}"
    );
    assert!(!out.exists());
    // A good artifact stays whole when a later run is refused.
    write_awq_artifact(&job(&src, &out, &ds, 4, 32), &NullSink).unwrap();
    let e = write_awq_artifact(&job(&src, &out, &ds, 4, 48), &NullSink).unwrap_err();
    assert!(e.is_bad_input(), "{e}");
    verify_save_complete(&out, true).expect("the earlier artifact still verifies");
}

#[test]
fn gptqmodel_dequantizes_and_transformers_loads_our_awq_like_we_dequantize_it() {
    let Some(python) = std::env::var_os("FLEXINFER_AWQ_PYTHON")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
    else {
        assert!(
            std::env::var_os("FLEXINFER_REQUIRE_AWQ_PYTHON").is_none(),
            "FLEXINFER_REQUIRE_AWQ_PYTHON is set but FLEXINFER_AWQ_PYTHON is not (scripts/awq/make-venv.sh prints it)"
        );
        eprintln!("skipped: FLEXINFER_AWQ_PYTHON is not set (scripts/awq/make-venv.sh prints the python to set it to)");
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/awq/check_awq.py");
    let d = tempfile::tempdir().unwrap();
    for (label, arch, size, group) in [
        ("llama-g32", "LlamaForCausalLM", ModelSize::TINY, 32),
        ("qwen2-mha-g64", "Qwen2ForCausalLM", MHA, 64),
    ] {
        let src = d.path().join(format!("{label}-model"));
        let ds = model(&src, arch, &size);
        let out = d.path().join(label);
        write_awq_artifact(&job(&src, &out, &ds, 4, group), &NullSink).unwrap();
        let expected = d.path().join(format!("expected-{label}.safetensors"));
        write_expected(
            &TensorStore::open_dir(&out).unwrap(),
            group as usize,
            &expected,
        );
        let r = std::process::Command::new(&python)
            .arg(&script)
            .args([&out, &src, &expected])
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("GPTQMODEL_CPU_WORKERS", "2")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&r.stdout);
        assert!(
            r.status.success(),
            "{label}: {stdout}\n{}",
            String::from_utf8_lossy(&r.stderr)
        );
        let report: serde_json::Value =
            serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(report["modules"], size.layers * 7, "{report}");
        // The folded model is the source model: AWQ's logits are no further from the source's than plain
        // rounding's (the same bits and groups, computed by the script) by more than a little.
        let (awq, rtn) = (
            report["logitsCosineVsSource"].as_f64().unwrap(),
            report["rtnCosineVsSource"].as_f64().unwrap(),
        );
        assert!(
            awq >= rtn - 0.01,
            "{label}: AWQ {awq} vs round-to-nearest {rtn}"
        );
        eprintln!("{label}: {report}");
    }
}
