//! What each phase runs where: enabled phases, GPUProfile and node selector, image
//! resolution, the per-phase spec hashes (docs/dev/architecture.md, "The ModelCache pipeline") and the directories inside the cache volume.

use std::collections::BTreeMap;

use flexinfer_api::contract::{self, env, labels, JobPhase};
use flexinfer_api::gpuprofile::{GPUProfile, GpuVendor};
use flexinfer_api::modelcache::{ModelCache, ModelCacheStatus, QuantFormat};
use sha2::{Digest, Sha256};

use super::config::Config;

/// Pipeline phases a cache runs, in order.
pub fn enabled_phases(mc: &ModelCache) -> Vec<JobPhase> {
    let mut v = vec![JobPhase::Download];
    if mc.spec.abliteration.is_some() {
        v.push(JobPhase::Abliterate);
    }
    if mc.spec.quantization.is_some() {
        v.push(JobPhase::Quantize);
    }
    if mc.spec.publish.is_some() {
        v.push(JobPhase::Publish);
    }
    v
}

/// Whether a phase runs on a GPU node. A quantization whose engine has no GPU path (`FormatInfo::gpu_engine`:
/// GGUF's block search runs on the CPU) runs on a CPU node whatever `useGPU` says
/// (docs/user/quantization-pipelines.md).
pub fn uses_gpu(mc: &ModelCache, phase: JobPhase) -> bool {
    match phase {
        JobPhase::Abliterate => mc.spec.abliteration.as_ref().is_some_and(|a| a.use_gpu),
        JobPhase::Quantize => mc
            .spec
            .quantization
            .as_ref()
            .is_some_and(|q| q.use_gpu && flexinfer_api::formats::info(q.format).gpu_engine),
        _ => false,
    }
}

fn phase_node_selector(mc: &ModelCache, phase: JobPhase) -> Option<BTreeMap<String, String>> {
    let own = match phase {
        JobPhase::Abliterate => mc
            .spec
            .abliteration
            .as_ref()
            .and_then(|a| a.node_selector.clone()),
        JobPhase::Quantize => mc
            .spec
            .quantization
            .as_ref()
            .and_then(|q| q.node_selector.clone()),
        _ => None,
    };
    own.filter(|m| !m.is_empty())
        .or_else(|| mc.spec.node_selector.clone().filter(|m| !m.is_empty()))
}

/// GPU architectures a cache's phases select (used to map GPUProfile changes to caches).
pub fn cache_arches(mc: &ModelCache) -> Vec<String> {
    let mut out: Vec<String> = JobPhase::ALL
        .into_iter()
        .filter_map(|p| phase_node_selector(mc, p))
        .filter_map(|m| m.get(labels::GPU_ARCH).cloned())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Whether a GPUProfile change can affect a cache: same namespace and either a phase selects the
/// profile's architecture, or a GPU phase selects no architecture (then the namespace's only
/// profile applies).
pub fn profile_affects(mc: &ModelCache, profile: &GPUProfile) -> bool {
    if mc.metadata.namespace != profile.metadata.namespace {
        return false;
    }
    let arches = cache_arches(mc);
    if arches.is_empty() {
        return JobPhase::ALL.iter().any(|p| uses_gpu(mc, *p));
    }
    arches.contains(&profile.spec.architecture)
        || profile
            .metadata
            .name
            .as_ref()
            .is_some_and(|n| arches.contains(n))
}

/// Whether a node selector pins pods to GPU nodes: it names a GPU architecture, or it contains
/// every label of some GPUProfile's node selector.
pub fn selects_gpu_nodes(sel: &BTreeMap<String, String>, profiles: &[GPUProfile]) -> bool {
    sel.contains_key(labels::GPU_ARCH)
        || profiles.iter().any(|p| {
            let ps = p.spec.effective_node_selector();
            !ps.is_empty() && ps.iter().all(|(k, v)| sel.get(k) == Some(v))
        })
}

/// Where and with what a phase runs.
#[derive(Debug, Clone)]
pub struct PhaseTarget {
    pub phase: JobPhase,
    pub gpu: bool,
    /// GPUProfile that applies (GPU phases only).
    pub profile: Option<GPUProfile>,
    pub arch: Option<String>,
    pub node_selector: BTreeMap<String, String>,
    /// The pod is pinned to GPU nodes: a GPU phase, or a node selector that names a GPU
    /// architecture or contains a GPUProfile's node selector. Such pods get the default GPU
    /// toleration (`dedicated=gpu:NoSchedule`), whatever their phase.
    pub gpu_pinned: bool,
    /// Resolved image; `Err` names what to configure.
    pub image: Result<String, ImageError>,
}

/// No image is configured for a phase; the text (the `ImageNotConfigured` condition message)
/// names what to set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error(
        "no worker image: set {} on the controller",
        env::controller::WORKER_IMAGE
    )]
    NoWorkerImage,
    #[error(
        "no {format} quantizer image for arch {}: set GPUProfile spec.quantization.images.{format}, {} or {}",
        .arch.as_deref().unwrap_or("<none>"),
        env::controller::QUANTIZER_GPTQ_IMAGE,
        env::controller::quantizer_format_image(.format)
    )]
    NoQuantizerImage {
        format: &'static str,
        arch: Option<String>,
    },
}

