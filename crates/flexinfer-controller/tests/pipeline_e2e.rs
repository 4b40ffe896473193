//! Integration tests of the ModelCache pipeline on the real control plane in cluster mode
//! (`scripts/testenv/up.sh cluster`: kube-apiserver, etcd, kube-controller-manager, scheduler,
//! kwok nodes whose Job pods run to Succeeded/Failed). The controller binary runs as a
//! subprocess, one per test, watching only that test's namespace.
//!
//! Run: `eval "$(TESTENV_BIN=… bash scripts/testenv/up.sh cluster)"; cargo test -p flexinfer-controller --test pipeline_e2e`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::time::Duration;

use anyhow::{Context, Result};
use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::modelcache::{CachePhase, ModelCache};
use flexinfer_e2e::{assert_no_status_churn, reconciles_total, wait_for};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::ResourceExt;

mod support;
use support::*;

const FULL_SPEC: &str = "  source: org/model\n  nodeSelector: {flexinfer.ai/gpu.arch: gfx1100}\n  abliteration: {useGPU: true}\n  quantization: {format: GPTQ, useGPU: true}\n  publish: {ociRef: registry.local/models/m}\n";
const QUANT_SPEC: &str = "  source: org/model\n  nodeSelector: {flexinfer.ai/gpu.arch: gfx1100}\n  maxRetries: 1\n  quantization: {format: GPTQ, useGPU: true}\n  publish: {ociRef: registry.local/models/m}\n";

fn uid(j: &Option<Job>) -> Option<String> {
    j.as_ref().and_then(|j| j.metadata.uid.clone())
}

fn image(j: &Job) -> String {
    j.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.first())
        .and_then(|c| c.image.clone())
        .unwrap_or_default()
}

fn cond_reason(m: &ModelCache, t: &str) -> Option<String> {
    m.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == t))
        .map(|c| c.reason.clone())
}

#[tokio::test]
async fn full_pipeline_reaches_ready() -> Result<()> {
    let mut w = World::new("pl-full").await?;
    let ctl = Controller::start(w.name(), &[]).await?;
    w.cache("full", FULL_SPEC, "").await?;
    let m = w.wait_phase("full", CachePhase::Ready, &ctl).await?;
    let st = m.status.clone().context("status")?;
    assert_eq!(st.current_phase.as_deref(), Some("ready"));
    let q = st.quantization.context("quantization status")?;
    // The path names the promoted generation.
    let generation = q.generations.generation.clone().context("generation")?;
    assert_eq!(
        st.path,
        Some(format!("full-cache:full/gptq-w4-g128.{generation}"))
    );
    assert_eq!(q.spec_hash.as_deref().map(str::len), Some(16));
    assert_eq!(
        q.image.as_deref(),
        Some("example.com/flexinfer/worker:rocm-gfx1100-a")
    );
    for phase in ["download", "abliterate", "quantize", "publish"] {
        let j = w
            .job(&format!("full-{phase}"))
            .await
            .with_context(|| format!("{phase} Job"))?;
        assert_eq!(
            j.status.as_ref().and_then(|s| s.succeeded),
            Some(1),
            "{phase}"
        );
        assert_eq!(
            j.owner_references().first().map(|o| o.name.as_str()),
            Some("full")
        );
    }
    assert_eq!(cond_reason(&m, "Ready").as_deref(), Some("CacheReady"));
    assert!(!w.events("CacheReady").await.is_empty());
    assert!(!w.events("QuantizationComplete").await.is_empty());
    // Ready is stable: reconciles of it write nothing (the namespace holds only this cache, so
    // every counted reconcile is one of it).
    assert_no_status_churn(&w.caches(), "full", "modelcache", 2, || ctl.reconciles())
        .await
        .with_context(|| format!("status rewritten while Ready\n{}", ctl.log_tail()))?;
    Ok(())
}

