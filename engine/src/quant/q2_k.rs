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

    use super::super::q4_k::x86::d_dmin;
    use super::super::simd::x86::{hsum_i32_256, run_pair_scales};
    use super::super::{Acc4, ActRow};

    /// A row dot of Q2_K, AVX2, straight from the blocks (no unpacked copy): per 32 values, bits `2s` of 32
    /// level bytes (levels 0..3, unsigned) times the activations with `maddubs`, the scales of their two runs of
    /// 16 (one per 128-bit lane) with `madd`; the mins' term as one `madd` of the 16 mins with the activations'
    /// 16 block sums. The exact integer sums of [`super::super::unpacked::isum_scalar`] and the same `f32` term
    /// as [`super::Q2K`]'s, so the same bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let nsb = row.len() / 84;
        assert!(xs.iter().all(|x| x.qs.len() >= 256 * nsb && x.sums.len() >= 16 * nsb && x.d.len() >= nsb));
        let (three, nib) = (_mm256_set1_epi8(3), _mm_set1_epi8(15));
        let mut acc = [Acc4::default(); 4];
        let xq: [*const i8; T] = std::array::from_fn(|t| xs[t].qs.as_ptr());
        let xb: [*const i16; T] = std::array::from_fn(|t| xs[t].sums.as_ptr());
        for sb in 0..nsb {
            let blk = row.as_ptr().add(84 * sb);
            let packed = _mm_loadu_si128(blk as *const __m128i);
            // The 16 run scales as bytes in both lanes, and the 16 mins as i16.
            let scales = _mm256_broadcastsi128_si256(_mm_and_si128(packed, nib));
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), nib));
            let (d, dmin) = d_dmin(blk.add(80));
            let mut vacc = [_mm256_setzero_si256(); T];
            for h in 0..2 {
                let q = _mm256_loadu_si256(blk.add(16 + 32 * h) as *const __m256i);
                for s in 0..4 {
                    let lv = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * s as i32)), three);
                    let sc = run_pair_scales(scales, 8 * h + 2 * s);
                    for t in 0..T {
                        let x = _mm256_loadu_si256(xq[t].add(256 * sb + 128 * h + 32 * s) as *const __m256i);
                        vacc[t] = _mm256_add_epi32(vacc[t], _mm256_madd_epi16(_mm256_maddubs_epi16(lv, x), sc));
                    }
                }
            }
            for t in 0..T {
                let bs = _mm256_loadu_si256(xb[t].add(16 * sb) as *const __m256i);
                let msum = hsum_i32_256(_mm256_madd_epi16(mins, bs));
                let dx = *xs[t].d.get_unchecked(sb);
                acc[t].add(sb, (dx * d) * hsum_i32_256(vacc[t]) as f32 - (dx * dmin) * msum as f32);
            }
        }
        for t in 0..T {
            out[t] = acc[t].sum();
        }
    }
}

super::unpacked::avx2_dot_simd!(x86::dot_avx2);
