//! The runbooks' commands work as written.

use super::*;

/// Every reference command of the GPTQ runbook works as written against the real node, in the state it
/// assumes: on a cache (any phase), on its running quantize Job (the worker container frozen with containerd
/// while the commands run, so the state holds; `exec` after it is thawed), on a failed cache (the recovery
/// steps), and on a Model with its pod. The commands come from the runbook itself (scripts/runbook/commands.py),
/// so a new command there is run here; the few that cannot run in this cluster (Flux, `kubectl top` without
/// metrics-server, the `make deploy-quantizer` synopsis) are listed with the reason.
#[tokio::test]
async fn real_pipeline_runbook_commands_work_as_written() -> Result<()> {
    let _node = NODE.read().await;
    let e = Env::get()?;
    let c = client().await;
    let cmds = runbook_commands()?;
    let of = |state: &str| -> Vec<&Value> { cmds.iter().filter(|c| c["state"] == state).collect() };
    for s in of("skip") {
        eprintln!(
            "runbook line {} not run here: {} ({})",
            s["line"], s["command"], s["reason"]
        );
    }
    for state in ["cache", "running", "failed", "model"] {
        ensure!(
            !of(state).is_empty(),
            "no runbook command of state {state}: the runbook or scripts/runbook/commands.py changed"
        );
    }
    let ns = e.ns.clone();

    // A GPTQ cache whose quantization runs long enough to be caught (the kill test's size).
    let name = "rb-gptq";
    let dir = start_cache(&c, &e, name, "flexinfer-demo/small-llama", "small-llama", json!({
        "quantization": {"format": "GPTQ", "bits": 4, "groupSize": 128, "maxMemoryGB": 4,
                         "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 64, "maxSeqLen": 512}},
    }))
    .await?;
    let mut seen = Observed::default();
    let (pod, cid, _) = running_quantize_with_a_cached_layer(&c, &e, name, &dir, &mut seen).await?;
    let qpod = pod.metadata.name.clone().unwrap_or_default();
    let cid = cid.trim_start_matches("containerd://").to_string();
    let ctr = |verb: &str| -> Result<()> {
        let o = Command::new("ctr")
            .args([
                "--address",
                &e.containerd,
                "-n",
                "k8s.io",
                "tasks",
                verb,
                &cid,
            ])
            .output()?;
        ensure!(
            o.status.success(),
            "ctr tasks {verb}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Ok(())
    };
    let subst = [
        ("<quantize pod>", qpod.as_str()),
        ("<name>", name),
        ("<cache>", name),
        ("<ns>", ns.as_str()),
    ];
    ctr("pause")?;
    let mut ran = 0;
    let frozen = async {
        for cmd in of("cache").into_iter().chain(of("running")) {
            let text = cmd["command"].as_str().unwrap_or_default();
            if text.contains(" exec ") || text.starts_with("kubectl delete job") {
                continue; // below, with the container running
            }
            run_runbook_command(&e, cmd, &subst)?;
            if text.starts_with("POD=") {
                // The assignment prints nothing; the same selector must find the running pod.
                let check = json!({"command": format!("{text}; test \"$POD\" = {qpod}"),
                                   "line": cmd["line"], "section": cmd["section"]});
                run_runbook_command(&e, &check, &subst)?;
            }
            ran += 1;
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    ctr("resume")?;
    frozen?;
    for cmd in of("running") {
        let text = cmd["command"].as_str().unwrap_or_default();
        if text.contains(" exec ") {
            let out = run_runbook_command(&e, cmd, &subst)?;
            ensure!(!out.trim().is_empty(), "`{text}` printed nothing");
            ran += 1;
        }
    }
    // Deleting the running Job (option B of "Failed but the run got ~90% through"): the controller creates it
    // again and the cache still ends Ready.
    for cmd in of("running") {
        if cmd["command"]
            .as_str()
            .unwrap_or_default()
            .starts_with("kubectl delete job")
        {
            run_runbook_command(&e, cmd, &subst)?;
            ran += 1;
        }
    }
    until_ready(&c, &e, name, &mut seen, Duration::from_secs(600)).await?;
    // A Ready cache: the reading commands again, and the CLI's status.
    for cmd in of("cache") {
        run_runbook_command(&e, cmd, &subst)?;
        ran += 1;
    }

    // A Model serving it, with its pod.
    let place = e.real_node_placement();
    let model = json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "namespace": e.ns},
        "spec": {"backend": "vllm", "source": format!("modelcache://{name}"), "image": e.standin_image,
                 "gpu": {"count": 1, "profile": "e2e-gfx1100"}, "serverless": {"enabled": false},
                 "resources": {"requests": {"memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                 "nodeSelector": place["nodeSelector"], "tolerations": place["tolerations"]},
    });
    apply(&c, &model, None, false)
        .await
        .context("apply Model")?;
    let pods: Api<Pod> = Api::namespaced(c.clone(), &e.ns);
    let sel = ListParams::default().labels(&format!("flexinfer.ai/model={name}"));
    let serving = wait_for("the Model's pod", Duration::from_secs(120), || {
        let pods = pods.clone();
        let sel = sel.clone();
        async move {
            pods.list(&sel)
                .await
                .ok()?
                .items
                .into_iter()
                .find_map(|p| p.metadata.name)
        }
    })
    .await?;
    let msubst = [
        ("<pod>", serving.as_str()),
        ("<name>", name),
        ("<ns>", ns.as_str()),
    ];
    for cmd in of("model") {
        run_runbook_command(&e, cmd, &msubst)?;
        ran += 1;
    }
    let models: Api<Model> = Api::namespaced(c.clone(), &e.ns);
    let _ = models.delete(name, &DeleteParams::default()).await;

    // A failed cache (a repository the hub does not have, no retries): the recovery steps.
    let failed = "rb-failed";
    start_cache(
        &c,
        &e,
        failed,
        "flexinfer-demo/no-such-model",
        "none",
        json!({"maxRetries": 0}),
    )
    .await?;
    let api: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    wait_for("the cache Failed", Duration::from_secs(180), || {
        let api = api.clone();
        async move {
            let mc = api.get_opt(failed).await.ok().flatten()?;
            let phase = serde_json::to_value(&mc.status).ok()?["phase"].clone();
            (phase == "Failed").then_some(())
        }
    })
    .await?;
    let fsubst = [
        ("<name>", failed),
        ("<cache>", failed),
        ("<ns>", ns.as_str()),
    ];
    for cmd in of("failed").into_iter().chain(of("cache")) {
        run_runbook_command(&e, cmd, &fsubst)?;
        ran += 1;
    }
    eprintln!("{ran} runbook commands ran as written");
    delete_cache(&c, &e, failed).await;
    delete_cache(&c, &e, name).await;
    Ok(())
}
