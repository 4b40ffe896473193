//! `tokenizer.json` (+ `tokenizer_config.json`, `config.json`) → llama.cpp's `tokenizer.ggml.*`
//! metadata, for byte-level BPE tokenizers (`tokenizer.ggml.model = gpt2`).
//!
//! The pre-tokenizer (`tokenizer.ggml.pre`) is recognised from its structure rather than by
//! tokenizing llama.cpp's probe text (what the converter hashes): a bare `ByteLevel` with its own
//! regex is GPT-2's split (`gpt-2`); a `Split` with Llama 3's or Qwen2's regex followed by
//! `ByteLevel` is `llama-bpe` / `qwen2`. Anything else — including SentencePiece-style tokenizers
//! (`tokenizer.ggml.model = llama`), not mapped yet — is an error naming the field.

use super::error::GgufError;
use super::writer::{MetaArray, MetaValue};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// llama.cpp's token types (`llama_token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn tok_err(key: &str, reason: impl Into<String>) -> GgufError {
    GgufError::Tokenizer {
        key: key.to_string(),
        reason: reason.into(),
    }
}

fn read_json(dir: &Path, name: &str, required: bool) -> Result<Option<Value>, GgufError> {
    if dir.join(name).symlink_metadata().is_err() {
        return if required {
            Err(tok_err(name, "missing from the model directory"))
        } else {
            Ok(None)
        };
    }
    crate::fsutil::read_json_within(dir, name, flexinfer_fsutil::limits::TOKENIZER)
        .map(Some)
        .map_err(|e| tok_err(name, e.to_string()))
}

/// The `tokenizer.ggml.pre` name of a byte-level pre-tokenizer.
fn pre_name(pre: &Value) -> Result<&'static str, GgufError> {
    let ty = pre.get("type").and_then(Value::as_str).unwrap_or("null");
    match ty {
        "ByteLevel" if pre.get("use_regex").and_then(Value::as_bool) != Some(false) => Ok("gpt-2"),
        "Sequence" => {
            let parts = pre
                .get("pretokenizers")
                .and_then(Value::as_array)
                .ok_or_else(|| tok_err("pre_tokenizer.pretokenizers", "missing"))?;
            let kinds: Vec<&str> = parts
                .iter()
                .map(|p| p.get("type").and_then(Value::as_str).unwrap_or(""))
                .collect();
            let split = parts
                .iter()
                .find(|p| p.get("type").and_then(Value::as_str) == Some("Split"))
                .and_then(|p| p.pointer("/pattern/Regex"))
                .and_then(Value::as_str);
            match (split, kinds.last()) {
                (Some(LLAMA3_SPLIT), Some(&"ByteLevel")) => Ok("llama-bpe"),
                (Some(QWEN2_SPLIT), Some(&"ByteLevel")) => Ok("qwen2"),
                (Some(p), _) => Err(tok_err(
                    "pre_tokenizer",
                    format!("split pattern {p:?} is not one llama.cpp's pre-tokenizers we map (gpt-2, llama-bpe, qwen2)"),
                )),
                (None, _) => Err(tok_err(
                    "pre_tokenizer",
                    format!("sequence {kinds:?} is not a byte-level split llama.cpp knows"),
                )),
            }
        }
        "Metaspace" | "null" => Err(tok_err(
            "pre_tokenizer",
            format!("{ty}: a SentencePiece-style tokenizer (tokenizer.ggml.model llama) is not mapped yet"),
        )),
        other => Err(tok_err(
            "pre_tokenizer",
            format!("{other} is not a byte-level BPE pre-tokenizer llama.cpp knows"),
        )),
    }
}

/// The converter's `does_token_look_special`, for added tokens not flagged special.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>") || (t.starts_with("<|") && t.ends_with("|>"))
}

fn special_text(v: &Value) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(Value::as_str))
}

