//! The pieces the controller's integration tests share: the controller binary as a subprocess, a
//! test namespace with a GPUProfile and pre-bound PVs ([`World`]), small HTTP and port helpers.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use flexinfer_api::modelcache::{CachePhase, ModelCache};
use flexinfer_e2e::{
    apply, cleanup_off_runtime, client, reconciles_total, wait_for, yaml_docs, TestNamespace,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, PersistentVolume};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use tokio::process::{Child, Command};

pub const WAIT: Duration = Duration::from_secs(150);

pub use flexinfer_e2e::install_crds;

/// The controller as a subprocess; killed when dropped.
pub struct Controller {
    pub child: Child,
    pub log: PathBuf,
    /// Port of its `/metrics`.
    pub metrics_port: u16,
}

impl Controller {
    pub async fn start(ns: &str, extra: &[(&str, &str)]) -> Result<Self> {
        let log =
            std::env::temp_dir().join(format!("flexinfer-e2e-{ns}-{}.log", std::process::id()));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let err = out.try_clone()?;
        let metrics_addr = extra
            .iter()
            .find(|(k, _)| *k == "FLEXINFER_METRICS_ADDR")
            .map_or_else(
                || format!("127.0.0.1:{}", free_port()),
                |(_, v)| v.to_string(),
            );
        let metrics_port = metrics_addr
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .context("metrics port")?;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_flexinfer-controller"));
        cmd.env("FLEXINFER_WATCH_NAMESPACE", ns)
            .env("FLEXINFER_LEADER_ELECT", "false")
            .env("FLEXINFER_METRICS_ADDR", &metrics_addr)
            .env("FLEXINFER_HEALTH_ADDR", "127.0.0.1:0")
            .env("FLEXINFER_WORKER_IMAGE", "example.com/flexinfer/worker:cpu")
            .env("FLEXINFER_RETRY_BASE_SECONDS", "1")
            .env("FLEXINFER_PROGRESS_POLL_SECONDS", "2")
            // FLEXINFER_TEST_CONTROLLER_LOG overrides the controller's log filter (e.g. `debug,kube=info`).
            .env(
                "RUST_LOG",
                std::env::var("FLEXINFER_TEST_CONTROLLER_LOG")
                    .unwrap_or_else(|_| "info,kube=warn".into()),
            )
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .kill_on_drop(true);
        for (k, v) in extra {
            cmd.env(k, v);
        }
        Ok(Self {
            child: cmd.spawn()?,
            log,
            metrics_port,
        })
    }
    /// Its `flexinfer_reconciles_total{controller="modelcache"}` (0 while `/metrics` is not up).
    pub async fn reconciles(&self) -> u64 {
        http_get(self.metrics_port, "/metrics")
            .await
            .map_or(0, |(_, body)| reconciles_total(&body, "modelcache"))
    }
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
        let _ = self.child.wait().await;
    }
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// One test's world: namespace, a gfx1100 GPUProfile, PVs for its caches, the controller.
pub struct World {
    pub c: Client,
    pub ns: TestNamespace,
    pub pvs: Vec<String>,
}

