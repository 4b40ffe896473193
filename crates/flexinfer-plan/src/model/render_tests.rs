//! Table-driven tests of `render` (args per backend, images, compatibility, sources, profiles).

use flexinfer_api::contract::{annotations, env, labels};
use flexinfer_api::modelcache::CachePhase;
use flexinfer_api::{GPUProfile, Model, ModelCache};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Container;

use super::render::*;

fn model(name: &str, spec: serde_json::Value) -> Model {
    let mut m: Model = serde_json::from_value(serde_json::json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "Model",
        "metadata": {"name": name, "namespace": "ns", "uid": "u-1"},
        "spec": spec
    }))
    .unwrap_or_else(|e| panic!("model: {e}"));
    m.metadata.generation = Some(1);
    m
}

fn profile() -> GPUProfile {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "GPUProfile",
        "metadata": {"name": "gfx1100", "namespace": "ns"},
        "spec": {"architecture": "gfx1100", "vendor": "amd", "containerMemoryGB": 32, "gpuDriverMemoryMB": 1024,
                 "env": [{"name": "HSA_OVERRIDE_GFX_VERSION", "value": "11.0.0"}],
                 "runtime": {"images": {"vllm": "registry/vllm-rocm:1", "exllamav2": "registry/exllamav2-rocm:1"}}}
    }))
    .unwrap_or_else(|e| panic!("profile: {e}"))
}

fn cache(phase: Option<&str>, path: Option<&str>, format: Option<&str>) -> ModelCache {
    let mut spec = serde_json::json!({"source": "org/model"});
    if let Some(f) = format {
        spec["quantization"] = serde_json::json!({"format": f});
    }
    let mut c: ModelCache = serde_json::from_value(serde_json::json!({
        "apiVersion": "ai.flexinfer/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "cache", "namespace": "ns"},
        "spec": spec,
    }))
    .unwrap_or_else(|e| panic!("cache: {e}"));
    c.status = Some(flexinfer_api::ModelCacheStatus {
        phase: phase.and_then(|p| CachePhase::ALL.into_iter().find(|x| x.as_str() == p)),
        path: path.map(str::to_string),
        ..Default::default()
    });
    c
}

fn container(d: &Deployment) -> Container {
    d.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|p| p.containers[0].clone())
        .unwrap_or_else(|| panic!("no container"))
}

fn arg_after(c: &Container, flag: &str) -> Option<String> {
    let args = c.args.clone().unwrap_or_default();
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

fn env(c: &Container, name: &str) -> Option<String> {
    c.env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

#[test]
fn vllm_gemma4_canary_args() {
    let m = model(
        "gemma4-26b-a4b-gptq-long",
        serde_json::json!({
            "backend": "vllm",
            "source": "pvc://gemma4-26b-a4b-gptq/gemma4-26b-a4b-gptq/gptq-w4-g128-attnfp16-clean",
            "gpu": {"profile": "gfx1100", "priority": 255, "shared": "7900xtx-textgen"},
            "config": {"quantization": "gptq", "kvCacheDtype": "fp8_e4m3", "maxModelLen": 16384,
                       "maxNumBatchedTokens": 160, "gpuMemoryUtilization": 0.98, "attentionBackend": "TRITON_ATTN",
                       "extraArgs": ["--enforce-eager"]}
        }),
    );
    let p = profile();
    let r = render(&m, None, Some(&p), &RenderConfig::default()).unwrap_or_else(|e| panic!("{e}"));
    let c = container(&r.deployment);
    assert_eq!(
        c.image.as_deref(),
        Some("registry/vllm-rocm:1"),
        "profile image wins over defaults"
    );
    assert_eq!(arg_after(&c, "--model").as_deref(), Some("/models/model"));
    assert_eq!(arg_after(&c, "--max-model-len").as_deref(), Some("16384"));
    assert_eq!(
        arg_after(&c, "--kv-cache-dtype").as_deref(),
        Some("fp8_e4m3")
    );
    assert_eq!(
        arg_after(&c, "--gpu-memory-utilization").as_deref(),
        Some("0.98")
    );
    assert_eq!(
        arg_after(&c, "--max-num-batched-tokens").as_deref(),
        Some("160")
    );
    assert_eq!(
        arg_after(&c, "--quantization"),
        None,
        "vLLM reads the method from the checkpoint"
    );
    assert_eq!(
        arg_after(&c, "--served-model-name").as_deref(),
        Some("gemma4-26b-a4b-gptq-long")
    );
    assert_eq!(
        c.args.as_ref().and_then(|a| a.last().cloned()).as_deref(),
        Some("--enforce-eager")
    );
    assert_eq!(
        env(&c, env::serving::VLLM_ATTENTION_BACKEND).as_deref(),
        Some("TRITON_ATTN")
    );
    assert_eq!(
        env(&c, "HSA_OVERRIDE_GFX_VERSION").as_deref(),
        Some("11.0.0")
    );
    let res = c.resources.clone().unwrap_or_default();
    let limits = res.limits.unwrap_or_default();
    assert_eq!(limits.get("amd.com/gpu").map(|q| q.0.as_str()), Some("1"));
    assert_eq!(limits.get("memory").map(|q| q.0.as_str()), Some("33792Mi"));
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "model")
        .cloned();
    let mount = mount.unwrap_or_else(|| panic!("no model mount"));
    assert_eq!(mount.read_only, Some(true));
    assert_eq!(
        mount.sub_path.as_deref(),
        Some("gemma4-26b-a4b-gptq/gptq-w4-g128-attnfp16-clean")
    );
    let pod = r
        .deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.clone())
        .unwrap_or_default();
    assert_eq!(
        pod.node_selector
            .unwrap_or_default()
            .get(labels::GPU_ARCH)
            .map(String::as_str),
        Some("gfx1100")
    );
    let vol = pod
        .volumes
        .unwrap_or_default()
        .into_iter()
        .find(|v| v.name == "model");
    let pvc = vol
        .and_then(|v| v.persistent_volume_claim)
        .unwrap_or_else(|| panic!("no pvc volume"));
    assert_eq!(pvc.claim_name, "gemma4-26b-a4b-gptq");
    assert_eq!(pvc.read_only, Some(true));
    assert!(pod
        .tolerations
        .unwrap_or_default()
        .iter()
        .any(|t| t.key.as_deref() == Some("dedicated")));
    let tmpl_annos = r
        .deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.clone())
        .and_then(|m| m.annotations)
        .unwrap_or_default();
    assert_eq!(
        tmpl_annos.get(annotations::SERVED_PATH).map(String::as_str),
        Some("gemma4-26b-a4b-gptq:gemma4-26b-a4b-gptq/gptq-w4-g128-attnfp16-clean")
    );
    assert_eq!(
        tmpl_annos
            .get(annotations::GPU_PRIORITY)
            .map(String::as_str),
        Some("255")
    );
    let dl = r.deployment.metadata.labels.clone().unwrap_or_default();
    for k in [
        labels::NAME,
        labels::INSTANCE,
        labels::COMPONENT,
        labels::MANAGED_BY,
        labels::PART_OF,
        labels::MODEL,
    ] {
        assert!(dl.contains_key(k), "missing label {k}");
    }
    assert_eq!(
        r.deployment
            .metadata
            .owner_references
            .as_ref()
            .map(|o| o.len()),
        Some(1)
    );
    let port = r
        .service
        .spec
        .as_ref()
        .and_then(|s| s.ports.clone())
        .unwrap_or_default();
    assert_eq!(port[0].port, 8000);
    assert_eq!(port[0].name.as_deref(), Some("http"));
    assert_eq!(endpoint("m", "ns"), "http://m.ns.svc:8000/v1");
}

