//! Gated self-attention with the QSA indexer (`self_attn` and `self_attn.indexer` in the reference) on the
//! device (kernels/cuda/attention.cu), as `crate::model::self_attn`: q/k/v projections, per-head RMS norms,
//! rope, the KV cache, the indexer's block selection of past keys, split-key decode attention, the sigmoid gate
//! and the output projection.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::device::Arg;
use super::gemv::GEMV_MAX_TOKENS;
use super::launch::{Launch, Seq};
use super::memory::zeros;
use super::weights::{DevMatrix, Uploader};
use crate::gguf::GgmlType;
use crate::model::config::ModelConfig;
use crate::model::self_attn::Attention;

/// Key splits per query of decode attention (flash-decoding); parts are merged by `attention_combine`.
const ATTN_SPLITS: usize = 16;

/// The QSA indexer on the device (`crate::model::self_attn::Indexer`).
pub(crate) struct DevIndexer {
    pub(crate) q_proj: DevMatrix,
    pub(crate) k_proj: DevMatrix,
    pub(crate) q_norm: CudaSlice<f32>,
    pub(crate) k_norm: CudaSlice<f32>,
    /// Keys per pooled block.
    pub(crate) compress_ratio: usize,
}

/// One gated attention token mixer on the device (`crate::model::self_attn::Attention`).
pub(crate) struct DevAttention {
    pub(crate) q_proj: DevMatrix,
    pub(crate) k_proj: DevMatrix,
    pub(crate) v_proj: DevMatrix,
    pub(crate) o_proj: DevMatrix,
    pub(crate) q_norm: CudaSlice<f32>,
    pub(crate) k_norm: CudaSlice<f32>,
    pub(crate) indexer: Option<DevIndexer>,
}

/// One attention layer's cache of a sequence on the device (`crate::model::self_attn::AttnState`), sized for the
/// state's capacity up front; rows are position-indexed.
pub(crate) struct AttnState {
    /// `[max_len, n_kv * head_dim]`.
    pub(crate) k: CudaSlice<f32>,
    /// `[max_len, n_kv * head_dim]`.
    pub(crate) v: CudaSlice<f32>,
    /// The indexer's raw keys, `[max_len, index_head_dim]` (one value without an indexer).
    pub(crate) index_k: CudaSlice<f32>,
    /// The indexer's block-pooled keys, `[max_len / ratio + 1, index_head_dim]`.
    pub(crate) pooled: CudaSlice<f32>,
}

impl DevAttention {
    /// Uploads `a`, the attention of block `block` (tensors `blk.{block}.attn_*` and `blk.{block}.indexer.*`).
    pub(crate) fn upload(up: &mut Uploader<'_>, a: &Attention, block: usize) -> Result<Self, CudaError> {
        let p = format!("blk.{block}");
        Ok(Self {
            q_proj: up.matrix(&a.q_proj, &format!("{p}.attn_q"))?,
            k_proj: up.matrix(&a.k_proj, &format!("{p}.attn_k"))?,
            v_proj: up.matrix(&a.v_proj, &format!("{p}.attn_v"))?,
            o_proj: up.matrix(&a.o_proj, &format!("{p}.attn_output"))?,
            q_norm: up.vector(&a.q_norm)?,
            k_norm: up.vector(&a.k_norm)?,
            indexer: match &a.indexer {
                Some(ix) => Some(DevIndexer {
                    q_proj: up.matrix(&ix.q_proj, &format!("{p}.indexer.q_proj"))?,
                    k_proj: up.matrix(&ix.k_proj, &format!("{p}.indexer.k_proj"))?,
                    q_norm: up.vector(&ix.q_norm)?,
                    k_norm: up.vector(&ix.k_norm)?,
                    compress_ratio: ix.compress_ratio,
                }),
                None => None,
            },
        })
    }

    /// The type of the first matrix that multiplies the block's input (its 8-bit form is written by the mixer).
    pub(crate) fn input_type(&self) -> GgmlType {
        self.q_proj.ty
    }

