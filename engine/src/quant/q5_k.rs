//! `Q5_K`: super-blocks of 256 values as `f16` `d` and `dmin`, 12 bytes of 6-bit scales and mins (packed as in
//! Q4_K), 32 bytes of high bits and 128 bytes of low nibbles; value `i` = `(d * sc_j) * u_i - dmin * m_j` with
//! `j = i / 32` and `u_i` in 0..32 (ggml `block_q5_K`). Run `j = 2c + s` takes nibble `s` of bytes
//! `32c..32c + 32` and bit `j` of the 32 high-bit bytes.

use super::q4_k::scale_min;
use super::unpacked::{Unpack256, Unpacked};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `Q5_K` format.
pub struct Q5K;

#[inline(always)]
fn level(block: &[u8], i: usize) -> u8 {
    let (j, l) = (i / 32, i % 32);
    let low = (block[48 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
    let high = (block[16 + l] >> j) & 1;
    low | (high << 4)
}

impl BlockFormat for Q5K {
    const TYPE: GgmlType = GgmlType::Q5_K;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 176;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
        for (j, run) in out.chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min(&block[4..16], j);
            let (dl, ml) = (d * sc as f32, dmin * m as f32);
            for (k, o) in run.iter_mut().enumerate() {
                *o = dl * level(block, 32 * j + k) as f32 - ml;
            }
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 0) && f16_finite_at(block, 2)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::unpacked::dot_scalar::<Self>(row, xs, out)
    }
}

impl Unpack256 for Q5K {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for j in 0..8 {
            for l in 0..32 {
                let low = (block[48 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
                let high = (block[16 + l] >> j) & 1;
                u.q[32 * j + l] = (low | (high << 4)) as i8;
            }
            let sc = scale_min(&block[4..16], j).0 as i16;
            u.scale[2 * j] = sc;
            u.scale[2 * j + 1] = sc;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        let bs = &x.sums[sb * 16..sb * 16 + 16];
        let msum: i32 =
            (0..8).map(|j| scale_min(&block[4..16], j).1 as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32)).sum();
        let dx = x.d[sb];
        (dx * f16_at(block, 0)) * isum as f32 - (dx * f16_at(block, 2)) * msum as f32
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::q4_k::x86::{d_dmin, min_sum_avx2, scales_mins_u64};
    use super::super::simd::x86::hsum_i32_256;
    use super::super::{Acc4, ActRow};

    /// A row dot of Q5_K, AVX2, straight from the blocks (no unpacked copy): per 32 bytes of low nibbles, runs
    /// `2c` and `2c + 1` with their high bits (bits `2c`, `2c + 1` of the 32 high-bit bytes) moved to bit 4, times
    /// the activations with `maddubs` (levels 0..31 unsigned), the run scale with `madd`; the mins' term from the
    /// activations' block sums (`min_sum_avx2`, as Q4_K). The exact integer sums of
    /// [`super::super::unpacked::isum_scalar`] and the same `f32` term as [`super::Q5K`]'s, so the same bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let nsb = row.len() / 176;
        assert!(xs.iter().all(|x| x.qs.len() >= 256 * nsb && x.sums.len() >= 16 * nsb && x.d.len() >= nsb));
        let (mask, sixteen) = (_mm256_set1_epi8(15), _mm256_set1_epi8(16));
        let mut acc = [Acc4::default(); 4];
        let xq: [*const i8; T] = std::array::from_fn(|t| xs[t].qs.as_ptr());
        let xb: [*const i16; T] = std::array::from_fn(|t| xs[t].sums.as_ptr());
        for sb in 0..nsb {
            let blk = row.as_ptr().add(176 * sb);
            let (sc, m) = scales_mins_u64(blk.add(4));
            let (d, dmin) = d_dmin(blk);
            let qh = _mm256_loadu_si256(blk.add(16) as *const __m256i);
            let mut vacc = [_mm256_setzero_si256(); T];
            for c in 0..4 {
                let q = _mm256_loadu_si256(blk.add(48 + 32 * c) as *const __m256i);
                // Bit j of each high-bit byte, moved to bit 4: shift right by j - 4 (left by 4 - j), keep 16.
                let high = |j: i32| {
                    let moved = if j >= 4 {
                        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j - 4))
                    } else {
                        _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - j))
                    };
                    _mm256_and_si256(moved, sixteen)
                };
                let lo = _mm256_or_si256(_mm256_and_si256(q, mask), high(2 * c as i32));
                let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), mask), high(2 * c as i32 + 1));
                let s_lo = _mm256_set1_epi16(((sc >> (16 * c)) & 0xff) as i16);
                let s_hi = _mm256_set1_epi16(((sc >> (16 * c + 8)) & 0xff) as i16);
                for t in 0..T {
                    let xp = xq[t].add(256 * sb + 64 * c) as *const __m256i;
                    let a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(xp)), s_lo);
                    let b = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256(xp.add(1))), s_hi);
                    vacc[t] = _mm256_add_epi32(vacc[t], _mm256_add_epi32(a, b));
                }
            }
            for t in 0..T {
                let msum = min_sum_avx2(m, xb[t].add(16 * sb));
                let dx = *xs[t].d.get_unchecked(sb);
                acc[t].add(sb, (dx * d) * hsum_i32_256(vacc[t]) as f32 - (dx * dmin) * msum as f32);
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
    // SAFETY: listed for Isa::Avx2 and Isa::Avx512 (which includes AVX2), chosen when the CPU has it.
    unsafe { crate::dispatch_tokens!(dot_avx2, row, xs, out) }
}
/// The SIMD dot paths of this format (the AVX2 one on AVX-512 machines too).
#[cfg(target_arch = "x86_64")]
pub(crate) const SIMD: [(super::Isa, super::DotFn); 2] = [(super::Isa::Avx2, dot_avx2), (super::Isa::Avx512, dot_avx2)];
/// No SIMD paths off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) const SIMD: [(super::Isa, super::DotFn); 0] = [];
