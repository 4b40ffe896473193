//! `--layout awq`: a checkpoint in AutoAWQ's GEMM layout, as vLLM's `awq` method and transformers' AWQ
//! loader read it (docs/user/quantization-pipelines.md "AWQ (vLLM)"): `quantization_config`
//! (`quant_method: awq`, `version: gemm`, 4 bits, a group size the GEMM kernels take, zero points), every
//! `<m>.qweight` `I32 [in, out/8]` beside `qzeros` `I32 [in/group, out/8]` and `scales` `F16 [in/group,
//! out]` (finite, positive), no dense `<m>.weight` or GPTQ `g_idx` beside them, the shapes `config.json`
//! implies, no quantized module matched by `modules_to_not_convert` and no dense linear of a quantized
//! kind left out of it; then the shards, index, `.save-complete` and the AWQ quality sidecar (its gate
//! passed).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use flexinfer_api::contract::env::{AWQ_GROUP_SIZES, FORMAT_AWQ};
use flexinfer_api::contract::{files, AwqQuality};
use flexinfer_fsutil::limits;
use serde_json::Value;

use super::config::{check_family, expected_shape};
use super::read::{read_file, read_json, TensorInfo};
use super::{shards, validate_layout, Options, Report};
use flexinfer_api::contract::error::chain;

/// Bits of a code in the GEMM layout.
const BITS: u64 = 4;
/// Codes per `I32` word.
const PACK: u64 = 32 / BITS;

/// Whether `config.json` in `dir` declares `quant_method: awq`.
pub fn is_awq(dir: &Path) -> bool {
    read_json(dir, "config.json", limits::CONFIG_JSON)
        .ok()
        .and_then(|c| c.get("quantization_config").cloned())
        .is_some_and(|qc| qc.get("quant_method").and_then(Value::as_str) == Some("awq"))
}

/// What `quantization_config` says.
struct Scheme {
    group_size: u64,
    modules_to_not_convert: Vec<String>,
}

impl Scheme {
    /// vLLM's rule (`is_layer_skipped_awq`): a module is kept dense when an entry is a substring of its name.
    fn skips(&self, module: &str) -> Option<&str> {
        self.modules_to_not_convert
            .iter()
            .find(|e| module.contains(e.as_str()))
            .map(String::as_str)
    }
}

/// The first of `keys` that `qc` has (vLLM reads `bits` or `w_bit`, `group_size` or `q_group_size`).
fn first<'a>(qc: &'a Value, keys: &[&'static str]) -> Option<(&'static str, &'a Value)> {
    keys.iter().find_map(|k| qc.get(*k).map(|v| (*k, v)))
}

fn check_config(r: &mut Report, dir: &Path, opts: &Options) -> (Option<Value>, Option<Scheme>) {
    let cfg = match read_json(dir, "config.json", limits::CONFIG_JSON) {
        Ok(c) => c,
        Err(e) => {
            r.defect("config", chain(&e));
            return (None, None);
        }
    };
    check_family(r, &cfg, opts);
    let Some(qc) = cfg.get("quantization_config").filter(|q| q.is_object()) else {
        r.defect("config", "config.json has no quantization_config object");
        return (Some(cfg), None);
    };
    let mut ok = true;
    let method = qc.get("quant_method").and_then(Value::as_str);
    if method != Some("awq") {
        r.defect(
            "config",
            format!("quantization_config.quant_method is {method:?}, expected \"awq\""),
        );
        ok = false;
    }
    // transformers and vLLM read the version case-insensitively.
    let version = qc.get("version").and_then(Value::as_str);
    if !version.is_some_and(|v| v.eq_ignore_ascii_case("gemm")) {
        r.defect(
            "config",
            format!("quantization_config.version is {version:?}, expected \"gemm\" (the layout of qweight/qzeros checked here)"),
        );
        ok = false;
    }
    match first(qc, &["bits", "w_bit"]) {
        Some((_, v)) if v.as_u64() == Some(BITS) => {}
        Some((k, v)) => {
            r.defect(
                "config",
                format!("quantization_config.{k} is {v}, expected 4 (the GEMM layout holds 4-bit codes)"),
            );
            ok = false;
        }
        None => {
            r.defect(
                "config",
                "quantization_config has no bits (or w_bit), expected 4",
            );
            ok = false;
        }
    }
    let group_size = match first(qc, &["group_size", "q_group_size"]) {
        Some((_, v))
            if v.as_u64()
                .and_then(|g| usize::try_from(g).ok())
                .is_some_and(|g| AWQ_GROUP_SIZES.contains(&g)) =>
        {
            v.as_u64().unwrap_or(0)
        }
        found => {
            let sizes = AWQ_GROUP_SIZES.map(|g| g.to_string()).join(", ");
            r.defect(
                "config",
                match found {
                    Some((k, v)) => format!(
                        "quantization_config.{k} is {v}, expected one of {sizes} (the GEMM kernels' group sizes)"
                    ),
                    None => format!(
                        "quantization_config has no group_size (or q_group_size), expected one of {sizes}"
                    ),
                },
            );
            ok = false;
            0
        }
    };
    let zp = qc.get("zero_point");
    if zp.and_then(Value::as_bool) != Some(true) {
        r.defect(
            "config",
            format!(
                "quantization_config.zero_point is {}, expected true (the GEMM layout carries qzeros)",
                zp.map_or("missing".to_string(), Value::to_string)
            ),
        );
        ok = false;
    }
    let modules_to_not_convert = match qc.get("modules_to_not_convert") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        Some(other) => {
            r.defect(
                "config",
                format!("quantization_config.modules_to_not_convert is {other}, expected a list of module names"),
            );
            ok = false;
            Vec::new()
        }
    };
    if modules_to_not_convert.iter().any(String::is_empty) {
        r.defect(
            "config",
            "quantization_config.modules_to_not_convert holds an empty name (it would match every module)",
        );
        ok = false;
    }
    let scheme = ok.then_some(Scheme {
        group_size,
        modules_to_not_convert,
    });
    (Some(cfg), scheme)
}

