//! The per-tensor type mix of llama.cpp's presets (`llama-quantize`'s `llama_tensor_get_type`),
//! restated for the dense Llama family and the presets we write.
//!
//! What is quantized: 2-D tensors whose name ends in `weight`, except norms; the rest (norms, biases,
//! `rope_freqs`) stay F32 as llama.cpp's converter stores them. F16/BF16 presets store every
//! quantizable tensor in that type. For the quantized presets, starting from the preset's default
//! type:
//! - `output.weight` (or `token_embd.weight` when there is no separate output) → Q6_K, or Q8_0 when
//!   its rows do not split into the default type's blocks (unchanged for Q8_0);
//! - `attn_v`: Q2_K → Q4_K if heads/kv_heads ≥ 4 else Q3_K; Q3_K_M → Q5_K for layers 0–1 else Q4_K;
//!   Q4_K_M / Q5_K_M → Q6_K on the "more bits" layers; Q4_K_S → Q5_K for layers 0–3; 70B-class
//!   models (80 layers with grouped KV) get Q5_K instead of Q3_K/Q4_K;
//! - `ffn_down`: Q2_K → Q3_K; Q3_K_M → Q5_K below n/16 else Q4_K; Q4_K_M / Q5_K_M → Q6_K on the
//!   "more bits" layers; Q4_K_S → Q5_K below n/8;
//! - `attn_output`: Q2_K → Q3_K; Q3_K_M → Q4_K;
//! - `ffn_down` of Q4_0 with an importance matrix → Q4_1 below n/8;
//! - IQ4_XS: `attn_v` → Q5_K when heads/kv_heads ≥ 4, `ffn_down` → Q5_K below n/8 without an
//!   importance matrix;
//! - finally a row length that is not a multiple of the chosen block falls back (Q6_K → Q8_0,
//!   Q4_K → Q5_0, Q5_K → Q5_1, Q2_K / Q3_K → Q4_0, IQ4_XS → IQ4_NL, and to F16 when not a multiple
//!   of 32 either), so every preset can store every tensor, as in llama.cpp 0.7.0's
//!   `tensor_type_fallback` (older llama.cpp sent Q2_K / Q3_K to IQ4_NL).
//!
//! "More bits" layers (`use_more_bits`): the first and last eighth, and every third layer between.
//! The layer counter is the layer index: llama-quantize visits tensors sorted by layer number.
//! Not restated: the MoE (`n_expert == 8`) and Falcon rules.

use super::error::GgufError;
use super::types::{FileType, GgmlType};

/// What the rules need to know of the model.
#[derive(Clone, Copy, Debug)]
pub struct MixModel {
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// A separate `output.weight` exists (not tied to the embeddings).
    pub has_output: bool,
    /// llama.cpp's `LLM_TYPE_70B` (80 layers, grouped KV heads).
    pub is_70b: bool,
    /// An importance matrix is given (llama-quantize's `has_imatrix`).
    pub has_importance: bool,
}

/// llama-quantize's `use_more_bits`.
pub fn use_more_bits(layer: usize, layers: usize) -> bool {
    let eighth = layers / 8;
    layer < eighth || layer >= 7 * layers / 8 || (layer - eighth) % 3 == 2
}

/// Whether llama-quantize would quantize a tensor of this name and rank.
pub fn is_quantizable(name: &str, n_dims: usize) -> bool {
    name.ends_with("weight") && n_dims >= 2 && !name.contains("_norm.weight")
}

