//! Serving images by GPU vendor and architecture (docs/user/serving.md, "Image"). Pure.
//!
//! [`TABLE`] is the controller's default image of each backend per vendor and architecture, used
//! when neither the Model, nor its GPUProfile, nor the controller's `FLEXINFER_RUNTIME_IMAGE_<BACKEND>`
//! names one. [`built_for`] recognises what an image reference was built for (conservatively: known
//! repositories and tag words; anything else is [`BuiltFor::Unknown`] and never refused). [`resolve`]
//! picks the image and refuses a Model whose image belongs to another vendor or whose backend, image
//! and GPU are known not to work together.

use flexinfer_api::contract::env;
use flexinfer_api::gpuprofile::GpuVendor;
use flexinfer_api::model::Backend;
use k8s_openapi::api::core::v1::EnvVar;

use super::problem::ConfigProblem;

/// vLLM for NVIDIA: the official CUDA image (`vllm/vllm-openai`, one tag per release).
pub const VLLM_CUDA: &str = "docker.io/vllm/vllm-openai:v0.18.0";
/// vLLM for AMD: the official ROCm image of the same release (`vllm/vllm-openai-rocm`, published by
/// the vLLM project since 2026-01-20, built for [`VLLM_ROCM_TARGETS`]). AMD's `rocm/vllm` images are
/// MI300X performance-validation builds.
pub const VLLM_ROCM: &str = "docker.io/vllm/vllm-openai-rocm:v0.18.0";
/// llama.cpp for NVIDIA: upstream's CUDA 12 server image of one build (FlexInfer builds no CUDA
/// flavor of its own llama.cpp image).
pub const LLAMACPP_CUDA: &str = "ghcr.io/ggml-org/llama.cpp:server-cuda-b11206";
/// ollama without a GPU or on NVIDIA (the plain tags carry the CUDA libraries).
pub const OLLAMA: &str = "docker.io/ollama/ollama:0.12.6";
/// ollama on AMD: the same release's ROCm tag.
pub const OLLAMA_ROCM: &str = "docker.io/ollama/ollama:0.12.6-rocm";
/// TabbyAPI (exllamav2) for NVIDIA: it publishes rolling tags only (`latest`, `cu13`), so one build is
/// pinned by digest (CUDA 12.8).
pub const TABBYAPI_CUDA: &str = "ghcr.io/theroyallab/tabbyapi@sha256:cbceb3032963ab7ada80c76649956b01f54e9e0b04a050fb3396c95950c52b03";
/// Repository of the llama.cpp images FlexInfer builds (`FLEXINFER_LLAMACPP_IMAGE` unset).
pub const LLAMACPP_REPOSITORY: &str = "ghcr.io/flexinfer/flexinfer-llamacpp";

/// AMD targets ggml's HIP backend in FlexInfer's `-rocm` llama.cpp image carries code for (read from
/// the offload bundles of Debian's `libggml-hip.so`, docs/user/install.md).
pub const LLAMACPP_HIP_TARGETS: [&str; 10] = [
    "gfx803", "gfx900", "gfx906", "gfx908", "gfx90a", "gfx1010", "gfx1030", "gfx1100", "gfx1101",
    "gfx1102",
];
/// AMD targets vLLM's ROCm builds carry kernels for (`PYTORCH_ROCM_ARCH` of vLLM's
/// `docker/Dockerfile.rocm_base`; the GPUs its ROCm installation page lists). gfx906 is not one.
pub const VLLM_ROCM_TARGETS: [&str; 9] = [
    "gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1150", "gfx1151", "gfx1200", "gfx1201",
];

/// Which architectures a row of [`TABLE`] covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Archs {
    /// Every architecture, known or not.
    Any,
    /// These architectures.
    OneOf(&'static [&'static str]),
    /// The architecture is not known (`spec.gpu.vendor` without a GPUProfile).
    Unknown,
    /// Any known architecture (the rows before it of the same vendor and backend took theirs).
    Others,
}

impl Archs {
    fn matches(self, arch: Option<&str>) -> bool {
        match self {
            Archs::Any => true,
            Archs::OneOf(list) => arch.is_some_and(|a| list.contains(&a)),
            Archs::Unknown => arch.is_none(),
            Archs::Others => arch.is_some(),
        }
    }
}

