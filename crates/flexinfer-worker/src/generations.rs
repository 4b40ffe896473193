//! One writer per directory, and garbage collection of a phase's earlier generations
//! (docs/dev/architecture.md, "The artifact lifecycle").

use std::path::{Path, PathBuf};
use std::time::Duration;

use flexinfer_contract::{env, files};
use flexinfer_fsutil::{LockHolder, WriterLock};

use crate::common::{Events, ExitKind, WorkerError};

/// Heartbeat of a writer lock; a record older than [`STALE_AFTER`] without a live flock is stale.
const HEARTBEAT: Duration = Duration::from_secs(20);
const STALE_AFTER: Duration = Duration::from_secs(120);

/// Takes the writer lock of `dir` (`<dir>.lock`) for this pod's Job (`FLEXINFER_WRITER_ID`, set by the
/// controller from the pod's `controller-uid` label), in `.<dir>.lock`. Another live writer: exit 2
/// naming it.
pub fn lock_output(dir: &Path, events: &Events) -> Result<WriterLock, WorkerError> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let holder = LockHolder {
        owner: var(env::WRITER_ID).unwrap_or_else(|| format!("pid-{}", std::process::id())),
        pod: var(env::WRITER_POD).unwrap_or_default(),
        node: var(env::WRITER_NODE).unwrap_or_default(),
        ..Default::default()
    };
    match WriterLock::acquire(dir, holder, HEARTBEAT, STALE_AFTER) {
        Ok(l) => {
            events.log(&format!("holding the writer lock {}", l.path().display()));
            Ok(l)
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Err(WorkerError::Locked(e)),
        Err(e) => Err(WorkerError::Io {
            kind: ExitKind::Failure,
            context: format!("cannot take the writer lock of {}", dir.display()),
            source: e,
        }),
    }
}

/// The family of output directories `out_dir` belongs to: `gptq-…`, `abliterated…` or the download's
/// `source.<generation>`.
#[derive(Clone, Copy, PartialEq)]
enum Family {
    Gptq,
    Abliterated,
    Source,
}

impl Family {
    fn of(name: &str) -> Option<Family> {
        if name.starts_with("gptq-") {
            Some(Family::Gptq)
        } else if name.starts_with(flexinfer_contract::ABLITERATED_SUBDIR) {
            Some(Family::Abliterated)
        } else if files::is_generation_of(name, flexinfer_contract::SOURCE_SUBDIR) {
            Some(Family::Source)
        } else {
            None
        }
    }

    /// Whether a sibling entry (a directory name) is a generation of this family. Download generations
    /// must match the generation grammar exactly: beside them may lie the model's own files of a
    /// download made before generations existed (`source.spm`, …).
    fn contains(self, name: &str) -> bool {
        match self {
            Family::Gptq => name.starts_with("gptq-"),
            Family::Abliterated => name.starts_with(flexinfer_contract::ABLITERATED_SUBDIR),
            Family::Source => files::is_generation_of(name, flexinfer_contract::SOURCE_SUBDIR),
        }
    }
}

/// After a successful run: removes the sibling generations of `out_dir` (same family, any quant type)
/// that `FLEXINFER_KEEP_DIRS` does not name, with their staging directories and lock files; skips any
/// that a live writer holds. Without `FLEXINFER_KEEP_DIRS` nothing is removed. Returns what was removed.
pub fn collect_garbage(out_dir: &Path, keep: Option<&str>, events: &Events) -> Vec<String> {
    let node = std::env::var(env::WRITER_NODE).unwrap_or_default();
    collect_garbage_on(out_dir, keep, node.trim(), events)
}

