//! Hessian preparation (sanitise, dead columns, act-order permutation) and the recovery loop that turns it into
//! the sweep factor (one Cholesky factorisation; see [`crate::numerics::linalg`]) (docs/dev/gptq.md, "Hessian" to "The factor").

use crate::events::{fields, EventSink};
use crate::numerics::linalg::{LinalgBackend, SweepFactor};
use crate::params::{ColumnOrder, FloorMode, RecoveryParams};
use faer::Mat;
use flexinfer_contract::events as names;
use serde_json::{json, Value};

/// Everything the column sweep needs from one Hessian; shared by all modules that see the same input.
#[derive(Clone, Debug)]
pub struct PreparedFactor {
    /// Sweep factor of the (permuted, damped) Hessian (see [`crate::numerics::linalg`]).
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
    h: Mat<f32>,
    order: impl Into<ColumnOrder>,
    recovery: &RecoveryParams,
    module: &str,
    events: &dyn EventSink,
) -> FactorOutcome {
    let prepared = prepare_hessian(h, order, module, events);
    match recover(backend, &prepared.h, recovery, module, events) {
        Some((f, damp)) => FactorOutcome::Factor(PreparedFactor {
            f,
            perm: prepared.perm,
            dead: prepared.dead,
            damp,
        }),
        None => FactorOutcome::Exhausted,
    }
}

/// A Hessian after [`prepare_hessian`]: what every factorisation attempt starts from.
#[derive(Clone, Debug)]
pub struct PreparedHessian {
    /// Sanitised, dead diagonal entries set to one, permuted into sweep order when act-order is on.
    pub h: Mat<f32>,
    /// See [`PreparedFactor::perm`].
    pub perm: Option<Vec<usize>>,
    /// See [`PreparedFactor::dead`].
    pub dead: Vec<bool>,
}

/// The part of [`prepare_factor`] before the recovery loop: non-finite entries replaced (with an event),
/// dead columns marked, the sweep's column order (act-order or group-aware) applied.
pub fn prepare_hessian(
    mut h: Mat<f32>,
    order: impl Into<ColumnOrder>,
    module: &str,
    events: &dyn EventSink,
) -> PreparedHessian {
    let n = h.nrows();
    let replaced = sanitize(&mut h);
    if replaced > 0 {
        recovery_event(
            events,
            module,
            0,
            Some(("sanitized", json!(replaced))),
            "sanitized",
        );
    }
    let raw: Vec<f32> = (0..n).map(|i| h[(i, i)]).collect();
    let pd = prepared_diagonal(&raw, order.into());
    for (i, _) in pd.dead.iter().enumerate().filter(|(_, d)| **d) {
        h[(i, i)] = 1.0;
    }
    if let Some(idx) = &pd.perm {
        h = Mat::from_fn(n, n, |i, j| h[(idx[i], idx[j])]);
    }
    PreparedHessian {
        h,
        perm: pd.perm,
        dead: pd.dead,
    }
}

/// What preparing a sanitised Hessian does, decided from its diagonal alone: the dead columns (a zero
/// diagonal entry, which becomes one: the torch mask idiom), the act-order permutation, and the diagonal after
/// both (sweep order). One rule for the CPU's [`prepare_hessian`] and a device's preparation, which applies
/// it to the diagonal it downloads.
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedDiagonal {
    pub dead: Vec<bool>,
    pub perm: Option<Vec<usize>>,
    pub diag: Vec<f32>,
}

/// [`PreparedDiagonal`] of the diagonal `raw` (after sanitising, before the dead-column fix).
pub fn prepared_diagonal(raw: &[f32], order: impl Into<ColumnOrder>) -> PreparedDiagonal {
    let dead: Vec<bool> = raw.iter().map(|&d| d == 0.0).collect();
    let fixed: Vec<f32> = raw
        .iter()
        .map(|&d| if d == 0.0 { 1.0 } else { d })
        .collect();
    let perm = match order.into() {
        ColumnOrder::Plain => None,
        ColumnOrder::Desc => Some(act_order(&fixed)),
        ColumnOrder::GroupAware { group } => Some(group_aware_order(&fixed, group)),
    };
    let diag = match &perm {
        Some(p) => p.iter().map(|&i| fixed[i]).collect(),
        None => fixed,
    };
    PreparedDiagonal { dead, perm, diag }
}

