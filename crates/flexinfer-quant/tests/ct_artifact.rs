//! compressed-tensors `pack-quantized` artifacts of a generated Llama model (the GPTQ solve in
//! compressed-tensors' container): the tensors and `quantization_config` by the safetensors rules, the
//! same codes as the GPTQ container of the same run, reuse, bad settings refused before any output;
//! and — when `FLEXINFER_CT_PYTHON` names a python with the PyPI `compressed-tensors` library
//! (scripts/fp8/make-venv.sh) — decompressed by compressed-tensors and loaded by transformers
//! (scripts/ct/check_pack_quantized.py), both equal to our dequantization.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_contract::files::{self, QualitySummary};
use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::ct;
use flexinfer_quant::events::NullSink;
use flexinfer_quant::job::{run, Container, QuantizeJob};
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::model::modules::LINEARS;
use flexinfer_quant::pack::{unpack_qweight, unpack_qzeros, ZeroFormat};
use flexinfer_quant::params::GptqParams;
use flexinfer_quant::tensors::TensorStore;
use flexinfer_quant::testkit::{self, ModelSize};
use flexinfer_quant::writer::verify_save_complete;
use safetensors::Dtype;
use std::path::{Path, PathBuf};

const SIZE: ModelSize = ModelSize::TINY;
fn model(dir: &Path) -> PathBuf {
    testkit::write_model_sized(dir, "LlamaForCausalLM", 3, &SIZE).unwrap();
    let ds = dir.with_file_name("calib.jsonl");
    testkit::write_dataset(&ds, 4).unwrap();
    ds
}

fn job(
    model: &Path,
    out: &Path,
    ds: &Path,
    params: GptqParams,
    container: Container,
) -> QuantizeJob {
    QuantizeJob {
        container,
        params,
        max_shard_bytes: 1 << 20,
        ..QuantizeJob::new(
            model,
            out,
            ds,
            CalibSettings {
                max_samples: 4,
                max_seq_len: 32,
            },
            "test",
        )
    }
}

