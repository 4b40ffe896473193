//! Where an input group's whole GPTQ solve runs (docs/dev/gptq-device.md).
//!
//! [`crate::numerics::linalg::LinalgBackend`] is the per-operation interface: every call takes host matrices. A GPU that
//! received H, W and the factor across the bus for each call would spend most of its time copying, so the
//! pipeline talks to a [`Device`] instead: [`Device::open`] gives a [`Session`] that owns the group's buffers
//! (on the device, for a GPU), [`Session::accumulate`] uploads one calibration batch and adds its `xᵀx`, and
//! [`Session::solve`] does everything after it (mirror, sanitise, dead columns, act-order, the damp/floor
//! recovery attempts, the sweep factor, the lazy-batch sweep and block updates of every module of the group)
//! with one upload of each module's W and one download of its codes and scales.
//!
//! Backends:
//! - [`CpuBackend`] is a [`Device`] whose session runs the existing CPU code (bit-identical to calling
//!   [`crate::numerics::hessian::prepare_factor`] and [`crate::numerics::gptq::gptq_quantize_in`] directly).
//! - A device whose buffers live elsewhere implements the smaller [`DeviceOps`]; [`OpsSession`] turns it into a
//!   [`Session`] with the recovery rules of a real card: a failed operation (not a failed factorisation, which
//!   is numerical and handled by the damp/floor loop) resets the device context, restores the prepared Hessian
//!   from the host checkpoint and retries; after [`MAX_DEVICE_RESETS`] resets the error goes to
//!   [`solve_with_fallback`], which solves the group on the CPU from the same checkpoint and says so in an event.
//! - [`fake::FakeDevice`] is such a device on the host, with scripted failures (tests).
//!
//! [`select_device`] implements `GPTQ_DEVICE=auto|cpu|hip|cuda`; [`SystemPlatform`] looks for vendor runtimes
//! with `dlopen` at run time, so the binary needs no GPU SDK to build, link or run.

pub mod access;
pub mod check;
pub mod driver;
pub mod fake;
pub mod kernel;
mod ops;
mod select;

pub use kernel::forward::{ForwardPass, ForwardTimes};
pub use ops::{DeviceOps, OpsSession, PreparedMeta, SweepJob, MAX_DEVICE_RESETS};
pub use select::{
    select_device, DeviceChoice, MemoryBudget, Platform, Selection, SystemPlatform, VendorLibs,
    VendorLibsError, CUDA_LIBRARIES, HIP_LIBRARIES,
};

pub use crate::error::device::{DevResult, DeviceError, DeviceKind, GpuInfo, ProbeError};

use crate::error::QuantError;
use crate::events::{fields, EventSink};
use crate::numerics::gptq::{gptq_quantize_in, rtn_quantize, QuantizedLinear, Workspace};
use crate::numerics::hessian::{
    prepare_hessian, recover, FactorOutcome, PreparedFactor, PreparedHessian,
};
use crate::numerics::linalg::{CpuBackend, LinalgBackend};
use crate::params::{GptqParams, RecoveryParams};
use faer::{Mat, MatRef};
use flexinfer_contract::events as names;
use serde_json::json;

/// What the solve of one input group needs besides its buffers, and where its events go.
#[derive(Clone, Copy)]
pub struct SolveSpec<'a> {
    pub params: &'a GptqParams,
    pub recovery: &'a RecoveryParams,
    /// The group's module names (comma list), for events.
    pub module: &'a str,
    pub events: &'a dyn EventSink,
}

/// Something that runs whole input-group solves.
pub trait Device: Send + Sync {
    /// Names the device in events and logs (`cpu-faer`, `cuda:0 NVIDIA …`).
    fn describe(&self) -> String;
    fn kind(&self) -> DeviceKind;
    /// Buffers for one input group whose modules have `n` input features (the Hessian is n × n).
    fn open(&self, n: usize) -> DevResult<Box<dyn Session + '_>>;
    /// The calibration forward on this device for a model of `hidden_size`, in batches of at most
    /// `batch_tokens` tokens (`None`: the device has none; the forward runs on the CPU).
    fn forward(
        &self,
        _hidden_size: usize,
        _batch_tokens: usize,
    ) -> Option<DevResult<Box<dyn ForwardPass + '_>>> {
        None
    }
    /// Device memory the run may use, bytes (`None`: unknown, or not a device with its own memory).
    fn memory_budget(&self) -> Option<u64> {
        None
    }
}

/// A batch of activations already on the device (a view `rows × cols` with leading dimension `ld`), which a
/// session of the same context can accumulate without a copy ([`Session::accumulate_resident`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resident {
    pub ptr: kernel::DevPtr,
    pub ld: usize,
    pub rows: usize,
    pub cols: usize,
    /// Identifies the device context the pointer belongs to (the address of its shared state).
    pub context: usize,
    /// The context generation the pointer was allocated in.
    pub generation: u64,
}

