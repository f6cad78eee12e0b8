//! Images on the CUDA backend against the CPU engine and the reference. These tests need an NVIDIA GPU; run them
//! on a GPU machine with `cargo test --release -p nebula-tests --test gpu_vision -- --ignored --nocapture
//! --test-threads 1`. Without a GPU they are ignored, never passed silently.
//!
//! Truth: the CPU tower and the CPU language model (exact against transformers, `tests/vision.rs`) and the
//! golden logits of `Qwen4ExpForConditionalGeneration` on the prompts of `tests/fixtures/vision` (one image, two
//! images of different sizes, a 4-frame video). Bounds:
//! - the GPU tower's features: max |delta| <= 1e-4 x max |feature| against the CPU tower (both f32; the GPU's
//!   GEMMs are cuBLAS SGEMM without TF32, its attention an online softmax: only summation orders differ);
//! - the GPU language model's logits with the images injected: max |delta| <= 1e-3 x max |logit| against the CPU
//!   and against the reference, with the same top-1 at every row (the bound of the text GPU tests, `tests/gpu.rs`);
//! - greedy continuations: the same tokens as the CPU; a restored or forked image state: bit for bit its own
//!   continuation.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use nebula_engine::backend::cuda::{CudaModel, CudaState, CudaVisionModel};
use nebula_engine::backend::{Backend, BatchItem, BatchMode, Kept, MediaRows};
use nebula_engine::convert::{ConvertOptions, OutType, convert, convert_mmproj};
use nebula_engine::model::{LogitsFor, Qwen4Exp};
use nebula_engine::tuning::{CudaTuning, Tuning};
use nebula_engine::vision::rope_index::MediaItem;
use nebula_engine::vision::{MediaPrompt, MediaSpan, PatchedPixels, VisionModel};
use serde_json::Value;

fn tuning() -> &'static CudaTuning {
    static TUNING: std::sync::OnceLock<CudaTuning> = std::sync::OnceLock::new();
    TUNING.get_or_init(|| Tuning::from_env().expect("the NEBULA_* tuning variables parse").cuda)
}

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

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The golden checkpoint's tower and language model (F32) in `tmp`.
fn golden_models(tmp: &Path) -> (VisionModel, PathBuf) {
    let mm = tmp.join("mmproj.gguf");
    let lm = tmp.join("lm.gguf");
    convert_mmproj(&dir().join("model"), &mm, OutType::F32, None).expect("convert the tower");
    convert(&dir().join("model"), &lm, &ConvertOptions { out_type: OutType::F32, ..Default::default() })
        .expect("convert");
    (VisionModel::load(&mm).expect("load the tower"), lm)
}

/// max |a - b| / max |b| over finite values (a masked `-inf` must be masked on both sides).
fn max_rel(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let max_ref = reference.iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
    let worst = ours.iter().zip(reference).fold(0f32, |m, (&a, &b)| {
        if a == f32::NEG_INFINITY && b == f32::NEG_INFINITY {
            return m;
        }
        assert!(a.is_finite() && b.is_finite(), "{a} vs {b}");
        m.max((a - b).abs())
    });
    worst / max_ref
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0
}

/// Rows (of `vocab` logits) whose top-1 differs.
fn top1_differs(a: &[f32], b: &[f32], vocab: usize) -> Vec<usize> {
    a.chunks_exact(vocab)
        .zip(b.chunks_exact(vocab))
        .enumerate()
        .filter(|(_, (x, y))| argmax(x) != argmax(y))
        .map(|(i, _)| i)
        .collect()
}

/// One golden prompt: its ids, the decode ids, and the pixels of its images or video groups with their grids.
struct Prompt {
    name: String,
    ids: Vec<u32>,
    decode: Vec<u32>,
    pixels: Vec<PatchedPixels>,
    spans: Vec<MediaSpan>,
}

