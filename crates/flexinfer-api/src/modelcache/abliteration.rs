//! The abliteration phase of a ModelCache: `spec.abliteration`.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Abliteration phase settings (refusal-direction orthogonalization).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AbliterationSpec {
    /// Decoder layers whose refusal direction is used: `auto` (pick the best full-attention layer in
    /// the middle of the stack), a range `10-55`, or a list `0,1,5`.
    #[serde(default = "default_target_layers")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self == 'auto' || self.matches('^[0-9]{1,4}-[0-9]{1,4}$') || self.matches('^[0-9]{1,4}(,[0-9]{1,4})*$')",
         "message": "spec.abliteration.targetLayers must be 'auto', a range like '10-55', or a list like '0,1,5'"}
    ]))]
    #[schemars(length(min = 1, max = 256))]
    pub target_layers: String,

    /// Matrices that write into the residual stream and get the direction projected out.
    #[serde(default = "default_weight_matrices")]
    #[schemars(length(min = 1, max = 2))]
    pub weight_matrices: Vec<WeightMatrix>,

    /// Prompts per class (refusal / harmless) used to estimate the direction.
    #[serde(default = "default_num_samples")]
    #[schemars(range(min = 16, max = 512))]
    pub num_samples: i32,

    /// Maximum accepted norm of the raw refusal direction (decimal string). Larger norms fail the
    /// phase: they indicate a corrupted model or a bad layer choice.
    #[serde(default = "default_norm_threshold")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^[0-9]+(\\\\.[0-9]+)?$') && double(self) > 0.0",
         "message": "spec.abliteration.normThreshold must be a positive decimal number such as \"100\""}
    ]))]
    #[schemars(length(max = 32))]
    pub norm_threshold: String,

    /// Maximum perplexity increase on harmless text, in percent (decimal string).
    #[serde(default = "default_max_ppl_regression")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^[0-9]+(\\\\.[0-9]+)?$')",
         "message": "spec.abliteration.maxPerplexityIncreasePercent must be a non-negative decimal number such as \"5\""}
    ]))]
    #[schemars(length(max = 32))]
    pub max_perplexity_increase_percent: String,

    /// Dataset (hub id or local file under the cache) of prompts the model refuses.
    #[serde(default = "default_refusal_dataset")]
    #[schemars(length(max = 512))]
    pub refusal_dataset: String,

    /// Dataset (hub id or local file under the cache) of harmless prompts.
    #[serde(default = "default_harmless_dataset")]
    #[schemars(length(max = 512))]
    pub harmless_dataset: String,

    /// Skip linear-attention (GatedDeltaNet) layers when choosing and modifying layers.
    #[serde(default = "super::default_true", rename = "skipGDNLayers")]
    pub skip_gdn_layers: bool,

    /// Skip vision/audio tower layers.
    #[serde(default = "super::default_true")]
    pub skip_vision_layers: bool,

    /// Also orthogonalize the lm_head. Off by default: it corrupted saves in the reference pipeline.
    #[serde(default)]
    pub ablitate_lm_head: bool,

    /// Run on a GPU node (adds the GPU resource and the default GPU toleration).
    #[serde(default, rename = "useGPU")]
    pub use_gpu: bool,

    /// Memory request and limit of the abliteration Job, in GiB.
    #[serde(default = "default_abliteration_memory")]
    #[schemars(range(min = 1, max = 1024))]
    #[serde(rename = "maxMemoryGB")]
    pub max_memory_gb: i32,

    /// activeDeadlineSeconds of the abliteration Job.
    #[serde(default = "default_abliteration_timeout")]
    #[schemars(range(min = 300, max = 172800))]
    pub timeout_seconds: i64,

    /// Node selector for this phase only (overrides `spec.nodeSelector`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    pub node_selector: Option<BTreeMap<String, String>>,
}

/// A weight matrix that writes into the residual stream.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WeightMatrix {
    /// Attention output projection.
    OProj,
    /// MLP down projection (shared/dense only; MoE experts are never modified).
    DownProj,
}

impl WeightMatrix {
    pub fn as_str(self) -> &'static str {
        match self {
            WeightMatrix::OProj => "o_proj",
            WeightMatrix::DownProj => "down_proj",
        }
    }
}

fn default_target_layers() -> String {
    "auto".into()
}
fn default_weight_matrices() -> Vec<WeightMatrix> {
    vec![WeightMatrix::OProj, WeightMatrix::DownProj]
}
fn default_num_samples() -> i32 {
    128
}
fn default_norm_threshold() -> String {
    "100".into()
}
fn default_max_ppl_regression() -> String {
    "5".into()
}
fn default_refusal_dataset() -> String {
    "mlabonne/harmful_behaviors".into()
}
fn default_harmless_dataset() -> String {
    "mlabonne/harmless_alpaca".into()
}
fn default_abliteration_memory() -> i32 {
    56
}
fn default_abliteration_timeout() -> i64 {
    14400
}
