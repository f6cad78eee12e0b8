//! The MTP (multi-token prediction) draft block of Qwen3.8-Flash-Next, read from the GGUF's `blk.{n_layer}.*`
//! tensors (`nextn.*` plus a trunk-style attention layer). Transformers drops `mtp.*`, so the math follows
//! SGLang's `Qwen4ExpForCausalLMMTP` (`python/sglang/srt/models/qwen4_exp_mtp.py`, `_fuse_residual_linear_shared`,
//! and `Qwen4ExpModel(is_nextn=True)` in `qwen4_exp.py`):
//!
//! For MTP row `j` (rope position `j`), given the target's pre-mixer bank `H_j` (`[S*d]`, the output of the last
//! decoder layer before `hyper_connection_mixer`) and the next token `x_{j+1}`:
//! 1. `u = W_fe · N(E[x_{j+1}]; enorm)` (one `d`-wide vector; `N` is the Gemma RMS norm, weights stored `1 + w`);
//! 2. `Ĥ = N(H_j; hnorm)` with **one** RMS over all `S*d` values (ungrouped, unlike every other bank norm; llama.cpp
//!    normalises per stream here, SGLang and vLLM over the whole bank);
//! 3. `Z_s = W_fh · Ĥ_s + u` for every stream `s` (one shared `W_fh`; GGUF stores `[W_fe | W_fh]` as `eh_proj`);
//! 4. one decoder layer without PLE: attention hyper-connection around gated attention (with its own KV cache;
//!    dense when the GGUF's `compress_ratios` entry for the block is 0, as llama.cpp's converter writes it, else
//!    with the QSA indexer), then the MLP hyper-connection around the 512-expert MoE with its shared expert; the
//!    layer's output bank is `G_j`;
//! 5. `y_j = mixer(G_j)` through the block's own `nextn.hc_head_*` mixer, and `logits = lm_head(y_j)` with the
//!    target's head (no further norm).
//!
//! A chained draft step feeds `G_j` (the MTP's own pre-mixer bank) back as the next row's hidden input, with the
//! drafted token, at position `j + 1` ("scheme A" in vLLM).

use crate::quant::Matrix;

use super::config::ModelConfig;
use super::error::ModelError;
use super::hyper_connection::GatedResidual;
use super::kv_cache::KvCacheType;
use super::moe::SparseMoe;
use super::norm::rms_norm_into;
use super::rope::Rope;
use super::self_attn::{Attention, AttnState};
use super::weights::TensorLoader;

/// The MTP block's part of a sequence's state: its own KV cache, aligned with the target.
///
/// MTP row `j` needs the token at `j + 1`, so after the target consumed `pos` tokens the block holds rows
/// `0..pos-1` and waits for the next token to run row `pos - 1`, whose hidden input (the target's bank at
/// `pos - 1`) is kept in `last_bank`.
#[derive(Debug, Clone, PartialEq)]
pub struct MtpState {
    /// KV cache (and indexer keys) of the block's attention; one row per position.
    pub attn: AttnState,
    /// The target's pre-mixer bank at position `pos - 1`, `[S*d]` (empty before the first token).
    pub last_bank: Vec<f32>,
    /// When a draft already ran row `pos - 1` (kept in the cache), the pending token it read.
    pub drafted_with: Option<u32>,
}

/// The loaded MTP block (`mtp.*` in the HF checkpoint).
#[derive(Debug, Clone)]
pub struct MtpBlock {
    /// `[fc_embedding | fc_hidden]`, `[d, 2d]`: the embedding columns first (`blk.N.nextn.eh_proj`).
    pub(crate) eh_proj: Matrix,
    /// `pre_fc_norm_embedding`, `[d]`, stored `1 + w`.
    pub(crate) enorm: Vec<f32>,
    /// `pre_fc_norm_hidden`, `[S*d]`, stored `1 + w`.
    pub(crate) hnorm: Vec<f32>,
    pub(crate) attn_hyper_connection: GatedResidual,
    pub(crate) self_attn: Attention,
    pub(crate) mlp_hyper_connection: GatedResidual,
    pub(crate) mlp: SparseMoe,
    /// The block's own final mixer (`nextn.hc_head_*`, mix only).
    pub(crate) hyper_connection_mixer: GatedResidual,
    pub(crate) rope: Rope,
    pub(crate) streams: usize,
    pub(crate) hidden: usize,
    pub(crate) eps: f32,
}

/// What one MTP forward over `n` rows returns.
#[derive(Debug, Clone)]
pub struct MtpOutput {
    /// `G`, the layer's output bank per row, `[n, S*d]` (the next chained row's hidden input).
    pub bank: Vec<f32>,
    /// The pre-head hidden `y = mixer(G)` of the rows asked for, `[rows, d]` (empty when none were).
    pub hidden: Vec<f32>,
}

