//! Image and video preprocessing as the reference processors do it: transformers' `Qwen2VLImageProcessor` (the
//! torchvision backend that `AutoImageProcessor` picks for `qwen4_exp`) and `Qwen3VLVideoProcessor`.
//!
//! 1. Decode PNG, JPEG, WebP or GIF (its first frame) with the `image` crate; the header's dimensions are checked
//!    against the pixel limit before any pixel is decoded.
//! 2. To RGB: an image with an alpha channel is composited onto white as PIL's `alpha_composite` does it (what
//!    transformers' `convert_to_rgb` calls), in PIL's fixed-point arithmetic.
//! 3. Smart resize: height and width rounded to multiples of `patch * merge` keeping the aspect ratio, scaled
//!    into `[min_pixels, max_pixels]` (`smart_resize` of `image_processing_qwen2_vl.py`; the video version
//!    counts `frames * height * width`).
//! 4. Resize: bicubic with antialiasing, as torchvision resizes a `uint8` image on the CPU (PyTorch's native
//!    `uint8` path, Pillow-SIMD's integer convolution): Keys' cubic with `a = -0.5`, support widened by the scale
//!    when shrinking, weights as fixed-point integers; width first into a `uint8` image, then height.
//! 5. Normalise: `(x - 255 mean) / (255 std)` in `f32` (the processor's fused rescale and normalise).
//! 6. Patchify: `[patches, 3 * temporal * patch * patch]`, patches in spatial-merge-block order (each `merge x
//!    merge` square contiguous, squares row-major), each patch's values channel, frame, row, column; an image is
//!    its own frame repeated `temporal` times, a video's frames go in groups of `temporal` (the last frame
//!    repeated to fill the last group).

use std::io::Cursor;

use image::{DynamicImage, ImageFormat, ImageReader, Limits, RgbaImage};

use super::config::VisionConfig;
use super::error::VisionError;

/// An RGB image, `u8` per channel, row-major `[height, width, 3]`.
#[derive(Debug, Clone, PartialEq)]
pub struct RgbImage {
    /// Width, pixels.
    pub width: u32,
    /// Height, pixels.
    pub height: u32,
    /// `height * width * 3` bytes.
    pub data: Vec<u8>,
}

/// Limits on what is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Most pixels (`width * height`) an image may declare; larger ones are refused from their header.
    pub max_pixels: u64,
}

impl Default for DecodeLimits {
    /// 64 megapixels (an 8192 x 8192 image): beyond any camera's output, far below a pixel bomb's.
    fn default() -> Self {
        Self { max_pixels: 64 << 20 }
    }
}

/// The pixels of one image or video for the tower: `[patches, patch_values]` row-major, and its grid in patches.
#[derive(Debug, Clone, PartialEq)]
pub struct PatchedPixels {
    /// Normalised values, `[t * h * w, 3 * temporal * patch * patch]`.
    pub values: Vec<f32>,
    /// `[t, h, w]`: temporal groups and patch rows and columns.
    pub grid_thw: [usize; 3],
}

/// Decodes `bytes` (PNG, JPEG, WebP, GIF's first frame) to RGB, alpha composited onto white.
///
/// Errors: [`VisionError::UnsupportedFormat`] for other formats; [`VisionError::TooLarge`] when the header
/// declares more than `limits.max_pixels` pixels (before decoding); [`VisionError::Corrupt`] for truncated or
/// damaged data; [`VisionError::BadShape`] for a zero side.
pub fn decode_image(bytes: &[u8], limits: DecodeLimits) -> Result<RgbImage, VisionError> {
    let reader =
        ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| VisionError::Corrupt(e.to_string()))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) => {}
        _ => return Err(VisionError::UnsupportedFormat),
    }
    let (width, height) = reader.into_dimensions().map_err(|e| VisionError::Corrupt(e.to_string()))?;
    if width as u64 * height as u64 > limits.max_pixels {
        return Err(VisionError::TooLarge { width: width as u64, height: height as u64, limit: limits.max_pixels });
    }
    if width == 0 || height == 0 {
        return Err(VisionError::BadShape { width, height, problem: "a side is zero".into() });
    }
    let mut reader =
        ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| VisionError::Corrupt(e.to_string()))?;
    let mut l = Limits::default();
    l.max_image_width = Some(width);
    l.max_image_height = Some(height);
    // The decoded image and the decoder's own buffers: a few bytes per pixel beyond the RGBA image.
    l.max_alloc = Some(limits.max_pixels.saturating_mul(16).max(64 << 20));
    reader.limits(l);
    let img = reader.decode().map_err(|e| VisionError::Corrupt(e.to_string()))?;
    Ok(to_rgb(img))
}

