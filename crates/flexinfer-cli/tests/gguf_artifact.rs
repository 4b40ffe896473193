//! `flexinfer quantize validate-artifact` on GGUF: what the engine writes (flexinfer-quant's
//! `write_gguf_artifact`) validates; each corruption (truncated, a tensor past the end, misaligned,
//! a huge count, an unknown or removed type, a row that is not whole blocks, a missing key, a special
//! token id outside the vocabulary, an unknown architecture, a missing split, changed bytes) is a
//! defect naming the file and the key or tensor, exit 1; bad flags exit 2. `--run-generation` says it
//! skipped without llama.cpp on PATH, and with the real llama.cpp (`FLEXINFER_LLAMACPP_ROOT`, a
//! wrapper on PATH) it generates from our file and from a split llama-gguf-split made.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::path::{Path, PathBuf};
use std::process::Command;

use flexinfer_cli::artifact::{validate, Options, Report};
use flexinfer_quant::events::NullSink;
use flexinfer_quant::gguf::{write_gguf_artifact, FileType, GgufArtifactJob};
use flexinfer_quant::testkit::{self, ModelSize};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_flexinfer");
const FILE: &str = "model-Q4_K_M.gguf";

/// A GGUF artifact directory the engine wrote (Q4_K_M of the generated wide Llama).
fn artifact(root: &Path, ft: FileType) -> PathBuf {
    let src = root.join("model");
    testkit::write_model_sized(&src, "LlamaForCausalLM", 1, &ModelSize::GGUF_WIDE).unwrap();
    testkit::write_byte_level_tokenizer(&src).unwrap();
    let out = root.join("gguf");
    write_gguf_artifact(
        &GgufArtifactJob {
            model_dir: &src,
            out_dir: &out,
            file_type: ft,
            importance: None,
            prequantized: None,
            script_version: "test",
            verify_save_sha256: true,
        },
        &NullSink,
    )
    .unwrap();
    out
}

fn check(path: &Path) -> Report {
    validate(path, None, &Options::default()).unwrap()
}