#[tokio::test]
async fn phase_fails_then_succeeds_on_retry() -> Result<()> {
    let mut w = World::new("pl-retry").await?;
    let ctl = Controller::start(w.name(), &[("FLEXINFER_RETRY_BASE_SECONDS", "6")]).await?;
    // Download pods fail with exit code 1: the Job fails after its own backoffLimit.
    w.cache(
        "retry",
        "  source: org/model\n  maxRetries: 2\n",
        r#""flexinfer.ai/download-pod-labels": '{"sim.kwok.test/outcome":"fail"}'"#,
    )
    .await?;
    let m = wait_for("first failure recorded", WAIT, || async {
        w.get("retry")
            .await
            .filter(|m| m.status.as_ref().and_then(|s| s.retry_count) == Some(1))
    })
    .await
    .with_context(|| ctl.log_tail())?;
    let st = m.status.clone().context("status")?;
    assert_eq!(st.last_failure_phase.as_deref(), Some("download"));
    let msg = st
        .download
        .and_then(|d| d.run.failure_message)
        .context("failureMessage")?;
    assert!(msg.starts_with("BackoffLimitExceeded"), "{msg}");
    assert!(msg.contains("simulated failure"), "{msg}");
    assert_eq!(
        cond_reason(&m, "Degraded").as_deref(),
        Some("BackoffLimitExceeded")
    );
    // Fix the cause before the retry fires.
    w.patch_cache("retry", serde_json::json!({"metadata": {"annotations": {"flexinfer.ai/download-pod-labels": null}}}))
        .await?;
    let m = w.wait_phase("retry", CachePhase::Ready, &ctl).await?;
    assert_eq!(m.status.as_ref().and_then(|s| s.retry_count), Some(0));
    assert!(!w.events("Retrying").await.is_empty());
    Ok(())
}

#[tokio::test]
async fn retries_exhausted_then_reset_or_runbook_patch_recovers() -> Result<()> {
    let mut w = World::new("pl-exhaust").await?;
    let ctl = Controller::start(w.name(), &[]).await?;
    let fail = r#""flexinfer.ai/quantize-pod-labels": '{"sim.kwok.test/outcome":"fail"}', "flexinfer.ai/quantize-pod-annotations": '{"sim.kwok.test/exit-code":"2"}'"#;
    w.cache("reset", QUANT_SPEC, fail).await?;
    w.cache("runbook", QUANT_SPEC, fail).await?;
    for name in ["reset", "runbook"] {
        let m = w.wait_phase(name, CachePhase::Failed, &ctl).await?;
        assert_eq!(
            cond_reason(&m, "Ready").as_deref(),
            Some("QuantizationFailed"),
            "{name}"
        );
        assert_eq!(
            cond_reason(&m, "Degraded").as_deref(),
            Some("BadInput"),
            "{name}"
        );
        let st = m.status.clone().context("status")?;
        assert_eq!(st.retry_count, Some(1));
        assert_eq!(st.last_failure_phase.as_deref(), Some("quantization"));
        // Failed stays Failed: no new Job appears.
        assert!(w
            .job(&format!("{name}-quantize"))
            .await
            .is_none_or(|j| j.metadata.deletion_timestamp.is_some()));
    }
    assert!(!w.events("PhaseFailed").await.is_empty());
    let clear = serde_json::json!({"metadata": {"annotations": {
        "flexinfer.ai/quantize-pod-labels": null, "flexinfer.ai/quantize-pod-annotations": null}}});
    // 1: the reset-retries annotation.
    w.patch_cache("reset", clear.clone()).await?;
    w.patch_cache(
        "reset",
        serde_json::json!({"metadata": {"annotations": {"flexinfer.ai/reset-retries": "true"}}}),
    )
    .await?;
    // 2: the runbook's status merge patch ("The ModelCache is `Failed` but the run got ~90% through", option A, step 3).
    w.patch_cache("runbook", clear).await?;
    let status_patch = serde_json::json!({"status": {"phase": "Quantizing", "retryCount": 0, "lastFailurePhase": null, "lastFailureTime": null}});
    w.caches()
        .patch_status(
            "runbook",
            &PatchParams::default(),
            &Patch::Merge(&status_patch),
        )
        .await?;
    for name in ["reset", "runbook"] {
        let m = w.wait_phase(name, CachePhase::Ready, &ctl).await?;
        assert!(
            !m.annotations().contains_key("flexinfer.ai/reset-retries"),
            "{name}: trigger annotation not removed"
        );
    }
    Ok(())
}

