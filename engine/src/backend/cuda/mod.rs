//! The CUDA backend: every block of the model on the GPU, weights resident in VRAM (the "datacenter" case, and
//! the GPU half of the hybrid placement).
//!
//! [`CudaModel::from_cpu`] uploads the weights of a loaded (and validated) [`Qwen4Exp`] as they are stored —
//! quantized blocks stay quantized and are decoded in registers by the kernels. [`CudaModel::forward`] mirrors
//! the CPU forward pass block for block: decode-sized batches (up to 8 tokens) use the quantized GEMV kernels,
//! larger batches dequantize each weight to f32 and multiply with cuBLAS SGEMM. Everything accumulates in f32;
//! routed experts for small batches run through a gather GEMV over the device-resident expert stack without a
//! host round trip, larger batches group tokens by expert.

mod backend;
mod checkpoint;
pub mod hybrid;
mod mtp;
mod ops;

pub use checkpoint::CudaSnapshot;
pub use mtp::{CudaChain, MAX_CHAIN_ROWS};

use std::sync::Mutex;

use nebula_kernels::cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, sys as driver_sys};
use nebula_kernels::{Gpu, GpuError};

use crate::gguf::GgmlType;
use crate::model::config::{LayerKind, ModelConfig, PleConfig};
use crate::model::hyper_connection::GatedResidual;
use crate::model::{LogitsFor, Qwen4Exp, TokenMixer};
use crate::quant::Matrix;

use ops::{Arg, Dev, ptr, type_suffix};

/// Tokens up to which matrix products use the GEMV kernels (weights read once for all of them).
const GEMV_MAX_TOKENS: usize = 8;
/// The tensor-core grouped expert kernel's tile (kernels/cuda/gemv.cu `MMA_ROWS`, `MMA_SLOTS`, `MMA_K`): rows per
/// block, slots per tile, columns per step.
const MMA_ROWS: usize = 128;
const MMA_SLOTS: usize = 32;
const MMA_K: usize = 128;
/// Key splits per query of decode attention (flash-decoding); parts are merged by `attention_combine`.
const ATTN_SPLITS: usize = 16;
/// Largest weight block dequantized at once for the SGEMM path, in values (64 Mi floats = 256 MiB).
const DEQUANT_CHUNK: usize = 64 << 20;

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The GPU or its driver.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A model feature the kernels do not cover.
    #[error("the CUDA backend does not support {0}")]
    Unsupported(String),
    /// Input the model cannot take.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
}

impl From<nebula_kernels::cudarc::driver::DriverError> for CudaError {
    fn from(e: nebula_kernels::cudarc::driver::DriverError) -> Self {
        CudaError::Gpu(GpuError::from(e))
    }
}

/// Values of a row each `hc_norm` thread keeps in registers (`HC_NORM_PER_THREAD` in hyper_connection.cu).
const HC_NORM_PER_THREAD: usize = 4;

/// A weight matrix in device memory, blocks as stored in the GGUF.
struct DevMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: CudaSlice<u8>,
}

/// A stack of same-shaped matrices (the routed experts of a layer), `rows * row_bytes` apart.
struct DevStack {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: CudaSlice<u8>,
}

/// A matrix by address (a whole [`DevMatrix`] or one matrix of a [`DevStack`]).
#[derive(Clone, Copy)]
struct MatRef {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    ptr: u64,
}

struct DevHc {
    norm: CudaSlice<f32>,
    /// The down projection `[rank, S * d]`, with the injection's `S` rows stacked under it when
    /// `inject` is [`HcInject::Stacked`] (one GEMV for both).
    down: DevMatrix,
    /// Rows of the down projection proper.
    rank: usize,
    up: DevMatrix,
    inject: HcInject,
}

/// Where a hyper-connection mixer's injection projection lives on the device.
enum HcInject {
    /// The mixer does not inject (the final mixer).
    None,
    /// Under the down projection's rows in `DevHc::down` (same type and width).
    Stacked,
    /// A matrix of its own (its type differs from the down projection's).
    Separate(DevMatrix),
}

struct DevGdn {
    /// The input projections `in_proj_qkv` `[C, d]` and `in_proj_z` `[vd, d]` stacked (`[C + vd, d]`, one
    /// decode GEMV for both) when the two share a type; `z` holds `in_proj_z` otherwise.
    qkvz: DevMatrix,
    z: Option<DevMatrix>,
    /// Rows of `in_proj_qkv` (`C`).
    qkv_rows: usize,
    b: DevMatrix,
    a: DevMatrix,
    conv: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    a_neg_exp: CudaSlice<f32>,
    norm: CudaSlice<f32>,
    out: DevMatrix,
    silu_gate: bool,
}

impl DevGdn {
    /// `in_proj_qkv` `[C, d]`.
    fn qkv(&self, dev: &Dev) -> MatRef {
        MatRef { rows: self.qkv_rows, ..self.qkvz.r(dev) }
    }
    /// `in_proj_z` `[vd, d]` (the rows under `in_proj_qkv` when stacked).
    fn z(&self, dev: &Dev) -> MatRef {
        match &self.z {
            Some(z) => z.r(dev),
            None => {
                let q = self.qkv(dev);
                MatRef { ptr: q.ptr + (q.rows * q.row_bytes) as u64, rows: self.qkvz.rows - q.rows, ..q }
            }
        }
    }
}

struct DevIndexer {
    q: DevMatrix,
    k: DevMatrix,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    ratio: usize,
}

struct DevAttn {
    q: DevMatrix,
    k: DevMatrix,
    v: DevMatrix,
    o: DevMatrix,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    indexer: Option<DevIndexer>,
}

enum DevMixer {
    Gdn(DevGdn),
    Attn(DevAttn),
}

struct DevMoe {
    router: DevMatrix,
    gate: DevStack,
    up: DevStack,
    down: DevStack,
    /// The shared expert's gate projection `[sff, d]`, with its up projection stacked under it (`[2 sff, d]`,
    /// one decode GEMV for both) when the two share a type; `sh_up` holds the up projection otherwise.
    sh_gate_up: DevMatrix,
    sh_up: Option<DevMatrix>,
    sh_down: DevMatrix,
    /// The shared expert's gate row (f32 `[d]`), applied by the router kernel.
    sh_gate_inp: CudaSlice<f32>,
}

impl DevMoe {
    /// The shared expert's hidden size `sff`.
    fn sh_ff(&self) -> usize {
        if self.sh_up.is_some() { self.sh_gate_up.rows } else { self.sh_gate_up.rows / 2 }
    }
    /// The shared expert's gate projection `[sff, d]`.
    fn sh_gate(&self, dev: &Dev) -> MatRef {
        MatRef { rows: self.sh_ff(), ..self.sh_gate_up.r(dev) }
    }
    /// The shared expert's up projection `[sff, d]` (the lower half of the stack when stacked).
    fn sh_up(&self, dev: &Dev) -> MatRef {
        match &self.sh_up {
            Some(u) => u.r(dev),
            None => {
                let g = self.sh_gate(dev);
                MatRef { ptr: g.ptr + (g.rows * g.row_bytes) as u64, ..g }
            }
        }
    }
}

struct DevPle {
    cfg: PleConfig,
    key: DevMatrix,
    value: DevMatrix,
    norm_key: CudaSlice<f32>,
    norm_query: CudaSlice<f32>,
    norm_conv: CudaSlice<f32>,
    conv: CudaSlice<f32>,
    /// The n-gram table on the device; `None` in hybrid mode, where it stays on the host (RAM or SSD, it is far
    /// larger than a consumer GPU: 29 GB in IQ4_NL for the real model) and each pass uploads the rows it reads.
    table: Option<DevMatrix>,
    table_rows: usize,
}

struct DevLayer {
    ple: Option<DevPle>,
    attn_hc: DevHc,
    mixer: DevMixer,
    mlp_hc: DevHc,
    moe: DevMoe,
}

/// Per-layer device state of one sequence.
enum DevLayerState {
    Gdn { conv: CudaSlice<f32>, s: CudaSlice<f32> },
    Attn { k: CudaSlice<f32>, v: CudaSlice<f32>, raw: CudaSlice<f32>, pooled: CudaSlice<f32> },
}

/// Fixed device buffers of a decode step, so a captured CUDA Graph replays with the same addresses: the token
/// id, its PLE row ids and the logits.
struct StepBuffers {
    token: CudaSlice<i32>,
    ple_rows: CudaSlice<i32>,
    logits: CudaSlice<f32>,
    /// The step's argmax ([`CudaModel::step_argmax`]).
    choice: CudaSlice<i32>,
}

/// A captured decode step and the arena generation its temporaries live in.
struct DecodeGraph {
    graph: CudaGraph,
    arena_generation: u64,
    /// Where the step leaves its pre-mixer bank (an arena address, valid after each replay).
    bank: u64,
    /// Arena values the captured step uses (after a replay, later temporaries go past them).
    arena_used: usize,
}

/// The state of one sequence on the GPU (KV caches sized for `max_len` tokens up front).
pub struct CudaState {
    /// Tokens consumed.
    pub pos: usize,
    /// Capacity in tokens.
    pub max_len: usize,
    layers: Vec<DevLayerState>,
    ple_context: Vec<u32>,
    ple_conv: Option<CudaSlice<f32>>,
    /// The position the next token takes, on the device (kernels read it, so graph replays advance).
    pos_dev: CudaSlice<i32>,
    step: StepBuffers,
    graph: Option<DecodeGraph>,
    /// The MTP block's cache (`None` without a block on the device).
    mtp: Option<mtp::MtpDevState>,
    /// Rollback buffers of speculative chains (allocated with the first chain).
    chain: Option<mtp::ChainBufs>,
    /// Verify-pass graphs by chain length, with their use counts.
    verify_graphs: Vec<(Option<DecodeGraph>, usize)>,
    /// Decode steps run so far (a graph is captured on the second, once the arena holds its size).
    decode_steps: usize,
    /// Set by [`CudaModel::step_argmax`] for its decode step: the step leaves its argmax in `argmax_out` instead
    /// of copying the logits back.
    want_argmax: bool,
    argmax_out: Option<u32>,
}

/// The model on the GPU.
pub struct CudaModel {
    dev: Dev,
    /// Shapes.
    pub config: ModelConfig,
    embed: DevMatrix,
    layers: Vec<DevLayer>,
    mixer: DevHc,
    lm_head: DevMatrix,
    masked: CudaSlice<i32>,
    n_masked: usize,
    scratch: Mutex<Option<CudaSlice<f32>>>,
    arena: Mutex<Arena>,
    graphs: bool,
    /// Quantize activations to 8 bits for the GEMVs of Q8_0, Q4_0, IQ4_NL and Q4_K weights (integer dot products,
    /// as the CPU kernels do); `NEBULA_CUDA_Q8=0` keeps f32 activations for every type.
    q8_acts: bool,
    /// Whether down projections and hyper-connection up projections compute and quantize their input themselves
    /// (`Acts::Pro`) instead of after a SiLU or `hc_acts` kernel: off unless `NEBULA_CUDA_GEMV_PROLOGUE=1`. It
    /// takes 48 launches out of a 12-layer decode step and Nsight Compute times each fused kernel below the
    /// two it replaces, yet the CUDA Graph step measured slower with it (H200: 384 against 432 tok/s; later, with
    /// four repeats in each of two processes per setting, 411.3 against 434.7 on average), so it is opt-in for
    /// study.
    gemv_prologue: bool,
    /// The launch size below which a dense decode GEMV widens its rows ([`Self::gemv_lanes`]): 2^15 threads, or
    /// `NEBULA_CUDA_GEMV_THREADS` (tuning).
    gemv_min_threads: usize,
    /// Whether one-token dense decode GEMVs on 8-bit activations keep four tasks per thread in flight
    /// (`gemvqd_*`, every weight load of a thread issued before the first is used) with rows widened so that no
    /// thread has more than four tasks ([`Self::dense_lanes`]): `NEBULA_CUDA_GEMV_DEPTH=4`; 2 (two tasks in
    /// flight, `gemvq_*_1`) otherwise.
    gemv_deep: bool,
    /// Which independent pieces of decode work share launches ([`Fusions`], `NEBULA_CUDA_FUSE`).
    fuse: Fusions,
    /// Routed experts and quantized dense matmuls of prefill batches (over `GEMV_MAX_TOKENS` tokens) on tensor
    /// cores (`moe_groupedmma_*`, int8 MMA, compute capability 8.0 and newer) where the type has an 8-bit path
    /// (needs `q8_acts`) and the column count is a multiple of 128; otherwise (or with `NEBULA_CUDA_MMA=0`) the
    /// dp4a expert kernel (`moe_groupedq_*`, the same integer dot products) and f32 cuBLAS for dense matmuls.
    tensor_cores: bool,
    /// The last quantized activations: ((x, n, cols, block, write count), (qx, dx)).
    q8_cache: Mutex<Option<(Q8Key, (u64, u64))>>,
    /// Per-phase wall time (`NEBULA_CUDA_PROFILE=1`: the stream is synchronised after each phase).
    profile: Option<Mutex<PhaseTimes>>,
    /// Bytes of weights uploaded.
    pub weight_bytes: usize,
    /// The host half when only the placement's GPU-tier experts are on the device (hybrid decode and streamed
    /// prefill, [`hybrid`]); `None`: every expert is on the GPU.
    hybrid: Option<hybrid::Hybrid>,
    /// The MTP draft block (when the model has one loaded).
    mtp: Option<mtp::DevMtp>,
    /// Set during a verify pass: every kernel choice is the one a single decode step makes, so each row's result
    /// is bit for bit a decode step's (batch-invariant GEMVs, per-token expert GEMVs, split attention).
    exact_rows: std::sync::atomic::AtomicBool,
    /// During a hybrid verify pass, the device address of the per-row coverage buffer (0 otherwise).
    coverage_out: std::sync::atomic::AtomicU64,
}

/// Accumulated wall time per phase of the forward pass, for `nebula bench model`'s breakdown.
#[derive(Default)]
struct PhaseTimes {
    last: Option<std::time::Instant>,
    totals: Vec<(&'static str, f64, u64)>,
}

/// Bump allocator for a forward pass's temporaries: one device buffer reused by every call, so decode steps
/// allocate nothing and a captured graph's addresses stay valid. When a pass needs more, a bigger buffer is added
/// for the rest of that pass and the two are merged at the next reset; the generation counter changes then, so
/// graphs captured over the old buffer are recaptured.
struct Arena {
    chunks: Vec<CudaSlice<f32>>,
    used: usize,
    generation: u64,
}

impl Arena {
    /// Values per allocation are rounded up to this (256-byte alignment).
    const ALIGN: usize = 64;

    fn reset(&mut self, dev: &Dev) -> Result<(), CudaError> {
        if self.chunks.len() > 1 {
            let total: usize = self.chunks.iter().map(|c| c.len()).sum();
            self.chunks.clear();
            self.chunks.push(zeros(dev, total)?);
            self.generation += 1;
        }
        self.used = 0;
        Ok(())
    }

    /// Where the next temporary would go: (chunk, offset). See [`Arena::release`].
    fn mark(&self) -> (usize, usize) {
        (self.chunks.len(), self.used)
    }

    /// Frees every temporary taken since `mark` for reuse by later launches. All work is on one stream, so a
    /// later kernel writing reused memory runs after the earlier ones that read it; callers release only values
    /// nothing enqueued later reads (a layer's temporaries once its output is added to the residual stream, an
    /// expert group's once its kernels are queued). When a chunk was added since the mark, the new chunk is reused
    /// from its start and the rest of the old one waits for the next reset.
    fn release(&mut self, mark: (usize, usize)) {
        if self.chunks.len() == mark.0 {
            self.used = self.used.min(mark.1);
        } else {
            self.used = 0;
        }
    }

