//! Gated softmax attention with the QSA indexer (`Qwen4ExpTextAttention`, `Qwen4ExpTextQSAIndexer` in
//! transformers' `modeling_qwen4_exp.py`).
//!
//! `q_proj` gives per head a query and an output gate; q and k get a per-head RMS norm and partial M-RoPE; the
//! output is `o_proj(softmax(q k^T / sqrt(hd)) v * sigmoid(gate))` with grouped KV heads. The QSA indexer decides
//! which keys each query sees: the visible keys are cut into blocks of `compress_ratio` tokens; each complete
//! block's raw indexer keys are mean-pooled, normed and rotated at the block's first position; blocks score
//! `sum_h relu(<q_I,h, k_b>) / sqrt(head_dim)`; the top `budget / compress_ratio` blocks plus the incomplete
//! tail are attended to. With no more complete blocks than that, attention is dense.

use rayon::prelude::*;

use crate::quant::Matrix;

use super::config::{IndexerConfig, ModelConfig};
use super::error::ModelError;
use super::kv_cache::{KvCacheType, KvRows};
use super::norm::{rms_norm, sigmoid, softmax};
use super::rope::Rope;
use super::state::MropeTrack;
use super::weights::TensorLoader;

/// KV cache and indexer keys of one attention layer for one sequence, stored in the model's
/// [`KvCacheType`] (`super::kv_cache`: `f32` is the exact path).
#[derive(Debug, Clone, PartialEq)]
pub struct AttnState {
    /// Keys after norm and RoPE, `[len, kv_heads * head_dim]`.
    pub k: KvRows,
    /// Values, `[len, kv_heads * head_dim]`.
    pub v: KvRows,
    /// Raw indexer keys (before pooling, norm and RoPE), `[len, indexer_head_dim]` (no rows when dense).
    pub index_k: KvRows,
    /// Pooled, normed and rotated keys of the complete blocks, `[blocks, indexer_head_dim]` (derived from
    /// `index_k`, kept so each block is pooled once).
    pub pooled: KvRows,
}

impl AttnState {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.k.len()
    }
    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }
    /// Drops everything after the first `len` tokens (`ratio` the indexer's compress ratio, 0 when dense).
    pub fn truncate(&mut self, len: usize, ratio: usize) {
        self.k.truncate(len);
        self.v.truncate(len);
        self.index_k.truncate(len);
        self.pooled.truncate(len.checked_div(ratio).unwrap_or(0));
    }
    /// A copy of the first `len` tokens (`None` when fewer are held).
    pub fn prefix(&self, len: usize, ratio: usize) -> Option<Self> {
        let blocks = len.checked_div(ratio).unwrap_or(0);
        // A dense layer keeps no indexer keys.
        let raw = if ratio > 0 { len } else { 0 };
        Some(Self {
            k: self.k.prefix(len)?,
            v: self.v.prefix(len)?,
            index_k: self.index_k.prefix(raw)?,
            pooled: self.pooled.prefix(blocks)?,
        })
    }
    /// Bytes held.
    pub fn held_bytes(&self) -> usize {
        self.k.held_bytes() + self.v.held_bytes() + self.index_k.held_bytes() + self.pooled.held_bytes()
    }
}

/// The QSA indexer of one layer.
#[derive(Debug, Clone)]
pub struct Indexer {
    pub(crate) q_proj: Matrix,
    pub(crate) k_proj: Matrix,
    pub(crate) q_norm: Vec<f32>,
    pub(crate) k_norm: Vec<f32>,
    pub(crate) cfg: IndexerConfig,
    pub(crate) compress_ratio: usize,
}

/// One gated attention token mixer.
#[derive(Debug, Clone)]
pub struct Attention {
    pub(crate) q_proj: Matrix,
    pub(crate) k_proj: Matrix,
    pub(crate) v_proj: Matrix,
    pub(crate) o_proj: Matrix,
    pub(crate) q_norm: Vec<f32>,
    pub(crate) k_norm: Vec<f32>,
    pub(crate) indexer: Option<Indexer>,
    pub(crate) n_head: usize,
    pub(crate) n_kv: usize,
    pub(crate) head_dim: usize,
    pub(crate) eps: f32,
}

