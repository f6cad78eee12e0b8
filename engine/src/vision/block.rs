//! `Qwen4ExpVisionBlock`: pre-norm residual block, `x + attn(norm1(x))` then `x + mlp(norm2(x))`, LayerNorms
//! with weight and bias.

use crate::model::ModelError;
use crate::model::weights::TensorLoader;

use super::attention::VisionAttention;
use super::config::VisionConfig;
use super::mlp::VisionMlp;
use super::{LayerNorm, layer_norm_rows};

/// One block of the tower.
#[derive(Debug, Clone)]
pub struct VisionBlock {
    pub(crate) norm1: LayerNorm,
    pub(crate) norm2: LayerNorm,
    pub(crate) attn: VisionAttention,
    pub(crate) mlp: VisionMlp,
}

impl VisionBlock {
    /// Loads block `b` (`v.blk.{b}.{ln1,ln2,attn_*,ffn_*}`).
    ///
    /// Errors: a tensor missing, of another shape or type (named).
    pub fn load(w: &TensorLoader, cfg: &VisionConfig, b: usize) -> Result<Self, ModelError> {
        Ok(Self {
            norm1: LayerNorm::load(w, &format!("v.blk.{b}.ln1"), cfg.hidden, cfg.eps)?,
            norm2: LayerNorm::load(w, &format!("v.blk.{b}.ln2"), cfg.hidden, cfg.eps)?,
            attn: VisionAttention::load(w, cfg, b)?,
            mlp: VisionMlp::load(w, cfg, b)?,
        })
    }

    /// Runs the block on `x` (`[n, hidden]`) in place.
    pub fn forward(
        &self,
        x: &mut [f32],
        n: usize,
        segments: &[std::ops::Range<usize>],
        angles: &[(Vec<f32>, Vec<f32>)],
    ) {
        let h = layer_norm_rows(&self.norm1, x);
        let a = self.attn.forward(&h, n, segments, angles);
        for (v, d) in x.iter_mut().zip(&a) {
            *v += d;
        }
        let h = layer_norm_rows(&self.norm2, x);
        let m = self.mlp.forward(&h, n);
        for (v, d) in x.iter_mut().zip(&m) {
            *v += d;
        }
    }
}
