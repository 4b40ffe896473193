//! The flags that the commands' implementations take (clap derive): the global connection and output
//! flags, a quantization request, `quantize recommend`. Below [`crate::cli`] (which parses and dispatches)
//! and [`crate::cluster`] and [`crate::request`] (which run the commands), so those need not import the
//! dispatcher; `crate::cli` re-exports them.

use std::path::PathBuf;

use clap::Args;

use crate::output::Format;

/// Connection and output flags shared by every command.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Global options")]
pub struct Global {
    /// Path to the kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)
    #[arg(long, global = true, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context to use (default: the current context)
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
    /// Namespace (default: the context's namespace, else "default")
    #[arg(short = 'n', long, global = true, value_name = "NAME")]
    pub namespace: Option<String>,
    /// Output format: table (human), json or yaml
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

/// Flags of a quantization request (patches `spec.quantization`).
#[derive(Debug, Clone, Args)]
pub struct QuantizeRequest {
    /// ModelCache to quantize
    #[arg(required = true, value_name = "CACHE")]
    pub cache: Option<String>,
    /// Target format: GGUF (the default), AWQ, GPTQ, EXL2, FP8, COMPRESSED_TENSORS (see `flexinfer quantize formats`)
    #[arg(long, default_value = "GGUF", value_name = "FORMAT")]
    pub format: Option<String>,
    /// GGUF quantization type, e.g. Q4_K_M (GGUF only; unset: Q4_K_M)
    #[arg(long = "type", value_name = "TYPE")]
    pub gguf_type: Option<String>,
    /// Bits per weight (GPTQ 2/3/4/8, AWQ 4, FP8 8, COMPRESSED_TENSORS 4/8, GGUF/EXL2 2-8)
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub bits: Option<i32>,
    /// Group size: -1 (per channel) or a power of two such as 32, 64, 128
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub group_size: Option<i32>,
    /// Run the quantize Job on a GPU node
    #[arg(long)]
    pub use_gpu: bool,
}

#[derive(Debug, Args)]
pub struct RecommendArgs {
    /// ModelCache name
    pub cache: String,
    /// Patch the recommendation into spec.quantization (explicit opt-in)
    #[arg(long)]
    pub apply: bool,
    /// Local or mounted copy of the source model (config.json, *.safetensors)
    #[arg(long, value_name = "DIR")]
    pub model_dir: Option<PathBuf>,
    /// Hub endpoint for metadata lookups (the hub API /api/models/{id})
    #[arg(
        long,
        value_name = "URL",
        env = flexinfer_api::contract::env::HF_ENDPOINT,
        hide_env_values = true,
        default_value = "https://huggingface.co"
    )]
    pub hub_endpoint: String,
    /// Do not query the hub
    #[arg(long)]
    pub offline: bool,
    /// Parameter count when no local copy or hub metadata is reachable (8B, 14.8B, 770M)
    #[arg(long, value_name = "COUNT")]
    pub params: Option<String>,
    /// GPUProfile to target (default: the one matching the cache's flexinfer.ai/gpu.arch nodeSelector)
    #[arg(long, value_name = "NAME")]
    pub gpu_profile: Option<String>,
    /// Format to recommend: GPTQ, AWQ or GGUF (default: GGUF on gfx906, which vLLM does not serve; GPTQ otherwise)
    #[arg(long, value_name = "FORMAT")]
    pub format: Option<String>,
}
