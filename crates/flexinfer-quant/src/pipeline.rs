//! The whole quantize job: validate, calibrate layer by layer (true sequential), GPTQ each module group,
//! cache each finished layer, write the checkpoint, apply the RTN fallback gate.

use crate::cache::LayerCache;
use crate::calib::{load_samples, CalibSettings};
use crate::error::{QuantError, Result};
use crate::events::{fields, EventSink};
use crate::fsutil::{read_json, sha256_file, sha256_hex};
use crate::gptq::{
    dequantize_weight, gptq_quantize_in, rtn_quantize, Method, QuantizedLinear, Workspace,
};
use crate::hessian::{prepare_factor, FactorOutcome};
use crate::linalg::LinalgBackend;
use crate::llama::{
    attention, embed, layer_forward, linear, mlp_activation, rms_norm, Rope, Stage, STAGES,
};
use crate::model::{
    linear_shape, load_layer, load_linear, GptqReadConfig, ModelConfig, INPUT_GROUPS, LINEARS,
};
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

    /// Whether module `name` stays in full precision.
    pub fn excluded(&self, name: &str) -> bool {
        match self.dynamic_exclusion.as_deref().map(str::trim) {
            None | Some("") | Some("none") => false,
            Some("gdn") => name.contains("linear_attn"),
            Some(list) => list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .any(|s| name.contains(s)),
        }
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
    sha256_hex(
        json!({
            "params": job.params, "recovery": job.recovery, "calibration": calibration_fingerprint,
            "calibBatch": job.n_parallel_calib_samples.unwrap_or(DEFAULT_CALIB_BATCH).max(1),
            "model": input, "exclusion": job.dynamic_exclusion,
            "script_version": job.script_version, "engine": env!("CARGO_PKG_VERSION"),
        })
        .to_string()
        .as_bytes(),
    )
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

fn quantize_config_json(job: &QuantizeJob, excluded: &[String]) -> Value {
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

pub fn run(
    job: &QuantizeJob,
    backend: &dyn LinalgBackend,
    events: &dyn EventSink,
) -> Result<Outcome> {
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
    for layer in 0..cfg.num_layers {
        for (i, m) in LINEARS.iter().enumerate() {
            let name = format!("{}{m}", cfg.layer_prefix(layer));
            let (rows, cols) = linear_shape(&cfg, i);
            let e = store.entry(&format!("{name}.weight"))?;
            if e.shape != [rows, cols] {
                return Err(QuantError::Input(format!(
                    "{name}.weight has shape {:?}, config.json implies [{rows}, {cols}]",
                    e.shape
                )));
            }
            if job.excluded(&name) {
                excluded.push(name);
            } else {
                job.params.check_shape(&name, rows, cols)?;
            }
        }
    }
    let samples = load_samples(&job.model_dir, &job.dataset, &job.calib)?;
    let n_tokens: usize = samples.iter().map(Vec::len).sum();
    progress.emit(
        "calibration",
        0.0,
        format!(
            "{} samples, {n_tokens} tokens, backend {}",
            samples.len(),
            backend.name()
        ),
        fields([
            ("samples", json!(samples.len())),
            ("tokens", json!(n_tokens)),
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
            for (i, m) in LINEARS.iter().enumerate() {
                let name = format!("{prefix}{m}");
                if cstore.contains(&format!("{name}.qweight")) {
                    lw.linears[i].w =
                        load_linear(&cstore, &name, linear_shape(&cfg, i), Some(gq))?.w;
                }
            }
            let entry = &cache.manifest.layers[layer];
            gptq_count += entry.gptq_modules;
            rtn_count += entry.rtn_modules;
            progress.emit(
                "quantize",
                pct(layer as f64 + 1.0),
                format!("layer {}/{layers} loaded from cache", layer + 1),
                layer_extra(layer + 1),
            );
        } else {
            let mut results: Vec<Option<QuantizedLinear>> = vec![None; 7];
            // True sequential: every stage sees the modules before it already quantized. The attention output
            // feeds two stages (o_proj's Hessian, then the residual for gate/up); it is computed again for the
            // second rather than kept, so the calibration activations are resident once, not twice.
            for (stage, group) in STAGES.iter().zip(INPUT_GROUPS.iter()) {
                let active: Vec<usize> = group
                    .iter()
                    .copied()
                    .filter(|&i| !job.excluded(&format!("{prefix}{}", LINEARS[i])))
                    .collect();
                let cols = lw.linears[group[0]].w.ncols();
                let mut h = Mat::<f32>::zeros(
                    if active.is_empty() { 0 } else { cols },
                    if active.is_empty() { 0 } else { cols },
                );
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
                                let o = linear(att.as_ref(), &lw.linears[3]);
                                drop(att);
                                add_in_place(x, &o);
                                drop(o);
                                rms_norm(x.as_ref(), &lw.post_norm, cfg.rms_norm_eps)
                            }
                            Stage::Down => mlp_activation(&cfg, &lw, x.as_ref()),
                        };
                        if !active.is_empty() {
                            acts.push(a);
                        }
                    }
                    if active.is_empty() {
                        continue;
                    }
                    if let [one] = acts.as_slice() {
                        backend.accumulate_hessian(h.as_mut(), one.as_ref(), 2.0 / n_tokens as f32);
                        continue;
                    }
                    let rows: usize = acts.iter().map(|a| a.nrows()).sum();
                    let mut stacked = Mat::<f32>::zeros(rows, cols);
                    let mut r0 = 0;
                    for a in acts.drain(..) {
                        stacked.subrows_mut(r0, a.nrows()).copy_from(&a);
                        r0 += a.nrows();
                    }
                    backend.accumulate_hessian(h.as_mut(), stacked.as_ref(), 2.0 / n_tokens as f32);
                }
                release_free_memory();
                if *stage == Stage::GateUp {
                    hidden_is_x1 = true;
                }
                if active.is_empty() {
                    continue;
                }
                // The per-sample stage inputs are gone: hand their memory back before the factorisation.
                release_free_memory();
                backend.finish_hessian(h.as_mut());
                let names: Vec<String> = active
                    .iter()
                    .map(|&i| format!("{prefix}{}", LINEARS[i]))
                    .collect();
                let outcome = prepare_factor(
                    backend,
                    h,
                    job.params.desc_act,
                    &job.recovery,
                    &names.join(","),
                    events,
                );
                // The Hessian was consumed by the factorisation: hand its memory back before the sweep.
                release_free_memory();
                // The solver's buffers, shared by the modules of this input group (q/k/v, gate/up) and
                // dropped with it, so they do not stay resident through the next stages' forward passes.
                let mut workspace = Workspace::default();
                for &i in &active {
                    let q = match &outcome {
                        FactorOutcome::Factor(f) => gptq_quantize_in(
                            &mut workspace,
                            backend,
                            &lw.linears[i].w,
                            f,
                            &job.params,
                        ),
                        FactorOutcome::Exhausted => rtn_quantize(&lw.linears[i].w, &job.params),
                    };
                    lw.linears[i].w = dequantize_weight(&q);
                    results[i] = Some(q);
                }
                release_free_memory();
                progress.emit(
                    "quantize",
                    pct(layer as f64 + (*stage as usize + 1) as f64 / 5.0),
                    format!("layer {}/{layers}: {}", layer + 1, names.join(", ")),
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
                    tensors.extend(module_tensors(&format!("{prefix}{}", LINEARS[i]), q));
                }
            }
            cache.write_layer(layer, &tensors, g, r, events)?;
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
                let act = mlp_activation(&cfg, &lw, x.as_ref());
                let dn = linear(act.as_ref(), &lw.linears[6]);
                drop(act);
                add_in_place(x, &dn);
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
    for (name, e) in &store.entries {
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
    let quality_json =
        serde_json::to_value(&quality).map_err(|e| QuantError::Numeric(e.to_string()))?;
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
    let qc = quantize_config_json(job, &excluded);
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
