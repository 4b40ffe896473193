//! The per-cache metric series: set from a plan's outcome, and dropped when a Job ends or a cache
//! is deleted (also when it was deleted while the controller was away), so no alert keeps firing.

use std::collections::BTreeSet;
use std::time::Duration;

use flexinfer_api::contract::{self, JobPhase};
use flexinfer_api::modelcache::ModelCache;
use futures::StreamExt;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::{watcher, WatchStreamExt};
use kube::ResourceExt;
use tracing::debug;

use super::types::Plan;
use crate::metrics::Metrics;

/// A cache deleted without a finalizer (existing claim) never reaches `reconcile`: watch the
/// caches' metadata and drop the series of deleted ones. A reconcile that started before the
/// deletion may set a series again after it, so the series are also compared with the caches that
/// exist every few seconds (and after every relist, which covers deletions while the watch was down).
pub(super) async fn forget_deleted_caches(caches: Api<PartialObjectMeta<ModelCache>>, m: Metrics) {
    use kube::runtime::watcher::Event as WatchEvent;
    let key = |o: &PartialObjectMeta<ModelCache>| (o.name_any(), o.namespace().unwrap_or_default());
    let mut existing = BTreeSet::new();
    let mut listing = BTreeSet::new();
    let mut synced = false;
    let events = watcher(caches, watcher::Config::default()).default_backoff();
    futures::pin_mut!(events);
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            ev = events.next() => match ev {
                None => return,
                Some(Ok(WatchEvent::Delete(obj))) => {
                    let (name, ns) = key(&obj);
                    existing.remove(&(name.clone(), ns.clone()));
                    forget_cache_series(&m, &name, &ns);
                }
                Some(Ok(WatchEvent::Apply(obj))) => {
                    existing.insert(key(&obj));
                }
                Some(Ok(WatchEvent::Init)) => listing.clear(),
                Some(Ok(WatchEvent::InitApply(obj))) => {
                    listing.insert(key(&obj));
                }
                Some(Ok(WatchEvent::InitDone)) => {
                    existing = std::mem::take(&mut listing);
                    synced = true;
                    forget_absent(&m, &existing);
                }
                Some(Err(e)) => debug!(error = %e, "cache deletion watch error"),
            },
            _ = tick.tick() => if synced {
                forget_absent(&m, &existing);
            },
        }
    }
}

fn forget_absent(m: &Metrics, existing: &BTreeSet<(String, String)>) {
    for k in cache_series_keys(m) {
        if !existing.contains(&k) {
            forget_cache_series(m, &k.0, &k.1);
        }
    }
}

/// Drop per-Job series that no longer describe a running Job, so the deadline and stall alerts stop
/// once a Job ends (or the cache is being deleted).
fn forget_job_series(m: &crate::metrics::Metrics, name: &str, ns: &str, running: Option<JobPhase>) {
    for phase in JobPhase::ALL {
        if Some(phase) == running {
            continue;
        }
        let jt = phase.status_name();
        let _ = m.job_deadline_seconds.remove_label_values(&[name, ns, jt]);
        let _ = m.job_elapsed_seconds.remove_label_values(&[name, ns, jt]);
        // Progress is the running Job's: a finished phase keeps no series (three per Ready cache
        // were half of its series, kept for every finished cache).
        let _ = m.job_progress_ratio.remove_label_values(&[name, ns, jt]);
        let _ = m.job_progress_percent.remove_label_values(&[name, ns, jt]);
    }
    if running != Some(JobPhase::Quantize) {
        let _ = m.quantization_layer_index.remove_label_values(&[name, ns]);
        let _ = m.quantization_layers.remove_label_values(&[name, ns]);
        let _ = m.quantization_layer_total.remove_label_values(&[name, ns]);
        let _ = m
            .quantization_last_progress_timestamp
            .remove_label_values(&[name, ns]);
        let _ = m.quantization_on_cpu.remove_label_values(&[name, ns]);
    }
}