impl Attention {
    /// Loads `blk.{layer}.attn_*` and, when `compress_ratio > 0`, `blk.{layer}.indexer.*`.
    pub fn load(w: &TensorLoader, cfg: &ModelConfig, layer: usize, compress_ratio: usize) -> Result<Self, ModelError> {
        let p = format!("blk.{layer}");
        let (d, hd, nh, nkv) = (cfg.hidden, cfg.head_dim, cfg.n_head, cfg.n_head_kv);
        let indexer = if compress_ratio > 0 {
            let ic = cfg.indexer;
            Some(Indexer {
                q_proj: w.matrix(&format!("{p}.indexer.q_proj.weight"), ic.n_heads * ic.head_dim, d)?,
                k_proj: w.matrix(&format!("{p}.indexer.k_proj.weight"), ic.head_dim, d)?,
                q_norm: w.vector(&format!("{p}.indexer.q_norm.weight"), ic.head_dim)?,
                k_norm: w.vector(&format!("{p}.indexer.k_norm.weight"), ic.head_dim)?,
                cfg: ic,
                compress_ratio,
            })
        } else {
            None
        };
        Ok(Self {
            q_proj: w.matrix(&format!("{p}.attn_q.weight"), nh * hd * 2, d)?,
            k_proj: w.matrix(&format!("{p}.attn_k.weight"), nkv * hd, d)?,
            v_proj: w.matrix(&format!("{p}.attn_v.weight"), nkv * hd, d)?,
            o_proj: w.matrix(&format!("{p}.attn_output.weight"), d, nh * hd)?,
            q_norm: w.vector(&format!("{p}.attn_q_norm.weight"), hd)?,
            k_norm: w.vector(&format!("{p}.attn_k_norm.weight"), hd)?,
            indexer,
            n_head: nh,
            n_kv: nkv,
            head_dim: hd,
            eps: cfg.rms_eps,
        })
    }

    /// An empty cache in type `ty` (checked against the head widths by [`Attention::check_kv_cache`]).
    pub fn new_state(&self, ty: KvCacheType) -> AttnState {
        let kvw = self.kv_width();
        let ihd = self.indexer.as_ref().map_or(0, |i| i.cfg.head_dim);
        let ity = ty.index_key_type(ihd);
        AttnState {
            k: KvRows::new(ty, kvw),
            v: KvRows::new(ty, kvw),
            index_k: KvRows::new(ity, ihd),
            pooled: KvRows::new(ity, ihd),
        }
    }

    /// Checks that this layer's heads can be cached as `ty`.
    ///
    /// Errors: [`ModelError::KvCacheType`] naming the width.
    pub fn check_kv_cache(&self, ty: KvCacheType) -> Result<(), ModelError> {
        ty.check_head_dim(self.head_dim)
    }

    /// Width of one token's keys.
    pub fn kv_width(&self) -> usize {
        self.n_kv * self.head_dim
    }

    /// (indexer head width, compress ratio), zeros when dense.
    pub fn index_shape(&self) -> (usize, usize) {
        self.indexer.as_ref().map_or((0, 0), |i| (i.cfg.head_dim, i.compress_ratio))
    }

    /// Runs `n` text tokens `x` (`[n, d]`) at positions `pos0..pos0+n`, appending to `state`; returns `[n, d]`.
    pub fn forward(&self, x: &[f32], n: usize, pos0: usize, state: &mut AttnState, rope: &Rope) -> Vec<f32> {
        let proj = self.project(x, n);
        let positions: Vec<[u32; 3]> = (pos0..pos0 + n).map(|p| [p as u32; 3]).collect();
        let attn = self.attend(&proj, 0..n, pos0, &positions, &MropeTrack::default(), state, rope);
        self.output(&attn, n)
    }

    /// The projections of `n` rows `x` (`[n, d]`), row by row: what a batched pass computes once for the rows of
    /// every sequence before [`Attention::attend`] runs each sequence on its own cache.
    pub(crate) fn project(&self, x: &[f32], n: usize) -> AttnProjections {
        let (nh, nkv, hd) = (self.n_head, self.n_kv, self.head_dim);
        let kvw = nkv * hd;
        let mut p = vec![0f32; n * nh * hd * 2];
        self.q_proj.matmul(x, n, &mut p);
        let mut k = vec![0f32; n * kvw];
        self.k_proj.matmul(x, n, &mut k);
        let mut v = vec![0f32; n * kvw];
        self.v_proj.matmul(x, n, &mut v);
        let index = self.indexer.as_ref().map(|ix| ix.project(x, n));
        AttnProjections { p, k, v, index }
    }

