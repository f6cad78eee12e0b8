//! MTP speculative decoding: the model's MTP block drafts a chain of tokens, the target verifies the whole chain
//! in one batched pass, the accepted prefix is kept and every state is rolled back exactly to it.
//!
//! - The backend operations the loop needs (plain step, draft, batched verify, rollback) are part of
//!   [`crate::backend::Backend`]; the CPU model and the GPU model (all-GPU or hybrid) implement them. A hybrid
//!   verify reports the resident experts' router-weight coverage per row, which drives case B.
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
//! What a backend provides:
//! - `verify`: one batched pass over the chain, returning every row's logits and, per row, the smallest share
//!   over the layers of its normalised router weight that resident experts covered; rows under
//!   [`COVERAGE_THRESHOLD`] are not trusted (case B). Before the pass it saves what a rollback needs (the CPU
//!   model snapshots the Gated DeltaNet and PLE states and records the projections their updates read) and
//!   reports the save time.
//! - `step`: the exact target for one token, with the CPU handoff of low-coverage experts (case B's token).
//! - `rollback`: exact, without recomputing kept rows, and it realigns the MTP cache to the kept prefix.
//! - `draft`: the MTP chain; it may leave its first (target-aligned) row in the MTP cache.

pub mod bench;
pub mod decoder;
pub mod scripted;
pub mod stats;
pub mod verify;
pub mod window;

pub use decoder::{DecodeError, DecodeOutcome, Flow, SpeculativeDecoder, SpeculativeOptions, TokenSink};
pub use stats::SpecStats;
pub use verify::AccuracyLevel;
pub use window::{ChainCase, ChainSample, WindowController};

/// Fraction of a token's normalised router weight the resident experts must cover for a verify row to be
/// trusted (case B: the full target recomputes that row).
pub const COVERAGE_THRESHOLD: f32 = 0.9;

/// The result of a batched verify pass.
#[derive(Debug)]
pub struct Verified<R> {
    /// Logits of every row, `[rows, vocab]`.
    pub logits: Vec<f32>,
    /// Per row, the resident experts' smallest share of the router weight over the layers (1 when every expert
    /// ran where it lives, as on the CPU). The hybrid GPU backend reports a trust flag instead: 1 for a row it
    /// computed exactly, 0 for one under its handoff threshold (not trusted: case B).
    pub coverage: Vec<f32>,
    /// What [`crate::backend::Backend::rollback`] needs.
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
