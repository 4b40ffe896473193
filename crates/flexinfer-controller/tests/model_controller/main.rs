//! Model controller on the real control plane (cluster mode: kube-controller-manager, scheduler
//! and kwok nodes, so Deployments get pods that become Ready). Each test runs the controller
//! in-process, scoped to its own namespace, and deletes the namespace at the end.
//!
//! Needs `KUBECONFIG` from `scripts/testenv/up.sh cluster` (`make test` sets it up).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::collections::BTreeMap;
use std::time::Duration;

use flexinfer_api::conditions::{self, types};
use flexinfer_api::contract::controller::FIELD_MANAGER;
use flexinfer_api::contract::{annotations, labels, reasons};
use flexinfer_api::model::ModelPhase;
use flexinfer_api::{GPUProfile, Model, ModelCache};
use flexinfer_controller::metrics::Metrics;
use flexinfer_controller::model::{self, render::RenderConfig, Options};
use flexinfer_e2e::{cleanup_off_runtime, client, install_crds, wait_for, TestNamespace};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    Container, PersistentVolume, PersistentVolumeClaim, Pod, Service,
};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::{Client, Resource, ResourceExt};
use serde_json::{json, Value};

const MANAGER: &str = "flexinfer-model-tests";
const WAIT: Duration = Duration::from_secs(90);

struct TestEnv {
    client: Client,
    ns: TestNamespace,
    metrics: Metrics,
    controller: tokio::task::JoinHandle<()>,
    pvs: Vec<String>,
}

