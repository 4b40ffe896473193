//! Quantizes a model directory to a `gptq` checkpoint with the engine's CPU backend (not a test): the driver of
//! `make oracle-check`, which loads the result with transformers (scripts/oracle/make_fixtures.py
//! `--check-quantized`).
//!
//! Usage: `quantize_dir MODEL_DIR OUT_DIR [GROUP_SIZE] [BITS] [EXCLUSION]` (defaults: 32, 4, none). The
//! calibration text is the test kit's generated sentences (24 samples of at most 48 tokens); a model directory
//! without `tokenizer.json` (the oracle fixtures) is copied to a temporary directory with the test kit's
//! letters-only tokenizer, whose ids are below every fixture's vocabulary. The quality gate accepts any RTN
//! fallback (tiny models: many experts see few calibration tokens). EXCLUSION is `dynamicExclusion` (`gdn`,
//! `auto`, a module list).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a tool: a panic is the failure report

use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::events::MemorySink;
use flexinfer_quant::job::{run, QuantizeJob};
use flexinfer_quant::linalg::CpuBackend;
use flexinfer_quant::params::{GateParams, GptqParams};
use std::path::{Path, PathBuf};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        eprintln!("usage: quantize_dir MODEL_DIR OUT_DIR [GROUP_SIZE] [BITS] [EXCLUSION]");
        std::process::exit(2);
    }
    let (model, out) = (PathBuf::from(&args[0]), PathBuf::from(&args[1]));
    let group_size: i32 = args.get(2).map_or(32, |s| s.parse().expect("GROUP_SIZE"));
    let bits: u32 = args.get(3).map_or(4, |s| s.parse().expect("BITS"));
    let exclusion = args.get(4).cloned();

    let tmp = tempfile::tempdir().unwrap();
    let model_dir = if model.join("tokenizer.json").exists() {
        model
    } else {
        let copy = tmp.path().join("model");
        std::fs::create_dir_all(&copy).unwrap();
        for e in std::fs::read_dir(&model).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
            }
        }
        flexinfer_quant::testkit::write_char_tokenizer(&copy).unwrap();
        copy
    };
    let ds = tmp.path().join("calib.jsonl");
    flexinfer_quant::testkit::write_dataset(&ds, 24).unwrap();
    if out.exists() {
        std::fs::remove_dir_all(&out).unwrap();
    }
    let job = QuantizeJob {
        params: GptqParams {
            group_size,
            bits,
            ..Default::default()
        },
        gate: GateParams {
            max_rtn_fallback_percent: 100.0,
            min_modules: 1,
        },
        dynamic_exclusion: exclusion,
        resume_layers: false,
        ..QuantizeJob::new(
            &model_dir,
            &out,
            &ds,
            CalibSettings {
                max_samples: 24,
                max_seq_len: 48,
            },
            "quantize_dir",
        )
    };
    let o = run(&job, &CpuBackend::default(), &MemorySink::default())
        .unwrap_or_else(|e| panic!("{}: {e}", model_dir.display()));
    let q = o.quality.expect("quality summary");
    println!(
        "{}: w{bits} g{group_size}, {} GPTQ + {} RTN modules, {:.1}s",
        display(&o.output_dir),
        q.gptq_modules,
        q.rtn_fallback_modules,
        o.seconds
    );
}

fn display(p: &Path) -> String {
    p.display().to_string()
}
