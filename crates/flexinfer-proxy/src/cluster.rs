//! What the proxy knows of the cluster: watch-based caches (kube-runtime reflectors) of Models,
//! their Services and those Services' EndpointSlices, a change signal for requests waiting on a
//! cold start, and the `status.lastActiveTime` writer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flexinfer_api::contract::{labels, proxy, serving};
use flexinfer_api::Model;
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Service;
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

/// A `touch` in flight, shared by every caller for the same Model (its error shared too).
type TouchInFlight = Shared<BoxFuture<'static, Result<bool, Arc<kube::Error>>>>;

/// Shared view of Models and their endpoints.
#[derive(Clone)]
pub struct Cluster {
    client: Client,
    /// One store per watched namespace (one for all namespaces when none is set).
    models: Vec<Store<Model>>,
    changes: watch::Receiver<u64>,
    /// True once every cache has its initial list.
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
    models: Vec<Store<Model>>,
    services: Vec<Store<Service>>,
    slices: Vec<Store<EndpointSlice>>,
    /// The `endpointslice.kubernetes.io/managed-by` value of the slices whose addresses are used.
    slice_manager: String,
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
        let r = ObjectRef::new(&key.1).within(&key.0);
        let Some(model) = self.models.iter().find_map(|s| s.get(&r)) else {
            return Vec::new();
        };
        let r = ObjectRef::new(&key.1).within(&key.0);
        let service = self.services.iter().find_map(|s| s.get(&r));
        let all: Vec<Arc<EndpointSlice>> = self.slices.iter().flat_map(|s| s.state()).collect();
        endpoints::ready_backends(&model, service.as_deref(), &all, &self.slice_manager)
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

/// The Model whose objects an event is about: a Model itself, its Service or an EndpointSlice of
/// its Service (both named after the Model). `None` for events about everything (a (re-)list).
trait ModelOf {
    fn model_key(&self) -> Option<ModelKey>;
}

impl ModelOf for Model {
    fn model_key(&self) -> Option<ModelKey> {
        Some((self.namespace()?, self.name_any()))
    }
}

impl ModelOf for Service {
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

/// The writing ends of one scope's stores.
struct Writers {
    models: reflector::store::Writer<Model>,
    services: reflector::store::Writer<Service>,
    slices: reflector::store::Writer<EndpointSlice>,
}

/// An API handle for one namespace, or all.
fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Watch `api` (objects matching `config`) into `writer`, signalling each change.
fn spawn_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    mut writer: reflector::store::Writer<K>,
    signals: &Arc<Signals>,
    what: &'static str,
) where
    K: kube::Resource
        + ModelOf
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    let s = signals.clone();
    tokio::spawn(watcher(api, config).default_backoff().for_each(move |ev| {
        match ev {
            Ok(ev) => observe(&mut writer, &s, &ev),
            Err(e) => warn!(error = %flexinfer_api::contract::error::chain(&e), watch = what, "watch failed"),
        }
        futures::future::ready(())
    }));
}

/// Watch the Models, the Model Services and their EndpointSlices of one namespace (or all) into
/// the given stores' writers; every change signals the Model it concerns.
fn watch_scope(client: &Client, namespace: Option<&str>, w: Writers, signals: &Arc<Signals>) {
    // The Model controller labels its Services so, and Kubernetes copies a Service's labels
    // onto its EndpointSlices: this selects Model Services and their slices only (plus any
    // hand-made object carrying the labels, which endpoints::ready_backends refuses).
    let selector = format!(
        "{}={},{}={}",
        labels::MANAGED_BY,
        labels::MANAGED_BY_VALUE,
        labels::COMPONENT,
        serving::COMPONENT
    );
    let labelled = || watcher::Config::default().labels(&selector);
    spawn_watch(
        api(client, namespace),
        watcher::Config::default(),
        w.models,
        signals,
        "Model",
    );
    spawn_watch(
        api(client, namespace),
        labelled(),
        w.services,
        signals,
        "Service",
    );
    spawn_watch(
        api(client, namespace),
        labelled(),
        w.slices,
        signals,
        "EndpointSlice",
    );
}

impl Cluster {
    /// Start the watches (in background tasks) for each of `namespaces`, or all namespaces when
    /// the list is empty (one set of watches per namespace: a namespace-scoped install has no
    /// cluster-wide list permission). Backend addresses come only from the slices Kubernetes'
    /// EndpointSlice controller computes for each Model's own Service ([`endpoints`]).
    pub fn start(client: Client, namespaces: &[String]) -> Self {
        Self::start_with_slice_manager(client, namespaces, proxy::ENDPOINTSLICE_CONTROLLER)
    }

