//! Prompt datasets (local files or hub datasets fetched under `$MODEL_DIR/.datasets`), the chat
//! template, and tokenization (through the quantization engine's tokenizer loading, so both phases
//! tokenize the same way).

use std::io::Write;
use std::path::Path;

use flexinfer_fsutil::limits;
use flexinfer_quant::calib::{load_samples, CalibSettings};
use flexinfer_quant::model::dataset;
use serde_json::Value;

use crate::common::{AbliterateError, ExitKind, WorkerError};

/// Fields tried, in order, for a prompt in a JSON record or a CSV header.
pub const PROMPT_FIELDS: &[&str] = dataset::PROMPTS.fields;

/// Up to `max` non-empty prompts of a dataset file: JSONL (one string or object per line; fields
/// [`PROMPT_FIELDS`]), a JSON array, CSV with a header naming one of those fields, parquet, or
/// plain text with one prompt per line; read by the engine's dataset reader with its
/// [`dataset::PROMPTS`] rules (formats in [`flexinfer_quant::model::dataset`]).
pub fn read_prompts(path: &Path, max: usize) -> Result<Vec<String>, WorkerError> {
    dataset::read_texts(path, max, &dataset::PROMPTS).map_err(WorkerError::wrap(ExitKind::BadInput))
}

/// Chat formats recognized in a tokenizer's `chat_template`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatFormat {
    /// No template: prompts are used as they are.
    Raw,
    /// `<|im_start|>user … <|im_end|> <|im_start|>assistant` (Qwen, many others).
    ChatMl,
    /// `<|start_header_id|>user<|end_header_id|> … <|eot_id|>` (Llama 3).
    Llama3,
    /// `<start_of_turn>user … <end_of_turn> <start_of_turn>model` (Gemma 2, Gemma 3).
    Gemma,
    /// `<|turn>user … <turn|> <|turn>model` (Gemma 4).
    Gemma4,
    /// `[INST] … [/INST]` (Llama 2, Mistral).
    Inst,
    /// `<|user|> … <|end|> <|assistant|>` (Phi-3).
    Phi3,
}

impl ChatFormat {
    /// Recognizes the role/content structure of a Jinja chat template by its markers.
    pub fn detect(template: &str) -> Option<ChatFormat> {
        let t = template;
        if t.contains("<|im_start|>") {
            Some(ChatFormat::ChatMl)
        } else if t.contains("<|start_header_id|>") {
            Some(ChatFormat::Llama3)
        } else if t.contains("<|turn>") {
            Some(ChatFormat::Gemma4)
        } else if t.contains("<start_of_turn>") {
            Some(ChatFormat::Gemma)
        } else if t.contains("[INST]") {
            Some(ChatFormat::Inst)
        } else if t.contains("<|user|>") && t.contains("<|assistant|>") {
            Some(ChatFormat::Phi3)
        } else {
            None
        }
    }

    /// One user turn followed by the generation prompt of the assistant.
    pub fn apply(self, prompt: &str) -> String {
        match self {
            ChatFormat::Raw => prompt.to_string(),
            ChatFormat::ChatMl => {
                format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
            }
            ChatFormat::Llama3 => format!(
                "<|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
            ),
            ChatFormat::Gemma => {
                format!("<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n")
            }
            ChatFormat::Gemma4 => format!("<|turn>user\n{prompt}<turn|>\n<|turn>model\n"),
            ChatFormat::Inst => format!("[INST] {prompt} [/INST]"),
            ChatFormat::Phi3 => format!("<|user|>\n{prompt}<|end|>\n<|assistant|>\n"),
        }
    }
}

/// The model's chat template (`tokenizer_config.json` `chat_template`, or `chat_template.jinja`).
pub fn chat_template(model_dir: &Path) -> Option<String> {
    let read = |name: &str| {
        flexinfer_fsutil::read_string_within(model_dir, name, limits::TOKENIZER)
            .map_err(|e| {
                if flexinfer_fsutil::is_refused(&e) {
                    tracing::warn!(error = %e, "chat template file refused");
                }
            })
            .ok()
    };
    if let Some(text) = read("tokenizer_config.json") {
        if let Ok(v) = serde_json::from_str::<Value>(&text) {
            match v.get("chat_template") {
                Some(Value::String(s)) => return Some(s.clone()),
                Some(Value::Array(list)) => {
                    let pick = list
                        .iter()
                        .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                        .or(list.first());
                    if let Some(s) = pick.and_then(|t| t.get("template")).and_then(Value::as_str) {
                        return Some(s.to_string());
                    }
                }
                _ => {}
            }
        }
    }
    read("chat_template.jinja")
}

