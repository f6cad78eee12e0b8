//! `Q6_K`: super-blocks of 256 values as 128 bytes of low nibbles `ql`, 64 bytes of 2-bit highs `qh`, 16 signed
//! byte scales and an `f16` `d`; value `i` = `(d * sc_{i/16}) * (u_i - 32)`, `u_i` in 0..64 (ggml
//! `block_q6_K`). With `h = i / 128`, `r = i % 128`: low nibble `r / 64` of `ql[64h + r % 64]`, high bits
//! `2 * (r / 32)` of `qh[32h + r % 32]`.

use super::unpacked::{Unpack256, Unpacked, unpacked_simd};
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

unpacked_simd!(Q6K);
