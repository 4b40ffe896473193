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

#[tokio::test]
async fn model_backends_phases_and_metrics() {
    let mut env = TestEnv::new("mdl-backends").await;
    env.pvc("models").await;
    env.apply::<GPUProfile>(example("gpuprofile-gfx1100.yaml"))
        .await;
    let arch = json!({"flexinfer.ai/gpu.arch": "gfx1100"});
    let warm = [
        (
            "vllm-m",
            json!({"backend": "vllm", "source": "pvc://models/org/awq", "nodeSelector": arch,
            "serverless": {"minReplicas": 1},
            "config": {"quantization": "awq", "maxModelLen": 4096, "kvCacheDtype": "fp8", "gpuMemoryUtilization": 0.9,
                       "maxNumBatchedTokens": 512, "attentionBackend": "TRITON_ATTN"}}),
        ),
        (
            "llama-m",
            json!({"backend": "llamacpp", "source": "pvc://models/gguf/m-q4_k_m.gguf", "nodeSelector": arch,
            "serverless": {"enabled": false}, "config": {"quantization": "gguf", "maxModelLen": 8192}}),
        ),
        (
            "ollama-m",
            json!({"backend": "ollama", "source": "pvc://models/gguf", "nodeSelector": arch,
            "config": {"quantization": "gguf", "warmPolicy": "primary"}}),
        ),
        (
            "exl2-m",
            json!({"backend": "exllamav2", "source": "pvc://models/exl2-w4", "nodeSelector": arch,
            "serverless": {"minReplicas": 1}, "config": {"quantization": "exl2", "maxModelLen": 4096}}),
        ),
    ];
    for (name, spec) in &warm {
        env.apply::<Model>(model_json(name, &[], spec.clone()))
            .await;
    }
    // Scale-to-zero model and one that can never be scheduled.
    env.apply::<Model>(model_json(
        "idle-m",
        &[],
        json!({"backend": "vllm", "source": "pvc://models/org/awq", "nodeSelector": arch}),
    ))
    .await;
    env.apply::<Model>(model_json("nowhere-m", &[], json!({"backend": "vllm", "source": "pvc://models/org/awq",
        "nodeSelector": {"flexinfer.ai/gpu.arch": "gfx1100", "kubernetes.io/hostname": "no-such-node"},
        "serverless": {"minReplicas": 1}}))).await;

    for (name, _) in &warm {
        let m = env
            .wait_model(name, "phase Ready", phase_is(ModelPhase::Ready))
            .await;
        let st = m.status.clone().unwrap_or_default();
        assert_eq!(st.replicas, Some(1), "{name}");
        assert_eq!(
            st.endpoint,
            Some(format!("http://{name}.{}.svc:8000/v1", env.ns.name)),
            "{name}"
        );
        assert_eq!(st.observed_generation, m.metadata.generation, "{name}");
        assert!(
            cond(&m, types::READY).is_some_and(|c| c.status == "True"),
            "{name}"
        );
        assert!(
            cond(&m, types::CONFIG_VALID).is_some_and(|c| c.status == "True"),
            "{name}"
        );
        assert!(
            cond(&m, types::CACHED).is_some_and(|c| c.status == "True" && c.reason == "PVCSource"),
            "{name}"
        );
        assert!(
            cond(&m, types::PROMOTION_GATE).is_none(),
            "{name}: ungated models carry no gate condition"
        );
        let d = env
            .api::<Deployment>()
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        // Re-applying the same intent on every reconcile must not change the Deployment.
        assert_eq!(
            d.metadata.generation,
            Some(1),
            "{name}: Deployment spec changed without a Model change"
        );
        let l = d.metadata.labels.clone().unwrap_or_default();
        assert_eq!(l.get(labels::MODEL).map(String::as_str), Some(*name));
        assert_eq!(
            l.get(labels::MANAGED_BY).map(String::as_str),
            Some(labels::MANAGED_BY_VALUE)
        );
        for k in [
            labels::NAME,
            labels::INSTANCE,
            labels::COMPONENT,
            labels::PART_OF,
        ] {
            assert!(l.contains_key(k), "{name}: label {k}");
        }
        let owner = d.metadata.owner_references.clone().unwrap_or_default();
        assert!(
            owner
                .iter()
                .any(|o| o.kind == "Model" && o.name == *name && o.controller == Some(true)),
            "{name}"
        );
        let managers: Vec<String> = d
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .filter_map(|f| f.manager.clone())
            .collect();
        assert!(
            managers.iter().any(|m| m == FIELD_MANAGER),
            "{name}: {managers:?}"
        );
        let c = container(&d);
        let limits = c
            .resources
            .clone()
            .and_then(|r| r.limits)
            .unwrap_or_default();
        assert_eq!(
            limits.get("amd.com/gpu").map(|q| q.0.as_str()),
            Some("1"),
            "{name}"
        );
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == "model")
            .cloned();
        assert_eq!(mount.and_then(|m| m.read_only), Some(true), "{name}");
        let svc = env
            .api::<Service>()
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let port = svc.spec.and_then(|s| s.ports).unwrap_or_default();
        assert_eq!(
            (port[0].port, port[0].name.as_deref()),
            (8000, Some("http")),
            "{name}"
        );
        // Metrics: 1 for the current phase, 0 for the others.
        let get = |p: &str| {
            env.metrics
                .model_phase
                .with_label_values(&[*name, env.ns.name.as_str(), p])
                .get()
        };
        assert_eq!(get("Ready"), 1, "{name}");
        assert_eq!(
            get("Pending") + get("Loading") + get("Idle") + get("Failed"),
            0,
            "{name}"
        );
    }
    // Backend-specific arguments.
    let d = env
        .api::<Deployment>()
        .get("vllm-m")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let c = container(&d);
    for (flag, want) in [
        ("--max-model-len", "4096"),
        ("--kv-cache-dtype", "fp8"),
        ("--gpu-memory-utilization", "0.9"),
        ("--max-num-batched-tokens", "512"),
        ("--model", "/models/model"),
    ] {
        assert_eq!(arg_after(&c, flag).as_deref(), Some(want), "vllm {flag}");
    }
    assert_eq!(
        arg_after(&c, "--quantization"),
        None,
        "vLLM reads the quantization method from the checkpoint"
    );
    assert!(c
        .env
        .iter()
        .flatten()
        .any(|e| e.name == "VLLM_ATTENTION_BACKEND" && e.value.as_deref() == Some("TRITON_ATTN")));
    assert!(
        c.env
            .iter()
            .flatten()
            .any(|e| e.name == "HSA_OVERRIDE_GFX_VERSION"),
        "GPUProfile env"
    );
    assert_eq!(
        c.image.as_deref(),
        Some("registry.example.com/flexinfer/runtime:vllm-rocm-gfx1100"),
        "GPUProfile image"
    );
    let c = container(
        &env.api::<Deployment>()
            .get("llama-m")
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    assert_eq!(
        arg_after(&c, "--model").as_deref(),
        Some("/models/m-q4_k_m.gguf")
    );
    assert_eq!(arg_after(&c, "--ctx-size").as_deref(), Some("8192"));
    assert_eq!(
        c.image.as_deref(),
        Some(
            format!(
                "ghcr.io/flexinfer/flexinfer-llamacpp:{}-rocm",
                env!("CARGO_PKG_VERSION")
            )
            .as_str()
        ),
        "the table: FlexInfer's ROCm llama.cpp image on gfx1100"
    );
    let c = container(
        &env.api::<Deployment>()
            .get("ollama-m")
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    assert!(c
        .env
        .iter()
        .flatten()
        .any(|e| e.name == "OLLAMA_HOST" && e.value.as_deref() == Some("0.0.0.0:8000")));
    assert_eq!(
        c.image.as_deref(),
        Some("docker.io/ollama/ollama:0.12.6-rocm")
    );
    let c = container(
        &env.api::<Deployment>()
            .get("exl2-m")
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    assert_eq!(arg_after(&c, "--max-seq-len").as_deref(), Some("4096"));

    // Idle: scale-to-zero with no traffic.
    let m = env
        .wait_model("idle-m", "phase Idle", phase_is(ModelPhase::Idle))
        .await;
    assert!(cond(&m, types::READY).is_some_and(|c| c.status == "True" && c.reason == "Idle"));
    let d = env
        .api::<Deployment>()
        .get("idle-m")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(replicas(&d), Some(0));
    // Traffic (lastActiveTime written by the proxy) scales it up.
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    env.api::<Model>()
        .patch_status(
            "idle-m",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"lastActiveTime": now}})),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    env.wait_model(
        "idle-m",
        "phase Ready after activity",
        phase_is(ModelPhase::Ready),
    )
    .await;
    // Once idleTimeout has passed since the last activity it scales back to zero by itself.
    env.api::<Model>()
        .patch(
            "idle-m",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"serverless": {"idleTimeout": "3s"}}})),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    env.wait_model(
        "idle-m",
        "phase Idle after idleTimeout",
        phase_is(ModelPhase::Idle),
    )
    .await;
    let d = env
        .api::<Deployment>()
        .get("idle-m")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(replicas(&d), Some(0));

    // Pending: nowhere to schedule.
    let m = env
        .wait_model("nowhere-m", "phase Pending", phase_is(ModelPhase::Pending))
        .await;
    assert!(cond(&m, types::READY).is_some_and(|c| c.status == "False" && c.reason == "Pending"));

    // Loading: the pod is bound but not ready (the backend is still loading weights).
    let pods = env
        .api::<Pod>()
        .list(&ListParams::default().labels("flexinfer.ai/model=vllm-m"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let pod = pods
        .items
        .first()
        .cloned()
        .unwrap_or_else(|| panic!("no pod for vllm-m"));
    let mut pod_conds = pod
        .status
        .clone()
        .and_then(|s| s.conditions)
        .unwrap_or_default();
    for c in pod_conds
        .iter_mut()
        .filter(|c| c.type_ == "Ready" || c.type_ == "ContainersReady")
    {
        c.status = "False".into();
    }
    env.api::<Pod>()
        .patch_status(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": pod_conds}})),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let m = env
        .wait_model("vllm-m", "phase Loading", phase_is(ModelPhase::Loading))
        .await;
    assert!(cond(&m, types::READY).is_some_and(|c| c.status == "False" && c.reason == "Loading"));
    assert_eq!(m.status.and_then(|s| s.replicas), Some(0));
    assert_eq!(
        env.metrics
            .model_phase
            .with_label_values(&["vllm-m", env.ns.name.as_str(), "Loading"])
            .get(),
        1
    );
    // The transition is counted once its status is written (after the write returns, so a watcher
    // may see the status a moment before the counter moves).
    let counted = || {
        env.metrics
            .model_phase_transitions_total
            .with_label_values(&["vllm-m", env.ns.name.as_str(), "Ready", "Loading"])
            .get()
    };
    wait_for(
        "the Ready -> Loading transition to be counted",
        Duration::from_secs(10),
        || {
            let n = counted();
            async move { (n >= 1).then_some(()) }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(env.metrics.render().contains("flexinfer_model_phase{"));

    // Events on phase changes.
    let phase_event = |needle: &'static str| {
        move |e: &Event| {
            e.reason.as_deref() == Some(reasons::PHASE_CHANGED)
                && e.note.as_deref().is_some_and(|n| n.contains(needle))
        }
    };
    env.wait_event("vllm-m", "PhaseChanged -> Ready", phase_event("-> Ready"))
        .await;
    env.wait_event(
        "vllm-m",
        "PhaseChanged Ready -> Loading",
        phase_event("Ready -> Loading"),
    )
    .await;
    env.cleanup().await;
}

#[tokio::test]
async fn model_cache_not_ready_ready_requantized() {
    let mut env = TestEnv::new("mdl-cache").await;
    env.pvc("cache-pvc").await;
    // vLLM serves on gfx1100 (it has no gfx906 kernels: a gfx906 profile would refuse the Model).
    env.apply::<GPUProfile>(example("gpuprofile-gfx1100.yaml"))
        .await;
    env.apply::<ModelCache>(json!({"apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "llm"}, "spec": {"source": "org/llm", "quantization": {"format": "GPTQ"}}})).await;
    env.apply::<Model>(model_json(
        "llm",
        &[],
        json!({"backend": "vllm", "source": "modelcache://llm",
        "gpu": {"profile": "gfx1100"}, "serverless": {"minReplicas": 1}}),
    ))
    .await;

    let m = env
        .wait_model(
            "llm",
            "Cached=False CacheNotReady",
            cond_is(types::CACHED, "False", "CacheNotReady"),
        )
        .await;
    assert_eq!(
        m.status.as_ref().and_then(|s| s.phase),
        Some(ModelPhase::Pending)
    );
    assert!(
        env.api::<Deployment>()
            .get_opt("llm")
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_none(),
        "nothing deployed before the cache is Ready"
    );

    let set_cache = |phase: &'static str, path: &'static str| {
        let api = env.api::<ModelCache>();
        async move {
            api.patch_status(
                "llm",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": phase, "path": path}})),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        }
    };
    set_cache("Ready", "cache-pvc:llm/gptq-w4-g128").await;
    let m = env
        .wait_model("llm", "phase Ready", phase_is(ModelPhase::Ready))
        .await;
    assert!(cond(&m, types::CACHED).is_some_and(|c| c.status == "True" && c.reason == "CacheReady"));
    assert_eq!(
        m.status.as_ref().and_then(|s| s.served_path.as_deref()),
        Some("cache-pvc:llm/gptq-w4-g128")
    );
    let d = env
        .api::<Deployment>()
        .get("llm")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let c = container(&d);
    assert_eq!(
        arg_after(&c, "--quantization"),
        None,
        "the ModelCache's format is checked, not passed: vLLM reads it from the checkpoint"
    );
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "model")
        .cloned()
        .unwrap_or_else(|| panic!("no mount"));
    assert_eq!(mount.sub_path.as_deref(), Some("llm/gptq-w4-g128"));
    let limits = c.resources.and_then(|r| r.limits).unwrap_or_default();
    assert!(limits.contains_key("amd.com/gpu"));

    // Requantization in progress: keep serving the previous artifact.
    set_cache("Quantizing", "cache-pvc:llm/gptq-w4-g128").await;
    let m = env
        .wait_model(
            "llm",
            "Cached=False while requantizing",
            cond_is(types::CACHED, "False", "CacheNotReady"),
        )
        .await;
    assert!(cond(&m, types::CACHED).is_some_and(|c| c.message.contains("previous artifact")));
    let d = env
        .api::<Deployment>()
        .get("llm")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(replicas(&d), Some(1));

    // Requantization finished with a new path: the Deployment rolls to it.
    set_cache("Ready", "cache-pvc:llm/gptq-w4-g64").await;
    let d = env
        .wait_deployment("llm", "rollout to the new artifact", |d| {
            let annos = d
                .spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.annotations.clone())
                .unwrap_or_default();
            annos.get(annotations::SERVED_PATH).map(String::as_str)
                == Some("cache-pvc:llm/gptq-w4-g64")
                && d.status.as_ref().and_then(|s| s.updated_replicas) == Some(1)
                && d.status.as_ref().and_then(|s| s.ready_replicas) == Some(1)
        })
        .await;
    let mount = container(&d)
        .volume_mounts
        .into_iter()
        .flatten()
        .find(|m| m.name == "model");
    assert_eq!(
        mount.and_then(|m| m.sub_path).as_deref(),
        Some("llm/gptq-w4-g64")
    );
    let m = env
        .wait_model("llm", "Ready on the new artifact", |m| {
            phase_is(ModelPhase::Ready)(m)
                && m.status.as_ref().and_then(|s| s.served_path.as_deref())
                    == Some("cache-pvc:llm/gptq-w4-g64")
        })
        .await;
    assert!(cond(&m, types::CACHED).is_some_and(|c| c.status == "True"));
    env.cleanup().await;
}

#[tokio::test]
async fn model_promotion_gate_cases() {
    let mut env = TestEnv::new("mdl-gate").await;
    env.pvc("w").await;
    env.apply::<GPUProfile>(example("gpuprofile-gfx1100.yaml"))
        .await;
    // The Gemma4 primary/canary Models, as shipped under deploy/examples.
    env.apply::<ModelCache>(example("modelcache-gemma4-31b-gptq.yaml"))
        .await;
    env.api::<ModelCache>()
        .patch_status("gemma4-31b-gptq", &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Ready", "path": "gemma4-31b-gptq:gemma4-31b-gptq/gptq-w4-g128-keqv"}})))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for f in [
        "model-gemma4-31b-gptq.yaml",
        "model-gemma4-26b-a4b-gptq-long.yaml",
        "model-gemma4-31b-gptq-fp8kv-canary.yaml",
    ] {
        env.apply::<Model>(example(f)).await;
    }
    let gate = |reason: &'static str| cond_is(types::PROMOTION_GATE, "True", reason);
    let m = env
        .wait_model(
            "gemma4-31b-gptq",
            "PromotionGate Validated",
            gate("Validated"),
        )
        .await;
    let d = env
        .api::<Deployment>()
        .get("gemma4-31b-gptq")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        replicas(&d),
        Some(1),
        "validated warm primary keeps a replica"
    );
    let c = container(&d);
    assert_eq!(arg_after(&c, "--max-model-len").as_deref(), Some("2048"));
    assert_eq!(
        arg_after(&c, "--gpu-memory-utilization").as_deref(),
        Some("0.95")
    );
    assert_eq!(
        arg_after(&c, "--kv-cache-dtype").as_deref(),
        Some("float16")
    );
    assert!(cond(&m, types::CACHED).is_some_and(|c| c.status == "True"));
    env.wait_model(
        "gemma4-26b-a4b-gptq-long",
        "PromotionGate Canary",
        gate("Canary"),
    )
    .await;
    let m = env
        .wait_model(
            "gemma4-26b-a4b-gptq-long",
            "Idle canary",
            phase_is(ModelPhase::Idle),
        )
        .await;
    assert!(cond(&m, types::PROMOTION_GATE).is_some_and(|c| c.reason == "Canary"));
    let d = env
        .api::<Deployment>()
        .get("gemma4-26b-a4b-gptq-long")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(replicas(&d), Some(0));
    let c = container(&d);
    for (flag, want) in [
        ("--max-model-len", "16384"),
        ("--kv-cache-dtype", "fp8_e4m3"),
        ("--max-num-batched-tokens", "160"),
        ("--gpu-memory-utilization", "0.98"),
    ] {
        assert_eq!(arg_after(&c, flag).as_deref(), Some(want), "{flag}");
    }
    let annos = d
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.annotations.clone())
        .unwrap_or_default();
    assert_eq!(
        annos.get(annotations::GPU_PRIORITY).map(String::as_str),
        Some("255")
    );
    env.wait_model(
        "gemma4-31b-gptq-fp8kv-canary",
        "PromotionGate Canary",
        gate("Canary"),
    )
    .await;
    env.wait_model(
        "gemma4-31b-gptq-fp8kv-canary",
        "Idle",
        phase_is(ModelPhase::Idle),
    )
    .await;

    // Gate cases of docs/user/promotion-gate.md on GPUs of the sm89 node (no profile: vendor given).
    let gated = [(annotations::PROMOTION_GATE, annotations::PROMOTION_GATE_V1)];
    let base = |extra: Value| {
        let mut s = json!({"backend": "vllm", "source": "pvc://w/x", "gpu": {"vendor": "nvidia"},
            "nodeSelector": {"kubernetes.io/hostname": "kwok-sm89"}});
        if let (Some(s), Some(e)) = (s.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                s.insert(k.clone(), v.clone());
            }
        }
        s
    };
    env.apply::<Model>(model_json(
        "ungated",
        &[],
        base(json!({"serverless": {"minReplicas": 1}})),
    ))
    .await;
    env.apply::<Model>(model_json("canary", &gated, base(json!({}))))
        .await;
    env.apply::<Model>(model_json(
        "blocked-min",
        &gated,
        base(json!({"serverless": {"minReplicas": 1}})),
    ))
    .await;
    env.apply::<Model>(model_json(
        "blocked-off",
        &gated,
        base(json!({"serverless": {"enabled": false}})),
    ))
    .await;
    env.apply::<Model>(model_json(
        "blocked-primary",
        &gated,
        base(json!({"config": {"warmPolicy": "primary"}})),
    ))
    .await;

    let m = env
        .wait_model("ungated", "Ready", phase_is(ModelPhase::Ready))
        .await;
    assert!(cond(&m, types::PROMOTION_GATE).is_none());
    env.wait_model("canary", "Canary", gate("Canary")).await;
    for name in ["blocked-min", "blocked-off", "blocked-primary"] {
        let m = env
            .wait_model(
                name,
                "PromotionGate Blocked",
                cond_is(types::PROMOTION_GATE, "False", "Blocked"),
            )
            .await;
        let msg = cond(&m, types::PROMOTION_GATE)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        assert!(
            msg.contains(annotations::PROMOTION_VALIDATION)
                && msg.contains(annotations::PROMOTION_EVIDENCE),
            "{name}: {msg}"
        );
        let m = env
            .wait_model(name, "runs as an Idle canary", phase_is(ModelPhase::Idle))
            .await;
        assert!(cond(&m, types::PROMOTION_GATE).is_some_and(|c| c.reason == "Blocked"));
        let d = env
            .api::<Deployment>()
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            replicas(&d),
            Some(0),
            "{name}: a blocked promotion scales to zero"
        );
        let ev = env
            .wait_event(name, "PromotionBlocked", |e| {
                e.reason.as_deref() == Some(reasons::PROMOTION_BLOCKED)
            })
            .await;
        assert_eq!(ev.type_.as_deref(), Some("Warning"));
        assert!(
            ev.note
                .as_deref()
                .is_some_and(|n| n.contains(annotations::PROMOTION_VALIDATION)),
            "{:?}",
            ev.note
        );
    }
    // Validation and evidence lift the block.
    let annotate = |name: &'static str, key: &'static str, value: Value| {
        let api = env.api::<Model>();
        async move {
            api.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {key: value}}})),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        }
    };
    annotate(
        "blocked-min",
        annotations::PROMOTION_VALIDATION,
        json!("passed"),
    )
    .await;
    annotate(
        "blocked-off",
        annotations::PROMOTION_EVIDENCE,
        json!("docs/user/promotion-gate.md#run-1"),
    )
    .await;
    annotate("blocked-primary", annotations::PROMOTION_GATE, Value::Null).await;
    for name in ["blocked-min", "blocked-off"] {
        env.wait_model(name, "PromotionGate Validated", gate("Validated"))
            .await;
        env.wait_model(name, "Ready as warm primary", phase_is(ModelPhase::Ready))
            .await;
        let d = env
            .api::<Deployment>()
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ready_replicas(&d), 1, "{name}");
    }
    // Ungating removes the stale condition.
    let m = env
        .wait_model("blocked-primary", "no PromotionGate condition", |m| {
            m.status
                .as_ref()
                .is_some_and(|s| conditions::find(&s.conditions, types::PROMOTION_GATE).is_none())
        })
        .await;
    assert!(m.status.is_some());
    env.wait_model(
        "blocked-primary",
        "Ready as ungated primary",
        phase_is(ModelPhase::Ready),
    )
    .await;
    env.cleanup().await;
}

