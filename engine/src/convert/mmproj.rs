//! `nebula convert --mmproj`: the checkpoint's vision tower (`model.visual.*`) as a llama.cpp mmproj GGUF
//! (architecture `clip`, projector `qwen3vl_merger`).
//!
//! llama.cpp's converter registers this model's tower as an unmodified Qwen3-VL ViT (`Qwen4ExpVisionModel`
//! subclasses `Qwen3VLVisionModel` in its `conversion/qwen4exp.py`), so the names, keys and transforms are
//! Qwen3-VL's: the `Conv3d` patch embedding is split along its temporal axis into `v.patch_embd.weight` (frame 0)
//! and `v.patch_embd.weight.1` (frame 1); `blocks.N.{norm1,norm2,attn.qkv,attn.proj,mlp.linear_fc1,
//! mlp.linear_fc2}` become `v.blk.N.{ln1,ln2,attn_qkv,attn_out,ffn_up,ffn_down}`; the merger's `norm`,
//! `linear_fc1`, `linear_fc2` become `v.post_ln`, `mm.0`, `mm.2`; `pos_embed` becomes `v.position_embd`. The
//! preprocessing settings come from `preprocessor_config.json` when the checkpoint has one, else Qwen3-VL's
//! published values (patch 16, mean = std = 0.5, 65,536 to 16,777,216 pixels).

use std::path::Path;

use serde_json::Value;

use super::{Checkpoint, ConvertError, ConvertReport, OutType, encode};
use crate::gguf::{GgmlType, GgufWriter, MetadataArray, MetadataValue, ValueType};

/// Qwen3-VL's image mean and std (its `preprocessor_config.json`).
pub const QWEN3VL_IMAGE_MEAN: [f32; 3] = [0.5, 0.5, 0.5];
/// See [`QWEN3VL_IMAGE_MEAN`].
pub const QWEN3VL_IMAGE_STD: [f32; 3] = [0.5, 0.5, 0.5];
/// Qwen3-VL's pixel bounds (`size.shortest_edge`, `size.longest_edge` of its `preprocessor_config.json`).
pub const QWEN3VL_PIXEL_BOUNDS: (u64, u64) = (65_536, 16_777_216);

/// The `vision_config` fields the tower needs.
#[derive(Debug, Clone)]
struct VisionHf {
    depth: usize,
    hidden: usize,
    intermediate: usize,
    heads: usize,
    patch: usize,
    temporal_patch: usize,
    merge: usize,
    out_hidden: usize,
    num_position_embeddings: usize,
    in_channels: usize,
}

fn parse_vision(cfg: &Value) -> Result<(VisionHf, f32), ConvertError> {
    let v = cfg.get("vision_config").ok_or_else(|| {
        ConvertError::Config("no vision_config: this checkpoint has no vision tower to write as an mmproj".into())
    })?;
    let get = |k: &str, default: Option<u64>| -> Result<usize, ConvertError> {
        match v.get(k).and_then(Value::as_u64).or(default) {
            Some(x) => Ok(x as usize),
            None => Err(ConvertError::Config(format!("vision_config.{k} missing or not an integer"))),
        }
    };
    let act = v.get("hidden_act").and_then(Value::as_str).unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(ConvertError::Config(format!(
            "vision_config.hidden_act '{act}': the tower is written for gelu_pytorch_tanh (clip.use_gelu)"
        )));
    }
    if let Some(theta) = v.pointer("/rope_parameters/rope_theta").and_then(Value::as_f64)
        && theta != 10_000.0
    {
        return Err(ConvertError::Config(format!(
            "vision_config.rope_parameters.rope_theta {theta}: llama.cpp's qwen3vl graph fixes it at 10000"
        )));
    }
    let text = cfg.get("text_config").unwrap_or(cfg);
    let out_default = text.get("hidden_size").and_then(Value::as_u64);
    let eps = text.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32;
    let h = VisionHf {
        depth: get("depth", Some(27))?,
        hidden: get("hidden_size", Some(1152))?,
        intermediate: get("intermediate_size", Some(4304))?,
        heads: get("num_heads", Some(16))?,
        patch: get("patch_size", Some(16))?,
        temporal_patch: get("temporal_patch_size", Some(2))?,
        merge: get("spatial_merge_size", Some(2))?,
        out_hidden: get("out_hidden_size", out_default)?,
        num_position_embeddings: get("num_position_embeddings", Some(2304))?,
        in_channels: get("in_channels", Some(3))?,
    };
    if h.temporal_patch != 2 {
        return Err(ConvertError::Config(format!(
            "vision_config.temporal_patch_size {}: the mmproj layout splits the patch embedding into 2 frames",
            h.temporal_patch
        )));
    }
    let side = (h.num_position_embeddings as f64).sqrt() as usize;
    if side * side != h.num_position_embeddings || h.heads == 0 || h.hidden % h.heads != 0 || h.in_channels != 3 {
        return Err(ConvertError::Config(format!(
            "vision_config: num_position_embeddings {} must be a square, hidden_size {} a multiple of num_heads {}, \
             in_channels {} = 3",
            h.num_position_embeddings, h.hidden, h.heads, h.in_channels
        )));
    }
    if Some(h.out_hidden as u64) != out_default {
        return Err(ConvertError::Config(format!(
            "vision_config.out_hidden_size {} differs from the text hidden size {out_default:?}",
            h.out_hidden
        )));
    }
    Ok((h, eps))
}