/// RGB of a decoded image: images without alpha as they are, with alpha composited onto opaque white as PIL's
/// `Image.alpha_composite(white, image)` computes it (7 fractional bits, `SHIFTFORDIV255` rounding).
fn to_rgb(img: DynamicImage) -> RgbImage {
    let (width, height) = (img.width(), img.height());
    if !img.color().has_alpha() {
        return RgbImage { width, height, data: img.into_rgb8().into_raw() };
    }
    let rgba: RgbaImage = img.into_rgba8();
    let mut data = Vec::with_capacity(width as usize * height as usize * 3);
    for px in rgba.pixels() {
        let a = px[3] as u32;
        // Background alpha 255: outa255 = 255 * 255, so coef1 = a << 7 and coef2 = (255 << 7) - coef1.
        let coef1 = a << 7;
        let coef2 = (255u32 << 7) - coef1;
        for c in 0..3 {
            let tmp = px[c] as u32 * coef1 + 255 * coef2 + (0x80 << 7);
            data.push(((((tmp >> 8) + tmp) >> 8) >> 7) as u8);
        }
    }
    RgbImage { width, height, data }
}

/// `smart_resize` of the image processor: `(height, width)` multiples of `factor` closest to the image's, scaled
/// so that `height * width` lies in `[min_pixels, max_pixels]`, aspect ratio kept.
///
/// Errors: [`VisionError::BadShape`] for an aspect ratio over 200 (as the reference refuses it) or a zero side.
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: usize,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(usize, usize), VisionError> {
    smart_resize_frames(1, height, width, factor, 1, min_pixels, max_pixels)
}

/// Python's `round` (half to even) of a double.
fn py_round(x: f64) -> f64 {
    x.round_ties_even()
}

