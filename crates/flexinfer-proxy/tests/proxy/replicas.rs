//! A proxy replica killed mid-stream: the other serves.

use super::*;

/// HA: two proxy processes (the real binary) serve one Model. One is SIGKILLed in the middle of a
/// stream: that client's stream ends early, the backend sees its request released, and the other
/// replica serves new requests (streamed and not) with nothing to recover.
#[tokio::test]
async fn proxy_replica_killed_mid_stream_the_other_serves() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-ha").await.unwrap();
    let ns = tns.name.clone();
    let backend = start_backend("ha").await;
    apply_served_model(
        &client,
        &ns,
        "ha-model",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
               "serverless": {"enabled": false}}),
    )
    .await;
    publish_endpoint(&client, &ns, "ha-model", backend.addr, true).await;

    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let spawn = |name: &str| {
        let (port, health) = (free_port(), free_port());
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_flexinfer-proxy"))
            .args(["--log-text"])
            .env("FLEXINFER_PROXY_LISTEN_ADDR", format!("127.0.0.1:{port}"))
            .env("FLEXINFER_PROXY_HEALTH_ADDR", format!("127.0.0.1:{health}"))
            .env("FLEXINFER_PROXY_WATCH_NAMESPACE", &ns)
            .env("FLEXINFER_PROXY_KEEPALIVE_INTERVAL", "1s")
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start proxy {name}: {e}"));
        (child, format!("http://127.0.0.1:{port}"), health)
    };
    let (mut a, url_a, health_a) = spawn("a");
    let (mut b, url_b, health_b) = spawn("b");
    // Ready: caches synced and the Model routable through each replica.
    for (url, health) in [(&url_a, health_a), (&url_b, health_b)] {
        let ready = format!("http://127.0.0.1:{health}/readyz");
        tokio::time::timeout(WAIT, async {
            loop {
                let ok = http()
                    .get(&ready)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200);
                let routed = ok
                    && post(
                        url,
                        "/v1/chat/completions",
                        None,
                        &json!({"model": "ha-model", "messages": []}),
                    )
                    .await
                    .status()
                        == StatusCode::OK;
                if routed {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("proxy at {url} never became ready"));
    }

    // A long stream through A; A is killed after the first chunks.
    let mut stream = http()
        .post(format!("{url_a}/v1/chat/completions"))
        .json(&json!({"model": "ha-model", "stream": true, "max_tokens": 40, "delay_ms": 200}))
        .send()
        .await
        .unwrap()
        .bytes_stream();
    let mut got = Vec::new();
    while got.len() < 2 {
        match tokio::time::timeout(WAIT, stream.next()).await.unwrap() {
            Some(Ok(chunk)) => got.push(chunk),
            other => panic!("stream through A ended early: {other:?}"),
        }
    }
    let abandoned_before = backend.state.abandoned.load(Ordering::SeqCst);
    a.start_kill().unwrap(); // SIGKILL
    a.wait().await.unwrap();
    let rest = tokio::time::timeout(WAIT, async {
        let mut more = Vec::new();
        while let Some(Ok(chunk)) = stream.next().await {
            more.push(chunk);
        }
        more
    })
    .await
    .expect("the cut stream ends");
    let text: String = got
        .iter()
        .chain(&rest)
        .map(|c| String::from_utf8_lossy(c).to_string())
        .collect();
    assert!(
        !text.contains("[DONE]") && text.matches("data: ").count() < 40,
        "the stream through the killed replica was cut short: {text}"
    );
    // The backend sees its request go away (the killed replica's socket closed).
    tokio::time::timeout(WAIT, async {
        while backend.state.abandoned.load(Ordering::SeqCst) <= abandoned_before {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the backend request of the killed replica is released");

    // B serves new requests, streamed and not.
    let r = post(
        &url_b,
        "/v1/chat/completions",
        None,
        &json!({"model": "ha-model", "messages": []}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = post(
        &url_b,
        "/v1/chat/completions",
        None,
        &json!({"model": "ha-model", "stream": true, "max_tokens": 5}),
    )
    .await;
    assert_eq!(r.text().await.unwrap(), expected_sse(5));
    b.start_kill().unwrap();
    let _ = b.wait().await;
}
