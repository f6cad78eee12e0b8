#!/usr/bin/env python3
"""Golden vectors for Nebula's vision input, from the reference implementation.

Runs transformers 5.24's `Qwen4ExpForConditionalGeneration` (random init with fixed seeds, float32, eager
attention) with a tiny vision tower of the real architecture (patch 16, temporal patch 2, spatial merge 2, a
learned position grid interpolated bilinearly, 2-D rotary attention per image, the patch merger) in front of a
tiny language model (Gated DeltaNet, QSA with a budget below the prompt, PLE, hc 2), and the reference image and
video processors (`Qwen2VLImageProcessor`, the torchvision backend transformers picks for `qwen4_exp`, with the
Qwen3-VL settings: patch 16, mean = std = 0.5; `Qwen3VLVideoProcessor` with its class defaults). It writes:

  tests/fixtures/vision/images/*.png            the committed test images (odd sizes, made here from a seed)
  tests/fixtures/vision/pixels.json             per image case: the processor's bounds, grid_thw, resized size
  tests/fixtures/vision/pixels/<case>.bin       float32 LE pixel_values `[patches, 3*2*16*16]` of that case
  tests/fixtures/vision/model/                  the checkpoint (`save_pretrained`: config.json, model.safetensors)
  tests/fixtures/vision/golden.json             per prompt: token ids, mm_token_type_ids, grids, the 3-D
                                                position ids (`get_rope_index`), rope delta, versions, seeds
  tests/fixtures/vision/<prompt>.features.bin   float32 LE merged vision features `[tokens, text hidden]`
  tests/fixtures/vision/<prompt>.logits.bin     float32 LE logits `[prefill + decode, vocab]`: every prefill
                                                row, then one row per decode step (the reference's own decode
                                                path: a cache and its `rope_deltas`)

Prompts (the token ids are composed here; the tiny vocabulary puts the vision tokens at the ids in the config):
  one_image    text, <vision_start> 15 x <image_pad> <vision_end>, text; 4 decode steps
  two_images   two images of different sizes (15 and 6 tokens), text between and after; 4 decode steps
  video        4 frames at 2 fps: two temporal groups, each `<t seconds>` text, <vision_start> frame <vision_end>;
               4 decode steps

Usage: python3 scripts/make_vision_golden.py [--out tests/fixtures/vision]
Needs: pip install torch transformers==5.24.0 torchvision pillow numpy
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import PIL
import torch
import torchvision
import transformers
from PIL import Image
from transformers import (
    Qwen2VLImageProcessor,
    Qwen3VLVideoProcessor,
    Qwen4ExpConfig,
    Qwen4ExpForConditionalGeneration,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden import TopkGaps  # noqa: E402

SEED = 20261202  # images and the video's frames
MODEL_SEED = 7009  # the first model seed tried (7000..7008 had a near tie)
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 500, 501, 497, 498
EOS = 7

TEXT = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=16,
    num_experts_per_tok=4, hc_count=2, hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=64,
    ngram_vocab_size_base=300, split_ngram_parts=2, indexer_n_heads=4, indexer_kv_heads=1,
    indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4, eos_token_id=EOS, bos_token_id=EOS,
    output_gate_type="sigmoid", max_position_embeddings=4096, initializer_range=0.1,
    rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
        "mrope_section": [3, 3, 2], "mrope_interleaved": True,
    },
)
# The real tower's architecture at toy width: 27 blocks of 1152 with 16 heads and a 48 x 48 position grid become
# 2 blocks of 32 with 2 heads and an 8 x 8 grid.
VISION = dict(
    depth=2, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=2, in_channels=3,
    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
    initializer_range=0.02,
)

# Qwen3-VL's published preprocessor settings (its preprocessor_config.json): patch 16, mean = std = 0.5, pixel
# bounds 65,536 .. 16,777,216. The model cases use smaller bounds so that the prompts stay short.
IMAGE_PROCESSOR = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                       image_std=[0.5, 0.5, 0.5])
DEFAULT_BOUNDS = (65536, 16777216)  # the engine's defaults
SMALL_BOUNDS = (32 * 32 * 4, 32 * 32 * 16)

# (file, height, width, kind): odd sizes; `kind` picks the synthetic content.
IMAGES = [
    ("a_100x150.png", 100, 150, "gradient"),
    ("b_45x201.png", 45, 201, "noise"),
    ("c_333x517.png", 333, 517, "blocks"),
    ("d_37x29_rgba.png", 37, 29, "alpha"),
]
# Pixel cases: (case, image, (min_pixels, max_pixels)).
PIXEL_CASES = [
    ("a_small", "a_100x150.png", SMALL_BOUNDS),  # 96 x 160: a down/up resize on both axes
    ("b_small", "b_45x201.png", SMALL_BOUNDS),  # 32 x 192
    ("c_small", "c_333x517.png", SMALL_BOUNDS),  # beyond max_pixels: scaled down to fit
    ("d_min", "d_37x29_rgba.png", (128 * 128, DEFAULT_BOUNDS[1])),  # below min_pixels: scaled up; alpha on white
]
VIDEO_FRAMES = (4, 64, 96)  # frames, height, width
VIDEO_FPS = 2.0
VIDEO_BOUNDS = (32 * 32 * 4, 32 * 32 * 16 * 2)
DECODE = 4


def make_image(h, w, kind, rng):
    if kind == "gradient":
        y, x = np.mgrid[0:h, 0:w]
        img = np.stack([x * 255 / (w - 1), y * 255 / (h - 1), (x + y) * 255 / (w + h - 2)], -1)
        img = img + rng.normal(0, 12, img.shape)
        return Image.fromarray(np.clip(img, 0, 255).round().astype(np.uint8), "RGB")
    if kind == "noise":
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
    if kind == "blocks":
        small = rng.integers(0, 256, ((h + 15) // 16, (w + 15) // 16, 3), dtype=np.uint8)
        return Image.fromarray(np.kron(small, np.ones((16, 16, 1), dtype=np.uint8))[:h, :w], "RGB")
    if kind == "alpha":
        rgba = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
        rgba[: h // 3, :, 3] = 255
        rgba[h // 3 : 2 * h // 3, :, 3] = 0
        return Image.fromarray(rgba, "RGBA")
    raise ValueError(kind)


def image_processor(bounds):
    return Qwen2VLImageProcessor(**IMAGE_PROCESSOR, size={"shortest_edge": bounds[0], "longest_edge": bounds[1]})


def randomize(model, gen):
    """Moves every parameter away from its structured init. Text weights as scripts/make_golden.py does it
    (N(0, 1/fan_in) matrices, residual writers scaled by 1/sqrt(2 layers), log-normal head rows); vision weights
    N(0, 1/fan_in) with fan_in every input of an output (the patch conv's 3*2*16*16), biases N(0, 0.1), norm
    weights 1 + N(0, 0.2), the learned position grid N(0, 0.5)."""
    residual_scale = 1.0 / (2 * model.config.text_config.num_hidden_layers) ** 0.5
    writes_residual = ("o_proj", "out_proj", "down_proj", "value_proj")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.visual."):
                if "pos_embed" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                elif "norm" in name and name.endswith("weight"):
                    p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.2)
                elif p.ndim == 1:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
                else:
                    fan_in = p[0].numel()
                    p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
                continue
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.2, 2.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
            elif p.ndim == 1 or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "ngram_embedding" in name or "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "lm_head" in name:
                row_scale = torch.exp(0.7 * torch.randn(p.shape[0], 1, generator=gen))
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 * row_scale)
            else:
                scale = 1.0 / p.shape[-1] ** 0.5
                if any(w in name for w in writes_residual):
                    scale *= residual_scale
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def text_ids(n, gen):
    ids = torch.randint(0, 480, (n,), generator=gen)
    ids[ids == EOS] = EOS + 1
    return ids.tolist()


def write_f32(path, t):
    path.write_bytes(np.ascontiguousarray(t.detach().numpy().astype("<f4")).tobytes())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/vision")
    out = Path(ap.parse_args().out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "pixels").mkdir(exist_ok=True)
    rng = np.random.default_rng(SEED)
    torch.manual_seed(SEED)

    # The committed images.
    for name, h, w, kind in IMAGES:
        make_image(h, w, kind, rng).save(out / "images" / name, optimize=False)
    # A JPEG of image a (decoders may differ in their IDCT's last bit: checked with a looser tolerance).
    Image.open(out / "images" / "a_100x150.png").save(out / "images" / "a_100x150.jpg", quality=92)

    # Pixel tensors from the reference processor (images opened as the processor's callers do: PIL).
    pixels = {}
    for case, file, bounds in PIXEL_CASES:
        feat = image_processor(bounds)(images=[Image.open(out / "images" / file)], return_tensors="pt")
        grid = feat["image_grid_thw"][0].tolist()
        write_f32(out / "pixels" / f"{case}.bin", feat["pixel_values"])
        pixels[case] = dict(image=file, min_pixels=bounds[0], max_pixels=bounds[1], grid_thw=grid,
                            resized=[grid[1] * 16, grid[2] * 16], shape=list(feat["pixel_values"].shape))
    jpg = image_processor(SMALL_BOUNDS)(images=[Image.open(out / "images" / "a_100x150.jpg")], return_tensors="pt")
    write_f32(out / "pixels" / "a_jpeg_small.bin", jpg["pixel_values"])
    pixels["a_jpeg_small"] = dict(image="a_100x150.jpg", min_pixels=SMALL_BOUNDS[0], max_pixels=SMALL_BOUNDS[1],
                                  grid_thw=jpg["image_grid_thw"][0].tolist(), shape=list(jpg["pixel_values"].shape))

    # The video: frames made here, given to the video processor already sampled (do_sample_frames=False).
    t, vh, vw = VIDEO_FRAMES
    frames = [make_image(vh, vw, "gradient" if i % 2 == 0 else "noise", rng) for i in range(t)]
    for i, f in enumerate(frames):
        f.save(out / "images" / f"video_frame{i}.png")
    vproc = Qwen3VLVideoProcessor(size={"shortest_edge": VIDEO_BOUNDS[0], "longest_edge": VIDEO_BOUNDS[1]})
    video_np = np.stack([np.asarray(f) for f in frames])
    vfeat = vproc(videos=[video_np], do_sample_frames=False, return_tensors="pt", return_metadata=True,
                  video_metadata=[{"fps": VIDEO_FPS, "total_num_frames": t, "frames_indices": list(range(t))}],
                  cap_pixels_per_frame=False)
    write_f32(out / "pixels" / "video.bin", vfeat["pixel_values_videos"])
    vgrid = vfeat["video_grid_thw"][0].tolist()
    idx = list(range(t))
    stamps = [(idx[i] / VIDEO_FPS + idx[i + 1] / VIDEO_FPS) / 2 for i in range(0, t, 2)]
    pixels["video"] = dict(frames=[f"video_frame{i}.png" for i in range(t)], fps=VIDEO_FPS,
                           min_pixels=VIDEO_BOUNDS[0], max_pixels=VIDEO_BOUNDS[1], grid_thw=vgrid,
                           shape=list(vfeat["pixel_values_videos"].shape),
                           timestamps=[f"<{s:.1f} seconds>" for s in stamps])

    seed = MODEL_SEED
    while not run_model(out, seed, meta_base(pixels), vgrid, vfeat):
        seed += 1
        print(f"  a top-1 margin or a top-k selection gap too small, trying model seed {seed}")


def meta_base(pixels):
    return dict(pixels=pixels)


def run_model(out, seed, meta_extra, vgrid, vfeat):
    """Builds the model from `seed`, runs the prompts; writes the fixtures and returns True when every top-1
    margin is >= 1e-3 and every top-k selection gap >= 1e-5 (else nothing is written)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    pixels = meta_extra["pixels"]
    cfg = Qwen4ExpConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE_TOKEN,
                         video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                         vision_end_token_id=VISION_END)
    model = Qwen4ExpForConditionalGeneration(cfg).to(torch.float32)
    model.config._attn_implementation = "eager"
    model.config.text_config._attn_implementation = "eager"
    model.config.vision_config._attn_implementation = "eager"
    randomize(model, gen)
    model.eval()

    small = image_processor(SMALL_BOUNDS)
    img_a = small(images=[Image.open(out / "images" / "a_100x150.png")], return_tensors="pt")
    img_b = small(images=[Image.open(out / "images" / "b_45x201.png")], return_tensors="pt")

    def vision_span(token, n):
        return [VISION_START] + [token] * n + [VISION_END]

    merge = 4
    na = int(img_a["image_grid_thw"][0].prod()) // merge
    nb = int(img_b["image_grid_thw"][0].prod()) // merge
    frame_tokens = vgrid[1] * vgrid[2] // merge
    prompts = {
        "one_image": dict(
            ids=text_ids(5, gen) + vision_span(IMAGE_TOKEN, na) + text_ids(6, gen),
            pixel_values=img_a["pixel_values"], image_grid_thw=img_a["image_grid_thw"], images=["a_small"]),
        "two_images": dict(
            ids=text_ids(3, gen) + vision_span(IMAGE_TOKEN, na) + text_ids(4, gen) + vision_span(IMAGE_TOKEN, nb)
            + text_ids(3, gen),
            pixel_values=torch.cat([img_a["pixel_values"], img_b["pixel_values"]]),
            image_grid_thw=torch.cat([img_a["image_grid_thw"], img_b["image_grid_thw"]]),
            images=["a_small", "b_small"]),
        "video": dict(
            ids=text_ids(3, gen) + sum((text_ids(2, gen) + vision_span(VIDEO_TOKEN, frame_tokens)
                                        for _ in range(vgrid[0])), []) + text_ids(3, gen),
            pixel_values_videos=vfeat["pixel_values_videos"], video_grid_thw=vfeat["video_grid_thw"],
            videos=["video"]),
    }

    meta = dict(
        source=("transformers Qwen4ExpForConditionalGeneration (random init) and its image/video processors, "
                "float32, eager attention"),
        versions=dict(transformers=transformers.__version__, torch=torch.__version__,
                      torchvision=torchvision.__version__, pillow=PIL.__version__, numpy=np.__version__),
        image_seed=SEED, model_seed=seed, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, eos_token_id=EOS, vocab_size=TEXT["vocab_size"],
        image_processor=dict(IMAGE_PROCESSOR, default_bounds=DEFAULT_BOUNDS, small_bounds=SMALL_BOUNDS,
                             resample="bicubic, antialias (torchvision on uint8 via float32), round, clamp"),
        pixels=pixels, prompts={},
    )
    results = {}
    for name, p in prompts.items():
        ids = p["ids"]
        decode = text_ids(DECODE, gen)
        tt = [1 if i == IMAGE_TOKEN else 2 if i == VIDEO_TOKEN else 0 for i in ids]
        input_ids = torch.tensor([ids])
        mm = torch.tensor([tt])
        kw = {k: p[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw") if k in p}
        with torch.no_grad(), TopkGaps() as gaps:
            model.model.rope_deltas = None
            pos, delta = model.model.get_rope_index(
                input_ids, mm_token_type_ids=mm, image_grid_thw=p.get("image_grid_thw"),
                video_grid_thw=p.get("video_grid_thw"))
            if "pixel_values" in p:
                feats = model.model.get_image_features(p["pixel_values"], p["image_grid_thw"]).pooler_output
            else:
                feats = model.model.get_video_features(p["pixel_values_videos"], p["video_grid_thw"]).pooler_output
            feats = torch.cat(list(feats))
            out_ = model(input_ids=input_ids, mm_token_type_ids=mm, use_cache=True, **kw)
            cache = out_.cache if hasattr(out_, "cache") else out_.past_key_values
            logits = [out_.logits[0]]
            for t_ in decode:
                step = model(input_ids=torch.tensor([[t_]]), cache=cache, use_cache=True)
                cache = step.cache if hasattr(step, "cache") else step.past_key_values
                logits.append(step.logits[0])
            logits = torch.cat(logits)
        results[name] = (feats, logits)
        top = torch.topk(logits, 2, dim=-1).values
        meta["prompts"][name] = dict(
            token_ids=ids, decode_ids=decode, mm_token_type_ids=tt, prefill=len(ids),
            image_grid_thw=p["image_grid_thw"].tolist() if "image_grid_thw" in p else [],
            video_grid_thw=p["video_grid_thw"].tolist() if "video_grid_thw" in p else [],
            images=p.get("images", []), videos=p.get("videos", []),
            position_ids=pos[:, 0].tolist(), rope_delta=int(delta[0, 0]),
            features_shape=list(feats.shape), logits_shape=list(logits.shape),
            min_top1_margin=float((top[:, 0] - top[:, 1]).min()), min_topk_gap=gaps.min_gap,
        )
        print(name, "tokens", len(ids), "features", tuple(feats.shape), "delta", int(delta[0, 0]),
              "margin", meta["prompts"][name]["min_top1_margin"], "topk gap", gaps.min_gap)
    if any(m["min_top1_margin"] < 1e-3 or m["min_topk_gap"] < 1e-5 for m in meta["prompts"].values()):
        return False
    for name, (feats, logits) in results.items():
        write_f32(out / f"{name}.features.bin", feats)
        write_f32(out / f"{name}.logits.bin", logits)
    model.save_pretrained(out / "model", safe_serialization=True)
    (out / "golden.json").write_text(json.dumps(meta, indent=1) + "\n")
    return True


if __name__ == "__main__":
    main()
