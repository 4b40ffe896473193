//! Where serving pods land: the vendor-right image on each GPU, a NodeLocal copy only on nodes that hold it.

use super::*;

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
