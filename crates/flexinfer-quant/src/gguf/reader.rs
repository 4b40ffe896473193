//! A GGUF header reader for our own checks (tests, artifact validation): the metadata, the tensor
//! infos and where the data section starts. Every length is bounds-checked and every tensor must lie
//! inside the file; a malformed or truncated file is an error, never a panic. The arrays it decodes
//! are the kinds [`super::writer`] writes.
#![deny(clippy::arithmetic_side_effects)]

use super::types::GgmlType;
use super::writer::{MetaArray, MetaValue, TensorSpec, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};

#[derive(Debug, Clone, PartialEq)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    /// Each tensor with its offset from the data section.
    pub tensors: Vec<(TensorSpec, u64)>,
    /// File offset of the data section.
    pub data_start: u64,
}

impl GgufHeader {
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("malformed GGUF at byte {at}: {what}")]
pub struct ReadError {
    pub at: usize,
    pub what: String,
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: impl Into<String>) -> ReadError {
        ReadError {
            at: self.at,
            what: what.into(),
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.b.len())
            .ok_or_else(|| self.err(format!("{n} bytes past the end")))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, ReadError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, ReadError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn len(&mut self) -> Result<usize, ReadError> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|n| *n <= self.b.len())
            .ok_or_else(|| self.err(format!("length {n}")))
    }
    fn string(&mut self) -> Result<String, ReadError> {
        let n = self.len()?;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| self.err("string is not UTF-8"))
    }
    fn value(&mut self, ty: u32) -> Result<MetaValue, ReadError> {
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>()?[0]),
            1 => MetaValue::I8(i8::from_le_bytes(self.arr()?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr()?)),
            7 => MetaValue::Bool(self.arr::<1>()?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr()?)),
            9 => {
                let item = self.u32()?;
                let n = self.len()?;
                MetaValue::Array(match item {
                    4 => MetaArray::U32((0..n).map(|_| self.u32()).collect::<Result<_, _>>()?),
                    5 => MetaArray::I32(
                        (0..n)
                            .map(|_| Ok(i32::from_le_bytes(self.arr()?)))
                            .collect::<Result<_, _>>()?,
                    ),
                    6 => MetaArray::F32(
                        (0..n)
                            .map(|_| Ok(f32::from_le_bytes(self.arr()?)))
                            .collect::<Result<_, _>>()?,
                    ),
                    8 => MetaArray::Str((0..n).map(|_| self.string()).collect::<Result<_, _>>()?),
                    other => return Err(self.err(format!("array item type {other}"))),
                })
            }
            other => return Err(self.err(format!("value type {other}"))),
        })
    }
}

