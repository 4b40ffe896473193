//! Kills and replacements: the controller and the worker killed, a new quantizer image mid-run, the controller killed during concurrent pipelines.

use super::*;

#[tokio::test]
async fn real_pipeline_survives_controller_and_worker_kills() -> Result<()> {
    let _node = NODE.read().await;
    let e = Env::get()?;
    let c = client().await;
    // A real Prometheus scrapes the controller through the whole test and evaluates the chart's alert rules
    // (the controller's metrics address is configured, so it is the same after the controller is killed).
    let controllers: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
    let targets: Vec<String> = controllers
        .list(&ListParams::default().labels("app.kubernetes.io/component=controller"))
        .await?
        .items
        .iter()
        .filter_map(metrics_target)
        .collect();
    ensure!(!targets.is_empty(), "no controller metrics address");
    let prom = Prometheus::start().await?;
    let name = "small-kill";
    let dir = start_cache(&c, &e, name, "flexinfer-demo/small-llama", "small-llama", json!({
        "quantization": {"format": "GPTQ", "bits": 4, "groupSize": 128, "maxMemoryGB": 4, "useGPU": true,
                         "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 64, "maxSeqLen": 512}},
    }))
    .await?;
    let mut seen = Observed::default();
    let jobs: Api<Job> = Api::namespaced(c.clone(), &e.ns);
    let job_name = format!("{name}-quantize");
    // The worker is killed first, the moment a running container has cached a layer, so the kill never
    // depends on how fast this machine quantizes; the controller is killed next, while the Job must still run
    // the retry (the kill left work undone).
    let (running, cid, manifest) =
        running_quantize_with_a_cached_layer(&c, &e, name, &dir, &mut seen).await?;
    let job = jobs
        .get(&job_name)
        .await
        .with_context(|| format!("Job {job_name}"))?;
    let uid = job.metadata.uid.clone();
    // The cache asks for a GPU and this node has none: the controller's gauge says so while the worker runs
    // (the FlexInferQuantizationOnCPU alert's input).
    let on_cpu = "flexinfer_quantization_on_cpu{";
    let (cr, er) = (&c, &e);
    let gauge = wait_for(
        "flexinfer_quantization_on_cpu 1",
        Duration::from_secs(20),
        || async move {
            let lines = controller_metric(cr, er, on_cpu, name, None).await.ok()?;
            lines.iter().any(|l| l.ends_with(" 1")).then_some(lines)
        },
    )
    .await;
    let gauge = match gauge {
        Ok(g) => g,
        Err(err) => {
            let mut diag = Vec::new();
            let _ = controller_metric(&c, &e, on_cpu, name, Some(&mut diag)).await;
            bail!("{err:#}; scraped: {diag:#?}");
        }
    };

    // 1. SIGKILL the worker container mid-quantization (through the node's containerd).
    let layers_before = cached_layers(&manifest);
    let cid = cid.trim_start_matches("containerd://");
    let k = Command::new("ctr")
        .args([
            "--address",
            &e.containerd,
            "-n",
            "k8s.io",
            "tasks",
            "kill",
            "-s",
            "SIGKILL",
            cid,
        ])
        .output()?;
    ensure!(
        k.status.success(),
        "ctr kill: {}",
        String::from_utf8_lossy(&k.stderr)
    );
    let killed = running.metadata.name.clone().unwrap_or_default();

    // 2. Kill the controller pod while the Job still has the retry to run; its replacement adopts the
    // running Job.
    let cpods: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
    let sel = ListParams::default().labels("app.kubernetes.io/component=controller");
    let old: Vec<String> = cpods
        .list(&sel)
        .await?
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    ensure!(!old.is_empty(), "no controller pod in {}", e.controller_ns);
    for p in &old {
        cpods
            .delete(
                p,
                &DeleteParams {
                    grace_period_seconds: Some(0),
                    ..DeleteParams::default()
                },
            )
            .await?;
    }
    // The cache is observed all the while: the retry runs (and reports progress through the replacement)
    // while the new pod waits for its readiness probe.
    let start = Instant::now();
    loop {
        observe_once(&c, &e, name, &mut seen).await?;
        let l = cpods.list(&sel).await?;
        let ready = l.items.iter().any(|p| {
            !old.contains(p.metadata.name.as_ref().unwrap_or(&String::new()))
                && p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        });
        if ready {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(120),
            "no new controller pod Ready after 120 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let after = jobs.get(&job_name).await?;
    ensure!(
        after.metadata.uid == uid,
        "the quantize Job was recreated after the controller restart"
    );
    let mc = until_ready(&c, &e, name, &mut seen, Duration::from_secs(900)).await?;
    ensure!(
        layers_before < 12,
        "the kill came after the last layer ({layers_before} cached)"
    );
    let (_, kp) = seen.pods.get(&killed).context("killed pod observed")?;
    let code = kp["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"].as_i64();
    ensure!(code == Some(137), "killed worker exit code {code:?}");
    let retry = seen
        .pods
        .iter()
        .find(|(n, (ph, p))| {
            *n != &killed
                && ph == "quantize"
                && p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        })
        .map(|(n, _)| n.clone())
        .context("a retried quantize pod that succeeded")?;
    // The worker's termination message carries the device report (the route that fills the status when the
    // log was not read in time), and `applied` the setting only.
    let (_, rp) = seen.pods.get(&retry).context("retry pod observed")?;
    let message = rp["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
        .as_str()
        .context("the retry pod's termination message")?;
    let term: Value =
        serde_json::from_str(message).with_context(|| format!("termination message {message}"))?;
    ensure!(
        term["gptqDevice"]["device"] == "cpu-faer"
            && term["gptqDevice"]["kind"] == "cpu"
            && term["gptqDevice"]["requested"] == "auto"
            && term["gptqDevice"]["reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("auto: no usable GPU (hip: "))
            && term["applied"]["gptqDevice"] == "auto"
            && term["applied"].get("gptqDeviceUsed").is_none(),
        "the retry's termination message: {message}"
    );
    let logs = Command::new("kubectl")
        .args(["logs", "-n", &e.ns, &retry])
        .output()?;
    let logs = String::from_utf8_lossy(&logs.stdout);
    let resumed = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == "quantization_resume_loaded")
        .context("no quantization_resume_loaded event in the retry's log")?;
    ensure!(
        resumed["layers"]
            .as_u64()
            .is_some_and(|n| n as usize >= layers_before),
        "resumed {resumed}"
    );

    // The retry ran inside the same Job: neither crash made the controller replace it.
    ensure!(
        jobs.get(&job_name).await?.metadata.uid == uid,
        "the quantize Job was replaced"
    );
    check_pods(&e, &seen, &["download", "quantize"])?;
    let path = mc["status"]["path"].as_str().context("status.path")?;
    ensure!(
        path.starts_with(&format!("{name}:small-llama/gptq-w4-g128.")),
        "status.path {path}"
    );
    let art = host_dir(&dir, path);
    check_artifact(&art)?;
    // Progress advanced through values the worker reported while quantizing.
    let mid: BTreeSet<i64> = seen
        .progress
        .iter()
        .filter(|(p, v)| p == "quantization" && *v > 0 && *v < 100)
        .map(|(_, v)| *v)
        .collect();
    ensure!(
        mid.len() >= 2,
        "intermediate quantize progress values {mid:?} (all: {:?})",
        seen.progress
    );
    // The device was in the status while the worker ran (from its gptq_device_selected event in the log the
    // controller tails), not only from the termination message at the end; and it is still there.
    ensure!(
        seen.devices_while_quantizing == BTreeSet::from(["cpu-faer".to_string()]),
        "status.quantization.gptqDevice while quantizing: {:?}",
        seen.devices_while_quantizing
    );
    ensure!(
        mc["status"]["quantization"]["gptqDevice"] == "cpu-faer",
        "status.quantization.gptqDevice at the end: {}",
        mc["status"]["quantization"]["gptqDevice"]
    );
    // The gauge (seen as {gauge:?} while quantizing) is gone once the Job has ended, so the alert stops.
    wait_for(
        "flexinfer_quantization_on_cpu dropped after the run",
        Duration::from_secs(30),
        || async move {
            controller_metric(cr, er, on_cpu, name, None)
                .await
                .ok()
                .filter(Vec::is_empty)
        },
    )
    .await
    .with_context(|| format!("the on-CPU gauge while quantizing was {gauge:?}"))?;
    // Prometheus scraped that gauge and the chart's FlexInferQuantizationOnCPU fired from it (its `for`
    // shortened to 1s), and the alert resolved once the Job had ended.
    let firing = format!(
        "ALERTS{{alertname=\"FlexInferQuantizationOnCPU\",alertstate=\"firing\",model=\"{name}\"}}"
    );
    let fired = prom.query(&format!("max_over_time({firing}[1h])"))?;
    // One series whatever pod was scraped (the controller pod is replaced during the test: the `pod` target
    // label changes); `exported_namespace` is kept so a renamed label would show.
    let scraped = prom.query(&format!(
        "max by (model, namespace, exported_namespace) (max_over_time(flexinfer_quantization_on_cpu{{model=\"{name}\"}}[1h]))"
    ))?;
    let one = |r: &[Value]| r.len() == 1 && r[0]["value"][1] == "1";
    ensure!(
        one(&scraped) && one(&fired),
        "Prometheus (scraping the chart's ServiceMonitor targets; controller at {targets:?}): the gauge's maximum {scraped:?}, the alert firing {fired:?}; log: {}",
        prom.log()
    );
    // The cache lives in another namespace than the controller: the series and the alert carry the cache's own
    // namespace (the ServiceMonitor's honorLabels), not the scraped Service's, and no `exported_namespace`.
    for (what, r) in [("gauge", &scraped), ("alert", &fired)] {
        let m = &r[0]["metric"];
        ensure!(
            m["namespace"] == e.ns.as_str() && m.get("exported_namespace").is_none(),
            "the {what} from Prometheus carries namespace {} (exported_namespace {}), not the cache's {}: {m}",
            m["namespace"],
            m["exported_namespace"],
            e.ns
        );
    }
    ensure!(
        e.ns != e.controller_ns,
        "the cache must live outside the controller's namespace {} for this check",
        e.controller_ns
    );
    let any = format!("ALERTS{{alertname=\"FlexInferQuantizationOnCPU\",model=\"{name}\"}}");
    let p = &prom;
    let a = &any;
    wait_for(
        "FlexInferQuantizationOnCPU resolved in Prometheus",
        Duration::from_secs(30),
        || async move { p.query(a).ok().filter(Vec::is_empty) },
    )
    .await?;
    Ok(())
}

/// `make deploy-quantizer` on the real path: while a quantization runs on the real node,
/// `scripts/deploy-quantizer.sh gfx1100 --restart` builds and pushes the worker image to the local registry,
/// pins the namespace's gfx1100 GPUProfile to it by digest and moves the running quantization onto it (the
/// controller replaces the drifted Job; the new one resumes from the layer cache), then removes the
/// `force-image-update` annotation; the cache ends Ready with a verified artifact. Takes the node for itself:
/// it changes the GPUProfile the other tests use (restored at the end).
#[tokio::test]
async fn real_pipeline_deploy_quantizer_moves_a_running_quantization_to_the_new_image() -> Result<()>
{
    let _node = NODE.write().await;
    let e = Env::get()?;
    let c = client().await;
    let result = deploy_quantizer_mid_run(&c, &e).await;
    // Back to the image the other tests expect, whatever happened.
    profile(&c, &e).await?;
    result
}

/// The controller is killed (its pod deleted with no grace) at seeded moments while
/// `E2E_CONCURRENT_PIPELINES` (default 20) download → quantize pipelines run on the real node. Then every
/// cache must finish: zero lost artifacts, zero `status.path` naming a missing or unverified directory
/// (checked whenever a path appears), zero moments with two live pods of one phase of one cache
/// (sampled throughout), every served artifact byte-identical to its `.save-complete` record.
#[tokio::test]
async fn real_pipeline_controller_killed_during_concurrent_pipelines() -> Result<()> {
    let _node = NODE.write().await;
    let e = Env::get()?;
    let c = client().await;
    let n: usize = std::env::var("E2E_CONCURRENT_PIPELINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let quant = json!({"format": "GPTQ", "bits": 4, "groupSize": 32, "maxMemoryGB": 1, "useGPU": true,
                       "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 16, "maxSeqLen": 128}});
    let mut dirs = BTreeMap::new();
    for i in 0..n {
        let name = format!("conc-{i:02}");
        let dir = start_cache(
            &c,
            &e,
            &name,
            "flexinfer-demo/tiny-llama",
            "tiny-llama",
            json!({"quantization": quant}),
        )
        .await?;
        dirs.insert(name, dir);
    }
    let api: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.ns);
    let cpods: Api<Pod> = Api::namespaced(c.clone(), &e.controller_ns);
    let csel = ListParams::default().labels("app.kubernetes.io/component=controller");
    let psel = ListParams::default().labels("flexinfer.ai/cache");
    // Seeded kill moments (seconds after the start), spread over the first minutes of the run.
    let mut x: u64 = 0x5eed_c0de;
    let mut kills_at: Vec<f64> = (0..5)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            8.0 + (x % 1000) as f64 / 1000.0 * 150.0
        })
        .collect();
    kills_at.sort_by(f64::total_cmp);
    let start = Instant::now();
    let mut kills = 0usize;
    let mut verified_paths: BTreeSet<String> = BTreeSet::new();
    let mut double_pods: Vec<String> = Vec::new();
    let mut samples = 0usize;
    loop {
        let t = start.elapsed().as_secs_f64();
        if kills_at.first().is_some_and(|k| *k <= t) {
            kills_at.remove(0);
            for p in cpods.list(&csel).await?.items {
                let name = p.metadata.name.unwrap_or_default();
                let _ = cpods
                    .delete(
                        &name,
                        &DeleteParams {
                            grace_period_seconds: Some(0),
                            ..DeleteParams::default()
                        },
                    )
                    .await;
            }
            kills += 1;
        }
        // Live pods (not finished, terminating included) per cache and phase.
        samples += 1;
        let mut live: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        for p in pods.list(&psel).await?.items {
            let phase = p
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            if phase == "Succeeded" || phase == "Failed" {
                continue;
            }
            let l = p.metadata.labels.clone().unwrap_or_default();
            let key = (
                l.get("flexinfer.ai/cache").cloned().unwrap_or_default(),
                l.get("flexinfer.ai/phase").cloned().unwrap_or_default(),
            );
            live.entry(key)
                .or_default()
                .push(p.metadata.name.unwrap_or_default());
        }
        for ((cache, phase), names) in &live {
            if names.len() > 1 {
                double_pods.push(format!("{cache}/{phase}: {names:?} at {t:.1}s"));
            }
        }
        // Every path a status names must be a complete, verified artifact the moment it is named.
        let mut ready = 0usize;
        for mc in api.list(&ListParams::default()).await?.items {
            let name = mc.metadata.name.clone().unwrap_or_default();
            let Some(dir) = dirs.get(&name) else { continue };
            let st = mc.status.clone().unwrap_or_default();
            ensure!(
                st.phase != Some(flexinfer_api::modelcache::CachePhase::Failed),
                "{name} Failed: {}",
                serde_json::to_string_pretty(&st)?
            );
            if let Some(p) = st.path.clone() {
                if verified_paths.insert(p.clone()) {
                    save_complete_verifies(&host_dir(dir, &p))
                        .with_context(|| format!("{name}: status.path {p}"))?;
                }
            }
            if st.phase == Some(flexinfer_api::modelcache::CachePhase::Ready) {
                ready += 1;
            }
        }
        if ready == n && kills_at.is_empty() {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(1500),
            "{ready}/{n} Ready after {:?} ({kills} controller kills)",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    ensure!(
        double_pods.is_empty(),
        "two live pods of one phase: {double_pods:?}"
    );
    // The end state: every served artifact whole and equal to its record; one path per cache.
    let mut artifacts = 0usize;
    for mc in api.list(&ListParams::default()).await?.items {
        let name = mc.metadata.name.clone().unwrap_or_default();
        let Some(dir) = dirs.get(&name) else { continue };
        let p = mc.status.and_then(|s| s.path).context("status.path")?;
        let art = host_dir(dir, &p);
        save_complete_verifies(&art)?;
        check_artifact(&art)?;
        artifacts += 1;
    }
    ensure!(artifacts == n, "{artifacts} artifacts for {n} caches");
    eprintln!(
        "concurrent pipelines: {n} caches Ready in {:.0}s, {kills} controller kills, {samples} samples, \
         0 double pods, {} paths verified when named, {artifacts} artifacts verified at the end",
        start.elapsed().as_secs_f64(),
        verified_paths.len()
    );
    for name in dirs.keys() {
        delete_cache(&c, &e, name).await;
    }
    Ok(())
}
