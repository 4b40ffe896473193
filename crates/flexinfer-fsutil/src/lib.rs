//! File helpers shared by the engine, the worker and the CLI. Each returns `std::io::Result`; the
//! callers put the path into their own error type.
//!
//! Untrusted files (docs/dev/architecture.md, "Untrusted input"): every name taken from a downloaded file goes
//! through [`open_regular_within`] (or [`read_within`]), and every file read whole goes through a
//! [`Limit`].
// Integer overflow from user or model values must be an error or saturate, never wrap or panic.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

mod lock;
mod replace;

pub use lock::{lock_path, LockHolder, WriterLock, LOCK_SUFFIX, MAX_CLOCK_SKEW};
pub use replace::{fsync_dir, replace_dir};

use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::Path;

mod untrusted;
pub use untrusted::{
    check_relative, is_refused, limits, open_regular, open_regular_within, read_limited,
    read_line_limited, read_regular, read_string_within, read_within, resolve_within, Limit,
    Refused,
};

/// sha256 (lower-case hex) of a whole file. Blocking.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut h = Sha256::new();
    hash_reader(std::fs::File::open(path)?, &mut h, 1 << 20, |_| Ok(()))?;
    Ok(hex::encode(h.finalize()))
}

/// Feeds everything `r` yields into `h`, `chunk` bytes at a time, and hands each chunk to
/// `each` (to copy or count it). Returns the bytes read. The one read-and-hash loop of the
/// workspace; any `Digest` (sha256, git's sha1) works.
pub fn hash_reader<D: Digest>(
    mut r: impl Read,
    h: &mut D,
    chunk: usize,
    mut each: impl FnMut(&[u8]) -> std::io::Result<()>,
) -> std::io::Result<u64> {
    let mut buf = vec![0u8; chunk.max(1)];
    let mut total = 0u64;
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            return Ok(total);
        }
        h.update(&buf[..n]);
        each(&buf[..n])?;
        total = total.saturating_add(n as u64);
    }
}

/// sha256 (lower-case hex) of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Writes `bytes` to `path` atomically: a temp file in the same directory (created if missing),
/// fsync, rename, fsync of the directory. A reader sees the old content or the new one, never a part.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp = temp_file_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    // The rename is durable only once the directory entry is.
    fsync_dir(dir)
}

/// The name prefix of the temporary files the workspace writes before a rename ([`write_atomic`],
/// [`temp_file_in`]). A kill between create and rename leaves one behind; [`is_write_leftover`] and
/// [`remove_write_leftovers`] are the one rule for recognising and removing them.
pub const WRITE_TMP_PREFIX: &str = ".tmp";

/// A temporary file in `dir` named with [`WRITE_TMP_PREFIX`], removed on drop unless persisted.
pub fn temp_file_in(dir: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    tempfile::Builder::new()
        .prefix(WRITE_TMP_PREFIX)
        .tempfile_in(dir)
}

/// Whether a directory entry named `name` is the temporary file of a write a kill interrupted.
pub fn is_write_leftover(name: &str) -> bool {
    name.starts_with(WRITE_TMP_PREFIX)
}

/// Removes the temporary files interrupted writes left directly in `dir` (not below it); returns how
/// many. A missing `dir` has none. Only regular files are removed.
pub fn remove_write_leftovers(dir: &Path) -> std::io::Result<usize> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut n = 0usize;
    for e in rd {
        let e = e?;
        if is_write_leftover(&e.file_name().to_string_lossy()) && e.file_type()?.is_file() {
            std::fs::remove_file(e.path())?;
            n = n.saturating_add(1);
        }
    }
    Ok(n)
}

/// The current time as RFC 3339 in UTC, whole seconds (`2026-01-01T00:00:00Z`).
pub fn now_rfc3339() -> String {
    let now = jiff::Timestamp::now();
    jiff::Timestamp::from_second(now.as_second())
        .unwrap_or(now)
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interrupted_write_leaves_a_file_that_remove_write_leftovers_removes() {
        let d = tempfile::tempdir().expect("tempdir");
        write_atomic(&d.path().join("kept.json"), b"{}").expect("write");
        // What a kill between create and rename leaves: the temporary file, kept.
        let (_, left) = temp_file_in(d.path()).expect("tmp").keep().expect("keep");
        assert!(is_write_leftover(
            &left.file_name().expect("name").to_string_lossy()
        ));
        std::fs::create_dir(d.path().join(".tmpdir")).expect("dir");
        assert_eq!(remove_write_leftovers(d.path()).expect("remove"), 1);
        assert!(!left.exists());
        assert!(d.path().join("kept.json").is_file());
        assert!(d.path().join(".tmpdir").is_dir(), "only regular files go");
        assert_eq!(
            remove_write_leftovers(&d.path().join("absent")).expect("absent"),
            0
        );
    }

    #[test]
    fn sha256_of_a_file_and_of_bytes_agree() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("a/b.bin");
        write_atomic(&p, b"abc").expect("write");
        assert_eq!(
            sha256_file(&p).expect("hash"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(sha256_hex(b"abc"), sha256_file(&p).expect("hash"));
        write_atomic(&p, b"new").expect("overwrite");
        assert_eq!(std::fs::read(&p).expect("read"), b"new");
        assert!(sha256_file(&d.path().join("missing")).is_err());
    }

    #[test]
    fn timestamps_are_whole_seconds_in_utc() {
        let t = now_rfc3339();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.ends_with('Z') && t.as_bytes()[10] == b'T', "{t}");
        assert!(t.parse::<jiff::Timestamp>().is_ok(), "{t}");
    }
}
