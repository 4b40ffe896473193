//! The typed children of a rendered Model: the pod template (env, resources, tolerations, volumes), the
//! Deployment, the Service and the NetworkPolicy.

use std::collections::BTreeMap;

use flexinfer_api::contract::{annotations, serving};
use flexinfer_api::Model;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy};
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, EnvVar, HostPathVolumeSource,
    PersistentVolumeClaimVolumeSource, PodSpec, PodTemplateSpec, ResourceRequirements, Service,
    ServicePort, ServiceSpec, Toleration, Volume,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_core::{Resource, ResourceExt};

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};

use super::{child_labels, object_labels, selector, Artifact, GpuSettings, ProxyPeer};

/// Later variables replace earlier ones of the same name (the replacement goes last).
/// The serving pod runs as a user that the image's `/etc/passwd` may not know, so its `HOME`
/// would be `/`, which it cannot write: backends keep caches under `$HOME/.cache` (vLLM's compile
/// cache, the hub cache of hub-sourced Models, Ollama's `~/.ollama`). `HOME` is the pod's own
/// writable scratch volume instead; a profile or backend env may still set it.
pub(super) fn serving_home_env() -> Vec<EnvVar> {
    vec![EnvVar {
        name: "HOME".into(),
        value: Some(serving::HOME.into()),
        value_from: None,
    }]
}

pub(super) fn merge_env(vars: impl IntoIterator<Item = EnvVar>) -> Vec<EnvVar> {
    let mut env: Vec<EnvVar> = Vec::new();
    for v in vars {
        env.retain(|e| e.name != v.name);
        env.push(v);
    }
    env
}

/// Resources: the Model's, plus the GPUs, plus the profile's memory default.
pub(super) fn resources(model: &Model, gpu: &GpuSettings) -> ResourceRequirements {
    let spec = &model.spec;
    let mut r = spec.resources.clone().unwrap_or_default();
    let count = Quantity(spec.gpu.count.to_string());
    let limits = r.limits.get_or_insert_with(BTreeMap::new);
    limits.insert(gpu.resource_name.clone(), count.clone());
    let requests = r.requests.get_or_insert_with(BTreeMap::new);
    requests.insert(gpu.resource_name.clone(), count);
    if let Some((request_mi, limit_mi)) = gpu.memory {
        let has = |m: &Option<BTreeMap<String, Quantity>>| {
            m.as_ref().is_some_and(|m| m.contains_key("memory"))
        };
        if !has(&r.limits) && !has(&r.requests) {
            let (limits, requests) = (
                r.limits.get_or_insert_with(BTreeMap::new),
                r.requests.get_or_insert_with(BTreeMap::new),
            );
            requests.insert("memory".into(), Quantity(format!("{request_mi}Mi")));
            limits.insert("memory".into(), Quantity(format!("{limit_mi}Mi")));
        }
    }
    r
}

/// The Model's tolerations plus the GPU node toleration (once).
fn tolerations(model: &Model) -> Vec<Toleration> {
    use flexinfer_api::contract::controller::{
        GPU_TOLERATION_EFFECT, GPU_TOLERATION_KEY, GPU_TOLERATION_VALUE,
    };
    let mut tolerations: Vec<Toleration> = model.spec.tolerations.clone().unwrap_or_default();
    let gpu = Toleration {
        key: Some(GPU_TOLERATION_KEY.to_string()),
        operator: Some("Equal".into()),
        value: Some(GPU_TOLERATION_VALUE.to_string()),
        effect: Some(GPU_TOLERATION_EFFECT.to_string()),
        toleration_seconds: None,
    };
    if !tolerations.contains(&gpu) {
        tolerations.push(gpu);
    }
    tolerations
}

