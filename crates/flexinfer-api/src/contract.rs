//! The contract between the controller and the worker images (SPEC §4): annotation keys, labels,
//! environment variable names, event names, marker-file names, and the serde types of events,
//! marker files and termination messages. Every binary uses these; nothing retypes them.

use serde::{Deserialize, Serialize};

/// Version of this contract. The controller sets `FLEXINFER_SCRIPT_VERSION` to it; a worker built
/// for another version exits with code 4 and
/// `FATAL: Script version mismatch (image=X controller=Y)`.
pub const SCRIPT_VERSION: &str = "v14";

/// Annotation keys on ModelCache and Model objects.
pub mod annotations {
    /// `"true"`: re-run quantization (and what follows). Removed once acted on.
    pub const REQUANTIZE: &str = "flexinfer.ai/requantize";
    /// `"true"`: re-run abliteration (and what follows). Removed once acted on.
    pub const REABLITERATE: &str = "flexinfer.ai/reabliterate";
    /// `"true"`: re-download the source (and re-run everything). Removed once acted on.
    pub const REDOWNLOAD: &str = "flexinfer.ai/redownload";
    /// `"true"`: replace a running quantize Job whose image drifted, even outside the grace window.
    pub const FORCE_IMAGE_UPDATE: &str = "flexinfer.ai/force-image-update";
    /// `"true"`: clear the retry state of a Failed cache and retry the failed phase. Removed once acted on.
    pub const RESET_RETRIES: &str = "flexinfer.ai/reset-retries";
    /// Model: opt into the quantized-artifact promotion gate (`quantized-artifact-v1`).
    pub const PROMOTION_GATE: &str = "flexinfer.ai/promotion-gate";
    /// Value of [`PROMOTION_GATE`] for the gate of the seed status page.
    pub const PROMOTION_GATE_V1: &str = "quantized-artifact-v1";
    /// Model: `passed` once the artifact passed validation.
    pub const PROMOTION_VALIDATION: &str = "flexinfer.ai/promotion-validation";
    /// Model: reference to validation evidence (artifact or runbook run).
    pub const PROMOTION_EVIDENCE: &str = "flexinfer.ai/promotion-evidence";
    /// Model: informational promotion state (e.g. `canary-reference-only`).
    pub const PROMOTION_STATE: &str = "flexinfer.ai/promotion-state";
    /// Pod template annotation: the artifact path a serving Deployment was rendered for.
    pub const SERVED_PATH: &str = "flexinfer.ai/served-path";
}

/// Label keys.
pub mod labels {
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    pub const MANAGED_BY_VALUE: &str = "flexinfer";
    pub const NAME: &str = "app.kubernetes.io/name";
    pub const INSTANCE: &str = "app.kubernetes.io/instance";
    pub const COMPONENT: &str = "app.kubernetes.io/component";
    pub const PART_OF: &str = "app.kubernetes.io/part-of";
    /// Name of the ModelCache a pipeline Job/PVC belongs to.
    pub const CACHE: &str = "flexinfer.ai/cache";
    /// Pipeline phase of a Job: `download`, `abliterate`, `quantize`, `publish`.
    pub const PHASE: &str = "flexinfer.ai/phase";
    /// Name of the Model a Deployment/Service belongs to.
    pub const MODEL: &str = "flexinfer.ai/model";
    /// Node label carrying the GPU architecture (`gfx1100`, `gfx906`, `sm_90`).
    pub const GPU_ARCH: &str = "flexinfer.ai/gpu.arch";
}

/// Finalizer the controller puts on ModelCaches that own a PVC.
pub const FINALIZER_CLEANUP: &str = "flexinfer.ai/modelcache-cleanup";

/// Default toleration added to GPU Jobs: `dedicated=gpu:NoSchedule`.
pub const GPU_TOLERATION_KEY: &str = "dedicated";
pub const GPU_TOLERATION_VALUE: &str = "gpu";
pub const GPU_TOLERATION_EFFECT: &str = "NoSchedule";

/// Mount point of the cache PVC in every pipeline Job.
pub const CACHE_MOUNT: &str = "/cache";
/// Subdirectory (under the model dir) of the abliterated model.
pub const ABLITERATED_SUBDIR: &str = "abliterated";
/// Subdirectory (under the model dir) where the download phase puts hub datasets.
pub const DATASETS_SUBDIR: &str = ".datasets";

