//! `flexinfer quantize validate-artifact --layout vllm-gptq`: a native check that a GPTQ
//! checkpoint directory is what vLLM (Marlin/ExLlama) and transformers load (docs/dev/gptq.md §2),
//! that the save completed (`.save-complete` sizes and sha256) and that the quality gate passed.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use flexinfer_api::contract::{files, QualitySummary, SaveComplete};
use flexinfer_fsutil::limits;
use serde::Serialize;
use serde_json::Value;

/// One defect (or warning): which check and the precise message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub check: &'static str,
    pub message: String,
}

/// Result of a validation run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub path: String,
    pub layout: String,
    pub ok: bool,
    pub defects: Vec<Finding>,
    pub warnings: Vec<Finding>,
    pub shards: usize,
    pub tensors: usize,
    pub quantized_linears: usize,
}

impl Report {
    fn defect(&mut self, check: &'static str, message: impl Into<String>) {
        self.defects.push(Finding {
            check,
            message: message.into(),
        });
    }
    fn warn(&mut self, check: &'static str, message: impl Into<String>) {
        self.warnings.push(Finding {
            check,
            message: message.into(),
        });
    }

    /// Human output: one line per defect/warning, then a summary line.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for d in &self.defects {
            s.push_str(&format!("DEFECT [{}] {}\n", d.check, d.message));
        }
        for w in &self.warnings {
            s.push_str(&format!("WARNING [{}] {}\n", w.check, w.message));
        }
        s.push_str(&format!(
            "{}: {} ({} shard(s), {} tensors, {} quantized linears, {} defect(s), {} warning(s))\n",
            if self.ok { "OK" } else { "INVALID" },
            self.path,
            self.shards,
            self.tensors,
            self.quantized_linears,
            self.defects.len(),
            self.warnings.len()
        ));
        s
    }
}

/// Options.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Expected model family (matched against config.json `model_type`), e.g. `qwen35`, `gemma4-26b-a4b`.
    pub family: Option<String>,
    /// Skip sha256 of the shards (sizes are still checked).
    pub skip_sha256: bool,
}

/// A tensor entry of a safetensors header.
#[derive(Debug, Clone, PartialEq)]
struct TensorInfo {
    shard: String,
    dtype: String,
    shape: Vec<u64>,
    /// Absolute byte range in the file.
    start: u64,
    end: u64,
}

/// GPTQ settings from `quantization_config`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Gptq {
    bits: u32,
    group_size: i64,
    sym: bool,
    desc_act: bool,
    v2: bool,
}

/// `dir/name` parsed as JSON; the name stays inside `dir`, the file is regular and within `limit`.
fn read_json(dir: &Path, name: &str, limit: flexinfer_fsutil::Limit) -> Result<Value, String> {
    let bytes = read_file(dir, name, limit)?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{name} is not valid JSON: {e}"))
}

fn read_file(dir: &Path, name: &str, limit: flexinfer_fsutil::Limit) -> Result<Vec<u8>, String> {
    flexinfer_fsutil::read_within(dir, name, limit).map_err(|e| format!("cannot read {name}: {e}"))
}

fn open_shard(dir: &Path, shard: &str) -> Result<File, String> {
    flexinfer_fsutil::open_regular_within(dir, shard)
        .map_err(|e| format!("{shard}: cannot open: {e}"))
}