/// `(image_mean, image_std, min_pixels, max_pixels)` from `preprocessor_config.json`, else Qwen3-VL's.
fn preprocessor(dir: &Path) -> Result<([f32; 3], [f32; 3], u64, u64), ConvertError> {
    let path = dir.join("preprocessor_config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok((QWEN3VL_IMAGE_MEAN, QWEN3VL_IMAGE_STD, QWEN3VL_PIXEL_BOUNDS.0, QWEN3VL_PIXEL_BOUNDS.1));
    };
    let bad = |problem: String| ConvertError::Input { path: path.clone(), problem };
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let triple = |k: &str, d: [f32; 3]| -> Result<[f32; 3], ConvertError> {
        match v.get(k) {
            None => Ok(d),
            Some(a) => {
                let vals: Vec<f32> =
                    a.as_array().into_iter().flatten().filter_map(Value::as_f64).map(|x| x as f32).collect();
                <[f32; 3]>::try_from(vals).map_err(|_| bad(format!("{k} is not 3 numbers")))
            }
        }
    };
    let min = v
        .pointer("/size/shortest_edge")
        .or_else(|| v.get("min_pixels"))
        .and_then(Value::as_u64)
        .unwrap_or(QWEN3VL_PIXEL_BOUNDS.0);
    let max = v
        .pointer("/size/longest_edge")
        .or_else(|| v.get("max_pixels"))
        .and_then(Value::as_u64)
        .unwrap_or(QWEN3VL_PIXEL_BOUNDS.1);
    Ok((triple("image_mean", QWEN3VL_IMAGE_MEAN)?, triple("image_std", QWEN3VL_IMAGE_STD)?, min, max))
}

/// One output tensor: its name, ggml dims, type, source and a slice of the source's values.
struct Planned {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    src: String,
    /// For the patch embedding's frames: `Some(t)` keeps temporal index `t` of `[out, c, 2, p, p]`.
    frame: Option<usize>,
}

/// The type of a matrix with rows of `ne0` values for `out`: F32 and F16 and BF16 as asked; Q8_0 where rows are
/// whole blocks, else F16.
fn matrix_type(out: OutType, ne0: u64) -> GgmlType {
    match out {
        OutType::F32 => GgmlType::F32,
        OutType::F16 => GgmlType::F16,
        OutType::Bf16 => GgmlType::BF16,
        OutType::Q8_0 if ne0 % 32 == 0 => GgmlType::Q8_0,
        OutType::Q8_0 => GgmlType::F16,
    }
}

/// llama.cpp's `general.file_type` (`LlamaFileType`) for `out`.
fn file_type(out: OutType) -> u32 {
    match out {
        OutType::F32 => 0,
        OutType::F16 => 1,
        OutType::Q8_0 => 7,
        OutType::Bf16 => 32,
    }
}

