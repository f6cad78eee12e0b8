//! `Qwen4ExpVisionPatchMerger` (without post-shuffle norm): LayerNorm of every patch, then each `merge x merge`
//! square of patches (contiguous in the patch order) concatenated into one `merge^2 * hidden` row, `linear_fc2(
//! GELU(linear_fc1(row)))` with the exact (erf) GELU of `nn.GELU()`, giving one language-model token per square.

use crate::model::ModelError;
use crate::model::weights::TensorLoader;
use crate::quant::Matrix;

use super::config::VisionConfig;
use super::{LayerNorm, gelu_erf, layer_norm_rows, linear};

/// The merger.
#[derive(Debug, Clone)]
pub struct PatchMerger {
    pub(crate) norm: LayerNorm,
    pub(crate) linear_fc1: Matrix,
    pub(crate) fc1_bias: Vec<f32>,
    pub(crate) linear_fc2: Matrix,
    pub(crate) fc2_bias: Vec<f32>,
    pub(crate) merged: usize,
}

impl PatchMerger {
    /// Loads `v.post_ln.*` (the merger's `norm`), `mm.0.*` (`linear_fc1`) and `mm.2.*` (`linear_fc2`).
    ///
    /// Errors: a tensor missing, of another shape or type (named).
    pub fn load(w: &TensorLoader, cfg: &VisionConfig) -> Result<Self, ModelError> {
        let m = cfg.hidden * cfg.merge * cfg.merge;
        Ok(Self {
            norm: LayerNorm::load(w, "v.post_ln", cfg.hidden, cfg.eps)?,
            linear_fc1: w.matrix("mm.0.weight", m, m)?,
            fc1_bias: w.vector("mm.0.bias", m)?,
            linear_fc2: w.matrix("mm.2.weight", cfg.out_hidden, m)?,
            fc2_bias: w.vector("mm.2.bias", cfg.out_hidden)?,
            merged: m,
        })
    }

    /// `[n, hidden]` patches (`n` a multiple of `merge^2`) to `[n / merge^2, out_hidden]` features.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let h = layer_norm_rows(&self.norm, x);
        let tokens = h.len() / self.merged;
        let mut a = linear(&self.linear_fc1, &self.fc1_bias, &h, tokens);
        for v in &mut a {
            *v = gelu_erf(*v);
        }
        linear(&self.linear_fc2, &self.fc2_bias, &a, tokens)
    }
}
