//! The identities of a run: what the input model is, and the digest of everything that determines the
//! output bytes (recorded in `.save-complete`, compared before a finished artifact is reused).

use super::{QuantizeJob, DEFAULT_CALIB_BATCH, DEFAULT_EXPERT_MIN_TOKEN_PERCENT};
use crate::error::Result;
use crate::fsutil::{sha256_file, sha256_hex};
use crate::model::tensors::TensorStore;
use flexinfer_contract::files;
use serde_json::json;
use std::path::Path;

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
pub(crate) fn input_digest(model_dir: &Path, store: &TensorStore) -> Result<String> {
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

/// sha256 over everything that determines the output bytes (docs/dev/architecture.md, "The artifact
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
    // Only the compressed-tensors container enters the digest, so GPTQ artifacts made before it stay valid.
    if job.container == super::Container::CompressedTensors {
        v["container"] = json!("compressed-tensors");
    }
    // Only a non-default threshold enters the digest, so artifacts made before the setting existed stay valid.
    if job.expert_min_token_percent != DEFAULT_EXPERT_MIN_TOKEN_PERCENT {
        v["expertMinTokenPercent"] = json!(job.expert_min_token_percent);
    }
    sha256_hex(v.to_string().as_bytes())
}

/// The calibration fingerprint (the dataset's sha256 and the sample settings) and the run's
/// [`config_digest`].
pub(super) fn run_digests(job: &QuantizeJob, store: &TensorStore) -> Result<(String, String)> {
    let dataset_sha = sha256_file(&job.dataset)?;
    let calib_fp = sha256_hex(
        format!(
            "{dataset_sha}|{}|{}",
            job.calib.max_samples, job.calib.max_seq_len
        )
        .as_bytes(),
    );
    let config_hash = config_digest(job, &calib_fp, &input_digest(&job.model_dir, store)?);
    Ok((calib_fp, config_hash))
}
