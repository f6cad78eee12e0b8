//! MTP speculative decoding on the GPU (issue 9, SPEC §4): the MTP draft block on the device, the batched verify
//! pass over a chain and its exact rollback. The math is the CPU's (`crate::model::mtp`, `Qwen4Exp::draft`,
//! `forward_chain`, `rollback_chain`); this module mirrors it with the CUDA kernels.
//!
//! - **Draft**: `n` MTP steps enqueued back to back without a host round trip: each step's token id is the
//!   device argmax of the previous step's logits (`argmax_rows` writes it where the next step's embedding lookup
//!   reads it), each step's output bank is copied where the next step reads its hidden input. One copy brings
//!   the `n` ids back.
//! - **Verify**: one forward of the chain with every row computed exactly as a single decode step computes it
//!   (batch-invariant kernels: the quantized GEMVs in groups of up to 8 tokens, per-token expert GEMVs, split
//!   decode attention, and the hybrid CPU path), so level 3 keeps plain greedy output. Before the pass the Gated
//!   DeltaNet conv and recurrent states and the PLE conv state are copied aside (device to device); during it the
//!   inputs of those recurrences (pre-conv `qkv`, `beta`, `g`, the PLE conv input) and every row's pre-mixer bank
//!   are recorded.
//! - **Hybrid verify** (placed model): per SPEC §4 the chain is verified with the GPU-resident experts; each row
//!   reports the smallest share over the layers of its router weight those experts cover (`hybrid_split` writes
//!   it). A row below the handoff threshold gets no CPU experts (its logits are not trusted: case B, the decoder
//!   cuts the chain there and runs that token as an exact step); a row at or above it has its other experts
//!   computed on the CPU as a plain step would, so trusted rows are exact. `NEBULA_MTP_VERIFY_HANDOFF=1` hands
//!   low-coverage rows to the CPU inside the verify pass instead (every row exact, coverage 1).
//! - **Rollback**: attention KV and indexer keys are position-indexed (nothing to undo); GDN and PLE states are
//!   restored from the copies and only their recurrences are replayed over the kept rows (no projection, router,
//!   MoE or head work is redone); the n-gram context is rebuilt on the host; the MTP cache is realigned over the
//!   kept rows from the recorded banks.
//!
//! In hybrid mode the MTP block's routed experts stay on the host (the GPU holds none of them: the hotlist has no
//! entry for the block), so its MoE runs through the same CPU path as a trunk layer's non-resident experts.

use nebula_kernels::cudarc::driver::{CudaEvent, CudaSlice, sys as driver_sys};

use super::ops::{Arg, ptr};
use super::{CudaError, CudaModel, CudaState, DevAttn, DevHc, DevLayerState, DevMatrix, DevMoe, Uploader, zeros};
use crate::model::{LogitsFor, ModelError, Qwen4Exp};

/// Most rows a verify pass takes (the window controller's largest chain, 16 drafts, plus the pending token).
pub const MAX_CHAIN_ROWS: usize = 17;

/// The MTP block on the device (`blk.{n_layer}.*`, see `crate::model::mtp`).
pub(crate) struct DevMtp {
    eh_proj: DevMatrix,
    enorm: CudaSlice<f32>,
    hnorm: CudaSlice<f32>,
    attn_hc: DevHc,
    pub(super) attn: DevAttn,
    mlp_hc: DevHc,
    moe: DevMoe,
    mixer: DevHc,
}

impl DevMtp {
    /// Uploads `model`'s MTP block; `hybrid` keeps its routed experts on the host.
    pub(crate) fn upload(up: &mut Uploader<'_>, model: &Qwen4Exp, hybrid: bool) -> Result<Option<Self>, CudaError> {
        let Some(b) = model.mtp() else { return Ok(None) };
        let what = "the MTP block";
        Ok(Some(Self {
            eh_proj: up.matrix(&b.eh_proj, what)?,
            enorm: up.vector(&b.enorm)?,
            hnorm: up.vector(&b.hnorm)?,
            attn_hc: up.hc(&b.attn_hyper_connection, what)?,
            attn: up.attn(&b.self_attn, what)?,
            mlp_hc: up.hc(&b.mlp_hyper_connection, what)?,
            moe: up.moe(&b.mlp, if hybrid { Some(&[]) } else { None }, what)?,
            mixer: up.hc(&b.hyper_connection_mixer, what)?,
        }))
    }
}

