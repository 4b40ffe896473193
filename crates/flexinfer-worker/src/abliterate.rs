//! `flexinfer-worker abliterate`: refusal-direction removal (`spec.abliteration`; docs/user/abliteration.md).
//!
//! 1. Plan: which decoder layers and which residual-writing matrices are modified, with the
//!    guards (GDN/linear-attention layers, MoE experts, lm_head, vision/audio towers).
//! 2. Direction: refusal and harmless prompts run through the model (the quantization engine's
//!    forward: Llama family, Gemma 2/3/4, one layer at a time); per layer the last-token residual means
//!    of both classes; the normalized difference of the best-separating target layer is the direction.
//!    Each writer is orthogonalized so that what reaches the residual has no component along it: against the
//!    direction itself, or (Gemma, whose post-norms scale each writer's output per channel by `g`) against
//!    `g ⊙ r` ([`ortho::orthogonalize_writer`]).
//! 3. Gate: raw direction norm finite and within `normThreshold`; perplexity on harmless text
//!    within `maxPerplexityIncreasePercent` of the original (computed with the edited weights,
//!    rounded to the source dtype exactly as written). Reported beside it: the projection check (the
//!    classes' separation along the direction at its layer, before and after the edit).
//! 4. Output: a new directory mirroring the source shards (same names, dtypes, headers), written
//!    through a resumable staging directory; `.abliteration-status.json` last.

pub mod data;
pub mod direction;
pub mod dtype;
pub mod edit;
pub mod forward;
pub mod ortho;
pub mod output;

use std::path::{Path, PathBuf};

use flexinfer_contract::{
    self as contract, env, events, files, AbliterationStatusFile, ProgressEvent, TerminationSuccess,
};
use flexinfer_quant::QuantError;

use crate::common::{self, AbliterateError, Events, ExitKind, WorkerError};
use crate::download::parse_bool_arg;

/// Flags of `flexinfer-worker abliterate` (each also read from its env variable; flags win).
#[derive(clap::Args, Debug, Clone)]
pub struct AbliterateArgs {
    /// Source model directory (never modified, except for `.abliteration-status.json`).
    #[arg(long, env = env::MODEL_DIR)]
    pub model_dir: PathBuf,
    /// Output directory (default `$MODEL_DIR/abliterated`).
    #[arg(long, env = env::OUT_DIR)]
    pub out_dir: Option<PathBuf>,
    /// Prompts per class used to estimate the direction (and harmless texts for perplexity).
    #[arg(long, env = env::NUM_SAMPLES, default_value_t = 128)]
    pub num_samples: usize,
    /// `auto`, a range `10-55` or a list `0,1,5` of decoder layers to modify.
    #[arg(long, env = env::TARGET_LAYERS, default_value = "auto")]
    pub target_layers: String,
    /// Comma list of residual-writing matrices: `o_proj`, `down_proj`.
    #[arg(long, env = env::WEIGHT_MATRICES, default_value = "o_proj,down_proj")]
    pub weight_matrices: String,
    /// Never modify linear-attention (GatedDeltaNet) layers.
    #[arg(long, env = env::SKIP_GDN_LAYERS, value_parser = parse_bool_arg, action = clap::ArgAction::Set, default_value = "true")]
    pub skip_gdn_layers: bool,
    /// Never modify vision/audio tower weights.
    #[arg(long, env = env::SKIP_VISION, value_parser = parse_bool_arg, action = clap::ArgAction::Set, default_value = "true")]
    pub skip_vision: bool,
    /// Maximum raw refusal-direction norm.
    #[arg(long, env = env::NORM_THRESHOLD, default_value = "100")]
    pub norm_threshold: String,
    /// Also orthogonalize the lm_head (off by default: orthogonalizing it has corrupted saved checkpoints).
    #[arg(long, env = env::ABLITERATE_LM_HEAD, value_parser = parse_bool_arg, action = clap::ArgAction::Set, default_value = "false")]
    pub abliterate_lm_head: bool,
    /// Maximum perplexity increase on harmless text, in percent.
    #[arg(long, env = env::MAX_PERPLEXITY_INCREASE_PERCENT, default_value = "5")]
    pub max_perplexity_increase_percent: String,
    /// Prompts the model refuses: a local file, or a hub dataset id fetched under `$MODEL_DIR/.datasets`.
    #[arg(long, env = env::REFUSAL_DATASET, default_value = "mlabonne/harmful_behaviors")]
    pub refusal_dataset: String,
    /// Harmless prompts (same forms as the refusal dataset).
    #[arg(long, env = env::HARMLESS_DATASET, default_value = "mlabonne/harmless_alpaca")]
    pub harmless_dataset: String,
    /// Token limit per prompt.
    #[arg(long, default_value_t = 512)]
    pub max_seq_len: usize,
    /// Contract version expected by the controller.
    #[arg(long, env = env::SCRIPT_VERSION)]
    pub script_version: Option<String>,
    /// Test hook: exit abruptly (code 137, like a SIGKILL) after writing this many shards (feature
    /// `test-hooks`).
    #[cfg(feature = "test-hooks")]
    #[arg(long, hide = true)]
    pub test_abort_after_shards: Option<usize>,
}