#[test]
fn image_resolution_order() {
    let p = profile();
    let mut cfg = RenderConfig::default();
    cfg.runtime_images
        .insert("vllm".into(), "env/vllm:2".into());
    cfg.runtime_images
        .insert("llamacpp".into(), "env/llama:2".into());
    let img = |m: &Model, p: Option<&GPUProfile>, cfg: &RenderConfig| {
        render(m, None, p, cfg)
            .map(|r| container(&r.deployment).image.unwrap_or_default())
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let base = serde_json::json!({"backend": "vllm", "source": "pvc://c/p", "gpu": {"profile": "gfx1100"}});
    let mut with_image = base.clone();
    with_image["image"] = "spec/image:1".into();
    assert_eq!(img(&model("a", with_image), Some(&p), &cfg), "spec/image:1");
    assert_eq!(
        img(&model("a", base), Some(&p), &cfg),
        "registry/vllm-rocm:1"
    );
    let llama = serde_json::json!({"backend": "llamacpp", "source": "pvc://c/m.gguf", "gpu": {"profile": "gfx1100"}});
    assert_eq!(
        img(&model("a", llama.clone()), Some(&p), &cfg),
        "env/llama:2"
    );
    assert_eq!(
        img(&model("a", llama), Some(&p), &RenderConfig::default()),
        format!(
            "{}:{}-rocm",
            super::images::LLAMACPP_REPOSITORY,
            crate::VERSION
        ),
        "the table: FlexInfer's ROCm llama.cpp image on gfx1100"
    );
}

#[test]
fn other_backends() {
    let p = profile();
    let cfg = RenderConfig::default();
    // llama.cpp with a .gguf file
    let m = model(
        "llama",
        serde_json::json!({"backend": "llamacpp", "source": "pvc://c/dir/m-q4.gguf",
        "gpu": {"profile": "gfx1100"}, "config": {"maxModelLen": 8192, "kvCacheDtype": "float16", "quantization": "gguf"}}),
    );
    let c = container(
        &render(&m, None, Some(&p), &cfg)
            .unwrap_or_else(|e| panic!("{e}"))
            .deployment,
    );
    assert_eq!(
        arg_after(&c, "--model").as_deref(),
        Some("/models/m-q4.gguf")
    );
    assert_eq!(arg_after(&c, "--ctx-size").as_deref(), Some("8192"));
    assert_eq!(arg_after(&c, "--cache-type-k").as_deref(), Some("f16"));
    assert_eq!(
        c.readiness_probe
            .and_then(|p| p.http_get)
            .map(|h| h.path.unwrap_or_default())
            .as_deref(),
        Some("/health")
    );
    // ollama
    let m = model(
        "olla",
        serde_json::json!({"backend": "ollama", "source": "pvc://c/dir",
        "gpu": {"vendor": "nvidia"}, "config": {"maxModelLen": 4096}}),
    );
    let r = render(&m, None, None, &cfg).unwrap_or_else(|e| panic!("{e}"));
    let c = container(&r.deployment);
    assert_eq!(env(&c, "OLLAMA_HOST").as_deref(), Some("0.0.0.0:8000"));
    assert_eq!(env(&c, "OLLAMA_CONTEXT_LENGTH").as_deref(), Some("4096"));
    assert!(c
        .command
        .unwrap_or_default()
        .join(" ")
        .contains("ollama create olla"));
    let limits = c.resources.and_then(|r| r.limits).unwrap_or_default();
    assert!(limits.contains_key("nvidia.com/gpu"));
    // exllamav2
    let m = model(
        "exl",
        serde_json::json!({"backend": "exllamav2", "source": "pvc://c/exl2-w4",
        "gpu": {"profile": "gfx1100", "count": 2}, "config": {"maxModelLen": 4096, "quantization": "exl2"}}),
    );
    let c = container(
        &render(&m, None, Some(&p), &cfg)
            .unwrap_or_else(|e| panic!("{e}"))
            .deployment,
    );
    assert_eq!(arg_after(&c, "--model-dir").as_deref(), Some("/models"));
    assert_eq!(arg_after(&c, "--model-name").as_deref(), Some("model"));
    assert_eq!(arg_after(&c, "--max-seq-len").as_deref(), Some("4096"));
    let limits = c.resources.and_then(|r| r.limits).unwrap_or_default();
    assert_eq!(limits.get("amd.com/gpu").map(|q| q.0.as_str()), Some("2"));
}

#[test]
fn compatibility_table() {
    let p = profile();
    let cfg = RenderConfig::default();
    let cases = [
        ("vllm", "gptq", true),
        ("vllm", "awq", true),
        ("vllm", "fp8", true),
        ("vllm", "compressed-tensors", true),
        ("vllm", "gguf", false),
        ("vllm", "exl2", false),
        ("llamacpp", "gguf", true),
        ("ollama", "gguf", true),
        ("llamacpp", "gptq", false),
        ("ollama", "awq", false),
        ("exllamav2", "exl2", true),
        ("exllamav2", "gptq", false),
        ("vllm", "none", true),
    ];
    for (backend, q, ok) in cases {
        let m = model(
            "m",
            serde_json::json!({"backend": backend, "source": "pvc://c/p",
            "gpu": {"profile": "gfx1100"}, "config": {"quantization": q}}),
        );
        match render(&m, None, Some(&p), &cfg) {
            Ok(_) => assert!(ok, "{backend}/{q} should be rejected"),
            Err(e) => {
                assert!(!ok, "{backend}/{q}: {e}");
                assert_eq!(e.reason(), "BackendUnsupported");
                assert_eq!(e.condition_type(), "ConfigValid");
                assert!(e.to_string().contains(backend), "{e}");
            }
        }
    }
    // Format from the cache when the Model does not declare one.
    let m = model(
        "m",
        serde_json::json!({"backend": "llamacpp", "source": "modelcache://cache", "gpu": {"profile": "gfx1100"}}),
    );
    let c = cache(
        Some("Ready"),
        Some("pvc-a:cache/gptq-w4-g128"),
        Some("GPTQ"),
    );
    let e = render(&m, Some(&c), Some(&p), &cfg)
        .err()
        .unwrap_or_else(|| panic!("expected BackendUnsupported"));
    assert_eq!(e.reason(), "BackendUnsupported");
    // Declared vs cache mismatch.
    let m = model(
        "m",
        serde_json::json!({"backend": "vllm", "source": "modelcache://cache", "gpu": {"profile": "gfx1100"}, "config": {"quantization": "awq"}}),
    );
    let e = render(&m, Some(&c), Some(&p), &cfg)
        .err()
        .unwrap_or_else(|| panic!("expected mismatch"));
    assert_eq!(e.reason(), "QuantizationMismatch");
}

#[test]
fn cache_sources() {
    let p = profile();
    let cfg = RenderConfig::default();
    let m = model(
        "m",
        serde_json::json!({"backend": "vllm", "source": "modelcache://cache", "gpu": {"profile": "gfx1100"}}),
    );
    let e = render(&m, None, Some(&p), &cfg)
        .err()
        .unwrap_or_else(|| panic!("expected not found"));
    assert_eq!(
        (e.condition_type(), e.reason()),
        ("Cached", "CacheNotFound")
    );
    let e = render(
        &m,
        Some(&cache(Some("Quantizing"), None, Some("GPTQ"))),
        Some(&p),
        &cfg,
    )
    .err()
    .unwrap_or_else(|| panic!("expected not ready"));
    assert_eq!(
        (e.condition_type(), e.reason()),
        ("Cached", "CacheNotReady")
    );
    assert!(e.to_string().contains("Quantizing"), "{e}");
    let r = render(
        &m,
        Some(&cache(
            Some("Ready"),
            Some("pvc-a:cache/gptq-w4-g128"),
            Some("GPTQ"),
        )),
        Some(&p),
        &cfg,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.served_path.as_deref(), Some("pvc-a:cache/gptq-w4-g128"));
    assert_eq!(
        r.format,
        Some(flexinfer_api::modelcache::QuantFormat::Gptq),
        "format from the cache"
    );
    let c = container(&r.deployment);
    assert_eq!(arg_after(&c, "--quantization"), None, "vLLM detects it");
    // Requantizing after having served: keep serving the previous artifact.
    let mut served = m.clone();
    served.status = Some(flexinfer_api::ModelStatus {
        served_path: Some("pvc-a:cache/old".into()),
        ..Default::default()
    });
    let r = render(
        &served,
        Some(&cache(
            Some("Quantizing"),
            Some("pvc-a:cache/old"),
            Some("GPTQ"),
        )),
        Some(&p),
        &cfg,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.served_path.as_deref(), Some("pvc-a:cache/old"));
    assert!(matches!(r.cached, CachedState::ServingPrevious { .. }));
    let e = render(
        &m,
        Some(&cache(Some("Ready"), Some("nocolon"), None)),
        Some(&p),
        &cfg,
    )
    .err()
    .unwrap_or_else(|| panic!("expected bad path"));
    assert_eq!(e.reason(), "CachePathInvalid");
}

#[test]
fn bad_input() {
    let cfg = RenderConfig::default();
    let p = profile();
    let m = model(
        "m",
        serde_json::json!({"backend": "vllm", "source": "pvc://c//etc", "gpu": {"profile": "gfx1100"}}),
    );
    let e = render(&m, None, Some(&p), &cfg)
        .err()
        .unwrap_or_else(|| panic!("expected invalid source"));
    assert_eq!(
        (e.condition_type(), e.reason()),
        ("ConfigValid", "InvalidSource")
    );
    let m = model(
        "m",
        serde_json::json!({"backend": "vllm", "source": "pvc://c/p", "gpu": {"profile": "missing"}}),
    );
    let e = render(&m, None, None, &cfg)
        .err()
        .unwrap_or_else(|| panic!("expected profile not found"));
    assert_eq!(e.reason(), "GPUProfileNotFound");
    assert!(e.to_string().contains("missing"), "{e}");
    let m = model(
        "m",
        serde_json::json!({"backend": "vllm", "source": "pvc://c/p", "nodeSelector": {"flexinfer.ai/gpu.arch": "gfx942"}}),
    );
    let e = render(&m, None, None, &cfg)
        .err()
        .unwrap_or_else(|| panic!("expected profile not found"));
    assert!(e.to_string().contains("gfx942"), "{e}");
    let m = model(
        "m",
        serde_json::json!({"backend": "vllm", "source": "pvc://c/p"}),
    );
    let e = render(&m, None, None, &cfg)
        .err()
        .unwrap_or_else(|| panic!("expected profile not found"));
    assert_eq!(e.reason(), "GPUProfileNotFound");
    let m = model(
        "9bad",
        serde_json::json!({"backend": "vllm", "source": "pvc://c/p", "gpu": {"vendor": "amd"}}),
    );
    assert_eq!(
        render(&m, None, None, &cfg).err().map(|e| e.reason()),
        Some("InvalidName")
    );
    let m = model(
        "m",
        serde_json::json!({"backend": "exllamav2", "source": "HF://org/model", "gpu": {"vendor": "amd"}}),
    );
    assert_eq!(
        render(&m, None, None, &cfg).err().map(|e| e.reason()),
        Some("SourceUnsupported")
    );
}

/// Serving pods get the pipeline Jobs' hardening (non-root, no escalation, no capabilities,
/// seccomp RuntimeDefault), a writable `HOME` that a profile may still override, and the
/// configured GPU supplemental groups only when configured.
#[test]
fn serving_pods_are_hardened_like_jobs() {
    use crate::pod_security::NONROOT_ID;
    let m = model(
        "m",
        serde_json::json!({"backend": "vllm", "source": "org/model", "gpu": {"profile": "gfx1100"}}),
    );
    let p = profile();
    let pod = |cfg: &RenderConfig, p: &GPUProfile| {
        let r = render(&m, None, Some(p), cfg).unwrap_or_else(|e| panic!("{e}"));
        r.deployment
            .spec
            .and_then(|s| s.template.spec)
            .unwrap_or_else(|| panic!("no pod spec"))
    };
    let spec = pod(&RenderConfig::default(), &p);
    let sc = spec.security_context.clone().unwrap_or_default();
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.run_as_user, Some(NONROOT_ID));
    assert_eq!(sc.fs_group, Some(NONROOT_ID));
    assert_eq!(
        sc.seccomp_profile.map(|s| s.type_).as_deref(),
        Some("RuntimeDefault")
    );
    assert_eq!(sc.supplemental_groups, None, "no groups unless configured");
    let c = &spec.containers[0];
    let csc = c.security_context.clone().unwrap_or_default();
    assert_eq!(csc.allow_privilege_escalation, Some(false));
    assert_eq!(csc.privileged, Some(false));
    assert_eq!(
        csc.capabilities.and_then(|c| c.drop),
        Some(vec!["ALL".to_string()])
    );
    // HOME is a mounted scratch volume of the pod.
    assert_eq!(
        env(c, "HOME").as_deref(),
        Some(flexinfer_api::contract::serving::HOME)
    );
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| v.mount_path == flexinfer_api::contract::serving::HOME)
        .unwrap_or_else(|| panic!("HOME is not mounted"));
    assert!(spec
        .volumes
        .iter()
        .flatten()
        .any(|v| v.name == mount.name && v.empty_dir.is_some()));

    let cfg = RenderConfig {
        gpu_supplemental_groups: vec![44, 109],
        ..Default::default()
    };
    let spec = pod(&cfg, &p);
    assert_eq!(
        spec.security_context.and_then(|s| s.supplemental_groups),
        Some(vec![44, 109])
    );

    // A profile's HOME wins over the default.
    let mut p2 = p.clone();
    p2.spec.env.push(k8s_openapi::api::core::v1::EnvVar {
        name: "HOME".into(),
        value: Some("/root".into()),
        value_from: None,
    });
    let spec = pod(&RenderConfig::default(), &p2);
    assert_eq!(env(&spec.containers[0], "HOME").as_deref(), Some("/root"));
}

