//! The real llama.cpp (Debian sid's llama.cpp 0.7.0 / ggml 0.27.0, in the root that
//! `scripts/gguf/llamacpp-root.sh` builds; docs/dev/gguf.md) against the GGUF files we write:
//!
//! - `llama-server` loads every type we write (generated Llama models, one with rows that need the
//!   fallback types, and a Qwen2 model) and answers `/completion` (8 tokens) and
//!   `/v1/chat/completions` with our chat template; its load log reports the tensor count, the count
//!   per ggml type and the file type we wrote. For F16/BF16 its next-token log-probabilities equal
//!   our own forward pass over the source checkpoint (names, q/k row order, rope, norms, biases).
//! - `llama-tokenize` splits a prompt as the tokenizer.json does (the `tokenizers` crate), for each
//!   pre-tokenizer we map (GPT-2, Llama 3, Qwen2), begin-of-text and special tokens included.
//! - `llama-quantize` of our BF16 file (exact in f32) to every preset, with and without an importance
//!   matrix, gives the same tensors, per-tensor types and the same bytes as our writer from the source.
//!
//! The root comes from `FLEXINFER_LLAMACPP_ROOT`; when it is unset the tests print `SKIPPED` and pass,
//! unless `FLEXINFER_REQUIRE_LLAMACPP=1` (scripts/test.sh sets both), which makes it a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod llamacpp_support;

use flexinfer_quant::gguf::reader::{read_header, GgufHeader};
use flexinfer_quant::gguf::{FileType, GgmlType};
use llamacpp_support::*;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// How far llama.cpp's next-token log-probabilities of an F16 / a BF16 file may be from our
/// reference forward pass (f16 KV cache, f32 sums in another order; BF16 also rounds the
/// activations to bf16). Measured here: 0.0011–0.0019 for F16, 0.0096–0.0153 for BF16.
fn logprob_tolerance(ft: FileType) -> f64 {
    if ft == FileType::F16 {
        0.01
    } else {
        0.03
    }
}

/// How far the controls (the prompt with two tokens swapped, the model without its rope
/// scaling) must be from what llama.cpp computes, so that the comparison could see such a mistake.
/// With the q/k rows left in transformers' order (a mapping mistake, made by hand once) the
/// difference was 0.49.
const CONTROL_MIN: f64 = 0.1;

