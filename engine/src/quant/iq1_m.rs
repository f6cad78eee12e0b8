//! `IQ1_M` (1.75 bits per weight): super-blocks of 256 values as 32 low index bytes, 16 bytes of 4-bit
//! index-high + delta-sign nibbles (one per 8 values) and four `u16` holding sixteen 3-bit scales (one per 16
//! values, bits `3k`) with the super-block's `f16` `d` spread over their top nibbles; entry `e` uses
//! `IQ1S_GRID[qs[e] | (nib & 7) << 8]`, `delta = -0.125` when `nib & 8`, else `0.125`; value =
//! `d * (2s + 1) * (grid + delta)` (ggml `block_iq1_m`; tables from `gguf.quants.IQ1_M`).

use super::grids::IQ1S_GRID;
use super::unpacked::{Unpack256, Unpacked};
use super::{ActFormat, ActRow, BlockFormat};
use crate::gguf::GgmlType;

/// The `IQ1_M` format.
pub struct Iq1M;

#[inline(always)]
fn sc(block: &[u8], k: usize) -> u16 {
    u16::from_le_bytes([block[48 + 2 * k], block[49 + 2 * k]])
}

/// The super-block scale's `f16` bits.
#[inline(always)]
fn d_bits(block: &[u8]) -> u16 {
    (sc(block, 0) >> 12) | ((sc(block, 1) >> 8) & 0x00f0) | ((sc(block, 2) >> 4) & 0x0f00) | (sc(block, 3) & 0xf000)
}

#[inline(always)]
fn scale16(block: &[u8], j: usize) -> u16 {
    (sc(block, j / 4) >> (3 * (j % 4))) & 7
}

/// Entry `e`'s 8 grid values and whether its delta is negative.
#[inline(always)]
fn entry(block: &[u8], e: usize) -> ([i8; 8], bool) {
    let nib = (block[32 + e / 2] >> (4 * (e % 2))) & 15;
    let idx = block[e] as usize | (((nib & 7) as usize) << 8);
    (IQ1S_GRID[idx].to_le_bytes().map(|b| b as i8), nib & 8 != 0)
}

impl BlockFormat for Iq1M {
    const TYPE: GgmlType = GgmlType::IQ1_M;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 56;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = half::f16::from_bits(d_bits(block)).to_f32();
        for e in 0..32 {
            let dl = d * (2 * scale16(block, e / 2) + 1) as f32;
            let (g, neg) = entry(block, e);
            let delta = if neg { -0.125f32 } else { 0.125 };
            for (j, &v) in g.iter().enumerate() {
                out[8 * e + j] = dl * (v as f32 + delta);
            }
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        d_bits(block) & 0x7c00 != 0x7c00
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::unpacked::dot_scalar::<Self>(row, xs, out)
    }
}

impl Unpack256 for Iq1M {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for e in 0..32 {
            let (g, neg) = entry(block, e);
            let delta: i8 = if neg { -1 } else { 1 };
            for (j, &v) in g.iter().enumerate() {
                u.q[8 * e + j] = 8 * v + delta;
            }
        }
        for j in 0..16 {
            u.scale[j] = 2 * scale16(block, j) as i16 + 1;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        let d = half::f16::from_bits(d_bits(block)).to_f32();
        ((x.d[sb] * d) * isum as f32) * 0.125
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::grids::IQ1S_GRID;
    use super::super::simd::x86::{f16_to_f32, hsum_i32_256};
    use super::super::{Acc4, ActRow};
    use super::{d_bits, sc};

    /// A row dot of IQ1_M, AVX2, straight from the blocks: per run of 32, the four entries' grid words (bytes -1..1)
    /// and their deltas (±1 per 8 values, from bit 3 of each entry's nibble, expanded with one compare), the levels
    /// `8 g + delta` by byte doublings (no carries), `maddubs` of `|q|` with the activations signed by `q`, and the
    /// scales of the run's two halves of 16 with `madd`. The levels, exact integer sums and `f32` term of the
    /// scalar path ([`super::Iq1M`]), so the same bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let nsb = row.len() / 56;
        assert!(xs.iter().all(|x| x.qs.len() >= 256 * nsb && x.d.len() >= nsb));
        let mut acc = [Acc4::default(); 4];
        let xq: [*const i8; T] = std::array::from_fn(|t| xs[t].qs.as_ptr());
        // Qword l of a run holds entry l: its delta is negative when bit 4 l + 3 of the run's two nibble bytes is set.
        let delta_bit = _mm256_set_epi64x(
            0x8000_8000_8000_8000u64 as i64,
            0x0800_0800_0800_0800,
            0x0080_0080_0080_0080,
            0x0008_0008_0008_0008,
        );
        let one = _mm256_set1_epi8(1);
        for sb in 0..nsb {
            let blk = &row[56 * sb..56 * sb + 56];
            let d = f16_to_f32(d_bits(blk));
            let mut vacc = [_mm256_setzero_si256(); T];
            for ib in 0..8 {
                let nib = u16::from_le_bytes([blk[32 + 2 * ib], blk[33 + 2 * ib]]) as usize;
                let e = |l: usize| IQ1S_GRID.0[blk[4 * ib + l] as usize | ((nib >> (4 * l)) & 7) << 8] as i64;
                let g = _mm256_set_epi64x(e(3), e(2), e(1), e(0));
                let set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(nib as i16), delta_bit), delta_bit);
                let delta = _mm256_or_si256(set, one);
                let g2 = _mm256_add_epi8(g, g);
                let g4 = _mm256_add_epi8(g2, g2);
                let q = _mm256_add_epi8(_mm256_add_epi8(g4, g4), delta);
                let mag = _mm256_sign_epi8(q, q);
                let w = sc(blk, ib / 2) as i32;
                let s = |half: usize| (2 * ((w >> (3 * (2 * (ib % 2) + half))) & 7) + 1) as i16;
                let sv = _mm256_set_m128i(_mm_set1_epi16(s(1)), _mm_set1_epi16(s(0)));
                for t in 0..T {
                    let x = _mm256_loadu_si256(xq[t].add(256 * sb + 32 * ib) as *const __m256i);
                    let p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, q));
                    vacc[t] = _mm256_add_epi32(vacc[t], _mm256_madd_epi16(p, sv));
                }
            }
            for t in 0..T {
                acc[t].add(sb, ((*xs[t].d.get_unchecked(sb) * d) * hsum_i32_256(vacc[t]) as f32) * 0.125);
            }
        }
        for t in 0..T {
            out[t] = acc[t].sum();
        }
    }
}

super::unpacked::avx2_dot_simd!(x86::dot_avx2);
