//! `GPTQ_DEVICE=auto|cpu|hip|cuda`: choosing the device, and probing the vendor runtimes with
//! `dlopen` at run time.

use super::{Device, DeviceKind, GpuInfo, ProbeError};
use crate::error::QuantError;
use crate::events::EventSink;
use crate::numerics::linalg::CpuBackend;
use flexinfer_contract::error::chain;
use flexinfer_contract::events as names;
use serde_json::{json, Value};

/// `GPTQ_DEVICE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Hip,
    Cuda,
}

impl DeviceChoice {
    /// The setting's canonical spelling (`auto` for an empty setting, `hip` for `rocm`).
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceChoice::Auto => "auto",
            DeviceChoice::Cpu => flexinfer_contract::GptqDeviceReport::CPU,
            DeviceChoice::Hip => "hip",
            DeviceChoice::Cuda => "cuda",
        }
    }
}

impl std::str::FromStr for DeviceChoice {
    type Err = QuantError;
    fn from_str(s: &str) -> Result<Self, QuantError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "hip" | "rocm" => Ok(DeviceChoice::Hip),
            "cuda" => Ok(DeviceChoice::Cuda),
            other => Err(crate::error::SpecError::Device { got: other.into() }.into()),
        }
    }
}

/// What [`select_device`] asks of the machine: whether a vendor runtime is usable, and a device on it.
pub trait Platform {
    /// Why not, when the runtime cannot be loaded or reports no device.
    fn probe(&self, kind: DeviceKind) -> Result<GpuInfo, ProbeError>;
    /// A solve device on a usable runtime; why not when this build cannot run on it.
    fn open(&self, info: &GpuInfo) -> Result<Box<dyn Device>, ProbeError>;
}

/// The device chosen and why.
pub struct Selection {
    pub device: Box<dyn Device>,
    pub reason: String,
    /// The setting it was chosen for.
    pub requested: DeviceChoice,
}

impl Selection {
    /// What the worker reports of it: the `gptq_device_selected` event's fields (whole) and its
    /// termination message's `gptqDevice` (there [`bounded`](flexinfer_contract::GptqDeviceReport::bounded)).
    pub fn report(&self) -> flexinfer_contract::GptqDeviceReport {
        flexinfer_contract::GptqDeviceReport {
            requested: self.requested.as_str().to_string(),
            device: self.device.describe(),
            kind: self.device.kind().as_str().to_string(),
            reason: self.reason.clone(),
        }
    }
}

