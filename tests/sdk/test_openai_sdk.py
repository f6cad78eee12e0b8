"""The official OpenAI Python SDK against `nebula serve` with the embedded demo model.

Expected answers come from `tests/fixtures/demo/reference_greedy.json` (transformers greedy generation on the demo
checkpoint, written by scripts/make_demo_model.py), not from Nebula. Run with scripts/test_sdk.sh.
"""

import json
import pathlib

import openai
import pytest
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = json.loads((REPO / "tests/fixtures/demo/reference_greedy.json").read_text())
HELLO = FIXTURE["cases"][0]
assert HELLO["user"] == "Hello!"
HELLO_REASONING, HELLO_ANSWER = (
    part.strip() for part in HELLO["completion"].removesuffix("<|im_end|>").split("</think>")
)
MODEL = "nebula-demo"
MESSAGES = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def test_models_list(client):
    models = client.models.list().data
    assert len(models) == 1
    model = models[0]
    assert isinstance(model, Model)
    assert model.id == MODEL
    assert model.object == "model"
    assert model.owned_by == "nebula"
    assert model.model_extra["max_model_len"] > 0


def test_non_stream_greedy(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert isinstance(resp, ChatCompletion)
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"
    assert resp.model == MODEL
    assert resp.created > 1_600_000_000
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.index == 0
    assert choice.finish_reason == "stop"
    assert choice.logprobs is None
    assert choice.message.role == "assistant"
    assert choice.message.content == HELLO_ANSWER
    assert choice.message.tool_calls is None
    assert choice.message.model_extra["reasoning_content"] == HELLO_REASONING
    usage = resp.usage
    assert usage.prompt_tokens == len(HELLO["prompt_ids"])
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def _collect(stream):
    chunks = list(stream)
    for chunk in chunks:
        assert isinstance(chunk, ChatCompletionChunk)
        assert chunk.object == "chat.completion.chunk"
        assert chunk.model == MODEL
        assert chunk.id == chunks[0].id
    return chunks


def test_stream_with_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    chunks = _collect(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump()
    reasoning, content = "", ""
    for chunk in choice_chunks:
        assert chunk.usage is None
        assert len(chunk.choices) == 1
        delta = chunk.choices[0].delta
        extra = (delta.model_extra or {}).get("reasoning_content")
        if extra:
            assert content == "", "reasoning arrives before the answer"
            reasoning += extra
        content += delta.content or ""
    assert reasoning == HELLO_REASONING
    assert content == HELLO_ANSWER
    finish = [c.choices[0].finish_reason for c in choice_chunks]
    assert finish[-1] == "stop"
    assert all(f is None for f in finish[:-1])


def test_stream_without_usage(client):
    chunks = _collect(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, stream=True))
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == HELLO_ANSWER


def test_thinking_off_via_extra_body(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = resp.choices[0].message
    assert message.content == HELLO_ANSWER
    assert "reasoning_content" not in (message.model_extra or {})


def test_max_tokens_gives_length(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=5)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_completion_tokens=3)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3


def test_stop_string(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, stop=["demo"])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == "Hello! I am the Nebula"


def test_seed_reproducible(client):
    def ask(seed):
        resp = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me something surprising."}],
            temperature=1.0,
            top_p=1.0,
            seed=seed,
            max_tokens=40,
            extra_body={"top_k": 0},
        )
        message = resp.choices[0].message
        return message.content, (message.model_extra or {}).get("reasoning_content")

    assert ask(7) == ask(7)


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    err = info.value
    assert err.status_code == 404
    assert err.code == "model_not_found"
    assert err.type == "invalid_request_error"
    assert "gpt-4o" in err.message


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": MESSAGES, "n": 2}, "n"),
        ({"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
        ({"messages": MESSAGES, "temperature": 5}, "temperature"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_bad_requests_raise_bad_request(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, **kwargs)
    err = info.value
    assert err.status_code == 400
    assert err.type == "invalid_request_error"
    assert err.param == param
    assert err.message


def test_bad_request_in_stream_mode_raises_before_streaming(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], stream=True)
