//! GEMV launch geometry and the 8-bit activation helpers: every matrix product of the model goes through
//! [`Launch::matmul`] (decode-sized batches on the quantized GEMV kernels, mid-size fast batched passes on the
//! tiled GEMV [`Launch::gemvqm`], larger ones on tensor cores or cuBLAS), and the routed experts through
//! [`Launch::moe_gemv`] (decode), [`Launch::moe_gemvqg`] (mid-size fast batched passes, grouped by expert) and
//! [`Launch::moe_grouped`] (prefill, grouped by expert). Threads per row depend on the matrix only, never on the token count, so a verify pass's rows sum in a
//! decode step's order (batch invariance).

use super::CudaError;
use super::device::{Arg, ptr, type_suffix};
use super::launch::Launch;
use super::memory::zeros;
use super::weights::{DevMatrix, DevStack, MatRef, StackView};
use crate::gguf::GgmlType;

/// Tokens up to which matrix products use the GEMV kernels (weights read once for all of them).
pub(crate) const GEMV_MAX_TOKENS: usize = 8;
/// The tensor-core grouped expert kernel's tile (kernels/cuda/gemv.cu `MMA_ROWS`, `MMA_SLOTS`, `MMA_K`): rows per
/// block, slots per tile, columns per step.
const MMA_ROWS: usize = 128;
pub(crate) const MMA_SLOTS: usize = 32;
pub(crate) const MMA_K: usize = 128;
/// Largest weight block dequantized at once for the SGEMM path, in values (64 Mi floats = 256 MiB).
const DEQUANT_CHUNK: usize = 64 << 20;

/// The launch size below which a decode GEMV widens its rows ([`Launch::gemv_lanes`]): fixed for routed
/// experts (wider expert rows measured slower on the H200: 15.6 against 11.3 us for a layer's gate/up at 32 and 8
/// threads per row), the default for dense matrices ([`crate::tuning::CudaTuning::gemv_min_threads`]).
const GEMV_MIN_THREADS: usize = 1 << 15;

/// The launch size (threads, at [`Launch::gemv_lanes`]' width) from which a dense GEMV keeps the shallow
/// prefetch with a GEMV depth of 4: about the threads an H200 holds at once (132 SMs x 2048); the output
/// head (248,320 rows) measured slower deep (Nsight Compute: 141 against 122 us).
const DEEP_MAX_THREADS: usize = 1 << 18;

/// Threads per weight row of the mid-size kernels (`gemvqm_*`, `moe_gemvqg_*`): [`Launch::gemv_lanes`]'s choice
/// for `tasks` per row and `rows` rows per token, at most a warp (the kernels sum a row's partial sums with warp
/// shuffles only).
pub(crate) fn mid_lanes(tasks: usize, rows: usize, min_threads: usize) -> usize {
    Launch::gemv_lanes(tasks, rows, min_threads).min(32)
}

/// The grid of a grouped expert launch (`moe_gemvqg_*`, 128-thread blocks of `128 / lanes` weight rows): the
/// row groups of a matrix of `rows`, one y per entry of the sort plan's active list (`experts`, the most experts
/// that can have slots), z = 2 for gate and up in one launch.
pub(crate) fn grouped_grid(rows: usize, lanes: usize, experts: usize, both: bool) -> (u32, u32, u32) {
    (rows.div_ceil(128 / lanes) as u32, experts.max(1) as u32, if both { 2 } else { 1 })
}

/// Token slots grouped by expert on the device (`moe_sort`, [`Launch::sort_plan`]): `offsets` (`[count + 1]`
/// i32: expert `e`'s slots are `perm[offsets[e] .. offsets[e + 1]]`, ascending), `perm` (`[slots]` i32, the
/// slots with a valid id first), `active` (`[experts]` i32: the experts with slots in id order, then -1) and
/// `experts` = min(count, slots), the length of `active`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SortPlan {
    pub(crate) offsets: u64,
    pub(crate) perm: u64,
    pub(crate) active: u64,
    pub(crate) experts: usize,
}

/// The most columns a GEMV prologue quantizes (gemv.cu `PRO_MAX_COLS`).
pub(crate) const PRO_MAX_COLS: usize = 2560;

/// What a quantized activation buffer was made from: (x, rows, cols, block, the device's write count).
type Q8Key = (u64, usize, usize, usize, u64);

/// The last quantized activations: (what they were made from, (qx, dx)).
pub(crate) type Q8Cache = Option<(Q8Key, (u64, u64))>;

/// The 8-bit form of rows of activations that a fused kernel writes for its consumer: int8 values `qx`, f32
/// scales per 32 `dx`, quantization block `blk`.
pub(crate) type Q8Out = (u64, u64, usize);

/// A GEMV's input rows on the device: f32, or quantized to 8 bits (int8 values, f32 scales per 32), or f32 rows
/// that the 8-bit GEMV's blocks turn into the activation and quantize themselves (`gemvqp_*`, `moe_gemvqp_*`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Acts {
    F32(u64),
    Q8(u64, u64),
    Pro(Pro),
}

