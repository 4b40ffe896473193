//! The end of a run: reporting a finished artifact made from the same configuration instead of
//! recomputing it, and the save: the gate, `quantization_config`, the checkpoint from the source and
//! the cached layers.

use super::calibrate::ModulePlan;
use super::layer::Totals;
use super::{evaluate_quality, Container, Outcome, Progress, QuantizeJob, Run};
use crate::error::{NumericError, QuantError, Result};
use crate::events::fields;
use crate::fsutil::read_json;
use crate::job::cache::LayerCache;
use crate::job::rewrite::push_stored;
use crate::job::writer::{write_checkpoint, Extras, OutTensor};
use crate::model::tensors::TensorStore;
use crate::model::{fused_expert_names, layer_modules, source_module_bytes, ModelConfig};
use crate::numerics::pack::ZeroFormat;
use flexinfer_contract::events as names;
use flexinfer_contract::files::{self, QualitySummary};
use serde_json::{json, Value};
use std::borrow::Cow;
use std::path::Path;
use std::time::Instant;

/// The artifact at `final_dir` was made from this configuration: report it without recomputing.
pub(super) fn reuse_artifact(
    job: &QuantizeJob,
    final_dir: &Path,
    sc: &files::SaveComplete,
    store: &TensorStore,
    config_hash: &str,
    started: Instant,
    progress: &mut Progress<'_>,
) -> Result<Outcome> {
    let events = progress.events;
    let quality = read_json(&final_dir.join(files::QUANTIZATION_QUALITY))
        .ok()
        .and_then(|v| serde_json::from_value::<QualitySummary>(v).ok());
    match &quality {
        Some(q) => events.emit(
            names::QUANTIZATION_QUALITY,
            serde_json::to_value(q)
                .ok()
                .and_then(|v| v.as_object().cloned())
                .unwrap_or_default(),
        ),
        None => events.emit(
            names::QUANTIZATION_QUALITY_UNAVAILABLE,
            fields([("outputDir", json!(final_dir.display().to_string()))]),
        ),
    }
    events.emit(
        names::QUANTIZATION_CACHED,
        fields([
            ("outputDir", json!(final_dir.display().to_string())),
            ("configDigest", json!(config_hash)),
            ("sha256Verified", json!(job.verify_save_sha256)),
        ]),
    );
    progress.emit(
        "complete",
        100.0,
        "cached artifact verified".into(),
        Default::default(),
    );
    Ok(Outcome {
        output_dir: final_dir.to_path_buf(),
        original_size_bytes: store.total_bytes(),
        compressed_size_bytes: sc.shards.iter().map(|s| s.size_bytes).sum(),
        seconds: started.elapsed().as_secs_f64(),
        quality,
        cached: true,
        config_digest: config_hash.to_string(),
    })
}

/// `quantization_config`: the GPTQ settings plus exactly what was quantized. `quantized[l]` are the
/// block-relative names of the modules quantized in layer `l` (true-sequential order), `kept[l]` those of the
/// candidate linears it keeps in full precision, `excluded` the full names of all kept candidates. Every kept
/// module gets a negative `dynamic` entry (GPTQModel / vLLM skip it). `modules_in_block_to_quantize` lists the
/// union of the layers' quantized modules (first-seen order) whenever no listed name is kept in some layer: the
/// form optimum / transformers read (they ignore `dynamic`), matched by name suffix inside each decoder layer, so
/// a layer converts just the listed modules it has. It is needed even when nothing is excluded: transformers'
/// GPTQ loader otherwise converts every plain `nn.Linear` of a layer, non-candidates such as Qwen2-MoE /
/// Qwen3-Next's `mlp.shared_expert_gate` (kept in full precision by the engine) included, and would leave them
/// uninitialised.
fn quantize_config_json(
    job: &QuantizeJob,
    quantized: &[Vec<String>],
    kept: &[Vec<String>],
    excluded: &[String],
) -> Value {
    let p = &job.params;
    let mut qc = json!({
        "quant_method": "gptq",
        "bits": p.bits,
        "group_size": p.group_size,
        "desc_act": p.desc_act,
        "sym": p.sym,
        "lm_head": false,
        "checkpoint_format": ZeroFormat::for_sym(p.sym).checkpoint_format(),
        "damp_percent": job.recovery.damp_percent,
        "true_sequential": true,
        "static_groups": p.static_groups,
        "pack_dtype": "int32",
        "meta": {
            "quantizer": [format!("flexinfer-quant:{}", env!("CARGO_PKG_VERSION"))],
            "damp_auto_increment": job.recovery.damp_auto_increment,
            "act_group_aware": p.act_group_aware && !p.desc_act,
            "clip_search": p.clip_search,
            "refine_rounds": p.refine_rounds,
        },
    });
    if !excluded.is_empty() {
        let dynamic: serde_json::Map<String, Value> = excluded
            .iter()
            .map(|m| (format!("-:^{}$", m.replace('.', "\\.")), json!({})))
            .collect();
        qc["dynamic"] = Value::Object(dynamic);
    }
    if let Some(block) = block_modules(quantized, kept) {
        qc["modules_in_block_to_quantize"] = json!([block]);
    }
    qc
}

