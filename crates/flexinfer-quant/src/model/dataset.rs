//! Dataset files, read by one reader wherever the workspace uses them: the calibration text of a
//! quantize run ([`CALIBRATION`]) and the prompt sets of an abliteration ([`PROMPTS`]).
//!
//! The format comes from the file name, after an optional `.zst` suffix (the file is then
//! zstd-decompressed), the same for every use:
//! - `.parquet`: each row a JSON object keyed by column name (hub datasets ship in it);
//! - `.jsonl`, or `.json` whose first character is not `[`: one JSON value per line, blank lines
//!   skipped, each line within [`limits::JSON_LINE`];
//! - `.json` whose first character is `[`: one JSON array of values;
//! - `.csv`: a header row naming the columns, then one row per line (RFC 4180 quoting, no embedded
//!   newlines);
//! - anything else: UTF-8 plain text.
//!
//! Whole-file formats (JSON array, CSV, plain text) are read within [`limits::DATASET`]. A value
//! is a string (its text) or an object; what differs between the uses is only which field of an
//! object holds the text and how plain text divides into texts, and that is the use's
//! [`TextRules`], declared side by side below.
// Sizes, head counts and offsets come from untrusted model files: overflow must be an error or
// saturate, never wrap or panic (the numeric kernels are outside the lint).
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

use crate::error::{DatasetError, QuantError, Result};
use flexinfer_fsutil::limits;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// How one use takes texts from the values of a dataset.
#[derive(Clone, Copy, Debug)]
pub struct TextRules {
    /// What the file is called in errors (`calibration dataset`, `prompt dataset`).
    pub what: &'static str,
    /// Fields tried in order for an object (and, case-insensitively, for a CSV header).
    pub fields: &'static [&'static str],
    /// An `instruction` with a non-empty `input` (Alpaca records) is the two joined by a blank line.
    pub join_input: bool,
    /// An object with none of the fields but `messages` (chat records) is its message contents
    /// joined by newlines.
    pub chat_messages: bool,
    /// Texts of values are trimmed (else used as they are, once they are not blank).
    pub trim_values: bool,
    /// Plain text is documents separated by blank lines (else one text a line); each is trimmed.
    pub blank_line_documents: bool,
}

/// Calibration text of a quantize run: documents, used as written.
pub const CALIBRATION: TextRules = TextRules {
    what: "calibration dataset",
    fields: &["text", "content", "prompt", "document"],
    join_input: false,
    chat_messages: true,
    trim_values: false,
    blank_line_documents: true,
};

/// Prompts of an abliteration (refusal and harmless sets): one prompt each, trimmed.
pub const PROMPTS: TextRules = TextRules {
    what: "prompt dataset",
    fields: &[
        "prompt",
        "instruction",
        "text",
        "goal",
        "question",
        "content",
    ],
    join_input: true,
    chat_messages: false,
    trim_values: true,
    blank_line_documents: false,
};

/// The formats of the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Parquet,
    /// JSON lines, or a JSON array when the file starts with `[` (`array_allowed`).
    Json {
        array_allowed: bool,
    },
    Csv,
    Text,
}

/// The format and whether the file is zstd-compressed, from its name.
fn format_of(path: &Path) -> (Format, bool) {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let (stem, zst) = match name.strip_suffix(".zst") {
        Some(s) => (s, true),
        None => (name.as_str(), false),
    };
    let format = if stem.ends_with(".parquet") && !zst {
        Format::Parquet
    } else if stem.ends_with(".jsonl") {
        Format::Json {
            array_allowed: false,
        }
    } else if stem.ends_with(".json") {
        Format::Json {
            array_allowed: true,
        }
    } else if stem.ends_with(".csv") {
        Format::Csv
    } else {
        Format::Text
    };
    (format, zst)
}

