//! Environment variable names: what the worker reads (top level), what the controller reads
//! ([`controller`]), the transfer tuning knobs ([`transfer`]) and serving-container env ([`serving`]).

pub const SCRIPT_VERSION: &str = "FLEXINFER_SCRIPT_VERSION";
pub const MODEL_DIR: &str = "MODEL_DIR";
pub const OUT_DIR: &str = "OUT_DIR";
pub const BITS: &str = "BITS";
pub const GROUP_SIZE: &str = "GROUP_SIZE";
pub const SYM: &str = "SYM";
pub const DESC_ACT: &str = "DESC_ACT";
/// Group-aware column order inside the groups (`true`/`false`; the worker's default is its engine default).
pub const ACT_GROUP_AWARE: &str = "ACT_GROUP_AWARE";
/// Clipping search of the group scales: `auto` (the engine's default, off), `on`/`true` or `off`/`false`.
pub const CLIP_SEARCH: &str = "CLIP_SEARCH";
/// Scale refinement after the GPTQ sweep: `auto` (the engine's default: on at 2 and 3 bits), `on`, `off`, or
/// a number of rounds.
pub const REFINE_SCALES: &str = "REFINE_SCALES";
pub const DYNAMIC_EXCLUSION: &str = "DYNAMIC_EXCLUSION";
pub const MAX_SEQ_LEN: &str = "MAX_SEQ_LEN";
pub const MAX_SAMPLES: &str = "MAX_SAMPLES";
pub const DATASET: &str = "DATASET";
pub const N_PARALLEL_CALIB_SAMPLES: &str = "N_PARALLEL_CALIB_SAMPLES";
pub const MAX_MEMORY_GB: &str = "MAX_MEMORY_GB";
pub const GPU_VRAM_MB: &str = "GPU_VRAM_MB";
pub const GPU_MEMORY_FRACTION: &str = "GPU_MEMORY_FRACTION";
/// What the quantize phase writes: `GPTQ` (the default), `GGUF` (one llama.cpp file, see `GGUF_TYPE`),
/// `FP8` (E4M3 weights in compressed-tensors' `float-quantized` layout, see `FP8_SCALE`) or
/// `COMPRESSED_TENSORS` (the GPTQ solve written in compressed-tensors' `pack-quantized` layout; the GPTQ
/// settings apply, `BITS` 4 or 8) or `AWQ` (4-bit groups in AutoAWQ's GEMM layout; `BITS` 4, `GROUP_SIZE`
/// 32/64/128, the calibration settings).
pub const FORMAT: &str = "FORMAT";
/// The `FORMAT` values.
pub const FORMAT_GPTQ: &str = "GPTQ";
pub const FORMAT_GGUF: &str = "GGUF";
pub const FORMAT_FP8: &str = "FP8";
pub const FORMAT_COMPRESSED_TENSORS: &str = "COMPRESSED_TENSORS";
pub const FORMAT_AWQ: &str = "AWQ";
/// Group sizes the AWQ engine writes (the GEMM kernels' sizes); the controller refuses others before any Job.
pub const AWQ_GROUP_SIZES: [usize; 3] = [32, 64, 128];
/// AWQ's quality gate: the largest mean ratio of the artifact's output error to plain rounding's on the
/// calibration tokens (default 1: no worse than rounding); above it the Job fails with the gate's exit code.
pub const AWQ_MAX_OUTPUT_ERROR_RATIO: &str = "AWQ_MAX_OUTPUT_ERROR_RATIO";
/// Where the scales of a `FORMAT=FP8` run live: `channel` (one per output row, the default) or `tensor`.
pub const FP8_SCALE: &str = "FP8_SCALE";
/// The activation scales of a `FORMAT=FP8` run: `dynamic` (the default: per-token scales the serving engine
/// computes, no calibration) or `static` (one calibrated per-tensor `input_scale` per quantized linear from a
/// forward over `DATASET`, `MAX_SAMPLES`, `MAX_SEQ_LEN`: vLLM's static W8A8 scheme).
pub const FP8_ACTIVATIONS: &str = "FP8_ACTIVATIONS";
/// The llama.cpp preset of a `FORMAT=GGUF` run (`Q4_K_M` by default; `flexinfer_quant::gguf::FileType`).
pub const GGUF_TYPE: &str = "GGUF_TYPE";
/// GPTQ error feedback on the K-quant grids of a `FORMAT=GGUF` run with a `DATASET`: `auto` (the
/// default: on for the types where it measured better than without), `1` (on for every type) or `0` (off).
pub const GGUF_GPTQ: &str = "GGUF_GPTQ";
/// Every `GGUF_TYPE` the engine writes (llama.cpp's preset names; `flexinfer_quant::gguf::FileType::ALL`
/// is checked against this list). The controller refuses any other `spec.quantization.ggufType` before a
/// Job runs.
pub const GGUF_TYPES: &[&str] = &[
    "F16", "BF16", "Q8_0", "Q4_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q3_K_M",
    "Q2_K", "IQ4_XS",
];
/// Where the GPTQ solve runs: `auto` (default), `cpu`, `hip` or `cuda`.
pub const GPTQ_DEVICE: &str = "GPTQ_DEVICE";
/// Where the calibration forward runs when the solve is on a GPU: `auto` (default: on the GPU for every layer
/// the device forward supports) or `off` (on the CPU, only the Hessians and solves on the GPU).
pub const GPTQ_DEVICE_FORWARD: &str = "GPTQ_DEVICE_FORWARD";
/// Whether a GPU solve uses the vendor's BLAS and solver libraries where installed: `auto` (default) or
/// `off` (the engine's own kernels only).
pub const GPTQ_VENDOR_LIBS: &str = "GPTQ_VENDOR_LIBS";
pub const GPTQ_DAMP_PERCENT_OVERRIDE: &str = "GPTQ_DAMP_PERCENT_OVERRIDE";
pub const GPTQ_DAMP_AUTO_INCREMENT_OVERRIDE: &str = "GPTQ_DAMP_AUTO_INCREMENT_OVERRIDE";
pub const GPTQ_HESSIAN_DIAG_FLOOR_MODE: &str = "GPTQ_HESSIAN_DIAG_FLOOR_MODE";
pub const GPTQ_HESSIAN_DIAG_FLOOR_SCALE: &str = "GPTQ_HESSIAN_DIAG_FLOOR_SCALE";
pub const GPTQ_HESSIAN_FLOOR_MULTIPLIER: &str = "GPTQ_HESSIAN_FLOOR_MULTIPLIER";
pub const GPTQ_HESSIAN_MAX_FLOOR_ATTEMPTS: &str = "GPTQ_HESSIAN_MAX_FLOOR_ATTEMPTS";
pub const GPTQ_RESUME_LAYERS: &str = "GPTQ_RESUME_LAYERS";
pub const GPTQ_MAX_RTN_FALLBACK_PERCENT: &str = "GPTQ_MAX_RTN_FALLBACK_PERCENT";
pub const GPTQ_MIN_MODULES_FOR_FALLBACK_GATE: &str = "GPTQ_MIN_MODULES_FOR_FALLBACK_GATE";
/// `true` (the default): a quantize Job re-hashes every shard of an existing `.save-complete` before
/// it reuses the artifact; `false`: exact sizes only.
pub const GPTQ_VERIFY_SAVE_SHA256: &str = "GPTQ_VERIFY_SAVE_SHA256";
pub const TELEMETRY: &str = "FLEXINFER_TELEMETRY";
/// Who writes a phase's directory: the Job's UID (downward API, the pod label
/// `batch.kubernetes.io/controller-uid`). Recorded in the directory's writer lock.
pub const WRITER_ID: &str = "FLEXINFER_WRITER_ID";
/// The writing pod's name (downward API), recorded in the writer lock.
pub const WRITER_POD: &str = "FLEXINFER_WRITER_POD";
/// The node the writing pod runs on (downward API `spec.nodeName`): a fresh heartbeat of a writer on
/// another node blocks a second writer even where flocks are not shared between nodes.
pub const WRITER_NODE: &str = "FLEXINFER_WRITER_NODE";
/// Comma list of directories (relative to the cache mount) that a phase's garbage collection keeps:
/// the new generation, the promoted one, earlier ones still kept, and every one a Model serves.
pub const KEEP_DIRS: &str = "FLEXINFER_KEEP_DIRS";
pub const HF_TOKEN: &str = "HF_TOKEN";
pub const HF_ENDPOINT: &str = "HF_ENDPOINT";
pub const SOURCE: &str = "SOURCE";
pub const REVISION: &str = "REVISION";
pub const REPO_TYPE: &str = "REPO_TYPE";
pub const ALLOW_PATTERNS: &str = "ALLOW_PATTERNS";
pub const IGNORE_PATTERNS: &str = "IGNORE_PATTERNS";
pub const NUM_SAMPLES: &str = "NUM_SAMPLES";
pub const TARGET_LAYERS: &str = "TARGET_LAYERS";
pub const WEIGHT_MATRICES: &str = "WEIGHT_MATRICES";
pub const SKIP_GDN_LAYERS: &str = "SKIP_GDN_LAYERS";
pub const SKIP_VISION: &str = "SKIP_VISION";
pub const NORM_THRESHOLD: &str = "NORM_THRESHOLD";
pub const ABLITERATE_LM_HEAD: &str = "ABLITERATE_LM_HEAD";
pub const MAX_PERPLEXITY_INCREASE_PERCENT: &str = "MAX_PERPLEXITY_INCREASE_PERCENT";
pub const REFUSAL_DATASET: &str = "REFUSAL_DATASET";
pub const HARMLESS_DATASET: &str = "HARMLESS_DATASET";
pub const OCI_REF: &str = "OCI_REF";
pub const OCI_TAG_POLICY: &str = "OCI_TAG_POLICY";
pub const OCI_ADDITIONAL_TAGS: &str = "OCI_ADDITIONAL_TAGS";
pub const OCI_INSECURE: &str = "OCI_INSECURE";
pub const OCI_USERNAME: &str = "OCI_USERNAME";
pub const OCI_PASSWORD: &str = "OCI_PASSWORD";
/// Path of a mounted dockerconfigjson with registry credentials.
pub const DOCKER_CONFIG_JSON: &str = "DOCKER_CONFIG_JSON";
/// A `storageStrategy: NodeLocal` cache's directory on the node (the fill and cleanup Jobs of
/// `flexinfer-worker node-copy`): each verified copy is `<dir>/<manifest digest hex>`.
pub const NODE_COPY_DIR: &str = "NODE_COPY_DIR";
/// `node-copy clean`: the digest (`sha256:<hex>`) whose copy stays; unset or empty removes every copy.
pub const NODE_COPY_KEEP: &str = "NODE_COPY_KEEP";
/// Where the worker writes its termination message (default `/dev/termination-log`).
pub const TERMINATION_LOG: &str = "FLEXINFER_TERMINATION_LOG";
/// Pipeline phase the Job runs (`download`, `abliterate`, `quantize`, `publish`).
pub const PHASE: &str = "FLEXINFER_PHASE";

