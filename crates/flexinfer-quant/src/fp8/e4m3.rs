//! The OCP FP8 E4M3 code (`float8_e4m3fn` in torch, `F8_E4M3` in safetensors): 1 sign bit, 4 exponent bits
//! (bias 7), 3 mantissa bits; no infinities; `S.1111.111` is NaN, so the largest finite magnitude is
//! `1.75 × 2⁸ = 448`; exponent 0 holds the subnormals `m × 2⁻⁹`.
//!
//! [`encode`] rounds to nearest, ties to even, and saturates: every finite value and ±∞ beyond ±448
//! becomes ±448 (what `x.clamp(-448, 448).to(torch.float8_e4m3fn)` gives, the cast compressed-tensors
//! and vLLM use); NaN stays NaN.

/// Largest finite magnitude.
pub const MAX: f32 = 448.0;
/// The code of +448 (`0.1111.110`).
const MAX_CODE: u8 = 0x7E;
/// The NaN code without its sign (`0.1111.111`).
pub const NAN_CODE: u8 = 0x7F;
/// Smallest normal magnitude, `2⁻⁶`.
const MIN_NORMAL: f32 = 0.015_625;
/// `2⁹`: a subnormal's code is its magnitude in units of `2⁻⁹`.
const SUBNORMAL_STEPS: f32 = 512.0;

/// The E4M3 code nearest to `x` (ties to even), saturated to ±448.
pub fn encode(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return sign | NAN_CODE;
    }
    let a = x.abs();
    if a >= MAX {
        return sign | MAX_CODE;
    }
    if a < MIN_NORMAL {
        // Exact: scaling by a power of two. 0..=8; 8 is the smallest normal's code (exponent 1, mantissa 0).
        let steps = (a * SUBNORMAL_STEPS).round_ties_even();
        return sign | steps as u8;
    }
    let bits = a.to_bits();
    // a is normal in f32 and in [2⁻⁶, 448): the unbiased exponent is -6..=8.
    let mut exponent = ((bits >> 23) & 0xFF) as i32 - 127;
    let fraction = bits & 0x7F_FFFF;
    let mut mantissa = fraction >> 20;
    let rest = fraction & 0xF_FFFF;
    const HALF: u32 = 1 << 19;
    if rest > HALF || (rest == HALF && mantissa & 1 == 1) {
        mantissa += 1;
        if mantissa == 8 {
            mantissa = 0;
            exponent += 1;
        }
    }
    // a < 448 rounds at most to 448 (exponent 8, mantissa 6), never to the NaN code.
    sign | (((exponent + 7) as u8) << 3) | mantissa as u8
}

/// The value of code `c` (NaN for `0x7F` / `0xFF`).
pub fn decode(c: u8) -> f32 {
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = (c >> 3) & 0x0F;
    let mantissa = f32::from(c & 0x07);
    if c & 0x7F == NAN_CODE {
        return f32::NAN;
    }
    if exponent == 0 {
        sign * mantissa / SUBNORMAL_STEPS
    } else {
        sign * (1.0 + mantissa / 8.0) * 2f32.powi(i32::from(exponent) - 7)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: every finite code's value by the format's definition (independent of [`decode`]'s
    /// arithmetic), and the nearest of them by search, ties to the even code, beyond 448 saturated.
    fn reference_value(c: u8) -> Option<f64> {
        let s = if c & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((c >> 3) & 0xF);
        let m = f64::from(c & 7);
        if e == 15 && m == 7.0 {
            return None;
        }
        Some(if e == 0 {
            s * m / 8.0 * 2f64.powi(-6)
        } else {
            s * (1.0 + m / 8.0) * 2f64.powi(e - 7)
        })
    }

    fn reference_encode(x: f32) -> u8 {
        if x.is_nan() {
            return if x.is_sign_negative() { 0xFF } else { 0x7F };
        }
        let x = f64::from(x).clamp(-448.0, 448.0);
        let mut best: Option<(f64, u8)> = None;
        for c in 0..=255u8 {
            let Some(v) = reference_value(c) else {
                continue;
            };
            // ±0: keep the input's sign.
            if v == 0.0 && (c & 0x80 != 0) != x.is_sign_negative() {
                continue;
            }
            let d = (x - v).abs();
            best = match best {
                None => Some((d, c)),
                Some((bd, bc)) if d < bd || (d == bd && c & 1 == 0 && bc & 1 == 1) => Some((d, c)),
                keep => keep,
            };
        }
        best.map(|(_, c)| c).unwrap_or(0)
    }

    #[test]
    fn decode_matches_the_definition_for_all_256_codes() {
        for c in 0..=255u8 {
            match reference_value(c) {
                None => assert!(decode(c).is_nan(), "{c:#04x}"),
                Some(v) => {
                    assert_eq!(f64::from(decode(c)), v, "{c:#04x}");
                    // Every finite code is its own nearest code.
                    assert_eq!(encode(decode(c)), c, "{c:#04x}");
                }
            }
        }
        assert_eq!(decode(0x7E), 448.0);
        assert_eq!(decode(0xFE), -448.0);
        assert_eq!(decode(0x01), 2f32.powi(-9));
        assert_eq!(decode(0x08), 2f32.powi(-6));
    }

    #[test]
    fn encode_matches_the_reference_on_midpoints_neighbours_and_edges() {
        let mut inputs = vec![
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::from_bits(1), // the smallest f32 subnormal
            448.0,
            448.0001,
            449.0,
            464.0, // halfway to the code 480 that E4M3 does not have
            480.0,
            1e6,
            -1e6,
            2f32.powi(-10), // half the smallest subnormal: a tie, rounds to even (0)
            3.0 * 2f32.powi(-10), // between codes 1 and 2: a tie, rounds to 2
            2f32.powi(-6) - 2f32.powi(-12),
        ];
        // Every midpoint between neighbouring codes (the ties) and the floats just beside it.
        let values: Vec<f32> = (0..=0x7Eu8).map(decode).collect();
        for w in values.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for x in [
                mid,
                f32::from_bits(mid.to_bits() + 1),
                f32::from_bits(mid.to_bits() - 1),
            ] {
                inputs.push(x);
                inputs.push(-x);
            }
        }
        // A dense sweep with a simple generator (LCG) over several magnitudes.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..20_000 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            let u = ((state >> 40) as f32) / (1u64 << 24) as f32;
            let scale = 2f32.powi(((state >> 8) % 30) as i32 - 14);
            inputs.push((u * 2.0 - 1.0) * scale);
        }
        for x in inputs {
            assert_eq!(
                encode(x),
                reference_encode(x),
                "x = {x:e} ({:#010x})",
                x.to_bits()
            );
        }
    }

    #[test]
    fn nan_saturation_and_signed_zero() {
        assert_eq!(encode(f32::NAN), NAN_CODE);
        assert!(decode(encode(f32::NAN)).is_nan());
        assert!(decode(encode(-f32::NAN)).is_nan());
        assert_eq!(encode(f32::INFINITY), 0x7E);
        assert_eq!(encode(f32::NEG_INFINITY), 0xFE);
        assert_eq!(encode(1e30), 0x7E);
        assert_eq!(encode(-0.0), 0x80);
        assert_eq!(encode(0.0), 0x00);
        // Below half the smallest subnormal: zero of the same sign.
        assert_eq!(encode(-1e-4), 0x80);
        // 432 is halfway between 416 (mantissa 5, odd) and 448: ties to even, 448.
        assert_eq!(encode(432.0), 0x7E);
        // 17 is halfway between 16 (mantissa 0) and 18 (mantissa 1): 16.
        assert_eq!(encode(17.0), encode(16.0));
    }
}
