//! File helpers shared by the engine, the worker and the CLI. Each returns `std::io::Result`; the
//! callers put the path into their own error type.
//!
//! Untrusted files (docs/dev/architecture.md §8): every name taken from a downloaded file goes
//! through [`open_regular_within`] (or [`read_within`]), and every file read whole goes through a
//! [`Limit`].
// Integer overflow from user or model values must be an error or saturate, never wrap or panic.
#![deny(clippy::arithmetic_side_effects)]
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

mod lock;
mod replace;

pub use lock::{lock_path, LockHolder, WriterLock, LOCK_SUFFIX};
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
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    // The rename is durable only once the directory entry is.
    fsync_dir(dir)
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