#[tokio::test]
async fn model_bad_input_is_reported_not_crashlooped() {
    let env = TestEnv::new("mdl-bad").await;
    let amd = json!({"vendor": "amd"});
    env.apply::<Model>(model_json("gguf-on-vllm", &[], json!({"backend": "vllm", "source": "pvc://m/x.gguf", "gpu": amd, "config": {"quantization": "gguf"}}))).await;
    env.apply::<Model>(model_json("exl2-on-ollama", &[], json!({"backend": "ollama", "source": "pvc://m/x", "gpu": amd, "config": {"quantization": "exl2"}}))).await;
    env.apply::<Model>(model_json(
        "no-cache",
        &[],
        json!({"backend": "vllm", "source": "modelcache://nope", "gpu": amd}),
    ))
    .await;
    env.apply::<Model>(model_json(
        "no-profile",
        &[],
        json!({"backend": "vllm", "source": "pvc://m/x", "gpu": {"profile": "late"}}),
    ))
    .await;
    env.apply::<Model>(model_json(
        "abs-path",
        &[],
        json!({"backend": "vllm", "source": "pvc://m//etc/passwd", "gpu": amd}),
    ))
    .await;
    env.apply::<Model>(model_json(
        "cuda-on-amd",
        &[],
        json!({"backend": "vllm", "source": "pvc://m/x", "gpu": amd,
               "image": "docker.io/vllm/vllm-openai:v0.18.0"}),
    ))
    .await;

    for name in ["gguf-on-vllm", "exl2-on-ollama"] {
        let m = env
            .wait_model(
                name,
                "ConfigValid=False BackendUnsupported",
                cond_is(types::CONFIG_VALID, "False", "BackendUnsupported"),
            )
            .await;
        assert_eq!(
            m.status.as_ref().and_then(|s| s.phase),
            Some(ModelPhase::Failed)
        );
        assert!(
            env.api::<Deployment>()
                .get_opt(name)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .is_none(),
            "{name}: nothing deployed"
        );
        assert!(
            env.api::<Service>()
                .get_opt(name)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .is_none(),
            "{name}: nothing deployed"
        );
    }
    let m = env
        .wait_model(
            "no-cache",
            "Cached=False CacheNotFound",
            cond_is(types::CACHED, "False", "CacheNotFound"),
        )
        .await;
    assert_eq!(
        m.status.as_ref().and_then(|s| s.phase),
        Some(ModelPhase::Pending)
    );
    assert!(cond(&m, types::CACHED).is_some_and(|c| c.message.contains("nope")));
    let m = env
        .wait_model(
            "no-profile",
            "ConfigValid=False GPUProfileNotFound",
            cond_is(types::CONFIG_VALID, "False", "GPUProfileNotFound"),
        )
        .await;
    assert!(cond(&m, types::CONFIG_VALID).is_some_and(|c| c.message.contains("late")));
    let m = env
        .wait_model(
            "abs-path",
            "ConfigValid=False InvalidSource",
            cond_is(types::CONFIG_VALID, "False", "InvalidSource"),
        )
        .await;
    assert!(
        cond(&m, types::CONFIG_VALID).is_some_and(|c| c.message.contains("absolute")),
        "{:?}",
        cond(&m, types::CONFIG_VALID)
    );
    assert!(env
        .api::<Deployment>()
        .get_opt("abs-path")
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_none());

    // Another vendor's image: ConfigValid=False, a Warning Event naming the field and the fix,
    // nothing deployed.
    let m = env
        .wait_model(
            "cuda-on-amd",
            "ConfigValid=False ImageVendorMismatch",
            cond_is(types::CONFIG_VALID, "False", "ImageVendorMismatch"),
        )
        .await;
    assert_eq!(
        m.status.as_ref().and_then(|s| s.phase),
        Some(ModelPhase::Failed)
    );
    let ev = env
        .wait_event("cuda-on-amd", "ImageVendorMismatch", |e| {
            e.reason.as_deref() == Some("ImageVendorMismatch")
        })
        .await;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    assert!(
        ev.note
            .as_deref()
            .is_some_and(|n| n.contains("spec.image") && n.contains("vllm-openai-rocm")),
        "{:?}",
        ev.note
    );
    assert!(env
        .api::<Deployment>()
        .get_opt("cuda-on-amd")
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_none());

    // The CRD rejects what it can at admission, naming the field.
    let err = env
        .api::<Model>()
        .patch("dotdot", &PatchParams::apply(MANAGER), &Patch::Apply(json!({"apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
            "metadata": {"name": "dotdot", "namespace": env.ns.name}, "spec": {"backend": "vllm", "source": "pvc://m/../etc"}})))
        .await
        .err()
        .unwrap_or_else(|| panic!("pvc:// with '..' was admitted"));
    assert!(err.to_string().contains("spec.source"), "{err}");

    // No status churn: reconciles of a settled invalid Model write nothing (the other Models of
    // this namespace, requeued with backoff, count too; the nudges make this one due at once).
    let reconciles = || {
        let text = env.metrics.render();
        async move { flexinfer_e2e::reconciles_total(&text, "model") }
    };
    flexinfer_e2e::assert_no_status_churn(
        &env.api::<Model>(),
        "gguf-on-vllm",
        "model",
        3,
        reconciles,
    )
    .await
    .unwrap_or_else(|e| panic!("status rewritten without a change: {e:#}"));

    // A deleted Model leaves no metric series behind.
    assert!(env.metrics.render().contains("model=\"exl2-on-ollama\""));
    env.api::<Model>()
        .delete("exl2-on-ollama", &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "the metrics of the deleted Model to go",
        Duration::from_secs(30),
        || {
            let kept = env.metrics.render().contains("model=\"exl2-on-ollama\"");
            async move { (!kept).then_some(()) }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));

    // Fixing the input recovers without a restart: the missing GPUProfile appears.
    let mut profile = example("gpuprofile-gfx1100.yaml");
    profile["metadata"]["name"] = json!("late");
    env.apply::<GPUProfile>(profile).await;
    let m = env
        .wait_model(
            "no-profile",
            "deployed once the GPUProfile exists",
            phase_is(ModelPhase::Idle),
        )
        .await;
    assert!(cond(&m, types::CONFIG_VALID).is_some_and(|c| c.status == "True"));
    assert!(env
        .api::<Deployment>()
        .get_opt("no-profile")
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_some());
    // ... and the missing ModelCache appears (not Ready yet).
    env.apply::<ModelCache>(
        json!({"apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "nope"}, "spec": {"source": "org/nope"}}),
    )
    .await;
    env.wait_model(
        "no-cache",
        "Cached=False CacheNotReady",
        cond_is(types::CACHED, "False", "CacheNotReady"),
    )
    .await;
    env.cleanup().await;
}

/// A Model named like an existing Deployment and Service it does not control
/// leaves them alone (no server-side apply, no owner reference, so no garbage collection when the
/// Model goes), and says so in its Ready condition and a Warning Event.
#[tokio::test]
async fn model_leaves_foreign_objects_alone() {
    let env = TestEnv::new("mdl-foreign").await;
    let web = json!({"app": "web"});
    // The selector and strategy the controller would render, so a forced apply would succeed (and
    // take the Deployment over, as a controller that did not check ownership would).
    let selector = json!({labels::INSTANCE: "taken", labels::MODEL: "taken"});
    env.apply::<Deployment>(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "taken", "labels": web},
        "spec": {"replicas": 0, "selector": {"matchLabels": selector}, "strategy": {"type": "Recreate"},
                 "template": {"metadata": {"labels": selector},
                              "spec": {"containers": [{"name": "web", "image": "registry.example.com/web:1"}]}}}
    }))
    .await;
    env.apply::<Service>(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "taken", "labels": web},
        "spec": {"selector": web, "ports": [{"name": "web", "port": 80, "targetPort": 8080}]}
    }))
    .await;
    // Let the Deployment controller finish its own status writes before taking the snapshot.
    let dep_before = env
        .wait_deployment("taken", "settled by the Deployment controller", |d| {
            let st = d.status.clone().unwrap_or_default();
            st.observed_generation == d.metadata.generation
                && st.conditions.iter().flatten().any(|c| {
                    c.type_ == "Progressing"
                        && c.reason.as_deref() == Some("NewReplicaSetAvailable")
                })
                && st
                    .conditions
                    .iter()
                    .flatten()
                    .any(|c| c.type_ == "Available")
        })
        .await;
    let svc_before = env
        .api::<Service>()
        .get("taken")
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let spec = |extra: Value| {
        let mut s = json!({"backend": "vllm", "source": "pvc://w/x", "gpu": {"vendor": "nvidia"},
            "nodeSelector": {"kubernetes.io/hostname": "kwok-sm89"}, "serverless": {"minReplicas": 1}});
        if let (Some(s), Some(e)) = (s.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                s.insert(k.clone(), v.clone());
            }
        }
        s
    };
    env.apply::<Model>(model_json("taken", &[], spec(json!({}))))
        .await;
    // A Model with children of its own: their garbage collection shows when GC has run.
    env.apply::<Model>(model_json(
        "mine",
        &[],
        spec(json!({"serverless": {"minReplicas": 0}})),
    ))
    .await;

    let m = env
        .wait_model(
            "taken",
            "Ready=False ResourceConflict",
            cond_is(types::READY, "False", "ResourceConflict"),
        )
        .await;
    assert_eq!(
        m.status.as_ref().and_then(|s| s.phase),
        Some(ModelPhase::Failed)
    );
    let msg = cond(&m, types::READY)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        msg.contains("Deployment taken") && msg.contains("has no owner"),
        "{msg}"
    );
    let ev = env
        .wait_event("taken", "ResourceConflict", |e| {
            e.reason.as_deref() == Some("ResourceConflict")
        })
        .await;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    assert!(
        ev.note
            .as_deref()
            .is_some_and(|n| n.contains("Deployment taken")),
        "{:?}",
        ev.note
    );
    env.wait_deployment("mine", "created", |_| true).await;
    env.wait_object(
        "mine",
        "Service created",
        |_: &Service| true,
        |s: Option<Service>| format!("{s:?}"),
    )
    .await;

    let untouched = |what: &str, dep: &Deployment, svc: &Service| {
        assert_eq!(
            dep.resource_version(),
            dep_before.resource_version(),
            "{what}: Deployment written"
        );
        assert_eq!(dep.spec, dep_before.spec, "{what}: Deployment spec changed");
        assert_eq!(dep.metadata.owner_references, None, "{what}");
        assert_eq!(
            svc.resource_version(),
            svc_before.resource_version(),
            "{what}: Service written"
        );
        assert_eq!(svc.spec, svc_before.spec, "{what}: Service spec changed");
        assert_eq!(svc.metadata.owner_references, None, "{what}");
        for managed in [&dep.metadata.managed_fields, &svc.metadata.managed_fields] {
            assert!(
                !managed
                    .iter()
                    .flatten()
                    .any(|f| f.manager.as_deref() == Some(FIELD_MANAGER)),
                "{what}: the controller manages fields of a foreign object"
            );
        }
    };
    let get = || async {
        let d = env.api::<Deployment>().get("taken").await;
        let s = env.api::<Service>().get("taken").await;
        (
            d.unwrap_or_else(|e| panic!("foreign Deployment: {e}")),
            s.unwrap_or_else(|e| panic!("foreign Service: {e}")),
        )
    };
    let (d, s) = get().await;
    untouched("after the Model was reconciled", &d, &s);

    // Deleting the Models: "mine"'s children are collected, the foreign objects stay.
    for name in ["taken", "mine"] {
        env.api::<Model>()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("delete {name}: {e}"));
    }
    wait_for(
        "the owned children of the deleted Model to be garbage collected",
        WAIT,
        || {
            let (deployments, services) = (env.api::<Deployment>(), env.api::<Service>());
            async move {
                let gone = deployments
                    .get_opt("mine")
                    .await
                    .unwrap_or_else(|e| panic!("{e}"))
                    .is_none()
                    && services
                        .get_opt("mine")
                        .await
                        .unwrap_or_else(|e| panic!("{e}"))
                        .is_none();
                gone.then_some(())
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let (d, s) = get().await;
    untouched("after the Model was deleted", &d, &s);
    env.cleanup().await;
}

/// A validation covers the artifact it was accepted for: a re-quantization that promotes a new
/// artifact (new `configDigest`) closes the gate again until the evidence names the new digest.
#[tokio::test]
async fn model_gate_closes_when_the_cache_promotes_a_new_artifact() {
    const D1: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const D2: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
    let mut env = TestEnv::new("mdl-bind").await;
    env.pvc("cache-pvc").await;
    env.apply::<ModelCache>(json!({"apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "llm"}, "spec": {"source": "org/llm", "quantization": {"format": "GPTQ"}}}))
        .await;
    let set_digest = |digest: &'static str, path: &'static str| {
        let api = env.api::<ModelCache>();
        async move {
            api.patch_status(
                "llm",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Ready", "path": path,
                    "quantization": {"configDigest": digest}}})),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        }
    };
    set_digest(D1, "cache-pvc:llm/gptq.1").await;
    env.apply::<Model>(model_json(
        "llm",
        &[
            (annotations::PROMOTION_GATE, annotations::PROMOTION_GATE_V1),
            (annotations::PROMOTION_VALIDATION, "passed"),
        ],
        json!({"backend": "vllm", "source": "modelcache://llm", "gpu": {"vendor": "amd"},
               "serverless": {"minReplicas": 1}}),
    ))
    .await;
    let recorded = |m: &Model| m.status.as_ref().and_then(|s| s.validated_artifact.clone());
    let m = env
        .wait_model(
            "llm",
            "Validated for D1",
            cond_is(types::PROMOTION_GATE, "True", "Validated"),
        )
        .await;
    assert_eq!(recorded(&m).as_deref(), Some(D1));
    env.wait_deployment("llm", "warm (1 replica)", |d| replicas(d) == Some(1))
        .await;

    // A new artifact: the gate closes, the Model becomes a canary (0 replicas without demand).
    set_digest(D2, "cache-pvc:llm/gptq.2").await;
    let m = env
        .wait_model(
            "llm",
            "Blocked on D2",
            cond_is(types::PROMOTION_GATE, "False", "Blocked"),
        )
        .await;
    let msg = cond(&m, types::PROMOTION_GATE)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(msg.contains(D1) && msg.contains(D2), "{msg}");
    assert_eq!(recorded(&m).as_deref(), Some(D1), "kept while closed");
    env.wait_deployment("llm", "canary (0 replicas)", |d| replicas(d) == Some(0))
        .await;

    // Evidence naming the new digest promotes it.
    env.api::<Model>()
        .patch(
            "llm",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                annotations::PROMOTION_EVIDENCE: format!("eval run 3 sha256:{D2}")}}})),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let m = env
        .wait_model(
            "llm",
            "Validated for D2",
            cond_is(types::PROMOTION_GATE, "True", "Validated"),
        )
        .await;
    assert_eq!(recorded(&m).as_deref(), Some(D2));
    env.wait_deployment("llm", "warm again", |d| replicas(d) == Some(1))
        .await;
    env.cleanup().await;
}

