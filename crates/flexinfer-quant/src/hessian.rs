//! Hessian preparation (sanitise, dead columns, act-order permutation) and the recovery loop that turns it into
//! the sweep factor (one Cholesky factorisation; see [`crate::linalg`]) (docs/dev/gptq.md §1.2–§1.4).

use crate::events::{fields, EventSink};
use crate::linalg::{LinalgBackend, SweepFactor};
use crate::params::{FloorMode, RecoveryParams};
use faer::Mat;
use flexinfer_contract::events as names;
use serde_json::json;

/// Everything the column sweep needs from one Hessian; shared by all modules that see the same input.
#[derive(Clone, Debug)]
pub struct PreparedFactor {
    /// Sweep factor of the (permuted, damped) Hessian (see [`crate::linalg`]).
    pub f: SweepFactor,
    /// `perm[k]` = original column at sweep position k (act-order); `None` = identity.
    pub perm: Option<Vec<usize>>,
    /// Columns whose Hessian diagonal was zero (original order); their weights are zeroed.
    pub dead: Vec<bool>,
    /// Relative damping that succeeded (0 when a diagonal floor was needed).
    pub damp: f32,
}

/// Outcome of the recovery loop for one Hessian.
#[derive(Clone, Debug)]
pub enum FactorOutcome {
    Factor(PreparedFactor),
    /// Every damp and floor attempt failed: the modules fall back to RTN.
    Exhausted,
}

/// Replaces non-finite entries by zero; returns how many were replaced.
pub fn sanitize(h: &mut Mat<f32>) -> usize {
    use rayon::prelude::*;
    h.as_mut()
        .par_col_iter_mut()
        .map(|c| {
            let mut count = 0;
            for v in c.iter_mut() {
                if !v.is_finite() {
                    *v = 0.0;
                    count += 1;
                }
            }
            count
        })
        .sum()
}

/// Prepares `h` (consumed) and runs the recovery loop. `module` names the input group in events.
pub fn prepare_factor(
    backend: &dyn LinalgBackend,
    mut h: Mat<f32>,
    desc_act: bool,
    recovery: &RecoveryParams,
    module: &str,
    events: &dyn EventSink,
) -> FactorOutcome {
    let n = h.nrows();
    let replaced = sanitize(&mut h);
    if replaced > 0 {
        events.emit(
            names::HESSIAN_RECOVERY,
            fields([
                ("module", json!(module)),
                ("attempt", json!(0)),
                ("sanitized", json!(replaced)),
                ("result", json!("sanitized")),
            ]),
        );
    }
    // Dead columns: only the diagonal entry is set to one (the torch mask idiom).
    let mut dead = vec![false; n];
    for (i, d) in dead.iter_mut().enumerate() {
        if h[(i, i)] == 0.0 {
            *d = true;
            h[(i, i)] = 1.0;
        }
    }
    let perm = if desc_act {
        let mut idx: Vec<usize> = (0..n).collect();
        // Descending diag, stable on ties (torch argsort(descending) is not guaranteed stable; we pick stable).
        idx.sort_by(|&a, &b| {
            h[(b, b)]
                .partial_cmp(&h[(a, a)])
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        let permuted = Mat::from_fn(n, n, |i, j| h[(idx[i], idx[j])]);
        h = permuted;
        Some(idx)
    } else {
        None
    };
    match recover(backend, &h, recovery, module, events) {
        Some((f, damp)) => FactorOutcome::Factor(PreparedFactor {
            f,
            perm,
            dead,
            damp,
        }),
        None => FactorOutcome::Exhausted,
    }
}

/// The damp sweep, then the diagonal-floor attempts. Returns `(sweep factor, damp)`. `h` is only read: every
/// attempt factors its off-diagonal part with a new diagonal into one reused output buffer.
pub fn recover(
    backend: &dyn LinalgBackend,
    h: &Mat<f32>,
    rp: &RecoveryParams,
    module: &str,
    events: &dyn EventSink,
) -> Option<(SweepFactor, f32)> {
    let n = h.nrows();
    if n == 0 {
        return None;
    }
    let diag: Vec<f32> = (0..n).map(|i| h[(i, i)]).collect();
    let mean = (diag.iter().map(|&d| d as f64).sum::<f64>() / n as f64) as f32;
    let mut work = SweepFactor::new(n);
    let mut attempt_diag = vec![0f32; n];
    let mut try_factor = |work: &mut SweepFactor, f: &dyn Fn(usize) -> f32| -> bool {
        for (i, d) in attempt_diag.iter_mut().enumerate() {
            *d = f(i);
        }
        backend.sweep_factor(h.as_ref(), &attempt_diag, work)
    };

    // Attempt 0: damp sweep from damp_percent in steps of damp_auto_increment while damp < 1.
    let mut damp = rp.damp_percent;
    let mut failed_any = false;
    loop {
        let add = damp * mean;
        if try_factor(&mut work, &|i| diag[i] + add) {
            if failed_any {
                events.emit(
                    names::HESSIAN_RECOVERY,
                    fields([
                        ("module", json!(module)),
                        ("attempt", json!(0)),
                        ("damp", json!(damp)),
                        ("result", json!("recovered")),
                    ]),
                );
            }
            return Some((work, damp));
        }
        failed_any = true;
        events.emit(
            names::HESSIAN_RECOVERY,
            fields([
                ("module", json!(module)),
                ("attempt", json!(0)),
                ("damp", json!(damp)),
                ("result", json!("failed")),
            ]),
        );
        if rp.damp_auto_increment <= 0.0 {
            break;
        }
        damp += rp.damp_auto_increment;
        if damp >= 1.0 {
            break;
        }
    }

    // Attempts 1..=max: one factorisation each with a growing diagonal floor, no damp.
    let base = match rp.floor_mode {
        FloorMode::Mean => mean * rp.floor_scale,
        FloorMode::AbsMax => diag.iter().fold(0.0f32, |m, d| m.max(d.abs())) * 1e-6,
    };
    for attempt in 1..=rp.max_floor_attempts {
        let floor = base * rp.floor_multiplier.powi(attempt as i32 - 1);
        let ok = floor.is_finite()
            && floor > 0.0
            && try_factor(&mut work, &|i| (diag[i] + floor).max(floor));
        events.emit(
            names::HESSIAN_RECOVERY,
            fields([
                ("module", json!(module)),
                ("attempt", json!(attempt)),
                ("floor", json!(floor)),
                ("result", json!(if ok { "recovered" } else { "failed" })),
            ]),
        );
        if ok {
            return Some((work, 0.0));
        }
    }
    events.emit(
        names::HESSIAN_RECOVERY,
        fields([
            ("module", json!(module)),
            ("attempt", json!(rp.max_floor_attempts)),
            ("result", json!("exhausted")),
        ]),
    );
    None
}
