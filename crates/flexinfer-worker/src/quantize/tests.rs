//! The quantize subcommand: argument parsing, exit-code mapping, version handshake, quality gate.

use super::*;
use clap::Parser;
use flexinfer_quant::testkit;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: QuantizeArgs,
}

fn try_parse(extra: &[&str]) -> Result<QuantizeArgs, clap::Error> {
    let mut argv = vec![
        "q",
        "--model-dir",
        "/m",
        "--out-dir",
        "/o",
        "--dataset",
        "d.jsonl",
    ];
    argv.extend_from_slice(extra);
    Cli::try_parse_from(argv).map(|c| c.args)
}

fn parse(extra: &[&str]) -> QuantizeArgs {
    try_parse(extra).expect("parses")
}

struct Fixture {
    _tmp: tempfile::TempDir,
    args: QuantizeArgs,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("model");
    testkit::write_model(&model, "LlamaForCausalLM", 3).expect("model");
    let ds = tmp.path().join("calib.jsonl");
    testkit::write_dataset(&ds, 8).expect("dataset");
    let mut args = parse(&[
        "--group-size",
        "32",
        "--max-samples",
        "8",
        "--max-seq-len",
        "32",
    ]);
    args.model_dir = model;
    args.out_dir = tmp.path().join("gptq-w4-g32");
    args.dataset = ds.display().to_string();
    Fixture { _tmp: tmp, args }
}

#[test]
fn flags_parse_with_contract_spellings() {
    let a = parse(&[
        "--sym",
        "False",
        "--desc-act",
        "1",
        "--group-size",
        "-1",
        "--resume-layers",
        "TRUE",
    ]);
    assert!(!a.sym && a.desc_act && a.resume_layers);
    assert_eq!(a.group_size, -1);
    assert_eq!(
        (a.gptq_bits(), a.max_samples, a.max_seq_len),
        (4, 128, 2048)
    );
    assert_eq!(
        (a.damp_percent, a.damp_auto_increment, a.max_floor_attempts),
        (0.05, 0.1, 6)
    );
    assert_eq!(
        (a.max_rtn_fallback_percent, a.min_modules_for_fallback_gate),
        (10.0, 100)
    );
    assert!(Cli::try_parse_from([
        "q",
        "--model-dir",
        "/m",
        "--out-dir",
        "/o",
        "--dataset",
        "d",
        "--sym",
        "maybe"
    ])
    .is_err());
}

/// `ACT_GROUP_AWARE` / `CLIP_SEARCH` become the engine's parameters: group-aware order unless act-order is
/// on, the clipping search only when asked for (`auto` is off at every width, as measured); a value that is
/// not a mode is bad input (exit 2).
#[test]
fn gptq_quality_knobs_reach_the_engine_parameters() {
    let f = fixture();
    let params = |extra: &[&str]| {
        let mut a = parse(extra);
        a.model_dir = f.args.model_dir.clone();
        a.dataset = f.args.dataset.clone();
        job_from_args(&a).map(|j| (j.params.act_group_aware, j.params.clip_search))
    };
    let ok = |extra: &[&str]| params(extra).unwrap_or_else(|e| panic!("{extra:?}: {e}"));
    assert_eq!(ok(&[]), (true, false), "defaults at 4 bits");
    assert_eq!(
        ok(&["--bits", "2"]),
        (true, false),
        "auto does not clip at 2 bits"
    );
    assert_eq!(ok(&["--bits", "2", "--clip-search", "on"]), (true, true));
    assert_eq!(ok(&["--clip-search", "ON"]), (true, true));
    assert_eq!(ok(&["--act-group-aware", "false"]), (false, false));
    assert_eq!(
        ok(&["--desc-act", "true"]),
        (false, false),
        "act-order wins"
    );
    let err = params(&["--clip-search", "sometimes"]).expect_err("not a mode");
    assert!(
        flexinfer_contract::error::chain(&err).contains("CLIP_SEARCH"),
        "{err}"
    );
}

/// `REFINE_SCALES` becomes the refinement rounds: `auto` refines at 2 and 3 bits (the measured default) and
/// not at 4 or 8; `on`, `off` and a count override it; anything else is bad input naming the variable.
#[test]
fn refine_scales_reaches_the_engine_parameters() {
    let f = fixture();
    let rounds = |extra: &[&str]| {
        let mut a = parse(extra);
        a.model_dir = f.args.model_dir.clone();
        a.dataset = f.args.dataset.clone();
        job_from_args(&a).map(|j| j.params.refine_rounds)
    };
    let ok = |extra: &[&str]| rounds(extra).unwrap_or_else(|e| panic!("{extra:?}: {e}"));
    let on = flexinfer_quant::params::DEFAULT_REFINE_ROUNDS;
    assert_eq!(ok(&[]), 0, "auto is off at 4 bits");
    assert_eq!(ok(&["--bits", "8"]), 0, "auto is off at 8 bits");
    assert_eq!(ok(&["--bits", "2"]), on, "auto refines at 2 bits");
    assert_eq!(ok(&["--bits", "3"]), on, "auto refines at 3 bits");
    assert_eq!(ok(&["--bits", "2", "--refine-scales", "off"]), 0);
    assert_eq!(ok(&["--refine-scales", "On"]), on);
    assert_eq!(ok(&["--bits", "3", "--refine-scales", "3"]), 3);
    for bad in ["sometimes", "-1", "65"] {
        // `=` form: clap would take a bare "-1" for a flag.
        let err = rounds(&[&format!("--refine-scales={bad}")]).expect_err("not a setting");
        assert!(
            flexinfer_contract::error::chain(&err).contains("REFINE_SCALES"),
            "{bad}: {err}"
        );
    }
}

