//! `Model` (`ai.flexinfer/v1alpha2`): a served model (Deployment + Service) for one backend.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Desired state of a served model.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "ai.flexinfer",
    version = "v1alpha2",
    kind = "Model",
    plural = "models",
    shortname = "mdl",
    doc = "A model served by vLLM, llama.cpp, ollama or exllamav2 (a Deployment and a Service).",
    namespaced,
    status = "ModelStatus",
    printcolumn = r#"{"name":"Backend","type":"string","jsonPath":".spec.backend"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"Gate","type":"string","jsonPath":".status.conditions[?(@.type==\"PromotionGate\")].reason"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Endpoint","type":"string","priority":1,"jsonPath":".status.endpoint"}"#,
    printcolumn = r#"{"name":"Source","type":"string","priority":1,"jsonPath":".spec.source"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.backendKeySecretRef) || self.backend in ['vllm', 'llamacpp']",
     "message": "spec.backendKeySecretRef: only the vllm and llamacpp backends take an API key (ollama and exllamav2 do not)"}
]))]
pub struct ModelSpec {
    /// Serving engine.
    pub backend: Backend,

    /// Artifact to serve: `pvc://<claim>/<path>`, `modelcache://<name>` (that cache's `status.path`
    /// once it is Ready), or a Hugging Face id `HF://org/model` that the backend downloads itself.
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[A-Za-z0-9._/-]*$') && !self.contains('..') || self.matches('^modelcache://[a-z0-9]([-a-z0-9.]*[a-z0-9])?$') || self.matches('^((HF|hf|huggingface)://)?[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$')",
         "message": "spec.source must be pvc://<claim>/<path> (no '..'), modelcache://<name> or HF://org/model"}
    ]))]
    #[schemars(length(min = 3, max = 512))]
    pub source: String,

    /// Other names `flexinfer-proxy` routes to this Model (the request's `model` field), besides
    /// the Model's name. The proxy rewrites them to the served name before forwarding.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    #[schemars(inner(
        length(min = 1, max = 256),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")
    ))]
    pub aliases: Vec<String>,

    /// The serving backend's own API key, a key of a Secret in the Model's namespace. The
    /// controller injects it into the serving container by `secretKeyRef` (vLLM `VLLM_API_KEY`,
    /// llama.cpp `LLAMA_API_KEY`): the backend then answers its OpenAI routes only to requests
    /// that carry `Authorization: Bearer <key>`, so a caller that reaches a serving pod around
    /// flexinfer-proxy cannot use it. The proxy reads the Secret (chart value
    /// `proxy.backendKeys.enabled`) and sends the key itself; a caller's own `Authorization` is
    /// never forwarded to such a Model. Only `vllm` and `llamacpp` take a key. Unset: no key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_key_secret_ref: Option<BackendKeySecretRef>,

    /// Container image override; otherwise the GPUProfile's `runtime.images[backend]` or the
    /// controller default for the backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub image: Option<String>,

    /// GPU request and sharing.
    #[serde(default)]
    pub gpu: GpuSpec,

    /// Scale-to-zero settings.
    #[serde(default)]
    pub serverless: ServerlessSpec,

    /// Backend configuration.
    #[serde(default)]
    pub config: ModelConfig,

    /// Extra resource requests/limits for the serving container (GPU is added from `gpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// Node selector of the serving pods (the GPUProfile's node selector is merged in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    pub node_selector: Option<BTreeMap<String, String>>,

    /// Tolerations of the serving pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub tolerations: Option<Vec<Toleration>>,
}

/// A key of a Secret in the Model's namespace that holds the backend's API key.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub struct BackendKeySecretRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    #[schemars(regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"))]
    pub name: String,
    /// Key of the Secret whose value is the API key (printable ASCII without spaces: it is sent
    /// in an HTTP header).
    #[schemars(length(min = 1, max = 253))]
    #[schemars(regex(pattern = r"^[-._a-zA-Z0-9]+$"))]
    pub key: String,
}

/// Serving backend.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Vllm,
    Llamacpp,
    Ollama,
    Exllamav2,
}

impl Backend {
    /// Whether the backend's server takes an API key from its environment
    /// (`spec.backendKeySecretRef`; the CRD's rule on `spec` lists the same backends).
    pub fn takes_api_key(self) -> bool {
        matches!(self, Backend::Vllm | Backend::Llamacpp)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Vllm => "vllm",
            Backend::Llamacpp => "llamacpp",
            Backend::Ollama => "ollama",
            Backend::Exllamav2 => "exllamav2",
        }
    }
}

