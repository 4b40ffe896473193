//! The other formats on the real path: GGUF served by llama-server, AWQ made on the CPU.

use super::*;

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
