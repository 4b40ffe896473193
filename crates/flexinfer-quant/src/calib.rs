//! Calibration data: a local JSONL, JSONL.zst, parquet or plain-text file, tokenized with the model's `tokenizer.json`.

use crate::error::{QuantError, Result};
use flexinfer_fsutil::limits;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// Calibration settings (`MAX_SAMPLES`, `MAX_SEQ_LEN`).
#[derive(Clone, Debug)]
pub struct CalibSettings {
    pub max_samples: usize,
    pub max_seq_len: usize,
}

/// Text fields tried in order for JSONL records.
const TEXT_FIELDS: [&str; 4] = ["text", "content", "prompt", "document"];

fn open_reader(path: &Path) -> Result<Box<dyn BufRead>> {
    let file = flexinfer_fsutil::open_regular(path).map_err(|e| {
        QuantError::Input(format!(
            "calibration dataset {} cannot be opened: {e}",
            path.display()
        ))
    })?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    if name.ends_with(".zst") {
        let dec = zstd::stream::read::Decoder::new(file).map_err(|e| QuantError::io(path, e))?;
        Ok(Box::new(BufReader::new(dec)))
    } else {
        Ok(Box::new(BufReader::new(file)))
    }
}

fn record_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => {
            for f in TEXT_FIELDS {
                if let Some(Value::String(s)) = o.get(f) {
                    return Some(s.clone());
                }
            }
            // Chat records: concatenate message contents.
            if let Some(Value::Array(msgs)) = o.get("messages") {
                let parts: Vec<&str> = msgs
                    .iter()
                    .filter_map(|m| m.get("content").and_then(Value::as_str))
                    .collect();
                if !parts.is_empty() {
                    return Some(parts.join("\n"));
                }
            }
            None
        }
        _ => None,
    }
}

/// Up to `max_rows` rows of a parquet file (the format hub datasets ship in), each as a JSON object
/// keyed by column name, so the JSONL field rules apply to them unchanged.
pub fn read_parquet_records(path: &Path, max_rows: usize) -> Result<Vec<Value>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let bad = |e: &dyn std::fmt::Display| {
        QuantError::Input(format!(
            "dataset {}: not a readable parquet file: {e}",
            path.display()
        ))
    };
    let file =
        flexinfer_fsutil::open_regular(path).map_err(|e| crate::fsutil::untrusted_err(path, e))?;
    let reader = SerializedFileReader::new(file).map_err(|e| bad(&e))?;
    let rows = reader.get_row_iter(None).map_err(|e| bad(&e))?;
    let mut out = Vec::new();
    for row in rows.take(max_rows) {
        out.push(row.map_err(|e| bad(&e))?.to_json_value());
    }
    Ok(out)
}

/// Reads up to `max_texts` non-empty texts. JSONL when the name contains `.jsonl`/`.json`, else plain text where
/// blank lines separate documents.
pub fn read_texts(path: &Path, max_texts: usize) -> Result<Vec<String>> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    if name.ends_with(".parquet") {
        let mut texts = Vec::new();
        for v in read_parquet_records(path, usize::MAX)? {
            if let Some(t) = record_text(&v) {
                if !t.trim().is_empty() {
                    texts.push(t);
                }
            }
            if texts.len() >= max_texts {
                break;
            }
        }
        return Ok(texts);
    }
    let mut reader = open_reader(path)?;
    let mut texts = Vec::new();
    if name.contains(".jsonl") || name.contains(".json") {
        let shown = format!("calibration dataset {}", path.display());
        let mut line = String::new();
        for i in 0usize.. {
            let n = flexinfer_fsutil::read_line_limited(
                &mut reader,
                &mut line,
                limits::JSON_LINE,
                &shown,
                i.saturating_add(1),
            )
            .map_err(|e| QuantError::Input(format!("{shown}: {e}")))?;
            if n == 0 {
                break;
            }
            if line.trim().is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(&line).map_err(|e| {
                QuantError::Input(format!(
                    "calibration dataset {} line {}: invalid JSON: {e}",
                    path.display(),
                    i + 1
                ))
            })?;
            if let Some(t) = record_text(&v) {
                if !t.trim().is_empty() {
                    texts.push(t);
                }
            }
            if texts.len() >= max_texts {
                break;
            }
        }
    } else {
        let all = flexinfer_fsutil::read_limited(
            reader,
            limits::DATASET,
            &format!("calibration dataset {}", path.display()),
        )
        .map_err(|e| QuantError::Input(e.to_string()))?;
        let all = String::from_utf8(all).map_err(|_| {
            QuantError::Input(format!(
                "calibration dataset {} is not UTF-8 text",
                path.display()
            ))
        })?;
        for doc in all.split("\n\n") {
            if !doc.trim().is_empty() {
                texts.push(doc.trim().to_string());
            }
            if texts.len() >= max_texts {
                break;
            }
        }
    }
    Ok(texts)
}