/// Variables a GPUProfile's `env` may not set: FlexInfer sets them for every Job from the cache's spec
/// and the controller's configuration (paths, sources and their credentials, what the artifact is, the
/// publish target), and the dynamic loader's paths. Every `FLEXINFER_*` name is refused too
/// ([`PROFILE_PROTECTED_PREFIX`]). GPU tuning (`GPU_*`, `GPTQ_DEVICE`, `GPTQ_VENDOR_LIBS`, the `GPTQ_*`
/// tunables, `N_PARALLEL_CALIB_SAMPLES`, `MAX_MEMORY_GB`) and the vendors' own variables stay allowed.
pub const PROFILE_PROTECTED: &[&str] = &[
    MODEL_DIR,
    OUT_DIR,
    BITS,
    GROUP_SIZE,
    SYM,
    DESC_ACT,
    ACT_GROUP_AWARE,
    CLIP_SEARCH,
    REFINE_SCALES,
    DYNAMIC_EXCLUSION,
    MAX_SEQ_LEN,
    MAX_SAMPLES,
    DATASET,
    FORMAT,
    GGUF_TYPE,
    GGUF_GPTQ,
    FP8_SCALE,
    FP8_ACTIVATIONS,
    HF_TOKEN,
    HF_ENDPOINT,
    SOURCE,
    REVISION,
    REPO_TYPE,
    ALLOW_PATTERNS,
    IGNORE_PATTERNS,
    NUM_SAMPLES,
    TARGET_LAYERS,
    WEIGHT_MATRICES,
    SKIP_GDN_LAYERS,
    SKIP_VISION,
    NORM_THRESHOLD,
    ABLITERATE_LM_HEAD,
    MAX_PERPLEXITY_INCREASE_PERCENT,
    REFUSAL_DATASET,
    HARMLESS_DATASET,
    OCI_REF,
    OCI_TAG_POLICY,
    OCI_ADDITIONAL_TAGS,
    OCI_INSECURE,
    OCI_USERNAME,
    OCI_PASSWORD,
    DOCKER_CONFIG_JSON,
    NODE_COPY_DIR,
    NODE_COPY_KEEP,
    // The serving backends' API keys: a profile's key would lock every Model on it behind a key the proxy
    // does not send (only `spec.backendKeySecretRef` sets them).
    serving::VLLM_API_KEY,
    serving::LLAMA_API_KEY,
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "LD_AUDIT",
];