/// Up to `max` non-blank texts of the dataset at `path`, taken by `rules`.
pub fn read_texts(path: &Path, max: usize, rules: &TextRules) -> Result<Vec<String>> {
    let mut out = Texts {
        rules,
        max,
        texts: Vec::new(),
    };
    let (format, zst) = format_of(path);
    if format == Format::Parquet {
        for v in read_parquet_records(path, usize::MAX)? {
            if out.full() {
                break;
            }
            out.value(&v);
        }
        return Ok(out.texts);
    }
    let mut reader = open_reader(path, zst, rules)?;
    let shown = format!("{} {}", rules.what, path.display());
    let lines = match format {
        Format::Json { array_allowed } => !(array_allowed && starts_with_bracket(&mut reader)),
        _ => false,
    };
    match format {
        _ if lines => read_json_lines(reader, path, &shown, &mut out)?,
        _ => {
            let text = read_whole(reader, path, rules.what, &shown)?;
            match format {
                Format::Json { .. } => {
                    let v: Value =
                        serde_json::from_str(&text).map_err(|source| DatasetError::Json {
                            what: rules.what,
                            path: path.to_path_buf(),
                            line: None,
                            source,
                        })?;
                    for item in v.as_array().into_iter().flatten() {
                        if out.full() {
                            break;
                        }
                        out.value(item);
                    }
                }
                Format::Csv => csv_texts(&text, path, &mut out)?,
                _ => out.plain_text(&text),
            }
        }
    }
    Ok(out.texts)
}

/// Up to `max_rows` rows of a parquet file, each as a JSON object keyed by column name, so the rules
/// of JSON values apply to them unchanged.
pub fn read_parquet_records(path: &Path, max_rows: usize) -> Result<Vec<Value>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let bad = |source| DatasetError::Parquet {
        path: path.to_path_buf(),
        source,
    };
    let file =
        flexinfer_fsutil::open_regular(path).map_err(|e| crate::fsutil::untrusted_err(path, e))?;
    let reader = SerializedFileReader::new(file).map_err(bad)?;
    let rows = reader.get_row_iter(None).map_err(bad)?;
    let mut out = Vec::new();
    for row in rows.take(max_rows) {
        out.push(row.map_err(bad)?.to_json_value());
    }
    Ok(out)
}

/// The texts found so far, at most `max`.
struct Texts<'a> {
    rules: &'a TextRules,
    max: usize,
    texts: Vec<String>,
}

impl Texts<'_> {
    fn full(&self) -> bool {
        self.texts.len() >= self.max
    }

    /// A text unless it is blank (trimmed when the rules say so).
    fn push(&mut self, t: String, trim: bool) {
        if self.full() || t.trim().is_empty() {
            return;
        }
        self.texts.push(if trim { t.trim().to_string() } else { t });
    }

    /// The text of one JSON value, if it has one.
    fn value(&mut self, v: &Value) {
        if let Some(t) = value_text(v, self.rules) {
            self.push(t, self.rules.trim_values);
        }
    }

    fn plain_text(&mut self, text: &str) {
        if self.rules.blank_line_documents {
            for doc in text.split("\n\n") {
                self.push(doc.to_string(), true);
            }
        } else {
            for line in text.lines() {
                self.push(line.to_string(), true);
            }
        }
    }
}

/// The text of a string, or of the first of the rules' fields an object has as a string.
fn value_text(v: &Value, rules: &TextRules) -> Option<String> {
    let o = match v {
        Value::String(s) => return Some(s.clone()),
        Value::Object(o) => o,
        _ => return None,
    };
    for &f in rules.fields {
        if let Some(Value::String(s)) = o.get(f) {
            if rules.join_input && f == "instruction" {
                if let Some(Value::String(input)) = o.get("input") {
                    if !input.trim().is_empty() {
                        return Some(format!("{s}\n\n{input}"));
                    }
                }
            }
            return Some(s.clone());
        }
    }
    if rules.chat_messages {
        if let Some(Value::Array(msgs)) = o.get("messages") {
            let parts: Vec<&str> = msgs
                .iter()
                .filter_map(|m| m.get("content").and_then(Value::as_str))
                .collect();
            if !parts.is_empty() {
                return Some(parts.join("\n"));
            }
        }
    }
    None
}

fn open_reader(path: &Path, zst: bool, rules: &TextRules) -> Result<Box<dyn BufRead>> {
    let file = flexinfer_fsutil::open_regular(path).map_err(|source| DatasetError::Open {
        what: rules.what,
        path: path.to_path_buf(),
        source,
    })?;
    if zst {
        let dec = zstd::stream::read::Decoder::new(file).map_err(|e| QuantError::io(path, e))?;
        Ok(Box::new(BufReader::new(dec)))
    } else {
        Ok(Box::new(BufReader::new(file)))
    }
}