/// Environment variable names read by the worker (SPEC §4.1).
pub mod env {
    pub const SCRIPT_VERSION: &str = "FLEXINFER_SCRIPT_VERSION";
    pub const MODEL_DIR: &str = "MODEL_DIR";
    pub const OUT_DIR: &str = "OUT_DIR";
    pub const BITS: &str = "BITS";
    pub const GROUP_SIZE: &str = "GROUP_SIZE";
    pub const SYM: &str = "SYM";
    pub const DESC_ACT: &str = "DESC_ACT";
    pub const DYNAMIC_EXCLUSION: &str = "DYNAMIC_EXCLUSION";
    pub const MAX_SEQ_LEN: &str = "MAX_SEQ_LEN";
    pub const MAX_SAMPLES: &str = "MAX_SAMPLES";
    pub const DATASET: &str = "DATASET";
    pub const N_PARALLEL_CALIB_SAMPLES: &str = "N_PARALLEL_CALIB_SAMPLES";
    pub const MAX_MEMORY_GB: &str = "MAX_MEMORY_GB";
    pub const GPU_VRAM_MB: &str = "GPU_VRAM_MB";
    pub const GPU_MEMORY_FRACTION: &str = "GPU_MEMORY_FRACTION";
    pub const GPTQ_DAMP_PERCENT_OVERRIDE: &str = "GPTQ_DAMP_PERCENT_OVERRIDE";
    pub const GPTQ_DAMP_AUTO_INCREMENT_OVERRIDE: &str = "GPTQ_DAMP_AUTO_INCREMENT_OVERRIDE";
    pub const GPTQ_HESSIAN_DIAG_FLOOR_MODE: &str = "GPTQ_HESSIAN_DIAG_FLOOR_MODE";
    pub const GPTQ_HESSIAN_DIAG_FLOOR_SCALE: &str = "GPTQ_HESSIAN_DIAG_FLOOR_SCALE";
    pub const GPTQ_HESSIAN_FLOOR_MULTIPLIER: &str = "GPTQ_HESSIAN_FLOOR_MULTIPLIER";
    pub const GPTQ_HESSIAN_MAX_FLOOR_ATTEMPTS: &str = "GPTQ_HESSIAN_MAX_FLOOR_ATTEMPTS";
    pub const GPTQ_RESUME_LAYERS: &str = "GPTQ_RESUME_LAYERS";
    pub const GPTQ_MAX_RTN_FALLBACK_PERCENT: &str = "GPTQ_MAX_RTN_FALLBACK_PERCENT";
    pub const GPTQ_MIN_MODULES_FOR_FALLBACK_GATE: &str = "GPTQ_MIN_MODULES_FOR_FALLBACK_GATE";
    /// `true`: a restarted quantize Job re-hashes every shard of `.save-complete` before it
    /// short-circuits (default: exact sizes only).
    pub const GPTQ_VERIFY_SAVE_SHA256: &str = "GPTQ_VERIFY_SAVE_SHA256";
    pub const TELEMETRY: &str = "FLEXINFER_TELEMETRY";
    pub const HF_TOKEN: &str = "HF_TOKEN";
    pub const HF_ENDPOINT: &str = "HF_ENDPOINT";
    pub const SOURCE: &str = "SOURCE";
    pub const REVISION: &str = "REVISION";
    pub const REPO_TYPE: &str = "REPO_TYPE";
    pub const ALLOW_PATTERNS: &str = "ALLOW_PATTERNS";
    pub const IGNORE_PATTERNS: &str = "IGNORE_PATTERNS";
    pub const NUM_SAMPLES: &str = "NUM_SAMPLES";
    pub const TARGET_LAYERS: &str = "TARGET_LAYERS";
    pub const WEIGHT_MATRICES: &str = "WEIGHT_MATRICES";
    pub const SKIP_GDN_LAYERS: &str = "SKIP_GDN_LAYERS";
    pub const SKIP_VISION: &str = "SKIP_VISION";
    pub const NORM_THRESHOLD: &str = "NORM_THRESHOLD";
    pub const ABLITERATE_LM_HEAD: &str = "ABLITERATE_LM_HEAD";
    pub const MAX_PERPLEXITY_INCREASE_PERCENT: &str = "MAX_PERPLEXITY_INCREASE_PERCENT";
    pub const REFUSAL_DATASET: &str = "REFUSAL_DATASET";
    pub const HARMLESS_DATASET: &str = "HARMLESS_DATASET";
    pub const OCI_REF: &str = "OCI_REF";
    pub const OCI_TAG_POLICY: &str = "OCI_TAG_POLICY";
    pub const OCI_ADDITIONAL_TAGS: &str = "OCI_ADDITIONAL_TAGS";
    pub const OCI_INSECURE: &str = "OCI_INSECURE";
    pub const OCI_USERNAME: &str = "OCI_USERNAME";
    pub const OCI_PASSWORD: &str = "OCI_PASSWORD";
    /// Path of a mounted dockerconfigjson with registry credentials.
    pub const DOCKER_CONFIG_JSON: &str = "DOCKER_CONFIG_JSON";
    /// Where the worker writes its termination message (default `/dev/termination-log`).
    pub const TERMINATION_LOG: &str = "FLEXINFER_TERMINATION_LOG";
    /// Pipeline phase the Job runs (`download`, `abliterate`, `quantize`, `publish`).
    pub const PHASE: &str = "FLEXINFER_PHASE";
    /// AMD allocator setting injected into AMD GPU Jobs (not gfx906).
    pub const PYTORCH_HIP_ALLOC_CONF: &str = "PYTORCH_HIP_ALLOC_CONF";
    pub const PYTORCH_HIP_ALLOC_CONF_VALUE: &str = "expandable_segments:True";

