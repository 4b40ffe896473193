//! GGUF output of a generated Llama model: read back with our header reader and dequantizers (names,
//! types of the preset mix, metadata, alignment, values against the source), bad input, and — when
//! `FLEXINFER_GGUF_PYTHON` names a python with the PyPI `gguf` package (scripts/gguf/make-venv.sh) —
//! llama.cpp's own reader and `gguf.quants` over every type we write.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_quant::gguf::blocks::dequantize_tensor;
use flexinfer_quant::gguf::llama::permute_heads;
use flexinfer_quant::gguf::reader::{read_header, GgufHeader};
use flexinfer_quant::gguf::writer::{MetaArray, MetaValue};
use flexinfer_quant::gguf::{write_gguf, FileType, GgmlType, GgufJob};
use flexinfer_quant::tensors::TensorStore;
use flexinfer_quant::testkit::{self, ModelSize};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const SIZE: ModelSize = ModelSize::GGUF_WIDE;

fn model(dir: &Path, arch: &str, size: &ModelSize) {
    testkit::write_model_sized(dir, arch, 1, size).unwrap();
    testkit::write_byte_level_tokenizer(dir).unwrap();
}

fn gguf(
    model: &Path,
    out: &Path,
    ft: FileType,
    imp: Option<&HashMap<String, Vec<f32>>>,
) -> flexinfer_quant::Result<flexinfer_quant::gguf::GgufSummary> {
    write_gguf(&GgufJob {
        model_dir: model,
        out_path: out,
        file_type: ft,
        importance: imp,
        name: "tiny",
    })
}

/// A tensor's stored bytes.
fn tensor_bytes<'a>(file: &'a [u8], h: &GgufHeader, name: &str) -> (&'a [u8], GgmlType, Vec<u64>) {
    let (spec, off) = h.tensors.iter().find(|(t, _)| t.name == name).unwrap();
    let start = (h.data_start + off) as usize;
    let len = spec.byte_size().unwrap() as usize;
    (&file[start..start + len], spec.ty, spec.dims.clone())
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let e: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let s: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (e / s).sqrt()
}

/// Random positive importance for every quantized weight of the model.
fn importance(h: &GgufHeader) -> HashMap<String, Vec<f32>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    h.tensors
        .iter()
        .filter(|(t, _)| t.ty.is_quantized())
        .map(|(t, _)| {
            let w = (0..t.dims[0])
                .map(|_| (2.0 * rng.random::<f32>()).exp())
                .collect();
            (t.name.clone(), w)
        })
        .collect()
}

