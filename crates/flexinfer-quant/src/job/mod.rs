//! The whole quantize job: validate, calibrate layer by layer (true sequential), GPTQ each module group,
//! cache each finished layer, write the checkpoint, apply the RTN fallback gate.
//!
//! The steps, in the order [`run`] takes them: [`digest`] (what the run is made from), a finished
//! artifact of the same digest is reused ([`checkpoint`]), [`calibrate`] (module plan, samples,
//! embeddings, each group's Hessian), [`layer`] (each layer quantized or read back from the [`cache`],
//! [`experts`] for sparse MoE layers), [`checkpoint`] (gate and save through the [`writer`]).

pub mod cache;
pub(crate) mod calibrate;
mod checkpoint;
pub(crate) mod digest;
mod experts;
mod layer;
pub mod policy;
pub mod rewrite;
mod solve;
pub mod writer;

pub use digest::config_digest;

use crate::device::Device;
use crate::error::{DatasetError, Result, SpecError};
use crate::events::{fields, EventSink};
use crate::exclusion::Exclusion;
use crate::job::cache::LayerCache;
use crate::job::writer::verify_save_complete;
use crate::memory::release_free_memory;
use crate::model::calib::CalibSettings;
use crate::model::llama::Rope;
use crate::model::tensors::TensorStore;
use crate::model::ModelConfig;
use crate::params::{GateParams, GptqParams, RecoveryParams};
use flexinfer_contract::events as names;
use flexinfer_contract::files::QualitySummary;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Samples whose activations are stacked into one Hessian update when `N_PARALLEL_CALIB_SAMPLES` is unset: one,
/// so only one sample's activations of a stage are alive at a time (a sample's tokens already give the
/// Hessian product a deep enough inner dimension).
pub const DEFAULT_CALIB_BATCH: usize = 1;

/// Default of [`QuantizeJob::expert_min_token_percent`].
pub const DEFAULT_EXPERT_MIN_TOKEN_PERCENT: f64 = 0.5;

/// The container the solve's output is written in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Container {
    /// The `gptq` checkpoint (`qweight`, `qzeros`, `scales`, `g_idx`; `quant_method: gptq`).
    #[default]
    Gptq,
    /// compressed-tensors' `pack-quantized` layout ([`crate::ct`]; `quant_method: compressed-tensors`).
    CompressedTensors,
}

