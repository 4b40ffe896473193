//! `quantize status` and `cache status`: what the cluster says about a ModelCache's quantization,
//! and the table of ModelCaches.

use anyhow::anyhow;
use flexinfer_api::contract::JobPhase;
use flexinfer_api::modelcache::{ModelCacheStatus, QuantizationSpec, QuantizationStatus};
use flexinfer_api::ModelCache;
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ListParams};
use serde::Serialize;

use crate::args::Global;
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
    let job_state = job_state(job_name, job.as_ref());
    let view = QuantView::new(&mc);
    if g.output != Format::Table {
        let data = view.data(name, &ns, job_state);
        return Ok(output::structured(g.output, &data)?);
    }
    let mut rows = view.summary_rows(name, &ns, &job_state);
    rows.extend(view.progress_rows());
    rows.extend(view.outcome_rows());
    Ok(output::kv(&rows))
}

/// The state of the quantize Job `name` (`job` is `None` when it does not exist): its pod
/// counts and one word for where it stands.
fn job_state(name: String, job: Option<&Job>) -> JobState {
    let js = job.and_then(|j| j.status.clone()).unwrap_or_default();
    let (active, succeeded, failed) = (
        js.active.unwrap_or(0),
        js.succeeded.unwrap_or(0),
        js.failed.unwrap_or(0),
    );
    JobState {
        name,
        exists: job.is_some(),
        active,
        succeeded,
        failed,
        state: match job {
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
    }
}

/// Placeholder for a value the status does not have.
fn dash() -> String {
    "-".to_string()
}

/// What `quantize status` reads from a ModelCache.
struct QuantView<'a> {
    /// The cache's status (empty when it has none yet).
    st: ModelCacheStatus,
    /// Its quantization status (empty when it has none yet).
    qs: QuantizationStatus,
    /// `spec.quantization`.
    spec_q: Option<&'a QuantizationSpec>,
    /// The artifact type the spec asks for.
    requested_type: Option<String>,
    /// Whether the applied type is the requested one; `None` when either is unknown.
    up_to_date: Option<bool>,
}

impl<'a> QuantView<'a> {
    /// Reads the statuses and the requested type from `mc`.
    fn new(mc: &'a ModelCache) -> Self {
        let st = mc.status.clone().unwrap_or_default();
        let qs = st.quantization.clone().unwrap_or_default();
        let spec_q = mc.spec.quantization.as_ref();
        let requested_type = spec_q.map(|q| q.output_subdir());
        let up_to_date = match (&requested_type, &qs.quant_type) {
            (Some(r), Some(a)) => Some(r == a),
            _ => None,
        };
        Self {
            st,
            qs,
            spec_q,
            requested_type,
            up_to_date,
        }
    }

    /// `quantize status` as data (for `-o json|yaml`).
    fn data(self, name: &str, ns: &str, job: JobState) -> QuantStatus {
        let (st, qs) = (&self.st, &self.qs);
        QuantStatus {
            name: name.to_string(),
            namespace: ns.to_string(),
            phase: st.phase.map(|p| p.as_str().to_string()),
            current_phase: st.current_phase.clone(),
            requested: self.spec_q.and_then(|q| serde_json::to_value(q).ok()),
            requested_type: self.requested_type.clone(),
            applied_type: qs.quant_type.clone(),
            applied_spec_hash: qs.spec_hash.clone(),
            up_to_date: self.up_to_date,
            job,
            quantization: st
                .quantization
                .as_ref()
                .and_then(|q| serde_json::to_value(q).ok()),
        }
    }

    /// The table's first rows: the cache, its phase and step, what is requested and applied,
    /// whether they match, and the Job.
    fn summary_rows(&self, name: &str, ns: &str, job: &JobState) -> Vec<(&'static str, String)> {
        let (st, qs) = (&self.st, &self.qs);
        vec![
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
                self.spec_q
                    .map(describe_spec)
                    .unwrap_or_else(|| "none (spec.quantization is not set)".into()),
            ),
            ("Applied", applied_text(qs)),
            ("Up to date", up_to_date_text(self.up_to_date)),
            ("Job", job_text(job)),
        ]
    }

    /// Progress, last update, sizes, ratio and duration, then the start and completion times
    /// when known.
    fn progress_rows(&self) -> Vec<(&'static str, String)> {
        let qs = &self.qs;
        let mut rows = vec![
            ("Progress", progress_text(qs)),
            (
                "Last update",
                qs.last_progress_at
                    .as_ref()
                    .map(|t| format!("{} ({})", t.0, ago(t)))
                    .unwrap_or_else(dash),
            ),
            ("Sizes", sizes_text(qs)),
            (
                "Ratio",
                qs.compression_ratio
                    .map(|r| format!("{r:.2}x"))
                    .unwrap_or_else(dash),
            ),
            ("Duration", duration_text(qs).unwrap_or_else(dash)),
            ("GPTQ device", device_text(qs)),
        ];
        if let Some(s) = time_str(&qs.started_at) {
            rows.push(("Started", s));
        }
        if let Some(s) = time_str(&qs.completed_at) {
            rows.push(("Completed", s));
        }
        rows
    }

    /// The quality gate, then the failure message and the retry count when there are any.
    fn outcome_rows(&self) -> Vec<(&'static str, String)> {
        let qs = &self.qs;
        let mut rows = vec![("Quality gate", quality_text(qs))];
        if let Some(f) = &qs.failure_message {
            rows.push(("Failure", f.clone()));
        }
        if let Some(n) = self.st.retry_count.filter(|n| *n > 0) {
            rows.push(("Retries", n.to_string()));
        }
        rows
    }
}

