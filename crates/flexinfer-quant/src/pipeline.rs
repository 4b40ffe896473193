//! The whole quantize job: validate, calibrate layer by layer (true sequential), GPTQ each module group,
//! cache each finished layer, write the checkpoint, apply the RTN fallback gate.

use crate::cache::{LayerCache, LayerStats};
use crate::calib::{load_samples_counted, CalibSettings};
use crate::device::{solve_with_fallback, Device, Session, SolveSpec};
use crate::error::{QuantError, Result};
use crate::events::{fields, EventSink};
use crate::exclusion::Exclusion;
use crate::fsutil::{read_json, sha256_file, sha256_hex};
use crate::gptq::{dequantize_weight, rtn_quantize, Method, QuantizedLinear};
use crate::llama::{
    attention, attention_delta, embed, layer_forward, mlp_activation, mlp_output, rms_norm,
    scale_layer_output, Rope, Stage, STAGES,
};
use crate::model::{
    check_fused_experts, check_source_module, fused_expert_names, layer_modules, load_layer,
    load_linear, source_module_bytes, GptqReadConfig, LayerWeights, ModelConfig, ModuleSpec,
    MoeConfig, INPUT_GROUPS,
};
use crate::moe::{gated, gather_rows};
use crate::pack::{pack, ZeroFormat};
use crate::params::{GateParams, GptqParams, RecoveryParams};
use crate::tensors::TensorStore;
use crate::writer::{verify_save_complete, write_checkpoint, Extras, OutTensor};
use faer::Mat;
use flexinfer_contract::events as names;
use flexinfer_contract::files::{self, QualitySummary};
use safetensors::Dtype;

use serde_json::{json, Value};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Samples whose activations are stacked into one Hessian update when `N_PARALLEL_CALIB_SAMPLES` is unset: one,
/// so only one sample's activations of a stage are alive at a time (a sample's tokens already give the
/// Hessian product a deep enough inner dimension).
pub const DEFAULT_CALIB_BATCH: usize = 1;

/// Default of [`QuantizeJob::expert_min_token_percent`].
pub const DEFAULT_EXPERT_MIN_TOKEN_PERCENT: f64 = 0.5;

/// Everything a quantize run needs.
#[derive(Clone, Debug)]
pub struct QuantizeJob {
    pub model_dir: PathBuf,
    /// The artifact directory itself (the worker contract's `OUT_DIR`). It is written complete or not at
    /// all: the checkpoint is staged beside it (`.<name>.partial`) and renamed into place.
    pub out_dir: PathBuf,
    pub dataset: PathBuf,
    pub params: GptqParams,
    pub recovery: RecoveryParams,
    pub gate: GateParams,
    pub calib: CalibSettings,
    /// Samples whose activations are stacked per Hessian update (default [`DEFAULT_CALIB_BATCH`]).
    pub n_parallel_calib_samples: Option<usize>,
    /// `gdn`, or a comma list of module-name substrings kept in full precision.
    pub dynamic_exclusion: Option<String>,
    /// MoE: an expert routed fewer than this percentage of the calibration tokens takes RTN (counted in the
    /// gate and in the sidecar's `expertCoverage`). Default [`DEFAULT_EXPERT_MIN_TOKEN_PERCENT`].
    pub expert_min_token_percent: f64,
    pub resume_layers: bool,
    /// Re-hash every shard listed in `.save-complete` before short-circuiting (else sizes only).
    pub verify_save_sha256: bool,
    pub max_shard_bytes: u64,
    pub script_version: String,
    /// Test hook: stop (as if killed) right after layer k is cached.
    pub abort_after_layer: Option<usize>,
}

/// The RTN-fallback gate over a run's module counts: the quality sidecar
/// (`.quantization-quality.json`) and the termination message's `quality`.
pub fn evaluate_quality(gptq: u64, rtn: u64, gate: &GateParams) -> QualitySummary {
    let total = gptq + rtn;
    let pct = if total == 0 {
        0.0
    } else {
        100.0 * rtn as f64 / total as f64
    };
    let verdict = if total < gate.min_modules {
        "insufficient-sample"
    } else if pct > gate.max_rtn_fallback_percent {
        "failed"
    } else {
        "passed"
    };
    QualitySummary {
        gptq_modules: gptq,
        rtn_fallback_modules: rtn,
        rtn_fallback_percent: pct,
        max_rtn_fallback_percent: gate.max_rtn_fallback_percent,
        minimum_modules: gate.min_modules,
        gate: verdict.into(),
    }
}

