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

#[tokio::test]
async fn real_pipeline_download_abliterate_quantize_publish_and_serve() -> Result<()> {
    let _node = NODE.read().await;
    let e = Env::get()?;
    let c = client().await;
    let name = "tiny-full";
    let dir = start_cache(&c, &e, name, "flexinfer-demo/tiny-llama", "tiny-llama", json!({
        "abliteration": {"refusalDataset": "flexinfer-demo/refusal", "harmlessDataset": "flexinfer-demo/harmless",
                         "numSamples": 32, "maxMemoryGB": 2, "useGPU": true},
        "quantization": {"format": "GPTQ", "bits": 4, "groupSize": 32, "maxMemoryGB": 2, "useGPU": true,
                         "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 16, "maxSeqLen": 128}},
        "publish": {"targets": ["oci"], "ociRef": format!("{}/e2e/{name}:v1", e.registry), "insecure": true},
    }))
    .await?;
    let place = e.real_node_placement();
    let mut seen = Observed::default();
    let mc = until_ready(&c, &e, name, &mut seen, Duration::from_secs(900)).await?;
    let st = &mc["status"];
    check_pods(
        &e,
        &seen,
        &["download", "abliterate", "quantize", "publish"],
    )?;

    // status.path is the complete artifact, and status.quantization describes this run.
    // status.path names the promoted generation of the quantized output.
    let path = st["path"].as_str().context("status.path")?;
    let generation = st["quantization"]["generation"]
        .as_str()
        .context("status.quantization.generation")?;
    ensure!(
        path == format!("{name}:tiny-llama/gptq-w4-g32.{generation}"),
        "status.path {path}"
    );
    let art = host_dir(&dir, path);
    let sc = check_artifact(&art)?;
    let q = &st["quantization"];
    let shard_bytes: u64 = sc["shards"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["size_bytes"].as_u64())
        .sum();
    ensure!(
        q["compressedSizeBytes"].as_u64() == Some(shard_bytes),
        "compressedSizeBytes {} vs shards {shard_bytes}",
        q["compressedSizeBytes"]
    );
    let ablit = st["abliteration"]["outputDir"]
        .as_str()
        .context("status.abliteration.outputDir")?;
    ensure!(
        ablit.starts_with("tiny-llama/abliterated."),
        "abliteration output {ablit}"
    );
    let input = safetensors_bytes(&dir.join(ablit))?;
    ensure!(
        q["originalSizeBytes"].as_u64() == Some(input),
        "originalSizeBytes {} vs the abliterated input's shards {input}",
        q["originalSizeBytes"]
    );
    let ratio = q["compressionRatio"].as_f64().context("compressionRatio")?;
    ensure!(
        (ratio - input as f64 / shard_bytes as f64).abs() < 0.01 * ratio,
        "ratio {ratio}"
    );
    let sidecar: Value =
        serde_json::from_slice(&std::fs::read(art.join(".quantization-quality.json"))?)?;
    for (k, f) in [
        ("gptqModules", "gptqModules"),
        ("rtnFallbackModules", "rtnFallbackModules"),
        ("gate", "gate"),
    ] {
        ensure!(
            q["quality"][k] == sidecar[f],
            "status.quantization.quality.{k} {} vs sidecar {}",
            q["quality"][k],
            sidecar[f]
        );
    }
    ensure!(
        st["abliteration"]["layersModified"]
            .as_i64()
            .is_some_and(|n| n > 0),
        "abliteration status {}",
        st["abliteration"]
    );

    // Published: the registry holds exactly these bytes, and the pulled copy validates.
    let pulled = tempfile::tempdir()?;
    let digest = pull_and_compare(
        &e,
        &format!("e2e/{name}"),
        "v1",
        &art,
        pulled.path(),
        GPTQ_FILES,
    )?;
    ensure!(
        st["publish"]["ociDigest"] == digest.as_str(),
        "status.publish.ociDigest {} vs {digest}",
        st["publish"]["ociDigest"]
    );
    validate_artifact(&e, pulled.path())?;

    // Served: a promoted Model mounts exactly status.path and answers through the stand-in.
    let model = json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "namespace": e.ns, "annotations": {
            "flexinfer.ai/promotion-gate": "quantized-artifact-v1", "flexinfer.ai/promotion-validation": "passed"}},
        "spec": {"backend": "vllm", "source": format!("modelcache://{name}"), "image": e.standin_image,
                 "gpu": {"count": 1, "profile": "e2e-gfx1100"}, "serverless": {"enabled": false},
                 // A slow stand-in (one token per 60 ms) so that a stream outlives a proxy replica.
                 "config": {"extraArgs": ["--token-delay-ms", "60"]},
                 "resources": {"requests": {"memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                 "nodeSelector": place["nodeSelector"], "tolerations": place["tolerations"]},
    });
    apply(&c, &model, None, false)
        .await
        .context("apply Model")?;
    let deps: Api<Deployment> = Api::namespaced(c.clone(), &e.ns);
    let d = wait_for(
        "the Model's Deployment available",
        Duration::from_secs(180),
        || {
            let deps = deps.clone();
            async move {
                let d = deps.get_opt(name).await.ok().flatten()?;
                (d.status.as_ref()?.available_replicas? >= 1).then_some(d)
            }
        },
    )
    .await?;
    let dv = serde_json::to_value(&d)?;
    let pod_spec = &dv["spec"]["template"]["spec"];
    let vol = pod_spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == "model")
        .context("model volume")?;
    ensure!(
        vol["persistentVolumeClaim"]["claimName"] == name,
        "model volume {vol}"
    );
    let mount = pod_spec["containers"][0]["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["name"] == "model")
        .context("model mount")?;
    ensure!(
        host_dir(&dir, mount["subPath"].as_str().unwrap_or_default()) == art,
        "Deployment mounts subPath {} but status.path is {path}",
        mount["subPath"]
    );
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.ns);
    let pod = pods
        .list(&ListParams::default().labels(&format!("flexinfer.ai/model={name}")))
        .await?
        .items
        .into_iter()
        .find(|p| p.metadata.deletion_timestamp.is_none())
        .context("serving pod")?;
    // The serving pod runs hardened like the Jobs (non-root 65532, no escalation, no
    // capabilities) and still serves: the kubelet enforced what the controller asked for.
    let psc = serde_json::to_value(pod.spec.as_ref().map(|s| &s.security_context))?;
    let csc = serde_json::to_value(pod.spec.as_ref().map(|s| &s.containers[0].security_context))?;
    ensure!(
        psc["runAsNonRoot"] == true
            && psc["runAsUser"] == 65532
            && psc["supplementalGroups"] == json!([44]),
        "serving pod security context (runAsUser 65532, the install's GPU group 44) {psc}"
    );
    ensure!(
        csc["allowPrivilegeEscalation"] == false && csc["capabilities"]["drop"] == json!(["ALL"]),
        "serving container security context {csc}"
    );
    let ip = pod.status.and_then(|s| s.pod_ip).context("pod IP")?;
    let body = json!({"model": name, "prompt": "hello world", "max_tokens": 4}).to_string();
    let out = curl(&[
        "-H",
        "Content-Type: application/json",
        "-d",
        &body,
        &format!("http://{ip}:8000/v1/completions"),
    ])?;
    let r: Value = serde_json::from_slice(&out)?;
    ensure!(
        r["usage"]["completion_tokens"] == 4 && r["choices"][0]["text"].is_string(),
        "completion {r}"
    );
    let m: Api<Model> = Api::namespaced(c.clone(), &e.ns);
    let mv = serde_json::to_value(m.get(name).await?)?;
    let gate = mv["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "PromotionGate")
        .cloned();
    ensure!(
        gate.as_ref().is_some_and(|g| g["status"] == "True"),
        "PromotionGate {gate:?}"
    );

    // The same request through flexinfer-proxy, the chart's Deployment on the real node (two replicas on
    // the pod network): each finds the Model's ready endpoint in the EndpointSlice Kubernetes made for its
    // Service, forwards, and marks the Model active.
    let proxies = proxy_pods(&c, &e).await?;
    ensure!(proxies.len() == 2, "two ready proxy pods: {proxies:?}");
    let completes = |url: String| {
        let body = body.clone();
        async move {
            let out = curl(&["-H", "Content-Type: application/json", "-d", &body, &url]).ok()?;
            let r: Value = serde_json::from_slice(&out).ok()?;
            (r["usage"]["completion_tokens"] == 4).then_some(r)
        }
    };
    for (pod, base) in &proxies {
        let via_proxy = wait_for(
            &format!("the proxy {pod} routes the Model"),
            Duration::from_secs(60),
            || completes(format!("{base}/v1/completions")),
        )
        .await?;
        ensure!(
            via_proxy["choices"][0]["text"].is_string(),
            "completion through the proxy {pod}: {via_proxy}"
        );
        let models: Value = serde_json::from_slice(&curl(&[&format!("{base}/v1/models")])?)?;
        ensure!(
            models["data"]
                .as_array()
                .is_some_and(|d| d.iter().any(|m| m["id"] == name)),
            "/v1/models through the proxy {pod} lists {name}: {models}"
        );
    }

    // HA: one proxy pod is killed in the middle of a stream. That client's stream ends early (no
    // `[DONE]`); the other replica serves new requests, streamed and not, at once.
    let (killed, via_killed) = &proxies[0];
    let (other, via_other) = &proxies[1];
    let stream_body =
        json!({"model": name, "prompt": "hello world", "max_tokens": 150, "stream": true})
            .to_string();
    let stream_out = tempfile::NamedTempFile::new()?;
    let mut stream = Command::new("curl")
        .args([
            "-sSN",
            "--max-time",
            "60",
            "-H",
            "Content-Type: application/json",
            "-d",
            &stream_body,
        ])
        .arg(format!("{via_killed}/v1/completions"))
        .stdout(stream_out.reopen()?)
        .stderr(std::process::Stdio::null())
        .spawn()?;
    wait_for(
        "the stream through the first proxy started",
        Duration::from_secs(30),
        || {
            let path = stream_out.path().to_path_buf();
            async move {
                let text = std::fs::read_to_string(path).ok()?;
                (text.matches("data: ").count() >= 3).then_some(())
            }
        },
    )
    .await?;
    let proxy_api: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
    proxy_api
        .delete(
            killed,
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..DeleteParams::default()
            },
        )
        .await?;
    let status = tokio::task::spawn_blocking(move || stream.wait()).await??;
    let streamed = std::fs::read_to_string(stream_out.path())?;
    ensure!(
        !streamed.contains("[DONE]") && streamed.matches("data: ").count() < 150,
        "the stream through the killed proxy {killed} ran to its end ({status}): {} events",
        streamed.matches("data: ").count()
    );
    let r = completes(format!("{via_other}/v1/completions"))
        .await
        .with_context(|| format!("a completion through {other} after {killed} was killed"))?;
    ensure!(
        r["choices"][0]["text"].is_string(),
        "completion through {other}: {r}"
    );
    let short_stream =
        json!({"model": name, "prompt": "hello world", "max_tokens": 3, "stream": true})
            .to_string();
    let out = curl(&[
        "-N",
        "-H",
        "Content-Type: application/json",
        "-d",
        &short_stream,
        &format!("{via_other}/v1/completions"),
    ])?;
    let text = String::from_utf8_lossy(&out);
    ensure!(
        text.contains("[DONE]") && text.matches("data: ").count() >= 4,
        "a stream through {other} after {killed} was killed: {text}"
    );
    let active = wait_for(
        "the proxy wrote status.lastActiveTime",
        Duration::from_secs(30),
        || {
            let m = m.clone();
            async move {
                let mv = m.get(name).await.ok()?;
                mv.status?.last_active_time
            }
        },
    )
    .await?;
    ensure!(active.0.as_second() > 0, "lastActiveTime {active:?}");
    m.delete(name, &DeleteParams::background()).await?;
    Ok(())
}

