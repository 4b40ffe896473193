//! FP8 artifacts of a generated Llama model: read back by the safetensors rules (dtypes, shapes,
//! `quantization_config`, `ignore`, copied tensors, `.save-complete`, the quality sidecar), reuse,
//! exclusion, per-tensor scales, bad input; and — when `FLEXINFER_CT_PYTHON` names a python with the
//! PyPI `compressed-tensors` library (scripts/fp8/make-venv.sh) — decompressed by compressed-tensors and
//! loaded by transformers (scripts/fp8/check_fp8.py), both equal to our dequantization.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_contract::files::{self, Fp8Quality};
use flexinfer_quant::events::NullSink;
use flexinfer_quant::fp8::e4m3;
use flexinfer_quant::fp8::{write_fp8_artifact, Fp8Job, ScaleStrategy};
use flexinfer_quant::model::modules::LINEARS;
use flexinfer_quant::tensors::TensorStore;
use flexinfer_quant::testkit::{self, ModelSize};
use flexinfer_quant::writer::verify_save_complete;
use safetensors::Dtype;
use std::path::{Path, PathBuf};

const SIZE: ModelSize = ModelSize::TINY;
fn model(dir: &Path) {
    testkit::write_model_sized(dir, "LlamaForCausalLM", 3, &SIZE).unwrap();
    testkit::write_byte_level_tokenizer(dir).unwrap();
}