impl World {
    pub async fn new(prefix: &str) -> Result<Self> {
        let c = client().await;
        install_crds(&c).await?;
        let ns = TestNamespace::new(&c, prefix).await?;
        let w = Self {
            c,
            ns,
            pvs: Vec::new(),
        };
        w.apply_yaml(&format!(
            r#"apiVersion: ai.flexinfer/v1alpha2
kind: GPUProfile
metadata: {{name: gfx1100, namespace: {ns}}}
spec:
  architecture: gfx1100
  vendor: amd
  gpuDriverMemoryMB: 1024
  quantization: {{images: {{GPTQ: "example.com/flexinfer/worker:rocm-gfx1100-a"}}}}
"#,
            ns = w.ns.name
        ))
        .await?;
        Ok(w)
    }
    pub fn name(&self) -> &str {
        &self.ns.name
    }
    pub async fn apply_yaml(&self, y: &str) -> Result<()> {
        for doc in yaml_docs(y)? {
            apply(&self.c, &doc, Some(&self.ns.name), false).await?;
        }
        Ok(())
    }
    /// A PV pre-bound to `claim` (nothing provisions volumes in the test cluster).
    pub async fn pv_for(&mut self, claim: &str) -> Result<()> {
        let name = format!("{}-{claim}", self.ns.name);
        let pv = serde_json::json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": name, "labels": {"flexinfer.ai/test": "true"}},
            "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                     "hostPath": {"path": "/tmp/flexinfer-e2e"},
                     "claimRef": {"namespace": self.ns.name, "name": claim}}
        });
        apply(&self.c, &pv, None, false).await?;
        self.pvs.push(name);
        Ok(())
    }
    pub async fn cache(&mut self, name: &str, spec: &str, annotations: &str) -> Result<()> {
        self.pv_for(&format!("{name}-cache")).await?;
        self.apply_yaml(&format!(
            "apiVersion: ai.flexinfer/v1alpha1\nkind: ModelCache\nmetadata:\n  name: {name}\n  annotations: {{{annotations}}}\nspec:\n{spec}"
        ))
        .await
    }
    pub fn caches(&self) -> Api<ModelCache> {
        Api::namespaced(self.c.clone(), self.name())
    }
    pub fn jobs(&self) -> Api<Job> {
        Api::namespaced(self.c.clone(), self.name())
    }
    pub async fn get(&self, name: &str) -> Option<ModelCache> {
        self.caches().get_opt(name).await.ok().flatten()
    }
    pub async fn wait_phase(
        &self,
        name: &str,
        phase: CachePhase,
        ctl: &Controller,
    ) -> Result<ModelCache> {
        let r = wait_for(&format!("{name} {phase:?}"), WAIT, || async {
            self.get(name)
                .await
                .filter(|m| m.status.as_ref().and_then(|s| s.phase) == Some(phase))
        })
        .await;
        let st = self.get(name).await.and_then(|m| m.status);
        r.with_context(|| format!("status: {st:?}\ncontroller log:\n{}", ctl.log_tail()))
    }
    pub async fn job(&self, name: &str) -> Option<Job> {
        self.jobs().get_opt(name).await.ok().flatten()
    }
    pub async fn events(&self, reason: &str) -> Vec<Event> {
        let api: Api<Event> = Api::namespaced(self.c.clone(), self.name());
        api.list(&ListParams::default())
            .await
            .map(|l| {
                l.items
                    .into_iter()
                    .filter(|e| e.reason.as_deref() == Some(reason))
                    .collect()
            })
            .unwrap_or_default()
    }
    pub async fn patch_cache(&self, name: &str, patch: serde_json::Value) -> Result<()> {
        self.caches()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }
}

impl Drop for World {
    /// Remove the PVs (the namespace goes with `self.ns` after this). Runs on its own thread and
    /// runtime with a fresh client: the test's runtime is shutting down. ModelCache finalizers are
    /// stripped first because the controller subprocess may already be gone.
    fn drop(&mut self) {
        let ns = self.ns.name.clone();
        let pvs = std::mem::take(&mut self.pvs);
        cleanup_off_runtime(move |c| async move {
            let caches: Api<ModelCache> = Api::namespaced(c.clone(), &ns);
            if let Ok(list) = caches.list(&ListParams::default()).await {
                for m in list.items {
                    let p = serde_json::json!({"metadata": {"finalizers": null}});
                    let _ = caches
                        .patch(&m.name_any(), &PatchParams::default(), &Patch::Merge(&p))
                        .await;
                }
            }
            let pvapi: Api<PersistentVolume> = Api::all(c);
            for pv in pvs {
                let _ = pvapi.delete(&pv, &DeleteParams::background()).await;
            }
        });
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.ok()?;
    let code = buf.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, buf))
}
