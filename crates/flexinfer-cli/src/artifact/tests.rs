//! validate-artifact: a small good GPTQ artifact built here following docs/dev/gptq.md, "The checkpoint", and one
//! defect of each kind.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::*;
use flexinfer_api::contract::files;

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV: usize = 2;
const HEAD_DIM: usize = 16;
const INTER: usize = 128;
const GROUP: usize = 32;

/// Everything an artifact is made of, editable before writing.
struct Spec {
    config: Value,
    quantize_config: Option<Value>,
    /// name -> (dtype, shape, bytes)
    tensors: BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    /// shard assignment by tensor name: layer 0 → shard 1, the rest → shard 2
    quality: Option<Value>,
    write_index: bool,
    write_save_complete: bool,
}

fn i32_bytes(v: impl IntoIterator<Item = i32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f16_bytes(v: f32, n: usize) -> Vec<u8> {
    let h = half::f16::from_f32(v).to_le_bytes();
    (0..n).flat_map(|_| h).collect()
}

fn qconfig() -> Value {
    json!({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": true, "desc_act": false,
           "lm_head": false, "checkpoint_format": "gptq", "damp_percent": 0.01,
           "true_sequential": true, "static_groups": false})
}

fn good() -> Spec {
    let mut config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "head_dim": HEAD_DIM, "intermediate_size": INTER, "num_hidden_layers": 2, "vocab_size": 32,
        "torch_dtype": "bfloat16"
    });
    config["quantization_config"] = qconfig();
    let mut tensors = BTreeMap::new();
    let bf16 = |n: usize| vec![0u8; n * 2];
    tensors.insert(
        "model.embed_tokens.weight".to_string(),
        (
            safetensors::Dtype::BF16,
            vec![32, HIDDEN],
            bf16(32 * HIDDEN),
        ),
    );
    tensors.insert(
        "model.norm.weight".to_string(),
        (safetensors::Dtype::BF16, vec![HIDDEN], bf16(HIDDEN)),
    );
    tensors.insert(
        "lm_head.weight".to_string(),
        (
            safetensors::Dtype::BF16,
            vec![32, HIDDEN],
            bf16(32 * HIDDEN),
        ),
    );
    let mods = [
        ("self_attn.q_proj", HIDDEN, HEADS * HEAD_DIM),
        ("self_attn.k_proj", HIDDEN, KV * HEAD_DIM),
        ("self_attn.v_proj", HIDDEN, KV * HEAD_DIM),
        ("self_attn.o_proj", HEADS * HEAD_DIM, HIDDEN),
        ("mlp.gate_proj", HIDDEN, INTER),
        ("mlp.up_proj", HIDDEN, INTER),
        ("mlp.down_proj", INTER, HIDDEN),
    ];
    for layer in 0..2 {
        for (m, inp, out) in mods {
            let p = format!("model.layers.{layer}.{m}");
            let g = inp / GROUP;
            // codes: arbitrary packed words
            let qw: Vec<i32> = (0..inp / 8 * out)
                .map(|i| (i as i32).wrapping_mul(0x0101_0101))
                .collect();
            tensors.insert(
                format!("{p}.qweight"),
                (safetensors::Dtype::I32, vec![inp / 8, out], i32_bytes(qw)),
            );
            tensors.insert(
                format!("{p}.qzeros"),
                (
                    safetensors::Dtype::I32,
                    vec![g, out / 8],
                    i32_bytes(vec![0x7777_7777; g * out / 8]),
                ),
            );
            tensors.insert(
                format!("{p}.scales"),
                (
                    safetensors::Dtype::F16,
                    vec![g, out],
                    f16_bytes(0.01, g * out),
                ),
            );
            tensors.insert(
                format!("{p}.g_idx"),
                (
                    safetensors::Dtype::I32,
                    vec![inp],
                    i32_bytes((0..inp).map(|i| (i / GROUP) as i32)),
                ),
            );
        }
        tensors.insert(
            format!("model.layers.{layer}.input_layernorm.weight"),
            (safetensors::Dtype::BF16, vec![HIDDEN], bf16(HIDDEN)),
        );
    }
    Spec {
        config,
        quantize_config: Some(qconfig()),
        tensors,
        quality: Some(
            json!({"gptqModules": 14, "rtnFallbackModules": 0, "rtnFallbackPercent": 0.0,
                             "maxRtnFallbackPercent": 5.0, "minimumModules": 10, "gate": "passed"}),
        ),
        write_index: true,
        write_save_complete: true,
    }
}

