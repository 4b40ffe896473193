//! Typed errors of the quantization engine.

use std::path::PathBuf;

use crate::device::{DeviceError, DeviceKind, ProbeError};

/// Everything that can go wrong in the engine. `Input` means the caller handed us something we cannot quantize
/// (bad model, bad config, bad dataset): the worker maps it to exit code 2.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("invalid input: {0}")]
    Input(String),
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("safetensors error in {path}: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("JSON error in {path}: {message}")]
    Json { path: PathBuf, message: String },
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    #[error("numerical failure: {0}")]
    Numeric(String),
    /// The RTN-fallback gate rejected the run; nothing was written to the output directory.
    #[error("RTN fallback gate failed: {} of {} modules ({:.1}%) fell back to RTN, limit {:.1}%", .0.rtn_fallback_modules, .0.gptq_modules + .0.rtn_fallback_modules, .0.rtn_fallback_percent, .0.max_rtn_fallback_percent)]
    GateFailed(flexinfer_contract::files::QualitySummary),
    /// The requested GPTQ device cannot be used (`GPTQ_DEVICE`); configuration, so the worker exits 2.
    #[error(
        "GPTQ device unavailable: GPTQ_DEVICE={}: no {} device this build can use: {reason} (set GPTQ_DEVICE=cpu or auto to run on the CPU)",
        .kind.as_str(),
        if *.kind == DeviceKind::Hip { "AMD (HIP)" } else { "NVIDIA (CUDA)" }
    )]
    DeviceUnavailable {
        kind: DeviceKind,
        #[source]
        reason: ProbeError,
    },
    /// A device operation failed where no CPU fallback was possible.
    #[error("GPTQ device failure: {0}")]
    Device(#[from] DeviceError),
    /// A device operation failed after the Hessian's host copy was gone: the module cannot finish
    /// on the CPU.
    #[error(
        "GPTQ device failure: {module}: {source}; no host copy of the Hessian to finish on the CPU"
    )]
    DeviceLost {
        module: String,
        #[source]
        source: DeviceError,
    },
    #[error("aborted by test hook after layer {0}")]
    TestAbort(usize),
}

impl QuantError {
    /// True when the error is the caller's fault (bad model, config, or dataset).
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            QuantError::Input(_)
                | QuantError::Safetensors { .. }
                | QuantError::Json { .. }
                | QuantError::Tokenizer(_)
                | QuantError::DeviceUnavailable { .. }
        )
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        QuantError::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, QuantError>;