fn prompts(g: &Value) -> Vec<Prompt> {
    let (img, vid) = (g["image_token_id"].as_u64().unwrap() as u32, g["video_token_id"].as_u64().unwrap() as u32);
    g["prompts"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, p)| {
            let ids = ids_of(&p["token_ids"]);
            let mut pixels = Vec::new();
            let mut grids: Vec<[usize; 3]> = Vec::new();
            for (media, key) in [("images", "image_grid_thw"), ("videos", "video_grid_thw")] {
                for (case, gr) in p[media].as_array().unwrap().iter().zip(p[key].as_array().unwrap()) {
                    let values = f32s(dir().join("pixels").join(format!("{}.bin", case.as_str().unwrap())));
                    let gr = grid(gr);
                    pixels.push(PatchedPixels { values, grid_thw: gr });
                    grids.extend(std::iter::repeat_n([1, gr[1], gr[2]], gr[0]));
                }
            }
            let mut spans = Vec::new();
            let (mut i, mut next) = (0, grids.into_iter());
            while i < ids.len() {
                if ids[i] == img || ids[i] == vid {
                    let [_, h, w] = next.next().expect("a grid per run");
                    spans.push(MediaSpan { start: i, rows: h / 2, cols: w / 2 });
                    i += h * w / 4;
                } else {
                    i += 1;
                }
            }
            Prompt { name: name.clone(), ids, decode: ids_of(&p["decode_ids"]), pixels, spans }
        })
        .collect()
}

/// The media of prompt `p` with `features` (the tower's output for its pixels, in order).
fn media_of(p: &Prompt, features: &[f32], vocab: usize, hidden: usize) -> MediaPrompt {
    let mut at = 0;
    let items: Vec<MediaItem> = p
        .spans
        .iter()
        .map(|s| {
            let f = features[at * hidden..(at + s.len()) * hidden].to_vec();
            at += s.len();
            MediaItem { span: *s, features: f, content_hash: at as u64 }
        })
        .collect();
    MediaPrompt::new(&p.ids, &items, vocab, hidden).unwrap()
}

/// Prefill of `ids` with `media` in chunks of `chunk` tokens (every row's logits), then one decode step per
/// `decode` id (its logits appended).
fn run<B: Backend>(
    b: &B,
    st: &mut B::State,
    ids: &[u32],
    media: &MediaPrompt,
    chunk: usize,
    decode: &[u32],
) -> Vec<f32> {
    let hidden = b.config().hidden;
    let mut out = Vec::new();
    let mut at = 0;
    while at < ids.len() {
        let end = (at + chunk).min(ids.len());
        let (rows, embeds) = media.rows_in(at..end, hidden);
        let mut item = BatchItem::text(&mut *st, &ids[at..end], LogitsFor::All);
        item.media = Some(MediaRows { positions: &media.positions[at..end], rows: &rows, embeds });
        out.extend(b.forward_batch(&mut [item], BatchMode::Fast).unwrap().remove(0));
        at = end;
    }
    for &t in decode {
        out.extend(b.forward(st, &[t], LogitsFor::All).unwrap());
    }
    out
}

/// `steps` greedy tokens after the logits `last` (`[vocab]`).
fn greedy<B: Backend>(b: &B, st: &mut B::State, last: &[f32], steps: usize) -> Vec<u32> {
    let mut t = argmax(last) as u32;
    let mut out = vec![t];
    for _ in 1..steps {
        t = argmax(&b.forward(st, &[t], LogitsFor::Last).unwrap()) as u32;
        out.push(t);
    }
    out
}

