//! `flexinfer-worker quantize`: the GPTQ phase (docs/dev/architecture.md, "The controller–worker contract"; docs/dev/gptq.md). Reads the env contract (every setting is also a
//! flag; flags win), runs the `flexinfer-quant` engine on the device `GPTQ_DEVICE` selects (today always the
//! CPU backend: see docs/dev/gptq-device.md), streams JSON-line events, writes the
//! termination message, and exits 0 ok / 1 failure / 2 bad input / 3 quality gate / 4 version mismatch.

use std::path::PathBuf;

use flexinfer_contract::{
    self as contract, env, events, JobPhase, ProgressEvent, TerminationSuccess,
};
use flexinfer_quant::awq::{write_awq_artifact, AwqJob};
use flexinfer_quant::calib::CalibSettings;
use flexinfer_quant::device::{select_device, MemoryBudget, Selection, SystemPlatform, VendorLibs};
use flexinfer_quant::events::EventSink;
use flexinfer_quant::fp8::{
    write_fp8_artifact, ActivationScheme, Fp8Activations, Fp8Job, ScaleStrategy,
};
use flexinfer_quant::gguf::blocks::feedback::FEEDBACK_BY_DEFAULT;
use flexinfer_quant::gguf::importance::{collect_importance, Importance, ImportanceJob};
use flexinfer_quant::gguf::{write_gguf_artifact, FileType, GgufArtifactJob};
use flexinfer_quant::job::{self as quantize_job, Container, QuantizeJob};
use flexinfer_quant::params::{
    ClipSearch, FloorMode, GateParams, GptqParams, RecoveryParams, RefineScales,
};
use flexinfer_quant::QuantError;

use crate::common::{self, Events, ExitKind, QuantizeError, WorkerError};
use crate::download::parse_bool_arg;

#[cfg(test)]
mod tests;

/// [`Written`] from an FP8, AWQ or GGUF outcome (the engine's three outcome types share these fields).
macro_rules! written {
    ($o:expr) => {
        Written {
            output_dir: &$o.output_dir,
            original_size_bytes: $o.original_size_bytes,
            compressed_size_bytes: $o.compressed_size_bytes,
            seconds: $o.seconds,
            config_digest: $o.config_digest.clone(),
            cached: $o.cached,
        }
    };
}

/// Test hook: abort the process (as a SIGKILL would) right after layer k is cached (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
pub const TEST_ABORT_AFTER_LAYER_ENV: &str = "FLEXINFER_TEST_ABORT_AFTER_LAYER";

