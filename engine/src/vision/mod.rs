//! Vision input: images and video frames through the model's own vision tower, one file per block named as the
//! reference names it (`Qwen4ExpVisionModel` and its parts in transformers' `modeling_qwen4_exp.py`).
//!
//! - [`preprocess`]: decoding, smart resize, normalisation and patchify, as the reference processors do them;
//! - the tower ([`VisionModel`], loaded from an mmproj GGUF, [`config`]): [`patch_embed`], the learned position
//!   grid resampled to each image ([`pos_embed`]), the blocks ([`block`]: [`attention`] with 2-D rotary
//!   ([`rotary_emb`]) over each frame's own patches, [`mlp`]) and the [`merger`] (one language-model token per
//!   `merge x merge` patches). This tower has no deepstack mergers (unlike Qwen3-VL's);
//! - [`rope_index`]: the language model's 3-D M-RoPE positions of a prompt with vision tokens
//!   (`Qwen4ExpModel.get_rope_index` / `get_vision_position_ids`), and [`MediaPrompt`], what a prompt with media
//!   carries into the engine: the features to place at the `<|image_pad|>` / `<|video_pad|>` rows and every row's
//!   position.
//!
//! All math is `f32` on the CPU; the matrix products go through [`crate::quant::Matrix`].

pub mod attention;
pub mod block;
pub mod config;
pub mod error;
pub mod merger;
pub mod mlp;
pub mod patch_embed;
pub mod pos_embed;
pub mod preprocess;
pub mod rope_index;
pub mod rotary_emb;

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use crate::gguf::{GgmlType, GgufFile};
use crate::model::ModelError;
use crate::model::weights::TensorLoader;
use crate::quant::{Matrix, WeightBytes};

pub use config::VisionConfig;
pub use error::VisionError;
pub use preprocess::{DecodeLimits, PatchedPixels, RgbImage, decode_image, preprocess_image, preprocess_video};
pub use rope_index::{MediaPrompt, MediaSpan, rope_index};

use block::VisionBlock;
use merger::PatchMerger;
use patch_embed::PatchEmbed;
use pos_embed::PosEmbed;
use rotary_emb::VisionRotary;

/// A `rows x cols` F32 matrix over `vals` (row-major).
pub(crate) fn f32_matrix(vals: Vec<f32>, rows: usize, cols: usize) -> Matrix {
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    Matrix::new(GgmlType::F32, rows, cols, WeightBytes::from_vec(bytes)).expect("rows x cols f32 values")
}

/// `x W^T + b` for `n` rows.
pub(crate) fn linear(w: &Matrix, b: &[f32], x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n * w.rows()];
    w.matmul(x, n, &mut y);
    for row in y.chunks_exact_mut(w.rows()) {
        for (o, bb) in row.iter_mut().zip(b) {
            *o += bb;
        }
    }
    y
}

/// GELU with the tanh approximation (`gelu_pytorch_tanh`): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (K * (x + 0.044715 * x * x * x)).tanh())
}

/// The exact GELU of `nn.GELU()`: `0.5 x (1 + erf(x / sqrt 2))`, erf evaluated in `f64`.
pub(crate) fn gelu_erf(x: f32) -> f32 {
    (0.5 * x as f64 * (1.0 + erf(x as f64 / std::f64::consts::SQRT_2))) as f32
}

/// The error function to about 1e-16 (relative): Taylor series near 0, a continued fraction of `erfc` beyond.
fn erf(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 2.5 {
        // erf(x) = 2/sqrt(pi) sum_n (-1)^n x^(2n+1) / (n! (2n+1)).
        let (mut term, mut sum, x2) = (a, a, a * a);
        for n in 1..80 {
            term *= -x2 / n as f64;
            let add = term / (2 * n + 1) as f64;
            sum += add;
            if add.abs() < 1e-17 * sum.abs() {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + 1/2/(x + 1/(x + 3/2/(x + 2/(x + ...))))), Lentz-free backward.
        let mut f = a;
        for k in (1..60).rev() {
            f = a + (k as f64 / 2.0) / f;
        }
        1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / f
    };
    r.copysign(x)
}

/// A LayerNorm with weight and bias.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    pub(crate) weight: Vec<f32>,
    pub(crate) bias: Vec<f32>,
    pub(crate) eps: f32,
}

impl LayerNorm {
    /// Loads `{prefix}.weight` and `{prefix}.bias` of `dim` values.
    ///
    /// Errors: missing, wrong shape or type (named).
    pub fn load(w: &TensorLoader, prefix: &str, dim: usize, eps: f32) -> Result<Self, ModelError> {
        Ok(Self {
            weight: w.vector(&format!("{prefix}.weight"), dim)?,
            bias: w.vector(&format!("{prefix}.bias"), dim)?,
            eps,
        })
    }
}

/// LayerNorm of every row of `x`: `(x - mean) / sqrt(var + eps) * w + b`, biased variance, in `f32`.
pub(crate) fn layer_norm_rows(ln: &LayerNorm, x: &[f32]) -> Vec<f32> {
    let d = ln.weight.len();
    let mut out = vec![0f32; x.len()];
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + ln.eps).sqrt();
        for ((o, &v), (&w, &b)) in o.iter_mut().zip(row).zip(ln.weight.iter().zip(&ln.bias)) {
            *o = (v - mean) * inv * w + b;
        }
    }
    out
}

