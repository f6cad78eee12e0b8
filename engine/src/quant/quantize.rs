//! Quantizers for the converter: `f32` rows to GGUF block formats.
//!
//! Bit-exact with the PyPI `gguf` package (`gguf.quants.quantize`): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 and
//! BF16. The k-quants (Q4_K, Q5_K, Q6_K) and the non-linear 4-bit types (IQ4_NL, IQ4_XS) follow the reference
//! algorithms of ggml's `ggml-quants.c` (written here from their description, not copied): a weighted
//! least-squares search for each block's scale (and min), with an optional importance matrix.

pub use super::mxfp4::quantize_row_mxfp4;
pub use super::q4_0::quantize_row_q4_0;
pub use super::q4_1::quantize_row_q4_1;
pub use super::q5_0::quantize_row_q5_0;
pub use super::q5_1::quantize_row_q5_1;
pub use super::q8_0::quantize_row_q8_0;

/// The value of largest magnitude (the first one among equals), as numpy's `argmax(abs(x))` picks it.
pub(crate) fn signed_absmax(x: &[f32]) -> f32 {
    let mut best = 0f32;
    let mut amax = -1f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            best = v;
        }
    }
    best
}

/// `(min, max)` of a block.
pub(crate) fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}
