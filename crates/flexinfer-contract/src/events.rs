//! The JSON-line event stream on a worker's stdout: event names and the line format.

use serde::{Deserialize, Serialize};

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
/// Earlier generations of a phase's output that a successful run removed (`removed`, `kept`).
pub const GENERATIONS_COLLECTED: &str = "generations_collected";
/// An artifact exists at `OUT_DIR` but was made from another configuration: it is not reused.
pub const QUANTIZATION_REUSE_REJECTED: &str = "quantization_reuse_rejected";
/// Quantize: a per-family model policy applied to this run (`policy`, `message`, `advice`).
pub const MODEL_POLICY: &str = "model_policy";
/// Quantize: which GPTQ device the run uses and why (`requested`, `device`, `reason`, `probes`).
pub const GPTQ_DEVICE_SELECTED: &str = "gptq_device_selected";
/// Quantize: a device operation failed and the device was reset (`module`, `device`, `op`, `error`, `reset`).
pub const GPTQ_DEVICE_ERROR: &str = "gptq_device_error";
/// Quantize: an input group's solve moved from the device to the CPU (`module`, `device`, `error`).
pub const GPTQ_DEVICE_FALLBACK: &str = "gptq_device_fallback";
pub const COMPLETE: &str = "complete";
pub const ERROR: &str = "error";
pub const WARNING: &str = "warning";
/// Abliteration: the refusal direction was chosen (`layer`, `refusalDirNorm`, `score`, `scores`).
pub const ABLITERATION_DIRECTION: &str = "abliteration_direction";
/// Abliteration: the quality gate was evaluated (`gate`, `refusalDirNorm`, `perplexityBefore`, …).
pub const ABLITERATION_GATE: &str = "abliteration_gate";
/// Abliteration: an interrupted run was resumed from its staging manifest (`shardsCached`).
pub const ABLITERATION_RESUME_LOADED: &str = "abliteration_resume_loaded";
/// Abliteration: the output directory already holds this exact result; nothing was recomputed.
pub const ABLITERATION_CACHED: &str = "abliteration_cached";

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
        if self.event != PROGRESS {
            return None;
        }
        let p: ProgressEvent =
            serde_json::from_value(serde_json::Value::Object(self.fields.clone())).ok()?;
        (p.percent.is_finite() && (0.0..=100.0).contains(&p.percent)).then_some(p)
    }
}

/// The newest event called `name` in a chunk of log text (the controller's bounded tail).
pub fn latest_event(log: &str, name: &str) -> Option<WorkerEvent> {
    log.lines()
        .rev()
        .filter_map(WorkerEvent::parse_line)
        .find(|e| e.event == name)
}

/// The newest valid `progress` event in a chunk of log text (timestamp and payload).
pub fn latest_progress(log: &str) -> Option<(String, ProgressEvent)> {
    log.lines()
        .rev()
        .filter_map(WorkerEvent::parse_line)
        .find_map(|e| e.progress().map(|p| (e.ts.clone(), p)))
}
