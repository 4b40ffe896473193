//! Abliteration of Gemma 2 / 3 / 4 (dense, MoE, multimodal wrapper): Gemma RMS-normalises each writer's output
//! and scales it per channel (`post_attention_layernorm`, `post_feedforward_layernorm`, Gemma 4 MoE's
//! `post_feedforward_layernorm_1` inside the sum's norm) before the residual add, so the edit orthogonalizes
//! against `g ⊙ r`, not `r`.
//!
//! What reaches the residual is measured with the engine's forward on the oracle fixtures and on generated
//! models: after the norm-aware edit each edited writer's contribution has `|⟨c, r⟩| ≤ BOUND · ‖c‖` per token,
//! and the edit that projects against `r` alone (what the Llama family needs) violates that by far.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod abliterate_support;

use std::path::{Path, PathBuf};

use abliterate_support::*;
use faer::Mat;
use flexinfer_contract::{events, files, AbliterationStatusFile};
use flexinfer_quant::llama::{
    attention_delta, embed, layer_forward, logits, mlp_output, Rope, Stage,
};
use flexinfer_quant::model::ModelConfig;
use flexinfer_quant::tensors::TensorStore;
use flexinfer_worker::abliterate::edit::{self, Matrix, TargetLayers};
use flexinfer_worker::abliterate::forward::{Arch, LayerModel};
use flexinfer_worker::abliterate::{ortho, output, Settings};

/// Largest `|⟨c, r⟩| / ‖c‖` allowed for an edited writer's residual contribution `c` (f32 weights and forward;
/// the measured values are around 1e-7).
const BOUND: f64 = 1e-4;

/// The naive edit must exceed the bound by at least this factor (so the test tells the two apart).
const NAIVE_FACTOR: f64 = 10.0;

/// Whole jobs: the projection check's separation along the direction after the edit, at most this fraction of
/// before (what is left comes from the unedited embeddings and layer 0; the edit that ignores the norms leaves
/// about a quarter).
const PROJECTION_DROP: f64 = 0.1;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/oracle")
        .join(name)
}

fn settings(layers: usize) -> Settings {
    Settings {
        target: TargetLayers::List((0..layers).collect()),
        matrices: vec![Matrix::OProj, Matrix::DownProj],
        skip_gdn: true,
        skip_vision: true,
        lm_head: false,
        norm_threshold: 100.0,
        max_ppl_increase_percent: 5.0,
    }
}

fn unit_direction(d: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut r: Vec<f32> = (0..d).map(|_| rng.gauss()).collect();
    normalize(&mut r);
    r
}

struct Measured {
    /// Largest alignment over tokens, layers and edited writers.
    worst: f64,
    /// Edited writers measured (o_proj and down_proj per layer).
    writers: usize,
}

/// Edits every o_proj / down_proj of the text stack with the direction `r` (`aware`: with the output norms, as
/// the phase does; otherwise projecting against `r` alone), runs the edited model with the engine's forward and
/// measures each edited writer's contribution to the residual after its output norm.
fn measure(dir: &Path, r: &[f32], aware: bool) -> Measured {
    let store = TensorStore::open_dir(dir).unwrap();
    let raw = output::read_config(dir).unwrap();
    let layout = edit::Layout::from_model(&store, &raw).unwrap();
    let arch = Arch::load(dir, &layout).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let cfg = &arch.cfg;
    let s = settings(cfg.num_layers);
    let targets = edit::select_target_layers(&layout, &s).unwrap();
    let mut plan = edit::plan(&layout, &s, &targets.layers).unwrap();
    edit::attach_output_norms(&mut plan, &store, cfg).unwrap();
    assert!(
        plan.edits.iter().all(|e| e.out_norm.is_some()),
        "every Gemma writer has its output norm"
    );
    if !aware {
        plan.edits.iter_mut().for_each(|e| e.out_norm = None);
    }
    let tokens: Vec<u32> = (0..20u32)
        .map(|i| (i * 7 + 3) % cfg.vocab_size as u32)
        .collect();
    let rope = Rope::new(cfg, tokens.len());
    let mut x = embed(&store, cfg, None, &tokens).unwrap();
    let (mut worst, mut writers) = (0f64, 0usize);
    for layer in 0..cfg.num_layers {
        let mut lm = LayerModel::load(&store, &arch, layer).unwrap();
        let prefix = cfg.layer_prefix(layer);
        let mut edited = Vec::new();
        for e in plan.edits.iter().filter(|e| e.layer == Some(layer)) {
            let rest = e.tensor.strip_prefix(&prefix).unwrap();
            let (_, v) = ortho::edited_tensor(&store, e, r).unwrap();
            let (lin, bias) = lm
                .linear_mut(rest)
                .unwrap_or_else(|| panic!("{}", e.tensor));
            assert!(!bias);
            let cols = lin.w.ncols();
            lin.w = Mat::from_fn(lin.w.nrows(), cols, |i, j| v[i * cols + j]);
            edited.push(rest.to_string());
        }
        let lw = &lm.lw;
        let att = layer_forward(cfg, lw, x.as_ref(), &rope, Some(Stage::O));
        let c_attn = attention_delta(cfg, lw, att.as_ref());
        let x1 = &x + &c_attn;
        let c_mlp = mlp_output(cfg, lw, x1.as_ref());
        // The engine's layer is exactly x + attention + MLP (times Gemma 4's layer_scalar).
        let out = layer_forward(cfg, lw, x.as_ref(), &rope, None);
        let s = lw.layer_scalar.unwrap_or(1.0);
        for t in 0..out.nrows() {
            for j in 0..out.ncols() {
                let want = (x1[(t, j)] + c_mlp[(t, j)]) * s;
                assert!((out[(t, j)] - want).abs() <= 1e-4 * (1.0 + want.abs()));
            }
        }
        // The dense MLP's contribution: on Gemma 4 MoE it is summed with the experts' and the sum normalised; with
        // the experts' branch zeroed the engine yields it alone, up to the per-token factor of the sum's norm,
        // which changes neither its direction nor the ratio measured.
        let c_dense = match lw.moe.as_ref().and_then(|m| m.gemma4.as_ref()) {
            Some(_) => {
                let mut alone = lw.clone();
                let g4 = alone.moe.as_mut().unwrap().gemma4.as_mut().unwrap();
                g4.experts_out_norm.iter_mut().for_each(|v| *v = 0.0);
                mlp_output(cfg, &alone, x1.as_ref())
            }
            None => c_mlp.clone(),
        };
        for rest in &edited {
            let c = match rest.as_str() {
                "self_attn.o_proj.weight" => &c_attn,
                "mlp.down_proj.weight" => &c_dense,
                other => panic!("unexpected edit {other}"),
            };
            worst = worst.max(worst_alignment(c.as_ref(), r));
            writers += 1;
        }
        x = out;
    }
    Measured { worst, writers }
}