impl TestEnv {
    async fn new(prefix: &str) -> Self {
        let client = client().await;
        install_crds(&client).await.expect("install the CRDs");
        let ns = TestNamespace::new(&client, prefix)
            .await
            .unwrap_or_else(|e| panic!("create namespace: {e:#}"));
        let metrics = Metrics::new().unwrap_or_else(|e| panic!("metrics: {e}"));
        let opts = Options {
            namespace: Some(ns.name.clone()),
            profile_namespace: None,
            render: RenderConfig::default(),
            preemption_grace: None,
        };
        let (c, m) = (client.clone(), metrics.clone());
        let controller = tokio::spawn(async move {
            if let Err(e) = model::run_with(c, m, opts).await {
                eprintln!("model controller stopped: {e}");
            }
        });
        Self {
            client,
            ns,
            metrics,
            controller,
            pvs: Vec::new(),
        }
    }

    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }

    /// Server-side apply a namespaced object (JSON with apiVersion/kind/metadata.name).
    async fn apply<K>(&self, mut obj: Value) -> K
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + serde::Serialize
            + std::fmt::Debug,
        K::DynamicType: Default,
    {
        obj["metadata"]["namespace"] = json!(self.ns.name);
        let name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        self.api::<K>()
            .patch(
                &name,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&obj),
            )
            .await
            .unwrap_or_else(|e| panic!("apply {name}: {e}"))
    }

    /// A PersistentVolumeClaim pre-bound to a hostPath PersistentVolume (no provisioner here).
    async fn pvc(&mut self, claim: &str) {
        let pv_name = format!("{}-{claim}", self.ns.name);
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        let pv: PersistentVolume = serde_json::from_value(json!({
            "metadata": {"name": pv_name, "labels": {"flexinfer.ai/test": "true"}},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": "/tmp/flexinfer-model-tests"},
                     "claimRef": {"namespace": self.ns.name, "name": claim}}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        pvs.create(&PostParams::default(), &pv)
            .await
            .unwrap_or_else(|e| panic!("create PV {pv_name}: {e}"));
        self.pvs.push(pv_name.clone());
        let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv_name,
                     "resources": {"requests": {"storage": "1Gi"}}}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        self.api::<PersistentVolumeClaim>()
            .create(&PostParams::default(), &pvc)
            .await
            .unwrap_or_else(|e| panic!("create PVC {claim}: {e}"));
        let bound = |p: Option<&PersistentVolumeClaim>| {
            p.and_then(|p| p.status.as_ref())
                .and_then(|s| s.phase.as_deref())
                == Some("Bound")
        };
        tokio::time::timeout(
            WAIT,
            await_condition(self.api::<PersistentVolumeClaim>(), claim, bound),
        )
        .await
        .unwrap_or_else(|_| panic!("PVC {claim} not bound"))
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Wait until the object `name` satisfies `cond`; on timeout, fail with `describe` of what is there.
    async fn wait_object<K>(
        &self,
        name: &str,
        what: &str,
        cond: impl Fn(&K) -> bool + Send + 'static,
        describe: impl Fn(Option<K>) -> String,
    ) -> K
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + std::fmt::Debug
            + serde::de::DeserializeOwned
            + Send
            + 'static,
        K::DynamicType: Default,
    {
        let api = self.api::<K>();
        let res = tokio::time::timeout(
            WAIT,
            await_condition(api.clone(), name, move |o: Option<&K>| o.is_some_and(&cond)),
        )
        .await;
        match res {
            Ok(Ok(Some(o))) => o,
            _ => {
                let now = api.get_opt(name).await.ok().flatten();
                panic!(
                    "{} {name}: timed out waiting for {what}; {}",
                    K::kind(&Default::default()),
                    describe(now)
                );
            }
        }
    }

    async fn wait_model(
        &self,
        name: &str,
        what: &str,
        cond: impl Fn(&Model) -> bool + Send + 'static,
    ) -> Model {
        self.wait_object(name, what, cond, |m: Option<Model>| {
            format!("status: {:#?}", m.and_then(|m| m.status))
        })
        .await
    }

    async fn wait_deployment(
        &self,
        name: &str,
        what: &str,
        cond: impl Fn(&Deployment) -> bool + Send + 'static,
    ) -> Deployment {
        self.wait_object(name, what, cond, |d: Option<Deployment>| {
            format!("{:#?}", d.map(|d| (d.spec.map(|s| s.replicas), d.status)))
        })
        .await
    }

    async fn events_for(&self, name: &str) -> Vec<Event> {
        self.api::<Event>()
            .list(&ListParams::default())
            .await
            .unwrap_or_else(|e| panic!("list events: {e}"))
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .collect()
    }

    /// Wait until an Event about `name` satisfies `pred` (Events are written after the status).
    async fn wait_event(&self, name: &str, what: &str, pred: impl Fn(&Event) -> bool) -> Event {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let evs = self.events_for(name).await;
            if let Some(e) = evs.iter().find(|e| pred(e)) {
                return e.clone();
            }
            if tokio::time::Instant::now() > deadline {
                let seen: Vec<_> = evs
                    .iter()
                    .map(|e| (e.reason.clone(), e.note.clone()))
                    .collect();
                panic!("{name}: no Event {what}; seen: {seen:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn cleanup(mut self) {
        self.controller.abort();
        delete_pvs(&self.client, &self.pvs).await;
        self.pvs.clear();
    }
}

async fn delete_pvs(client: &Client, pvs: &[String]) {
    let pvapi: Api<PersistentVolume> = Api::all(client.clone());
    for pv in pvs {
        let _ = pvapi.delete(pv, &DeleteParams::background()).await;
    }
}

/// A failed test still removes its PVs (and, through [`TestNamespace`], its namespace with its pods
/// and their GPUs).
impl Drop for TestEnv {
    fn drop(&mut self) {
        self.controller.abort();
        if self.pvs.is_empty() {
            return;
        }
        let pvs = std::mem::take(&mut self.pvs);
        cleanup_off_runtime(move |client| async move { delete_pvs(&client, &pvs).await });
    }
}

fn example(file: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/examples")
        .join(file);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

fn model_json(name: &str, annotations: &[(&str, &str)], spec: Value) -> Value {
    let annos: BTreeMap<&str, &str> = annotations.iter().copied().collect();
    json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "annotations": annos},
        "spec": spec,
    })
}

fn phase_is(p: ModelPhase) -> impl Fn(&Model) -> bool + Send + 'static {
    move |m: &Model| m.status.as_ref().and_then(|s| s.phase) == Some(p)
}

fn cond_is(
    type_: &'static str,
    status: &'static str,
    reason: &'static str,
) -> impl Fn(&Model) -> bool + Send + 'static {
    move |m: &Model| {
        m.status
            .as_ref()
            .and_then(|s| conditions::find(&s.conditions, type_))
            .is_some_and(|c| c.status == status && c.reason == reason)
    }
}

fn cond<'a>(
    m: &'a Model,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    m.status
        .as_ref()
        .and_then(|s| conditions::find(&s.conditions, type_))
}

fn container(d: &Deployment) -> Container {
    d.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.first().cloned())
        .unwrap_or_else(|| panic!("Deployment without container"))
}

fn arg_after(c: &Container, flag: &str) -> Option<String> {
    let args = c.args.clone().unwrap_or_default();
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

fn replicas(d: &Deployment) -> Option<i32> {
    d.spec.as_ref().and_then(|s| s.replicas)
}

fn ready_replicas(d: &Deployment) -> i32 {
    d.status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0)
}

mod backends;
mod cache;
mod gate;
mod placement;
mod safety;
