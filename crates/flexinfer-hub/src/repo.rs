//! What the hub serves: repositories (models and datasets), their revisions and files, described
//! from directories on disk as the hub would list them.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use sha2::Sha256;

/// Files at least this large are LFS files (as are `*.safetensors` of any size).
pub const LFS_MIN_SIZE: u64 = 1 << 20;

/// One served file.
#[derive(Clone, Debug)]
pub struct ServedFile {
    /// The path inside the repository (`/`-separated).
    pub path: String,
    /// Where its bytes are read from.
    pub disk: PathBuf,
    pub size: u64,
    pub sha256: String,
    /// Listed with an `lfs` object (its sha256); otherwise only its git blob id.
    pub lfs: bool,
    /// The git blob id (`sha1("blob <size>\0" + bytes)`).
    pub git_sha1: String,
}

impl ServedFile {
    /// The ETag the hub sends for the file: the sha256 of an LFS file, the git blob id otherwise.
    pub fn etag(&self) -> &str {
        if self.lfs {
            &self.sha256
        } else {
            &self.git_sha1
        }
    }
}

/// `models` or `datasets`, as the API paths name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Model,
    Dataset,
}

impl Kind {
    pub const ALL: [Kind; 2] = [Kind::Model, Kind::Dataset];

    /// The API path segment and the directory under a hub root: `models`, `datasets`.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Model => "models",
            Kind::Dataset => "datasets",
        }
    }

    pub fn from_plural(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.plural() == s)
    }
}

/// A repository: its kind and id (`org/name` or `name`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RepoId {
    pub kind: Kind,
    pub id: String,
}

impl RepoId {
    pub fn model(id: &str) -> RepoId {
        RepoId {
            kind: Kind::Model,
            id: id.to_string(),
        }
    }
    pub fn dataset(id: &str) -> RepoId {
        RepoId {
            kind: Kind::Dataset,
            id: id.to_string(),
        }
    }
}

/// The files of one revision and its commit id.
#[derive(Clone, Debug)]
pub struct Revision {
    /// Derived from the content ([`commit_id`]): changed files make a new commit.
    pub commit: String,
    /// Sorted by path.
    pub files: Vec<ServedFile>,
}

impl Revision {
    pub fn new(mut files: Vec<ServedFile>) -> Revision {
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Revision {
            commit: commit_id(&files),
            files,
        }
    }

    pub fn file(&self, path: &str) -> Option<&ServedFile> {
        self.files.iter().find(|f| f.path == path)
    }
}

/// One repository's revisions by name.
#[derive(Clone, Debug, Default)]
pub struct Repo {
    pub revisions: BTreeMap<String, Revision>,
    /// Every revision name that is not one of `revisions` (nor a commit id of one) resolves to the
    /// default revision ([`Repo::default_revision`]), as a repository served from a directory has
    /// only its current files. When unset, an unknown revision is not found.
    pub any_revision: bool,
}

impl Repo {
    /// A repository with one revision, `main`, that every revision name resolves to.
    pub fn current(files: Vec<ServedFile>) -> Repo {
        Repo {
            revisions: BTreeMap::from([("main".to_string(), Revision::new(files))]),
            any_revision: true,
        }
    }

    /// `main`, else the first revision by name.
    pub fn default_revision(&self) -> Option<&Revision> {
        self.revisions
            .get("main")
            .or_else(|| self.revisions.values().next())
    }

    /// The revision a name (a revision name or a commit id) refers to.
    pub fn revision(&self, name: &str) -> Option<&Revision> {
        self.revisions
            .get(name)
            .or_else(|| self.revisions.values().find(|r| r.commit == name))
            .or_else(|| {
                if self.any_revision {
                    self.default_revision()
                } else {
                    None
                }
            })
    }
}

/// The repositories a hub serves.
pub type Repos = BTreeMap<RepoId, Repo>;

