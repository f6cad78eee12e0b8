//! Small x86-64 SIMD helpers shared by the format kernels (horizontal sums, bit-to-byte masks), and the float
//! row kernels of F32/F16/BF16.

use super::{ActRow, reduce16};

/// A plain-float weight element type for [`float_dot_scalar`] and the SIMD float kernels.
pub(crate) trait FloatElem {
    /// Bytes per element.
    const BYTES: usize;
    /// Element `i` of `row`, as `f32` (exact).
    fn get(row: &[u8], i: usize) -> f32;
}

/// Scalar float row dot: element `i` into lane `i % 16`, then [`reduce16`].
pub(crate) fn float_dot_scalar<E: FloatElem>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
    let n = row.len() / E::BYTES;
    for (t, x) in xs.iter().enumerate() {
        let mut acc = [0f32; 16];
        for i in 0..n {
            acc[i % 16] += E::get(row, i) * x.f[i];
        }
        out[t] = reduce16(&acc);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::{ActRow, reduce16};
    use super::FloatElem;

    /// Sum of the 8 `i32` lanes (exact, wrapping like the scalar sum never does in range).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn hsum_i32_256(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// Sums of four 8-lane `i32` vectors: `[sum(a), sum(b), sum(c), sum(d)]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn hsum4_i32_256(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m128i {
        // hadd pairs within 128-bit lanes; two rounds leave each lane's partial sums of a, b, c, d in order.
        let ab = _mm256_hadd_epi32(a, b);
        let cd = _mm256_hadd_epi32(c, d);
        let abcd = _mm256_hadd_epi32(ab, cd);
        _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1))
    }

    /// `sum(x * y)` of signed bytes in groups of 4 (8 `i32` lanes), via |x| and the sign of x moved onto y.
    /// Exact when every product pair fits `i16` (|x|, |y| <= 127, or |x| <= 128 with |y| <= 127).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn mul_sum_i8_pairs(x: __m256i, y: __m256i) -> __m256i {
        let ax = _mm256_sign_epi8(x, x);
        let sy = _mm256_sign_epi8(y, x);
        _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
    }

    /// `sum(u * y)` of unsigned bytes `u` (<= 128) and signed bytes `y`, in groups of 4.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn mul_sum_u8_i8(u: __m256i, y: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1))
    }

    /// 32 bits to 32 bytes: byte `i` is 0xFF when bit `i` of `bits` is set, else 0.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn bits_to_bytes(bits: u32) -> __m256i {
        let shuf = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        );
        let v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
        let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit)
    }

    /// Four little-endian `f16` values to `f32`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn f16x4(a: u16, b: u16, c: u16, d: u16) -> __m128 {
        _mm_cvtph_ps(_mm_setr_epi16(a as i16, b as i16, c as i16, d as i16, 0, 0, 0, 0))
    }

    /// One `f16` (its bits) to `f32`, exactly (F16C).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn f16_to_f32(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// The scales of runs `r` and `r + 1` of 16 values, as `i16` in every lane of the low and the high 128-bit
    /// lane: bytes `r` and `r + 1` of each lane of `scales` (one byte per run, the same 16 bytes in both lanes),
    /// zero-extended by one `pshufb` (Q2_K and Q3_K, whose 32-value steps span two runs).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn run_pair_scales(scales: __m256i, r: usize) -> __m256i {
        // Control bytes (r, 0x80) per i16: byte r, then a zero (pshufb zeroes where the control's top bit is set).
        let (lo, hi) = ((0x8000 | r as u16) as i16, (0x8000 | (r as u16 + 1)) as i16);
        _mm256_shuffle_epi8(scales, _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo)))
    }

    /// Loads the little-endian u16 at `p`.
    #[inline(always)]
    pub unsafe fn u16_at(p: *const u8) -> u16 {
        unsafe { u16::from_le_bytes([*p, *p.add(1)]) }
    }

    /// Sums of the 4 `i32` lanes of each 128-bit quarter of a block pair `v01` (block b: lanes 0..8, block
    /// b + 1: lanes 8..16) and `v23`: `[sum b, sum b+1, sum b+2, sum b+3]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub unsafe fn hsum4_blocks_512(v01: __m512i, v23: __m512i) -> __m128i {
        // [v01.q0, v01.q2, v23.q0, v23.q2] + [v01.q1, v01.q3, v23.q1, v23.q3]: quarter k = block k's 4 lanes.
        let lo = _mm512_shuffle_i64x2(v01, v23, 0b10_00_10_00);
        let hi = _mm512_shuffle_i64x2(v01, v23, 0b11_01_11_01);
        let s = _mm512_add_epi32(lo, hi);
        let s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_BADC));
        let s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_CDAB));
        _mm512_castsi512_si128(_mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
            s,
        ))
    }

    /// Widens 8 elements at `p` to `f32` (AVX2).
    pub trait FloatLoad: FloatElem {
        unsafe fn load8(p: *const u8) -> __m256;
        unsafe fn load16(p: *const u8) -> __m512;
    }

    /// Float row dot, AVX2: two 8-lane accumulators are lanes 0..8 and 8..16 of the scalar semantics.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn float_dot_avx2<E: FloatLoad>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let n = row.len() / E::BYTES;
        let n16 = n / 16 * 16;
        let p = row.as_ptr();
        for (t, x) in xs.iter().enumerate() {
            let xp = x.f.as_ptr();
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i < n16 {
                let w0 = E::load8(p.add(i * E::BYTES));
                let w1 = E::load8(p.add((i + 8) * E::BYTES));
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(w0, _mm256_loadu_ps(xp.add(i))));
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(w1, _mm256_loadu_ps(xp.add(i + 8))));
                i += 16;
            }
            let mut acc = [0f32; 16];
            _mm256_storeu_ps(acc.as_mut_ptr(), a0);
            _mm256_storeu_ps(acc.as_mut_ptr().add(8), a1);
            for j in n16..n {
                acc[j % 16] += E::get(row, j) * x.f[j];
            }
            out[t] = reduce16(&acc);
        }
    }

    /// Float row dot, AVX-512: one 16-lane accumulator.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn float_dot_avx512<E: FloatLoad>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let n = row.len() / E::BYTES;
        let n16 = n / 16 * 16;
        let p = row.as_ptr();
        let nt = xs.len();
        let mut i = 0;
        let mut acc = [_mm512_setzero_ps(); 4];
        // Weights converted once per 16 and reused by every token.
        while i < n16 {
            let w = E::load16(p.add(i * E::BYTES));
            for t in 0..nt {
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(w, _mm512_loadu_ps(xs[t].f.as_ptr().add(i))));
            }
            i += 16;
        }
        for t in 0..nt {
            let mut a = [0f32; 16];
            _mm512_storeu_ps(a.as_mut_ptr(), acc[t]);
            for j in n16..n {
                a[j % 16] += E::get(row, j) * xs[t].f[j];
            }
            out[t] = reduce16(&a);
        }
    }
}

