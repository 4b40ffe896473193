//! Pure rendering of a Model into its Deployment and Service (docs/dev/architecture.md, "The Model controller").
//!
//! `render` takes the Model and what the reconciler looked up (the referenced ModelCache and
//! GPUProfile, `None` when not found) and returns the children, or the configuration problem
//! that stops the Model from being deployed.

use std::collections::BTreeMap;

use flexinfer_api::contract::{env, labels, serving};
use flexinfer_api::formats;
use flexinfer_api::gpuprofile::GpuVendor;
use flexinfer_api::model::{Backend, GpuVendorChoice, ModelQuantization};
use flexinfer_api::modelcache::{CachePhase, QuantFormat, StorageStrategy};
use flexinfer_api::{GPUProfile, Model, ModelCache};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{EnvVar, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube_core::ResourceExt;

use super::backends::{self, Artifact};
use super::images;
pub use super::problem::{CachedState, ConfigProblem};
use super::source::{parse_cache_path, parse_source, Source};
use crate::modelcache::{node_jobs, nodelocal};

mod objects;
use objects::{
    deployment, merge_env, network_policy, pod_template, resources, service, serving_home_env,
};

/// Controller-level rendering settings.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderConfig {
    /// Serving image per backend from `FLEXINFER_RUNTIME_IMAGE_<BACKEND>`.
    pub runtime_images: BTreeMap<String, String>,
    /// `FLEXINFER_LLAMACPP_IMAGE`: FlexInfer's llama.cpp image (`<repository>:<tag>`, CPU flavor);
    /// `None`: [`super::images::LLAMACPP_REPOSITORY`] at the controller's version.
    pub llamacpp_image: Option<String>,
    /// `FLEXINFER_LLAMACPP_IMAGE_DIGESTS`: digest per llama.cpp flavor (`cpu`, `rocm`, `vulkan`).
    pub llamacpp_digests: BTreeMap<String, String>,
    /// Longest idle time of a gated canary (`FLEXINFER_CANARY_MAX_IDLE_SECONDS`; `None`:
    /// [`super::gate::DEFAULT_CANARY_MAX_IDLE`]).
    pub canary_max_idle: Option<std::time::Duration>,
    /// `FLEXINFER_GPU_SUPPLEMENTAL_GROUPS`: supplemental groups of serving pods that request a GPU.
    pub gpu_supplemental_groups: Vec<i64>,
    /// `FLEXINFER_PROXY_NAMESPACE` + `FLEXINFER_PROXY_POD_LABELS`: the proxy pods that alone may reach
    /// serving pods (each Model gets a NetworkPolicy); `None`: no policy.
    pub proxy_peer: Option<ProxyPeer>,
    /// `FLEXINFER_NODE_LOCAL_ROOT`: the nodes' directory of NodeLocal copies (`None`: the default).
    pub node_local_root: Option<String>,
}

/// Where flexinfer-proxy runs: the one peer a Model's NetworkPolicy admits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyPeer {
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
}

/// Why a `key=value,…` label list does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelsError {
    #[error("{0:?} is not key=value")]
    NotKeyValue(String),
    #[error("{0:?} is not a valid label")]
    InvalidLabel(String),
    #[error("expected key=value pairs separated by commas")]
    Empty,
}

/// `key=value,key=value` (label keys and values as Kubernetes allows them, at least one pair).
fn parse_labels(s: &str) -> Result<BTreeMap<String, String>, LabelsError> {
    let mut out = BTreeMap::new();
    for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| LabelsError::NotKeyValue(pair.to_string()))?;
        let (k, v) = (k.trim(), v.trim());
        let key_ok = !k.is_empty()
            && k.len() <= 253
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
        let value_ok = v.len() <= 63
            && v.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !key_ok || !value_ok {
            return Err(LabelsError::InvalidLabel(pair.to_string()));
        }
        out.insert(k.to_string(), v.to_string());
    }
    if out.is_empty() {
        return Err(LabelsError::Empty);
    }
    Ok(out)
}

impl RenderConfig {
    /// Read `FLEXINFER_RUNTIME_IMAGE_<BACKEND>` for every backend, the canary idle cap and the GPU
    /// groups; a set value that does not parse is an error naming the variable.
    pub fn from_env() -> Result<Self, crate::settings::SettingError> {
        Self::from_settings(&crate::settings::process_env())
    }

