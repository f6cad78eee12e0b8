//! PLE: hashed n-gram embeddings injected into every residual stream (`Qwen4ExpTextNGramEmbedding` and
//! `Qwen4ExpTextPLELayer` in transformers' `modeling_qwen4_exp.py`).
//!
//! Each token's `ngram_size - 1` previous tokens (cut at the last EOS, which starts a new segment) are hashed by
//! 16 heads into rows of one big table; the concatenated rows `E` give a value `V = W_val E` and one key per
//! stream `K = G_key(W_key E)`. Each stream gates `V` by its agreement with the normalised stream
//! (`gamma = sign(c) sqrt(max(|c|, 1e-6))`, `c = <K_s, G_query(X)_s> / sqrt(d)`), and a dilated causal depthwise
//! conv (kernel 4, dilation `ngram_size`) over the normalised gated values adds local context.

use crate::quant::Matrix;

use super::config::PleConfig;
use super::error::ModelError;
use super::norm::{grouped_rms_norm_into, sigmoid, silu};
use super::weights::TensorLoader;

/// The n-gram context and conv history of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct PleState {
    /// The last `ngram_size - 1` tokens (EOS-filled at the start of a sequence), oldest first.
    pub context: Vec<u32>,
    /// The last `(conv_kernel - 1) * ngram_size` conv inputs, `[steps, S*d]`, oldest first (zeros at start).
    pub conv: Vec<f32>,
}

/// Table rows of the `n_heads` hash heads for each token of `tokens`, given the `context` before them
/// (`[ngram_size - 1]` tokens). Returns `[tokens.len(), n_heads]` absolute row indices, order-2 heads first.
///
/// `t_0` is the token itself; `t_k` is the token `k` steps back, replaced by EOS when an EOS lies strictly
/// between (or at) it and the current token, i.e. the n-gram never crosses a segment start. Products and XOR
/// use wrapping `u64` arithmetic, which equals the reference's `int64` math for valid multipliers.
pub fn ngram_rows(cfg: &PleConfig, context: &[u32], tokens: &[u32]) -> Vec<u64> {
    let n = cfg.ngram_size;
    let eos = cfg.eos_token_id;
    let heads = cfg.n_heads();
    let mut hist: Vec<u32> = Vec::with_capacity(context.len() + tokens.len());
    hist.extend_from_slice(context);
    hist.extend_from_slice(tokens);
    let base = context.len();
    let mut rows = Vec::with_capacity(tokens.len() * heads);
    let mut shifted = vec![0u64; n];
    for p in base..hist.len() {
        // Walk back from p; once an EOS is passed at p-j (j >= 1), every older shift reads EOS.
        let mut cut = false;
        for (k, slot) in shifted.iter_mut().enumerate() {
            let tok = if k == 0 {
                hist[p]
            } else if cut || p < k {
                eos
            } else {
                hist[p - k]
            };
            if k >= 1 && p >= k && hist[p - k] == eos {
                cut = true;
            }
            *slot = tok as u64;
        }
        let mut mixed = shifted[0].wrapping_mul(cfg.multipliers[0]);
        for order in 2..=n {
            mixed ^= shifted[order - 1].wrapping_mul(cfg.multipliers[order - 1]);
            let first = (order - 2) * cfg.heads_per_ngram;
            for h in first..first + cfg.heads_per_ngram {
                rows.push(mixed % cfg.head_sizes[h] + cfg.head_offsets[h]);
            }
        }
    }
    rows
}

/// What a recorded PLE forward kept for [`PleLayer::replay`]: the tokens and their normalised conv inputs
/// (`[n, S*d]`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PleRecord {
    /// The tokens run.
    pub tokens: Vec<u32>,
    /// `G_conv(U)` per token, the rows the dilated conv's history keeps.
    pub normed: Vec<f32>,
}

/// The PLE block of one layer.
#[derive(Debug, Clone)]
pub struct PleLayer {
    pub(crate) cfg: PleConfig,
    pub(crate) key_proj: Matrix,
    pub(crate) value_proj: Matrix,
    pub(crate) norm_key: Vec<f32>,
    pub(crate) norm_query: Vec<f32>,
    pub(crate) norm_conv: Vec<f32>,
    /// `[S*d, conv_kernel]`, tap `k` of channel `c` at `c * kernel + k`.
    pub(crate) conv1d: Vec<f32>,
    /// The n-gram table, `[rows, head_dim]`.
    pub(crate) ngram_embedding: Matrix,
    pub(crate) streams: usize,
    pub(crate) hidden: usize,
    pub(crate) eps: f32,
}

