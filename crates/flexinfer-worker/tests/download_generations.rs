//! Download generations on the real worker binary against the local hub: a new revision downloads
//! beside the one that is served, unchanged files are hard-linked (and re-verified) instead of fetched,
//! earlier generations are collected only when no longer kept, a download made before generations is
//! reused and retired the same way, and bytes changed on disk during a download are never recorded as
//! verified.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod download_support;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use download_support::*;

const REPO: &str = "acme/gen-llama";
const SHARD: &str = "model-00002-of-00002.safetensors";
const INTEGRITY: &str = ".source-integrity.json";
const COMPLETE: &str = ".download_complete";

/// The fixture without its 210 MiB shard.
fn v1() -> Vec<ServedFile> {
    fixture()
        .iter()
        .filter(|f| f.path != "model-00001-of-00002.safetensors")
        .cloned()
        .collect()
}

fn gen(root: &Path, n: u32) -> PathBuf {
    root.join(format!("source.0a1b2c3{n}-2026120100000{n}"))
}

/// `download` of `revision` into the generation `out` of the cache directory `root`, keeping `keep`
/// (directory names relative to the parent of `root`, as the controller writes them).
fn download(
    hub: &HubServer,
    root: &Path,
    out: Option<&Path>,
    revision: &str,
    keep: &[&Path],
    scratch: &Path,
) -> std::process::Command {
    let mut c = worker("download", scratch);
    c.env("SOURCE", format!("HF://{REPO}"))
        .env("REVISION", revision)
        .env("MODEL_DIR", root)
        .env("HF_ENDPOINT", hub.endpoint())
        .env("FLEXINFER_DOWNLOAD_RETRIES", "4");
    if let Some(o) = out {
        c.env("OUT_DIR", o);
    }
    let pvc = root.parent().unwrap();
    let keep: Vec<String> = keep
        .iter()
        .map(|k| k.strip_prefix(pvc).unwrap().display().to_string())
        .collect();
    c.env("FLEXINFER_KEEP_DIRS", keep.join(","));
    c
}

fn files_of(t: &std::collections::BTreeMap<String, String>) -> Vec<String> {
    t.keys().cloned().collect()
}

fn served_tree(files: &[ServedFile]) -> std::collections::BTreeMap<String, String> {
    files
        .iter()
        .map(|f| (f.path.clone(), f.sha256.clone()))
        .collect()
}

