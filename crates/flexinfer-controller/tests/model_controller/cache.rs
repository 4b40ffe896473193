//! A Model follows its ModelCache: not ready, ready, requantized, a new artifact promoted.

use super::*;

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
