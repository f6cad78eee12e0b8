#!/usr/bin/env python3
"""Write the GGUF test fixtures of `engine/src/gguf/testdata/` with the PyPI `gguf` package (the outside truth).

Usage: python3 scripts/gguf_fixtures.py [OUT_DIR]     (default: engine/src/gguf/testdata)

Writes, all small (KBs), deterministically:
- ggml_types.json: every GGMLQuantizationType (id, name, block size, bytes per block from GGML_QUANT_SIZES) and
  every GGUFValueType (id, name), plus GGUF_VERSION and GGUF_DEFAULT_ALIGNMENT.
- all_types.gguf: every metadata value type (edge values, NaN/inf/-0.0, empty and Unicode strings, arrays of every
  type, nested arrays) and tensors of many ggml types and ranks (0-D to 4-D), via gguf.GGUFWriter.
- align64.gguf: general.alignment = 64 with odd tensor sizes (padding).
- split-0000{1,2,3}-of-00003.gguf: GGUFWriter(split_max_size=128) over five tensors.
- no_tensors.gguf: metadata only.
- big_endian.gguf: GGUFWriter(endianess=BIG); our reader must reject it.
- expected.json: for each .gguf above except big_endian, the dump (format: scripts/gguf_check.py) built from the
  values this script wrote, cross-checked here against gguf.GGUFReader's reading of the files.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q, GGUFValueType as V, GGUFWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_check import dump, first_difference  # noqa: E402

ARCH = "qwen4exp"


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f64_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def encode(value: Any, vtype: V, sub_type: V | None = None) -> Any:
    """The dump encoding of a value as GGUFWriter will pack it (inner array types as GGUFValueType.get_type)."""
    if vtype == V.ARRAY:
        elem = sub_type if sub_type is not None else V.get_type(value[0])
        return {"elem_type": int(elem), "values": [encode(v, elem) for v in value]}
    if vtype == V.FLOAT32:
        return f32_bits(value)
    if vtype == V.FLOAT64:
        return f64_bits(value)
    if vtype == V.BOOL:
        return bool(value)
    if vtype == V.STRING:
        return value
    return int(value)


class Fixture:
    """A GGUFWriter plus the expected dump of what it writes."""

    def __init__(self, path: Path, alignment: int = 32, **writer_args: Any) -> None:
        self.path = path
        self.alignment = alignment
        self.w = GGUFWriter(path, ARCH, **writer_args)
        self.kv: list[dict[str, Any]] = [{"key": "general.architecture", "type": int(V.STRING), "value": ARCH}]
        self.tensors: list[dict[str, Any]] = []
        if alignment != 32:
            self.w.add_custom_alignment(alignment)
            self.kv.append({"key": "general.alignment", "type": int(V.UINT32), "value": alignment})

    def add(self, key: str, value: Any, vtype: V, sub_type: V | None = None) -> None:
        self.w.add_key_value(key, value, vtype, sub_type=sub_type)
        self.kv.append({"key": key, "type": int(vtype), "value": encode(value, vtype, sub_type)})

    def tensor(self, name: str, array: np.ndarray, qtype: Q, ne: list[int]) -> None:
        """array: numpy data (uint8 bytes for block types); ne: the expected ggml dims."""
        raw = None if array.dtype != np.uint8 and qtype in (Q.F32, Q.F16, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64) else qtype
        self.w.add_tensor(name, array, raw_dtype=raw)
        data = array.tobytes()
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_elem = int(np.prod(ne)) if ne else 1
        assert n_elem * size // block == len(data), name
        self.tensors.append({"name": name, "dims": ne, "type": int(qtype), "n_bytes": len(data), "data_hex": data.hex()})

    def write(self) -> None:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()

    def expected(self, tensors: list[dict[str, Any]] | None = None, kv: list[dict[str, Any]] | None = None,
                 path: Path | None = None) -> dict[str, Any]:
        """The expected dump; offsets follow the GGUF layout (each tensor padded to the alignment)."""
        tensors = self.tensors if tensors is None else tensors
        kv = self.kv if kv is None else kv
        path = self.path if path is None else path
        out, offset = [], 0
        for t in tensors:
            out.append({**{k: t[k] for k in ("name", "dims", "type")}, "offset": offset, "n_bytes": t["n_bytes"],
                        "data_hex": t["data_hex"]})
            offset += (t["n_bytes"] + self.alignment - 1) // self.alignment * self.alignment
        return {"name": path.name, "version": 3, "alignment": self.alignment, "kv": kv, "tensors": out}


def check(expected: dict[str, Any], path: Path) -> dict[str, Any]:
    """Compares the expected dump with GGUFReader's reading and returns the full dump (with data_offset)."""
    got = dump(path)
    without_offset = {k: v for k, v in got.items() if k != "data_offset"}
    diff = first_difference(expected, without_offset)
    if diff:
        raise SystemExit(f"{path}: written file differs from intent at {diff}")
    return got


