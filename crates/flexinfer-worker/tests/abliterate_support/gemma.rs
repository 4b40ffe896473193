//! Tiny generated Gemma 4 models (dense, MoE with fused experts, the multimodal wrapper) with a planted refusal
//! direction, for the abliteration tests. The post-attention / post-feedforward norms get strongly non-uniform
//! weights, so an edit that ignores them leaves a visible component along the direction.
#![allow(dead_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use super::tiny::{
    normalize, project_out, prompt, tokenizer_json, vocab, write_safetensors, Rng, Tensor,
    TinyModel,
};

pub const G_HIDDEN: usize = 32;
pub const G_HEADS: usize = 4;
pub const G_KV_HEADS: usize = 2;
pub const G_HEAD_DIM: usize = 8;
pub const G_INTER: usize = 64;
pub const G_EXPERT_INTER: usize = 16;

#[derive(Clone, Debug)]
pub struct GemmaOpts {
    /// `F32` or `BF16`.
    pub dtype: &'static str,
    pub layers: usize,
    /// Layer whose MLP (Gemma 4 MoE: its dense MLP) writes the planted direction for refusal prompts.
    pub planted: usize,
    /// Routed experts beside the dense MLP (`enable_moe_block`); 0 = dense.
    pub moe_experts: usize,
    /// `Gemma4ForConditionalGeneration`: the text stack under `model.language_model.`, plus a vision tower.
    pub multimodal: bool,
    /// Standard deviation of the log of the post-norm weights (0 = all ones).
    pub norm_spread: f32,
    /// The lm_head is the embedding table (Gemma's default); otherwise an own `lm_head.weight` with small rows.
    pub tied: bool,
    pub seed: u64,
}

impl Default for GemmaOpts {
    fn default() -> Self {
        GemmaOpts {
            dtype: "F32",
            layers: 8,
            planted: 3,
            moe_experts: 0,
            multimodal: false,
            norm_spread: 0.6,
            tied: false,
            seed: 5,
        }
    }
}

/// Names of the vision tower's tensors in the multimodal layout (never modified).
pub const TOWER_TENSORS: [&str; 3] = [
    "model.vision_tower.encoder.layers.0.self_attn.o_proj.weight",
    "model.vision_tower.encoder.layers.0.mlp.down_proj.weight",
    "model.embed_vision.embedding_projection.weight",
];

/// The text stack's tensor prefix.
pub fn text_prefix(o: &GemmaOpts) -> &'static str {
    if o.multimodal {
        "model.language_model."
    } else {
        "model."
    }
}

