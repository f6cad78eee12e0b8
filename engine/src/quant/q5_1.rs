//! `Q5_1`: blocks of 32 values as `f16` scale `d`, `f16` min `m`, 32 high bits and 16 bytes of low nibbles
//! (as Q5_0); value = `d * u + m` (ggml `block_q5_1`). Quantizer as `gguf.quants.Q5_1.quantize_blocks`
//! (bit-exact): `d = (max - min) / 31`, `u = min(31, trunc((x - min) / d + 0.5))`.

use super::blocks32::{Block32, block32_simd};
use super::q5_0::levels5;
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `Q5_1` format.
pub struct Q5_1;

impl BlockFormat for Q5_1 {
    const TYPE: GgmlType = GgmlType::Q5_1;
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 24;
    const ACTS: ActFormat = ActFormat::Q8_32;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let (d, m) = (f16_at(block, 0), f16_at(block, 2));
        let mut q = [0i8; 32];
        Self::levels(block, &mut q);
        for (o, &v) in out.iter_mut().zip(&q) {
            *o = d * v as f32 + m;
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 0) && f16_finite_at(block, 2)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::blocks32::dot_scalar::<Self>(row, xs, out)
    }
}

impl Block32 for Q5_1 {
    const OFFSET: i32 = 0;
    const AVX2_SIGNED: bool = false;
    const HAS_MIN: bool = true;
    fn d(block: &[u8]) -> f32 {
        f16_at(block, 0)
    }
    fn m(block: &[u8]) -> f32 {
        f16_at(block, 2)
    }
    fn levels(block: &[u8], q: &mut [i8; 32]) {
        levels5(block, 4, 8, q, 0);
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn avx2_levels(p: *const u8) -> std::arch::x86_64::__m256i {
        unsafe { super::q5_0::x86::levels5_avx2(p, 4, 8) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn avx512_levels2(p0: *const u8, p1: *const u8) -> std::arch::x86_64::__m512i {
        unsafe { super::q5_0::x86::levels5x2_avx512(p0, p1, 4, 8) }
    }
}

block32_simd!(Q5_1);

/// Quantizes a row (`src.len()` a multiple of 32) to Q5_1, bit-exact with `gguf.quants.quantize(.., Q5_1)`.
pub fn quantize_row_q5_1(src: &[f32], dst: &mut Vec<u8>) {
    for block in src.chunks_exact(32) {
        let (min, max) = super::quantize::min_max(block);
        let d = (max - min) / 31.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let q: Vec<u8> = block.iter().map(|&v| (((v - min) * id + 0.5).trunc() as u8).min(31)).collect();
        dst.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        dst.extend_from_slice(&half::f16::from_f32(min).to_le_bytes());
        let qh = q.iter().enumerate().fold(0u32, |h, (i, &u)| h | (((u >> 4) as u32) << i));
        dst.extend_from_slice(&qh.to_le_bytes());
        for i in 0..16 {
            dst.push((q[i] & 15) | (q[i + 16] << 4));
        }
    }
}