/// A row's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultImage {
    /// An upstream image, pinned.
    Upstream(&'static str),
    /// FlexInfer's llama.cpp image (`FLEXINFER_LLAMACPP_IMAGE`) with this flavor suffix.
    Ours(&'static str),
    /// No image works: the Model must name one.
    None(NoDefault),
}

/// Why a row has no default image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoDefault {
    /// vLLM has no kernels for the architecture.
    VllmArch,
    /// The backend publishes no ROCm build (TabbyAPI).
    NoRocmBuild,
    /// The backend needs a GPU.
    NoCpuBuild,
}

/// One row of the default-image table: the first row matching the vendor (`None`: no GPU), the
/// architecture and the backend wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    pub vendor: Option<GpuVendor>,
    pub archs: Archs,
    pub backend: Backend,
    pub image: DefaultImage,
}

const fn row(
    vendor: Option<GpuVendor>,
    archs: Archs,
    backend: Backend,
    image: DefaultImage,
) -> Row {
    Row {
        vendor,
        archs,
        backend,
        image,
    }
}

const AMD: Option<GpuVendor> = Some(GpuVendor::Amd);
const NVIDIA: Option<GpuVendor> = Some(GpuVendor::Nvidia);

/// The controller's default serving image per vendor, architecture and backend.
#[rustfmt::skip]
pub const TABLE: [Row; 15] = [
    row(AMD, Archs::OneOf(&VLLM_ROCM_TARGETS), Backend::Vllm, DefaultImage::Upstream(VLLM_ROCM)),
    row(AMD, Archs::Unknown, Backend::Vllm, DefaultImage::Upstream(VLLM_ROCM)),
    row(AMD, Archs::Others, Backend::Vllm, DefaultImage::None(NoDefault::VllmArch)),
    row(AMD, Archs::OneOf(&LLAMACPP_HIP_TARGETS), Backend::Llamacpp, DefaultImage::Ours("-rocm")),
    // Mesa's radv drives every AMD generation the HIP build has no code for (and an unknown one).
    row(AMD, Archs::Any, Backend::Llamacpp, DefaultImage::Ours("-vulkan")),
    row(AMD, Archs::Any, Backend::Ollama, DefaultImage::Upstream(OLLAMA_ROCM)),
    row(AMD, Archs::Any, Backend::Exllamav2, DefaultImage::None(NoDefault::NoRocmBuild)),
    row(NVIDIA, Archs::Any, Backend::Vllm, DefaultImage::Upstream(VLLM_CUDA)),
    row(NVIDIA, Archs::Any, Backend::Llamacpp, DefaultImage::Upstream(LLAMACPP_CUDA)),
    row(NVIDIA, Archs::Any, Backend::Ollama, DefaultImage::Upstream(OLLAMA)),
    row(NVIDIA, Archs::Any, Backend::Exllamav2, DefaultImage::Upstream(TABBYAPI_CUDA)),
    row(None, Archs::Any, Backend::Llamacpp, DefaultImage::Ours("")),
    row(None, Archs::Any, Backend::Ollama, DefaultImage::Upstream(OLLAMA)),
    row(None, Archs::Any, Backend::Vllm, DefaultImage::None(NoDefault::NoCpuBuild)),
    row(None, Archs::Any, Backend::Exllamav2, DefaultImage::None(NoDefault::NoCpuBuild)),
];

/// The table's default for a backend on a GPU (`vendor` `None`: no GPU); `ours` is FlexInfer's
/// llama.cpp image (`<repository>:<tag>`, the CPU flavor).
pub fn default_image(
    backend: Backend,
    vendor: Option<GpuVendor>,
    arch: Option<&str>,
    ours: &str,
) -> Result<String, NoDefault> {
    let row = TABLE
        .iter()
        .find(|r| r.vendor == vendor && r.backend == backend && r.archs.matches(arch));
    match row.map(|r| r.image) {
        Some(DefaultImage::Upstream(i)) => Ok(i.to_string()),
        Some(DefaultImage::Ours(suffix)) => Ok(format!("{ours}{suffix}")),
        Some(DefaultImage::None(why)) => Err(why),
        // Every (vendor, backend) pair ends in an `Any` or `Others` row (a test checks it).
        None => Err(NoDefault::NoCpuBuild),
    }
}

