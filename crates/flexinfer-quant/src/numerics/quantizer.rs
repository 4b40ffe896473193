//! Per-row min/max quantizer with the reference tools' conventions (docs/dev/gptq.md §1.6).

/// Scale and integer zero-point for each output row of one group.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupParams {
    pub scale: Vec<f32>,
    pub zero: Vec<f32>,
}

/// `maxq = 2^bits - 1`.
pub fn maxq(bits: u32) -> f32 {
    ((1u32 << bits) - 1) as f32
}

/// Per-row parameters from the min/max of `cols` columns of a column-major matrix.
/// `col(c)` must return column `c` (one value per row).
pub fn find_params<'a>(
    rows: usize,
    columns: impl Iterator<Item = &'a [f32]>,
    bits: u32,
    sym: bool,
) -> GroupParams {
    let mut xmin = vec![0.0f32; rows];
    let mut xmax = vec![0.0f32; rows];
    // Starting from zero: the range always contains zero. `f32::min`/`max` skip NaN like the comparisons of
    // the reference, and vectorize (dispatched to the CPU's widest instruction set).
    pulp::Arch::new().dispatch(
        #[inline(always)]
        || {
            for col in columns {
                for ((lo, hi), &v) in xmin.iter_mut().zip(xmax.iter_mut()).zip(&col[..rows]) {
                    *lo = lo.min(v);
                    *hi = hi.max(v);
                }
            }
        },
    );
    params_from_range(&mut xmin, &mut xmax, bits, sym)
}

fn params_from_range(xmin: &mut [f32], xmax: &mut [f32], bits: u32, sym: bool) -> GroupParams {
    let maxq = maxq(bits);
    let rows = xmin.len();
    let mut scale = vec![0.0f32; rows];
    let mut zero = vec![0.0f32; rows];
    for r in 0..rows {
        let (mut lo, mut hi) = (xmin[r], xmax[r]);
        if sym {
            hi = hi.max(lo.abs());
            if lo < 0.0 {
                lo = -hi;
            }
        }
        if lo == 0.0 && hi == 0.0 {
            lo = -1.0;
            hi = 1.0;
        }
        let s = (hi - lo) / maxq;
        scale[r] = s;
        zero[r] = if sym {
            (maxq + 1.0) / 2.0
        } else {
            (-lo / s).round_ties_even()
        };
    }
    GroupParams { scale, zero }
}

/// Integer code of one value: `clamp(round(x/scale) + zero, 0, maxq)` (a NaN input gives code 0).
#[inline(always)]
pub fn quantize_code(x: f32, scale: f32, zero: f32, maxq: f32) -> f32 {
    // max/min rather than `clamp`: same result for every number, and it vectorizes.
    ((x / scale).round_ties_even() + zero).max(0.0).min(maxq)
}

/// Dequantized value of a code.
#[inline(always)]
pub fn dequantize(code: f32, scale: f32, zero: f32) -> f32 {
    scale * (code - zero)
}
