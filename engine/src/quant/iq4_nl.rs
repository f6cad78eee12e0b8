//! `IQ4_NL`: blocks of 32 values as an `f16` scale `d` and 16 bytes of 4-bit indices into the non-linear
//! levels `KVALUES_IQ4NL` (layout as Q4_0); value = `d * kvalues[i]` (ggml `block_iq4_nl`; levels from the
//! `gguf` package, `IQ4_NL.kvalues`).

use super::blocks32::{Block32, block32_simd};
use super::grids::KVALUES_IQ4NL;
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `IQ4_NL` format.
pub struct Iq4Nl;

impl BlockFormat for Iq4Nl {
    const TYPE: GgmlType = GgmlType::IQ4_NL;
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 18;
    const ACTS: ActFormat = ActFormat::Q8_32;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        let mut q = [0i8; 32];
        Self::levels(block, &mut q);
        for (o, &v) in out.iter_mut().zip(&q) {
            *o = d * v as f32;
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 0)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::blocks32::dot_scalar::<Self>(row, xs, out)
    }
}

impl Block32 for Iq4Nl {
    const OFFSET: i32 = 128;
    const AVX2_SIGNED: bool = true;
    fn d(block: &[u8]) -> f32 {
        f16_at(block, 0)
    }
    fn levels(block: &[u8], q: &mut [i8; 32]) {
        for (i, &b) in block[2..18].iter().enumerate() {
            q[i] = KVALUES_IQ4NL[(b & 15) as usize];
            q[i + 16] = KVALUES_IQ4NL[(b >> 4) as usize];
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn avx2_levels(p: *const u8) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        unsafe {
            let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
            _mm256_shuffle_epi8(table, super::blocks32::x86::nibbles_256(p.add(2)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn avx512_levels2(p0: *const u8, p1: *const u8) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        unsafe {
            let k = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
            let table = _mm512_broadcast_i32x4(_mm_xor_si128(k, _mm_set1_epi8(-128)));
            _mm512_shuffle_epi8(table, super::blocks32::x86::nibbles2_512(p0.add(2), p1.add(2)))
        }
    }
}

block32_simd!(Iq4Nl);
