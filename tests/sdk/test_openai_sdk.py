"""The official OpenAI Python SDK against `nebula serve` with the embedded demo model.

Expected answers come from `tests/fixtures/demo/reference_greedy.json` (transformers greedy generation on the demo
checkpoint, written by scripts/make_demo_model.py), not from Nebula. Run with scripts/test_sdk.sh.
"""

import json
import pathlib
import threading

import openai
import pydantic
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from conftest import STRICT_KEY

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
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


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
        ({"messages": MESSAGES, "n": 9}, "n"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": MESSAGES, "reasoning_effort": "ultra"}, "reasoning_effort"),
        ({"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format"),
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


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TOOL_KWARGS = dict(
    model=MODEL,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    temperature=0,
    max_tokens=200,
    tools=[WEATHER_TOOL],
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    parallel_tool_calls=False,
)


def test_tool_call_non_stream(client):
    resp = client.chat.completions.create(**TOOL_KWARGS)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Tokyo") and isinstance(args["days"], int)


def test_tool_call_stream(client):
    whole = client.chat.completions.create(**TOOL_KWARGS)
    chunks = _collect(client.chat.completions.create(**TOOL_KWARGS, stream=True))
    calls = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            if delta.id:
                assert call["id"] is None, "the id comes once"
                call["id"] = delta.id
            if delta.function.name:
                call["name"] += delta.function.name
            # Every prefix is a prefix of the final JSON; the whole is the same object as non-streamed.
            call["arguments"] += delta.function.arguments or ""
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_n_choices(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, n=3, max_tokens=8)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.message.model_extra["reasoning_content"] for c in resp.choices}) == 1
    assert resp.usage.completion_tokens == 24
    stream = _collect(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, n=2, max_tokens=4, stream=True)
    )
    finished = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_logprobs(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for token in content:
        assert token.logprob <= 0
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token
        assert bytes(token.bytes).decode("utf-8", "replace") == token.token


class Reply(pydantic.BaseModel):
    answer: str = pydantic.Field(max_length=24)
    count: int
    sure: bool


@pytest.mark.parametrize("thinking", [True, False])
def test_json_schema_parsed_by_the_sdk(client, thinking):
    # The SDK's structured-output helper sends a strict json_schema and parses the answer into the model.
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    resp = parse(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=200,
        response_format=Reply,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
    )
    message = resp.choices[0].message
    assert isinstance(message.parsed, Reply)
    assert len(message.parsed.answer) <= 24
    assert ("reasoning_content" in (message.model_extra or {})) == thinking


def test_text_completion(client):
    prompt = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert isinstance(resp, Completion)
    assert resp.choices[0].text == HELLO_ANSWER
    assert resp.choices[0].finish_reason == "stop"


def test_reasoning_effort_high_is_accepted(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, reasoning_effort="high")
    assert resp.choices[0].finish_reason == "stop"


def _strict(base, key=STRICT_KEY):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def test_wrong_api_key_is_401(strict_server):
    with pytest.raises(openai.AuthenticationError) as info:
        _strict(strict_server, "wrong").chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    assert _strict(strict_server).models.list().data[0].id == MODEL


def test_body_over_the_limit_is_413(strict_server):
    with pytest.raises(openai.APIStatusError) as info:
        _strict(strict_server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * 100_000}]
        )
    assert info.value.status_code == 413
    assert info.value.code == "payload_too_large"


def test_busy_server_is_429(strict_server):
    client = _strict(strict_server)
    started = threading.Event()
    release = threading.Event()

    def hold():
        stream = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, max_tokens=4000, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        started.set()
        release.wait(60)
        stream.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert started.wait(60)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert info.value.status_code == 429
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.type == "rate_limit_error"
    finally:
        release.set()
        holder.join()
