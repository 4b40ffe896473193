//! The calibration side of a run: which modules are quantized, the tokenized samples and their
//! embeddings, each input group's Hessian from the activations of the layer being quantized, and
//! moving the activations on to the next layer.

use super::solve::LayerRun;
use super::{PhaseTimes, Progress, QuantizeJob};
use crate::device::{Device, ForwardPass, Session};
use crate::error::{Result, TensorError};
use crate::events::{fields, EventSink};
use crate::exclusion::Exclusion;
use crate::memory::release_free_memory;
use crate::model::calib::load_samples_counted;
use crate::model::llama::{
    attention_delta, embed, layer_forward, mlp_activation, mlp_output, rms_norm,
    scale_layer_output, token_mixer, Rope, Stage,
};
use crate::model::tensors::TensorStore;
use crate::model::{
    check_fused_experts, check_source_module, layer_modules, LayerWeights, ModelConfig,
};
use faer::Mat;
use serde_json::json;

/// What the run quantizes, checked against the source before anything is computed.
pub(super) struct ModulePlan {
    /// Full names of the candidate linears kept in full precision.
    pub(super) excluded: Vec<String>,
    /// Block-relative names of the modules quantized in each layer (the written config lists them).
    pub(super) quantized: Vec<Vec<String>>,
    /// Block-relative names of the candidate linears kept in full precision in each layer.
    pub(super) kept: Vec<Vec<String>>,
}

/// Checks every layer's modules (shapes, fused experts, routers) and splits them into quantized and
/// excluded.
pub(super) fn plan_modules(
    job: &QuantizeJob,
    cfg: &ModelConfig,
    store: &TensorStore,
    exclusion: &Exclusion,
) -> Result<ModulePlan> {
    let mut excluded = Vec::new();
    let mut quantized_names: Vec<Vec<String>> = Vec::with_capacity(cfg.num_layers);
    let mut kept: Vec<Vec<String>> = Vec::with_capacity(cfg.num_layers);
    for layer in 0..cfg.num_layers {
        let prefix = cfg.layer_prefix(layer);
        let mut names = Vec::new();
        let mut kept_here = Vec::new();
        check_fused_experts(store, cfg, layer)?;
        for spec in layer_modules(cfg, layer) {
            if spec.tied {
                continue;
            }
            let name = format!("{prefix}{}", spec.name);
            let (rows, cols) = spec.shape;
            check_source_module(store, cfg, layer, &spec)?;
            if exclusion.excludes(&name, cfg.hybrid) {
                excluded.push(name);
                kept_here.push(spec.name);
            } else {
                job.params.check_shape(&name, rows, cols)?;
                names.push(spec.name);
            }
        }
        if let Some(m) = cfg.sparse_layer(layer) {
            let router = format!("{prefix}{}.weight", m.spec.style.router_name());
            let e = store.entry(&router)?;
            if e.shape != [m.num_experts, cfg.hidden_size] {
                return Err(TensorError::Shape {
                    name: router,
                    shape: e.shape.clone(),
                    expected: vec![m.num_experts, cfg.hidden_size],
                }
                .into());
            }
        }
        quantized_names.push(names);
        kept.push(kept_here);
    }
    Ok(ModulePlan {
        excluded,
        quantized: quantized_names,
        kept,
    })
}

/// The tokenized calibration samples, reported as the `calibration` progress step.
pub(super) fn load_calibration(
    job: &QuantizeJob,
    device: &dyn Device,
    progress: &mut Progress<'_>,
) -> Result<Vec<Vec<u32>>> {
    let loaded = load_samples_counted(&job.model_dir, &job.dataset, &job.calib)?;
    if loaded.skipped_unencodable > 0 {
        tracing::warn!(
            skipped = loaded.skipped_unencodable,
            "calibration samples skipped: their text needs bytes tokenizer.json's vocabulary lacks"
        );
    }
    let skipped = loaded.skipped_unencodable;
    let samples = loaded.ids;
    let n_tokens: usize = samples.iter().map(Vec::len).sum();
    progress.emit(
        "calibration",
        0.0,
        format!(
            "{} samples, {n_tokens} tokens, backend {}{}",
            samples.len(),
            device.describe(),
            if skipped > 0 {
                format!(", {skipped} samples skipped (bytes the tokenizer vocabulary lacks)")
            } else {
                String::new()
            }
        ),
        fields([
            ("samples", json!(samples.len())),
            ("tokens", json!(n_tokens)),
            ("skippedSamples", json!(skipped)),
        ]),
    );
    Ok(samples)
}

