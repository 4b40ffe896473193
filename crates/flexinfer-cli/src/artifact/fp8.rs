//! `--layout fp8`: an FP8 checkpoint in compressed-tensors' `float-quantized` layout, as vLLM's
//! compressed-tensors loader and transformers read it (docs/user/quantization-pipelines.md "FP8"):
//! `quantization_config` (method, format, the config group's E4M3 weights and their strategy), every
//! `<m>.weight_scale` beside an `F8_E4M3` `<m>.weight` of the strategy's shape, finite positive
//! scales, no NaN code, no quantized module in `ignore`; with static activation scales (the group's
//! `input_activations` `dynamic: false`) every quantized linear's `<m>.input_scale` `F32 [1]`, finite and
//! positive (and none with dynamic ones); then the shards, index, `.save-complete` and the FP8 quality
//! sidecar.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use flexinfer_api::contract::{files, Fp8Quality};
use flexinfer_fsutil::limits;
use serde_json::Value;

use super::read::{read_bytes, read_file, TensorInfo};
use super::{compressed_tensors, validate_layout, Options, Report};
use flexinfer_api::contract::error::chain;

/// The E4M3 NaN codes (`S.1111.111`).
const NAN_CODES: [u8; 2] = [0x7F, 0xFF];

/// Whether `config.json` in `dir` declares compressed-tensors' `float-quantized` format.
pub fn is_fp8(dir: &Path) -> bool {
    compressed_tensors::declares_format(dir, "float-quantized")
}

/// What the config says the linears hold.
struct Declared {
    /// The weight strategy (`channel` / `tensor`).
    strategy: String,
    ignore: Vec<String>,
    /// Static per-tensor input scales (`input_activations.dynamic: false`).
    static_inputs: bool,
}

/// The weight strategy, `ignore` and activation scheme of a usable `quantization_config`.
fn check_config(r: &mut Report, dir: &Path) -> Option<Declared> {
    let qc = compressed_tensors::quantization_config(r, dir)?;
    let s = |k: &str| qc.get(k).and_then(Value::as_str);
    if s("quant_method") != Some("compressed-tensors") {
        r.defect(
            "config",
            format!(
                "quantization_config.quant_method is {:?}, expected \"compressed-tensors\"",
                s("quant_method")
            ),
        );
    }
    if s("format") != Some("float-quantized") {
        r.defect(
            "config",
            format!(
                "quantization_config.format is {:?}, expected \"float-quantized\"",
                s("format")
            ),
        );
    }
    if s("quantization_status") != Some("compressed") {
        r.defect("config", "quantization_config.quantization_status is not \"compressed\" (loaders would expect dense weights)");
    }
    let (name, group) = compressed_tensors::single_group(r, &qc)?;
    let w = &group["weights"];
    let strategy = w
        .get("strategy")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if w.get("type").and_then(Value::as_str) != Some("float")
        || w.get("num_bits").and_then(Value::as_u64) != Some(8)
    {
        r.defect(
            "config",
            format!("config_groups.{name}.weights is not 8-bit float (E4M3)"),
        );
    }
    if !matches!(strategy.as_str(), "channel" | "tensor") {
        r.defect(
            "config",
            format!("config_groups.{name}.weights.strategy {strategy:?} is not channel or tensor"),
        );
    }
    let ia = &group["input_activations"];
    let static_inputs = ia.get("dynamic").and_then(Value::as_bool) == Some(false);
    if static_inputs
        && (ia.get("strategy").and_then(Value::as_str) != Some("tensor")
            || ia.get("type").and_then(Value::as_str) != Some("float")
            || ia.get("num_bits").and_then(Value::as_u64) != Some(8))
    {
        r.defect(
            "config",
            format!(
                "config_groups.{name}.input_activations are static but not 8-bit float per tensor (the input_scale the engine writes)"
            ),
        );
    }
    let ignore = compressed_tensors::ignore_list(&qc);
    Some(Declared {
        strategy,
        ignore,
        static_inputs,
    })
}

