//! Activations prepared for the dot-product kernels: kept as `f32`, or quantized to 8 bits the way ggml pairs
//! them with each weight format (`vec_dot_type` in ggml's CPU backend).
//!
//! - [`ActFormat::F32`] for F32, F16 and BF16 weights (ggml converts activations to F16/BF16 for those; we keep
//!   `f32`, which is more accurate).
//! - [`ActFormat::Q8_32`] for the 32-value block formats (ggml `Q8_0`/`Q8_1`): per block of 32 an `f32` scale
//!   `d = max|x| / 127`, 32 `i8` values `round(x / d)` and their sum (ggml stores `d` as f16; we keep `f32`).
//! - [`ActFormat::Q8K`] for the 256-value super-block formats, k-quants and i-quants (ggml `block_q8_K`): per
//!   256 values an `f32` scale, 256 `i8` values and the 16 sums of each run of 16.
//!
//! A block holding a NaN or an infinity gets a NaN scale, so the dot products turn NaN rather than hide it.

/// How a kernel wants its activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActFormat {
    /// Plain `f32`.
    F32,
    /// 8-bit blocks of 32 with an `f32` scale and the block sum.
    Q8_32,
    /// 8-bit super-blocks of 256 with an `f32` scale and 16 sums of 16.
    Q8K,
}

impl ActFormat {
    /// Values per activation block (1 for `F32`).
    pub fn block(self) -> usize {
        match self {
            ActFormat::F32 => 1,
            ActFormat::Q8_32 => 32,
            ActFormat::Q8K => 256,
        }
    }
    /// Values covered by one entry of `sums`.
    pub fn sum_block(self) -> usize {
        match self {
            ActFormat::F32 => 1,
            ActFormat::Q8_32 => 32,
            ActFormat::Q8K => 16,
        }
    }
}

/// One token's activations as the kernels read them. Only the fields of its format are non-empty: `f` for
/// `F32`; `qs` (`cols` values), `d` (one per block) and `sums` (one per 32 for `Q8_32`, per 16 for `Q8K`).
#[derive(Debug, Clone, Copy)]
pub struct ActRow<'a> {
    /// `f32` values (`F32`).
    pub f: &'a [f32],
    /// Quantized values.
    pub qs: &'a [i8],
    /// Block scales.
    pub d: &'a [f32],
    /// Sums of the quantized values (exact).
    pub sums: &'a [i16],
}

/// `tokens` activation vectors of `cols` values in one format.
#[derive(Debug, Clone)]
pub struct Activations {
    format: ActFormat,
    cols: usize,
    tokens: usize,
    f: Vec<f32>,
    qs: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<i16>,
}

impl Activations {
    /// Prepares `xs` (`[tokens, cols]`, row-major) in `format`. `cols` must be a multiple of the format's block
    /// (the weight's row length always is).
    pub fn new(format: ActFormat, xs: &[f32], cols: usize, tokens: usize) -> Self {
        assert_eq!(xs.len(), cols * tokens, "activations: {} values for {tokens} x {cols}", xs.len());
        assert_eq!(cols % format.block(), 0, "activations: {cols} columns are not whole {format:?} blocks");
        let mut a = Self { format, cols, tokens, f: Vec::new(), qs: Vec::new(), d: Vec::new(), sums: Vec::new() };
        match format {
            ActFormat::F32 => a.f = xs.to_vec(),
            ActFormat::Q8_32 | ActFormat::Q8K => {
                let block = format.block();
                let sb = format.sum_block();
                a.qs = vec![0; xs.len()];
                a.d = vec![0.0; xs.len() / block];
                a.sums = vec![0; xs.len() / sb];
                for ((x, q), d) in xs.chunks_exact(block).zip(a.qs.chunks_exact_mut(block)).zip(a.d.iter_mut()) {
                    *d = quantize_block_i8(x, q);
                }
                for (q, s) in a.qs.chunks_exact(sb).zip(a.sums.iter_mut()) {
                    *s = q.iter().map(|&v| v as i16).sum();
                }
            }
        }
        a
    }

