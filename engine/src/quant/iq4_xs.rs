//! `IQ4_XS`: super-blocks of 256 values as an `f16` `d`, 6-bit run scales (low nibbles in 4 bytes, high 2-bit
//! parts in a `u16`) and 128 bytes of 4-bit indices into `KVALUES_IQ4NL`; value `i` = `(d * (ls_j - 32)) *
//! kvalues[idx_i]` with `j = i / 32` (ggml `block_iq4_xs`). Run `j`: bytes `16j..16j + 16` of the indices, low
//! nibbles first.

use super::grids::KVALUES_IQ4NL;
use super::unpacked::{Unpack256, Unpacked, unpacked_simd};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `IQ4_XS` format.
pub struct Iq4Xs;

#[inline(always)]
fn run_scale(block: &[u8], j: usize) -> i32 {
    let sh = u16::from_le_bytes([block[2], block[3]]);
    let l = (block[4 + j / 2] >> (4 * (j % 2))) & 15;
    let h = ((sh >> (2 * j)) & 3) as u8;
    (l | (h << 4)) as i32 - 32
}

#[inline(always)]
fn level(block: &[u8], i: usize) -> i8 {
    let (j, l) = (i / 32, i % 32);
    let b = block[8 + 16 * j + l % 16];
    KVALUES_IQ4NL[((b >> (4 * (l / 16))) & 15) as usize]
}

impl BlockFormat for Iq4Xs {
    const TYPE: GgmlType = GgmlType::IQ4_XS;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 136;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for (j, run) in out.chunks_exact_mut(32).enumerate() {
            let dl = d * run_scale(block, j) as f32;
            for (k, o) in run.iter_mut().enumerate() {
                *o = dl * level(block, 32 * j + k) as f32;
            }
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 0)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::unpacked::dot_scalar::<Self>(row, xs, out)
    }
}

impl Unpack256 for Iq4Xs {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for j in 0..8 {
            for l in 0..16 {
                let b = block[8 + 16 * j + l];
                u.q[32 * j + l] = KVALUES_IQ4NL[(b & 15) as usize];
                u.q[32 * j + 16 + l] = KVALUES_IQ4NL[(b >> 4) as usize];
            }
            let s = run_scale(block, j) as i16;
            u.scale[2 * j] = s;
            u.scale[2 * j + 1] = s;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        (x.d[sb] * f16_at(block, 0)) * isum as f32
    }
}

unpacked_simd!(Iq4Xs);
