//! Shared helpers for the end-to-end tests. These tests talk to the real kube-apiserver started by
//! `scripts/testenv/up.sh` (through `make test`, which exports `KUBECONFIG` and
//! `FLEXINFER_TESTENV_DIR`). Run outside `make test` they fail with a message saying so.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers: a panic is the failure report

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{ApiCapabilities, ApiResource, Discovery, Scope};
use kube::{Client, Resource, ResourceExt};

/// Repository root (the `tests` crate lives one level below it).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// A client for the test control plane. Panics with instructions when no control plane is set up.
pub async fn client() -> Client {
    if std::env::var_os("KUBECONFIG").is_none() {
        panic!(
            "KUBECONFIG is not set: end-to-end tests need the local control plane. Run them with `make test` \
             (or `eval $(scripts/testenv/up.sh cluster)` first)."
        );
    }
    Client::try_default()
        .await
        .expect("cannot build a client from KUBECONFIG (is the test control plane running?)")
}

/// A namespace created for one test (labelled `flexinfer.ai/test=true`) and deleted (in the
/// background) when dropped, also when the test fails.
pub struct TestNamespace {
    pub name: String,
}

impl TestNamespace {
    /// Create `<prefix>-<random>`.
    pub async fn new(client: &Client, prefix: &str) -> Result<Self> {
        let suffix: u32 = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32).rotate_left(7))
            .unwrap_or(0)
            ^ std::process::id();
        let name = format!("{prefix}-{:08x}", suffix);
        let api: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {"flexinfer.ai/test": "true"}}
        }))?;
        api.create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("create namespace {name}"))?;
        Ok(Self { name })
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        let name = std::mem::take(&mut self.name);
        cleanup_off_runtime(move |client| async move {
            let api: Api<Namespace> = Api::all(client);
            let _ = api.delete(&name, &DeleteParams::background()).await;
        });
    }
}

/// Run `cleanup` to completion with a fresh client on a helper thread with its own runtime: from a
/// `Drop` of a test object the test's runtime is blocked (or already gone), so a task spawned on
/// it might never run. Does nothing when no client can be built.
pub fn cleanup_off_runtime<F, Fut>(cleanup: F)
where
    F: FnOnce(Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let helper = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async move {
            if let Ok(client) = Client::try_default().await {
                cleanup(client).await;
            }
        });
    });
    let _ = helper.join();
}

/// Parse a multi-document YAML string into JSON values (empty documents skipped).
pub fn yaml_docs(text: &str) -> Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let v: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

/// Resolve the API resource of a JSON object through discovery.
pub async fn resource_for(
    client: &Client,
    obj: &serde_json::Value,
) -> Result<(ApiResource, ApiCapabilities)> {
    let api_version = obj["apiVersion"]
        .as_str()
        .context("object without apiVersion")?;
    let kind = obj["kind"].as_str().context("object without kind")?;
    let (group, version) = match api_version.split_once('/') {
        Some((g, v)) => (g.to_string(), v.to_string()),
        None => (String::new(), api_version.to_string()),
    };
    let gvk = GroupVersionKind::gvk(&group, &version, kind);
    let discovery = Discovery::new(client.clone()).run().await?;
    match discovery.resolve_gvk(&gvk) {
        Some(r) => Ok(r),
        None => bail!("the API server does not serve {api_version}/{kind}"),
    }
}

fn dyn_api(
    client: &Client,
    ar: &ApiResource,
    caps: &ApiCapabilities,
    ns: Option<&str>,
) -> Api<DynamicObject> {
    match (caps.scope.clone(), ns) {
        (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client.clone(), ns, ar),
        (Scope::Namespaced, None) => Api::default_namespaced_with(client.clone(), ar),
        (Scope::Cluster, _) => Api::all_with(client.clone(), ar),
    }
}

