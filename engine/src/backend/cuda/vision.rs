//! The vision tower on the GPU ([`CudaVisionModel`]): `crate::vision::VisionModel::forward` (transformers'
//! `Qwen4ExpVisionModel.forward`) with the matrix products in cuBLAS f32 GEMMs (no TF32) and the rest in
//! kernels/cuda/vision.cu: the patch embedding, the learned position grid resampled to the image, each block's
//! LayerNorms, 2-D rotary and softmax attention of every patch over its own frame's patches (a flash-style kernel,
//! f32 online softmax), the tanh-GELU MLP, and the merger (LayerNorm, `merge x merge` patches per token, erf
//! GELU). Every weight is dequantized to f32 on upload, whatever its type in the mmproj file.
//!
//! The tower opens the GPU's primary context with a stream of its own and loads only the vision kernels, so it
//! runs beside the language model (on its GPU or another) without compiling the model's kernels again. Its
//! activations live in one workspace sized at load for the largest image the server takes (`max_pixels`; video
//! grids past it grow it), so the VRAM it holds is known before the language model places its experts
//! ([`CudaVisionModel::vram_bytes`]). One image runs at a time (a lock around the workspace).

use std::sync::Mutex;

use nebula_kernels::Gpu;
use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::device::{Arg, Dev, ptr};
use crate::tuning::CudaTuning;
use crate::vision::{PatchedPixels, VisionConfig, VisionModel};

/// Head widths the attention kernel is instantiated for (`vision_attention_<hd>`).
pub const VISION_HEAD_DIMS: [usize; 8] = [16, 32, 48, 64, 72, 80, 96, 128];

/// Queries per block of the attention kernel.
const ATTN_QUERIES: u32 = 128;

/// One block's weights on the device (f32).
struct DevVisionBlock {
    ln1: (CudaSlice<f32>, CudaSlice<f32>),
    ln2: (CudaSlice<f32>, CudaSlice<f32>),
    qkv: (CudaSlice<f32>, CudaSlice<f32>),
    proj: (CudaSlice<f32>, CudaSlice<f32>),
    fc1: (CudaSlice<f32>, CudaSlice<f32>),
    fc2: (CudaSlice<f32>, CudaSlice<f32>),
}

/// The activations of one forward, for up to `patches` patches.
struct Workspace {
    patches: usize,
    pixels: CudaSlice<f32>,
    x: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    wide: CudaSlice<f32>,
    out: CudaSlice<f32>,
}

/// Floats of each workspace buffer for `patches` patches: pixels `[n, patch values]`, the residual stream, the
/// normed rows and the attention output `[n, hidden]` each (the merger's `[n / merge^2, merge^2 hidden]` rows reuse
/// the attention output), q/k/v `[n, 3 hidden]`, the MLP's hidden rows `[n, max(intermediate, hidden)]` (the
/// projections' outputs reuse it), and the merged features `[n / merge^2, out_hidden]`.
fn workspace_lens(cfg: &VisionConfig, patches: usize) -> [usize; 7] {
    let (d, m2) = (cfg.hidden, cfg.merge * cfg.merge);
    let n = patches.max(m2);
    [
        n * cfg.patch_values(),
        n * d,
        n * d,
        3 * n * d,
        n * d,
        n * cfg.intermediate.max(d),
        n.div_ceil(m2) * cfg.out_hidden,
    ]
}

struct Inner {
    dev: Dev,
    patch: (CudaSlice<f32>, CudaSlice<f32>),
    pos_table: CudaSlice<f32>,
    inv_freq: CudaSlice<f32>,
    blocks: Vec<DevVisionBlock>,
    post_ln: (CudaSlice<f32>, CudaSlice<f32>),
    merger_fc1: (CudaSlice<f32>, CudaSlice<f32>),
    merger_fc2: (CudaSlice<f32>, CudaSlice<f32>),
    ws: Workspace,
}

