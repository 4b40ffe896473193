//! Watch-fed views of everything the ModelCache reconciler reads — the caches, their Jobs and those
//! Jobs' pods, the claims the controller creates, GPUProfiles and Models — so that a reconcile sends
//! no read to the API server (the one exception is a running pod's log tail, rate-limited).
//!
//! Each view is a kube-runtime reflector store fed by one watch. The Job and GPUProfile streams are
//! also the controller's triggers, so a reconcile triggered by a Job event finds that event in the
//! Job store. Stored Jobs and pods keep only what the planner reads ([`super::stored_job`]), and
//! lookups go through name keys and small indexes (a cache's
//! Jobs by their deterministic names, pods by their Job, caches by their claim), never a scan of a
//! store: a reconcile costs the same with 10 or 5,000 caches.
//!
//! What a store keeps is cut to what its readers read, after the watch has read it (the watch needs
//! each object's resourceVersion; a stored Job or pod does not, and each such string is kept twice:
//! in the object and in the store's key).
//!
//! A Job whose completion its cache's status records, and that Job's pods, are not kept
//! ([`Recorded`]): the planner judges a completed phase by the status and reads such a Job only to
//! delete it, as [`super::observe::recorded_job`] describes it from the status. A Ready cache keeps
//! none of its Jobs and pods in memory (most of a finished cache's share of the stores at thousands
//! of caches).
//!
//! Our own writes reach the stores through the watch a few milliseconds later. The reconciler
//! records each Job it creates or deletes as an [`Expectation`]; until the Job store shows it, the
//! cache is reconciled again shortly instead of planning from a view that predates the write
//! (client-go's controller expectations).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flexinfer_api::contract::{labels, JobPhase};
use flexinfer_api::gpuprofile::GPUProfile;
use flexinfer_api::model::Model;
use flexinfer_api::modelcache::ModelCache;
use futures::{Stream, StreamExt};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, store::Writer, ObjectRef, Store};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Resource, ResourceExt};

use super::jobs;
use super::observe::{job_state, records, JobState};
use super::stored_job::{StoredJob, StoredPod};
pub use super::stored_job::{JOB_NAME_LABEL, LEGACY_JOB_NAME_LABEL};
use super::written::WrittenCopies;
use crate::kube_client::api_in;

/// `(namespace, key)` of an [`Index`].
type IndexKey = (Box<str>, Box<str>);

/// Names of objects by `(namespace, key)`: a superset of the truth, checked against the store on
/// every lookup (an entry whose object is gone or has another key now is dropped then). A key has
/// one name or a few (a Job's pods, the caches of a shared claim), so the names are a short list: a
/// set per key was a tree node of ~0.3 KB for each of thousands of keys.
#[derive(Default)]
pub struct Index {
    /// Names by `(namespace, key)`.
    map: Mutex<HashMap<IndexKey, Vec<Box<str>>>>,
}

impl Index {
    fn insert(&self, ns: &str, key: String, name: &str) {
        if let Ok(mut m) = self.map.lock() {
            let names = m.entry((ns.into(), key.into_boxed_str())).or_default();
            if !names.iter().any(|n| &**n == name) {
                names.push(name.into());
                names.shrink_to_fit();
            }
        }
    }

    fn remove(&self, ns: &str, key: String, name: &str) {
        if let Ok(mut m) = self.map.lock() {
            let k: (Box<str>, Box<str>) = (ns.into(), key.into_boxed_str());
            if let Some(names) = m.get_mut(&k) {
                names.retain(|n| &**n != name);
                if names.is_empty() {
                    m.remove(&k);
                }
            }
        }
    }

    /// The objects of `store` indexed under `(ns, key)` whose key (by `key_of`) is still `key`.
    fn lookup<K>(
        &self,
        store: &Store<K>,
        ns: &str,
        key: &str,
        key_of: fn(&K) -> Option<String>,
    ) -> Vec<Arc<K>>
    where
        K: Resource<DynamicType = ()> + Clone + 'static,
    {
        let mut names: Vec<Box<str>> = match self.map.lock() {
            Ok(m) => m
                .get(&(Box::<str>::from(ns), Box::<str>::from(key)))
                .cloned()
                .unwrap_or_default(),
            Err(_) => return Vec::new(),
        };
        // By name, as a set would give them.
        names.sort_unstable();
        let mut found = Vec::with_capacity(names.len());
        for name in names {
            match store.get(&ObjectRef::new(&name).within(ns)) {
                Some(obj) if key_of(&obj).as_deref() == Some(key) => found.push(obj),
                _ => self.remove(ns, key.to_string(), &name),
            }
        }
        found
    }

