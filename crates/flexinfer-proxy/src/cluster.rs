//! What the proxy knows of the cluster: watch-based caches (kube-runtime reflectors) of Models
//! and of the EndpointSlices of their Services, a change signal for requests waiting on a cold
//! start, and the `status.lastActiveTime` writer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flexinfer_api::contract::{labels, proxy, serving};
use flexinfer_api::Model;
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::endpoints;
use crate::plan;

/// `(namespace, name)` of a Model.
pub type ModelKey = (String, String);

/// A `touch` in flight, shared by every caller for the same Model (its error as text).
type TouchInFlight = Shared<BoxFuture<'static, Result<bool, String>>>;

/// Shared view of Models and their endpoints.
#[derive(Clone)]
pub struct Cluster {
    client: Client,
    /// One store per watched namespace (one for all namespaces when none is set).
    models: Vec<Store<Model>>,
    changes: watch::Receiver<u64>,
    /// True once both caches have their initial lists.
    ready: watch::Receiver<bool>,
    /// This replica's last `lastActiveTime` write per Model (the cache may lag behind it).
    written: Arc<Mutex<HashMap<ModelKey, Timestamp>>>,
    writes: Arc<AtomicU64>,
    signals: Arc<Signals>,
    /// The `lastActiveTime` write in flight per Model (single-flight).
    touching: Arc<Mutex<HashMap<ModelKey, TouchInFlight>>>,
}

/// Per-Model change signals: requests waiting for a Model subscribe to its channel, which carries
/// the Model's ready backends, recomputed once per change of that Model's objects (not per waiter,
/// and not for changes of other Models).
struct Signals {
    slices: Vec<Store<EndpointSlice>>,
    /// Only Models someone waits for (or waited for) have a channel; entries whose receivers are
    /// all gone are dropped on the next change.
    subscribed: Mutex<HashMap<ModelKey, watch::Sender<Arc<Vec<String>>>>>,
    /// Every change, for [`Cluster::changes`].
    any: Arc<watch::Sender<u64>>,
    /// How often a Model's backends were computed from the EndpointSlices.
    backend_reads: AtomicU64,
}

impl Signals {
    fn backends(&self, key: &ModelKey) -> Vec<String> {
        self.backend_reads.fetch_add(1, Ordering::Relaxed);
        let all: Vec<Arc<EndpointSlice>> = self.slices.iter().flat_map(|s| s.state()).collect();
        endpoints::ready_backends(&all, &key.0, &key.1)
    }

    fn subscribe(&self, key: &ModelKey) -> watch::Receiver<Arc<Vec<String>>> {
        let Ok(mut subs) = self.subscribed.lock() else {
            return watch::channel(Arc::new(self.backends(key))).1;
        };
        if let Some(tx) = subs.get(key) {
            return tx.subscribe();
        }
        // Created under the lock after the store already holds any event whose signal would
        // look for this entry: no change is missed.
        let (tx, rx) = watch::channel(Arc::new(self.backends(key)));
        subs.insert(key.clone(), tx);
        rx
    }

