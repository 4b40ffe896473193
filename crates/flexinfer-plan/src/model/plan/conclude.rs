//! The second half of the Model plan: from the rollout of what was applied to the status, the Events and
//! the requeue interval ([`ModelPlan::conclude`]).

use std::time::Duration;

use crate::model::plan::EventType;
use flexinfer_api::conditions::{self, types};
use flexinfer_api::contract::reasons;
use flexinfer_api::model::{ModelPhase, ModelStatus, SharedGroupState, SharedGroupStatus};
use flexinfer_api::Model;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube_core::ResourceExt;

use super::super::gate::{self, GateDecision};
use super::super::render::{self, ConfigProblem};
use super::super::status::{self, DeploymentObservation, Outcome};
use super::{Conclusion, ModelPlan, PlannedEvent};

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
        let mut new = status::next_status(
            old,
            model.metadata.generation,
            &outcome,
            &self.gate,
            &Time(now),
        );
        self.shared_status(&mut new, &outcome, model.metadata.generation, now);
        new.validated_artifact = gate::recorded_artifact(model, &self.gate);
        let phase = new.phase.unwrap_or(ModelPhase::Pending);
        let mut events = self.events(old, previous, phase, &outcome);
        let (shared_events, preempted_in) = self.shared_events(old);
        events.extend(shared_events);
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
            preempted_in,
        }
    }

    /// `status.sharedGroup`, and the phase and Ready condition of a Model held at zero replicas
    /// by its group (it wants to run: Pending, not Idle).
    fn shared_status(
        &self,
        st: &mut ModelStatus,
        outcome: &Outcome,
        generation: Option<i64>,
        now: Timestamp,
    ) {
        let Some(s) = &self.shared else {
            st.shared_group = None;
            return;
        };
        let l = &s.lane;
        st.shared_group = Some(SharedGroupStatus {
            group: s.group.clone(),
            state: l.state,
            queue_position: l.queue_position,
            preempted_by: l.preempted_by.clone(),
            active_model: l.active_model.clone(),
            last_transition_time: Some(Time(l.since)),
        });
        let held_back = matches!(
            l.state,
            SharedGroupState::Queued | SharedGroupState::Preempted
        ) && l.replicas == 0;
        if !held_back || !matches!(outcome, Outcome::Deployed { .. }) {
            return;
        }
        let (reason, message) = match l.state {
            SharedGroupState::Preempted => (
                SharedGroupState::Preempted.as_str(),
                format!(
                    "preempted by {} (priority {} > {}) in shared GPU group {}; it runs again \
                     when that Model goes idle",
                    l.preempted_by.as_deref().unwrap_or("another Model"),
                    s.active_priority.unwrap_or(s.priority),
                    s.priority,
                    s.group
                ),
            ),
            _ if l.queue_position == Some(1) => (
                SharedGroupState::Queued.as_str(),
                format!(
                    "next in shared GPU group {}; waiting for the Model that holds the GPU to \
                     release it",
                    s.group
                ),
            ),
            _ => (
                SharedGroupState::Queued.as_str(),
                format!(
                    "queued at position {} in shared GPU group {} behind {} (priority {})",
                    l.queue_position.unwrap_or(0),
                    s.group,
                    l.active_model.as_deref().unwrap_or("another Model"),
                    s.active_priority.unwrap_or(s.priority),
                ),
            ),
        };
        st.phase = Some(ModelPhase::Pending);
        conditions::set(
            &mut st.conditions,
            types::READY,
            false,
            reason,
            &message,
            generation,
            &Time(now),
        );
    }

    /// One Event per change of the Model's state in its group; the group when it was preempted.
    fn shared_events(&self, old: Option<&ModelStatus>) -> (Vec<PlannedEvent>, Option<String>) {
        let Some(s) = &self.shared else {
            return (Vec::new(), None);
        };
        let before = old
            .and_then(|o| o.shared_group.as_ref())
            .filter(|g| g.group == s.group)
            .map(|g| g.state)
            .unwrap_or(SharedGroupState::Idle);
        let l = &s.lane;
        if before == l.state {
            return (Vec::new(), None);
        }
        let g = &s.group;
        let (reason, note) = match l.state {
            SharedGroupState::Active => (
                reasons::SHARED_GROUP_ACTIVE,
                format!(
                    "holds the GPU lane of shared group {g} (priority {}; was {})",
                    s.priority,
                    before.as_str()
                ),
            ),
            SharedGroupState::Queued => (
                reasons::SHARED_GROUP_QUEUED,
                format!(
                    "queued at position {} for shared GPU group {g}; the lane goes to {}",
                    l.queue_position.unwrap_or(0),
                    l.active_model.as_deref().unwrap_or("another Model")
                ),
            ),
            SharedGroupState::Preempted => (
                reasons::SHARED_GROUP_PREEMPTED,
                format!(
                    "preempted by {} (priority {} > {}) in shared GPU group {g}; requests in \
                     flight may finish within the grace period",
                    l.preempted_by.as_deref().unwrap_or("another Model"),
                    s.active_priority.unwrap_or(s.priority),
                    s.priority
                ),
            ),
            SharedGroupState::Idle => (
                reasons::SHARED_GROUP_IDLE,
                format!("no demand; released its place in shared GPU group {g}"),
            ),
        };
        let preempted = (l.state == SharedGroupState::Preempted).then(|| g.clone());
        (
            vec![PlannedEvent {
                type_: EventType::Normal,
                reason,
                action: format!("SharedGroup{}", l.state.as_str()),
                note,
            }],
            preempted,
        )
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
        // Once per new problem: a status that already carries it was announced.
        if let Some(p) = match outcome {
            Outcome::Problem(p) if p.warns() => Some(p),
            _ => None,
        } {
            let note = p.to_string();
            let known = old_ready.is_some_and(|c| c.reason == p.reason() && c.message == note);
            if !known {
                let action = match p {
                    ConfigProblem::ResourceConflict { .. } => "Apply",
                    _ => "ResolveImage",
                };
                events.push(PlannedEvent {
                    type_: EventType::Warning,
                    reason: p.reason(),
                    action: action.into(),
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
