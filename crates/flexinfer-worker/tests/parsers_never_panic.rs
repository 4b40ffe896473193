//! Property tests of the parsers of strings a user, a hub, a registry or a worker pod controls: each
//! returns an error or a value for any input and never panics (100 000 cases each; `PROPTEST_CASES`
//! overrides). Covers the source-URI grammar, OCI references and tags, the tag policy, allow/ignore
//! patterns, hub dataset ids, contract booleans, relative paths, reserved and generation names, phase
//! names, termination messages and JSON-line events (what the controller reads back from a pod), and
//! the dataset reader over arbitrary file bytes (what a hub dataset can contain), the GGUF and safetensors
//! header readers publish describes a model with, and the layer rules of an `oci://` manifest. The engine's
//! model-file readers (safetensors header, index, config) have their own suite in `flexinfer-quant`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use flexinfer_contract::{self as contract, files, JobPhase, TerminationMessage, WorkerEvent};
use flexinfer_quant::model::dataset;
use flexinfer_worker::download::{hub_dataset_id, PatternFilter, Source};
use flexinfer_worker::oci::{check_tag, Reference};
use flexinfer_worker::publish::TagPolicy;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000)
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Any string, or one shaped like the grammar under test (so the parser gets past its first check).
fn shaped(pattern: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![any::<String>(), pattern.prop_map(String::from)]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn source_uris(s in shaped(r"(HF|hf|huggingface|oci|local|pvc|s3)?(://)?[a-zA-Z0-9/._:@%+\-]{0,40}")) {
        let _ = Source::parse(&s);
        let _ = hub_dataset_id(&s);
    }

    #[test]
    fn oci_references_and_tags(s in shaped(r"[a-z0-9.:\[\]]{0,20}/[a-zA-Z0-9/._\-]{0,20}(:[a-zA-Z0-9._\-]{0,130})?(@sha256:[0-9a-f]{0,70})?")) {
        let _ = Reference::parse(&s);
        let _ = check_tag(&s);
        let _ = TagPolicy::parse(&s);
    }

    #[test]
    fn allow_and_ignore_patterns(
        allow in shaped(r"[*?\[\]{}!,a-z./\\]{0,30}"),
        ignore in shaped(r"[*?\[\]{}!,a-z./\\]{0,30}"),
        path in shaped(r"[a-z./*\[\]]{0,30}"),
    ) {
        if let Ok(f) = PatternFilter::new(&allow, &ignore) {
            let _ = f.matches(&path);
        }
    }

    #[test]
    fn names_and_paths(s in shaped(r"[a-zA-Z0-9./\-_]{0,40}")) {
        let _ = contract::parse_bool(&s);
        let _ = contract::check_relative_path(&s);
        let _ = files::is_reserved_path(&s);
        let _ = files::is_generation_of(&s, contract::SOURCE_SUBDIR);
        let _ = JobPhase::parse(&s);
    }

    #[test]
    fn termination_messages_and_events(s in shaped(r#"\{"(type|ok|reason|message|percent|event|ts)":("[^"]{0,8}"|[0-9e.\-]{1,30}|null|\[\]|\{\}),?.{0,20}\}?"#), cut in 0usize..5000) {
        let _ = TerminationMessage::parse(&s);
        let _ = WorkerEvent::parse_line(&s);
        let tail = contract::termination::tail_chars(&s, cut);
        prop_assert!(s.ends_with(&tail));
        prop_assert!(tail.len() <= cut || s.len() <= cut);
    }

    /// The head of any text (multi-byte characters included) is a prefix of it plus `...`, within the bound.
    #[test]
    fn heads_of_texts(s in ".{0,60}", cut in 0usize..80) {
        let head = contract::termination::head_chars(&s, cut);
        if s.len() <= cut {
            prop_assert_eq!(&head, &s);
        } else {
            let kept = head.strip_suffix("...").unwrap_or_else(|| panic!("{head:?} has no ..."));
            prop_assert!(s.starts_with(kept));
            prop_assert!(head.len() <= cut.max(3));
            // cut at the last character boundary within `cut - 3` bytes (a character is at most 4 bytes)
            prop_assert!(kept.len() + 4 > cut.saturating_sub(3));
        }
    }
}

proptest! {
    #![proptest_config(config())]

    /// Arbitrary bytes under every dataset extension: the reader answers texts or an error.
    #[test]
    fn dataset_files(
        bytes in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..256),
            r#"(\{"(text|prompt|messages|instruction|input)":("[^"]{0,6}"|\[\{"content":"x"\}\]|[0-9]{1,3}|null)\}\n){0,4}"#
                .prop_map(String::into_bytes),
            r#"(prompt|text|x),?(y)?\n("a,b"|a|"")\n"#.prop_map(String::into_bytes),
        ],
        ext in prop::sample::select(vec!["jsonl", "json", "csv", "txt", "parquet", "jsonl.zst", "bin"]),
        max in 0usize..8,
        prompts in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(format!("data.{ext}"));
        std::fs::write(&p, &bytes).unwrap();
        let rules = if prompts { &dataset::PROMPTS } else { &dataset::CALIBRATION };
        if let Ok(texts) = dataset::read_texts(&p, max, rules) {
            prop_assert!(texts.len() <= max, "{} texts for max {max}", texts.len());
        }
    }
}

