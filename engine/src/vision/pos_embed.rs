//! The learned absolute position embedding (`pos_embed`, a square `side x side` grid) resampled to each image's
//! patch grid: bilinear with `align_corners=True` and border clamping, in the spatial-merge-block patch order
//! (`get_vision_interpolation_indices_and_weights` of transformers' `vision_utils.py`, as
//! `Qwen4ExpVisionModel.forward` calls it).

use crate::model::ModelError;
use crate::model::weights::TensorLoader;

use super::config::VisionConfig;

/// The position grid.
#[derive(Debug, Clone)]
pub struct PosEmbed {
    /// `[side * side, hidden]`.
    pub(crate) table: Vec<f32>,
    pub(crate) side: usize,
    pub(crate) hidden: usize,
}

/// Taps and weights of one axis: output index `i` of `size` reads grid rows `taps` with weights `weights`
/// (`src = i * (side - 1) / max(size - 1, 1)` in `f32`, two taps `floor(src)` and `floor(src) + 1` clamped to the
/// grid, weights `max(0, 1 - |src - tap|)`).
fn axis(i: usize, size: usize, side: usize) -> ([usize; 2], [f32; 2]) {
    let src = (i as f32 * (side - 1) as f32) / (size.saturating_sub(1).max(1)) as f32;
    let floor = src.floor();
    let mut taps = [0usize; 2];
    let mut weights = [0f32; 2];
    for k in 0..2 {
        let raw = floor as i64 + k as i64;
        taps[k] = raw.clamp(0, side as i64 - 1) as usize;
        weights[k] = (1.0 - (src - floor - k as f32).abs()).max(0.0);
    }
    (taps, weights)
}

impl PosEmbed {
    /// Loads `v.position_embd.weight` (GGUF `[hidden, side * side]`, any float or quantized type), decoded to f32.
    ///
    /// Errors: missing, wrong shape or type (named).
    pub fn load(w: &TensorLoader, cfg: &VisionConfig) -> Result<Self, ModelError> {
        let n = cfg.position_side * cfg.position_side;
        let m = w.matrix("v.position_embd.weight", n, cfg.hidden)?;
        Ok(Self { table: m.to_f32(), side: cfg.position_side, hidden: cfg.hidden })
    }

    /// Adds the resampled grid to `x` (`[t * h * w, hidden]`, patches in spatial-merge-block order, `merge` the
    /// block side) for a grid of `t` frames of `h x w` patches.
    pub fn add_to(&self, x: &mut [f32], [t, h, w]: [usize; 3], merge: usize) {
        let d = self.hidden;
        let per_frame = h * w;
        let blocks_w = w / merge;
        for (idx, row) in x.chunks_exact_mut(d).enumerate().take(t * per_frame) {
            let within = idx % per_frame;
            let (in_col, in_row) = (within % merge, (within / merge) % merge);
            let (block_col, block_row) = ((within / (merge * merge)) % blocks_w, within / (merge * merge * blocks_w));
            let (r, c) = (block_row * merge + in_row, block_col * merge + in_col);
            let (ht, hw) = axis(r, h, self.side);
            let (wt, ww) = axis(c, w, self.side);
            let taps = [(ht[0], wt[0]), (ht[0], wt[1]), (ht[1], wt[0]), (ht[1], wt[1])];
            let weights = [hw[0] * ww[0], hw[0] * ww[1], hw[1] * ww[0], hw[1] * ww[1]];
            for j in 0..d {
                let mut s = 0f32;
                for (k, &(a, b)) in taps.iter().enumerate() {
                    s += self.table[(a * self.side + b) * d + j] * weights[k];
                }
                row[j] += s;
            }
        }
    }
}