/// Settings of the quantize phase. Env names are the worker contract's.
#[derive(clap::Args, Debug, Clone)]
pub struct QuantizeArgs {
    /// Contract version the controller expects (mismatch: exit 4).
    #[arg(long, env = env::SCRIPT_VERSION)]
    pub script_version: Option<String>,
    /// Source model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = env::MODEL_DIR)]
    pub model_dir: PathBuf,
    /// The artifact directory (e.g. `/cache/<modelPath>/gptq-w4-g128`); staged beside it, renamed into place.
    #[arg(long, env = env::OUT_DIR)]
    pub out_dir: PathBuf,
    /// GPTQ: 2, 3, 4 (the default) or 8; FP8: 8 only.
    #[arg(long, env = env::BITS)]
    pub bits: Option<u32>,
    /// -1 = one group per output row.
    #[arg(long, env = env::GROUP_SIZE, default_value_t = 128, allow_hyphen_values = true)]
    pub group_size: i32,
    #[arg(long, env = env::SYM, value_parser = parse_bool_arg, action = clap::ArgAction::Set, default_value = "true")]
    pub sym: bool,
    #[arg(long, env = env::DESC_ACT, value_parser = parse_bool_arg, action = clap::ArgAction::Set, default_value = "false")]
    pub desc_act: bool,
    /// Group-aware column order inside the groups (GPTQModel's `act_group_aware`; ignored with desc_act).
    #[arg(long, env = env::ACT_GROUP_AWARE, value_parser = parse_bool_arg, action = clap::ArgAction::Set, default_value = "true")]
    pub act_group_aware: bool,
    /// Clipping search of the group scales: `auto` (the measured default: off), `on`, `off`.
    #[arg(long, env = env::CLIP_SEARCH, default_value = "auto")]
    pub clip_search: String,
    /// Scale refinement rounds (least-squares refit of the group scales, then a sweep with them): `auto` (the
    /// measured default: on at 2–3 bits), `on`, `off`, or a number of rounds.
    #[arg(long, env = env::REFINE_SCALES, default_value = "auto")]
    pub refine_scales: String,
    /// Compute all group parameters before the sweep (keeps g_idx monotonic with desc_act).
    #[arg(long, value_parser = parse_bool_arg, action = clap::ArgAction::Set, default_value = "false")]
    pub static_groups: bool,
    /// `auto`, `gdn`, `none`, or a comma list of module-name substrings kept in full precision
    /// (`flexinfer_quant::exclusion`).
    #[arg(long, env = env::DYNAMIC_EXCLUSION)]
    pub dynamic_exclusion: Option<String>,
    /// MoE: experts routed fewer than this percentage of the calibration tokens take RTN (counted in the gate
    /// and in the quality sidecar's `expertCoverage`).
    #[arg(long, default_value_t = flexinfer_quant::job::DEFAULT_EXPERT_MIN_TOKEN_PERCENT)]
    pub expert_min_token_percent: f64,
    #[arg(long, env = env::MAX_SEQ_LEN, default_value_t = 2048)]
    pub max_seq_len: usize,
    #[arg(long, env = env::MAX_SAMPLES, default_value_t = 128)]
    pub max_samples: usize,
    /// Local JSONL / JSONL.zst / text file, or a dataset id already fetched under the cache. GPTQ: required;
    /// GGUF: optional, when set the importance matrix of the block search comes from a calibration pass over it.
    #[arg(long, env = env::DATASET, default_value = "")]
    pub dataset: String,
    #[arg(long, env = env::N_PARALLEL_CALIB_SAMPLES)]
    pub n_parallel_calib_samples: Option<usize>,
    /// Informational on the CPU backend (recorded in the start event).
    #[arg(long, env = env::MAX_MEMORY_GB)]
    pub max_memory_gb: Option<f64>,
    /// Where the GPTQ solve runs: `auto` (HIP, else CUDA, else CPU), `cpu`, `hip`, `cuda`. An explicit GPU that
    /// cannot be used is bad configuration (exit 2).
    #[arg(long, env = env::GPTQ_DEVICE, default_value = "auto")]
    pub gptq_device: String,
    /// `auto` (default): a GPU session uses the vendor's BLAS and solver libraries (cuBLAS + cuSOLVER,
    /// rocBLAS + rocSOLVER) where they are installed; `off`: the engine's own kernels for everything.
    #[arg(long, env = env::GPTQ_VENDOR_LIBS, default_value = "auto")]
    pub gptq_vendor_libs: VendorLibs,
    /// `auto` (default): with a GPU solve, the calibration forward runs on the GPU too (every layer the
    /// device forward supports); `off`: the forward stays on the CPU.
    #[arg(long, env = env::GPTQ_DEVICE_FORWARD, default_value = "auto")]
    pub gptq_device_forward: VendorLibs,
    /// The card's memory in MiB, for the device memory budget (gfx906 reports its own unreliably).
    #[arg(long, env = env::GPU_VRAM_MB)]
    pub gpu_vram_mb: Option<u64>,
    /// The share of the card's memory an input group's solve may use (0 < f ≤ 1; default 0.80); a group
    /// that does not fit is solved on the CPU with a `gptq_device_fallback` event.
    #[arg(long, env = env::GPU_MEMORY_FRACTION, value_parser = parse_fraction)]
    pub gpu_memory_fraction: Option<f64>,
    #[arg(long, env = env::GPTQ_DAMP_PERCENT_OVERRIDE, default_value_t = 0.05)]
    pub damp_percent: f32,
    #[arg(long, env = env::GPTQ_DAMP_AUTO_INCREMENT_OVERRIDE, default_value_t = 0.1)]
    pub damp_auto_increment: f32,
    /// `mean` or `abs_max`.
    #[arg(long, env = env::GPTQ_HESSIAN_DIAG_FLOOR_MODE, default_value = "mean")]
    pub diag_floor_mode: String,
    #[arg(long, env = env::GPTQ_HESSIAN_DIAG_FLOOR_SCALE, default_value_t = 0.01)]
    pub diag_floor_scale: f32,
    #[arg(long, env = env::GPTQ_HESSIAN_FLOOR_MULTIPLIER, default_value_t = 10.0)]
    pub floor_multiplier: f32,
    #[arg(long, env = env::GPTQ_HESSIAN_MAX_FLOOR_ATTEMPTS, default_value_t = 6)]
    pub max_floor_attempts: u32,
    #[arg(long, env = env::GPTQ_RESUME_LAYERS, value_parser = parse_bool_arg, action = clap::ArgAction::Set, default_value = "true")]
    pub resume_layers: bool,
    /// Re-hash the shards of an existing `.save-complete` before reusing it (`false`: sizes only).
    #[arg(long, env = env::GPTQ_VERIFY_SAVE_SHA256, value_parser = parse_bool_arg, action = clap::ArgAction::Set, default_value = "true")]
    pub verify_save_sha256: bool,
    #[arg(long, env = env::GPTQ_MAX_RTN_FALLBACK_PERCENT, default_value_t = 10.0)]
    pub max_rtn_fallback_percent: f64,
    #[arg(long, env = env::GPTQ_MIN_MODULES_FOR_FALLBACK_GATE, default_value_t = 100)]
    pub min_modules_for_fallback_gate: u64,
    /// AWQ's quality gate: the largest mean ratio of the artifact's output error to plain rounding's.
    #[arg(long, env = env::AWQ_MAX_OUTPUT_ERROR_RATIO, default_value_t = flexinfer_quant::awq::gate::DEFAULT_MAX_OUTPUT_ERROR_RATIO)]
    pub max_output_error_ratio: f64,
    /// Maximum bytes per output shard.
    #[arg(long, default_value_t = flexinfer_quant::job::DEFAULT_MAX_SHARD_BYTES)]
    pub max_shard_bytes: u64,
    #[cfg(feature = "test-hooks")]
    #[arg(long, env = TEST_ABORT_AFTER_LAYER_ENV, hide = true)]
    pub test_abort_after_layer: Option<usize>,
    /// `GPTQ` (the default), `GGUF`: one llama.cpp file in `OUT_DIR` (Llama / Mistral / Qwen2 only; the GPTQ
    /// settings do not apply; `DATASET`, `MAX_SAMPLES`, `MAX_SEQ_LEN` feed the optional importance pass), or
    /// `FP8`: E4M3 weights in compressed-tensors' `float-quantized` layout (`FP8_SCALE`, `FP8_ACTIVATIONS` and
    /// `DYNAMIC_EXCLUSION` apply; with `FP8_ACTIVATIONS=static` also `DATASET`, `MAX_SAMPLES`, `MAX_SEQ_LEN`; the
    /// other GPTQ settings do not), or `COMPRESSED_TENSORS`: the GPTQ solve
    /// written in compressed-tensors' `pack-quantized` layout (every GPTQ setting applies; `BITS` 4 or 8), or
    /// `AWQ`: the activation-aware scale and clipping search, 4-bit groups in AutoAWQ's GEMM layout (`BITS` 4,
    /// `GROUP_SIZE` 32/64/128, `DATASET`, `MAX_SAMPLES`, `MAX_SEQ_LEN` apply; the other GPTQ settings do not).
    #[arg(long, env = env::FORMAT, default_value = FORMAT_GPTQ)]
    pub format: String,
    /// Where the scales of an FP8 run live: `channel` (one per output row) or `tensor` (one per linear).
    #[arg(long, env = env::FP8_SCALE, default_value = "channel")]
    pub fp8_scale: String,
    /// The activation scales of an FP8 run: `dynamic` (per token at serving time, no calibration) or `static`
    /// (one calibrated per-tensor `input_scale` per linear from a forward over `DATASET`).
    #[arg(long, env = env::FP8_ACTIVATIONS, default_value = "dynamic")]
    pub fp8_activations: String,
    /// The llama.cpp preset of a GGUF run: F16, BF16, Q8_0, Q6_K, Q5_K_M, Q5_K_S, Q4_K_M, Q4_K_S, Q4_0,
    /// Q3_K_M, Q2_K, IQ4_XS.
    #[arg(long, env = env::GGUF_TYPE, default_value = "Q4_K_M")]
    pub gguf_type: String,
    /// GPTQ error feedback on the K-quant grids of a GGUF run with a `DATASET`: `auto` (on for the types
    /// where it measured better), `1` (on) or `0` (off).
    #[arg(long, env = env::GGUF_GPTQ, default_value = "auto")]
    pub gguf_gptq: String,
}

