//! Quality gate failures (exit 3), kill and resume, bad input (exit 2).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod abliterate_support;

use std::os::unix::fs::MetadataExt;

use abliterate_support::*;
use flexinfer_contract::{events, files};

fn assert_source_untouched(
    model: &TinyModel,
    before: &std::collections::BTreeMap<String, String>,
    out: &std::path::Path,
) {
    assert_eq!(
        &checksums(&model.dir),
        before,
        "the source directory changed"
    );
    assert!(!model.dir.join(files::ABLITERATION_STATUS).exists());
    assert!(!out.exists(), "no output on failure");
    assert!(!flexinfer_worker::abliterate::output::staging_dir(out).exists());
}

#[test]
fn norm_above_threshold_fails_the_gate_with_exit_3() {
    let model = build(&TinyOpts {
        seed: 21,
        ..Default::default()
    });
    let before = checksums(&model.dir);
    let out = model.dir.join("abliterated");
    let r = run(&model, &out, &[("NORM_THRESHOLD", "1.5")], &[]);
    assert_eq!(r.code, 3, "{}\n{}", r.stdout, r.stderr);
    let msg = r.termination["error"].as_str().unwrap();
    assert!(msg.contains("norm") && msg.contains("1.5"), "{msg}");
    assert_eq!(r.termination["exitCode"], 3);
    assert_eq!(r.termination["phase"], "abliteration");
    assert!(events(&r.stdout)
        .iter()
        .any(|e| e["event"] == events::ABLITERATION_GATE && e["gate"] == "failed"));
    assert_source_untouched(&model, &before, &out);
}