fn cli(args: &[&str], path_env: Option<&str>) -> (i32, String, String) {
    let mut c = Command::new(BIN);
    c.args(args);
    if let Some(p) = path_env {
        c.env("PATH", p);
    }
    let o = c.output().unwrap();
    (
        o.status.code().unwrap(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn expect_defect(r: &Report, check: &str, want: &str) {
    assert!(!r.ok, "expected a defect {want:?}:\n{}", r.render());
    assert!(
        r.defects
            .iter()
            .any(|d| d.check == check && d.message.contains(want)),
        "no [{check}] defect containing {want:?}:\n{}",
        r.render()
    );
}

/// Byte positions of a tensor info: (dims, type id, offset).
fn tensor_info(b: &[u8], name: &str) -> (usize, usize, usize) {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend(name.as_bytes());
    let at = b
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .unwrap_or_else(|| panic!("tensor info {name}"));
    let nd_at = at + needle.len();
    let nd = u32::from_le_bytes(b[nd_at..nd_at + 4].try_into().unwrap()) as usize;
    let dims = nd_at + 4;
    let ty = dims + 8 * nd;
    (dims, ty, ty + 4)
}

/// Byte position of a metadata key's value (after its type).
fn key_value(b: &[u8], key: &str) -> usize {
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend(key.as_bytes());
    let at = b
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .unwrap_or_else(|| panic!("key {key}"));
    at + needle.len() + 4
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

#[test]
fn what_the_engine_writes_validates_with_its_summary() {
    let d = tempfile::tempdir().unwrap();
    for ft in [FileType::Q4KM, FileType::Q2K, FileType::F16] {
        let out = artifact(&d.path().join(ft.name()), ft);
        let r = check(&out);
        assert!(r.ok, "{}", r.render());
        assert_eq!(r.layout, "gguf");
        assert!(r.warnings.is_empty(), "{}", r.render());
        let m = &r.gguf[0];
        assert_eq!(m.file, format!("model-{}.gguf", ft.name()));
        assert_eq!(m.architecture.as_deref(), Some("llama"));
        assert_eq!(m.file_type.as_deref(), Some(ft.name()));
        // 4 blocks × 9 tensors, token_embd, output_norm, output (+ rope_freqs of llama3 scaling)
        assert!(m.tensors >= 4 * 9 + 3, "{}", m.tensors);
        assert_eq!(m.tensors_by_type.values().sum::<usize>(), m.tensors);
        assert_eq!(m.metadata["blockCount"], 4);
        assert_eq!(m.metadata["embeddingLength"], 256);
        assert_eq!(m.metadata["tokenizerModel"], "gpt2");
        assert_eq!(
            m.size_bytes,
            std::fs::metadata(out.join(&m.file)).unwrap().len()
        );
        let quantized: usize = m
            .tensors_by_type
            .iter()
            .filter(|(t, _)| !["F32", "F16", "BF16"].contains(&t.as_str()))
            .map(|(_, n)| n)
            .sum();
        assert_eq!(r.quantized_linears, quantized);
        match ft {
            FileType::Q4KM => {
                assert!(
                    m.tensors_by_type.contains_key("Q4_K"),
                    "{:?}",
                    m.tensors_by_type
                );
                assert!(
                    m.tensors_by_type.contains_key("Q6_K"),
                    "{:?}",
                    m.tensors_by_type
                );
            }
            FileType::F16 => assert_eq!(quantized, 0),
            _ => {}
        }
    }
    // The file itself is a path too; the CLI's JSON carries the same summary, exit 0.
    let out = d.path().join("Q4_K_M/gguf");
    let r = check(&out.join(FILE));
    assert!(r.ok, "{}", r.render());
    let (code, stdout, stderr) = cli(
        &[
            "quantize",
            "validate-artifact",
            "--path",
            out.to_str().unwrap(),
            "-o",
            "json",
        ],
        None,
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    let v: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["layout"], "gguf");
    assert_eq!(v["gguf"][0]["fileType"], "Q4_K_M");
    assert!(v["gguf"][0]["tensorsByType"]["Q4_K"].as_u64().unwrap() > 0);
    let (code, stdout, _) = cli(
        &[
            "quantize",
            "validate-artifact",
            "--path",
            out.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 0);
    assert!(
        stdout.contains("GGUF model-Q4_K_M.gguf: llama Q4_K_M"),
        "{stdout}"
    );
    assert!(
        stdout.starts_with("WARNING") || stdout.contains("OK: "),
        "{stdout}"
    );
}

/// Each corruption of the engine's Q4_K_M: (name, what to do, check, what the defect says).
type Corrupt = fn(&mut Vec<u8>);

#[test]
fn corrupted_files_are_defects_naming_the_key_or_tensor() {
    let d = tempfile::tempdir().unwrap();
    let good_dir = artifact(d.path(), FileType::Q4KM);
    let good = std::fs::read(good_dir.join(FILE)).unwrap();
    let cases: Vec<(&str, Corrupt, &str, &str)> = vec![
        ("truncated", |b| b.truncate(b.len() - 4096), "gguf-tensors", "lies past the end of the file"),
        ("header cut", |b| b.truncate(200), "gguf-header", "truncated"),
        (
            "offset past the end",
            |b| {
                let (_, _, off) = tensor_info(b, "blk.3.ffn_down.weight");
                put_u64(b, off, 1 << 40);
            },
            "gguf-tensors",
            "tensor blk.3.ffn_down.weight",
        ),
        (
            "misaligned",
            |b| {
                let (_, _, off) = tensor_info(b, "blk.1.attn_q.weight");
                let v = get_u64(b, off);
                put_u64(b, off, v + 4);
            },
            "gguf-tensors",
            "tensor blk.1.attn_q.weight: offset",
        ),
        ("huge tensor count", |b| put_u64(b, 8, u64::MAX / 2), "gguf-header", "tensors; the"),
        ("huge key count", |b| put_u64(b, 16, u64::MAX), "gguf-header", "metadata keys"),
        (
            "unknown type",
            |b| {
                let (_, ty, _) = tensor_info(b, "blk.0.ffn_up.weight");
                put_u32(b, ty, 99);
            },
            "gguf-tensors",
            "tensor blk.0.ffn_up.weight: unknown ggml type id 99",
        ),
        (
            "removed type",
            |b| {
                let (_, ty, _) = tensor_info(b, "blk.0.ffn_up.weight");
                put_u32(b, ty, 4);
            },
            "gguf-tensors",
            "Q4_2) was removed",
        ),
        (
            "row not whole blocks",
            |b| {
                let (dims, _, _) = tensor_info(b, "blk.2.ffn_gate.weight");
                put_u64(b, dims, 300);
            },
            "gguf-tensors",
            "blk.2.ffn_gate.weight (Q4_K [300, 512]): row length 300 is not a multiple of Q4_K's block of 256",
        ),
        (
            "missing key",
            |b| {
                let at = key_value(b, "llama.block_count") - 4 - 5;
                b[at..at + 5].copy_from_slice(b"COUNT");
            },
            "gguf-metadata",
            "key llama.block_count is missing",
        ),
        (
            "key of the wrong type",
            |b| {
                let at = key_value(b, "llama.context_length");
                put_u32(b, at - 4, 6); // f32
            },
            "gguf-metadata",
            "key llama.context_length has type f32; llama.cpp reads it as u32",
        ),
        (
            "eos outside the vocabulary",
            |b| {
                let at = key_value(b, "tokenizer.ggml.eos_token_id");
                put_u32(b, at, 100_000);
            },
            "gguf-metadata",
            "tokenizer.ggml.eos_token_id 100000 is not a token id",
        ),
        (
            "unknown architecture",
            |b| {
                let at = key_value(b, "general.architecture");
                b[at + 8..at + 13].copy_from_slice(b"llamx");
            },
            "gguf-metadata",
            "general.architecture \"llamx\" is not an architecture llama.cpp loads",
        ),
        (
            "no merges",
            |b| {
                let at = key_value(b, "tokenizer.ggml.merges") - 4 - 6;
                b[at..at + 6].copy_from_slice(b"MERGES");
            },
            "gguf-metadata",
            "tokenizer.ggml.merges is missing",
        ),
        (
            "bad magic",
            |b| b[0] = b'X',
            "gguf-header",
            "no GGUF magic",
        ),
    ];
    for (what, corrupt, check_name, want) in cases {
        let dir = d.path().join(what.replace(' ', "-"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut b = good.clone();
        corrupt(&mut b);
        std::fs::write(dir.join(FILE), &b).unwrap();
        let r = check(&dir);
        expect_defect(&r, check_name, want);
        assert!(
            r.defects.iter().any(|x| x.message.contains(FILE)),
            "{what}: the defect names the file:\n{}",
            r.render()
        );
        let (code, stdout, _) = cli(
            &[
                "quantize",
                "validate-artifact",
                "--path",
                dir.to_str().unwrap(),
            ],
            None,
        );
        assert_eq!(code, 1, "{what}: {stdout}");
        assert!(stdout.contains("INVALID"), "{stdout}");
    }
}

#[test]
fn save_complete_and_splits_are_checked() {
    let d = tempfile::tempdir().unwrap();
    let out = artifact(d.path(), FileType::Q4KM);
    // A changed tensor byte: the header is fine, the recorded sha256 is not.
    let mut b = std::fs::read(out.join(FILE)).unwrap();
    let n = b.len();
    b[n - 100] ^= 0xff;
    std::fs::write(out.join(FILE), &b).unwrap();
    expect_defect(&check(&out), "save-complete", "sha256");
    let r = validate(
        &out,
        None,
        &Options {
            skip_sha256: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.ok, "{}", r.render());
    // A file the marker does not record.
    std::fs::copy(out.join(FILE), out.join("extra.gguf")).unwrap();
    expect_defect(
        &check(&out),
        "save-complete",
        "shard extra.gguf is not recorded",
    );
    std::fs::remove_file(out.join("extra.gguf")).unwrap();
    // Without the marker: a warning only.
    std::fs::remove_file(out.join(".save-complete")).unwrap();
    let r = validate(
        &out,
        None,
        &Options {
            skip_sha256: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.ok, "{}", r.render());
    assert!(r.warnings.iter().any(|w| w.check == "save-complete"));
    // The first of two split files, alone and without split keys.
    std::fs::rename(out.join(FILE), out.join("model-00001-of-00002.gguf")).unwrap();
    let r = check(&out);
    expect_defect(
        &r,
        "gguf-split",
        "split file model-00002-of-00002.gguf is missing",
    );
    expect_defect(&r, "gguf-split", "key split.count is None");
    expect_defect(&r, "gguf-split", "split.tensors.count is missing");
}

#[test]
fn bad_flags_are_bad_input() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().to_str().unwrap().to_string();
    let (code, _, stderr) = cli(
        &[
            "quantize",
            "validate-artifact",
            "--path",
            &p,
            "--layout",
            "exl2",
        ],
        None,
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--layout exl2"), "{stderr}");
    let nope = d.path().join("nope.gguf");
    let (code, _, stderr) = cli(
        &[
            "quantize",
            "validate-artifact",
            "--path",
            nope.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 2, "{stderr}");
    // An empty directory named as GGUF: no file is a defect.
    let (code, stdout, _) = cli(
        &[
            "quantize",
            "validate-artifact",
            "--path",
            &p,
            "--layout",
            "gguf",
        ],
        None,
    );
    assert_eq!(code, 1);
    assert!(stdout.contains("no .gguf file"), "{stdout}");
}

#[test]
fn run_generation_without_llama_cpp_on_path_is_skipped_not_an_error() {
    let d = tempfile::tempdir().unwrap();
    let out = artifact(d.path(), FileType::Q4KM);
    let empty = d.path().join("empty-bin");
    std::fs::create_dir_all(&empty).unwrap();
    let (code, stdout, stderr) = cli(
        &[
            "quantize",
            "validate-artifact",
            "--path",
            out.to_str().unwrap(),
            "--run-generation",
        ],
        Some(empty.to_str().unwrap()),
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("generation: skipped: no llama.cpp on PATH (llama-completion, llama-cli)"),
        "{stdout}"
    );
}

/// The llama.cpp root (scripts/gguf/llamacpp-root.sh), or a skip; required with
/// FLEXINFER_REQUIRE_LLAMACPP=1.
fn llamacpp_root() -> Option<PathBuf> {
    match std::env::var_os("FLEXINFER_LLAMACPP_ROOT") {
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => {
            assert!(
                std::env::var("FLEXINFER_REQUIRE_LLAMACPP").as_deref() != Ok("1"),
                "FLEXINFER_REQUIRE_LLAMACPP=1 but FLEXINFER_LLAMACPP_ROOT is not set"
            );
            println!("SKIPPED: FLEXINFER_LLAMACPP_ROOT is not set");
            None
        }
    }
}

/// A `llama-*` on PATH that runs the root's binary with `dir` bound at /work (paths under `dir`
/// rewritten to /work).
fn wrapper(bin_dir: &Path, tool: &str, root: &Path, dir: &Path) {
    let run = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gguf/llamacpp-run.sh");
    let script = format!(
        "#!/bin/sh\ndir='{}'\nfor a in \"$@\"; do shift; case \"$a\" in \"$dir\"/*) set -- \"$@\" \"/work/${{a#\"$dir\"/}}\";; *) set -- \"$@\" \"$a\";; esac; done\nexec bash '{}' '{}' \"$dir\" {tool} \"$@\"\n",
        dir.display(),
        run.display(),
        root.display()
    );
    let p = bin_dir.join(tool);
    std::fs::write(&p, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn run_generation_with_the_real_llama_cpp_and_a_real_split() {
    let Some(root) = llamacpp_root() else { return };
    let d = tempfile::tempdir().unwrap();
    let out = artifact(d.path(), FileType::Q4KM);
    let bin = d.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    wrapper(&bin, "llama-completion", &root, &out);
    let path = format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display());
    let (code, stdout, stderr) = cli(
        &[
            "quantize",
            "validate-artifact",
            "--path",
            out.to_str().unwrap(),
            "--run-generation",
            "-o",
            "json",
        ],
        Some(&path),
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    let v: Value = serde_json::from_str(&stdout).unwrap();
    let g = &v["gguf"][0]["generation"];
    assert_eq!(g["tool"], "llama-completion", "{g}");
    assert_eq!(g["exitCode"], 0, "{g}");
    // llama-completion may lose its last log lines (docs/dev/gguf.md): the speed is reported when
    // its timings arrived.
    println!("generation: {g}");
    // llama-gguf-split of our file into 3 parts validates as one model.
    let split = d.path().join("split");
    std::fs::create_dir_all(&split).unwrap();
    std::fs::copy(out.join(FILE), split.join(FILE)).unwrap();
    let run = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gguf/llamacpp-run.sh");
    let st = Command::new("bash")
        .arg(&run)
        .arg(&root)
        .arg(&split)
        .args([
            "llama-gguf-split",
            "--split",
            "--split-max-tensors",
            "16",
            FILE,
            "part",
        ])
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::remove_file(split.join(FILE)).unwrap();
    let r = check(&split);
    assert!(r.ok, "{}", r.render());
    assert_eq!(r.gguf.len(), 1, "{}", r.render());
    assert_eq!(r.gguf[0].files, 3, "{}", r.render());
    assert_eq!(r.gguf[0].architecture.as_deref(), Some("llama"));
    // One part missing is a defect.
    std::fs::remove_file(split.join("part-00002-of-00003.gguf")).unwrap();
    expect_defect(
        &check(&split),
        "gguf-split",
        "part-00002-of-00003.gguf is missing",
    );
    // A corrupted file llama.cpp refuses: the generation is a defect (exit 1).
    let bad = d.path().join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let mut b = std::fs::read(out.join(FILE)).unwrap();
    let at = key_value(&b, "general.architecture");
    b[at + 8..at + 13].copy_from_slice(b"llamx");
    std::fs::write(bad.join(FILE), &b).unwrap();
    wrapper(&bin, "llama-completion", &root, &bad);
    let (code, stdout, _) = cli(
        &[
            "quantize",
            "validate-artifact",
            "--path",
            bad.to_str().unwrap(),
            "--run-generation",
        ],
        Some(&path),
    );
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stdout.contains("DEFECT [generation] llama-completion failed"),
        "{stdout}"
    );
}