/// One input group's solve: accumulation batches, then one [`Session::solve`].
pub trait Session {
    /// `H += alpha · xᵀx` for activations `x` (`[tokens, n]`): one upload of `x`.
    fn accumulate(&mut self, x: MatRef<'_, f32>, alpha: f32) -> DevResult<()>;
    /// As [`Session::accumulate`] from activations on the device; `Ok(false)` when this session cannot read
    /// them there (another context, or a session on the host), and the caller hands it a host copy instead.
    fn accumulate_resident(&mut self, _x: &Resident, _alpha: f32) -> DevResult<bool> {
        Ok(false)
    }
    /// The rest of the group's GPTQ: preparation, recovery loop, sweep factor and the sweep of each of
    /// `weights` (`[out, n]`, one upload each), results in the same order (one download each). Recovery that
    /// is exhausted gives RTN results, as on the CPU. Called once.
    fn solve(
        &mut self,
        weights: &[&Mat<f32>],
        spec: &SolveSpec<'_>,
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
        Ok(Box::new(CpuSession::new(self.clone(), n, None)))
    }
}

/// Why a GPU device handed an input group to the CPU before starting it (it does not fit the budget).
pub(crate) struct Handover {
    /// The device that gave the group up ([`Device::describe`]).
    pub device: String,
    pub reason: String,
}

/// The CPU session: the Hessian in host memory, the existing solver. It is also the session a GPU device
/// opens for an input group too large for its memory budget; then `handover` says which device and why, and
/// the solve reports it in a [`names::GPTQ_DEVICE_FALLBACK`] event.
pub(crate) struct CpuSession {
    backend: CpuBackend,
    h: Option<Mat<f32>>,
    handover: Option<Handover>,
}

impl CpuSession {
    pub(crate) fn new(backend: CpuBackend, n: usize, handover: Option<Handover>) -> CpuSession {
        CpuSession {
            backend,
            h: Some(Mat::zeros(n, n)),
            handover,
        }
    }

    fn solved(op: &str) -> DeviceError {
        DeviceError::new("cpu-faer", op, "the session was already solved")
    }
}

impl Session for CpuSession {
    fn accumulate(&mut self, x: MatRef<'_, f32>, alpha: f32) -> DevResult<()> {
        let h = self.h.as_mut().ok_or_else(|| Self::solved("accumulate"))?;
        self.backend.accumulate_hessian(h.as_mut(), x, alpha);
        Ok(())
    }

    fn solve(
        &mut self,
        weights: &[&Mat<f32>],
        spec: &SolveSpec<'_>,
    ) -> DevResult<Vec<QuantizedLinear>> {
        let events = spec.events;
        let mut h = self.h.take().ok_or_else(|| Self::solved("solve"))?;
        if let Some(Handover { device, reason }) = &self.handover {
            fallback_event(events, spec.module, device, reason, "cpu");
        }
        // The per-sample stage inputs are gone: hand their memory back before the factorisation.
        crate::memory::release_free_memory();
        self.backend.finish_hessian(h.as_mut());
        let order = spec.params.column_order(h.nrows());
        let prepared = prepare_hessian(h, order, spec.module, events);
        Ok(solve_prepared_on_cpu(
            &self.backend,
            prepared,
            weights,
            spec,
        ))
    }

    fn fallback_hessian(&mut self) -> Option<PreparedHessian> {
        None
    }
}

/// The [`names::GPTQ_DEVICE_FALLBACK`] event: `device` gave up `module` because of `error`; it goes `to` the
/// CPU (or to `none` when nothing could be saved).
fn fallback_event(events: &dyn EventSink, module: &str, device: &str, error: &str, to: &str) {
    events.emit(
        names::GPTQ_DEVICE_FALLBACK,
        fields([
            ("module", json!(module)),
            ("device", json!(device)),
            ("error", json!(error)),
            ("to", json!(to)),
        ]),
    );
}

/// The sweep of every module of a group on the CPU (RTN when recovery was exhausted).
fn sweep_all(
    backend: &CpuBackend,
    outcome: &FactorOutcome,
    weights: &[&Mat<f32>],
    p: &GptqParams,
) -> Vec<QuantizedLinear> {
    // The Hessian was consumed by the factorisation: hand its memory back before the sweep.
    crate::memory::release_free_memory();
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
) -> Vec<QuantizedLinear> {
    let PreparedHessian { h, perm, dead } = prepared;
    let outcome = match recover(backend, &h, spec.recovery, spec.module, spec.events) {
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
) -> Result<Vec<QuantizedLinear>, QuantError> {
    match session.solve(weights, spec) {
        Ok(r) => Ok(r),
        Err(e) => {
            let prepared = session.fallback_hessian();
            let to = if prepared.is_some() { "cpu" } else { "none" };
            fallback_event(spec.events, spec.module, device_name, &e.to_string(), to);
            match prepared {
                Some(p) => Ok(solve_prepared_on_cpu(
                    &CpuBackend::default(),
                    p,
                    weights,
                    spec,
                )),
                None => Err(QuantError::DeviceLost {
                    module: spec.module.to_string(),
                    source: e,
                }),
            }
        }
    }
}