/// Features of the GPU tower against the CPU tower's: the demo's tower (`models/`), the golden checkpoint's on
/// its images and its 4-frame video (two temporal groups, so attention is per frame), and synthetic towers of the
/// released widths (head width 64 and 72) on a 448 x 336 image.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-tests --test gpu_vision -- --ignored"]
fn gpu_tower_features_match_the_cpu_tower() {
    let tmp = tempfile::tempdir().unwrap();
    let mut towers: Vec<(String, VisionModel, Vec<PatchedPixels>)> = Vec::new();
    let card = |cfg: &nebula_engine::vision::VisionConfig, w: u32, h: u32| {
        let data: Vec<u8> = (0..w * h * 3).map(|i| ((i * 37 + i / 7) % 251) as u8).collect();
        let img = nebula_engine::vision::RgbImage { width: w, height: h, data };
        nebula_engine::vision::preprocess_image(&img, cfg, Some((1024, 1 << 22))).unwrap()
    };
    let demo = VisionModel::load(&nebula_tests::repo_root().join("models/nebula-demo-mmproj.gguf")).unwrap();
    let demo_px = vec![card(&demo.config, 224, 160), card(&demo.config, 100, 300)];
    towers.push(("demo".into(), demo, demo_px));
    let (g_tower, _) = golden_models(tmp.path());
    let g_px: Vec<PatchedPixels> = prompts(&golden()).into_iter().flat_map(|p| p.pixels).collect();
    towers.push(("golden".into(), g_tower, g_px));
    for (hidden, heads) in [(1024usize, 16usize), (1152, 16)] {
        let path = tmp.path().join(format!("synth-{hidden}.gguf"));
        let shape = nebula_engine::synth::vision::SynthVision {
            depth: 2,
            hidden,
            heads,
            intermediate: 4 * hidden,
            out_hidden: 256,
            ..nebula_engine::synth::vision::SynthVision::real(256)
        };
        nebula_engine::synth::vision::synth_mmproj(&path, &shape, 5).unwrap();
        let t = VisionModel::load(&path).unwrap();
        let px = vec![card(&t.config, 448, 336)];
        towers.push((format!("synthetic {hidden} wide, {heads} heads"), t, px));
    }
    for (name, cpu, pixels) in &towers {
        let most = pixels.iter().map(|p| p.grid_thw.iter().product::<usize>()).max().unwrap();
        let gpu = CudaVisionModel::new(cpu, 0, (most * cpu.config.patch * cpu.config.patch) as u64).unwrap();
        for (i, p) in pixels.iter().enumerate() {
            let want = cpu.forward(p);
            let got = gpu.forward(p).unwrap();
            let err = max_rel(&got, &want);
            println!("{name} tower, pixels {i} (grid {:?}): GPU vs CPU {err:.2e} x max|feature|", p.grid_thw);
            assert!(err <= 1e-4, "{name} tower, pixels {i}: {err:.2e} x max|feature|");
        }
    }
    // Pixels that do not fit the grid are an error, not a crash.
    let (_, cpu, pixels) = &towers[0];
    let gpu = CudaVisionModel::new(cpu, 0, 1 << 16).unwrap();
    let short = PatchedPixels { values: pixels[0].values[1..].to_vec(), grid_thw: pixels[0].grid_thw };
    assert!(gpu.forward(&short).is_err());
}

/// The CUDA language model (all-GPU and hybrid) on the golden prompts with one image, two images and a video:
/// the CPU tower's features injected at the pad rows, every row at its M-RoPE position; prefill whole and in
/// chunks of 5 (pooled QSA blocks of earlier chunks rotate at their image positions), then 4 decode steps. Logits
/// against the CPU backend and the reference; 4 greedy tokens equal to the CPU's; the GPU tower end to end gives
/// the same top-1 tokens.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-tests --test gpu_vision -- --ignored"]
fn cuda_language_model_with_images_matches_the_cpu_and_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let g = golden();
    let (tower, lm) = golden_models(tmp.path());
    let cpu = Qwen4Exp::load(&lm).unwrap();
    let (vocab, hidden) = (cpu.config.vocab, cpu.config.hidden);
    let gpu_tower = CudaVisionModel::new(&tower, 0, 1 << 20).unwrap();
    let all_gpu = CudaModel::from_cpu(&cpu, 0, None, tuning()).expect("the GPU model loads");
    let hybrid = {
        let mut m = Qwen4Exp::load(&lm).unwrap();
        m.place(&nebula_engine::placement::PlacementOptions {
            gpu_experts: 2,
            ram_experts: usize::MAX,
            lock_memory: false,
            ..Default::default()
        })
        .unwrap();
        CudaModel::hybrid(Arc::new(m), 0, None, tuning()).expect("the hybrid model loads")
    };
    for p in prompts(&g) {
        let features: Vec<f32> = p.pixels.iter().flat_map(|px| tower.forward(px)).collect();
        let media = media_of(&p, &features, vocab, hidden);
        let total = p.ids.len() + p.decode.len() + 8;
        let mut cs = cpu.new_state(total);
        let want = run(&cpu, &mut cs, &p.ids, &media, p.ids.len(), &p.decode);
        let cpu_greedy = greedy(&cpu, &mut cs, &want[want.len() - vocab..], 4);
        let reference = f32s(dir().join(format!("{}.logits.bin", p.name)));
        for (label, model) in [("all-GPU", &all_gpu), ("hybrid", &hybrid)] {
            for chunk in [p.ids.len(), 5] {
                let mut st = model.new_state(total).unwrap();
                let got = run(model, &mut st, &p.ids, &media, chunk, &p.decode);
                let (vs_cpu, vs_ref) = (max_rel(&got, &want), max_rel(&got, &reference));
                let (d_cpu, d_ref) = (top1_differs(&got, &want, vocab), top1_differs(&got, &reference, vocab));
                println!(
                    "{} {label} chunk {chunk}: GPU vs CPU {vs_cpu:.2e} (top-1 differs at {d_cpu:?}), vs reference {vs_ref:.2e} ({d_ref:?})",
                    p.name
                );
                assert!(
                    vs_cpu <= 1e-3 && d_cpu.is_empty(),
                    "{} {label} chunk {chunk}: vs CPU {vs_cpu:.2e} {d_cpu:?}",
                    p.name
                );
                assert!(
                    vs_ref <= 1e-3 && d_ref.is_empty(),
                    "{} {label} chunk {chunk}: vs ref {vs_ref:.2e} {d_ref:?}",
                    p.name
                );
                let toks = greedy(model, &mut st, &got[got.len() - vocab..], 4);
                assert_eq!(toks, cpu_greedy, "{} {label} chunk {chunk}: greedy tokens", p.name);
            }
        }
        // End to end on the GPU: the GPU tower's features into the GPU model.
        let gfeat: Vec<f32> = p.pixels.iter().flat_map(|px| gpu_tower.forward(px).unwrap()).collect();
        let gmedia = media_of(&p, &gfeat, vocab, hidden);
        let mut st = all_gpu.new_state(total).unwrap();
        let got = run(&all_gpu, &mut st, &p.ids, &gmedia, p.ids.len(), &p.decode);
        let d = top1_differs(&got, &want, vocab);
        println!("{} end to end on the GPU: vs CPU {:.2e}, top-1 differs at {d:?}", p.name, max_rel(&got, &want));
        assert!(d.is_empty(), "{} end to end: top-1 differs at {d:?}", p.name);
    }
}