/// The `FORMAT` values.
pub use env::{FORMAT_AWQ, FORMAT_COMPRESSED_TENSORS, FORMAT_FP8, FORMAT_GGUF, FORMAT_GPTQ};

/// What `FORMAT` asks the quantize phase to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Gptq,
    Gguf,
    Fp8,
    /// The GPTQ run, written in compressed-tensors' `pack-quantized` layout.
    CompressedTensors,
    Awq,
}

impl QuantizeArgs {
    /// The GPTQ bit width: `BITS`, else 4.
    pub fn gptq_bits(&self) -> u32 {
        self.bits.unwrap_or(4)
    }
}

/// Engine events → the worker's JSON-line stream (progress stays monotonic there).
struct WorkerSink<'a>(&'a Events);

impl EventSink for WorkerSink<'_> {
    fn emit(&self, event: &str, fields: serde_json::Map<String, serde_json::Value>) {
        if event == events::PROGRESS {
            let value = serde_json::Value::Object(fields);
            if let Ok(mut p) = serde_json::from_value::<ProgressEvent>(value) {
                // The contract's `phase` is the pipeline phase; the engine's stage goes into the detail.
                if let Some(stage) = p.phase.take() {
                    p.detail = Some(format!("{stage}: {}", p.detail.unwrap_or_default()));
                }
                self.0.progress(p);
            }
        } else {
            self.0.emit(event, &serde_json::Value::Object(fields));
        }
    }
}

/// Runs the subcommand; returns the process exit code.
pub fn run(args: QuantizeArgs) -> i32 {
    let events = Events::new(JobPhase::Quantize.status_name());
    let result = run_inner(&args, &events);
    common::finish(&events, result)
}

