//! Where the forward pass runs, behind one trait: [`Backend`] is what the generation worker, the speculative
//! decoder, `nebula bench` and `nebula generate` call, and the CPU model ([`crate::model::Qwen4Exp`], in
//! [`cpu`]) and the CUDA model ([`cuda::CudaModel`], all-GPU or hybrid) implement it. Code above this module is
//! generic over the backend; the choice between them is made once, by [`Loaded::new`], and crossed with
//! [`Loaded::run`].
//!
//! A sequence lives in a backend's [`Backend::State`]. Its recurrent parts (Gated DeltaNet conv and recurrent
//! state, the PLE n-gram context, the MTP block's pending hidden input) are overwritten by every token, while
//! attention caches only grow, so a sequence can be cut back or copied only at a [`Backend::Snapshot`] taken
//! earlier: [`Backend::restore`] truncates a state back to one of its snapshots, [`Backend::fork`] makes a new
//! state holding a cached sequence's prefix. The prefix cache keeps finished sequences as [`Kept`] (live on the
//! backend, or spilled to host memory as a [`SequenceState`] image) and resumes requests from them.

pub mod cpu;
pub mod cuda;

use std::sync::Arc;

use crate::model::{LogitsFor, ModelConfig, ModelError, Qwen4Exp, SequenceState};
use crate::placement::PlacementStats;
use crate::speculative::{Rollback, Verified};

/// Which backend to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// Every block on the CPU.
    #[default]
    Cpu,
    /// Every block on GPU `device`, within `vram_budget` bytes when given.
    Cuda {
        /// GPU index (as `nvidia-smi` lists them).
        device: usize,
        /// VRAM the model may use, bytes; `None` = what is free.
        vram_budget: Option<u64>,
    },
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda { device: 0, vram_budget: None }),
            other => Err(format!("unknown backend '{other}' (cpu, cuda)")),
        }
    }
}

/// Errors of either backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// From the model (bad input, context overflow, a weight read that failed, a bad snapshot).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// From the GPU.
    #[error(transparent)]
    Cuda(#[from] cuda::CudaError),
}

impl BackendError {
    /// Whether the error is a failed device allocation (the driver's out-of-memory result, or a state over
    /// what the GPU has free): waiting for other sequences to end can cure it.
    pub fn is_out_of_memory(&self) -> bool {
        use nebula_kernels::GpuError;
        match self {
            BackendError::Cuda(cuda::CudaError::Gpu(GpuError::OutOfMemory { .. })) => true,
            BackendError::Cuda(cuda::CudaError::Gpu(GpuError::DriverCall(code))) => {
                *code == nebula_kernels::cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
            }
            _ => false,
        }
    }

    /// The model error inside, when there is one (a CUDA error wrapping a model error included).
    pub fn as_model(&self) -> Option<&ModelError> {
        match self {
            BackendError::Model(m) | BackendError::Cuda(cuda::CudaError::Model(m)) => Some(m),
            BackendError::Cuda(_) => None,
        }
    }
}

/// Bytes a state or snapshot holds, by where they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeldBytes {
    /// In device memory (VRAM).
    pub device: usize,
    /// In host memory.
    pub host: usize,
}

impl std::ops::Add for HeldBytes {
    type Output = HeldBytes;
    fn add(self, o: HeldBytes) -> HeldBytes {
        HeldBytes { device: self.device + o.device, host: self.host + o.host }
    }
}

impl std::iter::Sum for HeldBytes {
    fn sum<I: Iterator<Item = HeldBytes>>(iter: I) -> HeldBytes {
        iter.fold(HeldBytes::default(), |a, b| a + b)
    }
}

/// A resumable point of a sequence on some backend: the recurrent and PLE parts at a position (attention
/// caches are cut by length).
pub trait BackendSnapshot {
    /// Tokens the sequence had consumed when the snapshot was taken.
    fn pos(&self) -> usize;
    /// Bytes it holds, by where.
    fn held(&self) -> HeldBytes;
}

impl BackendSnapshot for crate::model::Snapshot {
    fn pos(&self) -> usize {
        crate::model::Snapshot::pos(self)
    }
    fn held(&self) -> HeldBytes {
        HeldBytes { device: 0, host: self.bytes() }
    }
}