/// Two image prompts in one batched pass on the GPU (and a text sequence beside them) give each its own logits:
/// within the bound of the CPU's, with the same top-1, as each run alone.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-tests --test gpu_vision -- --ignored"]
fn image_prompts_batch_with_each_other_and_with_text() {
    let tmp = tempfile::tempdir().unwrap();
    let g = golden();
    let (tower, lm) = golden_models(tmp.path());
    let cpu = Qwen4Exp::load(&lm).unwrap();
    let (vocab, hidden) = (cpu.config.vocab, cpu.config.hidden);
    let gpu = CudaModel::from_cpu(&cpu, 0, None, tuning()).unwrap();
    let ps = prompts(&g);
    let medias: Vec<MediaPrompt> = ps
        .iter()
        .map(|p| media_of(p, &p.pixels.iter().flat_map(|px| tower.forward(px)).collect::<Vec<_>>(), vocab, hidden))
        .collect();
    let text: Vec<u32> = ps[0].ids.iter().map(|&t| (t * 7 + 3) % 400).collect();
    let mut states: Vec<CudaState> = (0..ps.len() + 1).map(|_| gpu.new_state(64).unwrap()).collect();
    let mut cstates: Vec<_> = (0..ps.len() + 1).map(|_| cpu.new_state(64)).collect();
    let (last, first) = states.split_at_mut(ps.len());
    let mut items: Vec<BatchItem<'_, CudaState>> = Vec::new();
    let rows: Vec<Vec<usize>> = medias.iter().map(|m| m.rows.clone()).collect();
    for ((st, p), (m, r)) in last.iter_mut().zip(&ps).zip(medias.iter().zip(&rows)) {
        let mut it = BatchItem::text(st, &p.ids, LogitsFor::All);
        it.media = Some(MediaRows { positions: &m.positions, rows: r, embeds: &m.features });
        items.push(it);
    }
    items.push(BatchItem::text(&mut first[0], &text, LogitsFor::All));
    let batched = gpu.forward_batch(&mut items, BatchMode::Fast).unwrap();
    for (i, out) in batched.iter().enumerate() {
        let want = if i < ps.len() {
            let m = &medias[i];
            let mut it = BatchItem::text(&mut cstates[i], &ps[i].ids, LogitsFor::All);
            it.media = Some(MediaRows { positions: &m.positions, rows: &m.rows, embeds: &m.features });
            cpu.forward_batch(&mut [it], BatchMode::Fast).unwrap().remove(0)
        } else {
            cpu.forward(&mut cstates[i], &text, LogitsFor::All).unwrap()
        };
        let err = max_rel(out, &want);
        let d = top1_differs(out, &want, vocab);
        println!("batch item {i}: GPU vs CPU {err:.2e}, top-1 differs at {d:?}");
        assert!(err <= 1e-3 && d.is_empty(), "batch item {i}: {err:.2e} {d:?}");
    }
    // Decoding on after the batch: the image states continue from their M-RoPE tracks.
    for (i, st) in states.iter_mut().enumerate().take(ps.len()) {
        let t = argmax(&batched[i][batched[i].len() - vocab..]) as u32;
        let got = gpu.forward(st, &[t], LogitsFor::Last).unwrap();
        let want = cpu.forward(&mut cstates[i], &[t], LogitsFor::Last).unwrap();
        assert!(max_rel(&got, &want) <= 1e-3 && argmax(&got) == argmax(&want), "item {i}: the step after the batch");
    }
}

