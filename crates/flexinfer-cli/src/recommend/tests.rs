use super::*;

fn model(b: f64, moe: bool, hybrid: bool) -> Footprint {
    Footprint {
        params: b * 1e9,
        source: "test".into(),
        model_type: None,
        moe,
        hybrid,
    }
}

fn gpu(arch: &str) -> GpuTarget {
    let (vendor, vram) = known_arch(arch).unwrap();
    GpuTarget {
        arch: Some(arch.into()),
        vendor: Some(vendor.into()),
        vram_mb: Some(vram),
        source: "test".into(),
    }
}

struct Row {
    b: f64,
    moe: bool,
    hybrid: bool,
    arch: &'static str,
    bits: i32,
    excl: &'static str,
    seq: i32,
    samples: i32,
    npar: Option<i32>,
    mem: i32,
    fits: bool,
}

/// Models × GPUs. The 24 GB rows are the measured baseline (memory and calibration per model class on a 24 GB card); 16 GB rows move a class up.
#[test]
fn table_of_models_and_gpus() {
    let rows = [
        // baseline: 8B GPTQ INT4 on 24 GB: defaults, 32Gi
        Row {
            b: 8.0,
            moe: false,
            hybrid: false,
            arch: "gfx1100",
            bits: 4,
            excl: "auto",
            seq: 4096,
            samples: 256,
            npar: None,
            mem: 32,
            fits: true,
        },
        // baseline: 14B GPTQ on 24 GB: 256 @ 4096, nParallel 32, maxMemoryGB 56
        Row {
            b: 14.0,
            moe: false,
            hybrid: false,
            arch: "gfx1100",
            bits: 4,
            excl: "auto",
            seq: 4096,
            samples: 256,
            npar: Some(32),
            mem: 56,
            fits: true,
        },
        // baseline: 27B single GPU: 128 @ 2048, nParallel 16, 96Gi; hybrid auto (~28 GB) does not fit → none (~15 GB)
        Row {
            b: 27.0,
            moe: false,
            hybrid: true,
            arch: "gfx1100",
            bits: 4,
            excl: "none",
            seq: 2048,
            samples: 128,
            npar: Some(16),
            mem: 96,
            fits: true,
        },
        // dense 27B at 4 bit fits 24 GB
        Row {
            b: 27.0,
            moe: false,
            hybrid: false,
            arch: "gfx1100",
            bits: 4,
            excl: "auto",
            seq: 2048,
            samples: 128,
            npar: Some(16),
            mem: 96,
            fits: true,
        },
        // 26B MoE hybrid: 512 samples for expert coverage
        Row {
            b: 25.2,
            moe: true,
            hybrid: true,
            arch: "gfx1100",
            bits: 4,
            excl: "none",
            seq: 2048,
            samples: 512,
            npar: Some(16),
            mem: 96,
            fits: true,
        },
        // 9B hybrid: auto fits 24 GB
        Row {
            b: 9.0,
            moe: false,
            hybrid: true,
            arch: "gfx1100",
            bits: 4,
            excl: "auto",
            seq: 4096,
            samples: 256,
            npar: None,
            mem: 32,
            fits: true,
        },
        // gfx906 16 GB: 8B moves to the 14B calibration recipe; host memory stays the 8B one
        Row {
            b: 8.0,
            moe: false,
            hybrid: false,
            arch: "gfx906",
            bits: 4,
            excl: "auto",
            seq: 4096,
            samples: 256,
            npar: Some(32),
            mem: 32,
            fits: true,
        },
        // 14B on 16 GB: 27B calibration recipe
        Row {
            b: 14.0,
            moe: false,
            hybrid: false,
            arch: "gfx906",
            bits: 4,
            excl: "auto",
            seq: 2048,
            samples: 128,
            npar: Some(16),
            mem: 56,
            fits: true,
        },
        // 27B on 16 GB: 4-bit (~15 GB) exceeds 85% of 16 GB → 3 bit
        Row {
            b: 27.0,
            moe: false,
            hybrid: false,
            arch: "gfx906",
            bits: 3,
            excl: "none",
            seq: 2048,
            samples: 128,
            npar: Some(16),
            mem: 96,
            fits: true,
        },
        // 70B on 24 GB: does not fit even at 3 bit
        Row {
            b: 70.0,
            moe: false,
            hybrid: false,
            arch: "gfx1100",
            bits: 4,
            excl: "auto",
            seq: 2048,
            samples: 128,
            npar: Some(16),
            mem: 248,
            fits: false,
        },
        // 70B on an 80 GB H100: fits at 4 bit
        Row {
            b: 70.0,
            moe: false,
            hybrid: false,
            arch: "sm_90",
            bits: 4,
            excl: "auto",
            seq: 2048,
            samples: 128,
            npar: Some(16),
            mem: 248,
            fits: true,
        },
        // 8B on an 80 GB H100: defaults
        Row {
            b: 8.0,
            moe: false,
            hybrid: false,
            arch: "sm_90",
            bits: 4,
            excl: "auto",
            seq: 4096,
            samples: 256,
            npar: None,
            mem: 32,
            fits: true,
        },
    ];
    for (i, r) in rows.iter().enumerate() {
        let rec = recommend(&model(r.b, r.moe, r.hybrid), &gpu(r.arch));
        let ctx = format!("row {i} ({}B on {}): {rec:#?}", r.b, r.arch);
        assert_eq!(rec.format, "GPTQ", "{ctx}");
        assert!(rec.sym && !rec.desc_act, "{ctx}");
        assert_eq!(rec.group_size, 128, "{ctx}");
        assert_eq!(rec.bits, r.bits, "{ctx}");
        assert_eq!(rec.dynamic_exclusion, r.excl, "{ctx}");
        assert_eq!(rec.calibration.max_seq_len, r.seq, "{ctx}");
        assert_eq!(rec.calibration.max_samples, r.samples, "{ctx}");
        assert_eq!(rec.calibration.n_parallel_calib_samples, r.npar, "{ctx}");
        assert_eq!(rec.max_memory_gb, r.mem, "{ctx}");
        assert_eq!(rec.fits, Some(r.fits), "{ctx}");
        assert!(rec.use_gpu, "{ctx}");
        assert!((3600..=172_800).contains(&rec.timeout_seconds), "{ctx}");
        assert!(rec.reasons.len() >= 4, "{ctx}");
    }
}

