#!/usr/bin/env python3
"""Type-selection fixture for the low-bit recipes (engine/src/convert/recipe.rs, tests/recipe_types.rs).

Writes a header-only qwen4exp GGUF at the release's widths and depth (48 blocks plus the MTP block, 512 routed
experts, the release's tensor names; BF16 weights, F32 vectors and norms; the tensor data is a hole, so the file
takes no disk) and asks llama.cpp's own `llama-quantize --dry-run` which type it picks for every tensor, for each
mix, with and without an importance matrix (a one-entry matrix: llama.cpp only asks whether one is given when it
picks types). The answers are the expected values of the test: the truth comes from llama.cpp's
`llama_tensor_get_type`, not from our code.

llama.cpp is not built by this repository: pass the path of a `llama-quantize` binary.

Usage: python3 scripts/gen_recipe_fixture.py /path/to/llama-quantize tests/fixtures/recipes
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import gguf

MIXES = ["Q2_K", "Q3_K_S", "Q3_K_M", "IQ3_XXS", "IQ2_XS", "IQ1_M", "IQ4_XS"]
LAYERS, EXPERTS = 48, 512
D, HC, RANK, HEADS, KV, HEAD_DIM = 2560, 4, 320, 24, 2, 256
SSM_K, SSM_V, SSM_DIM, FF, IDX_HEADS, IDX_DIM, PLE = 16, 48, 128, 640, 4, 128, 160
NGRAM_ROWS = 16 * 1024


def tensors():
    """(name, ggml dims, is_matrix) of the release's GGUF, in the order `nebula convert` writes them."""
    dd, kd, vd = HC * D, SSM_K * SSM_DIM, SSM_V * SSM_DIM
    conv = 2 * kd + vd
    v = [("token_embd.weight", [D, 248320], 1), ("output.weight", [D, 248320], 1),
         ("output_hc_norm.weight", [dd], 0), ("output_hc_down.weight", [dd, RANK], 1),
         ("output_hc_up.weight", [RANK, dd], 1)]
    for i in range(LAYERS + 1):
        b = f"blk.{i}"
        mtp = i == LAYERS
        if mtp:
            v += [(f"{b}.nextn.eh_proj.weight", [2 * D, D], 1), (f"{b}.nextn.enorm.weight", [D], 0),
                  (f"{b}.nextn.hnorm.weight", [dd], 0), (f"{b}.nextn.hc_head_norm.weight", [dd], 0),
                  (f"{b}.nextn.hc_head_down.weight", [dd, RANK], 1), (f"{b}.nextn.hc_head_up.weight", [RANK, dd], 1)]
        for g in ["hc_attn", "hc_ffn"]:
            v += [(f"{b}.{g}_norm.weight", [dd], 0), (f"{b}.{g}_down.weight", [dd, RANK], 1),
                  (f"{b}.{g}_up.weight", [RANK, dd], 1), (f"{b}.{g}_inject.weight", [dd, HC], 1)]
        if not mtp and (i + 1) % 4 != 0:
            v += [(f"{b}.attn_qkv.weight", [D, conv], 1), (f"{b}.attn_gate.weight", [D, vd], 1),
                  (f"{b}.ssm_beta.weight", [D, SSM_V], 1), (f"{b}.ssm_alpha.weight", [D, SSM_V], 1),
                  (f"{b}.ssm_conv1d.weight", [4, conv], 0), (f"{b}.ssm_dt.bias", [SSM_V], 0),
                  (f"{b}.ssm_a", [SSM_V], 0), (f"{b}.ssm_norm.weight", [SSM_DIM], 0),
                  (f"{b}.ssm_out.weight", [vd, D], 1)]
        else:
            v += [(f"{b}.attn_q.weight", [D, HEADS * HEAD_DIM * 2], 1), (f"{b}.attn_k.weight", [D, KV * HEAD_DIM], 1),
                  (f"{b}.attn_v.weight", [D, KV * HEAD_DIM], 1), (f"{b}.attn_output.weight", [HEADS * HEAD_DIM, D], 1),
                  (f"{b}.attn_q_norm.weight", [HEAD_DIM], 0), (f"{b}.attn_k_norm.weight", [HEAD_DIM], 0),
                  (f"{b}.indexer.q_proj.weight", [D, IDX_HEADS * IDX_DIM], 1),
                  (f"{b}.indexer.k_proj.weight", [D, IDX_DIM], 1),
                  (f"{b}.indexer.q_norm.weight", [IDX_DIM], 0), (f"{b}.indexer.k_norm.weight", [IDX_DIM], 0)]
        v += [(f"{b}.ffn_gate_inp.weight", [D, EXPERTS], 0), (f"{b}.ffn_gate_exps.weight", [D, FF, EXPERTS], 1),
              (f"{b}.ffn_up_exps.weight", [D, FF, EXPERTS], 1), (f"{b}.ffn_down_exps.weight", [FF, D, EXPERTS], 1),
              (f"{b}.ffn_gate_shexp.weight", [D, FF], 1), (f"{b}.ffn_up_shexp.weight", [D, FF], 1),
              (f"{b}.ffn_down_shexp.weight", [FF, D], 1), (f"{b}.ffn_gate_inp_shexp.weight", [D], 0)]
        if i == 1:
            v += [(f"{b}.ple_key.weight", [D, dd], 1), (f"{b}.ple_value.weight", [D, D], 1)]
            v += [(f"{b}.{n}.weight", [dd], 0) for n in ["ple_norm_key", "ple_norm_query", "ple_norm_conv"]]
            v += [(f"{b}.ple_conv1d.weight", [4, dd], 0)]
    v.append(("per_layer_token_embd.weight", [PLE, NGRAM_ROWS], 1))
    return v


