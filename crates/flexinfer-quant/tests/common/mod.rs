//! Test fixtures: the crate's testkit model plus a BPE tokenizer trained here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report
#![allow(dead_code)]

use serde_json::json;
use std::path::Path;
use tokenizers::Trainer;

#[allow(unused_imports)]
pub use flexinfer_quant::testkit::{HIDDEN, INTER, LAYERS};

/// Trains a small BPE on the fixture sentences and writes it as `tokenizer.json`. Returns the vocabulary size.
pub fn write_trained_tokenizer(dir: &Path) -> usize {
    let texts = flexinfer_quant::testkit::sentences(1, 200);
    let mut trainer = tokenizers::trainers::BpeTrainer::builder()
        .vocab_size(200)
        .show_progress(false)
        .build();
    trainer
        .feed(texts.iter(), |s| {
            Ok(s.split_whitespace().map(str::to_string).collect())
        })
        .expect("feed");
    let (vocab, merges, _) = trainer.train_vocab().expect("train");
    let vocab_map: serde_json::Map<String, serde_json::Value> =
        vocab.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
    let merges: Vec<[String; 2]> = merges.into_iter().map(|(a, b)| [a, b]).collect();
    let doc = json!({
        "version": "2.0", "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null, "padding": null,
        "model": {"type": "BPE", "byte_level": false, "vocab": vocab_map, "merges": merges},
    });
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec_pretty(&doc).expect("json"),
    )
    .expect("write");
    vocab.len()
}

pub fn write_model(dir: &Path, arch: &str, seed: u64) {
    flexinfer_quant::testkit::write_model(dir, arch, seed).expect("fixture model");
    let n = write_trained_tokenizer(dir);
    assert!(
        n <= flexinfer_quant::testkit::VOCAB,
        "trained vocab {n} exceeds the embedding"
    );
}

pub fn write_dataset(path: &Path, n: usize) {
    flexinfer_quant::testkit::write_dataset(path, n).expect("dataset");
}

/// Every file of an artifact directory with its bytes, sorted by name, without `.save-complete` (which
/// carries a timestamp): two artifacts compare equal exactly when they are byte-identical.
pub fn artifact_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .expect("read_dir")
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().to_string(), e.path()))
        .filter(|(n, _)| n != ".save-complete")
        .map(|(n, p)| (n, std::fs::read(p).expect("read")))
        .collect();
    v.sort();
    v
}
