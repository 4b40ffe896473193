//! Pure rendering of a Model into its Deployment and Service (docs/dev/architecture.md §4).
//!
//! `render` takes the Model and what the reconciler looked up (the referenced ModelCache and
//! GPUProfile, `None` when not found) and returns the children, or the configuration problem
//! that stops the Model from being deployed.

use std::collections::BTreeMap;

use flexinfer_api::contract::{annotations, env, labels, serving};
use flexinfer_api::formats;
use flexinfer_api::gpuprofile::GpuVendor;
use flexinfer_api::model::{Backend, GpuVendorChoice, ModelQuantization};
use flexinfer_api::modelcache::{CachePhase, QuantFormat};
use flexinfer_api::{GPUProfile, Model, ModelCache};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::{Resource, ResourceExt};
use serde_json::{json, Value};

use super::backends::{self, Artifact};
pub use super::problem::{CachedState, ConfigProblem};
use super::source::{parse_cache_path, parse_source, Source};

/// Controller-level rendering settings.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderConfig {
    /// Serving image per backend from `FLEXINFER_RUNTIME_IMAGE_<BACKEND>`.
    pub runtime_images: BTreeMap<String, String>,
}

impl RenderConfig {
    /// Read `FLEXINFER_RUNTIME_IMAGE_<BACKEND>` for every backend.
    pub fn from_env() -> Self {
        let runtime_images = ALL_BACKENDS
            .iter()
            .filter_map(|b| {
                std::env::var(env::controller::runtime_image(b.as_str()))
                    .ok()
                    .filter(|v| !v.trim().is_empty())
                    .map(|v| (b.as_str().to_string(), v.trim().to_string()))
            })
            .collect();
        Self { runtime_images }
    }
}

pub const ALL_BACKENDS: [Backend; 4] = [
    Backend::Vllm,
    Backend::Llamacpp,
    Backend::Ollama,
    Backend::Exllamav2,
];

/// Public default image of each backend (last step of the image resolution).
pub fn default_image(backend: Backend) -> &'static str {
    match backend {
        Backend::Vllm => "docker.io/vllm/vllm-openai:v0.11.0",
        Backend::Llamacpp => "ghcr.io/ggml-org/llama.cpp:server",
        Backend::Ollama => "docker.io/ollama/ollama:0.12.6",
        Backend::Exllamav2 => "ghcr.io/theroyallab/tabbyapi:latest",
    }
}

/// The children of a Model.
#[derive(Debug, Clone)]
pub struct Rendered {
    /// Deployment without `spec.replicas` (the reconciler sets it from the replica policy).
    pub deployment: Deployment,
    pub service: Service,
    /// `<pvc>:<subdir>` (or hub id) the Deployment serves.
    pub served_path: Option<String>,
    pub cached: CachedState,
    /// Artifact format, when known.
    pub format: Option<QuantFormat>,
}

/// How the reconciler should find the GPUProfile of a Model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProfileRef {
    /// `spec.gpu.profile`.
    Named(String),
    /// The profile whose `architecture` matches the `flexinfer.ai/gpu.arch` node selector.
    Arch(String),
    /// No profile wanted: `spec.gpu.vendor` is given explicitly.
    None(GpuVendor),
    /// `vendor: auto` and nothing else: the namespace's only GPUProfile.
    Any,
}

/// Which GPUProfile a Model refers to.
pub fn profile_ref(model: &Model) -> ProfileRef {
    if let Some(p) = model.spec.gpu.profile.as_ref().filter(|p| !p.is_empty()) {
        return ProfileRef::Named(p.clone());
    }
    if let Some(arch) = model
        .spec
        .node_selector
        .as_ref()
        .and_then(|s| s.get(labels::GPU_ARCH))
    {
        return ProfileRef::Arch(arch.clone());
    }
    match model.spec.gpu.vendor {
        GpuVendorChoice::Amd => ProfileRef::None(GpuVendor::Amd),
        GpuVendorChoice::Nvidia => ProfileRef::None(GpuVendor::Nvidia),
        GpuVendorChoice::Auto => ProfileRef::Any,
    }
}

/// Name of the ModelCache a Model serves from, if any.
pub fn cache_name(model: &Model) -> Option<String> {
    match parse_source(&model.spec.source) {
        Ok(Source::Cache { name }) => Some(name),
        _ => None,
    }
}

