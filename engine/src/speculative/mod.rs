//! MTP speculative decoding (SPEC §4, issue 9): the model's MTP block drafts a chain of tokens, the target verifies
//! the whole chain in one batched pass, the accepted prefix is kept and every state is rolled back exactly to it.
//!
//! - [`SpeculativeModel`]: the few operations the loop needs from a backend (plain step, draft, batched verify,
//!   rollback). [`crate::model::Qwen4Exp`] implements it on the CPU; a GPU or hybrid backend implements the same
//!   trait (its verify reports the resident experts' router-weight coverage per row, which drives case B).
//! - [`verify`]: the acceptance rules (levels 3, 2, 1 for greedy requests; speculative sampling otherwise).
//! - [`window`]: the draft-window controller (basic rule, timing model, collapse and recovery).
//! - [`decoder`]: the loop itself, driving a [`decoder::TokenSink`] (the worker's per-token rules: penalties,
//!   grammar, events, stop conditions), with the chain cases A, B and C.
//! - [`scripted`]: a test drafter that proposes chosen right or wrong tokens (tests, `nebula bench mtp`).
//! - [`stats`]: server-wide counters for the metrics.
//! - [`bench`]: `nebula bench mtp`.
//!
//! Chain layout: the target has consumed `pos` tokens and the last emitted token `c` is pending (not consumed).
//! The drafter proposes `d_1..d_N`; the verify pass consumes `[c, d_1, ..., d_N]` at positions `pos..pos+N`, so
//! row `i`'s logits judge `d_{i+1}` and row `N`'s give the bonus token. With `m` drafts accepted the state keeps
//! rows `0..=m` (`pos + m + 1` tokens) and the row-`m` token (bonus or replacement) is the next pending token.
//!
//! What another backend provides to plug in (the GPU/hybrid path of SPEC §3):
//! - `verify`: one batched pass over the chain with the GPU-resident experts only, returning every row's logits
//!   and, per row, the smallest share over the layers of its normalised router weight that resident experts
//!   covered (SPEC §3.3); rows under [`COVERAGE_THRESHOLD`] are not trusted (case B). Before the pass it saves
//!   what a rollback needs (the CPU model snapshots the Gated DeltaNet and PLE states and records the
//!   projections their updates read; per-token state slots are the other exact option, `shared/design/mtp.md`
//!   §4) and reports the save time.
//! - `step`: the exact target for one token, with the CPU handoff of low-coverage experts (case B's token).
//! - `rollback`: exact, without recomputing kept rows, and it realigns the MTP cache to the kept prefix.
//! - `draft`: the MTP chain; it may leave its first (target-aligned) row in the MTP cache.

pub mod bench;
pub mod decoder;
pub mod scripted;
pub mod stats;
pub mod verify;
pub mod window;

use crate::model::{ChainRecord, ModelError, Qwen4Exp, SequenceState};

pub use decoder::{DecodeOutcome, Flow, SpeculativeDecoder, SpeculativeOptions, TokenSink};
pub use stats::SpecStats;
pub use verify::AccuracyLevel;
pub use window::{ChainCase, ChainSample, WindowController};

/// Fraction of a token's normalised router weight the resident experts must cover for a verify row to be
/// trusted (SPEC §3.3 and §4 case B).
pub const COVERAGE_THRESHOLD: f32 = 0.9;

/// The result of a batched verify pass.
#[derive(Debug)]
pub struct Verified<R> {
    /// Logits of every row, `[rows, vocab]`.
    pub logits: Vec<f32>,
    /// Per row, the resident experts' smallest share of the router weight over the layers (1 when every expert
    /// ran where it lives, as on the CPU).
    pub coverage: Vec<f32>,
    /// What [`SpeculativeModel::rollback`] needs.
    pub record: R,
    /// Seconds spent saving the state before the pass.
    pub save_s: f64,
    /// Seconds spent realigning the MTP cache inside the pass (backends that do it there; the CPU model does it
    /// in the rollback).
    pub realign_s: f64,
}

/// What a rollback reports.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Rollback {
    /// Seconds of it spent realigning the MTP cache to the kept rows.
    pub realign_s: f64,
}

/// The model operations speculative decoding needs, whatever the backend.
///
/// Contract: a state has consumed [`SpeculativeModel::position`] tokens; [`SpeculativeModel::draft`] may use
/// scratch space but leaves the target state as it was; [`SpeculativeModel::verify`] consumes every token it is
/// given and returns each row's logits; [`SpeculativeModel::rollback`] then cuts the state back to the first
/// `keep` rows exactly (bit for bit the state a forward of those rows alone leaves), without recomputing them.
pub trait SpeculativeModel {
    /// A sequence's state on this backend.
    type State;
    /// What a verify pass keeps for its rollback.
    type Record;

    /// Vocabulary size (row width of the logits).
    fn vocab(&self) -> usize;

    /// Tokens `state` has consumed.
    fn position(&self, state: &Self::State) -> usize;

    /// Plain decode step with the full target (every expert, wherever it lives): consumes `token`, returns its
    /// logits `[vocab]`.
    ///
    /// Errors: bad token, context overflow.
    fn step(&self, state: &mut Self::State, token: u32) -> Result<Vec<f32>, ModelError>;

