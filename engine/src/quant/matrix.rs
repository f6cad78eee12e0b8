//! [`Matrix`]: a 2-D weight in any supported block format, with row-parallel products.

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use super::{ActFormat, ActRow, Activations, Isa, QuantError, RowKernels, row_bytes, row_kernels, row_kernels_for};
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
///
/// Products quantize the activations once per call into the format the weight type pairs with
/// ([`ActFormat`]), then take every row's dot product with the kernels of [`row_kernels`]; tokens go through in
/// tiles of 4 so each weight block is decoded once per tile. Each output is one row's dot product with one
/// token, computed the same way whatever the tile, the thread count or the instruction set, so
/// [`Matrix::matmul`] equals [`Matrix::matvec`] per token bit for bit.
#[derive(Clone, Debug)]
pub struct Matrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    kernels: RowKernels,
    data: WeightBytes,
}

/// An observer of the inputs of every product (importance-matrix collection, `nebula imatrix`): called with the
/// address of the weight's bytes, the input rows (`[n, cols]`) and `n`, from [`Matrix::matvec`],
/// [`Matrix::matmul`] and the MoE kernel ([`super::moe::routed_experts`]) when they are called on the thread that
/// installed it (a forward pass issues its products from its own thread), so other threads' models are not seen.
pub type ActObserver = Arc<dyn Fn(usize, &[f32], usize) + Send + Sync>;

thread_local! {
    static OBSERVER: std::cell::RefCell<Option<ActObserver>> = const { std::cell::RefCell::new(None) };
}
/// Threads with an observer installed (the fast path of every product reads only this).
static OBSERVERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Installs (`Some`) or removes (`None`) this thread's [`ActObserver`]. While no thread has one a product pays
/// one relaxed atomic load.
pub fn set_act_observer(o: Option<ActObserver>) {
    use std::sync::atomic::Ordering::Relaxed;
    let on = o.is_some();
    let was = OBSERVER.with(|c| std::mem::replace(&mut *c.borrow_mut(), o).is_some());
    match (was, on) {
        (false, true) => _ = OBSERVERS.fetch_add(1, Relaxed),
        (true, false) => _ = OBSERVERS.fetch_sub(1, Relaxed),
        _ => {}
    }
}

/// Whether this thread has an [`ActObserver`].
pub fn observing() -> bool {
    OBSERVERS.load(std::sync::atomic::Ordering::Relaxed) > 0 && OBSERVER.with(|c| c.borrow().is_some())
}

