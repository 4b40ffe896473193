//! The main job on the real path: the controller installed by its Helm chart (a pod on the local cluster's
//! real kubelet node), pipeline Jobs running the real worker image on that node, a local Hugging Face-
//! compatible hub, the local OCI registry, and a Model served by the stand-in backend.
//!
//! Needs what `scripts/e2e/setup.sh` prepares (`make test` runs it): the env it exports (`E2E_*`) and the
//! testenv's (`TESTENV_*`). Without them the tests fail with instructions.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use flexinfer_api::{Model, ModelCache};
use flexinfer_e2e::{apply, client, wait_for};
use flexinfer_fsutil::{sha256_file, sha256_hex};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};
use kube::Client;
use serde_json::{json, Value};

struct Env {
    ns: String,
    controller_ns: String,
    worker_image: String,
    standin_image: String,
    registry: String,
    storage: PathBuf,
    containerd: String,
    cli: PathBuf,
    /// Label selector of the flexinfer-proxy pods (the chart's two replicas on the real node).
    proxy_selector: String,
    /// The llama.cpp serving image (Debian's llama-server), the chart's `runtime.images.llamacpp`.
    llamacpp_image: String,
}

/// What a published GPTQ artifact must hold.
const GPTQ_FILES: &[&str] = &["config.json", ".save-complete"];

fn var(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| {
        format!(
            "{name} is not set: this test needs the real-node cluster prepared by scripts/e2e/setup.sh \
             (run it through `make test`)"
        )
    })
}

impl Env {
    fn get() -> Result<Self> {
        Ok(Env {
            ns: var("E2E_NAMESPACE")?,
            controller_ns: var("E2E_CONTROLLER_NAMESPACE")?,
            worker_image: var("E2E_WORKER_IMAGE")?,
            standin_image: var("E2E_STANDIN_IMAGE")?,
            registry: var("TESTENV_REGISTRY")?,
            storage: PathBuf::from(var("E2E_STORAGE")?),
            containerd: var("TESTENV_CONTAINERD_ADDRESS")?,
            cli: PathBuf::from(var("E2E_CLI")?),
            proxy_selector: var("E2E_PROXY_SELECTOR")?,
            llamacpp_image: var("E2E_LLAMACPP_IMAGE")?,
        })
    }

    fn real_node_placement(&self) -> Value {
        json!({
            "nodeSelector": {"flexinfer.ai/gpu.arch": "gfx1100", "flexinfer.ai/testenv-node": "real"},
            "tolerations": [{"key": "flexinfer.ai/testenv-node", "operator": "Equal", "value": "real",
                             "effect": "NoSchedule"}],
        })
    }
}

