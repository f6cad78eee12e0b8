//! The gated hyper-connection residual on the device (`hc_norm`, `hc_acts`, `hc_mix`, kernels/cuda/
//! hyper_connection.cu), as `crate::model::hyper_connection`: the bundle's RMS norm, the low-rank mixing
//! projections (`input_mix_weight_down`/`_up`) and, for a block's mixer, the injection weights the block's output
//! is added with.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::device::Arg;
use super::gemv::{Acts, PRO_MAX_COLS, Pro};
use super::launch::Launch;
use super::weights::{DevMatrix, Uploader};
use crate::gguf::GgmlType;
use crate::model::hyper_connection::GatedResidual;

/// Values of a row each `hc_norm` thread keeps in registers (`HC_NORM_PER_THREAD` in hyper_connection.cu).
const HC_NORM_PER_THREAD: usize = 4;

/// One hyper-connection mixer on the device (`crate::model::hyper_connection::GatedResidual`).
pub(crate) struct DevGatedResidual {
    /// `[S*d]`.
    pub(crate) hc_norm: CudaSlice<f32>,
    /// The down projection `[rank, S * d]`, with the injection's `S` rows stacked under it when `block_inject` is
    /// [`BlockInject::Stacked`] (one GEMV for both).
    pub(crate) input_mix_weight_down: DevMatrix,
    /// Rows of the down projection proper.
    pub(crate) rank: usize,
    /// `[S * d, rank]`.
    pub(crate) input_mix_weight_up: DevMatrix,
    pub(crate) block_inject: BlockInject,
}

/// Where a mixer's injection projection (`block_inject_weight`) lives on the device.
pub(crate) enum BlockInject {
    /// The mixer does not inject (the final mixer).
    None,
    /// Under the down projection's rows in `input_mix_weight_down` (same type and width).
    Stacked,
    /// A matrix of its own (its type differs from the down projection's).
    Separate(DevMatrix),
}

/// What a mixer returns (device addresses of arena temporaries): the block's input and its injection weights.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MixedInput {
    /// `[n][d]`.
    pub(crate) mixed: u64,
    /// `[n][S]`, when the mixer injects.
    pub(crate) inject: Option<u64>,
}

impl DevGatedResidual {
    /// Uploads `g`, whose tensors are `{prefix}_norm`, `{prefix}_down`, `{prefix}_up`, `{prefix}_inject`.
    pub(crate) fn upload(up: &mut Uploader<'_>, g: &GatedResidual, prefix: &str) -> Result<Self, CudaError> {
        let down = &g.input_mix_weight_down;
        let down_name = format!("{prefix}_down");
        let (down_dev, block_inject) = match &g.block_inject_weight {
            None => (up.matrix(down, &down_name)?, BlockInject::None),
            Some(inj) => match up.pair((down, &down_name), (inj, &format!("{prefix}_inject")))? {
                (both, None) => (both, BlockInject::Stacked),
                (down, Some(inj)) => (down, BlockInject::Separate(inj)),
            },
        };
        Ok(Self {
            hc_norm: up.vector(&g.hc_norm)?,
            input_mix_weight_down: down_dev,
            rank: down.rows(),
            input_mix_weight_up: up.matrix(&g.input_mix_weight_up, &format!("{prefix}_up"))?,
            block_inject,
        })
    }

