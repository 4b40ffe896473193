//! The model metadata llama.cpp needs before it loads a tensor: `general.architecture` one it knows,
//! the architecture's hyperparameters with the types its loader reads them as (context length,
//! embedding length, block count, head counts, feed-forward length, norm epsilon, rope), the
//! tokenizer (model, tokens, merges for `gpt2`, token types and scores of the vocabulary's length,
//! special token ids inside it), and the shapes that tie them to the tensors (`token_embd.weight` is
//! embedding × vocabulary, every block has tensors and none is beyond the block count).
#![deny(clippy::arithmetic_side_effects)]

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value as Json};

use super::ggml::{file_type_name, ARCHITECTURES, RECURRENT, ROPE_SCALING_TYPES, TOKENIZER_MODELS};
use super::parse::{GgufFile, Value};

/// What the metadata says, for the report.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct ModelMeta {
    pub(crate) architecture: Option<String>,
    pub(crate) file_type: Option<String>,
    pub(crate) summary: BTreeMap<String, Json>,
}

struct Ctx<'a> {
    file: &'a str,
    f: &'a GgufFile,
    defect: &'a mut dyn FnMut(String),
}

impl Ctx<'_> {
    fn bad(&mut self, msg: String) {
        (self.defect)(format!("{}: {msg}", self.file));
    }
    /// A `u32` key (llama.cpp's loader reads these as u32 and refuses other types).
    fn u32_key(&mut self, key: &str, required: bool) -> Option<u64> {
        match self.f.get(key) {
            Some(Value::Uint(v, "u32")) => Some(*v),
            Some(v) => {
                let ty = v.type_name();
                self.bad(format!(
                    "key {key} has type {ty}; llama.cpp reads it as u32"
                ));
                None
            }
            None if required => {
                self.bad(format!("key {key} is missing; llama.cpp needs it"));
                None
            }
            None => None,
        }
    }
    /// A positive u32, or an array of them (per-layer values); returns the scalar.
    fn u32_or_array(&mut self, key: &str, required: bool) -> Option<u64> {
        match self.f.get(key) {
            Some(Value::Array {
                item: "u32" | "i32",
                len,
            }) if *len > 0 => None,
            Some(Value::Array { .. }) => {
                self.bad(format!("key {key} is an empty array or not of u32/i32"));
                None
            }
            _ => self.u32_key(key, required),
        }
    }
    fn f32_key(&mut self, key: &str) -> Option<f64> {
        match self.f.get(key) {
            Some(Value::Float(v, "f32")) => Some(*v),
            Some(v) => {
                let ty = v.type_name();
                self.bad(format!(
                    "key {key} has type {ty}; llama.cpp reads it as f32"
                ));
                None
            }
            None => None,
        }
    }
    fn positive(&mut self, key: &str, v: Option<u64>) -> Option<u64> {
        match v {
            Some(0) => {
                self.bad(format!("key {key} is 0"));
                None
            }
            v => v,
        }
    }
}