    /// Attention of the projected rows `rows` (one sequence's, at cache indices `pos0..`) over that sequence's cache
    /// `state` (appended to first), gated: `[rows.len(), n_head * head_dim]`, the input of [`Attention::output`].
    /// `positions` are the rows' rope positions `[t, h, w]`; `track` gives those of earlier tokens (the QSA
    /// indexer rotates a pooled block at its first token's position; an empty track means position = index).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend(
        &self,
        proj: &AttnProjections,
        rows: std::ops::Range<usize>,
        pos0: usize,
        positions: &[[u32; 3]],
        track: &MropeTrack,
        state: &mut AttnState,
        rope: &Rope,
    ) -> Vec<f32> {
        let (nh, nkv, hd) = (self.n_head, self.n_kv, self.head_dim);
        let kvw = nkv * hd;
        let n = rows.len();
        let p = &proj.p[rows.start * nh * hd * 2..rows.end * nh * hd * 2];
        let mut k = proj.k[rows.start * kvw..rows.end * kvw].to_vec();
        let v = &proj.v[rows.start * kvw..rows.end * kvw];

        debug_assert_eq!(positions.len(), n);
        let angles: Vec<_> = positions.iter().map(|p| rope.angles_thw(p.map(|v| v as usize))).collect();
        let mut q = vec![0f32; n * nh * hd];
        let mut gate = vec![0f32; n * nh * hd];
        for t in 0..n {
            for h in 0..nh {
                let src = &p[(t * nh + h) * 2 * hd..(t * nh + h + 1) * 2 * hd];
                let qh = &mut q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
                qh.copy_from_slice(&src[..hd]);
                rms_norm(qh, &self.q_norm, self.eps);
                rope.apply(qh, &angles[t]);
                gate[(t * nh + h) * hd..(t * nh + h + 1) * hd].copy_from_slice(&src[hd..]);
            }
            for kh in k[t * kvw..(t + 1) * kvw].chunks_exact_mut(hd) {
                rms_norm(kh, &self.k_norm, self.eps);
                rope.apply(kh, &angles[t]);
            }
        }
        state.k.push(&k);
        state.v.push(v);

        let index_q = match (&self.indexer, &proj.index) {
            (Some(ix), Some(ip)) => Some(ix.prepare(ip, rows.clone(), &angles, track, state, rope, self.eps)),
            _ => None,
        };
        let total = state.k.len();
        let group = nh / nkv;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut attn = vec![0f32; n * nh * hd];
        let state = &*state;
        // The pooled block keys every query of the call scores, as f32 (in place for an f32 cache).
        let pooled: std::borrow::Cow<'_, [f32]> = match (&self.indexer, state.pooled.as_f32()) {
            (_, Some(f)) => std::borrow::Cow::Borrowed(f),
            (None, None) => std::borrow::Cow::Owned(Vec::new()),
            (Some(ix), None) => {
                let ihd = ix.cfg.head_dim;
                let mut all = vec![0f32; state.pooled.len() * ihd];
                for (b, row) in all.chunks_exact_mut(ihd).enumerate() {
                    state.pooled.read(b, 0, row);
                }
                std::borrow::Cow::Owned(all)
            }
        };
        attn.par_chunks_mut(nh * hd).enumerate().for_each(|(t, out)| {
            let pos = pos0 + t;
            debug_assert!(pos < total);
            let selected: Vec<usize> = match (&self.indexer, &index_q) {
                (Some(ix), Some(iq)) => ix.select(
                    &iq[t * ix.cfg.n_heads * ix.cfg.head_dim..(t + 1) * ix.cfg.n_heads * ix.cfg.head_dim],
                    pos,
                    &pooled,
                ),
                _ => (0..=pos).collect(),
            };
            let mut scores = vec![0f32; selected.len()];
            // `f32` caches are read in place; other types have each kv head's selected rows decoded once for the
            // query heads of its group. The arithmetic per head is the same either way.
            let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
            for kvh in 0..nkv {
                let direct = state.k.as_f32().zip(state.v.as_f32());
                if direct.is_none() {
                    kbuf.resize(selected.len() * hd, 0f32);
                    vbuf.resize(selected.len() * hd, 0f32);
                    for (i, &j) in selected.iter().enumerate() {
                        state.k.read(j, kvh * hd, &mut kbuf[i * hd..(i + 1) * hd]);
                        state.v.read(j, kvh * hd, &mut vbuf[i * hd..(i + 1) * hd]);
                    }
                }
                let key = |i: usize| -> &[f32] {
                    match direct {
                        Some((kf, _)) => &kf[selected[i] * kvw + kvh * hd..selected[i] * kvw + (kvh + 1) * hd],
                        None => &kbuf[i * hd..(i + 1) * hd],
                    }
                };
                let value = |i: usize| -> &[f32] {
                    match direct {
                        Some((_, vf)) => &vf[selected[i] * kvw + kvh * hd..selected[i] * kvw + (kvh + 1) * hd],
                        None => &vbuf[i * hd..(i + 1) * hd],
                    }
                };
                for h in kvh * group..(kvh + 1) * group {
                    let qh = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
                    for (i, sc) in scores.iter_mut().enumerate() {
                        *sc = qh.iter().zip(key(i)).map(|(a, b)| a * b).sum::<f32>() * scale;
                    }
                    softmax(&mut scores);
                    let oh = &mut out[h * hd..(h + 1) * hd];
                    for (i, &w) in scores.iter().enumerate() {
                        for (o, &vv) in oh.iter_mut().zip(value(i)) {
                            *o += w * vv;
                        }
                    }
                }
            }
        });
        for (a, g) in attn.iter_mut().zip(&gate) {
            *a *= sigmoid(*g);
        }
        attn
    }

    /// `o_proj` over `n` rows of gated attention (`[n, n_head * head_dim]`): `[n, d]`.
    pub(crate) fn output(&self, attn: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n * self.o_proj.rows()];
        self.o_proj.matmul(attn, n, &mut y);
        y
    }
}

