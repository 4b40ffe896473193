//! `flexinfer-worker download` against a local Hugging Face Hub-compatible server with fault
//! injection (dropped connections, corruption, 401/404, 500s, SIGKILL + restart).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod download_support;

use std::path::Path;
use std::time::{Duration, Instant};

use download_support::*;

const REPO: &str = "acme/tiny-llama";
const BIG: &str = "model-00001-of-00002.safetensors";
const SMALL: &str = "model-00002-of-00002.safetensors";

fn download(hub: &HubServer, dest: &Path, scratch: &Path) -> std::process::Command {
    let mut c = worker("download", scratch);
    c.env("SOURCE", format!("HF://{REPO}"))
        .env("REVISION", "main")
        .env("MODEL_DIR", dest)
        .env("HF_ENDPOINT", hub.endpoint())
        .env("FLEXINFER_DOWNLOAD_RETRIES", "4");
    c
}

fn assert_tree_matches(dest: &Path, files: &[ServedFile]) {
    for f in files {
        let p = dest.join(&f.path);
        assert!(p.is_file(), "{} missing", f.path);
        assert_eq!(sha256_of(&p), f.sha256, "content of {}", f.path);
    }
}

#[test]
fn dropped_connection_resumes_with_range_and_never_refetches_finished_files() {
    let files = fixture().clone();
    let hub = start_hub(REPO, vec![("main", files.clone())]);
    hub.state
        .faults
        .lock()
        .unwrap()
        .drop_once_at
        .insert(BIG.into(), 64 << 20);
    hub.state
        .faults
        .lock()
        .unwrap()
        .fail_500
        .insert("config.json".into(), 1);
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("model");
    let r = run(download(&hub, &dest, tmp.path()), tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());

    assert_tree_matches(&dest, &files);
    // The big file: one full request cut at 64 MiB, then one Range request from there on.
    let big = hub.state.requests(BIG);
    assert_eq!(big.len(), 2, "{big:?}");
    assert_eq!(big[0].range_start, None);
    // Bytes in flight when the connection died may be lost, never more than a few buffers.
    let resumed = big[1].range_start.unwrap_or(0);
    assert!(
        resumed > (60 << 20) && resumed <= (64 << 20),
        "resumed at {resumed}: {big:?}"
    );
    // config.json: one 500, one success; every other file exactly once.
    assert_eq!(hub.state.requests("config.json").len(), 2);
    for f in &files {
        if f.path != BIG && f.path != "config.json" {
            assert_eq!(hub.state.requests(&f.path).len(), 1, "{}", f.path);
        }
    }
    // Markers: integrity lists every file with its sha256; complete marker present; no partials.
    let integrity: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dest.join(".source-integrity.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(integrity["revision"], "main");
    assert_eq!(integrity["source"], format!("hf://{REPO}"));
    assert_eq!(integrity["files"].as_array().unwrap().len(), files.len());
    let weight: u64 = files
        .iter()
        .filter(|f| f.path.ends_with(".safetensors"))
        .map(|f| f.size)
        .sum();
    assert_eq!(integrity["weightBytes"], weight);
    for f in &files {
        let entry = integrity["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == f.path.as_str())
            .unwrap();
        assert_eq!(entry["sha256"], f.sha256.as_str());
        assert_eq!(entry["size"], f.size);
    }
    assert!(dest.join(".download_complete").is_file());
    assert!(!dest.join(format!("{BIG}.part")).exists());
    // Events: progress in bytes, monotonic, ending at 100; termination message.
    let progress = r.events("progress");
    assert!(!progress.is_empty());
    let mut last = 0.0;
    for p in &progress {
        let pct = p["percent"].as_f64().unwrap();
        assert!(pct >= last, "progress went backwards: {progress:?}");
        last = pct;
        assert_eq!(p["unit"], "bytes");
        assert!(p["detail"].as_str().unwrap().contains("MiB/s"));
    }
    assert_eq!(last, 100.0);
    assert_eq!(r.termination["type"], "download");
    assert_eq!(r.termination["fileCount"], files.len());
    assert_eq!(
        r.termination["sizeBytes"],
        files.iter().map(|f| f.size).sum::<u64>()
    );

    // A second run with a derived artifact present: nothing fetched, nothing reset. The first run was as
    // if killed after its completion marker and before it removed its in-progress record: the second run
    // removes the record (seen once in the fault-injection test, kill point 10 of 12).
    std::fs::create_dir_all(dest.join("gptq-w4-g128")).unwrap();
    let marker = dest.join(flexinfer_worker::download::IN_PROGRESS_FILE);
    std::fs::write(
        &marker,
        serde_json::json!({"source": format!("hf://{REPO}"), "revision": "main", "files": []})
            .to_string(),
    )
    .unwrap();
    hub.state.reset_counts();
    let again = run(download(&hub, &dest, tmp.path()), tmp.path());
    assert_eq!(again.code, 0, "{}", again.describe());
    assert_eq!(
        hub.state.total_file_requests(),
        0,
        "a verified download must not be fetched again"
    );
    assert!(dest.join("gptq-w4-g128").is_dir());
    assert!(
        again.stderr.contains("already downloaded"),
        "{}",
        again.describe()
    );
    assert!(!marker.exists(), "{}", again.describe());
    assert!(
        again.stderr.contains("removed the in-progress record"),
        "{}",
        again.describe()
    );
}

#[test]
fn corrupted_byte_fails_verification_and_nothing_is_marked_complete() {
    let files: Vec<ServedFile> = fixture()
        .iter()
        .filter(|f| f.path != BIG)
        .cloned()
        .collect();
    let hub = start_hub(REPO, vec![("main", files.clone())]);
    hub.state
        .faults
        .lock()
        .unwrap()
        .corrupt
        .insert(SMALL.into());
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("model");
    let r = run(download(&hub, &dest, tmp.path()), tmp.path());
    assert_eq!(r.code, 1, "{}", r.describe());
    let err = r.termination["error"].as_str().unwrap_or_default();
    assert!(
        err.contains("sha256 mismatch") && err.contains(SMALL),
        "{}",
        r.describe()
    );
    assert_eq!(r.termination["exitCode"], 1);
    assert!(
        !dest.join(SMALL).exists(),
        "a corrupt file must never be renamed into place"
    );
    assert!(!dest.join(format!("{SMALL}.part")).exists());
    assert!(!dest.join(".download_complete").exists());
    assert!(!dest.join(".source-integrity.json").exists());
    // It was retried once from scratch before giving up.
    assert_eq!(hub.state.requests(SMALL).len(), 2);

    // A corrupt non-LFS file is caught by its git blob id.
    let hub2 = start_hub(REPO, vec![("main", files.clone())]);
    hub2.state
        .faults
        .lock()
        .unwrap()
        .corrupt
        .insert("tokenizer/vocab.txt".into());
    let dest2 = tmp.path().join("model2");
    let r = run(download(&hub2, &dest2, tmp.path()), tmp.path());
    assert_eq!(r.code, 1, "{}", r.describe());
    assert!(r.termination["error"]
        .as_str()
        .unwrap()
        .contains("git blob sha1 mismatch for tokenizer/vocab.txt"));
}

#[test]
fn unauthorized_and_missing_repositories_fail_fast_with_exit_2() {
    let files: Vec<ServedFile> = fixture()
        .iter()
        .filter(|f| f.path != BIG)
        .cloned()
        .collect();
    let hub = start_hub(REPO, vec![("main", files.clone())]);
    let secret = "hf_SECRETtoken1234567890";
    hub.state.faults.lock().unwrap().token = Some(secret.into());
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("m");

    let started = Instant::now();
    let r = run(download(&hub, &dest, tmp.path()), tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    let err = r.termination["error"].as_str().unwrap();
    assert!(
        err.contains("access denied") && err.contains("HTTP 401") && err.contains("HF_TOKEN"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "401 must not be retried for long"
    );

    let mut wrong = download(&hub, &dest, tmp.path());
    wrong.env("HF_TOKEN", "hf_wrongtoken99999");
    let r = run(wrong, tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    assert!(r.termination["error"]
        .as_str()
        .unwrap()
        .contains("token was rejected"));
    assert!(
        !r.describe().contains("hf_wrongtoken99999"),
        "the token leaked: {}",
        r.describe()
    );

    let mut ok = download(&hub, &dest, tmp.path());
    ok.env("HF_TOKEN", secret);
    let r = run(ok, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert!(!r.describe().contains(secret), "the token leaked");
    assert_tree_matches(&dest, &files);

    // Unknown repository and unknown revision: 404, exit 2, a message that says what to check.
    hub.state.faults.lock().unwrap().token = None;
    let mut missing = download(&hub, &tmp.path().join("x"), tmp.path());
    missing.env("SOURCE", "acme/does-not-exist");
    let r = run(missing, tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    assert!(
        r.termination["error"]
            .as_str()
            .unwrap()
            .contains("not found (HTTP 404)"),
        "{}",
        r.describe()
    );
    let mut badrev = download(&hub, &tmp.path().join("y"), tmp.path());
    badrev.env("REVISION", "nope");
    let r = run(badrev, tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    assert!(r.termination["error"]
        .as_str()
        .unwrap()
        .contains("acme/tiny-llama@nope"));

    // Bad input surfaces: unknown scheme, path traversal in the repo id, bad pattern.
    for (k, v) in [
        ("SOURCE", "s3://bucket/x"),
        ("SOURCE", "../../etc"),
        ("ALLOW_PATTERNS", "["),
    ] {
        let mut c = download(&hub, &tmp.path().join("z"), tmp.path());
        c.env(k, v);
        let r = run(c, tmp.path());
        assert_eq!(r.code, 2, "{k}={v}: {}", r.describe());
    }
}

#[test]
fn killed_download_resumes_from_its_partial_file() {
    let files: Vec<ServedFile> = fixture()
        .iter()
        .filter(|f| f.path == BIG || f.path == "config.json")
        .cloned()
        .collect();
    let hub = start_hub(REPO, vec![("main", files.clone())]);
    hub.state.faults.lock().unwrap().throttle = Some(60 << 20);
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("m");
    let mut child = download(&hub, &dest, tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let part = dest.join(format!("{BIG}.part"));
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0) < 40 << 20 {
        assert!(Instant::now() < deadline, "download did not progress");
        assert!(child.try_wait().unwrap().is_none(), "worker exited early");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let kept = std::fs::metadata(&part).unwrap().len();
    assert!(kept >= 40 << 20);
    assert!(!dest.join(".download_complete").exists());

    hub.state.faults.lock().unwrap().throttle = None;
    let r = run(download(&hub, &dest, tmp.path()), tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert_tree_matches(&dest, &files);
    let reqs = hub.state.requests(BIG);
    let resumed = reqs.last().unwrap().range_start.unwrap_or(0);
    // The buffered tail that had not reached the disk at SIGKILL is fetched again; nothing else.
    assert!(
        resumed >= 32 << 20 && resumed <= kept,
        "resumed at {resumed}, kept {kept}: {reqs:?}"
    );
}

#[test]
fn changed_revision_resets_derived_artifacts_and_removes_stale_files() {
    let v1: Vec<ServedFile> = fixture()
        .iter()
        .filter(|f| f.path != BIG)
        .cloned()
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    // v2: the second shard changed, README removed.
    let v2dir = tmp.path().join("v2src");
    write_data(&v2dir.join(SMALL), 5 << 20, 99);
    let new_small = describe(&v2dir).remove(0);
    let mut v2: Vec<ServedFile> = v1
        .iter()
        .filter(|f| f.path != SMALL && f.path != "README.md")
        .cloned()
        .collect();
    v2.push(new_small.clone());
    let hub = start_hub(REPO, vec![("main", v1.clone()), ("v2", v2.clone())]);
    let dest = tmp.path().join("m");
    let r = run(download(&hub, &dest, tmp.path()), tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    // Later phases produced artifacts from v1.
    for d in [
        "abliterated",
        ".flexinfer-gptq-cache/layers",
        "gptq-w4-g128",
    ] {
        std::fs::create_dir_all(dest.join(d)).unwrap();
    }
    std::fs::write(dest.join(".abliteration-status.json"), "{}").unwrap();

    let mut c = download(&hub, &dest, tmp.path());
    c.env("REVISION", "v2");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    // Caches tied to the old weights go; outputs stay (a Model may serve one until the controller
    // promotes a generation made from the new revision, and garbage collection removes it then).
    for d in [".flexinfer-gptq-cache", ".abliteration-status.json"] {
        assert!(!dest.join(d).exists(), "{d} survived a revision change");
    }
    for d in ["abliterated", "gptq-w4-g128"] {
        assert!(
            dest.join(d).exists(),
            "{d} was deleted before a newer generation replaced it"
        );
    }
    assert!(
        !dest.join("README.md").exists(),
        "a file the new revision lacks must go"
    );
    assert_eq!(sha256_of(&dest.join(SMALL)), new_small.sha256);
    assert_tree_matches(&dest, &v2);
    let integrity: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dest.join(".source-integrity.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(integrity["revision"], "v2");
    // Unchanged files were verified on disk, not fetched again.
    assert_eq!(hub.state.requests("config.json").len(), 1);
}

#[test]
fn allow_and_ignore_patterns_select_files() {
    let files: Vec<ServedFile> = fixture()
        .iter()
        .filter(|f| f.path != BIG)
        .cloned()
        .collect();
    let hub = start_hub(REPO, vec![("main", files)]);
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("m");
    let mut c = download(&hub, &dest, tmp.path());
    c.env("ALLOW_PATTERNS", "*.json,tokenizer/")
        .env("IGNORE_PATTERNS", "*.txt");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    let got: Vec<String> = tree(&dest, &[".source-integrity.json", ".download_complete"])
        .into_keys()
        .collect();
    assert_eq!(
        got,
        vec![
            "config.json".to_string(),
            "tokenizer/tokenizer.json".to_string()
        ]
    );
    // Flags win over env.
    let mut c = download(&hub, &tmp.path().join("n"), tmp.path());
    c.env("ALLOW_PATTERNS", "*.json")
        .arg("--allow-patterns")
        .arg("README.md");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert!(tmp.path().join("n/README.md").is_file());
    assert!(!tmp.path().join("n/config.json").exists());
    // Nothing left after filtering is a clear bad-input error.
    let mut c = download(&hub, &tmp.path().join("o"), tmp.path());
    c.env("ALLOW_PATTERNS", "*.gguf");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    assert!(r.termination["error"]
        .as_str()
        .unwrap()
        .contains("none match"));
}

#[test]
fn local_sources_are_copied_verified_and_confined() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("models");
    let src = root.join("tiny");
    write_data(&src.join("model.safetensors"), 3 << 20, 5);
    std::fs::write(src.join("config.json"), "{}").unwrap();
    let dest = tmp.path().join("cache/m");
    let mut c = worker("download", tmp.path());
    c.env("SOURCE", "local://tiny")
        .env("MODEL_DIR", &dest)
        .env("FLEXINFER_LOCAL_SOURCE_ROOT", &root);
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert_eq!(
        tree(&dest, &[".source-integrity.json", ".download_complete"]),
        tree(&src, &[])
    );
    assert!(dest.join(".download_complete").is_file());

    // In place (source == MODEL_DIR): verified, markers written, files untouched.
    let mut c = worker("download", tmp.path());
    c.env("SOURCE", "local://tiny")
        .env("MODEL_DIR", &src)
        .env("FLEXINFER_LOCAL_SOURCE_ROOT", &root);
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert!(src.join(".source-integrity.json").is_file());

    // Escaping the root, or no root configured: exit 2.
    for (source, root_env) in [
        ("local://../", Some(&root)),
        ("local:///etc", Some(&root)),
        ("local://tiny", None),
    ] {
        let mut c = worker("download", tmp.path());
        c.env("SOURCE", source)
            .env("MODEL_DIR", tmp.path().join("x"));
        if let Some(r) = root_env {
            c.env("FLEXINFER_LOCAL_SOURCE_ROOT", r);
        }
        let r = run(c, tmp.path());
        assert_eq!(r.code, 2, "{source}: {}", r.describe());
    }
}

#[test]
fn version_mismatch_exits_4() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = worker("download", tmp.path());
    c.env("SOURCE", "acme/x")
        .env("MODEL_DIR", tmp.path().join("m"))
        .env("FLEXINFER_SCRIPT_VERSION", "v0");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 4, "{}", r.describe());
    assert!(r.termination["error"]
        .as_str()
        .unwrap()
        .starts_with("FATAL: Script version mismatch"));
}

#[test]
fn calibration_dataset_is_fetched_under_dot_datasets() {
    let files: Vec<ServedFile> = fixture()
        .iter()
        .filter(|f| f.path == "config.json")
        .cloned()
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let dsdir = tmp.path().join("ds");
    write_data(&dsdir.join("val.jsonl.zst"), 2 << 20, 42);
    std::fs::write(dsdir.join("README.md"), "calibration").unwrap();
    let ds_files = describe(&dsdir);
    let prompts = tmp.path().join("prompts");
    std::fs::create_dir_all(&prompts).unwrap();
    std::fs::write(prompts.join("train.jsonl"), "{\"text\": \"a prompt\"}\n").unwrap();
    let prompt_files = describe(&prompts);
    let hub = start_hub(
        REPO,
        vec![
            ("main", files),
            ("dataset:mit-han-lab/pile-val-backup@main", ds_files.clone()),
            ("dataset:org/refusal-prompts@main", prompt_files.clone()),
        ],
    );
    let dest = tmp.path().join("m");
    let mut c = download(&hub, &dest, tmp.path());
    c.env("DATASET", "mit-han-lab/pile-val-backup");
    // The abliteration prompt sets are fetched the same way; a repeated id only once.
    c.env("REFUSAL_DATASET", "org/refusal-prompts");
    c.env("HARMLESS_DATASET", "org/refusal-prompts");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert_tree_matches(&dest.join(".datasets/org/refusal-prompts"), &prompt_files);
    assert_eq!(
        hub.state
            .requests("datasets/org/refusal-prompts/train.jsonl")
            .len(),
        1
    );
    let ds_dest = dest.join(".datasets/mit-han-lab/pile-val-backup");
    assert_tree_matches(&ds_dest, &ds_files);
    assert!(ds_dest.join(".download_complete").is_file());
    assert!(dest.join(".download_complete").is_file());
    assert_eq!(
        hub.state
            .requests("datasets/mit-han-lab/pile-val-backup/val.jsonl.zst")
            .len(),
        1
    );
    // The model's integrity record does not list dataset files.
    let integrity = std::fs::read_to_string(dest.join(".source-integrity.json")).unwrap();
    assert!(!integrity.contains("val.jsonl.zst"));

    // A local dataset path is not fetched.
    let dest2 = tmp.path().join("m2");
    let mut c = download(&hub, &dest2, tmp.path());
    c.env("DATASET", "/data/calib.jsonl");
    let r = run(c, tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert!(!dest2.join(".datasets").exists());
}

#[test]
fn interrupted_download_of_another_source_is_discarded() {
    let files: Vec<ServedFile> = fixture()
        .iter()
        .filter(|f| f.path == "config.json" || f.path == "README.md")
        .cloned()
        .collect();
    let hub = start_hub(REPO, vec![("main", files.clone())]);
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("m");
    // What a killed run of another source leaves behind.
    std::fs::create_dir_all(dest.join("gptq-w4-g128")).unwrap();
    std::fs::write(dest.join("old-model.safetensors"), "old weights").unwrap();
    std::fs::write(dest.join("config.json.part"), "{\"old\":").unwrap();
    std::fs::write(
        dest.join(flexinfer_worker::download::IN_PROGRESS_FILE),
        r#"{"source":"hf://other/model","revision":"main","files":["old-model.safetensors","config.json"]}"#,
    )
    .unwrap();
    let r = run(download(&hub, &dest, tmp.path()), tmp.path());
    assert_eq!(r.code, 0, "{}", r.describe());
    assert!(!dest.join("old-model.safetensors").exists());
    // An output directory is not the download's to delete (the controller's garbage collection is).
    assert!(dest.join("gptq-w4-g128").exists());
    assert!(!dest
        .join(flexinfer_worker::download::IN_PROGRESS_FILE)
        .exists());
    assert_tree_matches(&dest, &files);
    // The stale partial was not continued: one full request.
    assert_eq!(hub.state.requests("config.json")[0].range_start, None);
}

/// A repository that ships a name the pipeline writes (a completion marker of an output directory) is
/// refused before anything is fetched: it could otherwise skip quantization and the gate.
#[test]
fn a_source_with_pipeline_file_names_is_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = tmp.path().join("extra");
    std::fs::create_dir_all(extra.join("gptq-w4-g128")).unwrap();
    std::fs::write(
        extra.join("gptq-w4-g128/.save-complete"),
        r#"{"version":1,"shards":[]}"#,
    )
    .unwrap();
    let mut files = fixture().clone();
    files.extend(describe(&extra));
    let hub = start_hub(REPO, vec![("main", files)]);
    let dest = tmp.path().join("m");
    let r = run(download(&hub, &dest, tmp.path()), tmp.path());
    assert_eq!(r.code, 2, "{}", r.describe());
    let msg = r.termination["error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        msg.contains("gptq-w4-g128/.save-complete") && msg.contains("ignorePatterns"),
        "{msg}"
    );
    assert!(!dest.join("gptq-w4-g128").exists());
    assert!(!dest.join(".download_complete").exists());
}
