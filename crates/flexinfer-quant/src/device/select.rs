//! `GPTQ_DEVICE=auto|cpu|hip|cuda`: choosing the device, and probing the vendor runtimes with
//! `dlopen` at run time.

use super::{Device, DeviceKind};
use crate::error::QuantError;
use crate::events::{fields, EventSink};
use crate::numerics::linalg::CpuBackend;
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

impl std::str::FromStr for DeviceChoice {
    type Err = QuantError;
    fn from_str(s: &str) -> Result<Self, QuantError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "hip" | "rocm" => Ok(DeviceChoice::Hip),
            "cuda" => Ok(DeviceChoice::Cuda),
            other => Err(QuantError::Input(format!(
                "GPTQ_DEVICE={other:?}: expected auto, cpu, hip or cuda"
            ))),
        }
    }
}

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

/// What [`select_device`] asks of the machine: whether a vendor runtime is usable, and a device on it.
pub trait Platform {
    /// `Err(reason)` when the runtime cannot be loaded or reports no device.
    fn probe(&self, kind: DeviceKind) -> Result<GpuInfo, String>;
    /// A solve device on a usable runtime; `Err(reason)` when this build cannot run on it.
    fn open(&self, info: &GpuInfo) -> Result<Box<dyn Device>, String>;
}

/// The device chosen and why.
pub struct Selection {
    pub device: Box<dyn Device>,
    pub reason: String,
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
    let requested = setting.unwrap_or("auto").trim().to_ascii_lowercase();
    let mut probes: Vec<Value> = Vec::new();
    let attempt = |kind: DeviceKind, probes: &mut Vec<Value>| -> Result<Box<dyn Device>, String> {
        let r = platform.probe(kind).and_then(|info| {
            let name = format!(
                "{} ({} device(s), {})",
                info.name, info.devices, info.library
            );
            platform
                .open(&info)
                .map_err(|e| format!("{name} is usable, but {e}"))
        });
        probes.push(json!({
            "kind": kind.as_str(),
            "usable": r.is_ok(),
            "reason": r.as_ref().err(),
        }));
        r
    };
    let selection = match choice {
        DeviceChoice::Cpu => Selection {
            device: Box::new(CpuBackend::default()),
            reason: "GPTQ_DEVICE=cpu".to_string(),
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
                },
                Err(reason) => {
                    return Err(QuantError::DeviceUnavailable(format!(
                        "GPTQ_DEVICE={}: no {} device this build can use: {reason} (set GPTQ_DEVICE=cpu or auto to run on the CPU)",
                        kind.as_str(),
                        if kind == DeviceKind::Hip { "AMD (HIP)" } else { "NVIDIA (CUDA)" },
                    )))
                }
            }
        }
        DeviceChoice::Auto => {
            let mut reasons = Vec::new();
            let mut picked = None;
            for kind in [DeviceKind::Hip, DeviceKind::Cuda] {
                match attempt(kind, &mut probes) {
                    Ok(device) => {
                        picked = Some(Selection {
                            reason: format!("auto: {} usable", kind.as_str()),
                            device,
                        });
                        break;
                    }
                    Err(r) => reasons.push(format!("{}: {r}", kind.as_str())),
                }
            }
            match picked {
                Some(mut s) => {
                    if !reasons.is_empty() {
                        s.reason = format!("{} ({})", s.reason, reasons.join("; "));
                    }
                    s
                }
                None => Selection {
                    device: Box::new(CpuBackend::default()),
                    reason: format!("auto: no usable GPU ({})", reasons.join("; ")),
                },
            }
        }
    };
    events.emit(
        names::GPTQ_DEVICE_SELECTED,
        fields([
            ("requested", json!(requested)),
            ("device", json!(selection.device.describe())),
            ("kind", json!(selection.device.kind().as_str())),
            ("reason", json!(selection.reason)),
            ("probes", Value::Array(probes)),
        ]),
    );
    Ok(selection)
}

/// The real machine: vendor runtimes found with `dlopen`.
pub struct SystemPlatform;

/// Library names tried for each runtime, in order.
pub const HIP_LIBRARIES: &[&str] = &["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];
pub const CUDA_LIBRARIES: &[&str] = &["libcuda.so.1", "libcuda.so"];

impl Platform for SystemPlatform {
    fn probe(&self, kind: DeviceKind) -> Result<GpuInfo, String> {
        match kind {
            DeviceKind::Cpu => Err("not a GPU".to_string()),
            DeviceKind::Hip => dl::probe_hip(),
            DeviceKind::Cuda => dl::probe_cuda(),
        }
    }
    fn open(&self, info: &GpuInfo) -> Result<Box<dyn Device>, String> {
        Err(format!(
            "this build has no {} solve session yet: the kernels exist as source (kernels/gptq.cu, compiled \
             by the NVRTC test) but their launch code is not written (issue #18)",
            info.kind.as_str()
        ))
    }
}

/// Run-time loading of the vendor runtimes (probing only).
mod dl {
    use super::{DeviceKind, GpuInfo, CUDA_LIBRARIES, HIP_LIBRARIES};
    use libloading::{Library, Symbol};
    use std::ffi::{c_char, c_int, c_uint, CStr};

    fn load(names: &[&str]) -> Result<(Library, String), String> {
        let mut errors = Vec::new();
        for name in names {
            // SAFETY: loading a vendor runtime runs its initialisers; these libraries are made to be loaded
            // by applications at run time.
            match unsafe { Library::new(name) } {
                Ok(lib) => return Ok((lib, name.to_string())),
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(errors.join("; "))
    }

    fn sym<'l, T>(lib: &'l Library, name: &[u8]) -> Result<Symbol<'l, T>, String> {
        // SAFETY: the caller names a symbol of the vendor API with the C signature `T` it declares.
        unsafe { lib.get(name) }.map_err(|e| e.to_string())
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
    type Answer = Result<(c_int, c_int, String), String>;
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

    pub(super) fn probe_hip() -> Result<GpuInfo, String> {
        probe(&Runtime {
            kind: DeviceKind::Hip,
            libraries: HIP_LIBRARIES,
            query: hip_query,
            vendor: "HIP",
            calls: "hipInit/hipGetDeviceCount",
            code: "hipError",
        })
    }

    pub(super) fn probe_cuda() -> Result<GpuInfo, String> {
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
    fn probe(rt: &Runtime) -> Result<GpuInfo, String> {
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
            (0, _, _) => Err(format!("{library}: no {} device", rt.vendor)),
            (rc, _, _) => Err(format!("{library}: {} returned {} {rc}", rt.calls, rt.code)),
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
