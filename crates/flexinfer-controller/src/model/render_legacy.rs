//! TEMPORARY: the `json!`-built renderer as it was before the typed rewrite, kept only to prove
//! that the typed objects serialize to the same JSON (removed in the next commit).
#![allow(clippy::too_many_lines)]

use std::collections::BTreeMap;

use flexinfer_api::contract::labels;
use flexinfer_api::contract::{annotations, env, serving};
use flexinfer_api::formats;
use flexinfer_api::model::{Backend, KvCacheDtype};
use flexinfer_api::modelcache::{CachePhase, QuantFormat};
use flexinfer_api::{GPUProfile, Model, ModelCache};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::{Resource, ResourceExt};
use serde_json::{json, Value};

use super::backends::{kv_dtype_str, Artifact};
use super::render::*;
use super::source::{parse_cache_path, parse_source, Source};

fn model_format(q: flexinfer_api::model::ModelQuantization) -> Option<QuantFormat> {
    super::render::model_format_for_legacy(q)
}
fn check_compat(format: QuantFormat, backend: Backend) -> Result<(), ConfigProblem> {
    super::render::check_compat_for_legacy(format, backend)
}
fn is_dns1035(s: &str) -> bool {
    super::render::is_dns1035_for_legacy(s)
}

/// Render a Model's Deployment and Service.
pub fn render_legacy(
    model: &Model,
    cache: Option<&ModelCache>,
    profile: Option<&GPUProfile>,
    config: &RenderConfig,
) -> Result<Rendered, ConfigProblem> {
    let spec = &model.spec;
    let name = model.name_any();
    if !is_dns1035(&name) {
        return Err(ConfigProblem::InvalidName(name));
    }
    let source = parse_source(&spec.source).map_err(|e| ConfigProblem::InvalidSource(e.0))?;

    // Format and backend compatibility, from the Model first, then the referenced cache.
    let declared = spec.config.quantization.and_then(model_format);
    if let Some(f) = declared {
        check_compat(f, spec.backend)?;
    }
    let cache = match &source {
        Source::Cache { name } => match cache {
            Some(c) if c.name_any() == *name => Some(c),
            _ => return Err(ConfigProblem::CacheNotFound(name.clone())),
        },
        _ => None,
    };
    let cache_format = cache.and_then(|c| c.spec.quantization.as_ref().map(|q| q.format));
    if let (Some(m), Some(c), Some(cache)) = (declared, cache_format, cache) {
        if m != c {
            return Err(ConfigProblem::QuantizationMismatch {
                model: formats::info(m).model_name,
                cache: formats::info(c).name,
                cache_name: cache.name_any(),
            });
        }
    }
    let format = declared.or(cache_format);
    if let Some(f) = format {
        check_compat(f, spec.backend)?;
    }

    // GPU resource name, node selector and env from the GPUProfile.
    let (resource_name, profile_selector, profile_env, profile_image, memory) =
        match (profile_ref(model), profile) {
            (ProfileRef::Named(_) | ProfileRef::Arch(_) | ProfileRef::Any, Some(p)) => (
                p.spec.effective_resource_name(),
                p.spec.effective_node_selector(),
                p.spec.env.clone(),
                p.spec
                    .runtime
                    .as_ref()
                    .and_then(|r| r.images.get(spec.backend.as_str()).cloned()),
                p.spec.container_memory_gb.map(|gb| {
                    (
                        i64::from(gb) * 1024,
                        i64::from(gb) * 1024 + p.spec.gpu_driver_memory_mb.unwrap_or(0),
                    )
                }),
            ),
            (ProfileRef::Named(n), None) => {
                return Err(ConfigProblem::GpuProfileNotFound(format!(
                    "GPUProfile {n} (spec.gpu.profile) not found"
                )))
            }
            (ProfileRef::Arch(a), None) => {
                return Err(ConfigProblem::GpuProfileNotFound(format!(
                    "no GPUProfile with spec.architecture {a} (from nodeSelector {})",
                    labels::GPU_ARCH
                )))
            }
            (ProfileRef::Any, None) => {
                return Err(ConfigProblem::GpuProfileNotFound(format!(
                "no GPUProfile to use: set spec.gpu.profile, a {} nodeSelector or spec.gpu.vendor \
                     (with gpu.vendor auto the namespace must hold exactly one GPUProfile)",
                labels::GPU_ARCH
            )))
            }
            (ProfileRef::None(vendor), _) => (
                vendor.default_resource_name().to_string(),
                BTreeMap::new(),
                Vec::new(),
                None,
                None,
            ),
        };

    // The artifact.
    let (artifact, served_path, cached) = match &source {
        Source::Pvc { claim, path } => (
            Artifact::Volume {
                claim: claim.clone(),
                sub_path: path.clone(),
            },
            Some(format!("{claim}:{path}")),
            CachedState::Pvc,
        ),
        Source::Hub { repo } => {
            if spec.backend == Backend::Exllamav2 {
                return Err(ConfigProblem::SourceUnsupported(format!(
                    "backend exllamav2 cannot download {repo}; use a pvc:// or modelcache:// source"
                )));
            }
            (
                Artifact::Hub { repo: repo.clone() },
                None,
                CachedState::NotApplicable,
            )
        }
        Source::Cache { name } => {
            let cache = cache.ok_or_else(|| ConfigProblem::CacheNotFound(name.clone()))?;
            let status = cache.status.as_ref();
            let phase = status.and_then(|s| s.phase);
            let ready = phase == Some(CachePhase::Ready);
            let cache_path = status
                .and_then(|s| s.path.clone())
                .filter(|p| !p.is_empty());
            let previous = model.status.as_ref().and_then(|s| s.served_path.clone());
            let phase_s = phase.map(|p| p.as_str()).unwrap_or("Pending").to_string();
            let (path, state) = match (ready, cache_path, previous) {
                (true, Some(p), _) => (p, CachedState::CacheReady { name: name.clone() }),
                (true, None, _) => {
                    return Err(ConfigProblem::CachePathInvalid(format!(
                        "ModelCache {name} is Ready but has no status.path"
                    )))
                }
                (false, _, Some(prev)) => (
                    prev,
                    CachedState::ServingPrevious {
                        name: name.clone(),
                        phase: phase_s,
                    },
                ),
                (false, _, None) => {
                    return Err(ConfigProblem::CacheNotReady {
                        name: name.clone(),
                        phase: phase_s,
                    })
                }
            };
            let (claim, sub_path) =
                parse_cache_path(&path).map_err(|e| ConfigProblem::CachePathInvalid(e.0))?;
            (Artifact::Volume { claim, sub_path }, Some(path), state)
        }
    };

    let image = spec
        .image
        .clone()
        .filter(|i| !i.is_empty())
        .or(profile_image)
        .or_else(|| config.runtime_images.get(spec.backend.as_str()).cloned())
        .unwrap_or_else(|| default_image(spec.backend).to_string());

    let container = container_legacy(model, &artifact, format, &image)?;
    let mut container = container;

    // Env: profile env, then the backend's (later names win, no duplicates).
    let mut env: Vec<Value> = Vec::new();
    let mut push_env = |v: Value| {
        let key = v.get("name").cloned();
        env.retain(|e| e.get("name") != key.as_ref());
        env.push(v);
    };
    for e in &profile_env {
        push_env(serde_json::to_value(e).map_err(|e| ConfigProblem::Invalid(e.to_string()))?);
    }
    if let Some(Value::Array(items)) = container.get("env").cloned() {
        for v in items {
            push_env(v);
        }
    }
    container["env"] = Value::Array(env);

    // Resources: the Model's, plus the GPUs, plus the profile's memory default.
    let mut resources = match &spec.resources {
        Some(r) => serde_json::to_value(r).map_err(|e| ConfigProblem::Invalid(e.to_string()))?,
        None => json!({}),
    };
    for key in ["limits", "requests"] {
        if !resources.get(key).is_some_and(Value::is_object) {
            resources[key] = json!({});
        }
        resources[key][&resource_name] = json!(spec.gpu.count.to_string());
    }
    if let Some((request_mi, limit_mi)) = memory {
        if resources["limits"].get("memory").is_none()
            && resources["requests"].get("memory").is_none()
        {
            resources["requests"]["memory"] = json!(format!("{request_mi}Mi"));
            resources["limits"]["memory"] = json!(format!("{limit_mi}Mi"));
        }
    }
    container["resources"] = resources;

    let mut node_selector = profile_selector;
    for (k, v) in spec.node_selector.iter().flatten() {
        node_selector.insert(k.clone(), v.clone());
    }

    let mut tolerations: Vec<Value> = Vec::new();
    for t in spec.tolerations.iter().flatten() {
        tolerations
            .push(serde_json::to_value(t).map_err(|e| ConfigProblem::Invalid(e.to_string()))?);
    }
    let gpu_toleration = json!({
        "key": flexinfer_api::contract::controller::GPU_TOLERATION_KEY,
        "operator": "Equal",
        "value": flexinfer_api::contract::controller::GPU_TOLERATION_VALUE,
        "effect": flexinfer_api::contract::controller::GPU_TOLERATION_EFFECT,
    });
    if !tolerations.contains(&gpu_toleration) {
        tolerations.push(gpu_toleration);
    }

    let mut pod_annotations = BTreeMap::from([(
        annotations::GPU_PRIORITY.to_string(),
        spec.gpu.priority.to_string(),
    )]);
    if let Some(p) = &served_path {
        pod_annotations.insert(annotations::SERVED_PATH.to_string(), p.clone());
    }
    if let Some(g) = &spec.gpu.shared {
        pod_annotations.insert(annotations::GPU_SHARED_GROUP.to_string(), g.clone());
    }

    let mut volumes = vec![json!({"name": "dshm", "emptyDir": {"medium": "Memory"}})];
    if let Artifact::Volume { claim, .. } = &artifact {
        volumes.push(json!({
            "name": "model",
            "persistentVolumeClaim": {"claimName": claim, "readOnly": true}
        }));
    }

    let owner = model
        .controller_owner_ref(&())
        .into_iter()
        .collect::<Vec<_>>();
    let ns = model.namespace();
    let child_labels = child_labels(model);
    let object_labels = object_labels(model);
    let selector = selector(model);
    let deployment = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": object_labels,
            "ownerReferences": owner,
        },
        "spec": {
            "selector": {"matchLabels": selector},
            // GPUs are exclusive: a surge pod could never be scheduled next to the old one.
            "strategy": {"type": "Recreate"},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": child_labels, "annotations": pod_annotations},
                "spec": {
                    "containers": [container],
                    "volumes": volumes,
                    "nodeSelector": node_selector,
                    "tolerations": tolerations,
                    "enableServiceLinks": false,
                    "automountServiceAccountToken": false,
                    "terminationGracePeriodSeconds": 30,
                }
            }
        }
    });
    let service = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": object_labels,
            "ownerReferences": owner,
        },
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{
                "name": serving::PORT_NAME,
                "port": serving::PORT,
                "targetPort": serving::PORT_NAME,
                "protocol": "TCP",
            }]
        }
    });
    let deployment: Deployment =
        serde_json::from_value(deployment).map_err(|e| ConfigProblem::Invalid(e.to_string()))?;
    let service: Service =
        serde_json::from_value(service).map_err(|e| ConfigProblem::Invalid(e.to_string()))?;
    Ok(Rendered {
        deployment,
        service,
        served_path,
        cached,
        format,
    })
}