/// What a finished run reports (the worker's termination message).
#[derive(Clone, Debug)]
pub struct Outcome {
    pub output_dir: PathBuf,
    pub original_size_bytes: u64,
    pub compressed_size_bytes: u64,
    pub seconds: f64,
    /// `None` for an older cached artifact without a sidecar.
    pub quality: Option<QualitySummary>,
    pub cached: bool,
    /// [`config_digest`] of the run (also in `.save-complete`).
    pub config_digest: String,
}

/// Default maximum bytes per output shard (also the worker's `--max-shard-bytes` default).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 4 << 30;

impl QuantizeJob {
    /// A job with the engine's defaults for everything but the paths and the calibration size: default GPTQ,
    /// recovery and gate parameters, no exclusion, layer resume on, sha256 check of a `.save-complete` before reuse,
    /// [`DEFAULT_MAX_SHARD_BYTES`] shards. Change other fields with struct-update syntax.
    pub fn new(
        model_dir: &Path,
        out_dir: &Path,
        dataset: &Path,
        calib: CalibSettings,
        script_version: &str,
    ) -> Self {
        QuantizeJob {
            model_dir: model_dir.to_path_buf(),
            out_dir: out_dir.to_path_buf(),
            dataset: dataset.to_path_buf(),
            params: GptqParams::default(),
            recovery: RecoveryParams::default(),
            gate: GateParams::default(),
            calib,
            n_parallel_calib_samples: None,
            dynamic_exclusion: None,
            expert_min_token_percent: DEFAULT_EXPERT_MIN_TOKEN_PERCENT,
            resume_layers: true,
            verify_save_sha256: true,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            script_version: script_version.to_string(),
            abort_after_layer: None,
        }
    }

    pub fn subdir_name(&self) -> String {
        let gdn = if self.dynamic_exclusion.as_deref().map(str::trim) == Some("gdn") {
            "-gdn"
        } else {
            ""
        };
        format!(
            "gptq-w{}-g{}{gdn}",
            self.params.bits, self.params.group_size
        )
    }

    /// Where the checkpoint lands: `out_dir` itself.
    pub fn output_dir(&self) -> PathBuf {
        self.out_dir.clone()
    }

    /// The staging directory beside `out_dir`, renamed onto it when the save is complete.
    fn staging_dir(&self) -> PathBuf {
        let name = self
            .out_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.subdir_name());
        self.out_dir.with_file_name(format!(".{name}.partial"))
    }

    /// Whether module `name` stays in full precision (`hybrid`: see [`ModelConfig::hybrid`]).
    pub fn excluded(&self, name: &str, hybrid: bool) -> Result<bool> {
        Ok(Exclusion::parse(self.dynamic_exclusion.as_deref())?.excludes(name, hybrid))
    }
}

struct Progress<'a> {
    events: &'a dyn EventSink,
    last: f64,
}

impl Progress<'_> {
    fn emit(
        &mut self,
        phase: &str,
        percent: f64,
        detail: String,
        extra: serde_json::Map<String, Value>,
    ) {
        let p = percent.clamp(self.last, 100.0);
        self.last = p;
        let mut f = fields([
            ("phase", json!(phase)),
            ("percent", json!((p * 10.0).round() / 10.0)),
            ("detail", json!(detail)),
        ]);
        f.extend(extra);
        self.events.emit(names::PROGRESS, f);
    }
}

fn model_fingerprint(model_dir: &Path, store: &TensorStore) -> Result<String> {
    let mut s = sha256_file(&model_dir.join("config.json"))?;
    for f in &store.files {
        let len = std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
        s.push_str(&format!(
            "|{}:{len}",
            f.file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default()
        ));
    }
    Ok(sha256_hex(s.as_bytes()))
}

/// What the input weights are: the download's integrity record (per-file sha256 of the source), the
/// abliteration manifest or a `.save-complete` when present, plus `config.json`; otherwise the names and
/// sizes of the weight files.
fn input_digest(model_dir: &Path, store: &TensorStore) -> Result<String> {
    for marker in [
        files::SOURCE_INTEGRITY,
        files::ABLITERATION_MANIFEST,
        files::SAVE_COMPLETE,
    ] {
        let p = model_dir.join(marker);
        if p.is_file() {
            let config = sha256_file(&model_dir.join("config.json"))?;
            return Ok(sha256_hex(
                format!("{marker}:{}|config:{config}", sha256_file(&p)?).as_bytes(),
            ));
        }
    }
    model_fingerprint(model_dir, store)
}

