#!/usr/bin/env python3
"""Dump GGUF files as JSON with the PyPI `gguf` package's GGUFReader: the outside truth for Nebula's GGUF tests.

Usage:
    python3 scripts/gguf_check.py FILE [FILE ...]                 # print the dump
    python3 scripts/gguf_check.py --expect EXPECTED.json FILE ... # compare with a dump, exit 1 on difference
    python3 scripts/gguf_check.py --no-data FILE ...              # sha256 instead of hex (large files)

Dump format (shared with `engine/src/gguf/tests.rs`, which produces the same JSON from our reader):
    {"files": [{"name": file name, "version": int, "alignment": int, "data_offset": int,
                "kv": [{"key": str, "type": value type id, "value": V}],
                "tensors": [{"name": str, "dims": [ne0, ne1, ...], "type": ggml type id,
                             "offset": offset relative to the data section, "n_bytes": int,
                             "data_hex": hex of the tensor's bytes}]}]}
    V: integers as numbers, bools as true/false, strings as strings, f32/f64 as the integer of their IEEE bit pattern
    (so NaN, inf and -0.0 compare exactly), arrays as {"elem_type": id, "values": [V, ...]} (nested for arrays of
    arrays, which GGUFReader itself flattens: we rebuild them from the field's parts).

Requires: gguf (tested with 0.19.0), numpy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType


def _decode(parts: list[np.ndarray], i: int, vtype: int) -> tuple[Any, int]:
    """Decodes one value starting at parts[i]; returns (JSON value, next part index)."""
    t = GGUFValueType(vtype)
    if t == GGUFValueType.STRING:
        return bytes(parts[i + 1]).decode("utf-8"), i + 2
    if t == GGUFValueType.ARRAY:
        elem_type = int(parts[i][0])
        count = int(parts[i + 1][0])
        i += 2
        values = []
        for _ in range(count):
            v, i = _decode(parts, i, elem_type)
            values.append(v)
        return {"elem_type": elem_type, "values": values}, i
    raw = parts[i]
    if t == GGUFValueType.FLOAT32:
        return int(raw.view(np.uint32)[0]), i + 1
    if t == GGUFValueType.FLOAT64:
        return int(raw.view(np.uint64)[0]), i + 1
    if t == GGUFValueType.BOOL:
        return bool(raw[0]), i + 1
    return int(raw[0]), i + 1


def dump(path: Path, with_data: bool = True) -> dict[str, Any]:
    """Reads one GGUF file with GGUFReader and returns its dump (see the module docstring)."""
    reader = GGUFReader(path)
    kv = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        vtype = int(field.parts[2][0])
        value, end = _decode(field.parts, 3, vtype)
        assert end == len(field.parts), f"{name}: {len(field.parts) - end} parts left over"
        kv.append({"key": name, "type": vtype, "value": value})
    tensors = []
    for t in reader.tensors:
        data = t.data.tobytes()
        assert len(data) == int(t.n_bytes)
        entry = {
            "name": t.name,
            "dims": [int(d) for d in t.shape],
            "type": int(t.tensor_type),
            "offset": int(t.data_offset) - int(reader.data_offset),
            "n_bytes": int(t.n_bytes),
        }
        if with_data:
            entry["data_hex"] = data.hex()
        else:
            entry["data_sha256"] = hashlib.sha256(data).hexdigest()
        tensors.append(entry)
    return {
        "name": path.name,
        "version": int(reader.fields["GGUF.version"].parts[0][0]),
        "alignment": int(reader.alignment),
        "data_offset": int(reader.data_offset),
        "kv": kv,
        "tensors": tensors,
    }


def dump_files(paths: list[Path], with_data: bool = True) -> dict[str, Any]:
    return {"files": [dump(p, with_data) for p in paths]}


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """A path to the first place where a and b differ, or None."""
    if type(a) is not type(b):
        return f"{where}: {a!r} vs {b!r}"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            d = first_difference(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--expect", type=Path, help="JSON dump to compare with")
    ap.add_argument("--no-data", action="store_true", help="sha256 of tensor data instead of hex")
    args = ap.parse_args()
    got = dump_files(args.files, with_data=not args.no_data)
    if args.expect is None:
        json.dump(got, sys.stdout, indent=1, ensure_ascii=False)
        print()
        return 0
    expected = json.loads(args.expect.read_text(encoding="utf-8"))
    diff = first_difference(expected, got)
    if diff:
        print(f"MISMATCH (expected vs gguf.GGUFReader) at {diff}", file=sys.stderr)
        return 1
    n_kv = sum(len(f["kv"]) for f in got["files"])
    n_t = sum(len(f["tensors"]) for f in got["files"])
    print(f"OK: {len(got['files'])} file(s), {n_kv} keys, {n_t} tensors match {args.expect}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