/// Builds the engine job from the arguments (validation of values happens here and in the engine).
pub fn job_from_args(args: &QuantizeArgs) -> Result<QuantizeJob, WorkerError> {
    let floor_mode: FloorMode = args
        .diag_floor_mode
        .parse()
        .map_err(WorkerError::wrap::<QuantError>(ExitKind::BadInput))?;
    let clip_search: ClipSearch = args
        .clip_search
        .parse()
        .map_err(WorkerError::wrap::<QuantError>(ExitKind::BadInput))?;
    let refine_scales: RefineScales =
        args.refine_scales
            .parse()
            .map_err(WorkerError::wrap::<QuantError>(ExitKind::BadInput))?;
    let dataset = crate::datasets::resolve(&args.dataset, &args.model_dir, "calibration")?;
    let container = match output_format(&args.format)? {
        OutputFormat::CompressedTensors => Container::CompressedTensors,
        _ => Container::Gptq,
    };
    Ok(QuantizeJob {
        container,
        model_dir: args.model_dir.clone(),
        out_dir: args.out_dir.clone(),
        dataset,
        params: GptqParams {
            bits: args.gptq_bits(),
            group_size: args.group_size,
            sym: args.sym,
            desc_act: args.desc_act,
            static_groups: args.static_groups,
            block_size: 128,
            act_group_aware: args.act_group_aware && !args.desc_act,
            clip_search: clip_search.resolve(args.gptq_bits()),
            refine_rounds: refine_scales.resolve(args.gptq_bits()),
        },
        recovery: RecoveryParams {
            damp_percent: args.damp_percent,
            damp_auto_increment: args.damp_auto_increment,
            floor_mode,
            floor_scale: args.diag_floor_scale,
            floor_multiplier: args.floor_multiplier,
            max_floor_attempts: args.max_floor_attempts,
        },
        gate: GateParams {
            max_rtn_fallback_percent: args.max_rtn_fallback_percent,
            min_modules: args.min_modules_for_fallback_gate,
        },
        calib: CalibSettings {
            max_samples: args.max_samples,
            max_seq_len: args.max_seq_len,
        },
        n_parallel_calib_samples: args.n_parallel_calib_samples,
        device_forward: args.gptq_device_forward != VendorLibs::Off,
        dynamic_exclusion: args
            .dynamic_exclusion
            .clone()
            .filter(|s| !s.trim().is_empty()),
        expert_min_token_percent: args.expert_min_token_percent,
        resume_layers: args.resume_layers,
        verify_save_sha256: args.verify_save_sha256,
        max_shard_bytes: args.max_shard_bytes.max(1),
        script_version: contract::SCRIPT_VERSION.to_string(),
        #[cfg(feature = "test-hooks")]
        abort_after_layer: args.test_abort_after_layer,
    })
}

/// A `GPU_MEMORY_FRACTION` outside (0, 1].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0:?}: expected a number greater than 0 and at most 1")]
pub struct NotAFraction(String);

fn parse_fraction(s: &str) -> Result<f64, NotAFraction> {
    match s.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(NotAFraction(s.to_string())),
    }
}

fn run_inner(args: &QuantizeArgs, events: &Events) -> Result<TerminationSuccess, WorkerError> {
    common::check_version(args.script_version.as_deref())?;
    events.emit(
        events::START,
        &serde_json::json!({
            "phase": events.phase(), "modelDir": args.model_dir, "outDir": args.out_dir, "bits": args.bits,
            "groupSize": args.group_size, "sym": args.sym, "descAct": args.desc_act, "gptqDevice": args.gptq_device,
            "maxMemoryGB": args.max_memory_gb,
        }),
    );
    match output_format(&args.format)? {
        OutputFormat::Gguf => return run_gguf(args, events),
        OutputFormat::Fp8 => return run_fp8(args, events),
        OutputFormat::Awq => return run_awq(args, events),
        OutputFormat::Gptq | OutputFormat::CompressedTensors => {}
    }
    let job = job_from_args(args)?;
    let selection = select_device(
        Some(args.gptq_device.as_str()),
        &SystemPlatform {
            budget: MemoryBudget {
                vram_mb: args.gpu_vram_mb,
                fraction: args
                    .gpu_memory_fraction
                    .unwrap_or(MemoryBudget::default().fraction),
            },
            vendor_libs: args.gptq_vendor_libs,
        },
        &WorkerSink(events),
    )
    .map_err(WorkerError::wrap(ExitKind::BadInput))?;
    events.log(&format!(
        "GPTQ device: {} ({})",
        selection.device.describe(),
        selection.reason
    ));
    // One writer per output directory (a replaced Job's pod may still be running).
    let _lock = crate::generations::lock_output(&args.out_dir, events)?;
    let result = run_locked(args, &job, &selection, events);
    if result.is_ok() {
        collect_garbage(args, events);
    }
    result
}

