//! The Job builders: spec hash, image and node-selector resolution, pod metadata, GPU tolerations.

use super::*;

#[test]
fn quant_spec_hash_keeps_the_legacy_formula_and_leaves_run_only_settings_out() {
    let mc = cache(FULL);
    let q = serde_json::to_value(&mc.spec.quantization).expect("json");
    let canon = jobs::canonical_json(&q);
    let mut h = Sha256::new();
    h.update(format!("{canon}|q:a").as_bytes());
    let want = &hex::encode(h.finalize())[..16];
    // The original formula over all of spec.quantization survives as the legacy hash (status written by
    // an older controller stays current) …
    assert_eq!(jobs::legacy_spec_hash(&mc, JobPhase::Quantize, "q:a"), want);
    assert_ne!(jobs::legacy_spec_hash(&mc, JobPhase::Quantize, "q:b"), want);
    // … and the artifact hash leaves run-only settings out: raising a deadline or a memory limit does
    // not replace a running Job or re-run a finished phase; a setting of the artifact does.
    let h = |m: &ModelCache| jobs::spec_hash(m, JobPhase::Quantize, "q:a");
    let mut run_only = mc.clone();
    if let Some(q) = run_only.spec.quantization.as_mut() {
        q.timeout_seconds = Some(999_999);
        q.max_memory_gb += 7;
        q.gpu_memory_fraction = "0.5".into();
    }
    assert_eq!(h(&run_only), h(&mc));
    assert_ne!(
        jobs::legacy_spec_hash(&run_only, JobPhase::Quantize, "q:a"),
        want
    );
    for edit in [
        |q: &mut flexinfer_api::modelcache::QuantizationSpec| q.sym = !q.sym,
        |q: &mut flexinfer_api::modelcache::QuantizationSpec| q.group_size = 32,
        |q: &mut flexinfer_api::modelcache::QuantizationSpec| q.desc_act = !q.desc_act,
        |q: &mut flexinfer_api::modelcache::QuantizationSpec| q.act_group_aware = Some(false),
        |q: &mut flexinfer_api::modelcache::QuantizationSpec| q.clip_search = Some(false),
        |q: &mut flexinfer_api::modelcache::QuantizationSpec| q.refine_scales = Some(false),
        |q: &mut flexinfer_api::modelcache::QuantizationSpec| q.damp_percent = Some("0.01".into()),
    ] {
        let mut m = mc.clone();
        if let Some(q) = m.spec.quantization.as_mut() {
            edit(q);
        }
        assert_ne!(h(&m), h(&mc));
    }
    assert_ne!(jobs::spec_hash(&mc, JobPhase::Quantize, "q:b"), h(&mc));
    // Key order does not matter.
    let a: serde_json::Value = serde_json::from_str(r#"{"b":1,"a":{"d":2,"c":3}}"#).expect("json");
    assert_eq!(jobs::canonical_json(&a), r#"{"a":{"c":3,"d":2},"b":1}"#);
}

#[test]
fn image_resolution_order() {
    let amd = cache(FULL);
    let nv = cache(&FULL.replace("gfx1100", "sm_89"));
    let env = |pairs: &[(&str, &str)]| {
        let m: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| m.get(k).cloned()).unwrap_or_else(|e| panic!("{e}"))
    };
    let all = env(&[
        ("FLEXINFER_WORKER_IMAGE", "w"),
        ("FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX1100_IMAGE", "rocm-1100"),
        ("FLEXINFER_QUANTIZER_GPTQ_ROCM_IMAGE", "rocm"),
        ("FLEXINFER_QUANTIZER_GPTQ_IMAGE", "gptq"),
        ("FLEXINFER_QUANTIZER_IMAGE_GPTQ", "chart"),
    ]);
    let no_arch = env(&[
        ("FLEXINFER_WORKER_IMAGE", "w"),
        ("FLEXINFER_QUANTIZER_GPTQ_ROCM_IMAGE", "rocm"),
        ("FLEXINFER_QUANTIZER_GPTQ_IMAGE", "gptq"),
    ]);
    let chart = env(&[
        ("FLEXINFER_WORKER_IMAGE", "w"),
        ("FLEXINFER_QUANTIZER_GPTQ_IMAGE", "gptq"),
        ("FLEXINFER_QUANTIZER_IMAGE_GPTQ", "chart"),
    ]);
    let prof = vec![profile("gfx1100", "prof")];
    let none: Vec<GPUProfile> = Vec::new();
    let cases = [
        // (cache, phase, profiles, settings, image, why)
        (
            &amd,
            JobPhase::Quantize,
            &prof,
            &all,
            "prof",
            "the GPUProfile's image first",
        ),
        (
            &amd,
            JobPhase::Quantize,
            &none,
            &all,
            "rocm-1100",
            "then the arch-specific ROCm image",
        ),
        (
            &amd,
            JobPhase::Quantize,
            &none,
            &no_arch,
            "rocm",
            "then the ROCm image",
        ),
        (
            &amd,
            JobPhase::Quantize,
            &none,
            &chart,
            "chart",
            "AMD arch skips the non-ROCm GPTQ image",
        ),
        (
            &nv,
            JobPhase::Quantize,
            &none,
            &chart,
            "gptq",
            "an NVIDIA arch takes the GPTQ image",
        ),
        (
            &amd,
            JobPhase::Download,
            &prof,
            &all,
            "w",
            "download: the worker image",
        ),
        (
            &amd,
            JobPhase::Publish,
            &none,
            &all,
            "w",
            "publish: the worker image",
        ),
    ];
    for (mc, phase, profiles, c, want, why) in cases {
        assert_eq!(
            jobs::resolve_target(mc, phase, profiles, c).image,
            Ok(want.to_string()),
            "{why}"
        );
    }
}

#[test]
fn node_selector_precedence_and_profile_fallback() {
    let c = cfg();
    let full = cache(FULL);
    let mut phase_selector = cache(FULL);
    if let Some(q) = phase_selector.spec.quantization.as_mut() {
        q.node_selector = Some(BTreeMap::from([
            ("flexinfer.ai/gpu.arch".into(), "gfx906".into()),
            ("big".into(), "ram".into()),
        ]));
    }
    let mut no_selector = cache(FULL);
    no_selector.spec.node_selector = None;
    let prof = vec![profile("gfx1100", "x")];
    let none: Vec<GPUProfile> = Vec::new();
    let arch = |a: &str| vec![("flexinfer.ai/gpu.arch", a.to_string())];
    let cases = [
        // (cache, phase, profiles, selector, why)
        (
            &full,
            JobPhase::Quantize,
            &none,
            arch("gfx1100"),
            "the cache's selector",
        ),
        (
            &phase_selector,
            JobPhase::Quantize,
            &none,
            vec![
                ("big", "ram".into()),
                ("flexinfer.ai/gpu.arch", "gfx906".into()),
            ],
            "the phase's own selector wins",
        ),
        (
            &phase_selector,
            JobPhase::Download,
            &none,
            arch("gfx1100"),
            "other phases keep the cache's",
        ),
        (
            &no_selector,
            JobPhase::Quantize,
            &prof,
            arch("gfx1100"),
            "no selector anywhere: the single GPUProfile's",
        ),
        (
            &no_selector,
            JobPhase::Download,
            &prof,
            vec![],
            "a CPU phase gets no GPUProfile selector",
        ),
    ];
    for (mc, phase, profiles, want, why) in cases {
        let got = jobs::resolve_target(mc, phase, profiles, &c).node_selector;
        let want: BTreeMap<String, String> =
            want.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        assert_eq!(got, want, "{why}");
    }
}

#[test]
fn quantize_reads_the_abliterated_model() {
    let c = cfg();
    let mc = cache(FULL);
    let t_ = jobs::resolve_target(&mc, JobPhase::Quantize, &[profile("gfx1100", "q")], &c);
    let job = jobs::build_job(&mc, &Default::default(), &[], &t_, "q", "h", &c);
    let env = job
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers[0].env.clone().unwrap_or_default())
        .unwrap_or_default();
    let get = |n: &str| {
        env.iter()
            .find(|e| e.name == n)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(get("MODEL_DIR").as_deref(), Some("/cache/mc/abliterated"));
    assert_eq!(get("OUT_DIR").as_deref(), Some("/cache/mc/gptq-w4-g128"));
    let simple = cache(SIMPLE);
    let t_ = jobs::resolve_target(&simple, JobPhase::Quantize, &[], &c);
    let job = jobs::build_job(&simple, &Default::default(), &[], &t_, "q", "h", &c);
    let env = job
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers[0].env.clone().unwrap_or_default())
        .unwrap_or_default();
    assert_eq!(
        env.iter()
            .find(|e| e.name == "MODEL_DIR")
            .and_then(|e| e.value.clone())
            .as_deref(),
        Some("/cache/mc")
    );
}

