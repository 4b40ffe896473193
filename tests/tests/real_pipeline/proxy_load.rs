//! The Helm-installed proxy holds a cold-start stampede and wide bodies.

use super::*;

/// The proxy's load test on the real node, CI-sized: 2,000 concurrent requests to a scaled-to-zero Model (the
/// stand-in serving tiny-llama from a claim) through ONE flexinfer-proxy pod of the chart (256 MiB memory limit,
/// checked in its cgroup): every request answered 200 or 429, the pod neither restarted nor OOM-killed, at most
/// two `lastActiveTime` writes per keepalive interval (every change of the value, from a watch on the Model);
/// then 8 bodies of 8 MB `{"model":[0,0,…]}` at once through the same pod: each 400 or 413, no restart.
/// Prints the answers by status, the writes, the proxy's peak memory and the times.
#[tokio::test]
async fn real_pipeline_proxy_holds_a_cold_start_stampede_and_wide_bodies() -> Result<()> {
    use futures::StreamExt;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::WatchParams;
    use std::sync::{Arc, Mutex};
    let _node = NODE.write().await;
    let e = Env::get()?;
    let c = client().await;
    let name = "load-stampede";
    let n: usize = std::env::var("E2E_STAMPEDE_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let keepalive = Duration::from_secs(2);

    // The Model's files: the hub's tiny-llama (safetensors, tokenizer) on a claim, served by the stand-in.
    let m: Api<Model> = Api::namespaced(c.clone(), &e.ns);
    let _ = m.delete(name, &DeleteParams::foreground()).await;
    wait_for(
        "the previous load-test Model gone",
        Duration::from_secs(60),
        || {
            let m = m.clone();
            async move { m.get_opt(name).await.ok().flatten().is_none().then_some(()) }
        },
    )
    .await?;
    let dir = storage(&c, &e, name).await?;
    let hub = PathBuf::from(var("TESTENV_DIR")?).join("hub/repos/models/flexinfer-demo/tiny-llama");
    let cp = Command::new("cp")
        .args([
            "-r",
            &hub.display().to_string(),
            &dir.join("tiny-llama").display().to_string(),
        ])
        .status()?;
    ensure!(cp.success(), "copy {} into the claim", hub.display());
    let own = Command::new("chown")
        .args(["-R", "65532:65532", &dir.display().to_string()])
        .status()?;
    ensure!(own.success(), "chown {}", dir.display());
    profile(&c, &e).await?;
    let place = e.real_node_placement();
    let model = json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "namespace": e.ns},
        "spec": {"backend": "vllm", "source": format!("pvc://{name}/tiny-llama"), "image": e.standin_image,
                 "gpu": {"count": 1, "profile": "e2e-gfx1100"},
                 "serverless": {"enabled": true, "minReplicas": 0, "idleTimeout": "10m",
                                "coldStartTimeout": "150s", "keepaliveInterval": format!("{}s", keepalive.as_secs())},
                 "resources": {"requests": {"memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                 "nodeSelector": place["nodeSelector"], "tolerations": place["tolerations"]},
    });
    apply(&c, &model, None, false)
        .await
        .context("apply the load-test Model")?;

    // Scaled to zero: its Deployment exists with 0 replicas and no pod runs; nothing has marked it active.
    let deps: Api<Deployment> = Api::namespaced(c.clone(), &e.ns);
    wait_for(
        "the Model's Deployment at 0 replicas",
        Duration::from_secs(60),
        || {
            let deps = deps.clone();
            async move {
                let d = deps.get_opt(name).await.ok().flatten()?;
                (d.spec.as_ref()?.replicas == Some(0)).then_some(())
            }
        },
    )
    .await?;
    let serving: Api<Pod> = Api::namespaced(c.clone(), &e.ns);
    let sel = ListParams::default().labels(&format!("flexinfer.ai/model={name}"));
    ensure!(
        serving.list(&sel).await?.items.is_empty(),
        "the Model is not scaled to zero: serving pods exist"
    );
    let before = m.get(name).await?;
    ensure!(
        before
            .status
            .as_ref()
            .and_then(|s| s.last_active_time.as_ref())
            .is_none(),
        "the new Model already has a lastActiveTime"
    );

    // One proxy pod, its limit as the kubelet set it, its process on this host.
    let proxies = proxy_pods(&c, &e).await?;
    let (proxy, base) = proxies.first().context("no ready proxy pod")?.clone();
    let addr = base.trim_start_matches("http://").to_string();
    wait_for(
        &format!("the proxy {proxy} knows the Model"),
        Duration::from_secs(60),
        || {
            let url = format!("{base}/v1/models");
            async move {
                let v: Value = serde_json::from_slice(&curl(&[&url]).ok()?).ok()?;
                v["data"]
                    .as_array()?
                    .iter()
                    .any(|m| m["id"] == name)
                    .then_some(())
            }
        },
    )
    .await?;
    let (restarts0, _, pod) = restarts(&c, &e, &proxy).await?;
    let limit = serde_json::to_value(
        &pod.spec.as_ref().context("proxy pod spec")?.containers[0].resources,
    )?["limits"]["memory"]
        .clone();
    ensure!(
        limit == "256Mi",
        "the proxy pod's memory limit is {limit}, not 256Mi"
    );
    let (pid, cgroup) = container_process(&pod, "flexinfer-proxy")?;
    let cg = cgroup.with_context(|| format!("memory cgroup of the proxy process {pid}"))?;
    let cg_limit = cgroup_bytes(&cg, "memory.limit_in_bytes")?;
    ensure!(
        cg_limit == 256 * 1024 * 1024,
        "the proxy's cgroup {} has memory.limit_in_bytes {cg_limit}, not 256 MiB",
        cg.display()
    );
    // Peak of this run only: the cgroup's high-water mark is reset (cgroup v1: write 0).
    std::fs::write(cg.join("memory.max_usage_in_bytes"), "0")
        .with_context(|| format!("reset {}/memory.max_usage_in_bytes", cg.display()))?;
    let rss0 = proc_status_bytes(pid, "VmRSS")?;
    let overflows0 = listen_overflows(pid)?;
    let cg0 = cgroup_bytes(&cg, "memory.usage_in_bytes")?;

    // Every change of status.lastActiveTime, from a watch that starts before the first request.
    let writes: Arc<Mutex<Vec<Time>>> = Arc::default();
    let rv = before.metadata.resource_version.clone().unwrap_or_default();
    let mut stream = m
        .watch(
            &WatchParams::default()
                .fields(&format!("metadata.name={name}"))
                .timeout(290),
            &rv,
        )
        .await
        .context("watch the Model")?
        .boxed();
    let watcher = {
        let writes = writes.clone();
        tokio::spawn(async move {
            let mut last = None;
            while let Some(ev) = stream.next().await {
                let model = match ev {
                    Ok(kube::api::WatchEvent::Added(m) | kube::api::WatchEvent::Modified(m)) => m,
                    Ok(kube::api::WatchEvent::Error(err)) => {
                        return Err(anyhow::anyhow!("watch: {err:?}"))
                    }
                    Ok(_) => continue,
                    Err(err) => return Err(anyhow::anyhow!("watch: {err}")),
                };
                let t = model.status.and_then(|s| s.last_active_time);
                if t.is_some() && t != last {
                    if let (Some(t), Ok(mut w)) = (t.clone(), writes.lock()) {
                        w.push(t);
                    }
                    last = t;
                }
            }
            Ok(())
        })
    };
    let patches0 = apiserver_model_status_patches()?;

    // The stampede: n requests at once, each on its own connection.
    let body = Arc::new(
        json!({"model": name, "prompt": "hello world", "max_tokens": 2})
            .to_string()
            .into_bytes(),
    );
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let (addr, body) = (addr.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let r = tokio::time::timeout(
                Duration::from_secs(240),
                post_raw(&addr, "/v1/completions", body),
            )
            .await;
            let r = match r {
                Ok(r) => r,
                Err(_) => Err(anyhow::anyhow!("no answer within 240 s")),
            };
            (r, start.elapsed())
        }));
    }
    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    let mut errors: Vec<String> = Vec::new();
    let mut no_retry_after = 0;
    let (mut first_200, mut last_answer) = (None::<Duration>, Duration::ZERO);
    for t in tasks {
        let (r, at) = t.await?;
        match r {
            Ok((code, head)) => {
                *by_status.entry(code).or_default() += 1;
                last_answer = last_answer.max(at);
                if code == 200 {
                    first_200 = Some(first_200.map_or(at, |f| f.min(at)));
                }
                if code == 429 && !head.to_ascii_lowercase().contains("\r\nretry-after:") {
                    no_retry_after += 1;
                }
            }
            Err(err) => errors.push(format!("{err:#}")),
        }
    }
    let stampede_s = start.elapsed().as_secs_f64();
    // A cold start: the serving pod that answered was created after the requests were sent (creation
    // times are whole seconds).
    let started_at = unix_seconds_ago(start.elapsed());
    let created: Vec<i64> = serving
        .list(&sel)
        .await?
        .items
        .iter()
        .filter_map(|p| Some(p.metadata.creation_timestamp.as_ref()?.0.as_second()))
        .collect();
    ensure!(
        !created.is_empty() && created.iter().all(|c| *c >= started_at - 1),
        "no serving pod created by the stampede (requests sent at {started_at} s, pods created at {created:?})"
    );
    // The writes while requests were in flight and one keepalive interval after.
    tokio::time::sleep(keepalive + Duration::from_secs(1)).await;
    let patches = apiserver_model_status_patches()? - patches0;
    let (restarts1, reason1, _) = restarts(&c, &e, &proxy).await?;
    let peak1 = cgroup_bytes(&cg, "memory.max_usage_in_bytes")?;
    let hwm1 = proc_status_bytes(pid, "VmHWM")?;
    let overflows = listen_overflows(pid)? - overflows0;
    let written: Vec<Time> = writes.lock().map(|w| w.clone()).unwrap_or_default();
    let written_s = written
        .last()
        .zip(written.first())
        .map_or(0.0, |(l, f)| l.0.duration_since(f.0).as_secs_f64());
    println!(
        "stampede: {n} requests through proxy pod {proxy} (limit 256 MiB): answers {by_status:?}, \
         errors {}; first 200 after {:.2} s, all answered after {:.2} s (total {stampede_s:.2} s); \
         lastActiveTime writes {} (values {:?}, over {written_s:.0} s; keepalive {keepalive:?}); \
         API-server PATCH models/status (all clients) {patches}; proxy cgroup peak {:.1} MiB (usage before {:.1} MiB), \
         process VmRSS before {:.1} MiB, VmHWM since start {:.1} MiB; accept-queue overflows {overflows}; \
         restarts {restarts1}",
        errors.len(),
        first_200.unwrap_or_default().as_secs_f64(),
        last_answer.as_secs_f64(),
        written.len(),
        written.iter().map(|t| t.0.to_string()).collect::<Vec<_>>(),
        peak1 as f64 / MIB,
        cg0 as f64 / MIB,
        rss0 as f64 / MIB,
        hwm1 as f64 / MIB,
    );
    if !errors.is_empty() {
        let pods: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
        let log = pods
            .logs(&proxy, &kube::api::LogParams::default())
            .await
            .unwrap_or_else(|err| format!("(no log: {err})"));
        let warnings: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .collect();
        bail!(
            "{} of {n} requests got no HTTP answer from the proxy {proxy} (accept-queue overflows in its network \
             namespace: {overflows}; its open-files limit: {}); first: \
             {:?}; the proxy's last warnings: {:?}",
            errors.len(),
            open_files_limit(pid),
            errors.iter().take(3).collect::<Vec<_>>(),
            &warnings[warnings.len().saturating_sub(5)..]
        );
    }
    ensure!(
        by_status.keys().all(|c| *c == 200 || *c == 429),
        "answers other than 200 and 429 through {proxy}: {by_status:?}"
    );
    ensure!(
        by_status.values().sum::<usize>() == n,
        "{n} requests, answers {by_status:?}"
    );
    ensure!(
        by_status.get(&200).copied().unwrap_or(0) > 0,
        "no request was served: the cold start did not complete ({by_status:?})"
    );
    ensure!(
        no_retry_after == 0,
        "{no_retry_after} answers 429 without Retry-After"
    );
    ensure!(
        restarts1 == restarts0 && restarts1 == 0 && reason1.is_none(),
        "the proxy pod {proxy} restarted during the stampede: restartCount {restarts1}, last termination {reason1:?}"
    );
    ensure!(!written.is_empty(), "the stampede wrote no lastActiveTime");
    // At most 2 writes in any keepalive interval: no three values closer than one interval. The values are
    // whole seconds (written ≤ 1 s before); writes one interval apart still read ≥ interval − 1 s apart, so
    // three writes in one interval read < interval apart.
    for w in written.windows(3) {
        let span = w[2].0.duration_since(w[0].0).as_secs_f64();
        ensure!(
            span >= keepalive.as_secs_f64(),
            "three lastActiveTime writes within {span} s (keepalive {keepalive:?}): {w:?}; all: {written:?}"
        );
    }

    // The wide-JSON bodies: 8 × 8 MB of {"model":[0,0,…]} at once through the same pod.
    let mut wide = Vec::with_capacity(8_000_001);
    wide.extend_from_slice(b"{\"model\":[0");
    while wide.len() + 2 < 8_000_001 {
        wide.extend_from_slice(b",0");
    }
    wide.extend_from_slice(b"]}");
    let wide = Arc::new(wide);
    std::fs::write(cg.join("memory.max_usage_in_bytes"), "0")
        .with_context(|| format!("reset {}/memory.max_usage_in_bytes", cg.display()))?;
    let start = Instant::now();
    let wide_answers = futures::future::join_all((0..8).map(|_| {
        let (addr, wide) = (addr.clone(), wide.clone());
        async move {
            tokio::time::timeout(
                Duration::from_secs(120),
                post_raw(&addr, "/v1/chat/completions", wide),
            )
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within 120 s")))
        }
    }))
    .await;
    let wide_s = start.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (restarts2, reason2, _) = restarts(&c, &e, &proxy).await?;
    let peak2 = cgroup_bytes(&cg, "memory.max_usage_in_bytes")?;
    let codes: Vec<String> = wide_answers
        .iter()
        .map(|r| match r {
            Ok((code, _)) => code.to_string(),
            Err(err) => format!("error: {err:#}"),
        })
        .collect();
    println!(
        "wide bodies: 8 × {} B through {proxy}: answers {codes:?} after {wide_s:.2} s; proxy cgroup peak \
         {:.1} MiB; restarts {restarts2}",
        wide.len(),
        peak2 as f64 / MIB
    );
    ensure!(
        wide_answers.iter().all(|r| matches!(r, Ok((400 | 413, _)))),
        "the 8 wide bodies through {proxy} were answered {codes:?} (400 or 413 expected)"
    );
    ensure!(
        restarts2 == 0 && reason2.is_none(),
        "the proxy pod {proxy} restarted after the wide bodies: restartCount {restarts2}, last termination {reason2:?}"
    );
    watcher.abort();
    m.delete(name, &DeleteParams::background()).await?;
    Ok(())
}