/// Parse one safetensors header, checking that offsets are in order and inside the file (all
/// arithmetic on the header's numbers is checked).
fn read_header(dir: &Path, shard: &str) -> Result<Vec<(String, TensorInfo)>, String> {
    let mut f = open_shard(dir, shard)?;
    let file_len = f
        .metadata()
        .map_err(|e| format!("{shard}: cannot stat: {e}"))?
        .len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| format!("{shard}: shorter than the 8-byte safetensors header length"))?;
    let n = u64::from_le_bytes(len);
    if n > limits::SAFETENSORS_HEADER.bytes || n.saturating_add(8) > file_len {
        return Err(format!(
            "{shard}: header length {n} is larger than the file ({file_len} bytes)"
        ));
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf)
        .map_err(|e| format!("{shard}: truncated header: {e}"))?;
    let hdr: BTreeMap<String, Value> = serde_json::from_slice(&buf)
        .map_err(|e| format!("{shard}: header is not valid JSON: {e}"))?;
    let base = 8 + n;
    let mut out = Vec::new();
    let mut data_end = 0u64;
    for (name, t) in hdr {
        if name == "__metadata__" {
            continue;
        }
        let dtype = t
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{shard}: tensor {name} has no dtype"))?
            .to_string();
        let shape: Vec<u64> = t
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("{shard}: tensor {name} has no shape"))?
            .iter()
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| format!("{shard}: tensor {name} has a bad shape"))
            })
            .collect::<Result<_, _>>()?;
        let offs = t
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|a| a.len() == 2)
            .ok_or_else(|| format!("{shard}: tensor {name} has no data_offsets"))?;
        let (s, e) = match (offs[0].as_u64(), offs[1].as_u64()) {
            (Some(s), Some(e)) if s <= e => (s, e),
            _ => return Err(format!("{shard}: tensor {name} has bad data_offsets")),
        };
        let elem = dtype_size(&dtype);
        let bytes = elem.and_then(|sz| {
            shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .and_then(|n| n.checked_mul(sz))
        });
        match (elem, bytes) {
            (Some(_), None) => {
                return Err(format!(
                    "{shard}: tensor {name} {dtype} {shape:?} overflows a 64-bit size"
                ))
            }
            (Some(_), Some(b)) if b != e - s => {
                return Err(format!(
                    "{shard}: tensor {name} {dtype} {shape:?} needs {b} bytes but data_offsets span {}",
                    e - s
                ));
            }
            _ => {}
        }
        let (Some(start), Some(end)) = (base.checked_add(s), base.checked_add(e)) else {
            return Err(format!(
                "{shard}: tensor {name} has data_offsets past the file"
            ));
        };
        data_end = data_end.max(e);
        out.push((
            name,
            TensorInfo {
                shard: shard.to_string(),
                dtype,
                shape,
                start,
                end,
            },
        ));
    }
    let total = base.saturating_add(data_end);
    if total > file_len {
        return Err(format!(
            "{shard}: truncated: tensor data ends at byte {total} but the file has {file_len} bytes"
        ));
    }
    Ok(out)
}

fn dtype_size(d: &str) -> Option<u64> {
    Some(match d {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return None,
    })
}

fn read_bytes(dir: &Path, t: &TensorInfo) -> Result<Vec<u8>, String> {
    let mut f = open_shard(dir, &t.shard)?;
    f.seek(SeekFrom::Start(t.start))
        .map_err(|e| format!("{}: {e}", t.shard))?;
    let len = usize::try_from(t.end.saturating_sub(t.start))
        .map_err(|_| format!("{}: tensor too large for this machine", t.shard))?;
    let mut buf = vec![0u8; len];
    f.read_exact(&mut buf)
        .map_err(|e| format!("{}: {e}", t.shard))?;
    Ok(buf)
}

fn i32s(b: &[u8]) -> impl Iterator<Item = i32> + '_ {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