/// The ready flexinfer-proxy pods (name, `http://<pod IP>:8000`), sorted by name.
async fn proxy_pods(c: &Client, e: &Env) -> Result<Vec<(String, String)>> {
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
    let mut out: Vec<(String, String)> = pods
        .list(&ListParams::default().labels(&e.proxy_selector))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .filter_map(|p| {
            let ip = p.status.as_ref()?.pod_ip.clone()?;
            Some((p.metadata.name.clone()?, format!("http://{ip}:8000")))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Where a controller pod serves `/metrics`: its configured `FLEXINFER_METRICS_ADDR` (the e2e controller runs on
/// the host network on a free port), else the pod IP and its `metrics` port.
fn metrics_target(p: &Pod) -> Option<String> {
    let container = p.spec.as_ref().and_then(|s| s.containers.first());
    let configured = container
        .and_then(|c| c.env.as_ref())
        .and_then(|env| env.iter().find(|v| v.name == "FLEXINFER_METRICS_ADDR"))
        .and_then(|v| v.value.clone());
    let port = container
        .and_then(|c| c.ports.as_ref())
        .and_then(|ps| ps.iter().find(|p| p.name.as_deref() == Some("metrics")))
        .map_or(8080, |p| p.container_port);
    match (configured, p.status.as_ref().and_then(|s| s.pod_ip.clone())) {
        (Some(addr), _) => Some(addr.replace("0.0.0.0", "127.0.0.1")),
        (None, Some(ip)) => Some(format!("{ip}:{port}")),
        (None, None) => None,
    }
}

/// A real Prometheus server (Debian's `prometheus`, the package `promtool` comes from) scraping the
/// controller every second and evaluating the chart's alert rules every second (`E2E_ALERT_RULES`, rendered
/// by scripts/e2e/setup.sh from the chart with `alerting.quantizedOnCPU.for=1s`). It finds the controller the
/// way prometheus-operator does from the chart's ServiceMonitor (`E2E_SCRAPE_CONFIG`: Kubernetes service
/// discovery of the metrics Service, the operator's target labels, the ServiceMonitor's `honorLabels`).
/// Stopped when dropped.
struct Prometheus {
    child: std::process::Child,
    url: String,
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts the server; a start whose free port was taken in between (it exits) is tried again.
    async fn start() -> Result<Prometheus> {
        let mut last = String::new();
        for _ in 0..3 {
            match Prometheus::start_once().await {
                Ok(p) => return Ok(p),
                Err(e) => last = format!("{e:#}"),
            }
        }
        bail!("prometheus did not start in 3 tries: {last}")
    }

    async fn start_once() -> Result<Prometheus> {
        let rules = var("E2E_ALERT_RULES")?;
        let scrape_file = var("E2E_SCRAPE_CONFIG")?;
        let scrape: Value = serde_json::from_slice(
            &std::fs::read(&scrape_file)
                .with_context(|| format!("E2E_SCRAPE_CONFIG {scrape_file}"))?,
        )?;
        let dir = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let config = json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [rules],
            "scrape_configs": [scrape],
        });
        // JSON is YAML: the config file needs no YAML writer.
        std::fs::write(dir.path().join("prometheus.yml"), config.to_string())?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("start prometheus (Debian package prometheus, installed with promtool)")?;
        let p = Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            dir,
        };
        let mut p = p;
        let ready = format!("{}/-/ready", p.url);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            // A server that exited (its port taken in between) is not the one that would answer.
            if let Ok(Some(status)) = p.child.try_wait() {
                bail!("prometheus exited ({status}); log: {}", p.log());
            }
            if curl(&[&ready]).is_ok() {
                return Ok(p);
            }
            if std::time::Instant::now() > deadline {
                bail!("prometheus not ready after 60 s; log: {}", p.log());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The result vector of an instant query.
    fn query(&self, q: &str) -> Result<Vec<Value>> {
        let body = curl(&[
            "-G",
            &format!("{}/api/v1/query", self.url),
            "--data-urlencode",
            &format!("query={q}"),
        ])?;
        let v: Value = serde_json::from_slice(&body)?;
        ensure!(v["status"] == "success", "prometheus query {q}: {v}");
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// The server's log (for failure messages).
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }
}

/// The lines of the controller pods' `/metrics` that start with `prefix` and name `model="<model>"`. The address
/// is the container's `FLEXINFER_METRICS_ADDR` (the e2e post-renderer binds the host-network controller to a
/// free port), else the pod IP and the container port named `metrics`. A pod that does not answer (starting, or stopping) gives nothing; `diag` gets what was
/// scraped from where (for the error message).
async fn controller_metric(
    c: &Client,
    e: &Env,
    prefix: &str,
    model: &str,
    diag: Option<&mut Vec<String>>,
) -> Result<Vec<String>> {
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
    let sel = ListParams::default().labels("app.kubernetes.io/component=controller");
    let mut out = Vec::new();
    let mut notes = Vec::new();
    for p in pods.list(&sel).await?.items {
        let name = p.metadata.name.clone().unwrap_or_default();
        let Some(ip) = metrics_target(&p) else {
            notes.push(format!("{name}: no pod IP"));
            continue;
        };
        let body = match curl(&[&format!("http://{ip}/metrics")]) {
            Ok(b) => b,
            Err(err) => {
                notes.push(format!("{name} {ip}: {err:#}"));
                continue;
            }
        };
        let text = String::from_utf8_lossy(&body);
        notes.push(format!(
            "{name} {ip}: {}",
            text.lines()
                .filter(
                    |l| l.starts_with("flexinfer_quantization_") || l.starts_with("flexinfer_job_")
                )
                .collect::<Vec<_>>()
                .join(" | ")
        ));
        out.extend(
            text.lines()
                .filter(|l| l.starts_with(prefix) && l.contains(&format!("model=\"{model}\"")))
                .map(str::to_string),
        );
    }
    if let Some(d) = diag {
        *d = notes;
    }
    Ok(out)
}

/// A hostPath PV (a directory of the host, writable by the Jobs' uid 65532) and a PVC bound to it.
async fn storage(c: &Client, e: &Env, name: &str) -> Result<PathBuf> {
    let dir = e.storage.join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clear {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir)?;
    let ok = Command::new("chown")
        .args(["65532:65532", &dir.display().to_string()])
        .status()?;
    ensure!(ok.success(), "chown {}", dir.display());
    let pv = json!({
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": format!("{}-{name}", e.ns)},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain",
                 "hostPath": {"path": dir.display().to_string(), "type": "Directory"},
                 "claimRef": {"namespace": e.ns, "name": name}},
    });
    let pvc = json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": e.ns},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "",
                 "volumeName": format!("{}-{name}", e.ns), "resources": {"requests": {"storage": "10Gi"}}},
    });
    apply(c, &pv, None, false).await.context("apply PV")?;
    apply(c, &pvc, None, false).await.context("apply PVC")?;
    Ok(dir)
}

async fn profile(c: &Client, e: &Env) -> Result<()> {
    let placement = e.real_node_placement();
    let p = json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "GPUProfile",
        "metadata": {"name": "e2e-gfx1100", "namespace": e.ns},
        "spec": {"architecture": "gfx1100", "vendor": "amd", "vramMB": 24576, "resourceName": "amd.com/gpu",
                 "gpuDriverMemoryMB": 0, "nodeSelector": placement["nodeSelector"],
                 "quantization": {"images": {"GPTQ": e.worker_image}},
                 "runtime": {"images": {"vllm": e.standin_image}}},
    });
    apply(c, &p, None, false)
        .await
        .context("apply GPUProfile")?;
    Ok(())
}

