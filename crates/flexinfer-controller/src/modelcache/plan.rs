//! The ModelCache state machine (docs/dev/architecture.md, "The ModelCache pipeline") as one pure function: `plan(cache, observed, config,
//! now) -> Plan`. No I/O happens here; the reconciler observes, calls `plan`, and applies it.
//!
//! `plan` runs named steps, each in its own module: `deletion` (finalizer and claim),
//! `validation` (specs no engine can run), `triggers` (removed phases and trigger annotations),
//! `advance` (the first phase that is not done), `conditions` (Ready and the per-phase
//! conditions) and `node_step` (a NodeLocal cache's copies on its nodes).

use std::collections::BTreeMap;
use std::time::Duration;

use flexinfer_api::conditions::types;
use flexinfer_api::contract::{reasons, JobPhase, ProgressEvent};
use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::modelcache::{CachePhase, ModelCache, ModelCacheStatus, PhaseProgress};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::jiff::Timestamp;

use super::advance::advance;
use super::conditions::{drop_unconfigured_conditions, mark_ready, set_phase_conditions};
use super::config::Config;
use super::ctx::Ctx;
use super::deletion::{claim_actions, deletion};
use super::jobs;
use super::node_step::{self, NodeLocalObserved};
use super::observe::ObservedJob;
use super::phase::{new_generation, running_phase, set_common, set_generation};
use super::triggers::{apply_triggers, forget_removed_phases};
use super::validation::spec_problem;

pub use super::failures::{classify_failure, redact};

/// Everything the reconciler read from the cluster for one cache.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    pub jobs: BTreeMap<JobPhase, ObservedJob>,
    /// Whether the PVC the controller creates exists (ignored with `existingClaimName`).
    pub pvc_exists: bool,
    /// GPUProfiles visible to the cache.
    pub profiles: Vec<GPUProfile>,
    /// Bounded tail of the active Job's pod log: `None` = not read.
    pub log_tail: Option<LogTail>,
    /// Directories on this cache's claim that Models serve (from their `status.servedPath`): kept by
    /// generation garbage collection.
    pub served_dirs: Vec<String>,
    /// Other ModelCaches of the namespace that use the same claim.
    pub claim_peers: Vec<ClaimPeer>,
    /// Models of the namespace that read from this cache's claim (`pvc://` source or served path):
    /// deleting the cache keeps the claim while any does.
    pub claim_models: Vec<String>,
    /// The nodes and node-copy Jobs of a `storageStrategy: NodeLocal` cache (or of one that has
    /// copies left from when it was); `None`: not read.
    pub node_local: Option<NodeLocalObserved>,
}

/// The pod log tail as the reconciler read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTail {
    Read(String),
    /// The read failed (the reconciler logs why): progress keeps its last trustworthy value.
    Unreadable,
}

/// Another cache on the same PersistentVolumeClaim.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClaimPeer {
    pub name: String,
    pub model_dir: String,
    /// Created before this cache (or same time and a smaller name): it keeps the directory.
    pub older: bool,
}

/// One side effect of a reconcile.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    AddFinalizer,
    RemoveFinalizer,
    CreatePvc(Box<PersistentVolumeClaim>),
    DeletePvc(String),
    CreateJob(Box<Job>),
    DeleteJob(String),
    /// Set (`Some`) or remove (`None`) label `key` on node `node` (`storageStrategy: NodeLocal`).
    LabelNode {
        node: String,
        key: String,
        value: Option<String>,
    },
    RemoveAnnotations(Vec<String>),
    Event {
        warning: bool,
        reason: String,
        note: String,
        /// Name of the Job the event is about (recorded as the related object, which also keeps
        /// events about different Jobs from being folded into one series).
        job: Option<String>,
    },
}

/// Facts for metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// Phases that completed in this reconcile.
    pub completed: Vec<JobPhase>,
    /// `(phase, classified reason)` of Jobs that failed in this reconcile.
    pub failed: Vec<(JobPhase, String)>,
    /// The newest telemetry of the running Job.
    pub telemetry: Option<ProgressEvent>,
    /// Running Job: phase, deadline seconds, elapsed seconds.
    pub running: Option<(JobPhase, i64, i64)>,
    /// The running quantization's GPTQ device, when this reconcile read its report: whether a `useGPU`
    /// quantization runs on the CPU unasked (the `QuantizedOnCPU` condition).
    pub gptq_on_cpu: Option<bool>,
}

/// Result of planning.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub status: ModelCacheStatus,
    /// `status` differs from what the object carries (only then is it written).
    pub status_changed: bool,
    pub actions: Vec<Action>,
    pub requeue_after: Option<Duration>,
    pub outcome: Outcome,
}

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

pub(super) fn create_job(
    cx: &mut Ctx<'_>,
    target: &jobs::PhaseTarget,
    image: &str,
    hash: &str,
    mut c: PhaseProgress,
    served: &[String],
) {
    let phase = target.phase;
    // A phase that writes generations gets a new one for a new run (new spec, trigger, changed input);
    // a retry of the same run continues in its generation (and resumes from its files).
    let retry_of_same_run = c.spec_hash.as_deref() == Some(hash);
    if jobs::output_base(cx.mc, phase).is_some()
        && (!retry_of_same_run || jobs::generation(&cx.st, phase).is_none())
    {
        set_generation(&mut cx.st, phase, new_generation(hash, cx.now));
    }
    let job = jobs::build_job(cx.mc, &cx.st, served, target, image, hash, cx.config);
    let jname = job.metadata.name.clone().unwrap_or_default();
    cx.actions.push(Action::CreateJob(Box::new(job)));
    c.spec_hash = Some(hash.to_string());
    c.run_hash = Some(jobs::legacy_spec_hash(cx.mc, phase, image));
    c.image = Some(image.to_string());
    c.started_at = Some(cx.now_t.clone());
    c.completed_at = None;
    c.progress = Some(0);
    c.progress_detail = None;
    c.progress_source = None;
    c.last_progress_at = None;
    set_common(&mut cx.st, phase, c);
    if let (JobPhase::Quantize, Some(q)) = (phase, cx.st.quantization.as_mut()) {
        // The new run reports its own device.
        q.gptq_device = None;
        q.gptq_device_reason = None;
        q.gptq_device_kind = None;
        q.gptq_device_requested = None;
    }
    cx.st.phase = Some(running_phase(phase));
    cx.st.progress = Some(0);
    cx.st.next_retry_at = None;
    let attempt = cx.st.retry_count.unwrap_or(0);
    let msg = format!(
        "created Job {jname} (image {image}, attempt {})",
        attempt.saturating_add(1)
    );
    cx.cond(
        types::PROGRESSING,
        true,
        running_phase(phase).as_str(),
        &msg,
    );
    cx.ready_pending_at(phase);
    cx.job_event(false, reasons::JOB_CREATED, msg, Some(&jname));
}
