//! Pure status computation: phase, conditions and the rest of `Model.status`.

use flexinfer_api::conditions::{self, types};
use flexinfer_api::model::{ModelPhase, ModelStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::gate::GateDecision;
use super::render::{CachedState, ConfigProblem};

/// What the reconciler saw of the serving Deployment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeploymentObservation {
    /// Replicas the controller asked for.
    pub desired: i32,
    /// `status.readyReplicas`.
    pub ready: i32,
    /// `status.updatedReplicas`.
    pub updated: i32,
    /// Whether the Deployment controller has seen the latest spec.
    pub current: bool,
    /// Pods of the Model that are bound to a node.
    pub scheduled: i32,
}

/// Result of rendering and applying.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Children applied.
    Deployed {
        observed: DeploymentObservation,
        cached: CachedState,
        served_path: Option<String>,
        endpoint: String,
    },
    /// Not deployed (or not updated) because of a problem.
    Problem(ConfigProblem),
}

/// Phase from the outcome.
pub fn phase(outcome: &Outcome) -> ModelPhase {
    match outcome {
        Outcome::Problem(p) => p.phase(),
        Outcome::Deployed { observed: o, .. } => {
            if o.desired == 0 {
                ModelPhase::Idle
            } else if o.current && o.updated >= o.desired && o.ready >= o.desired {
                ModelPhase::Ready
            } else if o.scheduled > 0 {
                ModelPhase::Loading
            } else {
                ModelPhase::Pending
            }
        }
    }
}

/// The next status (only the fields the controller owns; `lastActiveTime` is kept as is).
pub fn next_status(
    old: Option<&ModelStatus>,
    generation: Option<i64>,
    outcome: &Outcome,
    gate: &GateDecision,
    now: &Time,
) -> ModelStatus {
    let mut st = old.cloned().unwrap_or_default();
    let phase = phase(outcome);
    st.phase = Some(phase);
    st.observed_generation = generation;
    let mut conds = Conditions {
        list: &mut st.conditions,
        generation,
        now,
    };
    match outcome {
        Outcome::Problem(p) => conds.problem(p),
        Outcome::Deployed {
            observed,
            cached,
            served_path,
            endpoint,
        } => {
            conds.config_valid();
            conds.set_or_remove(types::CACHED, cached.condition(served_path.as_deref()));
            let (ready, reason, msg) = ready_condition(phase, observed, endpoint);
            conds.set(types::READY, ready, reason, &msg);
            st.endpoint = Some(endpoint.clone());
            st.served_path = served_path.clone();
            st.replicas = Some(observed.ready);
        }
    }
    conds.set_or_remove(types::PROMOTION_GATE, gate.condition());
    if st.replicas.is_none() {
        st.replicas = Some(0);
    }
    st
}

/// The status conditions being written, with the generation and time every change is stamped
/// with.
struct Conditions<'a> {
    list: &'a mut Vec<Condition>,
    generation: Option<i64>,
    now: &'a Time,
}

impl Conditions<'_> {
    /// Sets condition `type_`.
    fn set(&mut self, type_: &str, status: bool, reason: &str, message: &str) {
        conditions::set(
            self.list,
            type_,
            status,
            reason,
            message,
            self.generation,
            self.now,
        );
    }

    /// Sets condition `type_` to `cond` (status, reason, message), or removes it when `None`.
    fn set_or_remove(&mut self, type_: &str, cond: Option<(bool, &str, String)>) {
        match cond {
            Some((s, r, m)) => self.set(type_, s, r, &m),
            None => {
                conditions::remove(self.list, type_);
            }
        }
    }

    /// `ConfigValid=True`.
    fn config_valid(&mut self) {
        self.set(types::CONFIG_VALID, true, "Valid", "configuration is valid");
    }

    /// A problem fails the condition it belongs to (`ConfigValid`, else `Cached` with the
    /// configuration valid) and `Ready`.
    fn problem(&mut self, p: &ConfigProblem) {
        let msg = p.to_string();
        if p.condition_type() == types::CONFIG_VALID {
            self.set(types::CONFIG_VALID, false, p.reason(), &msg);
        } else {
            self.config_valid();
            self.set(types::CACHED, false, p.reason(), &msg);
        }
        self.set(types::READY, false, p.reason(), &msg);
    }
}