/// A finished sequence kept by the prefix cache: still on the backend, or spilled to host memory as an image
/// ([`Backend::spill_state`]).
pub enum Kept<S> {
    /// The backend's own state (VRAM on the GPU).
    Live(S),
    /// An image in host memory, in the layout of [`SequenceState`] (the CPU model's own state; a GPU image holds
    /// the device buffers' bytes in the same fields).
    Host(SequenceState),
}

/// One sequence's part of a batched forward pass ([`Backend::forward_batch`]): its state, the tokens it consumes
/// in this pass (one for a decode step, a chunk for prefill), which of their logits it wants, and for a prompt
/// with images the rows that take an image's features instead of their token's embedding.
pub struct BatchItem<'a, S> {
    /// The sequence's state; the pass advances it by `tokens.len()`.
    pub state: &'a mut S,
    /// Tokens to consume, in order. A row with an injected embedding keeps its placeholder id here: the PLE
    /// n-gram hash reads it, as the reference hashes the `<|image_pad|>` id.
    pub tokens: &'a [u32],
    /// Which rows' logits come back.
    pub want: LogitsFor,
    /// Injected embeddings and explicit rope positions; `None`: text continuing the state's positions.
    pub media: Option<MediaRows<'a>>,
}

impl<'a, S> BatchItem<'a, S> {
    /// An item of text tokens.
    pub fn text(state: &'a mut S, tokens: &'a [u32], want: LogitsFor) -> Self {
        Self { state, tokens, want, media: None }
    }
}

/// What a forward call takes besides token ids for a prompt with images or video: rows whose input embedding is
/// given (the vision tower's merged features, placed at the `<|image_pad|>` / `<|video_pad|>` rows) and the 3-D
/// rope position of every row (`crate::vision::rope_index`). Positions are the reference's M-RoPE `[t, h, w]`;
/// text rows carry `[p, p, p]`.
#[derive(Debug, Clone, Copy)]
pub struct MediaRows<'a> {
    /// `[t, h, w]` of every row of the call (`tokens.len()` entries).
    pub positions: &'a [[u32; 3]],
    /// Rows of the call (indices into its tokens, ascending) whose embedding is `embeds`.
    pub rows: &'a [usize],
    /// `[rows.len(), hidden]` embeddings.
    pub embeds: &'a [f32],
}

impl MediaRows<'_> {
    /// Checks the rows against a call of `n` tokens of a model `hidden` wide.
    ///
    /// Errors: [`ModelError::MediaRows`] naming the mismatch.
    pub fn check(&self, n: usize, hidden: usize) -> Result<(), ModelError> {
        let bad = |problem: String| Err(ModelError::MediaRows { problem });
        if self.positions.len() != n {
            return bad(format!("{} positions for {n} tokens", self.positions.len()));
        }
        if self.embeds.len() != self.rows.len() * hidden {
            return bad(format!(
                "{} embedding values for {} rows of width {hidden}",
                self.embeds.len(),
                self.rows.len()
            ));
        }
        if self.rows.windows(2).any(|w| w[0] >= w[1]) || self.rows.last().is_some_and(|&r| r >= n) {
            return bad(format!("rows {:?} are not ascending within {n} tokens", self.rows));
        }
        Ok(())
    }
}

/// How a batched pass may order its sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchMode {
    /// Whatever is fastest for the batch (on the GPU, tensor-core GEMMs over the batch's rows: a sequence's
    /// logits may differ in the last bits from a pass run alone).
    #[default]
    Fast,
    /// Every row computed with the summation order of a pass run alone, so a sequence's logits do not depend on
    /// what else is in the batch. The CPU always runs this way.
    Deterministic,
}

