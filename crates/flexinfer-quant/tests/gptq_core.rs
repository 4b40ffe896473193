//! The GPTQ solver against a straightforward, unblocked reference written here, plus properties.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use faer::{Mat, Side};
use flexinfer_quant::events::{MemorySink, NullSink};
use flexinfer_quant::gptq::{dequantize_weight, gptq_quantize, rtn_quantize, Method};
use flexinfer_quant::hessian::{prepare_factor, FactorOutcome, PreparedFactor};
use flexinfer_quant::linalg::{CpuBackend, FactorRoute, LinalgBackend, SweepFactor};
use flexinfer_quant::params::{GptqParams, RecoveryParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn gauss(rng: &mut StdRng) -> f32 {
    // Box-Muller; rand's distributions crate is not a dependency.
    let u1: f32 = rng.random_range(1e-7f32..1.0);
    let u2: f32 = rng.random_range(0.0f32..1.0);
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
}

/// Activations `[tokens, n]`; `correlated` mixes a few latent factors and gives channels very different scales.
fn activations(rng: &mut StdRng, tokens: usize, n: usize, correlated: bool) -> Mat<f32> {
    if !correlated {
        return Mat::from_fn(tokens, n, |_, _| gauss(rng));
    }
    let latent = 8;
    let z = Mat::from_fn(tokens, latent, |_, _| gauss(rng));
    let mix = Mat::from_fn(latent, n, |_, _| gauss(rng));
    let scale: Vec<f32> = (0..n)
        .map(|j| 0.2 + 3.0 * ((j * 7919) % n) as f32 / n as f32)
        .collect();
    let noise = Mat::from_fn(tokens, n, |_, _| 0.05 * gauss(rng));
    let x = &z * &mix + noise;
    Mat::from_fn(tokens, n, |t, j| x[(t, j)] * scale[j])
}

fn weights(rng: &mut StdRng, rows: usize, cols: usize) -> Mat<f32> {
    Mat::from_fn(rows, cols, |_, _| 0.05 * gauss(rng))
}

fn hessian(x: &Mat<f32>) -> Mat<f32> {
    let mut h = Mat::<f32>::zeros(x.ncols(), x.ncols());
    let b = CpuBackend::default();
    b.accumulate_hessian(h.as_mut(), x.as_ref(), 2.0 / x.nrows() as f32);
    b.finish_hessian(h.as_mut());
    h
}

fn quant(x: f32, s: f32, z: f32, maxq: f32) -> f32 {
    ((x / s).round_ties_even() + z).clamp(0.0, maxq)
}

/// Scale and zero of the range `[lo, hi]` (already containing zero) with the reference conventions.
fn range_params(mut lo: f32, mut hi: f32, maxq: f32, sym: bool) -> (f32, f32) {
    if sym {
        hi = hi.max(lo.abs());
        if lo < 0.0 {
            lo = -hi;
        }
    }
    if lo == 0.0 && hi == 0.0 {
        lo = -1.0;
        hi = 1.0;
    }
    let s = (hi - lo) / maxq;
    let z = if sym {
        (maxq + 1.0) / 2.0
    } else {
        (-lo / s).round_ties_even()
    };
    (s, z)
}

/// Per-row min/max parameters of `cols`; with `clip = Some(weights)` the clipping search: every row's range
/// shrunk by 1, 0.975, …, 0.5 and the factor with the least `Σ weight·(x − dequant)²` kept (first on ties).
fn params_of(
    cols: &[Vec<f32>],
    bits: u32,
    sym: bool,
    clip: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let rows = cols[0].len();
    let maxq = ((1u32 << bits) - 1) as f32;
    let mut s = vec![0.0; rows];
    let mut z = vec![0.0; rows];
    for r in 0..rows {
        let lo = cols.iter().map(|c| c[r]).fold(0.0f32, f32::min);
        let hi = cols.iter().map(|c| c[r]).fold(0.0f32, f32::max);
        (s[r], z[r]) = range_params(lo, hi, maxq, sym);
        let Some(weights) = clip else { continue };
        let mut best = f64::INFINITY;
        for k in 0..=20 {
            let f = 1.0 - 0.5 * k as f32 / 20.0;
            let (cs, cz) = range_params(lo * f, hi * f, maxq, sym);
            let err: f64 = cols
                .iter()
                .zip(weights)
                .map(|(c, &w)| {
                    let d = c[r] - cs * (quant(c[r], cs, cz, maxq) - cz);
                    f64::from(w * d * d)
                })
                .sum();
            if err < best {
                best = err;
                (s[r], z[r]) = (cs, cz);
            }
        }
    }
    (s, z)
}

/// The group-aware order written out: groups of `gs` columns by descending maximum diagonal, the columns
/// of each by descending diagonal (stable sorts).
fn group_aware_perm(diag: &[f32], gs: usize) -> Vec<usize> {
    let groups: Vec<Vec<usize>> = (0..diag.len() / gs)
        .map(|g| (g * gs..(g + 1) * gs).collect())
        .collect();
    let gmax = |g: &Vec<usize>| g.iter().map(|&c| diag[c]).fold(f32::MIN, f32::max);
    let mut order: Vec<&Vec<usize>> = groups.iter().collect();
    order.sort_by(|a, b| gmax(b).partial_cmp(&gmax(a)).unwrap());
    let mut perm = Vec::new();
    for g in order {
        let mut cols = g.clone();
        cols.sort_by(|&a, &b| diag[b].partial_cmp(&diag[a]).unwrap());
        perm.extend(cols);
    }
    perm
}

/// What the reference returns: codes (input-major, original order), `g_idx`, and the scales by group index.
struct RefResult {
    codes: Vec<u8>,
    g_idx: Vec<i32>,
    scales: Vec<f32>,
}

/// Unblocked GPTQ with the reference chain for U: one column at a time, every later column updated at once.
/// Group parameters follow the reference quirk: they are read from W as it stood at the start of the
/// enclosing 128-column block. Group-aware order: each group's parameters come from its own columns when the
/// sweep reaches its first one, and they are stored under the original group. Clipping search: the error
/// weight of sweep position k is `1/U_kk²`.
fn reference_gptq(w0: &Mat<f32>, h0: &Mat<f32>, p: &GptqParams, damp: f32) -> RefResult {
    let (rows, cols) = (w0.nrows(), w0.ncols());
    let maxq = ((1u32 << p.bits) - 1) as f32;
    let gs = if p.group_size < 0 {
        cols
    } else {
        p.group_size as usize
    };
    let mut w = w0.clone();
    let mut h = h0.clone();
    for i in 0..cols {
        if h[(i, i)] == 0.0 {
            h[(i, i)] = 1.0;
            for r in 0..rows {
                w[(r, i)] = 0.0;
            }
        }
    }
    let mut perm: Vec<usize> = (0..cols).collect();
    let diag: Vec<f32> = (0..cols).map(|i| h[(i, i)]).collect();
    if p.desc_act {
        perm.sort_by(|&a, &b| {
            h[(b, b)]
                .partial_cmp(&h[(a, a)])
                .unwrap_or(std::cmp::Ordering::Equal)
        });
    } else if p.act_group_aware {
        perm = group_aware_perm(&diag, gs);
    }
    let group_aware = p.act_group_aware && !p.desc_act;
    let wp = Mat::from_fn(rows, cols, |r, k| w[(r, perm[k])]);
    let mut hp = Mat::from_fn(cols, cols, |i, j| h[(perm[i], perm[j])]);
    let mean = (0..cols).map(|i| hp[(i, i)]).sum::<f32>() / cols as f32;
    for i in 0..cols {
        hp[(i, i)] += damp * mean;
    }
    let l = hp.llt(Side::Lower).expect("reference chol");
    let hinv = faer::linalg::solvers::DenseSolveCore::inverse(&l);
    let u = hinv
        .llt(Side::Lower)
        .expect("reference chol of inverse")
        .L()
        .transpose()
        .to_owned();
    // The clipping search's weight of each original column.
    let mut weight = vec![1.0f32; cols];
    for k in 0..cols {
        weight[perm[k]] = 1.0 / (u[(k, k)] * u[(k, k)]);
    }
    let clip = |idx: &[usize]| -> Option<Vec<f32>> {
        p.clip_search
            .then(|| idx.iter().map(|&c| weight[c]).collect())
    };
    let col0 = |m: &Mat<f32>, c: usize| -> Vec<f32> { (0..rows).map(|r| m[(r, c)]).collect() };
    let all: Vec<usize> = (0..cols).collect();
    let global = params_of(
        &(0..cols).map(|c| col0(w0, c)).collect::<Vec<_>>(),
        p.bits,
        p.sym,
        clip(&all).as_deref(),
    );
    let statics: Vec<(Vec<f32>, Vec<f32>)> = (0..cols / gs)
        .map(|g| {
            let idx: Vec<usize> = (g * gs..(g + 1) * gs).collect();
            params_of(
                &idx.iter().map(|&c| col0(&w, c)).collect::<Vec<_>>(),
                p.bits,
                p.sym,
                clip(&idx).as_deref(),
            )
        })
        .collect();
    let mut w = wp;

    let n_groups = cols.div_ceil(gs);
    let mut scales = vec![0f32; n_groups * rows];
    let mut codes = vec![0u8; rows * cols];
    let mut g_idx = vec![0i32; cols];
    let mut snapshot = w.clone();
    let mut cur = global.clone();
    if p.group_size < 0 {
        scales.copy_from_slice(&global.0);
    }
    for (g, st) in statics.iter().enumerate().filter(|_| p.static_groups) {
        scales[g * rows..(g + 1) * rows].copy_from_slice(&st.0);
    }
    for k in 0..cols {
        if k % p.block_size == 0 {
            snapshot = w.clone();
        }
        if p.group_size > 0 {
            let g = if p.static_groups || group_aware {
                perm[k] / gs
            } else {
                k / gs
            };
            if p.static_groups {
                cur = statics[perm[k] / gs].clone();
            } else if k % gs == 0 {
                cur = params_of(
                    &(k..k + gs).map(|c| col0(&snapshot, c)).collect::<Vec<_>>(),
                    p.bits,
                    p.sym,
                    clip(&perm[k..k + gs]).as_deref(),
                );
                scales[g * rows..(g + 1) * rows].copy_from_slice(&cur.0);
            }
            g_idx[perm[k]] = g as i32;
        }
        let d = u[(k, k)];
        let mut err = vec![0.0f32; rows];
        for r in 0..rows {
            let q = quant(w[(r, k)], cur.0[r], cur.1[r], maxq);
            codes[perm[k] * rows + r] = q as u8;
            err[r] = (w[(r, k)] - cur.0[r] * (q - cur.1[r])) / d;
        }
        for j in k + 1..cols {
            for r in 0..rows {
                w[(r, j)] -= err[r] * u[(k, j)];
            }
        }
    }
    RefResult {
        codes,
        g_idx,
        scales,
    }
}

fn engine(
    w: &Mat<f32>,
    h: &Mat<f32>,
    p: &GptqParams,
    route: FactorRoute,
) -> flexinfer_quant::gptq::QuantizedLinear {
    let backend = CpuBackend { route };
    let rp = RecoveryParams {
        damp_percent: 0.01,
        ..RecoveryParams::default()
    };
    let order = p.column_order(w.ncols());
    match prepare_factor(&backend, h.clone(), order, &rp, "test", &NullSink) {
        FactorOutcome::Factor(f) => gptq_quantize(&backend, w, &f, p),
        FactorOutcome::Exhausted => panic!("well-conditioned Hessian must factor"),
    }
}

fn mismatch(a: &[u8], b: &[u8]) -> f64 {
    a.iter().zip(b).filter(|(x, y)| x != y).count() as f64 / a.len() as f64
}

fn check_case(seed: u64, rows: usize, cols: usize, correlated: bool, p: GptqParams) {
    let mut rng = StdRng::seed_from_u64(seed);
    let x = activations(&mut rng, 4 * cols, cols, correlated);
    let w = weights(&mut rng, rows, cols);
    let h = hessian(&x);
    let RefResult {
        codes: ref_codes,
        g_idx: ref_gidx,
        scales: ref_scales,
    } = reference_gptq(&w, &h, &p, 0.01);
    for route in [FactorRoute::Reference, FactorRoute::Reversed] {
        let q = engine(&w, &h, &p, route);
        let mm = mismatch(&q.codes, &ref_codes);
        let maxdiff = q
            .codes
            .iter()
            .zip(&ref_codes)
            .map(|(a, b)| (*a as i32 - *b as i32).abs())
            .max()
            .unwrap_or(0);
        eprintln!(
            "{} {} {:?} corr={correlated} mm={:.4}% maxdiff={maxdiff}",
            p.bits,
            p.group_size,
            route,
            mm * 100.0
        );
        // Identical integers up to float order: ill-conditioned correlated Hessians can cascade a rare boundary flip.
        assert!(
            mm <= 0.005,
            "{p:?} {route:?} correlated={correlated}: {:.4}% codes differ",
            mm * 100.0
        );
        assert_eq!(q.g_idx, ref_gidx, "{p:?}: g_idx differs");
        // Scales by group index: the same groups in the same slots. With identical codes W went the same way,
        // so every scale agrees; a rare boundary flip (above) changes the later groups' W, and with it a few
        // of their scales (a scale in the wrong slot would make most of them differ).
        let off = q
            .scales
            .iter()
            .zip(&ref_scales)
            .filter(|(a, b)| (*a - *b).abs() > 1e-4 * b.abs().max(1e-6))
            .count();
        let allowed = if mm == 0.0 { 0 } else { ref_scales.len() / 20 };
        assert!(
            off <= allowed,
            "{p:?} {route:?}: {off} of {} scales differ (codes {:.4}%)",
            ref_scales.len(),
            mm * 100.0
        );
    }
}

#[test]
fn matches_unblocked_reference_across_settings() {
    let cases = [
        GptqParams {
            bits: 4,
            group_size: 128,
            ..Default::default()
        },
        GptqParams {
            bits: 4,
            group_size: -1,
            ..Default::default()
        },
        GptqParams {
            bits: 4,
            group_size: 32,
            sym: false,
            ..Default::default()
        },
        GptqParams {
            bits: 3,
            group_size: 64,
            ..Default::default()
        },
        GptqParams {
            bits: 2,
            group_size: 32,
            sym: false,
            ..Default::default()
        },
        GptqParams {
            bits: 8,
            group_size: 64,
            ..Default::default()
        },
        GptqParams {
            bits: 4,
            group_size: 64,
            desc_act: true,
            ..Default::default()
        },
        GptqParams {
            bits: 4,
            group_size: 32,
            desc_act: true,
            static_groups: true,
            ..Default::default()
        },
        GptqParams {
            bits: 4,
            group_size: 128,
            desc_act: true,
            sym: false,
            ..Default::default()
        },
    ];
    for (i, p) in cases.into_iter().enumerate() {
        check_case(10 + i as u64, 64, 256, i % 2 == 0, p.clone());
        check_case(100 + i as u64, 32, 384, i % 2 == 1, p);
    }
}

/// Group sizes that the block size does not divide (nor they it): a group that starts inside a block reads
/// the block-start W past the block's end, as the reference does.
#[test]
fn groups_the_block_size_does_not_divide_match_the_reference() {
    for (i, (gs, bs)) in [(48i32, 128usize), (48, 32), (96, 64)]
        .into_iter()
        .enumerate()
    {
        let p = GptqParams {
            bits: 4,
            group_size: gs,
            block_size: bs,
            sym: i % 2 == 0,
            ..Default::default()
        };
        check_case(200 + i as u64, 32, 384, i % 2 == 1, p);
    }
}

#[test]
fn two_level_sweep_matches_reference_beyond_one_outer_block() {
    // More input columns than one outer block (1024), so the deferred wide update is exercised.
    check_case(
        200,
        16,
        1280,
        true,
        GptqParams {
            bits: 4,
            group_size: 32,
            desc_act: true,
            ..Default::default()
        },
    );
    check_case(
        201,
        16,
        1280,
        false,
        GptqParams {
            bits: 4,
            group_size: 128,
            ..Default::default()
        },
    );
}

#[test]
fn row_parallel_sweep_matches_reference() {
    // Enough rows that the in-block sweep is split across threads.
    check_case(
        300,
        300,
        256,
        true,
        GptqParams {
            bits: 4,
            group_size: 64,
            desc_act: true,
            ..Default::default()
        },
    );
    check_case(
        301,
        520,
        128,
        false,
        GptqParams {
            bits: 3,
            group_size: -1,
            sym: false,
            ..Default::default()
        },
    );
}

#[test]
fn desc_act_g_idx_is_a_permutation_of_groups() {
    let p = GptqParams {
        bits: 4,
        group_size: 32,
        desc_act: true,
        ..Default::default()
    };
    let mut rng = StdRng::seed_from_u64(7);
    let x = activations(&mut rng, 512, 128, true);
    let w = weights(&mut rng, 32, 128);
    let q = engine(&w, &hessian(&x), &p, FactorRoute::Reversed);
    let mut counts = [0usize; 4];
    for &g in &q.g_idx {
        counts[g as usize] += 1;
    }
    assert_eq!(counts, [32; 4]);
    assert!(
        q.g_idx.windows(2).any(|w| w[0] > w[1]),
        "act-order g_idx should be non-monotonic here"
    );
}

fn output_error(x: &Mat<f32>, w: &Mat<f32>, q: &Mat<f32>) -> f32 {
    let d = x * (w - q).transpose();
    d.norm_l2().powi(2)
}

#[test]
fn gptq_beats_rtn_on_correlated_activations() {
    let mut rng = StdRng::seed_from_u64(3);
    let (rows, cols) = (96, 256);
    let x = activations(&mut rng, 1024, cols, true);
    let w = weights(&mut rng, rows, cols);
    for p in [
        GptqParams {
            bits: 4,
            group_size: 128,
            ..Default::default()
        },
        GptqParams {
            bits: 3,
            group_size: -1,
            sym: false,
            desc_act: true,
            ..Default::default()
        },
    ] {
        let g = engine(&w, &hessian(&x), &p, FactorRoute::Reversed);
        let r = rtn_quantize(&w, &p);
        let eg = output_error(&x, &w, &dequantize_weight(&g));
        let er = output_error(&x, &w, &dequantize_weight(&r));
        assert!(
            eg < 0.8 * er,
            "{p:?}: GPTQ error {eg} not clearly below RTN {er}"
        );
        assert_eq!(g.method, Method::Gptq);
        assert_eq!(r.method, Method::Rtn);
    }
}

#[test]
fn hessian_is_symmetric_and_matches_a_direct_product() {
    let mut rng = StdRng::seed_from_u64(11);
    let x = activations(&mut rng, 300, 96, false);
    let h = hessian(&x);
    let direct = x.transpose() * &x * faer::Scale(2.0 / 300.0);
    assert!((&h - &direct).norm_l2() / direct.norm_l2() < 1e-5);
    assert!((&h - h.transpose()).norm_l2() == 0.0);
}

#[test]
fn sweep_factor_routes_agree_and_factor_h() {
    let mut rng = StdRng::seed_from_u64(5);
    let n = 200;
    let x = activations(&mut rng, 600, n, true);
    let h = hessian(&x);
    let mean = (0..n).map(|i| h[(i, i)]).sum::<f32>() / n as f32;
    let diag: Vec<f32> = (0..n).map(|i| h[(i, i)] + 0.01 * mean).collect();
    let mut hd = h.clone();
    for i in 0..n {
        hd[(i, i)] = diag[i];
    }
    let factor = |route| {
        let mut f = SweepFactor::new(n);
        // Garbage on and below the diagonal of `h` must not matter: only its strict upper triangle is read.
        let mut hu = h.clone();
        for j in 0..n {
            for i in j..n {
                hu[(i, j)] = f32::NAN;
            }
        }
        assert!(CpuBackend { route }.sweep_factor(hu.as_ref(), &diag, &mut f));
        f
    };
    let fa = factor(FactorRoute::Reference);
    let fb = factor(FactorRoute::Reversed);
    let (ra, rb) = (fa.r_matrix(), fb.r_matrix());
    let rel = (&ra - &rb).norm_l2() / ra.norm_l2();
    assert!(rel < 1e-3, "routes differ by {rel}");
    // R·Rᵀ = H, and R = U⁻¹ for the reference tools' U = chol_upper(H⁻¹): U·R = I.
    let rrt = &rb * rb.transpose();
    let e = (&rrt - &hd).norm_l2() / hd.norm_l2();
    assert!(e < 1e-5, "R·Rᵀ deviates from H by {e}");
    let hinv = hd
        .llt(Side::Lower)
        .map(|l| faer::linalg::solvers::DenseSolveCore::inverse(&l))
        .expect("chol");
    let u = hinv
        .llt(Side::Lower)
        .expect("chol")
        .L()
        .transpose()
        .to_owned();
    let ur = &u * &rb;
    let eye = Mat::<f32>::identity(n, n);
    let e = (&ur - &eye).norm_l2() / (n as f32).sqrt();
    assert!(e < 1e-2, "U·R deviates from I by {e}");
    // A failed factorisation leaves `h` usable for the next attempt: an indefinite diagonal fails, then the
    // damped one succeeds from the same input with the same result.
    let bad: Vec<f32> = vec![-1.0; n];
    let mut f = SweepFactor::new(n);
    assert!(!CpuBackend::default().sweep_factor(h.as_ref(), &bad, &mut f));
    assert!(CpuBackend::default().sweep_factor(h.as_ref(), &diag, &mut f));
    assert_eq!(f.r_matrix(), rb);
}

#[test]
fn rank_deficient_and_non_finite_hessians_recover() {
    let backend = CpuBackend::default();
    let p = GptqParams {
        bits: 4,
        group_size: 32,
        ..Default::default()
    };
    let mut rng = StdRng::seed_from_u64(9);
    // Fewer tokens than channels, a dead channel, and a zero damp start: the first try fails.
    let mut x = activations(&mut rng, 16, 64, true);
    for t in 0..16 {
        x[(t, 5)] = 0.0;
    }
    let mut h = hessian(&x);
    h[(3, 7)] = f32::NAN;
    h[(7, 3)] = f32::INFINITY;
    let rp = RecoveryParams {
        damp_percent: 0.0,
        damp_auto_increment: 0.1,
        ..RecoveryParams::default()
    };
    let sink = MemorySink::default();
    let w = weights(&mut rng, 32, 64);
    let f: PreparedFactor = match prepare_factor(&backend, h, false, &rp, "m", &sink) {
        FactorOutcome::Factor(f) => f,
        FactorOutcome::Exhausted => panic!("must recover"),
    };
    assert!(f.dead[5]);
    let ev = sink.named("hessian_recovery");
    assert!(
        ev.iter()
            .any(|e| e["result"] == "sanitized" && e["sanitized"] == 2),
        "{ev:?}"
    );
    let q = gptq_quantize(&backend, &w, &f, &p);
    assert!(q.scales.iter().all(|s| s.is_finite()));
    assert!(dequantize_weight(&q)
        .col(5)
        .iter()
        .all(|v| *v == 0.0 || v.abs() < 0.2));
}

#[test]
fn indefinite_hessian_exhausts_and_reports_each_attempt() {
    let backend = CpuBackend::default();
    let n = 8;
    let mut h = Mat::<f32>::identity(n, n);
    h[(0, 1)] = 1e9;
    h[(1, 0)] = 1e9;
    let sink = MemorySink::default();
    let rp = RecoveryParams::default();
    let out = prepare_factor(
        &backend,
        h,
        false,
        &rp,
        "model.layers.0.mlp.down_proj",
        &sink,
    );
    assert!(matches!(out, FactorOutcome::Exhausted));
    let ev = sink.named("hessian_recovery");
    let damps: Vec<f64> = ev
        .iter()
        .filter_map(|e| e.get("damp").and_then(|d| d.as_f64()))
        .collect();
    assert_eq!(damps.len(), 10, "damp sweep 0.05..0.95 step 0.1: {damps:?}");
    let floors: Vec<f64> = ev
        .iter()
        .filter_map(|e| e.get("floor").and_then(|d| d.as_f64()))
        .collect();
    assert_eq!(floors.len(), 6);
    assert!(
        (floors[0] - 0.01).abs() < 1e-6 && (floors[5] - 1000.0).abs() < 1e-2,
        "{floors:?}"
    );
    assert_eq!(
        ev.last().and_then(|e| e["result"].as_str()),
        Some("exhausted")
    );

    // A milder off-diagonal is rescued by a diagonal floor.
    let mut h2 = Mat::<f32>::identity(n, n);
    h2[(0, 1)] = 50.0;
    h2[(1, 0)] = 50.0;
    let sink2 = MemorySink::default();
    match prepare_factor(&backend, h2, false, &rp, "m", &sink2) {
        FactorOutcome::Factor(f) => assert_eq!(f.damp, 0.0),
        FactorOutcome::Exhausted => panic!("floor 100 must rescue an off-diagonal of 50"),
    }
}

#[test]
fn groups_wider_than_a_block_match_reference() {
    // The reference reads a group's parameters when the group starts, from W as of that block's start; a
    // 256- or 512-column group reaches into later blocks, whose columns it sees with earlier blocks' errors only.
    check_case(
        400,
        48,
        512,
        true,
        GptqParams {
            bits: 4,
            group_size: 256,
            ..Default::default()
        },
    );
    check_case(
        401,
        40,
        1024,
        true,
        GptqParams {
            bits: 3,
            group_size: 512,
            sym: false,
            desc_act: true,
            ..Default::default()
        },
    );
}

#[test]
fn group_aware_order_and_clipping_search_match_the_reference() {
    let gar = |bits, group_size, sym| GptqParams {
        bits,
        group_size,
        sym,
        act_group_aware: true,
        ..Default::default()
    };
    let clip = |p: GptqParams| GptqParams {
        clip_search: true,
        ..p
    };
    let cases = [
        gar(4, 128, true),
        gar(3, 64, true),
        gar(2, 32, false),
        gar(4, -1, true),
        // A group wider than the block that the block size does not divide.
        GptqParams {
            block_size: 32,
            ..gar(4, 48, true)
        },
        // Act-order wins over group-aware reordering.
        GptqParams {
            desc_act: true,
            ..gar(4, 64, true)
        },
        GptqParams {
            static_groups: true,
            ..gar(3, 32, false)
        },
        clip(GptqParams {
            bits: 2,
            group_size: 32,
            ..Default::default()
        }),
        clip(gar(3, 128, true)),
        clip(gar(2, 64, false)),
        clip(GptqParams {
            bits: 3,
            group_size: -1,
            ..Default::default()
        }),
        clip(GptqParams {
            static_groups: true,
            desc_act: true,
            ..gar(2, 32, true)
        }),
    ];
    for (i, p) in cases.into_iter().enumerate() {
        check_case(400 + i as u64, 48, 384, i % 2 == 0, p.clone());
    }
}

#[test]
fn group_aware_order_keeps_each_column_in_its_own_group() {
    let mut rng = StdRng::seed_from_u64(17);
    let x = activations(&mut rng, 512, 256, true);
    let w = weights(&mut rng, 32, 256);
    let h = hessian(&x);
    let p = GptqParams {
        bits: 4,
        group_size: 32,
        act_group_aware: true,
        ..Default::default()
    };
    let rp = RecoveryParams::default();
    let FactorOutcome::Factor(f) = prepare_factor(
        &CpuBackend::default(),
        h.clone(),
        p.column_order(256),
        &rp,
        "t",
        &NullSink,
    ) else {
        panic!("must factor")
    };
    let perm = f.perm.clone().expect("group-aware order permutes");
    assert_ne!(
        perm,
        (0..256).collect::<Vec<_>>(),
        "the order must change here"
    );
    for (k, chunk) in perm.chunks(32).enumerate() {
        let g = chunk[0] / 32;
        assert!(
            chunk.iter().all(|&c| c / 32 == g),
            "sweep group {k} mixes groups: {chunk:?}"
        );
        assert!(
            chunk.windows(2).all(|w| h[(w[0], w[0])] >= h[(w[1], w[1])]),
            "group {g}: columns not by descending diagonal"
        );
    }
    let q = gptq_quantize(&CpuBackend::default(), &w, &f, &p);
    let want: Vec<i32> = (0..256).map(|c| c / 32).collect();
    assert_eq!(q.g_idx, want, "the checkpoint keeps the plain layout");
}

/// `‖X (W − Q)ᵀ‖²` summed over a few seeds of a module whose activations have a few very loud channels in
/// every group (the case the reordering is for), for `p` and `p` with `edit` applied.
fn output_errors(p: &GptqParams, edit: impl Fn(&mut GptqParams), seeds: u64) -> (f64, f64) {
    let (mut base, mut changed) = (0.0f64, 0.0f64);
    for seed in 0..seeds {
        let mut rng = StdRng::seed_from_u64(900 + seed);
        let (rows, cols) = (64, 256);
        let mut x = activations(&mut rng, 1024, cols, true);
        // One loud channel in four, placed at random inside each group.
        for c in 0..cols {
            if rng.random_range(0..4) == 0 {
                for t in 0..x.nrows() {
                    x[(t, c)] *= 6.0;
                }
            }
        }
        let w = weights(&mut rng, rows, cols);
        let h = hessian(&x);
        let mut q = p.clone();
        edit(&mut q);
        for (params, acc) in [(p, &mut base), (&q, &mut changed)] {
            let g = engine(&w, &h, params, FactorRoute::Reversed);
            *acc += f64::from(output_error(&x, &w, &dequantize_weight(&g)));
        }
    }
    (base, changed)
}

#[test]
fn group_aware_order_lowers_the_output_error_at_low_widths() {
    for bits in [2, 3] {
        let p = GptqParams {
            bits,
            group_size: 64,
            ..Default::default()
        };
        let (plain, gar) = output_errors(&p, |q| q.act_group_aware = true, 4);
        eprintln!("{bits} bits: plain {plain:.4} group-aware {gar:.4}");
        assert!(
            gar < plain,
            "{bits} bits: group-aware order error {gar} not below plain {plain}"
        );
    }
}

/// The search minimises each group's error on W as the group starts; the sweep's error feedback then moves the
/// group's later columns, which a shrunk range may clamp. So it is not a guaranteed gain end to end: on this
/// construction it lowers the error at 2 bits in input order and at 3 bits group-aware, and raises it at 2
/// bits group-aware (15134 → 18243 when written), which is why its default follows the trained-model
/// measurement (docs/benchmarks.md). The quantizer-level guarantee is tested in `numerics::quantizer`.
#[test]
fn clipping_search_lowers_the_output_error_at_low_widths() {
    for (bits, gar) in [(2, false), (3, true)] {
        let p = GptqParams {
            bits,
            group_size: 64,
            act_group_aware: gar,
            ..Default::default()
        };
        let (plain, clipped) = output_errors(&p, |q| q.clip_search = true, 4);
        eprintln!("{bits} bits gar={gar}: min/max {plain:.4} clipped {clipped:.4}");
        assert!(
            clipped < plain,
            "{bits} bits gar={gar}: clipped error {clipped} not below min/max {plain}"
        );
    }
}

/// One round of the scale refinement written out: for each row, with the codes of `q` fixed, the scales `s` of
/// its groups minimising `(w − q(s))·H·(w − q(s))ᵀ` (H the calibration Hessian with the dead-column fix and no
/// damping), by the normal equations in f64, rounded to f16; a row keeps `q`'s scales unless that lowers its
/// error. Groups whose codes all sit at the zero-point keep theirs (their scale does not matter).
fn reference_refined_scales(
    w0: &Mat<f32>,
    h0: &Mat<f32>,
    q: &flexinfer_quant::gptq::QuantizedLinear,
) -> Vec<f32> {
    let (rows, cols) = (w0.nrows(), w0.ncols());
    let groups = q.scales.len() / rows;
    let mut hd = Mat::<f64>::from_fn(cols, cols, |i, j| f64::from(h0[(i, j)]));
    let dead: Vec<bool> = (0..cols).map(|i| h0[(i, i)] == 0.0).collect();
    for i in 0..cols {
        if dead[i] {
            hd[(i, i)] = 1.0;
        }
    }
    let f16 = |v: f64| f64::from(half::f16::from_f64(v).to_f64() as f32);
    let mut out = q.scales.clone();
    for r in 0..rows {
        let w: Vec<f64> = (0..cols)
            .map(|c| if dead[c] { 0.0 } else { f64::from(w0[(r, c)]) })
            .collect();
        let a: Vec<f64> = (0..cols)
            .map(|c| {
                let g = q.g_idx[c] as usize;
                f64::from(q.codes[c * rows + r]) - f64::from(q.zeros[g * rows + r])
            })
            .collect();
        let mut m = vec![vec![0f64; groups]; groups];
        let mut b = vec![0f64; groups];
        for i in 0..cols {
            let gi = q.g_idx[i] as usize;
            for j in 0..cols {
                let gj = q.g_idx[j] as usize;
                m[gi][gj] += a[i] * hd[(i, j)] * a[j];
                b[gi] += a[i] * hd[(i, j)] * w[j];
            }
        }
        let s_old: Vec<f64> = (0..groups)
            .map(|g| f16(f64::from(q.scales[g * rows + r])))
            .collect();
        let err = |s: &[f64]| -> f64 {
            let mut e = 0.0;
            for i in 0..groups {
                for j in 0..groups {
                    e += s[i] * m[i][j] * s[j];
                }
                e -= 2.0 * b[i] * s[i];
            }
            e
        };
        // Gaussian elimination on the free groups (the fixed ones moved to the right-hand side).
        let free: Vec<usize> = (0..groups).filter(|&g| m[g][g] > 0.0).collect();
        let n = free.len();
        let mut aug: Vec<Vec<f64>> = free
            .iter()
            .map(|&i| {
                let mut row: Vec<f64> = free.iter().map(|&j| m[i][j]).collect();
                let fixed: f64 = (0..groups)
                    .filter(|&j| m[j][j] <= 0.0)
                    .map(|j| m[i][j] * s_old[j])
                    .sum();
                row.push(b[i] - fixed);
                row
            })
            .collect();
        for c in 0..n {
            let piv = (c..n)
                .max_by(|&x, &y| aug[x][c].abs().partial_cmp(&aug[y][c].abs()).unwrap())
                .unwrap();
            aug.swap(c, piv);
            for rr in 0..n {
                if rr != c {
                    let f = aug[rr][c] / aug[c][c];
                    let pivot = aug[c].clone();
                    for (v, pv) in aug[rr].iter_mut().zip(&pivot).skip(c) {
                        *v -= f * pv;
                    }
                }
            }
        }
        let mut s_new = s_old.clone();
        for (i, &g) in free.iter().enumerate() {
            s_new[g] = f16(aug[i][n] / aug[i][i]);
        }
        if s_new.iter().all(|&s| s.is_finite() && s > 0.0) && err(&s_new) < err(&s_old) {
            for g in 0..groups {
                out[g * rows + r] = s_new[g] as f32;
            }
        }
    }
    out
}

#[test]
fn scale_refinement_keeps_the_codes_and_matches_the_reference() {
    let cases = [
        GptqParams {
            bits: 2,
            group_size: 64,
            act_group_aware: true,
            ..Default::default()
        },
        GptqParams {
            bits: 3,
            group_size: 32,
            ..Default::default()
        },
        GptqParams {
            bits: 4,
            group_size: 64,
            sym: false,
            act_group_aware: true,
            ..Default::default()
        },
        GptqParams {
            bits: 2,
            group_size: 32,
            desc_act: true,
            ..Default::default()
        },
        GptqParams {
            bits: 3,
            group_size: -1,
            ..Default::default()
        },
    ];
    for (i, p) in cases.into_iter().enumerate() {
        let mut rng = StdRng::seed_from_u64(700 + i as u64);
        // 130 rows: the engine builds its row-major copies in chunks of 64 rows, the last one partial.
        let (rows, cols) = (if i % 2 == 0 { 40 } else { 130 }, 256);
        let x = activations(&mut rng, 4 * cols, cols, i % 2 == 0);
        let w = weights(&mut rng, rows, cols);
        let mut h = hessian(&x);
        // One dead input channel.
        for j in 0..cols {
            h[(7, j)] = 0.0;
            h[(j, 7)] = 0.0;
        }
        let plain = engine(&w, &h, &p, FactorRoute::Reversed);
        let refined = engine(
            &w,
            &h,
            &GptqParams {
                refine_rounds: 1,
                ..p.clone()
            },
            FactorRoute::Reversed,
        );
        assert_eq!(
            refined.codes, plain.codes,
            "{p:?}: the refinement must not change the codes"
        );
        assert_eq!(refined.zeros, plain.zeros, "{p:?}: nor the zero-points");
        assert_eq!(refined.g_idx, plain.g_idx);
        let want = reference_refined_scales(&w, &h, &plain);
        let changed = want
            .iter()
            .zip(&plain.scales)
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            changed > want.len() / 2,
            "{p:?}: the reference refits only {changed} of {} scales",
            want.len()
        );
        // Equal up to one f16 step (the engine sums in f32 where the reference uses f64).
        let off: Vec<(usize, f32, f32)> = refined
            .scales
            .iter()
            .zip(&want)
            .enumerate()
            .filter(|(_, (a, b))| (*a - *b).abs() > 2e-3 * b.abs())
            .map(|(k, (a, b))| (k, *a, *b))
            .collect();
        assert!(
            off.len() <= want.len() / 100,
            "{p:?}: {} scales differ from the reference: {:?}",
            off.len(),
            &off[..off.len().min(5)]
        );
    }
}

