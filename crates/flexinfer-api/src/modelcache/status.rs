//! Observed state of a ModelCache: the pipeline phase, per-phase progress and results, and the
//! quality sidecar's summary.

use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Observed state of a ModelCache.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelCacheStatus {
    /// Pipeline phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<CachePhase>,
    /// Current step: `download`, `abliteration`, `quantization`, `publish` or `ready`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_phase: Option<String>,
    /// Progress (0–100) of the current step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Progressing`, `Degraded`, and per phase `Downloaded`, `Abliterated`, `Quantized`, `Published`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Failed attempts of the current phase so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_count: Option<i32>,
    /// Phase of the last failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure_phase: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure_time: Option<Time>,
    /// Earliest time the failed phase is re-attempted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_retry_at: Option<Time>,
    /// `<pvc>:<subdir>` of the artifact serving should use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// PVC holding the cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub download: Option<DownloadStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abliteration: Option<AbliterationStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<QuantizationStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish: Option<PublishStatus>,
    /// `storageStrategy: NodeLocal`: which node holds which copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_local: Option<NodeLocalStatus>,
}

/// The copies of a `storageStrategy: NodeLocal` cache on its nodes.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeLocalStatus {
    /// The published digest the selected nodes hold or are filling (none before the first publish).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Selected nodes whose copy of `digest` is verified: a Model of this cache can run there.
    pub ready_nodes: i32,
    /// Nodes that `nodeLocal.nodeSelector` selects (cordoned ones excluded).
    pub selected_nodes: i32,
    /// Why no node gets a copy, when none does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// One entry per selected node, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<NodeCopyStatus>,
}

/// One node's copy.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeCopyStatus {
    pub node: String,
    /// `Pending` (nothing published yet), `Filling`, `Ready` or `Failed`.
    pub phase: String,
    /// The digest being filled or held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The earlier verified copy the node serves while a newer one fills (its shortened digest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<String>,
    /// Why a fill failed, or what it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Pipeline phase of a ModelCache.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum CachePhase {
    Pending,
    Downloading,
    Abliterating,
    Quantizing,
    Publishing,
    Ready,
    Failed,
}

impl CachePhase {
    pub const ALL: [CachePhase; 7] = [
        CachePhase::Pending,
        CachePhase::Downloading,
        CachePhase::Abliterating,
        CachePhase::Quantizing,
        CachePhase::Publishing,
        CachePhase::Ready,
        CachePhase::Failed,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            CachePhase::Pending => "Pending",
            CachePhase::Downloading => "Downloading",
            CachePhase::Abliterating => "Abliterating",
            CachePhase::Quantizing => "Quantizing",
            CachePhase::Publishing => "Publishing",
            CachePhase::Ready => "Ready",
            CachePhase::Failed => "Failed",
        }
    }
}

/// Progress fields shared by every phase status, flattened into each one (so they stay flat in
/// each phase for `kubectl` readability). The phase statuses dereference to it, so
/// `status.download.completed_at` reads it directly.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PhaseProgress {
    /// Hash of the phase inputs (spec + image) the current artifact was or is being built from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_hash: Option<String>,
    /// Hash of the whole phase spec including run-only settings (deadline, memory) that the last
    /// attempt ran with: a failed phase is tried again when only those change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_hash: Option<String>,
    /// Image of the Job that produced (or is producing) the artifact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
    /// 0–100, never decreases within one run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_detail: Option<String>,
    /// `telemetry` (worker events) or `elapsed-estimate` (time used / deadline, capped at 99).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress_at: Option<Time>,
    /// Why the last attempt failed (termination message or log tail).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
}

/// Download phase status.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DownloadStatus {
    #[serde(flatten)]
    pub run: PhaseProgress,
    /// Total bytes of the downloaded files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_count: Option<i64>,
    /// Revision that was downloaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// Directory (relative to the cache root) of the downloaded files (the promoted generation,
    /// `<modelPath>/source.<generation>`; absent for a cache downloaded into `<modelPath>` itself
    /// before downloads had generations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_dir: Option<String>,
    /// Generation of the run in flight or last run: it writes `<modelPath>/source.<generation>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<String>,
    /// Earlier downloads still on disk (kept for Models that serve them), newest first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_output_dirs: Option<Vec<String>>,
}

