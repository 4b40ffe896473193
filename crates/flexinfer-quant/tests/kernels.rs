//! The device kernels of `kernels/gptq.cu`, without a GPU:
//! - compiled for the host from the same source (`kernels/host_harness.c` emulates the launches, each device thread a coroutine)
//!   and checked against the CPU backend: the in-block sweep to the bit, the Hessian and block-update GEMMs
//!   within a stated tolerance, the mirror exactly;
//! - compiled to PTX through NVRTC, loaded at run time (`scripts/install-deps.sh` installs the PyPI wheel
//!   under `~/.cache/flexinfer/nvrtc-<version>`; `FLEXINFER_NVRTC` names another libnvrtc). The NVRTC test
//!   is skipped, with a message, only when no libnvrtc can be found.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use faer::{Mat, MatRef};
use flexinfer_quant::device::driver::{Nvrtc, NvrtcOutput};
use flexinfer_quant::device::kernel::{Arg, Kernel, Launch, KERNEL_SOURCE};
use flexinfer_quant::gptq::{block_snapshot_cpu, sweep_block_cpu};
use flexinfer_quant::linalg::{CpuBackend, LinalgBackend, SweepFactor};
use flexinfer_quant::quantizer::{find_params, maxq, GroupParams};
use libloading::Symbol;
use std::ffi::c_int;
use std::path::{Path, PathBuf};

mod host_kernels;
mod support;
use host_kernels::{sym, KERNELS};
use support::random;

type HessianFn =
    unsafe extern "C" fn(*mut f32, c_int, *const f32, c_int, c_int, c_int, f32) -> c_int;
type MirrorFn = unsafe extern "C" fn(*mut f32, c_int, c_int) -> c_int;
type UpdateFn = unsafe extern "C" fn(
    *mut f32,
    c_int,
    *const f32,
    c_int,
    *const f32,
    i64,
    i64,
    c_int,
    c_int,
    c_int,
) -> c_int;
type SweepFn = unsafe extern "C" fn(
    *const f32,
    c_int,
    *const f32,
    c_int,
    *mut f32,
    c_int,
    *mut u8,
    c_int,
    *const f32,
    *const f32,
    *const c_int,
    *const f32,
    *const f32,
    c_int,
    c_int,
    f32,
    *mut f32,
) -> c_int;

type SnapshotFn = unsafe extern "C" fn(
    *mut f32,
    c_int,
    *mut f32,
    c_int,
    *const f32,
    c_int,
    *const f32,
    c_int,
    *const f32,
    c_int,
    c_int,
) -> c_int;
type ParamsFn =
    unsafe extern "C" fn(*const f32, c_int, c_int, c_int, f32, c_int, *mut f32, *mut f32) -> c_int;

fn ld(m: MatRef<'_, f32>) -> c_int {
    assert_eq!(m.row_stride(), 1);
    m.col_stride() as c_int
}