    fn take(&mut self, dev: &Dev, n: usize) -> Result<u64, CudaError> {
        let n = n.max(1).div_ceil(Self::ALIGN) * Self::ALIGN;
        let cur = self.chunks.last().map_or(0, |c| c.len());
        if self.chunks.is_empty() || self.used + n > cur {
            self.chunks.push(zeros(dev, (2 * cur).max(n).max(1 << 20))?);
            self.used = 0;
            self.generation += 1;
        }
        let p = ptr(self.chunks.last().expect("pushed above"), dev.stream(), self.used);
        self.used += n;
        Ok(p)
    }
}

impl std::fmt::Debug for CudaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModel").field("gpu", &self.dev.gpu.name).field("weight_bytes", &self.weight_bytes).finish()
    }
}

struct Uploader<'a> {
    dev: &'a Dev,
    bytes: usize,
}

impl Uploader<'_> {
    fn check_shape(m: &Matrix, what: &str) -> Result<(), CudaError> {
        type_suffix(m.ggml_type())?;
        let cols = m.cols();
        let ok = match m.ggml_type() {
            GgmlType::F32 => cols % 4 == 0,
            GgmlType::F16 | GgmlType::BF16 => cols % 4 == 0 && (cols < 32 || cols % 8 == 0),
            _ => true,
        };
        if !ok {
            return Err(CudaError::Unsupported(format!(
                "{what}: rows of {cols} values (need a multiple of 4, or 8 for 16-bit floats)"
            )));
        }
        Ok(())
    }
    fn matrix(&mut self, m: &Matrix, what: &str) -> Result<DevMatrix, CudaError> {
        Self::check_shape(m, what)?;
        self.upload(m)
    }
    /// A lookup table (read by `get_rows`, never multiplied): any row width.
    fn table(&mut self, m: &Matrix) -> Result<DevMatrix, CudaError> {
        type_suffix(m.ggml_type())?;
        self.upload(m)
    }
    fn upload(&mut self, m: &Matrix) -> Result<DevMatrix, CudaError> {
        self.bytes += m.bytes().len();
        Ok(DevMatrix {
            ty: m.ggml_type(),
            rows: m.rows(),
            cols: m.cols(),
            row_bytes: m.row_bytes(),
            data: self.dev.stream().clone_htod(m.bytes())?,
        })
    }
    fn vector(&mut self, v: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        self.bytes += v.len() * 4;
        Ok(self.dev.stream().clone_htod(v)?)
    }
    /// The matrices `ms` back to back (possibly none: the shape is `like`'s, one byte is allocated).
    fn stack(&mut self, ms: &[&Matrix], like: &Matrix, what: &str) -> Result<DevStack, CudaError> {
        let first = ms.first().copied().unwrap_or(like);
        Self::check_shape(first, what)?;
        let mut all = Vec::with_capacity(first.bytes().len() * ms.len());
        for m in ms {
            all.extend_from_slice(m.bytes());
        }
        if all.is_empty() {
            all.push(0);
        }
        self.bytes += all.len();
        Ok(DevStack {
            ty: first.ggml_type(),
            rows: first.rows(),
            cols: first.cols(),
            row_bytes: first.row_bytes(),
            data: self.dev.stream().clone_htod(&all)?,
        })
    }
    fn attn(&mut self, a: &crate::model::self_attn::Attention, what: &str) -> Result<DevAttn, CudaError> {
        Ok(DevAttn {
            q: self.matrix(&a.q_proj, what)?,
            k: self.matrix(&a.k_proj, what)?,
            v: self.matrix(&a.v_proj, what)?,
            o: self.matrix(&a.o_proj, what)?,
            q_norm: self.vector(&a.q_norm)?,
            k_norm: self.vector(&a.k_norm)?,
            indexer: match &a.indexer {
                Some(ix) => Some(DevIndexer {
                    q: self.matrix(&ix.q_proj, what)?,
                    k: self.matrix(&ix.k_proj, what)?,
                    q_norm: self.vector(&ix.q_norm)?,
                    k_norm: self.vector(&ix.k_norm)?,
                    ratio: ix.compress_ratio,
                }),
                None => None,
            },
        })
    }
    /// A MoE block with the routed experts `held` (all when `None`) as slot stacks.
    fn moe(
        &mut self,
        m: &crate::model::moe::SparseMoe,
        held: Option<&[usize]>,
        what: &str,
    ) -> Result<DevMoe, CudaError> {
        let held: Vec<&crate::model::moe::Expert> = match held {
            Some(r) => r.iter().map(|&e| &m.experts[e]).collect(),
            None => m.experts.iter().collect(),
        };
        let gates: Vec<&Matrix> = held.iter().map(|e| &e.gate_proj).collect();
        let ups: Vec<&Matrix> = held.iter().map(|e| &e.up_proj).collect();
        let downs: Vec<&Matrix> = held.iter().map(|e| &e.down_proj).collect();
        let e0 = &m.experts[0];
        let se = &m.shared_expert;
        Self::check_shape(&se.up_proj, what)?;
        if se.up_proj.rows() != se.gate_proj.rows() {
            return Err(CudaError::Unsupported(format!(
                "{what}: shared expert gate {} and up {} rows differ",
                se.gate_proj.rows(),
                se.up_proj.rows()
            )));
        }
        let (sh_gate_up, sh_up) = match self.stacked(&[&se.gate_proj, &se.up_proj], what)? {
            Some(both) => (both, None),
            None => (self.matrix(&se.gate_proj, what)?, Some(self.matrix(&se.up_proj, what)?)),
        };
        Ok(DevMoe {
            router: self.matrix(&m.gate, what)?,
            gate: self.stack(&gates, &e0.gate_proj, what)?,
            up: self.stack(&ups, &e0.up_proj, what)?,
            down: self.stack(&downs, &e0.down_proj, what)?,
            sh_gate_up,
            sh_up,
            sh_down: self.matrix(&m.shared_expert.down_proj, what)?,
            sh_gate_inp: self.vector(&m.shared_expert_gate)?,
        })
    }
    fn hc(&mut self, g: &GatedResidual, what: &str) -> Result<DevHc, CudaError> {
        let down = &g.input_mix_weight_down;
        let (down_dev, inject) = match &g.block_inject_weight {
            None => (self.matrix(down, what)?, HcInject::None),
            Some(inj) => match self.stacked(&[down, inj], what)? {
                Some(both) => (both, HcInject::Stacked),
                None => (self.matrix(down, what)?, HcInject::Separate(self.matrix(inj, what)?)),
            },
        };
        Ok(DevHc {
            norm: self.vector(&g.hc_norm)?,
            down: down_dev,
            rank: down.rows(),
            up: self.matrix(&g.input_mix_weight_up, what)?,
            inject,
        })
    }
    /// The matrices `ms` as one matrix of their rows one after another, when they share a type and a width
    /// (`None` otherwise): several products of one input in a single GEMV.
    fn stacked(&mut self, ms: &[&Matrix], what: &str) -> Result<Option<DevMatrix>, CudaError> {
        let first = ms[0];
        if ms.iter().any(|m| m.ggml_type() != first.ggml_type() || m.cols() != first.cols()) {
            return Ok(None);
        }
        Self::check_shape(first, what)?;
        let all: Vec<u8> = ms.iter().flat_map(|m| m.bytes().iter().copied()).collect();
        self.bytes += all.len();
        Ok(Some(DevMatrix {
            ty: first.ggml_type(),
            rows: ms.iter().map(|m| m.rows()).sum(),
            cols: first.cols(),
            row_bytes: first.row_bytes(),
            data: self.dev.stream().clone_htod(&all)?,
        }))
    }
}

impl DevMatrix {
    fn r(&self, dev: &Dev) -> MatRef {
        MatRef {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            row_bytes: self.row_bytes,
            ptr: ptr(&self.data, dev.stream(), 0),
        }
    }
}

/// What a quantized activation buffer was made from: (x, rows, cols, block, the device's write count).
type Q8Key = (u64, usize, usize, usize, u64);

/// A GEMV's input rows on the device: f32, or quantized to 8 bits (int8 values, f32 scales per 32), or f32 rows
/// that the 8-bit GEMV's blocks turn into the activation and quantize themselves (`gemvqp_*`, `moe_gemvqp_*`).
#[derive(Debug, Clone, Copy)]
enum Acts {
    F32(u64),
    Q8(u64, u64),
    Pro(Pro),
}

/// The input of a GEMV with a prologue (gemv.cu `ProIn`, `quantize_prologue`): with `x2` not 0 the SwiGLU
/// hidden layer `silu(x) * x2`; with `x2 = 0` the hyper-connection activation `silu(x * scale)`, and then block
/// 0 also writes `aux[s] = 2 sigmoid(x[cols + s] * scale)` for `s < aux_n` (0 = none). Quantized in blocks of `blk`.
#[derive(Debug, Clone, Copy)]
struct Pro {
    x: u64,
    x2: u64,
    scale: f32,
    blk: usize,
    aux: u64,
    aux_n: usize,
}

/// The most columns a GEMV prologue quantizes (gemv.cu `PRO_MAX_COLS`).
const PRO_MAX_COLS: usize = 2560;

/// One stack of expert matrices by address: `ty`/`rows`/`cols`/`row_bytes` per matrix, consecutive matrices
/// `rows * row_bytes` apart from `ptr` (the resident stack or a staging buffer).
#[derive(Clone, Copy)]
struct StackView {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    ptr: u64,
}

impl StackView {
    /// Bytes per matrix, bytes per row, rows, columns (the kernels' shape arguments).
    fn shape_args(&self) -> [Arg; 4] {
        [
            Arg::I64((self.rows * self.row_bytes) as i64),
            Arg::I64(self.row_bytes as i64),
            Arg::I32(self.rows as i32),
            Arg::I32(self.cols as i32),
        ]
    }
}

impl DevStack {
    fn view(&self, dev: &Dev) -> StackView {
        StackView {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            row_bytes: self.row_bytes,
            ptr: ptr(&self.data, dev.stream(), 0),
        }
    }

    /// The launch arguments every routed-expert kernel takes after the weights: bytes per expert, bytes per
    /// row, rows, columns.
    fn shape_args(&self) -> [Arg; 4] {
        [
            Arg::I64(self.expert_bytes() as i64),
            Arg::I64(self.row_bytes as i64),
            Arg::I32(self.rows as i32),
            Arg::I32(self.cols as i32),
        ]
    }

    fn expert_bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// The launch size below which a decode GEMV widens its rows ([`CudaModel::gemv_lanes`]): fixed for routed
/// experts (wider expert rows measured slower on the H200: 15.6 against 11.3 us for a layer's gate/up at 32 and 8
/// threads per row), the default for dense matrices (`NEBULA_CUDA_GEMV_THREADS`).
const GEMV_MIN_THREADS: usize = 1 << 15;

/// The arguments of the Gated DeltaNet gates (`gdn_ba_gates`, and the tail of `gdn_conv_gates`'s): the device
/// addresses `[m, Wb, Wa, A, dt_bias, beta, g]`, then `nv` value heads and the width `d`.
fn gdn_gate_args(p: [u64; 7], nv: usize, d: usize) -> [Arg; 9] {
    let [m, wb, wa, a, dt_bias, beta, g] = p;
    [
        Arg::Ptr(m),
        Arg::Ptr(wb),
        Arg::Ptr(wa),
        Arg::Ptr(a),
        Arg::Ptr(dt_bias),
        Arg::Ptr(beta),
        Arg::Ptr(g),
        Arg::I32(nv as i32),
        Arg::I32(d as i32),
    ]
}

/// Independent pieces of decode work that can share a launch: `shared`, the shared expert's gate/up and SiLU in the
/// routed experts' launches ([`CudaModel::shared_parts`]); `qkvz`, Gated DeltaNet's `in_proj_qkv` and `in_proj_z`
/// in one GEMV ([`CudaModel::gdn_in_proj`]); `gates`, its gates in the conv launch ([`CudaModel::gdn_mix`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fusions {
    shared: bool,
    qkvz: bool,
    gates: bool,
}

impl Fusions {
    /// All three.
    const ALL: Fusions = Fusions { shared: true, qkvz: true, gates: true };

    /// `NEBULA_CUDA_FUSE`: unset, [`Self::ALL`]; `0`, none; else a comma-separated list of `shared`, `qkvz`,
    /// `gates` (study: Nsight Compute times a fused step below the unfused one, yet the CUDA Graph step can measure
    /// otherwise, as with the GEMV prologues).
    ///
    /// # Errors
    /// An unknown name, quoted in the message.
    fn parse(v: Option<&str>) -> Result<Self, CudaError> {
        let Some(v) = v else { return Ok(Self::ALL) };
        let mut f = Fusions { shared: false, qkvz: false, gates: false };
        if v.trim() == "0" {
            return Ok(f);
        }
        for name in v.split(',').map(str::trim) {
            match name {
                "shared" => f.shared = true,
                "qkvz" => f.qkvz = true,
                "gates" => f.gates = true,
                other => {
                    return Err(CudaError::Unsupported(format!(
                        "NEBULA_CUDA_FUSE takes 0 or a list of shared, qkvz, gates; got {other:?}"
                    )));
                }
            }
        }
        Ok(f)
    }
}

/// The launch size (threads, at [`CudaModel::gemv_lanes`]' width) from which a dense GEMV keeps the shallow
/// prefetch under `NEBULA_CUDA_GEMV_DEPTH=4`: about the threads an H200 holds at once (132 SMs x 2048); the output
/// head (248,320 rows) measured slower deep (Nsight Compute: 141 against 122 us).
const DEEP_MAX_THREADS: usize = 1 << 18;

/// `NEBULA_CUDA_GEMV_DEPTH` (tasks a dense one-token GEMV thread keeps in flight): 2 when unset.
///
/// # Errors
/// A value other than 2 or 4, named in the message.
fn parse_gemv_depth(v: Option<&str>) -> Result<usize, CudaError> {
    match v.map(str::trim) {
        None => Ok(2),
        Some("2") => Ok(2),
        Some("4") => Ok(4),
        Some(t) => Err(CudaError::Unsupported(format!("NEBULA_CUDA_GEMV_DEPTH must be 2 or 4, got {t:?}"))),
    }
}

/// A device f32 buffer of `n` values.
fn zeros(dev: &Dev, n: usize) -> Result<CudaSlice<f32>, CudaError> {
    Ok(dev.stream().alloc_zeros::<f32>(n.max(1))?)
}

impl CudaModel {
    /// Opens GPU `ordinal` and uploads `model`'s weights. `vram_budget` (bytes), when given, is checked against
    /// both the weights' size and the free device memory before anything is allocated.
    pub fn from_cpu(model: &Qwen4Exp, ordinal: usize, vram_budget: Option<u64>) -> Result<Self, CudaError> {
        Self::build(model, ordinal, vram_budget, None, 0)
    }

    /// `model` on GPU `ordinal`: hybrid ([`CudaModel::hybrid`]) when it is placed, else every weight on the GPU
    /// ([`CudaModel::from_cpu`]).
    pub fn for_model(
        model: std::sync::Arc<Qwen4Exp>,
        ordinal: usize,
        vram_budget: Option<u64>,
    ) -> Result<Self, CudaError> {
        if model.expert_tiers().is_some() {
            Self::hybrid(model, ordinal, vram_budget)
        } else {
            Self::from_cpu(&model, ordinal, vram_budget)
        }
    }

    /// The hybrid model ([`hybrid`]): `model` must be placed ([`Qwen4Exp::place`]); its GPU-tier experts and the
    /// dense trunk go to GPU `ordinal`, the CPU model keeps the rest and computes them. `vram_budget` (bytes)
    /// covers the trunk, the GPU experts and the two staging buffers of streamed prefill.
    ///
    /// Errors: [`CudaError::Unsupported`] for a model without a placement; as [`CudaModel::from_cpu`].
    pub fn hybrid(
        model: std::sync::Arc<Qwen4Exp>,
        ordinal: usize,
        vram_budget: Option<u64>,
    ) -> Result<Self, CudaError> {
        let params = hybrid::HybridParams::for_model(&model);
        Self::hybrid_with(model, ordinal, vram_budget, params)
    }

