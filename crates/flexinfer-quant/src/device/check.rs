//! Checks of a GPU solve device against the CPU backend, each with a stated bound (docs/dev/gptq-device.md,
//! "The card check"). `scripts/gpu-check.sh` runs them on a card (`examples/gpu_check/`); tests/gpu_session.rs runs them
//! through the host build of the same kernels, including vendors that corrupt one kernel's output, so a
//! check that cannot fail would be noticed.
//!
//! - [`hessian`]: `gptq_hessian_lower` + `gptq_mirror_lower` (through [`KernelOps`]'s accumulate and
//!   prepare) against [`CpuBackend::accumulate_hessian`]: `|ΔH_ij| ≤ 8·T·ε·α·Σ_t |x_ti·x_tj|` (T tokens, ε
//!   the f32 unit roundoff): a dot product of T terms in any summation order is within `T·ε` of the exact
//!   one relative to the sum of absolute terms; both sides are, so their difference is within twice that,
//!   with a factor 4 for the accumulation over batches.
//! - [`factor`]: `gptq_factor_fill`, the column kernels and `gptq_factor_scale` (through `try_factor`):
//!   the backward error of the downloaded factor, `|L·Lᵀ − A|_ij ≤ 2·(n+1)·ε·(|L|·|Lᵀ|)_ij` for the
//!   attempt's matrix `A` (the reversed prepared Hessian with the attempt's diagonal). Cholesky in f32 has
//!   `γ_{n+1}` there whatever the order of its sums; the factor 2 covers the scaling of `M` by the pivots.
//!   The CPU's own factor is checked by the same function, so a wrong reconstruction shows as a CPU failure.
//! - [`compare`]: a whole input group's solve (every kernel, the sweep and block updates among them) against
//!   the CPU session: the same method, damp and `g_idx`; at most 1 % of the codes differ; in each row, the
//!   first code that differs (in sweep order) is one step from the CPU's; the scales of every row whose
//!   codes all agree are within 1e-3 relative; the loss within 1 % relative. Why per row: GPTQ carries each
//!   row's rounding error forward along that row only. The device sums the Hessian and the block updates
//!   in another order (and may fuse them), so a value on a rounding tie can round the other way: one step.
//!   From there on the row's later values and group scales legitimately differ (they absorb a different
//!   error), and a later code can move by more than one step (seen on an H200: 2 steps in a 4096 × 11008
//!   module). A row whose first difference is more than one step, or a row without a difference whose
//!   scales are off, has a wrong kernel; so has a result whose loss is more than 1 % off.

use super::kernel::{KernelDevice, KernelOps, Vendor};
use super::{solve_with_fallback, DevResult, Device, DeviceOps, SolveSpec};
use crate::events::NullSink;
use crate::numerics::gptq::{Method, QuantizedLinear};
use crate::numerics::hessian::{prepare_hessian, PreparedHessian};
use crate::numerics::linalg::{CpuBackend, LinalgBackend, SweepFactor};
use crate::params::{ColumnOrder, GptqParams, RecoveryParams};
use faer::{Mat, MatRef};
use std::time::Instant;

/// The outcome of one check: what was measured against which bound.
#[derive(Clone, Debug, PartialEq)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    /// The largest ratio of an observed difference to its bound (≤ 1 passes), or the count a bound limits.
    pub worst: f64,
    pub detail: String,
}

impl Check {
    fn new(name: &str, passed: bool, worst: f64, detail: String) -> Check {
        Check {
            name: name.to_string(),
            passed,
            worst,
            detail,
        }
    }
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let verdict = if self.passed { "ok  " } else { "FAIL" };
        write!(f, "{verdict} {}: {}", self.name, self.detail)
    }
}

/// A deterministic generator (SplitMix64) for the check inputs: no `rand` in the engine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn matrix(&mut self, rows: usize, cols: usize, scale: f32) -> Mat<f32> {
        Mat::from_fn(rows, cols, |_, _| scale * self.uniform())
    }
}

