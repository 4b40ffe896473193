//! A generated Gemma 4 model ([`write_gemma4_model`]): dense or with routed experts.

use serde_json::json;
use std::path::Path;

use super::*;

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
    let (mut rng, text, mut tensors) = start_model(dir, seed, opts.multimodal, (vocab, h, 0.05))?;
    let mut randn = |n: usize, std: f32| normal_samples(&mut rng, n, std);
    let mut push = |name: String, shape: Vec<usize>, v: Vec<f32>| tensors.push((name, shape, v));
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
