//! The thin reconciler: observe (Jobs, pods, PVC, GPUProfiles, log tail), call [`plan`], apply.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flexinfer_api::contract::controller::FIELD_MANAGER;
use flexinfer_api::contract::{self, labels, JobPhase};
use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::model::Model;
use flexinfer_api::modelcache::{CachePhase, ModelCache};
use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolumeClaim, Pod};
use kube::api::{
    Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams, PropagationPolicy,
};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action as CtrlAction, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Resource, ResourceExt};
use tracing::{debug, info, warn};

use super::config::Config;
use super::jobs;
use super::observe::{observe_job, JobState};
use super::plan::{plan, Action, ClaimPeer, Observed, Plan};
use crate::metrics::Metrics;

/// Bytes of pod log read per progress poll.
const LOG_TAIL_BYTES: i64 = 64 * 1024;

/// Reconcile errors (all retried with backoff by `error_policy`).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("object without {0}")]
    Missing(&'static str),
    #[error("serialize: {0}")]
    Json(#[from] serde_json::Error),
    #[error("object changed while reconciling; retrying")]
    Conflict,
}

/// Shared state of the reconciler.
pub struct Context {
    pub client: Client,
    pub metrics: Metrics,
    pub config: Config,
    pub recorder: Recorder,
    /// Last pod-log read per cache.
    log_reads: Mutex<HashMap<(String, String), Instant>>,
    /// Consecutive reconcile failures per cache (error requeue backoff).
    failures: crate::backoff::Failures,
}

impl Context {
    fn log_read_due(&self, ns: &str, name: &str) -> bool {
        let Ok(mut m) = self.log_reads.lock() else {
            return true;
        };
        let key = (ns.to_string(), name.to_string());
        let min_gap = self.config.progress_poll.checked_div(2).unwrap_or_default();
        match m.get(&key) {
            Some(t) if t.elapsed() < min_gap => false,
            _ => {
                m.insert(key, Instant::now());
                true
            }
        }
    }
}

/// Run the ModelCache controller until shutdown. `namespace` limits the watch (all when `None`).
pub async fn run(
    client: Client,
    metrics: Metrics,
    config: Config,
    namespace: Option<String>,
) -> anyhow::Result<()> {
    let (caches, job_api, profiles): (Api<ModelCache>, Api<Job>, Api<GPUProfile>) = match &namespace
    {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all(client.clone()),
        ),
    };
    let reporter = Reporter {
        controller: FIELD_MANAGER.into(),
        instance: std::env::var(flexinfer_api::contract::env::controller::POD_NAME).ok(),
    };
    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter),
        client,
        metrics,
        config,
        log_reads: Mutex::new(HashMap::new()),
        failures: Default::default(),
    });
    let guard = crate::supervise::Guard::new(
        "modelcache",
        ctx.metrics.clone(),
        Some(ctx.recorder.clone()),
    );
    let cache_meta: Api<PartialObjectMeta<ModelCache>> = match &namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let forget = forget_deleted_caches(cache_meta, ctx.metrics.clone());
    let controller = Controller::new(caches, watcher::Config::default());
    let store = controller.store();
    let job_wc = watcher::Config::default().labels(&format!(
        "{}={}",
        labels::MANAGED_BY,
        labels::MANAGED_BY_VALUE
    ));
    let run = controller
        .owns(job_api, job_wc)
        .watches(
            profiles,
            watcher::Config::default(),
            move |gp: GPUProfile| {
                // Only the caches whose phases select this profile's architecture.
                store
                    .state()
                    .into_iter()
                    .filter(|mc| jobs::profile_affects(mc, &gp))
                    .map(|mc| ObjectRef::from_obj(&*mc))
                    .collect::<Vec<_>>()
            },
        )
        .shutdown_on_signal()
        // A panic in one cache's reconcile is an error of that cache, not of the process.
        .run(
            guard.reconcile(reconcile),
            guard.error_policy(error_policy),
            ctx,
        )
        .for_each(|res| async move {
            if let Err(e) = res {
                debug!(error = %e, "reconcile stream error");
            }
        });
    tokio::select! {
        () = run => {}
        () = forget => {}
    }
    Ok(())
}

