//! `IQ3_S` (3.44 bits per weight): super-blocks of 256 values as an `f16` `d`, 64 low index bytes, 8 bytes of
//! index high bits, 32 sign bytes (one bit per value) and 4 bytes of 4-bit scales (one per 32 values, low
//! nibble first); entry `e` (4 values) uses `IQ3S_GRID[qs[e] | ((qh[e / 8] >> (e % 8)) & 1) << 8]`; value =
//! `d * (1 + 2s) * grid * sign` (ggml `block_iq3_s`; tables from `gguf.quants.IQ3_S`).

use super::grids::IQ3S_GRID;
use super::unpacked::{Grid32, GridU32, SIGN_BYTES, Unpack256, Unpacked, grid_simd};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `IQ3_S` format.
pub struct Iq3S;

#[inline(always)]
fn grid(block: &[u8], e: usize) -> u32 {
    let idx = block[2 + e] as usize | ((((block[66 + e / 8] >> (e % 8)) & 1) as usize) << 8);
    IQ3S_GRID[idx]
}

#[inline(always)]
fn scale32(block: &[u8], ib: usize) -> u8 {
    (block[106 + ib / 2] >> (4 * (ib % 2))) & 15
}

impl BlockFormat for Iq3S {
    const TYPE: GgmlType = GgmlType::IQ3_S;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 110;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for e in 0..64 {
            let db = d * (1 + 2 * scale32(block, e / 8)) as f32;
            let g = grid(block, e).to_le_bytes();
            for k in 0..4 {
                let i = 4 * e + k;
                let v = db * g[k] as f32;
                out[i] = if block[74 + i / 8] >> (i % 8) & 1 != 0 { -v } else { v };
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

impl Unpack256 for Iq3S {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        u.signs_apart = true;
        for e in 0..64 {
            u.mag[4 * e..4 * e + 4].copy_from_slice(&grid(block, e).to_le_bytes());
        }
        u.neg.copy_from_slice(&block[74..106]);
        for ib in 0..8 {
            let s = 1 + 2 * scale32(block, ib) as i16;
            u.scale[2 * ib] = s;
            u.scale[2 * ib + 1] = s;
        }
    }
    #[inline(always)]
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        (x.d[sb] * f16_at(block, 0)) * isum as f32
    }
}

impl Grid32 for Iq3S {
    const SIGN_BITS_AT: Option<usize> = Some(74);
    const GRID_U32: Option<GridU32> = Some(GridU32 { grid: &IQ3S_GRID.0, qs: 2, qh: Some(66) });

    #[inline(always)]
    fn sub32<const SCALAR_LOADS: bool>(block: &[u8], ib: usize) -> ([u64; 4], [u64; 4], i16, i16) {
        // Two 4-value grid entries per word of 8 magnitudes.
        let g = |l: usize| grid(block, 8 * ib + 2 * l) as u64 | (grid(block, 8 * ib + 2 * l + 1) as u64) << 32;
        let n = |l: usize| SIGN_BYTES[block[74 + 4 * ib + l] as usize];
        let s = 1 + 2 * scale32(block, ib) as i16;
        ([g(0), g(1), g(2), g(3)], [n(0), n(1), n(2), n(3)], s, s)
    }
}

grid_simd!(Iq3S);