/// The union of the layers' quantized block-relative names in first-seen order, or `None` when it is empty
/// or some listed name is kept in full precision in another layer (a suffix list cannot say that).
fn block_modules(quantized: &[Vec<String>], kept: &[Vec<String>]) -> Option<Vec<String>> {
    let mut seen = std::collections::HashSet::new();
    let mut union: Vec<String> = Vec::new();
    for name in quantized.iter().flatten() {
        if seen.insert(name.as_str()) {
            union.push(name.clone());
        }
    }
    let conflict = kept.iter().flatten().any(|k| seen.contains(k.as_str()));
    (!union.is_empty() && !conflict).then_some(union)
}

/// Everything the save needs beyond the job.
pub(super) struct SaveInput<'a> {
    pub(super) run: &'a Run<'a>,
    pub(super) plan: &'a ModulePlan,
    pub(super) config_hash: &'a str,
}

/// Applies the gate and writes the checkpoint from the source and the cached layers. A rejected run
/// writes nothing (see below); the layer cache is removed once the checkpoint is in place.
pub(super) fn save(
    s: &SaveInput<'_>,
    cache: LayerCache,
    totals: &Totals,
    progress: &mut Progress<'_>,
) -> Result<Outcome> {
    let (job, events, cfg, store) = (s.run.job, s.run.events, s.run.cfg, s.run.store);
    let final_dir = job.output_dir();
    cache.write_checkpoint("saving", None)?;
    let quality = evaluate_quality(totals.gptq, totals.rtn, &job.gate);
    let layer_stores: Vec<TensorStore> = (0..cfg.num_layers)
        .map(|l| {
            let p = cache
                .layer_path(l)
                .ok_or(NumericError::LayerNotCached { layer: l })?;
            TensorStore::open_files(vec![p])
        })
        .collect::<Result<_>>()?;
    let quality_json = quality_sidecar(&quality, totals)?;
    if quality.failed() {
        drop(layer_stores);
        return reject(job, quality, &quality_json, events);
    }
    let work = job.ct_work_dir();
    let converted = match job.container {
        Container::Gptq => None,
        Container::CompressedTensors => {
            let r = ct_layer_stores(job, store, &layer_stores, &work);
            if r.is_err() {
                remove_work(&work);
            }
            Some(r?)
        }
    };
    let result = write_save(
        s,
        store,
        &layer_stores,
        converted.as_ref(),
        &quality_json,
        progress,
    );
    drop(converted);
    remove_work(&work);
    let records = result?;
    drop(layer_stores);
    cache.remove()?;
    tracing::info!(output = %final_dir.display(), shards = records.len(), gate = %quality.gate, "checkpoint written");
    events.emit(
        names::QUANTIZATION_QUALITY,
        quality_json.as_object().cloned().unwrap_or_default(),
    );
    Ok(Outcome {
        output_dir: final_dir,
        original_size_bytes: store.total_bytes(),
        compressed_size_bytes: records.iter().map(|r| r.size_bytes).sum(),
        seconds: s.run.started.elapsed().as_secs_f64(),
        quality: Some(quality),
        cached: false,
        config_digest: s.config_hash.to_string(),
    })
}

/// The conversion's work files are inputs of the save only.
fn remove_work(work: &Path) {
    if work.exists() {
        if let Err(e) = std::fs::remove_dir_all(work) {
            tracing::warn!(path = %work.display(), error = %e, "could not remove the compressed-tensors work directory");
        }
    }
}

