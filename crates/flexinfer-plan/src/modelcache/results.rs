//! What a finished or running Job means for status: results from the termination message,
//! failure and retry bookkeeping, and progress (telemetry or elapsed estimate).

use std::collections::BTreeMap;

use flexinfer_api::conditions::types;
use flexinfer_api::contract::{self, reasons, JobPhase, TerminationMessage, TerminationSuccess};
use flexinfer_api::formats;
use flexinfer_api::modelcache::{CachePhase, ModelCache, PhaseProgress, QualityStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use super::ctx::Ctx;
use super::failures::{classify_failure, failure_text};
use super::jobs;
use super::observe::ObservedJob;
use super::phase::{
    complete_reason, failed_reason, get_common, phase_from_status_name, reset_retries,
    running_phase, secs_between, set_common, ts_add,
};
use super::types::{Action, LogTail, Observed};

fn rel_output_dir(raw: &str) -> Option<String> {
    let p = raw
        .strip_prefix(contract::CACHE_MOUNT)
        .map(|s| s.trim_start_matches('/'))
        .unwrap_or(raw);
    contract::check_relative_path(p)
        .ok()
        .map(|_| p.trim_end_matches('/').to_string())
}

/// The output a succeeded Job wrote (its termination message, else the generation in status) becomes
/// the phase's promoted output; returns it.
fn promote_output(cx: &mut Ctx<'_>, phase: JobPhase, reported: Option<&str>) -> String {
    let out = reported
        .and_then(rel_output_dir)
        .unwrap_or_else(|| jobs::phase_dirs(cx.mc, &cx.st, phase).1);
    let keep = cx.config.keep_generations;
    let (current, previous) = match phase {
        JobPhase::Download => {
            let d = cx.st.download.get_or_insert_with(Default::default);
            (&mut d.output_dir, &mut d.previous_output_dirs)
        }
        JobPhase::Abliterate => {
            let a = cx.st.abliteration.get_or_insert_with(Default::default);
            (&mut a.output_dir, &mut a.generations.previous_output_dirs)
        }
        JobPhase::Quantize => {
            let q = cx.st.quantization.get_or_insert_with(Default::default);
            (&mut q.output_dir, &mut q.generations.previous_output_dirs)
        }
        _ => return out,
    };
    promote(current, previous, out.clone(), keep);
    out
}

/// `out` becomes the promoted output; the one it replaces heads the kept earlier generations (at most
/// `keep`; the worker's garbage collection removes the rest from disk).
fn promote(
    current: &mut Option<String>,
    previous: &mut Option<Vec<String>>,
    out: String,
    keep: usize,
) {
    if let Some(old) = current.take().filter(|o| *o != out && !o.is_empty()) {
        let mut list = previous.take().unwrap_or_default();
        list.retain(|x| *x != old && *x != out);
        list.insert(0, old);
        list.truncate(keep);
        *previous = (!list.is_empty()).then_some(list);
    } else if let Some(list) = previous.as_mut() {
        list.retain(|x| *x != out);
    }
    *current = Some(out);
}

fn fmt_duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as i64;
    let (h, m, s) = (s / 3600, (s % 3600) / 60, s % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

/// A Job adopted after its status write was lost (a controller restart, a conflict) writes a generation
/// that status does not name: take it from the Job's `OUT_DIR`, so status names what is being written.
fn adopt_generation(cx: &mut Ctx<'_>, phase: JobPhase, job: &ObservedJob) {
    let (Some(out), Some(base)) = (job.out_dir.as_deref(), jobs::output_base(cx.mc, phase)) else {
        return;
    };
    let Some(g) = out
        .strip_prefix(base.as_str())
        .and_then(|r| r.strip_prefix(contract::files::GENERATION_SEPARATOR))
        .filter(|g| !g.is_empty())
    else {
        return;
    };
    if jobs::generation(&cx.st, phase).as_deref() != Some(g) {
        super::phase::set_generation(&mut cx.st, phase, g.to_string());
    }
}

pub(super) fn record_success(
    cx: &mut Ctx<'_>,
    phase: JobPhase,
    job: &ObservedJob,
    mut c: PhaseProgress,
) {
    adopt_generation(cx, phase, job);
    let now = cx.now_t.clone();
    c.completed_at = Some(now.clone());
    c.spec_hash = job.spec_hash.clone();
    c.image = Some(job.image.clone());
    if c.started_at.is_none() {
        c.started_at = Some(Time(job.created));
    }
    c.progress = Some(100);
    c.failure_message = None;
    c.last_progress_at = Some(now.clone());
    set_common(&mut cx.st, phase, c);
    let term = success_message(job);
    let mut note = format!("{} complete (Job {})", phase.status_name(), job.name);
    match phase {
        JobPhase::Download => record_download(cx, &term, &mut note),
        JobPhase::Abliterate => record_abliteration(cx, &term, &mut note),
        JobPhase::Quantize => record_quantization(cx, &term, &job.name, &mut note),
        JobPhase::Publish => record_publish(cx, &term, &now, &mut note),
    }
    if cx
        .st
        .last_failure_phase
        .as_deref()
        .and_then(phase_from_status_name)
        == Some(phase)
    {
        reset_retries(&mut cx.st);
    }
    cx.st.retry_count = Some(0);
    cx.outcome.completed.push(phase);
    cx.job_event(false, complete_reason(phase), note, Some(&job.name));
}

/// The worker's success termination message (empty when the pod left none, or a failure).
fn success_message(job: &ObservedJob) -> TerminationSuccess {
    job.pod
        .as_ref()
        .and_then(|p| p.termination_message.as_deref())
        .and_then(TerminationMessage::parse)
        .and_then(|m| match m {
            TerminationMessage::Success(s) => Some(s),
            TerminationMessage::Failure(_) => None,
        })
        .unwrap_or_default()
}

/// Records a finished download: its output (the model path itself for a download made before
/// generations), size, file count and revision.
fn record_download(cx: &mut Ctx<'_>, term: &TerminationSuccess, note: &mut String) {
    let phase = JobPhase::Download;
    let mc = cx.mc;
    // Downloaded before downloads had generations: `<modelPath>` itself is what is replaced.
    let legacy = jobs::legacy_download_root(mc, &cx.st);
    let d = cx.st.download.get_or_insert_with(Default::default);
    if legacy.is_some() {
        d.output_dir = legacy;
    }
    d.size_bytes = term
        .size_bytes
        .or(term.original_size_bytes)
        .map(|v| v as i64);
    d.file_count = term.file_count.map(|v| v as i64);
    d.revision = Some(
        term.revision
            .clone()
            .unwrap_or_else(|| mc.spec.revision.clone()),
    );
    let out = promote_output(cx, phase, term.output_dir.as_deref());
    note.push_str(&format!(", output {out}"));
}

/// Records a finished abliteration: the layers modified, the direction's layer and norm, the
/// perplexity before and after, and its output.
fn record_abliteration(cx: &mut Ctx<'_>, term: &TerminationSuccess, note: &mut String) {
    let phase = JobPhase::Abliterate;
    let a = cx.st.abliteration.get_or_insert_with(Default::default);
    a.layers_modified = term.layers_modified.map(|v| v as i64);
    a.refusal_dir_norm = term.refusal_dir_norm.map(|v| format!("{v:.3}"));
    a.layer = term.layer.map(|v| v as i64);
    a.perplexity_before = term.perplexity_before.map(|v| format!("{v:.3}"));
    a.perplexity_after = term.perplexity_after.map(|v| format!("{v:.3}"));
    let out = promote_output(cx, phase, term.output_dir.as_deref());
    note.push_str(&format!(", output {out}"));
}

/// Records a finished quantization: format, quant type, sizes and compression ratio, time,
/// calibration, its output, the applied settings and the quality gate. A `useGPU` quantization whose
/// solves ran on the CPU although the worker was not told to (`GPTQ_DEVICE` other than `cpu`) gets a
/// Warning event with the worker's reason.
fn record_quantization(cx: &mut Ctx<'_>, term: &TerminationSuccess, job: &str, note: &mut String) {
    let phase = JobPhase::Quantize;
    let mc = cx.mc;
    if let Some(d) = &term.gptq_device {
        // The worker bounds it; the controller does not rely on that.
        note_device(cx, &d.clone().bounded(), job);
    }
    let started = get_common(&cx.st, phase).started_at.map(|t| t.0);
    let q = cx.st.quantization.get_or_insert_with(Default::default);
    let spec = mc.spec.quantization.clone();
    q.format = spec
        .as_ref()
        .map(|s| formats::info(s.format).name.to_string());
    q.quant_type = Some(
        spec.as_ref()
            .map(|s| s.output_subdir())
            .filter(|_| term.kind.is_empty() || term.kind == "quantize")
            .unwrap_or_else(|| term.kind.clone()),
    );
    q.original_size_bytes = term.original_size_bytes.map(|v| v as i64);
    q.compressed_size_bytes = term.compressed_size_bytes.map(|v| v as i64);
    q.compression_ratio = match (term.original_size_bytes, term.compressed_size_bytes) {
        (Some(o), Some(c)) if c > 0 => Some(((o as f64 / c as f64) * 100.0).round() / 100.0),
        _ => None,
    };
    let secs = term
        .quantization_time_seconds
        .or_else(|| started.map(|s| cx.now.duration_since(s).as_secs_f64()));
    q.quantization_time = secs.map(fmt_duration);
    if let Some(s) = &spec {
        let cal = s.effective_calibration();
        let mut m = BTreeMap::from([
            ("maxSeqLen".to_string(), cal.max_seq_len.to_string()),
            ("maxSamples".to_string(), cal.max_samples.to_string()),
            ("dataset".to_string(), cal.dataset.clone()),
        ]);
        if let Some(n) = cal.n_parallel_calib_samples {
            m.insert("nParallelCalibSamples".into(), n.to_string());
        }
        q.calibration_params = Some(m);
    }
    let out = promote_output(cx, phase, term.output_dir.as_deref());
    let q = cx.st.quantization.get_or_insert_with(Default::default);
    q.config_digest = term.config_digest.clone();
    if !term.applied.is_empty() {
        q.applied = Some(term.applied.clone());
    }
    note.push_str(&format!(", output {out}"));
    q.quality = term.quality.as_ref().map(|g| QualityStatus {
        gptq_modules: Some(g.gptq_modules as i64),
        rtn_fallback_modules: Some(g.rtn_fallback_modules as i64),
        rtn_fallback_percent: Some(g.rtn_fallback_percent),
        gate: Some(g.gate.clone()),
    });
    if let Some(r) = q.compression_ratio {
        note.push_str(&format!(", compression ratio {r}"));
    }
}

/// Records the device in `status.quantization` when it is new to the status, and then, for a `useGPU`
/// quantization on the CPU without `GPTQ_DEVICE=cpu`, a [`reasons::QUANTIZED_ON_CPU`] Warning event with the
/// worker's reason: once per run (seen while it runs, or at its end when the log was not read in time). Every
/// report read sets the outcome's `gptq_on_cpu` (the `flexinfer_quantization_on_cpu` gauge).
pub(super) fn note_device(cx: &mut Ctx<'_>, d: &contract::GptqDeviceReport, job: &str) {
    let on_cpu = on_cpu_with_use_gpu(cx.mc, d);
    cx.outcome.gptq_on_cpu = Some(on_cpu);
    let q = cx.st.quantization.get_or_insert_with(Default::default);
    // Kind and setting also for a device already in the status (one written by an older controller).
    q.gptq_device_kind = Some(d.kind.clone());
    q.gptq_device_requested = Some(d.requested.clone());
    if q.gptq_device.as_deref() == Some(d.device.as_str()) {
        return;
    }
    q.gptq_device = Some(d.device.clone());
    q.gptq_device_reason = (!d.reason.is_empty()).then(|| d.reason.clone());
    if on_cpu {
        let reason = if d.reason.is_empty() {
            "no reason reported"
        } else {
            d.reason.as_str()
        };
        cx.job_event(
            true,
            reasons::QUANTIZED_ON_CPU,
            format!("useGPU is set, but the GPTQ solves run on the CPU: {reason}"),
            Some(job),
        );
    }
}

/// The running quantization's `gptq_on_cpu` from the device report already in the status (this run's: a new
/// run clears it), when this reconcile read none: the worker's event has left the log tail the controller
/// reads, e.g. after a controller restart late in a long run. `None` without a report, or one from a
/// controller that did not record its kind and setting.
fn device_in_status(cx: &Ctx<'_>) -> Option<bool> {
    let q = cx.st.quantization.as_ref()?;
    let report = contract::GptqDeviceReport {
        requested: q.gptq_device_requested.clone()?,
        device: q.gptq_device.clone()?,
        kind: q.gptq_device_kind.clone()?,
        reason: String::new(),
    };
    Some(on_cpu_with_use_gpu(cx.mc, &report))
}

/// A `useGPU` quantization whose solves run on the CPU unasked: the `QuantizedOnCPU` condition.
fn on_cpu_with_use_gpu(mc: &ModelCache, d: &contract::GptqDeviceReport) -> bool {
    d.on_cpu_unasked() && jobs::uses_gpu(mc, JobPhase::Quantize)
}

/// Records a finished publish: the pushed digest (the one it replaces goes first in the previous
/// digests, five kept), the tags and the time.
fn record_publish(cx: &mut Ctx<'_>, term: &TerminationSuccess, now: &Time, note: &mut String) {
    let p = cx.st.publish.get_or_insert_with(Default::default);
    if let Some(d) = &term.digest {
        if let Some(prev) = p.oci_digest.clone().filter(|x| x != d) {
            let mut list = p.previous_digests.clone().unwrap_or_default();
            list.retain(|x| *x != prev);
            list.insert(0, prev);
            list.truncate(5);
            p.previous_digests = Some(list);
        }
        p.oci_digest = Some(d.clone());
        note.push_str(&format!(", digest {d}"));
    }
    p.published_tags = (!term.tags.is_empty()).then(|| term.tags.clone());
    p.published_at = Some(now.clone());
}

pub(super) fn record_failure(
    cx: &mut Ctx<'_>,
    phase: JobPhase,
    job: &ObservedJob,
    observed: &Observed,
    mut c: PhaseProgress,
    max_retries: i32,
) {
    adopt_generation(cx, phase, job);
    let reason = classify_failure(job);
    let text = failure_text(job, observed.log_tail.as_ref());
    let failure = Failure {
        msg: format!("{reason}: {text}"),
        reason,
        text,
    };
    if reason == contract::FailureReason::QualityGateFailed {
        reject_generation(cx, phase, job);
    }
    c.failure_message = Some(failure.msg.clone());
    set_common(&mut cx.st, phase, c);
    cx.st.last_failure_phase = Some(phase.status_name().to_string());
    cx.st.last_failure_time = Some(cx.now_t.clone());
    cx.actions.push(Action::DeleteJob(job.name.clone()));
    cx.outcome.failed.push((phase, reason.to_string()));
    let n = cx.st.retry_count.unwrap_or(0).max(0);
    if n < max_retries {
        schedule_retry(cx, phase, job, &failure, n, max_retries);
    } else {
        give_up(cx, phase, job, &failure, max_retries);
    }
}

/// Why a Job failed: the classified reason, the failure text, and `<reason>: <text>`.
struct Failure {
    reason: contract::FailureReason,
    text: String,
    msg: String,
}

/// A gate rejected the run's generation. The gate ran before anything was promoted, so the
/// served artifact and `status.path` stay: records the rejected generation and says so in an
/// event.
fn reject_generation(cx: &mut Ctx<'_>, phase: JobPhase, job: &ObservedJob) {
    let generation = jobs::generation(&cx.st, phase);
    let kept = jobs::promoted_dir(&cx.st, phase);
    match phase {
        JobPhase::Abliterate => {
            cx.st
                .abliteration
                .get_or_insert_with(Default::default)
                .generations
                .rejected_generation = generation.clone()
        }
        JobPhase::Quantize => {
            cx.st
                .quantization
                .get_or_insert_with(Default::default)
                .generations
                .rejected_generation = generation.clone()
        }
        _ => {}
    }
    cx.job_event(
        true,
        reasons::GENERATION_REJECTED,
        format!(
            "{} generation {} was rejected by its gate; {}",
            phase.status_name(),
            generation.unwrap_or_default(),
            match kept {
                Some(k) => format!("the promoted output {k} is unchanged"),
                None => "nothing was promoted".into(),
            }
        ),
        Some(&job.name),
    );
}

/// Retries left (`n` of `max_retries` used): schedules attempt `n + 1` after the backoff delay
/// and reports it as progressing but degraded.
fn schedule_retry(
    cx: &mut Ctx<'_>,
    phase: JobPhase,
    job: &ObservedJob,
    f: &Failure,
    n: i32,
    max_retries: i32,
) {
    let reason = f.reason;
    let delay = cx.config.retry_delay(n as u32);
    cx.st.retry_count = Some(n.saturating_add(1));
    cx.st.next_retry_at = Some(Time(ts_add(cx.now, delay)));
    cx.st.phase = Some(running_phase(phase));
    let note = format!(
        "{} failed ({reason}); retry {}/{} in {}s: {}",
        phase.status_name(),
        n.saturating_add(1),
        max_retries,
        delay.as_secs(),
        f.text
    );
    cx.cond(types::PROGRESSING, true, reasons::RETRYING, &note);
    cx.cond(types::DEGRADED, true, reason.as_str(), &f.msg);
    cx.job_event(true, reasons::RETRYING, note, Some(&job.name));
    cx.requeue(delay);
}

/// No retries left: the cache fails (not ready, not progressing, degraded).
fn give_up(cx: &mut Ctx<'_>, phase: JobPhase, job: &ObservedJob, f: &Failure, max_retries: i32) {
    let reason = f.reason;
    let r = failed_reason(phase);
    cx.st.phase = Some(CachePhase::Failed);
    cx.st.next_retry_at = None;
    let note = format!(
        "{} failed after {} retries ({reason}): {}",
        phase.status_name(),
        max_retries,
        f.text
    );
    cx.cond(types::READY, false, &r, &f.msg);
    cx.cond(types::PROGRESSING, false, &r, &note);
    cx.cond(types::DEGRADED, true, reason.as_str(), &f.msg);
    cx.job_event(true, reasons::PHASE_FAILED, note, Some(&job.name));
}

pub(super) fn update_progress(
    cx: &mut Ctx<'_>,
    phase: JobPhase,
    job: &ObservedJob,
    observed: &Observed,
    mut c: PhaseProgress,
) {
    let now = cx.now;
    adopt_generation(cx, phase, job);
    // Adopt a Job created before a status write was lost (e.g. controller restart).
    if c.started_at.is_none() {
        c.started_at = Some(Time(job.created));
        c.spec_hash = job.spec_hash.clone();
        c.image = Some(job.image.clone());
    }
    let old = c.progress.unwrap_or(0);
    // The deadline in force is the running Job's; a changed spec applies to the next attempt.
    let spec_deadline = jobs::deadline_seconds(cx.mc, phase);
    let deadline = job.deadline_seconds.unwrap_or(spec_deadline).max(1);

    let elapsed = secs_between(job.started, now).max(0);
    cx.outcome.running = Some((phase, deadline, elapsed));
    if phase == JobPhase::Quantize {
        if let Some(d) = match &observed.log_tail {
            Some(LogTail::Read(text)) => {
                contract::latest_event(text, contract::events::GPTQ_DEVICE_SELECTED)
                    .and_then(|e| e.gptq_device())
            }
            _ => None,
        } {
            note_device(cx, &d, &job.name);
        } else {
            cx.outcome.gptq_on_cpu = device_in_status(cx);
        }
    }
    let telemetry = match &observed.log_tail {
        Some(LogTail::Read(text)) => contract::latest_progress(text).filter(|(_, p)| {
            p.phase
                .as_deref()
                .is_none_or(|ph| ph == phase.status_name() || ph == phase.as_str())
        }),
        _ => None,
    };
    if let Some((ts, p)) = telemetry {
        let pct = (p.percent.floor() as i32).clamp(0, 100);
        let new = old.max(pct);
        let detail = p.detail.clone().or(c.progress_detail.clone());
        if new != old
            || c.progress_source.as_deref() != Some("telemetry")
            || detail != c.progress_detail
        {
            c.progress = Some(new);
            c.progress_detail = detail;
            c.progress_source = Some("telemetry".into());
            c.last_progress_at = Some(Time(ts.parse::<Timestamp>().unwrap_or(now)));
        }
        cx.outcome.telemetry = Some(p);
    } else if c.progress_source.as_deref() != Some("telemetry") {
        // No telemetry (yet, or an image without it): elapsed / deadline, capped at 99.
        let est = ((elapsed as f64 / deadline as f64) * 100.0)
            .floor()
            .min(99.0) as i32;
        let new = old.max(est);
        if new != old || c.progress_source.is_none() {
            c.progress = Some(new);
            c.progress_source = Some("elapsed-estimate".into());
            c.progress_detail = Some(format!("{elapsed}s of {deadline}s deadline"));
            c.last_progress_at = Some(Time(now));
        }
    }
    // A failed log read (or a tail without events) keeps the last trustworthy value.
    cx.st.progress = c.progress;
    set_common(&mut cx.st, phase, c);
}