#[test]
fn gfx1100_reason_names_exllama_and_the_expected_times() {
    let rec = recommend(&model(8.0, false, false), &gpu("gfx1100"));
    assert!(
        rec.reasons.iter().any(|r| r.contains("ExLlama")),
        "{:?}",
        rec.reasons
    );
    // baseline: 8B ≈ 30 min, 14B ≈ 73 min
    assert!(
        (25.0..=35.0).contains(&rec.estimated_minutes),
        "{}",
        rec.estimated_minutes
    );
    let rec = recommend(&model(14.0, false, false), &gpu("gfx1100"));
    assert!(
        (60.0..=85.0).contains(&rec.estimated_minutes),
        "{}",
        rec.estimated_minutes
    );
    // baseline: 27B hybrid auto ~28 GB, none ~15 GB
    let rec = recommend(&model(27.0, false, true), &gpu("gfx1100"));
    assert!(
        (13.0..=17.0).contains(&rec.estimated_artifact_gb),
        "{}",
        rec.estimated_artifact_gb
    );
    assert!(rec.reasons.iter().any(|r| r.contains("does not fit")));
}

#[test]
fn no_gpu_means_fit_unknown() {
    let rec = recommend(&model(8.0, false, false), &GpuTarget::default());
    assert_eq!(rec.fits, None);
    assert!(!rec.use_gpu);
    assert!(rec.reasons.iter().any(|r| r.contains("fit not checked")));
}

