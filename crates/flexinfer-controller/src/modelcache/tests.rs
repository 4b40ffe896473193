//! Table-driven tests of the pure planner and the Job builders.

use std::collections::BTreeMap;
use std::time::Duration;

use flexinfer_api::conditions;
use flexinfer_api::contract::{annotations, JobPhase};
use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::modelcache::{CachePhase, ModelCache};
use k8s_openapi::jiff::Timestamp;
use sha2::{Digest, Sha256};

use super::config::Config;
use super::jobs;
use super::observe::{JobState, ObservedJob, ObservedPod};
use super::plan::{plan, redact, Action, ClaimPeer, Observed, Plan};

fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + s).unwrap_or_default()
}

fn cfg() -> Config {
    Config {
        worker_image: Some("worker:1".into()),
        ..Config::default()
    }
}

const FULL: &str = r#"
apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {name: mc, namespace: ns, uid: u-1, generation: 1}
spec:
  source: org/model
  nodeSelector: {flexinfer.ai/gpu.arch: gfx1100}
  maxRetries: 2
  abliteration: {useGPU: true}
  quantization: {format: GPTQ, useGPU: true}
  publish: {ociRef: "reg.local/models/mc"}
"#;

const SIMPLE: &str = r#"
apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {name: mc, namespace: ns, uid: u-1, generation: 1, finalizers: [flexinfer.ai/modelcache-cleanup]}
spec:
  source: org/model
  maxRetries: 2
  quantization: {format: GPTQ}
"#;

fn cache(y: &str) -> ModelCache {
    serde_norway::from_str(y).expect("test manifest")
}

fn profile(arch: &str, image: &str) -> GPUProfile {
    serde_norway::from_str(&format!(
        "apiVersion: ai.flexinfer/v1alpha2\nkind: GPUProfile\nmetadata: {{name: {arch}, namespace: ns}}\n\
         spec: {{architecture: {arch}, vendor: amd, gpuDriverMemoryMB: 12288, vramMB: 24576,\n\
         env: [{{name: HSA_OVERRIDE_GFX_VERSION, value: '11.0.0'}}],\n\
         quantization: {{images: {{GPTQ: '{image}'}}}}}}"
    ))
    .expect("profile")
}

/// Apply a plan's status (and finalizer) to the object, as the reconciler would.
fn applied(mut mc: ModelCache, p: &Plan) -> ModelCache {
    mc.status = Some(p.status.clone());
    for a in &p.actions {
        match a {
            Action::AddFinalizer => mc
                .metadata
                .finalizers
                .get_or_insert_with(Vec::new)
                .push("flexinfer.ai/modelcache-cleanup".into()),
            Action::RemoveAnnotations(keys) => {
                if let Some(an) = mc.metadata.annotations.as_mut() {
                    for k in keys {
                        an.remove(k);
                    }
                }
            }
            _ => {}
        }
    }
    mc
}

fn created_jobs(p: &Plan) -> Vec<String> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::CreateJob(j) => j.metadata.name.clone(),
            _ => None,
        })
        .collect()
}

fn deleted_jobs(p: &Plan) -> Vec<String> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::DeleteJob(n) => Some(n.clone()),
            _ => None,
        })
        .collect()
}

fn events(p: &Plan) -> Vec<String> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::Event { reason, .. } => Some(reason.clone()),
            _ => None,
        })
        .collect()
}

/// The Job a plan created, as the cluster would report it in `state`.
fn job_from(p: &Plan, phase: JobPhase, created: Timestamp, state: JobState) -> ObservedJob {
    let j = p
        .actions
        .iter()
        .find_map(|a| match a {
            Action::CreateJob(j)
                if j.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.ends_with(phase.as_str())) =>
            {
                Some(j.clone())
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("plan created no {phase:?} Job: {:?}", p.actions));
    let image = j
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|s| s.containers[0].image.clone().unwrap_or_default())
        .unwrap_or_default();
    ObservedJob {
        phase,
        name: j.metadata.name.clone().unwrap_or_default(),
        image,
        spec_hash: j
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("flexinfer.ai/spec-hash").cloned()),
        created,
        started: created,
        terminating: false,
        state,
        pod: None,
        deadline_seconds: None,
        out_dir: super::observe::job_out_dir(&j),
    }
}

fn obs(jobs: Vec<ObservedJob>) -> Observed {
    Observed {
        jobs: jobs.into_iter().map(|j| (j.phase, j)).collect(),
        pvc_exists: true,
        profiles: vec![profile("gfx1100", "q:a")],
        log_tail: None,
        ..Default::default()
    }
}

/// Drive the simple cache (download → quantize) to Ready; returns the Ready object.
fn ready_simple() -> ModelCache {
    let c = cfg();
    let mc = cache(SIMPLE);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let dl = job_from(&p, JobPhase::Download, t(1), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone()]), &c, t(10));
    let q = job_from(&p, JobPhase::Quantize, t(11), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl, q]), &c, t(20));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    applied(mc, &p)
}

#[test]
fn fresh_cache_gets_finalizer_pvc_and_download_job() {
    let p = plan(&cache(FULL), &Observed::default(), &cfg(), t(0));
    assert!(p.actions.contains(&Action::AddFinalizer));
    assert!(p.actions.iter().any(|a| matches!(a, Action::CreatePvc(_))));
    assert_eq!(created_jobs(&p), vec!["mc-download"]);
    assert_eq!(p.status.phase, Some(CachePhase::Downloading));
    assert_eq!(p.status.current_phase.as_deref(), Some("download"));
    assert_eq!(p.status.claim_name.as_deref(), Some("mc-cache"));
    assert!(p.status_changed);
    assert!(events(&p).contains(&"JobCreated".to_string()));
}

#[test]
fn existing_claim_gets_no_finalizer_and_no_pvc() {
    let y = SIMPLE.replace(
        "source: org/model",
        "source: org/model\n  existingClaimName: shared",
    );
    let mut mc = cache(&y);
    mc.metadata.finalizers = None;
    let p = plan(&mc, &Observed::default(), &cfg(), t(0));
    assert!(!p
        .actions
        .iter()
        .any(|a| matches!(a, Action::AddFinalizer | Action::CreatePvc(_))));
    assert_eq!(p.status.claim_name.as_deref(), Some("shared"));
}

#[test]
fn full_pipeline_walks_phases_in_order_and_ready_is_stable() {
    let c = cfg();
    let mut mc = cache(FULL);
    let mut seen = Vec::new();
    let mut done: Vec<ObservedJob> = Vec::new();
    let mut now = 0;
    let mut p = plan(&mc, &obs(vec![]), &c, t(now));
    for phase in [
        JobPhase::Download,
        JobPhase::Abliterate,
        JobPhase::Quantize,
        JobPhase::Publish,
    ] {
        seen.push(p.status.phase);
        assert_eq!(created_jobs(&p), vec![phase.job_name("mc")], "at {phase:?}");
        let j = job_from(&p, phase, t(now + 1), JobState::Succeeded);
        mc = applied(mc, &p);
        done.push(j);
        now += 10;
        p = plan(&mc, &obs(done.clone()), &c, t(now));
    }
    assert_eq!(
        seen,
        vec![
            Some(CachePhase::Downloading),
            Some(CachePhase::Abliterating),
            Some(CachePhase::Quantizing),
            Some(CachePhase::Publishing)
        ]
    );
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    // The path names the promoted generation of the quantized output.
    let q = p.status.quantization.clone().expect("quantization status");
    let out = q.output_dir.clone().expect("outputDir");
    let generation = q.generation.clone().expect("generation");
    assert_eq!(out, format!("mc/gptq-w4-g128.{generation}"));
    assert_eq!(p.status.path, Some(format!("mc-cache:{out}")));
    assert!(conditions::is_true(&p.status.conditions, "Ready"));
    for c in ["Downloaded", "Abliterated", "Quantized", "Published"] {
        assert!(conditions::is_true(&p.status.conditions, c), "{c}");
    }
    assert!(events(&p).contains(&"CacheReady".to_string()));
    // Next reconcile: nothing to do, nothing to write.
    mc = applied(mc, &p);
    let again = plan(&mc, &obs(done.clone()), &c, t(now + 100));
    assert!(!again.status_changed, "status rewritten without change");
    assert!(again.actions.is_empty(), "{:?}", again.actions);
    // Jobs garbage-collected after success: phases do not re-run.
    let gc = plan(&mc, &obs(vec![]), &c, t(now + 200));
    assert!(created_jobs(&gc).is_empty());
    assert!(!gc.status_changed);
}