/// Resolve profile, arch, node selector and image of one phase (first hit wins: GPUProfile images, controller env, chart value).
pub fn resolve_target(
    mc: &ModelCache,
    phase: JobPhase,
    profiles: &[GPUProfile],
    config: &Config,
) -> PhaseTarget {
    let gpu = uses_gpu(mc, phase);
    let sel = phase_node_selector(mc, phase);
    let sel_arch = sel.as_ref().and_then(|m| m.get(labels::GPU_ARCH).cloned());
    let profile = if gpu {
        match &sel_arch {
            Some(a) => profiles
                .iter()
                .find(|p| &p.spec.architecture == a)
                .or_else(|| {
                    profiles
                        .iter()
                        .find(|p| p.metadata.name.as_deref() == Some(a))
                })
                .cloned(),
            // No arch in the selector: the namespace's only GPUProfile, if there is exactly one.
            None if profiles.len() == 1 => profiles.first().cloned(),
            None => None,
        }
    } else {
        None
    };
    let arch = sel_arch.or_else(|| profile.as_ref().map(|p| p.spec.architecture.clone()));
    let node_selector = sel
        .or_else(|| profile.as_ref().map(|p| p.spec.effective_node_selector()))
        .unwrap_or_default();
    let image = resolve_image(mc, phase, profile.as_ref(), arch.as_deref(), config);
    let gpu_pinned = gpu || selects_gpu_nodes(&node_selector, profiles);
    PhaseTarget {
        phase,
        gpu,
        gpu_pinned,
        profile,
        arch,
        node_selector,
        image,
    }
}