/// The GPTQ quality knobs reach the worker only when the spec sets them (the worker's defaults apply
/// otherwise), and a cache's `dampPercent` replaces the cluster-wide damping tunable.
#[test]
fn quantize_env_carries_the_gptq_quality_knobs_only_when_set() {
    let c = cfg();
    let env_of = |mc: &ModelCache| {
        let t_ = jobs::resolve_target(mc, JobPhase::Quantize, &[], &c);
        let job = jobs::build_job(mc, &Default::default(), &[], &t_, "q", "h", &c);
        job.spec
            .and_then(|s| s.template.spec)
            .map(|s| s.containers[0].env.clone().unwrap_or_default())
            .unwrap_or_default()
    };
    let values = |env: &[k8s_openapi::api::core::v1::EnvVar], n: &str| -> Vec<String> {
        env.iter()
            .filter(|e| e.name == n)
            .filter_map(|e| e.value.clone())
            .collect()
    };
    let plain = env_of(&cache(SIMPLE));
    assert!(values(&plain, "ACT_GROUP_AWARE").is_empty());
    assert!(values(&plain, "CLIP_SEARCH").is_empty());
    assert!(values(&plain, "REFINE_SCALES").is_empty());
    assert_eq!(values(&plain, "GPTQ_DAMP_PERCENT_OVERRIDE"), vec!["0.05"]);
    let set = env_of(&cache(&SIMPLE.replace(
        "quantization: {format: GPTQ}",
        "quantization: {format: GPTQ, actGroupAware: false, clipSearch: true, refineScales: false, dampPercent: \"0.01\"}",
    )));
    assert_eq!(values(&set, "ACT_GROUP_AWARE"), vec!["false"]);
    assert_eq!(values(&set, "CLIP_SEARCH"), vec!["true"]);
    assert_eq!(values(&set, "REFINE_SCALES"), vec!["false"]);
    assert_eq!(values(&set, "GPTQ_DAMP_PERCENT_OVERRIDE"), vec!["0.01"]);
}

