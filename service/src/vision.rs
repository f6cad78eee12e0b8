//! Images in requests: reading an `image_url` part (a `data:` URL, or a local file when the config allows it; no
//! network fetches), decoding, preprocessing and the vision tower (all on the blocking thread the request is
//! prepared on, so they never hold up the runtime or the engine's worker; the tower runs on the GPU when the
//! server loaded it there, `nebula_engine::backend::cuda::CudaVisionModel`), and turning the prompt's one
//! `<|image_pad|>` per image (what the chat template renders) into as many pad tokens as the image has features,
//! with every token's 3-D position ([`nebula_engine::vision::MediaPrompt`]).
//!
//! The Responses API's `input_image` and Anthropic's `image` blocks are rebuilt as `image_url` parts by
//! `crate::conversation`; each part may carry [`PARAM_KEY`], the request path a 400 names (`input[0].content[1]`).

use std::path::Path;
use std::sync::Arc;

use base64::Engine as _;
use nebula_engine::vision::rope_index::MediaItem;
use nebula_engine::vision::{
    DecodeLimits, MediaPrompt, MediaSpan, VisionError, VisionModel, decode_image, preprocess_image,
};
use serde_json::{Map, Value};

use crate::config::VisionConfig;
use crate::error::ApiError;

/// The key of an `image_url` part that holds the request path of the image in the client's own API (set by the
/// Responses and Messages conversions; chat completions parts are named `messages[i].content[j]`).
pub const PARAM_KEY: &str = "nebula_param";

/// One image of a request, in the order the template renders them.
#[derive(Debug, Clone)]
pub struct ImageRef {
    /// The request path a 400 names.
    pub param: String,
    /// The URL as sent.
    pub url: String,
}

/// The URL of an `image_url` part (`{"image_url": {"url": ...}}` or `{"image_url": "..."}`), or a 400.
pub fn part_url(part: &Map<String, Value>, param: &str) -> Result<String, ApiError> {
    let url = match part.get("image_url") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => o.get("url").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    };
    url.filter(|u| !u.is_empty())
        .ok_or_else(|| ApiError::invalid("An `image_url` part needs `image_url.url`, a data: URL.", param))
}

/// The bytes of an image URL: a `data:` URL (base64 or percent-encoded), or with `allow_local_files` a
/// `file://` URL or absolute path (under `local_files_root` when set).
///
/// Errors: 400 naming `param`: a remote URL (never fetched), a local path when not allowed or outside the root,
/// an unreadable file, malformed base64.
pub fn read_url(url: &str, cfg: &VisionConfig, param: &str) -> Result<Vec<u8>, ApiError> {
    let bad = |m: String| ApiError::invalid(m, param.to_owned());
    if let Some(rest) = url.strip_prefix("data:") {
        let Some((meta, data)) = rest.split_once(',') else {
            return Err(bad("A data: URL needs a comma before its data.".into()));
        };
        if meta.ends_with(";base64") {
            let clean: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
            return base64::engine::general_purpose::STANDARD
                .decode(clean.as_bytes())
                .map_err(|e| bad(format!("The data: URL's base64 does not decode: {e}.")));
        }
        return Ok(percent_decode(data));
    }
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("http://")
        || lower.starts_with("https://")
        || lower.contains("://") && !lower.starts_with("file://")
    {
        return Err(bad(
            "Remote image URLs are not fetched: this server makes no network requests. Send the image inline as a \
             data: URL (data:image/png;base64,...)."
                .into(),
        ));
    }
    let path = url.strip_prefix("file://").unwrap_or(url);
    if !cfg.allow_local_files {
        return Err(bad(
            "Local image paths are not read unless the server sets vision.allow_local_files; send the image as a \
             data: URL."
                .into(),
        ));
    }
    let path = Path::new(path);
    if !path.is_absolute() {
        return Err(bad(format!("A local image path must be absolute, got {}.", path.display())));
    }
    let real =
        path.canonicalize().map_err(|e| bad(format!("The image file {} cannot be read: {e}.", path.display())))?;
    if let Some(root) = &cfg.local_files_root {
        let root = root.canonicalize().unwrap_or_else(|_| root.clone());
        if !real.starts_with(&root) {
            return Err(bad(format!("The image file {} is outside vision.local_files_root.", path.display())));
        }
    }
    std::fs::read(&real).map_err(|e| bad(format!("The image file {} cannot be read: {e}.", path.display())))
}

fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16)
        {
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// An image made ready for the prompt: its features and merged grid.
#[derive(Debug, Clone)]
pub struct EncodedImage {
    /// Merged grid rows.
    pub rows: usize,
    /// Merged grid columns.
    pub cols: usize,
    /// `[rows * cols, hidden]`.
    pub features: Vec<f32>,
    /// Hash of the image's bytes and the processing bounds.
    pub content_hash: u64,
}

/// Reads, decodes, preprocesses and runs the tower on every image (blocking work: call from a blocking thread):
/// on the GPU when `gpu` is the tower there, else on the CPU.
///
/// Errors: 400 naming the image's part: unreadable, corrupt, truncated, over the pixel limit, an unsupported
/// format, a bad aspect ratio; more images than `max_images`; 500 when the GPU tower fails.
pub fn encode_images(
    tower: &VisionModel,
    gpu: Option<&nebula_engine::backend::cuda::CudaVisionModel>,
    images: &[ImageRef],
    cfg: &VisionConfig,
) -> Result<Vec<EncodedImage>, ApiError> {
    if images.len() > cfg.max_images {
        return Err(ApiError::invalid(
            format!(
                "The request has {} images; this server takes at most {} (vision.max_images).",
                images.len(),
                cfg.max_images
            ),
            images[cfg.max_images].param.clone(),
        ));
    }
    let bounds = (cfg.min_pixels.unwrap_or(tower.config.min_pixels), cfg.max_pixels.unwrap_or(tower.config.max_pixels));
    let limits = DecodeLimits { max_pixels: cfg.max_decode_pixels };
    images
        .iter()
        .map(|img| {
            let bytes = read_url(&img.url, cfg, &img.param)?;
            let rgb = decode_image(&bytes, limits).map_err(|e| vision_error(&e, &img.param))?;
            let pixels =
                preprocess_image(&rgb, &tower.config, Some(bounds)).map_err(|e| vision_error(&e, &img.param))?;
            let [_, h, w] = pixels.grid_thw;
            let m = tower.config.merge;
            let features = match gpu {
                Some(g) => g
                    .forward(&pixels)
                    .map_err(|e| ApiError::Internal(format!("the vision tower on the GPU failed: {e}")))?,
                None => tower.forward(&pixels),
            };
            let content_hash =
                nebula_engine::vision::rope_index::content_hash(&bytes, bounds.0 ^ bounds.1.rotate_left(32));
            Ok(EncodedImage { rows: h / m, cols: w / m, features, content_hash })
        })
        .collect()
}

/// A 400 for an image that could not be used.
fn vision_error(e: &VisionError, param: &str) -> ApiError {
    ApiError::invalid(format!("The image could not be used: {e}."), param.to_owned())
}

/// Expands each `<|image_pad|>` of `ids` (one per image, as the template renders them) into its image's tokens
/// and builds the media the engine takes.
///
/// Errors: 500 when the prompt holds another number of image pads than images (the template did not render
/// them), 400 (the first image's part) for features of the wrong width.
pub fn expand_prompt(
    ids: &[u32],
    image_pad: u32,
    images: &[EncodedImage],
    refs: &[ImageRef],
    vocab: usize,
    hidden: usize,
) -> Result<(Vec<u32>, Arc<MediaPrompt>), ApiError> {
    let pads = ids.iter().filter(|&&t| t == image_pad).count();
    if pads != images.len() {
        return Err(ApiError::Internal(format!(
            "the rendered prompt has {pads} image placeholders for {} images",
            images.len()
        )));
    }
    let mut out = Vec::with_capacity(ids.len() + images.iter().map(|i| i.rows * i.cols).sum::<usize>());
    let mut items = Vec::with_capacity(images.len());
    let mut next = images.iter();
    for &t in ids {
        if t != image_pad {
            out.push(t);
            continue;
        }
        let img = next.next().expect("counted above");
        let span = MediaSpan { start: out.len(), rows: img.rows, cols: img.cols };
        out.extend(std::iter::repeat_n(image_pad, span.len()));
        items.push(MediaItem { span, features: img.features.clone(), content_hash: img.content_hash });
    }
    let media = MediaPrompt::new(&out, &items, vocab, hidden).map_err(|e| {
        ApiError::invalid(format!("image input: {e}"), refs.first().map_or("messages".into(), |r| r.param.clone()))
    })?;
    Ok((out, Arc::new(media)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_read_only_from_data_or_allowed_files() {
        let cfg = VisionConfig::default();
        assert_eq!(read_url("data:image/png;base64,aGk=", &cfg, "p").unwrap(), b"hi");
        assert_eq!(read_url("data:text/plain,a%20b", &cfg, "p").unwrap(), b"a b");
        let remote = read_url("https://example.com/a.png", &cfg, "messages[0].content[1]").unwrap_err();
        assert!(format!("{remote:?}").contains("network"), "{remote:?}");
        let local = read_url("/etc/hostname", &cfg, "p").unwrap_err();
        assert!(format!("{local:?}").contains("allow_local_files"));
        assert!(read_url("data:image/png;base64,@@@", &cfg, "p").is_err());
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.bin");
        std::fs::write(&f, b"xyz").unwrap();
        let open = VisionConfig { allow_local_files: true, local_files_root: Some(dir.path().into()), ..cfg };
        assert_eq!(read_url(&format!("file://{}", f.display()), &open, "p").unwrap(), b"xyz");
        assert!(read_url("/etc/hostname", &open, "p").is_err(), "outside the root");
    }
}
