//! The MTP draft block on the device (`blk.{n_layer}.*`, `mtp.*` in the HF checkpoint), as `crate::model::mtp`:
//! the embedding and hidden-state norms, `eh_proj`, one attention layer with its hyper-connections and MoE, and
//! the block's own final mixer before the shared output head. Drafting, verifying and rolling back chains are in
//! `chain.rs`.
//!
//! In hybrid mode the block's routed experts stay on the host (the policy makes none of them resident), so its
//! MoE runs through the same CPU path as a trunk layer's non-resident experts.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::chain::MAX_CHAIN_ROWS;
use super::device::Arg;
use super::graphs::GraphSlot;
use super::head::TokenHead;
use super::hybrid::Hybrid;
use super::hyper_connection::DevGatedResidual;
use super::launch::Launch;
use super::memory::zeros;
use super::moe::DevSparseMoe;
use super::self_attn::{AttnState, DevAttention};
use super::weights::{DevMatrix, Uploader};
use crate::model::Qwen4Exp;
use crate::model::config::ModelConfig;

/// The MTP block on the device (`crate::model::mtp::MtpBlock`).
pub(crate) struct DevMtpBlock {
    /// `[d, 2d]`.
    pub(crate) eh_proj: DevMatrix,
    /// `[d]`.
    pub(crate) enorm: CudaSlice<f32>,
    /// `[S*d]`.
    pub(crate) hnorm: CudaSlice<f32>,
    pub(crate) attn_hyper_connection: DevGatedResidual,
    pub(crate) self_attn: DevAttention,
    pub(crate) mlp_hyper_connection: DevGatedResidual,
    pub(crate) mlp: DevSparseMoe,
    pub(crate) hyper_connection_mixer: DevGatedResidual,
}

/// The MTP block's part of a sequence's device state (mirrors `crate::model::mtp::MtpState`): after the target
/// consumed `pos` tokens the cache holds rows `0..pos-1` (or `pos` when a draft already ran the next row).
pub(crate) struct DevMtpState {
    pub(crate) attn: AttnState,
    /// Rows in the block's cache.
    pub(crate) rows: usize,
    /// The target's pre-mixer bank at `pos - 1`, `[S*d]`.
    pub(crate) last_bank: CudaSlice<f32>,
    pub(crate) has_bank: bool,
    /// The pending token a draft ran row `pos - 1` with.
    pub(crate) drafted_with: Option<u32>,
    /// A draft step's output bank (the next step's hidden input), `[S*d]`.
    pub(crate) draft_bank: CudaSlice<f32>,
    /// Draft token ids: the pending token, then each step's argmax.
    pub(crate) draft_ids: CudaSlice<i32>,
    /// Each draft step's rope position.
    pub(crate) draft_positions: CudaSlice<i32>,
    /// Draft-chain graphs by chain length, with their use counts.
    pub(crate) graphs: Vec<GraphSlot>,
}

impl DevMtpBlock {
    /// Uploads `model`'s MTP block (`None` without one) with the routed experts `held` (all when `None`; the
    /// hybrid policy's list, empty, keeps them on the host).
    pub(crate) fn upload(
        up: &mut Uploader<'_>,
        model: &Qwen4Exp,
        held: Option<&[usize]>,
    ) -> Result<Option<Self>, CudaError> {
        let Some(b) = model.mtp() else { return Ok(None) };
        let layer = model.layers.len();
        let p = format!("blk.{layer}");
        Ok(Some(Self {
            eh_proj: up.matrix(&b.eh_proj, &format!("{p}.nextn.eh_proj"))?,
            enorm: up.vector(&b.enorm)?,
            hnorm: up.vector(&b.hnorm)?,
            attn_hyper_connection: DevGatedResidual::upload(up, &b.attn_hyper_connection, &format!("{p}.hc_attn"))?,
            self_attn: DevAttention::upload(up, &b.self_attn, layer)?,
            mlp_hyper_connection: DevGatedResidual::upload(up, &b.mlp_hyper_connection, &format!("{p}.hc_ffn"))?,
            mlp: DevSparseMoe::upload(up, &b.mlp, held, layer)?,
            hyper_connection_mixer: DevGatedResidual::upload(
                up,
                &b.hyper_connection_mixer,
                &format!("{p}.nextn.hc_head"),
            )?,
        }))
    }

