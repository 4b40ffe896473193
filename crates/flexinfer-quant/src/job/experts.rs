//! The experts of one sparse-MoE layer: routing the calibration tokens, one expert's Hessians at a
//! time, RTN for an expert too few tokens reach, and the run's expert-coverage report.

use super::solve::{solve_group, LayerRun};
use crate::error::{NumericError, Result};
use crate::model::llama::rms_norm;
use crate::model::moe::{gated, gather_rows};
use crate::model::{LayerWeights, ModuleSpec, MoeConfig};
use crate::numerics::gptq::{dequantize_weight, rtn_quantize, QuantizedLinear};
use faer::Mat;
use serde_json::{json, Value};

/// What the expert loop of one MoE layer needs.
pub(super) struct ExpertCtx<'a> {
    pub(super) layer: &'a LayerRun<'a>,
    pub(super) moe: &'a MoeConfig,
    pub(super) prefix: &'a str,
    pub(super) specs: &'a [ModuleSpec],
}

/// Expert GPTQ of one MoE layer. `hidden` holds each sample's residual after attention (already quantized
/// attention). The router (full precision) picks each token's experts; each expert's gate/up Hessian comes from
/// the post-attention-norm rows of the tokens routed to it, its down Hessian from its SwiGLU activation of those
/// rows (with its gate/up already quantized). Experts are done one after another, so one expert's Hessians are
/// alive at a time whatever the expert count. An expert whose tokens are fewer than
/// `expert_min_token_percent` of the calibration tokens takes RTN. Returns the routed tokens per expert and the
/// number of modules that took RTN for low coverage.
pub(super) fn quantize_experts(
    ctx: &ExpertCtx<'_>,
    hidden: &[Mat<f32>],
    lw: &mut LayerWeights,
    results: &mut [Option<QuantizedLinear>],
) -> Result<(Vec<u64>, u64)> {
    let (cfg, m) = (ctx.layer.run.cfg, ctx.moe);
    let eps = cfg.rms_norm_eps;
    let moe_w = lw.moe.as_ref().ok_or_else(|| NumericError::MoeNotLoaded {
        layer_prefix: ctx.prefix.to_string(),
    })?;
    // Per sample, per expert: the routed token rows (the shared expert, if any, sees every token).
    let routed: Vec<Vec<Vec<(usize, f32)>>> = hidden
        .iter()
        .map(|x| {
            moe_w
                .route_residual(x.as_ref(), &lw.post_norm, eps, &m.spec)
                .per_expert(m.num_experts)
        })
        .collect();
    // The input norms of the routed experts and of the shared unit (they differ on Gemma 4).
    let (expert_norm, shared_norm) = moe_w.input_norms(&lw.post_norm);
    let tokens: Vec<u64> = (0..m.num_experts)
        .map(|e| routed.iter().map(|r| r[e].len() as u64).sum())
        .collect();
    let n_units = m.num_experts + usize::from(m.shared_intermediate.is_some());
    let mut low_rtn = 0u64;
    for e in 0..n_units {
        let shared = e == m.num_experts;
        let n_e = if shared {
            ctx.layer.n_tokens as u64
        } else {
            tokens[e]
        };
        let n = lw.mixer;
        let [ig, iu, id] = [n + 3 * e, n + 1 + 3 * e, n + 2 + 3 * e];
        let is_active = |i: usize| {
            !ctx.specs[i].tied
                && !ctx
                    .layer
                    .run
                    .exclusion
                    .excludes(&format!("{}{}", ctx.prefix, ctx.specs[i].name), cfg.hybrid)
        };
        let gate_up: Vec<usize> = [ig, iu].into_iter().filter(|&i| is_active(i)).collect();
        let down: Vec<usize> = [id].into_iter().filter(|&i| is_active(i)).collect();
        if gate_up.is_empty() && down.is_empty() {
            continue;
        }
        let percent = 100.0 * n_e as f64 / ctx.layer.n_tokens.max(1) as f64;
        if n_e == 0 || percent < ctx.layer.run.job.expert_min_token_percent {
            low_rtn += rtn_modules(ctx, lw, results, gate_up.iter().chain(&down))?;
            continue;
        }
        // The rows this expert sees, post-attention-norm, one sample at a time.
        let rows_of = |s: usize| -> Mat<f32> {
            let x = hidden[s].as_ref();
            if shared {
                rms_norm(x, &shared_norm, eps)
            } else {
                let sub = gather_rows(x, &routed[s][e]);
                rms_norm(sub.as_ref(), &expert_norm, eps)
            }
        };
        let unit = Unit {
            expert: e,
            modules: [ig, iu, id],
            gate_up,
            down,
            alpha: 2.0 / n_e as f32,
            rows_of: &rows_of,
        };
        solve_unit(ctx, hidden.len(), lw, results, &unit)?;
    }
    Ok((tokens, low_rtn))
}

