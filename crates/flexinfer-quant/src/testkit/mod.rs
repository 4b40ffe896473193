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
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    write_char_tokenizer(dir)?;
    let vocab = size.vocab;
    let mut rng = StdRng::seed_from_u64(seed);
    let head_dim = size.hidden / size.heads;
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut randn = |rows: usize, cols: usize, std: f32| -> Vec<f32> {
        (0..rows * cols).map(|_| std * gauss(&mut rng)).collect()
    };
    tensors.push((
        "model.embed_tokens.weight".into(),
        vec![vocab, size.hidden],
        randn(vocab, size.hidden, 1.0),
    ));
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

/// What [`write_gemma4_model`] generates.
#[derive(Clone, Copy, Debug)]
pub struct Gemma4Options {
    /// Routed experts beside each layer's dense MLP (`enable_moe_block`), in the hub's fused layout.
    pub moe: bool,
    /// `Gemma4ForConditionalGeneration`: `text_config`, `model.language_model.*`, a small vision tower.
    pub multimodal: bool,
}

/// Shape of a generated Gemma 4 text stack ([`write_gemma4_model_sized`]).
#[derive(Clone, Debug)]
pub struct Gemma4Size {
    pub hidden: usize,
    /// The dense MLP's width (every layer has one; MoE layers add the experts beside it).
    pub inter: usize,
    pub layers: usize,
    /// Layer `l` is global (full attention) when `(l + 1) % global_every == 0`, else sliding.
    pub global_every: usize,
    pub heads: usize,
    /// Key/value heads and head width of the sliding layers.
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Key/value heads and head width of the global layers (keys double as values there).
    pub global_kv_heads: usize,
    pub global_head_dim: usize,
    /// Routed experts with `moe`, their width and how many each token takes.
    pub experts: usize,
    pub moe_inter: usize,
    pub top_k: usize,
    pub vocab: usize,
}

impl Gemma4Size {
    /// The small model of the pipeline tests: hidden 128, 4 layers alternating sliding and global, the
    /// global ones with a wider head and one kv head; MoE: 8 experts of width 64, top 2.
    pub const TINY: Gemma4Size = Gemma4Size {
        hidden: 128,
        inter: 128,
        layers: 4,
        global_every: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        global_kv_heads: 1,
        global_head_dim: 64,
        experts: 8,
        moe_inter: 64,
        top_k: 2,
        vocab: VOCAB,
    };
}

/// A Gemma 4 text model shaped like the published ones, small ([`Gemma4Size::TINY`]), BF16 in two shards +
/// index, with the char tokenizer. Random weights: for the pipeline's plumbing; the forward itself is checked
/// against transformers by the oracle fixtures.
pub fn write_gemma4_model(dir: &Path, opts: Gemma4Options, seed: u64) -> Result<(), String> {
    write_gemma4_model_sized(dir, opts, &Gemma4Size::TINY, seed)
}

