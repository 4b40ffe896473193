//! Block types against straightforward references written here (ggml's loop structure, not our
//! index formulas) and against properties: round-trip error, importance, consistency of the codes
//! with the stored scales.

use super::*;
use crate::gguf::types::QK_K;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn gauss_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| crate::testkit::gauss(rng)).collect()
}

fn h(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Random block bytes with finite, moderate f16 fields at `f16_at`.
fn random_block(rng: &mut StdRng, ty: GgmlType, f16_at: &[usize]) -> Vec<u8> {
    let mut b: Vec<u8> = (0..ty.block_bytes()).map(|_| rng.random()).collect();
    for &at in f16_at {
        let v = half::f16::from_f32(rng.random_range(-2.0f32..2.0));
        b[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }
    b
}

// ------------------------------------------------------------ reference dequantizers (ggml's loops)

fn ref_q4_0(b: &[u8]) -> Vec<f32> {
    let d = h(b, 0);
    let mut y = vec![0.0; 32];
    for j in 0..16 {
        y[j] = ((b[2 + j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
    }
    y
}

fn ref_q4_1(b: &[u8]) -> Vec<f32> {
    let (d, m) = (h(b, 0), h(b, 2));
    let lo = (0..16).map(|j| (b[4 + j] & 0x0F) as f32 * d + m);
    let hi = (0..16).map(|j| (b[4 + j] >> 4) as f32 * d + m);
    lo.chain(hi).collect()
}

/// Q5_0 / Q5_1: the fifth bits read as ggml does, `xh_0 = ((qh >> j) << 4) & 0x10`,
/// `xh_1 = (qh >> (j + 12)) & 0x10`.
fn ref_q5(b: &[u8], with_min: bool) -> Vec<f32> {
    let d = h(b, 0);
    let (m, qh_at) = if with_min { (h(b, 2), 4) } else { (0.0, 2) };
    let qh = u32::from_le_bytes(b[qh_at..qh_at + 4].try_into().unwrap());
    let qs = &b[qh_at + 4..];
    let mut y = vec![0.0; 32];
    for j in 0..16 {
        let x0 = ((qs[j] & 0x0F) as u32 | (((qh >> j) << 4) & 0x10)) as i32;
        let x1 = ((qs[j] >> 4) as u32 | ((qh >> (j + 12)) & 0x10)) as i32;
        if with_min {
            y[j] = x0 as f32 * d + m;
            y[j + 16] = x1 as f32 * d + m;
        } else {
            y[j] = (x0 - 16) as f32 * d;
            y[j + 16] = (x1 - 16) as f32 * d;
        }
    }
    y
}

fn ref_q5_0(b: &[u8]) -> Vec<f32> {
    ref_q5(b, false)
}

fn ref_q5_1(b: &[u8]) -> Vec<f32> {
    ref_q5(b, true)
}

const KVALUES: [f32; 16] = [
    -127., -104., -83., -65., -49., -35., -22., -10., 1., 13., 25., 38., 53., 69., 89., 113.,
];

fn ref_iq4_nl(b: &[u8]) -> Vec<f32> {
    let d = h(b, 0);
    let lo = (0..16).map(|j| d * KVALUES[(b[2 + j] & 0xf) as usize]);
    let hi = (0..16).map(|j| d * KVALUES[(b[2 + j] >> 4) as usize]);
    lo.chain(hi).collect()
}

fn ref_iq4_xs(b: &[u8]) -> Vec<f32> {
    let d = h(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]) as i32;
    let mut y = Vec::with_capacity(QK_K);
    let mut qs = 8;
    for ib in 0..8 {
        let ls =
            ((b[4 + ib / 2] as i32 >> (4 * (ib % 2))) & 0xf) | (((scales_h >> (2 * ib)) & 3) << 4);
        let dl = d * (ls - 32) as f32;
        y.extend((0..16).map(|j| dl * KVALUES[(b[qs + j] & 0xf) as usize]));
        y.extend((0..16).map(|j| dl * KVALUES[(b[qs + j] >> 4) as usize]));
        qs += 16;
    }
    y
}

fn ref_q8_0(b: &[u8]) -> Vec<f32> {
    (0..32).map(|j| (b[2 + j] as i8) as f32 * h(b, 0)).collect()
}

fn ref_q2k(b: &[u8]) -> Vec<f32> {
    let (d, min) = (h(b, 80), h(b, 82));
    let mut y = Vec::with_capacity(QK_K);
    let mut is = 0;
    let mut q = 16;
    for _n in 0..2 {
        let mut shift = 0;
        for _j in 0..4 {
            for off in [0, 16] {
                let sc = b[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                for l in 0..16 {
                    y.push(dl * ((b[q + l + off] >> shift) & 3) as f32 - ml);
                }
            }
            shift += 2;
        }
        q += 32;
    }
    y
}

fn ref_q3k(b: &[u8]) -> Vec<f32> {
    let d_all = h(b, 108);
    let mut aux = [0u32; 4];
    for k in 0..3 {
        aux[k] = u32::from_le_bytes([b[96 + 4 * k], b[97 + 4 * k], b[98 + 4 * k], b[99 + 4 * k]]);
    }
    let (kmask1, kmask2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    let scales: Vec<i8> = aux
        .iter()
        .flat_map(|a| a.to_le_bytes())
        .map(|v| v as i8)
        .collect();
    let mut y = Vec::with_capacity(QK_K);
    let (mut is, mut q, mut m) = (0, 32, 1u8);
    for _n in 0..2 {
        let mut shift = 0;
        for _j in 0..4 {
            for off in [0, 16] {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let low = ((b[q + l + off] >> shift) & 3) as i32;
                    let hi = if b[l + off] & m != 0 { 0 } else { 4 };
                    y.push(dl * (low - hi) as f32);
                }
            }
            shift += 2;
            m <<= 1;
        }
        q += 32;
    }
    y
}

fn ref_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn ref_q4k(b: &[u8]) -> Vec<f32> {
    let (d, min) = (h(b, 0), h(b, 2));
    let mut y = Vec::with_capacity(QK_K);
    for (k, q) in b[16..].chunks(32).enumerate() {
        let (s1, m1) = ref_scale_min(2 * k, &b[4..16]);
        let (s2, m2) = ref_scale_min(2 * k + 1, &b[4..16]);
        y.extend(
            q.iter()
                .map(|v| d * s1 as f32 * (v & 0xF) as f32 - min * m1 as f32),
        );
        y.extend(
            q.iter()
                .map(|v| d * s2 as f32 * (v >> 4) as f32 - min * m2 as f32),
        );
    }
    y
}

fn ref_q5k(b: &[u8]) -> Vec<f32> {
    let (d, min) = (h(b, 0), h(b, 2));
    let qh = &b[16..48];
    let mut y = Vec::with_capacity(QK_K);
    let (mut u1, mut u2) = (1u8, 2u8);
    for (k, ql) in b[48..].chunks(32).enumerate() {
        let (s1, m1) = ref_scale_min(2 * k, &b[4..16]);
        let (s2, m2) = ref_scale_min(2 * k + 1, &b[4..16]);
        for l in 0..32 {
            let v = (ql[l] & 0xF) + if qh[l] & u1 != 0 { 16 } else { 0 };
            y.push(d * s1 as f32 * v as f32 - min * m1 as f32);
        }
        for l in 0..32 {
            let v = (ql[l] >> 4) + if qh[l] & u2 != 0 { 16 } else { 0 };
            y.push(d * s2 as f32 * v as f32 - min * m2 as f32);
        }
        u1 <<= 2;
        u2 <<= 2;
    }
    y
}

fn ref_q6k(b: &[u8]) -> Vec<f32> {
    let d = h(b, 208);
    let mut y = vec![0.0f32; QK_K];
    let (mut ql, mut qh, mut sc, mut yo) = (0usize, 128usize, 192usize, 0usize);
    for _n in 0..2 {
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((b[ql + l] & 0xF) | ((b[qh + l] & 3) << 4)) as i32 - 32;
            let q2 = ((b[ql + l + 32] & 0xF) | (((b[qh + l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((b[ql + l] >> 4) | (((b[qh + l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((b[ql + l + 32] >> 4) | (((b[qh + l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| (b[sc + is + k] as i8) as f32;
            y[yo + l] = d * s(0) * q1 as f32;
            y[yo + l + 32] = d * s(2) * q2 as f32;
            y[yo + l + 64] = d * s(4) * q3 as f32;
            y[yo + l + 96] = d * s(6) * q4 as f32;
        }
        yo += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
    y
}

/// A reference dequantizer and the byte offsets of the block's f16 fields.
type Reference = (fn(&[u8]) -> Vec<f32>, Vec<usize>);

fn reference(ty: GgmlType) -> Reference {
    match ty {
        GgmlType::Q4_0 => (ref_q4_0, vec![0]),
        GgmlType::Q8_0 => (ref_q8_0, vec![0]),
        GgmlType::Q4_1 => (ref_q4_1, vec![0, 2]),
        GgmlType::Q5_0 => (ref_q5_0, vec![0]),
        GgmlType::Q5_1 => (ref_q5_1, vec![0, 2]),
        GgmlType::IQ4NL => (ref_iq4_nl, vec![0]),
        GgmlType::IQ4XS => (ref_iq4_xs, vec![0]),
        GgmlType::Q2K => (ref_q2k, vec![80, 82]),
        GgmlType::Q3K => (ref_q3k, vec![108]),
        GgmlType::Q4K => (ref_q4k, vec![0, 2]),
        GgmlType::Q5K => (ref_q5k, vec![0, 2]),
        GgmlType::Q6K => (ref_q6k, vec![208]),
        _ => unreachable!(),
    }
}

/// The block-quantized types (every type but the float ones), in [`GgmlType::ALL`]'s order.
fn quantized() -> impl Iterator<Item = GgmlType> {
    GgmlType::ALL.into_iter().filter(|t| t.is_quantized())
}

#[test]
fn dequantization_of_random_blocks_matches_the_reference_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(7);
    for ty in quantized() {
        let (f, at) = reference(ty);
        for _ in 0..200 {
            let b = random_block(&mut rng, ty, &at);
            let mut y = vec![0.0f32; ty.block_len()];
            dequantize_row(ty, &b, &mut y);
            let want = f(&b);
            let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{}: {:?}\nvs reference {:?}", ty.name(), y, want);
        }
    }
}

#[test]
fn every_code_bit_reaches_the_output() {
    // Flipping any single bit of a quantized block (outside the f16 fields) changes the
    // dequantized values, so no packed field is dropped by the dequantizer.
    let mut rng = StdRng::seed_from_u64(3);
    for ty in quantized() {
        let (_, at) = reference(ty);
        let x = gauss_vec(&mut rng, ty.block_len());
        let mut b = vec![0u8; ty.block_bytes()];
        quantize_row(ty, &x, None, &mut b);
        let mut base = vec![0.0f32; ty.block_len()];
        dequantize_row(ty, &b, &mut base);
        for byte in 0..b.len() {
            if at.iter().any(|&a| byte == a || byte == a + 1) {
                continue;
            }
            for bit in 0..8 {
                let mut m = b.clone();
                m[byte] ^= 1 << bit;
                let mut y = vec![0.0f32; ty.block_len()];
                dequantize_row(ty, &m, &mut y);
                assert_ne!(y, base, "{} byte {byte} bit {bit} is ignored", ty.name());
            }
        }
    }
}

fn rel_rmse(x: &[f32], y: &[f32]) -> f64 {
    let e: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let s: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (e / s).sqrt()
}

fn round_trip(ty: GgmlType, x: &[f32], cols: usize, w: Option<&[f32]>) -> Vec<f32> {
    let q = quantize_tensor(ty, x, cols, w).unwrap();
    assert_eq!(q.len(), x.len() / cols * ty.row_bytes(cols).unwrap());
    dequantize_tensor(ty, &q, cols).unwrap()
}

#[test]
fn round_trip_error_is_within_each_types_bound_and_ordered_by_bits() {
    let mut rng = StdRng::seed_from_u64(11);
    let cols = 1024;
    let x = gauss_vec(&mut rng, 64 * cols);
    // Relative RMSE on Gaussian data, about 10% above what these quantizers reach (the step of each
    // grid over sqrt(12), less what the searches gain).
    let bounds = [
        (GgmlType::F32, 0.0),
        (GgmlType::F16, 4e-4),
        (GgmlType::BF16, 3e-3),
        (GgmlType::Q8_0, 6e-3),
        (GgmlType::Q6K, 2.0e-2),
        (GgmlType::Q5K, 4.0e-2),
        (GgmlType::Q4K, 7.8e-2),
        (GgmlType::Q4_0, 9.5e-2),
        (GgmlType::Q4_1, 9.0e-2),
        (GgmlType::Q5_0, 4.8e-2),
        (GgmlType::Q5_1, 4.5e-2),
        (GgmlType::IQ4NL, 9.0e-2),
        (GgmlType::IQ4XS, 9.0e-2),
        (GgmlType::Q3K, 1.65e-1),
        (GgmlType::Q2K, 3.2e-1),
    ];
    let mut errs = Vec::new();
    for (ty, bound) in bounds {
        let e = rel_rmse(&x, &round_trip(ty, &x, cols, None));
        eprintln!("{}: relative RMSE {e:.5}", ty.name());
        errs.push((ty, e, bound));
    }
    for (ty, e, bound) in &errs {
        assert!(e <= bound, "{}: {e} > {bound}", ty.name());
    }
    let order = [
        GgmlType::Q8_0,
        GgmlType::Q6K,
        GgmlType::Q5K,
        GgmlType::Q4K,
        GgmlType::Q3K,
        GgmlType::Q2K,
    ];
    let err_of = |t| errs.iter().find(|(u, _, _)| *u == t).unwrap().1;
    for pair in order.windows(2) {
        assert!(err_of(pair[0]) < err_of(pair[1]), "{:?}", pair);
    }
}

#[test]
fn importance_lowers_the_weighted_error_of_the_weighted_types() {
    let mut rng = StdRng::seed_from_u64(5);
    let cols = 512;
    let x = gauss_vec(&mut rng, 32 * cols);
    // A heavy-tailed importance (some columns matter 100× more), like real activation statistics.
    let w: Vec<f32> = (0..cols)
        .map(|_| (3.0 * crate::testkit::gauss(&mut rng)).exp())
        .collect();
    let werr = |y: &[f32]| -> f64 {
        x.iter()
            .zip(y)
            .enumerate()
            .map(|(i, (a, b))| w[i % cols] as f64 * ((a - b) as f64).powi(2))
            .sum()
    };
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ] {
        let plain = werr(&round_trip(ty, &x, cols, None));
        let weighted = werr(&round_trip(ty, &x, cols, Some(&w)));
        eprintln!("{}: weighted error {plain:.4} -> {weighted:.4}", ty.name());
        assert!(
            weighted < 0.9 * plain,
            "{}: {weighted} vs {plain}",
            ty.name()
        );
    }
    // Uniform importance still gives a sound quantization.
    let ones = vec![1.0f32; cols];
    for ty in [GgmlType::Q2K, GgmlType::Q3K, GgmlType::Q4K, GgmlType::Q6K] {
        let e = rel_rmse(&x, &round_trip(ty, &x, cols, Some(&ones)));
        assert!(e < 0.3, "{}: {e}", ty.name());
    }
}

/// The levels a value of sub-block `j` can take, given the block's stored scales.
fn levels(ty: GgmlType, b: &[u8], j: usize) -> Vec<f32> {
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => {
            let (sc, m) = kquants::scale_min_k4(j, &b[4..16]);
            let nmax = if ty == GgmlType::Q4K { 15 } else { 31 };
            (0..=nmax)
                .map(|l| h(b, 0) * sc as f32 * l as f32 - h(b, 2) * m as f32)
                .collect()
        }
        GgmlType::Q6K => (-32..32)
            .map(|l| h(b, 208) * (b[192 + j] as i8) as f32 * l as f32)
            .collect(),
        GgmlType::Q3K => (-4..4)
            .map(|l| h(b, 108) * kquants::q3_scale(j, &b[96..108]) as f32 * l as f32)
            .collect(),
        GgmlType::Q2K => (0..4)
            .map(|l| h(b, 80) * (b[j] & 0xF) as f32 * l as f32 - h(b, 82) * (b[j] >> 4) as f32)
            .collect(),
        _ => unreachable!(),
    }
}

#[test]
fn every_code_is_the_nearest_level_of_its_stored_scale() {
    // The final pass rounds each value against the scales as stored: no level of its sub-block
    // is closer (up to float rounding of the division).
    let mut rng = StdRng::seed_from_u64(13);
    let x = gauss_vec(&mut rng, 8 * QK_K);
    for ty in [
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ] {
        let sub = if matches!(ty, GgmlType::Q4K | GgmlType::Q5K) {
            32
        } else {
            16
        };
        for w in [None, Some(vec![1.0f32; QK_K])] {
            for xb in x.chunks(QK_K) {
                let mut b = vec![0u8; ty.block_bytes()];
                quantize_row(ty, xb, w.as_deref(), &mut b);
                let mut y = vec![0.0; QK_K];
                dequantize_row(ty, &b, &mut y);
                for (i, (&v, &got)) in xb.iter().zip(&y).enumerate() {
                    let lv = levels(ty, &b, i / sub);
                    if lv.iter().all(|l| *l == lv[0]) {
                        continue; // a zero scale keeps the search's codes
                    }
                    let best = lv
                        .iter()
                        .map(|l| (l - v).abs())
                        .fold(f32::INFINITY, f32::min);
                    let tol = 1e-5 * (1.0 + v.abs());
                    assert!(
                        (got - v).abs() <= best + tol,
                        "{} value {i}: {v} -> {got}, nearest level is {best} away",
                        ty.name()
                    );
                }
            }
        }
    }
}

#[test]
fn nearest_rounds_half_to_even_like_ggml() {
    for (v, want) in [
        (0.5f32, 0),
        (1.5, 2),
        (2.5, 2),
        (-0.5, 0),
        (-1.5, -2),
        (-2.5, -2),
        (3.49, 3),
        (-3.51, -4),
    ] {
        assert_eq!(search::nearest(v), want, "{v}");
    }
    let mut rng = StdRng::seed_from_u64(1);
    for _ in 0..100_000 {
        let v: f32 = rng.random_range(-4_000_000.0f32..4_000_000.0);
        assert_eq!(search::nearest(v), v.round_ties_even() as i32, "{v}");
        let small = v / 65536.0;
        assert_eq!(
            search::nearest(small),
            small.round_ties_even() as i32,
            "{small}"
        );
    }
}

#[test]
fn simple_types_equal_a_naive_quantizer_byte_for_byte() {
    let mut rng = StdRng::seed_from_u64(17);
    let x = gauss_vec(&mut rng, 32 * 40);
    for xb in x.chunks(32) {
        // Q8_0: d = max|x|/127 as f16, q = round-half-away(x/d) with the unrounded d.
        let amax = xb.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
        let d = amax / 127.0;
        let mut want = half::f16::from_f32(d).to_le_bytes().to_vec();
        want.extend(xb.iter().map(|v| (v / d).round() as i8 as u8));
        let mut got = vec![0u8; 34];
        quantize_row(GgmlType::Q8_0, xb, None, &mut got);
        // x·(1/d) and x/d can differ in the last bit; allow a code off by one only there.
        for (a, b) in got[2..].iter().zip(&want[2..]) {
            assert!((*a as i8 as i32 - *b as i8 as i32).abs() <= 1);
        }
        assert_eq!(got[..2], want[..2]);
        // Q4_0: d = (signed extreme)/−8; q = min(15, trunc(x/d + 8.5)).
        let ext = xb
            .iter()
            .copied()
            .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
        let d = ext / -8.0;
        let mut got = vec![0u8; 18];
        quantize_row(GgmlType::Q4_0, xb, None, &mut got);
        assert_eq!(got[..2], half::f16::from_f32(d).to_le_bytes());
        for j in 0..16 {
            let q = |v: f32| ((v * (1.0 / d) + 8.5) as i32).min(15) as u8;
            assert_eq!(got[2 + j], q(xb[j]) | (q(xb[j + 16]) << 4));
        }
    }
    // F16 / BF16: round to nearest even, as the half crate does for F16.
    let mut got = vec![0u8; x.len() * 2];
    quantize_row(GgmlType::BF16, &x, None, &mut got);
    for (v, c) in x.iter().zip(got.chunks(2)) {
        assert_eq!(
            u16::from_le_bytes([c[0], c[1]]),
            half::bf16::from_f32(*v).to_bits()
        );
    }
}

#[test]
fn zero_constant_and_outlier_rows_are_handled() {
    for ty in GgmlType::ALL {
        let cols = 512;
        let zeros = vec![0.0f32; cols];
        assert!(
            round_trip(ty, &zeros, cols, None).iter().all(|v| *v == 0.0),
            "{}",
            ty.name()
        );
        let w = vec![1.0f32; cols];
        assert!(
            round_trip(ty, &zeros, cols, Some(&w))
                .iter()
                .all(|v| *v == 0.0),
            "{}",
            ty.name()
        );
        let c = vec![0.25f32; cols];
        let y = round_trip(ty, &c, cols, None);
        assert!(
            rel_rmse(&c, &y) < 0.05,
            "{}: constant row {:?}",
            ty.name(),
            &y[..4]
        );
        let mut o = vec![0.01f32; cols];
        o[7] = 100.0;
        let y = round_trip(ty, &o, cols, None);
        assert!(
            (y[7] - 100.0).abs() < 2.0,
            "{}: outlier -> {}",
            ty.name(),
            y[7]
        );
        assert!(y.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn bad_shapes_are_typed_errors() {
    let x = vec![0.0f32; 384];
    assert_eq!(
        quantize_tensor(GgmlType::Q4K, &x, 384, None),
        Err(BlockError::RowNotBlockMultiple {
            ty: "Q4_K",
            cols: 384,
            block: 256
        })
    );
    assert!(matches!(
        quantize_tensor(GgmlType::Q8_0, &x, 256, None),
        Err(BlockError::Shape { .. })
    ));
    assert!(matches!(
        quantize_tensor(GgmlType::Q8_0, &x, 128, Some(&[1.0; 64])),
        Err(BlockError::Importance { len: 64, cols: 128 })
    ));
    assert!(quantize_tensor(GgmlType::Q8_0, &x, 128, None).is_ok());
}