/// Rows handed to one rayon task: enough work to amortize scheduling, few enough to balance 16 cores.
const ROWS_PER_TASK: usize = 16;
/// Below this many weights a product runs on the calling thread.
const PARALLEL_MIN: usize = 1 << 15;

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

    /// The same matrix computing with instruction set `isa` at most (tests and benchmarks; the CPU must
    /// support it).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.kernels = row_kernels_for(self.ty, isa).expect("the type was accepted by Matrix::new");
        self
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
    /// The kernels in use.
    pub fn kernels(&self) -> &RowKernels {
        &self.kernels
    }
    /// The activation format of this matrix's products.
    pub fn act_format(&self) -> ActFormat {
        self.kernels.acts
    }
    /// The weight bytes.
    pub fn data(&self) -> &WeightBytes {
        &self.data
    }
    /// Raw bytes of row `r`.
    #[inline]
    pub fn row_bytes_of(&self, r: usize) -> &[u8] {
        &self.data.as_slice()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
    /// Row `r` decoded into `out` (`cols` values), bit-exact with `gguf.quants.dequantize`.
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

    /// Prepares `n` tokens `xs` (`[n, cols]`) for this matrix's kernels.
    pub fn prepare(&self, xs: &[f32], n: usize) -> Activations {
        Activations::new(self.kernels.acts, xs, self.cols, n)
    }

    /// Dot product of row `r` with `x` (`cols` values), through the same kernel as the products (this
    /// prepares `x` on every call; use [`Matrix::matvec`] for many rows).
    pub fn dot_row(&self, r: usize, x: &[f32]) -> f32 {
        let a = self.prepare(x, 1);
        let mut out = [0f32];
        (self.kernels.dot)(self.row_bytes_of(r), &[a.row(0)], &mut out);
        out[0]
    }

    /// Dot products of rows `rows` with the prepared tokens `tokens` of `acts`, written to `out` as
    /// `[rows.len(), tokens.len()]` (row-major), tokens in tiles of 4. Sequential: callers parallelize.
    #[inline]
    pub fn dot_rows(&self, rows: Range<usize>, acts: &Activations, tokens: Range<usize>, out: &mut [f32]) {
        let nt = tokens.len();
        debug_assert_eq!(out.len(), rows.len() * nt);
        if nt == 1 {
            let x = [acts.row(tokens.start)];
            for (o, r) in out.iter_mut().zip(rows) {
                (self.kernels.dot)(self.row_bytes_of(r), &x, std::slice::from_mut(o));
            }
            return;
        }
        // The token views of each tile, built once for all rows.
        let tiles: Vec<([ActRow<'_>; 4], usize)> = (0..nt)
            .step_by(4)
            .map(|t0| {
                let k = (nt - t0).min(4);
                (std::array::from_fn(|i| acts.row(tokens.start + t0 + i.min(k - 1))), k)
            })
            .collect();
        for (o, r) in out.chunks_exact_mut(nt).zip(rows) {
            let row = self.row_bytes_of(r);
            for (c, (tile, k)) in tiles.iter().enumerate() {
                (self.kernels.dot)(row, &tile[..*k], &mut o[4 * c..4 * c + k]);
            }
        }
    }

    /// Hands `xs` (`[n, cols]`, this matrix's inputs) to the installed [`ActObserver`], if any.
    pub fn observe_input(&self, xs: &[f32], n: usize) {
        if OBSERVERS.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            // Cloned out so that the observer may itself run products without a borrow conflict.
            if let Some(o) = OBSERVER.with(|c| c.borrow().clone()) {
                o(self.data.as_slice().as_ptr() as usize, xs, n);
            }
        }
    }

    /// `y = W x`: `x` has `cols` values, `y` gets `rows` values. Parallel over rows.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "matvec input length");
        assert_eq!(y.len(), self.rows, "matvec output length");
        self.observe_input(x, 1);
        let a = self.prepare(x, 1);
        self.matvec_prepared(&a, y);
    }

    /// `y = W x` with `x` already prepared (one token).
    pub fn matvec_prepared(&self, a: &Activations, y: &mut [f32]) {
        if self.rows * self.cols < PARALLEL_MIN {
            self.dot_rows(0..self.rows, a, 0..1, y);
            return;
        }
        y.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(chunk, out)| {
            let r0 = chunk * ROWS_PER_TASK;
            self.dot_rows(r0..r0 + out.len(), a, 0..1, out);
        });
    }

    /// `Y = X W^T` for `n` tokens: `xs` is `[n, cols]`, `ys` is `[n, rows]`. Parallel over rows, tokens in tiles
    /// of 4 per row; equals `n` calls of [`Matrix::matvec`] exactly.
    pub fn matmul(&self, xs: &[f32], n: usize, ys: &mut [f32]) {
        assert_eq!(xs.len(), n * self.cols, "matmul input length");
        assert_eq!(ys.len(), n * self.rows, "matmul output length");
        if n == 1 {
            return self.matvec(xs, ys);
        }
        self.observe_input(xs, n);
        let a = self.prepare(xs, n);
        // Compute the transpose [rows, n] in parallel row chunks, then scatter.
        let mut yt = vec![0f32; self.rows * n];
        if self.rows * self.cols < PARALLEL_MIN {
            self.dot_rows(0..self.rows, &a, 0..n, &mut yt);
        } else {
            yt.par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(|(chunk, out)| {
                let r0 = chunk * ROWS_PER_TASK;
                self.dot_rows(r0..r0 + out.len() / n, &a, 0..n, out);
            });
        }
        // The scatter is a copy; for a wide matrix (the head: 248,320 rows) it is worth threads of its own.
        let rows = self.rows;
        let scatter = |(t, out): (usize, &mut [f32])| {
            for (r, o) in out.iter_mut().enumerate() {
                *o = yt[r * n + t];
            }
        };
        if rows * n >= 1 << 16 {
            ys.par_chunks_mut(rows).enumerate().for_each(scatter);
        } else {
            ys.chunks_mut(rows).enumerate().for_each(scatter);
        }
    }
}
