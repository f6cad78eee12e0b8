//! `F32`: plain little-endian IEEE-754 single precision, one value per 4 bytes.

use super::{BlockFormat, dot_f32};
use crate::gguf::GgmlType;

/// The `F32` format.
pub struct Fp32;

impl BlockFormat for Fp32 {
    const TYPE: GgmlType = GgmlType::F32;
    const BLOCK_ELEMS: usize = 1;
    const BLOCK_BYTES: usize = 4;
    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        out[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
    }
}

/// Views little-endian `f32` bytes as `f32`s when aligned, or copies them into `scratch` otherwise.
pub(crate) fn as_f32s<'a>(src: &'a [u8], scratch: &'a mut Vec<f32>) -> &'a [f32] {
    // SAFETY: every bit pattern is a valid f32; align_to only yields the aligned middle part.
    let (pre, mid, post) = unsafe { src.align_to::<f32>() };
    if pre.is_empty() && post.is_empty() && cfg!(target_endian = "little") {
        mid
    } else {
        scratch.clear();
        scratch.extend(src.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        scratch
    }
}

/// Row dot product straight from the bytes (no per-element decode when the row is 4-byte aligned).
pub(crate) fn dot_row(src: &[u8], x: &[f32]) -> f32 {
    let mut scratch = Vec::new();
    dot_f32(as_f32s(src, &mut scratch), x)
}
