//! Calibration data: a local dataset file (JSONL, JSON, CSV, parquet or plain text, optionally
//! zstd-compressed; read by [`super::dataset`]), tokenized with the model's `tokenizer.json`.
// Sizes, head counts and offsets come from untrusted model files: overflow must be an error or
// saturate, never wrap or panic (the numeric kernels are outside the lint).
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

use super::dataset;
use crate::error::{BoxError, DatasetError, Result, TokenizerError};
use flexinfer_fsutil::limits;
use serde_json::Value;
use std::path::Path;

/// Calibration settings (`MAX_SAMPLES`, `MAX_SEQ_LEN`).
#[derive(Clone, Debug)]
pub struct CalibSettings {
    pub max_samples: usize,
    pub max_seq_len: usize,
}

pub use super::dataset::read_parquet_records;

/// Reads up to `max_texts` non-blank calibration texts ([`dataset::CALIBRATION`] rules; formats in
/// [`super::dataset`]).
pub fn read_texts(path: &Path, max_texts: usize) -> Result<Vec<String>> {
    dataset::read_texts(path, max_texts, &dataset::CALIBRATION)
}

/// Token ids of each calibration sample, truncated to `max_seq_len`, at most `max_samples` samples.
/// A loaded `tokenizer.json`.
pub use tokenizers::pipeline::PipelineTokenizer as Tokenizer;

/// The model directory's `tokenizer.json` (hub files written by older tokenizers versions go through the
/// canonicalising converter first).
pub fn load_tokenizer(model_dir: &Path) -> Result<Tokenizer> {
    let tok_path = model_dir.join("tokenizer.json");
    crate::fsutil::require_in_model_dir(model_dir, "tokenizer.json")?;
    let text = flexinfer_fsutil::read_string_within(model_dir, "tokenizer.json", limits::TOKENIZER)
        .map_err(|e| crate::fsutil::untrusted_err(&tok_path, e))?;
    match tokenizers::from_json(&text) {
        Ok(t) => Ok(t),
        Err(first) => {
            let canonical =
                tokenizers::canonicalize_str(&text).map_err(|source| TokenizerError::Convert {
                    path: tok_path.clone(),
                    first,
                    source,
                })?;
            tokenizers::from_json(&canonical).map_err(|source| {
                TokenizerError::Load {
                    path: tok_path,
                    source,
                }
                .into()
            })
        }
    }
}

/// Token ids of `text` (no special tokens added); errors say "encoding `what`".
pub fn encode(tokenizer: &Tokenizer, text: &str, what: &str) -> Result<Vec<u32>> {
    let opts = tokenizers::pipeline::EncodeOptions::default();
    let enc = tokenizer
        .encode(text, &opts)
        .wait()
        .map_err(|source| TokenizerError::Encode {
            what: what.to_string(),
            source,
        })?;
    Ok(enc
        .into_iter()
        .next()
        .map(|first| first.ids().iter().map(|t| t.id()).collect())
        .unwrap_or_default())
}

/// GPT-2's byte-level alphabet: the symbol that stands for each byte in a byte-level BPE vocabulary.
pub fn byte_level_symbols() -> [char; 256] {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for (b, slot) in out.iter_mut().enumerate() {
        let b = b as u32;
        let cp = if printable(b) {
            b
        } else {
            n = n.saturating_add(1);
            n.saturating_add(255)
        };
        *slot = char::from_u32(cp).unwrap_or('\0');
    }
    out
}

fn names_byte_level(v: &Value) -> bool {
    match v {
        Value::Object(o) => {
            o.get("type").and_then(Value::as_str) == Some("ByteLevel")
                || o.values().any(names_byte_level)
        }
        Value::Array(a) => a.iter().any(names_byte_level),
        _ => false,
    }
}

/// A byte-level BPE whose vocabulary lacks some of the 256 byte symbols (transformers loads those; the
/// tokenizer crate refuses them at load): the missing symbols are added with fresh ids above every id in
/// the file. Returns the patched document and the added ids with their bytes; `None` when nothing is missing.
pub fn add_missing_byte_symbols(doc: &Value) -> Option<(Value, Vec<(u32, u8)>)> {
    let model = doc.get("model")?;
    if model.get("type").and_then(Value::as_str) != Some("BPE") {
        return None;
    }
    let byte_level = model
        .get("byte_level")
        .and_then(Value::as_bool)
        .unwrap_or(false)
        || names_byte_level(doc.get("pre_tokenizer").unwrap_or(&Value::Null))
        || names_byte_level(doc.get("decoder").unwrap_or(&Value::Null));
    let vocab = model.get("vocab")?.as_object()?;
    if !byte_level {
        return None;
    }
    let added_max = doc
        .get("added_tokens")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|t| t.get("id").and_then(Value::as_u64))
                .max()
                .unwrap_or(0)
        })
        .unwrap_or(0);
    let vocab_max = vocab.values().filter_map(Value::as_u64).max().unwrap_or(0);
    let mut next = u32::try_from(vocab_max.max(added_max))
        .ok()?
        .checked_add(1)?;
    let mut added = Vec::new();
    let mut patched_vocab = vocab.clone();
    for (b, sym) in byte_level_symbols().iter().enumerate() {
        let key = sym.to_string();
        if !patched_vocab.contains_key(&key) {
            patched_vocab.insert(key, Value::from(next));
            added.push((next, b as u8));
            next = next.checked_add(1)?;
        }
    }
    if added.is_empty() {
        return None;
    }
    let mut patched = doc.clone();
    patched["model"]["vocab"] = Value::Object(patched_vocab);
    Some((patched, added))
}

