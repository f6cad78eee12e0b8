//! `IQ1_S` (1.56 bits per weight): super-blocks of 256 values as an `f16` `d`, 32 low index bytes and 8 `u16`
//! (per run of 32: four 3-bit index highs, a 3-bit scale `s` and a delta sign); entry `e` (8 values) uses
//! `IQ1S_GRID[qs[e] | ((qh >> 3 * (e % 4)) & 7) << 8]` (values -1, 0, 1); value = `d * (2s + 1) * (grid +
//! delta)`, `delta = -0.125` when bit 15 is set, else `0.125` (ggml `block_iq1_s`; tables from
//! `gguf.quants.IQ1_S`). The kernels fold the delta into integer levels `8 * grid + sign(delta)`.

use super::grids::IQ1S_GRID;
use super::unpacked::{Grid32, Unpack256, Unpacked, grid_simd};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `IQ1_S` format.
pub struct Iq1S;

#[inline(always)]
fn qh(block: &[u8], ib: usize) -> u16 {
    u16::from_le_bytes([block[34 + 2 * ib], block[35 + 2 * ib]])
}

#[inline(always)]
fn grid(block: &[u8], ib: usize, l: usize) -> [i8; 8] {
    let h = qh(block, ib);
    let idx = block[2 + 4 * ib + l] as usize | ((((h >> (3 * l)) & 7) as usize) << 8);
    IQ1S_GRID[idx].to_le_bytes().map(|b| b as i8)
}

impl BlockFormat for Iq1S {
    const TYPE: GgmlType = GgmlType::IQ1_S;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 50;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for ib in 0..8 {
            let h = qh(block, ib);
            let dl = d * (2 * ((h >> 12) & 7) + 1) as f32;
            let delta = if h & 0x8000 == 0 { 0.125f32 } else { -0.125 };
            for l in 0..4 {
                for (j, &g) in grid(block, ib, l).iter().enumerate() {
                    out[32 * ib + 8 * l + j] = dl * (g as f32 + delta);
                }
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

impl Unpack256 for Iq1S {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for ib in 0..8 {
            let h = qh(block, ib);
            let delta: i8 = if h & 0x8000 == 0 { 1 } else { -1 };
            for l in 0..4 {
                for (j, &g) in grid(block, ib, l).iter().enumerate() {
                    u.q[32 * ib + 8 * l + j] = 8 * g + delta;
                }
            }
            let s = 2 * ((h >> 12) & 7) as i16 + 1;
            u.scale[2 * ib] = s;
            u.scale[2 * ib + 1] = s;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        ((x.d[sb] * f16_at(block, 0)) * isum as f32) * 0.125
    }
}

/// Eight delta bytes: `1` each, or `-1` each when `neg`.
#[inline(always)]
fn delta_word(neg: bool) -> u64 {
    if neg { u64::MAX } else { 0x0101_0101_0101_0101 }
}

impl Grid32 for Iq1S {
    const IQ1_LEVELS: bool = true;

    #[inline(always)]
    fn sub32<const SCALAR_LOADS: bool>(block: &[u8], ib: usize) -> ([u64; 4], [u64; 4], i16, i16) {
        let h = qh(block, ib);
        let g = |l: usize| IQ1S_GRID[block[2 + 4 * ib + l] as usize | ((((h >> (3 * l)) & 7) as usize) << 8)];
        let s = 2 * ((h >> 12) & 7) as i16 + 1;
        ([g(0), g(1), g(2), g(3)], [delta_word(h & 0x8000 != 0); 4], s, s)
    }
}

grid_simd!(Iq1S);