/// Parsed, validated settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub target: edit::TargetLayers,
    pub matrices: Vec<edit::Matrix>,
    pub skip_gdn: bool,
    pub skip_vision: bool,
    pub lm_head: bool,
    pub norm_threshold: f64,
    pub max_ppl_increase_percent: f64,
}

impl Settings {
    pub fn from_args(a: &AbliterateArgs) -> Result<Self, WorkerError> {
        let norm_threshold = parse_positive(&a.norm_threshold, env::NORM_THRESHOLD, false)?;
        let max_ppl = parse_positive(
            &a.max_perplexity_increase_percent,
            env::MAX_PERPLEXITY_INCREASE_PERCENT,
            true,
        )?;
        Ok(Settings {
            target: edit::TargetLayers::parse(&a.target_layers)?,
            matrices: edit::Matrix::parse_list(&a.weight_matrices)?,
            skip_gdn: a.skip_gdn_layers,
            skip_vision: a.skip_vision,
            lm_head: a.abliterate_lm_head,
            norm_threshold,
            max_ppl_increase_percent: max_ppl,
        })
    }
}

fn parse_positive(s: &str, name: &str, zero_ok: bool) -> Result<f64, WorkerError> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0)) => Ok(v),
        _ => Err(AbliterateError::NotPositive {
            name: name.to_string(),
            value: s.to_string(),
            zero_ok,
        }
        .into()),
    }
}

/// Map an engine error: the caller's fault → exit 2, anything else → exit 1.
pub fn quant_err(e: QuantError) -> WorkerError {
    WorkerError::Quant(e)
}

pub(crate) fn io_err(path: &Path, e: std::io::Error) -> WorkerError {
    WorkerError::Io {
        kind: ExitKind::Failure,
        context: path.display().to_string(),
        source: e,
    }
}

/// Run the subcommand; returns the process exit code.
pub fn run(args: AbliterateArgs) -> i32 {
    let events = Events::new(contract::JobPhase::Abliterate.status_name());
    let result = run_inner(&args, &events);
    common::finish(&events, result)
}

fn progress(ev: &Events, percent: f64, detail: String) {
    ev.progress(ProgressEvent {
        percent,
        detail: Some(detail),
        ..Default::default()
    });
}

fn run_inner(args: &AbliterateArgs, ev: &Events) -> Result<TerminationSuccess, WorkerError> {
    common::check_version(args.script_version.as_deref())?;
    let started = std::time::Instant::now();
    let settings = Settings::from_args(args)?;
    if args.num_samples == 0 {
        return Err(AbliterateError::NoSamples.into());
    }
    let model_dir = args.model_dir.clone();
    if !model_dir.is_dir() {
        return Err(AbliterateError::NoModelDir { dir: model_dir }.into());
    }
    let out_dir = args
        .out_dir
        .clone()
        .unwrap_or_else(|| model_dir.join(contract::ABLITERATED_SUBDIR));
    if same_dir(&out_dir, &model_dir) {
        return Err(AbliterateError::OutInsideSource.into());
    }
    ev.emit(
        events::START,
        &serde_json::json!({
            "phase": ev.phase(),
            "modelDir": model_dir.display().to_string(),
            "outDir": out_dir.display().to_string(),
            "targetLayers": args.target_layers,
            "weightMatrices": args.weight_matrices,
        }),
    );
    // One writer per output directory (a replaced Job's pod may still be running).
    let _lock = crate::generations::lock_output(&out_dir, ev)?;
    let result = run_locked(args, ev, &settings, &model_dir, &out_dir, started);
    if result.is_ok() {
        crate::generations::collect_garbage(
            &out_dir,
            std::env::var(env::KEEP_DIRS).ok().as_deref(),
            ev,
        );
    }
    result
}