/// Endpoint of a Model's Service.
pub fn endpoint(name: &str, namespace: &str) -> String {
    format!("http://{name}.{namespace}.svc:{}/v1", serving::PORT)
}

/// Labels of the serving pods.
pub fn child_labels(model: &Model) -> BTreeMap<String, String> {
    child_label_builder(model).build()
}

/// Labels of the Deployment and Service: the pod labels plus `app.kubernetes.io/version`.
pub fn object_labels(model: &Model) -> BTreeMap<String, String> {
    child_label_builder(model).version(crate::VERSION).build()
}

fn child_label_builder(model: &Model) -> labels::Recommended {
    let name = model.name_any();
    labels::Recommended::new()
        .name(model.spec.backend.as_str())
        .instance(&name)
        .component(serving::COMPONENT)
        .with(labels::MODEL, name)
}

/// Pod selector of the Deployment and Service (immutable: never depends on the backend).
pub fn selector(model: &Model) -> BTreeMap<String, String> {
    let name = model.name_any();
    BTreeMap::from([
        (labels::INSTANCE.to_string(), name.clone()),
        (labels::MODEL.to_string(), name),
    ])
}

fn model_format(q: ModelQuantization) -> Option<QuantFormat> {
    match q {
        ModelQuantization::None => None,
        ModelQuantization::Gptq => Some(QuantFormat::Gptq),
        ModelQuantization::Awq => Some(QuantFormat::Awq),
        ModelQuantization::Gguf => Some(QuantFormat::Gguf),
        ModelQuantization::Fp8 => Some(QuantFormat::Fp8),
        ModelQuantization::Exl2 => Some(QuantFormat::Exl2),
        ModelQuantization::CompressedTensors => Some(QuantFormat::CompressedTensors),
    }
}