#[tokio::test]
async fn gpuprofile_image_change_recreates_young_quantize_job() -> Result<()> {
    let mut w = World::new("pl-drift").await?;
    let ctl =
        Controller::start(w.name(), &[("FLEXINFER_IMAGE_DRIFT_GRACE_SECONDS", "300")]).await?;
    w.cache(
        "drift",
        "  source: org/model\n  nodeSelector: {flexinfer.ai/gpu.arch: gfx1100}\n  quantization: {format: GPTQ, useGPU: true}\n",
        r#""flexinfer.ai/quantize-pod-annotations": '{"sim.kwok.test/duration":"20s"}'"#,
    )
    .await?;
    let old = wait_for("quantize Job", WAIT, || async {
        w.job("drift-quantize").await
    })
    .await
    .with_context(|| ctl.log_tail())?;
    assert_eq!(image(&old), "example.com/flexinfer/worker:rocm-gfx1100-a");
    let profiles: Api<GPUProfile> = Api::namespaced(w.c.clone(), w.name());
    profiles
        .patch(
            "gfx1100",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"quantization": {"images": {"GPTQ": "example.com/flexinfer/worker:rocm-gfx1100-b"}}}})),
        )
        .await?;
    let new = wait_for("recreated quantize Job", WAIT, || async {
        w.job("drift-quantize").await.filter(|j| {
            j.metadata.uid != old.metadata.uid && j.metadata.deletion_timestamp.is_none()
        })
    })
    .await
    .with_context(|| ctl.log_tail())?;
    assert_eq!(image(&new), "example.com/flexinfer/worker:rocm-gfx1100-b");
    let ev = w.events("QuantizerImageDrift").await;
    assert!(!ev.is_empty(), "no QuantizerImageDrift event");
    assert_eq!(ev[0].type_.as_deref(), Some("Warning"));
    let m = w.wait_phase("drift", CachePhase::Ready, &ctl).await?;
    assert_eq!(
        m.status
            .and_then(|s| s.quantization)
            .and_then(|q| q.run.image)
            .as_deref(),
        Some("example.com/flexinfer/worker:rocm-gfx1100-b")
    );
    Ok(())
}

#[tokio::test]
async fn requantize_reruns_only_quantize_and_publish() -> Result<()> {
    let mut w = World::new("pl-requant").await?;
    let ctl = Controller::start(w.name(), &[]).await?;
    w.cache("rq", QUANT_SPEC, "").await?;
    let first = w.wait_phase("rq", CachePhase::Ready, &ctl).await?;
    let path = first.status.as_ref().and_then(|s| s.path.clone());
    let dl = uid(&w.job("rq-download").await);
    let q = uid(&w.job("rq-quantize").await);
    let p = uid(&w.job("rq-publish").await);
    assert!(dl.is_some() && q.is_some() && p.is_some());
    w.patch_cache(
        "rq",
        serde_json::json!({"metadata": {"annotations": {"flexinfer.ai/requantize": "true"}}}),
    )
    .await?;
    wait_for("quantize re-run", WAIT, || async {
        w.get("rq")
            .await
            .filter(|m| m.status.as_ref().and_then(|s| s.phase) != Some(CachePhase::Ready))
    })
    .await?;
    let again = wait_for("Ready after requantize", WAIT, || async {
        let m = w.get("rq").await?;
        let ready = m.status.as_ref().and_then(|s| s.phase) == Some(CachePhase::Ready);
        let q2 = uid(&w.job("rq-quantize").await);
        let p2 = uid(&w.job("rq-publish").await);
        (ready && q2.is_some() && q2 != q && p2.is_some() && p2 != p).then_some(m)
    })
    .await
    .with_context(|| ctl.log_tail())?;
    assert_eq!(
        uid(&w.job("rq-download").await),
        dl,
        "download must not re-run"
    );
    assert!(
        !again.annotations().contains_key("flexinfer.ai/requantize"),
        "annotation not removed"
    );
    // The re-run wrote a new generation; the path moved to it once the run completed.
    let new_path = again.status.and_then(|s| s.path);
    assert_ne!(
        new_path, path,
        "requantize must not reuse the old generation"
    );
    assert!(
        new_path
            .as_deref()
            .is_some_and(|p| p.starts_with("rq-cache:rq/gptq-w4-g128.")),
        "{new_path:?}"
    );
    Ok(())
}