impl PleLayer {
    /// Loads `blk.{layer}.ple_*` and `per_layer_token_embd.weight`.
    pub fn load(
        w: &TensorLoader,
        cfg: &PleConfig,
        streams: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<Self, ModelError> {
        let p = format!("blk.{}", cfg.layer);
        let dim = streams * hidden;
        let pe = cfg.embed_dim();
        let table_rows =
            cfg.head_offsets.iter().zip(&cfg.head_sizes).map(|(o, s)| o.saturating_add(*s)).max().unwrap_or(0);
        let table = w.matrix_min_rows("per_layer_token_embd.weight", cfg.head_dim, table_rows)?;
        Ok(Self {
            cfg: cfg.clone(),
            key_proj: w.matrix(&format!("{p}.ple_key.weight"), dim, pe)?,
            value_proj: w.matrix(&format!("{p}.ple_value.weight"), hidden, pe)?,
            norm_key: w.vector(&format!("{p}.ple_norm_key.weight"), dim)?,
            norm_query: w.vector(&format!("{p}.ple_norm_query.weight"), dim)?,
            norm_conv: w.vector(&format!("{p}.ple_norm_conv.weight"), dim)?,
            conv1d: w.decoded(&format!("{p}.ple_conv1d.weight"), &[cfg.conv_kernel as u64, dim as u64])?,
            ngram_embedding: table,
            streams,
            hidden,
            eps,
        })
    }

    /// A fresh state: EOS context, zero conv history.
    pub fn new_state(&self) -> PleState {
        PleState {
            context: vec![self.cfg.eos_token_id; self.cfg.ngram_size - 1],
            conv: vec![0.0; self.cfg.conv_state_len() * self.streams * self.hidden],
        }
    }

    /// The residual update `U + C` for `tokens` (`[n, S*d]`), given the bundle `x` entering the layer.
    pub fn forward(&self, x: &[f32], tokens: &[u32], state: &mut PleState) -> Vec<f32> {
        self.forward_recorded(x, tokens, state, None)
    }

    /// [`PleLayer::forward`] that also keeps, in `record`, what the state update reads, so that
    /// [`PleLayer::replay`] can rebuild the state after any prefix of these tokens.
    pub fn forward_recorded(
        &self,
        x: &[f32],
        tokens: &[u32],
        state: &mut PleState,
        record: Option<&mut PleRecord>,
    ) -> Vec<f32> {
        // E: gather the hashed rows.
        let rows = self.rows(tokens, state);
        let mut emb = vec![0f32; tokens.len() * self.cfg.embed_dim()];
        for (r, out) in rows.iter().zip(emb.chunks_exact_mut(self.cfg.head_dim)) {
            self.ngram_embedding.dequantize_row(*r as usize, out);
        }
        self.forward_gathered(x, tokens, state, &emb, record)
    }

    /// The table rows `tokens` read, given the context in `state` (`[n, n_heads]`, see [`ngram_rows`]).
    pub fn rows(&self, tokens: &[u32], state: &PleState) -> Vec<u64> {
        ngram_rows(&self.cfg, &state.context, tokens)
    }

    /// [`PleLayer::forward_recorded`] with the n-gram embedding `emb` (`[n, n_heads * head_dim]`, the decoded
    /// table rows of [`PleLayer::rows`]) already gathered, wherever the table lives.
    pub fn forward_gathered(
        &self,
        x: &[f32],
        tokens: &[u32],
        state: &mut PleState,
        emb: &[f32],
        record: Option<&mut PleRecord>,
    ) -> Vec<f32> {
        let n = tokens.len();
        let (s, d) = (self.streams, self.hidden);
        let dim = s * d;
        let pe = self.cfg.embed_dim();
        debug_assert_eq!(emb.len(), n * pe);

        let mut key = vec![0f32; n * dim];
        self.key_proj.matmul(emb, n, &mut key);
        let mut value = vec![0f32; n * d];
        self.value_proj.matmul(emb, n, &mut value);

        let mut gated = vec![0f32; n * dim];
        let mut kn = vec![0f32; dim];
        let mut qn = vec![0f32; dim];
        let inv_sqrt_d = 1.0 / (d as f32).sqrt();
        for t in 0..n {
            grouped_rms_norm_into(&key[t * dim..(t + 1) * dim], &self.norm_key, d, self.eps, &mut kn);
            grouped_rms_norm_into(&x[t * dim..(t + 1) * dim], &self.norm_query, d, self.eps, &mut qn);
            let v = &value[t * d..(t + 1) * d];
            for st in 0..s {
                let c: f32 =
                    kn[st * d..(st + 1) * d].iter().zip(&qn[st * d..(st + 1) * d]).map(|(a, b)| a * b).sum::<f32>()
                        * inv_sqrt_d;
                let gamma = c.abs().max(1e-6).sqrt() * c.signum() * if c == 0.0 { 0.0 } else { 1.0 };
                let gs = sigmoid(gamma);
                for (o, &vi) in gated[t * dim + st * d..t * dim + (st + 1) * d].iter_mut().zip(v) {
                    *o = gs * vi;
                }
            }
        }

        // C: dilated causal conv over the normalised gated values, with the history in the state.
        let k = self.cfg.conv_kernel;
        let dil = self.cfg.ngram_size;
        let hist_len = self.cfg.conv_state_len();
        let mut seq = Vec::with_capacity((hist_len + n) * dim);
        seq.extend_from_slice(&state.conv);
        seq.resize((hist_len + n) * dim, 0.0);
        for t in 0..n {
            let (_, tail) = seq.split_at_mut((hist_len + t) * dim);
            grouped_rms_norm_into(&gated[t * dim..(t + 1) * dim], &self.norm_conv, d, self.eps, &mut tail[..dim]);
        }
        let mut out = gated;
        for t in 0..n {
            let cur = hist_len + t;
            for ch in 0..dim {
                let mut acc = 0f32;
                for tap in 0..k {
                    let back = (k - 1 - tap) * dil;
                    acc += self.conv1d[ch * k + tap] * seq[(cur - back) * dim + ch];
                }
                out[t * dim + ch] += silu(acc);
            }
        }
        let normed = &seq[hist_len * dim..];
        Self::commit(state, normed, tokens, dim);
        if let Some(r) = record {
            *r = PleRecord { tokens: tokens.to_vec(), normed: normed.to_vec() };
        }
        out
    }

    /// Rebuilds `state` after the first `keep` tokens recorded by [`PleLayer::forward_recorded`], starting from the
    /// state those tokens started from: the conv history and the n-gram context shift in the recorded rows and
    /// tokens exactly as the forward did.
    pub fn replay(&self, state: &mut PleState, record: &PleRecord, keep: usize) {
        let dim = self.streams * self.hidden;
        let keep = keep.min(record.tokens.len());
        Self::commit(state, &record.normed[..keep * dim], &record.tokens[..keep], dim);
    }

    /// Shifts the normalised conv inputs `normed` (`[n, dim]`) and their tokens into the state.
    fn commit(state: &mut PleState, normed: &[f32], tokens: &[u32], dim: usize) {
        let hist_len = state.conv.len();
        let mut seq = Vec::with_capacity(hist_len + normed.len());
        seq.extend_from_slice(&state.conv);
        seq.extend_from_slice(normed);
        state.conv.copy_from_slice(&seq[seq.len() - hist_len..]);
        debug_assert_eq!(normed.len(), tokens.len() * dim);
        let ctx = state.context.len();
        let mut hist = state.context.clone();
        hist.extend_from_slice(tokens);
        state.context.copy_from_slice(&hist[hist.len() - ctx..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PleConfig {
        PleConfig {
            layer: 1,
            ngram_size: 3,
            heads_per_ngram: 2,
            conv_kernel: 4,
            eos_token_id: 9,
            head_dim: 2,
            multipliers: vec![3, 5, 7],
            head_offsets: vec![0, 11, 24, 41],
            head_sizes: vec![11, 13, 17, 19],
        }
    }

    #[test]
    fn hashes_follow_the_reference_rule() {
        let c = cfg();
        // tokens: a=1 b=2 EOS c=4 d=5
        let rows = ngram_rows(&c, &[9, 9], &[1, 2, 9, 4, 5]);
        let h = |t0: u64, t1: u64, t2: u64| {
            let x2 = (t0 * 3) ^ (t1 * 5);
            let x3 = x2 ^ (t2 * 7);
            vec![x2 % 11, x2 % 13 + 11, x3 % 17 + 24, x3 % 19 + 41]
        };
        let want: Vec<u64> = [h(1, 9, 9), h(2, 1, 9), h(9, 2, 1), h(4, 9, 9), h(5, 4, 9)].concat();
        assert_eq!(rows, want);
    }
}
