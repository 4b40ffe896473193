//! Planning step 4: walk the enabled phases in order and advance the first one that is not done:
//! keep completed phases that are current, start a missing Job, replace an outdated one, and
//! record what a finished or running Job says.

use std::time::Duration;

use flexinfer_api::conditions::types;
use flexinfer_api::contract::{self, annotations, reasons, JobPhase};
use flexinfer_api::modelcache::{CachePhase, PhaseProgress};
use k8s_openapi::jiff::Timestamp;

use super::config::Config;
use super::credentials::credentials_problem;
use super::ctx::{invalidate, Ctx};
use super::failures::{is_image_pull_failure, is_transient_pull_failure};
use super::jobs;
use super::observe::{stuck_reason, waits_for, JobState, ObservedJob};
use super::phase::{
    get_common, new_generation, phase_from_status_name, reset_retries, running_phase, secs_between,
    set_common, set_generation,
};
use super::results::{record_failure, record_success, update_progress};
use super::types::{Action, Observed};

/// The phase being advanced.
struct PhaseRun<'t> {
    /// Position in the enabled phases.
    index: usize,
    phase: JobPhase,
    target: &'t jobs::PhaseTarget,
    image: String,
    /// Spec hash of the phase with `image`.
    desired: String,
}

/// Advance the pipeline of `phases` (the enabled ones, in order). Returns whether every phase is
/// complete.
pub(super) fn advance(cx: &mut Ctx<'_>, phases: &[JobPhase], observed: &Observed) -> bool {
    let mut all_done = true;
    for (index, &phase) in phases.iter().enumerate() {
        let target = jobs::resolve_target(cx.mc, phase, &observed.profiles, cx.config);
        let image = match &target.image {
            Ok(img) => img.clone(),
            Err(e) => {
                all_done = false;
                cx.fail_config(reasons::IMAGE_NOT_CONFIGURED, &e.to_string(), Some(phase));
                break;
            }
        };
        if let Some(msg) = protected_profile_env(&target) {
            all_done = false;
            cx.fail_config(reasons::PROFILE_ENV_PROTECTED, &msg, Some(phase));
            break;
        }
        if completed_and_current(cx, phases, index, observed) {
            continue;
        }
        all_done = false;
        // Before the first Job that is to run: no phase still ahead may send a Secret's registry
        // credentials to a registry they may not go to (phases already done at this spec are kept).
        let ahead = phases.get(index..).unwrap_or_default();
        if let Some(p) = credentials_problem(cx.mc, &cx.config.credential_registries, ahead) {
            cx.fail_config(p.reason, &p.message, p.phase);
            break;
        }
        let run = PhaseRun {
            index,
            phase,
            target: &target,
            desired: jobs::spec_hash(cx.mc, phase, &image),
            image,
        };
        if !advance_phase(cx, phases, &run, observed) {
            break;
        }
        // Its Job has just succeeded: on to the next phase.
        all_done = true;
    }
    all_done
}

/// A GPUProfile (created before its CRD refused them) that sets variables FlexInfer sets itself: the
/// refusal, naming them.
fn protected_profile_env(target: &jobs::PhaseTarget) -> Option<String> {
    let p = target.profile.as_ref()?;
    let names: Vec<&str> = p
        .spec
        .env
        .iter()
        .map(|e| e.name.as_str())
        .filter(|n| contract::env::protected_from_profiles(n))
        .collect();
    (!names.is_empty()).then(|| {
        format!(
            "GPUProfile {} sets {} in spec.env, which FlexInfer sets itself for every Job; remove {} from the profile",
            p.metadata.name.as_deref().unwrap_or_default(),
            names.join(", "),
            if names.len() == 1 { "it" } else { "them" }
        )
    })
}