/// [`collect_garbage`] on node `node` (`FLEXINFER_WRITER_NODE`): its lock probes carry the node, so a
/// fresh heartbeat of a writer on another node keeps that generation even where the flock is not
/// shared between nodes.
fn collect_garbage_on(
    out_dir: &Path,
    keep: Option<&str>,
    node: &str,
    events: &Events,
) -> Vec<String> {
    let Some(keep) = keep else {
        return Vec::new();
    };
    let keep = keep_names(keep);
    let (Some(parent), Some(own)) = (out_dir.parent(), out_dir.file_name()) else {
        return Vec::new();
    };
    let own = own.to_string_lossy().into_owned();
    let Some(fam) = Family::of(&own) else {
        return Vec::new();
    };
    let Ok(rd) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    let mut targets = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let target = generation_of_entry(&name);
        if !fam.contains(&target) || target == own || keep.contains(&target) {
            continue;
        }
        let gen_dir = parent.join(&target);
        let p = e.path();
        let Some(res) = remove_unless_written(&e, &gen_dir, node) else {
            continue;
        };
        match res {
            Ok(()) => {
                if p != flexinfer_fsutil::lock_path(&gen_dir) {
                    removed.push(name);
                }
                targets.push(gen_dir);
            }
            Err(err) => events.log(&format!(
                "garbage collection: cannot remove {}: {err}",
                p.display()
            )),
        }
    }
    remove_orphan_locks(targets);
    // A download made before generations existed lives in the model directory itself.
    if fam == Family::Source {
        let root = parent
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !keep.contains(&root) {
            if let Some(n) = collect_legacy_download(parent, events) {
                removed.push(format!(
                    "{n} file(s) of the download in {}",
                    parent.display()
                ));
            }
        }
    }
    let _ = flexinfer_fsutil::fsync_dir(parent);
    if !removed.is_empty() {
        removed.sort();
        events.emit(
            flexinfer_contract::events::GENERATIONS_COLLECTED,
            &serde_json::json!({"removed": removed, "kept": keep}),
        );
    }
    removed
}

