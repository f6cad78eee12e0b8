//! Gated self-attention with the QSA indexer (`self_attn` and `self_attn.indexer` in the reference) on the
//! device (kernels/cuda/attention.cu), as `crate::model::self_attn`: q/k/v projections, per-head RMS norms,
//! rope, the KV cache, the indexer's block selection of past keys, split-key decode attention, the sigmoid gate
//! and the output projection.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::device::Arg;
use super::gemv::GEMV_MAX_TOKENS;
use super::kv_cache::{GATHER_MAX_ROWS, HostKv, MappedHost, kv_suffix};
use super::launch::{Launch, Seq};
use super::weights::{DevMatrix, Uploader};
use crate::gguf::GgmlType;
use crate::model::KvCacheType;
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

/// One attention layer's cache of a sequence on the device (`crate::model::self_attn::AttnState`): rows of the
/// model's KV cache type (`kv_cache.rs`), position-indexed, sized for the state's capacity up front; with the hot
/// window, K, V and the raw indexer keys keep a ring of `ring` rows in VRAM and every row in `host`.
pub(crate) struct AttnState {
    /// `[ring, kv row bytes]`.
    pub(crate) k: CudaSlice<u8>,
    /// `[ring, kv row bytes]`.
    pub(crate) v: CudaSlice<u8>,
    /// The indexer's raw keys, `[ring, index row bytes]` (one byte without an indexer).
    pub(crate) index_k: CudaSlice<u8>,
    /// The indexer's block-pooled keys, `[max_len / ratio + 1, index row bytes]`, always in VRAM.
    pub(crate) pooled: CudaSlice<u8>,
    /// Rows of K, V and raw indexer keys in VRAM: the capacity, or the hot window's.
    pub(crate) ring: usize,
    /// Every row of K, V and raw indexer keys in pinned host memory, when windowed.
    pub(crate) host: Option<HostKv>,
}

