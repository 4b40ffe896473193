//! Fixtures for tests in this crate and in the worker: a tiny Llama-architecture model with realistically
//! scaled random weights (BF16, two shards + index), a character-level BPE `tokenizer.json`, and generated
//! calibration text. Not used by the engine itself.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;

mod gemma4;
mod hybrid;
pub use gemma4::*;
pub use hybrid::*;

pub const HIDDEN: usize = 128;
pub const INTER: usize = 256;
pub const LAYERS: usize = 3;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
/// Embedding rows (a trained tokenizer used with this model must stay below it).
pub const VOCAB: usize = 256;

/// Shape of a generated model.
#[derive(Clone, Debug)]
pub struct ModelSize {
    pub hidden: usize,
    pub inter: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
}

impl ModelSize {
    pub const TINY: ModelSize = ModelSize {
        hidden: HIDDEN,
        inter: INTER,
        layers: LAYERS,
        heads: HEADS,
        kv_heads: KV_HEADS,
        vocab: VOCAB,
    };
    /// About 110M parameters (GPT-2-small-like widths in a Llama layout).
    pub const SMALL_100M: ModelSize = ModelSize {
        hidden: 768,
        inter: 2048,
        layers: 12,
        heads: 12,
        kv_heads: 4,
        vocab: 16384,
    };
    /// The GGUF tests' model: rows of 256 values (one K-quant super-block), one KV head, a vocabulary
    /// the byte-level tokenizer fills.
    pub const GGUF_WIDE: ModelSize = ModelSize {
        hidden: 256,
        inter: 512,
        layers: 4,
        heads: 4,
        kv_heads: 1,
        vocab: 320,
    };

    pub fn parameters(&self) -> usize {
        let hd = self.hidden / self.heads;
        let attn = self.hidden * hd * (2 * self.heads + 2 * self.kv_heads);
        let mlp = 3 * self.hidden * self.inter;
        self.layers * (attn + mlp + 2 * self.hidden) + 2 * self.vocab * self.hidden + self.hidden
    }
}

const WORDS: &[&str] = &[
    "the",
    "model",
    "weights",
    "are",
    "quantized",
    "with",
    "gptq",
    "and",
    "served",
    "by",
    "vllm",
    "on",
    "a",
    "small",
    "cluster",
    "of",
    "gpu",
    "nodes",
    "cache",
    "layer",
    "hessian",
    "matrix",
    "column",
    "block",
    "error",
    "update",
    "token",
    "sequence",
    "attention",
    "head",
    "rotary",
    "embedding",
    "norm",
    "residual",
    "stream",
    "output",
];

pub fn gauss(rng: &mut StdRng) -> f32 {
    let u1: f32 = rng.random_range(1e-7f32..1.0);
    let u2: f32 = rng.random_range(0.0f32..1.0);
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
}

/// Random sentences over a small vocabulary, Zipf-like so some words dominate.
pub fn sentences(seed: u64, n: usize) -> Vec<String> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(20..60);
            (0..len)
                .map(|_| {
                    WORDS[(rng.random_range(0.0f32..1.0).powi(2) * WORDS.len() as f32) as usize]
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// A BPE with one token per lowercase letter and no merges, whitespace pre-tokenized.
pub fn write_char_tokenizer(dir: &Path) -> Result<(), String> {
    let vocab: serde_json::Map<String, serde_json::Value> = ('a'..='z')
        .enumerate()
        .map(|(i, c)| (c.to_string(), json!(i)))
        .collect();
    let doc = json!({
        "version": "2.0", "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null, "padding": null,
        "model": {"type": "BPE", "byte_level": false, "vocab": vocab, "merges": []},
    });
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec_pretty(&doc).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        b"{\"model_max_length\": 2048}",
    )
    .map_err(|e| e.to_string())
}

/// GPT-2's byte → printable-character table (`bytes_to_unicode`), by byte value.
pub fn gpt2_byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

/// A byte-level BPE (GPT-2's byte alphabet as ids 0..256, `ByteLevel` pre-tokenizer, four merges as ids
/// 256..260, `<|endoftext|>` as 260) and a `tokenizer_config.json` naming it as BOS/EOS, with a chat
/// template: the tokenizer llama.cpp calls `gpt2` / `gpt-2`.
pub fn write_byte_level_tokenizer(dir: &Path) -> Result<(), String> {
    let chars = gpt2_byte_chars();
    let mut vocab = serde_json::Map::new();
    for (i, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(i));
    }
    let merges = [("Ġ", "t"), ("t", "h"), ("th", "e"), ("Ġ", "a")];
    for (k, (a, b)) in merges.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), json!(256 + k));
    }
    vocab.insert("<|endoftext|>".into(), json!(260));
    let doc = json!({
        "version": "1.0", "normalizer": null, "post_processor": null, "padding": null, "truncation": null,
        "added_tokens": [{"id": 260, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "vocab": vocab,
                  "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()},
    });
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec_pretty(&doc).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    let cfg = json!({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "model_max_length": 2048,
                     "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"});
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec_pretty(&cfg).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())
}

/// A generated model's tensors in the order they are written: (name, shape, values).
type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// `n` samples of a normal distribution with standard deviation `std`.
fn normal_samples(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    (0..n).map(|_| std * gauss(rng)).collect()
}