fn check_model(name: &str, dir: &Path, layers: usize) {
    let store = TensorStore::open_dir(dir).unwrap();
    let cfg = ModelConfig::load(dir).unwrap();
    drop(store);
    let r = unit_direction(cfg.hidden_size, 41);
    let aware = measure(dir, &r, true);
    let naive = measure(dir, &r, false);
    eprintln!(
        "{name}: {} writers, worst |<c,r>|/|c|: norm-aware {:.3e}, projection against r {:.3e} (bound {BOUND:e})",
        aware.writers, aware.worst, naive.worst
    );
    assert_eq!(aware.writers, 2 * layers, "{name}");
    assert!(
        aware.worst <= BOUND,
        "{name}: an edited writer still adds {:.3e} of its norm along r (bound {BOUND:e})",
        aware.worst
    );
    assert!(
        naive.worst >= NAIVE_FACTOR * BOUND,
        "{name}: the naive edit stays within {:.3e}; the test would not notice a missing norm correction",
        naive.worst
    );
}

#[test]
fn norm_aware_edit_leaves_nothing_along_the_direction_in_the_residual_fixtures() {
    for name in [
        "gemma2",
        "gemma3_text",
        "gemma4_text",
        "gemma4_moe",
        "gemma4_mm",
    ] {
        let dir = fixture(name);
        let layers = ModelConfig::load(&dir).unwrap().num_layers;
        check_model(name, &dir, layers);
    }
}

#[test]
fn norm_aware_edit_leaves_nothing_along_the_direction_in_the_residual_generated() {
    for (name, o) in [
        ("generated gemma4 dense", GemmaOpts::default()),
        (
            "generated gemma4 moe",
            GemmaOpts {
                moe_experts: 4,
                ..Default::default()
            },
        ),
        (
            "generated gemma4 multimodal",
            GemmaOpts {
                multimodal: true,
                ..Default::default()
            },
        ),
    ] {
        let model = build_gemma(&o);
        check_model(name, &model.dir, o.layers);
    }
}

// ---- whole jobs ----