#[test]
fn retry_backoff_then_exhaustion_then_recovery() {
    let c = cfg();
    let mc = ready_simple();
    // Run the quantize phase again through a spec-independent trigger.
    let mut mc = mc;
    mc.metadata.annotations = Some(BTreeMap::from([(
        annotations::REQUANTIZE.into(),
        "true".into(),
    )]));
    let p = plan(&mc, &obs(vec![]), &c, t(100));
    let mut mc = applied(mc, &p);
    let mut now = 100;
    let mut p = plan(&mc, &obs(vec![]), &c, t(now));
    let mut delays = Vec::new();
    for attempt in 0..3 {
        let failed = job_from(
            &p,
            JobPhase::Quantize,
            t(now),
            JobState::Failed {
                reason: "BackoffLimitExceeded".into(),
                message: String::new(),
            },
        );
        mc = applied(mc, &p);
        now += 5;
        p = plan(&mc, &obs(vec![failed]), &c, t(now));
        assert_eq!(deleted_jobs(&p), vec!["mc-quantize"], "attempt {attempt}");
        mc = applied(mc, &p);
        if attempt < 2 {
            assert_eq!(p.status.retry_count, Some(attempt + 1));
            assert_eq!(p.status.phase, Some(CachePhase::Quantizing));
            let d = p.requeue_after.expect("requeue");
            delays.push(d.as_secs());
            // Before the backoff elapses: no Job.
            let early = plan(&mc, &obs(vec![]), &c, t(now + d.as_secs() as i64 - 1));
            assert!(created_jobs(&early).is_empty());
            now += d.as_secs() as i64 + 1;
            p = plan(&mc, &obs(vec![]), &c, t(now));
            assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
        } else {
            assert_eq!(p.status.phase, Some(CachePhase::Failed));
            let ready = conditions::find(&p.status.conditions, "Ready").expect("ready cond");
            assert_eq!(ready.status, "False");
            assert_eq!(ready.reason, "QuantizationFailed");
            assert!(
                ready.message.starts_with("BackoffLimitExceeded"),
                "{}",
                ready.message
            );
            assert!(events(&p).contains(&"PhaseFailed".to_string()));
        }
    }
    assert_eq!(delays, vec![30, 60]);
    assert_eq!(
        mc.status
            .as_ref()
            .and_then(|s| s.last_failure_phase.clone())
            .as_deref(),
        Some("quantization")
    );
    // Exhausted: stays Failed, creates nothing, writes nothing.
    let stuck = plan(&mc, &obs(vec![]), &c, t(now + 10_000));
    assert!(created_jobs(&stuck).is_empty());
    assert!(!stuck.status_changed);

    // Recovery 1: reset-retries annotation.
    let mut reset = mc.clone();
    reset.metadata.annotations = Some(BTreeMap::from([(
        annotations::RESET_RETRIES.into(),
        "true".into(),
    )]));
    let r = plan(&reset, &obs(vec![]), &c, t(now + 20));
    assert_eq!(created_jobs(&r), vec!["mc-quantize"]);
    assert!(r.actions.contains(&Action::RemoveAnnotations(vec![
        annotations::RESET_RETRIES.into()
    ])));
    assert_eq!(r.status.retry_count, Some(0));
    assert_eq!(r.status.phase, Some(CachePhase::Quantizing));

    // Recovery 2: the runbook's status merge patch.
    let mut patched = mc.clone();
    if let Some(s) = patched.status.as_mut() {
        s.phase = Some(CachePhase::Quantizing);
        s.retry_count = Some(0);
        s.last_failure_phase = None;
        s.last_failure_time = None;
    }
    let r = plan(&patched, &obs(vec![]), &c, t(now + 20));
    assert_eq!(created_jobs(&r), vec!["mc-quantize"]);
}

#[test]
fn zero_max_retries_fails_at_first_failure() {
    let c = cfg();
    let mc = cache(&SIMPLE.replace("maxRetries: 2", "maxRetries: 0"));
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let j = job_from(
        &p,
        JobPhase::Download,
        t(0),
        JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: String::new(),
        },
    );
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![j]), &c, t(5));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    assert_eq!(
        conditions::find(&p.status.conditions, "Ready").map(|c| c.reason.as_str()),
        Some("DownloadFailed")
    );
}

#[test]
fn failures_are_classified() {
    let base = ObservedJob {
        phase: JobPhase::Quantize,
        name: "mc-quantize".into(),
        image: "i".into(),
        spec_hash: None,
        created: t(0),
        started: t(0),
        terminating: false,
        state: JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: String::new(),
        },
        pod: None,
        deadline_seconds: None,
        out_dir: None,
    };
    let pod = |term: Option<&str>, wait: Option<&str>| {
        Some(ObservedPod {
            terminated_reason: term.map(String::from),
            waiting_reason: wait.map(String::from),
            ..Default::default()
        })
    };
    let cases = vec![
        (
            JobState::Failed {
                reason: "BackoffLimitExceeded".into(),
                message: String::new(),
            },
            pod(Some("OOMKilled"), None),
            "OOMKilled",
        ),
        (
            JobState::Failed {
                reason: "DeadlineExceeded".into(),
                message: String::new(),
            },
            pod(Some("Error"), None),
            "DeadlineExceeded",
        ),
        (
            JobState::Active,
            pod(None, Some("ImagePullBackOff")),
            "ImagePullBackOff",
        ),
        (
            JobState::Failed {
                reason: "BackoffLimitExceeded".into(),
                message: String::new(),
            },
            pod(Some("Error"), None),
            "BackoffLimitExceeded",
        ),
        (
            JobState::Failed {
                reason: "PodFailurePolicy".into(),
                message: String::new(),
            },
            None,
            "JobFailed",
        ),
        (
            JobState::Failed {
                reason: "PodFailurePolicy".into(),
                message: String::new(),
            },
            Some(ObservedPod {
                exit_code: Some(3),
                terminated_reason: Some("Error".into()),
                ..Default::default()
            }),
            "QualityGateFailed",
        ),
        (
            JobState::Failed {
                reason: "PodFailurePolicy".into(),
                message: String::new(),
            },
            Some(ObservedPod {
                exit_code: Some(4),
                terminated_reason: Some("Error".into()),
                ..Default::default()
            }),
            "ScriptVersionMismatch",
        ),
    ];
    for (state, pod, want) in cases {
        let j = ObservedJob {
            state,
            pod,
            ..base.clone()
        };
        assert_eq!(super::plan::classify_failure(&j).as_str(), want);
    }
}

fn running_quantize(
    log: Option<Result<String, String>>,
    mc: &ModelCache,
    now: i64,
) -> (Plan, ObservedJob) {
    let c = cfg();
    let p0 = plan(mc, &obs(vec![]), &c, t(0));
    let mut j = job_from(&p0, JobPhase::Quantize, t(0), JobState::Active);
    j.pod = Some(ObservedPod {
        name: "p".into(),
        running: true,
        ..Default::default()
    });
    let mut o = obs(vec![j.clone()]);
    o.log_tail = log;
    let mc2 = applied(mc.clone(), &p0);
    (plan(&mc2, &o, &c, t(now)), j)
}

