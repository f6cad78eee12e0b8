//! [`Matrix`]: a 2-D weight in any supported block format, with row-parallel products.

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use super::{QuantError, RowKernels, row_bytes, row_kernels};
use crate::gguf::GgmlType;

/// Shared, immutable bytes of a weight: a range of some owner (a memory-mapped GGUF file, or an owned buffer).
#[derive(Clone)]
pub struct WeightBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
}

impl WeightBytes {
    /// Bytes `range` of `owner`. Errors if the range lies outside the owner.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Result<Self, QuantError> {
        let len = (*owner).as_ref().len();
        if range.start > range.end || range.end > len {
            return Err(QuantError::WrongSize { what: "weight range".into(), expected: range.end, found: len });
        }
        Ok(Self { owner, range })
    }

    /// Owns `bytes`.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self { owner: Arc::new(bytes), range: 0..len }
    }

    /// The bytes.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    /// A sub-range of these bytes (relative to their start).
    pub fn slice(&self, range: Range<usize>) -> Result<Self, QuantError> {
        if range.start > range.end || range.end > self.range.len() {
            return Err(QuantError::WrongSize {
                what: "weight sub-range".into(),
                expected: range.end,
                found: self.range.len(),
            });
        }
        Ok(Self { owner: self.owner.clone(), range: self.range.start + range.start..self.range.start + range.end })
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.range.len())
    }
}

/// A `rows x cols` weight matrix (PyTorch `nn.Linear.weight` orientation: `y = W x`, `W` is `[out, in]`;
/// GGUF stores it as `ne = [cols, rows]`), each row `row_bytes` bytes of blocks of `ty`.
#[derive(Clone, Debug)]
pub struct Matrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    kernels: RowKernels,
    data: WeightBytes,
}

/// Rows handed to one rayon task: enough work to amortize scheduling, few enough to balance 16 cores.
const ROWS_PER_TASK: usize = 16;

impl Matrix {
    /// A matrix over `data`, which must hold exactly `rows` rows of `cols` values of type `ty`.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: WeightBytes) -> Result<Self, QuantError> {
        let kernels = row_kernels(ty)?;
        let rb = row_bytes(ty, cols)?;
        let expected = rb.checked_mul(rows).ok_or(QuantError::WrongSize {
            what: "matrix".into(),
            expected: usize::MAX,
            found: data.len(),
        })?;
        if data.len() != expected {
            return Err(QuantError::WrongSize { what: "matrix".into(), expected, found: data.len() });
        }
        Ok(Self { ty, rows, cols, row_bytes: rb, kernels, data })
    }

    /// Output size.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input size.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Storage type.
    pub fn ggml_type(&self) -> GgmlType {
        self.ty
    }
    /// All the bytes, rows one after another.
    pub fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }
    /// Raw bytes of row `r`.
    #[inline]
    pub fn row_bytes_of(&self, r: usize) -> &[u8] {
        &self.data.as_slice()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
    /// Row `r` decoded into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        (self.kernels.dequantize_row)(self.row_bytes_of(r), out);
    }
    /// The whole matrix decoded, row-major `[rows, cols]`.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, o);
        }
        out
    }
    /// Dot product of row `r` with `x` (`cols` values).
    #[inline]
    pub fn dot_row(&self, r: usize, x: &[f32]) -> f32 {
        (self.kernels.dot_row)(self.row_bytes_of(r), x)
    }

    /// `y = W x`: `x` has `cols` values, `y` gets `rows` values. Parallel over rows; each output is one row's dot
    /// product, so the result does not depend on the thread count.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "matvec input length");
        assert_eq!(y.len(), self.rows, "matvec output length");
        if self.rows * self.cols < 1 << 15 {
            for (r, o) in y.iter_mut().enumerate() {
                *o = self.dot_row(r, x);
            }
            return;
        }
        y.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(chunk, out)| {
            let r0 = chunk * ROWS_PER_TASK;
            for (i, o) in out.iter_mut().enumerate() {
                *o = self.dot_row(r0 + i, x);
            }
        });
    }

    /// `Y = X W^T` for `n` tokens: `xs` is `[n, cols]`, `ys` is `[n, rows]`. Each row is decoded once and reused
    /// across the tokens; the result equals `n` calls of [`Matrix::matvec`] exactly.
    pub fn matmul(&self, xs: &[f32], n: usize, ys: &mut [f32]) {
        assert_eq!(xs.len(), n * self.cols, "matmul input length");
        assert_eq!(ys.len(), n * self.rows, "matmul output length");
        if n == 1 {
            return self.matvec(xs, ys);
        }
        // Compute the transpose [rows, n] in parallel row chunks, then scatter.
        let mut yt = vec![0f32; self.rows * n];
        let is_f32 = self.ty == GgmlType::F32;
        yt.par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(|(chunk, out)| {
            let r0 = chunk * ROWS_PER_TASK;
            let mut scratch = Vec::new();
            let mut row = Vec::new();
            for (i, o) in out.chunks_exact_mut(n).enumerate() {
                let r = r0 + i;
                let w: &[f32] = if is_f32 {
                    super::fp32::as_f32s(self.row_bytes_of(r), &mut scratch)
                } else {
                    row.resize(self.cols, 0.0);
                    self.dequantize_row(r, &mut row);
                    &row
                };
                for (t, v) in o.iter_mut().enumerate() {
                    *v = super::dot_f32(w, &xs[t * self.cols..(t + 1) * self.cols]);
                }
            }
        });
        for r in 0..self.rows {
            for t in 0..n {
                ys[t * self.rows + r] = yt[r * n + t];
            }
        }
    }
}