fn shard_of(name: &str) -> &'static str {
    if name.starts_with("model.layers.0.") {
        "model-00001-of-00002.safetensors"
    } else {
        "model-00002-of-00002.safetensors"
    }
}

fn write(dir: &Path, s: &Spec) {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&s.config).unwrap(),
    )
    .unwrap();
    if let Some(q) = &s.quantize_config {
        std::fs::write(
            dir.join("quantize_config.json"),
            serde_json::to_vec(q).unwrap(),
        )
        .unwrap();
    }
    let mut by_shard: BTreeMap<&str, Vec<(String, safetensors::tensor::TensorView<'_>)>> =
        BTreeMap::new();
    let mut weight_map = serde_json::Map::new();
    for (name, (dt, shape, data)) in &s.tensors {
        let v = safetensors::tensor::TensorView::new(*dt, shape.clone(), data).unwrap();
        by_shard
            .entry(shard_of(name))
            .or_default()
            .push((name.clone(), v));
        weight_map.insert(name.clone(), json!(shard_of(name)));
    }
    let mut shards = Vec::new();
    for (shard, views) in by_shard {
        let bytes = safetensors::serialize(views, None).unwrap();
        std::fs::write(dir.join(shard), &bytes).unwrap();
        shards.push(json!({"name": shard, "size_bytes": bytes.len(), "sha256": hex::encode(Sha256::digest(&bytes))}));
    }
    if s.write_index {
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_vec(&json!({"metadata": {"total_size": 0}, "weight_map": weight_map}))
                .unwrap(),
        )
        .unwrap();
    }
    if s.write_save_complete {
        std::fs::write(
            dir.join(files::SAVE_COMPLETE),
            serde_json::to_vec(&json!({"version": 1, "script_version": "v14", "completed_at": "2026-01-01T00:00:00Z",
                "shards": shards, "has_index": s.write_index, "has_config": true,
                "has_quantize_config": s.quantize_config.is_some()}))
            .unwrap(),
        )
        .unwrap();
    }
    if let Some(q) = &s.quality {
        std::fs::write(
            dir.join(files::QUANTIZATION_QUALITY),
            serde_json::to_vec(q).unwrap(),
        )
        .unwrap();
    }
}

fn run(s: &Spec, after: impl FnOnce(&Path)) -> Report {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), s);
    after(dir.path());
    validate(
        dir.path(),
        Some("vllm-gptq"),
        &Options {
            family: Some("llama".into()),
            skip_sha256: false,
            ..Default::default()
        },
    )
    .unwrap()
}

/// A defect of `check` whose message contains `needle` (the layouts' own tests use it too).
pub(super) fn expect_defect(r: &Report, check: &str, needle: &str) {
    assert!(!r.ok, "expected a defect [{check}] {needle}; got OK");
    assert!(
        r.defects
            .iter()
            .any(|d| d.check == check && d.message.contains(needle)),
        "expected [{check}] containing {needle:?}, got:\n{}",
        r.render()
    );
}

/// `dir` validated without reading its files' sha256 (for tests that edit a file in place).
pub(super) fn check_without_sha256(dir: &Path) -> Report {
    let opts = Options {
        skip_sha256: true,
        ..Default::default()
    };
    validate(dir, None, &opts).unwrap()
}

/// `dir`'s config.json edited by `f`.
pub(super) fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

/// Overwrites element `i` (of `bytes.len()` bytes) of tensor `name` in place (same size; sha256 not checked).
pub(super) fn poke(dir: &Path, name: &str, i: u64, bytes: &[u8]) {
    use std::io::{Seek, SeekFrom, Write};
    for e in std::fs::read_dir(dir).unwrap() {
        let f = e.unwrap().file_name().into_string().unwrap();
        if !f.ends_with(".safetensors") {
            continue;
        }
        if let Some((_, t)) = read_header(dir, &f)
            .unwrap()
            .into_iter()
            .find(|(n, _)| n == name)
        {
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join(&f))
                .unwrap();
            file.seek(SeekFrom::Start(t.start + i * bytes.len() as u64))
                .unwrap();
            file.write_all(bytes).unwrap();
            return;
        }
    }
    panic!("{name} not found");
}