/// The generation names `FLEXINFER_KEEP_DIRS` lists (its comma-separated paths' last components).
fn keep_names(keep: &str) -> Vec<String> {
    keep.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .filter_map(|s| Path::new(s).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .collect()
}

/// The generation a sibling entry belongs to: `<gen dir>` itself, `.<gen dir>.partial` (its staging) or
/// `.<gen dir>.lock`.
fn generation_of_entry(name: &str) -> String {
    name.strip_prefix('.')
        .and_then(|n| {
            n.strip_suffix(files::STAGING_SUFFIX)
                .or_else(|| n.strip_suffix(flexinfer_fsutil::LOCK_SUFFIX))
        })
        .unwrap_or(name)
        .to_string()
}

/// Removes the entry `e` of the generation `gen_dir` while holding that generation's writer lock; `None` when a
/// live writer holds it (its directory is kept). The lock file the probe itself holds is left for
/// [`remove_orphan_locks`].
fn remove_unless_written(
    e: &std::fs::DirEntry,
    gen_dir: &Path,
    node: &str,
) -> Option<std::io::Result<()>> {
    let probe = LockHolder {
        owner: "garbage-collection".into(),
        node: node.to_string(),
        ..Default::default()
    };
    let lock = WriterLock::acquire(gen_dir, probe, HEARTBEAT, STALE_AFTER).ok()?;
    let p = e.path();
    let res = match e.file_type() {
        Ok(t) if t.is_dir() => std::fs::remove_dir_all(&p),
        Ok(_) if p == lock.path() => Ok(()),
        Ok(_) => std::fs::remove_file(&p),
        Err(err) => Err(err),
    };
    drop(lock);
    Some(res)
}

/// Lock files (including the garbage collection's probes') of the generations that are gone, with no
/// staging directory left either.
fn remove_orphan_locks(targets: Vec<PathBuf>) {
    for gen_dir in targets {
        let lock = flexinfer_fsutil::lock_path(&gen_dir);
        let staging = gen_dir.with_file_name(format!(
            ".{}{}",
            gen_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            files::STAGING_SUFFIX
        ));
        if lock.is_file() && !gen_dir.exists() && !staging.exists() {
            let _ = std::fs::remove_file(lock);
        }
    }
}

/// Removes the files a download made before generations existed left in `root` (exactly those its
/// `.source-integrity.json` names, then its markers), and the directories that leaves empty. The caller
/// holds `root`'s writer lock. Returns how many files went, or `None` when there is no such download.
fn collect_legacy_download(root: &Path, events: &Events) -> Option<usize> {
    if !root.join(files::DOWNLOAD_COMPLETE).is_file() {
        return None;
    }
    let text = std::fs::read_to_string(root.join(files::SOURCE_INTEGRITY)).ok()?;
    let integrity: flexinfer_contract::SourceIntegrity = serde_json::from_str(&text).ok()?;
    // The completion marker goes first: an interrupted collection never leaves a download that looks
    // complete with files missing.
    if let Err(e) = std::fs::remove_file(root.join(files::DOWNLOAD_COMPLETE)) {
        events.log(&format!(
            "garbage collection: cannot retire the download in {}: {e}",
            root.display()
        ));
        return None;
    }
    let _ = flexinfer_fsutil::fsync_dir(root);
    let mut n = 0usize;
    let mut parents = Vec::new();
    for f in &integrity.files {
        if flexinfer_contract::check_relative_path(&f.name).is_err()
            || files::is_reserved_path(&f.name).is_some()
        {
            continue;
        }
        let p = root.join(&f.name);
        // Only regular files (a symlink is removed as a link, never followed).
        let is_file = std::fs::symlink_metadata(&p).is_ok_and(|m| !m.is_dir());
        if is_file && std::fs::remove_file(&p).is_ok() {
            n = n.saturating_add(1);
            if let Some(parent) = p.parent().filter(|d| *d != root) {
                parents.push(parent.to_path_buf());
            }
        }
    }
    // Deepest first; `remove_dir` only removes empty directories.
    parents.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    parents.dedup();
    for d in parents {
        let mut cur = Some(d.as_path());
        while let Some(c) = cur.filter(|c| c.starts_with(root) && *c != root) {
            if std::fs::remove_dir(c).is_err() {
                break;
            }
            cur = c.parent();
        }
    }
    let _ = std::fs::remove_file(root.join(files::SOURCE_INTEGRITY));
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_collection_keeps_what_is_named_and_what_is_written() {
        let d = tempfile::tempdir().expect("tmp");
        let p = d.path();
        for n in [
            "gptq-w4-g128",
            "gptq-w4-g128.aaaa-1",
            "gptq-w4-g128.bbbb-2",
            "gptq-w8-g128.cccc-3",
            "gptq-w4-g128.dddd-4",
            "abliterated.eeee-5",
            ".gptq-w4-g128.ffff-6.partial",
        ] {
            std::fs::create_dir_all(p.join(n)).expect("mkdir");
        }
        std::fs::write(p.join("config.json"), "{}").expect("write");
        let ev = Events::new("quantization");
        // A live writer of one generation.
        let live = WriterLock::acquire(
            &p.join("gptq-w4-g128.bbbb-2"),
            LockHolder {
                owner: "other-job".into(),
                ..Default::default()
            },
            HEARTBEAT,
            STALE_AFTER,
        )
        .expect("lock");
        let out = p.join("gptq-w4-g128.dddd-4");
        // No keep list: nothing goes.
        assert!(collect_garbage(&out, None, &ev).is_empty());
        let removed = collect_garbage(
            &out,
            Some("m/gptq-w4-g128.aaaa-1,m/gptq-w4-g128.dddd-4"),
            &ev,
        );
        let exists = |n: &str| p.join(n).exists();
        assert!(exists("gptq-w4-g128.dddd-4"), "its own output");
        assert!(exists("gptq-w4-g128.aaaa-1"), "named in the keep list");
        assert!(exists("gptq-w4-g128.bbbb-2"), "held by a live writer");
        assert!(exists("abliterated.eeee-5"), "another family");
        assert!(exists("config.json"));
        assert!(
            !exists("gptq-w4-g128"),
            "a legacy output not kept: {removed:?}"
        );
        assert!(!exists("gptq-w8-g128.cccc-3"), "an older quant type");
        assert!(
            !exists(".gptq-w4-g128.ffff-6.partial"),
            "a stale staging dir"
        );
        assert!(!exists(".gptq-w8-g128.cccc-3.lock") && !exists(".gptq-w4-g128.ffff-6.lock"));
        drop(live);
    }

    #[test]
    fn a_fresh_writer_on_another_node_keeps_its_generation_without_a_shared_flock() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("m");
        for n in ["gptq-w4-g128.aaaa-1", "gptq-w4-g128.bbbb-2"] {
            std::fs::create_dir_all(p.join(n)).expect("mkdir");
        }
        // A writer on node-a whose flock this node cannot see (another node's kernel holds it): only
        // its record with a fresh heartbeat says it is alive.
        let record = serde_json::json!({"owner": "other-job", "node": "node-a",
            "heartbeatAt": jiff::Timestamp::now().to_string()});
        std::fs::write(p.join(".gptq-w4-g128.aaaa-1.lock"), record.to_string()).expect("write");
        let ev = Events::new("quantization");
        let out = p.join("gptq-w4-g128.bbbb-2");
        collect_garbage_on(&out, Some("m/gptq-w4-g128.bbbb-2"), "node-b", &ev);
        assert!(
            p.join("gptq-w4-g128.aaaa-1").exists(),
            "a live writer's generation was removed"
        );
        // The same record from this node (a dead writer here: its flock would be held) does not keep it.
        let mine = serde_json::json!({"owner": "other-job", "node": "node-b",
            "heartbeatAt": jiff::Timestamp::now().to_string()});
        std::fs::write(p.join(".gptq-w4-g128.aaaa-1.lock"), mine.to_string()).expect("write");
        collect_garbage_on(&out, Some("m/gptq-w4-g128.bbbb-2"), "node-b", &ev);
        assert!(!p.join("gptq-w4-g128.aaaa-1").exists());
    }
}
