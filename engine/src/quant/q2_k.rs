//! `Q2_K`: super-blocks of 256 values as 16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit levels, and
//! `f16` `d` and `dmin`; value `i` = `(d * sc_j) * u_i - dmin * m_j` with `j = i / 16` (ggml `block_q2_K`).
//! Levels: value `i` = bits `2 * ((i % 128) / 32)` of byte `(i / 128) * 32 + i % 32`.

use super::unpacked::{Unpack256, Unpacked};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `Q2_K` format.
pub struct Q2K;

#[inline(always)]
fn level(block: &[u8], i: usize) -> u8 {
    (block[16 + (i / 128) * 32 + i % 32] >> (2 * ((i % 128) / 32))) & 3
}

impl BlockFormat for Q2K {
    const TYPE: GgmlType = GgmlType::Q2_K;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 84;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(block, 80), f16_at(block, 82));
        for (i, o) in out.iter_mut().enumerate() {
            let s = block[i / 16];
            let dl = d * (s & 15) as f32;
            let ml = dmin * (s >> 4) as f32;
            *o = dl * level(block, i) as f32 - ml;
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 80) && f16_finite_at(block, 82)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::unpacked::dot_scalar::<Self>(row, xs, out)
    }
}

impl Unpack256 for Q2K {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for h in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    u.q[128 * h + 32 * s + l] = ((block[16 + 32 * h + l] >> (2 * s)) & 3) as i8;
                }
            }
        }
        for j in 0..16 {
            u.scale[j] = (block[j] & 15) as i16;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        let bs = &x.sums[sb * 16..sb * 16 + 16];
        let msum: i32 = (0..16).map(|j| (block[j] >> 4) as i32 * bs[j] as i32).sum();
        let dx = x.d[sb];
        (dx * f16_at(block, 80)) * isum as f32 - (dx * f16_at(block, 82)) * msum as f32
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::BlockFormat;
    use super::super::unpacked::Unpacked;
    use super::Q2K;

    /// [`Unpack256::unpack`](super::Unpack256::unpack) of Q2_K with AVX2: 32 two-bit levels per step, the same
    /// levels and scales as the scalar one.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn unpack_avx2(block: &[u8], u: &mut Unpacked) {
        assert!(block.len() >= Q2K::BLOCK_BYTES);
        u.signs_apart = false;
        let three = _mm256_set1_epi8(3);
        for h in 0..2 {
            let lows = _mm256_loadu_si256(block.as_ptr().add(16 + 32 * h) as *const __m256i);
            for s in 0..4 {
                let q = _mm256_and_si256(_mm256_srl_epi16(lows, _mm_cvtsi32_si128(2 * s as i32)), three);
                _mm256_storeu_si256(u.q.as_mut_ptr().add(128 * h + 32 * s) as *mut __m256i, q);
            }
        }
        for j in 0..16 {
            u.scale[j] = (block[j] & 15) as i16;
        }
    }
}

// The AVX2 products on AVX-512 machines too: the AVX-512 ones measured slower for Q2_K (3.5 against 5.3 GB/s on
// the development VM).
super::unpacked::avx2_unpack_simd!(Q2K, x86::unpack_avx2, super::unpacked::x86::isum_avx2);
