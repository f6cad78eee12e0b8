//! `nebula synth --mmproj`: a random-weight vision tower as an mmproj GGUF (the keys and tensors `nebula convert
//! --mmproj` writes, architecture `clip`, projector `qwen3vl_merger`), for a synthetic model on a machine without
//! the checkpoint: the GPU tower and image prompts can then be timed and tested against the CPU tower.
//!
//! Weights are F32: LayerNorms at weight 1 and bias 0, matrices uniform in `+-1/sqrt(cols)` (so activations keep
//! their scale through the blocks), biases and the position grid uniform in `+-0.02`, from a seeded xorshift
//! stream (the same file for the same seed).

use std::path::{Path, PathBuf};

use crate::gguf::{GgmlType, GgufError, GgufWriter, MetadataArray, MetadataValue, ValueType};

/// Shapes of a synthetic tower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthVision {
    /// Blocks.
    pub depth: usize,
    /// Width of the blocks.
    pub hidden: usize,
    /// Attention heads (the head width `hidden / heads` a multiple of 4).
    pub heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Side of a patch, pixels.
    pub patch: usize,
    /// Side of the patch square merged into one token.
    pub merge: usize,
    /// Side of the learned position grid, patches.
    pub position_side: usize,
    /// Width of the merged features: the language model's hidden size.
    pub out_hidden: usize,
    /// Most pixels an image is resized to.
    pub max_pixels: u64,
}

impl SynthVision {
    /// A tower of the shapes of the released model's (a Qwen3-VL ViT of about 0.31B parameters: 24 blocks of
    /// width 1024, 16 heads, MLP 4096, patch 16, merge 2, a 48 x 48 position grid) for a language model of width
    /// `out_hidden`, with Qwen3-VL's pixel bound.
    pub fn real(out_hidden: usize) -> Self {
        Self {
            depth: 24,
            hidden: 1024,
            heads: 16,
            intermediate: 4096,
            patch: 16,
            merge: 2,
            position_side: 48,
            out_hidden,
            max_pixels: crate::convert::QWEN3VL_PIXEL_BOUNDS.1,
        }
    }

    /// Parameters of the tower.
    pub fn parameters(&self) -> u64 {
        let (d, f, p) = (self.hidden as u64, self.intermediate as u64, self.patch as u64);
        let m = d * (self.merge * self.merge) as u64;
        let block = 4 * d + 3 * d * d + 3 * d + d * d + d + 2 * f * d + f + d;
        2 * p * p * 3 * d
            + d
            + (self.position_side * self.position_side) as u64 * d
            + self.depth as u64 * block
            + 2 * d
            + m * m
            + m
            + self.out_hidden as u64 * m
            + self.out_hidden as u64
    }
}