async fn delete_cache(c: &Client, e: &Env, name: &str) {
    let api: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    let _ = api.delete(name, &DeleteParams::foreground()).await;
    let _ = wait_for("old ModelCache gone", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            api.get_opt(name)
                .await
                .ok()
                .flatten()
                .is_none()
                .then_some(())
        }
    })
    .await;
}

/// What the watch loop saw of one cache.
#[derive(Default, Debug)]
struct Observed {
    /// (status.currentPhase, status.progress) in order, deduplicated.
    progress: Vec<(String, i64)>,
    /// Every pipeline pod seen: name → (phase label, pod JSON).
    pods: BTreeMap<String, (String, Value)>,
    /// `status.quantization.gptqDevice` values seen while a quantization was under way (progress below 100,
    /// the cache not yet Ready): what the controller read from the running worker's log.
    devices_while_quantizing: BTreeSet<String>,
}

async fn observe_once(c: &Client, e: &Env, name: &str, seen: &mut Observed) -> Result<Value> {
    let api: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    let mc = serde_json::to_value(api.get(name).await?)?;
    let st = &mc["status"];
    let cur = st["currentPhase"].as_str().unwrap_or_default().to_string();
    let p = st["progress"].as_i64().unwrap_or(-1);
    if cur == "quantization"
        && (0..100).contains(&p)
        && !matches!(st["phase"].as_str(), Some("Ready" | "Failed"))
    {
        if let Some(d) = st["quantization"]["gptqDevice"].as_str() {
            seen.devices_while_quantizing.insert(d.to_string());
        }
    }
    if seen.progress.last() != Some(&(cur.clone(), p)) {
        seen.progress.push((cur, p));
    }
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.ns);
    for pod in pods
        .list(&ListParams::default().labels(&format!("flexinfer.ai/cache={name}")))
        .await?
    {
        let v = serde_json::to_value(&pod)?;
        let n = v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let phase = v["metadata"]["labels"]["flexinfer.ai/phase"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        seen.pods.insert(n, (phase, v));
    }
    Ok(mc)
}

