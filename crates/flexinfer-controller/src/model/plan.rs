//! The Model planner (docs/dev/architecture.md §4). Pure: no API calls, no clock reads.
//!
//! [`plan`] decides, from the Model and what the reconciler observed, the gate, the replicas and
//! which children to apply (or why none are applied: a configuration problem, or an existing
//! object of the same name that this Model does not control). The status depends on what the
//! API server answers to the apply (the Deployment's generation after the write), so the second
//! half of the plan, [`ModelPlan::conclude`], turns that rollout observation into the status,
//! the Events and the requeue interval.

use std::time::Duration;

use flexinfer_api::conditions::{self, types};
use flexinfer_api::contract::reasons;
use flexinfer_api::model::{ModelPhase, ModelStatus};
use flexinfer_api::{GPUProfile, Model, ModelCache};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use kube::ResourceExt;

use super::gate::{self, GateDecision};
use super::render::{self, ConfigProblem, RenderConfig, Rendered};
use super::replicas::{self, ReplicaDecision};
use super::status::{self, DeploymentObservation, Outcome};

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
}

/// The decisions of one reconcile, before the apply.
#[derive(Debug, Clone)]
pub struct ModelPlan {
    pub gate: GateDecision,
    pub replicas: ReplicaDecision,
    /// The children to apply (the Deployment with `spec.replicas` set), or why nothing is applied.
    pub children: Result<Rendered, ConfigProblem>,
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
}

/// Plan one reconcile of `model`.
pub fn plan(
    model: &Model,
    observed: &Observed,
    config: &RenderConfig,
    now: Timestamp,
) -> ModelPlan {
    let gate = gate::gate(model);
    let effective = if gate.is_blocked() {
        gate::as_canary(&model.spec)
    } else {
        model.spec.clone()
    };
    let last_active = model
        .status
        .as_ref()
        .and_then(|s| s.last_active_time.as_ref())
        .map(|t| t.0);
    let replicas = replicas::desired_replicas(&effective, last_active, now);
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
        children,
    }
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

impl ModelPlan {
    /// What was deployed, given the rollout of the applied Deployment (`None` = nothing applied).
    pub fn outcome(&self, model: &Model, rollout: Option<DeploymentObservation>) -> Outcome {
        match &self.children {
            Err(problem) => Outcome::Problem(problem.clone()),
            Ok(r) => Outcome::Deployed {
                observed: rollout.unwrap_or(DeploymentObservation {
                    desired: self.replicas.replicas,
                    ..Default::default()
                }),
                cached: r.cached.clone(),
                served_path: r.served_path.clone(),
                endpoint: render::endpoint(
                    &model.name_any(),
                    &model.namespace().unwrap_or_default(),
                ),
            },
        }
    }

    /// Status, Events and requeue from the rollout of what was applied.
    pub fn conclude(
        &self,
        model: &Model,
        rollout: Option<DeploymentObservation>,
        now: Timestamp,
    ) -> Conclusion {
        let outcome = self.outcome(model, rollout);
        let old = model.status.as_ref();
        let previous = old.and_then(|s| s.phase);
        let new = status::next_status(
            old,
            model.metadata.generation,
            &outcome,
            &self.gate,
            &Time(now),
        );
        let phase = new.phase.unwrap_or(ModelPhase::Pending);
        let events = self.events(old, previous, phase, &outcome);
        let mut requeue = match (&outcome, phase) {
            (Outcome::Problem(_), ModelPhase::Failed) => Duration::from_secs(120),
            (Outcome::Problem(_), _) => Duration::from_secs(60),
            (_, ModelPhase::Loading | ModelPhase::Pending) => Duration::from_secs(15),
            _ => Duration::from_secs(300),
        };
        if let Some(r) = self.replicas.recheck_after {
            requeue = requeue.min(r.saturating_add(Duration::from_secs(1)));
        }
        Conclusion {
            phase,
            previous,
            status: status::owned_differs(old, &new).then_some(new),
            events,
            requeue,
        }
    }

    fn events(
        &self,
        old: Option<&ModelStatus>,
        previous: Option<ModelPhase>,
        phase: ModelPhase,
        outcome: &Outcome,
    ) -> Vec<PlannedEvent> {
        let mut events = Vec::new();
        let old_ready = old.and_then(|s| conditions::find(&s.conditions, types::READY));
        if previous != Some(phase) {
            let from = previous.map(|p| p.as_str()).unwrap_or("None");
            let note = match outcome {
                Outcome::Problem(p) => format!("{from} -> {}: {p}", phase.as_str()),
                Outcome::Deployed { .. } => format!("{from} -> {}", phase.as_str()),
            };
            events.push(PlannedEvent {
                type_: if phase == ModelPhase::Failed {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: reasons::PHASE_CHANGED,
                // Repeats of one transition count up; other transitions are new series.
                action: format!("{from}To{}", phase.as_str()),
                note,
            });
        }
        if let Outcome::Problem(p @ ConfigProblem::ResourceConflict { .. }) = outcome {
            let note = p.to_string();
            let known = old_ready.is_some_and(|c| c.reason == p.reason() && c.message == note);
            if !known {
                events.push(PlannedEvent {
                    type_: EventType::Warning,
                    reason: p.reason(),
                    action: "Apply".into(),
                    note,
                });
            }
        }
        let was_blocked = old
            .and_then(|s| conditions::find(&s.conditions, types::PROMOTION_GATE))
            .is_some_and(|c| c.reason == gate::reasons::BLOCKED);
        if let (GateDecision::Blocked { message }, false) = (&self.gate, was_blocked) {
            events.push(PlannedEvent {
                type_: EventType::Warning,
                reason: reasons::PROMOTION_BLOCKED,
                action: "PromotionGate".into(),
                note: message.clone(),
            });
        }
        events
    }
}