/// sha256 over everything that determines the output bytes (docs/dev/architecture.md, "Artifact
/// lifecycle"): the input, the GPTQ, recovery and calibration settings, the exclusions, the engine
/// version. The gate's thresholds are not part of it: they decide whether an artifact is promoted, not
/// its bytes.
pub fn config_digest(job: &QuantizeJob, calibration_fingerprint: &str, input: &str) -> String {
    let mut v = json!({
        "params": job.params, "recovery": job.recovery, "calibration": calibration_fingerprint,
        "calibBatch": job.n_parallel_calib_samples.unwrap_or(DEFAULT_CALIB_BATCH).max(1),
        "model": input, "exclusion": job.dynamic_exclusion,
        "script_version": job.script_version, "engine": env!("CARGO_PKG_VERSION"),
    });
    // Only a non-default threshold enters the digest, so artifacts made before the setting existed stay valid.
    if job.expert_min_token_percent != DEFAULT_EXPERT_MIN_TOKEN_PERCENT {
        v["expertMinTokenPercent"] = json!(job.expert_min_token_percent);
    }
    sha256_hex(v.to_string().as_bytes())
}

/// The artifact at `final_dir` was made from this configuration: report it without recomputing.
fn reuse_artifact(
    job: &QuantizeJob,
    final_dir: &Path,
    sc: &files::SaveComplete,
    store: &TensorStore,
    config_hash: &str,
    started: Instant,
    progress: &mut Progress<'_>,
) -> Result<Outcome> {
    let events = progress.events;
    let quality = read_json(&final_dir.join(files::QUANTIZATION_QUALITY))
        .ok()
        .and_then(|v| serde_json::from_value::<QualitySummary>(v).ok());
    match &quality {
        Some(q) => events.emit(
            names::QUANTIZATION_QUALITY,
            serde_json::to_value(q)
                .ok()
                .and_then(|v| v.as_object().cloned())
                .unwrap_or_default(),
        ),
        None => events.emit(
            names::QUANTIZATION_QUALITY_UNAVAILABLE,
            fields([("outputDir", json!(final_dir.display().to_string()))]),
        ),
    }
    events.emit(
        names::QUANTIZATION_CACHED,
        fields([
            ("outputDir", json!(final_dir.display().to_string())),
            ("configDigest", json!(config_hash)),
            ("sha256Verified", json!(job.verify_save_sha256)),
        ]),
    );
    progress.emit(
        "complete",
        100.0,
        "cached artifact verified".into(),
        Default::default(),
    );
    Ok(Outcome {
        output_dir: final_dir.to_path_buf(),
        original_size_bytes: store.total_bytes(),
        compressed_size_bytes: sc.shards.iter().map(|s| s.size_bytes).sum(),
        seconds: started.elapsed().as_secs_f64(),
        quality,
        cached: true,
        config_digest: config_hash.to_string(),
    })
}

/// `quantization_config`: the GPTQ settings plus exactly what was quantized. `quantized[l]` are the
/// block-relative names of the modules quantized in layer `l` (true-sequential order), `excluded` the full names
/// of candidate linears kept in full precision. Every kept module gets a negative `dynamic` entry (GPTQModel /
/// vLLM / transformers skip it); when every layer quantizes the same modules, `modules_in_block_to_quantize`
/// lists them too (the form optimum / transformers read).
fn quantize_config_json(
    job: &QuantizeJob,
    quantized: &[Vec<String>],
    excluded: &[String],
) -> Value {
    let p = &job.params;
    let mut qc = json!({
        "quant_method": "gptq",
        "bits": p.bits,
        "group_size": p.group_size,
        "desc_act": p.desc_act,
        "sym": p.sym,
        "lm_head": false,
        "checkpoint_format": ZeroFormat::for_sym(p.sym).checkpoint_format(),
        "damp_percent": job.recovery.damp_percent,
        "true_sequential": true,
        "static_groups": p.static_groups,
        "pack_dtype": "int32",
        "meta": {
            "quantizer": [format!("flexinfer-quant:{}", env!("CARGO_PKG_VERSION"))],
            "damp_auto_increment": job.recovery.damp_auto_increment,
        },
    });
    if !excluded.is_empty() {
        let dynamic: serde_json::Map<String, Value> = excluded
            .iter()
            .map(|m| (format!("-:^{}$", m.replace('.', "\\.")), json!({})))
            .collect();
        qc["dynamic"] = Value::Object(dynamic);
        if let Some(first) = quantized.first() {
            if !first.is_empty() && quantized.iter().all(|l| l == first) {
                qc["modules_in_block_to_quantize"] = json!([first]);
            }
        }
    }
    qc
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

/// Runs the job. Bad input is reported before anything is written to `out_dir`.
/// Hands memory the allocator holds after frees back to the system. The calibration forward allocates and
/// frees many activation-sized buffers from several threads; glibc keeps the freed space in per-thread
/// arenas, so without this the resident set only ever grows (docs/benchmarks.md). Called between stages,
/// where little is live.
/// `x += y` (same shape), elementwise: the same sums as `x + y`, without a new matrix.
fn add_in_place(x: &mut Mat<f32>, y: &Mat<f32>) {
    for j in 0..x.ncols().min(y.ncols()) {
        let yc = y.col_as_slice(j);
        for (a, b) in x.col_as_slice_mut(j).iter_mut().zip(yc) {
            *a += *b;
        }
    }
}

pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the kernel; it does not touch live allocations.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Factorises one input group's Hessian and quantizes its active modules (GPTQ, or RTN when the recovery
/// loop is exhausted) in one device session (`session` holds the accumulated Hessian); the quantized weights
/// replace the f32 ones in `lw` for the stages after it.
#[allow(clippy::too_many_arguments)]
fn solve_group(
    job: &QuantizeJob,
    device: &dyn Device,
    events: &dyn EventSink,
    mut session: Box<dyn Session + '_>,
    lw: &mut LayerWeights,
    active: &[usize],
    names: &[String],
    results: &mut [Option<QuantizedLinear>],
) -> Result<()> {
    let missing =
        |i: usize| QuantError::Numeric(format!("module index {i} of {}", names.join(",")));
    let module = names.join(",");
    let spec = SolveSpec {
        params: &job.params,
        recovery: &job.recovery,
        module: &module,
    };
    let quantized = {
        let weights = active
            .iter()
            .map(|&i| lw.module(i).map(|l| &l.w).ok_or_else(|| missing(i)))
            .collect::<Result<Vec<_>>>()?;
        solve_with_fallback(
            &device.describe(),
            session.as_mut(),
            &weights,
            &spec,
            events,
        )?
    };
    drop(session);
    for (&i, q) in active.iter().zip(quantized) {
        lw.module_mut(i).ok_or_else(|| missing(i))?.w = dequantize_weight(&q);
        results[i] = Some(q);
    }
    lw.sync_tied();
    release_free_memory();
    Ok(())
}

/// What the expert loop of one MoE layer needs.
struct ExpertCtx<'a> {
    job: &'a QuantizeJob,
    device: &'a dyn Device,
    events: &'a dyn EventSink,
    cfg: &'a ModelConfig,
    moe: &'a MoeConfig,
    prefix: &'a str,
    specs: &'a [ModuleSpec],
    exclusion: &'a Exclusion,
    n_tokens: usize,
}

