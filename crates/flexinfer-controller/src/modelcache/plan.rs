//! The ModelCache state machine (docs/dev/architecture.md §3) as one pure function: `plan(cache, observed, config,
//! now) -> Plan`. No I/O happens here; the reconciler observes, calls `plan`, and applies it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use flexinfer_api::conditions::{self, types};
use flexinfer_api::contract::{self, annotations, reasons, JobPhase, ProgressEvent};
use flexinfer_api::formats;
use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::modelcache::{
    AbliterationStatus, CachePhase, DownloadStatus, ModelCache, ModelCacheStatus, PhaseProgress,
    QuantizationStatus,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::config::Config;
use super::failures::{is_image_pull_failure, is_transient_pull_failure, truncate};
use super::jobs;
use super::observe::{stuck_reason, JobState, ObservedJob};
use super::results::{record_failure, record_success, update_progress};

pub use super::failures::{classify_failure, redact};

/// Everything the reconciler read from the cluster for one cache.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    pub jobs: BTreeMap<JobPhase, ObservedJob>,
    /// Whether the PVC the controller creates exists (ignored with `existingClaimName`).
    pub pvc_exists: bool,
    /// GPUProfiles visible to the cache.
    pub profiles: Vec<GPUProfile>,
    /// Bounded tail of the active Job's pod log: `None` = not read, `Some(Err)` = read failed.
    pub log_tail: Option<Result<String, String>>,
    /// Directories on this cache's claim that Models serve (from their `status.servedPath`): kept by
    /// generation garbage collection.
    pub served_dirs: Vec<String>,
    /// Other ModelCaches of the namespace that use the same claim.
    pub claim_peers: Vec<ClaimPeer>,
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

/// The progress fields of phase `p` (default when the phase has no status yet).
pub(super) fn get_common(st: &ModelCacheStatus, p: JobPhase) -> PhaseProgress {
    match p {
        JobPhase::Download => st.download.as_ref().map(|s| s.run.clone()),
        JobPhase::Abliterate => st.abliteration.as_ref().map(|s| s.run.clone()),
        JobPhase::Quantize => st.quantization.as_ref().map(|s| s.run.clone()),
        JobPhase::Publish => st.publish.as_ref().map(|s| s.run.clone()),
    }
    .unwrap_or_default()
}

/// Replace the progress fields of phase `p`, creating its status if needed.
pub(super) fn set_common(st: &mut ModelCacheStatus, p: JobPhase, c: PhaseProgress) {
    let run = match p {
        JobPhase::Download => &mut st.download.get_or_insert_with(Default::default).run,
        JobPhase::Abliterate => &mut st.abliteration.get_or_insert_with(Default::default).run,
        JobPhase::Quantize => &mut st.quantization.get_or_insert_with(Default::default).run,
        JobPhase::Publish => &mut st.publish.get_or_insert_with(Default::default).run,
    };
    *run = c;
}

/// `Downloading`, `Abliterating`, … for a Job phase.
pub fn running_phase(p: JobPhase) -> CachePhase {
    match p {
        JobPhase::Download => CachePhase::Downloading,
        JobPhase::Abliterate => CachePhase::Abliterating,
        JobPhase::Quantize => CachePhase::Quantizing,
        JobPhase::Publish => CachePhase::Publishing,
    }
}

pub(super) fn phase_condition(p: JobPhase) -> &'static str {
    match p {
        JobPhase::Download => types::DOWNLOADED,
        JobPhase::Abliterate => types::ABLITERATED,
        JobPhase::Quantize => types::QUANTIZED,
        JobPhase::Publish => types::PUBLISHED,
    }
}

pub(super) fn complete_reason(p: JobPhase) -> &'static str {
    match p {
        JobPhase::Download => reasons::DOWNLOAD_COMPLETE,
        JobPhase::Abliterate => reasons::ABLITERATION_COMPLETE,
        JobPhase::Quantize => reasons::QUANTIZATION_COMPLETE,
        JobPhase::Publish => reasons::PUBLISHED,
    }
}

/// Ready condition reason of a phase that ran out of retries: `DownloadFailed`, `QuantizationFailed`, …
pub fn failed_reason(p: JobPhase) -> String {
    let n = p.status_name();
    let mut c = n.chars();
    match c.next() {
        Some(f) => format!("{}{}Failed", f.to_ascii_uppercase(), c.as_str()),
        None => "Failed".into(),
    }
}

pub(super) fn phase_from_status_name(s: &str) -> Option<JobPhase> {
    JobPhase::parse(s)
}