fn run_locked(
    args: &QuantizeArgs,
    job: &QuantizeJob,
    selection: &Selection,
    events: &Events,
) -> Result<TerminationSuccess, WorkerError> {
    let sink = WorkerSink(events);
    let device = selection.device.as_ref();
    let outcome = match quantize_job::run(job, device, &sink) {
        Ok(o) => o,
        #[cfg(feature = "test-hooks")]
        Err(QuantError::TestAbort(layer)) => {
            events.log(&format!("test hook: aborting after layer {layer}"));
            std::process::abort();
        }
        Err(gate @ QuantError::GateFailed(_)) => {
            return Err(QuantizeError::GateFailed {
                gate,
                out_dir: args.out_dir.clone(),
            }
            .into())
        }
        // Exit 2 when the input is at fault, else 1 (WorkerError::kind).
        Err(e) => return Err(WorkerError::Quant(e)),
    };
    let quality = outcome.quality.clone();
    if let Some(q) = outcome.quality.as_ref().filter(|q| q.failed()) {
        // An artifact promoted by an older engine whose sidecar records a failed gate.
        return Err(QuantizeError::GateRecorded {
            gate: QuantError::GateFailed(q.clone()),
            dir: outcome.output_dir.clone(),
        }
        .into());
    }
    Ok(TerminationSuccess {
        kind: job.subdir_name(),
        original_size_bytes: Some(outcome.original_size_bytes),
        compressed_size_bytes: Some(outcome.compressed_size_bytes),
        quantization_time_seconds: Some((outcome.seconds * 10.0).round() / 10.0),
        output_dir: Some(outcome.output_dir.display().to_string()),
        quality,
        config_digest: Some(outcome.config_digest.clone()),
        gptq_device: Some(selection.report().bounded()),
        applied: applied_settings(job, selection),
        ..Default::default()
    })
}

/// The format `FORMAT` names (case-insensitive; empty is GPTQ); anything else is bad configuration.
pub fn output_format(format: &str) -> Result<OutputFormat, WorkerError> {
    let f = format.trim();
    if f.eq_ignore_ascii_case(FORMAT_GGUF) {
        Ok(OutputFormat::Gguf)
    } else if f.eq_ignore_ascii_case(FORMAT_FP8) {
        Ok(OutputFormat::Fp8)
    } else if f.eq_ignore_ascii_case(FORMAT_COMPRESSED_TENSORS) {
        Ok(OutputFormat::CompressedTensors)
    } else if f.eq_ignore_ascii_case(FORMAT_AWQ) {
        Ok(OutputFormat::Awq)
    } else if f.is_empty() || f.eq_ignore_ascii_case(FORMAT_GPTQ) {
        Ok(OutputFormat::Gptq)
    } else {
        Err(QuantizeError::Format {
            format: format.to_string(),
        }
        .into())
    }
}

/// `FORMAT=FP8`: the artifact directory in compressed-tensors' `float-quantized` layout
/// ([`write_fp8_artifact`]), under the same writer lock and garbage collection as a GPTQ run. Only 8
/// bits exist: another `BITS` is bad input.
fn run_fp8(args: &QuantizeArgs, events: &Events) -> Result<TerminationSuccess, WorkerError> {
    if let Some(bits) = args.bits.filter(|&b| b != 8) {
        return Err(QuantizeError::Fp8Bits { bits }.into());
    }
    let strategy = ScaleStrategy::parse(env::FP8_SCALE, &args.fp8_scale)
        .map_err(|e| WorkerError::Quant(e.into()))?;
    let scheme = ActivationScheme::parse(env::FP8_ACTIVATIONS, &args.fp8_activations)
        .map_err(|e| WorkerError::Quant(e.into()))?;
    let dataset = match scheme {
        ActivationScheme::Dynamic => None,
        ActivationScheme::Static if args.dataset.trim().is_empty() => {
            return Err(QuantizeError::Fp8StaticNeedsDataset.into())
        }
        ActivationScheme::Static => Some(crate::datasets::resolve(
            &args.dataset,
            &args.model_dir,
            "calibration",
        )?),
    };
    let activations = match &dataset {
        None => Fp8Activations::Dynamic,
        Some(d) => Fp8Activations::Static {
            dataset: d,
            calib: CalibSettings {
                max_samples: args.max_samples,
                max_seq_len: args.max_seq_len,
            },
        },
    };
    let exclusion = args
        .dynamic_exclusion
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty());
    let _lock = crate::generations::lock_output(&args.out_dir, events)?;
    let outcome = write_fp8_artifact(
        &Fp8Job {
            model_dir: &args.model_dir,
            out_dir: &args.out_dir,
            strategy,
            activations,
            dynamic_exclusion: exclusion,
            script_version: contract::SCRIPT_VERSION,
            verify_save_sha256: args.verify_save_sha256,
            max_shard_bytes: args.max_shard_bytes.max(1),
        },
        &WorkerSink(events),
    )
    .map_err(WorkerError::Quant)?;
    let mut applied = applied_map([
        ("format", FORMAT_FP8.to_string()),
        ("bits", "8".to_string()),
        ("fp8Scale", strategy.as_str().to_string()),
        ("activationScales", scheme.as_str().to_string()),
        ("dynamicExclusion", exclusion.unwrap_or("none").to_string()),
    ]);
    if let Some(d) = &dataset {
        applied.extend(applied_map([
            ("dataset", d.display().to_string()),
            ("calibrationSamples", args.max_samples.to_string()),
            ("calibrationSeqLen", args.max_seq_len.to_string()),
        ]));
    }
    if let Some(q) = &outcome.quality {
        applied.extend(applied_map([
            ("quantizedModules", q.quantized_modules.to_string()),
            ("keptModules", q.kept_modules.to_string()),
            ("maxRelativeError", format!("{:.5}", q.max_relative_error)),
        ]));
        if q.calibration_tokens > 0 {
            applied.insert("calibrationTokens".into(), q.calibration_tokens.to_string());
        }
    }
    let shown = match scheme {
        ActivationScheme::Dynamic => format!("FP8 ({})", strategy.as_str()),
        ActivationScheme::Static => format!(
            "FP8 ({}, static activation scales from {} calibration tokens)",
            strategy.as_str(),
            outcome.quality.as_ref().map_or(0, |q| q.calibration_tokens)
        ),
    };
    Ok(finish_artifact(
        args,
        events,
        &shown,
        &outcome.output_dir,
        written!(outcome),
        format!("fp8-{}", strategy.as_str()),
        applied,
    ))
}