/// Calibration-like activations: a low-rank signal (8 directions) plus noise, in `parts` batches.
pub fn activations(tokens: usize, n: usize, parts: usize, rng: &mut Rng) -> Vec<Mat<f32>> {
    let latent = rng.matrix(tokens, 8, 1.0);
    let mix = rng.matrix(8, n, 1.0);
    let noise = rng.matrix(tokens, n, 0.1);
    let x = &latent * &mix + noise;
    let step = tokens.div_ceil(parts.max(1)).max(1);
    (0..tokens)
        .step_by(step)
        .map(|t0| x.subrows(t0, step.min(tokens - t0)).to_owned())
        .collect()
}

const EPS: f64 = f32::EPSILON as f64 / 2.0;

/// A factorisation attempt's diagonal: `h`'s diagonal plus `damp` times its mean (as the engine damps).
fn damped(h: &Mat<f32>, damp: f64) -> Vec<f32> {
    damp_diagonal(&(0..h.nrows()).map(|i| h[(i, i)]).collect::<Vec<_>>(), damp)
}

/// `diag` plus `damp` times its mean (an attempt's diagonal, as the engine damps).
pub fn damp_diagonal(diag: &[f32], damp: f64) -> Vec<f32> {
    let mean = diag.iter().map(|d| *d as f64).sum::<f64>() / diag.len().max(1) as f64;
    diag.iter().map(|d| d + (damp * mean) as f32).collect()
}

/// A ratio to its bound, with NaN (a non-finite result) as the worst possible.
fn not_nan(r: f64) -> f64 {
    if r.is_nan() {
        f64::INFINITY
    } else {
        r
    }
}

/// The CPU's prepared Hessian of `batches` (accumulated with weight `alpha`; act-order when `desc_act`).
fn cpu_prepared(n: usize, batches: &[Mat<f32>], alpha: f32, desc_act: bool) -> PreparedHessian {
    let cpu = CpuBackend::default();
    let mut h = Mat::zeros(n, n);
    for x in batches {
        cpu.accumulate_hessian(h.as_mut(), x.as_ref(), alpha);
    }
    cpu.finish_hessian(h.as_mut());
    prepare_hessian(h, desc_act, "", &NullSink)
}

/// The CPU's prepared Hessian of `batches` without act-order.
fn cpu_hessian(n: usize, batches: &[Mat<f32>], alpha: f32) -> Mat<f32> {
    cpu_prepared(n, batches, alpha, false).h
}

/// Accumulates `batches` on the device and prepares the Hessian (no act-order); returns the device's
/// prepared Hessian (the host checkpoint) and the session steps for [`factor`].
fn device_hessian<'d, V: Vendor + Send>(
    dev: &'d KernelDevice<V>,
    n: usize,
    batches: &[Mat<f32>],
    alpha: f32,
) -> DevResult<(KernelOps<'d, V>, Mat<f32>)> {
    let mut ops = dev.ops(n)?;
    for x in batches {
        ops.accumulate(x.as_ref(), alpha)?;
    }
    ops.prepare(ColumnOrder::Plain)?;
    // The prepared Hessian stays on the device; this is the host copy made from its download.
    let h = ops.checkpoint()?;
    Ok((ops, h))
}

/// [`hessian`] and [`factor`] on one input group: `n` features, `tokens` tokens in three batches.
pub fn hessian_and_factor<V: Vendor + Send>(
    dev: &KernelDevice<V>,
    n: usize,
    tokens: usize,
    seed: u64,
) -> DevResult<[Check; 2]> {
    let mut rng = Rng::new(seed);
    let batches = activations(tokens, n, 3, &mut rng);
    let alpha = 2.0 / tokens as f32;
    let (mut ops, h_dev) = device_hessian(dev, n, &batches, alpha)?;
    let h_cpu = cpu_hessian(n, &batches, alpha);
    let hc = hessian(&h_dev, &h_cpu, &batches, alpha);
    // The attempt's diagonal: the prepared diagonal plus 1 % of its mean (the engine's default damp is 5 %).
    let damp = 0.01;
    let diag = damped(&h_dev, damp);
    let fc = if ops.try_factor(&diag)? {
        let (m, r) = ops.factor_host()?;
        factor(&h_dev, damp, m.as_ref(), &r, &h_cpu)
    } else {
        Check::new(
            "factor",
            false,
            f64::INFINITY,
            format!("n={n}: the device found the damped Hessian not positive definite"),
        )
    };
    Ok([hc, fc])
}