    /// [`Self::start`], using the slices whose `endpointslice.kubernetes.io/managed-by` is
    /// `slice_manager` instead of Kubernetes' EndpointSlice controller's. For tests on a control
    /// plane whose EndpointSlice controller would replace a slice published by hand for a Service
    /// whose pods cannot run there; every other rule is the same.
    pub fn start_with_slice_manager(
        client: Client,
        namespaces: &[String],
        slice_manager: &str,
    ) -> Self {
        let scopes: Vec<Option<&str>> = if namespaces.is_empty() {
            vec![None]
        } else {
            namespaces.iter().map(|n| Some(n.as_str())).collect()
        };
        let mut writers = Vec::new();
        let (mut models, mut services, mut slices) = (Vec::new(), Vec::new(), Vec::new());
        for _ in &scopes {
            let (m, mw) = reflector::store();
            let (v, vw) = reflector::store();
            let (s, sw) = reflector::store();
            models.push(m);
            services.push(v);
            slices.push(s);
            writers.push(Writers {
                models: mw,
                services: vw,
                slices: sw,
            });
        }
        let (cluster, signals) = Self::assemble(
            client,
            models.clone(),
            services.clone(),
            slices.clone(),
            slice_manager,
        );
        for (ns, w) in scopes.into_iter().zip(writers) {
            watch_scope(&cluster.client, ns, w, &signals);
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
            for store in &services {
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
        services: Vec<Store<Service>>,
        slices: Vec<Store<EndpointSlice>>,
        slice_manager: &str,
    ) -> (Self, Arc<Signals>) {
        let (tx, changes) = watch::channel(0u64);
        let signals = Arc::new(Signals {
            models: models.clone(),
            services,
            slices,
            slice_manager: slice_manager.to_string(),
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
        let (v, vw) = reflector::store();
        let (s, sw) = reflector::store();
        let (cluster, signals) = Self::assemble(
            client,
            vec![m],
            vec![v],
            vec![s],
            proxy::ENDPOINTSLICE_CONTROLLER,
        );
        (
            cluster,
            Offline {
                models: mw,
                services: vw,
                slices: sw,
                signals,
            },
        )
    }

    /// Every cache has its initial list.
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

    /// The API client the watches and writes use.
    pub fn client(&self) -> Client {
        self.client.clone()
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
    ) -> Result<bool, Arc<kube::Error>> {
        let fut = {
            let Ok(mut touching) = self.touching.lock() else {
                return self.touch(key, default_interval).await.map_err(Arc::new);
            };
            match touching.get(key) {
                Some(f) => f.clone(),
                None => {
                    let (this, k) = (self.clone(), key.clone());
                    let f = async move {
                        let r = this.touch(&k, default_interval).await.map_err(Arc::new);
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
    services: reflector::store::Writer<Service>,
    slices: reflector::store::Writer<EndpointSlice>,
    signals: Arc<Signals>,
}

#[cfg(test)]
impl Offline {
    pub(crate) fn apply_model(&mut self, m: Model) {
        observe(&mut self.models, &self.signals, &watcher::Event::Apply(m));
    }
    pub(crate) fn apply_service(&mut self, s: Service) {
        observe(&mut self.services, &self.signals, &watcher::Event::Apply(s));
    }
    pub(crate) fn apply_slice(&mut self, s: EndpointSlice) {
        observe(&mut self.slices, &self.signals, &watcher::Event::Apply(s));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn model(uid: &str) -> Model {
        serde_json::from_value(json!({
            "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
            "metadata": {"name": "m", "namespace": "a", "uid": uid},
            "spec": {"backend": "vllm", "source": "pvc://c/p"}
        }))
        .unwrap()
    }

    fn slice(name: &str, addr: &str, owned: bool) -> EndpointSlice {
        let mut labels = json!({"kubernetes.io/service-name": "m",
                                "app.kubernetes.io/managed-by": "flexinfer",
                                "app.kubernetes.io/component": "inference-server"});
        let mut owners = json!(null);
        if owned {
            labels["endpointslice.kubernetes.io/managed-by"] =
                json!("endpointslice-controller.k8s.io");
            owners = json!([{"apiVersion": "v1", "kind": "Service", "name": "m", "uid": "svc-1",
                             "controller": true}]);
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "a", "labels": labels, "ownerReferences": owners},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [{"addresses": [addr]}]
        }))
        .unwrap()
    }

    /// Through the stores: the backends of a Model come from its own Service's slices only, and
    /// a Model that no longer controls the Service (deleted and made again) gets none.
    #[tokio::test]
    async fn backends_come_from_the_models_own_service_only() {
        let url: http::Uri = "http://127.0.0.1:9".parse().unwrap();
        let (cluster, mut feed) =
            Cluster::offline(Client::try_from(kube::Config::new(url)).unwrap());
        let key: ModelKey = ("a".into(), "m".into());
        feed.apply_model(model("model-1"));
        feed.apply_slice(slice("m-real", "10.0.0.1", true));
        feed.apply_slice(slice("m-hand-made", "203.0.113.9", false));
        assert!(cluster.backends(&key).is_empty(), "no Service yet");
        let mut rx = cluster.subscribe(&key);
        feed.apply_service(
            serde_json::from_value(json!({
                "metadata": {"name": "m", "namespace": "a", "uid": "svc-1", "ownerReferences": [
                    {"apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model", "name": "m",
                     "uid": "model-1", "controller": true}]}
            }))
            .unwrap(),
        );
        assert!(
            rx.has_changed().unwrap(),
            "the Service's arrival signals the Model"
        );
        assert_eq!(*rx.borrow_and_update().clone(), vec!["10.0.0.1:8000"]);
        assert_eq!(cluster.backends(&key), vec!["10.0.0.1:8000"]);
        // The Model deleted and made again under the same name: the old Service is not its own.
        feed.apply_model(model("model-2"));
        assert!(rx.borrow_and_update().is_empty());
        assert!(cluster.backends(&key).is_empty());
    }
}