fn check_compat(format: QuantFormat, backend: Backend) -> Result<(), ConfigProblem> {
    if formats::backend_supports(format, backend) {
        return Ok(());
    }
    let info = formats::info(format);
    Err(ConfigProblem::BackendUnsupported {
        format: info.name,
        backend: backend.as_str(),
        supported: info
            .backends
            .iter()
            .map(|b| b.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

fn is_dns1035(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.starts_with(|c: char| c.is_ascii_lowercase())
        && s.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// Render a Model's Deployment and Service.
pub fn render(
    model: &Model,
    cache: Option<&ModelCache>,
    profile: Option<&GPUProfile>,
    config: &RenderConfig,
) -> Result<Rendered, ConfigProblem> {
    let spec = &model.spec;
    let name = model.name_any();
    if !is_dns1035(&name) {
        return Err(ConfigProblem::InvalidName(name));
    }
    let source = parse_source(&spec.source).map_err(|e| ConfigProblem::InvalidSource(e.0))?;

    // Format and backend compatibility, from the Model first, then the referenced cache.
    let declared = spec.config.quantization.and_then(model_format);
    if let Some(f) = declared {
        check_compat(f, spec.backend)?;
    }
    let cache = match &source {
        Source::Cache { name } => match cache {
            Some(c) if c.name_any() == *name => Some(c),
            _ => return Err(ConfigProblem::CacheNotFound(name.clone())),
        },
        _ => None,
    };
    let cache_format = cache.and_then(|c| c.spec.quantization.as_ref().map(|q| q.format));
    if let (Some(m), Some(c), Some(cache)) = (declared, cache_format, cache) {
        if m != c {
            return Err(ConfigProblem::QuantizationMismatch {
                model: formats::info(m).model_name,
                cache: formats::info(c).name,
                cache_name: cache.name_any(),
            });
        }
    }
    let format = declared.or(cache_format);
    if let Some(f) = format {
        check_compat(f, spec.backend)?;
    }

    // GPU resource name, node selector and env from the GPUProfile.
    let (resource_name, profile_selector, profile_env, profile_image, memory) =
        match (profile_ref(model), profile) {
            (ProfileRef::Named(_) | ProfileRef::Arch(_) | ProfileRef::Any, Some(p)) => (
                p.spec.effective_resource_name(),
                p.spec.effective_node_selector(),
                p.spec.env.clone(),
                p.spec
                    .runtime
                    .as_ref()
                    .and_then(|r| r.images.get(spec.backend.as_str()).cloned()),
                p.spec.container_memory_gb.map(|gb| {
                    (
                        i64::from(gb) * 1024,
                        i64::from(gb) * 1024 + p.spec.gpu_driver_memory_mb.unwrap_or(0),
                    )
                }),
            ),
            (ProfileRef::Named(n), None) => {
                return Err(ConfigProblem::GpuProfileNotFound(format!(
                    "GPUProfile {n} (spec.gpu.profile) not found"
                )))
            }
            (ProfileRef::Arch(a), None) => {
                return Err(ConfigProblem::GpuProfileNotFound(format!(
                    "no GPUProfile with spec.architecture {a} (from nodeSelector {})",
                    labels::GPU_ARCH
                )))
            }
            (ProfileRef::Any, None) => {
                return Err(ConfigProblem::GpuProfileNotFound(format!(
                "no GPUProfile to use: set spec.gpu.profile, a {} nodeSelector or spec.gpu.vendor \
                     (with gpu.vendor auto the namespace must hold exactly one GPUProfile)",
                labels::GPU_ARCH
            )))
            }
            (ProfileRef::None(vendor), _) => (
                vendor.default_resource_name().to_string(),
                BTreeMap::new(),
                Vec::new(),
                None,
                None,
            ),
        };

    // The artifact.
    let (artifact, served_path, cached) = match &source {
        Source::Pvc { claim, path } => (
            Artifact::Volume {
                claim: claim.clone(),
                sub_path: path.clone(),
            },
            Some(format!("{claim}:{path}")),
            CachedState::Pvc,
        ),
        Source::Hub { repo } => {
            if spec.backend == Backend::Exllamav2 {
                return Err(ConfigProblem::SourceUnsupported(format!(
                    "backend exllamav2 cannot download {repo}; use a pvc:// or modelcache:// source"
                )));
            }
            (
                Artifact::Hub { repo: repo.clone() },
                None,
                CachedState::NotApplicable,
            )
        }
        Source::Cache { name } => {
            let cache = cache.ok_or_else(|| ConfigProblem::CacheNotFound(name.clone()))?;
            let status = cache.status.as_ref();
            let phase = status.and_then(|s| s.phase);
            let ready = phase == Some(CachePhase::Ready);
            let cache_path = status
                .and_then(|s| s.path.clone())
                .filter(|p| !p.is_empty());
            let previous = model.status.as_ref().and_then(|s| s.served_path.clone());
            let phase_s = phase.map(|p| p.as_str()).unwrap_or("Pending").to_string();
            let (path, state) = match (ready, cache_path, previous) {
                (true, Some(p), _) => (p, CachedState::CacheReady { name: name.clone() }),
                (true, None, _) => {
                    return Err(ConfigProblem::CachePathInvalid(format!(
                        "ModelCache {name} is Ready but has no status.path"
                    )))
                }
                (false, _, Some(prev)) => (
                    prev,
                    CachedState::ServingPrevious {
                        name: name.clone(),
                        phase: phase_s,
                    },
                ),
                (false, _, None) => {
                    return Err(ConfigProblem::CacheNotReady {
                        name: name.clone(),
                        phase: phase_s,
                    })
                }
            };
            let (claim, sub_path) =
                parse_cache_path(&path).map_err(|e| ConfigProblem::CachePathInvalid(e.0))?;
            (Artifact::Volume { claim, sub_path }, Some(path), state)
        }
    };

    let image = spec
        .image
        .clone()
        .filter(|i| !i.is_empty())
        .or(profile_image)
        .or_else(|| config.runtime_images.get(spec.backend.as_str()).cloned())
        .unwrap_or_else(|| default_image(spec.backend).to_string());

    let container = backends::container(model, &artifact, format, &image)?;
    let mut container = container;

    // Env: profile env, then the backend's (later names win, no duplicates).
    let mut env: Vec<Value> = Vec::new();
    let mut push_env = |v: Value| {
        let key = v.get("name").cloned();
        env.retain(|e| e.get("name") != key.as_ref());
        env.push(v);
    };
    for e in &profile_env {
        push_env(serde_json::to_value(e).map_err(|e| ConfigProblem::Invalid(e.to_string()))?);
    }
    if let Some(Value::Array(items)) = container.get("env").cloned() {
        for v in items {
            push_env(v);
        }
    }
    container["env"] = Value::Array(env);

    // Resources: the Model's, plus the GPUs, plus the profile's memory default.
    let mut resources = match &spec.resources {
        Some(r) => serde_json::to_value(r).map_err(|e| ConfigProblem::Invalid(e.to_string()))?,
        None => json!({}),
    };
    for key in ["limits", "requests"] {
        if !resources.get(key).is_some_and(Value::is_object) {
            resources[key] = json!({});
        }
        resources[key][&resource_name] = json!(spec.gpu.count.to_string());
    }
    if let Some((request_mi, limit_mi)) = memory {
        if resources["limits"].get("memory").is_none()
            && resources["requests"].get("memory").is_none()
        {
            resources["requests"]["memory"] = json!(format!("{request_mi}Mi"));
            resources["limits"]["memory"] = json!(format!("{limit_mi}Mi"));
        }
    }
    container["resources"] = resources;

    let mut node_selector = profile_selector;
    for (k, v) in spec.node_selector.iter().flatten() {
        node_selector.insert(k.clone(), v.clone());
    }

    let mut tolerations: Vec<Value> = Vec::new();
    for t in spec.tolerations.iter().flatten() {
        tolerations
            .push(serde_json::to_value(t).map_err(|e| ConfigProblem::Invalid(e.to_string()))?);
    }
    let gpu_toleration = json!({
        "key": flexinfer_api::contract::controller::GPU_TOLERATION_KEY,
        "operator": "Equal",
        "value": flexinfer_api::contract::controller::GPU_TOLERATION_VALUE,
        "effect": flexinfer_api::contract::controller::GPU_TOLERATION_EFFECT,
    });
    if !tolerations.contains(&gpu_toleration) {
        tolerations.push(gpu_toleration);
    }

    let mut pod_annotations = BTreeMap::from([(
        annotations::GPU_PRIORITY.to_string(),
        spec.gpu.priority.to_string(),
    )]);
    if let Some(p) = &served_path {
        pod_annotations.insert(annotations::SERVED_PATH.to_string(), p.clone());
    }
    if let Some(g) = &spec.gpu.shared {
        pod_annotations.insert(annotations::GPU_SHARED_GROUP.to_string(), g.clone());
    }

    let mut volumes = vec![json!({"name": "dshm", "emptyDir": {"medium": "Memory"}})];
    if let Artifact::Volume { claim, .. } = &artifact {
        volumes.push(json!({
            "name": "model",
            "persistentVolumeClaim": {"claimName": claim, "readOnly": true}
        }));
    }

    let owner = model
        .controller_owner_ref(&())
        .into_iter()
        .collect::<Vec<_>>();
    let ns = model.namespace();
    let child_labels = child_labels(model);
    let object_labels = object_labels(model);
    let selector = selector(model);
    let deployment = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": object_labels,
            "ownerReferences": owner,
        },
        "spec": {
            "selector": {"matchLabels": selector},
            // GPUs are exclusive: a surge pod could never be scheduled next to the old one.
            "strategy": {"type": "Recreate"},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": child_labels, "annotations": pod_annotations},
                "spec": {
                    "containers": [container],
                    "volumes": volumes,
                    "nodeSelector": node_selector,
                    "tolerations": tolerations,
                    "enableServiceLinks": false,
                    "automountServiceAccountToken": false,
                    "terminationGracePeriodSeconds": 30,
                }
            }
        }
    });
    let service = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": object_labels,
            "ownerReferences": owner,
        },
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{
                "name": serving::PORT_NAME,
                "port": serving::PORT,
                "targetPort": serving::PORT_NAME,
                "protocol": "TCP",
            }]
        }
    });
    let deployment: Deployment =
        serde_json::from_value(deployment).map_err(|e| ConfigProblem::Invalid(e.to_string()))?;
    let service: Service =
        serde_json::from_value(service).map_err(|e| ConfigProblem::Invalid(e.to_string()))?;
    Ok(Rendered {
        deployment,
        service,
        served_path,
        cached,
        format,
    })
}
