//! The ModelCache state machine (docs/dev/architecture.md, "The ModelCache pipeline") as one pure function: `plan(cache, observed, config,
//! now) -> Plan`. No I/O happens here; the reconciler observes, calls `plan`, and applies it.
//!
//! `plan` runs named steps, each in its own module: `deletion` (finalizer and claim),
//! `validation` (specs no engine can run), `triggers` (removed phases and trigger annotations),
//! `advance` (the first phase that is not done), `conditions` (Ready and the per-phase
//! conditions) and `node_step` (a NodeLocal cache's copies on its nodes).

use std::time::Duration;

use flexinfer_api::modelcache::{CachePhase, ModelCache, ModelCacheStatus};
use k8s_openapi::jiff::Timestamp;

use super::advance::advance;
use super::conditions::{drop_unconfigured_conditions, mark_ready, set_phase_conditions};
use super::config::Config;
use super::ctx::Ctx;
use super::deletion::{claim_actions, deletion};
use super::jobs;
use super::node_step;
use super::triggers::{apply_triggers, forget_removed_phases};
use super::validation::spec_problem;

pub use super::failures::{classify_failure, redact};
pub use super::types::{Action, ClaimPeer, LogTail, Observed, Outcome, Plan};

/// Plan one reconcile of `mc`.
pub fn plan(mc: &ModelCache, observed: &Observed, config: &Config, now: Timestamp) -> Plan {
    let old = mc.status.clone().unwrap_or_default();
    if let Some(waiting) = node_copies_before_deletion(mc, observed, config, now) {
        return Plan {
            status: old,
            status_changed: false,
            actions: waiting,
            requeue_after: Some(Duration::from_secs(10)),
            outcome: Outcome::default(),
        };
    }
    if let Some(actions) = deletion(mc, observed) {
        return Plan {
            status: old,
            status_changed: false,
            actions,
            requeue_after: None,
            outcome: Outcome::default(),
        };
    }
    let mut cx = Ctx::new(mc, config, now);
    cx.actions = claim_actions(mc, observed);
    cx.st.claim_name = Some(jobs::claim_name(mc));
    cx.st.observed_generation = cx.gen;
    if cx.st.phase.is_none() {
        cx.st.phase = Some(CachePhase::Pending);
    }
    if cx.st.retry_count.is_none() {
        cx.st.retry_count = Some(0);
    }
    let phases = jobs::enabled_phases(mc);
    drop_unconfigured_conditions(&mut cx, &phases);
    if let Some(problem) = spec_problem(mc, observed) {
        cx.fail_config(problem.reason, &problem.message, problem.phase);
        return finish(cx, &old);
    }
    // Jobs already being deleted (by us, now or earlier) are waited for.
    cx.deleting = observed
        .jobs
        .values()
        .filter(|j| j.terminating)
        .map(|j| j.phase)
        .collect();
    forget_removed_phases(&mut cx, &phases, observed);
    apply_triggers(&mut cx, &phases, observed);
    if advance(&mut cx, &phases, observed) {
        mark_ready(&mut cx);
    }
    set_phase_conditions(&mut cx, &phases);
    plan_node_copies(&mut cx, observed);
    finish(cx, &old)
}

/// A NodeLocal cache being deleted removes its node copies first: the cleanup actions while any node
/// still holds one (bounded by [`node_step::DELETION_WAIT`]); `None` once the finalizer may go.
fn node_copies_before_deletion(
    mc: &ModelCache,
    observed: &Observed,
    config: &Config,
    now: Timestamp,
) -> Option<Vec<Action>> {
    mc.metadata.deletion_timestamp.as_ref()?;
    if !super::deletion::has_cleanup_finalizer(mc) {
        return None;
    }
    let obs = observed.node_local.as_ref()?;
    let step = node_step::node_step(mc, obs, None, config, now, true);
    let past_deadline = node_step::deletion_deadline_passed(mc, now);
    let done = step.plan.deletion_done && (obs.problem.is_none() || past_deadline);
    (!done).then_some(step.actions)
}

/// The copies of a NodeLocal cache on its nodes, once the pipeline has published; a cache that is no
/// longer NodeLocal has its copies removed.
fn plan_node_copies(cx: &mut Ctx<'_>, observed: &Observed) {
    let Some(obs) = observed.node_local.as_ref() else {
        return;
    };
    let node_local = node_step::is_node_local(cx.mc);
    // While the pipeline runs again the nodes keep the copy of the last published digest (the Models
    // serve it); the new one replaces it once it is published.
    let want = node_local
        .then(|| {
            node_step::wanted_digest(&cx.st)
                .or_else(|| cx.st.node_local.as_ref().and_then(|n| n.digest.clone()))
        })
        .flatten();
    let step = node_step::node_step(cx.mc, obs, want.as_deref(), cx.config, cx.now, !node_local);
    cx.actions.extend(step.actions.iter().cloned());
    if node_local {
        cx.st.node_local = Some(node_step::node_status(
            &step,
            obs,
            want.as_deref(),
            cx.config,
        ));
        cx.requeue(node_step::NODE_RESYNC);
    } else if step.plan.deletion_done {
        cx.st.node_local = None;
    } else {
        cx.requeue(Duration::from_secs(10));
    }
}

fn finish(cx: Ctx<'_>, old: &ModelCacheStatus) -> Plan {
    let changed = &cx.st != old;
    Plan {
        status_changed: changed,
        status: cx.st,
        actions: cx.actions,
        requeue_after: cx.requeue,
        outcome: cx.outcome,
    }
}