/// Each sample's embeddings, the input of layer 0. Embedding rows are read one token at a time from
/// the mapping (no f32 copy of the whole table).
pub(crate) fn embed_samples(
    store: &TensorStore,
    cfg: &ModelConfig,
    samples: &[Vec<u32>],
) -> Result<Vec<Mat<f32>>> {
    let hidden = samples
        .iter()
        .map(|s| embed(store, cfg, None, s))
        .collect::<Result<_>>()?;
    store.release_pages();
    Ok(hidden)
}

/// Most tokens a device forward batch holds when `N_PARALLEL_CALIB_SAMPLES` is unset and the device's memory
/// is unknown.
const DEVICE_BATCH_TOKENS: usize = 8192;
/// Most tokens of a device forward batch chosen from the memory budget.
const MAX_DEVICE_BATCH_TOKENS: usize = 32768;

/// Device bytes one token of a forward batch holds at most: the normalised input, the attention's q, k, v
/// and output, the attention delta, the MLP's gate and up (f32).
pub(super) fn forward_bytes_per_token(cfg: &ModelConfig) -> usize {
    let widest = cfg
        .layer_attn
        .iter()
        .map(|a| (a.heads * a.head_dim, a.kv_heads * a.head_dim))
        .fold(
            (
                cfg.num_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
            ),
            |m, a| (m.0.max(a.0), m.1.max(a.1)),
        );
    4 * (2 * cfg.hidden_size + 2 * widest.0 + 2 * widest.1 + 2 * cfg.intermediate_size)
}

/// Tokens per device forward batch: `N_PARALLEL_CALIB_SAMPLES` whole samples when set, else as many as a
/// quarter of the device budget holds (at least one sample, at most [`MAX_DEVICE_BATCH_TOKENS`]).
pub(super) fn device_batch_tokens(
    cfg: &ModelConfig,
    samples: Option<usize>,
    budget: Option<u64>,
    max_len: usize,
) -> usize {
    if let Some(n) = samples {
        return n.max(1) * max_len.max(1);
    }
    let per = forward_bytes_per_token(cfg).max(1) as u64;
    let fit = budget.map_or(DEVICE_BATCH_TOKENS as u64, |b| b / 4 / per) as usize;
    fit.min(MAX_DEVICE_BATCH_TOKENS).max(max_len.max(1))
}