/// The act-order permutation of a prepared Hessian with diagonal `diag`: the columns by descending diagonal,
/// stable on ties (torch's `argsort(descending=True)` is not guaranteed stable; we pick stable).
fn act_order(diag: &[f32]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..diag.len()).collect();
    idx.sort_by(|&a, &b| {
        diag[b]
            .partial_cmp(&diag[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    idx
}

/// The group-aware permutation (GPTQModel's GAR) of a prepared Hessian with diagonal `diag` and groups of
/// `group` consecutive columns: the groups by descending maximum diagonal entry, and inside each group its
/// columns by descending diagonal, both stable on ties. Every group's columns stay contiguous, so a group's
/// parameters are found once, from its own columns, as the sweep reaches it.
fn group_aware_order(diag: &[f32], group: usize) -> Vec<usize> {
    let group = group.max(1);
    let n_groups = diag.len().div_ceil(group);
    let members = |g: usize| g * group..((g + 1) * group).min(diag.len());
    let group_max: Vec<f32> = (0..n_groups)
        .map(|g| {
            members(g)
                .map(|c| diag[c])
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect();
    let by_group = act_order(&group_max);
    let mut perm = Vec::with_capacity(diag.len());
    for g in by_group {
        let start = members(g).start;
        perm.extend(act_order(&diag[members(g)]).into_iter().map(|c| start + c));
    }
    perm
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
    let mut work = SweepFactor::new(n);
    let outcome = recover_with(&diag, rp, module, events, |d| {
        Ok::<bool, std::convert::Infallible>(backend.sweep_factor(h.as_ref(), d, &mut work))
    });
    match outcome {
        Ok(Some(damp)) => Some((work, damp)),
        Ok(None) => None,
        Err(never) => match never {},
    }
}

/// The recovery loop itself, for any factorisation routine: `attempt(diagonal)` factors the prepared Hessian
/// with that diagonal (its off-diagonal part is the attempt's business: host memory for the CPU, device memory
/// for a GPU session) and says whether the factor is usable. Returns the damp that succeeded (0 for a floor),
/// `None` when every attempt failed, and the first error of `attempt` (a device failure, not a numerical one)
/// as it is.
pub fn recover_with<E>(
    diag: &[f32],
    rp: &RecoveryParams,
    module: &str,
    events: &dyn EventSink,
    mut factor_attempt: impl FnMut(&[f32]) -> Result<bool, E>,
) -> Result<Option<f32>, E> {
    let n = diag.len();
    if n == 0 {
        return Ok(None);
    }
    let mean = (diag.iter().map(|&d| d as f64).sum::<f64>() / n as f64) as f32;
    let mut attempt_diag = vec![0f32; n];
    let mut try_factor = |f: &dyn Fn(usize) -> f32| -> Result<bool, E> {
        for (i, d) in attempt_diag.iter_mut().enumerate() {
            *d = f(i);
        }
        factor_attempt(&attempt_diag)
    };

    // Attempt 0: damp sweep from damp_percent in steps of damp_auto_increment while damp < 1.
    let mut damp = rp.damp_percent;
    let mut failed_any = false;
    loop {
        let add = damp * mean;
        if try_factor(&|i| diag[i] + add)? {
            if failed_any {
                recovery_event(events, module, 0, Some(("damp", json!(damp))), "recovered");
            }
            return Ok(Some(damp));
        }
        failed_any = true;
        recovery_event(events, module, 0, Some(("damp", json!(damp))), "failed");
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
        let ok = floor.is_finite() && floor > 0.0 && try_factor(&|i| (diag[i] + floor).max(floor))?;
        recovery_event(
            events,
            module,
            attempt,
            Some(("floor", json!(floor))),
            if ok { "recovered" } else { "failed" },
        );
        if ok {
            return Ok(Some(0.0));
        }
    }
    recovery_event(events, module, rp.max_floor_attempts, None, "exhausted");
    Ok(None)
}

/// One `HessianRecovery` event: the module, the attempt, what it tried (damp, floor or the count of
/// sanitised entries) and its result.
fn recovery_event(
    events: &dyn EventSink,
    module: &str,
    attempt: u32,
    tried: Option<(&str, Value)>,
    result: &str,
) {
    let mut f = fields([("module", json!(module)), ("attempt", json!(attempt))]);
    if let Some((k, v)) = tried {
        f.insert(k.to_string(), v);
    }
    f.insert("result".to_string(), json!(result));
    events.emit(names::HESSIAN_RECOVERY, f);
}

#[cfg(test)]
mod tests {
    use super::{prepared_diagonal, PreparedDiagonal};
    use crate::params::ColumnOrder;

    #[test]
    fn group_aware_order_keeps_groups_whole_and_sorts_by_diagonal() {
        // A diagonal with ties and an uneven last group.
        let raw: Vec<f32> = (0..70u32)
            .map(|i| ((i * 37) % 11) as f32 + if i % 13 == 0 { 0.0 } else { 0.5 })
            .collect();
        let group = 16;
        let pd = prepared_diagonal(&raw, ColumnOrder::GroupAware { group });
        let perm = pd.perm.expect("group-aware order permutes");
        let mut seen = perm.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..70).collect::<Vec<_>>(), "a permutation");
        let fixed = |c: usize| if raw[c] == 0.0 { 1.0 } else { raw[c] };
        let mut group_max = Vec::new();
        let mut k = 0;
        while k < perm.len() {
            let g = perm[k] / group;
            let len = group.min(70 - g * group);
            let chunk = &perm[k..k + len];
            assert!(
                chunk.iter().all(|&c| c / group == g),
                "group {g} split: {chunk:?}"
            );
            for w in chunk.windows(2) {
                let (a, b) = (fixed(w[0]), fixed(w[1]));
                assert!(
                    a > b || (a == b && w[0] < w[1]),
                    "group {g}: {w:?} out of order"
                );
            }
            group_max.push(fixed(chunk[0]));
            k += len;
        }
        assert!(group_max.windows(2).all(|w| w[0] >= w[1]), "{group_max:?}");
        assert_eq!(pd.diag, perm.iter().map(|&c| fixed(c)).collect::<Vec<_>>());
        // One group covering everything is act-order.
        assert_eq!(
            prepared_diagonal(&raw, ColumnOrder::GroupAware { group: 70 }).perm,
            prepared_diagonal(&raw, true).perm
        );
    }

    #[test]
    fn prepared_diagonal_marks_dead_columns_and_orders_by_descending_diagonal_stably() {
        let raw = [3.0, 0.0, 5.0, -0.0, 5.0];
        let dead = vec![false, true, false, true, false];
        assert_eq!(
            prepared_diagonal(&raw, false),
            PreparedDiagonal {
                dead: dead.clone(),
                perm: None,
                diag: vec![3.0, 1.0, 5.0, 1.0, 5.0],
            }
        );
        // Ties keep their order (2 before 4, 1 before 3); the dead columns' diagonal is 1 when sorted.
        assert_eq!(
            prepared_diagonal(&raw, true),
            PreparedDiagonal {
                dead,
                perm: Some(vec![2, 4, 0, 1, 3]),
                diag: vec![5.0, 5.0, 3.0, 1.0, 1.0],
            }
        );
        assert_eq!(
            prepared_diagonal(&[], true),
            PreparedDiagonal {
                dead: vec![],
                perm: Some(vec![]),
                diag: vec![],
            }
        );
    }
}
