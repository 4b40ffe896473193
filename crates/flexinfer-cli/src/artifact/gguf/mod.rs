//! `validate-artifact` for GGUF (the layout llama.cpp serves): every `.gguf` in the directory (or
//! the file given), split files (`<name>-00001-of-0000N.gguf`) as one model. Per file: the header
//! reads ([`parse`], bounded, for hostile input) and its tensors are what llama.cpp loads
//! ([`tensors`]); per model: the metadata ([`metadata`]), the split keys, and `.save-complete` when
//! present; with `--run-generation`, a short generation by llama.cpp ([`generation`]).

mod generation;
mod ggml;
mod metadata;
mod parse;
mod tensors;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value as Json;

pub use generation::Generation;
use parse::read_gguf;

use super::{save_complete, Options, Report};
use parse::Value;

/// One model of the report: a `.gguf` file or the files of a split.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GgufModel {
    /// The (first) file's name.
    pub file: String,
    pub files: usize,
    pub size_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_type: Option<String>,
    pub tensors: usize,
    pub tensors_by_type: BTreeMap<String, usize>,
    pub metadata: BTreeMap<String, Json>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<Generation>,
}

/// The defects of one GGUF file whose first bytes are `header` and whose length is `file_len`
/// (header, tensors, metadata; no splits, no marker): for tests of hostile input.
pub fn check_header_bytes(name: &str, header: &[u8], file_len: u64) -> Vec<String> {
    let f = match parse::parse(header, file_len) {
        Ok(f) => f,
        Err(e) => return vec![format!("{name}: malformed GGUF {e}")],
    };
    let mut defects = Vec::new();
    tensors::check_tensors(name, &f, &mut BTreeSet::new(), &mut |d| defects.push(d));
    let all: BTreeMap<String, Vec<u64>> = f
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone()))
        .collect();
    metadata::check_metadata(name, &f, &all, &mut |d| defects.push(d));
    defects
}

/// Whether `path` is (or holds) GGUF files.
pub(crate) fn is_gguf(path: &Path) -> bool {
    if path.is_file() {
        return has_gguf_ext(path);
    }
    std::fs::read_dir(path)
        .map(|rd| rd.flatten().any(|e| has_gguf_ext(&e.path())))
        .unwrap_or(false)
}

fn has_gguf_ext(p: &Path) -> bool {
    p.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// `<prefix>-00001-of-00003.gguf` → (prefix, 1, 3), llama.cpp's `llama_split_path` names.
pub(crate) fn split_name(name: &str) -> Option<(&str, u32, u32)> {
    let stem = name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) {
        return None;
    }
    Some((prefix, no.parse().ok()?, count.parse().ok()?))
}

/// The models in `names`: split files grouped (by prefix and count), other files alone.
fn group(names: &[String]) -> Vec<(String, Option<u32>, Vec<String>)> {
    let mut splits: BTreeMap<(String, u32), Vec<String>> = BTreeMap::new();
    let mut out = Vec::new();
    for n in names {
        match split_name(n) {
            Some((prefix, _, count)) => splits
                .entry((prefix.to_string(), count))
                .or_default()
                .push(n.clone()),
            None => out.push((n.clone(), None, vec![n.clone()])),
        }
    }
    for ((prefix, count), files) in splits {
        out.push((prefix, Some(count), files));
    }
    out
}

/// Validate the GGUF file `path`, or every `.gguf` in the directory `path`.
pub(crate) fn validate_gguf(path: &Path, opts: &Options) -> Report {
    let mut r = Report {
        path: path.display().to_string(),
        layout: "gguf".into(),
        ..Default::default()
    };
    let (dir, names, whole_dir) = if path.is_file() {
        let dir = path
            .parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // A split file brings its siblings.
        let mut names = vec![name.clone()];
        if let Some((prefix, _, count)) = split_name(&name) {
            names = list_gguf(&dir)
                .into_iter()
                .filter(|n| split_name(n).is_some_and(|(p, _, c)| p == prefix && c == count))
                .collect();
        }
        (dir, names, false)
    } else {
        (path.to_path_buf(), list_gguf(path), true)
    };
    if names.is_empty() {
        r.defect("gguf", format!("no .gguf file in {}", dir.display()));
    }
    for (model, count, files) in group(&names) {
        let m = check_model(&mut r, &dir, &model, count, &files, opts);
        r.gguf.push(m);
    }
    check_marker(&mut r, &dir, &names, whole_dir, opts);
    r.ok = r.defects.is_empty();
    r
}

fn list_gguf(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| has_gguf_ext(&e.path()))
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// `.save-complete`: checked when present (all of a directory's files recorded, each of its size
/// and sha256); its absence is a warning (a GGUF made elsewhere has none).
fn check_marker(r: &mut Report, dir: &Path, names: &[String], whole_dir: bool, opts: &Options) {
    let marker = dir.join(flexinfer_api::contract::files::SAVE_COMPLETE);
    if marker.symlink_metadata().is_err() {
        r.warn(
            "save-complete",
            format!(
                "{} is missing: no record that the save completed (not written by flexinfer, or unfinished)",
                flexinfer_api::contract::files::SAVE_COMPLETE
            ),
        );
        return;
    }
    let Some(sc) = save_complete::read_save_complete(r, dir) else {
        return;
    };
    if whole_dir {
        save_complete::check_save_complete(r, dir, &sc, names, opts);
        return;
    }
    for n in names {
        match sc.shards.iter().find(|s| s.name == *n) {
            Some(s) => save_complete::check_recorded_shard(r, dir, s, opts),
            None => r.defect(
                "save-complete",
                format!("shard {n} is not recorded in .save-complete"),
            ),
        }
    }
}