fn sha256_file(path: &Path) -> Result<String, String> {
    flexinfer_fsutil::sha256_file(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parse and check `quantization_config` (config.json) against docs/dev/gptq.md §2.4/§2.5.
fn check_qconfig(r: &mut Report, qc: &Value, origin: &str) -> Option<Gptq> {
    let mut ok = true;
    match qc.get("quant_method").and_then(Value::as_str) {
        Some("gptq") => {}
        Some(m) => {
            r.defect(
                "config",
                format!("{origin}: quant_method is {m:?}, expected \"gptq\""),
            );
            ok = false;
        }
        None => {
            r.defect(
                "config",
                format!("{origin}: quant_method is missing (vLLM routes on quant_method \"gptq\")"),
            );
            ok = false;
        }
    }
    let bits = match qc.get("bits").and_then(Value::as_u64) {
        Some(b) if [2, 3, 4, 8].contains(&b) => Some(b as u32),
        Some(b) => {
            r.defect("config", format!("{origin}: bits {b} is not 2, 3, 4 or 8"));
            None
        }
        None => {
            r.defect("config", format!("{origin}: bits is missing (vLLM Marlin needs bits, group_size, sym and desc_act)"));
            None
        }
    };
    let group = match qc.get("group_size").and_then(Value::as_i64) {
        Some(g) if g == -1 || (g > 0 && (g as u64).is_power_of_two()) => Some(g),
        Some(g) => {
            r.defect(
                "config",
                format!("{origin}: group_size {g} is not -1 or a power of two"),
            );
            None
        }
        None => {
            r.defect("config", format!("{origin}: group_size is missing (vLLM Marlin needs bits, group_size, sym and desc_act)"));
            None
        }
    };
    let mut flag = |name: &str| match qc.get(name) {
        Some(Value::Bool(b)) => Some(*b),
        Some(v) => {
            r.defect(
                "config",
                format!("{origin}: {name} is {v}, expected true or false"),
            );
            None
        }
        None => {
            r.defect("config", format!("{origin}: {name} is missing (vLLM Marlin needs bits, group_size, sym and desc_act)"));
            None
        }
    };
    let sym = flag("sym");
    let desc_act = flag("desc_act");
    let v2 = match qc.get("checkpoint_format").and_then(Value::as_str) {
        None | Some("gptq") => false,
        Some("gptq_v2") => true,
        Some(other) => {
            r.defect(
                "config",
                format!("{origin}: checkpoint_format {other:?} is not \"gptq\" or \"gptq_v2\""),
            );
            ok = false;
            false
        }
    };
    match (ok, bits, group, sym, desc_act) {
        (true, Some(bits), Some(group_size), Some(sym), Some(desc_act)) => Some(Gptq {
            bits,
            group_size,
            sym,
            desc_act,
            v2,
        }),
        _ => None,
    }
}

/// Expected (in, out) of well-known decoder linears, from the text config.
fn expected_shape(cfg: &Value, module: &str) -> Option<(u64, u64)> {
    let t = match cfg.get("text_config") {
        Some(t) if t.is_object() => t,
        _ => cfg,
    };
    let g = |k: &str| t.get(k).and_then(Value::as_u64);
    let h = g("hidden_size")?;
    let heads = g("num_attention_heads");
    let kv = g("num_key_value_heads").or(heads);
    let hd = g("head_dim").or_else(|| heads.map(|n| h / n.max(1)));
    if module.contains("experts") || module.contains("linear_attn") || module.contains("vision") {
        return None;
    }
    let leaf = module.rsplit('.').next()?;
    let parent = module.rsplit('.').nth(1).unwrap_or("");
    if parent != "self_attn" && parent != "mlp" {
        return None;
    }
    Some(match leaf {
        "q_proj" => (h, heads? * hd?),
        "k_proj" | "v_proj" => (h, kv? * hd?),
        "o_proj" => (heads? * hd?, h),
        "gate_proj" | "up_proj" => (h, g("intermediate_size")?),
        "down_proj" => (g("intermediate_size")?, h),
        _ => return None,
    })
}

/// Normalized alphanumerics for the family match.
fn norm(s: &str) -> String {
    s.chars()
        .filter(char::is_ascii_alphanumeric)
        .collect::<String>()
        .to_ascii_lowercase()
}

/// Validate `dir` with the `vllm-gptq` layout.
pub fn validate_vllm_gptq(dir: &Path, opts: &Options) -> Report {
    let mut r = Report {
        path: dir.display().to_string(),
        layout: "vllm-gptq".into(),
        ..Default::default()
    };

    // --- config.json and quantize_config.json
    let cfg = match read_json(dir, "config.json", limits::CONFIG_JSON) {
        Ok(v) => Some(v),
        Err(e) => {
            r.defect("config", e);
            None
        }
    };
    let mut gptq = None;
    if let Some(cfg) = &cfg {
        match cfg.get("quantization_config") {
            Some(qc) if qc.is_object() => gptq = check_qconfig(&mut r, qc, "config.json quantization_config"),
            _ => r.defect(
                "config",
                "config.json has no quantization_config object (vLLM and transformers read the GPTQ settings from it)",
            ),
        }
        if let Some(fam) = &opts.family {
            let want = norm(fam.split('-').next().unwrap_or(fam));
            match cfg.get("model_type").and_then(Value::as_str) {
                Some(mt) if norm(mt).contains(&want) || want.contains(&norm(mt)) => {}
                Some(mt) => r.defect(
                    "family",
                    format!("config.json model_type {mt:?} does not match --family {fam}"),
                ),
                None => r.defect(
                    "family",
                    format!("config.json has no model_type to match --family {fam}"),
                ),
            }
        }
    }
    let save_complete: Option<SaveComplete> =
        match read_file(dir, files::SAVE_COMPLETE, limits::CONFIG_JSON) {
            Ok(b) => match serde_json::from_slice(&b) {
                Ok(s) => Some(s),
                Err(e) => {
                    r.defect(
                        "save-complete",
                        format!("{} is not valid: {e}", files::SAVE_COMPLETE),
                    );
                    None
                }
            },
            Err(_) if dir.join(files::SAVE_COMPLETE).symlink_metadata().is_err() => {
                r.defect(
                    "save-complete",
                    format!(
                        "{} is missing: the save did not complete (or predates the marker)",
                        files::SAVE_COMPLETE
                    ),
                );
                None
            }
            Err(e) => {
                r.defect("save-complete", e);
                None
            }
        };
    let qcfg_path = dir.join("quantize_config.json");
    if qcfg_path.symlink_metadata().is_ok() {
        match read_json(dir, "quantize_config.json", limits::CONFIG_JSON) {
            Ok(q) => {
                if let Some(main) = cfg.as_ref().and_then(|c| c.get("quantization_config")) {
                    for k in [
                        "quant_method",
                        "bits",
                        "group_size",
                        "sym",
                        "desc_act",
                        "checkpoint_format",
                    ] {
                        let (a, b) = (main.get(k), q.get(k));
                        // quantize_config.json may omit quant_method/checkpoint_format (defaults).
                        if b.is_none() && (k == "quant_method" || k == "checkpoint_format") {
                            continue;
                        }
                        if a != b {
                            r.defect(
                                "config",
                                format!(
                                    "{k} differs: config.json quantization_config has {}, quantize_config.json has {}",
                                    a.map_or("nothing".to_string(), Value::to_string),
                                    b.map_or("nothing".to_string(), Value::to_string)
                                ),
                            );
                        }
                    }
                }
            }
            Err(e) => r.defect("config", e),
        }
    } else if save_complete
        .as_ref()
        .is_some_and(|s| s.has_quantize_config)
    {
        r.defect(
            "config",
            "quantize_config.json is missing but .save-complete records has_quantize_config",
        );
    } else {
        r.warn(
            "config",
            "quantize_config.json is missing (GPTQModel/AutoGPTQ loaders read it)",
        );
    }

    // --- shards and index
    let mut shard_files: Vec<String> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n.ends_with(".safetensors"))
            .collect(),
        Err(e) => {
            r.defect("shards", format!("cannot list {}: {e}", dir.display()));
            Vec::new()
        }
    };
    shard_files.sort();
    if shard_files.is_empty() {
        r.defect("shards", "no *.safetensors files");
    }
    r.shards = shard_files.len();
    let mut tensors: BTreeMap<String, TensorInfo> = BTreeMap::new();
    for s in &shard_files {
        match read_header(dir, s) {
            Ok(list) => {
                for (name, t) in list {
                    if let Some(prev) = tensors.get(&name) {
                        r.defect(
                            "shards",
                            format!("tensor {name} is in both {} and {s}", prev.shard),
                        );
                    }
                    tensors.insert(name, t);
                }
            }
            Err(e) => r.defect("shards", e),
        }
    }
    r.tensors = tensors.len();
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.symlink_metadata().is_ok() {
        match read_json(dir, "model.safetensors.index.json", limits::INDEX_JSON) {
            Ok(idx) => match idx.get("weight_map").and_then(Value::as_object) {
                Some(map) => {
                    for (name, t) in &tensors {
                        match map.get(name).and_then(Value::as_str) {
                            Some(f) if f == t.shard => {}
                            Some(f) => r.defect(
                                "index",
                                format!("model.safetensors.index.json maps {name} to {f}, but it is in {}", t.shard),
                            ),
                            None => r.defect(
                                "index",
                                format!("model.safetensors.index.json does not cover tensor {name} (in {})", t.shard),
                            ),
                        }
                    }
                    for (name, f) in map {
                        if !tensors.contains_key(name) {
                            r.defect(
                                "index",
                                format!(
                                    "model.safetensors.index.json lists {name} in {} but no shard contains it",
                                    f.as_str().unwrap_or("?")
                                ),
                            );
                        }
                    }
                }
                None => r.defect("index", "model.safetensors.index.json has no weight_map"),
            },
            Err(e) => r.defect("index", e),
        }
    } else if shard_files.len() > 1 {
        r.defect(
            "index",
            format!(
                "{} shards but no model.safetensors.index.json",
                shard_files.len()
            ),
        );
    } else if save_complete.as_ref().is_some_and(|s| s.has_index) {
        r.defect(
            "index",
            "model.safetensors.index.json is missing but .save-complete records has_index",
        );
    }

    // --- quantized linears
    let prefixes: Vec<String> = tensors
        .keys()
        .filter_map(|n| n.strip_suffix(".qweight").map(str::to_string))
        .collect();
    r.quantized_linears = prefixes.len();
    if prefixes.is_empty() && !tensors.is_empty() {
        r.defect("tensors", "no quantized linear (no tensor named *.qweight)");
    }
    if let Some(g) = gptq {
        for p in &prefixes {
            check_linear(&mut r, dir, &tensors, p, g, cfg.as_ref());
        }
    }

    // --- .save-complete
    if let Some(sc) = &save_complete {
        let listed: BTreeSet<&str> = sc.shards.iter().map(|s| s.name.as_str()).collect();
        for s in &sc.shards {
            if flexinfer_api::contract::check_relative_path(&s.name).is_err()
                || s.name.contains('/')
            {
                r.defect(
                    "save-complete",
                    format!("shard name {:?} is not a plain file name", s.name),
                );
                continue;
            }
            let path = match flexinfer_fsutil::resolve_within(dir, &s.name) {
                Ok(p) => p,
                Err(e) if flexinfer_fsutil::is_refused(&e) => {
                    r.defect("save-complete", format!("shard {}: {e}", s.name));
                    continue;
                }
                Err(_) => {
                    r.defect(
                        "save-complete",
                        format!("shard {} is recorded but missing", s.name),
                    );
                    continue;
                }
            };
            match std::fs::metadata(&path) {
                Err(_) => r.defect(
                    "save-complete",
                    format!("shard {} is recorded but missing", s.name),
                ),
                Ok(m) if m.len() != s.size_bytes => r.defect(
                    "save-complete",
                    format!(
                        "shard {} has {} bytes, .save-complete records {}",
                        s.name,
                        m.len(),
                        s.size_bytes
                    ),
                ),
                Ok(_) if !opts.skip_sha256 => match sha256_file(&path) {
                    Ok(h) if h.eq_ignore_ascii_case(&s.sha256) => {}
                    Ok(h) => r.defect(
                        "save-complete",
                        format!(
                            "shard {} sha256 is {h}, .save-complete records {}",
                            s.name, s.sha256
                        ),
                    ),
                    Err(e) => r.defect("save-complete", e),
                },
                Ok(_) => {}
            }
        }
        for s in &shard_files {
            if !listed.contains(s.as_str()) {
                r.defect(
                    "save-complete",
                    format!("shard {s} is not recorded in .save-complete"),
                );
            }
        }
        if sc.has_config && !dir.join("config.json").exists() {
            r.defect(
                "save-complete",
                ".save-complete records has_config but config.json is missing",
            );
        }
    }

    // --- quality sidecar
    match read_file(dir, files::QUANTIZATION_QUALITY, limits::CONFIG_JSON) {
        Err(e)
            if dir
                .join(files::QUANTIZATION_QUALITY)
                .symlink_metadata()
                .is_ok() =>
        {
            r.defect("quality", e)
        }
        Err(_) => r.defect(
            "quality",
            format!("{} is missing", files::QUANTIZATION_QUALITY),
        ),
        Ok(b) => match serde_json::from_slice::<QualitySummary>(&b) {
            Err(e) => r.defect(
                "quality",
                format!("{} is not valid: {e}", files::QUANTIZATION_QUALITY),
            ),
            Ok(q) => match q.gate.as_str() {
                "passed" | "insufficient-sample" => {}
                "failed" => r.defect(
                    "quality",
                    format!(
                        "quality gate failed: {} of {} modules fell back to RTN ({:.2}% > {:.2}%)",
                        q.rtn_fallback_modules,
                        q.gptq_modules + q.rtn_fallback_modules,
                        q.rtn_fallback_percent,
                        q.max_rtn_fallback_percent
                    ),
                ),
                other => r.defect(
                    "quality",
                    format!("quality gate {other:?} is not passed/failed/insufficient-sample"),
                ),
            },
        },
    }

    r.ok = r.defects.is_empty();
    r
}