/// A GGUF cache: the quantize Job asks the worker for one llama.cpp file of the spec's type (Q4_K_M when
/// unset) in `gguf-<type>`, with no GPTQ or calibration settings; the download fetches no calibration
/// set; it runs in the worker image on a CPU node even with `useGPU` (the GGUF engine has no GPU path).
#[test]
fn gguf_quantize_job_names_format_and_type_and_runs_on_the_cpu() {
    let c = cfg();
    let env_of = |mc: &ModelCache, phase: JobPhase| target_and_env(mc, phase, &c);
    let plain = cache(&SIMPLE.replace("{format: GPTQ}", "{format: GGUF, useGPU: true}"));
    let (target, env) = env_of(&plain, JobPhase::Quantize);
    assert!(!target.gpu, "GGUF quantization requests no GPU");
    assert_eq!(target.image.as_deref().ok(), c.worker_image.as_deref());
    assert_eq!(env.get("FORMAT").map(String::as_str), Some("GGUF"));
    assert_eq!(env.get("GGUF_TYPE").map(String::as_str), Some("Q4_K_M"));
    assert_eq!(
        env.get("OUT_DIR").map(String::as_str),
        Some("/cache/mc/gguf-q4_k_m")
    );
    for gptq_only in [
        "BITS",
        "GROUP_SIZE",
        "DATASET",
        "GPTQ_DAMP_PERCENT_OVERRIDE",
    ] {
        assert!(!env.contains_key(gptq_only), "{gptq_only} in {env:?}");
    }
    let (_, download) = env_of(&plain, JobPhase::Download);
    assert!(!download.contains_key("DATASET"), "{download:?}");
    let q6 = cache(&SIMPLE.replace("{format: GPTQ}", "{format: GGUF, ggufType: Q6_K}"));
    let (_, env) = env_of(&q6, JobPhase::Quantize);
    assert_eq!(env.get("GGUF_TYPE").map(String::as_str), Some("Q6_K"));
    assert_eq!(
        env.get("OUT_DIR").map(String::as_str),
        Some("/cache/mc/gguf-q6_k")
    );
    // With `calibration`, GGUF reads it (the importance matrix): the download fetches the set and the quantize
    // Job names it with its sample count and length, still without GPTQ settings.
    let calibrated = cache(&SIMPLE.replace(
        "{format: GPTQ}",
        "{format: GGUF, calibration: {dataset: org/calib, maxSamples: 32, maxSeqLen: 256}}",
    ));
    let (_, env) = env_of(&calibrated, JobPhase::Quantize);
    assert_eq!(env.get("DATASET").map(String::as_str), Some("org/calib"));
    assert_eq!(env.get("MAX_SAMPLES").map(String::as_str), Some("32"));
    assert_eq!(env.get("MAX_SEQ_LEN").map(String::as_str), Some("256"));
    assert!(!env.contains_key("BITS"), "{env:?}");
    let (_, download) = env_of(&calibrated, JobPhase::Download);
    assert_eq!(
        download.get("DATASET").map(String::as_str),
        Some("org/calib")
    );
    // GPTQ keeps its calibration download and its GPU.
    let gptq = cache(&SIMPLE.replace("{format: GPTQ}", "{format: GPTQ, useGPU: true}"));
    let (target, env) = env_of(&gptq, JobPhase::Quantize);
    assert!(target.gpu);
    assert!(!env.contains_key("FORMAT") && env.contains_key("BITS"));
    let (_, download) = env_of(&gptq, JobPhase::Download);
    assert!(download.contains_key("DATASET"));
}