/// The GPU target ROCm loads code for: `HSA_OVERRIDE_GFX_VERSION` (`11.0.0` → `gfx1100`,
/// `9.0.10` → `gfx90a`) in the profile's env when set, else the profile's architecture.
pub fn rocm_target(arch: &str, profile_env: &[EnvVar]) -> String {
    let over = profile_env
        .iter()
        .rev()
        .find(|e| e.name == "HSA_OVERRIDE_GFX_VERSION")
        .and_then(|e| e.value.as_deref());
    let parsed = over.and_then(|v| {
        let mut it = v.trim().split('.').map(|p| p.parse::<u32>().ok());
        match (it.next()??, it.next()??, it.next()??, it.next()) {
            (major, minor, step, None) if major > 0 && minor < 16 && step < 16 => {
                Some(format!("gfx{major}{minor:x}{step:x}"))
            }
            _ => None,
        }
    });
    parsed.unwrap_or_else(|| arch.to_string())
}

/// What an image was built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuiltFor {
    /// NVIDIA GPUs (CUDA).
    Cuda,
    /// AMD GPUs (ROCm/HIP).
    Rocm,
    /// Any GPU with a Vulkan driver.
    Vulkan,
    /// The CPU only.
    Cpu,
    /// Not recognised: never refused.
    Unknown,
}

impl BuiltFor {
    /// Whether an image built for this cannot use `vendor`'s GPUs.
    pub fn wrong_for(self, vendor: GpuVendor) -> bool {
        matches!(
            (self, vendor),
            (BuiltFor::Cuda, GpuVendor::Amd) | (BuiltFor::Rocm, GpuVendor::Nvidia)
        )
    }

    fn label(self) -> &'static str {
        match self {
            BuiltFor::Cuda => "a CUDA build (NVIDIA GPUs)",
            BuiltFor::Rocm => "a ROCm build (AMD GPUs)",
            BuiltFor::Vulkan => "a Vulkan build",
            BuiltFor::Cpu => "a CPU build",
            BuiltFor::Unknown => "an image",
        }
    }
}

/// An image reference split into registry (`None`: Docker Hub), repository path and tag.
struct Reference {
    hub: bool,
    registry: String,
    path: Vec<String>,
    tag: Option<String>,
}

fn parse_reference(image: &str) -> Reference {
    let image = image.trim().to_ascii_lowercase();
    let name = image.split('@').next().unwrap_or_default();
    let (name, tag) = match name.rsplit_once(':') {
        Some((n, t)) if !t.contains('/') => (n.to_string(), Some(t.to_string())),
        _ => (name.to_string(), None),
    };
    let mut parts: Vec<String> = name.split('/').map(str::to_string).collect();
    let registry = match parts.first() {
        Some(first)
            if parts.len() > 1
                && (first.contains('.') || first.contains(':') || first == "localhost") =>
        {
            parts.remove(0)
        }
        _ => String::new(),
    };
    let hub = matches!(
        registry.as_str(),
        "" | "docker.io" | "index.docker.io" | "registry-1.docker.io"
    );
    if hub && parts.len() > 1 && parts[0] == "library" {
        parts.remove(0);
    }
    Reference {
        hub,
        registry,
        path: parts,
        tag,
    }
}

impl Reference {
    /// The repository path ends with `repo` (`owner/name`): the upstream repository itself or a
    /// mirror that keeps its path (`harbor.lan/dockerhub/vllm/vllm-openai`).
    fn is(&self, repo: &str) -> bool {
        let want: Vec<&str> = repo.split('/').collect();
        self.path
            .len()
            .checked_sub(want.len())
            .and_then(|start| self.path.get(start..))
            .is_some_and(|tail| tail.iter().zip(&want).all(|(a, b)| a == b))
    }