/// The Hessian check (module docs): every entry of the device's prepared Hessian against the CPU's.
pub fn hessian(h_dev: &Mat<f32>, h_cpu: &Mat<f32>, batches: &[Mat<f32>], alpha: f32) -> Check {
    let n = h_cpu.nrows();
    let tokens: usize = batches.iter().map(|x| x.nrows()).sum();
    // Σ_t |x_ti·x_tj| = (|X|ᵀ|X|)_ij.
    let mut abs = Mat::<f64>::zeros(n, n);
    for x in batches {
        let a = Mat::from_fn(x.nrows(), n, |t, i| x[(t, i)].abs() as f64);
        abs += a.transpose() * &a;
    }
    let (mut worst, mut at) = (0.0f64, (0, 0));
    for j in 0..n {
        for i in 0..n {
            let bound = 8.0 * tokens as f64 * EPS * alpha as f64 * abs[(i, j)] + f64::MIN_POSITIVE;
            let r = not_nan((h_dev[(i, j)] as f64 - h_cpu[(i, j)] as f64).abs() / bound);
            if r > worst {
                (worst, at) = (r, (i, j));
            }
        }
    }
    Check::new(
        "hessian",
        worst <= 1.0,
        worst,
        format!(
            "n={n}, {tokens} tokens: worst |ΔH|/(8·T·ε·α·Σ|x·x|) = {worst:.3} at {at:?} (device {} vs CPU {})",
            h_dev[at], h_cpu[at]
        ),
    )
}

/// `max_ij |L·Lᵀ − A|_ij / (2·(n+1)·ε·(|L|·|Lᵀ|)_ij)` for the factor `(m, r)` of the attempt on `h` with
/// diagonal `diag` (module docs), and where it is largest.
pub fn backward_error(
    h: &Mat<f32>,
    diag: &[f32],
    m: MatRef<'_, f32>,
    r: &[f32],
) -> (f64, (usize, usize)) {
    let n = h.nrows();
    // L of the reversed matrix: L[j,j] = r[n-1-j], L[i,j] = M[i,j]·L[j,j] below the diagonal.
    let l = Mat::<f64>::from_fn(n, n, |i, j| {
        let d = r[n - 1 - j] as f64;
        match i.cmp(&j) {
            std::cmp::Ordering::Less => 0.0,
            std::cmp::Ordering::Equal => d,
            std::cmp::Ordering::Greater => m[(i, j)] as f64 * d,
        }
    });
    let labs = Mat::<f64>::from_fn(n, n, |i, j| l[(i, j)].abs());
    let prod = &l * l.transpose();
    let abs_prod = &labs * labs.transpose();
    let gamma = 2.0 * (n + 1) as f64 * EPS;
    let (mut worst, mut at) = (0.0f64, (0, 0));
    for j in 0..n {
        for i in j..n {
            let a = if i == j {
                diag[n - 1 - j] as f64
            } else {
                h[(n - 1 - i, n - 1 - j)] as f64
            };
            let ratio =
                not_nan((prod[(i, j)] - a).abs() / (gamma * abs_prod[(i, j)] + f64::MIN_POSITIVE));
            if ratio > worst {
                (worst, at) = (ratio, (i, j));
            }
        }
    }
    (worst, at)
}

