//! Why a Model is not deployed, and how its artifact source reads in the `Cached` condition.

use flexinfer_api::conditions::types;
use flexinfer_api::model::ModelPhase;

/// Why a Model is not deployed (or not updated).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigProblem {
    #[error("{0}")]
    InvalidSource(String),
    #[error(
        "Model name {0:?} must be a DNS-1035 label of at most 63 characters (it names the Service)"
    )]
    InvalidName(String),
    #[error(
        "backend {backend} cannot serve {format} artifacts; {format} is served by {supported}"
    )]
    BackendUnsupported {
        format: &'static str,
        backend: &'static str,
        supported: String,
    },
    #[error("{field}: backend {backend} takes no API key; the backends that do: {supported}")]
    BackendKeyUnsupported {
        field: &'static str,
        backend: &'static str,
        supported: String,
    },
    #[error("spec.config.quantization is {model} but ModelCache {cache_name} produces {cache}")]
    QuantizationMismatch {
        model: &'static str,
        cache: &'static str,
        cache_name: String,
    },
    #[error("{0}")]
    SourceUnsupported(String),
    #[error("{0}")]
    GpuProfileNotFound(String),
    /// The serving image is recognisably built for the other GPU vendor.
    #[error("{message}")]
    ImageVendorMismatch { message: String },
    /// Backend, image and GPU are known not to work together.
    #[error("{message}")]
    UnsupportedCombination { message: String },
    /// No serving image for the backend on this GPU.
    #[error("{message}")]
    ImageNotConfigured { message: String },
    #[error("ModelCache {0} not found in this namespace")]
    CacheNotFound(String),
    #[error("ModelCache {name} is {phase}, not Ready; the Model is deployed once it is")]
    CacheNotReady { name: String, phase: String },
    #[error("{0}")]
    CachePathInvalid(String),
    #[error("cannot build the Deployment: {0}")]
    Invalid(String),
    #[error(
        "{kind} {name} already exists and is not controlled by this Model ({owner}); it is left \
         untouched: remove it or give the Model another name"
    )]
    ResourceConflict {
        kind: &'static str,
        name: String,
        owner: String,
    },
}

/// Reason of a child that exists but is not controlled by the Model.
pub const RESOURCE_CONFLICT: &str = "ResourceConflict";

impl ConfigProblem {
    /// Condition type the problem is reported on.
    pub fn condition_type(&self) -> &'static str {
        match self {
            ConfigProblem::CacheNotFound(_)
            | ConfigProblem::CacheNotReady { .. }
            | ConfigProblem::CachePathInvalid(_) => types::CACHED,
            _ => types::CONFIG_VALID,
        }
    }

    /// Condition reason.
    pub fn reason(&self) -> &'static str {
        match self {
            ConfigProblem::InvalidSource(_) => "InvalidSource",
            ConfigProblem::InvalidName(_) => "InvalidName",
            ConfigProblem::BackendUnsupported { .. }
            | ConfigProblem::BackendKeyUnsupported { .. } => {
                flexinfer_api::contract::reasons::BACKEND_UNSUPPORTED
            }
            ConfigProblem::QuantizationMismatch { .. } => "QuantizationMismatch",
            ConfigProblem::SourceUnsupported(_) => "SourceUnsupported",
            ConfigProblem::GpuProfileNotFound(_) => "GPUProfileNotFound",
            ConfigProblem::ImageVendorMismatch { .. } => {
                flexinfer_api::contract::reasons::IMAGE_VENDOR_MISMATCH
            }
            ConfigProblem::UnsupportedCombination { .. } => {
                flexinfer_api::contract::reasons::UNSUPPORTED_COMBINATION
            }
            ConfigProblem::ImageNotConfigured { .. } => {
                flexinfer_api::contract::reasons::IMAGE_NOT_CONFIGURED
            }
            ConfigProblem::CacheNotFound(_) => "CacheNotFound",
            ConfigProblem::CacheNotReady { .. } => {
                flexinfer_api::contract::reasons::CACHE_NOT_READY
            }
            ConfigProblem::CachePathInvalid(_) => "CachePathInvalid",
            ConfigProblem::Invalid(_) => flexinfer_api::contract::reasons::INVALID_SPEC,
            ConfigProblem::ResourceConflict { .. } => RESOURCE_CONFLICT,
        }
    }

    /// Whether the problem also gets a Warning Event of its own (besides the phase change): a child
    /// that is not the Model's, and a serving image that cannot work on the Model's GPU.
    pub fn warns(&self) -> bool {
        matches!(
            self,
            ConfigProblem::ResourceConflict { .. }
                | ConfigProblem::ImageVendorMismatch { .. }
                | ConfigProblem::UnsupportedCombination { .. }
                | ConfigProblem::ImageNotConfigured { .. }
        )
    }

    /// Phase of a Model with this problem: waiting for a cache is `Pending`, the rest `Failed`.
    pub fn phase(&self) -> ModelPhase {
        if self.condition_type() == types::CACHED {
            ModelPhase::Pending
        } else {
            ModelPhase::Failed
        }
    }
}

/// How the `Cached` condition should read for a rendered Model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CachedState {
    /// Hub source: the backend downloads it; no `Cached` condition.
    NotApplicable,
    /// `pvc://` source.
    Pvc,
    /// `modelcache://` source that is Ready.
    CacheReady { name: String },
    /// The cache is being re-processed; the previously served artifact stays in service.
    ServingPrevious { name: String, phase: String },
}

impl CachedState {
    /// `(status, reason, message)`; `None` = no condition.
    pub fn condition(&self, served_path: Option<&str>) -> Option<(bool, &'static str, String)> {
        let path = served_path.unwrap_or("");
        match self {
            CachedState::NotApplicable => None,
            CachedState::Pvc => Some((true, "PVCSource", format!("artifact on PVC {path}"))),
            CachedState::CacheReady { name } => Some((
                true,
                flexinfer_api::contract::reasons::CACHE_READY,
                format!("ModelCache {name} is Ready; serving {path}"),
            )),
            CachedState::ServingPrevious { name, phase } => Some((
                false,
                flexinfer_api::contract::reasons::CACHE_NOT_READY,
                format!("ModelCache {name} is {phase}; still serving the previous artifact {path}"),
            )),
        }
    }
}
