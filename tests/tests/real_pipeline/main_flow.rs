//! The main job: download, abliterate, quantize, publish and serve.

use super::*;

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