    /// An empty cache for `max_len` tokens: K and V, and with the QSA indexer its raw and block-pooled keys.
    pub(crate) fn new_state(&self, ctx: &Launch, max_len: usize) -> Result<AttnState, CudaError> {
        let dev = &ctx.dev;
        let [k, v, index_k, pooled] = self.cache_lens(&ctx.cfg, max_len);
        Ok(AttnState {
            k: zeros(dev, k)?,
            v: zeros(dev, v)?,
            index_k: zeros(dev, index_k)?,
            pooled: zeros(dev, pooled)?,
        })
    }

    /// The f32 values of each buffer of [`Self::new_state`] for `max_len` tokens, as allocated (at least one
    /// each): K, V, the indexer's raw keys, its pooled blocks.
    pub(crate) fn cache_lens(&self, cfg: &ModelConfig, max_len: usize) -> [usize; 4] {
        let kvw = cfg.n_head_kv * cfg.head_dim;
        let (ihd, blocks) =
            self.indexer.as_ref().map_or((0, 1), |i| (cfg.indexer.head_dim, max_len / i.compress_ratio.max(1) + 1));
        [max_len * kvw, max_len * kvw, max_len * ihd, blocks * ihd].map(|v| v.max(1))
    }

    /// Gated attention for `n` tokens at the position in `pos_dev`; `capacity` is the state's token capacity
    /// (it sizes the QSA score rows so the launch shapes do not depend on the position).
    pub(crate) fn forward(
        &self,
        ctx: &Launch,
        st: &AttnState,
        m: u64,
        n: usize,
        pos_dev: u64,
        capacity: usize,
    ) -> Result<u64, CudaError> {
        self.forward_seqs(ctx, m, n, &[Seq { st, r0: 0, n, pos_dev, capacity }])
    }