/// A calibration tokenizer: the model's `tokenizer.json`, plus the ids of byte symbols its vocabulary lacked
/// (a sample that needs one of them cannot be encoded as the model would).
pub struct CalibTokenizer {
    pub tokenizer: Tokenizer,
    /// Added id → the byte it stands for.
    pub missing_bytes: Vec<(u32, u8)>,
}

/// Like [`load_tokenizer`], but a byte-level BPE lacking some byte symbols loads (see
/// [`add_missing_byte_symbols`]).
pub fn load_calib_tokenizer(model_dir: &Path) -> Result<CalibTokenizer> {
    match load_tokenizer(model_dir) {
        Ok(tokenizer) => Ok(CalibTokenizer {
            tokenizer,
            missing_bytes: Vec::new(),
        }),
        Err(first) => {
            let tok_path = model_dir.join("tokenizer.json");
            let text = flexinfer_fsutil::read_string_within(
                model_dir,
                "tokenizer.json",
                limits::TOKENIZER,
            )
            .map_err(|e| crate::fsutil::untrusted_err(&tok_path, e))?;
            let Ok(doc) = serde_json::from_str::<Value>(&text) else {
                return Err(first);
            };
            let Some((patched, missing_bytes)) = add_missing_byte_symbols(&doc) else {
                return Err(first);
            };
            let patched = patched.to_string();
            let tokenizer = tokenizers::from_json(&patched)
                .or_else(|_| {
                    tokenizers::canonicalize_str(&patched)
                        .map_err(BoxError::from)
                        .and_then(|c| tokenizers::from_json(&c))
                })
                .map_err(|source| TokenizerError::ByteSymbols {
                    path: tok_path,
                    first: Box::new(first),
                    source,
                })?;
            Ok(CalibTokenizer {
                tokenizer,
                missing_bytes,
            })
        }
    }
}

/// Tokenized calibration samples.
#[derive(Clone, Debug, Default)]
pub struct Samples {
    pub ids: Vec<Vec<u32>>,
    /// Samples left out because their text needs a byte the tokenizer's vocabulary lacks.
    pub skipped_unencodable: usize,
}

pub fn load_samples(model_dir: &Path, dataset: &Path, s: &CalibSettings) -> Result<Vec<Vec<u32>>> {
    Ok(load_samples_counted(model_dir, dataset, s)?.ids)
}

/// Token ids of each calibration sample; a sample whose text needs a byte symbol missing from a byte-level
/// vocabulary is skipped and counted. When every sample is skipped, the error names the first one.
pub fn load_samples_counted(
    model_dir: &Path,
    dataset: &Path,
    s: &CalibSettings,
) -> Result<Samples> {
    let ct = load_calib_tokenizer(model_dir)?;
    let texts = read_texts(dataset, s.max_samples)?;
    let mut out = Samples::default();
    let mut first_bad: Option<(usize, Vec<u8>)> = None;
    for (i, t) in texts.iter().enumerate() {
        let mut ids = encode(
            &ct.tokenizer,
            t,
            &format!("calibration sample {}", i.saturating_add(1)),
        )?;
        let needs: Vec<u8> = ct
            .missing_bytes
            .iter()
            .filter(|(id, _)| ids.contains(id))
            .map(|&(_, b)| b)
            .collect();
        if !needs.is_empty() {
            out.skipped_unencodable = out.skipped_unencodable.saturating_add(1);
            first_bad.get_or_insert((i.saturating_add(1), needs));
            continue;
        }
        ids.truncate(s.max_seq_len);
        if ids.len() >= 2 {
            out.ids.push(ids);
        }
    }
    if out.ids.is_empty() {
        if let Some((i, bytes)) = first_bad {
            return Err(DatasetError::Unencodable {
                path: dataset.to_path_buf(),
                sample: i,
                bytes,
                skipped: out.skipped_unencodable,
            }
            .into());
        }
        return Err(DatasetError::NoSamples {
            path: dataset.to_path_buf(),
            fields: dataset::CALIBRATION.fields,
        }
        .into());
    }
    Ok(out)
}

#[cfg(test)]
mod byte_level_tests {
    use super::*;
    use serde_json::json;

