//! `quantize recommend`: the target GPU (from a GPUProfile or the cache's nodeSelector), the model's
//! footprint (local copy, hub metadata or `--params`), the recommendation, and `--apply`.

use anyhow::anyhow;
use flexinfer_api::contract::labels;
use flexinfer_api::{GPUProfile, ModelCache};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::Client;

use crate::args::{Global, RecommendArgs};
use crate::footprint::{self, Footprint};
use crate::output::{self, Format};
use crate::recommend::{self, GpuTarget};
use crate::{bad, CliError};

use super::{connect, get_cache};

/// The effective gpu arch of the quantize phase (phase nodeSelector, then spec.nodeSelector).
fn cache_arch(mc: &ModelCache) -> Option<String> {
    mc.spec
        .quantization
        .as_ref()
        .and_then(|q| q.node_selector.as_ref())
        .and_then(|s| s.get(labels::GPU_ARCH))
        .or_else(|| {
            mc.spec
                .node_selector
                .as_ref()
                .and_then(|s| s.get(labels::GPU_ARCH))
        })
        .cloned()
}

fn target_from_profile(p: &GPUProfile) -> GpuTarget {
    let name = p.metadata.name.clone().unwrap_or_default();
    let vendor = serde_json::to_value(p.spec.vendor)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string));
    GpuTarget {
        arch: Some(p.spec.architecture.clone()),
        vram_mb: p
            .spec
            .vram_mb
            .or_else(|| recommend::known_arch(&p.spec.architecture).map(|k| k.1)),
        vendor,
        source: format!("GPUProfile {name}"),
    }
}

async fn gpu_target(
    client: &Client,
    ns: &str,
    mc: &ModelCache,
    flag: Option<&str>,
) -> Result<GpuTarget, CliError> {
    let api: Api<GPUProfile> = Api::namespaced(client.clone(), ns);
    if let Some(name) = flag {
        return match api.get_opt(name).await {
            Ok(Some(p)) => Ok(target_from_profile(&p)),
            Ok(None) => Err(bad(format!(
                "--gpu-profile {name}: no GPUProfile {name} in namespace {ns}"
            ))),
            Err(e) => Err(CliError::Failed(anyhow!("get gpuprofile {ns}/{name}: {e}"))),
        };
    }
    let Some(arch) = cache_arch(mc) else {
        return Ok(GpuTarget::default());
    };
    // A profile named after the arch, else any profile with that architecture (this namespace first).
    if let Ok(Some(p)) = api.get_opt(&arch).await {
        return Ok(target_from_profile(&p));
    }
    for list_api in [api, Api::<GPUProfile>::all(client.clone())] {
        if let Ok(list) = list_api.list(&ListParams::default()).await {
            if let Some(p) = list.items.iter().find(|p| p.spec.architecture == arch) {
                return Ok(target_from_profile(p));
            }
        }
    }
    Ok(match recommend::known_arch(&arch) {
        Some((vendor, vram)) => GpuTarget {
            arch: Some(arch.clone()),
            vendor: Some(vendor.into()),
            vram_mb: Some(vram),
            source: format!(
                "nodeSelector {}={arch}, no GPUProfile; built-in VRAM for {arch}",
                labels::GPU_ARCH
            ),
        },
        None => GpuTarget {
            arch: Some(arch.clone()),
            vendor: None,
            vram_mb: None,
            source: format!("nodeSelector {}={arch}, no GPUProfile", labels::GPU_ARCH),
        },
    })
}

