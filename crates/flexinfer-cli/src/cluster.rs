//! Commands that talk to the API server: `quantize`, `quantize status`, `quantize recommend`,
//! `cache status`.

use anyhow::{anyhow, Context};
use flexinfer_api::contract::{labels, JobPhase};
use flexinfer_api::formats::FormatInfo;
use flexinfer_api::{GPUProfile, ModelCache};
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde::Serialize;

use crate::cli::{Global, QuantizeRequest, RecommendArgs};
use crate::footprint::{self, Footprint};
use crate::output::{self, Format};
use crate::recommend::{self, GpuTarget};
use crate::{bad, CliError};

/// A client and the effective namespace, like kubectl.
pub async fn connect(g: &Global) -> anyhow::Result<(Client, String)> {
    let opts = KubeConfigOptions {
        context: g.context.clone(),
        cluster: None,
        user: None,
    };
    let config = match &g.kubeconfig {
        Some(p) => {
            let kc = Kubeconfig::read_from(p)
                .with_context(|| format!("read kubeconfig {}", p.display()))?;
            Config::from_custom_kubeconfig(kc, &opts).await
        }
        None => Config::from_kubeconfig(&opts).await,
    }
    .context("load kubeconfig (set --kubeconfig or KUBECONFIG)")?;
    let ns = g
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).context("build the API client")?;
    Ok((client, ns))
}

async fn get_cache(api: &Api<ModelCache>, name: &str, ns: &str) -> Result<ModelCache, CliError> {
    match api.get_opt(name).await {
        Ok(Some(c)) => Ok(c),
        Ok(None) => Err(CliError::Failed(anyhow!(
            "modelcache {name} not found in namespace {ns}"
        ))),
        Err(e) => Err(CliError::Failed(anyhow!("get modelcache {ns}/{name}: {e}"))),
    }
}

/// `flexinfer quantize <cache> --format ...`.
pub async fn quantize(
    g: &Global,
    r: &QuantizeRequest,
    info: &FormatInfo,
) -> Result<String, CliError> {
    let name = r.cache.clone().unwrap_or_default();
    let (client, ns) = connect(g).await?;
    let api: Api<ModelCache> = Api::namespaced(client, &ns);
    get_cache(&api, &name, &ns).await?;
    let patch = crate::request::request_patch(r, info);
    let updated = api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) if s.code == 422 || s.code == 400 => bad(format!(
                "the API server rejected the request: {}",
                s.message
            )),
            e => CliError::Failed(anyhow!("patch modelcache {ns}/{name}: {e}")),
        })?;
    if g.output != Format::Table {
        return Ok(output::structured(g.output, &updated.spec.quantization)?);
    }
    let q = updated.spec.quantization.as_ref();
    let mut s = format!(
        "modelcache/{name} quantization requested: {}",
        q.map(describe_spec)
            .unwrap_or_else(|| info.name.to_string())
    );
    s.push('\n');
    if !info.implemented {
        s.push_str(&format!(
            "note: {} has no built-in engine yet (planned); the phase will fail with UnsupportedFormat\n",
            info.name
        ));
    }
    s.push_str(&format!(
        "Watch progress:\n  flexinfer quantize status {name} -n {ns}\n  kubectl get modelcache {name} -n {ns} -w\n"
    ));
    Ok(s)
}

fn describe_spec(q: &flexinfer_api::modelcache::QuantizationSpec) -> String {
    let fmt = flexinfer_api::formats::info(q.format).name;
    let mut s = format!("{fmt} {}", q.output_subdir());
    if fmt == "GPTQ" || fmt == "AWQ" {
        s.push_str(&format!(
            " (bits {}, groupSize {}, sym {}, descAct {}, dynamicExclusion {})",
            q.effective_bits(),
            q.group_size,
            q.sym,
            q.desc_act,
            q.dynamic_exclusion.as_str()
        ));
    }
    if q.use_gpu {
        s.push_str(" on GPU");
    }
    s
}

fn time_str(t: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>) -> Option<String> {
    t.as_ref().map(|t| t.0.to_string())
}

