//! The serving container of each backend: image-independent command, args, env and probes.

use flexinfer_api::contract::{env, serving};
use flexinfer_api::model::{Backend, KvCacheDtype};
use flexinfer_api::Model;
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvVar, EnvVarSource, ExecAction, HTTPGetAction, Probe,
    SecretKeySelector, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_core::ResourceExt;

/// Where the weights come from inside the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Artifact {
    /// A PVC (read-only), `sub_path` inside it; with `host_dir`, a NodeLocal cache's verified copy on
    /// the node (a read-only host directory, `sub_path` inside it, empty for the whole copy).
    Volume {
        claim: String,
        sub_path: String,
        host_dir: Option<String>,
    },
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
fn mount(artifact: &Artifact) -> Option<(String, VolumeMount)> {
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
            let m = VolumeMount {
                name: "model".into(),
                mount_path: path.clone(),
                sub_path: (!sub_path.is_empty()).then(|| sub_path.clone()),
                read_only: Some(true),
                ..Default::default()
            };
            Some((path, m))
        }
        Artifact::Hub { .. } => None,
    }
}

/// Probe timings shared by every backend.
fn probe(http_get: Option<HTTPGetAction>, exec: Option<ExecAction>) -> Probe {
    Probe {
        http_get,
        exec,
        period_seconds: Some(10),
        timeout_seconds: Some(5),
        failure_threshold: Some(3),
        ..Default::default()
    }
}

fn http_probe(path: &str) -> Probe {
    let get = HTTPGetAction {
        path: Some(path.to_string()),
        port: IntOrString::String(serving::PORT_NAME.to_string()),
        ..Default::default()
    };
    probe(Some(get), None)
}

fn env_var(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.into()),
        ..Default::default()
    }
}

/// The environment variable from which a backend's server reads its API key; `None` for a backend
/// that takes none (`Backend::takes_api_key`).
fn api_key_env(backend: Backend) -> Option<&'static str> {
    match backend {
        Backend::Vllm => Some(env::serving::VLLM_API_KEY),
        Backend::Llamacpp => Some(env::serving::LLAMA_API_KEY),
        Backend::Ollama | Backend::Exllamav2 => None,
    }
}

/// The API key variable of the Model's backend, from `spec.backendKeySecretRef` by `secretKeyRef`
/// (the controller never reads the Secret; a missing one keeps the pod from starting). Both
/// servers leave `/health`, the readiness probe's path, unauthenticated.
fn api_key_var(model: &Model) -> Option<EnvVar> {
    let r = model.spec.backend_key_secret_ref.as_ref()?;
    let name = api_key_env(model.spec.backend)?;
    Some(EnvVar {
        name: name.to_string(),
        value: None,
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: r.name.clone(),
                key: r.key.clone(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
    })
}

/// What a backend runs: command, args, its own env and its readiness probe.
struct Launch {
    command: Vec<String>,
    args: Vec<String>,
    env: Vec<EnvVar>,
    probe: Probe,
}

/// Inputs every backend needs.
struct BackendInput<'a> {
    model: &'a Model,
    artifact: &'a Artifact,
    /// `--model` argument: the mount path, or the hub id.
    model_arg: String,
    name: String,
    port: String,
}