/// A cache whose download is done and whose quantize phase is next.
fn downloaded() -> ModelCache {
    let c = cfg();
    let mc = cache(SIMPLE);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let dl = job_from(&p, JobPhase::Download, t(0), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl]), &c, t(0));
    let mut mc = applied(mc, &p);
    // Forget the quantize Job that plan just created (tests create their own).
    if let Some(q) = mc.status.as_mut().and_then(|s| s.quantization.as_mut()) {
        *q = Default::default();
    }
    mc
}

#[test]
fn progress_is_monotonic_and_keeps_last_value_on_log_failure() {
    let mc = downloaded();
    let log = |pct: f64| {
        Some(Ok(format!(
            "noise\n{{\"ts\":\"2026-01-01T00:00:00Z\",\"event\":\"progress\",\"phase\":\"quantization\",\"percent\":{pct},\"detail\":\"layer\",\"layer\":3,\"layers\":10}}\n"
        )))
    };
    let (p, _) = running_quantize(log(40.0), &mc, 60);
    let q = p.status.quantization.clone().expect("quant status");
    assert_eq!(q.progress, Some(40));
    assert_eq!(q.progress_source.as_deref(), Some("telemetry"));
    let mc40 = applied(mc.clone(), &p);
    let c = cfg();
    let job = |mc: &ModelCache| {
        let mut j = job_from(
            &plan(&downloaded(), &obs(vec![]), &c, t(0)),
            JobPhase::Quantize,
            t(0),
            JobState::Active,
        );
        j.pod = Some(ObservedPod {
            name: "p".into(),
            running: true,
            ..Default::default()
        });
        let _ = mc;
        j
    };
    // Lower telemetry: never backwards.
    let mut o = obs(vec![job(&mc40)]);
    o.log_tail = log(30.0);
    let p = plan(&mc40, &o, &c, t(120));
    assert_eq!(
        p.status.quantization.as_ref().and_then(|q| q.progress),
        Some(40)
    );
    assert!(!p.status_changed, "no change, no write");
    // Failed log read: keeps the last trustworthy value and source.
    o.log_tail = Some(Err("connection refused".into()));
    let p = plan(&mc40, &o, &c, t(180));
    let q = p.status.quantization.clone().expect("quant");
    assert_eq!(
        (q.progress, q.progress_source.as_deref()),
        (Some(40), Some("telemetry"))
    );
    assert!(!p.status_changed);
    // Higher telemetry moves forward.
    o.log_tail = log(55.5);
    let p = plan(&mc40, &o, &c, t(240));
    assert_eq!(
        p.status.quantization.as_ref().and_then(|q| q.progress),
        Some(55)
    );
    assert_eq!(p.status.progress, Some(55));
    assert_eq!(p.outcome.telemetry.as_ref().and_then(|t| t.layer), Some(3));
}

#[test]
fn elapsed_estimate_without_telemetry_is_capped_at_99() {
    let mc = downloaded();
    // Quantize deadline defaults to 86400 s: 8640 s elapsed = 10 %.
    let (p, _) = running_quantize(None, &mc, 8640);
    let q = p.status.quantization.clone().expect("quant");
    assert_eq!(q.progress, Some(10));
    assert_eq!(q.progress_source.as_deref(), Some("elapsed-estimate"));
    let (p, _) = running_quantize(Some(Err("x".into())), &mc, 200_000);
    assert_eq!(p.status.quantization.and_then(|q| q.progress), Some(99));
    assert_eq!(p.requeue_after, Some(Duration::from_secs(30)));
}

#[test]
fn image_drift_inside_and_outside_grace_window() {
    let c = cfg();
    let mc = cache(FULL);
    // Abliteration etc. done: get to a running quantize Job with image q:a.
    let mut mcx = mc.clone();
    let mut done = vec![];
    let mut p = plan(&mcx, &obs(vec![]), &c, t(0));
    for ph in [JobPhase::Download, JobPhase::Abliterate] {
        done.push(job_from(&p, ph, t(0), JobState::Succeeded));
        mcx = applied(mcx, &p);
        p = plan(&mcx, &obs(done.clone()), &c, t(1));
    }
    let q = job_from(&p, JobPhase::Quantize, t(10), JobState::Active);
    assert_eq!(q.image, "q:a");
    mcx = applied(mcx, &p);
    let with_profile = |img: &str, jobs: Vec<ObservedJob>| {
        let mut o = obs(jobs);
        o.profiles = vec![profile("gfx1100", img)];
        o
    };
    let mut all = done.clone();
    all.push(q.clone());
    // Same image: nothing.
    let same = plan(&mcx, &with_profile("q:a", all.clone()), &c, t(20));
    assert!(deleted_jobs(&same).is_empty());
    // Young Job, new image: replaced with a warning.
    let young = plan(&mcx, &with_profile("q:b", all.clone()), &c, t(10 + 599));
    assert_eq!(deleted_jobs(&young), vec!["mc-quantize"]);
    assert!(events(&young).contains(&"QuantizerImageDrift".to_string()));
    // Old Job: left to finish.
    let old = plan(&mcx, &with_profile("q:b", all.clone()), &c, t(10 + 601));
    assert!(deleted_jobs(&old).is_empty());
    assert!(!events(&old).contains(&"QuantizerImageDrift".to_string()));
    // Old Job with force-image-update: replaced.
    let mut forced = mcx.clone();
    forced.metadata.annotations = Some(BTreeMap::from([(
        annotations::FORCE_IMAGE_UPDATE.into(),
        "true".into(),
    )]));
    let f = plan(&forced, &with_profile("q:b", all.clone()), &c, t(10 + 5000));
    assert_eq!(deleted_jobs(&f), vec!["mc-quantize"]);
    // Configurable grace window.
    let short = Config {
        drift_grace: Duration::from_secs(5),
        ..cfg()
    };
    let s = plan(&mcx, &with_profile("q:b", all.clone()), &short, t(10 + 6));
    assert!(deleted_jobs(&s).is_empty());
    // After deletion the Job is recreated with the new image.
    let recreated = plan(&mcx, &with_profile("q:b", done.clone()), &c, t(700));
    let j = job_from(&recreated, JobPhase::Quantize, t(700), JobState::Active);
    assert_eq!(j.image, "q:b");
    // A Ready cache is not rebuilt because the image changed.
    let mut all_done = done.clone();
    let qs = job_from(&recreated, JobPhase::Quantize, t(700), JobState::Succeeded);
    all_done.push(qs);
    let m2 = applied(mcx.clone(), &recreated);
    let p = plan(&m2, &with_profile("q:b", all_done.clone()), &c, t(710));
    all_done.push(job_from(&p, JobPhase::Publish, t(710), JobState::Succeeded));
    let m3 = applied(m2, &p);
    let p = plan(&m3, &with_profile("q:b", all_done.clone()), &c, t(720));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    let m4 = applied(m3, &p);
    let p = plan(&m4, &with_profile("q:c", all_done), &c, t(730));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    assert!(created_jobs(&p).is_empty() && deleted_jobs(&p).is_empty());
}