#[test]
fn good_artifact_passes() {
    let r = run(&good(), |_| {});
    assert!(r.ok, "{}", r.render());
    assert!(r.warnings.is_empty(), "{}", r.render());
    assert_eq!(r.shards, 2);
    assert_eq!(r.quantized_linears, 14);
    assert_eq!(r.tensors, 14 * 4 + 5);
}

#[test]
fn layout_and_path_are_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    assert!(validate(dir.path(), Some("exl2"), &Options::default())
        .map_err(|e| flexinfer_api::contract::error::chain(&e))
        .unwrap_err()
        .contains("--layout exl2"));
    assert!(validate(
        &dir.path().join("nope"),
        Some("vllm-gptq"),
        &Options::default()
    )
    .map_err(|e| flexinfer_api::contract::error::chain(&e))
    .unwrap_err()
    .contains("--path"));
}

#[test]
fn config_defects() {
    let mut s = good();
    s.config
        .as_object_mut()
        .unwrap()
        .remove("quantization_config");
    expect_defect(&run(&s, |_| {}), "config", "no quantization_config");

    for field in ["bits", "group_size", "sym", "desc_act"] {
        let mut s = good();
        s.config["quantization_config"]
            .as_object_mut()
            .unwrap()
            .remove(field);
        s.quantize_config
            .as_mut()
            .unwrap()
            .as_object_mut()
            .unwrap()
            .remove(field);
        expect_defect(
            &run(&s, |_| {}),
            "config",
            &format!("{field} is missing (vLLM Marlin needs"),
        );
    }

    let mut s = good();
    s.config["quantization_config"]["quant_method"] = json!("awq");
    expect_defect(&run(&s, |_| {}), "config", "quant_method is \"awq\"");

    let mut s = good();
    s.quantize_config.as_mut().unwrap()["desc_act"] = json!(true);
    expect_defect(&run(&s, |_| {}), "config", "desc_act differs");

    let mut s = good();
    s.config["quantization_config"]["group_size"] = json!(100);
    expect_defect(
        &run(&s, |_| {}),
        "config",
        "group_size 100 is not -1 or a power of two",
    );

    // quantize_config.json missing though .save-complete says it was written
    let r = run(&good(), |d| {
        std::fs::remove_file(d.join("quantize_config.json")).unwrap()
    });
    expect_defect(&r, "config", "quantize_config.json is missing");
}

#[test]
fn family_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &good());
    let r = validate(
        dir.path(),
        Some("vllm-gptq"),
        &Options {
            family: Some("qwen35".into()),
            skip_sha256: true,
            ..Default::default()
        },
    )
    .unwrap();
    expect_defect(&r, "family", "does not match --family qwen35");
    let r = validate(
        dir.path(),
        Some("vllm-gptq"),
        &Options {
            family: Some("llama-3-8b".into()),
            skip_sha256: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.ok, "{}", r.render());
}