/// The row-wise projections of an attention layer's input ([`Attention::project`]): per row the query and gate
/// (`[n, n_head * 2 * head_dim]`), keys and values before norm and rope (`[n, n_kv * head_dim]`), and the
/// indexer's.
pub(crate) struct AttnProjections {
    p: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    index: Option<IndexProjections>,
}

/// The QSA indexer's row-wise projections: queries `[n, heads * head_dim]` before norm and rope, raw keys
/// `[n, head_dim]`.
pub(crate) struct IndexProjections {
    q: Vec<f32>,
    k: Vec<f32>,
}

impl Indexer {
    /// The indexer's projections of `n` rows `x` (`[n, d]`).
    fn project(&self, x: &[f32], n: usize) -> IndexProjections {
        let (nih, ihd) = (self.cfg.n_heads, self.cfg.head_dim);
        let mut q = vec![0f32; n * nih * ihd];
        self.q_proj.matmul(x, n, &mut q);
        let mut k = vec![0f32; n * ihd];
        self.k_proj.matmul(x, n, &mut k);
        IndexProjections { q, k }
    }

    /// Normalises and rotates the indexer queries of the projected rows `rows` (one sequence's), appends their
    /// raw keys to the state and pools every newly completed block. Returns the queries,
    /// `[rows.len(), heads * head_dim]`.
    fn prepare(
        &self,
        proj: &IndexProjections,
        rows: std::ops::Range<usize>,
        angles: &[super::rope::RopeAngles],
        track: &MropeTrack,
        state: &mut AttnState,
        rope: &Rope,
        eps: f32,
    ) -> Vec<f32> {
        let (nih, ihd, r) = (self.cfg.n_heads, self.cfg.head_dim, self.compress_ratio);
        let n = rows.len();
        let mut q = proj.q[rows.start * nih * ihd..rows.end * nih * ihd].to_vec();
        for t in 0..n {
            for qh in q[t * nih * ihd..(t + 1) * nih * ihd].chunks_exact_mut(ihd) {
                rms_norm(qh, &self.q_norm, eps);
                rope.apply(qh, &angles[t]);
            }
        }
        state.index_k.push(&proj.k[rows.start * ihd..rows.end * ihd]);
        let len = state.index_k.len();
        let mut blocks = state.pooled.len();
        let mut raw = vec![0f32; ihd];
        while (blocks + 1) * r <= len {
            let mut mean = vec![0f32; ihd];
            for tok in blocks * r..(blocks + 1) * r {
                let kv = match state.index_k.as_f32() {
                    Some(f) => &f[tok * ihd..(tok + 1) * ihd],
                    None => {
                        state.index_k.read(tok, 0, &mut raw);
                        &raw[..]
                    }
                };
                for (m, &kv) in mean.iter_mut().zip(kv) {
                    *m += kv;
                }
            }
            for m in &mut mean {
                *m /= r as f32;
            }
            rms_norm(&mut mean, &self.k_norm, eps);
            rope.apply(&mut mean, &rope.angles_thw(track.position(blocks * r).map(|v| v as usize)));
            state.pooled.push(&mean);
            blocks += 1;
        }
        q
    }

