//! The abliteration guards: GDN/linear-attention layers, MoE experts, the lm_head and vision towers stay
//! byte-identical unless explicitly enabled.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod abliterate_support;

use std::collections::BTreeMap;
use std::path::Path;

use abliterate_support::*;
use flexinfer_contract::files;
use flexinfer_quant::tensors::TensorStore;
use flexinfer_worker::abliterate::edit::{self, Matrix, TargetLayers};
use flexinfer_worker::abliterate::output::{self, RunResult};
use flexinfer_worker::abliterate::Settings;
use flexinfer_worker::common::Events;

fn layer_tensors(store: &TensorStore, layer: usize) -> Vec<String> {
    let p = format!("model.layers.{layer}.");
    store
        .entries
        .keys()
        .filter(|n| n.starts_with(&p))
        .cloned()
        .collect()
}

#[test]
fn gdn_layer_and_lm_head_untouched_unless_enabled() {
    let model = build(&TinyOpts {
        dtype: "BF16",
        seed: 5,
        layer_types: Some(vec![
            "full_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
            "full_attention",
            "full_attention",
            "full_attention",
            "full_attention",
        ]),
        ..Default::default()
    });
    let src = TensorStore::open_dir(&model.dir).unwrap();

    // Defaults: skipGDNLayers=true, ablitateLmHead=false.
    let out = model.root.path().join("out-default");
    let r = run(&model, &out, &[("TARGET_LAYERS", "1-4")], &[]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let dst = TensorStore::open_dir(&out).unwrap();
    for name in layer_tensors(&src, 2)
        .iter()
        .chain(["lm_head.weight".to_string()].iter())
    {
        assert_eq!(
            src.raw(name).unwrap(),
            dst.raw(name).unwrap(),
            "{name} must be byte-identical"
        );
    }
    for name in src.entries.keys() {
        assert_eq!(
            format!("{:?}", dst.entry(name).unwrap().dtype),
            "BF16",
            "{name}"
        );
    }
    for l in [1, 3, 4] {
        let n = format!("model.layers.{l}.mlp.down_proj.weight");
        assert_ne!(
            src.raw(&n).unwrap(),
            dst.raw(&n).unwrap(),
            "{n} should be modified"
        );
    }
    let status: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.dir.join(files::ABLITERATION_STATUS)).unwrap(),
    )
    .unwrap();
    assert_eq!(status["layersModified"], 3);
    assert_eq!(status["layer"], 3);
    assert!(
        events(&r.stdout).iter().any(|e| e["event"] == "warning"
            && e["message"]
                .as_str()
                .unwrap_or("")
                .contains("skipGDNLayers")),
        "{}",
        r.stdout
    );
    // `auto` never picks the linear-attention layer either.
    let out_auto = model.root.path().join("out-auto");
    let r = run(&model, &out_auto, &[], &[]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let dst_auto = TensorStore::open_dir(&out_auto).unwrap();
    for name in layer_tensors(&src, 2) {
        assert_eq!(
            src.raw(&name).unwrap(),
            dst_auto.raw(&name).unwrap(),
            "{name}"
        );
    }

    // Explicitly enabled: the GDN layer's residual writers and the lm_head change.
    let out2 = model.root.path().join("out-enabled");
    let r = run(
        &model,
        &out2,
        &[
            ("TARGET_LAYERS", "1-4"),
            // A flag wins over its environment variable.
            ("SKIP_GDN_LAYERS", "true"),
            ("ABLITERATE_LM_HEAD", "True"),
        ],
        &["--skip-gdn-layers", "False"],
    );
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let dst2 = TensorStore::open_dir(&out2).unwrap();
    for n in ["model.layers.2.mlp.down_proj.weight", "lm_head.weight"] {
        assert_ne!(
            src.raw(n).unwrap(),
            dst2.raw(n).unwrap(),
            "{n} should be modified"
        );
    }
    // The edited lm_head no longer reads the direction (bf16 rounding tolerance).
    let m: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out2.join(".abliteration-manifest.json")).unwrap(),
    )
    .unwrap();
    let dir: Vec<f32> = m["result"]["direction"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let head = dst2.f32("lm_head.weight").unwrap();
    let old = src.f32("lm_head.weight").unwrap();
    for (row_new, row_old) in head.chunks(HIDDEN).zip(old.chunks(HIDDEN)) {
        let before = dot(row_old, &dir).abs();
        let after = dot(row_new, &dir).abs();
        assert!(
            after < 0.01 + before * 0.02,
            "lm_head still reads the direction: {after}"
        );
    }
}

struct Fake {
    _root: tempfile::TempDir,
    dir: std::path::PathBuf,
}