#[tokio::test]
async fn controller_restart_mid_pipeline_creates_no_duplicates() -> Result<()> {
    let mut w = World::new("pl-restart").await?;
    let mut ctl = Controller::start(w.name(), &[]).await?;
    w.cache(
        "rs",
        QUANT_SPEC,
        r#""flexinfer.ai/quantize-pod-annotations": '{"sim.kwok.test/duration":"6s"}'"#,
    )
    .await?;
    let dl_uid = wait_for("quantize Job running", WAIT, || async {
        let _ = w.job("rs-quantize").await?;
        uid(&w.job("rs-download").await)
    })
    .await
    .with_context(|| ctl.log_tail())?;
    let q_uid = uid(&w.job("rs-quantize").await);
    ctl.kill().await;
    let ctl2 = Controller::start(w.name(), &[]).await?;
    w.wait_phase("rs", CachePhase::Ready, &ctl2).await?;
    assert_eq!(
        uid(&w.job("rs-download").await),
        Some(dl_uid),
        "download re-ran"
    );
    assert_eq!(
        uid(&w.job("rs-quantize").await),
        q_uid,
        "quantize Job was replaced"
    );
    let jobs = w
        .jobs()
        .list(&ListParams::default().labels("flexinfer.ai/cache=rs"))
        .await?;
    assert_eq!(
        jobs.items.len(),
        3,
        "{:?}",
        jobs.items.iter().map(|j| j.name_any()).collect::<Vec<_>>()
    );
    let created = w.events("JobCreated").await;
    let total: i32 = created.iter().map(|e| e.count.unwrap_or(1).max(1)).sum();
    assert!(total <= 3, "{total} JobCreated events for 3 phases");
    Ok(())
}

#[tokio::test]
async fn deleting_a_cache_removes_jobs_and_created_pvc_only() -> Result<()> {
    let mut w = World::new("pl-delete").await?;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let ctl = Controller::start(w.name(), &[("FLEXINFER_METRICS_ADDR", &addr)]).await?;
    // A PVC the user owns.
    w.pv_for("shared").await?;
    w.apply_yaml(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: shared}\nspec:\n  accessModes: [ReadWriteOnce]\n  storageClassName: ''\n  resources: {requests: {storage: 100Gi}}\n",
    )
    .await?;
    w.cache("owned", "  source: org/model\n", "").await?;
    w.apply_yaml("apiVersion: ai.flexinfer/v1alpha1\nkind: ModelCache\nmetadata: {name: borrowed}\nspec:\n  source: org/model\n  existingClaimName: shared\n")
        .await?;
    for n in ["owned", "borrowed"] {
        w.wait_phase(n, CachePhase::Ready, &ctl).await?;
    }
    let owned = w.get("owned").await.context("owned")?;
    assert!(owned
        .finalizers()
        .iter()
        .any(|f| f == "flexinfer.ai/modelcache-cleanup"));
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(w.c.clone(), w.name());
    assert!(pvcs.get_opt("owned-cache").await?.is_some());
    let series = |m: &str, cache: &str| {
        m.lines()
            .filter(|l| {
                !l.starts_with('#')
                    && (l.contains(&format!("cache=\"{cache}\""))
                        || l.contains(&format!("model=\"{cache}\"")))
            })
            .count()
    };
    let before = wait_for("series of both caches", WAIT, || async {
        let (_, m) = http_get(port, "/metrics").await?;
        (series(&m, "owned") > 0 && series(&m, "borrowed") > 0).then_some(m)
    })
    .await?;
    assert!(before.contains("flexinfer_modelcache_phase{cache=\"borrowed\""));
    for n in ["owned", "borrowed"] {
        w.caches().delete(n, &DeleteParams::background()).await?;
    }
    // Both are gone from /metrics, including the one without a finalizer (never reconciled
    // again after its deletion).
    wait_for("no series of deleted caches", WAIT, || async {
        let (_, m) = http_get(port, "/metrics").await?;
        (series(&m, "owned") == 0 && series(&m, "borrowed") == 0).then_some(())
    })
    .await
    .with_context(|| ctl.log_tail())?;
    wait_for("caches gone", WAIT, || async {
        (w.get("owned").await.is_none() && w.get("borrowed").await.is_none()).then_some(())
    })
    .await
    .with_context(|| ctl.log_tail())?;
    wait_for("created PVC deleted", WAIT, || async {
        match pvcs.get_opt("owned-cache").await {
            Ok(None) => Some(()),
            Ok(Some(p)) if p.metadata.deletion_timestamp.is_some() => Some(()),
            _ => None,
        }
    })
    .await?;
    wait_for("Jobs garbage-collected", WAIT, || async {
        let l = w.jobs().list(&ListParams::default()).await.ok()?;
        l.items
            .iter()
            .all(|j| j.metadata.deletion_timestamp.is_some())
            .then_some(())
    })
    .await?;
    let shared = pvcs
        .get_opt("shared")
        .await?
        .context("existingClaimName PVC was deleted")?;
    assert!(
        shared.metadata.deletion_timestamp.is_none(),
        "existingClaimName PVC is being deleted"
    );
    Ok(())
}