/// The vision tower on a GPU (module docs).
pub struct CudaVisionModel {
    /// The tower's shapes and preprocessing settings (those of the CPU tower it was uploaded from).
    pub config: VisionConfig,
    /// Bytes of its weights on the device (f32).
    pub weight_bytes: usize,
    inner: Mutex<Inner>,
    gpu_name: String,
}

impl std::fmt::Debug for CudaVisionModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaVisionModel").field("gpu", &self.gpu_name).field("config", &self.config).finish()
    }
}

/// Patches of the largest image of at most `max_pixels` pixels: `max_pixels / patch^2`, at least one merged
/// token's.
pub fn max_patches(cfg: &VisionConfig, max_pixels: u64) -> usize {
    let per = (cfg.patch * cfg.patch).max(1) as u64;
    ((max_pixels / per) as usize).max(cfg.merge * cfg.merge)
}

impl CudaVisionModel {
    /// Bytes of the tower's f32 weights on the device for `cfg`: the patch embedding, the position grid, the
    /// rotary frequencies, every block's norms, projections and biases, the merger's.
    pub fn weight_bytes_for(cfg: &VisionConfig) -> usize {
        let (d, f, m) = (cfg.hidden, cfg.intermediate, cfg.hidden * cfg.merge * cfg.merge);
        let block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (f * d + f) + (d * f + d);
        let floats = cfg.patch_values() * d
            + d
            + cfg.position_side * cfg.position_side * d
            + cfg.head_dim() / 4
            + cfg.depth * block
            + 2 * d
            + (m * m + m)
            + (cfg.out_hidden * m + cfg.out_hidden);
        4 * floats
    }

    /// Bytes of device memory a tower of `cfg` takes when made for images of up to `max_pixels` pixels
    /// ([`CudaVisionModel::new`]): its weights and the activation workspace of the largest such image. What a
    /// server subtracts from the VRAM budget of the language model.
    pub fn vram_bytes(cfg: &VisionConfig, max_pixels: u64) -> u64 {
        let ws: usize = workspace_lens(cfg, max_patches(cfg, max_pixels)).iter().sum();
        (Self::weight_bytes_for(cfg) + 4 * ws) as u64
    }

    /// Uploads `tower` to GPU `ordinal` (every matrix dequantized to f32) with a workspace for images of up to
    /// `max_pixels` pixels.
    ///
    /// Errors: no GPU or driver, the vision kernels do not compile, a head width the attention kernel has no
    /// instantiation for ([`VISION_HEAD_DIMS`]), device memory.
    pub fn new(tower: &VisionModel, ordinal: usize, max_pixels: u64) -> Result<Self, CudaError> {
        let cfg = tower.config.clone();
        let hd = cfg.head_dim();
        if !VISION_HEAD_DIMS.contains(&hd) {
            return Err(CudaError::Unsupported(format!(
                "a vision tower with heads {hd} wide (the GPU attention takes {VISION_HEAD_DIMS:?})"
            )));
        }
        let gpu = Gpu::open_sources(ordinal, &["vision"])?;
        let gpu_name = gpu.name.clone();
        let dev = Dev::new(gpu, &CudaTuning::default())?;
        // Few, large launches: no programmatic dependent launch.
        dev.set_pass_tokens(usize::MAX);
        let stream = dev.stream().clone();
        let up = |v: &[f32]| -> Result<CudaSlice<f32>, CudaError> {
            Ok(if v.is_empty() { stream.alloc_zeros::<f32>(1)? } else { stream.clone_htod(v)? })
        };
        let pair =
            |w: &[f32], b: &[f32]| -> Result<(CudaSlice<f32>, CudaSlice<f32>), CudaError> { Ok((up(w)?, up(b)?)) };
        let ln = |l: &crate::vision::LayerNorm| pair(&l.weight, &l.bias);
        let mut blocks = Vec::with_capacity(tower.blocks.len());
        for b in &tower.blocks {
            blocks.push(DevVisionBlock {
                ln1: ln(&b.norm1)?,
                ln2: ln(&b.norm2)?,
                qkv: pair(&b.attn.qkv.to_f32(), &b.attn.qkv_bias)?,
                proj: pair(&b.attn.proj.to_f32(), &b.attn.proj_bias)?,
                fc1: pair(&b.mlp.linear_fc1.to_f32(), &b.mlp.fc1_bias)?,
                fc2: pair(&b.mlp.linear_fc2.to_f32(), &b.mlp.fc2_bias)?,
            });
        }
        let mg = &tower.merger;
        let ws = Self::workspace(&dev, &cfg, max_patches(&cfg, max_pixels))?;
        let inner = Inner {
            patch: pair(&tower.patch_embed.proj.to_f32(), &tower.patch_embed.bias)?,
            pos_table: up(&tower.pos_embed.table)?,
            inv_freq: up(tower.rotary.inv_freq())?,
            blocks,
            post_ln: ln(&mg.norm)?,
            merger_fc1: pair(&mg.linear_fc1.to_f32(), &mg.fc1_bias)?,
            merger_fc2: pair(&mg.linear_fc2.to_f32(), &mg.fc2_bias)?,
            ws,
            dev,
        };
        inner.dev.stream().synchronize()?;
        Ok(Self { weight_bytes: Self::weight_bytes_for(&cfg), config: cfg, inner: Mutex::new(inner), gpu_name })
    }