/// The factor check (module docs) of the attempt with `damp` (fraction of the mean diagonal), with the CPU's
/// factor of the CPU's Hessian (damped alike) checked the same way and the
/// largest difference between the two factors reported.
pub fn factor(
    h_dev: &Mat<f32>,
    damp: f64,
    m: MatRef<'_, f32>,
    r: &[f32],
    h_cpu: &Mat<f32>,
) -> Check {
    let n = h_dev.nrows();
    let (worst, at) = backward_error(h_dev, &damped(h_dev, damp), m, r);
    let cpu_diag = damped(h_cpu, damp);
    let mut sf = SweepFactor::new(n);
    let cpu_ok = CpuBackend::default().sweep_factor(h_cpu.as_ref(), &cpu_diag, &mut sf);
    let (cpu_worst, cpu_m) = if cpu_ok {
        // M[i,j] = F[n-1-i, n-1-j]: `coef()` is the reversed view of M.
        let f = sf.coef();
        let cm = Mat::from_fn(n, n, |i, j| f[(n - 1 - i, n - 1 - j)]);
        (
            backward_error(h_cpu, &cpu_diag, cm.as_ref(), sf.r_diag()).0,
            Some(cm),
        )
    } else {
        (f64::INFINITY, None)
    };
    let max_diff = cpu_m.map_or(f64::NAN, |cm| {
        let mut d = 0.0f64;
        for j in 0..n {
            for i in j + 1..n {
                d = d.max((m[(i, j)] as f64 - cm[(i, j)] as f64).abs());
            }
        }
        d
    });
    Check::new(
        "factor",
        worst <= 1.0 && cpu_worst <= 1.0,
        worst,
        format!(
            "n={n}: worst |LLᵀ−A|/(2(n+1)ε·|L||Lᵀ|) = {worst:.3} at {at:?} (the CPU's factor: {cpu_worst:.3}); max |ΔM| device vs CPU {max_diff:.2e}"
        ),
    )
}

/// The whole-solve comparison (module docs) of a device's results with the CPU's, module by module, with
/// the columns in their order (no act-order).
pub fn compare(name: &str, dev: &[QuantizedLinear], cpu: &[QuantizedLinear]) -> Check {
    compare_in_order(name, dev, cpu, None)
}

/// [`compare`] with the sweep order of the columns: `order[k]` is the original column of sweep position `k`
/// (act-order's permutation; `None`: column order).
pub fn compare_in_order(
    name: &str,
    dev: &[QuantizedLinear],
    cpu: &[QuantizedLinear],
    order: Option<&[usize]>,
) -> Check {
    let fail = |why: String| Check::new(name, false, f64::INFINITY, why);
    if dev.len() != cpu.len() {
        return fail(format!("{} modules, the CPU {}", dev.len(), cpu.len()));
    }
    let (mut moved_total, mut codes_total, mut rows_moved, mut rows_total) = (0usize, 0, 0, 0);
    let (mut worst_scale, mut worst_loss, mut max_step) = (0f64, 0f64, 0i32);
    for (k, (d, c)) in dev.iter().zip(cpu).enumerate() {
        if (d.rows, d.cols, d.bits, d.sym) != (c.rows, c.cols, c.bits, c.sym)
            || d.codes.len() != c.codes.len()
            || c.codes.len() != c.rows * c.cols
        {
            return fail(format!("module {k}: shape or format differs"));
        }
        if d.method != c.method || d.damp.to_bits() != c.damp.to_bits() || d.g_idx != c.g_idx {
            return fail(format!(
                "module {k}: method {:?}/{:?}, damp {}/{}, or g_idx differ",
                d.method, c.method, d.damp, c.damp
            ));
        }
        if order.is_some_and(|o| o.len() != c.cols) {
            return fail(format!(
                "module {k}: the sweep order has not {} columns",
                c.cols
            ));
        }
        let rows = c.rows;
        let (moved, row_moved, step) = match code_rows(d, c, order) {
            Ok(v) => v,
            Err(why) => return fail(format!("module {k}: {why}")),
        };
        max_step = max_step.max(step);
        if moved * 100 > d.codes.len() {
            return fail(format!(
                "module {k}: {moved} of {} codes differ (over 1 %)",
                d.codes.len()
            ));
        }
        moved_total += moved;
        codes_total += d.codes.len();
        rows_moved += row_moved.iter().filter(|m| **m).count();
        rows_total += rows;
        if d.scales.len() != c.scales.len() || c.scales.len() % rows.max(1) != 0 {
            return fail(format!(
                "module {k}: {} scales, the CPU {}",
                d.scales.len(),
                c.scales.len()
            ));
        }
        for (i, (a, b)) in d.scales.iter().zip(&c.scales).enumerate() {
            if row_moved[i % rows] {
                continue;
            }
            let r = (a - b).abs() as f64 / (1e-3 * b.abs().max(1e-6) as f64);
            worst_scale = worst_scale.max(not_nan(r));
        }
        if c.method == Method::Gptq {
            let r = (d.loss - c.loss).abs() / (0.01 * c.loss.abs().max(1e-9));
            worst_loss = worst_loss.max(not_nan(r));
        }
    }
    let worst = worst_scale.max(worst_loss);
    Check::new(
        name,
        worst <= 1.0,
        worst,
        format!(
            "{moved_total} of {codes_total} codes differ (in {rows_moved} of {rows_total} rows, each row's first by one step; largest {max_step}); worst scale of the other rows |Δ|/1e-3 rel {worst_scale:.3}, loss |Δ|/1 % {worst_loss:.3}"
        ),
    )
}