    /// The `GPTQ_*` tunables with their defaults, in the order the controller emits them.
    /// The controller overrides each cluster-wide from its own env `FLEXINFER_<NAME>`.
    pub const GPTQ_TUNABLES: &[(&str, &str)] = &[
        (GPTQ_DAMP_PERCENT_OVERRIDE, "0.05"),
        (GPTQ_DAMP_AUTO_INCREMENT_OVERRIDE, "0.1"),
        (GPTQ_HESSIAN_DIAG_FLOOR_MODE, "mean"),
        (GPTQ_HESSIAN_DIAG_FLOOR_SCALE, "0.01"),
        (GPTQ_HESSIAN_FLOOR_MULTIPLIER, "10"),
        (GPTQ_HESSIAN_MAX_FLOOR_ATTEMPTS, "6"),
        (GPTQ_RESUME_LAYERS, "true"),
        (GPTQ_MAX_RTN_FALLBACK_PERCENT, "10"),
        (GPTQ_MIN_MODULES_FOR_FALLBACK_GATE, "100"),
        (GPTQ_VERIFY_SAVE_SHA256, "false"),
    ];

    /// Controller env name that overrides a worker tunable cluster-wide (`FLEXINFER_<NAME>`).
    pub fn controller_override(name: &str) -> String {
        format!("FLEXINFER_{name}")
    }
}

/// Controller configuration environment (read by the controller binary, set by the chart).
pub mod controller_env {
    pub const QUANTIZER_GPTQ_IMAGE: &str = "FLEXINFER_QUANTIZER_GPTQ_IMAGE";
    pub const QUANTIZER_GPTQ_ROCM_IMAGE: &str = "FLEXINFER_QUANTIZER_GPTQ_ROCM_IMAGE";
    /// `FLEXINFER_QUANTIZER_GPTQ_ROCM_<ARCH>_IMAGE`, e.g. `..._GFX906_IMAGE`.
    pub fn quantizer_gptq_rocm_arch_image(arch: &str) -> String {
        format!(
            "FLEXINFER_QUANTIZER_GPTQ_ROCM_{}_IMAGE",
            arch.to_ascii_uppercase()
        )
    }
    /// `FLEXINFER_QUANTIZER_IMAGE_<FORMAT>` (chart value `quantization.images.<format>`).
    pub fn quantizer_format_image(format: &str) -> String {
        format!("FLEXINFER_QUANTIZER_IMAGE_{}", format.to_ascii_uppercase())
    }
    /// Image of the download/publish worker (and CPU phases without a format image).
    pub const WORKER_IMAGE: &str = "FLEXINFER_WORKER_IMAGE";
    /// ServiceAccount of pipeline Jobs.
    pub const WORKER_SERVICE_ACCOUNT: &str = "FLEXINFER_WORKER_SERVICE_ACCOUNT";
    /// Image-drift grace window in seconds (default 600).
    pub const IMAGE_DRIFT_GRACE_SECONDS: &str = "FLEXINFER_IMAGE_DRIFT_GRACE_SECONDS";
    /// Retry backoff base in seconds (default 30).
    pub const RETRY_BASE_SECONDS: &str = "FLEXINFER_RETRY_BASE_SECONDS";
    pub const LEADER_ELECT: &str = "FLEXINFER_LEADER_ELECT";
    pub const NAMESPACE: &str = "FLEXINFER_NAMESPACE";
    /// Root directory `local://` sources are confined to.
    pub const LOCAL_SOURCE_ROOT: &str = "FLEXINFER_LOCAL_SOURCE_ROOT";
    /// Default serving image per backend: `FLEXINFER_RUNTIME_IMAGE_<BACKEND>`.
    pub fn runtime_image(backend: &str) -> String {
        format!("FLEXINFER_RUNTIME_IMAGE_{}", backend.to_ascii_uppercase())
    }
    /// Only watch this namespace (default: all namespaces).
    pub const WATCH_NAMESPACE: &str = "FLEXINFER_WATCH_NAMESPACE";
    /// Seconds between progress polls (pod log tail) of a running Job (default 30).
    pub const PROGRESS_POLL_SECONDS: &str = "FLEXINFER_PROGRESS_POLL_SECONDS";
    /// Leader-election Lease duration in seconds (default 15).
    pub const LEASE_DURATION_SECONDS: &str = "FLEXINFER_LEASE_DURATION_SECONDS";
    /// Name of the leader-election Lease (default `flexinfer-controller-leader`).
    pub const LEASE_NAME: &str = "FLEXINFER_LEASE_NAME";
    /// Address of `/metrics` (default `0.0.0.0:8080`).
    pub const METRICS_ADDR: &str = "FLEXINFER_METRICS_ADDR";
    /// Address of `/healthz` and `/readyz` (default `0.0.0.0:8081`).
    pub const HEALTH_ADDR: &str = "FLEXINFER_HEALTH_ADDR";
}