    /// Words of the tag and of the repository's last path component.
    fn words(&self) -> Vec<&str> {
        self.tag
            .as_deref()
            .into_iter()
            .chain(self.path.last().map(String::as_str))
            .flat_map(|s| s.split(['-', '_', '.']))
            .filter(|w| !w.is_empty())
            .collect()
    }
}

/// `cu121`, `cu128`, `cu13`: a CUDA version word.
fn is_cuda_version(w: &str) -> bool {
    w.strip_prefix("cu")
        .is_some_and(|d| (2..=3).contains(&d.len()) && d.chars().all(|c| c.is_ascii_digit()))
}

/// What `image` was built for. `ours` is FlexInfer's llama.cpp image (its repository counts).
///
/// Conservative: a `rocm…` word or a `cuda…`/`cuNNN` word in the tag or the repository name decides
/// (both: unknown); otherwise the upstream repositories FlexInfer knows (vLLM, vLLM ROCm, AMD's
/// `rocm/*` on Docker Hub, `nvcr.io/nvidia/*`, ollama, llama.cpp, TabbyAPI, FlexInfer's llama.cpp).
/// Anything else is [`BuiltFor::Unknown`].
pub fn built_for(image: &str, ours: &str) -> BuiltFor {
    let r = parse_reference(image);
    let words = r.words();
    let rocm = words.iter().any(|w| w.starts_with("rocm"));
    let cuda = words
        .iter()
        .any(|w| w.starts_with("cuda") || is_cuda_version(w));
    match (rocm, cuda) {
        (true, true) => return BuiltFor::Unknown,
        (true, false) => return BuiltFor::Rocm,
        (false, true) => return BuiltFor::Cuda,
        (false, false) => {}
    }
    if words.contains(&"vulkan") {
        return BuiltFor::Vulkan;
    }
    let vllm_rocm = r.is("vllm/vllm-openai-rocm") || r.is("rocm/vllm") || r.is("rocm/vllm-dev");
    if vllm_rocm || (r.hub && r.path.first().is_some_and(|p| p == "rocm")) {
        return BuiltFor::Rocm;
    }
    let nvcr = r.registry == "nvcr.io" && r.path.first().is_some_and(|p| p == "nvidia");
    if nvcr || r.is("vllm/vllm-openai") || r.is("theroyallab/tabbyapi") {
        return BuiltFor::Cuda;
    }
    // The plain ollama tags carry CUDA (and the CPU); ROCm is in the `-rocm` tags. A digest alone
    // does not say which.
    if r.is("ollama/ollama") && r.tag.is_some() {
        return BuiltFor::Cuda;
    }
    let cpu_words = |words: &[&str]| {
        words.iter().all(|w| {
            matches!(*w, "server" | "full" | "light" | "llama" | "cpp")
                || w.strip_prefix('b')
                    .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
        })
    };
    let upstream_llama = r.is("ggml-org/llama.cpp") || r.is("ggerganov/llama.cpp");
    if upstream_llama && r.tag.is_some() && cpu_words(&words) {
        return BuiltFor::Cpu;
    }
    let ours_ref = parse_reference(ours);
    if r.registry == ours_ref.registry && r.path == ours_ref.path && r.tag.is_some() {
        return BuiltFor::Cpu;
    }
    BuiltFor::Unknown
}

/// The GPU a Model runs on, for the image choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuTarget {
    /// `None`: no GPU.
    pub vendor: Option<GpuVendor>,
    /// The architecture code must exist for ([`rocm_target`] on AMD); `None`: not known.
    pub arch: Option<String>,
    /// The GPUProfile's name (`None`: `spec.gpu.vendor` without a profile).
    pub profile: Option<String>,
}

impl GpuTarget {
    /// `(GPUProfile gfx906)`-style suffix for messages.
    fn on(&self) -> String {
        match (&self.profile, &self.arch) {
            (Some(p), _) => format!(" (GPUProfile {p})"),
            (None, Some(a)) => format!(" ({a})"),
            (None, None) => " (spec.gpu.vendor)".to_string(),
        }
    }
}

/// Where the image came from (first hit wins, in this order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `spec.image`.
    Model,
    /// The GPUProfile's `spec.runtime.images.<backend>`.
    Profile,
    /// The controller's `FLEXINFER_RUNTIME_IMAGE_<BACKEND>`.
    Controller,
    /// [`TABLE`].
    Default,
}

