//! `Q4_K`: super-blocks of 256 values as `f16` `d` and `dmin`, 12 bytes of eight 6-bit scales and eight 6-bit
//! mins, and 128 bytes of 4-bit levels; value `i` = `(d * sc_j) * u_i - dmin * m_j` with `j = i / 32` (ggml
//! `block_q4_K`). Run `j = 2c + s` is nibble `s` of bytes `32c..32c + 32`. Scales and mins: for `j < 4` the
//! low 6 bits of bytes `j` and `j + 4`; for `j >= 4` the nibbles of byte `j + 4` with the top 2 bits of bytes
//! `j - 4` and `j` (`gguf.quants.Q4_K.get_scale_min`).
//!
//! Dot product (with Q8_K activations `x`, scale `dx`, sums of 16 `bs`): `isum = sum_j sc_j sum_i u_i x_i`,
//! `msum = sum_j m_j (bs_2j + bs_2j+1)`, term = `(dx * d) * isum - (dx * dmin) * msum` (ggml
//! `ggml_vec_dot_q4_K_q8_K`).

use super::{Acc4, ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `Q4_K` format.
pub struct Q4K;

/// Scale and min of run `j` from the 12 packed bytes `s`.
#[inline(always)]
pub(crate) fn scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// All eight scales and mins.
#[inline(always)]
pub(crate) fn scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        (sc[j], m[j]) = scale_min(s, j);
    }
    (sc, m)
}

/// `sum_j m_j (bs_2j + bs_2j+1)` for one super-block.
#[inline(always)]
pub(crate) fn min_sum(m: &[u8; 8], bs: &[i16]) -> i32 {
    (0..8).map(|j| m[j] as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32)).sum()
}

/// The super-block term from the exact sums.
#[inline(always)]
fn term(blk: &[u8], x: &ActRow<'_>, sb: usize, isum: i32, msum: i32) -> f32 {
    let dx = x.d[sb];
    (dx * f16_at(blk, 0)) * isum as f32 - (dx * f16_at(blk, 2)) * msum as f32
}

impl BlockFormat for Q4K {
    const TYPE: GgmlType = GgmlType::Q4_K;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 144;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
        for (j, run) in out.chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min(&block[4..16], j);
            let (dl, ml) = (d * sc as f32, dmin * m as f32);
            for (l, o) in run.iter_mut().enumerate() {
                let u = (block[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
                *o = dl * u as f32 - ml;
            }
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 0) && f16_finite_at(block, 2)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let mut acc = [Acc4::default(); 4];
        for (sb, blk) in row.chunks_exact(144).enumerate() {
            let (sc, m) = scales_mins(&blk[4..16]);
            for (t, x) in xs.iter().enumerate() {
                let xq = &x.qs[256 * sb..256 * sb + 256];
                let mut isum = 0i32;
                for j in 0..8 {
                    let mut s = 0i32;
                    for l in 0..32 {
                        let u = (blk[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
                        s += u as i32 * xq[32 * j + l] as i32;
                    }
                    isum += sc[j] as i32 * s;
                }
                let msum = min_sum(&m, &x.sums[16 * sb..16 * sb + 16]);
                acc[t].add(sb, term(blk, x, sb, isum, msum));
            }
        }
        for (o, a) in out.iter_mut().zip(&acc[..xs.len()]) {
            *o = a.sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::simd::x86::hsum_i32_256;
    use super::super::{Acc4, ActRow};

    /// The eight 6-bit scales and mins of a super-block as two u64 (byte j = run j), from the 12 packed bytes
    /// at `p`: runs 0..4 are the low 6 bits of words 0 and 1, runs 4..8 the nibbles of word 2 with the top two
    /// bits of words 0 and 1 (the layout of `scale_min`).
    #[inline(always)]
    pub unsafe fn scales_mins_u64(p: *const u8) -> (u64, u64) {
        let a = (p as *const u32).read_unaligned();
        let b = (p.add(4) as *const u32).read_unaligned();
        let c = (p.add(8) as *const u32).read_unaligned();
        let sc_lo = a & 0x3f3f_3f3f;
        let m_lo = b & 0x3f3f_3f3f;
        let sc_hi = (c & 0x0f0f_0f0f) | ((a >> 2) & 0x3030_3030);
        let m_hi = ((c >> 4) & 0x0f0f_0f0f) | ((b >> 2) & 0x3030_3030);
        (sc_lo as u64 | (sc_hi as u64) << 32, m_lo as u64 | (m_hi as u64) << 32)
    }

    /// `sum_j m_j (bs_2j + bs_2j+1)` with the 16 sums of 16 at `bs` (exact).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn min_sum_avx2(m: u64, bs: *const i16) -> i32 {
        let m8 = _mm_cvtsi64_si128(m as i64);
        let mm = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        hsum_i32_256(_mm256_madd_epi16(_mm256_loadu_si256(bs as *const __m256i), mm))
    }

    /// `[d, dmin]` of the super-block at `p` (F16C).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn d_dmin(p: *const u8) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1)))
    }

    /// The term of one super-block (same `f32` operations as the scalar path).
    #[inline(always)]
    fn term(d: f32, dmin: f32, dx: f32, isum: i32, msum: i32) -> f32 {
        (dx * d) * isum as f32 - (dx * dmin) * msum as f32
    }

    /// AVX2: per 32 bytes, the low and high nibbles (runs 2c and 2c+1) times the activations with `maddubs`, the
    /// run scale applied by `madd`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        dot45_avx2::<false, T>(row, xs, out)
    }

    /// Q5_K's AVX2 dot: [`dot_avx2`] on Q5_K's blocks (176 bytes: the 12 scale bytes as Q4_K's, then 32 high-bit
    /// bytes, then the nibbles), with bit `j` of the high-bit bytes moved to bit 4 of run `j`'s levels (0..31,
    /// still unsigned for `maddubs`). The same `f32` term as Q5_K's scalar path.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5k_avx2<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        dot45_avx2::<true, T>(row, xs, out)
    }