/// Per-kernel, per-phase and copy timings a backend collected since the last call (empty where it keeps none):
/// `nebula bench model`'s breakdown.
#[derive(Debug, Default)]
pub struct Timings {
    /// (kernel, total seconds, launches).
    pub kernels: Vec<(String, f64, u64)>,
    /// (forward-pass phase, total seconds, count).
    pub phases: Vec<(&'static str, f64, u64)>,
    /// A one-line report of host-device copies.
    pub copies: Option<String>,
    /// The split of hybrid decode steps between CPU and GPU.
    pub hybrid: Option<cuda::hybrid::HybridTimes>,
}

/// One model on one backend: everything the generation worker, speculative decoding and the benchmarks run.
///
/// Contract: a state has consumed [`Backend::position`] tokens, at most its `max_len`. [`Backend::forward`] and
/// [`Backend::step`] consume tokens; on a bad token or a context overflow the state is unchanged, on any other
/// error it must be discarded (the backend stays usable). [`Backend::draft`] may use scratch space but leaves
/// the target state as it was; [`Backend::verify`] consumes every token it is given and returns each row's
/// logits; [`Backend::rollback`] then cuts the state back to the first `keep` rows exactly (bit for bit the
/// state a forward of those rows alone leaves), without recomputing them.
pub trait Backend {
    /// A sequence's state on this backend.
    type State;
    /// A resumable point of a state ([`Backend::snapshot`]).
    type Snapshot: BackendSnapshot;
    /// What a verify pass keeps for its rollback.
    type Record;

    /// The model's shapes.
    fn config(&self) -> &ModelConfig;

    /// Vocabulary size (row width of the logits).
    fn vocab(&self) -> usize {
        self.config().vocab
    }

    /// One line for logs: backend and device.
    fn describe(&self) -> String;

    /// Whether the model has an MTP block loaded to draft with.
    fn has_mtp(&self) -> bool;

    /// A fresh state for at most `max_len` tokens; `drafting` keeps an MTP cache aligned (when the model has
    /// the block) so the state can draft.
    ///
    /// Errors: the state cannot be allocated (device memory).
    fn new_state(&self, max_len: usize, drafting: bool) -> Result<Self::State, BackendError>;

    /// Tokens `state` has consumed.
    fn position(&self, state: &Self::State) -> usize;

    /// Runs `tokens` (one sequence) on `state` and returns the logits asked for (`[rows, vocab]`, masked ids at
    /// `-inf`).
    ///
    /// Errors: [`ModelError::TokenOutOfRange`], [`ModelError::ContextOverflow`] (state unchanged); a weight
    /// read or device failure (state to be discarded).
    fn forward(&self, state: &mut Self::State, tokens: &[u32], want: LogitsFor) -> Result<Vec<f32>, BackendError>;

    /// Most tokens `state` can hold (the `max_len` it was made for).
    fn capacity(&self, state: &Self::State) -> usize;

    /// Checks that `state` can consume `tokens`: every id in the vocabulary, and room for all of them.
    ///
    /// Errors: [`ModelError::TokenOutOfRange`], [`ModelError::ContextOverflow`].
    fn check_input(&self, state: &Self::State, tokens: &[u32]) -> Result<(), BackendError> {
        Ok(crate::model::check_tokens(self.vocab(), self.position(state), self.capacity(state), tokens)?)
    }

    /// Whether [`Backend::forward_batch`] takes items with [`MediaRows`] (injected embeddings and explicit
    /// positions). A backend that does not refuses such items with [`ModelError::MediaRows`].
    fn accepts_media(&self) -> bool {
        false
    }