fn params(bits: u32, group_size: i32, sym: bool) -> GptqParams {
    GptqParams {
        bits,
        group_size,
        sym,
        ..Default::default()
    }
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Our dequantization of module `m` of the artifact ([`ct::dequantize`]) and its shape.
fn dequantized(art: &TensorStore, m: &str, bits: u32) -> (Vec<f32>, Vec<usize>) {
    let shape = i32s(art.raw(&format!("{m}.weight_shape")).unwrap());
    // int64 little-endian: the low words.
    let (rows, cols) = (shape[0] as usize, shape[2] as usize);
    let scale = art.entry(&format!("{m}.weight_scale")).unwrap();
    let zp = art
        .contains(&format!("{m}.weight_zero_point"))
        .then(|| i32s(art.raw(&format!("{m}.weight_zero_point")).unwrap()));
    let w = ct::dequantize(
        &i32s(art.raw(&format!("{m}.weight_packed")).unwrap()),
        art.raw(&format!("{m}.weight_scale")).unwrap(),
        scale.dtype,
        zp.as_deref(),
        rows,
        cols,
        bits,
    );
    (w, vec![rows, cols])
}

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

#[test]
fn pack_quantized_artifact_has_the_layout_and_the_gptq_codes() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    let ds = model(&src);
    let (out, gptq_out) = (d.path().join("ct"), d.path().join("gptq"));
    for (bits, gs, sym) in [(4, 32, true), (4, 32, false), (8, -1, true)] {
        let p = params(bits, gs, sym);
        let o = run(
            &job(&src, &out, &ds, p.clone(), Container::CompressedTensors),
            &CpuBackend::default(),
            &NullSink,
        )
        .unwrap();
        assert!(!o.cached);
        let g = run(
            &job(&src, &gptq_out, &ds, p.clone(), Container::Gptq),
            &CpuBackend::default(),
            &NullSink,
        )
        .unwrap();
        assert_ne!(g.config_digest, o.config_digest);
        let source = TensorStore::open_dir(&src).unwrap();
        let art = TensorStore::open_dir(&out).unwrap();
        let gptq = TensorStore::open_dir(&gptq_out).unwrap();
        let groups_of = |cols: usize| if gs > 0 { cols / gs as usize } else { 1 };
        for l in 0..SIZE.layers {
            for lin in LINEARS {
                let m = format!("model.layers.{l}.{lin}");
                let sw = source.entry(&format!("{m}.weight")).unwrap();
                let (rows, cols) = (sw.shape[0], sw.shape[1]);
                let groups = groups_of(cols);
                assert!(!art.contains(&format!("{m}.weight")), "{m}");
                assert!(!art.contains(&format!("{m}.qweight")), "{m}");
                let wp = art.entry(&format!("{m}.weight_packed")).unwrap();
                assert_eq!(
                    (wp.dtype, wp.shape.clone()),
                    (Dtype::I32, vec![rows, cols * bits as usize / 32]),
                    "{m}"
                );
                let s = art.entry(&format!("{m}.weight_scale")).unwrap();
                assert_eq!(
                    (s.dtype, s.shape.clone()),
                    (Dtype::BF16, vec![rows, groups])
                );
                let ws = art.entry(&format!("{m}.weight_shape")).unwrap();
                assert_eq!((ws.dtype, ws.shape.clone()), (Dtype::I64, vec![2]));
                assert_eq!(
                    art.raw(&format!("{m}.weight_shape")).unwrap(),
                    [(rows as i64).to_le_bytes(), (cols as i64).to_le_bytes()].concat()
                );
                assert_eq!(art.contains(&format!("{m}.weight_zero_point")), !sym, "{m}");
                // The same solve: the GPTQ container's codes and zeros, the scales rounded to BF16.
                let gcodes = unpack_qweight(
                    &gptq.i32(&format!("{m}.qweight")).unwrap(),
                    rows,
                    cols,
                    bits,
                );
                let codes = ct::pack::unpack_rows(
                    &art.i32(&format!("{m}.weight_packed")).unwrap(),
                    rows,
                    cols,
                    bits,
                );
                for r in 0..rows {
                    for c in 0..cols {
                        assert_eq!(codes[r * cols + c], gcodes[c * rows + r], "{m} [{r}, {c}]");
                    }
                }
                let gzeros = unpack_qzeros(
                    &gptq.i32(&format!("{m}.qzeros")).unwrap(),
                    rows,
                    groups,
                    bits,
                    ZeroFormat::for_sym(sym),
                );
                let gscales = gptq.raw(&format!("{m}.scales")).unwrap();
                let scales = art.raw(&format!("{m}.weight_scale")).unwrap();
                let zeros = (!sym).then(|| {
                    ct::pack::unpack_zero_points(
                        &art.i32(&format!("{m}.weight_zero_point")).unwrap(),
                        rows,
                        groups,
                        bits,
                    )
                });
                for r in 0..rows {
                    for g in 0..groups {
                        let k = g * rows + r;
                        let f16 = half::f16::from_le_bytes([gscales[2 * k], gscales[2 * k + 1]]);
                        let j = r * groups + g;
                        let bf16 = half::bf16::from_le_bytes([scales[2 * j], scales[2 * j + 1]]);
                        assert_eq!(bf16, half::bf16::from_f32(f16.to_f32()), "{m} scale");
                        let z = zeros.as_ref().map_or(1 << (bits - 1), |z| z[j]);
                        assert_eq!(z, gzeros[k], "{m} zero [{r}, {g}]");
                    }
                }
                // Our dequantization is close to the source weight.
                let (deq, _) = dequantized(&art, &m, bits);
                let orig = source.f32(&format!("{m}.weight")).unwrap();
                let (mut err, mut norm) = (0f64, 0f64);
                for (a, b) in orig.iter().zip(&deq) {
                    err += f64::from(a - b).powi(2);
                    norm += f64::from(*a).powi(2);
                }
                let rel = (err / norm).sqrt();
                let bound = if bits == 8 { 0.02 } else { 0.2 };
                assert!(rel > 0.0 && rel < bound, "{m}: relative error {rel}");
            }
        }
        for name in [
            "lm_head.weight",
            "model.embed_tokens.weight",
            "model.norm.weight",
        ] {
            assert_eq!(art.raw(name).unwrap(), source.raw(name).unwrap(), "{name}");
        }
        let cfg = read_json(&out.join("config.json"));
        let qc = &cfg["quantization_config"];
        assert_eq!(qc["quant_method"], "compressed-tensors");
        assert_eq!(qc["format"], "pack-quantized");
        assert_eq!(qc["quantization_status"], "compressed");
        let w = &qc["config_groups"]["group_0"]["weights"];
        assert_eq!(w["num_bits"], bits);
        assert_eq!(w["type"], "int");
        assert_eq!(w["symmetric"], sym);
        if gs > 0 {
            assert_eq!(
                (w["strategy"].as_str(), w["group_size"].as_i64()),
                (Some("group"), Some(32))
            );
        } else {
            assert_eq!(
                (w["strategy"].as_str(), w["group_size"].as_i64()),
                (Some("channel"), None)
            );
        }
        assert!(qc["config_groups"]["group_0"]["input_activations"].is_null());
        assert_eq!(qc["ignore"], serde_json::json!(["lm_head"]));
        assert!(!out.join("quantize_config.json").exists());
        let sc = verify_save_complete(&out, true).expect(".save-complete verifies");
        assert_eq!(sc.config_digest.as_deref(), Some(o.config_digest.as_str()));
        assert_eq!(
            o.compressed_size_bytes,
            sc.shards.iter().map(|s| s.size_bytes).sum::<u64>()
        );
        let q: QualitySummary =
            serde_json::from_value(read_json(&out.join(files::QUANTIZATION_QUALITY))).unwrap();
        assert_eq!(
            q.gptq_modules + q.rtn_fallback_modules,
            (SIZE.layers * 7) as u64
        );
        assert_eq!(Some(&q), o.quality.as_ref());
        // No work or staging directory is left beside the artifacts (model, dataset, two artifacts).
        let names: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 4, "{names:?}");
        // The same settings again: reused.
        let again = run(
            &job(&src, &out, &ds, p, Container::CompressedTensors),
            &CpuBackend::default(),
            &NullSink,
        )
        .unwrap();
        assert!(again.cached);
        assert_eq!(again.config_digest, o.config_digest);
    }
}