/// The phase's target (profile `gfx1100` with GPTQ image `gptq-img`) and its Job's plain env values.
fn target_and_env(
    mc: &ModelCache,
    phase: JobPhase,
    c: &Config,
) -> (jobs::PhaseTarget, BTreeMap<String, String>) {
    let t_ = jobs::resolve_target(mc, phase, &[profile("gfx1100", "gptq-img")], c);
    let job = jobs::build_job(mc, &Default::default(), &[], &t_, "q", "h", c);
    let env = job
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers[0].env.clone().unwrap_or_default())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|e| Some((e.name, e.value?)))
        .collect();
    (t_, env)
}

/// An AWQ cache: the quantize Job asks the worker for AWQ (4 bits, the group size, the calibration set) in
/// `awq-w4-g<group>`, with none of GPTQ's settings; it runs in the worker image on a CPU node even with
/// `useGPU` (the AWQ engine has no GPU path); the download fetches the calibration set; the plan creates the
/// download Job (the format is admitted).
#[test]
fn awq_quantize_job_names_format_group_and_calibration_and_runs_on_the_cpu() {
    let c = cfg();
    let awq = cache(&SIMPLE.replace(
        "{format: GPTQ}",
        "{format: AWQ, useGPU: true, groupSize: 64}",
    ));
    let (target, env) = target_and_env(&awq, JobPhase::Quantize, &c);
    assert!(!target.gpu, "AWQ quantization requests no GPU");
    assert_eq!(target.image.as_deref().ok(), c.worker_image.as_deref());
    for (k, v) in [("FORMAT", "AWQ"), ("BITS", "4"), ("GROUP_SIZE", "64")] {
        assert_eq!(env.get(k).map(String::as_str), Some(v), "{k}: {env:?}");
    }
    assert!(
        env.contains_key("DATASET")
            && env.contains_key("MAX_SAMPLES")
            && env.contains_key("MAX_SEQ_LEN")
    );
    assert_eq!(
        env.get("OUT_DIR").map(String::as_str),
        Some("/cache/mc/awq-w4-g64")
    );
    for gptq_only in [
        "SYM",
        "DESC_ACT",
        "GPTQ_DAMP_PERCENT_OVERRIDE",
        "DYNAMIC_EXCLUSION",
    ] {
        assert!(!env.contains_key(gptq_only), "{gptq_only} in {env:?}");
    }
    let (_, download) = target_and_env(&awq, JobPhase::Download, &c);
    assert!(download.contains_key("DATASET"), "{download:?}");
    let plain = cache(&SIMPLE.replace("{format: GPTQ}", "{format: AWQ}"));
    assert_eq!(
        created_jobs(&plan(&plain, &obs(vec![]), &c, t(0))),
        vec!["mc-download"]
    );
}

