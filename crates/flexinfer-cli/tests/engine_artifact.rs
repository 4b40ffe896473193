//! `validate-artifact` on a real artifact: the engine (`flexinfer-quant`) quantizes its tiny
//! Llama test model end to end, and the CLI must find no defect in what it wrote — and must find
//! the defect after one shard is corrupted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::path::Path;
use std::process::Command;

use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::events::NullSink;
use flexinfer_quant::job::{run, QuantizeJob};
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::params::GptqParams;
use flexinfer_quant::testkit;

const BIN: &str = env!("CARGO_BIN_EXE_flexinfer");

fn job(model: &Path, out: &Path, dataset: &Path, params: GptqParams) -> QuantizeJob {
    QuantizeJob {
        params,
        resume_layers: false,
        max_shard_bytes: 200_000,
        ..QuantizeJob::new(
            model,
            out,
            dataset,
            CalibSettings {
                max_samples: 8,
                max_seq_len: 32,
            },
            "test",
        )
    }
}

#[test]
fn engine_output_passes_and_corruption_is_found() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    testkit::write_model(&model, "LlamaForCausalLM", 7).unwrap();
    let ds = tmp.path().join("calib.jsonl");
    testkit::write_dataset(&ds, 16).unwrap();
    for (bits, gs, desc_act) in [(4u32, 32i32, false), (8, 128, true)] {
        let out = tmp.path().join(format!("out{bits}"));
        let params = GptqParams {
            bits,
            group_size: gs,
            desc_act,
            sym: true,
            ..Default::default()
        };
        let outcome = run(
            &job(&model, &out, &ds, params),
            &CpuBackend::default(),
            &NullSink,
        )
        .expect("engine quantizes the test model");
        let dir = outcome.output_dir;
        let o = Command::new(BIN)
            .args([
                "quantize",
                "validate-artifact",
                "--layout",
                "vllm-gptq",
                "--family",
                "llama",
                "--path",
            ])
            .arg(&dir)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert_eq!(
            o.status.code(),
            Some(0),
            "w{bits} g{gs}: {text}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(text.starts_with("OK: "), "{text}");

        // flip one byte of the last shard: sha256 no longer matches .save-complete
        let mut shards: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        shards.sort();
        let last = shards.last().unwrap();
        let mut b = std::fs::read(last).unwrap();
        let n = b.len();
        b[n - 1] ^= 0x01;
        std::fs::write(last, b).unwrap();
        let o = Command::new(BIN)
            .args(["quantize", "validate-artifact", "--json", "--path"])
            .arg(&dir)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["ok"], false);
        assert!(
            v["defects"]
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d["check"] == "save-complete"
                    && d["message"].as_str().unwrap_or("").contains("sha256")),
            "{v}"
        );
    }
}