/// Parses the header of a GGUF file held in `bytes`.
pub fn read_header(bytes: &[u8]) -> Result<GgufHeader, ReadError> {
    let mut c = Cursor { b: bytes, at: 0 };
    if c.take(4)? != MAGIC {
        return Err(c.err("no GGUF magic"));
    }
    let version = c.u32()?;
    let n_tensors = c.len()?;
    let n_kv = c.len()?;
    let mut metadata = Vec::new();
    for _ in 0..n_kv {
        let k = c.string()?;
        let ty = c.u32()?;
        metadata.push((k, c.value(ty)?));
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name = c.string()?;
        let nd = c.u32()?;
        if nd > 4 {
            return Err(c.err(format!("tensor {name}: {nd} dims")));
        }
        let dims = (0..nd).map(|_| c.u64()).collect::<Result<Vec<_>, _>>()?;
        let id = c.u32()?;
        let ty = GgmlType::ALL
            .into_iter()
            .find(|t| t.id() == id)
            .ok_or_else(|| c.err(format!("tensor {name}: type {id}")))?;
        let offset = c.u64()?;
        tensors.push((TensorSpec { name, dims, ty }, offset));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        Some((_, MetaValue::U32(a))) => u64::from(*a),
        _ => DEFAULT_ALIGNMENT,
    };
    let at = c.at as u64;
    let data_start = at
        .checked_next_multiple_of(alignment)
        .filter(|_| alignment.is_power_of_two())
        .ok_or_else(|| c.err(format!("alignment {alignment}")))?;
    // Every tensor's bytes must lie inside the file: a truncated file is an error here.
    let data_len = (bytes.len() as u64)
        .checked_sub(data_start)
        .ok_or_else(|| c.err("the data section starts past the end of the file"))?;
    for (t, offset) in &tensors {
        let size = t.byte_size().map_err(|e| c.err(e.to_string()))?;
        if offset.checked_add(size).is_none_or(|end| end > data_len) {
            return Err(c.err(format!("tensor {} lies outside the file", t.name)));
        }
    }
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        data_start,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::GgufWriter;
    use rand::{Rng, SeedableRng};

    fn sample_file() -> Vec<u8> {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.gguf");
        let md = vec![
            (
                "general.architecture".to_string(),
                MetaValue::Str("llama".into()),
            ),
            ("general.alignment".to_string(), MetaValue::U32(64)),
            ("a.f".to_string(), MetaValue::F32(1.5)),
            ("a.b".to_string(), MetaValue::Bool(true)),
            (
                "a.toks".to_string(),
                MetaValue::Array(MetaArray::Str(vec!["x".into(), "yz".into()])),
            ),
            (
                "a.ids".to_string(),
                MetaValue::Array(MetaArray::I32(vec![1, -2, 3])),
            ),
        ];
        let t = vec![
            TensorSpec {
                name: "w".into(),
                dims: vec![32, 2],
                ty: GgmlType::Q8_0,
            },
            TensorSpec {
                name: "n".into(),
                dims: vec![3],
                ty: GgmlType::F32,
            },
        ];
        let mut w = GgufWriter::create(&p, &md, t).unwrap();
        w.write_tensor("w", &[7u8; 68]).unwrap();
        w.write_tensor("n", &[1u8; 12]).unwrap();
        assert!(matches!(
            w.write_tensor("extra", &[]),
            Err(crate::gguf::GgufError::Order { .. })
        ));
        w.finish().unwrap();
        std::fs::read(&p).unwrap()
    }

    #[test]
    fn what_the_writer_writes_reads_back_with_its_alignment() {
        let b = sample_file();
        let h = read_header(&b).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.get("a.f"), Some(&MetaValue::F32(1.5)));
        assert_eq!(
            h.get("a.toks"),
            Some(&MetaValue::Array(MetaArray::Str(vec![
                "x".into(),
                "yz".into()
            ])))
        );
        assert_eq!(h.data_start % 64, 0);
        assert_eq!(h.tensors[0].1, 0);
        assert_eq!(h.tensors[1].1, 128, "68 bytes padded to 64-byte alignment");
        let start = h.data_start as usize;
        assert_eq!(&b[start..start + 68], &[7u8; 68][..]);
        assert!(b[start + 68..start + 128].iter().all(|v| *v == 0));
        assert_eq!(b.len(), start + 128 + 64);
    }

    #[test]
    fn truncated_or_corrupted_files_are_errors_never_panics() {
        let b = sample_file();
        let h = read_header(&b).unwrap();
        // Anything shorter than the end of the last tensor (the file's last 60 bytes are padding).
        for n in 0..b.len() - 60 {
            assert!(read_header(&b[..n]).is_err(), "truncated at {n}");
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for _ in 0..20_000 {
            let mut c = b.clone();
            for _ in 0..rng.random_range(1..4) {
                let i = rng.random_range(0..h.data_start as usize);
                c[i] = rng.random();
            }
            let _ = read_header(&c);
        }
    }

    #[test]
    fn the_writer_refuses_bad_declarations_before_creating_a_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.gguf");
        let t = |name: &str, dims: Vec<u64>, ty| TensorSpec {
            name: name.into(),
            dims,
            ty,
        };
        // (metadata, tensors, what the error says)
        type Case = (Vec<(String, MetaValue)>, Vec<TensorSpec>, &'static str);
        let cases: Vec<Case> = vec![
            (
                vec![],
                vec![t("a", vec![300, 2], GgmlType::Q4K)],
                "not a multiple",
            ),
            (
                vec![],
                vec![
                    t("a", vec![32], GgmlType::Q8_0),
                    t("a", vec![32], GgmlType::Q8_0),
                ],
                "twice",
            ),
            (
                vec![],
                vec![t(&"x".repeat(64), vec![4], GgmlType::F32)],
                "63 bytes",
            ),
            (vec![], vec![t("a", vec![0, 4], GgmlType::F32)], "shape"),
            (
                vec![],
                vec![t("a", vec![u64::MAX, 2], GgmlType::F32)],
                "shape",
            ),
            (
                vec![("general.alignment".into(), MetaValue::U32(48))],
                vec![],
                "power of two",
            ),
            (
                vec![
                    ("k".into(), MetaValue::U8(1)),
                    ("k".into(), MetaValue::U8(2)),
                ],
                vec![],
                "declared twice",
            ),
        ];
        for (md, tensors, want) in cases {
            let e = GgufWriter::create(&p, &md, tensors)
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains(want), "{e}");
            assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0, "{e}");
        }
    }
}