    /// Runs several sequences in one pass: each item's tokens on its own state (attention, Gated DeltaNet, PLE
    /// and MTP caches per sequence), the row-wise work (projections, routers, experts, head) over the rows of
    /// every item together, so each weight is read once per pass. Returns each item's logits as
    /// [`Backend::forward`] would (`[rows, vocab]` for its `want`), in the items' order. Under
    /// [`BatchMode::Deterministic`] every item's logits equal, bit for bit, those of the same call made for the
    /// item alone. The default runs the items one after another.
    ///
    /// Errors: a bad token or a context overflow in any item is reported before anything runs (every state
    /// unchanged); any other error leaves every state of the batch to be discarded.
    fn forward_batch(
        &self,
        items: &mut [BatchItem<'_, Self::State>],
        mode: BatchMode,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let _ = mode;
        for it in items.iter() {
            self.check_input(it.state, it.tokens)?;
            if it.media.is_some() {
                return Err(ModelError::MediaRows {
                    problem: format!("the {} backend takes no image input", self.describe()),
                }
                .into());
            }
        }
        items.iter_mut().map(|it| self.forward(it.state, it.tokens, it.want)).collect()
    }

    /// Bytes a fresh state for `max_len` tokens will hold once full (what admission into a batch reserves).
    fn state_bytes(&self, max_len: usize, drafting: bool) -> HeldBytes;

    /// Plain decode step with the full target (every expert, wherever it lives): consumes `token`, returns its
    /// logits `[vocab]`.
    ///
    /// Errors: as [`Backend::forward`].
    fn step(&self, state: &mut Self::State, token: u32) -> Result<Vec<f32>, BackendError> {
        self.forward(state, &[token], LogitsFor::Last)
    }

    /// A plain decode step that returns the greedy choice instead of the logits: the argmax of the logits
    /// [`Backend::step`] would return ([`crate::sampling::argmax`]: ties to the lower id, `-inf` and NaN never
    /// chosen; `None` when no logit is finite). Backends that can choose on their device override it.
    ///
    /// Errors: as [`Backend::step`].
    fn step_greedy(&self, state: &mut Self::State, token: u32) -> Result<Option<u32>, BackendError> {
        Ok(crate::sampling::argmax(&self.step(state, token)?).map(|i| i as u32))
    }

    /// A snapshot of `state` now.
    ///
    /// Errors: a device copy failed.
    fn snapshot(&self, state: &Self::State) -> Result<Self::Snapshot, BackendError>;

    /// Truncates `state` back to `snap`, taken earlier from the same sequence (which may have grown since).
    ///
    /// Errors: [`ModelError::BadSnapshot`] when `snap` lies beyond the state or has another shape.
    fn restore(&self, state: &mut Self::State, snap: &Self::Snapshot) -> Result<(), BackendError>;

    /// A new state for at most `max_len` tokens holding the first `snap.pos()` tokens of the kept sequence
    /// `source` (attention caches copied up to that length, recurrent parts from `snap`, which was taken from
    /// `source` earlier); `source` is left as it is, so one cached sequence can seed many requests.
    ///
    /// Errors: [`ModelError::BadSnapshot`] when `snap` does not fit `source` or `max_len`; device memory.
    fn fork(
        &self,
        source: &Kept<Self::State>,
        snap: &Self::Snapshot,
        max_len: usize,
        drafting: bool,
    ) -> Result<Self::State, BackendError>;

    /// Bytes `state` holds, by where.
    fn state_held(&self, state: &Self::State) -> HeldBytes;

    /// A host image of `state` (its consumed prefix), from which [`Backend::fork`] resumes as from the state
    /// itself: how the prefix cache moves a sequence out of device memory.
    ///
    /// Errors: a device copy failed.
    fn spill_state(&self, state: &Self::State) -> Result<SequenceState, BackendError>;

    /// A host image of `snap` in [`crate::model::Snapshot`]'s fields (what the disk cache writes).
    ///
    /// Errors: a device copy failed.
    fn snapshot_image(&self, snap: &Self::Snapshot) -> Result<crate::model::Snapshot, BackendError>;

    /// A snapshot held in host memory, made from an image [`Backend::snapshot_image`] gave (on disk since).
    fn snapshot_from_image(&self, image: crate::model::Snapshot) -> Self::Snapshot;

    /// A copy of `snap` that holds everything in host memory.
    ///
    /// Errors: a device copy failed.
    fn spill_snapshot(&self, snap: &Self::Snapshot) -> Result<Self::Snapshot, BackendError> {
        Ok(self.snapshot_from_image(self.snapshot_image(snap)?))
    }

    /// Whether the drafter can propose after this state now (MTP loaded and aligned, a token consumed).
    fn can_draft(&self, state: &Self::State) -> bool;

    /// Up to `n` drafts following `pending` (the next token the target will consume).
    ///
    /// Errors: drafting unavailable, bad token.
    fn draft(&self, state: &mut Self::State, pending: u32, n: usize) -> Result<Vec<u32>, BackendError>;

    /// Consumes `chain` in one batched pass; reports per row the resident experts' share of the router weight
    /// (1 where every expert ran where it lives).
    ///
    /// Errors: bad token, context overflow (state unchanged).
    fn verify(&self, state: &mut Self::State, chain: &[u32]) -> Result<Verified<Self::Record>, BackendError>;

    /// Cuts the chain of `record` back to its first `keep` rows and realigns the drafter's cache to them.
    /// Called after every verify, with `keep` = all rows when everything is kept.
    ///
    /// Errors: `record` is not the state's last chain, or `keep` exceeds it.
    fn rollback(&self, state: &mut Self::State, record: &Self::Record, keep: usize) -> Result<Rollback, BackendError>;

    /// The placement counters of a placed model (CPU tiers, or hybrid CUDA); `None` otherwise.
    fn placement_stats(&self) -> Option<Arc<PlacementStats>>;

    /// Timings collected since the last call (then cleared); empty by default.
    ///
    /// Errors: a device query failed.
    fn take_timings(&self) -> Result<Timings, BackendError> {
        Ok(Timings::default())
    }
}

/// A model put on the backend [`BackendKind`] chose: the one place the choice forks.
pub enum Loaded {
    /// The CPU model.
    Cpu(Arc<Qwen4Exp>),
    /// The GPU model (all-GPU, or hybrid for a placed model).
    Cuda(Box<cuda::CudaModel>),
}

/// Code to run with whichever backend was loaded ([`Loaded::run`]): a generic function in a struct, since
/// closures cannot be generic.
pub trait WithBackend {
    /// What the code returns.
    type Output;
    /// Runs with `backend`.
    fn run<B: Backend>(self, backend: &B) -> Self::Output;
}

impl Loaded {
    /// Puts `model` on `kind`. A placed model ([`Qwen4Exp::place`]) on CUDA runs hybrid: its GPU-tier experts on
    /// the GPU, the others on the CPU ([`cuda::hybrid`]); unplaced, every weight goes to the GPU. `tuning` steers
    /// the CUDA backend.
    ///
    /// Errors: no GPU, over the VRAM budget, no kernels for a weight type.
    pub fn new(
        model: Arc<Qwen4Exp>,
        kind: BackendKind,
        tuning: &crate::tuning::CudaTuning,
    ) -> Result<Self, cuda::CudaError> {
        Ok(match kind {
            BackendKind::Cpu => Loaded::Cpu(model),
            BackendKind::Cuda { device, vram_budget } => {
                Loaded::Cuda(Box::new(cuda::CudaModel::for_model(model, device, vram_budget, tuning)?))
            }
        })
    }