#[test]
fn a_q4_k_m_gguf_reads_back_with_llama_cpp_names_mix_metadata_and_values() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    model(&src, "LlamaForCausalLM", &SIZE);
    let out = d.path().join("out/model-Q4_K_M.gguf");
    let summary = gguf(&src, &out, FileType::Q4KM, None).unwrap();
    let file = std::fs::read(&out).unwrap();
    assert_eq!(summary.bytes, file.len() as u64);
    let h = read_header(&file).unwrap();
    assert_eq!(h.version, 3);

    // Names and the Q4_K_M mix: 4 layers → "more bits" layers are 2 and 3.
    let mut want = vec![
        ("token_embd.weight", GgmlType::Q4K),
        ("rope_freqs.weight", GgmlType::F32),
    ];
    let layer: Vec<(String, GgmlType)> = (0..4)
        .flat_map(|l| {
            let more = l >= 2;
            let hi = if more { GgmlType::Q6K } else { GgmlType::Q4K };
            [
                ("attn_norm.weight", GgmlType::F32),
                ("attn_q.weight", GgmlType::Q4K),
                ("attn_k.weight", GgmlType::Q4K),
                ("attn_v.weight", hi),
                ("attn_output.weight", GgmlType::Q4K),
                ("ffn_norm.weight", GgmlType::F32),
                ("ffn_gate.weight", GgmlType::Q4K),
                ("ffn_up.weight", GgmlType::Q4K),
                ("ffn_down.weight", hi),
            ]
            .map(|(n, t)| (format!("blk.{l}.{n}"), t))
        })
        .collect();
    want.extend(layer.iter().map(|(n, t)| (n.as_str(), *t)));
    want.push(("output_norm.weight", GgmlType::F32));
    want.push(("output.weight", GgmlType::Q6K));
    let got: Vec<(&str, GgmlType)> = h
        .tensors
        .iter()
        .map(|(t, _)| (t.name.as_str(), t.ty))
        .collect();
    assert_eq!(got, want);
    assert_eq!(summary.tensors.len(), want.len());

    // Metadata llama.cpp's llama loader reads.
    let u = |k: &str| match h.get(k) {
        Some(MetaValue::U32(v)) => *v,
        other => panic!("{k}: {other:?}"),
    };
    assert_eq!(
        h.get("general.architecture"),
        Some(&MetaValue::Str("llama".into()))
    );
    assert_eq!(u("llama.block_count"), 4);
    assert_eq!(u("llama.context_length"), 2048);
    assert_eq!(u("llama.embedding_length"), 256);
    assert_eq!(u("llama.feed_forward_length"), 512);
    assert_eq!(u("llama.attention.head_count"), 4);
    assert_eq!(u("llama.attention.head_count_kv"), 1);
    assert_eq!(u("llama.rope.dimension_count"), 64);
    assert_eq!(u("llama.vocab_size"), 320);
    assert_eq!(u("general.file_type"), 15);
    assert_eq!(u("general.quantization_version"), 2);
    assert_eq!(
        h.get("llama.rope.freq_base"),
        Some(&MetaValue::F32(500000.0))
    );
    assert_eq!(
        h.get("llama.attention.layer_norm_rms_epsilon"),
        Some(&MetaValue::F32(1e-5))
    );
    assert_eq!(
        h.get("tokenizer.ggml.model"),
        Some(&MetaValue::Str("gpt2".into()))
    );
    assert_eq!(
        h.get("tokenizer.ggml.pre"),
        Some(&MetaValue::Str("gpt-2".into()))
    );
    assert_eq!(u("tokenizer.ggml.eos_token_id"), 260);
    assert_eq!(u("tokenizer.ggml.bos_token_id"), 260);
    let Some(MetaValue::Array(MetaArray::Str(tokens))) = h.get("tokenizer.ggml.tokens") else {
        panic!()
    };
    assert_eq!(tokens.len(), 320);
    assert_eq!(
        (
            tokens[32].as_str(),
            tokens[256].as_str(),
            tokens[260].as_str()
        ),
        ("Ġ", "Ġt", "<|endoftext|>")
    );
    assert_eq!(tokens[319], "[PAD319]");
    assert!(matches!(
        h.get("tokenizer.chat_template"),
        Some(MetaValue::Str(_))
    ));

    // Alignment: the data section and every tensor start on 32 bytes; the file ends padded.
    assert_eq!(h.data_start % 32, 0);
    assert!(h.tensors.iter().all(|(_, off)| off % 32 == 0));
    let (last, off) = h.tensors.last().unwrap();
    assert_eq!(
        file.len() as u64,
        h.data_start + (off + last.byte_size().unwrap()).next_multiple_of(32)
    );

    // Values: every tensor dequantizes close to its source; q/k rows are in llama.cpp's order.
    let store = TensorStore::open_dir(&src).unwrap();
    for (hf, gguf_name, heads) in [
        ("model.embed_tokens.weight", "token_embd.weight", None),
        (
            "model.layers.1.self_attn.q_proj.weight",
            "blk.1.attn_q.weight",
            Some(4),
        ),
        (
            "model.layers.1.self_attn.k_proj.weight",
            "blk.1.attn_k.weight",
            Some(1),
        ),
        (
            "model.layers.2.self_attn.v_proj.weight",
            "blk.2.attn_v.weight",
            None,
        ),
        (
            "model.layers.3.mlp.down_proj.weight",
            "blk.3.ffn_down.weight",
            None,
        ),
        (
            "model.layers.0.input_layernorm.weight",
            "blk.0.attn_norm.weight",
            None,
        ),
        ("lm_head.weight", "output.weight", None),
    ] {
        let (bytes, ty, dims) = tensor_bytes(&file, &h, gguf_name);
        let cols = dims[0] as usize;
        let source = store.f32(hf).unwrap();
        let ours = dequantize_tensor(ty, bytes, cols).unwrap();
        let expected = match heads {
            Some(n) => permute_heads(&source, source.len() / cols, cols, n),
            None => source.clone(),
        };
        let bound = match ty {
            GgmlType::F32 => 0.0,
            GgmlType::Q6K => 0.02,
            _ => 0.08,
        };
        let e = rel_err(&expected, &ours);
        assert!(e <= bound, "{gguf_name} ({}): {e}", ty.name());
        if heads.is_some() {
            assert!(
                rel_err(&source, &ours) > 0.5,
                "{gguf_name}: rows not permuted"
            );
        }
    }
    let (bytes, _, _) = tensor_bytes(&file, &h, "rope_freqs.weight");
    let f = dequantize_tensor(GgmlType::F32, bytes, 32).unwrap();
    assert_eq!(f.len(), 32);
    assert_eq!(f[0], 1.0);
}