const H: usize = 16;
const I: usize = 24;

/// A Qwen3-Next-like hybrid MoE model with a vision tower (tensor names only matter here).
fn fake_moe_hybrid() -> Fake {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model");
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = Rng::new(3);
    let mut t: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut put = |name: String, shape: Vec<usize>| {
        let n = shape.iter().product();
        let data = (0..n).map(|_| rng.gauss() * 0.1).collect();
        t.insert(
            name,
            Tensor {
                dtype: "BF16",
                shape,
                data,
            },
        );
    };
    put("model.embed_tokens.weight".into(), vec![32, H]);
    for l in 0..4 {
        let p = format!("model.layers.{l}.");
        if l == 1 {
            put(format!("{p}linear_attn.in_proj_qkvz.weight"), vec![H, H]);
            put(format!("{p}linear_attn.out_proj.weight"), vec![H, H]);
        } else {
            put(format!("{p}self_attn.q_proj.weight"), vec![H, H]);
            put(format!("{p}self_attn.o_proj.weight"), vec![H, H]);
        }
        put(format!("{p}mlp.gate.weight"), vec![2, H]);
        for e in 0..2 {
            put(format!("{p}mlp.experts.{e}.gate_proj.weight"), vec![I, H]);
            put(format!("{p}mlp.experts.{e}.down_proj.weight"), vec![H, I]);
        }
        put(format!("{p}mlp.shared_expert.gate_proj.weight"), vec![I, H]);
        put(format!("{p}mlp.shared_expert.down_proj.weight"), vec![H, I]);
        put(format!("{p}mlp.shared_expert_gate.weight"), vec![1, H]);
    }
    put(
        "model.visual.blocks.0.mlp.down_proj.weight".into(),
        vec![H, I],
    );
    put(
        "model.visual.blocks.0.attn.o_proj.weight".into(),
        vec![H, H],
    );
    put("model.norm.weight".into(), vec![H]);
    put("lm_head.weight".into(), vec![32, H]);
    write_safetensors(&dir.join("model.safetensors"), &t);
    let cfg = serde_json::json!({
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": H,
        "num_hidden_layers": 4,
        "num_experts": 2,
        "layer_types": ["full_attention", "linear_attention", "full_attention", "full_attention"],
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    Fake { _root: root, dir }
}

fn settings(skip_gdn: bool, skip_vision: bool, lm_head: bool) -> Settings {
    Settings {
        target: TargetLayers::List(vec![0, 1, 2, 3]),
        matrices: vec![Matrix::OProj, Matrix::DownProj],
        skip_gdn,
        skip_vision,
        lm_head,
        norm_threshold: 100.0,
        max_ppl_increase_percent: 5.0,
    }
}

/// Plans and writes with a fixed direction; returns (source, output, plan).
fn apply(f: &Fake, s: &Settings, out_name: &str) -> (TensorStore, TensorStore, edit::Plan) {
    let store = TensorStore::open_dir(&f.dir).unwrap();
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(f.dir.join("config.json")).unwrap()).unwrap();
    let layout = edit::Layout::from_model(&store, &raw).unwrap();
    assert!(layout.moe);
    assert!(layout.linear_attention.contains(&1));
    let targets = edit::select_target_layers(&layout, s).unwrap();
    let plan = edit::plan(&layout, s, &targets.layers).unwrap();
    let mut dir: Vec<f32> = (0..H).map(|i| (i as f32 * 0.7).sin()).collect();
    normalize(&mut dir);
    let result = RunResult {
        layer: 2,
        direction: dir,
        refusal_dir_norm: 1.0,
        score: 1.0,
        perplexity_before: 1.0,
        perplexity_after: 1.0,
        layers_modified: plan.layers_modified.clone(),
        refusal_projection_before: None,
        refusal_projection_after: None,
    };
    let out = f.dir.parent().unwrap().join(out_name);
    let staging = output::staging_dir(&out);
    let ev = Events::new("abliteration");
    output::write_output(
        &store, &f.dir, &staging, &plan, &result, "fp", None, None, &ev,
    )
    .unwrap();
    output::commit(&staging, &out).unwrap();
    let dst = TensorStore::open_dir(&out).unwrap();
    (store, dst, plan)
}

fn changed(src: &TensorStore, dst: &TensorStore) -> Vec<String> {
    src.entries
        .keys()
        .filter(|n| src.raw(n).unwrap() != dst.raw(n).unwrap())
        .cloned()
        .collect()
}

#[test]
fn moe_experts_gdn_vision_and_lm_head_are_guarded() {
    let f = fake_moe_hybrid();
    let (src, dst, plan) = apply(&f, &settings(true, true, false), "out-guarded");
    let mut expected: Vec<String> = [0, 2, 3]
        .iter()
        .flat_map(|l| {
            [
                format!("model.layers.{l}.self_attn.o_proj.weight"),
                format!("model.layers.{l}.mlp.shared_expert.down_proj.weight"),
            ]
        })
        .collect();
    expected.sort();
    assert_eq!(changed(&src, &dst), expected);
    assert_eq!(plan.guarded_experts, 8, "two experts × four layers");
    assert!(
        plan.warnings
            .iter()
            .any(|w| w.contains("MoE") && w.contains("down_proj")),
        "{:?}",
        plan.warnings
    );
    assert_eq!(plan.layers_modified, vec![0, 2, 3]);
    // Same tensor set, names and dtypes.
    assert_eq!(src.entries.len(), dst.entries.len());

    // Enabling the GDN layer and the towers and the lm_head: experts still never touched.
    let (src, dst, _) = apply(&f, &settings(false, false, true), "out-enabled");
    let ch = changed(&src, &dst);
    for n in [
        "model.layers.1.linear_attn.out_proj.weight",
        "model.layers.1.mlp.shared_expert.down_proj.weight",
        "model.visual.blocks.0.mlp.down_proj.weight",
        "lm_head.weight",
    ] {
        assert!(ch.contains(&n.to_string()), "{n} should change: {ch:?}");
    }
    assert!(ch.iter().all(|n| !n.contains(".experts.")), "{ch:?}");
    assert!(
        !ch.iter()
            .any(|n| n.contains("in_proj") || n.contains("gate")),
        "{ch:?}"
    );
}

#[test]
fn moe_model_fails_clearly_where_the_forward_cannot_run() {
    // The direction needs the engine's Llama-family forward; other architectures are refused with
    // exit 2 and a message, after the guards were planned, and nothing is written.
    let f = fake_moe_hybrid();
    let data = f.dir.parent().unwrap().join("p.txt");
    std::fs::write(&data, "A B C\n").unwrap();
    let before = checksums(&f.dir);
    let term = f.dir.parent().unwrap().join("term.json");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_flexinfer-worker"))
        .arg("abliterate")
        .arg("--model-dir")
        .arg(&f.dir)
        .arg("--refusal-dataset")
        .arg(&data)
        .arg("--harmless-dataset")
        .arg(&data)
        .arg("--target-layers")
        .arg("0-3")
        .env("FLEXINFER_TERMINATION_LOG", &term)
        .env_remove("OUT_DIR")
        .env_remove("MODEL_DIR")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(2), "{stdout}");
    assert!(
        stdout.contains("MoE model"),
        "warning event expected: {stdout}"
    );
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&term).unwrap()).unwrap();
    assert!(
        t["error"]
            .as_str()
            .unwrap()
            .contains("Llama-family forward"),
        "{t}"
    );
    assert_eq!(t["exitCode"], 2);
    assert_eq!(checksums(&f.dir), before);
    assert!(!Path::new(&f.dir.join("abliterated")).exists());
}