/// [`write_gemma4_model`] at another size (the benchmark's larger MoE model).
pub fn write_gemma4_model_sized(
    dir: &Path,
    opts: Gemma4Options,
    size: &Gemma4Size,
    seed: u64,
) -> Result<(), String> {
    let Gemma4Size {
        global_every,
        top_k,
        vocab,
        ..
    } = *size;
    let (h, inter, layers, heads) = (size.hidden, size.inter, size.layers, size.heads);
    let (kv_heads, head_dim) = (size.kv_heads, size.head_dim);
    let (global_kv, global_hd) = (size.global_kv_heads, size.global_head_dim);
    let (experts, moe_inter) = (size.experts, size.moe_inter);
    if global_every == 0 {
        return Err("global_every must be at least 1".into());
    }
    let is_global = |l: usize| (l + 1).is_multiple_of(global_every);
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    write_char_tokenizer(dir)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut randn =
        |n: usize, std: f32| -> Vec<f32> { (0..n).map(|_| std * gauss(&mut rng)).collect() };
    let text = if opts.multimodal {
        "model.language_model."
    } else {
        "model."
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, v: Vec<f32>| tensors.push((name, shape, v));
    push(
        format!("{text}embed_tokens.weight"),
        vec![vocab, h],
        randn(vocab * h, 0.05),
    );
    push(format!("{text}norm.weight"), vec![h], vec![1.0; h]);
    let norm = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| 1.0 + 0.1 * ((i * 37 % 11) as f32 / 11.0 - 0.5))
            .collect()
    };
    for l in 0..layers {
        let p = format!("{text}layers.{l}.");
        let global = is_global(l);
        let (hd, kv) = if global {
            (global_hd, global_kv)
        } else {
            (head_dim, kv_heads)
        };
        let mut lin = |m: &str, out: usize, inp: usize| {
            (
                format!("{p}{m}.weight"),
                vec![out, inp],
                randn(out * inp, 1.0 / (inp as f32).sqrt()),
            )
        };
        let mut layer = vec![
            lin("self_attn.q_proj", heads * hd, h),
            lin("self_attn.k_proj", kv * hd, h),
            lin("self_attn.o_proj", h, heads * hd),
            lin("mlp.gate_proj", inter, h),
            lin("mlp.up_proj", inter, h),
            lin("mlp.down_proj", h, inter),
        ];
        if !global {
            layer.push(lin("self_attn.v_proj", kv * hd, h));
        }
        if opts.moe {
            layer.push(lin("router.proj", experts, h));
        }
        for t in layer {
            push(t.0, t.1, t.2);
        }
        for n in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            push(format!("{p}{n}.weight"), vec![h], norm(h));
        }
        // The scores are not scaled by 1/sqrt(d): small q/k norm weights keep them in a trained model's range
        // (with weights near 1 a random model's attention is nearly one-hot, and 4-bit noise flips it).
        let small = |n: usize| norm(n).into_iter().map(|v| 0.3 * v).collect::<Vec<f32>>();
        push(format!("{p}self_attn.q_norm.weight"), vec![hd], small(hd));
        push(format!("{p}self_attn.k_norm.weight"), vec![hd], small(hd));
        push(format!("{p}layer_scalar"), vec![1], vec![0.75]);
        if opts.moe {
            for n in [
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2",
            ] {
                push(format!("{p}{n}.weight"), vec![h], norm(h));
            }
            push(format!("{p}router.scale"), vec![h], norm(h));
            push(
                format!("{p}router.per_expert_scale"),
                vec![experts],
                norm(experts),
            );
            push(
                format!("{p}experts.gate_up_proj"),
                vec![experts, 2 * moe_inter, h],
                randn(experts * 2 * moe_inter * h, 1.0 / (h as f32).sqrt()),
            );
            push(
                format!("{p}experts.down_proj"),
                vec![experts, h, moe_inter],
                randn(experts * h * moe_inter, 1.0 / (moe_inter as f32).sqrt()),
            );
        }
    }
    if opts.multimodal {
        for (n, shape) in [
            (
                "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight",
                vec![32, 32],
            ),
            (
                "model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight",
                vec![32, 32],
            ),
            (
                "model.embed_vision.embedding_projection.weight",
                vec![h, 32],
            ),
        ] {
            let len = shape.iter().product();
            push(n.to_string(), shape, randn(len, 0.1));
        }
    }
    write_shards(dir, tensors)?;
    let mut text_cfg = json!({
        "model_type": "gemma4_text", "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "global_head_dim": global_hd, "num_global_key_value_heads": global_kv, "attention_k_eq_v": true,
        "vocab_size": vocab, "rms_norm_eps": 1e-6, "sliding_window": 16, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
        "tie_word_embeddings": true, "max_position_embeddings": 2048,
        "layer_types": (0..layers)
            .map(|l| if is_global(l) { "full_attention" } else { "sliding_attention" })
            .collect::<Vec<_>>(),
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}
        },
    });
    if opts.moe {
        text_cfg["enable_moe_block"] = json!(true);
        text_cfg["num_experts"] = json!(experts);
        text_cfg["top_k_experts"] = json!(top_k);
        text_cfg["moe_intermediate_size"] = json!(moe_inter);
    }
    let cfg = if opts.multimodal {
        json!({"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
               "text_config": text_cfg, "vision_config": {"hidden_size": 32}, "tie_word_embeddings": true})
    } else {
        text_cfg["architectures"] = json!(["Gemma4ForCausalLM"]);
        text_cfg
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&cfg).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())
}

