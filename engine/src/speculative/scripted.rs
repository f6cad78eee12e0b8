//! A test drafter: wraps a model and proposes chosen right or wrong tokens instead of (or after) its MTP
//! drafts, so tests can drive every chain case and benchmarks can measure the machinery at a fixed acceptance
//! rate. "Right" means the token of a known reference sequence (the target's own greedy output) at that position.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::backend::{Backend, BackendError, Kept, Timings};
use crate::model::{LogitsFor, ModelConfig, ModelError, SequenceState};
use crate::placement::PlacementStats;

use super::{Rollback, Verified};

/// Which drafts are right.
#[derive(Debug, Clone)]
pub enum DraftPlan {
    /// One pattern per chain, in order (`true` = the right token); a chain longer than its pattern proposes only
    /// the pattern's length, and once the patterns run out every draft is right.
    Script(VecDeque<Vec<bool>>),
    /// Each draft right with probability `rate`, from a seeded stream.
    Rate {
        /// Probability that a draft is right.
        rate: f64,
        /// Random state (xorshift).
        seed: u64,
    },
}

/// One chain as the drafter proposed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftLog {
    /// Position of the pending token (tokens the state had consumed).
    pub pos: usize,
    /// The proposals.
    pub tokens: Vec<u32>,
    /// Which were right.
    pub right: Vec<bool>,
}

/// Row coverage to report instead of the model's, given (chain number from 0, row in the chain, absolute
/// position of the row); drives case B.
pub type CoverageFn = Box<dyn Fn(usize, usize, usize) -> f32 + Send + Sync>;

/// A model whose drafts follow a [`DraftPlan`] against a reference token sequence.
pub struct ScriptedDrafter<'a, M> {
    inner: &'a M,
    reference: Vec<u32>,
    plan: Mutex<DraftPlan>,
    run_inner: bool,
    coverage: Option<CoverageFn>,
    log: Mutex<Vec<DraftLog>>,
    verifies: Mutex<usize>,
}

impl<'a, M: Backend> ScriptedDrafter<'a, M> {
    /// Wraps `inner`. `reference[j]` is the right token at position `j` (prompt and expected output together).
    /// With `run_inner`, the model's own drafter also runs (its cost is measured, its tokens are discarded).
    pub fn new(inner: &'a M, reference: Vec<u32>, plan: DraftPlan, run_inner: bool) -> Self {
        Self {
            inner,
            reference,
            plan: Mutex::new(plan),
            run_inner,
            coverage: None,
            log: Mutex::new(Vec::new()),
            verifies: Mutex::new(0),
        }
    }

    /// Reports `f(chain, row, position)` as each verify row's resident-expert coverage.
    pub fn with_coverage(mut self, f: CoverageFn) -> Self {
        self.coverage = Some(f);
        self
    }

    /// The chains proposed so far.
    pub fn log(&self) -> Vec<DraftLog> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// A wrong token for position `j`: the reference's neighbour id (never the reference token).
    fn wrong(&self, j: usize) -> u32 {
        let vocab = self.inner.vocab() as u32;
        let right = self.reference.get(j).copied().unwrap_or(0);
        (right + 1) % vocab.max(2)
    }
}