#[test]
fn perplexity_regression_fails_the_gate_with_exit_3() {
    // No cancellation and an lm_head that uses the direction: removing it hurts prediction of
    // the (mixed) harmless texts.
    let model = build(&TinyOpts {
        seed: 22,
        cancel: false,
        lm_head_boost: 1.0,
        ..Default::default()
    });
    mixed_harmless(&model.harmless, 5);
    let before = checksums(&model.dir);
    let out = model.root.path().join("out");
    let r = run(&model, &out, &[("TARGET_LAYERS", "3")], &[]);
    assert_eq!(r.code, 3, "{}\n{}", r.stdout, r.stderr);
    let msg = r.termination["error"].as_str().unwrap();
    assert!(msg.contains("perplexity"), "{msg}");
    let gate = events(&r.stdout)
        .into_iter()
        .find(|e| e["event"] == events::ABLITERATION_GATE)
        .unwrap();
    let (ppl_before, ppl_after) = (
        gate["perplexityBefore"].as_f64().unwrap(),
        gate["perplexityAfter"].as_f64().unwrap(),
    );
    assert!(
        ppl_before.is_finite() && ppl_after > ppl_before * 1.05,
        "{gate}"
    );
    assert!(gate["refusalDirNorm"].as_f64().unwrap() < 100.0, "{gate}");
    assert_source_untouched(&model, &before, &out);
    // A generous bound lets the same run through.
    let r = run(
        &model,
        &out,
        &[
            ("TARGET_LAYERS", "3"),
            ("MAX_PERPLEXITY_INCREASE_PERCENT", "100000"),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn killed_run_resumes_without_rewriting_finished_shards() {
    let model = build(&TinyOpts {
        seed: 23,
        shards: 3,
        ..Default::default()
    });
    let out = model.root.path().join("out");
    let staging = flexinfer_worker::abliterate::output::staging_dir(&out);

    let r = run(&model, &out, &[], &["--test-abort-after-shards", "1"]);
    assert_eq!(r.code, 137, "{}\n{}", r.stdout, r.stderr);
    assert!(!out.exists());
    assert!(!model.dir.join(files::ABLITERATION_STATUS).exists());
    let m: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(staging.join(files::ABLITERATION_MANIFEST)).unwrap(),
    )
    .unwrap();
    let shards = m["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 1);
    let first = shards[0]["name"].as_str().unwrap().to_string();
    let meta = std::fs::metadata(staging.join(&first)).unwrap();
    let (ino, mtime) = (meta.ino(), meta.mtime_nsec());

    let r = run(&model, &out, &[], &[]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let evs = events(&r.stdout);
    assert!(
        evs.iter()
            .any(|e| e["event"] == events::ABLITERATION_RESUME_LOADED),
        "{}",
        r.stdout
    );
    // The direction was not recomputed and the finished shard was not rewritten.
    assert!(!evs
        .iter()
        .any(|e| e["event"] == events::ABLITERATION_DIRECTION));
    let meta = std::fs::metadata(out.join(&first)).unwrap();
    assert_eq!(
        (meta.ino(), meta.mtime_nsec()),
        (ino, mtime),
        "{first} was rewritten"
    );
    assert!(evs.iter().any(|e| e["detail"]
        .as_str()
        .is_some_and(|d| d.contains("already written"))));

    // Same bytes as an uninterrupted run.
    let fresh = model.root.path().join("fresh");
    let r2 = run(&model, &fresh, &[], &[]);
    assert_eq!(r2.code, 0, "{}", r2.stderr);
    let a = checksums(&out);
    let b = checksums(&fresh);
    for name in a
        .keys()
        .filter(|k| k.ends_with(".safetensors") || k.ends_with(".json") && !k.starts_with('.'))
    {
        assert_eq!(a.get(name), b.get(name), "{name}");
    }
    assert!(a.contains_key("model.safetensors.index.json"));
    assert_eq!(a.keys().filter(|k| k.ends_with(".safetensors")).count(), 3);
}

#[test]
fn bad_input_exits_2_with_a_clear_error() {
    let model = build(&TinyOpts {
        seed: 24,
        ..Default::default()
    });
    let out = model.root.path().join("out");
    let before = checksums(&model.dir);
    let missing = model.root.path().join("nope.jsonl");
    let empty = model.root.path().join("empty.txt");
    std::fs::write(&empty, "\n  \n\n").unwrap();
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (
            vec![("REFUSAL_DATASET", missing.to_str().unwrap())],
            "refusal dataset",
        ),
        (
            vec![("HARMLESS_DATASET", empty.to_str().unwrap())],
            "holds no prompts",
        ),
        (vec![("WEIGHT_MATRICES", "gate_proj")], "gate_proj"),
        (vec![("TARGET_LAYERS", "3-99")], "99"),
        (vec![("TARGET_LAYERS", "ten")], "targetLayers"),
        (vec![("NORM_THRESHOLD", "-1")], "NORM_THRESHOLD"),
        (vec![("SKIP_GDN_LAYERS", "maybe")], "maybe"),
    ];
    for (envs, needle) in cases {
        let r = run(&model, &out, &envs, &[]);
        assert_eq!(r.code, 2, "{envs:?}: {}\n{}", r.stdout, r.stderr);
        let text = format!("{} {}", r.termination, r.stderr);
        assert!(
            text.contains(needle),
            "{envs:?}: expected {needle:?} in {text}"
        );
    }
    // An output directory that is the source or above it would replace the source.
    for bad_out in [model.dir.clone(), model.root.path().to_path_buf()] {
        let r = run(&model, &bad_out, &[], &[]);
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert!(r.termination["error"]
            .as_str()
            .unwrap()
            .contains("never modified in place"));
    }
    assert_eq!(checksums(&model.dir), before);
    assert!(!out.exists());

    // A model without the requested matrices.
    let no_o = build(&TinyOpts {
        seed: 25,
        omit: vec!["o_proj"],
        ..Default::default()
    });
    let r = run(&no_o, &out, &[("WEIGHT_MATRICES", "o_proj")], &[]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    let msg = r.termination["error"].as_str().unwrap();
    assert!(msg.contains("no o_proj tensors"), "{msg}");
}