/// Polls until `status.phase` is Ready (Failed is an error naming the status).
async fn until_ready(
    c: &Client,
    e: &Env,
    name: &str,
    seen: &mut Observed,
    timeout: Duration,
) -> Result<Value> {
    let start = Instant::now();
    loop {
        let mc = observe_once(c, e, name, seen).await?;
        match mc["status"]["phase"].as_str() {
            Some("Ready") => return Ok(mc),
            Some("Failed") => bail!(
                "{name} Failed: {}",
                serde_json::to_string_pretty(&mc["status"])?
            ),
            _ => {}
        }
        if start.elapsed() > timeout {
            bail!(
                "{name} not Ready after {timeout:?}: {}",
                serde_json::to_string_pretty(&mc["status"])?
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Host directory of a `status.path` (`<claim>:<path in the claim>`) or of a mount's subPath (a path in the
/// claim), for a claim backed by `storage`.
fn host_dir(storage: &Path, status_path: &str) -> PathBuf {
    let rel = status_path.split_once(':').map_or(status_path, |(_, p)| p);
    storage.join(rel.trim_start_matches('/'))
}

/// Bytes of the safetensors files in `dir` (what the engine reports as the original size).
fn safetensors_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            total += p.metadata()?.len();
        }
    }
    Ok(total)
}

/// No quantize pod seen asked for a GPU (the CPU engines: GGUF, AWQ, FP8), whatever `useGPU` says.
fn quantize_pods_request_no_gpu(seen: &Observed) -> Result<()> {
    for (pod, (phase, v)) in &seen.pods {
        if phase == "quantize" {
            let limits = &v["spec"]["containers"][0]["resources"]["limits"];
            ensure!(
                !limits
                    .as_object()
                    .is_some_and(|l| l.keys().any(|k| k.ends_with("/gpu"))),
                "quantize pod {pod} requests a GPU: {limits}"
            );
        }
    }
    Ok(())
}

/// The artifact at `dir` is complete: config, shards, index, `.save-complete` whose records match the bytes.
fn check_artifact(dir: &Path) -> Result<Value> {
    ensure!(
        dir.join("config.json").is_file(),
        "{}: no config.json",
        dir.display()
    );
    let sc: Value = serde_json::from_slice(&std::fs::read(dir.join(".save-complete"))?)
        .context(".save-complete")?;
    let shards = sc["shards"].as_array().context("shards")?;
    ensure!(!shards.is_empty(), "no shards recorded");
    for s in shards {
        let f = dir.join(s["name"].as_str().context("shard name")?);
        ensure!(
            f.metadata()?.len() == s["size_bytes"].as_u64().unwrap_or(0),
            "{} size",
            f.display()
        );
        ensure!(
            sha256_file(&f).with_context(|| format!("hash {}", f.display()))?
                == s["sha256"].as_str().unwrap_or_default(),
            "{} sha256",
            f.display()
        );
    }
    let cfg: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
    ensure!(
        cfg["quantization_config"]["quant_method"] == "gptq",
        "config.json is not a gptq checkpoint"
    );
    Ok(sc)
}

/// `flexinfer quantize validate-artifact --path DIR` passes (GPTQ or GGUF, the CLI tells them apart).
fn validate_artifact(e: &Env, dir: &Path) -> Result<()> {
    let v = Command::new(&e.cli)
        .args([
            "quantize",
            "validate-artifact",
            "--path",
            &dir.display().to_string(),
        ])
        .output()?;
    ensure!(
        v.status.success(),
        "validate-artifact {}: {}{}",
        dir.display(),
        String::from_utf8_lossy(&v.stdout),
        String::from_utf8_lossy(&v.stderr)
    );
    Ok(())
}

fn curl(args: &[&str]) -> Result<Vec<u8>> {
    let out = Command::new("curl")
        .args(["-sSf", "--max-time", "60"])
        .args(args)
        .output()?;
    ensure!(
        out.status.success(),
        "curl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out.stdout)
}

/// Pulls `repo:tag` from the registry with plain HTTP (independent of the worker's OCI client), checks it
/// against the artifact directory byte for byte, and writes the files under `into`.
fn pull_and_compare(
    e: &Env,
    repo: &str,
    tag: &str,
    artifact: &Path,
    into: &Path,
    required: &[&str],
) -> Result<String> {
    let url = format!("http://{}/v2/{repo}/manifests/{tag}", e.registry);
    let manifest = curl(&[
        "-H",
        "Accept: application/vnd.oci.image.manifest.v1+json",
        &url,
    ])?;
    let digest = format!("sha256:{}", sha256_hex(&manifest));
    let m: Value = serde_json::from_slice(&manifest)?;
    // A CNCF ModelPack artifact (its config is checked against the spec's schema by
    // crates/flexinfer-worker/tests/publish_consumers.rs).
    ensure!(
        m["artifactType"] == "application/vnd.cncf.model.manifest.v1+json"
            && m["config"]["mediaType"] == "application/vnd.cncf.model.config.v1+json",
        "not a ModelPack manifest: {m}"
    );
    let mut titles = BTreeSet::new();
    for l in m["layers"].as_array().context("layers")? {
        let title = l["annotations"]["org.opencontainers.image.title"]
            .as_str()
            .context("layer title")?;
        let d = l["digest"].as_str().context("layer digest")?;
        let blob = curl(&[&format!("http://{}/v2/{repo}/blobs/{d}", e.registry), "-L"])?;
        ensure!(
            format!("sha256:{}", sha256_hex(&blob)) == d,
            "{title}: blob digest"
        );
        let local =
            std::fs::read(artifact.join(title)).with_context(|| format!("{title} on disk"))?;
        ensure!(
            blob == local,
            "{title}: registry bytes differ from {}",
            artifact.display()
        );
        let dst = into.join(title);
        std::fs::create_dir_all(dst.parent().context("parent")?)?;
        std::fs::write(&dst, &blob)?;
        titles.insert(title.to_string());
    }
    for f in required {
        ensure!(
            titles.contains(*f),
            "published artifact lacks {f}: {titles:?}"
        );
    }
    Ok(digest)
}

fn check_pods(e: &Env, seen: &Observed, phases: &[&str]) -> Result<()> {
    let mut ran = BTreeSet::new();
    for (name, (phase, pod)) in &seen.pods {
        ensure!(
            pod["spec"]["nodeName"] == "localhost",
            "pod {name} ran on {} (not the real node)",
            pod["spec"]["nodeName"]
        );
        ensure!(
            pod["spec"]["containers"][0]["image"] == e.worker_image.as_str(),
            "pod {name} image {}",
            pod["spec"]["containers"][0]["image"]
        );
        // Pods that request a GPU run with the install's GPU group (44); the others with none.
        let gpu = pod["spec"]["containers"][0]["resources"]["limits"]
            .as_object()
            .is_some_and(|l| l.keys().any(|k| k.ends_with("/gpu")));
        let groups = &pod["spec"]["securityContext"]["supplementalGroups"];
        ensure!(
            if gpu {
                *groups == json!([44])
            } else {
                groups.is_null()
            },
            "pod {name} (GPU: {gpu}): supplementalGroups {groups}"
        );
        let cs = &pod["status"]["containerStatuses"][0];
        if cs["state"]["terminated"]["exitCode"] == 0 {
            ensure!(
                cs["imageID"].as_str().is_some_and(|s| !s.is_empty()),
                "pod {name}: no imageID"
            );
            ran.insert(phase.clone());
        }
    }
    for p in phases {
        ensure!(
            ran.contains(*p),
            "no pod of phase {p} succeeded on the real node: {:?}",
            seen.pods.keys()
        );
    }
    Ok(())
}

/// Clears a previous run of cache `name`, gives it a hostPath claim and the real-node GPUProfile, and applies
/// a ModelCache of hub repo `source` on the real node with the given phase specs (`abliteration`,
/// `quantization`, `publish`). Returns the claim's host directory.
async fn start_cache(
    c: &Client,
    e: &Env,
    name: &str,
    source: &str,
    model_path: &str,
    phases: Value,
) -> Result<PathBuf> {
    delete_cache(c, e, name).await;
    let dir = storage(c, e, name).await?;
    profile(c, e).await?;
    let place = e.real_node_placement();
    let mut spec = json!({
        "source": source, "existingClaimName": name, "modelPath": model_path,
        "nodeSelector": place["nodeSelector"], "tolerations": place["tolerations"],
        "download": {"maxMemoryGB": 1},
    });
    for (k, v) in phases.as_object().into_iter().flatten() {
        spec[k] = v.clone();
    }
    let mc = json!({
        "apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": name, "namespace": e.ns}, "spec": spec,
    });
    apply(c, &mc, None, false)
        .await
        .context("apply ModelCache")?;
    Ok(dir)
}

/// Applies a llama.cpp Model serving ModelCache `name` (the controller's default llama.cpp image, the test
/// GPUProfile, the real node's tolerations, `node_selector` when given) and waits until its Deployment is
/// available; returns its serving pod (a failure names the pods' status and log tails).
async fn serve_llamacpp(
    c: &Client,
    e: &Env,
    name: &str,
    node_selector: Option<&Value>,
) -> Result<Pod> {
    let place = e.real_node_placement();
    let mut model = json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "namespace": e.ns, "annotations": {
            "flexinfer.ai/promotion-gate": "quantized-artifact-v1", "flexinfer.ai/promotion-validation": "passed"}},
        "spec": {"backend": "llamacpp", "source": format!("modelcache://{name}"),
                 "gpu": {"count": 1, "profile": "e2e-gfx1100"}, "serverless": {"enabled": false},
                 "config": {"maxModelLen": 512},
                 "resources": {"requests": {"memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                 "tolerations": place["tolerations"]},
    });
    if let Some(sel) = node_selector {
        model["spec"]["nodeSelector"] = sel.clone();
    }
    apply(c, &model, None, false).await.context("apply Model")?;
    let deps: Api<Deployment> = Api::namespaced(c.clone(), &e.ns);
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.ns);
    let sel = format!("flexinfer.ai/model={name}");
    let available = wait_for(
        "the llama.cpp Model's Deployment available",
        Duration::from_secs(240),
        || {
            let deps = deps.clone();
            async move {
                let d = deps.get_opt(name).await.ok().flatten()?;
                (d.status.as_ref()?.available_replicas? >= 1).then_some(d)
            }
        },
    )
    .await;
    if let Err(err) = available {
        let mut diag = String::new();
        for p in pods.list(&ListParams::default().labels(&sel)).await? {
            let pn = p.metadata.name.clone().unwrap_or_default();
            let log = pods
                .logs(&pn, &Default::default())
                .await
                .unwrap_or_default();
            diag.push_str(&format!(
                "\npod {pn}: {}\nlog tail: {}",
                serde_json::to_string(&p.status)?,
                log.lines().rev().take(30).collect::<Vec<_>>().join("\n")
            ));
        }
        bail!("{err:#}{diag}");
    }
    pods.list(&ListParams::default().labels(&sel))
        .await?
        .items
        .into_iter()
        .find(|p| p.metadata.deletion_timestamp.is_none())
        .context("serving pod")
}