/// The codes of `dev` against `cpu` row by row in sweep order: how many differ, which rows have a difference,
/// and the largest difference; an error when a row's first difference is more than one step.
fn code_rows(
    dev: &QuantizedLinear,
    cpu: &QuantizedLinear,
    order: Option<&[usize]>,
) -> Result<(usize, Vec<bool>, i32), String> {
    let (rows, cols) = (cpu.rows, cpu.cols);
    let (mut moved, mut max_step) = (0usize, 0i32);
    let mut row_moved = vec![false; rows];
    for (r, row_moved) in row_moved.iter_mut().enumerate() {
        for p in 0..cols {
            let col = order.map_or(p, |o| o[p]);
            let i = col * rows + r;
            let diff = (dev.codes[i] as i32 - cpu.codes[i] as i32).abs();
            if diff == 0 {
                continue;
            }
            moved += 1;
            max_step = max_step.max(diff);
            if !*row_moved && diff > 1 {
                return Err(format!(
                    "row {r}'s first differing code (column {col}, sweep position {p}) moved by {diff} ({} vs {}): a rounding tie moves one step",
                    dev.codes[i], cpu.codes[i]
                ));
            }
            *row_moved = true;
        }
    }
    Ok((moved, row_moved, max_step))
}

/// One input-group solve for [`solve_case`] and the timings.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    /// Output features of each of the group's modules.
    pub rows: Vec<usize>,
    pub n: usize,
    pub tokens: usize,
    pub params: GptqParams,
    pub recovery: RecoveryParams,
}

/// The default GPTQ settings with the ones a solve case varies.
pub fn params(
    bits: u32,
    group_size: i32,
    sym: bool,
    desc_act: bool,
    static_groups: bool,
    block_size: usize,
) -> GptqParams {
    GptqParams {
        bits,
        group_size,
        sym,
        desc_act,
        static_groups,
        block_size,
        ..GptqParams::default()
    }
}

/// The solve cases of a card check: g128 4-bit (the default), act-order with static groups, 3-bit g32 with
/// blocks of 32, 8-bit per row with a ragged last block; `n` features.
pub fn cases(n: usize, rows: usize) -> Vec<Case> {
    let p = params;
    let case = |name: &str, n: usize, params| Case {
        name: name.to_string(),
        rows: vec![rows, rows / 2 + 1],
        n,
        tokens: 2 * n,
        params,
        recovery: RecoveryParams::default(),
    };
    vec![
        case("solve w4 g128", n, p(4, 128, false, false, false, 128)),
        case(
            "solve w4 g128 act-order static",
            n,
            p(4, 128, false, true, true, 128),
        ),
        case(
            "solve w3 g32 blocks of 32",
            n,
            p(3, 32, false, false, false, 32),
        ),
        case(
            "solve w8 per-row sym, ragged block",
            n + 37,
            p(8, -1, true, false, false, 128),
        ),
    ]
}

/// Device and CPU results and seconds of one case's whole solve (accumulation included).
pub struct Solved {
    pub device: Vec<QuantizedLinear>,
    pub cpu: Vec<QuantizedLinear>,
    pub device_seconds: f64,
    pub cpu_seconds: f64,
    /// The CPU's sweep order under act-order (the permutation of its prepared Hessian).
    pub order: Option<Vec<usize>>,
}

