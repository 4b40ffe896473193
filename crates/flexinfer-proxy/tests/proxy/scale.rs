//! Scale from zero, keepalive and idle, cold-start timeouts, and the throttled lastActiveTime writes across replicas.

use super::*;

#[tokio::test]
async fn proxy_scales_from_zero_keeps_alive_and_lets_idle() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-cold").await.unwrap();
    let ns = tns.name.clone();
    let metrics = flexinfer_controller::metrics::Metrics::new().unwrap();
    let opts = flexinfer_controller::model::Options {
        namespace: Some(ns.clone()),
        profile_namespace: None,
        render: Default::default(),
        preemption_grace: None,
    };
    let (c, m) = (client.clone(), metrics.clone());
    let controller = tokio::spawn(async move {
        let _ = flexinfer_controller::model::run_with(c, m, opts).await;
    });
    let backend = start_backend("cold").await;
    // Unschedulable on purpose: in cluster mode no kwok pod (with an unreachable fake IP) may
    // become the endpoint; the test publishes the endpoint itself.
    apply_model(
        &client,
        &ns,
        "cold",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
        "nodeSelector": {"kubernetes.io/hostname": "no-such-node"},
        "serverless": {"idleTimeout": "6s", "keepaliveInterval": "1s", "coldStartTimeout": "45s"}}),
    )
    .await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let models: Api<Model> = Api::namespaced(client.clone(), &ns);
    let replicas_are = |n: i32| {
        move |d: Option<&Deployment>| {
            d.and_then(|d| d.spec.as_ref()).and_then(|s| s.replicas) == Some(n)
        }
    };
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "cold", replicas_are(0)),
    )
    .await
    .unwrap()
    .unwrap();
    tokio::time::timeout(
        WAIT,
        await_condition(models.clone(), "cold", |m: Option<&Model>| {
            m.and_then(|m| m.status.as_ref()).and_then(|s| s.phase) == Some(ModelPhase::Idle)
        }),
    )
    .await
    .unwrap()
    .unwrap();
    let p = start_proxy_trusting(
        &client,
        &ns,
        "",
        Duration::from_secs(30),
        TEST_SLICE_MANAGER,
    )
    .await;
    p.wait_routable(&ns, "cold", 0).await;

    // A request for the idle Model marks it active; the controller scales it up; the request
    // waits until the endpoint is ready and then succeeds.
    let url = p.url.clone();
    let pending = tokio::spawn(async move {
        let r = post(
            &url,
            "/v1/chat/completions",
            None,
            &json!({"model": "cold", "messages": []}),
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
        await_condition(deployments.clone(), "cold", replicas_are(1)),
    )
    .await
    .expect("the controller scales the Model up on demand")
    .unwrap();
    let m = models.get("cold").await.unwrap();
    assert!(last_active(&m).is_some(), "the proxy wrote lastActiveTime");
    flexinfer_e2e::holds_for(
        "the request is held while no endpoint is ready",
        Duration::from_millis(500),
        || !pending.is_finished(),
    )
    .await
    .unwrap();
    publish_endpoint(&client, &ns, "cold", backend.addr, false).await; // starting, not ready
    flexinfer_e2e::holds_for(
        "a not-ready endpoint is not used",
        Duration::from_millis(500),
        || !pending.is_finished(),
    )
    .await
    .unwrap();
    publish_endpoint(&client, &ns, "cold", backend.addr, true).await;
    let (status, via) = tokio::time::timeout(WAIT, pending).await.unwrap().unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(via.as_deref(), Some("cold"));
    // The cold start is on /metrics: one wait that ended ready, nothing queued any more, the
    // time to first byte includes the wait.
    let text = String::from_utf8(p.proxy.metrics.render(&[])).unwrap();
    let series = format!(r#"model="cold",namespace="{ns}""#);
    assert!(
        text.contains(&format!(
            "flexinfer_proxy_cold_starts_total{{{series},result=\"ready\"}} 1"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("flexinfer_proxy_waiting_requests{{{series}}} 0")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "flexinfer_proxy_requests_total{{code=\"200\",{series}}} 1"
        )),
        "{text}"
    );
    let ttfb_sum: f64 = text
        .lines()
        .find(|l| {
            l.starts_with(&format!(
                "flexinfer_proxy_time_to_first_byte_seconds_sum{{{series}}}"
            ))
        })
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(
        ttfb_sum >= 0.5,
        "first byte after the held wait: {ttfb_sum}\n{text}"
    );

    // A streamed request longer than idleTimeout keeps the Model up and lastActiveTime fresh.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let watch_deploy = {
        let deployments = deployments.clone();
        let models = models.clone();
        tokio::spawn(async move {
            loop {
                let d = deployments.get("cold").await.unwrap();
                let m = models.get("cold").await.unwrap();
                let _ = tx.send((d.spec.and_then(|s| s.replicas), last_active(&m)));
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let r = post(
        &p.url,
        "/v1/chat/completions",
        None,
        &json!({"model": "cold", "stream": true, "max_tokens": 20, "delay_ms": 500}),
    )
    .await;
    let text = r.text().await.unwrap();
    assert_eq!(text, expected_sse(20));
    let ended = tokio::time::Instant::now();
    watch_deploy.abort();
    let mut samples = Vec::new();
    while let Ok(s) = rx.try_recv() {
        samples.push(s);
    }
    assert!(samples.len() > 20, "sampled during the 10 s stream");
    assert!(
        samples.iter().all(|(r, _)| *r == Some(1)),
        "never scaled down mid-request: {samples:?}"
    );
    let mut stamps: Vec<Timestamp> = samples.iter().filter_map(|(_, t)| *t).collect();
    stamps.dedup();
    assert!(
        stamps.len() >= 5,
        "lastActiveTime advanced during the stream: {stamps:?}"
    );

    // After the last request: idle → zero after idleTimeout, not before.
    tokio::time::timeout(
        WAIT,
        await_condition(deployments.clone(), "cold", replicas_are(0)),
    )
    .await
    .expect("scaled back to zero after idleTimeout")
    .unwrap();
    let idle_after = ended.elapsed();
    assert!(
        idle_after >= Duration::from_secs(4),
        "scaled down {idle_after:?} after the request ended (idleTimeout 6s)"
    );
    controller.abort();
}

#[tokio::test]
async fn proxy_cold_start_timeout_and_unservable_models() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-timeout").await.unwrap();
    let ns = tns.name.clone();
    apply_model(
        &client,
        &ns,
        "never",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
        "serverless": {"coldStartTimeout": "2s"}}),
    )
    .await;
    apply_model(
        &client,
        &ns,
        "broken",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"}}),
    )
    .await;
    let models: Api<Model> = Api::namespaced(client.clone(), &ns);
    let status = json!({"status": {"phase": "Failed", "conditions": [{"type": "ConfigValid", "status": "False",
        "reason": "BackendUnsupported", "message": "backend vllm cannot serve gguf artifacts",
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    models
        .patch_status("broken", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let p = start_proxy(&client, &ns, "", Duration::from_secs(30)).await;
    p.wait_cache("broken with its status", |c| {
        c.model(&(ns.clone(), "broken".into()))
            .and_then(|m| m.status.clone())
            .is_some()
            && c.model(&(ns.clone(), "never".into())).is_some()
    })
    .await;

    let t0 = tokio::time::Instant::now();
    let e = error_of(
        post(
            &p.url,
            "/v1/completions",
            None,
            &json!({"model": "never", "prompt": "x"}),
        )
        .await,
        504,
    )
    .await;
    let waited = t0.elapsed();
    assert_eq!(e["code"], "cold_start_timeout");
    let text = String::from_utf8(p.proxy.metrics.render(&[])).unwrap();
    assert!(
        text.contains(&format!(
            r#"flexinfer_proxy_cold_starts_total{{model="never",namespace="{ns}",result="timeout"}} 1"#
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            r#"flexinfer_proxy_requests_total{{code="504",model="never",namespace="{ns}"}} 1"#
        )),
        "{text}"
    );
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("{ns}/never")) && msg.contains("coldStartTimeout"),
        "{msg}"
    );
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(15),
        "{waited:?}"
    );
    assert!(
        last_active(&models.get("never").await.unwrap()).is_some(),
        "the request marked the Model active"
    );

    let t0 = tokio::time::Instant::now();
    let e = error_of(
        post(
            &p.url,
            "/v1/completions",
            None,
            &json!({"model": "broken", "prompt": "x"}),
        )
        .await,
        503,
    )
    .await;
    assert!(t0.elapsed() < Duration::from_secs(2), "refused at once");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("BackendUnsupported"),
        "{e}"
    );
}

#[tokio::test]
async fn proxy_last_active_time_is_throttled_across_replicas() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-throttle").await.unwrap();
    let ns = tns.name.clone();
    let backend = start_backend("shared").await;
    apply_served_model(
        &client,
        &ns,
        "busy",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
        "serverless": {"idleTimeout": "5m", "keepaliveInterval": "2s"}}),
    )
    .await;
    publish_endpoint(&client, &ns, "busy", backend.addr, true).await;
    // Two proxy replicas, each with its own caches, both serving long streams of the same Model.
    let p1 = start_proxy(&client, &ns, "", Duration::from_secs(30)).await;
    let p2 = start_proxy(&client, &ns, "", Duration::from_secs(30)).await;
    p1.wait_routable(&ns, "busy", 1).await;
    p2.wait_routable(&ns, "busy", 1).await;
    let models: Api<Model> = Api::namespaced(client.clone(), &ns);
    let stream = json!({"model": "busy", "stream": true, "max_tokens": 16, "delay_ms": 500});
    let t0 = tokio::time::Instant::now();
    let (r1, r2) = tokio::join!(
        async {
            post(&p1.url, "/v1/chat/completions", None, &stream)
                .await
                .text()
                .await
                .unwrap()
        },
        async {
            post(&p2.url, "/v1/chat/completions", None, &stream)
                .await
                .text()
                .await
                .unwrap()
        },
    );
    assert_eq!(r1, expected_sse(16));
    assert_eq!(r2, expected_sse(16));
    // Let the end-of-request writes happen (at most one interval later).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let window = t0.elapsed().as_secs_f64();
    let writes = p1.proxy.cluster.writes() + p2.proxy.cluster.writes();
    // Once per 2 s across both replicas (+1 for the first write); each replica alone would do
    // as many, so together without coordination about twice that.
    let max = (window / 2.0).ceil() as u64 + 1;
    assert!(writes >= 3, "start + keepalives + end: {writes} writes");
    assert!(
        writes <= max,
        "{writes} writes in {window:.1}s at 2s intervals (max {max})"
    );
    let last = last_active(&models.get("busy").await.unwrap()).unwrap();
    let age = Timestamp::now().duration_since(last);
    assert!(
        age.as_secs() <= 6,
        "lastActiveTime reflects the end of the requests: {age:?} old"
    );
    // The proxy's cache and the server agree on what was written.
    assert!(p1.proxy.activity.total_in_flight() == 0 && p2.proxy.activity.total_in_flight() == 0);
}
