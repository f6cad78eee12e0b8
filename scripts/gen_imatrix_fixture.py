#!/usr/bin/env python3
"""Importance-matrix fixtures for `nebula convert --imatrix` (tests/quant_imatrix.rs).

1. Writes a seeded importance matrix for every quantizable weight of an F32 GGUF (the wide256 golden checkpoint,
   converted with `nebula convert tests/fixtures/golden/wide256 -o w256.gguf --outtype f32 --no-mtp`) in both of
   llama.cpp's file formats: the legacy binary one (`.dat`: entry count, then per entry name, call count, value
   count and values; then the chunk count and the dataset name) and the GGUF one (`<name>.in_sum2` and
   `<name>.counts` per entry, `imatrix.*` metadata). Values: one per column (3-D expert tensors: one row of
   columns per expert), log-normal so that columns differ by orders of magnitude, as real activations do. Both
   files hold the same values (the GGUF one as sums over 4 calls, exact in f32).
2. With LLAMA_QUANTIZE pointing at llama.cpp's `llama-quantize` (llama.cpp is not built by this repository),
   quantizes the GGUF with `--pure --imatrix` to each type below and records, per tensor, llama.cpp's type and the
   SHA-256 of its bytes: the expected values of the test (the truth comes from llama.cpp's quantizer).

3. With LLAMA_IMATRIX pointing at llama.cpp's `llama-imatrix`, gathers llama.cpp's own importance matrix of the
   demo model (`models/nebula-demo.gguf`) over `tests/fixtures/imatrix/calibration.txt` in chunks of 64 tokens:
   the expected values of `nebula imatrix` (tests/quant_imatrix.rs).

Usage: python3 scripts/gen_imatrix_fixture.py w256.gguf tests/fixtures/imatrix
"""
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import gguf

TYPES = ["Q4_K_S", "Q5_K_S", "Q6_K", "IQ4_NL", "IQ4_XS", "Q4_0", "Q4_1"]


def quantizable(t):
    n = t.name
    return (len(t.shape) >= 2 and n.endswith("weight") and "_norm.weight" not in n and "ffn_gate_inp" not in n
            and "ssm_conv1d" not in n and int(t.shape[0]) % 32 == 0)


def main():
    src, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(20261130)
    reader = gguf.GGUFReader(src)
    entries = {}
    for t in reader.tensors:
        if not quantizable(t):
            continue
        cols = int(t.shape[0])
        mats = int(t.shape[2]) if len(t.shape) == 3 else 1
        entries[t.name] = rng.lognormal(mean=0.0, sigma=1.5, size=cols * mats).astype(np.float32)
    names = sorted(entries)
    dat = os.path.join(out_dir, "wide256.imatrix.dat")
    with open(dat, "wb") as f:
        f.write(struct.pack("<i", len(names)))
        for n in names:
            v = entries[n]
            f.write(struct.pack("<i", len(n)) + n.encode())
            f.write(struct.pack("<ii", 1, v.size))  # ncall = 1: the stored values are the means
            f.write(v.tobytes())
        f.write(struct.pack("<i", 1))
        ds = b"seeded log-normal (scripts/gen_imatrix_fixture.py)"
        f.write(struct.pack("<i", len(ds)) + ds)
    w = gguf.GGUFWriter(os.path.join(out_dir, "wide256.imatrix.gguf"), arch="imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["seeded log-normal (scripts/gen_imatrix_fixture.py)"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", 512)
    for n in names:
        v = entries[n]
        t = next(t for t in reader.tensors if t.name == n)
        cols = int(t.shape[0])
        mats = v.size // cols
        w.add_tensor(n + ".in_sum2", (v * 4.0).reshape(mats, cols))
        w.add_tensor(n + ".counts", np.full((mats, 1), 4.0, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    imx = os.environ.get("LLAMA_IMATRIX")
    if imx:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        subprocess.run([imx, "-m", os.path.join(root, "models/nebula-demo.gguf"), "-f",
                        os.path.join(out_dir, "calibration.txt"), "-o",
                        os.path.join(out_dir, "demo.llama-imatrix.gguf"), "-c", "64", "-t", "2"],
                       check=True, capture_output=True)
    exe = os.environ.get("LLAMA_QUANTIZE")
    if not exe:
        print("LLAMA_QUANTIZE not set: wrote the importance matrices only")
        return
    expected = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ty in TYPES:
            out = os.path.join(tmp, ty + ".gguf")
            subprocess.run([exe, "--pure", "--imatrix", dat, src, out, ty, "2"], check=True, capture_output=True)
            q = gguf.GGUFReader(out)
            expected[ty] = {t.name: [t.tensor_type.name, hashlib.sha256(bytes(t.data.tobytes())).hexdigest()]
                            for t in q.tensors if t.name in entries}
    with open(os.path.join(out_dir, "wide256.llama-quantize.json"), "w") as f:
        json.dump({"source": "llama-quantize --pure --imatrix wide256.imatrix.dat (llama.cpp of llama-cpp-python "
                             "0.3.36)", "types": expected}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