#[test]
fn tensor_defects() {
    let p = "model.layers.1.mlp.down_proj";

    let mut s = good();
    s.tensors.remove(&format!("{p}.g_idx"));
    expect_defect(
        &run(&s, |_| {}),
        "tensors",
        &format!("{p}.g_idx is missing"),
    );

    let mut s = good();
    let t = s.tensors.get_mut(&format!("{p}.scales")).unwrap();
    t.0 = safetensors::Dtype::BF16;
    expect_defect(
        &run(&s, |_| {}),
        "dtypes",
        &format!("{p}.scales is BF16, expected F16"),
    );

    let mut s = good();
    let t = s.tensors.get_mut(&format!("{p}.scales")).unwrap();
    t.1 = vec![INTER / GROUP - 1, HIDDEN];
    t.2.truncate((INTER / GROUP - 1) * HIDDEN * 2);
    expect_defect(
        &run(&s, |_| {}),
        "shapes",
        &format!("{p}.scales has shape [3, 64], expected [4, 64]"),
    );

    let mut s = good();
    let t = s.tensors.get_mut(&format!("{p}.qzeros")).unwrap();
    t.1 = vec![INTER / GROUP, HIDDEN / 4];
    t.2 = i32_bytes(vec![0x7777_7777; INTER / GROUP * HIDDEN / 4]);
    expect_defect(
        &run(&s, |_| {}),
        "shapes",
        &format!("{p}.qzeros has shape [4, 16], expected [4, 8]"),
    );

    // config implies a different intermediate size than the tensors
    let mut s = good();
    s.config["intermediate_size"] = json!(256);
    expect_defect(
        &run(&s, |_| {}),
        "shapes",
        "but config.json implies [256 in, 64 out]",
    );

    let mut s = good();
    let t = s.tensors.get_mut(&format!("{p}.g_idx")).unwrap();
    t.2 = i32_bytes((0..INTER).map(|i| if i == 5 { 4 } else { (i / GROUP) as i32 }));
    expect_defect(
        &run(&s, |_| {}),
        "g_idx",
        &format!("{p}.g_idx[5] = 4 is outside [0, 4)"),
    );

    let mut s = good();
    let t = s.tensors.get_mut(&format!("{p}.g_idx")).unwrap();
    t.2 = i32_bytes((0..INTER).map(|i| ((INTER - 1 - i) / GROUP) as i32));
    expect_defect(
        &run(&s, |_| {}),
        "g_idx",
        "not i / group_size but desc_act is false",
    );
    // with desc_act true the same permutation is fine
    s.config["quantization_config"]["desc_act"] = json!(true);
    s.quantize_config.as_mut().unwrap()["desc_act"] = json!(true);
    let r = run(&s, |_| {});
    assert!(r.ok, "{}", r.render());

    let mut s = good();
    let t = s.tensors.get_mut(&format!("{p}.qzeros")).unwrap();
    t.2 = i32_bytes((0..INTER / GROUP * HIDDEN / 8).map(|i| {
        if i == 3 {
            0x8888_8888u32 as i32
        } else {
            0x7777_7777
        }
    }));
    expect_defect(
        &run(&s, |_| {}),
        "qzeros",
        &format!("{p}.qzeros word 3 is 0x88888888, expected 0x77777777"),
    );

    let mut s = good();
    let t = s.tensors.get_mut(&format!("{p}.scales")).unwrap();
    t.2 = f16_bytes(f32::NAN, INTER / GROUP * HIDDEN);
    expect_defect(&run(&s, |_| {}), "scales", &format!("{p}.scales element 0"));

    let mut s = good();
    s.tensors.retain(|n, _| {
        !n.ends_with(".qweight")
            && !n.ends_with(".qzeros")
            && !n.ends_with(".scales")
            && !n.ends_with(".g_idx")
    });
    expect_defect(&run(&s, |_| {}), "tensors", "no quantized linear");
}

#[test]
fn index_defects() {
    let r = run(&good(), |d| {
        let path = d.join("model.safetensors.index.json");
        let mut idx: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        idx["weight_map"]
            .as_object_mut()
            .unwrap()
            .remove("model.norm.weight");
        idx["weight_map"]["model.ghost.weight"] = json!("model-00001-of-00002.safetensors");
        std::fs::write(&path, serde_json::to_vec(&idx).unwrap()).unwrap();
    });
    expect_defect(&r, "index", "does not cover tensor model.norm.weight");
    expect_defect(&r, "index", "lists model.ghost.weight");

    let mut s = good();
    s.write_index = false;
    expect_defect(
        &run(&s, |_| {}),
        "index",
        "2 shards but no model.safetensors.index.json",
    );
}

#[test]
fn save_complete_defects() {
    let mut s = good();
    s.write_save_complete = false;
    expect_defect(
        &run(&s, |_| {}),
        "save-complete",
        ".save-complete is missing",
    );

    // same size, different bytes → sha256 mismatch
    let r = run(&good(), |d| {
        let p = d.join("model-00002-of-00002.safetensors");
        let mut b = std::fs::read(&p).unwrap();
        let n = b.len();
        b[n - 1] ^= 0xff;
        std::fs::write(&p, b).unwrap();
    });
    expect_defect(
        &r,
        "save-complete",
        "shard model-00002-of-00002.safetensors sha256 is",
    );

    // truncated shard: size mismatch and a truncated header/data
    let r = run(&good(), |d| {
        let p = d.join("model-00001-of-00002.safetensors");
        let b = std::fs::read(&p).unwrap();
        std::fs::write(&p, &b[..b.len() - 10]).unwrap();
    });
    expect_defect(&r, "save-complete", "model-00001-of-00002.safetensors has");
    expect_defect(&r, "shards", "truncated");

    // an extra shard nobody recorded
    let r = run(&good(), |d| {
        std::fs::copy(
            d.join("model-00001-of-00002.safetensors"),
            d.join("extra.safetensors"),
        )
        .unwrap();
    });
    expect_defect(
        &r,
        "save-complete",
        "shard extra.safetensors is not recorded",
    );
}