#[test]
fn llama_server_loads_every_type_we_write_and_generates_tokens() {
    let Some(root) = llamacpp_root() else { return };
    let d = tempfile::tempdir().unwrap();
    let models = [
        ("wide", Arch::Llama(WIDE)),
        ("narrow", Arch::Llama(NARROW)),
        ("qwen2", Arch::Qwen2),
        ("linear-rope", Arch::LlamaLinearRope),
    ];
    // The wide model's weights without rope scaling: its log-probabilities are far from what
    // llama.cpp computes for the wide and linear-rope files, so the comparison sees the scaling.
    let unscaled = d.path().join("unscaled");
    model(&unscaled, &Arch::LlamaNoRopeScaling);
    let mut loaded = 0;
    for (name, arch) in &models {
        let src = d.path().join(name);
        model(&src, arch);
        let types: &[FileType] = match arch {
            Arch::Qwen2 => &[FileType::Q4KM, FileType::Q8_0, FileType::F16],
            Arch::Llama(_) => &FileType::ALL,
            Arch::LlamaLinearRope | Arch::LlamaNoRopeScaling => &[FileType::F16],
        };
        let template: serde_json::Value =
            serde_json::from_slice(&std::fs::read(src.join("tokenizer_config.json")).unwrap())
                .unwrap();
        let prompt_tokens = token_count(&src, PROMPT);
        let prompt_ids = token_ids(&src, PROMPT);
        let reference = reference_logprobs(&src, &prompt_ids);
        // The same tokens with the first two swapped: what a mistake in attention or positions
        // (rows of q/k in the wrong order, the wrong rope) would look like.
        let mut swapped = prompt_ids.clone();
        swapped.swap(0, 1);
        let reference_swapped = reference_logprobs(&src, &swapped);
        let reference_unscaled = match arch {
            Arch::Llama(size) if size.hidden == WIDE.hidden => {
                Some(reference_logprobs(&unscaled, &prompt_ids))
            }
            Arch::LlamaLinearRope => Some(reference_logprobs(&unscaled, &prompt_ids)),
            _ => None,
        };
        for ft in types {
            let file = format!("{name}-{}.gguf", ft.name());
            let s = ours(&src, &d.path().join(&file), *ft, None);
            let h = read_header(&std::fs::read(d.path().join(&file)).unwrap()).unwrap();
            let server = Server::start(&root, d.path(), &file);
            // 8 tokens from the prompt (greedy, end-of-text masked so that all 8 come): the prompt
            // is evaluated as the tokenizer.json splits it, and every sampled id is in the vocabulary.
            let c = server.request(
                "POST",
                "/completion",
                Some(
                    &json!({"prompt": PROMPT, "n_predict": 8, "temperature": 0, "seed": 1,
                             "ignore_eos": true, "return_tokens": true, "cache_prompt": false}),
                ),
            );
            assert_eq!(c["tokens_evaluated"], prompt_tokens, "{file}: {c}");
            assert_eq!(c["tokens_predicted"], 8, "{file}: {c}");
            let ids: Vec<u64> = serde_json::from_value(c["tokens"].clone()).unwrap();
            assert_eq!(ids.len(), 8, "{file}: {c}");
            assert!(
                ids.iter().all(|t| *t < WIDE.vocab as u64),
                "{file}: {ids:?}"
            );
            // The chat template we wrote is the one llama.cpp renders: it concatenates the
            // messages' contents, so the prompt is the same tokens.
            let chat = server.request(
                "POST",
                "/v1/chat/completions",
                Some(
                    &json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
                             "temperature": 0}),
                ),
            );
            assert_eq!(
                chat["usage"]["prompt_tokens"], prompt_tokens,
                "{file}: {chat}"
            );
            assert_eq!(chat["usage"]["completion_tokens"], 2, "{file}: {chat}");
            if matches!(ft, FileType::F16 | FileType::BF16) {
                // Unquantized weights: llama.cpp computes the function the checkpoint defines.
                // Its log-probabilities of every next token after the prompt (the raw logits',
                // before any sampler) equal our forward pass's; the swapped prompt's are far
                // away, so the comparison can tell. The server withholds the probabilities of a
                // token that is an incomplete UTF-8 sequence, so the single bytes 0x80..0xff
                // (ids 128..255 of the test vocabulary) are kept from being sampled.
                let no_partial_utf8: Vec<_> = (128..256).map(|id| json!([id, false])).collect();
                let body = json!({"prompt": prompt_ids, "n_predict": 1, "n_probs": WIDE.vocab,
                                  "temperature": 0, "post_sampling_probs": false,
                                  "logit_bias": no_partial_utf8, "cache_prompt": false});
                let c = server.request("POST", "/completion", Some(&body));
                let mut theirs = vec![f64::NAN; WIDE.vocab];
                let top = c["completion_probabilities"][0]["top_logprobs"].as_array();
                for t in top.unwrap_or_else(|| panic!("{file}: no log-probabilities in {c}")) {
                    theirs[usize::try_from(t["id"].as_u64().unwrap()).unwrap()] =
                        t["logprob"].as_f64().unwrap();
                }
                assert!(theirs.iter().all(|v| v.is_finite()), "{file}: {c}");
                let d = max_abs_diff(&reference, &theirs);
                let d_swapped = max_abs_diff(&reference_swapped, &theirs);
                assert!(
                    d < logprob_tolerance(*ft),
                    "{file}: |logprob difference| {d}"
                );
                assert!(
                    d_swapped > CONTROL_MIN,
                    "{file}: the swapped prompt is only {d_swapped} away"
                );
                if let Some(u) = &reference_unscaled {
                    let d_unscaled = max_abs_diff(u, &theirs);
                    assert!(
                        d_unscaled > CONTROL_MIN,
                        "{file}: without rope scaling only {d_unscaled} away"
                    );
                    eprintln!("{file}: without rope scaling {d_unscaled:.3} away");
                }
                eprintln!(
                    "{file}: logprobs within {d:.5} of ours (swapped prompt: {d_swapped:.3})"
                );
            }
            let props = server.request("GET", "/props", None);
            assert_eq!(props["chat_template"], template["chat_template"], "{file}");
            // What the loader reported: tensor and key counts, tensors per type, file type.
            let log = server.log_text();
            drop(server);
            let r = load_report(&log);
            let mut want = BTreeMap::new();
            for (_, ty) in &s.tensors {
                *want.entry(ty.name().to_lowercase()).or_insert(0) += 1;
            }
            let got: BTreeMap<String, usize> = r
                .per_type
                .iter()
                .map(|(k, v)| (k.to_lowercase(), *v))
                .collect();
            assert_eq!(got, want, "{file}: tensors per type");
            assert_eq!(r.tensors, s.tensors.len(), "{file}: tensor count");
            assert_eq!(r.kv, h.metadata.len(), "{file}: metadata count");
            assert_eq!(r.file_type, llama_cpp_ftype_name(*ft), "{file}: file type");
            eprintln!(
                "{file}: loaded ({}, {:?}); generated {ids:?} {:?}",
                r.file_type, r.per_type, c["content"]
            );
            loaded += 1;
        }
    }
    assert_eq!(loaded, 2 * FileType::ALL.len() + 3 + 1);
}