/// `FORMAT=AWQ`: the AWQ artifact directory in AutoAWQ's GEMM layout ([`write_awq_artifact`]), under the
/// same writer lock and garbage collection as a GPTQ run. `BITS` (4), `GROUP_SIZE` and the family are checked
/// by the engine before any output; a missing `DATASET` is bad input.
fn run_awq(args: &QuantizeArgs, events: &Events) -> Result<TerminationSuccess, WorkerError> {
    if args.dataset.trim().is_empty() {
        return Err(QuantizeError::AwqNeedsDataset.into());
    }
    let dataset = crate::datasets::resolve(&args.dataset, &args.model_dir, "calibration")?;
    let bits = args.bits.unwrap_or(4);
    let _lock = crate::generations::lock_output(&args.out_dir, events)?;
    let outcome = write_awq_artifact(
        &AwqJob {
            model_dir: &args.model_dir,
            out_dir: &args.out_dir,
            dataset: &dataset,
            calib: CalibSettings {
                max_samples: args.max_samples,
                max_seq_len: args.max_seq_len,
            },
            bits,
            group_size: args.group_size,
            script_version: contract::SCRIPT_VERSION,
            verify_save_sha256: args.verify_save_sha256,
            max_shard_bytes: args.max_shard_bytes.max(1),
            max_output_error_ratio: args.max_output_error_ratio,
        },
        &WorkerSink(events),
    )
    .map_err(|e| match e {
        gate @ QuantError::AwqGateFailed(_) => QuantizeError::GateFailed {
            gate,
            out_dir: args.out_dir.clone(),
        }
        .into(),
        e => WorkerError::Quant(e),
    })?;
    if let Some(q) = outcome.quality.as_ref().filter(|q| q.failed()) {
        // A reused artifact whose sidecar records a failed gate.
        return Err(QuantizeError::GateRecorded {
            gate: QuantError::AwqGateFailed(Box::new(q.clone())),
            dir: outcome.output_dir.clone(),
        }
        .into());
    }
    let mut applied = applied_map([
        ("format", FORMAT_AWQ.to_string()),
        ("bits", bits.to_string()),
        ("groupSize", args.group_size.to_string()),
        ("zeroPoint", "true".to_string()),
        ("version", "gemm".to_string()),
        ("calibrationSamples", args.max_samples.to_string()),
        ("calibrationSeqLen", args.max_seq_len.to_string()),
    ]);
    if let Some(q) = &outcome.quality {
        applied.extend(applied_map([
            ("quantizedModules", q.quantized_modules.to_string()),
            ("scaledGroups", q.scaled_groups.to_string()),
            ("meanLossRatio", format!("{:.4}", q.mean_loss_ratio)),
            ("outputErrorRatio", format!("{:.4}", q.output_error_ratio)),
            ("maxRelativeError", format!("{:.5}", q.max_relative_error)),
        ]));
        if !q.gate.is_empty() {
            applied.insert("qualityGate".into(), q.gate.clone());
        }
    }
    Ok(finish_artifact(
        args,
        events,
        &format!("AWQ (w{bits} g{})", args.group_size),
        &outcome.output_dir,
        written!(outcome),
        format!("awq-w{bits}-g{}", args.group_size),
        applied,
    ))
}

/// What an artifact writer (FP8, AWQ, GGUF) reports, for the log line and the termination message.
struct Written<'a> {
    output_dir: &'a std::path::Path,
    original_size_bytes: u64,
    compressed_size_bytes: u64,
    seconds: f64,
    config_digest: String,
    cached: bool,
}

