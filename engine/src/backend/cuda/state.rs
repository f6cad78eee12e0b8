//! A sequence's state on the GPU (`crate::model::state` on the CPU): each layer's recurrent state or KV cache, the
//! PLE context and conv history, the MTP cache, and the fixed buffers and CUDA Graphs of its decode steps. Sized
//! for `max_len` tokens up front, so an out-of-memory is reported when the state is made, never mid-request.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::chain::ChainBufs;
use super::graphs::{DecodeGraph, GraphSlot};
use super::linear_attn::GdnState;
use super::mtp::DevMtpState;
use super::ple::DevPleState;
use super::self_attn::AttnState;

/// One layer's device state of a sequence (`crate::model::state::LayerState`).
pub(crate) enum LayerState {
    /// A Gated DeltaNet layer's conv and recurrent state.
    LinearAttention(GdnState),
    /// An attention layer's caches.
    Attention(AttnState),
}

/// Fixed device buffers of a decode step, so a captured CUDA Graph replays with the same addresses: the token
/// id, its PLE row ids and the logits.
pub(crate) struct StepBuffers {
    pub(crate) token: CudaSlice<i32>,
    pub(crate) ple_rows: CudaSlice<i32>,
    pub(crate) logits: CudaSlice<f32>,
    /// The step's argmax ([`super::CudaModel::step_argmax`]).
    pub(crate) choice: CudaSlice<i32>,
}

/// A number no other state of this process has (keys the batched decode graphs, which hold the addresses of
/// their states' buffers: a graph replays only for the states it was captured with).
pub(crate) fn next_state_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The state of one sequence on the GPU (KV caches sized for `max_len` tokens up front).
pub struct CudaState {
    /// This state's number ([`next_state_id`]).
    pub(crate) id: u64,
    /// Tokens consumed.
    pub pos: usize,
    /// Capacity in tokens.
    pub max_len: usize,
    pub(crate) layers: Vec<LayerState>,
    /// The PLE block's state (`None` without one).
    pub(crate) ple: Option<DevPleState>,
    /// The position the next token takes, on the device (kernels read it, so graph replays advance).
    pub(crate) pos_dev: CudaSlice<i32>,
    pub(crate) step: StepBuffers,
    pub(crate) graph: Option<DecodeGraph>,
    /// The MTP block's cache (`None` without a block on the device, or for a state made without drafting).
    pub(crate) mtp: Option<DevMtpState>,
    /// Rollback buffers of speculative chains (allocated with the first chain).
    pub(crate) chain: Option<ChainBufs>,
    /// Verify-pass graphs by chain length, with their use counts.
    pub(crate) verify_graphs: Vec<GraphSlot>,
    /// Decode steps run so far (a graph is captured on the second, once the arena holds its size).
    pub(crate) decode_steps: usize,
    /// Set by [`super::CudaModel::step_argmax`] for its decode step: the step leaves its argmax in `argmax_out`
    /// instead of copying the logits back.
    pub(crate) want_argmax: bool,
    pub(crate) argmax_out: Option<u32>,
    /// The stream a routing override follows (`crate::model::SequenceState::routing_stream`).
    pub(crate) routing_stream: u64,
    /// The `[t, h, w]` rope position of every token consumed (M-RoPE after images; `crate::model::MropeTrack`).
    pub(crate) mrope: crate::model::MropeTrack,
    /// The device copy of those positions, `[max_len][3]` i32 by cache index, made when the sequence first
    /// takes a token whose position is not its index (an image's) and kept up to date from then on: the rope and
    /// QSA pooling kernels read it in place of the index. `None` while every position is the index (text only:
    /// the kernels compute it, as before any image).
    pub(crate) mrope_dev: Option<CudaSlice<i32>>,
    /// Fixed device buffers of an override's choice for a decode step or a verify chain (`[layer][row][k]` ids
    /// and weights, room for `MAX_CHAIN_ROWS` rows), so their CUDA Graphs replay with new choices; `None` without
    /// an override.
    pub(crate) routing: Option<RoutingBufs>,
}

/// See [`CudaState::routing`].
pub(crate) struct RoutingBufs {
    pub(crate) ids: CudaSlice<i32>,
    pub(crate) weights: CudaSlice<f32>,
}
