//! Opening and reading files whose names or contents come from outside (a hub, a registry, a
//! model file): names stay inside their directory, only regular files are opened, and nothing is
//! read whole past a [`Limit`].
//!
//! How the check works (canonicalize + metadata, not `openat2`): `rel` must be relative and made of
//! plain components only (no `..`, no root, no NUL); `dir/rel` is canonicalized (every symlink
//! resolved) and must lie strictly below the canonical `dir`; the result must be a regular file by
//! `stat`; it is then opened with `O_NOFOLLOW | O_NONBLOCK` (a FIFO swapped in cannot block the
//! open) and checked again with `fstat` on the open descriptor. Symlinks that stay inside the
//! directory are followed. A writer racing the check could still swap a parent directory between
//! the canonicalize and the open; the directories these helpers guard are written by our own Jobs,
//! and the threat is the content of downloaded files, not a concurrent local attacker.

use std::fs::File;
use std::io::{BufRead, Read};
use std::path::{Component, Path, PathBuf};

/// Why an untrusted file was refused (a bad name, an escape, not a regular file, too large).
/// Carried inside the `io::Error` (kind `InvalidData`) so that callers can tell bad input from an
/// I/O failure with [`is_refused`].
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

fn refuse(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, Refused(msg))
}

/// True when `e` came from one of these checks (the input is bad), not from the file system.
pub fn is_refused(e: &std::io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Refused>())
}

/// The most bytes a kind of file may have when it is read whole; `what` names the kind in the error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub bytes: u64,
    pub what: &'static str,
}

impl Limit {
    pub const fn new(bytes: u64, what: &'static str) -> Self {
        Self { bytes, what }
    }
}

/// The limit of each kind of file read whole.
pub mod limits {
    use super::Limit;
    const MIB: u64 = 1 << 20;
    /// `config.json`, `generation_config.json`, `quantize_config.json`, our marker files.
    pub const CONFIG_JSON: Limit = Limit::new(16 * MIB, "JSON config file");
    /// `model.safetensors.index.json` (a weight map of a few hundred thousand tensors).
    pub const INDEX_JSON: Limit = Limit::new(64 * MIB, "safetensors index");
    /// `tokenizer.json`, `tokenizer_config.json`, chat templates and the other files copied as-is.
    pub const TOKENIZER: Limit = Limit::new(256 * MIB, "tokenizer file");
    /// The JSON header of a `.safetensors` file (the same bound as the safetensors crate).
    pub const SAFETENSORS_HEADER: Limit = Limit::new(100_000_000, "safetensors header");
    /// A prompt or calibration dataset read whole (plain text, a JSON array, CSV).
    pub const DATASET: Limit = Limit::new(1024 * MIB, "dataset file");
    /// One line of a JSON-lines dataset.
    pub const JSON_LINE: Limit = Limit::new(16 * MIB, "JSON line");
    /// A dockerconfigjson file.
    pub const DOCKER_CONFIG: Limit = Limit::new(4 * MIB, "docker config");
}

/// Checks `rel` without touching the disk: relative, not empty, plain components only (`.` is
/// allowed, `..`, a root or a prefix are not), no NUL byte.
pub fn check_relative(rel: &Path) -> std::io::Result<()> {
    let shown = rel.display();
    if rel.as_os_str().is_empty() {
        return Err(refuse("empty file name".into()));
    }
    if rel.as_os_str().as_encoded_bytes().contains(&0) {
        return Err(refuse(format!("file name {shown:?} contains a NUL byte")));
    }
    let mut normal = 0usize;
    for c in rel.components() {
        match c {
            Component::Normal(_) => normal = normal.saturating_add(1),
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(refuse(format!("file name {shown:?} contains '..'")));
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(refuse(format!("file name {shown:?} is absolute")));
            }
        }
    }
    if normal == 0 {
        return Err(refuse(format!("file name {shown:?} names no file")));
    }
    Ok(())
}

/// The canonical path of `dir/rel` after checking that it stays strictly inside `dir` (symlinks
/// resolved) and is a regular file. See the module doc for the method.
pub fn resolve_within(dir: &Path, rel: impl AsRef<Path>) -> std::io::Result<PathBuf> {
    let rel = rel.as_ref();
    check_relative(rel)?;
    let root = dir
        .canonicalize()
        .map_err(|e| std::io::Error::new(e.kind(), format!("directory {}: {e}", dir.display())))?;
    let target = root.join(rel).canonicalize().map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("{} in {}: {e}", rel.display(), dir.display()),
        )
    })?;
    if target == root || !target.starts_with(&root) {
        return Err(refuse(format!(
            "{} resolves to {}, outside {}",
            rel.display(),
            target.display(),
            dir.display()
        )));
    }
    let meta = std::fs::metadata(&target).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("{} in {}: {e}", rel.display(), dir.display()),
        )
    })?;
    if !meta.file_type().is_file() {
        return Err(refuse(format!(
            "{} in {} is not a regular file ({})",
            rel.display(),
            dir.display(),
            kind_of(&meta.file_type())
        )));
    }
    Ok(target)
}