/// Marker files written by workers (SPEC §4.2). All are written atomically.
pub mod files {
    pub const DOWNLOAD_COMPLETE: &str = ".download_complete";
    pub const SOURCE_INTEGRITY: &str = ".source-integrity.json";
    pub const ABLITERATION_STATUS: &str = ".abliteration-status.json";
    pub const GPTQ_CACHE_DIR: &str = ".flexinfer-gptq-cache";
    pub const GPTQ_CHECKPOINT: &str = ".flexinfer-gptq-cache/checkpoint.json";
    pub const GPTQ_LAYERS_DIR: &str = ".flexinfer-gptq-cache/layers";
    pub const GPTQ_LAYERS_MANIFEST: &str = ".flexinfer-gptq-cache/layers/manifest.json";
    pub const SAVE_COMPLETE: &str = ".save-complete";
    pub const QUANTIZATION_QUALITY: &str = ".quantization-quality.json";
    pub const DEFAULT_TERMINATION_LOG: &str = "/dev/termination-log";
    /// Kubernetes caps termination messages at 4096 bytes.
    pub const TERMINATION_MESSAGE_MAX_BYTES: usize = 4096;
}

/// Exit codes of every worker subcommand (SPEC §4.4).
pub mod exit_codes {
    pub const OK: i32 = 0;
    pub const FAILURE: i32 = 1;
    pub const BAD_INPUT: i32 = 2;
    pub const QUALITY_GATE: i32 = 3;
    pub const VERSION_MISMATCH: i32 = 4;
}

/// Event names of the JSON-line stream on stdout (SPEC §4.3).
pub mod events {
    pub const START: &str = "start";
    pub const PROGRESS: &str = "progress";
    pub const QUANTIZATION_LAYER_CACHED: &str = "quantization_layer_cached";
    pub const QUANTIZATION_RESUME_LOADED: &str = "quantization_resume_loaded";
    pub const QUANTIZATION_RESUME_FALLBACK: &str = "quantization_resume_fallback";
    pub const QUANTIZATION_LAYER_CACHE_RESET: &str = "quantization_layer_cache_reset";
    pub const HESSIAN_RECOVERY: &str = "hessian_recovery";
    pub const QUANTIZATION_QUALITY: &str = "quantization_quality";
    pub const QUANTIZATION_QUALITY_UNAVAILABLE: &str = "quantization_quality_unavailable";
    pub const QUANTIZATION_CACHED: &str = "quantization_cached";
    pub const COMPLETE: &str = "complete";
    pub const ERROR: &str = "error";
    pub const WARNING: &str = "warning";
}

/// Kubernetes Event reasons emitted by the controller.
pub mod reasons {
    pub const DOWNLOAD_COMPLETE: &str = "DownloadComplete";
    pub const ABLITERATION_COMPLETE: &str = "AbliterationComplete";
    pub const QUANTIZATION_COMPLETE: &str = "QuantizationComplete";
    pub const PUBLISHED: &str = "Published";
    pub const CACHE_READY: &str = "CacheReady";
    pub const QUANTIZER_IMAGE_DRIFT: &str = "QuantizerImageDrift";
    pub const JOB_CREATED: &str = "JobCreated";
    pub const PHASE_FAILED: &str = "PhaseFailed";
    pub const RETRYING: &str = "Retrying";
    pub const UNSUPPORTED_FORMAT: &str = "UnsupportedFormat";
    pub const BACKEND_UNSUPPORTED: &str = "BackendUnsupported";
    pub const CACHE_NOT_READY: &str = "CacheNotReady";
    /// A trigger annotation or a spec change made a phase (and what follows) run again.
    pub const RERUN_REQUESTED: &str = "RerunRequested";
    /// `flexinfer.ai/reset-retries` cleared the retry state.
    pub const RETRIES_RESET: &str = "RetriesReset";
    /// The spec can't run (no image configured, bad annotation, bad path).
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// No image could be resolved for a phase.
    pub const IMAGE_NOT_CONFIGURED: &str = "ImageNotConfigured";
}

