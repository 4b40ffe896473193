//! The Model planner (docs/dev/architecture.md, "The Model controller"). Pure: no API calls, no clock reads.
//!
//! [`plan`] decides, from the Model and what the reconciler observed, the gate, the replicas and
//! which children to apply (or why none are applied: a configuration problem, or an existing
//! object of the same name that this Model does not control). The status depends on what the
//! API server answers to the apply (the Deployment's generation after the write), so the second
//! half of the plan, [`ModelPlan::conclude`], turns that rollout observation into the status,
//! the Events and the requeue interval.

use std::collections::BTreeMap;
use std::time::Duration;

use flexinfer_api::contract::labels;
use flexinfer_api::model::{ModelPhase, ModelStatus, DEFAULT_KEEPALIVE_INTERVAL};
use flexinfer_api::{GPUProfile, Model, ModelCache};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube_core::ResourceExt;

use super::gate::{self, GateDecision};
use super::render::{self, ConfigProblem, RenderConfig, Rendered};
use super::replicas::{self, ReplicaDecision};
use super::shared::{self, Lane};
use super::status::DeploymentObservation;

mod conclude;

/// An object of the Model's name that already exists: what the planner needs to know about it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Existing {
    pub owner_references: Vec<OwnerReference>,
}

impl Existing {
    pub fn of(meta: &ObjectMeta) -> Self {
        Self {
            owner_references: meta.owner_references.clone().unwrap_or_default(),
        }
    }
}

/// What the reconciler observed before planning.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// The referenced ModelCache (`modelcache://` sources), if found.
    pub cache: Option<ModelCache>,
    /// The GPUProfile the Model refers to, if found.
    pub profile: Option<GPUProfile>,
    /// The Deployment named like the Model, if one exists.
    pub deployment: Option<Existing>,
    /// The Service named like the Model, if one exists.
    pub service: Option<Existing>,
    /// The Model's shared GPU group, when `spec.gpu.shared` is set.
    pub shared: Option<SharedObservation>,
}

/// A shared GPU group as observed: the Models of the namespace with the same `gpu.shared` (this
/// one may be missing or stale: the planner uses the object it plans instead) and the replicas
/// each one's Deployment asks for or still has.
#[derive(Debug, Clone, Default)]
pub struct SharedObservation {
    pub models: Vec<Model>,
    /// Model name → max(Deployment spec.replicas, status.replicas).
    pub running: BTreeMap<String, i32>,
    /// How long a preempted Model may finish in-flight requests.
    pub grace: Duration,
}

/// This Model's lane in its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedLane {
    pub group: String,
    pub lane: Lane,
    pub priority: i32,
    /// Priority of the Model the lane is given to.
    pub active_priority: Option<i32>,
}

/// The decisions of one reconcile, before the apply.
#[derive(Debug, Clone)]
pub struct ModelPlan {
    pub gate: GateDecision,
    pub replicas: ReplicaDecision,
    /// The Model's place in its shared GPU group (already applied to `replicas`).
    pub shared: Option<SharedLane>,
    /// The children to apply (the Deployment with `spec.replicas` set), or why nothing is applied.
    pub children: Result<Rendered, ConfigProblem>,
}

/// The type of a Kubernetes Event (`Normal` or `Warning`); the reconciler turns it into kube's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// An Event to publish about the Model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedEvent {
    pub type_: EventType,
    pub reason: &'static str,
    /// The recorder folds events with the same (type, reason, action) into one series.
    pub action: String,
    pub note: String,
}

/// The decisions after the apply.
#[derive(Debug, Clone)]
pub struct Conclusion {
    pub phase: ModelPhase,
    pub previous: Option<ModelPhase>,
    /// The status to write; `None` when nothing the controller owns changed.
    pub status: Option<ModelStatus>,
    pub events: Vec<PlannedEvent>,
    pub requeue: Duration,
    /// The shared GPU group in which the Model was just preempted (counted in metrics).
    pub preempted_in: Option<String>,
}