/// Declares `SIMD` (AVX2 and AVX-512 dots) for a plain float format type.
macro_rules! float_simd {
    ($f:ty) => {
        #[cfg(target_arch = "x86_64")]
        fn dot_avx2(row: &[u8], xs: &[$crate::quant::ActRow<'_>], out: &mut [f32]) {
            // SAFETY: only listed for Isa::Avx2, chosen when the CPU has it.
            unsafe { $crate::quant::simd::x86::float_dot_avx2::<$f>(row, xs, out) }
        }
        #[cfg(target_arch = "x86_64")]
        fn dot_avx512(row: &[u8], xs: &[$crate::quant::ActRow<'_>], out: &mut [f32]) {
            // SAFETY: as above, for Isa::Avx512.
            unsafe { $crate::quant::simd::x86::float_dot_avx512::<$f>(row, xs, out) }
        }
        /// The SIMD dot paths of this format.
        #[cfg(target_arch = "x86_64")]
        pub(crate) const SIMD: [(super::Isa, super::DotFn); 2] =
            [(super::Isa::Avx2, dot_avx2), (super::Isa::Avx512, dot_avx512)];
        /// No SIMD paths off x86-64.
        #[cfg(not(target_arch = "x86_64"))]
        pub(crate) const SIMD: [(super::Isa, super::DotFn); 0] = [];
    };
}
pub(crate) use float_simd;