/// The device the GPTQ solves of the running or last quantization use (`status.quantization.gptqDevice`),
/// with the worker's reason; a dash when no worker reported one yet.
fn device_text(qs: &QuantizationStatus) -> String {
    match (&qs.gptq_device, &qs.gptq_device_reason) {
        (Some(d), Some(r)) => format!("{d} ({r})"),
        (Some(d), None) => d.clone(),
        (None, _) => dash(),
    }
}

/// The applied artifact type and spec hash, or that a run is in progress or none has finished.
fn applied_text(qs: &QuantizationStatus) -> String {
    match (&qs.quant_type, &qs.spec_hash) {
        (Some(t), Some(h)) => format!("{t} (specHash {h})"),
        (Some(t), None) => t.clone(),
        (None, Some(h)) => format!("in progress (specHash {h})"),
        (None, None) => "none yet".into(),
    }
}

/// The "Up to date" cell.
fn up_to_date_text(up_to_date: Option<bool>) -> String {
    match up_to_date {
        Some(true) => "yes".into(),
        Some(false) => "no: the requested type differs from the applied artifact".into(),
        None => "-".into(),
    }
}

/// The Job's name, state and pod counts, or that it is not present.
fn job_text(job: &JobState) -> String {
    if job.exists {
        format!(
            "{} {} (active {}, succeeded {}, failed {})",
            job.name, job.state, job.active, job.succeeded, job.failed
        )
    } else {
        format!("{} not present", job.name)
    }
}

/// The progress percentage with its source and detail.
fn progress_text(qs: &QuantizationStatus) -> String {
    match qs.progress {
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
    }
}

/// Original and compressed size.
fn sizes_text(qs: &QuantizationStatus) -> String {
    match (qs.original_size_bytes, qs.compressed_size_bytes) {
        (Some(o), Some(c)) => format!("{} -> {}", output::bytes(o), output::bytes(c)),
        (Some(o), None) => format!("{} -> -", output::bytes(o)),
        _ => dash(),
    }
}

/// The reported quantization time, else the time from start to completion (or to now, marked
/// running).
fn duration_text(qs: &QuantizationStatus) -> Option<String> {
    qs.quantization_time.clone().or_else(|| {
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
    })
}

/// The quality gate's verdict with its module counts.
fn quality_text(qs: &QuantizationStatus) -> String {
    let q = qs.quality.clone().unwrap_or_default();
    match &q.gate {
        Some(gate) => format!(
            "{gate} (gptq modules {}, RTN fallback {} = {:.2}%)",
            q.gptq_modules.unwrap_or(0),
            q.rtn_fallback_modules.unwrap_or(0),
            q.rtn_fallback_percent.unwrap_or(0.0)
        ),
        None => dash(),
    }
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
    let mut rows: Vec<CacheRow> = list.items.iter().map(cache_row).collect();
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
    let cells: Vec<Vec<String>> = rows.into_iter().map(|r| cache_cells(r, all)).collect();
    Ok(output::table(&cache_header(all), &cells))
}

/// The `cache status` row of one ModelCache.
fn cache_row(mc: &ModelCache) -> CacheRow {
    let st = mc.status.clone().unwrap_or_default();
    let qs = st.quantization.clone().unwrap_or_default();
    CacheRow {
        namespace: mc.metadata.namespace.clone().unwrap_or_default(),
        name: mc.metadata.name.clone().unwrap_or_default(),
        phase: st.phase.map(|p| p.as_str().to_string()),
        current_phase: st.current_phase.clone(),
        progress: st.progress.or(step_progress(&st, &qs)),
        format: qs.quant_type.clone().or_else(|| {
            mc.spec
                .quantization
                .as_ref()
                .map(|q| flexinfer_api::formats::info(q.format).name.to_string())
        }),
        compression_ratio: qs.compression_ratio,
        source: mc.spec.source.clone(),
    }
}

/// The progress the current step's own status reports.
fn step_progress(st: &ModelCacheStatus, qs: &QuantizationStatus) -> Option<i32> {
    match st.current_phase.as_deref() {
        Some("download") => st.download.as_ref().and_then(|d| d.progress),
        Some("abliteration") => st.abliteration.as_ref().and_then(|d| d.progress),
        Some("quantization") => qs.progress,
        Some("publish") => st.publish.as_ref().and_then(|d| d.progress),
        _ => None,
    }
}

/// The table cells of one row; the namespace only with `-A`.
fn cache_cells(r: CacheRow, all: bool) -> Vec<String> {
    let d = |o: Option<String>| o.unwrap_or_else(|| "-".into());
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
}

/// The table header; NAMESPACE only with `-A`.
fn cache_header(all: bool) -> Vec<&'static str> {
    let mut header = vec![];
    if all {
        header.push("NAMESPACE");
    }
    header.extend([
        "NAME", "PHASE", "STEP", "PROGRESS", "FORMAT", "RATIO",
        "SOURCE", // not-contract: headers
    ]);
    header
}
