//! `Q8_0`: blocks of 32 values as one `f16` scale `d` and 32 signed bytes `q`; value = `d * q`
//! (ggml `block_q8_0`; quantizer as `gguf.quants.Q8_0.quantize_blocks`).

use super::blocks32::{Block32, block32_simd};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `Q8_0` format.
pub struct Q8_0;

impl BlockFormat for Q8_0 {
    const TYPE: GgmlType = GgmlType::Q8_0;
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 34;
    const ACTS: ActFormat = ActFormat::Q8_32;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for (o, &q) in out.iter_mut().zip(&block[2..34]) {
            *o = (q as i8) as f32 * d;
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 0)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::blocks32::dot_scalar::<Self>(row, xs, out)
    }
}

impl Block32 for Q8_0 {
    const OFFSET: i32 = 128;
    const AVX2_SIGNED: bool = true;
    fn d(block: &[u8]) -> f32 {
        f16_at(block, 0)
    }
    fn levels(block: &[u8], q: &mut [i8; 32]) {
        for (o, &b) in q.iter_mut().zip(&block[2..34]) {
            *o = b as i8;
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn avx2_levels(p: *const u8) -> std::arch::x86_64::__m256i {
        unsafe { std::arch::x86_64::_mm256_loadu_si256(p.add(2) as *const _) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn avx512_levels2(p0: *const u8, p1: *const u8) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        unsafe {
            let a = _mm256_loadu_si256(p0.add(2) as *const __m256i);
            let b = _mm256_loadu_si256(p1.add(2) as *const __m256i);
            // q + 128 as an unsigned byte is q with its top bit flipped.
            _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1), _mm512_set1_epi8(-128))
        }
    }
}

block32_simd!(Q8_0);

/// Quantizes a row (`src.len()` a multiple of 32) to Q8_0, bit-exact with `gguf.quants.quantize(.., Q8_0)`:
/// `d = max|x| / 127`, `q = round_half_away(x / d)`, `d` stored as `f16`.
pub fn quantize_row_q8_0(src: &[f32], dst: &mut Vec<u8>) {
    for block in src.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        dst.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        dst.extend(block.iter().map(|&v| (v * id).round() as i8 as u8));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dequantize_inverts_quantize_within_half_a_step() {
        let row: Vec<f32> = (0..64).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173).collect();
        let mut bytes = Vec::new();
        quantize_row_q8_0(&row, &mut bytes);
        assert_eq!(bytes.len(), 68);
        let mut back = vec![0f32; 64];
        for (b, o) in bytes.chunks_exact(34).zip(back.chunks_exact_mut(32)) {
            Q8_0::dequantize_block(b, o);
        }
        for (blk, bblk) in row.chunks(32).zip(back.chunks(32)) {
            let step = blk.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (a, b) in blk.iter().zip(bblk) {
                assert!((a - b).abs() <= step * 0.5 + 1e-3 * step, "{a} vs {b}");
            }
        }
    }
}
