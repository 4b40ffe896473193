//! An AWQ artifact directory in AutoAWQ's GEMM layout (`quant_method: awq`, `version: gemm`, what vLLM
//! and transformers load): the calibration samples run through the model layer by layer; in each layer
//! the four shared-input groups (q/k/v after `input_layernorm`, o after v, gate/up after
//! `post_attention_layernorm`, down after up) get their scales searched ([`super::search`]) and folded
//! into the preceding norm or linear, every linear but q/k its clipping searched, and all seven are
//! quantized to 4-bit groups with zero points; every layer sees the full-precision model's activations.
//! Each linear's output error is measured against plain rounding's ([`super::gate`]); a run whose mean
//! ratio exceeds the job's limit fails before anything is written. Written with the GPTQ writer's shards,
//! index, tokenizer files, quality sidecar and `.save-complete`; staged beside `out_dir` and exchanged into
//! place whole; a finished artifact of the same digest is reused.

use super::gate::{evaluate, folded_ratio, GATE_TOKENS};
use super::gemm::{pack_gemm, quantize, BITS, PACK};
use super::search::{sample_rows, search_clip, search_scales};
use crate::error::{QuantError, Result, SpecError};
use crate::events::EventSink;
use crate::fsutil::sha256_hex;
use crate::job::digest::input_digest;
use crate::job::rewrite::{
    merged_tensors, progress, write_work_file, ArtifactRun, RewriteOutcome, Rewritten, WorkTensor,
};
use crate::model::calib::{load_samples_counted, CalibSettings};
use crate::model::config::ModelConfig;
use crate::model::llama::{embed, layer_forward_visit, Rope, Stage};
use crate::model::tensors::TensorStore;
use crate::model::{check_source_module, layer_modules, load_layer, LayerWeights};
use faer::Mat;
use flexinfer_contract::files::AwqQuality;
use safetensors::Dtype;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

/// Group sizes the GEMM kernels take (vLLM's `awq` method: 32, 64, 128; AutoAWQ's default 128).
pub const GROUP_SIZES: [usize; 3] = flexinfer_contract::env::AWQ_GROUP_SIZES;
/// Calibration tokens (evenly strided) the scale search measures on, per module group.
const SCALE_TOKENS: usize = 4096;
/// Calibration tokens the clipping search measures on (AutoAWQ's `n_sample_token` is 512).
const CLIP_TOKENS: usize = 512;

/// What to make.
pub struct AwqJob<'a> {
    pub model_dir: &'a Path,
    /// The artifact directory (the worker contract's `OUT_DIR`).
    pub out_dir: &'a Path,
    /// The calibration dataset and how much of it to use.
    pub dataset: &'a Path,
    pub calib: CalibSettings,
    pub bits: u32,
    pub group_size: i32,
    pub script_version: &'a str,
    /// Re-hash the shards of an existing `.save-complete` before reusing it (else sizes only).
    pub verify_save_sha256: bool,
    pub max_shard_bytes: u64,
    /// The quality gate's limit on the mean output error ratio to plain rounding
    /// (`AWQ_MAX_OUTPUT_ERROR_RATIO`; [`super::gate::DEFAULT_MAX_OUTPUT_ERROR_RATIO`]).
    pub max_output_error_ratio: f64,
}

/// What a finished (or reused) artifact is.
pub type AwqOutcome = RewriteOutcome<AwqQuality>;

/// transformers' `AwqConfig` / vLLM's `AWQConfig` of the artifact.
pub fn quantization_config(group_size: usize) -> Value {
    json!({
        "quant_method": "awq",
        "bits": BITS,
        "group_size": group_size,
        "zero_point": true,
        "version": "gemm",
        "modules_to_not_convert": ["lm_head"],
        "quantizer": format!("flexinfer-quant:{}", env!("CARGO_PKG_VERSION")),
    })
}