/// Drop every series of a cache: it is being deleted or is gone (deleted without a finalizer,
/// or while the controller was away), so no alert may keep firing for it.
pub(crate) fn forget_cache_series(m: &crate::metrics::Metrics, name: &str, ns: &str) {
    forget_job_series(m, name, ns, None);
    m.caches.forget(name, ns);
    for phase in JobPhase::ALL {
        let jt = phase.status_name();
        let _ = m.job_progress_ratio.remove_label_values(&[name, ns, jt]);
        let _ = m.job_progress_percent.remove_label_values(&[name, ns, jt]);
    }
    for r in contract::FailureReason::ALL {
        let _ = m
            .model_cache_failures_total
            .remove_label_values(&[name, ns, r.as_str()]);
    }
}

/// `(cache, namespace)` of every cache that has per-cache series.
fn cache_series_keys(m: &crate::metrics::Metrics) -> BTreeSet<(String, String)> {
    use prometheus::core::Collector;
    let mut out: BTreeSet<(String, String)> = m.caches.keys().into_iter().collect();
    for fam in m.job_progress_percent.collect() {
        for metric in fam.get_metric() {
            let label = |n: &str| {
                metric
                    .get_label()
                    .iter()
                    .find(|l| l.name() == n)
                    .map(|l| l.value().to_string())
            };
            if let (Some(c), Some(ns)) = (
                label("cache").or_else(|| label("model")),
                label("namespace"),
            ) {
                out.insert((c, ns));
            }
        }
    }
    out
}

pub(super) fn update_metrics(mc: &ModelCache, m: &Metrics, ns: &str, p: &Plan) {
    let name = mc.name_any();
    if mc.metadata.deletion_timestamp.is_some() {
        forget_cache_series(m, &name, ns);
        return;
    }
    forget_job_series(m, &name, ns, p.outcome.running.map(|(ph, _, _)| ph));
    if let Some(phase) = p.status.phase {
        // One series per cache: the current phase's (a one-hot row of 7 series per cache was most of the
        // controller's metric memory at thousands of caches).
        m.caches.set_phase(&name, ns, phase);
    }
    for (phase, reason) in &p.outcome.failed {
        m.model_cache_failures_total
            .with_label_values(&[name.as_str(), ns, reason.as_str()])
            .inc();
        if *phase == JobPhase::Quantize {
            m.caches.count_quantization(&name, ns, false);
        }
    }
    for phase in &p.outcome.completed {
        if *phase == JobPhase::Quantize {
            m.caches.count_quantization(&name, ns, true);
            if let Some(q) = &p.status.quantization {
                if let Some(r) = q.compression_ratio {
                    m.caches.set_compression_ratio(&name, ns, r);
                }
                if let (Some(s), Some(c)) = (&q.started_at, &q.completed_at) {
                    let secs = c.0.duration_since(s.0).as_secs_f64().max(0.0);
                    m.quantization_duration_seconds
                        .with_label_values(&[ns])
                        .observe(secs);
                }
            }
        }
    }
    if let Some(running) = p.outcome.running {
        set_running_series(m, &name, ns, p, running);
    }
}