/// Checks the model metadata of `f` (the first file of a split model); `tensors` are every tensor's
/// name and dims across the files.
pub(crate) fn check_metadata(
    file: &str,
    f: &GgufFile,
    tensors: &BTreeMap<String, Vec<u64>>,
    defect: &mut dyn FnMut(String),
) -> ModelMeta {
    let mut c = Ctx { file, f, defect };
    let mut meta = ModelMeta::default();
    if let Some(Value::Uint(id, "u32")) = f.get("general.file_type") {
        meta.file_type = Some(
            u32::try_from(*id)
                .ok()
                .and_then(file_type_name)
                .map_or_else(|| format!("unknown ({id})"), str::to_string),
        );
    }
    if let Some(Value::Str(n)) = f.get("general.name") {
        meta.summary.insert("name".into(), json!(n));
    }
    let arch = match f.get("general.architecture") {
        Some(Value::Str(a)) => a.clone(),
        Some(v) => {
            let ty = v.type_name();
            c.bad(format!(
                "key general.architecture has type {ty}, not string"
            ));
            return meta;
        }
        None => {
            c.bad("key general.architecture is missing; llama.cpp needs it".into());
            return meta;
        }
    };
    meta.architecture = Some(arch.clone());
    if !ARCHITECTURES.contains(&arch.as_str()) {
        c.bad(format!(
            "general.architecture {arch:?} is not an architecture llama.cpp loads"
        ));
        return meta;
    }
    let k = |s: &str| format!("{arch}.{s}");
    let ctx_len = c.u32_key(&k("context_length"), true);
    let ctx_len = c.positive(&k("context_length"), ctx_len);
    let embd = c.u32_key(&k("embedding_length"), true);
    let embd = c.positive(&k("embedding_length"), embd);
    let blocks = c.u32_key(&k("block_count"), true);
    let blocks = c.positive(&k("block_count"), blocks);
    let recurrent = RECURRENT.contains(&arch.as_str());
    let heads = c.u32_or_array(&k("attention.head_count"), !recurrent);
    let heads = c.positive(&k("attention.head_count"), heads);
    let heads_kv = c.u32_or_array(&k("attention.head_count_kv"), false);
    let ffn = c.u32_or_array(&k("feed_forward_length"), false);
    let key_len = c.u32_key(&k("attention.key_length"), false);
    let rms = c.f32_key(&k("attention.layer_norm_rms_epsilon"));
    let ln = c.f32_key(&k("attention.layer_norm_epsilon"));
    match rms.or(ln) {
        None if f.get(&k("attention.layer_norm_rms_epsilon")).is_none()
            && f.get(&k("attention.layer_norm_epsilon")).is_none() =>
        {
            c.bad(format!(
                "key {} (or {}) is missing; llama.cpp needs the norm epsilon",
                k("attention.layer_norm_rms_epsilon"),
                k("attention.layer_norm_epsilon")
            ))
        }
        Some(e) if !(e.is_finite() && e > 0.0) => {
            c.bad(format!("norm epsilon {e} is not positive"))
        }
        _ => {}
    }
    if let (Some(h), Some(kv)) = (heads, heads_kv) {
        if kv == 0 || !h.is_multiple_of(kv) {
            c.bad(format!(
                "key {} {kv} does not divide {} {h}",
                k("attention.head_count_kv"),
                k("attention.head_count")
            ));
        }
    }
    if let (Some(e), Some(h), None) = (embd, heads, key_len) {
        if !e.is_multiple_of(h) {
            c.bad(format!(
                "{} {e} is not a multiple of {} {h} (and no {} says the head size)",
                k("embedding_length"),
                k("attention.head_count"),
                k("attention.key_length")
            ));
        }
    }
    let freq_base = c.f32_key(&k("rope.freq_base"));
    if let Some(b) = freq_base.filter(|b| !(b.is_finite() && *b > 0.0)) {
        c.bad(format!("key {} {b} is not positive", k("rope.freq_base")));
    }
    let rope_dims = c.u32_key(&k("rope.dimension_count"), false);
    match f.get(&k("rope.scaling.type")) {
        Some(Value::Str(s)) if !ROPE_SCALING_TYPES.contains(&s.as_str()) => c.bad(format!(
            "key {} {s:?} is not one of {ROPE_SCALING_TYPES:?}",
            k("rope.scaling.type")
        )),
        Some(Value::Str(_)) | None => {}
        Some(v) => {
            let ty = v.type_name();
            c.bad(format!(
                "key {} has type {ty}, not string",
                k("rope.scaling.type")
            ));
        }
    }
    if let Some(s) = c
        .f32_key(&k("rope.scaling.factor"))
        .filter(|s| !(s.is_finite() && *s >= 0.0))
    {
        c.bad(format!(
            "key {} {s} is not a factor",
            k("rope.scaling.factor")
        ));
    }
    let vocab = check_tokenizer(&mut c, &mut meta);
    let vocab_key = c.u32_key(&k("vocab_size"), false);
    check_shapes(&mut c, tensors, embd, blocks, vocab_key.or(vocab));
    for (key, v) in [
        ("contextLength", ctx_len.map(|v| json!(v))),
        ("embeddingLength", embd.map(|v| json!(v))),
        ("blockCount", blocks.map(|v| json!(v))),
        ("headCount", heads.map(|v| json!(v))),
        ("headCountKv", heads_kv.map(|v| json!(v))),
        ("feedForwardLength", ffn.map(|v| json!(v))),
        ("ropeFreqBase", freq_base.map(|v| json!(v))),
        ("ropeDimensionCount", rope_dims.map(|v| json!(v))),
        ("normEpsilon", rms.or(ln).map(|v| json!(v))),
        ("vocabSize", vocab_key.or(vocab).map(|v| json!(v))),
    ] {
        if let Some(v) = v {
            meta.summary.insert(key.into(), v);
        }
    }
    meta
}

