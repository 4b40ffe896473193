//! The promotion gate of a quantized artifact, case by case.

use super::*;

#[tokio::test]
async fn model_promotion_gate_cases() {
    let mut env = TestEnv::new("mdl-gate").await;
    env.pvc("w").await;
    env.apply::<GPUProfile>(example("gpuprofile-gfx1100.yaml"))
        .await;
    // The Gemma4 primary/canary Models, as shipped under deploy/examples.
    env.apply::<ModelCache>(example("modelcache-gemma4-31b-gptq.yaml"))
        .await;
    env.api::<ModelCache>()
        .patch_status("gemma4-31b-gptq", &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Ready", "path": "gemma4-31b-gptq:gemma4-31b-gptq/gptq-w4-g128-keqv"}})))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for f in [
        "model-gemma4-31b-gptq.yaml",
        "model-gemma4-26b-a4b-gptq-long.yaml",
        "model-gemma4-31b-gptq-fp8kv-canary.yaml",
    ] {
        env.apply::<Model>(example(f)).await;
    }
    let gate = |reason: &'static str| cond_is(types::PROMOTION_GATE, "True", reason);
    let m = env
        .wait_model(
            "gemma4-31b-gptq",
            "PromotionGate Validated",
            gate("Validated"),
        )
        .await;
    let d = env
        .api::<Deployment>()
        .get("gemma4-31b-gptq")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        replicas(&d),
        Some(1),
        "validated warm primary keeps a replica"
    );
    let c = container(&d);
    assert_eq!(arg_after(&c, "--max-model-len").as_deref(), Some("2048"));
    assert_eq!(
        arg_after(&c, "--gpu-memory-utilization").as_deref(),
        Some("0.95")
    );
    assert_eq!(
        arg_after(&c, "--kv-cache-dtype").as_deref(),
        Some("float16")
    );
    assert!(cond(&m, types::CACHED).is_some_and(|c| c.status == "True"));
    env.wait_model(
        "gemma4-26b-a4b-gptq-long",
        "PromotionGate Canary",
        gate("Canary"),
    )
    .await;
    let m = env
        .wait_model(
            "gemma4-26b-a4b-gptq-long",
            "Idle canary",
            phase_is(ModelPhase::Idle),
        )
        .await;
    assert!(cond(&m, types::PROMOTION_GATE).is_some_and(|c| c.reason == "Canary"));
    let d = env
        .api::<Deployment>()
        .get("gemma4-26b-a4b-gptq-long")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(replicas(&d), Some(0));
    let c = container(&d);
    for (flag, want) in [
        ("--max-model-len", "16384"),
        ("--kv-cache-dtype", "fp8_e4m3"),
        ("--max-num-batched-tokens", "160"),
        ("--gpu-memory-utilization", "0.98"),
    ] {
        assert_eq!(arg_after(&c, flag).as_deref(), Some(want), "{flag}");
    }
    let annos = d
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.annotations.clone())
        .unwrap_or_default();
    assert_eq!(
        annos.get(annotations::GPU_PRIORITY).map(String::as_str),
        Some("255")
    );
    env.wait_model(
        "gemma4-31b-gptq-fp8kv-canary",
        "PromotionGate Canary",
        gate("Canary"),
    )
    .await;
    env.wait_model(
        "gemma4-31b-gptq-fp8kv-canary",
        "Idle",
        phase_is(ModelPhase::Idle),
    )
    .await;

    // Gate cases of docs/user/promotion-gate.md on GPUs of the sm89 node (no profile: vendor given).
    let gated = [(annotations::PROMOTION_GATE, annotations::PROMOTION_GATE_V1)];
    let base = |extra: Value| {
        let mut s = json!({"backend": "vllm", "source": "pvc://w/x", "gpu": {"vendor": "nvidia"},
            "nodeSelector": {"kubernetes.io/hostname": "kwok-sm89"}});
        if let (Some(s), Some(e)) = (s.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                s.insert(k.clone(), v.clone());
            }
        }
        s
    };
    env.apply::<Model>(model_json(
        "ungated",
        &[],
        base(json!({"serverless": {"minReplicas": 1}})),
    ))
    .await;
    env.apply::<Model>(model_json("canary", &gated, base(json!({}))))
        .await;
    env.apply::<Model>(model_json(
        "blocked-min",
        &gated,
        base(json!({"serverless": {"minReplicas": 1}})),
    ))
    .await;
    env.apply::<Model>(model_json(
        "blocked-off",
        &gated,
        base(json!({"serverless": {"enabled": false}})),
    ))
    .await;
    env.apply::<Model>(model_json(
        "blocked-primary",
        &gated,
        base(json!({"config": {"warmPolicy": "primary"}})),
    ))
    .await;

    let m = env
        .wait_model("ungated", "Ready", phase_is(ModelPhase::Ready))
        .await;
    assert!(cond(&m, types::PROMOTION_GATE).is_none());
    env.wait_model("canary", "Canary", gate("Canary")).await;
    for name in ["blocked-min", "blocked-off", "blocked-primary"] {
        let m = env
            .wait_model(
                name,
                "PromotionGate Blocked",
                cond_is(types::PROMOTION_GATE, "False", "Blocked"),
            )
            .await;
        let msg = cond(&m, types::PROMOTION_GATE)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        assert!(
            msg.contains(annotations::PROMOTION_VALIDATION)
                && msg.contains(annotations::PROMOTION_EVIDENCE),
            "{name}: {msg}"
        );
        let m = env
            .wait_model(name, "runs as an Idle canary", phase_is(ModelPhase::Idle))
            .await;
        assert!(cond(&m, types::PROMOTION_GATE).is_some_and(|c| c.reason == "Blocked"));
        let d = env
            .api::<Deployment>()
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            replicas(&d),
            Some(0),
            "{name}: a blocked promotion scales to zero"
        );
        let ev = env
            .wait_event(name, "PromotionBlocked", |e| {
                e.reason.as_deref() == Some(reasons::PROMOTION_BLOCKED)
            })
            .await;
        assert_eq!(ev.type_.as_deref(), Some("Warning"));
        assert!(
            ev.note
                .as_deref()
                .is_some_and(|n| n.contains(annotations::PROMOTION_VALIDATION)),
            "{:?}",
            ev.note
        );
    }
    // Validation and evidence lift the block.
    let annotate = |name: &'static str, key: &'static str, value: Value| {
        let api = env.api::<Model>();
        async move {
            api.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {key: value}}})),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        }
    };
    annotate(
        "blocked-min",
        annotations::PROMOTION_VALIDATION,
        json!("passed"),
    )
    .await;
    annotate(
        "blocked-off",
        annotations::PROMOTION_EVIDENCE,
        json!("docs/user/promotion-gate.md#run-1"),
    )
    .await;
    annotate("blocked-primary", annotations::PROMOTION_GATE, Value::Null).await;
    for name in ["blocked-min", "blocked-off"] {
        env.wait_model(name, "PromotionGate Validated", gate("Validated"))
            .await;
        env.wait_model(name, "Ready as warm primary", phase_is(ModelPhase::Ready))
            .await;
        let d = env
            .api::<Deployment>()
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ready_replicas(&d), 1, "{name}");
    }
    // Ungating removes the stale condition.
    let m = env
        .wait_model("blocked-primary", "no PromotionGate condition", |m| {
            m.status
                .as_ref()
                .is_some_and(|s| conditions::find(&s.conditions, types::PROMOTION_GATE).is_none())
        })
        .await;
    assert!(m.status.is_some());
    env.wait_model(
        "blocked-primary",
        "Ready as ungated primary",
        phase_is(ModelPhase::Ready),
    )
    .await;
    env.cleanup().await;
}
