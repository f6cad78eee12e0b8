//! Weight block formats and the CPU kernels built on them.
//!
//! Every GGUF tensor type the engine computes with is one module implementing [`BlockFormat`]: how one block of
//! `BLOCK_ELEMS` values is stored in `BLOCK_BYTES` bytes (ggml `ggml-common.h` layouts), how it turns back into
//! `f32` (bit-exact with the PyPI `gguf` package's `gguf.quants.dequantize`, checked by fixtures), and how a row
//! of blocks dots with activations. The activations are prepared once per token in the format ggml pairs with
//! the weight type ([`ActFormat`]: `f32`, 8-bit blocks of 32, or 8-bit super-blocks of 256).
//!
//! # Dot-product semantics (identical on every instruction set)
//! Each kernel first forms exact integer sums (levels x quantized activations, with the format's integer
//! sub-block scales), then turns each block into one `f32` term with the format's scales in a fixed order of
//! `f32` operations (no fused multiply-add), and adds block `b`'s term into accumulator `b % 4`; the row's
//! result is `(a0 + a1) + (a2 + a3)`. Plain float rows (F32/F16/BF16) accumulate element `i` into lane `i % 16`
//! and reduce the 16 lanes as a fixed tree. The scalar, AVX2 and AVX-512 paths ([`Isa`]) follow this to the
//! bit, so their outputs are identical and a matrix product never depends on the path or thread count.
//!
//! [`Matrix`] is a weight matrix in any supported format with row-parallel products; [`moe`] is the fused
//! routed-expert kernel; [`quantize`] holds the quantizers used by the converter.

// Kernels index blocks, runs and lanes by position, as the format layouts are written.
#![allow(clippy::needless_range_loop)]

mod acts;
mod bf16;
mod blocks32;
mod fp16;
mod fp32;
pub mod grids;
mod iq1_m;
mod iq1_s;
mod iq2_s;
mod iq2_xs;
mod iq2_xxs;
mod iq3_s;
mod iq3_xxs;
mod iq4_nl;
mod iq4_xs;
mod isa;
mod matrix;
pub mod moe;
mod mxfp4;
mod q2_k;
mod q3_k;
mod q4_0;
mod q4_1;
mod q4_k;
mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
mod q8_0;
pub mod quantize;
mod simd;
pub mod spin_pool;
#[cfg(test)]
mod tests;
mod unpacked;

pub use acts::{ActFormat, ActRow, Activations};
pub use bf16::{Bf16, f32_to_bf16_bits};
pub use fp16::Fp16;
pub use fp32::Fp32;
pub use iq1_m::Iq1M;
pub use iq1_s::Iq1S;
pub use iq2_s::Iq2S;
pub use iq2_xs::Iq2Xs;
pub use iq2_xxs::Iq2Xxs;
pub use iq3_s::Iq3S;
pub use iq3_xxs::Iq3Xxs;
pub use iq4_nl::Iq4Nl;
pub use iq4_xs::Iq4Xs;
pub use isa::Isa;
pub use matrix::{ActObserver, Matrix, WeightBytes, observing, set_act_observer};
pub use mxfp4::Mxfp4;
pub use q2_k::Q2K;
pub use q3_k::Q3K;
pub use q4_0::Q4_0;
pub use q4_1::Q4_1;
pub use q4_k::Q4K;
pub use q5_0::Q5_0;
pub use q5_1::Q5_1;
pub use q5_k::Q5K;
pub use q6_k::Q6K;
pub use q8_0::{Q8_0, quantize_row_q8_0};

use crate::gguf::GgmlType;

/// Values per super-block of the k-quants and most i-quants.
pub const QK_K: usize = 256;

