//! Abliteration of the gated delta-net hybrids (Qwen3-Next, Qwen3.5 dense / MoE / multimodal): the residual
//! writers are `self_attn.o_proj` in the full-attention layers, `linear_attn.out_proj` in the linear-attention
//! layers (edited only with `skipGDNLayers: false`) and the dense or shared-expert `down_proj`; routed experts
//! are never edited.
//!
//! - On the oracle fixtures (transformers' random-weight models): after the edit, what each edited token mixer
//!   adds to the residual (the engine's forward) has `|⟨c, r⟩| ≤ BOUND · ‖c‖` per token, where the unedited
//!   model's contribution is far from orthogonal; every edited MLP writer has `rᵀW ≈ 0`.
//! - Whole jobs on generated Qwen3.5-shaped models: exit 0, exactly the planned tensors change (and which
//!   depends on `skipGDNLayers`), the output is read back by the engine.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod abliterate_support;

use std::path::{Path, PathBuf};

use abliterate_support::*;
use faer::Mat;
use flexinfer_quant::llama::{attention_delta, embed, layer_forward, logits, Rope, Stage};
use flexinfer_quant::model::ModelConfig;
use flexinfer_quant::tensors::TensorStore;
use flexinfer_quant::testkit::{write_hybrid_model, HybridSize};
use flexinfer_worker::abliterate::edit::{self, Matrix, TargetLayers};
use flexinfer_worker::abliterate::forward::{Arch, LayerModel};
use flexinfer_worker::abliterate::{ortho, output, Settings};

/// Largest `|⟨c, r⟩| / ‖c‖` of an edited mixer's residual contribution (f32 weights and forward).
const BOUND: f64 = 1e-4;
/// The unedited contribution must be at least this much further along r (so the check can fail).
const UNEDITED_FACTOR: f64 = 10.0;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle")
        .join(name)
}

fn settings(layers: usize, skip_gdn: bool) -> Settings {
    Settings {
        target: TargetLayers::List((0..layers).collect()),
        matrices: vec![Matrix::OProj, Matrix::DownProj],
        skip_gdn,
        skip_vision: true,
        lm_head: false,
        norm_threshold: 100.0,
        max_ppl_increase_percent: 5.0,
    }
}

#[derive(Default, Debug)]
struct Measured {
    /// Largest alignment of an edited (or, unedited, of the same) mixer's contribution.
    mixers: f64,
    /// Largest relative `rᵀW` of an edited MLP writer.
    mlp_writers: f64,
    /// Edited tensors by kind: o_proj, out_proj, down_proj (dense or shared expert).
    o_proj: usize,
    out_proj: usize,
    down_proj: usize,
}

