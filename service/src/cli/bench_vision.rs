//! `nebula bench vision`: the vision tower's time to encode an image of each size, and the time to first token
//! of a one-image prompt (encode, then the prefill with the image's features at its pad rows, then the first
//! token's logits), on the CPU or the GPU.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use nebula_engine::backend::{
    Backend, BackendError, BackendKind, BatchItem, BatchMode, Loaded, MediaRows, WithBackend,
};
use nebula_engine::model::{LogitsFor, Qwen4Exp};
use nebula_engine::vision::rope_index::MediaItem;
use nebula_engine::vision::{MediaPrompt, MediaSpan, PatchedPixels, RgbImage, VisionModel, preprocess_image};

/// Arguments of `nebula bench vision`.
#[derive(clap::Args, Debug)]
pub struct BenchVisionArgs {
    /// GGUF language model (default: the embedded demo model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The vision tower's mmproj GGUF (default: `<model stem>-mmproj.gguf` beside the model, else the embedded
    /// demo's tower for the demo model).
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    /// cpu or cuda (the tower and the language model on the same backend).
    #[arg(long, default_value = "cpu")]
    pub backend: BackendKind,
    /// GPU index for the cuda backend.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Image sizes, `WIDTHxHEIGHT` pixels, comma separated (each resized as the preprocessor resizes it: to
    /// multiples of patch x merge within the tower's pixel bounds).
    #[arg(long, value_delimiter = ',', default_value = "224x224,448x448,896x896")]
    pub sizes: Vec<String>,
    /// Timed runs per size (after one untimed warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Text tokens around the image in the TTFT prompt.
    #[arg(long, default_value_t = 32)]
    pub text: usize,
    /// Prefill chunk size.
    #[arg(long, default_value_t = 2048)]
    pub prefill_chunk: usize,
}

/// `WIDTHxHEIGHT` as (width, height).
fn parse_size(s: &str) -> anyhow::Result<(u32, u32)> {
    let (w, h) = s.trim().split_once(['x', 'X']).with_context(|| format!("image size '{s}': expected WIDTHxHEIGHT"))?;
    let (w, h): (u32, u32) = (w.parse()?, h.parse()?);
    if w == 0 || h == 0 {
        anyhow::bail!("image size '{s}': both sides must be positive");
    }
    Ok((w, h))
}

/// A deterministic test card of `w x h` pixels (smooth gradients and a checkerboard, so every patch differs).
fn test_image(w: u32, h: u32) -> RgbImage {
    let mut data = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            let check = ((x / 16 + y / 16) % 2) as u32 * 64;
            data.extend([(x * 255 / w.max(1)) as u8, (y * 255 / h.max(1)) as u8, ((x + y) % 192 + check) as u8]);
        }
    }
    RgbImage { width: w, height: h, data }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The one-image prompt's prefill on a backend, chunked, the last chunk's last logits wanted: seconds.
struct Prefill<'a> {
    ids: &'a [u32],
    media: &'a MediaPrompt,
    chunk: usize,
    hidden: usize,
}

