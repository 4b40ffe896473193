//! The objects of `storageStrategy: NodeLocal` (pure): where a copy lives on a node, the fill and
//! cleanup Jobs that [`super::nodelocal::plan_nodes`] starts (`flexinfer-worker node-copy`), the
//! tasks read back from those Jobs, and the status the plan gives.

use std::collections::BTreeMap;

use flexinfer_api::contract::{self, annotations, env, labels, phase, source};
use flexinfer_api::modelcache::{ModelCache, NodeCopyStatus, NodeLocalStatus};
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Affinity, Container, HostPathVolumeSource, NodeAffinity, NodeSelector, NodeSelectorRequirement,
    NodeSelectorTerm, PodSpec, PodTemplateSpec, ResourceRequirements, Toleration, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube_core::Resource;
use sha2::{Digest, Sha256};

use super::config::Config;
use super::jobs::{ev, secret_ev};
use super::nodelocal::{CopyPhase, NodePlan, Task, TaskKind, TaskState};
use super::observe::{job_state, JobState};

/// Where the node-copy container sees `<root>/<namespace>`.
const MOUNT: &str = "/node-local";
/// Name of the node-copy container (the worker subcommand's).
pub const CONTAINER: &str = phase::NODE_COPY_SUBCOMMAND;
/// Memory of a node-copy pod: files stream to disk in chunks.
const MEMORY: &str = "512Mi";

/// `<root>/<namespace>`: the host directory a node-copy pod mounts.
pub fn namespace_dir(root: &str, ns: &str) -> String {
    format!("{}/{ns}", root.trim_end_matches('/'))
}

/// `<root>/<namespace>/<cache>/<digest hex>`: the verified copy of `digest` on a node; `None` when
/// `digest` is not `sha256:<64 hex>`.
pub fn copy_dir(root: &str, ns: &str, cache: &str, digest: &str) -> Option<String> {
    super::nodelocal::label_value(digest)?;
    let hex = digest.strip_prefix("sha256:")?;
    Some(format!("{}/{cache}/{hex}", namespace_dir(root, ns)))
}

/// The reference a node copy is pulled from: `spec.publish.ociRef`'s repository at `digest`.
pub fn source_ref(oci_ref: &str, digest: &str) -> Option<String> {
    super::nodelocal::label_value(digest)?;
    let r = source::oci_reference(oci_ref);
    let (host, path) = r.split_once('/')?;
    let repo = match path.rsplit_once(':') {
        Some((repo, tag)) if !tag.contains('/') => repo,
        _ => path,
    };
    (!host.is_empty() && !repo.is_empty()).then(|| format!("{}{host}/{repo}@{digest}", source::OCI))
}

/// The digest in a task's annotation: the fill's, or the one a cleanup keeps (`""`: none).
fn kind_digest(kind: &TaskKind) -> (&'static str, String) {
    match kind {
        TaskKind::Fill { digest } => (labels::NODE_COPY_FILL, digest.clone()),
        TaskKind::Cleanup { keep } => (labels::NODE_COPY_CLEAN, keep.clone().unwrap_or_default()),
    }
}

/// The Job of one task: `<cache>-nc-<hash of node, kind, digest>`, at most 63 characters (the
/// Job controller puts the name in a pod label).
pub fn job_name(cache: &str, node: &str, kind: &TaskKind) -> String {
    let (k, d) = kind_digest(kind);
    let mut h = Sha256::new();
    for part in [node, k, &d] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    let hash = &hex::encode(h.finalize())[..12];
    // 63 = the 47 characters kept of the cache's name, `-nc-`, the 12 of the hash.
    let prefix: String = cache.chars().take(47).collect();
    format!("{}-nc-{hash}", prefix.trim_end_matches(['-', '.']))
}

/// The task a Job of this cache runs, `None` for any other Job (a pipeline phase's, or one whose
/// annotations are not ours).
pub fn task_of(job: &Job) -> Option<Task> {
    let l = job.metadata.labels.as_ref()?;
    let a = job.metadata.annotations.as_ref()?;
    let node = a.get(annotations::NODE_COPY_NODE)?.clone();
    let digest = a
        .get(annotations::NODE_COPY_DIGEST)
        .cloned()
        .unwrap_or_default();
    let kind = match l.get(labels::NODE_COPY)?.as_str() {
        labels::NODE_COPY_FILL if !digest.is_empty() => TaskKind::Fill { digest },
        labels::NODE_COPY_CLEAN => TaskKind::Cleanup {
            keep: (!digest.is_empty()).then_some(digest),
        },
        _ => return None,
    };
    let state = match job_state(job) {
        JobState::Succeeded => TaskState::Succeeded,
        JobState::Failed { reason, message } => TaskState::Failed {
            message: format!(
                "Job {} failed: {}",
                job.metadata.name.as_deref().unwrap_or(""),
                if message.is_empty() { reason } else { message }
            ),
        },
        JobState::Active => TaskState::Running,
    };
    Some(Task {
        node,
        kind,
        state,
        bytes: None,
        terminating: job.metadata.deletion_timestamp.is_some(),
    })
}

