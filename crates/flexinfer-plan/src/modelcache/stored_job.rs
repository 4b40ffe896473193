//! Pipeline Jobs and pods as the watch stores keep them: the fields `observe_job`, the ownership
//! check and the expectations read, as plain values, nothing else. A `k8s_openapi` `Job` costs about
//! 9 KB in memory even pruned (its pod template and container are wide structs), a pruned `Pod` 8 KB;
//! at thousands of caches (three Jobs and three pods each) that was most of the controller's memory.
//! These types deserialize only what is kept and turn back into a `Job` / `Pod` for the planner.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobCondition, JobSpec, JobStatus};
use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus,
    EnvVar, Pod, PodCondition, PodSpec, PodStatus, PodTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::{Metadata, NamespaceResourceScope, Resource};
use serde::Deserialize;

use flexinfer_api::contract;

/// The label the Job controller puts on a Job's pods.
pub const JOB_NAME_LABEL: &str = "batch.kubernetes.io/job-name";
/// The same label as Kubernetes before 1.27 spelled it.
pub const LEGACY_JOB_NAME_LABEL: &str = "job-name";

/// A Job, reduced (see the module docs): the metadata that identifies it, and the fields of its
/// labels, annotations, spec and status that a reader looks at, as plain values (a label or
/// annotation map of its own would cost a tree node of ~0.5 KB per Job).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(from = "WireJob")]
pub struct StoredJob {
    /// Name, namespace, uid, resourceVersion, creation and deletion time, and the owner references:
    /// the controller maps each Job event to its cache through them.
    pub metadata: ObjectMeta,
    /// The `flexinfer.ai/cache` label.
    cache: Option<String>,
    /// The `flexinfer.ai/phase` label.
    phase: Option<String>,
    /// The spec-hash annotation.
    spec_hash: Option<String>,
    /// `spec.activeDeadlineSeconds`.
    deadline: Option<i64>,
    /// The worker container's name, image and `OUT_DIR` value.
    container: Option<(String, Option<String>, Option<String>)>,
    /// `status.startTime`.
    start_time: Option<Time>,
    /// Which of [`JOB_CONDITIONS`] hold (`status: "True"`), one bit each in that order: a finished
    /// Job's two conditions as `JobCondition`s were ~0.4 KB per Job.
    holds: u8,
    /// A failure condition's reason and message (`Failed`, else `FailureTarget`), the only condition
    /// text a reader looks at.
    failure: Option<Box<(Option<String>, Option<String>)>>,
    /// Whether the Job had a status at all.
    has_status: bool,
}

/// The condition types of a Job that a reader asks about (and only whether they hold).
const JOB_CONDITIONS: [&str; 4] = ["Complete", "SuccessCriteriaMet", "Failed", "FailureTarget"];

/// The Job as the watch reads it: only the worker container's `OUT_DIR` of the pod template is
/// parsed; the rest is converted into [`StoredJob`] at once.
#[derive(Deserialize)]
struct WireJob {
    metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<StoredJobSpec>,
    #[serde(default)]
    status: Option<JobStatus>,
}

impl From<WireJob> for StoredJob {
    fn from(w: WireJob) -> Self {
        let mut meta = w.metadata;
        let mut labels = meta.labels.take().unwrap_or_default();
        let mut annotations = meta.annotations.take().unwrap_or_default();
        let owners = meta.owner_references.take();
        let (deadline, container) = match w.spec {
            Some(s) => (
                s.active_deadline_seconds,
                s.template
                    .spec
                    .and_then(|p| p.containers.into_iter().next())
                    .map(|c| {
                        let out_dir = c
                            .env
                            .unwrap_or_default()
                            .into_iter()
                            .find(|e| e.name == contract::env::OUT_DIR)
                            .and_then(|e| e.value);
                        (c.name, c.image, out_dir)
                    }),
            ),
            None => (None, None),
        };
        let has_status = w.status.is_some();
        let (mut holds, mut failure) = (0u8, None);
        let start_time = match w.status {
            Some(st) => {
                for c in st.conditions.unwrap_or_default() {
                    let Some(bit) = JOB_CONDITIONS.iter().position(|t| *t == c.type_) else {
                        continue;
                    };
                    if c.status != "True" {
                        continue;
                    }
                    holds |= 1 << bit;
                    // Only a failure's reason and message are read; `Failed` wins over `FailureTarget`.
                    if c.type_ == "Failed" || (c.type_ == "FailureTarget" && failure.is_none()) {
                        failure = Some(Box::new((c.reason, c.message)));
                    }
                }
                st.start_time
            }
            None => None,
        };
        let mut metadata = identity(meta);
        metadata.owner_references = owners;
        StoredJob {
            metadata,
            cache: labels.remove(contract::labels::CACHE),
            phase: labels.remove(contract::labels::PHASE),
            spec_hash: annotations.remove(contract::annotations::JOB_SPEC_HASH),
            deadline,
            container,
            start_time,
            holds,
            failure,
            has_status,
        }
    }
}

