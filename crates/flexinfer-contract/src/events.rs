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
/// Quantize: where the calibration forward runs (`on`: `device` or `cpu`, `device`, `reason`, `batchTokens`;
/// `layer` when a layer's forward moves to the CPU).
pub const CALIBRATION_FORWARD: &str = "calibration_forward";
/// Quantize, at the end of a run: where its time went, seconds per phase (`loadSeconds`, `forwardSeconds`,
/// `hessianSeconds`, `solveSeconds`, `cacheSeconds`, `copySeconds`, `saveSeconds`, `wholeRunSeconds`),
/// where the forward ran (`forwardOn`: `device` or `cpu`) and, on the device, its batch size at the end
/// (`forwardBatchTokens`) and how many batches ran out of memory and ran again smaller
/// (`forwardSmallerBatches`).
pub const QUANTIZE_PHASES: &str = "quantize_phases";
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

    /// The report of a `gptq_device_selected` event (its reason cut to
    /// [`GptqDeviceReport::REASON_MAX_BYTES`]); `None` for another event or one without a `device`.
    pub fn gptq_device(&self) -> Option<GptqDeviceReport> {
        if self.event != GPTQ_DEVICE_SELECTED {
            return None;
        }
        let r: GptqDeviceReport =
            serde_json::from_value(serde_json::Value::Object(self.fields.clone())).ok()?;
        (!r.device.is_empty()).then(|| r.bounded())
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

/// Which device a quantization's GPTQ solves run on and why: the fields of a `gptq_device_selected` event
/// (besides its per-runtime `probes`), and the quantize termination message's `gptqDevice`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptqDeviceReport {
    /// The `GPTQ_DEVICE` setting the worker ran with, canonical: `auto`, `cpu`, `hip`, `cuda`.
    #[serde(default)]
    pub requested: String,
    /// The device: `cpu-faer`, `hip:0 AMD Radeon RX 7900 XTX (embedded gptq-gfx1100.hsaco)
    /// [librocblas.so.0, librocsolver.so.0]`.
    pub device: String,
    /// Its kind: `cpu`, `hip`, `cuda`.
    #[serde(default)]
    pub kind: String,
    /// Why this device; with `auto`, every runtime probed and why it was not usable.
    #[serde(default)]
    pub reason: String,
}

impl GptqDeviceReport {
    /// The setting and the kind that mean the host CPU.
    pub const CPU: &'static str = "cpu";
    /// The reason is cut to this (the termination message must stay under 4 KiB with everything else in
    /// it; the controller does not trust the log it reads).
    pub const REASON_MAX_BYTES: usize = 800;
    /// A device name is cut to this.
    pub const DEVICE_MAX_BYTES: usize = 256;
    /// The setting and the kind (a few letters when the worker is ours) are cut to this.
    pub const WORD_MAX_BYTES: usize = 32;

    /// The report with each field cut to its bound at a character boundary.
    pub fn bounded(mut self) -> Self {
        use crate::text::head_chars;
        self.requested = head_chars(&self.requested, Self::WORD_MAX_BYTES);
        self.device = head_chars(&self.device, Self::DEVICE_MAX_BYTES);
        self.kind = head_chars(&self.kind, Self::WORD_MAX_BYTES);
        self.reason = head_chars(&self.reason, Self::REASON_MAX_BYTES);
        self
    }

    /// The solves run on the CPU although the setting did not ask for it (`auto` found no GPU, or an older
    /// worker that did not say).
    pub fn on_cpu_unasked(&self) -> bool {
        self.kind == Self::CPU && self.requested != Self::CPU
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

#[cfg(test)]
mod tests {
    use super::*;

    fn event(line: &str) -> WorkerEvent {
        WorkerEvent::parse_line(line).expect("a valid line")
    }

    #[test]
    fn a_gptq_device_selected_event_gives_its_report() {
        let e = event(
            r#"{"ts":"t","event":"gptq_device_selected","requested":"auto","device":"cpu-faer","kind":"cpu","reason":"auto: no usable GPU","probes":[{"kind":"hip","usable":false}]}"#,
        );
        assert_eq!(
            e.gptq_device(),
            Some(GptqDeviceReport {
                requested: "auto".into(),
                device: "cpu-faer".into(),
                kind: "cpu".into(),
                reason: "auto: no usable GPU".into(),
            })
        );
        // Another event with the same fields, or one without a device, is no report.
        let other = event(r#"{"ts":"t","event":"start","device":"cpu-faer"}"#);
        assert_eq!(other.gptq_device(), None);
        let empty = event(r#"{"ts":"t","event":"gptq_device_selected","device":"","kind":"cpu"}"#);
        assert_eq!(empty.gptq_device(), None);
        let wrong_type = event(r#"{"ts":"t","event":"gptq_device_selected","device":7}"#);
        assert_eq!(wrong_type.gptq_device(), None);
    }

    #[test]
    fn a_report_read_from_the_log_is_bounded() {
        let long = "é".repeat(GptqDeviceReport::REASON_MAX_BYTES);
        let line = serde_json::json!({
            "ts": "t", "event": GPTQ_DEVICE_SELECTED, "requested": "h".repeat(5000),
            "device": "d".repeat(10_000), "kind": "k".repeat(5000), "reason": long,
        })
        .to_string();
        let r = event(&line).gptq_device().unwrap();
        assert!(
            r.reason.len() <= GptqDeviceReport::REASON_MAX_BYTES,
            "{}",
            r.reason.len()
        );
        assert!(r.reason.ends_with("..."));
        assert!(r.device.len() <= GptqDeviceReport::DEVICE_MAX_BYTES);
        assert!(r.requested.len() <= GptqDeviceReport::WORD_MAX_BYTES);
        assert!(r.kind.len() <= GptqDeviceReport::WORD_MAX_BYTES);
        // The worker's own words pass unchanged.
        let ours = GptqDeviceReport {
            requested: "auto".into(),
            device: "cpu-faer".into(),
            kind: "cpu".into(),
            reason: "auto: no usable GPU".into(),
        };
        assert_eq!(ours.clone().bounded(), ours);
    }

    #[test]
    fn on_the_cpu_unasked_is_cpu_without_the_cpu_setting() {
        let r = |requested: &str, kind: &str| GptqDeviceReport {
            requested: requested.into(),
            device: "x".into(),
            kind: kind.into(),
            reason: String::new(),
        };
        assert!(r("auto", "cpu").on_cpu_unasked());
        assert!(r("", "cpu").on_cpu_unasked());
        assert!(!r("cpu", "cpu").on_cpu_unasked());
        assert!(!r("auto", "hip").on_cpu_unasked());
        assert!(!r("cuda", "cuda").on_cpu_unasked());
    }
}
