//! Tiny generated Llama-architecture models with a planted refusal direction, their tokenizer and
//! prompt datasets. Shared by the abliteration tests and the `hub_fixtures` example.
#![allow(dead_code)]
// Test fixture generator: a failed write is a broken test setup, so it panics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
pub const HIDDEN: usize = 32;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const INTER: usize = 64;

/// Deterministic xorshift + Box-Muller.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn gauss(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-12);
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Per token (row of `c`): `|⟨c_t, r⟩| / ‖c_t‖`; the largest.
pub fn worst_alignment(c: faer::MatRef<'_, f32>, r: &[f32]) -> f64 {
    let mut worst = 0f64;
    for t in 0..c.nrows() {
        let (mut along, mut sq) = (0f64, 0f64);
        for (j, &rv) in r.iter().enumerate() {
            let v = c[(t, j)] as f64;
            along += v * rv as f64;
            sq += v * v;
        }
        if sq > 0.0 {
            worst = worst.max(along.abs() / sq.sqrt());
        }
    }
    worst
}

/// Largest `|vᵀ W[:, j]|` over the columns of a row-major `[rows, cols]` matrix, relative to its largest entry.
pub fn relative_projection(v: &[f32], w: &[f32], cols: usize) -> f64 {
    let max = w.iter().fold(0f64, |a, b| a.max(b.abs() as f64));
    let mut worst = 0f64;
    for j in 0..cols {
        let p: f64 = v
            .iter()
            .enumerate()
            .map(|(i, &x)| x as f64 * w[i * cols + j] as f64)
            .sum();
        worst = worst.max(p.abs());
    }
    worst / max.max(f64::MIN_POSITIVE)
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub fn normalize(v: &mut [f32]) {
    let n = dot(v, v).sqrt();
    v.iter_mut().for_each(|x| *x /= n);
}

pub fn project_out(v: &mut [f32], dir: &[f32]) {
    let d = dot(v, dir);
    v.iter_mut().zip(dir).for_each(|(x, r)| *x -= d * r);
}

/// The vocabulary: one token per character (refusal words are upper case, harmless lower case).
pub fn vocab() -> Vec<String> {
    let mut v: Vec<String> = ('a'..='z')
        .chain('A'..='Z')
        .chain('0'..='9')
        .map(String::from)
        .collect();
    v.push(".".into());
    v.push("?".into());
    for t in ["[", "]", "/"] {
        v.push(t.into());
    }
    v
}

#[derive(Clone, Debug)]
pub struct TinyOpts {
    /// `F32`, `BF16` or `F16`.
    pub dtype: &'static str,
    pub layers: usize,
    /// Layer whose MLP writes the planted direction for refusal prompts.
    pub planted: usize,
    /// The next layer cancels it again (so only the planted layer's output carries it).
    pub cancel: bool,
    /// lm_head rows of refusal tokens get `boost · u` (makes the direction useful for prediction).
    pub lm_head_boost: f32,
    pub shards: usize,
    pub layer_types: Option<Vec<&'static str>>,
    /// Tensors whose name contains one of these are left out.
    pub omit: Vec<&'static str>,
    pub chat_template: Option<&'static str>,
    /// Qwen2-MoE layout with this many routed experts (the planted direction goes through the
    /// shared expert); 0 = dense Llama.
    pub moe_experts: usize,
    pub seed: u64,
}

impl Default for TinyOpts {
    fn default() -> Self {
        TinyOpts {
            dtype: "F32",
            layers: 8,
            planted: 3,
            cancel: true,
            lm_head_boost: 0.0,
            shards: 1,
            layer_types: None,
            omit: Vec::new(),
            chat_template: None,
            moe_experts: 0,
            seed: 7,
        }
    }
}

pub struct TinyModel {
    pub root: tempfile::TempDir,
    pub dir: PathBuf,
    /// The planted unit direction.
    pub u: Vec<f32>,
    pub refusal: PathBuf,
    pub harmless: PathBuf,
}

pub struct Tensor {
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

fn encode(dtype: &str, v: &[f32]) -> Vec<u8> {
    match dtype {
        "F32" => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        "BF16" => v
            .iter()
            .flat_map(|x| {
                let b = x.to_bits();
                (((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16).to_le_bytes()
            })
            .collect(),
        "F16" => v
            .iter()
            .flat_map(|&x| flexinfer_worker::abliterate::edit::f32_to_f16(x).to_le_bytes())
            .collect(),
        other => panic!("test generator does not write {other}"),
    }
}

/// Writes a safetensors file (header JSON padded to 8 bytes, then the data).
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, Tensor>) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut data = Vec::new();
    for (name, t) in tensors {
        let bytes = encode(t.dtype, &t.data);
        let start = data.len();
        data.extend_from_slice(&bytes);
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

pub fn tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = vocab()
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, serde_json::json!(i)))
        .collect();
    serde_json::json!({
        "version": "2.0",
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "BPE", "byte_level": false, "vocab": vocab, "merges": []},
        "padding": null
    })
    .to_string()
}

