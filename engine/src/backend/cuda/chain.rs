//! MTP speculative decoding on the GPU: drafting with the MTP block, the batched verify pass over a chain and its
//! exact rollback. The math is the CPU's (`crate::model::mtp`, `Qwen4Exp::draft`, `forward_chain`,
//! `rollback_chain`); this module mirrors it with the CUDA kernels.
//!
//! - **Draft**: `n` MTP steps enqueued back to back without a host round trip: each step's token id is the
//!   device argmax of the previous step's logits (`argmax_rows` writes it where the next step's embedding lookup
//!   reads it), each step's output bank is copied where the next step reads its hidden input. One copy brings
//!   the `n` ids back.
//! - **Verify**: one forward of the chain with every row computed exactly as a single decode step computes it
//!   (batch-invariant kernels: the quantized GEMVs in groups of up to 8 tokens, per-token expert GEMVs, split
//!   decode attention, and the hybrid CPU path), so speculative decoding keeps plain greedy output. Before the
//!   pass the Gated DeltaNet conv and recurrent states and the PLE conv state are copied aside (device to device);
//!   during it the inputs of those recurrences (pre-conv `qkv`, `beta`, `g`, the PLE conv input) and every row's
//!   pre-mixer bank are recorded.
//! - **Hybrid verify** (placed model): the chain is verified with the GPU-resident experts; each row reports the
//!   smallest share over the layers of its router weight those experts cover (`hybrid_split` writes it). A row
//!   below the handoff threshold gets no CPU experts (its logits are not trusted: reported as coverage 0, the
//!   decoder cuts the chain there and runs that token as an exact step); a row at or above it has its other
//!   experts computed on the CPU as a plain step would, so trusted rows are exact (reported as coverage 1). With
//!   `verify_handoff` (`hybrid::policy`) low-coverage rows are handed to the CPU inside the verify pass instead
//!   (every row exact, coverage 1).
//! - **Rollback**: attention KV and indexer keys are position-indexed (nothing to undo but, with the hot window,
//!   the ring slots the dropped rows overwrote, refilled from the host copies); GDN and PLE states are
//!   restored from the copies and only their recurrences are replayed over the kept rows (no projection, router,
//!   MoE or head work is redone); the n-gram context is rebuilt on the host; the MTP cache is realigned over the
//!   kept rows from the recorded banks.

use nebula_kernels::cudarc::driver::{CudaEvent, CudaSlice, sys as driver_sys};

use super::device::{Arg, ptr};
use super::launch::Launch;
use super::linear_attn::GdnRecording;
use super::memory::zeros;
use super::mtp::DevMtpState;
use super::state::{CudaState, LayerState};
use super::{CudaError, CudaModel, DevTokenMixer};
use crate::model::{LogitsFor, ModelError};

/// Most rows a verify pass takes (the window controller's largest chain, 16 drafts, plus the pending token).
pub const MAX_CHAIN_ROWS: usize = 17;

/// One GDN layer's rollback material: the states before the chain and the recurrences' inputs per row.
pub(crate) struct GdnChain {
    pub(crate) conv: CudaSlice<f32>,
    pub(crate) recurrent: CudaSlice<f32>,
    pub(crate) qkv: CudaSlice<f32>,
    pub(crate) beta: CudaSlice<f32>,
    pub(crate) g: CudaSlice<f32>,
}

/// Device buffers a verify pass records into (allocated with the state's first chain, for
/// [`MAX_CHAIN_ROWS`] rows).
pub(crate) struct ChainBufs {
    pub(crate) gdn: Vec<Option<GdnChain>>,
    pub(crate) ple_conv: Option<CudaSlice<f32>>,
    pub(crate) ple_nrm: Option<CudaSlice<f32>>,
    /// Every row's pre-mixer bank, `[rows, S*d]`.
    pub(crate) banks: CudaSlice<f32>,
    /// Per row, the resident experts' smallest share of the router weight over the layers.
    pub(crate) coverage: CudaSlice<f32>,
    /// The chain's token ids, PLE table rows and logits (fixed addresses: the pass replays as a graph).
    pub(crate) ids: CudaSlice<i32>,
    pub(crate) ple_rows: CudaSlice<i32>,
    pub(crate) logits: CudaSlice<f32>,
    pub(crate) saved_from: CudaEvent,
    pub(crate) saved_to: CudaEvent,
}