/// The prefix of FlexInfer's own variables (identity, phase, telemetry, GC): none may come from a GPUProfile.
pub const PROFILE_PROTECTED_PREFIX: &str = "FLEXINFER_";

/// Whether a GPUProfile's `env` may not set `name` (see [`PROFILE_PROTECTED`]).
pub fn protected_from_profiles(name: &str) -> bool {
    PROFILE_PROTECTED.contains(&name) || name.starts_with(PROFILE_PROTECTED_PREFIX)
}

/// The `GPTQ_*` tunables with their defaults, in the order the controller emits them.
/// The controller overrides each cluster-wide from its own env `FLEXINFER_<NAME>`.
pub const GPTQ_TUNABLES: &[(&str, &str)] = &[
    (GPTQ_DAMP_PERCENT_OVERRIDE, "0.05"),
    (GPTQ_DAMP_AUTO_INCREMENT_OVERRIDE, "0.1"),
    (GPTQ_HESSIAN_DIAG_FLOOR_MODE, "mean"),
    (GPTQ_HESSIAN_DIAG_FLOOR_SCALE, "0.01"),
    (GPTQ_HESSIAN_FLOOR_MULTIPLIER, "10"),
    (GPTQ_HESSIAN_MAX_FLOOR_ATTEMPTS, "6"),
    (GPTQ_RESUME_LAYERS, "true"),
    (GPTQ_MAX_RTN_FALLBACK_PERCENT, "10"),
    (GPTQ_MIN_MODULES_FOR_FALLBACK_GATE, "100"),
    (GPTQ_VERIFY_SAVE_SHA256, "true"),
];