    /// A byte-level BPE over the symbols of `bytes` only, no merges.
    fn write_partial_byte_bpe(dir: &Path, bytes: &[u8]) {
        let syms = byte_level_symbols();
        let vocab: serde_json::Map<String, Value> = bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| (syms[b as usize].to_string(), json!(i)))
            .collect();
        let doc = json!({
            "version": "1.0", "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null, "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": []},
        });
        std::fs::write(dir.join("tokenizer.json"), doc.to_string()).unwrap();
    }

    #[test]
    fn alphabet_is_gpt2s() {
        let s = byte_level_symbols();
        assert_eq!(s[b'a' as usize], 'a');
        assert_eq!(s[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(s[b'\n' as usize], '\u{10a}'); // Ċ
        assert_eq!(s[0], '\u{100}');
        let mut sorted: Vec<char> = s.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
    }

    #[test]
    fn missing_byte_symbols_load_and_only_samples_needing_them_are_skipped() {
        let d = tempfile::tempdir().unwrap();
        // Lowercase letters and space only: no digits, no 'é' bytes.
        let mut bytes: Vec<u8> = (b'a'..=b'z').collect();
        bytes.push(b' ');
        write_partial_byte_bpe(d.path(), &bytes);
        let ct = load_calib_tokenizer(d.path()).unwrap();
        assert_eq!(ct.missing_bytes.len(), 256 - 27);
        let ds = d.path().join("calib.jsonl");
        std::fs::write(
            &ds,
            "{\"text\": \"plain words only\"}\n{\"text\": \"café 1\"}\n{\"text\": \"more plain words\"}\n",
        )
        .unwrap();
        let s = load_samples_counted(
            d.path(),
            &ds,
            &CalibSettings {
                max_samples: 10,
                max_seq_len: 64,
            },
        )
        .unwrap();
        assert_eq!(s.ids.len(), 2);
        assert_eq!(s.skipped_unencodable, 1);
        assert!(s.ids.iter().flatten().all(|&id| id < 27));
        // Every sample unencodable: the error names the first one and its bytes.
        std::fs::write(&ds, "{\"text\": \"x 42\"}\n").unwrap();
        let e = load_samples_counted(
            d.path(),
            &ds,
            &CalibSettings {
                max_samples: 10,
                max_seq_len: 64,
            },
        )
        .map_err(|e| flexinfer_contract::error::chain(&e))
        .unwrap_err();
        assert!(
            e.contains("sample 1") && e.contains("0x34") && e.contains("0x32"),
            "{e}"
        );
    }

    #[test]
    fn a_complete_byte_level_vocabulary_is_not_patched() {
        let d = tempfile::tempdir().unwrap();
        let all: Vec<u8> = (0..=255).collect();
        write_partial_byte_bpe(d.path(), &all);
        let ct = load_calib_tokenizer(d.path()).unwrap();
        assert!(ct.missing_bytes.is_empty());
    }
}

#[cfg(test)]
mod parquet_tests {
    use super::*;
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    use std::sync::Arc;

    /// Write a one-row-group parquet file with string columns `id` and `text`.
    fn write_parquet(path: &Path, texts: &[&str]) {
        let schema = Arc::new(
            parse_message_type(
                "message m { REQUIRED BYTE_ARRAY id (UTF8); REQUIRED BYTE_ARRAY text (UTF8); }",
            )
            .unwrap(),
        );
        let file = std::fs::File::create(path).unwrap();
        let props = Arc::new(WriterProperties::builder().build());
        let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
        let mut rg = w.next_row_group().unwrap();
        let ids: Vec<ByteArray> = (0..texts.len())
            .map(|i| ByteArray::from(format!("row-{i}").as_str()))
            .collect();
        let vals: Vec<ByteArray> = texts.iter().map(|t| ByteArray::from(*t)).collect();
        for col in [&ids, &vals] {
            let mut c = rg.next_column().unwrap().unwrap();
            c.typed::<ByteArrayType>()
                .write_batch(col, None, None)
                .unwrap();
            c.close().unwrap();
        }
        rg.close().unwrap();
        w.close().unwrap();
    }

    #[test]
    fn parquet_text_column_is_read_like_jsonl() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("train-00000-of-00001.parquet");
        write_parquet(&p, &["first document", "  ", "second document", "third"]);
        let texts = read_texts(&p, 2).unwrap();
        assert_eq!(texts, ["first document", "second document"]);
        let rows = read_parquet_records(&p, 10).unwrap();
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[0]["id"], "row-0");
    }

    #[test]
    fn corrupt_parquet_names_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.parquet");
        std::fs::write(&p, b"PAR1 not really").unwrap();
        let e = read_texts(&p, 2)
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err();
        assert!(
            e.contains("x.parquet") && e.contains("not a readable parquet file"),
            "{e}"
        );
    }
}
