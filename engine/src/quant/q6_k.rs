//! `Q6_K`: super-blocks of 256 values as 128 bytes of low nibbles `ql`, 64 bytes of 2-bit highs `qh`, 16 signed
//! byte scales and an `f16` `d`; value `i` = `(d * sc_{i/16}) * (u_i - 32)`, `u_i` in 0..64 (ggml
//! `block_q6_K`). With `h = i / 128`, `r = i % 128`: low nibble `r / 64` of `ql[64h + r % 64]`, high bits
//! `2 * (r / 32)` of `qh[32h + r % 32]`.

use super::unpacked::{Unpack256, Unpacked};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `Q6_K` format.
pub struct Q6K;

#[inline(always)]
pub(crate) fn level(block: &[u8], i: usize) -> i32 {
    let (h, r) = (i / 128, i % 128);
    let low = (block[64 * h + r % 64] >> (4 * (r / 64))) & 15;
    let high = (block[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
    (low | (high << 4)) as i32 - 32
}

impl BlockFormat for Q6K {
    const TYPE: GgmlType = GgmlType::Q6_K;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 210;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 208);
        for (j, run) in out.chunks_exact_mut(16).enumerate() {
            let dl = d * (block[192 + j] as i8) as f32;
            for (k, o) in run.iter_mut().enumerate() {
                *o = dl * level(block, 16 * j + k) as f32;
            }
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 208)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::unpacked::dot_scalar::<Self>(row, xs, out)
    }
}

impl Unpack256 for Q6K {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for h in 0..2 {
            let (ql, qh) = (&block[64 * h..64 * h + 64], &block[128 + 32 * h..160 + 32 * h]);
            for l in 0..32 {
                let o = 128 * h + l;
                u.q[o] = ((ql[l] & 15) | ((qh[l] & 3) << 4)) as i8 - 32;
                u.q[o + 32] = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                u.q[o + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                u.q[o + 96] = ((ql[l + 32] >> 4) | ((qh[l] >> 6) << 4)) as i8 - 32;
            }
        }
        for j in 0..16 {
            u.scale[j] = (block[192 + j] as i8) as i16;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        (x.d[sb] * f16_at(block, 208)) * isum as f32
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::simd::x86::hsum_i32_256;
    use super::super::{Acc4, ActRow};

    /// `32 * sum_j sc_j bs_j`: the offset of the unsigned levels `u = q + 32` (exact).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn offset_sum(sc16: __m256i, bs: *const i16) -> i32 {
        32 * hsum_i32_256(_mm256_madd_epi16(_mm256_loadu_si256(bs as *const __m256i), sc16))
    }

    #[inline(always)]
    unsafe fn d_of(blk: *const u8) -> f32 {
        half::f16::from_bits((blk.add(208) as *const u16).read_unaligned()).to_f32()
    }

    /// AVX2: 32 levels `u = q + 32` per vector from the nibbles and 2-bit highs, `maddubs` with the activations,
    /// `madd` with the two run scales of the vector; the offset removed with the activation sums.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let m4 = _mm256_set1_epi8(15);
        let m2 = _mm256_set1_epi8(3);
        let mut acc = [Acc4::default(); 4];
        for sb in 0..row.len() / 210 {
            let blk = row.as_ptr().add(210 * sb);
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i));
            let sc = |r: usize| *blk.add(192 + r) as i8 as i16;
            let mut vacc = [_mm256_setzero_si256(); T];
            for h in 0..2 {
                let ql0 = _mm256_loadu_si256(blk.add(64 * h) as *const __m256i);
                let ql1 = _mm256_loadu_si256(blk.add(64 * h + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(blk.add(128 + 32 * h) as *const __m256i);
                let u = [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4),
                    ),
                ];
                for (k, &uk) in u.iter().enumerate() {
                    let r = 8 * h + 2 * k;
                    let s = _mm256_set_m128i(_mm_set1_epi16(sc(r + 1)), _mm_set1_epi16(sc(r)));
                    for t in 0..T {
                        let xv =
                            _mm256_loadu_si256(xs[t].qs.as_ptr().add(256 * sb + 128 * h + 32 * k) as *const __m256i);
                        vacc[t] = _mm256_add_epi32(vacc[t], _mm256_madd_epi16(_mm256_maddubs_epi16(uk, xv), s));
                    }
                }
            }
            for t in 0..T {
                let isum = hsum_i32_256(vacc[t]) - offset_sum(sc16, xs[t].sums.as_ptr().add(16 * sb));
                acc[t].add(sb, (*xs[t].d.get_unchecked(sb) * d_of(blk)) * isum as f32);
            }
        }
        for t in 0..T {
            out[t] = acc[t].sum();
        }
    }

    /// AVX-512: the 64 low-nibble bytes of a half give its 128 levels in element order (low nibbles values
    /// 0..64, high nibbles 64..128), the highs added from the 32 `qh` bytes; `maddubs` then VNNI `vpdpwssd`
    /// with the run scales.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_avx512<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let m4 = _mm512_set1_epi8(15);
        let m30 = _mm512_set1_epi8(0x30);
        let idx: [__m512i; 4] = std::array::from_fn(|k| {
            let b = 4 * k as i16;
            _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(b + 1), _mm_set1_epi16(b))),
                _mm256_set_m128i(_mm_set1_epi16(b + 3), _mm_set1_epi16(b + 2)),
                1,
            )
        });
        let mut acc = [Acc4::default(); 4];
        for sb in 0..row.len() / 210 {
            let blk = row.as_ptr().add(210 * sb);
            let sc16y = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i));
            let sc16 = _mm512_castsi256_si512(sc16y);
            let mut vacc = [_mm512_setzero_si512(); T];
            for h in 0..2 {
                let ql = _mm512_loadu_si512(blk.add(64 * h) as *const _);
                let qh = _mm256_loadu_si256(blk.add(128 + 32 * h) as *const __m256i);
                // highs of values 0..64 (bits 0-1, 2-3 of qh) and 64..128 (bits 4-5, 6-7), moved to bits 4-5
                let h01 =
                    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_slli_epi16(qh, 4)), _mm256_slli_epi16(qh, 2), 1);
                let h23 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                let u0 = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(h01, m30));
                let u1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), _mm512_and_si512(h23, m30));
                let s0 = _mm512_permutexvar_epi16(idx[2 * h], sc16);
                let s1 = _mm512_permutexvar_epi16(idx[2 * h + 1], sc16);
                for t in 0..T {
                    let xp = xs[t].qs.as_ptr().add(256 * sb + 128 * h);
                    let x0 = _mm512_loadu_si512(xp as *const _);
                    let x1 = _mm512_loadu_si512(xp.add(64) as *const _);
                    vacc[t] = _mm512_dpwssd_epi32(vacc[t], _mm512_maddubs_epi16(u0, x0), s0);
                    vacc[t] = _mm512_dpwssd_epi32(vacc[t], _mm512_maddubs_epi16(u1, x1), s1);
                }
            }
            for t in 0..T {
                let isum = _mm512_reduce_add_epi32(vacc[t]) - offset_sum(sc16y, xs[t].sums.as_ptr().add(16 * sb));
                acc[t].add(sb, (*xs[t].d.get_unchecked(sb) * d_of(blk)) * isum as f32);
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