pub fn prompt(rng: &mut Rng, upper: bool) -> String {
    let n = 5 + rng.below(6);
    (0..n)
        .map(|_| {
            let c = (b'a' + rng.below(26) as u8) as char;
            if upper { c.to_ascii_uppercase() } else { c }.to_string()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Builds the model directory (`<tmp>/model`) and two prompt datasets (`<tmp>/data`).
pub fn build(o: &TinyOpts) -> TinyModel {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model");
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = Rng::new(o.seed);
    let h = HIDDEN;
    let rand_vec = |rng: &mut Rng, n: usize, std: f32| -> Vec<f32> {
        (0..n).map(|_| rng.gauss() * std).collect()
    };
    let mut u = rand_vec(&mut rng, h, 1.0);
    normalize(&mut u);
    let mut m = rand_vec(&mut rng, h, 1.0);
    project_out(&mut m, &u);
    normalize(&mut m);

    let vocab = vocab();
    let mut t: BTreeMap<String, Tensor> = BTreeMap::new();
    let dt = o.dtype;
    let mut put = |name: String, shape: Vec<usize>, data: Vec<f32>| {
        t.insert(
            name,
            Tensor {
                dtype: dt,
                shape,
                data,
            },
        );
    };
    // Embeddings: no component along u or m, plus 3·m for refusal (upper-case) tokens.
    let mut emb = Vec::new();
    for tok in &vocab {
        let mut e = rand_vec(&mut rng, h, 1.0);
        project_out(&mut e, &u);
        project_out(&mut e, &m);
        if tok.chars().all(|c| c.is_ascii_uppercase()) {
            e.iter_mut().zip(&m).for_each(|(x, mv)| *x += 3.0 * mv);
        }
        emb.extend(e);
    }
    put(
        "model.embed_tokens.weight".into(),
        vec![vocab.len(), h],
        emb,
    );
    let q = HEADS * (h / HEADS);
    let kv = KV_HEADS * (h / HEADS);
    for l in 0..o.layers {
        let p = format!("model.layers.{l}.");
        put(format!("{p}input_layernorm.weight"), vec![h], vec![1.0; h]);
        put(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            vec![1.0; h],
        );
        put(
            format!("{p}self_attn.q_proj.weight"),
            vec![q, h],
            rand_vec(&mut rng, q * h, 0.02),
        );
        put(
            format!("{p}self_attn.k_proj.weight"),
            vec![kv, h],
            rand_vec(&mut rng, kv * h, 0.02),
        );
        put(
            format!("{p}self_attn.v_proj.weight"),
            vec![kv, h],
            rand_vec(&mut rng, kv * h, 0.02),
        );
        put(
            format!("{p}self_attn.o_proj.weight"),
            vec![h, q],
            rand_vec(&mut rng, h * q, 0.02),
        );
        let mut gate = rand_vec(&mut rng, INTER * h, 0.02);
        let mut up = rand_vec(&mut rng, INTER * h, 0.02);
        let mut down = rand_vec(&mut rng, h * INTER, 0.02);
        let plant = |gate: &mut Vec<f32>,
                     up: &mut Vec<f32>,
                     down: &mut Vec<f32>,
                     read: &[f32],
                     a: f32,
                     k: f32| {
            for c in 0..h {
                gate[c] = a * read[c];
                up[c] = a * read[c];
                // Column 0 of down_proj ([h, INTER] row-major).
                down[c * INTER] = k * u[c];
            }
        };
        if l == o.planted {
            plant(&mut gate, &mut up, &mut down, &m, 2.0, 1.0);
        }
        if o.cancel && l == o.planted + 1 {
            plant(&mut gate, &mut up, &mut down, &u, 1.0, -0.93);
        }
        if o.moe_experts == 0 {
            put(format!("{p}mlp.gate_proj.weight"), vec![INTER, h], gate);
            put(format!("{p}mlp.up_proj.weight"), vec![INTER, h], up);
            put(format!("{p}mlp.down_proj.weight"), vec![h, INTER], down);
        } else {
            // The shared expert carries the plant; its sigmoid gate (zero weights) halves it.
            down.iter_mut().for_each(|v| *v *= 2.0);
            put(
                format!("{p}mlp.shared_expert.gate_proj.weight"),
                vec![INTER, h],
                gate,
            );
            put(
                format!("{p}mlp.shared_expert.up_proj.weight"),
                vec![INTER, h],
                up,
            );
            put(
                format!("{p}mlp.shared_expert.down_proj.weight"),
                vec![h, INTER],
                down,
            );
            put(
                format!("{p}mlp.shared_expert_gate.weight"),
                vec![1, h],
                vec![0.0; h],
            );
            let e = o.moe_experts;
            put(
                format!("{p}mlp.gate.weight"),
                vec![e, h],
                rand_vec(&mut rng, e * h, 0.02),
            );
            for x in 0..e {
                let q = format!("{p}mlp.experts.{x}.");
                put(
                    format!("{q}gate_proj.weight"),
                    vec![INTER, h],
                    rand_vec(&mut rng, INTER * h, 0.02),
                );
                put(
                    format!("{q}up_proj.weight"),
                    vec![INTER, h],
                    rand_vec(&mut rng, INTER * h, 0.02),
                );
                put(
                    format!("{q}down_proj.weight"),
                    vec![h, INTER],
                    rand_vec(&mut rng, h * INTER, 0.02),
                );
            }
        }
    }
    put("model.norm.weight".into(), vec![h], vec![1.0; h]);
    let mut head = Vec::new();
    for tok in &vocab {
        let mut r = rand_vec(&mut rng, h, 0.1);
        if tok.chars().all(|c| c.is_ascii_uppercase()) {
            r.iter_mut()
                .zip(&u)
                .for_each(|(x, uv)| *x += o.lm_head_boost * uv);
        }
        head.extend(r);
    }
    put("lm_head.weight".into(), vec![vocab.len(), h], head);
    t.retain(|name, _| !o.omit.iter().any(|s| name.contains(s)));

    // Shards: round-robin by sorted name into `o.shards` files.
    if o.shards <= 1 {
        write_safetensors(&dir.join("model.safetensors"), &t);
    } else {
        let n = o.shards;
        let mut parts: Vec<BTreeMap<String, Tensor>> = (0..n).map(|_| BTreeMap::new()).collect();
        let mut weight_map = serde_json::Map::new();
        let names: Vec<String> = t.keys().cloned().collect();
        let per = names.len().div_ceil(n);
        for (i, name) in names.into_iter().enumerate() {
            let si = i / per;
            let file = format!("model-{:05}-of-{:05}.safetensors", si + 1, n);
            weight_map.insert(name.clone(), serde_json::json!(file));
            let tensor = t.remove(&name).unwrap();
            parts[si].insert(name, tensor);
        }
        for (si, part) in parts.iter().enumerate() {
            write_safetensors(
                &dir.join(format!("model-{:05}-of-{:05}.safetensors", si + 1, n)),
                part,
            );
        }
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
        )
        .unwrap();
    }
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": INTER,
        "num_hidden_layers": o.layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab.len(),
        "tie_word_embeddings": false,
        "torch_dtype": if o.dtype == "F32" { "float32" } else { "bfloat16" },
    });
    if o.moe_experts > 0 {
        config["architectures"] = serde_json::json!(["Qwen2MoeForCausalLM"]);
        config["model_type"] = serde_json::json!("qwen2_moe");
        config["num_experts"] = serde_json::json!(o.moe_experts);
        config["num_experts_per_tok"] = serde_json::json!(2);
        config["moe_intermediate_size"] = serde_json::json!(INTER);
        config["shared_expert_intermediate_size"] = serde_json::json!(INTER);
        config["norm_topk_prob"] = serde_json::json!(false);
    }
    if let Some(lt) = &o.layer_types {
        config["layer_types"] = serde_json::json!(lt);
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json()).unwrap();
    if let Some(ct) = o.chat_template {
        std::fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::json!({"chat_template": ct}).to_string(),
        )
        .unwrap();
    }
    std::fs::write(dir.join("generation_config.json"), "{\"do_sample\": false}").unwrap();

    let data = root.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let refusal = data.join("refusal.jsonl");
    let harmless = data.join("harmless.txt");
    let mut r = String::new();
    let mut hl = String::new();
    for _ in 0..40 {
        r.push_str(&serde_json::json!({"prompt": prompt(&mut rng, true)}).to_string());
        r.push('\n');
        hl.push_str(&prompt(&mut rng, false));
        hl.push('\n');
    }
    std::fs::write(&refusal, r).unwrap();
    std::fs::write(&harmless, hl).unwrap();
    TinyModel {
        root,
        dir,
        u,
        refusal,
        harmless,
    }
}

/// Writes a harmless dataset where every other line is refusal-like (upper case).
pub fn mixed_harmless(path: &Path, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut s = String::new();
    for i in 0..40 {
        s.push_str(&prompt(&mut rng, i % 2 == 0));
        s.push('\n');
    }
    std::fs::write(path, s).unwrap();
}
