//! Gated DeltaNet (`linear_attn` in the reference) on the device (kernels/cuda/gdn.cu), as
//! `crate::model::linear_attn`: the input projections, the causal conv + SiLU, the gates, the delta-rule
//! recurrence over the per-head state, the gated RMS norm and the output projection.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::device::Arg;
use super::gemv::Acts;
use super::launch::{Launch, Seq};
use super::memory::zeros;
use super::weights::{DevMatrix, MatRef, Uploader};
use crate::gguf::GgmlType;
use crate::model::GateActivation;
use crate::model::config::ModelConfig;
use crate::model::linear_attn::GatedDeltaNet;

/// One Gated DeltaNet token mixer on the device (`crate::model::linear_attn::GatedDeltaNet`).
pub(crate) struct DevGatedDeltaNet {
    /// The input projections `in_proj_qkv` `[C, d]` and `in_proj_z` `[vd, d]` stacked (`[C + vd, d]`, one
    /// decode GEMV for both) when the two share a type; `in_proj_qkv` alone otherwise, with `in_proj_z` in
    /// `separate_z`.
    pub(crate) in_proj_qkvz: DevMatrix,
    pub(crate) separate_z: Option<DevMatrix>,
    /// Rows of `in_proj_qkv` (`C`).
    pub(crate) qkv_rows: usize,
    pub(crate) in_proj_b: DevMatrix,
    pub(crate) in_proj_a: DevMatrix,
    /// `[C, kernel]`.
    pub(crate) conv1d: CudaSlice<f32>,
    pub(crate) dt_bias: CudaSlice<f32>,
    /// `-exp(A_log)`.
    pub(crate) a: CudaSlice<f32>,
    pub(crate) norm: CudaSlice<f32>,
    pub(crate) out_proj: DevMatrix,
    /// The output gate is SiLU (else sigmoid).
    pub(crate) silu_gate: bool,
}

/// One Gated DeltaNet layer's state of a sequence on the device (`crate::model::linear_attn::GdnState`).
pub(crate) struct GdnState {
    /// The conv's last `kernel - 1` inputs, `[kernel - 1, C]`.
    pub(crate) conv: CudaSlice<f32>,
    /// The per-head recurrent state, `[Hv, dk, dk]`.
    pub(crate) recurrent: CudaSlice<f32>,
}

/// Where a verify pass records a layer's recurrence inputs (device addresses): the pre-conv `qkv` `[n, C]`,
/// `beta` and `g` `[n, Hv]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GdnRecording {
    pub(crate) qkv: u64,
    pub(crate) beta: u64,
    pub(crate) g: u64,
}

/// The arguments of the Gated DeltaNet gates (`gdn_ba_gates`, and the tail of `gdn_conv_gates`'s): the device
/// addresses `[m, Wb, Wa, A, dt_bias, beta, g]`, then `nv` value heads and the width `d`.
fn gdn_gate_args(p: [u64; 7], nv: usize, d: usize) -> [Arg; 9] {
    let [m, wb, wa, a, dt_bias, beta, g] = p;
    [
        Arg::Ptr(m),
        Arg::Ptr(wb),
        Arg::Ptr(wa),
        Arg::Ptr(a),
        Arg::Ptr(dt_bias),
        Arg::Ptr(beta),
        Arg::Ptr(g),
        Arg::I32(nv as i32),
        Arg::I32(d as i32),
    ]
}

impl GdnState {
    /// A zeroed state for the model's shapes.
    pub(crate) fn new(ctx: &Launch) -> Result<Self, CudaError> {
        let [conv, recurrent] = Self::lens(&ctx.cfg);
        Ok(Self { conv: zeros(&ctx.dev, conv)?, recurrent: zeros(&ctx.dev, recurrent)? })
    }

    /// The f32 values of the conv and recurrent state, as allocated (at least one each).
    pub(crate) fn lens(cfg: &ModelConfig) -> [usize; 2] {
        [(cfg.ssm_conv_kernel - 1) * cfg.ssm_conv_dim(), cfg.ssm_v_heads * cfg.ssm_head_dim * cfg.ssm_head_dim]
            .map(|v| v.max(1))
    }
}

