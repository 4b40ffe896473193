//! Per-shard save resume: shards already in the staging directory with the right size and sha256 are kept
//! (same inode), a damaged one is rewritten, and `.save-complete` verifies afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_quant::writer::{verify_save_complete, write_checkpoint, Extras, OutTensor};
use safetensors::Dtype;
use serde_json::json;
use std::borrow::Cow;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

fn tensors() -> Vec<OutTensor<'static>> {
    (0..6)
        .map(|i| OutTensor {
            name: format!("model.layers.{i}.mlp.down_proj.qweight"),
            dtype: Dtype::I32,
            shape: vec![16, 64],
            data: Cow::Owned((0..16 * 64 * 4).map(|b| (b * (i + 3)) as u8).collect()),
        })
        .chain(std::iter::once(OutTensor {
            name: "model.norm.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![3],
            data: Cow::Owned(vec![1, 2, 3, 4, 5, 6]),
        }))
        .collect()
}

fn save(staging: &Path, out: &Path, src: &Path) -> Vec<String> {
    let extras = Extras {
        config_json: json!({"architectures": ["LlamaForCausalLM"]}),
        quantize_config: Some(json!({"bits": 4})),
        quality: json!({"gate": "passed"}),
        source_dir: src,
        script_version: "test",
        config_digest: "d",
    };
    write_checkpoint(staging, out, tensors(), 9000, &extras, &|| {}, |_, _| {})
        .expect("save")
        .into_iter()
        .map(|r| r.name)
        .collect()
}

#[test]
fn matching_shards_are_not_rewritten() {
    let tmp = tempfile::tempdir().expect("tmp");
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).expect("mkdir");
    std::fs::write(src.join("tokenizer.json"), "{}").expect("write");
    let first = tmp.path().join("first");
    let names = save(&tmp.path().join(".first.partial"), &first, &src);
    assert!(names.len() >= 3, "expected several shards, got {names:?}");
    assert!(verify_save_complete(&first, true).is_some());
    assert!(first.join("tokenizer.json").exists());

    // A crashed save left all shards in staging, one of them damaged.
    let staging = tmp.path().join(".second.partial");
    std::fs::create_dir_all(&staging).expect("mkdir");
    for n in &names {
        std::fs::copy(first.join(n), staging.join(n)).expect("copy");
    }
    std::fs::write(staging.join(&names[1]), b"garbage").expect("damage");
    let inodes: Vec<u64> = names
        .iter()
        .map(|n| std::fs::metadata(staging.join(n)).expect("meta").ino())
        .collect();
    let second = tmp.path().join("second");
    assert_eq!(save(&staging, &second, &src), names);
    for (i, n) in names.iter().enumerate() {
        let ino = std::fs::metadata(second.join(n)).expect("meta").ino();
        if i == 1 {
            assert_ne!(ino, inodes[i], "damaged shard must be rewritten");
        } else {
            assert_eq!(ino, inodes[i], "{n} was rewritten although it matched");
        }
        assert_eq!(
            std::fs::read(second.join(n)).expect("read"),
            std::fs::read(first.join(n)).expect("read")
        );
    }
    assert!(verify_save_complete(&second, true).is_some());
    assert!(!staging.exists(), "staging renamed into place");
    // A size mismatch makes verification fail.
    std::fs::write(second.join(&names[0]), b"x").expect("truncate");
    assert!(verify_save_complete(&second, false).is_none());
}
