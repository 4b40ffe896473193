//! The termination message a worker leaves in `/dev/termination-log` (JSON, at most 4 KiB).

use serde::{Deserialize, Serialize};

use crate::files::{self, QualitySummary};
pub use crate::text::{head_chars, tail_chars};

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
    /// Quantize: the digest of everything that determined the artifact's bytes (`.save-complete`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_digest: Option<String>,
    /// Quantize: the device the GPTQ solves ran on, the `GPTQ_DEVICE` setting and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gptq_device: Option<crate::events::GptqDeviceReport>,
    /// Quantize: the settings the run used (after defaults, overrides and resolution), by name.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub applied: std::collections::BTreeMap<String, String>,
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