/// Llama 3's and Qwen2's split rules (their tokenizer.json `Split` patterns).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What the tokenizer.json's post-processor adds.
#[derive(Clone, Copy, Debug)]
enum Post {
    /// No post-processor.
    None,
    /// `ByteLevel` (offsets only: no special tokens, as Qwen2's).
    ByteLevel,
    /// `TemplateProcessing` with a begin-of-text token first (as Llama 3's).
    Bos,
}

/// The test tokenizer turned into one with the given pre-tokenizer (GPT-2's, Llama 3's or Qwen2's)
/// and post-processor, with merges on digits that make the three split rules give different tokens
/// (" 12345" is one word for GPT-2, " ", "123", "45" for Llama 3, single digits for Qwen2).
fn retokenize(dir: &Path, pre: &str, post: Post) {
    let p = dir.join("tokenizer.json");
    let mut tj: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let vocab = tj["model"]["vocab"].as_object_mut().unwrap();
    for (t, id) in [("Ġ1", 261), ("45", 262), ("12", 263)] {
        vocab.insert(t.into(), json!(id));
    }
    let merges = tj["model"]["merges"].as_array_mut().unwrap();
    merges.extend(["Ġ 1", "4 5", "1 2"].map(|m| json!(m)));
    let split = |pattern: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})
    };
    match pre {
        "gpt-2" => {}
        "llama-bpe" => {
            tj["pre_tokenizer"] = split(LLAMA3_SPLIT);
            tj["model"]["ignore_merges"] = json!(true);
        }
        "qwen2" => tj["pre_tokenizer"] = split(QWEN2_SPLIT),
        other => panic!("{other}"),
    }
    match post {
        Post::None => {}
        Post::ByteLevel => {
            tj["post_processor"] = json!({"type": "ByteLevel", "add_prefix_space": false,
                                           "trim_offsets": false, "use_regex": false});
        }
        Post::Bos => {
            vocab_add_special(&mut tj, "<|begin_of_text|>", 264);
            tj["post_processor"] = json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [264],
                                                         "tokens": ["<|begin_of_text|>"]}}});
            let cp = dir.join("tokenizer_config.json");
            let mut tc: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&cp).unwrap()).unwrap();
            tc["bos_token"] = json!("<|begin_of_text|>");
            std::fs::write(&cp, serde_json::to_vec(&tc).unwrap()).unwrap();
        }
    }
    std::fs::write(&p, serde_json::to_vec(&tj).unwrap()).unwrap();
}