    pub fn from_settings<F: Fn(&str) -> Option<String>>(
        s: &crate::settings::Settings<F>,
    ) -> Result<Self, crate::settings::SettingError> {
        let runtime_images = ALL_BACKENDS
            .iter()
            .filter_map(|b| {
                s.text(&env::controller::runtime_image(b.as_str()))
                    .map(|v| (b.as_str().to_string(), v))
            })
            .collect();
        Ok(Self {
            runtime_images,
            llamacpp_image: s.text(env::controller::LLAMACPP_IMAGE),
            llamacpp_digests: s
                .parsed(
                    env::controller::LLAMACPP_IMAGE_DIGESTS,
                    parse_flavor_digests,
                )?
                .unwrap_or_default(),
            canary_max_idle: s.positive_seconds(
                env::controller::CANARY_MAX_IDLE_SECONDS,
                std::time::Duration::from_secs(7 * 86_400),
            )?,
            gpu_supplemental_groups: s
                .parsed(
                    env::controller::GPU_SUPPLEMENTAL_GROUPS,
                    crate::pod_security::parse_groups,
                )?
                .unwrap_or_default(),
            proxy_peer: match (
                s.text(env::controller::PROXY_NAMESPACE),
                s.parsed(env::controller::PROXY_POD_LABELS, parse_labels)?,
            ) {
                (Some(namespace), Some(labels)) => Some(ProxyPeer { namespace, labels }),
                _ => None,
            },
            node_local_root: s.parsed(
                env::controller::NODE_LOCAL_ROOT,
                crate::modelcache::config::parse_node_local_root,
            )?,
        })
    }

    /// The nodes' directory of NodeLocal copies in force.
    pub fn node_local_root(&self) -> &str {
        self.node_local_root
            .as_deref()
            .unwrap_or(env::controller::NODE_LOCAL_ROOT_DEFAULT)
    }

    /// FlexInfer's llama.cpp image in force (`<repository>:<tag>`, the CPU flavor).
    pub fn llamacpp_image(&self) -> String {
        self.llamacpp_image
            .clone()
            .unwrap_or_else(|| format!("{}:{}", super::images::LLAMACPP_REPOSITORY, crate::VERSION))
    }

    /// `image` pinned by its flavor's digest when it is one of FlexInfer's llama.cpp images in force
    /// (`<llamacpp_image>`, `-rocm`, `-vulkan`) and that flavor has one; any other image as it is.
    pub fn pin_llamacpp(&self, image: String) -> String {
        let flavor = match image.strip_prefix(self.llamacpp_image().as_str()) {
            Some("") => "cpu",
            Some("-rocm") => "rocm",
            Some("-vulkan") => "vulkan",
            _ => return image,
        };
        match self.llamacpp_digests.get(flavor) {
            Some(digest) => format!("{image}@{digest}"),
            None => image,
        }
    }

    /// The canary idle cap in force.
    pub fn canary_max_idle(&self) -> std::time::Duration {
        self.canary_max_idle
            .unwrap_or(super::gate::DEFAULT_CANARY_MAX_IDLE)
    }
}