#[test]
fn hessian_and_mirror_kernels_match_the_cpu_backend() {
    let hess: Symbol<HessianFn> = sym(b"gptq_host_hessian_lower\0");
    let mirror: Symbol<MirrorFn> = sym(b"gptq_host_mirror_lower\0");
    let cpu = CpuBackend::default();
    for (n, tokens, seed) in [(17usize, 5usize, 1u64), (50, 37, 2), (96, 300, 3)] {
        let batches = [
            random(tokens, n, seed),
            random(tokens / 2 + 1, n, seed + 10),
        ];
        let alpha = 2.0 / tokens as f32;
        let mut want = Mat::<f32>::zeros(n, n);
        let mut got = Mat::<f32>::zeros(n, n);
        let mut bound = Mat::<f64>::zeros(n, n);
        for x in &batches {
            cpu.accumulate_hessian(want.as_mut(), x.as_ref(), alpha);
            let ldh = ld(got.as_ref());
            // SAFETY: pointers and leading dimensions of live faer matrices of the stated shapes.
            let rc = unsafe {
                hess(
                    got.as_ptr_mut(),
                    ldh,
                    x.as_ptr(),
                    ld(x.as_ref()),
                    x.nrows() as c_int,
                    n as c_int,
                    alpha,
                )
            };
            assert_eq!(rc, 0);
            for j in 0..n {
                for i in 0..n {
                    bound[(i, j)] += (0..x.nrows())
                        .map(|t| (x[(t, i)] as f64 * x[(t, j)] as f64).abs())
                        .sum::<f64>()
                        * alpha as f64;
                }
            }
        }
        // Tolerance: f32 sums of `tokens` products in another order; 8·tokens·ε of the sum of magnitudes.
        let eps = f32::EPSILON as f64 * 8.0 * (tokens + tokens / 2 + 1) as f64;
        let mut worst = 0.0f64;
        for j in 0..n {
            for i in 0..n {
                if i >= j {
                    let d = (got[(i, j)] as f64 - want[(i, j)] as f64).abs();
                    assert!(
                        d <= eps * bound[(i, j)] + 1e-30,
                        "n={n} H[{i},{j}]: kernel {} cpu {}",
                        got[(i, j)],
                        want[(i, j)]
                    );
                    worst = worst.max(d / bound[(i, j)].max(1e-30));
                } else {
                    assert_eq!(
                        got[(i, j)],
                        0.0,
                        "n={n}: the kernel wrote above the diagonal at ({i},{j})"
                    );
                }
            }
        }
        println!("hessian n={n} tokens={tokens}: worst |kernel - cpu| / sum|x_i x_j| = {worst:.2e} (bound {eps:.2e})");
        cpu.finish_hessian(want.as_mut());
        let ldh = ld(got.as_ref());
        // SAFETY: as above.
        assert_eq!(unsafe { mirror(got.as_ptr_mut(), ldh, n as c_int) }, 0);
        for j in 0..n {
            for i in 0..j {
                assert_eq!(
                    got[(i, j)].to_bits(),
                    got[(j, i)].to_bits(),
                    "mirror ({i},{j})"
                );
            }
        }
    }
}

/// A sweep factor of a random positive-definite Hessian of dimension `n`.
fn factor(n: usize, seed: u64) -> SweepFactor {
    let x = random(3 * n, n, seed);
    let mut h = Mat::<f32>::zeros(n, n);
    let cpu = CpuBackend::default();
    cpu.accumulate_hessian(h.as_mut(), x.as_ref(), 1.0 / n as f32);
    cpu.finish_hessian(h.as_mut());
    let diag: Vec<f32> = (0..n).map(|i| h[(i, i)] * 1.01).collect();
    let mut f = SweepFactor::new(n);
    assert!(cpu.sweep_factor(h.as_ref(), &diag, &mut f));
    f
}

#[test]
fn block_update_kernel_matches_the_cpu_backend_through_the_reversed_view() {
    let update: Symbol<UpdateFn> = sym(b"gptq_host_block_update\0");
    let cpu = CpuBackend::default();
    let n = 300;
    let f = factor(n, 5);
    let coef = f.coef();
    assert!(
        coef.row_stride() < 0 && coef.col_stride() < 0,
        "the factor is a reversed view"
    );
    for (rows, i1, k, seed) in [
        (45usize, 0usize, 128usize, 1u64),
        (70, 128, 37, 2),
        (33, 10, 5, 3),
    ] {
        let cols = n - i1 - k;
        let sub = coef.submatrix(i1, i1 + k, k, cols);
        let d = random(rows, k, seed) * faer::Scale(0.01);
        let w = random(rows, cols, seed + 1);
        let mut want = w.clone();
        cpu.block_update(want.as_mut(), d.as_ref(), sub);
        let mut got = w.clone();
        let ldw = ld(got.as_ref());
        // SAFETY: live matrices; F is read at sub.as_ptr() + u·row_stride + c·col_stride inside `coef`'s buffer.
        let rc = unsafe {
            update(
                got.as_ptr_mut(),
                ldw,
                d.as_ptr(),
                ld(d.as_ref()),
                sub.as_ptr(),
                sub.row_stride() as i64,
                sub.col_stride() as i64,
                rows as c_int,
                k as c_int,
                cols as c_int,
            )
        };
        assert_eq!(rc, 0);
        let mut worst = 0.0f64;
        for c in 0..cols {
            for r in 0..rows {
                let mag: f64 = w[(r, c)].abs() as f64
                    + (0..k)
                        .map(|u| (d[(r, u)] as f64 * sub[(u, c)] as f64).abs())
                        .sum::<f64>();
                let diff = (got[(r, c)] as f64 - want[(r, c)] as f64).abs();
                let tol = f32::EPSILON as f64 * 4.0 * (k + 1) as f64 * mag;
                assert!(
                    diff <= tol,
                    "W[{r},{c}]: kernel {} cpu {} (tol {tol:e})",
                    got[(r, c)],
                    want[(r, c)]
                );
                worst = worst.max(diff / mag.max(1e-30));
            }
        }
        println!("block update {rows}x{k}x{cols}: worst relative difference {worst:.2e}");
    }
}