/// The commit id of a set of files: the sha1 of every `path\0blob-id\n` line, in path order.
pub fn commit_id(files: &[ServedFile]) -> String {
    use sha1::Digest as _;
    let mut sorted: Vec<&ServedFile> = files.iter().collect();
    sorted.sort_by(|a, b| a.path.cmp(&b.path));
    let mut h = sha1::Sha1::new();
    for f in sorted {
        h.update(f.path.as_bytes());
        h.update(b"\0");
        h.update(f.git_sha1.as_bytes());
        h.update(b"\n");
    }
    hex::encode(h.finalize())
}

/// The sha256 and the git blob id of a file, in one read.
pub fn hash_file(path: &Path) -> io::Result<(u64, String, String)> {
    use sha1::Digest as _;
    let mut f = std::fs::File::open(path)?;
    let size = f.metadata()?.len();
    let mut sha256 = Sha256::new();
    let mut git = sha1::Sha1::new();
    git.update(format!("blob {size}\0").as_bytes());
    let mut buf = vec![0u8; 4 << 20];
    let mut read = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        sha256.update(&buf[..n]);
        git.update(&buf[..n]);
        read += n as u64;
    }
    if read != size {
        return Err(io::Error::other(format!(
            "{} changed while it was read ({size} bytes, then {read})",
            path.display()
        )));
    }
    Ok((
        size,
        hex::encode(sha256.finalize()),
        hex::encode(git.finalize()),
    ))
}

/// Describe the files under a directory as the hub would (`*.safetensors` and files of at least
/// [`LFS_MIN_SIZE`] are LFS), sorted by path. Symbolic links are followed.
pub fn describe(dir: &Path) -> io::Result<Vec<ServedFile>> {
    fn walk(root: &Path, d: &Path, out: &mut Vec<ServedFile>) -> io::Result<()> {
        for e in std::fs::read_dir(d)? {
            let disk = e?.path();
            if std::fs::metadata(&disk)?.is_dir() {
                walk(root, &disk, out)?;
                continue;
            }
            let rel = disk
                .strip_prefix(root)
                .map_err(io::Error::other)?
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            let (size, sha256, git_sha1) = hash_file(&disk)?;
            out.push(ServedFile {
                lfs: rel.ends_with(".safetensors") || size >= LFS_MIN_SIZE,
                sha256,
                git_sha1,
                disk,
                path: rel,
                size,
            });
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// Every repository under a hub root: `ROOT/models/<org>/<name>/…` and `ROOT/datasets/<org>/<name>/…`,
/// each with its current files ([`Repo::current`]).
pub fn load_root(root: &Path) -> io::Result<Repos> {
    let mut repos = Repos::new();
    for kind in Kind::ALL {
        let base = root.join(kind.plural());
        if !base.is_dir() {
            continue;
        }
        for org in sorted_dirs(&base)? {
            for name in sorted_dirs(&base.join(&org))? {
                let files = describe(&base.join(&org).join(&name))?;
                repos.insert(
                    RepoId {
                        kind,
                        id: format!("{org}/{name}"),
                    },
                    Repo::current(files),
                );
            }
        }
    }
    Ok(repos)
}

/// The names of the directories in `d`, sorted.
fn sorted_dirs(d: &Path) -> io::Result<Vec<String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d)? {
        let e = e?;
        if std::fs::metadata(e.path())?.is_dir() {
            out.push(e.file_name().to_string_lossy().to_string());
        }
    }
    out.sort();
    Ok(out)
}

/// The directories a recursive tree listing names besides the files: every parent of a file.
pub fn directories(files: &[ServedFile]) -> Vec<String> {
    let mut dirs = std::collections::BTreeSet::new();
    for f in files {
        let mut p = f.path.as_str();
        while let Some((parent, _)) = p.rsplit_once('/') {
            dirs.insert(parent.to_string());
            p = parent;
        }
    }
    dirs.into_iter().collect()
}