/// Of an object's metadata, what identifies it: name, namespace, uid, resourceVersion (the watch
/// reads it; the stores drop it afterwards), creation and deletion time.
fn identity(m: ObjectMeta) -> ObjectMeta {
    ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        creation_timestamp: m.creation_timestamp,
        deletion_timestamp: m.deletion_timestamp,
        ..Default::default()
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StoredJobSpec {
    #[serde(default)]
    active_deadline_seconds: Option<i64>,
    #[serde(default)]
    template: StoredTemplate,
}

#[derive(Default, Deserialize)]
struct StoredTemplate {
    #[serde(default)]
    spec: Option<StoredPodSpec>,
}

#[derive(Deserialize)]
struct StoredPodSpec {
    #[serde(default)]
    containers: Vec<StoredContainer>,
}

/// A container of the pod template: its name, image and `OUT_DIR` (the other variables are skipped
/// while the watch event is read).
#[derive(Deserialize)]
struct StoredContainer {
    #[serde(default)]
    name: String,
    #[serde(default)]
    image: Option<String>,
    #[serde(default, deserialize_with = "out_dir_only")]
    env: Option<Vec<EnvVar>>,
}

/// The env list, keeping only `OUT_DIR` (each other entry is read and dropped at once, so the full
/// list is never held).
fn out_dir_only<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<EnvVar>>, D::Error> {
    struct Keep;
    impl<'de> serde::de::Visitor<'de> for Keep {
        type Value = Option<Vec<EnvVar>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a list of env variables or null")
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D2: serde::Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            d.deserialize_seq(Keep)
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut kept = Vec::new();
            while let Some(e) = seq.next_element::<EnvVar>()? {
                if e.name == contract::env::OUT_DIR {
                    kept.push(e);
                }
            }
            Ok(Some(kept))
        }
    }
    d.deserialize_option(Keep)
}

impl Resource for StoredJob {
    const API_VERSION: &'static str = Job::API_VERSION;
    const GROUP: &'static str = Job::GROUP;
    const KIND: &'static str = Job::KIND;
    const VERSION: &'static str = Job::VERSION;
    const URL_PATH_SEGMENT: &'static str = Job::URL_PATH_SEGMENT;
    type Scope = NamespaceResourceScope;
}

impl Metadata for StoredJob {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl StoredJob {
    /// The conditions that hold, in [`JOB_CONDITIONS`] order, with a failure's reason and message.
    fn conditions(&self) -> Vec<JobCondition> {
        JOB_CONDITIONS
            .iter()
            .enumerate()
            .filter(|(bit, _)| self.holds & (1 << bit) != 0)
            .map(|(_, t)| {
                let failed = matches!(*t, "Failed" | "FailureTarget");
                let (reason, message) = match (&self.failure, failed) {
                    (Some(f), true) => (f.0.clone(), f.1.clone()),
                    _ => (None, None),
                };
                JobCondition {
                    type_: t.to_string(),
                    status: "True".to_string(),
                    reason,
                    message,
                    ..Default::default()
                }
            })
            .collect()
    }

    /// The `flexinfer.ai/cache` and `flexinfer.ai/phase` labels and the spec-hash annotation.
    pub fn cache_phase_hash(&self) -> (Option<&str>, Option<&str>, Option<&str>) {
        (
            self.cache.as_deref(),
            self.phase.as_deref(),
            self.spec_hash.as_deref(),
        )
    }

    /// The Job the planner reads: what `observe::prune_job` keeps of a Job, less the conditions
    /// that do not hold and the labels and annotations nobody reads.
    pub fn to_job(&self) -> Job {
        let mut metadata = self.metadata.clone();
        let labels: BTreeMap<String, String> = [
            (contract::labels::CACHE, &self.cache),
            (contract::labels::PHASE, &self.phase),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_string(), v.clone()?)))
        .collect();
        metadata.labels = (!labels.is_empty()).then_some(labels);
        metadata.annotations = self.spec_hash.as_ref().map(|h| {
            BTreeMap::from([(contract::annotations::JOB_SPEC_HASH.to_string(), h.clone())])
        });
        Job {
            metadata,
            spec: Some(JobSpec {
                active_deadline_seconds: self.deadline,
                template: PodTemplateSpec {
                    metadata: None,
                    spec: self
                        .container
                        .as_ref()
                        .map(|(name, image, out_dir)| PodSpec {
                            containers: vec![Container {
                                name: name.clone(),
                                image: image.clone(),
                                env: out_dir.as_ref().map(|v| {
                                    vec![EnvVar {
                                        name: contract::env::OUT_DIR.to_string(),
                                        value: Some(v.clone()),
                                        value_from: None,
                                    }]
                                }),
                                ..Default::default()
                            }],
                            ..Default::default()
                        }),
                },
                ..Default::default()
            }),
            status: self.has_status.then(|| JobStatus {
                start_time: self.start_time.clone(),
                conditions: (self.holds != 0).then(|| self.conditions()),
                ..Default::default()
            }),
        }
    }
}

