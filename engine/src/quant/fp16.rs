//! `F16`: IEEE-754 half precision, one value per 2 bytes (converted exactly to `f32`).

use super::simd::{FloatElem, float_dot_scalar};
use super::{ActFormat, ActRow, BlockFormat};
use crate::gguf::GgmlType;

/// The `F16` format.
pub struct Fp16;

impl FloatElem for Fp16 {
    const BYTES: usize = 2;
    #[inline(always)]
    fn get(row: &[u8], i: usize) -> f32 {
        half::f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32()
    }
}

impl BlockFormat for Fp16 {
    const TYPE: GgmlType = GgmlType::F16;
    const BLOCK_ELEMS: usize = 1;
    const BLOCK_BYTES: usize = 2;
    const ACTS: ActFormat = ActFormat::F32;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        out[0] = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
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
    use super::Fp16;

    impl FloatLoad for Fp16 {
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn load8(p: *const u8) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        #[inline]
        unsafe fn load16(p: *const u8) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
    }
}

crate::quant::simd::float_simd!(Fp16);