/// The MTP block's part of a sequence's device state (mirrors `crate::model::MtpState`): after the target
/// consumed `pos` tokens the cache holds rows `0..pos-1` (or `pos` when a draft already ran the next row).
pub(crate) struct MtpDevState {
    pub(super) attn: DevLayerState,
    pub(super) rows: usize,
    /// The target's pre-mixer bank at `pos - 1`, `[S*d]`.
    pub(super) last_bank: CudaSlice<f32>,
    pub(super) has_bank: bool,
    /// The pending token a draft ran row `pos - 1` with.
    pub(super) drafted_with: Option<u32>,
    /// A draft step's output bank (the next step's hidden input), `[S*d]`.
    draft_bank: CudaSlice<f32>,
    /// Draft token ids: the pending token, then each step's argmax.
    ids: CudaSlice<i32>,
    /// Each draft step's rope position.
    pos: CudaSlice<i32>,
    /// Draft-chain graphs by chain length, with their use counts.
    graphs: Vec<(Option<super::DecodeGraph>, usize)>,
}

/// One GDN layer's rollback material: the states before the chain and the recurrences' inputs per row.
struct GdnChain {
    conv: CudaSlice<f32>,
    s: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    g: CudaSlice<f32>,
}

/// Device buffers a verify pass records into (allocated with the state's first chain, for
/// [`MAX_CHAIN_ROWS`] rows).
pub(crate) struct ChainBufs {
    gdn: Vec<Option<GdnChain>>,
    ple_conv: Option<CudaSlice<f32>>,
    ple_nrm: Option<CudaSlice<f32>>,
    /// Every row's pre-mixer bank, `[rows, S*d]`.
    banks: CudaSlice<f32>,
    /// Per row, the resident experts' smallest share of the router weight over the layers.
    coverage: CudaSlice<f32>,
    /// The chain's token ids, PLE table rows and logits (fixed addresses: the pass replays as a graph).
    ids: CudaSlice<i32>,
    ple_rows: CudaSlice<i32>,
    logits: CudaSlice<f32>,
    saved_from: CudaEvent,
    saved_to: CudaEvent,
}

/// Recording targets of one pass's GDN layer: (pre-conv qkv, beta, g) device addresses.
pub(crate) type GdnRec = (u64, u64, u64);

/// What [`CudaModel::verify_chain`] keeps for its rollback.
#[derive(Debug, Clone)]
pub struct CudaChain {
    pos0: usize,
    tokens: Vec<u32>,
    ple_context: Vec<u32>,
}

impl ChainBufs {
    /// Where layer `li`'s GDN inputs go.
    pub(crate) fn gdn_rec(&self, m: &CudaModel, li: usize) -> Option<GdnRec> {
        self.gdn.get(li)?.as_ref().map(|g| (m.p(&g.qkv, 0), m.p(&g.beta, 0), m.p(&g.g, 0)))
    }
    /// Where the PLE conv inputs go.
    pub(crate) fn ple_rec(&self, m: &CudaModel) -> Option<u64> {
        self.ple_nrm.as_ref().map(|b| m.p(b, 0))
    }
    /// Where the banks go.
    pub(crate) fn banks_rec(&self, m: &CudaModel) -> u64 {
        m.p(&self.banks, 0)
    }
    /// The pass's (token ids, PLE rows, logits) buffers.
    pub(crate) fn pass_buffers(&self, m: &CudaModel) -> (u64, u64, u64) {
        let stream = m.dev.stream();
        (ptr(&self.ids, stream, 0), ptr(&self.ple_rows, stream, 0), m.p(&self.logits, 0))
    }
    /// The per-row coverage buffer.
    pub(crate) fn coverage_rec(&self, m: &CudaModel) -> u64 {
        m.p(&self.coverage, 0)
    }
}

impl CudaModel {
    /// Whether a verify pass writes per-row coverage (hybrid under SPEC §4's rule); otherwise every row is exact
    /// and its coverage is 1.
    pub(crate) fn verify_reports_coverage(&self) -> bool {
        self.hybrid.as_ref().is_some_and(|h| !h.params.verify_handoff)
    }

