//! CRDs on a real kube-apiserver: install and become Established, `kubectl explain` shows the
//! documented ranges, every example passes server-side dry-run, invalid manifests are rejected by
//! the API server with a message that names the offending field, and defaults are applied.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_api::ModelCache;
use flexinfer_e2e::{apply, client, install_crds, repo_root, yaml_docs, TestNamespace};
use kube::api::Api;

#[tokio::test]
async fn crds_install_and_explain_shows_ranges() {
    let c = client().await;
    install_crds(&c).await.expect("install the CRDs");
    let out = std::process::Command::new("kubectl")
        .args(["explain", "modelcache.spec.quantization.calibration"])
        .output()
        .expect("run kubectl explain");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl explain failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "maxSeqLen",
        "128–32768",
        "maxSamples",
        "8–2048",
        "nParallelCalibSamples",
        "1–256",
        "dataset",
    ] {
        assert!(
            text.contains(needle),
            "kubectl explain lacks {needle:?}:\n{text}"
        );
    }
    let out = std::process::Command::new("kubectl")
        .args(["explain", "model.spec.gpu.priority"])
        .output()
        .expect("run kubectl explain");
    assert!(
        out.status.success(),
        "short name resolution for Model failed"
    );
}

#[tokio::test]
async fn every_example_passes_server_side_dry_run() {
    let c = client().await;
    install_crds(&c).await.expect("install the CRDs");
    let ns = TestNamespace::new(&c, "examples").await.expect("namespace");
    let dir = repo_root().join("deploy/examples");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("deploy/examples")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut kinds = Vec::new();
    for p in &files {
        let text = std::fs::read_to_string(p).expect("read example");
        for doc in yaml_docs(&text).expect("parse example") {
            let kind = doc["kind"].as_str().unwrap_or_default().to_string();
            let name = doc["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let target_ns = (kind != "Namespace").then_some(ns.name.as_str());
            apply(&c, &doc, target_ns, true)
                .await
                .unwrap_or_else(|e| panic!("{} ({kind}/{name}) rejected: {e}", p.display()));
            kinds.push(format!("{kind}/{name}"));
        }
    }
    // The example caches and Models and one GPUProfile per architecture family must be there.
    for want in [
        "ModelCache/llama3-8b-gguf",
        "ModelCache/gemma4-26b-a4b-gptq",
        "ModelCache/my-model-gptq",
        "Model/gemma4-31b-gptq-fp8kv-canary",
        "Model/gemma4-31b-gptq",
        "Model/gemma4-26b-a4b-gptq-long",
        "GPUProfile/gfx1100",
        "GPUProfile/gfx906",
        "GPUProfile/sm-89",
    ] {
        assert!(
            kinds.iter().any(|k| k == want),
            "deploy/examples lacks {want}: {kinds:?}"
        );
    }
}

#[tokio::test]
async fn invalid_manifests_are_rejected_naming_the_field() {
    let c = client().await;
    install_crds(&c).await.expect("install the CRDs");
    let ns = TestNamespace::new(&c, "invalid").await.expect("namespace");
    let dir = repo_root().join("tests/invalid");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("tests/invalid")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    files.sort();
    assert!(
        files.len() >= 25,
        "need at least 25 invalid manifests, have {}",
        files.len()
    );
    let mut failures = Vec::new();
    for p in &files {
        let text = std::fs::read_to_string(p).expect("read");
        let field = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect-field: "))
            .unwrap_or_else(|| panic!("{} lacks '# expect-field: <path>'", p.display()))
            .trim()
            .to_string();
        let doc = yaml_docs(&text).expect("parse").remove(0);
        match apply(&c, &doc, Some(&ns.name), true).await {
            Ok(_) => failures.push(format!("{}: accepted", p.display())),
            Err(kube::Error::Api(e)) => {
                if e.code != 422 || !e.message.contains(&field) {
                    failures.push(format!(
                        "{}: expected 422 naming {field}, got {} {}",
                        p.display(),
                        e.code,
                        e.message
                    ));
                }
            }
            Err(e) => failures.push(format!("{}: unexpected error {e}", p.display())),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn server_applies_documented_defaults() {
    let c = client().await;
    install_crds(&c).await.expect("install the CRDs");
    let ns = TestNamespace::new(&c, "defaults").await.expect("namespace");
    let doc = serde_json::json!({
        "apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "defaults"},
        "spec": {"source": "org/model",
                 "quantization": {"format": "GPTQ", "calibration": {}},
                 "abliteration": {},
                 "publish": {"ociRef": "registry.example.com/m"}}
    });
    apply(&c, &doc, Some(&ns.name), false)
        .await
        .expect("create");
    let api: Api<ModelCache> = Api::namespaced(c.clone(), &ns.name);
    let mc = api.get("defaults").await.expect("get");
    let s = &mc.spec;
    assert_eq!(s.revision, "main");
    assert_eq!(s.max_retries, 3);
    assert_eq!(s.storage_size.0, "50Gi");
    let q = s.quantization.as_ref().expect("quantization");
    assert_eq!(q.group_size, 128);
    assert!(q.sym && !q.desc_act);
    assert_eq!(q.gpu_memory_fraction, "0.80");
    assert_eq!(q.max_memory_gb, 48);
    let cal = q.calibration.as_ref().expect("calibration");
    assert_eq!((cal.max_seq_len, cal.max_samples), (4096, 256));
    assert_eq!(cal.dataset, "mit-han-lab/pile-val-backup");
    let a = s.abliteration.as_ref().expect("abliteration");
    assert!(!a.ablitate_lm_head, "ablitateLmHead must default to false");
    assert_eq!(a.num_samples, 128);
    assert_eq!(a.target_layers, "auto");
    assert_eq!(a.timeout_seconds, 14400);
    let p = s.publish.as_ref().expect("publish");
    assert_eq!(p.timeout_seconds, 7200);
    assert_eq!(p.targets.len(), 1);
}