#[test]
fn scale_refinement_lowers_the_output_error() {
    for bits in [2, 3, 4] {
        let p = GptqParams {
            bits,
            group_size: 64,
            act_group_aware: true,
            ..Default::default()
        };
        let (plain, refined) = output_errors(&p, |q| q.refine_rounds = 1, 4);
        eprintln!("{bits} bits: sweep scales {plain:.4} refined {refined:.4}");
        assert!(
            refined < plain,
            "{bits} bits: refined error {refined} not below {plain}"
        );
    }
}

/// Sweeping again with the refitted scales, and refitting again, goes on lowering the error (the default
/// runs seven rounds).
#[test]
fn more_refinement_rounds_lower_the_output_error_further() {
    for bits in [2, 3] {
        let p = GptqParams {
            bits,
            group_size: 64,
            act_group_aware: true,
            refine_rounds: 1,
            ..Default::default()
        };
        let (one, seven) = output_errors(&p, |q| q.refine_rounds = 7, 4);
        eprintln!("{bits} bits: one round {one:.4} seven rounds {seven:.4}");
        assert!(
            seven < one,
            "{bits} bits: seven rounds {seven} not below one {one}"
        );
    }
}

/// Unblocked GPTQ (the reference chain for U, damp 0.01 as in `engine`) with every group's scale and zero
/// given (by group index) instead of found: the sweep of a refinement round after the first. Codes in
/// original order.
fn reference_sweep_with_scales(
    w0: &Mat<f32>,
    h0: &Mat<f32>,
    p: &GptqParams,
    scales: &[f32],
    zeros: &[u8],
) -> Vec<u8> {
    let (rows, cols) = (w0.nrows(), w0.ncols());
    let maxq = ((1u32 << p.bits) - 1) as f32;
    let gs = if p.group_size < 0 {
        cols
    } else {
        p.group_size as usize
    };
    let mut w = w0.clone();
    let mut h = h0.clone();
    for i in 0..cols {
        if h[(i, i)] == 0.0 {
            h[(i, i)] = 1.0;
            for r in 0..rows {
                w[(r, i)] = 0.0;
            }
        }
    }
    let diag: Vec<f32> = (0..cols).map(|i| h[(i, i)]).collect();
    let perm: Vec<usize> = if p.act_group_aware {
        group_aware_perm(&diag, gs)
    } else {
        (0..cols).collect()
    };
    let mut wp = Mat::from_fn(rows, cols, |r, k| w[(r, perm[k])]);
    let mut hp = Mat::from_fn(cols, cols, |i, j| h[(perm[i], perm[j])]);
    let mean = (0..cols).map(|i| hp[(i, i)]).sum::<f32>() / cols as f32;
    for i in 0..cols {
        hp[(i, i)] += 0.01 * mean;
    }
    let l = hp.llt(Side::Lower).expect("reference chol");
    let hinv = faer::linalg::solvers::DenseSolveCore::inverse(&l);
    let u = hinv
        .llt(Side::Lower)
        .expect("chol of inverse")
        .L()
        .transpose()
        .to_owned();
    let mut codes = vec![0u8; rows * cols];
    for k in 0..cols {
        let g = perm[k] / gs;
        let mut err = vec![0f32; rows];
        for r in 0..rows {
            let (s, z) = (scales[g * rows + r], f32::from(zeros[g * rows + r]));
            let q = quant(wp[(r, k)], s, z, maxq);
            codes[perm[k] * rows + r] = q as u8;
            err[r] = (wp[(r, k)] - s * (q - z)) / u[(k, k)];
        }
        for j in k + 1..cols {
            for r in 0..rows {
                wp[(r, j)] -= err[r] * u[(k, j)];
            }
        }
    }
    codes
}

