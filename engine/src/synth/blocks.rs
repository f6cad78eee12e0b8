//! Random *valid* blocks of every GGUF block type, at a chosen standard deviation, for `nebula synth`.
//!
//! No float weights are made and nothing is quantized: each block's level bits (the 2..8-bit levels of the
//! linear types, the grid indices and sign indices of the i-quants) are uniform random bits, which every index
//! of these formats accepts, and the scales are fixed so that every block has the same spread:
//!
//! - sub-block scales (K-quants, IQ4_XS, the IQ2/IQ3/IQ1 4- or 3-bit block scales) are one mid-range value for
//!   every sub-block (the table in [`layout`]);
//! - the types with a min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) get the min that centres the uniform levels, so their
//!   values have mean zero; the symmetric linear types (Q4_0, Q5_0, Q8_0, Q3_K, Q6_K) have the small negative
//!   mean of their asymmetric level range (half a level step), the i-quants the mean of their grids (zero for
//!   the signed grids);
//! - the `f16` super-block scale `d` is `std / s1`, with `s1` the standard deviation of the dequantized values
//!   of blocks made the same way with `d = 1` (measured once per type with this crate's own dequantizer over
//!   [`CALIBRATION_BLOCKS`] blocks), so the written values have the requested standard deviation to within the
//!   sampling error of that measurement and the `f16` rounding of `d`.
//!
//! The value distribution is therefore the format's own level (or grid-point) distribution under uniform
//! indices: uniform over the levels for the linear types, the grid's empirical distribution for the i-quants.

use crate::gguf::GgmlType;
use crate::quant::dequantize_row;

use super::Rng;

/// Blocks dequantized to measure a type's unit standard deviation.
pub const CALIBRATION_BLOCKS: usize = 256;

/// Where a block keeps its scales, and the fixed bytes that make every block alike.
struct Layout {
    /// Offset of the `f16` super-block scale `d` (`None`: IQ1_M, whose `d` is spread over four nibbles, and
    /// MXFP4, which has an exponent byte).
    d: Option<usize>,
    /// Offset of the `f16` min scale and its ratio to `d` (value = level term - ratio * d * min code).
    dmin: Option<(usize, f32)>,
    /// `(offset, length, byte)`: bytes set to a fixed value.
    fixed: &'static [(usize, usize, u8)],
    /// `(offset, stride, count, mask, bits)`: bytes whose `mask` bits are replaced by `bits`.
    masked: &'static [(usize, usize, usize, u8, u8)],
}

