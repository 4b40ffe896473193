//! Quantizing the decoder layers one after another (true sequential): a cached layer is read back,
//! any other has each input group's Hessian accumulated, solved on the device and its modules
//! replaced by their quantized weights before the next group; every finished layer is cached.

use super::calibrate::{
    accumulate_stage, accumulate_stage_device, advance, forward_error, StageInput,
};
use super::experts::{quantize_experts, ExpertCoverage, ExpertCtx};
use super::solve::{solve_group, LayerRun};
use super::{PhaseTimes, Progress};
use crate::device::kernel::forward::layer_unsupported;
use crate::device::{ForwardPass, ForwardTimes};
use crate::error::{NumericError, Result};
use crate::events::fields;
use crate::events::EventSink;
use crate::job::cache::{LayerCache, LayerStats};
use crate::job::writer::OutTensor;
use crate::memory::release_free_memory;
use crate::model::llama::{Stage, STAGES};
use crate::model::tensors::TensorStore;
use crate::model::{
    input_groups, layer_modules, load_layer, load_linear, GptqReadConfig, LayerWeights, ModuleSpec,
};
use crate::numerics::gptq::{Method, QuantizedLinear};
use crate::numerics::pack::{pack, ZeroFormat};
use faer::Mat;
use safetensors::Dtype;
use serde_json::{json, Value};
use std::borrow::Cow;

/// What the layer loop adds up: the module counts of the gate and the expert coverage.
pub(super) struct Totals {
    pub(super) gptq: u64,
    pub(super) rtn: u64,
    pub(super) coverage: ExpertCoverage,
}

/// Where the calibration activations are: on the host, or on the device of the run's forward, which then
/// runs every layer it supports (the others on the CPU, the activations copied across at the switch).
pub(super) struct Activations<'f> {
    host: Vec<Mat<f32>>,
    device: Option<Box<dyn ForwardPass + 'f>>,
    /// The reason of the last `calibration_forward` event that moved a layer to the CPU (said once).
    reported: Option<&'static str>,
}

impl<'f> Activations<'f> {
    pub(super) fn new(host: Vec<Mat<f32>>, device: Option<Box<dyn ForwardPass + 'f>>) -> Self {
        Activations {
            host,
            device,
            reported: None,
        }
    }

    /// The forward for a layer that runs on the device (the activations uploaded if they are on the
    /// host), or `None` with the activations on the host: no device forward, or `unsupported` says why
    /// this layer's forward is not on the device.
    fn place(
        &mut self,
        layer: usize,
        unsupported: Option<&'static str>,
        events: &dyn EventSink,
    ) -> Result<Option<&mut (dyn ForwardPass + 'f)>> {
        let Some(f) = self.device.as_mut() else {
            return Ok(None);
        };
        match unsupported {
            None => {
                if !f.resident() {
                    f.upload(std::mem::take(&mut self.host))
                        .map_err(forward_error)?;
                }
                Ok(Some(&mut **f))
            }
            Some(reason) => {
                if f.resident() {
                    self.host = f.download().map_err(forward_error)?;
                }
                if self.reported != Some(reason) {
                    self.reported = Some(reason);
                    events.emit(
                        flexinfer_contract::events::CALIBRATION_FORWARD,
                        fields([
                            ("on", json!("cpu")),
                            ("device", json!(f.name())),
                            ("layer", json!(layer)),
                            ("reason", json!(format!("layer {layer} is {reason}, which the device forward does not run"))),
                        ]),
                    );
                }
                Ok(None)
            }
        }
    }

    /// The device forward's own times (`None` without one).
    pub(super) fn times(&self) -> Option<ForwardTimes> {
        self.device.as_ref().map(|f| f.times())
    }
}

/// Progress of the quantize step after `done` layers (it spans 0–95 %).
fn layer_percent(done: f64, layers: usize) -> f64 {
    95.0 * done / layers.max(1) as f64
}