/// Build the serving container (without resources; env holds only the backend's variables).
pub fn container(model: &Model, artifact: &Artifact, image: &str) -> Container {
    let mounted = mount(artifact);
    let mut mounts = vec![
        VolumeMount {
            name: "dshm".into(),
            mount_path: "/dev/shm".into(),
            ..Default::default()
        },
        VolumeMount {
            name: serving::HOME_VOLUME.into(),
            mount_path: serving::HOME.into(),
            ..Default::default()
        },
    ];
    if let Some((_, m)) = &mounted {
        mounts.push(m.clone());
    }
    let model_arg = match (&mounted, artifact) {
        (Some((path, _)), _) => path.clone(),
        (None, Artifact::Hub { repo }) => repo.clone(),
        (None, Artifact::Volume { .. }) => String::new(),
    };
    let input = BackendInput {
        model,
        artifact,
        model_arg,
        name: model.name_any(),
        port: serving::PORT.to_string(),
    };
    let mut launch = match model.spec.backend {
        Backend::Vllm => vllm(&input),
        Backend::Llamacpp => llamacpp(&input),
        Backend::Ollama => ollama(&input),
        Backend::Exllamav2 => exllamav2(&input),
    };
    launch
        .args
        .extend(model.spec.config.extra_args.iter().cloned());
    launch.env.extend(api_key_var(model));
    Container {
        name: serving::CONTAINER.to_string(),
        image: Some(image.to_string()),
        command: Some(launch.command),
        args: Some(launch.args),
        env: Some(launch.env),
        ports: Some(vec![ContainerPort {
            name: Some(serving::PORT_NAME.to_string()),
            container_port: serving::PORT,
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        readiness_probe: Some(launch.probe),
        volume_mounts: Some(mounts),
        ..Default::default()
    }
}

fn vllm(i: &BackendInput) -> Launch {
    let spec = &i.model.spec;
    let cfg = &spec.config;
    let mut a = vec![
        "--model".to_string(),
        i.model_arg.clone(),
        "--served-model-name".into(),
        i.name.clone(),
        "--host".into(),
        "0.0.0.0".into(),
        "--port".into(),
        i.port.clone(),
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
    // No `--quantization`: vLLM reads the method from the checkpoint's quantization_config and
    // picks its fastest kernel for the GPU (Marlin on NVIDIA); naming the format (`gptq`) would
    // force the slow generic kernel. `extraArgs` may still name a method.
    if spec.gpu.count > 1 {
        a.extend(["--tensor-parallel-size".into(), spec.gpu.count.to_string()]);
    }
    let mut env = Vec::new();
    if let Some(b) = cfg.attention_backend.as_ref().filter(|b| !b.is_empty()) {
        env.push(env_var(env::serving::VLLM_ATTENTION_BACKEND, b.clone()));
    }
    Launch {
        command: vec![
            "python3".into(),
            "-m".into(),
            "vllm.entrypoints.openai.api_server".into(),
        ],
        args: a,
        env,
        probe: http_probe("/health"),
    }
}

fn llamacpp(i: &BackendInput) -> Launch {
    let cfg = &i.model.spec.config;
    let model_arg = &i.model_arg;
    let mut a = vec![
        "--host".to_string(),
        "0.0.0.0".into(),
        "--port".into(),
        i.port.clone(),
        "--alias".into(),
        i.name.clone(),
        "--n-gpu-layers".into(),
        "999".into(),
        // Prometheus metrics on /metrics of the serving port (the chart's backends PodMonitor scrapes them).
        "--metrics".into(),
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
    let command = match i.artifact {
        Artifact::Hub { repo } => {
            a.extend(["--hf-repo".into(), repo.clone()]);
            vec!["/app/llama-server".to_string()]
        }
        Artifact::Volume { .. } if model_arg.ends_with(".gguf") => {
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
    Launch {
        command,
        args: a,
        env: Vec::new(),
        probe: http_probe("/health"),
    }
}

fn ollama(i: &BackendInput) -> Launch {
    let cfg = &i.model.spec.config;
    let (name, model_arg) = (&i.name, &i.model_arg);
    let mut env = vec![env_var("OLLAMA_HOST", format!("0.0.0.0:{}", i.port))];
    if let Some(v) = cfg.max_model_len {
        env.push(env_var("OLLAMA_CONTEXT_LENGTH", v.to_string()));
    }
    if let Some(t) = cfg.kv_cache_dtype.and_then(ggml_kv_type) {
        env.push(env_var("OLLAMA_KV_CACHE_TYPE", t));
        env.push(env_var("OLLAMA_FLASH_ATTENTION", "1"));
    }
    let load = match i.artifact {
        Artifact::Hub { repo } => {
            format!("ollama pull hf.co/{repo} && ollama cp hf.co/{repo} {name}")
        }
        Artifact::Volume { .. } => {
            let from = if model_arg.ends_with(".gguf") {
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
    let show = ExecAction {
        command: Some(vec!["ollama".into(), "show".into(), name.clone()]),
    };
    Launch {
        command: vec!["/bin/sh".into(), "-c".into(), script],
        args: Vec::new(),
        env,
        probe: probe(None, Some(show)),
    }
}

/// TabbyAPI, the OpenAI-compatible exllamav2 server.
fn exllamav2(i: &BackendInput) -> Launch {
    let spec = &i.model.spec;
    let cfg = &spec.config;
    let (dir, model_name) = match i.model_arg.rsplit_once('/') {
        Some((d, n)) => (d.to_string(), n.to_string()),
        None => (serving::MODEL_MOUNT.to_string(), i.model_arg.clone()),
    };
    let mut a = vec![
        "--host".to_string(),
        "0.0.0.0".into(),
        "--port".into(),
        i.port.clone(),
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
    let mode = cfg.kv_cache_dtype.and_then(|d| match d {
        KvCacheDtype::Fp8 | KvCacheDtype::Fp8E4m3 | KvCacheDtype::Fp8E5m2 => Some("Q8"),
        KvCacheDtype::Float16 | KvCacheDtype::Bfloat16 => Some("FP16"),
        KvCacheDtype::Auto => None,
    });
    if let Some(m) = mode {
        a.extend(["--cache-mode".into(), m.into()]);
    }
    if spec.gpu.count > 1 {
        a.extend(["--gpu-split-auto".into(), "true".into()]);
    }
    Launch {
        command: vec!["python3".into(), "main.py".into()],
        args: a,
        env: Vec::new(),
        probe: http_probe("/health"),
    }
}
