//! Per-phase vocabulary of the planner: the progress fields of a phase's status, the cache phase,
//! condition and reasons that belong to a Job phase, generations and the retry bookkeeping.

use std::time::Duration;

use flexinfer_api::conditions::types;
use flexinfer_api::contract::{self, reasons, JobPhase};
use flexinfer_api::modelcache::{
    AbliterationStatus, CachePhase, DownloadStatus, ModelCacheStatus, PhaseProgress,
    QuantizationStatus,
};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

/// The progress fields of phase `p` (default when the phase has no status yet).
pub(super) fn get_common(st: &ModelCacheStatus, p: JobPhase) -> PhaseProgress {
    match p {
        JobPhase::Download => st.download.as_ref().map(|s| s.run.clone()),
        JobPhase::Abliterate => st.abliteration.as_ref().map(|s| s.run.clone()),
        JobPhase::Quantize => st.quantization.as_ref().map(|s| s.run.clone()),
        JobPhase::Publish => st.publish.as_ref().map(|s| s.run.clone()),
    }
    .unwrap_or_default()
}

/// Replace the progress fields of phase `p`, creating its status if needed.
pub(super) fn set_common(st: &mut ModelCacheStatus, p: JobPhase, c: PhaseProgress) {
    let run = match p {
        JobPhase::Download => &mut st.download.get_or_insert_with(Default::default).run,
        JobPhase::Abliterate => &mut st.abliteration.get_or_insert_with(Default::default).run,
        JobPhase::Quantize => &mut st.quantization.get_or_insert_with(Default::default).run,
        JobPhase::Publish => &mut st.publish.get_or_insert_with(Default::default).run,
    };
    *run = c;
}

/// `Downloading`, `Abliterating`, … for a Job phase.
pub fn running_phase(p: JobPhase) -> CachePhase {
    match p {
        JobPhase::Download => CachePhase::Downloading,
        JobPhase::Abliterate => CachePhase::Abliterating,
        JobPhase::Quantize => CachePhase::Quantizing,
        JobPhase::Publish => CachePhase::Publishing,
    }
}

pub(super) fn phase_condition(p: JobPhase) -> &'static str {
    match p {
        JobPhase::Download => types::DOWNLOADED,
        JobPhase::Abliterate => types::ABLITERATED,
        JobPhase::Quantize => types::QUANTIZED,
        JobPhase::Publish => types::PUBLISHED,
    }
}

pub(super) fn complete_reason(p: JobPhase) -> &'static str {
    match p {
        JobPhase::Download => reasons::DOWNLOAD_COMPLETE,
        JobPhase::Abliterate => reasons::ABLITERATION_COMPLETE,
        JobPhase::Quantize => reasons::QUANTIZATION_COMPLETE,
        JobPhase::Publish => reasons::PUBLISHED,
    }
}

/// Ready condition reason of a phase that ran out of retries: `DownloadFailed`, `QuantizationFailed`, …
pub fn failed_reason(p: JobPhase) -> String {
    let n = p.status_name();
    let mut c = n.chars();
    match c.next() {
        Some(f) => format!("{}{}Failed", f.to_ascii_uppercase(), c.as_str()),
        None => "Failed".into(),
    }
}

pub(super) fn phase_from_status_name(s: &str) -> Option<JobPhase> {
    JobPhase::parse(s)
}

pub(super) fn ts_add(now: Timestamp, d: Duration) -> Timestamp {
    now.checked_add(SignedDuration::try_from(d).unwrap_or(SignedDuration::ZERO))
        .unwrap_or(now)
}

pub(super) fn secs_between(a: Timestamp, b: Timestamp) -> i64 {
    b.duration_since(a).as_secs()
}

/// `<8 hex of the spec hash>-<UTC yyyymmddhhmmss>`: unique per run start, sortable by time, names the
/// configuration it was made for.
pub fn new_generation(hash: &str, now: Timestamp) -> String {
    contract::files::generation_id(hash, &now.strftime("%Y%m%d%H%M%S").to_string())
}

pub(super) fn set_generation(st: &mut ModelCacheStatus, phase: JobPhase, generation: String) {
    match phase {
        JobPhase::Download => {
            st.download
                .get_or_insert_with(DownloadStatus::default)
                .generation = Some(generation)
        }
        JobPhase::Abliterate => {
            st.abliteration
                .get_or_insert_with(AbliterationStatus::default)
                .generations
                .generation = Some(generation)
        }
        JobPhase::Quantize => {
            st.quantization
                .get_or_insert_with(QuantizationStatus::default)
                .generations
                .generation = Some(generation)
        }
        _ => {}
    }
}

pub(super) fn reset_retries(st: &mut ModelCacheStatus) {
    st.retry_count = Some(0);
    st.last_failure_phase = None;
    st.last_failure_time = None;
    st.next_retry_at = None;
}
