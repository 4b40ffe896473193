//! What the two compressed-tensors layouts ([`super::fp8`] and [`super::pack_quantized`]) read alike
//! from `config.json`'s `quantization_config`: the declared format, the object itself, its one config
//! group and its `ignore` list.

use std::path::Path;

use flexinfer_fsutil::limits;
use serde_json::Value;

use super::read::read_json;
use super::Report;
use flexinfer_api::contract::error::chain;

/// Whether `config.json` in `dir` declares compressed-tensors with the given `format`.
pub(super) fn declares_format(dir: &Path, format: &str) -> bool {
    read_json(dir, "config.json", limits::CONFIG_JSON)
        .ok()
        .and_then(|c| c.get("quantization_config").cloned())
        .is_some_and(|qc| {
            qc.get("quant_method").and_then(Value::as_str) == Some("compressed-tensors")
                && qc.get("format").and_then(Value::as_str) == Some(format)
        })
}

/// `config.json`'s `quantization_config` object; an unreadable `config.json` or a missing object is a
/// defect.
pub(super) fn quantization_config(r: &mut Report, dir: &Path) -> Option<Value> {
    let mut cfg = match read_json(dir, "config.json", limits::CONFIG_JSON) {
        Ok(c) => c,
        Err(e) => {
            r.defect("config", chain(&e));
            return None;
        }
    };
    let qc = cfg
        .get_mut("quantization_config")
        .map(Value::take)
        .filter(Value::is_object);
    if qc.is_none() {
        r.defect("config", "config.json has no quantization_config object");
    }
    qc
}

/// The one group of `quantization_config.config_groups`: its name and value; none or several is a
/// defect.
pub(super) fn single_group<'a>(r: &mut Report, qc: &'a Value) -> Option<(&'a String, &'a Value)> {
    let groups = qc.get("config_groups").and_then(Value::as_object);
    let group = groups
        .filter(|g| g.len() == 1)
        .and_then(|g| g.iter().next());
    if group.is_none() {
        r.defect(
            "config",
            "quantization_config.config_groups must hold exactly one group",
        );
    }
    group
}

/// `quantization_config.ignore`: the names of the modules left unquantized (none when absent).
pub(super) fn ignore_list(qc: &Value) -> Vec<String> {
    qc.get("ignore")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}