/// With the proxy configured (`FLEXINFER_PROXY_NAMESPACE` + `FLEXINFER_PROXY_POD_LABELS`), each Model gets a
/// NetworkPolicy owned by it that selects exactly its serving pods and admits only the proxy pods of the
/// proxy's namespace on the serving port; without them, none. Bad labels are a setting error naming the
/// variable.
#[test]
fn network_policy_admits_only_the_proxy() {
    let m = model(
        "llm",
        serde_json::json!({"backend": "vllm", "source": "pvc://c/p", "gpu": {"vendor": "nvidia"}}),
    );
    let none = render(&m, None, None, &RenderConfig::default()).unwrap_or_else(|e| panic!("{e}"));
    assert!(none.network_policy.is_none());
    let vars = std::collections::BTreeMap::from([
        (env::controller::PROXY_NAMESPACE, "flexinfer-system"),
        (
            env::controller::PROXY_POD_LABELS,
            "app.kubernetes.io/instance=flexinfer, app.kubernetes.io/component=proxy",
        ),
    ]);
    let settings = crate::settings::Settings::new(|k: &str| vars.get(k).map(|v| v.to_string()));
    let cfg = RenderConfig::from_settings(&settings).unwrap_or_else(|e| panic!("{e}"));
    let r = render(&m, None, None, &cfg).unwrap_or_else(|e| panic!("{e}"));
    let np = serde_json::to_value(r.network_policy.expect("a NetworkPolicy")).expect("json");
    let pods = serde_json::to_value(
        r.deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.labels.clone()),
    )
    .expect("json");
    assert_eq!(np["metadata"]["name"], "llm");
    assert_eq!(np["metadata"]["ownerReferences"][0]["kind"], "Model");
    assert_eq!(np["metadata"]["ownerReferences"][0]["controller"], true);
    let sel = np["spec"]["podSelector"]["matchLabels"]
        .as_object()
        .expect("pod selector");
    assert!(
        !sel.is_empty() && sel.iter().all(|(k, v)| pods[k] == *v),
        "the policy selects the serving pods: {sel:?} vs {pods}"
    );
    assert_eq!(np["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    assert_eq!(
        np["spec"]["ingress"],
        serde_json::json!([{
            "from": [{
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "flexinfer-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/instance": "flexinfer",
                                                "app.kubernetes.io/component": "proxy"}},
            }],
            "ports": [{"port": 8000, "protocol": "TCP"}],
        }])
    );
    for bad in ["component", "a=b,c", "a=b c", "=x"] {
        let vars = std::collections::BTreeMap::from([
            (env::controller::PROXY_NAMESPACE, "ns"),
            (env::controller::PROXY_POD_LABELS, bad),
        ]);
        let settings = crate::settings::Settings::new(|k: &str| vars.get(k).map(|v| v.to_string()));
        let e = RenderConfig::from_settings(&settings).expect_err(bad);
        assert!(e.to_string().contains("FLEXINFER_PROXY_POD_LABELS"), "{e}");
    }
}