/// The type of one tensor; `cols` is its row length (ne[0]), `layer` its block index if any.
pub fn tensor_type(
    ftype: FileType,
    name: &str,
    n_dims: usize,
    cols: u64,
    layer: Option<usize>,
    m: &MixModel,
) -> Result<GgmlType, GgufError> {
    if !is_quantizable(name, n_dims) {
        return Ok(GgmlType::F32);
    }
    let default = ftype.default_type();
    if !default.is_quantized() {
        return Ok(default);
    }
    use FileType as F;
    use GgmlType as G;
    let mut ty = default;
    let l = layer.unwrap_or(0);
    let n = m.layers;
    if name == "output.weight" || (!m.has_output && name == "token_embd.weight") {
        if !cols.is_multiple_of(ty.block_len() as u64) {
            ty = G::Q8_0;
        } else if ty != G::Q8_0 {
            ty = G::Q6K;
        }
    } else if name.contains("attn_v.weight") {
        match ftype {
            F::Q2K => {
                ty = if m.heads >= 4 * m.kv_heads {
                    G::Q4K
                } else {
                    G::Q3K
                }
            }
            F::Q3KM => ty = if l < 2 { G::Q5K } else { G::Q4K },
            F::Q4KM | F::Q5KM if use_more_bits(l, n) => ty = G::Q6K,
            F::Q4KS if l < 4 => ty = G::Q5K,
            F::IQ4XS if m.heads >= 4 * m.kv_heads => ty = G::Q5K,
            _ => {}
        }
        if m.is_70b && matches!(ty, G::Q3K | G::Q4K) {
            ty = G::Q5K;
        }
    } else if name.contains("ffn_down") {
        match ftype {
            F::Q2K => ty = G::Q3K,
            F::Q3KM => ty = if l < n / 16 { G::Q5K } else { G::Q4K },
            F::Q4KM | F::Q5KM if use_more_bits(l, n) => ty = G::Q6K,
            F::Q4KS if l < n / 8 => ty = G::Q5K,
            F::Q4_0 if m.has_importance && l < n / 8 => ty = G::Q4_1,
            F::IQ4XS if !m.has_importance && l < n / 8 => ty = G::Q5K,
            _ => {}
        }
    } else if name.contains("attn_output.weight") {
        match ftype {
            F::Q2K => ty = G::Q3K,
            F::Q3KM => ty = G::Q4K,
            _ => {}
        }
    }
    if cols.is_multiple_of(ty.block_len() as u64) {
        return Ok(ty);
    }
    let fallback = match ty {
        G::Q6K => G::Q8_0,
        G::Q4K => G::Q5_0,
        G::Q5K => G::Q5_1,
        G::Q2K | G::Q3K => G::Q4_0,
        G::IQ4XS => G::IQ4NL,
        G::F32 | G::F16 | G::BF16 => ty,
        G::Q4_0 | G::Q4_1 | G::Q5_0 | G::Q5_1 | G::Q8_0 | G::IQ4NL => G::F16,
    };
    Ok(if cols.is_multiple_of(fallback.block_len() as u64) {
        fallback
    } else {
        G::F16
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const M32: MixModel = MixModel {
        layers: 32,
        heads: 32,
        kv_heads: 8,
        has_output: true,
        is_70b: false,
        has_importance: false,
    };

    fn ty(f: FileType, name: &str, layer: usize) -> GgmlType {
        tensor_type(f, name, 2, 4096, Some(layer), &M32).unwrap()
    }

    #[test]
    fn more_bits_layers_of_a_32_layer_model() {
        let more: Vec<usize> = (0..32).filter(|&l| use_more_bits(l, 32)).collect();
        // first 4, last 4, and every third from layer 4 (4 + 2, 4 + 5, …)
        assert_eq!(
            more,
            vec![0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
    }

    #[test]
    fn the_q4_k_m_mix_of_a_llama_8b() {
        use GgmlType::*;
        let f = FileType::Q4KM;
        assert_eq!(ty(f, "output.weight", 0), Q6K);
        assert_eq!(ty(f, "token_embd.weight", 0), Q4K);
        assert_eq!(ty(f, "blk.0.attn_v.weight", 0), Q6K);
        assert_eq!(ty(f, "blk.4.attn_v.weight", 4), Q4K);
        assert_eq!(ty(f, "blk.6.attn_v.weight", 6), Q6K);
        assert_eq!(ty(f, "blk.6.ffn_down.weight", 6), Q6K);
        assert_eq!(ty(f, "blk.7.ffn_down.weight", 7), Q4K);
        assert_eq!(ty(f, "blk.7.attn_q.weight", 7), Q4K);
        assert_eq!(ty(f, "blk.7.ffn_gate.weight", 7), Q4K);
        assert_eq!(ty(f, "blk.7.attn_output.weight", 7), Q4K);
        assert_eq!(
            tensor_type(f, "blk.7.attn_norm.weight", 1, 4096, Some(7), &M32).unwrap(),
            F32
        );
        assert_eq!(
            tensor_type(f, "blk.7.attn_q.bias", 1, 4096, Some(7), &M32).unwrap(),
            F32
        );
        // tied embeddings: the embedding takes the output's type
        let tied = MixModel {
            has_output: false,
            ..M32
        };
        assert_eq!(
            tensor_type(f, "token_embd.weight", 2, 4096, None, &tied).unwrap(),
            Q6K
        );
    }

    #[test]
    fn the_other_presets() {
        use FileType as F;
        use GgmlType::*;
        assert_eq!(ty(F::Q4KS, "blk.3.attn_v.weight", 3), Q5K);
        assert_eq!(ty(F::Q4KS, "blk.4.attn_v.weight", 4), Q4K);
        assert_eq!(ty(F::Q4KS, "blk.3.ffn_down.weight", 3), Q5K);
        assert_eq!(ty(F::Q4KS, "blk.4.ffn_down.weight", 4), Q4K);
        assert_eq!(ty(F::Q5KM, "blk.0.ffn_down.weight", 0), Q6K);
        assert_eq!(ty(F::Q5KM, "blk.5.ffn_down.weight", 5), Q5K);
        assert_eq!(ty(F::Q5KS, "blk.0.ffn_down.weight", 0), Q5K);
        assert_eq!(ty(F::Q3KM, "blk.1.attn_v.weight", 1), Q5K);
        assert_eq!(ty(F::Q3KM, "blk.2.attn_v.weight", 2), Q4K);
        assert_eq!(ty(F::Q3KM, "blk.1.ffn_down.weight", 1), Q5K);
        assert_eq!(ty(F::Q3KM, "blk.2.ffn_down.weight", 2), Q4K);
        assert_eq!(ty(F::Q3KM, "blk.2.attn_output.weight", 2), Q4K);
        assert_eq!(ty(F::Q3KM, "blk.2.attn_q.weight", 2), Q3K);
        assert_eq!(ty(F::Q2K, "blk.2.attn_v.weight", 2), Q4K); // 32/8 = 4
        let mha = MixModel {
            kv_heads: 32,
            ..M32
        };
        assert_eq!(
            tensor_type(F::Q2K, "blk.2.attn_v.weight", 2, 4096, Some(2), &mha).unwrap(),
            Q3K
        );
        assert_eq!(ty(F::Q2K, "blk.2.ffn_down.weight", 2), Q3K);
        assert_eq!(ty(F::Q2K, "blk.2.attn_output.weight", 2), Q3K);
        assert_eq!(ty(F::Q2K, "blk.2.ffn_up.weight", 2), Q2K);
        assert_eq!(ty(F::Q2K, "output.weight", 0), Q6K);
        assert_eq!(ty(F::Q6K, "blk.2.ffn_up.weight", 2), Q6K);
        assert_eq!(ty(F::Q8_0, "output.weight", 0), Q8_0);
        assert_eq!(ty(F::Q4_0, "output.weight", 0), Q6K);
        assert_eq!(ty(F::Q4_0, "blk.3.ffn_down.weight", 3), Q4_0);
        let imp = MixModel {
            has_importance: true,
            ..M32
        };
        let q40 = |l| {
            tensor_type(
                F::Q4_0,
                &format!("blk.{l}.ffn_down.weight"),
                2,
                4096,
                Some(l),
                &imp,
            )
        };
        assert_eq!((q40(3).unwrap(), q40(4).unwrap()), (Q4_1, Q4_0));
        assert_eq!(ty(F::F16, "output.weight", 0), F16);
        assert_eq!(ty(F::BF16, "blk.0.attn_v.weight", 0), BF16);
        assert_eq!(ty(F::IQ4XS, "blk.9.attn_q.weight", 9), IQ4XS);
        assert_eq!(ty(F::IQ4XS, "blk.9.attn_v.weight", 9), Q5K);
        assert_eq!(ty(F::IQ4XS, "blk.3.ffn_down.weight", 3), Q5K);
        assert_eq!(ty(F::IQ4XS, "blk.4.ffn_down.weight", 4), IQ4XS);
        assert_eq!(ty(F::IQ4XS, "output.weight", 0), Q6K);
        let b70 = MixModel {
            layers: 80,
            is_70b: true,
            ..M32
        };
        assert_eq!(
            tensor_type(F::Q4KM, "blk.11.attn_v.weight", 4, 8192, Some(11), &b70).unwrap(),
            Q5K
        );
    }

    #[test]
    fn rows_that_do_not_split_into_blocks_fall_back_or_name_the_tensor() {
        use GgmlType::*;
        // output: Q8_0 straight away when ne[0] is not a multiple of 256
        assert_eq!(
            tensor_type(FileType::Q4KM, "output.weight", 2, 896, None, &M32).unwrap(),
            Q8_0
        );
        // Q6_K falls back to Q8_0
        assert_eq!(
            tensor_type(FileType::Q6K, "blk.0.attn_q.weight", 2, 896, Some(0), &M32).unwrap(),
            Q8_0
        );
        assert_eq!(
            tensor_type(FileType::Q8_0, "blk.0.attn_q.weight", 2, 100, Some(0), &M32).unwrap(),
            F16
        );
        // Qwen2-0.5B's rows of 896: Q4_K → Q5_0, Q5_K → Q5_1, Q2_K / Q3_K → Q4_0 (llama.cpp 0.7.0;
        // llama-quantize's choice, checked by tests/gguf_llamacpp.rs), IQ4_XS → IQ4_NL
        let t = |f, name: &str| tensor_type(f, name, 2, 896, Some(0), &M32).unwrap();
        assert_eq!(t(FileType::Q4KM, "blk.1.attn_q.weight"), Q5_0);
        assert_eq!(t(FileType::Q5KS, "blk.1.attn_q.weight"), Q5_1);
        assert_eq!(t(FileType::Q2K, "blk.1.attn_q.weight"), Q4_0);
        assert_eq!(t(FileType::Q3KM, "blk.1.attn_q.weight"), Q4_0);
        assert_eq!(t(FileType::Q3KM, "blk.1.attn_output.weight"), Q5_0);
        assert_eq!(t(FileType::IQ4XS, "blk.1.attn_q.weight"), IQ4NL);
    }
}