/// One model: its files' headers and tensors, its metadata, its split keys, the generation.
fn check_model(
    r: &mut Report,
    dir: &Path,
    model: &str,
    count: Option<u32>,
    files: &[String],
    opts: &Options,
) -> GgufModel {
    let mut m = GgufModel {
        file: files.first().cloned().unwrap_or_else(|| model.to_string()),
        files: files.len(),
        ..Default::default()
    };
    if let Some(count) = count {
        let present: BTreeSet<u32> = files
            .iter()
            .filter_map(|f| split_name(f).map(|s| s.1))
            .collect();
        for i in 1..=count {
            if !present.contains(&i) {
                r.defect(
                    "gguf-split",
                    format!("split file {model}-{i:05}-of-{count:05}.gguf is missing"),
                );
            }
        }
        if let Some(extra) = present.iter().find(|i| **i == 0 || **i > count) {
            r.defect(
                "gguf-split",
                format!("split file {model}-{extra:05}-of-{count:05}.gguf is outside 1..={count}"),
            );
        }
    }
    let mut names = BTreeSet::new();
    let mut all_tensors: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut first: Option<(String, parse::GgufFile)> = None;
    let mut total_tensors: u64 = 0;
    for name in files {
        let path = dir.join(name);
        r.shards = r.shards.saturating_add(1);
        let f = match read_gguf(&path) {
            Ok(f) => f,
            Err(e) => {
                r.defect("gguf-header", format!("{name}: malformed GGUF {e}"));
                continue;
            }
        };
        m.size_bytes = m.size_bytes.saturating_add(f.file_len);
        m.version.get_or_insert(f.version);
        let mut defects = Vec::new();
        let tally = tensors::check_tensors(name, &f, &mut names, &mut |d| defects.push(d));
        for d in defects {
            r.defect("gguf-tensors", d);
        }
        for (t, n) in tally.by_type {
            let e = m.tensors_by_type.entry(t).or_insert(0);
            *e = e.saturating_add(n);
        }
        r.quantized_linears = r.quantized_linears.saturating_add(tally.quantized);
        m.tensors = m.tensors.saturating_add(f.tensors.len());
        total_tensors = total_tensors.saturating_add(f.tensors.len() as u64);
        for t in &f.tensors {
            all_tensors.insert(t.name.clone(), t.dims.clone());
        }
        check_split_keys(r, name, &f);
        let is_first = split_name(name).is_none_or(|s| s.1 == 1);
        if is_first {
            first = Some((name.clone(), f));
        }
    }
    r.tensors = r.tensors.saturating_add(m.tensors);
    let Some((first_name, f)) = first else {
        return m;
    };
    if count.is_some() {
        match f.get("split.tensors.count") {
            Some(Value::Int(n, _)) if u64::try_from(*n).ok() == Some(total_tensors) => {}
            Some(v) => r.defect(
                "gguf-split",
                format!("{first_name}: split.tensors.count is {v:?}, the split files declare {total_tensors} tensors"),
            ),
            None => r.defect(
                "gguf-split",
                format!("{first_name}: key split.tensors.count is missing"),
            ),
        }
    }
    let mut defects = Vec::new();
    let meta = metadata::check_metadata(&first_name, &f, &all_tensors, &mut |d| defects.push(d));
    for d in defects {
        r.defect("gguf-metadata", d);
    }
    m.architecture = meta.architecture;
    m.file_type = meta.file_type;
    m.metadata = meta.summary;
    if opts.run_generation {
        let (g, failed) = generation::run_generation(&dir.join(&first_name));
        if let Some(s) = &g.skipped {
            r.warn("generation", s);
        }
        if let Some(e) = failed {
            r.defect("generation", e);
        }
        m.generation = Some(g);
    }
    m
}

/// `split.no` / `split.count` (u16) agree with the file's name; a file not named as a split says
/// it is not one.
fn check_split_keys(r: &mut Report, name: &str, f: &parse::GgufFile) {
    let get = |k: &str| match f.get(k) {
        Some(Value::Uint(v, "u16")) => Some(Ok(*v)),
        Some(v) => Some(Err(v.type_name())),
        None => None,
    };
    match (split_name(name), get("split.count")) {
        (None, Some(Ok(n))) if n > 1 => r.defect(
            "gguf-split",
            format!("{name}: split.count is {n}, but the file is not named <name>-00001-of-{n:05}.gguf, so llama.cpp cannot find the others"),
        ),
        (_, Some(Err(ty))) => r.defect("gguf-split", format!("{name}: key split.count has type {ty}, not u16")),
        (Some((_, no, c)), sc) => {
            if sc.clone().and_then(Result::ok) != Some(u64::from(c)) {
                r.defect("gguf-split", format!("{name}: key split.count is {sc:?}, the name says {c}"));
            }
            let want = u64::from(no.saturating_sub(1));
            match get("split.no") {
                Some(Ok(v)) if v == want => {}
                other => r.defect(
                    "gguf-split",
                    format!("{name}: key split.no is {other:?}, the name says {want} (0-based)"),
                ),
            }
        }
        _ => {}
    }
}
