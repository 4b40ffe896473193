//! The quality sidecar (`.quantization-quality.json`): present, valid, and its gate passed.

use std::path::Path;

use flexinfer_api::contract::{files, QualitySummary};
use flexinfer_fsutil::limits;

use super::read::read_file;
use super::Report;
use flexinfer_api::contract::error::chain;

/// A missing, invalid or failed quality sidecar is a defect.
pub(super) fn check_quality(r: &mut Report, dir: &Path) {
    match read_file(dir, files::QUANTIZATION_QUALITY, limits::CONFIG_JSON) {
        Err(e)
            if dir
                .join(files::QUANTIZATION_QUALITY)
                .symlink_metadata()
                .is_ok() =>
        {
            r.defect("quality", chain(&e))
        }
        Err(_) => r.defect(
            "quality",
            format!("{} is missing", files::QUANTIZATION_QUALITY),
        ),
        Ok(b) => match serde_json::from_slice::<QualitySummary>(&b) {
            Err(e) => r.defect(
                "quality",
                format!("{} is not valid: {e}", files::QUANTIZATION_QUALITY),
            ),
            Ok(q) => match q.gate.as_str() {
                "passed" | "insufficient-sample" => {}
                "failed" => r.defect(
                    "quality",
                    format!(
                        "quality gate failed: {} of {} modules fell back to RTN ({:.2}% > {:.2}%)",
                        q.rtn_fallback_modules,
                        q.gptq_modules + q.rtn_fallback_modules,
                        q.rtn_fallback_percent,
                        q.max_rtn_fallback_percent
                    ),
                ),
                other => r.defect(
                    "quality",
                    format!("quality gate {other:?} is not passed/failed/insufficient-sample"),
                ),
            },
        },
    }
}