/// GPU request of a Model.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    /// GPU vendor; `auto` takes it from the GPUProfile.
    #[serde(default)]
    pub vendor: GpuVendorChoice,
    /// GPUs per replica.
    #[serde(default = "default_gpu_count")]
    #[schemars(range(min = 1, max = 8))]
    pub count: i32,
    /// Shared GPU group: at most one Model of a group is active at a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub shared: Option<String>,
    /// Priority inside a shared group; higher demand preempts lower.
    #[serde(default = "default_priority")]
    #[schemars(range(min = 0, max = 1000))]
    pub priority: i32,
    /// GPUProfile to use (name). Otherwise the profile whose architecture matches the
    /// `flexinfer.ai/gpu.arch` node selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub profile: Option<String>,
}

impl Default for GpuSpec {
    fn default() -> Self {
        Self {
            vendor: GpuVendorChoice::Auto,
            count: default_gpu_count(),
            shared: None,
            priority: default_priority(),
            profile: None,
        }
    }
}

/// GPU vendor selection.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum GpuVendorChoice {
    #[default]
    Auto,
    Amd,
    Nvidia,
}

/// Scale-to-zero settings.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServerlessSpec {
    /// Scale to `minReplicas` after `idleTimeout` without traffic. Disabled means always 1 replica.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Replicas kept while idle.
    #[serde(default)]
    #[schemars(range(min = 0, max = 10))]
    pub min_replicas: i32,
    /// Idle time before scaling down, as a duration (`30s`, `5m`, `1h`).
    #[serde(default = "default_idle_timeout")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^([0-9]+(\\\\.[0-9]+)?(ms|s|m|h))+$')",
         "message": "spec.serverless.idleTimeout must be a duration such as 30s, 5m or 1h"}
    ]))]
    #[schemars(length(max = 32))]
    pub idle_timeout: String,
    /// How long a request waits for a cold start.
    #[serde(default = "default_cold_start_timeout")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^([0-9]+(\\\\.[0-9]+)?(ms|s|m|h))+$')",
         "message": "spec.serverless.coldStartTimeout must be a duration such as 60s or 5m"}
    ]))]
    #[schemars(length(max = 32))]
    pub cold_start_timeout: String,
    /// How often `flexinfer-proxy` refreshes `status.lastActiveTime` while requests are in flight,
    /// as a duration; unset: the proxy's default (30s), at most half of `idleTimeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^([0-9]+(\\\\.[0-9]+)?(ms|s|m|h))+$')",
         "message": "spec.serverless.keepaliveInterval must be a duration such as 10s or 1m"}
    ]))]
    #[schemars(length(max = 32))]
    pub keepalive_interval: Option<String>,
}

/// `serverless.idleTimeout` when it cannot be parsed (the CRD rejects bad values).
pub const DEFAULT_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);
/// The proxy's default keepalive interval (`FLEXINFER_PROXY_KEEPALIVE_INTERVAL`).
pub const DEFAULT_KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
/// No Model's `lastActiveTime` is refreshed more often than this.
pub const MIN_KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

impl ServerlessSpec {
    /// `idleTimeout`, or [`DEFAULT_IDLE_TIMEOUT`] when it cannot be parsed.
    pub fn idle_timeout(&self) -> std::time::Duration {
        crate::duration::parse_duration(&self.idle_timeout).unwrap_or(DEFAULT_IDLE_TIMEOUT)
    }

    /// Interval of `lastActiveTime` refreshes while requests are in flight: `keepaliveInterval`,
    /// else `default` (the proxy's setting); at most half of `idleTimeout` (so an in-flight request
    /// always refreshes it before it expires) and at least [`MIN_KEEPALIVE_INTERVAL`].
    pub fn keepalive_interval(&self, default: std::time::Duration) -> std::time::Duration {
        let wanted = self
            .keepalive_interval
            .as_deref()
            .and_then(crate::duration::parse_duration)
            .unwrap_or(default);
        wanted
            .min(self.idle_timeout().checked_div(2).unwrap_or_default())
            .max(MIN_KEEPALIVE_INTERVAL)
    }
}

impl Default for ServerlessSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            min_replicas: 0,
            idle_timeout: default_idle_timeout(),
            cold_start_timeout: default_cold_start_timeout(),
            keepalive_interval: None,
        }
    }
}

/// Backend configuration.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelConfig {
    /// Quantization of the artifact (`gptq`, `awq`, `gguf`, `fp8`, `exl2`, `compressed-tensors`);
    /// taken from the ModelCache when the source is `modelcache://`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<ModelQuantization>,
    /// KV cache dtype (vLLM `--kv-cache-dtype`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// Maximum context length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 128, max = 1048576))]
    pub max_model_len: Option<i64>,
    /// vLLM `--max-num-batched-tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1048576))]
    pub max_num_batched_tokens: Option<i64>,
    /// vLLM `--gpu-memory-utilization`, in (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.05, max = 1.0))]
    pub gpu_memory_utilization: Option<f64>,
    /// `primary` keeps at least one replica warm; `ondemand` allows scale to zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_policy: Option<WarmPolicy>,
    /// vLLM attention backend (`VLLM_ATTENTION_BACKEND`), e.g. `TRITON_ATTN`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub attention_backend: Option<String>,
    /// Extra command-line arguments appended to the backend's arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[schemars(inner(length(max = 1024)))]
    pub extra_args: Vec<String>,
}

