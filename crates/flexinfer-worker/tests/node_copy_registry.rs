//! `flexinfer-worker node-copy` (the copy of a `storageStrategy: NodeLocal` cache on one node)
//! against a real registry (Debian's docker-registry on loopback): what `publish` pushed is pulled,
//! verified against its layers and `.save-complete`, renamed into place; a tampered record or a
//! tag-only reference leaves nothing behind; `clean` keeps exactly the named copy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod download_support;
mod publish_support;

use std::path::Path;
use std::process::Command;

use download_support::*;
use publish_support::Registry;

/// A quantized output as the pipeline leaves it: two shards, their record, config, tokenizer.
fn output_tree(dir: &Path) {
    let a = write_safetensors(&dir.join("model-00001-of-00002.safetensors"), 6 << 20, 21);
    let b = write_safetensors(&dir.join("model-00002-of-00002.safetensors"), 1 << 20, 22);
    let size = |n: &str| std::fs::metadata(dir.join(n)).unwrap().len();
    let record = serde_json::json!({
        "version": 1,
        "script_version": "test",
        "completed_at": "2026-12-07T00:00:00Z",
        "shards": [
            {"name": "model-00001-of-00002.safetensors", "size_bytes": size("model-00001-of-00002.safetensors"), "sha256": a},
            {"name": "model-00002-of-00002.safetensors", "size_bytes": size("model-00002-of-00002.safetensors"), "sha256": b},
        ],
        "has_index": false,
        "has_config": true,
        "has_quantize_config": false,
    });
    std::fs::write(
        dir.join(".save-complete"),
        serde_json::to_vec(&record).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"quantization_config":{"bits":4}}"#,
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("tokenizer")).unwrap();
    std::fs::write(dir.join("tokenizer/tokenizer.json"), r#"{"model":{}}"#).unwrap();
}

fn publish(reg: &Registry, dir: &Path, reference: &str, scratch: &Path) -> String {
    let mut c = worker("publish", scratch);
    c.env("MODEL_DIR", dir)
        .env("OCI_REF", format!("{}/{reference}", reg.addr))
        .env("OCI_INSECURE", "True");
    let r = run(c, scratch);
    assert_eq!(r.code, 0, "{}\n{}", r.describe(), reg.log_text());
    r.termination["digest"].as_str().unwrap().to_string()
}

fn node_copy(op: &str, node_dir: &Path, scratch: &Path) -> Command {
    let mut c = worker("node-copy", scratch);
    c.arg(op)
        .env("NODE_COPY_DIR", node_dir)
        .env("OCI_INSECURE", "true");
    c
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn fill_copies_the_published_tree_verified_and_only_then_renames_it() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("out");
    output_tree(&src);
    let digest = publish(&reg, &src, "flexinfer/nl:v1", tmp.path());
    let hex = digest.trim_start_matches("sha256:").to_string();
    let node_dir = tmp.path().join("node/ns/cache");

    let fill = |scratch: &Path| {
        let mut c = node_copy("fill", &node_dir, scratch);
        c.env(
            "SOURCE",
            format!("oci://{}/flexinfer/nl@{digest}", reg.addr),
        );
        run(c, scratch)
    };
    let r = fill(tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert_eq!(r.termination["type"], "node-copy");
    let copy = node_dir.join(&hex);
    assert_eq!(
        r.termination["outputDir"].as_str(),
        Some(copy.to_str().unwrap())
    );
    // Every file of the published tree, byte for byte; no staging or lock entry left beside it.
    let want = tree(&src, &[]);
    let got = tree(&copy, &[".source-integrity.json", ".download_complete"]);
    assert_eq!(got, want);
    assert_eq!(entries(&node_dir), vec![hex.clone()]);
    // The serving pods run as another user: every file readable, every directory searchable by all.
    let mut todo = vec![copy.clone()];
    while let Some(d) = todo.pop() {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&d).unwrap().permissions().mode() & 0o777,
            0o755,
            "{}",
            d.display()
        );
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                todo.push(e.path());
            } else {
                let mode = e.metadata().unwrap().permissions().mode() & 0o777;
                assert_eq!(mode, 0o644, "{}", e.path().display());
            }
        }
    }
    assert!(
        r.stderr
            .contains("2 weight shard(s) against .save-complete"),
        "{}",
        r.describe()
    );

    // A second fill of the same digest is a no-op that reports the copy.
    let again = fill(tmp.path());
    assert_eq!(again.code, 0, "{}", again.describe());
    assert!(
        again.stderr.contains("already holds the verified copy"),
        "{}",
        again.describe()
    );
    assert_eq!(
        tree(&copy, &[".source-integrity.json", ".download_complete"]),
        want
    );
}

