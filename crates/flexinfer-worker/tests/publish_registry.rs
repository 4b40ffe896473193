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
    write_safetensors(&dir.join("model-00001-of-00002.safetensors"), 24 << 20, 11);
    write_safetensors(&dir.join("model-00002-of-00002.safetensors"), 3 << 20, 12);
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

    // The manifest as the registry serves it: a ModelPack artifact, its model config, one raw layer
    // per file with its path as both the ModelPack file path and the OCI title (what `oras pull` uses).
    let (st, body) = reg.get(&format!("/v2/flexinfer/tiny/manifests/{digest}"));
    assert_eq!(st, 200, "{body}");
    let m: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        m["artifactType"],
        "application/vnd.cncf.model.manifest.v1+json"
    );
    assert_eq!(
        m["config"]["mediaType"],
        "application/vnd.cncf.model.config.v1+json"
    );
    let layers: Vec<(&str, &str, &str)> = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let a = &l["annotations"];
            assert_eq!(
                a["org.cncf.model.filepath"],
                a["org.opencontainers.image.title"]
            );
            (
                a["org.cncf.model.filepath"].as_str().unwrap(),
                l["mediaType"].as_str().unwrap(),
                a["org.cncf.model.file.mediatype.untested"]
                    .as_str()
                    .unwrap_or(""),
            )
        })
        .collect();
    let weight = "application/vnd.cncf.model.weight.v1.raw";
    let config = "application/vnd.cncf.model.weight.config.v1.raw";
    assert_eq!(
        layers,
        [
            ("config.json", config, ""),
            ("empty.txt", "application/vnd.cncf.model.doc.v1.raw", ""),
            ("model-00001-of-00002.safetensors", weight, ""),
            ("model-00002-of-00002.safetensors", weight, ""),
            ("tokenizer/tokenizer.json", config, ""),
        ]
    );
    // The config: what the files say, and one DiffID (the raw layer's digest) per layer.
    let cfg: serde_json::Value = serde_json::from_slice(
        &reg.blob("flexinfer/tiny", m["config"]["digest"].as_str().unwrap()),
    )
    .unwrap();
    assert_eq!(cfg["config"], serde_json::json!({"format": "safetensors"}));
    assert_eq!(cfg["descriptor"], serde_json::json!({}));
    let diff_ids: Vec<&serde_json::Value> = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| &l["digest"])
        .collect();
    assert_eq!(
        cfg["modelfs"],
        serde_json::json!({"type": "layers", "diffIds": diff_ids})
    );
    // What the config has no field for: the bits of `quantization_config`.
    assert_eq!(
        m["annotations"],
        serde_json::json!({"ai.flexinfer.model.quantization.bits": "4"})
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
        "5 files + the model config: {:?}",
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
    write_safetensors(&src.join("model.safetensors"), 2 << 20, 21);

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
    write_safetensors(&src.join("model.safetensors"), 1 << 20, 7);

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
        write_safetensors(
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
    // Kill it as soon as the registry has completed the first file blob (the config goes last).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done: Vec<String> = reg.uploaded_digests();
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
    let before_files = reg.uploaded_digests().len();
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
    let sha = write_safetensors(&src.join("model.safetensors"), 2 << 20, 21);
    std::fs::write(
        src.join("config.json"),
        r#"{"quantization_config":{"bits":4}}"#,
    )
    .unwrap();
    let size = std::fs::metadata(src.join("model.safetensors"))
        .unwrap()
        .len();
    let record = |sha: &str| {
        serde_json::json!({
            "version": 1, "script_version": "x", "completed_at": "2026-12-01T00:00:00Z",
            "shards": [{"name": "model.safetensors", "size_bytes": size, "sha256": sha}],
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
    write_safetensors(&src.join("model.safetensors"), 2 << 20, 22);
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

/// Where and how a test artifact is pushed: the repository (tag `v1`), the manifest's artifact type
/// and its config's media type.
struct Layout<'a> {
    repo: &'a str,
    artifact_type: Option<&'a str>,
    config: &'a str,
}

/// Pushes `files` (path, bytes, layer media type) to `layout` with the annotations `annotate` gives
/// each path; returns the manifest digest.
fn push_layout(
    reg: &Registry,
    layout: &Layout,
    files: &[(&str, &[u8], &str)],
    annotate: &dyn Fn(&str) -> serde_json::Value,
) -> String {
    let repo = layout.repo;
    let config = reg.put_blob(repo, b"{}");
    let layers: Vec<serde_json::Value> = files
        .iter()
        .map(|(path, bytes, media_type)| {
            serde_json::json!({
                "mediaType": media_type, "digest": reg.put_blob(repo, bytes), "size": bytes.len(),
                "annotations": annotate(path),
            })
        })
        .collect();
    let mut m = serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": layout.config, "digest": config, "size": 2},
        "layers": layers,
    });
    if let Some(t) = layout.artifact_type {
        m["artifactType"] = t.into();
    }
    reg.put_manifest(repo, "v1", &m)
}

fn pull(reg: &Registry, repo: &str, scratch: &Path, into: &Path) -> Run {
    let mut c = worker("download", scratch);
    c.env("SOURCE", format!("oci://{}/{repo}:v1", reg.addr))
        .env("MODEL_DIR", into)
        .env("OCI_INSECURE", "true");
    run(c, scratch)
}

/// An artifact `download` reads: its layout, the media types of its weight and config layers, and
/// the annotations that name each file.
struct Readable<'a> {
    layout: Layout<'a>,
    media_types: [&'a str; 2],
    annotate: &'a dyn Fn(&str) -> serde_json::Value,
}

/// An artifact `download` refuses: one layer of `media_type` with `annotations`, and what the
/// error must say.
struct Refused<'a> {
    layout: Layout<'a>,
    media_type: &'a str,
    annotations: serde_json::Value,
    want: &'a str,
}

#[test]
fn oci_sources_read_earlier_flexinfer_plain_oras_and_modctl_artifacts_and_refuse_archives() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let weights = vec![7u8; 70_000];
    let title = |p: &str| serde_json::json!({"org.opencontainers.image.title": p});
    let modelpack = |repo| Layout {
        repo,
        artifact_type: Some("application/vnd.cncf.model.manifest.v1+json"),
        config: "application/vnd.cncf.model.config.v1+json",
    };
    let oras = |repo| Layout {
        repo,
        artifact_type: Some("application/vnd.unknown.artifact.v1"),
        config: "application/vnd.oci.empty.v1+json",
    };
    let cases = [
        // What FlexInfer published before ModelPack (caches that point at such artifacts keep working).
        Readable {
            layout: Layout {
                repo: "old/flexinfer",
                artifact_type: Some("application/vnd.flexinfer.model.v1"),
                config: "application/vnd.oci.empty.v1+json",
            },
            media_types: ["application/vnd.flexinfer.model.file.v1"; 2],
            annotate: &title,
        },
        // `oras push ref model.safetensors tok/tokenizer.json`.
        Readable {
            layout: oras("plain/oras"),
            media_types: ["application/vnd.oci.image.layer.v1.tar"; 2],
            annotate: &title,
        },
        // modctl: the transitional vnd.cnai spelling, the path only in org.cnai.model.filepath.
        Readable {
            layout: Layout {
                repo: "modctl/raw",
                artifact_type: Some("application/vnd.cnai.model.manifest.v1+json"),
                config: "application/vnd.cnai.model.config.v1+json",
            },
            media_types: [
                "application/vnd.cnai.model.weight.v1.raw",
                "application/vnd.cnai.model.weight.config.v1.raw",
            ],
            annotate: &|p: &str| serde_json::json!({"org.cnai.model.filepath": p}),
        },
    ];
    for c in cases {
        let [wmt, cmt] = c.media_types;
        let repo = c.layout.repo;
        let digest = push_layout(
            &reg,
            &c.layout,
            &[
                ("model.safetensors", &weights, wmt),
                ("tok/tokenizer.json", br#"{"model":{}}"#, cmt),
            ],
            c.annotate,
        );
        let into = tmp.path().join(repo);
        let p = pull(&reg, repo, tmp.path(), &into);
        assert_eq!(p.code, 0, "{repo}: {}", p.describe());
        assert_eq!(p.termination["revision"], digest.as_str(), "{repo}");
        assert_eq!(
            std::fs::read(into.join("model.safetensors")).unwrap(),
            weights,
            "{repo}"
        );
        assert_eq!(
            std::fs::read_to_string(into.join("tok/tokenizer.json")).unwrap(),
            r#"{"model":{}}"#,
            "{repo}"
        );
    }

    // Refused at once (exit 2), naming the layer and its media type, nothing fetched: a ModelPack tar
    // layer, a directory `oras push` tarred, a layer without a path, a path out of the tree.
    let cases = [
        Refused {
            layout: modelpack("refused/tar"),
            media_type: "application/vnd.cncf.model.weight.v1.tar",
            annotations: serde_json::json!({"org.cncf.model.filepath": "model.safetensors"}),
            want: "a tar archive, which FlexInfer does not unpack",
        },
        Refused {
            layout: oras("refused/orasdir"),
            media_type: "application/vnd.oci.image.layer.v1.tar+gzip",
            annotations: serde_json::json!({"org.opencontainers.image.title": "tok", "io.deis.oras.content.unpack": "true"}),
            want: "a directory that `oras push` tarred",
        },
        Refused {
            layout: Layout {
                repo: "refused/untitled",
                artifact_type: None,
                config: "application/vnd.oci.image.config.v1+json",
            },
            media_type: "application/vnd.oci.image.layer.v1.tar+gzip",
            annotations: serde_json::json!({}),
            want: "names no file",
        },
        Refused {
            layout: modelpack("refused/escape"),
            media_type: "application/vnd.cncf.model.weight.v1.raw",
            annotations: serde_json::json!({"org.cncf.model.filepath": "../../etc/cron.d/x"}),
            want: "unsafe file path",
        },
    ];
    for c in cases {
        let repo = c.layout.repo;
        push_layout(&reg, &c.layout, &[("x", &weights, c.media_type)], &|_| {
            c.annotations.clone()
        });
        let into = tmp.path().join(repo);
        let p = pull(&reg, repo, tmp.path(), &into);
        assert_eq!(p.code, 2, "{repo}: {}", p.describe());
        let err = p.termination["error"].as_str().unwrap_or_default();
        assert!(
            err.contains("layer 0 (sha256:") && err.contains(c.media_type) && err.contains(c.want),
            "{repo}: {err}"
        );
        let fetched = reg
            .log_text()
            .lines()
            .filter(|l| l.contains(&format!("GET /v2/{repo}/blobs/")))
            .count();
        assert_eq!(
            fetched, 0,
            "{repo}: a blob of a refused artifact was fetched"
        );
    }
}
