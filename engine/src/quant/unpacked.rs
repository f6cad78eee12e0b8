//! The shared dot-product machinery of the 256-value super-block formats whose levels are decoded per
//! super-block before the products (Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS and the grid i-quants), with
//! [`ActFormat::Q8K`](super::ActFormat) activations.
//!
//! A format unpacks a super-block into signed integer levels `q[256]` (|q| <= 127), or for the grid i-quants
//! magnitudes and sign bits, and one integer scale per run of 16 values; the scalar reference computes
//! `isum = sum_j scale_j * sum_{i in run j} q_i x_i` exactly and the format turns `isum` into the super-block's
//! `f32` term. The SIMD paths read the blocks straight into registers, with no unpacked copy, and compute the
//! same exact sums (the products ggml forms with `maddubs`/`madd`): the grid i-quants' here ([`Grid32`]), the
//! others' in their own files (Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS, IQ1_S, IQ1_M).

use super::grids::CacheAligned;
use super::{Acc4, ActRow, BlockFormat};

/// One unpacked super-block, in one of two forms: signed levels `q` (most formats), or magnitudes `mag` with
/// sign bits `neg` (the grid i-quants, whose tables hold magnitudes and whose signs come as bit patterns).
#[derive(Clone)]
pub(crate) struct Unpacked {
    /// Signed levels, |q| <= 127 (when `signs_apart` is false).
    pub q: [i8; 256],
    /// Magnitudes, 1..=127 (when `signs_apart` is true).
    pub mag: [u8; 256],
    /// Sign bits: bit `i % 8` of byte `i / 8` set when value `i` is negative (when `signs_apart`).
    pub neg: [u8; 32],
    /// Which form holds the levels.
    pub signs_apart: bool,
    /// Integer scale of each run of 16 values.
    pub scale: [i16; 16],
}

impl Default for Unpacked {
    fn default() -> Self {
        Self { q: [0; 256], mag: [0; 256], neg: [0; 32], signs_apart: false, scale: [0; 16] }
    }
}

impl Unpacked {
    /// The signed level at position `i`, whichever the form.
    #[inline(always)]
    pub fn level(&self, i: usize) -> i32 {
        if self.signs_apart {
            let m = self.mag[i] as i32;
            if self.neg[i / 8] >> (i % 8) & 1 != 0 { -m } else { m }
        } else {
            self.q[i] as i32
        }
    }
}

/// A super-block format decoded through [`Unpacked`].
pub(crate) trait Unpack256: BlockFormat {
    /// Decodes the super-block's levels and integer scales.
    fn unpack(block: &[u8], u: &mut Unpacked);
    /// The `f32` term of super-block `sb` for token `x`, given its exact integer sum.
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32;
}

/// A grid i-quant (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S; IQ1_S and IQ1_M have their own dots) that the
/// direct SIMD dot reads 32 values at a time, straight from the block into registers, with no [`Unpacked`] copy
/// in memory between: the same levels and run scales as [`Unpack256::unpack`], so the same exact integer sums
/// and the same `f32` terms.
pub(crate) trait Grid32: Unpack256 {
    /// Values `32 ib .. 32 ib + 32` of a super-block: their magnitudes as four little-endian words of 8 bytes,
    /// their signs as four words of 8 sign bytes ([`SIGN_BYTES`]: `0xFF` negative, `0x01` positive) and the
    /// integer scales of their two runs of 16 (as [`Unpacked::scale`]).
    ///
    /// `SCALAR_LOADS`: read the magnitude tables through [`lut`] (loads the auto-vectorizer cannot turn into
    /// gathers), as [`x86::grid_dot_avx512`] asks; [`x86::grid_dot_avx2`] asks for plain loads (the GRID_U32
    /// formats' magnitude words go unused there, and unused plain loads are dropped). Formats that the AVX-512
    /// dot does not run (see [`x86::grid_avx512_applies`]) may ignore it.
    fn sub32<const SCALAR_LOADS: bool>(block: &[u8], ib: usize) -> ([u64; 4], [u64; 4], i16, i16);
    /// For formats whose 16 run scales are 4-bit values `s` packed in 8 bytes at this offset (low nibble first,
    /// run scale `2 s + 1`), the SIMD dot reads them once per super-block and ignores `sub32`'s scales.
    const NIBBLE_SCALES_AT: Option<usize> = None;
    /// For formats whose signs are plain bits (32 bytes at this offset, bit `i % 8` of byte `i / 8` set when value
    /// `i` is negative), the SIMD dot expands them with vector instructions and ignores `sub32`'s sign words.
    const SIGN_BITS_AT: Option<usize> = None;
    /// For formats whose 32 values are eight 4-value entries of a `u32` grid (IQ3_XXS, IQ3_S): the SIMD dot
    /// then builds the eight indices with vector instructions, looks the entries up itself and ignores `sub32`'s
    /// magnitude words.
    const GRID_U32: Option<GridU32> = None;
    /// For formats whose signs are 7-bit indices into `KSIGNS_IQ2XS` (one per group of 8 values): where the
    /// super-block's 32 indices are, so that the AVX-512 dot looks them all up with one byte permute.
    const KSIGN_INDICES: Option<KsignIndices> = None;
}

