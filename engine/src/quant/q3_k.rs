//! `Q3_K`: super-blocks of 256 values as 32 bytes of high bits `hmask`, 64 bytes of 2-bit low levels, 12 bytes
//! of 6-bit scales and an `f16` `d`; value `i` = `(d * (sc_j - 32)) * q_i` with `q_i = low - 4` when the high
//! bit is clear, `low` when set, and `j = i / 16` (ggml `block_q3_K`). High bit of value `i`: bit `i / 32` of
//! `hmask[i % 32]`. Scale `j`: low nibble of byte `j` (`j < 8`) or high nibble of byte `j - 8`, with bits
//! `2 * (j / 4)` of byte `8 + j % 4` on top.

use super::unpacked::{Unpack256, Unpacked};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `Q3_K` format.
pub struct Q3K;

#[inline(always)]
fn level(block: &[u8], i: usize) -> i32 {
    let low = (block[32 + (i / 128) * 32 + i % 32] >> (2 * ((i % 128) / 32))) & 3;
    let high = (block[i % 32] >> (i / 32)) & 1;
    low as i32 - if high == 0 { 4 } else { 0 }
}

#[inline(always)]
fn scale(block: &[u8], j: usize) -> i32 {
    let s = &block[96..108];
    let l = if j < 8 { s[j] & 15 } else { s[j - 8] >> 4 };
    let h = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    (l | (h << 4)) as i32 - 32
}

impl BlockFormat for Q3K {
    const TYPE: GgmlType = GgmlType::Q3_K;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 110;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 108);
        for (j, run) in out.chunks_exact_mut(16).enumerate() {
            let dl = d * scale(block, j) as f32;
            for (k, o) in run.iter_mut().enumerate() {
                *o = dl * level(block, 16 * j + k) as f32;
            }
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 108)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::unpacked::dot_scalar::<Self>(row, xs, out)
    }
}

impl Unpack256 for Q3K {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for h in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    let low = (block[32 + 32 * h + l] >> (2 * s)) & 3;
                    let high = (block[l] >> (4 * h + s)) & 1;
                    u.q[128 * h + 32 * s + l] = low as i8 - 4 * (1 - high as i8);
                }
            }
        }
        for j in 0..16 {
            u.scale[j] = scale(block, j) as i16;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        (x.d[sb] * f16_at(block, 108)) * isum as f32
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::BlockFormat;
    use super::super::unpacked::Unpacked;
    use super::{Q3K, scale};

    /// [`Unpack256::unpack`](super::Unpack256::unpack) of Q3_K with AVX2: 32 levels per step (the 2-bit lows
    /// of one shift of a 32-byte run, minus 4 where the `hmask` bit is clear), the same levels as the scalar one.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn unpack_avx2(block: &[u8], u: &mut Unpacked) {
        assert!(block.len() >= Q3K::BLOCK_BYTES);
        u.signs_apart = false;
        let three = _mm256_set1_epi8(3);
        let one = _mm256_set1_epi8(1);
        let hm = _mm256_loadu_si256(block.as_ptr() as *const __m256i);
        for h in 0..2 {
            let lows = _mm256_loadu_si256(block.as_ptr().add(32 + 32 * h) as *const __m256i);
            for s in 0..4 {
                let sh = _mm_cvtsi32_si128(2 * s as i32);
                let low = _mm256_and_si256(_mm256_srl_epi16(lows, sh), three);
                let hb = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128((4 * h + s) as i32)), one);
                // low - 4 where the high bit is clear: (1 - hb) * 4 = (hb ^ 1) << 2 (bytes of 0 or 1, no carry).
                let q = _mm256_sub_epi8(low, _mm256_slli_epi16(_mm256_xor_si256(hb, one), 2));
                _mm256_storeu_si256(u.q.as_mut_ptr().add(128 * h + 32 * s) as *mut __m256i, q);
            }
        }
        for j in 0..16 {
            u.scale[j] = scale(block, j) as i16;
        }
    }
}

super::unpacked::avx2_unpack_simd!(Q3K, x86::unpack_avx2, super::unpacked::x86::isum_avx512);
