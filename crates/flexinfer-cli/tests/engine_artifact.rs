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

/// The engine's AWQ artifact through the binary: detected as `awq` without `--layout` and exit 0; a
/// corrupted scale is exit 1 with a defect naming the tensor; a `--path` that is not a directory is exit 2.
#[test]
fn engine_awq_output_passes_and_a_bad_scale_is_named() {
    use flexinfer_quant::awq::{gate, write_awq_artifact, AwqJob};
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    testkit::write_model(&model, "LlamaForCausalLM", 7).unwrap();
    let ds = tmp.path().join("calib.jsonl");
    testkit::write_dataset(&ds, 8).unwrap();
    let dir = tmp.path().join("awq");
    write_awq_artifact(
        &AwqJob {
            model_dir: &model,
            out_dir: &dir,
            dataset: &ds,
            calib: CalibSettings {
                max_samples: 8,
                max_seq_len: 32,
            },
            bits: 4,
            group_size: 64,
            script_version: "test",
            verify_save_sha256: true,
            max_shard_bytes: 200_000,
            max_output_error_ratio: gate::DEFAULT_MAX_OUTPUT_ERROR_RATIO,
        },
        &NullSink,
    )
    .expect("engine writes the AWQ artifact");
    let run = |args: &[&str], path: &Path| {
        Command::new(BIN)
            .args(["quantize", "validate-artifact"])
            .args(args)
            .arg("--path")
            .arg(path)
            .output()
            .unwrap()
    };
    let o = run(&["--json"], &dir);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(o.status.code(), Some(0), "{v}");
    assert_eq!(v["layout"], "awq");
    assert_eq!(v["quantizedLinears"], testkit::LAYERS * 7);

    // One scale of one linear set to -1 in place: the shard's sha256 changes too (both are defects).
    let m = "model.layers.2.mlp.down_proj.scales";
    let mut hit = false;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let mut b = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
        if let Some(t) = h.get(m) {
            let start = 8 + n + t["data_offsets"][0].as_u64().unwrap() as usize;
            b[start..start + 2].copy_from_slice(&half::f16::from_f32(-1.0).to_le_bytes());
            std::fs::write(&p, b).unwrap();
            hit = true;
        }
    }
    assert!(hit, "{m} not found");
    let o = run(&[], &dir);
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "DEFECT [linear] {m}[0] is not a finite positive scale"
        )),
        "{text}"
    );
    let o = run(&["--layout", "awq"], &ds);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a directory"));
}
