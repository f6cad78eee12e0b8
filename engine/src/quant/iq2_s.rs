//! `IQ2_S` (2.5 bits per weight): super-blocks of 256 values as an `f16` `d`, 32 low index bytes, 32 sign bytes
//! (one bit per value), 8 bytes of 2-bit index highs and 8 bytes of 4-bit scales (one per 16 values, low nibble
//! first); entry `e` (8 values) uses `IQ2S_GRID[qs[e] | ((qh[e / 4] >> 2 * (e % 4)) & 3) << 8]`; value =
//! `d * (0.5 + s) * 0.25 * grid * sign` (ggml `block_iq2_s`; tables from `gguf.quants.IQ2_S`).

use super::grids::IQ2S_GRID;
use super::unpacked::{Grid32, SIGN_BYTES, Unpack256, Unpacked, grid_simd};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `IQ2_S` format.
pub struct Iq2S;

#[inline(always)]
fn grid(block: &[u8], e: usize) -> u64 {
    let idx = block[2 + e] as usize | ((((block[66 + e / 4] >> (2 * (e % 4))) & 3) as usize) << 8);
    IQ2S_GRID[idx]
}

#[inline(always)]
fn scale16(block: &[u8], j: usize) -> u8 {
    (block[74 + j / 2] >> (4 * (j % 2))) & 15
}

impl BlockFormat for Iq2S {
    const TYPE: GgmlType = GgmlType::IQ2_S;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 82;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for e in 0..32 {
            let db = d * (0.5 + scale16(block, e / 2) as f32) * 0.25;
            let g = grid(block, e).to_le_bytes();
            let signs = block[34 + e];
            for j in 0..8 {
                let v = db * g[j] as f32;
                out[8 * e + j] = if signs >> j & 1 != 0 { -v } else { v };
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

impl Unpack256 for Iq2S {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        u.signs_apart = true;
        for e in 0..32 {
            u.mag[8 * e..8 * e + 8].copy_from_slice(&grid(block, e).to_le_bytes());
        }
        u.neg.copy_from_slice(&block[34..66]);
        for j in 0..16 {
            u.scale[j] = 2 * scale16(block, j) as i16 + 1;
        }
    }
    #[inline(always)]
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        ((x.d[sb] * f16_at(block, 0)) * isum as f32) * 0.125
    }
}

impl Grid32 for Iq2S {
    const SIGN_BITS_AT: Option<usize> = Some(34);

    const NIBBLE_SCALES_AT: Option<usize> = Some(74);

    #[inline(always)]
    fn sub32<const SCALAR_LOADS: bool>(block: &[u8], ib: usize) -> ([u64; 4], [u64; 4], i16, i16) {
        let g = |l: usize| grid(block, 4 * ib + l);
        let n = |l: usize| SIGN_BYTES[block[34 + 4 * ib + l] as usize];
        let s = |j: usize| 2 * scale16(block, j) as i16 + 1;
        ([g(0), g(1), g(2), g(3)], [n(0), n(1), n(2), n(3)], s(2 * ib), s(2 * ib + 1))
    }
}

grid_simd!(Iq2S);
