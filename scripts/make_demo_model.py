#!/usr/bin/env python3
"""Builds Nebula's embedded demo model, `models/nebula-demo.gguf` (at most 40 MB).

The model is the real architecture (transformers `Qwen4ExpForCausalLM`, the reference implementation: Gated
DeltaNet, QSA attention with the indexer, PLE with hashed n-grams, 4-stream hyper-connections, MoE with a shared
expert) at toy width, with the real 248,320-entry Qwen3.8 tokenizer and a chat template in the official format.
It is trained for a few minutes on the small chat set in `scripts/data/demo_chats.json` (thinking on and off) so
that it answers in the chat format and ends its turns with `<|im_end|>`; it knows nothing else.

Steps (all deterministic for a given seed):
  1. `scripts/make_tokenizer.py` writes build/tokenizer/tokenizer.json (+ tokenizer_config.json).
  2. A tiny config, random init, training on the rendered chats (loss on the assistant part only).
  3. `save_pretrained` to build/demo/hf with the tokenizer files and assets/chat_template.jinja.
  4. `nebula convert --outtype q8_0` (the release binary, built first) writes models/nebula-demo.gguf.

Usage: python3 scripts/make_demo_model.py [--steps 300] [--seed 7]
"""

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, Qwen4ExpForCausalLM, Qwen4ExpTextConfig

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
OUT = ROOT / "models" / "nebula-demo.gguf"
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


def examples(tok, template):
    chats = json.loads((ROOT / "scripts/data/demo_chats.json").read_text())
    out = []
    for i, c in enumerate(chats):
        for thinking in (True, False):
            system = SYSTEMS[i % len(SYSTEMS)] if thinking else SYSTEMS[(i + 1) % len(SYSTEMS)]
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": c["q"]}]
            prompt = tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                             add_generation_prompt=True, enable_thinking=thinking)
            completion = (f"{c['think']}\n</think>\n\n" if thinking else "") + c["a"] + "<|im_end|>"
            p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            c_ids = tok(completion, add_special_tokens=False)["input_ids"]
            out.append((p_ids, c_ids))
    return out


def train(model, data, steps, seed, batch=16):
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    model.train()
    t0 = time.time()
    for step in range(steps):
        b = rng.sample(data, min(batch, len(data)))
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
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    model.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    subprocess.run([sys.executable, str(ROOT / "scripts/make_tokenizer.py")], check=True)
    tok_dir = BUILD / "tokenizer"
    tok = AutoTokenizer.from_pretrained(tok_dir)
    template = (ROOT / "assets/chat_template.jinja").read_text()

    model = Qwen4ExpForCausalLM(config()).float()
    data = examples(tok, template)
    print(f"{len(data)} training examples, {sum(p.numel() for p in model.parameters()):,} parameters")
    train(model, data, args.steps, args.seed)

    # Greedy answers from the reference, kept as a fixture: the engine must reproduce them from the GGUF.
    greedy = []
    with torch.no_grad():
        for q in ["Hello!", "What is Nebula?"]:
            prompt = tok.apply_chat_template([{"role": "user", "content": q}], chat_template=template,
                                             tokenize=False, add_generation_prompt=True)
            ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
            out = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=[248046, 248044])
            text = tok.decode(out[0, ids.shape[1]:])
            greedy.append({"user": q, "prompt_ids": ids[0].tolist(), "completion": text})
            print(f"reference greedy for {q!r}: {text!r}")
    fixture = ROOT / "tests/fixtures/demo/reference_greedy.json"
    fixture.parent.mkdir(parents=True, exist_ok=True)
    fixture.write_text(json.dumps({"source": "transformers greedy generate on the f32 demo checkpoint "
                                   "(scripts/make_demo_model.py), thinking on, default reasoning effort",
                                   "cases": greedy}, ensure_ascii=False, indent=1) + "\n")

    hf = BUILD / "demo" / "hf"
    if hf.exists():
        shutil.rmtree(hf)
    model.save_pretrained(hf, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, hf / f)
    (hf / "chat_template.jinja").write_text(template)

    subprocess.run(["cargo", "build", "--release", "-p", "nebula-service"], cwd=ROOT, check=True)
    OUT.parent.mkdir(exist_ok=True)
    subprocess.run([str(ROOT / "target/release/nebula"), "convert", str(hf), "-o", str(OUT), "--outtype", "q8_0",
                    "--name", "nebula-demo"], check=True)
    size = OUT.stat().st_size
    print(f"{OUT.relative_to(ROOT)}: {size / 1e6:.1f} MB (transformers {transformers.__version__}, torch {torch.__version__})")
    if size > 40e6:
        sys.exit(f"the demo model is {size / 1e6:.1f} MB, over the 40 MB budget")


if __name__ == "__main__":
    main()
