//! An FP8 artifact directory in compressed-tensors' `float-quantized` layout (what vLLM's
//! compressed-tensors loader and transformers' `CompressedTensorsHfQuantizer` read): every quantized
//! linear's `weight` as `F8_E4M3` and its `weight_scale` as `F32` (`[out, 1]` per channel, `[1]` per
//! tensor); everything else copied as it is; `config.json` gains the `quantization_config`; the quality
//! sidecar, tokenizer files and `.save-complete` as a GPTQ checkpoint has them. Staged beside `out_dir`
//! and exchanged into place whole; a finished artifact of the same digest is reused.

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
/// (E4M3 weights with static scales of `strategy`, dynamic per-token E4M3 activations: llm-compressor's
/// `FP8_DYNAMIC` scheme, or its per-tensor form), the `ignore` list, the `float-quantized` format.
pub fn quantization_config(strategy: ScaleStrategy, ignore: &[String]) -> Value {
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
                    "strategy": "token", "dynamic": true,
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
fn digest_of(job: &Fp8Job<'_>, exclusion: &Exclusion, store: &TensorStore) -> Result<String> {
    Ok(sha256_hex(
        json!({
            "format": "fp8", "strategy": job.strategy.as_str(), "exclusion": exclusion.as_str(),
            "model": input_digest(job.model_dir, store)?, "max_shard_bytes": job.max_shard_bytes,
            "script_version": job.script_version, "engine": env!("CARGO_PKG_VERSION"),
        })
        .to_string()
        .as_bytes(),
    ))
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
    run.rewrite(events, |work| {
        quantize_and_save(job, &cfg, &store, &plan, work, &digest, events)
    })
}

/// Quantizes layer by layer into `work` (one file per layer, so only one layer's output is in memory),
/// then writes the checkpoint from the source and the work files.
fn quantize_and_save(
    job: &Fp8Job<'_>,
    cfg: &ModelConfig,
    store: &TensorStore,
    plan: &Fp8Plan,
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
        let next_layer = plan.quantized.get(i + 1).map(|(n, _, _)| layer_of(n));
        if next_layer != Some(layer_of(module)) {
            flush(&mut pending)?;
        }
        progress(
            events,
            "fp8",
            90.0 * (i + 1) as f64 / total.max(1) as f64,
            format!("module {}/{total}", i + 1),
        );
    }
    flush(&mut pending)?;
    let quality = quality_of(job.strategy, &errors, plan.kept.len());
    let work_store = TensorStore::open_files(work_files)?;
    let tensors = merged_tensors(store, &work_store, |name| work_store.contains(name))?;
    let mut config_json = cfg.raw.clone();
    config_json["quantization_config"] = quantization_config(job.strategy, &plan.ignore);
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

fn quality_of(strategy: ScaleStrategy, errors: &[(String, f64)], kept: usize) -> Fp8Quality {
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
    }
}
