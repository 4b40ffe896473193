//! `--layout pack-quantized`: a checkpoint in compressed-tensors' `pack-quantized` layout (the GPTQ solve
//! in compressed-tensors' container; docs/user/quantization-pipelines.md "compressed-tensors"), as the
//! `compressed-tensors` library and vLLM read it: `quantization_config` (method, format, status, the one
//! config group's int weights of 4 or 8 bits with their strategy and group size), every
//! `<m>.weight_packed` with its `weight_shape`, `weight_scale` (and `weight_zero_point` when asymmetric)
//! of the shapes the strategy gives, finite positive scales, no dense `<m>.weight` beside them, no
//! quantized module in `ignore`; then the shards, index, `.save-complete` and the GPTQ quality sidecar
//! (its gate passed).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::read::{read_bytes, TensorInfo};
use super::{compressed_tensors, quality, shards, validate_layout, Options, Report};
use flexinfer_api::contract::error::chain;

/// Whether `config.json` in `dir` declares compressed-tensors' `pack-quantized` format.
pub fn is_pack_quantized(dir: &Path) -> bool {
    compressed_tensors::declares_format(dir, "pack-quantized")
}

/// What the config group says about the weights.
struct Scheme {
    bits: u64,
    /// `None`: one group per row (`channel`).
    group_size: Option<u64>,
    symmetric: bool,
    ignore: Vec<String>,
}

fn check_config(r: &mut Report, dir: &Path) -> Option<Scheme> {
    let qc = compressed_tensors::quantization_config(r, dir)?;
    let s = |k: &str| qc.get(k).and_then(Value::as_str);
    for (key, want) in [
        ("quant_method", "compressed-tensors"),
        ("format", "pack-quantized"),
        ("quantization_status", "compressed"),
    ] {
        if s(key) != Some(want) {
            r.defect(
                "config",
                format!(
                    "quantization_config.{key} is {:?}, expected {want:?}",
                    s(key)
                ),
            );
        }
    }
    let (name, group) = compressed_tensors::single_group(r, &qc)?;
    let w = &group["weights"];
    let bits = w.get("num_bits").and_then(Value::as_u64).unwrap_or(0);
    if w.get("type").and_then(Value::as_str) != Some("int") || !matches!(bits, 4 | 8) {
        r.defect(
            "config",
            format!("config_groups.{name}.weights is not int of 4 or 8 bits"),
        );
        return None;
    }
    let group_size = match w.get("strategy").and_then(Value::as_str) {
        Some("channel") => None,
        Some("group") => match w.get("group_size").and_then(Value::as_u64) {
            Some(g) if g > 0 => Some(g),
            _ => {
                r.defect(
                    "config",
                    format!("config_groups.{name}.weights.group_size must be positive with strategy group"),
                );
                return None;
            }
        },
        other => {
            r.defect(
                "config",
                format!("config_groups.{name}.weights.strategy {other:?} is not group or channel"),
            );
            return None;
        }
    };
    if w.get("actorder").and_then(Value::as_str) == Some("group") {
        r.defect(
            "config",
            format!("config_groups.{name}.weights.actorder \"group\" needs weight_g_idx, which this layout does not carry"),
        );
    }
    let ignore = compressed_tensors::ignore_list(&qc);
    Some(Scheme {
        bits,
        group_size,
        symmetric: w.get("symmetric").and_then(Value::as_bool).unwrap_or(true),
        ignore,
    })
}

fn words(n: u64, bits: u64) -> u64 {
    (n * bits).div_ceil(32)
}