/// An FP8 cache: the quantize Job asks the worker for FP8 (8 bits, the spec's exclusion) in `fp8`, with no
/// GPTQ or calibration settings; the download fetches no calibration set; it runs in the worker image on a
/// CPU node even with `useGPU` (the FP8 cast has no GPU path); the plan creates its download Job (the
/// format is admitted, not `UnsupportedFormat`).
#[test]
fn fp8_quantize_job_names_format_bits_and_exclusion_and_runs_on_the_cpu() {
    let c = cfg();
    let env_of = |mc: &ModelCache, phase: JobPhase| target_and_env(mc, phase, &c);
    let fp8 = cache(&SIMPLE.replace(
        "{format: GPTQ}",
        "{format: FP8, useGPU: true, dynamicExclusion: gdn}",
    ));
    let (target, env) = env_of(&fp8, JobPhase::Quantize);
    assert!(!target.gpu, "FP8 quantization requests no GPU");
    assert_eq!(target.image.as_deref().ok(), c.worker_image.as_deref());
    assert_eq!(env.get("FORMAT").map(String::as_str), Some("FP8"));
    assert_eq!(env.get("BITS").map(String::as_str), Some("8"));
    assert_eq!(
        env.get("DYNAMIC_EXCLUSION").map(String::as_str),
        Some("gdn")
    );
    assert_eq!(
        env.get("OUT_DIR").map(String::as_str),
        Some("/cache/mc/fp8-gdn")
    );
    for gptq_only in [
        "GROUP_SIZE",
        "DATASET",
        "MAX_SAMPLES",
        "GPTQ_DAMP_PERCENT_OVERRIDE",
    ] {
        assert!(!env.contains_key(gptq_only), "{gptq_only} in {env:?}");
    }
    let (_, download) = env_of(&fp8, JobPhase::Download);
    assert!(!download.contains_key("DATASET"), "{download:?}");
    let plain = cache(&SIMPLE.replace("{format: GPTQ}", "{format: FP8}"));
    assert_eq!(
        created_jobs(&plan(&plain, &obs(vec![]), &c, t(0))),
        vec!["mc-download"]
    );
}

/// A compressed-tensors cache: the GPTQ run's settings and calibration plus `FORMAT=COMPRESSED_TENSORS`;
/// with `useGPU` it runs on a GPU node in the arch's GPTQ image (the same solve).
#[test]
fn compressed_tensors_quantize_job_is_the_gptq_job_with_its_format() {
    let c = cfg();
    let env_of = |mc: &ModelCache, phase: JobPhase| target_and_env(mc, phase, &c);
    let ct = cache(&SIMPLE.replace(
        "{format: GPTQ}",
        "{format: COMPRESSED_TENSORS, useGPU: true, bits: 8, groupSize: 64}",
    ));
    let (target, env) = env_of(&ct, JobPhase::Quantize);
    assert!(target.gpu);
    assert_eq!(target.image.as_deref().ok(), Some("gptq-img"));
    assert_eq!(
        env.get("FORMAT").map(String::as_str),
        Some("COMPRESSED_TENSORS")
    );
    for (k, v) in [("BITS", "8"), ("GROUP_SIZE", "64"), ("SYM", "true")] {
        assert_eq!(env.get(k).map(String::as_str), Some(v), "{k}");
    }
    assert!(env.contains_key("DATASET") && env.contains_key("MAX_SAMPLES"));
    let (_, download) = env_of(&ct, JobPhase::Download);
    assert!(download.contains_key("DATASET"), "{download:?}");
}