    /// The format.
    pub fn format(&self) -> ActFormat {
        self.format
    }
    /// Values per token.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Number of tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Token `t`'s view.
    #[inline]
    pub fn row(&self, t: usize) -> ActRow<'_> {
        let c = self.cols;
        match self.format {
            ActFormat::F32 => ActRow { f: &self.f[t * c..(t + 1) * c], qs: &[], d: &[], sums: &[] },
            f => {
                let nb = c / f.block();
                let ns = c / f.sum_block();
                ActRow {
                    f: &[],
                    qs: &self.qs[t * c..(t + 1) * c],
                    d: &self.d[t * nb..(t + 1) * nb],
                    sums: &self.sums[t * ns..(t + 1) * ns],
                }
            }
        }
    }
}

/// Symmetric 8-bit quantization of one block: `d = max|x| / 127`, `q = round_half_away(x / d)`; returns `d`
/// (NaN when the block holds a non-finite value, with all `q` zero). The AVX2 path (when the chosen instruction
/// set has it) computes the same values.
fn quantize_block_i8(x: &[f32], q: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::Isa::detect() >= super::Isa::Avx2 && x.len().is_multiple_of(8) {
        // SAFETY: the CPU has AVX2 (Isa::detect only reports what it has).
        if let Some(d) = unsafe { x86::quantize_block_i8_avx2(x, q) } {
            return d;
        }
    }
    quantize_block_i8_scalar(x, q)
}

