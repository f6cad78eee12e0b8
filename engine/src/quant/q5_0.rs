//! `Q5_0`: blocks of 32 values as an `f16` scale `d`, 32 high bits `qh` (u32, bit `i` for element `i`) and 16
//! bytes of low nibbles (as Q4_0); value = `d * (u - 16)` with `u` in 0..32 (ggml `block_q5_0`). Quantizer as
//! `gguf.quants.Q5_0.quantize_blocks` (bit-exact): `d = max / -16`, `u = min(31, trunc(x / d + 16.5))`.

use super::blocks32::{Block32, block32_simd};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `Q5_0` format.
pub struct Q5_0;

impl BlockFormat for Q5_0 {
    const TYPE: GgmlType = GgmlType::Q5_0;
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 22;
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

/// The 32 five-bit levels `u` of a block whose `qh` starts at `hi` and nibbles at `lo`.
#[inline(always)]
pub(crate) fn levels5(block: &[u8], hi: usize, lo: usize, q: &mut [i8; 32], offset: i8) {
    let qh = u32::from_le_bytes([block[hi], block[hi + 1], block[hi + 2], block[hi + 3]]);
    for (i, &b) in block[lo..lo + 16].iter().enumerate() {
        q[i] = ((b & 15) | (((qh >> i) & 1) << 4) as u8) as i8 - offset;
        q[i + 16] = ((b >> 4) | (((qh >> (i + 16)) & 1) << 4) as u8) as i8 - offset;
    }
}

impl Block32 for Q5_0 {
    const OFFSET: i32 = 16;
    const AVX2_SIGNED: bool = false;
    fn d(block: &[u8]) -> f32 {
        f16_at(block, 0)
    }
    fn levels(block: &[u8], q: &mut [i8; 32]) {
        levels5(block, 2, 6, q, 16);
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn avx2_levels(p: *const u8) -> std::arch::x86_64::__m256i {
        unsafe { x86::levels5_avx2(p, 2, 6) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn avx512_levels2(p0: *const u8, p1: *const u8) -> std::arch::x86_64::__m512i {
        unsafe { x86::levels5x2_avx512(p0, p1, 2, 6) }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::blocks32::x86::{nibbles_256, nibbles2_512};
    use super::super::simd::x86::bits_to_bytes;

    #[inline(always)]
    unsafe fn qh_at(p: *const u8) -> u32 {
        unsafe { u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]) }
    }

    /// Unsigned 5-bit levels of one block (high bits at `p + hi`, nibbles at `p + lo`).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn levels5_avx2(p: *const u8, hi: usize, lo: usize) -> __m256i {
        let n = nibbles_256(p.add(lo));
        let h = _mm256_and_si256(bits_to_bytes(qh_at(p.add(hi))), _mm256_set1_epi8(16));
        _mm256_or_si256(n, h)
    }

    /// Unsigned 5-bit levels of two blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub unsafe fn levels5x2_avx512(p0: *const u8, p1: *const u8, hi: usize, lo: usize) -> __m512i {
        let n = nibbles2_512(p0.add(lo), p1.add(lo));
        let k = qh_at(p0.add(hi)) as u64 | ((qh_at(p1.add(hi)) as u64) << 32);
        _mm512_mask_add_epi8(n, k, n, _mm512_set1_epi8(16))
    }
}

block32_simd!(Q5_0);

/// Quantizes a row (`src.len()` a multiple of 32) to Q5_0, bit-exact with `gguf.quants.quantize(.., Q5_0)`.
pub fn quantize_row_q5_0(src: &[f32], dst: &mut Vec<u8>) {
    for block in src.chunks_exact(32) {
        let max = super::quantize::signed_absmax(block);
        let d = max / -16.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let q: Vec<u8> = block.iter().map(|&v| ((v * id + 16.5).trunc() as u8).min(31)).collect();
        dst.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        let qh = q.iter().enumerate().fold(0u32, |h, (i, &u)| h | (((u >> 4) as u32) << i));
        dst.extend_from_slice(&qh.to_le_bytes());
        for i in 0..16 {
            dst.push((q[i] & 15) | (q[i + 16] << 4));
        }
    }
}