/// Writes the vision tower of the checkpoint in `dir` to `out` as an mmproj GGUF (module doc). Matrices take
/// `out_type`; biases and norms are F32; the patch embedding is F16 for `f16`, else F32 (as llama.cpp writes it).
///
/// Errors: no `vision_config` or `model.visual.*` tensors, a tensor missing or of the wrong shape (named), a
/// configuration llama.cpp's layout cannot hold (named), I/O.
pub fn convert_mmproj(
    dir: &Path,
    out: &Path,
    out_type: OutType,
    name: Option<&str>,
) -> Result<ConvertReport, ConvertError> {
    let cfg_path = dir.join("config.json");
    let cfg_text =
        std::fs::read_to_string(&cfg_path).map_err(|e| ConvertError::Io { path: cfg_path.clone(), source: e })?;
    let cfg: Value = serde_json::from_str(&cfg_text).map_err(|e| ConvertError::Config(e.to_string()))?;
    let (h, eps) = parse_vision(&cfg)?;
    let (mean, std, min_pixels, max_pixels) = preprocessor(dir)?;
    let ckpt = Checkpoint::open(dir)?;
    let prefix = ["model.visual.", "visual."]
        .into_iter()
        .find(|p| ckpt.get(&format!("{p}patch_embed.proj.weight")).is_some())
        .ok_or_else(|| ConvertError::Missing { name: "model.visual.patch_embed.proj.weight".into() })?;

    let (d, ff, p, m2) =
        (h.hidden as u64, h.intermediate as u64, h.patch as u64, (h.hidden * h.merge * h.merge) as u64);
    let mut plan: Vec<(Planned, Vec<usize>)> = Vec::new();
    let mut add = |name: String, dims: Vec<u64>, ty: GgmlType, src: &str, hf_shape: Vec<usize>, frame| {
        plan.push((Planned { name, dims, ty, src: format!("{prefix}{src}"), frame }, hf_shape));
    };
    let patch_ty = if out_type == OutType::F16 { GgmlType::F16 } else { GgmlType::F32 };
    let conv_shape = vec![h.hidden, 3, 2, h.patch, h.patch];
    add(
        "v.patch_embd.weight".into(),
        vec![p, p, 3, d],
        patch_ty,
        "patch_embed.proj.weight",
        conv_shape.clone(),
        Some(0),
    );
    add("v.patch_embd.weight.1".into(), vec![p, p, 3, d], patch_ty, "patch_embed.proj.weight", conv_shape, Some(1));
    add("v.patch_embd.bias".into(), vec![d], GgmlType::F32, "patch_embed.proj.bias", vec![h.hidden], None);
    let npos = h.num_position_embeddings;
    add(
        "v.position_embd.weight".into(),
        vec![d, npos as u64],
        matrix_type(out_type, d),
        "pos_embed.weight",
        vec![npos, h.hidden],
        None,
    );
    for b in 0..h.depth {
        let blk = |s: &str| format!("blocks.{b}.{s}");
        let v = |s: &str| format!("v.blk.{b}.{s}");
        for (n, src) in [("ln1", "norm1"), ("ln2", "norm2")] {
            add(
                v(&format!("{n}.weight")),
                vec![d],
                GgmlType::F32,
                &blk(&format!("{src}.weight")),
                vec![h.hidden],
                None,
            );
            add(v(&format!("{n}.bias")), vec![d], GgmlType::F32, &blk(&format!("{src}.bias")), vec![h.hidden], None);
        }
        for (n, src, rows, cols) in [
            ("attn_qkv", "attn.qkv", 3 * d, d),
            ("attn_out", "attn.proj", d, d),
            ("ffn_up", "mlp.linear_fc1", ff, d),
            ("ffn_down", "mlp.linear_fc2", d, ff),
        ] {
            let shape = vec![rows as usize, cols as usize];
            add(
                v(&format!("{n}.weight")),
                vec![cols, rows],
                matrix_type(out_type, cols),
                &blk(&format!("{src}.weight")),
                shape,
                None,
            );
            add(
                v(&format!("{n}.bias")),
                vec![rows],
                GgmlType::F32,
                &blk(&format!("{src}.bias")),
                vec![rows as usize],
                None,
            );
        }
    }
    add("v.post_ln.weight".into(), vec![d], GgmlType::F32, "merger.norm.weight", vec![h.hidden], None);
    add("v.post_ln.bias".into(), vec![d], GgmlType::F32, "merger.norm.bias", vec![h.hidden], None);
    let o = h.out_hidden as u64;
    add(
        "mm.0.weight".into(),
        vec![m2, m2],
        matrix_type(out_type, m2),
        "merger.linear_fc1.weight",
        vec![m2 as usize; 2],
        None,
    );
    add("mm.0.bias".into(), vec![m2], GgmlType::F32, "merger.linear_fc1.bias", vec![m2 as usize], None);
    add(
        "mm.2.weight".into(),
        vec![m2, o],
        matrix_type(out_type, m2),
        "merger.linear_fc2.weight",
        vec![o as usize, m2 as usize],
        None,
    );
    add("mm.2.bias".into(), vec![o], GgmlType::F32, "merger.linear_fc2.bias", vec![o as usize], None);

    for (t, shape) in &plan {
        let s = ckpt.get(&t.src).ok_or_else(|| ConvertError::Missing { name: t.src.clone() })?;
        if &s.shape != shape {
            return Err(ConvertError::Shape { name: t.src.clone(), expected: shape.clone(), actual: s.shape.clone() });
        }
    }

    let mut w = GgufWriter::create(out, 32)?;
    w.add_kv("general.architecture", "clip")?;
    w.add_kv("general.type", "mmproj")?;
    w.add_kv("general.file_type", file_type(out_type))?;
    if let Some(n) = name {
        w.add_kv("general.name", n)?;
    }
    let u = |x: usize| x as u32;
    w.add_kv("clip.has_vision_encoder", true)?;
    w.add_kv("clip.projector_type", "qwen3vl_merger")?;
    w.add_kv("clip.use_gelu", true)?;
    w.add_kv("clip.vision.projection_dim", u(h.out_hidden))?;
    let side = (npos as f64).sqrt() as usize;
    w.add_kv("clip.vision.image_size", u(side * h.patch))?;
    w.add_kv("clip.vision.patch_size", u(h.patch))?;
    w.add_kv("clip.vision.embedding_length", u(h.hidden))?;
    w.add_kv("clip.vision.feed_forward_length", u(h.intermediate))?;
    w.add_kv("clip.vision.block_count", u(h.depth))?;
    w.add_kv("clip.vision.attention.head_count", u(h.heads))?;
    w.add_kv("clip.vision.attention.layer_norm_epsilon", eps)?;
    w.add_kv("clip.vision.image_mean", mean.to_vec())?;
    w.add_kv("clip.vision.image_std", std.to_vec())?;
    w.add_kv("clip.vision.spatial_merge_size", u(h.merge))?;
    w.add_kv("clip.vision.image_min_pixels", u32::try_from(min_pixels).unwrap_or(u32::MAX))?;
    w.add_kv("clip.vision.image_max_pixels", u32::try_from(max_pixels).unwrap_or(u32::MAX))?;
    w.add_kv(
        "clip.vision.is_deepstack_layers",
        MetadataValue::Array(MetadataArray::new(
            ValueType::Bool,
            (0..h.depth).map(|_| MetadataValue::Bool(false)).collect(),
        )),
    )?;
    for (t, _) in &plan {
        w.add_tensor(t.name.clone(), &t.dims, t.ty)?;
    }
    let mut data = w.begin_data()?;
    let mut data_bytes = 0u64;
    for (t, _) in &plan {
        let s = ckpt.get(&t.src).expect("checked above");
        let mut vals = ckpt.read_f32(&t.src, s, 0, s.numel())?;
        if let Some(frame) = t.frame {
            // [out, c, 2, p, p] -> frame `frame`: [out, c, p, p].
            let pp = h.patch * h.patch;
            vals = vals.chunks_exact(2 * pp).flat_map(|c| c[frame * pp..(frame + 1) * pp].to_vec()).collect();
        }
        let bytes = encode(&vals, t.ty, t.dims[0] as usize, None);
        data_bytes += bytes.len() as u64;
        data.write_tensor(&t.name, &bytes)?;
    }
    let files = data.finish()?;
    Ok(ConvertReport { files, tensors: plan.len(), data_bytes, mtp: false, tokenizer: false })
}