/// Footprint: `--params`, else `--model-dir`, else the hub (for hub sources).
async fn model_footprint(a: &RecommendArgs, mc: &ModelCache) -> Result<Footprint, CliError> {
    if let Some(p) = &a.params {
        let params = footprint::parse_params(p).map_err(|e| bad(e.to_string()))?;
        let mut f = Footprint {
            params,
            source: format!("--params {p}"),
            ..Default::default()
        };
        if let Some(dir) = &a.model_dir {
            if let Ok(local) = footprint::from_dir(dir) {
                f.model_type = local.model_type;
                f.moe = local.moe;
                f.hybrid = local.hybrid;
            }
        }
        return Ok(f);
    }
    let mut tried = Vec::new();
    if let Some(dir) = &a.model_dir {
        match footprint::from_dir(dir) {
            Ok(f) => return Ok(f),
            Err(e) => tried.push(format!("{e:#}")),
        }
    }
    match footprint::hub_id(&mc.spec.source) {
        Some(id) if !a.offline => {
            let token = std::env::var(flexinfer_api::contract::env::HF_TOKEN)
                .ok()
                .filter(|t| !t.is_empty());
            match footprint::fetch_hub(&a.hub_endpoint, &id, token.as_deref()).await {
                Ok(v) => match footprint::from_hub_json(&id, &v) {
                    Ok(f) => return Ok(f),
                    Err(e) => tried.push(format!("{e:#}")),
                },
                Err(e) => tried.push(format!("hub metadata: {e:#}")),
            }
        }
        Some(_) => tried.push("hub lookup disabled (--offline)".into()),
        None => tried.push(format!("source {} is not a hub model", mc.spec.source)),
    }
    if a.model_dir.is_none() {
        tried.push("no --model-dir given".into());
    }
    Err(bad(format!(
        "cannot determine the parameter count of {} ({}); pass --params, e.g. --params 8B",
        mc.spec.source,
        tried.join("; ")
    )))
}

/// `flexinfer quantize recommend <cache> [--apply]`.
pub async fn recommend(g: &Global, a: &RecommendArgs) -> Result<String, CliError> {
    let (client, ns) = connect(g).await?;
    let api: Api<ModelCache> = Api::namespaced(client.clone(), &ns);
    let mc = get_cache(&api, &a.cache, &ns).await?;
    let model = model_footprint(a, &mc).await?;
    let gpu = gpu_target(&client, &ns, &mc, a.gpu_profile.as_deref()).await?;
    let gguf = match a.format.as_deref().map(str::trim) {
        None => recommend::gguf::default_for(&gpu),
        Some(f) if f.eq_ignore_ascii_case("GGUF") => true,
        Some(f) if f.eq_ignore_ascii_case("GPTQ") => false,
        Some(f) if f.eq_ignore_ascii_case("AWQ") => {
            // A model or card AWQ cannot serve is bad input naming why.
            let rec = recommend::awq::recommend(&model, &gpu).map_err(|e| bad(e.to_string()))?;
            let rows = awq_rows(&rec);
            return finish(g, a, &api, &ns, &rec.spec_patch(), &rec, rows, &rec.reasons).await;
        }
        Some(f) => {
            return Err(bad(format!(
                "--format {f}: recommend knows GPTQ, AWQ and GGUF"
            )))
        }
    };
    if gguf {
        let rec = recommend::gguf::recommend(&model, &gpu);
        let rows = gguf_rows(&rec);
        return finish(g, a, &api, &ns, &rec.spec_patch(), &rec, rows, &rec.reasons).await;
    }
    let rec = recommend::recommend(&model, &gpu);
    let rows = gptq_rows(&rec);
    finish(g, a, &api, &ns, &rec.spec_patch(), &rec, rows, &rec.reasons).await
}

