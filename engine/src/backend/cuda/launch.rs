//! The launch context every block's `forward` takes ([`Launch`]): the device, the model's shapes, the arena of
//! temporaries, the 8-bit activation cache, the tuning flags in effect and the profiling clock. It sits below the
//! blocks and knows nothing of them; the GEMV geometry (`gemv.rs`), the norms (`norm.rs`), rope (`rope.rs`) and
//! the CUDA Graphs (`graphs.rs`) are its methods.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use nebula_kernels::cudarc::driver::{CudaSlice, DeviceRepr};

use super::CudaError;
use super::device::{Dev, dtod, ptr};
use super::gemv::Q8Cache;
use super::memory::{Arena, ArenaMark};
use crate::model::config::ModelConfig;
use crate::tuning::{CudaFusions, CudaProfile, CudaTuning};

/// The tuning flags a launch consults, resolved against the device at load ([`CudaTuning`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaunchFlags {
    /// Decode steps replay as CUDA Graphs (never in hybrid mode, never while profiling).
    pub(crate) graphs: bool,
    /// 8-bit activations for the GEMVs of the types with an integer path (`Launch::q8_block`)
    /// ([`CudaTuning::q8_activations`]).
    pub(crate) q8_acts: bool,
    /// Down projections and hyper-connection up projections compute and quantize their input themselves
    /// (`Acts::Pro`) ([`CudaTuning::gemv_prologue`]).
    pub(crate) gemv_prologue: bool,
    /// The launch size below which a dense decode GEMV widens its rows (`Launch::gemv_lanes`).
    pub(crate) gemv_min_threads: usize,
    /// One-token dense decode GEMVs on 8-bit activations keep four tasks per thread in flight (`gemvqd_*`) with
    /// rows widened so that no thread has more than four tasks (`Launch::dense_lanes`); two otherwise.
    pub(crate) gemv_deep: bool,
    /// Which independent pieces of decode work share launches.
    pub(crate) fuse: CudaFusions,
    /// Routed experts and quantized dense matmuls of prefill batches (over `GEMV_MAX_TOKENS` tokens) on tensor
    /// cores (`moe_groupedmma_*`, int8 MMA, compute capability 8.0 and newer) where the type has an 8-bit path
    /// (needs `q8_acts`) and the column count is a multiple of 128; otherwise the dp4a expert kernel
    /// (`moe_groupedq_*`, the same integer dot products) and f32 cuBLAS for dense matmuls.
    pub(crate) tensor_cores: bool,
    /// The most rows of a fast batched pass whose 8-bit products take the mid-size kernels (`gemvqm_*`,
    /// `moe_gemvqg_*`; 0: none) ([`CudaTuning::mid_rows`], `Launch::mid`).
    pub(crate) mid_rows: usize,
}

impl LaunchFlags {
    pub(crate) fn new(tuning: &CudaTuning, capability_major: i32) -> Self {
        Self {
            graphs: tuning.graphs_in_effect(),
            q8_acts: tuning.q8_activations,
            gemv_prologue: tuning.gemv_prologue,
            gemv_min_threads: tuning.gemv_min_threads,
            gemv_deep: tuning.gemv_depth == 4,
            fuse: tuning.fuse,
            tensor_cores: capability_major >= 8 && tuning.tensor_cores,
            mid_rows: tuning.mid_rows,
        }
    }
}

/// Whether a product of `n` rows takes the mid-size kernels (`gemvqm_*`; routed experts `moe_gemvqg_*` from
/// `GEMV_MAX_TOKENS / 2 + 1` rows): in a fast pass over several sequences (`batched`), never in the exact mode
/// (whose rows must be bit for bit a decode step's), for 2 to `mid_rows` rows.
pub(crate) fn mid_path(mid_rows: usize, batched: bool, exact: bool, n: usize) -> bool {
    batched && !exact && n >= 2 && n <= mid_rows
}

/// One sequence's rows in a pass over the rows of several sequences (`CudaModel::forward_batch`; a single
/// forward is one of them covering every row): its part `st` of the state a block keeps per sequence, its first
/// row `r0` and row count `n` in the pass's `[rows, ..]` buffers, the device address of its position (`pos_dev`,
/// an `i32`: the position its first row takes), that position on the host (`pos`: what eager passes plan their
/// copies with; graph replays read `pos_dev`), its token capacity and the device address of its M-RoPE position
/// table (`thw`, `[cache index][3]` i32; 0 while its positions are the indices, see `CudaState::mrope_dev`).
#[derive(Clone, Copy)]
pub(crate) struct Seq<'a, T> {
    pub(crate) st: &'a T,
    pub(crate) r0: usize,
    pub(crate) n: usize,
    pub(crate) pos_dev: u64,
    pub(crate) thw: u64,
    pub(crate) pos: usize,
    pub(crate) capacity: usize,
}

impl<T> Seq<'_, T> {
    /// The device address of this sequence's first row in a buffer of rows of `width` f32 (or i32) values.
    pub(crate) fn row(&self, buf: u64, width: usize) -> u64 {
        buf + (self.r0 * width * 4) as u64
    }
}

