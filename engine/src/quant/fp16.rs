//! `F16`: IEEE-754 half precision, one value per 2 bytes (converted exactly to `f32`).

use super::BlockFormat;
use crate::gguf::GgmlType;

/// The `F16` format.
pub struct Fp16;

impl BlockFormat for Fp16 {
    const TYPE: GgmlType = GgmlType::F16;
    const BLOCK_ELEMS: usize = 1;
    const BLOCK_BYTES: usize = 2;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        out[0] = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
    }
}