/// The settings and the model, checked before anything is read beyond `config.json` and the tensor
/// headers: 4 bits, a group size the kernels take that divides every linear's input, output features in
/// whole words, and a family whose scales fold (plain RMSNorm before q/k/v and gate/up, no experts, no
/// linear attention).
fn check(job: &AwqJob<'_>, cfg: &ModelConfig, store: &TensorStore) -> Result<usize> {
    if !(job.max_output_error_ratio.is_finite() && job.max_output_error_ratio > 0.0) {
        return Err(SpecError::Value {
            field: flexinfer_contract::env::AWQ_MAX_OUTPUT_ERROR_RATIO.into(),
            value: job.max_output_error_ratio.to_string(),
            expected:
                "a positive number (1: no worse than plain rounding on the calibration tokens)"
                    .into(),
        }
        .into());
    }
    if job.bits != BITS {
        return Err(SpecError::Value {
            field: flexinfer_contract::env::BITS.into(),
            value: job.bits.to_string(),
            expected: "4 (the AWQ GEMM layout holds 4-bit codes only)".into(),
        }
        .into());
    }
    let group = usize::try_from(job.group_size)
        .ok()
        .filter(|g| GROUP_SIZES.contains(g))
        .ok_or_else(|| SpecError::Value {
            field: flexinfer_contract::env::GROUP_SIZE.into(),
            value: job.group_size.to_string(),
            expected: "32, 64 or 128 (the AWQ GEMM kernels' group sizes)".into(),
        })?;
    let family = if cfg.gemma.is_some() {
        Some("Gemma's (1 + w) norms")
    } else if cfg.moe.is_some() {
        Some("mixture-of-experts layers")
    } else if cfg.hybrid {
        Some("linear-attention layers")
    } else {
        None
    };
    if let Some(why) = family {
        return Err(SpecError::Value {
            field: "config.json architectures".into(),
            value: cfg.architecture.clone(),
            expected: format!(
                "a dense Llama-family decoder (the AWQ engine does not fold scales across {why})"
            ),
        }
        .into());
    }
    for layer in 0..cfg.num_layers {
        let prefix = cfg.layer_prefix(layer);
        for spec in layer_modules(cfg, layer) {
            check_source_module(store, cfg, layer, &spec)?;
            let (rows, cols) = spec.shape;
            let module = format!("{prefix}{}", spec.name);
            if cols % group != 0 {
                return Err(SpecError::GroupDivides {
                    module,
                    group_size: job.group_size,
                    cols,
                }
                .into());
            }
            if rows % PACK != 0 {
                return Err(SpecError::Value {
                    field: module,
                    value: format!("{rows} output features"),
                    expected: "a multiple of 8 (the GEMM layout packs 8 outputs per word)".into(),
                }
                .into());
            }
        }
    }
    Ok(group)
}

/// The digest of everything that determines the artifact's bytes.
fn digest_of(job: &AwqJob<'_>, store: &TensorStore) -> Result<String> {
    let dataset = std::fs::read(job.dataset).map_err(|e| QuantError::io(job.dataset, e))?;
    Ok(sha256_hex(
        json!({
            "format": "awq", "bits": job.bits, "group_size": job.group_size,
            "model": input_digest(job.model_dir, store)?, "dataset": sha256_hex(&dataset),
            "max_samples": job.calib.max_samples, "max_seq_len": job.calib.max_seq_len,
            "max_shard_bytes": job.max_shard_bytes,
            "max_output_error_ratio": job.max_output_error_ratio,
            "script_version": job.script_version, "engine": env!("CARGO_PKG_VERSION"),
        })
        .to_string()
        .as_bytes(),
    ))
}

/// Makes (or reuses) the AWQ artifact of `job`. Bad input (settings, architecture, shapes, dataset) is
/// found before anything is moved to `out_dir`; a previous artifact there stays whole.
pub fn write_awq_artifact(job: &AwqJob<'_>, events: &dyn EventSink) -> Result<AwqOutcome> {
    let started = Instant::now();
    let cfg = ModelConfig::load(job.model_dir)?;
    let store = TensorStore::open_dir(job.model_dir)?;
    let group = check(job, &cfg, &store)?;
    let digest = digest_of(job, &store)?;
    let run = ArtifactRun::new("awq", job.out_dir, &store, &digest, started);
    if let Some(o) = run.reuse(job.verify_save_sha256, events) {
        return Ok(o);
    }
    let samples = load_samples_counted(job.model_dir, job.dataset, &job.calib)?.ids;
    run.rewrite(events, |work| {
        quantize_and_save(job, &cfg, &store, &samples, group, work, &digest, events)
    })
}