/// Server-side apply (optionally dry-run) one object; `ns` overrides `metadata.namespace`.
pub async fn apply(
    client: &Client,
    obj: &serde_json::Value,
    ns: Option<&str>,
    dry_run: bool,
) -> Result<DynamicObject, kube::Error> {
    let (ar, caps) = resource_for(client, obj)
        .await
        .map_err(|e| kube::Error::Service(e.into()))?;
    let mut obj = obj.clone();
    if let Some(ns) = ns {
        obj["metadata"]["namespace"] = serde_json::Value::String(ns.to_string());
    }
    let name = obj["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let ns_eff = obj["metadata"]["namespace"].as_str().map(|s| s.to_string());
    let api = dyn_api(client, &ar, &caps, ns_eff.as_deref());
    let mut pp = PatchParams::apply("flexinfer-e2e").force();
    pp.dry_run = dry_run;
    api.patch(&name, &pp, &Patch::Apply(&obj)).await
}

/// Install the CRDs as users do — server-side apply of `deploy/crds/*.ai.flexinfer.yaml` (which `make
/// crds-check` keeps equal to the Rust types) — and wait until each is Established.
pub async fn install_crds(client: &Client) -> Result<()> {
    let dir = repo_root().join("deploy/crds");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".ai.flexinfer.yaml"))
        .collect();
    files.sort();
    let mut names = Vec::new();
    for path in files {
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        for doc in yaml_docs(&text).with_context(|| format!("parse {}", path.display()))? {
            apply(client, &doc, None, false)
                .await
                .with_context(|| format!("apply {}", path.display()))?;
            names.extend(doc["metadata"]["name"].as_str().map(String::from));
        }
    }
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in names {
        wait_for(
            &format!("CRD {name} Established"),
            Duration::from_secs(60),
            || {
                let (crds, name) = (crds.clone(), name.clone());
                async move {
                    let crd = crds.get(&name).await.ok()?;
                    crd.status?
                        .conditions?
                        .iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                        .then_some(())
                }
            },
        )
        .await?;
    }
    Ok(())
}

/// Poll `f` until it returns `Some`, or fail after `timeout` with `what` in the message.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The negative wait ("stays so for `period`"): `ok` is checked every 50 ms and must hold each
/// time; the first time it does not, this fails at once naming `what`, instead of sleeping the
/// whole period and looking once at the end.
pub async fn holds_for<F>(what: &str, period: Duration, mut ok: F) -> Result<()>
where
    F: FnMut() -> bool,
{
    let start = tokio::time::Instant::now();
    loop {
        if !ok() {
            bail!(
                "{what} stopped holding after {:?} (of {period:?})",
                start.elapsed()
            );
        }
        if start.elapsed() >= period {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `flexinfer_reconciles_total{controller="<controller>"}` in a Prometheus text exposition: the
/// reconcile calls that controller finished, success or error (0 when the series is absent).
pub fn reconciles_total(metrics: &str, controller: &str) -> u64 {
    let series = format!("flexinfer_reconciles_total{{controller=\"{controller}\"}}");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Annotation the "no status churn" checks patch onto the object under test: a change the
/// controller reconciles (it watches every change of its objects, metadata included) and has no
/// reason to answer with a write.
pub const NUDGE_ANNOTATION: &str = "e2e.flexinfer.ai/nudge";

/// The "no status churn" check: `nudges` times, patch [`NUDGE_ANNOTATION`] onto `name`, wait until
/// `controller` finished at least one more reconcile (`reconciles` reads its
/// `flexinfer_reconciles_total`, see [`reconciles_total`]), then require that the object's
/// resourceVersion is still the one the patch returned: the reconciles wrote nothing.
///
/// The counter is per controller, not per object: a reconcile of another object (or one already
/// running when the patch landed) can satisfy one wait. Nudging more than once, and the nudge
/// making the object itself due at once, keeps that from hiding a rewrite in practice; a check
/// whose namespace holds only the object under test is exact.
pub async fn assert_no_status_churn<K, F, Fut>(
    api: &Api<K>,
    name: &str,
    controller: &str,
    nudges: u32,
    mut reconciles: F,
) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    for i in 1..=nudges {
        let before = reconciles().await;
        let patch =
            serde_json::json!({"metadata": {"annotations": {NUDGE_ANNOTATION: i.to_string()}}});
        let nudged = api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("annotate {name}"))?;
        let rv = nudged.resource_version();
        let what =
            format!("a {controller} reconcile after nudge {i} of {name} (counter was {before})");
        wait_for(&what, Duration::from_secs(60), || {
            let seen = reconciles();
            async move { (seen.await > before).then_some(()) }
        })
        .await?;
        let now = api
            .get(name)
            .await
            .with_context(|| format!("get {name}"))?
            .resource_version();
        if now != rv {
            bail!(
                "{name} was rewritten by a reconcile without a change (nudge {i}): \
                 resourceVersion {rv:?} -> {now:?}"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// It holds for the whole period when the condition stays true, and fails at the first false
    /// (long before the period is over).
    #[tokio::test]
    async fn holds_for_fails_at_the_first_false() {
        holds_for("always", Duration::from_millis(200), || true)
            .await
            .expect("holds");
        let calls = AtomicU32::new(0);
        let t0 = tokio::time::Instant::now();
        let e = holds_for("three checks", Duration::from_secs(30), || {
            calls.fetch_add(1, Ordering::SeqCst) < 3
        })
        .await
        .expect_err("the fourth check is false");
        assert!(t0.elapsed() < Duration::from_secs(5), "failed at once");
        assert!(
            e.to_string().contains("three checks stopped holding"),
            "{e}"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    }
}
