//! Writes the repositories of the local Hugging Face-compatible hub that `make demo` and the end-to-end test
//! serve (`flexinfer-hub --root ROOT`, crates/flexinfer-hub): generated models and datasets, no downloads.
//!
//! usage: hub_fixtures ROOT
//!
//! - `ROOT/models/flexinfer-demo/tiny-llama`: an 8-layer Llama-architecture model (hidden 32, BF16, two shards)
//!   whose layer 3 writes a planted "refusal" direction for upper-case prompts, so abliteration finds a real
//!   direction; a word-level tokenizer (letters, digits, `.`, `?`).
//! - `ROOT/models/flexinfer-demo/small-llama`: a larger Llama model (hidden 256, 12 layers) whose GPTQ run
//!   lasts long enough on one core to be interrupted mid-way.
//! - `ROOT/models/flexinfer-demo/tiny-llama-bpe`: a Llama model llama.cpp can load (hidden 256, 4 layers, a
//!   byte-level BPE tokenizer llama.cpp calls `gpt-2`, with a chat template), for the GGUF path served by
//!   the real llama-server (the word-level tokenizer of `tiny-llama` has no llama.cpp equivalent).
//! - `ROOT/datasets/flexinfer-demo/{calibration,refusal,harmless}`: calibration text and the two prompt sets.

use std::path::{Path, PathBuf};

#[path = "../tests/abliterate_support/tiny.rs"]
mod support;

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        std::fs::copy(e.path(), to.join(e.file_name()))?;
    }
    Ok(())
}

fn write(path: &Path, body: &str) -> std::io::Result<()> {
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p)?;
    }
    std::fs::write(path, body)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::args().nth(1).ok_or("usage: hub_fixtures ROOT")?);
    let tiny = support::build(&support::TinyOpts {
        dtype: "BF16",
        shards: 2,
        ..Default::default()
    });
    copy_dir(&tiny.dir, &root.join("models/flexinfer-demo/tiny-llama"))?;
    let ds = root.join("datasets/flexinfer-demo");
    std::fs::create_dir_all(ds.join("refusal"))?;
    std::fs::create_dir_all(ds.join("harmless"))?;
    std::fs::copy(&tiny.refusal, ds.join("refusal/refusal.jsonl"))?;
    std::fs::copy(&tiny.harmless, ds.join("harmless/harmless.txt"))?;
    // Calibration text in both models' vocabularies (lower-case words).
    let calib: Vec<String> = flexinfer_quant::testkit::sentences(11, 256)
        .into_iter()
        .map(|s| serde_json::json!({ "text": s }).to_string())
        .collect();
    write(
        &ds.join("calibration/train.jsonl"),
        &(calib.join("\n") + "\n"),
    )?;
    write(
        &ds.join("calibration/README.md"),
        "Generated calibration text for the FlexInfer demo.\n",
    )?;
    let small = flexinfer_quant::testkit::ModelSize {
        hidden: 256,
        inter: 768,
        layers: 12,
        heads: 8,
        kv_heads: 4,
        vocab: 256,
    };
    flexinfer_quant::testkit::write_model_sized(
        &root.join("models/flexinfer-demo/small-llama"),
        "LlamaForCausalLM",
        5,
        &small,
    )?;
    let bpe = root.join("models/flexinfer-demo/tiny-llama-bpe");
    flexinfer_quant::testkit::write_model_sized(
        &bpe,
        "LlamaForCausalLM",
        7,
        &flexinfer_quant::testkit::ModelSize::GGUF_WIDE,
    )?;
    flexinfer_quant::testkit::write_byte_level_tokenizer(&bpe)?;
    println!("{}", root.display());
    Ok(())
}