/// Opens `dir/rel` for reading after [`resolve_within`]'s checks; the open does not follow a
/// symlink swapped in afterwards, does not block on a FIFO, and is re-checked with `fstat`.
pub fn open_regular_within(dir: &Path, rel: impl AsRef<Path>) -> std::io::Result<File> {
    let rel = rel.as_ref();
    let target = resolve_within(dir, rel)?;
    open_checked(
        &target,
        &format!("{} in {}", rel.display(), dir.display()),
        true,
    )
}

/// Opens `path` for reading if it is a regular file (symlinks followed, FIFOs and devices refused
/// without blocking). For paths the user named (a dataset file), not names from a downloaded file.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let meta = std::fs::metadata(path)?;
    if !meta.file_type().is_file() {
        return Err(refuse(format!(
            "{} is not a regular file ({})",
            path.display(),
            kind_of(&meta.file_type())
        )));
    }
    open_checked(path, &path.display().to_string(), false)
}

fn open_checked(path: &Path, shown: &str, no_follow: bool) -> std::io::Result<File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        let follow = if no_follow { libc::O_NOFOLLOW } else { 0 };
        opts.custom_flags(libc::O_NONBLOCK | follow);
    }
    #[cfg(not(unix))]
    let _ = no_follow;
    let file = opts.open(path).map_err(|e| {
        #[cfg(unix)]
        if e.raw_os_error() == Some(libc::ELOOP) {
            return refuse(format!("{shown} became a symlink while it was opened"));
        }
        std::io::Error::new(e.kind(), format!("{shown}: {e}"))
    })?;
    let ft = file.metadata()?.file_type();
    if !ft.is_file() {
        return Err(refuse(format!(
            "{shown} is not a regular file ({})",
            kind_of(&ft)
        )));
    }
    Ok(file)
}

fn kind_of(ft: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a FIFO";
        }
        if ft.is_block_device() || ft.is_char_device() {
            return "a device";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    if ft.is_dir() {
        "a directory"
    } else if ft.is_symlink() {
        "a symlink"
    } else {
        "not a file"
    }
}

/// Reads all of `r`, refusing more than `limit` bytes; `name` names the file in the error.
pub fn read_limited(r: impl Read, limit: Limit, name: &str) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    r.take(limit.bytes.saturating_add(1))
        .read_to_end(&mut buf)?;
    if buf.len() as u64 > limit.bytes {
        return Err(too_large(name, None, limit));
    }
    Ok(buf)
}

fn too_large(name: &str, size: Option<u64>, limit: Limit) -> std::io::Error {
    let size = size.map_or_else(|| "more than".to_string(), |s| format!("{s} bytes,"));
    refuse(format!(
        "{name} is {size} over the {} bytes allowed for a {}",
        limit.bytes, limit.what
    ))
}

fn read_open(file: File, limit: Limit, name: &str) -> std::io::Result<Vec<u8>> {
    let len = file.metadata()?.len();
    if len > limit.bytes {
        return Err(too_large(name, Some(len), limit));
    }
    read_limited(file, limit, name)
}

/// `dir/rel` whole, after [`open_regular_within`]'s checks and within `limit`.
pub fn read_within(dir: &Path, rel: impl AsRef<Path>, limit: Limit) -> std::io::Result<Vec<u8>> {
    let rel = rel.as_ref();
    let file = open_regular_within(dir, rel)?;
    read_open(
        file,
        limit,
        &format!("{} in {}", rel.display(), dir.display()),
    )
}

/// [`read_within`] as UTF-8 text.
pub fn read_string_within(
    dir: &Path,
    rel: impl AsRef<Path>,
    limit: Limit,
) -> std::io::Result<String> {
    let rel = rel.as_ref();
    let bytes = read_within(dir, rel, limit)?;
    String::from_utf8(bytes).map_err(|_| {
        refuse(format!(
            "{} in {} is not UTF-8 text",
            rel.display(),
            dir.display()
        ))
    })
}

/// `path` whole, after [`open_regular`]'s checks and within `limit`.
pub fn read_regular(path: &Path, limit: Limit) -> std::io::Result<Vec<u8>> {
    read_open(open_regular(path)?, limit, &path.display().to_string())
}

