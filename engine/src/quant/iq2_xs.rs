//! `IQ2_XS` (2.31 bits per weight): super-blocks of 256 values as an `f16` `d`, 32 `u16` (a 9-bit index into
//! `IQ2XS_GRID` and a 7-bit sign-pattern index into `KSIGNS_IQ2XS`, 8 values each) and 8 bytes of 4-bit
//! scales, one per 16 values (low nibble first); value = `d * (0.5 + s) * 0.25 * grid * sign` (ggml
//! `block_iq2_xs`; tables and order of operations from `gguf.quants.IQ2_XS`).

use super::grids::{IQ2XS_GRID, KSIGNS_IQ2XS};
use super::unpacked::{Grid32, KSIGN_BYTES, KsignIndices, Unpack256, Unpacked, grid_simd, lookup};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `IQ2_XS` format.
pub struct Iq2Xs;

#[inline(always)]
fn entry(block: &[u8], e: usize) -> (u64, u8) {
    let q = u16::from_le_bytes([block[2 + 2 * e], block[3 + 2 * e]]);
    (IQ2XS_GRID[(q & 511) as usize], KSIGNS_IQ2XS[(q >> 9) as usize])
}

#[inline(always)]
fn scale16(block: &[u8], j: usize) -> u8 {
    (block[66 + j / 2] >> (4 * (j % 2))) & 15
}

impl BlockFormat for Iq2Xs {
    const TYPE: GgmlType = GgmlType::IQ2_XS;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 74;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for e in 0..32 {
            let db = d * (0.5 + scale16(block, e / 2) as f32) * 0.25;
            let (grid, signs) = entry(block, e);
            let grid = grid.to_le_bytes();
            for j in 0..8 {
                let v = db * grid[j] as f32;
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

impl Unpack256 for Iq2Xs {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        u.signs_apart = true;
        for e in 0..32 {
            let (grid, signs) = entry(block, e);
            u.mag[8 * e..8 * e + 8].copy_from_slice(&grid.to_le_bytes());
            u.neg[e] = signs;
        }
        for j in 0..16 {
            u.scale[j] = 2 * scale16(block, j) as i16 + 1;
        }
    }
    #[inline(always)]
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        ((x.d[sb] * f16_at(block, 0)) * isum as f32) * 0.125
    }
}

impl Grid32 for Iq2Xs {
    const KSIGN_INDICES: Option<KsignIndices> = Some(KsignIndices::Halfwords { first: 2 });

    const NIBBLE_SCALES_AT: Option<usize> = Some(66);

    #[inline(always)]
    fn sub32<const SCALAR_LOADS: bool>(block: &[u8], ib: usize) -> ([u64; 4], [u64; 4], i16, i16) {
        // The four entries' u16 in one load.
        let w = u64::from_le_bytes(block[2 + 8 * ib..10 + 8 * ib].try_into().unwrap());
        let (q0, q1, q2, q3) = (w as u16, (w >> 16) as u16, (w >> 32) as u16, (w >> 48) as u16);
        let g = |q: u16| lookup::<SCALAR_LOADS, _>(&IQ2XS_GRID.0, (q & 511) as usize);
        let n = |q: u16| KSIGN_BYTES[(q >> 9) as usize];
        let s = |j: usize| 2 * scale16(block, j) as i16 + 1;
        ([g(q0), g(q1), g(q2), g(q3)], [n(q0), n(q1), n(q2), n(q3)], s(2 * ib), s(2 * ib + 1))
    }
}

grid_simd!(Iq2Xs);
