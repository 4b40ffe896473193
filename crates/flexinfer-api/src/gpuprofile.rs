//! `GPUProfile` (`ai.flexinfer/v1alpha2`): how to find and use one GPU architecture.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::EnvVar;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One GPU architecture of the cluster (conventionally named after it, e.g. `gfx1100`).
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "ai.flexinfer",
    version = "v1alpha2",
    kind = "GPUProfile",
    plural = "gpuprofiles",
    shortname = "gpup",
    shortname = "gpuprofile",
    doc = "How to find and use one GPU architecture: node selector, GPU resource, driver memory, images.",
    namespaced,
    status = "GPUProfileStatus",
    printcolumn = r#"{"name":"Arch","type":"string","jsonPath":".spec.architecture"}"#,
    printcolumn = r#"{"name":"Vendor","type":"string","jsonPath":".spec.vendor"}"#,
    printcolumn = r#"{"name":"VRAM(MB)","type":"integer","jsonPath":".spec.vramMB"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GPUProfileSpec {
    /// GPU architecture: `gfx1100`, `gfx906`, `sm_90`, …
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.matches('^(gfx[0-9a-f]{3,5}|sm_[0-9]{2,3}[a-z]?)$')",
         "message": "spec.architecture must be an AMD gfx target (gfx1100, gfx906, …) or an NVIDIA sm_XX target"}
    ]))]
    #[schemars(length(max = 63))]
    pub architecture: String,

    /// GPU vendor.
    pub vendor: GpuVendor,

    /// VRAM per GPU in MiB.
    #[serde(default, rename = "vramMB", skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1024, max = 1048576))]
    pub vram_mb: Option<i64>,

    /// How to find these nodes; default `flexinfer.ai/gpu.arch: <architecture>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    pub node_selector: Option<BTreeMap<String, String>>,

    /// Extended resource name of the GPU; default `amd.com/gpu` or `nvidia.com/gpu` by vendor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub resource_name: Option<String>,

    /// Environment injected into GPU Jobs and serving pods on this architecture. It may not set the
    /// variables FlexInfer sets itself (paths, sources, credentials, the artifact's settings, the
    /// publish target, `FLEXINFER_*`) nor the dynamic loader's (`LD_PRELOAD`, `LD_LIBRARY_PATH`, `LD_AUDIT`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), transform = protected_env_rule)]
    pub env: Vec<EnvVar>,

    /// Default container memory (GiB) for serving pods on these nodes.
    #[serde(
        default,
        rename = "containerMemoryGB",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = 1, max = 2048))]
    pub container_memory_gb: Option<i32>,

    /// Driver memory outside the cgroup (ROCm GTT), added to Job memory request and limit.
    #[serde(
        default,
        rename = "gpuDriverMemoryMB",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = 0, max = 1048576))]
    pub gpu_driver_memory_mb: Option<i64>,

    /// Quantizer images for this architecture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<ProfileQuantization>,

    /// Serving runtime images for this architecture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<ProfileRuntime>,

    /// RuntimeClass of every pod on this profile that requests a GPU (serving pods and GPU
    /// pipeline Jobs), e.g. `nvidia` where the NVIDIA container runtime is not the node's default
    /// (k3s with the NVIDIA container toolkit). Unset: the node's default runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[schemars(regex(
        pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
    ))]
    pub runtime_class_name: Option<String>,

    /// Supplemental group ids of every pod on this profile that requests a GPU, added to the
    /// controller-wide `FLEXINFER_GPU_SUPPLEMENTAL_GROUPS` (AMD: the nodes' `render` and `video`
    /// gids, which own `/dev/kfd` and `/dev/dri/renderD*`). Group 0 (root) is refused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[schemars(inner(range(min = 1, max = 4294967295_i64)))]
    pub supplemental_groups: Vec<i64>,
}

/// GPU vendor.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum GpuVendor {
    Amd,
    Nvidia,
}

impl GpuVendor {
    pub fn default_resource_name(self) -> &'static str {
        match self {
            GpuVendor::Amd => "amd.com/gpu",
            GpuVendor::Nvidia => "nvidia.com/gpu",
        }
    }
}

/// The admission rule on `spec.env`: no protected name (the contract's list, one place). Names are
/// bounded so that the API server can bound the rule's cost.
fn protected_env_rule(schema: &mut schemars::Schema) {
    use crate::contract::env::{PROFILE_PROTECTED, PROFILE_PROTECTED_PREFIX};
    let names = PROFILE_PROTECTED
        .iter()
        .map(|n| format!("'{n}'"))
        .collect::<Vec<_>>()
        .join(", ");
    let rule = format!(
        "self.all(e, !(e.name in [{names}]) && !e.name.startsWith('{PROFILE_PROTECTED_PREFIX}'))"
    );
    let message = format!(
        "spec.env may not set a variable FlexInfer sets itself ({}, {PROFILE_PROTECTED_PREFIX}*)",
        PROFILE_PROTECTED.join(", ")
    );
    schema.insert(
        "x-kubernetes-validations".into(),
        serde_json::json!([{"rule": rule, "message": message}]),
    );
    if let Some(name) = schema
        .get_mut("items")
        .and_then(|i| i.get_mut("properties"))
        .and_then(|p| p.get_mut("name"))
        .and_then(|n| n.as_object_mut())
    {
        name.insert("maxLength".into(), serde_json::json!(256));
    }
}

/// Quantizer images of a GPUProfile.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProfileQuantization {
    /// Image per format (`GPTQ`, `AWQ`, `GGUF`, `EXL2`, `FP8`, `COMPRESSED_TENSORS`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.all(k, k in ['GGUF', 'AWQ', 'GPTQ', 'EXL2', 'FP8', 'COMPRESSED_TENSORS'])",
         "message": "spec.quantization.images keys must be formats: GGUF, AWQ, GPTQ, EXL2, FP8, COMPRESSED_TENSORS"}
    ]))]
    #[schemars(extend("maxProperties" = 16, "additionalProperties" = {"type": "string", "maxLength": 512}))]
    pub images: BTreeMap<String, String>,
    /// Pull policy of quantizer images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,
}

/// Serving images of a GPUProfile.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProfileRuntime {
    /// Image per backend (`vllm`, `llamacpp`, `ollama`, `exllamav2`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self.all(k, k in ['vllm', 'llamacpp', 'ollama', 'exllamav2'])",
         "message": "spec.runtime.images keys must be backends: vllm, llamacpp, ollama, exllamav2"}
    ]))]
    #[schemars(extend("maxProperties" = 16, "additionalProperties" = {"type": "string", "maxLength": 512}))]
    pub images: BTreeMap<String, String>,
}

/// Image pull policy.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum PullPolicy {
    Always,
    IfNotPresent,
    Never,
}

impl PullPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::Always => "Always",
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Never => "Never",
        }
    }
}

/// Observed state of a GPUProfile.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GPUProfileStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

impl GPUProfileSpec {
    /// GPU resource name with the vendor default applied.
    pub fn effective_resource_name(&self) -> String {
        self.resource_name
            .clone()
            .unwrap_or_else(|| self.vendor.default_resource_name().to_string())
    }

    /// Node selector with the `flexinfer.ai/gpu.arch` default applied.
    pub fn effective_node_selector(&self) -> BTreeMap<String, String> {
        self.node_selector.clone().unwrap_or_else(|| {
            BTreeMap::from([(
                crate::contract::labels::GPU_ARCH.to_string(),
                self.architecture.clone(),
            )])
        })
    }
}
