//! The vision tower's shapes and preprocessing settings, read from an mmproj GGUF (`clip.*` keys, as llama.cpp's
//! converter writes them for Qwen3-VL's projector `qwen3vl_merger`).

use crate::gguf::GgufFile;
use crate::model::ModelError;
use crate::model::config::Meta;

/// Shapes of the tower (`Qwen4ExpVisionConfig`) and the preprocessor's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Blocks (`depth`).
    pub depth: usize,
    /// Width of the blocks (`hidden_size`).
    pub hidden: usize,
    /// MLP width (`intermediate_size`).
    pub intermediate: usize,
    /// Attention heads (`num_heads`).
    pub heads: usize,
    /// Side of a patch, pixels (`patch_size`).
    pub patch: usize,
    /// Frames per patch (`temporal_patch_size`; the mmproj layout holds 2).
    pub temporal_patch: usize,
    /// Side of the patch square merged into one language-model token (`spatial_merge_size`).
    pub merge: usize,
    /// Width of the merged features, the language model's hidden size (`out_hidden_size`).
    pub out_hidden: usize,
    /// Side of the learned position grid (`sqrt(num_position_embeddings)`).
    pub position_side: usize,
    /// LayerNorm epsilon of the blocks and the merger.
    pub eps: f32,
    /// Per-channel mean the pixels are normalised with (after scaling to [0, 1]).
    pub image_mean: [f32; 3],
    /// Per-channel std.
    pub image_std: [f32; 3],
    /// Fewest pixels an image is resized to (smart resize's `min_pixels`).
    pub min_pixels: u64,
    /// Most pixels an image is resized to (`max_pixels`).
    pub max_pixels: u64,
}

impl VisionConfig {
    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Values of one flattened patch: `3 * temporal_patch * patch * patch`.
    pub fn patch_values(&self) -> usize {
        3 * self.temporal_patch * self.patch * self.patch
    }

    /// The side a resized image's height and width are multiples of: `patch * merge`.
    pub fn factor(&self) -> usize {
        self.patch * self.merge
    }

    /// Reads the `clip.*` keys of an mmproj file.
    ///
    /// Errors: [`ModelError::Architecture`] for a file that is not `clip`, [`ModelError::Metadata`] naming a
    /// missing or impossible key (a projector other than `qwen3vl_merger`, deepstack layers, shapes that do not
    /// divide).
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let m = Meta { file };
        let arch = m.string("general.architecture")?;
        if arch != "clip" {
            return Err(ModelError::Metadata {
                file: m.name(),
                key: "general.architecture".into(),
                problem: format!("'{arch}': an mmproj file is 'clip'"),
            });
        }
        let proj = m.string("clip.projector_type").or_else(|_| m.string("clip.vision.projector_type"))?;
        if proj != "qwen3vl_merger" {
            return Err(m.bad("clip.projector_type", format!("'{proj}': this model's tower is 'qwen3vl_merger'")));
        }
        if let Some(ds) = m.opt_bool_array("clip.vision.is_deepstack_layers")?
            && ds.iter().any(|&b| b)
        {
            return Err(m.bad(
                "clip.vision.is_deepstack_layers",
                "deepstack layers are set, but this model's tower has none (Qwen4ExpVisionModel has no deepstack \
                 mergers)"
                    .into(),
            ));
        }
        let depth = m.usize("clip.vision.block_count")?;
        let hidden = m.usize("clip.vision.embedding_length")?;
        let heads = m.usize("clip.vision.attention.head_count")?;
        let patch = m.usize("clip.vision.patch_size")?;
        let image_size = m.usize("clip.vision.image_size")?;
        let merge = m.opt_usize("clip.vision.spatial_merge_size")?.unwrap_or(2);
        if heads == 0 || hidden % heads != 0 || (hidden / heads) % 4 != 0 {
            return Err(m.bad(
                "clip.vision.attention.head_count",
                format!("{heads} heads for width {hidden}: the head width must be a multiple of 4 (2-D rotary)"),
            ));
        }
        if patch == 0 || image_size % patch != 0 || merge == 0 {
            return Err(m.bad("clip.vision.image_size", format!("{image_size} is not a multiple of patch {patch}")));
        }
        let mean = m.opt_f32_array("clip.vision.image_mean")?.unwrap_or(crate::convert::QWEN3VL_IMAGE_MEAN.to_vec());
        let std = m.opt_f32_array("clip.vision.image_std")?.unwrap_or(crate::convert::QWEN3VL_IMAGE_STD.to_vec());
        let triple = |key: &str, v: Vec<f32>| -> Result<[f32; 3], ModelError> {
            <[f32; 3]>::try_from(v).map_err(|_| m.bad(key, "expected 3 values".into()))
        };
        let image_std = triple("clip.vision.image_std", std)?;
        if image_std.iter().any(|&s| s <= 0.0) {
            return Err(m.bad("clip.vision.image_std", format!("{image_std:?}: every std must be positive")));
        }
        let (dmin, dmax) = crate::convert::QWEN3VL_PIXEL_BOUNDS;
        let min_pixels = m.opt_usize("clip.vision.image_min_pixels")?.map_or(dmin, |x| x as u64);
        let max_pixels = m.opt_usize("clip.vision.image_max_pixels")?.map_or(dmax, |x| x as u64);
        Ok(Self {
            depth,
            hidden,
            intermediate: m.usize("clip.vision.feed_forward_length")?,
            heads,
            patch,
            temporal_patch: 2,
            merge,
            out_hidden: m.usize("clip.vision.projection_dim")?,
            position_side: image_size / patch,
            eps: m.opt_f32("clip.vision.attention.layer_norm_epsilon")?.unwrap_or(1e-6),
            image_mean: triple("clip.vision.image_mean", mean)?,
            image_std,
            min_pixels,
            max_pixels,
        })
    }
}
