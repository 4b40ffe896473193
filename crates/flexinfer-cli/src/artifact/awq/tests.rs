//! `--layout awq` on the engine's own AWQ artifact of the tiny generated model (it must pass), and one
//! edit of each kind (each must be a defect naming the key or tensor).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::super::tests::{check_without_sha256 as check, edit_config, expect_defect, poke};
use super::super::validate;
use super::*;
use flexinfer_quant::awq::{write_awq_artifact, AwqJob};
use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::testkit;
use serde_json::json;
use std::path::PathBuf;

const M: &str = "model.layers.1.self_attn.k_proj";

/// The engine's AWQ artifact (group size 32) of the tiny generated Llama.
fn artifact(dir: &Path) -> PathBuf {
    let src = dir.join("model");
    testkit::write_model(&src, "LlamaForCausalLM", 5).unwrap();
    let ds = dir.join("calib.jsonl");
    testkit::write_dataset(&ds, 4).unwrap();
    let out = dir.join("awq");
    write_awq_artifact(
        &AwqJob {
            model_dir: &src,
            out_dir: &out,
            dataset: &ds,
            calib: CalibSettings {
                max_samples: 4,
                max_seq_len: 32,
            },
            bits: 4,
            group_size: 32,
            script_version: "test",
            verify_save_sha256: true,
            max_shard_bytes: 1 << 20,
            max_output_error_ratio: flexinfer_quant::awq::gate::DEFAULT_MAX_OUTPUT_ERROR_RATIO,
        },
        &flexinfer_quant::events::NullSink,
    )
    .unwrap();
    out
}

