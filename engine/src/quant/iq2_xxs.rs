//! `IQ2_XXS` (2.06 bits per weight): super-blocks of 256 values as an `f16` `d` and, per run of 32, two `u32`:
//! four 8-bit indices into `IQ2XXS_GRID` (8 magnitudes each) and four 7-bit sign-pattern indices into
//! `KSIGNS_IQ2XS` plus a 4-bit scale `s` in the top bits; value = `d * (0.5 + s) * 0.25 * grid * sign`
//! (ggml `block_iq2_xxs`; tables and order of operations from `gguf.quants.IQ2_XXS`).

use super::grids::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use super::unpacked::{Grid32, KSIGN_BYTES, KsignIndices, Unpack256, Unpacked, grid_simd, lookup};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `IQ2_XXS` format.
pub struct Iq2Xxs;

#[inline(always)]
fn aux(block: &[u8], ib: usize) -> (u32, u32) {
    let p = 2 + 8 * ib;
    (
        u32::from_le_bytes(block[p..p + 4].try_into().unwrap()),
        u32::from_le_bytes(block[p + 4..p + 8].try_into().unwrap()),
    )
}

impl BlockFormat for Iq2Xxs {
    const TYPE: GgmlType = GgmlType::IQ2_XXS;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 66;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for ib in 0..8 {
            let (a0, a1) = aux(block, ib);
            let db = d * (0.5 + (a1 >> 28) as f32) * 0.25;
            for l in 0..4 {
                let grid = IQ2XXS_GRID[((a0 >> (8 * l)) & 255) as usize].to_le_bytes();
                let signs = KSIGNS_IQ2XS[((a1 >> (7 * l)) & 127) as usize];
                for j in 0..8 {
                    let v = db * grid[j] as f32;
                    out[32 * ib + 8 * l + j] = if signs >> j & 1 != 0 { -v } else { v };
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

impl Unpack256 for Iq2Xxs {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        u.signs_apart = true;
        for ib in 0..8 {
            let (a0, a1) = aux(block, ib);
            for l in 0..4 {
                let g = IQ2XXS_GRID[((a0 >> (8 * l)) & 255) as usize];
                let p = 32 * ib + 8 * l;
                u.mag[p..p + 8].copy_from_slice(&g.to_le_bytes());
                u.neg[4 * ib + l] = KSIGNS_IQ2XS[((a1 >> (7 * l)) & 127) as usize];
            }
            let s = 2 * (a1 >> 28) as i16 + 1;
            u.scale[2 * ib] = s;
            u.scale[2 * ib + 1] = s;
        }
    }
    #[inline(always)]
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        ((x.d[sb] * f16_at(block, 0)) * isum as f32) * 0.125
    }
}

impl Grid32 for Iq2Xxs {
    const KSIGN_INDICES: Option<KsignIndices> = Some(KsignIndices::Words { first: 6, stride: 8 });

    #[inline(always)]
    fn sub32<const SCALAR_LOADS: bool>(block: &[u8], ib: usize) -> ([u64; 4], [u64; 4], i16, i16) {
        let (a0, a1) = aux(block, ib);
        let g = |l: u32| lookup::<SCALAR_LOADS, _>(&IQ2XXS_GRID.0, ((a0 >> (8 * l)) & 255) as usize);
        let n = |l: u32| KSIGN_BYTES[((a1 >> (7 * l)) & 127) as usize];
        let s = 2 * (a1 >> 28) as i16 + 1;
        ([g(0), g(1), g(2), g(3)], [n(0), n(1), n(2), n(3)], s, s)
    }
}

grid_simd!(Iq2Xxs);