#[test]
fn requantize_reruns_only_quantize_and_keeps_path_until_success() {
    let c = cfg();
    let ready = ready_simple();
    let old_path = ready.status.as_ref().and_then(|s| s.path.clone());
    assert!(
        old_path
            .as_deref()
            .is_some_and(|p| p.starts_with("mc-cache:mc/gptq-w4-g128.")),
        "{old_path:?}"
    );
    // Change the spec (bits 4 -> 8): quantization re-runs, download does not.
    let mut mc = ready.clone();
    if let Some(q) = mc.spec.quantization.as_mut() {
        q.bits = Some(8);
    }
    mc.metadata.generation = Some(2);
    let old_q = ObservedJob {
        phase: JobPhase::Quantize,
        name: "mc-quantize".into(),
        image: "worker:1".into(),
        spec_hash: ready
            .status
            .as_ref()
            .and_then(|s| s.quantization.as_ref())
            .and_then(|q| q.spec_hash.clone()),
        created: t(11),
        started: t(11),
        terminating: false,
        state: JobState::Succeeded,
        pod: None,
        deadline_seconds: None,
        out_dir: None,
    };
    let p = plan(&mc, &obs(vec![old_q]), &c, t(100));
    assert_eq!(deleted_jobs(&p), vec!["mc-quantize"]);
    assert!(created_jobs(&p).is_empty(), "waits for the old Job to go");
    assert_eq!(p.status.phase, Some(CachePhase::Quantizing));
    assert_eq!(
        p.status.path, old_path,
        "path moved before the new run succeeded"
    );
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![]), &c, t(110));
    assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
    assert_eq!(p.status.path, old_path);
    let q = job_from(&p, JobPhase::Quantize, t(111), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![q]), &c, t(120));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    let new_path = p.status.path.clone().unwrap_or_default();
    assert!(
        new_path.starts_with("mc-cache:mc/gptq-w8-g128."),
        "{new_path}"
    );
    // The replaced generation is kept (the default keeps one) and named in status.
    assert_eq!(
        p.status
            .quantization
            .as_ref()
            .and_then(|q| q.previous_output_dirs.clone()),
        old_path
            .as_deref()
            .and_then(|p| p.split_once(':'))
            .map(|(_, d)| vec![d.to_string()])
    );

    // The annotation: re-runs quantization with the same spec, and is removed.
    let mut mc = ready.clone();
    mc.metadata.annotations = Some(BTreeMap::from([(
        annotations::REQUANTIZE.into(),
        "true".into(),
    )]));
    let p = plan(&mc, &obs(vec![]), &c, t(200));
    assert!(p.actions.contains(&Action::RemoveAnnotations(vec![
        annotations::REQUANTIZE.into()
    ])));
    assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
    assert_eq!(p.status.path, old_path);
    // A new generation: the re-run writes beside the served artifact instead of reusing it.
    let out_dir = |p: &Plan| -> String {
        p.actions
            .iter()
            .find_map(|a| match a {
                Action::CreateJob(j) => j
                    .spec
                    .clone()
                    .and_then(|s| s.template.spec)
                    .and_then(|s| s.containers[0].env.clone())
                    .and_then(|e| e.into_iter().find(|e| e.name == "OUT_DIR"))
                    .and_then(|e| e.value),
                _ => None,
            })
            .unwrap_or_default()
    };
    let old_dir = old_path
        .as_deref()
        .and_then(|p| p.split_once(':'))
        .map(|(_, d)| d);
    assert_ne!(Some(out_dir(&p).trim_start_matches("/cache/")), old_dir);
    assert!(
        out_dir(&p).starts_with("/cache/mc/gptq-w4-g128."),
        "{}",
        out_dir(&p)
    );
    assert!(
        p.status
            .download
            .as_ref()
            .and_then(|d| d.completed_at.clone())
            .is_some(),
        "download must stay done"
    );
}

#[test]
fn redownload_reruns_everything() {
    let c = cfg();
    let mut mc = ready_simple();
    mc.metadata.annotations = Some(BTreeMap::from([(
        annotations::REDOWNLOAD.into(),
        "true".into(),
    )]));
    let p = plan(&mc, &obs(vec![]), &c, t(300));
    assert_eq!(created_jobs(&p), vec!["mc-download"]);
    assert!(p
        .status
        .quantization
        .as_ref()
        .and_then(|q| q.completed_at.clone())
        .is_none());
}

#[test]
fn unsupported_format_fails_clearly_once() {
    let c = cfg();
    let mc = cache(&SIMPLE.replace("format: GPTQ", "format: AWQ"));
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    assert!(created_jobs(&p).is_empty());
    let ready = conditions::find(&p.status.conditions, "Ready").expect("cond");
    assert_eq!(ready.reason, "UnsupportedFormat");
    assert!(ready.message.contains("AWQ"), "{}", ready.message);
    assert_eq!(
        conditions::find(&p.status.conditions, "Quantized").map(|c| c.reason.as_str()),
        Some("UnsupportedFormat")
    );
    assert_eq!(events(&p), vec!["UnsupportedFormat"]);
    let mc = applied(mc, &p);
    let again = plan(&mc, &obs(vec![]), &c, t(60));
    assert!(!again.status_changed && events(&again).is_empty() && again.requeue_after.is_none());
    // Fixing the spec recovers without intervention.
    let mut fixed = mc.clone();
    if let Some(q) = fixed.spec.quantization.as_mut() {
        q.format = flexinfer_api::modelcache::QuantFormat::Gptq;
    }
    assert_eq!(
        created_jobs(&plan(&fixed, &obs(vec![]), &c, t(70))),
        vec!["mc-download"]
    );
}

#[test]
fn missing_image_and_bad_annotations_become_conditions() {
    let no_image = Config::default();
    let p = plan(&cache(SIMPLE), &obs(vec![]), &no_image, t(0));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    let r = conditions::find(&p.status.conditions, "Ready").expect("cond");
    assert_eq!(r.reason, "ImageNotConfigured");
    assert!(r.message.contains("FLEXINFER_WORKER_IMAGE"));
    let mut mc = cache(SIMPLE);
    mc.metadata.annotations = Some(BTreeMap::from([(
        "flexinfer.ai/job-pod-labels".into(),
        "{not json".into(),
    )]));
    let p = plan(&mc, &obs(vec![]), &cfg(), t(0));
    let r = conditions::find(&p.status.conditions, "Ready").expect("cond");
    assert_eq!(r.reason, "InvalidSpec");
    assert!(r.message.contains("flexinfer.ai/job-pod-labels"));
}

#[test]
fn failure_message_from_termination_message_or_log_tail_is_redacted() {
    let c = cfg();
    let mc = cache(SIMPLE);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let mut j = job_from(
        &p,
        JobPhase::Download,
        t(0),
        JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: String::new(),
        },
    );
    let mc = applied(mc, &p);
    j.pod = Some(ObservedPod {
        termination_message: Some(r#"{"error":"401 for token=hf_abcdefghijklmnopqrstu","phase":"download","exitCode":2,"tail":"GET https://hub\nAuthorization: Bearer hf_zzzzzzzzzzzzzzzzzzzz"}"#.into()),
        terminated_reason: Some("Error".into()),
        ..Default::default()
    });
    let p = plan(&mc, &obs(vec![j.clone()]), &c, t(5));
    let msg = p
        .status
        .download
        .and_then(|d| d.run.failure_message)
        .expect("failure message");
    assert!(
        msg.starts_with("BackoffLimitExceeded: exit 2: 401"),
        "{msg}"
    );
    assert!(
        !msg.contains("hf_abc") && !msg.contains("hf_zzz"),
        "secret leaked: {msg}"
    );
    // No termination message: the log tail.
    j.pod = Some(ObservedPod {
        terminated_reason: Some("Error".into()),
        ..Default::default()
    });
    let mut o = obs(vec![j]);
    o.log_tail = Some(Ok(
        "line1\nFATAL: Script version mismatch (image=v1 controller=v14) password=hunter2\n".into(),
    ));
    let p = plan(&mc, &o, &c, t(5));
    let msg = p
        .status
        .download
        .and_then(|d| d.run.failure_message)
        .expect("failure message");
    assert!(msg.contains("Script version mismatch"), "{msg}");
    assert!(!msg.contains("hunter2"), "{msg}");
}

#[test]
fn redaction_rules() {
    assert_eq!(redact("token=abc def"), "token=[REDACTED] def");
    assert_eq!(
        redact("Authorization: Bearer xyz ok"),
        "Authorization: Bearer [REDACTED] ok"
    );
    assert_eq!(
        redact("using hf_0123456789abcdef now"),
        "using [REDACTED] now"
    );
    assert_eq!(redact("HF_TOKEN=hf_x1234567890"), "HF_TOKEN=[REDACTED]");
    assert_eq!(redact("layer=3 of 10"), "layer=3 of 10");
}