/// Plans the edit of every layer's writers (`skipGDNLayers: false`), applies it (or not) in memory, runs the
/// engine's forward layer by layer and measures the edited writers.
fn measure(dir: &Path, r: &[f32], apply: bool) -> Measured {
    let store = TensorStore::open_dir(dir).unwrap();
    let raw = output::read_config(dir).unwrap();
    let layout = edit::Layout::from_model(&store, &raw).unwrap();
    let arch = Arch::load(dir, &layout).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let cfg = &arch.cfg;
    let s = settings(cfg.num_layers, false);
    let targets = edit::select_target_layers(&layout, &s).unwrap();
    let mut plan = edit::plan(&layout, &s, &targets.layers).unwrap();
    edit::attach_output_norms(&mut plan, &store, cfg).unwrap();
    assert!(
        plan.edits.iter().all(|e| e.out_norm.is_none()),
        "Qwen writers have no output norm"
    );
    let tokens: Vec<u32> = (0..20u32)
        .map(|i| (i * 7 + 3) % cfg.vocab_size as u32)
        .collect();
    let rope = Rope::new(cfg, tokens.len());
    let mut x = embed(&store, cfg, None, &tokens).unwrap();
    let mut m = Measured::default();
    for layer in 0..cfg.num_layers {
        let mut lm = LayerModel::load(&store, &arch, layer).unwrap();
        let prefix = cfg.layer_prefix(layer);
        let mut mixer_edited = false;
        for e in plan.edits.iter().filter(|e| e.layer == Some(layer)) {
            let rest = e.tensor.strip_prefix(&prefix).unwrap();
            let (lin, bias) = lm
                .linear_mut(rest)
                .unwrap_or_else(|| panic!("{} has no linear in the forward", e.tensor));
            assert!(!bias);
            let cols = lin.w.ncols();
            if apply {
                let (_, v) = ortho::edited_tensor(&store, e, r).unwrap();
                lin.w = Mat::from_fn(lin.w.nrows(), cols, |i, j| v[i * cols + j]);
            }
            match rest {
                "self_attn.o_proj.weight" => {
                    m.o_proj += 1;
                    mixer_edited = true;
                }
                "linear_attn.out_proj.weight" => {
                    m.out_proj += 1;
                    mixer_edited = true;
                }
                "mlp.down_proj.weight" | "mlp.shared_expert.down_proj.weight" => {
                    m.down_proj += 1;
                    let w: Vec<f32> = (0..lin.w.nrows())
                        .flat_map(|i| (0..cols).map(move |j| (i, j)))
                        .map(|(i, j)| lin.w[(i, j)])
                        .collect();
                    m.mlp_writers = m.mlp_writers.max(relative_projection(r, &w, cols));
                }
                other => panic!("unexpected edit {other}"),
            }
        }
        let lw = &lm.lw;
        assert!(
            mixer_edited,
            "layer {layer}: its token mixer's writer was not planned"
        );
        let att = layer_forward(cfg, lw, x.as_ref(), &rope, Some(Stage::O));
        let c = attention_delta(cfg, lw, att.as_ref());
        m.mixers = m.mixers.max(worst_alignment(c.as_ref(), r));
        x = layer_forward(cfg, lw, x.as_ref(), &rope, None);
    }
    m
}

#[test]
fn edit_leaves_nothing_along_the_direction_in_the_hybrid_fixtures() {
    for name in ["qwen3_next", "qwen3_5", "qwen3_5_moe_mm"] {
        let dir = fixture(name);
        let cfg = ModelConfig::load(&dir).unwrap();
        let mut rng = Rng::new(41);
        let mut r: Vec<f32> = (0..cfg.hidden_size).map(|_| rng.gauss()).collect();
        normalize(&mut r);
        let edited = measure(&dir, &r, true);
        let unedited = measure(&dir, &r, false);
        eprintln!("{name}: edited {edited:?}; unedited {unedited:?}");
        let linear = (0..cfg.num_layers)
            .filter(|&l| cfg.is_linear_attention(l))
            .count();
        assert!(linear > 0, "{name}: a hybrid");
        assert_eq!(edited.out_proj, linear, "{name}");
        assert_eq!(edited.o_proj, cfg.num_layers - linear, "{name}");
        assert!(
            edited.down_proj > 0,
            "{name}: a dense or shared-expert down_proj"
        );
        assert!(
            edited.mixers <= BOUND,
            "{name}: an edited mixer still adds {:.3e} of its norm along r",
            edited.mixers
        );
        assert!(
            unedited.mixers >= UNEDITED_FACTOR * BOUND,
            "{name}: unedited mixers are already orthogonal ({:.3e}): the check would not notice",
            unedited.mixers
        );
        assert!(
            edited.mlp_writers <= 1e-5,
            "{name}: {:.3e}",
            edited.mlp_writers
        );
        assert!(
            unedited.mlp_writers > 1e-3,
            "{name}: {:.3e}",
            unedited.mlp_writers
        );
    }
}

// ---- whole jobs ----