#[test]
fn settings_the_container_cannot_take_are_refused_before_any_output() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    let ds = model(&src);
    let out = d.path().join("ct");
    let cases = [
        (params(3, 32, true), "BITS=\"3\""),
        (params(2, 32, true), "BITS=\"2\""),
        (
            GptqParams {
                desc_act: true,
                ..params(4, 32, true)
            },
            "DESC_ACT",
        ),
    ];
    for (p, needle) in cases {
        let e = run(
            &job(&src, &out, &ds, p, Container::CompressedTensors),
            &CpuBackend::default(),
            &NullSink,
        )
        .unwrap_err();
        assert!(e.is_bad_input(), "{e}");
        assert!(flexinfer_contract::error::chain(&e).contains(needle), "{e}");
        assert!(!out.exists());
    }
    // Act-order with static groups keeps every column in its own group: the container takes it.
    let o = run(
        &job(
            &src,
            &out,
            &ds,
            GptqParams {
                desc_act: true,
                static_groups: true,
                ..params(4, 32, true)
            },
            Container::CompressedTensors,
        ),
        &CpuBackend::default(),
        &NullSink,
    )
    .unwrap();
    assert!(!o.cached);
    let qc = read_json(&out.join("config.json"))["quantization_config"].clone();
    assert_eq!(
        qc["config_groups"]["group_0"]["weights"]["actorder"],
        "weight"
    );
}