    fn workspace(dev: &Dev, cfg: &VisionConfig, patches: usize) -> Result<Workspace, CudaError> {
        let [p, x, nm, qkv, attn, wide, out] = workspace_lens(cfg, patches);
        let z = |n: usize| super::memory::zeros(dev, n);
        Ok(Workspace {
            patches,
            pixels: z(p)?,
            x: z(x)?,
            normed: z(nm)?,
            qkv: z(qkv)?,
            attn: z(attn)?,
            wide: z(wide)?,
            out: z(out)?,
        })
    }

    /// The GPU's name.
    pub fn gpu_name(&self) -> &str {
        &self.gpu_name
    }

    /// Bytes of device memory held now: the weights and the workspace (which a video past the load's
    /// `max_pixels` grows).
    pub fn device_bytes(&self) -> usize {
        let inner = self.inner.lock().expect("vision tower lock");
        let ws: usize = workspace_lens(&self.config, inner.ws.patches).iter().sum();
        self.weight_bytes + 4 * ws
    }

    /// The tower on one image or video (`Qwen4ExpVisionModel.forward`, as [`VisionModel::forward`]): `pixels` as
    /// `crate::vision::preprocess` made them. Returns the merged features `[t * h * w / merge^2, out_hidden]`,
    /// in the order of the pad tokens they replace.
    ///
    /// Errors: pixels of another size than the grid's, a grid not a whole number of merge squares
    /// ([`CudaError::Unsupported`]); a device failure.
    pub fn forward(&self, pixels: &PatchedPixels) -> Result<Vec<f32>, CudaError> {
        let cfg = &self.config;
        let [t, h, w] = pixels.grid_thw;
        let (m, d) = (cfg.merge, cfg.hidden);
        let n = t * h * w;
        if n == 0 || h % m != 0 || w % m != 0 || pixels.values.len() != n * cfg.patch_values() {
            return Err(CudaError::Unsupported(format!(
                "pixels of {} values for a {t} x {h} x {w} patch grid (merge {m}, {} values a patch)",
                pixels.values.len(),
                cfg.patch_values()
            )));
        }
        let mut guard = self.inner.lock().expect("vision tower lock");
        let inner = &mut *guard;
        inner.dev.gpu.ctx.bind_to_thread()?;
        if inner.ws.patches < n {
            inner.ws = Self::workspace(&inner.dev, cfg, n)?;
        }
        let dev = &inner.dev;
        let stream = dev.stream().clone();
        let a = |b: &CudaSlice<f32>| ptr(b, &stream, 0);
        let ws = &mut inner.ws;
        stream.memcpy_htod(&pixels.values, &mut ws.pixels.slice_mut(0..pixels.values.len()))?;
        let (px, x, nm, qkv, attn, wide, out) =
            (a(&ws.pixels), a(&ws.x), a(&ws.normed), a(&ws.qkv), a(&ws.attn), a(&ws.wide), a(&ws.out));
        let (f, hd, heads) = (cfg.intermediate, cfg.head_dim(), cfg.heads);
        let bias_act = |y: u64, b: &CudaSlice<f32>, rows: usize, cols: usize, act: i32| {
            dev.launch_1d(
                "vision_bias_act",
                rows * cols,
                &[Arg::Ptr(y), Arg::Ptr(a(b)), Arg::I64(rows as i64), Arg::I32(cols as i32), Arg::I32(act)],
            )
        };
        let residual = |y: u64, b: &CudaSlice<f32>| {
            dev.launch_1d(
                "vision_bias_residual",
                n * d,
                &[Arg::Ptr(x), Arg::Ptr(y), Arg::Ptr(a(b)), Arg::I64(n as i64), Arg::I32(d as i32)],
            )
        };
        let layer_norm = |src: u64, l: &(CudaSlice<f32>, CudaSlice<f32>), dst: u64| {
            dev.launch(
                "vision_layer_norm",
                (n as u32, 1, 1),
                256,
                &[
                    Arg::Ptr(src),
                    Arg::Ptr(a(&l.0)),
                    Arg::Ptr(a(&l.1)),
                    Arg::Ptr(dst),
                    Arg::I32(n as i32),
                    Arg::I32(d as i32),
                    Arg::F32(cfg.eps),
                ],
            )
        };
        // Patch embedding and the resampled position grid.
        dev.sgemm(a(&inner.patch.0), px, x, d, n, cfg.patch_values())?;
        bias_act(x, &inner.patch.1, n, d, 0)?;
        dev.launch_1d(
            "vision_pos_embed",
            n * d,
            &[
                Arg::Ptr(x),
                Arg::Ptr(a(&inner.pos_table)),
                Arg::I32(t as i32),
                Arg::I32(h as i32),
                Arg::I32(w as i32),
                Arg::I32(m as i32),
                Arg::I32(cfg.position_side as i32),
                Arg::I32(d as i32),
            ],
        )?;
        let attention = format!("vision_attention_{hd}");
        let hw = h * w;
        for b in &inner.blocks {
            layer_norm(x, &b.ln1, nm)?;
            dev.sgemm(a(&b.qkv.0), nm, qkv, 3 * d, n, d)?;
            bias_act(qkv, &b.qkv.1, n, 3 * d, 0)?;
            dev.launch_1d(
                "vision_rotary",
                n * heads * hd / 2,
                &[
                    Arg::Ptr(qkv),
                    Arg::I32(n as i32),
                    Arg::I32(hw as i32),
                    Arg::I32(w as i32),
                    Arg::I32(m as i32),
                    Arg::I32(heads as i32),
                    Arg::I32(hd as i32),
                    Arg::Ptr(a(&inner.inv_freq)),
                ],
            )?;
            dev.launch(
                &attention,
                (hw.div_ceil(ATTN_QUERIES as usize) as u32, heads as u32, t as u32),
                ATTN_QUERIES,
                &[
                    Arg::Ptr(qkv),
                    Arg::Ptr(attn),
                    Arg::I32(hw as i32),
                    Arg::I32(heads as i32),
                    Arg::F32(1.0 / (hd as f32).sqrt()),
                ],
            )?;
            dev.sgemm(a(&b.proj.0), attn, wide, d, n, d)?;
            residual(wide, &b.proj.1)?;
            layer_norm(x, &b.ln2, nm)?;
            dev.sgemm(a(&b.fc1.0), nm, wide, f, n, d)?;
            bias_act(wide, &b.fc1.1, n, f, 1)?;
            dev.sgemm(a(&b.fc2.0), wide, attn, d, n, f)?;
            residual(attn, &b.fc2.1)?;
        }
        // The merger: each merge x merge square of normed patches (contiguous rows) is one row of merge^2 hidden.
        layer_norm(x, &inner.post_ln, nm)?;
        let tokens = n / (m * m);
        let mw = d * m * m;
        dev.sgemm(a(&inner.merger_fc1.0), nm, attn, mw, tokens, mw)?;
        bias_act(attn, &inner.merger_fc1.1, tokens, mw, 2)?;
        dev.sgemm(a(&inner.merger_fc2.0), attn, out, cfg.out_hidden, tokens, mw)?;
        bias_act(out, &inner.merger_fc2.1, tokens, cfg.out_hidden, 0)?;
        let mut features = vec![0f32; tokens * cfg.out_hidden];
        stream.memcpy_dtoh(&ws.out.slice(0..features.len()), &mut features)?;
        stream.synchronize()?;
        Ok(features)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo_tower() -> VisionModel {
        let root = std::env::var("NEBULA_REPO_ROOT")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|_| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
        VisionModel::load(&root.join("models/nebula-demo-mmproj.gguf")).expect("the demo's vision tower")
    }

    /// The device bytes counted for the weights are the f32 values the upload makes of every tensor the CPU
    /// tower holds (so the VRAM a server subtracts for the tower is what it uploads), and the workspace covers
    /// the largest image of the bounds.
    #[test]
    fn vram_accounting_counts_every_uploaded_value() {
        let t = demo_tower();
        let c = &t.config;
        let mut floats = t.patch_embed.proj.rows() * t.patch_embed.proj.cols()
            + t.patch_embed.bias.len()
            + t.pos_embed.table.len()
            + t.rotary.inv_freq().len();
        for b in &t.blocks {
            for l in [&b.norm1, &b.norm2] {
                floats += l.weight.len() + l.bias.len();
            }
            for (mx, bias) in [
                (&b.attn.qkv, &b.attn.qkv_bias),
                (&b.attn.proj, &b.attn.proj_bias),
                (&b.mlp.linear_fc1, &b.mlp.fc1_bias),
                (&b.mlp.linear_fc2, &b.mlp.fc2_bias),
            ] {
                floats += mx.rows() * mx.cols() + bias.len();
            }
        }
        let mg = &t.merger;
        floats += mg.norm.weight.len() + mg.norm.bias.len();
        floats += mg.linear_fc1.rows() * mg.linear_fc1.cols() + mg.fc1_bias.len();
        floats += mg.linear_fc2.rows() * mg.linear_fc2.cols() + mg.fc2_bias.len();
        assert_eq!(CudaVisionModel::weight_bytes_for(c), 4 * floats);
        assert!(VISION_HEAD_DIMS.contains(&c.head_dim()), "the demo tower's head width {}", c.head_dim());
        // A 224 x 224 image at patch 16: 196 patches; the bound's patches hold it.
        let n = max_patches(c, (224 * 224) as u64);
        assert_eq!(n, (224 * 224) / (c.patch * c.patch));
        let lens = workspace_lens(c, n);
        assert_eq!(lens[0], n * c.patch_values());
        assert_eq!(lens[6], n.div_ceil(c.merge * c.merge) * c.out_hidden);
        let want = CudaVisionModel::weight_bytes_for(c) as u64 + 4 * lens.iter().sum::<usize>() as u64;
        assert_eq!(CudaVisionModel::vram_bytes(c, (224 * 224) as u64), want);
        // Larger bounds, more VRAM.
        assert!(CudaVisionModel::vram_bytes(c, 1 << 22) > want);
    }

    /// Every kernel the tower launches exists in the sources (no GPU needed).
    #[test]
    fn every_vision_kernel_a_forward_launches_exists() {
        let names = nebula_kernels::all_kernel_names();
        let mut want: Vec<String> =
            ["vision_bias_act", "vision_bias_residual", "vision_layer_norm", "vision_pos_embed", "vision_rotary"]
                .map(String::from)
                .to_vec();
        want.extend(VISION_HEAD_DIMS.iter().map(|hd| format!("vision_attention_{hd}")));
        for w in want {
            assert!(names.contains(&w), "{w} missing");
        }
    }
}