/// One scale as f64 from its dtype's bytes, `None` for a dtype that is not a float of 16/32 bits.
fn scale_values(dtype: &str, b: &[u8]) -> Option<Vec<f64>> {
    match dtype {
        "BF16" => Some(
            b.chunks_exact(2)
                .map(|c| f64::from(half::bf16::from_le_bytes([c[0], c[1]]).to_f32()))
                .collect(),
        ),
        "F16" => Some(
            b.chunks_exact(2)
                .map(|c| f64::from(half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
                .collect(),
        ),
        "F32" => Some(
            b.chunks_exact(4)
                .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
        ),
        _ => None,
    }
}

/// One quantized linear `m`; a defect for each thing that differs from the layout.
fn check_linear(
    r: &mut Report,
    dir: &Path,
    tensors: &BTreeMap<String, TensorInfo>,
    m: &str,
    scheme: &Scheme,
) {
    let get = |k: &str| tensors.get(&format!("{m}.{k}"));
    let (Some(packed), Some(shape_t), Some(scale)) = (
        get("weight_packed"),
        get("weight_shape"),
        get("weight_scale"),
    ) else {
        r.defect(
            "linear",
            format!("{m}: weight_packed needs weight_shape and weight_scale beside it"),
        );
        return;
    };
    if get("weight").is_some() {
        r.defect(
            "linear",
            format!("{m} has a dense weight beside weight_packed"),
        );
    }
    if scheme.ignore.iter().any(|i| i == m) {
        r.defect(
            "linear",
            format!("{m} is quantized but listed in quantization_config.ignore"),
        );
    }
    if shape_t.dtype != "I64" || shape_t.shape != [2] {
        r.defect(
            "linear",
            format!(
                "{m}.weight_shape is {} {:?}, expected I64 [2]",
                shape_t.dtype, shape_t.shape
            ),
        );
        return;
    }
    let (rows, cols) = match read_bytes(dir, shape_t) {
        Ok(b) if b.len() == 16 => {
            let v = |i: usize| {
                i64::from_le_bytes([
                    b[i],
                    b[i + 1],
                    b[i + 2],
                    b[i + 3],
                    b[i + 4],
                    b[i + 5],
                    b[i + 6],
                    b[i + 7],
                ])
            };
            (
                u64::try_from(v(0)).unwrap_or(0),
                u64::try_from(v(8)).unwrap_or(0),
            )
        }
        Ok(_) => {
            r.defect("linear", format!("{m}.weight_shape has the wrong size"));
            return;
        }
        Err(e) => {
            r.defect("linear", chain(&e));
            return;
        }
    };
    let bits = scheme.bits;
    if packed.dtype != "I32" || packed.shape != [rows, words(cols, bits)] {
        r.defect(
            "linear",
            format!(
                "{m}.weight_packed is {} {:?}, expected I32 [{rows}, {}] ({bits}-bit, weight_shape [{rows}, {cols}])",
                packed.dtype,
                packed.shape,
                words(cols, bits)
            ),
        );
    }
    let groups = match scheme.group_size {
        None => 1,
        Some(g) if g > 0 && cols % g == 0 => cols / g,
        Some(g) => {
            r.defect(
                "linear",
                format!("{m}: group size {g} does not divide the input dimension {cols}"),
            );
            return;
        }
    };
    if !matches!(scale.dtype.as_str(), "BF16" | "F16" | "F32") || scale.shape != [rows, groups] {
        r.defect(
            "linear",
            format!(
                "{m}.weight_scale is {} {:?}, expected BF16/F16/F32 [{rows}, {groups}]",
                scale.dtype, scale.shape
            ),
        );
    } else {
        shards::check_scales(r, dir, scale, &format!("{m}.weight_scale"), |b| {
            scale_values(&scale.dtype, b).unwrap_or_default()
        });
    }
    match (get("weight_zero_point"), scheme.symmetric) {
        (Some(_), true) => r.defect(
            "linear",
            format!("{m}.weight_zero_point is present but the weights are symmetric"),
        ),
        (None, false) => r.defect(
            "linear",
            format!("{m} has no weight_zero_point but the weights are asymmetric"),
        ),
        (Some(z), false) if z.dtype != "I32" || z.shape != [words(rows, bits), groups] => {
            r.defect(
                "linear",
                format!(
                    "{m}.weight_zero_point is {} {:?}, expected I32 [{}, {groups}] (packed along the output dimension)",
                    z.dtype,
                    z.shape,
                    words(rows, bits)
                ),
            )
        }
        _ => {}
    }
}

/// Validate `dir` with the `pack-quantized` layout.
pub fn validate_pack_quantized(dir: &Path, opts: &Options) -> Report {
    let mut r = validate_layout(
        dir,
        "pack-quantized",
        opts,
        |r| check_config(r, dir),
        |r, tensors, scheme| {
            let modules = shards::quantized_modules(r, tensors, ".weight_packed");
            for m in &modules {
                check_linear(r, dir, tensors, m, scheme);
            }
            r.quantized_linears = modules.len();
        },
    );
    // This layout's quality sidecar is checked after `.save-complete` (the order of its defects).
    quality::check_quality(&mut r, dir);
    r.ok = r.defects.is_empty();
    r
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::super::tests::{check_without_sha256 as check, edit_config, expect_defect};
    use super::super::validate;
    use super::*;
    use flexinfer_quant::calib::CalibSettings;
    use flexinfer_quant::job::{run, Container, QuantizeJob};
    use flexinfer_quant::linalg::CpuBackend;
    use flexinfer_quant::params::GptqParams;
    use flexinfer_quant::testkit;

    /// The engine's own pack-quantized artifact of the tiny generated model.
    fn artifact(dir: &Path, sym: bool) -> std::path::PathBuf {
        let src = dir.join("model");
        testkit::write_model(&src, "LlamaForCausalLM", 5).unwrap();
        let ds = dir.join("calib.jsonl");
        testkit::write_dataset(&ds, 4).unwrap();
        let out = dir.join("ct");
        let job = QuantizeJob {
            container: Container::CompressedTensors,
            params: GptqParams {
                group_size: 32,
                sym,
                ..Default::default()
            },
            max_shard_bytes: 1 << 20,
            ..QuantizeJob::new(
                &src,
                &out,
                &ds,
                CalibSettings {
                    max_samples: 4,
                    max_seq_len: 32,
                },
                "test",
            )
        };
        run(
            &job,
            &CpuBackend::default(),
            &flexinfer_quant::events::NullSink,
        )
        .unwrap();
        out
    }

    #[test]
    fn the_engines_artifacts_pass_and_are_detected_and_edits_are_defects() {
        let m = "model.layers.1.self_attn.k_proj";
        for sym in [true, false] {
            let d = tempfile::tempdir().unwrap();
            let out = artifact(d.path(), sym);
            let r = validate(&out, None, &Options::default()).unwrap();
            assert!(r.ok, "sym {sym}: {}", r.render());
            assert_eq!(r.layout, "pack-quantized");
            assert_eq!(r.quantized_linears, testkit::LAYERS * 7);
            // The declared symmetry no longer matches the tensors.
            edit_config(&out, |v| {
                v["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] =
                    (!sym).into()
            });
            let needle = if sym {
                "has no weight_zero_point"
            } else {
                "weight_zero_point is present"
            };
            expect_defect(&check(&out), "linear", needle);
        }
        let d = tempfile::tempdir().unwrap();
        let out = artifact(d.path(), true);
        edit_config(&out, |v| {
            v["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] =
                64.into()
        });
        expect_defect(&check(&out), "linear", &format!("{m}.weight_scale is BF16"));
        edit_config(&out, |v| {
            let w = &mut v["quantization_config"]["config_groups"]["group_0"]["weights"];
            w["group_size"] = 32.into();
            w["num_bits"] = 8.into();
        });
        expect_defect(&check(&out), "linear", &format!("{m}.weight_packed is I32"));
        edit_config(&out, |v| {
            let qc = &mut v["quantization_config"];
            qc["config_groups"]["group_0"]["weights"]["num_bits"] = 4.into();
            qc["ignore"] = serde_json::json!(["lm_head", m]);
        });
        expect_defect(
            &check(&out),
            "linear",
            &format!("{m} is quantized but listed"),
        );
        edit_config(&out, |v| {
            v["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 3.into()
        });
        let r = validate(
            &out,
            Some("pack-quantized"),
            &Options {
                skip_sha256: true,
                ..Default::default()
            },
        )
        .unwrap();
        expect_defect(&r, "config", "is not int of 4 or 8 bits");
    }

    /// The `quantization_config` reads both compressed-tensors layouts share (compressed_tensors.rs).
    #[test]
    fn the_config_needs_one_group_and_the_object() {
        for layout in ["pack-quantized", "fp8"] {
            let d = tempfile::tempdir().unwrap();
            let out = artifact(d.path(), true);
            let check = |out: &Path| {
                validate(
                    out,
                    Some(layout),
                    &Options {
                        skip_sha256: true,
                        ..Default::default()
                    },
                )
                .unwrap()
            };
            edit_config(&out, |v| {
                let g = v["quantization_config"]["config_groups"]["group_0"].clone();
                v["quantization_config"]["config_groups"]["group_1"] = g;
            });
            expect_defect(
                &check(&out),
                "config",
                "quantization_config.config_groups must hold exactly one group",
            );
            edit_config(&out, |v| {
                v.as_object_mut().unwrap().remove("quantization_config");
            });
            let r = check(&out);
            expect_defect(
                &r,
                "config",
                "config.json has no quantization_config object",
            );
            assert_eq!(r.quantized_linears, 0, "{layout}: {}", r.render());
        }
    }
}