/// Abliteration phase status.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AbliterationStatus {
    #[serde(flatten)]
    pub run: PhaseProgress,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers_modified: Option<i64>,
    /// Norm of the raw refusal direction (decimal string).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal_dir_norm: Option<String>,
    /// Layer whose direction was used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perplexity_before: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perplexity_after: Option<String>,
    /// Directory (relative to the cache root) of the abliterated model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_dir: Option<String>,
    #[serde(flatten)]
    pub generations: Generations,
}

/// Quantization phase status.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuantizationStatus {
    #[serde(flatten)]
    pub run: PhaseProgress,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// e.g. `gptq-w4-g128`.
    #[serde(rename = "type")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_size_bytes: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compressed_size_bytes: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression_ratio: Option<f64>,
    /// Duration, e.g. `1h2m3s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization_time: Option<String>,
    /// Calibration parameters that were used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration_params: Option<BTreeMap<String, String>>,
    /// Directory (relative to the cache root) of the quantized artifact (the promoted generation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<QualityStatus>,
    /// Digest of everything that determined the artifact's bytes (also in its `.save-complete`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_digest: Option<String>,
    /// Settings the run used, as the worker reported them (not copied from the spec).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied: Option<BTreeMap<String, String>>,
    /// The device the GPTQ solves of the run in flight or the last run use (`cpu-faer`, `hip:0 AMD Radeon RX
    /// 7900 XTX …`): from the worker's `gptq_device_selected` event while it runs (the log is read with the
    /// progress), from its termination message when it ends; cleared when a new run starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gptq_device: Option<String>,
    /// Why that device (with `GPTQ_DEVICE=auto`, each runtime probed and why it was not usable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gptq_device_reason: Option<String>,
    /// That device's kind: `cpu`, `cuda` or `hip` (from the same report; cleared with it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gptq_device_kind: Option<String>,
    /// The `GPTQ_DEVICE` setting the worker chose that device for (`auto`, `cpu`, `hip`, `cuda`), as it
    /// read it (from the same report; cleared with it). With the kind, what keeps the
    /// `flexinfer_quantization_on_cpu` gauge true across a controller restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gptq_device_requested: Option<String>,
    #[serde(flatten)]
    pub generations: Generations,
}

/// Publish phase status.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PublishStatus {
    #[serde(flatten)]
    pub run: PhaseProgress,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published_tags: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published_at: Option<Time>,
    /// Up to five earlier digests, newest first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_digests: Option<Vec<String>>,
}

/// The generations of a phase whose output a gate may reject (abliteration, quantization), flattened
/// into its status after the phase's own fields.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Generations {
    /// Generation of the run in flight or last run: its output is `<outputDir base>.<generation>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<String>,
    /// Earlier generations still on disk (kept for Models that serve them), newest first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_output_dirs: Option<Vec<String>>,
    /// The last generation a gate rejected; the promoted output (`outputDir`) was left untouched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected_generation: Option<String>,
}

/// The phase statuses dereference to their [`PhaseProgress`].
macro_rules! deref_to_progress {
    ($($status:ty),*) => {$(
        impl Deref for $status {
            type Target = PhaseProgress;
            fn deref(&self) -> &PhaseProgress {
                &self.run
            }
        }

        impl DerefMut for $status {
            fn deref_mut(&mut self) -> &mut PhaseProgress {
                &mut self.run
            }
        }
    )*};
}

deref_to_progress!(
    DownloadStatus,
    AbliterationStatus,
    QuantizationStatus,
    PublishStatus
);

/// Result of the RTN-fallback quality gate.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QualityStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gptq_modules: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rtn_fallback_modules: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rtn_fallback_percent: Option<f64>,
    /// `passed`, `failed` or `insufficient-sample`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<String>,
}