/// The progress fields of layer `layer` with `done` layers finished.
fn layer_fields(layer: usize, layers: usize, done: usize) -> serde_json::Map<String, Value> {
    fields([
        ("layer", json!(layer)),
        ("layers", json!(layers)),
        ("unit", json!("layers")),
        ("done", json!(done)),
        ("total", json!(layers)),
    ])
}

/// Every layer in order: cached ones are read back, the others quantized and cached; `hidden` moves
/// through each layer with its quantized weights.
pub(super) fn quantize_layers(
    lr: &LayerRun<'_>,
    cache: &mut LayerCache,
    progress: &mut Progress<'_>,
    acts: &mut Activations<'_>,
) -> Result<Totals> {
    let mut totals = Totals {
        gptq: 0,
        rtn: 0,
        coverage: ExpertCoverage::new(lr.run.job.expert_min_token_percent, lr.n_tokens),
    };
    let (cfg, store) = (lr.run.cfg, lr.run.store);
    for layer in 0..cfg.num_layers {
        let t = std::time::Instant::now();
        let mut lw = load_layer(store, cfg, layer, None)?;
        PhaseTimes::add(&lr.run.times, |p| &mut p.load, t);
        store.release_pages();
        release_free_memory();
        let unsupported = if cfg.sparse_layer(layer).is_some() {
            Some("a mixture-of-experts layer")
        } else {
            layer_unsupported(&lw)
        };
        let on_device = acts.place(layer, unsupported, lr.run.events)?.is_some();
        // True once the activations hold each sample's residual after attention (a freshly quantized layer).
        let hidden_is_x1 = if layer < cache.completed_layers() {
            load_cached_layer(lr, cache, layer, &mut lw, &mut totals, progress)?;
            false
        } else {
            quantize_layer(
                lr,
                cache,
                layer,
                &mut lw,
                acts,
                on_device,
                &mut totals,
                progress,
            )?
        };
        let t = std::time::Instant::now();
        match acts.device.as_mut().filter(|_| on_device) {
            Some(f) => f
                .advance(cfg, &lw, lr.rope, hidden_is_x1)
                .map_err(forward_error)?,
            None => {
                advance(cfg, &lw, lr.rope, &mut acts.host, hidden_is_x1);
                PhaseTimes::add(&lr.run.times, |p| &mut p.forward, t);
            }
        }
        #[cfg(feature = "test-hooks")]
        if lr.run.job.abort_after_layer == Some(layer) {
            return Err(crate::error::QuantError::TestAbort(layer));
        }
    }
    Ok(totals)
}

