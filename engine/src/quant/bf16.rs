//! `BF16`: bfloat16, the upper 16 bits of an `f32`, one value per 2 bytes.

use super::BlockFormat;
use crate::gguf::GgmlType;

/// The `BF16` format.
pub struct Bf16;

impl BlockFormat for Bf16 {
    const TYPE: GgmlType = GgmlType::BF16;
    const BLOCK_ELEMS: usize = 1;
    const BLOCK_BYTES: usize = 2;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        out[0] = f32::from_bits((u16::from_le_bytes([block[0], block[1]]) as u32) << 16);
    }
}

/// Rounds an `f32` to bfloat16 bits the way the `gguf` package and ggml do: NaN stays a quiet NaN, everything
/// else rounds to nearest even.
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 64) as u16;
    }
    ((bits.wrapping_add(0x7fff + ((bits >> 16) & 1))) >> 16) as u16
}