    /// A plain decode step that returns the greedy choice instead of the logits: the argmax of the logits
    /// [`SpeculativeModel::step`] would return ([`crate::sampling::argmax`]: ties to the lower id, `-inf` and NaN
    /// never chosen; `None` when no logit is finite). Backends that can choose on their device override it.
    ///
    /// Errors: as [`SpeculativeModel::step`].
    fn step_greedy(&self, state: &mut Self::State, token: u32) -> Result<Option<u32>, ModelError> {
        Ok(crate::sampling::argmax(&self.step(state, token)?).map(|i| i as u32))
    }

    /// Whether the drafter can propose after this state now (MTP loaded and aligned, a token consumed).
    fn can_draft(&self, state: &Self::State) -> bool;

    /// Up to `n` drafts following `pending` (the next token the target will consume).
    ///
    /// Errors: drafting unavailable, bad token.
    fn draft(&self, state: &mut Self::State, pending: u32, n: usize) -> Result<Vec<u32>, ModelError>;

    /// Consumes `chain` in one batched pass.
    ///
    /// Errors: bad token, context overflow (state unchanged).
    fn verify(&self, state: &mut Self::State, chain: &[u32]) -> Result<Verified<Self::Record>, ModelError>;

    /// Cuts the chain of `record` back to its first `keep` rows and realigns the drafter's cache to them. Called
    /// after every verify, with `keep` = all rows when everything is kept.
    ///
    /// Errors: `record` is not the state's last chain, or `keep` exceeds it.
    fn rollback(&self, state: &mut Self::State, record: &Self::Record, keep: usize) -> Result<Rollback, ModelError>;
}

/// A CUDA error as the model error the decoder reports.
pub(crate) fn model_error(e: crate::backend::cuda::CudaError, what: &str) -> ModelError {
    match e {
        crate::backend::cuda::CudaError::Model(m) => m,
        other => ModelError::WeightRead { what: what.into(), detail: other.to_string() },
    }
}

/// The GPU model (all-GPU or hybrid), with the MTP block on the device: drafts, a batch-invariant verify pass
/// and exact rollback ([`crate::backend::cuda`]'s `mtp` module). In hybrid mode the verify pass reports each
/// row's resident-expert coverage, which drives case B.
impl SpeculativeModel for crate::backend::cuda::CudaModel {
    type State = crate::backend::cuda::CudaState;
    type Record = crate::backend::cuda::CudaChain;

    fn vocab(&self) -> usize {
        self.config.vocab
    }

    fn position(&self, state: &Self::State) -> usize {
        state.pos
    }

    fn step(&self, state: &mut Self::State, token: u32) -> Result<Vec<f32>, ModelError> {
        self.forward(state, &[token], crate::model::LogitsFor::Last).map_err(|e| model_error(e, "CUDA decode step"))
    }

    fn step_greedy(&self, state: &mut Self::State, token: u32) -> Result<Option<u32>, ModelError> {
        self.step_argmax(state, token).map_err(|e| model_error(e, "CUDA decode step"))
    }

    fn can_draft(&self, state: &Self::State) -> bool {
        crate::backend::cuda::CudaModel::can_draft(self, state)
    }

    fn draft(&self, state: &mut Self::State, pending: u32, n: usize) -> Result<Vec<u32>, ModelError> {
        let n = n.min(crate::backend::cuda::MAX_CHAIN_ROWS - 1);
        self.draft_tokens(state, pending, n).map_err(|e| model_error(e, "CUDA MTP draft"))
    }

    fn verify(&self, state: &mut Self::State, chain: &[u32]) -> Result<Verified<Self::Record>, ModelError> {
        self.verify_chain(state, chain).map_err(|e| model_error(e, "CUDA verify pass"))
    }

    fn rollback(&self, state: &mut Self::State, record: &Self::Record, keep: usize) -> Result<Rollback, ModelError> {
        let realign_s = self.rollback_chain(state, record, keep).map_err(|e| model_error(e, "CUDA rollback"))?;
        Ok(Rollback { realign_s })
    }
}

impl SpeculativeModel for Qwen4Exp {
    type State = SequenceState;
    type Record = ChainRecord;

    fn vocab(&self) -> usize {
        self.config.vocab
    }

    fn position(&self, state: &SequenceState) -> usize {
        state.pos
    }

    fn step(&self, state: &mut SequenceState, token: u32) -> Result<Vec<f32>, ModelError> {
        self.forward(state, &[token], crate::model::LogitsFor::Last)
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

    fn draft(&self, state: &mut SequenceState, pending: u32, n: usize) -> Result<Vec<u32>, ModelError> {
        Ok(Qwen4Exp::draft(self, state, pending, n, false)?.tokens)
    }

    fn verify(&self, state: &mut SequenceState, chain: &[u32]) -> Result<Verified<ChainRecord>, ModelError> {
        let out = self.forward_chain(state, chain)?;
        let save_s = out.record.save_s();
        Ok(Verified { logits: out.logits, coverage: out.coverage, record: out.record, save_s, realign_s: 0.0 })
    }

    fn rollback(&self, state: &mut SequenceState, record: &ChainRecord, keep: usize) -> Result<Rollback, ModelError> {
        Ok(Rollback { realign_s: self.rollback_chain(state, record, keep)? })
    }
}