#[test]
fn restart_adopts_running_job_without_duplicates() {
    let c = cfg();
    let mc = cache(SIMPLE);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let j = job_from(&p, JobPhase::Download, t(1), JobState::Active);
    let written = j.out_dir.clone().expect("the download Job's OUT_DIR");
    // Status write was lost: the object has no status at all.
    let p = plan(&mc, &obs(vec![j]), &c, t(30));
    assert!(
        created_jobs(&p).is_empty() && deleted_jobs(&p).is_empty(),
        "{:?}",
        p.actions
    );
    assert_eq!(p.status.phase, Some(CachePhase::Downloading));
    // Status names the generation the adopted Job writes, not none (nor a new one).
    let generation = p
        .status
        .download
        .as_ref()
        .and_then(|d| d.generation.clone())
        .expect("the adopted Job's generation");
    assert_eq!(written, format!("mc/source.{generation}"));
}

#[test]
fn running_job_from_an_older_spec_is_replaced() {
    let c = cfg();
    let mc = cache(SIMPLE);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let j = job_from(&p, JobPhase::Download, t(1), JobState::Active);
    let mut mc = applied(mc, &p);
    mc.spec.revision = "v2".into();
    let p = plan(&mc, &obs(vec![j]), &c, t(30));
    assert_eq!(deleted_jobs(&p), vec!["mc-download"]);
}

#[test]
fn deletion_removes_created_pvc_but_never_an_existing_claim() {
    let mut mc = cache(SIMPLE);
    mc.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t(0)));
    let p = plan(&mc, &obs(vec![]), &cfg(), t(0));
    assert_eq!(
        p.actions,
        vec![
            Action::DeletePvc("mc-cache".into()),
            Action::RemoveFinalizer
        ]
    );
    let mut ex = cache(&SIMPLE.replace(
        "source: org/model",
        "source: org/model\n  existingClaimName: keep",
    ));
    ex.metadata.deletion_timestamp = mc.metadata.deletion_timestamp.clone();
    let p = plan(&ex, &obs(vec![]), &cfg(), t(0));
    assert_eq!(p.actions, vec![Action::RemoveFinalizer]);
}

#[test]
fn quant_spec_hash_matches_the_seed_formula() {
    let mc = cache(FULL);
    let q = serde_json::to_value(&mc.spec.quantization).expect("json");
    let canon = jobs::canonical_json(&q);
    let mut h = Sha256::new();
    h.update(format!("{canon}|q:a").as_bytes());
    let want = &hex::encode(h.finalize())[..16];
    // The seed's formula over all of spec.quantization survives as the legacy hash (status written by
    // an older controller stays current) …
    assert_eq!(jobs::legacy_spec_hash(&mc, JobPhase::Quantize, "q:a"), want);
    assert_ne!(jobs::legacy_spec_hash(&mc, JobPhase::Quantize, "q:b"), want);
    // … and the artifact hash leaves run-only settings out: raising a deadline or a memory limit does
    // not replace a running Job or re-run a finished phase; a setting of the artifact does.
    let h = |m: &ModelCache| jobs::spec_hash(m, JobPhase::Quantize, "q:a");
    let mut run_only = mc.clone();
    if let Some(q) = run_only.spec.quantization.as_mut() {
        q.timeout_seconds = Some(999_999);
        q.max_memory_gb += 7;
        q.gpu_memory_fraction = "0.5".into();
    }
    assert_eq!(h(&run_only), h(&mc));
    assert_ne!(
        jobs::legacy_spec_hash(&run_only, JobPhase::Quantize, "q:a"),
        want
    );
    for edit in [
        |q: &mut flexinfer_api::modelcache::QuantizationSpec| q.sym = !q.sym,
        |q: &mut flexinfer_api::modelcache::QuantizationSpec| q.group_size = 32,
        |q: &mut flexinfer_api::modelcache::QuantizationSpec| q.desc_act = !q.desc_act,
    ] {
        let mut m = mc.clone();
        if let Some(q) = m.spec.quantization.as_mut() {
            edit(q);
        }
        assert_ne!(h(&m), h(&mc));
    }
    assert_ne!(jobs::spec_hash(&mc, JobPhase::Quantize, "q:b"), h(&mc));
    // Key order does not matter.
    let a: serde_json::Value = serde_json::from_str(r#"{"b":1,"a":{"d":2,"c":3}}"#).expect("json");
    assert_eq!(jobs::canonical_json(&a), r#"{"a":{"c":3,"d":2},"b":1}"#);
}

#[test]
fn image_resolution_order() {
    let mc = cache(FULL);
    let env = |pairs: &[(&str, &str)]| {
        let m: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| m.get(k).cloned())
    };
    let all = env(&[
        ("FLEXINFER_WORKER_IMAGE", "w"),
        ("FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX1100_IMAGE", "rocm-1100"),
        ("FLEXINFER_QUANTIZER_GPTQ_ROCM_IMAGE", "rocm"),
        ("FLEXINFER_QUANTIZER_GPTQ_IMAGE", "gptq"),
        ("FLEXINFER_QUANTIZER_IMAGE_GPTQ", "chart"),
    ]);
    let img = |profiles: &[GPUProfile], c: &Config| {
        jobs::resolve_target(&mc, JobPhase::Quantize, profiles, c).image
    };
    assert_eq!(img(&[profile("gfx1100", "prof")], &all), Ok("prof".into()));
    assert_eq!(img(&[], &all), Ok("rocm-1100".into()));
    let no_arch = env(&[
        ("FLEXINFER_WORKER_IMAGE", "w"),
        ("FLEXINFER_QUANTIZER_GPTQ_ROCM_IMAGE", "rocm"),
        ("FLEXINFER_QUANTIZER_GPTQ_IMAGE", "gptq"),
    ]);
    assert_eq!(img(&[], &no_arch), Ok("rocm".into()));
    let chart = env(&[
        ("FLEXINFER_WORKER_IMAGE", "w"),
        ("FLEXINFER_QUANTIZER_GPTQ_IMAGE", "gptq"),
        ("FLEXINFER_QUANTIZER_IMAGE_GPTQ", "chart"),
    ]);
    assert_eq!(
        img(&[], &chart),
        Ok("chart".into()),
        "AMD arch skips the non-ROCm GPTQ image"
    );
    let nv = cache(&FULL.replace("gfx1100", "sm_89"));
    assert_eq!(
        jobs::resolve_target(&nv, JobPhase::Quantize, &[], &chart).image,
        Ok("gptq".into())
    );
    assert_eq!(
        jobs::resolve_target(&mc, JobPhase::Download, &[profile("gfx1100", "prof")], &all).image,
        Ok("w".into())
    );
    assert_eq!(
        jobs::resolve_target(&mc, JobPhase::Publish, &[], &all).image,
        Ok("w".into())
    );
}

#[test]
fn node_selector_precedence_and_profile_fallback() {
    let c = cfg();
    let mut mc = cache(FULL);
    let sel = |mc: &ModelCache, p: JobPhase, profs: &[GPUProfile]| {
        jobs::resolve_target(mc, p, profs, &c).node_selector
    };
    assert_eq!(
        sel(&mc, JobPhase::Quantize, &[])
            .get("flexinfer.ai/gpu.arch")
            .map(String::as_str),
        Some("gfx1100")
    );
    if let Some(q) = mc.spec.quantization.as_mut() {
        q.node_selector = Some(BTreeMap::from([
            ("flexinfer.ai/gpu.arch".into(), "gfx906".into()),
            ("big".into(), "ram".into()),
        ]));
    }
    let s = sel(&mc, JobPhase::Quantize, &[]);
    assert_eq!(
        s.get("flexinfer.ai/gpu.arch").map(String::as_str),
        Some("gfx906")
    );
    assert_eq!(s.get("big").map(String::as_str), Some("ram"));
    assert_eq!(
        sel(&mc, JobPhase::Download, &[])
            .get("flexinfer.ai/gpu.arch")
            .map(String::as_str),
        Some("gfx1100")
    );
    // No selector anywhere: the single GPUProfile's selector.
    mc.spec.node_selector = None;
    if let Some(q) = mc.spec.quantization.as_mut() {
        q.node_selector = None;
    }
    assert_eq!(
        sel(&mc, JobPhase::Quantize, &[profile("gfx1100", "x")])
            .get("flexinfer.ai/gpu.arch")
            .map(String::as_str),
        Some("gfx1100")
    );
    assert!(sel(&mc, JobPhase::Download, &[profile("gfx1100", "x")]).is_empty());
}

#[test]
fn quantize_reads_the_abliterated_model() {
    let c = cfg();
    let mc = cache(FULL);
    let t_ = jobs::resolve_target(&mc, JobPhase::Quantize, &[profile("gfx1100", "q")], &c);
    let job = jobs::build_job(&mc, &Default::default(), &[], &t_, "q", "h", &c);
    let env = job
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers[0].env.clone().unwrap_or_default())
        .unwrap_or_default();
    let get = |n: &str| {
        env.iter()
            .find(|e| e.name == n)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(get("MODEL_DIR").as_deref(), Some("/cache/mc/abliterated"));
    assert_eq!(get("OUT_DIR").as_deref(), Some("/cache/mc/gptq-w4-g128"));
    let simple = cache(SIMPLE);
    let t_ = jobs::resolve_target(&simple, JobPhase::Quantize, &[], &c);
    let job = jobs::build_job(&simple, &Default::default(), &[], &t_, "q", "h", &c);
    let env = job
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers[0].env.clone().unwrap_or_default())
        .unwrap_or_default();
    assert_eq!(
        env.iter()
            .find(|e| e.name == "MODEL_DIR")
            .and_then(|e| e.value.clone())
            .as_deref(),
        Some("/cache/mc")
    );
}

