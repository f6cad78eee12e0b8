//! Several sequences in one forward pass on the GPU ([`CudaModel::forward_batch`], the backend's
//! `Backend::forward_batch`), all-GPU and hybrid.
//!
//! The rows of every sequence are stacked (`[rows, ..]` buffers, each sequence's rows together, in the items'
//! order) and go through one pass over the layers ([`CudaModel::launch_layers`]): the embedding gather, the
//! hyper-connection mixes and injections, every projection of Gated DeltaNet, attention and PLE, the routers, the
//! routed experts (the hybrid CPU experts of all rows in one CPU job per layer), the shared expert, the final
//! mixer and the head run over all rows at once, so each weight is read once per pass. The sequence mixing runs
//! per sequence on its own state: the Gated DeltaNet conv and recurrence, rope at the sequence's positions, the
//! K/V and indexer-key writes, the QSA selection and attention over the sequence's own cache, and the PLE conv;
//! the PLE n-gram rows are hashed from each sequence's own context, and each sequence's MTP cache is extended
//! from its own rows after the pass.
//!
//! [`BatchMode::Fast`] chooses kernels for the pass's row count (tensor-core GEMMs and grouped experts for more
//! than a decode step's rows; hybrid: the policy's path for that count), so a sequence's logits may differ in
//! the last bits from a pass run alone. [`BatchMode::Deterministic`] runs the shared pass on the single-step
//! kernels row by row (the exact-rows mode of the verify pass: batch-invariant GEMVs, per-slot expert GEMVs, split
//! attention, the hybrid CPU path), which is bit for bit what [`CudaModel::forward`] computes for a decode step
//! and for chunks of up to [`CudaModel::single_step_rows`] tokens; longer chunks run alone (their alone-pass
//! kernels are the batch GEMMs, whose sums depend on the row count), so every item equals its `forward`.
//!
//! Launches are eager: the states of a batch change from step to step and the sequence-mixing kernels take each
//! state's buffers as arguments, so no CUDA Graph is captured for a batch (a batch of one is a plain
//! [`CudaModel::forward`], with its decode-step graph).

use super::device::ptr;
use super::gemv::GEMV_MAX_TOKENS;
use super::memory::zeros;
use super::{CudaError, CudaModel, CudaState, PassSeq};
use crate::backend::{BatchItem, BatchMode};
use crate::model::{LogitsFor, ModelError};