/// llama.cpp / ollama KV cache type (`f16`, `bf16`, `q8_0`); FP8 has no GGUF equivalent, so the
/// nearest 8-bit type is used.
fn ggml_kv_type(d: KvCacheDtype) -> Option<&'static str> {
    match d {
        KvCacheDtype::Auto => None,
        KvCacheDtype::Float16 => Some("f16"),
        KvCacheDtype::Bfloat16 => Some("bf16"),
        KvCacheDtype::Fp8 | KvCacheDtype::Fp8E4m3 | KvCacheDtype::Fp8E5m2 => Some("q8_0"),
    }
}

/// Mount path of the artifact and the volume mount itself.
fn mount(artifact: &Artifact) -> Option<(String, Value)> {
    match artifact {
        Artifact::Volume { sub_path, .. } => {
            let file = sub_path
                .rsplit('/')
                .next()
                .filter(|f| f.ends_with(".gguf"))
                .map(str::to_string);
            let path = match file {
                Some(f) => format!("{}/{f}", serving::MODEL_MOUNT),
                None => format!("{}/model", serving::MODEL_MOUNT),
            };
            let m =
                json!({"name": "model", "mountPath": path, "subPath": sub_path, "readOnly": true});
            Some((path, m))
        }
        Artifact::Hub { .. } => None,
    }
}