/// Layers in the per-layer cache's manifest (0 while there is none).
fn cached_layers(manifest: &Path) -> usize {
    std::fs::read(manifest)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|v| v["layers"].as_array().map(Vec::len))
        .unwrap_or(0)
}

/// Waits (10 min at most) for quantization of `name` to be under way: a quantize pod Running whose container
/// has put at least one layer into the per-layer cache (which lives beside the quantize input, the promoted
/// download generation). Returns the pod, its container id and the cache manifest's path. Failed, or Ready
/// before that (a model too small to catch mid-run), is an error.
async fn running_quantize_with_a_cached_layer(
    c: &Client,
    e: &Env,
    name: &str,
    dir: &Path,
    seen: &mut Observed,
) -> Result<(Pod, String, PathBuf)> {
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.ns);
    let qsel = ListParams::default().labels(&format!(
        "flexinfer.ai/cache={name},flexinfer.ai/phase=quantize"
    ));
    let mut manifest = PathBuf::new();
    let start = Instant::now();
    loop {
        let mc = observe_once(c, e, name, seen).await?;
        if let Some(d) = mc["status"]["download"]["outputDir"].as_str() {
            manifest = dir
                .join(d)
                .join(".flexinfer-gptq-cache/layers/manifest.json");
        }
        ensure!(
            mc["status"]["phase"] != "Failed",
            "failed: {}",
            mc["status"]
        );
        ensure!(
            mc["status"]["phase"] != "Ready",
            "quantization finished before it could be interrupted (model too small)"
        );
        ensure!(
            start.elapsed() < Duration::from_secs(600),
            "no running quantize container with a cached layer after 10 min: {}",
            mc["status"]
        );
        if cached_layers(&manifest) >= 1 {
            let found = pods.list(&qsel).await?.items.into_iter().find_map(|p| {
                let st = p.status.as_ref()?;
                (st.phase.as_deref() == Some("Running")).then_some(())?;
                let cid = st
                    .container_statuses
                    .as_ref()?
                    .first()?
                    .container_id
                    .clone()?;
                Some((p, cid))
            });
            if let Some((pod, cid)) = found {
                return Ok((pod, cid, manifest));
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn deploy_quantizer_mid_run(c: &Client, e: &Env) -> Result<()> {
    let name = "small-deploy";
    // 128 samples (the kill test's 64 doubled): the run must outlast the image push and the hand-over.
    let dir = start_cache(c, e, name, "flexinfer-demo/small-llama", "small-llama", json!({
        "quantization": {"format": "GPTQ", "bits": 4, "groupSize": 128, "maxMemoryGB": 4, "useGPU": true,
                         "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 128, "maxSeqLen": 512}},
    }))
    .await?;
    let mut seen = Observed::default();
    let (running, _, _) = running_quantize_with_a_cached_layer(c, e, name, &dir, &mut seen).await?;
    let jobs: Api<Job> = Api::namespaced(c.clone(), &e.ns);
    let job_name = format!("{name}-quantize");
    let old_uid = jobs.get(&job_name).await?.metadata.uid;
    let tag = format!("deploy-e2e-{}", std::process::id());

    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("repository root")?;
    // `--variant cpu`: gfx1100 maps to the rocm-gfx1100 image (tag `<tag>-rocm-gfx1100`, a 300 MB trixie
    // base with the HIP runtime), which this GPU-less node has no use for; the mapping itself is checked by
    // the chart tests (scripts/chart-tests/run.sh, deploy-quantizer --dry-run). The cpu variant keeps `<tag>`.
    let out = Command::new("bash")
        .current_dir(root)
        .args([
            "scripts/deploy-quantizer.sh",
            "gfx1100",
            "--variant",
            "cpu",
            "--registry",
        ])
        .arg(&e.registry)
        .args(["--tag", &tag, "-n", &e.ns, "--wait", "300", "--restart"])
        .arg(format!("{}/{name}", e.ns))
        .output()?;
    let log = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "deploy-quantizer failed: {log}");

    // The profile is pinned to what the registry holds under the tag.
    let inspect = Command::new("skopeo")
        .args(["inspect", "--tls-verify=false"])
        .arg(format!("docker://{}/flexinfer/worker:{tag}", e.registry))
        .output()?;
    ensure!(
        inspect.status.success(),
        "skopeo inspect: {}",
        String::from_utf8_lossy(&inspect.stderr)
    );
    let digest = serde_json::from_slice::<Value>(&inspect.stdout)?["Digest"]
        .as_str()
        .context("Digest")?
        .to_string();
    let image = format!("{}/flexinfer/worker:{tag}@{digest}", e.registry);
    let profiles: Api<flexinfer_api::GPUProfile> = Api::namespaced(c.clone(), &e.ns);
    let pinned = profiles
        .get("e2e-gfx1100")
        .await?
        .spec
        .quantization
        .and_then(|q| q.images.get("GPTQ").cloned());
    ensure!(
        pinned.as_deref() == Some(image.as_str()),
        "GPUProfile GPTQ image {pinned:?}, expected {image}; log: {log}"
    );
    // The running Job was replaced by one on the new image; the annotation is gone again.
    let job = jobs.get(&job_name).await?;
    ensure!(
        job.metadata.uid != old_uid,
        "the quantize Job was not replaced"
    );
    let job_image = job
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.first().and_then(|c| c.image.clone()));
    ensure!(
        job_image.as_deref() == Some(image.as_str()),
        "new Job image {job_image:?}"
    );
    let caches: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    let annotations = caches
        .get(name)
        .await?
        .metadata
        .annotations
        .unwrap_or_default();
    ensure!(
        !annotations.contains_key("flexinfer.ai/force-image-update"),
        "force-image-update left on the cache: {annotations:?}"
    );

    let mc = until_ready(c, e, name, &mut seen, Duration::from_secs(900)).await?;
    // The replacement resumed from the layers the first Job had cached.
    let old_pod = running.metadata.name.unwrap_or_default();
    let new_pod = seen
        .pods
        .iter()
        .find(|(n, (ph, p))| {
            **n != old_pod
                && ph == "quantize"
                && p["spec"]["containers"][0]["image"] == image.as_str()
                && p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        })
        .map(|(n, _)| n.clone())
        .context("a quantize pod on the new image that succeeded")?;
    let logs = Command::new("kubectl")
        .args(["logs", "-n", &e.ns, &new_pod])
        .output()?;
    ensure!(
        String::from_utf8_lossy(&logs.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|v| v["event"] == "quantization_resume_loaded"),
        "the Job on the new image did not resume from the layer cache"
    );
    let path = mc["status"]["path"].as_str().context("status.path")?;
    check_artifact(&host_dir(&dir, path))?;
    delete_cache(c, e, name).await;
    Ok(())
}

/// sha256 of every file of a directory (name → digest).
fn dir_digest(dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let e = e?;
        if e.file_type()?.is_file() {
            m.insert(
                e.file_name().to_string_lossy().to_string(),
                sha256_file(&e.path())?,
            );
        }
    }
    Ok(m)
}

/// Waits until the cache is Ready with a `status.path` other than `old`, checking at every poll that
/// `status.path` never leaves `old` before the new run is complete.
async fn until_ready_at_new_path(
    c: &Client,
    e: &Env,
    name: &str,
    old: &str,
    seen: &mut Observed,
) -> Result<Value> {
    let start = Instant::now();
    let mut left_ready = false;
    loop {
        let mc = observe_once(c, e, name, seen).await?;
        let st = &mc["status"];
        let path = st["path"].as_str().unwrap_or_default();
        match st["phase"].as_str() {
            Some("Ready") if path != old => return Ok(mc),
            Some("Ready") => {}
            Some("Failed") => bail!("{name} Failed: {}", serde_json::to_string_pretty(st)?),
            _ => {
                left_ready = true;
                ensure!(
                    path == old,
                    "status.path moved to {path} while the new run was at {}",
                    st["currentPhase"]
                );
            }
        }
        ensure!(
            start.elapsed() < Duration::from_secs(600),
            "{name} not Ready at a new path (left Ready: {left_ready}): {}",
            serde_json::to_string_pretty(st)?
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Tests that share the real node take this lock for reading; the concurrent-pipelines test takes it for
/// writing, so its controller kills never land in another test's run.
static NODE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Every shard `.save-complete` lists has its recorded size and sha256 on disk.
fn save_complete_verifies(dir: &Path) -> Result<()> {
    let sc: Value = serde_json::from_slice(
        &std::fs::read(dir.join(".save-complete"))
            .with_context(|| format!("{}/.save-complete", dir.display()))?,
    )?;
    let shards = sc["shards"].as_array().context(".save-complete shards")?;
    ensure!(!shards.is_empty(), "{}: no shards", dir.display());
    for s in shards {
        let name = s["name"].as_str().context("shard name")?;
        let p = dir.join(name);
        let len = std::fs::metadata(&p)
            .with_context(|| p.display().to_string())?
            .len();
        ensure!(
            Some(len) == s["size_bytes"].as_u64(),
            "{}: size {len}",
            p.display()
        );
        ensure!(
            Some(sha256_file(&p)?.as_str()) == s["sha256"].as_str(),
            "{}: sha256 differs from .save-complete",
            p.display()
        );
    }
    Ok(())
}

/// One HTTP/1.1 POST on its own connection (`Connection: close`), written while the answer is read: the status
/// code and the response head. The write side stays open until the answer is read (a half-close would end the
/// request at the proxy). Errors name the address and the step that failed.
async fn post_raw(addr: &str, path: &str, body: std::sync::Arc<Vec<u8>>) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect to {addr}"))?;
    let (mut rd, mut wr) = stream.into_split();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let writer = tokio::spawn(async move {
        wr.write_all(head.as_bytes()).await?;
        wr.write_all(&body).await?;
        wr.flush().await?;
        Ok::<_, std::io::Error>(wr)
    });
    let mut buf = Vec::new();
    let read = rd.read_to_end(&mut buf).await;
    let wrote = writer.await.context("the writing task")?;
    let text = String::from_utf8_lossy(&buf);
    let head = text
        .split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_string();
    let code = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|s| s.get(..3))
        .and_then(|c| c.parse::<u16>().ok());
    match code {
        Some(code) => Ok((code, head)),
        None => bail!(
            "no HTTP answer from {addr}{path}: read {:?} ({} bytes), write {:?}",
            read.err(),
            buf.len(),
            wrote.err()
        ),
    }
}

/// The host PID of a pod's first container (its `containerd://` id found in `/proc/<pid>/cgroup`, the process
/// named `comm`) and the memory cgroup directory of that container (cgroup v1), if found.
fn container_process(pod: &Pod, comm: &str) -> Result<(u32, Option<PathBuf>)> {
    let cid = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .and_then(|c| c.container_id.clone())
        .context("container id of the proxy pod")?;
    let cid = cid.rsplit("://").next().unwrap_or_default().to_string();
    ensure!(!cid.is_empty(), "empty container id");
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cg) = std::fs::read_to_string(entry.path().join("cgroup")) else {
            continue;
        };
        if !cg.contains(&cid) {
            continue;
        }
        let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if name.trim() != comm {
            continue;
        }
        let mem = cg.lines().find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctl, path) = (parts.next()?, parts.next()?, parts.next()?);
            ctl.split(',')
                .any(|c| c == "memory")
                .then(|| PathBuf::from(format!("/sys/fs/cgroup/memory{path}")))
        });
        return Ok((pid, mem.filter(|p| p.is_dir())));
    }
    bail!("no process {comm} in a cgroup of container {cid} on this host")
}

