//! A shared GPU group: preemption, serving and the lane handed back.

use super::*;

/// Two profiles on one shared GPU group (a warm primary and a canary), with the real Model controller: a
/// warm primary (250) serves; a request for the scale-to-zero canary (255) preempts it (the
/// primary goes to zero before the canary starts), the canary serves, goes idle, and the primary
/// comes back. A lower-priority Model's request queues behind the primary and fails with a 504
/// that says so.
#[tokio::test]
async fn proxy_shared_gpu_group_preempts_serves_and_hands_the_lane_back() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-shared").await.unwrap();
    let ns = tns.name.clone();
    let metrics = flexinfer_controller::metrics::Metrics::new().unwrap();
    let opts = flexinfer_controller::model::Options {
        namespace: Some(ns.clone()),
        profile_namespace: None,
        render: Default::default(),
        preemption_grace: Some(Duration::from_secs(5)),
    };
    let (c, m) = (client.clone(), metrics.clone());
    let controller = tokio::spawn(async move {
        let _ = flexinfer_controller::model::run_with(c, m, opts).await;
    });
    let primary_backend = start_backend("primary").await;
    let canary_backend = start_backend("canary").await;
    let member = |priority: i32, min: i32, cold: &str| {
        json!({"backend": "vllm", "source": "pvc://models/m",
        "gpu": {"vendor": "nvidia", "shared": "gpu0", "priority": priority},
        // Unschedulable on purpose (see proxy_scales_from_zero_keeps_alive_and_lets_idle).
        "nodeSelector": {"kubernetes.io/hostname": "no-such-node"},
        "serverless": {"minReplicas": min, "idleTimeout": "6s", "keepaliveInterval": "1s",
                       "coldStartTimeout": cold}})
    };
    apply_model(&client, &ns, "primary", member(250, 1, "45s")).await;
    apply_model(&client, &ns, "canary", member(255, 0, "45s")).await;
    apply_model(&client, &ns, "batch", member(100, 0, "3s")).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let models: Api<Model> = Api::namespaced(client.clone(), &ns);
    let replicas_are = |n: i32| {
        move |d: Option<&Deployment>| {
            d.and_then(|d| d.spec.as_ref()).and_then(|s| s.replicas) == Some(n)
        }
    };
    let shared_state = |m: &Model| {
        m.status
            .as_ref()
            .and_then(|s| s.shared_group.as_ref())
            .map(|g| g.state)
    };
    use flexinfer_api::model::SharedGroupState;
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "primary", replicas_are(1)),
    )
    .await
    .expect("the warm primary takes the lane")
    .unwrap();
    publish_endpoint(&client, &ns, "primary", primary_backend.addr, true).await;
    let p = start_proxy_trusting(
        &client,
        &ns,
        "",
        Duration::from_secs(30),
        TEST_SLICE_MANAGER,
    )
    .await;
    p.wait_routable(&ns, "primary", 1).await;
    let r = post(
        &p.url,
        "/v1/chat/completions",
        None,
        &json!({"model": "primary", "messages": []}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);

    // Lower priority: queued behind the primary; its cold start times out with the reason.
    p.wait_cache("batch", |c| {
        c.model(&(ns.clone(), "batch".into())).is_some()
    })
    .await;
    let e = error_of(
        post(
            &p.url,
            "/v1/completions",
            None,
            &json!({"model": "batch", "prompt": "x"}),
        )
        .await,
        504,
    )
    .await;
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("Queued") && msg.contains("behind primary"),
        "{msg}"
    );
    let b = models.get("batch").await.unwrap();
    assert_eq!(shared_state(&b), Some(SharedGroupState::Queued));
    assert_eq!(
        deployments
            .get("batch")
            .await
            .unwrap()
            .spec
            .and_then(|s| s.replicas),
        Some(0),
        "the queued Model never started"
    );

    // Sample both Deployments while the canary is asked for: the primary must be at zero before
    // the canary is scaled up.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let sampler = {
        let deployments = deployments.clone();
        tokio::spawn(async move {
            loop {
                let p = deployments.get("primary").await.unwrap();
                let c = deployments.get("canary").await.unwrap();
                let _ = tx.send((
                    p.spec.and_then(|s| s.replicas),
                    c.spec.and_then(|s| s.replicas),
                ));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let url = p.url.clone();
    let canary_req = tokio::spawn(async move {
        let r = post(
            &url,
            "/v1/chat/completions",
            None,
            &json!({"model": "canary", "messages": []}),
        )
        .await;
        (
            r.status(),
            r.headers()
                .get("x-backend")
                .map(|v| v.to_str().unwrap().to_string()),
        )
    });
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "primary", replicas_are(0)),
    )
    .await
    .expect("the primary is preempted")
    .unwrap();
    // The endpoint controller's part: the primary's pod is gone.
    publish_endpoint(&client, &ns, "primary", primary_backend.addr, false).await;
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "canary", replicas_are(1)),
    )
    .await
    .expect("the canary gets the lane")
    .unwrap();
    publish_endpoint(&client, &ns, "canary", canary_backend.addr, true).await;
    let (status, via) = tokio::time::timeout(WAIT, canary_req)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(via.as_deref(), Some("canary"));
    sampler.abort();
    let mut samples = Vec::new();
    while let Ok(s) = rx.try_recv() {
        samples.push(s);
    }
    assert!(
        samples
            .iter()
            .all(|(p, c)| !(*p == Some(1) && *c == Some(1))),
        "never both scaled up: {samples:?}"
    );
    let pm = models.get("primary").await.unwrap();
    let pg = pm
        .status
        .as_ref()
        .and_then(|s| s.shared_group.clone())
        .unwrap();
    assert_eq!(pg.state, SharedGroupState::Preempted);
    assert_eq!(pg.preempted_by.as_deref(), Some("canary"));
    // The status follows the scale-up in the same reconcile.
    tokio::time::timeout(
        WAIT,
        await_condition(models.clone(), "canary", move |m: Option<&Model>| {
            m.and_then(shared_state) == Some(SharedGroupState::Active)
        }),
    )
    .await
    .expect("the canary is Active")
    .unwrap();
    let text = metrics.render();
    assert!(
        text.contains(&format!(
            r#"flexinfer_model_preemptions_total{{group="gpu0",model="primary",namespace="{ns}"}} 1"#
        )),
        "{text}"
    );
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), &ns);
    let reasons: Vec<String> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some("primary"))
        .filter_map(|e| e.reason)
        .collect();
    assert!(
        reasons.iter().any(|r| r == "SharedGroupPreempted"),
        "{reasons:?}"
    );

    // The canary idles out (6 s); the lane goes back to the warm primary.
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "canary", replicas_are(0)),
    )
    .await
    .expect("the canary idles out")
    .unwrap();
    publish_endpoint(&client, &ns, "canary", canary_backend.addr, false).await;
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "primary", replicas_are(1)),
    )
    .await
    .expect("the primary comes back")
    .unwrap();
    tokio::time::timeout(
        WAIT,
        await_condition(models.clone(), "primary", |m: Option<&Model>| {
            m.and_then(|m| m.status.as_ref())
                .and_then(|s| s.shared_group.as_ref())
                .is_some_and(|g| g.state == SharedGroupState::Active)
        }),
    )
    .await
    .expect("the primary is Active again")
    .unwrap();
    publish_endpoint(&client, &ns, "primary", primary_backend.addr, true).await;
    p.wait_routable(&ns, "primary", 1).await;
    let r = post(
        &p.url,
        "/v1/chat/completions",
        None,
        &json!({"model": "primary", "messages": []}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers().get("x-backend").unwrap(), "primary");
    controller.abort();
}
