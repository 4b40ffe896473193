//! The serving container of each backend: image-independent command, args, env and probes.

use flexinfer_api::contract::{env, serving};
use flexinfer_api::formats;
use flexinfer_api::model::{Backend, KvCacheDtype};
use flexinfer_api::modelcache::QuantFormat;
use flexinfer_api::Model;
use kube::ResourceExt;
use serde_json::{json, Value};

use super::render::ConfigProblem;

/// Where the weights come from inside the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Artifact {
    /// A PVC (read-only), `sub_path` inside it.
    Volume { claim: String, sub_path: String },
    /// A hub id the backend downloads itself.
    Hub { repo: String },
}

/// The `--kv-cache-dtype` spelling of a dtype (as written in the manifest).
pub fn kv_dtype_str(d: KvCacheDtype) -> &'static str {
    match d {
        KvCacheDtype::Auto => "auto",
        KvCacheDtype::Fp8 => "fp8",
        KvCacheDtype::Fp8E4m3 => "fp8_e4m3",
        KvCacheDtype::Fp8E5m2 => "fp8_e5m2",
        KvCacheDtype::Float16 => "float16",
        KvCacheDtype::Bfloat16 => "bfloat16",
    }
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
pub fn container(
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
