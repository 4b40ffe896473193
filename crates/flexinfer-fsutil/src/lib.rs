//! File helpers shared by the engine, the worker and the CLI. Each returns `std::io::Result`; the
//! callers put the path into their own error type.

use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::Path;

/// sha256 (lower-case hex) of a whole file, read in 1 MiB chunks. Blocking.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// sha256 (lower-case hex) of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Writes `bytes` to `path` atomically: a temp file in the same directory (created if missing),
/// fsync, rename. A reader sees the old content or the new one, never a part.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
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