fn http_probe(path: &str) -> Value {
    json!({
        "httpGet": {"path": path, "port": serving::PORT_NAME},
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    })
}

/// Build the serving container (without resources; env holds only the backend's variables).
pub fn container_legacy(
    model: &Model,
    artifact: &Artifact,
    format: Option<QuantFormat>,
    image: &str,
) -> Result<Value, ConfigProblem> {
    let spec = &model.spec;
    let cfg = &spec.config;
    let name = model.name_any();
    let port = serving::PORT.to_string();
    let mounted = mount(artifact);
    let mut mounts = vec![json!({"name": "dshm", "mountPath": "/dev/shm"})];
    if let Some((_, m)) = &mounted {
        mounts.push(m.clone());
    }
    let model_arg = match (&mounted, artifact) {
        (Some((path, _)), _) => path.clone(),
        (None, Artifact::Hub { repo }) => repo.clone(),
        (None, Artifact::Volume { .. }) => String::new(),
    };
    let is_gguf_file = model_arg.ends_with(".gguf");

    let mut env: Vec<Value> = Vec::new();
    let (command, mut args, probe): (Vec<String>, Vec<String>, Value) = match spec.backend {
        Backend::Vllm => {
            let mut a = vec![
                "--model".to_string(),
                model_arg.clone(),
                "--served-model-name".into(),
                name.clone(),
                "--host".into(),
                "0.0.0.0".into(),
                "--port".into(),
                port.clone(),
            ];
            if let Some(v) = cfg.max_model_len {
                a.extend(["--max-model-len".into(), v.to_string()]);
            }
            if let Some(v) = cfg.kv_cache_dtype {
                a.extend(["--kv-cache-dtype".into(), kv_dtype_str(v).into()]);
            }
            if let Some(v) = cfg.gpu_memory_utilization {
                a.extend(["--gpu-memory-utilization".into(), v.to_string()]);
            }
            if let Some(v) = cfg.max_num_batched_tokens {
                a.extend(["--max-num-batched-tokens".into(), v.to_string()]);
            }
            if let Some(f) = format {
                a.extend(["--quantization".into(), formats::info(f).model_name.into()]);
            }
            if spec.gpu.count > 1 {
                a.extend(["--tensor-parallel-size".into(), spec.gpu.count.to_string()]);
            }
            if let Some(b) = cfg.attention_backend.as_ref().filter(|b| !b.is_empty()) {
                env.push(json!({"name": env::serving::VLLM_ATTENTION_BACKEND, "value": b}));
            }
            (
                vec![
                    "python3".into(),
                    "-m".into(),
                    "vllm.entrypoints.openai.api_server".into(),
                ],
                a,
                http_probe("/health"),
            )
        }
        Backend::Llamacpp => {
            let mut a = vec![
                "--host".to_string(),
                "0.0.0.0".into(),
                "--port".into(),
                port.clone(),
                "--alias".into(),
                name.clone(),
                "--n-gpu-layers".into(),
                "999".into(),
            ];
            if let Some(v) = cfg.max_model_len {
                a.extend(["--ctx-size".into(), v.to_string()]);
            }
            if let Some(t) = cfg.kv_cache_dtype.and_then(ggml_kv_type) {
                a.extend([
                    "--cache-type-k".into(),
                    t.into(),
                    "--cache-type-v".into(),
                    t.into(),
                ]);
            }
            if let Some(v) = cfg.max_num_batched_tokens {
                a.extend(["--batch-size".into(), v.to_string()]);
            }
            let command = match artifact {
                Artifact::Hub { repo } => {
                    a.extend(["--hf-repo".into(), repo.clone()]);
                    vec!["/app/llama-server".to_string()]
                }
                Artifact::Volume { .. } if is_gguf_file => {
                    a.extend(["--model".into(), model_arg.clone()]);
                    vec!["/app/llama-server".to_string()]
                }
                // A directory: serve its first .gguf file (split GGUFs start with -00001-of-).
                Artifact::Volume { .. } => vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    format!(
                        "exec /app/llama-server --model \"$(find {model_arg} -name '*.gguf' | sort | head -n 1)\" \"$@\""
                    ),
                    "llama-server".into(),
                ],
            };
            (command, a, http_probe("/health"))
        }
        Backend::Ollama => {
            env.push(json!({"name": "OLLAMA_HOST", "value": format!("0.0.0.0:{port}")}));
            if let Some(v) = cfg.max_model_len {
                env.push(json!({"name": "OLLAMA_CONTEXT_LENGTH", "value": v.to_string()}));
            }
            if let Some(t) = cfg.kv_cache_dtype.and_then(ggml_kv_type) {
                env.push(json!({"name": "OLLAMA_KV_CACHE_TYPE", "value": t}));
                env.push(json!({"name": "OLLAMA_FLASH_ATTENTION", "value": "1"}));
            }
            let load = match artifact {
                Artifact::Hub { repo } => {
                    format!("ollama pull hf.co/{repo} && ollama cp hf.co/{repo} {name}")
                }
                Artifact::Volume { .. } => {
                    let from = if is_gguf_file {
                        format!("\"{model_arg}\"")
                    } else {
                        format!("\"$(find {model_arg} -name '*.gguf' | sort | head -n 1)\"")
                    };
                    format!("printf 'FROM %s\\n' {from} > /tmp/Modelfile && ollama create {name} -f /tmp/Modelfile")
                }
            };
            let script = format!(
                "ollama serve & pid=$!; until ollama list >/dev/null 2>&1; do sleep 1; done; {load} || exit 1; wait $pid"
            );
            (
                vec!["/bin/sh".into(), "-c".into(), script],
                Vec::new(),
                json!({
                    "exec": {"command": ["ollama", "show", name.clone()]},
                    "periodSeconds": 10,
                    "timeoutSeconds": 5,
                    "failureThreshold": 3,
                }),
            )
        }
        Backend::Exllamav2 => {
            // TabbyAPI, the OpenAI-compatible exllamav2 server.
            let (dir, model_name) = match model_arg.rsplit_once('/') {
                Some((d, n)) => (d.to_string(), n.to_string()),
                None => (serving::MODEL_MOUNT.to_string(), model_arg.clone()),
            };
            let mut a = vec![
                "--host".to_string(),
                "0.0.0.0".into(),
                "--port".into(),
                port.clone(),
                "--disable-auth".into(),
                "true".into(),
                "--model-dir".into(),
                dir,
                "--model-name".into(),
                model_name,
            ];
            if let Some(v) = cfg.max_model_len {
                a.extend(["--max-seq-len".into(), v.to_string()]);
            }
            if let Some(d) = cfg.kv_cache_dtype {
                let mode = match d {
                    KvCacheDtype::Fp8 | KvCacheDtype::Fp8E4m3 | KvCacheDtype::Fp8E5m2 => Some("Q8"),
                    KvCacheDtype::Float16 | KvCacheDtype::Bfloat16 => Some("FP16"),
                    KvCacheDtype::Auto => None,
                };
                if let Some(m) = mode {
                    a.extend(["--cache-mode".into(), m.into()]);
                }
            }
            if spec.gpu.count > 1 {
                a.extend(["--gpu-split-auto".into(), "true".into()]);
            }
            (
                vec!["python3".into(), "main.py".into()],
                a,
                http_probe("/health"),
            )
        }
    };
    args.extend(cfg.extra_args.iter().cloned());
    Ok(json!({
        "name": serving::CONTAINER,
        "image": image,
        "command": command,
        "args": args,
        "env": env,
        "ports": [{"name": serving::PORT_NAME, "containerPort": serving::PORT, "protocol": "TCP"}],
        "readinessProbe": probe,
        "volumeMounts": mounts,
    }))
}