/// `spec.backendKeySecretRef`: each backend that takes an API key gets it in the variable its
/// server reads, from the Secret by `secretKeyRef` (never as a value); the readiness probe stays
/// on `/health` (unauthenticated in both servers); a backend without key support is refused,
/// naming the field and the backend; without the field no key variable is rendered.
#[test]
fn backend_key_per_backend() {
    let p = profile();
    let cfg = RenderConfig::default();
    let key_ref = serde_json::json!({"name": "backend-key", "key": "token"});
    // (backend, source, quantization, the variable or None = refused)
    let cases = [
        (
            "vllm",
            "pvc://c/p",
            "none",
            Some(env::serving::VLLM_API_KEY),
        ),
        (
            "llamacpp",
            "pvc://c/m.gguf",
            "gguf",
            Some(env::serving::LLAMA_API_KEY),
        ),
        ("ollama", "pvc://c/m.gguf", "gguf", None),
        ("exllamav2", "pvc://c/exl2", "exl2", None),
    ];
    let key_vars = [env::serving::VLLM_API_KEY, env::serving::LLAMA_API_KEY];
    for (backend, source, q, want) in cases {
        let spec = |with_key: bool| {
            let mut s = serde_json::json!({"backend": backend, "source": source,
                "gpu": {"profile": "gfx1100"}, "config": {"quantization": q}});
            if with_key {
                s["backendKeySecretRef"] = key_ref.clone();
            }
            s
        };
        // Without the field: no key variable, whatever the backend.
        let c = container(
            &render(&model("m", spec(false)), None, Some(&p), &cfg)
                .unwrap_or_else(|e| panic!("{backend}: {e}"))
                .deployment,
        );
        for v in key_vars {
            assert!(
                !c.env.iter().flatten().any(|e| e.name == v),
                "{backend}: {v} without backendKeySecretRef"
            );
        }
        let got = render(&model("m", spec(true)), None, Some(&p), &cfg);
        match want {
            Some(var) => {
                let c = container(&got.unwrap_or_else(|e| panic!("{backend}: {e}")).deployment);
                let vars: Vec<_> = c
                    .env
                    .iter()
                    .flatten()
                    .filter(|e| key_vars.contains(&e.name.as_str()))
                    .collect();
                assert_eq!(vars.len(), 1, "{backend}: one key variable: {vars:?}");
                assert_eq!(vars[0].name, var, "{backend}");
                assert_eq!(vars[0].value, None, "{backend}: the key is never inlined");
                let sel = vars[0]
                    .value_from
                    .as_ref()
                    .and_then(|f| f.secret_key_ref.as_ref())
                    .unwrap_or_else(|| panic!("{backend}: no secretKeyRef"));
                assert_eq!(
                    (sel.name.as_str(), sel.key.as_str(), sel.optional),
                    ("backend-key", "token", Some(false)),
                    "{backend}"
                );
                let probe = c
                    .readiness_probe
                    .and_then(|p| p.http_get)
                    .and_then(|h| h.path);
                assert_eq!(probe.as_deref(), Some("/health"), "{backend}");
            }
            None => {
                let e = got
                    .err()
                    .unwrap_or_else(|| panic!("{backend}: a key should be refused"));
                assert_eq!(
                    (e.condition_type(), e.reason()),
                    ("ConfigValid", "BackendUnsupported"),
                    "{backend}"
                );
                let msg = e.to_string();
                assert!(
                    msg.contains("spec.backendKeySecretRef") && msg.contains(backend),
                    "{backend}: {msg}"
                );
                assert!(msg.contains("vllm, llamacpp"), "{msg}");
            }
        }
    }
}

