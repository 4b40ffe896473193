//! The thin reconciler: observe (Jobs, pods, PVC, GPUProfiles, log tail), call [`plan`], apply.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::events::Recorder;
use flexinfer_api::contract::controller::FIELD_MANAGER;
use flexinfer_api::contract::{self, labels, JobPhase};
use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::modelcache::ModelCache;
use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, ObjectReference, PersistentVolumeClaim, Pod};
use kube::api::{
    Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams, PropagationPolicy,
};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action as CtrlAction, Controller};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use tracing::{debug, info, warn};

use super::config::Config;
use super::jobs;
use super::node_jobs;
use super::node_step::{self, NodeLocalObserved};
use super::nodelocal;
use super::observe::{
    is_older_peer, log_read_due, model_uses_claim, needs_pods, needs_profiles, observe_job,
    prune_job, pvc_known_to_exist, recorded_job, served_dir_on, wants_log_tail, JobState,
    LogBudget,
};
use super::plan::{plan, Action, ClaimPeer, LogTail, Observed, Plan};
use super::series::{forget_deleted_caches, update_metrics};
use super::stores::{Expectation, Pending, Stores};
use crate::kube_client::api_in;
use crate::metrics::Metrics;
use crate::status_write::apply_status;

/// Longest a reconcile may take before it is abandoned and retried with backoff.
const RECONCILE_TIMEOUT: Duration = Duration::from_secs(60);

/// Bytes of pod log read per progress poll.
const LOG_TAIL_BYTES: i64 = 64 * 1024;

/// Reconcile errors and their requeue: `crate::reconcile_error`.
pub use crate::reconcile_error::Error;

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
    /// What a reconcile reads: watch-fed stores, no API reads.
    pub stores: Stores,
    /// Progress log reads of running pods across all caches (token bucket).
    log_budget: Mutex<LogBudget>,
}

impl Context {
    /// Whether a running pod's log may be read now (see [`log_read_due`]); records the read.
    fn log_read_due(&self, ns: &str, name: &str) -> bool {
        let Ok(mut m) = self.log_reads.lock() else {
            return true;
        };
        let key = (ns.to_string(), name.to_string());
        let now = Instant::now();
        let due = log_read_due(m.get(&key).copied(), now, self.config.progress_poll)
            && self.log_budget.lock().is_ok_and(|mut b| b.take(now));
        if due {
            m.insert(key, now);
        }
        due
    }

    /// Forget what is kept per cache (log-read times, expectations) once it is gone.
    fn forget(&self, ns: &str, name: &str) {
        if let Ok(mut m) = self.log_reads.lock() {
            m.remove(&(ns.to_string(), name.to_string()));
        }
        self.stores.forget(ns, name);
    }
}

/// Run the ModelCache controller until shutdown. `namespace` limits the watch (all when `None`).
pub async fn run(
    client: Client,
    metrics: Metrics,
    config: Config,
    namespace: Option<String>,
) -> anyhow::Result<()> {
    let ns = namespace.as_deref();
    let (stores, streams) = Stores::new(&client, ns);
    let reporter = Reporter {
        controller: FIELD_MANAGER.into(),
        instance: std::env::var(flexinfer_api::contract::env::controller::POD_NAME).ok(),
    };
    let log_budget = Mutex::new(LogBudget::new(config.log_reads_per_second, Instant::now()));
    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter),
        client,
        metrics,
        config,
        log_reads: Mutex::new(HashMap::new()),
        failures: Default::default(),
        stores: stores.clone(),
        log_budget,
    });
    let guard = crate::supervise::Guard::new(
        "modelcache",
        ctx.metrics.clone(),
        Some(ctx.recorder.clone()),
    );
    let cache_meta: Api<PartialObjectMeta<ModelCache>> = api_in(&ctx.client, ns);
    let forget = forget_deleted_caches(cache_meta, ctx.metrics.clone());
    let cache_store = stores.caches.clone();
    let controller = Controller::for_stream(streams.caches, stores.caches.clone())
        .with_config(
            kube::runtime::controller::Config::default()
                .concurrency(ctx.config.reconcile_concurrency),
        )
        .owns_stream(streams.jobs)
        .watches_stream(streams.profiles, move |gp: GPUProfile| {
            // Only the caches whose phases select this profile's architecture.
            cache_store
                .state()
                .into_iter()
                .filter(|mc| jobs::profile_affects(mc, &gp))
                .map(|mc| ObjectRef::from_obj(&*mc))
                .collect::<Vec<_>>()
        })
        .shutdown_on_signal();
    let run = guard
        .run(controller, reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                debug!(error = %flexinfer_api::contract::error::chain(&e), "reconcile stream error");
            }
        });
    tokio::select! {
        () = run => {}
        () = forget => {}
        () = streams.background => {}
    }
    Ok(())
}
fn error_policy(mc: Arc<ModelCache>, err: &Error, ctx: Arc<Context>) -> CtrlAction {
    crate::reconcile_error::error_policy(
        "modelcache",
        mc.as_ref(),
        err,
        &ctx.metrics,
        &ctx.failures,
    )
}