#[test]
fn a_record_that_disagrees_with_the_artifact_or_a_tag_leaves_nothing_on_the_node() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("out");
    output_tree(&src);
    let digest = publish(&reg, &src, "flexinfer/nl:v1", tmp.path());

    // The same artifact with a `.save-complete` whose first shard's sha256 is wrong.
    let (st, body) = reg.get(&format!("/v2/flexinfer/nl/manifests/{digest}"));
    assert_eq!(st, 200, "{body}");
    let mut m: serde_json::Value = serde_json::from_str(&body).unwrap();
    let record_path = src.join(".save-complete");
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record_path).unwrap()).unwrap();
    record["shards"][0]["sha256"] = serde_json::json!("0".repeat(64));
    let bad = serde_json::to_vec(&record).unwrap();
    let bad_digest = reg.put_blob("flexinfer/nl", &bad);
    let layer = m["layers"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|l| l["annotations"]["org.opencontainers.image.title"] == ".save-complete")
        .expect("the .save-complete layer");
    layer["digest"] = serde_json::json!(bad_digest);
    layer["size"] = serde_json::json!(bad.len());
    let tampered = reg.put_manifest("flexinfer/nl", "tampered", &m);

    let node_dir = tmp.path().join("node/ns/cache");
    let mut c = node_copy("fill", &node_dir, tmp.path());
    c.env(
        "SOURCE",
        format!("oci://{}/flexinfer/nl@{tampered}", reg.addr),
    );
    let r = run(c, tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    let msg = r.termination.to_string();
    assert!(
        msg.contains("model-00001-of-00002.safetensors") && msg.contains(".save-complete"),
        "{msg}"
    );
    let hex = tampered.trim_start_matches("sha256:");
    assert!(
        !node_dir.join(hex).exists(),
        "a copy that failed verification was renamed into place: {:?}",
        entries(&node_dir)
    );

    // A tag names no fixed content: refused before anything is fetched.
    let mut c = node_copy("fill", &tmp.path().join("node2"), tmp.path());
    c.env("SOURCE", format!("oci://{}/flexinfer/nl:v1", reg.addr));
    let r = run(c, tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    assert!(
        r.termination.to_string().contains("names no digest"),
        "{}",
        r.describe()
    );
    assert!(!tmp.path().join("node2").exists());
}

#[test]
fn clean_keeps_the_named_copy_and_removes_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let node_dir = tmp.path().join("node/ns/cache");
    let keep = "a".repeat(64);
    let old = "b".repeat(64);
    for d in [&keep, &old, &format!("{old}.partial")] {
        std::fs::create_dir_all(node_dir.join(d)).unwrap();
        std::fs::write(node_dir.join(d).join("model.safetensors"), "x").unwrap();
    }
    std::fs::write(node_dir.join(format!("{old}.partial.lock")), "").unwrap();

    let mut c = node_copy("clean", &node_dir, tmp.path());
    c.env("NODE_COPY_KEEP", format!("sha256:{keep}"));
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert_eq!(entries(&node_dir), vec![keep.clone()]);
    assert!(node_dir.join(&keep).join("model.safetensors").exists());

    // A keep that is not a digest is refused, nothing removed.
    let mut c = node_copy("clean", &node_dir, tmp.path());
    c.env("NODE_COPY_KEEP", "latest");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    assert_eq!(entries(&node_dir), vec![keep.clone()]);

    // Without a keep: every copy and the cache's directory go; a second run finds nothing to do.
    for _ in 0..2 {
        let r = run(node_copy("clean", &node_dir, tmp.path()), tmp.path());
        assert_eq!(r.code, 0, "{}", r.describe());
        assert!(!node_dir.exists());
    }
}
