//! One writer per directory. A pipeline Job holds an exclusive `flock` on `.<dir>.lock` (beside the
//! directory, which may itself be renamed into place) for as long as it writes; the kernel drops the lock
//! when the process dies, however it dies. The file also records who holds it, on which node, and a
//! heartbeat, so that on filesystems whose locks are not shared between nodes a writer on another node
//! still sees a live holder. On one node the flock alone decides (a killed writer's fresh heartbeat does
//! not block its replacement). The file is removed when the lock is released.

use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Suffix of the lock file beside a written directory: `.<dir>.lock` (hidden, so listings of model files
/// skip it).
pub const LOCK_SUFFIX: &str = ".lock";

/// Who holds a directory (the lock file's content).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LockHolder {
    /// The Job's UID (or another id of the writer); a writer with the same id may take over.
    pub owner: String,
    #[serde(default)]
    pub pod: String,
    /// The node the writer runs on (empty: unknown, the flock alone decides).
    #[serde(default)]
    pub node: String,
    #[serde(default)]
    pub pid: u32,
    #[serde(default)]
    pub acquired_at: String,
    /// Refreshed every heartbeat interval while the lock is held.
    #[serde(default)]
    pub heartbeat_at: String,
}

/// A held lock; released on drop (and by the kernel when the process dies).
#[derive(Debug)]
pub struct WriterLock {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    heartbeat: Option<std::thread::JoinHandle<()>>,
    // Keeps the flock.
    _file: Arc<std::fs::File>,
}

/// The lock file of `dir`: `.<name>.lock` beside it.
pub fn lock_path(dir: &Path) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dir.with_file_name(format!(".{name}{LOCK_SUFFIX}"))
}

fn read_holder(f: &mut std::fs::File) -> Option<LockHolder> {
    let mut text = String::new();
    f.seek(io::SeekFrom::Start(0)).ok()?;
    f.take(64 << 10).read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

fn write_holder(f: &std::fs::File, h: &LockHolder) -> io::Result<()> {
    let body = serde_json::to_vec(h).map_err(io::Error::other)?;
    let mut f = f;
    f.set_len(0)?;
    f.seek(io::SeekFrom::Start(0))?;
    f.write_all(&body)?;
    f.sync_data()
}

/// The error of a directory another writer holds: who (from the lock file, when readable) and why.
fn busy(dir: &Path, h: Option<LockHolder>, why: &str) -> io::Error {
    let who = h
        .map(|h| {
            format!(
                "owner {} (pod {}, pid {}, heartbeat {})",
                h.owner, h.pod, h.pid, h.heartbeat_at
            )
        })
        .unwrap_or_else(|| "an unknown process".into());
    io::Error::new(
        io::ErrorKind::WouldBlock,
        format!("{} is being written by {who}: {why}", dir.display()),
    )
}

/// Why [`flock_current`] did not get the lock.
enum Flock {
    /// Another process holds the flock (its file, to read the holder from).
    Held(File),
    Io(io::Error),
}

/// The lock file at `path`, created if missing, with its exclusive flock taken. The file is unlinked by the
/// holder on release: a lock taken on an inode that is no longer at `path` is retried on the new file (up to
/// eight times).
fn flock_current(path: &Path) -> Result<File, Flock> {
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(Flock::Io)
    };
    let mut file = open()?;
    let mut attempts: u32 = 0;
    loop {
        if let Err(e) =
            rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        {
            if e == rustix::io::Errno::WOULDBLOCK {
                return Err(Flock::Held(file));
            }
            return Err(Flock::Io(e.into()));
        }
        use std::os::unix::fs::MetadataExt;
        let same = std::fs::metadata(path)
            .map(|m| m.ino() == file.metadata().map(|f| f.ino()).unwrap_or(0))
            .unwrap_or(false);
        attempts = attempts.saturating_add(1);
        if same || attempts > 8 {
            return Ok(file);
        }
        file = open()?;
    }
}

/// How far ahead of this node's clock another node's clock may be: a heartbeat up to this far in the
/// future reads as fresh (just written by a node whose clock is ahead). One further ahead is no plausible
/// heartbeat and reads as stale, so a record from a badly wrong clock cannot block a directory forever.
/// Nodes whose clocks disagree by more than this can both take a directory (docs/dev/architecture.md).
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(300);

