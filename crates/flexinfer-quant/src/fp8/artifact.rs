//! An FP8 artifact directory in compressed-tensors' `float-quantized` layout (what vLLM's
//! compressed-tensors loader and transformers' `CompressedTensorsHfQuantizer` read): every quantized
//! linear's `weight` as `F8_E4M3` and its `weight_scale` as `F32` (`[out, 1]` per channel, `[1]` per
//! tensor), with static activation scales also its calibrated `input_scale` as `F32` `[1]`
//! ([`super::calibrate`]); everything else copied as it is; `config.json` gains the
//! `quantization_config`; the quality sidecar, tokenizer files and `.save-complete` as a GPTQ checkpoint
//! has them. Staged beside `out_dir`
//! and exchanged into place whole; a finished artifact of the same digest is reused.

use super::calibrate::{
    calibrate_input_scales, ActivationScheme, Fp8Activations, InputScales, CALIBRATION_PERCENT,
};
use super::quantize::{quantize_weight, ScaleStrategy};
use crate::error::{QuantError, Result};
use crate::events::EventSink;
use crate::exclusion::Exclusion;
use crate::fsutil::sha256_hex;
use crate::job::digest::input_digest;
use crate::job::rewrite::{
    merged_tensors, progress, write_work_file, ArtifactRun, RewriteOutcome, Rewritten, WorkTensor,
};
use crate::model::config::ModelConfig;
use crate::model::tensors::TensorStore;
use crate::model::{check_source_module, fused_expert_names, layer_modules};
use flexinfer_contract::files::Fp8Quality;
use safetensors::Dtype;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

/// What to make.
pub struct Fp8Job<'a> {
    pub model_dir: &'a Path,
    /// The artifact directory (the worker contract's `OUT_DIR`).
    pub out_dir: &'a Path,
    pub strategy: ScaleStrategy,
    /// `FP8_ACTIVATIONS`: dynamic (no calibration) or static with its calibration set.
    pub activations: Fp8Activations<'a>,
    /// `DYNAMIC_EXCLUSION` ([`Exclusion`]): which decoder linears stay in full precision.
    pub dynamic_exclusion: Option<&'a str>,
    pub script_version: &'a str,
    /// Re-hash the shards of an existing `.save-complete` before reusing it (else sizes only).
    pub verify_save_sha256: bool,
    pub max_shard_bytes: u64,
}

/// What a finished (or reused) artifact is.
pub type Fp8Outcome = RewriteOutcome<Fp8Quality>;

/// The linears of the model: those converted and the module names the consumer must leave alone.
#[derive(Debug, Default)]
pub struct Fp8Plan {
    /// Full module names (`model.layers.0.self_attn.q_proj`) with `[rows, cols]`, in layer order.
    pub quantized: Vec<(String, usize, usize)>,
    /// Candidate decoder linears kept in full precision.
    pub kept: Vec<String>,
    /// compressed-tensors' `ignore`: `lm_head`, the kept candidates, and every other 2-D `.weight` of the
    /// checkpoint that is not an embedding (routers, towers, projectors).
    pub ignore: Vec<String>,
}

/// Checks the model's linears and splits them; reads no weight data.
pub fn plan_fp8(cfg: &ModelConfig, store: &TensorStore, exclusion: &Exclusion) -> Result<Fp8Plan> {
    let mut plan = Fp8Plan::default();
    for layer in 0..cfg.num_layers {
        let prefix = cfg.layer_prefix(layer);
        let fused = fused_expert_names(store, cfg, layer).is_some();
        for spec in layer_modules(cfg, layer) {
            let name = format!("{prefix}{}", spec.name);
            if spec.tied || (fused && !store.contains(&format!("{name}.weight"))) {
                // Gemma 4's fused expert tensors are not linears: copied as they are.
                continue;
            }
            check_source_module(store, cfg, layer, &spec)?;
            if exclusion.excludes(&name, cfg.hybrid) {
                plan.kept.push(name);
            } else {
                plan.quantized.push((name, spec.shape.0, spec.shape.1));
            }
        }
    }
    let quantized: std::collections::HashSet<&str> =
        plan.quantized.iter().map(|(n, _, _)| n.as_str()).collect();
    let mut ignore: std::collections::BTreeSet<String> = plan.kept.iter().cloned().collect();
    // A tied head has no tensor, but the consumer's model has the linear.
    ignore.insert("lm_head".into());
    for (name, e) in &store.entries {
        let Some(stem) = name.strip_suffix(".weight") else {
            continue;
        };
        if e.shape.len() == 2 && !quantized.contains(stem) && !stem.ends_with("embed_tokens") {
            ignore.insert(stem.to_string());
        }
    }
    plan.ignore = ignore.into_iter().collect();
    Ok(plan)
}