#[tokio::test]
async fn invalid_but_admitted_spec_gets_a_clear_condition() -> Result<()> {
    let mut w = World::new("pl-invalid").await?;
    let mut ctl = Controller::start(w.name(), &[]).await?;
    w.cache(
        "q3ks",
        "  source: org/model\n  quantization: {format: GGUF, ggufType: Q3_K_S}\n",
        "",
    )
    .await?;
    w.cache(
        "badlabels",
        "  source: org/model\n",
        r#""flexinfer.ai/job-pod-labels": "not json""#,
    )
    .await?;
    let m = w.wait_phase("q3ks", CachePhase::Failed, &ctl).await?;
    assert_eq!(
        cond_reason(&m, "Ready").as_deref(),
        Some("UnsupportedFormat")
    );
    assert_eq!(
        cond_reason(&m, "Quantized").as_deref(),
        Some("UnsupportedFormat")
    );
    let msg = m
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(msg.contains("spec.quantization.ggufType Q3_K_S"), "{msg}");
    let b = w.wait_phase("badlabels", CachePhase::Failed, &ctl).await?;
    assert_eq!(cond_reason(&b, "Ready").as_deref(), Some("InvalidSpec"));
    assert!(
        w.job("q3ks-download").await.is_none(),
        "a Job was created for an unsupported format"
    );
    // No crash loop, no event spam, no status churn: reconciles of the settled cache write
    // nothing (the namespace also holds `badlabels`, whose reconciles count too).
    assert_no_status_churn(&w.caches(), "q3ks", "modelcache", 3, || ctl.reconciles())
        .await
        .with_context(|| ctl.log_tail())?;
    assert!(ctl.alive(), "controller exited:\n{}", ctl.log_tail());
    let ev = w.events("UnsupportedFormat").await;
    assert_eq!(
        ev.iter().map(|e| e.count.unwrap_or(1).max(1)).sum::<i32>(),
        1,
        "event spam"
    );
    // Fixing the spec recovers without touching status.
    w.caches()
        .patch(
            "q3ks",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"quantization": {"ggufType": "Q4_K_M"}}})),
        )
        .await?;
    w.wait_phase("q3ks", CachePhase::Ready, &ctl).await?;
    ctl.kill().await;
    Ok(())
}

/// A download pinned to a GPU architecture no node has: the Job tolerates the GPU taint, the
/// real scheduler reports the pod Unschedulable, the cache says so at once, and the attempt fails
/// after the stuck-pod threshold with the scheduler's message.
#[tokio::test]
async fn a_pod_no_node_can_take_fails_with_the_schedulers_message() -> Result<()> {
    let mut w = World::new("pl-unsched").await?;
    let ctl = Controller::start(w.name(), &[("FLEXINFER_STUCK_POD_SECONDS", "6")]).await?;
    w.cache(
        "nowhere",
        "  source: org/model
  maxRetries: 0
  nodeSelector: {flexinfer.ai/gpu.arch: gfx1030}
",
        "",
    )
    .await?;
    let job = wait_for("download Job", WAIT, || async {
        w.job("nowhere-download").await
    })
    .await
    .with_context(|| ctl.log_tail())?;
    let tolerations = job
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.tolerations.clone())
        .unwrap_or_default();
    assert!(
        tolerations
            .iter()
            .any(|t| t.key.as_deref() == Some("dedicated")
                && t.value.as_deref() == Some("gpu")
                && t.effect.as_deref() == Some("NoSchedule")),
        "{tolerations:?}"
    );
    let waiting = wait_for("Progressing=Unschedulable", WAIT, || async {
        w.get("nowhere")
            .await
            .filter(|m| cond_reason(m, "Progressing").as_deref() == Some("Unschedulable"))
    })
    .await
    .with_context(|| ctl.log_tail())?;
    assert_ne!(
        waiting.status.as_ref().and_then(|s| s.phase),
        Some(CachePhase::Failed)
    );
    let m = w.wait_phase("nowhere", CachePhase::Failed, &ctl).await?;
    assert_eq!(
        cond_reason(&m, "Degraded").as_deref(),
        Some("Unschedulable")
    );
    let msg = m
        .status
        .as_ref()
        .and_then(|s| s.download.as_ref())
        .and_then(|d| d.failure_message.clone())
        .unwrap_or_default();
    assert!(msg.starts_with("Unschedulable: "), "{msg}");
    assert!(
        msg.contains("node"),
        "the scheduler's message is carried: {msg}"
    );
    assert!(!w.events("Unschedulable").await.is_empty());
    Ok(())
}

