"""The official Anthropic Python SDK against `nebula serve` (POST /v1/messages, /v1/messages/count_tokens) with the
embedded demo model.

Expected answers come from `tests/fixtures/demo/reference_greedy.json` (transformers greedy generation on the demo
checkpoint, written by scripts/make_demo_model.py), not from Nebula: a one-message conversation renders to the same
prompt through the Messages API as through chat completions. Run with scripts/test_sdk.sh.
"""

import json
import pathlib

import anthropic
import pytest
from anthropic.types import Message

from conftest import AGENT_KEY, ALIASES

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = json.loads((REPO / "tests/fixtures/demo/reference_greedy.json").read_text())
HELLO = FIXTURE["cases"][0]
assert HELLO["user"] == "Hello!"
HELLO_REASONING, HELLO_ANSWER = (
    part.strip() for part in HELLO["completion"].removesuffix("<|im_end|>").split("</think>")
)
MODEL = "nebula-demo"
# The SDK's `create` takes no `temperature` (newer Claude models fix it); the Messages API still has the field.
GREEDY = {"temperature": 0}
HELLO_MESSAGES = [{"role": "user", "content": "Hello!"}]

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}
TOOL_KWARGS = dict(
    model=MODEL,
    max_tokens=200,
    extra_body=GREEDY,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    tools=[WEATHER_TOOL],
    tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)


def test_create_greedy_matches_the_reference(client):
    msg = client.messages.create(model=MODEL, max_tokens=200, extra_body=GREEDY, messages=HELLO_MESSAGES)
    assert isinstance(msg, Message)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == MODEL
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == HELLO_REASONING
    assert msg.content[0].signature
    assert msg.content[1].text == HELLO_ANSWER
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    # input_tokens counts the prompt tokens not read from the prefix cache.
    usage = msg.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(HELLO["prompt_ids"])
    assert usage.cache_creation_input_tokens == 0
    assert usage.output_tokens > 0
    # The same request again: the prompt is in the prefix cache now.
    again = client.messages.create(model=MODEL, max_tokens=200, extra_body=GREEDY, messages=HELLO_MESSAGES)
    assert again.content[1].text == HELLO_ANSWER
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(HELLO["prompt_ids"])