#[test]
fn pod_labels_and_annotations_from_cache_annotations() {
    let c = cfg();
    let mut mc = cache(SIMPLE);
    mc.metadata.annotations = Some(BTreeMap::from([
        (
            "flexinfer.ai/job-pod-labels".into(),
            r#"{"cost-center":"ml","flexinfer.ai/phase":"spoof"}"#.into(),
        ),
        (
            "flexinfer.ai/quantize-pod-labels".into(),
            r#"{"sim.kwok.test/outcome":"fail"}"#.into(),
        ),
        (
            "flexinfer.ai/job-pod-annotations".into(),
            r#"{"sidecar.istio.io/inject":"false"}"#.into(),
        ),
    ]));
    let build = |p: JobPhase| {
        let t_ = jobs::resolve_target(&mc, p, &[], &c);
        jobs::build_job(&mc, &Default::default(), &[], &t_, "i", "h", &c)
            .spec
            .and_then(|s| s.template.metadata)
            .unwrap_or_default()
    };
    let q = build(JobPhase::Quantize);
    let l = q.labels.unwrap_or_default();
    assert_eq!(l.get("cost-center").map(String::as_str), Some("ml"));
    assert_eq!(
        l.get("sim.kwok.test/outcome").map(String::as_str),
        Some("fail")
    );
    assert_eq!(
        l.get("flexinfer.ai/phase").map(String::as_str),
        Some("quantize"),
        "identity labels win"
    );
    assert_eq!(
        q.annotations
            .unwrap_or_default()
            .get("sidecar.istio.io/inject")
            .map(String::as_str),
        Some("false")
    );
    let d = build(JobPhase::Download).labels.unwrap_or_default();
    assert!(!d.contains_key("sim.kwok.test/outcome"));
    assert_eq!(d.get("cost-center").map(String::as_str), Some("ml"));
}

#[test]
fn gpuprofile_changes_map_only_to_matching_caches() {
    let gfx1100 = profile("gfx1100", "x");
    let gfx906 = profile("gfx906", "x");
    let full = cache(FULL);
    assert!(jobs::profile_affects(&full, &gfx1100));
    assert!(!jobs::profile_affects(&full, &gfx906));
    // CPU-only cache: no profile matters.
    assert!(!jobs::profile_affects(&cache(SIMPLE), &gfx1100));
    // GPU phase without an arch selector: any profile of the namespace may be the one.
    let mut no_arch = cache(FULL);
    no_arch.spec.node_selector = None;
    assert!(jobs::profile_affects(&no_arch, &gfx906));
    // Other namespace: never.
    let mut other = gfx1100.clone();
    other.metadata.namespace = Some("elsewhere".into());
    assert!(!jobs::profile_affects(&full, &other));
}

fn tolerates_gpu_taint(p: &Plan) -> Vec<(String, bool)> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::CreateJob(j) => Some((
                j.metadata.name.clone().unwrap_or_default(),
                j.spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref())
                    .and_then(|s| s.tolerations.as_ref())
                    .is_some_and(|ts| {
                        ts.iter().any(|t| {
                            t.key.as_deref() == Some("dedicated")
                                && t.value.as_deref() == Some("gpu")
                                && t.effect.as_deref() == Some("NoSchedule")
                        })
                    }),
            )),
            _ => None,
        })
        .collect()
}