    /// Gated attention over the `n` rows `m` of several sequences (`seqs` cover the rows in order, each with its
    /// own cache and position): the projections, norms, gate and output projection over all rows at once, rope,
    /// the cache writes, the QSA selection and the attention itself per sequence. Returns the output `[n, d]`.
    pub(crate) fn forward_seqs(
        &self,
        ctx: &Launch,
        m: u64,
        n: usize,
        seqs: &[Seq<'_, AttnState>],
    ) -> Result<u64, CudaError> {
        let cfg = &ctx.cfg;
        let rows = self.project(ctx, m, n)?;
        let out = ctx.tmp(n * cfg.n_head * cfg.head_dim)?;
        for s in seqs {
            self.attend(ctx, s, &rows, out)?;
        }
        let dev = &ctx.dev;
        let width = n * cfg.n_head * cfg.head_dim;
        dev.launch_1d("mul_sigmoid", width, &[Arg::Ptr(out), Arg::Ptr(rows.gate), Arg::I64(width as i64)])?;
        let y = ctx.tmp(n * cfg.hidden)?;
        ctx.matmul(self.o_proj.view(dev), out, n, y)?;
        Ok(y)
    }

    /// The row-wise part of attention for `n` rows `m`: the q/gate, k, v (and indexer q, k) projections and the
    /// per-head RMS norms, before rope.
    fn project(&self, ctx: &Launch, m: u64, n: usize) -> Result<AttnRows, CudaError> {
        let dev = &ctx.dev;
        let cfg = &ctx.cfg;
        let at = self;
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        let kvw = nkv * hd;
        let pq = ctx.tmp(n * nh * hd * 2)?;
        ctx.matmul(at.q_proj.view(dev), m, n, pq)?;
        let q = ctx.tmp(n * nh * hd)?;
        let gate = ctx.tmp(n * nh * hd)?;
        dev.launch_1d(
            "attn_split_q",
            n * nh * hd,
            &[Arg::Ptr(pq), Arg::Ptr(q), Arg::Ptr(gate), Arg::I32(n as i32), Arg::I32(nh as i32), Arg::I32(hd as i32)],
        )?;
        ctx.rms_norm(q, ctx.addr(&at.q_norm, 0), q, n * nh, hd, 1)?;
        let kn = ctx.tmp(n * kvw)?;
        let vn = ctx.tmp(n * kvw)?;
        ctx.matmul(at.k_proj.view(dev), m, n, kn)?;
        ctx.matmul(at.v_proj.view(dev), m, n, vn)?;
        ctx.rms_norm(kn, ctx.addr(&at.k_norm, 0), kn, n * nkv, hd, 1)?;
        let (mut qi, mut kr) = (0, 0);
        if let Some(ix) = &at.indexer {
            let ic = cfg.indexer;
            let (nih, ihd) = (ic.n_heads, ic.head_dim);
            qi = ctx.tmp(n * nih * ihd)?;
            ctx.matmul(ix.q_proj.view(dev), m, n, qi)?;
            ctx.rms_norm(qi, ctx.addr(&ix.q_norm, 0), qi, n * nih, ihd, 1)?;
            kr = ctx.tmp(n * ihd)?;
            ctx.matmul(ix.k_proj.view(dev), m, n, kr)?;
        }
        Ok(AttnRows { q, gate, kn, vn, qi, kr })
    }

    /// The per-sequence part of attention for the rows of `s`: rope at the sequence's positions, the K/V (and
    /// indexer key) cache writes, the QSA block selection and the attention over the sequence's own cache, into
    /// the sequence's rows of `out` (`[rows, n_head * head_dim]`).
    fn attend(&self, ctx: &Launch, s: &Seq<'_, AttnState>, rows: &AttnRows, out: u64) -> Result<(), CudaError> {
        let dev = &ctx.dev;
        let cfg = &ctx.cfg;
        let at = self;
        let AttnState { k: kc, v: vc, index_k: raw, pooled } = s.st;
        let (n, pos_dev, capacity) = (s.n, s.pos_dev, s.capacity);
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        let kvw = nkv * hd;
        let q = s.row(rows.q, nh * hd);
        let (kn, vn) = (s.row(rows.kn, kvw), s.row(rows.vn, kvw));
        let out = s.row(out, nh * hd);
        ctx.rope(q, n, nh, nh * hd, hd, pos_dev)?;
        ctx.rope(kn, n, nkv, kvw, hd, pos_dev)?;
        for (src, dst) in [(kn, kc), (vn, vc)] {
            dev.launch_1d(
                "copy_rows_at",
                n * kvw,
                &[
                    Arg::Ptr(src),
                    Arg::Ptr(ctx.addr(dst, 0)),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(n as i32),
                    Arg::I32(kvw as i32),
                ],
            )?;
        }
        let mut selection: Option<(u64, u64, usize)> = None;
        if let Some(ix) = &at.indexer {
            let ic = cfg.indexer;
            let (nih, ihd, r) = (ic.n_heads, ic.head_dim, ix.compress_ratio);
            let qi = s.row(rows.qi, nih * ihd);
            let kr = s.row(rows.kr, ihd);
            ctx.rope(qi, n, nih, nih * ihd, ihd, pos_dev)?;
            dev.launch_1d(
                "copy_rows_at",
                n * ihd,
                &[
                    Arg::Ptr(kr),
                    Arg::Ptr(ctx.addr(raw, 0)),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(n as i32),
                    Arg::I32(ihd as i32),
                ],
            )?;
            dev.launch(
                "qsa_pool_new",
                ((n / r + 1) as u32, 1, 1),
                128,
                &[
                    Arg::Ptr(ctx.addr(raw, 0)),
                    Arg::Ptr(ctx.addr(pooled, 0)),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(n as i32),
                    Arg::I32(r as i32),
                    Arg::I32(ihd as i32),
                    Arg::Ptr(ctx.addr(&ix.k_norm, 0)),
                    Arg::F32(cfg.rms_eps),
                    Arg::I32(cfg.rope_dim as i32),
                    Arg::F32(cfg.rope_theta),
                ],
            )?;
            let keep = ic.token_budget / r;
            let max_blocks = (capacity / r).max(1);
            let scores = ctx.tmp(n * max_blocks)?;
            dev.launch_1d(
                "qsa_scores",
                n * max_blocks * 32, // a warp per (token, block)
                &[
                    Arg::Ptr(qi),
                    Arg::Ptr(ctx.addr(pooled, 0)),
                    Arg::Ptr(scores),
                    Arg::I32(n as i32),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(r as i32),
                    Arg::I32(nih as i32),
                    Arg::I32(ihd as i32),
                    Arg::I32(max_blocks as i32),
                ],
            )?;
            let cap = keep * r + r - 1;
            let sel = ctx.tmp(n * cap)?;
            let count = ctx.tmp(n)?;
            dev.launch(
                "qsa_select",
                (n as u32, 1, 1),
                256,
                &[
                    Arg::Ptr(scores),
                    Arg::I32(max_blocks as i32),
                    Arg::I32(keep as i32),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(r as i32),
                    Arg::Ptr(sel),
                    Arg::Ptr(count),
                    Arg::I32(cap as i32),
                ],
            )?;
            selection = Some((sel, count, cap));
        }
        let (sp, cp, cap) = selection.unwrap_or((0, 0, 0));
        // Both attention kernels take the query, the caches and the key list first, the head shape last; the
        // output in between (the decode split writes partial sums).
        let head = [Arg::I32(nh as i32), Arg::I32(nkv as i32), Arg::I32(hd as i32), Arg::F32(1.0 / (hd as f32).sqrt())];
        let mut args = vec![
            Arg::Ptr(q),
            Arg::Ptr(ctx.addr(kc, 0)),
            Arg::Ptr(ctx.addr(vc, 0)),
            Arg::Ptr(sp),
            Arg::Ptr(cp),
            Arg::I32(cap as i32),
            Arg::I32(0),
            Arg::Ptr(pos_dev),
        ];
        if (n <= GEMV_MAX_TOKENS || ctx.exact()) && hd % 4 == 0 {
            // Decode: few queries, so the keys are split over ATTN_SPLITS blocks per query and merged after.
            let splits = ATTN_SPLITS;
            let pm = ctx.tmp(n * nh * splits)?;
            let pl = ctx.tmp(n * nh * splits)?;
            let pa = ctx.tmp(n * nh * splits * hd)?;
            args.extend([Arg::Ptr(pm), Arg::Ptr(pl), Arg::Ptr(pa)]);
            args.extend(head);
            dev.launch("attention_part", ((n * nh) as u32, splits as u32, 1), 128, &args)?;
            dev.launch(
                "attention_combine",
                ((n * nh) as u32, 1, 1),
                128,
                &[
                    Arg::Ptr(pm),
                    Arg::Ptr(pl),
                    Arg::Ptr(pa),
                    Arg::Ptr(out),
                    Arg::I32(splits as i32),
                    Arg::I32(hd as i32),
                ],
            )?;
        } else {
            args.push(Arg::Ptr(out));
            args.extend(head);
            if nh % nkv == 0 && nh / nkv <= 16 && hd <= 256 && hd % 32 == 0 {
                // The query heads of a kv head together: each key row read once for all of them.
                dev.launch("attention_gqa", ((n * nkv) as u32, 1, 1), 128, &args)?;
            } else {
                dev.launch("attention", ((n * nh) as u32, 1, 1), 128, &args)?;
            }
        }
        Ok(())
    }
}

/// The row-wise outputs of attention's projections (device addresses of arena temporaries, rows in pass order):
/// the normed queries `[rows, n_head * head_dim]` and the output gate (same shape), the normed keys and the
/// values `[rows, n_head_kv * head_dim]`, and with the QSA indexer its normed queries `[rows, heads * head_dim]`
/// and raw keys `[rows, head_dim]` (0 without one).
struct AttnRows {
    q: u64,
    gate: u64,
    kn: u64,
    vn: u64,
    qi: u64,
    kr: u64,
}
