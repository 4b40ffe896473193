//! The device layer's error types, and the device kinds they name. They live here, below
//! [`crate::device`], so that [`super::QuantError`] can hold them without `error` importing `device`.

/// The kinds of device `GPTQ_DEVICE` can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Hip,
    Cuda,
}

impl DeviceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Cpu => flexinfer_contract::GptqDeviceReport::CPU,
            DeviceKind::Hip => "hip",
            DeviceKind::Cuda => "cuda",
        }
    }
}

/// A device operation that failed (a runtime or kernel error, never a matrix that is not positive definite).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{device}: {op} failed: {message}")]
pub struct DeviceError {
    pub device: String,
    /// The operation (`accumulate`, `prepare`, `factor`, `sweep`, `reset`, …).
    pub op: String,
    pub message: String,
}

impl DeviceError {
    pub fn new(
        device: impl Into<String>,
        op: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        DeviceError {
            device: device.into(),
            op: op.into(),
            message: message.into(),
        }
    }
}

pub type DevResult<T> = std::result::Result<T, DeviceError>;

/// A GPU runtime that answered.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuInfo {
    pub kind: DeviceKind,
    /// The library that was loaded.
    pub library: String,
    pub devices: usize,
    /// Name of device 0.
    pub name: String,
}

/// Why a GPU runtime, or a device on it, cannot be used (the reason in [`select_device`](crate::device::select_device)'s event and
/// in [`QuantError::DeviceUnavailable`](super::QuantError::DeviceUnavailable)).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The CPU was probed as if it were a GPU runtime.
    #[error("not a GPU")]
    NotAGpu,
    /// None of the runtime's libraries could be loaded: each name's loader error, in order.
    #[error("{}", join(.0))]
    NotLoaded(Vec<libloading::Error>),
    /// The runtime lacks an entry point it must have.
    #[error(transparent)]
    MissingSymbol(#[from] libloading::Error),
    /// The runtime answered but reports no device.
    #[error("{library}: no {vendor} device")]
    NoDevice {
        library: String,
        vendor: &'static str,
    },
    /// Initialising the runtime or counting its devices returned an error status.
    #[error("{library}: {calls} returned {code} {status}")]
    Status {
        library: String,
        /// The calls made (`hipInit/hipGetDeviceCount`).
        calls: &'static str,
        /// The status type of the vendor API (`hipError`, `CUresult`).
        code: &'static str,
        status: i32,
    },
    /// The runtime is usable, but the solve session could not be set up on it (context, kernels).
    #[error("opening the solve session failed")]
    Session(#[source] DeviceError),
    /// One of the above (`probe`, printed in full, not a separate cause), with what the device files
    /// say about it ([`crate::device::access::hint`]).
    #[error("{}; {hint}", flexinfer_contract::error::chain(.probe.as_ref()))]
    Hint {
        probe: Box<ProbeError>,
        hint: String,
    },
    /// A usable runtime whose device could not be opened.
    #[error("{} ({} device(s), {}) is usable, but not opened", .info.name, .info.devices, .info.library)]
    NotOpened {
        info: GpuInfo,
        #[source]
        source: Box<ProbeError>,
    },
}

fn join(errors: &[libloading::Error]) -> String {
    let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
    texts.join("; ")
}