#[test]
fn version_mismatch_exits_4_before_touching_anything() {
    let mut f = fixture();
    f.args.script_version = Some("v1".into());
    let e = run_inner(&f.args, &Events::new("quantization")).expect_err("mismatch");
    assert_eq!(e.exit_code(), 4);
    assert!(flexinfer_contract::error::chain(&e).contains(&format!(
        "FATAL: Script version mismatch (image={} controller=v1)",
        contract::SCRIPT_VERSION
    )));
    assert!(!f.args.out_dir.exists());
}

#[test]
fn bad_input_exits_2_and_success_reports_sizes_and_quality() {
    let f = fixture();
    let mut bits5 = f.args.clone();
    bits5.bits = Some(5);
    let e = run_inner(&bits5, &Events::new("quantization")).expect_err("bits 5");
    assert_eq!(e.exit_code(), 2);
    assert!(
        flexinfer_contract::error::chain(&e).contains("bits must be one of 2, 3, 4, 8 (got 5)"),
        "{e}"
    );
    let mut no_ds = f.args.clone();
    no_ds.dataset = "missing/dataset".into();
    assert_eq!(
        run_inner(&no_ds, &Events::new("quantization"))
            .expect_err("dataset")
            .exit_code(),
        2
    );
    assert!(!f.args.out_dir.exists());

    let ok = run_inner(&f.args, &Events::new("quantization")).expect("quantize");
    assert_eq!(ok.kind, "gptq-w4-g32");
    assert!(
        ok.compressed_size_bytes.unwrap_or(0) > 0
            && ok.original_size_bytes > ok.compressed_size_bytes
    );
    assert_eq!(
        ok.quality.as_ref().map(|q| q.gate.as_str()),
        Some("insufficient-sample")
    );
    let out = PathBuf::from(ok.output_dir.clone().expect("output dir"));
    assert!(out.join(".save-complete").exists() && out.ends_with("gptq-w4-g32"));
    let msg = contract::encode_termination(&ok);
    assert!(
        msg.len() <= contract::files::TERMINATION_MESSAGE_MAX_BYTES
            && msg.contains("\"outputDir\"")
    );
}

#[test]
fn gptq_device_cuda_without_a_usable_device_exits_2_and_auto_runs_on_the_cpu() {
    let f = fixture();
    // This build has no GPU session, so an explicit GPU is refused on every machine (with or without one).
    for dev in ["cuda", "hip"] {
        let mut a = f.args.clone();
        a.gptq_device = dev.into();
        let e = run_inner(&a, &Events::new("quantization")).expect_err(dev);
        assert_eq!(e.exit_code(), 2, "{e}");
        let m = flexinfer_contract::error::chain(&e);
        assert!(
            m.contains(&format!("GPTQ_DEVICE={dev}")) && m.contains("GPTQ_DEVICE=cpu or auto"),
            "{m}"
        );
    }
    let mut bad = f.args.clone();
    bad.gptq_device = "tpu".into();
    let e = run_inner(&bad, &Events::new("quantization")).expect_err("tpu");
    assert_eq!(e.exit_code(), 2);
    assert!(
        flexinfer_contract::error::chain(&e).contains("expected auto, cpu, hip or cuda"),
        "{e}"
    );
    assert!(!f.args.out_dir.exists());
    assert_eq!(parse(&[]).gptq_device, "auto");
    assert_eq!(parse(&["--gptq-device", "cpu"]).gptq_device, "cpu");
}

#[test]
fn gptq_vendor_libs_is_auto_or_off() {
    use flexinfer_quant::device::VendorLibs;
    assert_eq!(parse(&[]).gptq_vendor_libs, VendorLibs::Auto);
    assert_eq!(
        parse(&["--gptq-vendor-libs", "off"]).gptq_vendor_libs,
        VendorLibs::Off
    );
    assert_eq!(
        parse(&["--gptq-vendor-libs", "AUTO"]).gptq_vendor_libs,
        VendorLibs::Auto
    );
    let e = try_parse(&["--gptq-vendor-libs", "maybe"]).expect_err("a bad value is refused");
    assert!(
        flexinfer_contract::error::chain(&e).contains("--gptq-vendor-libs")
            && flexinfer_contract::error::chain(&e).contains("expected auto or off"),
        "{e}"
    );
    // clap's usage errors exit 2: bad configuration, as the worker contract says.
    assert_eq!(e.exit_code(), 2);
}