    /// Entries (for tests and the memory bound).
    pub fn len(&self) -> usize {
        self.map
            .lock()
            .map(|m| m.values().map(Vec::len).sum())
            .unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keep the index in step with a watch event of an object whose key is `key_of(obj)`.
    fn update<K: Resource>(&self, ev: &watcher::Event<K>, key_of: fn(&K) -> Option<String>) {
        let entry = |o: &K| {
            Some((
                o.meta().namespace.clone()?,
                key_of(o)?,
                o.meta().name.clone()?,
            ))
        };
        match ev {
            watcher::Event::Apply(o) | watcher::Event::InitApply(o) => {
                if let Some((ns, key, name)) = entry(o) {
                    self.insert(&ns, key, &name);
                }
            }
            watcher::Event::Delete(o) => {
                if let Some((ns, key, name)) = entry(o) {
                    self.remove(&ns, key, &name);
                }
            }
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
    }
}

/// The claim a cache uses: the index key of caches.
fn cache_claim(mc: &ModelCache) -> Option<String> {
    Some(jobs::claim_name(mc))
}

/// The Job a stored pod belongs to: the index key of pods.
fn pod_job(p: &StoredPod) -> Option<String> {
    p.job_name()
}

/// A Job or PVC the reconciler wrote and the store has not shown yet.
#[derive(Debug, Clone, PartialEq)]
pub enum Expectation {
    /// A Job created with this uid.
    JobCreated { name: String, uid: String },
    /// A Job deleted (it shows up terminating or gone).
    JobDeleted { name: String, uid: Option<String> },
    /// A Job create found the name taken by a Job the store does not show: the cache's Jobs are
    /// read from the API server at its next reconcile, once.
    ReadJobsFromApi,
}

/// How long an unmet expectation holds a cache back before the reconciler stops waiting for the
/// watch (and reads the cache's Jobs from the API server once).
pub const EXPECTATION_TIMEOUT: Duration = Duration::from_secs(15);

/// Whether `exp` is met by the Job store's copy `stored` of the Job it names.
pub fn expectation_met(exp: &Expectation, stored: Option<&Job>) -> bool {
    match exp {
        Expectation::JobCreated { uid, .. } => {
            stored.is_some_and(|j| j.metadata.uid.as_deref() == Some(uid.as_str()))
        }
        Expectation::JobDeleted { uid, .. } => match stored {
            None => true,
            Some(j) => {
                j.metadata.deletion_timestamp.is_some()
                    || (uid.is_some() && j.metadata.uid.as_deref() != uid.as_deref())
            }
        },
        Expectation::ReadJobsFromApi => false,
    }
}

/// The read views of one ModelCache controller (one watched scope).
#[derive(Clone)]
pub struct Stores {
    pub caches: Store<ModelCache>,
    pub jobs: Store<StoredJob>,
    pub pods: Store<StoredPod>,
    pub claims: Store<PartialObjectMeta<PersistentVolumeClaim>>,
    pub profiles: Store<GPUProfile>,
    pub models: Store<Model>,
    caches_by_claim: Arc<Index>,
    pods_by_job: Arc<Index>,
    expectations: Arc<Mutex<ExpectationMap>>,
    /// Copies of caches our writes returned that the cache watch does not show yet.
    pub written: WrittenCopies,
    /// Whether every store has its first listing, awaited by many reconciles at once.
    ready: Readiness,
}

/// One readiness every waiter can await: a reflector store wakes only the last of several tasks
/// waiting on it (its signal is a oneshot channel), so reconciles that waited side by side at
/// start-up slept until something else woke them (the 60 s reconcile timeout). One shared future
/// polls the stores and wakes every waiter.
type Readiness = futures::future::Shared<futures::future::BoxFuture<'static, bool>>;

fn readiness(all: impl Future<Output = bool> + Send + 'static) -> Readiness {
    use futures::FutureExt;
    all.boxed().shared()
}

/// Unmet expectations by `(namespace, cache)`, each with the time it was recorded.
type ExpectationMap = HashMap<(String, String), Vec<(Expectation, Instant)>>;

/// The watch streams behind [`Stores`]: `caches` drives the controller, `jobs` and `profiles` are
/// its triggers, `background` only fills stores and must be polled beside the controller.
pub struct Streams {
    pub caches: futures::stream::BoxStream<'static, Result<ModelCache, watcher::Error>>,
    pub jobs: futures::stream::BoxStream<'static, Result<StoredJob, watcher::Error>>,
    pub profiles: futures::stream::BoxStream<'static, Result<GPUProfile, watcher::Error>>,
    pub background: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
}

/// The annotation `kubectl apply` (client-side) keeps: the whole applied manifest again, read by
/// nobody here.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Keep of a claim its name and namespace: its labels, annotations, finalizers and owners were
/// ~1.5 KB per claim, and only its existence is read.
fn identity_only(o: &mut PartialObjectMeta<PersistentVolumeClaim>) {
    let m = std::mem::take(&mut o.metadata);
    o.types = None;
    o.metadata = kube::api::ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        ..Default::default()
    };
}

/// Drop what no reader of a stored object needs: managed fields and `kubectl apply`'s copy of the
/// manifest.
fn lean_metadata<K: Resource>(o: &mut K) {
    let meta = o.meta_mut();
    meta.managed_fields = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.remove(LAST_APPLIED);
        if a.is_empty() {
            meta.annotations = None;
        }
    }
}