def write_header_only(path):
    w = gguf.GGUFWriter(path, arch="qwen4exp")
    a = "qwen4exp"
    w.add_uint32(f"{a}.block_count", LAYERS + 1)
    w.add_uint32(f"{a}.nextn_predict_layers", 1)
    for k, x in [("context_length", 262144), ("embedding_length", D), ("attention.head_count", HEADS),
                 ("attention.head_count_kv", KV), ("attention.key_length", HEAD_DIM),
                 ("attention.value_length", HEAD_DIM), ("rope.dimension_count", 64), ("expert_count", EXPERTS),
                 ("expert_used_count", 10), ("expert_feed_forward_length", FF),
                 ("expert_shared_feed_forward_length", FF), ("ssm.conv_kernel", 4), ("ssm.state_size", SSM_DIM),
                 ("ssm.group_count", SSM_K), ("ssm.time_step_rank", SSM_V), ("ssm.inner_size", SSM_V * SSM_DIM),
                 ("full_attention_interval", 4), ("hyper_connection.count", HC), ("hyper_connection.low_rank", RANK),
                 ("attention.indexer.head_count", IDX_HEADS), ("attention.indexer.key_length", IDX_DIM),
                 ("attention.indexer.top_k", 2048), ("ple.ngram_size", 3), ("ple.heads_per_ngram", 8),
                 ("ple.conv_kernel", 4), ("ple.eos_token_id", 248044), ("ple.image_token_id", 248056),
                 ("embedding_length_per_layer_input", PLE)]:
        w.add_uint32(f"{a}.{k}", x)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{a}.rope.freq_base", 1e7)
    w.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_array(f"{a}.attention.compress_ratios", [4 if (i + 1) % 4 == 0 else 0 for i in range(LAYERS)] + [0])
    w.add_array(f"{a}.ple.layers", [1])
    u64 = gguf.GGUFValueType.UINT64
    for k, x in [("layer_multipliers", [3, 5, 7]), ("head_offsets", [h * 1024 for h in range(16)]),
                 ("head_vocab_sizes", [1021] * 16)]:
        w.add_key_value(f"{a}.ple.{k}", x, gguf.GGUFValueType.ARRAY, sub_type=u64)
    total = 0
    for name, dims, matrix in tensors():
        dt = np.dtype(np.float32) if not matrix else np.dtype(np.float16)
        qt = gguf.GGMLQuantizationType.BF16 if matrix else gguf.GGMLQuantizationType.F32
        n = int(np.prod(dims)) * (2 if matrix else 4)
        w.add_tensor_info(name, list(reversed(dims)), dt, n, raw_dtype=qt)
        total += (n + 31) // 32 * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(path, "r+b") as f:
        f.seek(0, 2)
        end = f.tell()
        f.truncate((end + 31) // 32 * 32 + total)


def dry_run(exe, src, mix, imatrix):
    cmd = [exe, "--dry-run"] + (["--imatrix", imatrix] if imatrix else []) + [src, mix, "2"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    types = {}
    for line in (p.stdout + p.stderr).splitlines():
        m = re.search(r"\]\s+(\S+)\s+- \[.*\], type =\s+(\S+), size =.*?(?:\((\w+)\))?\s*$", line)
        if m:
            name, old, new = m.group(1), m.group(2), m.group(3)
            types[name] = (new or old).upper()
    if len(types) != len(tensors()):
        raise SystemExit(f"{mix}: parsed {len(types)} of {len(tensors())} tensors from llama-quantize's log")
    return types


def main():
    exe, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    expected = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "release-shape.gguf")
        write_header_only(src)
        imx = os.path.join(tmp, "one.imatrix.gguf")
        w = gguf.GGUFWriter(imx, arch="imatrix")
        w.add_string("general.type", "imatrix")
        w.add_array("imatrix.datasets", ["one entry"])
        w.add_uint32("imatrix.chunk_count", 1)
        w.add_uint32("imatrix.chunk_size", 512)
        w.add_tensor("output_hc_down.weight.in_sum2", np.ones((1, HC * D), dtype=np.float32))
        w.add_tensor("output_hc_down.weight.counts", np.ones((1, 1), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        matrices = [name for name, _, m in tensors() if m]
        for mix in MIXES:
            with_m, without = dry_run(exe, src, mix, imx), dry_run(exe, src, mix, None)
            expected[mix] = {"imatrix": {n: with_m[n] for n in matrices},
                             "no_imatrix_where_different": {n: without[n] for n in matrices if without[n] != with_m[n]}}
    shapes = {name: dims for name, dims, m in tensors() if m}
    with open(os.path.join(out_dir, "release-shape.llama-quantize.json"), "w") as f:
        json.dump({"source": "llama-quantize --dry-run [--imatrix] on a header-only 48+1-block qwen4exp GGUF at the "
                             "release's widths (llama.cpp of llama-cpp-python 0.3.36); BF16 input weights (a BF16 "
                             "answer is a tensor llama.cpp leaves unquantized), F32 vectors (not listed)",
                   "dims": shapes, "types": expected}, f, indent=0, sort_keys=True)


if __name__ == "__main__":
    main()
