//! `flexinfer-worker abliterate` end to end on tiny generated models with a planted direction.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod abliterate_support;

use abliterate_support::*;
use flexinfer_contract::{events, files, AbliterationStatusFile};
use flexinfer_quant::tensors::TensorStore;

fn status(model: &TinyModel) -> AbliterationStatusFile {
    let text = std::fs::read_to_string(model.dir.join(files::ABLITERATION_STATUS)).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn manifest(out: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join(files::ABLITERATION_MANIFEST)).unwrap())
        .unwrap()
}

fn direction(out: &std::path::Path) -> Vec<f32> {
    manifest(out)["result"]["direction"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

/// `[rows, cols]` row-major f32 of a tensor.
fn tensor(store: &TensorStore, name: &str) -> (Vec<f32>, usize) {
    let cols = store.entry(name).unwrap().shape[1];
    (store.f32(name).unwrap(), cols)
}

/// `vᵀ W` for a `[rows, cols]` matrix.
fn project(v: &[f32], w: &[f32], cols: usize) -> Vec<f32> {
    (0..cols)
        .map(|c| v.iter().enumerate().map(|(i, x)| x * w[i * cols + c]).sum())
        .collect()
}

#[test]
fn planted_direction_is_found_removed_and_nothing_else_changes() {
    let model = build(&TinyOpts::default());
    let source_before = checksums(&model.dir);
    let out = model.root.path().join("out");
    let r = run(&model, &out, &[], &[]);
    assert_eq!(r.code, 0, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);

    // The chosen layer is the planted one, and the direction matches the planted vector.
    let st = status(&model);
    assert_eq!(st.status, "completed");
    assert_eq!(st.layer, 3, "{}", r.stdout);
    // auto on 8 layers: 20%–80% depth = layers 1..=6.
    assert_eq!(st.layers_modified, 6);
    assert_eq!(st.weight_matrices, vec!["o_proj", "down_proj"]);
    assert!(
        st.refusal_dir_norm > 5.0 && st.refusal_dir_norm < 100.0,
        "{}",
        st.refusal_dir_norm
    );
    let (pb, pa) = (st.perplexity_before.unwrap(), st.perplexity_after.unwrap());
    assert!(pa <= pb * 1.05, "{pb} -> {pa}");
    let dir = direction(&out);
    let cos = dot(&dir, &model.u) / dot(&dir, &dir).sqrt();
    assert!(cos >= 0.95, "cosine with the planted direction {cos}");

    // Selected matrices no longer write along the direction; orthogonal directions unchanged.
    let src = TensorStore::open_dir(&model.dir).unwrap();
    let dst = TensorStore::open_dir(&out).unwrap();
    let mut rng = Rng::new(99);
    let mut v: Vec<f32> = (0..HIDDEN).map(|_| rng.gauss()).collect();
    let d = dot(&v, &dir);
    v.iter_mut().zip(&dir).for_each(|(x, r)| *x -= d * r);
    for l in 1..=6 {
        for m in ["self_attn.o_proj", "mlp.down_proj"] {
            let name = format!("model.layers.{l}.{m}.weight");
            let (w_new, cols) = tensor(&dst, &name);
            let (w_old, _) = tensor(&src, &name);
            let along = project(&dir, &w_new, cols);
            let max = along.iter().fold(0f32, |a, b| a.max(b.abs()));
            assert!(max < 1e-4, "{name}: |rᵀW| = {max}");
            let a = project(&v, &w_new, cols);
            let b = project(&v, &w_old, cols);
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() < 1e-4,
                    "{name}: orthogonal output changed {x} vs {y}"
                );
            }
        }
    }
    // Everything else is byte-identical.
    for name in src.entries.keys() {
        let edited = (1..=6).any(|l| {
            *name == format!("model.layers.{l}.self_attn.o_proj.weight")
                || *name == format!("model.layers.{l}.mlp.down_proj.weight")
        });
        assert_eq!(
            dst.entry(name).unwrap().shape,
            src.entry(name).unwrap().shape
        );
        if !edited {
            assert_eq!(
                src.raw(name).unwrap(),
                dst.raw(name).unwrap(),
                "{name} changed"
            );
        }
    }
    assert_eq!(src.entries.len(), dst.entries.len());
    for f in ["config.json", "tokenizer.json", "generation_config.json"] {
        assert_eq!(
            std::fs::read(model.dir.join(f)).unwrap(),
            std::fs::read(out.join(f)).unwrap(),
            "{f}"
        );
    }
    // The source is untouched except for the status file.
    let mut after = checksums(&model.dir);
    assert!(after.remove(files::ABLITERATION_STATUS).is_some());
    let after: std::collections::BTreeMap<_, _> = after
        .into_iter()
        .filter(|(k, _)| !k.starts_with("out"))
        .collect();
    assert_eq!(source_before, after);

    // Termination message, events, monotonic progress.
    assert_eq!(r.termination["type"], "abliterate");
    assert_eq!(r.termination["layer"], 3);
    assert_eq!(r.termination["layersModified"], 6);
    let evs = events(&r.stdout);
    let mut last = 0.0;
    for e in evs.iter().filter(|e| e["event"] == "progress") {
        let p = e["percent"].as_f64().unwrap();
        assert!(p >= last, "progress went backwards: {p} < {last}");
        last = p;
    }
    assert!(evs
        .iter()
        .any(|e| e["event"] == events::ABLITERATION_DIRECTION));
    assert!(evs
        .iter()
        .any(|e| e["event"] == events::ABLITERATION_GATE && e["gate"] == "passed"));
    // The projection check: the classes' separation along the direction collapses with the edit.
    let gate = evs
        .iter()
        .find(|e| e["event"] == events::ABLITERATION_GATE)
        .unwrap();
    let before = gate["refusalProjectionBefore"].as_f64().unwrap();
    let after = gate["refusalProjectionAfter"].as_f64().unwrap();
    assert!(
        (before - st.refusal_dir_norm).abs() < 1e-3 * before,
        "{before}"
    );
    assert!(after.abs() < 0.05 * before, "{before} -> {after}");
    assert_eq!(evs.last().unwrap()["event"], "complete");

    // A second run finds the finished output and recomputes nothing.
    let again = run(&model, &out, &[], &[]);
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert!(events(&again.stdout)
        .iter()
        .any(|e| e["event"] == events::ABLITERATION_CACHED));
}