/// Drive a store-only stream to its end (it ends only with the process), saying when its watch fails
/// (e.g. a missing RBAC verb): until its first listing succeeds no reconcile runs.
async fn drain<T, S: Stream<Item = Result<T, watcher::Error>> + Send>(what: &'static str, s: S) {
    s.for_each(|r| {
        if let Err(e) = r {
            tracing::warn!(watch = what, error = %e, "watch failed; retrying with backoff");
        }
        std::future::ready(())
    })
    .await
}

/// Whether the status of the Job's cache (in `caches`) records this Job's completion: a Job that
/// succeeded, is not being deleted, belongs to the cache object in the store (its owner uid) and is
/// the one the status records ([`records`]: created before the record, at the recorded spec hash).
pub fn job_recorded(j: &StoredJob, caches: &Store<ModelCache>) -> bool {
    let (Some(cache), Some(phase), Some(hash)) = j.cache_phase_hash() else {
        return false;
    };
    let (Some(ns), Some(created), None) = (
        j.metadata.namespace.as_deref(),
        j.metadata.creation_timestamp.as_ref(),
        j.metadata.deletion_timestamp.as_ref(),
    ) else {
        return false;
    };
    let Some(phase) = JobPhase::parse(phase) else {
        return false;
    };
    let Some(mc) = caches.get(&ObjectRef::new(cache).within(ns)) else {
        return false;
    };
    let owned = mc.metadata.uid.as_deref().is_some_and(|uid| {
        j.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.uid == uid)
    });
    owned
        && records(&mc, phase, created.0, Some(hash))
        && job_state(&j.to_job()) == JobState::Succeeded
}

/// Whether a pod is of a Job the stores no longer keep ([`job_recorded`]): it succeeded, its Job is
/// not in `jobs`, and the status of the Job's cache records that phase as done after the pod was
/// created. A pod of a Job still stored is kept (the planner reads its termination message).
pub fn pod_recorded(p: &StoredPod, jobs: &Store<StoredJob>, caches: &Store<ModelCache>) -> bool {
    let (Some(ns), Some(job), Some(created)) = (
        p.metadata.namespace.as_deref(),
        p.job_name(),
        p.metadata.creation_timestamp.as_ref(),
    ) else {
        return false;
    };
    if !p.succeeded() || jobs.get(&ObjectRef::new(&job).within(ns)).is_some() {
        return false;
    }
    let recorded = JobPhase::of_job_name(&job).any(|(cache, phase)| {
        caches
            .get(&ObjectRef::new(cache).within(ns))
            .is_some_and(|mc| records(&mc, phase, created.0, None))
    });
    recorded
}

/// Applies the Job and pod watches' events to their stores, leaving out what the caches' statuses
/// record ([`job_recorded`], [`pod_recorded`]), and takes such Jobs and their pods out of the stores
/// when a cache's status comes to record them.
#[derive(Clone)]
struct Recorded {
    caches: Store<ModelCache>,
    jobs: Store<StoredJob>,
    pods: Store<StoredPod>,
    jobs_w: Arc<Mutex<Writer<StoredJob>>>,
    pods_w: Arc<Mutex<Writer<StoredPod>>>,
    pods_by_job: Arc<Index>,
}

impl Recorded {
    /// Apply a Job watch event: a recorded Job is applied as its deletion (or left out of a listing).
    fn apply_job(&self, ev: &watcher::Event<StoredJob>) {
        if let Ok(mut w) = self.jobs_w.lock() {
            match ev {
                watcher::Event::Apply(j) if job_recorded(j, &self.caches) => {
                    w.apply_watcher_event(&watcher::Event::Delete(j.clone()));
                }
                watcher::Event::InitApply(j) if job_recorded(j, &self.caches) => {}
                _ => w.apply_watcher_event(ev),
            }
        }
        // A relisting replaces the store at its end: what a cache's status came to record while
        // it ran may be back.
        if matches!(ev, watcher::Event::InitDone) {
            self.forget_all_recorded();
        }
    }