/// Artifact quantization as declared on a Model.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ModelQuantization {
    None,
    Gptq,
    Awq,
    Gguf,
    Fp8,
    Exl2,
    CompressedTensors,
}

/// KV cache dtype.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheDtype {
    Auto,
    Fp8,
    #[serde(rename = "fp8_e4m3")]
    Fp8E4m3,
    #[serde(rename = "fp8_e5m2")]
    Fp8E5m2,
    Float16,
    Bfloat16,
}

/// Warm policy.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WarmPolicy {
    Primary,
    Ondemand,
}

/// Observed state of a Model.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ModelPhase>,
    /// `Ready`, `ConfigValid`, `Cached`, `PromotionGate`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// In-cluster URL of the OpenAI-compatible endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Ready replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Last time traffic was seen (written by whatever proxies traffic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_active_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Artifact path currently served (`<pvc>:<subdir>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_path: Option<String>,
    /// Digest of the artifact the promotion validation was accepted for (the ModelCache's
    /// `configDigest`, else its published manifest digest). A different served artifact closes the
    /// gate again until `flexinfer.ai/promotion-evidence` names the new digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validated_artifact: Option<String>,
    /// Where the Model stands in its shared GPU group (`spec.gpu.shared`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_group: Option<SharedGroupStatus>,
}

/// A Model's place in its shared GPU group: one Model of a group holds the GPU lane at a time.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SharedGroupStatus {
    /// The group (`spec.gpu.shared`).
    pub group: String,
    pub state: SharedGroupState,
    /// Place in the line for the lane (1 = next) while `Queued` or `Preempted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<i32>,
    /// The higher-priority Model that took the lane (while `Preempted`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted_by: Option<String>,
    /// The Model the lane is given to now (this one when `Active`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_model: Option<String>,
    /// When `state` last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
}

/// State of a Model in its shared GPU group.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum SharedGroupState {
    /// Holds the lane and runs its replicas.
    Active,
    /// Wants to run and waits for the lane (behind a Model of equal or higher priority, or for
    /// the previous holder to release the GPU).
    Queued,
    /// Wanted to keep running but a higher-priority Model took the lane; back when that one idles.
    Preempted,
    /// No demand: holds no lane and waits for none.
    #[default]
    Idle,
}

impl SharedGroupState {
    pub fn as_str(self) -> &'static str {
        match self {
            SharedGroupState::Active => "Active",
            SharedGroupState::Queued => "Queued",
            SharedGroupState::Preempted => "Preempted",
            SharedGroupState::Idle => "Idle",
        }
    }
}

/// Phase of a Model.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum ModelPhase {
    Idle,
    Pending,
    Loading,
    Ready,
    Failed,
}

impl ModelPhase {
    pub const ALL: [ModelPhase; 5] = [
        ModelPhase::Idle,
        ModelPhase::Pending,
        ModelPhase::Loading,
        ModelPhase::Ready,
        ModelPhase::Failed,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            ModelPhase::Idle => "Idle",
            ModelPhase::Pending => "Pending",
            ModelPhase::Loading => "Loading",
            ModelPhase::Ready => "Ready",
            ModelPhase::Failed => "Failed",
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_gpu_count() -> i32 {
    1
}
fn default_priority() -> i32 {
    100
}
fn default_idle_timeout() -> String {
    "5m".into()
}
fn default_cold_start_timeout() -> String {
    "60s".into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_core::CustomResourceExt;

    /// The CRD's rule on `spec` admits `backendKeySecretRef` for exactly the backends that take a
    /// key (`Backend::takes_api_key`, which the controller's refusal uses).
    #[test]
    fn the_backend_key_rule_lists_the_backends_that_take_a_key() {
        let crd = serde_json::to_value(Model::crd()).unwrap_or_default();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let rules = spec["x-kubernetes-validations"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let rule = rules
            .iter()
            .filter_map(|r| r["rule"].as_str())
            .find(|r| r.contains("backendKeySecretRef"))
            .unwrap_or_else(|| panic!("no backendKeySecretRef rule on spec: {rules:?}"));
        let all = [
            Backend::Vllm,
            Backend::Llamacpp,
            Backend::Ollama,
            Backend::Exllamav2,
        ];
        for b in all {
            assert_eq!(
                rule.contains(&format!("'{}'", b.as_str())),
                b.takes_api_key(),
                "{b:?} in {rule}"
            );
        }
        assert!(spec["properties"]["backendKeySecretRef"]["properties"]["key"].is_object());
    }
}