/// Pipeline phases as named in Job names/labels and the worker's subcommands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobPhase {
    Download,
    Abliterate,
    Quantize,
    Publish,
}

impl JobPhase {
    pub const ALL: [JobPhase; 4] = [
        JobPhase::Download,
        JobPhase::Abliterate,
        JobPhase::Quantize,
        JobPhase::Publish,
    ];
    /// Job name suffix, label value and worker subcommand.
    pub fn as_str(self) -> &'static str {
        match self {
            JobPhase::Download => "download",
            JobPhase::Abliterate => "abliterate",
            JobPhase::Quantize => "quantize",
            JobPhase::Publish => "publish",
        }
    }
    /// `status.currentPhase` value and metrics `job_type`.
    pub fn status_name(self) -> &'static str {
        match self {
            JobPhase::Download => "download",
            JobPhase::Abliterate => "abliteration",
            JobPhase::Quantize => "quantization",
            JobPhase::Publish => "publish",
        }
    }
    /// Name of the Job of this phase for a cache.
    pub fn job_name(self, cache: &str) -> String {
        format!("{cache}-{}", self.as_str())
    }
    pub fn parse(s: &str) -> Option<JobPhase> {
        JobPhase::ALL
            .into_iter()
            .find(|p| p.as_str() == s || p.status_name() == s)
    }
}

/// Parse a boolean env/flag value: `true`/`false` in any letter case, `1`/`0`, `yes`/`no`.
pub fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "y" | "on" => Some(true),
        "false" | "0" | "no" | "n" | "off" => Some(false),
        _ => None,
    }
}

/// One JSON line of the worker's stdout: `{"ts": RFC3339, "event": NAME, ...fields}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerEvent {
    pub ts: String,
    pub event: String,
    #[serde(flatten)]
    pub fields: serde_json::Map<String, serde_json::Value>,
}

/// Payload of a `progress` event.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProgressEvent {
    /// Pipeline phase (`download`, `abliteration`, `quantization`, `publish`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// 0–100.
    pub percent: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<i64>,
    /// Unit of `done`/`total` (`bytes`, `layers`, `modules`, `files`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<f64>,
}

impl WorkerEvent {
    /// Build an event line from a name and a serializable payload (an object).
    pub fn new<T: Serialize>(ts: String, event: &str, payload: &T) -> Self {
        let fields = match serde_json::to_value(payload) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        };
        Self {
            ts,
            event: event.to_string(),
            fields,
        }
    }

    /// Parse one stdout line; non-JSON and malformed lines give `None`.
    pub fn parse_line(line: &str) -> Option<WorkerEvent> {
        let line = line.trim();
        if !line.starts_with('{') {
            return None;
        }
        serde_json::from_str(line).ok()
    }

    /// The `progress` payload, if this is a valid progress event (percent finite, 0–100).
    pub fn progress(&self) -> Option<ProgressEvent> {
        if self.event != events::PROGRESS {
            return None;
        }
        let p: ProgressEvent =
            serde_json::from_value(serde_json::Value::Object(self.fields.clone())).ok()?;
        (p.percent.is_finite() && (0.0..=100.0).contains(&p.percent)).then_some(p)
    }
}

/// The newest valid `progress` event in a chunk of log text (the controller's bounded tail).
pub fn latest_progress(log: &str) -> Option<(String, ProgressEvent)> {
    log.lines()
        .rev()
        .filter_map(WorkerEvent::parse_line)
        .find_map(|e| e.progress().map(|p| (e.ts.clone(), p)))
}

/// Quality summary of the RTN-fallback gate (`$OUT_DIR/.quantization-quality.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct QualitySummary {
    pub gptq_modules: u64,
    pub rtn_fallback_modules: u64,
    pub rtn_fallback_percent: f64,
    pub max_rtn_fallback_percent: f64,
    pub minimum_modules: u64,
    /// `passed`, `failed` or `insufficient-sample`.
    pub gate: String,
}

