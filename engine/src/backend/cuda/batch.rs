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
//! [`BatchMode::Fast`] chooses kernels for the pass's row count (up to `tuning.cuda.mid_rows` rows the mid-size
//! 8-bit kernels: the tiled dense GEMV `gemvqm_*` and the grouped expert GEMV `moe_gemvqg_*`, which read each
//! weight once for all the rows; beyond, tensor-core GEMMs and grouped experts; hybrid: the policy's path for that
//! count), so a sequence's logits may differ in the last bits from a pass run alone. [`BatchMode::Deterministic`] runs the shared pass on the single-step
//! kernels row by row (the exact-rows mode of the verify pass: batch-invariant GEMVs, per-slot expert GEMVs, split
//! attention, the hybrid CPU path), which is bit for bit what [`CudaModel::forward`] computes for a decode step
//! and for chunks of up to [`CudaModel::single_step_rows`] tokens; longer chunks run alone (their alone-pass
//! kernels are the batch GEMMs, whose sums depend on the row count), so every item equals its `forward`.
//!
//! **CUDA Graphs.** The sequence-mixing kernels take each state's buffers as arguments, so a captured pass is
//! only valid for the states it was captured with. A batch of decode steps (one token per sequence, its logits
//! wanted) on the all-GPU model is therefore captured per set of sequences ([`BatchGraphs`]: keyed by the states'
//! ids in the batch's order and the mode; token ids, PLE rows and logits in fixed buffers of the graph; each
//! position read from the state's own device copy): run eagerly the first time, captured the second, replayed
//! while the batch's membership stays the same (a decoding batch keeps it for many steps: sequences join and
//! leave between steps). The few most recent sets are kept. Prefill chunks, mixed batches and hybrid passes (which
//! wait for the CPU's experts inside the pass) launch eagerly. A batch of one is a plain [`CudaModel::forward`],
//! with its own decode-step graph.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::device::{Dev, dtoh, ptr};
use super::gemv::GEMV_MAX_TOKENS;
use super::graphs::GraphSlot;
use super::memory::zeros;
use super::{CudaError, CudaModel, CudaState, Injected, PassSeq};
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
            if let Some(m) = &it.media {
                m.check(it.tokens.len(), self.config.hidden)?;
            }
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
            out[only] = self.forward_media(it.state, it.tokens, it.want, it.media.as_ref())?;
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
                *slot = self.forward_media(it.state, it.tokens, it.want, it.media.as_ref())?;
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
        // A fast pass may take the mid-size kernels for its row count (`Launch::mid`).
        ctx.batched_rows.store(!exact, Relaxed);
        let out = self.forward_shared_inner(items);
        ctx.exact_rows.store(false, Relaxed);
        ctx.batched_rows.store(false, Relaxed);
        self.settle(out)
    }

    fn forward_shared_inner(&self, items: &mut [&mut BatchItem<'_, CudaState>]) -> Result<Vec<Vec<f32>>, CudaError> {
        let ctx = &self.launch;
        let cfg = &self.config;
        let dev = &ctx.dev;
        let stream = dev.stream().clone();
        // (Rows with media inject their embeddings: eager.)
        let decode_only =
            items.iter().all(|it| it.tokens.len() == 1 && it.want == LogitsFor::Last && it.media.is_none());
        // (A routing override uploads its choice per pass: eager.)
        if decode_only && self.hybrid.is_none() && self.routing.is_none() && ctx.flags.graphs {
            return self.decode_batch_graphed(items);
        }
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
        let (ids, ple_rows) = self.stage_items(items)?;
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
        // Every item's image rows, as pass rows; kept alive until the pass is queued.
        let inject_d = self.upload_injected(
            items.iter().zip(&spans).filter_map(|(it, &(r0, _, _))| it.media.as_ref().map(|m| (r0, m))),
        )?;
        let inject = inject_d.as_ref().map(|(r, e)| Injected {
            rows: ptr(r, &stream, 0),
            embeds: ptr(e, &stream, 0),
            count: r.len(),
        });
        let x = {
            let seqs: Vec<PassSeq<'_>> =
                items.iter().zip(&spans).map(|(it, &(r0, n, _))| PassSeq::new(&*it.state, r0, n, &stream)).collect();
            self.launch_layers(&seqs, n, ids_p, rows_p, ple_emb_ptr, None, scripted, inject)?
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

    /// The pass's token ids and PLE n-gram rows in the items' order (each item's rows hashed from its own n-gram
    /// context, which this advances), with each state's position written to its device copy and its rows' rope
    /// positions to its M-RoPE track ([`CudaModel::stage_positions`]).
    ///
    /// Errors: a device copy fails.
    fn stage_items(&self, items: &mut [&mut BatchItem<'_, CudaState>]) -> Result<(Vec<i32>, Vec<i32>), CudaError> {
        let stream = self.launch.dev.stream();
        let ple = self.layers.iter().find_map(|l| l.ple.as_ref());
        let mut ids: Vec<i32> = Vec::with_capacity(items.iter().map(|it| it.tokens.len()).sum());
        let mut ple_rows: Vec<i32> = Vec::new();
        for it in items.iter_mut() {
            ids.extend(it.tokens.iter().map(|&t| t as i32));
            if let (Some(p), Some(ps)) = (ple, it.state.ple.as_mut()) {
                ple_rows.extend(p.ngram_rows(ps, it.tokens)?);
            }
            stream.memcpy_htod(&[it.state.pos as i32], &mut it.state.pos_dev)?;
            self.stage_positions(it.state, it.tokens.len(), it.media.as_ref())?;
        }
        Ok((ids, ple_rows))
    }

    /// One decode step of every item (one token each, its logits wanted; all-GPU) through the batch's CUDA Graph
    /// (see the module docs): the same launches as [`Self::forward_shared_inner`]'s eager pass, with the token ids,
    /// PLE rows and logits in the graph's fixed buffers.
    fn decode_batch_graphed(&self, items: &mut [&mut BatchItem<'_, CudaState>]) -> Result<Vec<Vec<f32>>, CudaError> {
        let ctx = &self.launch;
        let cfg = &self.config;
        let dev = &ctx.dev;
        let stream = dev.stream().clone();
        let (s, dim, vocab) = (items.len(), cfg.hc_dim(), cfg.vocab);
        let heads = self.layers.iter().find_map(|l| l.ple.as_ref()).map_or(1, |p| p.cfg.n_heads());
        // (Staging first: a state that makes its M-RoPE table now takes a new id.)
        let (ids, ple_rows) = self.stage_items(items)?;
        let key: Vec<u64> = items.iter().map(|it| it.state.id).collect();
        let mut graphs = self.batch_graphs.lock().expect("batch graphs lock");
        let g = graphs.entry(dev, key, ctx.exact(), heads, vocab)?;
        stream.memcpy_htod(&ids, &mut g.ids)?;
        if !ple_rows.is_empty() {
            stream.memcpy_htod(&ple_rows, &mut g.ple_rows)?;
        }
        let (ids_p, rows_p, logits_p) =
            (ptr(&g.ids, &stream, 0), ptr(&g.ple_rows, &stream, 0), ptr(&g.logits, &stream, 0));
        let x = {
            let seqs: Vec<PassSeq<'_>> =
                items.iter().enumerate().map(|(i, it)| PassSeq::new(&*it.state, i, 1, &stream)).collect();
            let (slot, seen) = &mut g.slot;
            ctx.run_graphed(slot, seen, || {
                let x = self.launch_layers(&seqs, s, ids_p, rows_p, None, None, None, None)?;
                self.launch_head(x, s, logits_p)?;
                Ok(x)
            })?
        };
        drop(graphs);
        for (i, it) in items.iter_mut().enumerate() {
            let pos0 = it.state.pos;
            it.state.pos = pos0 + 1;
            self.mtp_extend(it.state, x + (i * dim * 4) as u64, it.tokens, pos0)?;
        }
        let mut out = Vec::with_capacity(s);
        for i in 0..s {
            let mut row = vec![0f32; vocab];
            dtoh(&stream, row.as_mut_ptr() as *mut std::ffi::c_void, logits_p + (i * vocab * 4) as u64, vocab * 4)?;
            out.push(row);
        }
        stream.synchronize()?;
        Ok(out)
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

/// Batched decode graphs kept (the least recently used goes first).
const BATCH_GRAPHS: usize = 4;

/// A batched decode step's CUDA Graph and the fixed buffers it reads and writes.
pub(crate) struct BatchGraph {
    /// The batch's states (their ids, in the batch's order).
    states: Vec<u64>,
    /// Whether the pass ran every row on the single-step kernels (deterministic mode).
    exact: bool,
    slot: GraphSlot,
    /// Token ids `[S]`, PLE rows `[S, heads]`, logits `[S, vocab]`.
    ids: CudaSlice<i32>,
    ple_rows: CudaSlice<i32>,
    logits: CudaSlice<f32>,
    last_used: u64,
}

/// The batched decode graphs of a model (see the module docs).
#[derive(Default)]
pub(crate) struct BatchGraphs {
    graphs: Vec<BatchGraph>,
    clock: u64,
}

// SAFETY: a CUDA graph and its executable are driver handles that any thread with the model's context current
// may launch or destroy (the driver API does not tie them to the creating thread); cudarc only leaves them
// without `Send` because they are raw pointers. The graphs are reached through the model's mutex, so one thread
// at a time uses them, and the worker moves the model to its thread before the first pass.
unsafe impl Send for BatchGraphs {}

impl BatchGraphs {
    /// The graph of the batch of `states` in `exact` mode: found, or made with fresh buffers (no graph yet),
    /// replacing the least recently used when [`BATCH_GRAPHS`] are kept.
    ///
    /// Errors: the buffers cannot be allocated.
    fn entry(
        &mut self,
        dev: &Dev,
        states: Vec<u64>,
        exact: bool,
        heads: usize,
        vocab: usize,
    ) -> Result<&mut BatchGraph, CudaError> {
        self.clock += 1;
        let clock = self.clock;
        let at = match self.graphs.iter().position(|g| g.exact == exact && g.states == states) {
            Some(i) => i,
            None => {
                if self.graphs.len() >= BATCH_GRAPHS
                    && let Some(old) = (0..self.graphs.len()).min_by_key(|&i| self.graphs[i].last_used)
                {
                    self.graphs.swap_remove(old);
                }
                let s = states.len();
                let stream = dev.stream();
                self.graphs.push(BatchGraph {
                    states,
                    exact,
                    slot: (None, 0),
                    ids: stream.alloc_zeros::<i32>(s)?,
                    ple_rows: stream.alloc_zeros::<i32>(s * heads)?,
                    logits: zeros(dev, s * vocab)?,
                    last_used: clock,
                });
                self.graphs.len() - 1
            }
        };
        let g = &mut self.graphs[at];
        g.last_used = clock;
        Ok(g)
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