/// The Job that runs `kind` on `node`; `None` when the controller has no worker image or the cache
/// no publish reference (the planner's caller says so in the status).
pub fn build_job(mc: &ModelCache, node: &str, kind: &TaskKind, config: &Config) -> Option<Job> {
    let cache = mc.metadata.name.clone()?;
    let ns = mc.metadata.namespace.clone()?;
    let image = config.worker_image.clone()?;
    let publish = mc.spec.publish.as_ref()?;
    let (k, digest) = kind_digest(kind);
    let mut env = vec![
        ev(env::SCRIPT_VERSION, contract::SCRIPT_VERSION),
        ev(env::NODE_COPY_DIR, format!("{MOUNT}/{cache}")),
        ev(env::TELEMETRY, "true"),
    ];
    let args = match kind {
        TaskKind::Fill { digest } => {
            env.push(ev(
                env::SOURCE,
                source_ref(publish.oci_ref.as_deref()?, digest)?,
            ));
            env.push(ev(env::OCI_INSECURE, publish.insecure.to_string()));
            if let Some(sec) = publish.secret_ref.as_ref().or(mc.spec.secret_ref.as_ref()) {
                env.push(secret_ev(env::OCI_USERNAME, sec, env::OCI_USERNAME));
                env.push(secret_ev(env::OCI_PASSWORD, sec, env::OCI_PASSWORD));
            }
            vec![
                phase::NODE_COPY_SUBCOMMAND.to_string(),
                labels::NODE_COPY_FILL.to_string(),
            ]
        }
        TaskKind::Cleanup { keep } => {
            env.push(ev(env::NODE_COPY_KEEP, keep.clone().unwrap_or_default()));
            vec![
                phase::NODE_COPY_SUBCOMMAND.to_string(),
                labels::NODE_COPY_CLEAN.to_string(),
            ]
        }
    };
    let pod_labels = labels::Recommended::new()
        .name(labels::WORKER_NAME)
        .instance(&cache)
        .component(CONTAINER)
        .with(labels::CACHE, &cache)
        .with(labels::NODE_COPY, k)
        .build();
    let mut job_labels = pod_labels.clone();
    job_labels.insert(labels::VERSION.to_string(), crate::VERSION.to_string());
    let (pod_ctx, container_ctx) = crate::pod_security::node_copy_contexts();
    let mem = Quantity(MEMORY.into());
    Some(Job {
        metadata: ObjectMeta {
            name: Some(job_name(&cache, node, kind)),
            namespace: Some(ns.clone()),
            labels: Some(job_labels),
            annotations: Some(BTreeMap::from([
                (annotations::NODE_COPY_NODE.to_string(), node.to_string()),
                (annotations::NODE_COPY_DIGEST.to_string(), digest),
            ])),
            owner_references: mc.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(2),
            active_deadline_seconds: Some(publish.timeout_seconds),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".into()),
                    service_account_name: Some(config.service_account.clone()),
                    automount_service_account_token: Some(false),
                    // Exactly this node (through the scheduler, which accounts the pod's memory).
                    affinity: Some(Affinity {
                        node_affinity: Some(NodeAffinity {
                            required_during_scheduling_ignored_during_execution: Some(
                                NodeSelector {
                                    node_selector_terms: vec![NodeSelectorTerm {
                                        match_fields: Some(vec![NodeSelectorRequirement {
                                            key: "metadata.name".into(),
                                            operator: "In".into(),
                                            values: Some(vec![node.to_string()]),
                                        }]),
                                        match_expressions: None,
                                    }],
                                },
                            ),
                            preferred_during_scheduling_ignored_during_execution: None,
                        }),
                        ..Default::default()
                    }),
                    // The node was chosen by the cache's node selector: its taints (a GPU node's)
                    // do not keep its copy away.
                    tolerations: Some(vec![Toleration {
                        operator: Some("Exists".into()),
                        ..Default::default()
                    }]),
                    security_context: Some(pod_ctx),
                    containers: vec![Container {
                        name: CONTAINER.into(),
                        image: Some(image),
                        args: Some(args),
                        env: Some(env),
                        resources: Some(ResourceRequirements {
                            requests: Some(BTreeMap::from([("memory".into(), mem.clone())])),
                            limits: Some(BTreeMap::from([("memory".into(), mem)])),
                            ..Default::default()
                        }),
                        volume_mounts: Some(vec![VolumeMount {
                            name: "node-local".into(),
                            mount_path: MOUNT.into(),
                            ..Default::default()
                        }]),
                        security_context: Some(container_ctx),
                        termination_message_policy: Some("FallbackToLogsOnError".into()),
                        ..Default::default()
                    }],
                    volumes: Some(vec![Volume {
                        name: "node-local".into(),
                        host_path: Some(HostPathVolumeSource {
                            path: namespace_dir(&config.node_local_root, &ns),
                            type_: Some("DirectoryOrCreate".into()),
                        }),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: None,
    })
}

/// The status of the plan: the digest the nodes should hold, per node its copy.
pub fn status_of(plan: &NodePlan, want: Option<&str>, message: Option<String>) -> NodeLocalStatus {
    let phase = |p: CopyPhase| match p {
        CopyPhase::Pending => "Pending",
        CopyPhase::Filling => "Filling",
        CopyPhase::Ready => "Ready",
        CopyPhase::Failed => "Failed",
    };
    let message = message.or_else(|| {
        plan.no_matching_nodes.then(|| {
            "no schedulable node matches the node selector: no node gets a copy".to_string()
        })
    });
    NodeLocalStatus {
        digest: want.map(String::from),
        ready_nodes: i32::try_from(plan.ready_nodes).unwrap_or(i32::MAX),
        selected_nodes: i32::try_from(plan.nodes.len()).unwrap_or(i32::MAX),
        message,
        nodes: plan
            .nodes
            .iter()
            .map(|n| NodeCopyStatus {
                node: n.node.clone(),
                phase: phase(n.phase).to_string(),
                digest: n.digest.clone(),
                serving: n.serving.clone(),
                message: n.message.clone(),
            })
            .collect(),
    }
}
