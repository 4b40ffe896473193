//! A NodeLocal cache served from the node's copy.

use super::*;

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