    /// Whether the model has an MTP block on the device.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// The MTP part of a new state (`None` without a block).
    pub(crate) fn new_mtp_state(&self, max_len: usize) -> Result<Option<MtpDevState>, CudaError> {
        let Some(mtp) = &self.mtp else { return Ok(None) };
        let cfg = &self.config;
        let dev = &self.dev;
        Ok(Some(MtpDevState {
            attn: self.attn_state(&mtp.attn, max_len)?,
            rows: 0,
            last_bank: zeros(dev, cfg.hc_dim())?,
            has_bank: false,
            drafted_with: None,
            draft_bank: zeros(dev, cfg.hc_dim())?,
            ids: dev.stream().alloc_zeros::<i32>(MAX_CHAIN_ROWS + 1)?,
            pos: dev.stream().alloc_zeros::<i32>(MAX_CHAIN_ROWS)?,
            graphs: (0..MAX_CHAIN_ROWS).map(|_| (None, 0)).collect(),
        }))
    }

    /// `n` floats from device address `src` to `dst`, stream-ordered.
    pub(crate) fn dtod(&self, dst: u64, src: u64, n: usize) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: both addresses are live device allocations of at least `n` floats (callers size them), and
        // the copy is ordered on the model's stream like every kernel that touches them.
        let r = unsafe { driver_sys::cuMemcpyDtoDAsync_v2(dst, src, n * 4, self.dev.stream().cu_stream()) };
        super::hybrid::check(r, "a device-to-device copy")
    }

    /// The MTP block over `n` rows (`crate::model::mtp::MtpBlock::forward`): hidden inputs `banks` (`[n, S*d]`),
    /// next-token ids `ids` (`[n]` i32), rows at the positions from the one in `pos_dev`, appended to the block's
    /// cache. With `logits`, the last row's masked logits (`[vocab]`) are written there. Returns the output banks'
    /// address (`[n, S*d]`, an arena temporary).
    #[allow(clippy::too_many_arguments)]
    fn mtp_pass(
        &self,
        ms: &MtpDevState,
        banks: u64,
        ids: u64,
        n: usize,
        pos_dev: u64,
        capacity: usize,
        logits: Option<u64>,
    ) -> Result<u64, CudaError> {
        let mtp = self.mtp.as_ref().expect("callers check the block");
        // Chain-sized batches take the batch-invariant kernels (cheaper than the prefill path for a few rows).
        let exact = self.exact_rows.swap(n <= MAX_CHAIN_ROWS, std::sync::atomic::Ordering::Relaxed);
        let out = (|| {
            let cfg = &self.config;
            let dev = &self.dev;
            let (s, d) = (cfg.hc_count, cfg.hidden);
            let dim = s * d;
            let e = self.tmp(n * d)?;
            self.get_rows(&self.embed, ids, n, e, d, 1)?;
            self.rms_norm(e, self.p(&mtp.enorm, 0), e, n, d, 1)?;
            // One RMS over the whole bank (ungrouped), see mtp.rs.
            let hn = self.tmp(n * dim)?;
            self.rms_norm(banks, self.p(&mtp.hnorm, 0), hn, n, dim, 1)?;
            let input = self.tmp(n * s * 2 * d)?;
            dev.launch_1d(
                "mtp_eh_input",
                n * s * 2 * d,
                &[
                    Arg::Ptr(e),
                    Arg::Ptr(hn),
                    Arg::Ptr(input),
                    Arg::I32(n as i32),
                    Arg::I32(s as i32),
                    Arg::I32(d as i32),
                ],
            )?;
            let x = self.tmp(n * dim)?;
            self.matmul(mtp.eh_proj.r(dev), input, n * s, x)?;
            let (m, a) = self.hc_mix(&mtp.attn_hc, x, n, Some(mtp.attn.q.ty), None)?;
            let y = self.attn(&mtp.attn, &ms.attn, m, n, pos_dev, capacity)?;
            let res = Some((y, a.expect("the MTP layer injects")));
            let (m, a) = self.hc_mix(&mtp.mlp_hc, x, n, Some(mtp.moe.sh_gate_up.ty), res)?;
            self.moe(self.layers.len(), &mtp.moe, m, n, Some((x, a.expect("the MTP layer injects"))))?;
            if let Some(out) = logits {
                let (h, _) = self.hc_mix(&mtp.mixer, x + ((n - 1) * dim * 4) as u64, 1, Some(self.lm_head.ty), None)?;
                self.matmul(self.lm_head.r(dev), h, 1, out)?;
                self.mask_logits(out, 1)?;
            }
            Ok(x)
        })();
        self.exact_rows.store(exact, std::sync::atomic::Ordering::Relaxed);
        out
    }

    /// Keeps the MTP cache aligned after the target consumed `tokens` from `pos0` (their pre-mixer banks at `x`,
    /// `[n, S*d]`): runs every MTP row whose next token is now known in one batch and keeps the last bank
    /// (`Qwen4Exp::extend_mtp`). A cache that is out of step is left alone (drafting then refuses).
    pub(crate) fn mtp_extend(&self, st: &mut CudaState, x: u64, tokens: &[u32], pos0: usize) -> Result<(), CudaError> {
        let dim = self.config.hc_dim();
        let capacity = st.max_len;
        let Some(ms) = st.mtp.as_mut() else { return Ok(()) };
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
        let stream = self.dev.stream().clone();
        if ms.rows < end {
            let count = end - ms.rows;
            let banks = self.tmp(count * dim)?;
            let mut filled = 0;
            if ms.rows + 1 == pos0 {
                self.dtod(banks, self.p(&ms.last_bank, 0), dim)?;
                filled = 1;
            }
            // Rows pos0.. read the target's banks of this pass.
            self.dtod(banks + (filled * dim * 4) as u64, x, (count - filled) * dim)?;
            let next: Vec<i32> = (ms.rows..end).map(|j| tokens[j + 1 - pos0] as i32).collect();
            let ids = stream.clone_htod(&next)?;
            let pos = stream.clone_htod(&[ms.rows as i32])?;
            self.mtp_pass(ms, banks, ptr(&ids, &stream, 0), count, ptr(&pos, &stream, 0), capacity, None)?;
            ms.rows = end;
        }
        self.dtod(self.p(&ms.last_bank, 0), x + ((n - 1) * dim * 4) as u64, dim)?;
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
        let ms = st.mtp.as_mut().ok_or_else(|| unavailable("the sequence state has no MTP cache"))?;
        if pos == 0 || !ms.has_bank {
            return Err(unavailable("no target hidden state yet (empty sequence)"));
        }
        if ms.rows == pos {
            ms.rows = pos - 1;
        } else if ms.rows + 1 != pos {
            return Err(unavailable("the MTP cache is out of step with the sequence"));
        }
        let dev = &self.dev;
        let stream = dev.stream().clone();
        let dim = cfg.hc_dim();
        let positions: Vec<i32> = (0..n).map(|i| (pos - 1 + i) as i32).collect();
        stream.memcpy_htod(&positions, &mut ms.pos)?;
        stream.memcpy_htod(&[pending as i32], &mut ms.ids)?;
        let mut graphs = std::mem::take(&mut ms.graphs);
        let ms_ref: &MtpDevState = ms;
        let chain = {
            let (slot, seen) = &mut graphs[n];
            self.run_graphed(slot, seen, || {
                let logits = self.tmp(cfg.vocab)?;
                for i in 0..n {
                    let mark = self.arena_mark();
                    let bank = if i == 0 { self.p(&ms_ref.last_bank, 0) } else { self.p(&ms_ref.draft_bank, 0) };
                    let ids = ptr(&ms_ref.ids, &stream, i);
                    let at = ptr(&ms_ref.pos, &stream, i);
                    let x = self.mtp_pass(ms_ref, bank, ids, 1, at, capacity, Some(logits))?;
                    dev.launch(
                        "argmax_rows",
                        (1, 1, 1),
                        256,
                        &[Arg::Ptr(logits), Arg::I32(cfg.vocab as i32), Arg::Ptr(ids + 4)],
                    )?;
                    self.dtod(self.p(&ms_ref.draft_bank, 0), x, dim)?;
                    self.arena_release(mark);
                }
                Ok(0)
            })
        };
        ms.graphs = graphs;
        chain?;
        let mut out = vec![0i32; n + 1];
        stream.memcpy_dtoh(&ms.ids.slice(0..n + 1), &mut out)?;
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
            && let Err(e) = self.dev.stream().memcpy_htod(&[1f32; MAX_CHAIN_ROWS], &mut bufs.coverage)
        {
            st.chain = Some(bufs);
            return Err(e.into());
        }
        let record = CudaChain { pos0: st.pos, tokens: chain.to_vec(), ple_context: st.ple_context.clone() };
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
        let logits = self.forward_guarded(st, chain, LogitsFor::All, Some(bufs))?;
        let mut coverage = vec![1f32; n];
        if self.verify_reports_coverage() {
            self.dev.stream().memcpy_dtoh(&bufs.coverage.slice(0..n), &mut coverage)?;
        }
        let save_s = bufs.saved_from.elapsed_ms(&bufs.saved_to).map_or(0.0, |ms| ms as f64 * 1e-3);
        Ok((logits, coverage, save_s))
    }

    /// Copies the GDN and PLE states aside before a verify pass (inside the pass, so a captured verify graph
    /// includes it), between two timing events.
    pub(crate) fn save_chain_states(&self, st: &CudaState, bufs: &ChainBufs) -> Result<(), CudaError> {
        let stream = self.dev.stream();
        bufs.saved_from.record(stream)?;
        for (ls, rec) in st.layers.iter().zip(&bufs.gdn) {
            if let (DevLayerState::Gdn { conv, s }, Some(g)) = (ls, rec) {
                self.dtod(self.p(&g.conv, 0), self.p(conv, 0), conv.len())?;
                self.dtod(self.p(&g.s, 0), self.p(s, 0), s.len())?;
            }
        }
        if let (Some(state), Some(saved)) = (&st.ple_conv, &bufs.ple_conv) {
            self.dtod(self.p(saved, 0), self.p(state, 0), state.len())?;
        }
        bufs.saved_to.record(stream)?;
        Ok(())
    }

    fn new_chain_bufs(&self) -> Result<ChainBufs, CudaError> {
        let cfg = &self.config;
        let dev = &self.dev;
        let rows = MAX_CHAIN_ROWS;
        let (nv, dk, c) = (cfg.ssm_v_heads, cfg.ssm_head_dim, cfg.ssm_conv_dim());
        let mut gdn = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            gdn.push(match &l.mixer {
                super::DevMixer::Gdn(_) => Some(GdnChain {
                    conv: zeros(dev, (cfg.ssm_conv_kernel - 1) * c)?,
                    s: zeros(dev, nv * dk * dk)?,
                    qkv: zeros(dev, rows * c)?,
                    beta: zeros(dev, rows * nv)?,
                    g: zeros(dev, rows * nv)?,
                }),
                super::DevMixer::Attn(_) => None,
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
        let n = record.tokens.len();
        if keep < n {
            // The verify pass's temporaries are dead: replay in fresh arena space.
            self.arena.lock().expect("arena lock").reset(&self.dev)?;
            let c = self.config.ssm_conv_dim();
            for ((ls, layer), rec) in st.layers.iter().zip(&self.layers).zip(&bufs.gdn) {
                if let (DevLayerState::Gdn { conv, s }, super::DevMixer::Gdn(g), Some(r)) = (ls, &layer.mixer, rec) {
                    self.dtod(self.p(conv, 0), self.p(&r.conv, 0), conv.len())?;
                    self.dtod(self.p(s, 0), self.p(&r.s, 0), s.len())?;
                    if keep > 0 {
                        let qkv = self.tmp(keep * c)?;
                        self.dtod(qkv, self.p(&r.qkv, 0), keep * c)?;
                        self.gdn_mix(g, ls, qkv, self.p(&r.beta, 0), self.p(&r.g, 0), keep, None)?;
                    }
                }
            }
            if let (Some(state), Some(saved), Some(nrm), Some(ple)) =
                (&st.ple_conv, &bufs.ple_conv, &bufs.ple_nrm, self.layers.iter().find_map(|l| l.ple.as_ref()))
            {
                self.dtod(self.p(state, 0), self.p(saved, 0), state.len())?;
                if keep > 0 {
                    let u = self.tmp(keep * self.config.hc_dim())?;
                    self.ple_conv_rows(ple, state, self.p(nrm, 0), u, keep)?;
                }
            }
            let ctx = record.ple_context.len();
            let mut hist = record.ple_context.clone();
            hist.extend_from_slice(&record.tokens[..keep]);
            st.ple_context.copy_from_slice(&hist[hist.len() - ctx..]);
        }
        st.pos = record.pos0 + keep;
        let t = std::time::Instant::now();
        if keep > 0 && st.mtp.is_some() {
            let banks = self.p(&bufs.banks, 0);
            self.mtp_extend(st, banks, &record.tokens[..keep], record.pos0)?;
        }
        // (Host time: the realignment's kernels are queued; the next draft waits for them.)
        Ok(t.elapsed().as_secs_f64())
    }
}