def test_count_tokens_is_the_prompt_length(client, server):
    count = client.messages.count_tokens(model=MODEL, messages=HELLO_MESSAGES)
    assert count.input_tokens == len(HELLO["prompt_ids"])
    # /tokenize of the same conversation (vLLM's chat shape) gives the reference ids themselves.
    import urllib.request

    body = json.dumps({"messages": HELLO_MESSAGES}).encode()
    req = urllib.request.Request(f"{server}/tokenize", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        tokens = json.load(resp)
    assert tokens["tokens"] == HELLO["prompt_ids"]
    assert tokens["count"] == count.input_tokens


def test_stream_text_and_thinking(client):
    with client.messages.stream(model=MODEL, max_tokens=200, extra_body=GREEDY, messages=HELLO_MESSAGES) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start"
    assert types[-1] == "message_stop"
    assert "content_block_start" in types and "content_block_stop" in types
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "text_delta" in deltas and "signature_delta" in deltas
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == HELLO_REASONING
    assert final.content[1].text == HELLO_ANSWER
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(HELLO["prompt_ids"])


def test_thinking_disabled_and_omitted(client):
    off = client.messages.create(
        model=MODEL, max_tokens=200, extra_body=GREEDY, messages=HELLO_MESSAGES, thinking={"type": "disabled"}
    )
    assert [b.type for b in off.content] == ["text"]
    omitted = client.messages.create(
        model=MODEL,
        max_tokens=200,
        extra_body=GREEDY,
        messages=HELLO_MESSAGES,
        thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
    )
    assert omitted.content[0].type == "thinking"
    assert omitted.content[0].thinking == "" and omitted.content[0].signature
    assert omitted.content[1].text == HELLO_ANSWER


def test_tool_use_stream_equals_non_stream(client):
    whole = client.messages.create(**TOOL_KWARGS)
    assert whole.stop_reason == "tool_use"
    (call,) = [b for b in whole.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input["city"] in ("Paris", "Tokyo") and isinstance(call.input["days"], int)
    with client.messages.stream(**TOOL_KWARGS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == call.input
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == call.input and streamed.name == call.name
    assert final.stop_reason == "tool_use"

    # The round trip: the result goes back and the model answers.
    follow = client.messages.create(
        model=MODEL,
        max_tokens=100,
        extra_body=GREEDY,
        tools=[WEATHER_TOOL],
        messages=[
            *TOOL_KWARGS["messages"],
            {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C."}],
            },
        ],
    )
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert follow.content


def test_signature_gives_the_thinking_back(client):
    """A replayed thinking block with its text omitted counts the same tokens as with the text: the server read
    its own signature."""
    whole = client.messages.create(**TOOL_KWARGS, thinking={"type": "enabled", "budget_tokens": 1024})
    thinking, call = whole.content[0], [b for b in whole.content if b.type == "tool_use"][0]
    assert thinking.type == "thinking" and thinking.thinking

    def count(blocks):
        messages = [
            *TOOL_KWARGS["messages"],
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny."}]},
        ]
        return client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER_TOOL]).input_tokens

    tool_use = call.model_dump()
    clear = count([{"type": "thinking", "thinking": thinking.thinking, "signature": thinking.signature}, tool_use])
    sealed = count([{"type": "thinking", "thinking": "", "signature": thinking.signature}, tool_use])
    forged = count([{"type": "thinking", "thinking": "", "signature": "bm90IG91cnM="}, tool_use])
    none = count([tool_use])
    assert sealed == clear
    assert forged == none < clear


def test_stop_sequences_name_the_match(client):
    msg = client.messages.create(
        model=MODEL,
        max_tokens=200,
        extra_body=GREEDY,
        messages=HELLO_MESSAGES,
        thinking={"type": "disabled"},
        stop_sequences=["demo"],
    )
    assert msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == "demo"
    # The text before the match, the match itself not returned.
    assert msg.content[0].text.strip() == HELLO_ANSWER.split("demo")[0].strip()


def test_max_tokens_beyond_the_context_is_clamped(client):
    msg = client.messages.create(model=MODEL, max_tokens=10_000_000, extra_body=GREEDY, messages=HELLO_MESSAGES)
    assert msg.content[-1].text == HELLO_ANSWER
    short = client.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY, messages=HELLO_MESSAGES)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_system_blocks_and_system_messages(client):
    msg = client.messages.create(
        model=MODEL,
        max_tokens=40,
        extra_body=GREEDY,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": [{"type": "text", "text": "Thank you!", "cache_control": {"type": "ephemeral"}}]},
        ],
    )
    assert msg.content and msg.stop_reason in ("end_turn", "max_tokens")


def test_errors_are_typed(client, server, agent_server):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-does-not-exist", max_tokens=10, messages=HELLO_MESSAGES)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=10, messages=HELLO_MESSAGES, extra_body={"temperature": 5})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}],
                }
            ],
        )
    # Bytes that are no image: a 400 that says so (the server reads PNG, JPEG, WebP and GIF).
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "image could not be used" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=10, messages=HELLO_MESSAGES, extra_body={"bogus": 1})
    wrong = anthropic.Anthropic(base_url=agent_server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=10, messages=HELLO_MESSAGES)
    assert e.value.body["error"]["type"] == "authentication_error"
    # The right key as x-api-key, and any model name on this server.
    right = anthropic.Anthropic(base_url=agent_server, api_key=AGENT_KEY, max_retries=0, timeout=120)
    msg = right.messages.create(model="claude-opus-4-1-20250805", max_tokens=200, extra_body=GREEDY, messages=HELLO_MESSAGES)
    assert msg.model == "claude-opus-4-1-20250805" and msg.content[-1].text == HELLO_ANSWER


def test_aliases_answer_and_others_are_not_found(alias_server):
    client = anthropic.Anthropic(base_url=alias_server, api_key="none", max_retries=0, timeout=120)
    msg = client.messages.create(model=ALIASES[0], max_tokens=200, extra_body=GREEDY, messages=HELLO_MESSAGES)
    assert msg.model == ALIASES[0] and msg.content[-1].text == HELLO_ANSWER
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=HELLO_MESSAGES)
