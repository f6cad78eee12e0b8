//! Vision input against the reference implementation.
//!
//! `scripts/make_vision_golden.py` ran transformers 5.24's image and video processors on committed images of odd
//! sizes and `Qwen4ExpForConditionalGeneration` (random init, a tiny tower of the real architecture) on prompts
//! with one image, two images of different sizes and a 4-frame video, and stored the pixel tensors, grids, merged
//! features, 3-D position ids and the logits of a prefill plus 4 decode steps. Here `nebula convert --mmproj`
//! writes the tower and the language model from the same checkpoint and the engine must reproduce them: pixel
//! tensors within 1e-5 (PNG; JPEG decoders may differ in the IDCT's last bit), position ids exactly, features
//! within 1e-4 x max|feature|, logits within 1e-4 x max|logit| with the same top-1 at every row.

use std::path::PathBuf;

use nebula_engine::backend::{Backend, BatchItem, MediaRows};
use nebula_engine::convert::{ConvertOptions, OutType, convert, convert_mmproj};
use nebula_engine::model::{LogitsFor, Qwen4Exp};
use nebula_engine::vision::{
    DecodeLimits, MediaPrompt, MediaSpan, PatchedPixels, VisionError, VisionModel, decode_image, preprocess_image,
    preprocess_video,
};
use serde_json::Value;

fn dir() -> PathBuf {
    nebula_tests::repo_root().join("tests/fixtures/vision")
}

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("golden.json")).unwrap()).unwrap()
}