/// `smart_resize` of the video processor (`frames` counted against the bounds, `frames` rounded to multiples of
/// `temporal`); with `frames = temporal = 1` the image processor's.
fn smart_resize_frames(
    frames: usize,
    height: u32,
    width: u32,
    factor: usize,
    temporal: usize,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(usize, usize), VisionError> {
    if height == 0 || width == 0 {
        return Err(VisionError::BadShape { width, height, problem: "a side is zero".into() });
    }
    let (mut h, mut w) = (height as f64, width as f64);
    if temporal > 1 && (h < factor as f64 || w < factor as f64) {
        // The video version first scales a frame smaller than the factor up to it (int() truncates).
        let scale = (factor as f64 / h).max(factor as f64 / w);
        h = (h * scale).trunc();
        w = (w * scale).trunc();
    }
    if h.max(w) / h.min(w) > 200.0 {
        return Err(VisionError::BadShape {
            width,
            height,
            problem: format!("aspect ratio {:.1} is over 200", h.max(w) / h.min(w)),
        });
    }
    let f = factor as f64;
    let mut h_bar = py_round(h / f) * f;
    let mut w_bar = py_round(w / f) * f;
    let t_bar = (py_round(frames as f64 / temporal as f64) * temporal as f64).max(1.0);
    let n = frames as f64;
    if t_bar * h_bar * w_bar > max_pixels as f64 {
        let beta = ((n * h * w) / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if t_bar * h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (n * h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// Keys' cubic convolution kernel with `a = -0.5` (PyTorch's antialiasing bicubic filter, matching PIL).
fn bicubic_filter(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

/// One axis of the resize: per output index the first input index and its integer taps, and the taps'
/// fractional bits. PyTorch's `_compute_index_ranges_int16_weights`: the antialiased weights in `f64` (support
/// `2 * scale` when shrinking, `2` when growing; normalised to sum 1), then scaled by `2^precision` and rounded
/// half away from zero, `precision` the largest below 22 that keeps twice the largest weight under `2^15`.
fn int_taps(input: usize, output: usize) -> (Vec<(usize, Vec<i32>)>, u32) {
    let scale = input as f64 / output as f64;
    let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
    let max_taps = (support.ceil() as usize) * 2 + 1;
    let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let mut w_max = 0f64;
    let taps: Vec<(usize, Vec<f64>)> = (0..output)
        .map(|i| {
            let center = scale * (i as f64 + 0.5);
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(input as i64) as usize;
            let size = xmax.saturating_sub(xmin).min(max_taps);
            let mut w: Vec<f64> =
                (0..size).map(|j| bicubic_filter((j as f64 + xmin as f64 - center + 0.5) * invscale)).collect();
            let total: f64 = w.iter().sum();
            if total != 0.0 {
                for x in &mut w {
                    *x /= total;
                    w_max = w_max.max(*x);
                }
            }
            (xmin, w)
        })
        .collect();
    let mut precision = 0u32;
    while precision < 22 {
        if (0.5 + w_max * (1u64 << (precision + 1)) as f64) as i64 >= 1 << 15 {
            break;
        }
        precision += 1;
    }
    let one = (1u64 << precision) as f64;
    let taps = taps
        .into_iter()
        .map(|(x0, w)| {
            let q =
                w.iter().map(|&v| v * one).map(|v| if v < 0.0 { (v - 0.5) as i32 } else { (v + 0.5) as i32 }).collect();
            (x0, q)
        })
        .collect();
    (taps, precision)
}

/// One resize pass along an axis of `len` lines of `n` values each `stride` apart: output value =
/// `clamp((2^(p-1) + sum_k src_k w_k) >> p, 0, 255)` (Pillow-SIMD's integer convolution, which PyTorch runs for
/// `uint8` images).
fn int_pass(taps: &[(usize, Vec<i32>)], precision: u32, value: impl Fn(usize) -> i32) -> Vec<u8> {
    taps.iter()
        .map(|(x0, w)| {
            let mut acc: i32 = 1 << (precision.max(1) - 1);
            for (j, &wt) in w.iter().enumerate() {
                acc += value(x0 + j) * wt;
            }
            (acc >> precision).clamp(0, 255) as u8
        })
        .collect()
}

/// Resizes `img` to `height x width` as torchvision resizes a `uint8` image with bicubic antialiasing on the CPU
/// (PyTorch's `upsample_avx_bilinear_bicubic_uint8`): integer taps ([`int_taps`]), width first into a `uint8`
/// image, then height. A side of unchanged size is not resampled.
pub fn resize_bicubic(img: &RgbImage, height: usize, width: usize) -> RgbImage {
    let (ih, iw) = (img.height as usize, img.width as usize);
    if (ih, iw) == (height, width) {
        return img.clone();
    }
    let mid = if iw == width {
        img.data.clone()
    } else {
        let (taps, p) = int_taps(iw, width);
        let mut mid = vec![0u8; ih * width * 3];
        for y in 0..ih {
            for c in 0..3 {
                let row = &img.data[y * iw * 3..(y + 1) * iw * 3];
                for (x, v) in int_pass(&taps, p, |i| row[i * 3 + c] as i32).into_iter().enumerate() {
                    mid[(y * width + x) * 3 + c] = v;
                }
            }
        }
        mid
    };
    let data = if ih == height {
        mid
    } else {
        let (taps, p) = int_taps(ih, height);
        let mut out = vec![0u8; height * width * 3];
        for x in 0..width {
            for c in 0..3 {
                for (y, v) in int_pass(&taps, p, |i| mid[(i * width + x) * 3 + c] as i32).into_iter().enumerate() {
                    out[(y * width + x) * 3 + c] = v;
                }
            }
        }
        out
    };
    RgbImage { width: width as u32, height: height as u32, data }
}

/// Normalised planes `[3, h, w]` of an image: `(x - 255 mean) / (255 std)` in `f32`.
fn normalise(img: &RgbImage, cfg: &VisionConfig) -> Vec<f32> {
    let (h, w) = (img.height as usize, img.width as usize);
    let mut out = vec![0f32; 3 * h * w];
    for c in 0..3 {
        let mean = cfg.image_mean[c] * 255.0;
        let std = cfg.image_std[c] * 255.0;
        for i in 0..h * w {
            out[c * h * w + i] = (img.data[i * 3 + c] as f32 - mean) / std;
        }
    }
    out
}

/// Patchifies `frames` (each normalised `[3, h, w]`, `frames.len()` a multiple of `temporal`) into
/// [`PatchedPixels`] (module doc, step 6).
fn patchify(frames: &[Vec<f32>], h: usize, w: usize, cfg: &VisionConfig) -> PatchedPixels {
    let (p, m, tp) = (cfg.patch, cfg.merge, cfg.temporal_patch);
    let (gh, gw, gt) = (h / p, w / p, frames.len() / tp);
    let per = 3 * tp * p * p;
    let mut values = Vec::with_capacity(gt * gh * gw * per);
    for t in 0..gt {
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (py, px) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            for f in &frames[t * tp..(t + 1) * tp] {
                                for y in 0..p {
                                    let row = c * h * w + (py + y) * w + px;
                                    values.extend_from_slice(&f[row..row + p]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    PatchedPixels { values, grid_thw: [gt, gh, gw] }
}

/// The image processor on one decoded image, with pixel bounds `bounds` (`(min_pixels, max_pixels)`; the
/// tower's when `None`).
///
/// Errors: [`VisionError::BadShape`] from [`smart_resize`].
pub fn preprocess_image(
    img: &RgbImage,
    cfg: &VisionConfig,
    bounds: Option<(u64, u64)>,
) -> Result<PatchedPixels, VisionError> {
    let (min, max) = bounds.unwrap_or((cfg.min_pixels, cfg.max_pixels));
    let (h, w) = smart_resize(img.height, img.width, cfg.factor(), min, max)?;
    let resized = resize_bicubic(img, h, w);
    let plane = normalise(&resized, cfg);
    let frames = vec![plane; cfg.temporal_patch];
    Ok(patchify(&frames, h, w, cfg))
}

/// The video processor on already sampled frames (all of one size), with pixel bounds `bounds` counted over all
/// frames (the tower's image bounds when `None`).
///
/// Errors: [`VisionError::BadVideo`] for fewer frames than the temporal patch or frames of different sizes;
/// [`VisionError::BadShape`] from the resize rule.
pub fn preprocess_video(
    frames: &[RgbImage],
    cfg: &VisionConfig,
    bounds: Option<(u64, u64)>,
) -> Result<PatchedPixels, VisionError> {
    let tp = cfg.temporal_patch;
    let Some(first) = frames.first() else { return Err(VisionError::BadVideo("no frames".into())) };
    if frames.len() < tp {
        return Err(VisionError::BadVideo(format!("{} frames, fewer than the temporal patch of {tp}", frames.len())));
    }
    if let Some(f) = frames.iter().find(|f| (f.width, f.height) != (first.width, first.height)) {
        return Err(VisionError::BadVideo(format!(
            "frames of different sizes ({} x {} and {} x {})",
            first.width, first.height, f.width, f.height
        )));
    }
    let (min, max) = bounds.unwrap_or((cfg.min_pixels, cfg.max_pixels));
    let (h, w) = smart_resize_frames(frames.len(), first.height, first.width, cfg.factor(), tp, min, max)?;
    let mut planes: Vec<Vec<f32>> = frames.iter().map(|f| normalise(&resize_bicubic(f, h, w), cfg)).collect();
    while planes.len() % tp != 0 {
        planes.push(planes.last().expect("at least one frame").clone());
    }
    Ok(patchify(&planes, h, w, cfg))
}

/// The `<t seconds>` timestamps the reference processor writes before each temporal group of a video whose
/// frames were sampled at `frame_indices` of a `fps` stream: the mean time of each group's first and last frame
/// (the last frame repeated to fill the last group), formatted with one decimal as Python's `f"{t:.1f}"`.
pub fn video_timestamps(frame_indices: &[usize], fps: f64, temporal: usize) -> Vec<String> {
    let mut idx = frame_indices.to_vec();
    while !idx.len().is_multiple_of(temporal.max(1)) {
        idx.push(*idx.last().unwrap_or(&0));
    }
    idx.chunks(temporal.max(1))
        .map(|g| {
            let t = (g[0] as f64 / fps + g[g.len() - 1] as f64 / fps) / 2.0;
            format!("<{} seconds>", format_one_decimal(t))
        })
        .collect()
}

/// `f"{x:.1f}"`: the shortest correctly rounded decimal with one fractional digit (ties on the exact binary value
/// go to even, as Python's formatting rounds the exact value).
fn format_one_decimal(x: f64) -> String {
    // Rust's `{:.1}` rounds the exact binary value half to even, as Python does.
    format!("{x:.1}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_follows_the_reference_rule() {
        // 100 x 150 within [4096, 16384] at factor 32: round(3.125)=3, round(4.6875)=5 -> 96 x 160.
        assert_eq!(smart_resize(100, 150, 32, 4096, 16384).unwrap(), (96, 160));
        // Over the maximum: scaled down by sqrt(h w / max), floored to the factor.
        let (h, w) = smart_resize(333, 517, 32, 4096, 16384).unwrap();
        assert!(h * w <= 16384 && h % 32 == 0 && w % 32 == 0);
        // Below the minimum: scaled up, ceiled.
        let (h, w) = smart_resize(37, 29, 32, 65536, 1 << 24).unwrap();
        assert!(h * w >= 65536 && h % 32 == 0);
        assert!(matches!(smart_resize(1, 500, 32, 1, 1 << 30), Err(VisionError::BadShape { .. })));
    }

    #[test]
    fn timestamps_format_as_python() {
        // Frames 0..3 at 2 fps in groups of 2: means 0.25 and 1.25, which Python prints as 0.2 and 1.2.
        assert_eq!(video_timestamps(&[0, 1, 2, 3], 2.0, 2), ["<0.2 seconds>", "<1.2 seconds>"]);
        assert_eq!(video_timestamps(&[0, 1, 2], 1.0, 2), ["<0.5 seconds>", "<2.0 seconds>"]);
    }

    #[test]
    fn resize_to_the_same_size_is_the_identity_and_weights_sum_to_one() {
        let img = RgbImage { width: 3, height: 2, data: (0..18).map(|i| i as u8 * 13).collect() };
        assert_eq!(resize_bicubic(&img, 2, 3), img);
        for (n, m) in [(517, 96), (29, 160)] {
            let (taps, p) = int_taps(n, m);
            for (_, w) in taps {
                let sum: i32 = w.iter().sum();
                assert!((sum - (1 << p)).abs() <= w.len() as i32, "taps sum to one in fixed point");
            }
        }
    }
}