/// The controller's status write is conditional on the resourceVersion it planned from: a plan
/// made from a stale object cannot overwrite a newer status (e.g. take back `validatedArtifact`).
#[tokio::test]
async fn model_status_write_from_a_stale_object_is_refused() {
    use flexinfer_controller::model::{write_status, Error as ModelError};
    let env = TestEnv::new("mdl-stale").await;
    // No controller: the write itself is under test, and nothing else may write the status.
    env.controller.abort();
    let api = env.api::<Model>();
    let created = api
        .create(
            &Default::default(),
            &serde_json::from_value(model_json(
                "s",
                &[],
                json!({"backend": "vllm", "source": "pvc://c/p"}),
            ))
            .unwrap_or_else(|e| panic!("{e}")),
        )
        .await
        .unwrap_or_else(|e| panic!("create: {e}"));
    let stale_rv = created.resource_version();
    let newer = flexinfer_api::ModelStatus {
        phase: Some(ModelPhase::Ready),
        validated_artifact: Some("sha256:new".into()),
        ..Default::default()
    };
    write_status(&api, "s", stale_rv.as_deref(), &newer)
        .await
        .unwrap_or_else(|e| panic!("first write: {e}"));
    let older = flexinfer_api::ModelStatus {
        phase: Some(ModelPhase::Pending),
        validated_artifact: Some("sha256:old".into()),
        ..Default::default()
    };
    let r = write_status(&api, "s", stale_rv.as_deref(), &older).await;
    assert!(matches!(r, Err(ModelError::Conflict)), "{r:?}");
    let now = api.get("s").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        now.status.and_then(|s| s.validated_artifact).as_deref(),
        Some("sha256:new"),
        "the newer status stands"
    );
    env.cleanup().await;
}