/// Resume: the cached packed modules replace the source weights, read with the consumer's rules.
fn load_cached_layer(
    lr: &LayerRun<'_>,
    cache: &LayerCache,
    layer: usize,
    lw: &mut LayerWeights,
    totals: &mut Totals,
    progress: &mut Progress<'_>,
) -> Result<()> {
    let (cfg, job) = (lr.run.cfg, lr.run.job);
    let layers = cfg.num_layers;
    let prefix = cfg.layer_prefix(layer);
    let path = cache
        .layer_path(layer)
        .ok_or(NumericError::LayerNotCached { layer })?;
    let cstore = TensorStore::open_files(vec![path])?;
    let gq = GptqReadConfig {
        bits: job.params.bits,
        format: ZeroFormat::for_sym(job.params.sym),
    };
    for (i, spec) in layer_modules(cfg, layer).iter().enumerate() {
        let name = format!("{prefix}{}", spec.name);
        if cstore.contains(&format!("{name}.qweight")) {
            let w = load_linear(&cstore, &name, spec.shape, Some(gq))?.w;
            if let Some(l) = lw.module_mut(i) {
                l.w = w;
            }
        }
    }
    lw.sync_tied();
    let entry = &cache.manifest.layers[layer];
    totals.gptq += entry.gptq_modules;
    totals.rtn += entry.rtn_modules;
    totals
        .coverage
        .add_layer(layer, &entry.expert_tokens, entry.low_coverage_rtn_modules);
    progress.emit(
        "quantize",
        layer_percent(layer as f64 + 1.0, layers),
        format!("layer {}/{layers} loaded from cache", layer + 1),
        layer_fields(layer, layers, layer + 1),
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
/// Quantizes one layer from the calibration activations `hidden` (its input) and caches it.
/// Returns whether `hidden` now holds the residual after attention.
fn quantize_layer(
    lr: &LayerRun<'_>,
    cache: &mut LayerCache,
    layer: usize,
    lw: &mut LayerWeights,
    acts: &mut Activations<'_>,
    on_device: bool,
    totals: &mut Totals,
    progress: &mut Progress<'_>,
) -> Result<bool> {
    let cfg = lr.run.cfg;
    let layers = cfg.num_layers;
    let prefix = cfg.layer_prefix(layer);
    let specs = layer_modules(cfg, layer);
    let mut results: Vec<Option<QuantizedLinear>> = vec![None; specs.len()];
    let sparse = cfg.sparse_layer(layer).cloned();
    let (mut low_rtn, mut expert_tokens) = (0u64, Vec::new());
    let hidden_is_x1 = quantize_stages(
        lr,
        layer,
        &specs,
        lw,
        acts,
        on_device,
        &mut results,
        sparse.is_some(),
        progress,
    )?;
    if let Some(m) = &sparse {
        let ctx = ExpertCtx {
            layer: lr,
            moe: m,
            prefix: &prefix,
            specs: &specs,
        };
        let (tokens, low) = quantize_experts(&ctx, &acts.host, lw, &mut results)?;
        expert_tokens = tokens;
        low_rtn = low;
        progress.emit(
            "quantize",
            layer_percent(layer as f64 + 0.9, layers),
            format!("layer {}/{layers}: {} experts", layer + 1, m.num_experts),
            layer_fields(layer, layers, layer),
        );
    }
    cache_layer(
        lr,
        cache,
        layer,
        &specs,
        &results,
        expert_tokens,
        low_rtn,
        totals,
    )?;
    progress.emit(
        "quantize",
        layer_percent(layer as f64 + 1.0, layers),
        format!("layer {}/{layers} done", layer + 1),
        layer_fields(layer, layers, layer + 1),
    );
    Ok(hidden_is_x1)
}

/// The dense stages of one layer in true-sequential order: every stage sees the modules before it
/// already quantized. The attention output feeds two stages (o_proj's Hessian, then the residual for
/// gate/up); it is computed again for the second rather than kept, so the calibration activations are
/// resident once, not twice. A sparse layer stops before the dense down stage (its experts follow).
/// Returns whether `hidden` now holds the residual after attention.
#[allow(clippy::too_many_arguments)]
fn quantize_stages(
    lr: &LayerRun<'_>,
    layer: usize,
    specs: &[ModuleSpec],
    lw: &mut LayerWeights,
    acts: &mut Activations<'_>,
    on_device: bool,
    results: &mut [Option<QuantizedLinear>],
    sparse: bool,
    progress: &mut Progress<'_>,
) -> Result<bool> {
    let cfg = lr.run.cfg;
    let layers = cfg.num_layers;
    let prefix = cfg.layer_prefix(layer);
    let mut hidden_is_x1 = false;
    let groups = input_groups(cfg, layer);
    for (stage, group) in STAGES.iter().zip(groups.iter()) {
        if sparse && *stage == Stage::Down {
            break;
        }
        let moe_gate_up = sparse && *stage == Stage::GateUp;
        let group: &[usize] = if moe_gate_up { &[] } else { group.as_slice() };
        let active: Vec<usize> = group
            .iter()
            .copied()
            .filter(|&i| {
                !specs[i].tied
                    && !lr
                        .run
                        .exclusion
                        .excludes(&format!("{prefix}{}", specs[i].name), cfg.hybrid)
            })
            .collect();
        let cols = group.first().map_or(0, |&g| lw.linears[g].w.ncols());
        // The group's device session (its Hessian); none when every module of the group is excluded.
        let input = StageInput {
            layer: lr,
            lw,
            stage: *stage,
            active: !active.is_empty(),
        };
        let h = match acts.device.as_mut().filter(|_| on_device) {
            Some(f) => accumulate_stage_device(lr.run.device, &mut **f, &input, cols)?,
            None => accumulate_stage(lr.run.device, &input, cols, &mut acts.host)?,
        };
        release_free_memory();
        if *stage == Stage::GateUp {
            hidden_is_x1 = true;
        }
        let Some(h) = h else {
            continue;
        };
        let names: Vec<String> = active
            .iter()
            .map(|&i| format!("{prefix}{}", specs[i].name))
            .collect();
        solve_group(lr.run, h, lw, &active, &names, results)?;
        progress.emit(
            "quantize",
            layer_percent(layer as f64 + (*stage as usize + 1) as f64 / 5.0, layers),
            format!("layer {}/{layers}: {}", layer + 1, names.join(", ")),
            layer_fields(layer, layers, layer),
        );
    }
    Ok(hidden_is_x1)
}

/// Packs the layer's quantized modules into the cache and adds its counts to `totals`.
#[allow(clippy::too_many_arguments)]
fn cache_layer(
    lr: &LayerRun<'_>,
    cache: &mut LayerCache,
    layer: usize,
    specs: &[ModuleSpec],
    results: &[Option<QuantizedLinear>],
    expert_tokens: Vec<u64>,
    low_rtn: u64,
    totals: &mut Totals,
) -> Result<()> {
    let started = std::time::Instant::now();
    let r = (|| -> Result<()> {
        let prefix = lr.run.cfg.layer_prefix(layer);
        let mut tensors = Vec::new();
        let (mut g, mut r) = (0u64, 0u64);
        for (i, q) in results.iter().enumerate() {
            if let Some(q) = q {
                match q.method {
                    Method::Gptq => g += 1,
                    Method::Rtn => r += 1,
                }
                tensors.extend(module_tensors(&format!("{prefix}{}", specs[i].name), q));
            }
        }
        totals.coverage.add_layer(layer, &expert_tokens, low_rtn);
        cache.write_layer(
            layer,
            &tensors,
            LayerStats {
                gptq_modules: g,
                rtn_modules: r,
                expert_tokens,
                low_coverage_rtn_modules: low_rtn,
            },
            lr.run.events,
        )?;
        drop(tensors);
        release_free_memory();
        tracing::info!(
            layer,
            gptq = g,
            rtn = r,
            elapsed_s = lr.run.started.elapsed().as_secs_f64(),
            "layer quantized"
        );
        totals.gptq += g;
        totals.rtn += r;
        Ok(())
    })();
    PhaseTimes::add(&lr.run.times, |p| &mut p.cache, started);
    r
}

/// Packed tensors of one quantized module, named as in the checkpoint.
fn module_tensors(name: &str, q: &QuantizedLinear) -> Vec<OutTensor<'static>> {
    let p = pack(q, ZeroFormat::for_sym(q.sym));
    let i32_bytes = |v: &[i32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    vec![
        OutTensor {
            name: format!("{name}.qweight"),
            dtype: Dtype::I32,
            shape: vec![p.qweight.len() / p.rows, p.rows],
            data: Cow::Owned(i32_bytes(&p.qweight)),
        },
        OutTensor {
            name: format!("{name}.qzeros"),
            dtype: Dtype::I32,
            shape: vec![p.groups, p.qzeros.len() / p.groups.max(1)],
            data: Cow::Owned(i32_bytes(&p.qzeros)),
        },
        OutTensor {
            name: format!("{name}.scales"),
            dtype: Dtype::F16,
            shape: vec![p.groups, p.rows],
            data: Cow::Owned(p.scales.iter().flat_map(|s| s.to_le_bytes()).collect()),
        },
        OutTensor {
            name: format!("{name}.g_idx"),
            dtype: Dtype::I32,
            shape: vec![p.cols],
            data: Cow::Owned(i32_bytes(&p.g_idx)),
        },
    ]
}