/// The tokenizer keys; returns the vocabulary size.
fn check_tokenizer(c: &mut Ctx<'_>, meta: &mut ModelMeta) -> Option<u64> {
    let model = match c.f.get("tokenizer.ggml.model") {
        Some(Value::Str(m)) => m.clone(),
        Some(v) => {
            let ty = v.type_name();
            c.bad(format!(
                "key tokenizer.ggml.model has type {ty}, not string"
            ));
            return None;
        }
        None => {
            c.bad("key tokenizer.ggml.model is missing; llama.cpp needs it".into());
            return None;
        }
    };
    meta.summary.insert("tokenizerModel".into(), json!(model));
    if let Some(Value::Str(p)) = c.f.get("tokenizer.ggml.pre") {
        meta.summary.insert("tokenizerPre".into(), json!(p));
    }
    if !TOKENIZER_MODELS.contains(&model.as_str()) {
        c.bad(format!(
            "tokenizer.ggml.model {model:?} is not one of llama.cpp's {TOKENIZER_MODELS:?}"
        ));
        return None;
    }
    if model == "no" || model == "none" {
        return None;
    }
    let n = match c.f.get("tokenizer.ggml.tokens") {
        Some(Value::Array {
            item: "string",
            len,
        }) if *len > 0 => *len,
        Some(v) => {
            let ty = v.type_name();
            c.bad(format!(
                "key tokenizer.ggml.tokens is {ty} (length 0 or not strings)"
            ));
            return None;
        }
        None => {
            c.bad("key tokenizer.ggml.tokens is missing; llama.cpp needs the vocabulary".into());
            return None;
        }
    };
    if model == "gpt2" {
        match c.f.get("tokenizer.ggml.merges") {
            Some(Value::Array { item: "string", .. }) => {}
            Some(v) => {
                let ty = v.type_name();
                c.bad(format!("key tokenizer.ggml.merges has type {ty}, not array[string]"));
            }
            None => c.bad(
                "key tokenizer.ggml.merges is missing; llama.cpp needs the merges of a gpt2 (BPE) tokenizer"
                    .into(),
            ),
        }
    }
    for (key, item) in [
        ("tokenizer.ggml.token_type", "i32"),
        ("tokenizer.ggml.scores", "f32"),
    ] {
        match c.f.get(key) {
            None => {}
            Some(Value::Array { item: i, len }) if *i == item && *len == n => {}
            Some(v) => {
                let (ty, len) = match v {
                    Value::Array { len, .. } => (v.type_name(), *len),
                    _ => (v.type_name(), 0),
                };
                c.bad(format!(
                    "key {key} is {ty} of length {len}; llama.cpp needs array[{item}] of the vocabulary's {n}"
                ));
            }
        }
    }
    for special in [
        "bos", "eos", "unk", "sep", "pad", "eot", "eom", "mask", "cls",
    ] {
        let key = format!("tokenizer.ggml.{special}_token_id");
        if let Some(id) = c.u32_key(&key, false).filter(|id| *id >= n) {
            c.bad(format!(
                "key {key} {id} is not a token id (the vocabulary has {n} tokens)"
            ));
        }
    }
    Some(n)
}

/// `token_embd.weight` is embedding × vocabulary; the blocks' tensors match the block count.
fn check_shapes(
    c: &mut Ctx<'_>,
    tensors: &BTreeMap<String, Vec<u64>>,
    embd: Option<u64>,
    blocks: Option<u64>,
    vocab: Option<u64>,
) {
    match tensors.get("token_embd.weight") {
        None => c.bad("tensor token_embd.weight is missing".into()),
        Some(dims) => {
            if let (Some(e), Some(d0)) = (embd, dims.first()) {
                if *d0 != e {
                    c.bad(format!(
                        "tensor token_embd.weight {dims:?}: rows of {d0}, the embedding length is {e}"
                    ));
                }
            }
            if let (Some(v), Some(d1)) = (vocab, dims.get(1)) {
                if *d1 != v {
                    c.bad(format!(
                        "tensor token_embd.weight {dims:?}: {d1} rows, the vocabulary has {v} tokens"
                    ));
                }
            }
        }
    }
    let Some(blocks) = blocks else { return };
    let mut seen = BTreeSet::new();
    for name in tensors.keys() {
        let Some(i) = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<u64>().ok())
        else {
            continue;
        };
        if i >= blocks {
            c.bad(format!(
                "tensor {name}: block {i}, but the block count is {blocks}"
            ));
        }
        seen.insert(i);
    }
    // The first block without tensors is at most seen.len().
    let first_missing = (0..=seen.len() as u64).find(|i| !seen.contains(i));
    if let Some(m) = first_missing.filter(|m| *m < blocks) {
        c.bad(format!(
            "block {m} has no tensors (blk.{m}.*), but the block count is {blocks}"
        ));
    }
}
