//! Where an input group's whole GPTQ solve runs (docs/dev/gptq-device.md).
//!
//! [`crate::linalg::LinalgBackend`] is the per-operation interface: every call takes host matrices. A GPU that
//! received H, W and the factor across the bus for each call would spend most of its time copying, so the
//! pipeline talks to a [`Device`] instead: [`Device::open`] gives a [`Session`] that owns the group's buffers
//! (on the device, for a GPU), [`Session::accumulate`] uploads one calibration batch and adds its `xᵀx`, and
//! [`Session::solve`] does everything after it (mirror, sanitise, dead columns, act-order, the damp/floor
//! recovery attempts, the sweep factor, the lazy-batch sweep and block updates of every module of the group)
//! with one upload of each module's W and one download of its codes and scales.
//!
//! Backends:
//! - [`CpuBackend`] is a [`Device`] whose session runs the existing CPU code (bit-identical to calling
//!   [`crate::hessian::prepare_factor`] and [`crate::gptq::gptq_quantize_in`] directly).
//! - A device whose buffers live elsewhere implements the smaller [`DeviceOps`]; [`OpsSession`] turns it into a
//!   [`Session`] with the recovery rules of a real card: a failed operation (not a failed factorisation, which
//!   is numerical and handled by the damp/floor loop) resets the device context, restores the prepared Hessian
//!   from the host checkpoint and retries; after [`MAX_DEVICE_RESETS`] resets the error goes to
//!   [`solve_with_fallback`], which solves the group on the CPU from the same checkpoint and says so in an event.
//! - [`fake::FakeDevice`] is such a device on the host, with scripted failures (tests).
//!
//! [`select_device`] implements `GPTQ_DEVICE=auto|cpu|hip|cuda`; [`SystemPlatform`] looks for vendor runtimes
//! with `dlopen` at run time, so the binary needs no GPU SDK to build, link or run.

use crate::error::QuantError;
use crate::events::{fields, EventSink};
use crate::gptq::{gptq_quantize_in, rtn_quantize, QuantizedLinear, Workspace};
use crate::hessian::{prepare_factor, recover, FactorOutcome, PreparedFactor, PreparedHessian};
use crate::linalg::{CpuBackend, LinalgBackend};
use crate::params::{GptqParams, RecoveryParams};
use faer::{Mat, MatRef};
use flexinfer_contract::events as names;
use serde_json::{json, Value};

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
            DeviceKind::Cpu => "cpu",
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

impl From<DeviceError> for QuantError {
    fn from(e: DeviceError) -> Self {
        QuantError::Device(e.to_string())
    }
}

pub type DevResult<T> = std::result::Result<T, DeviceError>;

/// What the solve of one input group needs besides its buffers.
#[derive(Clone, Copy, Debug)]
pub struct SolveSpec<'a> {
    pub params: &'a GptqParams,
    pub recovery: &'a RecoveryParams,
    /// The group's module names (comma list), for events.
    pub module: &'a str,
}

/// Something that runs whole input-group solves.
pub trait Device: Send + Sync {
    /// Names the device in events and logs (`cpu-faer`, `cuda:0 NVIDIA …`).
    fn describe(&self) -> String;
    fn kind(&self) -> DeviceKind;
    /// Buffers for one input group whose modules have `n` input features (the Hessian is n × n).
    fn open(&self, n: usize) -> DevResult<Box<dyn Session + '_>>;
}