/// One quantized linear `m` (it has `m.qweight`); a defect naming the tensor for each difference.
fn check_linear(
    r: &mut Report,
    dir: &Path,
    tensors: &BTreeMap<String, TensorInfo>,
    m: &str,
    scheme: &Scheme,
    cfg: Option<&Value>,
) {
    let get = |k: &str| tensors.get(&format!("{m}.{k}"));
    if let Some(entry) = scheme.skips(m) {
        r.defect(
            "linear",
            format!("{m} is quantized but modules_to_not_convert entry {entry:?} matches it (vLLM would load it dense)"),
        );
    }
    for extra in ["weight", "g_idx"] {
        if get(extra).is_some() {
            r.defect(
                "linear",
                format!(
                    "{m}.{extra} is present beside {m}.qweight (not part of the AWQ GEMM layout)"
                ),
            );
        }
    }
    let mut usable = true;
    for (k, dtype) in [("qweight", "I32"), ("qzeros", "I32"), ("scales", "F16")] {
        match get(k) {
            None => {
                r.defect("linear", format!("{m}.{k} is missing"));
                usable = false;
            }
            Some(t) if t.dtype != dtype || t.shape.len() != 2 => {
                r.defect(
                    "linear",
                    format!(
                        "{m}.{k} is {} {:?}, expected a 2-D {dtype}",
                        t.dtype, t.shape
                    ),
                );
                usable = false;
            }
            Some(_) => {}
        }
    }
    let (Some(qw), Some(qz), Some(sc)) = (get("qweight"), get("qzeros"), get("scales")) else {
        return;
    };
    if !usable {
        return;
    }
    let (in_features, words) = (qw.shape[0], qw.shape[1]);
    // Shapes come from an untrusted header: a product that does not fit is a defect, not a panic.
    let Some(out) = words.checked_mul(PACK) else {
        r.defect(
            "linear",
            format!("{m}.qweight has shape {:?}, too large", qw.shape),
        );
        return;
    };
    let group = scheme.group_size;
    if in_features == 0 || words == 0 || !in_features.is_multiple_of(group) {
        r.defect(
            "linear",
            format!("{m}.qweight has shape {:?}: its {in_features} input features are not a positive multiple of group_size {group}", qw.shape),
        );
        return;
    }
    let groups = in_features / group;
    if qz.shape != [groups, words] {
        r.defect(
            "linear",
            format!(
                "{m}.qzeros has shape {:?}, expected [{groups}, {words}] (qweight {:?}, group_size {group})",
                qz.shape, qw.shape
            ),
        );
    }
    if sc.shape != [groups, out] {
        r.defect(
            "linear",
            format!(
                "{m}.scales has shape {:?}, expected [{groups}, {out}] (qweight {:?}, group_size {group})",
                sc.shape, qw.shape
            ),
        );
    } else {
        shards::check_scales(r, dir, sc, &format!("{m}.scales"), |b| {
            b.chunks_exact(2)
                .map(|c| f64::from(half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
                .collect()
        });
    }
    if let Some(bias) = get("bias") {
        if bias.shape != [out] {
            r.defect(
                "linear",
                format!("{m}.bias has shape {:?}, expected [{out}]", bias.shape),
            );
        }
    }
    if let Some((ei, eo)) = cfg.and_then(|c| expected_shape(c, m)) {
        if (ei, eo) != (in_features, out) {
            r.defect(
                "linear",
                format!("{m}: quantized as [{in_features} in, {out} out] but config.json implies [{ei} in, {eo} out]"),
            );
        }
    }
}

/// A dense 2-D `<m>.weight` whose last name part is that of a quantized linear (another layer's
/// `self_attn.q_proj`, say) must be listed in `modules_to_not_convert`: vLLM builds it as an AWQ linear
/// and finds no `qweight`.
fn check_dense_linears(
    r: &mut Report,
    tensors: &BTreeMap<String, TensorInfo>,
    quantized: &[String],
    scheme: &Scheme,
) {
    let kinds: BTreeSet<&str> = quantized
        .iter()
        .filter_map(|m| m.rsplit('.').next())
        .collect();
    for (name, t) in tensors {
        let Some(m) = name.strip_suffix(".weight") else {
            continue;
        };
        let kind = m.rsplit('.').next().unwrap_or(m);
        if t.shape.len() == 2 && kinds.contains(kind) && scheme.skips(m).is_none() {
            r.defect(
                "linear",
                format!("{name} is dense but {m} is not in modules_to_not_convert (vLLM would look for {m}.qweight)"),
            );
        }
    }
}

/// The AWQ quality sidecar: present, valid, and agreeing with the shards and `quantization_config`.
fn check_quality(r: &mut Report, dir: &Path, linears: usize, scheme: &Scheme) {
    let name = files::QUANTIZATION_QUALITY;
    let q = match read_file(dir, name, limits::CONFIG_JSON) {
        Err(e) => return r.defect("quality", format!("{name}: {}", chain(&e))),
        Ok(b) => match serde_json::from_slice::<AwqQuality>(&b) {
            Err(e) => {
                return r.defect(
                    "quality",
                    format!("{name} is not an AWQ quality summary: {e}"),
                )
            }
            Ok(q) => q,
        },
    };
    if q.format != FORMAT_AWQ {
        r.defect(
            "quality",
            format!("{name} is for format {:?}, expected \"AWQ\"", q.format),
        );
    }
    if q.quantized_modules != linears as u64 {
        r.defect(
            "quality",
            format!(
                "{name} counts {} quantized modules, the shards hold {linears}",
                q.quantized_modules
            ),
        );
    }
    match q.gate.as_str() {
        "passed" => {}
        "failed" => r.defect(
            "quality",
            format!(
                "quality gate failed: mean output error ratio to plain rounding {:.4} > {:.4} (worst {} at {:.4})",
                q.output_error_ratio,
                q.max_output_error_ratio,
                q.worst_output_error_module,
                q.worst_output_error_ratio
            ),
        ),
        "" => r.warn(
            "quality",
            format!("{name} records no gate (written before the AWQ quality gate)"),
        ),
        other => r.defect(
            "quality",
            format!("quality gate {other:?} is not passed or failed"),
        ),
    }
    if u64::from(q.bits) != BITS || u64::from(q.group_size) != scheme.group_size {
        r.defect(
            "quality",
            format!(
                "{name} records w{} g{}, quantization_config says w4 g{}",
                q.bits, q.group_size, scheme.group_size
            ),
        );
    }
}

/// Validate `dir` with the `awq` layout.
pub fn validate_awq(dir: &Path, opts: &Options) -> Report {
    validate_layout(
        dir,
        "awq",
        opts,
        |r| match check_config(r, dir, opts) {
            (cfg, Some(scheme)) => Some((cfg, scheme)),
            (_, None) => None,
        },
        |r, tensors, (cfg, scheme)| {
            let modules = shards::quantized_modules(r, tensors, ".qweight");
            for m in &modules {
                check_linear(r, dir, tensors, m, scheme, cfg.as_ref());
            }
            check_dense_linears(r, tensors, &modules, scheme);
            r.quantized_linears = modules.len();
            check_quality(r, dir, modules.len(), scheme);
        },
    )
}

#[cfg(test)]
mod tests;
