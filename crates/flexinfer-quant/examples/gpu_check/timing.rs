//! The Hessian accumulation's rate and one module's solve step by step (section 4 of the check).

use flexinfer_quant::device::check;
use flexinfer_quant::device::driver::DriverVendor;
use flexinfer_quant::device::kernel::KernelDevice;
use flexinfer_quant::params::GptqParams;
use serde_json::{json, Value};
use std::time::Instant;

/// Seconds and rate of the Hessian accumulation (`gptq_hessian_lower`, the activations' upload included) of
/// `tokens` × `n` activations in 4 batches, averaged over 3 passes: after a warm-up pass (allocation, zero
/// fill), the passes and a download of the Hessian are timed, less the time of a download alone.
pub fn time_hessian(
    dev: &KernelDevice<DriverVendor>,
    n: usize,
    tokens: usize,
) -> Result<Value, String> {
    use flexinfer_quant::device::DeviceOps;
    let e = |e: flexinfer_quant::device::DeviceError| e.to_string();
    let batches = check::activations(tokens, n, 4, &mut check::Rng::new(3));
    let mut ops = dev.ops(n).map_err(e)?;
    for x in &batches {
        ops.accumulate(x.as_ref(), 1.0).map_err(e)?;
    }
    ops.checkpoint().map_err(e)?;
    let t = Instant::now();
    ops.checkpoint().map_err(e)?;
    let download = t.elapsed().as_secs_f64();
    let reps = 3;
    let t = Instant::now();
    for _ in 0..reps {
        for x in &batches {
            ops.accumulate(x.as_ref(), 1.0).map_err(e)?;
        }
    }
    ops.checkpoint().map_err(e)?;
    let total = t.elapsed().as_secs_f64();
    let seconds = ((total - download) / reps as f64).max(1e-9);
    // The lower triangle with the diagonal: n(n+1)/2 dot products of `tokens` terms, 2 flops a term.
    let flops = tokens as f64 * n as f64 * (n as f64 + 1.0);
    Ok(json!({
        "timing": "hessian", "n": n, "tokens": tokens,
        "seconds": seconds, "gflops": flops / seconds / 1e9, "download_seconds": download,
    }))
}

/// The steps of one module's solve on the device, each ended by a download: accumulation and preparation
/// (on the device; with `desc_act` the act-order permutation too), the checkpoint download, one
/// factorisation attempt (1 % damp), the sweep (W up, codes and scales down).
pub fn module_steps(
    dev: &KernelDevice<DriverVendor>,
    rows: usize,
    n: usize,
    tokens: usize,
    desc_act: bool,
) -> Result<Value, String> {
    use flexinfer_quant::device::DeviceOps;
    let e = |e: flexinfer_quant::device::DeviceError| e.to_string();
    let mut rng = check::Rng::new(99);
    let batches = check::activations(tokens, n, 4, &mut rng);
    let w = rng.matrix(rows, n, 0.05);
    let mut ops = dev.ops(n).map_err(e)?;
    let t = Instant::now();
    for x in &batches {
        ops.accumulate(x.as_ref(), 2.0 / tokens as f32).map_err(e)?;
    }
    let meta = ops.prepare(desc_act.into()).map_err(e)?;
    let prepare = t.elapsed().as_secs_f64();
    let t = Instant::now();
    ops.checkpoint().map_err(e)?;
    let checkpoint = t.elapsed().as_secs_f64();
    let diag = check::damp_diagonal(&meta.diag, 0.01);
    let t = Instant::now();
    let ok = ops.try_factor(&diag).map_err(e)?;
    let factor = t.elapsed().as_secs_f64();
    if !ok {
        return Err("the factorisation attempt failed".into());
    }
    let t = Instant::now();
    let params = GptqParams {
        desc_act,
        ..GptqParams::default()
    };
    let job = flexinfer_quant::device::SweepJob {
        meta: &meta,
        damp: 0.01,
        params: &params,
    };
    let q = ops.sweep(&w, &job).map_err(e)?;
    let sweep = t.elapsed().as_secs_f64();
    Ok(json!({
        "timing": "module steps", "rows": rows, "n": n, "tokens": tokens, "desc_act": desc_act,
        "accumulate_prepare_seconds": prepare, "checkpoint_seconds": checkpoint,
        "factor_seconds": factor, "sweep_seconds": sweep,
        "loss": q.loss,
    }))
}