/// Controller env name that overrides a worker tunable cluster-wide (`FLEXINFER_<NAME>`).
pub fn controller_override(name: &str) -> String {
    format!("FLEXINFER_{name}")
}

/// Controller configuration environment (read by the controller binary, set by the chart).
pub mod controller {
    pub const QUANTIZER_GPTQ_IMAGE: &str = "FLEXINFER_QUANTIZER_GPTQ_IMAGE";
    pub const QUANTIZER_GPTQ_ROCM_IMAGE: &str = "FLEXINFER_QUANTIZER_GPTQ_ROCM_IMAGE";
    /// `FLEXINFER_QUANTIZER_GPTQ_ROCM_<ARCH>_IMAGE`, e.g. `..._GFX906_IMAGE`.
    pub fn quantizer_gptq_rocm_arch_image(arch: &str) -> String {
        format!(
            "FLEXINFER_QUANTIZER_GPTQ_ROCM_{}_IMAGE",
            arch.to_ascii_uppercase()
        )
    }
    /// `FLEXINFER_QUANTIZER_IMAGE_<FORMAT>` (chart value `quantization.images.<format>`).
    pub fn quantizer_format_image(format: &str) -> String {
        format!("FLEXINFER_QUANTIZER_IMAGE_{}", format.to_ascii_uppercase())
    }
    /// Image of the download/publish worker (and CPU phases without a format image).
    pub const WORKER_IMAGE: &str = "FLEXINFER_WORKER_IMAGE";
    /// ServiceAccount of pipeline Jobs.
    pub const WORKER_SERVICE_ACCOUNT: &str = "FLEXINFER_WORKER_SERVICE_ACCOUNT";
    /// Image-drift grace window in seconds (default 600).
    pub const IMAGE_DRIFT_GRACE_SECONDS: &str = "FLEXINFER_IMAGE_DRIFT_GRACE_SECONDS";
    /// How long a pipeline pod may stay unschedulable or unable to pull its image before the
    /// attempt counts as failed (seconds, default 300).
    pub const STUCK_POD_SECONDS: &str = "FLEXINFER_STUCK_POD_SECONDS";
    /// How long a preempted Model of a shared GPU group keeps serving requests in flight before
    /// it is scaled to zero (seconds, default 30).
    pub const PREEMPTION_GRACE_SECONDS: &str = "FLEXINFER_PREEMPTION_GRACE_SECONDS";
    /// Longest `idleTimeout` a canary of the promotion gate keeps (seconds, default 900).
    pub const CANARY_MAX_IDLE_SECONDS: &str = "FLEXINFER_CANARY_MAX_IDLE_SECONDS";
    /// Supplemental group ids of every pod that requests a GPU (comma-separated; e.g. the AMD
    /// nodes' `render` and `video` gids, which own `/dev/kfd` and `/dev/dri`). Default: none.
    pub const GPU_SUPPLEMENTAL_GROUPS: &str = "FLEXINFER_GPU_SUPPLEMENTAL_GROUPS";
    /// Registries (`host` or `host:port`, comma-separated; `*`: every registry) that may receive the registry
    /// credentials of a ModelCache's Secret (publish target, `oci://` source). Unset: none; a cache that would
    /// send credentials elsewhere fails before any Job.
    pub const CREDENTIAL_REGISTRIES: &str = "FLEXINFER_CREDENTIAL_REGISTRIES";
    /// Retry backoff base in seconds (default 30).
    pub const RETRY_BASE_SECONDS: &str = "FLEXINFER_RETRY_BASE_SECONDS";
    pub const LEADER_ELECT: &str = "FLEXINFER_LEADER_ELECT";
    pub const NAMESPACE: &str = "FLEXINFER_NAMESPACE";
    /// Root directory `local://` sources are confined to.
    pub const LOCAL_SOURCE_ROOT: &str = "FLEXINFER_LOCAL_SOURCE_ROOT";
    /// Host directory of the nodes that holds `storageStrategy: NodeLocal` copies:
    /// `<root>/<namespace>/<cache>/<digest hex>` (default [`NODE_LOCAL_ROOT_DEFAULT`]).
    pub const NODE_LOCAL_ROOT: &str = "FLEXINFER_NODE_LOCAL_ROOT";
    /// Default of [`NODE_LOCAL_ROOT`].
    pub const NODE_LOCAL_ROOT_DEFAULT: &str = "/var/lib/flexinfer/node-local";
    /// The namespace of flexinfer-proxy. With [`PROXY_POD_LABELS`] set, every Model gets a NetworkPolicy (its
    /// name, owned by it) that admits only the proxy pods to its serving pods' port.
    pub const PROXY_NAMESPACE: &str = "FLEXINFER_PROXY_NAMESPACE";
    /// The proxy pods' labels, `key=value` pairs separated by commas (the chart's proxy selector labels).
    pub const PROXY_POD_LABELS: &str = "FLEXINFER_PROXY_POD_LABELS";
    /// The llama.cpp serving images FlexInfer builds, `<repository>:<tag>` (the CPU flavor); the
    /// controller's image table appends `-rocm` and `-vulkan` for AMD GPUs (chart value
    /// `runtime.llamacpp`). Unset: `ghcr.io/flexinfer/flexinfer-llamacpp:<controller version>`.
    pub const LLAMACPP_IMAGE: &str = "FLEXINFER_LLAMACPP_IMAGE";
    /// Digests that pin FlexInfer's llama.cpp images per flavor, `flavor=sha256:<64 hex>` pairs separated
    /// by commas (flavors `cpu`, `rocm`, `vulkan`; chart value `runtime.llamacpp.digests`): a default llama.cpp
    /// image of that flavor runs as `<image>@<digest>`.
    pub const LLAMACPP_IMAGE_DIGESTS: &str = "FLEXINFER_LLAMACPP_IMAGE_DIGESTS";
    /// Serving image per backend for every Model whose spec and GPUProfile name none, whatever its
    /// GPU: `FLEXINFER_RUNTIME_IMAGE_<BACKEND>` (unset: the controller's table by vendor and
    /// architecture).
    pub fn runtime_image(backend: &str) -> String {
        format!("FLEXINFER_RUNTIME_IMAGE_{}", backend.to_ascii_uppercase())
    }
    /// Only watch this namespace (default: all namespaces).
    pub const WATCH_NAMESPACE: &str = "FLEXINFER_WATCH_NAMESPACE";
    /// Seconds between progress polls (pod log tail) of a running Job (default 30).
    pub const PROGRESS_POLL_SECONDS: &str = "FLEXINFER_PROGRESS_POLL_SECONDS";
    /// Pod-log reads for progress per second across all caches (default 20, 0 = none; at most 1000).
    pub const LOG_READS_PER_SECOND: &str = "FLEXINFER_LOG_READS_PER_SECOND";
    /// ModelCache reconciles that run at once (default 32, at most 1024, 0 = no limit).
    pub const RECONCILE_CONCURRENCY: &str = "FLEXINFER_RECONCILE_CONCURRENCY";
    /// Leader-election Lease duration in seconds (default 15).
    pub const LEASE_DURATION_SECONDS: &str = "FLEXINFER_LEASE_DURATION_SECONDS";
    /// Name of the leader-election Lease (default `flexinfer-controller-leader`).
    pub const LEASE_NAME: &str = "FLEXINFER_LEASE_NAME";
    /// Address of `/metrics` (default `0.0.0.0:8080`).
    pub const METRICS_ADDR: &str = "FLEXINFER_METRICS_ADDR";
    /// Address of `/healthz` and `/readyz` (default `0.0.0.0:8081`).
    pub const HEALTH_ADDR: &str = "FLEXINFER_HEALTH_ADDR";
    /// Earlier generations of an abliteration/quantization output kept on disk (default 1, at most 16).
    pub const KEEP_GENERATIONS: &str = "FLEXINFER_KEEP_GENERATIONS";
    /// Downward-API env naming the controller pod: Event `reportingInstance`, lease identity.
    pub const POD_NAME: &str = "POD_NAME";
}