fn run_locked(
    args: &AbliterateArgs,
    ev: &Events,
    settings: &Settings,
    model_dir: &Path,
    out_dir: &Path,
    started: std::time::Instant,
) -> Result<TerminationSuccess, WorkerError> {
    let (model_dir, out_dir) = (model_dir.to_path_buf(), out_dir.to_path_buf());
    progress(ev, 1.0, "opening the model".into());
    let store = flexinfer_quant::tensors::TensorStore::open_dir(&model_dir).map_err(quant_err)?;
    let raw_config = output::read_config(&model_dir)?;
    let layout = edit::Layout::from_model(&store, &raw_config)?;

    // Plan first: a bad matrix or layer list fails before any expensive forward.
    let (targets, mut plan) = plan_edits(&layout, settings, ev)?;
    let matrices: Vec<String> = settings
        .matrices
        .iter()
        .map(|m| m.as_str().to_string())
        .collect();
    // The direction needs the engine's forward: refuse other architectures before any work.
    let arch = forward::Arch::load(&model_dir, &layout)?;
    // Gemma: each writer is orthogonalized against its output norm's `g ⊙ r`, not `r`.
    edit::attach_output_norms(&mut plan, &store, &arch.cfg)?;

    // Datasets and the resume fingerprint (source identity + everything that shapes the result).
    let refusal_path = crate::datasets::resolve(&args.refusal_dataset, &model_dir, "refusal")?;
    let harmless_path = crate::datasets::resolve(&args.harmless_dataset, &model_dir, "harmless")?;
    let fingerprint = output::fingerprint(
        &store,
        &model_dir,
        &[&refusal_path, &harmless_path],
        &result_shape(args, settings, &targets.layers, &matrices, &plan),
    )?;

    // A complete output of this exact run short-circuits.
    if let Some(done) = output::verify_complete(&out_dir, &fingerprint) {
        ev.emit(
            events::ABLITERATION_CACHED,
            &serde_json::json!({ "outDir": out_dir.display().to_string() }),
        );
        gate(settings, &done.result, ev)?;
        return finish_success(
            &model_dir,
            &out_dir,
            &done.result,
            &matrices,
            &store,
            started,
        );
    }

    let staging = output::staging_dir(&out_dir);
    let resumed = output::load_staging(&staging, &fingerprint);
    let result = match &resumed {
        Some(m) => resumed_result(ev, m),
        None => {
            let prompts = load_prompts(args, ev, &model_dir, &refusal_path, &harmless_path)?;
            direction::compute(&store, &arch, &targets.layers, &plan, &prompts, ev)?
        }
    };
    gate(settings, &result, ev)?;

    // Only now (gate passed) is anything written.
    let shards = output::write_output(
        &store,
        &model_dir,
        &staging,
        &plan,
        &result,
        &fingerprint,
        resumed.as_ref(),
        test_abort_after_shards(args),
        ev,
    )?;
    output::commit(&staging, &out_dir)?;
    progress(ev, 99.0, format!("wrote {} shards", shards));
    finish_success(&model_dir, &out_dir, &result, &matrices, &store, started)
}

/// The shard count after which the test hook ends the process.
#[cfg(feature = "test-hooks")]
fn test_abort_after_shards(args: &AbliterateArgs) -> Option<usize> {
    args.test_abort_after_shards
}

/// Without feature `test-hooks` there is no such hook.
#[cfg(not(feature = "test-hooks"))]
fn test_abort_after_shards(_: &AbliterateArgs) -> Option<usize> {
    None
}

/// Chooses the target layers and plans the edits (failing on a bad matrix or layer list before
/// any expensive forward); the warnings of both are logged and emitted as warning events.
fn plan_edits(
    layout: &edit::Layout,
    settings: &Settings,
    ev: &Events,
) -> Result<(edit::Targets, edit::Plan), WorkerError> {
    let targets = edit::select_target_layers(layout, settings)?;
    let plan = edit::plan(layout, settings, &targets.layers)?;
    for w in targets.warnings.iter().chain(plan.warnings.iter()) {
        ev.log(&format!("warning: {w}"));
        ev.emit(events::WARNING, &serde_json::json!({ "message": w }));
    }
    Ok((targets, plan))
}

/// Everything besides the source and the datasets that shapes the result: part of the resume
/// fingerprint, so a change to any of it starts over.
fn result_shape(
    args: &AbliterateArgs,
    settings: &Settings,
    layers: &[usize],
    matrices: &[String],
    plan: &edit::Plan,
) -> serde_json::Value {
    serde_json::json!({
        "numSamples": args.num_samples,
        "targets": layers,
        "matrices": matrices,
        "skipGdn": settings.skip_gdn,
        "skipVision": settings.skip_vision,
        "lmHead": settings.lm_head,
        "maxSeqLen": args.max_seq_len,
        "edits": plan.edits.iter().map(|e| &e.tensor).collect::<Vec<_>>(),
    })
}

/// The direction and gate results an interrupted run recorded in its staging manifest (announced
/// as a resume event).
fn resumed_result(ev: &Events, m: &output::Manifest) -> output::RunResult {
    ev.emit(
        events::ABLITERATION_RESUME_LOADED,
        &serde_json::json!({
            "shardsCached": m.shards.len(),
            "layer": m.result.layer,
        }),
    );
    progress(
        ev,
        70.0,
        "resumed: direction and gate results loaded".into(),
    );
    m.result.clone()
}

