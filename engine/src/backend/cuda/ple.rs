//! The per-layer embedding (PLE) block on the device (kernels/cuda/ple.cu), as `crate::model::ple`: the hashed
//! n-gram rows of the table, their key and value projections, the gate against the bundle, the causal conv and
//! the residual add. In hybrid mode the table stays on the host and each pass uploads the rows it reads.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::device::Arg;
use super::launch::{Launch, Seq};
use super::memory::zeros;
use super::weights::{DevMatrix, Uploader};
use crate::model::config::{ModelConfig, PleConfig};
use crate::model::ple::PleLayer;

/// The PLE block on the device (`crate::model::ple::PleLayer`).
pub(crate) struct DevPle {
    pub(crate) cfg: PleConfig,
    pub(crate) key_proj: DevMatrix,
    pub(crate) value_proj: DevMatrix,
    pub(crate) norm_key: CudaSlice<f32>,
    pub(crate) norm_query: CudaSlice<f32>,
    pub(crate) norm_conv: CudaSlice<f32>,
    /// `[S*d, conv_kernel]`.
    pub(crate) conv1d: CudaSlice<f32>,
    /// The n-gram table on the device; `None` in hybrid mode, where it stays on the host (RAM or SSD, it is far
    /// larger than a consumer GPU: 29 GB in IQ4_NL for the real model) and each pass uploads the rows it reads.
    pub(crate) ngram_embedding: Option<DevMatrix>,
    /// Rows of the table (on the device or not).
    pub(crate) table_rows: usize,
}

/// A sequence's PLE state on the device (`crate::model::ple::PleState`).
pub(crate) struct DevPleState {
    /// The last `ngram_size - 1` tokens (host side: the n-gram rows are hashed on the host).
    pub(crate) context: Vec<u32>,
    /// The conv's history, `[conv_state_len, S*d]`.
    pub(crate) conv: CudaSlice<f32>,
}

impl DevPle {
    /// Uploads `p` (tensors `blk.{layer}.ple_*`); `with_table` also uploads the n-gram table
    /// (`per_layer_token_embd`).
    pub(crate) fn upload(up: &mut Uploader<'_>, p: &PleLayer, with_table: bool) -> Result<Self, CudaError> {
        let b = format!("blk.{}", p.cfg.layer);
        Ok(Self {
            cfg: p.cfg.clone(),
            key_proj: up.matrix(&p.key_proj, &format!("{b}.ple_key"))?,
            value_proj: up.matrix(&p.value_proj, &format!("{b}.ple_value"))?,
            norm_key: up.vector(&p.norm_key)?,
            norm_query: up.vector(&p.norm_query)?,
            norm_conv: up.vector(&p.norm_conv)?,
            conv1d: up.vector(&p.conv1d)?,
            ngram_embedding: if with_table {
                Some(up.table(&p.ngram_embedding, "per_layer_token_embd")?)
            } else {
                None
            },
            table_rows: p.ngram_embedding.rows(),
        })
    }

    /// A fresh state: the context all end-of-text, the conv history zero.
    pub(crate) fn new_state(&self, ctx: &Launch) -> Result<DevPleState, CudaError> {
        Ok(DevPleState {
            context: vec![self.cfg.eos_token_id; self.context_len()],
            conv: zeros(&ctx.dev, self.conv_len(&ctx.cfg))?,
        })
    }

    /// Tokens of a state's host-side n-gram context.
    pub(crate) fn context_len(&self) -> usize {
        self.cfg.ngram_size - 1
    }

    /// The f32 values of a state's conv history, as allocated (at least one).
    pub(crate) fn conv_len(&self, cfg: &ModelConfig) -> usize {
        (self.cfg.conv_state_len() * cfg.hc_dim()).max(1)
    }

    /// Table rows of the PLE hash heads for `tokens`, advancing the host-side n-gram context of `st`.
    ///
    /// Errors: a row past the table (a table shorter than the hash space).
    pub(crate) fn ngram_rows(&self, st: &mut DevPleState, tokens: &[u32]) -> Result<Vec<i32>, CudaError> {
        let rows = crate::model::ple::ngram_rows(&self.cfg, &st.context, tokens);
        let ctx = st.context.len();
        let mut hist = st.context.clone();
        hist.extend_from_slice(tokens);
        st.context.copy_from_slice(&hist[hist.len() - ctx..]);
        let table_rows = self.table_rows as u64;
        rows.iter()
            .map(|&r| {
                if r < table_rows {
                    Ok(r as i32)
                } else {
                    Err(CudaError::Unsupported(format!("n-gram row {r} past the table of {table_rows} rows")))
                }
            })
            .collect()
    }