fn f32s(path: PathBuf) -> Vec<f32> {
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn grid(v: &Value) -> [usize; 3] {
    let a: Vec<usize> = v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
    [a[0], a[1], a[2]]
}

/// The tower and the language model converted from the golden checkpoint (F32).
fn models() -> (VisionModel, Qwen4Exp, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let mm = tmp.path().join("mmproj.gguf");
    let lm = tmp.path().join("lm.gguf");
    convert_mmproj(&dir().join("model"), &mm, OutType::F32, None).expect("convert the tower");
    convert(&dir().join("model"), &lm, &ConvertOptions { out_type: OutType::F32, ..Default::default() })
        .expect("convert");
    (VisionModel::load(&mm).expect("load the tower"), Qwen4Exp::load(&lm).expect("load the language model"), tmp)
}

fn max_rel(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let max_ref = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    ours.iter().zip(reference).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / max_ref
}

fn image(name: &str) -> nebula_engine::vision::RgbImage {
    let bytes = std::fs::read(dir().join("images").join(name)).unwrap();
    decode_image(&bytes, DecodeLimits::default()).unwrap()
}

#[test]
fn pixels_equal_the_reference_processor() {
    let g = golden();
    let (tower, _, _tmp) = models();
    for (case, c) in g["pixels"].as_object().unwrap() {
        let reference = f32s(dir().join("pixels").join(format!("{case}.bin")));
        let bounds = Some((c["min_pixels"].as_u64().unwrap(), c["max_pixels"].as_u64().unwrap()));
        let ours: PatchedPixels = if case == "video" {
            let frames: Vec<_> = c["frames"].as_array().unwrap().iter().map(|f| image(f.as_str().unwrap())).collect();
            preprocess_video(&frames, &tower.config, bounds).unwrap()
        } else {
            preprocess_image(&image(c["image"].as_str().unwrap()), &tower.config, bounds).unwrap()
        };
        assert_eq!(ours.grid_thw, grid(&c["grid_thw"]), "{case}: grid");
        assert_eq!(ours.values.len(), reference.len(), "{case}: pixel count");
        let worst = ours.values.iter().zip(&reference).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let tolerance = if case.contains("jpeg") { 0.1 } else { 1e-5 };
        eprintln!("{case}: max |delta| {worst:.2e}");
        if case.contains("jpeg") {
            let mean =
                ours.values.iter().zip(&reference).map(|(a, b)| (a - b).abs()).sum::<f32>() / reference.len() as f32;
            assert!(
                mean < 0.01,
                "{case}: mean |delta| {mean} (a JPEG decoder's IDCT rounding differs by a level at most)"
            );
        }
        assert!(worst <= tolerance, "{case}: max |delta| {worst} over {tolerance}");
    }
}

/// The vision runs of a golden prompt: contiguous runs of the image or video token.
fn spans(p: &Value, g: &Value) -> Vec<MediaSpan> {
    let ids: Vec<u32> = p["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let (img, vid) = (g["image_token_id"].as_u64().unwrap() as u32, g["video_token_id"].as_u64().unwrap() as u32);
    let mut grids: Vec<[usize; 3]> = Vec::new();
    for k in ["image_grid_thw", "video_grid_thw"] {
        for gr in p[k].as_array().unwrap() {
            let [t, h, w] = grid(gr);
            grids.extend(std::iter::repeat_n([1, h, w], t));
        }
    }
    let mut out = Vec::new();
    let mut i = 0;
    let mut next = grids.into_iter();
    while i < ids.len() {
        if ids[i] == img || ids[i] == vid {
            let [_, h, w] = next.next().expect("a grid per run");
            out.push(MediaSpan { start: i, rows: h / 2, cols: w / 2 });
            i += h * w / 4;
        } else {
            i += 1;
        }
    }
    out
}

#[test]
fn features_positions_and_logits_match_the_reference() {
    let g = golden();
    let (tower, lm, _tmp) = models();
    let d = lm.config.hidden;
    for (name, p) in g["prompts"].as_object().unwrap() {
        // The tower on the reference processor's pixels.
        let mut features = Vec::new();
        for (media, key) in [("images", "image_grid_thw"), ("videos", "video_grid_thw")] {
            for (case, gr) in p[media].as_array().unwrap().iter().zip(p[key].as_array().unwrap()) {
                let values = f32s(dir().join("pixels").join(format!("{}.bin", case.as_str().unwrap())));
                features.extend(tower.forward(&PatchedPixels { values, grid_thw: grid(gr) }));
            }
        }
        let reference = f32s(dir().join(format!("{name}.features.bin")));
        let feature_err = max_rel(&features, &reference);
        assert!(feature_err < 1e-4, "{name}: features differ by {feature_err} x max|feature|");

        // Positions.
        let ids: Vec<u32> = p["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let spans = spans(p, &g);
        let items: Vec<nebula_engine::vision::rope_index::MediaItem> = {
            let mut at = 0;
            spans
                .iter()
                .map(|s| {
                    let f = features[at * d..(at + s.len()) * d].to_vec();
                    at += s.len();
                    nebula_engine::vision::rope_index::MediaItem { span: *s, features: f, content_hash: at as u64 }
                })
                .collect()
        };
        let media = MediaPrompt::new(&ids, &items, lm.config.vocab, d).unwrap();
        let axes = p["position_ids"].as_array().unwrap();
        for (i, pos) in media.positions.iter().enumerate() {
            for a in 0..3 {
                assert_eq!(pos[a] as u64, axes[a][i].as_u64().unwrap(), "{name}: position of token {i}, axis {a}");
            }
        }

        // Prefill with the features at the pad rows, then decode.
        let decode: Vec<u32> = p["decode_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let mut state = lm.new_state(ids.len() + decode.len());
        let rows: Vec<usize> = media.rows.clone();
        let mut item = BatchItem::text(&mut state, &ids, LogitsFor::All);
        item.media = Some(MediaRows { positions: &media.positions, rows: &rows, embeds: &media.features });
        let mut logits = lm.forward_batch(&mut [item], Default::default()).unwrap().remove(0);
        for &t in &decode {
            logits.extend(lm.forward(&mut state, &[t], LogitsFor::All).unwrap());
        }
        let reference = f32s(dir().join(format!("{name}.logits.bin")));
        let err = max_rel(&logits, &reference);
        let vocab = lm.config.vocab;
        let argmax =
            |r: &[f32]| r.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
        let differ: Vec<usize> = logits
            .chunks_exact(vocab)
            .zip(reference.chunks_exact(vocab))
            .enumerate()
            .filter(|(_, (a, b))| argmax(a) != argmax(b))
            .map(|(i, _)| i)
            .collect();
        eprintln!("{name}: features {feature_err:.2e} x max|feature|, logits {err:.2e} x max|logit|");
        assert!(err <= 1e-4, "{name}: logits differ by {err} x max|logit|");
        assert!(differ.is_empty(), "{name}: top-1 differs at rows {differ:?}");
        // Text after the image continues from the reference's next position.
        let delta = p["rope_delta"].as_i64().unwrap();
        assert_eq!(state.mrope.next_text() as i64, (ids.len() + decode.len()) as i64 + delta, "{name}: next position");
    }
}

#[test]
fn bad_images_are_typed_errors() {
    let png = std::fs::read(dir().join("images/a_100x150.png")).unwrap();
    // Truncated.
    assert!(matches!(decode_image(&png[..png.len() / 2], DecodeLimits::default()), Err(VisionError::Corrupt(_))));
    // Not an image.
    assert_eq!(decode_image(b"hello, world", DecodeLimits::default()), Err(VisionError::UnsupportedFormat));
    // A BMP is a format the decoder does not take.
    let mut bmp = b"BM".to_vec();
    bmp.extend([0u8; 60]);
    assert_eq!(decode_image(&bmp, DecodeLimits::default()), Err(VisionError::UnsupportedFormat));
    // A pixel bomb: a PNG header that declares 100000 x 100000, refused before decoding.
    let mut bomb = png.clone();
    bomb[16..20].copy_from_slice(&100_000u32.to_be_bytes());
    bomb[20..24].copy_from_slice(&100_000u32.to_be_bytes());
    let crc = crc32(&bomb[12..29]);
    bomb[29..33].copy_from_slice(&crc.to_be_bytes());
    let r = decode_image(&bomb, DecodeLimits::default());
    assert!(matches!(r, Err(VisionError::TooLarge { width: 100_000, .. })), "{r:?}");
    // Over a configured limit.
    assert!(matches!(decode_image(&png, DecodeLimits { max_pixels: 1000 }), Err(VisionError::TooLarge { .. })));
}

/// CRC-32 (PNG's chunk checksum).
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

#[test]
fn mmproj_loading_names_the_bad_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    // The language model's GGUF is not an mmproj.
    let lm = tmp.path().join("lm.gguf");
    convert(&dir().join("model"), &lm, &ConvertOptions { out_type: OutType::F32, ..Default::default() }).unwrap();
    let err = VisionModel::load(&lm).unwrap_err().to_string();
    assert!(err.contains("general.architecture") && err.contains("clip"), "{err}");
    // A Q8_0 tower loads (matrices quantized, vectors F32) and gives close features.
    let mm = tmp.path().join("q8.gguf");
    convert_mmproj(&dir().join("model"), &mm, OutType::Q8_0, None).unwrap();
    let tower = VisionModel::load(&mm).unwrap();
    assert_eq!(tower.config.depth, 2);
}
