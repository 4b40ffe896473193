//! Resume after a real SIGKILL: a child process (this test binary re-run on an ignored entry point) quantizes
//! until layer 1 is cached and then hangs; the parent kills it with SIGKILL, restarts the job in-process, and
//! compares the artifact with an uninterrupted run byte for byte.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod common;

use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::events::MemorySink;
use flexinfer_quant::job::{run, QuantizeJob};
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::params::GptqParams;
use flexinfer_quant::QuantError;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "FLEXINFER_QUANT_SIGKILL_CHILD";

fn job(model: &Path, out: &Path, ds: &Path) -> QuantizeJob {
    QuantizeJob {
        params: GptqParams {
            bits: 4,
            group_size: 32,
            desc_act: true,
            ..Default::default()
        },
        n_parallel_calib_samples: Some(5),
        max_shard_bytes: 150_000,
        ..QuantizeJob::new(
            model,
            out,
            ds,
            CalibSettings {
                max_samples: 12,
                max_seq_len: 40,
            },
            "test",
        )
    }
}

/// Child entry point: runs until layer 1 is cached, then hangs until killed.
#[test]
#[ignore = "entry point for the SIGKILL test's child process"]
fn sigkill_child_entry() {
    let Ok(root) = std::env::var(CHILD_ENV) else {
        return;
    };
    let root = PathBuf::from(root);
    let mut j = job(
        &root.join("model"),
        &root.join("killed"),
        &root.join("calib.jsonl"),
    );
    j.abort_after_layer = Some(1);
    match run(&j, &CpuBackend::default(), &MemorySink::default()) {
        Err(QuantError::TestAbort(1)) => loop {
            std::thread::sleep(Duration::from_secs(1));
        },
        other => panic!(
            "child expected to stop after layer 1: {:?}",
            other.map(|o| o.output_dir)
        ),
    }
}

#[test]
fn sigkill_mid_run_then_resume_is_byte_identical() {
    let tmp = tempfile::tempdir().expect("tmp");
    let root = tmp.path();
    let model = root.join("model");
    common::write_model(&model, "LlamaForCausalLM", 5);
    common::write_dataset(&root.join("calib.jsonl"), 16);

    let straight = root.join("straight");
    run(
        &job(&model, &straight, &root.join("calib.jsonl")),
        &CpuBackend::default(),
        &MemorySink::default(),
    )
    .expect("uninterrupted");
    let expected = common::artifact_files(&straight);

    let exe = std::env::current_exe().expect("test binary");
    let mut child = std::process::Command::new(exe)
        .args(["--exact", "sigkill_child_entry", "--ignored", "--nocapture"])
        .env(CHILD_ENV, root)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn child");
    let manifest = model.join(".flexinfer-gptq-cache/layers/manifest.json");
    let started = Instant::now();
    loop {
        let layers = std::fs::read(&manifest)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v["layers"].as_array().map(Vec::len))
            .unwrap_or(0);
        if layers >= 2 {
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("child exited early: {status}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "child never cached layer 1"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("wait");
    assert!(!status.success());
    assert!(!root.join("killed").exists());

    let sink = MemorySink::default();
    let o = run(
        &job(&model, &root.join("killed"), &root.join("calib.jsonl")),
        &CpuBackend::default(),
        &sink,
    )
    .expect("resume");
    assert_eq!(
        sink.named("quantization_resume_loaded")
            .first()
            .and_then(|e| e["layers"].as_u64()),
        Some(2)
    );
    assert_eq!(
        common::artifact_files(&o.output_dir),
        expected,
        "resumed artifact differs from the uninterrupted one"
    );
}
