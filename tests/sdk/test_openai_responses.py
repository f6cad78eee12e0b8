"""The official OpenAI Python SDK's Responses API (`client.responses`) against `nebula serve` with the embedded demo
model.

Expected answers come from `tests/fixtures/demo/reference_greedy.json` (transformers greedy generation on the demo
checkpoint, written by scripts/make_demo_model.py): the input "Hello!" renders to the same prompt as the chat
message. Run with scripts/test_sdk.sh.
"""

import json
import pathlib

import openai
import pydantic
import pytest
from openai.types.responses import Response

from conftest import ALIASES

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = json.loads((REPO / "tests/fixtures/demo/reference_greedy.json").read_text())
HELLO = FIXTURE["cases"][0]
assert HELLO["user"] == "Hello!"
HELLO_REASONING, HELLO_ANSWER = (
    part.strip() for part in HELLO["completion"].removesuffix("<|im_end|>").split("</think>")
)
MODEL = "nebula-demo"

WEATHER_TOOL = {
    "type": "function",
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
    "strict": False,
}
QUESTION = "What is the capital of France?"
TOOL_KWARGS = dict(
    model=MODEL,
    input=QUESTION,
    temperature=0,
    max_output_tokens=200,
    tools=[WEATHER_TOOL],
    tool_choice={"type": "function", "name": "get_weather"},
    parallel_tool_calls=False,
)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def test_create_greedy_matches_the_reference(client):
    resp = client.responses.create(model=MODEL, input="Hello!", temperature=0, store=False)
    assert isinstance(resp, Response)
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.model == MODEL
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    reasoning, message = resp.output
    assert reasoning.content[0].text == HELLO_REASONING
    assert reasoning.encrypted_content is None
    assert message.role == "assistant" and message.status == "completed"
    assert resp.output_text == HELLO_ANSWER
    usage = resp.usage
    assert usage.input_tokens == len(HELLO["prompt_ids"])
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    again = client.responses.create(model=MODEL, input="Hello!", temperature=0)
    assert again.usage.input_tokens_details.cached_tokens > 0
    assert again.output_text == HELLO_ANSWER


def test_stream_event_grammar(client):
    with client.responses.stream(model=MODEL, input="Hello!", temperature=0, reasoning={"summary": "auto"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for needed in (
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert needed in types, needed
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == HELLO_ANSWER == final.output_text
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == HELLO_REASONING == final.output[0].summary[0].text
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert added == done == [item.id for item in final.output]


def test_reasoning_text_stream_without_summary(client):
    with client.responses.stream(model=MODEL, input="Hello!", temperature=0) as stream:
        events = list(stream)
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == HELLO_REASONING
    assert any(e.type == "response.reasoning_text.done" and e.text == HELLO_REASONING for e in events)


def test_function_call_round_trip(client):
    resp = client.responses.create(**TOOL_KWARGS)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Tokyo") and isinstance(args["days"], int)

    with client.responses.stream(**TOOL_KWARGS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(streamed) == args
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == args
    assert [i.type for i in final.output if i.type == "function_call"] == ["function_call"]

    # The round trip: the call and its output go back (stateless: the whole history), the model answers.
    follow = client.responses.create(
        model=MODEL,
        temperature=0,
        max_output_tokens=100,
        tools=[WEATHER_TOOL],
        store=False,
        input=[
            {"role": "user", "content": QUESTION},
            *[item.model_dump(exclude_none=True) for item in resp.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."},
        ],
    )
    assert follow.status in ("completed", "incomplete")
    assert follow.output


def test_encrypted_reasoning_is_read_back(client):
    """Sealed reasoning replayed in `input` reaches the prompt: the prompt is as long as with the reasoning in
    clear, and an unreadable blob is ignored (not a 400)."""
    resp = client.responses.create(**TOOL_KWARGS, include=["reasoning.encrypted_content"], store=False)
    reasoning = resp.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    call = [i for i in resp.output if i.type == "function_call"][0]

    def prompt_tokens(reasoning_item):
        items = [{"role": "user", "content": QUESTION}]
        if reasoning_item:
            items.append(reasoning_item)
        items += [
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."},
        ]
        r = client.responses.create(model=MODEL, input=items, tools=[WEATHER_TOOL], max_output_tokens=1)
        return r.usage.input_tokens

    text = reasoning.content[0].text
    clear = prompt_tokens({"type": "reasoning", "id": reasoning.id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
    sealed = prompt_tokens({"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content})
    garbage = prompt_tokens({"type": "reasoning", "id": "rs_x", "summary": [], "encrypted_content": "bm90IG91cnM="})
    none = prompt_tokens(None)
    assert sealed == clear
    assert garbage == none < clear


class Reply(pydantic.BaseModel):
    answer: str = pydantic.Field(max_length=24)
    count: int
    sure: bool


def test_json_schema_parsed_by_the_sdk(client):
    resp = client.responses.parse(model=MODEL, input="Hello!", temperature=0, max_output_tokens=200, text_format=Reply)
    assert isinstance(resp.output_parsed, Reply)
    assert len(resp.output_parsed.answer) <= 24


def test_developer_and_several_system_messages(client):
    resp = client.responses.create(
        model=MODEL,
        instructions="You are the demo model.",
        input=[
            {"role": "developer", "content": "Answer briefly."},
            {"role": "system", "content": [{"type": "input_text", "text": "Be kind."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Hello!"}]},
            {"role": "developer", "content": "Stay on topic."},
        ],
        temperature=0,
        max_output_tokens=60,
    )
    assert resp.status in ("completed", "incomplete")
    assert resp.output and resp.instructions == "You are the demo model."


def test_max_output_tokens_gives_incomplete(client):
    resp = client.responses.create(model=MODEL, input="Hello!", temperature=0, max_output_tokens=3)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3


def test_effort_none_turns_thinking_off(client):
    resp = client.responses.create(model=MODEL, input="Hello!", temperature=0, reasoning={"effort": "none"})
    assert [i.type for i in resp.output] == ["message"]
    assert resp.output_text == HELLO_ANSWER


def test_bad_requests(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hello!", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hello!", extra_body={"bogus": True})
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hello!", max_output_tokens=10_000_000)
    assert "maximum context length" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-5-codex", input="Hello!")
    assert e.value.body["code"] == "model_not_found"


def test_aliases(alias_server):
    client = openai.OpenAI(base_url=f"{alias_server}/v1", api_key="none", max_retries=0, timeout=120)
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, *ALIASES]
    resp = client.responses.create(model=ALIASES[1], input="Hello!", temperature=0)
    assert resp.model == ALIASES[1] and resp.output_text == HELLO_ANSWER
    chat = client.chat.completions.create(model=ALIASES[1], messages=[{"role": "user", "content": "Hello!"}], temperature=0)
    assert chat.choices[0].message.content == HELLO_ANSWER
    assert client.models.retrieve(ALIASES[0]).id == ALIASES[0]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hello!"}])
