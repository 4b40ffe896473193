//! Every backend renders, runs and reports its phase and metrics.

use super::*;

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
