//! `IQ3_XXS` (3.06 bits per weight): super-blocks of 256 values as an `f16` `d`, 64 index bytes into
//! `IQ3XXS_GRID` (4 magnitudes each) and, per run of 32, a `u32` of four 7-bit sign-pattern indices into
//! `KSIGNS_IQ2XS` plus a 4-bit scale `s` on top; value = `d * (0.5 + s) * 0.5 * grid * sign` (ggml
//! `block_iq3_xxs`; tables and order of operations from `gguf.quants.IQ3_XXS`).

use super::grids::{IQ3XXS_GRID, KSIGNS_IQ2XS};
use super::unpacked::{Grid32, GridU32, KSIGN_BYTES, KsignIndices, Unpack256, Unpacked, grid_simd, lookup};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `IQ3_XXS` format.
pub struct Iq3Xxs;

#[inline(always)]
fn aux(block: &[u8], ib: usize) -> u32 {
    u32::from_le_bytes(block[66 + 4 * ib..70 + 4 * ib].try_into().unwrap())
}

impl BlockFormat for Iq3Xxs {
    const TYPE: GgmlType = GgmlType::IQ3_XXS;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 98;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for ib in 0..8 {
            let a = aux(block, ib);
            let db = d * (0.5 + (a >> 28) as f32) * 0.5;
            for l in 0..4 {
                let signs = KSIGNS_IQ2XS[((a >> (7 * l)) & 127) as usize];
                for half in 0..2 {
                    let g = IQ3XXS_GRID[block[2 + 8 * ib + 2 * l + half] as usize].to_le_bytes();
                    for k in 0..4 {
                        let j = 4 * half + k;
                        let v = db * g[k] as f32;
                        out[32 * ib + 8 * l + j] = if signs >> j & 1 != 0 { -v } else { v };
                    }
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

impl Unpack256 for Iq3Xxs {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        u.signs_apart = true;
        for e in 0..64 {
            u.mag[4 * e..4 * e + 4].copy_from_slice(&IQ3XXS_GRID[block[2 + e] as usize].to_le_bytes());
        }
        for ib in 0..8 {
            let a = aux(block, ib);
            for l in 0..4 {
                u.neg[4 * ib + l] = KSIGNS_IQ2XS[((a >> (7 * l)) & 127) as usize];
            }
            let s = 2 * (a >> 28) as i16 + 1;
            u.scale[2 * ib] = s;
            u.scale[2 * ib + 1] = s;
        }
    }
    #[inline(always)]
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        ((x.d[sb] * f16_at(block, 0)) * isum as f32) * 0.25
    }
}

impl Grid32 for Iq3Xxs {
    const KSIGN_INDICES: Option<KsignIndices> = Some(KsignIndices::Words { first: 66, stride: 4 });

    const GRID_U32: Option<GridU32> = Some(GridU32 { grid: &IQ3XXS_GRID.0, qs: 2, qh: None });

    #[inline(always)]
    fn sub32<const SCALAR_LOADS: bool>(block: &[u8], ib: usize) -> ([u64; 4], [u64; 4], i16, i16) {
        // Two 4-value grid entries per word of 8 magnitudes.
        let g = |l: usize| {
            let e = 2 + 8 * ib + 2 * l;
            lookup::<SCALAR_LOADS, _>(&IQ3XXS_GRID.0, block[e] as usize) as u64
                | (lookup::<SCALAR_LOADS, _>(&IQ3XXS_GRID.0, block[e + 1] as usize) as u64) << 32
        };
        let a = aux(block, ib);
        let n = |l: u32| KSIGN_BYTES[((a >> (7 * l)) & 127) as usize];
        let s = 2 * (a >> 28) as i16 + 1;
        ([g(0), g(1), g(2), g(3)], [n(0), n(1), n(2), n(3)], s, s)
    }
}

grid_simd!(Iq3Xxs);