/// The start of a generated model in `dir`: the directory and its tokenizer, the seeded random source, the
/// prefix of the text model's tensor names (`model.language_model.` in a multimodal checkpoint), and the
/// tensor list holding the `vocab × hidden` token embedding drawn with `embed_std` (the random source's first
/// draws).
fn start_model(
    dir: &Path,
    seed: u64,
    multimodal: bool,
    (vocab, hidden, embed_std): (usize, usize, f32),
) -> Result<(StdRng, &'static str, Tensors), String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    write_char_tokenizer(dir)?;
    let text = if multimodal {
        "model.language_model."
    } else {
        "model."
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let embed = normal_samples(&mut rng, vocab * hidden, embed_std);
    let tensors = vec![(
        format!("{text}embed_tokens.weight"),
        vec![vocab, hidden],
        embed,
    )];
    Ok((rng, text, tensors))
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect()
}

/// Writes config.json, two safetensors shards + index, tokenizer files.
pub fn write_model(dir: &Path, arch: &str, seed: u64) -> Result<(), String> {
    write_model_sized(dir, arch, seed, &ModelSize::TINY)
}

/// Writes a model of the given size (config.json, two BF16 shards + index, char tokenizer).
pub fn write_model_sized(
    dir: &Path,
    arch: &str,
    seed: u64,
    size: &ModelSize,
) -> Result<(), String> {
    let vocab = size.vocab;
    let (mut rng, _, mut tensors) = start_model(dir, seed, false, (vocab, size.hidden, 1.0))?;
    let head_dim = size.hidden / size.heads;
    let mut randn = |rows: usize, cols: usize, std: f32| normal_samples(&mut rng, rows * cols, std);
    tensors.push((
        "lm_head.weight".into(),
        vec![vocab, size.hidden],
        randn(vocab, size.hidden, 0.05),
    ));
    tensors.push((
        "model.norm.weight".into(),
        vec![size.hidden],
        vec![1.0; size.hidden],
    ));
    let qwen2 = arch == "Qwen2ForCausalLM";
    let qwen3 = arch == "Qwen3ForCausalLM";
    for l in 0..size.layers {
        let p = format!("model.layers.{l}.");
        let shapes = [
            ("self_attn.q_proj", size.heads * head_dim, size.hidden),
            ("self_attn.k_proj", size.kv_heads * head_dim, size.hidden),
            ("self_attn.v_proj", size.kv_heads * head_dim, size.hidden),
            ("self_attn.o_proj", size.hidden, size.heads * head_dim),
            ("mlp.gate_proj", size.inter, size.hidden),
            ("mlp.up_proj", size.inter, size.hidden),
            ("mlp.down_proj", size.hidden, size.inter),
        ];
        for (m, out, inp) in shapes {
            let std = 1.0 / (inp as f32).sqrt();
            tensors.push((
                format!("{p}{m}.weight"),
                vec![out, inp],
                randn(out, inp, std),
            ));
            if qwen2 && m.starts_with("self_attn.") && m != "self_attn.o_proj" {
                tensors.push((format!("{p}{m}.bias"), vec![out], randn(out, 1, 0.02)));
            }
        }
        let mut ones = vec![1.0f32; size.hidden];
        ones.iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v += 0.1 * ((i * 37 % 11) as f32 / 11.0 - 0.5));
        tensors.push((
            format!("{p}input_layernorm.weight"),
            vec![size.hidden],
            ones.clone(),
        ));
        tensors.push((
            format!("{p}post_attention_layernorm.weight"),
            vec![size.hidden],
            ones.clone(),
        ));
        if qwen3 {
            tensors.push((
                format!("{p}self_attn.q_norm.weight"),
                vec![head_dim],
                vec![1.0; head_dim],
            ));
            tensors.push((
                format!("{p}self_attn.k_norm.weight"),
                vec![head_dim],
                vec![1.0; head_dim],
            ));
        }
    }
    write_shards(dir, tensors)?;
    let mut cfg = json!({
        "architectures": [arch], "model_type": "llama", "hidden_size": size.hidden, "intermediate_size": size.inter,
        "num_hidden_layers": size.layers, "num_attention_heads": size.heads, "num_key_value_heads": size.kv_heads,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": vocab, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16", "max_position_embeddings": 2048,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    });
    if qwen3 {
        cfg["head_dim"] = json!(head_dim);
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&cfg).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    Ok(())
}

/// Two BF16 shards split by name, plus `model.safetensors.index.json`.
fn write_shards(dir: &Path, mut tensors: Tensors) -> Result<(), String> {
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let half_n = tensors.len() / 2;
    let mut weight_map = serde_json::Map::new();
    for (si, chunk) in [&tensors[..half_n], &tensors[half_n..]].iter().enumerate() {
        let fname = format!("model-{:05}-of-00002.safetensors", si + 1);
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = chunk
            .iter()
            .map(|(n, s, v)| (n.clone(), s.clone(), bf16_bytes(v)))
            .collect();
        let views: Vec<(String, TensorView<'_>)> = bytes
            .iter()
            .map(|(n, s, b)| {
                Ok((
                    n.clone(),
                    TensorView::new(Dtype::BF16, s.clone(), b).map_err(|e| format!("{e:?}"))?,
                ))
            })
            .collect::<Result<_, String>>()?;
        for (n, _, _) in chunk.iter() {
            weight_map.insert(n.clone(), json!(fname));
        }
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())]
            .into_iter()
            .collect();
        std::fs::write(
            dir.join(&fname),
            safetensors::serialize(views, Some(meta)).map_err(|e| format!("{e:?}"))?,
        )
        .map_err(|e| e.to_string())?;
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec(&json!({"metadata": {}, "weight_map": weight_map}))
            .map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())
}

pub fn write_dataset(path: &Path, n: usize) -> Result<(), String> {
    let lines: Vec<String> = sentences(2, n)
        .into_iter()
        .map(|s| json!({"text": s}).to_string())
        .collect();
    std::fs::write(path, lines.join("\n")).map_err(|e| e.to_string())?;
    Ok(())
}