/// `TcpExt: ListenOverflows` of the network namespace of process `pid` (`/proc/<pid>/net/netstat`): connections
/// the kernel could not queue for accept (it drops or resets them).
fn listen_overflows(pid: u32) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/netstat"))
        .with_context(|| format!("/proc/{pid}/net/netstat"))?;
    let tcp_ext: Vec<&str> = text.lines().filter(|l| l.starts_with("TcpExt:")).collect();
    ensure!(
        tcp_ext.len() == 2,
        "/proc/{pid}/net/netstat: no TcpExt lines"
    );
    let names = tcp_ext[0].split_whitespace();
    let values = tcp_ext[1].split_whitespace();
    names
        .zip(values)
        .find(|(n, _)| *n == "ListenOverflows")
        .and_then(|(_, v)| v.parse().ok())
        .with_context(|| format!("/proc/{pid}/net/netstat: no ListenOverflows"))
}

/// The `Max open files` line of `/proc/<pid>/limits`.
fn open_files_limit(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/limits"))
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .map(str::to_string)
        })
        .unwrap_or_default()
}

/// `Vm…:` of `/proc/<pid>/status`, in bytes.
fn proc_status_bytes(pid: u32, field: &str) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("/proc/{pid}/status"))?;
    let line = s
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .with_context(|| format!("{field} in /proc/{pid}/status"))?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("{line:?}"))?;
    Ok(kb * 1024)
}