/// GGUF, the guide's default format, end to end with its real consumer: a ModelCache with `format: GGUF` and
/// no type (Q4_K_M) downloads a model from the hub, writes one llama.cpp file and publishes it; a Model with `backend: llamacpp`
/// gets the chart's llama.cpp image (Debian's llama-server, not the stand-in) by default, which loads the
/// file from the cache's claim and answers a chat completion sent through flexinfer-proxy by the official
/// `openai` client.
#[tokio::test]
async fn real_pipeline_gguf_served_by_llama_server() -> Result<()> {
    let _node = NODE.read().await;
    let e = Env::get()?;
    let python = var("FLEXINFER_OPENAI_PYTHON")?;
    let c = client().await;
    let name = "tiny-gguf";
    // The hub's Llama with a byte-level BPE tokenizer (llama.cpp's `gpt-2`); tiny-llama's word-level one has
    // no llama.cpp equivalent.
    let dir = start_cache(&c, &e, name, "flexinfer-demo/tiny-llama-bpe", "tiny-llama-bpe", json!({
        "quantization": {"format": "GGUF", "maxMemoryGB": 2, "useGPU": true},
        "publish": {"targets": ["oci"], "ociRef": format!("{}/e2e/{name}:v1", e.registry), "insecure": true},
    }))
    .await?;
    let place = e.real_node_placement();
    let mut seen = Observed::default();
    let mc = until_ready(&c, &e, name, &mut seen, Duration::from_secs(600)).await?;
    check_pods(&e, &seen, &["download", "quantize", "publish"])?;
    // The GGUF engine has no GPU path: the quantize pod asked for no GPU although the spec says useGPU.
    quantize_pods_request_no_gpu(&seen)?;
    let st = &mc["status"];
    let path = st["path"].as_str().context("status.path")?;
    let generation = st["quantization"]["generation"]
        .as_str()
        .context("status.quantization.generation")?;
    ensure!(
        path == format!("{name}:tiny-llama-bpe/gguf-q4_k_m.{generation}"),
        "status.path {path}"
    );
    let q = &st["quantization"];
    ensure!(
        q["applied"]["format"] == "GGUF" && q["applied"]["ggufType"] == "Q4_K_M",
        "status.quantization.applied {}",
        q["applied"]
    );
    let art = host_dir(&dir, path);
    save_complete_verifies(&art)?;
    let file = q["applied"]["ggufFile"]
        .as_str()
        .context("status.quantization.applied.ggufFile")?;
    let gguf = art.join(file);
    let bytes = std::fs::read(&gguf).with_context(|| format!("read {}", gguf.display()))?;
    ensure!(
        bytes.starts_with(b"GGUF"),
        "{} is not a GGUF file",
        gguf.display()
    );
    ensure!(
        q["compressedSizeBytes"].as_u64() == Some(bytes.len() as u64),
        "compressedSizeBytes {} vs {} bytes on disk",
        q["compressedSizeBytes"],
        bytes.len()
    );
    let downloaded = st["download"]["outputDir"]
        .as_str()
        .context("status.download.outputDir")?;
    let source = safetensors_bytes(&dir.join(downloaded))?;
    ensure!(
        q["originalSizeBytes"].as_u64() == Some(source)
            && q["compressionRatio"].as_f64().is_some_and(|r| r > 1.0),
        "originalSizeBytes {} (source shards {source}), ratio {}",
        q["originalSizeBytes"],
        q["compressionRatio"]
    );
    let pulled = tempfile::tempdir()?;
    let digest = pull_and_compare(
        &e,
        &format!("e2e/{name}"),
        "v1",
        &art,
        pulled.path(),
        &[file, ".save-complete"],
    )?;
    ensure!(
        st["publish"]["ociDigest"] == digest.as_str(),
        "status.publish.ociDigest {} vs {digest}",
        st["publish"]["ociDigest"]
    );
    // The pulled copy passes the CLI's GGUF checks (layout, types, metadata, .save-complete).
    validate_artifact(&e, pulled.path())?;

    // Served by the real llama-server: no image in the Model, so the controller's default for llamacpp (the
    // chart's runtime.images.llamacpp) applies.
    let pod = serve_llamacpp(&c, &e, name, Some(&place["nodeSelector"])).await?;
    let pv = serde_json::to_value(&pod)?;
    ensure!(
        pv["spec"]["nodeName"] == "localhost"
            && pv["spec"]["containers"][0]["image"] == e.llamacpp_image.as_str(),
        "serving pod on {} with image {} (want the real node and {})",
        pv["spec"]["nodeName"],
        pv["spec"]["containers"][0]["image"],
        e.llamacpp_image
    );
    // The Model's own NetworkPolicy (the chart enables it with the proxy): its serving pods, the proxy only.
    let policies: Api<k8s_openapi::api::networking::v1::NetworkPolicy> =
        Api::namespaced(c.clone(), &e.ns);
    let np = serde_json::to_value(
        policies
            .get(name)
            .await
            .context("the Model's NetworkPolicy")?,
    )?;
    ensure!(
        np["metadata"]["ownerReferences"][0]["kind"] == "Model"
            && np["spec"]["podSelector"]["matchLabels"]["flexinfer.ai/model"] == name
            && np["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
                ["app.kubernetes.io/component"]
                == "proxy"
            && np["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"]
                ["kubernetes.io/metadata.name"]
                == e.controller_ns.as_str(),
        "the Model's NetworkPolicy: {np}"
    );
    // It is llama-server that answers, with our file: its own /props endpoint names the model path.
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("pod IP")?;
    let props: Value = serde_json::from_slice(&curl(&[&format!("http://{ip}:8000/props")])?)?;
    ensure!(
        props["model_path"]
            .as_str()
            .is_some_and(|p| p.ends_with(file)),
        "llama-server /props: {props}"
    );

    // A chat completion through flexinfer-proxy with the official openai client.
    let proxies = proxy_pods(&c, &e).await?;
    let (proxy, base) = proxies.first().context("a ready proxy pod")?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/e2e/openai_chat.py");
    let chat = wait_for(
        &format!("a chat completion through the proxy {proxy}"),
        Duration::from_secs(90),
        || {
            let (python, base) = (python.clone(), base.clone());
            async move {
                let out = Command::new(&python)
                    .args([script, &base, name, "8"])
                    .output()
                    .ok()?;
                if !out.status.success() {
                    return None;
                }
                serde_json::from_slice::<Value>(&out.stdout).ok()
            }
        },
    )
    .await?;
    ensure!(
        chat["usage"]["completion_tokens"] == 8
            && chat["content"].is_string()
            && chat["finish_reason"] == "length",
        "chat completion through the proxy: {chat}"
    );
    // llama-server exports Prometheus metrics (the controller starts it with --metrics; the chart's backends
    // PodMonitor scrapes them): its counters saw the completion above.
    let metrics = String::from_utf8(curl(&[&format!("http://{ip}:8000/metrics")])?)?;
    let tokens = metrics
        .lines()
        .find_map(|l| l.strip_prefix("llamacpp:tokens_predicted_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    ensure!(
        tokens.is_some_and(|t| t >= 8.0),
        "llama-server /metrics: no llamacpp:tokens_predicted_total >= 8 in:\n{metrics}"
    );
    let m: Api<Model> = Api::namespaced(c.clone(), &e.ns);
    m.delete(name, &DeleteParams::background()).await?;
    Ok(())
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

/// `storageStrategy: NodeLocal` on the real node: once the GGUF is published, a fill Job copies the
/// published digest onto the node's own disk (not the claim), verified, and only then labels the node;
/// the Model mounts that copy (a hostPath, no claim) on a labelled node and llama-server loads it;
/// deleting the cache removes the copy and the label before the cache goes. One real node: the Model's
/// node choice among several nodes is the scheduler's reading of the label (render and planner tests).
#[tokio::test]
async fn real_pipeline_node_local_cache_is_served_from_the_nodes_copy() -> Result<()> {
    let _node = NODE.read().await;
    let e = Env::get()?;
    let root = PathBuf::from(var("E2E_NODE_LOCAL_ROOT")?);
    let c = client().await;
    let name = "tiny-nodelocal";
    let place = e.real_node_placement();
    let dir = start_cache(&c, &e, name, "flexinfer-demo/tiny-llama-bpe", "tiny-llama-bpe", json!({
        "quantization": {"format": "GGUF", "maxMemoryGB": 2},
        "publish": {"targets": ["oci"], "ociRef": format!("{}/e2e/{name}:v1", e.registry), "insecure": true},
        "storageStrategy": "NodeLocal",
        "nodeLocal": {"nodeSelector": place["nodeSelector"]},
    }))
    .await?;
    let mut seen = Observed::default();
    until_ready(&c, &e, name, &mut seen, Duration::from_secs(600)).await?;
    let caches: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    let mc = wait_for(
        "status.nodeLocal.readyNodes 1",
        Duration::from_secs(180),
        || {
            let caches = caches.clone();
            async move {
                let mc = serde_json::to_value(caches.get(name).await.ok()?).ok()?;
                (mc["status"]["nodeLocal"]["readyNodes"] == 1).then_some(mc)
            }
        },
    )
    .await
    .with_context(|| format!("pods seen: {:?}", seen.pods.keys()))?;
    let st = &mc["status"];
    let digest = st["publish"]["ociDigest"]
        .as_str()
        .context("status.publish.ociDigest")?;
    let nl = &st["nodeLocal"];
    ensure!(
        nl["digest"] == digest
            && nl["selectedNodes"] == 1
            && nl["nodes"][0]["node"] == "localhost"
            && nl["nodes"][0]["phase"] == "Ready",
        "status.nodeLocal {nl}"
    );
    // The node's label: the cache's key, the copy's digest (shortened to a label value).
    let key = format!(
        "nodelocal.flexinfer.ai/c-{}",
        &sha256_hex(format!("{}/{name}", e.ns).as_bytes())[..20]
    );
    let hex = digest.trim_start_matches("sha256:");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(c.clone());
    let node = nodes.get("localhost").await?;
    let value = node.metadata.labels.unwrap_or_default().get(&key).cloned();
    ensure!(
        value.as_deref() == Some(&hex[..40]),
        "node label {key}: {value:?}, want {}",
        &hex[..40]
    );
    // The copy on the node's disk holds exactly the artifact the pipeline wrote on the claim.
    let copy = root.join(&e.ns).join(name).join(hex);
    let art = host_dir(&dir, st["path"].as_str().context("status.path")?);
    let mut want = dir_digest(&art)?;
    want.retain(|f, _| !f.starts_with(".flexinfer") && !f.ends_with(".lock"));
    let mut got = dir_digest(&copy)?;
    got.retain(|f, _| f != ".source-integrity.json" && f != ".download_complete");
    ensure!(
        got == want,
        "node copy {} differs from the artifact {}:\n{got:?}\n{want:?}",
        copy.display(),
        art.display()
    );
    let copies = std::fs::read_dir(root.join(&e.ns).join(name))?
        .flatten()
        .map(|d| d.file_name().to_string_lossy().into_owned())
        .collect::<Vec<_>>();
    ensure!(
        copies == vec![hex.to_string()],
        "entries beside the copy: {copies:?}"
    );

    // The Model serves the node's copy: a hostPath, no claim, only on labelled nodes (no node selector of
    // its own).
    let pod = serve_llamacpp(&c, &e, name, None).await?;
    let pv = serde_json::to_value(&pod)?;
    let vols = pv["spec"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let model_vol = vols
        .iter()
        .find(|v| v["name"] == "model")
        .context("model volume")?;
    ensure!(
        model_vol["hostPath"]["path"] == copy.to_string_lossy().as_ref()
            && vols
                .iter()
                .all(|v| v.get("persistentVolumeClaim").is_none()),
        "serving pod volumes: {vols:?}"
    );
    ensure!(
        pv["spec"]["nodeSelector"][key.as_str()] == hex[..40]
            && pv["spec"]["nodeName"] == "localhost",
        "serving pod placement: nodeSelector {} on {}",
        pv["spec"]["nodeSelector"],
        pv["spec"]["nodeName"]
    );
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("pod IP")?;
    let props: Value = serde_json::from_slice(&curl(&[&format!("http://{ip}:8000/props")])?)?;
    let file = st["quantization"]["applied"]["ggufFile"]
        .as_str()
        .context("ggufFile")?;
    ensure!(
        props["model_path"]
            .as_str()
            .is_some_and(|p| p.ends_with(file)),
        "llama-server /props: {props}"
    );
    let m: Api<Model> = Api::namespaced(c.clone(), &e.ns);
    m.delete(name, &DeleteParams::background()).await?;

    // Deleting the cache removes the node's copy and label first.
    caches.delete(name, &DeleteParams::background()).await?;
    wait_for("the NodeLocal cache gone", Duration::from_secs(180), || {
        let caches = caches.clone();
        async move {
            caches
                .get_opt(name)
                .await
                .ok()
                .flatten()
                .is_none()
                .then_some(())
        }
    })
    .await?;
    let node = nodes.get("localhost").await?;
    let left = node.metadata.labels.unwrap_or_default().get(&key).cloned();
    ensure!(
        left.is_none(),
        "node label {key} left after deletion: {left:?}"
    );
    ensure!(
        !root.join(&e.ns).join(name).exists(),
        "{} left after deletion",
        root.join(&e.ns).join(name).display()
    );
    Ok(())
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

/// GPTQ without abliteration, and the two crashes a long quantization must survive: the worker container is
/// SIGKILLed mid-quantization (the Job's retry resumes from the per-layer cache), and the controller pod is
/// killed while the Job still has that retry to run (the running Job is kept, not restarted). The worker is
/// killed first, as soon as a running container has cached a layer, so neither kill races the quantization.
/// `format: AWQ` through the real Jobs on the real node: download → AWQ (the worker's activation-aware
/// search on the calibration set, on the CPU: no GPU asked for although the spec says `useGPU`) → Ready, with
/// the AutoAWQ GEMM checkpoint at `awq-w4-g32.<generation>`, its `.save-complete` matching the bytes and the
/// status' sizes matching the shards. (Its consumers, GPTQModel's reader and transformers, are checked on the
/// engine's output by crates/flexinfer-quant/tests/awq_artifact.rs.)
#[tokio::test]
async fn real_pipeline_awq_cache_goes_ready_on_the_cpu() -> Result<()> {
    let _node = NODE.read().await;
    let e = Env::get()?;
    let c = client().await;
    let name = "tiny-awq";
    let dir = start_cache(&c, &e, name, "flexinfer-demo/tiny-llama", "tiny-llama", json!({
        "quantization": {"format": "AWQ", "groupSize": 32, "maxMemoryGB": 2, "useGPU": true,
                         "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 16, "maxSeqLen": 128}},
    }))
    .await?;
    let mut seen = Observed::default();
    let mc = until_ready(&c, &e, name, &mut seen, Duration::from_secs(600)).await?;
    check_pods(&e, &seen, &["download", "quantize"])?;
    quantize_pods_request_no_gpu(&seen)?;
    let st = &mc["status"];
    let q = &st["quantization"];
    let generation = q["generation"]
        .as_str()
        .context("status.quantization.generation")?;
    let path = st["path"].as_str().context("status.path")?;
    ensure!(
        path == format!("{name}:tiny-llama/awq-w4-g32.{generation}"),
        "status.path {path}"
    );
    ensure!(
        q["applied"]["format"] == "AWQ"
            && q["applied"]["groupSize"] == "32"
            && q["applied"]["bits"] == "4",
        "status.quantization.applied {}",
        q["applied"]
    );
    let art = host_dir(&dir, path);
    save_complete_verifies(&art)?;
    let cfg: Value = serde_json::from_slice(&std::fs::read(art.join("config.json"))?)?;
    let qc = &cfg["quantization_config"];
    ensure!(
        qc["quant_method"] == "awq"
            && qc["version"] == "gemm"
            && qc["group_size"] == 32
            && qc["zero_point"] == true,
        "config.json quantization_config {qc}"
    );
    let shards = safetensors_bytes(&art)?;
    ensure!(
        q["compressedSizeBytes"].as_u64() == Some(shards)
            && q["compressionRatio"].as_f64().is_some_and(|r| r > 1.0),
        "compressedSizeBytes {} vs shards {shards}, ratio {}",
        q["compressedSizeBytes"],
        q["compressionRatio"]
    );
    Ok(())
}

#[tokio::test]
async fn real_pipeline_survives_controller_and_worker_kills() -> Result<()> {
    let _node = NODE.read().await;
    let e = Env::get()?;
    let c = client().await;
    // A real Prometheus scrapes the controller through the whole test and evaluates the chart's alert rules
    // (the controller's metrics address is configured, so it is the same after the controller is killed).
    let controllers: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
    let targets: Vec<String> = controllers
        .list(&ListParams::default().labels("app.kubernetes.io/component=controller"))
        .await?
        .items
        .iter()
        .filter_map(metrics_target)
        .collect();
    ensure!(!targets.is_empty(), "no controller metrics address");
    let prom = Prometheus::start().await?;
    let name = "small-kill";
    let dir = start_cache(&c, &e, name, "flexinfer-demo/small-llama", "small-llama", json!({
        "quantization": {"format": "GPTQ", "bits": 4, "groupSize": 128, "maxMemoryGB": 4, "useGPU": true,
                         "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 64, "maxSeqLen": 512}},
    }))
    .await?;
    let mut seen = Observed::default();
    let jobs: Api<Job> = Api::namespaced(c.clone(), &e.ns);
    let job_name = format!("{name}-quantize");
    // The worker is killed first, the moment a running container has cached a layer, so the kill never
    // depends on how fast this machine quantizes; the controller is killed next, while the Job must still run
    // the retry (the kill left work undone).
    let (running, cid, manifest) =
        running_quantize_with_a_cached_layer(&c, &e, name, &dir, &mut seen).await?;
    let job = jobs
        .get(&job_name)
        .await
        .with_context(|| format!("Job {job_name}"))?;
    let uid = job.metadata.uid.clone();
    // The cache asks for a GPU and this node has none: the controller's gauge says so while the worker runs
    // (the FlexInferQuantizationOnCPU alert's input).
    let on_cpu = "flexinfer_quantization_on_cpu{";
    let (cr, er) = (&c, &e);
    let gauge = wait_for(
        "flexinfer_quantization_on_cpu 1",
        Duration::from_secs(20),
        || async move {
            let lines = controller_metric(cr, er, on_cpu, name, None).await.ok()?;
            lines.iter().any(|l| l.ends_with(" 1")).then_some(lines)
        },
    )
    .await;
    let gauge = match gauge {
        Ok(g) => g,
        Err(err) => {
            let mut diag = Vec::new();
            let _ = controller_metric(&c, &e, on_cpu, name, Some(&mut diag)).await;
            bail!("{err:#}; scraped: {diag:#?}");
        }
    };

    // 1. SIGKILL the worker container mid-quantization (through the node's containerd).
    let layers_before = cached_layers(&manifest);
    let cid = cid.trim_start_matches("containerd://");
    let k = Command::new("ctr")
        .args([
            "--address",
            &e.containerd,
            "-n",
            "k8s.io",
            "tasks",
            "kill",
            "-s",
            "SIGKILL",
            cid,
        ])
        .output()?;
    ensure!(
        k.status.success(),
        "ctr kill: {}",
        String::from_utf8_lossy(&k.stderr)
    );
    let killed = running.metadata.name.clone().unwrap_or_default();

    // 2. Kill the controller pod while the Job still has the retry to run; its replacement adopts the
    // running Job.
    let cpods: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
    let sel = ListParams::default().labels("app.kubernetes.io/component=controller");
    let old: Vec<String> = cpods
        .list(&sel)
        .await?
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    ensure!(!old.is_empty(), "no controller pod in {}", e.controller_ns);
    for p in &old {
        cpods
            .delete(
                p,
                &DeleteParams {
                    grace_period_seconds: Some(0),
                    ..DeleteParams::default()
                },
            )
            .await?;
    }
    // The cache is observed all the while: the retry runs (and reports progress through the replacement)
    // while the new pod waits for its readiness probe.
    let start = Instant::now();
    loop {
        observe_once(&c, &e, name, &mut seen).await?;
        let l = cpods.list(&sel).await?;
        let ready = l.items.iter().any(|p| {
            !old.contains(p.metadata.name.as_ref().unwrap_or(&String::new()))
                && p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        });
        if ready {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(120),
            "no new controller pod Ready after 120 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let after = jobs.get(&job_name).await?;
    ensure!(
        after.metadata.uid == uid,
        "the quantize Job was recreated after the controller restart"
    );
    let mc = until_ready(&c, &e, name, &mut seen, Duration::from_secs(900)).await?;
    ensure!(
        layers_before < 12,
        "the kill came after the last layer ({layers_before} cached)"
    );
    let (_, kp) = seen.pods.get(&killed).context("killed pod observed")?;
    let code = kp["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"].as_i64();
    ensure!(code == Some(137), "killed worker exit code {code:?}");
    let retry = seen
        .pods
        .iter()
        .find(|(n, (ph, p))| {
            *n != &killed
                && ph == "quantize"
                && p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        })
        .map(|(n, _)| n.clone())
        .context("a retried quantize pod that succeeded")?;
    // The worker's termination message carries the device report (the route that fills the status when the
    // log was not read in time), and `applied` the setting only.
    let (_, rp) = seen.pods.get(&retry).context("retry pod observed")?;
    let message = rp["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
        .as_str()
        .context("the retry pod's termination message")?;
    let term: Value =
        serde_json::from_str(message).with_context(|| format!("termination message {message}"))?;
    ensure!(
        term["gptqDevice"]["device"] == "cpu-faer"
            && term["gptqDevice"]["kind"] == "cpu"
            && term["gptqDevice"]["requested"] == "auto"
            && term["gptqDevice"]["reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("auto: no usable GPU (hip: "))
            && term["applied"]["gptqDevice"] == "auto"
            && term["applied"].get("gptqDeviceUsed").is_none(),
        "the retry's termination message: {message}"
    );
    let logs = Command::new("kubectl")
        .args(["logs", "-n", &e.ns, &retry])
        .output()?;
    let logs = String::from_utf8_lossy(&logs.stdout);
    let resumed = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == "quantization_resume_loaded")
        .context("no quantization_resume_loaded event in the retry's log")?;
    ensure!(
        resumed["layers"]
            .as_u64()
            .is_some_and(|n| n as usize >= layers_before),
        "resumed {resumed}"
    );

    // The retry ran inside the same Job: neither crash made the controller replace it.
    ensure!(
        jobs.get(&job_name).await?.metadata.uid == uid,
        "the quantize Job was replaced"
    );
    check_pods(&e, &seen, &["download", "quantize"])?;
    let path = mc["status"]["path"].as_str().context("status.path")?;
    ensure!(
        path.starts_with(&format!("{name}:small-llama/gptq-w4-g128.")),
        "status.path {path}"
    );
    let art = host_dir(&dir, path);
    check_artifact(&art)?;
    // Progress advanced through values the worker reported while quantizing.
    let mid: BTreeSet<i64> = seen
        .progress
        .iter()
        .filter(|(p, v)| p == "quantization" && *v > 0 && *v < 100)
        .map(|(_, v)| *v)
        .collect();
    ensure!(
        mid.len() >= 2,
        "intermediate quantize progress values {mid:?} (all: {:?})",
        seen.progress
    );
    // The device was in the status while the worker ran (from its gptq_device_selected event in the log the
    // controller tails), not only from the termination message at the end; and it is still there.
    ensure!(
        seen.devices_while_quantizing == BTreeSet::from(["cpu-faer".to_string()]),
        "status.quantization.gptqDevice while quantizing: {:?}",
        seen.devices_while_quantizing
    );
    ensure!(
        mc["status"]["quantization"]["gptqDevice"] == "cpu-faer",
        "status.quantization.gptqDevice at the end: {}",
        mc["status"]["quantization"]["gptqDevice"]
    );
    // The gauge (seen as {gauge:?} while quantizing) is gone once the Job has ended, so the alert stops.
    wait_for(
        "flexinfer_quantization_on_cpu dropped after the run",
        Duration::from_secs(30),
        || async move {
            controller_metric(cr, er, on_cpu, name, None)
                .await
                .ok()
                .filter(Vec::is_empty)
        },
    )
    .await
    .with_context(|| format!("the on-CPU gauge while quantizing was {gauge:?}"))?;
    // Prometheus scraped that gauge and the chart's FlexInferQuantizationOnCPU fired from it (its `for`
    // shortened to 1s), and the alert resolved once the Job had ended.
    let firing = format!(
        "ALERTS{{alertname=\"FlexInferQuantizationOnCPU\",alertstate=\"firing\",model=\"{name}\"}}"
    );
    let fired = prom.query(&format!("max_over_time({firing}[1h])"))?;
    // One series whatever pod was scraped (the controller pod is replaced during the test: the `pod` target
    // label changes); `exported_namespace` is kept so a renamed label would show.
    let scraped = prom.query(&format!(
        "max by (model, namespace, exported_namespace) (max_over_time(flexinfer_quantization_on_cpu{{model=\"{name}\"}}[1h]))"
    ))?;
    let one = |r: &[Value]| r.len() == 1 && r[0]["value"][1] == "1";
    ensure!(
        one(&scraped) && one(&fired),
        "Prometheus (scraping the chart's ServiceMonitor targets; controller at {targets:?}): the gauge's maximum {scraped:?}, the alert firing {fired:?}; log: {}",
        prom.log()
    );
    // The cache lives in another namespace than the controller: the series and the alert carry the cache's own
    // namespace (the ServiceMonitor's honorLabels), not the scraped Service's, and no `exported_namespace`.
    for (what, r) in [("gauge", &scraped), ("alert", &fired)] {
        let m = &r[0]["metric"];
        ensure!(
            m["namespace"] == e.ns.as_str() && m.get("exported_namespace").is_none(),
            "the {what} from Prometheus carries namespace {} (exported_namespace {}), not the cache's {}: {m}",
            m["namespace"],
            m["exported_namespace"],
            e.ns
        );
    }
    ensure!(
        e.ns != e.controller_ns,
        "the cache must live outside the controller's namespace {} for this check",
        e.controller_ns
    );
    let any = format!("ALERTS{{alertname=\"FlexInferQuantizationOnCPU\",model=\"{name}\"}}");
    let p = &prom;
    let a = &any;
    wait_for(
        "FlexInferQuantizationOnCPU resolved in Prometheus",
        Duration::from_secs(30),
        || async move { p.query(a).ok().filter(Vec::is_empty) },
    )
    .await?;
    Ok(())
}

/// `make deploy-quantizer` on the real path: while a quantization runs on the real node,
/// `scripts/deploy-quantizer.sh gfx1100 --restart` builds and pushes the worker image to the local registry,
/// pins the namespace's gfx1100 GPUProfile to it by digest and moves the running quantization onto it (the
/// controller replaces the drifted Job; the new one resumes from the layer cache), then removes the
/// `force-image-update` annotation; the cache ends Ready with a verified artifact. Takes the node for itself:
/// it changes the GPUProfile the other tests use (restored at the end).
#[tokio::test]
async fn real_pipeline_deploy_quantizer_moves_a_running_quantization_to_the_new_image() -> Result<()>
{
    let _node = NODE.write().await;
    let e = Env::get()?;
    let c = client().await;
    let result = deploy_quantizer_mid_run(&c, &e).await;
    // Back to the image the other tests expect, whatever happened.
    profile(&c, &e).await?;
    result
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

/// The artifact lifecycle on the real path: a changed `sym` and the `flexinfer.ai/requantize` annotation each
/// produce a new generation (never a reuse of the old bytes under the new spec), `status.path` moves only
/// when the new one is complete, the replaced generation stays on disk byte for byte, one older than that
/// is collected, and a run-only edit (`timeoutSeconds`) does not replace the running Job.
#[tokio::test]
async fn real_pipeline_generations_config_bound_reuse_and_collection() -> Result<()> {
    let _node = NODE.read().await;
    let e = Env::get()?;
    let c = client().await;
    let name = "tiny-gen";
    let quant = json!({"format": "GPTQ", "bits": 4, "groupSize": 32, "sym": true, "maxMemoryGB": 2,
                       "useGPU": true,
                       "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 16, "maxSeqLen": 128}});
    let dir = start_cache(
        &c,
        &e,
        name,
        "flexinfer-demo/tiny-llama",
        "tiny-llama",
        json!({"quantization": quant}),
    )
    .await?;
    let mut seen = Observed::default();
    let mc = until_ready(&c, &e, name, &mut seen, Duration::from_secs(600)).await?;
    let p1 = mc["status"]["path"].as_str().context("path")?.to_string();
    let d1 = host_dir(&dir, &p1);
    let before = dir_digest(&d1)?;
    let sc1: Value = serde_json::from_slice(&std::fs::read(d1.join(".save-complete"))?)?;
    ensure!(
        mc["status"]["quantization"]["configDigest"] == sc1["config_digest"],
        "status configDigest {} vs .save-complete {}",
        mc["status"]["quantization"]["configDigest"],
        sc1["config_digest"]
    );
    ensure!(
        mc["status"]["quantization"]["applied"]["sym"] == "true",
        "applied {}",
        mc["status"]["quantization"]["applied"]
    );
    // The worker reports the device its solves ran on: this node has no GPU and the cpu image no runtime,
    // so `auto` chose the CPU; with `useGPU: true` that is a Warning event carrying the worker's reason.
    // The setting is among the applied settings; the device is not (it has its own fields).
    let applied = &mc["status"]["quantization"]["applied"];
    ensure!(
        applied["gptqDevice"] == "auto"
            && applied.as_object().is_some_and(|m| m
                .keys()
                .all(|k| !k.starts_with("gptqDevice") || k == "gptqDevice")),
        "applied settings: {applied}"
    );
    let q = &mc["status"]["quantization"];
    ensure!(
        q["gptqDevice"] == "cpu-faer"
            && q["gptqDeviceKind"] == "cpu"
            && q["gptqDeviceRequested"] == "auto"
            && q["gptqDeviceReason"]
                .as_str()
                .is_some_and(|r| r.starts_with("auto: no usable GPU (hip: ")),
        "status.quantization.gptqDevice {} (kind {}, setting {}) / gptqDeviceReason {}",
        q["gptqDevice"],
        q["gptqDeviceKind"],
        q["gptqDeviceRequested"],
        q["gptqDeviceReason"]
    );
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(c.clone(), &e.ns);
    let on_cpu: Vec<String> = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|ev| {
            ev.reason.as_deref() == Some("QuantizedOnCPU")
                && ev.involved_object.name.as_deref() == Some(name)
        })
        .map(|ev| {
            format!(
                "{} {}",
                ev.type_.unwrap_or_default(),
                ev.message.unwrap_or_default()
            )
        })
        .collect();
    ensure!(
        on_cpu.iter().any(|m| m.starts_with(
            "Warning useGPU is set, but the GPTQ solves run on the CPU: auto: no usable GPU"
        )),
        "QuantizedOnCPU events of {name}: {on_cpu:?}"
    );

    // 1. sym true -> false: a new generation with the new configuration, the old one intact.
    let api: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    let pp = kube::api::PatchParams::default();
    api.patch(
        name,
        &pp,
        &kube::api::Patch::Merge(json!({"spec": {"quantization": {"sym": false}}})),
    )
    .await?;
    let mc = until_ready_at_new_path(&c, &e, name, &p1, &mut seen).await?;
    let st = &mc["status"];
    let p2 = st["path"].as_str().context("path")?.to_string();
    let d2 = host_dir(&dir, &p2);
    let qc: Value = serde_json::from_slice(&std::fs::read(d2.join("quantize_config.json"))?)?;
    ensure!(qc["sym"] == false, "new artifact's quantize_config {qc}");
    ensure!(
        st["quantization"]["applied"]["sym"] == "false",
        "applied {}",
        st["quantization"]["applied"]
    );
    let sc2: Value = serde_json::from_slice(&std::fs::read(d2.join(".save-complete"))?)?;
    ensure!(
        sc2["config_digest"] != sc1["config_digest"],
        "config digest did not change"
    );
    ensure!(
        dir_digest(&d1)? == before,
        "the replaced generation changed on disk"
    );
    let rel1 = p1
        .split_once(':')
        .map(|(_, d)| d.to_string())
        .unwrap_or_default();
    ensure!(
        st["quantization"]["previousOutputDirs"] == json!([rel1]),
        "previousOutputDirs {}",
        st["quantization"]["previousOutputDirs"]
    );

    // 2. The requantize annotation with an unchanged spec: a third generation, computed again; while it
    //    runs, a deadline edit applies to the next attempt and does not replace the Job.
    api.patch(
        name,
        &pp,
        &kube::api::Patch::Merge(
            json!({"metadata": {"annotations": {"flexinfer.ai/requantize": "true"}}}),
        ),
    )
    .await?;
    let jobs: Api<Job> = Api::namespaced(c.clone(), &e.ns);
    let job_name = format!("{name}-quantize");
    let uid = wait_for("the requantize Job", Duration::from_secs(120), || {
        let jobs = jobs.clone();
        let job_name = job_name.clone();
        async move {
            let j = jobs.get_opt(&job_name).await.ok().flatten()?;
            (j.metadata.deletion_timestamp.is_none()
                && j.status.as_ref().and_then(|s| s.succeeded).unwrap_or(0) == 0)
                .then_some(j.metadata.uid)
        }
    })
    .await?;
    api.patch(
        name,
        &pp,
        &kube::api::Patch::Merge(json!({"spec": {"quantization": {"timeoutSeconds": 7777}}})),
    )
    .await?;
    let mc = until_ready_at_new_path(&c, &e, name, &p2, &mut seen).await?;
    let st = &mc["status"];
    let p3 = st["path"].as_str().context("path")?.to_string();
    let job = jobs.get(&job_name).await?;
    ensure!(
        job.metadata.uid == uid,
        "the timeoutSeconds edit replaced the running quantize Job"
    );
    let d3 = host_dir(&dir, &p3);
    check_artifact(&d3)?;
    // Keep one previous generation: the second stays, the first is collected by the third run.
    ensure!(
        d2.join(".save-complete").is_file(),
        "previous generation {p2} was removed"
    );
    ensure!(
        !d1.exists(),
        "generation {p1} older than the kept one is still on disk"
    );
    let logs = Command::new("kubectl")
        .args(["logs", "-n", &e.ns, &format!("job/{job_name}")])
        .output()?;
    let logs = String::from_utf8_lossy(&logs.stdout);
    ensure!(
        !logs.contains("\"quantization_cached\""),
        "requantize reused the artifact"
    );
    ensure!(
        logs.contains("\"generations_collected\""),
        "no generations_collected event in the worker log"
    );
    Ok(())
}

/// Downloads have generations too, on the real path: a new revision downloads into a new
/// `source.<generation>` beside the one `status.path` names, which stays byte for byte and keeps being
/// the path until the new one is complete; unchanged files are hard links to the earlier generation's;
/// the replaced generation is kept (one previous by default) and the one before it is collected.
#[tokio::test]
async fn real_pipeline_a_new_revision_downloads_beside_the_served_one() -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let _node = NODE.read().await;
    let e = Env::get()?;
    let c = client().await;
    let name = "tiny-rev";
    let dir = start_cache(
        &c,
        &e,
        name,
        "flexinfer-demo/tiny-llama",
        "tiny-rev",
        json!({}),
    )
    .await?;
    let mut seen = Observed::default();
    let mc = until_ready(&c, &e, name, &mut seen, Duration::from_secs(300)).await?;
    let st = &mc["status"];
    let p1 = st["path"].as_str().context("path")?.to_string();
    let rel1 = st["download"]["outputDir"]
        .as_str()
        .context("status.download.outputDir")?
        .to_string();
    ensure!(
        p1.ends_with(&format!(":{rel1}")) && rel1.starts_with("tiny-rev/source."),
        "path {p1} vs download.outputDir {rel1}"
    );
    let d1 = host_dir(&dir, &p1);
    ensure!(
        d1.join("config.json").is_file() && d1.join(".download_complete").is_file(),
        "{} holds no complete download",
        d1.display()
    );
    ensure!(
        !dir.join("tiny-rev/config.json").exists(),
        "the model's files were written into the cache directory itself"
    );
    let before = dir_digest(&d1)?;

    let api: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    let pp = kube::api::PatchParams::default();
    let mut paths = vec![p1.clone()];
    for rev in ["r2", "r3"] {
        api.patch(
            name,
            &pp,
            &kube::api::Patch::Merge(json!({"spec": {"revision": rev}})),
        )
        .await?;
        let old = paths.last().cloned().unwrap_or_default();
        let mc = until_ready_at_new_path(&c, &e, name, &old, &mut seen).await?;
        let st = &mc["status"];
        ensure!(
            st["download"]["revision"] == rev,
            "download.revision {}",
            st["download"]["revision"]
        );
        let new = st["path"].as_str().context("path")?.to_string();
        let prev_rel = old.split_once(':').map(|(_, d)| d.to_string());
        ensure!(
            st["download"]["previousOutputDirs"] == json!([prev_rel]),
            "previousOutputDirs {}",
            st["download"]["previousOutputDirs"]
        );
        let (dn, dold) = (host_dir(&dir, &new), host_dir(&dir, &old));
        let cfg_new = std::fs::metadata(dn.join("config.json"))?.ino();
        let cfg_old = std::fs::metadata(dold.join("config.json"))?.ino();
        ensure!(
            cfg_new == cfg_old,
            "config.json of {new} is not a hard link to the earlier generation's"
        );
        paths.push(new);
    }
    // r2 replaced the first generation and kept it; r3 kept r2 and collected the first.
    ensure!(
        !d1.exists(),
        "generation {p1} older than the kept one is still on disk"
    );
    let d2 = host_dir(&dir, &paths[1]);
    ensure!(
        dir_digest(&d2)?.len() == before.len() && d2.join(".download_complete").is_file(),
        "the kept generation {} is not whole",
        paths[1]
    );
    Ok(())
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

/// The controller is killed (its pod deleted with no grace) at seeded moments while
/// `E2E_CONCURRENT_PIPELINES` (default 20) download → quantize pipelines run on the real node. Then every
/// cache must finish: zero lost artifacts, zero `status.path` naming a missing or unverified directory
/// (checked whenever a path appears), zero moments with two live pods of one phase of one cache
/// (sampled throughout), every served artifact byte-identical to its `.save-complete` record.
#[tokio::test]
async fn real_pipeline_controller_killed_during_concurrent_pipelines() -> Result<()> {
    let _node = NODE.write().await;
    let e = Env::get()?;
    let c = client().await;
    let n: usize = std::env::var("E2E_CONCURRENT_PIPELINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let quant = json!({"format": "GPTQ", "bits": 4, "groupSize": 32, "maxMemoryGB": 1, "useGPU": true,
                       "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 16, "maxSeqLen": 128}});
    let mut dirs = BTreeMap::new();
    for i in 0..n {
        let name = format!("conc-{i:02}");
        let dir = start_cache(
            &c,
            &e,
            &name,
            "flexinfer-demo/tiny-llama",
            "tiny-llama",
            json!({"quantization": quant}),
        )
        .await?;
        dirs.insert(name, dir);
    }
    let api: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.ns);
    let cpods: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
    let csel = ListParams::default().labels("app.kubernetes.io/component=controller");
    let psel = ListParams::default().labels("flexinfer.ai/cache");
    // Seeded kill moments (seconds after the start), spread over the first minutes of the run.
    let mut x: u64 = 0x5eed_c0de;
    let mut kills_at: Vec<f64> = (0..5)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            8.0 + (x % 1000) as f64 / 1000.0 * 150.0
        })
        .collect();
    kills_at.sort_by(f64::total_cmp);
    let start = Instant::now();
    let mut kills = 0usize;
    let mut verified_paths: BTreeSet<String> = BTreeSet::new();
    let mut double_pods: Vec<String> = Vec::new();
    let mut samples = 0usize;
    loop {
        let t = start.elapsed().as_secs_f64();
        if kills_at.first().is_some_and(|k| *k <= t) {
            kills_at.remove(0);
            for p in cpods.list(&csel).await?.items {
                let name = p.metadata.name.unwrap_or_default();
                let _ = cpods
                    .delete(
                        &name,
                        &DeleteParams {
                            grace_period_seconds: Some(0),
                            ..DeleteParams::default()
                        },
                    )
                    .await;
            }
            kills += 1;
        }
        // Live pods (not finished, terminating included) per cache and phase.
        samples += 1;
        let mut live: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        for p in pods.list(&psel).await?.items {
            let phase = p
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            if phase == "Succeeded" || phase == "Failed" {
                continue;
            }
            let l = p.metadata.labels.clone().unwrap_or_default();
            let key = (
                l.get("flexinfer.ai/cache").cloned().unwrap_or_default(),
                l.get("flexinfer.ai/phase").cloned().unwrap_or_default(),
            );
            live.entry(key)
                .or_default()
                .push(p.metadata.name.unwrap_or_default());
        }
        for ((cache, phase), names) in &live {
            if names.len() > 1 {
                double_pods.push(format!("{cache}/{phase}: {names:?} at {t:.1}s"));
            }
        }
        // Every path a status names must be a complete, verified artifact the moment it is named.
        let mut ready = 0usize;
        for mc in api.list(&ListParams::default()).await?.items {
            let name = mc.metadata.name.clone().unwrap_or_default();
            let Some(dir) = dirs.get(&name) else { continue };
            let st = mc.status.clone().unwrap_or_default();
            ensure!(
                st.phase != Some(flexinfer_api::modelcache::CachePhase::Failed),
                "{name} Failed: {}",
                serde_json::to_string_pretty(&st)?
            );
            if let Some(p) = st.path.clone() {
                if verified_paths.insert(p.clone()) {
                    save_complete_verifies(&host_dir(dir, &p))
                        .with_context(|| format!("{name}: status.path {p}"))?;
                }
            }
            if st.phase == Some(flexinfer_api::modelcache::CachePhase::Ready) {
                ready += 1;
            }
        }
        if ready == n && kills_at.is_empty() {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(1500),
            "{ready}/{n} Ready after {:?} ({kills} controller kills)",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    ensure!(
        double_pods.is_empty(),
        "two live pods of one phase: {double_pods:?}"
    );
    // The end state: every served artifact whole and equal to its record; one path per cache.
    let mut artifacts = 0usize;
    for mc in api.list(&ListParams::default()).await?.items {
        let name = mc.metadata.name.clone().unwrap_or_default();
        let Some(dir) = dirs.get(&name) else { continue };
        let p = mc.status.and_then(|s| s.path).context("status.path")?;
        let art = host_dir(dir, &p);
        save_complete_verifies(&art)?;
        check_artifact(&art)?;
        artifacts += 1;
    }
    ensure!(artifacts == n, "{artifacts} artifacts for {n} caches");
    eprintln!(
        "concurrent pipelines: {n} caches Ready in {:.0}s, {kills} controller kills, {samples} samples, \
         0 double pods, {} paths verified when named, {artifacts} artifacts verified at the end",
        start.elapsed().as_secs_f64(),
        verified_paths.len()
    );
    for name in dirs.keys() {
        delete_cache(&c, &e, name).await;
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

/// The proxy's load test on the real node, CI-sized: 2,000 concurrent requests to a scaled-to-zero Model (the
/// stand-in serving tiny-llama from a claim) through ONE flexinfer-proxy pod of the chart (256 MiB memory limit,
/// checked in its cgroup): every request answered 200 or 429, the pod neither restarted nor OOM-killed, at most
/// two `lastActiveTime` writes per keepalive interval (every change of the value, from a watch on the Model);
/// then 8 bodies of 8 MB `{"model":[0,0,…]}` at once through the same pod: each 400 or 413, no restart.
/// Prints the answers by status, the writes, the proxy's peak memory and the times.
#[tokio::test]
async fn real_pipeline_proxy_holds_a_cold_start_stampede_and_wide_bodies() -> Result<()> {
    use futures::StreamExt;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::WatchParams;
    use std::sync::{Arc, Mutex};
    let _node = NODE.write().await;
    let e = Env::get()?;
    let c = client().await;
    let name = "load-stampede";
    let n: usize = std::env::var("E2E_STAMPEDE_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let keepalive = Duration::from_secs(2);

    // The Model's files: the hub's tiny-llama (safetensors, tokenizer) on a claim, served by the stand-in.
    let m: Api<Model> = Api::namespaced(c.clone(), &e.ns);
    let _ = m.delete(name, &DeleteParams::foreground()).await;
    wait_for(
        "the previous load-test Model gone",
        Duration::from_secs(60),
        || {
            let m = m.clone();
            async move { m.get_opt(name).await.ok().flatten().is_none().then_some(()) }
        },
    )
    .await?;
    let dir = storage(&c, &e, name).await?;
    let hub = PathBuf::from(var("TESTENV_DIR")?).join("hub/repos/models/flexinfer-demo/tiny-llama");
    let cp = Command::new("cp")
        .args([
            "-r",
            &hub.display().to_string(),
            &dir.join("tiny-llama").display().to_string(),
        ])
        .status()?;
    ensure!(cp.success(), "copy {} into the claim", hub.display());
    let own = Command::new("chown")
        .args(["-R", "65532:65532", &dir.display().to_string()])
        .status()?;
    ensure!(own.success(), "chown {}", dir.display());
    profile(&c, &e).await?;
    let place = e.real_node_placement();
    let model = json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "namespace": e.ns},
        "spec": {"backend": "vllm", "source": format!("pvc://{name}/tiny-llama"), "image": e.standin_image,
                 "gpu": {"count": 1, "profile": "e2e-gfx1100"},
                 "serverless": {"enabled": true, "minReplicas": 0, "idleTimeout": "10m",
                                "coldStartTimeout": "150s", "keepaliveInterval": format!("{}s", keepalive.as_secs())},
                 "resources": {"requests": {"memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                 "nodeSelector": place["nodeSelector"], "tolerations": place["tolerations"]},
    });
    apply(&c, &model, None, false)
        .await
        .context("apply the load-test Model")?;

    // Scaled to zero: its Deployment exists with 0 replicas and no pod runs; nothing has marked it active.
    let deps: Api<Deployment> = Api::namespaced(c.clone(), &e.ns);
    wait_for(
        "the Model's Deployment at 0 replicas",
        Duration::from_secs(60),
        || {
            let deps = deps.clone();
            async move {
                let d = deps.get_opt(name).await.ok().flatten()?;
                (d.spec.as_ref()?.replicas == Some(0)).then_some(())
            }
        },
    )
    .await?;
    let serving: Api<Pod> = Api::namespaced(c.clone(), &e.ns);
    let sel = ListParams::default().labels(&format!("flexinfer.ai/model={name}"));
    ensure!(
        serving.list(&sel).await?.items.is_empty(),
        "the Model is not scaled to zero: serving pods exist"
    );
    let before = m.get(name).await?;
    ensure!(
        before
            .status
            .as_ref()
            .and_then(|s| s.last_active_time.as_ref())
            .is_none(),
        "the new Model already has a lastActiveTime"
    );

    // One proxy pod, its limit as the kubelet set it, its process on this host.
    let proxies = proxy_pods(&c, &e).await?;
    let (proxy, base) = proxies.first().context("no ready proxy pod")?.clone();
    let addr = base.trim_start_matches("http://").to_string();
    wait_for(
        &format!("the proxy {proxy} knows the Model"),
        Duration::from_secs(60),
        || {
            let url = format!("{base}/v1/models");
            async move {
                let v: Value = serde_json::from_slice(&curl(&[&url]).ok()?).ok()?;
                v["data"]
                    .as_array()?
                    .iter()
                    .any(|m| m["id"] == name)
                    .then_some(())
            }
        },
    )
    .await?;
    let (restarts0, _, pod) = restarts(&c, &e, &proxy).await?;
    let limit = serde_json::to_value(
        &pod.spec.as_ref().context("proxy pod spec")?.containers[0].resources,
    )?["limits"]["memory"]
        .clone();
    ensure!(
        limit == "256Mi",
        "the proxy pod's memory limit is {limit}, not 256Mi"
    );
    let (pid, cgroup) = container_process(&pod, "flexinfer-proxy")?;
    let cg = cgroup.with_context(|| format!("memory cgroup of the proxy process {pid}"))?;
    let cg_limit = cgroup_bytes(&cg, "memory.limit_in_bytes")?;
    ensure!(
        cg_limit == 256 * 1024 * 1024,
        "the proxy's cgroup {} has memory.limit_in_bytes {cg_limit}, not 256 MiB",
        cg.display()
    );
    // Peak of this run only: the cgroup's high-water mark is reset (cgroup v1: write 0).
    std::fs::write(cg.join("memory.max_usage_in_bytes"), "0")
        .with_context(|| format!("reset {}/memory.max_usage_in_bytes", cg.display()))?;
    let rss0 = proc_status_bytes(pid, "VmRSS")?;
    let overflows0 = listen_overflows(pid)?;
    let cg0 = cgroup_bytes(&cg, "memory.usage_in_bytes")?;

    // Every change of status.lastActiveTime, from a watch that starts before the first request.
    let writes: Arc<Mutex<Vec<Time>>> = Arc::default();
    let rv = before.metadata.resource_version.clone().unwrap_or_default();
    let mut stream = m
        .watch(
            &WatchParams::default()
                .fields(&format!("metadata.name={name}"))
                .timeout(290),
            &rv,
        )
        .await
        .context("watch the Model")?
        .boxed();
    let watcher = {
        let writes = writes.clone();
        tokio::spawn(async move {
            let mut last = None;
            while let Some(ev) = stream.next().await {
                let model = match ev {
                    Ok(kube::api::WatchEvent::Added(m) | kube::api::WatchEvent::Modified(m)) => m,
                    Ok(kube::api::WatchEvent::Error(err)) => {
                        return Err(anyhow::anyhow!("watch: {err:?}"))
                    }
                    Ok(_) => continue,
                    Err(err) => return Err(anyhow::anyhow!("watch: {err}")),
                };
                let t = model.status.and_then(|s| s.last_active_time);
                if t.is_some() && t != last {
                    if let (Some(t), Ok(mut w)) = (t.clone(), writes.lock()) {
                        w.push(t);
                    }
                    last = t;
                }
            }
            Ok(())
        })
    };
    let patches0 = apiserver_model_status_patches()?;

    // The stampede: n requests at once, each on its own connection.
    let body = Arc::new(
        json!({"model": name, "prompt": "hello world", "max_tokens": 2})
            .to_string()
            .into_bytes(),
    );
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let (addr, body) = (addr.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let r = tokio::time::timeout(
                Duration::from_secs(240),
                post_raw(&addr, "/v1/completions", body),
            )
            .await;
            let r = match r {
                Ok(r) => r,
                Err(_) => Err(anyhow::anyhow!("no answer within 240 s")),
            };
            (r, start.elapsed())
        }));
    }
    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    let mut errors: Vec<String> = Vec::new();
    let mut no_retry_after = 0;
    let (mut first_200, mut last_answer) = (None::<Duration>, Duration::ZERO);
    for t in tasks {
        let (r, at) = t.await?;
        match r {
            Ok((code, head)) => {
                *by_status.entry(code).or_default() += 1;
                last_answer = last_answer.max(at);
                if code == 200 {
                    first_200 = Some(first_200.map_or(at, |f| f.min(at)));
                }
                if code == 429 && !head.to_ascii_lowercase().contains("\r\nretry-after:") {
                    no_retry_after += 1;
                }
            }
            Err(err) => errors.push(format!("{err:#}")),
        }
    }
    let stampede_s = start.elapsed().as_secs_f64();
    // A cold start: the serving pod that answered was created after the requests were sent (creation
    // times are whole seconds).
    let started_at = unix_seconds_ago(start.elapsed());
    let created: Vec<i64> = serving
        .list(&sel)
        .await?
        .items
        .iter()
        .filter_map(|p| Some(p.metadata.creation_timestamp.as_ref()?.0.as_second()))
        .collect();
    ensure!(
        !created.is_empty() && created.iter().all(|c| *c >= started_at - 1),
        "no serving pod created by the stampede (requests sent at {started_at} s, pods created at {created:?})"
    );
    // The writes while requests were in flight and one keepalive interval after.
    tokio::time::sleep(keepalive + Duration::from_secs(1)).await;
    let patches = apiserver_model_status_patches()? - patches0;
    let (restarts1, reason1, _) = restarts(&c, &e, &proxy).await?;
    let peak1 = cgroup_bytes(&cg, "memory.max_usage_in_bytes")?;
    let hwm1 = proc_status_bytes(pid, "VmHWM")?;
    let overflows = listen_overflows(pid)? - overflows0;
    let written: Vec<Time> = writes.lock().map(|w| w.clone()).unwrap_or_default();
    let written_s = written
        .last()
        .zip(written.first())
        .map_or(0.0, |(l, f)| l.0.duration_since(f.0).as_secs_f64());
    println!(
        "stampede: {n} requests through proxy pod {proxy} (limit 256 MiB): answers {by_status:?}, \
         errors {}; first 200 after {:.2} s, all answered after {:.2} s (total {stampede_s:.2} s); \
         lastActiveTime writes {} (values {:?}, over {written_s:.0} s; keepalive {keepalive:?}); \
         API-server PATCH models/status (all clients) {patches}; proxy cgroup peak {:.1} MiB (usage before {:.1} MiB), \
         process VmRSS before {:.1} MiB, VmHWM since start {:.1} MiB; accept-queue overflows {overflows}; \
         restarts {restarts1}",
        errors.len(),
        first_200.unwrap_or_default().as_secs_f64(),
        last_answer.as_secs_f64(),
        written.len(),
        written.iter().map(|t| t.0.to_string()).collect::<Vec<_>>(),
        peak1 as f64 / MIB,
        cg0 as f64 / MIB,
        rss0 as f64 / MIB,
        hwm1 as f64 / MIB,
    );
    if !errors.is_empty() {
        let pods: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
        let log = pods
            .logs(&proxy, &kube::api::LogParams::default())
            .await
            .unwrap_or_else(|err| format!("(no log: {err})"));
        let warnings: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .collect();
        bail!(
            "{} of {n} requests got no HTTP answer from the proxy {proxy} (accept-queue overflows in its network \
             namespace: {overflows}; its open-files limit: {}); first: \
             {:?}; the proxy's last warnings: {:?}",
            errors.len(),
            open_files_limit(pid),
            errors.iter().take(3).collect::<Vec<_>>(),
            &warnings[warnings.len().saturating_sub(5)..]
        );
    }
    ensure!(
        by_status.keys().all(|c| *c == 200 || *c == 429),
        "answers other than 200 and 429 through {proxy}: {by_status:?}"
    );
    ensure!(
        by_status.values().sum::<usize>() == n,
        "{n} requests, answers {by_status:?}"
    );
    ensure!(
        by_status.get(&200).copied().unwrap_or(0) > 0,
        "no request was served: the cold start did not complete ({by_status:?})"
    );
    ensure!(
        no_retry_after == 0,
        "{no_retry_after} answers 429 without Retry-After"
    );
    ensure!(
        restarts1 == restarts0 && restarts1 == 0 && reason1.is_none(),
        "the proxy pod {proxy} restarted during the stampede: restartCount {restarts1}, last termination {reason1:?}"
    );
    ensure!(!written.is_empty(), "the stampede wrote no lastActiveTime");
    // At most 2 writes in any keepalive interval: no three values closer than one interval. The values are
    // whole seconds (written ≤ 1 s before); writes one interval apart still read ≥ interval − 1 s apart, so
    // three writes in one interval read < interval apart.
    for w in written.windows(3) {
        let span = w[2].0.duration_since(w[0].0).as_secs_f64();
        ensure!(
            span >= keepalive.as_secs_f64(),
            "three lastActiveTime writes within {span} s (keepalive {keepalive:?}): {w:?}; all: {written:?}"
        );
    }

    // The wide-JSON bodies: 8 × 8 MB of {"model":[0,0,…]} at once through the same pod.
    let mut wide = Vec::with_capacity(8_000_001);
    wide.extend_from_slice(b"{\"model\":[0");
    while wide.len() + 2 < 8_000_001 {
        wide.extend_from_slice(b",0");
    }
    wide.extend_from_slice(b"]}");
    let wide = Arc::new(wide);
    std::fs::write(cg.join("memory.max_usage_in_bytes"), "0")
        .with_context(|| format!("reset {}/memory.max_usage_in_bytes", cg.display()))?;
    let start = Instant::now();
    let wide_answers = futures::future::join_all((0..8).map(|_| {
        let (addr, wide) = (addr.clone(), wide.clone());
        async move {
            tokio::time::timeout(
                Duration::from_secs(120),
                post_raw(&addr, "/v1/chat/completions", wide),
            )
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within 120 s")))
        }
    }))
    .await;
    let wide_s = start.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (restarts2, reason2, _) = restarts(&c, &e, &proxy).await?;
    let peak2 = cgroup_bytes(&cg, "memory.max_usage_in_bytes")?;
    let codes: Vec<String> = wide_answers
        .iter()
        .map(|r| match r {
            Ok((code, _)) => code.to_string(),
            Err(err) => format!("error: {err:#}"),
        })
        .collect();
    println!(
        "wide bodies: 8 × {} B through {proxy}: answers {codes:?} after {wide_s:.2} s; proxy cgroup peak \
         {:.1} MiB; restarts {restarts2}",
        wide.len(),
        peak2 as f64 / MIB
    );
    ensure!(
        wide_answers.iter().all(|r| matches!(r, Ok((400 | 413, _)))),
        "the 8 wide bodies through {proxy} were answered {codes:?} (400 or 413 expected)"
    );
    ensure!(
        restarts2 == 0 && reason2.is_none(),
        "the proxy pod {proxy} restarted after the wide bodies: restartCount {restarts2}, last termination {reason2:?}"
    );
    watcher.abort();
    m.delete(name, &DeleteParams::background()).await?;
    Ok(())
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

/// Every reference command of the GPTQ runbook works as written against the real node, in the state it
/// assumes: on a cache (any phase), on its running quantize Job (the worker container frozen with containerd
/// while the commands run, so the state holds; `exec` after it is thawed), on a failed cache (the recovery
/// steps), and on a Model with its pod. The commands come from the runbook itself (scripts/runbook/commands.py),
/// so a new command there is run here; the few that cannot run in this cluster (Flux, `kubectl top` without
/// metrics-server, the `make deploy-quantizer` synopsis) are listed with the reason.
#[tokio::test]
async fn real_pipeline_runbook_commands_work_as_written() -> Result<()> {
    let _node = NODE.read().await;
    let e = Env::get()?;
    let c = client().await;
    let cmds = runbook_commands()?;
    let of = |state: &str| -> Vec<&Value> { cmds.iter().filter(|c| c["state"] == state).collect() };
    for s in of("skip") {
        eprintln!(
            "runbook line {} not run here: {} ({})",
            s["line"], s["command"], s["reason"]
        );
    }
    for state in ["cache", "running", "failed", "model"] {
        ensure!(
            !of(state).is_empty(),
            "no runbook command of state {state}: the runbook or scripts/runbook/commands.py changed"
        );
    }
    let ns = e.ns.clone();

    // A GPTQ cache whose quantization runs long enough to be caught (the kill test's size).
    let name = "rb-gptq";
    let dir = start_cache(&c, &e, name, "flexinfer-demo/small-llama", "small-llama", json!({
        "quantization": {"format": "GPTQ", "bits": 4, "groupSize": 128, "maxMemoryGB": 4,
                         "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 64, "maxSeqLen": 512}},
    }))
    .await?;
    let mut seen = Observed::default();
    let (pod, cid, _) = running_quantize_with_a_cached_layer(&c, &e, name, &dir, &mut seen).await?;
    let qpod = pod.metadata.name.clone().unwrap_or_default();
    let cid = cid.trim_start_matches("containerd://").to_string();
    let ctr = |verb: &str| -> Result<()> {
        let o = Command::new("ctr")
            .args([
                "--address",
                &e.containerd,
                "-n",
                "k8s.io",
                "tasks",
                verb,
                &cid,
            ])
            .output()?;
        ensure!(
            o.status.success(),
            "ctr tasks {verb}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Ok(())
    };
    let subst = [
        ("<quantize pod>", qpod.as_str()),
        ("<name>", name),
        ("<cache>", name),
        ("<ns>", ns.as_str()),
    ];
    ctr("pause")?;
    let mut ran = 0;
    let frozen = async {
        for cmd in of("cache").into_iter().chain(of("running")) {
            let text = cmd["command"].as_str().unwrap_or_default();
            if text.contains(" exec ") || text.starts_with("kubectl delete job") {
                continue; // below, with the container running
            }
            run_runbook_command(&e, cmd, &subst)?;
            if text.starts_with("POD=") {
                // The assignment prints nothing; the same selector must find the running pod.
                let check = json!({"command": format!("{text}; test \"$POD\" = {qpod}"),
                                   "line": cmd["line"], "section": cmd["section"]});
                run_runbook_command(&e, &check, &subst)?;
            }
            ran += 1;
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    ctr("resume")?;
    frozen?;
    for cmd in of("running") {
        let text = cmd["command"].as_str().unwrap_or_default();
        if text.contains(" exec ") {
            let out = run_runbook_command(&e, cmd, &subst)?;
            ensure!(!out.trim().is_empty(), "`{text}` printed nothing");
            ran += 1;
        }
    }
    // Deleting the running Job (option B of "Failed but the run got ~90% through"): the controller creates it
    // again and the cache still ends Ready.
    for cmd in of("running") {
        if cmd["command"]
            .as_str()
            .unwrap_or_default()
            .starts_with("kubectl delete job")
        {
            run_runbook_command(&e, cmd, &subst)?;
            ran += 1;
        }
    }
    until_ready(&c, &e, name, &mut seen, Duration::from_secs(600)).await?;
    // A Ready cache: the reading commands again, and the CLI's status.
    for cmd in of("cache") {
        run_runbook_command(&e, cmd, &subst)?;
        ran += 1;
    }

    // A Model serving it, with its pod.
    let place = e.real_node_placement();
    let model = json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "namespace": e.ns},
        "spec": {"backend": "vllm", "source": format!("modelcache://{name}"), "image": e.standin_image,
                 "gpu": {"count": 1, "profile": "e2e-gfx1100"}, "serverless": {"enabled": false},
                 "resources": {"requests": {"memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                 "nodeSelector": place["nodeSelector"], "tolerations": place["tolerations"]},
    });
    apply(&c, &model, None, false)
        .await
        .context("apply Model")?;
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.ns);
    let sel = ListParams::default().labels(&format!("flexinfer.ai/model={name}"));
    let serving = wait_for("the Model's pod", Duration::from_secs(120), || {
        let pods = pods.clone();
        let sel = sel.clone();
        async move {
            pods.list(&sel)
                .await
                .ok()?
                .items
                .into_iter()
                .find_map(|p| p.metadata.name)
        }
    })
    .await?;
    let msubst = [
        ("<pod>", serving.as_str()),
        ("<name>", name),
        ("<ns>", ns.as_str()),
    ];
    for cmd in of("model") {
        run_runbook_command(&e, cmd, &msubst)?;
        ran += 1;
    }
    let models: Api<Model> = Api::namespaced(c.clone(), &e.ns);
    let _ = models.delete(name, &DeleteParams::default()).await;

    // A failed cache (a repository the hub does not have, no retries): the recovery steps.
    let failed = "rb-failed";
    start_cache(
        &c,
        &e,
        failed,
        "flexinfer-demo/no-such-model",
        "none",
        json!({"maxRetries": 0}),
    )
    .await?;
    let api: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    wait_for("the cache Failed", Duration::from_secs(180), || {
        let api = api.clone();
        async move {
            let mc = api.get_opt(failed).await.ok().flatten()?;
            let phase = serde_json::to_value(&mc.status).ok()?["phase"].clone();
            (phase == "Failed").then_some(())
        }
    })
    .await?;
    let fsubst = [
        ("<name>", failed),
        ("<cache>", failed),
        ("<ns>", ns.as_str()),
    ];
    for cmd in of("failed").into_iter().chain(of("cache")) {
        run_runbook_command(&e, cmd, &fsubst)?;
        ran += 1;
    }
    eprintln!("{ran} runbook commands ran as written");
    delete_cache(&c, &e, failed).await;
    delete_cache(&c, &e, name).await;
    Ok(())
}
