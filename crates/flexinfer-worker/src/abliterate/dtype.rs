//! The source dtypes abliteration reads and writes (F32, F16, BF16) and their conversions.

use flexinfer_quant::tensors::TensorStore;

use crate::common::{AbliterateError, WorkerError};

/// Source dtypes the phase reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
}

impl Dtype {
    /// From the safetensors dtype (as its header spells it).
    pub fn from_name(s: &str) -> Option<Dtype> {
        match s {
            "F32" => Some(Dtype::F32),
            "F16" => Some(Dtype::F16),
            "BF16" => Some(Dtype::BF16),
            _ => None,
        }
    }

    pub fn encode(self, v: &[f32]) -> Vec<u8> {
        match self {
            Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Dtype::BF16 => v
                .iter()
                .flat_map(|&x| f32_to_bf16(x).to_le_bytes())
                .collect(),
            Dtype::F16 => v
                .iter()
                .flat_map(|&x| f32_to_f16(x).to_le_bytes())
                .collect(),
        }
    }

    pub fn decode(self, b: &[u8]) -> Vec<f32> {
        match self {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        }
    }
}

/// f32 → bf16 bits, round to nearest even.
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// f32 → f16 bits, round to nearest even (overflow → ±inf, underflow → subnormal/zero).
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

pub fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// The dtype of a stored tensor.
pub fn tensor_dtype(store: &TensorStore, name: &str) -> Result<Dtype, WorkerError> {
    let e = store.entry(name).map_err(super::quant_err)?;
    let d = format!("{:?}", e.dtype);
    Dtype::from_name(&d).ok_or_else(|| {
        WorkerError::from(AbliterateError::Dtype {
            name: name.to_string(),
            dtype: d.clone(),
        })
    })
}