/// Status is written only from the object it was planned from: a write from a stale copy is
/// refused (409) and changes nothing, so `retryCount` cannot go backwards.
#[tokio::test]
async fn a_status_planned_from_a_stale_copy_is_refused() -> Result<()> {
    use flexinfer_api::modelcache::ModelCacheStatus;
    use flexinfer_controller::modelcache::reconcile::{write_status, Error as RecError};
    let w = World::new("pl-stale").await?;
    w.apply_yaml(
        "apiVersion: ai.flexinfer/v1alpha1\nkind: ModelCache\nmetadata: {name: s}\nspec:\n  source: org/model\n",
    )
    .await?;
    let stale = w.get("s").await.context("cache")?;
    let rv = stale.resource_version();
    let first = ModelCacheStatus {
        retry_count: Some(2),
        ..Default::default()
    };
    let newer = write_status(&w.caches(), "s", rv.as_deref(), &first)
        .await?
        .resource_version();
    assert!(newer.is_some() && newer != rv);
    let older = ModelCacheStatus {
        retry_count: Some(1),
        ..Default::default()
    };
    let r = write_status(&w.caches(), "s", rv.as_deref(), &older).await;
    assert!(matches!(r, Err(RecError::Conflict)), "{r:?}");
    let now = w.get("s").await.context("cache")?;
    assert_eq!(now.status.and_then(|s| s.retry_count), Some(2));
    Ok(())
}

fn reconciles(metrics: &str) -> u64 {
    reconciles_total(metrics, "modelcache")
}

#[tokio::test]
async fn leader_election_lets_one_replica_reconcile_and_fails_over() -> Result<()> {
    let mut w = World::new("pl-leader").await?;
    let ports: Vec<(u16, u16)> = (0..2).map(|_| (free_port(), free_port())).collect();
    let mut ctls = Vec::new();
    for (m, h) in &ports {
        let (ma, ha) = (format!("127.0.0.1:{m}"), format!("127.0.0.1:{h}"));
        ctls.push(
            Controller::start(
                w.name(),
                &[
                    ("FLEXINFER_LEADER_ELECT", "true"),
                    ("FLEXINFER_LEASE_DURATION_SECONDS", "3"),
                    ("FLEXINFER_METRICS_ADDR", &ma),
                    ("FLEXINFER_HEALTH_ADDR", &ha),
                ],
            )
            .await?,
        );
    }
    w.cache("one", "  source: org/model\n", "").await?;
    w.wait_phase("one", CachePhase::Ready, &ctls[0]).await?;
    let mut counts = Vec::new();
    for (m, h) in &ports {
        let (code, _) = wait_for("healthz", Duration::from_secs(20), || {
            http_get(*h, "/healthz")
        })
        .await?;
        assert_eq!(code, 200);
        let (code, _) = http_get(*h, "/readyz").await.context("readyz")?;
        assert_eq!(code, 200);
        let (_, body) = http_get(*m, "/metrics").await.context("metrics")?;
        counts.push(reconciles(&body));
    }
    let active: Vec<usize> = counts
        .iter()
        .enumerate()
        .filter(|(_, c)| **c > 0)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(active.len(), 1, "reconcile counts per replica: {counts:?}");
    // Kill the leader: the standby takes over and reconciles a new cache.
    let leader = active[0];
    ctls[leader].kill().await;
    let standby = 1 - leader;
    w.cache("two", "  source: org/model\n", "").await?;
    w.wait_phase("two", CachePhase::Ready, &ctls[standby])
        .await?;
    let (_, body) = http_get(ports[standby].0, "/metrics")
        .await
        .context("metrics")?;
    assert!(reconciles(&body) > 0);
    assert!(
        body.contains("flexinfer_modelcache_phase{cache=\"two\""),
        "phase metric missing"
    );
    Ok(())
}