impl DevGatedDeltaNet {
    /// Uploads `g`, layer `layer`'s mixer (tensors `blk.{layer}.attn_qkv`, `attn_gate`, `ssm_*`).
    pub(crate) fn upload(up: &mut Uploader<'_>, g: &GatedDeltaNet, layer: usize) -> Result<Self, CudaError> {
        let p = format!("blk.{layer}");
        let (in_proj_qkvz, separate_z) =
            up.pair((&g.in_proj_qkv, &format!("{p}.attn_qkv")), (&g.in_proj_z, &format!("{p}.attn_gate")))?;
        Ok(Self {
            in_proj_qkvz,
            separate_z,
            qkv_rows: g.in_proj_qkv.rows(),
            in_proj_b: up.matrix(&g.in_proj_b, &format!("{p}.ssm_beta"))?,
            in_proj_a: up.matrix(&g.in_proj_a, &format!("{p}.ssm_alpha"))?,
            conv1d: up.vector(&g.conv1d)?,
            dt_bias: up.vector(&g.dt_bias)?,
            a: up.vector(&g.a)?,
            norm: up.vector(&g.norm)?,
            out_proj: up.matrix(&g.out_proj, &format!("{p}.ssm_out"))?,
            silu_gate: g.gate == GateActivation::Silu,
        })
    }

    /// `in_proj_qkv` `[C, d]`.
    fn in_proj_qkv(&self, dev: &super::device::Dev) -> MatRef {
        self.in_proj_qkvz.view(dev).top(self.qkv_rows)
    }

    /// `in_proj_z` `[vd, d]` (the rows under `in_proj_qkv` when stacked).
    fn in_proj_z(&self, dev: &super::device::Dev) -> MatRef {
        match &self.separate_z {
            Some(z) => z.view(dev),
            None => self.in_proj_qkvz.view(dev).below(self.qkv_rows),
        }
    }

    /// The type of the first matrix that multiplies the block's input (its 8-bit form is written by the mixer).
    pub(crate) fn input_type(&self) -> GgmlType {
        self.in_proj_qkvz.ty
    }

    /// The Gated DeltaNet input projections of `n` tokens `m`: (`qkv` `[n, C]`, `z` `[n, vd]`). One token with
    /// the two stacked ([`DevGatedDeltaNet`]) and the same threads per row for each alone is one GEMV launch (each
    /// row's sum is the one its matrix's own launch computes, so batch invariance holds); otherwise two.
    pub(crate) fn in_proj(&self, ctx: &Launch, m: u64, n: usize) -> Result<(u64, u64), CudaError> {
        let dev = &ctx.dev;
        let g = self;
        let (qm, zm) = (g.in_proj_qkv(dev), g.in_proj_z(dev));
        if n == 1 && g.separate_z.is_none() && ctx.flags.fuse.qkvz {
            let xa = ctx.acts(qm.ty, m, 1, qm.cols)?;
            let tasks = Launch::tasks_per_row(qm.ty, qm.cols, !matches!(xa, Acts::F32(..)));
            if ctx.dense_lanes(tasks, qm.rows) == ctx.dense_lanes(tasks, zm.rows) {
                let both = ctx.tmp(qm.rows + zm.rows)?;
                ctx.gemv_as(g.in_proj_qkvz.view(dev), xa, 1, both, qm.rows)?;
                return Ok((both, both + (4 * qm.rows) as u64));
            }
        }
        let qkv = ctx.tmp(n * qm.rows)?;
        ctx.matmul(qm, m, n, qkv)?;
        let z = ctx.tmp(n * zm.rows)?;
        ctx.matmul(zm, m, n, z)?;
        Ok((qkv, z))
    }