/// Plan one reconcile of `model`.
pub fn plan(
    model: &Model,
    observed: &Observed,
    config: &RenderConfig,
    now: Timestamp,
) -> ModelPlan {
    let served = gate::served_artifact(observed.cache.as_ref());
    let gate = gate::gate(model, served.as_deref());
    let effective = gate::effective_spec(model, &gate, config.canary_max_idle());
    let mut replicas = replicas::desired_replicas(&effective, last_active(model), now);
    let shared = shared_lane(
        model,
        observed.shared.as_ref(),
        config,
        replicas.replicas,
        now,
    );
    if let Some(s) = &shared {
        replicas.replicas = s.lane.replicas;
        replicas.recheck_after = match (replicas.recheck_after, s.lane.recheck_after) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    let children = render::render(
        model,
        observed.cache.as_ref(),
        observed.profile.as_ref(),
        config,
    )
    .and_then(|r| {
        check_owner(model, "Deployment", observed.deployment.as_ref())?;
        check_owner(model, "Service", observed.service.as_ref())?;
        Ok(r)
    })
    .map(|mut r| {
        if let Some(spec) = r.deployment.spec.as_mut() {
            spec.replicas = Some(replicas.replicas);
        }
        r
    });
    ModelPlan {
        gate,
        replicas,
        shared,
        children,
    }
}

/// A member of a shared group: `wanted` is what its own replica policy asks for (for the Model
/// being planned, the plan's own decision; for the others, [`wanted_replicas`]).
pub fn member_of(model: &Model, wanted: i32, running: i32, now: Timestamp) -> shared::Member {
    let status = model.status.as_ref();
    let last_active = last_active(model);
    // The proxy refreshes lastActiveTime every keepalive interval while requests are in flight:
    // a value younger than two intervals means a request may still be running.
    let window = model
        .spec
        .serverless
        .keepalive_interval(DEFAULT_KEEPALIVE_INTERVAL)
        .saturating_mul(2);
    let busy = last_active.is_some_and(|t| {
        t >= now || Duration::try_from(now.duration_since(t)).is_ok_and(|age| age < window)
    });
    let group = model.spec.gpu.shared.as_deref();
    let previous = status
        .and_then(|s| s.shared_group.as_ref())
        .filter(|g| Some(g.group.as_str()) == group)
        .map(|g| (g.state, g.last_transition_time.as_ref().map(|t| t.0)));
    shared::Member {
        name: model.name_any(),
        priority: model.spec.gpu.priority,
        wanted,
        running,
        busy,
        previous,
    }
}

/// `status.lastActiveTime` of a Model.
fn last_active(model: &Model) -> Option<Timestamp> {
    model
        .status
        .as_ref()
        .and_then(|s| s.last_active_time.as_ref())
        .map(|t| t.0)
}

/// What another member's own policy asks for, with its gate judged against the artifact its own
/// reconcile last accepted (its artifact is not observed here; its own reconcile decides for real).
fn wanted_replicas(model: &Model, config: &RenderConfig, now: Timestamp) -> i32 {
    let recorded = model
        .status
        .as_ref()
        .and_then(|s| s.validated_artifact.clone());
    let g = gate::gate(model, recorded.as_deref());
    let effective = gate::effective_spec(model, &g, config.canary_max_idle());
    replicas::desired_replicas(&effective, last_active(model), now).replicas
}

/// Replicas each Model runs or is about to run: the larger of its Deployment's `spec.replicas`
/// (only a Deployment this Model controls counts) and its pods that still exist, terminating ones
/// included (a terminating pod may still hold the GPU; Deployment status does not count it).
pub fn running_replicas(
    models: &[Model],
    deployments: &[Deployment],
    pods: &[Pod],
) -> BTreeMap<String, i32> {
    let mut running: BTreeMap<String, i32> = BTreeMap::new();
    for d in deployments {
        let Some(name) = d.metadata.name.as_deref() else {
            continue;
        };
        let Some(model) = models.iter().find(|m| m.name_any() == name) else {
            continue;
        };
        let controlled = d
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| is_our_controller(model, o));
        if controlled {
            let spec = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1).max(0);
            running.insert(name.to_string(), spec);
        }
    }
    let mut pod_counts: BTreeMap<&str, i32> = BTreeMap::new();
    for p in pods {
        let finished = p
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|ph| ph == "Succeeded" || ph == "Failed");
        if finished {
            continue;
        }
        if let Some(m) = p
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(labels::MODEL))
        {
            let c = pod_counts.entry(m.as_str()).or_insert(0);
            *c = c.saturating_add(1);
        }
    }
    for (m, n) in pod_counts {
        if models.iter().any(|x| x.name_any() == m) {
            let e = running.entry(m.to_string()).or_insert(0);
            *e = (*e).max(n);
        }
    }
    running
}