/// The device forward for this run, or `None` (the forward runs on the CPU) with a `calibration_forward`
/// event saying why when the device has one but it is not used.
pub(super) fn device_forward<'d>(
    job: &QuantizeJob,
    device: &'d dyn Device,
    cfg: &ModelConfig,
    n_tokens: usize,
    max_len: usize,
    events: &dyn EventSink,
) -> Option<Box<dyn ForwardPass + 'd>> {
    let report = |on: &str, reason: String, batch: Option<usize>| {
        events.emit(
            flexinfer_contract::events::CALIBRATION_FORWARD,
            fields([
                ("on", json!(on)),
                ("device", json!(device.describe())),
                ("reason", json!(reason)),
                ("batchTokens", json!(batch)),
            ]),
        );
    };
    let budget = device.memory_budget();
    let batch = device_batch_tokens(cfg, job.n_parallel_calib_samples, budget, max_len);
    if !job.device_forward {
        // Only worth saying on a device that has a forward.
        if device.forward(cfg.hidden_size, batch).is_some() {
            report("cpu", "GPTQ_DEVICE_FORWARD=off".into(), None);
        }
        return None;
    }
    let resident = (n_tokens * cfg.hidden_size * 4) as u64;
    let temps = (batch * forward_bytes_per_token(cfg)) as u64;
    let mut spill = None;
    if let Some(b) = budget.filter(|&b| resident + temps > b / 2) {
        if temps > b / 2 {
            if device.forward(cfg.hidden_size, batch).is_some() {
                report(
                    "cpu",
                    format!(
                        "one batch's temporaries ({} MiB for {batch} tokens) need more than half of the device budget of {} MiB (GPU_VRAM_MB × GPU_MEMORY_FRACTION); a smaller N_PARALLEL_CALIB_SAMPLES or shorter samples fit",
                        temps >> 20,
                        b >> 20
                    ),
                    Some(batch),
                );
            }
            return None;
        }
        spill = Some(format!(
            "the calibration activations ({} MiB) stay in host memory and each batch is uploaded for its stage: with a batch's temporaries ({} MiB) they need more than half of the device budget of {} MiB (GPU_VRAM_MB × GPU_MEMORY_FRACTION)",
            resident >> 20,
            temps >> 20,
            b >> 20
        ));
    }
    match device.forward(cfg.hidden_size, batch)? {
        Ok(mut f) => {
            f.set_spill(spill.is_some());
            report(
                "device",
                spill.unwrap_or_else(|| {
                    "every supported layer; the activations stay on the device".into()
                }),
                Some(batch),
            );
            Some(f)
        }
        Err(e) => {
            report("cpu", e.to_string(), Some(batch));
            None
        }
    }
}

/// [`accumulate_stage`] with the activations on the device: the stage runs there batch by batch and each
/// batch's input goes into the group's session without leaving the device (a session on the host gets a copy).
pub(super) fn accumulate_stage_device<'d>(
    device: &'d dyn Device,
    forward: &mut dyn ForwardPass,
    s: &StageInput<'_>,
    cols: usize,
) -> Result<Option<Box<dyn Session + 'd>>> {
    let mut h = if s.active {
        Some(device.open(cols)?)
    } else {
        None
    };
    let alpha = 2.0 / s.layer.n_tokens as f32;
    let session: Option<&mut dyn Session> = match h.as_mut() {
        Some(b) => Some(&mut **b),
        None => None,
    };
    forward.stage(s.layer.run.cfg, s.lw, s.layer.rope, s.stage, session, alpha)?;
    Ok(h)
}

/// A device error of the forward, saying how to keep the forward on the CPU (the run fails with it; the
/// Job's retry resumes from the layer cache).
pub(super) fn forward_error(mut e: crate::device::DeviceError) -> crate::error::QuantError {
    e.message = format!(
        "{} (calibration forward on the device; GPTQ_DEVICE_FORWARD=off keeps it on the CPU, with the Hessians and solves still on the GPU)",
        e.message
    );
    e.into()
}

/// Where one input group's Hessian comes from.
pub(super) struct StageInput<'a> {
    pub(super) layer: &'a LayerRun<'a>,
    pub(super) lw: &'a LayerWeights,
    pub(super) stage: Stage,
    /// Some module of the group is quantized (else no Hessian is made).
    pub(super) active: bool,
}

/// The device session holding the Hessian of one input group over every sample (`None` when every
/// module of the group is excluded). The [`Stage::GateUp`] stage also turns `hidden` into each
/// sample's residual after attention. Up to `batch` samples' activations are stacked into one
/// product (bounded memory, better GEMM).
pub(super) fn accumulate_stage<'d>(
    device: &'d dyn Device,
    s: &StageInput<'_>,
    cols: usize,
    hidden: &mut [Mat<f32>],
) -> Result<Option<Box<dyn Session + 'd>>> {
    let mut h = if s.active {
        Some(device.open(cols)?)
    } else {
        None
    };
    let times = &s.layer.run.times;
    for chunk in hidden.chunks_mut(s.layer.batch) {
        let t = std::time::Instant::now();
        let mut acts: Vec<Mat<f32>> = Vec::with_capacity(chunk.len());
        for x in chunk.iter_mut() {
            let Some(a) = stage_activation(s, x) else {
                continue;
            };
            if s.active {
                acts.push(a);
            }
        }
        PhaseTimes::add(times, |p| &mut p.forward, t);
        let Some(h) = h.as_mut() else {
            continue;
        };
        let t = std::time::Instant::now();
        accumulate_stacked(&mut **h, acts, cols, 2.0 / s.layer.n_tokens as f32)?;
        PhaseTimes::add(times, |p| &mut p.hessian, t);
    }
    Ok(h)
}