#[test]
fn quality_defects() {
    let mut s = good();
    s.quality = None;
    expect_defect(
        &run(&s, |_| {}),
        "quality",
        ".quantization-quality.json is missing",
    );

    let mut s = good();
    s.quality = Some(
        json!({"gptqModules": 10, "rtnFallbackModules": 4, "rtnFallbackPercent": 28.57,
                            "maxRtnFallbackPercent": 5.0, "minimumModules": 10, "gate": "failed"}),
    );
    expect_defect(
        &run(&s, |_| {}),
        "quality",
        "quality gate failed: 4 of 14 modules fell back to RTN (28.57% > 5.00%)",
    );

    let mut s = good();
    s.quality.as_mut().unwrap()["gate"] = json!("insufficient-sample");
    assert!(run(&s, |_| {}).ok);
}

#[test]
fn json_report_shape() {
    let mut s = good();
    s.quality = None;
    let r = run(&s, |_| {});
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["defects"][0]["check"], "quality");
    assert_eq!(v["quantizedLinears"], 14);
}

#[test]
fn files_escaping_the_artifact_are_defects_naming_them() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("config.json"), b"{}").unwrap();
    // A shard and config.json that are symlinks out of the directory: neither is read.
    let r = run(&good(), |d| {
        let shard = d.join("model-00002-of-00002.safetensors");
        let real = outside.path().join("shard.safetensors");
        std::fs::rename(&shard, &real).unwrap();
        std::os::unix::fs::symlink(&real, &shard).unwrap();
        std::fs::remove_file(d.join("config.json")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("config.json"), d.join("config.json"))
            .unwrap();
    });
    expect_defect(&r, "shards", "model-00002-of-00002.safetensors");
    expect_defect(&r, "shards", "outside");
    expect_defect(&r, "config", "config.json");
    expect_defect(&r, "save-complete", "outside");
    assert!(!r.ok);
}

#[test]
fn a_fifo_shard_is_a_defect_not_a_hang() {
    let r = run(&good(), |d| {
        let shard = d.join("model-00001-of-00002.safetensors");
        std::fs::remove_file(&shard).unwrap();
        let c = std::ffi::CString::new(shard.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc_mkfifo(c.as_ptr(), 0o644) }, 0);
    });
    expect_defect(&r, "shards", "not a regular file (a FIFO)");
}

extern "C" {
    #[link_name = "mkfifo"]
    fn libc_mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
}

#[test]
fn overflowing_shapes_and_offsets_are_defects() {
    let dir = tempfile::tempdir().unwrap();
    for (name, header) in [
        (
            "shape.safetensors",
            r#"{"t":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#,
        ),
        (
            "offsets.safetensors",
            r#"{"t":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}}"#,
        ),
    ] {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        std::fs::write(dir.path().join(name), b).unwrap();
        let e = read_header(dir.path(), name).unwrap_err();
        assert!(
            flexinfer_api::contract::error::chain(&e).contains(name),
            "{e}"
        );
    }
}

/// Shape values from an untrusted header and config whose products do not fit 64 bits: defects (or no
/// expectation), never a panic.
#[test]
fn huge_shape_values_are_defects_not_panics() {
    let p = "model.layers.1.mlp.down_proj";
    let mut s = good();
    let t = s.tensors.get_mut(&format!("{p}.qweight")).unwrap();
    t.1 = vec![1usize << 60, 0];
    t.2.clear();
    expect_defect(
        &run(&s, |_| {}),
        "shapes",
        &format!("{p}.qweight has shape"),
    );

    let mut s = good();
    s.config["num_attention_heads"] = json!(u64::MAX / 2);
    s.config["num_key_value_heads"] = json!(u64::MAX / 2);
    s.config["head_dim"] = json!(u64::MAX / 2);
    // The attention shapes imply nothing then; the rest of the artifact is still checked.
    let r = run(&s, |_| {});
    assert!(
        !r.defects.iter().any(|d| d.message.contains("self_attn")),
        "{}",
        r.render()
    );
}