/// One input group's solve: accumulation batches, then one [`Session::solve`].
pub trait Session {
    /// `H += alpha · xᵀx` for activations `x` (`[tokens, n]`): one upload of `x`.
    fn accumulate(&mut self, x: MatRef<'_, f32>, alpha: f32) -> DevResult<()>;
    /// The rest of the group's GPTQ: preparation, recovery loop, sweep factor and the sweep of each of
    /// `weights` (`[out, n]`, one upload each), results in the same order (one download each). Recovery that
    /// is exhausted gives RTN results, as on the CPU. Called once.
    fn solve(
        &mut self,
        weights: &[&Mat<f32>],
        spec: &SolveSpec<'_>,
        events: &dyn EventSink,
    ) -> DevResult<Vec<QuantizedLinear>>;
    /// After `solve` failed: the prepared Hessian as the host has it, for the CPU to finish the group; `None`
    /// when the failure came before the host had a copy.
    fn fallback_hessian(&mut self) -> Option<PreparedHessian>;
}

// ---------------------------------------------------------------------------------------------------------
// CPU

impl Device for CpuBackend {
    fn describe(&self) -> String {
        LinalgBackend::name(self).to_string()
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn open(&self, n: usize) -> DevResult<Box<dyn Session + '_>> {
        Ok(Box::new(CpuSession {
            backend: self,
            h: Some(Mat::zeros(n, n)),
        }))
    }
}

/// The CPU session: the Hessian in host memory, the existing solver.
struct CpuSession<'a> {
    backend: &'a CpuBackend,
    h: Option<Mat<f32>>,
}

impl Session for CpuSession<'_> {
    fn accumulate(&mut self, x: MatRef<'_, f32>, alpha: f32) -> DevResult<()> {
        match self.h.as_mut() {
            Some(h) => {
                self.backend.accumulate_hessian(h.as_mut(), x, alpha);
                Ok(())
            }
            None => Err(DeviceError::new(
                "cpu-faer",
                "accumulate",
                "the session was already solved",
            )),
        }
    }

    fn solve(
        &mut self,
        weights: &[&Mat<f32>],
        spec: &SolveSpec<'_>,
        events: &dyn EventSink,
    ) -> DevResult<Vec<QuantizedLinear>> {
        let Some(mut h) = self.h.take() else {
            return Err(DeviceError::new(
                "cpu-faer",
                "solve",
                "the session was already solved",
            ));
        };
        // The per-sample stage inputs are gone: hand their memory back before the factorisation.
        crate::pipeline::release_free_memory();
        self.backend.finish_hessian(h.as_mut());
        let outcome = prepare_factor(
            self.backend,
            h,
            spec.params.desc_act,
            spec.recovery,
            spec.module,
            events,
        );
        Ok(sweep_all(self.backend, &outcome, weights, spec.params))
    }

    fn fallback_hessian(&mut self) -> Option<PreparedHessian> {
        None
    }
}

/// The sweep of every module of a group on the CPU (RTN when recovery was exhausted).
fn sweep_all(
    backend: &CpuBackend,
    outcome: &FactorOutcome,
    weights: &[&Mat<f32>],
    p: &GptqParams,
) -> Vec<QuantizedLinear> {
    // The Hessian was consumed by the factorisation: hand its memory back before the sweep.
    crate::pipeline::release_free_memory();
    // The solver's buffers, shared by the modules of this input group (q/k/v, gate/up) and dropped with it.
    let mut workspace = Workspace::default();
    weights
        .iter()
        .map(|w| match outcome {
            FactorOutcome::Factor(f) => gptq_quantize_in(&mut workspace, backend, w, f, p),
            FactorOutcome::Exhausted => rtn_quantize(w, p),
        })
        .collect()
}

/// The group's solve on the CPU from an already prepared Hessian (the fallback after a device failure): the
/// same recovery loop and sweep as [`CpuBackend`]'s session.
pub fn solve_prepared_on_cpu(
    backend: &CpuBackend,
    prepared: PreparedHessian,
    weights: &[&Mat<f32>],
    spec: &SolveSpec<'_>,
    events: &dyn EventSink,
) -> Vec<QuantizedLinear> {
    let PreparedHessian { h, perm, dead } = prepared;
    let outcome = match recover(backend, &h, spec.recovery, spec.module, events) {
        Some((f, damp)) => FactorOutcome::Factor(PreparedFactor {
            f,
            perm,
            dead,
            damp,
        }),
        None => FactorOutcome::Exhausted,
    };
    drop(h);
    sweep_all(backend, &outcome, weights, spec.params)
}