/// Shape of a generated Qwen3.5-style gated delta-net hybrid ([`write_hybrid_model`]).
#[derive(Clone, Debug)]
pub struct HybridSize {
    pub hidden: usize,
    pub layers: usize,
    /// One full-attention layer in every `full_attention_interval` (the others are linear attention).
    pub full_attention_interval: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub linear_k_heads: usize,
    pub linear_v_heads: usize,
    pub linear_k_dim: usize,
    pub linear_v_dim: usize,
    /// Dense MLP width (no experts), or the routed experts' width with `experts > 0`.
    pub inter: usize,
    /// Routed experts per layer (0: dense Qwen3.5); with experts, a shared expert of `inter` and top-`top_k`.
    pub experts: usize,
    pub top_k: usize,
    pub vocab: usize,
    /// `Qwen3_5MoeForConditionalGeneration` / `Qwen3_5ForConditionalGeneration`: `text_config`,
    /// `model.language_model.*`, a small vision tower and MTP tensors.
    pub multimodal: bool,
}

impl HybridSize {
    /// A small MoE hybrid for the pipeline tests: 4 layers (3 linear, 1 full), 8 experts top 2, multimodal.
    pub const TINY_MOE: HybridSize = HybridSize {
        hidden: 128,
        layers: 4,
        full_attention_interval: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        linear_k_heads: 2,
        linear_v_heads: 8,
        linear_k_dim: 32,
        linear_v_dim: 16,
        inter: 64,
        experts: 8,
        top_k: 2,
        vocab: VOCAB,
        multimodal: true,
    };
}