#[test]
fn sweep_kernel_matches_the_cpu_sweep_to_the_bit() {
    let sweep: Symbol<SweepFn> = sym(b"gptq_host_sweep_block\0");
    let max_block: Symbol<unsafe extern "C" fn() -> c_int> = sym(b"gptq_host_max_block\0");
    // SAFETY: no arguments.
    assert_eq!(unsafe { max_block() }, 128);
    let n = 400;
    let f = factor(n, 9);
    let coef_all = f.coef();
    let r_diag = f.r_diag();
    // (rows, first column, columns, bits, group size, sym, leading columns without parameters, a NaN row)
    for (rows, i1, count, bits, gs, sym, unparam, nan) in [
        (
            200usize, 0usize, 128usize, 4u32, 64usize, false, 0usize, false,
        ),
        (131, 128, 128, 3, 32, true, 0, true),
        (64, 256, 37, 8, 128, false, 5, false),
        (1, 300, 100, 2, 16, false, 0, false),
    ] {
        let mut w = random(rows, count, 100 + i1 as u64) * faer::Scale(0.1);
        if nan {
            w[(rows / 2, 3)] = f32::NAN;
        }
        let w0 = Mat::from_fn(rows, count, |r, c| {
            w[(r, c)] + 0.01 * ((r * 7 + c) % 5) as f32 - 0.02
        });
        let mut coef = vec![0f32; count * count];
        let mut rdiag2 = vec![0f32; count];
        for j in 0..count {
            for i in 0..j {
                coef[i * count + j] = coef_all[(i1 + i, i1 + j)];
            }
            rdiag2[j] = r_diag[i1 + j] * r_diag[i1 + j];
        }
        let groups = count.div_ceil(gs);
        let params: Vec<GroupParams> = (0..groups)
            .map(|g| {
                find_params(
                    rows,
                    (g * gs..((g + 1) * gs).min(count)).map(|c| w0.col_as_slice(c)),
                    bits,
                    sym,
                )
            })
            .collect();
        let col_param: Vec<Option<usize>> = (0..count)
            .map(|c| (c >= unparam).then_some(c / gs))
            .collect();
        let mq = maxq(bits);
        let (want_codes, want_delta, want_loss) =
            sweep_block_cpu(&w, &w0, &coef, &rdiag2, &params, &col_param, mq);

        let scale: Vec<f32> = params
            .iter()
            .flat_map(|p| p.scale.iter().copied())
            .collect();
        let zero: Vec<f32> = params.iter().flat_map(|p| p.zero.iter().copied()).collect();
        let param: Vec<c_int> = col_param
            .iter()
            .map(|p| p.map_or(-1, |i| i as c_int))
            .collect();
        let mut delta = Mat::<f32>::from_fn(rows, count, |_, _| f32::NAN);
        let mut codes = vec![0xAAu8; rows * count];
        let mut acc = vec![f32::NAN; rows];
        let ldd = ld(delta.as_ref());
        // SAFETY: every buffer is live and of the size the kernel's documentation states.
        let rc = unsafe {
            sweep(
                w.as_ptr(),
                ld(w.as_ref()),
                w0.as_ptr(),
                ld(w0.as_ref()),
                delta.as_ptr_mut(),
                ldd,
                codes.as_mut_ptr(),
                rows as c_int,
                coef.as_ptr(),
                rdiag2.as_ptr(),
                param.as_ptr(),
                scale.as_ptr(),
                zero.as_ptr(),
                rows as c_int,
                count as c_int,
                mq,
                acc.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0);
        let case = format!("rows={rows} cols {i1}+{count} bits={bits} g{gs} sym={sym}");
        assert_eq!(codes, want_codes, "{case}: codes");
        for c in 0..count {
            for r in 0..rows {
                assert_eq!(
                    delta[(r, c)].to_bits(),
                    want_delta[(r, c)].to_bits(),
                    "{case}: delta[{r},{c}]"
                );
            }
        }
        // The CPU sums each 64-row tile's per-row losses in f64 and halves it; the host does the same with
        // the kernel's per-row sums.
        let loss: f64 = acc
            .chunks(64)
            .map(|t| t.iter().map(|&v| v as f64).sum::<f64>() / 2.0)
            .fold(0.0, |a, b| a + b);
        if nan {
            assert!(
                loss.is_nan() && want_loss.is_nan(),
                "{case}: NaN input gives a NaN loss on both"
            );
        } else {
            assert_eq!(
                loss.to_bits(),
                want_loss.to_bits(),
                "{case}: loss {loss} vs {want_loss}"
            );
        }
        let distinct: std::collections::BTreeSet<u8> = codes.iter().copied().collect();
        assert!(distinct.len() > 2, "{case}: the case exercises the grid");
    }
}

#[test]
fn group_params_kernel_matches_find_params_to_the_bit() {
    let params: Symbol<ParamsFn> = sym(b"gptq_host_group_params\0");
    // (rows, columns of the group, bits, symmetric, seed); the group starts at column 3 of a wider matrix
    for (rows, ncols, bits, symmetric, seed) in [
        (200usize, 128usize, 4u32, false, 1u64),
        (131, 32, 3, true, 2),
        (64, 64, 8, false, 3),
        (1, 16, 2, false, 4),
        (70, 128, 4, true, 5),
    ] {
        let mut m = random(rows, ncols + 5, seed) * faer::Scale(0.1);
        // Rows that take the quantizer's special paths: all zero ([-1, 1]), a NaN (skipped), all positive
        // (the range keeps 0 as its low end), all negative, a −0.0 among zeros, an infinity.
        let special = |r: usize, c: usize, v: f32| match r {
            0 => 0.0,
            1 if c == 7 => f32::NAN,
            2 => v.abs(),
            3 => -v.abs(),
            4 => {
                if c == 4 {
                    -0.0
                } else {
                    0.0
                }
            }
            5 if c == 9 => f32::INFINITY,
            _ => v,
        };
        for c in 0..m.ncols() {
            for r in 0..rows {
                m[(r, c)] = special(r, c, m[(r, c)]);
            }
        }
        let want = find_params(
            rows,
            (3..3 + ncols).map(|c| m.col_as_slice(c)),
            bits,
            symmetric,
        );
        let (mut scale, mut zero) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
        let lds = ld(m.as_ref());
        // SAFETY: column 3 of a live matrix with `ncols` more columns; outputs of `rows` floats each.
        let rc = unsafe {
            params(
                m.as_ptr().add(3 * lds as usize),
                lds,
                ncols as c_int,
                rows as c_int,
                maxq(bits),
                c_int::from(symmetric),
                scale.as_mut_ptr(),
                zero.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0);
        for r in 0..rows {
            let case = format!("rows={rows} g{ncols} bits={bits} sym={symmetric} row {r}");
            assert_eq!(
                scale[r].to_bits(),
                want.scale[r].to_bits(),
                "{case}: scale {} vs {}",
                scale[r],
                want.scale[r]
            );
            // ±0 may come out either way from a min/max of zeros; both store as code 0.
            assert!(
                zero[r].to_bits() == want.zero[r].to_bits()
                    || (zero[r] == 0.0 && want.zero[r] == 0.0),
                "{case}: zero {} vs {}",
                zero[r],
                want.zero[r]
            );
        }
    }
}

#[test]
fn snapshot_kernel_solves_for_the_block_start_snapshot_like_the_cpu() {
    let snapshot: Symbol<SnapshotFn> = sym(b"gptq_host_block_snapshot\0");
    let n = 400;
    let f = factor(n, 11);
    let coef_all = f.coef();
    for (rows, i1, width, seed) in [
        (150usize, 0usize, 128usize, 1u64),
        (33, 128, 64, 2),
        (70, 190, 200, 3),
        (1, 300, 17, 4),
    ] {
        let p = random(rows, width, seed) * faer::Scale(0.1);
        // W₀ is P before the earlier blocks' updates: close to P, as in a sweep.
        let w0 = Mat::from_fn(rows, width, |r, c| {
            p[(r, c)] - 0.01 * (((r * 5 + c * 3) % 7) as f32 - 3.0)
        });
        let fb = Mat::from_fn(width, width, |a, b| coef_all[(i1 + a, i1 + b)]);
        let coef: Vec<f32> = (0..width * width)
            .map(|i| {
                let (a, b) = (i / width, i % width);
                if a < b {
                    fb[(a, b)]
                } else {
                    0.0
                }
            })
            .collect();
        let want = block_snapshot_cpu(&p, &w0, fb.as_ref());
        let mut snap = Mat::<f32>::from_fn(rows, width, |_, _| f32::NAN);
        let mut xs = Mat::<f32>::from_fn(rows, width, |_, _| f32::NAN);
        let (lds, ldx) = (ld(snap.as_ref()), ld(xs.as_ref()));
        // SAFETY: live matrices of `rows × width`, `coef` of width² floats.
        let rc = unsafe {
            snapshot(
                snap.as_ptr_mut(),
                lds,
                xs.as_ptr_mut(),
                ldx,
                p.as_ptr(),
                ld(p.as_ref()),
                w0.as_ptr(),
                ld(w0.as_ref()),
                coef.as_ptr(),
                width as c_int,
                rows as c_int,
            )
        };
        assert_eq!(rc, 0);
        let case = format!("rows={rows} block {i1}+{width}");
        let (mut worst_kernel, mut worst_cpu) = (0f64, 0f64);
        for r in 0..rows {
            assert_eq!(
                snap[(r, 0)].to_bits(),
                p[(r, 0)].to_bits(),
                "{case}: the first column is P's"
            );
            // The exact snapshot (f64) of the same inputs, by the same substitution.
            let c: Vec<f64> = (0..width)
                .map(|j| p[(r, j)] as f64 - w0[(r, j)] as f64)
                .collect();
            let mut x = vec![0f64; width];
            for j in 0..width {
                let (mut y, mut mag) = (0f64, p[(r, j)].abs() as f64 + c[j].abs());
                for a in 0..j {
                    y -= x[a] * fb[(a, j)] as f64;
                    mag += (x[a] * fb[(a, j)] as f64).abs();
                }
                x[j] = c[j] + y;
                let exact = p[(r, j)] as f64 + y;
                // Backward error of the kernel's own X: X·F̂ = C row by row, to γ_{j+2} of the magnitudes.
                let xk: f64 = xs[(r, j)] as f64
                    + (0..j)
                        .map(|a| xs[(r, a)] as f64 * fb[(a, j)] as f64)
                        .sum::<f64>();
                let xmag = c[j].abs()
                    + (0..j)
                        .map(|a| (xs[(r, a)] as f64 * fb[(a, j)] as f64).abs())
                        .sum::<f64>();
                let gamma = 2.0 * (j + 2) as f64 * f32::EPSILON as f64;
                assert!(
                    (xk - c[j]).abs() <= gamma * xmag + 1e-30,
                    "{case}: X·F̂ = C residual at ({r},{j}): {:e} over {:e}",
                    (xk - c[j]).abs(),
                    gamma * xmag
                );
                let ek = (snap[(r, j)] as f64 - exact).abs() / mag.max(1e-30);
                let ec = (want[(r, j)] as f64 - exact).abs() / mag.max(1e-30);
                worst_kernel = worst_kernel.max(ek);
                worst_cpu = worst_cpu.max(ec);
            }
        }
        // Both are f32 computations of the same exact value: the kernel's error may not exceed the CPU's
        // (explicit inverse, then a product) by more than 4×, or a few ε·width where the CPU's is tiny.
        let floor = 8.0 * width as f64 * f32::EPSILON as f64;
        println!("snapshot {case}: worst error / magnitude: kernel {worst_kernel:.2e}, cpu {worst_cpu:.2e}");
        assert!(
            worst_kernel <= (4.0 * worst_cpu).max(floor),
            "{case}: kernel error {worst_kernel:e}, cpu {worst_cpu:e}"
        );
    }
}

// --- NVRTC -------------------------------------------------------------------------------------------

/// libnvrtc: `FLEXINFER_NVRTC`, else the wheel unpacked by scripts/install-deps.sh, else the system's.
fn find_nvrtc() -> Vec<PathBuf> {
    if let Ok(p) = std::env::var("FLEXINFER_NVRTC") {
        return vec![PathBuf::from(p)];
    }
    let mut found = Vec::new();
    let cache = PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/flexinfer");
    let mut stack: Vec<(PathBuf, usize)> = std::fs::read_dir(&cache)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("nvrtc-"))
        .map(|e| (e.path(), 0))
        .collect();
    while let Some((dir, depth)) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() && depth < 8 {
                stack.push((p, depth + 1));
            } else if name.starts_with("libnvrtc.so") && !name.contains("alt") {
                found.push(p);
            }
        }
    }
    found.sort();
    found.push(PathBuf::from("libnvrtc.so"));
    found
}