/// The block layout of `ty` (ggml's `block_*` structs in `ggml-common.h`), `None` for a float type.
fn layout(ty: GgmlType) -> Option<Layout> {
    use GgmlType as T;
    let plain = |d| Layout { d: Some(d), dmin: None, fixed: &[], masked: &[] };
    Some(match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4_NL => plain(0),
        // value = d q + m, q in 0..16 (0..32): m = -7.5 d (-15.5 d) centres it.
        T::Q4_1 => Layout { d: Some(0), dmin: Some((2, -7.5)), fixed: &[], masked: &[] },
        T::Q5_1 => Layout { d: Some(0), dmin: Some((2, -15.5)), fixed: &[], masked: &[] },
        // 16 scale bytes 0xC8: scale 8, min 12; value = d 8 q - dmin 12 with q in 0..4 and dmin = d: mean 0.
        T::Q2_K => Layout { d: Some(80), dmin: Some((82, 1.0)), fixed: &[(0, 16, 0xC8)], masked: &[] },
        // Every 6-bit scale 40 (scale 40 - 32 = 8): low nibbles 8, high bit pairs 2.
        T::Q3_K => Layout { d: Some(108), dmin: None, fixed: &[(96, 8, 0x88), (104, 4, 0xAA)], masked: &[] },
        // Every 6-bit scale and min 32 (`get_scale_min_k4`); dmin = 7.5 d (15.5 d) centres the levels.
        T::Q4_K => Layout { d: Some(0), dmin: Some((2, 7.5)), fixed: &[(4, 8, 160), (12, 4, 0)], masked: &[] },
        T::Q5_K => Layout { d: Some(0), dmin: Some((2, 15.5)), fixed: &[(4, 8, 160), (12, 4, 0)], masked: &[] },
        // Sixteen int8 scales 16.
        T::Q6_K => Layout { d: Some(208), dmin: None, fixed: &[(192, 16, 16)], masked: &[] },
        // Every 6-bit scale 40 (40 - 32 = 8): scales_h 0xAAAA, scales_l 0x88.
        T::IQ4_XS => Layout { d: Some(0), dmin: None, fixed: &[(2, 2, 0xAA), (4, 4, 0x88)], masked: &[] },
        // The 4-bit block scale in the top nibble of each sub-block's second (first for IQ3_XXS) u32: 7.
        T::IQ2_XXS => Layout { d: Some(0), dmin: None, fixed: &[], masked: &[(9, 8, 8, 0xF0, 0x70)] },
        T::IQ3_XXS => Layout { d: Some(0), dmin: None, fixed: &[], masked: &[(69, 4, 8, 0xF0, 0x70)] },
        // Two 4-bit block scales per byte: 7 and 7 (IQ2_XS, IQ2_S), 3 and 3 (IQ3_S).
        T::IQ2_XS => Layout { d: Some(0), dmin: None, fixed: &[(66, 8, 0x77)], masked: &[] },
        T::IQ2_S => Layout { d: Some(0), dmin: None, fixed: &[(74, 8, 0x77)], masked: &[] },
        T::IQ3_S => Layout { d: Some(0), dmin: None, fixed: &[(106, 4, 0x33)], masked: &[] },
        // The 3-bit block scale in bits 12..15 of each qh word: 3 (the delta sign bit stays random).
        T::IQ1_S => Layout { d: Some(0), dmin: None, fixed: &[], masked: &[(35, 2, 8, 0x70, 0x30)] },
        // Four 3-bit block scales 3 in bits 0..12 of each scale word (0x6DB); `d`'s nibbles in bits 12..16.
        T::IQ1_M => Layout {
            d: None,
            dmin: None,
            fixed: &[(48, 1, 0xDB), (50, 1, 0xDB), (52, 1, 0xDB), (54, 1, 0xDB)],
            masked: &[(49, 2, 4, 0x0F, 0x06)],
        },
        T::MXFP4 => Layout { d: None, dmin: None, fixed: &[], masked: &[] },
        _ => return None,
    })
}

/// Writes `d` (and the min scale) into one block.
fn set_scales(ty: GgmlType, l: &Layout, b: &mut [u8], d: half::f16) {
    if let Some(o) = l.d {
        b[o..o + 2].copy_from_slice(&d.to_le_bytes());
    }
    if let Some((o, ratio)) = l.dmin {
        b[o..o + 2].copy_from_slice(&half::f16::from_f32(d.to_f32() * ratio).to_le_bytes());
    }
    match ty {
        GgmlType::IQ1_M => {
            let bits = d.to_bits();
            for k in 0..4 {
                let o = 49 + 2 * k;
                b[o] = (b[o] & 0x0F) | ((((bits >> (4 * k)) & 15) as u8) << 4);
            }
        }
        GgmlType::MXFP4 => {
            // E8M0: the power of two nearest `d`.
            b[0] = (127.0 + d.to_f32().log2().round()).clamp(1.0, 254.0) as u8;
        }
        _ => {}
    }
}