/// Everything but drafting and verify coverage is the wrapped model's.
impl<M: Backend> Backend for ScriptedDrafter<'_, M> {
    type State = M::State;
    type Snapshot = M::Snapshot;
    type Record = M::Record;

    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn describe(&self) -> String {
        format!("{} (scripted drafts)", self.inner.describe())
    }

    fn has_mtp(&self) -> bool {
        true
    }

    fn new_state(&self, max_len: usize, drafting: bool) -> Result<M::State, BackendError> {
        self.inner.new_state(max_len, drafting)
    }

    fn capacity(&self, state: &M::State) -> usize {
        self.inner.capacity(state)
    }

    fn state_bytes(&self, max_len: usize, drafting: bool) -> crate::backend::HeldBytes {
        self.inner.state_bytes(max_len, drafting)
    }

    fn forward(&self, state: &mut M::State, tokens: &[u32], want: LogitsFor) -> Result<Vec<f32>, BackendError> {
        self.inner.forward(state, tokens, want)
    }

    fn forward_batch(
        &self,
        items: &mut [crate::backend::BatchItem<'_, M::State>],
        mode: crate::backend::BatchMode,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        self.inner.forward_batch(items, mode)
    }

    fn snapshot(&self, state: &M::State) -> Result<M::Snapshot, BackendError> {
        self.inner.snapshot(state)
    }

    fn restore(&self, state: &mut M::State, snap: &M::Snapshot) -> Result<(), BackendError> {
        self.inner.restore(state, snap)
    }

    fn fork(
        &self,
        source: &Kept<M::State>,
        snap: &M::Snapshot,
        max_len: usize,
        drafting: bool,
    ) -> Result<M::State, BackendError> {
        self.inner.fork(source, snap, max_len, drafting)
    }

    fn state_held(&self, state: &M::State) -> crate::backend::HeldBytes {
        self.inner.state_held(state)
    }

    fn spill_state(&self, state: &M::State) -> Result<SequenceState, BackendError> {
        self.inner.spill_state(state)
    }

    fn snapshot_image(&self, snap: &M::Snapshot) -> Result<crate::model::Snapshot, BackendError> {
        self.inner.snapshot_image(snap)
    }

    fn snapshot_from_image(&self, image: crate::model::Snapshot) -> M::Snapshot {
        self.inner.snapshot_from_image(image)
    }

    fn placement_stats(&self) -> Option<std::sync::Arc<PlacementStats>> {
        self.inner.placement_stats()
    }

    fn take_timings(&self) -> Result<Timings, BackendError> {
        self.inner.take_timings()
    }

    fn position(&self, state: &M::State) -> usize {
        self.inner.position(state)
    }

    fn step_greedy(&self, state: &mut M::State, token: u32) -> Result<Option<u32>, BackendError> {
        self.inner.step_greedy(state, token)
    }

    fn step(&self, state: &mut M::State, token: u32) -> Result<Vec<f32>, BackendError> {
        self.inner.step(state, token)
    }

    fn can_draft(&self, state: &M::State) -> bool {
        !self.run_inner || self.inner.can_draft(state)
    }

    fn draft(&self, state: &mut M::State, pending: u32, n: usize) -> Result<Vec<u32>, BackendError> {
        if self.run_inner {
            self.inner.draft(state, pending, n)?;
        }
        let pos = self.inner.position(state);
        let mut plan = self.plan.lock().map_err(|_| ModelError::MtpUnavailable { reason: "poisoned plan".into() })?;
        let pattern: Vec<bool> = match &mut *plan {
            DraftPlan::Script(chains) => match chains.pop_front() {
                Some(p) => p.into_iter().take(n).collect(),
                None => vec![true; n],
            },
            DraftPlan::Rate { rate, seed } => (0..n)
                .map(|_| {
                    *seed ^= *seed << 13;
                    *seed ^= *seed >> 7;
                    *seed ^= *seed << 17;
                    ((*seed >> 11) as f64 / (1u64 << 53) as f64) < *rate
                })
                .collect(),
        };
        let mut tokens = Vec::with_capacity(pattern.len());
        let mut right = Vec::with_capacity(pattern.len());
        for (i, &ok) in pattern.iter().enumerate() {
            let j = pos + 1 + i;
            let Some(&truth) = self.reference.get(j) else { break };
            tokens.push(if ok { truth } else { self.wrong(j) });
            right.push(ok);
        }
        if let Ok(mut log) = self.log.lock() {
            log.push(DraftLog { pos, tokens: tokens.clone(), right });
        }
        Ok(tokens)
    }

    fn verify(&self, state: &mut M::State, chain: &[u32]) -> Result<Verified<M::Record>, BackendError> {
        let pos0 = self.inner.position(state);
        let mut v = self.inner.verify(state, chain)?;
        let k = self.verifies.lock().map(|mut n| {
            *n += 1;
            *n - 1
        });
        if let (Some(f), Ok(k)) = (&self.coverage, k) {
            for (i, c) in v.coverage.iter_mut().enumerate() {
                *c = f(k, i, pos0 + i);
            }
        }
        Ok(v)
    }

    fn rollback(&self, state: &mut M::State, record: &M::Record, keep: usize) -> Result<Rollback, BackendError> {
        self.inner.rollback(state, record, keep)
    }
}