/// Optional tuning env of the transfer subcommands (each also a command-line flag).
pub mod transfer {
    /// Files fetched in parallel by `download` (default 4).
    pub const DOWNLOAD_CONCURRENCY: &str = "FLEXINFER_DOWNLOAD_CONCURRENCY";
    /// Consecutive failed attempts per file without progress before `download` gives up (default 8).
    pub const DOWNLOAD_RETRIES: &str = "FLEXINFER_DOWNLOAD_RETRIES";
    /// Blobs uploaded in parallel by `publish` (default 4).
    pub const PUBLISH_CONCURRENCY: &str = "FLEXINFER_PUBLISH_CONCURRENCY";
    /// Seconds between `progress` events of `download`/`publish` (default 5).
    pub const PROGRESS_INTERVAL_SECONDS: &str = "FLEXINFER_PROGRESS_INTERVAL_SECONDS";
}

/// Environment of the serving containers.
pub mod serving {
    /// vLLM attention backend (`config.attentionBackend`).
    pub const VLLM_ATTENTION_BACKEND: &str = "VLLM_ATTENTION_BACKEND";
    /// The key vLLM's OpenAI server demands (`Authorization: Bearer <key>`) on its `/v1` routes
    /// (`spec.backendKeySecretRef`, injected from the Secret by `secretKeyRef`).
    pub const VLLM_API_KEY: &str = "VLLM_API_KEY";
    /// The key llama.cpp's `llama-server` demands (its `--api-key` flag's variable), likewise.
    pub const LLAMA_API_KEY: &str = "LLAMA_API_KEY";
}