/// The Model's lane: arbitrate over the group as observed, with this Model as it is now.
fn shared_lane(
    model: &Model,
    observed: Option<&SharedObservation>,
    config: &RenderConfig,
    own_wanted: i32,
    now: Timestamp,
) -> Option<SharedLane> {
    let group = model.spec.gpu.shared.clone()?;
    let empty = SharedObservation::default();
    let obs = observed.unwrap_or(&empty);
    let me = model.name_any();
    let running = |name: &str| obs.running.get(name).copied().unwrap_or(0);
    let mut members: Vec<shared::Member> = obs
        .models
        .iter()
        .filter(|m| m.name_any() != me && m.spec.gpu.shared.as_deref() == Some(group.as_str()))
        .map(|m| {
            let wanted = wanted_replicas(m, config, now);
            member_of(m, wanted, running(&m.name_any()), now)
        })
        .collect();
    members.push(member_of(model, own_wanted, running(&me), now));
    let lanes = shared::arbitrate(&members, now, obs.grace);
    let active_priority = lanes
        .last()
        .and_then(|l| l.active_model.as_ref())
        .and_then(|a| members.iter().find(|m| &m.name == a))
        .map(|m| m.priority);
    lanes.last().cloned().map(|lane| SharedLane {
        group,
        lane,
        priority: model.spec.gpu.priority,
        active_priority,
    })
}

/// Whether `owner` is this Model's controller reference.
fn is_our_controller(model: &Model, owner: &OwnerReference) -> bool {
    owner.controller == Some(true) && Some(owner.uid.as_str()) == model.metadata.uid.as_deref()
}

/// An existing child may be written only if this Model controls it (absent ones are created).
pub fn check_owner(
    model: &Model,
    kind: &'static str,
    existing: Option<&Existing>,
) -> Result<(), ConfigProblem> {
    let Some(existing) = existing else {
        return Ok(());
    };
    let refs = &existing.owner_references;
    if refs.iter().any(|o| is_our_controller(model, o)) {
        return Ok(());
    }
    let owner = match refs.iter().find(|o| o.controller == Some(true)) {
        Some(o) => format!("it is controlled by {} {} (uid {})", o.kind, o.name, o.uid),
        None if refs.is_empty() => "it has no owner".to_string(),
        None => format!(
            "it has no controller; owners: {}",
            refs.iter()
                .map(|o| format!("{} {}", o.kind, o.name))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    Err(ConfigProblem::ResourceConflict {
        kind,
        name: model.name_any(),
        owner,
    })
}

/// The rollout as the applied Deployment shows it (`scheduled` is filled in from the pods).
pub fn rollout(applied: &Deployment, desired: i32) -> DeploymentObservation {
    let st = applied.status.clone().unwrap_or_default();
    DeploymentObservation {
        desired,
        ready: st.ready_replicas.unwrap_or(0),
        updated: st.updated_replicas.unwrap_or(0),
        current: st.observed_generation.is_some()
            && st.observed_generation >= applied.metadata.generation,
        scheduled: 0,
    }
}

/// Whether the pods must be counted: only while replicas are wanted and not all ready.
pub fn needs_pod_count(o: &DeploymentObservation) -> bool {
    o.desired > 0 && o.ready < o.desired
}

/// Pods bound to a node and not being deleted.
pub fn scheduled(pods: &[Pod]) -> i32 {
    pods.iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
        })
        .count()
        .try_into()
        .unwrap_or(i32::MAX)
}