impl MtpBlock {
    /// Loads block `layer` (= the trunk's `n_layer`): `blk.{layer}.nextn.{eh_proj,enorm,hnorm,hc_head_*}` and the
    /// trunk-style `blk.{layer}.{hc_attn,attn_*,indexer.*,hc_ffn,ffn_*}`; `compress_ratio` 0 means dense attention.
    ///
    /// Errors: the tensor at fault (missing, wrong shape or type) as [`ModelError`].
    pub fn load(w: &TensorLoader, cfg: &ModelConfig, layer: usize, compress_ratio: usize) -> Result<Self, ModelError> {
        let (d, s, r, eps) = (cfg.hidden, cfg.hc_count, cfg.hc_lowrank, cfg.rms_eps);
        let p = format!("blk.{layer}");
        Ok(Self {
            eh_proj: w.matrix(&format!("{p}.nextn.eh_proj.weight"), d, 2 * d)?,
            enorm: w.vector(&format!("{p}.nextn.enorm.weight"), d)?,
            hnorm: w.vector(&format!("{p}.nextn.hnorm.weight"), s * d)?,
            attn_hyper_connection: GatedResidual::load(w, &format!("{p}.hc_attn"), s, d, r, true, eps)?,
            self_attn: Attention::load(w, cfg, layer, compress_ratio)?,
            mlp_hyper_connection: GatedResidual::load(w, &format!("{p}.hc_ffn"), s, d, r, true, eps)?,
            mlp: SparseMoe::load(w, cfg, layer)?,
            hyper_connection_mixer: GatedResidual::load(w, &format!("{p}.nextn.hc_head"), s, d, r, false, eps)?,
            rope: Rope::new(cfg.rope_dim, cfg.rope_theta, cfg.rope_sections),
            streams: s,
            hidden: d,
            eps,
        })
    }

    /// An empty MTP state whose cache stores rows as `ty`.
    pub fn new_state(&self, ty: KvCacheType) -> MtpState {
        MtpState { attn: self.self_attn.new_state(ty), last_bank: Vec::new(), drafted_with: None }
    }

    /// Rows held by an MTP attention cache.
    pub fn rows(&self, state: &AttnState) -> usize {
        state.len()
    }

    /// A copy of the first `rows` rows of `state` (`None` when it holds fewer).
    pub fn prefix(&self, state: &AttnState, rows: usize) -> Option<AttnState> {
        state.prefix(rows, self.self_attn.index_shape().1)
    }

    /// Drops every row of `state` from `rows` on.
    pub fn truncate(&self, state: &mut AttnState, rows: usize) {
        state.truncate(rows, self.self_attn.index_shape().1);
    }

    /// Runs `n = tokens.len()` MTP rows at positions `pos0..pos0+n`, appending to the block's cache `state` (which
    /// must hold exactly `pos0` rows). `banks` (`[n, S*d]`) are the hidden inputs (a target bank or a previous
    /// row's `G`), `tokens` the next token of each row; `embed` is the target's embedding table (RoPE as the
    /// trunk's attention). The mixer output
    /// is computed for the rows in `hidden_rows` (a range of `0..n`).
    ///
    /// Errors: [`ModelError::BadSnapshot`] when the cache is not at `pos0`.
    pub fn forward(
        &self,
        embed: &Matrix,
        state: &mut AttnState,
        banks: &[f32],
        tokens: &[u32],
        pos0: usize,
        hidden_rows: std::ops::Range<usize>,
    ) -> Result<MtpOutput, ModelError> {
        let (s, d) = (self.streams, self.hidden);
        let dim = s * d;
        let n = tokens.len();
        let held = self.rows(state);
        if held != pos0 || banks.len() != n * dim {
            return Err(ModelError::BadSnapshot { snapshot: pos0, current: held });
        }
        if n == 0 {
            return Ok(MtpOutput { bank: Vec::new(), hidden: Vec::new() });
        }
        // Per row and stream the eh_proj input [N(e); N(H)_s]: n*S rows of 2d.
        let mut input = vec![0f32; n * s * 2 * d];
        let mut e = vec![0f32; d];
        let mut en = vec![0f32; d];
        let mut hn = vec![0f32; dim];
        for (t, &tok) in tokens.iter().enumerate() {
            embed.dequantize_row(tok as usize, &mut e);
            rms_norm_into(&e, &self.enorm, self.eps, &mut en);
            rms_norm_into(&banks[t * dim..(t + 1) * dim], &self.hnorm, self.eps, &mut hn);
            for st in 0..s {
                let row = &mut input[(t * s + st) * 2 * d..(t * s + st + 1) * 2 * d];
                row[..d].copy_from_slice(&en);
                row[d..].copy_from_slice(&hn[st * d..(st + 1) * d]);
            }
        }
        let mut x = vec![0f32; n * dim];
        self.eh_proj.matmul(&input, n * s, &mut x);

        let mixed = self.attn_hyper_connection.mix(&x, n);
        let y = self.self_attn.forward(&mixed.mixed, n, pos0, state, &self.rope);
        self.attn_hyper_connection.inject(&mut x, &y, &mixed.inject);
        let mixed = self.mlp_hyper_connection.mix(&x, n);
        let y = self.mlp.forward(&mixed.mixed, n);
        self.mlp_hyper_connection.inject(&mut x, &y, &mixed.inject);

        let hidden = if hidden_rows.is_empty() || hidden_rows.end > n {
            Vec::new()
        } else {
            self.hyper_connection_mixer.mix(&x[hidden_rows.start * dim..hidden_rows.end * dim], hidden_rows.len()).mixed
        };
        Ok(MtpOutput { bank: x, hidden })
    }
}