#[test]
fn rtn_share_over_the_limit_exits_3() {
    let mut f = fixture();
    f.args.max_samples = 1;
    f.args.max_seq_len = 6;
    f.args.damp_percent = 0.0;
    f.args.damp_auto_increment = 0.0;
    f.args.max_floor_attempts = 0;
    f.args.min_modules_for_fallback_gate = 5;
    let e = run_inner(&f.args, &Events::new("quantization")).expect_err("gate");
    assert_eq!(e.exit_code(), 3, "{e}");
    assert!(flexinfer_contract::error::chain(&e).contains("RTN fallback gate failed"));
    // The gate runs before the save: nothing is written to OUT_DIR, and a restarted Job fails the same
    // way (there is no cached pass to short-circuit on).
    assert!(!f.args.out_dir.join(".save-complete").exists());
    assert!(!f.args.out_dir.join(".quantization-quality.json").exists());
    assert_eq!(
        run_inner(&f.args, &Events::new("quantization"))
            .expect_err("cached gate")
            .exit_code(),
        3
    );
}

/// The download phase stores hub datasets under `<download dir>/.datasets/<id>`; quantize finds them both
/// when it reads the downloaded model itself (no abliteration) and when it reads `<download dir>/abliterated`.
#[test]
fn hub_dataset_fetched_by_download_is_found_with_and_without_abliteration() {
    let tmp = tempfile::tempdir().expect("tmp");
    let download = tmp.path().join("org/model");
    let fetched = download.join(contract::DATASETS_SUBDIR).join("org/calib");
    std::fs::create_dir_all(fetched.join("data")).expect("mkdir");
    std::fs::write(fetched.join("data/train.jsonl"), "{\"text\":\"a\"}\n").expect("write");
    let want = fetched.join("data/train.jsonl");
    assert_eq!(
        crate::datasets::resolve("org/calib", &download, "calibration")
            .expect("without abliteration"),
        want
    );
    assert_eq!(
        crate::datasets::resolve(
            "org/calib",
            &download.join(contract::ABLITERATED_SUBDIR),
            "calibration"
        )
        .expect("with abliteration"),
        want
    );
    let e = crate::datasets::resolve("org/other", &download, "calibration").expect_err("missing");
    assert!(
        flexinfer_contract::error::chain(&e).contains("org/other"),
        "{e}"
    );
}

/// A model llama.cpp's K-quants fit (rows of 256) with a byte-level BPE tokenizer.
fn gguf_fixture() -> Fixture {
    let f = fixture();
    let model = f.args.model_dir.clone();
    let size = testkit::ModelSize {
        hidden: 256,
        inter: 512,
        layers: 2,
        heads: 4,
        kv_heads: 1,
        vocab: 320,
    };
    testkit::write_model_sized(&model, "LlamaForCausalLM", 3, &size).expect("model");
    testkit::write_byte_level_tokenizer(&model).expect("tokenizer");
    let mut args = f.args.clone();
    args.format = "gguf".into();
    args.out_dir = model.with_file_name("gguf-q4_k_m");
    // What the controller sends today: no calibration set.
    args.dataset = String::new();
    Fixture { args, ..f }
}

#[test]
fn format_and_gguf_type_parse_with_their_defaults() {
    let a = parse(&[]);
    assert_eq!(
        (a.format.as_str(), a.gguf_type.as_str()),
        ("GPTQ", "Q4_K_M")
    );
    assert_eq!(output_format(&a.format).expect("gptq"), OutputFormat::Gptq);
    let a = parse(&["--format", "GGUF", "--gguf-type", "q5_k_m"]);
    assert_eq!(output_format(&a.format).expect("gguf"), OutputFormat::Gguf);
    assert_eq!(gguf_file_type(&a.gguf_type).expect("type"), FileType::Q5KM);
    assert_eq!(output_format(" fp8 ").expect("fp8"), OutputFormat::Fp8);
    assert_eq!(output_format("awq").expect("awq"), OutputFormat::Awq);
    let e = output_format("EXL2").expect_err("exl2");
    assert_eq!(e.exit_code(), 2);
    assert!(
        flexinfer_contract::error::chain(&e).contains("FORMAT=\"EXL2\""),
        "{e}"
    );
    assert!(flexinfer_contract::error::chain(&e).contains("FP8"), "{e}");
    let e = gguf_file_type("Q3_K_S").expect_err("q3_k_s");
    assert_eq!(e.exit_code(), 2);
    assert!(
        flexinfer_contract::error::chain(&e).contains("GGUF_TYPE=\"Q3_K_S\"")
            && flexinfer_contract::error::chain(&e).contains("Q4_K_M"),
        "{e}"
    );
}

