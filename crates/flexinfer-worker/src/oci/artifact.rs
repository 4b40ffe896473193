//! Which layers of an `oci://` artifact become which files: ModelPack artifacts (raw layers named by
//! `org.cncf.model.filepath`, also in the transitional `vnd.cnai` spelling), plain ORAS artifacts (any
//! layer titled `org.opencontainers.image.title`, written as the blob's bytes, as `oras pull` does) and
//! the layout FlexInfer published before ModelPack. A layer is refused, naming its index, digest and
//! media type, when it is an archive we would have to unpack (a ModelPack `.tar*` layer, a directory
//! `oras push` tarred), a media type a ModelPack artifact does not define, or names no file or an
//! unsafe one; two layers may not write the same path, nor a file where another layer needs a directory.

use std::collections::BTreeMap;

use flexinfer_contract::{check_relative_path, oci_artifact as oa, PathError};

use super::{is_sha256_digest, Manifest, OciError};

/// What the manifest says the artifact is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArtifactKind {
    /// A CNCF ModelPack artifact (by its artifact type or config media type).
    ModelPack,
    /// What FlexInfer published before ModelPack (`application/vnd.flexinfer.model.v1`).
    FlexinferV1,
    /// Anything else: a plain OCI artifact such as `oras push` makes.
    Plain,
}

impl ArtifactKind {
    pub fn of(m: &Manifest) -> ArtifactKind {
        let at = m.artifact_type.as_deref().unwrap_or("");
        if oa::MODELPACK_ARTIFACT_TYPES.contains(&at)
            || oa::MODELPACK_CONFIG_MEDIA_TYPES.contains(&m.config.media_type.as_str())
        {
            ArtifactKind::ModelPack
        } else if at == oa::LEGACY_ARTIFACT_TYPE {
            ArtifactKind::FlexinferV1
        } else {
            ArtifactKind::Plain
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            ArtifactKind::ModelPack => "a ModelPack artifact",
            ArtifactKind::FlexinferV1 => "a FlexInfer artifact (pre-ModelPack layout)",
            ArtifactKind::Plain => "a plain OCI artifact",
        }
    }
}

/// Why a layer is not written out as a file.
#[derive(Debug, thiserror::Error)]
pub enum LayerProblem {
    #[error(
        "a tar archive, which FlexInfer does not unpack: publish the files as raw layers \
         (application/vnd.cncf.model.*.v1.raw), one per file"
    )]
    Archive,
    #[error(
        "a directory that `oras push` tarred ({} = true), which FlexInfer does not unpack: \
         push the directory's files instead",
        oa::ORAS_UNPACK_ANNOTATION
    )]
    OrasDirectory,
    #[error(
        "not a layer media type of the ModelPack spec that FlexInfer reads (the *.v1.raw layers)"
    )]
    UnknownModelPackType,
    #[error(
        "names no file: no {} or {} annotation",
        oa::MODELPACK_FILEPATH_ANNOTATION,
        oa::TITLE_ANNOTATION
    )]
    NoPath,
    #[error("unsafe file path")]
    UnsafePath(#[source] PathError),
    #[error("its digest is not sha256:<64 hex>")]
    UnsupportedDigest,
}

/// One layer to fetch as a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileLayer {
    /// Relative path in the model directory.
    pub path: String,
    /// `sha256:<hex>`.
    pub digest: String,
    pub size: u64,
}

fn refuse(index: usize, l: &super::Descriptor, problem: LayerProblem) -> OciError {
    OciError::LayerRefused {
        index,
        digest: l.digest.clone(),
        media_type: l.media_type.clone(),
        problem,
    }
}

/// The part of a media type after a ModelPack prefix (`weight.v1.raw`), if it has one.
fn modelpack_kind(media_type: &str) -> Option<&str> {
    oa::MODELPACK_MEDIA_TYPE_PREFIXES
        .iter()
        .find_map(|p| media_type.strip_prefix(p))
}

/// The file path a layer names: a ModelPack file path annotation first, then the OCI title.
fn layer_path(l: &super::Descriptor) -> Option<&str> {
    oa::MODELPACK_FILEPATH_ANNOTATIONS
        .iter()
        .chain(std::iter::once(&oa::TITLE_ANNOTATION))
        .find_map(|k| l.annotations.get(*k))
        .map(String::as_str)
}

