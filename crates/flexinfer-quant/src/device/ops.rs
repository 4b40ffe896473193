//! Devices with their own memory: the primitive steps ([`DeviceOps`]) and the session that adds a real
//! card's recovery rules to them ([`OpsSession`]).

use super::{DevResult, DeviceError, Resident, Session, SolveSpec};
use crate::events::NullSink;
use crate::events::{fields, EventSink};
use crate::numerics::gptq::{rtn_quantize, QuantizedLinear};
use crate::numerics::hessian::{prepare_hessian, sanitize, PreparedHessian};
use crate::params::{ColumnOrder, GptqParams};
use faer::{Mat, MatRef};
use flexinfer_contract::events as names;
use serde_json::{json, Value};

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

/// What every module of an input group is swept with: the preparation's facts, the damp of the
/// factorisation attempt that succeeded (recorded in each result) and the quantization parameters.
#[derive(Clone, Copy, Debug)]
pub struct SweepJob<'a> {
    pub meta: &'a PreparedMeta,
    pub damp: f32,
    pub params: &'a GptqParams,
}

impl PreparedMeta {
    /// The host half of [`DeviceOps::prepare`] for devices that prepare on the host: sanitise the
    /// mirrored Hessian, then the CPU's dead-column fix and act-order permutation. Returns the prepared
    /// matrix (to keep or upload) and its facts.
    pub fn prepare_on_host(mut h: Mat<f32>, order: ColumnOrder) -> (Mat<f32>, PreparedMeta) {
        let sanitized = sanitize(&mut h);
        let p = prepare_hessian(h, order, "", &NullSink);
        let n = p.h.nrows();
        let diag = (0..n).map(|i| p.h[(i, i)]).collect();
        let meta = PreparedMeta {
            diag,
            perm: p.perm,
            dead: p.dead,
            sanitized,
        };
        (p.h, meta)
    }
}

/// The primitive steps of a solve on a device with its own memory. Every buffer named here lives on the
/// device; only the arguments and results cross the bus.
pub trait DeviceOps {
    fn name(&self) -> String;
    /// `H += alpha · xᵀx` (lower triangle), `x` uploaded.
    fn accumulate(&mut self, x: MatRef<'_, f32>, alpha: f32) -> DevResult<()>;
    /// `H += alpha · xᵀx` from activations already on the device; `Ok(false)` when they are not in this
    /// device's context (the caller then uses [`DeviceOps::accumulate`]).
    fn accumulate_resident(&mut self, _x: &Resident, _alpha: f32) -> DevResult<bool> {
        Ok(false)
    }
    /// Mirror, sanitise, dead columns, act-order permutation of H in device memory.
    fn prepare(&mut self, order: ColumnOrder) -> DevResult<PreparedMeta>;
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
    fn sweep(&mut self, w: &Mat<f32>, job: &SweepJob<'_>) -> DevResult<QuantizedLinear>;
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

    fn accumulate_resident(&mut self, x: &Resident, alpha: f32) -> DevResult<bool> {
        self.ops.accumulate_resident(x, alpha)
    }

    fn solve(
        &mut self,
        weights: &[&Mat<f32>],
        spec: &SolveSpec<'_>,
    ) -> DevResult<Vec<QuantizedLinear>> {
        let events = spec.events;
        let n = weights.first().map_or(0, |w| w.ncols());
        let meta = self.ops.prepare(spec.params.column_order(n))?;
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
        if let Some(reason) = spec.params.cpu_only() {
            // The clipping search and the scale refinement run in the CPU sweep only: the group goes to the
            // CPU from the checkpoint (a `gptq_device_fallback` event names the reason).
            return Err(DeviceError::new(self.ops.name(), "sweep", reason));
        }
        let mut good: Option<Vec<f32>> = None;
        let damp = crate::numerics::hessian::recover_with(
            &meta.diag,
            spec.recovery,
            spec.module,
            events,
            |d| {
                let ok = self.retry("factor", spec.module, events, |o| o.try_factor(d))?;
                if ok {
                    good = Some(d.to_vec());
                }
                Ok::<bool, DeviceError>(ok)
            },
        )?;
        let (Some(damp), Some(good)) = (damp, good) else {
            return Ok(weights
                .iter()
                .map(|w| rtn_quantize(w, spec.params))
                .collect());
        };
        let job = SweepJob {
            meta: &meta,
            damp,
            params: spec.params,
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
                o.sweep(w, &job)
            })?;
            out.push(q);
        }
        Ok(out)
    }

    fn fallback_hessian(&mut self) -> Option<PreparedHessian> {
        self.checkpoint.take()
    }
}