/// `‖X·(w_r − q_r)ᵀ‖²` of every output row r.
fn row_output_errors(x: &Mat<f32>, w: &Mat<f32>, q: &Mat<f32>) -> Vec<f64> {
    let d = x * (w - q).transpose();
    (0..w.nrows())
        .map(|r| (0..d.nrows()).map(|t| f64::from(d[(t, r)]).powi(2)).sum())
        .collect()
}

/// A second round sweeps again with the first round's refitted scales (new codes for them) and refits the
/// scales to those codes, both against the unblocked references; a row whose second round did not lower its
/// output error keeps its first round, so no row ends above its first round.
#[test]
fn a_second_refinement_round_resweeps_with_the_refitted_scales() {
    for (i, p) in [
        GptqParams {
            bits: 2,
            group_size: 64,
            act_group_aware: true,
            ..Default::default()
        },
        GptqParams {
            bits: 3,
            group_size: 32,
            sym: false,
            ..Default::default()
        },
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = StdRng::seed_from_u64(800 + i as u64);
        let (rows, cols) = (32, 256);
        let x = activations(&mut rng, 4 * cols, cols, true);
        let w = weights(&mut rng, rows, cols);
        let h = hessian(&x);
        let one = engine(
            &w,
            &h,
            &GptqParams {
                refine_rounds: 1,
                ..p.clone()
            },
            FactorRoute::Reversed,
        );
        let two = engine(
            &w,
            &h,
            &GptqParams {
                refine_rounds: 2,
                ..p.clone()
            },
            FactorRoute::Reversed,
        );
        let swept = reference_sweep_with_scales(&w, &h, &p, &one.scales, &one.zeros);
        let resweep = flexinfer_quant::gptq::QuantizedLinear {
            codes: swept,
            ..one.clone()
        };
        let refit = reference_refined_scales(&w, &h, &resweep);
        let row_codes =
            |q: &[u8], r: usize| -> Vec<u8> { (0..cols).map(|c| q[c * rows + r]).collect() };
        let row_scales = |s: &[f32], r: usize| -> Vec<f32> {
            (0..s.len() / rows).map(|g| s[g * rows + r]).collect()
        };
        let (mut from_two, mut code_off, mut scale_off) = (0, 0usize, 0usize);
        for r in 0..rows {
            if row_codes(&two.codes, r) == row_codes(&one.codes, r)
                && row_scales(&two.scales, r) == row_scales(&one.scales, r)
            {
                continue; // kept its first round
            }
            from_two += 1;
            let (got, want) = (row_codes(&two.codes, r), row_codes(&resweep.codes, r));
            code_off += got.iter().zip(&want).filter(|(a, b)| a != b).count();
            let (got, want) = (row_scales(&two.scales, r), row_scales(&refit, r));
            scale_off += got
                .iter()
                .zip(&want)
                .filter(|(a, b)| (**a - **b).abs() > 2e-3 * b.abs())
                .count();
        }
        eprintln!("{p:?}: {from_two} of {rows} rows from the second round");
        assert!(
            from_two > rows / 4,
            "{p:?}: only {from_two} rows took the second round"
        );
        assert!(
            code_off * 200 <= from_two * cols,
            "{p:?}: {code_off} codes differ from the reference sweep"
        );
        assert!(
            scale_off * 50 <= from_two * (one.scales.len() / rows),
            "{p:?}: {scale_off} scales differ from the reference refit"
        );
        let (e1, e2) = (
            row_output_errors(&x, &w, &dequantize_weight(&one)),
            row_output_errors(&x, &w, &dequantize_weight(&two)),
        );
        for r in 0..rows {
            assert!(
                e2[r] <= e1[r] * (1.0 + 1e-3),
                "{p:?} row {r}: {} above its first round {}",
                e2[r],
                e1[r]
            );
        }
    }
}
