//! The ggml tensor types we write and the llama.cpp file types (`general.file_type`, the
//! `llama-quantize` presets) with their numeric ids, block lengths and block sizes.

/// A ggml tensor type: its id in a GGUF tensor info, how many values one block holds and how many
/// bytes one block takes (ggml's `ggml_type_traits`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
}

/// Values per K-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;
/// Values per legacy block (`QK4_0`, `QK8_0`).
pub const QK_LEGACY: usize = 32;

impl GgmlType {
    pub const ALL: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
    ];

    /// The id stored in a tensor info (`enum ggml_type`).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::IQ4NL => 20,
            GgmlType::IQ4XS => 23,
            GgmlType::BF16 => 30,
        }
    }

    /// ggml's name (`ggml_type_name`), which is also the `gguf` Python package's enum member name.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::IQ4NL => "IQ4_NL",
            GgmlType::IQ4XS => "IQ4_XS",
        }
    }

    /// Values per block: a row's length must be a multiple of it.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::IQ4NL => QK_LEGACY,
            GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::IQ4XS => QK_K,
        }
    }

    /// Bytes per block (`sizeof(block_*)`).
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            // f16 d + 16 bytes of nibbles
            GgmlType::Q4_0 => 18,
            // f16 d + f16 m + 16 bytes of nibbles
            GgmlType::Q4_1 => 20,
            // f16 d + u32 fifth bits + 16 bytes of nibbles
            GgmlType::Q5_0 => 22,
            // f16 d + f16 m + u32 fifth bits + 16 bytes of nibbles
            GgmlType::Q5_1 => 24,
            // f16 d + 32 int8
            GgmlType::Q8_0 => 34,
            // scales[16] + qs[64] + f16 d + f16 dmin
            GgmlType::Q2K => 84,
            // hmask[32] + qs[64] + scales[12] + f16 d
            GgmlType::Q3K => 110,
            // f16 d + f16 dmin + scales[12] + qs[128]
            GgmlType::Q4K => 144,
            // f16 d + f16 dmin + scales[12] + qh[32] + qs[128]
            GgmlType::Q5K => 176,
            // ql[128] + qh[64] + scales[16] + f16 d
            GgmlType::Q6K => 210,
            // f16 d + 16 bytes of grid indices
            GgmlType::IQ4NL => 18,
            // f16 d + u16 scales_h + scales_l[4] + qs[128]
            GgmlType::IQ4XS => 136,
        }
    }

    /// Bytes of one row of `cols` values; `None` when `cols` is not a multiple of the block length
    /// (or the size overflows).
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        let n = self.block_len();
        if cols == 0 || !cols.is_multiple_of(n) {
            return None;
        }
        (cols / n).checked_mul(self.block_bytes())
    }

    pub fn is_quantized(self) -> bool {
        !matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }
}

/// A `llama-quantize` preset (`enum llama_ftype`): the default type of the quantized tensors and the
/// per-tensor mix [`crate::gguf::preset`] derives from it. Its id is `general.file_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileType {
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q6K,
    Q5KM,
    Q5KS,
    Q4KM,
    Q4KS,
    Q3KM,
    Q2K,
    IQ4XS,
}

impl FileType {
    pub const ALL: [FileType; 12] = [
        FileType::F16,
        FileType::BF16,
        FileType::Q8_0,
        FileType::Q4_0,
        FileType::Q6K,
        FileType::Q5KM,
        FileType::Q5KS,
        FileType::Q4KM,
        FileType::Q4KS,
        FileType::Q3KM,
        FileType::Q2K,
        FileType::IQ4XS,
    ];

    /// `general.file_type` (`LLAMA_FTYPE_*`).
    pub fn id(self) -> u32 {
        match self {
            FileType::F16 => 1,
            FileType::Q4_0 => 2,
            FileType::Q8_0 => 7,
            FileType::Q2K => 10,
            FileType::Q3KM => 12,
            FileType::Q4KS => 14,
            FileType::Q4KM => 15,
            FileType::Q5KS => 16,
            FileType::Q5KM => 17,
            FileType::Q6K => 18,
            FileType::IQ4XS => 30,
            FileType::BF16 => 32,
        }
    }

    /// The name `llama-quantize` and the `GGUF_TYPE` contract variable use.
    pub fn name(self) -> &'static str {
        match self {
            FileType::F16 => "F16",
            FileType::BF16 => "BF16",
            FileType::Q8_0 => "Q8_0",
            FileType::Q4_0 => "Q4_0",
            FileType::Q6K => "Q6_K",
            FileType::Q5KM => "Q5_K_M",
            FileType::Q5KS => "Q5_K_S",
            FileType::Q4KM => "Q4_K_M",
            FileType::Q4KS => "Q4_K_S",
            FileType::Q3KM => "Q3_K_M",
            FileType::Q2K => "Q2_K",
            FileType::IQ4XS => "IQ4_XS",
        }
    }

    /// Case-insensitive; `None` for a name we do not write.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name.trim()))
    }

    /// The type of a quantized tensor before the per-tensor rules (`default_type` in llama-quantize).
    pub fn default_type(self) -> GgmlType {
        match self {
            FileType::F16 => GgmlType::F16,
            FileType::BF16 => GgmlType::BF16,
            FileType::Q8_0 => GgmlType::Q8_0,
            FileType::Q4_0 => GgmlType::Q4_0,
            FileType::Q6K => GgmlType::Q6K,
            FileType::Q5KM | FileType::Q5KS => GgmlType::Q5K,
            FileType::Q4KM | FileType::Q4KS => GgmlType::Q4K,
            FileType::Q3KM => GgmlType::Q3K,
            FileType::Q2K => GgmlType::Q2K,
            FileType::IQ4XS => GgmlType::IQ4XS,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_types_are_the_contracts_list() {
        // The controller admits exactly the types of flexinfer_contract::env::GGUF_TYPES.
        let ours: Vec<&str> = FileType::ALL.iter().map(|f| f.name()).collect();
        assert_eq!(ours, flexinfer_contract::env::GGUF_TYPES);
    }

    #[test]
    fn names_round_trip_and_sizes_are_ggmls() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        for f in FileType::ALL {
            assert_eq!(FileType::from_name(&f.name().to_lowercase()), Some(f));
        }
        // bits per weight as ggml documents them
        let bpw = |t: GgmlType| (t.block_bytes() * 8) as f64 / t.block_len() as f64;
        assert_eq!(bpw(GgmlType::Q4K), 4.5);
        assert_eq!(bpw(GgmlType::Q5K), 5.5);
        assert_eq!(bpw(GgmlType::Q6K), 6.5625);
        assert_eq!(bpw(GgmlType::Q3K), 3.4375);
        assert_eq!(bpw(GgmlType::Q2K), 2.625);
        assert_eq!(bpw(GgmlType::Q8_0), 8.5);
        assert_eq!(bpw(GgmlType::Q4_0), 4.5);
        assert_eq!(bpw(GgmlType::Q4_1), 5.0);
        assert_eq!(bpw(GgmlType::Q5_0), 5.5);
        assert_eq!(bpw(GgmlType::Q5_1), 6.0);
        assert_eq!(bpw(GgmlType::IQ4NL), 4.5);
        assert_eq!(bpw(GgmlType::IQ4XS), 4.25);
        assert_eq!(GgmlType::Q4K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4K.row_bytes(128), None);
        assert_eq!(GgmlType::F16.row_bytes(3), Some(6));
    }
}