/// The input of a GEMV with a prologue (gemv.cu `ProIn`, `quantize_prologue`): with `x2` not 0 the SwiGLU
/// hidden layer `silu(x) * x2`; with `x2 = 0` the hyper-connection activation `silu(x * scale)`, and then block
/// 0 also writes `aux[s] = 2 sigmoid(x[cols + s] * scale)` for `s < aux_n` (0 = none). Quantized in blocks of `blk`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pro {
    pub(crate) x: u64,
    pub(crate) x2: u64,
    pub(crate) scale: f32,
    pub(crate) blk: usize,
    pub(crate) aux: u64,
    pub(crate) aux_n: usize,
}

/// The activation block of the types with 8-bit GEMV kernels (`gemvq_*`, `moe_gemvq_*`, `gemvqp_*`,
/// `moe_groupedq_*`, `moe_groupedmma_*`), whatever the tuning: see [`Launch::q8_block`].
pub(crate) fn q8_type_block(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q8_0
        | GgmlType::Q4_0
        | GgmlType::Q5_0
        | GgmlType::IQ4_NL
        | GgmlType::Q4_1
        | GgmlType::Q5_1
        | GgmlType::MXFP4 => Some(32),
        GgmlType::Q4_K
        | GgmlType::Q5_K
        | GgmlType::IQ4_XS
        | GgmlType::IQ2_XXS
        | GgmlType::IQ3_XXS
        | GgmlType::IQ3_S
        | GgmlType::IQ1_S
        | GgmlType::Q2_K
        | GgmlType::Q3_K
        | GgmlType::Q6_K
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ1_M => Some(256),
        _ => None,
    }
}

/// Whether the mid-size kernels (`gemvqm_*`, `moe_gemvqg_*`, kernels/cuda/gemv_grouped.cu) exist for `ty`: every
/// type with an 8-bit path ([`q8_type_block`]; gemv_grouped.cu instantiates each of them on its `QRaw` decoder, and
/// `every_cpu_type_has_each_kernel_a_launch_asks_for` fails for a type it misses).
pub(crate) fn mid_type(ty: GgmlType) -> bool {
    q8_type_block(ty).is_some()
}

impl Launch {
    /// The activation block of the 8-bit GEMV path for weights of type `ty` with `cols` columns (32 for the
    /// 32-value formats, 256 for the 256-value super-blocks, as `engine/src/quant/acts.rs` pairs them), or `None`
    /// for f32 activations: every quantized type (gemv.cu `QRaw`, kernels/cuda/lowbit_q8.cuh; Q2_K, Q3_K, Q6_K,
    /// IQ2_XS, IQ2_S and IQ1_M with their integer run scales per 16 values); F32, F16 and BF16 weights multiply
    /// f32 activations.
    pub(crate) fn q8_block(&self, ty: GgmlType, cols: usize) -> Option<usize> {
        let blk = q8_type_block(ty)?;
        (self.flags.q8_acts && cols.is_multiple_of(blk)).then_some(blk)
    }