pub(super) fn ts_add(now: Timestamp, d: Duration) -> Timestamp {
    now.checked_add(SignedDuration::try_from(d).unwrap_or(SignedDuration::ZERO))
        .unwrap_or(now)
}

/// A pipeline pod that has not started because the scheduler cannot place it or its image
/// cannot be pulled.
struct StuckPod {
    reason: contract::FailureReason,
    message: String,
    pod: String,
    since: Timestamp,
    /// Stuck for at least `Config::stuck_pod_after`: the attempt counts as failed.
    expired: bool,
    /// Time left before it does.
    remaining: Duration,
}

fn stuck_pod(job: &ObservedJob, config: &Config, now: Timestamp) -> Option<StuckPod> {
    let pod = job.pod.as_ref()?;
    let (reason, message) = stuck_reason(pod)?;
    let since = pod.created.unwrap_or(job.created);
    let age = secs_between(since, now).max(0);
    let limit = i64::try_from(config.stuck_pod_after.as_secs()).unwrap_or(i64::MAX);
    Some(StuckPod {
        reason,
        message,
        pod: pod.name.clone(),
        since,
        expired: age >= limit,
        remaining: Duration::from_secs(u64::try_from(limit.saturating_sub(age)).unwrap_or(0)),
    })
}

/// Say why the pod is waiting (condition; one event when it starts waiting) and come back when
/// the threshold passes.
fn report_stuck_pod(cx: &mut Ctx<'_>, job: &ObservedJob, stuck: &StuckPod) {
    let limit = cx.config.stuck_pod_after.as_secs();
    let msg = format!(
        "pod {} of Job {} has been waiting since {}: {}; the attempt fails after {limit}s",
        stuck.pod, job.name, stuck.since, stuck.message
    );
    let already = cx
        .st
        .conditions
        .iter()
        .any(|c| c.type_ == types::PROGRESSING && c.reason == stuck.reason.as_str());
    cx.cond(types::PROGRESSING, true, stuck.reason.as_str(), &msg);
    if !already {
        cx.job_event(true, stuck.reason.as_str(), msg, Some(&job.name));
    }
    cx.requeue(stuck.remaining.min(cx.config.progress_poll));
}

pub(super) fn secs_between(a: Timestamp, b: Timestamp) -> i64 {
    b.duration_since(a).as_secs()
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
}

impl Ctx<'_> {
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
        self.actions.push(Action::Event {
            warning,
            reason: reason.to_string(),
            note: truncate(&redact(&note), 1000),
            job: job.map(String::from),
        });
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