    /// Runs `code` with the loaded backend.
    pub fn run<W: WithBackend>(&self, code: W) -> W::Output {
        match self {
            Loaded::Cpu(m) => code.run(&**m),
            Loaded::Cuda(m) => code.run(&**m),
        }
    }

    /// The CUDA model, when that is the backend (its device-specific measurements: copy bandwidth, round trip).
    pub fn cuda(&self) -> Option<&cuda::CudaModel> {
        match self {
            Loaded::Cuda(m) => Some(m),
            Loaded::Cpu(_) => None,
        }
    }

    /// The model's shapes.
    pub fn config(&self) -> &ModelConfig {
        match self {
            Loaded::Cpu(m) => &m.config,
            Loaded::Cuda(m) => &m.config,
        }
    }

    /// One line for logs: backend and device.
    pub fn describe(&self) -> String {
        match self {
            Loaded::Cpu(m) => m.describe(),
            Loaded::Cuda(m) => m.describe(),
        }
    }

    /// The host model: the CPU model, or the hybrid GPU model's host half (`None` for an all-GPU model).
    pub fn host_model(&self) -> Option<&Qwen4Exp> {
        match self {
            Loaded::Cpu(m) => Some(m),
            Loaded::Cuda(m) => m.host_model(),
        }
    }

    /// Read bandwidth of a placed model's SSD tier in bytes/s, measured for about `seconds` (see
    /// [`Qwen4Exp::ssd_read_bandwidth`]); `None` without an SSD tier (an unplaced or all-GPU model).
    ///
    /// Errors: [`ModelError::WeightRead`] when a read fails.
    pub fn ssd_read_bandwidth(&self, seconds: f64) -> Option<Result<f64, ModelError>> {
        self.host_model().and_then(|h| h.ssd_read_bandwidth(seconds))
    }
}