#[test]
fn every_job_pinned_to_gpu_nodes_tolerates_the_gpu_taint() {
    // (case, manifest, profiles, download Job tolerates `dedicated=gpu:NoSchedule`)
    let arch_pinned = SIMPLE.replace(
        "  maxRetries: 2\n",
        "  maxRetries: 2\n  nodeSelector: {flexinfer.ai/gpu.arch: gfx906}\n",
    );
    let profile_pinned = SIMPLE.replace(
        "  maxRetries: 2\n",
        "  maxRetries: 2\n  nodeSelector: {amd.com/gpu.product: rx7900, zone: a}\n",
    );
    let cpu_pinned = SIMPLE.replace(
        "  maxRetries: 2\n",
        "  maxRetries: 2\n  nodeSelector: {kubernetes.io/arch: amd64}\n",
    );
    let mut gpu_profile = profile("gfx1100", "q:a");
    gpu_profile.spec.node_selector = Some(BTreeMap::from([(
        "amd.com/gpu.product".to_string(),
        "rx7900".to_string(),
    )]));
    let cases: Vec<(&str, String, Vec<GPUProfile>, bool)> = vec![
        ("no selector", SIMPLE.to_string(), vec![], false),
        ("selector names a GPU arch", arch_pinned, vec![], true),
        (
            "selector contains a GPUProfile's selector",
            profile_pinned.clone(),
            vec![gpu_profile],
            true,
        ),
        (
            "same selector, no profile names it",
            profile_pinned,
            vec![],
            false,
        ),
        ("selector of CPU nodes", cpu_pinned, vec![], false),
    ];
    for (name, y, profiles, want) in cases {
        let o = Observed {
            profiles,
            ..Default::default()
        };
        let p = plan(&cache(&y), &o, &cfg(), t(0));
        assert_eq!(
            tolerates_gpu_taint(&p),
            vec![("mc-download".to_string(), want)],
            "{name}"
        );
    }
}

#[test]
fn pod_annotations_cannot_loosen_confinement() {
    // (annotation on the cache, refused)
    let cases = [
        (
            "flexinfer.ai/job-pod-annotations",
            r#"{"container.apparmor.security.beta.kubernetes.io/worker":"unconfined"}"#,
            true,
        ),
        (
            "flexinfer.ai/quantize-pod-annotations",
            r#"{"seccomp.security.alpha.kubernetes.io/pod":"unconfined"}"#,
            true,
        ),
        (
            "flexinfer.ai/download-pod-annotations",
            r#"{"Container.Seccomp.Security.Alpha.Kubernetes.io/worker":"unconfined"}"#,
            true,
        ),
        (
            "flexinfer.ai/job-pod-annotations",
            r#"{"prometheus.io/scrape":"true"}"#,
            false,
        ),
        // Labels are not annotations: a label with that name changes nothing.
        ("flexinfer.ai/job-pod-labels", r#"{"team":"ml"}"#, false),
    ];
    for (key, value, refused) in cases {
        let mut mc = cache(SIMPLE);
        mc.metadata.annotations = Some(BTreeMap::from([(key.to_string(), value.to_string())]));
        let p = plan(&mc, &obs(vec![]), &cfg(), t(0));
        let r = conditions::find(&p.status.conditions, "Ready");
        if refused {
            assert_eq!(
                r.map(|c| c.reason.as_str()),
                Some("InvalidSpec"),
                "{key}={value}"
            );
            assert!(r.is_some_and(|c| c.message.contains(key)), "{r:?}");
            assert!(created_jobs(&p).is_empty(), "{key}={value}");
        } else {
            assert_eq!(created_jobs(&p), vec!["mc-download"], "{key}={value}");
        }
    }
}

#[test]
fn gpu_jobs_get_the_configured_supplemental_groups_and_cpu_jobs_none() {
    let mut c = cfg();
    c.gpu_supplemental_groups = vec![44, 110];
    let mc = cache(FULL);
    let profiles = [profile("gfx1100", "q")];
    let pod_groups = |phase: JobPhase, c: &Config| {
        let t_ = jobs::resolve_target(&mc, phase, &profiles, c);
        let job = jobs::build_job(&mc, &Default::default(), &[], &t_, "q", "h", c);
        let sc = job
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|s| s.security_context)
            .unwrap_or_else(|| panic!("{phase:?}: no pod security context"));
        assert_eq!(sc.run_as_non_root, Some(true), "{phase:?}");
        sc.supplemental_groups
    };
    // Quantize requests the profile's GPU; download and publish never request one.
    assert_eq!(pod_groups(JobPhase::Quantize, &c), Some(vec![44, 110]));
    assert_eq!(pod_groups(JobPhase::Download, &c), None);
    assert_eq!(pod_groups(JobPhase::Publish, &c), None);
    // Unset: no groups anywhere (and the Job hash inputs stay as before).
    assert_eq!(pod_groups(JobPhase::Quantize, &cfg()), None);
}

