//! Bad input: each case gives an error that names the problem, classified as bad input (exit 2),
//! no output directory left behind, and the source untouched.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod common;

use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::events::NullSink;
use flexinfer_quant::fsutil::sha256_file;
use flexinfer_quant::job::{run, QuantizeJob};
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::params::GptqParams;
use std::path::Path;

fn job(model: &Path, out: &Path, ds: &Path) -> QuantizeJob {
    QuantizeJob {
        params: GptqParams {
            group_size: 32,
            ..Default::default()
        },
        max_shard_bytes: 1 << 30,
        ..QuantizeJob::new(
            model,
            out,
            ds,
            CalibSettings {
                max_samples: 4,
                max_seq_len: 32,
            },
            "test",
        )
    }
}

fn snapshot(dir: &Path) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::fs::read_dir(dir)
        .expect("read_dir")
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().to_string(),
                sha256_file(&e.path()).expect("sha"),
            )
        })
        .collect();
    v.sort();
    v
}

type Mutate = fn(&Path, &mut QuantizeJob);

#[test]
fn bad_inputs_are_named_and_leave_nothing_behind() {
    let cases: Vec<(&str, Mutate, &str)> = vec![
        (
            "missing config",
            |m, _| std::fs::remove_file(m.join("config.json")).expect("rm"),
            "config.json not found",
        ),
        (
            "unsupported arch",
            |m, _| {
                let p = m.join("config.json");
                let s = std::fs::read_to_string(&p)
                    .expect("read")
                    .replace("LlamaForCausalLM", "GPT2LMHeadModel");
                std::fs::write(p, s).expect("write");
            },
            "unsupported architecture \"GPT2LMHeadModel\"",
        ),
        (
            "truncated safetensors",
            |m, _| {
                let p = m.join("model-00002-of-00002.safetensors");
                let b = std::fs::read(&p).expect("read");
                std::fs::write(&p, &b[..b.len() - 100]).expect("write");
            },
            "model-00002-of-00002.safetensors",
        ),
        (
            "nan weights",
            |m, _| {
                // Overwrite the first bf16 element of the first shard's data with a NaN (0x7fc0).
                let p = m.join("model-00001-of-00002.safetensors");
                let mut b = std::fs::read(&p).expect("read");
                let n = u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize;
                let header: serde_json::Value =
                    serde_json::from_slice(&b[8..8 + n]).expect("header");
                let (name, off) = header
                    .as_object()
                    .expect("obj")
                    .iter()
                    .filter(|(k, _)| k.contains("layers.0.mlp.down_proj"))
                    .map(|(k, v)| {
                        (
                            k.clone(),
                            v["data_offsets"][0].as_u64().expect("offset") as usize,
                        )
                    })
                    .next()
                    .expect("down_proj in shard 1");
                assert!(name.ends_with(".weight"));
                b[8 + n + off] = 0xc0;
                b[8 + n + off + 1] = 0x7f;
                std::fs::write(&p, b).expect("write");
            },
            "non-finite",
        ),
        (
            "bits 5",
            |_, j| j.params.bits = 5,
            "bits must be one of 2, 3, 4, 8 (got 5)",
        ),
        (
            "group size",
            |_, j| j.params.group_size = 96,
            "group size 96 does not divide the input dimension 128",
        ),
        (
            "empty dataset",
            |_, j| std::fs::write(&j.dataset, "").expect("write"),
            "no usable samples",
        ),
        (
            "missing dataset",
            |_, j| j.dataset = j.dataset.with_file_name("nope.jsonl"),
            "nope.jsonl",
        ),
        (
            "corrupt parquet",
            |_, j| {
                j.dataset = j.dataset.with_file_name("d.parquet");
                std::fs::write(&j.dataset, b"PAR1").expect("write");
            },
            "not a readable parquet file",
        ),
    ];
    for (label, mutate, needle) in cases {
        let tmp = tempfile::tempdir().expect("tmp");
        let model = tmp.path().join("model");
        common::write_model(&model, "LlamaForCausalLM", 1);
        let ds = tmp.path().join("calib.jsonl");
        common::write_dataset(&ds, 8);
        let out = tmp.path().join("out");
        let mut j = job(&model, &out, &ds);
        mutate(&model, &mut j);
        let before = snapshot(&model);
        let err = run(&j, &CpuBackend::default(), &NullSink)
            .err()
            .unwrap_or_else(|| panic!("{label}: must fail"));
        let msg = flexinfer_contract::error::chain(&err);
        assert!(
            err.is_bad_input(),
            "{label}: not classified as bad input: {msg}"
        );
        assert!(
            msg.contains(needle),
            "{label}: message {msg:?} does not name the problem ({needle:?})"
        );
        assert!(!out.exists(), "{label}: OUT_DIR was created");
        assert_eq!(snapshot(&model), before, "{label}: source files changed");
    }
}
