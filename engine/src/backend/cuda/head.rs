//! The token embedding and the output head on the device (`token_embd`, `output`), shared by the trunk and the MTP
//! block, with the vocabulary rows the model never emits masked out of the logits.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::device::{Arg, Dev, ptr};
use super::launch::Launch;
use super::weights::{DevMatrix, Uploader};
use crate::model::Qwen4Exp;

/// The embedding table, the output projection and the masked id ranges.
pub(crate) struct TokenHead {
    /// `[vocab, d]`, read by `get_rows`.
    pub(crate) embed_tokens: DevMatrix,
    /// `[vocab, d]`.
    pub(crate) lm_head: DevMatrix,
    /// Masked id ranges `[start, end)` as i32 pairs (one dummy pair when there are none).
    masked: CudaSlice<i32>,
    n_masked: usize,
}

impl TokenHead {
    /// Uploads `model`'s embedding, output projection and masked ranges.
    pub(crate) fn upload(up: &mut Uploader<'_>, dev: &Dev, model: &Qwen4Exp) -> Result<Self, CudaError> {
        let embed_tokens = up.matrix(&model.embed_tokens, "token_embd")?;
        let lm_head = up.matrix(&model.lm_head, "output")?;
        let ranges: Vec<i32> = model.masked.iter().flat_map(|r| [r.start as i32, r.end as i32]).collect();
        let masked = dev.stream().clone_htod(if ranges.is_empty() { &[0i32, 0][..] } else { &ranges[..] })?;
        Ok(Self { embed_tokens, lm_head, masked, n_masked: model.masked.len() })
    }

    /// Sets the masked vocabulary ids of `rows` logits rows at `logits` to -inf.
    pub(crate) fn mask_logits(&self, ctx: &Launch, logits: u64, rows: usize) -> Result<(), CudaError> {
        if self.n_masked == 0 {
            return Ok(());
        }
        let cfg = &ctx.cfg;
        ctx.dev.launch_1d(
            "mask_logits",
            rows * cfg.vocab,
            &[
                Arg::Ptr(logits),
                Arg::I32(rows as i32),
                Arg::I32(cfg.vocab as i32),
                Arg::Ptr(ptr(&self.masked, ctx.dev.stream(), 0)),
                Arg::I32(self.n_masked as i32),
            ],
        )?;
        Ok(())
    }
}
