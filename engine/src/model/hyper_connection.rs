//! Hyper-connections: the 4-stream residual bundle and its gated mixer (`Qwen4ExpTextGatedResidual`,
//! transformers' `modeling_qwen4_exp.py`).
//!
//! For a bundle `X` of `S` streams of width `d`: `Xn = G(X)` (grouped RMS norm), `l = silu(W_down Xn / S)`,
//! `g = sigmoid(W_up l)`, block input `m = (1/S) sum_s g_s * Xn_s`, injection `a = 2 sigmoid(W_inj Xn / S)`;
//! after the block `f`: `X_s += a_s * f(m)`. The final mixer stops at `m`.

use crate::quant::Matrix;

use super::error::ModelError;
use super::norm::{grouped_rms_norm_into, sigmoid, silu};
use super::weights::TensorLoader;

/// One gated residual (`attn_hyper_connection`, `mlp_hyper_connection`, or the final `hyper_connection_mixer`).
#[derive(Debug, Clone)]
pub struct GatedResidual {
    pub(crate) hc_norm: Vec<f32>,
    pub(crate) input_mix_weight_down: Matrix,
    pub(crate) input_mix_weight_up: Matrix,
    pub(crate) block_inject_weight: Option<Matrix>,
    pub(crate) streams: usize,
    pub(crate) hidden: usize,
    pub(crate) eps: f32,
}

/// The block input and injection weights computed from a bundle.
pub struct MixedInput {
    /// `m`, `[T, hidden]`.
    pub mixed: Vec<f32>,
    /// `a`, `[T, streams]` (empty for the final mixer).
    pub inject: Vec<f32>,
}

impl GatedResidual {
    /// Loads `{prefix}_norm/_down/_up[/_inject].weight`, e.g. prefix `blk.3.hc_attn` or `output_hc`.
    pub fn load(
        w: &TensorLoader,
        prefix: &str,
        streams: usize,
        hidden: usize,
        rank: usize,
        with_inject: bool,
        eps: f32,
    ) -> Result<Self, ModelError> {
        let dim = streams * hidden;
        Ok(Self {
            hc_norm: w.vector(&format!("{prefix}_norm.weight"), dim)?,
            input_mix_weight_down: w.matrix(&format!("{prefix}_down.weight"), rank, dim)?,
            input_mix_weight_up: w.matrix(&format!("{prefix}_up.weight"), dim, rank)?,
            block_inject_weight: if with_inject {
                Some(w.matrix(&format!("{prefix}_inject.weight"), streams, dim)?)
            } else {
                None
            },
            streams,
            hidden,
            eps,
        })
    }

    /// Computes the block input `m` (and the injection weights) for `n` tokens of the bundle `x` (`[n, S*d]`).
    pub fn mix(&self, x: &[f32], n: usize) -> MixedInput {
        let (s, d) = (self.streams, self.hidden);
        let dim = s * d;
        let mut xn = vec![0f32; n * dim];
        for (xt, ot) in x.chunks_exact(dim).zip(xn.chunks_exact_mut(dim)) {
            grouped_rms_norm_into(xt, &self.hc_norm, d, self.eps, ot);
        }
        let rank = self.input_mix_weight_down.rows();
        let mut low = vec![0f32; n * rank];
        self.input_mix_weight_down.matmul(&xn, n, &mut low);
        let inv_s = 1.0 / s as f32;
        for v in &mut low {
            *v = silu(*v * inv_s);
        }
        let mut gate = vec![0f32; n * dim];
        self.input_mix_weight_up.matmul(&low, n, &mut gate);
        let mut mixed = vec![0f32; n * d];
        for t in 0..n {
            let g = &gate[t * dim..(t + 1) * dim];
            let xt = &xn[t * dim..(t + 1) * dim];
            let m = &mut mixed[t * d..(t + 1) * d];
            for i in 0..d {
                let mut acc = 0f32;
                for st in 0..s {
                    acc += sigmoid(g[st * d + i]) * xt[st * d + i];
                }
                m[i] = acc * inv_s;
            }
        }
        let inject = match &self.block_inject_weight {
            None => Vec::new(),
            Some(wi) => {
                let mut a = vec![0f32; n * s];
                wi.matmul(&xn, n, &mut a);
                for v in &mut a {
                    *v = 2.0 * sigmoid(*v * inv_s);
                }
                a
            }
        };
        MixedInput { mixed, inject }
    }

    /// `X_s += a_s * y` for every token: the residual update after a block (`y` is `[n, d]`, `inject` `[n, S]`).
    pub fn inject(&self, x: &mut [f32], y: &[f32], inject: &[f32]) {
        let (s, d) = (self.streams, self.hidden);
        for ((xt, yt), at) in x.chunks_exact_mut(s * d).zip(y.chunks_exact(d)).zip(inject.chunks_exact(s)) {
            for (st, &a) in at.iter().enumerate() {
                for (xv, &yv) in xt[st * d..(st + 1) * d].iter_mut().zip(yt) {
                    *xv += yv * a;
                }
            }
        }
    }
}