fn profile_of(name: &str, spec: serde_json::Value) -> GPUProfile {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "ai.flexinfer/v1alpha2", "kind": "GPUProfile",
        "metadata": {"name": name, "namespace": "ns"}, "spec": spec
    }))
    .unwrap_or_else(|e| panic!("profile: {e}"))
}

fn source_of(backend: &str) -> (&'static str, &'static str) {
    match backend {
        "llamacpp" | "ollama" => ("pvc://c/m.gguf", "gguf"),
        "exllamav2" => ("pvc://c/exl2", "exl2"),
        _ => ("pvc://c/p", "gptq"),
    }
}

/// A Model on a gfx906-labelled node (its GPUProfile found by the `flexinfer.ai/gpu.arch` node
/// selector, naming no image) serves llama.cpp with FlexInfer's ROCm image.
#[test]
fn a_gfx906_node_gets_the_llamacpp_rocm_image() {
    let gfx906 = profile_of(
        "gfx906",
        serde_json::json!({"architecture": "gfx906", "vendor": "amd"}),
    );
    let m = model(
        "llama",
        serde_json::json!({"backend": "llamacpp", "source": "pvc://c/m.gguf",
            "nodeSelector": {"flexinfer.ai/gpu.arch": "gfx906"}}),
    );
    assert_eq!(profile_ref(&m), ProfileRef::Arch("gfx906".into()));
    let cfg = RenderConfig {
        llamacpp_image: Some("registry.lan/flexinfer/llamacpp:7".into()),
        ..Default::default()
    };
    let r = render(&m, None, Some(&gfx906), &cfg).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        container(&r.deployment).image.as_deref(),
        Some("registry.lan/flexinfer/llamacpp:7-rocm")
    );
    // Digests pin the flavor that is served (here rocm); another flavor's digest does not apply.
    let dig = |c: char| format!("sha256:{}", c.to_string().repeat(64));
    let pinned = RenderConfig {
        llamacpp_digests: [
            ("rocm".to_string(), dig('a')),
            ("cpu".to_string(), dig('b')),
        ]
        .into_iter()
        .collect(),
        ..cfg.clone()
    };
    let r = render(&m, None, Some(&gfx906), &pinned).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        container(&r.deployment).image,
        Some(format!(
            "registry.lan/flexinfer/llamacpp:7-rocm@{}",
            dig('a')
        ))
    );
    let rocm_only = RenderConfig {
        llamacpp_digests: [("cpu".to_string(), dig('b'))].into_iter().collect(),
        ..cfg.clone()
    };
    let r = render(&m, None, Some(&gfx906), &rocm_only).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        container(&r.deployment).image.as_deref(),
        Some("registry.lan/flexinfer/llamacpp:7-rocm")
    );
    // vLLM on the same node is refused, pointing at llama.cpp.
    let m = model(
        "v",
        serde_json::json!({"backend": "vllm", "source": "pvc://c/p",
            "nodeSelector": {"flexinfer.ai/gpu.arch": "gfx906"}}),
    );
    let e = render(&m, None, Some(&gfx906), &cfg)
        .err()
        .unwrap_or_else(|| panic!("vLLM on gfx906"));
    assert_eq!(
        (e.condition_type(), e.reason()),
        ("ConfigValid", "UnsupportedCombination")
    );
    assert!(
        e.to_string()
            .contains("registry.lan/flexinfer/llamacpp:7-rocm"),
        "{e}"
    );
}