#[test]
fn importance_changes_the_blocks_of_the_tensors_it_names() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    model(&src, "LlamaForCausalLM", &SIZE);
    let plain = d.path().join("plain.gguf");
    gguf(&src, &plain, FileType::Q4KM, None).unwrap();
    let a = std::fs::read(&plain).unwrap();
    let h = read_header(&a).unwrap();
    let mut imp = HashMap::new();
    imp.insert(
        "blk.1.ffn_up.weight".to_string(),
        importance(&h).remove("blk.1.ffn_up.weight").unwrap(),
    );
    let weighted = d.path().join("weighted.gguf");
    gguf(&src, &weighted, FileType::Q4KM, Some(&imp)).unwrap();
    let b = std::fs::read(&weighted).unwrap();
    assert_eq!(a.len(), b.len());
    for (t, _) in &h.tensors {
        let same = tensor_bytes(&a, &h, &t.name).0 == tensor_bytes(&b, &h, &t.name).0;
        assert_eq!(same, t.name != "blk.1.ffn_up.weight", "{}", t.name);
    }
    // A vector of the wrong length is bad input naming the tensor, and nothing is written.
    imp.insert("blk.0.attn_q.weight".into(), vec![1.0; 7]);
    let bad = d.path().join("bad.gguf");
    let e = gguf(&src, &bad, FileType::Q4KM, Some(&imp)).unwrap_err();
    assert!(
        e.is_bad_input() && flexinfer_contract::error::chain(&e).contains("blk.0.attn_q.weight"),
        "{e}"
    );
    assert!(!bad.exists());
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp"))
        .collect()
}

#[test]
fn bad_input_names_the_problem_and_leaves_the_previous_file() {
    let d = tempfile::tempdir().unwrap();
    let outdir = d.path().join("out");
    std::fs::create_dir_all(&outdir).unwrap();
    let out = outdir.join("model.gguf");
    std::fs::write(&out, b"previous good file").unwrap();
    let case =
        |name: &str, arch: &str, size: &ModelSize, byte_level: bool, ft: FileType| -> String {
            let src = d.path().join(name);
            testkit::write_model_sized(&src, arch, 2, size).unwrap();
            if byte_level {
                testkit::write_byte_level_tokenizer(&src).unwrap();
            }
            let e = gguf(&src, &out, ft, None).unwrap_err();
            assert!(e.is_bad_input(), "{name}: {e}");
            assert_eq!(
                std::fs::read(&out).unwrap(),
                b"previous good file",
                "{name}"
            );
            assert!(
                leftovers(&outdir).is_empty(),
                "{name}: {:?}",
                leftovers(&outdir)
            );
            flexinfer_contract::error::chain(&e)
        };
    let e = case("qwen3", "Qwen3ForCausalLM", &SIZE, true, FileType::Q8_0);
    assert!(
        e.contains("Qwen3ForCausalLM") && e.contains("LlamaForCausalLM"),
        "{e}"
    );
    let e = case("chars", "LlamaForCausalLM", &SIZE, false, FileType::Q8_0);
    assert!(
        e.contains("tokenizer") && e.contains("pre_tokenizer") && e.contains("Whitespace"),
        "{e}"
    );
    // A config.json with more layers than the weights: the first missing tensor is named.
    let e = {
        let src = d.path().join("short");
        model(&src, "LlamaForCausalLM", &SIZE);
        let cfgp = src.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&cfgp).unwrap()).unwrap();
        cfg["num_hidden_layers"] = json!(5);
        std::fs::write(&cfgp, serde_json::to_vec(&cfg).unwrap()).unwrap();
        let e = gguf(&src, &out, FileType::Q4KM, None).unwrap_err();
        assert!(e.is_bad_input(), "{e}");
        assert_eq!(std::fs::read(&out).unwrap(), b"previous good file");
        assert!(leftovers(&outdir).is_empty());
        flexinfer_contract::error::chain(&e)
    };
    assert!(
        e.contains("model.layers.4.input_layernorm.weight") && e.contains("blk.4.attn_norm.weight"),
        "{e}"
    );
    let narrow = ModelSize {
        hidden: 128,
        inter: 256,
        ..SIZE
    };
    testkit::write_model_sized(&d.path().join("narrow"), "LlamaForCausalLM", 2, &narrow).unwrap();
    testkit::write_byte_level_tokenizer(&d.path().join("narrow")).unwrap();
    // The same narrow model is fine as Q4_K_M (Q5_0 where Q4_K does not fit, as llama.cpp does).
    let src = d.path().join("narrow");
    let s = gguf(&src, &out, FileType::Q4KM, None).unwrap();
    assert!(s
        .tensors
        .contains(&("blk.0.attn_q.weight".into(), GgmlType::Q5_0)));
    assert!(s
        .tensors
        .contains(&("blk.2.ffn_down.weight".into(), GgmlType::Q6K)));
    assert!(read_header(&std::fs::read(&out).unwrap()).is_ok());
}