/// Runs `session.solve`; when the device gives up, emits [`names::GPTQ_DEVICE_FALLBACK`] and solves the group
/// on the CPU from the session's host checkpoint. An error only when there is no checkpoint to fall back to.
pub fn solve_with_fallback(
    device_name: &str,
    session: &mut dyn Session,
    weights: &[&Mat<f32>],
    spec: &SolveSpec<'_>,
    events: &dyn EventSink,
) -> Result<Vec<QuantizedLinear>, QuantError> {
    match session.solve(weights, spec, events) {
        Ok(r) => Ok(r),
        Err(e) => {
            let prepared = session.fallback_hessian();
            events.emit(
                names::GPTQ_DEVICE_FALLBACK,
                fields([
                    ("module", json!(spec.module)),
                    ("device", json!(device_name)),
                    ("error", json!(e.to_string())),
                    ("to", json!(if prepared.is_some() { "cpu" } else { "none" })),
                ]),
            );
            match prepared {
                Some(p) => Ok(solve_prepared_on_cpu(
                    &CpuBackend::default(),
                    p,
                    weights,
                    spec,
                    events,
                )),
                None => Err(QuantError::Device(format!(
                    "{}: {e}; no host copy of the Hessian to finish on the CPU",
                    spec.module
                ))),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Devices with their own memory

/// Host-side facts about a prepared Hessian (the matrix itself stays on the device).
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedMeta {
    /// The diagonal after the dead-column fix, in sweep order (the recovery loop's base diagonal).
    pub diag: Vec<f32>,
    pub perm: Option<Vec<usize>>,
    pub dead: Vec<bool>,
    /// Non-finite entries replaced by zero.
    pub sanitized: usize,
}

/// The primitive steps of a solve on a device with its own memory. Every buffer named here lives on the
/// device; only the arguments and results cross the bus.
pub trait DeviceOps {
    fn name(&self) -> String;
    /// `H += alpha · xᵀx` (lower triangle), `x` uploaded.
    fn accumulate(&mut self, x: MatRef<'_, f32>, alpha: f32) -> DevResult<()>;
    /// Mirror, sanitise, dead columns, act-order permutation of H in device memory.
    fn prepare(&mut self, desc_act: bool) -> DevResult<PreparedMeta>;
    /// The prepared Hessian downloaded (the host checkpoint a reset or the CPU fallback starts from).
    fn checkpoint(&mut self) -> DevResult<Mat<f32>>;
    /// After [`DeviceOps::reset`]: the prepared Hessian uploaded again.
    fn restore(&mut self, prepared: &Mat<f32>) -> DevResult<()>;
    /// The sweep factor of the prepared Hessian with diagonal `diag` (uploaded), kept on the device;
    /// `Ok(false)` when the matrix is not numerically positive definite.
    fn try_factor(&mut self, diag: &[f32]) -> DevResult<bool>;
    /// Whether a usable factor from the last successful [`DeviceOps::try_factor`] is on the device.
    fn has_factor(&self) -> bool;
    /// The sweep of one module with the current factor: W uploaded, codes/scales/zeros downloaded.
    fn sweep(
        &mut self,
        w: &Mat<f32>,
        meta: &PreparedMeta,
        damp: f32,
        p: &GptqParams,
    ) -> DevResult<QuantizedLinear>;
    /// A fresh context and stream (after an error that may have poisoned the old one); device buffers are
    /// gone afterwards.
    fn reset(&mut self) -> DevResult<()>;
}

/// Device resets per input group before its solve goes to the CPU.
pub const MAX_DEVICE_RESETS: usize = 2;

/// A [`Session`] over [`DeviceOps`], with the device-error rules of the module docs.
pub struct OpsSession<O: DeviceOps> {
    ops: O,
    checkpoint: Option<PreparedHessian>,
    resets: usize,
}

impl<O: DeviceOps> OpsSession<O> {
    pub fn new(ops: O) -> Self {
        OpsSession {
            ops,
            checkpoint: None,
            resets: 0,
        }
    }
    /// Device resets so far.
    pub fn resets(&self) -> usize {
        self.resets
    }
    pub fn ops(&self) -> &O {
        &self.ops
    }

    /// Runs `f` until it succeeds; after each error, resets the device and restores the checkpoint, at most
    /// [`MAX_DEVICE_RESETS`] times per session.
    fn retry<T>(
        &mut self,
        op: &str,
        module: &str,
        events: &dyn EventSink,
        mut f: impl FnMut(&mut O) -> DevResult<T>,
    ) -> DevResult<T> {
        loop {
            let err = match f(&mut self.ops) {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let give_up = self.resets >= MAX_DEVICE_RESETS || self.checkpoint.is_none();
            events.emit(
                names::GPTQ_DEVICE_ERROR,
                fields([
                    ("module", json!(module)),
                    ("device", json!(self.ops.name())),
                    ("op", json!(op)),
                    ("error", json!(err.to_string())),
                    (
                        "reset",
                        json!(if give_up {
                            Value::Null
                        } else {
                            json!(self.resets + 1)
                        }),
                    ),
                ]),
            );
            if give_up {
                return Err(err);
            }
            self.resets += 1;
            self.ops.reset()?;
            let Some(cp) = self.checkpoint.as_ref() else {
                return Err(err);
            };
            self.ops.restore(&cp.h)?;
        }
    }
}

impl<O: DeviceOps> Session for OpsSession<O> {
    fn accumulate(&mut self, x: MatRef<'_, f32>, alpha: f32) -> DevResult<()> {
        // Before the checkpoint a failed batch cannot be replayed: the error goes to the caller.
        self.ops.accumulate(x, alpha)
    }

    fn solve(
        &mut self,
        weights: &[&Mat<f32>],
        spec: &SolveSpec<'_>,
        events: &dyn EventSink,
    ) -> DevResult<Vec<QuantizedLinear>> {
        let meta = self.ops.prepare(spec.params.desc_act)?;
        if meta.sanitized > 0 {
            events.emit(
                names::HESSIAN_RECOVERY,
                fields([
                    ("module", json!(spec.module)),
                    ("attempt", json!(0)),
                    ("sanitized", json!(meta.sanitized)),
                    ("result", json!("sanitized")),
                ]),
            );
        }
        let h = self.ops.checkpoint()?;
        self.checkpoint = Some(PreparedHessian {
            h,
            perm: meta.perm.clone(),
            dead: meta.dead.clone(),
        });
        let mut good: Option<Vec<f32>> = None;
        let damp =
            crate::hessian::recover_with(&meta.diag, spec.recovery, spec.module, events, |d| {
                let ok = self.retry("factor", spec.module, events, |o| o.try_factor(d))?;
                if ok {
                    good = Some(d.to_vec());
                }
                Ok::<bool, DeviceError>(ok)
            })?;
        let (Some(damp), Some(good)) = (damp, good) else {
            return Ok(weights
                .iter()
                .map(|w| rtn_quantize(w, spec.params))
                .collect());
        };
        let mut out = Vec::with_capacity(weights.len());
        for w in weights {
            let q = self.retry("sweep", spec.module, events, |o| {
                // After a reset the factor is gone: factor again with the diagonal that succeeded.
                if !o.has_factor() && !o.try_factor(&good)? {
                    return Err(DeviceError::new(
                        o.name(),
                        "factor",
                        "the diagonal that succeeded before the reset failed after it",
                    ));
                }
                o.sweep(w, &meta, damp, spec.params)
            })?;
            out.push(q);
        }
        Ok(out)
    }

    fn fallback_hessian(&mut self) -> Option<PreparedHessian> {
        self.checkpoint.take()
    }
}

// ---------------------------------------------------------------------------------------------------------
// Selection

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
    type CountFn = unsafe extern "C" fn(*mut c_int) -> c_int;

    pub(super) fn probe_hip() -> Result<GpuInfo, String> {
        let (lib, library) = load(HIP_LIBRARIES)?;
        let answer = hip_query(&lib);
        // The runtime stays loaded (unloading a GPU runtime after init is not supported by every vendor).
        std::mem::forget(lib);
        gpu_info(
            DeviceKind::Hip,
            library,
            answer?,
            "HIP",
            "hipInit/hipGetDeviceCount",
            "hipError",
        )
    }

    /// A probe's answer `(status, device count, name)` as a usable device or the reason it is not one.
    fn gpu_info(
        kind: DeviceKind,
        library: String,
        (rc, n, name): (c_int, c_int, String),
        vendor: &str,
        calls: &str,
        code: &str,
    ) -> Result<GpuInfo, String> {
        match (rc, n) {
            (0, n) if n > 0 => Ok(GpuInfo {
                kind,
                library,
                devices: n as usize,
                name,
            }),
            (0, _) => Err(format!("{library}: no {vendor} device")),
            (rc, _) => Err(format!("{library}: {calls} returned {code} {rc}")),
        }
    }

    /// `(status, device count, name of device 0)`.
    fn hip_query(lib: &Library) -> Result<(c_int, c_int, String), String> {
        let init: Symbol<InitFn> = sym(lib, b"hipInit\0")?;
        let count: Symbol<CountFn> = sym(lib, b"hipGetDeviceCount\0")?;
        let get_name: Symbol<unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int> =
            sym(lib, b"hipDeviceGetName\0")?;
        // SAFETY: C calls with valid out-pointers, per the HIP runtime API.
        let (rc, n, name) = unsafe {
            let rc = init(0);
            let mut n: c_int = 0;
            let rc = if rc == 0 { count(&mut n) } else { rc };
            let mut buf = [0 as c_char; 256];
            if rc == 0 && n > 0 {
                get_name(buf.as_mut_ptr(), buf.len() as c_int, 0);
            }
            (rc, n, name_from(&buf))
        };
        Ok((rc, n, name))
    }

    pub(super) fn probe_cuda() -> Result<GpuInfo, String> {
        let (lib, library) = load(CUDA_LIBRARIES)?;
        let answer = cuda_query(&lib);
        std::mem::forget(lib);
        gpu_info(
            DeviceKind::Cuda,
            library,
            answer?,
            "CUDA",
            "cuInit/cuDeviceGetCount",
            "CUresult",
        )
    }

    /// `(status, device count, name of device 0)`.
    fn cuda_query(lib: &Library) -> Result<(c_int, c_int, String), String> {
        let init: Symbol<InitFn> = sym(lib, b"cuInit\0")?;
        let count: Symbol<CountFn> = sym(lib, b"cuDeviceGetCount\0")?;
        let get: Symbol<unsafe extern "C" fn(*mut c_int, c_int) -> c_int> =
            sym(lib, b"cuDeviceGet\0")?;
        let get_name: Symbol<unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int> =
            sym(lib, b"cuDeviceGetName\0")?;
        // SAFETY: C calls with valid out-pointers, per the CUDA driver API.
        let (rc, n, name) = unsafe {
            let rc = init(0);
            let mut n: c_int = 0;
            let rc = if rc == 0 { count(&mut n) } else { rc };
            let mut buf = [0 as c_char; 256];
            if rc == 0 && n > 0 {
                let mut dev: c_int = 0;
                if get(&mut dev, 0) == 0 {
                    get_name(buf.as_mut_ptr(), buf.len() as c_int, dev);
                }
            }
            (rc, n, name_from(&buf))
        };
        Ok((rc, n, name))
    }
}

pub mod fake;