/// A GGUF block format: `BLOCK_ELEMS` consecutive values of a row stored in `BLOCK_BYTES` bytes.
pub trait BlockFormat {
    /// The GGUF type id this format implements.
    const TYPE: GgmlType;
    /// Values per block (1 for plain floats, 32 for the `*_0`/`*_1`/IQ4_NL/MXFP4 blocks, 256 for k-/i-quants).
    const BLOCK_ELEMS: usize;
    /// Bytes per block.
    const BLOCK_BYTES: usize;
    /// The activation format its dot products take.
    const ACTS: ActFormat;
    /// Decodes one block (`block.len() == BLOCK_BYTES`) into `out` (`out.len() == BLOCK_ELEMS`), bit-exact with
    /// `gguf.quants.dequantize`.
    fn dequantize_block(block: &[u8], out: &mut [f32]);
    /// Whether the block's scale fields are finite (what load-time validation checks; plain floats: true).
    fn scales_finite(block: &[u8]) -> bool;
    /// Scalar reference dot products: `out[t] = row . xs[t]` for `xs.len() <= 4` tokens (the semantics every
    /// SIMD path reproduces bit for bit).
    fn dot_scalar(row: &[u8], xs: &[ActRow<'_>], out: &mut [f32]);
}

/// Errors of the quant module.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// The engine has no kernels for this GGUF type.
    #[error(
        "tensor type {0} is not supported by the CPU kernels (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, \
         Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, \
         MXFP4)"
    )]
    Unsupported(&'static str),
    /// A row's element count does not fill whole blocks of its type.
    #[error("a row of {cols} values is not a whole number of {ty} blocks of {block} values")]
    PartialBlock { ty: &'static str, cols: usize, block: usize },
    /// A byte buffer does not have the size its shape and type require.
    #[error("{what}: expected {expected} bytes for its shape and type, found {found}")]
    WrongSize { what: String, expected: usize, found: usize },
    /// A block's scale decodes to NaN or infinity.
    #[error("{ty} block {block} (row {row}) has a non-finite scale")]
    NonFiniteScale { ty: &'static str, row: usize, block: usize },
}

/// Dot products of one weight row with up to four tokens' activations: `out[t] = row . xs[t]`.
pub type DotFn = fn(&[u8], &[ActRow<'_>], &mut [f32]);

/// The kernels of one format for one instruction set, resolved once so hot loops never branch on the type.
#[derive(Clone, Copy)]
pub struct RowKernels {
    /// The type.
    pub ty: GgmlType,
    /// Values per block.
    pub block_elems: usize,
    /// Bytes per block.
    pub block_bytes: usize,
    /// Activation format of `dot`.
    pub acts: ActFormat,
    /// The instruction set of `dot`.
    pub isa: Isa,
    /// Decodes a whole row: `src` holds `dst.len() / block_elems` blocks.
    pub dequantize_row: fn(&[u8], &mut [f32]),
    /// Whether one block's scales are finite.
    pub scales_finite: fn(&[u8]) -> bool,
    /// Row dot products with up to 4 tokens.
    pub dot: DotFn,
}

impl std::fmt::Debug for RowKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowKernels").field("ty", &self.ty.name()).field("isa", &self.isa).finish()
    }
}

fn dequantize_row_with<F: BlockFormat>(src: &[u8], dst: &mut [f32]) {
    for (block, out) in src.chunks_exact(F::BLOCK_BYTES).zip(dst.chunks_exact_mut(F::BLOCK_ELEMS)) {
        F::dequantize_block(block, out);
    }
}

/// A format's kernels: the scalar dot, or the SIMD ones given for `isa` (each `(Isa, DotFn)` pair lists a path
/// the format has; the best one not above `isa` wins).
fn kernels_of<F: BlockFormat>(isa: Isa, simd: &[(Isa, DotFn)]) -> RowKernels {
    let mut dot: DotFn = F::dot_scalar;
    let mut chosen = Isa::Scalar;
    for &(level, f) in simd {
        if level <= isa && level > chosen {
            dot = f;
            chosen = level;
        }
    }
    RowKernels {
        ty: F::TYPE,
        block_elems: F::BLOCK_ELEMS,
        block_bytes: F::BLOCK_BYTES,
        acts: F::ACTS,
        isa: chosen,
        dequantize_row: dequantize_row_with::<F>,
        scales_finite: F::scales_finite,
        dot,
    }
}

/// Every type the CPU kernels support.
pub const SUPPORTED: [GgmlType; 23] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

/// The kernels for `ty` on the detected instruction set ([`Isa::detect`]), or [`QuantError::Unsupported`].
pub fn row_kernels(ty: GgmlType) -> Result<RowKernels, QuantError> {
    row_kernels_for(ty, Isa::detect())
}

/// The kernels for `ty` using at most instruction set `isa` (which must be supported by this CPU; see
/// [`Isa::available`]). For tests and benchmarks that compare paths.
pub fn row_kernels_for(ty: GgmlType, isa: Isa) -> Result<RowKernels, QuantError> {
    assert!(isa.supported(), "instruction set {isa} is not available on this CPU");
    macro_rules! k {
        ($f:ty, $m:ident) => {
            kernels_of::<$f>(isa, &$m::SIMD)
        };
    }
    Ok(match ty {
        GgmlType::F32 => k!(Fp32, fp32),
        GgmlType::F16 => k!(Fp16, fp16),
        GgmlType::BF16 => k!(Bf16, bf16),
        GgmlType::Q4_0 => k!(Q4_0, q4_0),
        GgmlType::Q4_1 => k!(Q4_1, q4_1),
        GgmlType::Q5_0 => k!(Q5_0, q5_0),
        GgmlType::Q5_1 => k!(Q5_1, q5_1),
        GgmlType::Q8_0 => k!(Q8_0, q8_0),
        GgmlType::Q2_K => k!(Q2K, q2_k),
        GgmlType::Q3_K => k!(Q3K, q3_k),
        GgmlType::Q4_K => k!(Q4K, q4_k),
        GgmlType::Q5_K => k!(Q5K, q5_k),
        GgmlType::Q6_K => k!(Q6K, q6_k),
        GgmlType::IQ1_S => k!(Iq1S, iq1_s),
        GgmlType::IQ1_M => k!(Iq1M, iq1_m),
        GgmlType::IQ2_XXS => k!(Iq2Xxs, iq2_xxs),
        GgmlType::IQ2_XS => k!(Iq2Xs, iq2_xs),
        GgmlType::IQ2_S => k!(Iq2S, iq2_s),
        GgmlType::IQ3_XXS => k!(Iq3Xxs, iq3_xxs),
        GgmlType::IQ3_S => k!(Iq3S, iq3_s),
        GgmlType::IQ4_NL => k!(Iq4Nl, iq4_nl),
        GgmlType::IQ4_XS => k!(Iq4Xs, iq4_xs),
        GgmlType::MXFP4 => k!(Mxfp4, mxfp4),
        other => return Err(QuantError::Unsupported(other.name())),
    })
}

/// Bytes of one row of `cols` values of type `ty`, or an error if `cols` is not a whole number of blocks.
pub fn row_bytes(ty: GgmlType, cols: usize) -> Result<usize, QuantError> {
    if !SUPPORTED.contains(&ty) {
        return Err(QuantError::Unsupported(ty.name()));
    }
    if !cols.is_multiple_of(ty.block_size()) {
        return Err(QuantError::PartialBlock { ty: ty.name(), cols, block: ty.block_size() });
    }
    Ok(cols / ty.block_size() * ty.type_size())
}

/// Decodes one row of type `ty` into `dst` (`dst.len()` values).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let k = row_kernels(ty)?;
    let expected = row_bytes(ty, dst.len())?;
    if src.len() != expected {
        return Err(QuantError::WrongSize { what: "row".into(), expected, found: src.len() });
    }
    (k.dequantize_row)(src, dst);
    Ok(())
}

/// Checks that every block of `data` (whole rows of `cols` values of type `ty`) has finite scales; reports the
/// first bad block. Reads one scale field per block, in parallel over chunks of rows.
pub fn check_scales(ty: GgmlType, data: &[u8], cols: usize) -> Result<(), QuantError> {
    use rayon::prelude::*;
    if !ty.is_quantized() {
        return Ok(());
    }
    let k = row_kernels(ty)?;
    let rb = row_bytes(ty, cols)?;
    if rb == 0 || !data.len().is_multiple_of(rb) {
        return Err(QuantError::WrongSize { what: "tensor".into(), expected: rb, found: data.len() });
    }
    const ROWS: usize = 256;
    let bad = data.par_chunks(rb * ROWS).enumerate().find_map_first(|(c, chunk)| {
        chunk.chunks_exact(k.block_bytes).position(|b| !(k.scales_finite)(b)).map(|i| {
            let global = c * ROWS * (rb / k.block_bytes) + i;
            let per_row = rb / k.block_bytes;
            (global / per_row, global % per_row)
        })
    });
    match bad {
        Some((row, block)) => Err(QuantError::NonFiniteScale { ty: ty.name(), row, block }),
        None => Ok(()),
    }
}

/// `f32` dot product with eight independent accumulators (vectorizes; a fixed summation order, so the result
/// depends only on the inputs). Used by the model for small vector ops, not for weight rows.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Little-endian `f16` at `b[off..off + 2]`, as `f32` (exact).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Whether the `f16` at `b[off..off + 2]` is finite.
#[inline(always)]
pub(crate) fn f16_finite_at(b: &[u8], off: usize) -> bool {
    u16::from_le_bytes([b[off], b[off + 1]]) & 0x7c00 != 0x7c00
}

/// The per-block accumulator of the dot-product semantics: block `b` adds into lane `b % 4`.
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct Acc4(pub [f32; 4]);

impl Acc4 {
    #[inline(always)]
    pub fn add(&mut self, b: usize, v: f32) {
        self.0[b & 3] += v;
    }
    #[inline(always)]
    pub fn sum(self) -> f32 {
        (self.0[0] + self.0[1]) + (self.0[2] + self.0[3])
    }
}

/// The 16-lane float reduction tree of plain float rows: lanes `i` and `i + 8`, then `i + 4`, `i + 2`, `i + 1`.
#[inline(always)]
pub(crate) fn reduce16(a: &[f32; 16]) -> f32 {
    let mut s = [0f32; 8];
    for i in 0..8 {
        s[i] = a[i] + a[i + 8];
    }
    let t = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    let u = [t[0] + t[2], t[1] + t[3]];
    u[0] + u[1]
}

/// Byte offsets of the `f16` scale fields in one block of `ty` (for synthetic data; IQ1_M keeps its scale in
/// four nibbles and MXFP4 an exponent byte, handled by [`synthetic_blocks`]).
fn f16_scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::IQ1_S
        | GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ3_XXS
        | GgmlType::IQ3_S => &[0],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// `n_blocks` blocks of `ty` with pseudo-random levels and every scale set to `scale` (a normal `f16`
/// value), for benchmarks and tests of types the converter cannot write. Plain float types get random values
/// of magnitude below `scale * 8`.
pub fn synthetic_blocks(ty: GgmlType, n_blocks: usize, scale: f32, seed: u64) -> Vec<u8> {
    let bs = ty.type_size();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let d = half::f16::from_f32(scale).to_bits().to_le_bytes();
    match ty {
        GgmlType::F32 => {
            return (0..n_blocks)
                .flat_map(|_| ((next() >> 40) as f32 * scale / (1 << 21) as f32).to_le_bytes())
                .collect();
        }
        GgmlType::F16 | GgmlType::BF16 => {
            return (0..n_blocks)
                .flat_map(|_| {
                    let v = ((next() >> 40) as f32 / (1 << 24) as f32 - 0.5) * scale * 8.0;
                    if ty == GgmlType::F16 {
                        half::f16::from_f32(v).to_le_bytes()
                    } else {
                        f32_to_bf16_bits(v).to_le_bytes()
                    }
                })
                .collect();
        }
        _ => {}
    }
    let mut out = vec![0u8; n_blocks * bs];
    for chunk in out.chunks_mut(8) {
        let v = next().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    for b in out.chunks_exact_mut(bs) {
        for &off in f16_scale_offsets(ty) {
            b[off..off + 2].copy_from_slice(&d);
        }
        match ty {
            GgmlType::MXFP4 => b[0] = 120,
            GgmlType::IQ1_M => {
                let bits = u16::from_le_bytes(d);
                for k in 0..4 {
                    let w =
                        u16::from_le_bytes([b[48 + 2 * k], b[49 + 2 * k]]) & 0x0fff | (((bits >> (4 * k)) & 15) << 12);
                    b[48 + 2 * k..50 + 2 * k].copy_from_slice(&w.to_le_bytes());
                }
            }
            _ => {}
        }
    }
    out
}
