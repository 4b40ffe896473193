//! Each quantized linear: its four tensors present with the loaders' dtypes and shapes (and the shape
//! `config.json` implies), `g_idx` in range (and the identity without act-order), the fixed zero
//! points of a symmetric checkpoint, finite positive scales.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::config::{expected_shape, Gptq};
use super::read::{i32s, read_bytes, TensorInfo};
use super::Report;
use flexinfer_api::contract::error::chain;

/// Every quantized linear (a `*.qweight` prefix) of the artifact.
pub(super) fn check_linears(
    r: &mut Report,
    dir: &Path,
    tensors: &BTreeMap<String, TensorInfo>,
    gptq: Option<Gptq>,
    cfg: Option<&Value>,
) {
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
            check_linear(r, dir, tensors, p, g, cfg);
        }
    }
}

/// The four tensors of one linear.
struct Linear<'a> {
    qw: &'a TensorInfo,
    qz: &'a TensorInfo,
    sc: &'a TensorInfo,
    gi: &'a TensorInfo,
}

/// What the shapes of one linear are and should be.
struct Dims {
    in_features: u64,
    out: u64,
    groups: u64,
    packed_out: u64,
}

fn check_linear(
    r: &mut Report,
    dir: &Path,
    tensors: &BTreeMap<String, TensorInfo>,
    p: &str,
    g: Gptq,
    cfg: Option<&Value>,
) {
    let Some(l) = linear_tensors(r, tensors, p) else {
        return;
    };
    let d = check_shapes(r, p, &l, g, cfg);
    check_g_idx(r, dir, p, &l, &d, g);
    check_sym_zeros(r, dir, p, &l, &d, g);
    check_scales(r, dir, p, &l, &d);
}

/// The four tensors of `p` when each is present with the loaders' dtype and rank.
fn linear_tensors<'a>(
    r: &mut Report,
    tensors: &'a BTreeMap<String, TensorInfo>,
    p: &str,
) -> Option<Linear<'a>> {
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
        return None;
    }
    let (Some(qw), Some(qz), Some(sc), Some(gi)) =
        (get("qweight"), get("qzeros"), get("scales"), get("g_idx"))
    else {
        return None;
    };
    Some(Linear { qw, qz, sc, gi })
}

/// The shapes of the four tensors against each other, the bit width and group size, and
/// `config.json`.
fn check_shapes(r: &mut Report, p: &str, l: &Linear<'_>, g: Gptq, cfg: Option<&Value>) -> Dims {
    let Linear { qw, qz, sc, gi } = l;
    // packed rows per 32 inputs: bits (3-bit: 3 words per 32 rows; 2/4/8: 32/pf = bits)
    let bits = u64::from(g.bits).max(1);
    let out = qw.shape[1];
    // Shapes come from an untrusted header: a product that does not fit is a defect, not a panic.
    let (Some(rows32), Some(out_bits)) = (qw.shape[0].checked_mul(32), out.checked_mul(bits))
    else {
        r.defect(
            "shapes",
            format!(
                "{p}.qweight has shape {:?}, too large for {bits}-bit",
                qw.shape
            ),
        );
        return Dims {
            in_features: 0,
            out: 0,
            groups: 0,
            packed_out: 0,
        };
    };
    let in_features = rows32 / bits;
    let groups = match u64::try_from(g.group_size) {
        Ok(gs) if gs > 0 => in_features.div_ceil(gs),
        _ => 1,
    };
    let packed_out = out_bits / 32;
    if !out_bits.is_multiple_of(32) {
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
    Dims {
        in_features,
        out,
        groups,
        packed_out,
    }
}

/// `g_idx` values: each a group index, and `i / group_size` when `desc_act` is off.
fn check_g_idx(r: &mut Report, dir: &Path, p: &str, l: &Linear<'_>, d: &Dims, g: Gptq) {
    let (gi, in_features, groups) = (l.gi, d.in_features, d.groups);
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
            Err(e) => r.defect("g_idx", chain(&e)),
        }
    }
}

/// Symmetric zero points have a fixed packed pattern.
fn check_sym_zeros(r: &mut Report, dir: &Path, p: &str, l: &Linear<'_>, d: &Dims, g: Gptq) {
    let (qz, groups, packed_out) = (l.qz, d.groups, d.packed_out);
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
                Err(e) => r.defect("qzeros", chain(&e)),
            }
        }
    }
}

/// Scales must be finite and positive.
fn check_scales(r: &mut Report, dir: &Path, p: &str, l: &Linear<'_>, d: &Dims) {
    let (sc, groups, out) = (l.sc, d.groups, d.out);
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