/// What [`CudaModel::verify_chain`] keeps for its rollback.
#[derive(Debug, Clone)]
pub struct CudaChain {
    pos0: usize,
    tokens: Vec<u32>,
    ple_context: Vec<u32>,
}

impl ChainBufs {
    /// Where layer `li`'s GDN inputs go.
    pub(crate) fn gdn_rec(&self, ctx: &Launch, li: usize) -> Option<GdnRecording> {
        self.gdn.get(li)?.as_ref().map(|g| GdnRecording {
            qkv: ctx.addr(&g.qkv, 0),
            beta: ctx.addr(&g.beta, 0),
            g: ctx.addr(&g.g, 0),
        })
    }
    /// Where the PLE conv inputs go.
    pub(crate) fn ple_rec(&self, ctx: &Launch) -> Option<u64> {
        self.ple_nrm.as_ref().map(|b| ctx.addr(b, 0))
    }
    /// Where the banks go.
    pub(crate) fn banks_rec(&self, ctx: &Launch) -> u64 {
        ctx.addr(&self.banks, 0)
    }
    /// The pass's (token ids, PLE rows, logits) buffers.
    pub(crate) fn pass_buffers(&self, ctx: &Launch) -> (u64, u64, u64) {
        (ctx.addr(&self.ids, 0), ctx.addr(&self.ple_rows, 0), ctx.addr(&self.logits, 0))
    }
    /// The per-row coverage buffer.
    pub(crate) fn coverage_rec(&self, ctx: &Launch) -> u64 {
        ctx.addr(&self.coverage, 0)
    }
}

impl CudaModel {
    /// Whether a verify pass writes per-row coverage (hybrid, as the policy says); otherwise every row is exact
    /// and its coverage is 1.
    pub(crate) fn verify_reports_coverage(&self) -> bool {
        self.hybrid.as_ref().is_some_and(|h| h.policy.verify_reports_coverage())
    }

    /// Whether the model has an MTP block on the device.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Keeps the MTP cache aligned after the target consumed `tokens` from `pos0` (their pre-mixer banks at `x`,
    /// `[n, S*d]`): runs every MTP row whose next token is now known in one batch and keeps the last bank
    /// (`Qwen4Exp::extend_mtp`). A cache that is out of step is left alone (drafting then refuses).
    pub(crate) fn mtp_extend(&self, st: &mut CudaState, x: u64, tokens: &[u32], pos0: usize) -> Result<(), CudaError> {
        let ctx = &self.launch;
        let dim = ctx.cfg.hc_dim();
        let capacity = st.max_len;
        let (Some(mtp), Some(ms)) = (&self.mtp, st.mtp.as_mut()) else { return Ok(()) };
        let n = tokens.len();
        if n == 0 {
            return Ok(());
        }
        if pos0 > 0 && ms.rows == pos0 && ms.drafted_with != Some(tokens[0]) {
            ms.rows = pos0 - 1; // a draft ran this row for another pending token: redo it
        }
        ms.drafted_with = None;
        let aligned = if pos0 == 0 { ms.rows == 0 } else { ms.rows + 1 == pos0 || ms.rows == pos0 };
        let has_bank = pos0 == 0 || ms.rows == pos0 || ms.has_bank;
        if !aligned || !has_bank {
            return Ok(());
        }
        let end = pos0 + n - 1;
        let stream = ctx.dev.stream().clone();
        if ms.rows < end {
            let count = end - ms.rows;
            let banks = ctx.tmp(count * dim)?;
            let mut filled = 0;
            if ms.rows + 1 == pos0 {
                ctx.dtod(banks, ctx.addr(&ms.last_bank, 0), dim)?;
                filled = 1;
            }
            // Rows pos0.. read the target's banks of this pass.
            ctx.dtod(banks + (filled * dim * 4) as u64, x, (count - filled) * dim)?;
            let next: Vec<i32> = (ms.rows..end).map(|j| tokens[j + 1 - pos0] as i32).collect();
            let ids = stream.clone_htod(&next)?;
            let pos = stream.clone_htod(&[ms.rows as i32])?;
            let (ids, pos) = (ptr(&ids, &stream, 0), ptr(&pos, &stream, 0));
            mtp.forward(ctx, &self.head, self.mtp_host(), ms, banks, ids, count, pos, capacity, None)?;
            ms.rows = end;
        }
        ctx.dtod(ctx.addr(&ms.last_bank, 0), x + ((n - 1) * dim * 4) as u64, dim)?;
        ms.has_bank = true;
        Ok(())
    }

