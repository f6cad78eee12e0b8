//! [`CudaModel`] as a [`Backend`]: all-GPU, or hybrid for a placed model (the GPU-tier experts on the GPU, the
//! others on the CPU). The MTP block drafts on the device; a hybrid verify pass reports each row's
//! resident-expert coverage, which the speculative decoder uses to distrust rows the GPU alone computed
//! (case B). State operations are in [`super::checkpoint`].

use std::sync::Arc;

use super::{CudaChain, CudaModel, CudaSnapshot, CudaState, MAX_CHAIN_ROWS};
use crate::backend::{Backend, BackendError, BackendSnapshot, BatchItem, BatchMode, HeldBytes, Kept, Timings};
use crate::model::{LogitsFor, ModelConfig, SequenceState};
use crate::placement::PlacementStats;
use crate::speculative::{Rollback, Verified};

impl BackendSnapshot for CudaSnapshot {
    fn pos(&self) -> usize {
        CudaSnapshot::pos(self)
    }
    fn held(&self) -> HeldBytes {
        CudaSnapshot::held(self)
    }
}

impl Backend for CudaModel {
    type State = CudaState;
    type Snapshot = CudaSnapshot;
    type Record = CudaChain;

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn describe(&self) -> String {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let hybrid = if self.is_hybrid() {
            format!(
                " hybrid (GPU-tier experts on the GPU, the rest on the CPU; {:.1} GiB of RAM tier pinned for uploads)",
                gib(self.registered_bytes())
            )
        } else {
            String::new()
        };
        format!("CUDA{hybrid} on {} ({:.1} GiB of weights on the GPU)", self.gpu_name(), gib(self.weight_bytes))
    }

    fn has_mtp(&self) -> bool {
        CudaModel::has_mtp(self)
    }

    /// Without `drafting` the state has no MTP cache: no MTP pass after each forward, and drafting refuses.
    fn new_state(&self, max_len: usize, drafting: bool) -> Result<CudaState, BackendError> {
        Ok(self.new_state_with(max_len, drafting && CudaModel::has_mtp(self))?)
    }

    fn position(&self, state: &CudaState) -> usize {
        state.pos
    }

    fn capacity(&self, state: &CudaState) -> usize {
        state.max_len
    }

    /// Every buffer [`CudaModel::new_state_with`] allocates ([`CudaModel::state_alloc_bytes`]): in device memory
    /// the caches of [`ModelConfig::state_bytes`] in the KV cache type (as allocated: at least one byte each;
    /// with the hot window, the windowed layers' rings) plus the position, the decode step's token, PLE rows,
    /// logits and argmax, and with drafting the MTP block's banks and draft buffers; in host memory the PLE
    /// n-gram context and the windowed layers' pinned copies of every row. A verify pass adds its chain buffers on its first chain
    /// (`MAX_CHAIN_ROWS` rows of logits and banks, a copy of each recurrent state), which this does not count.
    fn state_bytes(&self, max_len: usize, drafting: bool) -> HeldBytes {
        self.state_alloc_bytes(max_len, drafting && self.has_mtp())
    }

    /// Images: the rows of [`crate::backend::MediaRows`] start from the given embeddings and every row takes its
    /// M-RoPE position ([`CudaModel::forward_media`]), all-GPU and hybrid.
    fn accepts_media(&self) -> bool {
        true
    }

    /// One pass for all items ([`CudaModel::forward_batch`]): fast mode on the batch's GEMMs; deterministic mode
    /// on the single-step kernels, with prefill chunks longer than [`CudaModel::single_step_rows`] run alone.
    /// Items with images inject their rows' embeddings and take their M-RoPE positions.
    fn forward_batch(
        &self,
        items: &mut [BatchItem<'_, CudaState>],
        mode: BatchMode,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        Ok(CudaModel::forward_batch(self, items, mode)?)
    }

    fn forward(&self, state: &mut CudaState, tokens: &[u32], want: LogitsFor) -> Result<Vec<f32>, BackendError> {
        Ok(CudaModel::forward(self, state, tokens, want)?)
    }

    fn step_greedy(&self, state: &mut CudaState, token: u32) -> Result<Option<u32>, BackendError> {
        Ok(self.step_argmax(state, token)?)
    }

    fn snapshot(&self, state: &CudaState) -> Result<CudaSnapshot, BackendError> {
        Ok(self.snapshot_state(state)?)
    }

    fn restore(&self, state: &mut CudaState, snap: &CudaSnapshot) -> Result<(), BackendError> {
        Ok(self.restore_state(state, snap)?)
    }

    fn fork(
        &self,
        source: &Kept<CudaState>,
        snap: &CudaSnapshot,
        max_len: usize,
        drafting: bool,
    ) -> Result<CudaState, BackendError> {
        Ok(self.fork_state(source, snap, max_len, drafting)?)
    }

    fn state_held(&self, state: &CudaState) -> HeldBytes {
        HeldBytes {
            device: self.state_device_bytes(state),
            host: state.ple.as_ref().map_or(0, |p| 4 * p.context.len()) + self.state_host_cache_bytes(state),
        }
    }

    fn spill_state(&self, state: &CudaState) -> Result<SequenceState, BackendError> {
        Ok(self.state_image(state)?)
    }

    fn snapshot_image(&self, snap: &CudaSnapshot) -> Result<crate::model::Snapshot, BackendError> {
        Ok(self.snapshot_to_host(snap)?)
    }

    fn snapshot_from_image(&self, image: crate::model::Snapshot) -> CudaSnapshot {
        CudaSnapshot::from_image(image)
    }

    fn can_draft(&self, state: &CudaState) -> bool {
        CudaModel::can_draft(self, state)
    }

    fn draft(&self, state: &mut CudaState, pending: u32, n: usize) -> Result<Vec<u32>, BackendError> {
        Ok(self.draft_tokens(state, pending, n.min(MAX_CHAIN_ROWS - 1))?)
    }

    fn verify(&self, state: &mut CudaState, chain: &[u32]) -> Result<Verified<CudaChain>, BackendError> {
        Ok(self.verify_chain(state, chain)?)
    }

    fn rollback(&self, state: &mut CudaState, record: &CudaChain, keep: usize) -> Result<Rollback, BackendError> {
        Ok(Rollback { realign_s: self.rollback_chain(state, record, keep)? })
    }

    fn placement_stats(&self) -> Option<Arc<PlacementStats>> {
        self.host_model().map(|h| h.placement_stats())
    }

    fn take_timings(&self) -> Result<Timings, BackendError> {
        Ok(Timings {
            kernels: self.take_kernel_times(),
            phases: self.take_profile(),
            copies: self.take_copy_report()?,
            hybrid: self.take_hybrid_times(),
        })
    }
}