/// NVRTC from [`find_nvrtc`]'s candidates, through the library's loader (the one the CUDA session uses).
fn load_nvrtc() -> Option<Nvrtc> {
    find_nvrtc()
        .into_iter()
        .find_map(|p| Nvrtc::load_from(&p).ok())
}

/// The PTX text of one kernel (from its `.entry` to the next one).
fn entry<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("no .entry {name} in the PTX"));
    let rest = &ptx[start + 1..];
    &ptx[start..start + 1 + rest.find(".entry ").unwrap_or(rest.len())]
}

#[test]
fn kernels_compile_through_nvrtc_loaded_at_run_time() {
    let Some(nvrtc) = load_nvrtc() else {
        println!(
            "SKIPPED kernels_compile_through_nvrtc_loaded_at_run_time: no libnvrtc found (looked in FLEXINFER_NVRTC, \
             ~/.cache/flexinfer/nvrtc-*/ and the system library path); scripts/install-deps.sh installs it"
        );
        return;
    };
    let (major, minor) = nvrtc.version().unwrap();
    println!("NVRTC {major}.{minor} from {}", nvrtc.path.display());
    let src = std::fs::read_to_string(Path::new(KERNELS).join("gptq.cu")).unwrap();
    assert_eq!(src, KERNEL_SOURCE, "the library embeds kernels/gptq.cu");
    // NVIDIA targets of the kinds the device tool and our users have (Ampere, Hopper).
    for arch in ["compute_80", "compute_90"] {
        let opt = format!("--gpu-architecture={arch}");
        let ptx = nvrtc
            .compile(&src, "gptq.cu", &[&opt, "--std=c++17"])
            .unwrap_or_else(|log| panic!("{arch}: {log}"));
        assert!(
            ptx.contains(&format!(".target sm_{}", &arch["compute_".len()..])),
            "{arch}: target line"
        );
        for k in Kernel::ALL {
            let body = entry(&ptx, k.entry());
            assert!(body.len() > 100, "{arch}: {} is empty", k.entry());
        }
        // The bit-exactness rule: no fused multiply-add in the sweep; the GEMMs may fuse.
        let sweep = entry(&ptx, "gptq_sweep_block");
        assert!(
            !sweep.contains("fma."),
            "{arch}: the sweep kernel contains an FMA"
        );
        assert!(
            sweep.contains("mul.rn.f32") && sweep.contains("add.rn.f32"),
            "{arch}: explicit rounding"
        );
        assert!(
            sweep.contains("cvt.rni.f32.f32"),
            "{arch}: round-half-even (rintf)"
        );
        println!(
            "{arch}: {} bytes of PTX, {} kernels",
            ptx.len(),
            Kernel::ALL.len()
        );
    }
    // A broken source is reported (the test can fail): NVRTC's log names the error.
    let bad = nvrtc.compile(
        "extern \"C\" __global__ void k() { undefined_thing(); }",
        "bad.cu",
        &["--gpu-architecture=compute_80"],
    );
    assert!(bad.is_err_and(|e| matches!(&e, flexinfer_quant::device::driver::NvrtcError::Compile { log, .. } if log.contains("undefined_thing"))));
}

