//! `Qwen4ExpVisionMLP`: `linear_fc2(gelu_tanh(linear_fc1(x)))`, both with bias (`hidden_act =
//! gelu_pytorch_tanh`).

use crate::model::ModelError;
use crate::model::weights::TensorLoader;
use crate::quant::Matrix;

use super::config::VisionConfig;
use super::{gelu_tanh, linear};

/// One block's MLP.
#[derive(Debug, Clone)]
pub struct VisionMlp {
    pub(crate) linear_fc1: Matrix,
    pub(crate) fc1_bias: Vec<f32>,
    pub(crate) linear_fc2: Matrix,
    pub(crate) fc2_bias: Vec<f32>,
}

impl VisionMlp {
    /// Loads `v.blk.{b}.ffn_up.*` (`linear_fc1`, `[intermediate, hidden]`) and `v.blk.{b}.ffn_down.*`.
    ///
    /// Errors: a tensor missing, of another shape or type (named).
    pub fn load(w: &TensorLoader, cfg: &VisionConfig, b: usize) -> Result<Self, ModelError> {
        let (d, f) = (cfg.hidden, cfg.intermediate);
        Ok(Self {
            linear_fc1: w.matrix(&format!("v.blk.{b}.ffn_up.weight"), f, d)?,
            fc1_bias: w.vector(&format!("v.blk.{b}.ffn_up.bias"), f)?,
            linear_fc2: w.matrix(&format!("v.blk.{b}.ffn_down.weight"), d, f)?,
            fc2_bias: w.vector(&format!("v.blk.{b}.ffn_down.bias"), d)?,
        })
    }

    /// `[n, hidden]` to `[n, hidden]`.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut h = linear(&self.linear_fc1, &self.fc1_bias, x, n);
        for v in &mut h {
            *v = gelu_tanh(*v);
        }
        linear(&self.linear_fc2, &self.fc2_bias, &h, n)
    }
}