/// `table[i]`, read as one plain scalar load that the auto-vectorizer leaves alone: the magnitude lookups of
/// [`Grid32::sub32`]. Inlined into the AVX-512 dot, a run of ordinary lookups becomes gathers (`vpgatherdd`),
/// which made an AVX-512 version of IQ3_S's dot half as fast here (Zen 4: 2.4 against 4.1-4.3 GB/s in cache;
/// IQ3_S now keeps the AVX2 dot) and are slow on Intel parts with the GDS mitigation; a volatile read is one
/// `mov` that is never merged. Panics if `i` is out of bounds.
#[inline(always)]
pub(crate) fn lut<T: Copy>(table: &[T], i: usize) -> T {
    let r = &table[i];
    // SAFETY: `r` is a valid, aligned reference into a live slice.
    unsafe { std::ptr::read_volatile(r) }
}

/// `table[i]` through [`lut`] when `SCALAR_LOADS`, else a plain index (see [`Grid32::sub32`]).
#[inline(always)]
pub(crate) fn lookup<const SCALAR_LOADS: bool, T: Copy>(table: &[T], i: usize) -> T {
    if SCALAR_LOADS { lut(table, i) } else { table[i] }
}

/// Where a [`Grid32`] format keeps the 32 sign-pattern indices of a super-block (index `g` covers values
/// `8 g .. 8 g + 8`; `KSIGNS_IQ2XS[index]` has bit `j` set when value `8 g + j` is negative).
pub(crate) enum KsignIndices {
    /// Four per little-endian `u32` word, at bits 0, 7, 14 and 21 (the run scale above them); run `ib`'s word (groups
    /// `4 ib .. 4 ib + 4`) at byte `first + stride * ib`, `stride` 4 or 8.
    Words { first: usize, stride: usize },
    /// One per little-endian `u16` entry, in its top 7 bits; group `g`'s entry at byte `first + 2 g`.
    Halfwords { first: usize },
}

/// Where a [`Grid32`] format's `u32` grid entries come from: entry `e` of a super-block (4 values) is
/// `grid[block[qs + e] | ((block[qh + e / 8] >> (e % 8)) & 1) << 8]`, without the high bit when `qh` is `None`.
pub(crate) struct GridU32 {
    /// The grid: 256 entries, 512 with `qh`.
    pub grid: &'static [u32],
    /// Offset of the 64 low index bytes in the block.
    pub qs: usize,
    /// Offset of the 8 bytes of index high bits, if any.
    pub qh: Option<usize>,
}

/// Eight sign bits (bit `j`: value `j` negative) as eight sign bytes, `0xFF` for negative and `0x01` for
/// positive (what `_mm256_sign_epi8` needs to negate or keep an activation). On its own cache lines, as the grids.
pub(crate) static SIGN_BYTES: CacheAligned<[u64; 256]> = CacheAligned({
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut w = 0u64;
        let mut j = 0;
        while j < 8 {
            w |= (if b >> j & 1 != 0 { 0xFFu64 } else { 0x01 }) << (8 * j);
            j += 1;
        }
        t[b] = w;
        b += 1;
    }
    t
});

/// [`SIGN_BYTES`] of each 7-bit sign-pattern index of the IQ2/IQ3 formats (`KSIGNS_IQ2XS`).
pub(crate) static KSIGN_BYTES: CacheAligned<[u64; 128]> = CacheAligned({
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = SIGN_BYTES.0[super::grids::KSIGNS_IQ2XS[i] as usize];
        i += 1;
    }
    t
});

