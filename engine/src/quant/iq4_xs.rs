//! `IQ4_XS`: super-blocks of 256 values as an `f16` `d`, 6-bit run scales (low nibbles in 4 bytes, high 2-bit
//! parts in a `u16`) and 128 bytes of 4-bit indices into `KVALUES_IQ4NL`; value `i` = `(d * (ls_j - 32)) *
//! kvalues[idx_i]` with `j = i / 32` (ggml `block_iq4_xs`). Run `j`: bytes `16j..16j + 16` of the indices, low
//! nibbles first.

use super::grids::KVALUES_IQ4NL;
use super::unpacked::{Unpack256, Unpacked};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `IQ4_XS` format.
pub struct Iq4Xs;

#[inline(always)]
fn run_scale(block: &[u8], j: usize) -> i32 {
    let sh = u16::from_le_bytes([block[2], block[3]]);
    let l = (block[4 + j / 2] >> (4 * (j % 2))) & 15;
    let h = ((sh >> (2 * j)) & 3) as u8;
    (l | (h << 4)) as i32 - 32
}

#[inline(always)]
fn level(block: &[u8], i: usize) -> i8 {
    let (j, l) = (i / 32, i % 32);
    let b = block[8 + 16 * j + l % 16];
    KVALUES_IQ4NL[((b >> (4 * (l / 16))) & 15) as usize]
}

impl BlockFormat for Iq4Xs {
    const TYPE: GgmlType = GgmlType::IQ4_XS;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 136;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for (j, run) in out.chunks_exact_mut(32).enumerate() {
            let dl = d * run_scale(block, j) as f32;
            for (k, o) in run.iter_mut().enumerate() {
                *o = dl * level(block, 32 * j + k) as f32;
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

impl Unpack256 for Iq4Xs {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for j in 0..8 {
            for l in 0..16 {
                let b = block[8 + 16 * j + l];
                u.q[32 * j + l] = KVALUES_IQ4NL[(b & 15) as usize];
                u.q[32 * j + 16 + l] = KVALUES_IQ4NL[(b >> 4) as usize];
            }
            let s = run_scale(block, j) as i16;
            u.scale[2 * j] = s;
            u.scale[2 * j + 1] = s;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        (x.d[sb] * f16_at(block, 0)) * isum as f32
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::blocks32::x86::nibbles_256;
    use super::super::grids::KVALUES_IQ4NL;
    use super::super::simd::x86::hsum_i32_256;
    use super::super::{Acc4, ActRow};

    /// The eight run scales `ls - 32` of the super-block at `blk`.
    #[inline(always)]
    unsafe fn run_scales(blk: *const u8) -> [i16; 8] {
        let sh = (blk.add(2) as *const u16).read_unaligned();
        std::array::from_fn(|j| {
            let l = (*blk.add(4 + j / 2) >> (4 * (j % 2))) & 15;
            ((l | ((((sh >> (2 * j)) & 3) as u8) << 4)) as i16) - 32
        })
    }

    #[inline(always)]
    unsafe fn d_of(blk: *const u8) -> f32 {
        half::f16::from_bits((blk as *const u16).read_unaligned()).to_f32()
    }

    /// AVX2: one run of 32 per vector (nibbles in element order, levels by table lookup), |level| by
    /// sign(x, level) with `maddubs`, the run scale by `madd`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        let mut acc = [Acc4::default(); 4];
        for sb in 0..row.len() / 136 {
            let blk = row.as_ptr().add(136 * sb);
            let ls = run_scales(blk);
            let mut vacc = [_mm256_setzero_si256(); T];
            for j in 0..8 {
                let q = _mm256_shuffle_epi8(table, nibbles_256(blk.add(8 + 16 * j)));
                let aq = _mm256_sign_epi8(q, q);
                let s = _mm256_set1_epi16(ls[j]);
                for t in 0..T {
                    let xv = _mm256_loadu_si256(xs[t].qs.as_ptr().add(256 * sb + 32 * j) as *const __m256i);
                    let p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(xv, q));
                    vacc[t] = _mm256_add_epi32(vacc[t], _mm256_madd_epi16(p, s));
                }
            }
            for t in 0..T {
                acc[t].add(sb, (*xs[t].d.get_unchecked(sb) * d_of(blk)) * hsum_i32_256(vacc[t]) as f32);
            }
        }
        for t in 0..T {
            out[t] = acc[t].sum();
        }
    }

    /// AVX-512: 64 index bytes (runs 4k..4k+4) per load, rearranged into two vectors of two runs in element
    /// order; |level| and the level signs by two table lookups, the signs moved onto the activations, `maddubs`
    /// then VNNI `vpdpwssd` with the run scales.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_avx512<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let k = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
        let table = _mm512_broadcast_i32x4(k);
        let abs_table = _mm512_broadcast_i32x4(_mm_abs_epi8(k));
        let m4 = _mm512_set1_epi8(15);
        let pick0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
        let pick1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
        let zero = _mm512_setzero_si512();
        let mut acc = [Acc4::default(); 4];
        for sb in 0..row.len() / 136 {
            let blk = row.as_ptr().add(136 * sb);
            let ls = run_scales(blk);
            let mut vacc = [_mm512_setzero_si512(); T];
            for h in 0..2 {
                let v = _mm512_loadu_si512(blk.add(8 + 64 * h) as *const _);
                let lo = _mm512_and_si512(v, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                for (p, pick) in [pick0, pick1].into_iter().enumerate() {
                    let idx = _mm512_permutex2var_epi64(lo, pick, hi);
                    let aq = _mm512_shuffle_epi8(abs_table, idx);
                    let neg = _mm512_movepi8_mask(_mm512_shuffle_epi8(table, idx));
                    let r = 4 * h + 2 * p;
                    let s = _mm512_inserti64x4(_mm512_set1_epi16(ls[r]), _mm256_set1_epi16(ls[r + 1]), 1);
                    for t in 0..T {
                        let xv = _mm512_loadu_si512(xs[t].qs.as_ptr().add(256 * sb + 32 * r) as *const _);
                        let xsg = _mm512_mask_sub_epi8(xv, neg, zero, xv);
                        vacc[t] = _mm512_dpwssd_epi32(vacc[t], _mm512_maddubs_epi16(aq, xsg), s);
                    }
                }
            }
            for t in 0..T {
                acc[t].add(sb, (*xs[t].d.get_unchecked(sb) * d_of(blk)) * _mm512_reduce_add_epi32(vacc[t]) as f32);
            }
        }
        for t in 0..T {
            out[t] = acc[t].sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn dot_avx2(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
    use x86::dot_avx2;
    // SAFETY: listed for Isa::Avx2 only, chosen when the CPU has it.
    unsafe { crate::dispatch_tokens!(dot_avx2, row, xs, out) }
}
#[cfg(target_arch = "x86_64")]
fn dot_avx512(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
    use x86::dot_avx512;
    // SAFETY: as above, for Isa::Avx512.
    unsafe { crate::dispatch_tokens!(dot_avx512, row, xs, out) }
}
/// The SIMD dot paths of this format.
#[cfg(target_arch = "x86_64")]
pub(crate) const SIMD: [(super::Isa, super::DotFn); 2] =
    [(super::Isa::Avx2, dot_avx2), (super::Isa::Avx512, dot_avx512)];
/// No SIMD paths off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) const SIMD: [(super::Isa, super::DotFn); 0] = [];