    /// Apply a pod watch event the same way, keeping the pods-by-Job index in step with the store.
    fn apply_pod(&self, ev: &watcher::Event<StoredPod>) {
        let ev = match ev {
            watcher::Event::Apply(p) | watcher::Event::InitApply(p)
                if pod_recorded(p, &self.jobs, &self.caches) =>
            {
                if matches!(ev, watcher::Event::InitApply(_)) {
                    return;
                }
                std::borrow::Cow::Owned(watcher::Event::Delete(p.clone()))
            }
            _ => std::borrow::Cow::Borrowed(ev),
        };
        if let Ok(mut w) = self.pods_w.lock() {
            w.apply_watcher_event(&ev);
        }
        self.pods_by_job.update(&ev, pod_job);
        if matches!(*ev, watcher::Event::InitDone) {
            for p in self.pods.state() {
                if pod_recorded(&p, &self.jobs, &self.caches) {
                    self.forget_pod(&p);
                }
            }
        }
    }

    fn forget_pod(&self, p: &StoredPod) {
        let ev = watcher::Event::Delete(p.clone());
        if let Ok(mut w) = self.pods_w.lock() {
            w.apply_watcher_event(&ev);
        }
        self.pods_by_job.update(&ev, pod_job);
    }

    /// Take the Jobs of `mc` that its status now records, and their pods, out of the stores.
    fn forget_recorded(&self, mc: &ModelCache) {
        let (Some(ns), Some(name)) = (
            mc.metadata.namespace.as_deref(),
            mc.metadata.name.as_deref(),
        ) else {
            return;
        };
        for phase in JobPhase::ALL {
            let job = phase.job_name(name);
            if let Some(j) = self.jobs.get(&ObjectRef::new(&job).within(ns)) {
                if job_recorded(&j, &self.caches) {
                    self.forget_job(&j, ns, &job);
                }
            }
        }
    }

    /// After a fresh listing of the caches: every stored Job a status records goes.
    fn forget_all_recorded(&self) {
        for j in self.jobs.state() {
            if job_recorded(&j, &self.caches) {
                if let (Some(ns), Some(name)) = (&j.metadata.namespace, &j.metadata.name) {
                    self.forget_job(&j, ns, name);
                }
            }
        }
    }

    fn forget_job(&self, j: &StoredJob, ns: &str, job: &str) {
        if let Ok(mut w) = self.jobs_w.lock() {
            w.apply_watcher_event(&watcher::Event::Delete(j.clone()));
        }
        for p in self.pods_by_job.lookup(&self.pods, ns, job, pod_job) {
            self.forget_pod(&p);
        }
    }
}

impl Stores {
    /// The stores of scope `ns` (all namespaces when `None`) and the streams that fill them.
    pub fn new(client: &Client, ns: Option<&str>) -> (Self, Streams) {
        let managed = format!("{}={}", labels::MANAGED_BY, labels::MANAGED_BY_VALUE);
        let (caches, caches_w) = reflector::store();
        let (jobs, jobs_w) = reflector::store();
        let (pods, pods_w) = reflector::store();
        let (claims, claims_w) = reflector::store();
        let (profiles, profiles_w) = reflector::store();
        let (models, models_w) = reflector::store();
        let caches_by_claim = Arc::new(Index::default());
        let pods_by_job = Arc::new(Index::default());

        let recorded = Recorded {
            caches: caches.clone(),
            jobs: jobs.clone(),
            pods: pods.clone(),
            jobs_w: Arc::new(Mutex::new(jobs_w)),
            pods_w: Arc::new(Mutex::new(pods_w)),
            pods_by_job: pods_by_job.clone(),
        };

        let written = WrittenCopies::default();
        let idx = caches_by_claim.clone();
        let rec = recorded.clone();
        let seen = written.clone();
        let cache_stream = watcher(api_in::<ModelCache>(client, ns), watcher::Config::default())
            .default_backoff()
            .modify(lean_metadata)
            .reflect(caches_w)
            .inspect(move |ev| {
                if let Ok(ev) = ev {
                    idx.update(ev, cache_claim);
                    match ev {
                        watcher::Event::Apply(mc) => {
                            seen.seen(mc);
                            rec.forget_recorded(mc)
                        }
                        watcher::Event::InitApply(mc) => seen.seen(mc),
                        watcher::Event::Delete(mc) => seen.seen(mc),
                        watcher::Event::InitDone => rec.forget_all_recorded(),
                        _ => {}
                    }
                }
            })
            .applied_objects()
            .boxed();
        let rec = recorded.clone();
        let job_stream = watcher(
            api_in::<StoredJob>(client, ns),
            watcher::Config::default().labels(&managed),
        )
        .default_backoff()
        .modify(|j| j.metadata.resource_version = None)
        .inspect(move |ev| {
            if let Ok(ev) = ev {
                rec.apply_job(ev);
            }
        })
        .touched_objects()
        .boxed();
        let profile_stream = watcher(api_in::<GPUProfile>(client, ns), watcher::Config::default())
            .default_backoff()
            .modify(lean_metadata)
            .reflect(profiles_w)
            .touched_objects()
            .boxed();

        let rec = recorded;
        let pod_stream = watcher(
            api_in::<StoredPod>(client, ns),
            watcher::Config::default().labels(&managed),
        )
        .default_backoff()
        .modify(|p| {
            p.metadata.resource_version = None;
            p.metadata.uid = None;
        })
        .inspect(move |ev| {
            if let Ok(ev) = ev {
                rec.apply_pod(ev);
            }
        });
        // Metadata only, and of it only the identity: whether a claim exists is all a reconcile asks.
        let claim_api: Api<PartialObjectMeta<PersistentVolumeClaim>> = api_in(client, ns);
        let claim_stream = watcher(claim_api, watcher::Config::default())
            .default_backoff()
            .modify(identity_only)
            .reflect(claims_w);
        let model_stream = watcher(api_in::<Model>(client, ns), watcher::Config::default())
            .default_backoff()
            .modify(lean_metadata)
            .reflect(models_w);
        let ready = {
            let (a, b, c) = (caches.clone(), jobs.clone(), pods.clone());
            let (d, e, f) = (claims.clone(), profiles.clone(), models.clone());
            readiness(async move {
                a.wait_until_ready().await.is_ok()
                    && b.wait_until_ready().await.is_ok()
                    && c.wait_until_ready().await.is_ok()
                    && d.wait_until_ready().await.is_ok()
                    && e.wait_until_ready().await.is_ok()
                    && f.wait_until_ready().await.is_ok()
            })
        };
        let background = Box::pin(async move {
            tokio::join!(
                drain("pods", pod_stream),
                drain("persistentvolumeclaims", claim_stream),
                drain("models", model_stream)
            );
        });
        (
            Self {
                caches,
                jobs,
                pods,
                claims,
                profiles,
                models,
                caches_by_claim,
                pods_by_job,
                expectations: Default::default(),
                written,
                ready,
            },
            Streams {
                caches: cache_stream,
                jobs: job_stream,
                profiles: profile_stream,
                background,
            },
        )
    }