#[test]
fn a_new_revision_downloads_beside_the_served_one_and_links_what_did_not_change() {
    let tmp = tempfile::tempdir().unwrap();
    let v1 = v1();
    // v2: the shard changed, README removed.
    let v2src = tmp.path().join("v2src");
    write_data(&v2src.join(SHARD), 5 << 20, 77);
    let mut v2: Vec<ServedFile> = v1
        .iter()
        .filter(|f| f.path != SHARD && f.path != "README.md")
        .cloned()
        .collect();
    v2.extend(describe(&v2src));
    let hub = start_hub(REPO, vec![("main", v1.clone()), ("v2", v2.clone())]);
    let root = tmp.path().join("pvc/m");
    let (g1, g2, g3) = (gen(&root, 1), gen(&root, 2), gen(&root, 3));

    let r = run(
        download(&hub, &root, Some(&g1), "main", &[&g1], tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 0, "{}", r.describe());
    let skip = [INTEGRITY, COMPLETE];
    assert_eq!(tree(&g1, &skip), served_tree(&v1));
    assert!(g1.join(COMPLETE).is_file() && g1.join(INTEGRITY).is_file());
    // The model's files live in the generation, not in the cache directory.
    assert!(!root.join("config.json").exists());
    assert_eq!(
        r.termination["outputDir"],
        g1.display().to_string(),
        "{}",
        r.describe()
    );
    let served_before = tree(&g1, &[]);

    // v2 into a second generation, slowly: the served generation stays whole while it runs.
    hub.state.reset_counts();
    hub.state.faults.lock().unwrap().throttle = Some(2 << 20);
    let mut child = download(&hub, &root, Some(&g2), "v2", &[&g1, &g2], tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let part = g2.join(format!("{SHARD}.part"));
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0) < 1 << 20 {
        assert!(
            Instant::now() < deadline,
            "the v2 download did not progress"
        );
        assert!(child.try_wait().unwrap().is_none(), "worker exited early");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        tree(&g1, &[]),
        served_before,
        "the served generation changed while the next one downloaded"
    );
    hub.state.faults.lock().unwrap().throttle = None;
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}");
    assert_eq!(tree(&g2, &skip), served_tree(&v2));
    assert_eq!(tree(&g1, &[]), served_before, "the kept generation changed");
    // Unchanged files are hard links to the earlier generation's, not fetched again.
    for f in v2.iter().filter(|f| f.path != SHARD) {
        let a = std::fs::metadata(g1.join(&f.path)).unwrap().ino();
        let b = std::fs::metadata(g2.join(&f.path)).unwrap().ino();
        assert_eq!(a, b, "{} was not linked", f.path);
        assert!(hub.state.requests(&f.path).is_empty(), "{} fetched", f.path);
    }
    assert_eq!(hub.state.requests(SHARD).len(), 1);
    assert!(stderr.contains("hard-linked from"), "{stderr}");

    // A third run keeps only itself and the second: the first is collected after it completes.
    hub.state.reset_counts();
    let r = run(
        download(&hub, &root, Some(&g3), "main", &[&g2, &g3], tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 0, "{}", r.describe());
    assert!(!g1.exists(), "an unkept generation survived");
    assert_eq!(
        tree(&g2, &skip),
        served_tree(&v2),
        "a kept generation changed"
    );
    assert_eq!(tree(&g3, &skip), served_tree(&v1));
    // Everything main has was on disk in the first generation when the third one started.
    assert_eq!(hub.state.total_file_requests(), 0);
    let collected = r.events("generations_collected");
    assert_eq!(collected.len(), 1, "{}", r.describe());
    assert_eq!(
        collected[0]["removed"],
        serde_json::json!([g1.file_name().unwrap().to_string_lossy()])
    );
}

#[test]
fn a_download_made_before_generations_is_reused_then_retired_when_no_longer_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let v1 = v1();
    let hub = start_hub(REPO, vec![("main", v1.clone())]);
    let root = tmp.path().join("pvc/m");
    // The old layout: the files in the cache directory itself, outputs beside them.
    let r = run(
        download(&hub, &root, None, "main", &[], tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 0, "{}", r.describe());
    std::fs::create_dir_all(root.join("gptq-w4-g128.aaaaaaaa-20261101000000")).unwrap();
    std::fs::write(
        root.join("gptq-w4-g128.aaaaaaaa-20261101000000/model.safetensors"),
        "q",
    )
    .unwrap();
    std::fs::create_dir_all(root.join(".datasets/org/calib")).unwrap();
    std::fs::write(root.join(".datasets/org/calib/data.jsonl"), "{}\n").unwrap();

    // First generation, the root still kept (it is the promoted download): everything linked.
    hub.state.reset_counts();
    let (g1, g2) = (gen(&root, 1), gen(&root, 2));
    let r = run(
        download(&hub, &root, Some(&g1), "main", &[&root, &g1], tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 0, "{}", r.describe());
    assert_eq!(hub.state.total_file_requests(), 0, "{}", r.describe());
    let skip = [INTEGRITY, COMPLETE];
    assert_eq!(tree(&g1, &skip), served_tree(&v1));
    for f in &v1 {
        assert!(
            root.join(&f.path).is_file(),
            "{} left the kept root",
            f.path
        );
    }

    // Second generation, the root no longer kept: its download goes, nothing else of it does.
    let r = run(
        download(&hub, &root, Some(&g2), "main", &[&g1, &g2], tmp.path()),
        tmp.path(),
    );
    assert_eq!(r.code, 0, "{}", r.describe());
    for f in &v1 {
        assert!(!root.join(&f.path).exists(), "{} survived", f.path);
    }
    assert!(
        !root.join("tokenizer").exists(),
        "an emptied directory survived"
    );
    assert!(!root.join(COMPLETE).exists() && !root.join(INTEGRITY).exists());
    assert!(root
        .join("gptq-w4-g128.aaaaaaaa-20261101000000/model.safetensors")
        .is_file());
    assert!(root.join(".datasets/org/calib/data.jsonl").is_file());
    assert_eq!(tree(&g1, &skip), served_tree(&v1));
    assert_eq!(tree(&g2, &skip), served_tree(&v1));
    let mut names = files_of(&tree(&root, &[]));
    names.retain(|n| !n.starts_with("source.") && !n.starts_with("gptq-"));
    assert_eq!(names, vec![".datasets/org/calib/data.jsonl".to_string()]);
}

#[test]
fn bytes_changed_on_disk_during_a_download_are_never_recorded_as_verified() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write_data(&src.join(SHARD), 12 << 20, 5);
    let files = describe(&src);
    let want = files[0].sha256.clone();
    let hub = start_hub(REPO, vec![("main", files.clone())]);
    hub.state.faults.lock().unwrap().throttle = Some(6 << 20);
    let root = tmp.path().join("pvc/m");
    let g1 = gen(&root, 1);
    let child = download(&hub, &root, Some(&g1), "main", &[&g1], tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let part = g1.join(format!("{SHARD}.part"));
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0) < 2 << 20 {
        assert!(Instant::now() < deadline, "the download did not progress");
        std::thread::sleep(Duration::from_millis(10));
    }
    // A second writer scribbles over bytes the worker already streamed (and hashed).
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&part).unwrap();
        f.seek(SeekFrom::Start(4096)).unwrap();
        f.write_all(&[0u8; 4096]).unwrap();
        f.sync_all().unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}");
    assert_eq!(sha256_of(&g1.join(SHARD)), want, "corrupt bytes were kept");
    assert!(
        stderr.contains("the bytes on disk differ from the bytes received"),
        "{stderr}"
    );
    let integrity: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(g1.join(INTEGRITY)).unwrap()).unwrap();
    assert_eq!(integrity["files"][0]["sha256"], want.as_str());
    // Fetched twice: the scribbled attempt was thrown away.
    assert_eq!(hub.state.requests(SHARD).len(), 2);
}