/// What the tokenizer.json's post-processor adds around a sequence, read as llama.cpp's converter
/// (gguf-py `SpecialVocab`) reads it: `ByteLevel` adds nothing (unless `tokenizer_config.json`
/// says otherwise), `RobertaProcessing` a BOS and an EOS, `TemplateProcessing` a BOS when its single
/// template starts with the BOS token (or CLS; or any special token when no BOS is configured, which
/// then is the BOS) and an EOS when it ends with the EOS token. `None` leaves the decision to
/// `tokenizer_config.json`'s `add_bos_token` / `add_eos_token` and then to llama.cpp's default for
/// the pre-tokenizer (Llama 3's adds a BOS, GPT-2's and Qwen2's do not).
#[derive(Debug, Default, PartialEq)]
struct PostProcessor {
    add_bos: Option<bool>,
    add_eos: Option<bool>,
    /// The template's leading special token, the BOS when `tokenizer_config.json` names none.
    bos_text: Option<String>,
}

fn post_processor(
    tj: &Value,
    bos: Option<&str>,
    cls: Option<&str>,
    eos: Option<&str>,
) -> Result<PostProcessor, GgufError> {
    let mut out = PostProcessor::default();
    let Some(pp) = tj.get("post_processor").filter(|v| !v.is_null()) else {
        return Ok(out);
    };
    let procs: Vec<&Value> = match pp.get("processors").and_then(Value::as_array) {
        Some(list) => list.iter().collect(),
        None => vec![pp],
    };
    let special = |t: &Value| {
        t.pointer("/SpecialToken/id")
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    for p in procs {
        match p.get("type").and_then(Value::as_str).unwrap_or("") {
            "ByteLevel" => {
                out.add_bos.get_or_insert(false);
                out.add_eos.get_or_insert(false);
            }
            "RobertaProcessing" => {
                out.add_bos = Some(true);
                out.add_eos = Some(true);
            }
            "TemplateProcessing" => {
                let single = p
                    .get("single")
                    .and_then(Value::as_array)
                    .map(Vec::as_slice)
                    .unwrap_or(&[]);
                if single.len() < 2 {
                    continue;
                }
                if let Some(first) = single.first().and_then(special) {
                    let is_bos = match bos {
                        None => true,
                        Some(b) => b == first || cls == Some(first.as_str()),
                    };
                    out.add_bos = Some(is_bos);
                    if bos.is_none() {
                        out.bos_text = Some(first);
                    }
                }
                if let Some(last) = single.last().and_then(special) {
                    if let Some(e) = eos.filter(|e| *e != last) {
                        let reason =
                            format!("the template ends with {last:?}, not the eos token {e:?}");
                        return Err(tok_err("post_processor.single", reason));
                    }
                    out.add_eos = Some(true);
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The `tokenizer.*` metadata of the model in `dir`; `vocab_size` is `config.json`'s (the embedding
/// rows): ids the tokenizer does not use become `[PAD<id>]` tokens of type UNUSED, as the converter
/// writes them.
pub fn tokenizer_metadata(
    dir: &Path,
    vocab_size: usize,
    config: &Value,
) -> Result<Vec<(String, MetaValue)>, GgufError> {
    let tj = read_json(dir, "tokenizer.json", true)?.unwrap_or(Value::Null);
    let model = tj
        .get("model")
        .ok_or_else(|| tok_err("tokenizer.json model", "missing"))?;
    let mtype = model.get("type").and_then(Value::as_str).unwrap_or("");
    if mtype != "BPE" {
        return Err(tok_err(
            "model.type",
            format!("{mtype:?}: only BPE tokenizers map to llama.cpp's gpt2 model"),
        ));
    }
    let pre = pre_name(tj.get("pre_tokenizer").unwrap_or(&Value::Null))?;
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| tok_err("model.vocab", "missing or not an object"))?;
    let mut by_id: HashMap<usize, (String, i32)> = HashMap::with_capacity(vocab.len());
    for (tok, id) in vocab {
        let id = id
            .as_u64()
            .and_then(|i| usize::try_from(i).ok())
            .ok_or_else(|| tok_err("model.vocab", format!("token {tok:?} has no integer id")))?;
        by_id.insert(id, (tok.clone(), token_type::NORMAL));
    }
    let mut by_text: HashMap<String, usize> = HashMap::new();
    for a in tj
        .get("added_tokens")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
    {
        let (Some(id), Some(content)) = (
            a.get("id")
                .and_then(Value::as_u64)
                .and_then(|i| usize::try_from(i).ok()),
            a.get("content").and_then(Value::as_str),
        ) else {
            return Err(tok_err(
                "added_tokens",
                format!("entry {a} has no id or content"),
            ));
        };
        let special = a.get("special").and_then(Value::as_bool).unwrap_or(false);
        let entry = if special || looks_special(content) {
            (content.to_string(), token_type::CONTROL)
        } else {
            (content.replace('\u{2581}', " "), token_type::USER_DEFINED)
        };
        by_text.insert(content.to_string(), id);
        by_id.insert(id, entry);
    }
    for (tok, id) in vocab {
        if let Some(i) = id.as_u64().and_then(|i| usize::try_from(i).ok()) {
            by_text.entry(tok.clone()).or_insert(i);
        }
    }
    if let Some(max) = by_id.keys().max() {
        if *max >= vocab_size {
            return Err(tok_err(
                "tokenizer.ggml.tokens",
                format!("token id {max} is beyond config.json's vocab_size {vocab_size}"),
            ));
        }
    }
    let mut tokens = Vec::with_capacity(vocab_size);
    let mut types = Vec::with_capacity(vocab_size);
    for id in 0..vocab_size {
        match by_id.remove(&id) {
            Some((t, ty)) => {
                tokens.push(t);
                types.push(ty);
            }
            None => {
                tokens.push(format!("[PAD{id}]"));
                types.push(token_type::UNUSED);
            }
        }
    }
    let merges: Vec<String> = model
        .get("merges")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .map(|m| match m {
            Value::String(s) => Ok(s.clone()),
            Value::Array(p) => match (
                p.first().and_then(Value::as_str),
                p.get(1).and_then(Value::as_str),
            ) {
                (Some(a), Some(b)) if p.len() == 2 => Ok(format!("{a} {b}")),
                _ => Err(tok_err("model.merges", format!("entry {m} is not a pair"))),
            },
            _ => Err(tok_err("model.merges", format!("entry {m} is not a merge"))),
        })
        .collect::<Result<_, _>>()?;

    let mut md: Vec<(String, MetaValue)> = vec![
        ("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), MetaValue::Str(pre.into())),
        (
            "tokenizer.ggml.tokens".into(),
            MetaValue::Array(MetaArray::Str(tokens)),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            MetaValue::Array(MetaArray::I32(types)),
        ),
        (
            "tokenizer.ggml.merges".into(),
            MetaValue::Array(MetaArray::Str(merges)),
        ),
    ];
    let tc = read_json(dir, "tokenizer_config.json", false)?.unwrap_or(Value::Null);
    let configured = |kind: &str| tc.get(format!("{kind}_token")).and_then(special_text);
    let post = post_processor(&tj, configured("bos"), configured("cls"), configured("eos"))?;
    for (kind, key) in [
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
    ] {
        let text = match (kind, configured(kind)) {
            ("bos", None) => post.bos_text.as_deref(),
            (_, t) => t,
        };
        let from_text = text.and_then(|t| by_text.get(t).copied());
        let id = from_text.or_else(|| {
            config
                .get(format!("{kind}_token_id"))
                .and_then(Value::as_u64)
                .and_then(|i| usize::try_from(i).ok())
        });
        if let Some(id) = id {
            let id = u32::try_from(id)
                .ok()
                .filter(|i| (*i as usize) < vocab_size)
                .ok_or_else(|| {
                    tok_err(
                        &format!("tokenizer.ggml.{key}"),
                        format!("{id} is not a token id"),
                    )
                })?;
            md.push((format!("tokenizer.ggml.{key}"), MetaValue::U32(id)));
        }
    }
    // The post-processor decides where it says something (as the converter: it wins over
    // tokenizer_config.json); without either, llama.cpp's default for the pre-tokenizer applies.
    for (flag, from_post) in [
        ("add_bos_token", post.add_bos),
        ("add_eos_token", post.add_eos),
    ] {
        if let Some(b) = from_post.or_else(|| tc.get(flag).and_then(Value::as_bool)) {
            md.push((format!("tokenizer.ggml.{flag}"), MetaValue::Bool(b)));
        }
    }
    let template = match tc.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    };
    let template = match template {
        Some(t) => Some(t),
        None if dir.join("chat_template.jinja").is_file() => Some(
            flexinfer_fsutil::read_string_within(
                dir,
                "chat_template.jinja",
                flexinfer_fsutil::limits::TOKENIZER,
            )
            .map_err(|e| tok_err("chat_template.jinja", e.to_string()))?,
        ),
        None => None,
    };
    if let Some(t) = template {
        md.push(("tokenizer.chat_template".into(), MetaValue::Str(t)));
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn write(dir: &Path, name: &str, v: &Value) {
        std::fs::write(dir.join(name), serde_json::to_vec(v).unwrap()).unwrap();
    }

    fn byte_level(pre: Value) -> Value {
        json!({
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3},
                      "merges": ["a b", ["Ġ", "a"]]},
            "pre_tokenizer": pre,
            "added_tokens": [{"id": 4, "content": "<|eot|>", "special": true},
                             {"id": 5, "content": "user\u{2581}tok", "special": false}],
        })
    }

    fn get<'a>(md: &'a [(String, MetaValue)], k: &str) -> Option<&'a MetaValue> {
        md.iter().find(|(key, _)| key == k).map(|(_, v)| v)
    }

    #[test]
    fn a_byte_level_bpe_maps_to_gpt2_with_types_merges_and_special_ids() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "tokenizer.json",
            &byte_level(json!({"type": "ByteLevel", "use_regex": true})),
        );
        write(
            d.path(),
            "tokenizer_config.json",
            &json!({"eos_token": {"content": "<|eot|>"}, "add_bos_token": false, "chat_template": "{{x}}"}),
        );
        let md = tokenizer_metadata(d.path(), 8, &json!({"bos_token_id": 1})).unwrap();
        assert_eq!(
            get(&md, "tokenizer.ggml.model"),
            Some(&MetaValue::Str("gpt2".into()))
        );
        assert_eq!(
            get(&md, "tokenizer.ggml.pre"),
            Some(&MetaValue::Str("gpt-2".into()))
        );
        let Some(MetaValue::Array(MetaArray::Str(toks))) = get(&md, "tokenizer.ggml.tokens") else {
            panic!()
        };
        assert_eq!(
            toks,
            &["a", "b", "ab", "Ġ", "<|eot|>", "user tok", "[PAD6]", "[PAD7]"]
        );
        assert_eq!(
            get(&md, "tokenizer.ggml.token_type"),
            Some(&MetaValue::Array(MetaArray::I32(vec![
                1, 1, 1, 1, 3, 4, 5, 5
            ])))
        );
        assert_eq!(
            get(&md, "tokenizer.ggml.merges"),
            Some(&MetaValue::Array(MetaArray::Str(vec![
                "a b".into(),
                "Ġ a".into()
            ])))
        );
        assert_eq!(
            get(&md, "tokenizer.ggml.eos_token_id"),
            Some(&MetaValue::U32(4))
        );
        assert_eq!(
            get(&md, "tokenizer.ggml.bos_token_id"),
            Some(&MetaValue::U32(1))
        );
        assert_eq!(
            get(&md, "tokenizer.ggml.add_bos_token"),
            Some(&MetaValue::Bool(false))
        );
        assert_eq!(
            get(&md, "tokenizer.chat_template"),
            Some(&MetaValue::Str("{{x}}".into()))
        );
    }

    #[test]
    fn the_post_processor_decides_bos_and_eos_as_the_converter_reads_it() {
        let d = tempfile::tempdir().unwrap();
        let bos_template = json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|eot|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {}});
        let flags = |post: Value, config: Value| {
            let mut tj = byte_level(json!({"type": "ByteLevel", "use_regex": true}));
            tj["post_processor"] = post;
            write(d.path(), "tokenizer.json", &tj);
            write(d.path(), "tokenizer_config.json", &config);
            let md = tokenizer_metadata(d.path(), 8, &Value::Null).unwrap();
            let flag = |k: &str| match get(&md, k) {
                Some(MetaValue::Bool(b)) => Some(*b),
                None => None,
                other => panic!("{k}: {other:?}"),
            };
            (
                flag("tokenizer.ggml.add_bos_token"),
                flag("tokenizer.ggml.add_eos_token"),
                get(&md, "tokenizer.ggml.bos_token_id").cloned(),
            )
        };
        // A leading special token: a BOS, and the BOS itself when the config names none.
        assert_eq!(
            flags(bos_template.clone(), json!({})),
            (Some(true), None, Some(MetaValue::U32(4)))
        );
        // ... which wins over the config's add_bos_token, as in the converter.
        assert_eq!(
            flags(
                bos_template.clone(),
                json!({"bos_token": "<|eot|>", "add_bos_token": false})
            ),
            (Some(true), None, Some(MetaValue::U32(4)))
        );
        // A leading special token that is not the configured BOS: no BOS.
        assert_eq!(
            flags(bos_template, json!({"bos_token": "a"})).0,
            Some(false)
        );
        // ByteLevel adds nothing unless the config says so; in a Sequence too.
        assert_eq!(
            flags(json!({"type": "ByteLevel"}), json!({})),
            (Some(false), Some(false), None)
        );
        assert_eq!(
            flags(
                json!({"type": "Sequence", "processors": [{"type": "ByteLevel"}]}),
                json!({"add_bos_token": true})
            )
            .0,
            Some(false)
        );
        assert_eq!(
            flags(json!({"type": "RobertaProcessing"}), json!({})),
            (Some(true), Some(true), None)
        );
        // No post-processor: the config's flag, or nothing (llama.cpp's default).
        assert_eq!(
            flags(Value::Null, json!({"add_bos_token": true})),
            (Some(true), None, None)
        );
        assert_eq!(flags(Value::Null, json!({})), (None, None, None));
        // A template that ends with a special token other than the EOS cannot be mapped.
        let mut tj = byte_level(json!({"type": "ByteLevel"}));
        tj["post_processor"] = json!({"type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "a", "type_id": 0}}]});
        write(d.path(), "tokenizer.json", &tj);
        write(
            d.path(),
            "tokenizer_config.json",
            &json!({"eos_token": "<|eot|>"}),
        );
        let e = tokenizer_metadata(d.path(), 8, &Value::Null)
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err();
        assert!(e.contains("post_processor") && e.contains("<|eot|>"), "{e}");
    }

    #[test]
    fn llama3_and_qwen2_splits_are_recognised() {
        for (pat, want) in [(LLAMA3_SPLIT, "llama-bpe"), (QWEN2_SPLIT, "qwen2")] {
            let pre = json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
            assert_eq!(pre_name(&pre).unwrap(), want);
        }
    }

    #[test]
    fn unmappable_tokenizers_name_the_field() {
        let d = tempfile::tempdir().unwrap();
        let cases = [
            (json!({"type": "Whitespace"}), "pre_tokenizer"),
            (json!({"type": "Metaspace"}), "SentencePiece"),
            (
                json!({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "x"}}, {"type": "ByteLevel"}]}),
                "split pattern",
            ),
        ];
        for (pre, want) in cases {
            write(d.path(), "tokenizer.json", &byte_level(pre));
            let e = tokenizer_metadata(d.path(), 8, &Value::Null)
                .map_err(|e| flexinfer_contract::error::chain(&e))
                .unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let mut wordpiece = byte_level(json!({"type": "ByteLevel"}));
        wordpiece["model"]["type"] = json!("WordPiece");
        write(d.path(), "tokenizer.json", &wordpiece);
        let e = tokenizer_metadata(d.path(), 8, &Value::Null)
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err();
        assert!(e.contains("model.type") && e.contains("WordPiece"), "{e}");
        write(
            d.path(),
            "tokenizer.json",
            &byte_level(json!({"type": "ByteLevel"})),
        );
        let e = tokenizer_metadata(d.path(), 4, &Value::Null)
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err();
        assert!(e.contains("vocab_size 4"), "{e}");
        std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
        let e = tokenizer_metadata(d.path(), 8, &Value::Null)
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err();
        assert!(e.contains("tokenizer.json") && e.contains("missing"), "{e}");
    }
}
