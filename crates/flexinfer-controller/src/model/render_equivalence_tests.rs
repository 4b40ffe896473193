//! TEMPORARY: the typed renderer produces byte-for-byte the JSON the `json!` renderer produced
//! (removed with `render_legacy` in the next commit).

use flexinfer_api::modelcache::CachePhase;
use flexinfer_api::{GPUProfile, Model, ModelCache};
use serde_json::json;

use super::render::*;
use super::render_legacy::render_legacy;

fn model(name: &str, spec: serde_json::Value, served: Option<&str>) -> Model {
    let mut m: Model = serde_json::from_value(json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "namespace": "ns", "uid": "u-1"},
        "spec": spec
    }))
    .unwrap_or_else(|e| panic!("model {name}: {e}"));
    m.metadata.generation = Some(1);
    if let Some(p) = served {
        m.status = Some(flexinfer_api::ModelStatus {
            served_path: Some(p.into()),
            ..Default::default()
        });
    }
    m
}

fn profiles() -> Vec<Option<GPUProfile>> {
    let p = |v: serde_json::Value| -> Option<GPUProfile> {
        Some(serde_json::from_value(v).unwrap_or_else(|e| panic!("profile: {e}")))
    };
    vec![
        None,
        p(
            json!({"apiVersion": "ai.flexinfer/v1alpha2", "kind": "GPUProfile",
            "metadata": {"name": "gfx1100", "namespace": "ns"},
            "spec": {"architecture": "gfx1100", "vendor": "amd", "containerMemoryGB": 32, "gpuDriverMemoryMB": 1024,
                     "env": [{"name": "HSA_OVERRIDE_GFX_VERSION", "value": "11.0.0"}, {"name": "OLLAMA_HOST", "value": "x"},
                             {"name": "DUP", "value": "1"}, {"name": "DUP", "value": "2"}],
                     "runtime": {"images": {"vllm": "registry/vllm-rocm:1"}}}}),
        ),
        p(
            json!({"apiVersion": "ai.flexinfer/v1alpha2", "kind": "GPUProfile",
            "metadata": {"name": "sm89", "namespace": "ns"},
            "spec": {"architecture": "sm89", "vendor": "nvidia"}}),
        ),
    ]
}

fn caches() -> Vec<Option<ModelCache>> {
    let c = |phase: Option<&str>, path: Option<&str>, format: Option<&str>| {
        let mut spec = json!({"source": "org/model"});
        if let Some(f) = format {
            spec["quantization"] = json!({"format": f});
        }
        let mut c: ModelCache = serde_json::from_value(json!({
            "apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
            "metadata": {"name": "cache", "namespace": "ns"}, "spec": spec,
        }))
        .unwrap_or_else(|e| panic!("cache: {e}"));
        c.status = Some(flexinfer_api::ModelCacheStatus {
            phase: phase.and_then(|p| CachePhase::ALL.into_iter().find(|x| x.as_str() == p)),
            path: path.map(str::to_string),
            ..Default::default()
        });
        Some(c)
    };
    vec![
        None,
        c(
            Some("Ready"),
            Some("pvc-a:cache/gptq-w4-g128"),
            Some("GPTQ"),
        ),
        c(Some("Quantizing"), Some("pvc-a:cache/old"), Some("GPTQ")),
        c(Some("Ready"), Some("pvc-a:cache/m.gguf"), None),
        c(Some("Ready"), None, None),
    ]
}

fn specs() -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    let sources = [
        "pvc://c/p",
        "pvc://c/dir/m-q4.gguf",
        "pvc://c/dir/",
        "modelcache://cache",
        "HF://org/model",
        "org/model",
        "pvc://c//etc",
    ];
    let gpus = [
        json!({"profile": "gfx1100"}),
        json!({"vendor": "nvidia", "count": 2, "shared": "grp", "priority": 7}),
        json!({"vendor": "amd"}),
        json!({}),
    ];
    let configs = [
        json!({}),
        json!({"quantization": "gptq", "kvCacheDtype": "fp8_e4m3", "maxModelLen": 16384, "maxNumBatchedTokens": 160,
               "gpuMemoryUtilization": 0.98, "attentionBackend": "TRITON_ATTN", "extraArgs": ["--enforce-eager"]}),
        json!({"quantization": "gguf", "kvCacheDtype": "float16", "maxModelLen": 8192, "maxNumBatchedTokens": 64}),
        json!({"quantization": "exl2", "kvCacheDtype": "fp8", "maxModelLen": 4096}),
        json!({"kvCacheDtype": "bfloat16", "attentionBackend": ""}),
        json!({"kvCacheDtype": "auto", "quantization": "none"}),
    ];
    let extras = [
        json!({}),
        json!({"resources": {"limits": {"memory": "8Gi", "cpu": "2"}}, "image": "spec/image:1",
               "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]}),
        json!({"resources": {"requests": {"cpu": "1"}}, "nodeSelector": {"flexinfer.ai/gpu.arch": "gfx1100", "zone": "a"},
               "tolerations": [{"key": "other", "operator": "Exists"}], "image": ""}),
    ];
    for backend in ["vllm", "llamacpp", "ollama", "exllamav2"] {
        for source in sources {
            for (gi, gpu) in gpus.iter().enumerate() {
                for (ci, config) in configs.iter().enumerate() {
                    let extra = &extras[(gi + ci) % extras.len()];
                    let mut s =
                        json!({"backend": backend, "source": source, "gpu": gpu, "config": config});
                    if let (Some(s), Some(e)) = (s.as_object_mut(), extra.as_object()) {
                        for (k, v) in e {
                            s.insert(k.clone(), v.clone());
                        }
                    }
                    out.push(s);
                }
            }
        }
    }
    out
}

#[test]
fn typed_render_serializes_like_the_json_render() {
    let mut cfg = RenderConfig::default();
    cfg.runtime_images
        .insert("llamacpp".into(), "env/llama:2".into());
    let (profiles, caches) = (profiles(), caches());
    let (mut ok, mut err) = (0, 0);
    for (i, spec) in specs().into_iter().enumerate() {
        for served in [None, Some("pvc-a:cache/prev")] {
            for name in ["m", "9bad"] {
                let m = model(name, spec.clone(), served);
                for p in &profiles {
                    for c in &caches {
                        let new = render(&m, c.as_ref(), p.as_ref(), &cfg);
                        let old = render_legacy(&m, c.as_ref(), p.as_ref(), &cfg);
                        match (new, old) {
                            (Ok(n), Ok(o)) => {
                                let nd = serde_json::to_string(&n.deployment).unwrap_or_default();
                                let od = serde_json::to_string(&o.deployment).unwrap_or_default();
                                assert_eq!(nd, od, "case {i} deployment: {spec}");
                                let ns = serde_json::to_string(&n.service).unwrap_or_default();
                                let os = serde_json::to_string(&o.service).unwrap_or_default();
                                assert_eq!(ns, os, "case {i} service: {spec}");
                                assert_eq!(n.served_path, o.served_path, "case {i}");
                                assert_eq!(n.cached, o.cached, "case {i}");
                                assert_eq!(n.format, o.format, "case {i}");
                                ok += 1;
                            }
                            (Err(n), Err(o)) => {
                                assert_eq!(n, o, "case {i}: {spec}");
                                err += 1;
                            }
                            (n, o) => {
                                panic!("case {i}: {spec}: new {:?} old {:?}", n.err(), o.err())
                            }
                        }
                    }
                }
            }
        }
    }
    eprintln!("equivalent: {ok} rendered, {err} rejected");
    assert!(ok > 1000 && err > 1000, "{ok} rendered, {err} rejected");
}