fn cgroup_bytes(dir: &Path, file: &str) -> Result<u64> {
    let p = dir.join(file);
    std::fs::read_to_string(&p)
        .with_context(|| p.display().to_string())?
        .trim()
        .parse()
        .with_context(|| format!("{} is not a number", p.display()))
}

/// Restarts of the proxy pod `name` and the reason of its last termination, if any.
async fn restarts(c: &Client, e: &Env, name: &str) -> Result<(i32, Option<String>, Pod)> {
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
    let p = pods
        .get(name)
        .await
        .with_context(|| format!("get proxy pod {name}"))?;
    let cs = p
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .cloned()
        .with_context(|| format!("proxy pod {name}: no container status"))?;
    let reason = cs
        .last_state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .and_then(|t| t.reason.clone());
    Ok((cs.restart_count, reason, p))
}

/// Sum of the API server's `apiserver_request_total` for PATCH of `models/status` (every client: the proxies and
/// the controller; no-op patches and conflicts included).
fn apiserver_model_status_patches() -> Result<f64> {
    let out = Command::new("kubectl")
        .args(["get", "--raw", "/metrics"])
        .output()
        .context("kubectl get --raw /metrics")?;
    ensure!(
        out.status.success(),
        "kubectl get --raw /metrics: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && l.contains("resource=\"models\"")
                && l.contains("subresource=\"status\"")
                && l.contains("verb=\"PATCH\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

const MIB: f64 = 1024.0 * 1024.0;

/// Unix seconds of the moment `ago` before now.
fn unix_seconds_ago(ago: Duration) -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(now.saturating_sub(ago).as_secs()).unwrap_or(i64::MAX)
}

/// The commands of docs/user/gptq-quantization-runbook.md, as `scripts/runbook/commands.py` extracts and
/// classifies them (the cluster state each assumes; `skip` with the reason it cannot run here).
fn runbook_commands() -> Result<Vec<Value>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("python3")
        .current_dir(&root)
        .args([
            "scripts/runbook/commands.py",
            "docs/user/gptq-quantization-runbook.md",
        ])
        .output()
        .context("python3 scripts/runbook/commands.py")?;
    ensure!(
        out.status.success(),
        "commands.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice::<Vec<Value>>(&out.stdout)?)
}

/// Runs one runbook command as written, in bash (no pipefail, as in a user's shell), with the placeholders
/// filled in: `flexinfer-system` → the test namespace (the runbook's namespace is the user's), `<ns>`, `<name>`,
/// `<cache>`, `<pod>`, `<quantize pod>`, and `$POD` from the environment. `flexinfer` is the CLI built for the
/// test. It must exit 0 (a watch or follow, `-w` / `-f`, is stopped after 5 s) and print no kubectl error — also from inside a
/// pipeline, whose status is its last command's.
fn run_runbook_command(e: &Env, cmd: &Value, subst: &[(&str, &str)]) -> Result<String> {
    let written = cmd["command"].as_str().context("command")?;
    let mut line = written.replace("flexinfer-system", &e.ns);
    for (k, v) in subst {
        line = line.replace(k, v);
    }
    ensure!(
        !line.contains('<'),
        "runbook line {}: a placeholder this test does not fill: {line}",
        cmd["line"]
    );
    // A watch (`-w`) or a follow (`-f`) runs until stopped: 5 s here.
    let watch = line
        .split_whitespace()
        .take_while(|w| !w.starts_with('#'))
        .any(|w| w == "-w" || w == "-f");
    let script = if watch {
        format!("timeout 5 {line}")
    } else {
        line.clone()
    };
    let cli_dir = e.cli.parent().context("E2E_CLI has no directory")?;
    let path = format!(
        "{}:{}",
        cli_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let pod = subst
        .iter()
        .find(|(k, _)| *k == "<quantize pod>")
        .map_or("", |(_, v)| v);
    let out = Command::new("bash")
        .args(["-c", &script])
        .env("PATH", path)
        .env("POD", pod)
        .output()
        .with_context(|| format!("bash -c {script}"))?;
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    let ok = out.status.success() || (watch && out.status.code() == Some(124));
    let kubectl_error = se.lines().any(|l| {
        l.starts_with("error:") || l.starts_with("Error from server") || l.starts_with("Error:")
    });
    ensure!(
        ok && !kubectl_error,
        "runbook line {} ({}) failed as written: `{written}`\nran: {line}\nexit {:?}\nstdout: {so}\nstderr: {se}",
        cmd["line"],
        cmd["section"],
        out.status.code()
    );
    Ok(so)
}

mod formats;
mod generations;
mod kills;
mod main_flow;
mod node_local;
mod proxy_load;
mod runbooks;