#[test]
fn format_gguf_writes_one_gguf_with_save_complete_and_reports_it() {
    let f = gguf_fixture();
    let ok = run_inner(&f.args, &Events::new("quantization")).expect("gguf run");
    assert_eq!(ok.kind, "gguf-q4_k_m");
    let file = f.args.out_dir.join("model-Q4_K_M.gguf");
    let bytes = std::fs::read(&file).expect("gguf file");
    assert_eq!(&bytes[..4], b"GGUF");
    assert_eq!(ok.compressed_size_bytes, Some(bytes.len() as u64));
    assert!(ok.original_size_bytes.expect("original") > bytes.len() as u64);
    assert_eq!(
        ok.applied.get("ggufType").map(String::as_str),
        Some("Q4_K_M")
    );
    assert_eq!(
        ok.applied.get("importance").map(String::as_str),
        Some("none")
    );
    assert!(f
        .args
        .out_dir
        .join(contract::files::SAVE_COMPLETE)
        .is_file());
    let header = flexinfer_quant::gguf::reader::read_header(&bytes).expect("header");
    assert_eq!(header.tensors.len(), 2 + 2 * 9 + 2);
    // Bad type and unmappable tokenizer: exit 2, the finished artifact stays.
    let mut bad = f.args.clone();
    bad.gguf_type = "Q9_K".into();
    assert_eq!(
        run_inner(&bad, &Events::new("quantization"))
            .expect_err("type")
            .exit_code(),
        2
    );
    testkit::write_char_tokenizer(&f.args.model_dir).expect("char tokenizer");
    let mut q8 = f.args.clone();
    q8.gguf_type = "Q8_0".into();
    let e = run_inner(&q8, &Events::new("quantization")).expect_err("tokenizer");
    assert_eq!(e.exit_code(), 2);
    assert!(
        flexinfer_contract::error::chain(&e).contains("pre_tokenizer"),
        "{e}"
    );
    assert_eq!(std::fs::read(&file).expect("kept"), bytes);
}

/// `DATASET` set on a GGUF run: the importance pass runs, the blocks change, the digest and `applied`
/// say so; a dataset that cannot be read is bad input and leaves the previous artifact.
#[test]
fn format_gguf_with_a_dataset_weights_the_blocks_by_the_calibration_importance() {
    let f = gguf_fixture();
    let plain = run_inner(&f.args, &Events::new("quantization")).expect("plain run");
    let file = f.args.out_dir.join("model-Q4_K_M.gguf");
    let plain_bytes = std::fs::read(&file).expect("plain file");

    let ds = f.args.model_dir.with_file_name("gguf-calib.jsonl");
    testkit::write_dataset(&ds, 8).expect("dataset");
    let mut missing = f.args.clone();
    missing.dataset = ds.with_extension("missing").display().to_string();
    let e = run_inner(&missing, &Events::new("quantization")).expect_err("missing dataset");
    assert_eq!(e.exit_code(), 2, "{e}");
    assert_eq!(std::fs::read(&file).expect("kept"), plain_bytes);

    let mut weighted = f.args.clone();
    weighted.dataset = ds.display().to_string();
    let ok = run_inner(&weighted, &Events::new("quantization")).expect("weighted run");
    let get = |k: &str| ok.applied.get(k).map(String::as_str);
    assert_eq!(get("importance"), Some("calibration"));
    assert_eq!(get("maxSamples"), Some("8"));
    assert_eq!(get("maxSeqLen"), Some("32"));
    assert_eq!(get("dataset"), Some(ds.display().to_string().as_str()));
    assert!(get("importanceTokens").and_then(|t| t.parse::<u64>().ok()) > Some(8));
    assert_ne!(ok.config_digest, plain.config_digest);
    let bytes = std::fs::read(&file).expect("weighted file");
    let (hp, hw) = (
        flexinfer_quant::gguf::reader::read_header(&plain_bytes).expect("plain header"),
        flexinfer_quant::gguf::reader::read_header(&bytes).expect("weighted header"),
    );
    let data = |b: &[u8], h: &flexinfer_quant::gguf::reader::GgufHeader, name: &str| {
        let (spec, off) = h.tensors.iter().find(|(t, _)| t.name == name).expect(name);
        let start = (h.data_start + off) as usize;
        b[start..start + spec.byte_size().expect("size") as usize].to_vec()
    };
    for name in ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"] {
        assert_ne!(
            data(&bytes, &hw, name),
            data(&plain_bytes, &hp, name),
            "{name}"
        );
    }
    // Not weighted either way: the embeddings (llama-imatrix collects none for them).
    assert_eq!(
        data(&bytes, &hw, "token_embd.weight"),
        data(&plain_bytes, &hp, "token_embd.weight")
    );
}

