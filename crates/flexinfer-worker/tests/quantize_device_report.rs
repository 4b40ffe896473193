//! What a quantize run says about its GPTQ device, on the real worker binary: the `gptq_device_selected`
//! event on stdout and the termination message's `gptqDevice` carry the same report (the contract's
//! `GptqDeviceReport`), and `applied` holds the `GPTQ_DEVICE` setting only.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod abliterate_support;

use std::path::Path;
use std::process::Command;

use abliterate_support::{build, TinyModel, TinyOpts};
use flexinfer_contract::{env, events, GptqDeviceReport, TerminationSuccess, WorkerEvent};

struct Run {
    stdout: String,
    termination: String,
}

fn quantize(m: &TinyModel, out: &Path, gptq_device: Option<&str>) -> Run {
    let calib = m.root.path().join("calib.jsonl");
    if !calib.exists() {
        let lines: Vec<String> = flexinfer_quant::testkit::sentences(3, 32)
            .into_iter()
            .map(|s| serde_json::json!({ "text": s }).to_string())
            .collect();
        std::fs::write(&calib, lines.join("\n") + "\n").unwrap();
    }
    let term = out.with_extension("termination.json");
    let mut c = Command::new(env!("CARGO_BIN_EXE_flexinfer-worker"));
    c.arg("quantize")
        .env_clear()
        .env(env::MODEL_DIR, &m.dir)
        .env(env::OUT_DIR, out)
        .env(env::TERMINATION_LOG, &term)
        .env(env::DATASET, &calib)
        .env(env::GROUP_SIZE, "32")
        .env(env::MAX_SAMPLES, "8")
        .env(env::MAX_SEQ_LEN, "32");
    if let Some(d) = gptq_device {
        c.env(env::GPTQ_DEVICE, d);
    }
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "quantize (GPTQ_DEVICE={gptq_device:?}) failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Run {
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        termination: std::fs::read_to_string(&term).unwrap(),
    }
}

fn selected(stdout: &str) -> GptqDeviceReport {
    let all: Vec<WorkerEvent> = stdout
        .lines()
        .filter_map(WorkerEvent::parse_line)
        .filter(|e| e.event == events::GPTQ_DEVICE_SELECTED)
        .collect();
    assert_eq!(all.len(), 1, "one gptq_device_selected event: {stdout}");
    all[0].gptq_device().expect("the event is a device report")
}

#[test]
fn the_event_and_the_termination_message_report_the_same_device() {
    let m = build(&TinyOpts::default());
    for (setting, requested) in [(None, "auto"), (Some(" CPU "), "cpu")] {
        let out = m.dir.join(format!("gptq-w4-g32.{requested}"));
        let r = quantize(&m, &out, setting);
        let t: TerminationSuccess = serde_json::from_str(&r.termination).unwrap();
        let report = t
            .gptq_device
            .clone()
            .expect("gptqDevice in the termination message");
        assert_eq!(report, selected(&r.stdout), "{setting:?}");
        assert_eq!(report.requested, requested);
        match (requested, report.kind.as_str()) {
            ("cpu", kind) => {
                assert_eq!(kind, GptqDeviceReport::CPU);
                assert_eq!(report.reason, "GPTQ_DEVICE=cpu");
                assert!(!report.on_cpu_unasked());
            }
            // This machine may have a GPU runtime: then `auto` says which one was usable.
            (_, "cpu") => {
                assert!(
                    report.reason.starts_with("auto: no usable GPU (hip: "),
                    "{}",
                    report.reason
                );
                assert!(report.on_cpu_unasked());
            }
            _ => assert!(report.reason.starts_with("auto: "), "{}", report.reason),
        }
        if report.kind == GptqDeviceReport::CPU {
            assert_eq!(report.device, "cpu-faer");
        }
        // The setting, and nothing else of the device, among the applied settings.
        assert_eq!(
            t.applied.get("gptqDevice").map(String::as_str),
            Some(requested)
        );
        let device_keys: Vec<&String> = t
            .applied
            .keys()
            .filter(|k| k.starts_with("gptqDevice") && *k != "gptqDevice")
            .collect();
        assert!(device_keys.is_empty(), "{device_keys:?}");
        assert!(
            r.termination.len() <= flexinfer_contract::files::TERMINATION_MESSAGE_MAX_BYTES,
            "{}",
            r.termination.len()
        );
    }
}