#[test]
fn pod_labels_and_annotations_from_cache_annotations() {
    let c = cfg();
    let mut mc = cache(SIMPLE);
    mc.metadata.annotations = Some(BTreeMap::from([
        (
            "flexinfer.ai/job-pod-labels".into(),
            r#"{"cost-center":"ml","flexinfer.ai/phase":"spoof"}"#.into(),
        ),
        (
            "flexinfer.ai/quantize-pod-labels".into(),
            r#"{"sim.kwok.test/outcome":"fail"}"#.into(),
        ),
        (
            "flexinfer.ai/job-pod-annotations".into(),
            r#"{"sidecar.istio.io/inject":"false"}"#.into(),
        ),
    ]));
    let build = |p: JobPhase| {
        let t_ = jobs::resolve_target(&mc, p, &[], &c);
        jobs::build_job(&mc, &Default::default(), &[], &t_, "i", "h", &c)
            .spec
            .and_then(|s| s.template.metadata)
            .unwrap_or_default()
    };
    let q = build(JobPhase::Quantize);
    let l = q.labels.unwrap_or_default();
    assert_eq!(l.get("cost-center").map(String::as_str), Some("ml"));
    assert_eq!(
        l.get("sim.kwok.test/outcome").map(String::as_str),
        Some("fail")
    );
    assert_eq!(
        l.get("flexinfer.ai/phase").map(String::as_str),
        Some("quantize"),
        "identity labels win"
    );
    assert_eq!(
        q.annotations
            .unwrap_or_default()
            .get("sidecar.istio.io/inject")
            .map(String::as_str),
        Some("false")
    );
    let d = build(JobPhase::Download).labels.unwrap_or_default();
    assert!(!d.contains_key("sim.kwok.test/outcome"));
    assert_eq!(d.get("cost-center").map(String::as_str), Some("ml"));
}

#[test]
fn spec_change_of_a_failed_phase_tries_again() {
    let c = cfg();
    let mc = cache(&SIMPLE.replace("maxRetries: 2", "maxRetries: 0"));
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let dl = job_from(&p, JobPhase::Download, t(0), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone()]), &c, t(1));
    let q = job_from(
        &p,
        JobPhase::Quantize,
        t(1),
        JobState::Failed {
            reason: "DeadlineExceeded".into(),
            message: String::new(),
        },
    );
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone(), q]), &c, t(2));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    let mut mc = applied(mc, &p);
    assert!(created_jobs(&plan(&mc, &obs(vec![dl.clone()]), &c, t(3))).is_empty());
    // Runbook 6.1 option A: a larger timeout alone retries.
    if let Some(qs) = mc.spec.quantization.as_mut() {
        qs.timeout_seconds = Some(172800);
    }
    let p = plan(&mc, &obs(vec![dl]), &c, t(4));
    assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
    assert_eq!(p.status.phase, Some(CachePhase::Quantizing));
    assert_eq!(p.status.retry_count, Some(0));
}

#[test]
fn adding_or_removing_abliteration_reruns_quantize() {
    let c = cfg();
    let ready = ready_simple();
    // Add abliteration: abliterate runs, then quantize again (it now reads abliterated/).
    let mut mc = ready.clone();
    mc.spec.abliteration = cache(FULL).spec.abliteration;
    if let Some(a) = mc.spec.abliteration.as_mut() {
        a.use_gpu = false;
    }
    let p = plan(&mc, &obs(vec![]), &c, t(100));
    assert_eq!(created_jobs(&p), vec!["mc-abliterate"]);
    assert!(p
        .status
        .quantization
        .as_ref()
        .and_then(|q| q.completed_at.clone())
        .is_none());
    assert_eq!(
        p.status.path,
        ready.status.as_ref().and_then(|s| s.path.clone())
    );
    let ab = job_from(&p, JobPhase::Abliterate, t(101), JobState::Succeeded);
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![ab]), &c, t(110));
    assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
    let q = job_from(&p, JobPhase::Quantize, t(111), JobState::Succeeded);
    let env = match p.actions.iter().find(|a| matches!(a, Action::CreateJob(_))) {
        Some(Action::CreateJob(j)) => j
            .spec
            .clone()
            .and_then(|s| s.template.spec)
            .map(|s| s.containers[0].env.clone().unwrap_or_default())
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let ablit = mc_ablit_dir(&p);
    assert!(env
        .iter()
        .any(|e| e.name == "MODEL_DIR" && e.value.as_deref() == Some(ablit.as_str())));
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![q]), &c, t(120));
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
    // Remove it again: quantize re-runs on the downloaded model.
    let mut mc = applied(mc, &p);
    mc.spec.abliteration = None;
    let p = plan(&mc, &obs(vec![]), &c, t(200));
    assert!(p.status.abliteration.is_none());
    assert_eq!(created_jobs(&p), vec!["mc-quantize"]);
}

#[test]
fn gpuprofile_changes_map_only_to_matching_caches() {
    let gfx1100 = profile("gfx1100", "x");
    let gfx906 = profile("gfx906", "x");
    let full = cache(FULL);
    assert!(jobs::profile_affects(&full, &gfx1100));
    assert!(!jobs::profile_affects(&full, &gfx906));
    // CPU-only cache: no profile matters.
    assert!(!jobs::profile_affects(&cache(SIMPLE), &gfx1100));
    // GPU phase without an arch selector: any profile of the namespace may be the one.
    let mut no_arch = cache(FULL);
    no_arch.spec.node_selector = None;
    assert!(jobs::profile_affects(&no_arch, &gfx906));
    // Other namespace: never.
    let mut other = gfx1100.clone();
    other.metadata.namespace = Some("elsewhere".into());
    assert!(!jobs::profile_affects(&full, &other));
}