/// A pipeline pod as the pod store keeps it: its identity, its Job, and the status fields
/// `observe_pod` reads (phase, a `PodScheduled` condition that does not hold, the first container's
/// termination and waiting reason), as plain values (no pod spec, label map or status struct).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(from = "WirePod")]
pub struct StoredPod {
    /// Name, namespace, uid, resourceVersion, creation and deletion time; nothing else.
    pub metadata: ObjectMeta,
    /// The Job it belongs to (the Job controller's job-name label).
    job: Option<String>,
    /// `status.phase`.
    phase: Option<String>,
    /// The `PodScheduled` condition while it does not hold (its times dropped).
    not_scheduled: Option<Box<PodCondition>>,
    /// The first container, when the pod has container statuses.
    container: Option<Box<StoredContainerStatus>>,
    /// Whether the pod had a status at all.
    has_status: bool,
}

/// Of the first container's status, what `observe_pod` reads.
#[derive(Clone, Debug, Default, PartialEq)]
struct StoredContainerStatus {
    name: String,
    /// The termination it reads: of the current state, else of the last state (`true`).
    terminated: Option<(bool, ContainerStateTerminated)>,
    /// The current state's waiting reason and message.
    waiting: Option<ContainerStateWaiting>,
}

/// The pod as the watch reads it: the spec is skipped, the status converted at once.
#[derive(Deserialize)]
struct WirePod {
    metadata: ObjectMeta,
    #[serde(default)]
    status: Option<PodStatus>,
}

impl From<ContainerStatus> for StoredContainerStatus {
    fn from(c: ContainerStatus) -> Self {
        let lean = |t: ContainerStateTerminated| ContainerStateTerminated {
            container_id: None,
            started_at: None,
            finished_at: None,
            ..t
        };
        let (current, last) = (
            c.state.unwrap_or_default(),
            c.last_state.unwrap_or_default(),
        );
        let terminated = match (current.terminated, last.terminated) {
            (Some(t), _) => Some((false, lean(t))),
            (None, Some(t)) => Some((true, lean(t))),
            (None, None) => None,
        };
        StoredContainerStatus {
            name: c.name,
            terminated,
            waiting: current.waiting,
        }
    }
}

impl StoredContainerStatus {
    fn to_status(&self) -> ContainerStatus {
        let (mut state, mut last) = (ContainerState::default(), None);
        match &self.terminated {
            Some((false, t)) => state.terminated = Some(t.clone()),
            Some((true, t)) => {
                last = Some(ContainerState {
                    terminated: Some(t.clone()),
                    ..Default::default()
                })
            }
            None => {}
        }
        state.waiting = self.waiting.clone();
        ContainerStatus {
            name: self.name.clone(),
            state: Some(state),
            last_state: last,
            ..Default::default()
        }
    }
}

impl From<WirePod> for StoredPod {
    fn from(w: WirePod) -> Self {
        let mut meta = w.metadata;
        let job = meta.labels.take().and_then(|mut l| {
            l.remove(JOB_NAME_LABEL)
                .or_else(|| l.remove(LEGACY_JOB_NAME_LABEL))
        });
        let has_status = w.status.is_some();
        let st = w.status.unwrap_or_default();
        let not_scheduled = st
            .conditions
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "PodScheduled")
            .filter(|c| c.status != "True")
            .map(|c| {
                Box::new(PodCondition {
                    last_probe_time: None,
                    last_transition_time: None,
                    ..c
                })
            });
        let container = st
            .container_statuses
            .and_then(|cs| cs.into_iter().next())
            .map(|c| Box::new(StoredContainerStatus::from(c)));
        StoredPod {
            metadata: identity(meta),
            job,
            phase: st.phase,
            not_scheduled,
            container,
            has_status,
        }
    }
}

impl Resource for StoredPod {
    const API_VERSION: &'static str = Pod::API_VERSION;
    const GROUP: &'static str = Pod::GROUP;
    const KIND: &'static str = Pod::KIND;
    const VERSION: &'static str = Pod::VERSION;
    const URL_PATH_SEGMENT: &'static str = Pod::URL_PATH_SEGMENT;
    type Scope = NamespaceResourceScope;
}

impl Metadata for StoredPod {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl StoredPod {
    /// The Job this pod belongs to.
    pub fn job_name(&self) -> Option<String> {
        self.job.clone()
    }

    /// Whether the pod ended with success (`status.phase: Succeeded`).
    pub fn succeeded(&self) -> bool {
        self.phase.as_deref() == Some("Succeeded")
    }

    /// The pod the planner reads: what `observe_pod` looks at, nothing else.
    pub fn to_pod(&self) -> Pod {
        let mut metadata = self.metadata.clone();
        metadata.labels = self
            .job
            .as_ref()
            .map(|j| BTreeMap::from([(JOB_NAME_LABEL.to_string(), j.clone())]));
        Pod {
            metadata,
            spec: None,
            status: self.has_status.then(|| PodStatus {
                phase: self.phase.clone(),
                conditions: self.not_scheduled.as_ref().map(|c| vec![(**c).clone()]),
                container_statuses: self.container.as_ref().map(|c| vec![c.to_status()]),
                ..Default::default()
            }),
        }
    }
}