/// The CUBIN route of the CUDA device (`DriverVendor` loads a CUBIN for the card's architecture first, PTX
/// second): NVRTC makes a CUDA ELF for each architecture with every kernel in its symbol table.
#[test]
fn kernels_compile_to_cubin_through_nvrtc() {
    let Some(nvrtc) = load_nvrtc() else {
        println!("SKIPPED kernels_compile_to_cubin_through_nvrtc: no libnvrtc found (see the test above)");
        return;
    };
    for arch in ["sm_80", "sm_90"] {
        let opt = format!("--gpu-architecture={arch}");
        let cubin = nvrtc
            .compile_image(
                KERNEL_SOURCE,
                "gptq.cu",
                &[&opt, "--std=c++17"],
                NvrtcOutput::Cubin,
            )
            .unwrap_or_else(|log| panic!("{arch}: {log}"));
        assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: a CUBIN is an ELF file");
        // ELF e_machine (offset 18, little-endian) 190 is EM_CUDA.
        assert_eq!(
            u16::from_le_bytes([cubin[18], cubin[19]]),
            190,
            "{arch}: EM_CUDA"
        );
        for k in Kernel::ALL {
            let name = k.entry().as_bytes();
            assert!(
                cubin.windows(name.len()).any(|w| w == name),
                "{arch}: {} is not in the CUBIN",
                k.entry()
            );
        }
        println!("{arch}: {} bytes of CUBIN", cubin.len());
    }
    // A compute_XY target has no machine code: NVRTC refuses a CUBIN for it (the test can fail).
    let virt = nvrtc.compile_image(
        KERNEL_SOURCE,
        "gptq.cu",
        &["--gpu-architecture=compute_80"],
        NvrtcOutput::Cubin,
    );
    println!("compute_80 as a CUBIN: {virt:?}");
    assert!(virt.is_err());
}