/// Configuration environment of `flexinfer-proxy` (each also a command-line flag; set by the chart).
pub mod proxy {
    /// Address of the OpenAI-compatible front (default `0.0.0.0:8000`).
    pub const LISTEN_ADDR: &str = "FLEXINFER_PROXY_LISTEN_ADDR";
    /// Address of `/healthz` and `/readyz` (default `0.0.0.0:8081`).
    pub const HEALTH_ADDR: &str = "FLEXINFER_PROXY_HEALTH_ADDR";
    /// Only route to Models of this namespace (default: all namespaces).
    pub const WATCH_NAMESPACE: &str = "FLEXINFER_PROXY_WATCH_NAMESPACE";
    /// Accepted bearer tokens, comma- or newline-separated. Auth is off when neither this nor
    /// [`API_KEYS_FILE`] is set.
    pub const API_KEYS: &str = "FLEXINFER_PROXY_API_KEYS";
    /// File with accepted bearer tokens, one per line (a mounted Secret key).
    pub const API_KEYS_FILE: &str = "FLEXINFER_PROXY_API_KEYS_FILE";
    /// Largest request body accepted, in bytes (default 8 MiB).
    pub const MAX_BODY_BYTES: &str = "FLEXINFER_PROXY_MAX_BODY_BYTES";
    /// Default keepalive interval when a Model sets none, as a duration (default `30s`).
    pub const KEEPALIVE_INTERVAL: &str = "FLEXINFER_PROXY_KEEPALIVE_INTERVAL";
    /// Bytes that request bodies may hold at once, all requests together (default: half the
    /// container's memory limit).
    pub const BODY_MEMORY_BYTES: &str = "FLEXINFER_PROXY_BODY_MEMORY_BYTES";
    /// Client connections open at once on the OpenAI port (default 2048; more wait in the listen
    /// backlog).
    pub const MAX_CONNECTIONS: &str = "FLEXINFER_PROXY_MAX_CONNECTIONS";
    /// Requests admitted at once, all Models together (default 1024; more wait, then 429).
    pub const MAX_REQUESTS: &str = "FLEXINFER_PROXY_MAX_REQUESTS";
    /// Requests that may wait for admission (default 1024; more are answered 429).
    pub const MAX_QUEUED_REQUESTS: &str = "FLEXINFER_PROXY_MAX_QUEUED_REQUESTS";
    /// Requests admitted at once for one Model, cold-start waiters included (default 512; 429 beyond).
    pub const MAX_REQUESTS_PER_MODEL: &str = "FLEXINFER_PROXY_MAX_REQUESTS_PER_MODEL";
    /// Requests released at once to a Model that just became ready (default 16).
    pub const COLD_START_RELEASE: &str = "FLEXINFER_PROXY_COLD_START_RELEASE";
    /// Longest wait for a client's request headers, on every port (default `30s`).
    pub const HEADER_READ_TIMEOUT: &str = "FLEXINFER_PROXY_HEADER_READ_TIMEOUT";
    /// Longest time to read a request body (default `30s`; 408 beyond).
    pub const BODY_READ_TIMEOUT: &str = "FLEXINFER_PROXY_BODY_READ_TIMEOUT";
    /// Longest wait for a backend's response headers (default `10m`; 504 beyond).
    pub const BACKEND_HEADER_TIMEOUT: &str = "FLEXINFER_PROXY_BACKEND_HEADER_TIMEOUT";
}
