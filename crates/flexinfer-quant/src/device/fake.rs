//! A [`DeviceOps`] device that computes on the host with the CPU backend's code and fails where a script
//! says: the test double for the device-error paths (reset and retry, CPU fallback). After an injected
//! failure every operation fails until [`DeviceOps::reset`], as a HIP context does after a kernel fault
//! (the gfx906 cascade), and a reset drops every device buffer.

use super::{
    DevResult, Device, DeviceError, DeviceKind, DeviceOps, OpsSession, PreparedMeta, Session,
    SweepJob,
};
use crate::numerics::gptq::{gptq_quantize_in, QuantizedLinear, Workspace};
use crate::numerics::hessian::PreparedFactor;
use crate::numerics::linalg::{CpuBackend, LinalgBackend, SweepFactor};
use crate::params::ColumnOrder;
use faer::{Mat, MatRef};
use std::sync::Mutex;

/// Which calls fail: 1-based call numbers per operation, counted over the device's whole life (all
/// sessions).
#[derive(Clone, Debug, Default)]
pub struct Faults {
    pub accumulate: Vec<usize>,
    pub factor: Vec<usize>,
    pub sweep: Vec<usize>,
    /// Every reset fails.
    pub reset: bool,
}

#[derive(Default)]
struct State {
    faults: Faults,
    counts: [usize; 3],
    /// Every operation in order (`accumulate`, `factor`, `factor-error`, `reset`, …).
    log: Vec<String>,
}

/// The fake device (see the module docs).
pub struct FakeDevice {
    backend: CpuBackend,
    state: Mutex<State>,
}

impl FakeDevice {
    pub fn new(faults: Faults) -> Self {
        FakeDevice {
            backend: CpuBackend::default(),
            state: Mutex::new(State {
                faults,
                ..Default::default()
            }),
        }
    }
    /// The operations so far.
    pub fn log(&self) -> Vec<String> {
        self.state.lock().map(|s| s.log.clone()).unwrap_or_default()
    }
    /// Counts the call of `op` (0 accumulate, 1 factor, 2 sweep); `Err` when the script makes it fail.
    fn tick(&self, op: usize, name: &str) -> DevResult<()> {
        let Ok(mut s) = self.state.lock() else {
            return Err(DeviceError::new("fake", name, "state lock poisoned"));
        };
        s.counts[op] += 1;
        let n = s.counts[op];
        let list = match op {
            0 => &s.faults.accumulate,
            1 => &s.faults.factor,
            _ => &s.faults.sweep,
        };
        let fail = list.contains(&n);
        s.log.push(if fail {
            format!("{name}-error")
        } else {
            name.to_string()
        });
        if fail {
            Err(DeviceError::new(
                "fake",
                name,
                format!("injected failure of call {n}"),
            ))
        } else {
            Ok(())
        }
    }
    fn note(&self, what: &str) {
        if let Ok(mut s) = self.state.lock() {
            s.log.push(what.to_string());
        }
    }
}

impl Device for FakeDevice {
    fn describe(&self) -> String {
        "fake".to_string()
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }
    fn open(&self, n: usize) -> DevResult<Box<dyn Session + '_>> {
        Ok(Box::new(OpsSession::new(FakeOps {
            dev: self,
            h: Some(Mat::zeros(n, n)),
            prepared: None,
            factor: None,
            poisoned: false,
            ws: Workspace::default(),
        })))
    }
}

/// One session's "device memory".
pub struct FakeOps<'a> {
    dev: &'a FakeDevice,
    h: Option<Mat<f32>>,
    prepared: Option<Mat<f32>>,
    factor: Option<SweepFactor>,
    poisoned: bool,
    ws: Workspace,
}

impl FakeOps<'_> {
    fn check(&mut self, op: usize, name: &str) -> DevResult<()> {
        if self.poisoned {
            self.dev.note(&format!("{name}-poisoned"));
            return Err(DeviceError::new(
                "fake",
                name,
                "context poisoned by an earlier error",
            ));
        }
        let r = self.dev.tick(op, name);
        if r.is_err() {
            self.poisoned = true;
        }
        r
    }
    fn lost(name: &str) -> DeviceError {
        DeviceError::new("fake", name, "buffer not on the device")
    }
}

impl DeviceOps for FakeOps<'_> {
    fn name(&self) -> String {
        "fake".to_string()
    }
    fn accumulate(&mut self, x: MatRef<'_, f32>, alpha: f32) -> DevResult<()> {
        self.check(0, "accumulate")?;
        let h = self.h.as_mut().ok_or_else(|| Self::lost("accumulate"))?;
        self.dev.backend.accumulate_hessian(h.as_mut(), x, alpha);
        Ok(())
    }
    fn prepare(&mut self, order: ColumnOrder) -> DevResult<PreparedMeta> {
        let mut h = self.h.take().ok_or_else(|| Self::lost("prepare"))?;
        self.dev.backend.finish_hessian(h.as_mut());
        let (prepared, meta) = PreparedMeta::prepare_on_host(h, order);
        self.prepared = Some(prepared);
        Ok(meta)
    }
    fn checkpoint(&mut self) -> DevResult<Mat<f32>> {
        self.prepared
            .clone()
            .ok_or_else(|| Self::lost("checkpoint"))
    }
    fn restore(&mut self, prepared: &Mat<f32>) -> DevResult<()> {
        self.dev.note("restore");
        self.prepared = Some(prepared.clone());
        Ok(())
    }
    fn try_factor(&mut self, diag: &[f32]) -> DevResult<bool> {
        self.check(1, "factor")?;
        let h = self.prepared.as_ref().ok_or_else(|| Self::lost("factor"))?;
        let mut f = self
            .factor
            .take()
            .unwrap_or_else(|| SweepFactor::new(h.nrows()));
        let ok = self.dev.backend.sweep_factor(h.as_ref(), diag, &mut f);
        if ok {
            self.factor = Some(f);
        }
        Ok(ok)
    }
    fn has_factor(&self) -> bool {
        self.factor.is_some()
    }
    fn sweep(&mut self, w: &Mat<f32>, job: &SweepJob<'_>) -> DevResult<QuantizedLinear> {
        self.check(2, "sweep")?;
        let f = self.factor.take().ok_or_else(|| Self::lost("sweep"))?;
        let pf = PreparedFactor {
            f,
            perm: job.meta.perm.clone(),
            dead: job.meta.dead.clone(),
            damp: job.damp,
        };
        let q = gptq_quantize_in(&mut self.ws, &self.dev.backend, w, &pf, job.params);
        self.factor = Some(pf.f);
        Ok(q)
    }
    fn reset(&mut self) -> DevResult<()> {
        let fail = self
            .dev
            .state
            .lock()
            .map(|s| s.faults.reset)
            .unwrap_or(true);
        self.dev.note(if fail { "reset-error" } else { "reset" });
        if fail {
            return Err(DeviceError::new("fake", "reset", "injected reset failure"));
        }
        self.poisoned = false;
        self.h = None;
        self.prepared = None;
        self.factor = None;
        Ok(())
    }
}
