//! The planner's working state for one reconcile ([`Ctx`]): the status being built, the actions,
//! the requeue, and the small operations every planning step uses.

use std::collections::BTreeSet;
use std::time::Duration;

use flexinfer_api::conditions::{self, types};
use flexinfer_api::contract::JobPhase;
use flexinfer_api::modelcache::{CachePhase, ModelCache, ModelCacheStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use super::config::Config;
use super::failures::{redact, truncate};
use super::phase::{get_common, phase_condition, running_phase, set_common};
use super::types::{Action, Observed, Outcome};

/// An event action; its note is redacted and bounded.
pub(super) fn event(warning: bool, reason: &str, note: &str, job: Option<&str>) -> Action {
    Action::Event {
        warning,
        reason: reason.to_string(),
        note: truncate(&redact(note), 1000),
        job: job.map(String::from),
    }
}

pub(super) struct Ctx<'a> {
    pub(super) mc: &'a ModelCache,
    pub(super) config: &'a Config,
    pub(super) now: Timestamp,
    pub(super) now_t: Time,
    pub(super) gen: Option<i64>,
    pub(super) st: ModelCacheStatus,
    pub(super) actions: Vec<Action>,
    pub(super) requeue: Option<Duration>,
    pub(super) outcome: Outcome,
    /// Phases whose Job is being deleted (by us, now or earlier): waited for, not replaced yet.
    pub(super) deleting: BTreeSet<JobPhase>,
}

impl<'a> Ctx<'a> {
    /// Start planning `mc` from the status it carries.
    pub(super) fn new(mc: &'a ModelCache, config: &'a Config, now: Timestamp) -> Self {
        Ctx {
            mc,
            config,
            now,
            now_t: Time(now),
            gen: mc.metadata.generation,
            st: mc.status.clone().unwrap_or_default(),
            actions: Vec::new(),
            requeue: None,
            outcome: Outcome::default(),
            deleting: BTreeSet::new(),
        }
    }
    pub(super) fn event(&mut self, warning: bool, reason: &str, note: String) {
        self.job_event(warning, reason, note, None);
    }
    pub(super) fn job_event(
        &mut self,
        warning: bool,
        reason: &str,
        note: String,
        job: Option<&str>,
    ) {
        self.actions.push(event(warning, reason, &note, job));
    }
    pub(super) fn requeue(&mut self, d: Duration) {
        let d = d.max(Duration::from_millis(500));
        self.requeue = Some(self.requeue.map_or(d, |r| r.min(d)));
    }
    pub(super) fn cond(&mut self, t: &str, status: bool, reason: &str, msg: &str) {
        let now = self.now_t.clone();
        conditions::set(
            &mut self.st.conditions,
            t,
            status,
            reason,
            msg,
            self.gen,
            &now,
        );
    }
    /// While no artifact is served yet, `Ready` says which phase the pipeline is at.
    pub(super) fn ready_pending_at(&mut self, phase: JobPhase) {
        if self.st.path.is_none() {
            self.cond(
                types::READY,
                false,
                running_phase(phase).as_str(),
                &format!("pipeline is at {}", phase.status_name()),
            );
        }
    }
    pub(super) fn ready_reason(&self) -> Option<String> {
        conditions::find(&self.st.conditions, types::READY).map(|c| c.reason.clone())
    }
    /// A spec problem no retry can fix: `Failed` with a clear condition; one event per change.
    pub(super) fn fail_config(&mut self, reason: &str, msg: &str, phase: Option<JobPhase>) {
        let changed = self.st.phase != Some(CachePhase::Failed)
            || self.ready_reason().as_deref() != Some(reason);
        self.st.phase = Some(CachePhase::Failed);
        if let Some(p) = phase {
            self.st.current_phase = Some(p.status_name().into());
            self.cond(phase_condition(p), false, reason, msg);
        }
        self.cond(types::READY, false, reason, msg);
        self.cond(types::PROGRESSING, false, reason, msg);
        self.cond(types::DEGRADED, true, reason, msg);
        if changed {
            self.event(true, reason, msg.to_string());
        }
    }
}

/// Forget completion of `phases` (a re-run) and delete their Jobs. Results stay in status (and
/// `status.path` keeps pointing at the previous artifact) until the new run succeeds.
pub(super) fn invalidate(cx: &mut Ctx<'_>, phases: &[JobPhase], observed: &Observed) {
    for &p in phases {
        let mut c = get_common(&cx.st, p);
        c.completed_at = None;
        c.spec_hash = None;
        set_common(&mut cx.st, p, c);
        if let Some(j) = observed.jobs.get(&p) {
            if !j.terminating {
                cx.actions.push(Action::DeleteJob(j.name.clone()));
            }
            cx.deleting.insert(p);
        }
    }
}