fn resolve_image(
    mc: &ModelCache,
    phase: JobPhase,
    profile: Option<&GPUProfile>,
    arch: Option<&str>,
    config: &Config,
) -> Result<String, ImageError> {
    let worker = || config.worker_image.clone().ok_or(ImageError::NoWorkerImage);
    let format = match phase {
        JobPhase::Download | JobPhase::Publish => return worker(),
        JobPhase::Abliterate if !uses_gpu(mc, phase) => return worker(),
        // GPU abliteration runs in the GPU worker image of the arch (the GPTQ image).
        JobPhase::Abliterate => QuantFormat::Gptq,
        JobPhase::Quantize => match &mc.spec.quantization {
            Some(q) => q.format,
            None => return worker(),
        },
    };
    let fname = flexinfer_api::formats::info(format).name;
    // compressed-tensors is the GPTQ solve in another container: without an image of its own it runs
    // in the GPTQ image (the GPU worker of the arch).
    let mut names = vec![fname];
    if format == QuantFormat::CompressedTensors {
        names.push(flexinfer_api::formats::info(QuantFormat::Gptq).name);
    }
    if let Some(img) = names.iter().find_map(|n| {
        profile
            .and_then(|p| p.spec.quantization.as_ref())
            .and_then(|q| q.images.get(*n))
            .filter(|s| !s.trim().is_empty())
    }) {
        return Ok(img.trim().to_string());
    }
    let env_get = |k: &str| config.image_env.get(k).cloned();
    if let Some(i) = (format == QuantFormat::CompressedTensors)
        .then(|| env_get(&env::controller::quantizer_format_image(fname)))
        .flatten()
    {
        return Ok(i);
    }
    if matches!(format, QuantFormat::Gptq | QuantFormat::CompressedTensors) {
        let amd = profile
            .map(|p| p.spec.vendor == GpuVendor::Amd)
            .unwrap_or(false)
            || arch.is_some_and(|a| a.starts_with("gfx"));
        if amd {
            if let Some(i) =
                arch.and_then(|a| env_get(&env::controller::quantizer_gptq_rocm_arch_image(a)))
            {
                return Ok(i);
            }
            if let Some(i) = env_get(env::controller::QUANTIZER_GPTQ_ROCM_IMAGE) {
                return Ok(i);
            }
        } else if let Some(i) = env_get(env::controller::QUANTIZER_GPTQ_IMAGE) {
            return Ok(i);
        }
    }
    if let Some(i) = env_get(&env::controller::quantizer_format_image(fname)) {
        return Ok(i);
    }
    if flexinfer_api::formats::info(format).implemented {
        // One worker binary holds every built-in engine: fall back to the worker image.
        if let Some(i) = config.worker_image.clone() {
            return Ok(i);
        }
    }
    Err(ImageError::NoQuantizerImage {
        format: fname,
        arch: arch.map(str::to_string),
    })
}

/// JSON with object keys sorted at every level (serde_json's default map is ordered, but the
/// `preserve_order` feature may be switched on by another crate in the build).
pub fn canonical_json(v: &serde_json::Value) -> String {
    fn canon(v: &serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::Object(m) => {
                let sorted: BTreeMap<&String, serde_json::Value> =
                    m.iter().map(|(k, v)| (k, canon(v))).collect();
                let mut out = serde_json::Map::new();
                for (k, v) in sorted {
                    out.insert(k.clone(), v);
                }
                serde_json::Value::Object(out)
            }
            serde_json::Value::Array(a) => serde_json::Value::Array(a.iter().map(canon).collect()),
            other => other.clone(),
        }
    }
    serde_json::to_string(&canon(v)).unwrap_or_default()
}

/// The part of the spec a phase's output depends on. Settings that only change how a run is carried out
/// (deadlines, memory limits, GPU memory fraction, node selection) are left out: editing them never
/// replaces a running Job or re-runs a finished phase; they apply to the next attempt.
pub fn phase_inputs(mc: &ModelCache, phase: JobPhase) -> serde_json::Value {
    let mut v = legacy_phase_inputs(mc, phase);
    let drop: &[&str] = match phase {
        JobPhase::Download => &[],
        JobPhase::Abliterate => &["maxMemoryGB", "maxMemoryGb", "nodeSelector"],
        JobPhase::Quantize => &[
            "maxMemoryGB",
            "maxMemoryGb",
            "timeoutSeconds",
            "nodeSelector",
            "gpuMemoryFraction",
        ],
        JobPhase::Publish => &["timeoutSeconds"],
    };
    if let Some(o) = v.as_object_mut() {
        for k in drop {
            o.remove(*k);
        }
    }
    if phase == JobPhase::Download {
        if let Some(d) = v.get_mut("download").and_then(|d| d.as_object_mut()) {
            for k in ["timeoutSeconds", "maxMemoryGB", "maxMemoryGb"] {
                d.remove(k);
            }
        }
    }
    v
}