/// `GGUF_GPTQ`: `auto` follows the measured default list and needs a dataset; `1` without a dataset and
/// unknown values are bad input naming the variable.
#[test]
fn gguf_gptq_parses_and_needs_a_dataset() {
    assert_eq!(parse(&[]).gguf_gptq, "auto");
    assert_eq!(
        parse(&["--gguf-gptq", "1"]).gguf_gptq,
        "1",
        "the flag reaches the field"
    );
    for ft in FileType::ALL {
        let default = FEEDBACK_BY_DEFAULT.contains(&ft);
        assert_eq!(
            gguf_feedback("auto", ft, true).expect("auto"),
            default,
            "{}",
            ft.name()
        );
        assert_eq!(
            gguf_feedback("", ft, true).expect("empty"),
            default,
            "{}",
            ft.name()
        );
        assert!(!gguf_feedback("auto", ft, false).expect("auto without dataset"));
        assert!(gguf_feedback(" ON ", ft, true).expect("on"));
        assert!(!gguf_feedback("0", ft, true).expect("0"));
        assert!(!gguf_feedback("off", ft, false).expect("off"));
    }
    for (value, has_dataset) in [("1", false), ("maybe", true), ("2", true)] {
        let e = gguf_feedback(value, FileType::Q4KM, has_dataset).expect_err(value);
        assert_eq!(e.exit_code(), 2, "{e}");
        assert!(
            flexinfer_contract::error::chain(&e).contains("GGUF_GPTQ"),
            "{e}"
        );
    }
}

/// `GGUF_GPTQ=1` with a dataset: the K-quant layer tensors are written with GPTQ feedback (they differ
/// from the importance-only run's), `applied` and the digest say so, the file reads back; `0` gives
/// the importance-only bytes again.
#[test]
fn format_gguf_with_gptq_feedback_changes_the_k_quant_tensors_and_reports_it() {
    let f = gguf_fixture();
    let ds = f.args.model_dir.with_file_name("gguf-calib.jsonl");
    testkit::write_dataset(&ds, 8).expect("dataset");
    let file = f.args.out_dir.join("model-Q4_K_M.gguf");
    let mut off = f.args.clone();
    off.dataset = ds.display().to_string();
    off.gguf_gptq = "0".into();
    let ok_off = run_inner(&off, &Events::new("quantization")).expect("importance-only run");
    assert_eq!(
        ok_off.applied.get("ggufGptq").map(String::as_str),
        Some("off")
    );
    let off_bytes = std::fs::read(&file).expect("importance-only file");

    let mut on = off.clone();
    on.gguf_gptq = "1".into();
    let ok_on = run_inner(&on, &Events::new("quantization")).expect("feedback run");
    let applied = ok_on
        .applied
        .get("ggufGptq")
        .map(String::as_str)
        .unwrap_or("");
    assert!(applied.starts_with("on ("), "{applied}");
    assert_ne!(ok_on.config_digest, ok_off.config_digest);
    let on_bytes = std::fs::read(&file).expect("feedback file");
    let (ho, hn) = (
        flexinfer_quant::gguf::reader::read_header(&off_bytes).expect("off header"),
        flexinfer_quant::gguf::reader::read_header(&on_bytes).expect("on header"),
    );
    let data = |b: &[u8], h: &flexinfer_quant::gguf::reader::GgufHeader, name: &str| {
        let (spec, off) = h.tensors.iter().find(|(t, _)| t.name == name).expect(name);
        let start = (h.data_start + off) as usize;
        (
            spec.ty,
            b[start..start + spec.byte_size().expect("size") as usize].to_vec(),
        )
    };
    for name in [
        "blk.0.attn_q.weight",
        "blk.1.ffn_down.weight",
        "blk.1.ffn_up.weight",
    ] {
        let ((t_off, b_off), (t_on, b_on)) =
            (data(&off_bytes, &ho, name), data(&on_bytes, &hn, name));
        assert_eq!(t_off, t_on, "{name}: same type");
        assert_ne!(b_off, b_on, "{name}: feedback changed the blocks");
        let cols = hn
            .tensors
            .iter()
            .find(|(t, _)| t.name == name)
            .expect(name)
            .0
            .dims[0] as usize;
        let q = flexinfer_quant::gguf::blocks::dequantize_tensor(t_on, &b_on, cols)
            .expect("dequantize");
        assert!(
            q.iter().all(|v| v.is_finite()) && q.iter().any(|v| *v != 0.0),
            "{name}"
        );
    }
    assert_eq!(
        data(&on_bytes, &hn, "token_embd.weight"),
        data(&off_bytes, &ho, "token_embd.weight")
    );
    // Back to 0: the importance-only bytes.
    run_inner(&off, &Events::new("quantization")).expect("importance-only again");
    assert_eq!(std::fs::read(&file).expect("file"), off_bytes);
}

