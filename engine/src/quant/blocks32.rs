//! The shared dot-product machinery of the 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
//! MXFP4) with [`ActFormat::Q8_32`](super::ActFormat) activations.
//!
//! Per block `b`: `isum = sum_i q_i x_i` over the block's integer levels `q` and the activation's `i8` values
//! `x` (exact); the block term is `(d * dx) * isum` plus, for the formats with a min, `(m * dx) * sum_i x_i`
//! (ggml `ggml_vec_dot_q4_1_q8_1` does the same with the activation sum stored as `d * sum`). Terms accumulate
//! per [`Acc4`]. A format gives its levels three ways: plain (`levels`), as an AVX2 vector, and as an AVX-512
//! vector of two blocks; the SIMD forms may carry a constant offset (`level + OFFSET` as unsigned bytes, for
//! the unsigned-by-signed byte products), removed exactly with the activation sums.

use super::{Acc4, ActRow, BlockFormat};

/// A 32-value block format.
pub(crate) trait Block32: BlockFormat {
    /// The SIMD levels are `level + OFFSET` (unsigned bytes); 0 for formats with unsigned levels.
    const OFFSET: i32;
    /// The AVX2 levels are signed (`level`, no offset) and use the sign trick; else unsigned with `OFFSET`.
    const AVX2_SIGNED: bool;
    /// The format has a min: value = `d * q + m`.
    const HAS_MIN: bool = false;
    /// The block scale `d`.
    fn d(block: &[u8]) -> f32;
    /// The block min `m` (formats with `HAS_MIN`).
    fn m(_block: &[u8]) -> f32 {
        0.0
    }
    /// The 32 integer levels: value `i` = `d * q[i]` (+ `m`).
    fn levels(block: &[u8], q: &mut [i8; 32]);

    /// The 32 levels in element order as AVX2 bytes (signed if `AVX2_SIGNED`, else `level + OFFSET`).
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2_levels(p: *const u8) -> std::arch::x86_64::__m256i;
    /// The levels of two blocks (`p0` then `p1`), element order, as unsigned bytes `level + OFFSET`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx512_levels2(p0: *const u8, p1: *const u8) -> std::arch::x86_64::__m512i;
    /// The scales `d` of the four blocks at `p`, `p + BLOCK_BYTES`, ... (f16 at offset 0 by default).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn d4(p: *const u8) -> std::arch::x86_64::__m128 {
        use super::simd::x86::{f16x4, u16_at};
        let bb = Self::BLOCK_BYTES;
        unsafe { f16x4(u16_at(p), u16_at(p.add(bb)), u16_at(p.add(2 * bb)), u16_at(p.add(3 * bb))) }
    }
    /// The mins of four blocks (f16 at offset 2; formats with `HAS_MIN`).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn m4(p: *const u8) -> std::arch::x86_64::__m128 {
        use super::simd::x86::{f16x4, u16_at};
        let bb = Self::BLOCK_BYTES;
        unsafe { f16x4(u16_at(p.add(2)), u16_at(p.add(bb + 2)), u16_at(p.add(2 * bb + 2)), u16_at(p.add(3 * bb + 2))) }
    }
}

/// The `f32` term of block `b` for token `x` given its exact integer sum.
#[inline(always)]
pub(crate) fn block_term<F: Block32>(blk: &[u8], x: &ActRow<'_>, b: usize, isum: i32) -> f32 {
    let dx = x.d[b];
    let mut f = (F::d(blk) * dx) * isum as f32;
    if F::HAS_MIN {
        f += (F::m(blk) * dx) * x.sums[b] as f32;
    }
    f
}

/// One block's term computed from scratch (levels, exact sum, scales).
#[inline(always)]
fn scalar_block<F: Block32>(blk: &[u8], x: &ActRow<'_>, b: usize, q: &[i8; 32]) -> f32 {
    let xq = &x.qs[b * 32..b * 32 + 32];
    let isum: i32 = q.iter().zip(xq).map(|(&a, &c)| a as i32 * c as i32).sum();
    block_term::<F>(blk, x, b, isum)
}

/// The scalar reference dot of a 32-block format.
pub(crate) fn dot_scalar<F: Block32>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
    let mut acc = [Acc4::default(); 4];
    let mut q = [0i8; 32];
    for (b, blk) in row.chunks_exact(F::BLOCK_BYTES).enumerate() {
        F::levels(blk, &mut q);
        for (t, x) in xs.iter().enumerate() {
            acc[t].add(b, scalar_block::<F>(blk, x, b, &q));
        }
    }
    for (o, a) in out.iter_mut().zip(&acc[..xs.len()]) {
        *o = a.sum();
    }
}

