//! The planner's test fixtures (cache manifests, a config, observed Jobs built from a plan), shared
//! by this crate's tests and, with the `testkit` feature, the controller's. Not used by the planner.
#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::panic,
    clippy::arithmetic_side_effects
)]

use flexinfer_api::contract::JobPhase;
use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::modelcache::{CachePhase, ModelCache};
use k8s_openapi::jiff::Timestamp;

use super::config::Config;
use super::observe::{JobState, ObservedJob, ObservedPod};
use super::plan::{plan, Action, LogTail, Observed, Plan};

pub fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + s).unwrap_or_default()
}

pub fn cfg() -> Config {
    Config {
        worker_image: Some("worker:1".into()),
        ..Config::default()
    }
}

pub const FULL: &str = r#"
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

pub const SIMPLE: &str = r#"
apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {name: mc, namespace: ns, uid: u-1, generation: 1, finalizers: [flexinfer.ai/modelcache-cleanup]}
spec:
  source: org/model
  maxRetries: 2
  quantization: {format: GPTQ}
"#;

pub fn cache(y: &str) -> ModelCache {
    serde_norway::from_str(y).expect("test manifest")
}

pub fn profile(arch: &str, image: &str) -> GPUProfile {
    serde_norway::from_str(&format!(
        "apiVersion: ai.flexinfer/v1alpha2\nkind: GPUProfile\nmetadata: {{name: {arch}, namespace: ns}}\n\
         spec: {{architecture: {arch}, vendor: amd, gpuDriverMemoryMB: 12288, vramMB: 24576,\n\
         env: [{{name: HSA_OVERRIDE_GFX_VERSION, value: '11.0.0'}}],\n\
         quantization: {{images: {{GPTQ: '{image}'}}}}}}"
    ))
    .expect("profile")
}

/// Apply a plan's status (and finalizer) to the object, as the reconciler would.
pub fn applied(mut mc: ModelCache, p: &Plan) -> ModelCache {
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

pub fn created_jobs(p: &Plan) -> Vec<String> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::CreateJob(j) => j.metadata.name.clone(),
            _ => None,
        })
        .collect()
}

pub fn deleted_jobs(p: &Plan) -> Vec<String> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::DeleteJob(n) => Some(n.clone()),
            _ => None,
        })
        .collect()
}

pub fn events(p: &Plan) -> Vec<String> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::Event { reason, .. } => Some(reason.clone()),
            _ => None,
        })
        .collect()
}

/// The Job a plan created, as the cluster would report it in `state`.
pub fn job_from(p: &Plan, phase: JobPhase, created: Timestamp, state: JobState) -> ObservedJob {
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

pub fn obs(jobs: Vec<ObservedJob>) -> Observed {
    Observed {
        jobs: jobs.into_iter().map(|j| (j.phase, j)).collect(),
        pvc_exists: true,
        profiles: vec![profile("gfx1100", "q:a")],
        log_tail: None,
        ..Default::default()
    }
}

/// Drive the simple cache (download → quantize) to Ready; returns the Ready object.
pub fn ready_simple() -> ModelCache {
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

pub fn running_quantize(log: Option<LogTail>, mc: &ModelCache, now: i64) -> (Plan, ObservedJob) {
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
pub fn downloaded() -> ModelCache {
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

/// `/cache/<promoted abliteration output>` of a plan's status.
pub fn mc_ablit_dir(p: &Plan) -> String {
    format!(
        "/cache/{}",
        p.status
            .abliteration
            .as_ref()
            .and_then(|a| a.output_dir.clone())
            .unwrap_or_default()
    )
}

/// The plan's Job of `phase` for the FULL cache, as the API server would return it (status, uid,
/// managed fields and all).
pub fn stored_job(phase: JobPhase, state: &str) -> k8s_openapi::api::batch::v1::Job {
    let p = plan(&cache(FULL), &obs(vec![]), &cfg(), t(0));
    let j = p
        .actions
        .iter()
        .find_map(|a| match a {
            Action::CreateJob(j) => Some(j.clone()),
            _ => None,
        })
        .expect("a created Job");
    assert!(j
        .metadata
        .name
        .as_deref()
        .unwrap()
        .ends_with(phase.as_str()));
    let mut v = serde_json::to_value(&j).unwrap();
    v["metadata"]["uid"] = "u-1".into();
    v["metadata"]["creationTimestamp"] = "2026-12-01T00:00:00Z".into();
    v["metadata"]["managedFields"] = serde_json::json!([{"manager": "x", "operation": "Update"}]);
    v["status"] = serde_json::json!({
        "startTime": "2026-12-01T00:00:01Z",
        "conditions": [{"type": state, "status": "True", "reason": "BackoffLimitExceeded", "message": "m"}]
    });
    serde_json::from_value(v).unwrap()
}