/// Seconds and rate of the sweep's block update (`W += D·F`) alone, at the shape of a module's first block:
/// `rows × k` deltas times a `k × cols` factor block into `rows × cols` weights, all on the device (buffers
/// filled once, not timed): the vendor's `sgemm` when the device uses its BLAS now (the engine gathers F into
/// that dense layout first, a `k × cols` copy not timed here), else `gptq_block_update`. After a warm-up
/// call, `reps` calls are timed up to a 4-byte download that waits for them; `2·rows·k·cols` flops a call.
pub fn time_block_update(
    dev: &KernelDevice<DriverVendor>,
    rows: usize,
    k: usize,
    cols: usize,
) -> Result<Value, String> {
    use flexinfer_quant::device::kernel::{Arg, Gemm, Kernel, Launch, Vendor};
    let e = |e: flexinfer_quant::device::DeviceError| e.to_string();
    let dim = |v: usize| i32::try_from(v).map_err(|_| format!("{v} exceeds i32"));
    let (r32, k32, c32) = (dim(rows)?, dim(k)?, dim(cols)?);
    let mut rng = check::Rng::new(5);
    let filled = |n: usize, rng: &mut check::Rng| -> Vec<u8> {
        let m = rng.matrix(n, 1, 0.05);
        (0..n).flat_map(|i| m[(i, 0)].to_ne_bytes()).collect()
    };
    let (w, d, f) = (
        filled(rows * cols, &mut rng),
        filled(rows * k, &mut rng),
        filled(k * cols, &mut rng),
    );
    let reps = 5;
    let blas = dev.math().map_err(e)?.blas;
    dev.with_vendor(|v| -> Result<Value, String> {
        let mut bufs = Vec::new();
        let run = (|| -> Result<Value, String> {
            let mut put = |v: &mut DriverVendor, data: &[u8]| -> Result<u64, String> {
                let p = v.alloc(data.len()).map_err(e)?;
                bufs.push(p);
                v.upload(p, data).map_err(e)?;
                Ok(p)
            };
            let (dw, dd, df) = (put(v, &w)?, put(v, &d)?, put(v, &f)?);
            // F column-major k × cols: F(u, c) at f[u + c·k].
            let args = [
                Arg::Ptr(dw),
                Arg::I32(r32),
                Arg::Ptr(dd),
                Arg::I32(r32),
                Arg::Ptr(df),
                Arg::I64(1),
                Arg::I64(k as i64),
                Arg::I32(r32),
                Arg::I32(k32),
                Arg::I32(c32),
            ];
            let launch = Launch::wide(Kernel::BlockUpdate, cols, rows);
            let gemm = Gemm {
                m: rows,
                n: cols,
                k,
                a: dd,
                lda: rows,
                b: df,
                ldb: k,
                c: dw,
                ldc: rows,
            };
            let call = |v: &mut DriverVendor| {
                if blas {
                    v.gemm_acc(&gemm)
                } else {
                    v.launch(launch, &args)
                }
            };
            let mut sync = [0u8; 4];
            call(v).map_err(e)?;
            v.download(dw, &mut sync).map_err(e)?;
            let t = Instant::now();
            for _ in 0..reps {
                call(v).map_err(e)?;
            }
            v.download(dw, &mut sync).map_err(e)?;
            let seconds = (t.elapsed().as_secs_f64() / reps as f64).max(1e-9);
            let flops = 2.0 * rows as f64 * k as f64 * cols as f64;
            Ok(json!({
                "timing": "block update", "rows": rows, "k": k, "cols": cols,
                "routine": if blas { "vendor sgemm" } else { "gptq_block_update" },
                "seconds": seconds, "gflops": flops / seconds / 1e9,
            }))
        })();
        for p in bufs {
            v.free(p);
        }
        run
    })
    .map_err(e)?
}

/// The engine's host ↔ device copies of `mib` MiB (`DriverVendor::upload`/`download`, through the
/// page-locked staging buffer when the runtime gives one), read against `gpu_peak.py`'s copy rates: the
/// upload from a host buffer already written, the download into one already written, into a fresh
/// allocation (its pages first touched by the copy: what a download into a new matrix pays), into a fresh
/// allocation written once before (the touch included in the time), and into a fresh mapping advised to use
/// huge pages. Median of 3 after a warm-up copy; `staged` says whether the staging buffer was in use.
pub fn time_transfers(dev: &KernelDevice<DriverVendor>, mib: usize) -> Result<Value, String> {
    use flexinfer_quant::device::kernel::Vendor;
    let e = |e: flexinfer_quant::device::DeviceError| e.to_string();
    let bytes = mib << 20;
    dev.with_vendor(|v| -> Result<Value, String> {
        let p = v.alloc(bytes).map_err(e)?;
        let run = (|| -> Result<Value, String> {
            let mut touched = vec![1u8; bytes];
            v.upload(p, &touched).map_err(e)?;
            let median = |f: &mut dyn FnMut() -> Result<(), String>| -> Result<f64, String> {
                f()?;
                let mut t = Vec::new();
                for _ in 0..3 {
                    let s = Instant::now();
                    f()?;
                    t.push(s.elapsed().as_secs_f64());
                }
                t.sort_by(f64::total_cmp);
                Ok(t[1])
            };
            let up = median(&mut || v.upload(p, &touched).map_err(e))?;
            let down = median(&mut || v.download(p, &mut touched).map_err(e))?;
            let fresh = median(&mut || {
                let mut d = vec![0u8; bytes];
                v.download(p, &mut d).map_err(e)?;
                std::hint::black_box(&d);
                Ok(())
            })?;
            let prefaulted = median(&mut || {
                let mut d = vec![0u8; bytes];
                for page in d.chunks_mut(4096) {
                    page[0] = 1;
                }
                v.download(p, &mut d).map_err(e)?;
                std::hint::black_box(&d);
                Ok(())
            })?;
            let huge = median(&mut || {
                // SAFETY: a private anonymous mapping of `bytes` bytes, advised, written only through the
                // slice below, and unmapped before the closure returns.
                unsafe {
                    let m = libc::mmap(
                        std::ptr::null_mut(),
                        bytes,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    );
                    if m == libc::MAP_FAILED {
                        return Err("mmap failed".into());
                    }
                    libc::madvise(m, bytes, libc::MADV_HUGEPAGE);
                    let d = std::slice::from_raw_parts_mut(m as *mut u8, bytes);
                    let r = v.download(p, d).map_err(e);
                    libc::munmap(m, bytes);
                    r
                }
            })?;
            let gb = bytes as f64 / 1e9;
            Ok(json!({
                "timing": "transfers", "mib": mib, "staged": v.staging_active(),
                "upload_gb_per_s": gb / up,
                "download_gb_per_s": gb / down,
                "download_fresh_gb_per_s": gb / fresh,
                "download_prefaulted_gb_per_s": gb / prefaulted,
                "download_hugepage_gb_per_s": gb / huge,
            }))
        })();
        v.free(p);
        run
    })
    .map_err(e)?
}