/// Bytes that start like a GGUF header (magic, version 3, small counts) so the scanner gets past its
/// first checks, or anything.
fn gguf_like() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        (0u64..4, 0u64..4, prop::collection::vec(any::<u8>(), 0..256)).prop_map(
            |(nt, nkv, tail)| {
                let mut b = b"GGUF".to_vec();
                b.extend(3u32.to_le_bytes());
                b.extend(nt.to_le_bytes());
                b.extend(nkv.to_le_bytes());
                b.extend(tail);
                b
            }
        ),
    ]
}

proptest! {
    #![proptest_config(config())]

    /// The headers publish reads to describe a model (ModelPack config): a GGUF header and a
    /// safetensors header over arbitrary bytes (and a claimed length that may lie) give a value or an
    /// error.
    #[test]
    fn model_file_headers(bytes in gguf_like(), extra in 0u64..1024) {
        use flexinfer_worker::publish::modelpack::{safetensors_header, scan_gguf};
        let len = bytes.len() as u64;
        let _ = scan_gguf(std::io::Cursor::new(&bytes), len);
        let _ = scan_gguf(std::io::Cursor::new(&bytes), len + extra);
        let _ = safetensors_header(&bytes[..], len);
        let _ = safetensors_header(&bytes[..], len + extra);
    }

    /// Any manifest an `oci://` source serves (artifact type, config and layer media types, path
    /// annotations): file layers or a refusal.
    #[test]
    fn artifact_manifests(
        artifact_type in shaped(r"application/vnd\.(cncf|cnai|flexinfer|unknown)\.(model|artifact)\.(manifest\.)?v1(\+json)?"),
        layers in prop::collection::vec(
            (
                shaped(r"application/vnd\.(cncf|cnai)\.model\.(weight|weight\.config|doc|code|dataset)\.v1\.(raw|tar|tar\+gzip|tar\+zstd)"),
                prop::option::of(shaped(r"(\.\./|/|\./)?[a-z.]{0,6}(/[a-z.]{0,6}){0,2}")),
                prop::sample::select(vec![
                    "org.cncf.model.filepath",
                    "org.cnai.model.filepath",
                    "org.opencontainers.image.title",
                    "io.deis.oras.content.unpack",
                ]),
                shaped("sha256:[0-9a-f]{64}"),
            ),
            0..5,
        ),
    ) {
        use flexinfer_worker::oci::{artifact::file_layers, Descriptor, Manifest};
        let m = Manifest {
            schema_version: 2,
            media_type: None,
            artifact_type: Some(artifact_type),
            config: Descriptor {
                media_type: "application/vnd.oci.empty.v1+json".into(),
                digest: "sha256:0".into(),
                size: 2,
                annotations: Default::default(),
            },
            layers: layers
                .into_iter()
                .map(|(media_type, path, key, digest)| Descriptor {
                    media_type,
                    digest,
                    size: 1,
                    annotations: path.map(|p| (key.to_string(), p)).into_iter().collect(),
                })
                .collect(),
            annotations: Default::default(),
        };
        if let Ok(files) = file_layers("r", &m) {
            for f in files {
                prop_assert!(contract::check_relative_path(&f.path).is_ok(), "{}", f.path);
            }
        }
    }
}