    /// [`CudaModel::hybrid`] with explicit [`hybrid::HybridParams`] (tests, benchmarks).
    pub fn hybrid_with(
        model: std::sync::Arc<Qwen4Exp>,
        ordinal: usize,
        vram_budget: Option<u64>,
        params: hybrid::HybridParams,
    ) -> Result<Self, CudaError> {
        if !(params.stage_experts > 0 && params.stages >= 2) {
            return Err(CudaError::Unsupported(
                "hybrid: stage_experts must be at least 1 and stages at least 2".into(),
            ));
        }
        let resident = hybrid::Hybrid::resident_lists(&model)
            .ok_or_else(|| CudaError::Unsupported("hybrid decode without a placement".into()))?;
        let stage = hybrid::Hybrid::stage_bytes(&model, &params);
        let mut m = Self::build(&model, ordinal, vram_budget, Some(&resident), stage)?;
        m.hybrid = Some(hybrid::Hybrid::new(&m.dev, model, resident, params)?);
        // The step synchronises with the host once per layer: no whole-step graph.
        m.graphs = false;
        Ok(m)
    }

    /// Uploads the trunk and the routed experts `resident[layer]` (all of them when `None`) after checking the
    /// weights plus `extra` bytes against the budget and the free memory.
    fn build(
        model: &Qwen4Exp,
        ordinal: usize,
        vram_budget: Option<u64>,
        resident: Option<&[Vec<usize>]>,
        extra: usize,
    ) -> Result<Self, CudaError> {
        let gpu = Gpu::open(ordinal)?;
        let (free, _total) = gpu.mem_info()?;
        let needed = (estimate_weight_bytes(model, resident) + extra) as u64;
        let budget = vram_budget.unwrap_or(free as u64);
        if needed > budget || needed > free as u64 {
            return Err(GpuError::OutOfMemory {
                what: "the model's weights".into(),
                needed_mib: needed >> 20,
                free_mib: (free as u64) >> 20,
                budget_mib: budget >> 20,
            }
            .into());
        }
        let dev = Dev::new(gpu)?;
        let cfg = model.config.clone();
        let mut up = Uploader { dev: &dev, bytes: 0 };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for (i, l) in model.layers.iter().enumerate() {
            let what = format!("layer {i}");
            let mixer = match &l.mixer {
                TokenMixer::LinearAttention(g) => {
                    let (qkvz, z) = match up.stacked(&[&g.in_proj_qkv, &g.in_proj_z], &what)? {
                        Some(stack) => (stack, None),
                        None => (up.matrix(&g.in_proj_qkv, &what)?, Some(up.matrix(&g.in_proj_z, &what)?)),
                    };
                    DevMixer::Gdn(DevGdn {
                        qkvz,
                        z,
                        qkv_rows: g.in_proj_qkv.rows(),
                        b: up.matrix(&g.in_proj_b, &what)?,
                        a: up.matrix(&g.in_proj_a, &what)?,
                        conv: up.vector(&g.conv1d)?,
                        dt_bias: up.vector(&g.dt_bias)?,
                        a_neg_exp: up.vector(&g.a)?,
                        norm: up.vector(&g.norm)?,
                        out: up.matrix(&g.out_proj, &what)?,
                        silu_gate: g.gate == crate::model::GateActivation::Silu,
                    })
                }
                TokenMixer::SelfAttention(a) => DevMixer::Attn(up.attn(a, &what)?),
            };
            let moe = up.moe(&l.mlp, resident.map(|r| &r[i][..]), &what)?;
            let ple = match &l.ple {
                Some(p) => Some(DevPle {
                    cfg: p.cfg.clone(),
                    key: up.matrix(&p.key_proj, &what)?,
                    value: up.matrix(&p.value_proj, &what)?,
                    norm_key: up.vector(&p.norm_key)?,
                    norm_query: up.vector(&p.norm_query)?,
                    norm_conv: up.vector(&p.norm_conv)?,
                    conv: up.vector(&p.conv1d)?,
                    table: if resident.is_some() { None } else { Some(up.table(&p.ngram_embedding)?) },
                    table_rows: p.ngram_embedding.rows(),
                }),
                None => None,
            };
            layers.push(DevLayer {
                ple,
                attn_hc: up.hc(&l.attn_hyper_connection, &what)?,
                mixer,
                mlp_hc: up.hc(&l.mlp_hyper_connection, &what)?,
                moe,
            });
        }
        let mtp = mtp::DevMtp::upload(&mut up, model, resident.is_some())?;
        let embed = up.matrix(&model.embed_tokens, "token_embd")?;
        let lm_head = up.matrix(&model.lm_head, "output")?;
        let mixer = up.hc(&model.hyper_connection_mixer, "output_hc")?;
        let ranges: Vec<i32> = model.masked.iter().flat_map(|r| [r.start as i32, r.end as i32]).collect();
        let n_masked = model.masked.len();
        let masked = dev.stream().clone_htod(if ranges.is_empty() { &[0i32, 0][..] } else { &ranges[..] })?;
        let weight_bytes = up.bytes;
        let capability = dev.gpu.capability.0;
        Ok(Self {
            dev,
            config: cfg,
            embed,
            layers,
            mixer,
            lm_head,
            masked,
            n_masked,
            scratch: Mutex::new(None),
            arena: Mutex::new(Arena { chunks: Vec::new(), used: 0, generation: 0 }),
            graphs: std::env::var("NEBULA_CUDA_GRAPHS").map_or(true, |v| v != "0")
                && std::env::var("NEBULA_CUDA_PROFILE").is_err(),
            q8_acts: std::env::var("NEBULA_CUDA_Q8").map_or(true, |v| v != "0"),
            gemv_prologue: std::env::var("NEBULA_CUDA_GEMV_PROLOGUE").is_ok_and(|v| v == "1"),
            gemv_min_threads: std::env::var("NEBULA_CUDA_GEMV_THREADS")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&t: &usize| t > 0)
                .unwrap_or(GEMV_MIN_THREADS),
            fuse: Fusions::parse(std::env::var("NEBULA_CUDA_FUSE").ok().as_deref())?,
            gemv_deep: parse_gemv_depth(std::env::var("NEBULA_CUDA_GEMV_DEPTH").ok().as_deref())? == 4,
            tensor_cores: capability >= 8 && std::env::var("NEBULA_CUDA_MMA").map_or(true, |v| v != "0"),
            q8_cache: Mutex::new(None),
            profile: std::env::var("NEBULA_CUDA_PROFILE")
                .is_ok_and(|v| v == "1")
                .then(|| Mutex::new(PhaseTimes::default())),
            weight_bytes,
            hybrid: None,
            mtp,
            exact_rows: Default::default(),
            coverage_out: Default::default(),
        })
    }

    /// Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), measured with `bytes`-sized
    /// copies: the HBM ceiling of the floor computations.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64, CudaError> {
        let n = bytes / 4;
        let src = zeros(&self.dev, n)?;
        let mut dst = zeros(&self.dev, n)?;
        let stream = self.dev.stream();
        stream.memcpy_dtod(&src, &mut dst)?;
        stream.synchronize()?;
        let reps = 10;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            stream.memcpy_dtod(&src, &mut dst)?;
        }
        stream.synchronize()?;
        Ok((2 * n * 4 * reps) as f64 / t.elapsed().as_secs_f64())
    }

    /// The CPU model of a hybrid model.
    pub fn host_model(&self) -> Option<&Qwen4Exp> {
        self.hybrid.as_ref().map(|h| &*h.host)
    }

    /// The hybrid settings in effect (the CPU/streaming crossover as chosen at load); `None` unless hybrid.
    pub fn hybrid_params(&self) -> Option<hybrid::HybridParams> {
        self.hybrid.as_ref().map(|h| h.params)
    }

    /// Bytes of the RAM tier registered with the GPU driver for full-speed uploads (hybrid only).
    pub fn registered_bytes(&self) -> usize {
        self.hybrid.as_ref().map_or(0, |h| h.registered_bytes)
    }

    /// True when only the placement's GPU-tier experts are on the device ([`CudaModel::hybrid`]).
    pub fn is_hybrid(&self) -> bool {
        self.hybrid.is_some()
    }

    /// Where hybrid steps spent their time since the last call (then reset); `None` unless hybrid.
    pub fn take_hybrid_times(&self) -> Option<hybrid::HybridTimes> {
        use std::sync::atomic::Ordering::Relaxed;
        self.hybrid.as_ref().map(|h| hybrid::HybridTimes {
            cpu_s: h.cpu_ns.swap(0, Relaxed) as f64 * 1e-9,
            wait_s: h.wait_ns.swap(0, Relaxed) as f64 * 1e-9,
            gpu_s: h.gpu_ns.swap(0, Relaxed) as f64 * 1e-9,
            trips: h.trips.swap(0, Relaxed),
        })
    }

    /// The streamed-prefill timeline since the last call (`NEBULA_CUDA_PROFILE=copies`, hybrid only; see
    /// [`hybrid::copy_report`]), then cleared.
    pub fn take_copy_report(&self) -> Result<Option<String>, CudaError> {
        let Some(log) = self.hybrid.as_ref().and_then(|h| h.copy_log.as_ref()) else { return Ok(None) };
        let entries = std::mem::take(&mut *log.lock().expect("copy log lock"));
        hybrid::copy_report(&entries)
    }

    /// Mean seconds of one host -> GPU -> host round trip of a small buffer (a copy each way and a stream
    /// synchronisation, as a hybrid layer does), over 200 trips.
    pub fn round_trip(&self) -> Result<f64, CudaError> {
        let stream = self.dev.stream();
        let mut buf = stream.alloc_zeros::<f32>(2560)?;
        let host = vec![1f32; 2560];
        let mut back = vec![0f32; 2560];
        stream.memcpy_htod(&host, &mut buf)?;
        stream.memcpy_dtoh(&buf, &mut back)?;
        stream.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..200 {
            stream.memcpy_htod(&host, &mut buf)?;
            stream.memcpy_dtoh(&buf, &mut back)?;
            stream.synchronize()?;
        }
        Ok(t.elapsed().as_secs_f64() / 200.0)
    }

    /// The GPU's name.
    pub fn gpu_name(&self) -> &str {
        &self.dev.gpu.name
    }

    /// A fresh state for at most `max_len` tokens (KV caches allocated now: an out-of-memory is reported here,
    /// never in the middle of a request), with an MTP cache that every forward keeps aligned when the model has
    /// the block ([`CudaModel::new_state_with`] without it).
    pub fn new_state(&self, max_len: usize) -> Result<CudaState, CudaError> {
        self.new_state_with(max_len, true)
    }

    /// [`CudaModel::new_state`]; `draft` false leaves out the MTP cache (no MTP pass after each forward: for
    /// sequences that never draft), and drafting then refuses.
    pub fn new_state_with(&self, max_len: usize, draft: bool) -> Result<CudaState, CudaError> {
        let cfg = &self.config;
        let dev = &self.dev;
        let mut layers = Vec::new();
        for l in &self.layers {
            layers.push(match &l.mixer {
                DevMixer::Gdn(_) => DevLayerState::Gdn {
                    conv: zeros(dev, (cfg.ssm_conv_kernel - 1) * cfg.ssm_conv_dim())?,
                    s: zeros(dev, cfg.ssm_v_heads * cfg.ssm_head_dim * cfg.ssm_head_dim)?,
                },
                DevMixer::Attn(a) => self.attn_state(a, max_len)?,
            });
        }
        let ple = self.layers.iter().find_map(|l| l.ple.as_ref());
        Ok(CudaState {
            pos: 0,
            max_len,
            layers,
            ple_context: ple.map(|p| vec![p.cfg.eos_token_id; p.cfg.ngram_size - 1]).unwrap_or_default(),
            ple_conv: match ple {
                Some(p) => Some(zeros(dev, p.cfg.conv_state_len() * cfg.hc_dim())?),
                None => None,
            },
            pos_dev: dev.stream().alloc_zeros::<i32>(1)?,
            step: StepBuffers {
                token: dev.stream().alloc_zeros::<i32>(1)?,
                ple_rows: dev.stream().alloc_zeros::<i32>(ple.map_or(1, |p| p.cfg.n_heads()))?,
                logits: zeros(dev, cfg.vocab)?,
                choice: dev.stream().alloc_zeros::<i32>(1)?,
            },
            graph: None,
            mtp: if draft { self.new_mtp_state(max_len)? } else { None },
            chain: None,
            verify_graphs: (0..=mtp::MAX_CHAIN_ROWS).map(|_| (None, 0)).collect(),
            decode_steps: 0,
            want_argmax: false,
            argmax_out: None,
        })
    }

    /// An attention layer's empty cache for `max_len` tokens: K and V, and with the QSA indexer its raw and
    /// block-pooled keys.
    fn attn_state(&self, a: &DevAttn, max_len: usize) -> Result<DevLayerState, CudaError> {
        let (cfg, dev) = (&self.config, &self.dev);
        let kvw = cfg.n_head_kv * cfg.head_dim;
        let (ihd, blocks) = a.indexer.as_ref().map_or((0, 1), |i| (cfg.indexer.head_dim, max_len / i.ratio.max(1) + 1));
        Ok(DevLayerState::Attn {
            k: zeros(dev, max_len * kvw)?,
            v: zeros(dev, max_len * kvw)?,
            raw: zeros(dev, max_len * ihd)?,
            pooled: zeros(dev, blocks * ihd)?,
        })
    }

    /// Closes the current profiling phase as `name` (no-op unless profiling).
    fn phase(&self, name: &'static str) -> Result<(), CudaError> {
        if let Some(prof) = &self.profile {
            self.dev.stream().synchronize()?;
            let now = std::time::Instant::now();
            let mut p = prof.lock().expect("profile lock");
            if let Some(last) = p.last {
                let dt = (now - last).as_secs_f64();
                match p.totals.iter_mut().find(|t| t.0 == name) {
                    Some(t) => {
                        t.1 += dt;
                        t.2 += 1;
                    }
                    None => p.totals.push((name, dt, 1)),
                }
            }
            p.last = Some(now);
        }
        Ok(())
    }

    /// A plain decode step that consumes `token` and returns the argmax of its logits (masked vocabulary rows
    /// excluded; ties to the lower id; `None` when every logit is `-inf` or NaN), chosen on the device: one
    /// 4-byte copy instead of the `[vocab]` logits. Greedy decoding without penalties, grammar or log-probabilities
    /// gives the same token as [`crate::sampling::argmax`] on [`Self::forward`]'s logits.
    ///
    /// Errors: as [`Self::forward`].
    pub fn step_argmax(&self, st: &mut CudaState, token: u32) -> Result<Option<u32>, CudaError> {
        st.want_argmax = true;
        st.argmax_out = None;
        let out = self.forward(st, &[token], LogitsFor::Last);
        st.want_argmax = false;
        out?;
        Ok(st.argmax_out.take())
    }

    /// Per-kernel (name, total seconds, launches) when `NEBULA_CUDA_PROFILE=kernels`; then clears it.
    pub fn take_kernel_times(&self) -> Vec<(String, f64, u64)> {
        self.dev
            .kernel_times
            .as_ref()
            .map_or_else(Vec::new, |t| std::mem::take(&mut *t.lock().expect("kernel times lock")))
    }

    /// Turns decode-step CUDA Graphs on or off (on by default; `NEBULA_CUDA_GRAPHS=0` turns them off). A hybrid
    /// model never captures one: its steps synchronise with the host once per layer.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on && self.hybrid.is_none();
    }

    /// Turns int8 tensor-core prefill on or off (on by default where the GPU has compute capability 8.0 or newer;
    /// `NEBULA_CUDA_MMA=0` turns it off): routed experts (`moe_groupedmma_*` instead of the dp4a `moe_groupedq_*`,
    /// the same integer products) and quantized dense matmuls (MMA on 8-bit activations instead of f32 cuBLAS on
    /// dequantized weights, so outputs also differ by activation rounding). Below compute capability 8.0, or with
    /// 8-bit activations off (`NEBULA_CUDA_Q8=0`), it stays off.
    pub fn set_tensor_cores(&mut self, on: bool) {
        self.tensor_cores = on && self.dev.gpu.capability.0 >= 8;
    }

    /// The profile so far: (phase, total seconds, count), when `NEBULA_CUDA_PROFILE=1`; then clears it.
    pub fn take_profile(&self) -> Vec<(&'static str, f64, u64)> {
        self.profile.as_ref().map_or_else(Vec::new, |p| std::mem::take(&mut p.lock().expect("profile lock").totals))
    }

    fn p(&self, buf: &CudaSlice<f32>, offset: usize) -> u64 {
        ptr(buf, self.dev.stream(), offset)
    }

    /// Whether a verify pass is running (every kernel choice a decode step's, see `exact_rows`).
    fn exact(&self) -> bool {
        self.exact_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A temporary of `n` f32 (or i32) values from the arena, valid until the end of the forward pass.
    fn tmp(&self, n: usize) -> Result<u64, CudaError> {
        self.arena.lock().expect("arena lock").take(&self.dev, n)
    }

    /// Marks the arena (see [`Arena::release`]).
    fn arena_mark(&self) -> (usize, usize) {
        self.arena.lock().expect("arena lock").mark()
    }

    /// Frees the temporaries taken since `mark` for reuse, and forgets the cached 8-bit activations (they may
    /// live in the freed memory).
    fn arena_release(&self, mark: (usize, usize)) {
        self.arena.lock().expect("arena lock").release(mark);
        *self.q8_cache.lock().expect("q8 cache lock") = None;
    }

    /// The activation block of the 8-bit GEMV path for weights of type `ty` with `cols` columns (32 for the
    /// 32-value formats, 256 for Q4_K, as `engine/src/quant/acts.rs` pairs them), or `None` for f32 activations.
    fn q8_block(&self, ty: GgmlType, cols: usize) -> Option<usize> {
        let blk = match ty {
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::IQ4_NL => 32,
            GgmlType::Q4_K => 256,
            _ => return None,
        };
        (self.q8_acts && cols % blk == 0).then_some(blk)
    }

    /// Tasks (the unit one thread decodes at a time: a 32-value chunk, 64 values for Q4_K on 8-bit activations)
    /// per row of `cols` weights of type `ty`.
    fn tasks_per_row(ty: GgmlType, cols: usize, q8: bool) -> usize {
        let per_task = if q8 && ty == GgmlType::Q4_K { 64 } else { 32 };
        (cols / per_task).max(1)
    }

    /// Threads per row of the grouped (prefill) 8-bit expert GEMV: about four tasks per thread, at most a warp.
    fn q8_lanes(ty: GgmlType, cols: usize) -> usize {
        let want = (Self::tasks_per_row(ty, cols, true) / 4).max(1);
        (1usize << want.ilog2()).min(32)
    }

    /// Threads per row of the decode GEMVs (`gemv*`, `moe_gemv*`; `tasks` per row; `rows` rows per token: a
    /// matrix's rows, times the slots per token for routed experts; 128-thread blocks): about four tasks per
    /// thread within a warp, which reads large matrices fastest (measured with ncu on the H200: the output head,
    /// experts); a launch with fewer than `min_threads` threads that way (a router, a hyper-connection
    /// projection, a one-row gate) widens its rows, up to a whole block per row, so enough loads are in flight.
    /// It depends on the matrix only, never on the number of tokens (batch invariance of the verify pass).
    fn gemv_lanes(tasks: usize, rows: usize, min_threads: usize) -> usize {
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
    fn dense_lanes(&self, tasks: usize, rows: usize) -> (usize, bool) {
        let lanes = Self::gemv_lanes(tasks, rows, self.gemv_min_threads);
        if self.gemv_deep && rows * lanes < DEEP_MAX_THREADS {
            (lanes.max(tasks.div_ceil(4).next_power_of_two().min(128)), true)
        } else {
            (lanes, false)
        }
    }

    /// Quantizes `x` (`[n][cols]` f32) to 8 bits per block of `blk`: (int8 `[n][cols]`, f32 scales `[n][cols/32]`).
    /// A vector quantized earlier in the same pass is reused while no other kernel ran in between (a GEMV only
    /// writes a fresh output, so `x` is unchanged).
    fn quantize_act(&self, x: u64, n: usize, cols: usize, blk: usize) -> Result<(u64, u64), CudaError> {
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
    fn q8_outputs(&self, ty: GgmlType, n: usize, cols: usize) -> Result<Option<(u64, u64, usize)>, CudaError> {
        match self.q8_block(ty, cols) {
            Some(blk) => Ok(Some((self.tmp((n * cols).div_ceil(4))?, self.tmp(n * cols / 32)?, blk))),
            None => Ok(None),
        }
    }

    /// The trailing `qx, dx, blk` kernel arguments for [`Self::q8_outputs`] (null pointers: no 8-bit form).
    fn q8_args(q: Option<(u64, u64, usize)>) -> [Arg; 3] {
        let (qx, dx, blk) = q.unwrap_or((0, 0, 0));
        [Arg::Ptr(qx), Arg::Ptr(dx), Arg::I32(blk as i32)]
    }

    /// Records that the kernel launched last wrote the 8-bit form of `x` (`[n][cols]`) into `q`, so the next
    /// [`Self::quantize_act`] of `x` with that block reuses it while no other kernel has run.
    fn q8_produced(&self, x: u64, n: usize, cols: usize, q: Option<(u64, u64, usize)>) {
        if let Some((qx, dx, blk)) = q {
            let writes = self.dev.writes.load(std::sync::atomic::Ordering::Relaxed);
            *self.q8_cache.lock().expect("q8 cache lock") = Some(((x, n, cols, blk, writes), (qx, dx)));
        }
    }

    /// `y[n][rows] = x[n][cols] . W^T`.
    fn matmul(&self, w: MatRef, x: u64, n: usize, y: u64) -> Result<(), CudaError> {
        if n <= GEMV_MAX_TOKENS || self.exact() {
            // 8-bit activations where the type has an integer path (`gemvq_*`: x is (qx, dx)), else f32 (`gemv_*`).
            let xa = self.acts(w.ty, x, n, w.cols)?;
            self.gemv(w, xa, n, y)
        } else {
            self.matmul_batch(w, x, n, y)
        }
    }

    /// Decode GEMVs `y[n][rows] = x[n][cols] . W^T` on activations `xa` (n = 1 for `Acts::Pro`).
    fn gemv(&self, w: MatRef, xa: Acts, n: usize, y: u64) -> Result<(), CudaError> {
        self.gemv_as(w, xa, n, y, w.rows)
    }

    /// [`Self::gemv`] with the threads per row chosen as for a matrix of `lane_rows` rows: a stack of matrices
    /// multiplied in one launch keeps each matrix's own lanes (so its f32 sums, hence its outputs, equal those
    /// of the matrix launched alone: the verify pass's batch invariance).
    fn gemv_as(&self, w: MatRef, xa: Acts, n: usize, y: u64, lane_rows: usize) -> Result<(), CudaError> {
        let dev = &self.dev;
        let sfx = type_suffix(w.ty)?;
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

    /// `y[n][rows] = x[n][cols] . W^T` for more than `GEMV_MAX_TOKENS` tokens (prefill): tensor cores on 8-bit
    /// activations, else the weights dequantized for cuBLAS.
    fn matmul_batch(&self, w: MatRef, x: u64, n: usize, y: u64) -> Result<(), CudaError> {
        let dev = &self.dev;
        let sfx = type_suffix(w.ty)?;
        if self.tensor_cores
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
        let mut guard = self.scratch.lock().expect("scratch lock");
        let need = rows_per * w.cols;
        if guard.as_ref().is_none_or(|s| s.len() < need) {
            *guard = Some(zeros(dev, need)?);
        }
        let scratch = guard.as_ref().expect("allocated above");
        let sp = ptr(scratch, dev.stream(), 0);
        let elem = matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) && w.cols % 32 != 0;
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

    /// Threads of a one-block-per-row norm over rows of `width`: about two values per thread, a multiple of
    /// `multiple` (32, or 256 when the kernel also quantizes in 256-value blocks), at most 1024.
    fn norm_threads(width: usize, multiple: usize) -> usize {
        width.div_ceil(2).next_multiple_of(multiple).clamp(multiple, 1024)
    }

    /// `out[r] = x[r] / rms(x[r]) * w[(r % w_rows)]` over `rows` rows of `width` (in place when out == x), one
    /// block per row with about two values per thread (up to 1024 threads): a decode step's few wide rows are
    /// latency-bound, so each thread loads little.
    fn rms_norm(&self, x: u64, w: u64, out: u64, rows: usize, width: usize, w_rows: usize) -> Result<(), CudaError> {
        let threads = Self::norm_threads(width, 32);
        self.dev.launch(
            "rms_norm_rows",
            (rows as u32, 1, 1),
            threads as u32,
            &[
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(out),
                Arg::I32(rows as i32),
                Arg::I32(width as i32),
                Arg::I32(w_rows as i32),
                Arg::F32(self.config.rms_eps),
            ],
        )?;
        Ok(())
    }

    /// Rotates `heads` heads of `n` tokens starting at the sequence position (`pos_dev`).
    fn rope(
        &self,
        x: u64,
        n: usize,
        heads: usize,
        token_stride: usize,
        head_stride: usize,
        pos_dev: u64,
    ) -> Result<(), CudaError> {
        let cfg = &self.config;
        let half = cfg.rope_dim / 2;
        self.dev.launch_1d(
            "rope_heads",
            n * heads * half,
            &[
                Arg::Ptr(x),
                Arg::I32(n as i32),
                Arg::I32(heads as i32),
                Arg::I64(token_stride as i64),
                Arg::I64(head_stride as i64),
                Arg::I32(0),
                Arg::Ptr(pos_dev),
                Arg::I32(1),
                Arg::I32(cfg.rope_dim as i32),
                Arg::F32(cfg.rope_theta),
                Arg::I32(cfg.rope_sections[1] as i32),
                Arg::I32(cfg.rope_sections[2] as i32),
            ],
        )?;
        Ok(())
    }

    /// Hyper-connection mixer: returns (m [n][d], a [n][S] when the mixer injects). `m_for` is the type of the
    /// first matrix that multiplies `m`: its 8-bit form is written by the mixing kernel itself (no separate
    /// `quantize_act`). With `residual = Some((y, a))` the residual update of the block before
    /// (`X[t][s] += a[t][s] * y[t]`) is fused into the norm. Down and injection projections run as one
    /// stacked GEMV when they share a type ([`HcInject::Stacked`]), on one quantization of the normalised bundle.
    fn hc_mix(
        &self,
        hc: &DevHc,
        x: u64,
        n: usize,
        m_for: Option<GgmlType>,
        residual: Option<(u64, u64)>,
    ) -> Result<(u64, Option<u64>), CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let (s, d) = (cfg.hc_count, cfg.hidden);
        let dim = s * d;
        let inv_s = 1.0 / s as f32;
        let xn = self.tmp(n * dim)?;
        let q_xn = self.q8_outputs(hc.down.ty, n * s, d)?;
        // Quantizing blocks of up to 256 values: whole multiples of 256 threads.
        let threads = Self::norm_threads(d, if q_xn.is_some() { 256 } else { 32 });
        if d > HC_NORM_PER_THREAD * threads {
            return Err(CudaError::Unsupported(format!(
                "a hidden width of {d} in the hyper-connection norm (at most {} values per row)",
                HC_NORM_PER_THREAD * threads
            )));
        }
        let (y, ya) = residual.unwrap_or((0, 0));
        dev.launch(
            "hc_norm",
            ((n * s) as u32, 1, 1),
            threads as u32,
            &[
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(y),
                    Arg::Ptr(ya),
                    Arg::Ptr(self.p(&hc.norm, 0)),
                    Arg::Ptr(xn),
                    Arg::I32(s as i32),
                    Arg::I32(d as i32),
                    Arg::F32(cfg.rms_eps),
                ][..],
                &Self::q8_args(q_xn),
            ]
            .concat(),
        )?;
        // The quantization blocks of a [n*S][d] view are those of the [n][S*d] rows the GEMVs read.
        self.q8_produced(xn, n, dim, q_xn);
        let rank = hc.rank;
        let fused_up = n == 1
            && self.gemv_prologue
            && rank <= PRO_MAX_COLS
            && matches!(hc.inject, HcInject::Stacked)
            && self.q8_block(hc.up.ty, rank).is_some();
        // The low-rank activation and its 8-bit form, written by hc_acts / hc_low_act (not when fused).
        let (low, q_low) =
            if fused_up { (0, None) } else { (self.tmp(n * rank)?, self.q8_outputs(hc.up.ty, n, rank)?) };
        let g = self.tmp(n * dim)?;
        let a = match &hc.inject {
            HcInject::Stacked if fused_up => {
                // One token: the up projection's blocks compute silu(y / S) themselves (and block 0 the injection
                // weights), so no hc_acts launch.
                let both = self.tmp(hc.down.rows)?;
                self.matmul(hc.down.r(dev), xn, 1, both)?;
                let a = self.tmp(s)?;
                let blk = self.q8_block(hc.up.ty, rank).expect("checked above");
                let pro = Pro { x: both, x2: 0, scale: inv_s, blk, aux: a, aux_n: s };
                self.gemv(hc.up.r(dev), Acts::Pro(pro), 1, g)?;
                Some(a)
            }
            HcInject::Stacked => {
                let both = self.tmp(n * hc.down.rows)?;
                self.matmul(hc.down.r(dev), xn, n, both)?;
                let a = self.tmp(n * s)?;
                dev.launch_1d(
                    "hc_acts",
                    n * rank.max(s),
                    &[
                        &[
                            Arg::Ptr(both),
                            Arg::Ptr(low),
                            Arg::Ptr(a),
                            Arg::I32(n as i32),
                            Arg::I32(rank as i32),
                            Arg::I32(s as i32),
                        ][..],
                        &Self::q8_args(q_low),
                    ]
                    .concat(),
                )?;
                Some(a)
            }
            inject => {
                self.matmul(hc.down.r(dev), xn, n, low)?;
                let a = match inject {
                    HcInject::None | HcInject::Stacked => None,
                    HcInject::Separate(wi) => {
                        let a = self.tmp(n * s)?;
                        self.matmul(wi.r(dev), xn, n, a)?;
                        dev.launch_1d(
                            "hc_inject_act",
                            n * s,
                            &[Arg::Ptr(a), Arg::I64((n * s) as i64), Arg::F32(inv_s)],
                        )?;
                        Some(a)
                    }
                };
                dev.launch_1d(
                    "hc_low_act",
                    n * rank,
                    &[&[Arg::Ptr(low), Arg::I64((n * rank) as i64), Arg::F32(inv_s)][..], &Self::q8_args(q_low)]
                        .concat(),
                )?;
                a
            }
        };
        if !fused_up {
            self.q8_produced(low, n, rank, q_low);
            self.matmul(hc.up.r(dev), low, n, g)?;
        }
        let m = self.tmp(n * d)?;
        let q_m = match m_for {
            Some(ty) => self.q8_outputs(ty, n, d)?,
            None => None,
        };
        dev.launch_1d(
            "hc_mix",
            n * d,
            &[
                &[Arg::Ptr(g), Arg::Ptr(xn), Arg::Ptr(m), Arg::I32(n as i32), Arg::I32(s as i32), Arg::I32(d as i32)][..],
                &Self::q8_args(q_m),
            ]
            .concat(),
        )?;
        self.q8_produced(m, n, d, q_m);
        Ok((m, a))
    }

    /// The Gated DeltaNet input projections of `n` tokens `m`: (`qkv` `[n, C]`, `z` `[n, vd]`). One token with
    /// the two stacked ([`DevGdn`]) and the same threads per row for each alone is one GEMV launch (each row's
    /// sum is the one its matrix's own launch computes, so batch invariance holds); otherwise two.
    fn gdn_in_proj(&self, g: &DevGdn, m: u64, n: usize) -> Result<(u64, u64), CudaError> {
        let dev = &self.dev;
        let (qm, zm) = (g.qkv(dev), g.z(dev));
        if n == 1 && g.z.is_none() && self.fuse.qkvz {
            let xa = self.acts(qm.ty, m, 1, qm.cols)?;
            let tasks = Self::tasks_per_row(qm.ty, qm.cols, !matches!(xa, Acts::F32(..)));
            if self.dense_lanes(tasks, qm.rows) == self.dense_lanes(tasks, zm.rows) {
                let both = self.tmp(qm.rows + zm.rows)?;
                self.gemv_as(g.qkvz.r(dev), xa, 1, both, qm.rows)?;
                return Ok((both, both + (4 * qm.rows) as u64));
            }
        }
        let qkv = self.tmp(n * qm.rows)?;
        self.matmul(qm, m, n, qkv)?;
        let z = self.tmp(n * zm.rows)?;
        self.matmul(zm, m, n, z)?;
        Ok((qkv, z))
    }

    /// Gated DeltaNet for `n` tokens `m`, updating the layer's conv and recurrent state in place. With `rec`
    /// (a verify pass), the recurrences' inputs are copied there: pre-conv `qkv` `[n, C]`, `beta` and `g` `[n, Hv]`.
    fn gdn(
        &self,
        g: &DevGdn,
        st: &DevLayerState,
        m: u64,
        n: usize,
        rec: Option<mtp::GdnRec>,
    ) -> Result<u64, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let (nv, dk) = (cfg.ssm_v_heads, cfg.ssm_head_dim);
        let c = cfg.ssm_conv_dim();
        let (qkv, z) = self.gdn_in_proj(g, m, n)?;
        let beta = self.tmp(n * nv)?;
        let gg = self.tmp(n * nv)?;
        let (a_neg_exp, dt_bias) = (self.p(&g.a_neg_exp, 0), self.p(&g.dt_bias, 0));
        // With f32 b and a projections, the gates are computed by blocks of the conv launch (gdn_mix).
        let f32_gates = g.b.ty == GgmlType::F32 && g.a.ty == GgmlType::F32 && cfg.hidden.is_multiple_of(4);
        let fused = f32_gates && self.fuse.gates;
        if f32_gates && !fused {
            let args = gdn_gate_args([m, g.b.r(dev).ptr, g.a.r(dev).ptr, a_neg_exp, dt_bias, beta, gg], nv, cfg.hidden);
            dev.launch("gdn_ba_gates", (nv as u32, n as u32, 1), 64, &args)?;
        } else if !f32_gates {
            let b = self.tmp(n * nv)?;
            self.matmul(g.b.r(dev), m, n, b)?;
            let a = self.tmp(n * nv)?;
            self.matmul(g.a.r(dev), m, n, a)?;
            dev.launch_1d(
                "gdn_gates",
                n * nv,
                &[
                    Arg::Ptr(b),
                    Arg::Ptr(a),
                    Arg::Ptr(a_neg_exp),
                    Arg::Ptr(dt_bias),
                    Arg::Ptr(beta),
                    Arg::Ptr(gg),
                    Arg::I32(n as i32),
                    Arg::I32(nv as i32),
                ],
            )?;
        }
        if let Some((rq, _, _)) = rec {
            self.dtod(rq, qkv, n * c)?;
        }
        let gates = fused.then(|| [m, g.b.r(dev).ptr, g.a.r(dev).ptr, a_neg_exp, dt_bias]);
        let o = self.gdn_mix(g, st, qkv, beta, gg, n, gates)?;
        if let Some((_, rb, rg)) = rec {
            // The recurrence reads beta and g without writing them.
            self.dtod(rb, beta, n * nv)?;
            self.dtod(rg, gg, n * nv)?;
        }
        dev.launch(
            "gdn_gated_norm",
            ((n * nv) as u32, 1, 1),
            128,
            &[
                Arg::Ptr(o),
                Arg::Ptr(z),
                Arg::Ptr(self.p(&g.norm, 0)),
                Arg::I32((n * nv) as i32),
                Arg::I32(dk as i32),
                Arg::F32(cfg.rms_eps),
                Arg::I32(g.silu_gate as i32),
            ],
        )?;
        let y = self.tmp(n * cfg.hidden)?;
        self.matmul(g.out.r(dev), o, n, y)?;
        Ok(y)
    }

    /// The recurrent part of Gated DeltaNet over `n` tokens: causal conv + SiLU on the pre-conv `qkv` (`[n, C]`,
    /// in place, conv state updated), the q/k L2 norms, and the delta-rule recurrence from `beta`/`g` (`[n, Hv]`)
    /// updating the state; returns the per-head outputs `[n, Hv * dk]`. A verify rollback replays exactly this.
    /// With `gates = Some([m, Wb, Wa, A, dt_bias])` (f32 projections), blocks of the conv launch first write
    /// `beta` and `g` from the block input `m` (`gdn_conv_gates`: one launch fewer).
    #[allow(clippy::too_many_arguments)]
    fn gdn_mix(
        &self,
        g: &DevGdn,
        st: &DevLayerState,
        qkv: u64,
        beta: u64,
        gg: u64,
        n: usize,
        gates: Option<[u64; 5]>,
    ) -> Result<u64, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let DevLayerState::Gdn { conv, s } = st else { unreachable!("state follows the layer kinds") };
        let (nk, nv, dk) = (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_dim);
        let (vd, c) = (nv * dk, cfg.ssm_conv_dim());
        let conv_args = [Arg::Ptr(qkv), Arg::Ptr(self.p(conv, 0)), Arg::Ptr(self.p(&g.conv, 0))];
        let shape = [Arg::I32(n as i32), Arg::I32(c as i32), Arg::I32(cfg.ssm_conv_kernel as i32)];
        match gates {
            None => dev.launch("gdn_conv", (c.div_ceil(64) as u32, 1, 1), 64, &[&conv_args[..], &shape].concat())?,
            Some([m, wb, wa, a_neg_exp, dt_bias]) => {
                let gate_args = gdn_gate_args([m, wb, wa, a_neg_exp, dt_bias, beta, gg], nv, cfg.hidden);
                let blocks = c.div_ceil(64) + nv * n;
                dev.launch("gdn_conv_gates", (blocks as u32, 1, 1), 64, &[&conv_args[..], &shape, &gate_args].concat())?
            }
        }
        // The q/k L2 norms (q scaled by 1/sqrt(dk)) happen inside the recurrence kernel.
        let o = self.tmp(n * vd)?;
        let kernel = match dk {
            128 => "gdn_recurrent_128",
            64 => "gdn_recurrent_64",
            32 => "gdn_recurrent_32",
            16 => "gdn_recurrent_16",
            other => {
                return Err(CudaError::Unsupported(format!("Gated DeltaNet heads of {other} dims (16, 32, 64, 128)")));
            }
        };
        // One warp per block: 32 / parts state columns, each column's dk rows split into parts of at most 32.
        let parts = dk / dk.min(32);
        let cols_per_warp = 32 / parts;
        dev.launch(
            kernel,
            (nv as u32, dk.div_ceil(cols_per_warp) as u32, 1),
            32,
            &[
                Arg::Ptr(qkv),
                Arg::Ptr(beta),
                Arg::Ptr(gg),
                Arg::Ptr(self.p(s, 0)),
                Arg::Ptr(o),
                Arg::I32(n as i32),
                Arg::I32(nk as i32),
                Arg::I32(nv as i32),
                Arg::I32(c as i32),
            ],
        )?;
        Ok(o)
    }

    /// Gated attention for `n` tokens at the position in `pos_dev`; `capacity` is the state's token capacity
    /// (it sizes the QSA score rows so the launch shapes do not depend on the position).
    fn attn(
        &self,
        at: &DevAttn,
        st: &DevLayerState,
        m: u64,
        n: usize,
        pos_dev: u64,
        capacity: usize,
    ) -> Result<u64, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let DevLayerState::Attn { k: kc, v: vc, raw, pooled } = st else {
            unreachable!("state follows the layer kinds")
        };
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        let kvw = nkv * hd;
        let pq = self.tmp(n * nh * hd * 2)?;
        self.matmul(at.q.r(dev), m, n, pq)?;
        let q = self.tmp(n * nh * hd)?;
        let gate = self.tmp(n * nh * hd)?;
        dev.launch_1d(
            "attn_split_q",
            n * nh * hd,
            &[Arg::Ptr(pq), Arg::Ptr(q), Arg::Ptr(gate), Arg::I32(n as i32), Arg::I32(nh as i32), Arg::I32(hd as i32)],
        )?;
        self.rms_norm(q, self.p(&at.q_norm, 0), q, n * nh, hd, 1)?;
        self.rope(q, n, nh, nh * hd, hd, pos_dev)?;
        let kn = self.tmp(n * kvw)?;
        let vn = self.tmp(n * kvw)?;
        self.matmul(at.k.r(dev), m, n, kn)?;
        self.matmul(at.v.r(dev), m, n, vn)?;
        self.rms_norm(kn, self.p(&at.k_norm, 0), kn, n * nkv, hd, 1)?;
        self.rope(kn, n, nkv, kvw, hd, pos_dev)?;
        for (src, dst) in [(kn, kc), (vn, vc)] {
            dev.launch_1d(
                "copy_rows_at",
                n * kvw,
                &[
                    Arg::Ptr(src),
                    Arg::Ptr(self.p(dst, 0)),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(n as i32),
                    Arg::I32(kvw as i32),
                ],
            )?;
        }
        let mut selection: Option<(u64, u64, usize)> = None;
        if let Some(ix) = &at.indexer {
            let ic = cfg.indexer;
            let (nih, ihd, r) = (ic.n_heads, ic.head_dim, ix.ratio);
            let qi = self.tmp(n * nih * ihd)?;
            self.matmul(ix.q.r(dev), m, n, qi)?;
            self.rms_norm(qi, self.p(&ix.q_norm, 0), qi, n * nih, ihd, 1)?;
            self.rope(qi, n, nih, nih * ihd, ihd, pos_dev)?;
            let kr = self.tmp(n * ihd)?;
            self.matmul(ix.k.r(dev), m, n, kr)?;
            dev.launch_1d(
                "copy_rows_at",
                n * ihd,
                &[
                    Arg::Ptr(kr),
                    Arg::Ptr(self.p(raw, 0)),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(n as i32),
                    Arg::I32(ihd as i32),
                ],
            )?;
            dev.launch(
                "qsa_pool_new",
                ((n / r + 1) as u32, 1, 1),
                128,
                &[
                    Arg::Ptr(self.p(raw, 0)),
                    Arg::Ptr(self.p(pooled, 0)),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(n as i32),
                    Arg::I32(r as i32),
                    Arg::I32(ihd as i32),
                    Arg::Ptr(self.p(&ix.k_norm, 0)),
                    Arg::F32(cfg.rms_eps),
                    Arg::I32(cfg.rope_dim as i32),
                    Arg::F32(cfg.rope_theta),
                ],
            )?;
            let keep = ic.token_budget / r;
            let max_blocks = (capacity / r).max(1);
            let scores = self.tmp(n * max_blocks)?;
            dev.launch_1d(
                "qsa_scores",
                n * max_blocks * 32, // a warp per (token, block)
                &[
                    Arg::Ptr(qi),
                    Arg::Ptr(self.p(pooled, 0)),
                    Arg::Ptr(scores),
                    Arg::I32(n as i32),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(r as i32),
                    Arg::I32(nih as i32),
                    Arg::I32(ihd as i32),
                    Arg::I32(max_blocks as i32),
                ],
            )?;
            let cap = keep * r + r - 1;
            let sel = self.tmp(n * cap)?;
            let count = self.tmp(n)?;
            dev.launch(
                "qsa_select",
                (n as u32, 1, 1),
                256,
                &[
                    Arg::Ptr(scores),
                    Arg::I32(max_blocks as i32),
                    Arg::I32(keep as i32),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(r as i32),
                    Arg::Ptr(sel),
                    Arg::Ptr(count),
                    Arg::I32(cap as i32),
                ],
            )?;
            selection = Some((sel, count, cap));
        }
        let out = self.tmp(n * nh * hd)?;
        let (sp, cp, cap) = selection.unwrap_or((0, 0, 0));
        // Both attention kernels take the query, the caches and the key list first, the head shape last; the
        // output in between (the decode split writes partial sums).
        let head = [Arg::I32(nh as i32), Arg::I32(nkv as i32), Arg::I32(hd as i32), Arg::F32(1.0 / (hd as f32).sqrt())];
        let mut args = vec![
            Arg::Ptr(q),
            Arg::Ptr(self.p(kc, 0)),
            Arg::Ptr(self.p(vc, 0)),
            Arg::Ptr(sp),
            Arg::Ptr(cp),
            Arg::I32(cap as i32),
            Arg::I32(0),
            Arg::Ptr(pos_dev),
        ];
        if (n <= GEMV_MAX_TOKENS || self.exact()) && hd % 4 == 0 {
            // Decode: few queries, so the keys are split over ATTN_SPLITS blocks per query and merged after.
            let splits = ATTN_SPLITS;
            let pm = self.tmp(n * nh * splits)?;
            let pl = self.tmp(n * nh * splits)?;
            let pa = self.tmp(n * nh * splits * hd)?;
            args.extend([Arg::Ptr(pm), Arg::Ptr(pl), Arg::Ptr(pa)]);
            args.extend(head);
            dev.launch("attention_part", ((n * nh) as u32, splits as u32, 1), 128, &args)?;
            dev.launch(
                "attention_combine",
                ((n * nh) as u32, 1, 1),
                128,
                &[
                    Arg::Ptr(pm),
                    Arg::Ptr(pl),
                    Arg::Ptr(pa),
                    Arg::Ptr(out),
                    Arg::I32(splits as i32),
                    Arg::I32(hd as i32),
                ],
            )?;
        } else {
            args.push(Arg::Ptr(out));
            args.extend(head);
            if nh % nkv == 0 && nh / nkv <= 16 && hd <= 256 && hd % 32 == 0 {
                // The query heads of a kv head together: each key row read once for all of them.
                dev.launch("attention_gqa", ((n * nkv) as u32, 1, 1), 128, &args)?;
            } else {
                dev.launch("attention", ((n * nh) as u32, 1, 1), 128, &args)?;
            }
        }
        dev.launch_1d("mul_sigmoid", n * nh * hd, &[Arg::Ptr(out), Arg::Ptr(gate), Arg::I64((n * nh * hd) as i64)])?;
        let y = self.tmp(n * cfg.hidden)?;
        self.matmul(at.o.r(dev), out, n, y)?;
        Ok(y)
    }

    /// The MoE block of layer `li`: routing, the routed experts (one GEMV per token-expert slot for small
    /// batches, grouped by expert for larger ones, both without a host round trip) and the gated shared expert.
    /// With a hybrid placement the routed experts the GPU does not hold run on the CPU ([`Self::moe_hybrid_cpu`])
    /// or are streamed in ([`Self::moe_streamed`]). Returns the output `[n, d]` of the `n` tokens `m`; with
    /// `res = Some((x, a))` the combine kernel also applies the hyper-connection residual update `x += a * out`.
    fn moe(&self, li: usize, moe: &DevMoe, m: u64, n: usize, res: Option<(u64, u64)>) -> Result<u64, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let (d, e, k) = (cfg.hidden, cfg.n_expert, cfg.n_expert_used);
        if e > 1024 || k > 32 {
            return Err(CudaError::Unsupported(format!(
                "{e} experts, {k} per token (the router kernel takes up to 1024 and 32)"
            )));
        }
        let logits = self.tmp(n * e)?;
        self.matmul(moe.router.r(dev), m, n, logits)?;
        let ids = self.tmp(n * k)?;
        let w = self.tmp(n * k)?;
        // The shared expert's gate logits, computed by the router kernel's warp (d a multiple of 128: float4 loads).
        let sgate = self.tmp(n)?;
        let (sgw, sg_out) = if d.is_multiple_of(128) { (self.p(&moe.sh_gate_inp, 0), sgate) } else { (0, 0) };
        dev.launch(
            "router_topk",
            (n as u32, 1, 1),
            32,
            &[
                Arg::Ptr(logits),
                Arg::I32(e as i32),
                Arg::I32(k as i32),
                Arg::Ptr(ids),
                Arg::Ptr(w),
                Arg::Ptr(m),
                Arg::I32(d as i32),
                Arg::Ptr(sgw),
                Arg::Ptr(sg_out),
            ],
        )?;
        if sgw == 0 {
            let gi = MatRef { ty: GgmlType::F32, rows: 1, cols: d, row_bytes: 4 * d, ptr: self.p(&moe.sh_gate_inp, 0) };
            self.matmul(gi, m, n, sgate)?;
        }
        if let Some(h) = &self.hybrid {
            return if n <= h.params.cpu_max_tokens || self.exact() {
                self.moe_hybrid_cpu(h, li, moe, m, n, ids, w, sgate, res)
            } else {
                self.moe_streamed(h, li, moe, m, n, ids, w, sgate, res)
            };
        }
        let slots = n * k;
        let ys = self.tmp(slots * d)?;
        let shared = if n <= GEMV_MAX_TOKENS / 2 || self.exact() {
            // Decode: one GEMV per (token, expert) slot, expert ids read on the device.
            self.shared_and_routed(moe, m, n, Some((ids, ys)))?
        } else {
            // Prefill: slots grouped by expert on the device; each expert's weights decoded once per 8 tokens.
            let shared = self.shared_expert(moe, m, n)?;
            let (offsets, perm) = self.sort_slots(ids, slots)?;
            let views = [moe.gate.view(dev), moe.up.view(dev), moe.down.view(dev)];
            self.grouped_ffn(views, e, 0, offsets, perm, m, n, ys, false)?;
            shared
        };
        self.combine(ys, w, shared, sgate, 0, n, res)
    }

    /// The shared expert of `n` tokens `m`: its outputs `[n, d]`, before the gate (the router kernel computes the
    /// gate logits).
    fn shared_expert(&self, moe: &DevMoe, m: u64, n: usize) -> Result<u64, CudaError> {
        self.shared_and_routed(moe, m, n, None)
    }

    /// The shared expert of `n` tokens `m` (returned as in [`Self::shared_expert`]) and, with
    /// `routed = Some((ids, ys))`, the routed experts' decode GEMVs: slot `s` multiplies the stacks' matrix
    /// `ids[s]` (a slot of the stack; negative = skipped) into `ys + s * d`. Every product of `m` runs before the
    /// first activation kernel, so they all read one 8-bit form of `m`; the down projections compute and
    /// quantize `silu(g) * u` in their prologues where they can ([`Self::acts_silu`]), else a SiLU kernel does.
    fn shared_and_routed(&self, moe: &DevMoe, m: u64, n: usize, routed: Option<(u64, u64)>) -> Result<u64, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let (d, k, ff) = (cfg.hidden, cfg.n_expert_used, cfg.expert_ff);
        let sff = moe.sh_ff();
        if let Some((ids, ys)) = routed
            && let Some(parts) = self.shared_parts(moe)
        {
            return self.shared_in_routed_slots(moe, m, n, ids, ys, parts);
        }
        let (sg, su) = if n == 1 && moe.sh_up.is_none() {
            // Gate and up in one GEMV of the stacked matrix: [gate | up] for the one token, each half with the
            // threads per row it has when launched alone (as multi-token passes do).
            let both = self.tmp(2 * sff)?;
            let stack = moe.sh_gate_up.r(dev);
            let xa = self.acts(stack.ty, m, 1, d)?;
            self.gemv_as(stack, xa, 1, both, sff)?;
            (both, both + (4 * sff) as u64)
        } else {
            let (sg, su) = (self.tmp(n * sff)?, self.tmp(n * sff)?);
            self.matmul(moe.sh_gate(dev), m, n, sg)?;
            self.matmul(moe.sh_up(dev), m, n, su)?;
            (sg, su)
        };
        let slots = n * k;
        let gu = match routed {
            None => None,
            Some((ids, _)) => {
                let g = self.tmp(slots * ff)?;
                let u = self.tmp(slots * ff)?;
                let xa = self.acts(moe.gate.ty, m, n, d)?;
                if moe.up.ty == moe.gate.ty {
                    self.moe_gemv(&moe.gate, Some(&moe.up), ids, slots, xa, d, k, (g, u), None)?;
                } else {
                    self.moe_gemv(&moe.gate, None, ids, slots, xa, d, k, (g, g), None)?;
                    let xu = self.acts(moe.up.ty, m, n, d)?;
                    self.moe_gemv(&moe.up, None, ids, slots, xu, d, k, (u, u), None)?;
                }
                Some((g, u))
            }
        };
        // The SwiGLU hidden layers silu(g) * u: computed by the down projections' prologues where they can.
        let shared = self.tmp(n * d)?;
        let sh = moe.sh_down.r(dev);
        if n == 1 && self.q8_block(sh.ty, sff).is_some() {
            let xa = self.acts_silu(sh.ty, sg, su, 1, sff, false)?;
            self.gemv(sh, xa, 1, shared)?;
        } else {
            self.silu_mul_q8(sg, su, n, sff, moe.sh_down.ty)?;
            self.matmul(sh, sg, n, shared)?;
        }
        if let (Some((g, u)), Some((ids, ys))) = (gu, routed) {
            let xg = self.acts_silu(moe.down.ty, g, u, slots, ff, true)?;
            self.moe_gemv(&moe.down, None, ids, slots, xg, ff, 1, (ys, ys), None)?;
        }
        Ok(shared)
    }

    /// The parts of `expert_ff` rows the shared expert's gate and up split into when they run as extra slots of
    /// the routed gate/up launch ([`Self::shared_in_routed_slots`]): `Some(sff / ff)` when the shared gate and up
    /// are one stack of the routed gate's type (so equal row bytes), `sff` is a multiple of `ff`, the activations
    /// are 8-bit and the SiLU outputs of both down projections quantize in the same blocks; `None` otherwise
    /// (and with the GEMV prologues on, whose down projections compute their own SiLU).
    fn shared_parts(&self, moe: &DevMoe) -> Option<usize> {
        let (d, ff) = (self.config.hidden, self.config.expert_ff);
        let sff = moe.sh_ff();
        let ok = self.fuse.shared
            && moe.sh_up.is_none()
            && !self.gemv_prologue
            && moe.up.ty == moe.gate.ty
            && moe.sh_gate_up.ty == moe.gate.ty
            && moe.gate.cols == d
            && ff > 0
            && sff.is_multiple_of(ff)
            && self.q8_block(moe.gate.ty, d).is_some()
            && self.q8_block(moe.down.ty, ff).is_some()
            && self.q8_block(moe.down.ty, ff) == self.q8_block(moe.sh_down.ty, sff);
        ok.then_some(sff / ff)
    }

    /// The decode MoE of [`Self::shared_and_routed`] with the shared expert folded into the routed launches: its
    /// gate and up run as `parts` extra slots per token of the routed gate/up GEMV (slot `n k + t parts + j`: rows
    /// `[j ff, (j + 1) ff)` of token `t`), so the SwiGLU rows of the routed slots and of the shared expert are
    /// contiguous and one SiLU launch computes and quantizes them all; the shared down projection then reads token
    /// `t`'s `sff` values from there. Each row's dot product is the one the routed kernel computes for an expert
    /// row (same threads per row for every token count: batch invariance holds). Two launches fewer per layer than
    /// the separate shared-expert GEMV and SiLU. Returns the shared expert's output `[n, d]`.
    fn shared_in_routed_slots(
        &self,
        moe: &DevMoe,
        m: u64,
        n: usize,
        ids: u64,
        ys: u64,
        parts: usize,
    ) -> Result<u64, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let (d, k, ff) = (cfg.hidden, cfg.n_expert_used, cfg.expert_ff);
        let slots = n * k;
        let rows = slots + n * parts;
        let g = self.tmp(rows * ff)?;
        let u = self.tmp(rows * ff)?;
        let xa = self.acts(moe.gate.ty, m, n, d)?;
        let (sg, su) = (moe.sh_gate(dev).ptr, moe.sh_up(dev).ptr);
        self.moe_gemv(&moe.gate, Some(&moe.up), ids, slots, xa, d, k, (g, u), Some((sg, su, parts, n)))?;
        let (qx, dx, _) = self.silu_mul_q8(g, u, rows, ff, moe.down.ty)?.ok_or_else(|| {
            CudaError::Unsupported(format!("no 8-bit SiLU output for a {:?} down projection", moe.down.ty))
        })?;
        self.moe_gemv(&moe.down, None, ids, slots, Acts::Q8(qx, dx), ff, 1, (ys, ys), None)?;
        let shared = self.tmp(n * d)?;
        let off = slots * ff;
        self.gemv(moe.sh_down.r(dev), Acts::Q8(qx + off as u64, dx + (off / 32 * 4) as u64), n, shared)?;
        Ok(shared)
    }

    /// `g = silu(g) * u` over `rows` rows of `cols`, writing the 8-bit form of `g` for a consumer of type `ty`.
    /// Returns the 8-bit outputs written (`qx, dx, blk`; `None` when `ty` has no 8-bit path).
    fn silu_mul_q8(
        &self,
        g: u64,
        u: u64,
        rows: usize,
        cols: usize,
        ty: GgmlType,
    ) -> Result<Option<(u64, u64, usize)>, CudaError> {
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

    /// `out = sum_j w_j ys_j + extra + sigmoid(sgate) shared` for `n` tokens (`extra` 0 = none); with
    /// `res = Some((x, a))` also the residual update `x[t][s] += a[t][s] * out[t]` of the hyper-connection bundle.
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &self,
        ys: u64,
        w: u64,
        shared: u64,
        sgate: u64,
        extra: u64,
        n: usize,
        res: Option<(u64, u64)>,
    ) -> Result<u64, CudaError> {
        let cfg = &self.config;
        let (d, k) = (cfg.hidden, cfg.n_expert_used);
        let out = self.tmp(n * d)?;
        let (x, a) = res.unwrap_or((0, 0));
        self.dev.launch_1d(
            "moe_combine",
            n * d,
            &[
                Arg::Ptr(ys),
                Arg::Ptr(w),
                Arg::Ptr(shared),
                Arg::Ptr(sgate),
                Arg::Ptr(extra),
                Arg::Ptr(out),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(d as i32),
                Arg::Ptr(x),
                Arg::Ptr(a),
                Arg::I32(cfg.hc_count as i32),
            ],
        )?;
        Ok(out)
    }

    /// Groups the `slots` routed (token, expert) slots by expert: (`offsets` `[E + 1]`, `perm` `[slots]`).
    fn sort_slots(&self, ids: u64, slots: usize) -> Result<(u64, u64), CudaError> {
        let e = self.config.n_expert;
        let offsets = self.tmp(e + 1)?;
        let perm = self.tmp(slots)?;
        self.dev.launch(
            "moe_sort",
            (1, 1, 1),
            1024,
            &[Arg::Ptr(ids), Arg::I32(slots as i32), Arg::I32(e as i32), Arg::Ptr(offsets), Arg::Ptr(perm)],
        )?;
        Ok((offsets, perm))
    }

    /// The routed experts of `count` weight slots for prefill, grouped by expert: `views` are the gate, up and
    /// down matrices of slot 0 (slot `j` at `j * expert_bytes`), `slot_expert` maps slots to expert ids (0 = slot
    /// `j` is expert `j`). Every token slot routed to one of these experts gets its output in `ys`. With
    /// `partial`, the other slots' activations are left alone (SiLU into a separate buffer), so several calls
    /// can cover one layer's experts.
    #[allow(clippy::too_many_arguments)]
    fn grouped_ffn(
        &self,
        views: [StackView; 3],
        count: usize,
        slot_expert: u64,
        offsets: u64,
        perm: u64,
        m: u64,
        n: usize,
        ys: u64,
        partial: bool,
    ) -> Result<(), CudaError> {
        let cfg = &self.config;
        let (d, k, ff) = (cfg.hidden, cfg.n_expert_used, cfg.expert_ff);
        let slots = n * k;
        let [gate, up, down] = views;
        let g = self.tmp(slots * ff)?;
        let u = self.tmp(slots * ff)?;
        for (view, out) in [(gate, g), (up, u)] {
            let xa = self.acts(view.ty, m, n, d)?;
            self.moe_grouped(view, count, slot_expert, offsets, perm, xa, k, d, out, slots)?;
        }
        let h = if partial {
            let h = self.tmp(slots * ff)?;
            self.dev.launch_1d(
                "silu_mul_into",
                slots * ff,
                &[Arg::Ptr(g), Arg::Ptr(u), Arg::Ptr(h), Arg::I64((slots * ff) as i64)],
            )?;
            h
        } else {
            self.silu_mul_q8(g, u, slots, ff, down.ty)?;
            g
        };
        let xh = self.acts(down.ty, h, slots, ff)?;
        self.moe_grouped(down, count, slot_expert, offsets, perm, xh, 1, ff, ys, slots)
    }

    /// Hybrid MoE for a short batch (decode, verification): see [`hybrid`]. The GPU splits each token's experts
    /// (`hybrid_split`), one copy brings the MoE input, ids and CPU weights to the host, the CPU computes its
    /// experts while the GPU runs the shared and resident ones, and one copy brings the CPU's weighted sum back.
    #[allow(clippy::too_many_arguments)]
    fn moe_hybrid_cpu(
        &self,
        h: &hybrid::Hybrid,
        li: usize,
        moe: &DevMoe,
        m: u64,
        n: usize,
        ids: u64,
        w: u64,
        sgate: u64,
        res: Option<(u64, u64)>,
    ) -> Result<u64, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let (d, k) = (cfg.hidden, cfg.n_expert_used);
        let stream = dev.stream();
        let hl = &h.layers[li];
        let slots = n * k;
        let gpu_slot = self.tmp(slots)?;
        let w_gpu = self.tmp(slots)?;
        let pack_len = n * d + 2 * slots + n;
        let pack = self.tmp(pack_len)?;
        dev.launch_1d(
            "hybrid_split",
            (n * d).max(n),
            &[
                Arg::Ptr(m),
                Arg::Ptr(ids),
                Arg::Ptr(w),
                Arg::Ptr(ptr(&hl.slot_of, stream, 0)),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(d as i32),
                Arg::F32(h.params.handoff),
                Arg::F32(h.params.omit),
                Arg::Ptr(gpu_slot),
                Arg::Ptr(w_gpu),
                Arg::Ptr(pack),
                Arg::Ptr(self.coverage_out.load(std::sync::atomic::Ordering::Relaxed)),
            ],
        )?;
        let mut bufs = h.bufs.lock().expect("hybrid buffers lock");
        hybrid::dtoh(stream, bufs.pack.addr(), pack, pack_len * 4)?;
        h.packed.record(stream)?;
        // The GPU's share, queued before the host waits: it runs while the CPU computes.
        let ys = self.tmp(slots * d)?;
        let routed = (!hl.resident.is_empty()).then_some((gpu_slot, ys));
        let shared = self.shared_and_routed(moe, m, n, routed)?;
        let t_wait = std::time::Instant::now();
        h.packed.synchronize()?;
        let waited = t_wait.elapsed();
        if h.resumed_live.swap(false, std::sync::atomic::Ordering::Relaxed)
            && let Ok(ms) = h.resumed.elapsed_ms(&h.packed)
        {
            h.gpu_ns.fetch_add((ms as f64 * 1e6) as u64, std::sync::atomic::Ordering::Relaxed);
        }
        let host = bufs.pack.slice(pack_len).to_vec();
        let (x, rest) = host.split_at(n * d);
        let (ids_h, rest) = rest.split_at(slots);
        let (w_cpu, flags) = rest.split_at(slots);
        let mut routing = Vec::with_capacity(n);
        let (mut on_gpu, mut omitted, mut handoffs) = (0u64, 0u64, 0u64);
        for (t, flag) in flags.iter().enumerate() {
            // 1: handed off; 2: a verify row below the handoff threshold (not trusted, no CPU experts).
            let untrusted = flag.to_bits() == 2;
            let handoff = flag.to_bits() == 1;
            handoffs += u64::from(handoff);
            let mut r = crate::model::moe::Routing { experts: Vec::new(), weights: Vec::new() };
            for j in t * k..(t + 1) * k {
                let e = ids_h[j].to_bits() as usize;
                if w_cpu[j] > 0.0 {
                    r.experts.push(e);
                    r.weights.push(w_cpu[j]);
                } else if !handoff && hl.resident.binary_search(&e).is_ok() {
                    on_gpu += 1;
                } else if !untrusted {
                    omitted += 1;
                }
            }
            routing.push(r);
        }
        use std::sync::atomic::Ordering::Relaxed;
        h.wait_ns.fetch_add(waited.as_nanos() as u64, Relaxed);
        h.trips.fetch_add(1, Relaxed);
        h.stats.hit(crate::placement::Tier::Gpu, on_gpu);
        // Experts the CPU computes count by where their weights are read from (a GPU-tier expert from its RAM copy).
        if let Some(tiers) = h.host.expert_tiers().and_then(|t| t.get(li)) {
            for r in &routing {
                for &e in &r.experts {
                    let t = tiers[e];
                    h.stats.hit(if t == crate::placement::Tier::Gpu { crate::placement::Tier::Ram } else { t }, 1);
                }
            }
        }
        h.stats.omitted.fetch_add(omitted, Relaxed);
        h.stats.handoffs.fetch_add(handoffs, Relaxed);
        let mut extra = 0;
        if routing.iter().any(|r| !r.experts.is_empty()) {
            extra = self.tmp(n * d)?;
            match &h.cpu {
                Some(cpu) => {
                    // Pipelined: the CPU thread computes while this thread enqueues the rest of the step; the
                    // stream waits for its flag before copying the result.
                    cpu.submit(stream, li, x.to_vec(), n, routing)?;
                    hybrid::htod(stream, extra, cpu.upload.addr() as *const u8, n * d * 4)?;
                }
                None => {
                    let t_cpu = std::time::Instant::now();
                    let y = h.host.cpu_routed(li, x, n, &routing)?;
                    h.cpu_ns.fetch_add(t_cpu.elapsed().as_nanos() as u64, Relaxed);
                    bufs.upload.slice_mut(n * d).copy_from_slice(&y);
                    hybrid::htod(stream, extra, bufs.upload.addr() as *const u8, n * d * 4)?;
                }
            }
            h.stats.pcie_bytes.fetch_add((n * d * 4) as u64, Relaxed);
        }
        h.stats.pcie_bytes.fetch_add((pack_len * 4) as u64, Relaxed);
        h.resumed.record(stream)?;
        h.resumed_live.store(true, Relaxed);
        self.combine(ys, w_gpu, shared, sgate, extra, n, res)
    }

    /// Hybrid MoE for a long batch (prefill): the resident experts from the expert cache, every other expert of
    /// the layer streamed from host RAM in groups through the ring of staging buffers (see [`hybrid`]).
    #[allow(clippy::too_many_arguments)]
    fn moe_streamed(
        &self,
        h: &hybrid::Hybrid,
        li: usize,
        moe: &DevMoe,
        m: u64,
        n: usize,
        ids: u64,
        w: u64,
        sgate: u64,
        res: Option<(u64, u64)>,
    ) -> Result<u64, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let (d, k) = (cfg.hidden, cfg.n_expert_used);
        let stream = dev.stream();
        let hl = &h.layers[li];
        let slots = n * k;
        let shared = self.shared_expert(moe, m, n)?;
        let ys = self.tmp(slots * d)?;
        let (offsets, perm) = self.sort_slots(ids, slots)?;
        if !hl.resident.is_empty() {
            let views = [moe.gate.view(dev), moe.up.view(dev), moe.down.view(dev)];
            let se = ptr(&hl.resident_dev, stream, 0);
            self.grouped_ffn(views, hl.resident.len(), se, offsets, perm, m, n, ys, true)?;
        }
        let group = h.params.stage_experts;
        let copy = &h.copy;
        let groups: Vec<&[usize]> = hl.streamed.chunks(group).collect();
        if let Some(first) = groups.first() {
            h.host.request_experts(li, first);
        }
        for (gi, experts) in groups.iter().enumerate() {
            // SSD-tier experts of the next group are read while this one is copied and computed.
            if let Some(next) = groups.get(gi + 1) {
                h.host.request_experts(li, next);
            }
            let stage = &h.stages[h.stage_turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % h.stages.len()];
            // The copy waits until the kernels that last read this buffer have run.
            copy.wait(&stage.free)?;
            let timing = h.copy_log.as_ref().map(|_| -> Result<[CudaEvent; 4], CudaError> {
                let ev = || dev.gpu.ctx.new_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT));
                Ok([ev()?, ev()?, ev()?, ev()?])
            });
            let timing = timing.transpose()?;
            if let Some(t) = &timing {
                t[0].record(copy)?;
            }
            let copied = hybrid::stage_group(copy, &h.host, li, experts, stage)?;
            stage.ready.record(copy)?;
            stream.wait(&stage.ready)?;
            if let Some(t) = &timing {
                t[1].record(copy)?;
                t[2].record(stream)?;
            }
            let views = [
                StackView { ptr: hybrid::stage_ptr(&stage.gate, stream, 0), ..moe.gate.view(dev) },
                StackView { ptr: hybrid::stage_ptr(&stage.up, stream, 0), ..moe.up.view(dev) },
                StackView { ptr: hybrid::stage_ptr(&stage.down, stream, 0), ..moe.down.view(dev) },
            ];
            let se = ptr(&hl.streamed_dev, stream, gi * group);
            // The group's activations are dead once its kernels are queued: the next group reuses them.
            let mark = self.arena_mark();
            self.grouped_ffn(views, experts.len(), se, offsets, perm, m, n, ys, true)?;
            self.arena_release(mark);
            stage.free.record(stream)?;
            if let (Some(t), Some(log)) = (timing, &h.copy_log) {
                t[3].record(stream)?;
                log.lock().expect("copy log lock").push((t, copied));
            }
            h.stats.pcie_bytes.fetch_add(copied as u64, std::sync::atomic::Ordering::Relaxed);
        }
        self.combine(ys, w, shared, sgate, 0, n, res)
    }

    fn lanes(cols: usize) -> u32 {
        if cols / 32 >= 24 { 32 } else { 16 }
    }

    /// Activations of `n` rows of `cols` for weights of type `ty`: quantized to 8 bits when the type has an
    /// integer GEMV path ([`Self::q8_block`]), else the f32 rows as they are.
    fn acts(&self, ty: GgmlType, x: u64, n: usize, cols: usize) -> Result<Acts, CudaError> {
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
    fn acts_silu(
        &self,
        ty: GgmlType,
        x: u64,
        x2: u64,
        rows: usize,
        cols: usize,
        per_row: bool,
    ) -> Result<Acts, CudaError> {
        if let Some(blk) = self.q8_block(ty, cols)
            && self.gemv_prologue
            && cols <= PRO_MAX_COLS
            && (rows == 1 || per_row)
        {
            return Ok(Acts::Pro(Pro { x, x2, scale: 1.0, blk, aux: 0, aux_n: 0 }));
        }
        self.silu_mul_q8(x, x2, rows, cols, ty)?;
        self.acts(ty, x, rows, cols)
    }

    /// Routed-expert GEMVs for decode: slot `s` multiplies expert `ids[s]` of `stack` with the activations of
    /// token `s / slots_per_x` into `y.0`. With `second` (same shape and type), the same slots also multiply it
    /// into `y.1` (gate and up: one launch on 8-bit activations, two on f32). With `dense = Some((w0, w1, parts,
    /// tokens))` (8-bit activations and `second` only), `tokens * parts` more slots follow the `slots` routed
    /// ones: slot `slots + t * parts + j` multiplies rows `[j * rows, (j + 1) * rows)` of the matrices at `w0`
    /// and `w1` (of the stack's type and row bytes) with token `t`'s activations (the kernel's `MoeShared`).
    #[allow(clippy::too_many_arguments)]
    fn moe_gemv(
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
                let lanes = Self::gemv_lanes(tasks, stack.rows * self.config.n_expert_used, GEMV_MIN_THREADS);
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
                let lanes = Self::gemv_lanes(tasks, stack.rows * self.config.n_expert_used, GEMV_MIN_THREADS);
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
    fn moe_grouped(
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
            && self.tensor_cores
            && w.cols.is_multiple_of(MMA_K)
        {
            // Slot tiles of 32 per expert split over blockIdx.z: about two per block for the layer's mean load.
            let tiles = (2 * slots).div_ceil(self.config.n_expert * MMA_SLOTS).clamp(1, 8);
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
                (format!("moe_grouped_{sfx}"), 256, Self::lanes(w.cols) as usize)
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
    fn mma(
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

    #[allow(clippy::too_many_arguments)]
    fn get_rows(
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
        if w.cols % 32 == 0 {
            self.dev.launch_1d(&format!("get_rows_{sfx}"), n * (w.cols / 32), &args)?;
        } else {
            self.dev.launch_1d(&format!("get_rows_elem_{sfx}"), n * w.cols, &args)?;
        }
        Ok(())
    }

    /// The PLE block for `n` tokens whose table row ids are already on the device (`rows`, `[n][heads]`).
    /// The PLE block on `x`: the n-gram rows `rows` gathered from the device table, or, in hybrid mode, `emb`
    /// (the rows already decoded on the host and uploaded, `[n, heads * head_dim]`).
    #[allow(clippy::too_many_arguments)]
    fn ple(
        &self,
        ple: &DevPle,
        conv_state: &CudaSlice<f32>,
        x: u64,
        rows: u64,
        emb: Option<u64>,
        n: usize,
        rec: Option<u64>,
    ) -> Result<(), CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let (s, d) = (cfg.hc_count, cfg.hidden);
        let dim = s * d;
        let heads = ple.cfg.n_heads();
        let pe = heads * ple.cfg.head_dim;
        let emb = match (emb, &ple.table) {
            (Some(e), _) => e,
            (None, Some(table)) => {
                let e = self.tmp(n * pe)?;
                self.get_rows(table, rows, n * heads, e, ple.cfg.head_dim, 1)?;
                e
            }
            (None, None) => {
                return Err(CudaError::Unsupported("the n-gram rows of a host-side table were not uploaded".into()));
            }
        };
        let key = self.tmp(n * dim)?;
        self.matmul(ple.key.r(dev), emb, n, key)?;
        let value = self.tmp(n * d)?;
        self.matmul(ple.value.r(dev), emb, n, value)?;
        self.rms_norm(key, self.p(&ple.norm_key, 0), key, n * s, d, s)?;
        let qn = self.tmp(n * dim)?;
        self.rms_norm(x, self.p(&ple.norm_query, 0), qn, n * s, d, s)?;
        let u = self.tmp(n * dim)?;
        dev.launch(
            "ple_gate",
            ((n * s) as u32, 1, 1),
            128,
            &[Arg::Ptr(key), Arg::Ptr(qn), Arg::Ptr(value), Arg::Ptr(u), Arg::I32(s as i32), Arg::I32(d as i32)],
        )?;
        let nrm = self.tmp(n * dim)?;
        self.rms_norm(u, self.p(&ple.norm_conv, 0), nrm, n * s, d, s)?;
        if let Some(r) = rec {
            self.dtod(r, nrm, n * dim)?;
        }
        self.ple_conv_rows(ple, conv_state, nrm, u, n)?;
        dev.launch_1d("add_inplace", n * dim, &[Arg::Ptr(x), Arg::Ptr(u), Arg::I64((n * dim) as i64)])?;
        Ok(())
    }

    /// The PLE causal conv over `n` normalised rows `nrm` (`[n, S*d]`) into `u`, updating the conv state (the
    /// part of the PLE block a verify rollback replays).
    fn ple_conv_rows(
        &self,
        ple: &DevPle,
        conv_state: &CudaSlice<f32>,
        nrm: u64,
        u: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let dim = self.config.hc_dim();
        if ple.cfg.conv_state_len() + 1 > 32 {
            return Err(CudaError::Unsupported("PLE conv history over 31 steps".into()));
        }
        self.dev.launch(
            "ple_conv",
            (dim.div_ceil(256) as u32, 1, 1),
            256,
            &[
                Arg::Ptr(nrm),
                Arg::Ptr(self.p(conv_state, 0)),
                Arg::Ptr(self.p(&ple.conv, 0)),
                Arg::Ptr(u),
                Arg::I32(n as i32),
                Arg::I32(dim as i32),
                Arg::I32(ple.cfg.conv_kernel as i32),
                Arg::I32(ple.cfg.ngram_size as i32),
            ],
        )?;
        Ok(())
    }

    /// Sets the masked vocabulary ids of `rows` logits rows at `logits` to -inf.
    fn mask_logits(&self, logits: u64, rows: usize) -> Result<(), CudaError> {
        if self.n_masked == 0 {
            return Ok(());
        }
        let cfg = &self.config;
        self.dev.launch_1d(
            "mask_logits",
            rows * cfg.vocab,
            &[
                Arg::Ptr(logits),
                Arg::I32(rows as i32),
                Arg::I32(cfg.vocab as i32),
                Arg::Ptr(ptr(&self.masked, self.dev.stream(), 0)),
                Arg::I32(self.n_masked as i32),
            ],
        )?;
        Ok(())
    }

    /// Table rows of the PLE hash heads for `tokens`, advancing the host-side n-gram context.
    fn ple_rows(&self, st: &mut CudaState, tokens: &[u32]) -> Result<Vec<i32>, CudaError> {
        let Some(ple) = self.layers.iter().find_map(|l| l.ple.as_ref()) else { return Ok(Vec::new()) };
        let rows = crate::model::ple::ngram_rows(&ple.cfg, &st.ple_context, tokens);
        let ctx = st.ple_context.len();
        let mut hist = st.ple_context.clone();
        hist.extend_from_slice(tokens);
        st.ple_context.copy_from_slice(&hist[hist.len() - ctx..]);
        let table_rows = ple.table_rows as u64;
        rows.iter()
            .map(|&r| {
                if r < table_rows {
                    Ok(r as i32)
                } else {
                    Err(CudaError::Unsupported(format!("n-gram row {r} past the table of {table_rows} rows")))
                }
            })
            .collect()
    }

    /// Every launch of one forward pass of `n` tokens (ids and PLE rows already on the device, the position in
    /// `st.pos_dev`), ending with the logits of `rows` tokens from `r0` in `logits` (when `rows > 0`). Issues no
    /// host synchronisation, so the decode step can be captured as a CUDA Graph.
    #[allow(clippy::too_many_arguments)]
    fn launch_pass(
        &self,
        st: &CudaState,
        n: usize,
        ids: u64,
        ple_rows: u64,
        ple_emb: Option<u64>,
        r0: usize,
        rows: usize,
        logits: u64,
        rec: Option<&mtp::ChainBufs>,
    ) -> Result<u64, CudaError> {
        let cfg = &self.config;
        let dev = &self.dev;
        let (s, d) = (cfg.hc_count, cfg.hidden);
        let dim = s * d;
        let pos_dev = ptr(&st.pos_dev, dev.stream(), 0);
        dev.set_pass_tokens(n);
        if let Some(r) = rec {
            self.save_chain_states(st, r)?;
        }
        self.phase("start")?;
        let x = self.tmp(n * dim)?;
        self.get_rows(&self.embed, ids, n, x, dim, s)?;
        self.phase("embedding")?;
        for (li, layer) in self.layers.iter().enumerate() {
            // A layer's temporaries are dead once its output is in `x`: the next layer reuses their memory, so a
            // pass needs one layer's worth of scratch, not the sum over layers.
            let mark = self.arena_mark();
            if let Some(ple) = &layer.ple {
                let conv = st.ple_conv.as_ref().expect("PLE state exists with a PLE layer");
                self.ple(ple, conv, x, ple_rows, ple_emb, n, rec.and_then(|r| r.ple_rec(self)))?;
                self.phase("ple")?;
            }
            let m_for = match &layer.mixer {
                DevMixer::Gdn(g) => g.qkvz.ty,
                DevMixer::Attn(at) => at.q.ty,
            };
            let (m, a) = self.hc_mix(&layer.attn_hc, x, n, Some(m_for), None)?;
            self.phase("hyper-connections")?;
            let ls = &st.layers[li];
            let y = match &layer.mixer {
                DevMixer::Gdn(g) => {
                    let y = self.gdn(g, ls, m, n, rec.and_then(|r| r.gdn_rec(self, li)))?;
                    self.phase("gated deltanet")?;
                    y
                }
                DevMixer::Attn(at) => {
                    let y = self.attn(at, ls, m, n, pos_dev, st.max_len)?;
                    self.phase("attention + qsa")?;
                    y
                }
            };
            let a = a.expect("layers inject");
            let (m, a) = self.hc_mix(&layer.mlp_hc, x, n, Some(layer.moe.sh_gate_up.ty), Some((y, a)))?;
            self.phase("hyper-connections")?;
            self.moe(li, &layer.moe, m, n, Some((x, a.expect("layers inject"))))?;
            self.phase("moe")?;
            self.arena_release(mark);
        }
        if let Some(r) = rec {
            self.dtod(r.banks_rec(self), x, n * dim)?;
        }
        if rows == 0 {
            return Ok(x);
        }
        let (h, _) = self.hc_mix(&self.mixer, x + (r0 * dim * 4) as u64, rows, Some(self.lm_head.ty), None)?;
        self.matmul(self.lm_head.r(dev), h, rows, logits)?;
        self.phase("head")?;
        self.mask_logits(logits, rows)?;
        Ok(x)
    }

    /// Enqueues a pass on fresh arena space: eagerly on its first use, captured as a CUDA Graph into `slot` on the
    /// next (`seen` counts uses) and replayed from there while the arena keeps its buffers. `enqueue` returns an
    /// address the caller reads after the pass (kept with the graph and returned on replays); it must issue no host
    /// synchronisation and use only buffers whose addresses do not change between uses.
    fn run_graphed(
        &self,
        slot: &mut Option<DecodeGraph>,
        seen: &mut usize,
        enqueue: impl FnOnce() -> Result<u64, CudaError>,
    ) -> Result<u64, CudaError> {
        let stream = self.dev.stream().clone();
        let generation = {
            let mut arena = self.arena.lock().expect("arena lock");
            arena.reset(&self.dev)?;
            arena.generation
        };
        if self.graphs
            && let Some(g) = slot.as_ref().filter(|g| g.arena_generation == generation)
        {
            g.graph.launch()?;
            self.arena.lock().expect("arena lock").used = g.arena_used;
            return Ok(g.bank);
        }
        let capture = self.graphs && *seen >= 1;
        *seen += 1;
        if !capture {
            return enqueue();
        }
        stream.begin_capture(driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let out = enqueue();
        let graph = stream.end_capture(driver_sys::CUgraphInstantiate_flags(0))?;
        let bank = out?;
        let (arena_generation, arena_used) = {
            let a = self.arena.lock().expect("arena lock");
            (a.generation, a.used)
        };
        let graph = graph.ok_or_else(|| CudaError::Unsupported("a captured pass produced no graph".into()))?;
        graph.launch()?;
        *slot = Some(DecodeGraph { graph, arena_generation, bank, arena_used });
        Ok(bank)
    }

    /// Runs `tokens` through the model on the GPU, continuing `st`, and returns the logits asked for
    /// (`[rows, vocab]`, masked ids at `-inf`), as [`Qwen4Exp::forward`] does on the CPU. Single-token steps that
    /// want the last logits run as a CUDA Graph captured on the state's second such step (disable with
    /// `NEBULA_CUDA_GRAPHS=0`).
    pub fn forward(&self, st: &mut CudaState, tokens: &[u32], want: LogitsFor) -> Result<Vec<f32>, CudaError> {
        self.forward_guarded(st, tokens, want, None)
    }

    /// [`CudaModel::forward`], recording into `rec` for a verify pass (see [`mtp`]).
    fn forward_guarded(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
        want: LogitsFor,
        rec: Option<&mtp::ChainBufs>,
    ) -> Result<Vec<f32>, CudaError> {
        use std::sync::atomic::Ordering::Relaxed;
        if let Some(r) = rec {
            self.exact_rows.store(true, Relaxed);
            if self.verify_reports_coverage() {
                self.coverage_out.store(r.coverage_rec(self), Relaxed);
            }
        }
        let out = self.forward_inner(st, tokens, want, rec);
        self.exact_rows.store(false, Relaxed);
        self.coverage_out.store(0, Relaxed);
        // A failed CPU job of hybrid decode (an SSD read error) fails the call; its state must be discarded.
        if let Some(e) = self.hybrid.as_ref().and_then(|h| h.cpu.as_ref()).and_then(|c| c.take_error()) {
            if out.is_err() {
                // The stream may still hold work that waits on the CPU thread, which signals even on errors.
                let _ = self.dev.stream().synchronize();
            }
            return Err(e.into());
        }
        if out.is_err() && self.hybrid.is_some() {
            // Let every enqueued wait drain (the CPU thread signals each job) before the next call.
            let _ = self.dev.stream().synchronize();
        }
        out
    }

    fn forward_inner(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
        want: LogitsFor,
        rec: Option<&mtp::ChainBufs>,
    ) -> Result<Vec<f32>, CudaError> {
        let cfg = &self.config;
        if let Some(h) = &self.hybrid {
            // The GPU's critical path of this step starts here.
            h.resumed.record(self.dev.stream())?;
            h.resumed_live.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let dev = &self.dev;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
            return Err(crate::model::ModelError::TokenOutOfRange { token: bad, vocab: cfg.vocab }.into());
        }
        let needed = st.pos + tokens.len();
        if needed > st.max_len {
            return Err(crate::model::ModelError::ContextOverflow { needed, limit: st.max_len }.into());
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let stream = dev.stream().clone();
        let ple_rows = self.ple_rows(st, tokens)?;
        // Hybrid: the n-gram table stays on the host; the rows this pass reads are decoded there and uploaded
        // (n x heads rows of head_dim values: 10 KiB a token for the real model). Kept alive until the pass is
        // queued; the free is stream-ordered.
        let ple_emb: Option<CudaSlice<f32>> = match &self.hybrid {
            Some(h) if !ple_rows.is_empty() => {
                let rows: Vec<u64> = ple_rows.iter().map(|&r| r as u64).collect();
                match h.host.gather_ngram_rows(&rows)? {
                    Some(emb) => {
                        h.stats.pcie_bytes.fetch_add((emb.len() * 4) as u64, std::sync::atomic::Ordering::Relaxed);
                        Some(stream.clone_htod(&emb)?)
                    }
                    None => None,
                }
            }
            _ => None,
        };
        let ple_emb_ptr = ple_emb.as_ref().map(|e| ptr(e, &stream, 0));
        stream.memcpy_htod(&[st.pos as i32], &mut st.pos_dev)?;
        let pos0 = st.pos;
        let decode_step = n == 1 && want == LogitsFor::Last && rec.is_none();
        if decode_step {
            stream.memcpy_htod(&[tokens[0] as i32], &mut st.step.token)?;
            if !ple_rows.is_empty() {
                stream.memcpy_htod(&ple_rows, &mut st.step.ple_rows)?;
            }
            let ids = ptr(&st.step.token, &stream, 0);
            let rows = ptr(&st.step.ple_rows, &stream, 0);
            let logits = ptr(&st.step.logits, &stream, 0);
            let mut slot = st.graph.take();
            let mut seen = st.decode_steps;
            let bank = self.run_graphed(&mut slot, &mut seen, || {
                self.launch_pass(st, 1, ids, rows, ple_emb_ptr, 0, 1, logits, None)
            });
            st.graph = slot;
            let bank = bank?;
            st.decode_steps += 1;
            st.pos = needed;
            self.mtp_extend(st, bank, tokens, pos0)?;
            if st.want_argmax {
                // Greedy: the token is chosen on the device; 4 bytes come back instead of the vocabulary.
                let choice = ptr(&st.step.choice, &stream, 0);
                dev.launch(
                    "argmax_rows",
                    (1, 1, 1),
                    1024,
                    &[Arg::Ptr(logits), Arg::I32(cfg.vocab as i32), Arg::Ptr(choice)],
                )?;
                let id = stream.clone_dtoh(&st.step.choice)?[0];
                st.argmax_out = u32::try_from(id).ok();
                return Ok(Vec::new());
            }
            return Ok(stream.clone_dtoh(&st.step.logits)?);
        }
        if let Some(bufs) = rec.filter(|_| self.graphs && want == LogitsFor::All && n <= mtp::MAX_CHAIN_ROWS) {
            // A verify pass: fixed buffers, so it replays as a CUDA Graph per chain length.
            let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
            let (ids_p, rows_p, logits_p) = bufs.pass_buffers(self);
            hybrid::htod(&stream, ids_p, ids.as_ptr() as *const u8, n * 4)?;
            if !ple_rows.is_empty() {
                hybrid::htod(&stream, rows_p, ple_rows.as_ptr() as *const u8, ple_rows.len() * 4)?;
            }
            let mut graphs = std::mem::take(&mut st.verify_graphs);
            let out = {
                let (slot, seen) = &mut graphs[n];
                self.run_graphed(slot, seen, || self.launch_pass(st, n, ids_p, rows_p, None, 0, n, logits_p, rec))
            };
            st.verify_graphs = graphs;
            out?;
            st.pos = needed;
            let mut logits = vec![0f32; n * cfg.vocab];
            hybrid::dtoh(&stream, logits.as_mut_ptr() as *mut std::ffi::c_void, logits_p, n * cfg.vocab * 4)?;
            stream.synchronize()?;
            return Ok(logits);
        }
        // Prefill (or a multi-token step): eager launches on fresh temporaries.
        self.arena.lock().expect("arena lock").reset(dev)?;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let ids_d = stream.clone_htod(&ids)?;
        let rows_d = stream.clone_htod(if ple_rows.is_empty() { &[0i32][..] } else { &ple_rows[..] })?;
        let (r0, rows) = match want {
            LogitsFor::None => (0, 0),
            LogitsFor::Last => (n - 1, 1),
            LogitsFor::All => (0, n),
        };
        let logits = zeros(dev, (rows * cfg.vocab).max(1))?;
        let (ids_p, rows_p) = (ptr(&ids_d, &stream, 0), ptr(&rows_d, &stream, 0));
        let bank = self.launch_pass(st, n, ids_p, rows_p, ple_emb_ptr, r0, rows, self.p(&logits, 0), rec)?;
        st.pos = needed;
        if rec.is_none() {
            // A verify pass's MTP rows wait for its rollback, which knows the kept rows.
            self.mtp_extend(st, bank, tokens, pos0)?;
        }
        if rows == 0 {
            stream.synchronize()?;
            return Ok(Vec::new());
        }
        let mut out = stream.clone_dtoh(&logits)?;
        out.truncate(rows * cfg.vocab);
        Ok(out)
    }
}

/// Bytes of weights [`CudaModel::from_cpu`] uploads (checked against the VRAM budget before allocating): the
/// dense trunk (every tensor of the file but the routed experts and the n-gram table; the MTP block with its
/// experts, which the hybrid model keeps on the host), the embedding, the table (all-GPU only), and the routed experts
/// `resident` holds (all when `None`).
fn estimate_weight_bytes(model: &Qwen4Exp, resident: Option<&[Vec<usize>]>) -> usize {
    let (dense, experts, table) = model.weight_bytes();
    let size =
        |e: &crate::model::moe::Expert| e.gate_proj.bytes().len() + e.up_proj.bytes().len() + e.down_proj.bytes().len();
    let held = match resident {
        Some(r) => {
            r.iter().zip(&model.layers).map(|(r, l)| r.iter().map(|&e| size(&l.mlp.experts[e])).sum::<usize>()).sum()
        }
        None => experts as usize,
    };
    // In hybrid mode (`resident` given) the n-gram table and the MTP block's routed experts stay on the host.
    let table = if resident.is_some() { 0 } else { table as usize };
    let mtp_experts = if resident.is_some() { model.mtp_routed_expert_bytes() as usize } else { 0 };
    (dense as usize + model.embed_tokens.bytes().len() + table + held).saturating_sub(mtp_experts)
}

/// Which layer kinds a model has (for reports).
pub fn describe(cfg: &ModelConfig) -> String {
    let gdn = cfg.layer_kinds.iter().filter(|k| **k == LayerKind::LinearAttention).count();
    format!("{} layers ({gdn} Gated DeltaNet, {} attention)", cfg.n_layer, cfg.n_layer - gdn)
}

/// True when an NVIDIA driver library is installed (no CUDA call is made).
pub fn driver_present() -> bool {
    nebula_kernels::find_cuda_driver().is_some()
}

#[cfg(test)]
mod tests {
    use super::{Fusions, parse_gemv_depth};

    #[test]
    fn fusions_parse_lists_and_name_unknown_entries() {
        assert_eq!(Fusions::parse(None).unwrap(), Fusions::ALL);
        assert_eq!(Fusions::parse(Some("0")).unwrap(), Fusions { shared: false, qkvz: false, gates: false });
        assert_eq!(Fusions::parse(Some("qkvz, gates")).unwrap(), Fusions { shared: false, qkvz: true, gates: true });
        let e = Fusions::parse(Some("shared,router")).unwrap_err().to_string();
        assert!(e.contains("NEBULA_CUDA_FUSE") && e.contains("\"router\""), "{e}");
    }

    #[test]
    fn gemv_depth_is_two_or_four_and_names_the_variable_otherwise() {
        assert_eq!(parse_gemv_depth(None).unwrap(), 2);
        assert_eq!(parse_gemv_depth(Some("4")).unwrap(), 4);
        assert_eq!(parse_gemv_depth(Some(" 2 ")).unwrap(), 2);
        for bad in ["3", "8", "deep", ""] {
            let e = parse_gemv_depth(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("NEBULA_CUDA_GEMV_DEPTH") && e.contains(&format!("{bad:?}")), "{e}");
        }
    }
}
