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
/// (the Hessian goes to the host and back), one factorisation attempt (1 % damp), the sweep (W up, codes and
/// scales down).
pub fn module_steps(
    dev: &KernelDevice<DriverVendor>,
    rows: usize,
    n: usize,
    tokens: usize,
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
    let meta = ops.prepare(false).map_err(e)?;
    let prepare = t.elapsed().as_secs_f64();
    let diag = check::damp_diagonal(&meta.diag, 0.01);
    let t = Instant::now();
    let ok = ops.try_factor(&diag).map_err(e)?;
    let factor = t.elapsed().as_secs_f64();
    if !ok {
        return Err("the factorisation attempt failed".into());
    }
    let t = Instant::now();
    let q = ops
        .sweep(&w, &meta, 0.01, &GptqParams::default())
        .map_err(e)?;
    let sweep = t.elapsed().as_secs_f64();
    Ok(json!({
        "timing": "module steps", "rows": rows, "n": n, "tokens": tokens,
        "accumulate_prepare_seconds": prepare, "factor_seconds": factor, "sweep_seconds": sweep,
        "loss": q.loss,
    }))
}