/// compressed-tensors' `quantization_config` of the artifact: one config group over every `Linear`
/// (E4M3 weights with static scales of `strategy`; dynamic per-token E4M3 activations: llm-compressor's
/// `FP8_DYNAMIC` scheme, or its per-tensor form; or static per-tensor activations with calibrated
/// `input_scale`s: its `FP8` scheme, or its per-channel-weight form), the `ignore` list, the
/// `float-quantized` format.
pub fn quantization_config(
    strategy: ScaleStrategy,
    activations: ActivationScheme,
    ignore: &[String],
) -> Value {
    let (act_strategy, dynamic) = match activations {
        ActivationScheme::Dynamic => ("token", true),
        ActivationScheme::Static => ("tensor", false),
    };
    json!({
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8, "type": "float", "symmetric": true,
                    "strategy": strategy.as_str(), "dynamic": false,
                    "group_size": null, "block_structure": null, "actorder": null,
                },
                "input_activations": {
                    "num_bits": 8, "type": "float", "symmetric": true,
                    "strategy": act_strategy, "dynamic": dynamic,
                    "group_size": null, "block_structure": null, "actorder": null,
                },
                "output_activations": null,
                "format": "float-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": null,
        "sparsity_config": {},
        "quantizer": format!("flexinfer-quant:{}", env!("CARGO_PKG_VERSION")),
    })
}

/// The digest of everything that determines the artifact's bytes.
/// Static activation scales add the scheme, the calibration set's hash and sizes; a dynamic run's digest is
/// the one it always had (its artifacts stay reusable).
fn digest_of(job: &Fp8Job<'_>, exclusion: &Exclusion, store: &TensorStore) -> Result<String> {
    let mut inputs = json!({
        "format": "fp8", "strategy": job.strategy.as_str(), "exclusion": exclusion.as_str(),
        "model": input_digest(job.model_dir, store)?, "max_shard_bytes": job.max_shard_bytes,
        "script_version": job.script_version, "engine": env!("CARGO_PKG_VERSION"),
    });
    if let Fp8Activations::Static { dataset, calib } = &job.activations {
        let data = std::fs::read(dataset).map_err(|e| QuantError::io(dataset, e))?;
        inputs["activations"] = json!(ActivationScheme::Static.as_str());
        inputs["dataset"] = json!(sha256_hex(&data));
        inputs["max_samples"] = json!(calib.max_samples);
        inputs["max_seq_len"] = json!(calib.max_seq_len);
    }
    Ok(sha256_hex(inputs.to_string().as_bytes()))
}

/// Makes (or reuses) the FP8 artifact of `job`. Bad input (architecture, shapes, non-finite weights,
/// settings) is found before anything is moved to `out_dir`; a previous artifact there stays whole.
pub fn write_fp8_artifact(job: &Fp8Job<'_>, events: &dyn EventSink) -> Result<Fp8Outcome> {
    let started = Instant::now();
    let exclusion = Exclusion::parse(job.dynamic_exclusion)?;
    let cfg = ModelConfig::load(job.model_dir)?;
    let store = TensorStore::open_dir(job.model_dir)?;
    let digest = digest_of(job, &exclusion, &store)?;
    let run = ArtifactRun::new("fp8", job.out_dir, &store, &digest, started);
    if let Some(o) = run.reuse(job.verify_save_sha256, events) {
        return Ok(o);
    }
    let plan = plan_fp8(&cfg, &store, &exclusion)?;
    let input_scales = match &job.activations {
        Fp8Activations::Dynamic => None,
        Fp8Activations::Static { dataset, calib } => {
            let modules: Vec<String> = plan.quantized.iter().map(|(n, _, _)| n.clone()).collect();
            Some(calibrate_input_scales(
                &cfg,
                &store,
                job.model_dir,
                dataset,
                calib,
                &modules,
                job.strategy,
                events,
            )?)
        }
    };
    run.rewrite(events, |work| {
        quantize_and_save(
            job,
            &cfg,
            &store,
            &plan,
            input_scales.as_ref(),
            work,
            &digest,
            events,
        )
    })
}

