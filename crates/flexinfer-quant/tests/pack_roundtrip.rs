//! Packing against the consumer's unpacking rules.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use faer::Mat;
use flexinfer_quant::gptq::{dequantize_weight, rtn_quantize};
use flexinfer_quant::pack::{dequantize_packed, pack, unpack_qweight, unpack_qzeros, ZeroFormat};
use flexinfer_quant::params::GptqParams;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random_w(rows: usize, cols: usize, seed: u64) -> Mat<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    Mat::from_fn(rows, cols, |_, _| {
        rng.random_range(-1.0f32..1.0) * rng.random_range(0.01f32..0.2)
    })
}

#[test]
fn pack_unpack_roundtrip_all_bit_widths() {
    for bits in [2u32, 3, 4, 8] {
        for sym in [true, false] {
            let p = GptqParams {
                bits,
                group_size: 32,
                sym,
                ..Default::default()
            };
            let w = random_w(64, 128, bits as u64);
            let q = rtn_quantize(&w, &p);
            let fmt = ZeroFormat::for_sym(sym);
            let packed = pack(&q, fmt);
            assert_eq!(packed.qweight.len(), 128 * bits as usize / 32 * 64);
            assert_eq!(packed.qzeros.len(), 4 * 64 * bits as usize / 32);
            assert_eq!(
                unpack_qweight(&packed.qweight, 64, 128, bits),
                q.codes,
                "bits {bits}"
            );
            assert_eq!(
                unpack_qzeros(&packed.qzeros, 64, 4, bits, fmt),
                q.zeros,
                "bits {bits} sym {sym}"
            );
            let deq = dequantize_packed(&packed, fmt);
            let direct = dequantize_weight(&q);
            for r in 0..64 {
                for c in 0..128 {
                    assert_eq!(deq[r * 128 + c], direct[(r, c)]);
                }
            }
        }
    }
}

#[test]
fn symmetric_4bit_v1_qzeros_are_0x77777777() {
    let p = GptqParams {
        bits: 4,
        group_size: 64,
        sym: true,
        ..Default::default()
    };
    let q = rtn_quantize(&random_w(32, 128, 1), &p);
    let packed = pack(&q, ZeroFormat::V1);
    assert!(
        packed.qzeros.iter().all(|&w| w as u32 == 0x7777_7777),
        "{:x?}",
        &packed.qzeros[..4]
    );
    let q8 = rtn_quantize(&random_w(32, 128, 2), &GptqParams { bits: 8, ..p });
    assert!(pack(&q8, ZeroFormat::V1)
        .qzeros
        .iter()
        .all(|&w| w as u32 == 0x7f7f_7f7f));
}

#[test]
fn nibble_order_is_little_endian_along_input() {
    // Codes 0..8 down the input dim of one output column land in nibbles 0..7 of word 0.
    let p = GptqParams {
        bits: 4,
        group_size: -1,
        sym: false,
        ..Default::default()
    };
    let mut q = rtn_quantize(&random_w(8, 8, 3), &p);
    for c in 0..8 {
        for r in 0..8 {
            q.codes[c * 8 + r] = if r == 0 { c as u8 } else { 0 };
        }
    }
    let packed = pack(&q, ZeroFormat::V2);
    assert_eq!(packed.qweight[0] as u32, 0x7654_3210);
    // 3-bit: 32 inputs in 3 words, row 10 straddles words A and B.
    let p3 = GptqParams {
        bits: 3,
        group_size: -1,
        ..Default::default()
    };
    let mut q3 = rtn_quantize(&random_w(32, 32, 4), &p3);
    q3.codes.iter_mut().for_each(|c| *c = 0);
    q3.codes[10 * 32] = 0b111;
    let packed3 = pack(&q3, ZeroFormat::V1);
    assert_eq!(packed3.qweight[0] as u32, 0b11 << 30);
    assert_eq!(packed3.qweight[32] as u32, 0b1);
}