async fn reconcile(mc: Arc<ModelCache>, ctx: Arc<Context>) -> Result<CtrlAction, Error> {
    let t0 = Instant::now();
    // No reconcile may hang on a request the API server never answers: the cache would wait for it
    // (kube runs one reconcile of an object at a time) until the client's 295 s read timeout.
    // Plan from the copy our last write returned when the watch still shows one it replaced.
    let mc = ctx.stores.written.newest(mc);
    let res = match tokio::time::timeout(RECONCILE_TIMEOUT, reconcile_inner(&mc, &ctx)).await {
        Ok(res) => res,
        Err(_) => Err(Error::TimedOut(RECONCILE_TIMEOUT.as_secs())),
    };
    if res.is_ok() {
        ctx.failures
            .succeeded(&crate::reconcile_error::failure_key(mc.as_ref()));
    }
    ctx.metrics
        .reconcile_duration_seconds
        .with_label_values(&["modelcache"])
        .observe(t0.elapsed().as_secs_f64());
    res
}

async fn observe(mc: &ModelCache, ctx: &Context, ns: &str) -> Result<Observed, Error> {
    let name = mc.name_any();
    let stores = &ctx.stores;
    let mut observed = Observed::default();
    if needs_profiles(mc) {
        observed.profiles = stores.profiles_in(ns);
    }
    observe_jobs(mc, ctx, ns, &mut observed).await?;
    observe_claim_users(mc, stores, ns, &mut observed);
    if mc.spec.existing_claim_name.is_none() {
        observed.pvc_exists =
            pvc_known_to_exist(mc) || stores.claim_exists(ns, &jobs::created_claim_name(&name));
    }
    let had_copies = mc.status.as_ref().is_some_and(|s| s.node_local.is_some());
    if node_step::is_node_local(mc) || had_copies {
        observed.node_local = Some(observe_node_local(mc, ctx, ns).await?);
    }
    Ok(observed)
}