    /// A fresh cache for `max_len` tokens.
    pub(crate) fn new_state(&self, ctx: &Launch, max_len: usize) -> Result<DevMtpState, CudaError> {
        let cfg = &ctx.cfg;
        let dev = &ctx.dev;
        Ok(DevMtpState {
            attn: self.self_attn.new_state(ctx, max_len, 0)?,
            rows: 0,
            last_bank: zeros(dev, cfg.hc_dim())?,
            has_bank: false,
            drafted_with: None,
            draft_bank: zeros(dev, cfg.hc_dim())?,
            draft_ids: dev.stream().alloc_zeros::<i32>(MAX_CHAIN_ROWS + 1)?,
            draft_positions: dev.stream().alloc_zeros::<i32>(MAX_CHAIN_ROWS)?,
            graphs: (0..MAX_CHAIN_ROWS).map(|_| (None, 0)).collect(),
        })
    }

    /// Device bytes of [`Self::new_state`] for `max_len` tokens: the attention cache (dense: never windowed), the
    /// two banks, the draft ids and positions.
    pub(crate) fn state_bytes(&self, cfg: &ModelConfig, max_len: usize) -> usize {
        let attn = self.self_attn.cache_bytes(cfg, max_len, 0).device;
        attn + 4 * (2 * cfg.hc_dim().max(1) + (MAX_CHAIN_ROWS + 1) + MAX_CHAIN_ROWS)
    }

    /// The MTP block over `n` rows (`crate::model::mtp::MtpBlock::forward`; `host` the hybrid half and the
    /// block's layer index, whose experts run as the policy says): hidden inputs `banks` (`[n, S*d]`),
    /// next-token ids `ids` (`[n]` i32), rows at the positions from the one in `pos_dev`, appended to the block's
    /// cache. With `logits`, the last row's masked logits (`[vocab]`) are written there. Returns the output banks'
    /// address (`[n, S*d]`, an arena temporary).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        ctx: &Launch,
        head: &TokenHead,
        host: Option<(&Hybrid, usize)>,
        ms: &DevMtpState,
        banks: u64,
        ids: u64,
        n: usize,
        pos_dev: u64,
        capacity: usize,
        logits: Option<u64>,
    ) -> Result<u64, CudaError> {
        let mtp = self;
        // Chain-sized batches take the batch-invariant kernels (cheaper than the prefill path for a few rows).
        let exact = ctx.exact_rows.swap(n <= MAX_CHAIN_ROWS, std::sync::atomic::Ordering::Relaxed);
        let out = (|| {
            let cfg = &ctx.cfg;
            let dev = &ctx.dev;
            let (s, d) = (cfg.hc_count, cfg.hidden);
            let dim = s * d;
            let e = ctx.tmp(n * d)?;
            ctx.get_rows(&head.embed_tokens, ids, n, e, d, 1)?;
            ctx.rms_norm(e, ctx.addr(&mtp.enorm, 0), e, n, d, 1)?;
            // One RMS over the whole bank (ungrouped), as in `crate::model::mtp`.
            let hn = ctx.tmp(n * dim)?;
            ctx.rms_norm(banks, ctx.addr(&mtp.hnorm, 0), hn, n, dim, 1)?;
            let input = ctx.tmp(n * s * 2 * d)?;
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
            let x = ctx.tmp(n * dim)?;
            ctx.matmul(mtp.eh_proj.view(dev), input, n * s, x)?;
            let mixed = mtp.attn_hyper_connection.forward(ctx, x, n, Some(mtp.self_attn.input_type()), None)?;
            let y = mtp.self_attn.forward(ctx, &ms.attn, mixed.mixed, n, pos_dev, capacity)?;
            let res = Some((y, mixed.inject.expect("the MTP layer injects")));
            let mixed = mtp.mlp_hyper_connection.forward(ctx, x, n, Some(mtp.mlp.input_type()), res)?;
            let res = Some((x, mixed.inject.expect("the MTP layer injects")));
            mtp.mlp.forward(ctx, host, mixed.mixed, n, res, None)?;
            if let Some(out) = logits {
                let h = mtp.hyper_connection_mixer.forward(
                    ctx,
                    x + ((n - 1) * dim * 4) as u64,
                    1,
                    Some(head.lm_head.ty),
                    None,
                )?;
                ctx.matmul(head.lm_head.view(dev), h.mixed, 1, out)?;
                head.mask_logits(ctx, out, 1)?;
            }
            Ok(x)
        })();
        ctx.exact_rows.store(exact, std::sync::atomic::Ordering::Relaxed);
        out
    }
}