/// Loads the refusal and harmless prompt sets; their warnings are logged and emitted.
fn load_prompts(
    args: &AbliterateArgs,
    ev: &Events,
    model_dir: &Path,
    refusal_path: &Path,
    harmless_path: &Path,
) -> Result<data::PromptSets, WorkerError> {
    let prompts = data::load_prompt_sets(
        model_dir,
        refusal_path,
        harmless_path,
        args.num_samples,
        args.max_seq_len,
    )?;
    for w in &prompts.warnings {
        ev.log(&format!("warning: {w}"));
        ev.emit(events::WARNING, &serde_json::json!({ "message": w }));
    }
    Ok(prompts)
}

/// True when `out` is `model` or one of its ancestors (replacing it would delete the source).
fn same_dir(out: &Path, model: &Path) -> bool {
    match (out.canonicalize(), model.canonicalize()) {
        (Ok(o), Ok(m)) => m.starts_with(&o),
        _ => out == model,
    }
}

/// The quality gate on a (computed or recorded) result.
fn gate(s: &Settings, r: &output::RunResult, ev: &Events) -> Result<(), WorkerError> {
    let limit = r.perplexity_before * (1.0 + s.max_ppl_increase_percent / 100.0);
    let norm_ok = r.refusal_dir_norm.is_finite() && r.refusal_dir_norm <= s.norm_threshold;
    let ppl_ok = r.perplexity_before.is_finite()
        && r.perplexity_after.is_finite()
        && r.perplexity_after <= limit;
    ev.emit(
        events::ABLITERATION_GATE,
        &serde_json::json!({
            "gate": if norm_ok && ppl_ok { "passed" } else { "failed" },
            "layer": r.layer,
            "refusalDirNorm": r.refusal_dir_norm,
            "normThreshold": s.norm_threshold,
            "perplexityBefore": r.perplexity_before,
            "perplexityAfter": r.perplexity_after,
            "maxPerplexityIncreasePercent": s.max_ppl_increase_percent,
            "refusalProjectionBefore": r.refusal_projection_before,
            "refusalProjectionAfter": r.refusal_projection_after,
        }),
    );
    if let (Some(b), Some(a)) = (r.refusal_projection_before, r.refusal_projection_after) {
        // Not a gate (the guards may leave writers such as MoE experts unedited), but worth a warning.
        if b.abs() > 0.0 && a.abs() > 0.5 * b.abs() {
            let w = format!(
                "projection check: the refusal/harmless separation along the direction at layer {} only fell \
                 from {b:.4} to {a:.4}; unedited writers (experts, skipped layers or matrices) still carry it",
                r.layer
            );
            ev.log(&format!("warning: {w}"));
            ev.emit(events::WARNING, &serde_json::json!({ "message": w }));
        }
    }
    if !norm_ok {
        return Err(AbliterateError::NormGate {
            norm: r.refusal_dir_norm,
            layer: r.layer,
            threshold: s.norm_threshold,
        }
        .into());
    }
    if !ppl_ok {
        return Err(AbliterateError::PerplexityGate {
            before: r.perplexity_before,
            after: r.perplexity_after,
            limit: s.max_ppl_increase_percent,
        }
        .into());
    }
    Ok(())
}

fn finish_success(
    model_dir: &Path,
    out_dir: &Path,
    r: &output::RunResult,
    matrices: &[String],
    store: &flexinfer_quant::tensors::TensorStore,
    started: std::time::Instant,
) -> Result<TerminationSuccess, WorkerError> {
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        "abliteration finished"
    );
    let status = AbliterationStatusFile {
        status: "completed".into(),
        layers_modified: r.layers_modified.len() as u64,
        refusal_dir_norm: r.refusal_dir_norm,
        layer: r.layer as u64,
        weight_matrices: matrices.to_vec(),
        perplexity_before: Some(r.perplexity_before),
        perplexity_after: Some(r.perplexity_after),
        completed_at: common::now_rfc3339(),
    };
    let bytes = serde_json::to_vec_pretty(&status).map_err(WorkerError::json(
        ExitKind::Failure,
        "encoding the status file",
    ))?;
    let path = model_dir.join(files::ABLITERATION_STATUS);
    common::write_atomic(&path, &bytes).map_err(|e| io_err(&path, e))?;
    Ok(TerminationSuccess {
        kind: contract::JobPhase::Abliterate.as_str().into(),
        original_size_bytes: Some(store.total_bytes()),
        output_dir: Some(out_dir.display().to_string()),
        layers_modified: Some(r.layers_modified.len() as u64),
        refusal_dir_norm: Some(r.refusal_dir_norm),
        layer: Some(r.layer as u64),
        perplexity_before: Some(r.perplexity_before),
        perplexity_after: Some(r.perplexity_after),
        ..Default::default()
    })
}
