//! Durable directory swaps: a complete directory replaces another without a moment in which the
//! destination is missing or half-written.

use std::io;
use std::path::Path;

/// fsync of a directory: makes the creations, renames and removals in it survive a crash.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Puts the complete directory `staging` at `dest`. When `dest` is absent this is one rename; when it
/// exists the two are exchanged atomically (`renameat2(RENAME_EXCHANGE)`), so `dest` names a complete
/// directory at every instant, and the old content (now at `staging`) is removed afterwards. Where the
/// filesystem cannot exchange (EINVAL/ENOSYS/EOPNOTSUPP), the old directory is renamed aside first, which
/// leaves a short window without `dest`. The parent is fsynced either way.
pub fn replace_dir(staging: &Path, dest: &Path) -> io::Result<()> {
    let parent = dest.parent().unwrap_or_else(|| Path::new("."));
    std::fs::create_dir_all(parent)?;
    match std::fs::symlink_metadata(dest) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::rename(staging, dest)?;
            return fsync_dir(parent);
        }
        Err(e) => return Err(e),
        Ok(_) => {}
    }
    let cwd = rustix::fs::CWD;
    match rustix::fs::renameat_with(cwd, staging, cwd, dest, rustix::fs::RenameFlags::EXCHANGE) {
        Ok(()) => {
            fsync_dir(parent)?;
            // `staging` now holds the previous content.
            std::fs::remove_dir_all(staging)?;
            fsync_dir(parent)
        }
        Err(e)
            if e == rustix::io::Errno::INVAL
                || e == rustix::io::Errno::NOSYS
                || e == rustix::io::Errno::OPNOTSUPP =>
        {
            let name = dest
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let aside = dest.with_file_name(format!(".{name}.replaced"));
            if std::fs::symlink_metadata(&aside).is_ok() {
                std::fs::remove_dir_all(&aside)?;
            }
            std::fs::rename(dest, &aside)?;
            std::fs::rename(staging, dest)?;
            fsync_dir(parent)?;
            std::fs::remove_dir_all(&aside)?;
            fsync_dir(parent)
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replace_into_absent_and_over_existing() {
        let d = tempfile::tempdir().expect("tempdir");
        let dest = d.path().join("out");
        let st = d.path().join(".out.partial");
        std::fs::create_dir(&st).expect("mkdir");
        std::fs::write(st.join("a"), b"1").expect("write");
        replace_dir(&st, &dest).expect("first");
        assert_eq!(std::fs::read(dest.join("a")).expect("read"), b"1");
        assert!(!st.exists());
        std::fs::create_dir(&st).expect("mkdir");
        std::fs::write(st.join("b"), b"2").expect("write");
        replace_dir(&st, &dest).expect("second");
        assert_eq!(std::fs::read(dest.join("b")).expect("read"), b"2");
        assert!(!dest.join("a").exists(), "old content replaced");
        assert!(!st.exists(), "old content removed");
    }
}
