//! `IQ1_S` (1.56 bits per weight): super-blocks of 256 values as an `f16` `d`, 32 low index bytes and 8 `u16`
//! (per run of 32: four 3-bit index highs, a 3-bit scale `s` and a delta sign); entry `e` (8 values) uses
//! `IQ1S_GRID[qs[e] | ((qh >> 3 * (e % 4)) & 7) << 8]` (values -1, 0, 1); value = `d * (2s + 1) * (grid +
//! delta)`, `delta = -0.125` when bit 15 is set, else `0.125` (ggml `block_iq1_s`; tables from
//! `gguf.quants.IQ1_S`). The scalar reference folds the delta into integer levels `8 * grid + sign(delta)`; the
//! SIMD dot sums the grid part and the delta part apart (the same exact integer).

use super::grids::IQ1S_GRID;
use super::unpacked::{Unpack256, Unpacked};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `IQ1_S` format.
pub struct Iq1S;

#[inline(always)]
fn qh(block: &[u8], ib: usize) -> u16 {
    u16::from_le_bytes([block[34 + 2 * ib], block[35 + 2 * ib]])
}

#[inline(always)]
fn grid(block: &[u8], ib: usize, l: usize) -> [i8; 8] {
    let h = qh(block, ib);
    let idx = block[2 + 4 * ib + l] as usize | ((((h >> (3 * l)) & 7) as usize) << 8);
    IQ1S_GRID[idx].to_le_bytes().map(|b| b as i8)
}

impl BlockFormat for Iq1S {
    const TYPE: GgmlType = GgmlType::IQ1_S;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 50;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for ib in 0..8 {
            let h = qh(block, ib);
            let dl = d * (2 * ((h >> 12) & 7) + 1) as f32;
            let delta = if h & 0x8000 == 0 { 0.125f32 } else { -0.125 };
            for l in 0..4 {
                for (j, &g) in grid(block, ib, l).iter().enumerate() {
                    out[32 * ib + 8 * l + j] = dl * (g as f32 + delta);
                }
            }
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 0)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::unpacked::dot_scalar::<Self>(row, xs, out)
    }
}

impl Unpack256 for Iq1S {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for ib in 0..8 {
            let h = qh(block, ib);
            let delta: i8 = if h & 0x8000 == 0 { 1 } else { -1 };
            for l in 0..4 {
                for (j, &g) in grid(block, ib, l).iter().enumerate() {
                    u.q[32 * ib + 8 * l + j] = 8 * g + delta;
                }
            }
            let s = 2 * ((h >> 12) & 7) as i16 + 1;
            u.scale[2 * ib] = s;
            u.scale[2 * ib + 1] = s;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        ((x.d[sb] * f16_at(block, 0)) * isum as f32) * 0.125
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::grids::IQ1S_GRID;
    use super::super::simd::x86::{f16_to_f32, hsum_i32_256};
    use super::super::{Acc4, ActRow};

    /// A row dot of IQ1_S, AVX2, with the delta split off: a run's levels are `8 g + delta` (`g` in -1..1 from
    /// the grid, `delta` = ±1 for the whole run of 32), so its sum is `8 sum g x + delta sum x`. The grid part
    /// is `maddubs` of `|g|` with the activations signed by `g`, the run scale applied by `madd`; the delta part
    /// comes from the activations' block sums. `isum = 8 A + B` is the exact sum of
    /// [`super::super::unpacked::isum_scalar`] (Q8_K activations are in -127..127, so the sign trick is exact),
    /// and the `f32` term is [`super::Iq1S`]'s, so the same bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let nsb = row.len() / 50;
        assert!(xs.iter().all(|x| x.qs.len() >= 256 * nsb && x.sums.len() >= 16 * nsb && x.d.len() >= nsb));
        let mut acc = [Acc4::default(); 4];
        let xq: [*const i8; T] = std::array::from_fn(|t| xs[t].qs.as_ptr());
        let xb: [*const i16; T] = std::array::from_fn(|t| xs[t].sums.as_ptr());
        for sb in 0..nsb {
            let blk = &row[50 * sb..50 * sb + 50];
            let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]]));
            // The eight runs' `u16` words: scale 2 s + 1 from bits 12..15, negated where bit 15 (the delta's sign)
            // is set (`psignw` by the word with bit 0 forced on: `psignw` zeroes where its operand is 0, and an
            // all-zero word is a valid run), each twice: the signed scale of each of the 16 block sums.
            let qh = _mm_loadu_si128(blk[34..50].as_ptr() as *const __m128i);
            let one = _mm_set1_epi16(1);
            let scale = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qh, 11), _mm_set1_epi16(14)), one);
            let signed = _mm_sign_epi16(scale, _mm_or_si128(qh, one));
            let per_sum = _mm256_set_m128i(_mm_unpackhi_epi16(signed, signed), _mm_unpacklo_epi16(signed, signed));
            let mut grid_sum = [_mm256_setzero_si256(); T];
            for pair in 0..4 {
                // Grid indices of runs 2 pair and 2 pair + 1 (four entries each), built in one vector: the low
                // bytes widened, each entry's three high bits from its run's word (bits 3 l) moved to bits 8..11.
                let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(blk[2 + 8 * pair..].as_ptr() as *const __m128i));
                let words = _mm256_cvtepu16_epi32(_mm_cvtsi32_si128(u32::from_le_bytes(
                    blk[34 + 4 * pair..38 + 4 * pair].try_into().unwrap(),
                ) as i32));
                let hh = _mm256_permutevar8x32_epi32(words, _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
                let hi = _mm256_and_si256(
                    _mm256_srlv_epi32(hh, _mm256_set_epi32(9, 6, 3, 0, 9, 6, 3, 0)),
                    _mm256_set1_epi32(7),
                );
                let idx = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 8));
                let mut ix = [0u32; 8];
                _mm256_storeu_si256(ix.as_mut_ptr() as *mut __m256i, idx);
                // Every index is below 2048, the grid's length (eleven bits).
                let e = |k: usize| IQ1S_GRID.0[ix[k] as usize & 2047] as i64;
                for half in 0..2 {
                    let ib = 2 * pair + half;
                    let h = u16::from_le_bytes([blk[34 + 2 * ib], blk[35 + 2 * ib]]);
                    let g = _mm256_set_epi64x(e(4 * half + 3), e(4 * half + 2), e(4 * half + 1), e(4 * half));
                    let mag = _mm256_sign_epi8(g, g);
                    let sv = _mm256_set1_epi16((2 * ((h >> 12) & 7) + 1) as i16);
                    for t in 0..T {
                        let x = _mm256_loadu_si256(xq[t].add(256 * sb + 32 * ib) as *const __m256i);
                        let p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, g));
                        grid_sum[t] = _mm256_add_epi32(grid_sum[t], _mm256_madd_epi16(p, sv));
                    }
                }
            }
            for t in 0..T {
                let bs = _mm256_loadu_si256(xb[t].add(16 * sb) as *const __m256i);
                let delta_sum = hsum_i32_256(_mm256_madd_epi16(per_sum, bs));
                let isum = 8 * hsum_i32_256(grid_sum[t]) + delta_sum;
                acc[t].add(sb, ((*xs[t].d.get_unchecked(sb) * d) * isum as f32) * 0.125);
            }
        }
        for t in 0..T {
            out[t] = acc[t].sum();
        }
    }
}

super::unpacked::avx2_dot_simd!(x86::dot_avx2);