/// The images named for a Model, by where they come from (empty strings count as unset).
#[derive(Debug, Clone, Copy, Default)]
pub struct Named<'a> {
    pub model: Option<&'a str>,
    pub profile: Option<&'a str>,
    pub controller: Option<&'a str>,
}

/// The serving image of a Model and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub image: String,
    pub source: Source,
}

fn vendor_name(v: GpuVendor) -> &'static str {
    match v {
        GpuVendor::Amd => "AMD",
        GpuVendor::Nvidia => "NVIDIA",
    }
}

fn field(source: &Source, backend: Backend, gpu: &GpuTarget) -> String {
    let b = backend.as_str();
    match source {
        Source::Model => "spec.image".to_string(),
        Source::Profile => format!(
            "GPUProfile {} spec.runtime.images.{b}",
            gpu.profile.as_deref().unwrap_or("?")
        ),
        Source::Controller => format!(
            "the controller's {} (chart value runtime.images.{b})",
            env::controller::runtime_image(b)
        ),
        Source::Default => format!("the default {b} image"),
    }
}

/// Pick the serving image (Model, GPUProfile, controller, table) and refuse what cannot work:
/// another vendor's image ([`ConfigProblem::ImageVendorMismatch`]), vLLM on an AMD target its ROCm
/// builds have no kernels for or its Marlin kernels on AMD ([`ConfigProblem::UnsupportedCombination`]),
/// no image at all ([`ConfigProblem::ImageNotConfigured`]).
pub fn resolve(
    backend: Backend,
    gpu: &GpuTarget,
    named: Named<'_>,
    ours: &str,
    extra_args: &[String],
) -> Result<Resolved, ConfigProblem> {
    let set = |s: Option<&str>| {
        s.map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    };
    let default = default_image(backend, gpu.vendor, gpu.arch.as_deref(), ours);
    let picked = [
        (Source::Model, set(named.model)),
        (Source::Profile, set(named.profile)),
        (Source::Controller, set(named.controller)),
    ]
    .into_iter()
    .find_map(|(source, image)| image.map(|image| Resolved { image, source }));
    let resolved = match (picked, &default) {
        (Some(r), _) => r,
        (None, Ok(image)) => Resolved {
            image: image.clone(),
            source: Source::Default,
        },
        (None, Err(why)) => return Err(no_default(backend, gpu, *why, ours)),
    };
    let Some(vendor) = gpu.vendor else {
        return Ok(resolved);
    };
    let built = built_for(&resolved.image, ours);
    if built.wrong_for(vendor) {
        return Err(mismatch(
            backend,
            gpu,
            vendor,
            &resolved,
            built,
            default.ok(),
        ));
    }
    if vendor == GpuVendor::Amd && backend == Backend::Vllm {
        check_vllm_on_amd(gpu, &resolved, extra_args, ours)?;
    }
    Ok(resolved)
}

fn mismatch(
    backend: Backend,
    gpu: &GpuTarget,
    vendor: GpuVendor,
    r: &Resolved,
    built: BuiltFor,
    default: Option<String>,
) -> ConfigProblem {
    let want = match vendor {
        GpuVendor::Amd => "ROCm",
        GpuVendor::Nvidia => "CUDA",
    };
    let b = backend.as_str();
    let f = field(&r.source, backend, gpu);
    let fix = match (&r.source, default) {
        (Source::Model | Source::Profile, Some(d)) => {
            format!("set {f} to a {want} build such as {d}, or remove it to get that default")
        }
        (Source::Model | Source::Profile, None) => format!("set {f} to a {want} build of {b}"),
        (Source::Controller, d) => {
            let profile = gpu
                .profile
                .as_deref()
                .map(|p| format!("GPUProfile {p} spec.runtime.images.{b} or "))
                .unwrap_or_default();
            let unset = match d {
                Some(d) => format!(
                    ", or unset {} to get {d}",
                    env::controller::runtime_image(b)
                ),
                None => String::new(),
            };
            format!("name a {want} image in {profile}the Model's spec.image{unset}")
        }
        (Source::Default, _) => format!("name a {want} image in spec.image"),
    };
    ConfigProblem::ImageVendorMismatch {
        message: format!(
            "{f} {} is {}, but this Model runs on {} GPUs{}: {fix}",
            r.image,
            built.label(),
            vendor_name(vendor),
            gpu.on()
        ),
    }
}