/// One line of `r` into `buf` (cleared first, the newline kept), refusing a line longer than
/// `limit`; returns the bytes read (0 at the end). `name` and `line` (1-based) name it in errors.
pub fn read_line_limited(
    r: &mut impl BufRead,
    buf: &mut String,
    limit: Limit,
    name: &str,
    line: usize,
) -> std::io::Result<usize> {
    buf.clear();
    let n = r.take(limit.bytes.saturating_add(1)).read_line(buf)?;
    if n as u64 > limit.bytes && !buf.ends_with('\n') {
        return Err(refuse(format!(
            "{name} line {line} is longer than the {} bytes allowed for a {}",
            limit.bytes, limit.what
        )));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: Limit = Limit {
        bytes: 8,
        what: "test file",
    };

    #[test]
    fn names_must_be_plain_and_relative() {
        for ok in ["a", "a/b.json", "./a", "a/./b"] {
            assert!(check_relative(Path::new(ok)).is_ok(), "{ok}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../b", "a/..", ".", "a\0b"] {
            let e = check_relative(Path::new(bad)).expect_err(bad);
            assert!(is_refused(&e), "{bad}: {e}");
        }
    }

    #[test]
    fn files_stay_inside_their_directory() {
        let d = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        let model = d.path().join("model");
        std::fs::create_dir_all(model.join("sub")).expect("mkdir");
        std::fs::write(model.join("sub/w.safetensors"), b"x").expect("write");
        std::fs::write(outside.path().join("secret"), b"s").expect("write");
        std::os::unix::fs::symlink(outside.path().join("secret"), model.join("escape"))
            .expect("symlink");
        std::os::unix::fs::symlink("sub/w.safetensors", model.join("inside")).expect("symlink");
        std::os::unix::fs::symlink("/dev/null", model.join("dev")).expect("symlink");
        let fifo = model.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("cstring");
        // SAFETY: a valid NUL-terminated path; mkfifo has no other preconditions.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);

        assert!(open_regular_within(&model, "sub/w.safetensors").is_ok());
        assert!(
            open_regular_within(&model, "inside").is_ok(),
            "a symlink inside is fine"
        );
        for (rel, want) in [
            ("escape", "outside"),
            ("../model/sub/w.safetensors", "'..'"),
            ("sub", "a directory"),
            ("fifo", "a FIFO"),
            ("dev", "outside"),
        ] {
            let e = open_regular_within(&model, rel).expect_err(rel);
            assert!(is_refused(&e), "{rel}: {e}");
            let msg = e.to_string();
            assert!(msg.contains(want) && msg.contains(rel), "{rel}: {msg}");
        }
        let abs = outside.path().join("secret");
        assert!(is_refused(
            &open_regular_within(&model, &abs).expect_err("absolute")
        ));
        let missing = open_regular_within(&model, "nope").expect_err("missing");
        assert!(!is_refused(&missing) && missing.to_string().contains("nope"));
        // A FIFO named by the user is refused without blocking too.
        assert!(is_refused(&open_regular(&fifo).expect_err("fifo")));
    }

    #[test]
    fn reads_are_bounded() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(d.path().join("small"), b"12345678").expect("write");
        std::fs::write(d.path().join("big"), b"123456789").expect("write");
        assert_eq!(
            read_within(d.path(), "small", TINY).expect("small"),
            b"12345678"
        );
        let e = read_within(d.path(), "big", TINY).expect_err("big");
        assert!(is_refused(&e));
        assert!(
            e.to_string().contains("9 bytes") && e.to_string().contains("test file"),
            "{e}"
        );
        let e = read_limited(&b"123456789"[..], TINY, "stream").expect_err("stream");
        assert!(e.to_string().contains("stream"), "{e}");
        assert!(is_refused(
            &read_regular(&d.path().join("big"), TINY).expect_err("big")
        ));
    }

    #[test]
    fn lines_are_bounded() {
        let mut r = std::io::Cursor::new(b"1234567\n123456789\n".to_vec());
        let mut buf = String::new();
        assert_eq!(
            read_line_limited(&mut r, &mut buf, TINY, "x.jsonl", 1).expect("l1"),
            8
        );
        assert_eq!(buf, "1234567\n");
        let e = read_line_limited(&mut r, &mut buf, TINY, "x.jsonl", 2).expect_err("l2");
        assert!(e.to_string().contains("x.jsonl line 2"), "{e}");
        let mut r = std::io::Cursor::new(b"12345678".to_vec());
        assert_eq!(
            read_line_limited(&mut r, &mut buf, TINY, "x", 1).expect("eof"),
            8
        );
        assert_eq!(
            read_line_limited(&mut r, &mut buf, TINY, "x", 2).expect("end"),
            0
        );
    }
}