/// The series of the running Job: deadline, elapsed, progress, and for quantization the layer
/// and the time of the last layer progress (the stall alert).
fn set_running_series(
    m: &Metrics,
    name: &str,
    ns: &str,
    p: &Plan,
    (phase, deadline, elapsed): (JobPhase, i64, i64),
) {
    let jt = phase.status_name();
    m.job_deadline_seconds
        .with_label_values(&[name, ns, jt])
        .set(deadline as f64);
    m.job_elapsed_seconds
        .with_label_values(&[name, ns, jt])
        .set(elapsed as f64);
    if let Some(pr) = p.status.progress {
        m.job_progress_ratio
            .with_label_values(&[name, ns, jt])
            .set(pr as f64 / 100.0);
        m.job_progress_percent
            .with_label_values(&[name, ns, jt])
            .set(pr as f64);
    }
    if let (JobPhase::Quantize, Some(on_cpu)) = (phase, p.outcome.gptq_on_cpu) {
        m.quantization_on_cpu
            .with_label_values(&[name, ns])
            .set(i64::from(on_cpu));
    }
    if phase == JobPhase::Quantize {
        // "No layer progress since the Job started" counts as a stall too: start the clock at
        // the Job's start when no newer progress was seen.
        let started = k8s_openapi::jiff::Timestamp::now().as_second() as f64 - elapsed as f64;
        let last = m
            .quantization_last_progress_timestamp
            .with_label_values(&[name, ns]);
        if last.get() < started {
            last.set(started);
        }
        if let Some(t) = &p.outcome.telemetry {
            if let Some(l) = t.layer {
                let prev = m
                    .quantization_layer_index
                    .with_label_values(&[name, ns])
                    .get();
                m.quantization_layer_index
                    .with_label_values(&[name, ns])
                    .set(l);
                if prev != l {
                    m.quantization_last_progress_timestamp
                        .with_label_values(&[name, ns])
                        .set(k8s_openapi::jiff::Timestamp::now().as_second() as f64);
                }
            }
            if let Some(l) = t.layers {
                m.quantization_layers.with_label_values(&[name, ns]).set(l);
                m.quantization_layer_total
                    .with_label_values(&[name, ns])
                    .set(l);
            }
        }
    }
}

#[cfg(test)]
mod metric_cleanup_tests {
    use super::*;

    fn has(m: &crate::metrics::Metrics, needle: &str) -> bool {
        m.render()
            .lines()
            .any(|l| !l.starts_with('#') && l.contains(needle))
    }

    #[test]
    fn job_series_are_dropped_when_the_job_is_not_running() {
        let m = crate::metrics::Metrics::new().expect("metrics");
        for jt in ["download", "quantization"] {
            m.job_deadline_seconds
                .with_label_values(&["c", "ns", jt])
                .set(100.0);
            m.job_elapsed_seconds
                .with_label_values(&["c", "ns", jt])
                .set(10.0);
        }
        m.quantization_last_progress_timestamp
            .with_label_values(&["c", "ns"])
            .set(1.0);
        m.quantization_on_cpu.with_label_values(&["c", "ns"]).set(1);
        forget_job_series(&m, "c", "ns", Some(JobPhase::Quantize));
        assert!(has(&m, "flexinfer_quantization_on_cpu{"), "{}", m.render());
        assert!(!has(&m, "job_type=\"download\""), "{}", m.render());
        assert!(has(
            &m,
            "flexinfer_job_deadline_seconds{job_type=\"quantization\""
        ));
        assert!(has(
            &m,
            "flexinfer_quantization_last_progress_timestamp_seconds"
        ));
        forget_job_series(&m, "c", "ns", None);
        assert!(!has(&m, "flexinfer_job_deadline_seconds"), "{}", m.render());
        assert!(!has(&m, "flexinfer_job_elapsed_seconds"));
        assert!(!has(
            &m,
            "flexinfer_quantization_last_progress_timestamp_seconds"
        ));
        assert!(!has(&m, "flexinfer_quantization_on_cpu{"), "{}", m.render());
    }