/// Accumulated wall time per phase of the forward pass, for `nebula bench model`'s breakdown.
#[derive(Default)]
pub(crate) struct PhaseTimes {
    last: Option<std::time::Instant>,
    pub(crate) totals: Vec<(&'static str, f64, u64)>,
}

/// What every launch helper needs: the device and its stream, the model's shapes, the arena, the flags.
pub(crate) struct Launch {
    pub(crate) dev: Dev,
    pub(crate) cfg: ModelConfig,
    pub(crate) arena: Mutex<Arena>,
    /// The f32 copy of a weight block the cuBLAS path of prefill multiplies (`Launch::matmul_batch`).
    pub(crate) dequant_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// The last quantized activations (`Launch::quantize_act`).
    pub(crate) q8_cache: Mutex<Q8Cache>,
    pub(crate) flags: LaunchFlags,
    /// Per-phase wall time ([`CudaProfile::Phases`]: the stream is synchronised after each phase).
    profile: Option<Mutex<PhaseTimes>>,
    /// Set during a verify pass (and an MTP pass of a chain's size): every kernel choice is the one a single
    /// decode step makes, so each row's result is bit for bit a decode step's (batch-invariant GEMVs, per-token
    /// expert GEMVs, split attention).
    pub(crate) exact_rows: AtomicBool,
    /// Set during a fast pass over the rows of several sequences (`CudaModel::forward_batch` in
    /// `BatchMode::Fast`): its products of up to `flags.mid_rows` rows may take the mid-size kernels
    /// (`Launch::mid`). Never during a pass of one sequence, whose kernels a deterministic batch reproduces.
    pub(crate) batched_rows: AtomicBool,
    /// During a hybrid verify pass, the device address of the per-row coverage buffer (0 otherwise).
    pub(crate) coverage_out: AtomicU64,
    /// Tokens of a QSA layer's K and V kept in VRAM per sequence (0: all; [`CudaTuning::kv_window`]).
    pub(crate) kv_window: usize,
    /// The staging buffers of cold KV rows and the copy stream (`kv_cache.rs`).
    pub(crate) cold: Mutex<super::kv_cache::ColdStaging>,
}

impl Launch {
    pub(crate) fn new(dev: Dev, cfg: ModelConfig, tuning: &CudaTuning) -> Self {
        let flags = LaunchFlags::new(tuning, dev.gpu.capability.0);
        Self {
            dev,
            cfg,
            arena: Mutex::new(Arena::default()),
            dequant_scratch: Mutex::new(None),
            q8_cache: Mutex::new(None),
            flags,
            profile: (tuning.profile == CudaProfile::Phases).then(|| Mutex::new(PhaseTimes::default())),
            exact_rows: Default::default(),
            batched_rows: Default::default(),
            coverage_out: Default::default(),
            kv_window: tuning.kv_window,
            cold: Mutex::default(),
        }
    }

    /// The device address of `buf`'s element `offset`.
    pub(crate) fn addr<T: DeviceRepr>(&self, buf: &CudaSlice<T>, offset: usize) -> u64 {
        ptr(buf, self.dev.stream(), offset)
    }

    /// Whether a verify pass is running (every kernel choice a decode step's, see `exact_rows`).
    pub(crate) fn exact(&self) -> bool {
        self.exact_rows.load(Ordering::Relaxed)
    }

    /// Whether a product of `n` rows takes the mid-size kernels ([`mid_path`] with this pass's state).
    pub(crate) fn mid(&self, n: usize) -> bool {
        mid_path(self.flags.mid_rows, self.batched_rows.load(Ordering::Relaxed), self.exact(), n)
    }

    /// A temporary of `n` f32 (or i32) values from the arena, valid until the end of the forward pass.
    pub(crate) fn tmp(&self, n: usize) -> Result<u64, CudaError> {
        self.arena.lock().expect("arena lock").take(&self.dev, n)
    }

    /// Marks the arena (see [`Arena::release`]).
    pub(crate) fn arena_mark(&self) -> ArenaMark {
        self.arena.lock().expect("arena lock").mark()
    }

    /// Frees the temporaries taken since `mark` for reuse, and forgets the cached 8-bit activations (they may
    /// live in the freed memory).
    pub(crate) fn arena_release(&self, mark: ArenaMark) {
        self.arena.lock().expect("arena lock").release(mark);
        *self.q8_cache.lock().expect("q8 cache lock") = None;
    }

    /// Starts a pass on fresh arena space (eager passes: prefill, rollback replays).
    pub(crate) fn arena_reset(&self) -> Result<(), CudaError> {
        self.arena.lock().expect("arena lock").reset(&self.dev)
    }

    /// `n` floats from device address `src` to `dst`, stream-ordered.
    pub(crate) fn dtod(&self, dst: u64, src: u64, n: usize) -> Result<(), CudaError> {
        dtod(self.dev.stream(), dst, src, n)
    }

    /// Closes the current profiling phase as `name` (no-op unless profiling).
    pub(crate) fn phase(&self, name: &'static str) -> Result<(), CudaError> {
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

    /// The profile so far: (phase, total seconds, count); then clears it.
    pub(crate) fn take_profile(&self) -> Vec<(&'static str, f64, u64)> {
        self.profile.as_ref().map_or_else(Vec::new, |p| std::mem::take(&mut p.lock().expect("profile lock").totals))
    }
}