fn no_default(backend: Backend, gpu: &GpuTarget, why: NoDefault, ours: &str) -> ConfigProblem {
    let b = backend.as_str();
    let on = gpu.on();
    let where_ = match &gpu.profile {
        Some(p) => format!("spec.image or GPUProfile {p} spec.runtime.images.{b}"),
        None => "spec.image".to_string(),
    };
    match why {
        NoDefault::VllmArch => ConfigProblem::UnsupportedCombination {
            message: vllm_arch_message(&format!("backend vllm{on}"), gpu, ours),
        },
        NoDefault::NoRocmBuild => ConfigProblem::ImageNotConfigured {
            message: format!(
                "no {b} image for AMD GPUs{on}: TabbyAPI publishes CUDA builds only; set {where_} \
                 to a ROCm build"
            ),
        },
        NoDefault::NoCpuBuild => ConfigProblem::ImageNotConfigured {
            message: format!("no {b} image without a GPU: set {where_}"),
        },
    }
}

fn vllm_arch_message(subject: &str, gpu: &GpuTarget, ours: &str) -> String {
    let arch = gpu.arch.as_deref().unwrap_or("this GPU");
    let llama = default_image(Backend::Llamacpp, gpu.vendor, gpu.arch.as_deref(), ours)
        .map(|i| format!(" (image {i})"))
        .unwrap_or_default();
    format!(
        "{subject}: vLLM does not support {arch}: its ROCm builds carry kernels for {} only; serve a \
         GGUF artifact with spec.backend llamacpp{llama} instead, or set spec.image to a vLLM build \
         made for {arch}",
        VLLM_ROCM_TARGETS.join(", ")
    )
}

/// vLLM on AMD: an upstream ROCm image on a target it has no kernels for, or Marlin kernels
/// (CUDA-only) asked for in `extraArgs`.
fn check_vllm_on_amd(
    gpu: &GpuTarget,
    r: &Resolved,
    extra_args: &[String],
    ours: &str,
) -> Result<(), ConfigProblem> {
    let upstream = {
        let p = parse_reference(&r.image);
        p.is("vllm/vllm-openai-rocm") || p.is("rocm/vllm") || p.is("rocm/vllm-dev")
    };
    let unsupported = gpu
        .arch
        .as_deref()
        .is_some_and(|a| !VLLM_ROCM_TARGETS.contains(&a));
    if upstream && unsupported {
        let subject = format!(
            "{} {} on {}{}",
            field(&r.source, Backend::Vllm, gpu),
            r.image,
            gpu.arch.as_deref().unwrap_or_default(),
            gpu.on()
        );
        return Err(ConfigProblem::UnsupportedCombination {
            message: vllm_arch_message(&subject, gpu, ours),
        });
    }
    if let Some(method) = quantization_arg(extra_args).filter(|m| m.contains("marlin")) {
        return Err(ConfigProblem::UnsupportedCombination {
            message: format!(
                "spec.config.extraArgs --quantization {method} selects vLLM's Marlin kernels, which \
                 exist for NVIDIA GPUs only, but this Model runs on AMD GPUs{}: remove it (vLLM \
                 picks its ROCm kernel for the checkpoint's quantization itself)",
                gpu.on()
            ),
        });
    }
    Ok(())
}

/// The value of vLLM's `--quantization` (`-q`) in `args` (lowercase), if given.
pub fn quantization_arg(args: &[String]) -> Option<String> {
    let mut it = args.iter();
    let mut found = None;
    while let Some(a) = it.next() {
        if let Some(v) = a
            .strip_prefix("--quantization=")
            .or_else(|| a.strip_prefix("-q="))
        {
            found = Some(v.to_ascii_lowercase());
        } else if a == "--quantization" || a == "-q" {
            found = it.next().map(|v| v.to_ascii_lowercase());
        }
    }
    found
}
