//! Planning step 3: what changed outside the phases themselves: phases removed from the spec, and
//! the trigger annotations (`redownload`, `reabliterate`, `requantize`, `reset-retries`).

use flexinfer_api::contract::{annotations, reasons, JobPhase};
use flexinfer_api::modelcache::{CachePhase, ModelCache};

use super::ctx::{invalidate, Ctx};
use super::jobs;
use super::phase::reset_retries;
use super::types::{Action, Observed};

/// A phase removed from the spec: forget its results and Job; its successors' input changed
/// (e.g. quantize reads the download directory instead of `abliterated/`), so they re-run.
pub(super) fn forget_removed_phases(cx: &mut Ctx<'_>, phases: &[JobPhase], observed: &Observed) {
    for p in JobPhase::ALL {
        if phases.contains(&p) {
            continue;
        }
        let had = match p {
            JobPhase::Download => false,
            JobPhase::Abliterate => cx.st.abliteration.take().is_some(),
            JobPhase::Quantize => cx.st.quantization.take().is_some(),
            JobPhase::Publish => cx.st.publish.take().is_some(),
        };
        if let Some(j) = observed.jobs.get(&p) {
            if !j.terminating {
                cx.actions.push(Action::DeleteJob(j.name.clone()));
            }
            cx.deleting.insert(p);
        }
        if had {
            let later: Vec<JobPhase> = phases.iter().copied().filter(|q| *q > p).collect();
            if !later.is_empty() {
                cx.event(
                    false,
                    reasons::RERUN_REQUESTED,
                    format!(
                        "{} was removed from the spec: re-running the phases after it",
                        p.status_name()
                    ),
                );
            }
            invalidate(cx, &later, observed);
        }
    }
}

/// The trigger annotations of a cache, read.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Triggers {
    /// Trigger annotations present (true or not): they are removed.
    pub(super) remove: Vec<String>,
    /// `(annotation, phase)` of the true re-run triggers of enabled phases, in trigger order.
    pub(super) reruns: Vec<(&'static str, JobPhase)>,
    /// Index in `phases` of the earliest phase to re-run.
    pub(super) rerun_from: Option<usize>,
    /// `reset-retries` is true.
    pub(super) reset_retries: bool,
}

/// Read the trigger annotations of `mc` against its enabled `phases`.
pub(super) fn read_triggers(mc: &ModelCache, phases: &[JobPhase]) -> Triggers {
    let triggers = [
        (annotations::REDOWNLOAD, JobPhase::Download),
        (annotations::REABLITERATE, JobPhase::Abliterate),
        (annotations::REQUANTIZE, JobPhase::Quantize),
    ];
    let present = |k: &str| {
        mc.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(k))
    };
    let mut out = Triggers::default();
    for (key, phase) in triggers {
        if !present(key) {
            continue;
        }
        out.remove.push(key.to_string());
        if jobs::annotation_true(mc, key) {
            if let Some(i) = phases.iter().position(|p| *p == phase) {
                out.rerun_from = Some(out.rerun_from.map_or(i, |r| r.min(i)));
                out.reruns.push((key, phase));
            }
        }
    }
    if present(annotations::RESET_RETRIES) {
        out.remove.push(annotations::RESET_RETRIES.to_string());
        out.reset_retries = jobs::annotation_true(mc, annotations::RESET_RETRIES);
    }
    out
}

/// Act on the trigger annotations: re-run from the earliest requested phase, clear the retry
/// state, and remove the annotations.
pub(super) fn apply_triggers(cx: &mut Ctx<'_>, phases: &[JobPhase], observed: &Observed) {
    let t = read_triggers(cx.mc, phases);
    for (key, phase) in &t.reruns {
        cx.event(
            false,
            reasons::RERUN_REQUESTED,
            format!(
                "{key}: re-running {} and the phases after it",
                phase.status_name()
            ),
        );
    }
    if let Some(i) = t.rerun_from {
        invalidate(cx, phases.get(i..).unwrap_or_default(), observed);
        reset_retries(&mut cx.st);
    }
    if t.reset_retries {
        reset_retries(&mut cx.st);
        if cx.st.phase == Some(CachePhase::Failed) {
            cx.st.phase = Some(CachePhase::Pending);
        }
        cx.event(
            false,
            reasons::RETRIES_RESET,
            "retry state cleared; the failed phase runs again".into(),
        );
    }
    if !t.remove.is_empty() {
        cx.actions.push(Action::RemoveAnnotations(t.remove));
    }
}