/// Tokenized prompt sets.
#[derive(Debug, Clone)]
pub struct PromptSets {
    /// Refusal prompts in the chat format.
    pub refusal: Vec<Vec<u32>>,
    /// Harmless prompts in the chat format.
    pub harmless: Vec<Vec<u32>>,
    /// Harmless prompts as plain text, for the perplexity gate.
    pub ppl: Vec<Vec<u32>>,
    pub format: ChatFormat,
    pub warnings: Vec<String>,
}

/// Token ids of each text, at most `max_seq_len` each: the *last* tokens when `keep_end` (so a
/// chat prompt keeps its generation prompt), else the first.
fn tokenize(
    model_dir: &Path,
    texts: &[String],
    max_seq_len: usize,
    keep_end: bool,
) -> Result<Vec<Vec<u32>>, WorkerError> {
    let dir = tempfile::tempdir().map_err(WorkerError::io(
        ExitKind::Failure,
        "cannot create a temporary directory",
    ))?;
    let path = dir.path().join("prompts.jsonl");
    let mut f = std::fs::File::create(&path).map_err(|e| super::io_err(&path, e))?;
    for t in texts {
        let line = serde_json::json!({ "text": t }).to_string();
        writeln!(f, "{line}").map_err(|e| super::io_err(&path, e))?;
    }
    drop(f);
    let settings = CalibSettings {
        max_samples: texts.len(),
        max_seq_len: usize::MAX,
    };
    let max = max_seq_len.max(2);
    let mut out = load_samples(model_dir, &path, &settings).map_err(super::quant_err)?;
    for ids in out.iter_mut().filter(|ids| ids.len() > max) {
        if keep_end {
            ids.drain(..ids.len() - max);
        } else {
            ids.truncate(max);
        }
    }
    Ok(out)
}