/// One row of the table: the field (as in `spec.quantization` where it is one) and its value.
type Row = (&'static str, String);

/// The GPTQ recommendation's rows.
fn gptq_rows(rec: &recommend::Recommendation) -> Vec<Row> {
    let npar = rec
        .calibration
        .n_parallel_calib_samples
        .map(|n| n.to_string())
        .unwrap_or_else(|| "unset (engine chooses)".into());
    let mut rows = precision_rows(rec.format, rec.bits, rec.group_size).to_vec();
    rows.extend([
        ("sym", rec.sym.to_string()),
        ("descAct", rec.desc_act.to_string()),
        ("dynamicExclusion", rec.dynamic_exclusion.to_string()),
        ("gpuMemoryFraction", rec.gpu_memory_fraction.clone()),
    ]);
    rows.extend(resource_rows(rec.use_gpu, rec.max_memory_gb));
    rows.extend(calibration_rows(
        rec.timeout_seconds,
        rec.calibration.max_seq_len,
        rec.calibration.max_samples,
    ));
    rows.extend([
        ("calibration.nParallelCalibSamples", npar),
        estimate_row(rec.estimated_artifact_gb),
        (
            "estimated time",
            format!("~{:.0} min", rec.estimated_minutes),
        ),
        fits_row(rec.fits),
    ]);
    rows
}

/// The AWQ recommendation's rows.
fn awq_rows(rec: &recommend::awq::AwqRecommendation) -> Vec<Row> {
    let mut rows = precision_rows(rec.format, rec.bits, rec.group_size).to_vec();
    rows.extend(resource_rows(rec.use_gpu, rec.max_memory_gb));
    rows.extend(calibration_rows(
        rec.timeout_seconds,
        rec.max_seq_len,
        rec.max_samples,
    ));
    rows.extend([estimate_row(rec.estimated_artifact_gb), fits_row(rec.fits)]);
    rows
}

/// The GGUF recommendation's rows.
fn gguf_rows(rec: &recommend::gguf::GgufRecommendation) -> Vec<Row> {
    let mut rows = vec![
        ("format", rec.format.to_string()),
        ("ggufType", rec.gguf_type.to_string()),
    ];
    rows.extend(resource_rows(rec.use_gpu, rec.max_memory_gb));
    rows.extend([estimate_row(rec.estimated_artifact_gb), fits_row(rec.fits)]);
    rows
}

/// The format, bits and group size (GPTQ, AWQ).
fn precision_rows(format: &str, bits: i32, group_size: i32) -> [Row; 3] {
    [
        ("format", format.to_string()),
        ("bits", bits.to_string()),
        ("groupSize", group_size.to_string()),
    ]
}

/// The quantize Job's resources (every format).
fn resource_rows(use_gpu: bool, max_memory_gb: i32) -> [Row; 2] {
    [
        ("useGPU", use_gpu.to_string()),
        ("maxMemoryGB", max_memory_gb.to_string()),
    ]
}

/// A calibrated Job's time bound and calibration bounds (GPTQ, AWQ).
fn calibration_rows(timeout_seconds: i64, max_seq_len: i32, max_samples: i32) -> [Row; 3] {
    [
        ("timeoutSeconds", timeout_seconds.to_string()),
        ("calibration.maxSeqLen", max_seq_len.to_string()),
        ("calibration.maxSamples", max_samples.to_string()),
    ]
}

/// The artifact's estimated size (every format).
fn estimate_row(gb: f64) -> Row {
    ("estimated artifact", format!("~{gb:.1} GB"))
}

/// Whether the recommendation fits the target GPU (every format).
fn fits_row(f: Option<bool>) -> Row {
    let fits = match f {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "unknown",
    };
    ("fits target GPU", fits.to_string())
}

/// Either recommendation: `--apply` patches `spec.quantization`; then the structured output, or the rows,
/// the reasons and how to apply (or watch).
#[allow(clippy::too_many_arguments)]
async fn finish(
    g: &Global,
    a: &RecommendArgs,
    api: &Api<ModelCache>,
    ns: &str,
    patch: &serde_json::Value,
    structured: &impl serde::Serialize,
    rows: Vec<(&str, String)>,
    reasons: &[String],
) -> Result<String, CliError> {
    if a.apply {
        api.patch(&a.cache, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map_err(|e| anyhow!("patch modelcache {ns}/{}: {e}", a.cache))?;
    }
    if g.output != Format::Table {
        return Ok(output::structured(g.output, structured)?);
    }
    let mut s = format!("Recommendation for modelcache {ns}/{}:\n", a.cache);
    s.push_str(&output::kv(&rows));
    s.push_str("Why:\n");
    for r in reasons {
        s.push_str(&format!("  - {r}\n"));
    }
    if a.apply {
        s.push_str(&format!(
            "Applied to modelcache/{} spec.quantization. Watch: flexinfer quantize status {} -n {ns}\n",
            a.cache, a.cache
        ));
    } else {
        s.push_str(&format!(
            "Preview only. Apply with: flexinfer quantize recommend {} -n {ns} --apply\n",
            a.cache
        ));
    }
    Ok(s)
}
