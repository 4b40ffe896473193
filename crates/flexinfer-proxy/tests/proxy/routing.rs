//! Routing, streaming and authentication, and the official OpenAI Python client against the proxy.

use super::*;

#[tokio::test]
async fn proxy_routes_streams_and_authenticates() {
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let ns = TestNamespace::new(&client, "proxy-route").await.unwrap();
    let ns = ns.name.clone();
    let a = start_backend("backend-a").await;
    let b = start_backend("backend-b").await;
    let spec = |aliases: Value| {
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
                                       "serverless": {"enabled": false}, "aliases": aliases})
    };
    apply_served_model(
        &client,
        &ns,
        "m-a",
        spec(json!(["alias-a", "org/Model-A:v1"])),
    )
    .await;
    apply_served_model(&client, &ns, "m-b", spec(json!([]))).await;
    // A hand-made slice carrying every label of m-a's real one (but no owner), pointing at m-b's
    // backend: in the proxy's initial list, never used.
    let hand_made = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "m-a-hand-made", "labels": {
            "kubernetes.io/service-name": "m-a",
            "endpointslice.kubernetes.io/managed-by": KCM_SLICE_MANAGER,
            "app.kubernetes.io/managed-by": "flexinfer",
            "app.kubernetes.io/component": "inference-server",
        }},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": b.addr.port(), "protocol": "TCP"}],
        "endpoints": [{"addresses": [b.addr.ip().to_string()]}],
    });
    Api::<EndpointSlice>::namespaced(client.clone(), &ns)
        .patch(
            "m-a-hand-made",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&hand_made),
        )
        .await
        .unwrap();
    publish_endpoint(&client, &ns, "m-a", a.addr, true).await;
    publish_endpoint(&client, &ns, "m-b", b.addr, true).await;
    // KEY reaches every namespace; the others only theirs.
    let keys =
        format!("{KEY}\nsk-elsewhere namespaces=elsewhere\nsk-own namespaces=elsewhere,{ns}");
    let p = start_proxy(&client, &ns, &keys, Duration::from_secs(30)).await;
    p.wait_routable(&ns, "m-a", 1).await;
    p.wait_routable(&ns, "m-b", 1).await;
    assert_eq!(
        p.proxy.cluster.backends(&(ns.clone(), "m-a".to_string())),
        vec![a.addr.to_string()],
        "only the slice of m-a's own Service is used"
    );
    let url = p.url.as_str();

    // Auth: no key, a wrong key, the right key.
    let e = error_of(
        http().get(format!("{url}/v1/models")).send().await.unwrap(),
        401,
    )
    .await;
    assert_eq!(e["code"], "invalid_api_key");
    let e = error_of(
        post(
            url,
            "/v1/chat/completions",
            Some("sk-wrong"),
            &json!({"model": "m-a"}),
        )
        .await,
        401,
    )
    .await;
    assert_eq!(e["code"], "invalid_api_key");
    assert!(
        a.state.requests.lock().unwrap().is_empty(),
        "nothing reached a backend without the key"
    );
    let list: Value = http()
        .get(format!("{url}/v1/models"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(list["object"], "list");
    assert_eq!(ids, vec!["alias-a", "m-a", "m-b", "org/Model-A:v1"]);
    let one: Value = http()
        .get(format!("{url}/v1/models/org/Model-A:v1"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(one["id"], "org/Model-A:v1");

    // A key scoped to other namespaces sees none of this namespace's Models, by any name.
    let list: Value = http()
        .get(format!("{url}/v1/models"))
        .bearer_auth("sk-elsewhere")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["data"], json!([]), "{list}");
    for model in ["alias-a", "m-a", &*format!("{ns}/m-a")] {
        let e = error_of(
            post(
                url,
                "/v1/chat/completions",
                Some("sk-elsewhere"),
                &json!({"model": model}),
            )
            .await,
            404,
        )
        .await;
        assert_eq!(e["code"], "model_not_found", "{model}");
    }
    assert!(
        a.state.requests.lock().unwrap().is_empty(),
        "nothing reached a backend out of the key's scope"
    );
    let r = post(
        url,
        "/v1/chat/completions",
        Some("sk-own"),
        &json!({"model": "alias-a"}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-backend"],
        "backend-a",
        "a key of the Model's namespace reaches it"
    );
    let _ = r.text().await;

    // Routing by name and alias; an alias is rewritten to the served name; the proxy's key stays.
    for (model, want_backend, served) in [
        ("alias-a", "backend-a", "m-a"),
        ("org/Model-A:v1", "backend-a", "m-a"),
        ("m-b", "backend-b", "m-b"),
        (&*format!("{ns}/m-b"), "backend-b", "m-b"),
    ] {
        let r = post(
            url,
            "/v1/chat/completions",
            Some(KEY),
            &json!({"model": model, "messages": [], "temperature": 0.5}),
        )
        .await;
        assert_eq!(r.status(), StatusCode::OK, "{model}");
        assert_eq!(r.headers()["x-backend"], want_backend, "{model}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            v["model"], served,
            "{model}: the backend saw the served name"
        );
    }
    {
        let reqs = a.state.requests.lock().unwrap();
        let (path, body, headers) = reqs.last().unwrap();
        assert_eq!(path, "/v1/chat/completions");
        assert_eq!(body["temperature"], 0.5, "the rest of the body is kept");
        assert!(
            headers.get("authorization").is_none(),
            "the proxy's key is not forwarded"
        );
    }
    let r = post(
        url,
        "/v1/embeddings",
        Some(KEY),
        &json!({"model": "m-b", "input": "x"}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        b.state.requests.lock().unwrap().last().unwrap().0,
        "/v1/embeddings"
    );

    // Bad input: unknown model, no model, not JSON, too large, wrong method/path.
    let e = error_of(
        post(
            url,
            "/v1/chat/completions",
            Some(KEY),
            &json!({"model": "gpt-9"}),
        )
        .await,
        404,
    )
    .await;
    assert_eq!(e["code"], "model_not_found");
    assert!(e["message"].as_str().unwrap().contains("gpt-9"));
    let e = error_of(
        post(url, "/v1/completions", Some(KEY), &json!({"prompt": "x"})).await,
        400,
    )
    .await;
    assert_eq!(e["param"], "model");
    let e = error_of(
        post(url, "/v1/completions", Some(KEY), &json!({"model": 7})).await,
        400,
    )
    .await;
    assert_eq!(e["param"], "model");
    let r = http()
        .post(format!("{url}/v1/completions"))
        .bearer_auth(KEY)
        .body("{not json")
        .send()
        .await
        .unwrap();
    error_of(r, 400).await;
    let e = error_of(
        post(url, "/v1/completions", Some(KEY), &json!(["alias-a"])).await,
        400,
    )
    .await;
    assert!(
        e["message"].as_str().unwrap().contains("JSON object"),
        "{e}"
    );
    let big = json!({"model": "m-a", "prompt": "x".repeat(2 << 20)});
    let e = error_of(post(url, "/v1/completions", Some(KEY), &big).await, 413).await;
    assert_eq!(e["code"], "request_too_large");
    let r = http()
        .post(format!("{url}/v1/completions"))
        .bearer_auth(KEY)
        .body(reqwest::Body::wrap_stream(futures::stream::iter(
            (0..40).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b' '; 64 << 10]))),
        )))
        .send()
        .await
        .unwrap();
    error_of(r, 413).await; // chunked, no Content-Length: the limit holds while reading
    error_of(
        http()
            .get(format!("{url}/v1/chat/completions"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap(),
        405,
    )
    .await;
    error_of(
        http()
            .get(format!("{url}/v2/x"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;

    // SSE passes through unchanged and as it is produced: the first event arrives while the
    // backend still holds the rest.
    let r = post(
        url,
        "/v1/chat/completions",
        Some(KEY),
        &json!({"model": "alias-a", "stream": true, "hold": true, "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let mut stream = r.bytes_stream();
    let mut got = Vec::new();
    while got.len() < sse_event(0).len() {
        let chunk = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("the first SSE event arrives before the stream ends")
            .unwrap()
            .unwrap();
        got.extend_from_slice(&chunk);
    }
    assert_eq!(String::from_utf8_lossy(&got), sse_event(0));
    a.state.release.notify_one();
    while let Some(c) = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .unwrap()
    {
        got.extend_from_slice(&c.unwrap());
    }
    assert_eq!(
        String::from_utf8(got).unwrap(),
        expected_sse(4),
        "byte-for-byte"
    );
    assert_eq!(a.state.abandoned.load(Ordering::SeqCst), 0);

    // A client that goes away mid-stream releases the backend's stream.
    let r = post(
        url,
        "/v1/chat/completions",
        Some(KEY),
        &json!({"model": "m-a", "stream": true, "hold": true, "max_tokens": 4}),
    )
    .await;
    let mut stream = r.bytes_stream();
    let _first = stream.next().await.unwrap().unwrap();
    let abandoned = a.state.abandoned_notify.notified();
    drop(stream);
    tokio::time::timeout(Duration::from_secs(10), abandoned)
        .await
        .expect("backend stream dropped after the client left");
    assert_eq!(a.state.abandoned.load(Ordering::SeqCst), 1);
    assert_eq!(
        p.proxy.activity.total_in_flight(),
        0,
        "in-flight count released"
    );

    // Back-pressure: a client that stops reading stops the backend (no response is buffered).
    let r = post(
        url,
        "/v1/chat/completions",
        Some(KEY),
        &json!({"model": "m-b", "flood": true}),
    )
    .await;
    let mut stream = r.bytes_stream();
    let _ = stream.next().await.unwrap().unwrap();
    // An unbounded pull would show itself within 2 s.
    flexinfer_e2e::holds_for(
        "the proxy pulling less than 64 MiB for a client that reads nothing",
        Duration::from_secs(2),
        || b.state.produced.load(Ordering::SeqCst) < 64 << 20,
    )
    .await
    .unwrap();
    drop(stream);
}

/// The official `openai` Python client (PyPI) against the proxy: model list, a chat completion,
/// a streamed one (deltas in order), and the error classes it maps 404 and 401 to. The venv comes
/// from scripts/install-deps.sh; `scripts/test.sh` exports `FLEXINFER_OPENAI_PYTHON`.
#[tokio::test]
async fn proxy_works_with_the_official_openai_python_client() {
    let python = std::env::var("FLEXINFER_OPENAI_PYTHON").unwrap_or_else(|_| {
        panic!(
            "FLEXINFER_OPENAI_PYTHON is not set: run scripts/install-deps.sh and point it at \
             ~/.cache/flexinfer/openai-venv-<version>/bin/python (scripts/test.sh does)"
        )
    });
    let client = client().await;
    install_crds(&client).await.expect("install the CRDs");
    let tns = TestNamespace::new(&client, "proxy-openai").await.unwrap();
    let ns = tns.name.clone();
    let backend = start_backend("py").await;
    apply_served_model(
        &client,
        &ns,
        "py-model",
        json!({"backend": "vllm", "source": "pvc://models/m", "gpu": {"vendor": "nvidia"},
               "serverless": {"enabled": false}}),
    )
    .await;
    publish_endpoint(&client, &ns, "py-model", backend.addr, true).await;
    let p = start_proxy(&client, &ns, KEY, Duration::from_secs(30)).await;
    p.wait_routable(&ns, "py-model", 1).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/proxy/openai_client_check.py"
    );
    let out = tokio::process::Command::new(&python)
        .args([script, p.url.as_str(), KEY, "py-model"])
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {python}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai client check failed:\n{stdout}\n{stderr}"
    );
    let seen: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        seen["stream"],
        json!(["tok0", "tok1", "tok2", "tok3", "tok4"])
    );
    assert_eq!(seen["not_found"]["status"], 404);
    // The backend saw the streamed request with the body the client wrote.
    let reqs = backend.state.requests.lock().unwrap();
    assert!(
        reqs.iter()
            .any(|(path, v, _)| path == "/v1/chat/completions" && v["stream"] == true),
        "{:?}",
        reqs.iter().map(|r| &r.0).collect::<Vec<_>>()
    );
}
