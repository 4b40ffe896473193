//! Planning step 5: the cache-level outcome of a complete pipeline and the per-phase conditions.

use flexinfer_api::conditions::{self, types};
use flexinfer_api::contract::{reasons, JobPhase};
use flexinfer_api::modelcache::CachePhase;

use super::ctx::Ctx;
use super::jobs;
use super::phase::{complete_reason, failed_reason, get_common, phase_condition};

/// Remove the conditions of phases that are no longer configured.
pub(super) fn drop_unconfigured_conditions(cx: &mut Ctx<'_>, phases: &[JobPhase]) {
    for p in JobPhase::ALL {
        if !phases.contains(&p) {
            conditions::remove(&mut cx.st.conditions, phase_condition(p));
        }
    }
}

/// Every phase is complete: the cache is `Ready` at its artifact (one event when it becomes so).
pub(super) fn mark_ready(cx: &mut Ctx<'_>) {
    let mc = cx.mc;
    let was_ready = mc.status.as_ref().and_then(|s| s.phase) == Some(CachePhase::Ready);
    let path = format!(
        "{}:{}",
        jobs::claim_name(mc),
        jobs::artifact_dir(mc, &cx.st)
    );
    cx.st.phase = Some(CachePhase::Ready);
    cx.st.current_phase = Some("ready".into());
    cx.st.progress = Some(100);
    cx.st.path = Some(path.clone());
    cx.st.next_retry_at = None;
    cx.cond(
        types::READY,
        true,
        reasons::CACHE_READY,
        &format!("artifact ready at {path}"),
    );
    cx.cond(
        types::PROGRESSING,
        false,
        reasons::CACHE_READY,
        "all pipeline phases complete",
    );
    cx.cond(types::DEGRADED, false, reasons::CACHE_READY, "");
    if !was_ready {
        cx.event(
            false,
            reasons::CACHE_READY,
            format!("ModelCache ready at {path}"),
        );
    }
}

/// `Downloaded`, `Abliterated`, … of each enabled phase: complete, in progress (or failed), or
/// waiting for earlier phases.
pub(super) fn set_phase_conditions(cx: &mut Ctx<'_>, phases: &[JobPhase]) {
    for &p in phases {
        let c = get_common(&cx.st, p);
        if c.completed_at.is_some() {
            let msg = format!("{} complete", p.status_name());
            cx.cond(phase_condition(p), true, complete_reason(p), &msg);
        } else if cx.st.current_phase.as_deref() == Some(p.status_name()) {
            let (reason, msg) = if cx.st.phase == Some(CachePhase::Failed) {
                let r = conditions::find(&cx.st.conditions, types::READY)
                    .map(|c| c.reason.clone())
                    .unwrap_or_else(|| failed_reason(p));
                (r, c.failure_message.clone().unwrap_or_default())
            } else {
                (
                    "InProgress".to_string(),
                    format!("{} in progress", p.status_name()),
                )
            };
            cx.cond(phase_condition(p), false, &reason, &msg);
        } else {
            cx.cond(
                phase_condition(p),
                false,
                "Waiting",
                "waiting for earlier phases",
            );
        }
    }
}