#[test]
fn patch_sets_quantization_fields() {
    let rec = recommend(&model(14.0, false, false), &gpu("gfx1100"));
    let p = rec.spec_patch();
    let q = &p["spec"]["quantization"];
    assert_eq!(q["format"], "GPTQ");
    assert_eq!(q["bits"], 4);
    assert_eq!(q["maxMemoryGB"], 56);
    assert_eq!(q["calibration"]["nParallelCalibSamples"], 32);
    assert!(q["ggufType"].is_null());
    let rec = recommend(&model(8.0, false, false), &gpu("gfx1100"));
    let p = rec.spec_patch();
    // merge patch null: clears a previous nParallelCalibSamples
    assert!(p["spec"]["quantization"]["calibration"]
        .as_object()
        .unwrap()
        .contains_key("nParallelCalibSamples"));
}

/// gfx906 (which vLLM does not serve) defaults to GGUF; the type is Q4_K_M when it fits the 16 GB card and
/// smaller ones when it does not; the patch sets GGUF and removes the GPTQ-only fields.
#[test]
fn gguf_for_gfx906() {
    use super::gguf;
    assert!(gguf::default_for(&gpu("gfx906")));
    assert!(!gguf::default_for(&gpu("gfx1100")) && !gguf::default_for(&gpu("sm_90")));
    let rows = [
        // (billions of parameters, expected type, fits)
        (8.0, "Q4_K_M", true),
        (14.0, "Q4_K_M", true),
        (27.0, "Q3_K_M", true),
        (32.0, "Q2_K", true),
        (70.0, "Q2_K", false),
    ];
    for (b, want, fits) in rows {
        let r = gguf::recommend(&model(b, false, false), &gpu("gfx906"));
        let ctx = format!("{b}B on gfx906: {r:#?}");
        assert_eq!(r.gguf_type, want, "{ctx}");
        assert_eq!(r.fits, Some(fits), "{ctx}");
        assert!(!r.use_gpu, "{ctx}");
        assert!(
            r.reasons
                .iter()
                .any(|s| s.contains("vLLM does not support gfx906")),
            "{ctx}"
        );
        // The estimate grows with the model and stays within the card when it fits.
        assert!(r.estimated_artifact_gb > 0.0, "{ctx}");
        if fits {
            assert!(
                r.estimated_artifact_gb <= 16.0 * 1.073_741_824 * 0.85 + 0.05,
                "{ctx}"
            );
        }
    }
    let r = gguf::recommend(&model(8.0, false, false), &gpu("gfx906"));
    let p = r.spec_patch();
    let q = &p["spec"]["quantization"];
    assert_eq!(q["format"], "GGUF");
    assert_eq!(q["ggufType"], "Q4_K_M");
    assert_eq!(q["useGPU"], false);
    for k in [
        "bits",
        "groupSize",
        "sym",
        "descAct",
        "dynamicExclusion",
        "calibration",
    ] {
        assert!(
            q[k].is_null() && q.as_object().is_some_and(|o| o.contains_key(k)),
            "{k}: {q}"
        );
    }
    // Every type it can pick is one the engine writes.
    for t in ["Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K"] {
        assert!(flexinfer_api::contract::env::GGUF_TYPES.contains(&t), "{t}");
    }
}