/// `a/./b//c` as `a/b/c`: the path the file lands on, for telling duplicates apart.
fn normalized(path: &str) -> String {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// The file layers of `m` (`reference` names the artifact in errors), in manifest order.
pub fn file_layers(reference: &str, m: &Manifest) -> Result<Vec<FileLayer>, OciError> {
    let kind = ArtifactKind::of(m);
    let mut out = Vec::with_capacity(m.layers.len());
    // Normalized path → layer index, to find two layers writing one path.
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (index, l) in m.layers.iter().enumerate() {
        let mt = l.media_type.as_str();
        if l.annotations
            .get(oa::ORAS_UNPACK_ANNOTATION)
            .is_some_and(|v| v.eq_ignore_ascii_case("true"))
        {
            return Err(refuse(index, l, LayerProblem::OrasDirectory));
        }
        match modelpack_kind(mt) {
            Some(k) if oa::MODELPACK_RAW_LAYER_KINDS.contains(&k) => {}
            Some(k)
                if oa::MODELPACK_ARCHIVE_SUFFIXES
                    .iter()
                    .any(|s| k.ends_with(s)) =>
            {
                return Err(refuse(index, l, LayerProblem::Archive));
            }
            Some(_) => return Err(refuse(index, l, LayerProblem::UnknownModelPackType)),
            // A ModelPack artifact holds ModelPack layers only.
            None if kind == ArtifactKind::ModelPack => {
                return Err(refuse(index, l, LayerProblem::UnknownModelPackType));
            }
            // The earlier FlexInfer layout and plain ORAS artifacts: every titled layer is a file,
            // whatever its media type (`oras push` marks plain files `…image.layer.v1.tar`).
            None => {}
        }
        let path = layer_path(l).ok_or_else(|| refuse(index, l, LayerProblem::NoPath))?;
        check_relative_path(path).map_err(|e| refuse(index, l, LayerProblem::UnsafePath(e)))?;
        let norm = normalized(path);
        if norm.is_empty() {
            return Err(refuse(index, l, LayerProblem::UnsafePath(PathError::Empty)));
        }
        if !is_sha256_digest(&l.digest) {
            return Err(refuse(index, l, LayerProblem::UnsupportedDigest));
        }
        if let Some(first) = seen.get(&norm) {
            return Err(OciError::DuplicatePath {
                path: norm,
                first: *first,
                second: index,
            });
        }
        seen.insert(norm.clone(), index);
        out.push(FileLayer {
            path: path.to_string(),
            digest: l.digest.clone(),
            size: l.size,
        });
    }
    if out.is_empty() {
        return Err(OciError::NoFileLayers {
            reference: reference.to_string(),
        });
    }
    // A file where another layer needs a directory (`a` and `a/b`): no path's parent directory may
    // be another layer's file.
    for (below, below_layer) in &seen {
        let mut end = below.len();
        while let Some(i) = below[..end].rfind('/') {
            end = i;
            if let Some(file_layer) = seen.get(&below[..end]) {
                return Err(OciError::PathConflict {
                    file: below[..end].to_string(),
                    file_layer: *file_layer,
                    below: below.clone(),
                    below_layer: *below_layer,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::Descriptor;

    fn digest(i: u8) -> String {
        format!("sha256:{}", hex::encode([i; 32]))
    }

    fn layer(mt: &str, ann: &[(&str, &str)], i: u8) -> Descriptor {
        Descriptor {
            media_type: mt.into(),
            digest: digest(i),
            size: u64::from(i),
            annotations: ann
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn manifest(artifact_type: Option<&str>, config_mt: &str, layers: Vec<Descriptor>) -> Manifest {
        Manifest {
            schema_version: 2,
            media_type: Some(oa::MANIFEST_MEDIA_TYPE.into()),
            artifact_type: artifact_type.map(String::from),
            config: Descriptor {
                media_type: config_mt.into(),
                digest: digest(0),
                size: 2,
                annotations: Default::default(),
            },
            layers,
            annotations: Default::default(),
        }
    }

    fn paths(m: &Manifest) -> Vec<String> {
        file_layers("r", m)
            .unwrap()
            .into_iter()
            .map(|l| l.path)
            .collect()
    }

    fn refused(m: &Manifest) -> String {
        file_layers("r", m)
            .map_err(|e| flexinfer_contract::error::chain(&e))
            .unwrap_err()
    }

    const FP: &str = oa::MODELPACK_FILEPATH_ANNOTATION;
    const TITLE: &str = oa::TITLE_ANNOTATION;

    #[test]
    fn modelpack_raw_layers_are_files_named_by_their_filepath() {
        let m = manifest(
            Some(oa::MODELPACK_ARTIFACT_TYPE),
            oa::MODELPACK_CONFIG_MEDIA_TYPE,
            vec![
                layer(
                    oa::MODELPACK_WEIGHT_RAW,
                    &[(FP, "model.safetensors"), (TITLE, "model.safetensors")],
                    1,
                ),
                layer(
                    oa::MODELPACK_WEIGHT_CONFIG_RAW,
                    &[(FP, "tok/tokenizer.json"), (TITLE, "tokenizer.json")],
                    2,
                ),
                layer(oa::MODELPACK_DOC_RAW, &[(FP, "README.md")], 3),
                layer(oa::MODELPACK_CODE_RAW, &[(FP, "modeling.py")], 4),
                layer(oa::MODELPACK_DATASET_RAW, &[(FP, "calib.jsonl")], 5),
            ],
        );
        assert_eq!(ArtifactKind::of(&m), ArtifactKind::ModelPack);
        // The ModelPack file path wins over a title that holds only the base name.
        assert_eq!(
            paths(&m),
            [
                "model.safetensors",
                "tok/tokenizer.json",
                "README.md",
                "modeling.py",
                "calib.jsonl"
            ]
        );
        let l = &file_layers("r", &m).unwrap()[0];
        assert_eq!((l.digest.as_str(), l.size), (digest(1).as_str(), 1));
    }

    #[test]
    fn the_transitional_cnai_spelling_is_modelpack_too() {
        // What modctl writes: vnd.cnai media types, org.cnai.model.filepath, no title.
        let m = manifest(
            Some("application/vnd.cnai.model.manifest.v1+json"),
            "application/vnd.cnai.model.config.v1+json",
            vec![layer(
                "application/vnd.cnai.model.weight.v1.raw",
                &[("org.cnai.model.filepath", "sub/w.safetensors")],
                1,
            )],
        );
        assert_eq!(ArtifactKind::of(&m), ArtifactKind::ModelPack);
        assert_eq!(paths(&m), ["sub/w.safetensors"]);
    }

    #[test]
    fn plain_oras_and_earlier_flexinfer_artifacts_are_read_by_title() {
        // `oras push ref a.txt tok/t.json`: artifactType vnd.unknown, layers marked image.layer.v1.tar.
        let m = manifest(
            Some("application/vnd.unknown.artifact.v1"),
            oa::EMPTY_CONFIG_MEDIA_TYPE,
            vec![
                layer(
                    "application/vnd.oci.image.layer.v1.tar",
                    &[(TITLE, "a.txt")],
                    1,
                ),
                layer("application/octet-stream", &[(TITLE, "tok/t.json")], 2),
            ],
        );
        assert_eq!(ArtifactKind::of(&m), ArtifactKind::Plain);
        assert_eq!(paths(&m), ["a.txt", "tok/t.json"]);
        // An older oras: no artifactType, a vnd.unknown config.
        let m = manifest(
            None,
            "application/vnd.unknown.config.v1+json",
            vec![layer(
                "application/vnd.oci.image.layer.v1.tar",
                &[(TITLE, "x.bin")],
                1,
            )],
        );
        assert_eq!(paths(&m), ["x.bin"]);
        let m = manifest(
            Some(oa::LEGACY_ARTIFACT_TYPE),
            oa::EMPTY_CONFIG_MEDIA_TYPE,
            vec![layer(
                oa::LEGACY_FILE_LAYER_MEDIA_TYPE,
                &[(TITLE, "config.json")],
                1,
            )],
        );
        assert_eq!(ArtifactKind::of(&m), ArtifactKind::FlexinferV1);
        assert_eq!(paths(&m), ["config.json"]);
    }

    #[test]
    fn archives_unknown_types_and_unnamed_layers_are_refused_by_index_and_media_type() {
        let mp = |l: Descriptor| {
            manifest(
                Some(oa::MODELPACK_ARTIFACT_TYPE),
                oa::MODELPACK_CONFIG_MEDIA_TYPE,
                vec![
                    layer(oa::MODELPACK_WEIGHT_RAW, &[(FP, "ok.safetensors")], 1),
                    l,
                ],
            )
        };
        for (l, want) in [
            (
                layer("application/vnd.cncf.model.weight.v1.tar", &[(FP, "w")], 2),
                "media type application/vnd.cncf.model.weight.v1.tar): a tar archive",
            ),
            (
                layer(
                    "application/vnd.cncf.model.doc.v1.tar+zstd",
                    &[(FP, "d")],
                    2,
                ),
                "a tar archive",
            ),
            (
                layer(
                    "application/vnd.cnai.model.weight.config.v1.tar+gzip",
                    &[(FP, "c")],
                    2,
                ),
                "a tar archive",
            ),
            (
                layer("application/vnd.cncf.model.weight.v2.raw", &[(FP, "w")], 2),
                "not a layer media type of the ModelPack spec",
            ),
            (
                layer("application/vnd.oci.image.layer.v1.tar", &[(TITLE, "w")], 2),
                "media type application/vnd.oci.image.layer.v1.tar): not a layer media type",
            ),
            (layer(oa::MODELPACK_DOC_RAW, &[], 2), "names no file"),
            (
                layer(oa::MODELPACK_DOC_RAW, &[(FP, "../escape")], 2),
                "unsafe file path",
            ),
            (
                layer(oa::MODELPACK_DOC_RAW, &[(FP, "/etc/passwd")], 2),
                "unsafe file path",
            ),
            (
                layer(oa::MODELPACK_DOC_RAW, &[(FP, "./")], 2),
                "unsafe file path",
            ),
        ] {
            let msg = refused(&mp(l));
            assert!(msg.starts_with(&format!("layer 1 ({}", digest(2))), "{msg}");
            assert!(msg.contains(want), "{msg} should contain {want}");
        }
        // Plain ORAS: a tarred directory, an untitled layer, a ModelPack archive type.
        let plain = |l: Descriptor| {
            manifest(
                Some("application/vnd.unknown.artifact.v1"),
                oa::EMPTY_CONFIG_MEDIA_TYPE,
                vec![l],
            )
        };
        let dir = layer(
            "application/vnd.oci.image.layer.v1.tar+gzip",
            &[(TITLE, "tok"), (oa::ORAS_UNPACK_ANNOTATION, "true")],
            3,
        );
        assert!(refused(&plain(dir)).contains("a directory that `oras push` tarred"));
        let untitled = layer("application/vnd.oci.image.layer.v1.tar+gzip", &[], 3);
        let msg = refused(&plain(untitled));
        assert!(
            msg.contains("layer 0")
                && msg.contains("application/vnd.oci.image.layer.v1.tar+gzip")
                && msg.contains("names no file"),
            "{msg}"
        );
        let tar = layer(
            "application/vnd.cncf.model.weight.v1.tar",
            &[(TITLE, "w.tar")],
            3,
        );
        assert!(refused(&plain(tar)).contains("a tar archive"));
        let mut bad_digest = layer(oa::LEGACY_FILE_LAYER_MEDIA_TYPE, &[(TITLE, "x")], 3);
        bad_digest.digest = "sha512:00".into();
        assert!(refused(&plain(bad_digest)).contains("not sha256"));
        // No layers at all.
        let mut empty = plain(layer("x", &[(TITLE, "a")], 1));
        empty.layers.clear();
        assert!(refused(&empty).contains("has no file layers"));
    }

    #[test]
    fn two_layers_may_not_write_one_path_nor_a_file_where_a_directory_goes() {
        let m = |a: &str, b: &str| {
            manifest(
                Some(oa::MODELPACK_ARTIFACT_TYPE),
                oa::MODELPACK_CONFIG_MEDIA_TYPE,
                vec![
                    layer(oa::MODELPACK_WEIGHT_RAW, &[(FP, a)], 1),
                    layer(oa::MODELPACK_WEIGHT_RAW, &[(FP, b)], 2),
                ],
            )
        };
        assert!(refused(&m("a/b", "./a//b")).contains("layers 0 and 1 both write a/b"));
        let msg = refused(&m("tok", "tok/t.json"));
        assert!(
            msg.contains("layer 0 writes the file tok")
                && msg.contains("layer 1 writes tok/t.json"),
            "{msg}"
        );
        // Siblings that share a prefix are fine.
        assert_eq!(paths(&m("tok", "tok.json")), ["tok", "tok.json"]);
        assert_eq!(paths(&m("tok-a/x", "tok/x")), ["tok-a/x", "tok/x"]);
        // Not fooled by a sibling sorting between them.
        let three = manifest(
            None,
            oa::EMPTY_CONFIG_MEDIA_TYPE,
            vec![
                layer("x", &[(TITLE, "a")], 1),
                layer("x", &[(TITLE, "a.json")], 2),
                layer("x", &[(TITLE, "a/b/c")], 3),
            ],
        );
        assert!(refused(&three).contains("layer 0 writes the file a"));
    }
}