    /// The objects of `key` changed (`None`: possibly every Model's, e.g. a re-list).
    fn changed(&self, key: Option<ModelKey>) {
        if let Ok(mut subs) = self.subscribed.lock() {
            subs.retain(|_, tx| tx.receiver_count() > 0);
            match key {
                Some(k) => {
                    // Also when the backends are the same: the Model itself may have changed
                    // (an invalid configuration ends the wait).
                    if let Some(tx) = subs.get(&k) {
                        tx.send_replace(Arc::new(self.backends(&k)));
                    }
                }
                None => {
                    for (k, tx) in subs.iter() {
                        let b = Arc::new(self.backends(k));
                        tx.send_replace(b);
                    }
                }
            }
        }
        self.any.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// The Model whose objects an event is about: a Model itself, or an EndpointSlice of its Service
/// (named after the Model). `None` for events about everything (a (re-)list).
trait ModelOf {
    fn model_key(&self) -> Option<ModelKey>;
}

impl ModelOf for Model {
    fn model_key(&self) -> Option<ModelKey> {
        Some((self.namespace()?, self.name_any()))
    }
}

impl ModelOf for EndpointSlice {
    fn model_key(&self) -> Option<ModelKey> {
        Some((
            self.namespace()?,
            self.labels()
                .get(proxy::ENDPOINTSLICE_SERVICE_LABEL)?
                .clone(),
        ))
    }
}

/// Apply one watch event to the store, then signal the Model it concerns.
fn observe<K>(writer: &mut reflector::store::Writer<K>, signals: &Signals, ev: &watcher::Event<K>)
where
    K: kube::Resource + ModelOf + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    writer.apply_watcher_event(ev);
    let key = match ev {
        watcher::Event::Apply(o) | watcher::Event::Delete(o) => o.model_key(),
        // A (re-)list: anything may have changed; signalled once it is complete.
        watcher::Event::Init | watcher::Event::InitApply(_) => return,
        watcher::Event::InitDone => None,
    };
    signals.changed(key);
}

/// Watch the Models and Model-Service EndpointSlices of one namespace (or all) into the given
/// stores' writers; every change signals the Model it concerns.
fn watch_scope(
    client: &Client,
    namespace: Option<&str>,
    mut models: reflector::store::Writer<Model>,
    mut slices: reflector::store::Writer<EndpointSlice>,
    signals: &Arc<Signals>,
) {
    let (models_api, slices_api): (Api<Model>, Api<EndpointSlice>) = match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    // Kubernetes copies a Service's labels onto its EndpointSlices: this selects the slices
    // of Model Services only.
    let slice_selector = format!(
        "{}={},{}={}",
        labels::MANAGED_BY,
        labels::MANAGED_BY_VALUE,
        labels::COMPONENT,
        serving::COMPONENT
    );
    let s = signals.clone();
    tokio::spawn(
        watcher(models_api, watcher::Config::default())
            .default_backoff()
            .for_each(move |ev| {
                match ev {
                    Ok(ev) => observe(&mut models, &s, &ev),
                    Err(e) => warn!(error = %e, "Model watch"),
                }
                futures::future::ready(())
            }),
    );
    let s = signals.clone();
    tokio::spawn(
        watcher(
            slices_api,
            watcher::Config::default().labels(&slice_selector),
        )
        .default_backoff()
        .for_each(move |ev| {
            match ev {
                Ok(ev) => observe(&mut slices, &s, &ev),
                Err(e) => warn!(error = %e, "EndpointSlice watch"),
            }
            futures::future::ready(())
        }),
    );
}

impl Cluster {
    /// Start the watches (in background tasks) for each of `namespaces`, or all namespaces when
    /// the list is empty (one pair of watches per namespace: a namespace-scoped install has no
    /// cluster-wide list permission).
    pub fn start(client: Client, namespaces: &[String]) -> Self {
        let scopes: Vec<Option<&str>> = if namespaces.is_empty() {
            vec![None]
        } else {
            namespaces.iter().map(|n| Some(n.as_str())).collect()
        };
        let mut writers = Vec::new();
        let (mut models, mut slices) = (Vec::new(), Vec::new());
        for _ in &scopes {
            let (m, mw) = reflector::store();
            let (s, sw) = reflector::store();
            models.push(m);
            slices.push(s);
            writers.push((mw, sw));
        }
        let (cluster, signals) = Self::assemble(client, models.clone(), slices.clone());
        for (ns, (mw, sw)) in scopes.into_iter().zip(writers) {
            watch_scope(&cluster.client, ns, mw, sw, &signals);
        }
        // The only waiter on the stores' readiness: a store wakes one waiter only (its signal is
        // a oneshot channel), so everyone else waits on this channel.
        let (ready_tx, ready) = watch::channel(false);
        tokio::spawn(async move {
            for store in &models {
                if store.wait_until_ready().await.is_err() {
                    return;
                }
            }
            for store in &slices {
                if store.wait_until_ready().await.is_err() {
                    return;
                }
            }
            let _ = ready_tx.send(true);
        });
        Self { ready, ..cluster }
    }

    fn assemble(
        client: Client,
        models: Vec<Store<Model>>,
        slices: Vec<Store<EndpointSlice>>,
    ) -> (Self, Arc<Signals>) {
        let (tx, changes) = watch::channel(0u64);
        let signals = Arc::new(Signals {
            slices,
            subscribed: Mutex::default(),
            any: Arc::new(tx),
            backend_reads: AtomicU64::new(0),
        });
        let cluster = Self {
            client,
            models,
            changes,
            ready: watch::channel(true).1,
            written: Arc::default(),
            writes: Arc::default(),
            signals: signals.clone(),
            touching: Arc::default(),
        };
        (cluster, signals)
    }

    /// A cluster view fed by hand instead of by watches (tests without an API server; `client`
    /// only serves `touch`).
    #[cfg(test)]
    pub(crate) fn offline(client: Client) -> (Self, Offline) {
        let (m, mw) = reflector::store();
        let (s, sw) = reflector::store();
        let (cluster, signals) = Self::assemble(client, vec![m], vec![s]);
        (
            cluster,
            Offline {
                models: mw,
                slices: sw,
                signals,
            },
        )
    }

    /// Both caches have their initial lists.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Wait until [`Self::is_ready`], at most `timeout`.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let mut ready = self.ready.clone();
        let waited = tokio::time::timeout(timeout, ready.wait_for(|r| *r))
            .await
            .map(|r| r.is_ok());
        waited.unwrap_or(false)
    }