#[test]
fn results_come_from_the_termination_message() {
    let c = cfg();
    let mc = cache(FULL);
    let p = plan(&mc, &obs(vec![]), &c, t(0));
    let mut dl = job_from(&p, JobPhase::Download, t(0), JobState::Succeeded);
    dl.pod = Some(ObservedPod {
        termination_message: Some(
            r#"{"type":"download","sizeBytes":1000,"fileCount":7,"revision":"abc123"}"#.into(),
        ),
        ..Default::default()
    });
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone()]), &c, t(1));
    let d = p.status.download.clone().expect("download status");
    assert_eq!(
        (d.size_bytes, d.file_count, d.revision.as_deref()),
        (Some(1000), Some(7), Some("abc123"))
    );
    let mut ab = job_from(&p, JobPhase::Abliterate, t(1), JobState::Succeeded);
    ab.pod = Some(ObservedPod {
        termination_message: Some(r#"{"type":"abliterate","layersModified":40,"refusalDirNorm":12.5,"layer":20,"perplexityBefore":7.25,"perplexityAfter":7.5}"#.into()),
        ..Default::default()
    });
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone(), ab.clone()]), &c, t(2));
    let a = p.status.abliteration.clone().expect("abliteration status");
    assert_eq!(a.layers_modified, Some(40));
    assert_eq!(a.perplexity_after.as_deref(), Some("7.500"));
    assert_eq!(
        a.output_dir,
        Some(format!(
            "mc/abliterated.{}",
            a.generation.clone().unwrap_or_default()
        ))
    );
    let mut q = job_from(&p, JobPhase::Quantize, t(2), JobState::Succeeded);
    q.pod = Some(ObservedPod {
        termination_message: Some(r#"{"type":"gptq-w4-g128","originalSizeBytes":4000,"compressedSizeBytes":1000,"quantizationTimeSeconds":3723,"outputDir":"/cache/mc/gptq-w4-g128","quality":{"gptqModules":400,"rtnFallbackModules":4,"rtnFallbackPercent":1.0,"maxRtnFallbackPercent":10.0,"minimumModules":100,"gate":"passed"}}"#.into()),
        ..Default::default()
    });
    let mc = applied(mc, &p);
    let p = plan(&mc, &obs(vec![dl.clone(), ab.clone(), q.clone()]), &c, t(3));
    let qs = p.status.quantization.clone().expect("quantization status");
    assert_eq!(qs.compression_ratio, Some(4.0));
    assert_eq!(qs.quantization_time.as_deref(), Some("1h2m3s"));
    assert_eq!(qs.output_dir.as_deref(), Some("mc/gptq-w4-g128"));
    assert_eq!(qs.quality.and_then(|g| g.gate).as_deref(), Some("passed"));
    assert_eq!(qs.format.as_deref(), Some("GPTQ"));
    // Publish: digest, tags; an earlier digest moves to previousDigests.
    let mut pb = job_from(&p, JobPhase::Publish, t(3), JobState::Succeeded);
    pb.pod = Some(ObservedPod {
        termination_message: Some(
            r#"{"type":"publish","digest":"sha256:new","tags":["latest","stable"]}"#.into(),
        ),
        ..Default::default()
    });
    let mut mc = applied(mc, &p);
    if let Some(ps) = mc.status.as_mut().and_then(|s| s.publish.as_mut()) {
        ps.oci_digest = Some("sha256:old".into());
    }
    let p = plan(&mc, &obs(vec![dl, ab, q, pb]), &c, t(4));
    let ps = p.status.publish.clone().expect("publish status");
    assert_eq!(ps.oci_digest.as_deref(), Some("sha256:new"));
    assert_eq!(ps.previous_digests, Some(vec!["sha256:old".to_string()]));
    assert_eq!(
        ps.published_tags,
        Some(vec!["latest".to_string(), "stable".to_string()])
    );
    assert_eq!(p.status.phase, Some(CachePhase::Ready));
}

/// `/cache/<promoted abliteration output>` of a plan's status.
fn mc_ablit_dir(p: &Plan) -> String {
    format!(
        "/cache/{}",
        p.status
            .abliteration
            .as_ref()
            .and_then(|a| a.output_dir.clone())
            .unwrap_or_default()
    )
}

#[test]
fn shared_claims_are_kept_and_a_second_cache_on_one_directory_is_refused() {
    // Cache A created its PVC; cache B uses it as existingClaimName: deleting A keeps the PVC.
    let mut a = cache(SIMPLE);
    a.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t(0)));
    let peer = |older: bool, dir: &str| ClaimPeer {
        name: "b".into(),
        model_dir: dir.into(),
        older,
    };
    let o = Observed {
        claim_peers: vec![peer(false, "other")],
        ..obs(vec![])
    };
    let p = plan(&a, &o, &cfg(), t(0));
    assert_eq!(
        p.actions
            .iter()
            .filter(|a| !matches!(a, Action::Event { .. }))
            .cloned()
            .collect::<Vec<_>>(),
        vec![Action::RemoveFinalizer],
        "a PVC another cache uses must not be deleted"
    );
    assert!(p.actions.iter().any(
        |a| matches!(a, Action::Event { reason, note, .. } if reason == "ClaimKept" && note.contains('b'))
    ));
    // Two caches on one claim and modelPath: the younger one fails and creates nothing.
    let mc = cache(SIMPLE);
    let dir = jobs::model_dir(&mc);
    let o = Observed {
        claim_peers: vec![peer(true, &dir)],
        ..obs(vec![])
    };
    let p = plan(&mc, &o, &cfg(), t(0));
    assert_eq!(p.status.phase, Some(CachePhase::Failed));
    assert!(created_jobs(&p).is_empty());
    let ready = conditions::find(&p.status.conditions, "Ready").expect("Ready");
    assert_eq!(ready.reason, "ClaimConflict");
    assert!(ready.message.contains("modelPath"), "{}", ready.message);
    // The older one (peer younger) and a peer on another directory proceed.
    for o in [
        Observed {
            claim_peers: vec![peer(false, &dir)],
            ..obs(vec![])
        },
        Observed {
            claim_peers: vec![peer(true, "elsewhere")],
            ..obs(vec![])
        },
    ] {
        let p = plan(&mc, &o, &cfg(), t(0));
        assert_eq!(created_jobs(&p), vec!["mc-download"]);
    }
}

/// A phase completed under the hash an older controller wrote (which also covered run-only settings) is
/// current: no re-run after an upgrade, and status is migrated to the new hash.
#[test]
fn status_written_under_the_legacy_hash_is_current_and_migrated() {
    let c = cfg();
    let mut ready = ready_simple();
    let spec = ready.clone();
    let q = ready
        .status
        .as_mut()
        .and_then(|s| s.quantization.as_mut())
        .expect("quantization status");
    let image = q.image.clone().expect("image");
    let current = jobs::spec_hash(&spec, JobPhase::Quantize, &image);
    let legacy = jobs::legacy_spec_hash(&spec, JobPhase::Quantize, &image);
    assert_ne!(legacy, current, "the fixture must have run-only settings");
    q.spec_hash = Some(legacy);
    let p = plan(&ready, &obs(vec![]), &c, t(500));
    assert!(created_jobs(&p).is_empty() && deleted_jobs(&p).is_empty());
    assert_eq!(
        p.status
            .quantization
            .as_ref()
            .and_then(|q| q.spec_hash.clone()),
        Some(current)
    );
    assert_eq!(
        p.status.path,
        ready.status.as_ref().and_then(|s| s.path.clone())
    );
    // An unrelated hash is a spec change: the phase re-runs.
    if let Some(q) = ready.status.as_mut().and_then(|s| s.quantization.as_mut()) {
        q.spec_hash = Some("0000000000000000".into());
    }
    assert!(
        !deleted_jobs(&plan(&ready, &obs(vec![]), &c, t(501))).is_empty()
            || !created_jobs(&plan(&ready, &obs(vec![]), &c, t(501))).is_empty()
    );
}