/// Everything a quantize run needs.
#[derive(Clone, Debug)]
pub struct QuantizeJob {
    /// What the checkpoint is written as (the solve is the same).
    pub container: Container,
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
    #[cfg(feature = "test-hooks")]
    pub abort_after_layer: Option<usize>,
    /// Run the calibration forward on the device where it has one (`GPTQ_DEVICE_FORWARD`, default on).
    pub device_forward: bool,
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
            container: Container::Gptq,
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
            #[cfg(feature = "test-hooks")]
            abort_after_layer: None,
            device_forward: true,
        }
    }

    pub fn subdir_name(&self) -> String {
        let gdn = if self.dynamic_exclusion.as_deref().map(str::trim) == Some("gdn") {
            "-gdn"
        } else {
            ""
        };
        let kind = match self.container {
            Container::Gptq => "gptq",
            Container::CompressedTensors => "ct",
        };
        format!(
            "{kind}-w{}-g{}{gdn}",
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

    /// Where the compressed-tensors conversion writes its per-layer work files (beside `out_dir`).
    fn ct_work_dir(&self) -> PathBuf {
        let mut p = self.staging_dir().into_os_string();
        p.push(".ct-work");
        PathBuf::from(p)
    }

    /// Whether module `name` stays in full precision (`hybrid`: see [`ModelConfig::hybrid`]).
    pub fn excluded(&self, name: &str, hybrid: bool) -> Result<bool> {
        Ok(Exclusion::parse(self.dynamic_exclusion.as_deref())?.excludes(name, hybrid))
    }
}

/// Seconds of a run's phases (the `quantize_phases` event): where the time went.
#[derive(Default)]
pub(crate) struct PhaseTimes {
    /// Reading each layer's weights from the source (bf16/f16 → f32).
    pub(crate) load: std::time::Duration,
    /// The calibration forward: each stage's activations and moving them through the quantized layer.
    pub(crate) forward: std::time::Duration,
    /// Adding the activations to the Hessians.
    pub(crate) hessian: std::time::Duration,
    /// Each input group's solve (preparation, factorisation, sweeps, results back on the host).
    pub(crate) solve: std::time::Duration,
    /// Packing and writing each finished layer to the cache.
    pub(crate) cache: std::time::Duration,
}

impl PhaseTimes {
    fn add(
        slot: &std::sync::Mutex<PhaseTimes>,
        f: impl FnOnce(&mut PhaseTimes) -> &mut std::time::Duration,
        since: Instant,
    ) {
        if let Ok(mut t) = slot.lock() {
            *f(&mut t) += since.elapsed();
        }
    }
}

/// What every step of a run reads; fixed for the whole run.
struct Run<'a> {
    /// Where the time went (reported at the end).
    times: std::sync::Mutex<PhaseTimes>,
    job: &'a QuantizeJob,
    device: &'a dyn Device,
    events: &'a dyn EventSink,
    cfg: &'a ModelConfig,
    store: &'a TensorStore,
    exclusion: &'a Exclusion,
    started: Instant,
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

/// The job's own settings: the GPTQ parameters, the recovery ladder and the calibration sizes.
fn validate(job: &QuantizeJob) -> Result<()> {
    job.params.validate()?;
    if job.container == Container::CompressedTensors {
        crate::ct::check_settings(
            job.params.bits,
            job.params.desc_act,
            job.params.static_groups,
            flexinfer_contract::env::BITS,
            flexinfer_contract::env::DESC_ACT,
        )?;
    }
    job.recovery.validate()?;
    if job.calib.max_samples == 0 || job.calib.max_seq_len < 2 {
        return Err(SpecError::Samples {
            max_samples: job.calib.max_samples,
            max_seq_len: job.calib.max_seq_len,
        }
        .into());
    }
    Ok(())
}

/// A previous run's finished save in `final_dir`, when it was made from exactly this configuration; one
/// made from another is reported (`quantization_reuse_rejected`) and not reused.
fn reusable_save(
    job: &QuantizeJob,
    final_dir: &Path,
    config_hash: &str,
    events: &dyn EventSink,
) -> Option<flexinfer_contract::files::SaveComplete> {
    let sc = verify_save_complete(final_dir, job.verify_save_sha256)?;
    if sc.config_digest.as_deref() == Some(config_hash) {
        return Some(sc);
    }
    events.emit(
        names::QUANTIZATION_REUSE_REJECTED,
        fields([
            ("outputDir", json!(final_dir.display().to_string())),
            ("found", json!(sc.config_digest)),
            ("configDigest", json!(config_hash)),
        ]),
    );
    None
}

/// One `model_policy` event for each model policy that applies to this model and calibration.
fn emit_policies(
    job: &QuantizeJob,
    cfg: &ModelConfig,
    exclusion: &Exclusion,
    events: &dyn EventSink,
) {
    for p in policy::applied(&policy::Facts {
        cfg,
        calib: &job.calib,
        exclusion,
    }) {
        events.emit(
            names::MODEL_POLICY,
            fields([
                ("policy", json!(p.policy)),
                ("message", json!(p.message)),
                ("advice", json!(p.advice)),
            ]),
        );
    }
}

/// Runs the job. Bad input is reported before anything is written to `out_dir`.
pub fn run(job: &QuantizeJob, device: &dyn Device, events: &dyn EventSink) -> Result<Outcome> {
    let started = Instant::now();
    validate(job)?;
    let mut progress = Progress { events, last: 0.0 };
    let final_dir = job.output_dir();

    let exclusion = Exclusion::parse(job.dynamic_exclusion.as_deref())?;
    let cfg = ModelConfig::load(&job.model_dir)?;
    let store = TensorStore::open_dir(&job.model_dir)?;
    if !job.dataset.is_file() {
        return Err(DatasetError::NotAFile {
            what: crate::model::dataset::CALIBRATION.what,
            path: job.dataset.clone(),
        }
        .into());
    }
    let (calib_fp, config_hash) = digest::run_digests(job, &store)?;

    if let Some(sc) = reusable_save(job, &final_dir, &config_hash, events) {
        // Only disk space is at stake: a cache that cannot be removed does not fail the reuse.
        if let Err(e) = cache::remove_finished(&job.model_dir, &config_hash, events) {
            tracing::warn!(error = %e, "could not remove the layer cache a finished run left");
        }
        return checkpoint::reuse_artifact(
            job,
            &final_dir,
            &sc,
            &store,
            &config_hash,
            started,
            &mut progress,
        );
    }

    emit_policies(job, &cfg, &exclusion, events);
    let plan = calibrate::plan_modules(job, &cfg, &store, &exclusion)?;
    let samples = calibrate::load_calibration(job, device, &mut progress)?;
    let n_tokens: usize = samples.iter().map(Vec::len).sum();
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
    let hidden = calibrate::embed_samples(&store, &cfg, &samples)?;
    let forward = calibrate::device_forward(job, device, &cfg, n_tokens, max_len, events);
    let mut acts = layer::Activations::new(hidden, forward);
    let run = Run {
        times: std::sync::Mutex::new(PhaseTimes::default()),
        job,
        device,
        events,
        cfg: &cfg,
        store: &store,
        exclusion: &exclusion,
        started,
    };
    let layer_run = solve::LayerRun {
        run: &run,
        rope: &rope,
        batch: job
            .n_parallel_calib_samples
            .unwrap_or(DEFAULT_CALIB_BATCH)
            .max(1),
        n_tokens,
    };
    let totals = layer::quantize_layers(&layer_run, &mut cache, &mut progress, &mut acts)?;
    if let Some(t) = acts.times() {
        // The device forward timed its own work (the stage code's clock also covers its waits).
        if let Ok(mut p) = run.times.lock() {
            p.forward = t.forward;
            p.hessian = t.hessian;
        }
    }

    let forward_on_device = acts.times().is_some();
    let acts_copy_seconds = acts.times().map_or(0.0, |t| t.copies.as_secs_f64());
    let batches = acts.times().map(|t| (t.batch_tokens, t.smaller_batches));
    // The activations are not needed for the save.
    drop(acts);
    release_free_memory();
    let save = checkpoint::SaveInput {
        run: &run,
        plan: &plan,
        config_hash: &config_hash,
    };
    let quantized = started.elapsed();
    let outcome = checkpoint::save(&save, cache, &totals, &mut progress)?;
    let save_seconds = started.elapsed() - quantized;
    if let Ok(t) = run.times.lock() {
        let copies = acts_copy_seconds;
        events.emit(
            names::QUANTIZE_PHASES,
            fields([
                ("device", json!(device.describe())),
                (
                    "forwardOn",
                    json!(if forward_on_device { "device" } else { "cpu" }),
                ),
                ("loadSeconds", json!(t.load.as_secs_f64())),
                ("forwardSeconds", json!(t.forward.as_secs_f64())),
                ("hessianSeconds", json!(t.hessian.as_secs_f64())),
                ("solveSeconds", json!(t.solve.as_secs_f64())),
                ("cacheSeconds", json!(t.cache.as_secs_f64())),
                ("copySeconds", json!(copies)),
                ("saveSeconds", json!(save_seconds.as_secs_f64())),
                ("forwardBatchTokens", json!(batches.map(|b| b.0))),
                ("forwardSmallerBatches", json!(batches.map(|b| b.1))),
                ("wholeRunSeconds", json!(started.elapsed().as_secs_f64())),
            ]),
        );
    }
    Ok(outcome)
}