/// `<m>.input_scale` of a quantized linear: with static inputs present, `F32 [1]`, finite and positive; with
/// dynamic ones absent.
fn check_input_scale(
    r: &mut Report,
    dir: &Path,
    tensors: &BTreeMap<String, TensorInfo>,
    m: &str,
    static_inputs: bool,
) {
    let name = format!("{m}.input_scale");
    match (tensors.get(&name), static_inputs) {
        (None, false) => {}
        (Some(_), false) => r.defect(
            "linear",
            format!("{name} is present but the config declares dynamic input activations"),
        ),
        (None, true) => r.defect(
            "linear",
            format!("{name} is missing (the config declares static input activations)"),
        ),
        (Some(t), true) if t.dtype != "F32" || t.shape != [1] => r.defect(
            "linear",
            format!("{name} is {} {:?}, expected F32 [1]", t.dtype, t.shape),
        ),
        (Some(t), true) => match read_bytes(dir, t) {
            Ok(b) => {
                let v = b
                    .get(..4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                if !v.is_some_and(|v| v.is_finite() && v > 0.0) {
                    r.defect(
                        "linear",
                        format!("{name} is {v:?}, not a finite positive scale"),
                    );
                }
            }
            Err(e) => r.defect("linear", chain(&e)),
        },
    }
}

/// Every quantized linear: dtypes, shapes, scales, codes. Returns how many there are.
fn check_linears(
    r: &mut Report,
    dir: &Path,
    tensors: &BTreeMap<String, TensorInfo>,
    declared: &Declared,
) -> usize {
    let (strategy, ignore) = (declared.strategy.as_str(), declared.ignore.as_slice());
    let mut modules = BTreeSet::new();
    for (name, t) in tensors {
        if t.dtype == "F8_E4M3" {
            match name.strip_suffix(".weight") {
                Some(m) if tensors.contains_key(&format!("{m}.weight_scale")) => {}
                _ => r.defect(
                    "linear",
                    format!("{name} is F8_E4M3 without a weight_scale beside it"),
                ),
            }
        }
        let Some(m) = name.strip_suffix(".weight_scale") else {
            continue;
        };
        modules.insert(m.to_string());
        let Some(w) = tensors.get(&format!("{m}.weight")) else {
            r.defect("linear", format!("{name} has no {m}.weight"));
            continue;
        };
        if w.dtype != "F8_E4M3" || w.shape.len() != 2 {
            r.defect(
                "linear",
                format!(
                    "{m}.weight is {} {:?}, expected F8_E4M3 [out, in]",
                    w.dtype, w.shape
                ),
            );
            continue;
        }
        let want: Vec<u64> = if strategy == "tensor" {
            vec![1]
        } else {
            vec![w.shape[0], 1]
        };
        if t.dtype != "F32" || t.shape != want {
            r.defect(
                "linear",
                format!(
                    "{name} is {} {:?}, expected F32 {want:?} ({strategy})",
                    t.dtype, t.shape
                ),
            );
            continue;
        }
        check_input_scale(r, dir, tensors, m, declared.static_inputs);
        if ignore.iter().any(|i| i == m) {
            r.defect(
                "linear",
                format!("{m} is quantized but listed in quantization_config.ignore"),
            );
        }
        match read_bytes(dir, t) {
            Ok(b) => {
                let bad = b
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .position(|s| !(s.is_finite() && s > 0.0));
                if let Some(i) = bad {
                    r.defect(
                        "linear",
                        format!("{name}[{i}] is not a finite positive scale"),
                    );
                }
            }
            Err(e) => r.defect("linear", chain(&e)),
        }
        match read_bytes(dir, w) {
            Ok(b) => {
                if let Some(i) = b.iter().position(|c| NAN_CODES.contains(c)) {
                    r.defect("linear", format!("{m}.weight[{i}] is the E4M3 NaN code"));
                }
            }
            Err(e) => r.defect("linear", chain(&e)),
        }
    }
    if modules.is_empty() {
        r.defect("linear", "no quantized linear (no *.weight_scale tensor)");
    }
    r.quantized_linears = modules.len();
    modules.len()
}

/// The FP8 quality sidecar: present, valid, counting the linears the shards hold, and recording static
/// activation scales (with their calibration tokens) when the config declares them.
fn check_quality(r: &mut Report, dir: &Path, linears: usize, static_inputs: bool) {
    match read_file(dir, files::QUANTIZATION_QUALITY, limits::CONFIG_JSON) {
        Err(e) => r.defect(
            "quality",
            format!("{}: {}", files::QUANTIZATION_QUALITY, chain(&e)),
        ),
        Ok(b) => match serde_json::from_slice::<Fp8Quality>(&b) {
            Err(e) => r.defect(
                "quality",
                format!(
                    "{} is not an FP8 quality summary: {e}",
                    files::QUANTIZATION_QUALITY
                ),
            ),
            Ok(q) if q.quantized_modules != linears as u64 => r.defect(
                "quality",
                format!(
                    "{} counts {} quantized modules, the shards hold {linears}",
                    files::QUANTIZATION_QUALITY,
                    q.quantized_modules
                ),
            ),
            Ok(q) if static_inputs && (q.activations != "static" || q.calibration_tokens == 0) => {
                r.defect(
                    "quality",
                    format!(
                        "{} records activations {:?} over {} calibration tokens, the config declares static input scales",
                        files::QUANTIZATION_QUALITY,
                        q.activations,
                        q.calibration_tokens
                    ),
                )
            }
            Ok(_) => {}
        },
    }
}

/// Validate `dir` with the `fp8` layout.
pub fn validate_fp8(dir: &Path, opts: &Options) -> Report {
    validate_layout(
        dir,
        "fp8",
        opts,
        |r| check_config(r, dir),
        |r, tensors, declared| {
            let n = check_linears(r, dir, tensors, declared);
            check_quality(r, dir, n, declared.static_inputs);
        },
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::super::tests::{check_without_sha256 as check, edit_config, expect_defect, poke};
    use super::super::validate;
    use super::*;
    use flexinfer_quant::calib::CalibSettings;
    use flexinfer_quant::fp8::{write_fp8_artifact, Fp8Activations, Fp8Job, ScaleStrategy};
    use flexinfer_quant::testkit;

    /// The engine's own FP8 artifact of the tiny generated model.
    fn artifact(dir: &Path, strategy: ScaleStrategy) -> std::path::PathBuf {
        artifact_with(dir, strategy, false)
    }

    /// The engine's own FP8 artifact, with static activation scales when `stat`.
    fn artifact_with(dir: &Path, strategy: ScaleStrategy, stat: bool) -> std::path::PathBuf {
        let src = dir.join("model");
        testkit::write_model(&src, "LlamaForCausalLM", 5).unwrap();
        testkit::write_char_tokenizer(&src).unwrap();
        let data = dir.join("calib.jsonl");
        testkit::write_dataset(&data, 4).unwrap();
        let out = dir.join("fp8");
        write_fp8_artifact(
            &Fp8Job {
                model_dir: &src,
                out_dir: &out,
                strategy,
                activations: if stat {
                    Fp8Activations::Static {
                        dataset: &data,
                        calib: CalibSettings {
                            max_samples: 4,
                            max_seq_len: 32,
                        },
                    }
                } else {
                    Fp8Activations::Dynamic
                },
                dynamic_exclusion: None,
                script_version: "test",
                verify_save_sha256: true,
                max_shard_bytes: 1 << 20,
            },
            &flexinfer_quant::events::NullSink,
        )
        .unwrap();
        out
    }

    #[test]
    fn the_engines_artifacts_pass_and_are_detected_as_fp8() {
        for strategy in ScaleStrategy::ALL {
            let d = tempfile::tempdir().unwrap();
            let out = artifact(d.path(), strategy);
            let r = validate(&out, None, &Options::default()).unwrap();
            assert!(r.ok, "{strategy:?}: {}", r.render());
            assert_eq!(r.layout, "fp8");
            assert_eq!(r.quantized_linears, testkit::LAYERS * 7);
        }
    }

    #[test]
    fn static_input_scales_pass_and_their_absence_or_corruption_is_a_named_defect() {
        let m = "model.layers.2.mlp.up_proj";
        for strategy in ScaleStrategy::ALL {
            let d = tempfile::tempdir().unwrap();
            let out = artifact_with(d.path(), strategy, true);
            let r = validate(&out, None, &Options::default()).unwrap();
            assert!(r.ok, "{strategy:?}: {}", r.render());
            assert_eq!(r.quantized_linears, testkit::LAYERS * 7);
        }
        let d = tempfile::tempdir().unwrap();
        let out = artifact_with(d.path(), ScaleStrategy::Channel, true);
        poke(&out, &format!("{m}.input_scale"), 0, &0f32.to_le_bytes());
        expect_defect(
            &check(&out),
            "linear",
            &format!("{m}.input_scale is Some(0.0), not a finite positive scale"),
        );

        let d = tempfile::tempdir().unwrap();
        let out = artifact_with(d.path(), ScaleStrategy::Channel, true);
        poke(
            &out,
            &format!("{m}.input_scale"),
            0,
            &f32::NAN.to_le_bytes(),
        );
        expect_defect(
            &check(&out),
            "linear",
            &format!("{m}.input_scale is Some(NaN), not a finite positive scale"),
        );

        // A dynamic artifact whose config claims static scales: every input_scale is missing.
        let d = tempfile::tempdir().unwrap();
        let out = artifact(d.path(), ScaleStrategy::Channel);
        edit_config(&out, |v| {
            let ia = &mut v["quantization_config"]["config_groups"]["group_0"]["input_activations"];
            ia["dynamic"] = false.into();
            ia["strategy"] = "tensor".into();
        });
        let r = check(&out);
        expect_defect(
            &r,
            "linear",
            &format!("{m}.input_scale is missing (the config declares static input activations)"),
        );
        expect_defect(&r, "quality", "the config declares static input scales");

        // A static artifact whose config says dynamic: the scales are unexpected.
        let d = tempfile::tempdir().unwrap();
        let out = artifact_with(d.path(), ScaleStrategy::Tensor, true);
        edit_config(&out, |v| {
            let ia = &mut v["quantization_config"]["config_groups"]["group_0"]["input_activations"];
            ia["dynamic"] = true.into();
            ia["strategy"] = "token".into();
        });
        expect_defect(
            &check(&out),
            "linear",
            &format!("{m}.input_scale is present but the config declares dynamic"),
        );
    }

    #[test]
    fn corruptions_are_defects_naming_the_tensor_or_field() {
        let m = "model.layers.1.self_attn.k_proj";
        let d = tempfile::tempdir().unwrap();
        let out = artifact(d.path(), ScaleStrategy::Channel);
        poke(&out, &format!("{m}.weight"), 3, &[0x7F]);
        expect_defect(
            &check(&out),
            "linear",
            &format!("{m}.weight[3] is the E4M3 NaN code"),
        );

        let d = tempfile::tempdir().unwrap();
        let out = artifact(d.path(), ScaleStrategy::Channel);
        poke(&out, &format!("{m}.weight_scale"), 2, &0f32.to_le_bytes());
        expect_defect(
            &check(&out),
            "linear",
            &format!("{m}.weight_scale[2] is not a finite positive scale"),
        );

        let d = tempfile::tempdir().unwrap();
        let out = artifact(d.path(), ScaleStrategy::Channel);
        edit_config(&out, |v| {
            v["quantization_config"]["ignore"] = serde_json::json!(["lm_head", m])
        });
        expect_defect(
            &check(&out),
            "linear",
            &format!("{m} is quantized but listed"),
        );

        let d = tempfile::tempdir().unwrap();
        let out = artifact(d.path(), ScaleStrategy::Channel);
        edit_config(&out, |v| {
            v["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] =
                "tensor".into()
        });
        expect_defect(&check(&out), "linear", "expected F32 [1] (tensor)");

        let d = tempfile::tempdir().unwrap();
        let out = artifact(d.path(), ScaleStrategy::Channel);
        edit_config(&out, |v| {
            v["quantization_config"]["format"] = "int-quantized".into()
        });
        let r = validate(
            &out,
            Some("fp8"),
            &Options {
                skip_sha256: true,
                ..Default::default()
            },
        )
        .unwrap();
        expect_defect(&r, "config", "quantization_config.format");
        // Not declared float-quantized: not detected as FP8.
        assert_eq!(check(&out).layout, "vllm-gptq");

        let d = tempfile::tempdir().unwrap();
        let out = artifact(d.path(), ScaleStrategy::Channel);
        let p = out.join(files::QUANTIZATION_QUALITY);
        let mut q: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        q["quantizedModules"] = 3.into();
        std::fs::write(&p, serde_json::to_vec(&q).unwrap()).unwrap();
        expect_defect(&check(&out), "quality", "counts 3 quantized modules");
        std::fs::remove_file(&p).unwrap();
        expect_defect(&check(&out), "quality", files::QUANTIZATION_QUALITY);
    }
}
