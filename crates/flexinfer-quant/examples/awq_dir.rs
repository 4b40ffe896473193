//! Writes the AWQ artifact of a model directory (not a test): the driver of the AWQ rows of
//! scripts/bench/quant/awq.sh. Prints one JSON line: seconds, sizes, the quality sidecar.
//!
//! Usage: `awq_dir MODEL_DIR OUT_DIR DATASET [GROUP_SIZE] [MAX_SAMPLES] [MAX_SEQ_LEN]` (defaults: 128, 128, 256).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a tool: a panic is the failure report

use flexinfer_quant::awq::{write_awq_artifact, AwqJob};
use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::events::NullSink;
use std::path::PathBuf;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        eprintln!(
            "usage: awq_dir MODEL_DIR OUT_DIR DATASET [GROUP_SIZE] [MAX_SAMPLES] [MAX_SEQ_LEN]"
        );
        std::process::exit(2);
    }
    let (model, out, dataset) = (
        PathBuf::from(&args[0]),
        PathBuf::from(&args[1]),
        PathBuf::from(&args[2]),
    );
    let num = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let o = write_awq_artifact(
        &AwqJob {
            model_dir: &model,
            out_dir: &out,
            dataset: &dataset,
            calib: CalibSettings {
                max_samples: num(4, 128),
                max_seq_len: num(5, 256),
            },
            bits: 4,
            group_size: num(3, 128) as i32,
            script_version: "awq_dir",
            verify_save_sha256: false,
            max_shard_bytes: 2 << 30,
            max_output_error_ratio: flexinfer_quant::awq::gate::DEFAULT_MAX_OUTPUT_ERROR_RATIO,
        },
        &NullSink,
    )
    .unwrap_or_else(|e| {
        eprintln!("awq_dir: {e}");
        std::process::exit(1)
    });
    println!(
        "{}",
        serde_json::json!({
            "seconds": o.seconds, "cached": o.cached,
            "originalBytes": o.original_size_bytes, "compressedBytes": o.compressed_size_bytes,
            "quality": o.quality,
        })
    );
}