pub const ALL_BACKENDS: [Backend; 4] = [
    Backend::Vllm,
    Backend::Llamacpp,
    Backend::Ollama,
    Backend::Exllamav2,
];

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
    /// Admits only flexinfer-proxy to the serving pods (with [`RenderConfig::proxy_peer`]).
    pub network_policy: Option<NetworkPolicy>,
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
    if spec.backend_key_secret_ref.is_some() && !spec.backend.takes_api_key() {
        return Err(ConfigProblem::BackendKeyUnsupported {
            field: serving::BACKEND_KEY_FIELD,
            backend: spec.backend.as_str(),
            supported: ALL_BACKENDS
                .iter()
                .filter(|b| b.takes_api_key())
                .map(|b| b.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let source = parse_source(&spec.source).map_err(|e| ConfigProblem::InvalidSource(e.0))?;
    let cache = match &source {
        Source::Cache { name } => match cache {
            Some(c) if c.name_any() == *name => Some(c),
            _ => None,
        },
        _ => None,
    };
    let format = resolve_format(model, &source, cache)?;
    let gpu = gpu_settings(model, profile)?;
    let (artifact, served_path, cached) = artifact(model, &source, cache, config)?;

    let image = images::resolve(
        spec.backend,
        &gpu.target,
        images::Named {
            model: spec.image.as_deref(),
            profile: gpu.image.as_deref(),
            controller: config
                .runtime_images
                .get(spec.backend.as_str())
                .map(String::as_str),
        },
        &config.llamacpp_image(),
        &spec.config.extra_args,
    )?
    .image;
    let image = config.pin_llamacpp(image);

    let mut container = backends::container(model, &artifact, &image);
    // Env: the writable home, then the profile env, then the backend's (later names win, no
    // duplicates).
    let backend_env = container.env.take().unwrap_or_default();
    container.env = Some(merge_env(
        serving_home_env()
            .into_iter()
            .chain(gpu.env.iter().cloned())
            .chain(backend_env),
    ));
    container.resources = Some(resources(model, &gpu));
    container.security_context = Some(crate::pod_security::container_context());

    let groups = if spec.gpu.count > 0 {
        crate::pod_security::gpu_groups(&config.gpu_supplemental_groups, &gpu.supplemental_groups)
    } else {
        Vec::new()
    };
    let mut node_selector = gpu.node_selector;
    if let Some((key, value)) = cache.and_then(node_copy_label) {
        // Only nodes whose copy of the published digest is verified.
        node_selector.insert(key, value);
    }
    let pod = pod_template(
        model,
        container,
        &artifact,
        node_selector,
        &served_path,
        &groups,
        gpu.runtime_class_name,
    );
    Ok(Rendered {
        deployment: deployment(model, pod),
        service: service(model),
        network_policy: config
            .proxy_peer
            .as_ref()
            .map(|peer| network_policy(model, peer)),
        served_path,
        cached,
        format,
    })
}

/// Artifact format from the Model first, then the referenced cache, checked against the backend.
fn resolve_format(
    model: &Model,
    source: &Source,
    cache: Option<&ModelCache>,
) -> Result<Option<QuantFormat>, ConfigProblem> {
    let spec = &model.spec;
    let declared = spec.config.quantization.and_then(model_format);
    if let Some(f) = declared {
        check_compat(f, spec.backend)?;
    }
    if let (Source::Cache { name }, None) = (source, cache) {
        return Err(ConfigProblem::CacheNotFound(name.clone()));
    }
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
    Ok(format)
}

/// What the GPUProfile (or the explicit vendor) contributes to the pod.
struct GpuSettings {
    resource_name: String,
    node_selector: BTreeMap<String, String>,
    env: Vec<EnvVar>,
    image: Option<String>,
    /// `(request, limit)` of container memory in MiB.
    memory: Option<(i64, i64)>,
    /// Vendor, architecture and profile, for the image choice.
    target: images::GpuTarget,
    runtime_class_name: Option<String>,
    supplemental_groups: Vec<i64>,
}

fn gpu_settings(model: &Model, profile: Option<&GPUProfile>) -> Result<GpuSettings, ConfigProblem> {
    let not_found = |m: String| Err(ConfigProblem::GpuProfileNotFound(m));
    match (profile_ref(model), profile) {
        (ProfileRef::Named(_) | ProfileRef::Arch(_) | ProfileRef::Any, Some(profile)) => {
            let p = &profile.spec;
            // A profile created before its CRD refused them: the serving pod would get variables
            // FlexInfer sets itself (a backend key among them).
            let protected: Vec<&str> = p
                .env
                .iter()
                .map(|e| e.name.as_str())
                .filter(|n| env::protected_from_profiles(n))
                .collect();
            if !protected.is_empty() {
                return Err(ConfigProblem::Invalid(format!(
                    "GPUProfile {} sets {} in spec.env, which FlexInfer sets itself (a backend key comes only \
                     from the Model's spec.backendKeySecretRef); remove it from the profile",
                    profile.name_any(),
                    protected.join(", ")
                )));
            }
            let arch = match p.vendor {
                GpuVendor::Amd => images::rocm_target(&p.architecture, &p.env),
                GpuVendor::Nvidia => p.architecture.clone(),
            };
            Ok(GpuSettings {
                target: images::GpuTarget {
                    vendor: Some(p.vendor),
                    arch: Some(arch),
                    profile: Some(profile.name_any()),
                },
                runtime_class_name: p.runtime_class_name.clone().filter(|r| !r.is_empty()),
                supplemental_groups: p.supplemental_groups.clone(),
                resource_name: p.effective_resource_name(),
                node_selector: p.effective_node_selector(),
                env: p.env.clone(),
                image: p
                    .runtime
                    .as_ref()
                    .and_then(|r| r.images.get(model.spec.backend.as_str()).cloned()),
                memory: p.container_memory_gb.map(|gb| {
                    let request = i64::from(gb).saturating_mul(1024);
                    (
                        request,
                        request.saturating_add(p.gpu_driver_memory_mb.unwrap_or(0)),
                    )
                }),
            })
        }
        (ProfileRef::Named(n), None) => {
            not_found(format!("GPUProfile {n} (spec.gpu.profile) not found"))
        }
        (ProfileRef::Arch(a), None) => not_found(format!(
            "no GPUProfile with spec.architecture {a} (from nodeSelector {})",
            labels::GPU_ARCH
        )),
        (ProfileRef::Any, None) => not_found(format!(
            "no GPUProfile to use: set spec.gpu.profile, a {} nodeSelector or spec.gpu.vendor \
                 (with gpu.vendor auto the namespace must hold exactly one GPUProfile)",
            labels::GPU_ARCH
        )),
        (ProfileRef::None(vendor), _) => Ok(GpuSettings {
            target: images::GpuTarget {
                vendor: Some(vendor),
                arch: None,
                profile: None,
            },
            runtime_class_name: None,
            supplemental_groups: Vec::new(),
            resource_name: vendor.default_resource_name().to_string(),
            node_selector: BTreeMap::new(),
            env: Vec::new(),
            image: None,
            memory: None,
        }),
    }
}

/// The node label that marks a verified copy of a NodeLocal cache's published digest, `None` for any
/// other cache (or before a digest is known).
fn node_copy_label(cache: &ModelCache) -> Option<(String, String)> {
    if cache.spec.storage_strategy != StorageStrategy::NodeLocal {
        return None;
    }
    let digest = cache
        .status
        .as_ref()?
        .node_local
        .as_ref()?
        .digest
        .as_deref()?;
    let value = nodelocal::label_value(digest)?;
    let (ns, name) = (cache.namespace()?, cache.name_any());
    Some((nodelocal::label_key(&ns, &name), value))
}

/// A NodeLocal cache's artifact: the nodes' verified copy of its published digest (the whole copy,
/// or its `.gguf` file when the cache's path names one).
fn node_copy_artifact(
    cache: &ModelCache,
    config: &RenderConfig,
) -> Result<(Artifact, Option<String>, CachedState), ConfigProblem> {
    let name = cache.name_any();
    let st = cache.status.as_ref();
    let digest = st
        .and_then(|s| s.node_local.as_ref())
        .and_then(|n| n.digest.clone());
    let Some(digest) = digest else {
        let phase = st
            .and_then(|s| s.phase)
            .map(|p| p.as_str())
            .unwrap_or("Pending");
        return Err(ConfigProblem::CacheNotReady {
            name,
            phase: format!(
                "{phase} (storageStrategy NodeLocal: no published digest for its nodes yet)"
            ),
        });
    };
    let ns = cache.namespace().unwrap_or_default();
    let dir =
        node_jobs::copy_dir(config.node_local_root(), &ns, &name, &digest).ok_or_else(|| {
            ConfigProblem::CachePathInvalid(format!(
                "ModelCache {name}: status.nodeLocal.digest {digest:?} is not sha256:<64 hex>"
            ))
        })?;
    let file = st
        .and_then(|s| s.path.as_deref())
        .and_then(|p| p.rsplit('/').next())
        .filter(|f| f.ends_with(".gguf"))
        .unwrap_or("")
        .to_string();
    Ok((
        Artifact::Volume {
            claim: String::new(),
            sub_path: file,
            host_dir: Some(dir.clone()),
        },
        Some(dir),
        CachedState::CacheReady { name },
    ))
}

/// The artifact to mount (or download), the served path and the `Cached` state.
fn artifact(
    model: &Model,
    source: &Source,
    cache: Option<&ModelCache>,
    config: &RenderConfig,
) -> Result<(Artifact, Option<String>, CachedState), ConfigProblem> {
    match source {
        Source::Pvc { claim, path } => Ok((
            Artifact::Volume {
                claim: claim.clone(),
                sub_path: path.clone(),
                host_dir: None,
            },
            Some(format!("{claim}:{path}")),
            CachedState::Pvc,
        )),
        Source::Hub { repo } => {
            if model.spec.backend == Backend::Exllamav2 {
                return Err(ConfigProblem::SourceUnsupported(format!(
                    "backend exllamav2 cannot download {repo}; use a pvc:// or modelcache:// source"
                )));
            }
            Ok((
                Artifact::Hub { repo: repo.clone() },
                None,
                CachedState::NotApplicable,
            ))
        }
        Source::Cache { name } => {
            let cache = cache.ok_or_else(|| ConfigProblem::CacheNotFound(name.clone()))?;
            if cache.spec.storage_strategy == StorageStrategy::NodeLocal {
                return node_copy_artifact(cache, config);
            }
            let (path, state) = cache_artifact(model, name, cache)?;
            let (claim, sub_path) =
                parse_cache_path(&path).map_err(|e| ConfigProblem::CachePathInvalid(e.0))?;
            Ok((
                Artifact::Volume {
                    claim,
                    sub_path,
                    host_dir: None,
                },
                Some(path),
                state,
            ))
        }
    }
}

/// The path served from a ModelCache: its Ready path, else the previously served one.
fn cache_artifact(
    model: &Model,
    name: &str,
    cache: &ModelCache,
) -> Result<(String, CachedState), ConfigProblem> {
    let status = cache.status.as_ref();
    let phase = status.and_then(|s| s.phase);
    let ready = phase == Some(CachePhase::Ready);
    let cache_path = status
        .and_then(|s| s.path.clone())
        .filter(|p| !p.is_empty());
    let previous = model.status.as_ref().and_then(|s| s.served_path.clone());
    let phase_s = phase.map(|p| p.as_str()).unwrap_or("Pending").to_string();
    let name = name.to_string();
    match (ready, cache_path, previous) {
        (true, Some(p), _) => Ok((p, CachedState::CacheReady { name })),
        (true, None, _) => Err(ConfigProblem::CachePathInvalid(format!(
            "ModelCache {name} is Ready but has no status.path"
        ))),
        (false, _, Some(prev)) => Ok((
            prev,
            CachedState::ServingPrevious {
                name,
                phase: phase_s,
            },
        )),
        (false, _, None) => Err(ConfigProblem::CacheNotReady {
            name,
            phase: phase_s,
        }),
    }
}

/// Why a `FLEXINFER_LLAMACPP_IMAGE_DIGESTS` value does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlavorDigestsError {
    #[error("`{0}` is not flavor=sha256:<64 hex>")]
    NotPair(String),
    #[error("unknown llama.cpp flavor `{0}` (cpu, rocm, vulkan)")]
    UnknownFlavor(String),
    #[error("`{digest}` of {flavor} is not sha256:<64 lowercase hex>")]
    BadDigest { flavor: String, digest: String },
    #[error("flavor `{0}` given twice")]
    Twice(String),
}

/// `FLEXINFER_LLAMACPP_IMAGE_DIGESTS`: `flavor=sha256:<64 hex>` pairs separated by commas, each flavor
/// (`cpu`, `rocm`, `vulkan`) at most once.
pub fn parse_flavor_digests(value: &str) -> Result<BTreeMap<String, String>, FlavorDigestsError> {
    let mut out = BTreeMap::new();
    for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (flavor, digest) = part
            .split_once('=')
            .ok_or_else(|| FlavorDigestsError::NotPair(part.to_string()))?;
        let (flavor, digest) = (flavor.trim(), digest.trim());
        if !matches!(flavor, "cpu" | "rocm" | "vulkan") {
            return Err(FlavorDigestsError::UnknownFlavor(flavor.to_string()));
        }
        let hex = digest.strip_prefix("sha256:").unwrap_or("");
        if hex.len() != 64
            || !hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(FlavorDigestsError::BadDigest {
                flavor: flavor.to_string(),
                digest: digest.to_string(),
            });
        }
        if out.insert(flavor.to_string(), digest.to_string()).is_some() {
            return Err(FlavorDigestsError::Twice(flavor.to_string()));
        }
    }
    Ok(out)
}