fn status(model: &TinyModel) -> AbliterationStatusFile {
    let text = std::fs::read_to_string(model.dir.join(files::ABLITERATION_STATUS)).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn manifest_direction(out: &Path) -> Vec<f32> {
    let m: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join(files::ABLITERATION_MANIFEST)).unwrap(),
    )
    .unwrap();
    m["result"]["direction"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

/// Runs a whole abliterate job on a generated Gemma 4 model and checks the output.
fn whole_job(o: &GemmaOpts) {
    let model = build_gemma(o);
    let out = model.root.path().join("out");
    // A tied lm_head reads the residual with the embedding rows, whose size makes the tiny random model's
    // perplexity (≈ its vocabulary) react more to the edit; the gate itself is tested on Llama models.
    let ppl_limit = if o.tied { 20.0 } else { 5.0 };
    let limit = ppl_limit.to_string();
    let r = run(
        &model,
        &out,
        &[
            ("NUM_SAMPLES", "40"),
            ("MAX_PERPLEXITY_INCREASE_PERCENT", limit.as_str()),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    let st = status(&model);
    assert_eq!(st.status, "completed");
    // The plant is not cancelled afterwards: any layer from the planted one on carries it.
    assert!(st.layer as usize >= o.planted, "{}", r.stdout);
    // auto on 8 layers: layers 1..=6.
    assert_eq!(st.layers_modified, 6);
    let (pb, pa) = (st.perplexity_before.unwrap(), st.perplexity_after.unwrap());
    assert!(pa <= pb * (1.0 + ppl_limit / 100.0), "{pb} -> {pa}");

    // The phase's projection check: the classes' separation along the direction collapses.
    let evs = events(&r.stdout);
    let gate = evs
        .iter()
        .find(|e| e["event"] == events::ABLITERATION_GATE)
        .unwrap();
    assert_eq!(gate["gate"], "passed");
    let before = gate["refusalProjectionBefore"].as_f64().unwrap();
    let after = gate["refusalProjectionAfter"].as_f64().unwrap();
    eprintln!(
        "{} experts={} multimodal={}: projection check {before:.4} -> {after:.4} (ratio {:.4})",
        o.dtype,
        o.moe_experts,
        o.multimodal,
        after.abs() / before
    );
    assert!(before > 1.0, "{before}");
    assert!(
        after.abs() <= PROJECTION_DROP * before,
        "separation along the direction fell only from {before} to {after}"
    );

    // Exactly the planned writers changed; experts, norms, router, towers and embeddings are byte-identical.
    let tp = text_prefix(o);
    let src = TensorStore::open_dir(&model.dir).unwrap();
    let dst = TensorStore::open_dir(&out).unwrap();
    assert_eq!(src.entries.len(), dst.entries.len());
    let mut changed: Vec<String> = src
        .entries
        .keys()
        .filter(|n| src.raw(n).unwrap() != dst.raw(n).unwrap())
        .cloned()
        .collect();
    changed.sort();
    let mut expected: Vec<String> = (1..=6)
        .flat_map(|l| {
            [
                format!("{tp}layers.{l}.mlp.down_proj.weight"),
                format!("{tp}layers.{l}.self_attn.o_proj.weight"),
            ]
        })
        .collect();
    expected.sort();
    assert_eq!(changed, expected);
    if o.multimodal {
        for t in TOWER_TENSORS {
            assert_eq!(src.raw(t).unwrap(), dst.raw(t).unwrap(), "{t}");
        }
    }
    if o.moe_experts > 0 {
        assert!(
            evs.iter().any(|e| e["event"] == "warning"
                && e["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("8 expert down_proj tensors are never modified")),
            "{}",
            r.stdout
        );
    }

    // Each written writer is orthogonal to g ⊙ r (g: its output norm(s) as multiplied: `w` in Gemma 4), and so
    // not to r itself.
    let rdir = manifest_direction(&out);
    for l in 1..=6 {
        let p = format!("{tp}layers.{l}.");
        let norm = |n: &str| dst.f32(&format!("{p}{n}.weight")).unwrap();
        for (m, g) in [
            ("self_attn.o_proj", norm("post_attention_layernorm")),
            (
                "mlp.down_proj",
                if o.moe_experts > 0 {
                    let (a, b) = (
                        norm("post_feedforward_layernorm_1"),
                        norm("post_feedforward_layernorm"),
                    );
                    a.iter().zip(&b).map(|(x, y)| x * y).collect()
                } else {
                    norm("post_feedforward_layernorm")
                },
            ),
        ] {
            let name = format!("{p}{m}.weight");
            let cols = dst.entry(&name).unwrap().shape[1];
            let w = dst.f32(&name).unwrap();
            let mut v: Vec<f32> = g.iter().zip(&rdir).map(|(a, b)| a * b).collect();
            normalize(&mut v);
            let aware = relative_projection(&v, &w, cols);
            let naive = relative_projection(&rdir, &w, cols);
            let tol = if o.dtype == "F32" { 1e-5 } else { 2e-2 };
            assert!(aware <= tol, "{name}: |(g⊙r)ᵀW| = {aware:e}");
            assert!(naive > 10.0 * tol, "{name}: |rᵀW| = {naive:e}");
        }
    }

    // The output is a model the engine reads: config, every layer, logits.
    let cfg = ModelConfig::load(&out).unwrap();
    let toks: Vec<u32> = (0..12).collect();
    let l = logits(&dst, &cfg, &toks).unwrap();
    assert_eq!((l.nrows(), l.ncols()), (12, cfg.vocab_size));
    for t in 0..l.nrows() {
        for j in 0..l.ncols() {
            assert!(l[(t, j)].is_finite());
        }
    }
}

#[test]
fn gemma4_dense_whole_job_removes_the_direction_and_writes_a_readable_model() {
    whole_job(&GemmaOpts::default());
}

#[test]
fn gemma4_moe_whole_job_edits_the_dense_mlp_and_leaves_the_experts() {
    whole_job(&GemmaOpts {
        moe_experts: 4,
        seed: 9,
        ..Default::default()
    });
}

#[test]
fn gemma4_multimodal_tied_whole_job_edits_the_text_stack_and_copies_the_towers() {
    whole_job(&GemmaOpts {
        multimodal: true,
        dtype: "BF16",
        tied: true,
        ..Default::default()
    });
}