/// Every sample's input of each module group, stacked (`[tokens, in]` per stage, in [`Stage`] order); each
/// sample of `hidden` becomes the layer's full-precision output, the next layer's input (AutoAWQ's order:
/// the activations of the unquantized model, one forward per layer).
fn stage_inputs(
    cfg: &ModelConfig,
    lw: &LayerWeights,
    hidden: &mut [Mat<f32>],
    rope: &Rope,
) -> Vec<Mat<f32>> {
    let mut parts: [Vec<Mat<f32>>; 4] = Default::default();
    for x in hidden.iter_mut() {
        layer_forward_visit(cfg, lw, x, rope, &mut |stage, m| {
            parts[stage as usize].push(m.to_owned());
        });
    }
    parts
        .iter()
        .map(|p| {
            let rows: usize = p.iter().map(Mat::nrows).sum();
            let cols = p.first().map_or(0, Mat::ncols);
            let mut out = Mat::<f32>::zeros(rows, cols);
            let mut r0 = 0;
            for m in p {
                out.as_mut()
                    .submatrix_mut(r0, 0, m.nrows(), cols)
                    .copy_from(m.as_ref());
                r0 += m.nrows();
            }
            out
        })
        .collect()
}

/// What the layer loop adds up for the sidecar.
#[derive(Default)]
struct Tally {
    errors: Vec<(String, f64)>,
    scaled: u64,
    unscaled: u64,
    loss_ratios: Vec<f64>,
    clipped: u64,
    clip_searched: u64,
    /// Per module: output error ratio to plain rounding ([`super::gate`]).
    output_ratios: Vec<(String, f64)>,
}

/// The linears whose input columns a stage's scales multiply, and the linear (if any, else a norm) whose
/// outputs they divide.
fn fold_targets(stage: Stage) -> (&'static [usize], Option<usize>) {
    match stage {
        Stage::Qkv => (&[0, 1, 2], None),
        Stage::O => (&[3], Some(2)),
        Stage::GateUp => (&[4, 5], None),
        Stage::Down => (&[6], Some(5)),
    }
}

/// Folds `s` into the module group of `stage`: the group's linears' input columns × s, the preceding
/// norm or linear's outputs ÷ s (the layer's function is unchanged), and the stage input ÷ s.
fn fold(lw: &mut LayerWeights, stage: Stage, s: &[f32], x: &mut Mat<f32>) {
    let (targets, before) = fold_targets(stage);
    for &i in targets {
        let w = &mut lw.linears[i].w;
        for (c, &sc) in s.iter().enumerate() {
            w.col_mut(c).iter_mut().for_each(|v| *v *= sc);
        }
    }
    match (stage, before) {
        (Stage::Qkv, _) => lw.input_norm.iter_mut().zip(s).for_each(|(n, sc)| *n /= sc),
        (Stage::GateUp, _) => lw.post_norm.iter_mut().zip(s).for_each(|(n, sc)| *n /= sc),
        (_, Some(p)) => {
            let l = &mut lw.linears[p];
            for (r, &sc) in s.iter().enumerate() {
                l.w.row_mut(r).iter_mut().for_each(|v| *v /= sc);
            }
            if let Some(b) = l.b.as_mut() {
                b.iter_mut().zip(s).for_each(|(v, sc)| *v /= sc);
            }
        }
        _ => {}
    }
    for (c, &sc) in s.iter().enumerate() {
        x.col_mut(c).iter_mut().for_each(|v| *v /= sc);
    }
}

fn row_major(w: &Mat<f32>) -> Vec<f32> {
    let (rows, cols) = (w.nrows(), w.ncols());
    let mut v = vec![0f32; rows * cols];
    for c in 0..cols {
        for (r, x) in w.col(c).iter().enumerate() {
            v[r * cols + c] = *x;
        }
    }
    v
}

/// `v` in `dtype` (the source's float dtype of the tensor it replaces), little-endian bytes.
fn encode(name: &str, v: &[f32], dtype: Dtype) -> Result<Vec<u8>> {
    Ok(match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::BF16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        Dtype::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        other => {
            return Err(SpecError::Value {
                field: name.to_string(),
                value: format!("{other:?}"),
                expected: "an F32, BF16 or F16 tensor".into(),
            }
            .into())
        }
    })
}