/// A fresh copy of the artifact (the engine runs once per test).
fn copy_of(src: &Path, dir: &Path) -> PathBuf {
    let dst = dir.join(format!("copy{}", std::fs::read_dir(dir).unwrap().count()));
    std::fs::create_dir(&dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
    dst
}

/// An edit of `config.json`.
type ConfigEdit = Box<dyn Fn(&mut Value)>;

#[test]
fn the_engines_artifact_passes_and_each_edit_is_a_defect_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let good = artifact(d.path());
    let r = validate(&good, None, &Options::default()).unwrap();
    assert!(r.ok, "{}", r.render());
    assert_eq!(r.layout, "awq");
    assert_eq!(r.quantized_linears, testkit::LAYERS * 7);
    assert!(r.warnings.is_empty(), "{}", r.render());
    let r = validate(
        &good,
        Some("awq"),
        &Options {
            family: Some("llama".into()),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.ok, "{}", r.render());

    let w = tempfile::tempdir().unwrap();
    let config_edits: Vec<(&str, ConfigEdit, &str, String)> = vec![
        (
            "version",
            Box::new(|v| v["quantization_config"]["version"] = "gemv".into()),
            "config",
            "quantization_config.version is Some(\"gemv\")".into(),
        ),
        (
            "bits",
            Box::new(|v| v["quantization_config"]["bits"] = 8.into()),
            "config",
            "quantization_config.bits is 8, expected 4".into(),
        ),
        (
            "group size the kernels lack",
            Box::new(|v| v["quantization_config"]["group_size"] = 48.into()),
            "config",
            "quantization_config.group_size is 48, expected one of 32, 64, 128".into(),
        ),
        (
            "group size the tensors do not have",
            Box::new(|v| v["quantization_config"]["group_size"] = 64.into()),
            "linear",
            format!("{M}.qzeros has shape"),
        ),
        (
            "zero_point",
            Box::new(|v| v["quantization_config"]["zero_point"] = false.into()),
            "config",
            "quantization_config.zero_point is false".into(),
        ),
        (
            "a quantized module skipped",
            Box::new(|v| {
                v["quantization_config"]["modules_to_not_convert"] = json!(["lm_head", "k_proj"])
            }),
            "linear",
            format!("{M} is quantized but modules_to_not_convert entry \"k_proj\""),
        ),
        (
            "modules_to_not_convert not a list",
            Box::new(|v| v["quantization_config"]["modules_to_not_convert"] = "lm_head".into()),
            "config",
            "quantization_config.modules_to_not_convert is \"lm_head\"".into(),
        ),
        (
            "method",
            Box::new(|v| v["quantization_config"]["quant_method"] = "gptq".into()),
            "config",
            "quantization_config.quant_method is Some(\"gptq\")".into(),
        ),
        (
            "shapes config.json implies",
            Box::new(|v| v["intermediate_size"] = 512.into()),
            "linear",
            "model.layers.0.mlp.gate_proj: quantized as".into(),
        ),
    ];
    for (what, edit, check_name, needle) in config_edits {
        let out = copy_of(&good, w.path());
        edit_config(&out, edit);
        // Explicit layout: an edited quant_method is no longer detected as AWQ.
        let r = validate(
            &out,
            Some("awq"),
            &Options {
                skip_sha256: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(r.layout, "awq", "{what}");
        expect_defect(&r, check_name, &needle);
    }

    // vLLM's and AutoAWQ's key spellings are accepted.
    let out = copy_of(&good, w.path());
    edit_config(&out, |v| {
        let qc = v["quantization_config"].as_object_mut().unwrap();
        let bits = qc.remove("bits").unwrap();
        let group = qc.remove("group_size").unwrap();
        qc.insert("w_bit".into(), bits);
        qc.insert("q_group_size".into(), group);
        qc.insert("version".into(), "GEMM".into());
    });
    let r = check(&out);
    assert!(r.ok, "{}", r.render());

    let out = copy_of(&good, w.path());
    poke(
        &out,
        &format!("{M}.scales"),
        2,
        &half::f16::ZERO.to_le_bytes(),
    );
    expect_defect(
        &check(&out),
        "linear",
        &format!("{M}.scales[2] is not a finite positive scale"),
    );
    let out = copy_of(&good, w.path());
    poke(
        &out,
        &format!("{M}.scales"),
        5,
        &half::f16::NAN.to_le_bytes(),
    );
    expect_defect(
        &check(&out),
        "linear",
        &format!("{M}.scales[5] is not a finite positive scale"),
    );

    let out = copy_of(&good, w.path());
    let p = out.join(files::QUANTIZATION_QUALITY);
    let mut q: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    q["quantizedModules"] = 3.into();
    q["groupSize"] = 128.into();
    std::fs::write(&p, serde_json::to_vec(&q).unwrap()).unwrap();
    let r = check(&out);
    expect_defect(&r, "quality", "counts 3 quantized modules");
    expect_defect(
        &r,
        "quality",
        "records w4 g128, quantization_config says w4 g32",
    );
    q["format"] = "FP8".into();
    std::fs::write(&p, serde_json::to_vec(&q).unwrap()).unwrap();
    expect_defect(&check(&out), "quality", "is for format \"FP8\"");
    q["format"] = "AWQ".into();
    q["quantizedModules"] = (testkit::LAYERS as u64 * 7).into();
    q["groupSize"] = 32.into();
    q["gate"] = "failed".into();
    q["outputErrorRatio"] = 1.25.into();
    std::fs::write(&p, serde_json::to_vec(&q).unwrap()).unwrap();
    let r = check(&out);
    expect_defect(
        &r,
        "quality",
        "quality gate failed: mean output error ratio to plain rounding 1.2500",
    );
    assert_eq!(r.defects.len(), 1, "{}", r.render());
    // A sidecar from before the gate: a warning, not a defect.
    q.as_object_mut().unwrap().remove("gate");
    std::fs::write(&p, serde_json::to_vec(&q).unwrap()).unwrap();
    let r = check(&out);
    assert!(r.ok, "{}", r.render());
    assert!(
        r.warnings
            .iter()
            .any(|w| w.message.contains("records no gate")),
        "{}",
        r.render()
    );
    std::fs::write(&p, b"{\"format\": \"AWQ\"}").unwrap();
    expect_defect(&check(&out), "quality", "is not an AWQ quality summary");
    std::fs::remove_file(&p).unwrap();
    expect_defect(&check(&out), "quality", files::QUANTIZATION_QUALITY);

    // The save must have completed.
    let out = copy_of(&good, w.path());
    std::fs::remove_file(out.join(files::SAVE_COMPLETE)).unwrap();
    expect_defect(&check(&out), "save-complete", files::SAVE_COMPLETE);
}

fn info(dtype: &str, shape: &[u64]) -> TensorInfo {
    TensorInfo {
        shard: "model.safetensors".into(),
        dtype: dtype.into(),
        shape: shape.to_vec(),
        start: 0,
        end: 0,
    }
}

/// The tensors of one linear `m` in the GEMM layout, `[in, out]`, group 32.
fn linear(m: &str, inp: u64, out: u64) -> BTreeMap<String, TensorInfo> {
    BTreeMap::from([
        (format!("{m}.qweight"), info("I32", &[inp, out / 8])),
        (format!("{m}.qzeros"), info("I32", &[inp / 32, out / 8])),
        (format!("{m}.scales"), info("F16", &[inp / 32, out])),
    ])
}

fn scheme(skip: &[&str]) -> Scheme {
    Scheme {
        group_size: 32,
        modules_to_not_convert: skip.iter().map(|s| s.to_string()).collect(),
    }
}

/// `check_linear` on synthetic headers (scales of the right shape are then unreadable: another defect).
fn check_shapes(tensors: &BTreeMap<String, TensorInfo>, m: &str) -> Report {
    let mut r = Report::default();
    let dir = tempfile::tempdir().unwrap();
    check_linear(&mut r, dir.path(), tensors, m, &scheme(&["lm_head"]), None);
    r.ok = r.defects.is_empty();
    r
}

#[test]
fn untrusted_shapes_are_defects_naming_the_tensor_not_panics() {
    let m = "model.layers.0.mlp.down_proj";
    // A word count whose ×8 overflows.
    let mut t = linear(m, 64, 64);
    t.insert(format!("{m}.qweight"), info("I32", &[64, u64::MAX / 4]));
    expect_defect(
        &check_shapes(&t, m),
        "linear",
        &format!("{m}.qweight has shape [64, {}], too large", u64::MAX / 4),
    );
    // Input features that are not whole groups, and none at all.
    for inp in [48, 0] {
        let mut t = linear(m, 64, 64);
        t.insert(format!("{m}.qweight"), info("I32", &[inp, 8]));
        expect_defect(
            &check_shapes(&t, m),
            "linear",
            &format!("{m}.qweight has shape [{inp}, 8]: its {inp} input features"),
        );
    }
    // qzeros and scales that disagree with qweight.
    let mut t = linear(m, 64, 64);
    t.insert(format!("{m}.qzeros"), info("I32", &[2, 16]));
    t.insert(format!("{m}.scales"), info("F16", &[2, 8]));
    let r = check_shapes(&t, m);
    expect_defect(
        &r,
        "linear",
        &format!("{m}.qzeros has shape [2, 16], expected [2, 8]"),
    );
    expect_defect(
        &r,
        "linear",
        &format!("{m}.scales has shape [2, 8], expected [2, 64]"),
    );
    // Wrong dtypes, a missing tensor, GPTQ's g_idx, a dense weight beside the packed one.
    let mut t = linear(m, 64, 64);
    t.insert(format!("{m}.scales"), info("BF16", &[2, 64]));
    t.remove(&format!("{m}.qzeros"));
    t.insert(format!("{m}.g_idx"), info("I32", &[64]));
    t.insert(format!("{m}.weight"), info("BF16", &[64, 64]));
    let r = check_shapes(&t, m);
    expect_defect(
        &r,
        "linear",
        &format!("{m}.scales is BF16 [2, 64], expected a 2-D F16"),
    );
    expect_defect(&r, "linear", &format!("{m}.qzeros is missing"));
    expect_defect(&r, "linear", &format!("{m}.g_idx is present beside"));
    expect_defect(&r, "linear", &format!("{m}.weight is present beside"));
    // A bias of the wrong length.
    let mut t = linear(m, 64, 64);
    t.insert(format!("{m}.bias"), info("BF16", &[32]));
    expect_defect(
        &check_shapes(&t, m),
        "linear",
        &format!("{m}.bias has shape [32], expected [64]"),
    );
}

#[test]
fn a_dense_linear_of_a_quantized_kind_must_be_listed() {
    let q = "model.layers.0.self_attn.q_proj";
    let dense = "model.layers.1.self_attn.q_proj";
    let mut t = linear(q, 64, 64);
    t.insert(format!("{dense}.weight"), info("BF16", &[64, 64]));
    t.insert("lm_head.weight".into(), info("BF16", &[32, 64]));
    t.insert("model.norm.weight".into(), info("BF16", &[64]));
    let quantized = vec![q.to_string()];
    let mut r = Report::default();
    check_dense_linears(&mut r, &t, &quantized, &scheme(&["lm_head"]));
    r.ok = r.defects.is_empty();
    expect_defect(
        &r,
        "linear",
        &format!("{dense}.weight is dense but {dense} is not in modules_to_not_convert"),
    );
    assert_eq!(r.defects.len(), 1, "{}", r.render());
    let mut r = Report::default();
    check_dense_linears(
        &mut r,
        &t,
        &quantized,
        &scheme(&["lm_head", "layers.1.self_attn"]),
    );
    assert!(r.defects.is_empty(), "{}", r.render());
}