    /// Wait until every store has its first full listing (a reconcile must never plan from an
    /// empty Job store: it would restart finished phases). False once a store's writer is gone (the
    /// controller is shutting down).
    pub async fn ready(&self) -> bool {
        self.ready.clone().await
    }

    /// How many objects each store holds, by kind (`flexinfer_watch_store_objects`).
    pub fn sizes(&self) -> [(&'static str, usize); 7] {
        [
            ("modelcaches", self.caches.len()),
            ("modelcaches_written", self.written.held()),
            ("jobs", self.jobs.len()),
            ("pods", self.pods.len()),
            ("persistentvolumeclaims", self.claims.len()),
            ("gpuprofiles", self.profiles.len()),
            ("models", self.models.len()),
        ]
    }

    /// The Job `name` in `ns`, as stored.
    pub fn job(&self, ns: &str, name: &str) -> Option<Job> {
        self.jobs
            .get(&ObjectRef::new(name).within(ns))
            .map(|j| j.to_job())
    }

    /// The pods of Job `job` in `ns`.
    pub fn pods_of(&self, ns: &str, job: &str) -> Vec<Pod> {
        self.pods_by_job
            .lookup(&self.pods, ns, job, pod_job)
            .into_iter()
            .map(|p| p.to_pod())
            .collect()
    }

    /// The caches of `ns` on claim `claim`.
    pub fn caches_on_claim(&self, ns: &str, claim: &str) -> Vec<Arc<ModelCache>> {
        self.caches_by_claim
            .lookup(&self.caches, ns, claim, cache_claim)
            .into_iter()
            .collect()
    }

    /// Whether a claim named `name` exists in `ns`.
    pub fn claim_exists(&self, ns: &str, name: &str) -> bool {
        self.claims.get(&ObjectRef::new(name).within(ns)).is_some()
    }

    /// The GPUProfiles of `ns`.
    pub fn profiles_in(&self, ns: &str) -> Vec<GPUProfile> {
        self.profiles
            .state()
            .into_iter()
            .filter(|p| p.namespace().as_deref() == Some(ns))
            .map(|p| (*p).clone())
            .collect()
    }

    /// The Models of `ns`.
    pub fn models_in(&self, ns: &str) -> Vec<Arc<Model>> {
        self.models
            .state()
            .into_iter()
            .filter(|m| m.namespace().as_deref() == Some(ns))
            .collect()
    }

    /// Record a write to Jobs of cache `(ns, cache)` that the Job store must show before the cache is
    /// planned again.
    pub fn expect(&self, ns: &str, cache: &str, exp: Expectation) {
        if let Ok(mut m) = self.expectations.lock() {
            m.entry((ns.to_string(), cache.to_string()))
                .or_default()
                .push((exp, Instant::now()));
        }
    }

    /// The state of cache `(ns, cache)`'s expectations now: met ones are dropped.
    pub fn expectations(&self, ns: &str, cache: &str, now: Instant) -> Pending {
        let Ok(mut m) = self.expectations.lock() else {
            return Pending::Met;
        };
        let key = (ns.to_string(), cache.to_string());
        let Some(list) = m.get_mut(&key) else {
            return Pending::Met;
        };
        let mut expired = false;
        list.retain(|(exp, at)| {
            let name = match exp {
                Expectation::JobCreated { name, .. } | Expectation::JobDeleted { name, .. } => name,
                Expectation::ReadJobsFromApi => {
                    expired = true;
                    return false;
                }
            };
            if expectation_met(exp, self.job(ns, name).as_ref()) {
                return false;
            }
            if now.duration_since(*at) >= EXPECTATION_TIMEOUT {
                expired = true;
                return false;
            }
            true
        });
        let pending = !list.is_empty();
        if !pending {
            m.remove(&key);
        }
        if expired {
            Pending::Expired
        } else if pending {
            Pending::Waiting
        } else {
            Pending::Met
        }
    }

    /// Forget a deleted cache's expectations and written copy.
    pub fn forget(&self, ns: &str, cache: &str) {
        if let Ok(mut m) = self.expectations.lock() {
            m.remove(&(ns.to_string(), cache.to_string()));
        }
        self.written.forget(ns, cache);
    }

    /// Record the copy a write of the cache, made from resourceVersion `from`, returned.
    pub fn wrote(&self, from: Option<&str>, copy: ModelCache) {
        self.written.wrote(from, copy, lean_metadata);
    }
}

/// What a cache's writes still wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pending {
    /// The stores show every write: plan from them.
    Met,
    /// A write is not in the Job store yet: reconcile again shortly.
    Waiting,
    /// A write did not show within [`EXPECTATION_TIMEOUT`]: read the cache's Jobs from the API
    /// server this once.
    Expired,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Several reconciles wait for the stores at start-up; every one of them goes on when the
    /// listing arrives (a store alone wakes only the last waiter).
    #[tokio::test]
    async fn every_waiter_wakes_when_the_stores_are_ready() {
        let (store, mut writer) = reflector::store::<Pod>();
        let ready = readiness(async move { store.wait_until_ready().await.is_ok() });
        let waiters: Vec<_> = (0..4).map(|_| tokio::spawn(ready.clone())).collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let all = tokio::time::timeout(Duration::from_secs(5), futures::future::join_all(waiters))
            .await
            .expect("every waiter woke");
        assert!(all.into_iter().all(|r| r.expect("task")));
    }