/// A cache deleted without a finalizer (existing claim) never reaches `reconcile`: watch the
/// caches' metadata and drop the series of deleted ones. A reconcile that started before the
/// deletion may set a series again after it, so the series are also compared with the caches that
/// exist every few seconds (and after every relist, which covers deletions while the watch was down).
async fn forget_deleted_caches(caches: Api<PartialObjectMeta<ModelCache>>, m: Metrics) {
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

fn error_policy(mc: Arc<ModelCache>, err: &Error, ctx: Arc<Context>) -> CtrlAction {
    if matches!(err, Error::Conflict) {
        debug!(cache = %mc.name_any(), "stale object; requeue");
        return CtrlAction::requeue(Duration::from_millis(300));
    }
    ctx.metrics
        .reconcile_errors_total
        .with_label_values(&["modelcache"])
        .inc();
    let delay = ctx.failures.failed(&failure_key(&mc));
    warn!(cache = %mc.name_any(), namespace = ?mc.namespace(), error = %err, retry_in_ms = delay.as_millis() as u64, "reconcile failed");
    CtrlAction::requeue(delay)
}

fn failure_key(mc: &ModelCache) -> String {
    format!("{}/{}", mc.namespace().unwrap_or_default(), mc.name_any())
}

async fn reconcile(mc: Arc<ModelCache>, ctx: Arc<Context>) -> Result<CtrlAction, Error> {
    let t0 = Instant::now();
    let res = reconcile_inner(&mc, &ctx).await;
    if res.is_ok() {
        ctx.failures.succeeded(&failure_key(&mc));
    }
    ctx.metrics
        .reconcile_duration_seconds
        .with_label_values(&["modelcache"])
        .observe(t0.elapsed().as_secs_f64());
    res
}

async fn observe(mc: &ModelCache, ctx: &Context, ns: &str) -> Result<Observed, Error> {
    let name = mc.name_any();
    let client = &ctx.client;
    let job_api: Api<Job> = Api::namespaced(client.clone(), ns);
    let sel = format!("{}={}", labels::CACHE, name);
    let job_list = job_api.list(&ListParams::default().labels(&sel)).await?;
    let owned: Vec<Job> = job_list
        .items
        .into_iter()
        .filter(|j| {
            j.owner_references()
                .iter()
                .any(|o| Some(o.uid.as_str()) == mc.metadata.uid.as_deref())
        })
        .collect();
    let mut observed = Observed::default();
    // GPUProfiles only matter to caches with GPU phases.
    let gpu = JobPhase::ALL.iter().any(|p| jobs::uses_gpu(mc, *p));
    if mc.metadata.deletion_timestamp.is_none() && gpu {
        let gp: Api<GPUProfile> = Api::namespaced(client.clone(), ns);
        observed.profiles = gp.list(&ListParams::default()).await?.items;
    }
    // Pods only for Jobs whose outcome or progress matters now: not-yet-recorded ones.
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let status = mc.status.clone().unwrap_or_default();
    for j in &owned {
        let Some(mut oj) = observe_job(j, &[]) else {
            continue;
        };
        let recorded = match oj.phase {
            JobPhase::Download => status
                .download
                .as_ref()
                .and_then(|s| s.completed_at.clone()),
            JobPhase::Abliterate => status
                .abliteration
                .as_ref()
                .and_then(|s| s.completed_at.clone()),
            JobPhase::Quantize => status
                .quantization
                .as_ref()
                .and_then(|s| s.completed_at.clone()),
            JobPhase::Publish => status.publish.as_ref().and_then(|s| s.completed_at.clone()),
        };
        let needs_pods = !oj.terminating
            && match oj.state {
                JobState::Succeeded => recorded.is_none(),
                _ => true,
            };
        if needs_pods {
            let pods = pod_api
                .list(
                    &ListParams::default()
                        .labels(&format!("batch.kubernetes.io/job-name={}", oj.name)),
                )
                .await?
                .items;
            if let Some(o) = observe_job(j, &pods) {
                oj = o;
            }
            // Log tail: running pod (progress) or failed pod without a termination message.
            let want_log = match (&oj.state, &oj.pod) {
                (JobState::Active, Some(p)) => p.running,
                (JobState::Failed { .. }, Some(p)) => p.termination_message.is_none(),
                _ => false,
            };
            // Running pods: at most one log read per half poll interval per cache (every Job
            // status change triggers a reconcile; progress does not need them all).
            let want_log =
                want_log && (!matches!(oj.state, JobState::Active) || ctx.log_read_due(ns, &name));
            if want_log {
                if let Some(p) = &oj.pod {
                    let lp = LogParams {
                        limit_bytes: Some(LOG_TAIL_BYTES),
                        tail_lines: Some(400),
                        ..Default::default()
                    };
                    observed.log_tail =
                        Some(pod_api.logs(&p.name, &lp).await.map_err(|e| e.to_string()));
                }
            }
        }
        observed.jobs.insert(oj.phase, oj);
    }
    // Once the download completed on it, the PVC exists; deletion checks again itself.
    let downloaded = status
        .download
        .as_ref()
        .is_some_and(|d| d.completed_at.is_some())
        && status.claim_name.is_some();
    // Other caches on the same claim, and what Models serve from it.
    let claim = jobs::claim_name(mc);
    let caches: Api<ModelCache> = Api::namespaced(client.clone(), ns);
    let me_created = mc.metadata.creation_timestamp.as_ref().map(|t| t.0);
    for other in caches.list(&ListParams::default()).await?.items {
        if other.metadata.uid == mc.metadata.uid || jobs::claim_name(&other) != claim {
            continue;
        }
        let created = other.metadata.creation_timestamp.as_ref().map(|t| t.0);
        let older = match (created, me_created) {
            (Some(a), Some(b)) if a != b => a < b,
            _ => other.name_any() < name,
        };
        observed.claim_peers.push(ClaimPeer {
            name: other.name_any(),
            model_dir: jobs::model_dir(&other),
            older,
        });
    }
    let models: Api<Model> = Api::namespaced(client.clone(), ns);
    for m in models.list(&ListParams::default()).await?.items {
        if let Some((c, dir)) = m
            .status
            .as_ref()
            .and_then(|s| s.served_path.as_deref())
            .and_then(|p| p.split_once(':'))
        {
            if c == claim {
                observed
                    .served_dirs
                    .push(dir.trim_end_matches('/').to_string());
            }
        }
    }
    if mc.spec.existing_claim_name.is_none() {
        observed.pvc_exists = if downloaded && mc.metadata.deletion_timestamp.is_none() {
            true
        } else {
            let pvc: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
            pvc.get_opt(&jobs::created_claim_name(&name))
                .await?
                .is_some()
        };
    }
    Ok(observed)
}

async fn reconcile_inner(mc: &ModelCache, ctx: &Context) -> Result<CtrlAction, Error> {
    let ns = mc.namespace().ok_or(Error::Missing("namespace"))?;
    let name = mc.name_any();
    let observed = observe(mc, ctx, &ns).await?;
    let now = k8s_openapi::jiff::Timestamp::now();
    let p = plan(mc, &observed, &ctx.config, now);
    apply(mc, ctx, &ns, &p).await?;
    update_metrics(mc, ctx, &ns, &p);
    debug!(cache = %name, namespace = %ns, phase = ?p.status.phase, actions = p.actions.len(), status_changed = p.status_changed, "reconciled");
    Ok(match p.requeue_after {
        Some(d) => CtrlAction::requeue(d),
        None => CtrlAction::await_change(),
    })
}

async fn apply(mc: &ModelCache, ctx: &Context, ns: &str, p: &Plan) -> Result<(), Error> {
    let client = &ctx.client;
    let name = mc.name_any();
    let caches: Api<ModelCache> = Api::namespaced(client.clone(), ns);
    let job_api: Api<Job> = Api::namespaced(client.clone(), ns);
    let pvc_api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let mut events = Vec::new();
    // The resourceVersion the plan was made from: every write of the cache is conditional on it,
    // so a plan made from a stale copy (the watch cache lags our own writes) changes nothing and
    // is made again from a fresh one. Counters such as `retryCount` never go backwards.
    let mut rv = mc.resource_version();
    if p.actions.contains(&Action::AddFinalizer) {
        let mut f = mc.finalizers().to_vec();
        f.push(contract::controller::FINALIZER_CLEANUP.to_string());
        let patch = serde_json::json!({"metadata": {"finalizers": f, "resourceVersion": rv}});
        match caches
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(updated) => rv = updated.resource_version(),
            // Our copy is stale (resourceVersion precondition): look again shortly.
            Err(kube::Error::Api(e)) if e.code == 409 => return Err(Error::Conflict),
            Err(e) => return Err(e.into()),
        }
    }
    // Status before the Jobs and PVCs it describes: if it cannot be written, nothing is done.
    if p.status_changed {
        rv = write_status(&caches, &name, rv.as_deref(), &p.status).await?;
    }
    for a in &p.actions {
        match a {
            Action::AddFinalizer => {}
            Action::RemoveFinalizer => {
                let f: Vec<String> = mc
                    .finalizers()
                    .iter()
                    .filter(|x| x.as_str() != contract::controller::FINALIZER_CLEANUP)
                    .cloned()
                    .collect();
                let patch =
                    serde_json::json!({"metadata": {"finalizers": f, "resourceVersion": rv}});
                match caches
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(kube::Error::Api(e)) if e.code == 409 => return Err(Error::Conflict),
                    Err(e) => return Err(e.into()),
                }
            }
            Action::CreatePvc(pvc) => match pvc_api.create(&PostParams::default(), pvc).await {
                Ok(_) => info!(cache = %name, namespace = %ns, "created PVC"),
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e.into()),
            },
            Action::DeletePvc(pvc) => {
                // Only a PVC this controller created (labels prove it).
                if let Some(obj) = pvc_api.get_opt(pvc).await? {
                    let ours = obj.labels().get(labels::CACHE) == Some(&name)
                        && obj.labels().get(labels::MANAGED_BY).map(String::as_str)
                            == Some(labels::MANAGED_BY_VALUE);
                    if ours {
                        match pvc_api.delete(pvc, &DeleteParams::background()).await {
                            Ok(_) => {
                                info!(cache = %name, namespace = %ns, pvc = %pvc, "deleted PVC")
                            }
                            Err(kube::Error::Api(e)) if e.code == 404 => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                }
            }
            Action::CreateJob(job) => {
                let jname = job.metadata.name.clone().unwrap_or_default();
                match job_api.create(&PostParams::default(), job).await {
                    Ok(_) => info!(cache = %name, namespace = %ns, job = %jname, "created Job"),
                    Err(kube::Error::Api(e)) if e.code == 409 => {
                        debug!(job = %jname, "Job already exists")
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Action::DeleteJob(jname) => {
                let dp = DeleteParams {
                    // Foreground: the Job stays (terminating) until its pods are gone, and the planner
                    // creates a replacement only then, so two pods never write one directory.
                    propagation_policy: Some(PropagationPolicy::Foreground),
                    ..Default::default()
                };
                match job_api.delete(jname, &dp).await {
                    Ok(_) => info!(cache = %name, namespace = %ns, job = %jname, "deleted Job"),
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Action::RemoveAnnotations(keys) => {
                let m: BTreeMap<&str, Option<String>> =
                    keys.iter().map(|k| (k.as_str(), None)).collect();
                let patch = serde_json::json!({"metadata": {"annotations": m}});
                caches
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
            }
            Action::Event {
                warning,
                reason,
                note,
                job,
            } => events.push(Event {
                type_: if *warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: reason.clone(),
                note: Some(note.clone()),
                action: "Reconcile".into(),
                secondary: job.as_ref().map(|j| ObjectReference {
                    api_version: Some("batch/v1".into()),
                    kind: Some("Job".into()),
                    name: Some(j.clone()),
                    namespace: Some(ns.to_string()),
                    ..Default::default()
                }),
            }),
        }
    }
    let oref = mc.object_ref(&());
    for e in events {
        if let Err(err) = ctx.recorder.publish(&e, &oref).await {
            warn!(cache = %name, error = %err, "cannot publish event");
        }
    }
    Ok(())
}

/// Apply a cache's status, conditional on `resource_version` when given (409 → `Error::Conflict`).
/// Returns the cache's new resourceVersion.
pub async fn write_status(
    caches: &Api<ModelCache>,
    name: &str,
    resource_version: Option<&str>,
    status: &flexinfer_api::modelcache::ModelCacheStatus,
) -> Result<Option<String>, Error> {
    let mut patch = serde_json::json!({
        "apiVersion": "ai.flexinfer/v1alpha1",
        "kind": "ModelCache",
        "status": status,
    });
    if let Some(rv) = resource_version {
        patch["metadata"] = serde_json::json!({ "resourceVersion": rv });
    }
    match caches
        .patch_status(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
    {
        Ok(updated) => Ok(updated.resource_version()),
        Err(kube::Error::Api(e)) if e.code == 409 => Err(Error::Conflict),
        Err(e) => Err(e.into()),
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
    }
    if running != Some(JobPhase::Quantize) {
        let _ = m.quantization_layer_index.remove_label_values(&[name, ns]);
        let _ = m.quantization_layer_total.remove_label_values(&[name, ns]);
        let _ = m
            .quantization_last_progress_timestamp
            .remove_label_values(&[name, ns]);
    }
}

/// Drop every series of a cache: it is being deleted or is gone (deleted without a finalizer,
/// or while the controller was away), so no alert may keep firing for it.
pub(crate) fn forget_cache_series(m: &crate::metrics::Metrics, name: &str, ns: &str) {
    forget_job_series(m, name, ns, None);
    for ph in CachePhase::ALL {
        let _ = m
            .modelcache_phase
            .remove_label_values(&[name, ns, ph.as_str()]);
    }
    for phase in JobPhase::ALL {
        let _ = m
            .job_progress_percent
            .remove_label_values(&[name, ns, phase.status_name()]);
    }
    for r in contract::FailureReason::ALL {
        let _ = m
            .model_cache_failures_total
            .remove_label_values(&[name, ns, r.as_str()]);
    }
    for status in ["succeeded", "failed"] {
        let _ = m
            .quantization_jobs_total
            .remove_label_values(&[name, ns, status]);
    }
    let _ = m
        .quantization_compression_ratio
        .remove_label_values(&[name, ns]);
    let _ = m
        .quantization_duration_seconds
        .remove_label_values(&[name, ns]);
}

/// `(cache, namespace)` of every cache that has per-cache series.
fn cache_series_keys(m: &crate::metrics::Metrics) -> BTreeSet<(String, String)> {
    use prometheus::core::Collector;
    let mut out = BTreeSet::new();
    let families = m
        .modelcache_phase
        .collect()
        .into_iter()
        .chain(m.job_progress_percent.collect());
    for fam in families {
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

fn update_metrics(mc: &ModelCache, ctx: &Context, ns: &str, p: &Plan) {
    let m = &ctx.metrics;
    let name = mc.name_any();
    if mc.metadata.deletion_timestamp.is_some() {
        forget_cache_series(m, &name, ns);
        return;
    }
    forget_job_series(m, &name, ns, p.outcome.running.map(|(ph, _, _)| ph));
    if let Some(phase) = p.status.phase {
        for ph in CachePhase::ALL {
            m.modelcache_phase
                .with_label_values(&[name.as_str(), ns, ph.as_str()])
                .set(i64::from(ph == phase));
        }
    }
    for (phase, reason) in &p.outcome.failed {
        m.model_cache_failures_total
            .with_label_values(&[name.as_str(), ns, reason.as_str()])
            .inc();
        if *phase == JobPhase::Quantize {
            m.quantization_jobs_total
                .with_label_values(&[name.as_str(), ns, "failed"])
                .inc();
        }
    }
    for phase in &p.outcome.completed {
        let jt = phase.status_name();
        m.job_progress_percent
            .with_label_values(&[name.as_str(), ns, jt])
            .set(100.0);
        if *phase == JobPhase::Quantize {
            m.quantization_jobs_total
                .with_label_values(&[name.as_str(), ns, "succeeded"])
                .inc();
            if let Some(q) = &p.status.quantization {
                if let Some(r) = q.compression_ratio {
                    m.quantization_compression_ratio
                        .with_label_values(&[name.as_str(), ns])
                        .set(r);
                }
                if let (Some(s), Some(c)) = (&q.started_at, &q.completed_at) {
                    let secs = c.0.duration_since(s.0).as_secs_f64().max(0.0);
                    m.quantization_duration_seconds
                        .with_label_values(&[name.as_str(), ns])
                        .observe(secs);
                }
            }
        }
    }
    if let Some((phase, deadline, elapsed)) = p.outcome.running {
        let jt = phase.status_name();
        m.job_deadline_seconds
            .with_label_values(&[name.as_str(), ns, jt])
            .set(deadline as f64);
        m.job_elapsed_seconds
            .with_label_values(&[name.as_str(), ns, jt])
            .set(elapsed as f64);
        if let Some(pr) = p.status.progress {
            m.job_progress_percent
                .with_label_values(&[name.as_str(), ns, jt])
                .set(pr as f64);
        }
        if phase == JobPhase::Quantize {
            // "No layer progress since the Job started" counts as a stall too: start the clock at
            // the Job's start when no newer progress was seen.
            let started = k8s_openapi::jiff::Timestamp::now().as_second() as f64 - elapsed as f64;
            let last = m
                .quantization_last_progress_timestamp
                .with_label_values(&[name.as_str(), ns]);
            if last.get() < started {
                last.set(started);
            }
            if let Some(t) = &p.outcome.telemetry {
                if let Some(l) = t.layer {
                    let prev = m
                        .quantization_layer_index
                        .with_label_values(&[name.as_str(), ns])
                        .get();
                    m.quantization_layer_index
                        .with_label_values(&[name.as_str(), ns])
                        .set(l);
                    if prev != l {
                        m.quantization_last_progress_timestamp
                            .with_label_values(&[name.as_str(), ns])
                            .set(k8s_openapi::jiff::Timestamp::now().as_second() as f64);
                    }
                }
                if let Some(l) = t.layers {
                    m.quantization_layer_total
                        .with_label_values(&[name.as_str(), ns])
                        .set(l);
                }
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
        forget_job_series(&m, "c", "ns", Some(JobPhase::Quantize));
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
    }
}