fn tolerates_gpu_taint(p: &Plan) -> Vec<(String, bool)> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::CreateJob(j) => Some((
                j.metadata.name.clone().unwrap_or_default(),
                j.spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref())
                    .and_then(|s| s.tolerations.as_ref())
                    .is_some_and(|ts| {
                        ts.iter().any(|t| {
                            t.key.as_deref() == Some("dedicated")
                                && t.value.as_deref() == Some("gpu")
                                && t.effect.as_deref() == Some("NoSchedule")
                        })
                    }),
            )),
            _ => None,
        })
        .collect()
}

#[test]
fn every_job_pinned_to_gpu_nodes_tolerates_the_gpu_taint() {
    // (case, manifest, profiles, download Job tolerates `dedicated=gpu:NoSchedule`)
    let arch_pinned = SIMPLE.replace(
        "  maxRetries: 2\n",
        "  maxRetries: 2\n  nodeSelector: {flexinfer.ai/gpu.arch: gfx906}\n",
    );
    let profile_pinned = SIMPLE.replace(
        "  maxRetries: 2\n",
        "  maxRetries: 2\n  nodeSelector: {amd.com/gpu.product: rx7900, zone: a}\n",
    );
    let cpu_pinned = SIMPLE.replace(
        "  maxRetries: 2\n",
        "  maxRetries: 2\n  nodeSelector: {kubernetes.io/arch: amd64}\n",
    );
    let mut gpu_profile = profile("gfx1100", "q:a");
    gpu_profile.spec.node_selector = Some(BTreeMap::from([(
        "amd.com/gpu.product".to_string(),
        "rx7900".to_string(),
    )]));
    let cases: Vec<(&str, String, Vec<GPUProfile>, bool)> = vec![
        ("no selector", SIMPLE.to_string(), vec![], false),
        ("selector names a GPU arch", arch_pinned, vec![], true),
        (
            "selector contains a GPUProfile's selector",
            profile_pinned.clone(),
            vec![gpu_profile],
            true,
        ),
        (
            "same selector, no profile names it",
            profile_pinned,
            vec![],
            false,
        ),
        ("selector of CPU nodes", cpu_pinned, vec![], false),
    ];
    for (name, y, profiles, want) in cases {
        let o = Observed {
            profiles,
            ..Default::default()
        };
        let p = plan(&cache(&y), &o, &cfg(), t(0));
        assert_eq!(
            tolerates_gpu_taint(&p),
            vec![("mc-download".to_string(), want)],
            "{name}"
        );
    }
}

#[test]
fn a_pod_that_cannot_start_fails_the_attempt_after_the_threshold() {
    let c = cfg();
    let limit = c.stuck_pod_after.as_secs() as i64;
    let unschedulable = ObservedPod {
        name: "mc-download-x".into(),
        created: Some(t(0)),
        unschedulable: Some("0/5 nodes are available: 5 node(s) had untolerated taint".into()),
        ..Default::default()
    };
    let backoff = ObservedPod {
        name: "mc-download-x".into(),
        created: Some(t(0)),
        waiting_reason: Some("ImagePullBackOff".into()),
        waiting_message: Some("Back-off pulling image \"worker:1\"".into()),
        ..Default::default()
    };
    let invalid = ObservedPod {
        waiting_reason: Some("InvalidImageName".into()),
        ..backoff.clone()
    };
    // (case, pod, seconds since the pod was created, attempt failed, reason on the conditions)
    let cases = vec![
        (
            "unschedulable, young",
            unschedulable.clone(),
            10,
            false,
            "Unschedulable",
        ),
        (
            "unschedulable, at the limit",
            unschedulable,
            limit,
            true,
            "Unschedulable",
        ),
        (
            "pull back-off, young",
            backoff.clone(),
            limit - 2,
            false,
            "ImagePullBackOff",
        ),
        (
            "pull back-off, old",
            backoff,
            limit + 60,
            true,
            "ImagePullBackOff",
        ),
        (
            "invalid image name fails at once",
            invalid,
            1,
            true,
            "ImagePullBackOff",
        ),
    ];
    for (name, pod, age, fails, reason) in cases {
        let mc = cache(SIMPLE);
        let p0 = plan(&mc, &obs(vec![]), &c, t(0));
        let mut j = job_from(&p0, JobPhase::Download, t(0), JobState::Active);
        j.pod = Some(pod);
        let mc = applied(mc, &p0);
        let p = plan(&mc, &obs(vec![j.clone()]), &c, t(age));
        let st = &p.status;
        if fails {
            assert_eq!(deleted_jobs(&p), vec![j.name.clone()], "{name}");
            assert_eq!(
                conditions::find(&st.conditions, "Degraded").map(|c| c.reason.as_str()),
                Some(reason),
                "{name}"
            );
            assert_eq!(st.retry_count, Some(1), "{name}");
            assert!(events(&p).contains(&"Retrying".to_string()), "{name}");
        } else {
            assert!(deleted_jobs(&p).is_empty(), "{name}");
            let prog = conditions::find(&st.conditions, "Progressing");
            assert_eq!(prog.map(|c| c.reason.as_str()), Some(reason), "{name}");
            assert!(
                prog.is_some_and(|c| c.message.contains("mc-download-x")
                    && c.message.contains(&format!("fails after {limit}s"))),
                "{name}: {prog:?}"
            );
            assert_eq!(
                events(&p).iter().filter(|e| *e == reason).count(),
                1,
                "{name}"
            );
            assert!(
                p.requeue_after.is_some_and(|d| d <= c.progress_poll),
                "{name}"
            );
            // The next reconcile keeps waiting without a second event or a status change.
            let mc2 = applied(mc.clone(), &p);
            let again = plan(&mc2, &obs(vec![j.clone()]), &c, t(age + 1));
            assert!(!events(&again).iter().any(|e| e == reason), "{name}");
            assert!(!again.status_changed, "{name}");
        }
    }
}

#[test]
fn pod_annotations_cannot_loosen_confinement() {
    // (annotation on the cache, refused)
    let cases = [
        (
            "flexinfer.ai/job-pod-annotations",
            r#"{"container.apparmor.security.beta.kubernetes.io/worker":"unconfined"}"#,
            true,
        ),
        (
            "flexinfer.ai/quantize-pod-annotations",
            r#"{"seccomp.security.alpha.kubernetes.io/pod":"unconfined"}"#,
            true,
        ),
        (
            "flexinfer.ai/download-pod-annotations",
            r#"{"Container.Seccomp.Security.Alpha.Kubernetes.io/worker":"unconfined"}"#,
            true,
        ),
        (
            "flexinfer.ai/job-pod-annotations",
            r#"{"prometheus.io/scrape":"true"}"#,
            false,
        ),
        // Labels are not annotations: a label with that name changes nothing.
        ("flexinfer.ai/job-pod-labels", r#"{"team":"ml"}"#, false),
    ];
    for (key, value, refused) in cases {
        let mut mc = cache(SIMPLE);
        mc.metadata.annotations = Some(BTreeMap::from([(key.to_string(), value.to_string())]));
        let p = plan(&mc, &obs(vec![]), &cfg(), t(0));
        let r = conditions::find(&p.status.conditions, "Ready");
        if refused {
            assert_eq!(
                r.map(|c| c.reason.as_str()),
                Some("InvalidSpec"),
                "{key}={value}"
            );
            assert!(r.is_some_and(|c| c.message.contains(key)), "{r:?}");
            assert!(created_jobs(&p).is_empty(), "{key}={value}");
        } else {
            assert_eq!(created_jobs(&p), vec!["mc-download"], "{key}={value}");
        }
    }
}