/// Bytes of one attention layer's caches of a state, by where (see [`DevAttention::cache_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CacheBytes {
    /// K, V, raw indexer keys (ring or all rows) and pooled keys, as allocated (at least one byte each).
    pub(crate) device: usize,
    /// The host copies of a windowed layer.
    pub(crate) host: usize,
    /// Bytes of one row of K (and of V), of the raw indexer keys.
    pub(crate) kv_row: usize,
    pub(crate) ik_row: usize,
    /// Rows in VRAM.
    pub(crate) ring: usize,
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

    /// The types of K/V and of the indexer keys under the model's cache type.
    pub(crate) fn kv_types(&self, cfg: &ModelConfig) -> (KvCacheType, KvCacheType) {
        let ihd = if self.indexer.is_some() { cfg.indexer.head_dim } else { 0 };
        (cfg.kv_cache, cfg.kv_cache.index_key_type(ihd))
    }

    /// The bytes of [`Self::new_state`] for `max_len` tokens with a hot window of `window` tokens (0: none; a
    /// dense layer, or a state no longer than the window, keeps every row in VRAM): K, V and raw indexer keys of
    /// `ring` rows and the pooled keys in VRAM (at least one byte each), and the host copies of every row when
    /// windowed.
    pub(crate) fn cache_bytes(&self, cfg: &ModelConfig, max_len: usize, window: usize) -> CacheBytes {
        let (ty, ity) = self.kv_types(cfg);
        let kv_row = ty.row_bytes(cfg.n_head_kv * cfg.head_dim);
        let (ik_row, blocks) = self
            .indexer
            .as_ref()
            .map_or((0, 1), |i| (ity.row_bytes(cfg.indexer.head_dim), max_len / i.compress_ratio.max(1) + 1));
        let windowed = self.indexer.is_some() && window > 0 && max_len > window;
        let ring = if windowed { window } else { max_len };
        let device = [ring * kv_row, ring * kv_row, ring * ik_row, blocks * ik_row].iter().map(|&b| b.max(1)).sum();
        let host = if windowed { max_len * (2 * kv_row + ik_row) } else { 0 };
        CacheBytes { device, host, kv_row, ik_row, ring }
    }

    /// An empty cache for `max_len` tokens: K and V, and with the QSA indexer its raw and block-pooled keys; with
    /// a hot window of `window` tokens (0: none) and a longer state, rings of `window` rows in VRAM and every row
    /// in pinned host memory, and the shared staging buffers grown to this state's cold rows.
    pub(crate) fn new_state(&self, ctx: &Launch, max_len: usize, window: usize) -> Result<AttnState, CudaError> {
        let dev = &ctx.dev;
        let b = self.cache_bytes(&ctx.cfg, max_len, window);
        let bytes = |n: usize| dev.stream().alloc_zeros::<u8>(n.max(1));
        let blocks = self.indexer.as_ref().map_or(1, |i| max_len / i.compress_ratio.max(1) + 1);
        let host = if b.host > 0 {
            ctx.reserve_cold_rows(max_len * b.kv_row)?;
            Some(HostKv {
                k: MappedHost::new(max_len * b.kv_row)?,
                v: MappedHost::new(max_len * b.kv_row)?,
                index_k: MappedHost::new(max_len * b.ik_row)?,
            })
        } else {
            None
        };
        Ok(AttnState {
            k: bytes(b.ring * b.kv_row)?,
            v: bytes(b.ring * b.kv_row)?,
            index_k: bytes(b.ring * b.ik_row)?,
            pooled: bytes(blocks * b.ik_row)?,
            ring: b.ring,
            host,
        })
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
        // (The MTP block's rows rotate at their indices, as on the CPU.)
        self.forward_seqs(ctx, m, n, &[Seq { st, r0: 0, n, pos_dev, thw: 0, pos: 0, capacity }], None)
    }

    /// Gated attention over the `n` rows `m` of several sequences (`seqs` cover the rows in order, each with its
    /// own cache and position): the projections, norms, gate and output projection over all rows at once, rope,
    /// the cache writes, the QSA selection and the attention itself per sequence. Returns the output `[n, d]`.
    /// `prefetch` (a prefill pass of one sequence): that sequence's cache of the next windowed attention layer,
    /// whose cold prefix is copied into the staging buffers on the copy stream once this layer has read them.
    pub(crate) fn forward_seqs(
        &self,
        ctx: &Launch,
        m: u64,
        n: usize,
        seqs: &[Seq<'_, AttnState>],
        prefetch: Option<(&AttnState, usize)>,
    ) -> Result<u64, CudaError> {
        let cfg = &ctx.cfg;
        let rows = self.project(ctx, m, n)?;
        let out = ctx.tmp(n * cfg.n_head * cfg.head_dim)?;
        for s in seqs {
            self.attend(ctx, s, &rows, out)?;
        }
        if let ([s], Some((next, ratio))) = (seqs, prefetch) {
            ctx.prefetch_cold(next, s.pos, s.n, ratio, cfg.kv_cache.row_bytes(cfg.n_head_kv * cfg.head_dim))?;
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
        let st = s.st;
        let (n, pos_dev, capacity) = (s.n, s.pos_dev, s.capacity);
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        let kvw = nkv * hd;
        let (ty, ity) = self.kv_types(cfg);
        let (kv_sfx, ik_sfx) = (kv_suffix(ty), kv_suffix(ity));
        let ring = st.ring as i32;
        let host = st.host.as_ref();
        if let (Some(_), Some(ix)) = (host, &at.indexer)
            && n + ix.compress_ratio > st.ring
        {
            // The ring must hold the pass's rows and the block they complete (kv_cache.rs).
            return Err(CudaError::Unsupported(format!(
                "a pass of {n} tokens over a KV window of {} tokens (at most {} a pass: a smaller prefill chunk or a \
                 larger kv_window)",
                st.ring,
                st.ring - ix.compress_ratio
            )));
        }
        let q = s.row(rows.q, nh * hd);
        let (kn, vn) = (s.row(rows.kn, kvw), s.row(rows.vn, kvw));
        let out = s.row(out, nh * hd);
        ctx.rope(q, n, nh, nh * hd, hd, pos_dev, s.thw)?;
        ctx.rope(kn, n, nkv, kvw, hd, pos_dev, s.thw)?;
        let store = format!("kv_store_rows_{kv_sfx}");
        for (src, dst, hc) in [(kn, &st.k, host.map(|h| &h.k)), (vn, &st.v, host.map(|h| &h.v))] {
            dev.launch_1d(
                &store,
                n * kvw,
                &[
                    Arg::Ptr(src),
                    Arg::Ptr(ctx.addr(dst, 0)),
                    Arg::Ptr(hc.map_or(0, |h| h.device_addr(0))),
                    Arg::Ptr(pos_dev),
                    Arg::I32(n as i32),
                    Arg::I32(kvw as i32),
                    Arg::I32(ring),
                ],
            )?;
        }
        let mut selection: Option<(u64, u64, usize)> = None;
        let mut window = 0;
        let mut ratio = 1;
        if let Some(ix) = &at.indexer {
            let ic = cfg.indexer;
            let (nih, ihd, r) = (ic.n_heads, ic.head_dim, ix.compress_ratio);
            ratio = r;
            if host.is_some() {
                window = st.ring;
            }
            let qi = s.row(rows.qi, nih * ihd);
            let kr = s.row(rows.kr, ihd);
            ctx.rope(qi, n, nih, nih * ihd, ihd, pos_dev, s.thw)?;
            dev.launch_1d(
                &format!("kv_store_rows_{ik_sfx}"),
                n * ihd,
                &[
                    Arg::Ptr(kr),
                    Arg::Ptr(ctx.addr(&st.index_k, 0)),
                    Arg::Ptr(host.map_or(0, |h| h.index_k.device_addr(0))),
                    Arg::Ptr(pos_dev),
                    Arg::I32(n as i32),
                    Arg::I32(ihd as i32),
                    Arg::I32(ring),
                ],
            )?;
            dev.launch(
                &format!("qsa_pool_new_{ik_sfx}"),
                ((n / r + 1) as u32, 1, 1),
                128,
                &[
                    Arg::Ptr(ctx.addr(&st.index_k, 0)),
                    Arg::Ptr(ctx.addr(&st.pooled, 0)),
                    Arg::I32(0),
                    Arg::Ptr(pos_dev),
                    Arg::I32(n as i32),
                    Arg::I32(r as i32),
                    Arg::I32(ihd as i32),
                    Arg::Ptr(ctx.addr(&ix.k_norm, 0)),
                    Arg::F32(cfg.rms_eps),
                    Arg::I32(cfg.rope_dim as i32),
                    Arg::F32(cfg.rope_theta),
                    Arg::I32(ring),
                    Arg::Ptr(s.thw),
                    Arg::I32(cfg.rope_sections[1] as i32),
                    Arg::I32(cfg.rope_sections[2] as i32),
                ],
            )?;
            let keep = ic.token_budget / r;
            let max_blocks = (capacity / r).max(1);
            let scores = ctx.tmp(n * max_blocks)?;
            dev.launch_1d(
                &format!("qsa_scores_{ik_sfx}"),
                n * max_blocks * 32, // a warp per (token, block)
                &[
                    Arg::Ptr(qi),
                    Arg::Ptr(ctx.addr(&st.pooled, 0)),
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
            if let Some(h) = host {
                // The cold keys this pass reads, into the staging buffers (see kv_cache.rs).
                let kv_row = ty.row_bytes(kvw);
                let (cold_k, cold_v) = ctx.cold_rows();
                if n <= GATHER_MAX_ROWS {
                    dev.launch_1d(
                        "kv_cold_gather",
                        n * (keep + 1) * 32, // a warp per (query, block entry)
                        &[
                            Arg::Ptr(sel),
                            Arg::Ptr(count),
                            Arg::I32(cap as i32),
                            Arg::I32(n as i32),
                            Arg::I32((keep + 1) as i32),
                            Arg::I32(0),
                            Arg::Ptr(pos_dev),
                            Arg::I32(window as i32),
                            Arg::I32(r as i32),
                            Arg::Ptr(h.k.device_addr(0)),
                            Arg::Ptr(h.v.device_addr(0)),
                            Arg::Ptr(cold_k),
                            Arg::Ptr(cold_v),
                            Arg::I32(kv_row as i32),
                        ],
                    )?;
                } else {
                    ctx.copy_cold(st, cold_end(s.pos + n, window, r), kv_row)?;
                }
            }
        }
        let (sp, cp, cap) = selection.unwrap_or((0, 0, 0));
        let (cold_k, cold_v) = if window > 0 { ctx.cold_rows() } else { (0, 0) };
        // Every attention kernel takes the query, the caches (rings and staging, the window) and the key list
        // first, the head shape last; the output in between (the decode split writes partial sums).
        let head = [Arg::I32(nh as i32), Arg::I32(nkv as i32), Arg::I32(hd as i32), Arg::F32(1.0 / (hd as f32).sqrt())];
        let mut args = vec![
            Arg::Ptr(q),
            Arg::Ptr(ctx.addr(&st.k, 0)),
            Arg::Ptr(ctx.addr(&st.v, 0)),
            Arg::Ptr(cold_k),
            Arg::Ptr(cold_v),
            Arg::I32(ring),
            Arg::I32(window as i32),
            Arg::I32(ratio as i32),
            Arg::I32(n as i32),
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
            dev.launch(&format!("attention_part_{kv_sfx}"), ((n * nh) as u32, splits as u32, 1), 128, &args)?;
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
                dev.launch(&format!("attention_gqa_{kv_sfx}"), ((n * nkv) as u32, 1, 1), 128, &args)?;
            } else {
                dev.launch(&format!("attention_{kv_sfx}"), ((n * nh) as u32, 1, 1), 128, &args)?;
            }
        }
        Ok(())
    }
}

/// The first key a pass ending at `end` reads from the staging buffers: `ceil_r(end - window)` (0 without a
/// window), as the kernels compute it (`kv_cold_end` in kernels/cuda/attention.cu).
pub(crate) fn cold_end(end: usize, window: usize, r: usize) -> usize {
    if window == 0 || end <= window {
        return 0;
    }
    (end - window).div_ceil(r.max(1)) * r.max(1)
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