/// One unit of a MoE layer (a routed expert, or the shared one) with enough tokens for GPTQ.
struct Unit<'a> {
    expert: usize,
    /// Its gate, up and down modules (indices into the layer's specs).
    modules: [usize; 3],
    /// The active ones among gate/up, and among down.
    gate_up: Vec<usize>,
    down: Vec<usize>,
    /// The Hessians' weight per row: 2 / the unit's token count.
    alpha: f32,
    /// The rows the unit sees in sample `s`, post-attention-norm.
    rows_of: &'a dyn Fn(usize) -> Mat<f32>,
}

/// A unit's GPTQ: gate/up from the rows it sees, then down from their SwiGLU activation through the
/// already-quantized gate/up. `samples` is the number of calibration samples.
fn solve_unit(
    ctx: &ExpertCtx<'_>,
    samples: usize,
    lw: &mut LayerWeights,
    results: &mut [Option<QuantizedLinear>],
    unit: &Unit<'_>,
) -> Result<()> {
    let (cfg, m) = (ctx.layer.run.cfg, ctx.moe);
    let name = |i: usize| format!("{}{}", ctx.prefix, ctx.specs[i].name);
    let [ig, iu, _] = unit.modules;
    if !unit.gate_up.is_empty() {
        let mut h = ctx.layer.run.device.open(cfg.hidden_size)?;
        for s in 0..samples {
            let a = (unit.rows_of)(s);
            if a.nrows() > 0 {
                h.accumulate(a.as_ref(), unit.alpha)?;
            }
        }
        let names: Vec<String> = unit.gate_up.iter().map(|&i| name(i)).collect();
        solve_group(ctx.layer.run, h, lw, &unit.gate_up, &names, results)?;
    }
    if !unit.down.is_empty() {
        let (g, u) = match (lw.module(ig), lw.module(iu)) {
            (Some(g), Some(u)) => (g, u),
            _ => {
                return Err(NumericError::ExpertMissing {
                    layer_prefix: ctx.prefix.to_string(),
                    expert: unit.expert,
                }
                .into())
            }
        };
        let mut h = ctx.layer.run.device.open(g.w.nrows())?;
        for s in 0..samples {
            let a = (unit.rows_of)(s);
            if a.nrows() > 0 {
                let act = gated(g, u, a.as_ref(), m.spec.act);
                h.accumulate(act.as_ref(), unit.alpha)?;
            }
        }
        let names: Vec<String> = unit.down.iter().map(|&i| name(i)).collect();
        solve_group(ctx.layer.run, h, lw, &unit.down, &names, results)?;
    }
    Ok(())
}

/// RTN for `modules` (an expert too few calibration tokens reach); returns how many.
fn rtn_modules<'i>(
    ctx: &ExpertCtx<'_>,
    lw: &mut LayerWeights,
    results: &mut [Option<QuantizedLinear>],
    modules: impl Iterator<Item = &'i usize>,
) -> Result<u64> {
    let mut n = 0u64;
    for &i in modules {
        let w = &lw
            .module(i)
            .ok_or(NumericError::ModuleMissing {
                index: i,
                group: None,
            })?
            .w;
        let q = rtn_quantize(w, &ctx.layer.run.job.params);
        if let Some(l) = lw.module_mut(i) {
            l.w = dequantize_weight(&q);
        }
        results[i] = Some(q);
        n += 1;
    }
    Ok(n)
}

/// The expert-coverage report of a MoE run (quality sidecar `expertCoverage`).
pub(super) struct ExpertCoverage {
    threshold_percent: f64,
    n_tokens: usize,
    layers: Vec<Value>,
    experts: u64,
    low_experts: u64,
    low_modules: u64,
    min_percent: f64,
}

impl ExpertCoverage {
    pub(super) fn new(threshold_percent: f64, n_tokens: usize) -> Self {
        ExpertCoverage {
            threshold_percent,
            n_tokens,
            layers: Vec::new(),
            experts: 0,
            low_experts: 0,
            low_modules: 0,
            min_percent: f64::INFINITY,
        }
    }

    pub(super) fn add_layer(&mut self, layer: usize, tokens: &[u64], low_modules: u64) {
        if tokens.is_empty() {
            return;
        }
        let pct = |t: u64| 100.0 * t as f64 / self.n_tokens.max(1) as f64;
        self.experts += tokens.len() as u64;
        self.low_experts += tokens
            .iter()
            .filter(|&&t| t == 0 || pct(t) < self.threshold_percent)
            .count() as u64;
        self.low_modules += low_modules;
        for &t in tokens {
            self.min_percent = self.min_percent.min(pct(t));
        }
        self.layers
            .push(json!({"layer": layer, "tokensPerExpert": tokens}));
    }

    pub(super) fn report(&self) -> Option<Value> {
        (self.experts > 0).then(|| {
            json!({
                "thresholdPercent": self.threshold_percent,
                "calibrationTokens": self.n_tokens,
                "experts": self.experts,
                "lowCoverageExperts": self.low_experts,
                "lowCoverageRtnModules": self.low_modules,
                "minExpertTokenPercent": (self.min_percent * 1000.0).round() / 1000.0,
                "layers": self.layers,
            })
        })
    }
}