/// Each cached layer's GPTQ tensors converted to compressed-tensors' `pack-quantized` tensors
/// ([`crate::ct::convert`]), one work file per layer (one layer in memory at a time). The scales take
/// the dtype of the module's source weight.
fn ct_layer_stores(
    job: &QuantizeJob,
    store: &TensorStore,
    layer_stores: &[TensorStore],
    work: &Path,
) -> Result<Vec<TensorStore>> {
    if work.exists() {
        std::fs::remove_dir_all(work).map_err(|e| QuantError::io(work, e))?;
    }
    std::fs::create_dir_all(work).map_err(|e| QuantError::io(work, e))?;
    let p = &job.params;
    let fallback = store
        .entries
        .iter()
        .find(|(n, _)| n.ends_with("embed_tokens.weight"))
        .map_or(safetensors::Dtype::BF16, |(_, e)| e.dtype);
    let mut out = Vec::with_capacity(layer_stores.len());
    for (layer, ls) in layer_stores.iter().enumerate() {
        let mut tensors: Vec<crate::ct::CtTensor> = Vec::new();
        for (name, e) in &ls.entries {
            let Some(module) = name.strip_suffix(".qweight") else {
                if [".qzeros", ".scales", ".g_idx"]
                    .iter()
                    .any(|s| name.ends_with(s))
                {
                    continue;
                }
                tensors.push(crate::ct::CtTensor {
                    name: name.clone(),
                    dtype: e.dtype,
                    shape: e.shape.clone(),
                    data: ls.raw(name)?.to_vec(),
                });
                continue;
            };
            let rows = e.shape.get(1).copied().unwrap_or(0);
            let g_idx = ls.i32(&format!("{module}.g_idx"))?;
            let cols = g_idx.len();
            let scales: Vec<half::f16> = ls
                .raw(&format!("{module}.scales"))?
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                .collect();
            let dtype = store
                .entries
                .get(&format!("{module}.weight"))
                .map_or(fallback, |e| e.dtype);
            tensors.extend(crate::ct::convert(
                module,
                &crate::ct::GptqTensors {
                    qweight: &ls.i32(name)?,
                    qzeros: &ls.i32(&format!("{module}.qzeros"))?,
                    scales: &scales,
                    g_idx: &g_idx,
                },
                rows,
                cols,
                p.effective_group(cols),
                p.bits,
                p.sym,
                crate::ct::pack::scale_dtype(dtype),
            )?);
        }
        let path = work.join(format!("layer-{layer:05}.safetensors"));
        let views = tensors
            .iter()
            .map(|t| {
                safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data)
                    .map(|v| (t.name.clone(), v))
                    .map_err(|e| QuantError::Safetensors {
                        path: path.clone(),
                        tensor: Some(t.name.clone()),
                        source: e.into(),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        safetensors::serialize_to_file(views, None, &path).map_err(|e| {
            QuantError::Safetensors {
                path: path.clone(),
                tensor: None,
                source: e.into(),
            }
        })?;
        ls.release_pages();
        out.push(TensorStore::open_files(vec![path])?);
    }
    Ok(out)
}

/// compressed-tensors' `ignore`: `lm_head`, the kept candidates, and every other 2-D `.weight` of the
/// source that is not quantized and not an embedding (routers, towers, projectors).
fn ct_ignore(store: &TensorStore, converted: &[TensorStore], excluded: &[String]) -> Vec<String> {
    let quantized = |stem: &str| {
        converted
            .iter()
            .any(|ls| ls.contains(&format!("{stem}.weight_packed")))
    };
    let mut ignore: std::collections::BTreeSet<String> = excluded.iter().cloned().collect();
    ignore.insert("lm_head".into());
    for (name, e) in &store.entries {
        let Some(stem) = name.strip_suffix(".weight") else {
            continue;
        };
        if e.shape.len() == 2 && !quantized(stem) && !stem.ends_with("embed_tokens") {
            ignore.insert(stem.to_string());
        }
    }
    ignore.into_iter().collect()
}

/// Writes the checkpoint (staged, then renamed into place) from the source and the layers: the
/// cached GPTQ layers, or their compressed-tensors conversion.
fn write_save(
    s: &SaveInput<'_>,
    store: &TensorStore,
    cached: &[TensorStore],
    converted: Option<&Vec<TensorStore>>,
    quality_json: &Value,
    progress: &mut Progress<'_>,
) -> Result<Vec<flexinfer_contract::files::SaveShard>> {
    let (job, cfg) = (s.run.job, s.run.cfg);
    let layer_stores: &[TensorStore] = converted.map_or(cached, |c| c.as_slice());
    let tensors = output_tensors(cfg, store, layer_stores)?;
    let (qc, quantize_config) = match converted {
        None => {
            let qc = quantize_config_json(job, &s.plan.quantized, &s.plan.kept, &s.plan.excluded);
            (qc.clone(), Some(qc))
        }
        Some(c) => {
            let p = &job.params;
            let reordered = p.desc_act || p.act_group_aware;
            let ignore = ct_ignore(store, c, &s.plan.excluded);
            (
                crate::ct::quantization_config(p.bits, p.group_size, p.sym, reordered, &ignore),
                None,
            )
        }
    };
    let mut config_json = cfg.raw.clone();
    config_json["quantization_config"] = qc;
    let extras = Extras {
        config_json,
        quantize_config,
        quality: quality_json.clone(),
        source_dir: &job.model_dir,
        script_version: &job.script_version,
        config_digest: s.config_hash,
    };
    write_checkpoint(
        &job.staging_dir(),
        &job.output_dir(),
        tensors,
        job.max_shard_bytes,
        &extras,
        &|| {
            // Pages already hashed or written are read again at most once, from the page cache.
            store.release_pages();
            layer_stores.iter().for_each(TensorStore::release_pages);
        },
        |done, total| {
            store.release_pages();
            layer_stores.iter().for_each(TensorStore::release_pages);
            progress.emit(
                "save",
                95.0 + 5.0 * done as f64 / total as f64,
                format!("shard {done}/{total}"),
                fields([
                    ("unit", json!("shards")),
                    ("done", json!(done)),
                    ("total", json!(total)),
                ]),
            );
        },
    )
}

/// The quality sidecar: the gate's summary plus, for a MoE run, the expert coverage.
fn quality_sidecar(quality: &QualitySummary, totals: &Totals) -> Result<Value> {
    let mut quality_json =
        serde_json::to_value(quality).map_err(|source| NumericError::Encode {
            what: "the quality summary",
            source,
        })?;
    if let (Some(report), Some(obj)) = (totals.coverage.report(), quality_json.as_object_mut()) {
        obj.insert("expertCoverage".into(), report);
    }
    Ok(quality_json)
}

/// The gate runs before anything is written: a rejected run leaves the artifact at `out_dir` (and its
/// status) untouched, writes no `.save-complete`, and removes its staging directory. The layer cache
/// stays, so a run with a relaxed gate reuses the computed layers.
fn reject(
    job: &QuantizeJob,
    quality: QualitySummary,
    quality_json: &Value,
    events: &dyn crate::events::EventSink,
) -> Result<Outcome> {
    let staging = job.staging_dir();
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|e| QuantError::io(&staging, e))?;
    }
    events.emit(
        names::QUANTIZATION_QUALITY,
        quality_json.as_object().cloned().unwrap_or_default(),
    );
    Err(QuantError::GateFailed(quality))
}

/// The checkpoint's tensors: the source tensors that were not quantized, then each cached layer's
/// packed modules. Gemma 4's fused expert tensors are written per expert: packed where quantized, the
/// source rows (same dtype) where an expert module was kept in full precision.
fn output_tensors<'s>(
    cfg: &ModelConfig,
    store: &'s TensorStore,
    layer_stores: &'s [TensorStore],
) -> Result<Vec<OutTensor<'s>>> {
    let mut tensors: Vec<OutTensor<'_>> = Vec::new();
    let mut fused: std::collections::BTreeSet<String> = Default::default();
    for (layer, ls) in layer_stores.iter().enumerate() {
        let Some(names) = fused_expert_names(store, cfg, layer) else {
            continue;
        };
        fused.extend(names);
        let prefix = cfg.layer_prefix(layer);
        for spec in layer_modules(cfg, layer) {
            if !spec.name.starts_with("experts.")
                || ls.contains(&format!("{prefix}{}.qweight", spec.name))
                || ls.contains(&format!("{prefix}{}.weight_packed", spec.name))
            {
                continue;
            }
            if let Some((name, dtype, shape, data)) = source_module_bytes(store, cfg, layer, &spec)?
            {
                tensors.push(OutTensor {
                    name,
                    dtype,
                    shape,
                    data: Cow::Borrowed(data),
                });
            }
        }
    }
    let replaced = |name: &str| {
        fused.contains(name)
            || name.strip_suffix(".weight").is_some_and(|stem| {
                layer_stores.iter().any(|ls| {
                    ls.contains(&format!("{stem}.qweight"))
                        || ls.contains(&format!("{stem}.weight_packed"))
                })
            })
    };
    push_stored(store, replaced, &mut tensors)?;
    for ls in layer_stores {
        push_stored(ls, |_| false, &mut tensors)?;
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::block_modules;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn block_list_is_the_union_unless_a_listed_module_is_kept_somewhere() {
        // Dense layer 0, MoE layer 1, nothing kept: the union in first-seen order.
        let q = [
            names(&["self_attn.q_proj", "mlp.gate_proj"]),
            names(&["self_attn.q_proj", "mlp.experts.0.up_proj"]),
        ];
        assert_eq!(
            block_modules(&q, &[vec![], vec![]]),
            Some(names(&[
                "self_attn.q_proj",
                "mlp.gate_proj",
                "mlp.experts.0.up_proj"
            ]))
        );
        // Kept modules no layer quantizes (linear attention of a hybrid): still the union.
        let kept = [names(&["linear_attn.in_proj_qkvz"]), vec![]];
        assert!(block_modules(&q, &kept).is_some());
        // q_proj kept in layer 1 but quantized in layer 0: a suffix list cannot say that.
        let kept = [vec![], names(&["self_attn.q_proj"])];
        assert_eq!(block_modules(&q, &kept), None);
        // Nothing quantized: no list.
        assert_eq!(block_modules(&[vec![], vec![]], &[vec![], vec![]]), None);
    }
}