/// `GPTQ_DEVICE` → a device. `auto`: HIP if an AMD GPU is usable, else CUDA, else the CPU, with the reason
/// (every probe's answer) in a [`names::GPTQ_DEVICE_SELECTED`] event. `hip`/`cuda` without a usable device:
/// [`QuantError::DeviceUnavailable`] naming the reason. `cpu`: no probe.
pub fn select_device(
    setting: Option<&str>,
    platform: &dyn Platform,
    events: &dyn EventSink,
) -> Result<Selection, QuantError> {
    let choice: DeviceChoice = setting.unwrap_or("auto").parse()?;
    let mut probes: Vec<Value> = Vec::new();
    let attempt =
        |kind: DeviceKind, probes: &mut Vec<Value>| -> Result<Box<dyn Device>, ProbeError> {
            let r = platform.probe(kind).and_then(|info| {
                platform.open(&info).map_err(|e| ProbeError::NotOpened {
                    info,
                    source: Box::new(e),
                })
            });
            probes.push(json!({
                "kind": kind.as_str(),
                "usable": r.is_ok(),
                "reason": r.as_ref().err().map(|e| chain(e)),
            }));
            r
        };
    let selection = match choice {
        DeviceChoice::Cpu => Selection {
            device: Box::new(CpuBackend::default()),
            reason: "GPTQ_DEVICE=cpu".to_string(),
            requested: choice,
        },
        DeviceChoice::Hip | DeviceChoice::Cuda => {
            let kind = if choice == DeviceChoice::Hip {
                DeviceKind::Hip
            } else {
                DeviceKind::Cuda
            };
            match attempt(kind, &mut probes) {
                Ok(device) => Selection {
                    reason: format!("GPTQ_DEVICE={}", kind.as_str()),
                    device,
                    requested: choice,
                },
                Err(reason) => return Err(QuantError::DeviceUnavailable { kind, reason }),
            }
        }
        DeviceChoice::Auto => auto(|kind| attempt(kind, &mut probes)),
    };
    let mut event = match serde_json::to_value(selection.report()) {
        Ok(Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    event.insert("probes".into(), Value::Array(probes));
    events.emit(names::GPTQ_DEVICE_SELECTED, event);
    Ok(selection)
}

/// `auto`: the first of HIP and CUDA that `attempt` opens, else the CPU; the reason names every probe that
/// failed.
fn auto(mut attempt: impl FnMut(DeviceKind) -> Result<Box<dyn Device>, ProbeError>) -> Selection {
    let mut reasons = Vec::new();
    for kind in [DeviceKind::Hip, DeviceKind::Cuda] {
        match attempt(kind) {
            Ok(device) => {
                let mut reason = format!("auto: {} usable", kind.as_str());
                if !reasons.is_empty() {
                    reason = format!("{reason} ({})", reasons.join("; "));
                }
                return Selection {
                    device,
                    reason,
                    requested: DeviceChoice::Auto,
                };
            }
            Err(r) => reasons.push(format!("{}: {}", kind.as_str(), chain(&r))),
        }
    }
    Selection {
        device: Box::new(CpuBackend::default()),
        reason: format!("auto: no usable GPU ({})", reasons.join("; ")),
        requested: DeviceChoice::Auto,
    }
}

/// The device memory an input group may use: `fraction` of `GPU_VRAM_MB` when it is set (gfx906 cards
/// report their memory unreliably), else of the total the runtime reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryBudget {
    /// `GPU_VRAM_MB`.
    pub vram_mb: Option<u64>,
    /// `GPU_MEMORY_FRACTION` (0 < f ≤ 1; the CRD's default is 0.80).
    pub fraction: f64,
}

impl Default for MemoryBudget {
    fn default() -> Self {
        MemoryBudget {
            vram_mb: None,
            fraction: 0.8,
        }
    }
}

impl MemoryBudget {
    /// The budget in bytes given the runtime's reported total; `None` when neither is known.
    pub fn bytes(&self, reported_total: Option<u64>) -> Option<u64> {
        let total = self.vram_mb.map(|mb| mb << 20).or(reported_total)?;
        Some((total as f64 * self.fraction.clamp(0.0, 1.0)) as u64)
    }
}

/// `GPTQ_VENDOR_LIBS`: whether a GPU session loads the vendor's BLAS and solver libraries (cuBLAS and
/// cuSOLVER, rocBLAS and rocSOLVER) where they are installed, for the Hessian, the factorisation and the
/// block update (`auto`, the default), or runs the kernels of `gptq.cu` for everything (`off`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VendorLibs {
    #[default]
    Auto,
    Off,
}

/// A [`VendorLibs`] setting that is neither `auto` nor `off`.
#[derive(Debug, thiserror::Error)]
#[error("{got:?}: expected auto or off")]
pub struct VendorLibsError {
    pub got: String,
}

impl std::str::FromStr for VendorLibs {
    type Err = VendorLibsError;
    fn from_str(s: &str) -> Result<Self, VendorLibsError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(VendorLibs::Auto),
            "off" => Ok(VendorLibs::Off),
            other => Err(VendorLibsError { got: other.into() }),
        }
    }
}

/// The real machine: vendor runtimes found with `dlopen`, solve sessions on
/// [`super::driver::DriverVendor`].
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemPlatform {
    pub budget: MemoryBudget,
    pub vendor_libs: VendorLibs,
}