/// The nodes a NodeLocal cache's copies concern (those its selector matches and those that carry its
/// label) and its node-copy Jobs, read from the API server: NodeLocal caches are few, and each is
/// read again only at its own reconciles ([`node_step::NODE_RESYNC`]).
async fn observe_node_local(
    mc: &ModelCache,
    ctx: &Context,
    ns: &str,
) -> Result<NodeLocalObserved, Error> {
    let name = mc.name_any();
    let forbidden = |what: &str| {
        format!(
            "the controller may not {what} (install the chart with nodeLocal.enabled=true: a ClusterRole \
             to get, list and label nodes); the node copies are left as they are"
        )
    };
    let job_api: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    let sel = format!("{}={},{}", labels::CACHE, name, labels::NODE_COPY);
    let uid = mc.metadata.uid.as_deref();
    let tasks = job_api
        .list(&ListParams::default().labels(&sel))
        .await?
        .items
        .iter()
        .filter(|j| {
            j.owner_references()
                .iter()
                .any(|o| Some(o.uid.as_str()) == uid)
        })
        .filter_map(node_jobs::task_of)
        .collect();
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let key = nodelocal::label_key(ns, &name);
    let mut selectors = vec![key];
    if let Some(sel) = mc
        .spec
        .node_local_selector()
        .filter(|_| node_step::is_node_local(mc))
    {
        selectors.push(
            sel.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    let mut by_name = BTreeMap::new();
    for s in selectors {
        match nodes.list(&ListParams::default().labels(&s)).await {
            Ok(list) => {
                for n in list.items {
                    let view = nodelocal::NodeView {
                        name: n.name_any(),
                        unschedulable: n.metadata.deletion_timestamp.is_some()
                            || n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true),
                        labels: n.metadata.labels.unwrap_or_default(),
                    };
                    by_name.insert(view.name.clone(), view);
                }
            }
            Err(kube::Error::Api(e)) if e.code == 403 => {
                return Ok(NodeLocalObserved {
                    nodes: Vec::new(),
                    tasks,
                    problem: Some(forbidden("list nodes")),
                })
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(NodeLocalObserved {
        nodes: by_name.into_values().collect(),
        tasks,
        problem: None,
    })
}

/// The cache's own Jobs (by their names, from the Job store; from the API server only when a write
/// of ours did not reach the store in time).
async fn owned_jobs(mc: &ModelCache, ctx: &Context, ns: &str) -> Result<Vec<Job>, Error> {
    let name = mc.name_any();
    let owned = |j: &Job| {
        j.labels().get(labels::CACHE) == Some(&name)
            && j.owner_references()
                .iter()
                .any(|o| Some(o.uid.as_str()) == mc.metadata.uid.as_deref())
    };
    match ctx.stores.expectations(ns, &name, Instant::now()) {
        Pending::Met => Ok(JobPhase::ALL
            .iter()
            .filter_map(|p| ctx.stores.job(ns, &p.job_name(&name)))
            .filter(|j| owned(j))
            .collect()),
        Pending::Waiting => Err(Error::StoreBehind),
        Pending::Expired => {
            warn!(cache = %name, namespace = %ns, "a Job write did not reach the watch in time, or a Job create found its name taken; reading the cache's Jobs from the API server");
            let job_api: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
            let sel = format!("{}={}", labels::CACHE, name);
            let mut list = job_api
                .list(&ListParams::default().labels(&sel))
                .await?
                .items;
            list.retain(|j| owned(j));
            list.iter_mut().for_each(prune_job);
            Ok(list)
        }
    }
}

/// The cache's own Jobs, with their newest pod and a log tail where they matter now.
async fn observe_jobs(
    mc: &ModelCache,
    ctx: &Context,
    ns: &str,
    observed: &mut Observed,
) -> Result<(), Error> {
    let name = mc.name_any();
    let pod_api: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let status = mc.status.clone().unwrap_or_default();
    for j in &owned_jobs(mc, ctx, ns).await? {
        let Some(mut oj) = observe_job(j, &[]) else {
            continue;
        };
        if needs_pods(&oj, &status) {
            let pods = ctx.stores.pods_of(ns, &oj.name);
            if let Some(o) = observe_job(j, &pods) {
                oj = o;
            }
            let want_log = wants_log_tail(&oj)
                && (!matches!(oj.state, JobState::Active) || ctx.log_read_due(ns, &name));
            if want_log {
                if let Some(p) = &oj.pod {
                    let lp = LogParams {
                        limit_bytes: Some(LOG_TAIL_BYTES),
                        tail_lines: Some(400),
                        ..Default::default()
                    };
                    observed.log_tail = Some(match pod_api.logs(&p.name, &lp).await {
                        Ok(text) => LogTail::Read(text),
                        Err(e) => {
                            debug!(pod = %p.name, error = %e, "cannot read the pod log tail");
                            LogTail::Unreadable
                        }
                    });
                }
            }
        }
        observed.jobs.insert(oj.phase, oj);
    }
    // The stores do not keep a Job whose completion the status records: the planner reads it as
    // the status describes it.
    for phase in JobPhase::ALL {
        if let (std::collections::btree_map::Entry::Vacant(e), Some(j)) =
            (observed.jobs.entry(phase), recorded_job(mc, phase))
        {
            e.insert(j);
        }
    }
    Ok(())
}

/// Other caches on the same claim, and the directories Models serve from it.
fn observe_claim_users(mc: &ModelCache, stores: &Stores, ns: &str, observed: &mut Observed) {
    let name = mc.name_any();
    let claim = jobs::claim_name(mc);
    let me_created = mc.metadata.creation_timestamp.as_ref().map(|t| t.0);
    for other in stores.caches_on_claim(ns, &claim) {
        if other.metadata.uid == mc.metadata.uid {
            continue;
        }
        let created = other.metadata.creation_timestamp.as_ref().map(|t| t.0);
        let other_name = other.name_any();
        observed.claim_peers.push(ClaimPeer {
            older: is_older_peer((created, &other_name), (me_created, &name)),
            name: other_name,
            model_dir: jobs::model_dir(&other),
        });
    }
    for m in stores.models_in(ns) {
        let served = m.status.as_ref().and_then(|s| s.served_path.as_deref());
        if let Some(dir) = served.and_then(|p| served_dir_on(p, &claim)) {
            observed.served_dirs.push(dir);
        }
        if model_uses_claim(&m.spec.source, served, &claim) {
            observed.claim_models.push(m.name_any());
        }
    }
}

async fn reconcile_inner(mc: &ModelCache, ctx: &Context) -> Result<CtrlAction, Error> {
    let t0 = Instant::now();
    let ns = mc.namespace().ok_or(Error::Missing("namespace"))?;
    let name = mc.name_any();
    if !ctx.stores.ready().await {
        return Err(Error::Missing(
            "watch stores (the controller is shutting down)",
        ));
    }
    let observed = observe(mc, ctx, &ns).await?;
    if !observed
        .jobs
        .values()
        .any(|j| matches!(j.state, JobState::Active))
    {
        // Nothing running: no log read is due (the per-cache record would only hold memory).
        if let Ok(mut m) = ctx.log_reads.lock() {
            m.remove(&(ns.clone(), name.clone()));
        }
    }
    let now = k8s_openapi::jiff::Timestamp::now();
    let p = plan(mc, &observed, &ctx.config, now);
    apply(mc, ctx, &ns, &p).await?;
    update_metrics(mc, &ctx.metrics, &ns, &p);
    for (kind, n) in ctx.stores.sizes() {
        ctx.metrics
            .watch_store_objects
            .with_label_values(&["modelcache", kind])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    debug!(cache = %name, namespace = %ns, phase = ?p.status.phase, actions = p.actions.len(), status_changed = p.status_changed, elapsed_ms = t0.elapsed().as_millis() as u64, "reconciled");
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
    // Each write's result is kept until the cache watch shows it: a reconcile that runs before then
    // plans from it instead of from the copy it replaced (`written`).
    let wrote = |from: Option<String>, updated: ModelCache| -> Option<String> {
        let rv = updated.resource_version();
        ctx.stores.wrote(from.as_deref(), updated);
        rv
    };
    if p.actions.contains(&Action::AddFinalizer) {
        let updated = add_finalizer(&caches, mc, &rv).await?;
        rv = wrote(rv, updated);
    }
    // Status before the Jobs and PVCs it describes: if it cannot be written, nothing is done.
    if p.status_changed {
        let updated = write_status(&caches, &name, rv.as_deref(), &p.status).await?;
        rv = wrote(rv, updated);
    }
    for a in &p.actions {
        match a {
            Action::AddFinalizer => {}
            Action::RemoveFinalizer => {
                remove_finalizer(&caches, mc, &rv).await?;
                ctx.forget(ns, &name);
            }
            Action::CreatePvc(pvc) => match pvc_api.create(&PostParams::default(), pvc).await {
                Ok(_) => info!(cache = %name, namespace = %ns, "created PVC"),
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e.into()),
            },
            Action::DeletePvc(pvc) => delete_created_pvc(&pvc_api, pvc, &name, ns).await?,
            Action::CreateJob(job) => {
                let jname = job.metadata.name.clone().unwrap_or_default();
                match job_api.create(&PostParams::default(), job).await {
                    Ok(created) => {
                        if let Some(uid) = created.metadata.uid {
                            let exp = Expectation::JobCreated {
                                name: jname.clone(),
                                uid,
                            };
                            ctx.stores.expect(ns, &name, exp);
                        }
                        info!(cache = %name, namespace = %ns, job = %jname, "created Job")
                    }
                    Err(kube::Error::Api(e)) if e.code == 409 => {
                        // A Job the store does not show holds the name (e.g. one it left out as
                        // recorded while this cache's status was behind): read the cache's Jobs from
                        // the API server at its next reconcile.
                        debug!(job = %jname, "Job already exists");
                        ctx.stores.expect(ns, &name, Expectation::ReadJobsFromApi);
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
                let uid = ctx
                    .stores
                    .job(ns, jname)
                    .and_then(|j| j.metadata.uid.clone());
                match job_api.delete(jname, &dp).await {
                    Ok(_) => {
                        let exp = Expectation::JobDeleted {
                            name: jname.clone(),
                            uid,
                        };
                        ctx.stores.expect(ns, &name, exp);
                        info!(cache = %name, namespace = %ns, job = %jname, "deleted Job")
                    }
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Action::LabelNode { node, key, value } => {
                let nodes: Api<Node> = Api::all(client.clone());
                let patch = serde_json::json!({"metadata": {"labels": {key.as_str(): value}}});
                match nodes
                    .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {
                        info!(cache = %name, namespace = %ns, node = %node, label = %key, value = ?value, "labelled node")
                    }
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Action::RemoveAnnotations(keys) => {
                // Conditional like every other write of the cache: the trigger was read from this
                // copy and its effect is in the status just written; on a conflict the next plan
                // reads the annotations again.
                let m: BTreeMap<&str, Option<String>> =
                    keys.iter().map(|k| (k.as_str(), None)).collect();
                let patch =
                    serde_json::json!({"metadata": {"annotations": m, "resourceVersion": rv}});
                match caches
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(updated) => rv = wrote(rv, updated),
                    Err(e) => return Err(Error::of_write(e)),
                }
            }
            Action::Event {
                warning,
                reason,
                note,
                job,
            } => events.push(kube_event(*warning, reason, note, job.as_deref(), ns)),
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

/// Add the cleanup finalizer, conditional on `rv`. Returns the cache as written.
async fn add_finalizer(
    caches: &Api<ModelCache>,
    mc: &ModelCache,
    rv: &Option<String>,
) -> Result<ModelCache, Error> {
    let mut f = mc.finalizers().to_vec();
    f.push(contract::controller::FINALIZER_CLEANUP.to_string());
    patch_finalizers(caches, mc, f, rv).await
}

/// Drop the cleanup finalizer, conditional on `rv` (a cache already gone is fine).
async fn remove_finalizer(
    caches: &Api<ModelCache>,
    mc: &ModelCache,
    rv: &Option<String>,
) -> Result<(), Error> {
    let f: Vec<String> = mc
        .finalizers()
        .iter()
        .filter(|x| x.as_str() != contract::controller::FINALIZER_CLEANUP)
        .cloned()
        .collect();
    match patch_finalizers(caches, mc, f, rv).await {
        Ok(_) => Ok(()),
        Err(Error::Kube(kube::Error::Api(e))) if e.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Set the cache's finalizers, conditional on `rv`. Returns the cache as written.
async fn patch_finalizers(
    caches: &Api<ModelCache>,
    mc: &ModelCache,
    finalizers: Vec<String>,
    rv: &Option<String>,
) -> Result<ModelCache, Error> {
    let patch = serde_json::json!({"metadata": {"finalizers": finalizers, "resourceVersion": rv}});
    match caches
        .patch(
            &mc.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(updated) => Ok(updated),
        // Our copy is stale (resourceVersion precondition): look again shortly.
        Err(e) => Err(Error::of_write(e)),
    }
}

/// Delete the PVC `pvc` of cache `name`, only if this controller created it (labels prove it).
async fn delete_created_pvc(
    pvc_api: &Api<PersistentVolumeClaim>,
    pvc: &str,
    name: &str,
    ns: &str,
) -> Result<(), Error> {
    let Some(obj) = pvc_api.get_opt(pvc).await? else {
        return Ok(());
    };
    let ours = obj.labels().get(labels::CACHE).map(String::as_str) == Some(name)
        && obj.labels().get(labels::MANAGED_BY).map(String::as_str)
            == Some(labels::MANAGED_BY_VALUE);
    if !ours {
        return Ok(());
    }
    match pvc_api.delete(pvc, &DeleteParams::background()).await {
        Ok(_) => {
            info!(cache = %name, namespace = %ns, pvc = %pvc, "deleted PVC");
            Ok(())
        }
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The Kubernetes event of a planned [`Action::Event`]; `job` becomes the related object.
fn kube_event(warning: bool, reason: &str, note: &str, job: Option<&str>, ns: &str) -> Event {
    Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.to_string(),
        note: Some(note.to_string()),
        action: "Reconcile".into(),
        secondary: job.map(|j| ObjectReference {
            api_version: Some("batch/v1".into()),
            kind: Some("Job".into()),
            name: Some(j.to_string()),
            namespace: Some(ns.to_string()),
            ..Default::default()
        }),
    }
}

/// Apply a cache's status, conditional on `resource_version` when given (409 → `Error::Conflict`).
/// Returns the cache as written.
pub async fn write_status(
    caches: &Api<ModelCache>,
    name: &str,
    resource_version: Option<&str>,
    status: &flexinfer_api::modelcache::ModelCacheStatus,
) -> Result<ModelCache, Error> {
    let status = serde_json::to_value(status)?;
    apply_status(caches, name, resource_version, status).await
}