    #[test]
    fn stored_objects_lose_managed_fields_and_the_applied_manifest_only() {
        let mut mc: ModelCache = serde_json::from_value(serde_json::json!({
            "apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
            "metadata": {"name": "c", "namespace": "ns",
                         "managedFields": [{"manager": "kubectl"}],
                         "annotations": {LAST_APPLIED: "{\"spec\":{}}",
                                         "flexinfer.ai/force-image-update": "true"}},
            "spec": {"source": "org/m"}
        }))
        .unwrap();
        lean_metadata(&mut mc);
        assert!(mc.metadata.managed_fields.is_none());
        let a = mc
            .metadata
            .annotations
            .as_ref()
            .expect("other annotations stay");
        assert_eq!(a.len(), 1);
        assert!(a.contains_key("flexinfer.ai/force-image-update"));
        mc.metadata.annotations = Some([(LAST_APPLIED.to_string(), "{}".to_string())].into());
        lean_metadata(&mut mc);
        assert!(mc.metadata.annotations.is_none());
    }

    fn pod(name: &str, job: &str) -> StoredPod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {JOB_NAME_LABEL: job}}
        }))
        .unwrap()
    }

    #[test]
    fn index_lookups_follow_the_store() {
        let (store, mut writer) = reflector::store::<StoredPod>();
        let index = Index::default();
        let feed = |w: &mut reflector::store::Writer<StoredPod>, ev: watcher::Event<StoredPod>| {
            w.apply_watcher_event(&ev);
            index.update(&ev, pod_job);
        };
        feed(&mut writer, watcher::Event::Apply(pod("a-1", "a")));
        feed(&mut writer, watcher::Event::Apply(pod("a-2", "a")));
        feed(&mut writer, watcher::Event::Apply(pod("b-1", "b")));
        let names = |job: &str| -> Vec<String> {
            index
                .lookup(&store, "ns", job, pod_job)
                .iter()
                .map(|p| p.name_any())
                .collect()
        };
        assert_eq!(names("a"), ["a-1", "a-2"]);
        assert_eq!(names("b"), ["b-1"]);
        assert!(names("c").is_empty());
        // A deleted pod leaves the index.
        feed(&mut writer, watcher::Event::Delete(pod("a-1", "a")));
        assert_eq!(names("a"), ["a-2"]);
        // A pod whose key changed is found under the new key only; the stale entry is dropped.
        feed(&mut writer, watcher::Event::Apply(pod("a-2", "b")));
        assert_eq!(names("a"), Vec::<String>::new());
        assert_eq!(names("b"), ["a-2", "b-1"]);
        assert_eq!(index.len(), 2);
        // Another namespace is another key.
        assert!(index.lookup(&store, "other", "b", pod_job).is_empty());
    }

    fn recorded_stores() -> (Recorded, reflector::store::Writer<ModelCache>) {
        let (caches, caches_w) = reflector::store::<ModelCache>();
        let (jobs, jobs_w) = reflector::store::<StoredJob>();
        let (pods, pods_w) = reflector::store::<StoredPod>();
        let rec = Recorded {
            caches,
            jobs,
            pods,
            jobs_w: Arc::new(Mutex::new(jobs_w)),
            pods_w: Arc::new(Mutex::new(pods_w)),
            pods_by_job: Arc::default(),
        };
        (rec, caches_w)
    }

    /// Cache `c` (uid u-1) whose status records `(phase, spec hash, completedAt)`.
    fn cache_recording(done: &[(&str, &str, &str)]) -> ModelCache {
        let mut status = serde_json::json!({"phase": "Ready"});
        for (phase, hash, at) in done {
            status[*phase] =
                serde_json::json!({"specHash": hash, "completedAt": at, "image": "w:1"});
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
            "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"},
            "spec": {"source": "org/m"},
            "status": status
        }))
        .unwrap()
    }

    /// Job `c-<phase>` of cache `c`, created at `created`, in condition `cond` (or running).
    fn job(phase: &str, hash: &str, created: &str, cond: Option<&str>) -> StoredJob {
        let conditions: Vec<serde_json::Value> = cond
            .map(|c| vec![serde_json::json!({"type": c, "status": "True"})])
            .unwrap_or_default();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("c-{phase}"), "namespace": "ns", "creationTimestamp": created,
                         "labels": {labels::CACHE: "c", labels::PHASE: phase},
                         "annotations": {flexinfer_api::contract::annotations::JOB_SPEC_HASH: hash},
                         "ownerReferences": [{"apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
                                              "name": "c", "uid": "u-1"}]},
            "status": {"conditions": conditions, "active": if cond.is_none() { 1 } else { 0 }}
        }))
        .unwrap()
    }

    fn job_pod(name: &str, job: &str, phase: &str, created: &str) -> StoredPod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created,
                         "labels": {JOB_NAME_LABEL: job}},
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    fn has_job(r: &Recorded, name: &str) -> bool {
        r.jobs.get(&ObjectRef::new(name).within("ns")).is_some()
    }

    fn has_pod(r: &Recorded, name: &str) -> bool {
        r.pods.get(&ObjectRef::new(name).within("ns")).is_some()
    }

    #[test]
    fn a_job_is_recorded_only_when_the_status_describes_it() {
        let (r, mut cw) = recorded_stores();
        const T0: &str = "2026-12-07T10:00:00Z";
        const DONE: &str = "2026-12-07T10:05:00Z";
        cw.apply_watcher_event(&watcher::Event::Apply(cache_recording(&[(
            "download", "h1", DONE,
        )])));
        let recorded = job("download", "h1", T0, Some("Complete"));
        assert!(job_recorded(&recorded, &r.caches));
        let mut other_owner = recorded.clone();
        other_owner
            .metadata
            .owner_references
            .iter_mut()
            .flatten()
            .for_each(|o| o.uid = "u-2".into());
        let mut terminating = recorded.clone();
        terminating.metadata.deletion_timestamp = recorded.metadata.creation_timestamp.clone();
        let mut elsewhere = recorded.clone();
        elsewhere.metadata.namespace = Some("other".into());
        for (what, j) in [
            (
                "another spec hash",
                job("download", "h2", T0, Some("Complete")),
            ),
            (
                "created after the record",
                job("download", "h1", "2026-12-07T10:06:00Z", Some("Complete")),
            ),
            ("failed", job("download", "h1", T0, Some("Failed"))),
            ("running", job("download", "h1", T0, None)),
            (
                "a phase the status does not record",
                job("quantize", "h1", T0, Some("Complete")),
            ),
            ("another cache object of that name", other_owner),
            ("being deleted", terminating),
            ("no such cache", elsewhere),
        ] {
            assert!(!job_recorded(&j, &r.caches), "{what}: recorded");
        }
    }

    #[test]
    fn recorded_jobs_and_their_pods_leave_the_stores() {
        let (r, mut cw) = recorded_stores();
        const T0: &str = "2026-12-07T10:00:00Z";
        const T1: &str = "2026-12-07T10:01:00Z";
        let dl_done = ("download", "hd", "2026-12-07T10:00:30Z");
        cw.apply_watcher_event(&watcher::Event::Apply(cache_recording(&[dl_done])));
        // A listing: the recorded download Job and its pod are left out; the running quantize kept.
        r.apply_job(&watcher::Event::Init);
        r.apply_job(&watcher::Event::InitApply(job(
            "download",
            "hd",
            T0,
            Some("Complete"),
        )));
        r.apply_job(&watcher::Event::InitApply(job("quantize", "hq", T1, None)));
        r.apply_job(&watcher::Event::InitDone);
        r.apply_pod(&watcher::Event::Init);
        r.apply_pod(&watcher::Event::InitApply(job_pod(
            "dl-1",
            "c-download",
            "Succeeded",
            T0,
        )));
        r.apply_pod(&watcher::Event::InitApply(job_pod(
            "q-1",
            "c-quantize",
            "Running",
            T1,
        )));
        r.apply_pod(&watcher::Event::InitDone);
        assert!(!has_job(&r, "c-download") && has_job(&r, "c-quantize"));
        assert!(!has_pod(&r, "dl-1") && has_pod(&r, "q-1"));
        // The quantize Job ends; its pod's termination is still needed: both stay until the status
        // records the phase.
        r.apply_job(&watcher::Event::Apply(job(
            "quantize",
            "hq",
            T1,
            Some("Complete"),
        )));
        r.apply_pod(&watcher::Event::Apply(job_pod(
            "q-1",
            "c-quantize",
            "Succeeded",
            T1,
        )));
        assert!(has_job(&r, "c-quantize") && has_pod(&r, "q-1"));
        assert_eq!(r.pods_by_job.len(), 1);
        // The status records it: the Job, its pod and the index entry go.
        let mc = cache_recording(&[dl_done, ("quantization", "hq", "2026-12-07T10:02:00Z")]);
        cw.apply_watcher_event(&watcher::Event::Apply(mc.clone()));
        r.forget_recorded(&mc);
        assert!(!has_job(&r, "c-quantize") && !has_pod(&r, "q-1"));
        assert_eq!(r.pods_by_job.len(), 0);
        // Later events of those objects (e.g. the pod's finalizer removed) do not bring them back.
        r.apply_job(&watcher::Event::Apply(job(
            "quantize",
            "hq",
            T1,
            Some("Complete"),
        )));
        r.apply_pod(&watcher::Event::Apply(job_pod(
            "q-1",
            "c-quantize",
            "Succeeded",
            T1,
        )));
        assert!(!has_job(&r, "c-quantize") && !has_pod(&r, "q-1"));
        // A re-run clears the record; its new Job (same name) is kept from its first event.
        cw.apply_watcher_event(&watcher::Event::Apply(cache_recording(&[dl_done])));
        r.apply_job(&watcher::Event::Apply(job(
            "quantize",
            "hq",
            "2026-12-07T10:10:00Z",
            None,
        )));
        r.apply_pod(&watcher::Event::Apply(job_pod(
            "q-2",
            "c-quantize",
            "Pending",
            "2026-12-07T10:10:00Z",
        )));
        assert!(has_job(&r, "c-quantize") && has_pod(&r, "q-2"));
        // A relisting that began before the status recorded a Job: swept at its end.
        r.apply_job(&watcher::Event::Init);
        r.apply_job(&watcher::Event::InitApply(job(
            "download",
            "hd",
            T0,
            Some("Complete"),
        )));
        let stale_status = cache_recording(&[]);
        cw.apply_watcher_event(&watcher::Event::Apply(stale_status));
        r.apply_job(&watcher::Event::InitApply(job(
            "quantize",
            "hq",
            T1,
            Some("Complete"),
        )));
        cw.apply_watcher_event(&watcher::Event::Apply(mc.clone()));
        r.apply_job(&watcher::Event::InitDone);
        assert!(!has_job(&r, "c-quantize"), "swept after the relisting");
        // A store filled before its cache was listed is swept when the caches' listing is done.
        let (r2, mut cw2) = recorded_stores();
        r2.apply_job(&watcher::Event::Apply(job(
            "download",
            "hd",
            T0,
            Some("Complete"),
        )));
        r2.apply_pod(&watcher::Event::Apply(job_pod(
            "dl-1",
            "c-download",
            "Succeeded",
            T0,
        )));
        assert!(has_job(&r2, "c-download") && has_pod(&r2, "dl-1"));
        cw2.apply_watcher_event(&watcher::Event::Apply(cache_recording(&[dl_done])));
        r2.forget_all_recorded();
        assert!(!has_job(&r2, "c-download") && !has_pod(&r2, "dl-1"));
    }
}
