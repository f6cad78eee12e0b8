//! `MXFP4` (OCP microscaling FP4): blocks of 32 values as an e8m0 exponent byte `e` and 16 bytes of 4-bit e2m1
//! codes (layout as Q4_0). ggml and the `gguf` package store the e2m1 values doubled (`KVALUES_MXFP4`) and
//! halve the scale: value = `e8m0_half(e) * kvalues[i]`, `e8m0_half(e) = 2^(e - 128)` (bit patterns below
//! `e = 2` are the subnormals `0x00200000 << e`), as `gguf.quants.MXFP4.e8m0_to_fp32_half`.

use super::blocks32::{Block32, block32_simd};
use super::grids::KVALUES_MXFP4;
use super::{ActFormat, ActRow, BlockFormat};
use crate::gguf::GgmlType;

/// The `MXFP4` format.
pub struct Mxfp4;

/// The halved e8m0 scale: `2^(e - 128)`.
#[inline(always)]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { ((e as u32) - 1) << 23 };
    f32::from_bits(bits)
}

impl BlockFormat for Mxfp4 {
    const TYPE: GgmlType = GgmlType::MXFP4;
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 17;
    const ACTS: ActFormat = ActFormat::Q8_32;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = e8m0_half(block[0]);
        let mut q = [0i8; 32];
        Self::levels(block, &mut q);
        for (o, &v) in out.iter_mut().zip(&q) {
            *o = d * v as f32;
        }
    }
    fn scales_finite(_block: &[u8]) -> bool {
        // Every e8m0 byte decodes to a finite power of two in ggml and the gguf package.
        true
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::blocks32::dot_scalar::<Self>(row, xs, out)
    }
}

impl Block32 for Mxfp4 {
    const OFFSET: i32 = 12;
    const AVX2_SIGNED: bool = false;
    fn d(block: &[u8]) -> f32 {
        e8m0_half(block[0])
    }
    fn levels(block: &[u8], q: &mut [i8; 32]) {
        for (i, &b) in block[1..17].iter().enumerate() {
            q[i] = KVALUES_MXFP4[(b & 15) as usize];
            q[i + 16] = KVALUES_MXFP4[(b >> 4) as usize];
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn avx2_levels(p: *const u8) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        unsafe {
            let k = _mm_add_epi8(_mm_loadu_si128(KVALUES_MXFP4.as_ptr() as *const __m128i), _mm_set1_epi8(12));
            _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(k), super::blocks32::x86::nibbles_256(p.add(1)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn avx512_levels2(p0: *const u8, p1: *const u8) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        unsafe {
            let k = _mm_add_epi8(_mm_loadu_si128(KVALUES_MXFP4.as_ptr() as *const __m128i), _mm_set1_epi8(12));
            _mm512_shuffle_epi8(_mm512_broadcast_i32x4(k), super::blocks32::x86::nibbles2_512(p0.add(1), p1.add(1)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn d4(p: *const u8) -> std::arch::x86_64::__m128 {
        let bb = Self::BLOCK_BYTES;
        unsafe {
            std::arch::x86_64::_mm_setr_ps(
                e8m0_half(*p),
                e8m0_half(*p.add(bb)),
                e8m0_half(*p.add(2 * bb)),
                e8m0_half(*p.add(3 * bb)),
            )
        }
    }
}

block32_simd!(Mxfp4);

/// Quantizes a row (`src.len()` a multiple of 32) to MXFP4, bit-exact with `gguf.quants.quantize(.., MXFP4)`:
/// `e = floor(log2(max|x|)) - 2 + 127` (0 for an all-zero block), each value to the nearest doubled level
/// (first of equals).
pub fn quantize_row_mxfp4(src: &[f32], dst: &mut Vec<u8>) {
    for block in src.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = if amax > 0.0 { (amax.log2().floor() - 2.0 + 127.0) as i32 as u8 } else { 0 };
        let d = e8m0_half(e);
        let best = |v: f32| {
            let mut bi = 0usize;
            let mut be = f32::INFINITY;
            for (i, &k) in KVALUES_MXFP4.iter().enumerate() {
                let err = (d * k as f32 - v).abs();
                if err < be {
                    be = err;
                    bi = i;
                }
            }
            bi as u8
        };
        dst.push(e);
        for i in 0..16 {
            dst.push(best(block[i]) | (best(block[i + 16]) << 4));
        }
    }
}
