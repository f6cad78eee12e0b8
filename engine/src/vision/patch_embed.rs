//! `Qwen4ExpVisionPatchEmbed`: a `Conv3d` whose kernel equals its stride (`temporal_patch x patch x patch`), so
//! one flattened patch times a `[hidden, 3 * temporal * patch * patch]` matrix, plus the bias.

use crate::model::ModelError;
use crate::model::weights::TensorLoader;
use crate::quant::Matrix;

use super::config::VisionConfig;
use super::f32_matrix;

/// The patch embedding.
#[derive(Debug, Clone)]
pub struct PatchEmbed {
    /// `[hidden, 3 * temporal * patch * patch]`, columns in the patch's order (channel, frame, row, column).
    pub(crate) proj: Matrix,
    pub(crate) bias: Vec<f32>,
}

impl PatchEmbed {
    /// Loads `v.patch_embd.weight` (frame 0) and `v.patch_embd.weight.1` (frame 1), each GGUF `[patch, patch, 3,
    /// hidden]`, and `v.patch_embd.bias`, re-interleaving the frames into the `Conv3d` kernel's order.
    ///
    /// Errors: a tensor missing, of another shape or type (named).
    pub fn load(w: &TensorLoader, cfg: &VisionConfig) -> Result<Self, ModelError> {
        let (p, d) = (cfg.patch as u64, cfg.hidden);
        let f0 = w.decoded("v.patch_embd.weight", &[p, p, 3, d as u64])?;
        let f1 = w.decoded("v.patch_embd.weight.1", &[p, p, 3, d as u64])?;
        let pp = cfg.patch * cfg.patch;
        let mut k = Vec::with_capacity(d * cfg.patch_values());
        for o in 0..d {
            for c in 0..3 {
                let at = (o * 3 + c) * pp;
                k.extend_from_slice(&f0[at..at + pp]);
                k.extend_from_slice(&f1[at..at + pp]);
            }
        }
        Ok(Self { proj: f32_matrix(k, d, cfg.patch_values()), bias: w.vector("v.patch_embd.bias", d)? })
    }

    /// Embeds `n` flattened patches (`[n, 3 * temporal * patch * patch]`): `[n, hidden]`.
    pub fn forward(&self, pixels: &[f32], n: usize) -> Vec<f32> {
        let d = self.bias.len();
        let mut out = vec![0f32; n * d];
        self.proj.matmul(pixels, n, &mut out);
        for row in out.chunks_exact_mut(d) {
            for (o, b) in row.iter_mut().zip(&self.bias) {
                *o += b;
            }
        }
        out
    }
}