/// `FORMAT=FP8`: the compressed-tensors artifact with `.save-complete` and the FP8 quality sidecar, reported
/// with its sizes and `applied`; a second run reuses it; bad `BITS` / `FP8_SCALE` are exit 2 naming the
/// variable and leave the artifact as it was.
#[test]
fn format_fp8_writes_the_float_quantized_artifact_and_reports_it() {
    let f = fixture();
    let mut args = f.args.clone();
    args.format = "FP8".into();
    args.bits = Some(8);
    args.dataset = String::new();
    args.out_dir = f.args.model_dir.with_file_name("fp8");
    let ok = run_inner(&args, &Events::new("quantization")).expect("fp8 run");
    assert_eq!(ok.kind, "fp8-channel");
    let out = &args.out_dir;
    let sc: contract::SaveComplete = serde_json::from_slice(
        &std::fs::read(out.join(contract::files::SAVE_COMPLETE)).expect("save-complete"),
    )
    .expect("save-complete json");
    assert_eq!(
        ok.compressed_size_bytes,
        Some(sc.shards.iter().map(|s| s.size_bytes).sum())
    );
    assert!(ok.original_size_bytes.expect("original") > ok.compressed_size_bytes.expect("size"));
    let q: contract::Fp8Quality = serde_json::from_slice(
        &std::fs::read(out.join(contract::files::QUANTIZATION_QUALITY)).expect("sidecar"),
    )
    .expect("sidecar json");
    assert_eq!(
        ok.applied.get("quantizedModules"),
        Some(&q.quantized_modules.to_string())
    );
    assert!(q.quantized_modules > 0);
    for (k, v) in [
        ("format", "FP8"),
        ("bits", "8"),
        ("fp8Scale", "channel"),
        ("activationScales", "dynamic"),
    ] {
        assert_eq!(ok.applied.get(k).map(String::as_str), Some(v), "{k}");
    }
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).expect("config"))
            .expect("json");
    assert_eq!(cfg["quantization_config"]["format"], "float-quantized");
    let again = run_inner(&args, &Events::new("quantization")).expect("reuse");
    assert_eq!(again.config_digest, ok.config_digest);
    let before = std::fs::read(out.join(contract::files::SAVE_COMPLETE)).expect("kept");
    for (bits, scale, needle) in [(Some(4), "channel", "BITS=4"), (None, "block", "FP8_SCALE")] {
        let mut bad = args.clone();
        bad.bits = bits;
        bad.fp8_scale = scale.into();
        let e = run_inner(&bad, &Events::new("quantization")).expect_err("bad input");
        assert_eq!(e.exit_code(), 2, "{e}");
        assert!(flexinfer_contract::error::chain(&e).contains(needle), "{e}");
    }
    assert_eq!(
        std::fs::read(out.join(contract::files::SAVE_COMPLETE)).expect("kept"),
        before
    );
}

/// `FORMAT=FP8 FP8_ACTIVATIONS=static`: every quantized linear gets a calibrated `input_scale` (F32 `[1]`,
/// finite, positive), the config declares static per-tensor activations, the sidecar and the termination
/// message say so with the calibration token count; a bad `FP8_ACTIVATIONS` or a missing `DATASET` is exit 2
/// naming the variable.
#[test]
fn format_fp8_with_static_activations_writes_input_scales_and_reports_them() {
    let f = fixture();
    let mut args = f.args.clone();
    args.format = "FP8".into();
    args.fp8_activations = "static".into();
    args.out_dir = f.args.model_dir.with_file_name("fp8-static");
    let ok = run_inner(&args, &Events::new("quantization")).expect("fp8 static run");
    assert_eq!(ok.kind, "fp8-channel");
    let out = &args.out_dir;
    let q: contract::Fp8Quality = serde_json::from_slice(
        &std::fs::read(out.join(contract::files::QUANTIZATION_QUALITY)).expect("sidecar"),
    )
    .expect("sidecar json");
    assert_eq!(q.activations, "static");
    assert!(q.calibration_tokens > 0);
    for (k, v) in [
        ("activationScales", "static".to_string()),
        ("calibrationTokens", q.calibration_tokens.to_string()),
        ("calibrationSamples", args.max_samples.to_string()),
        ("calibrationSeqLen", args.max_seq_len.to_string()),
    ] {
        assert_eq!(ok.applied.get(k), Some(&v), "{k}");
    }
    let store = flexinfer_quant::tensors::TensorStore::open_dir(out).expect("artifact");
    let mut scales = 0u64;
    for (name, e) in &store.entries {
        let Some(m) = name.strip_suffix(".weight_scale") else {
            continue;
        };
        let s = store
            .entry(&format!("{m}.input_scale"))
            .unwrap_or_else(|_| panic!("{m}.input_scale"));
        assert_eq!(
            (format!("{:?}", s.dtype), s.shape.clone()),
            ("F32".to_string(), vec![1]),
            "{m}"
        );
        let b = store.raw(&format!("{m}.input_scale")).expect("bytes");
        let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        assert!(v.is_finite() && v > 0.0, "{m}: {v}");
        assert_eq!(format!("{:?}", e.dtype), "F32", "{name}");
        scales += 1;
    }
    assert_eq!(scales, q.quantized_modules);
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).expect("config"))
            .expect("json");
    let ia = &cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"];
    assert_eq!(
        (&ia["strategy"], &ia["dynamic"]),
        (&"tensor".into(), &false.into()),
        "{ia}"
    );
    // The dynamic run of the same model has another digest and no input scales.
    let mut dynamic = args.clone();
    dynamic.fp8_activations = "dynamic".into();
    dynamic.out_dir = f.args.model_dir.with_file_name("fp8-dynamic");
    let d = run_inner(&dynamic, &Events::new("quantization")).expect("fp8 dynamic run");
    assert_ne!(d.config_digest, ok.config_digest);
    assert_eq!(
        d.applied.get("activationScales").map(String::as_str),
        Some("dynamic")
    );
    let store =
        flexinfer_quant::tensors::TensorStore::open_dir(&dynamic.out_dir).expect("artifact");
    assert!(!store.entries.keys().any(|n| n.ends_with(".input_scale")));
    for (value, dataset, needle) in [
        ("per-token", args.dataset.clone(), "FP8_ACTIVATIONS"),
        ("static", String::new(), "DATASET"),
    ] {
        let mut bad = args.clone();
        bad.fp8_activations = value.into();
        bad.dataset = dataset;
        let e = run_inner(&bad, &Events::new("quantization")).expect_err("bad input");
        assert_eq!(e.exit_code(), 2, "{e}");
        let text = flexinfer_contract::error::chain(&e);
        assert!(text.contains(needle), "{text}");
    }
}