    /// Whether a draft can follow `st` now (block loaded, a token consumed, the cache aligned).
    pub fn can_draft(&self, st: &CudaState) -> bool {
        match (&self.mtp, &st.mtp) {
            (Some(_), Some(ms)) => st.pos > 0 && ms.has_bank && (ms.rows + 1 == st.pos || ms.rows == st.pos),
            _ => false,
        }
    }

    /// Up to `n` greedy drafts after `pending` (`Qwen4Exp::draft`): step `i` reads the target's bank at
    /// `pos - 1` (step 0) or step `i - 1`'s own bank, at rope position `pos - 1 + i`. The first row stays in the
    /// MTP cache (the verify pass does not redo it), the chained rows are dropped.
    ///
    /// Errors: no block, an empty or misaligned state, a bad token, more than [`MAX_CHAIN_ROWS`] - 1 drafts.
    pub fn draft_tokens(&self, st: &mut CudaState, pending: u32, n: usize) -> Result<Vec<u32>, CudaError> {
        let cfg = &self.config;
        let unavailable = |reason: &str| CudaError::Model(ModelError::MtpUnavailable { reason: reason.into() });
        if pending as usize >= cfg.vocab {
            return Err(ModelError::TokenOutOfRange { token: pending, vocab: cfg.vocab }.into());
        }
        if self.mtp.is_none() {
            return Err(unavailable("the model has no MTP block on the GPU"));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        if n >= MAX_CHAIN_ROWS {
            return Err(unavailable("more drafts than a verify pass takes"));
        }
        let pos = st.pos;
        if pos + n > st.max_len {
            return Err(unavailable("no room for the drafts in the context"));
        }
        let capacity = st.max_len;
        let mtp = self.mtp.as_ref().ok_or_else(|| unavailable("the model has no MTP block on the GPU"))?;
        let ms = st.mtp.as_mut().ok_or_else(|| unavailable("the sequence state has no MTP cache"))?;
        if pos == 0 || !ms.has_bank {
            return Err(unavailable("no target hidden state yet (empty sequence)"));
        }
        if ms.rows == pos {
            ms.rows = pos - 1;
        } else if ms.rows + 1 != pos {
            return Err(unavailable("the MTP cache is out of step with the sequence"));
        }
        let ctx = &self.launch;
        let dev = &ctx.dev;
        let stream = dev.stream().clone();
        let dim = cfg.hc_dim();
        let positions: Vec<i32> = (0..n).map(|i| (pos - 1 + i) as i32).collect();
        stream.memcpy_htod(&positions, &mut ms.draft_positions)?;
        stream.memcpy_htod(&[pending as i32], &mut ms.draft_ids)?;
        let mut graphs = std::mem::take(&mut ms.graphs);
        let ms_ref: &DevMtpState = ms;
        let chain = {
            let (slot, seen) = &mut graphs[n];
            ctx.run_graphed(slot, seen, || {
                let logits = ctx.tmp(cfg.vocab)?;
                for i in 0..n {
                    let mark = ctx.arena_mark();
                    let bank = if i == 0 { ctx.addr(&ms_ref.last_bank, 0) } else { ctx.addr(&ms_ref.draft_bank, 0) };
                    let ids = ptr(&ms_ref.draft_ids, &stream, i);
                    let at = ptr(&ms_ref.draft_positions, &stream, i);
                    let host = self.mtp_host();
                    let x = mtp.forward(ctx, &self.head, host, ms_ref, bank, ids, 1, at, capacity, Some(logits))?;
                    dev.launch(
                        "argmax_rows",
                        (1, 1, 1),
                        1024,
                        &[Arg::Ptr(logits), Arg::I32(cfg.vocab as i32), Arg::Ptr(ids + 4)],
                    )?;
                    ctx.dtod(ctx.addr(&ms_ref.draft_bank, 0), x, dim)?;
                    ctx.arena_release(mark);
                }
                Ok(0)
            })
        };
        ms.graphs = graphs;
        chain?;
        let mut out = vec![0i32; n + 1];
        stream.memcpy_dtoh(&ms.draft_ids.slice(0..n + 1), &mut out)?;
        stream.synchronize()?;
        ms.rows = pos;
        ms.drafted_with = Some(pending);
        Ok(out[1..].iter().map(|&t| t as u32).collect())
    }

    /// Consumes `chain` (the pending token and its drafts) in one batched pass and returns every row's logits
    /// (`[rows, vocab]`) with each row's coverage (see the module doc) and what the rollback needs. Rows are bit
    /// for bit what single decode steps compute.
    ///
    /// Errors: a bad token, a context overflow or more than [`MAX_CHAIN_ROWS`] rows (state unchanged); a failed
    /// CPU job in hybrid mode (state to be discarded).
    pub fn verify_chain(
        &self,
        st: &mut CudaState,
        chain: &[u32],
    ) -> Result<crate::speculative::Verified<CudaChain>, CudaError> {
        let cfg = &self.config;
        let n = chain.len();
        if n == 0 || n > MAX_CHAIN_ROWS {
            return Err(CudaError::Unsupported(format!("a verify chain of {n} rows (1 to {MAX_CHAIN_ROWS})")));
        }
        if let Some(&bad) = chain.iter().find(|&&t| t as usize >= cfg.vocab) {
            return Err(ModelError::TokenOutOfRange { token: bad, vocab: cfg.vocab }.into());
        }
        if st.pos + n > st.max_len {
            return Err(ModelError::ContextOverflow { needed: st.pos + n, limit: st.max_len }.into());
        }
        if st.chain.is_none() {
            st.chain = Some(self.new_chain_bufs()?);
        }
        let mut bufs = st.chain.take().expect("allocated above");
        if self.verify_reports_coverage()
            && let Err(e) = self.launch.dev.stream().memcpy_htod(&[1f32; MAX_CHAIN_ROWS], &mut bufs.coverage)
        {
            st.chain = Some(bufs);
            return Err(e.into());
        }
        let ple_context = st.ple.as_ref().map(|p| p.context.clone()).unwrap_or_default();
        let record = CudaChain { pos0: st.pos, tokens: chain.to_vec(), ple_context };
        let out = self.verify_with(st, chain, &bufs);
        st.chain = Some(bufs);
        let (logits, coverage, save_s) = out?;
        Ok(crate::speculative::Verified { logits, coverage, record, save_s, realign_s: 0.0 })
    }

    fn verify_with(
        &self,
        st: &mut CudaState,
        chain: &[u32],
        bufs: &ChainBufs,
    ) -> Result<(Vec<f32>, Vec<f32>, f64), CudaError> {
        let n = chain.len();
        // The logits' copy to the host has synchronised the stream (the events below are complete).
        let logits = self.forward_guarded(st, chain, LogitsFor::All, Some(bufs), None)?;
        let mut coverage = vec![1f32; n];
        if let Some(h) = self.hybrid.as_ref().filter(|_| self.verify_reports_coverage()) {
            self.launch.dev.stream().memcpy_dtoh(&bufs.coverage.slice(0..n), &mut coverage)?;
            // A row at or above the handoff threshold had its other experts computed on the CPU (exact): 1; a
            // row under it got none (not trusted): 0, so the decoder's own threshold cannot disagree with the
            // handoff the pass applied.
            let handoff = h.policy.params().handoff;
            for c in &mut coverage {
                *c = if *c >= handoff { 1.0 } else { 0.0 };
            }
        }
        let save_s = bufs.saved_from.elapsed_ms(&bufs.saved_to).map_or(0.0, |ms| ms as f64 * 1e-3);
        Ok((logits, coverage, save_s))
    }

    /// Copies the GDN and PLE states aside before a verify pass (inside the pass, so a captured verify graph
    /// includes it), between two timing events.
    pub(crate) fn save_chain_states(&self, st: &CudaState, bufs: &ChainBufs) -> Result<(), CudaError> {
        let ctx = &self.launch;
        let stream = ctx.dev.stream();
        bufs.saved_from.record(stream)?;
        for (ls, rec) in st.layers.iter().zip(&bufs.gdn) {
            if let (LayerState::LinearAttention(gs), Some(g)) = (ls, rec) {
                ctx.dtod(ctx.addr(&g.conv, 0), ctx.addr(&gs.conv, 0), gs.conv.len())?;
                ctx.dtod(ctx.addr(&g.recurrent, 0), ctx.addr(&gs.recurrent, 0), gs.recurrent.len())?;
            }
        }
        if let (Some(state), Some(saved)) = (&st.ple, &bufs.ple_conv) {
            ctx.dtod(ctx.addr(saved, 0), ctx.addr(&state.conv, 0), state.conv.len())?;
        }
        bufs.saved_to.record(stream)?;
        Ok(())
    }

    fn new_chain_bufs(&self) -> Result<ChainBufs, CudaError> {
        let ctx = &self.launch;
        let cfg = &ctx.cfg;
        let dev = &ctx.dev;
        let rows = MAX_CHAIN_ROWS;
        let (nv, dk, c) = (cfg.ssm_v_heads, cfg.ssm_head_dim, cfg.ssm_conv_dim());
        let mut gdn = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            gdn.push(match &l.mixer {
                DevTokenMixer::LinearAttention(_) => Some(GdnChain {
                    conv: zeros(dev, (cfg.ssm_conv_kernel - 1) * c)?,
                    recurrent: zeros(dev, nv * dk * dk)?,
                    qkv: zeros(dev, rows * c)?,
                    beta: zeros(dev, rows * nv)?,
                    g: zeros(dev, rows * nv)?,
                }),
                DevTokenMixer::SelfAttention(_) => None,
            });
        }
        let ple = self.layers.iter().find_map(|l| l.ple.as_ref());
        let timing = Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT);
        Ok(ChainBufs {
            gdn,
            ple_conv: ple.map(|p| zeros(dev, p.cfg.conv_state_len() * cfg.hc_dim())).transpose()?,
            ple_nrm: ple.map(|_| zeros(dev, rows * cfg.hc_dim())).transpose()?,
            banks: zeros(dev, rows * cfg.hc_dim())?,
            coverage: zeros(dev, rows)?,
            ids: dev.stream().alloc_zeros::<i32>(rows)?,
            ple_rows: dev.stream().alloc_zeros::<i32>(rows * ple.map_or(1, |p| p.cfg.n_heads()))?,
            logits: zeros(dev, rows * cfg.vocab)?,
            saved_from: dev.gpu.ctx.new_event(timing)?,
            saved_to: dev.gpu.ctx.new_event(timing)?,
        })
    }

    /// Cuts the chain of `record` back to its first `keep` rows and realigns the MTP cache to them (see the
    /// module doc); the state equals, bit for bit, what a forward of only the kept rows leaves. Returns the
    /// seconds spent realigning the MTP cache.
    ///
    /// Errors: `record` is not the state's last chain, or `keep` exceeds it.
    pub fn rollback_chain(&self, st: &mut CudaState, record: &CudaChain, keep: usize) -> Result<f64, CudaError> {
        let n = record.tokens.len();
        let bad = || CudaError::Model(ModelError::BadSnapshot { snapshot: record.pos0 + keep, current: st.pos });
        if keep > n || st.pos != record.pos0 + n {
            return Err(bad());
        }
        let bufs = st.chain.take().ok_or_else(bad)?;
        let out = self.rollback_with(st, record, keep, &bufs);
        st.chain = Some(bufs);
        out
    }

    fn rollback_with(
        &self,
        st: &mut CudaState,
        record: &CudaChain,
        keep: usize,
        bufs: &ChainBufs,
    ) -> Result<f64, CudaError> {
        let ctx = &self.launch;
        let n = record.tokens.len();
        if keep < n {
            // The verify pass's temporaries are dead: replay in fresh arena space.
            ctx.arena_reset()?;
            let c = ctx.cfg.ssm_conv_dim();
            for ((ls, layer), rec) in st.layers.iter().zip(&self.layers).zip(&bufs.gdn) {
                if let (LayerState::LinearAttention(gs), DevTokenMixer::LinearAttention(g), Some(r)) =
                    (ls, &layer.mixer, rec)
                {
                    ctx.dtod(ctx.addr(&gs.conv, 0), ctx.addr(&r.conv, 0), gs.conv.len())?;
                    ctx.dtod(ctx.addr(&gs.recurrent, 0), ctx.addr(&r.recurrent, 0), gs.recurrent.len())?;
                    if keep > 0 {
                        let qkv = ctx.tmp(keep * c)?;
                        ctx.dtod(qkv, ctx.addr(&r.qkv, 0), keep * c)?;
                        g.recurrence(ctx, gs, qkv, ctx.addr(&r.beta, 0), ctx.addr(&r.g, 0), keep, None)?;
                    }
                }
            }
            if let (Some(state), Some(saved), Some(nrm), Some(ple)) =
                (&st.ple, &bufs.ple_conv, &bufs.ple_nrm, self.layers.iter().find_map(|l| l.ple.as_ref()))
            {
                ctx.dtod(ctx.addr(&state.conv, 0), ctx.addr(saved, 0), state.conv.len())?;
                if keep > 0 {
                    let u = ctx.tmp(keep * ctx.cfg.hc_dim())?;
                    ple.conv_rows(ctx, &state.conv, ctx.addr(nrm, 0), u, keep)?;
                }
            }
            if let Some(state) = st.ple.as_mut() {
                let len = record.ple_context.len();
                let mut hist = record.ple_context.clone();
                hist.extend_from_slice(&record.tokens[..keep]);
                state.context.copy_from_slice(&hist[hist.len() - len..]);
            }
        }
        // Windowed caches: the slots the dropped rows overwrote get their earlier rows back.
        self.refill_rings(st, record.pos0 + keep, record.pos0 + n)?;
        st.pos = record.pos0 + keep;
        st.mrope.truncate(st.pos);
        let t = std::time::Instant::now();
        if keep > 0 && st.mtp.is_some() {
            let banks = ctx.addr(&bufs.banks, 0);
            self.mtp_extend(st, banks, &record.tokens[..keep], record.pos0)?;
        }
        // (Host time: the realignment's kernels are queued; the next draft waits for them.)
        Ok(t.elapsed().as_secs_f64())
    }
}