/// Launches `kernel` through the harness's generic entry, as the session does.
fn host_launch(launch: Launch, args: &[Arg]) {
    // SAFETY: the callers' buffers hold what the launch touches.
    let rc = unsafe { host_kernels::launch(launch, args) };
    assert_eq!(rc, 0, "{}", launch.kernel.entry());
}

/// `gptq_factor_pivots` (after a vendor potrf): the pivots from the factor's diagonal in reversed order; a
/// pivot that is not positive and finite sets the status word, and a status already set stops it.
#[test]
fn pivots_kernel_reads_the_vendor_factor_diagonal_and_flags_bad_pivots() {
    let run = |diag: &[f32], status0: i32| {
        let n = diag.len();
        let mut m = vec![7.0f32; n * n];
        for (j, d) in diag.iter().enumerate() {
            m[j * n + j] = *d;
        }
        let mut r = vec![-1.0f32; n];
        let mut status = [status0, 0];
        let ptr = |p: *const u8| Arg::Ptr(p as u64);
        host_launch(
            Launch::rows(Kernel::FactorPivots, n, 256),
            &[
                ptr(m.as_ptr() as *const u8),
                Arg::I32(n as i32),
                Arg::I32(n as i32),
                ptr(r.as_mut_ptr() as *const u8),
                ptr(status.as_mut_ptr() as *const u8),
            ],
        );
        (r, status)
    };
    let (r, status) = run(&[2.0, 3.0, 5.0], 0);
    assert_eq!(r, vec![5.0, 3.0, 2.0]);
    assert_eq!(status, [0, 0]);
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let (_, status) = run(&[2.0, bad, 5.0], 0);
        assert_eq!(status, [2, 0], "pivot {bad}");
    }
    let (r, status) = run(&[2.0, 3.0, 5.0], 3);
    assert_eq!(
        (r, status),
        (vec![-1.0; 3], [3, 0]),
        "potrf's info already set"
    );
}