    /// Gated DeltaNet over the `n` rows `m` of several sequences (`seqs` cover the rows in order, each with its
    /// own conv and recurrent state): the input projections, gates, gated norm and output projection over all
    /// rows at once, the conv and the delta-rule recurrence per sequence, updating each state in place. Returns
    /// the output `[n, d]`. With `rec` (a verify pass, one sequence), the recurrences' inputs are copied there:
    /// pre-conv `qkv` `[n, C]`, `beta` and `g` `[n, Hv]`.
    pub(crate) fn forward_seqs(
        &self,
        ctx: &Launch,
        m: u64,
        n: usize,
        seqs: &[Seq<'_, GdnState>],
        rec: Option<GdnRecording>,
    ) -> Result<u64, CudaError> {
        let g = self;
        let dev = &ctx.dev;
        let cfg = &ctx.cfg;
        let (nv, dk) = (cfg.ssm_v_heads, cfg.ssm_head_dim);
        let c = cfg.ssm_conv_dim();
        let (qkv, z) = g.in_proj(ctx, m, n)?;
        let beta = ctx.tmp(n * nv)?;
        let gg = ctx.tmp(n * nv)?;
        let (a_neg_exp, dt_bias) = (ctx.addr(&g.a, 0), ctx.addr(&g.dt_bias, 0));
        // With f32 b and a projections, the gates are computed by blocks of the conv launch (gdn_mix).
        let f32_gates =
            g.in_proj_b.ty == GgmlType::F32 && g.in_proj_a.ty == GgmlType::F32 && cfg.hidden.is_multiple_of(4);
        let fused = f32_gates && ctx.flags.fuse.gates;
        if f32_gates && !fused {
            let args = gdn_gate_args(
                [m, g.in_proj_b.view(dev).ptr, g.in_proj_a.view(dev).ptr, a_neg_exp, dt_bias, beta, gg],
                nv,
                cfg.hidden,
            );
            dev.launch("gdn_ba_gates", (nv as u32, n as u32, 1), 64, &args)?;
        } else if !f32_gates {
            let b = ctx.tmp(n * nv)?;
            ctx.matmul(g.in_proj_b.view(dev), m, n, b)?;
            let a = ctx.tmp(n * nv)?;
            ctx.matmul(g.in_proj_a.view(dev), m, n, a)?;
            dev.launch_1d(
                "gdn_gates",
                n * nv,
                &[
                    Arg::Ptr(b),
                    Arg::Ptr(a),
                    Arg::Ptr(a_neg_exp),
                    Arg::Ptr(dt_bias),
                    Arg::Ptr(beta),
                    Arg::Ptr(gg),
                    Arg::I32(n as i32),
                    Arg::I32(nv as i32),
                ],
            )?;
        }
        if let Some(r) = rec {
            ctx.dtod(r.qkv, qkv, n * c)?;
        }
        let o = ctx.tmp(n * nv * dk)?;
        for s in seqs {
            // The fused gates read the sequence's own rows of the block input.
            let gates = fused.then(|| {
                [s.row(m, cfg.hidden), g.in_proj_b.view(dev).ptr, g.in_proj_a.view(dev).ptr, a_neg_exp, dt_bias]
            });
            let (qkv_s, beta_s, gg_s) = (s.row(qkv, c), s.row(beta, nv), s.row(gg, nv));
            g.recurrence_into(ctx, s.st, qkv_s, beta_s, gg_s, s.n, gates, s.row(o, nv * dk))?;
        }
        if let Some(r) = rec {
            // The recurrence reads beta and g without writing them.
            ctx.dtod(r.beta, beta, n * nv)?;
            ctx.dtod(r.g, gg, n * nv)?;
        }
        dev.launch(
            "gdn_gated_norm",
            ((n * nv) as u32, 1, 1),
            128,
            &[
                Arg::Ptr(o),
                Arg::Ptr(z),
                Arg::Ptr(ctx.addr(&g.norm, 0)),
                Arg::I32((n * nv) as i32),
                Arg::I32(dk as i32),
                Arg::F32(cfg.rms_eps),
                Arg::I32(g.silu_gate as i32),
            ],
        )?;
        let y = ctx.tmp(n * cfg.hidden)?;
        ctx.matmul(g.out_proj.view(dev), o, n, y)?;
        Ok(y)
    }

    /// The recurrent part of Gated DeltaNet over `n` tokens: causal conv + SiLU on the pre-conv `qkv` (`[n, C]`,
    /// in place, conv state updated), the q/k L2 norms, and the delta-rule recurrence from `beta`/`g` (`[n, Hv]`)
    /// updating the state; returns the per-head outputs `[n, Hv * dk]`. A verify rollback replays exactly this.
    /// With `gates = Some([m, Wb, Wa, A, dt_bias])` (f32 projections), blocks of the conv launch first write
    /// `beta` and `g` from the block input `m` (`gdn_conv_gates`: one launch fewer).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn recurrence(
        &self,
        ctx: &Launch,
        st: &GdnState,
        qkv: u64,
        beta: u64,
        gg: u64,
        n: usize,
        gates: Option<[u64; 5]>,
    ) -> Result<u64, CudaError> {
        let cfg = &ctx.cfg;
        let o = ctx.tmp(n * cfg.ssm_v_heads * cfg.ssm_head_dim)?;
        self.recurrence_into(ctx, st, qkv, beta, gg, n, gates, o)?;
        Ok(o)
    }