#[test]
fn qwen2_keeps_its_rows_and_maps_its_biases() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    model(&src, "Qwen2ForCausalLM", &SIZE);
    // Qwen2 with llama3 rope scaling is not a real config; drop it for this model.
    let cfgp = src.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfgp).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("rope_scaling");
    cfg["model_type"] = json!("qwen2");
    std::fs::write(&cfgp, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let out = d.path().join("q.gguf");
    gguf(&src, &out, FileType::Q8_0, None).unwrap();
    let file = std::fs::read(&out).unwrap();
    let h = read_header(&file).unwrap();
    assert_eq!(
        h.get("general.architecture"),
        Some(&MetaValue::Str("qwen2".into()))
    );
    assert!(h.get("qwen2.block_count").is_some());
    let names: Vec<&str> = h.tensors.iter().map(|(t, _)| t.name.as_str()).collect();
    assert!(names.contains(&"blk.0.attn_q.bias") && names.contains(&"blk.3.attn_v.bias"));
    assert!(!names.contains(&"rope_freqs.weight"));
    let store = TensorStore::open_dir(&src).unwrap();
    let (bytes, ty, _) = tensor_bytes(&file, &h, "blk.1.attn_q.weight");
    let ours = dequantize_tensor(ty, bytes, 256).unwrap();
    assert!(
        rel_err(
            &store.f32("model.layers.1.self_attn.q_proj.weight").unwrap(),
            &ours
        ) < 0.01
    );
    let (bytes, ty, _) = tensor_bytes(&file, &h, "blk.1.attn_k.bias");
    assert_eq!(ty, GgmlType::F32);
    assert_eq!(
        dequantize_tensor(ty, bytes, 64).unwrap(),
        store.f32("model.layers.1.self_attn.k_proj.bias").unwrap()
    );
}

/// Expected metadata for the Python check (a subset, compared exactly).
fn expected_metadata(h: &GgufHeader) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (k, v) in &h.metadata {
        let j = match v {
            MetaValue::U32(x) => json!(x),
            MetaValue::F32(x) => json!(x),
            MetaValue::Bool(x) => json!(x),
            MetaValue::Str(s) => json!(s),
            MetaValue::Array(MetaArray::Str(s)) => json!(s),
            MetaValue::Array(MetaArray::I32(s)) => json!(s),
            _ => continue,
        };
        m.insert(k.clone(), j);
    }
    serde_json::Value::Object(m)
}

fn write_f32(path: &Path, v: &[f32]) {
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(path, b).unwrap();
}