/// Success termination message (JSON, ≤ 4 KiB).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TerminationSuccess {
    /// `download`, `abliterate`, `quantize`, `publish`, or the quant type (e.g. `gptq-w4-g128`).
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_size_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compressed_size_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization_time_seconds: Option<f64>,
    /// Output directory, relative to the cache mount or absolute under it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<QualitySummary>,
    /// Download: bytes and files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_count: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// Publish: manifest digest and tags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Abliteration results.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers_modified: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal_dir_norm: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u64>,
    /// Abliteration: perplexity on harmless text before and after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perplexity_before: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perplexity_after: Option<f64>,
}

/// Failure termination message.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TerminationFailure {
    pub error: String,
    pub phase: String,
    pub exit_code: i32,
    /// Last lines of the worker's log.
    #[serde(default)]
    pub tail: String,
}

/// Either termination message, as the controller reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
#[allow(clippy::large_enum_variant)] // parsed once per finished Job; boxing buys nothing
pub enum TerminationMessage {
    Failure(TerminationFailure),
    Success(TerminationSuccess),
}

impl TerminationMessage {
    pub fn parse(s: &str) -> Option<TerminationMessage> {
        serde_json::from_str(s.trim()).ok()
    }
}

/// Serialize a termination message, shrinking `tail`/`error` so the JSON fits in 4 KiB.
pub fn encode_termination<T: Serialize>(msg: &T) -> String {
    let s = serde_json::to_string(msg).unwrap_or_else(|_| "{}".to_string());
    if s.len() <= files::TERMINATION_MESSAGE_MAX_BYTES {
        return s;
    }
    // Too long: only failures carry long text; trim their tail then error.
    if let Ok(mut f) = serde_json::from_str::<TerminationFailure>(&s) {
        let budget = files::TERMINATION_MESSAGE_MAX_BYTES.saturating_sub(512);
        f.tail = tail_chars(&f.tail, budget / 2);
        f.error = tail_chars(&f.error, budget / 2);
        return serde_json::to_string(&f).unwrap_or_else(|_| "{}".to_string());
    }
    s.chars()
        .take(files::TERMINATION_MESSAGE_MAX_BYTES)
        .collect()
}

fn tail_chars(s: &str, max_bytes: usize) -> String {
    if s.len() <= max_bytes {
        return s.to_string();
    }
    let mut start = s.len() - max_bytes;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].to_string()
}

/// `.source-integrity.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceIntegrity {
    pub files: Vec<IntegrityFile>,
    pub weight_bytes: u64,
    pub revision: String,
    /// Source URI the files came from (a different source resets derived artifacts).
    #[serde(default)]
    pub source: String,
}

/// One file of `.source-integrity.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IntegrityFile {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// `.abliteration-status.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AbliterationStatusFile {
    pub status: String,
    pub layers_modified: u64,
    pub refusal_dir_norm: f64,
    pub layer: u64,
    pub weight_matrices: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perplexity_before: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perplexity_after: Option<f64>,
    pub completed_at: String,
}

/// `$OUT_DIR/.save-complete`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SaveComplete {
    pub version: u32,
    pub script_version: String,
    pub completed_at: String,
    pub shards: Vec<SaveShard>,
    pub has_index: bool,
    pub has_config: bool,
    pub has_quantize_config: bool,
}

/// One shard of `.save-complete`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SaveShard {
    pub name: String,
    pub size_bytes: u64,
    pub sha256: String,
}