fn vocab_add_special(tj: &mut serde_json::Value, content: &str, id: u64) {
    tj["model"]["vocab"][content] = json!(id);
    tj["added_tokens"].as_array_mut().unwrap().push(json!({"id": id, "content": content,
        "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
}

#[test]
fn llama_cpp_tokenizes_like_the_tokenizer_json_for_each_pre_tokenizer_we_map() {
    use flexinfer_quant::calib::{encode, load_tokenizer};
    let Some(root) = llamacpp_root() else { return };
    let d = tempfile::tempdir().unwrap();
    let prompt = "the that at 12345<|endoftext|>";
    let mut seen = Vec::new();
    // As the real models have them (GPT-2: none; Llama 3: begin-of-text; Qwen2: ByteLevel), then
    // the other way round: the post-processor, not the pre-tokenizer, says whether a BOS comes.
    for (pre, post) in [
        ("gpt-2", Post::None),
        ("llama-bpe", Post::Bos),
        ("qwen2", Post::ByteLevel),
        ("gpt-2", Post::Bos),
        ("llama-bpe", Post::ByteLevel),
    ] {
        let tag = format!("{pre}-{post:?}");
        let src = d.path().join(&tag);
        model(&src, &Arch::Llama(WIDE));
        retokenize(&src, pre, post);
        let file = format!("{tag}.gguf");
        ours(&src, &d.path().join(&file), FileType::Q8_0, None);
        let (h, _) = tensors(&d.path().join(&file));
        assert_eq!(
            h.get("tokenizer.ggml.pre"),
            Some(&flexinfer_quant::gguf::writer::MetaValue::Str(pre.into()))
        );
        // The reference: the tokenizer.json itself, through the tokenizers crate, with the special
        // tokens its post-processor adds.
        let want: Vec<u64> = encode(&load_tokenizer(&src).unwrap(), prompt, pre)
            .unwrap()
            .into_iter()
            .map(u64::from)
            .collect();
        let out = run(
            &root,
            d.path(),
            &[
                "llama-tokenize",
                "-m",
                &file,
                "-p",
                prompt,
                "--ids",
                "--log-disable",
            ],
        );
        assert!(
            out.status.success(),
            "{file}: llama-tokenize failed:\n{}",
            text(&out.stderr)
        );
        let got: Vec<u64> = serde_json::from_str(text(&out.stdout).trim()).unwrap();
        assert_eq!(
            got, want,
            "{tag}: llama.cpp's ids, the tokenizer.json's ids of {prompt:?}"
        );
        eprintln!("{tag}: {got:?}");
        seen.push(want);
    }
    // The three split rules gave three different token sequences, so each was checked.
    assert!(
        seen[0] != seen[1] && seen[1] != seen[2] && seen[0] != seen[2],
        "{seen:?}"
    );
}

/// Random positive importance per input column for every quantized tensor of `h`.
fn importance(h: &GgufHeader, seed: u64) -> HashMap<String, Vec<f32>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    h.tensors
        .iter()
        .filter(|(t, _)| t.ty.is_quantized() || t.dims.len() == 2)
        .map(|(t, _)| {
            let w = (0..t.dims[0])
                .map(|_| (2.0 * rng.random::<f32>()).exp())
                .collect();
            (t.name.clone(), w)
        })
        .collect()
}

/// The importance as llama-imatrix's legacy `imatrix.dat` (what llama-quantize --imatrix reads):
/// entry count; per entry name length, name, call count, value count, values; then the last chunk
/// and the dataset name. A call count of 1 leaves the values as they are.
fn legacy_imatrix(imp: &HashMap<String, Vec<f32>>) -> Vec<u8> {
    let mut b = Vec::new();
    let i32le = |b: &mut Vec<u8>, v: usize| b.extend(i32::try_from(v).unwrap().to_le_bytes());
    let mut names: Vec<&String> = imp.keys().collect();
    names.sort();
    i32le(&mut b, names.len());
    for n in names {
        i32le(&mut b, n.len());
        b.extend(n.as_bytes());
        i32le(&mut b, 1);
        i32le(&mut b, imp[n].len());
        for v in &imp[n] {
            b.extend(v.to_le_bytes());
        }
    }
    i32le(&mut b, 1);
    i32le(&mut b, 4);
    b.extend(b"test");
    b
}

/// Per tensor: name → (type, stored bytes).
fn tensors(path: &Path) -> (GgufHeader, BTreeMap<String, (GgmlType, Vec<u8>)>) {
    let file = std::fs::read(path).unwrap();
    let h = read_header(&file).unwrap();
    let map = h
        .tensors
        .iter()
        .map(|(t, off)| {
            let start = usize::try_from(h.data_start + off).unwrap();
            let len = usize::try_from(t.byte_size().unwrap()).unwrap();
            (t.name.clone(), (t.ty, file[start..start + len].to_vec()))
        })
        .collect();
    (h, map)
}

#[test]
fn llama_quantize_of_our_bf16_gives_our_types_and_bytes_for_every_preset() {
    let Some(root) = llamacpp_root() else { return };
    let d = tempfile::tempdir().unwrap();
    let mut compared = 0;
    for (name, size) in [("wide", WIDE), ("narrow", NARROW)] {
        let src = d.path().join(name);
        model(&src, &Arch::Llama(size));
        // The source is BF16: our BF16 file holds exactly the source values, and llama-quantize
        // widens them to f32 exactly, so both quantizers see the same numbers.
        let bf16 = format!("{name}-BF16.gguf");
        ours(&src, &d.path().join(&bf16), FileType::BF16, None);
        let (h, _) = tensors(&d.path().join(&bf16));
        let imp = importance(&h, 7);
        let imatrix = format!("{name}-imatrix.dat");
        std::fs::write(d.path().join(&imatrix), legacy_imatrix(&imp)).unwrap();
        for ft in FileType::ALL.iter().filter(|f| **f != FileType::BF16) {
            for with_imp in [false, true] {
                let tag = format!(
                    "{name}-{}{}",
                    ft.name(),
                    if with_imp { "-imat" } else { "" }
                );
                let (mine, theirs) = (format!("{tag}.gguf"), format!("{tag}-lq.gguf"));
                ours(&src, &d.path().join(&mine), *ft, with_imp.then_some(&imp));
                let mut args = vec!["llama-quantize"];
                if with_imp {
                    args.extend(["--imatrix", &imatrix]);
                }
                args.extend([bf16.as_str(), theirs.as_str(), ft.name(), "2"]);
                let out = run(&root, d.path(), &args);
                let log = text(&out.stderr) + &text(&out.stdout);
                assert!(out.status.success(), "{tag}: llama-quantize failed:\n{log}");
                if with_imp {
                    assert!(!log.contains("did not find imatrix"), "{tag}:\n{log}");
                }
                let (_, a) = tensors(&d.path().join(&mine));
                if with_imp && ft.default_type().is_quantized() && *ft != FileType::Q8_0 {
                    // The importance changed the blocks (so the equality below covers the
                    // weighted searches, not only the plain ones).
                    let (_, plain) = tensors(&d.path().join(format!("{name}-{}.gguf", ft.name())));
                    assert!(
                        a.iter().any(|(n, (_, bytes))| plain[n].1 != *bytes),
                        "{tag}: importance changed nothing"
                    );
                }
                let (hm, _) = tensors(&d.path().join(&mine));
                let (ht, b) = tensors(&d.path().join(&theirs));
                assert_eq!(
                    hm.get("general.file_type"),
                    ht.get("general.file_type"),
                    "{tag}: general.file_type"
                );
                assert_eq!(
                    a.keys().collect::<Vec<_>>(),
                    b.keys().collect::<Vec<_>>(),
                    "{tag}: tensor names"
                );
                let types = |m: &BTreeMap<String, (GgmlType, Vec<u8>)>| {
                    m.iter()
                        .map(|(n, (t, _))| (n.clone(), t.name()))
                        .collect::<Vec<_>>()
                };
                assert_eq!(
                    types(&a),
                    types(&b),
                    "{tag}: per-tensor types (ours, llama-quantize)"
                );
                let differ: Vec<String> = a
                    .iter()
                    .filter(|(n, (_, bytes))| b[*n].1 != *bytes)
                    .map(|(n, (t, bytes))| {
                        let diff = bytes.iter().zip(&b[n].1).filter(|(x, y)| x != y).count();
                        format!("{n} ({}: {diff} of {} bytes differ)", t.name(), bytes.len())
                    })
                    .collect();
                assert!(
                    differ.is_empty(),
                    "{tag}: bytes differ from llama-quantize's: {differ:?}"
                );
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 2 * 2 * (FileType::ALL.len() - 1));
}
