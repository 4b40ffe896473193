//! Bad input is reported, not crash-looped; foreign objects are left alone; a stale status write is refused.

use super::*;

#[tokio::test]
async fn model_bad_input_is_reported_not_crashlooped() {
    let env = TestEnv::new("mdl-bad").await;
    let amd = json!({"vendor": "amd"});
    env.apply::<Model>(model_json("gguf-on-vllm", &[], json!({"backend": "vllm", "source": "pvc://m/x.gguf", "gpu": amd, "config": {"quantization": "gguf"}}))).await;
    env.apply::<Model>(model_json("exl2-on-ollama", &[], json!({"backend": "ollama", "source": "pvc://m/x", "gpu": amd, "config": {"quantization": "exl2"}}))).await;
    env.apply::<Model>(model_json(
        "no-cache",
        &[],
        json!({"backend": "vllm", "source": "modelcache://nope", "gpu": amd}),
    ))
    .await;
    env.apply::<Model>(model_json(
        "no-profile",
        &[],
        json!({"backend": "vllm", "source": "pvc://m/x", "gpu": {"profile": "late"}}),
    ))
    .await;
    env.apply::<Model>(model_json(
        "abs-path",
        &[],
        json!({"backend": "vllm", "source": "pvc://m//etc/passwd", "gpu": amd}),
    ))
    .await;
    env.apply::<Model>(model_json(
        "cuda-on-amd",
        &[],
        json!({"backend": "vllm", "source": "pvc://m/x", "gpu": amd,
               "image": "docker.io/vllm/vllm-openai:v0.18.0"}),
    ))
    .await;

    for name in ["gguf-on-vllm", "exl2-on-ollama"] {
        let m = env
            .wait_model(
                name,
                "ConfigValid=False BackendUnsupported",
                cond_is(types::CONFIG_VALID, "False", "BackendUnsupported"),
            )
            .await;
        assert_eq!(
            m.status.as_ref().and_then(|s| s.phase),
            Some(ModelPhase::Failed)
        );
        assert!(
            env.api::<Deployment>()
                .get_opt(name)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .is_none(),
            "{name}: nothing deployed"
        );
        assert!(
            env.api::<Service>()
                .get_opt(name)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .is_none(),
            "{name}: nothing deployed"
        );
    }
    let m = env
        .wait_model(
            "no-cache",
            "Cached=False CacheNotFound",
            cond_is(types::CACHED, "False", "CacheNotFound"),
        )
        .await;
    assert_eq!(
        m.status.as_ref().and_then(|s| s.phase),
        Some(ModelPhase::Pending)
    );
    assert!(cond(&m, types::CACHED).is_some_and(|c| c.message.contains("nope")));
    let m = env
        .wait_model(
            "no-profile",
            "ConfigValid=False GPUProfileNotFound",
            cond_is(types::CONFIG_VALID, "False", "GPUProfileNotFound"),
        )
        .await;
    assert!(cond(&m, types::CONFIG_VALID).is_some_and(|c| c.message.contains("late")));
    let m = env
        .wait_model(
            "abs-path",
            "ConfigValid=False InvalidSource",
            cond_is(types::CONFIG_VALID, "False", "InvalidSource"),
        )
        .await;
    assert!(
        cond(&m, types::CONFIG_VALID).is_some_and(|c| c.message.contains("absolute")),
        "{:?}",
        cond(&m, types::CONFIG_VALID)
    );
    assert!(env
        .api::<Deployment>()
        .get_opt("abs-path")
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_none());

    // Another vendor's image: ConfigValid=False, a Warning Event naming the field and the fix,
    // nothing deployed.
    let m = env
        .wait_model(
            "cuda-on-amd",
            "ConfigValid=False ImageVendorMismatch",
            cond_is(types::CONFIG_VALID, "False", "ImageVendorMismatch"),
        )
        .await;
    assert_eq!(
        m.status.as_ref().and_then(|s| s.phase),
        Some(ModelPhase::Failed)
    );
    let ev = env
        .wait_event("cuda-on-amd", "ImageVendorMismatch", |e| {
            e.reason.as_deref() == Some("ImageVendorMismatch")
        })
        .await;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    assert!(
        ev.note
            .as_deref()
            .is_some_and(|n| n.contains("spec.image") && n.contains("vllm-openai-rocm")),
        "{:?}",
        ev.note
    );
    assert!(env
        .api::<Deployment>()
        .get_opt("cuda-on-amd")
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_none());

    // The CRD rejects what it can at admission, naming the field.
    let err = env
        .api::<Model>()
        .patch("dotdot", &PatchParams::apply(MANAGER), &Patch::Apply(json!({"apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
            "metadata": {"name": "dotdot", "namespace": env.ns.name}, "spec": {"backend": "vllm", "source": "pvc://m/../etc"}})))
        .await
        .err()
        .unwrap_or_else(|| panic!("pvc:// with '..' was admitted"));
    assert!(err.to_string().contains("spec.source"), "{err}");

    // No status churn: reconciles of a settled invalid Model write nothing (the other Models of
    // this namespace, requeued with backoff, count too; the nudges make this one due at once).
    let reconciles = || {
        let text = env.metrics.render();
        async move { flexinfer_e2e::reconciles_total(&text, "model") }
    };
    flexinfer_e2e::assert_no_status_churn(
        &env.api::<Model>(),
        "gguf-on-vllm",
        "model",
        3,
        reconciles,
    )
    .await
    .unwrap_or_else(|e| panic!("status rewritten without a change: {e:#}"));

    // A deleted Model leaves no metric series behind.
    assert!(env.metrics.render().contains("model=\"exl2-on-ollama\""));
    env.api::<Model>()
        .delete("exl2-on-ollama", &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "the metrics of the deleted Model to go",
        Duration::from_secs(30),
        || {
            let kept = env.metrics.render().contains("model=\"exl2-on-ollama\"");
            async move { (!kept).then_some(()) }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));

    // Fixing the input recovers without a restart: the missing GPUProfile appears.
    let mut profile = example("gpuprofile-gfx1100.yaml");
    profile["metadata"]["name"] = json!("late");
    env.apply::<GPUProfile>(profile).await;
    let m = env
        .wait_model(
            "no-profile",
            "deployed once the GPUProfile exists",
            phase_is(ModelPhase::Idle),
        )
        .await;
    assert!(cond(&m, types::CONFIG_VALID).is_some_and(|c| c.status == "True"));
    assert!(env
        .api::<Deployment>()
        .get_opt("no-profile")
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_some());
    // ... and the missing ModelCache appears (not Ready yet).
    env.apply::<ModelCache>(
        json!({"apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "nope"}, "spec": {"source": "org/nope"}}),
    )
    .await;
    env.wait_model(
        "no-cache",
        "Cached=False CacheNotReady",
        cond_is(types::CACHED, "False", "CacheNotReady"),
    )
    .await;
    env.cleanup().await;
}

/// A Model named like an existing Deployment and Service it does not control
/// leaves them alone (no server-side apply, no owner reference, so no garbage collection when the
/// Model goes), and says so in its Ready condition and a Warning Event.
#[tokio::test]
async fn model_leaves_foreign_objects_alone() {
    let env = TestEnv::new("mdl-foreign").await;
    let web = json!({"app": "web"});
    // The selector and strategy the controller would render, so a forced apply would succeed (and
    // take the Deployment over, as a controller that did not check ownership would).
    let selector = json!({labels::INSTANCE: "taken", labels::MODEL: "taken"});
    env.apply::<Deployment>(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "taken", "labels": web},
        "spec": {"replicas": 0, "selector": {"matchLabels": selector}, "strategy": {"type": "Recreate"},
                 "template": {"metadata": {"labels": selector},
                              "spec": {"containers": [{"name": "web", "image": "registry.example.com/web:1"}]}}}
    }))
    .await;
    env.apply::<Service>(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "taken", "labels": web},
        "spec": {"selector": web, "ports": [{"name": "web", "port": 80, "targetPort": 8080}]}
    }))
    .await;
    // Let the Deployment controller finish its own status writes before taking the snapshot.
    let dep_before = env
        .wait_deployment("taken", "settled by the Deployment controller", |d| {
            let st = d.status.clone().unwrap_or_default();
            st.observed_generation == d.metadata.generation
                && st.conditions.iter().flatten().any(|c| {
                    c.type_ == "Progressing"
                        && c.reason.as_deref() == Some("NewReplicaSetAvailable")
                })
                && st
                    .conditions
                    .iter()
                    .flatten()
                    .any(|c| c.type_ == "Available")
        })
        .await;
    let svc_before = env
        .api::<Service>()
        .get("taken")
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let spec = |extra: Value| {
        let mut s = json!({"backend": "vllm", "source": "pvc://w/x", "gpu": {"vendor": "nvidia"},
            "nodeSelector": {"kubernetes.io/hostname": "kwok-sm89"}, "serverless": {"minReplicas": 1}});
        if let (Some(s), Some(e)) = (s.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                s.insert(k.clone(), v.clone());
            }
        }
        s
    };
    env.apply::<Model>(model_json("taken", &[], spec(json!({}))))
        .await;
    // A Model with children of its own: their garbage collection shows when GC has run.
    env.apply::<Model>(model_json(
        "mine",
        &[],
        spec(json!({"serverless": {"minReplicas": 0}})),
    ))
    .await;

    let m = env
        .wait_model(
            "taken",
            "Ready=False ResourceConflict",
            cond_is(types::READY, "False", "ResourceConflict"),
        )
        .await;
    assert_eq!(
        m.status.as_ref().and_then(|s| s.phase),
        Some(ModelPhase::Failed)
    );
    let msg = cond(&m, types::READY)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        msg.contains("Deployment taken") && msg.contains("has no owner"),
        "{msg}"
    );
    let ev = env
        .wait_event("taken", "ResourceConflict", |e| {
            e.reason.as_deref() == Some("ResourceConflict")
        })
        .await;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    assert!(
        ev.note
            .as_deref()
            .is_some_and(|n| n.contains("Deployment taken")),
        "{:?}",
        ev.note
    );
    env.wait_deployment("mine", "created", |_| true).await;
    env.wait_object(
        "mine",
        "Service created",
        |_: &Service| true,
        |s: Option<Service>| format!("{s:?}"),
    )
    .await;

    let untouched = |what: &str, dep: &Deployment, svc: &Service| {
        assert_eq!(
            dep.resource_version(),
            dep_before.resource_version(),
            "{what}: Deployment written"
        );
        assert_eq!(dep.spec, dep_before.spec, "{what}: Deployment spec changed");
        assert_eq!(dep.metadata.owner_references, None, "{what}");
        assert_eq!(
            svc.resource_version(),
            svc_before.resource_version(),
            "{what}: Service written"
        );
        assert_eq!(svc.spec, svc_before.spec, "{what}: Service spec changed");
        assert_eq!(svc.metadata.owner_references, None, "{what}");
        for managed in [&dep.metadata.managed_fields, &svc.metadata.managed_fields] {
            assert!(
                !managed
                    .iter()
                    .flatten()
                    .any(|f| f.manager.as_deref() == Some(FIELD_MANAGER)),
                "{what}: the controller manages fields of a foreign object"
            );
        }
    };
    let get = || async {
        let d = env.api::<Deployment>().get("taken").await;
        let s = env.api::<Service>().get("taken").await;
        (
            d.unwrap_or_else(|e| panic!("foreign Deployment: {e}")),
            s.unwrap_or_else(|e| panic!("foreign Service: {e}")),
        )
    };
    let (d, s) = get().await;
    untouched("after the Model was reconciled", &d, &s);

    // Deleting the Models: "mine"'s children are collected, the foreign objects stay.
    for name in ["taken", "mine"] {
        env.api::<Model>()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("delete {name}: {e}"));
    }
    wait_for(
        "the owned children of the deleted Model to be garbage collected",
        WAIT,
        || {
            let (deployments, services) = (env.api::<Deployment>(), env.api::<Service>());
            async move {
                let gone = deployments
                    .get_opt("mine")
                    .await
                    .unwrap_or_else(|e| panic!("{e}"))
                    .is_none()
                    && services
                        .get_opt("mine")
                        .await
                        .unwrap_or_else(|e| panic!("{e}"))
                        .is_none();
                gone.then_some(())
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let (d, s) = get().await;
    untouched("after the Model was deleted", &d, &s);
    env.cleanup().await;
}

/// The controller's status write is conditional on the resourceVersion it planned from: a plan
/// made from a stale object cannot overwrite a newer status (e.g. take back `validatedArtifact`).
#[tokio::test]
async fn model_status_write_from_a_stale_object_is_refused() {
    use flexinfer_controller::model::{write_status, Error as ModelError};
    let env = TestEnv::new("mdl-stale").await;
    // No controller: the write itself is under test, and nothing else may write the status.
    env.controller.abort();
    let api = env.api::<Model>();
    let created = api
        .create(
            &Default::default(),
            &serde_json::from_value(model_json(
                "s",
                &[],
                json!({"backend": "vllm", "source": "pvc://c/p"}),
            ))
            .unwrap_or_else(|e| panic!("{e}")),
        )
        .await
        .unwrap_or_else(|e| panic!("create: {e}"));
    let stale_rv = created.resource_version();
    let newer = flexinfer_api::ModelStatus {
        phase: Some(ModelPhase::Ready),
        validated_artifact: Some("sha256:new".into()),
        ..Default::default()
    };
    write_status(&api, "s", stale_rv.as_deref(), &newer)
        .await
        .unwrap_or_else(|e| panic!("first write: {e}"));
    let older = flexinfer_api::ModelStatus {
        phase: Some(ModelPhase::Pending),
        validated_artifact: Some("sha256:old".into()),
        ..Default::default()
    };
    let r = write_status(&api, "s", stale_rv.as_deref(), &older).await;
    assert!(matches!(r, Err(ModelError::Conflict)), "{r:?}");
    let now = api.get("s").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        now.status.and_then(|s| s.validated_artifact).as_deref(),
        Some("sha256:new"),
        "the newer status stands"
    );
    env.cleanup().await;
}
