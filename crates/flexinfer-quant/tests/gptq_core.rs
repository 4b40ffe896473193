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

fn params_of(cols: &[Vec<f32>], bits: u32, sym: bool) -> (Vec<f32>, Vec<f32>) {
    let rows = cols[0].len();
    let maxq = ((1u32 << bits) - 1) as f32;
    let mut s = vec![0.0; rows];
    let mut z = vec![0.0; rows];
    for r in 0..rows {
        let mut lo = cols.iter().map(|c| c[r]).fold(0.0f32, f32::min);
        let mut hi = cols.iter().map(|c| c[r]).fold(0.0f32, f32::max);
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
        s[r] = (hi - lo) / maxq;
        z[r] = if sym {
            (maxq + 1.0) / 2.0
        } else {
            (-lo / s[r]).round_ties_even()
        };
    }
    (s, z)
}

/// Unblocked GPTQ with the reference chain for U: one column at a time, every later column updated at once.
/// Group parameters follow the reference quirk: they are read from W as it stood at the start of the
/// enclosing 128-column block.
fn reference_gptq(w0: &Mat<f32>, h0: &Mat<f32>, p: &GptqParams, damp: f32) -> (Vec<u8>, Vec<i32>) {
    let (rows, cols) = (w0.nrows(), w0.ncols());
    let maxq = ((1u32 << p.bits) - 1) as f32;
    let gs = if p.group_size < 0 {
        cols
    } else {
        p.group_size as usize
    };
    let mut w = w0.clone();
    let mut h = h0.clone();
    let global = params_of(
        &(0..cols)
            .map(|c| (0..rows).map(|r| w[(r, c)]).collect())
            .collect::<Vec<_>>(),
        p.bits,
        p.sym,
    );
    for i in 0..cols {
        if h[(i, i)] == 0.0 {
            h[(i, i)] = 1.0;
            for r in 0..rows {
                w[(r, i)] = 0.0;
            }
        }
    }
    let col = |w: &Mat<f32>, c: usize| -> Vec<f32> { (0..rows).map(|r| w[(r, c)]).collect() };
    let statics: Vec<(Vec<f32>, Vec<f32>)> = (0..cols / gs)
        .map(|g| {
            params_of(
                &(g * gs..(g + 1) * gs)
                    .map(|c| col(&w, c))
                    .collect::<Vec<_>>(),
                p.bits,
                p.sym,
            )
        })
        .collect();
    let mut perm: Vec<usize> = (0..cols).collect();
    if p.desc_act {
        perm.sort_by(|&a, &b| {
            h[(b, b)]
                .partial_cmp(&h[(a, a)])
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        w = Mat::from_fn(rows, cols, |r, k| w[(r, perm[k])]);
        h = Mat::from_fn(cols, cols, |i, j| h[(perm[i], perm[j])]);
    }
    let mean = (0..cols).map(|i| h[(i, i)]).sum::<f32>() / cols as f32;
    for i in 0..cols {
        h[(i, i)] += damp * mean;
    }
    let l = h.llt(Side::Lower).expect("reference chol");
    let hinv = faer::linalg::solvers::DenseSolveCore::inverse(&l);
    let u = hinv
        .llt(Side::Lower)
        .expect("reference chol of inverse")
        .L()
        .transpose()
        .to_owned();

    let mut codes = vec![0u8; rows * cols];
    let mut g_idx = vec![0i32; cols];
    let mut snapshot = w.clone();
    let mut cur = global.clone();
    for k in 0..cols {
        if k % p.block_size == 0 {
            snapshot = w.clone();
        }
        if p.group_size > 0 {
            if p.static_groups {
                cur = statics[perm[k] / gs].clone();
            } else if k % gs == 0 {
                cur = params_of(
                    &(k..k + gs).map(|c| col(&snapshot, c)).collect::<Vec<_>>(),
                    p.bits,
                    p.sym,
                );
            }
            g_idx[perm[k]] = if p.static_groups {
                (perm[k] / gs) as i32
            } else {
                (k / gs) as i32
            };
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
    (codes, g_idx)
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
    match prepare_factor(&backend, h.clone(), p.desc_act, &rp, "test", &NullSink) {
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
    let (ref_codes, ref_gidx) = reference_gptq(&w, &h, &p, 0.01);
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