/// Token ids of each calibration sample, truncated to `max_seq_len`, at most `max_samples` samples.
/// A loaded `tokenizer.json`.
pub use tokenizers::pipeline::PipelineTokenizer as Tokenizer;

/// The model directory's `tokenizer.json` (hub files written by older tokenizers versions go through the
/// canonicalising converter first).
pub fn load_tokenizer(model_dir: &Path) -> Result<Tokenizer> {
    let tok_path = model_dir.join("tokenizer.json");
    if tok_path.symlink_metadata().is_err() {
        return Err(QuantError::Input(format!(
            "tokenizer.json not found in model directory {}",
            model_dir.display()
        )));
    }
    let text = flexinfer_fsutil::read_string_within(model_dir, "tokenizer.json", limits::TOKENIZER)
        .map_err(|e| crate::fsutil::untrusted_err(&tok_path, e))?;
    match tokenizers::from_json(&text) {
        Ok(t) => Ok(t),
        Err(first) => {
            let canonical = tokenizers::canonicalize_str(&text).map_err(|e| {
                QuantError::Tokenizer(format!(
                    "{}: {first}; conversion failed: {e}",
                    tok_path.display()
                ))
            })?;
            tokenizers::from_json(&canonical)
                .map_err(|e| QuantError::Tokenizer(format!("{}: {e}", tok_path.display())))
        }
    }
}

/// Token ids of `text` (no special tokens added); errors say "encoding `what`".
pub fn encode(tokenizer: &Tokenizer, text: &str, what: &str) -> Result<Vec<u32>> {
    let opts = tokenizers::pipeline::EncodeOptions::default();
    let enc = tokenizer
        .encode(text, &opts)
        .wait()
        .map_err(|e| QuantError::Tokenizer(format!("encoding {what}: {e}")))?;
    Ok(enc
        .into_iter()
        .next()
        .map(|first| first.ids().iter().map(|t| t.id()).collect())
        .unwrap_or_default())
}

pub fn load_samples(model_dir: &Path, dataset: &Path, s: &CalibSettings) -> Result<Vec<Vec<u32>>> {
    let tokenizer = load_tokenizer(model_dir)?;
    let texts = read_texts(dataset, s.max_samples)?;
    let mut samples = Vec::new();
    for t in texts {
        let mut ids = encode(&tokenizer, &t, "a calibration sample")?;
        ids.truncate(s.max_seq_len);
        if ids.len() >= 2 {
            samples.push(ids);
        }
    }
    if samples.is_empty() {
        return Err(QuantError::Input(format!(
            "calibration dataset {} yielded no usable samples (empty, or no text field among {TEXT_FIELDS:?})",
            dataset.display()
        )));
    }
    Ok(samples)
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
        let e = read_texts(&p, 2).unwrap_err().to_string();
        assert!(
            e.contains("x.parquet") && e.contains("not a readable parquet file"),
            "{e}"
        );
    }
}
