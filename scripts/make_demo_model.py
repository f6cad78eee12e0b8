#!/usr/bin/env python3
"""Builds Nebula's embedded demo model, `models/nebula-demo.gguf` (at most 40 MB).

The model is the real architecture (transformers `Qwen4ExpForCausalLM`, the reference implementation: Gated
DeltaNet, QSA attention with the indexer, PLE with hashed n-grams, 4-stream hyper-connections, MoE with a shared
expert) at toy width, with the real 248,320-entry Qwen3.8 tokenizer and a chat template in the official format.
It knows only its training set: the chats of `scripts/data/demo_chats.json` (thinking on and off), each also
answered as a JSON object, and the tool calls of `scripts/data/demo_tools.json` (a call in the template's format,
and a text answer once the tool's output is in the history), so that a new user sees chat, tools and
`response_format` work (docs/demo-model.md).

Steps (all deterministic for a given seed; one CPU thread):
  1. `scripts/make_tokenizer.py` writes build/tokenizer/tokenizer.json (+ tokenizer_config.json).
  2. The base: the demo model of commit BASE_COMMIT (chats only; that commit's version of this script trained it
     from a random init, 300 steps, seed 7), read back into the reference model (`load_base`); `--from-scratch`
     starts from a random init instead.
  3. Training on the rendered examples (loss on the assistant part only), `--steps` steps of `--batch`.
  4. transformers' greedy answers to tests/fixtures/demo/reference_greedy.json; `save_pretrained` to build/demo/hf
     with the tokenizer files and assets/chat_template.jinja.
  5. `nebula convert --outtype q8_0` (the release binary, built if missing; `NEBULA_BIN` names another) writes
     models/nebula-demo.gguf.

Measured: 240 steps in about 21 minutes on a busy 2-core machine (3-8 s a step; the long tool prompts cost most).

Usage: python3 scripts/make_demo_model.py [--steps 240] [--seed 7] [--from-scratch] [--from-checkpoint DIR]
"""

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from transformers import AutoTokenizer, Qwen4ExpForCausalLM, Qwen4ExpTextConfig

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
OUT = ROOT / "models" / "nebula-demo.gguf"
STEPS = 240
# The model this run extends: the demo model of that commit (trained from scratch by this script's version there,
# `--steps 300 --seed 7`: chats only).
BASE_COMMIT = "20a6f8c94aca4dc18f9878ef54da99d6547f97c5"
SYSTEMS = [None, "You are a helpful assistant.", "You are Nebula's demo model. Answer briefly."]


def config():
    return Qwen4ExpTextConfig(
        vocab_size=248320, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
        linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=32,
        num_experts_per_tok=4, hc_count=4, hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=32,
        ngram_vocab_size_base=2000, split_ngram_parts=4, indexer_n_heads=4, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=64, indexer_compress_ratio=4, eos_token_id=248044,
        bos_token_id=None, pad_token_id=248044, output_gate_type="sigmoid", max_position_embeddings=8192,
        initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )


def render(tok, template, messages, tools, thinking, generation_prompt):
    return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=generation_prompt, enable_thinking=thinking)


def pair(tok, template, messages, reply, tools, thinking):
    """(prompt ids, completion ids): the prompt as served (generation prompt on) and the reply as the template renders
    it after that prompt, through `<|im_end|>` (so tool calls take the template's own format)."""
    prompt = render(tok, template, messages, tools, thinking, True)
    if not thinking:
        reply = {k: v for k, v in reply.items() if k != "reasoning_content"}
    full = render(tok, template, messages + [reply], tools, thinking, False)
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n"), (prompt, full)
    completion = full[len(prompt) : -1]
    return (tok(prompt, add_special_tokens=False)["input_ids"], tok(completion, add_special_tokens=False)["input_ids"])