/// The pods themselves, scheduled by the real scheduler onto the kwok GPU nodes, run the image of their GPU's
/// vendor and architecture when neither the Model nor its GPUProfile names one (docs/user/serving.md, "Image"):
/// llama.cpp on gfx906 and gfx1100 the ROCm flavor, vLLM on gfx1100 vLLM's ROCm build, ollama on AMD its `-rocm`
/// tag, CUDA builds only on the NVIDIA node; and a vLLM Model on gfx906 gets no pod at all
/// (`UnsupportedCombination`). (kwok runs no container: the image is the one the scheduled pod names.)
#[tokio::test]
async fn model_pods_on_each_gpu_run_the_vendor_right_image() {
    let mut env = TestEnv::new("mdl-images").await;
    env.pvc("models").await;
    for (name, arch, vendor, resource) in [
        ("gfx906", "gfx906", "amd", "amd.com/gpu"),
        ("gfx1100", "gfx1100", "amd", "amd.com/gpu"),
        ("sm89", "sm_89", "nvidia", "nvidia.com/gpu"),
    ] {
        env.apply::<GPUProfile>(json!({
            "apiVersion": "ai.flexinfer/v1alpha2", "kind": "GPUProfile", "metadata": {"name": name},
            "spec": {"architecture": arch, "vendor": vendor, "vramMB": 16384, "resourceName": resource,
                     "nodeSelector": {"flexinfer.ai/gpu.arch": arch}}}))
        .await;
    }
    let llama = format!(
        "ghcr.io/flexinfer/flexinfer-llamacpp:{}",
        env!("CARGO_PKG_VERSION")
    );
    let gguf = "pvc://models/gguf/m-q4_k_m.gguf";
    let cases: [(&str, &str, &str, &str, &str, String); 6] = [
        (
            "llama-gfx906",
            "llamacpp",
            gguf,
            "gfx906",
            "kwok-gfx906",
            format!("{llama}-rocm"),
        ),
        (
            "ollama-gfx906",
            "ollama",
            "pvc://models/gguf",
            "gfx906",
            "kwok-gfx906",
            "docker.io/ollama/ollama:0.12.6-rocm".into(),
        ),
        (
            "vllm-gfx1100",
            "vllm",
            "pvc://models/org/awq",
            "gfx1100",
            "kwok-gfx1100",
            "docker.io/vllm/vllm-openai-rocm:v0.18.0".into(),
        ),
        (
            "llama-gfx1100",
            "llamacpp",
            gguf,
            "gfx1100",
            "kwok-gfx1100",
            format!("{llama}-rocm"),
        ),
        (
            "vllm-sm89",
            "vllm",
            "pvc://models/org/awq",
            "sm89",
            "kwok-sm89",
            "docker.io/vllm/vllm-openai:v0.18.0".into(),
        ),
        (
            "llama-sm89",
            "llamacpp",
            gguf,
            "sm89",
            "kwok-sm89",
            "ghcr.io/ggml-org/llama.cpp:server-cuda-b11206".into(),
        ),
    ];
    for (name, backend, source, profile, _, _) in &cases {
        env.apply::<Model>(model_json(
            name,
            &[],
            json!({"backend": backend, "source": source,
            "gpu": {"profile": profile}, "serverless": {"enabled": false}}),
        ))
        .await;
    }
    env.apply::<Model>(model_json("vllm-gfx906", &[], json!({"backend": "vllm",
        "source": "pvc://models/org/awq", "gpu": {"profile": "gfx906"}, "serverless": {"enabled": false}})))
        .await;
    let pods = env.api::<Pod>();
    for (name, _, _, profile, node, image) in &cases {
        let deadline = tokio::time::Instant::now() + WAIT;
        let pod = loop {
            let list = pods
                .list(&ListParams::default().labels(&format!("{}={name}", labels::MODEL)))
                .await
                .unwrap_or_else(|e| panic!("list pods: {e}"));
            let running = list
                .items
                .iter()
                .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"));
            if let Some(p) = running {
                break p.clone();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name}: no running pod; pods: {:#?}",
                list.items
                    .iter()
                    .map(|p| (&p.metadata.name, &p.status))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let spec = pod.spec.clone().unwrap_or_default();
        let ran = spec.containers[0].image.clone().unwrap_or_default();
        assert_eq!(
            spec.node_name.as_deref(),
            Some(*node),
            "{name}: scheduled on"
        );
        assert_eq!(&ran, image, "{name}: the image its pod runs on {node}");
        if *profile != "sm89" {
            assert!(
                !ran.contains("cuda") && !ran.ends_with("vllm-openai:v0.18.0"),
                "{name}: an AMD pod runs a CUDA image {ran}"
            );
        }
    }
    let m = env
        .wait_model(
            "vllm-gfx906",
            "ConfigValid=False UnsupportedCombination",
            cond_is(
                types::CONFIG_VALID,
                "False",
                reasons::UNSUPPORTED_COMBINATION,
            ),
        )
        .await;
    assert!(
        env.api::<Deployment>()
            .get_opt("vllm-gfx906")
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_none(),
        "vLLM on gfx906 deployed: {:?}",
        m.status
    );
    env.cleanup().await;
}

/// A Model of a `storageStrategy: NodeLocal` cache runs only on a node labelled as holding the verified
/// copy of the published digest — here a kwok node that never mounted the cache's claim. Without the label
/// its pod stays unschedulable; once the node carries it, the scheduler places the pod there, with the
/// node's copy (a hostPath) as its model volume and no claim.
#[tokio::test]
async fn a_node_local_models_pod_lands_only_on_a_node_holding_the_copy() {
    use flexinfer_controller::modelcache::nodelocal::{label_key, label_value};
    use k8s_openapi::api::core::v1::Node;
    let env = TestEnv::new("mdl-nodelocal").await;
    env.apply::<GPUProfile>(json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "GPUProfile", "metadata": {"name": "gfx1100"},
        "spec": {"architecture": "gfx1100", "vendor": "amd", "vramMB": 24576, "resourceName": "amd.com/gpu",
                 "nodeSelector": {"flexinfer.ai/gpu.arch": "gfx1100"}}}))
    .await;
    env.apply::<ModelCache>(json!({"apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "nl"}, "spec": {"source": "org/llm", "quantization": {"format": "GGUF"},
        "storageStrategy": "NodeLocal", "nodeLocal": {"nodeSelector": {"flexinfer.ai/gpu.arch": "gfx1100"}},
        "publish": {"ociRef": "registry.example/models/nl:v1"}}}))
    .await;
    let hex = "c0".repeat(32);
    let digest = format!("sha256:{hex}");
    env.api::<ModelCache>()
        .patch_status(
            "nl",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Ready", "path": "nl-cache:nl/gguf-q4_k_m.g1/m-Q4_K_M.gguf",
                "nodeLocal": {"digest": digest, "readyNodes": 1, "selectedNodes": 1}}})),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    env.apply::<Model>(model_json(
        "nl",
        &[],
        json!({"backend": "llamacpp", "source": "modelcache://nl",
        "gpu": {"profile": "gfx1100"}, "serverless": {"enabled": false}}),
    ))
    .await;
    let pods = env.api::<Pod>();
    let sel = format!("{}=nl", labels::MODEL);
    let unschedulable = wait_for("the pod unschedulable", WAIT, || {
        let pods = pods.clone();
        let sel = sel.clone();
        async move {
            let list = pods.list(&ListParams::default().labels(&sel)).await.ok()?;
            list.items.into_iter().find(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| {
                        cs.iter().any(|c| {
                            c.type_ == "PodScheduled"
                                && c.status == "False"
                                && c.reason.as_deref() == Some("Unschedulable")
                        })
                    })
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        unschedulable
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .is_none(),
        "scheduled without a node holding the copy"
    );
    // The node's copy is verified: it gets the label, and the pod goes there.
    let key = label_key(&env.ns.name, "nl");
    let value = label_value(&digest).unwrap_or_default();
    let nodes: Api<Node> = Api::all(env.client.clone());
    let label = |v: Value| {
        let nodes = nodes.clone();
        let key = key.clone();
        async move {
            nodes
                .patch(
                    "kwok-gfx1100",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"labels": {key: v}}})),
                )
                .await
                .unwrap_or_else(|e| panic!("label the node: {e}"));
        }
    };
    label(json!(value)).await;
    let running = wait_for("the pod running on the labelled node", WAIT, || {
        let pods = pods.clone();
        let sel = sel.clone();
        async move {
            let list = pods.list(&ListParams::default().labels(&sel)).await.ok()?;
            list.items
                .into_iter()
                .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        }
    })
    .await;
    label(Value::Null).await;
    let pod = running.unwrap_or_else(|e| panic!("{e:#}"));
    let spec = pod.spec.clone().unwrap_or_default();
    assert_eq!(spec.node_name.as_deref(), Some("kwok-gfx1100"));
    assert_eq!(
        spec.node_selector.unwrap_or_default().get(&key),
        Some(&value)
    );
    let vols = spec.volumes.unwrap_or_default();
    let model_vol = vols
        .iter()
        .find(|v| v.name == "model")
        .expect("model volume");
    let want = format!("/var/lib/flexinfer/node-local/{}/nl/{hex}", env.ns.name);
    assert_eq!(
        model_vol.host_path.as_ref().map(|h| h.path.as_str()),
        Some(want.as_str())
    );
    assert!(
        vols.iter().all(|v| v.persistent_volume_claim.is_none()),
        "{vols:?}"
    );
    env.cleanup().await;
}