fn check_linear(
    r: &mut Report,
    dir: &Path,
    tensors: &BTreeMap<String, TensorInfo>,
    p: &str,
    g: Gptq,
    cfg: Option<&Value>,
) {
    let get = |suffix: &str| tensors.get(&format!("{p}.{suffix}"));
    let mut missing = false;
    for s in ["qzeros", "scales", "g_idx"] {
        if get(s).is_none() {
            r.defect("tensors", format!("{p}: {p}.{s} is missing"));
            missing = true;
        }
    }
    let want_dtype = [
        ("qweight", "I32"),
        ("qzeros", "I32"),
        ("scales", "F16"),
        ("g_idx", "I32"),
    ];
    for (s, d) in want_dtype {
        if let Some(t) = get(s) {
            if t.dtype != d {
                r.defect("dtypes", format!("{p}.{s} is {}, expected {d}", t.dtype));
                missing = true;
            }
            if t.shape.len() != if s == "g_idx" { 1 } else { 2 } {
                r.defect(
                    "shapes",
                    format!(
                        "{p}.{s} has shape {:?}, expected {}-D",
                        t.shape,
                        if s == "g_idx" { 1 } else { 2 }
                    ),
                );
                missing = true;
            }
        }
    }
    if missing {
        return;
    }
    let (Some(qw), Some(qz), Some(sc), Some(gi)) =
        (get("qweight"), get("qzeros"), get("scales"), get("g_idx"))
    else {
        return;
    };
    // packed rows per 32 inputs: bits (3-bit: 3 words per 32 rows; 2/4/8: 32/pf = bits)
    let bits = g.bits as u64;
    let in_features = qw.shape[0] * 32 / bits;
    let out = qw.shape[1];
    let groups = if g.group_size <= 0 {
        1
    } else {
        in_features.div_ceil(g.group_size as u64)
    };
    let packed_out = out * bits / 32;
    if !(out * bits).is_multiple_of(32) {
        r.defect(
            "shapes",
            format!("{p}: out_features {out} is not a multiple of the pack factor for {bits}-bit"),
        );
    }
    if sc.shape != [groups, out] {
        r.defect("shapes", format!("{p}.scales has shape {:?}, expected [{groups}, {out}] (groups = ceil({in_features}/{}))", sc.shape, g.group_size));
    }
    if qz.shape != [groups, packed_out] {
        r.defect(
            "shapes",
            format!(
                "{p}.qzeros has shape {:?}, expected [{groups}, {packed_out}]",
                qz.shape
            ),
        );
    }
    if gi.shape != [in_features] {
        r.defect(
            "shapes",
            format!(
                "{p}.g_idx has shape {:?}, expected [{in_features}] (qweight {:?} at {bits} bits)",
                gi.shape, qw.shape
            ),
        );
    }
    if let Some((ei, eo)) = cfg.and_then(|c| expected_shape(c, p)) {
        if (ei, eo) != (in_features, out) {
            r.defect(
                "shapes",
                format!("{p}: quantized as [{in_features} in, {out} out] but config.json implies [{ei} in, {eo} out]"),
            );
        }
    }
    // g_idx values
    if gi.shape == [in_features] {
        match read_bytes(dir, gi) {
            Ok(b) => {
                let mut bad = None;
                let mut identity = true;
                for (i, v) in i32s(&b).enumerate() {
                    if v < 0 || v as u64 >= groups {
                        bad = Some((i, v));
                        break;
                    }
                    let want = if g.group_size <= 0 {
                        0
                    } else {
                        i as i64 / g.group_size
                    };
                    if v as i64 != want {
                        identity = false;
                    }
                }
                if let Some((i, v)) = bad {
                    r.defect(
                        "g_idx",
                        format!("{p}.g_idx[{i}] = {v} is outside [0, {groups})"),
                    );
                } else if !g.desc_act && !identity {
                    r.defect("g_idx", format!("{p}.g_idx is not i / group_size but desc_act is false (loaders would ignore the reordering)"));
                }
            }
            Err(e) => r.defect("g_idx", e),
        }
    }
    // symmetric zero points have a fixed packed pattern
    if g.sym && qz.shape == [groups, packed_out] {
        let expect: Option<u32> = match (g.bits, g.v2) {
            (4, false) => Some(0x7777_7777),
            (4, true) => Some(0x8888_8888),
            (8, false) => Some(0x7f7f_7f7f),
            (8, true) => Some(0x8080_8080),
            (2, false) => Some(0x5555_5555),
            (2, true) => Some(0xaaaa_aaaa),
            _ => None,
        };
        if let Some(want) = expect {
            match read_bytes(dir, qz) {
                Ok(b) => {
                    if let Some((i, v)) = i32s(&b).enumerate().find(|(_, v)| *v as u32 != want) {
                        r.defect(
                            "qzeros",
                            format!(
                                "{p}.qzeros word {i} is 0x{:08x}, expected 0x{want:08x} for symmetric {}-bit {}",
                                v as u32,
                                g.bits,
                                if g.v2 { "gptq_v2" } else { "gptq (v1)" }
                            ),
                        );
                    }
                }
                Err(e) => r.defect("qzeros", e),
            }
        }
    }
    // scales must be finite and positive
    if sc.shape == [groups, out] {
        if let Ok(b) = read_bytes(dir, sc) {
            let bad = b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .position(|v| !v.is_finite() || v <= 0.0);
            if let Some(i) = bad {
                r.defect(
                    "scales",
                    format!("{p}.scales element {i} is not a finite positive number"),
                );
            }
        }
    }
}

/// Entry point used by the command: validates the layout name first.
pub fn validate(dir: &Path, layout: &str, opts: &Options) -> Result<Report, String> {
    if layout != "vllm-gptq" {
        return Err(format!("--layout {layout}: only vllm-gptq is supported"));
    }
    if !dir.is_dir() {
        return Err(format!("--path {}: not a directory", dir.display()));
    }
    Ok(validate_vllm_gptq(dir, opts))
}

#[cfg(test)]
#[path = "artifact_tests.rs"]
mod tests;