#[test]
fn llama_cpp_gguf_reader_reads_every_type_we_write_and_dequantizes_it_like_us() {
    let Some(python) = std::env::var_os("FLEXINFER_GGUF_PYTHON")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
    else {
        eprintln!(
            "skipped: FLEXINFER_GGUF_PYTHON is not set (scripts/gguf/make-venv.sh prints the python to set it to)"
        );
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gguf/check_gguf.py");
    let d = tempfile::tempdir().unwrap();
    let wide = d.path().join("model");
    model(&wide, "LlamaForCausalLM", &SIZE);
    // Rows of 288 values do not split into 256-value super-blocks: llama.cpp's fallbacks Q5_0/Q5_1;
    // 8 layers give Q4_0 + importance its Q4_1 layer.
    let narrow = d.path().join("narrow");
    let narrow_size = ModelSize {
        hidden: 288,
        layers: 8,
        ..SIZE
    };
    model(&narrow, "LlamaForCausalLM", &narrow_size);
    let stores = [
        TensorStore::open_dir(&wide).unwrap(),
        TensorStore::open_dir(&narrow).unwrap(),
    ];
    let mut files = Vec::new();
    let types = [
        (0, FileType::Q4KM, true),
        (0, FileType::Q4KM, false),
        (0, FileType::Q4KS, false),
        (0, FileType::Q5KM, true),
        (0, FileType::Q5KS, false),
        (0, FileType::Q3KM, true),
        (0, FileType::Q3KM, false),
        (0, FileType::Q2K, true),
        (0, FileType::Q2K, false),
        (0, FileType::Q6K, true),
        (0, FileType::Q8_0, false),
        (0, FileType::Q4_0, false),
        (0, FileType::Q4_0, true),
        (0, FileType::F16, false),
        (0, FileType::BF16, false),
        (1, FileType::Q4KM, false),
        (1, FileType::Q4KM, true),
        (1, FileType::Q5KS, false),
        (1, FileType::Q5KS, true),
        (1, FileType::Q4_0, true),
        (0, FileType::IQ4XS, false),
        (0, FileType::IQ4XS, true),
        (1, FileType::Q2K, false),
        (1, FileType::Q3KM, true),
        // IQ4_XS falls back to IQ4_NL on the narrow rows (Q2_K / Q3_K fall back to Q4_0).
        (1, FileType::IQ4XS, true),
    ];
    let mut seen = std::collections::BTreeSet::new();
    for (i, (which, ft, with_imp)) in types.iter().enumerate() {
        let src = if *which == 0 { &wide } else { &narrow };
        let store = &stores[*which];
        let out = d.path().join(format!("m{i}-{}.gguf", ft.name()));
        let imp = if *with_imp {
            gguf(src, &out, *ft, None).unwrap();
            Some(importance(
                &read_header(&std::fs::read(&out).unwrap()).unwrap(),
            ))
        } else {
            None
        };
        gguf(src, &out, *ft, imp.as_ref()).unwrap();
        let file = std::fs::read(&out).unwrap();
        let h = read_header(&file).unwrap();
        let mut tensors = Vec::new();
        for (k, (t, _)) in h.tensors.iter().enumerate() {
            seen.insert(t.ty.name());
            let (bytes, ty, dims) = tensor_bytes(&file, &h, &t.name);
            let ours_path = d.path().join(format!("m{i}-t{k}.ours"));
            write_f32(
                &ours_path,
                &dequantize_tensor(ty, bytes, dims[0] as usize).unwrap(),
            );
            // gguf-py quantizes these types itself: compare its bytes with ours on the same input.
            let source = if !with_imp
                && matches!(
                    ty,
                    GgmlType::Q8_0
                        | GgmlType::Q4_0
                        | GgmlType::Q4_1
                        | GgmlType::Q5_0
                        | GgmlType::Q5_1
                        | GgmlType::F16
                        | GgmlType::BF16
                ) {
                let hf = match t.name.as_str() {
                    "token_embd.weight" => "model.embed_tokens.weight".to_string(),
                    "output.weight" => "lm_head.weight".to_string(),
                    n => {
                        let (l, rest) = n.trim_start_matches("blk.").split_once('.').unwrap();
                        let m = match rest {
                            "attn_q.weight" => "self_attn.q_proj.weight",
                            "attn_k.weight" => "self_attn.k_proj.weight",
                            "attn_v.weight" => "self_attn.v_proj.weight",
                            "attn_output.weight" => "self_attn.o_proj.weight",
                            "ffn_gate.weight" => "mlp.gate_proj.weight",
                            "ffn_up.weight" => "mlp.up_proj.weight",
                            "ffn_down.weight" => "mlp.down_proj.weight",
                            other => panic!("{other}"),
                        };
                        format!("model.layers.{l}.{m}")
                    }
                };
                let cols = dims[0] as usize;
                let mut v = store.f32(&hf).unwrap();
                if t.name.ends_with("attn_q.weight") {
                    v = permute_heads(&v, v.len() / cols, cols, 4);
                } else if t.name.ends_with("attn_k.weight") {
                    v = permute_heads(&v, v.len() / cols, cols, 1);
                }
                let p = d.path().join(format!("m{i}-t{k}.src"));
                write_f32(&p, &v);
                Some(p)
            } else {
                None
            };
            tensors.push(json!({"name": t.name, "type": ty.name(), "shape": dims,
                                "ours": ours_path, "source": source}));
        }
        files.push(json!({"gguf": out, "metadata": expected_metadata(&h), "tensors": tensors}));
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        vec![
            "BF16", "F16", "F32", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K",
            "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"
        ]
    );
    let manifest = d.path().join("manifest.json");
    std::fs::write(
        &manifest,
        serde_json::to_vec(&json!({"files": files})).unwrap(),
    )
    .unwrap();
    let run = std::process::Command::new(&python)
        .arg(&script)
        .arg(&manifest)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    eprintln!("{stdout}");
    assert!(
        run.status.success(),
        "gguf-py check failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count(),
        types.len()
    );
    // gguf-py quantized these files' tensors itself and got our bytes (Q4_0's output.weight is Q6_K,
    // which it cannot quantize); on the narrow model that includes the Q5_0 (Q4_K_M) and Q5_1
    // (Q5_K_S) fallbacks.
    for (file, n) in [
        ("m10-Q8_0", 30),
        ("m11-Q4_0", 29),
        ("m13-F16", 30),
        ("m14-BF16", 30),
        ("m15-Q4_K_M", 50),
        ("m17-Q5_K_S", 50),
    ] {
        let line = stdout
            .lines()
            .find(|l| l.contains(&format!("/{file}.gguf")))
            .unwrap();
        assert!(line.contains(&format!(", {n} quantized equal")), "{line}");
    }
}

#[test]
fn the_artifact_directory_has_the_file_and_save_complete_and_is_reused() {
    use flexinfer_quant::events::NullSink;
    use flexinfer_quant::gguf::{write_gguf_artifact, GgufArtifactJob};
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    model(&src, "LlamaForCausalLM", &SIZE);
    let out = d.path().join("cache/gguf-q4_k_m");
    let job = |ft| GgufArtifactJob {
        model_dir: &src,
        out_dir: &out,
        file_type: ft,
        importance: None,
        prequantized: None,
        script_version: "test",
        verify_save_sha256: true,
    };
    let first = write_gguf_artifact(&job(FileType::Q4KM), &NullSink).unwrap();
    assert!(!first.cached);
    let file = out.join("model-Q4_K_M.gguf");
    assert_eq!(first.file_name, "model-Q4_K_M.gguf");
    assert_eq!(
        first.compressed_size_bytes,
        std::fs::metadata(&file).unwrap().len()
    );
    assert!(first.original_size_bytes > first.compressed_size_bytes);
    let sc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join(".save-complete")).unwrap()).unwrap();
    assert_eq!(sc["shards"][0]["name"], "model-Q4_K_M.gguf");
    assert_eq!(
        sc["shards"][0]["sha256"],
        flexinfer_quant::fsutil::sha256_file(&file).unwrap()
    );
    assert_eq!(
        sc["config_digest"].as_str(),
        Some(first.config_digest.as_str())
    );
    assert!(read_header(&std::fs::read(&file).unwrap()).is_ok());
    // Same input and type: reused, nothing rewritten.
    let mtime = std::fs::metadata(&file).unwrap().modified().unwrap();
    let again = write_gguf_artifact(&job(FileType::Q4KM), &NullSink).unwrap();
    assert!(again.cached);
    assert_eq!(again.config_digest, first.config_digest);
    assert_eq!(std::fs::metadata(&file).unwrap().modified().unwrap(), mtime);
    // A damaged file is not reused: rewritten.
    std::fs::write(&file, b"x").unwrap();
    let healed = write_gguf_artifact(&job(FileType::Q4KM), &NullSink).unwrap();
    assert!(!healed.cached);
    assert_eq!(
        std::fs::metadata(&file).unwrap().len(),
        first.compressed_size_bytes
    );
    // Another type is another digest; bad input leaves the finished artifact and no staging.
    let q8 = write_gguf_artifact(&job(FileType::Q8_0), &NullSink).unwrap();
    assert_ne!(q8.config_digest, first.config_digest);
    assert!(out.join("model-Q8_0.gguf").is_file() && !file.exists());
    testkit::write_char_tokenizer(&src).unwrap();
    let e = write_gguf_artifact(&job(FileType::Q4KM), &NullSink).unwrap_err();
    assert!(e.is_bad_input(), "{e}");
    assert!(out.join("model-Q8_0.gguf").is_file());
    let names: Vec<String> = std::fs::read_dir(d.path().join("cache"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["gguf-q4_k_m".to_string()]);
}