/// `FORMAT=AWQ`: the GEMM-layout artifact with `.save-complete` and the AWQ quality sidecar, reported with its
/// sizes and `applied`; a second run reuses it; bad `BITS` / `GROUP_SIZE` / a missing `DATASET` are exit 2
/// naming the variable and leave the artifact as it was.
#[test]
fn format_awq_writes_the_gemm_artifact_and_reports_it() {
    let f = fixture();
    let mut args = f.args.clone();
    args.format = "AWQ".into();
    args.out_dir = f.args.model_dir.with_file_name("awq");
    let ok = run_inner(&args, &Events::new("quantization")).expect("awq run");
    assert_eq!(ok.kind, format!("awq-w4-g{}", args.group_size));
    let out = &args.out_dir;
    let sc: contract::SaveComplete = serde_json::from_slice(
        &std::fs::read(out.join(contract::files::SAVE_COMPLETE)).expect("save-complete"),
    )
    .expect("save-complete json");
    assert_eq!(
        ok.compressed_size_bytes,
        Some(sc.shards.iter().map(|s| s.size_bytes).sum())
    );
    let q: contract::files::AwqQuality = serde_json::from_slice(
        &std::fs::read(out.join(contract::files::QUANTIZATION_QUALITY)).expect("sidecar"),
    )
    .expect("sidecar json");
    assert!(q.quantized_modules > 0);
    assert_eq!(
        ok.applied.get("quantizedModules"),
        Some(&q.quantized_modules.to_string())
    );
    for (k, v) in [
        ("format", "AWQ"),
        ("bits", "4"),
        ("version", "gemm"),
        ("qualityGate", "passed"),
    ] {
        assert_eq!(ok.applied.get(k).map(String::as_str), Some(v), "{k}");
    }
    assert_eq!(q.gate, "passed");
    assert!(
        q.output_error_ratio > 0.0 && q.output_error_ratio <= q.max_output_error_ratio,
        "{q:?}"
    );
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).expect("config"))
            .expect("json");
    assert_eq!(cfg["quantization_config"]["quant_method"], "awq");
    let again = run_inner(&args, &Events::new("quantization")).expect("reuse");
    assert_eq!(again.config_digest, ok.config_digest);
    let before = std::fs::read(out.join(contract::files::SAVE_COMPLETE)).expect("kept");
    for (bits, group, dataset, needle) in [
        (Some(3), args.group_size, args.dataset.clone(), "BITS=\"3\""),
        (None, 100, args.dataset.clone(), "GROUP_SIZE=\"100\""),
        (None, args.group_size, String::new(), "DATASET"),
    ] {
        let mut bad = args.clone();
        bad.bits = bits;
        bad.group_size = group;
        bad.dataset = dataset;
        let e = run_inner(&bad, &Events::new("quantization")).expect_err("bad input");
        assert_eq!(e.exit_code(), 2, "{e}");
        assert!(
            flexinfer_contract::error::chain(&e).contains(needle),
            "{needle}: {e}"
        );
    }
    assert_eq!(
        std::fs::read(out.join(contract::files::SAVE_COMPLETE)).expect("kept"),
        before
    );
    for ratio in [0.0, f64::NAN] {
        let mut bad = args.clone();
        bad.max_output_error_ratio = ratio;
        let e = run_inner(&bad, &Events::new("quantization")).expect_err("bad limit");
        assert_eq!(e.exit_code(), 2, "{e}");
        assert!(
            flexinfer_contract::error::chain(&e).contains("AWQ_MAX_OUTPUT_ERROR_RATIO"),
            "{e}"
        );
    }
}