/// An image state's snapshot, restored on the live state, forked live and forked from its host image (spilled,
/// as the prefix cache keeps it), continues exactly as the state itself: the same logits bit for bit for the
/// same tokens (the M-RoPE track travels with it; a track reset to text positions would move every position
/// after the image).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-tests --test gpu_vision -- --ignored"]
fn an_image_state_survives_snapshot_restore_fork_and_spill() {
    let tmp = tempfile::tempdir().unwrap();
    let g = golden();
    let (tower, lm) = golden_models(tmp.path());
    let cpu = Qwen4Exp::load(&lm).unwrap();
    let (vocab, hidden) = (cpu.config.vocab, cpu.config.hidden);
    let gpu = CudaModel::from_cpu(&cpu, 0, None, tuning()).unwrap();
    let p = prompts(&g).into_iter().find(|p| p.name == "two_images").expect("the two-image prompt");
    let features: Vec<f32> = p.pixels.iter().flat_map(|px| tower.forward(px)).collect();
    let media = media_of(&p, &features, vocab, hidden);
    let cap = p.ids.len() + 16;
    let mut st = gpu.new_state(cap).unwrap();
    run(&gpu, &mut st, &p.ids, &media, p.ids.len(), &[]);
    let snap = Backend::snapshot(&gpu, &st).unwrap();
    let follow: Vec<u32> = p.decode.iter().chain(&p.decode).copied().collect();
    let cont = |st: &mut CudaState| -> Vec<f32> {
        follow.iter().flat_map(|&t| gpu.forward(st, &[t], LogitsFor::Last).unwrap()).collect()
    };
    let first = cont(&mut st);
    // The CPU continues the same way (the GPU's track is the reference's).
    let mut cs = cpu.new_state(cap);
    run(&cpu, &mut cs, &p.ids, &media, p.ids.len(), &[]);
    let cpu_follow: Vec<f32> =
        follow.iter().flat_map(|&t| cpu.forward(&mut cs, &[t], LogitsFor::Last).unwrap()).collect();
    assert!(max_rel(&first, &cpu_follow) <= 1e-3, "GPU continuation vs CPU");
    assert!(top1_differs(&first, &cpu_follow, vocab).is_empty(), "GPU continuation's top-1 vs CPU");
    Backend::restore(&gpu, &mut st, &snap).unwrap();
    assert_eq!(cont(&mut st), first, "restored on the live state");
    Backend::restore(&gpu, &mut st, &snap).unwrap();
    let live = Kept::Live(st);
    let mut forked = Backend::fork(&gpu, &live, &snap, cap, false).unwrap();
    assert_eq!(cont(&mut forked), first, "forked from the live state");
    let Kept::Live(st) = live else { unreachable!() };
    let image = gpu.spill_state(&st).unwrap();
    assert!(!image.mrope.explicit().is_empty(), "the host image carries the M-RoPE track");
    let host_snap = gpu.snapshot_from_image(gpu.snapshot_image(&snap).unwrap());
    let mut from_host = Backend::fork(&gpu, &Kept::Host(image), &host_snap, cap, false).unwrap();
    assert_eq!(cont(&mut from_host), first, "forked from the spilled host image");
}