/// The end of a successful FP8/AWQ/GGUF run: the log line `<what>: <shown> (<bytes> bytes[, reused])`,
/// garbage collection of older generations, and the termination message.
#[allow(clippy::too_many_arguments)]
fn finish_artifact(
    args: &QuantizeArgs,
    events: &Events,
    what: &str,
    shown: &std::path::Path,
    written: Written<'_>,
    kind: String,
    applied: std::collections::BTreeMap<String, String>,
) -> TerminationSuccess {
    events.log(&format!(
        "{what}: {} ({} bytes{})",
        shown.display(),
        written.compressed_size_bytes,
        if written.cached { ", reused" } else { "" }
    ));
    collect_garbage(args, events);
    TerminationSuccess {
        kind,
        original_size_bytes: Some(written.original_size_bytes),
        compressed_size_bytes: Some(written.compressed_size_bytes),
        quantization_time_seconds: Some((written.seconds * 10.0).round() / 10.0),
        output_dir: Some(written.output_dir.display().to_string()),
        config_digest: Some(written.config_digest),
        applied,
        ..Default::default()
    }
}

/// Removes older artifact generations beside `OUT_DIR` (keeping `KEEP_DIRS`).
fn collect_garbage(args: &QuantizeArgs, events: &Events) {
    crate::generations::collect_garbage(
        &args.out_dir,
        std::env::var(env::KEEP_DIRS).ok().as_deref(),
        events,
    );
}

/// `applied` from (key, value) pairs.
fn applied_map<'a>(
    pairs: impl IntoIterator<Item = (&'a str, String)>,
) -> std::collections::BTreeMap<String, String> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// The llama.cpp preset named by `GGUF_TYPE`.
pub fn gguf_file_type(name: &str) -> Result<FileType, WorkerError> {
    FileType::from_name(name).ok_or_else(|| {
        WorkerError::from(QuantizeError::GgufType {
            name: name.to_string(),
        })
    })
}

/// Whether a GGUF run of `file_type` uses GPTQ error feedback, from `GGUF_GPTQ` (`auto`, `1`/`on`/`true`,
/// `0`/`off`/`false`) and whether a calibration set is given (feedback needs the pass's Hessians).
pub fn gguf_feedback(
    value: &str,
    file_type: FileType,
    has_dataset: bool,
) -> Result<bool, WorkerError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(has_dataset && FEEDBACK_BY_DEFAULT.contains(&file_type)),
        "1" | "on" | "true" => {
            if has_dataset {
                Ok(true)
            } else {
                Err(QuantizeError::FeedbackNeedsDataset {
                    value: value.to_string(),
                }
                .into())
            }
        }
        "0" | "off" | "false" => Ok(false),
        _ => Err(QuantizeError::Feedback {
            value: value.to_string(),
        }
        .into()),
    }
}

/// Engine progress mapped into `[from, from + width]` of the worker's percent (two engine steps, each
/// reporting 0–100 %, in one monotonic stream).
struct SpanSink<'a> {
    events: &'a Events,
    from: f64,
    width: f64,
}

impl EventSink for SpanSink<'_> {
    fn emit(&self, event: &str, mut fields: serde_json::Map<String, serde_json::Value>) {
        if event == events::PROGRESS {
            if let Some(p) = fields.get("percent").and_then(serde_json::Value::as_f64) {
                let scaled = self.from + self.width * p.clamp(0.0, 100.0) / 100.0;
                fields.insert(
                    "percent".into(),
                    serde_json::json!((scaled * 10.0).round() / 10.0),
                );
            }
        }
        WorkerSink(self.events).emit(event, fields);
    }
}

/// Share of a GGUF run's progress that the importance pass takes when there is one.
const IMPORTANCE_PROGRESS_SHARE: f64 = 50.0;

/// The importance matrix of a GGUF run: from our calibration pass over the unquantized model when
/// `DATASET` is set, else none (the plain block search, as `llama-quantize` without `--imatrix`).
/// With `feedback`, the pass also quantizes the K-quant linears with GPTQ error feedback.
fn gguf_importance(
    args: &QuantizeArgs,
    file_type: FileType,
    feedback: bool,
    events: &Events,
) -> Result<Option<(Importance, PathBuf)>, WorkerError> {
    if args.dataset.trim().is_empty() {
        return Ok(None);
    }
    let dataset = crate::datasets::resolve(&args.dataset, &args.model_dir, "calibration")?;
    let imp = collect_importance(
        &ImportanceJob {
            model_dir: &args.model_dir,
            dataset: &dataset,
            calib: CalibSettings {
                max_samples: args.max_samples,
                max_seq_len: args.max_seq_len,
            },
            feedback: feedback.then_some(file_type),
        },
        &SpanSink {
            events,
            from: 0.0,
            width: IMPORTANCE_PROGRESS_SHARE,
        },
    )
    .map_err(WorkerError::Quant)?;
    events.log(&format!(
        "importance matrix: {} tensors ({} quantized with GPTQ feedback) from {} samples, {} tokens of {} in {:.1}s",
        imp.weights.len(),
        imp.feedback.len(),
        imp.samples,
        imp.tokens,
        dataset.display(),
        imp.seconds
    ));
    Ok(Some((imp, dataset)))
}