def all_types(out: Path, rng: np.random.Generator) -> dict[str, Any]:
    f = Fixture(out / "all_types.gguf")
    scalars = [
        ("test.u8", 255, V.UINT8), ("test.i8", -128, V.INT8), ("test.u16", 65535, V.UINT16),
        ("test.i16", -32768, V.INT16), ("test.u32", 2**32 - 1, V.UINT32), ("test.i32", -(2**31), V.INT32),
        ("test.f32", 1e-6, V.FLOAT32), ("test.f32_nan", math.nan, V.FLOAT32), ("test.f32_neg_zero", -0.0, V.FLOAT32),
        ("test.bool_true", True, V.BOOL), ("test.bool_false", False, V.BOOL),
        ("test.string", "héllo ✓ 世界 \U0001f600", V.STRING), ("test.string_empty", "", V.STRING),
        ("test.u64", 2**64 - 1, V.UINT64), ("test.i64", -(2**63), V.INT64),
        ("test.f64", math.pi, V.FLOAT64), ("test.f64_inf", -math.inf, V.FLOAT64),
    ]
    for key, value, vtype in scalars:
        f.add(key, value, vtype)
    arrays = [
        ("test.arr_u8", [0, 1, 255], V.UINT8), ("test.arr_i8", [-128, 0, 127], V.INT8),
        ("test.arr_u16", [0, 65535], V.UINT16), ("test.arr_i16", [-32768, 32767], V.INT16),
        ("test.arr_u32", [0, 2**32 - 1], V.UINT32), ("test.arr_i32", [-(2**31), 2**31 - 1], V.INT32),
        ("test.arr_f32", [1.5, -2.25, math.inf], V.FLOAT32), ("test.arr_bool", [True, False, True], V.BOOL),
        ("test.arr_string", ["a", "", "ü", "<|im_start|>"], V.STRING), ("test.arr_u64", [0, 2**64 - 1], V.UINT64),
        ("test.arr_i64", [-(2**63), 2**63 - 1], V.INT64), ("test.arr_f64", [0.1, -0.0], V.FLOAT64),
    ]
    for key, value, sub in arrays:
        f.add(key, value, V.ARRAY, sub_type=sub)
    # Nested arrays: GGUFWriter types inner arrays from their first element (int -> INT32, str -> STRING).
    f.add("test.arr_arr_i32", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
    f.add("test.arr_arr_str", [["x"], ["y", "z"]], V.ARRAY, sub_type=V.ARRAY)
    f.add("test.arr_arr_arr_i32", [[[7]], [[8, 9]]], V.ARRAY, sub_type=V.ARRAY)
    # Keys of the kind the qwen4exp loader reads (engine/src/model/config.rs).
    f.add("qwen4exp.block_count", 48, V.UINT32)
    f.add("qwen4exp.rope.dimension_sections", [11, 11, 10, 0], V.ARRAY, sub_type=V.INT32)
    f.add("qwen4exp.ple.layer_multipliers", [23703573157769, 20109073645365, 8052911324071], V.ARRAY,
          sub_type=V.UINT64)
    f.add("tokenizer.ggml.tokens", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġhello"], V.ARRAY,
          sub_type=V.STRING)

    def raw(nbytes: int) -> np.ndarray:
        return rng.integers(0, 256, size=nbytes, dtype=np.uint8)

    f.tensor("f32.weight", rng.standard_normal((3, 4)).astype(np.float32), Q.F32, [4, 3])
    f.tensor("f16.weight", rng.standard_normal(8).astype(np.float16), Q.F16, [8])
    f.tensor("bf16.weight", raw(8).reshape(2, 4), Q.BF16, [2, 2])
    f.tensor("i8", rng.integers(-128, 128, size=5, dtype=np.int8), Q.I8, [5])
    f.tensor("i16", rng.integers(-(2**15), 2**15, size=3, dtype=np.int16), Q.I16, [3])
    f.tensor("i32", rng.integers(-(2**31), 2**31, size=(2, 2), dtype=np.int32), Q.I32, [2, 2])
    f.tensor("i64", rng.integers(-(2**62), 2**62, size=3, dtype=np.int64), Q.I64, [3])
    f.tensor("f64", rng.standard_normal(2), Q.F64, [2])
    f.tensor("q4_0.weight", raw(2 * 36).reshape(2, 36), Q.Q4_0, [64, 2])
    f.tensor("q4_k.weight", raw(144), Q.Q4_K, [256])
    f.tensor("iq4_nl.weight", raw(3 * 18).reshape(3, 18), Q.IQ4_NL, [32, 3])
    f.tensor("q8_0_3d.weight", raw(2 * 2 * 34).reshape(2, 2, 34), Q.Q8_0, [32, 2, 2])
    f.tensor("f32_4d.weight", rng.standard_normal((2, 3, 1, 2)).astype(np.float32), Q.F32, [2, 1, 3, 2])
    f.tensor("mxfp4.weight", raw(17), Q.MXFP4, [32])
    f.tensor("scalar", np.array(0.5, dtype=np.float32), Q.F32, [])
    f.write()
    return check(f.expected(), f.path)


def align64(out: Path, rng: np.random.Generator) -> dict[str, Any]:
    f = Fixture(out / "align64.gguf", alignment=64)
    f.add("general.name", "alignment test", V.STRING)
    f.tensor("a", rng.integers(-128, 128, size=3, dtype=np.int8), Q.I8, [3])
    f.tensor("b", rng.standard_normal(25).astype(np.float32), Q.F32, [25])
    f.tensor("c", rng.standard_normal(16).astype(np.float32), Q.F32, [16])
    f.tensor("d", rng.integers(0, 256, size=34, dtype=np.uint8), Q.Q8_0, [32])
    f.write()
    return check(f.expected(), f.path)


def split(out: Path, rng: np.random.Generator) -> list[dict[str, Any]]:
    f = Fixture(out / "split.gguf", split_max_size=128)
    f.add("general.name", "split test", V.STRING)
    f.add("qwen4exp.block_count", 2, V.UINT32)
    f.tensor("t0", rng.standard_normal(16).astype(np.float32), Q.F32, [16])
    f.tensor("t1", rng.standard_normal(16).astype(np.float32), Q.F32, [16])
    f.tensor("t2", rng.standard_normal(40).astype(np.float32), Q.F32, [40])
    f.tensor("t3", rng.standard_normal(8).astype(np.float16), Q.F16, [8])
    f.tensor("t4", rng.integers(0, 256, size=34, dtype=np.uint8), Q.Q8_0, [32])
    f.write()
    groups = [f.tensors[0:2], f.tensors[2:3], f.tensors[3:5]]

    def split_kv(no: int) -> list[dict[str, Any]]:
        return [
            {"key": "split.no", "type": int(V.UINT16), "value": no},
            {"key": "split.count", "type": int(V.UINT16), "value": 3},
            {"key": "split.tensors.count", "type": int(V.INT32), "value": 5},
        ]

    dumps = []
    for i, group in enumerate(groups):
        path = out / f"split-{i + 1:05d}-of-00003.gguf"
        kv = (f.kv if i == 0 else []) + split_kv(i)
        dumps.append(check(f.expected(group, kv, path), path))
    return dumps


def no_tensors(out: Path) -> dict[str, Any]:
    f = Fixture(out / "no_tensors.gguf")
    f.add("tokenizer.ggml.model", "gpt2", V.STRING)
    f.add("tokenizer.ggml.tokens", ["a", "b"], V.ARRAY, sub_type=V.STRING)
    f.write()
    return check(f.expected(), f.path)


def big_endian(out: Path) -> None:
    w = GGUFWriter(out / "big_endian.gguf", ARCH, endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("qwen4exp.block_count", 48)
    w.add_tensor("t", np.arange(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def types_table() -> dict[str, Any]:
    return {
        "gguf_package_version": importlib.metadata.version("gguf"),
        "gguf_version": gguf.GGUF_VERSION,
        "default_alignment": gguf.GGUF_DEFAULT_ALIGNMENT,
        "ggml_types": [
            {"id": int(t), "name": t.name, "block_size": gguf.GGML_QUANT_SIZES[t][0],
             "type_size": gguf.GGML_QUANT_SIZES[t][1]}
            for t in Q
        ],
        "value_types": [{"id": int(t), "name": t.name} for t in V],
    }


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "engine/src/gguf/testdata"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20260829)
    files = [all_types(out, rng), align64(out, rng), *split(out, rng), no_tensors(out)]
    big_endian(out)
    (out / "expected.json").write_text(json.dumps({"files": files}, indent=1, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
    (out / "ggml_types.json").write_text(json.dumps(types_table(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote fixtures to {out}")


if __name__ == "__main__":
    main()