    /// Tasks (the unit one thread decodes at a time: a 32-value chunk, 64 values for Q4_K and Q5_K on 8-bit
    /// activations)
    /// per row of `cols` weights of type `ty`.
    pub(crate) fn tasks_per_row(ty: GgmlType, cols: usize, q8: bool) -> usize {
        let per_task = if q8 && matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K) { 64 } else { 32 };
        (cols / per_task).max(1)
    }

    /// Threads per row of the grouped (prefill) 8-bit expert GEMV: about four tasks per thread, at most a warp.
    pub(crate) fn q8_lanes(ty: GgmlType, cols: usize) -> usize {
        let want = (Self::tasks_per_row(ty, cols, true) / 4).max(1);
        (1usize << want.ilog2()).min(32)
    }

    /// Threads per row of the decode GEMVs (`gemv*`, `moe_gemv*`; `tasks` per row; `rows` rows per token: a
    /// matrix's rows, times the slots per token for routed experts; 128-thread blocks): about four tasks per
    /// thread within a warp, which reads large matrices fastest (measured with ncu on the H200: the output head,
    /// experts); a launch with fewer than `min_threads` threads that way (a router, a hyper-connection
    /// projection, a one-row gate) widens its rows, up to a whole block per row, so enough loads are in flight.
    /// It depends on the matrix only, never on the number of tokens (batch invariance of the verify pass).
    pub(crate) fn gemv_lanes(tasks: usize, rows: usize, min_threads: usize) -> usize {
        let mut lanes = (1usize << (tasks / 4).max(1).ilog2()).min(32);
        while lanes < 128 && lanes * 2 <= tasks && rows * lanes < min_threads {
            lanes *= 2;
        }
        lanes
    }

    /// Threads per row of a dense decode GEMV (`tasks` per row, `rows` rows per token), and whether its one-token
    /// launch takes the deep-prefetch kernel (`gemvqd_*`): [`Self::gemv_lanes`] with the configured launch size;
    /// with `gemv_deep`, a launch of fewer than `DEEP_MAX_THREADS` threads that way (every matrix but the output
    /// head and the like, whose threads already outnumber what the GPU holds at once) widens its rows to at least
    /// `tasks / 4` threads (a power of two, at most 128), so each thread's tasks are all in flight at once. It
    /// depends on the matrix only, as `gemv_lanes` does, so every token count sums in the same order.
    pub(crate) fn dense_lanes(&self, tasks: usize, rows: usize) -> (usize, bool) {
        let lanes = Self::gemv_lanes(tasks, rows, self.flags.gemv_min_threads);
        if self.flags.gemv_deep && rows * lanes < DEEP_MAX_THREADS {
            (lanes.max(tasks.div_ceil(4).next_power_of_two().min(128)), true)
        } else {
            (lanes, false)
        }
    }

    /// Quantizes `x` (`[n][cols]` f32) to 8 bits per block of `blk`: (int8 `[n][cols]`, f32 scales `[n][cols/32]`).
    /// A vector quantized earlier in the same pass is reused while no other kernel ran in between (a GEMV only
    /// writes a fresh output, so `x` is unchanged).
    pub(crate) fn quantize_act(&self, x: u64, n: usize, cols: usize, blk: usize) -> Result<(u64, u64), CudaError> {
        let writes = self.dev.writes.load(std::sync::atomic::Ordering::Relaxed);
        let key = (x, n, cols, blk, writes);
        let mut cache = self.q8_cache.lock().expect("q8 cache lock");
        if let Some((k, out)) = *cache
            && k == key
        {
            return Ok(out);
        }
        let qx = self.tmp((n * cols).div_ceil(4))?;
        let dx = self.tmp(n * cols / 32)?;
        self.dev.launch(
            "quantize_act",
            ((cols / blk) as u32, n as u32, 1),
            blk as u32,
            &[Arg::Ptr(x), Arg::I32(cols as i32), Arg::Ptr(qx), Arg::Ptr(dx)],
        )?;
        *cache = Some((key, (qx, dx)));
        Ok((qx, dx))
    }

    /// Arena buffers for the 8-bit form of `n` rows of `cols` activations (`qx`, `dx`, block) that a fused kernel
    /// writes for a consumer of type `ty`; `None` when that consumer multiplies f32 activations.
    pub(crate) fn q8_outputs(&self, ty: GgmlType, n: usize, cols: usize) -> Result<Option<Q8Out>, CudaError> {
        match self.q8_block(ty, cols) {
            Some(blk) => Ok(Some((self.tmp((n * cols).div_ceil(4))?, self.tmp(n * cols / 32)?, blk))),
            None => Ok(None),
        }
    }

    /// The trailing `qx, dx, blk` kernel arguments for [`Self::q8_outputs`] (null pointers: no 8-bit form).
    pub(crate) fn q8_args(q: Option<Q8Out>) -> [Arg; 3] {
        let (qx, dx, blk) = q.unwrap_or((0, 0, 0));
        [Arg::Ptr(qx), Arg::Ptr(dx), Arg::I32(blk as i32)]
    }

    /// Records that the kernel launched last wrote the 8-bit form of `x` (`[n][cols]`) into `q`, so the next
    /// [`Self::quantize_act`] of `x` with that block reuses it while no other kernel has run.
    pub(crate) fn q8_produced(&self, x: u64, n: usize, cols: usize, q: Option<Q8Out>) {
        if let Some((qx, dx, blk)) = q {
            let writes = self.dev.writes.load(std::sync::atomic::Ordering::Relaxed);
            *self.q8_cache.lock().expect("q8 cache lock") = Some(((x, n, cols, blk, writes), (qx, dx)));
        }
    }

    /// `y[n][rows] = x[n][cols] . W^T`.
    pub(crate) fn matmul(&self, w: MatRef, x: u64, n: usize, y: u64) -> Result<(), CudaError> {
        if n <= GEMV_MAX_TOKENS
            || self.exact()
            || (self.mid(n) && mid_type(w.ty) && self.q8_block(w.ty, w.cols).is_some())
        {
            // 8-bit activations where the type has an integer path (`gemvq_*`: x is (qx, dx)), else f32 (`gemv_*`).
            let xa = self.acts(w.ty, x, n, w.cols)?;
            self.gemv(w, xa, n, y)
        } else {
            self.matmul_batch(w, x, n, y)
        }
    }

    /// Decode GEMVs `y[n][rows] = x[n][cols] . W^T` on activations `xa` (n = 1 for `Acts::Pro`).
    pub(crate) fn gemv(&self, w: MatRef, xa: Acts, n: usize, y: u64) -> Result<(), CudaError> {
        self.gemv_as(w, xa, n, y, w.rows)
    }

    /// [`Self::gemv`] with the threads per row chosen as for a matrix of `lane_rows` rows: a stack of matrices
    /// multiplied in one launch keeps each matrix's own lanes (so its f32 sums, hence its outputs, equal those
    /// of the matrix launched alone: the verify pass's batch invariance).
    pub(crate) fn gemv_as(&self, w: MatRef, xa: Acts, n: usize, y: u64, lane_rows: usize) -> Result<(), CudaError> {
        let dev = &self.dev;
        let sfx = type_suffix(w.ty)?;
        if let Acts::Q8(qx, dx) = xa
            && self.mid(n)
            && mid_type(w.ty)
        {
            return self.gemvqm(w, (qx, dx), n, y);
        }
        // 128-thread blocks, [`Self::gemv_lanes`] threads per row.
        let tasks = Self::tasks_per_row(w.ty, w.cols, !matches!(xa, Acts::F32(..)));
        let (lanes, deep) = self.dense_lanes(tasks, lane_rows);
        let rows_per_block = 128 / lanes;
        if let Acts::Pro(p) = xa {
            debug_assert_eq!(n, 1);
            let args = [
                Arg::Ptr(w.ptr),
                Arg::I64(w.row_bytes as i64),
                Arg::I32(w.rows as i32),
                Arg::I32(w.cols as i32),
                Arg::Ptr(p.x),
                Arg::Ptr(p.x2),
                Arg::F32(p.scale),
                Arg::I32(p.blk as i32),
                Arg::Ptr(p.aux),
                Arg::I32(p.aux_n as i32),
                Arg::Ptr(y),
                Arg::I32(lanes as i32),
            ];
            dev.launch(&format!("gemvqp_{sfx}"), (w.rows.div_ceil(rows_per_block) as u32, 1, 1), 128, &args)?;
            return Ok(());
        }
        let mut t0 = 0;
        while t0 < n {
            let c = [8usize, 4, 2, 1].into_iter().find(|&c| c <= n - t0).expect("1 always fits");
            let (kernel, x_args) = match xa {
                Acts::Q8(qx, dx) => (
                    if c == 1 && deep { format!("gemvqd_{sfx}") } else { format!("gemvq_{sfx}_{c}") },
                    vec![Arg::Ptr(qx + (t0 * w.cols) as u64), Arg::Ptr(dx + (t0 * w.cols / 32 * 4) as u64)],
                ),
                Acts::F32(xp) => (format!("gemv_{sfx}_{c}"), vec![Arg::Ptr(xp + (t0 * w.cols * 4) as u64)]),
                Acts::Pro(_) => unreachable!("launched above"),
            };
            let mut args =
                vec![Arg::Ptr(w.ptr), Arg::I64(w.row_bytes as i64), Arg::I32(w.rows as i32), Arg::I32(w.cols as i32)];
            args.extend(x_args);
            args.extend([
                Arg::I64(w.cols as i64),
                Arg::Ptr(y + (t0 * w.rows * 4) as u64),
                Arg::I64(w.rows as i64),
                Arg::I32(lanes as i32),
            ]);
            dev.launch(&kernel, (w.rows.div_ceil(rows_per_block) as u32, 1, 1), 128, &args)?;
            t0 += c;
        }
        Ok(())
    }

    /// `y[n][rows] = x[n][cols] . W^T` on the 8-bit activations `q = (qx, dx)` (`[n][cols]` int8, `[n][cols / 32]`
    /// f32 scales) with the mid-size dense kernel `gemvqm_*` (kernels/cuda/gemv_grouped.cu): each weight task
    /// decoded once per tile of 16 rows (gemv_grouped.cu `MID_TILE`), [`mid_lanes`] threads per weight row.
    ///
    /// Errors: a type without mid-size kernels ([`mid_type`]), a failed launch.
    pub(crate) fn gemvqm(&self, w: MatRef, q: (u64, u64), n: usize, y: u64) -> Result<(), CudaError> {
        if !mid_type(w.ty) {
            return Err(CudaError::Unsupported(format!("no mid-size 8-bit GEMV for {:?} weights", w.ty)));
        }
        let sfx = type_suffix(w.ty)?;
        let tasks = Self::tasks_per_row(w.ty, w.cols, true);
        let lanes = mid_lanes(tasks, w.rows, self.flags.gemv_min_threads);
        let args = [
            Arg::Ptr(w.ptr),
            Arg::I64(w.row_bytes as i64),
            Arg::I32(w.rows as i32),
            Arg::I32(w.cols as i32),
            Arg::Ptr(q.0),
            Arg::Ptr(q.1),
            Arg::I64(w.cols as i64),
            Arg::Ptr(y),
            Arg::I64(w.rows as i64),
            Arg::I32(n as i32),
            Arg::I32(lanes as i32),
        ];
        self.dev.launch(&format!("gemvqm_{sfx}"), (w.rows.div_ceil(128 / lanes) as u32, 1, 1), 128, &args)?;
        Ok(())
    }

    /// Routed experts of a mid-size batch grouped by expert, on 8-bit activations (`moe_gemvqg_*`,
    /// kernels/cuda/gemv_grouped.cu): `plan` is [`Self::sort_plan`]'s over `slots` token slots and the `count`
    /// matrices of `stack` (slot `j` of the stack at `j * rows * row_bytes`); every slot routed to a matrix of
    /// the stack multiplies it with row `s / x_div` of the activations `q = (qx, dx)` (`x_stride` values apart)
    /// into `y.0 + s * rows`. With `second` (same type and shape: gate and up), the same slots multiply it into
    /// `y.1` in the same launch. Slots with no matrix of the stack are not written.
    ///
    /// Errors: a type without mid-size kernels ([`mid_type`]), a `second` of another type or shape, a failed
    /// launch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_gemvqg(
        &self,
        stack: &DevStack,
        second: Option<&DevStack>,
        plan: SortPlan,
        q: (u64, u64),
        x_div: usize,
        x_stride: usize,
        y: (u64, u64),
    ) -> Result<(), CudaError> {
        if !mid_type(stack.ty) {
            return Err(CudaError::Unsupported(format!("no grouped 8-bit expert GEMV for {:?} weights", stack.ty)));
        }
        if let Some(s) = second
            && (s.ty != stack.ty || s.rows != stack.rows || s.cols != stack.cols || s.row_bytes != stack.row_bytes)
        {
            return Err(CudaError::Unsupported("a grouped gate/up launch over matrices of two shapes".into()));
        }
        let stream = self.dev.stream();
        let tasks = Self::tasks_per_row(stack.ty, stack.cols, true);
        let lanes = mid_lanes(tasks, stack.rows * self.cfg.n_expert_used, GEMV_MIN_THREADS);
        let w0 = ptr(&stack.data, stream, 0);
        let w1 = second.map_or(w0, |s| ptr(&s.data, stream, 0));
        let mut args = vec![Arg::Ptr(w0), Arg::Ptr(w1)];
        args.extend(stack.shape_args());
        args.extend([
            Arg::Ptr(plan.offsets),
            Arg::Ptr(plan.perm),
            Arg::Ptr(plan.active),
            Arg::Ptr(q.0),
            Arg::Ptr(q.1),
            Arg::I32(x_div as i32),
            Arg::I64(x_stride as i64),
            Arg::Ptr(y.0),
            Arg::Ptr(y.1),
            Arg::I32(lanes as i32),
        ]);
        let grid = grouped_grid(stack.rows, lanes, plan.experts, second.is_some());
        self.dev.launch(&format!("moe_gemvqg_{}", type_suffix(stack.ty)?), grid, 128, &args)?;
        Ok(())
    }

    /// Groups `slots` token slots by the matrix of a stack of `count` that `ids` (`[slots]` i32) names, on the
    /// device (`moe_sort`): ids outside `0..count` (negative: computed elsewhere) are left out. See [`SortPlan`].
    ///
    /// Errors: more than 1024 matrices (the sort's limit), a failed launch.
    pub(crate) fn sort_plan(&self, ids: u64, slots: usize, count: usize) -> Result<SortPlan, CudaError> {
        if count > 1024 {
            return Err(CudaError::Unsupported(format!("grouping slots over {count} experts (at most 1024)")));
        }
        let offsets = self.tmp(count + 1)?;
        let perm = self.tmp(slots.max(1))?;
        let experts = count.min(slots);
        let active = self.tmp(experts.max(1))?;
        self.dev.launch(
            "moe_sort",
            (1, 1, 1),
            1024,
            &[
                Arg::Ptr(ids),
                Arg::I32(slots as i32),
                Arg::I32(count as i32),
                Arg::Ptr(offsets),
                Arg::Ptr(perm),
                Arg::Ptr(active),
            ],
        )?;
        Ok(SortPlan { offsets, perm, active, experts })
    }

    /// `y[n][rows] = x[n][cols] . W^T` for more than `GEMV_MAX_TOKENS` tokens (prefill): tensor cores on 8-bit
    /// activations, else the weights dequantized for cuBLAS.
    pub(crate) fn matmul_batch(&self, w: MatRef, x: u64, n: usize, y: u64) -> Result<(), CudaError> {
        let dev = &self.dev;
        let sfx = type_suffix(w.ty)?;
        if self.flags.tensor_cores
            && w.cols.is_multiple_of(MMA_K)
            && let Some(blk) = self.q8_block(w.ty, w.cols)
        {
            // 8-bit activations times the weights on tensor cores (the grouped expert kernel with one "expert"
            // and the identity slot map): no dequantized copy of the matrix, integer products as the GEMVs.
            let q = self.quantize_act(x, n, w.cols, blk)?;
            let shape = StackView { ptr: w.ptr, ty: w.ty, rows: w.rows, cols: w.cols, row_bytes: w.row_bytes };
            return self.mma(shape, 1, None, q, 1, w.cols, y, n, n.div_ceil(MMA_SLOTS));
        }
        // Dequantize row blocks to f32 and multiply with cuBLAS.
        let rows_per = (DEQUANT_CHUNK / w.cols).clamp(1, w.rows);
        let mut guard = self.dequant_scratch.lock().expect("dequant scratch lock");
        let need = rows_per * w.cols;
        if guard.as_ref().is_none_or(|s| s.len() < need) {
            *guard = Some(zeros(dev, need)?);
        }
        let scratch = guard.as_ref().expect("allocated above");
        let sp = ptr(scratch, dev.stream(), 0);
        let elem = matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) && !w.cols.is_multiple_of(32);
        let mut r0 = 0;
        while r0 < w.rows {
            let rows = rows_per.min(w.rows - r0);
            let wp = w.ptr + (r0 * w.row_bytes) as u64;
            let args = [
                Arg::Ptr(wp),
                Arg::I64(w.row_bytes as i64),
                Arg::I32(rows as i32),
                Arg::I32(w.cols as i32),
                Arg::Ptr(sp),
            ];
            if elem {
                dev.launch_1d(&format!("dequant_elem_f32_{sfx}"), rows * w.cols, &args)?;
            } else {
                dev.launch_1d(&format!("dequant_f32_{sfx}"), rows * (w.cols / 32), &args)?;
            }
            if rows == w.rows {
                dev.sgemm(sp, x, y, rows, n, w.cols)?;
            } else {
                // A partial row block writes a column slab of y: multiply into a temporary, then copy.
                let tp = self.tmp(n * rows)?;
                dev.sgemm(sp, x, tp, rows, n, w.cols)?;
                dev.launch_1d(
                    "copy_rows",
                    n * rows,
                    &[
                        Arg::Ptr(tp),
                        Arg::I64(rows as i64),
                        Arg::Ptr(y + (r0 * 4) as u64),
                        Arg::I64(w.rows as i64),
                        Arg::I32(n as i32),
                        Arg::I32(rows as i32),
                    ],
                )?;
            }
            r0 += rows;
        }
        Ok(())
    }

    /// Threads per row of the f32 grouped expert kernel (`moe_grouped_*`).
    pub(crate) fn grouped_f32_lanes(cols: usize) -> u32 {
        if cols / 32 >= 24 { 32 } else { 16 }
    }

    /// Activations of `n` rows of `cols` for weights of type `ty`: quantized to 8 bits when the type has an
    /// integer GEMV path ([`Self::q8_block`]), else the f32 rows as they are.
    pub(crate) fn acts(&self, ty: GgmlType, x: u64, n: usize, cols: usize) -> Result<Acts, CudaError> {
        Ok(match self.q8_block(ty, cols) {
            Some(blk) => {
                let (qx, dx) = self.quantize_act(x, n, cols, blk)?;
                Acts::Q8(qx, dx)
            }
            None => Acts::F32(x),
        })
    }

    /// Activations `silu(x) * x2` (`[rows][cols]` each) for the 8-bit decode GEMVs of a down projection of type
    /// `ty` whose blocks each read one row (routed experts with `per_row`, else a dense GEMV of one row): the GEMV
    /// computes and quantizes them itself ([`Acts::Pro`]) when it can (at most `PRO_MAX_COLS` columns,
    /// `NEBULA_CUDA_GEMV_PROLOGUE=1`); otherwise the SiLU kernel writes them into `x` (and their 8-bit form)
    /// first. (A prologue that only quantizes an f32 row was measured slower than `quantize_act` on a 6144-wide
    /// row, H200: each block re-reads the row; the SiLU kernel's launch is what the prologue saves.)
    pub(crate) fn acts_silu(
        &self,
        ty: GgmlType,
        x: u64,
        x2: u64,
        rows: usize,
        cols: usize,
        per_row: bool,
    ) -> Result<Acts, CudaError> {
        if let Some(blk) = self.q8_block(ty, cols)
            && self.flags.gemv_prologue
            && cols <= PRO_MAX_COLS
            && (rows == 1 || per_row)
        {
            return Ok(Acts::Pro(Pro { x, x2, scale: 1.0, blk, aux: 0, aux_n: 0 }));
        }
        self.silu_mul_q8(x, x2, rows, cols, ty)?;
        self.acts(ty, x, rows, cols)
    }

    /// `g = silu(g) * u` over `rows` rows of `cols`, writing the 8-bit form of `g` for a consumer of type `ty`.
    /// Returns the 8-bit outputs written (`qx, dx, blk`; `None` when `ty` has no 8-bit path).
    pub(crate) fn silu_mul_q8(
        &self,
        g: u64,
        u: u64,
        rows: usize,
        cols: usize,
        ty: GgmlType,
    ) -> Result<Option<Q8Out>, CudaError> {
        let q = self.q8_outputs(ty, rows, cols)?;
        let count = rows * cols;
        self.dev.launch_1d(
            "silu_mul",
            count,
            &[&[Arg::Ptr(g), Arg::Ptr(u), Arg::I64(count as i64)][..], &Self::q8_args(q)].concat(),
        )?;
        self.q8_produced(g, rows, cols, q);
        Ok(q)
    }

    /// Routed-expert GEMVs for decode: slot `s` multiplies expert `ids[s]` of `stack` with the activations of
    /// token `s / slots_per_x` into `y.0`. With `second` (same shape and type), the same slots also multiply it
    /// into `y.1` (gate and up: one launch on 8-bit activations, two on f32). With `dense = Some((w0, w1, parts,
    /// tokens))` (8-bit activations and `second` only), `tokens * parts` more slots follow the `slots` routed
    /// ones: slot `slots + t * parts + j` multiplies rows `[j * rows, (j + 1) * rows)` of the matrices at `w0`
    /// and `w1` (of the stack's type and row bytes) with token `t`'s activations (the kernel's `MoeShared`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_gemv(
        &self,
        stack: &DevStack,
        second: Option<&DevStack>,
        ids: u64,
        slots: usize,
        x: Acts,
        x_stride: usize,
        slots_per_x: usize,
        y: (u64, u64),
        dense: Option<(u64, u64, usize, usize)>,
    ) -> Result<(), CudaError> {
        if dense.is_some() && (second.is_none() || !matches!(x, Acts::Q8(..))) {
            return Err(CudaError::Unsupported(
                "dense slots of a routed GEMV need gate and up on 8-bit activations".into(),
            ));
        }
        let sfx = type_suffix(stack.ty)?;
        let stream = self.dev.stream();
        match x {
            Acts::Q8(..) | Acts::Pro(_) => {
                let tasks = Self::tasks_per_row(stack.ty, stack.cols, true);
                let lanes = Self::gemv_lanes(tasks, stack.rows * self.cfg.n_expert_used, GEMV_MIN_THREADS);
                let w0 = ptr(&stack.data, stream, 0);
                let w1 = second.map_or(w0, |s| ptr(&s.data, stream, 0));
                let mut args = vec![Arg::Ptr(w0), Arg::Ptr(w1)];
                args.extend(stack.shape_args());
                args.push(Arg::Ptr(ids));
                let kernel = match x {
                    Acts::Pro(p) => {
                        // moe_gemvqp_* computes silu(x) * x2 only (no hyper-connection activation, no aux output).
                        debug_assert!(p.x2 != 0 && p.aux == 0, "{p:?}");
                        args.extend([Arg::Ptr(p.x), Arg::Ptr(p.x2), Arg::I32(p.blk as i32)]);
                        "moe_gemvqp"
                    }
                    Acts::Q8(qx, dx) => {
                        args.extend([Arg::Ptr(qx), Arg::Ptr(dx)]);
                        "moe_gemvq"
                    }
                    Acts::F32(_) => unreachable!("f32 activations take the arm below"),
                };
                args.extend([
                    Arg::I64(x_stride as i64),
                    Arg::I32(slots_per_x as i32),
                    Arg::Ptr(y.0),
                    Arg::Ptr(y.1),
                    Arg::I32(lanes as i32),
                ]);
                let (s0, s1, parts, tokens) = dense.unwrap_or((0, 0, 1, 0));
                if matches!(x, Acts::Q8(..)) {
                    args.extend([Arg::Ptr(s0), Arg::Ptr(s1), Arg::I32(slots as i32), Arg::I32(parts as i32)]);
                }
                let all = slots + tokens * parts;
                let grid = (stack.rows.div_ceil(128 / lanes) as u32, all as u32, if second.is_some() { 2 } else { 1 });
                self.dev.launch(&format!("{kernel}_{sfx}"), grid, 128, &args)?;
            }
            Acts::F32(xp) => {
                let tasks = Self::tasks_per_row(stack.ty, stack.cols, false);
                let lanes = Self::gemv_lanes(tasks, stack.rows * self.cfg.n_expert_used, GEMV_MIN_THREADS);
                for (st, out) in std::iter::once((stack, y.0)).chain(second.map(|s| (s, y.1))) {
                    let mut args = vec![Arg::Ptr(ptr(&st.data, stream, 0))];
                    args.extend(st.shape_args());
                    args.extend([
                        Arg::Ptr(ids),
                        Arg::Ptr(xp),
                        Arg::I64(x_stride as i64),
                        Arg::I32(slots_per_x as i32),
                        Arg::Ptr(out),
                        Arg::I32(lanes as i32),
                    ]);
                    let grid = (st.rows.div_ceil(256 / lanes) as u32, slots as u32, 1);
                    self.dev.launch(&format!("moe_gemv_{sfx}"), grid, 256, &args)?;
                }
            }
        }
        Ok(())
    }

    /// Routed experts for prefill, grouped by expert (`offsets`/`perm` from `moe_sort`) over `count` weight
    /// slots of `w` (slot `j` holds expert `slot_expert[j]`, or `j` when `slot_expert` is 0): token slot `s`
    /// reads the activations of row `s / x_div` and writes `y + s * rows`; `slots` is the layer's slot count (for
    /// the tensor-core kernel's split of each expert's slots).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_grouped(
        &self,
        w: StackView,
        count: usize,
        slot_expert: u64,
        offsets: u64,
        perm: u64,
        x: Acts,
        x_div: usize,
        x_stride: usize,
        y: u64,
        slots: usize,
    ) -> Result<(), CudaError> {
        if let Acts::Q8(qx, dx) = x
            && self.flags.tensor_cores
            && w.cols.is_multiple_of(MMA_K)
        {
            // Slot tiles of 32 per expert split over blockIdx.z: about two per block for the layer's mean load.
            let tiles = (2 * slots).div_ceil(self.cfg.n_expert * MMA_SLOTS).clamp(1, 8);
            let map = Some((offsets, perm, slot_expert));
            return self.mma(w, count, map, (qx, dx), x_div, x_stride, y, 0, tiles);
        }
        let sfx = type_suffix(w.ty)?;
        let mut args = vec![Arg::Ptr(w.ptr)];
        args.extend(w.shape_args());
        args.extend([Arg::Ptr(offsets), Arg::Ptr(perm), Arg::Ptr(slot_expert)]);
        let (kernel, block, lanes) = match x {
            Acts::Q8(qx, dx) => {
                args.extend([Arg::Ptr(qx), Arg::Ptr(dx)]);
                (format!("moe_groupedq_{sfx}"), 128, Self::q8_lanes(w.ty, w.cols))
            }
            Acts::F32(xp) => {
                args.push(Arg::Ptr(xp));
                (format!("moe_grouped_{sfx}"), 256, Self::grouped_f32_lanes(w.cols) as usize)
            }
            Acts::Pro(_) => {
                return Err(CudaError::Unsupported("a grouped expert launch on prologue-quantized input".into()));
            }
        };
        args.extend([Arg::I32(x_div as i32), Arg::I64(x_stride as i64), Arg::Ptr(y), Arg::I32(lanes as i32)]);
        let grid = (w.rows.div_ceil(block as usize / lanes) as u32, count as u32, 1);
        self.dev.launch(&kernel, grid, block, &args)?;
        Ok(())
    }

    /// Launches the tensor-core kernel `moe_groupedmma_*` (kernels/cuda/gemv.cu) over `count` weight slots of `w`
    /// (slot `j` at `j * rows * row_bytes`): with `map = Some((offsets, perm, slot_expert))` the routed experts of
    /// [`Self::moe_grouped`]; with `None` one dense matrix whose token slots are `0..nslots`. Slot `s` multiplies
    /// the 8-bit activations `q = (qx, dx)` of row `s / x_div` (`x_stride` values apart) and writes
    /// `y + s * rows`; `tiles` slot tiles of `MMA_SLOTS` per block split over the grid's z.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mma(
        &self,
        w: StackView,
        count: usize,
        map: Option<(u64, u64, u64)>,
        q: (u64, u64),
        x_div: usize,
        x_stride: usize,
        y: u64,
        nslots: usize,
        tiles: usize,
    ) -> Result<(), CudaError> {
        let (offsets, perm, slot_expert) = map.unwrap_or((0, 0, 0));
        let mut args = vec![Arg::Ptr(w.ptr)];
        args.extend(w.shape_args());
        args.extend([
            Arg::Ptr(offsets),
            Arg::Ptr(perm),
            Arg::Ptr(slot_expert),
            Arg::Ptr(q.0),
            Arg::Ptr(q.1),
            Arg::I32(x_div as i32),
            Arg::I64(x_stride as i64),
            Arg::Ptr(y),
            Arg::I32(nslots as i32),
        ]);
        let grid = (w.rows.div_ceil(MMA_ROWS) as u32, count as u32, tiles as u32);
        self.dev.launch(&format!("moe_groupedmma_{}", type_suffix(w.ty)?), grid, 128, &args)?;
        Ok(())
    }

    /// Copies rows `ids` (`[n]` i32) of the table `w`, decoded to f32, to `out` (rows `out_stride` values apart),
    /// each `copies` times side by side (the embedding's `S` streams).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn get_rows(
        &self,
        w: &DevMatrix,
        ids: u64,
        n: usize,
        out: u64,
        out_stride: usize,
        copies: usize,
    ) -> Result<(), CudaError> {
        let sfx = type_suffix(w.ty)?;
        let args = [
            Arg::Ptr(ptr(&w.data, self.dev.stream(), 0)),
            Arg::I64(w.row_bytes as i64),
            Arg::I32(w.cols as i32),
            Arg::Ptr(ids),
            Arg::I32(n as i32),
            Arg::Ptr(out),
            Arg::I64(out_stride as i64),
            Arg::I32(copies as i32),
        ];
        if w.cols.is_multiple_of(32) {
            self.dev.launch_1d(&format!("get_rows_{sfx}"), n * (w.cols / 32), &args)?;
        } else {
            self.dev.launch_1d(&format!("get_rows_elem_{sfx}"), n * w.cols, &args)?;
        }
        Ok(())
    }
}
