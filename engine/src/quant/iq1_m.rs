//! `IQ1_M` (1.75 bits per weight): super-blocks of 256 values as 32 low index bytes, 16 bytes of 4-bit
//! index-high + delta-sign nibbles (one per 8 values) and four `u16` holding sixteen 3-bit scales (one per 16
//! values, bits `3k`) with the super-block's `f16` `d` spread over their top nibbles; entry `e` uses
//! `IQ1S_GRID[qs[e] | (nib & 7) << 8]`, `delta = -0.125` when `nib & 8`, else `0.125`; value =
//! `d * (2s + 1) * (grid + delta)` (ggml `block_iq1_m`; tables from `gguf.quants.IQ1_M`).

use super::grids::IQ1S_GRID;
use super::unpacked::{Grid32, Unpack256, Unpacked, grid_simd};
use super::{ActFormat, ActRow, BlockFormat};
use crate::gguf::GgmlType;

/// The `IQ1_M` format.
pub struct Iq1M;

#[inline(always)]
fn sc(block: &[u8], k: usize) -> u16 {
    u16::from_le_bytes([block[48 + 2 * k], block[49 + 2 * k]])
}

/// The super-block scale's `f16` bits.
#[inline(always)]
fn d_bits(block: &[u8]) -> u16 {
    (sc(block, 0) >> 12) | ((sc(block, 1) >> 8) & 0x00f0) | ((sc(block, 2) >> 4) & 0x0f00) | (sc(block, 3) & 0xf000)
}

#[inline(always)]
fn scale16(block: &[u8], j: usize) -> u16 {
    (sc(block, j / 4) >> (3 * (j % 4))) & 7
}

/// Entry `e`'s 8 grid values and whether its delta is negative.
#[inline(always)]
fn entry(block: &[u8], e: usize) -> ([i8; 8], bool) {
    let nib = (block[32 + e / 2] >> (4 * (e % 2))) & 15;
    let idx = block[e] as usize | (((nib & 7) as usize) << 8);
    (IQ1S_GRID[idx].to_le_bytes().map(|b| b as i8), nib & 8 != 0)
}

impl BlockFormat for Iq1M {
    const TYPE: GgmlType = GgmlType::IQ1_M;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 56;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = half::f16::from_bits(d_bits(block)).to_f32();
        for e in 0..32 {
            let dl = d * (2 * scale16(block, e / 2) + 1) as f32;
            let (g, neg) = entry(block, e);
            let delta = if neg { -0.125f32 } else { 0.125 };
            for (j, &v) in g.iter().enumerate() {
                out[8 * e + j] = dl * (v as f32 + delta);
            }
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        d_bits(block) & 0x7c00 != 0x7c00
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::unpacked::dot_scalar::<Self>(row, xs, out)
    }
}

impl Unpack256 for Iq1M {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for e in 0..32 {
            let (g, neg) = entry(block, e);
            let delta: i8 = if neg { -1 } else { 1 };
            for (j, &v) in g.iter().enumerate() {
                u.q[8 * e + j] = 8 * v + delta;
            }
        }
        for j in 0..16 {
            u.scale[j] = 2 * scale16(block, j) as i16 + 1;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        let d = half::f16::from_bits(d_bits(block)).to_f32();
        ((x.d[sb] * d) * isum as f32) * 0.125
    }
}

impl Grid32 for Iq1M {
    const IQ1_LEVELS: bool = true;

    #[inline(always)]
    fn sub32<const SCALAR_LOADS: bool>(block: &[u8], ib: usize) -> ([u64; 4], [u64; 4], i16, i16) {
        let (mut g, mut d) = ([0u64; 4], [0u64; 4]);
        for l in 0..4 {
            let (grid, neg) = entry(block, 4 * ib + l);
            g[l] = u64::from_le_bytes(grid.map(|v| v as u8));
            d[l] = if neg { u64::MAX } else { 0x0101_0101_0101_0101 };
        }
        let s = |j: usize| 2 * scale16(block, j) as i16 + 1;
        (g, d, s(2 * ib), s(2 * ib + 1))
    }
}

grid_simd!(Iq1M);