impl CudaModel {
    /// Runs each item's tokens on its state in one pass over the layers (see the module docs) and returns each
    /// item's logits as [`CudaModel::forward`] would (`[rows, vocab]` for its `want`, masked ids at `-inf`;
    /// empty for `LogitsFor::None` or no tokens), in the items' order. Under [`BatchMode::Deterministic`] every
    /// item's logits equal, bit for bit, those of `forward` with the same tokens on the same state.
    ///
    /// Errors: [`ModelError::TokenOutOfRange`] or [`ModelError::ContextOverflow`] in any item, reported before
    /// anything runs (every state unchanged); any other error (a device failure, a failed CPU expert job)
    /// leaves every state of the batch to be discarded.
    pub fn forward_batch(
        &self,
        items: &mut [BatchItem<'_, CudaState>],
        mode: BatchMode,
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        for it in items.iter() {
            self.check_tokens(it.state, it.tokens)?;
        }
        // Which items share the pass: all of them in fast mode; in deterministic mode those whose own forward
        // runs on the single-step kernels.
        let joins: Vec<bool> = items
            .iter()
            .map(|it| {
                let n = it.tokens.len();
                n > 0 && (mode == BatchMode::Fast || n <= self.single_step_rows())
            })
            .collect();
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); items.len()];
        let shared: Vec<usize> = (0..items.len()).filter(|&i| joins[i]).collect();
        if let [only] = shared[..] {
            let it = &mut items[only];
            out[only] = self.forward(it.state, it.tokens, it.want)?;
        } else if !shared.is_empty() {
            let mut group: Vec<&mut BatchItem<'_, CudaState>> =
                items.iter_mut().zip(&joins).filter(|(_, j)| **j).map(|(it, _)| it).collect();
            let logits = self.forward_shared(&mut group, mode == BatchMode::Deterministic)?;
            for (&i, l) in shared.iter().zip(logits) {
                out[i] = l;
            }
        }
        for (it, (&joined, slot)) in items.iter_mut().zip(joins.iter().zip(out.iter_mut())) {
            if !joined && !it.tokens.is_empty() {
                *slot = self.forward(it.state, it.tokens, it.want)?;
            }
        }
        Ok(out)
    }

    /// The longest chunk whose [`CudaModel::forward`] alone runs every row on a decode step's kernels (quantized
    /// GEMVs, split decode attention, per-slot expert GEMVs; hybrid: the CPU path for the non-resident experts):
    /// the kernels of an exact-rows pass, so such a chunk computes the same bits inside a deterministic batch.
    /// All-GPU: routed experts switch to the grouped kernels above `GEMV_MAX_TOKENS / 2` tokens. Hybrid: the GEMVs
    /// end at `GEMV_MAX_TOKENS`, the CPU path at the policy's crossover.
    pub fn single_step_rows(&self) -> usize {
        match &self.hybrid {
            None => GEMV_MAX_TOKENS / 2,
            Some(h) => GEMV_MAX_TOKENS.min(h.policy.params().cpu_max_tokens).max(1),
        }
    }

    /// Items, every state's tokens checked, in one pass; `exact` runs every row on the single-step kernels.
    fn forward_shared(
        &self,
        items: &mut [&mut BatchItem<'_, CudaState>],
        exact: bool,
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        use std::sync::atomic::Ordering::Relaxed;
        let ctx = &self.launch;
        ctx.exact_rows.store(exact, Relaxed);
        let out = self.forward_shared_inner(items);
        ctx.exact_rows.store(false, Relaxed);
        self.settle(out)
    }

    fn forward_shared_inner(&self, items: &mut [&mut BatchItem<'_, CudaState>]) -> Result<Vec<Vec<f32>>, CudaError> {
        let ctx = &self.launch;
        let cfg = &self.config;
        let dev = &ctx.dev;
        let stream = dev.stream().clone();
        if let Some(h) = &self.hybrid {
            // The GPU's critical path of this step starts here.
            h.step_started(&stream)?;
        }
        let dim = cfg.hc_dim();
        let n: usize = items.iter().map(|it| it.tokens.len()).sum();
        // Each item's rows: (first row, count), and its position before the pass.
        let mut spans = Vec::with_capacity(items.len());
        let mut r0 = 0;
        for it in items.iter() {
            spans.push((r0, it.tokens.len(), it.state.pos));
            r0 += it.tokens.len();
        }
        let mut ids: Vec<i32> = Vec::with_capacity(n);
        let mut ple_rows: Vec<i32> = Vec::new();
        let ple = self.layers.iter().find_map(|l| l.ple.as_ref());
        for it in items.iter_mut() {
            ids.extend(it.tokens.iter().map(|&t| t as i32));
            if let (Some(p), Some(ps)) = (ple, it.state.ple.as_mut()) {
                // Hashed from the item's own n-gram context, which this advances.
                ple_rows.extend(p.ngram_rows(ps, it.tokens)?);
            }
            stream.memcpy_htod(&[it.state.pos as i32], &mut it.state.pos_dev)?;
        }
        // Kept alive until the pass is queued; the frees are stream-ordered.
        let ple_emb = self.upload_ngram_rows(&ple_rows)?;
        let ple_emb_ptr = ple_emb.as_ref().map(|e| ptr(e, &stream, 0));
        // A routing override's choice for every row; kept alive until the pass is queued.
        let table = {
            let mut rows: Vec<(&mut CudaState, &[u32])> =
                items.iter_mut().map(|it| (&mut *it.state, it.tokens)).collect();
            self.scripted_routing(&mut rows)
        };
        let table_d = match &table {
            Some((ti, tw)) => Some((stream.clone_htod(ti)?, stream.clone_htod(tw)?)),
            None => None,
        };
        let scripted = table_d.as_ref().map(|(i, w)| (ptr(i, &stream, 0), ptr(w, &stream, 0)));
        ctx.arena_reset()?;
        let ids_d = stream.clone_htod(&ids)?;
        let rows_d = stream.clone_htod(if ple_rows.is_empty() { &[0i32][..] } else { &ple_rows[..] })?;
        let (ids_p, rows_p) = (ptr(&ids_d, &stream, 0), ptr(&rows_d, &stream, 0));
        let x = {
            let seqs: Vec<PassSeq<'_>> = items
                .iter()
                .zip(&spans)
                .map(|(it, &(r0, n, _))| PassSeq { st: &*it.state, r0, n, pos_dev: ptr(&it.state.pos_dev, &stream, 0) })
                .collect();
            self.launch_layers(&seqs, n, ids_p, rows_p, ple_emb_ptr, None, scripted)?
        };
        // The rows whose logits come back, per item: (first row, count).
        let wanted: Vec<(usize, usize)> = items
            .iter()
            .zip(&spans)
            .map(|(it, &(r0, n, _))| match it.want {
                LogitsFor::None => (r0, 0),
                LogitsFor::Last => (r0 + n - 1, 1),
                LogitsFor::All => (r0, n),
            })
            .collect();
        let rows: usize = wanted.iter().map(|w| w.1).sum();
        let logits = zeros(dev, (rows * cfg.vocab).max(1))?;
        if rows > 0 {
            let banks = match contiguous(&wanted) {
                Some(first) => x + (first * dim * 4) as u64,
                None => {
                    // Gather the wanted banks so the final mixer and the head run once over all of them.
                    let banks = ctx.tmp(rows * dim)?;
                    let mut at = 0;
                    for &(r, c) in wanted.iter().filter(|w| w.1 > 0) {
                        ctx.dtod(banks + (at * dim * 4) as u64, x + (r * dim * 4) as u64, c * dim)?;
                        at += c;
                    }
                    banks
                }
            };
            self.launch_head(banks, rows, ctx.addr(&logits, 0))?;
        }
        for (it, &(r0, n, pos0)) in items.iter_mut().zip(&spans) {
            it.state.pos = pos0 + n;
            self.mtp_extend(it.state, x + (r0 * dim * 4) as u64, it.tokens, pos0)?;
        }
        if rows == 0 {
            stream.synchronize()?;
            return Ok(vec![Vec::new(); items.len()]);
        }
        let all = stream.clone_dtoh(&logits)?;
        let mut at = 0;
        Ok(wanted
            .iter()
            .map(|&(_, c)| {
                let row = all[at * cfg.vocab..(at + c) * cfg.vocab].to_vec();
                at += c;
                row
            })
            .collect())
    }

    /// Checks that `st` can consume `tokens`: every id in the vocabulary, room for all of them.
    ///
    /// Errors: [`ModelError::TokenOutOfRange`], [`ModelError::ContextOverflow`].
    pub(crate) fn check_tokens(&self, st: &CudaState, tokens: &[u32]) -> Result<(), CudaError> {
        let vocab = self.config.vocab;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { token: bad, vocab }.into());
        }
        let needed = st.pos + tokens.len();
        if needed > st.max_len {
            return Err(ModelError::ContextOverflow { needed, limit: st.max_len }.into());
        }
        Ok(())
    }
}

