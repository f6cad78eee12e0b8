//! Weight block formats and the row kernels built on them.
//!
//! Every GGUF tensor type the engine computes with is one module implementing [`BlockFormat`]: how one block of
//! `BLOCK_ELEMS` values is stored in `BLOCK_BYTES` bytes, how it turns back into `f32`, and how it dots with `f32`
//! activations. The layouts are ggml's (`ggml-common.h`); the truth for each is the PyPI `gguf` package
//! (`gguf.quants`), against which the tests compare. [`Matrix`] is a weight matrix in any supported format with
//! row-parallel matrix-vector and matrix-matrix products.

mod bf16;
mod fp16;
mod fp32;
mod matrix;
mod q8_0;

pub use bf16::{Bf16, f32_to_bf16_bits};
pub use fp16::Fp16;
pub use fp32::Fp32;
pub use matrix::{Matrix, WeightBytes};
pub use q8_0::{Q8_0, quantize_row_q8_0};

use crate::gguf::GgmlType;

/// A GGUF block format: `BLOCK_ELEMS` consecutive values of a row stored in `BLOCK_BYTES` bytes.
pub trait BlockFormat {
    /// The GGUF type id this format implements.
    const TYPE: GgmlType;
    /// Values per block (1 for plain floats, 32 for Q8_0, 256 for K-quants).
    const BLOCK_ELEMS: usize;
    /// Bytes per block.
    const BLOCK_BYTES: usize;
    /// Decodes one block (`block.len() == BLOCK_BYTES`) into `out` (`out.len() == BLOCK_ELEMS`).
    fn dequantize_block(block: &[u8], out: &mut [f32]);
}

/// Errors of the quant module.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// The engine has no kernels for this GGUF type yet.
    #[error("tensor type {0} is not supported by the CPU kernels (supported: F32, F16, BF16, Q8_0)")]
    Unsupported(&'static str),
    /// A row's element count does not fill whole blocks of its type.
    #[error("a row of {cols} values is not a whole number of {ty} blocks of {block} values")]
    PartialBlock { ty: &'static str, cols: usize, block: usize },
    /// A byte buffer does not have the size its shape and type require.
    #[error("{what}: expected {expected} bytes for its shape and type, found {found}")]
    WrongSize { what: String, expected: usize, found: usize },
}

/// The two row kernels of one format, resolved once at load so the hot loops never branch on the type.
#[derive(Clone, Copy)]
pub struct RowKernels {
    /// Values per block.
    pub block_elems: usize,
    /// Bytes per block.
    pub block_bytes: usize,
    /// Decodes a whole row: `src` holds `dst.len() / block_elems` blocks.
    pub dequantize_row: fn(&[u8], &mut [f32]),
    /// Dot product of a whole row with `x` (`x.len()` values).
    pub dot_row: fn(&[u8], &[f32]) -> f32,
}

impl std::fmt::Debug for RowKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowKernels").field("block_elems", &self.block_elems).finish()
    }
}

fn dequantize_row_with<F: BlockFormat>(src: &[u8], dst: &mut [f32]) {
    for (block, out) in src.chunks_exact(F::BLOCK_BYTES).zip(dst.chunks_exact_mut(F::BLOCK_ELEMS)) {
        F::dequantize_block(block, out);
    }
}

/// Decodes the row into a per-thread buffer and takes an [`dot_f32`] with `x`: one summation order for every
/// format, so a matrix-vector product and a matrix-matrix product give bit-identical outputs.
fn dot_row_with<F: BlockFormat>(src: &[u8], x: &[f32]) -> f32 {
    thread_local! {
        static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    ROW.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.resize(x.len(), 0.0);
        dequantize_row_with::<F>(src, &mut buf);
        dot_f32(&buf, x)
    })
}

fn kernels_of<F: BlockFormat>() -> RowKernels {
    RowKernels {
        block_elems: F::BLOCK_ELEMS,
        block_bytes: F::BLOCK_BYTES,
        dequantize_row: dequantize_row_with::<F>,
        dot_row: dot_row_with::<F>,
    }
}

/// The row kernels for `ty`, or [`QuantError::Unsupported`].
pub fn row_kernels(ty: GgmlType) -> Result<RowKernels, QuantError> {
    Ok(match ty {
        GgmlType::F32 => RowKernels { dot_row: fp32::dot_row, ..kernels_of::<Fp32>() },
        GgmlType::F16 => kernels_of::<Fp16>(),
        GgmlType::BF16 => kernels_of::<Bf16>(),
        GgmlType::Q8_0 => kernels_of::<Q8_0>(),
        other => return Err(QuantError::Unsupported(other.name())),
    })
}

/// Bytes of one row of `cols` values of type `ty`, or an error if `cols` is not a whole number of blocks.
pub fn row_bytes(ty: GgmlType, cols: usize) -> Result<usize, QuantError> {
    let k = row_kernels(ty)?;
    if cols % k.block_elems != 0 {
        return Err(QuantError::PartialBlock { ty: ty.name(), cols, block: k.block_elems });
    }
    Ok(cols / k.block_elems * k.block_bytes)
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

/// `f32` dot product with eight independent accumulators (vectorizes; a fixed summation order, so the result
/// depends only on the inputs).
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