/// The input of the stage's modules for one sample; `None` where the stage has nothing to add.
fn stage_activation(s: &StageInput<'_>, x: &mut Mat<f32>) -> Option<Mat<f32>> {
    let (cfg, lw) = (s.layer.run.cfg, s.lw);
    Some(match s.stage {
        Stage::Qkv => rms_norm(x.as_ref(), &lw.input_norm, cfg.rms_norm_eps),
        Stage::O if !s.active => return None,
        Stage::O => {
            let hn = rms_norm(x.as_ref(), &lw.input_norm, cfg.rms_norm_eps);
            token_mixer(cfg, lw, hn.as_ref(), s.layer.rope)
        }
        Stage::GateUp => {
            let hn = rms_norm(x.as_ref(), &lw.input_norm, cfg.rms_norm_eps);
            let att = token_mixer(cfg, lw, hn.as_ref(), s.layer.rope);
            drop(hn);
            // The residual after attention replaces the layer input in place (the input
            // is not needed any more; no second activation-sized buffer).
            let o = attention_delta(cfg, lw, att.as_ref());
            drop(att);
            add_in_place(x, &o);
            drop(o);
            if !s.active {
                return None;
            }
            rms_norm(x.as_ref(), &lw.post_norm, cfg.rms_norm_eps)
        }
        Stage::Down => mlp_activation(cfg, lw, x.as_ref()),
    })
}

/// Adds the activations of one batch of samples to the Hessian: one product of the stacked rows.
fn accumulate_stacked(
    h: &mut dyn Session,
    mut acts: Vec<Mat<f32>>,
    cols: usize,
    alpha: f32,
) -> Result<()> {
    if let [one] = acts.as_slice() {
        h.accumulate(one.as_ref(), alpha)?;
        return Ok(());
    }
    let rows: usize = acts.iter().map(|a| a.nrows()).sum();
    let mut stacked = Mat::<f32>::zeros(rows, cols);
    let mut r0 = 0;
    for a in acts.drain(..) {
        stacked.subrows_mut(r0, a.nrows()).copy_from(&a);
        r0 += a.nrows();
    }
    h.accumulate(stacked.as_ref(), alpha)?;
    Ok(())
}

/// Moves every sample's activations through the (now quantized or cached) layer: from the residual
/// after attention when `hidden_is_x1`, else from the layer input.
pub(super) fn advance(
    cfg: &ModelConfig,
    lw: &LayerWeights,
    rope: &Rope,
    hidden: &mut [Mat<f32>],
    hidden_is_x1: bool,
) {
    if hidden_is_x1 {
        for x in hidden.iter_mut() {
            let dn = mlp_output(cfg, lw, x.as_ref());
            add_in_place(x, &dn);
            scale_layer_output(lw, x);
        }
    } else {
        for x in hidden.iter_mut() {
            *x = layer_forward(cfg, lw, x.as_ref(), rope, None);
        }
    }
    release_free_memory();
}

/// `x += y` (same shape), elementwise: the same sums as `x + y`, without a new matrix.
fn add_in_place(x: &mut Mat<f32>, y: &Mat<f32>) {
    for j in 0..x.ncols().min(y.ncols()) {
        let yc = y.col_as_slice(j);
        for (a, b) in x.col_as_slice_mut(j).iter_mut().zip(yc) {
            *a += *b;
        }
    }
}