pub(super) fn pod_template(
    model: &Model,
    container: Container,
    artifact: &Artifact,
    profile_selector: BTreeMap<String, String>,
    served_path: &Option<String>,
    supplemental_groups: &[i64],
    runtime_class_name: Option<String>,
) -> PodTemplateSpec {
    let spec = &model.spec;
    let mut annotations = BTreeMap::from([(
        annotations::GPU_PRIORITY.to_string(),
        spec.gpu.priority.to_string(),
    )]);
    if let Some(p) = served_path {
        annotations.insert(annotations::SERVED_PATH.to_string(), p.clone());
    }
    if let Some(g) = &spec.gpu.shared {
        annotations.insert(annotations::GPU_SHARED_GROUP.to_string(), g.clone());
    }
    let mut volumes = vec![
        Volume {
            name: "dshm".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: None,
            }),
            ..Default::default()
        },
        Volume {
            name: serving::HOME_VOLUME.into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        },
    ];
    match artifact {
        Artifact::Volume {
            host_dir: Some(dir),
            ..
        } => volumes.push(Volume {
            name: "model".into(),
            // The node's verified copy (`storageStrategy: NodeLocal`): the node selector below puts the
            // pod only where the copy's label says it is complete.
            host_path: Some(HostPathVolumeSource {
                path: dir.clone(),
                type_: Some("Directory".into()),
            }),
            ..Default::default()
        }),
        Artifact::Volume { claim, .. } => volumes.push(Volume {
            name: "model".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.clone(),
                read_only: Some(true),
            }),
            ..Default::default()
        }),
        Artifact::Hub { .. } => {}
    }
    let mut node_selector = profile_selector;
    for (k, v) in spec.node_selector.iter().flatten() {
        node_selector.insert(k.clone(), v.clone());
    }
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(child_labels(model)),
            annotations: Some(annotations),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            containers: vec![container],
            volumes: Some(volumes),
            node_selector: Some(node_selector),
            tolerations: Some(tolerations(model)),
            enable_service_links: Some(false),
            automount_service_account_token: Some(false),
            security_context: Some(crate::pod_security::pod_context(supplemental_groups)),
            runtime_class_name,
            termination_grace_period_seconds: Some(30),
            ..Default::default()
        }),
    }
}

/// Name, namespace, labels and controller reference shared by both children.
fn child_meta(model: &Model) -> ObjectMeta {
    ObjectMeta {
        name: Some(model.name_any()),
        namespace: model.namespace(),
        labels: Some(object_labels(model)),
        owner_references: Some(model.controller_owner_ref(&()).into_iter().collect()),
        ..Default::default()
    }
}

pub(super) fn deployment(model: &Model, template: PodTemplateSpec) -> Deployment {
    Deployment {
        metadata: child_meta(model),
        spec: Some(DeploymentSpec {
            selector: LabelSelector {
                match_labels: Some(selector(model)),
                match_expressions: None,
            },
            // GPUs are exclusive: a surge pod could never be scheduled next to the old one.
            strategy: Some(DeploymentStrategy {
                type_: Some("Recreate".into()),
                rolling_update: None,
            }),
            revision_history_limit: Some(3),
            template,
            ..Default::default()
        }),
        status: None,
    }
}

pub(super) fn service(model: &Model) -> Service {
    Service {
        metadata: child_meta(model),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(selector(model)),
            ports: Some(vec![ServicePort {
                name: Some(serving::PORT_NAME.to_string()),
                port: serving::PORT,
                target_port: Some(IntOrString::String(serving::PORT_NAME.to_string())),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

/// Ingress to the Model's serving pods only from the proxy pods (their namespace and labels), on the serving
/// port. Kubelet probes come from the node, which NetworkPolicy admits; the controller never connects.
pub(super) fn network_policy(model: &Model, peer: &ProxyPeer) -> NetworkPolicy {
    NetworkPolicy {
        metadata: child_meta(model),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(selector(model)),
                ..Default::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(vec![NetworkPolicyPeer {
                    namespace_selector: Some(LabelSelector {
                        match_labels: Some(BTreeMap::from([(
                            "kubernetes.io/metadata.name".to_string(),
                            peer.namespace.clone(),
                        )])),
                        ..Default::default()
                    }),
                    pod_selector: Some(LabelSelector {
                        match_labels: Some(peer.labels.clone()),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ports: Some(vec![NetworkPolicyPort {
                    port: Some(IntOrString::Int(serving::PORT)),
                    protocol: Some("TCP".into()),
                    ..Default::default()
                }]),
            }]),
            ..Default::default()
        }),
    }
}