impl WithBackend for Prefill<'_> {
    type Output = Result<f64, BackendError>;
    fn run<B: Backend>(self, b: &B) -> Self::Output {
        let n = self.ids.len();
        let mut st = b.new_state(n + 1, false)?;
        let t = Instant::now();
        let mut at = 0;
        while at < n {
            let end = (at + self.chunk.max(1)).min(n);
            let (rows, embeds) = self.media.rows_in(at..end, self.hidden);
            let want = if end == n { LogitsFor::Last } else { LogitsFor::None };
            let mut item = BatchItem::text(&mut st, &self.ids[at..end], want);
            item.media = Some(MediaRows { positions: &self.media.positions[at..end], rows: &rows, embeds });
            let logits = b.forward_batch(&mut [item], BatchMode::Fast)?;
            if end == n {
                let first = nebula_engine::sampling::argmax(&logits[0]);
                std::hint::black_box(first);
            }
            at = end;
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Runs `nebula bench vision`.
pub fn run(args: BenchVisionArgs) -> anyhow::Result<()> {
    let sizes: Vec<(u32, u32)> = args.sizes.iter().map(|s| parse_size(s)).collect::<anyhow::Result<_>>()?;
    let model = match &args.model {
        Some(p) => Qwen4Exp::load(p).with_context(|| format!("loading {}", p.display()))?,
        None => Qwen4Exp::from_gguf(Arc::new(nebula_engine::gguf::GgufFile::from_bytes(
            "embedded demo model",
            crate::config::EMBEDDED_DEMO_MODEL.to_vec(),
        )?))?,
    };
    let sibling = args.model.as_ref().and_then(|p| {
        let stem = p.file_stem()?.to_string_lossy().into_owned();
        Some(p.with_file_name(format!("{stem}-mmproj.gguf"))).filter(|s| s.is_file())
    });
    let tower = match (args.mmproj.as_ref(), sibling.as_ref(), &args.model) {
        (Some(p), _, _) | (None, Some(p), _) => {
            VisionModel::load(p).with_context(|| format!("loading the vision tower {}", p.display()))?
        }
        (None, None, None) if !crate::config::EMBEDDED_DEMO_MMPROJ.is_empty() => {
            VisionModel::from_gguf(Arc::new(nebula_engine::gguf::GgufFile::from_bytes(
                crate::config::EMBEDDED_DEMO_MMPROJ_LABEL,
                crate::config::EMBEDDED_DEMO_MMPROJ.to_vec(),
            )?))?
        }
        _ => anyhow::bail!("no vision tower: pass --mmproj FILE (the model's mmproj GGUF)"),
    };
    let hidden = model.config.hidden;
    if tower.config.out_hidden != hidden {
        anyhow::bail!("the tower's features are {} wide, the model's hidden size {hidden}", tower.config.out_hidden);
    }
    let cfg = tower.config.clone();
    let factor = cfg.factor() as u64;
    // Bounds that keep each size (rounded to the factor): the benchmark times the sizes asked for.
    let largest = sizes.iter().map(|&(w, h)| w as u64 * h as u64).max().unwrap_or(1);
    let bounds = (factor * factor, (largest + 2 * factor * (largest as f64).sqrt() as u64 + factor * factor));
    let gpu_tower = match args.backend {
        BackendKind::Cuda { .. } => Some(
            nebula_engine::backend::cuda::CudaVisionModel::new(&tower, args.gpu, bounds.1)
                .context("the vision tower on the GPU")?,
        ),
        BackendKind::Cpu => None,
    };
    let kind = match args.backend {
        BackendKind::Cuda { vram_budget, .. } => BackendKind::Cuda { device: args.gpu, vram_budget },
        other => other,
    };
    let t = Instant::now();
    let runner = Loaded::new(Arc::new(model), kind, &crate::cli::bench::tuning_from_env()?.cuda)?;
    println!(
        "model: {}, loaded in {:.1} s; tower: {} blocks, width {}, heads {}, patch {}, on {}",
        runner.describe(),
        t.elapsed().as_secs_f64(),
        cfg.depth,
        cfg.hidden,
        cfg.heads,
        cfg.patch,
        gpu_tower.as_ref().map_or("the CPU".to_owned(), |g| format!(
            "{} ({:.1} MiB of VRAM)",
            g.gpu_name(),
            g.device_bytes() as f64 / (1u64 << 20) as f64
        ))
    );
    let vocab = runner.config().vocab;
    println!(
        "{:>11} {:>8} {:>7} {:>11} {:>11} {:>9}",
        "size", "patches", "tokens", "encode ms", "prefill ms", "TTFT ms"
    );
    for &(w, h) in &sizes {
        let pixels: PatchedPixels = preprocess_image(&test_image(w, h), &cfg, Some(bounds))?;
        let encode = |p: &PatchedPixels| -> anyhow::Result<Vec<f32>> {
            Ok(match &gpu_tower {
                Some(g) => g.forward(p)?,
                None => tower.forward(p),
            })
        };
        let mut features = encode(&pixels)?;
        let mut times = Vec::with_capacity(args.repeats.max(1));
        for _ in 0..args.repeats.max(1) {
            let t = Instant::now();
            features = encode(&pixels)?;
            times.push(t.elapsed().as_secs_f64());
        }
        let enc = median(times);
        let [_, gh, gw] = pixels.grid_thw;
        let span = MediaSpan { start: args.text / 2, rows: gh / cfg.merge, cols: gw / cfg.merge };
        let mut ids = super::RandomTokens::new(7, vocab as u64).take(args.text + span.len());
        let pad = ids[span.start];
        ids[span.start..span.start + span.len()].fill(pad);
        let item = MediaItem { span, features, content_hash: 1 };
        let media = MediaPrompt::new(&ids, &[item], vocab, hidden).map_err(anyhow::Error::msg)?;
        let prefill = |_: ()| runner.run(Prefill { ids: &ids, media: &media, chunk: args.prefill_chunk, hidden });
        prefill(())?;
        let mut times = Vec::with_capacity(args.repeats.max(1));
        for _ in 0..args.repeats.max(1) {
            times.push(prefill(())?);
        }
        let pre = median(times);
        println!(
            "{:>11} {:>8} {:>7} {:>11.2} {:>11.2} {:>9.2}",
            format!("{w}x{h}"),
            gh * gw,
            span.len(),
            enc * 1e3,
            pre * 1e3,
            (enc + pre) * 1e3
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_bad_ones_are_named() {
        assert_eq!(parse_size("448x224").unwrap(), (448, 224));
        assert_eq!(parse_size(" 32X64").unwrap(), (32, 64));
        for bad in ["448", "0x10", "ax5"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        let img = test_image(40, 30);
        assert_eq!(img.data.len(), 40 * 30 * 3);
    }
}