/// Expert GPTQ of one MoE layer. `hidden` holds each sample's residual after attention (already quantized
/// attention). The router (full precision) picks each token's experts; each expert's gate/up Hessian comes from
/// the post-attention-norm rows of the tokens routed to it, its down Hessian from its SwiGLU activation of those
/// rows (with its gate/up already quantized). Experts are done one after another, so one expert's Hessians are
/// alive at a time whatever the expert count. An expert whose tokens are fewer than
/// `expert_min_token_percent` of the calibration tokens takes RTN. Returns the routed tokens per expert and the
/// number of modules that took RTN for low coverage.
fn quantize_experts(
    ctx: &ExpertCtx<'_>,
    hidden: &[Mat<f32>],
    lw: &mut LayerWeights,
    results: &mut [Option<QuantizedLinear>],
) -> Result<(Vec<u64>, u64)> {
    let (cfg, m) = (ctx.cfg, ctx.moe);
    let eps = cfg.rms_norm_eps;
    let moe_w = lw
        .moe
        .as_ref()
        .ok_or_else(|| QuantError::Numeric(format!("{}: MoE weights not loaded", ctx.prefix)))?;
    // Per sample, per expert: the routed token rows (the shared expert, if any, sees every token).
    let mut routed: Vec<Vec<Vec<(usize, f32)>>> = Vec::with_capacity(hidden.len());
    for x in hidden {
        routed.push(
            moe_w
                .route_residual(x.as_ref(), &lw.post_norm, eps, &m.spec)
                .per_expert(m.num_experts),
        );
    }
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
            ctx.n_tokens as u64
        } else {
            tokens[e]
        };
        let [ig, iu, id] = [4 + 3 * e, 5 + 3 * e, 6 + 3 * e];
        let is_active = |i: usize| {
            !ctx.specs[i].tied
                && !ctx
                    .exclusion
                    .excludes(&format!("{}{}", ctx.prefix, ctx.specs[i].name), cfg.hybrid)
        };
        let gate_up: Vec<usize> = [ig, iu].into_iter().filter(|&i| is_active(i)).collect();
        let down: Vec<usize> = [id].into_iter().filter(|&i| is_active(i)).collect();
        if gate_up.is_empty() && down.is_empty() {
            continue;
        }
        let percent = 100.0 * n_e as f64 / ctx.n_tokens.max(1) as f64;
        if n_e == 0 || percent < ctx.job.expert_min_token_percent {
            for &i in gate_up.iter().chain(&down) {
                let w = &lw
                    .module(i)
                    .ok_or_else(|| QuantError::Numeric(format!("module index {i}")))?
                    .w;
                let q = rtn_quantize(w, &ctx.job.params);
                if let Some(l) = lw.module_mut(i) {
                    l.w = dequantize_weight(&q);
                }
                results[i] = Some(q);
                low_rtn += 1;
            }
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
        let alpha = 2.0 / n_e as f32;
        let name = |i: usize| format!("{}{}", ctx.prefix, ctx.specs[i].name);
        if !gate_up.is_empty() {
            let cols = cfg.hidden_size;
            let mut h = ctx.device.open(cols)?;
            for s in 0..hidden.len() {
                let a = rows_of(s);
                if a.nrows() > 0 {
                    h.accumulate(a.as_ref(), alpha)?;
                }
            }
            let names: Vec<String> = gate_up.iter().map(|&i| name(i)).collect();
            solve_group(
                ctx.job, ctx.device, ctx.events, h, lw, &gate_up, &names, results,
            )?;
        }
        if !down.is_empty() {
            let (g, u) = match (lw.module(ig), lw.module(iu)) {
                (Some(g), Some(u)) => (g, u),
                _ => return Err(QuantError::Numeric(format!("{}: expert {e}", ctx.prefix))),
            };
            let cols = g.w.nrows();
            let mut h = ctx.device.open(cols)?;
            for s in 0..hidden.len() {
                let a = rows_of(s);
                if a.nrows() > 0 {
                    let act = gated(g, u, a.as_ref(), m.spec.act);
                    h.accumulate(act.as_ref(), alpha)?;
                }
            }
            let names: Vec<String> = down.iter().map(|&i| name(i)).collect();
            solve_group(
                ctx.job, ctx.device, ctx.events, h, lw, &down, &names, results,
            )?;
        }
    }
    Ok((tokens, low_rtn))
}