#[test]
fn moe_model_end_to_end_touches_only_shared_and_attention_projections() {
    let model = build(&TinyOpts {
        seed: 31,
        moe_experts: 4,
        ..Default::default()
    });
    let out = model.root.path().join("out");
    let r = run(&model, &out, &[], &[]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let status: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.dir.join(files::ABLITERATION_STATUS)).unwrap(),
    )
    .unwrap();
    assert_eq!(status["layer"], 3, "{}", r.stdout);
    assert_eq!(status["layersModified"], 6);
    assert!(
        events(&r.stdout).iter().any(|e| e["event"] == "warning"
            && e["message"]
                .as_str()
                .unwrap_or("")
                .contains("expert down_proj tensors are never modified")),
        "{}",
        r.stdout
    );
    let src = TensorStore::open_dir(&model.dir).unwrap();
    let dst = TensorStore::open_dir(&out).unwrap();
    let mut expected: Vec<String> = (1..=6)
        .flat_map(|l| {
            [
                format!("model.layers.{l}.mlp.shared_expert.down_proj.weight"),
                format!("model.layers.{l}.self_attn.o_proj.weight"),
            ]
        })
        .collect();
    expected.sort();
    assert_eq!(changed(&src, &dst), expected);
    // The planted direction was found through the MoE forward.
    let m: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join(".abliteration-manifest.json")).unwrap(),
    )
    .unwrap();
    let dir: Vec<f32> = m["result"]["direction"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let cos = dot(&dir, &model.u) / dot(&dir, &dir).sqrt();
    assert!(cos >= 0.95, "{cos}");
}
