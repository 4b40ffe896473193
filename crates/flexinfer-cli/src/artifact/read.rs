//! Reading the artifact's files: JSON within limits, safetensors headers (every offset checked) and
//! tensor bytes.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use flexinfer_fsutil::limits;
use serde_json::Value;

/// A tensor entry of a safetensors header.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct TensorInfo {
    pub(super) shard: String,
    pub(super) dtype: String,
    pub(super) shape: Vec<u64>,
    /// Absolute byte range in the file.
    pub(super) start: u64,
    pub(super) end: u64,
}

/// `dir/name` parsed as JSON; the name stays inside `dir`, the file is regular and within `limit`.
pub(super) fn read_json(
    dir: &Path,
    name: &str,
    limit: flexinfer_fsutil::Limit,
) -> Result<Value, String> {
    let bytes = read_file(dir, name, limit)?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{name} is not valid JSON: {e}"))
}

pub(super) fn read_file(
    dir: &Path,
    name: &str,
    limit: flexinfer_fsutil::Limit,
) -> Result<Vec<u8>, String> {
    flexinfer_fsutil::read_within(dir, name, limit).map_err(|e| format!("cannot read {name}: {e}"))
}

pub(super) fn open_shard(dir: &Path, shard: &str) -> Result<File, String> {
    flexinfer_fsutil::open_regular_within(dir, shard)
        .map_err(|e| format!("{shard}: cannot open: {e}"))
}

/// Parse one safetensors header, checking that offsets are in order and inside the file (all
/// arithmetic on the header's numbers is checked).
pub(super) fn read_header(dir: &Path, shard: &str) -> Result<Vec<(String, TensorInfo)>, String> {
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
        let (info, e) = tensor_info(shard, &name, &t, base)?;
        data_end = data_end.max(e);
        out.push((name, info));
    }
    let total = base.saturating_add(data_end);
    if total > file_len {
        return Err(format!(
            "{shard}: truncated: tensor data ends at byte {total} but the file has {file_len} bytes"
        ));
    }
    Ok(out)
}

/// One tensor entry of a safetensors header (`base`: where the data section starts): its dtype, shape
/// and absolute byte range, and the end of its data relative to `base`.
fn tensor_info(shard: &str, name: &str, t: &Value, base: u64) -> Result<(TensorInfo, u64), String> {
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
    Ok((
        TensorInfo {
            shard: shard.to_string(),
            dtype,
            shape,
            start,
            end,
        },
        e,
    ))
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

pub(super) fn read_bytes(dir: &Path, t: &TensorInfo) -> Result<Vec<u8>, String> {
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

pub(super) fn i32s(b: &[u8]) -> impl Iterator<Item = i32> + '_ {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}