/// Whether a heartbeat written at `heartbeat` is fresh at `now`: younger than `stale_after`, or ahead of
/// `now` by at most [`MAX_CLOCK_SKEW`].
fn heartbeat_is_fresh(
    heartbeat: jiff::Timestamp,
    now: jiff::Timestamp,
    stale_after: Duration,
) -> bool {
    let age = now.duration_since(heartbeat);
    if age.is_negative() {
        return age
            .checked_neg()
            .and_then(|ahead| Duration::try_from(ahead).ok())
            .is_some_and(|ahead| ahead <= MAX_CLOCK_SKEW);
    }
    Duration::try_from(age).is_ok_and(|age| age < stale_after)
}

/// Whether the previous holder recorded in the lock file is a live writer on another node: another owner,
/// a fresh heartbeat ([`heartbeat_is_fresh`]), and both nodes known and different. (On one node the
/// flock alone decides.)
fn live_elsewhere(prev: &LockHolder, holder: &LockHolder, stale_after: Duration) -> bool {
    let fresh = prev
        .heartbeat_at
        .parse::<jiff::Timestamp>()
        .is_ok_and(|t| heartbeat_is_fresh(t, jiff::Timestamp::now(), stale_after));
    let other_node = !prev.node.is_empty() && !holder.node.is_empty() && prev.node != holder.node;
    prev.owner != holder.owner && !prev.owner.is_empty() && fresh && other_node
}

/// The thread that rewrites the holder's heartbeat every `heartbeat` until `stop` is set.
fn spawn_heartbeat(
    file: Arc<File>,
    stop: Arc<AtomicBool>,
    mut holder: LockHolder,
    heartbeat: Duration,
) -> io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("writer-lock-heartbeat".into())
        .spawn(move || {
            let step = Duration::from_millis(200).min(heartbeat);
            let mut waited = Duration::ZERO;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(step);
                waited = waited.saturating_add(step);
                if waited >= heartbeat {
                    waited = Duration::ZERO;
                    holder.heartbeat_at = crate::now_rfc3339();
                    let _ = write_holder(&file, &holder);
                }
            }
        })
}