/// Whatever the architecture and backend, an AMD Model never resolves to a CUDA image (it gets a
/// ROCm or Vulkan build, or a ConfigValid=False that says what to set); an NVIDIA Model gets CUDA
/// builds.
#[test]
fn amd_never_resolves_to_a_cuda_image_and_nvidia_gets_cuda() {
    use super::images::{built_for, BuiltFor};
    let cfg = RenderConfig::default();
    let ours = cfg.llamacpp_image();
    let amd_profiles = ["gfx1100", "gfx906", "gfx942", "gfx1201", "gfx1030"].map(|a| {
        Some(profile_of(
            a,
            serde_json::json!({"architecture": a, "vendor": "amd"}),
        ))
    });
    for p in amd_profiles.iter().chain([&None]) {
        for backend in ALL_BACKENDS {
            let b = backend.as_str();
            let (source, q) = source_of(b);
            let gpu = match p {
                Some(p) => serde_json::json!({"profile": p.metadata.name}),
                None => serde_json::json!({"vendor": "amd"}),
            };
            let m = model(
                "m",
                serde_json::json!({"backend": b, "source": source, "gpu": gpu,
                    "config": {"quantization": q}}),
            );
            match render(&m, None, p.as_ref(), &cfg) {
                Ok(r) => {
                    let img = container(&r.deployment).image.unwrap_or_default();
                    let built = built_for(&img, &ours);
                    assert!(
                        matches!(built, BuiltFor::Rocm | BuiltFor::Vulkan),
                        "{b} on {:?}: {img} is {built:?}",
                        p.as_ref().map(|p| &p.spec.architecture)
                    );
                }
                Err(e) => assert!(
                    matches!(e.reason(), "UnsupportedCombination" | "ImageNotConfigured"),
                    "{b}: {e}"
                ),
            }
        }
    }
    let sm89 = profile_of(
        "sm89",
        serde_json::json!({"architecture": "sm_89", "vendor": "nvidia"}),
    );
    for backend in ALL_BACKENDS {
        let b = backend.as_str();
        let (source, q) = source_of(b);
        let m = model(
            "m",
            serde_json::json!({"backend": b, "source": source, "gpu": {"profile": "sm89"},
                "config": {"quantization": q}}),
        );
        let r = render(&m, None, Some(&sm89), &cfg).unwrap_or_else(|e| panic!("{b}: {e}"));
        let img = container(&r.deployment).image.unwrap_or_default();
        assert_eq!(built_for(&img, &ours), BuiltFor::Cuda, "{b}: {img}");
    }
}

/// The Model's own image wins over the profile's and the defaults, and is refused (nothing
/// rendered) when it is recognisably another vendor's build.
#[test]
fn an_explicit_image_wins_but_is_refused_when_vendor_wrong() {
    let p = profile();
    let cfg = RenderConfig::default();
    let spec = |image: &str| {
        serde_json::json!({"backend": "vllm", "source": "pvc://c/p", "gpu": {"profile": "gfx1100"},
            "image": image})
    };
    let r = render(
        &model("m", spec("registry.lan/vllm:custom-1")),
        None,
        Some(&p),
        &cfg,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        container(&r.deployment).image.as_deref(),
        Some("registry.lan/vllm:custom-1")
    );
    let e = render(
        &model("m", spec("vllm/vllm-openai:v0.11.0")),
        None,
        Some(&p),
        &cfg,
    )
    .err()
    .unwrap_or_else(|| panic!("a CUDA image on AMD"));
    assert_eq!(
        (e.condition_type(), e.reason()),
        ("ConfigValid", "ImageVendorMismatch")
    );
    assert_eq!(e.phase(), flexinfer_api::model::ModelPhase::Failed);
    assert!(e.warns());
    let msg = e.to_string();
    for part in [
        "spec.image vllm/vllm-openai:v0.11.0",
        "CUDA",
        "GPUProfile gfx1100",
        "vllm-openai-rocm",
    ] {
        assert!(msg.contains(part), "{msg} lacks {part:?}");
    }
    // The controller-wide image is vendor-blind: a CUDA one is refused for AMD Models too.
    let mut cfg = RenderConfig::default();
    cfg.runtime_images
        .insert("ollama".into(), "docker.io/ollama/ollama:0.12.6".into());
    let m = model(
        "o",
        serde_json::json!({"backend": "ollama", "source": "pvc://c/m.gguf", "gpu": {"vendor": "amd"}}),
    );
    let e = render(&m, None, None, &cfg)
        .err()
        .unwrap_or_else(|| panic!("a CUDA ollama on AMD"));
    assert_eq!(e.reason(), "ImageVendorMismatch");
    assert!(
        e.to_string().contains("FLEXINFER_RUNTIME_IMAGE_OLLAMA"),
        "{e}"
    );
}