/// The first row when the non-empty `(first row, count)` spans follow each other without a gap (one block of
/// rows in the pass's order), else `None`.
fn contiguous(spans: &[(usize, usize)]) -> Option<usize> {
    let mut live = spans.iter().filter(|s| s.1 > 0);
    let &(first, c) = live.next()?;
    let mut next = first + c;
    for &(r, c) in live {
        if r != next {
            return None;
        }
        next += c;
    }
    Some(first)
}

#[cfg(test)]
mod tests {
    use super::contiguous;

    #[test]
    fn wanted_rows_are_contiguous_only_without_gaps() {
        // Decode rows of three items: rows 0, 1, 2.
        assert_eq!(contiguous(&[(0, 1), (1, 1), (2, 1)]), Some(0));
        // A prefill chunk (rows 1..5) wanting nothing between two decode rows: rows 0 and 5, a gap.
        assert_eq!(contiguous(&[(0, 1), (1, 0), (5, 1)]), None);
        // The same chunk wanting every row: 0..6 in one block.
        assert_eq!(contiguous(&[(0, 1), (1, 4), (5, 1)]), Some(0));
        // A chunk wanting its last row (row 4 of 0..5), then a decode row at 5.
        assert_eq!(contiguous(&[(4, 1), (5, 1)]), Some(4));
        // A decode row, then a chunk's last row with its other rows between: a gap.
        assert_eq!(contiguous(&[(0, 1), (4, 1)]), None);
        assert_eq!(contiguous(&[(0, 0), (3, 0)]), None);
    }
}