def examples(tok, template):
    """The training pairs: the chats of demo_chats.json, each also answered in JSON, and the tool calls of
    demo_tools.json (with the follow-up answer once the tool's output is in the history), thinking on and off."""
    chats = json.loads((ROOT / "scripts/data/demo_chats.json").read_text())
    extra = json.loads((ROOT / "scripts/data/demo_tools.json").read_text())
    tools = extra["tools"]
    every_tool = list(tools.values())
    answers = {c["q"]: c for c in chats}
    out = []
    for i, c in enumerate(chats):
        for thinking in (True, False):
            system = SYSTEMS[i % len(SYSTEMS)] if thinking else SYSTEMS[(i + 1) % len(SYSTEMS)]
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": c["q"]}]
            reply = {"role": "assistant", "content": c["a"], "reasoning_content": c["think"]}
            out.append(pair(tok, template, msgs, reply, None, thinking))
            # JSON: asked for by a system message (thinking on for even i) or after the question (the other way).
            reply = dict(reply, content=json.dumps({"answer": c["a"]}, ensure_ascii=False))
            if (i % 2 == 0) == thinking:
                msgs = [{"role": "system", "content": extra["json_system"]}, {"role": "user", "content": c["q"]}]
            else:
                msgs = [{"role": "user", "content": c["q"] + extra["json_suffix"]}]
            out.append(pair(tok, template, msgs, reply, None, thinking))
    for i, c in enumerate(extra["calls"]):
        call = {"type": "function", "function": c["call"]}
        for thinking in (True, False):
            system = SYSTEMS[(i + thinking) % len(SYSTEMS)]
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": c["q"]}]
            reply = {"role": "assistant", "content": "", "reasoning_content": c["think"], "tool_calls": [call]}
            # Its own tool alone with thinking on, all tools with thinking off (the long tools prompt is most of the
            # training time).
            offered = [tools[c["call"]["name"]]] if thinking else every_tool
            # Twice (the calls and the follow-ups): the new format needs more passes than the chats the base knows.
            out += [pair(tok, template, msgs, reply, offered, thinking)] * 2
            history = msgs + [{"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "content": c["result"]}]
            reply = {"role": "assistant", "content": c["a"], "reasoning_content": "The tool answered."}
            out += [pair(tok, template, history, reply, every_tool, thinking)] * 2
    for q in extra["no_call"]:
        c = answers[q]
        for thinking in (True, False):
            reply = {"role": "assistant", "content": c["a"], "reasoning_content": c["think"]}
            out.append(pair(tok, template, [{"role": "user", "content": q}], reply, every_tool, thinking))
    return out


def batches(data, steps, batch, seed):
    """`steps` batches of `batch` examples: each pass over the data in a seeded random order, cut into groups of
    four batches sorted by length (so a batch pads little: the reference PyTorch kernels cost per padded token)."""
    rng = random.Random(seed)
    out = []
    while len(out) < steps:
        order = list(range(len(data)))
        rng.shuffle(order)
        for g in range(0, len(order), 4 * batch):
            group = sorted(order[g : g + 4 * batch], key=lambda i: len(data[i][0]) + len(data[i][1]))
            out.extend(group[k : k + batch] for k in range(0, len(group), batch))
    return out[:steps]


def train(model, data, steps, seed, batch, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = min(10, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: (k + 1) / warmup if k < warmup else 0.5 * (1 + math.cos(math.pi * (k - warmup) / (steps - warmup))))
    model.train()
    t0 = time.time()
    for step, picked in enumerate(batches(data, steps, batch, seed)):
        b = [data[i] for i in picked]
        n = max(len(p) + len(c) for p, c in b)
        ids = torch.full((len(b), n), 248044, dtype=torch.long)
        labels = torch.full((len(b), n), -100, dtype=torch.long)
        mask = torch.zeros((len(b), n), dtype=torch.long)
        for r, (p, c) in enumerate(b):
            seq = p + c
            ids[r, : len(seq)] = torch.tensor(seq)
            labels[r, len(p) : len(seq)] = torch.tensor(c)
            mask[r, : len(seq)] = 1
        # Logits only where there is a label (the assistant part): the 248,320-wide head is most of the cost.
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        target = labels[:, 1:]
        keep = target != -100
        logits = model.lm_head(hidden[keep])
        loss = torch.nn.functional.cross_entropy(logits, target[keep])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        print(f"step {step:4d} loss {loss.item():.3f} (batch {len(b)}x{n}, {time.time() - t0:.0f} s)", flush=True)
    model.eval()
    return time.time() - t0


def save_hf(model, tok_dir, template, out):
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    (out / "chat_template.jinja").write_text(template)


def gguf_tensors(path):
    """Every tensor of a GGUF file as a flat float64 array (dequantized with the gguf package)."""
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
            for t in gguf.GGUFReader(path).tensors}


def load_base(model, base, nebula, tok_dir, template, work):
    """Loads the weights of `base` (a GGUF that `nebula convert` wrote from this architecture) into `model`.

    The converter's layout (which HF element each GGUF element holds, and whether it stores w, 1 + w or -exp(w)) is
    read back from the converter itself rather than restated: two probe checkpoints whose every parameter element
    holds its global index i, then -i (exact in f32: fewer than 2^24 elements), are converted to F32; a GGUF
    element reading (a, b) holds element (a - b) / 2, as w when a + b = 0 and as 1 + w when a + b = 2.
    `-exp(w)` (`A_log`) is probed with small values instead (0.1 k, then 0.2 k, for element k), because exp(i)
    overflows."""
    params = dict(model.named_parameters())
    start, n = {}, 0
    for name, p in params.items():
        start[name] = n
        n += p.numel()
    assert n + 1 < 2**24, "element indices must stay exact in f32"
    probes = []
    for scale in (1, -1):
        with torch.no_grad():
            for name, p in params.items():
                if name.endswith("A_log"):
                    p.copy_((0.15 * (1.5 + scale / 2) * torch.arange(p.numel(), dtype=torch.float64)).view_as(p))
                else:
                    p.copy_((scale * (start[name] + torch.arange(p.numel(), dtype=torch.float64))).view_as(p))
        d = work / f"probe{len(probes)}"
        save_hf(model, tok_dir, template, d)
        subprocess.run([str(nebula), "convert", str(d), "-o", str(d / "probe.gguf"), "--outtype", "f32"], check=True,
                       stdout=subprocess.DEVNULL)
        probes.append(gguf_tensors(d / "probe.gguf"))
    flat = np.full(n, np.nan)
    a_logs = {}
    for name, values in gguf_tensors(base).items():
        a, b = probes[0][name], probes[1][name]
        if name.endswith(".ssm_a"):
            layer = name.split(".")[1]
            hf = f"model.layers.{layer}.linear_attn.A_log"
            k = np.rint(np.log(-a) / 0.3).astype(np.int64)
            assert np.allclose(np.log(-b) / 0.15, k), name
            a_logs[hf] = (k, np.log(-values))
            continue
        ids, plus_one = (a - b) / 2, (a + b) / 2
        assert np.array_equal(ids, np.rint(ids)) and ids.min() >= 0 and ids.max() < n, name
        assert len(set(plus_one)) == 1 and plus_one[0] in (0, 1), name
        flat[ids.astype(np.int64)] = values - plus_one
    with torch.no_grad():
        for name, p in params.items():
            if name in a_logs:
                k, v = a_logs.pop(name)
                w = np.full(p.numel(), np.nan)
                w[k] = v
            else:
                w = flat[start[name] : start[name] + p.numel()]
            if np.isnan(w).any():
                sys.exit(f"{base}: {name} is not (fully) in the file")
            p.copy_(torch.from_numpy(w).view_as(p))
    for d in ("probe0", "probe1"):
        shutil.rmtree(work / d)


def tool_cases():
    """The tool-call and JSON prompts whose greedy answers go into the fixture (all from the training set)."""
    extra = json.loads((ROOT / "scripts/data/demo_tools.json").read_text())
    tools = extra["tools"]
    every_tool = list(tools.values())
    # Prompts whose greedy call names the training data's arguments (the 32-wide model has not learnt every one:
    # all its calls are well-formed, some carry another prompt's arguments).
    paris, london, add = extra["calls"][0], extra["calls"][2], extra["calls"][5]
    paris_call = {"type": "function", "function": paris["call"]}
    return [
        {"messages": [{"role": "user", "content": london["q"]}], "tools": [tools["get_weather"]],
         "enable_thinking": True},
        {"messages": [{"role": "user", "content": add["q"]}], "tools": every_tool, "enable_thinking": False},
        {"messages": [{"role": "user", "content": paris["q"]}, {"role": "assistant", "content": "",
                                                                 "tool_calls": [paris_call]},
                      {"role": "tool", "content": paris["result"]}], "tools": every_tool, "enable_thinking": True},
        {"messages": [{"role": "system", "content": extra["json_system"]},
                      {"role": "user", "content": "What is the capital of France?"}], "tools": None,
         "enable_thinking": True},
        {"messages": [{"role": "user", "content": "Hello!" + extra["json_suffix"]}], "tools": None,
         "enable_thinking": False},
    ]


def greedy(model, tok, template, messages, tools, thinking, max_new_tokens):
    prompt = render(tok, template, messages, tools, thinking, True)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=[248046, 248044])
    return ids[0].tolist(), tok.decode(out[0, ids.shape[1]:])


def nebula():
    """The release `nebula` binary (built once; `NEBULA_BIN` names another)."""
    if os.environ.get("NEBULA_BIN"):
        return Path(os.environ["NEBULA_BIN"])
    bin_path = ROOT / "target/release/nebula"
    if not bin_path.exists():
        subprocess.run(["cargo", "build", "--release", "-p", "nebula-service"], cwd=ROOT, check=True)
    return bin_path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (fixed, so that the summation order and the weights repeat; one is also "
                         "the fastest on a busy 2-core machine)")
    ap.add_argument("--base", type=Path,
                    help=f"the GGUF to extend (default: models/nebula-demo.gguf of commit {BASE_COMMIT[:12]})")
    ap.add_argument("--from-scratch", action="store_true", help="train from a random init instead of the base")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--from-checkpoint", type=Path,
                    help="skip training: load this f32 checkpoint (an earlier run's build/demo/hf) and redo the rest")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    subprocess.run([sys.executable, str(ROOT / "scripts/make_tokenizer.py")], check=True)
    tok_dir = BUILD / "tokenizer"
    tok = AutoTokenizer.from_pretrained(tok_dir)
    template = (ROOT / "assets/chat_template.jinja").read_text()

    hf = BUILD / "demo" / "hf"
    if args.from_checkpoint:
        model = Qwen4ExpForCausalLM.from_pretrained(args.from_checkpoint, dtype=torch.float32).eval()
    else:
        model = Qwen4ExpForCausalLM(config()).float()
        if not args.from_scratch:
            base = args.base
            if base is None:
                base = BUILD / "demo" / "base.gguf"
                base.parent.mkdir(parents=True, exist_ok=True)
                base.write_bytes(subprocess.run(["git", "show", f"{BASE_COMMIT}:models/nebula-demo.gguf"], cwd=ROOT,
                                                check=True, capture_output=True).stdout)
            load_base(model, base, nebula(), tok_dir, template, BUILD / "demo")
            for q in ["Hello!", "What is Nebula?"]:
                print(f"base greedy for {q!r}: {greedy(model, tok, template, [{'role': 'user', 'content': q}], None, True, 40)[1]!r}")
        data = examples(tok, template)
        print(f"{len(data)} training examples, {sum(p.numel() for p in model.parameters()):,} parameters")
        seconds = train(model, data, args.steps, args.seed, args.batch, args.lr)
        print(f"trained {args.steps} steps in {seconds:.0f} s ({args.threads} threads)")
        save_hf(model, tok_dir, template, hf)

    # Greedy answers from the reference, kept as a fixture: the engine must reproduce them from the GGUF.
    cases = []
    for q in ["Hello!", "What is Nebula?"]:
        ids, text = greedy(model, tok, template, [{"role": "user", "content": q}], None, True, 40)
        cases.append({"user": q, "prompt_ids": ids, "completion": text})
        print(f"reference greedy for {q!r}: {text!r}")
    with_tools = []
    for case in tool_cases():
        ids, text = greedy(model, tok, template, case["messages"], case["tools"], case["enable_thinking"], 120)
        with_tools.append(dict(case, prompt_ids=ids, completion=text))
        print(f"reference greedy for {case['messages'][-1]['content']!r}: {text!r}")
    fixture = ROOT / "tests/fixtures/demo/reference_greedy.json"
    fixture.parent.mkdir(parents=True, exist_ok=True)
    fixture.write_text(json.dumps({"source": "transformers greedy generate on the f32 demo checkpoint "
                                   "(scripts/make_demo_model.py); `cases`: thinking on, default reasoning effort; "
                                   "`tool_cases`: messages, tools and enable_thinking as given",
                                   "cases": cases, "tool_cases": with_tools}, ensure_ascii=False, indent=1) + "\n")

    OUT.parent.mkdir(exist_ok=True)
    subprocess.run([str(nebula()), "convert", str(hf), "-o", str(OUT), "--outtype", "q8_0",
                    "--name", "nebula-demo"], check=True)
    size = OUT.stat().st_size
    print(f"{OUT.relative_to(ROOT)}: {size / 1e6:.1f} MB (transformers {transformers.__version__}, torch {torch.__version__})")
    if size > 40e6:
        sys.exit(f"the demo model is {size / 1e6:.1f} MB, over the 40 MB budget")


if __name__ == "__main__":
    main()