/// The inputs as hashed before run-only settings were left out: a phase completed under that hash is
/// still current (no re-run after an upgrade).
fn legacy_phase_inputs(mc: &ModelCache, phase: JobPhase) -> serde_json::Value {
    let s = &mc.spec;
    match phase {
        JobPhase::Download => serde_json::json!({
            "source": s.source, "revision": s.revision, "modelPath": s.model_path,
            "download": j(&s.download),
            // The calibration dataset is fetched by the download phase (for the formats that read one).
            "dataset": s.quantization.as_ref()
                .filter(|q| reads_calibration(q))
                .map(|q| q.effective_calibration().dataset),
        }),
        JobPhase::Abliterate => j(&s.abliteration),
        JobPhase::Quantize => j(&s.quantization),
        JobPhase::Publish => j(&s.publish),
    }
}

fn j<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

/// `sha256(canonical JSON of the phase inputs + "|" + image)`, first 16 hex characters. For
/// quantization this is `quantSpecHashWithImage` over `spec.quantization` (the hash the status records).
pub fn spec_hash(mc: &ModelCache, phase: JobPhase, image: &str) -> String {
    hash_inputs(&phase_inputs(mc, phase), image)
}

/// [`spec_hash`] as computed before run-only settings were left out of it.
pub fn legacy_spec_hash(mc: &ModelCache, phase: JobPhase, image: &str) -> String {
    hash_inputs(&legacy_phase_inputs(mc, phase), image)
}

fn hash_inputs(inputs: &serde_json::Value, image: &str) -> String {
    let mut h = Sha256::new();
    h.update(canonical_json(inputs).as_bytes());
    h.update(b"|");
    h.update(image.as_bytes());
    hex::encode(h.finalize())[..16].to_string()
}

/// Directory of the cache inside the PVC.
pub fn model_dir(mc: &ModelCache) -> String {
    let name = mc.metadata.name.clone().unwrap_or_default();
    mc.spec.model_dir_name(&name).trim_matches('/').to_string()
}

/// Base output directory of a phase (relative to the PVC root), without a generation:
/// `<modelPath>/source`, `<modelPath>/abliterated`, `<modelPath>/gptq-w4-g128`.
pub fn output_base(mc: &ModelCache, phase: JobPhase) -> Option<String> {
    let base = model_dir(mc);
    match phase {
        JobPhase::Download => Some(format!("{base}/{}", contract::SOURCE_SUBDIR)),
        JobPhase::Abliterate => Some(format!("{base}/{}", contract::ABLITERATED_SUBDIR)),
        JobPhase::Quantize => mc
            .spec
            .quantization
            .as_ref()
            .map(|q| format!("{base}/{}", q.output_subdir())),
        _ => None,
    }
}

/// Generation of the run in flight (or last run) of a phase that writes generations.
pub fn generation(st: &ModelCacheStatus, phase: JobPhase) -> Option<String> {
    match phase {
        JobPhase::Download => st.download.as_ref().and_then(|d| d.generation.clone()),
        JobPhase::Abliterate => st
            .abliteration
            .as_ref()
            .and_then(|a| a.generations.generation.clone()),
        JobPhase::Quantize => st
            .quantization
            .as_ref()
            .and_then(|q| q.generations.generation.clone()),
        _ => None,
    }
}

/// The promoted output of a phase (what later phases read and Models serve), if any.
pub fn promoted_dir(st: &ModelCacheStatus, phase: JobPhase) -> Option<String> {
    match phase {
        JobPhase::Download => st.download.as_ref().and_then(|d| d.output_dir.clone()),
        JobPhase::Abliterate => st.abliteration.as_ref().and_then(|a| a.output_dir.clone()),
        JobPhase::Quantize => st.quantization.as_ref().and_then(|q| q.output_dir.clone()),
        _ => None,
    }
    .filter(|d| !d.is_empty())
}

/// The downloaded model's directory: the promoted download generation, else `<modelPath>` itself (a
/// cache downloaded before downloads had generations).
pub fn source_dir(mc: &ModelCache, st: &ModelCacheStatus) -> String {
    promoted_output(mc, st, JobPhase::Download).unwrap_or_else(|| model_dir(mc))
}