/// Whether the first character of the stream (within its first buffer) is `[`; consumes nothing.
fn starts_with_bracket(r: &mut Box<dyn BufRead>) -> bool {
    r.fill_buf()
        .ok()
        .and_then(|b| b.iter().find(|c| !c.is_ascii_whitespace()).copied())
        == Some(b'[')
}

fn read_json_lines(
    mut reader: Box<dyn BufRead>,
    path: &Path,
    shown: &str,
    out: &mut Texts<'_>,
) -> Result<()> {
    let mut line = String::new();
    for i in 0usize.. {
        if out.full() {
            break;
        }
        let n = flexinfer_fsutil::read_line_limited(
            &mut reader,
            &mut line,
            limits::JSON_LINE,
            shown,
            i.saturating_add(1),
        )
        .map_err(|source| DatasetError::Line {
            what: out.rules.what,
            path: path.to_path_buf(),
            line: i.saturating_add(1),
            source,
        })?;
        if n == 0 {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line).map_err(|source| DatasetError::Json {
            what: out.rules.what,
            path: path.to_path_buf(),
            line: Some(i.saturating_add(1)),
            source,
        })?;
        out.value(&v);
    }
    Ok(())
}

fn read_whole(
    reader: Box<dyn BufRead>,
    path: &Path,
    what: &'static str,
    shown: &str,
) -> Result<String> {
    let all = flexinfer_fsutil::read_limited(reader, limits::DATASET, shown)
        .map_err(|source| DatasetError::Read { source })?;
    String::from_utf8(all).map_err(|source| {
        DatasetError::NotUtf8 {
            what,
            path: path.to_path_buf(),
            source,
        }
        .into()
    })
}

/// The column of the first of the rules' fields the header names, then that column of each row.
fn csv_texts(text: &str, path: &Path, out: &mut Texts<'_>) -> Result<()> {
    let mut lines = text.lines();
    let header = csv_fields(lines.next().unwrap_or(""));
    let fields = out.rules.fields;
    let col = fields
        .iter()
        .find_map(|f| header.iter().position(|h| h.trim().eq_ignore_ascii_case(f)))
        .ok_or_else(|| DatasetError::CsvHeader {
            what: out.rules.what,
            path: path.to_path_buf(),
            fields,
        })?;
    for line in lines {
        if out.full() {
            break;
        }
        if let Some(v) = csv_fields(line).into_iter().nth(col) {
            out.push(v, true);
        }
    }
    Ok(())
}

/// Splits one CSV line (RFC 4180 quoting, no embedded newlines).
fn csv_fields(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut cur)),
            (c, _) => cur.push(c),
        }
    }
    out.push(cur);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_come_from_the_name_for_every_use() {
        for (name, format, zst) in [
            ("a.parquet", Format::Parquet, false),
            (
                "a.JSONL",
                Format::Json {
                    array_allowed: false,
                },
                false,
            ),
            (
                "a.jsonl.zst",
                Format::Json {
                    array_allowed: false,
                },
                true,
            ),
            (
                "a.json",
                Format::Json {
                    array_allowed: true,
                },
                false,
            ),
            ("a.csv", Format::Csv, false),
            ("a.txt.zst", Format::Text, true),
            ("a", Format::Text, false),
        ] {
            assert_eq!(format_of(Path::new(name)), (format, zst), "{name}");
        }
    }

    #[test]
    fn the_same_file_gives_each_use_its_field() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.json");
        std::fs::write(
            &p,
            r#"[{"prompt": " p ", "text": " t "}, {"messages": [{"content": "m1"}, {"content": "m2"}]}]"#,
        )
        .unwrap();
        assert_eq!(read_texts(&p, 10, &CALIBRATION).unwrap(), [" t ", "m1\nm2"]);
        assert_eq!(read_texts(&p, 10, &PROMPTS).unwrap(), ["p"]);
        let c = d.path().join("b.csv");
        std::fs::write(&c, "id,Text\n1,first\n2,\"second, quoted\"\n").unwrap();
        assert_eq!(
            read_texts(&c, 10, &CALIBRATION).unwrap(),
            ["first", "second, quoted"]
        );
        assert_eq!(read_texts(&c, 1, &PROMPTS).unwrap(), ["first"]);
        std::fs::write(&c, "id,other\n1,x\n").unwrap();
        let e = read_texts(&c, 10, &CALIBRATION)
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err();
        assert!(
            e.contains("calibration dataset") && e.contains("none of the columns"),
            "{e}"
        );
    }
}
