//! `Q5_K`: super-blocks of 256 values as `f16` `d` and `dmin`, 12 bytes of 6-bit scales and mins (packed as in
//! Q4_K), 32 bytes of high bits and 128 bytes of low nibbles; value `i` = `(d * sc_j) * u_i - dmin * m_j` with
//! `j = i / 32` and `u_i` in 0..32 (ggml `block_q5_K`). Run `j = 2c + s` takes nibble `s` of bytes
//! `32c..32c + 32` and bit `j` of the 32 high-bit bytes.

use super::q4_k::scale_min;
use super::unpacked::{Unpack256, Unpacked};
use super::{ActFormat, ActRow, BlockFormat, f16_at, f16_finite_at};
use crate::gguf::GgmlType;

/// The `Q5_K` format.
pub struct Q5K;

#[inline(always)]
fn level(block: &[u8], i: usize) -> u8 {
    let (j, l) = (i / 32, i % 32);
    let low = (block[48 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
    let high = (block[16 + l] >> j) & 1;
    low | (high << 4)
}

impl BlockFormat for Q5K {
    const TYPE: GgmlType = GgmlType::Q5_K;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 176;
    const ACTS: ActFormat = ActFormat::Q8K;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
        for (j, run) in out.chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min(&block[4..16], j);
            let (dl, ml) = (d * sc as f32, dmin * m as f32);
            for (k, o) in run.iter_mut().enumerate() {
                *o = dl * level(block, 32 * j + k) as f32 - ml;
            }
        }
    }
    fn scales_finite(block: &[u8]) -> bool {
        f16_finite_at(block, 0) && f16_finite_at(block, 2)
    }
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]) {
        super::unpacked::dot_scalar::<Self>(row, xs, out)
    }
}

impl Unpack256 for Q5K {
    fn unpack(block: &[u8], u: &mut Unpacked) {
        for j in 0..8 {
            for l in 0..32 {
                let low = (block[48 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
                let high = (block[16 + l] >> j) & 1;
                u.q[32 * j + l] = (low | (high << 4)) as i8;
            }
            let sc = scale_min(&block[4..16], j).0 as i16;
            u.scale[2 * j] = sc;
            u.scale[2 * j + 1] = sc;
        }
    }
    fn term(block: &[u8], x: &ActRow<'_>, sb: usize, isum: i32) -> f32 {
        let bs = &x.sums[sb * 16..sb * 16 + 16];
        let msum: i32 =
            (0..8).map(|j| scale_min(&block[4..16], j).1 as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32)).sum();
        let dx = x.d[sb];
        (dx * f16_at(block, 0)) * isum as f32 - (dx * f16_at(block, 2)) * msum as f32
    }
}

// The AVX2 dot is Q4_K's, reading Q5_K's high bits too.
#[cfg(target_arch = "x86_64")]
use super::q4_k::x86;

super::unpacked::avx2_dot_simd!(x86::dot_q5k_avx2);