/// Quantizes layer by layer into `work` (one file per layer, so only one layer's output is in memory),
/// then writes the checkpoint from the source and the work files. With `input_scales` (static
/// activations) every quantized linear also gets its `input_scale`.
#[allow(clippy::too_many_arguments)]
fn quantize_and_save(
    job: &Fp8Job<'_>,
    cfg: &ModelConfig,
    store: &TensorStore,
    plan: &Fp8Plan,
    input_scales: Option<&InputScales>,
    work: &Path,
    digest: &str,
    events: &dyn EventSink,
) -> Result<(u64, Fp8Quality)> {
    if work.exists() {
        std::fs::remove_dir_all(work).map_err(|e| QuantError::io(work, e))?;
    }
    std::fs::create_dir_all(work).map_err(|e| QuantError::io(work, e))?;
    let total = plan.quantized.len();
    let mut errors: Vec<(String, f64)> = Vec::with_capacity(total);
    let mut work_files = Vec::new();
    let mut pending: Vec<WorkTensor> = Vec::new();
    let mut flush = |pending: &mut Vec<WorkTensor>| -> Result<()> {
        if pending.is_empty() {
            return Ok(());
        }
        let path = work.join(format!("part-{:05}.safetensors", work_files.len()));
        write_work_file(&path, pending)?;
        pending.clear();
        work_files.push(path);
        Ok(())
    };
    let layer_of = |name: &str| {
        (0..cfg.num_layers)
            .rev()
            .find(|&l| name.starts_with(&cfg.layer_prefix(l)))
    };
    for (i, (module, rows, cols)) in plan.quantized.iter().enumerate() {
        let tensor = format!("{module}.weight");
        let values = store.f32(&tensor)?;
        let q = quantize_weight(&tensor, &values, *rows, *cols, job.strategy)?;
        drop(values);
        store.release_pages();
        errors.push((module.clone(), q.relative_error));
        let scales: Vec<u8> = q.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        pending.push((tensor, q.codes, Dtype::F8_E4M3, vec![*rows, *cols]));
        pending.push((
            format!("{module}.weight_scale"),
            scales,
            Dtype::F32,
            job.strategy.scale_shape(*rows),
        ));
        if let Some(s) = input_scales {
            let scale = s.scales.get(module).copied().ok_or_else(|| {
                crate::error::TensorError::ActivationScale {
                    module: module.clone(),
                    absmax: f32::NAN,
                }
            })?;
            pending.push((
                format!("{module}.input_scale"),
                scale.to_le_bytes().to_vec(),
                Dtype::F32,
                vec![1],
            ));
        }
        let next_layer = plan.quantized.get(i + 1).map(|(n, _, _)| layer_of(n));
        if next_layer != Some(layer_of(module)) {
            flush(&mut pending)?;
        }
        let (base, span) = match input_scales {
            None => (0.0, 90.0),
            Some(_) => (CALIBRATION_PERCENT, 90.0 - CALIBRATION_PERCENT),
        };
        progress(
            events,
            "fp8",
            base + span * (i + 1) as f64 / total.max(1) as f64,
            format!("module {}/{total}", i + 1),
        );
    }
    flush(&mut pending)?;
    let quality = quality_of(job.strategy, input_scales, &errors, plan.kept.len());
    let work_store = TensorStore::open_files(work_files)?;
    let tensors = merged_tensors(store, &work_store, |name| work_store.contains(name))?;
    let mut config_json = cfg.raw.clone();
    config_json["quantization_config"] =
        quantization_config(job.strategy, job.activations.scheme(), &plan.ignore);
    let bytes = Rewritten {
        phase: "fp8",
        out_dir: job.out_dir,
        max_shard_bytes: job.max_shard_bytes,
        source: store,
        rewritten: &work_store,
        config_json,
        source_dir: job.model_dir,
        script_version: job.script_version,
        config_digest: digest,
    }
    .write(tensors, &quality, events)?;
    Ok((bytes, quality))
}