impl WriterLock {
    /// Takes the lock of `dir` for `holder`. Fails with `WouldBlock` naming the live holder when another
    /// process holds the flock, or when the file names another owner whose heartbeat is younger than
    /// `stale_after`. The heartbeat is refreshed every `heartbeat` until the lock is dropped.
    pub fn acquire(
        dir: &Path,
        mut holder: LockHolder,
        heartbeat: Duration,
        stale_after: Duration,
    ) -> io::Result<WriterLock> {
        let path = lock_path(dir);
        if let Some(p) = path.parent() {
            std::fs::create_dir_all(p)?;
        }
        let mut file = flock_current(&path).map_err(|e| match e {
            Flock::Held(mut file) => busy(dir, read_holder(&mut file), "its lock is held"),
            Flock::Io(e) => e,
        })?;
        if let Some(prev) = read_holder(&mut file) {
            if live_elsewhere(&prev, &holder, stale_after) {
                return Err(busy(
                    dir,
                    Some(prev),
                    "its heartbeat is fresh (a writer on another node?)",
                ));
            }
        }
        let now = crate::now_rfc3339();
        holder.pid = std::process::id();
        holder.acquired_at = now.clone();
        holder.heartbeat_at = now;
        write_holder(&file, &holder)?;
        let file = Arc::new(file);
        let stop = Arc::new(AtomicBool::new(false));
        let beat = spawn_heartbeat(file.clone(), stop.clone(), holder, heartbeat)?;
        Ok(WriterLock {
            path,
            stop,
            heartbeat: Some(beat),
            _file: file,
        })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for WriterLock {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.heartbeat.take() {
            let _ = h.join();
        }
        // Unlinked while still locked: an acquirer that opened the old inode notices and retries.
        let _ = std::fs::remove_file(&self.path);
        let mut f: &std::fs::File = &self._file;
        let _ = f.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(owner: &str) -> LockHolder {
        LockHolder {
            owner: owner.into(),
            pod: "p".into(),
            node: "node-a".into(),
            ..Default::default()
        }
    }

    #[test]
    fn second_writer_is_refused_until_the_first_drops() {
        let d = tempfile::tempdir().expect("tempdir");
        let dir = d.path().join("out");
        let long = Duration::from_secs(60);
        let a = WriterLock::acquire(&dir, holder("job-a"), long, long).expect("first");
        // Another open file description: flock conflicts even inside one process.
        let e = WriterLock::acquire(&dir, holder("job-b"), long, long).expect_err("second");
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert!(e.to_string().contains("job-a"), "{e}");
        drop(a);
        let b = WriterLock::acquire(&dir, holder("job-b"), long, long).expect("after release");
        assert_eq!(b.path(), d.path().join(".out.lock"));
    }

    #[test]
    fn a_fresh_heartbeat_of_another_owner_refuses_without_flock() {
        let d = tempfile::tempdir().expect("tempdir");
        let dir = d.path().join("out");
        // A record as a writer on another node (whose flock we cannot see) leaves it.
        let rec = LockHolder {
            owner: "job-remote".into(),
            node: "node-b".into(),
            heartbeat_at: crate::now_rfc3339(),
            ..Default::default()
        };
        std::fs::write(lock_path(&dir), serde_json::to_vec(&rec).expect("json")).expect("write");
        let long = Duration::from_secs(60);
        let e = WriterLock::acquire(&dir, holder("job-b"), long, long).expect_err("refused");
        assert!(e.to_string().contains("job-remote"), "{e}");
        // On the same node the flock decides: a killed writer's fresh record does not block.
        let local = LockHolder {
            node: "node-b".into(),
            ..holder("job-c")
        };
        drop(WriterLock::acquire(&dir, local, long, long).expect("same node, no flock"));
        std::fs::write(lock_path(&dir), serde_json::to_vec(&rec).expect("json")).expect("write");
        // The same owner (a retry of that Job's pod) may take over; a stale record does not block.
        WriterLock::acquire(&dir, holder("job-remote"), long, long).expect("same owner");
        std::fs::write(lock_path(&dir), serde_json::to_vec(&rec).expect("json")).expect("write");
        WriterLock::acquire(&dir, holder("job-b"), long, Duration::ZERO).expect("stale record");
    }

    /// A record written by `owner` on `node-b` with a heartbeat `offset_s` seconds from now
    /// (positive: the writer's clock is ahead of ours).
    fn remote(offset_s: i64) -> LockHolder {
        let at = jiff::Timestamp::now()
            .checked_add(jiff::SignedDuration::from_secs(offset_s))
            .expect("timestamp");
        LockHolder {
            owner: "job-remote".into(),
            node: "node-b".into(),
            heartbeat_at: jiff::Timestamp::from_second(at.as_second())
                .expect("second")
                .to_string(),
            ..Default::default()
        }
    }

    #[test]
    fn a_heartbeat_from_a_clock_ahead_is_fresh_within_the_skew_allowance() {
        let stale_after = Duration::from_secs(120);
        let me = holder("job-b");
        // Table: heartbeat offset from our clock (s) → the remote writer is live.
        let skew = MAX_CLOCK_SKEW.as_secs() as i64;
        let cases = [
            (0, true),
            (-60, true),
            (-119, true),
            (-121, false),
            (30, true), // the writer's clock is 30 s ahead: its fresh heartbeat is "in the future"
            (skew - 2, true),
            (skew + 2, false), // further ahead than any allowed skew: not a plausible heartbeat
        ];
        for (offset, live) in cases {
            assert_eq!(
                live_elsewhere(&remote(offset), &me, stale_after),
                live,
                "heartbeat {offset:+} s"
            );
        }
        // End to end: a second node does not take a directory whose writer's clock is ahead.
        let d = tempfile::tempdir().expect("tempdir");
        let dir = d.path().join("out");
        std::fs::write(
            lock_path(&dir),
            serde_json::to_vec(&remote(30)).expect("json"),
        )
        .expect("write");
        let e = WriterLock::acquire(&dir, me, Duration::from_secs(60), stale_after)
            .expect_err("a live writer on node-b");
        assert!(e.to_string().contains("job-remote"), "{e}");
    }

    #[test]
    fn heartbeat_is_refreshed() {
        let d = tempfile::tempdir().expect("tempdir");
        let dir = d.path().join("out");
        let l = WriterLock::acquire(
            &dir,
            holder("job-a"),
            Duration::from_millis(1100),
            Duration::from_secs(60),
        )
        .expect("lock");
        let read = || -> LockHolder {
            serde_json::from_slice(&std::fs::read(l.path()).expect("read")).expect("json")
        };
        let first = read().heartbeat_at;
        std::thread::sleep(Duration::from_millis(2600));
        assert_ne!(read().heartbeat_at, first, "heartbeat moved on");
    }
}