    /// `lastActiveTime` writes this replica made.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    pub fn models(&self) -> Vec<Arc<Model>> {
        self.models.iter().flat_map(|s| s.state()).collect()
    }

    pub fn model(&self, key: &ModelKey) -> Option<Arc<Model>> {
        let r = ObjectRef::new(&key.1).within(&key.0);
        self.models.iter().find_map(|s| s.get(&r))
    }

    /// Ready backends (`host:port`) of a Model.
    pub fn backends(&self, key: &ModelKey) -> Vec<String> {
        self.signals.backends(key)
    }

    /// How often a Model's backends were computed from the EndpointSlices (all Models).
    pub fn backend_reads(&self) -> u64 {
        self.signals.backend_reads.load(Ordering::Relaxed)
    }

    /// A receiver that changes whenever a Model or EndpointSlice changes.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.clone()
    }

    /// The Model's ready backends, as a receiver that changes only when that Model's Model or
    /// EndpointSlices change (computed once per change for all subscribers).
    pub fn subscribe(&self, key: &ModelKey) -> watch::Receiver<Arc<Vec<String>>> {
        self.signals.subscribe(key)
    }

    /// [`Self::touch`], single-flight: while a write decision for the Model is in flight, other
    /// callers wait for it and share its result instead of starting their own (one PATCH per
    /// Model, not one per waiting request).
    pub async fn touch_once(
        &self,
        key: &ModelKey,
        default_interval: Duration,
    ) -> Result<bool, String> {
        let fut = {
            let Ok(mut touching) = self.touching.lock() else {
                return self
                    .touch(key, default_interval)
                    .await
                    .map_err(|e| e.to_string());
            };
            match touching.get(key) {
                Some(f) => f.clone(),
                None => {
                    let (this, k) = (self.clone(), key.clone());
                    let f = async move {
                        let r = this
                            .touch(&k, default_interval)
                            .await
                            .map_err(|e| e.to_string());
                        if let Ok(mut t) = this.touching.lock() {
                            t.remove(&k);
                        }
                        r
                    }
                    .boxed()
                    .shared();
                    touching.insert(key.clone(), f.clone());
                    f
                }
            }
        };
        fut.await
    }

    /// Write `status.lastActiveTime = now` unless a write (by any replica) within the Model's
    /// keepalive interval makes it unnecessary. The write carries the resourceVersion it was
    /// decided on, so two replicas deciding at once do not both write: the loser gets a
    /// conflict, re-reads, and finds the fresh value. Returns whether this call wrote.
    pub async fn touch(
        &self,
        key: &ModelKey,
        default_interval: Duration,
    ) -> Result<bool, kube::Error> {
        let Some(model) = self.model(key) else {
            return Ok(false);
        };
        let interval = plan::keepalive_interval(&model, default_interval);
        let api: Api<Model> = Api::namespaced(self.client.clone(), &key.0);
        let mut current = (*model).clone();
        for attempt in 0..3 {
            let now = Timestamp::now();
            let mine = self.written.lock().ok().and_then(|w| w.get(key).copied());
            let cur = current
                .status
                .as_ref()
                .and_then(|s| s.last_active_time.as_ref())
                .map(|t| plan::written_at_most(t.0));
            // The cache may not have caught up with our own last write yet.
            if !plan::should_write(plan::newest(cur, mine), now, interval) {
                return Ok(false);
            }
            let patch = serde_json::json!({
                "metadata": {"resourceVersion": current.meta().resource_version},
                "status": {"lastActiveTime": Time(now)},
            });
            let pp = PatchParams {
                field_manager: Some(proxy::FIELD_MANAGER.to_string()),
                ..PatchParams::default()
            };
            match api.patch_status(&key.1, &pp, &Patch::Merge(&patch)).await {
                Ok(_) => {
                    self.writes.fetch_add(1, Ordering::Relaxed);
                    if let Ok(mut w) = self.written.lock() {
                        w.insert(key.clone(), now);
                    }
                    debug!(namespace = %key.0, model = %key.1, "lastActiveTime written");
                    return Ok(true);
                }
                Err(kube::Error::Api(e)) if e.code == 409 && attempt < 2 => {
                    current = api.get_status(&key.1).await?;
                }
                Err(kube::Error::Api(e)) if e.code == 404 => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }
}

/// The writing side of [`Cluster::offline`]: what the watches would deliver.
#[cfg(test)]
pub(crate) struct Offline {
    models: reflector::store::Writer<Model>,
    slices: reflector::store::Writer<EndpointSlice>,
    signals: Arc<Signals>,
}

#[cfg(test)]
impl Offline {
    pub(crate) fn apply_model(&mut self, m: Model) {
        observe(&mut self.models, &self.signals, &watcher::Event::Apply(m));
    }
    pub(crate) fn apply_slice(&mut self, s: EndpointSlice) {
        observe(&mut self.slices, &self.signals, &watcher::Event::Apply(s));
    }
}
