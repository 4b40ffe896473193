//! Artifact generations: the config-bound reuse and collection, a new revision downloaded beside the served one.

use super::*;

/// The artifact lifecycle on the real path: a changed `sym` and the `flexinfer.ai/requantize` annotation each
/// produce a new generation (never a reuse of the old bytes under the new spec), `status.path` moves only
/// when the new one is complete, the replaced generation stays on disk byte for byte, one older than that
/// is collected, and a run-only edit (`timeoutSeconds`) does not replace the running Job.
#[tokio::test]
async fn real_pipeline_generations_config_bound_reuse_and_collection() -> Result<()> {
    let _node = NODE.read().await;
    let e = Env::get()?;
    let c = client().await;
    let name = "tiny-gen";
    let quant = json!({"format": "GPTQ", "bits": 4, "groupSize": 32, "sym": true, "maxMemoryGB": 2,
                       "useGPU": true,
                       "calibration": {"dataset": "flexinfer-demo/calibration", "maxSamples": 16, "maxSeqLen": 128}});
    let dir = start_cache(
        &c,
        &e,
        name,
        "flexinfer-demo/tiny-llama",
        "tiny-llama",
        json!({"quantization": quant}),
    )
    .await?;
    let mut seen = Observed::default();
    let mc = until_ready(&c, &e, name, &mut seen, Duration::from_secs(600)).await?;
    let p1 = mc["status"]["path"].as_str().context("path")?.to_string();
    let d1 = host_dir(&dir, &p1);
    let before = dir_digest(&d1)?;
    let sc1: Value = serde_json::from_slice(&std::fs::read(d1.join(".save-complete"))?)?;
    ensure!(
        mc["status"]["quantization"]["configDigest"] == sc1["config_digest"],
        "status configDigest {} vs .save-complete {}",
        mc["status"]["quantization"]["configDigest"],
        sc1["config_digest"]
    );
    ensure!(
        mc["status"]["quantization"]["applied"]["sym"] == "true",
        "applied {}",
        mc["status"]["quantization"]["applied"]
    );
    // The worker reports the device its solves ran on: this node has no GPU and the cpu image no runtime,
    // so `auto` chose the CPU; with `useGPU: true` that is a Warning event carrying the worker's reason.
    // The setting is among the applied settings; the device is not (it has its own fields).
    let applied = &mc["status"]["quantization"]["applied"];
    ensure!(
        applied["gptqDevice"] == "auto"
            && applied.as_object().is_some_and(|m| m
                .keys()
                .all(|k| !k.starts_with("gptqDevice") || k == "gptqDevice")),
        "applied settings: {applied}"
    );
    let q = &mc["status"]["quantization"];
    ensure!(
        q["gptqDevice"] == "cpu-faer"
            && q["gptqDeviceKind"] == "cpu"
            && q["gptqDeviceRequested"] == "auto"
            && q["gptqDeviceReason"]
                .as_str()
                .is_some_and(|r| r.starts_with("auto: no usable GPU (hip: ")),
        "status.quantization.gptqDevice {} (kind {}, setting {}) / gptqDeviceReason {}",
        q["gptqDevice"],
        q["gptqDeviceKind"],
        q["gptqDeviceRequested"],
        q["gptqDeviceReason"]
    );
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(c.clone(), &e.ns);
    let on_cpu: Vec<String> = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|ev| {
            ev.reason.as_deref() == Some("QuantizedOnCPU")
                && ev.involved_object.name.as_deref() == Some(name)
        })
        .map(|ev| {
            format!(
                "{} {}",
                ev.type_.unwrap_or_default(),
                ev.message.unwrap_or_default()
            )
        })
        .collect();
    ensure!(
        on_cpu.iter().any(|m| m.starts_with(
            "Warning useGPU is set, but the GPTQ solves run on the CPU: auto: no usable GPU"
        )),
        "QuantizedOnCPU events of {name}: {on_cpu:?}"
    );

    // 1. sym true -> false: a new generation with the new configuration, the old one intact.
    let api: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    let pp = kube::api::PatchParams::default();
    api.patch(
        name,
        &pp,
        &kube::api::Patch::Merge(json!({"spec": {"quantization": {"sym": false}}})),
    )
    .await?;
    let mc = until_ready_at_new_path(&c, &e, name, &p1, &mut seen).await?;
    let st = &mc["status"];
    let p2 = st["path"].as_str().context("path")?.to_string();
    let d2 = host_dir(&dir, &p2);
    let qc: Value = serde_json::from_slice(&std::fs::read(d2.join("quantize_config.json"))?)?;
    ensure!(qc["sym"] == false, "new artifact's quantize_config {qc}");
    ensure!(
        st["quantization"]["applied"]["sym"] == "false",
        "applied {}",
        st["quantization"]["applied"]
    );
    let sc2: Value = serde_json::from_slice(&std::fs::read(d2.join(".save-complete"))?)?;
    ensure!(
        sc2["config_digest"] != sc1["config_digest"],
        "config digest did not change"
    );
    ensure!(
        dir_digest(&d1)? == before,
        "the replaced generation changed on disk"
    );
    let rel1 = p1
        .split_once(':')
        .map(|(_, d)| d.to_string())
        .unwrap_or_default();
    ensure!(
        st["quantization"]["previousOutputDirs"] == json!([rel1]),
        "previousOutputDirs {}",
        st["quantization"]["previousOutputDirs"]
    );

    // 2. The requantize annotation with an unchanged spec: a third generation, computed again; while it
    //    runs, a deadline edit applies to the next attempt and does not replace the Job.
    api.patch(
        name,
        &pp,
        &kube::api::Patch::Merge(
            json!({"metadata": {"annotations": {"flexinfer.ai/requantize": "true"}}}),
        ),
    )
    .await?;
    let jobs: Api<Job> = Api::namespaced(c.clone(), &e.ns);
    let job_name = format!("{name}-quantize");
    let uid = wait_for("the requantize Job", Duration::from_secs(120), || {
        let jobs = jobs.clone();
        let job_name = job_name.clone();
        async move {
            let j = jobs.get_opt(&job_name).await.ok().flatten()?;
            (j.metadata.deletion_timestamp.is_none()
                && j.status.as_ref().and_then(|s| s.succeeded).unwrap_or(0) == 0)
                .then_some(j.metadata.uid)
        }
    })
    .await?;
    api.patch(
        name,
        &pp,
        &kube::api::Patch::Merge(json!({"spec": {"quantization": {"timeoutSeconds": 7777}}})),
    )
    .await?;
    let mc = until_ready_at_new_path(&c, &e, name, &p2, &mut seen).await?;
    let st = &mc["status"];
    let p3 = st["path"].as_str().context("path")?.to_string();
    let job = jobs.get(&job_name).await?;
    ensure!(
        job.metadata.uid == uid,
        "the timeoutSeconds edit replaced the running quantize Job"
    );
    let d3 = host_dir(&dir, &p3);
    check_artifact(&d3)?;
    // Keep one previous generation: the second stays, the first is collected by the third run.
    ensure!(
        d2.join(".save-complete").is_file(),
        "previous generation {p2} was removed"
    );
    ensure!(
        !d1.exists(),
        "generation {p1} older than the kept one is still on disk"
    );
    let logs = Command::new("kubectl")
        .args(["logs", "-n", &e.ns, &format!("job/{job_name}")])
        .output()?;
    let logs = String::from_utf8_lossy(&logs.stdout);
    ensure!(
        !logs.contains("\"quantization_cached\""),
        "requantize reused the artifact"
    );
    ensure!(
        logs.contains("\"generations_collected\""),
        "no generations_collected event in the worker log"
    );
    Ok(())
}