fn ago(t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time) -> String {
    let secs = jiff::Timestamp::now().as_second() - t.0.as_second();
    if secs < 0 {
        return "just now".into();
    }
    match secs {
        0..=119 => format!("{secs}s ago"),
        120..=7199 => format!("{}m ago", secs / 60),
        _ => format!("{}h ago", secs / 3600),
    }
}

/// `quantize status` as data (for `-o json|yaml`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct QuantStatus {
    name: String,
    namespace: String,
    phase: Option<String>,
    current_phase: Option<String>,
    requested: Option<serde_json::Value>,
    requested_type: Option<String>,
    applied_type: Option<String>,
    applied_spec_hash: Option<String>,
    up_to_date: Option<bool>,
    job: JobState,
    quantization: Option<serde_json::Value>,
}

#[derive(Debug, Serialize)]
struct JobState {
    name: String,
    exists: bool,
    active: i32,
    succeeded: i32,
    failed: i32,
    state: String,
}

/// `flexinfer quantize status <cache>`.
pub async fn quantize_status(g: &Global, name: &str) -> Result<String, CliError> {
    let (client, ns) = connect(g).await?;
    let api: Api<ModelCache> = Api::namespaced(client.clone(), &ns);
    let mc = get_cache(&api, name, &ns).await?;
    let jobs: Api<Job> = Api::namespaced(client, &ns);
    let job_name = JobPhase::Quantize.job_name(name);
    let job = jobs
        .get_opt(&job_name)
        .await
        .map_err(|e| anyhow!("get job {ns}/{job_name}: {e}"))?;
    let js = job
        .as_ref()
        .and_then(|j| j.status.clone())
        .unwrap_or_default();
    let (active, succeeded, failed) = (
        js.active.unwrap_or(0),
        js.succeeded.unwrap_or(0),
        js.failed.unwrap_or(0),
    );
    let job_state = JobState {
        name: job_name.clone(),
        exists: job.is_some(),
        active,
        succeeded,
        failed,
        state: match &job {
            None => "none".into(),
            Some(_) if succeeded > 0 => "Succeeded".into(),
            Some(_)
                if js.conditions.as_ref().is_some_and(|c| {
                    c.iter().any(|c| c.type_ == "Failed" && c.status == "True")
                }) =>
            {
                "Failed".into()
            }
            Some(_) if active > 0 => "Running".into(),
            Some(_) => "Pending".into(),
        },
    };
    let st = mc.status.clone().unwrap_or_default();
    let qs = st.quantization.clone().unwrap_or_default();
    let spec_q = mc.spec.quantization.as_ref();
    let requested_type = spec_q.map(|q| q.output_subdir());
    let up_to_date = match (&requested_type, &qs.quant_type) {
        (Some(r), Some(a)) => Some(r == a),
        _ => None,
    };
    if g.output != Format::Table {
        let data = QuantStatus {
            name: name.to_string(),
            namespace: ns.clone(),
            phase: st.phase.map(|p| p.as_str().to_string()),
            current_phase: st.current_phase.clone(),
            requested: spec_q.and_then(|q| serde_json::to_value(q).ok()),
            requested_type,
            applied_type: qs.quant_type.clone(),
            applied_spec_hash: qs.spec_hash.clone(),
            up_to_date,
            job: job_state,
            quantization: st
                .quantization
                .as_ref()
                .and_then(|q| serde_json::to_value(q).ok()),
        };
        return Ok(output::structured(g.output, &data)?);
    }
    let dash = || "-".to_string();
    let mut rows: Vec<(&str, String)> = vec![
        ("Cache", format!("{ns}/{name}")),
        (
            "Phase",
            st.phase
                .map(|p| p.as_str().to_string())
                .unwrap_or_else(dash),
        ),
        (
            "Current step",
            st.current_phase.clone().unwrap_or_else(dash),
        ),
        (
            "Requested",
            spec_q
                .map(describe_spec)
                .unwrap_or_else(|| "none (spec.quantization is not set)".into()),
        ),
        (
            "Applied",
            match (&qs.quant_type, &qs.spec_hash) {
                (Some(t), Some(h)) => format!("{t} (specHash {h})"),
                (Some(t), None) => t.clone(),
                (None, Some(h)) => format!("in progress (specHash {h})"),
                (None, None) => "none yet".into(),
            },
        ),
        (
            "Up to date",
            match up_to_date {
                Some(true) => "yes".into(),
                Some(false) => "no: the requested type differs from the applied artifact".into(),
                None => "-".into(),
            },
        ),
        (
            "Job",
            if job_state.exists {
                format!(
                    "{} {} (active {}, succeeded {}, failed {})",
                    job_state.name, job_state.state, active, succeeded, failed
                )
            } else {
                format!("{} not present", job_state.name)
            },
        ),
    ];
    let progress = match qs.progress {
        Some(p) => {
            let mut s = format!("{p}%");
            if let Some(src) = &qs.progress_source {
                s.push_str(&format!(" ({src})"));
            }
            if let Some(d) = &qs.progress_detail {
                s.push_str(&format!(" {d}"));
            }
            s
        }
        None => dash(),
    };
    rows.push(("Progress", progress));
    rows.push((
        "Last update",
        qs.last_progress_at
            .as_ref()
            .map(|t| format!("{} ({})", t.0, ago(t)))
            .unwrap_or_else(dash),
    ));
    rows.push((
        "Sizes",
        match (qs.original_size_bytes, qs.compressed_size_bytes) {
            (Some(o), Some(c)) => format!("{} -> {}", output::bytes(o), output::bytes(c)),
            (Some(o), None) => format!("{} -> -", output::bytes(o)),
            _ => dash(),
        },
    ));
    rows.push((
        "Ratio",
        qs.compression_ratio
            .map(|r| format!("{r:.2}x"))
            .unwrap_or_else(dash),
    ));
    let duration = qs.quantization_time.clone().or_else(|| {
        qs.started_at.as_ref().map(|s| {
            let end = qs
                .completed_at
                .as_ref()
                .map(|c| c.0.as_second())
                .unwrap_or_else(|| jiff::Timestamp::now().as_second());
            let d = (end - s.0.as_second()).max(0);
            format!(
                "{}h{}m{}s{}",
                d / 3600,
                d % 3600 / 60,
                d % 60,
                if qs.completed_at.is_none() {
                    " (running)"
                } else {
                    ""
                }
            )
        })
    });
    rows.push(("Duration", duration.unwrap_or_else(dash)));
    if let Some(s) = time_str(&qs.started_at) {
        rows.push(("Started", s));
    }
    if let Some(s) = time_str(&qs.completed_at) {
        rows.push(("Completed", s));
    }
    let q = qs.quality.clone().unwrap_or_default();
    rows.push((
        "Quality gate",
        match &q.gate {
            Some(gate) => format!(
                "{gate} (gptq modules {}, RTN fallback {} = {:.2}%)",
                q.gptq_modules.unwrap_or(0),
                q.rtn_fallback_modules.unwrap_or(0),
                q.rtn_fallback_percent.unwrap_or(0.0)
            ),
            None => dash(),
        },
    ));
    if let Some(f) = &qs.failure_message {
        rows.push(("Failure", f.clone()));
    }
    if let Some(n) = st.retry_count.filter(|n| *n > 0) {
        rows.push(("Retries", n.to_string()));
    }
    Ok(output::kv(&rows))
}

