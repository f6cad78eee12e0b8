//! `Qwen4ExpVisionAttention`: fused `qkv` projection (with bias), 2-D rotary on q and k, softmax attention of
//! each patch over the patches of its own frame only (the reference's `cu_seqlens` segments: `h * w` patches per
//! temporal group), the output projection `proj` (with bias). No mask within a segment, scale `1/sqrt(hd)`.

use rayon::prelude::*;

use crate::model::ModelError;
use crate::model::norm::softmax;
use crate::model::weights::TensorLoader;
use crate::quant::Matrix;

use super::config::VisionConfig;
use super::linear;
use super::rotary_emb::VisionRotary;

/// One block's attention.
#[derive(Debug, Clone)]
pub struct VisionAttention {
    pub(crate) qkv: Matrix,
    pub(crate) qkv_bias: Vec<f32>,
    pub(crate) proj: Matrix,
    pub(crate) proj_bias: Vec<f32>,
    pub(crate) heads: usize,
}

impl VisionAttention {
    /// Loads `v.blk.{b}.attn_qkv.{weight,bias}` (`[3 hidden, hidden]`) and `v.blk.{b}.attn_out.{weight,bias}`.
    ///
    /// Errors: a tensor missing, of another shape or type (named).
    pub fn load(w: &TensorLoader, cfg: &VisionConfig, b: usize) -> Result<Self, ModelError> {
        let d = cfg.hidden;
        Ok(Self {
            qkv: w.matrix(&format!("v.blk.{b}.attn_qkv.weight"), 3 * d, d)?,
            qkv_bias: w.vector(&format!("v.blk.{b}.attn_qkv.bias"), 3 * d)?,
            proj: w.matrix(&format!("v.blk.{b}.attn_out.weight"), d, d)?,
            proj_bias: w.vector(&format!("v.blk.{b}.attn_out.bias"), d)?,
            heads: cfg.heads,
        })
    }

    /// Attention over `x` (`[n, hidden]`, normed): `segments` are the patch ranges that attend among themselves,
    /// `angles[i]` the rotary `(cos, sin)` of patch `i`. Returns `[n, hidden]`.
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        segments: &[std::ops::Range<usize>],
        angles: &[(Vec<f32>, Vec<f32>)],
    ) -> Vec<f32> {
        let d = self.proj_bias.len();
        let (nh, hd) = (self.heads, d / self.heads);
        let mut qkv = linear(&self.qkv, &self.qkv_bias, x, n);
        for (i, row) in qkv.chunks_exact_mut(3 * d).enumerate() {
            let (cos, sin) = &angles[i];
            for h in 0..nh {
                VisionRotary::apply(&mut row[h * hd..(h + 1) * hd], cos, sin);
                VisionRotary::apply(&mut row[d + h * hd..d + (h + 1) * hd], cos, sin);
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; n * d];
        for seg in segments {
            let len = seg.len();
            out[seg.start * d..seg.end * d].par_chunks_mut(d).enumerate().for_each(|(qi, o)| {
                let q_row = &qkv[(seg.start + qi) * 3 * d..];
                let mut scores = vec![0f32; len];
                for h in 0..nh {
                    let q = &q_row[h * hd..(h + 1) * hd];
                    for (j, s) in scores.iter_mut().enumerate() {
                        let k = &qkv[(seg.start + j) * 3 * d + d + h * hd..][..hd];
                        *s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                    }
                    softmax(&mut scores);
                    let oh = &mut o[h * hd..(h + 1) * hd];
                    for (j, &p) in scores.iter().enumerate() {
                        let v = &qkv[(seg.start + j) * 3 * d + 2 * d + h * hd..][..hd];
                        for (a, &b) in oh.iter_mut().zip(v) {
                            *a += p * b;
                        }
                    }
                }
            });
        }
        linear(&self.proj, &self.proj_bias, &out, n)
    }
}
