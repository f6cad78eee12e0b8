//! `Q4_1`: blocks of 32 values as `f16` scale `d`, `f16` min `m` and 16 bytes of 4-bit levels `u` (layout as
//! Q4_0); value = `d * u + m` (ggml `block_q4_1`). Quantizer as `gguf.quants.Q4_1.quantize_blocks`
//! (bit-exact): `d = (max - min) / 15`, `u = min(15, trunc((x - min) / d + 0.5))`.

use super::blocks32::{Block32, block32_simd};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `Q4_1` format.
pub struct Q4_1;

impl BlockFormat for Q4_1 {
    const TYPE: GgmlType = GgmlType::Q4_1;
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 20;
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

impl Block32 for Q4_1 {
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
        for (i, &b) in block[4..20].iter().enumerate() {
            q[i] = (b & 15) as i8;
            q[i + 16] = (b >> 4) as i8;
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn avx2_levels(p: *const u8) -> std::arch::x86_64::__m256i {
        unsafe { super::blocks32::x86::nibbles_256(p.add(4)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn avx512_levels2(p0: *const u8, p1: *const u8) -> std::arch::x86_64::__m512i {
        unsafe { super::blocks32::x86::nibbles2_512(p0.add(4), p1.add(4)) }
    }
}

block32_simd!(Q4_1);

/// Quantizes a row (`src.len()` a multiple of 32) to Q4_1, bit-exact with `gguf.quants.quantize(.., Q4_1)`.
pub fn quantize_row_q4_1(src: &[f32], dst: &mut Vec<u8>) {
    for block in src.chunks_exact(32) {
        let (min, max) = super::quantize::min_max(block);
        let d = (max - min) / 15.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        dst.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        dst.extend_from_slice(&half::f16::from_f32(min).to_le_bytes());
        let u = |v: f32| (((v - min) * id + 0.5).trunc() as u8).min(15);
        for i in 0..16 {
            dst.push(u(block[i]) | (u(block[i + 16]) << 4));
        }
    }
}
