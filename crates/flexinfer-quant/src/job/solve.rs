//! Solving one input group of a layer on the device (shared by the layer loop and the experts' units), and
//! what the layer loop reads beyond the run.

use super::{PhaseTimes, Run};
use crate::device::{solve_with_fallback, Session, SolveSpec};
use crate::error::{NumericError, QuantError, Result};
use crate::memory::release_free_memory;
use crate::model::llama::Rope;
use crate::model::LayerWeights;
use crate::numerics::gptq::{dequantize_weight, QuantizedLinear};

/// What the layer loop reads beyond the run: the rope tables and the calibration batch.
pub(super) struct LayerRun<'a> {
    pub(super) run: &'a Run<'a>,
    pub(super) rope: &'a Rope,
    /// Samples whose activations are stacked per Hessian update.
    pub(super) batch: usize,
    /// Calibration tokens over all samples.
    pub(super) n_tokens: usize,
}

/// Factorises one input group's Hessian and quantizes its active modules (GPTQ, or RTN when the recovery
/// loop is exhausted) in one device session (`session` holds the accumulated Hessian); the quantized weights
/// replace the f32 ones in `lw` for the stages after it.
pub(super) fn solve_group(
    run: &Run<'_>,
    mut session: Box<dyn Session + '_>,
    lw: &mut LayerWeights,
    active: &[usize],
    names: &[String],
    results: &mut [Option<QuantizedLinear>],
) -> Result<()> {
    let started = std::time::Instant::now();
    let r = solve_group_timed(run, session.as_mut(), lw, active, names, results);
    drop(session);
    PhaseTimes::add(&run.times, |p| &mut p.solve, started);
    r
}

fn solve_group_timed(
    run: &Run<'_>,
    session: &mut (dyn Session + '_),
    lw: &mut LayerWeights,
    active: &[usize],
    names: &[String],
    results: &mut [Option<QuantizedLinear>],
) -> Result<()> {
    let missing = |i: usize| {
        QuantError::from(NumericError::ModuleMissing {
            index: i,
            group: Some(names.join(",")),
        })
    };
    let module = names.join(",");
    let spec = SolveSpec {
        params: &run.job.params,
        recovery: &run.job.recovery,
        module: &module,
        events: run.events,
    };
    let quantized = {
        let weights = active
            .iter()
            .map(|&i| lw.module(i).map(|l| &l.w).ok_or_else(|| missing(i)))
            .collect::<Result<Vec<_>>>()?;
        solve_with_fallback(&run.device.describe(), session, &weights, &spec)?
    };
    for (&i, q) in active.iter().zip(quantized) {
        lw.module_mut(i).ok_or_else(|| missing(i))?.w = dequantize_weight(&q);
        results[i] = Some(q);
    }
    lw.sync_tied();
    release_free_memory();
    Ok(())
}