/// Validate a relative path that came from a spec, a hub listing or a manifest: non-empty, not
/// absolute, no `..` component, no NUL. Returns the reason when invalid.
pub fn check_relative_path(p: &str) -> Result<(), String> {
    if p.is_empty() {
        return Err("empty path".into());
    }
    if p.contains('\0') {
        return Err(format!("path {p:?} contains a NUL byte"));
    }
    if p.starts_with('/') || p.starts_with('\\') {
        return Err(format!("path {p:?} is absolute"));
    }
    if p.split(['/', '\\']).any(|c| c == "..") {
        return Err(format!("path {p:?} contains '..'"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bools_accept_seed_spellings() {
        for t in ["true", "True", "TRUE", "1", "yes"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["false", "False", "FALSE", "0", "no"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        assert_eq!(parse_bool("maybe"), None);
    }

    #[test]
    fn latest_progress_skips_noise_and_invalid() {
        let log = r#"human line
{"ts":"2026-01-01T00:00:00Z","event":"progress","percent":10,"layer":1,"layers":10}
{"ts":"2026-01-01T00:00:01Z","event":"progress","percent":20}
{"ts":"2026-01-01T00:00:02Z","event":"progress","percent":250}
{"ts":"2026-01-01T00:00:03Z","event":"hessian_recovery","module":"x"}
{"ts": broken
"#;
        let (ts, p) = latest_progress(log).expect("progress");
        assert_eq!(ts, "2026-01-01T00:00:01Z");
        assert_eq!(p.percent, 20.0);
        assert!(latest_progress("no json here").is_none());
    }

    #[test]
    fn termination_messages_roundtrip_and_fit() {
        let f = TerminationFailure {
            error: "x".repeat(10_000),
            phase: "quantize".into(),
            exit_code: 2,
            tail: "y".repeat(10_000),
        };
        let s = encode_termination(&f);
        assert!(
            s.len() <= files::TERMINATION_MESSAGE_MAX_BYTES,
            "{}",
            s.len()
        );
        match TerminationMessage::parse(&s) {
            Some(TerminationMessage::Failure(back)) => assert_eq!(back.exit_code, 2),
            other => panic!("expected failure, got {other:?}"),
        }
        let ok = TerminationSuccess {
            kind: "gptq-w4-g128".into(),
            compressed_size_bytes: Some(5),
            ..Default::default()
        };
        match TerminationMessage::parse(&encode_termination(&ok)) {
            Some(TerminationMessage::Success(back)) => assert_eq!(back, ok),
            other => panic!("expected success, got {other:?}"),
        }
    }

    #[test]
    fn relative_paths() {
        assert!(check_relative_path("a/b.safetensors").is_ok());
        assert!(check_relative_path("../etc/passwd").is_err());
        assert!(check_relative_path("a/../../b").is_err());
        assert!(check_relative_path("/abs").is_err());
        assert!(check_relative_path("").is_err());
    }

    #[test]
    fn job_phase_names() {
        assert_eq!(JobPhase::Quantize.job_name("c"), "c-quantize");
        assert_eq!(JobPhase::parse("abliteration"), Some(JobPhase::Abliterate));
        assert_eq!(JobPhase::parse("publish"), Some(JobPhase::Publish));
        assert_eq!(
            env::controller_override(env::GPTQ_RESUME_LAYERS),
            "FLEXINFER_GPTQ_RESUME_LAYERS"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Appended by the ModelCache pipeline controller (issue 3).
// ---------------------------------------------------------------------------------------------

/// Extra pod labels/annotations for pipeline Jobs, set as ModelCache annotations whose values are
/// JSON objects of strings (e.g. cost-allocation labels, service-mesh opt-out annotations).
pub mod job_pod_annotations {
    /// JSON object: labels added to the pods of every pipeline Job of the cache.
    pub const JOB_POD_LABELS: &str = "flexinfer.ai/job-pod-labels";
    /// JSON object: annotations added to the pods of every pipeline Job of the cache.
    pub const JOB_POD_ANNOTATIONS: &str = "flexinfer.ai/job-pod-annotations";
    /// `flexinfer.ai/<phase>-pod-labels` (phase = `download`, `abliterate`, `quantize`, `publish`):
    /// labels for the pods of that phase only; they win over [`JOB_POD_LABELS`].
    pub fn phase_pod_labels(phase: &str) -> String {
        format!("flexinfer.ai/{phase}-pod-labels")
    }
    /// `flexinfer.ai/<phase>-pod-annotations`: annotations for the pods of that phase only.
    pub fn phase_pod_annotations(phase: &str) -> String {
        format!("flexinfer.ai/{phase}-pod-annotations")
    }
}

/// Annotation on a pipeline Job: the phase spec hash (spec + image) it was created for.
pub const JOB_SPEC_HASH_ANNOTATION: &str = "flexinfer.ai/spec-hash";

// ---------------------------------------------------------------------------------------------
// Model serving contract (added by the Model controller work; SPEC §2.2, §7).
// ---------------------------------------------------------------------------------------------

/// Names shared by the Model controller, the chart/RBAC and the proxy.
pub mod serving {
    /// Field manager of every object the controller applies (server-side apply).
    pub const FIELD_MANAGER: &str = "flexinfer-controller";
    /// `app.kubernetes.io/component` of serving Deployments, Services and pods.
    pub const COMPONENT: &str = "inference-server";
    /// Port of every backend's OpenAI-compatible HTTP server (container and Service).
    pub const PORT: i32 = 8000;
    /// Name of that port.
    pub const PORT_NAME: &str = "http";
    /// Where the artifact is mounted (read-only) in serving pods.
    pub const MODEL_MOUNT: &str = "/models";
    /// Name of the serving container.
    pub const CONTAINER: &str = "server";
    /// Pod template annotation: `gpu.priority` of the Model (shared-group arbitration).
    pub const GPU_PRIORITY_ANNOTATION: &str = "flexinfer.ai/gpu-priority";
    /// Pod template annotation: `gpu.shared` group of the Model.
    pub const SHARED_GROUP_ANNOTATION: &str = "flexinfer.ai/gpu-shared-group";
    /// vLLM attention backend environment variable (`config.attentionBackend`).
    pub const VLLM_ATTENTION_BACKEND: &str = "VLLM_ATTENTION_BACKEND";
    /// Value of `flexinfer.ai/promotion-validation` that counts as validated.
    pub const PROMOTION_VALIDATION_PASSED: &str = "passed";
    /// Controller env (downward API) naming its pod: Event `reportingInstance`, lease identity.
    pub const POD_NAME_ENV: &str = "POD_NAME";
}

/// Kubernetes Event reasons emitted by the Model controller.
pub mod model_reasons {
    /// A Model's phase changed (note: `Old -> New`).
    pub const PHASE_CHANGED: &str = "PhaseChanged";
    /// A gated Model asked for warm-primary service without validation.
    pub const PROMOTION_BLOCKED: &str = "PromotionBlocked";
    /// A Model's configuration is invalid (ConfigValid=False).
    pub const INVALID_CONFIG: &str = "InvalidConfig";
}

// ---------------------------------------------------------------------------------------------
// Download / publish (worker `download` and `publish` subcommands). Appended by the transfer
// work; tuning knobs the controller may set, and the OCI artifact layout `publish` writes and
// `download` of an `oci://` source reads.
// ---------------------------------------------------------------------------------------------

/// Optional tuning env of the transfer subcommands (each also a command-line flag).
pub mod transfer_env {
    /// Files fetched in parallel by `download` (default 4).
    pub const DOWNLOAD_CONCURRENCY: &str = "FLEXINFER_DOWNLOAD_CONCURRENCY";
    /// Consecutive failed attempts per file without progress before `download` gives up (default 8).
    pub const DOWNLOAD_RETRIES: &str = "FLEXINFER_DOWNLOAD_RETRIES";
    /// Blobs uploaded in parallel by `publish` (default 4).
    pub const PUBLISH_CONCURRENCY: &str = "FLEXINFER_PUBLISH_CONCURRENCY";
    /// Seconds between `progress` events of `download`/`publish` (default 5).
    pub const PROGRESS_INTERVAL_SECONDS: &str = "FLEXINFER_PROGRESS_INTERVAL_SECONDS";
}

/// OCI artifact layout of a published model (SPEC §6).
pub mod oci_artifact {
    /// Manifest `artifactType`.
    pub const ARTIFACT_TYPE: &str = "application/vnd.flexinfer.model.v1";
    /// Config descriptor media type (the empty JSON `{}`).
    pub const EMPTY_CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.empty.v1+json";
    /// Media type of each file layer.
    pub const FILE_LAYER_MEDIA_TYPE: &str = "application/vnd.flexinfer.model.file.v1";
    /// Layer annotation holding the file's relative path (what `oras pull` uses as the file name).
    pub const TITLE_ANNOTATION: &str = "org.opencontainers.image.title";
    /// Manifest annotation with the source the artifact was built from.
    pub const SOURCE_ANNOTATION: &str = "org.opencontainers.image.source";
    pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
    /// Tag policies of `spec.publish.tagPolicy`.
    pub const TAG_POLICY_OVERWRITE: &str = "overwrite";
    pub const TAG_POLICY_TIMESTAMP: &str = "timestamp";
    pub const TAG_POLICY_DIGEST_SUFFIX: &str = "digest-suffix";
}

// ---------------------------------------------------------------------------------------------
// Abliteration worker (issue 9): events and the resume manifest of `flexinfer-worker abliterate`.
// ---------------------------------------------------------------------------------------------

/// Names used only by the abliteration phase.
pub mod abliteration {
    /// Event: the refusal direction was chosen (`layer`, `refusalDirNorm`, `score`, `scores`).
    pub const EVENT_DIRECTION: &str = "abliteration_direction";
    /// Event: the quality gate was evaluated (`gate`, `refusalDirNorm`, `perplexityBefore`, …).
    pub const EVENT_GATE: &str = "abliteration_gate";
    /// Event: an interrupted run was resumed from its staging manifest (`shardsCached`).
    pub const EVENT_RESUME_LOADED: &str = "abliteration_resume_loaded";
    /// Event: the output directory already holds this exact result; nothing was recomputed.
    pub const EVENT_CACHED: &str = "abliteration_cached";
    /// Resume manifest inside the output (and its staging) directory.
    pub const MANIFEST: &str = ".abliteration-manifest.json";
    /// Suffix of the staging directory next to `OUT_DIR` (renamed into place when complete).
    pub const STAGING_SUFFIX: &str = ".partial";
}