/// A cache downloaded before downloads had generations: status records a downloaded revision (set on
/// every successful download) but no `download.outputDir`, and the files are in `<modelPath>` itself,
/// which is then its promoted download.
pub fn legacy_download_root(mc: &ModelCache, st: &ModelCacheStatus) -> Option<String> {
    st.download
        .as_ref()
        .filter(|d| d.output_dir.is_none() && d.revision.is_some())
        .map(|_| model_dir(mc))
}

/// [`promoted_dir`], with a pre-generation download's `<modelPath>` as the promoted download.
pub fn promoted_output(mc: &ModelCache, st: &ModelCacheStatus, phase: JobPhase) -> Option<String> {
    promoted_dir(st, phase).or_else(|| match phase {
        JobPhase::Download => legacy_download_root(mc, st),
        _ => None,
    })
}

/// Earlier outputs of a phase still on disk, newest first.
pub fn previous_dirs(st: &ModelCacheStatus, phase: JobPhase) -> Vec<String> {
    match phase {
        JobPhase::Download => st
            .download
            .as_ref()
            .and_then(|d| d.previous_output_dirs.clone()),
        JobPhase::Abliterate => st
            .abliteration
            .as_ref()
            .and_then(|a| a.generations.previous_output_dirs.clone()),
        JobPhase::Quantize => st
            .quantization
            .as_ref()
            .and_then(|q| q.generations.previous_output_dirs.clone()),
        JobPhase::Publish => None,
    }
    .unwrap_or_default()
}

/// Relative (to the PVC root) input and output directories of a phase run. Download, abliteration and
/// quantization write a new generation (`<base>.<generation>` from status); a phase reads the promoted
/// output of the phase before it. The download's "input" is `<modelPath>`, where it keeps the hub
/// datasets (`.datasets/`) that later phases find beside their input.
pub fn phase_dirs(mc: &ModelCache, st: &ModelCacheStatus, phase: JobPhase) -> (String, String) {
    let base = model_dir(mc);
    let out = |p: JobPhase| {
        let b = output_base(mc, p).unwrap_or_else(|| base.clone());
        contract::files::generation_dir(&b, generation(st, p).as_deref())
    };
    let source = source_dir(mc, st);
    let ablit_in = promoted_dir(st, JobPhase::Abliterate)
        .unwrap_or_else(|| format!("{base}/{}", contract::ABLITERATED_SUBDIR));
    let quant_in = if mc.spec.abliteration.is_some() {
        ablit_in
    } else {
        source.clone()
    };
    match phase {
        JobPhase::Download => (base.clone(), out(JobPhase::Download)),
        JobPhase::Abliterate => (source, out(JobPhase::Abliterate)),
        JobPhase::Quantize => (quant_in, out(JobPhase::Quantize)),
        JobPhase::Publish => {
            let art = artifact_dir(mc, st);
            (art.clone(), art)
        }
    }
}

/// Directory (relative to the PVC root) of the artifact serving uses: the promoted output of the last
/// phase that writes one.
pub fn artifact_dir(mc: &ModelCache, st: &ModelCacheStatus) -> String {
    let base = model_dir(mc);
    let last = if mc.spec.quantization.is_some() {
        JobPhase::Quantize
    } else if mc.spec.abliteration.is_some() {
        JobPhase::Abliterate
    } else {
        return source_dir(mc, st);
    };
    promoted_dir(st, last)
        .or_else(|| output_base(mc, last))
        .unwrap_or(base)
}

/// Whether the quantize phase reads a calibration set: always for the formats that need one (GPTQ), and for
/// GGUF when the spec sets `calibration` (the importance matrix of the block search).
pub fn reads_calibration(q: &flexinfer_api::modelcache::QuantizationSpec) -> bool {
    flexinfer_api::formats::info(q.format).needs_calibration
        || (q.format == QuantFormat::Gguf && q.calibration.is_some())
}