/// vLLM gets no `--quantization` from the artifact's format (it picks its kernel, Marlin on
/// NVIDIA); a method in `extraArgs` is passed as written, once.
#[test]
fn vllm_detects_the_quantization_unless_extra_args_name_it() {
    let p = profile_of(
        "sm89",
        serde_json::json!({"architecture": "sm_89", "vendor": "nvidia"}),
    );
    for q in ["gptq", "awq", "fp8", "compressed-tensors"] {
        let m = model(
            "m",
            serde_json::json!({"backend": "vllm", "source": "pvc://c/p", "gpu": {"profile": "sm89"},
                "config": {"quantization": q}}),
        );
        let c = container(
            &render(&m, None, Some(&p), &RenderConfig::default())
                .unwrap_or_else(|e| panic!("{e}"))
                .deployment,
        );
        assert!(
            !c.args
                .unwrap_or_default()
                .iter()
                .any(|a| a.contains("quantization")),
            "{q}"
        );
    }
    let m = model(
        "m",
        serde_json::json!({"backend": "vllm", "source": "pvc://c/p", "gpu": {"profile": "sm89"},
            "config": {"quantization": "gptq", "extraArgs": ["--quantization", "gptq_marlin"]}}),
    );
    let c = container(
        &render(&m, None, Some(&p), &RenderConfig::default())
            .unwrap_or_else(|e| panic!("{e}"))
            .deployment,
    );
    let args = c.args.unwrap_or_default();
    assert_eq!(args.iter().filter(|a| *a == "--quantization").count(), 1);
    assert_eq!(
        arg_after(&container_with(args), "--quantization").as_deref(),
        Some("gptq_marlin")
    );
}

fn container_with(args: Vec<String>) -> Container {
    Container {
        args: Some(args),
        ..Default::default()
    }
}

/// A GPUProfile's `runtimeClassName` goes into the serving pod, and its `supplementalGroups` are
/// added to the controller's (each once); without them the pod has neither.
#[test]
fn runtime_class_and_groups_per_profile() {
    let pod = |p: &GPUProfile, cfg: &RenderConfig| {
        let m = model(
            "m",
            serde_json::json!({"backend": "vllm", "source": "pvc://c/p",
                "gpu": {"profile": p.metadata.name}}),
        );
        render(&m, None, Some(p), cfg)
            .unwrap_or_else(|e| panic!("{e}"))
            .deployment
            .spec
            .and_then(|s| s.template.spec)
            .unwrap_or_else(|| panic!("no pod spec"))
    };
    let nv = profile_of(
        "sm89",
        serde_json::json!({"architecture": "sm_89", "vendor": "nvidia", "runtimeClassName": "nvidia"}),
    );
    let spec = pod(&nv, &RenderConfig::default());
    assert_eq!(spec.runtime_class_name.as_deref(), Some("nvidia"));
    assert_eq!(
        spec.security_context.and_then(|s| s.supplemental_groups),
        None
    );
    let amd = profile_of(
        "gfx1100",
        serde_json::json!({"architecture": "gfx1100", "vendor": "amd", "supplementalGroups": [110, 44, 992]}),
    );
    let cfg = RenderConfig {
        gpu_supplemental_groups: vec![44, 109],
        ..Default::default()
    };
    let spec = pod(&amd, &cfg);
    assert_eq!(spec.runtime_class_name, None);
    assert_eq!(
        spec.security_context.and_then(|s| s.supplemental_groups),
        Some(vec![44, 109, 110, 992])
    );
}

#[test]
fn llamacpp_flavor_digests_parse_and_refuse_what_is_not_one() {
    use super::render::parse_flavor_digests;
    let d = format!("sha256:{}", "0f".repeat(32));
    let ok =
        parse_flavor_digests(&format!(" cpu={d}, rocm = {d} ,")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.len(), 2);
    assert_eq!(ok.get("rocm"), Some(&d));
    for bad in [
        format!("cuda={d}"),
        format!("cpu={d},cpu={d}"),
        "cpu=sha256:abc".to_string(),
        format!("cpu={}", d.to_uppercase()),
        "cpu".to_string(),
    ] {
        assert!(parse_flavor_digests(&bad).is_err(), "{bad}");
    }
}

/// A GPUProfile created before its CRD refused them may not give serving pods a backend key (or any
/// variable FlexInfer sets itself): the Model is refused, naming the profile and the variables.
#[test]
fn a_profile_may_not_set_a_backend_key() {
    let cfg = RenderConfig::default();
    for var in [
        env::serving::VLLM_API_KEY,
        env::serving::LLAMA_API_KEY,
        env::OUT_DIR,
    ] {
        let p = profile_of(
            "gfx1100",
            serde_json::json!({"architecture": "gfx1100", "vendor": "amd",
                "env": [{"name": "HIP_VISIBLE_DEVICES", "value": "0"}, {"name": var, "value": "x"}]}),
        );
        let m = model(
            "m",
            serde_json::json!({"backend": "vllm", "source": "pvc://c/p", "gpu": {"profile": "gfx1100"}}),
        );
        let e = render(&m, None, Some(&p), &cfg)
            .err()
            .unwrap_or_else(|| panic!("{var} from the profile was accepted"));
        assert_eq!(e.reason(), "InvalidSpec", "{var}");
        let msg = e.to_string();
        assert!(
            msg.contains("GPUProfile gfx1100 sets") && msg.contains(var),
            "{msg}"
        );
        assert!(!msg.contains("HIP_VISIBLE_DEVICES"), "{msg}");
    }
}

