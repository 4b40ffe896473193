//! A cache from creation to Ready and deletion: finalizer, claim, Jobs in order, restarts, shared claims.

use super::*;

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
    let generation = q.generations.generation.clone().expect("generation");
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

/// Deleting a cache keeps its claim while a Model reads from it (a `pvc://` source or the directory it
/// serves); the event names the Model.
#[test]
fn deletion_keeps_a_claim_a_model_serves() {
    let mut a = cache(SIMPLE);
    a.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t(0)));
    let o = Observed {
        claim_models: vec!["llama".into()],
        ..obs(vec![])
    };
    let p = plan(&a, &o, &cfg(), t(0));
    assert!(
        !p.actions.iter().any(|a| matches!(a, Action::DeletePvc(_))),
        "{:?}",
        p.actions
    );
    assert!(p.actions.contains(&Action::RemoveFinalizer));
    assert!(p.actions.iter().any(
        |a| matches!(a, Action::Event { reason, note, .. } if reason == "ClaimKept" && note.contains("Model llama"))
    ));
    // Nothing reads it: the created claim goes.
    let p = plan(&a, &obs(vec![]), &cfg(), t(0));
    assert!(p
        .actions
        .contains(&Action::DeletePvc(jobs::created_claim_name("mc"))));
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

/// Measurement (`cargo test --release -p flexinfer-controller --lib memory_per_stored_object -- --ignored
/// --nocapture`): resident memory of 5,000 Ready caches and of 15,000 Jobs as the Job store keeps them
/// (compact `StoredJob`) beside pruned `k8s_openapi` Jobs; the compact form must stay under half.
#[test]
#[ignore]
fn memory_per_stored_object() {
    use crate::modelcache::observe::prune_job;
    use crate::modelcache::stored_job::StoredJob;
    use std::sync::Arc;
    fn rss_kb() -> u64 {
        let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        s.split_whitespace()
            .nth(1)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 4
    }
    let per = |before: u64, after: u64, n: u64| after.saturating_sub(before) * 1024 / n;
    let ready = serde_json::to_string(&ready_simple()).unwrap();
    let before = rss_kb();
    let caches: Vec<Arc<ModelCache>> = (0..5000)
        .map(|_| Arc::new(serde_json::from_str(&ready).unwrap()))
        .collect();
    println!("Ready ModelCache: {} B each", per(before, rss_kb(), 5000));
    let c = cfg();
    let full = cache(FULL);
    let texts: Vec<String> = [JobPhase::Download, JobPhase::Quantize, JobPhase::Publish]
        .iter()
        .map(|phase| {
            let t_ = jobs::resolve_target(&full, *phase, &[profile("gfx1100", "q")], &c);
            let mut v = serde_json::to_value(jobs::build_job(
                &full,
                &Default::default(),
                &[],
                &t_,
                "q",
                "h",
                &c,
            ))
            .unwrap();
            // What the API server adds: identity, the Job controller's labels, a finished status.
            let meta = &mut v["metadata"];
            meta["uid"] = "0b6a1f9e-3c1d-4f5e-9a7b-2d8c6e4f1a3b".into();
            meta["resourceVersion"] = "1234567".into();
            meta["creationTimestamp"] = "2026-12-06T00:00:00Z".into();
            meta["generation"] = 1.into();
            meta["labels"]["batch.kubernetes.io/controller-uid"] =
                "0b6a1f9e-3c1d-4f5e-9a7b-2d8c6e4f1a3b".into();
            meta["labels"]["batch.kubernetes.io/job-name"] = "mc-quantize".into();
            v["status"] = serde_json::json!({
                "startTime": "2026-12-06T00:00:01Z", "completionTime": "2026-12-06T00:00:09Z",
                "succeeded": 1, "ready": 0, "terminating": 0, "uncountedTerminatedPods": {},
                "conditions": [
                    {"type": "SuccessCriteriaMet", "status": "True", "reason": "CompletionsReached",
                     "message": "Reached expected number of succeeded pods",
                     "lastProbeTime": "2026-12-06T00:00:09Z", "lastTransitionTime": "2026-12-06T00:00:09Z"},
                    {"type": "Complete", "status": "True", "reason": "CompletionsReached",
                     "message": "Reached expected number of succeeded pods",
                     "lastProbeTime": "2026-12-06T00:00:09Z", "lastTransitionTime": "2026-12-06T00:00:09Z"}]
            });
            v.to_string()
        })
        .collect();
    let before = rss_kb();
    let stored: Vec<Arc<StoredJob>> = (0..5000)
        .flat_map(|_| texts.iter())
        .map(|t| {
            let j: StoredJob = serde_json::from_str(t).unwrap();
            Arc::new(j)
        })
        .collect();
    let compact = per(before, rss_kb(), 15000);
    let before = rss_kb();
    let pruned: Vec<Arc<k8s_openapi::api::batch::v1::Job>> = (0..5000)
        .flat_map(|_| texts.iter())
        .map(|t| {
            let mut j: k8s_openapi::api::batch::v1::Job = serde_json::from_str(t).unwrap();
            prune_job(&mut j);
            Arc::new(j)
        })
        .collect();
    let wide = per(before, rss_kb(), 15000);
    println!("Job: StoredJob {compact} B, pruned k8s Job {wide} B each");
    assert!(compact * 2 < wide, "StoredJob {compact} B vs {wide} B");
    let pod = serde_json::json!({
        "metadata": {"name": "mc-quantize-abcde", "namespace": "ns", "uid": "u-2",
                     "creationTimestamp": "2026-12-06T00:00:00Z", "resourceVersion": "123",
                     "labels": {"batch.kubernetes.io/job-name": "mc-quantize", "job-name": "mc-quantize",
                                "batch.kubernetes.io/controller-uid": "u-1", "controller-uid": "u-1",
                                "flexinfer.ai/cache": "mc", "flexinfer.ai/phase": "quantize",
                                "app.kubernetes.io/managed-by": "flexinfer"},
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "mc-quantize",
                                          "uid": "u-1", "controller": true, "blockOwnerDeletion": true}]},
        "spec": {"containers": [{"name": "quantizer", "image": "q"}], "nodeName": "n"},
        "status": {"phase": "Succeeded", "conditions": [
                       {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"},
                       {"type": "Initialized", "status": "True"}],
                   "containerStatuses": [{"name": "quantizer", "image": "q", "imageID": "q@sha256:0",
                       "ready": false, "restartCount": 0,
                       "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                                "message": "{\"applied\":{}}"}}}]}
    })
    .to_string();
    let before = rss_kb();
    let spods: Vec<Arc<crate::modelcache::stored_job::StoredPod>> = (0..15000)
        .map(|_| {
            let p: crate::modelcache::stored_job::StoredPod = serde_json::from_str(&pod).unwrap();
            Arc::new(p)
        })
        .collect();
    let compact = per(before, rss_kb(), 15000);
    let before = rss_kb();
    let kpods: Vec<Arc<k8s_openapi::api::core::v1::Pod>> = (0..15000)
        .map(|_| {
            let p: k8s_openapi::api::core::v1::Pod = serde_json::from_str(&pod).unwrap();
            Arc::new(p)
        })
        .collect();
    let wide = per(before, rss_kb(), 15000);
    println!("Pod: StoredPod {compact} B, k8s Pod {wide} B each");
    println!(
        "inline sizes: ObjectMeta {} B, StoredJob {} B, StoredPod {} B, ModelCache {} B",
        std::mem::size_of::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>(),
        std::mem::size_of::<StoredJob>(),
        std::mem::size_of::<crate::modelcache::stored_job::StoredPod>(),
        std::mem::size_of::<ModelCache>()
    );
    assert!(compact < wide, "StoredPod {compact} B vs {wide} B");
    drop((caches, stored, pruned, spods, kpods));
}