/// Why a synthetic tower was not written.
#[derive(Debug, thiserror::Error)]
pub enum SynthVisionError {
    /// A shape the tower cannot have.
    #[error("synthetic vision tower: {0}")]
    Shape(String),
    /// Writing the file.
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

/// Writes a random tower of `shape` to `out` (module doc). Returns the files written.
///
/// Errors: [`SynthVisionError::Shape`] for a shape the tower cannot have (named), I/O.
pub fn synth_mmproj(out: &Path, shape: &SynthVision, seed: u64) -> Result<Vec<PathBuf>, SynthVisionError> {
    let s = shape;
    let bad = SynthVisionError::Shape;
    if s.depth == 0 || s.heads == 0 || s.hidden % s.heads != 0 || (s.hidden / s.heads) % 4 != 0 {
        return Err(bad(format!("{} heads for width {}: the head width must be a multiple of 4", s.heads, s.hidden)));
    }
    if s.patch == 0 || s.merge == 0 || s.position_side == 0 || s.intermediate == 0 || s.out_hidden == 0 {
        return Err(bad("every size must be positive".into()));
    }
    let (d, f, p) = (s.hidden as u64, s.intermediate as u64, s.patch as u64);
    let m2 = d * (s.merge * s.merge) as u64;
    let npos = (s.position_side * s.position_side) as u64;
    // (name, GGUF dims, what the values are): 0 ones, 1 zeros, 2 small, 3 matrix with `cols` columns.
    let mut plan: Vec<(String, Vec<u64>, u8)> = vec![
        ("v.patch_embd.weight".into(), vec![p, p, 3, d], 3),
        ("v.patch_embd.weight.1".into(), vec![p, p, 3, d], 3),
        ("v.patch_embd.bias".into(), vec![d], 2),
        ("v.position_embd.weight".into(), vec![d, npos], 2),
    ];
    for b in 0..s.depth {
        for n in ["ln1", "ln2"] {
            plan.push((format!("v.blk.{b}.{n}.weight"), vec![d], 0));
            plan.push((format!("v.blk.{b}.{n}.bias"), vec![d], 1));
        }
        for (n, rows, cols) in [("attn_qkv", 3 * d, d), ("attn_out", d, d), ("ffn_up", f, d), ("ffn_down", d, f)] {
            plan.push((format!("v.blk.{b}.{n}.weight"), vec![cols, rows], 3));
            plan.push((format!("v.blk.{b}.{n}.bias"), vec![rows], 2));
        }
    }
    let o = s.out_hidden as u64;
    plan.extend([
        ("v.post_ln.weight".into(), vec![d], 0),
        ("v.post_ln.bias".into(), vec![d], 1),
        ("mm.0.weight".into(), vec![m2, m2], 3),
        ("mm.0.bias".into(), vec![m2], 2),
        ("mm.2.weight".into(), vec![m2, o], 3),
        ("mm.2.bias".into(), vec![o], 2),
    ]);
    let mut w = GgufWriter::create(out, 32)?;
    w.add_kv("general.architecture", "clip")?;
    w.add_kv("general.type", "mmproj")?;
    w.add_kv("general.file_type", 0u32)?;
    w.add_kv("general.name", "nebula synthetic vision tower")?;
    let u = |x: usize| x as u32;
    w.add_kv("clip.has_vision_encoder", true)?;
    w.add_kv("clip.projector_type", "qwen3vl_merger")?;
    w.add_kv("clip.use_gelu", true)?;
    w.add_kv("clip.vision.projection_dim", u(s.out_hidden))?;
    w.add_kv("clip.vision.image_size", u(s.position_side * s.patch))?;
    w.add_kv("clip.vision.patch_size", u(s.patch))?;
    w.add_kv("clip.vision.embedding_length", u(s.hidden))?;
    w.add_kv("clip.vision.feed_forward_length", u(s.intermediate))?;
    w.add_kv("clip.vision.block_count", u(s.depth))?;
    w.add_kv("clip.vision.attention.head_count", u(s.heads))?;
    w.add_kv("clip.vision.attention.layer_norm_epsilon", 1e-6f32)?;
    w.add_kv("clip.vision.image_mean", crate::convert::QWEN3VL_IMAGE_MEAN.to_vec())?;
    w.add_kv("clip.vision.image_std", crate::convert::QWEN3VL_IMAGE_STD.to_vec())?;
    w.add_kv("clip.vision.spatial_merge_size", u(s.merge))?;
    let factor = (s.patch * s.merge) as u64;
    let min_pixels = crate::convert::QWEN3VL_PIXEL_BOUNDS.0.min(s.max_pixels).max(factor * factor);
    w.add_kv("clip.vision.image_min_pixels", u32::try_from(min_pixels).unwrap_or(u32::MAX))?;
    w.add_kv("clip.vision.image_max_pixels", u32::try_from(s.max_pixels.max(min_pixels)).unwrap_or(u32::MAX))?;
    w.add_kv(
        "clip.vision.is_deepstack_layers",
        MetadataValue::Array(MetadataArray::new(
            ValueType::Bool,
            (0..s.depth).map(|_| MetadataValue::Bool(false)).collect(),
        )),
    )?;
    for (name, dims, _) in &plan {
        w.add_tensor(name.clone(), dims, GgmlType::F32)?;
    }
    let mut data = w.begin_data()?;
    let mut state = seed.max(1);
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    for (name, dims, kind) in &plan {
        let count: u64 = dims.iter().product();
        let cols = dims[0] as f32 * if name.starts_with("v.patch_embd.weight") { 6.0 } else { 1.0 };
        let scale = match kind {
            3 => 1.0 / cols.sqrt(),
            _ => 0.02,
        };
        let bytes: Vec<u8> = (0..count)
            .flat_map(|_| {
                let v = match kind {
                    0 => 1.0,
                    1 => 0.0,
                    _ => next() * scale,
                };
                f32::to_le_bytes(v)
            })
            .collect();
        data.write_tensor(name, &bytes)?;
    }
    Ok(data.finish()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small synthetic tower loads as a vision tower of its shapes, counts its parameters as the file holds
    /// them, and gives finite features of the right size; a bad head width is refused by name.
    #[test]
    fn a_synthetic_tower_loads_and_runs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mm.gguf");
        let shape = SynthVision {
            depth: 2,
            hidden: 32,
            heads: 2,
            intermediate: 48,
            patch: 16,
            merge: 2,
            position_side: 4,
            out_hidden: 24,
            max_pixels: 128 * 128,
        };
        synth_mmproj(&path, &shape, 3).unwrap();
        let tower = crate::vision::VisionModel::load(&path).unwrap();
        let c = &tower.config;
        assert_eq!((c.depth, c.hidden, c.heads, c.intermediate, c.out_hidden), (2, 32, 2, 48, 24));
        assert_eq!(c.max_pixels, 128 * 128);
        assert_eq!(tower.weight_bytes(), 4 * shape.parameters());
        let pixels = crate::vision::PatchedPixels {
            values: (0..16 * c.patch_values()).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect(),
            grid_thw: [1, 4, 4],
        };
        let feats = tower.forward(&pixels);
        assert_eq!(feats.len(), 4 * 24);
        assert!(feats.iter().all(|v| v.is_finite()) && feats.iter().any(|&v| v != 0.0));
        let e = synth_mmproj(&path, &SynthVision { heads: 3, ..shape }, 3).unwrap_err().to_string();
        assert!(e.contains("head width"), "{e}");
    }
}
