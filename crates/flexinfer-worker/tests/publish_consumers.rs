//! A published artifact as other tools see it, against a real registry (Debian's docker-registry on
//! loopback): the CNCF ModelPack specification's own validator (scripts/modelpack/validator.sh builds it
//! from github.com/modelpack/model-spec; `FLEXINFER_MODELPACK_VALIDATE`) accepts the manifest and the
//! config blob, and rejects them once broken; the `oras` CLI (scripts/oras/oras.sh builds oras from the
//! Go module proxy; `FLEXINFER_ORAS`) pulls the artifact into the published tree, byte for byte. A test
//! whose tool is not set skips, unless `FLEXINFER_REQUIRE_OCI_TOOLS=1` (scripts/test.sh sets all three),
//! which makes it a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod download_support;
mod publish_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use download_support::*;
use publish_support::Registry;

/// The tool a variable names, or `None` (the test skips) when it is unset and not required.
fn tool(var: &str, script: &str) -> Option<PathBuf> {
    match std::env::var_os(var) {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            assert!(
                std::env::var("FLEXINFER_REQUIRE_OCI_TOOLS").as_deref() != Ok("1"),
                "FLEXINFER_REQUIRE_OCI_TOOLS=1 but {var} is not set ({script} prints it)"
            );
            eprintln!("skipped: {var} is not set ({script} prints it)");
            None
        }
    }
}

/// A safetensors file with these (name, dtype, shape) tensors, filled with bytes from `seed`.
fn safetensors(path: &Path, tensors: &[(&str, &str, &[u64])], seed: u8) -> String {
    let size = |d: &str| match d {
        "I32" | "F32" => 4u64,
        _ => 2,
    };
    let mut header = serde_json::Map::new();
    let mut off = 0u64;
    for (name, dtype, shape) in tensors {
        let n = shape.iter().product::<u64>() * size(dtype);
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}),
        );
        off += n;
    }
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend((0..off).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, &out).unwrap();
    sha256_of(path)
}

/// `.save-complete` recording `shards` (relative names) as they are on disk.
fn save_complete(dir: &Path, shards: &[&str]) {
    let shards: Vec<serde_json::Value> = shards
        .iter()
        .map(|s| {
            serde_json::json!({"name": s, "size_bytes": std::fs::metadata(dir.join(s)).unwrap().len(),
                "sha256": sha256_of(&dir.join(s))})
        })
        .collect();
    let sc = serde_json::json!({
        "version": 1, "script_version": "v15", "completed_at": "2026-12-01T10:20:30Z",
        "shards": shards, "has_index": false, "has_config": true, "has_quantize_config": false,
    });
    std::fs::write(dir.join(".save-complete"), sc.to_string()).unwrap();
}

