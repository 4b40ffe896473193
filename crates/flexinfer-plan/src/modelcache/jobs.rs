//! Pure builders of the pipeline Job and PVC objects (docs/dev/architecture.md, "The ModelCache pipeline"). What runs where
//! (GPUProfile, image, node selector) and the spec hashes live in `target` and are re-exported here.

use std::collections::BTreeMap;

use flexinfer_api::contract::{self, annotations, exit_codes, labels, JobPhase};
use flexinfer_api::modelcache::{defaults, ModelCache, ModelCacheStatus};
use k8s_openapi::api::batch::v1::{
    Job, JobSpec, PodFailurePolicy, PodFailurePolicyOnExitCodesRequirement, PodFailurePolicyRule,
};
use k8s_openapi::api::core::v1::{
    Container, EnvVar, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, PodSpec, PodTemplateSpec, ResourceRequirements, Toleration,
    Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube_core::Resource;

use super::config::Config;
pub use super::target::*;

mod worker_env;
pub(crate) use worker_env::{ev, secret_ev};

pub use worker_env::keep_dirs;
use worker_env::worker_env;

/// Name of the PVC the controller creates for a cache (when no `existingClaimName`).
pub fn created_claim_name(cache: &str) -> String {
    format!("{cache}-cache")
}

/// PVC the cache uses.
pub fn claim_name(mc: &ModelCache) -> String {
    mc.spec
        .existing_claim_name
        .clone()
        .unwrap_or_else(|| created_claim_name(&mc.name_any_str()))
}

trait NameStr {
    fn name_any_str(&self) -> String;
}
impl NameStr for ModelCache {
    fn name_any_str(&self) -> String {
        self.metadata.name.clone().unwrap_or_default()
    }
}

fn cache_path(rel: &str) -> String {
    format!("{}/{}", contract::CACHE_MOUNT, rel)
}

fn phase_deadline(mc: &ModelCache, phase: JobPhase) -> i64 {
    let s = &mc.spec;
    match phase {
        JobPhase::Download => s
            .download
            .as_ref()
            .and_then(|d| d.timeout_seconds)
            .unwrap_or(defaults::DOWNLOAD_TIMEOUT_SECONDS),
        JobPhase::Abliterate => s
            .abliteration
            .as_ref()
            .map(|a| a.timeout_seconds)
            .unwrap_or(14400),
        JobPhase::Quantize => s
            .quantization
            .as_ref()
            .and_then(|q| q.timeout_seconds)
            .unwrap_or(defaults::QUANTIZE_TIMEOUT_SECONDS),
        JobPhase::Publish => s
            .publish
            .as_ref()
            .map(|p| p.timeout_seconds)
            .unwrap_or(7200),
    }
}

/// activeDeadlineSeconds of a phase's Job.
pub fn deadline_seconds(mc: &ModelCache, phase: JobPhase) -> i64 {
    phase_deadline(mc, phase)
}

fn phase_memory_gb(mc: &ModelCache, phase: JobPhase) -> i64 {
    let s = &mc.spec;
    match phase {
        JobPhase::Download | JobPhase::Publish => {
            s.download.as_ref().map(|d| d.max_memory_gb).unwrap_or(16) as i64
        }
        JobPhase::Abliterate => s
            .abliteration
            .as_ref()
            .map(|a| a.max_memory_gb)
            .unwrap_or(56) as i64,
        JobPhase::Quantize => s
            .quantization
            .as_ref()
            .map(|q| q.max_memory_gb)
            .unwrap_or(48) as i64,
    }
}

fn json_map_annotation(mc: &ModelCache, key: &str) -> BTreeMap<String, String> {
    mc.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .and_then(|v| serde_json::from_str::<BTreeMap<String, serde_json::Value>>(v).ok())
        .map(|m| {
            m.into_iter()
                .filter_map(|(k, v)| match v {
                    serde_json::Value::String(s) => Some((k, s)),
                    serde_json::Value::Number(n) => Some((k, n.to_string())),
                    serde_json::Value::Bool(b) => Some((k, b.to_string())),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether a pod-metadata annotation on the cache is malformed (for a clear condition).
pub fn invalid_pod_metadata_annotation(mc: &ModelCache) -> Option<String> {
    let ann = mc.metadata.annotations.as_ref()?;
    let mut keys = vec![
        annotations::JOB_POD_LABELS.to_string(),
        annotations::JOB_POD_ANNOTATIONS.to_string(),
    ];
    for p in JobPhase::ALL {
        keys.push(annotations::phase_pod_labels(p.as_str()));
        keys.push(annotations::phase_pod_annotations(p.as_str()));
    }
    keys.into_iter().find_map(|k| {
        let v = ann.get(&k)?;
        match serde_json::from_str::<BTreeMap<String, serde_json::Value>>(v) {
            Ok(m) if k.ends_with("-pod-annotations") => m
                .keys()
                .find(|a| is_security_annotation(a))
                .map(|a| {
                    format!(
                        "annotation {k} may not set {a}: AppArmor and seccomp profiles of pipeline pods are set by the controller"
                    )
                }),
            Ok(_) => None,
            Err(e) => Some(format!(
                "annotation {k} must be a JSON object of strings: {e}"
            )),
        }
    })
}

/// Pod annotations that change a pod's confinement (AppArmor, seccomp): never passed through from
/// a cache's annotations.
pub fn is_security_annotation(key: &str) -> bool {
    const PREFIXES: [&str; 4] = [
        "container.apparmor.security.beta.kubernetes.io/",
        "apparmor.security.beta.kubernetes.io/",
        "container.seccomp.security.alpha.kubernetes.io/",
        "seccomp.security.alpha.kubernetes.io/",
    ];
    let k = key.to_ascii_lowercase();
    PREFIXES.iter().any(|p| k.starts_with(p))
}

/// Labels every pipeline Job and its pods carry.
pub fn job_labels(cache: &str, phase: JobPhase) -> BTreeMap<String, String> {
    labels::Recommended::new()
        .name(labels::WORKER_NAME)
        .instance(cache)
        .component(phase.as_str())
        .with(labels::CACHE, cache)
        .with(labels::PHASE, phase.as_str())
        .build()
}

/// Object labels: the pod labels plus `app.kubernetes.io/version`.
fn with_version(mut l: BTreeMap<String, String>) -> BTreeMap<String, String> {
    l.insert(labels::VERSION.to_string(), crate::VERSION.to_string());
    l
}

fn owner_ref(mc: &ModelCache) -> Option<OwnerReference> {
    mc.controller_owner_ref(&())
}

/// Build the Job of one phase.
pub fn build_job(
    mc: &ModelCache,
    st: &ModelCacheStatus,
    served: &[String],
    t: &PhaseTarget,
    image: &str,
    hash: &str,
    config: &Config,
) -> Job {
    let cache = mc.metadata.name.clone().unwrap_or_default();
    let phase = t.phase;
    let name = phase.job_name(&cache);
    let labels = job_labels(&cache, phase);
    let (pod_labels, pod_ann) = pod_metadata(mc, phase, &labels);
    let (requests, limits) = worker_resources(mc, t);
    // A pod with a GPU resource gets the device nodes' groups (AMD: render, video) and its
    // GPUProfile's RuntimeClass (k3s + NVIDIA: `nvidia`).
    let gpu_pod = requests.keys().any(|k| k != "memory");
    let profile = t.profile.as_ref().map(|p| &p.spec).filter(|_| gpu_pod);
    let gpu_groups = if gpu_pod {
        crate::pod_security::gpu_groups(
            &config.gpu_supplemental_groups,
            profile
                .map(|p| p.supplemental_groups.as_slice())
                .unwrap_or_default(),
        )
    } else {
        Vec::new()
    };
    let runtime_class_name = profile
        .and_then(|p| p.runtime_class_name.clone())
        .filter(|r| !r.is_empty());

    let tolerations = job_tolerations(mc, t);
    let pull_policy = quantize_pull_policy(t);
    let mut job_annotations = BTreeMap::from([(
        contract::annotations::JOB_SPEC_HASH.to_string(),
        hash.to_string(),
    )]);
    if let Some(a) = &t.arch {
        job_annotations.insert(labels::GPU_ARCH.to_string(), a.clone());
    }
    Job {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: mc.metadata.namespace.clone(),
            labels: Some(with_version(labels)),
            annotations: Some(job_annotations),
            owner_references: owner_ref(mc).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(2),
            pod_failure_policy: Some(deterministic_failures(phase)),
            active_deadline_seconds: Some(phase_deadline(mc, phase)),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: (!pod_ann.is_empty()).then_some(pod_ann),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".into()),
                    service_account_name: Some(config.service_account.clone()),
                    automount_service_account_token: Some(false),
                    node_selector: (!t.node_selector.is_empty()).then(|| t.node_selector.clone()),
                    tolerations: (!tolerations.is_empty()).then_some(tolerations),
                    security_context: Some(crate::pod_security::pod_context(&gpu_groups)),
                    runtime_class_name,
                    containers: vec![worker_container(
                        image,
                        pull_policy,
                        phase,
                        worker_env(mc, st, served, t, config),
                        ResourceRequirements {
                            requests: Some(requests),
                            limits: Some(limits),
                            ..Default::default()
                        },
                    )],
                    volumes: Some(vec![cache_volume(mc)]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: None,
    }
}

/// The worker pod's labels and annotations: the cache's `JOB_POD_*` annotations, then the phase's,
/// with the Job's identity labels winning over user-supplied ones and security annotations dropped.
fn pod_metadata(
    mc: &ModelCache,
    phase: JobPhase,
    labels: &BTreeMap<String, String>,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let mut pod_labels = labels.clone();
    pod_labels.extend(json_map_annotation(mc, annotations::JOB_POD_LABELS));
    pod_labels.extend(json_map_annotation(
        mc,
        &annotations::phase_pod_labels(phase.as_str()),
    ));
    // Identity labels always win over user-supplied ones.
    pod_labels.extend(labels.clone());
    let mut pod_ann = json_map_annotation(mc, annotations::JOB_POD_ANNOTATIONS);
    pod_ann.extend(json_map_annotation(
        mc,
        &annotations::phase_pod_annotations(phase.as_str()),
    ));
    // Belt and braces: the planner refuses such a cache before any Job is built.
    pod_ann.retain(|k, _| !is_security_annotation(k));
    (pod_labels, pod_ann)
}

/// The worker container's requests and limits: the phase's memory (plus the GPU driver's share on
/// a GPU), and on a GPU one of the profile's device resource, requested as well as limited.
fn worker_resources(
    mc: &ModelCache,
    t: &PhaseTarget,
) -> (BTreeMap<String, Quantity>, BTreeMap<String, Quantity>) {
    let mut mem_mb = phase_memory_gb(mc, t.phase).saturating_mul(1024);
    let mut limits = BTreeMap::new();
    if t.gpu {
        if let Some(p) = &t.profile {
            mem_mb = mem_mb.saturating_add(p.spec.gpu_driver_memory_mb.unwrap_or(0));
            limits.insert(p.spec.effective_resource_name(), Quantity("1".into()));
        }
    }
    let mem = Quantity(format!("{mem_mb}Mi"));
    let mut requests = BTreeMap::from([("memory".to_string(), mem.clone())]);
    limits.insert("memory".to_string(), mem);
    if let Some(gpu) = limits
        .iter()
        .find(|(k, _)| k.as_str() != "memory")
        .map(|(k, v)| (k.clone(), v.clone()))
    {
        requests.insert(gpu.0, gpu.1);
    }
    (requests, limits)
}

/// The pod's tolerations: the GPU taint's when the phase is pinned to a GPU node, then the cache's
/// own (duplicates dropped).
fn job_tolerations(mc: &ModelCache, t: &PhaseTarget) -> Vec<Toleration> {
    let mut tolerations = Vec::new();
    if t.gpu_pinned {
        tolerations.push(Toleration {
            key: Some(contract::controller::GPU_TOLERATION_KEY.into()),
            operator: Some("Equal".into()),
            value: Some(contract::controller::GPU_TOLERATION_VALUE.into()),
            effect: Some(contract::controller::GPU_TOLERATION_EFFECT.into()),
            toleration_seconds: None,
        });
    }
    for tol in mc.spec.tolerations.clone().unwrap_or_default() {
        if !tolerations.contains(&tol) {
            tolerations.push(tol);
        }
    }
    tolerations
}

/// The image pull policy the GPU profile sets for quantization; none for other phases or on CPU.
fn quantize_pull_policy(t: &PhaseTarget) -> Option<String> {
    if t.gpu && t.phase == JobPhase::Quantize {
        t.profile
            .as_ref()
            .and_then(|p| p.spec.quantization.as_ref())
            .and_then(|q| q.image_pull_policy)
            .map(|p| p.as_str().to_string())
    } else {
        None
    }
}

/// The worker container: the image running the phase's subcommand with the cache volume mounted,
/// under the restricted security context.
fn worker_container(
    image: &str,
    pull_policy: Option<String>,
    phase: JobPhase,
    env: Vec<EnvVar>,
    resources: ResourceRequirements,
) -> Container {
    Container {
        name: phase.container_name().into(),
        image: Some(image.to_string()),
        image_pull_policy: pull_policy,
        args: Some(vec![phase.as_str().to_string()]),
        env: Some(env),
        resources: Some(resources),
        volume_mounts: Some(vec![VolumeMount {
            name: "cache".into(),
            mount_path: contract::CACHE_MOUNT.into(),
            ..Default::default()
        }]),
        security_context: Some(crate::pod_security::container_context()),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    }
}

/// The cache's claim, mounted read-write.
fn cache_volume(mc: &ModelCache) -> Volume {
    Volume {
        name: "cache".into(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: claim_name(mc),
            read_only: Some(false),
        }),
        ..Default::default()
    }
}

/// Exit codes 2 (bad input), 3 (quality gate) and 4 (version mismatch) are deterministic:
/// re-running the pod inside the same Job cannot help, so they fail the Job at once.
fn deterministic_failures(phase: JobPhase) -> PodFailurePolicy {
    PodFailurePolicy {
        rules: vec![PodFailurePolicyRule {
            action: "FailJob".into(),
            on_exit_codes: Some(PodFailurePolicyOnExitCodesRequirement {
                container_name: Some(phase.container_name().into()),
                operator: "In".into(),
                values: vec![
                    exit_codes::BAD_INPUT,
                    exit_codes::QUALITY_GATE,
                    exit_codes::VERSION_MISMATCH,
                ],
            }),
            on_pod_conditions: None,
        }],
    }
}

/// The PVC the controller creates for a cache without `existingClaimName`.
pub fn build_pvc(mc: &ModelCache) -> PersistentVolumeClaim {
    let cache = mc.metadata.name.clone().unwrap_or_default();
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(created_claim_name(&cache)),
            namespace: mc.metadata.namespace.clone(),
            labels: Some(
                labels::Recommended::new()
                    .version(crate::VERSION)
                    .with(labels::CACHE, &cache)
                    .build(),
            ),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![mc
                .spec
                .claim_access_mode
                .unwrap_or_default()
                .as_str()
                .to_string()]),
            storage_class_name: mc.spec.cluster_storage_class_name.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_string(),
                    mc.spec.storage_size.clone(),
                )])),
                limits: None,
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// Whether a trigger annotation is set to a true value.
pub fn annotation_true(mc: &ModelCache, key: &str) -> bool {
    mc.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .and_then(|v| contract::parse_bool(v))
        .unwrap_or(false)
}

/// The trigger annotations the controller consumes.
pub const TRIGGER_ANNOTATIONS: [&str; 4] = [
    annotations::REDOWNLOAD,
    annotations::REABLITERATE,
    annotations::REQUANTIZE,
    annotations::RESET_RETRIES,
];