    /// The on-CPU gauge follows the running quantization: set when a reconcile read the worker's device, kept
    /// on reconciles that did not, dropped when the Job ends.
    #[test]
    fn the_on_cpu_gauge_is_set_while_the_quantization_runs() {
        let m = crate::metrics::Metrics::new().expect("metrics");
        let mc: ModelCache = serde_json::from_value(serde_json::json!({
            "apiVersion": "ai.flexinfer/v1alpha2", "kind": "ModelCache",
            "metadata": {"name": "c", "namespace": "ns"},
            "spec": {"source": "org/model"},
        }))
        .expect("cache");
        let plan = |running: bool, on_cpu: Option<bool>| Plan {
            status: Default::default(),
            status_changed: false,
            actions: vec![],
            requeue_after: None,
            outcome: super::super::types::Outcome {
                running: running.then_some((JobPhase::Quantize, 3600, 60)),
                gptq_on_cpu: on_cpu,
                ..Default::default()
            },
        };
        let value = |m: &crate::metrics::Metrics| {
            m.render()
                .lines()
                .find(|l| l.starts_with("flexinfer_quantization_on_cpu{"))
                .and_then(|l| l.rsplit(' ').next().map(str::to_string))
        };
        update_metrics(&mc, &m, "ns", &plan(true, None));
        assert_eq!(value(&m), None);
        update_metrics(&mc, &m, "ns", &plan(true, Some(true)));
        assert_eq!(value(&m).as_deref(), Some("1"));
        update_metrics(&mc, &m, "ns", &plan(true, None));
        assert_eq!(value(&m).as_deref(), Some("1"));
        update_metrics(&mc, &m, "ns", &plan(true, Some(false)));
        assert_eq!(value(&m).as_deref(), Some("0"));
        // The Job ended (its termination message may still carry the device): gone.
        update_metrics(&mc, &m, "ns", &plan(false, Some(true)));
        assert_eq!(value(&m), None, "{}", m.render());
    }

    /// The renamed series (`_ratio` 0-1, `_layers`) and their deprecated names carry the same reading while the
    /// quantization runs, and both go when it ends.
    #[test]
    fn progress_and_layer_count_under_their_new_and_deprecated_names() {
        let m = crate::metrics::Metrics::new().expect("metrics");
        let mc: ModelCache = serde_json::from_value(serde_json::json!({
            "apiVersion": "ai.flexinfer/v1alpha2", "kind": "ModelCache",
            "metadata": {"name": "c", "namespace": "ns"},
            "spec": {"source": "org/model"},
        }))
        .expect("cache");
        let telemetry: flexinfer_api::contract::events::ProgressEvent =
            serde_json::from_value(serde_json::json!({"percent": 40.0, "layer": 12, "layers": 32}))
                .expect("event");
        let plan = |running: bool| Plan {
            status: flexinfer_api::modelcache::ModelCacheStatus {
                progress: Some(40),
                ..Default::default()
            },
            status_changed: false,
            actions: vec![],
            requeue_after: None,
            outcome: super::super::types::Outcome {
                running: running.then_some((JobPhase::Quantize, 3600, 60)),
                telemetry: Some(telemetry.clone()),
                ..Default::default()
            },
        };
        let value = |m: &crate::metrics::Metrics, metric: &str| {
            m.render()
                .lines()
                .find(|l| l.starts_with(&format!("{metric}{{")))
                .and_then(|l| l.rsplit(' ').next().map(str::to_string))
        };
        update_metrics(&mc, &m, "ns", &plan(true));
        assert_eq!(
            value(&m, "flexinfer_job_progress_ratio").as_deref(),
            Some("0.4")
        );
        assert_eq!(
            value(&m, "flexinfer_job_progress_percent").as_deref(),
            Some("40")
        );
        assert_eq!(
            value(&m, "flexinfer_quantization_layers").as_deref(),
            Some("32")
        );
        assert_eq!(
            value(&m, "flexinfer_quantization_layer_total").as_deref(),
            Some("32")
        );
        update_metrics(&mc, &m, "ns", &plan(false));
        for metric in [
            "flexinfer_job_progress_ratio",
            "flexinfer_job_progress_percent",
            "flexinfer_quantization_layers",
            "flexinfer_quantization_layer_total",
        ] {
            assert_eq!(value(&m, metric), None, "{metric}: {}", m.render());
        }
    }
}