    /// The key positions query `q` (at `pos`) attends to, ascending within blocks, tail last; `pooled` the
    /// block keys (`[blocks, head_dim]`).
    fn select(&self, q: &[f32], pos: usize, pooled: &[f32]) -> Vec<usize> {
        let (nih, ihd, r) = (self.cfg.n_heads, self.cfg.head_dim, self.compress_ratio);
        let visible = pos + 1;
        let complete = visible / r;
        let keep_blocks = self.cfg.token_budget / r;
        if complete <= keep_blocks {
            return (0..visible).collect();
        }
        let inv = 1.0 / (ihd as f32).sqrt();
        let scored = block_scores(q, pooled, complete, nih, ihd);
        let mut scored: Vec<(f32, usize)> = scored.into_iter().enumerate().map(|(b, s)| (s * inv, b)).collect();
        // Highest scores first; equal scores keep the lower block first.
        scored.select_nth_unstable_by(keep_blocks - 1, |a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut blocks: Vec<usize> = scored[..keep_blocks].iter().map(|s| s.1).collect();
        blocks.sort_unstable();
        let mut sel: Vec<usize> = blocks.iter().flat_map(|&b| b * r..(b + 1) * r).collect();
        sel.extend(complete * r..visible);
        sel
    }
}

/// Blocks scored together by [`block_scores`]: independent sums, so their additions overlap instead of waiting on
/// each other.
const SCORE_LANES: usize = 8;

/// `sum_h relu(<q_h, pooled[b]>)` for blocks `0..complete` (`q` `[nih, ihd]`, `pooled` `[blocks, ihd]`), each dot
/// product summed in dimension order and the heads in head order from the starting value of `f32`'s
/// `Iterator::sum`: the numbers of `q.chunks(ihd).map(|qh| qh.iter().zip(kb).map(|(a, c)| a * c).sum().max(0))
/// .sum()`, bit for bit, with [`SCORE_LANES`] blocks in flight. At 128K tokens this is every decode step's
/// largest CPU cost in an attention layer (32,768 blocks).
fn block_scores(q: &[f32], pooled: &[f32], complete: usize, nih: usize, ihd: usize) -> Vec<f32> {
    let start: f32 = std::iter::empty::<f32>().sum();
    let mut out = Vec::with_capacity(complete);
    let mut b0 = 0;
    while b0 < complete {
        let g = SCORE_LANES.min(complete - b0);
        let mut s = [start; SCORE_LANES];
        for qh in q.chunks_exact(ihd).take(nih) {
            let mut acc = [start; SCORE_LANES];
            for (i, &qi) in qh.iter().enumerate() {
                for (j, a) in acc.iter_mut().enumerate().take(g) {
                    *a += qi * pooled[(b0 + j) * ihd + i];
                }
            }
            for (sj, a) in s.iter_mut().zip(acc).take(g) {
                *sj += a.max(0.0);
            }
        }
        out.extend_from_slice(&s[..g]);
        b0 += g;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lane-interleaved scores are the plain iterator sums bit for bit (zeros, negative products and a
    /// partial last group included).
    #[test]
    fn block_scores_equal_the_plain_sums_bit_for_bit() {
        let (nih, ihd, complete) = (3, 16, 21);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
        };
        let mut q: Vec<f32> = (0..nih * ihd).map(|_| next()).collect();
        let mut pooled: Vec<f32> = (0..complete * ihd).map(|_| next()).collect();
        q[5] = 0.0;
        q[6] = -0.0;
        pooled[ihd..2 * ihd].fill(0.0);
        let got = block_scores(&q, &pooled, complete, nih, ihd);
        for (b, &g) in got.iter().enumerate() {
            let kb = &pooled[b * ihd..(b + 1) * ihd];
            let want: f32 = q
                .chunks_exact(ihd)
                .take(nih)
                .map(|qh| qh.iter().zip(kb).map(|(a, c)| a * c).sum::<f32>().max(0.0))
                .sum();
            assert_eq!(g.to_bits(), want.to_bits(), "block {b}: {g} vs {want}");
        }
    }
}