/// A Qwen3.5-shaped gated delta-net hybrid (split linear-attention projections, output-gated full attention,
/// zero-centred norms, partial rope; with experts: routed experts, a shared expert and its gate), BF16 in two
/// shards + index, with the char tokenizer. Random weights: for the pipeline's plumbing; the forward is checked
/// against transformers by the oracle fixtures.
pub fn write_hybrid_model(dir: &Path, size: &HybridSize, seed: u64) -> Result<(), String> {
    let h = size.hidden;
    let (kd, vd) = (
        size.linear_k_heads * size.linear_k_dim,
        size.linear_v_heads * size.linear_v_dim,
    );
    let nv = size.linear_v_heads;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    write_char_tokenizer(dir)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut randn =
        |n: usize, std: f32| -> Vec<f32> { (0..n).map(|_| std * gauss(&mut rng)).collect() };
    let text = if size.multimodal {
        "model.language_model."
    } else {
        "model."
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, v: Vec<f32>| tensors.push((name, shape, v));
    push(
        format!("{text}embed_tokens.weight"),
        vec![size.vocab, h],
        randn(size.vocab * h, 1.0),
    );
    push(
        "lm_head.weight".into(),
        vec![size.vocab, h],
        randn(size.vocab * h, 0.05),
    );
    // Zero-centred norms (multiplied by 1 + w): small weights.
    let small = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| 0.05 * ((i * 37 % 11) as f32 / 11.0 - 0.5))
            .collect()
    };
    push(format!("{text}norm.weight"), vec![h], small(h));
    let mut layer_types = Vec::with_capacity(size.layers);
    for l in 0..size.layers {
        let p = format!("{text}layers.{l}.");
        let linear = !(l + 1).is_multiple_of(size.full_attention_interval.max(1));
        layer_types.push(if linear {
            "linear_attention"
        } else {
            "full_attention"
        });
        let mut lin = |m: &str, out: usize, inp: usize| {
            (
                format!("{p}{m}.weight"),
                vec![out, inp],
                randn(out * inp, 1.0 / (inp as f32).sqrt()),
            )
        };
        let mut layer = Vec::new();
        if linear {
            layer.push(lin("linear_attn.in_proj_qkv", 2 * kd + vd, h));
            layer.push(lin("linear_attn.in_proj_z", vd, h));
            layer.push(lin("linear_attn.in_proj_b", nv, h));
            layer.push(lin("linear_attn.in_proj_a", nv, h));
            layer.push(lin("linear_attn.out_proj", h, vd));
        } else {
            let q = size.heads * size.head_dim;
            let kv = size.kv_heads * size.head_dim;
            layer.push(lin("self_attn.q_proj", 2 * q, h));
            layer.push(lin("self_attn.k_proj", kv, h));
            layer.push(lin("self_attn.v_proj", kv, h));
            layer.push(lin("self_attn.o_proj", h, q));
        }
        if size.experts == 0 {
            layer.push(lin("mlp.gate_proj", size.inter, h));
            layer.push(lin("mlp.up_proj", size.inter, h));
            layer.push(lin("mlp.down_proj", h, size.inter));
        } else {
            for e in 0..size.experts {
                layer.push(lin(&format!("mlp.experts.{e}.gate_proj"), size.inter, h));
                layer.push(lin(&format!("mlp.experts.{e}.up_proj"), size.inter, h));
                layer.push(lin(&format!("mlp.experts.{e}.down_proj"), h, size.inter));
            }
            layer.push(lin("mlp.shared_expert.gate_proj", size.inter, h));
            layer.push(lin("mlp.shared_expert.up_proj", size.inter, h));
            layer.push(lin("mlp.shared_expert.down_proj", h, size.inter));
            layer.push(lin("mlp.shared_expert_gate", 1, h));
            let mut router = lin("mlp.gate", size.experts, h);
            router.2.iter_mut().for_each(|v| *v *= 3.0);
            layer.push(router);
        }
        for t in layer {
            push(t.0, t.1, t.2);
        }
        push(format!("{p}input_layernorm.weight"), vec![h], small(h));
        push(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            small(h),
        );
        if linear {
            let k = 4;
            push(
                format!("{p}linear_attn.conv1d.weight"),
                vec![2 * kd + vd, 1, k],
                randn((2 * kd + vd) * k, 0.5),
            );
            push(format!("{p}linear_attn.dt_bias"), vec![nv], vec![1.0; nv]);
            push(
                format!("{p}linear_attn.A_log"),
                vec![nv],
                (0..nv).map(|i| (1.0 + i as f32).ln()).collect(),
            );
            push(
                format!("{p}linear_attn.norm.weight"),
                vec![size.linear_v_dim],
                vec![1.0; size.linear_v_dim],
            );
        } else {
            push(
                format!("{p}self_attn.q_norm.weight"),
                vec![size.head_dim],
                small(size.head_dim),
            );
            push(
                format!("{p}self_attn.k_norm.weight"),
                vec![size.head_dim],
                small(size.head_dim),
            );
        }
    }
    if size.multimodal {
        for (n, shape) in [
            ("model.visual.blocks.0.attn.qkv.weight", vec![96, 32]),
            ("model.visual.blocks.0.mlp.linear_fc1.weight", vec![32, 32]),
            ("model.visual.merger.linear_fc2.weight", vec![h, 32]),
            ("mtp.fc.weight", vec![h, 2 * h]),
            ("mtp.layers.0.self_attn.q_proj.weight", vec![2 * h, h]),
            (
                "mtp.layers.0.mlp.experts.0.up_proj.weight",
                vec![size.inter, h],
            ),
        ] {
            let len = shape.iter().product();
            push(n.to_string(), shape, randn(len, 0.1));
        }
    }
    write_shards(dir, tensors)?;
    let moe = size.experts > 0;
    let mut text_cfg = json!({
        "model_type": if moe { "qwen3_5_moe_text" } else { "qwen3_5_text" },
        "hidden_size": h, "num_hidden_layers": size.layers, "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads, "head_dim": size.head_dim, "vocab_size": size.vocab,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 4096,
        "tie_word_embeddings": false, "layer_types": layer_types,
        "linear_num_key_heads": size.linear_k_heads, "linear_num_value_heads": nv,
        "linear_key_head_dim": size.linear_k_dim, "linear_value_head_dim": size.linear_v_dim,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": true},
    });
    if moe {
        text_cfg["num_experts"] = json!(size.experts);
        text_cfg["num_experts_per_tok"] = json!(size.top_k);
        text_cfg["moe_intermediate_size"] = json!(size.inter);
        text_cfg["shared_expert_intermediate_size"] = json!(size.inter);
    } else {
        text_cfg["intermediate_size"] = json!(size.inter);
    }
    let (causal, cond) = if moe {
        (
            "Qwen3_5MoeForCausalLM",
            "Qwen3_5MoeForConditionalGeneration",
        )
    } else {
        ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    };
    let cfg = if size.multimodal {
        json!({"architectures": [cond], "model_type": if moe { "qwen3_5_moe" } else { "qwen3_5" },
               "text_config": text_cfg, "vision_config": {"hidden_size": 32, "depth": 1},
               "tie_word_embeddings": false})
    } else {
        text_cfg["architectures"] = json!([causal]);
        text_cfg
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&cfg).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())
}

/// Two BF16 shards split by name, plus `model.safetensors.index.json`.
fn write_shards(
    dir: &Path,
    mut tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
) -> Result<(), String> {
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