fn quality_of(
    strategy: ScaleStrategy,
    input_scales: Option<&InputScales>,
    errors: &[(String, f64)],
    kept: usize,
) -> Fp8Quality {
    let worst = errors
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .cloned()
        .unwrap_or_default();
    let mean = if errors.is_empty() {
        0.0
    } else {
        errors.iter().map(|e| e.1).sum::<f64>() / errors.len() as f64
    };
    Fp8Quality {
        format: flexinfer_contract::env::FORMAT_FP8.into(),
        strategy: strategy.as_str().into(),
        quantized_modules: errors.len() as u64,
        kept_modules: kept as u64,
        max_relative_error: worst.1,
        worst_module: worst.0,
        mean_relative_error: mean,
        activations: input_scales
            .map(|_| ActivationScheme::Static.as_str().to_string())
            .unwrap_or_default(),
        calibration_tokens: input_scales.map_or(0, |s| s.tokens),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::model::calib::CalibSettings;
    use crate::testkit;

    #[test]
    fn the_digest_changes_with_the_activation_scheme_and_the_calibration_settings() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("model");
        testkit::write_model(&src, "LlamaForCausalLM", 3).unwrap();
        let data = d.path().join("calib.jsonl");
        testkit::write_dataset(&data, 4).unwrap();
        let other = d.path().join("other.jsonl");
        testkit::write_dataset(&other, 5).unwrap();
        let store = TensorStore::open_dir(&src).unwrap();
        let exclusion = Exclusion::parse(None).unwrap();
        let calib = |max_samples, max_seq_len| CalibSettings {
            max_samples,
            max_seq_len,
        };
        let digest = |activations: Fp8Activations<'_>| {
            let job = Fp8Job {
                model_dir: &src,
                out_dir: d.path(),
                strategy: ScaleStrategy::Channel,
                activations,
                dynamic_exclusion: None,
                script_version: "test",
                verify_save_sha256: true,
                max_shard_bytes: 1 << 20,
            };
            digest_of(&job, &exclusion, &store).unwrap()
        };
        let dynamic = digest(Fp8Activations::Dynamic);
        fn st(dataset: &Path, calib: CalibSettings) -> Fp8Activations<'_> {
            Fp8Activations::Static { dataset, calib }
        }
        let digests = [
            dynamic.clone(),
            digest(st(&data, calib(8, 64))),
            digest(st(&data, calib(9, 64))),
            digest(st(&data, calib(8, 65))),
            digest(st(&other, calib(8, 64))),
        ];
        let distinct: std::collections::HashSet<&String> = digests.iter().collect();
        assert_eq!(distinct.len(), digests.len(), "{digests:?}");
        // The same settings give the same digest (an artifact of them is reused).
        assert_eq!(digest(st(&data, calib(8, 64))), digests[1]);
        assert_eq!(digest(Fp8Activations::Dynamic), dynamic);
    }

    #[test]
    fn the_config_declares_the_activation_scheme() {
        let g = |a| {
            quantization_config(ScaleStrategy::Channel, a, &[])["config_groups"]["group_0"]
                ["input_activations"]
                .clone()
        };
        let dynamic = g(ActivationScheme::Dynamic);
        assert_eq!(
            (&dynamic["strategy"], &dynamic["dynamic"]),
            (&json!("token"), &json!(true))
        );
        let stat = g(ActivationScheme::Static);
        assert_eq!(
            (&stat["strategy"], &stat["dynamic"]),
            (&json!("tensor"), &json!(false))
        );
        assert_eq!(
            (&stat["type"], &stat["num_bits"]),
            (&json!("float"), &json!(8))
        );
        assert_eq!(stat["symmetric"], json!(true));
    }
}