/// Exact scaled integer sum, scalar.
pub(crate) fn isum_scalar(u: &Unpacked, x: &[i8]) -> i32 {
    let mut total = 0i32;
    for j in 0..16 {
        let mut s = 0i32;
        for i in 16 * j..16 * j + 16 {
            s += u.level(i) * x[i] as i32;
        }
        total += u.scale[j] as i32 * s;
    }
    total
}

/// A row dot of an [`Unpack256`] format with the integer sums from `isum`.
#[inline(always)]
pub(crate) fn dot_with<F: Unpack256>(
    row: &[u8],
    xs: &[ActRow<'_>],
    out: &mut [f32],
    isum: impl Fn(&Unpacked, &[i8]) -> i32,
) {
    let mut acc = [Acc4::default(); 4];
    let mut u = Unpacked::default();
    for (sb, blk) in row.chunks_exact(F::BLOCK_BYTES).enumerate() {
        F::unpack(blk, &mut u);
        for (t, x) in xs.iter().enumerate() {
            let s = isum(&u, &x.qs[sb * 256..sb * 256 + 256]);
            acc[t].add(sb, F::term(blk, x, sb, s));
        }
    }
    for (o, a) in out.iter_mut().zip(&acc[..xs.len()]) {
        *o = a.sum();
    }
}

/// The scalar reference dot of an [`Unpack256`] format.
pub(crate) fn dot_scalar<F: Unpack256>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
    dot_with::<F>(row, xs, out, isum_scalar)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::simd::x86::hsum_i32_256;
    use super::{Acc4, ActRow};

    /// A row dot of a [`Grid32`] format, AVX2: per 32 values the grid words and sign bits go straight into
    /// registers (no unpacked copy), the signs onto the activations, `maddubs` then `madd` with the run scales;
    /// the integer sums equal [`super::isum_scalar`]'s, so the result equals the unpacked paths' bit for bit.
    /// `xs` holds 1 to 4 tokens, each with at least the row's `cols` quantized values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn grid_dot_avx2<F: super::Grid32>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let blocks = row.len() / F::BLOCK_BYTES;
        assert!(xs.iter().all(|x| x.qs.len() >= 256 * blocks), "activations shorter than the row");
        crate::dispatch_tokens!(grid_dot_nt::<F>, row, xs, out)
    }

    /// [`grid_dot_avx2`] for `NT` tokens (a compile-time count, so the per-token sums stay in registers).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn grid_dot_nt<F: super::Grid32, const NT: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        if let Some(super::GridU32 { grid, qs, qh }) = F::GRID_U32 {
            assert!(grid.len() >= if qh.is_some() { 512 } else { 256 }, "grid shorter than its indices");
            assert!(qs + 64 <= F::BLOCK_BYTES, "index bytes past the block");
        }
        let mut acc = [Acc4::default(); NT];
        let xq: [*const i8; NT] = std::array::from_fn(|t| xs[t].qs.as_ptr());
        for (sb, blk) in row.chunks_exact(F::BLOCK_BYTES).enumerate() {
            let mut sumi = [_mm256_setzero_si256(); NT];
            // Packed 4-bit run scales: 2 s + 1 as i16, the even runs in the low lane and the odd in the high one,
            // so one in-lane shuffle per 32 values picks runs 2 ib and 2 ib + 1.
            let packed = match F::NIBBLE_SCALES_AT {
                Some(at) => {
                    let b = _mm_cvtsi64_si128(u64::from_le_bytes(blk[at..at + 8].try_into().unwrap()) as i64);
                    let nib = _mm_set1_epi8(15);
                    let even = _mm_cvtepu8_epi16(_mm_and_si128(b, nib));
                    let odd = _mm_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), nib));
                    let v = _mm256_set_m128i(odd, even);
                    _mm256_add_epi16(_mm256_add_epi16(v, v), _mm256_set1_epi16(1))
                }
                None => _mm256_setzero_si256(),
            };
            for ib in 0..8 {
                let (g, n, s0, s1) = F::sub32::<false>(blk, ib);
                let m = if let Some(super::GridU32 { grid, qs, qh }) = F::GRID_U32 {
                    // Lane j: qs[8 ib + j] | ((qh[ib] >> j) & 1) << 8 (an index below the grid's length, checked
                    // above), stored, then looked up. LLVM turns these eight lookups into one `vpgatherdd`, which
                    // measured faster than scalar loads through `lut` on the development VM's Zen 4 (moe10 one
                    // thread: IQ3_XXS 4.5 against 3.9 GB/s, IQ3_S 4.7 against 4.1); gathers are slow on Intel parts
                    // with the GDS mitigation (not measured).
                    let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(blk[qs + 8 * ib..].as_ptr() as *const __m128i));
                    let idx = match qh {
                        Some(qh) => {
                            let bits = _mm256_set1_epi32(blk[qh + ib] as i32);
                            let hi = _mm256_sllv_epi32(bits, _mm256_set_epi32(1, 2, 3, 4, 5, 6, 7, 8));
                            _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi32(256)))
                        }
                        None => lo,
                    };
                    let mut ix = [0u32; 8];
                    _mm256_storeu_si256(ix.as_mut_ptr() as *mut __m256i, idx);
                    // SAFETY: every index is below 256, or 512 with qh: the grid's length (asserted per row).
                    let e = |j: usize| *grid.get_unchecked(ix[j] as usize) as i32;
                    _mm256_set_epi32(e(7), e(6), e(5), e(4), e(3), e(2), e(1), e(0))
                } else {
                    _mm256_set_epi64x(g[3] as i64, g[2] as i64, g[1] as i64, g[0] as i64)
                };
                // 0xFF where the value is negative, else 0x01: _mm256_sign_epi8 then negates or keeps x.
                let sg = match F::SIGN_BITS_AT {
                    Some(at) => {
                        let bits = u32::from_le_bytes(blk[at + 4 * ib..at + 4 * ib + 4].try_into().unwrap());
                        _mm256_or_si256(super::super::simd::x86::bits_to_bytes(bits), _mm256_set1_epi8(1))
                    }
                    None => _mm256_set_epi64x(n[3] as i64, n[2] as i64, n[1] as i64, n[0] as i64),
                };
                let sc = if F::NIBBLE_SCALES_AT.is_some() {
                    // Bytes 2 ib, 2 ib + 1 (the i16 of run 2 ib in the low lane, 2 ib + 1 in the high) everywhere.
                    let pair = (2 * ib as i8) as u8 as u16 | ((2 * ib as u16 + 1) << 8);
                    _mm256_shuffle_epi8(packed, _mm256_set1_epi16(pair as i16))
                } else {
                    _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0))
                };
                for t in 0..NT {
                    // In bounds: the caller checked 256 values per super-block.
                    let xv = _mm256_loadu_si256(xq[t].add(256 * sb + 32 * ib) as *const __m256i);
                    let p = _mm256_maddubs_epi16(m, _mm256_sign_epi8(xv, sg));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p, sc));
                }
            }
            for t in 0..NT {
                acc[t].add(sb, F::term(blk, &xs[t], sb, hsum_i32_256(sumi[t])));
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = a.sum();
        }
    }

    /// Whether [`grid_dot_avx512`] runs format `F`: the formats whose signs are sign-pattern indices
    /// ([`super::KsignIndices`]: IQ2_XXS, IQ2_XS, IQ3_XXS) on CPUs with AVX-512 VBMI (its byte permutes look the
    /// patterns up). The caller has established [`super::super::Isa::Avx512`]. The formats with plain sign bits
    /// (IQ2_S, IQ3_S) keep the AVX2 dot: their AVX-512 version measured no faster for IQ2_S and slower for IQ3_S
    /// (its 9-bit grid indices cost more scalar work per lookup than the wider steps save).
    #[inline(always)]
    pub fn grid_avx512_applies<F: super::Grid32>() -> bool {
        F::KSIGN_INDICES.is_some() && is_x86_feature_detected!("avx512vbmi")
    }

    /// The super-block's 256 sign bits as four masks (bit `i` of mask `p`: value `64 p + i` is negative), looked up
    /// from its 32 sign-pattern indices with one `vpermi2b` of the 128-byte `KSIGNS_IQ2XS` table.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    unsafe fn sign_masks<F: super::Grid32>(blk: &[u8], table: [__m512i; 2]) -> [u64; 4] {
        let mut m = [0u64; 4];
        // Byte g of `idx`: the index of group g (32 groups of 8 values).
        let idx = match F::KSIGN_INDICES {
            Some(super::KsignIndices::Words { first, stride }) => {
                let words = match stride {
                    4 => _mm256_loadu_si256(blk[first..first + 32].as_ptr() as *const __m256i),
                    8 => {
                        // The 64 bytes from the word before the first: the words are the odd dwords.
                        let v = _mm512_loadu_si512(blk[first - 4..first + 60].as_ptr() as *const _);
                        let odd = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 13, 11, 9, 7, 5, 3, 1);
                        _mm512_castsi512_si256(_mm512_permutexvar_epi32(odd, v))
                    }
                    _ => unreachable!("sign words every 4 or 8 bytes"),
                };
                // Bytes 0-3 of each qword from bits 0, 7, 14, 21 of its low word, bytes 4-7 from its high word.
                let at = _mm256_set1_epi64x(i64::from_le_bytes([0, 7, 14, 21, 32, 39, 46, 53]));
                _mm256_and_si256(_mm256_multishift_epi64_epi8(at, words), _mm256_set1_epi8(127))
            }
            Some(super::KsignIndices::Halfwords { first }) => {
                let v = _mm512_loadu_si512(blk[first..first + 64].as_ptr() as *const _);
                _mm512_cvtepi16_epi8(_mm512_srli_epi16::<9>(v))
            }
            None => unreachable!("grid_avx512_applies admits formats with sign indices only"),
        };
        let signs = _mm512_permutex2var_epi8(table[0], _mm512_castsi256_si512(idx), table[1]);
        _mm256_storeu_si256(m.as_mut_ptr() as *mut __m256i, _mm512_castsi512_si256(signs));
        m
    }

    /// A row dot of a [`Grid32`] format, AVX-512 (where [`grid_avx512_applies`]): 64 values a step, the
    /// magnitudes of `sub32` in one register, the super-block's signs as bit masks ([`sign_masks`]) that negate
    /// the activations (`vpsubb` under a mask), `maddubs` and the run scales with VNNI `vpdpwssd`. The same byte
    /// pairs and the same exact integer sums as [`grid_dot_avx2`] and [`super::isum_scalar`], so the same bits.
    /// `xs` holds 1 to 4 tokens, each with at least the row's `cols` quantized values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    pub unsafe fn grid_dot_avx512<F: super::Grid32>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let blocks = row.len() / F::BLOCK_BYTES;
        assert!(xs.iter().all(|x| x.qs.len() >= 256 * blocks), "activations shorter than the row");
        crate::dispatch_tokens!(grid_dot512_nt::<F>, row, xs, out)
    }

    /// [`grid_dot_avx512`] for `NT` tokens.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    unsafe fn grid_dot512_nt<F: super::Grid32, const NT: usize>(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        let ks = &super::super::grids::KSIGNS_IQ2XS;
        let table =
            [_mm512_loadu_si512(ks[..64].as_ptr() as *const _), _mm512_loadu_si512(ks[64..].as_ptr() as *const _)];
        // i16 lane l of a 64-value step takes the scale of run l / 8 of the step's four.
        let runs = _mm512_set_epi16(
            3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0,
        );
        let mut acc = [Acc4::default(); NT];
        let xq: [*const i8; NT] = std::array::from_fn(|t| xs[t].qs.as_ptr());
        for (sb, blk) in row.chunks_exact(F::BLOCK_BYTES).enumerate() {
            let masks = sign_masks::<F>(blk, table);
            // The 16 run scales (2 s + 1) of packed nibbles, in run order, when the format has them.
            let nibble_scales = match F::NIBBLE_SCALES_AT {
                Some(at) => {
                    let b = _mm_cvtsi64_si128(u64::from_le_bytes(blk[at..at + 8].try_into().unwrap()) as i64);
                    let nib = _mm_set1_epi8(15);
                    let runs16 = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
                    let v = _mm256_cvtepu8_epi16(runs16);
                    _mm512_castsi256_si512(_mm256_add_epi16(_mm256_add_epi16(v, v), _mm256_set1_epi16(1)))
                }
                None => _mm512_setzero_si512(),
            };
            let mut sumi = [_mm512_setzero_si512(); NT];
            for (p, &mask) in masks.iter().enumerate() {
                let (g0, _, s0, s1) = F::sub32::<true>(blk, 2 * p);
                let (g1, _, s2, s3) = F::sub32::<true>(blk, 2 * p + 1);
                let m = _mm512_set_epi64(
                    g1[3] as i64,
                    g1[2] as i64,
                    g1[1] as i64,
                    g1[0] as i64,
                    g0[3] as i64,
                    g0[2] as i64,
                    g0[1] as i64,
                    g0[0] as i64,
                );
                let sc = match F::NIBBLE_SCALES_AT {
                    Some(_) => {
                        _mm512_permutexvar_epi16(_mm512_add_epi16(runs, _mm512_set1_epi16(4 * p as i16)), nibble_scales)
                    }
                    None => _mm512_permutexvar_epi16(
                        runs,
                        _mm512_castsi128_si512(_mm_setr_epi16(s0, s1, s2, s3, 0, 0, 0, 0)),
                    ),
                };
                for t in 0..NT {
                    // In bounds: the caller checked 256 values per super-block.
                    let xv = _mm512_loadu_si512(xq[t].add(256 * sb + 64 * p) as *const _);
                    let xsgn = _mm512_mask_sub_epi8(xv, mask, _mm512_setzero_si512(), xv);
                    sumi[t] = _mm512_dpwssd_epi32(sumi[t], _mm512_maddubs_epi16(m, xsgn), sc);
                }
            }
            for t in 0..NT {
                acc[t].add(sb, F::term(blk, &xs[t], sb, _mm512_reduce_add_epi32(sumi[t])));
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = a.sum();
        }
    }
}