/// The chart's backends PodMonitor (charts/flexinfer/templates/podmonitor.yaml) selects what render makes: the
/// serving pods' component label, the llama.cpp and vLLM backend names, the port name, the Model label; and
/// llama-server is started with `--metrics`, without which its /metrics answers 501.
#[test]
fn the_chart_pod_monitor_selects_the_serving_pods_and_llama_server_exports_metrics() {
    use flexinfer_api::contract::serving;
    let chart = include_str!("../../../../charts/flexinfer/templates/podmonitor.yaml");
    let p = profile();
    let cfg = RenderConfig::default();
    let mut names = Vec::new();
    for (backend, source) in [
        ("vllm", "pvc://c/dir"),
        ("llamacpp", "pvc://c/dir/m-q4.gguf"),
    ] {
        let m = model(
            "mon",
            serde_json::json!({"backend": backend, "source": source, "gpu": {"profile": "gfx1100"}}),
        );
        let d = render(&m, None, Some(&p), &cfg)
            .unwrap_or_else(|e| panic!("{e}"))
            .deployment;
        let pod_labels = d
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.labels.clone())
            .unwrap_or_default();
        let component = &pod_labels[labels::COMPONENT];
        assert!(
            chart.contains(&format!("{}: {component}", labels::COMPONENT)),
            "the PodMonitor does not select {}={component}",
            labels::COMPONENT
        );
        names.push(pod_labels[labels::NAME].clone());
        assert_eq!(pod_labels[labels::MODEL], "mon");
        let c = container(&d);
        let port = c.ports.clone().unwrap_or_default();
        assert_eq!(port[0].name.as_deref(), Some(serving::PORT_NAME));
        assert!(chart.contains(&format!("- port: {}", serving::PORT_NAME)));
        if backend == "llamacpp" {
            assert!(
                c.args
                    .clone()
                    .unwrap_or_default()
                    .iter()
                    .any(|a| a == "--metrics"),
                "llama-server without --metrics: {:?}",
                c.args
            );
        }
    }
    assert!(
        chart.contains(&format!("values: [{}]", names.join(", "))),
        "the PodMonitor's backend list is not {names:?}"
    );
    // Prometheus' Kubernetes SD spelling of the Model label.
    let meta: String = labels::MODEL
        .chars()
        .map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' })
        .collect();
    assert!(chart.contains(&format!("__meta_kubernetes_pod_label_{meta}]")));
}

/// A Model of a NodeLocal cache mounts the nodes' verified copy of the published digest (a read-only
/// host directory, no claim) and runs only on nodes labelled as holding it; before a digest is known
/// it waits, naming why.
#[test]
fn a_node_local_cache_is_served_from_the_nodes_copy() {
    use crate::modelcache::nodelocal::{label_key, label_value};
    let digest = format!("sha256:{}", "ab".repeat(32));
    let node_local = |path: &str, digest: Option<&str>| {
        let mut c = cache(Some("Ready"), Some(path), Some("GGUF"));
        c.spec.storage_strategy = flexinfer_api::modelcache::StorageStrategy::NodeLocal;
        if let Some(st) = c.status.as_mut() {
            st.node_local = Some(flexinfer_api::modelcache::NodeLocalStatus {
                digest: digest.map(String::from),
                ready_nodes: 1,
                selected_nodes: 2,
                ..Default::default()
            });
        }
        c
    };
    let cfg = RenderConfig {
        node_local_root: Some("/srv/copies".into()),
        ..RenderConfig::default()
    };
    let m = model(
        "m",
        serde_json::json!({"backend": "llamacpp", "source": "modelcache://cache", "gpu": {"profile": "gfx1100"}}),
    );
    let p = profile();
    let r = render(
        &m,
        Some(&node_local(
            "c-cache:cache/gguf-q4_k_m.g1/m-Q4_K_M.gguf",
            Some(&digest),
        )),
        Some(&p),
        &cfg,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let pod = r
        .deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.clone())
        .unwrap_or_else(|| panic!("pod"));
    let vol = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "model")
        .unwrap_or_else(|| panic!("model volume"));
    assert!(vol.persistent_volume_claim.is_none(), "{vol:?}");
    let host = vol.host_path.clone().unwrap_or_else(|| panic!("hostPath"));
    let dir = format!("/srv/copies/ns/cache/{}", "ab".repeat(32));
    assert_eq!(
        (host.path.as_str(), host.type_.as_deref()),
        (dir.as_str(), Some("Directory"))
    );
    let c = &pod.containers[0];
    let mnt = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| v.name == "model")
        .unwrap_or_else(|| panic!("mount"));
    assert_eq!(mnt.sub_path.as_deref(), Some("m-Q4_K_M.gguf"));
    assert_eq!(mnt.read_only, Some(true));
    assert_eq!(
        arg_after(c, "--model").as_deref(),
        Some("/models/m-Q4_K_M.gguf")
    );
    let sel = pod.node_selector.clone().unwrap_or_default();
    assert_eq!(
        sel.get(&label_key("ns", "cache")),
        label_value(&digest).as_ref(),
        "{sel:?}"
    );
    assert_eq!(r.served_path.as_deref(), Some(dir.as_str()));

    // A directory artifact is mounted whole.
    let r = render(
        &m,
        Some(&node_local("c-cache:cache/gptq-w4-g128.g1", Some(&digest))),
        Some(&p),
        &cfg,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let c = container(&r.deployment);
    let mnt = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| v.name == "model")
        .unwrap_or_else(|| panic!("mount"));
    assert_eq!(mnt.sub_path, None);
    assert_eq!(mnt.mount_path, "/models/model");

    // No published digest yet: not deployed, and the condition says why.
    let e = render(
        &m,
        Some(&node_local("c-cache:cache/x", None)),
        Some(&p),
        &cfg,
    )
    .err()
    .unwrap_or_else(|| panic!("expected waiting"));
    assert_eq!(
        (e.condition_type(), e.reason()),
        ("Cached", "CacheNotReady")
    );
    assert!(e.to_string().contains("NodeLocal"), "{e}");
}