/// Builds the model directory (`<tmp>/model`) and the two prompt datasets (`<tmp>/data`).
pub fn build_gemma(o: &GemmaOpts) -> TinyModel {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model");
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = Rng::new(o.seed);
    let h = G_HIDDEN;
    let rand_vec = |rng: &mut Rng, n: usize, std: f32| -> Vec<f32> {
        (0..n).map(|_| rng.gauss() * std).collect()
    };
    // Per-channel scales exp(N(0, spread)) times `level`.
    let norm = |rng: &mut Rng, level: f32| -> Vec<f32> {
        (0..h)
            .map(|_| level * (rng.gauss() * o.norm_spread).exp())
            .collect()
    };
    // u: written for refusal prompts; w: written for the others; c: in every embedding (read to write w);
    // m: the refusal tokens' marker (read to write u).
    let mut u = rand_vec(&mut rng, h, 1.0);
    normalize(&mut u);
    let mut w = rand_vec(&mut rng, h, 1.0);
    project_out(&mut w, &u);
    normalize(&mut w);
    let mut c = rand_vec(&mut rng, h, 1.0);
    for d in [&u, &w] {
        project_out(&mut c, d);
    }
    normalize(&mut c);
    // The planted layer's output norm(s); every other writer's output norm is weak (level NOISE), so the
    // residual carries the embeddings and the plant.
    const PLANT: f32 = 2.0;
    const NOISE: f32 = 0.05;
    let (planted_ff, planted_inner) = if o.moe_experts == 0 {
        (norm(&mut rng, PLANT), None)
    } else {
        (norm(&mut rng, PLANT), Some(norm(&mut rng, 1.0)))
    };
    let g: Vec<f32> = match &planted_inner {
        Some(inner) => planted_ff.iter().zip(inner).map(|(a, b)| a * b).collect(),
        None => planted_ff.clone(),
    };
    // The marker stays orthogonal to what the planted layer writes as the residual sees it (g ⊙ u, g ⊙ w), so
    // the refusal embeddings add little along the measured direction.
    let gu: Vec<f32> = g.iter().zip(&u).map(|(a, b)| a * b).collect();
    let gw: Vec<f32> = g.iter().zip(&w).map(|(a, b)| a * b).collect();
    let mut basis: Vec<Vec<f32>> = Vec::new();
    for v in [&u, &w, &c, &gu, &gw] {
        let mut b = v.clone();
        for e in &basis {
            project_out(&mut b, e);
        }
        normalize(&mut b);
        basis.push(b);
    }
    let mut m = rand_vec(&mut rng, h, 1.0);
    for e in &basis {
        project_out(&mut m, e);
    }
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
    let tp = text_prefix(o);
    // Embeddings (the forward multiplies them by sqrt(hidden)): small random rows with nothing along the basis,
    // 2·c everywhere, a weak marker 0.3·m on refusal (upper-case) tokens.
    let mut emb = Vec::new();
    for tok in &vocab {
        let mut e = rand_vec(&mut rng, h, 0.3);
        for b in basis.iter().chain([&m]) {
            project_out(&mut e, b);
        }
        e.iter_mut().zip(&c).for_each(|(x, cv)| *x += 2.0 * cv);
        if tok.chars().all(|ch| ch.is_ascii_uppercase()) {
            e.iter_mut().zip(&m).for_each(|(x, mv)| *x += 0.3 * mv);
        }
        emb.extend(e);
    }
    put(
        format!("{tp}embed_tokens.weight"),
        vec![vocab.len(), h],
        emb,
    );
    let hd = G_HEAD_DIM;
    let (q, kv) = (G_HEADS * hd, G_KV_HEADS * hd);
    for l in 0..o.layers {
        let p = format!("{tp}layers.{l}.");
        put(format!("{p}input_layernorm.weight"), vec![h], vec![1.0; h]);
        put(
            format!("{p}pre_feedforward_layernorm.weight"),
            vec![h],
            vec![1.0; h],
        );
        let attn_norm = norm(&mut rng, NOISE);
        put(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            attn_norm,
        );
        let planted = l == o.planted;
        let ff_norm = if planted {
            planted_ff.clone()
        } else {
            norm(&mut rng, NOISE)
        };
        put(
            format!("{p}self_attn.q_norm.weight"),
            vec![hd],
            vec![1.0; hd],
        );
        put(
            format!("{p}self_attn.k_norm.weight"),
            vec![hd],
            vec![1.0; hd],
        );
        put(
            format!("{p}self_attn.q_proj.weight"),
            vec![q, h],
            rand_vec(&mut rng, q * h, 0.1),
        );
        put(
            format!("{p}self_attn.k_proj.weight"),
            vec![kv, h],
            rand_vec(&mut rng, kv * h, 0.1),
        );
        put(
            format!("{p}self_attn.v_proj.weight"),
            vec![kv, h],
            rand_vec(&mut rng, kv * h, 0.1),
        );
        put(
            format!("{p}self_attn.o_proj.weight"),
            vec![h, q],
            rand_vec(&mut rng, h * q, 0.1),
        );
        put(
            format!("{p}layer_scalar"),
            vec![1],
            vec![0.6 + 0.8 * rng.uniform() as f32],
        );
        let mut gate = rand_vec(&mut rng, G_INTER * h, 0.02);
        let mut up = rand_vec(&mut rng, G_INTER * h, 0.02);
        let mut down = rand_vec(&mut rng, h * G_INTER, 0.02);
        if l == o.planted {
            // Unit 0 reads the marker and writes u; unit 1 reads the constant c and writes w. After the output
            // norm the refusal prompts add (mostly) g ⊙ u, the others g ⊙ w.
            for ch in 0..h {
                gate[ch] = 12.0 * m[ch];
                up[ch] = 12.0 * m[ch];
                gate[h + ch] = c[ch];
                up[h + ch] = c[ch];
                down[ch * G_INTER] = u[ch];
                down[ch * G_INTER + 1] = w[ch];
            }
        }
        put(format!("{p}mlp.gate_proj.weight"), vec![G_INTER, h], gate);
        put(format!("{p}mlp.up_proj.weight"), vec![G_INTER, h], up);
        put(format!("{p}mlp.down_proj.weight"), vec![h, G_INTER], down);
        if o.moe_experts == 0 {
            put(
                format!("{p}post_feedforward_layernorm.weight"),
                vec![h],
                ff_norm,
            );
        } else {
            // The dense MLP's own output norm carries the non-uniform scale; the sum's norm another one; the
            // experts' branch is kept small.
            let e = o.moe_experts;
            let ei = G_EXPERT_INTER;
            let inner = match (&planted_inner, planted) {
                (Some(i), true) => i.clone(),
                _ => norm(&mut rng, 1.0),
            };
            put(
                format!("{p}post_feedforward_layernorm_1.weight"),
                vec![h],
                inner,
            );
            put(
                format!("{p}post_feedforward_layernorm.weight"),
                vec![h],
                ff_norm,
            );
            put(
                format!("{p}post_feedforward_layernorm_2.weight"),
                vec![h],
                norm(&mut rng, 0.1),
            );
            put(
                format!("{p}pre_feedforward_layernorm_2.weight"),
                vec![h],
                vec![1.0; h],
            );
            put(
                format!("{p}router.proj.weight"),
                vec![e, h],
                rand_vec(&mut rng, e * h, 0.3),
            );
            put(format!("{p}router.scale"), vec![h], vec![1.0; h]);
            put(format!("{p}router.per_expert_scale"), vec![e], vec![1.0; e]);
            put(
                format!("{p}experts.gate_up_proj"),
                vec![e, 2 * ei, h],
                rand_vec(&mut rng, e * 2 * ei * h, 0.1),
            );
            put(
                format!("{p}experts.down_proj"),
                vec![e, h, ei],
                rand_vec(&mut rng, e * h * ei, 0.1),
            );
        }
    }
    put(format!("{tp}norm.weight"), vec![h], vec![1.0; h]);
    if !o.tied {
        put(
            "lm_head.weight".into(),
            vec![vocab.len(), h],
            rand_vec(&mut rng, vocab.len() * h, 0.05),
        );
    }
    if o.multimodal {
        for (name, shape) in TOWER_TENSORS.iter().zip([[h, h], [h, G_INTER], [h, 16]]) {
            let n = shape[0] * shape[1];
            put(name.to_string(), shape.to_vec(), rand_vec(&mut rng, n, 0.1));
        }
    }
    write_safetensors(&dir.join("model.safetensors"), &t);

    let layer_types: Vec<&str> = (0..o.layers)
        .map(|l| {
            if (l + 1) % 4 == 0 {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    let mut text = serde_json::json!({
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": h,
        "intermediate_size": G_INTER,
        "num_hidden_layers": o.layers,
        "num_attention_heads": G_HEADS,
        "num_key_value_heads": G_KV_HEADS,
        "head_dim": hd,
        "global_head_dim": hd,
        "attention_k_eq_v": false,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "layer_types": layer_types,
        "sliding_window": 4,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.5, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "vocab_size": vocab.len(),
        "tie_word_embeddings": o.tied,
        "enable_moe_block": o.moe_experts > 0,
        "torch_dtype": if o.dtype == "F32" { "float32" } else { "bfloat16" },
    });
    if o.moe_experts > 0 {
        text["num_experts"] = serde_json::json!(o.moe_experts);
        text["top_k_experts"] = serde_json::json!(2);
        text["moe_intermediate_size"] = serde_json::json!(G_EXPERT_INTER);
    }
    let config = if o.multimodal {
        let mut tc = text.clone();
        tc.as_object_mut().unwrap().remove("architectures");
        serde_json::json!({
            "architectures": ["Gemma4ForConditionalGeneration"],
            "model_type": "gemma4",
            "text_config": tc,
            "vision_config": {"hidden_size": h, "model_type": "gemma4_vision"},
            "tie_word_embeddings": o.tied,
        })
    } else {
        text
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json()).unwrap();
    std::fs::write(dir.join("generation_config.json"), "{\"do_sample\": false}").unwrap();

    let data = root.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let refusal = data.join("refusal.jsonl");
    let harmless = data.join("harmless.txt");
    let (mut r, mut hl) = (String::new(), String::new());
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