impl Solved {
    /// [`compare_in_order`] of the two results in the CPU's sweep order.
    pub fn compare(&self, name: &str) -> Check {
        compare_in_order(name, &self.device, &self.cpu, self.order.as_deref())
    }
}

/// Runs `case` on `dev` and on the CPU with the same inputs.
pub fn solve_case(dev: &dyn Device, case: &Case, seed: u64) -> crate::Result<Solved> {
    let mut rng = Rng::new(seed);
    let batches = activations(case.tokens, case.n, 4, &mut rng);
    let weights: Vec<Mat<f32>> = case
        .rows
        .iter()
        .map(|&r| rng.matrix(r, case.n, 0.05))
        .collect();
    let run = |d: &dyn Device| -> crate::Result<(Vec<QuantizedLinear>, f64)> {
        let t = Instant::now();
        let mut s = d.open(case.n)?;
        for x in &batches {
            s.accumulate(x.as_ref(), 2.0 / case.tokens as f32)?;
        }
        let refs: Vec<&Mat<f32>> = weights.iter().collect();
        let spec = SolveSpec {
            params: &case.params,
            recovery: &case.recovery,
            module: &case.name,
            events: &NullSink,
        };
        let q = solve_with_fallback(&d.describe(), s.as_mut(), &refs, &spec)?;
        Ok((q, t.elapsed().as_secs_f64()))
    };
    let (device, device_seconds) = run(dev)?;
    let (cpu, cpu_seconds) = run(&CpuBackend::default())?;
    let order = case
        .params
        .desc_act
        .then(|| cpu_prepared(case.n, &batches, 2.0 / case.tokens as f32, true).perm);
    Ok(Solved {
        device,
        cpu,
        device_seconds,
        cpu_seconds,
        order: order.flatten(),
    })
}

/// Seconds of one factorisation attempt of a damped `n × n` Hessian on the device and on the CPU (the
/// CPU's `sweep_factor`), with the device's backward error; `tokens` rows of activations make the Hessian.
pub struct FactorTiming {
    pub n: usize,
    pub device_seconds: f64,
    pub cpu_seconds: f64,
    /// The attempt's matrix `A` in the CPU's layout (the prepared Hessian and the diagonal), for timing a
    /// vendor solver on the same input.
    pub hessian: Mat<f32>,
    pub diag: Vec<f32>,
    pub backward_error: Option<f64>,
}

/// Times one factorisation of an `n`-feature group (see [`FactorTiming`]); the backward error is
/// computed only when `check` (it costs `n³` host flops).
pub fn time_factor<V: Vendor + Send>(
    dev: &KernelDevice<V>,
    n: usize,
    tokens: usize,
    seed: u64,
    check: bool,
) -> DevResult<FactorTiming> {
    let mut rng = Rng::new(seed);
    let batches = activations(tokens, n, 4, &mut rng);
    let (mut ops, h) = device_hessian(dev, n, &batches, 2.0 / tokens as f32)?;
    drop(batches);
    let diag = damped(&h, 0.05);
    // One warm-up attempt (first launches load the module), then the timed one.
    ops.try_factor(&diag)?;
    let t = Instant::now();
    let ok = ops.try_factor(&diag)?;
    let device_seconds = t.elapsed().as_secs_f64();
    let backward = if ok && check {
        let (m, r) = ops.factor_host()?;
        Some(backward_error(&h, &diag, m.as_ref(), &r).0)
    } else if ok {
        None
    } else {
        Some(f64::INFINITY)
    };
    drop(ops);
    let mut sf = SweepFactor::new(n);
    let t = Instant::now();
    CpuBackend::default().sweep_factor(h.as_ref(), &diag, &mut sf);
    let cpu_seconds = t.elapsed().as_secs_f64();
    Ok(FactorTiming {
        n,
        device_seconds,
        cpu_seconds,
        hessian: h,
        diag,
        backward_error: backward,
    })
}