/// Searches, folds and quantizes one layer (its linears replaced by their dequantized weights); returns the
/// layer's tensors for the artifact.
fn quantize_layer(
    cfg: &ModelConfig,
    store: &TensorStore,
    layer: usize,
    lw: &mut LayerWeights,
    mut inputs: Vec<Mat<f32>>,
    group: usize,
    tally: &mut Tally,
) -> Result<Vec<WorkTensor>> {
    let prefix = cfg.layer_prefix(layer);
    let specs = layer_modules(cfg, layer);
    // The gate's tokens, before the folds divide the inputs, and what the folds do to each linear: its
    // input columns × `col_scale`, its outputs ÷ `row_scale` (undone to compare with the source).
    let gate_x: Vec<Mat<f32>> = inputs
        .iter()
        .map(|x| sample_rows(x.as_ref(), GATE_TOKENS))
        .collect();
    let mut col_scale: Vec<Option<Vec<f32>>> = vec![None; lw.linears.len()];
    let mut row_scale: Vec<Option<Vec<f32>>> = vec![None; lw.linears.len()];
    for (stage, x) in [Stage::Qkv, Stage::O, Stage::GateUp, Stage::Down]
        .into_iter()
        .zip(inputs.iter_mut())
    {
        let idx: &[usize] = match stage {
            Stage::Qkv => &[0, 1, 2],
            Stage::O => &[3],
            Stage::GateUp => &[4, 5],
            Stage::Down => &[6],
        };
        // o's scales fold into v only where v's outputs are o's inputs one to one (no grouped-query
        // sharing), AutoAWQ's rule.
        if stage == Stage::O && lw.linears[2].w.nrows() != lw.linears[3].w.ncols() {
            continue;
        }
        let sample = sample_rows(x.as_ref(), SCALE_TOKENS);
        let group_ws: Vec<&Mat<f32>> = idx.iter().map(|&i| &lw.linears[i].w).collect();
        let choice = search_scales(sample.as_ref(), &group_ws, group);
        drop(sample);
        if choice.plain_loss > 0.0 {
            tally.loss_ratios.push(choice.loss / choice.plain_loss);
        }
        if choice.ratio.is_some() {
            tally.scaled += 1;
            fold(lw, stage, &choice.scales, x);
            let (targets, before) = fold_targets(stage);
            for &i in targets {
                col_scale[i] = Some(choice.scales.clone());
            }
            if let Some(p) = before {
                row_scale[p] = Some(choice.scales.clone());
            }
        } else {
            tally.unscaled += 1;
        }
    }
    let mut out: Vec<WorkTensor> = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let module = format!("{prefix}{}", spec.name);
        let stage_x = match i {
            0..=2 => &inputs[0],
            3 => &inputs[1],
            4 | 5 => &inputs[2],
            _ => &inputs[3],
        };
        let w = &lw.linears[i].w;
        let (rows, cols) = (w.nrows(), w.ncols());
        // q and k feed the attention scores through RoPE: AutoAWQ leaves their range whole.
        let clip = (i > 1).then(|| {
            let sample = sample_rows(stage_x.as_ref(), CLIP_TOKENS);
            search_clip(sample.as_ref(), w, group)
        });
        if let Some(c) = &clip {
            tally.clip_searched += c.len() as u64;
            tally.clipped += c.iter().filter(|b| b.is_finite()).count() as u64;
        }
        let flat = row_major(w);
        let q = quantize(&flat, rows, cols, group, clip.as_deref());
        let deq = q.dequantize();
        let stage = match i {
            0..=2 => 0,
            3 => 1,
            4 | 5 => 2,
            _ => 3,
        };
        tally.output_ratios.push((
            module.clone(),
            folded_ratio(
                &gate_x[stage],
                w,
                &deq,
                col_scale[i].as_deref(),
                row_scale[i].as_deref(),
                group,
            ),
        ));
        let (mut err, mut norm) = (0f64, 0f64);
        for (a, b) in flat.iter().zip(&deq) {
            err += f64::from(a - b).powi(2);
            norm += f64::from(*a).powi(2);
        }
        tally
            .errors
            .push((module.clone(), (err / norm.max(f64::MIN_POSITIVE)).sqrt()));
        lw.linears[i].w = Mat::from_fn(rows, cols, |r, c| deq[r * cols + c]);
        let (qweight, qzeros, scales) = pack_gemm(&q);
        let groups = cols / group;
        out.push((
            format!("{module}.qweight"),
            qweight.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::I32,
            vec![cols, rows / PACK],
        ));
        out.push((
            format!("{module}.qzeros"),
            qzeros.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::I32,
            vec![groups, rows / PACK],
        ));
        out.push((
            format!("{module}.scales"),
            scales.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::F16,
            vec![groups, rows],
        ));
        if let Some(b) = &lw.linears[i].b {
            let name = format!("{module}.bias");
            let dtype = store.entry(&name)?.dtype;
            out.push((name.clone(), encode(&name, b, dtype)?, dtype, vec![b.len()]));
        }
    }
    for (name, v) in [
        ("input_layernorm.weight", &lw.input_norm),
        ("post_attention_layernorm.weight", &lw.post_norm),
    ] {
        let name = format!("{prefix}{name}");
        let dtype = store.entry(&name)?.dtype;
        out.push((name.clone(), encode(&name, v, dtype)?, dtype, vec![v.len()]));
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn quantize_and_save(
    job: &AwqJob<'_>,
    cfg: &ModelConfig,
    store: &TensorStore,
    samples: &[Vec<u32>],
    group: usize,
    work: &Path,
    digest: &str,
    events: &dyn EventSink,
) -> Result<(u64, AwqQuality)> {
    if work.exists() {
        std::fs::remove_dir_all(work).map_err(|e| QuantError::io(work, e))?;
    }
    std::fs::create_dir_all(work).map_err(|e| QuantError::io(work, e))?;
    let longest = samples.iter().map(Vec::len).max().unwrap_or(1);
    let rope = Rope::new(cfg, longest);
    let mut hidden = samples
        .iter()
        .map(|s| embed(store, cfg, None, s))
        .collect::<Result<Vec<_>>>()?;
    let mut tally = Tally::default();
    let mut work_files = Vec::new();
    for layer in 0..cfg.num_layers {
        let mut lw = load_layer(store, cfg, layer, None)?;
        store.release_pages();
        let inputs = stage_inputs(cfg, &lw, &mut hidden, &rope);
        let tensors = quantize_layer(cfg, store, layer, &mut lw, inputs, group, &mut tally)?;
        let path = work.join(format!("layer-{layer:05}.safetensors"));
        write_work_file(&path, &tensors)?;
        work_files.push(path);
        progress(
            events,
            "awq",
            90.0 * (layer + 1) as f64 / cfg.num_layers.max(1) as f64,
            format!("layer {}/{}", layer + 1, cfg.num_layers),
        );
    }
    drop(hidden);
    let quality = quality_of(group, job.max_output_error_ratio, &tally);
    if quality.failed() {
        // As GPTQ's gate: nothing is written; the caller removes the work directory.
        events.emit(
            flexinfer_contract::events::QUANTIZATION_QUALITY,
            serde_json::to_value(&quality)
                .ok()
                .and_then(|v| v.as_object().cloned())
                .unwrap_or_default(),
        );
        return Err(QuantError::AwqGateFailed(Box::new(quality)));
    }
    let work_store = TensorStore::open_files(work_files)?;
    let replaced: std::collections::HashSet<String> = work_store
        .entries
        .keys()
        .filter_map(|n| {
            n.strip_suffix(".qweight")
                .map(|m| format!("{m}.weight"))
                .or_else(|| Some(n.clone()))
        })
        .collect();
    let tensors = merged_tensors(store, &work_store, |name| replaced.contains(name))?;
    let mut config_json = cfg.raw.clone();
    config_json["quantization_config"] = quantization_config(group);
    let bytes = Rewritten {
        phase: "awq",
        out_dir: job.out_dir,
        max_shard_bytes: job.max_shard_bytes,
        source: store,
        rewritten: &work_store,
        config_json,
        source_dir: job.model_dir,
        script_version: job.script_version,
        config_digest: digest,
    }
    .write(tensors, &quality, events)?;
    Ok((bytes, quality))
}

fn quality_of(group: usize, max_output_error_ratio: f64, t: &Tally) -> AwqQuality {
    let verdict = evaluate(&t.output_ratios, max_output_error_ratio);
    let worst = t
        .errors
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .cloned()
        .unwrap_or_default();
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let errors: Vec<f64> = t.errors.iter().map(|e| e.1).collect();
    AwqQuality {
        format: flexinfer_contract::env::FORMAT_AWQ.into(),
        bits: BITS,
        group_size: group as u32,
        quantized_modules: t.errors.len() as u64,
        scaled_groups: t.scaled,
        unscaled_groups: t.unscaled,
        mean_loss_ratio: mean(&t.loss_ratios),
        clipped_groups: t.clipped,
        searched_clip_groups: t.clip_searched,
        max_relative_error: worst.1,
        worst_module: worst.0,
        mean_relative_error: mean(&errors),
        output_error_ratio: verdict.mean_ratio,
        worst_output_error_ratio: verdict.worst_ratio,
        worst_output_error_module: verdict.worst_module,
        max_output_error_ratio,
        gate: verdict.gate.into(),
    }
}
