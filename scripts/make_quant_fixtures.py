#!/usr/bin/env python3
"""Writes the block-format fixtures of `engine/src/quant/testdata/` from the PyPI `gguf` package (0.19.0).

Truth: `gguf.quants.dequantize` and `gguf.quants.quantize`, the package's numpy re-implementation of ggml's
reference code. For every block type the engine reads, random blocks with finite scales (half with realistic
magnitudes, half with any finite f16 bit pattern, subnormals included) are dequantized by the package; for the
types the package can also quantize, random rows (plus rows of zeros, ties and sign-symmetric extremes) are
quantized by it. The engine's tests must reproduce every value bit for bit.

File layout (little-endian):
  dequant_<TYPE>.bin: u32 ggml type id, u32 block count n, n blocks of raw bytes, n*block_size f32 values.
  quant_<TYPE>.bin:   u32 ggml type id, u32 value count m, m f32 inputs (one row), the expected bytes.

Usage: python3 scripts/make_quant_fixtures.py   (deterministic: fixed seed)
"""

import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf import quants

OUT = Path(__file__).resolve().parent.parent / "engine" / "src" / "quant" / "testdata"

DEQUANT = ["BF16", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
           "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "MXFP4"]
QUANT = ["BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]

# Byte offsets of the f16 scale fields of each block (IQ1_M and MXFP4 are handled separately).
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ1_S": [0], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0],
    "IQ4_NL": [0], "IQ4_XS": [0],
}


def finite_f16(rng, realistic):
    if realistic:
        v = np.float16(rng.choice([-1, 1]) * 10 ** rng.uniform(-4, -1))
        return int(v.view(np.uint16))
    while True:
        bits = int(rng.integers(0, 1 << 16))
        if (bits >> 10) & 0x1F != 0x1F:
            return bits


def random_blocks(name, n, rng):
    bs, ts = GGML_QUANT_SIZES[T[name]]
    raw = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    for i in range(n):
        realistic = i % 2 == 0
        if name in ("BF16",):
            # any finite bfloat16
            while True:
                bits = int(rng.integers(0, 1 << 16))
                if (bits >> 7) & 0xFF != 0xFF:
                    break
            raw[i] = np.frombuffer(struct.pack("<H", bits), dtype=np.uint8)
        elif name == "F16":
            raw[i] = np.frombuffer(struct.pack("<H", finite_f16(rng, False)), dtype=np.uint8)
        elif name == "MXFP4":
            raw[i, 0] = rng.integers(100, 140) if realistic else rng.integers(0, 255)
        elif name == "IQ1_M":
            # the f16 super-block scale is the top nibble of each of the 4 trailing u16 scale words
            d = finite_f16(rng, realistic)
            sc = raw[i, 48:56].copy().view(np.uint16)
            for k in range(4):
                sc[k] = (int(sc[k]) & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
            raw[i, 48:56] = sc.view(np.uint8)
        else:
            for off in F16_FIELDS[name]:
                raw[i, off:off + 2] = np.frombuffer(struct.pack("<H", finite_f16(rng, realistic)), dtype=np.uint8)
    return raw


def quant_input(name, rng):
    bs = max(GGML_QUANT_SIZES[T[name]][0], 32)
    blocks = [rng.normal(0, 1, size=bs) * 10 ** rng.uniform(-3, 1) for _ in range(48)]
    blocks.append(np.zeros(bs))
    b = rng.normal(0, 1, size=bs)
    b[3], b[7] = 2.5, -2.5  # equal-magnitude extremes: the first one sets the sign
    blocks.append(b)
    blocks.append(np.arange(bs) - bs / 2 + 0.5)  # evenly spaced: many exact ties
    blocks.append(np.full(bs, -1e-30))  # tiny values: scales underflow f16
    blocks.append(rng.normal(0, 1, size=bs) * 1e4)  # large values: scales near the top of the f16 range
    return np.concatenate(blocks).astype(np.float32)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20260430)
    for name in DEQUANT:
        bs, _ = GGML_QUANT_SIZES[T[name]]
        n = 256 if bs == 1 else (64 if bs == 32 else 24)
        raw = random_blocks(name, n, rng)
        vals = quants.dequantize(raw.reshape(1, -1), T[name]).astype(np.float32).reshape(-1)
        assert vals.size == n * bs
        assert np.all(np.isfinite(vals) | (name == "MXFP4")), name
        (OUT / f"dequant_{name}.bin").write_bytes(
            struct.pack("<II", int(T[name]), n) + raw.tobytes() + vals.astype("<f4").tobytes())
    for name in QUANT:
        x = quant_input(name, rng)
        q = quants.quantize(x.reshape(1, -1), T[name])
        (OUT / f"quant_{name}.bin").write_bytes(
            struct.pack("<II", int(T[name]), x.size) + x.astype("<f4").tobytes() + q.tobytes())
    print(f"wrote {len(DEQUANT)} dequantization and {len(QUANT)} quantization fixtures to {OUT}")


if __name__ == "__main__":
    main()