/// `Ready`'s status, reason and message for a deployed Model in `phase`.
fn ready_condition(
    phase: ModelPhase,
    observed: &DeploymentObservation,
    endpoint: &str,
) -> (bool, &'static str, String) {
    match phase {
        ModelPhase::Idle => (
            true,
            "Idle",
            "scaled to zero; started on demand".to_string(),
        ),
        ModelPhase::Ready => (
            true,
            "Ready",
            format!(
                "{}/{} replicas ready at {endpoint}",
                observed.ready, observed.desired
            ),
        ),
        ModelPhase::Loading => (
            false,
            "Loading",
            format!(
                "{}/{} replicas ready; the backend is loading the model",
                observed.ready, observed.desired
            ),
        ),
        _ => (
            false,
            "Pending",
            format!(
                "0/{} replicas scheduled; waiting for a node with a free GPU",
                observed.desired
            ),
        ),
    }
}

/// Whether two statuses differ in what the controller owns.
pub fn owned_differs(a: Option<&ModelStatus>, b: &ModelStatus) -> bool {
    match a {
        None => true,
        Some(a) => {
            a.phase != b.phase
                || a.conditions != b.conditions
                || a.endpoint != b.endpoint
                || a.replicas != b.replicas
                || a.observed_generation != b.observed_generation
                || a.served_path != b.served_path
                || a.shared_group != b.shared_group
                || a.validated_artifact != b.validated_artifact
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(desired: i32, ready: i32, updated: i32, current: bool, scheduled: i32) -> Outcome {
        Outcome::Deployed {
            observed: DeploymentObservation {
                desired,
                ready,
                updated,
                current,
                scheduled,
            },
            cached: CachedState::Pvc,
            served_path: Some("c:p".into()),
            endpoint: "http://m.ns.svc:8000/v1".into(),
        }
    }

    #[test]
    fn phases() {
        use ModelPhase::*;
        let cases = [
            (obs(0, 0, 0, true, 0), Idle),
            (obs(0, 1, 1, true, 1), Idle),
            (obs(1, 1, 1, true, 1), Ready),
            (obs(2, 1, 2, true, 2), Loading),
            (obs(1, 1, 0, true, 1), Loading),
            (obs(1, 1, 1, false, 1), Loading),
            (obs(1, 0, 1, true, 0), Pending),
            (
                Outcome::Problem(ConfigProblem::CacheNotReady {
                    name: "c".into(),
                    phase: "Quantizing".into(),
                }),
                Pending,
            ),
            (
                Outcome::Problem(ConfigProblem::CacheNotFound("c".into())),
                Pending,
            ),
            (
                Outcome::Problem(ConfigProblem::InvalidSource("x".into())),
                Failed,
            ),
            (
                Outcome::Problem(ConfigProblem::GpuProfileNotFound("x".into())),
                Failed,
            ),
        ];
        for (i, (o, want)) in cases.into_iter().enumerate() {
            assert_eq!(phase(&o), want, "case {i}");
        }
    }

    fn t(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap_or_default())
    }

    #[test]
    fn status_is_stable_and_gate_condition_follows_decision() {
        let blocked = GateDecision::Blocked {
            message: "needs flexinfer.ai/promotion-validation".into(),
        };
        let s1 = next_status(None, Some(3), &obs(1, 1, 1, true, 1), &blocked, &t(10));
        assert!(conditions::find(&s1.conditions, types::PROMOTION_GATE)
            .is_some_and(|c| c.status == "False" && c.reason == "Blocked"));
        // Same input later: nothing to write.
        let s2 = next_status(Some(&s1), Some(3), &obs(1, 1, 1, true, 1), &blocked, &t(20));
        assert!(!owned_differs(Some(&s1), &s2));
        // Ungated: the stale condition goes away.
        let s3 = next_status(
            Some(&s2),
            Some(4),
            &obs(1, 1, 1, true, 1),
            &GateDecision::Ungated,
            &t(30),
        );
        assert!(conditions::find(&s3.conditions, types::PROMOTION_GATE).is_none());
        assert!(owned_differs(Some(&s2), &s3));
        assert_eq!(s3.replicas, Some(1));
        assert_eq!(s3.phase, Some(ModelPhase::Ready));
        // A problem keeps the endpoint and path of what is still deployed.
        let s4 = next_status(
            Some(&s3),
            Some(5),
            &Outcome::Problem(ConfigProblem::InvalidSource("bad".into())),
            &GateDecision::Ungated,
            &t(40),
        );
        assert_eq!(s4.phase, Some(ModelPhase::Failed));
        assert!(conditions::find(&s4.conditions, types::CONFIG_VALID)
            .is_some_and(|c| c.status == "False" && c.reason == "InvalidSource"));
        assert_eq!(s4.served_path.as_deref(), Some("c:p"));
    }
}