    /// The PLE block over the `n` rows of several sequences (`seqs` cover the rows in order, each with its own
    /// conv history): the n-gram rows, projections, gate and norms over all rows at once, the causal conv per
    /// sequence, then the residual add into `x`. The n-gram rows `rows` of all `n` rows are gathered from the
    /// device table, or, in hybrid mode, are `emb` (decoded on the host and uploaded, `[n, heads * head_dim]`);
    /// `rec` (a verify pass, one sequence) receives the conv inputs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_seqs(
        &self,
        ctx: &Launch,
        seqs: &[Seq<'_, CudaSlice<f32>>],
        x: u64,
        rows: u64,
        emb: Option<u64>,
        n: usize,
        rec: Option<u64>,
    ) -> Result<(), CudaError> {
        let ple = self;
        let dev = &ctx.dev;
        let cfg = &ctx.cfg;
        let (s, d) = (cfg.hc_count, cfg.hidden);
        let dim = s * d;
        let heads = ple.cfg.n_heads();
        let pe = heads * ple.cfg.head_dim;
        let emb = match (emb, &ple.ngram_embedding) {
            (Some(e), _) => e,
            (None, Some(table)) => {
                let e = ctx.tmp(n * pe)?;
                ctx.get_rows(table, rows, n * heads, e, ple.cfg.head_dim, 1)?;
                e
            }
            (None, None) => {
                return Err(CudaError::Unsupported("the n-gram rows of a host-side table were not uploaded".into()));
            }
        };
        let key = ctx.tmp(n * dim)?;
        ctx.matmul(ple.key_proj.view(dev), emb, n, key)?;
        let value = ctx.tmp(n * d)?;
        ctx.matmul(ple.value_proj.view(dev), emb, n, value)?;
        ctx.rms_norm(key, ctx.addr(&ple.norm_key, 0), key, n * s, d, s)?;
        let qn = ctx.tmp(n * dim)?;
        ctx.rms_norm(x, ctx.addr(&ple.norm_query, 0), qn, n * s, d, s)?;
        let u = ctx.tmp(n * dim)?;
        dev.launch(
            "ple_gate",
            ((n * s) as u32, 1, 1),
            128,
            &[Arg::Ptr(key), Arg::Ptr(qn), Arg::Ptr(value), Arg::Ptr(u), Arg::I32(s as i32), Arg::I32(d as i32)],
        )?;
        let nrm = ctx.tmp(n * dim)?;
        ctx.rms_norm(u, ctx.addr(&ple.norm_conv, 0), nrm, n * s, d, s)?;
        if let Some(r) = rec {
            ctx.dtod(r, nrm, n * dim)?;
        }
        for q in seqs {
            ple.conv_rows(ctx, q.st, q.row(nrm, dim), q.row(u, dim), q.n)?;
        }
        dev.launch_1d("add_inplace", n * dim, &[Arg::Ptr(x), Arg::Ptr(u), Arg::I64((n * dim) as i64)])?;
        Ok(())
    }

    /// The PLE causal conv over `n` normalised rows `nrm` (`[n, S*d]`) into `u`, updating the conv state (the
    /// part of the PLE block a verify rollback replays).
    pub(crate) fn conv_rows(
        &self,
        ctx: &Launch,
        conv_state: &CudaSlice<f32>,
        nrm: u64,
        u: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let ple = self;
        let dim = ctx.cfg.hc_dim();
        if ple.cfg.conv_state_len() + 1 > 32 {
            return Err(CudaError::Unsupported("PLE conv history over 31 steps".into()));
        }
        ctx.dev.launch(
            "ple_conv",
            (dim.div_ceil(256) as u32, 1, 1),
            256,
            &[
                Arg::Ptr(nrm),
                Arg::Ptr(ctx.addr(conv_state, 0)),
                Arg::Ptr(ctx.addr(&ple.conv1d, 0)),
                Arg::Ptr(u),
                Arg::I32(n as i32),
                Arg::I32(dim as i32),
                Arg::I32(ple.cfg.conv_kernel as i32),
                Arg::I32(ple.cfg.ngram_size as i32),
            ],
        )?;
        Ok(())
    }
}