/// Downloads have generations too, on the real path: a new revision downloads into a new
/// `source.<generation>` beside the one `status.path` names, which stays byte for byte and keeps being
/// the path until the new one is complete; unchanged files are hard links to the earlier generation's;
/// the replaced generation is kept (one previous by default) and the one before it is collected.
#[tokio::test]
async fn real_pipeline_a_new_revision_downloads_beside_the_served_one() -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let _node = NODE.read().await;
    let e = Env::get()?;
    let c = client().await;
    let name = "tiny-rev";
    let dir = start_cache(
        &c,
        &e,
        name,
        "flexinfer-demo/tiny-llama",
        "tiny-rev",
        json!({}),
    )
    .await?;
    let mut seen = Observed::default();
    let mc = until_ready(&c, &e, name, &mut seen, Duration::from_secs(300)).await?;
    let st = &mc["status"];
    let p1 = st["path"].as_str().context("path")?.to_string();
    let rel1 = st["download"]["outputDir"]
        .as_str()
        .context("status.download.outputDir")?
        .to_string();
    ensure!(
        p1.ends_with(&format!(":{rel1}")) && rel1.starts_with("tiny-rev/source."),
        "path {p1} vs download.outputDir {rel1}"
    );
    let d1 = host_dir(&dir, &p1);
    ensure!(
        d1.join("config.json").is_file() && d1.join(".download_complete").is_file(),
        "{} holds no complete download",
        d1.display()
    );
    ensure!(
        !dir.join("tiny-rev/config.json").exists(),
        "the model's files were written into the cache directory itself"
    );
    let before = dir_digest(&d1)?;

    let api: Api<ModelCache> = Api::namespaced(c.clone(), &e.ns);
    let pp = kube::api::PatchParams::default();
    let mut paths = vec![p1.clone()];
    for rev in ["r2", "r3"] {
        api.patch(
            name,
            &pp,
            &kube::api::Patch::Merge(json!({"spec": {"revision": rev}})),
        )
        .await?;
        let old = paths.last().cloned().unwrap_or_default();
        let mc = until_ready_at_new_path(&c, &e, name, &old, &mut seen).await?;
        let st = &mc["status"];
        ensure!(
            st["download"]["revision"] == rev,
            "download.revision {}",
            st["download"]["revision"]
        );
        let new = st["path"].as_str().context("path")?.to_string();
        let prev_rel = old.split_once(':').map(|(_, d)| d.to_string());
        ensure!(
            st["download"]["previousOutputDirs"] == json!([prev_rel]),
            "previousOutputDirs {}",
            st["download"]["previousOutputDirs"]
        );
        let (dn, dold) = (host_dir(&dir, &new), host_dir(&dir, &old));
        let cfg_new = std::fs::metadata(dn.join("config.json"))?.ino();
        let cfg_old = std::fs::metadata(dold.join("config.json"))?.ino();
        ensure!(
            cfg_new == cfg_old,
            "config.json of {new} is not a hard link to the earlier generation's"
        );
        paths.push(new);
    }
    // r2 replaced the first generation and kept it; r3 kept r2 and collected the first.
    ensure!(
        !d1.exists(),
        "generation {p1} older than the kept one is still on disk"
    );
    let d2 = host_dir(&dir, &paths[1]);
    ensure!(
        dir_digest(&d2)?.len() == before.len() && d2.join(".download_complete").is_file(),
        "the kept generation {} is not whole",
        paths[1]
    );
    Ok(())
}
