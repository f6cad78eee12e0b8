#!/usr/bin/env python3
"""The embedded demo model's vision tower: a tiny tower of the real architecture, from the reference.

Builds transformers 5.24's `Qwen4ExpVisionModel` (the tower of `Qwen4ExpForConditionalGeneration`: patch 16,
temporal patch 2, spatial merge 2, a learned position grid, 2-D rotary attention, the patch merger) at toy width
(2 blocks of 32, 2 heads, an 8 x 8 position grid) with its output width the demo model's hidden size (32), random
weights from a fixed seed, and writes it as the checkpoint directory `nebula convert --mmproj` reads
(`config.json` with `vision_config`, `model.safetensors` with `model.visual.*`, `preprocessor_config.json` with
the demo's pixel bounds), then converts it to `models/nebula-demo-mmproj.gguf` (F32, about 0.4 MB).

The tower is untrained: the demo model answers an image with whichever canned answer its features land nearest
to. What it shows is the path: decoding, preprocessing, the tower, the features at the pad tokens, M-RoPE.

Usage: python3 scripts/make_demo_vision.py [--nebula target/release/nebula] [--out models/nebula-demo-mmproj.gguf]
Needs: pip install torch transformers==5.24.0 safetensors
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen4ExpVisionConfig, Qwen4ExpVisionModel

SEED = 4242
DEMO_HIDDEN = 32  # the demo model's hidden size (scripts/make_demo_model.py)
VISION = dict(depth=2, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=2,
              in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
              out_hidden_size=DEMO_HIDDEN, num_position_embeddings=64)
# Small bounds for a CPU demo: 64 to 256 image tokens (65,536 to 262,144 pixels); Qwen3-VL's mean and std.
PREPROCESSOR = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                    image_std=[0.5, 0.5, 0.5], size={"shortest_edge": 65536, "longest_edge": 262144})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nebula", default="target/release/nebula")
    ap.add_argument("--out", default="models/nebula-demo-mmproj.gguf")
    args = ap.parse_args()
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    tower = Qwen4ExpVisionModel(Qwen4ExpVisionConfig(**VISION)).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if "pos_embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.2)
            elif p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        config = {"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"],
                  "vision_config": dict(VISION, model_type="qwen4_exp_vision"),
                  "text_config": {"hidden_size": DEMO_HIDDEN, "rms_norm_eps": 1e-6},
                  "provenance": {"script": "scripts/make_demo_vision.py", "seed": SEED,
                                 "transformers": transformers.__version__, "torch": torch.__version__}}
        (d / "config.json").write_text(json.dumps(config, indent=1))
        (d / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
        save_file({f"model.visual.{k}": v.contiguous() for k, v in tower.state_dict().items()},
                  str(d / "model.safetensors"))
        subprocess.run([args.nebula, "convert", str(d), "--mmproj", args.out, "--outtype", "f32",
                        "--name", "nebula-demo vision tower"], check=True)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
