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

    use super::super::simd::x86::{f16_to_f32, hsum_i32_256, run_pair_scales, u16_at};
    use super::super::{Acc4, ActRow};

    /// The 16 six-bit run scales of a Q3_K super-block (before the `- 32`), byte `j` = run `j`, from the 12
    /// packed bytes at `p`: low nibbles of bytes 0..8 for runs 0..8 and their high nibbles for runs 8..16, each
    /// with two bits of bytes 8..12 on top (byte `8 + j % 4`, bits `2 (j / 4)`), as [`super::scale`] reads them.
    #[inline(always)]
    unsafe fn scales6(p: *const u8) -> __m128i {
        let a = (p as *const u32).read_unaligned();
        let b = (p.add(4) as *const u32).read_unaligned();
        let c = (p.add(8) as *const u32).read_unaligned();
        let (lo4, hi2) = (0x0f0f_0f0fu32, 0x0303_0303u32);
        let w0 = (a & lo4) | (c & hi2) << 4;
        let w1 = (b & lo4) | ((c >> 2) & hi2) << 4;
        let w2 = ((a >> 4) & lo4) | ((c >> 4) & hi2) << 4;
        let w3 = ((b >> 4) & lo4) | ((c >> 6) & hi2) << 4;
        _mm_set_epi32(w3 as i32, w2 as i32, w1 as i32, w0 as i32)
    }

    /// A row dot of Q3_K, AVX2, straight from the blocks (no unpacked copy): per 32 values, the 2-bit lows times
    /// the activations with `maddubs`, minus 4 times the activations whose `hmask` bit is clear (a second
    /// `maddubs` with bytes of 4 or 0), the signed scales of their two runs of 16 (one per 128-bit lane) with
    /// `madd`. The exact integer sums of [`super::super::unpacked::isum_scalar`] and the same `f32` term as
    /// [`super::Q3K`]'s, so the same bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let nsb = row.len() / 110;
        assert!(xs.iter().all(|x| x.qs.len() >= 256 * nsb && x.d.len() >= nsb));
        let (three, one, bias) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1), _mm256_set1_epi16(32));
        let mut acc = [Acc4::default(); 4];
        let xq: [*const i8; T] = std::array::from_fn(|t| xs[t].qs.as_ptr());
        for sb in 0..nsb {
            let blk = row.as_ptr().add(110 * sb);
            let scales = _mm256_broadcastsi128_si256(scales6(blk.add(96)));
            let d = f16_to_f32(u16_at(blk.add(108)));
            let hm = _mm256_loadu_si256(blk as *const __m256i);
            let mut vacc = [_mm256_setzero_si256(); T];
            for h in 0..2 {
                let q = _mm256_loadu_si256(blk.add(32 + 32 * h) as *const __m256i);
                for s in 0..4 {
                    let low = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * s as i32)), three);
                    let hb = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128((4 * h + s) as i32)), one);
                    // 4 where the high bit is clear, else 0 (bytes of 0 or 1: no carries between bytes).
                    let four = _mm256_slli_epi16(_mm256_xor_si256(hb, one), 2);
                    let sc = _mm256_sub_epi16(run_pair_scales(scales, 8 * h + 2 * s), bias);
                    for t in 0..T {
                        let x = _mm256_loadu_si256(xq[t].add(256 * sb + 128 * h + 32 * s) as *const __m256i);
                        let p = _mm256_sub_epi16(_mm256_maddubs_epi16(low, x), _mm256_maddubs_epi16(four, x));
                        vacc[t] = _mm256_add_epi32(vacc[t], _mm256_madd_epi16(p, sc));
                    }
                }
            }
            for t in 0..T {
                acc[t].add(sb, (*xs[t].d.get_unchecked(sb) * d) * hsum_i32_256(vacc[t]) as f32);
            }
        }
        for t in 0..T {
            out[t] = acc[t].sum();
        }
    }
}

super::unpacked::avx2_dot_simd!(x86::dot_avx2);
