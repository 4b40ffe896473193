//! The pipeline Job as the watch store keeps it: the fields `observe_job` and the expectations read,
//! nothing else. A `k8s_openapi` `Job` costs about 9 KB in memory even pruned (its pod template and
//! container are wide structs); at thousands of caches (three Jobs each) that was most of the
//! controller's memory. This type deserializes only what is kept (≈1–2 KB) and turns back into a
//! `Job` for the planner.

use k8s_openapi::api::batch::v1::{Job, JobSpec, JobStatus};
use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, PodSpec, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::{Metadata, NamespaceResourceScope, Resource};
use serde::{Deserialize, Serialize};

use flexinfer_api::contract;

/// A Job, reduced (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct StoredJob {
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<StoredJobSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<JobStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredJobSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_deadline_seconds: Option<i64>,
    #[serde(default)]
    pub template: StoredTemplate,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct StoredTemplate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<StoredPodSpec>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct StoredPodSpec {
    #[serde(default)]
    pub containers: Vec<StoredContainer>,
}

/// The worker container: its name, image and `OUT_DIR` (the only env variable kept).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct StoredContainer {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Only `OUT_DIR`: the other variables are skipped while the watch event is read.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "out_dir_only"
    )]
    pub env: Option<Vec<EnvVar>>,
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
    /// Drop what the store does not need: managed fields, every container but the first (env was
    /// already reduced to `OUT_DIR` when read).
    pub fn prune(&mut self) {
        self.metadata.managed_fields = None;
        if let Some(pod) = self.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
            pod.containers.truncate(1);
            pod.containers.shrink_to_fit();
            for c in &mut pod.containers {
                if let Some(env) = c.env.as_mut() {
                    env.retain(|e| e.name == contract::env::OUT_DIR);
                    env.shrink_to_fit();
                }
            }
        }
    }

    /// The Job the planner reads (the same fields `observe::prune_job` keeps).
    pub fn to_job(&self) -> Job {
        Job {
            metadata: self.metadata.clone(),
            spec: self.spec.as_ref().map(|s| JobSpec {
                active_deadline_seconds: s.active_deadline_seconds,
                template: PodTemplateSpec {
                    metadata: None,
                    spec: s.template.spec.as_ref().map(|p| PodSpec {
                        containers: p
                            .containers
                            .iter()
                            .map(|c| Container {
                                name: c.name.clone(),
                                image: c.image.clone(),
                                env: c.env.clone(),
                                ..Default::default()
                            })
                            .collect(),
                        ..Default::default()
                    }),
                },
                ..Default::default()
            }),
            status: self.status.clone(),
        }
    }
}

/// A pipeline pod as the pod store keeps it: metadata and the status `observe_pod` reads (no pod spec:
/// a `k8s_openapi` `Pod` holds its wide spec struct inline even when it is empty).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct StoredPod {
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<k8s_openapi::api::core::v1::PodStatus>,
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
    /// Keep what `observe::prune_pod` keeps.
    pub fn prune(&mut self) {
        let mut pod = self.to_pod();
        super::observe::prune_pod(&mut pod);
        self.metadata = pod.metadata;
        self.status = pod.status;
    }

    /// The pod the planner reads.
    pub fn to_pod(&self) -> Pod {
        Pod {
            metadata: self.metadata.clone(),
            spec: None,
            status: self.status.clone(),
        }
    }
}