fn quantize_block_i8_scalar(x: &[f32], q: &mut [i8]) -> f32 {
    // max |x| over the bit patterns of |x| (ordered as the values for non-negative floats; vectorises, unlike
    // `f32::max`); a pattern at or above infinity's is a non-finite value.
    let amax_bits = x.iter().map(|v| v.to_bits() & 0x7fff_ffff).max().unwrap_or(0);
    let finite = amax_bits < 0x7f80_0000;
    let amax = f32::from_bits(amax_bits);
    if !finite {
        q.fill(0);
        return f32::NAN;
    }
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(x) {
        // round_half_away(r) as trunc(r + copysign(0.5, r)) in f64, where the sum of an f32 and 0.5 is exact (the
        // same integers as `f32::round`, which is a libm call per value on baseline x86-64).
        let r = (v * id) as f64;
        *o = ((r + 0.5f64.copysign(r)) as i32).clamp(-127, 127) as i8;
    }
    d
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    /// [`super::quantize_block_i8`] with AVX2, 8 values at a time (`x.len() % 8 == 0`): max |x| over the bit
    /// patterns, `x * (1/d)` in f32, then round-half-away as `trunc(r + copysign(0.5, r))` in f64 (exact), as the
    /// scalar path. `None` (nothing written) where the scalar path must decide: a non-finite value, or a scale
    /// whose inverse overflows.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_block_i8_avx2(x: &[f32], q: &mut [i8]) -> Option<f32> {
        let mask = _mm256_set1_epi32(0x7fff_ffff);
        let mut m = _mm256_setzero_si256();
        for c in x.chunks_exact(8) {
            m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_loadu_si256(c.as_ptr() as *const __m256i), mask));
        }
        let lanes: [u32; 8] = std::mem::transmute(m);
        let amax_bits = lanes.iter().copied().max().unwrap_or(0);
        if amax_bits >= 0x7f80_0000 {
            return None;
        }
        let d = f32::from_bits(amax_bits) / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        if !id.is_finite() {
            return None;
        }
        let idv = _mm256_set1_ps(id);
        let (half, sign) = (_mm256_set1_pd(0.5), _mm256_set1_pd(-0.0));
        let (lo_q, hi_q) = (_mm_set1_epi32(-127), _mm_set1_epi32(127));
        for (c, o) in x.chunks_exact(8).zip(q.chunks_exact_mut(8)) {
            let r = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), idv);
            let round = |v: __m256d| {
                let t = _mm256_cvttpd_epi32(_mm256_add_pd(v, _mm256_or_pd(half, _mm256_and_pd(v, sign))));
                _mm_min_epi32(_mm_max_epi32(t, lo_q), hi_q)
            };
            let a = round(_mm256_cvtps_pd(_mm256_castps256_ps128(r)));
            let b = round(_mm256_cvtps_pd(_mm256_extractf128_ps(r, 1)));
            let p = _mm_packs_epi16(_mm_packs_epi32(a, b), _mm_setzero_si128());
            _mm_storel_epi64(o.as_mut_ptr() as *mut __m128i, p);
        }
        Some(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 quantization equals the scalar one value for value: ordinary blocks, ties at .5 of either sign,
    /// signed zeros, a block of zeros, tiny and huge magnitudes, and the blocks it leaves to the scalar path.
    #[test]
    fn avx2_quantization_equals_scalar() {
        #[cfg(target_arch = "x86_64")]
        {
            if !std::is_x86_feature_detected!("avx2") {
                eprintln!("no AVX2 on this CPU: nothing to compare");
                return;
            }
            let mut blocks: Vec<Vec<f32>> = Vec::new();
            let mut s = 0x2545_f491_4f6c_dd1du64;
            for scale in [1e-30f32, 1e-3, 1.0, 7.5, 1e6, 3e38] {
                blocks.push(
                    (0..256)
                        .map(|_| {
                            s ^= s << 13;
                            s ^= s >> 7;
                            s ^= s << 17;
                            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
                        })
                        .collect(),
                );
            }
            // Ties: with max |x| = 127, x / d = x, so every half-integer is a tie.
            blocks.push((0..256).map(|i| if i == 0 { 127.0 } else { (i as f32 - 128.0) / 2.0 + 0.0 }).collect());
            blocks.push((0..32).map(|i| if i % 2 == 0 { -0.0 } else { 0.0 }).collect());
            blocks.push(vec![0.0; 32]);
            blocks.push((0..32).map(|i| if i == 3 { f32::from_bits(1) } else { 0.0 }).collect()); // 1/d overflows
            blocks.push((0..32).map(|i| if i == 5 { f32::INFINITY } else { 1.0 }).collect());
            blocks.push((0..32).map(|i| if i == 7 { f32::NAN } else { -1.0 }).collect());
            for (k, x) in blocks.iter().enumerate() {
                let (mut a, mut b) = (vec![0i8; x.len()], vec![0i8; x.len()]);
                let ds = quantize_block_i8_scalar(x, &mut a);
                // SAFETY: AVX2 checked above.
                match unsafe { x86::quantize_block_i8_avx2(x, &mut b) } {
                    Some(dv) => {
                        assert_eq!(dv.to_bits(), ds.to_bits(), "block {k}: scale");
                        assert_eq!(a, b, "block {k}: values");
                    }
                    None => assert!(!ds.is_finite() || !(1.0 / ds).is_finite(), "block {k} left to scalar"),
                }
            }
        }
    }

    #[test]
    fn q8k_sums_and_scales() {
        let xs: Vec<f32> = (0..512).map(|i| ((i * 7919) % 201) as f32 - 100.0).collect();
        let a = Activations::new(ActFormat::Q8K, &xs, 512, 1);
        let r = a.row(0);
        assert_eq!(r.d.len(), 2);
        assert_eq!(r.sums.len(), 32);
        for (j, s) in r.sums.iter().enumerate() {
            assert_eq!(*s, r.qs[j * 16..(j + 1) * 16].iter().map(|&v| v as i16).sum::<i16>());
        }
        for (x, q) in xs.iter().zip(r.qs) {
            let d = r.d[0];
            assert!((x - *q as f32 * d).abs() <= d * 0.5 + 1e-4, "{x} vs {q}*{d}");
        }
    }

    #[test]
    fn non_finite_blocks_get_a_nan_scale() {
        let mut xs = vec![1.0f32; 64];
        xs[40] = f32::INFINITY;
        let a = Activations::new(ActFormat::Q8_32, &xs, 64, 1);
        assert_eq!(a.row(0).d[0], 1.0 / 127.0);
        assert!(a.row(0).d[1].is_nan());
        xs[40] = f32::NAN;
        assert!(Activations::new(ActFormat::Q8_32, &xs, 64, 1).row(0).d[1].is_nan());
    }
}