    /// The mixer on the bundle `x` (`[n][S*d]`): returns the mixed input `m` (`[n][d]`) and, when the mixer
    /// injects, the injection weights `a` (`[n][S]`). `m_for` is the type of the
    /// first matrix that multiplies `m`: its 8-bit form is written by the mixing kernel itself (no separate
    /// `quantize_act`). With `residual = Some((y, a))` the residual update of the block before
    /// (`X[t][s] += a[t][s] * y[t]`) is fused into the norm. Down and injection projections run as one
    /// stacked GEMV when they share a type ([`BlockInject::Stacked`]), on one quantization of the normalised bundle.
    pub(crate) fn forward(
        &self,
        ctx: &Launch,
        x: u64,
        n: usize,
        m_for: Option<GgmlType>,
        residual: Option<(u64, u64)>,
    ) -> Result<MixedInput, CudaError> {
        let hc = self;
        let dev = &ctx.dev;
        let cfg = &ctx.cfg;
        let (s, d) = (cfg.hc_count, cfg.hidden);
        let dim = s * d;
        let inv_s = 1.0 / s as f32;
        let xn = ctx.tmp(n * dim)?;
        let q_xn = ctx.q8_outputs(hc.input_mix_weight_down.ty, n * s, d)?;
        // Quantizing blocks of up to 256 values: whole multiples of 256 threads.
        let threads = Launch::norm_threads(d, if q_xn.is_some() { 256 } else { 32 });
        if d > HC_NORM_PER_THREAD * threads {
            return Err(CudaError::Unsupported(format!(
                "a hidden width of {d} in the hyper-connection norm (at most {} values per row)",
                HC_NORM_PER_THREAD * threads
            )));
        }
        let (y, ya) = residual.unwrap_or((0, 0));
        dev.launch(
            "hc_norm",
            ((n * s) as u32, 1, 1),
            threads as u32,
            &[
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(y),
                    Arg::Ptr(ya),
                    Arg::Ptr(ctx.addr(&hc.hc_norm, 0)),
                    Arg::Ptr(xn),
                    Arg::I32(s as i32),
                    Arg::I32(d as i32),
                    Arg::F32(cfg.rms_eps),
                ][..],
                &Launch::q8_args(q_xn),
            ]
            .concat(),
        )?;
        // The quantization blocks of a [n*S][d] view are those of the [n][S*d] rows the GEMVs read.
        ctx.q8_produced(xn, n, dim, q_xn);
        let rank = hc.rank;
        let fused_up = n == 1
            && ctx.flags.gemv_prologue
            && rank <= PRO_MAX_COLS
            && matches!(hc.block_inject, BlockInject::Stacked)
            && ctx.q8_block(hc.input_mix_weight_up.ty, rank).is_some();
        // The low-rank activation and its 8-bit form, written by hc_acts / hc_low_act (not when fused).
        let (low, q_low) = if fused_up {
            (0, None)
        } else {
            (ctx.tmp(n * rank)?, ctx.q8_outputs(hc.input_mix_weight_up.ty, n, rank)?)
        };
        let g = ctx.tmp(n * dim)?;
        let a = match &hc.block_inject {
            BlockInject::Stacked if fused_up => {
                // One token: the up projection's blocks compute silu(y / S) themselves (and block 0 the injection
                // weights), so no hc_acts launch.
                let both = ctx.tmp(hc.input_mix_weight_down.rows)?;
                ctx.matmul(hc.input_mix_weight_down.view(dev), xn, 1, both)?;
                let a = ctx.tmp(s)?;
                let blk = ctx.q8_block(hc.input_mix_weight_up.ty, rank).expect("checked above");
                let pro = Pro { x: both, x2: 0, scale: inv_s, blk, aux: a, aux_n: s };
                ctx.gemv(hc.input_mix_weight_up.view(dev), Acts::Pro(pro), 1, g)?;
                Some(a)
            }
            BlockInject::Stacked => {
                let both = ctx.tmp(n * hc.input_mix_weight_down.rows)?;
                ctx.matmul(hc.input_mix_weight_down.view(dev), xn, n, both)?;
                let a = ctx.tmp(n * s)?;
                dev.launch_1d(
                    "hc_acts",
                    n * rank.max(s),
                    &[
                        &[
                            Arg::Ptr(both),
                            Arg::Ptr(low),
                            Arg::Ptr(a),
                            Arg::I32(n as i32),
                            Arg::I32(rank as i32),
                            Arg::I32(s as i32),
                        ][..],
                        &Launch::q8_args(q_low),
                    ]
                    .concat(),
                )?;
                Some(a)
            }
            inject => {
                ctx.matmul(hc.input_mix_weight_down.view(dev), xn, n, low)?;
                let a = match inject {
                    BlockInject::None | BlockInject::Stacked => None,
                    BlockInject::Separate(wi) => {
                        let a = ctx.tmp(n * s)?;
                        ctx.matmul(wi.view(dev), xn, n, a)?;
                        dev.launch_1d(
                            "hc_inject_act",
                            n * s,
                            &[Arg::Ptr(a), Arg::I64((n * s) as i64), Arg::F32(inv_s)],
                        )?;
                        Some(a)
                    }
                };
                dev.launch_1d(
                    "hc_low_act",
                    n * rank,
                    &[&[Arg::Ptr(low), Arg::I64((n * rank) as i64), Arg::F32(inv_s)][..], &Launch::q8_args(q_low)]
                        .concat(),
                )?;
                a
            }
        };
        if !fused_up {
            ctx.q8_produced(low, n, rank, q_low);
            ctx.matmul(hc.input_mix_weight_up.view(dev), low, n, g)?;
        }
        let m = ctx.tmp(n * d)?;
        let q_m = match m_for {
            Some(ty) => ctx.q8_outputs(ty, n, d)?,
            None => None,
        };
        dev.launch_1d(
            "hc_mix",
            n * d,
            &[
                &[Arg::Ptr(g), Arg::Ptr(xn), Arg::Ptr(m), Arg::I32(n as i32), Arg::I32(s as i32), Arg::I32(d as i32)][..],
                &Launch::q8_args(q_m),
            ]
            .concat(),
        )?;
        ctx.q8_produced(m, n, d, q_m);
        Ok(MixedInput { mixed: m, inject: a })
    }
}