/// The vision tower (`Qwen4ExpVisionModel`), loaded from an mmproj GGUF.
pub struct VisionModel {
    /// Shapes and preprocessing settings.
    pub config: VisionConfig,
    pub(crate) patch_embed: PatchEmbed,
    pub(crate) pos_embed: PosEmbed,
    pub(crate) rotary: VisionRotary,
    pub(crate) blocks: Vec<VisionBlock>,
    pub(crate) merger: PatchMerger,
    file: Arc<GgufFile>,
}

impl std::fmt::Debug for VisionModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VisionModel").field("config", &self.config).finish_non_exhaustive()
    }
}

impl VisionModel {
    /// Opens an mmproj GGUF and validates every tensor's presence, shape and type (errors name the tensor).
    ///
    /// Errors: [`ModelError`]: not a `clip` file, a projector other than `qwen3vl_merger`, a tensor missing or of
    /// the wrong shape or type.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::from_gguf(Arc::new(GgufFile::open(path)?))
    }

    /// [`VisionModel::load`] from an opened file.
    ///
    /// Errors: as [`VisionModel::load`].
    pub fn from_gguf(file: Arc<GgufFile>) -> Result<Self, ModelError> {
        let config = VisionConfig::from_gguf(&file)?;
        let w = TensorLoader::new(file.clone());
        let blocks = (0..config.depth).map(|b| VisionBlock::load(&w, &config, b)).collect::<Result<Vec<_>, _>>()?;
        // Every tensor of the file must be one the tower reads: a stray one means another tower's file.
        let mut expected: std::collections::HashSet<String> =
            ["v.patch_embd.weight", "v.patch_embd.weight.1", "v.patch_embd.bias", "v.position_embd.weight"]
                .into_iter()
                .chain(["v.post_ln.weight", "v.post_ln.bias", "mm.0.weight", "mm.0.bias", "mm.2.weight", "mm.2.bias"])
                .map(String::from)
                .collect();
        for b in 0..config.depth {
            for t in ["ln1", "ln2", "attn_qkv", "attn_out", "ffn_up", "ffn_down"] {
                expected.insert(format!("v.blk.{b}.{t}.weight"));
                expected.insert(format!("v.blk.{b}.{t}.bias"));
            }
        }
        if let Some(stray) = file.tensors().find(|t| !expected.contains(&t.name)) {
            return Err(ModelError::TensorValue {
                file: file.path().display().to_string(),
                name: stray.name.clone(),
                problem: format!("not a tensor of this model's vision tower ({} blocks, qwen3vl_merger)", config.depth),
            });
        }
        Ok(Self {
            patch_embed: PatchEmbed::load(&w, &config)?,
            pos_embed: PosEmbed::load(&w, &config)?,
            rotary: VisionRotary::new(config.head_dim()),
            blocks,
            merger: PatchMerger::load(&w, &config)?,
            config,
            file,
        })
    }

    /// The mmproj file.
    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// Bytes of the tower's tensors in the file.
    pub fn weight_bytes(&self) -> u64 {
        self.file.tensors().map(|t| t.n_bytes).sum()
    }

    /// Language-model tokens an image or video of grid `[t, h, w]` (patches) becomes: `t * h * w / merge^2`.
    pub fn tokens_for(&self, grid: [usize; 3]) -> usize {
        grid[0] * grid[1] * grid[2] / (self.config.merge * self.config.merge)
    }

    /// The tower on one image or video (`Qwen4ExpVisionModel.forward`): `pixels` as [`preprocess`] made them.
    /// Returns the merged features `[t * h * w / merge^2, out_hidden]`, in the order of the pad tokens they
    /// replace.
    pub fn forward(&self, pixels: &PatchedPixels) -> Vec<f32> {
        let [t, h, w] = pixels.grid_thw;
        let m = self.config.merge;
        let n = t * h * w;
        debug_assert_eq!(pixels.values.len(), n * self.config.patch_values());
        let mut x = self.patch_embed.forward(&pixels.values, n);
        self.pos_embed.add_to(&mut x, pixels.grid_thw, m);
        // Rotary angles per patch: (row, col) in spatial-merge-block order, repeated per frame.
        let blocks_w = w / m;
        let per_frame: Vec<(Vec<f32>, Vec<f32>)> = (0..h * w)
            .map(|i| {
                let (in_col, in_row) = (i % m, (i / m) % m);
                let (bc, br) = ((i / (m * m)) % blocks_w, i / (m * m * blocks_w));
                self.rotary.angles(br * m + in_row, bc * m + in_col)
            })
            .collect();
        let angles: Vec<(Vec<f32>, Vec<f32>)> = (0..t).flat_map(|_| per_frame.iter().cloned()).collect();
        let segments: Vec<Range<usize>> = (0..t).map(|f| f * h * w..(f + 1) * h * w).collect();
        for b in &self.blocks {
            b.forward(&mut x, n, &segments, &angles);
        }
        self.merger.forward(&x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        for (x, e) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.0, 0.999_977_909_503_001_4),
            (-1.5, -0.966_105_146_475_310_7),
        ] {
            assert!((erf(x) - e).abs() < 1e-14, "erf({x}) = {} not {e}", erf(x));
        }
    }
}