/// A GPTQ checkpoint as the quantize phase leaves it: config, one 4-bit shard, tokenizer, docs, the
/// records of the weights and the quality gate, and a file no rule knows.
fn gptq_tree(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "float16",
            "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32},
        })
        .to_string(),
    )
    .unwrap();
    safetensors(
        &dir.join("model.safetensors"),
        &[
            ("model.embed_tokens.weight", "F16", &[1000, 64]),
            ("model.layers.0.mlp.down_proj.qweight", "I32", &[16, 64]),
            ("model.layers.0.mlp.down_proj.qzeros", "I32", &[4, 8]),
            ("model.layers.0.mlp.down_proj.scales", "F16", &[4, 64]),
            ("model.norm.weight", "F16", &[64]),
        ],
        3,
    );
    std::fs::create_dir_all(dir.join("tokenizer")).unwrap();
    std::fs::write(dir.join("tokenizer/tokenizer.json"), r#"{"model":{}}"#).unwrap();
    std::fs::write(dir.join("generation_config.json"), r#"{"do_sample":false}"#).unwrap();
    std::fs::write(dir.join("README.md"), "# tiny\n").unwrap();
    std::fs::write(dir.join("imatrix.dat"), [1u8, 2, 3]).unwrap();
    std::fs::write(
        dir.join(".quantization-quality.json"),
        r#"{"gptqModules":7,"rtnFallbackModules":0,"rtnFallbackPercent":0.0,"maxRtnFallbackPercent":5.0,"minimumModules":1,"gate":"passed"}"#,
    )
    .unwrap();
    save_complete(dir, &["model.safetensors"]);
    // Never published: the resume cache.
    std::fs::create_dir_all(dir.join(".flexinfer-gptq-cache")).unwrap();
    std::fs::write(dir.join(".flexinfer-gptq-cache/checkpoint.json"), "{}").unwrap();
}

/// A GGUF artifact as the gguf phase leaves it: `model-Q4_K_M.gguf` and `.save-complete`.
fn gguf_tree(dir: &Path) {
    use flexinfer_quant::gguf::writer::{GgufWriter, MetaArray, MetaValue, TensorSpec};
    use flexinfer_quant::gguf::GgmlType;
    let md: Vec<(String, MetaValue)> = vec![
        (
            "general.architecture".into(),
            MetaValue::Str("llama".into()),
        ),
        ("general.name".into(), MetaValue::Str("Tiny Llama".into())),
        ("general.file_type".into(), MetaValue::U32(15)),
        (
            "tokenizer.ggml.tokens".into(),
            MetaValue::Array(MetaArray::Str(vec!["<s>".into(); 300])),
        ),
    ];
    let t = TensorSpec {
        name: "token_embd.weight".into(),
        dims: vec![64, 40],
        ty: GgmlType::F32,
    };
    let mut w = GgufWriter::create(&dir.join("model-Q4_K_M.gguf"), &md, vec![t]).unwrap();
    w.write_tensor("token_embd.weight", &vec![0u8; 64 * 40 * 4])
        .unwrap();
    w.finish().unwrap();
    save_complete(dir, &["model-Q4_K_M.gguf"]);
}

/// Publishes `dir` to `repo:v1`; returns (manifest bytes, config bytes).
fn publish(reg: &Registry, dir: &Path, repo: &str, scratch: &Path) -> (Vec<u8>, Vec<u8>) {
    let mut c = worker("publish", scratch);
    c.env("MODEL_DIR", dir)
        .env("OCI_REF", format!("{}/{repo}:v1", reg.addr))
        .env("OCI_INSECURE", "true");
    let r = run(c, scratch);
    assert_eq!(r.code, 0, "{}", r.describe());
    let digest = r.termination["digest"].as_str().unwrap();
    let (st, body) = reg.get(&format!("/v2/{repo}/manifests/{digest}"));
    assert_eq!(st, 200, "{body}");
    let m: serde_json::Value = serde_json::from_str(&body).unwrap();
    let config = reg.blob(repo, m["config"]["digest"].as_str().unwrap());
    (body.into_bytes(), config)
}

/// Runs the validator on (manifest, config); (exit code, stdout + stderr).
fn validate(bin: &Path, manifest: &[u8], config: &[u8], scratch: &Path) -> (i32, String) {
    let (mp, cp) = (scratch.join("manifest.json"), scratch.join("config.json"));
    std::fs::write(&mp, manifest).unwrap();
    std::fs::write(&cp, config).unwrap();
    let out = Command::new(bin).arg(&mp).arg(&cp).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn published_artifacts_validate_as_modelpack_and_broken_ones_do_not() {
    let Some(validator) = tool(
        "FLEXINFER_MODELPACK_VALIDATE",
        "scripts/modelpack/validator.sh",
    ) else {
        return;
    };
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let (gptq, gguf) = (tmp.path().join("gptq"), tmp.path().join("gguf"));
    gptq_tree(&gptq);
    std::fs::create_dir_all(&gguf).unwrap();
    gguf_tree(&gguf);

    let mut published = Vec::new();
    for (dir, repo, want) in [
        (
            &gptq,
            "mp/gptq",
            serde_json::json!({
                "descriptor": {"createdAt": "2026-12-01T10:20:30Z", "family": "qwen2"},
                "config": {"architecture": "Qwen2ForCausalLM", "format": "safetensors",
                    "paramSize": "72.3K", "precision": "float16", "quantization": "gptq"},
            }),
        ),
        (
            &gguf,
            "mp/gguf",
            serde_json::json!({
                "descriptor": {"createdAt": "2026-12-01T10:20:30Z", "family": "llama", "name": "Tiny Llama"},
                "config": {"architecture": "llama", "format": "gguf", "paramSize": "2.6K",
                    "quantization": "Q4_K_M"},
            }),
        ),
    ] {
        let (manifest, config) = publish(&reg, dir, repo, tmp.path());
        let (code, out) = validate(&validator, &manifest, &config, tmp.path());
        assert_eq!(code, 0, "{repo}: {out}");
        assert!(out.contains("valid ModelPack artifact"), "{out}");
        let c: serde_json::Value = serde_json::from_slice(&config).unwrap();
        assert_eq!(c["descriptor"], want["descriptor"], "{repo}");
        assert_eq!(c["config"], want["config"], "{repo}");
        published.push((manifest, config));
    }
    let m: serde_json::Value = serde_json::from_slice(&published[0].0).unwrap();
    assert_eq!(
        m["annotations"],
        serde_json::json!({
            "ai.flexinfer.model.quantization.bits": "4",
            "ai.flexinfer.model.quantization.group-size": "32",
            "ai.flexinfer.model.quality.gate": "passed",
        })
    );

    // The validator is not a rubber stamp: each break of the schema or the layout is rejected.
    let (manifest, config) = &published[0];
    let edit = |bytes: &[u8], f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
        f(&mut v);
        serde_json::to_vec(&v).unwrap()
    };
    let rehash = |manifest: &[u8], config: &[u8]| {
        edit(manifest, &|m| {
            m["config"]["digest"] = format!("sha256:{}", sha256_hex(config)).into();
            m["config"]["size"] = config.len().into();
        })
    };
    let config_breaks: [Break; 5] = [
        (
            "bits as a config field",
            &|c| c["config"]["bits"] = 4.into(),
            "additionalProperties",
        ),
        (
            "modelfs.type other than layers",
            &|c| c["modelfs"]["type"] = "tar".into(),
            "modelfs",
        ),
        (
            "createdAt not a date-time",
            &|c| c["descriptor"]["createdAt"] = "yesterday".into(),
            "createdAt",
        ),
        (
            "an empty name",
            &|c| c["descriptor"]["name"] = "".into(),
            "name",
        ),
        (
            "a DiffID missing",
            &|c| {
                c["modelfs"]["diffIds"].as_array_mut().unwrap().pop();
            },
            "diffIds",
        ),
    ];
    for (what, f, want) in config_breaks {
        let broken = edit(config, f);
        let (code, out) = validate(&validator, &rehash(manifest, &broken), &broken, tmp.path());
        assert_eq!(code, 1, "{what}: {out}");
        assert!(out.contains(want), "{what}: {out}");
    }
    let manifest_breaks: [Break; 4] = [
        (
            "the pre-ModelPack artifact type",
            &|m| m["artifactType"] = "application/vnd.flexinfer.model.v1".into(),
            "artifactType",
        ),
        (
            "the empty config media type",
            &|m| m["config"]["mediaType"] = "application/vnd.oci.empty.v1+json".into(),
            "config mediaType",
        ),
        (
            "a layer media type of our own",
            &|m| m["layers"][0]["mediaType"] = "application/vnd.flexinfer.model.file.v1".into(),
            "not a ModelPack layer type",
        ),
        (
            "a layer without its file path",
            &|m| {
                m["layers"][1]["annotations"]
                    .as_object_mut()
                    .unwrap()
                    .remove("org.cncf.model.filepath");
            },
            "org.cncf.model.filepath",
        ),
    ];
    for (what, f, want) in manifest_breaks {
        let (code, out) = validate(&validator, &edit(manifest, f), config, tmp.path());
        assert_eq!(code, 1, "{what}: {out}");
        assert!(out.contains(want), "{what}: {out}");
    }
}

/// A way to break a manifest or config: what it is, the edit, what the validator's answer names.
type Break<'a> = (&'a str, &'a dyn Fn(&mut serde_json::Value), &'a str);

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(b))
}

#[test]
fn oras_pulls_the_published_tree_byte_for_byte() {
    let Some(oras) = tool("FLEXINFER_ORAS", "scripts/oras/oras.sh") else {
        return;
    };
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("gptq");
    gptq_tree(&src);
    let (manifest, _) = publish(&reg, &src, "mp/oras", tmp.path());
    let digest = format!("sha256:{}", sha256_hex(&manifest));
    let want = tree(&src, &[".flexinfer-gptq-cache"]);
    assert!(want.contains_key(".save-complete") && want.contains_key("tokenizer/tokenizer.json"));
    for (reference, into) in [
        (format!("{}/mp/oras:v1", reg.addr), "by-tag"),
        (format!("{}/mp/oras@{digest}", reg.addr), "by-digest"),
    ] {
        let out_dir = tmp.path().join(into);
        std::fs::create_dir_all(&out_dir).unwrap();
        let out = Command::new(&oras)
            .args(["pull", "--plain-http", "--no-tty", "-o"])
            .arg(&out_dir)
            .arg(&reference)
            .env("HOME", tmp.path()) // no docker config of the machine's
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "oras pull {reference}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(tree(&out_dir, &[]), want, "oras pull {reference}");
    }
}
