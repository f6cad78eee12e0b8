//! `BF16`: bfloat16, the upper 16 bits of an `f32`, one value per 2 bytes.

use super::simd::{FloatElem, float_dot_scalar};
use super::{ActFormat, ActRow, BlockFormat};
use crate::gguf::GgmlType;

/// The `BF16` format.
pub struct Bf16;

impl FloatElem for Bf16 {
    const BYTES: usize = 2;
    #[inline(always)]
    fn get(row: &[u8], i: usize) -> f32 {
        f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16)
    }
}

impl BlockFormat for Bf16 {
    const TYPE: GgmlType = GgmlType::BF16;
    const BLOCK_ELEMS: usize = 1;
    const BLOCK_BYTES: usize = 2;
    const ACTS: ActFormat = ActFormat::F32;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        out[0] = f32::from_bits((u16::from_le_bytes([block[0], block[1]]) as u32) << 16);
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
    use super::Bf16;

    impl FloatLoad for Bf16 {
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn load8(p: *const u8) -> __m256 {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)), 16))
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        #[inline]
        unsafe fn load16(p: *const u8) -> __m512 {
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)), 16))
        }
    }
}

crate::quant::simd::float_simd!(Bf16);

/// Rounds an `f32` to bfloat16 bits the way the `gguf` package and ggml do: NaN stays a quiet NaN, everything
/// else rounds to nearest even.
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 64) as u16;
    }
    ((bits.wrapping_add(0x7fff + ((bits >> 16) & 1))) >> 16) as u16
}