/// `gptq_gather_panel`: the block update's factor rows, dense and column-major, equal the reversed view's.
#[test]
fn gather_panel_kernel_copies_the_reversed_view_dense() {
    let n = 70;
    let f = factor(n, 9);
    let coef = f.coef();
    for (i1, k) in [(0usize, 32usize), (32, 32), (64, 3)] {
        let i2 = i1 + k;
        let ncols = n - i2;
        // The factor's storage M: coef(u, c) = M[n-1-u, n-1-c].
        let m: Vec<f32> = (0..n * n)
            .map(|idx| {
                let (i, j) = (idx % n, idx / n);
                coef[(n - 1 - i, n - 1 - j)]
            })
            .collect();
        let mut g = vec![f32::NAN; k * ncols.max(1)];
        let ptr = |p: *const u8| Arg::Ptr(p as u64);
        host_launch(
            Launch::tiles(Kernel::GatherPanel, k, ncols),
            &[
                ptr(g.as_mut_ptr() as *const u8),
                Arg::I32(k as i32),
                ptr(m.as_ptr() as *const u8),
                Arg::I32(n as i32),
                Arg::I32(n as i32),
                Arg::I32(i1 as i32),
                Arg::I32(k as i32),
                Arg::I32(i2 as i32),
                Arg::I32(ncols as i32),
            ],
        );
        for c in 0..ncols {
            for u in 0..k {
                assert_eq!(
                    g[u + c * k].to_bits(),
                    coef[(i1 + u, i2 + c)].to_bits(),
                    "block {i1}+{k}: F({}, {})",
                    i1 + u,
                    i2 + c
                );
            }
        }
    }
}
