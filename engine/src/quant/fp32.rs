//! `F32`: plain little-endian IEEE-754 single precision, one value per 4 bytes.

use super::simd::{FloatElem, float_dot_scalar};
use super::{ActFormat, ActRow, BlockFormat};
use crate::gguf::GgmlType;

/// The `F32` format.
pub struct Fp32;

impl FloatElem for Fp32 {
    const BYTES: usize = 4;
    #[inline(always)]
    fn get(row: &[u8], i: usize) -> f32 {
        f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]])
    }
}

impl BlockFormat for Fp32 {
    const TYPE: GgmlType = GgmlType::F32;
    const BLOCK_ELEMS: usize = 1;
    const BLOCK_BYTES: usize = 4;
    const ACTS: ActFormat = ActFormat::F32;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        out[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
    }
    fn scales_finite(_block: &[u8]) -> bool {
        true
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        float_dot_scalar::<Self>(row, xs, out)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::simd::x86::FloatLoad;
    use super::Fp32;

    impl FloatLoad for Fp32 {
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn load8(p: *const u8) -> __m256 {
            _mm256_loadu_ps(p as *const f32)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        #[inline]
        unsafe fn load16(p: *const u8) -> __m512 {
            _mm512_loadu_ps(p as *const f32)
        }
    }
}

crate::quant::simd::float_simd!(Fp32);