/// `FORMAT=GGUF`: the artifact directory with one `.gguf` ([`write_gguf_artifact`]), under the same
/// writer lock and garbage collection as a GPTQ run; with `DATASET`, the block search is weighted by
/// the importance matrix of our calibration pass ([`collect_importance`]).
fn run_gguf(args: &QuantizeArgs, events: &Events) -> Result<TerminationSuccess, WorkerError> {
    let file_type = gguf_file_type(&args.gguf_type)?;
    let _lock = crate::generations::lock_output(&args.out_dir, events)?;
    let feedback = gguf_feedback(&args.gguf_gptq, file_type, !args.dataset.trim().is_empty())?;
    let importance = gguf_importance(args, file_type, feedback, events)?;
    let from = if importance.is_some() {
        IMPORTANCE_PROGRESS_SHARE
    } else {
        0.0
    };
    let outcome = write_gguf_artifact(
        &GgufArtifactJob {
            model_dir: &args.model_dir,
            out_dir: &args.out_dir,
            file_type,
            importance: importance.as_ref().map(|(imp, _)| &imp.weights),
            prequantized: importance
                .as_ref()
                .map(|(imp, _)| &imp.feedback)
                .filter(|m| !m.is_empty()),
            script_version: contract::SCRIPT_VERSION,
            verify_save_sha256: args.verify_save_sha256,
        },
        &SpanSink {
            events,
            from,
            width: 100.0 - from,
        },
    )
    .map_err(WorkerError::Quant)?;
    let file = outcome.output_dir.join(&outcome.file_name);
    Ok(finish_artifact(
        args,
        events,
        &format!("GGUF {}", file_type.name()),
        &file,
        written!(outcome),
        format!("gguf-{}", file_type.name().to_ascii_lowercase()),
        gguf_applied(
            args,
            file_type,
            outcome.file_name.clone(),
            importance.as_ref(),
        ),
    ))
}

/// `applied` of a GGUF run: the format, type and file, and where the importance matrix came from
/// (`calibration`, with the dataset and sizes it was collected over, or `none`).
fn gguf_applied(
    args: &QuantizeArgs,
    file_type: FileType,
    file_name: String,
    importance: Option<&(Importance, PathBuf)>,
) -> std::collections::BTreeMap<String, String> {
    let mut applied: Vec<(&str, String)> = vec![
        ("format", FORMAT_GGUF.to_string()),
        ("ggufType", file_type.name().to_string()),
        ("ggufFile", file_name),
    ];
    match importance {
        Some((imp, dataset)) => applied.extend([
            ("importance", "calibration".to_string()),
            ("dataset", dataset.display().to_string()),
            ("maxSamples", args.max_samples.to_string()),
            ("maxSeqLen", args.max_seq_len.to_string()),
            ("importanceTokens", imp.tokens.to_string()),
            (
                "ggufGptq",
                if imp.feedback.is_empty() {
                    "off".to_string()
                } else {
                    format!("on ({} tensors)", imp.feedback.len())
                },
            ),
        ]),
        None => applied.push(("importance", "none".to_string())),
    }
    applied_map(applied)
}

/// The settings the engine ran with, as the controller reports them in `status.quantization.applied`: the
/// GPTQ parameters and the `GPTQ_DEVICE` setting (canonical: `auto` for an empty one, `hip` for `rocm`). The
/// device used is the termination message's `gptqDevice`.
fn applied_settings(
    job: &QuantizeJob,
    selection: &Selection,
) -> std::collections::BTreeMap<String, String> {
    let p = &job.params;
    let r = &job.recovery;
    let mut applied = applied_map([
        ("bits", p.bits.to_string()),
        ("groupSize", p.group_size.to_string()),
        ("sym", p.sym.to_string()),
        ("descAct", p.desc_act.to_string()),
        ("staticGroups", p.static_groups.to_string()),
        ("actGroupAware", p.act_group_aware.to_string()),
        ("clipSearch", p.clip_search.to_string()),
        ("refineRounds", p.refine_rounds.to_string()),
        ("dampPercent", r.damp_percent.to_string()),
        ("maxSamples", job.calib.max_samples.to_string()),
        ("maxSeqLen", job.calib.max_seq_len.to_string()),
        ("dataset", job.dataset.display().to_string()),
        (
            "dynamicExclusion",
            job.dynamic_exclusion
                .clone()
                .unwrap_or_else(|| "none".into()),
        ),
        (
            "maxRtnFallbackPercent",
            job.gate.max_rtn_fallback_percent.to_string(),
        ),
        ("gptqDevice", selection.requested.as_str().to_string()),
    ]);
    if job.container == Container::CompressedTensors {
        // The GPTQ settings above are the solve's; the container is what the artifact is.
        applied.insert("format".into(), FORMAT_COMPRESSED_TENSORS.into());
    }
    applied
}