/// AWQ's quality gate: a limit on the output error ratio that the run exceeds fails the Job with the gate's
/// exit code 3 (`QualityGateFailed`), naming the figures, before anything is written: the artifact already at
/// `OUT_DIR` stays as it was, and a fresh `OUT_DIR` gets nothing.
#[test]
fn awq_output_error_over_the_limit_exits_3_and_writes_nothing() {
    let f = fixture();
    let mut args = f.args.clone();
    args.format = "AWQ".into();
    args.out_dir = f.args.model_dir.with_file_name("awq");
    run_inner(&args, &Events::new("quantization")).expect("awq run");
    let before = std::fs::read(args.out_dir.join(contract::files::SAVE_COMPLETE)).expect("done");
    let sidecar =
        std::fs::read(args.out_dir.join(contract::files::QUANTIZATION_QUALITY)).expect("q");
    for out in [
        args.out_dir.clone(),
        f.args.model_dir.with_file_name("awq-fresh"),
    ] {
        let mut strict = args.clone();
        strict.out_dir = out.clone();
        strict.max_output_error_ratio = 1e-6;
        let e = run_inner(&strict, &Events::new("quantization")).expect_err("gate");
        assert_eq!(e.exit_code(), 3, "{e}");
        let text = flexinfer_contract::error::chain(&e);
        assert!(
            text.contains("AWQ output-error gate failed") && text.contains("limit 0.0000"),
            "{text}"
        );
        assert!(text.contains("nothing was written"), "{text}");
    }
    assert_eq!(
        std::fs::read(args.out_dir.join(contract::files::SAVE_COMPLETE)).expect("kept"),
        before
    );
    assert_eq!(
        std::fs::read(args.out_dir.join(contract::files::QUANTIZATION_QUALITY)).expect("kept"),
        sidecar
    );
    let fresh = f.args.model_dir.with_file_name("awq-fresh");
    assert!(!fresh.join(contract::files::SAVE_COMPLETE).exists());
    assert!(!fresh.join(contract::files::QUANTIZATION_QUALITY).exists());
}

/// `FORMAT=COMPRESSED_TENSORS`: the GPTQ run written in the `pack-quantized` layout, reported with the
/// GPTQ quality gate and `applied.format`; `BITS=3` and `DESC_ACT=true` are exit 2 naming the variable,
/// before anything is written.
#[test]
fn format_compressed_tensors_writes_the_pack_quantized_artifact() {
    let f = fixture();
    let mut args = f.args.clone();
    args.format = "COMPRESSED_TENSORS".into();
    args.out_dir = f.args.model_dir.with_file_name("ct");
    let ok = run_inner(&args, &Events::new("quantization")).expect("ct run");
    assert_eq!(ok.kind, "ct-w4-g32");
    assert_eq!(
        ok.applied.get("format").map(String::as_str),
        Some("COMPRESSED_TENSORS")
    );
    assert!(ok.quality.is_some());
    let out = &args.out_dir;
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).expect("config"))
            .expect("json");
    let qc = &cfg["quantization_config"];
    assert_eq!(qc["format"], "pack-quantized");
    assert_eq!(qc["config_groups"]["group_0"]["weights"]["group_size"], 32);
    assert!(!out.join("quantize_config.json").exists());
    let again = run_inner(&args, &Events::new("quantization")).expect("reuse");
    assert_eq!(again.config_digest, ok.config_digest);
    let before = std::fs::read(out.join(contract::files::SAVE_COMPLETE)).expect("kept");
    for (bits, desc_act, needle) in [(Some(3), false, "BITS=\"3\""), (None, true, "DESC_ACT")] {
        let mut bad = args.clone();
        bad.bits = bits;
        bad.desc_act = desc_act;
        let e = run_inner(&bad, &Events::new("quantization")).expect_err("bad input");
        assert_eq!(e.exit_code(), 2, "{e}");
        assert!(flexinfer_contract::error::chain(&e).contains(needle), "{e}");
    }
    assert_eq!(
        std::fs::read(out.join(contract::files::SAVE_COMPLETE)).expect("kept"),
        before
    );
    let gptq = quantize_job::QuantizeJob {
        container: Container::Gptq,
        ..job_from_args(&args).expect("job")
    };
    assert_ne!(gptq.subdir_name(), "ct-w4-g32");
}