    /// [`Self::recurrence`] writing the per-head outputs into `o` (`[n, Hv * dk]`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn recurrence_into(
        &self,
        ctx: &Launch,
        st: &GdnState,
        qkv: u64,
        beta: u64,
        gg: u64,
        n: usize,
        gates: Option<[u64; 5]>,
        o: u64,
    ) -> Result<(), CudaError> {
        let dev = &ctx.dev;
        let cfg = &ctx.cfg;
        let g = self;
        let GdnState { conv, recurrent } = st;
        let (nk, nv, dk) = (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_dim);
        let c = cfg.ssm_conv_dim();
        let conv_args = [Arg::Ptr(qkv), Arg::Ptr(ctx.addr(conv, 0)), Arg::Ptr(ctx.addr(&g.conv1d, 0))];
        let shape = [Arg::I32(n as i32), Arg::I32(c as i32), Arg::I32(cfg.ssm_conv_kernel as i32)];
        match gates {
            None => dev.launch("gdn_conv", (c.div_ceil(64) as u32, 1, 1), 64, &[&conv_args[..], &shape].concat())?,
            Some([m, wb, wa, a_neg_exp, dt_bias]) => {
                let gate_args = gdn_gate_args([m, wb, wa, a_neg_exp, dt_bias, beta, gg], nv, cfg.hidden);
                let blocks = c.div_ceil(64) + nv * n;
                dev.launch("gdn_conv_gates", (blocks as u32, 1, 1), 64, &[&conv_args[..], &shape, &gate_args].concat())?
            }
        }
        // The q/k L2 norms (q scaled by 1/sqrt(dk)) happen inside the recurrence kernel.
        let kernel = match dk {
            128 => "gdn_recurrent_128",
            64 => "gdn_recurrent_64",
            32 => "gdn_recurrent_32",
            16 => "gdn_recurrent_16",
            other => {
                return Err(CudaError::Unsupported(format!("Gated DeltaNet heads of {other} dims (16, 32, 64, 128)")));
            }
        };
        // One warp per block: 32 / parts state columns, each column's dk rows split into parts of at most 32.
        let parts = dk / dk.min(32);
        let cols_per_warp = 32 / parts;
        dev.launch(
            kernel,
            (nv as u32, dk.div_ceil(cols_per_warp) as u32, 1),
            32,
            &[
                Arg::Ptr(qkv),
                Arg::Ptr(beta),
                Arg::Ptr(gg),
                Arg::Ptr(ctx.addr(recurrent, 0)),
                Arg::Ptr(o),
                Arg::I32(n as i32),
                Arg::I32(nk as i32),
                Arg::I32(nv as i32),
                Arg::I32(c as i32),
            ],
        )?;
        Ok(())
    }
}
