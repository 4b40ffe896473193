//! `quantize status` and `cache status`: what the cluster says about a ModelCache's quantization,
//! and the table of ModelCaches.

use anyhow::anyhow;
use flexinfer_api::contract::JobPhase;
use flexinfer_api::ModelCache;
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ListParams};
use serde::Serialize;

use crate::cli::Global;
use crate::output::{self, Format};
use crate::CliError;

use super::{connect, describe_spec, get_cache};

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