fn job<'a>(
    model: &'a Path,
    out: &'a Path,
    strategy: ScaleStrategy,
    excl: Option<&'a str>,
) -> Fp8Job<'a> {
    Fp8Job {
        model_dir: model,
        out_dir: out,
        strategy,
        dynamic_exclusion: excl,
        script_version: "test",
        verify_save_sha256: true,
        max_shard_bytes: 1 << 20,
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Our dequantization of module `m` in the artifact: `decode(code) × scale`, row by row.
fn dequantized(out: &TensorStore, m: &str) -> (Vec<f32>, Vec<usize>) {
    let w = out.entry(&format!("{m}.weight")).unwrap().clone();
    let codes = out.raw(&format!("{m}.weight")).unwrap();
    let scales = f32s(out.raw(&format!("{m}.weight_scale")).unwrap());
    let cols = w.shape[1];
    let v = codes
        .iter()
        .enumerate()
        .map(|(i, &c)| e4m3::decode(c) * scales[if scales.len() == 1 { 0 } else { i / cols }])
        .collect();
    (v, w.shape)
}

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

#[test]
fn per_channel_artifact_has_the_compressed_tensors_layout() {
    let d = tempfile::tempdir().unwrap();
    let (src, out) = (d.path().join("model"), d.path().join("fp8"));
    model(&src);
    let o = write_fp8_artifact(&job(&src, &out, ScaleStrategy::Channel, None), &NullSink).unwrap();
    assert!(!o.cached);
    let source = TensorStore::open_dir(&src).unwrap();
    let art = TensorStore::open_dir(&out).unwrap();
    for l in 0..SIZE.layers {
        for lin in LINEARS {
            let m = format!("model.layers.{l}.{lin}");
            let sw = source.entry(&format!("{m}.weight")).unwrap();
            let w = art.entry(&format!("{m}.weight")).unwrap();
            let s = art.entry(&format!("{m}.weight_scale")).unwrap();
            assert_eq!((w.dtype, &w.shape), (Dtype::F8_E4M3, &sw.shape), "{m}");
            assert_eq!(
                (s.dtype, s.shape.clone()),
                (Dtype::F32, vec![sw.shape[0], 1]),
                "{m}"
            );
            // Each row's largest magnitude maps to ±448 and the error is within E4M3's step.
            let (deq, _) = dequantized(&art, &m);
            let orig = source.f32(&format!("{m}.weight")).unwrap();
            let (mut err, mut norm) = (0f64, 0f64);
            for (a, b) in orig.iter().zip(&deq) {
                err += f64::from(a - b).powi(2);
                norm += f64::from(*a).powi(2);
            }
            let rel = (err / norm).sqrt();
            assert!(rel > 0.0 && rel < 0.06, "{m}: relative error {rel}");
            let cols = sw.shape[1];
            for (r, row) in art
                .raw(&format!("{m}.weight"))
                .unwrap()
                .chunks(cols)
                .enumerate()
            {
                assert!(row.iter().any(|&c| c & 0x7F == 0x7E), "{m} row {r}");
            }
        }
    }
    // Everything else is copied byte for byte, in its own dtype.
    for name in [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
    ] {
        assert_eq!(art.raw(name).unwrap(), source.raw(name).unwrap(), "{name}");
        assert_eq!(art.entry(name).unwrap().dtype, Dtype::BF16);
    }
    assert_eq!(
        art.entries.len(),
        source.entries.len() + SIZE.layers * LINEARS.len()
    );
    let cfg = read_json(&out.join("config.json"));
    let qc = &cfg["quantization_config"];
    assert_eq!(qc["quant_method"], "compressed-tensors");
    assert_eq!(qc["format"], "float-quantized");
    assert_eq!(qc["quantization_status"], "compressed");
    let g = &qc["config_groups"]["group_0"];
    assert_eq!(g["targets"], serde_json::json!(["Linear"]));
    assert_eq!(g["weights"]["type"], "float");
    assert_eq!(g["weights"]["num_bits"], 8);
    assert_eq!(g["weights"]["strategy"], "channel");
    assert_eq!(g["input_activations"]["dynamic"], true);
    assert_eq!(qc["ignore"], serde_json::json!(["lm_head"]));
    assert_eq!(cfg["hidden_size"], SIZE.hidden);
    assert!(!out.join("quantize_config.json").exists());
    assert!(out.join("tokenizer.json").is_file());
    let sc = verify_save_complete(&out, true).expect(".save-complete verifies");
    assert!(!sc.has_quantize_config && sc.has_config && sc.has_index);
    assert_eq!(sc.config_digest.as_deref(), Some(o.config_digest.as_str()));
    assert_eq!(
        o.compressed_size_bytes,
        sc.shards.iter().map(|s| s.size_bytes).sum::<u64>()
    );
    let q: Fp8Quality =
        serde_json::from_value(read_json(&out.join(files::QUANTIZATION_QUALITY))).unwrap();
    assert_eq!((q.format.as_str(), q.strategy.as_str()), ("FP8", "channel"));
    assert_eq!(
        (q.quantized_modules, q.kept_modules),
        ((SIZE.layers * 7) as u64, 0)
    );
    assert!(
        q.max_relative_error >= q.mean_relative_error && q.max_relative_error < 0.06,
        "{q:?}"
    );
    assert_eq!(Some(&q), o.quality.as_ref());
    // No work or staging directory is left beside the artifact.
    let names: Vec<String> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");

    // A second run with the same settings reuses the artifact; another strategy rewrites it.
    let again =
        write_fp8_artifact(&job(&src, &out, ScaleStrategy::Channel, None), &NullSink).unwrap();
    assert!(again.cached);
    assert_eq!(again.config_digest, o.config_digest);
    let t = write_fp8_artifact(&job(&src, &out, ScaleStrategy::Tensor, None), &NullSink).unwrap();
    assert!(!t.cached && t.config_digest != o.config_digest);
    let art = TensorStore::open_dir(&out).unwrap();
    let s = art
        .entry("model.layers.1.mlp.down_proj.weight_scale")
        .unwrap();
    assert_eq!(s.shape, vec![1]);
    assert_eq!(
        read_json(&out.join("config.json"))["quantization_config"]["config_groups"]["group_0"]
            ["weights"]["strategy"],
        "tensor"
    );
}

#[test]
fn excluded_linears_stay_in_full_precision_and_are_ignored() {
    let d = tempfile::tempdir().unwrap();
    let (src, out) = (d.path().join("model"), d.path().join("fp8"));
    model(&src);
    let o = write_fp8_artifact(
        &job(
            &src,
            &out,
            ScaleStrategy::Channel,
            Some("o_proj,layers.1.mlp.down_proj"),
        ),
        &NullSink,
    )
    .unwrap();
    let art = TensorStore::open_dir(&out).unwrap();
    let mut want_ignore = vec![
        "lm_head".to_string(),
        "model.layers.1.mlp.down_proj".to_string(),
    ];
    for l in 0..SIZE.layers {
        let o_proj = format!("model.layers.{l}.self_attn.o_proj");
        assert_eq!(
            art.entry(&format!("{o_proj}.weight")).unwrap().dtype,
            Dtype::BF16
        );
        assert!(!art.contains(&format!("{o_proj}.weight_scale")));
        want_ignore.push(o_proj);
    }
    assert_eq!(
        art.entry("model.layers.0.mlp.down_proj.weight")
            .unwrap()
            .dtype,
        Dtype::F8_E4M3
    );
    want_ignore.sort();
    let ignore: Vec<String> = serde_json::from_value(
        read_json(&out.join("config.json"))["quantization_config"]["ignore"].clone(),
    )
    .unwrap();
    assert_eq!(ignore, want_ignore);
    let q = o.quality.unwrap();
    assert_eq!(
        (q.quantized_modules, q.kept_modules),
        ((SIZE.layers * 6 - 1) as u64, (SIZE.layers + 1) as u64)
    );
}

#[test]
fn bad_input_names_the_problem_and_keeps_the_previous_artifact() {
    let d = tempfile::tempdir().unwrap();
    let (src, out) = (d.path().join("model"), d.path().join("fp8"));
    model(&src);
    write_fp8_artifact(&job(&src, &out, ScaleStrategy::Channel, None), &NullSink).unwrap();
    let before = std::fs::read(out.join(files::SAVE_COMPLETE)).unwrap();
    // A NaN in one weight: rewrite that shard with the value replaced.
    let store = TensorStore::open_dir(&src).unwrap();
    let name = "model.layers.2.mlp.up_proj.weight";
    let e = store.entry(name).unwrap().clone();
    let file = store.files[e.file].clone();
    drop(store);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[e.start + 2 * 7..e.start + 2 * 8].copy_from_slice(&half::bf16::NAN.to_le_bytes());
    std::fs::write(&file, bytes).unwrap();
    // Another digest (the source changed), so the run does not reuse the artifact; it fails instead.
    let err =
        write_fp8_artifact(&job(&src, &out, ScaleStrategy::Tensor, None), &NullSink).unwrap_err();
    assert!(err.is_bad_input(), "{err}");
    assert!(
        flexinfer_contract::error::chain(&err).contains(name)
            && flexinfer_contract::error::chain(&err).contains("element 7"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(out.join(files::SAVE_COMPLETE)).unwrap(),
        before
    );
    assert!(verify_save_complete(&out, true).is_some());
    let err = write_fp8_artifact(
        &job(&src, &out, ScaleStrategy::Channel, Some("o_proj,auto")),
        &NullSink,
    )
    .unwrap_err();
    assert!(
        flexinfer_contract::error::chain(&err).contains("DYNAMIC_EXCLUSION"),
        "{err}"
    );
    let missing = d.path().join("nothing");
    let err = write_fp8_artifact(
        &job(&missing, &out, ScaleStrategy::Channel, None),
        &NullSink,
    )
    .unwrap_err();
    assert!(
        flexinfer_contract::error::chain(&err).contains("config.json")
            || flexinfer_contract::error::chain(&err).contains(&missing.display().to_string()),
        "{err}"
    );
    assert_eq!(
        std::fs::read(out.join(files::SAVE_COMPLETE)).unwrap(),
        before
    );
}

/// Writes our dequantization of every quantized linear (f32) for the Python check.
fn write_expected(art: &TensorStore, path: &Path) {
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in art.entries.keys().filter(|n| n.ends_with(".weight_scale")) {
        let m = name.trim_end_matches(".weight_scale");
        let (v, shape) = dequantized(art, m);
        data.push((
            format!("{m}.weight"),
            shape,
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
fn compressed_tensors_decompresses_and_transformers_loads_our_fp8_like_we_dequantize_it() {
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
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/fp8/check_fp8.py");
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    model(&src);
    for (strategy, excl) in [
        (ScaleStrategy::Channel, Some("layers.1.mlp.down_proj")),
        (ScaleStrategy::Tensor, None),
    ] {
        let out = d.path().join(format!("fp8-{}", strategy.as_str()));
        write_fp8_artifact(&job(&src, &out, strategy, excl), &NullSink).unwrap();
        let expected = d
            .path()
            .join(format!("expected-{}.safetensors", strategy.as_str()));
        write_expected(&TensorStore::open_dir(&out).unwrap(), &expected);
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
            "{strategy:?}: {stdout}\n{}",
            String::from_utf8_lossy(&r.stderr)
        );
        let report: serde_json::Value =
            serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let kept = usize::from(excl.is_some());
        assert_eq!(report["modules"], SIZE.layers * 7 - kept, "{report}");
        assert_eq!(report["format"], "float-quantized");
        eprintln!("{strategy:?}: {report}");
    }
}