/// The expert-coverage report of a MoE run (quality sidecar `expertCoverage`).
struct ExpertCoverage {
    threshold_percent: f64,
    n_tokens: usize,
    layers: Vec<Value>,
    experts: u64,
    low_experts: u64,
    low_modules: u64,
    min_percent: f64,
}

impl ExpertCoverage {
    fn new(threshold_percent: f64, n_tokens: usize) -> Self {
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

    fn add_layer(&mut self, layer: usize, tokens: &[u64], low_modules: u64) {
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

    fn report(&self) -> Option<Value> {
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

pub fn run(job: &QuantizeJob, device: &dyn Device, events: &dyn EventSink) -> Result<Outcome> {
    let started = Instant::now();
    job.params.validate()?;
    job.recovery.validate()?;
    if job.calib.max_samples == 0 || job.calib.max_seq_len < 2 {
        return Err(QuantError::Input(
            "MAX_SAMPLES must be ≥ 1 and MAX_SEQ_LEN ≥ 2".into(),
        ));
    }
    let mut progress = Progress { events, last: 0.0 };
    let final_dir = job.output_dir();

    let exclusion = Exclusion::parse(job.dynamic_exclusion.as_deref())?;
    let cfg = ModelConfig::load(&job.model_dir)?;
    let store = TensorStore::open_dir(&job.model_dir)?;
    if !job.dataset.is_file() {
        return Err(QuantError::Input(format!(
            "calibration dataset {} does not exist or is not a regular file",
            job.dataset.display()
        )));
    }
    let dataset_sha = sha256_file(&job.dataset)?;
    let calib_fp = sha256_hex(
        format!(
            "{dataset_sha}|{}|{}",
            job.calib.max_samples, job.calib.max_seq_len
        )
        .as_bytes(),
    );
    let config_hash = config_digest(job, &calib_fp, &input_digest(&job.model_dir, &store)?);

    // A previous run finished the save: reuse it only when it was made from exactly this configuration.
    if let Some(sc) = verify_save_complete(&final_dir, job.verify_save_sha256) {
        if sc.config_digest.as_deref() == Some(config_hash.as_str()) {
            return reuse_artifact(
                job,
                &final_dir,
                &sc,
                &store,
                &config_hash,
                started,
                &mut progress,
            );
        }
        events.emit(
            names::QUANTIZATION_REUSE_REJECTED,
            fields([
                ("outputDir", json!(final_dir.display().to_string())),
                ("found", json!(sc.config_digest)),
                ("configDigest", json!(config_hash)),
            ]),
        );
    }

    let mut excluded = Vec::new();
    // Block-relative names of the modules quantized in each layer (the written config lists them).
    let mut quantized_names: Vec<Vec<String>> = Vec::with_capacity(cfg.num_layers);
    for layer in 0..cfg.num_layers {
        let prefix = cfg.layer_prefix(layer);
        let mut names = Vec::new();
        check_fused_experts(&store, &cfg, layer)?;
        for spec in layer_modules(&cfg, layer) {
            if spec.tied {
                continue;
            }
            let name = format!("{prefix}{}", spec.name);
            let (rows, cols) = spec.shape;
            check_source_module(&store, &cfg, layer, &spec)?;
            if exclusion.excludes(&name, cfg.hybrid) {
                excluded.push(name);
            } else {
                job.params.check_shape(&name, rows, cols)?;
                names.push(spec.name);
            }
        }
        if let Some(m) = cfg.sparse_layer(layer) {
            let router = format!("{prefix}{}.weight", m.spec.style.router_name());
            let e = store.entry(&router)?;
            if e.shape != [m.num_experts, cfg.hidden_size] {
                return Err(QuantError::Input(format!(
                    "{router} has shape {:?}, config.json implies [{}, {}]",
                    e.shape, m.num_experts, cfg.hidden_size
                )));
            }
        }
        quantized_names.push(names);
    }
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
    let mut cache = LayerCache::open(
        &job.model_dir,
        &config_hash,
        &calib_fp,
        &job.script_version,
        job.resume_layers,
        events,
    )?;

    let max_len = samples.iter().map(Vec::len).max().unwrap_or(0);
    let rope = Rope::new(&cfg, max_len);
    // Embedding rows are read one token at a time from the mapping (no f32 copy of the whole table).
    let mut hidden: Vec<Mat<f32>> = samples
        .iter()
        .map(|s| embed(&store, &cfg, None, s))
        .collect::<Result<_>>()?;
    store.release_pages();

    let batch = job
        .n_parallel_calib_samples
        .unwrap_or(DEFAULT_CALIB_BATCH)
        .max(1);
    let layers = cfg.num_layers;
    let pct = |done: f64| 95.0 * done / layers.max(1) as f64;
    let (mut gptq_count, mut rtn_count) = (0u64, 0u64);
    let mut coverage = ExpertCoverage::new(job.expert_min_token_percent, n_tokens);

    for layer in 0..layers {
        let prefix = cfg.layer_prefix(layer);
        let layer_extra = |done: usize| {
            fields([
                ("layer", json!(layer)),
                ("layers", json!(layers)),
                ("unit", json!("layers")),
                ("done", json!(done)),
                ("total", json!(layers)),
            ])
        };
        let mut lw = load_layer(&store, &cfg, layer, None)?;
        store.release_pages();
        release_free_memory();
        // True once `hidden` holds each sample's residual after attention (a freshly quantized layer).
        let mut hidden_is_x1 = false;
        if layer < cache.completed_layers() {
            // Resume: the cached packed modules replace the source weights, read with the consumer's rules.
            let path = cache
                .layer_path(layer)
                .ok_or_else(|| QuantError::Numeric("cache index".into()))?;
            let cstore = TensorStore::open_files(vec![path])?;
            let gq = GptqReadConfig {
                bits: job.params.bits,
                format: ZeroFormat::for_sym(job.params.sym),
            };
            for (i, spec) in layer_modules(&cfg, layer).iter().enumerate() {
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
            gptq_count += entry.gptq_modules;
            rtn_count += entry.rtn_modules;
            coverage.add_layer(layer, &entry.expert_tokens, entry.low_coverage_rtn_modules);
            progress.emit(
                "quantize",
                pct(layer as f64 + 1.0),
                format!("layer {}/{layers} loaded from cache", layer + 1),
                layer_extra(layer + 1),
            );
        } else {
            let specs = layer_modules(&cfg, layer);
            let mut results: Vec<Option<QuantizedLinear>> = vec![None; specs.len()];
            let sparse = cfg.sparse_layer(layer).cloned();
            let mut low_rtn = 0u64;
            let mut expert_tokens = Vec::new();
            // True sequential: every stage sees the modules before it already quantized. The attention output
            // feeds two stages (o_proj's Hessian, then the residual for gate/up); it is computed again for the
            // second rather than kept, so the calibration activations are resident once, not twice.
            for (stage, group) in STAGES.iter().zip(INPUT_GROUPS.iter()) {
                if sparse.is_some() && *stage == Stage::Down {
                    break;
                }
                let moe_gate_up = sparse.is_some() && *stage == Stage::GateUp;
                let group: &[usize] = if moe_gate_up { &[] } else { group };
                let active: Vec<usize> = group
                    .iter()
                    .copied()
                    .filter(|&i| {
                        !specs[i].tied
                            && !exclusion
                                .excludes(&format!("{prefix}{}", specs[i].name), cfg.hybrid)
                    })
                    .collect();
                let cols = group.first().map_or(0, |&g| lw.linears[g].w.ncols());
                // The group's device session (its Hessian); none when every module of the group is excluded.
                let mut h = if active.is_empty() {
                    None
                } else {
                    Some(device.open(cols)?)
                };
                // Up to `batch` samples' activations are stacked into one product (bounded memory, better GEMM).
                for chunk in hidden.chunks_mut(batch) {
                    let mut acts: Vec<Mat<f32>> = Vec::with_capacity(chunk.len());
                    for x in chunk.iter_mut() {
                        let a = match stage {
                            Stage::Qkv => rms_norm(x.as_ref(), &lw.input_norm, cfg.rms_norm_eps),
                            Stage::O if active.is_empty() => continue,
                            Stage::O => {
                                let hn = rms_norm(x.as_ref(), &lw.input_norm, cfg.rms_norm_eps);
                                attention(&cfg, &lw, hn.as_ref(), &rope)
                            }
                            Stage::GateUp => {
                                let hn = rms_norm(x.as_ref(), &lw.input_norm, cfg.rms_norm_eps);
                                let att = attention(&cfg, &lw, hn.as_ref(), &rope);
                                drop(hn);
                                // The residual after attention replaces the layer input in place (the input
                                // is not needed any more; no second activation-sized buffer).
                                let o = attention_delta(&cfg, &lw, att.as_ref());
                                drop(att);
                                add_in_place(x, &o);
                                drop(o);
                                if active.is_empty() {
                                    continue;
                                }
                                rms_norm(x.as_ref(), &lw.post_norm, cfg.rms_norm_eps)
                            }
                            Stage::Down => mlp_activation(&cfg, &lw, x.as_ref()),
                        };
                        if !active.is_empty() {
                            acts.push(a);
                        }
                    }
                    let Some(h) = h.as_mut() else {
                        continue;
                    };
                    if let [one] = acts.as_slice() {
                        h.accumulate(one.as_ref(), 2.0 / n_tokens as f32)?;
                        continue;
                    }
                    let rows: usize = acts.iter().map(|a| a.nrows()).sum();
                    let mut stacked = Mat::<f32>::zeros(rows, cols);
                    let mut r0 = 0;
                    for a in acts.drain(..) {
                        stacked.subrows_mut(r0, a.nrows()).copy_from(&a);
                        r0 += a.nrows();
                    }
                    h.accumulate(stacked.as_ref(), 2.0 / n_tokens as f32)?;
                }
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
                solve_group(
                    job,
                    device,
                    events,
                    h,
                    &mut lw,
                    &active,
                    &names,
                    &mut results,
                )?;
                progress.emit(
                    "quantize",
                    pct(layer as f64 + (*stage as usize + 1) as f64 / 5.0),
                    format!("layer {}/{layers}: {}", layer + 1, names.join(", ")),
                    layer_extra(layer),
                );
            }
            if let Some(m) = &sparse {
                let ctx = ExpertCtx {
                    job,
                    device,
                    events,
                    cfg: &cfg,
                    moe: m,
                    prefix: &prefix,
                    specs: &specs,
                    exclusion: &exclusion,
                    n_tokens,
                };
                let (tokens, low) = quantize_experts(&ctx, &hidden, &mut lw, &mut results)?;
                expert_tokens = tokens;
                low_rtn = low;
                progress.emit(
                    "quantize",
                    pct(layer as f64 + 0.9),
                    format!("layer {}/{layers}: {} experts", layer + 1, m.num_experts),
                    layer_extra(layer),
                );
            }
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
            coverage.add_layer(layer, &expert_tokens, low_rtn);
            cache.write_layer(
                layer,
                &tensors,
                LayerStats {
                    gptq_modules: g,
                    rtn_modules: r,
                    expert_tokens,
                    low_coverage_rtn_modules: low_rtn,
                },
                events,
            )?;
            drop(tensors);
            release_free_memory();
            tracing::info!(
                layer,
                gptq = g,
                rtn = r,
                elapsed_s = started.elapsed().as_secs_f64(),
                "layer quantized"
            );
            gptq_count += g;
            rtn_count += r;
            progress.emit(
                "quantize",
                pct(layer as f64 + 1.0),
                format!("layer {}/{layers} done", layer + 1),
                layer_extra(layer + 1),
            );
        }
        if hidden_is_x1 {
            for x in hidden.iter_mut() {
                let dn = mlp_output(&cfg, &lw, x.as_ref());
                add_in_place(x, &dn);
                scale_layer_output(&lw, x);
            }
        } else {
            for x in hidden.iter_mut() {
                *x = layer_forward(&cfg, &lw, x.as_ref(), &rope, None);
            }
        }
        release_free_memory();
        if job.abort_after_layer == Some(layer) {
            return Err(QuantError::TestAbort(layer));
        }
    }

    // The activations are not needed for the save.
    drop(hidden);
    release_free_memory();
    // Save.
    cache.write_checkpoint("saving", None)?;
    let quality = evaluate_quality(gptq_count, rtn_count, &job.gate);
    let layer_stores: Vec<TensorStore> = (0..layers)
        .map(|l| {
            let p = cache
                .layer_path(l)
                .ok_or_else(|| QuantError::Numeric(format!("layer {l} missing from cache")))?;
            TensorStore::open_files(vec![p])
        })
        .collect::<Result<_>>()?;
    let mut tensors: Vec<OutTensor<'_>> = Vec::new();
    // Gemma 4's fused expert tensors are written per expert: packed where quantized, the source rows (same
    // dtype) where an expert module was kept in full precision.
    let mut fused: std::collections::BTreeSet<String> = Default::default();
    for (layer, ls) in layer_stores.iter().enumerate() {
        let Some(names) = fused_expert_names(&store, &cfg, layer) else {
            continue;
        };
        fused.extend(names);
        let prefix = cfg.layer_prefix(layer);
        for spec in layer_modules(&cfg, layer) {
            if !spec.name.starts_with("experts.")
                || ls.contains(&format!("{prefix}{}.qweight", spec.name))
            {
                continue;
            }
            if let Some((name, dtype, shape, data)) =
                source_module_bytes(&store, &cfg, layer, &spec)?
            {
                tensors.push(OutTensor {
                    name,
                    dtype,
                    shape,
                    data: Cow::Borrowed(data),
                });
            }
        }
    }
    for (name, e) in &store.entries {
        if fused.contains(name) {
            continue;
        }
        if let Some(stem) = name.strip_suffix(".weight") {
            let quantized = layer_stores
                .iter()
                .any(|ls| ls.contains(&format!("{stem}.qweight")));
            if quantized {
                continue;
            }
        }
        tensors.push(OutTensor {
            name: name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            data: Cow::Borrowed(store.raw(name)?),
        });
    }
    for ls in &layer_stores {
        for (name, e) in &ls.entries {
            tensors.push(OutTensor {
                name: name.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
                data: Cow::Borrowed(ls.raw(name)?),
            });
        }
    }
    let mut quality_json =
        serde_json::to_value(&quality).map_err(|e| QuantError::Numeric(e.to_string()))?;
    if let (Some(report), Some(obj)) = (coverage.report(), quality_json.as_object_mut()) {
        obj.insert("expertCoverage".into(), report);
    }
    if quality.failed() {
        // The gate runs before anything is written: a rejected run leaves the artifact at `out_dir` (and
        // its status) untouched, writes no `.save-complete`, and removes its staging directory. The layer
        // cache stays, so a run with a relaxed gate reuses the computed layers.
        drop(layer_stores);
        let staging = job.staging_dir();
        if staging.exists() {
            std::fs::remove_dir_all(&staging).map_err(|e| QuantError::io(&staging, e))?;
        }
        events.emit(
            names::QUANTIZATION_QUALITY,
            quality_json.as_object().cloned().unwrap_or_default(),
        );
        return Err(QuantError::GateFailed(quality));
    }
    let qc = quantize_config_json(job, &quantized_names, &excluded);
    let mut config_json = cfg.raw.clone();

    config_json["quantization_config"] = qc.clone();
    let extras = Extras {
        config_json,
        quantize_config: qc,
        quality: quality_json.clone(),
        source_dir: &job.model_dir,
        script_version: &job.script_version,
        config_digest: &config_hash,
    };
    let records = write_checkpoint(
        &job.staging_dir(),
        &final_dir,
        tensors,
        job.max_shard_bytes,
        &extras,
        &|| {
            // Pages already hashed or written are read again at most once, from the page cache.
            store.release_pages();
            layer_stores.iter().for_each(TensorStore::release_pages);
        },
        |done, total| {
            store.release_pages();
            layer_stores.iter().for_each(TensorStore::release_pages);
            progress.emit(
                "save",
                95.0 + 5.0 * done as f64 / total as f64,
                format!("shard {done}/{total}"),
                fields([
                    ("unit", json!("shards")),
                    ("done", json!(done)),
                    ("total", json!(total)),
                ]),
            );
        },
    )?;
    drop(layer_stores);
    cache.remove()?;
    tracing::info!(output = %final_dir.display(), shards = records.len(), gate = %quality.gate, "checkpoint written");
    events.emit(
        names::QUANTIZATION_QUALITY,
        quality_json.as_object().cloned().unwrap_or_default(),
    );
    Ok(Outcome {
        output_dir: final_dir,
        original_size_bytes: store.total_bytes(),
        compressed_size_bytes: records.iter().map(|r| r.size_bytes).sum(),
        seconds: started.elapsed().as_secs_f64(),
        quality: Some(quality),
        cached: false,
        config_digest: config_hash,
    })
}
