//! The configs: `config.json`'s `quantization_config` (the settings vLLM and transformers read), the
//! expected model family, and `quantize_config.json` agreeing with it.

use std::path::Path;

use flexinfer_api::contract::SaveComplete;
use flexinfer_fsutil::limits;
use serde_json::Value;

use super::read::read_json;
use super::{Options, Report};
use flexinfer_api::contract::error::chain;

/// GPTQ settings from `quantization_config`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Gptq {
    pub(super) bits: u32,
    pub(super) group_size: i64,
    pub(super) sym: bool,
    pub(super) desc_act: bool,
    pub(super) v2: bool,
}

/// `config.json`: present and valid, its `quantization_config` usable, its `model_type` matching
/// `--family`. Returns the config and the GPTQ settings when they are usable.
pub(super) fn check_config(
    r: &mut Report,
    dir: &Path,
    opts: &Options,
) -> (Option<Value>, Option<Gptq>) {
    let cfg = match read_json(dir, "config.json", limits::CONFIG_JSON) {
        Ok(v) => Some(v),
        Err(e) => {
            r.defect("config", chain(&e));
            None
        }
    };
    let mut gptq = None;
    if let Some(cfg) = &cfg {
        match cfg.get("quantization_config") {
            Some(qc) if qc.is_object() => gptq = check_qconfig(r, qc, "config.json quantization_config"),
            _ => r.defect(
                "config",
                "config.json has no quantization_config object (vLLM and transformers read the GPTQ settings from it)",
            ),
        }
        check_family(r, cfg, opts);
    }
    (cfg, gptq)
}

/// `config.json`'s `model_type` against `--family`, when given.
pub(super) fn check_family(r: &mut Report, cfg: &Value, opts: &Options) {
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

/// `quantize_config.json`: when present, the same settings as `config.json`; when missing, a defect
/// if `.save-complete` says it was written, else a warning.
pub(super) fn check_quantize_config(
    r: &mut Report,
    dir: &Path,
    cfg: Option<&Value>,
    save_complete: Option<&SaveComplete>,
) {
    let qcfg_path = dir.join("quantize_config.json");
    if qcfg_path.symlink_metadata().is_ok() {
        match read_json(dir, "quantize_config.json", limits::CONFIG_JSON) {
            Ok(q) => {
                if let Some(main) = cfg.and_then(|c| c.get("quantization_config")) {
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
            Err(e) => r.defect("config", chain(&e)),
        }
    } else if save_complete.is_some_and(|s| s.has_quantize_config) {
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
}

/// Parse and check `quantization_config` (config.json) against docs/dev/gptq.md, "What vLLM needs" and "Config fields".
fn check_qconfig(r: &mut Report, qc: &Value, origin: &str) -> Option<Gptq> {
    let method_ok = check_quant_method(r, qc, origin);
    let bits = check_bits(r, qc, origin);
    let group = check_group_size(r, qc, origin);
    let sym = check_flag(r, qc, origin, "sym");
    let desc_act = check_flag(r, qc, origin, "desc_act");
    let format = check_checkpoint_format(r, qc, origin);
    let ok = method_ok && format.is_some();
    let v2 = format.unwrap_or(false);
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

/// `quant_method` must be `"gptq"`; false (after a defect) otherwise.
fn check_quant_method(r: &mut Report, qc: &Value, origin: &str) -> bool {
    match qc.get("quant_method").and_then(Value::as_str) {
        Some("gptq") => true,
        Some(m) => {
            r.defect(
                "config",
                format!("{origin}: quant_method is {m:?}, expected \"gptq\""),
            );
            false
        }
        None => {
            r.defect(
                "config",
                format!("{origin}: quant_method is missing (vLLM routes on quant_method \"gptq\")"),
            );
            false
        }
    }
}

/// Defect: setting `name`, which vLLM's Marlin kernels need, is missing.
fn marlin_setting_missing(r: &mut Report, origin: &str, name: &str) {
    r.defect(
        "config",
        format!(
            "{origin}: {name} is missing (vLLM Marlin needs bits, group_size, sym and desc_act)"
        ),
    );
}

/// `bits`: 2, 3, 4 or 8.
fn check_bits(r: &mut Report, qc: &Value, origin: &str) -> Option<u32> {
    match qc.get("bits").and_then(Value::as_u64) {
        Some(b) if [2, 3, 4, 8].contains(&b) => Some(b as u32),
        Some(b) => {
            r.defect("config", format!("{origin}: bits {b} is not 2, 3, 4 or 8"));
            None
        }
        None => {
            marlin_setting_missing(r, origin, "bits");
            None
        }
    }
}

/// `group_size`: -1 or a power of two.
fn check_group_size(r: &mut Report, qc: &Value, origin: &str) -> Option<i64> {
    match qc.get("group_size").and_then(Value::as_i64) {
        Some(g) if g == -1 || (g > 0 && (g as u64).is_power_of_two()) => Some(g),
        Some(g) => {
            r.defect(
                "config",
                format!("{origin}: group_size {g} is not -1 or a power of two"),
            );
            None
        }
        None => {
            marlin_setting_missing(r, origin, "group_size");
            None
        }
    }
}

/// A boolean setting (`sym`, `desc_act`).
fn check_flag(r: &mut Report, qc: &Value, origin: &str, name: &str) -> Option<bool> {
    match qc.get(name) {
        Some(Value::Bool(b)) => Some(*b),
        Some(v) => {
            r.defect(
                "config",
                format!("{origin}: {name} is {v}, expected true or false"),
            );
            None
        }
        None => {
            marlin_setting_missing(r, origin, name);
            None
        }
    }
}

/// `checkpoint_format`: whether it is `gptq_v2` (absent means `gptq`); `None` (after a defect)
/// for any other value.
fn check_checkpoint_format(r: &mut Report, qc: &Value, origin: &str) -> Option<bool> {
    match qc.get("checkpoint_format").and_then(Value::as_str) {
        None | Some("gptq") => Some(false),
        Some("gptq_v2") => Some(true),
        Some(other) => {
            r.defect(
                "config",
                format!("{origin}: checkpoint_format {other:?} is not \"gptq\" or \"gptq_v2\""),
            );
            None
        }
    }
}

/// Expected (in, out) of well-known decoder linears, from the text config.
pub(super) fn expected_shape(cfg: &Value, module: &str) -> Option<(u64, u64)> {
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
    // Values from an untrusted config: a product that does not fit implies nothing.
    Some(match leaf {
        "q_proj" => (h, heads?.checked_mul(hd?)?),
        "k_proj" | "v_proj" => (h, kv?.checked_mul(hd?)?),
        "o_proj" => (heads?.checked_mul(hd?)?, h),
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