/// Writes, for the Python check, what every quantized linear must decompress to (f32): computed from the
/// GPTQ container of the same run (its codes, zeros and F16 scales, read by the GPTQ reader that vLLM and
/// transformers are checked against), not from the compressed-tensors tensors, so a packing mistake on
/// our side cannot hide behind a matching mistake in our own reader. `(code − zero) × bf16(scale)`,
/// rounded to BF16 (the model's dtype) as the library computes it.
fn write_expected(art: &TensorStore, gptq: &TensorStore, bits: u32, sym: bool, path: &Path) {
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in art.entries.keys().filter(|n| n.ends_with(".weight_packed")) {
        let m = name.trim_end_matches(".weight_packed");
        let g_idx = gptq.i32(&format!("{m}.g_idx")).unwrap();
        let cols = g_idx.len();
        let rows = gptq.entry(&format!("{m}.qweight")).unwrap().shape[1];
        let groups = gptq.entry(&format!("{m}.scales")).unwrap().shape[0];
        let codes = unpack_qweight(
            &gptq.i32(&format!("{m}.qweight")).unwrap(),
            rows,
            cols,
            bits,
        );
        let zeros = unpack_qzeros(
            &gptq.i32(&format!("{m}.qzeros")).unwrap(),
            rows,
            groups,
            bits,
            ZeroFormat::for_sym(sym),
        );
        let scales = gptq.raw(&format!("{m}.scales")).unwrap();
        let mut v = vec![0f32; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                let k = g_idx[c] as usize * rows + r;
                let s = half::f16::from_le_bytes([scales[2 * k], scales[2 * k + 1]]).to_f32();
                let s = half::bf16::from_f32(s).to_f32();
                let q = f32::from(codes[c * rows + r]) - f32::from(zeros[k]);
                v[r * cols + c] = half::bf16::from_f32(q * s).to_f32();
            }
        }
        data.push((
            format!("{m}.weight"),
            vec![rows, cols],
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
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

#[test]
fn compressed_tensors_decompresses_and_transformers_loads_our_pack_quantized_like_we_dequantize_it()
{
    let Some(python) = std::env::var_os("FLEXINFER_CT_PYTHON")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
    else {
        assert!(
            std::env::var_os("FLEXINFER_REQUIRE_CT_PYTHON").is_none(),
            "FLEXINFER_REQUIRE_CT_PYTHON is set but FLEXINFER_CT_PYTHON is not (scripts/fp8/make-venv.sh prints it)"
        );
        eprintln!("skipped: FLEXINFER_CT_PYTHON is not set (scripts/fp8/make-venv.sh prints the python to set it to)");
        return;
    };
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ct/check_pack_quantized.py");
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    let ds = model(&src);
    let cases = [
        (
            "w4-sym-g32",
            params(4, 32, true),
            Some("layers.1.mlp.down_proj"),
        ),
        (
            "w4-asym-g32-gar",
            GptqParams {
                act_group_aware: true,
                ..params(4, 32, false)
            },
            None,
        ),
        ("w8-sym-channel", params(8, -1, true), None),
        ("w8-asym-g64", params(8, 64, false), None),
    ];
    for (label, p, excl) in cases {
        let out = d.path().join(label);
        let gptq_out = d.path().join(format!("{label}-gptq"));
        let (bits, sym) = (p.bits, p.sym);
        for (dir, container) in [
            (&out, Container::CompressedTensors),
            (&gptq_out, Container::Gptq),
        ] {
            let j = QuantizeJob {
                dynamic_exclusion: excl.map(str::to_string),
                ..job(&src, dir, &ds, p.clone(), container)
            };
            run(&j, &CpuBackend::default(), &NullSink).unwrap();
        }
        let expected = d.path().join(format!("expected-{label}.safetensors"));
        let art = TensorStore::open_dir(&out).unwrap();
        write_expected(
            &art,
            &TensorStore::open_dir(&gptq_out).unwrap(),
            bits,
            sym,
            &expected,
        );
        // Our reader of the layout agrees with that too.
        let m = "model.layers.0.self_attn.q_proj";
        let want = TensorStore::open_files(vec![expected.clone()]).unwrap();
        assert_eq!(
            dequantized(&art, m, bits).0,
            want.f32(&format!("{m}.weight")).unwrap()
        );
        let r = std::process::Command::new(&python)
            .arg(&script)
            .args([&out, &src, &expected])
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
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
        let kept = usize::from(excl.is_some());
        assert_eq!(report["modules"], SIZE.layers * 7 - kept, "{report}");
        assert_eq!(report["format"], "pack-quantized");
        assert_eq!(report["bits"], bits);
        eprintln!("{label}: {report}");
    }
}
