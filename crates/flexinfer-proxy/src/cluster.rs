//! What the proxy knows of the cluster: watch-based caches (kube-runtime reflectors) of Models
//! and of the EndpointSlices of their Services, a change signal for requests waiting on a cold
//! start, and the `status.lastActiveTime` writer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flexinfer_api::contract::{labels, proxy, serving};
use flexinfer_api::Model;
use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Resource};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::endpoints;
use crate::plan;

/// `(namespace, name)` of a Model.
pub type ModelKey = (String, String);

/// Shared view of Models and their endpoints.
#[derive(Clone)]
pub struct Cluster {
    client: Client,
    /// One store per watched namespace (one for all namespaces when none is set).
    models: Vec<Store<Model>>,
    slices: Vec<Store<EndpointSlice>>,
    changes: watch::Receiver<u64>,
    /// True once both caches have their initial lists.
    ready: watch::Receiver<bool>,
    /// This replica's last `lastActiveTime` write per Model (the cache may lag behind it).
    written: Arc<Mutex<HashMap<ModelKey, Timestamp>>>,
    writes: Arc<AtomicU64>,
}

/// Watch the Models and Model-Service EndpointSlices of one namespace (or all) into two stores;
/// every change bumps `tx`.
fn watch_scope(
    client: &Client,
    namespace: Option<&str>,
    tx: &Arc<watch::Sender<u64>>,
) -> (Store<Model>, Store<EndpointSlice>) {
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
    let (models, mw) = reflector::store();
    let (slices, sw) = reflector::store();
    let t = tx.clone();
    tokio::spawn(
        watcher(models_api, watcher::Config::default())
            .default_backoff()
            .reflect(mw)
            .for_each(move |ev| {
                if let Err(e) = ev {
                    warn!(error = %e, "Model watch");
                }
                t.send_modify(|n| *n = n.wrapping_add(1));
                futures::future::ready(())
            }),
    );
    let t = tx.clone();
    tokio::spawn(
        watcher(
            slices_api,
            watcher::Config::default().labels(&slice_selector),
        )
        .default_backoff()
        .reflect(sw)
        .for_each(move |ev| {
            if let Err(e) = ev {
                warn!(error = %e, "EndpointSlice watch");
            }
            t.send_modify(|n| *n = n.wrapping_add(1));
            futures::future::ready(())
        }),
    );
    (models, slices)
}

impl Cluster {
    /// Start the watches (in background tasks) for each of `namespaces`, or all namespaces when
    /// the list is empty (one pair of watches per namespace: a namespace-scoped install has no
    /// cluster-wide list permission).
    pub fn start(client: Client, namespaces: &[String]) -> Self {
        let (tx, changes) = watch::channel(0u64);
        let tx = Arc::new(tx);
        let scopes: Vec<Option<&str>> = if namespaces.is_empty() {
            vec![None]
        } else {
            namespaces.iter().map(|n| Some(n.as_str())).collect()
        };
        let mut models = Vec::new();
        let mut slices = Vec::new();
        for ns in scopes {
            let (m, s) = watch_scope(&client, ns, &tx);
            models.push(m);
            slices.push(s);
        }
        // The only waiter on the stores' readiness: a store wakes one waiter only (its signal is
        // a oneshot channel), so everyone else waits on this channel.
        let (ready_tx, ready) = watch::channel(false);
        let (m, s) = (models.clone(), slices.clone());
        tokio::spawn(async move {
            for store in &m {
                if store.wait_until_ready().await.is_err() {
                    return;
                }
            }
            for store in &s {
                if store.wait_until_ready().await.is_err() {
                    return;
                }
            }
            let _ = ready_tx.send(true);
        });
        Self {
            client,
            models,
            slices,
            changes,
            ready,
            written: Arc::default(),
            writes: Arc::default(),
        }
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
        let all: Vec<Arc<EndpointSlice>> = self.slices.iter().flat_map(|s| s.state()).collect();
        endpoints::ready_backends(&all, &key.0, &key.1)
    }

    /// A receiver that changes whenever a Model or EndpointSlice changes.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.clone()
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