/// One row of `cache status`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct CacheRow {
    namespace: String,
    name: String,
    phase: Option<String>,
    current_phase: Option<String>,
    progress: Option<i32>,
    format: Option<String>,
    compression_ratio: Option<f64>,
    source: String,
}

/// `flexinfer cache status [-A]`.
pub async fn cache_status(g: &Global, all: bool) -> Result<String, CliError> {
    let (client, ns) = connect(g).await?;
    let api: Api<ModelCache> = if all {
        Api::all(client)
    } else {
        Api::namespaced(client, &ns)
    };
    let list = api
        .list(&ListParams::default())
        .await
        .map_err(|e| anyhow!("list modelcaches: {e}"))?;
    let mut rows: Vec<CacheRow> = list
        .items
        .iter()
        .map(|mc| {
            let st = mc.status.clone().unwrap_or_default();
            let qs = st.quantization.clone().unwrap_or_default();
            let step_progress = match st.current_phase.as_deref() {
                Some("download") => st.download.as_ref().and_then(|d| d.progress),
                Some("abliteration") => st.abliteration.as_ref().and_then(|d| d.progress),
                Some("quantization") => qs.progress,
                Some("publish") => st.publish.as_ref().and_then(|d| d.progress),
                _ => None,
            };
            CacheRow {
                namespace: mc.metadata.namespace.clone().unwrap_or_default(),
                name: mc.metadata.name.clone().unwrap_or_default(),
                phase: st.phase.map(|p| p.as_str().to_string()),
                current_phase: st.current_phase.clone(),
                progress: st.progress.or(step_progress),
                format: qs.quant_type.clone().or_else(|| {
                    mc.spec
                        .quantization
                        .as_ref()
                        .map(|q| flexinfer_api::formats::info(q.format).name.to_string())
                }),
                compression_ratio: qs.compression_ratio,
                source: mc.spec.source.clone(),
            }
        })
        .collect();
    rows.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    if g.output != Format::Table {
        return Ok(output::structured(g.output, &rows)?);
    }
    if rows.is_empty() {
        return Ok(if all {
            "No ModelCaches found.\n".to_string()
        } else {
            format!("No ModelCaches found in namespace {ns}.\n")
        });
    }
    let d = |o: Option<String>| o.unwrap_or_else(|| "-".into());
    let cells: Vec<Vec<String>> = rows
        .into_iter()
        .map(|r| {
            let mut c = Vec::new();
            if all {
                c.push(r.namespace);
            }
            c.extend([
                r.name,
                d(r.phase),
                d(r.current_phase),
                d(r.progress.map(|p| format!("{p}%"))),
                d(r.format),
                d(r.compression_ratio.map(|x| format!("{x:.2}x"))),
                r.source,
            ]);
            c
        })
        .collect();
    let mut header = vec![];
    if all {
        header.push("NAMESPACE");
    }
    header.extend([
        "NAME", "PHASE", "STEP", "PROGRESS", "FORMAT", "RATIO",
        "SOURCE", // not-contract: headers
    ]);
    Ok(output::table(&header, &cells))
}

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
    let rec = recommend::recommend(&model, &gpu);
    if a.apply {
        api.patch(
            &a.cache,
            &PatchParams::default(),
            &Patch::Merge(&rec.spec_patch()),
        )
        .await
        .map_err(|e| anyhow!("patch modelcache {ns}/{}: {e}", a.cache))?;
    }
    if g.output != Format::Table {
        return Ok(output::structured(g.output, &rec)?);
    }
    let mut s = format!("Recommendation for modelcache {ns}/{}:\n", a.cache);
    let npar = rec
        .calibration
        .n_parallel_calib_samples
        .map(|n| n.to_string())
        .unwrap_or_else(|| "unset (engine chooses)".into());
    s.push_str(&output::kv(&[
        ("format", rec.format.to_string()),
        ("bits", rec.bits.to_string()),
        ("groupSize", rec.group_size.to_string()),
        ("sym", rec.sym.to_string()),
        ("descAct", rec.desc_act.to_string()),
        ("dynamicExclusion", rec.dynamic_exclusion.to_string()),
        ("gpuMemoryFraction", rec.gpu_memory_fraction.clone()),
        ("useGPU", rec.use_gpu.to_string()),
        ("maxMemoryGB", rec.max_memory_gb.to_string()),
        ("timeoutSeconds", rec.timeout_seconds.to_string()),
        (
            "calibration.maxSeqLen",
            rec.calibration.max_seq_len.to_string(),
        ),
        (
            "calibration.maxSamples",
            rec.calibration.max_samples.to_string(),
        ),
        ("calibration.nParallelCalibSamples", npar),
        (
            "estimated artifact",
            format!("~{:.1} GB", rec.estimated_artifact_gb),
        ),
        (
            "estimated time",
            format!("~{:.0} min", rec.estimated_minutes),
        ),
        (
            "fits target GPU",
            match rec.fits {
                Some(true) => "yes".into(),
                Some(false) => "NO".into(),
                None => "unknown".into(),
            },
        ),
    ]));
    s.push_str("Why:\n");
    for r in &rec.reasons {
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