/// A generated Qwen3.5-shaped hybrid (4 layers: 3 linear attention, 1 full) with the prompt datasets.
fn hybrid_model(size: &HybridSize) -> TinyModel {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model");
    write_hybrid_model(&dir, size, 11).unwrap();
    // The prompts use upper and lower case (refusal vs harmless): the support tokenizer has both (67 tokens,
    // within the generated vocabulary of 256).
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json()).unwrap();
    let (refusal, harmless) = (
        root.path().join("refusal.txt"),
        root.path().join("harmless.txt"),
    );
    let mut rng = Rng::new(3);
    let mut lines = |upper: bool| -> String {
        (0..40)
            .map(|_| prompt(&mut rng, upper) + "\n")
            .collect::<String>()
    };
    std::fs::write(&refusal, lines(true)).unwrap();
    std::fs::write(&harmless, lines(false)).unwrap();
    TinyModel {
        root,
        dir,
        u: Vec::new(),
        refusal,
        harmless,
    }
}

/// Runs the phase on layers 1–3 and returns the text-stack tensors it changed (layer-relative names with the
/// layer number, e.g. `3.self_attn.o_proj.weight`).
fn changed_by_job(model: &TinyModel, skip_gdn: bool) -> Vec<String> {
    let out = model.root.path().join(format!("out-skip-gdn-{skip_gdn}"));
    let skip = skip_gdn.to_string();
    let r = run(
        model,
        &out,
        &[
            ("TARGET_LAYERS", "1,2,3"),
            ("SKIP_GDN_LAYERS", skip.as_str()),
            // Random weights: the gate's perplexity bound is not what is tested here.
            ("MAX_PERPLEXITY_INCREASE_PERCENT", "1000"),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    if skip_gdn {
        assert!(
            events(&r.stdout).iter().any(|e| e["message"]
                .as_str()
                .unwrap_or("")
                .contains("linear-attention layers [1, 2] are not modified")),
            "{}",
            r.stdout
        );
    }
    let src = TensorStore::open_dir(&model.dir).unwrap();
    let dst = TensorStore::open_dir(&out).unwrap();
    assert_eq!(src.entries.len(), dst.entries.len());
    // The output is a model the engine reads: every layer, finite logits.
    let cfg = ModelConfig::load(&out).unwrap();
    let toks: Vec<u32> = (0..12).collect();
    let l = logits(&dst, &cfg, &toks).unwrap();
    assert!((0..l.nrows()).all(|t| (0..l.ncols()).all(|j| l[(t, j)].is_finite())));
    let mut changed: Vec<String> = src
        .entries
        .keys()
        .filter(|n| src.raw(n).unwrap() != dst.raw(n).unwrap())
        .map(|n| {
            n.split_once("layers.")
                .map(|(_, rest)| rest.to_string())
                .unwrap_or_else(|| n.clone())
        })
        .collect();
    changed.sort();
    changed
}

fn names(v: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = v.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

#[test]
fn dense_hybrid_whole_job_edits_full_attention_and_mlps_and_linear_attention_only_when_asked() {
    let size = HybridSize {
        experts: 0,
        multimodal: false,
        ..HybridSize::TINY_MOE
    };
    let model = hybrid_model(&size);
    assert_eq!(
        changed_by_job(&model, true),
        names(&["3.mlp.down_proj.weight", "3.self_attn.o_proj.weight"])
    );
    assert_eq!(
        changed_by_job(&model, false),
        names(&[
            "1.linear_attn.out_proj.weight",
            "1.mlp.down_proj.weight",
            "2.linear_attn.out_proj.weight",
            "2.mlp.down_proj.weight",
            "3.mlp.down_proj.weight",
            "3.self_attn.o_proj.weight",
        ])
    );
}

#[test]
fn moe_multimodal_hybrid_whole_job_edits_the_shared_expert_and_never_the_routed_ones() {
    let model = hybrid_model(&HybridSize::TINY_MOE);
    assert_eq!(
        changed_by_job(&model, true),
        names(&[
            "3.mlp.shared_expert.down_proj.weight",
            "3.self_attn.o_proj.weight"
        ])
    );
    assert_eq!(
        changed_by_job(&model, false),
        names(&[
            "1.linear_attn.out_proj.weight",
            "1.mlp.shared_expert.down_proj.weight",
            "2.linear_attn.out_proj.weight",
            "2.mlp.shared_expert.down_proj.weight",
            "3.mlp.shared_expert.down_proj.weight",
            "3.self_attn.o_proj.weight",
        ])
    );
}