/// Reads, templates and tokenizes both prompt sets (`n` prompts each).
pub fn load_prompt_sets(
    model_dir: &Path,
    refusal: &Path,
    harmless: &Path,
    n: usize,
    max_seq_len: usize,
) -> Result<PromptSets, WorkerError> {
    let r = read_prompts(refusal, n)?;
    let h = read_prompts(harmless, n)?;
    for (set, path) in [(&r, refusal), (&h, harmless)] {
        if set.is_empty() {
            return Err(AbliterateError::NoPrompts {
                path: path.to_path_buf(),
                fields: PROMPT_FIELDS,
            }
            .into());
        }
    }
    let mut warnings = Vec::new();
    for (set, what) in [(&r, "refusal"), (&h, "harmless")] {
        if set.len() < n {
            warnings.push(format!(
                "the {what} dataset has only {} prompts (numSamples {n})",
                set.len()
            ));
        }
    }
    let format = match chat_template(model_dir) {
        None => ChatFormat::Raw,
        Some(t) => ChatFormat::detect(&t).unwrap_or_else(|| {
            warnings.push(
                "the chat template is not one of the recognized formats (ChatML, Llama 3, Gemma, [INST], Phi-3); \
                 prompts are used without it"
                    .into(),
            );
            ChatFormat::Raw
        }),
    };
    let templ = |v: &[String]| v.iter().map(|p| format.apply(p)).collect::<Vec<_>>();
    Ok(PromptSets {
        refusal: tokenize(model_dir, &templ(&r), max_seq_len, true)?,
        harmless: tokenize(model_dir, &templ(&h), max_seq_len, true)?,
        ppl: tokenize(model_dir, &h, max_seq_len, false)?,
        format,
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_jsonl_csv_json_and_text() {
        let d = tempfile::tempdir().unwrap();
        let j = d.path().join("a.jsonl");
        std::fs::write(
            &j,
            "{\"instruction\":\"do x\",\"input\":\"with y\"}\n\n\"plain\"\n{\"goal\":\"g\"}\n{\"other\":1}\n",
        )
        .unwrap();
        assert_eq!(
            read_prompts(&j, 10).unwrap(),
            vec!["do x\n\nwith y", "plain", "g"]
        );
        assert_eq!(read_prompts(&j, 1).unwrap().len(), 1);
        let c = d.path().join("b.csv");
        std::fs::write(&c, "goal,target\n\"a, \"\"quoted\"\"\",t\nb,t\n").unwrap();
        assert_eq!(read_prompts(&c, 10).unwrap(), vec!["a, \"quoted\"", "b"]);
        let a = d.path().join("c.json");
        std::fs::write(&a, "[{\"prompt\":\"p1\"},\"p2\"]").unwrap();
        assert_eq!(read_prompts(&a, 10).unwrap(), vec!["p1", "p2"]);
        let t = d.path().join("d.txt");
        std::fs::write(&t, "one\n\n two \n").unwrap();
        assert_eq!(read_prompts(&t, 10).unwrap(), vec!["one", "two"]);
        let p = d.path().join("e.parquet");
        std::fs::write(&p, "x").unwrap();
        assert!(read_prompts(&p, 10)
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err()
            .contains("not a readable parquet file"));
    }

    #[test]
    fn parquet_prompt_sets_are_read() {
        use parquet::data_type::{ByteArray, ByteArrayType};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        use parquet::schema::parser::parse_message_type;
        use std::sync::Arc;
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(".datasets/org/prompts/data");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("train-00000-of-00001.parquet");
        let schema =
            Arc::new(parse_message_type("message m { REQUIRED BYTE_ARRAY text (UTF8); }").unwrap());
        let mut w = SerializedFileWriter::new(
            std::fs::File::create(&p).unwrap(),
            schema,
            Arc::new(WriterProperties::builder().build()),
        )
        .unwrap();
        let mut rg = w.next_row_group().unwrap();
        let mut c = rg.next_column().unwrap().unwrap();
        let vals: Vec<ByteArray> = ["p one", "", "p two"]
            .iter()
            .map(|t| ByteArray::from(*t))
            .collect();
        c.typed::<ByteArrayType>()
            .write_batch(&vals, None, None)
            .unwrap();
        c.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();
        let found = crate::datasets::resolve("org/prompts", d.path(), "refusal").unwrap();
        assert_eq!(found, p);
        assert_eq!(read_prompts(&found, 10).unwrap(), vec!["p one", "p two"]);
    }

    #[test]
    fn resolves_hub_ids_under_the_datasets_dir() {
        let d = tempfile::tempdir().unwrap();
        let ds = d.path().join(".datasets/org/set/data");
        std::fs::create_dir_all(&ds).unwrap();
        std::fs::write(ds.join("train.jsonl"), "\"x\"\n").unwrap();
        let p = crate::datasets::resolve("org/set", d.path(), "refusal").unwrap();
        assert!(p.ends_with("data/train.jsonl"));
        let e = crate::datasets::resolve("org/missing", d.path(), "refusal").unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(flexinfer_contract::error::chain(&e).contains("refusal dataset"));
    }

    #[test]
    fn chat_formats() {
        assert_eq!(
            ChatFormat::detect("{% for m in messages %}<|im_start|>{{m.role}}"),
            Some(ChatFormat::ChatMl)
        );
        assert_eq!(
            ChatFormat::detect("<start_of_turn>{{ role }}"),
            Some(ChatFormat::Gemma)
        );
        assert_eq!(
            ChatFormat::detect("{{ bos_token }}{{ '<|turn>' + role + '\\n' }}<start_of_turn>"),
            Some(ChatFormat::Gemma4)
        );
        assert_eq!(
            ChatFormat::Gemma4.apply("hi"),
            "<|turn>user\nhi<turn|>\n<|turn>model\n"
        );
        assert_eq!(ChatFormat::detect("{{ messages }}"), None);
        assert_eq!(
            ChatFormat::ChatMl.apply("hi"),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(ChatFormat::Llama3
            .apply("hi")
            .ends_with("assistant<|end_header_id|>\n\n"));
    }
}
