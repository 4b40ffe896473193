//! `.save-complete`: the marker of a finished save, and each shard it records (a plain name inside the
//! artifact, present, of the recorded size and sha256), no shard left out of it.

use std::collections::BTreeSet;
use std::path::Path;

use flexinfer_api::contract::{files, SaveComplete};
use flexinfer_fsutil::limits;

use super::read::read_file;
use super::{Options, Report};
use flexinfer_api::contract::error::chain;

/// The parsed `.save-complete`; a missing or invalid one is a defect.
pub(super) fn read_save_complete(r: &mut Report, dir: &Path) -> Option<SaveComplete> {
    match read_file(dir, files::SAVE_COMPLETE, limits::CONFIG_JSON) {
        Ok(b) => match serde_json::from_slice(&b) {
            Ok(s) => Some(s),
            Err(e) => {
                r.defect(
                    "save-complete",
                    format!("{} is not valid: {e}", files::SAVE_COMPLETE),
                );
                None
            }
        },
        Err(_) if dir.join(files::SAVE_COMPLETE).symlink_metadata().is_err() => {
            r.defect(
                "save-complete",
                format!(
                    "{} is missing: the save did not complete (or predates the marker)",
                    files::SAVE_COMPLETE
                ),
            );
            None
        }
        Err(e) => {
            r.defect("save-complete", chain(&e));
            None
        }
    }
}

/// The shards `.save-complete` records against the directory.
pub(super) fn check_save_complete(
    r: &mut Report,
    dir: &Path,
    sc: &SaveComplete,
    shard_files: &[String],
    opts: &Options,
) {
    let listed: BTreeSet<&str> = sc.shards.iter().map(|s| s.name.as_str()).collect();
    for s in &sc.shards {
        check_recorded_shard(r, dir, s, opts);
    }
    for s in shard_files {
        if !listed.contains(s.as_str()) {
            r.defect(
                "save-complete",
                format!("shard {s} is not recorded in .save-complete"),
            );
        }
    }
    if sc.has_config && !dir.join("config.json").exists() {
        r.defect(
            "save-complete",
            ".save-complete records has_config but config.json is missing",
        );
    }
}

/// One shard `.save-complete` records: a plain name inside `dir`, present, with the recorded size
/// and (unless skipped) sha256.
pub(super) fn check_recorded_shard(
    r: &mut Report,
    dir: &Path,
    s: &files::SaveShard,
    opts: &Options,
) {
    if flexinfer_api::contract::check_relative_path(&s.name).is_err() || s.name.contains('/') {
        r.defect(
            "save-complete",
            format!("shard name {:?} is not a plain file name", s.name),
        );
        return;
    }
    let path = match flexinfer_fsutil::resolve_within(dir, &s.name) {
        Ok(p) => p,
        Err(e) if flexinfer_fsutil::is_refused(&e) => {
            r.defect("save-complete", format!("shard {}: {e}", s.name));
            return;
        }
        Err(_) => {
            r.defect(
                "save-complete",
                format!("shard {} is recorded but missing", s.name),
            );
            return;
        }
    };
    match std::fs::metadata(&path) {
        Err(_) => r.defect(
            "save-complete",
            format!("shard {} is recorded but missing", s.name),
        ),
        Ok(m) if m.len() != s.size_bytes => r.defect(
            "save-complete",
            format!(
                "shard {} has {} bytes, .save-complete records {}",
                s.name,
                m.len(),
                s.size_bytes
            ),
        ),
        Ok(_) if !opts.skip_sha256 => match flexinfer_fsutil::sha256_file(&path)
            .map_err(|e| format!("{}: {e}", path.display()))
        {
            Ok(h) if h.eq_ignore_ascii_case(&s.sha256) => {}
            Ok(h) => r.defect(
                "save-complete",
                format!(
                    "shard {} sha256 is {h}, .save-complete records {}",
                    s.name, s.sha256
                ),
            ),
            Err(e) => r.defect("save-complete", e),
        },
        Ok(_) => {}
    }
}