/// `--format AWQ`: 4-bit g128 with AutoAWQ's calibration on every card vLLM serves (gfx1100 included, with
/// the reason naming the ROCm kernels and GPTQ's faster decode), the fit checked with no smaller width to
/// fall back to, the patch setting AWQ's fields and removing the others; refused on gfx906 and for the
/// families the engine cannot fold.
#[test]
fn awq_when_asked_for() {
    use super::awq::{self, AwqRefusal};
    // (billions, arch, fits): 4 bits + (16 + 4)/128 per quantized weight on 95% of them, 5% kept 16-bit.
    let rows = [
        (8.0, "gfx1100", true),
        (14.0, "gfx1100", true),
        (27.0, "gfx1100", true),
        (70.0, "gfx1100", false),
        (70.0, "sm_90", true),
        (8.0, "sm_86", true),
    ];
    for (b, arch, fits) in rows {
        let r = awq::recommend(&model(b, false, false), &gpu(arch)).unwrap();
        let ctx = format!("{b}B on {arch}: {r:#?}");
        let want_gb = b * (0.95 * (4.0 + 20.0 / 128.0) / 8.0 + 0.1);
        assert!((r.estimated_artifact_gb - want_gb).abs() < 0.06, "{ctx}");
        assert_eq!(r.fits, Some(fits), "{ctx}");
        assert_eq!((r.format, r.bits, r.group_size), ("AWQ", 4, 128), "{ctx}");
        assert_eq!((r.max_samples, r.max_seq_len), (128, 512), "{ctx}");
        assert!(!r.use_gpu, "{ctx}");
        // Host memory and timeout as the GPTQ recommendation of the same model.
        let gptq = recommend(&model(b, false, false), &gpu(arch));
        assert_eq!(r.max_memory_gb, gptq.max_memory_gb, "{ctx}");
        assert!((3600..=172_800).contains(&r.timeout_seconds), "{ctx}");
        assert_eq!(
            r.reasons.iter().any(|s| s.starts_with("WARNING")),
            !fits,
            "{ctx}"
        );
        assert_eq!(
            r.reasons.iter().any(|s| s.contains("ROCm int4 kernels")),
            arch == "gfx1100",
            "{ctx}"
        );
        // What it sets is what admission takes for AWQ.
        assert!(flexinfer_api::contract::env::AWQ_GROUP_SIZES.contains(&(r.group_size as usize)));
    }
    // The default on gfx1100 stays GPTQ and names AWQ as vLLM's other format there.
    let g = recommend(&model(8.0, false, false), &gpu("gfx1100"));
    assert_eq!(g.format, "GPTQ");
    assert!(
        g.reasons.iter().any(|s| s.contains("--format AWQ")),
        "{g:#?}"
    );

    let p = awq::recommend(&model(8.0, false, false), &gpu("gfx1100"))
        .unwrap()
        .spec_patch();
    let q = &p["spec"]["quantization"];
    assert_eq!(q["format"], "AWQ");
    assert_eq!(q["bits"], 4);
    assert_eq!(q["groupSize"], 128);
    assert_eq!(q["descAct"], false);
    assert_eq!(q["useGPU"], false);
    assert_eq!(q["calibration"]["maxSamples"], 128);
    assert_eq!(q["calibration"]["maxSeqLen"], 512);
    for k in ["sym", "dynamicExclusion", "gpuMemoryFraction", "ggufType"] {
        assert!(
            q[k].is_null() && q.as_object().is_some_and(|o| o.contains_key(k)),
            "{k}: {q}"
        );
    }
    assert!(q["calibration"]["nParallelCalibSamples"].is_null());

    let e = awq::recommend(&model(8.0, false, false), &gpu("gfx906")).unwrap_err();
    assert_eq!(
        e,
        AwqRefusal::NoVllm {
            arch: "gfx906".into()
        }
    );
    assert!(
        flexinfer_api::contract::error::chain(&e).contains("use --format GGUF"),
        "{e}"
    );
    for (m, what) in [
        (model(30.0, true, false), "mixture-of-experts"),
        (model(27.0, false, true), "linear-attention"),
        (
            Footprint {
                model_type: Some("gemma3".into()),
                ..model(12.0, false, false)
            },
            "Gemma",
        ),
    ] {
        let e = awq::recommend(&m, &gpu("gfx1100")).unwrap_err();
        assert!(
            flexinfer_api::contract::error::chain(&e).contains(what)
                && flexinfer_api::contract::error::chain(&e).contains("use --format GPTQ"),
            "{e}"
        );
    }
    // No GPU known: the fit is not checked.
    let r = awq::recommend(&model(8.0, false, false), &GpuTarget::default()).unwrap();
    assert_eq!(r.fits, None);
}
