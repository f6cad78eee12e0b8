//! The CPU backend: [`Qwen4Exp`] itself (every block on the CPU, experts from RAM or SSD as placed). Its state is
//! host memory already, so spilling is a copy and nothing is ever on a device.

use std::sync::Arc;

use super::{Backend, BackendError, BatchItem, BatchMode, HeldBytes, Kept};
use crate::model::{ChainRecord, LogitsFor, ModelConfig, Qwen4Exp, SequenceState, Snapshot};
use crate::placement::PlacementStats;
use crate::speculative::{Rollback, Verified};

impl Backend for Qwen4Exp {
    type State = SequenceState;
    type Snapshot = Snapshot;
    type Record = ChainRecord;

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn describe(&self) -> String {
        format!("CPU ({} threads)", rayon::current_num_threads())
    }

    fn has_mtp(&self) -> bool {
        self.mtp().is_some()
    }

    /// The CPU state's MTP cache costs nothing until drafting uses it, so `drafting` is not needed here.
    fn new_state(&self, max_len: usize, _drafting: bool) -> Result<SequenceState, BackendError> {
        Ok(Qwen4Exp::new_state(self, max_len))
    }

    fn position(&self, state: &SequenceState) -> usize {
        state.pos
    }

    fn capacity(&self, state: &SequenceState) -> usize {
        state.max_len
    }

    fn state_bytes(&self, max_len: usize, drafting: bool) -> HeldBytes {
        HeldBytes { device: 0, host: self.config.state_bytes(max_len, drafting && self.mtp().is_some()) }
    }

    fn forward(&self, state: &mut SequenceState, tokens: &[u32], want: LogitsFor) -> Result<Vec<f32>, BackendError> {
        Ok(Qwen4Exp::forward(self, state, tokens, want)?)
    }

    fn accepts_media(&self) -> bool {
        true
    }

    /// One pass for every item ([`Qwen4Exp::forward_items`]): always deterministic, whatever `mode` says.
    fn forward_batch(
        &self,
        items: &mut [BatchItem<'_, SequenceState>],
        _mode: BatchMode,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        Ok(self.forward_items(items, Default::default(), None, None)?)
    }

    fn snapshot(&self, state: &SequenceState) -> Result<Snapshot, BackendError> {
        Ok(state.snapshot())
    }

    fn restore(&self, state: &mut SequenceState, snap: &Snapshot) -> Result<(), BackendError> {
        Ok(Qwen4Exp::restore(self, state, snap)?)
    }

    fn fork(
        &self,
        source: &Kept<SequenceState>,
        snap: &Snapshot,
        max_len: usize,
        _drafting: bool,
    ) -> Result<SequenceState, BackendError> {
        let (Kept::Live(s) | Kept::Host(s)) = source;
        Ok(self.fork_state(s, snap, max_len)?)
    }

    fn state_held(&self, state: &SequenceState) -> HeldBytes {
        HeldBytes { device: 0, host: state.bytes() }
    }

    fn spill_state(&self, state: &SequenceState) -> Result<SequenceState, BackendError> {
        Ok(state.clone())
    }

    fn snapshot_image(&self, snap: &Snapshot) -> Result<Snapshot, BackendError> {
        Ok(snap.clone())
    }

    fn snapshot_from_image(&self, image: Snapshot) -> Snapshot {
        image
    }

    fn can_draft(&self, state: &SequenceState) -> bool {
        match (self.mtp(), &state.mtp) {
            (Some(block), Some(ms)) => {
                let rows = block.rows(&ms.attn);
                state.pos > 0
                    && ms.last_bank.len() == self.config.hc_dim()
                    && (rows + 1 == state.pos || rows == state.pos)
            }
            _ => false,
        }
    }

    fn draft(&self, state: &mut SequenceState, pending: u32, n: usize) -> Result<Vec<u32>, BackendError> {
        Ok(Qwen4Exp::draft(self, state, pending, n, false)?.tokens)
    }

    fn verify(&self, state: &mut SequenceState, chain: &[u32]) -> Result<Verified<ChainRecord>, BackendError> {
        let out = self.forward_chain(state, chain)?;
        let save_s = out.record.save_s();
        Ok(Verified { logits: out.logits, coverage: out.coverage, record: out.record, save_s, realign_s: 0.0 })
    }

    fn rollback(&self, state: &mut SequenceState, record: &ChainRecord, keep: usize) -> Result<Rollback, BackendError> {
        Ok(Rollback { realign_s: self.rollback_chain(state, record, keep)? })
    }

    fn placement_stats(&self) -> Option<Arc<PlacementStats>> {
        Some(Qwen4Exp::placement_stats(self))
    }
}