/// Library names tried for each runtime, in order.
pub const HIP_LIBRARIES: &[&str] = &["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];
pub const CUDA_LIBRARIES: &[&str] = &["libcuda.so.1", "libcuda.so"];

impl Platform for SystemPlatform {
    fn probe(&self, kind: DeviceKind) -> Result<GpuInfo, ProbeError> {
        match kind {
            DeviceKind::Cpu => Err(ProbeError::NotAGpu),
            DeviceKind::Hip => dl::probe_hip()
                .map_err(|e| super::access::explain(kind, e, std::path::Path::new("/dev"))),
            DeviceKind::Cuda => dl::probe_cuda()
                .map_err(|e| super::access::explain(kind, e, std::path::Path::new("/dev"))),
        }
    }
    fn open(&self, info: &GpuInfo) -> Result<Box<dyn Device>, ProbeError> {
        Ok(Box::new(self.kernel_device(info)?))
    }
}

impl SystemPlatform {
    /// The solve device on the runtime that `info` names, with this platform's memory budget: what
    /// [`Platform::open`] returns boxed; `examples/gpu_check/` drives its steps directly.
    pub fn kernel_device(
        &self,
        info: &GpuInfo,
    ) -> Result<super::kernel::KernelDevice<super::driver::DriverVendor>, ProbeError> {
        use super::driver::DriverVendor;
        use super::kernel::{KernelDevice, Vendor};
        let libraries = match info.kind {
            DeviceKind::Hip => HIP_LIBRARIES,
            DeviceKind::Cuda => CUDA_LIBRARIES,
            DeviceKind::Cpu => return Err(ProbeError::NotAGpu),
        };
        let mut vendor = DriverVendor::open(
            info.kind,
            libraries,
            &info.name,
            self.vendor_libs == VendorLibs::Auto,
        )
        .map_err(ProbeError::Session)?;
        let budget = self.budget.bytes(vendor.memory().map(|(_, total)| total));
        Ok(KernelDevice::new(vendor, info.kind, budget))
    }
}

/// Run-time loading of the vendor runtimes (probing only).
mod dl {
    use super::{DeviceKind, GpuInfo, ProbeError, CUDA_LIBRARIES, HIP_LIBRARIES};
    use libloading::{Library, Symbol};
    use std::ffi::{c_char, c_int, c_uint, CStr};

    fn load(names: &[&str]) -> Result<(Library, String), ProbeError> {
        let mut errors = Vec::new();
        for name in names {
            // SAFETY: loading a vendor runtime runs its initialisers; these libraries are made to be loaded
            // by applications at run time.
            match unsafe { Library::new(name) } {
                Ok(lib) => return Ok((lib, name.to_string())),
                Err(e) => errors.push(e),
            }
        }
        Err(ProbeError::NotLoaded(errors))
    }

    fn sym<'l, T>(lib: &'l Library, name: &[u8]) -> Result<Symbol<'l, T>, ProbeError> {
        // SAFETY: the caller names a symbol of the vendor API with the C signature `T` it declares.
        Ok(unsafe { lib.get(name) }?)
    }

    fn name_from(buf: &[c_char]) -> String {
        // SAFETY: the buffer is zeroed beforehand and the runtime writes a NUL-terminated string shorter than it.
        let mut b = buf.to_vec();
        if let Some(last) = b.last_mut() {
            *last = 0;
        }
        unsafe { CStr::from_ptr(b.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    type InitFn = unsafe extern "C" fn(c_uint) -> c_int;
    /// `(status, device count, name of device 0)`, or why the runtime's entry points are missing.
    type Answer = Result<(c_int, c_int, String), ProbeError>;
    type CountFn = unsafe extern "C" fn(*mut c_int) -> c_int;

    /// A vendor runtime: where to find it, how to ask it for its devices, and how its errors read.
    struct Runtime {
        kind: DeviceKind,
        libraries: &'static [&'static str],
        query: fn(&Library) -> Answer,
        vendor: &'static str,
        calls: &'static str,
        code: &'static str,
    }

    pub(super) fn probe_hip() -> Result<GpuInfo, ProbeError> {
        probe(&Runtime {
            kind: DeviceKind::Hip,
            libraries: HIP_LIBRARIES,
            query: hip_query,
            vendor: "HIP",
            calls: "hipInit/hipGetDeviceCount",
            code: "hipError",
        })
    }

    pub(super) fn probe_cuda() -> Result<GpuInfo, ProbeError> {
        probe(&Runtime {
            kind: DeviceKind::Cuda,
            libraries: CUDA_LIBRARIES,
            query: cuda_query,
            vendor: "CUDA",
            calls: "cuInit/cuDeviceGetCount",
            code: "CUresult",
        })
    }

    /// Loads the runtime and turns its answer into a usable device or the reason it is not one.
    fn probe(rt: &Runtime) -> Result<GpuInfo, ProbeError> {
        let (lib, library) = load(rt.libraries)?;
        let answer = (rt.query)(&lib);
        // The runtime stays loaded (unloading a GPU runtime after init is not supported by every vendor).
        std::mem::forget(lib);
        match answer? {
            (0, n, name) if n > 0 => Ok(GpuInfo {
                kind: rt.kind,
                library,
                devices: n as usize,
                name,
            }),
            (0, _, _) => Err(ProbeError::NoDevice {
                library,
                vendor: rt.vendor,
            }),
            (status, _, _) => Err(ProbeError::Status {
                library,
                calls: rt.calls,
                code: rt.code,
                status,
            }),
        }
    }

    /// `init(0)`, the device count, and (when there is a device) the name `name` writes into a zeroed
    /// buffer: `(status, device count, name)`.
    fn first_device(
        init: InitFn,
        count: CountFn,
        name: impl FnOnce(&mut [c_char]),
    ) -> (c_int, c_int, String) {
        // SAFETY: C calls of the runtime's entry points with their C signatures and a valid out-pointer.
        let (rc, n) = unsafe {
            let rc = init(0);
            let mut n: c_int = 0;
            let rc = if rc == 0 { count(&mut n) } else { rc };
            (rc, n)
        };
        let mut buf = [0 as c_char; 256];
        if rc == 0 && n > 0 {
            name(&mut buf);
        }
        (rc, n, name_from(&buf))
    }

    fn hip_query(lib: &Library) -> Answer {
        let init: Symbol<InitFn> = sym(lib, b"hipInit\0")?;
        let count: Symbol<CountFn> = sym(lib, b"hipGetDeviceCount\0")?;
        let get_name: Symbol<unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int> =
            sym(lib, b"hipDeviceGetName\0")?;
        Ok(first_device(*init, *count, |buf| {
            // SAFETY: a valid buffer and its length, per the HIP runtime API.
            unsafe {
                get_name(buf.as_mut_ptr(), buf.len() as c_int, 0);
            }
        }))
    }

    fn cuda_query(lib: &Library) -> Answer {
        let init: Symbol<InitFn> = sym(lib, b"cuInit\0")?;
        let count: Symbol<CountFn> = sym(lib, b"cuDeviceGetCount\0")?;
        let get: Symbol<unsafe extern "C" fn(*mut c_int, c_int) -> c_int> =
            sym(lib, b"cuDeviceGet\0")?;
        let get_name: Symbol<unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int> =
            sym(lib, b"cuDeviceGetName\0")?;
        Ok(first_device(*init, *count, |buf| {
            // SAFETY: valid out-pointers and a buffer with its length, per the CUDA driver API.
            unsafe {
                let mut dev: c_int = 0;
                if get(&mut dev, 0) == 0 {
                    get_name(buf.as_mut_ptr(), buf.len() as c_int, dev);
                }
            }
        }))
    }
}