/// Plan one reconcile of `mc`.
pub fn plan(mc: &ModelCache, observed: &Observed, config: &Config, now: Timestamp) -> Plan {
    let old = mc.status.clone().unwrap_or_default();
    let mut cx = Ctx {
        mc,
        config,
        now,
        now_t: Time(now),
        gen: mc.metadata.generation,
        st: old.clone(),
        actions: Vec::new(),
        requeue: None,
        outcome: Outcome::default(),
    };
    let name = mc.metadata.name.clone().unwrap_or_default();
    let owns_pvc = mc.spec.existing_claim_name.is_none();
    let has_finalizer = mc.metadata.finalizers.as_ref().is_some_and(|f| {
        f.iter()
            .any(|x| x == contract::controller::FINALIZER_CLEANUP)
    });

    // Deletion: clean up the PVC we created, then let the object go. Jobs go with their owner.
    if mc.metadata.deletion_timestamp.is_some() {
        if has_finalizer {
            if owns_pvc && observed.pvc_exists {
                if observed.claim_peers.is_empty() {
                    cx.actions
                        .push(Action::DeletePvc(jobs::created_claim_name(&name)));
                } else {
                    let users: Vec<&str> = observed
                        .claim_peers
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect();
                    cx.event(
                        false,
                        reasons::CLAIM_KEPT,
                        format!(
                            "PersistentVolumeClaim {} is kept: ModelCache {} use it",
                            jobs::created_claim_name(&name),
                            users.join(", ")
                        ),
                    );
                }
            }
            cx.actions.push(Action::RemoveFinalizer);
        }
        return Plan {
            status: old,
            status_changed: false,
            actions: cx.actions,
            requeue_after: None,
            outcome: Outcome::default(),
        };
    }
    if owns_pvc && !has_finalizer {
        cx.actions.push(Action::AddFinalizer);
    }
    if owns_pvc && !observed.pvc_exists {
        cx.actions
            .push(Action::CreatePvc(Box::new(jobs::build_pvc(mc))));
    }
    cx.st.claim_name = Some(jobs::claim_name(mc));
    cx.st.observed_generation = cx.gen;
    if cx.st.phase.is_none() {
        cx.st.phase = Some(CachePhase::Pending);
    }
    if cx.st.retry_count.is_none() {
        cx.st.retry_count = Some(0);
    }

    let phases = jobs::enabled_phases(mc);
    // Remove conditions of phases that are no longer configured.
    for p in JobPhase::ALL {
        if !phases.contains(&p) {
            conditions::remove(&mut cx.st.conditions, phase_condition(p));
        }
    }

    // Specs the API admitted but no engine or configuration can run.
    if let Some(q) = &mc.spec.quantization {
        let info = formats::info(q.format);
        if !info.implemented {
            let msg = format!(
                "spec.quantization.format {} has no quantization engine in this FlexInfer version (supported: GPTQ); \
                 change the format or remove spec.quantization",
                info.name
            );
            cx.fail_config(reasons::UNSUPPORTED_FORMAT, &msg, Some(JobPhase::Quantize));
            return finish(cx, &old);
        }
    }
    if let Err(e) = contract::check_relative_path(&jobs::model_dir(mc)) {
        cx.fail_config(reasons::INVALID_SPEC, &format!("spec.modelPath: {e}"), None);
        return finish(cx, &old);
    }
    if let Some(msg) = jobs::invalid_pod_metadata_annotation(mc) {
        cx.fail_config(reasons::INVALID_SPEC, &msg, None);
        return finish(cx, &old);
    }
    let my_dir = jobs::model_dir(mc);
    if let Some(p) = observed
        .claim_peers
        .iter()
        .find(|p| p.older && p.model_dir == my_dir)
    {
        let msg = format!(
            "ModelCache {} already uses claim {} with modelPath {my_dir:?}: the two would overwrite each \
             other's files; set a different spec.modelPath",
            p.name,
            jobs::claim_name(mc)
        );
        cx.fail_config(reasons::CLAIM_CONFLICT, &msg, None);
        return finish(cx, &old);
    }

    // Jobs already being deleted (by us, now or earlier) are waited for.
    let mut deleting: BTreeSet<JobPhase> = observed
        .jobs
        .values()
        .filter(|j| j.terminating)
        .map(|j| j.phase)
        .collect();

    // A phase removed from the spec: forget its results and Job; its successors' input changed
    // (e.g. quantize reads the download directory instead of `abliterated/`), so they re-run.
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
            deleting.insert(p);
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
            invalidate(&mut cx, &later, observed, &mut deleting);
        }
    }

    // Trigger annotations.
    let mut remove = Vec::new();
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
    let mut rerun_from: Option<usize> = None;
    for (key, phase) in triggers {
        if !present(key) {
            continue;
        }
        remove.push(key.to_string());
        if jobs::annotation_true(mc, key) {
            if let Some(i) = phases.iter().position(|p| *p == phase) {
                rerun_from = Some(rerun_from.map_or(i, |r| r.min(i)));
                cx.event(
                    false,
                    reasons::RERUN_REQUESTED,
                    format!(
                        "{key}: re-running {} and the phases after it",
                        phase.status_name()
                    ),
                );
            }
        }
    }
    if let Some(i) = rerun_from {
        invalidate(&mut cx, &phases[i..], observed, &mut deleting);
        reset_retries(&mut cx.st);
    }
    if present(annotations::RESET_RETRIES) {
        remove.push(annotations::RESET_RETRIES.to_string());
        if jobs::annotation_true(mc, annotations::RESET_RETRIES) {
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
    }
    if !remove.is_empty() {
        cx.actions.push(Action::RemoveAnnotations(remove));
    }

    let force_image = jobs::annotation_true(mc, annotations::FORCE_IMAGE_UPDATE);
    let max_retries = mc.spec.max_retries.max(0);
    let mut all_done = true;

    for (i, &phase) in phases.iter().enumerate() {
        let target = jobs::resolve_target(mc, phase, &observed.profiles, config);
        let image = match &target.image {
            Ok(img) => img.clone(),
            Err(msg) => {
                all_done = false;
                cx.fail_config(reasons::IMAGE_NOT_CONFIGURED, msg, Some(phase));
                break;
            }
        };
        let desired = jobs::spec_hash(mc, phase, &image);
        let mut c = get_common(&cx.st, phase);
        let built_from_current_spec = c.image.as_deref().is_some_and(|img| {
            c.spec_hash.as_deref() == Some(jobs::spec_hash(mc, phase, img).as_str())
        });
        // Completed under the hash of an older controller that also covered run-only settings: current.
        let built_from_legacy_hash = c.image.as_deref().is_some_and(|img| {
            c.spec_hash.as_deref() == Some(jobs::legacy_spec_hash(mc, phase, img).as_str())
        });
        if c.completed_at.is_some() {
            if built_from_current_spec {
                continue;
            }
            if built_from_legacy_hash {
                if let Some(img) = c.image.clone() {
                    c.spec_hash = Some(jobs::spec_hash(mc, phase, &img));
                    set_common(&mut cx.st, phase, c);
                }
                continue;
            }
            // The phase's inputs changed: re-run it and what follows.
            cx.event(
                false,
                reasons::RERUN_REQUESTED,
                format!(
                    "spec of {} changed: re-running it and the phases after it",
                    phase.status_name()
                ),
            );
            invalidate(&mut cx, &phases[i..], observed, &mut deleting);
            c = get_common(&cx.st, phase);
        }
        all_done = false;
        let job = observed
            .jobs
            .get(&phase)
            .filter(|_| !deleting.contains(&phase));
        cx.st.current_phase = Some(phase.status_name().to_string());
        if cx.st.phase != Some(CachePhase::Failed) {
            cx.st.phase = Some(running_phase(phase));
        }
        if deleting.contains(&phase) {
            cx.requeue(Duration::from_secs(2));
            break;
        }
        let Some(job) = job else {
            let failed_here = cx
                .st
                .last_failure_phase
                .as_deref()
                .and_then(phase_from_status_name)
                == Some(phase);
            if failed_here && cx.st.phase == Some(CachePhase::Failed) {
                let run_hash = jobs::legacy_spec_hash(mc, phase, &image);
                let same_run_settings = c.run_hash.as_deref().is_none_or(|h| h == run_hash);
                if c.spec_hash.as_deref() == Some(desired.as_str()) && same_run_settings {
                    // Retries exhausted: stay Failed until reset-retries, the runbook status
                    // patch, or a change of this phase's spec or image.
                    break;
                }
                reset_retries(&mut cx.st);
                cx.st.phase = Some(running_phase(phase));
                cx.event(
                    false,
                    reasons::RERUN_REQUESTED,
                    format!(
                        "spec of {} changed after it failed: trying again",
                        phase.status_name()
                    ),
                );
            }
            if let Some(at) = cx
                .st
                .next_retry_at
                .as_ref()
                .map(|t| t.0)
                .filter(|t| failed_here && *t > now)
            {
                cx.requeue(Duration::from_millis(
                    at.duration_since(now).as_millis().max(0) as u64,
                ));
                break;
            }
            // A (re)started phase makes the results of every later phase stale.
            let later = phases.get(i.saturating_add(1)..).unwrap_or_default();
            invalidate(&mut cx, later, observed, &mut deleting);
            create_job(&mut cx, &target, &image, &desired, c, &observed.served_dirs);
            break;
        };
        // A running Job built from an older spec is replaced.
        // Only a change of what the artifact depends on replaces a running Job (a legacy hash of the same
        // inputs is current too); deadlines and memory limits apply to the next attempt.
        let job_spec_current = job.spec_hash.as_ref().is_some_and(|h| {
            *h == jobs::spec_hash(mc, phase, &job.image)
                || *h == jobs::legacy_spec_hash(mc, phase, &job.image)
        });
        if !job_spec_current && job.state != JobState::Succeeded {
            cx.actions.push(Action::DeleteJob(job.name.clone()));
            cx.event(
                false,
                reasons::RERUN_REQUESTED,
                format!(
                    "Job {} was built from an older spec; replacing it",
                    job.name
                ),
            );
            cx.requeue(Duration::from_secs(2));
            break;
        }
        match &job.state {
            JobState::Succeeded => {
                record_success(&mut cx, phase, job, c);
                all_done = true;
                continue;
            }
            JobState::Failed { .. } => {
                record_failure(&mut cx, phase, job, observed, c, max_retries);
                break;
            }
            JobState::Active => {
                if job
                    .pod
                    .as_ref()
                    .and_then(|p| p.waiting_reason.as_deref())
                    .is_some_and(|r| is_image_pull_failure(r) && !is_transient_pull_failure(r))
                {
                    // A malformed or never-pull image cannot recover by waiting.
                    record_failure(&mut cx, phase, job, observed, c, max_retries);
                    break;
                }
                if let Some(stuck) = stuck_pod(job, config, now) {
                    if stuck.expired {
                        record_failure(&mut cx, phase, job, observed, c, max_retries);
                    } else {
                        report_stuck_pod(&mut cx, job, &stuck);
                    }
                    break;
                }
                if phase == JobPhase::Quantize && job.image != image {
                    let age = secs_between(job.created, now).max(0);
                    let grace = config.drift_grace.as_secs() as i64;
                    if age < grace || force_image {
                        cx.actions.push(Action::DeleteJob(job.name.clone()));
                        cx.job_event(
                            true,
                            reasons::QUANTIZER_IMAGE_DRIFT,
                            format!(
                                "quantizer image changed from {} to {image}; Job {} ({}s old{}) is replaced",
                                job.image,
                                job.name,
                                age,
                                if force_image { ", force-image-update" } else { "" }
                            ),
                            Some(&job.name),
                        );
                        cx.requeue(Duration::from_secs(1));
                        break;
                    }
                    // Older than the grace window: let it finish; the new image applies next run.
                }
                update_progress(&mut cx, phase, job, observed, c);
                let spec_deadline = jobs::deadline_seconds(mc, phase);
                match job.deadline_seconds.filter(|d| *d != spec_deadline) {
                    // Run-only settings apply to the next attempt: say which value is in force.
                    Some(d) => cx.cond(
                        types::PROGRESSING,
                        true,
                        reasons::APPLIES_NEXT_ATTEMPT,
                        &format!(
                            "Job {} is running with its deadline of {d}s; the spec's {spec_deadline}s applies to the next attempt",
                            job.name
                        ),
                    ),
                    None => cx.cond(
                        types::PROGRESSING,
                        true,
                        running_phase(phase).as_str(),
                        &format!("Job {} is running", job.name),
                    ),
                }
                if cx.st.path.is_none() {
                    cx.cond(
                        types::READY,
                        false,
                        running_phase(phase).as_str(),
                        &format!("pipeline is at {}", phase.status_name()),
                    );
                }
                cx.requeue(config.progress_poll);
                break;
            }
        }
    }

    if all_done {
        let was_ready = old.phase == Some(CachePhase::Ready);
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
    // Per-phase conditions.
    for &p in &phases {
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
    finish(cx, &old)
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

/// `<8 hex of the spec hash>-<UTC yyyymmddhhmmss>`: unique per run start, sortable by time, names the
/// configuration it was made for.
pub fn new_generation(hash: &str, now: Timestamp) -> String {
    let t = now.strftime("%Y%m%d%H%M%S").to_string();
    let h: String = hash
        .chars()
        .filter(|c| c.is_ascii_hexdigit())
        .take(8)
        .collect();
    format!("{h}-{t}")
}

pub(super) fn set_generation(st: &mut ModelCacheStatus, phase: JobPhase, generation: String) {
    match phase {
        JobPhase::Download => {
            st.download
                .get_or_insert_with(DownloadStatus::default)
                .generation = Some(generation)
        }
        JobPhase::Abliterate => {
            st.abliteration
                .get_or_insert_with(AbliterationStatus::default)
                .generation = Some(generation)
        }
        JobPhase::Quantize => {
            st.quantization
                .get_or_insert_with(QuantizationStatus::default)
                .generation = Some(generation)
        }
        _ => {}
    }
}

pub(super) fn reset_retries(st: &mut ModelCacheStatus) {
    st.retry_count = Some(0);
    st.last_failure_phase = None;
    st.last_failure_time = None;
    st.next_retry_at = None;
}

/// Forget completion of `phases` (a re-run) and delete their Jobs. Results stay in status (and
/// `status.path` keeps pointing at the previous artifact) until the new run succeeds.
fn invalidate(
    cx: &mut Ctx<'_>,
    phases: &[JobPhase],
    observed: &Observed,
    deleting: &mut BTreeSet<JobPhase>,
) {
    for &p in phases {
        let mut c = get_common(&cx.st, p);
        c.completed_at = None;
        c.spec_hash = None;
        set_common(&mut cx.st, p, c);
        if let Some(j) = observed.jobs.get(&p) {
            if !j.terminating {
                cx.actions.push(Action::DeleteJob(j.name.clone()));
            }
            deleting.insert(p);
        }
    }
}

fn create_job(
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
    if cx.st.path.is_none() {
        cx.cond(
            types::READY,
            false,
            running_phase(phase).as_str(),
            &format!("pipeline is at {}", phase.status_name()),
        );
    }
    cx.job_event(false, reasons::JOB_CREATED, msg, Some(&jname));
}
