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

/// A file of the artifact that cannot be read as what it should be (the text is the defect).
#[derive(Debug, thiserror::Error)]
pub(super) enum ReadError {
    #[error("cannot read {name}")]
    Read {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name} is not valid JSON")]
    Json {
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{shard}: cannot {what}")]
    Shard {
        shard: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{shard}: shorter than the 8-byte safetensors header length")]
    NoHeaderLength { shard: String },
    #[error("{shard}: header length {n} is larger than the file ({file_len} bytes)")]
    HeaderLength {
        shard: String,
        n: u64,
        file_len: u64,
    },
    #[error("{shard}: truncated header")]
    TruncatedHeader {
        shard: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{shard}: header is not valid JSON")]
    HeaderJson {
        shard: String,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{shard}: truncated: tensor data ends at byte {total} but the file has {file_len} bytes"
    )]
    Truncated {
        shard: String,
        total: u64,
        file_len: u64,
    },
    #[error("{shard}: tensor {name} {problem}")]
    Tensor {
        shard: String,
        name: String,
        problem: TensorProblem,
    },
    #[error("{shard}")]
    Data {
        shard: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{shard}: tensor too large for this machine")]
    TooLarge { shard: String },
}

/// What is wrong with one tensor entry of a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum TensorProblem {
    NoDtype,
    NoShape,
    BadShape,
    NoDataOffsets,
    BadDataOffsets,
    Overflow {
        dtype: String,
        shape: Vec<u64>,
    },
    Span {
        dtype: String,
        shape: Vec<u64>,
        needs: u64,
        span: u64,
    },
    PastTheFile,
}

impl std::fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorProblem::NoDtype => write!(f, "has no dtype"),
            TensorProblem::NoShape => write!(f, "has no shape"),
            TensorProblem::BadShape => write!(f, "has a bad shape"),
            TensorProblem::NoDataOffsets => write!(f, "has no data_offsets"),
            TensorProblem::BadDataOffsets => write!(f, "has bad data_offsets"),
            TensorProblem::Overflow { dtype, shape } => {
                write!(f, "{dtype} {shape:?} overflows a 64-bit size")
            }
            TensorProblem::Span {
                dtype,
                shape,
                needs,
                span,
            } => write!(
                f,
                "{dtype} {shape:?} needs {needs} bytes but data_offsets span {span}"
            ),
            TensorProblem::PastTheFile => write!(f, "has data_offsets past the file"),
        }
    }
}

/// `dir/name` parsed as JSON; the name stays inside `dir`, the file is regular and within `limit`.
pub(super) fn read_json(
    dir: &Path,
    name: &str,
    limit: flexinfer_fsutil::Limit,
) -> Result<Value, ReadError> {
    let bytes = read_file(dir, name, limit)?;
    serde_json::from_slice(&bytes).map_err(|source| ReadError::Json {
        name: name.to_string(),
        source,
    })
}

pub(super) fn read_file(
    dir: &Path,
    name: &str,
    limit: flexinfer_fsutil::Limit,
) -> Result<Vec<u8>, ReadError> {
    flexinfer_fsutil::read_within(dir, name, limit).map_err(|source| ReadError::Read {
        name: name.to_string(),
        source,
    })
}

fn shard_err(shard: &str, what: &'static str) -> impl FnOnce(std::io::Error) -> ReadError {
    let shard = shard.to_string();
    move |source| ReadError::Shard {
        shard,
        what,
        source,
    }
}

pub(super) fn open_shard(dir: &Path, shard: &str) -> Result<File, ReadError> {
    flexinfer_fsutil::open_regular_within(dir, shard).map_err(shard_err(shard, "open"))
}

/// Parse one safetensors header, checking that offsets are in order and inside the file (all
/// arithmetic on the header's numbers is checked).
pub(super) fn read_header(dir: &Path, shard: &str) -> Result<Vec<(String, TensorInfo)>, ReadError> {
    let mut f = open_shard(dir, shard)?;
    let file_len = f.metadata().map_err(shard_err(shard, "stat"))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| ReadError::NoHeaderLength {
            shard: shard.to_string(),
        })?;
    let n = u64::from_le_bytes(len);
    if n > limits::SAFETENSORS_HEADER.bytes || n.saturating_add(8) > file_len {
        return Err(ReadError::HeaderLength {
            shard: shard.to_string(),
            n,
            file_len,
        });
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf)
        .map_err(|source| ReadError::TruncatedHeader {
            shard: shard.to_string(),
            source,
        })?;
    let hdr: BTreeMap<String, Value> =
        serde_json::from_slice(&buf).map_err(|source| ReadError::HeaderJson {
            shard: shard.to_string(),
            source,
        })?;
    let base = 8 + n;
    let mut out = Vec::new();
    let mut data_end = 0u64;
    for (name, t) in hdr {
        if name == "__metadata__" {
            continue;
        }
        let (info, e) = tensor_info(shard, &t, base).map_err(|problem| ReadError::Tensor {
            shard: shard.to_string(),
            name: name.clone(),
            problem,
        })?;
        data_end = data_end.max(e);
        out.push((name, info));
    }
    let total = base.saturating_add(data_end);
    if total > file_len {
        return Err(ReadError::Truncated {
            shard: shard.to_string(),
            total,
            file_len,
        });
    }
    Ok(out)
}

/// One tensor entry of a safetensors header (`base`: where the data section starts): its dtype, shape
/// and absolute byte range, and the end of its data relative to `base`.
fn tensor_info(shard: &str, t: &Value, base: u64) -> Result<(TensorInfo, u64), TensorProblem> {
    let dtype = t
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or(TensorProblem::NoDtype)?
        .to_string();
    let shape: Vec<u64> = t
        .get("shape")
        .and_then(Value::as_array)
        .ok_or(TensorProblem::NoShape)?
        .iter()
        .map(|v| v.as_u64().ok_or(TensorProblem::BadShape))
        .collect::<Result<_, _>>()?;
    let offs = t
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .ok_or(TensorProblem::NoDataOffsets)?;
    let (s, e) = match (offs[0].as_u64(), offs[1].as_u64()) {
        (Some(s), Some(e)) if s <= e => (s, e),
        _ => return Err(TensorProblem::BadDataOffsets),
    };
    let elem = dtype_size(&dtype);
    let bytes = elem.and_then(|sz| {
        shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(sz))
    });
    match (elem, bytes) {
        (Some(_), None) => return Err(TensorProblem::Overflow { dtype, shape }),
        (Some(_), Some(b)) if b != e - s => {
            return Err(TensorProblem::Span {
                dtype,
                shape,
                needs: b,
                span: e - s,
            });
        }
        _ => {}
    }
    let (Some(start), Some(end)) = (base.checked_add(s), base.checked_add(e)) else {
        return Err(TensorProblem::PastTheFile);
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

pub(super) fn read_bytes(dir: &Path, t: &TensorInfo) -> Result<Vec<u8>, ReadError> {
    let data = |source| ReadError::Data {
        shard: t.shard.clone(),
        source,
    };
    let mut f = open_shard(dir, &t.shard)?;
    f.seek(SeekFrom::Start(t.start)).map_err(data)?;
    let len = usize::try_from(t.end.saturating_sub(t.start)).map_err(|_| ReadError::TooLarge {
        shard: t.shard.clone(),
    })?;
    let mut buf = vec![0u8; len];
    f.read_exact(&mut buf).map_err(data)?;
    Ok(buf)
}

pub(super) fn i32s(b: &[u8]) -> impl Iterator<Item = i32> + '_ {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}