/// Finishes a row: the SIMD lanes are `Acc4` lanes; the blocks past the last group of four run scalar.
#[inline(always)]
fn finish<F: Block32>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32], lanes: &[[f32; 4]; 4], from: usize) {
    let mut q = [0i8; 32];
    let mut acc = [Acc4(lanes[0]), Acc4(lanes[1]), Acc4(lanes[2]), Acc4(lanes[3])];
    for (b, blk) in row.chunks_exact(F::BLOCK_BYTES).enumerate().skip(from) {
        F::levels(blk, &mut q);
        for (t, x) in xs.iter().enumerate() {
            acc[t].add(b, scalar_block::<F>(blk, x, b, &q));
        }
    }
    for (o, a) in out.iter_mut().zip(&acc[..xs.len()]) {
        *o = a.sum();
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::ActRow;
    use super::super::simd::x86::{hsum4_blocks_512, hsum4_i32_256, mul_sum_i8_pairs, mul_sum_u8_i8};
    use super::{Block32, finish};

    /// `(d * dx) * isum (+ (m * dx) * sums)` for four blocks, added to `acc` (same operations as the scalar term).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn combine4<F: Block32>(
        acc: __m128,
        isum: __m128i,
        d: __m128,
        m: __m128,
        x: &ActRow<'_>,
        b: usize,
        sums: __m128i,
    ) -> __m128 {
        let dx = _mm_loadu_ps(x.d.as_ptr().add(b));
        let mut f = _mm_mul_ps(_mm_mul_ps(d, dx), _mm_cvtepi32_ps(isum));
        if F::HAS_MIN {
            f = _mm_add_ps(f, _mm_mul_ps(_mm_mul_ps(m, dx), _mm_cvtepi32_ps(sums)));
        }
        _mm_add_ps(acc, f)
    }

    /// `OFFSET * s` (a shift when the offset is a power of two).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn times_offset<F: Block32>(s: __m128i) -> __m128i {
        match F::OFFSET {
            8 => _mm_slli_epi32(s, 3),
            16 => _mm_slli_epi32(s, 4),
            128 => _mm_slli_epi32(s, 7),
            o => _mm_mullo_epi32(s, _mm_set1_epi32(o)),
        }
    }

    /// The row result from the four accumulator lanes: `(a0 + a1) + (a2 + a3)`, as [`Acc4::sum`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn lanes_sum(a: __m128) -> f32 {
        let pairs = _mm_add_ps(a, _mm_shuffle_ps(a, a, 0b10_11_00_01)); // [a0+a1, ., a2+a3, .]
        _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehl_ps(pairs, pairs)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn sums4(x: &ActRow<'_>, b: usize) -> __m128i {
        _mm_cvtepi16_epi32(_mm_loadl_epi64(x.sums.as_ptr().add(b) as *const __m128i))
    }

    /// AVX2 dot of a 32-block format, `T` tokens sharing each decoded block.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2<F: Block32, const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let bb = F::BLOCK_BYTES;
        let nb = row.len() / bb;
        let nb4 = nb / 4 * 4;
        let p = row.as_ptr();
        let mut acc = [_mm_setzero_ps(); T];
        let mut b = 0;
        while b < nb4 {
            let pb = p.add(b * bb);
            let w0 = F::avx2_levels(pb);
            let w1 = F::avx2_levels(pb.add(bb));
            let w2 = F::avx2_levels(pb.add(2 * bb));
            let w3 = F::avx2_levels(pb.add(3 * bb));
            let d = F::d4(pb);
            let m = if F::HAS_MIN { F::m4(pb) } else { _mm_setzero_ps() };
            for t in 0..T {
                let x = &xs[t];
                let xp = x.qs.as_ptr().add(b * 32) as *const __m256i;
                let (x0, x1, x2, x3) = (
                    _mm256_loadu_si256(xp),
                    _mm256_loadu_si256(xp.add(1)),
                    _mm256_loadu_si256(xp.add(2)),
                    _mm256_loadu_si256(xp.add(3)),
                );
                let s = sums4(x, b);
                let isum = if F::AVX2_SIGNED {
                    hsum4_i32_256(
                        mul_sum_i8_pairs(w0, x0),
                        mul_sum_i8_pairs(w1, x1),
                        mul_sum_i8_pairs(w2, x2),
                        mul_sum_i8_pairs(w3, x3),
                    )
                } else {
                    let raw = hsum4_i32_256(
                        mul_sum_u8_i8(w0, x0),
                        mul_sum_u8_i8(w1, x1),
                        mul_sum_u8_i8(w2, x2),
                        mul_sum_u8_i8(w3, x3),
                    );
                    _mm_sub_epi32(raw, times_offset::<F>(s))
                };
                acc[t] = combine4::<F>(acc[t], isum, d, m, x, b, s);
            }
            b += 4;
        }
        if nb4 == nb {
            for t in 0..T {
                out[t] = lanes_sum(acc[t]);
            }
            return;
        }
        let mut lanes = [[0f32; 4]; 4];
        for t in 0..T {
            _mm_storeu_ps(lanes[t].as_mut_ptr(), acc[t]);
        }
        finish::<F>(row, xs, out, &lanes, nb4);
    }

    /// AVX-512 (VNNI) dot of a 32-block format: two blocks per vector, unsigned levels with `OFFSET`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_avx512<F: Block32, const T: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let bb = F::BLOCK_BYTES;
        let nb = row.len() / bb;
        let nb4 = nb / 4 * 4;
        let p = row.as_ptr();
        let mut acc = [_mm_setzero_ps(); T];
        let mut b = 0;
        while b < nb4 {
            let pb = p.add(b * bb);
            let w01 = F::avx512_levels2(pb, pb.add(bb));
            let w23 = F::avx512_levels2(pb.add(2 * bb), pb.add(3 * bb));
            let d = F::d4(pb);
            let m = if F::HAS_MIN { F::m4(pb) } else { _mm_setzero_ps() };
            for t in 0..T {
                let x = &xs[t];
                let xp = x.qs.as_ptr().add(b * 32);
                let x01 = _mm512_loadu_si512(xp as *const _);
                let x23 = _mm512_loadu_si512(xp.add(64) as *const _);
                let v01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w01, x01);
                let v23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w23, x23);
                let s = sums4(x, b);
                let mut isum = hsum4_blocks_512(v01, v23);
                if F::OFFSET != 0 {
                    isum = _mm_sub_epi32(isum, times_offset::<F>(s));
                }
                acc[t] = combine4::<F>(acc[t], isum, d, m, x, b, s);
            }
            b += 4;
        }
        if nb4 == nb {
            for t in 0..T {
                out[t] = lanes_sum(acc[t]);
            }
            return;
        }
        let mut lanes = [[0f32; 4]; 4];
        for t in 0..T {
            _mm_storeu_ps(lanes[t].as_mut_ptr(), acc[t]);
        }
        finish::<F>(row, xs, out, &lanes, nb4);
    }

    /// Nibbles of two 16-byte groups (`p0`, `p1`) in element order: `[lo(p0), hi(p0), lo(p1), hi(p1)]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub unsafe fn nibbles2_512(p0: *const u8, p1: *const u8) -> __m512i {
        let a = _mm_loadu_si128(p0 as *const __m128i);
        let c = _mm_loadu_si128(p1 as *const __m128i);
        let v = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(a), a, 1), c, 2);
        let v = _mm512_inserti32x4(v, c, 3);
        let hi = _mm512_srli_epi16(v, 4);
        _mm512_and_si512(_mm512_mask_blend_epi64(0b1100_1100, v, hi), _mm512_set1_epi8(0x0F))
    }

    /// Nibbles of one 16-byte group in element order: `[lo, hi]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn nibbles_256(p: *const u8) -> __m256i {
        let q = _mm_loadu_si128(p as *const __m128i);
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F))
    }

    /// Dispatches `T` = `xs.len()` to a const-generic kernel.
    #[macro_export]
    #[doc(hidden)]
    macro_rules! dispatch_tokens {
        ($kernel:ident, $row:expr, $xs:expr, $out:expr) => {
            match $xs.len() {
                1 => $kernel::<1>($row, $xs, $out),
                2 => $kernel::<2>($row, $xs, $out),
                3 => $kernel::<3>($row, $xs, $out),
                4 => $kernel::<4>($row, $xs, $out),
                n => panic!("dot kernels take 1 to 4 tokens, got {n}"),
            }
        };
        ($kernel:ident :: < $f:ty >, $row:expr, $xs:expr, $out:expr) => {
            match $xs.len() {
                1 => $kernel::<$f, 1>($row, $xs, $out),
                2 => $kernel::<$f, 2>($row, $xs, $out),
                3 => $kernel::<$f, 3>($row, $xs, $out),
                4 => $kernel::<$f, 4>($row, $xs, $out),
                n => panic!("dot kernels take 1 to 4 tokens, got {n}"),
            }
        };
    }
}

/// Declares `SIMD` (the format's AVX2 and AVX-512 dots) for a [`Block32`] format type.
macro_rules! block32_simd {
    ($f:ty) => {
        #[cfg(target_arch = "x86_64")]
        fn dot_avx2(row: &[u8], xs: &[$crate::quant::ActRow<'_>], out: &mut [f32]) {
            use $crate::quant::blocks32::x86::dot_avx2;
            // SAFETY: only listed in SIMD for Isa::Avx2, chosen when the CPU has it.
            unsafe { $crate::dispatch_tokens!(dot_avx2::<$f>, row, xs, out) }
        }
        #[cfg(target_arch = "x86_64")]
        fn dot_avx512(row: &[u8], xs: &[$crate::quant::ActRow<'_>], out: &mut [f32]) {
            use $crate::quant::blocks32::x86::dot_avx512;
            // SAFETY: as above, for Isa::Avx512.
            unsafe { $crate::dispatch_tokens!(dot_avx512::<$f>, row, xs, out) }
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
pub(crate) use block32_simd;