#[test]
fn explicit_layer_list_picks_the_planted_layer_among_them() {
    let model = build(&TinyOpts {
        seed: 11,
        dtype: "F16",
        ..Default::default()
    });
    let out = model.root.path().join("out");
    let r = run(
        &model,
        &out,
        &[("TARGET_LAYERS", "2-5"), ("WEIGHT_MATRICES", "down_proj")],
        &[],
    );
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let st = status(&model);
    assert_eq!(st.layer, 3);
    assert_eq!(st.layers_modified, 4);
    assert_eq!(st.weight_matrices, vec!["down_proj"]);
    let src = TensorStore::open_dir(&model.dir).unwrap();
    let dst = TensorStore::open_dir(&out).unwrap();
    for l in 0..8 {
        let o = format!("model.layers.{l}.self_attn.o_proj.weight");
        assert_eq!(
            src.raw(&o).unwrap(),
            dst.raw(&o).unwrap(),
            "{o} must not change"
        );
        let d = format!("model.layers.{l}.mlp.down_proj.weight");
        let changed = src.raw(&d).unwrap() != dst.raw(&d).unwrap();
        assert_eq!(changed, (2..=5).contains(&l), "{d}");
        assert_eq!(format!("{:?}", dst.entry(&d).unwrap().dtype), "F16");
    }
}

#[test]
fn chat_template_wraps_prompts_before_tokenization() {
    let model = build(&TinyOpts {
        seed: 12,
        chat_template: Some("{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"),
        ..Default::default()
    });
    let sets = flexinfer_worker::abliterate::data::load_prompt_sets(
        &model.dir,
        &model.refusal,
        &model.harmless,
        4,
        64,
    )
    .unwrap();
    assert_eq!(
        sets.format,
        flexinfer_worker::abliterate::data::ChatFormat::Inst
    );
    let v = vocab();
    let id = |t: &str| v.iter().position(|x| x == t).unwrap() as u32;
    let (open, close) = (id("["), id("]"));
    for s in sets.refusal.iter().chain(&sets.harmless) {
        // "[INST] A B C [/INST]" → [ I N S T A B C [ / I N S T ]
        assert_eq!(s[0], open, "{s:?}");
        assert_eq!(*s.last().unwrap(), close, "{s:?}");
        assert_eq!(s[s.len() - 7..s.len() - 5], [open, id("/")], "{s:?}");
    }
    // The perplexity texts are the plain harmless prompts.
    for s in &sets.ppl {
        assert!(!s.contains(&open) && !s.contains(&close), "{s:?}");
    }
    assert_eq!(
        (sets.refusal.len(), sets.harmless.len(), sets.ppl.len()),
        (4, 4, 4)
    );
    // Long prompts keep their end (the generation prompt); plain texts keep their start.
    let short = flexinfer_worker::abliterate::data::load_prompt_sets(
        &model.dir,
        &model.refusal,
        &model.harmless,
        4,
        6,
    )
    .unwrap();
    for (long, cut) in sets.refusal.iter().zip(&short.refusal) {
        assert_eq!(cut.as_slice(), &long[long.len() - 6..]);
    }
    for (long, cut) in sets.ppl.iter().zip(&short.ppl) {
        assert_eq!(cut.as_slice(), &long[..6.min(long.len())]);
    }
}