/// A GPUProfile's `runtimeClassName` and `supplementalGroups` go to the Jobs that request its GPU
/// (the groups after the controller's, each once), never to CPU Jobs.
#[test]
fn gpu_jobs_get_their_profiles_runtime_class_and_groups() {
    let mut c = cfg();
    c.gpu_supplemental_groups = vec![44, 110];
    let mc = cache(FULL);
    let mut p = profile("gfx1100", "q");
    p.spec.runtime_class_name = Some("amd".into());
    p.spec.supplemental_groups = vec![110, 992];
    let profiles = [p];
    let pod = |phase: JobPhase| {
        let t_ = jobs::resolve_target(&mc, phase, &profiles, &c);
        let job = jobs::build_job(&mc, &Default::default(), &[], &t_, "q", "h", &c);
        job.spec
            .and_then(|s| s.template.spec)
            .unwrap_or_else(|| panic!("{phase:?}: no pod spec"))
    };
    let q = pod(JobPhase::Quantize);
    assert_eq!(q.runtime_class_name.as_deref(), Some("amd"));
    assert_eq!(
        q.security_context.and_then(|s| s.supplemental_groups),
        Some(vec![44, 110, 992])
    );
    for phase in [JobPhase::Download, JobPhase::Publish] {
        let p = pod(phase);
        assert_eq!(p.runtime_class_name, None, "{phase:?}");
        assert_eq!(
            p.security_context.and_then(|s| s.supplemental_groups),
            None,
            "{phase:?}"
        );
    }
}

/// Each phase's container has its own name (`kubectl logs job/<cache>-quantize -c quantizer`), and the
/// pod failure policy names that same container (a policy naming another container never applies).
#[test]
fn container_names_match_the_failure_policy() {
    let c = cfg();
    let mc = cache(FULL);
    for phase in JobPhase::ALL {
        let t_ = jobs::resolve_target(&mc, phase, &[profile("gfx1100", "q")], &c);
        let job = jobs::build_job(&mc, &Default::default(), &[], &t_, "q", "h", &c);
        let spec = job.spec.expect("job spec");
        let container = spec.template.spec.expect("pod spec").containers[0]
            .name
            .clone();
        let policy = spec.pod_failure_policy.expect("pod failure policy");
        let named = policy.rules[0]
            .on_exit_codes
            .as_ref()
            .and_then(|r| r.container_name.clone());
        assert_eq!(container, phase.container_name(), "{phase:?}");
        assert_eq!(named.as_deref(), Some(container.as_str()), "{phase:?}");
    }
    assert_eq!(JobPhase::Quantize.container_name(), "quantizer");
}

#[test]
fn the_created_claim_takes_the_access_mode_of_the_spec() {
    let modes = |mc: &ModelCache| {
        jobs::build_pvc(mc)
            .spec
            .and_then(|s| s.access_modes)
            .unwrap_or_default()
    };
    assert_eq!(modes(&cache(SIMPLE)), vec!["ReadWriteOnce"]);
    let rwx = cache(&format!(
        "{SIMPLE}  claimAccessMode: ReadWriteMany\n  clusterStorageClassName: nfs\n"
    ));
    assert_eq!(modes(&rwx), vec!["ReadWriteMany"]);
    assert_eq!(
        jobs::build_pvc(&rwx)
            .spec
            .and_then(|s| s.storage_class_name)
            .as_deref(),
        Some("nfs")
    );
}