/// A completed phase built from the current spec (or from an older controller's hash of the same
/// inputs) stays done. One whose inputs changed is re-run with the phases after it.
fn completed_and_current(
    cx: &mut Ctx<'_>,
    phases: &[JobPhase],
    index: usize,
    observed: &Observed,
) -> bool {
    let Some(&phase) = phases.get(index) else {
        return false;
    };
    let mc = cx.mc;
    let mut c = get_common(&cx.st, phase);
    if c.completed_at.is_none() {
        return false;
    }
    let built_from_current_spec = c.image.as_deref().is_some_and(|img| {
        c.spec_hash.as_deref() == Some(jobs::spec_hash(mc, phase, img).as_str())
    });
    // Completed under the hash of an older controller that also covered run-only settings: current.
    let built_from_legacy_hash = c.image.as_deref().is_some_and(|img| {
        c.spec_hash.as_deref() == Some(jobs::legacy_spec_hash(mc, phase, img).as_str())
    });
    if built_from_current_spec {
        return true;
    }
    if built_from_legacy_hash {
        if let Some(img) = c.image.clone() {
            c.spec_hash = Some(jobs::spec_hash(mc, phase, &img));
            set_common(&mut cx.st, phase, c);
        }
        return true;
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
    invalidate(cx, phases.get(index..).unwrap_or_default(), observed);
    false
}

/// Advance a phase that is not done. Returns `true` when its Job has just succeeded (the next phase
/// may go on), `false` when the pipeline stops at this phase for now.
fn advance_phase(
    cx: &mut Ctx<'_>,
    phases: &[JobPhase],
    run: &PhaseRun<'_>,
    observed: &Observed,
) -> bool {
    let phase = run.phase;
    let c = get_common(&cx.st, phase);
    let deleting = cx.deleting.contains(&phase);
    cx.st.current_phase = Some(phase.status_name().to_string());
    if cx.st.phase != Some(CachePhase::Failed) {
        cx.st.phase = Some(running_phase(phase));
    }
    if deleting {
        cx.requeue(Duration::from_secs(2));
        return false;
    }
    let Some(job) = observed.jobs.get(&phase) else {
        start_phase(cx, phases, run, c, observed);
        return false;
    };
    if replace_outdated_job(cx, phase, job) {
        return false;
    }
    let max_retries = cx.mc.spec.max_retries.max(0);
    match &job.state {
        JobState::Succeeded => {
            record_success(cx, phase, job, c);
            true
        }
        JobState::Failed { .. } => {
            record_failure(cx, phase, job, observed, c, max_retries);
            false
        }
        JobState::Active => {
            follow_active_job(cx, run, job, c, observed, max_retries);
            false
        }
    }
}

/// A phase without a Job: stay failed when retries are exhausted for the same settings, wait for the
/// retry time, or create the Job (making the results of every later phase stale).
fn start_phase(
    cx: &mut Ctx<'_>,
    phases: &[JobPhase],
    run: &PhaseRun<'_>,
    c: PhaseProgress,
    observed: &Observed,
) {
    let (phase, now) = (run.phase, cx.now);
    let failed_here = cx
        .st
        .last_failure_phase
        .as_deref()
        .and_then(phase_from_status_name)
        == Some(phase);
    if failed_here && cx.st.phase == Some(CachePhase::Failed) {
        let run_hash = jobs::legacy_spec_hash(cx.mc, phase, &run.image);
        let same_run_settings = c.run_hash.as_deref().is_none_or(|h| h == run_hash);
        if c.spec_hash.as_deref() == Some(run.desired.as_str()) && same_run_settings {
            // Retries exhausted: stay Failed until reset-retries, the runbook status
            // patch, or a change of this phase's spec or image.
            return;
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
        return;
    }
    // A (re)started phase makes the results of every later phase stale.
    let later = phases
        .get(run.index.saturating_add(1)..)
        .unwrap_or_default();
    invalidate(cx, later, observed);
    create_job(
        cx,
        run.target,
        &run.image,
        &run.desired,
        c,
        &observed.served_dirs,
    );
}

/// A running Job built from an older spec is replaced (returns `true`).
/// Only a change of what the artifact depends on replaces a running Job (a legacy hash of the same
/// inputs is current too); deadlines and memory limits apply to the next attempt.
fn replace_outdated_job(cx: &mut Ctx<'_>, phase: JobPhase, job: &ObservedJob) -> bool {
    let mc = cx.mc;
    let job_spec_current = job.spec_hash.as_ref().is_some_and(|h| {
        *h == jobs::spec_hash(mc, phase, &job.image)
            || *h == jobs::legacy_spec_hash(mc, phase, &job.image)
    });
    if job_spec_current || job.state == JobState::Succeeded {
        return false;
    }
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
    true
}

/// A Job that is still active: fail it when its pod cannot start, replace it when the quantizer
/// image drifted, else record its progress and come back at the next poll.
fn follow_active_job(
    cx: &mut Ctx<'_>,
    run: &PhaseRun<'_>,
    job: &ObservedJob,
    c: PhaseProgress,
    observed: &Observed,
    max_retries: i32,
) {
    let phase = run.phase;
    if job
        .pod
        .as_ref()
        .and_then(|p| p.waiting_reason.as_deref())
        .is_some_and(|r| is_image_pull_failure(r) && !is_transient_pull_failure(r))
    {
        // A malformed or never-pull image cannot recover by waiting.
        record_failure(cx, phase, job, observed, c, max_retries);
        return;
    }
    if let Some(stuck) = stuck_pod(job, cx.config, cx.now) {
        if stuck.expired {
            record_failure(cx, phase, job, observed, c, max_retries);
        } else {
            report_stuck_pod(cx, job, &stuck);
        }
        return;
    }
    if replace_drifted_quantizer(cx, run, job) {
        return;
    }
    update_progress(cx, phase, job, observed, c);
    report_running(cx, phase, job);
}

/// A running quantize Job whose image is no longer the one configured is replaced while it is
/// younger than the drift grace window (or with `force-image-update`); an older one finishes and
/// the new image applies to the next run.
fn replace_drifted_quantizer(cx: &mut Ctx<'_>, run: &PhaseRun<'_>, job: &ObservedJob) -> bool {
    let image = &run.image;
    if run.phase != JobPhase::Quantize || job.image == *image {
        return false;
    }
    let force_image = jobs::annotation_true(cx.mc, annotations::FORCE_IMAGE_UPDATE);
    let age = secs_between(job.created, cx.now).max(0);
    let grace = cx.config.drift_grace.as_secs() as i64;
    if age >= grace && !force_image {
        return false;
    }
    cx.actions.push(Action::DeleteJob(job.name.clone()));
    cx.job_event(
        true,
        reasons::QUANTIZER_IMAGE_DRIFT,
        format!(
            "quantizer image changed from {} to {image}; Job {} ({}s old{}) is replaced",
            job.image,
            job.name,
            age,
            if force_image {
                ", force-image-update"
            } else {
                ""
            }
        ),
        Some(&job.name),
    );
    cx.requeue(Duration::from_secs(1));
    true
}

/// Conditions of a running Job (which deadline is in force) and the next progress poll.
fn report_running(cx: &mut Ctx<'_>, phase: JobPhase, job: &ObservedJob) {
    let spec_deadline = jobs::deadline_seconds(cx.mc, phase);
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
    cx.ready_pending_at(phase);
    cx.requeue(cx.config.progress_poll);
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
    /// Unschedulable only because the nodes that fit are full (GPUs, CPU, memory or pod slots in
    /// use), or until its volume claim is bound: a queue, not a fault. What it waits for; it waits
    /// without expiring.
    waits_for: Option<&'static str>,
    /// Time left before it does.
    remaining: Duration,
}

fn stuck_pod(job: &ObservedJob, config: &Config, now: Timestamp) -> Option<StuckPod> {
    let pod = job.pod.as_ref()?;
    let (reason, message) = stuck_reason(pod)?;
    let since = pod.created.unwrap_or(job.created);
    let age = secs_between(since, now).max(0);
    let limit = i64::try_from(config.stuck_pod_after.as_secs()).unwrap_or(i64::MAX);
    let waits_for = (reason == contract::FailureReason::Unschedulable)
        .then(|| waits_for(&message))
        .flatten();
    Some(StuckPod {
        reason,
        message,
        pod: pod.name.clone(),
        since,
        waits_for,
        expired: waits_for.is_none() && age >= limit,
        remaining: if waits_for.is_some() {
            config.progress_poll
        } else {
            Duration::from_secs(u64::try_from(limit.saturating_sub(age)).unwrap_or(0))
        },
    })
}

/// Say why the pod is waiting (condition; one event when it starts waiting) and come back when
/// the threshold passes.
fn report_stuck_pod(cx: &mut Ctx<'_>, job: &ObservedJob, stuck: &StuckPod) {
    let limit = cx.config.stuck_pod_after.as_secs();
    let msg = if let Some(what) = stuck.waits_for {
        format!(
            "pod {} of Job {} has been waiting since {} for {what}: {}; it starts when that is done (waiting for {what} does not fail the attempt)",
            stuck.pod, job.name, stuck.since, stuck.message
        )
    } else {
        format!(
            "pod {} of Job {} has been waiting since {}: {}; the attempt fails after {limit}s",
            stuck.pod, job.name, stuck.since, stuck.message
        )
    };
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