/// Appends `n_blocks` random blocks of `ty` with scale `d` (see the module docs) to `out`.
fn blocks(ty: GgmlType, l: &Layout, n_blocks: usize, d: half::f16, rng: &mut Rng, out: &mut Vec<u8>) {
    let bs = ty.type_size();
    let start = out.len();
    out.resize(start + n_blocks * bs, 0);
    let dst = &mut out[start..];
    for c in dst.chunks_mut(8) {
        let v = rng.next().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
    for b in dst.chunks_exact_mut(bs) {
        for &(o, n, v) in l.fixed {
            b[o..o + n].fill(v);
        }
        for &(o, stride, count, mask, bits) in l.masked {
            for k in 0..count {
                let x = &mut b[o + k * stride];
                *x = (*x & !mask) | bits;
            }
        }
        set_scales(ty, l, b, d);
    }
}

/// Standard deviation of `ty`'s values with `d = 1`, measured on [`CALIBRATION_BLOCKS`] random blocks.
fn unit_std(ty: GgmlType, l: &Layout) -> f64 {
    let mut rng = Rng::new(0x5eed ^ ty as u64);
    let mut bytes = Vec::new();
    blocks(ty, l, CALIBRATION_BLOCKS, half::f16::ONE, &mut rng, &mut bytes);
    let mut vals = vec![0f32; CALIBRATION_BLOCKS * ty.block_size()];
    dequantize_row(ty, &bytes, &mut vals).expect("every block type synth writes is readable");
    let n = vals.len() as f64;
    let mean = vals.iter().map(|&v| v as f64).sum::<f64>() / n;
    (vals.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt()
}

/// A planned block type: the scale that gives values of the requested standard deviation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockPlan {
    ty: GgmlType,
    d: half::f16,
}

impl BlockPlan {
    /// Plans blocks of `ty` whose values have standard deviation `std`. `None` for a float type.
    pub fn new(ty: GgmlType, std: f32) -> Option<Self> {
        let l = layout(ty)?;
        let d = std as f64 / unit_std(ty, &l);
        Some(Self { ty, d: half::f16::from_f64(d) })
    }

    /// Appends `n_blocks` random blocks to `out`.
    pub fn fill(&self, n_blocks: usize, rng: &mut Rng, out: &mut Vec<u8>) {
        let l = layout(self.ty).expect("planned for a block type");
        blocks(self.ty, &l, n_blocks, self.d, rng, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every type the recipes can pick, dequantized by the CPU kernels: the requested spread, every value
    /// finite, means near zero where the layout centres them.
    #[test]
    fn random_blocks_have_the_requested_spread() {
        use GgmlType as T;
        let types = [
            T::Q4_0,
            T::Q4_1,
            T::Q5_0,
            T::Q5_1,
            T::Q8_0,
            T::Q2_K,
            T::Q3_K,
            T::Q4_K,
            T::Q5_K,
            T::Q6_K,
            T::IQ4_NL,
            T::IQ4_XS,
            T::IQ2_XXS,
            T::IQ2_XS,
            T::IQ2_S,
            T::IQ3_XXS,
            T::IQ3_S,
            T::IQ1_S,
            T::IQ1_M,
        ];
        for ty in types {
            let want = 0.02f32;
            let plan = BlockPlan::new(ty, want).unwrap();
            let mut rng = Rng::new(99);
            let mut bytes = Vec::new();
            let n = 4096 / ty.block_size() * 16;
            plan.fill(n, &mut rng, &mut bytes);
            assert_eq!(bytes.len(), n * ty.type_size(), "{}", ty.name());
            let mut v = vec![0f32; n * ty.block_size()];
            dequantize_row(ty, &bytes, &mut v).unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{}", ty.name());
            let m = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
            let s = (v.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
            assert!((s / want as f64 - 1.0).abs() < 0.05, "{}: std {s} for {want}", ty.name());
            assert!(m.abs() < 0.25 * want as f64, "{}: mean {m}", ty.name());
            // Not a constant: the level bits are random.
            let distinct = v.iter().map(|x| x.to_bits()).collect::<std::collections::BTreeSet<_>>().len();
            assert!(distinct >= 3, "{}: {distinct} distinct values", ty.name());
        }
    }

    #[test]
    fn float_types_are_not_block_types() {
        assert!(BlockPlan::new(GgmlType::F32, 1.0).is_none());
        assert!(BlockPlan::new(GgmlType::BF16, 1.0).is_none());
    }
}