/// Declares `SIMD` for a [`Grid32`] format: the direct dot [`x86::grid_dot_avx2`] on AVX2 machines, and
/// [`x86::grid_dot_avx512`] on AVX-512 ones where it applies ([`x86::grid_avx512_applies`]; else the AVX2 dot).
macro_rules! grid_simd {
    ($f:ty) => {
        #[cfg(target_arch = "x86_64")]
        fn dot_direct(row: &[u8], xs: &[$crate::quant::ActRow<'_>], out: &mut [f32]) {
            // SAFETY: only listed for Isa::Avx2 and Isa::Avx512 (which includes AVX2), chosen when the CPU has it.
            unsafe { $crate::quant::unpacked::x86::grid_dot_avx2::<$f>(row, xs, out) }
        }
        #[cfg(target_arch = "x86_64")]
        fn dot_avx512(row: &[u8], xs: &[$crate::quant::ActRow<'_>], out: &mut [f32]) {
            if $crate::quant::unpacked::x86::grid_avx512_applies::<$f>() {
                // SAFETY: listed for Isa::Avx512 only, and grid_avx512_applies checked the extra features it needs.
                unsafe { $crate::quant::unpacked::x86::grid_dot_avx512::<$f>(row, xs, out) }
            } else {
                dot_direct(row, xs, out)
            }
        }
        /// The SIMD dot paths of this format.
        #[cfg(target_arch = "x86_64")]
        pub(crate) const SIMD: [(super::Isa, super::DotFn); 2] =
            [(super::Isa::Avx2, dot_direct), (super::Isa::Avx512, dot_avx512)];
        /// No SIMD paths off x86-64.
        #[cfg(not(target_arch = "x86_64"))]
        pub(crate) const SIMD: [(super::Isa, super::DotFn); 0] = [];
    };
}
pub(crate) use grid_simd;

/// Declares `SIMD` for a format with one AVX2 dot, `$kernel` (a path to an `unsafe fn<const T: usize>(&[u8],
/// &[ActRow], &mut [f32])` with AVX2 enabled, `T` the token count 1..=4), used on AVX-512 machines too.
macro_rules! avx2_dot_simd {
    ($kernel:path) => {
        #[cfg(target_arch = "x86_64")]
        fn dot_avx2(row: &[u8], xs: &[$crate::quant::ActRow<'_>], out: &mut [f32]) {
            use $kernel as kernel;
            // SAFETY: listed for Isa::Avx2 and Isa::Avx512 (which includes AVX2), chosen when the CPU has it.
            unsafe { $crate::dispatch_tokens!(kernel, row, xs, out) }
        }
        /// The SIMD dot paths of this format (the AVX2 one on AVX-512 machines too).
        #[cfg(target_arch = "x86_64")]
        pub(crate) const SIMD: [(super::Isa, super::DotFn); 2] =
            [(super::Isa::Avx2, dot_avx2), (super::Isa::Avx512, dot_avx2)];
        /// No SIMD paths off x86-64.
        #[cfg(not(target_arch = "x86_64"))]
        pub(crate) const SIMD: [(super::Isa, super::DotFn); 0] = [];
    };
}
pub(crate) use avx2_dot_simd;