    /// The AVX2 dot of Q4_K (`HIGH` false) and Q5_K (`HIGH` true), whose blocks differ only by Q5_K's high bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot45_avx2<const HIGH: bool, const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let (block_bytes, nibbles_at) = if HIGH { (176, 48) } else { (144, 16) };
        let nsb = row.len() / block_bytes;
        assert!(xs.iter().all(|x| x.qs.len() >= 256 * nsb && x.sums.len() >= 16 * nsb && x.d.len() >= nsb));
        let (mask, sixteen) = (_mm256_set1_epi8(15), _mm256_set1_epi8(16));
        let mut acc = [Acc4::default(); 4];
        let xq: [*const i8; T] = std::array::from_fn(|t| xs[t].qs.as_ptr());
        let xb: [*const i16; T] = std::array::from_fn(|t| xs[t].sums.as_ptr());
        for sb in 0..nsb {
            let blk = row.as_ptr().add(block_bytes * sb);
            let (sc, m) = scales_mins_u64(blk.add(4));
            let (d, dmin) = d_dmin(blk);
            let qh = if HIGH { _mm256_loadu_si256(blk.add(16) as *const __m256i) } else { _mm256_setzero_si256() };
            // Bit j of each high-bit byte, moved to bit 4: shift right by j - 4 (left by 4 - j), keep 16.
            let high = |j: i32| {
                let moved = if j >= 4 {
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j - 4))
                } else {
                    _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - j))
                };
                _mm256_and_si256(moved, sixteen)
            };
            let mut vacc = [_mm256_setzero_si256(); T];
            for c in 0..4 {
                let q = _mm256_loadu_si256(blk.add(nibbles_at + 32 * c) as *const __m256i);
                let mut lo = _mm256_and_si256(q, mask);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                if HIGH {
                    lo = _mm256_or_si256(lo, high(2 * c as i32));
                    hi = _mm256_or_si256(hi, high(2 * c as i32 + 1));
                }
                // run scales 2c and 2c+1 broadcast to all 16 lanes
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
                acc[t].add(sb, term(d, dmin, *xs[t].d.get_unchecked(sb), hsum_i32_256(vacc[t]), msum));
            }
        }
        for t in 0..T {
            out[t] = acc[t].sum();
        }
    }

    /// AVX-512: 64 bytes of levels (runs 2c..2c+4) per load, rearranged into runs (2c, 2c+1) and (2c+2, 2c+3)
    /// in element order; `maddubs` then VNNI `vpdpwssd` with the run scales.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_avx512<const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let mask = _mm512_set1_epi8(15);
        // index vectors selecting run scales (2k, 2k+1) into the two 256-bit halves
        let idx: [__m512i; 4] = std::array::from_fn(|k| {
            _mm512_inserti64x4(_mm512_set1_epi16(2 * k as i16), _mm256_set1_epi16(2 * k as i16 + 1), 1)
        });
        let nsb = row.len() / 144;
        let mut acc = [Acc4::default(); 4];
        let xq: [*const i8; T] = std::array::from_fn(|t| xs[t].qs.as_ptr());
        let xb: [*const i16; T] = std::array::from_fn(|t| xs[t].sums.as_ptr());
        for sb in 0..nsb {
            let blk = row.as_ptr().add(144 * sb);
            let (sc, m) = scales_mins_u64(blk.add(4));
            let (d, dmin) = d_dmin(blk);
            let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let mut vacc = [_mm512_setzero_si512(); T];
            for h in 0..2 {
                let v = _mm512_loadu_si512(blk.add(16 + 64 * h) as *const _);
                let lo = _mm512_and_si512(v, mask);
                let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                let w0 = _mm512_shuffle_i64x2(lo, hi, 0b01_00_01_00);
                let w1 = _mm512_shuffle_i64x2(lo, hi, 0b11_10_11_10);
                let s0 = _mm512_permutexvar_epi16(idx[2 * h], sc16);
                let s1 = _mm512_permutexvar_epi16(idx[2 * h + 1], sc16);
                for t in 0..T {
                    let xp = xq[t].add(256 * sb + 128 * h);
                    let x0 = _mm512_loadu_si512(xp as *const _);
                    let x1 = _mm512_loadu_si512(xp.add(64) as *const _);
                    vacc[t] = _mm512_dpwssd_epi32(vacc[t], _mm512_maddubs_epi16(w0, x0), s0);
                    vacc[t] = _mm512_dpwssd_epi32(vacc[t], _mm512_maddubs_epi16(w1, x1), s1);
                }
            }
            for t in 0..T {
                let msum = min_sum_avx2(m, xb[t].add(16 * sb));
                acc[t].add(sb, term(d, dmin, *xs[t].d.get_unchecked(sb), _mm512_reduce_add_epi32(vacc[t]), msum));
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
