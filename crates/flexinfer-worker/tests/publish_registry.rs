//! `flexinfer-worker publish` (and `download` of `oci://` sources) against a real registry
//! (Debian's docker-registry on loopback).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod download_support;
mod publish_support;

use std::path::Path;
use std::time::{Duration, Instant};

use download_support::*;
use publish_support::Registry;

const MARKERS: &[&str] = &[".source-integrity.json", ".download_complete"];

fn model_tree(dir: &Path) {
    write_data(&dir.join("model-00001-of-00002.safetensors"), 24 << 20, 11);
    write_data(&dir.join("model-00002-of-00002.safetensors"), 3 << 20, 12);
    std::fs::write(
        dir.join("config.json"),
        r#"{"quantization_config":{"bits":4}}"#,
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("tokenizer")).unwrap();
    std::fs::write(dir.join("tokenizer/tokenizer.json"), r#"{"model":{}}"#).unwrap();
    std::fs::write(dir.join("empty.txt"), "").unwrap();
    // Never published: resume caches and partial files.
    std::fs::create_dir_all(dir.join(".flexinfer-gptq-cache/layers")).unwrap();
    std::fs::write(
        dir.join(".flexinfer-gptq-cache/layers/layer-000.safetensors"),
        "x",
    )
    .unwrap();
    std::fs::write(dir.join("junk.part"), "x").unwrap();
}

fn publish(reg: &Registry, dir: &Path, reference: &str, scratch: &Path) -> std::process::Command {
    let mut c = worker("publish", scratch);
    c.env("MODEL_DIR", dir)
        .env("OCI_REF", format!("{}/{reference}", reg.addr))
        .env("OCI_INSECURE", "True");
    c
}

#[test]
fn push_pull_roundtrip_is_byte_identical_and_repush_is_stable() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("out");
    model_tree(&src);
    let r = run(
        publish(&reg, &src, "flexinfer/tiny:v1", tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 0, "{}\n{}", r.describe(), reg.log_text());
    let digest = r.termination["digest"].as_str().unwrap().to_string();
    assert!(
        digest.starts_with("sha256:") && digest.len() == 71,
        "{digest}"
    );
    assert_eq!(r.termination["tags"], serde_json::json!(["v1"]));
    assert_eq!(r.termination["type"], "publish");
    let complete = r.events("complete");
    assert_eq!(complete.len(), 1);
    assert_eq!(complete[0]["digest"], digest.as_str());

    // The manifest as the registry serves it: artifact type, empty config, titled layers.
    let (st, body) = reg.get(&format!("/v2/flexinfer/tiny/manifests/{digest}"));
    assert_eq!(st, 200, "{body}");
    let m: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(m["artifactType"], "application/vnd.flexinfer.model.v1");
    assert_eq!(
        m["config"]["mediaType"],
        "application/vnd.oci.empty.v1+json"
    );
    let titles: Vec<&str> = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            l["annotations"]["org.opencontainers.image.title"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(
        titles,
        [
            "config.json",
            "empty.txt",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "tokenizer/tokenizer.json"
        ]
    );

    // Pull it back through `download` of an oci:// source: the identical tree.
    let pulled = tmp.path().join("pulled");
    let mut c = worker("download", tmp.path());
    c.env("SOURCE", format!("oci://{}/flexinfer/tiny:v1", reg.addr))
        .env("MODEL_DIR", &pulled)
        .env("OCI_INSECURE", "true");
    let p = run(c, tmp.path());
    assert_eq!(p.code, 0, "{}", p.describe());
    let want = tree(&src, &[".flexinfer-gptq-cache", "junk.part"]);
    assert_eq!(tree(&pulled, MARKERS), want);
    assert_eq!(p.termination["revision"], digest.as_str());
    // By digest too.
    let mut c = worker("download", tmp.path());
    c.env(
        "SOURCE",
        format!("oci://{}/flexinfer/tiny@{digest}", reg.addr),
    )
    .env("MODEL_DIR", tmp.path().join("by-digest"))
    .env("OCI_INSECURE", "1");
    let p = run(c, tmp.path());
    assert_eq!(p.code, 0, "{}", p.describe());
    assert_eq!(tree(&tmp.path().join("by-digest"), MARKERS), want);

    // Re-push: the same digest, and no blob uploaded again.
    let uploads = reg.uploaded_digests().len();
    assert_eq!(
        uploads,
        6,
        "5 files + the empty config: {:?}",
        reg.uploaded_digests()
    );
    let again = run(
        publish(&reg, &src, "flexinfer/tiny:v1", tmp.path()),
        tmp.path(),
    );
    assert_eq!(again.code, 0, "{}", again.describe());
    assert_eq!(again.termination["digest"], digest.as_str());
    assert_eq!(
        reg.uploaded_digests().len(),
        uploads,
        "re-push uploaded blobs again"
    );

    // Without insecure, plain HTTP is refused (TLS is verified by default), fast and clearly.
    let mut c = publish(&reg, &src, "flexinfer/tiny:v1", tmp.path());
    c.env("OCI_INSECURE", "false");
    let started = Instant::now();
    let r = run(c, tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    assert!(
        r.termination["error"]
            .as_str()
            .unwrap()
            .contains("OCI_INSECURE"),
        "{}",
        r.describe()
    );
    assert!(started.elapsed() < Duration::from_secs(15));
}

#[test]
fn credentials_from_env_or_dockerconfigjson() {
    use base64::Engine as _;
    let reg = Registry::start_with_auth("pusher", "s3cret-Pa55word");
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("out");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("config.json"), r#"{"a":1}"#).unwrap();
    write_data(&src.join("model.safetensors"), 2 << 20, 21);

    // No credentials: a clear bad-input error.
    let r = run(
        publish(&reg, &src, "flexinfer/auth:v1", tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 2, "{}", r.describe());
    assert!(
        r.termination["error"]
            .as_str()
            .unwrap()
            .contains("OCI_USERNAME"),
        "{}",
        r.describe()
    );

    // Wrong password: exit 2, and the password appears nowhere.
    let mut c = publish(&reg, &src, "flexinfer/auth:v1", tmp.path());
    c.env("OCI_USERNAME", "pusher")
        .env("OCI_PASSWORD", "wrong-Pa55word");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    assert!(
        r.termination["error"]
            .as_str()
            .unwrap()
            .contains("HTTP 401"),
        "{}",
        r.describe()
    );
    assert!(!r.describe().contains("wrong-Pa55word"));

    // dockerconfigjson (as a mounted Secret directory).
    let secret = tmp.path().join("secret");
    std::fs::create_dir_all(&secret).unwrap();
    let auth = base64::engine::general_purpose::STANDARD.encode("pusher:s3cret-Pa55word");
    std::fs::write(
        secret.join(".dockerconfigjson"),
        format!(r#"{{"auths":{{"{}":{{"auth":"{auth}"}}}}}}"#, reg.addr),
    )
    .unwrap();
    let mut c = publish(&reg, &src, "flexinfer/auth:v1", tmp.path());
    c.env("DOCKER_CONFIG_JSON", &secret);
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert!(!r.describe().contains("s3cret-Pa55word"));

    // Env credentials pull it back.
    let pulled = tmp.path().join("pulled");
    let mut c = worker("download", tmp.path());
    c.env("SOURCE", format!("oci://{}/flexinfer/auth:v1", reg.addr))
        .env("MODEL_DIR", &pulled)
        .env("OCI_INSECURE", "true")
        .env("OCI_USERNAME", "pusher")
        .env("OCI_PASSWORD", "s3cret-Pa55word");
    let p = run(c, tmp.path());
    assert_eq!(p.code, 0, "{}", p.describe());
    assert_eq!(tree(&pulled, MARKERS), tree(&src, &[]));
}

#[test]
fn tag_policies_and_additional_tags_show_in_the_registry() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("out");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("config.json"), "{}").unwrap();
    write_data(&src.join("model.safetensors"), 1 << 20, 7);

    let mut c = publish(&reg, &src, "flexinfer/tags:v2", tmp.path());
    c.env("OCI_TAG_POLICY", "digest-suffix")
        .env("OCI_ADDITIONAL_TAGS", "latest, stable");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    let digest = r.termination["digest"].as_str().unwrap().to_string();
    let suffixed = format!("v2-{}", &digest["sha256:".len()..][..12]);
    assert_eq!(reg.tags("flexinfer/tags"), {
        let mut t = vec![suffixed.clone(), "latest".to_string(), "stable".to_string()];
        t.sort();
        t
    });
    // Every tag resolves to the same manifest.
    for t in [&suffixed, "latest", "stable"] {
        let (st, body) = reg.get(&format!("/v2/flexinfer/tags/manifests/{t}"));
        assert_eq!(st, 200);
        assert_eq!(
            format!("sha256:{}", sha256_hex(body.as_bytes())),
            digest,
            "{t}"
        );
    }

    let mut c = publish(&reg, &src, "flexinfer/tags:v2", tmp.path());
    c.env("OCI_TAG_POLICY", "timestamp");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    let tags = reg.tags("flexinfer/tags");
    let ts: Vec<&String> = tags
        .iter()
        .filter(|t| t.starts_with("v2-") && **t != suffixed)
        .collect();
    assert_eq!(ts.len(), 1, "{tags:?}");
    assert!(
        ts[0].len() == 3 + 14 && ts[0][3..].bytes().all(|b| b.is_ascii_digit()),
        "{tags:?}"
    );
    assert_eq!(r.termination["tags"], serde_json::json!([ts[0]]));

    // overwrite moves the tag to new content.
    let mut c = publish(&reg, &src, "flexinfer/tags:latest", tmp.path());
    c.env("OCI_TAG_POLICY", "overwrite");
    std::fs::write(src.join("config.json"), r#"{"changed":true}"#).unwrap();
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert_ne!(r.termination["digest"], digest.as_str());
    let (_, body) = reg.get("/v2/flexinfer/tags/manifests/latest");
    assert_eq!(
        format!("sha256:{}", sha256_hex(body.as_bytes())),
        r.termination["digest"].as_str().unwrap()
    );

    // Bad input: unknown policy, bad tag, digest reference.
    for (k, v) in [
        ("OCI_TAG_POLICY", "sometimes".to_string()),
        ("OCI_ADDITIONAL_TAGS", "ok,-bad".to_string()),
        (
            "OCI_REF",
            format!("{}/flexinfer/tags@sha256:{}", reg.addr, "0".repeat(64)),
        ),
        ("OCI_REF", "no-registry-here".to_string()),
    ] {
        let mut c = publish(&reg, &src, "flexinfer/tags:v2", tmp.path());
        c.env(k, &v);
        let r = run(c, tmp.path());
        assert_eq!(r.code, 2, "{k}={v}: {}", r.describe());
    }
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(b))
}

#[test]
fn interrupted_push_resumes_without_reuploading_finished_blobs() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("out");
    for i in 0..8u64 {
        write_data(
            &src.join(format!("shard-{i}.safetensors")),
            24 << 20,
            100 + i,
        );
    }
    let mut first = publish(&reg, &src, "flexinfer/big:v1", tmp.path());
    first
        .env("FLEXINFER_PUBLISH_CONCURRENCY", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut child = first.spawn().unwrap();
    // Kill it as soon as the registry has completed the first file blob (config blob excluded).
    let empty_config = format!("sha256:{}", sha256_hex(b"{}"));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done: Vec<String> = reg
            .uploaded_digests()
            .into_iter()
            .filter(|d| *d != empty_config)
            .collect();
        if !done.is_empty() {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "publish finished before it could be interrupted"
        );
        assert!(
            Instant::now() < deadline,
            "no blob completed: {}",
            reg.log_text()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let before = reg.uploaded_digests();
    let before_files = before.iter().filter(|d| **d != empty_config).count();
    assert!(
        (1..8).contains(&before_files),
        "interrupted run uploaded {before_files} of 8 files"
    );

    let r = run(
        publish(&reg, &src, "flexinfer/big:v1", tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 0, "{}", r.describe());
    let after = reg.uploaded_digests();
    let mut uniq = after.clone();
    uniq.sort();
    uniq.dedup();
    assert_eq!(
        uniq.len(),
        after.len(),
        "a finished blob was uploaded twice: {after:?}"
    );
    assert_eq!(after.len(), 9, "8 files + config: {after:?}");
    assert!(
        r.stderr
            .contains(&format!("({before_files} already in the registry)")),
        "{}",
        r.describe()
    );
}

#[test]
fn an_artifact_that_does_not_match_its_save_complete_is_never_pushed() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("out");
    let sha = write_data(&src.join("model.safetensors"), 2 << 20, 21);
    std::fs::write(
        src.join("config.json"),
        r#"{"quantization_config":{"bits":4}}"#,
    )
    .unwrap();
    let record = |sha: &str| {
        serde_json::json!({
            "version": 1, "script_version": "x", "completed_at": "2026-12-01T00:00:00Z",
            "shards": [{"name": "model.safetensors", "size_bytes": 2u64 << 20, "sha256": sha}],
            "has_index": false, "has_config": true, "has_quantize_config": false,
        })
        .to_string()
    };
    // The record matches: published.
    std::fs::write(src.join(".save-complete"), record(&sha)).unwrap();
    let r = run(
        publish(&reg, &src, "flexinfer/checked:v1", tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 0, "{}", r.describe());
    let before = reg.uploaded_digests().len();
    // The shard changed after it was recorded (a bit flip, a partial copy): refused, nothing uploaded.
    write_data(&src.join("model.safetensors"), 2 << 20, 22);
    let r = run(
        publish(&reg, &src, "flexinfer/checked:v2", tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 2, "{}", r.describe());
    assert!(
        r.termination
            .to_string()
            .contains("model.safetensors does not match its .save-complete record"),
        "{}",
        r.describe()
    );
    assert_eq!(reg.uploaded_digests().len(), before, "a blob was uploaded");
    assert_eq!(reg.tags("flexinfer/checked"), vec!["v1".to_string()]);
    // A recorded shard that is missing is refused the same way.
    std::fs::remove_file(src.join("model.safetensors")).unwrap();
    let r = run(
        publish(&reg, &src, "flexinfer/checked:v3", tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 2, "{}", r.describe());
    assert!(r.describe().contains("is missing"), "{}", r.describe());
}
