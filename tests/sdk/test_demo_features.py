"""The demo model shows the features to a new user: with the official OpenAI SDK against `nebula serve` on the
embedded demo model, unconstrained (no `tool_choice`, thinking as the request leaves it), prompts of its training
set (scripts/data/demo_tools.json) get well-formed tool calls, the tool's output gets a text answer, and
`response_format: json_object` gets parseable JSON. Expected values come from the training data and from
transformers' greedy answers on the demo checkpoint (`tool_cases` of tests/fixtures/demo/reference_greedy.json,
written by scripts/make_demo_model.py), not from Nebula. Run with scripts/test_sdk.sh.
"""

import json
import pathlib

import openai
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DATA = json.loads((REPO / "scripts/data/demo_tools.json").read_text())
CASES = json.loads((REPO / "tests/fixtures/demo/reference_greedy.json").read_text())["tool_cases"]
TOOLS = DATA["tools"]
MODEL = "nebula-demo"


def call_of(question):
    return next(c for c in DATA["calls"] if c["q"] == question)


def answer_of(case):
    """The answer part of a reference completion (after the thinking block, without <|im_end|>)."""
    return case["completion"].removesuffix("<|im_end|>").rsplit("</think>\n\n", 1)[-1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def test_unconstrained_tool_call(client):
    # Thinking on (the default), the tool alone: as trained.
    question = "Is it raining in London?"
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        tools=[TOOLS["get_weather"]],
        temperature=0,
        max_tokens=200,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra.get("reasoning_content")
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == call_of(question)["call"]["arguments"] == {"city": "London"}


def test_unconstrained_tool_call_streamed_thinking_off(client):
    # Thinking off, every tool offered: the model picks add_numbers itself; integer arguments stay integers.
    question = "Add 2 and 3."
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        tools=list(TOOLS.values()),
        temperature=0,
        max_tokens=200,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "add_numbers"
    assert json.loads(call.function.arguments) == call_of(question)["call"]["arguments"] == {"a": 2, "b": 3}
    arguments, names = "", ""
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.index == 0
            names += delta.function.name or ""
            arguments += delta.function.arguments or ""
    assert names == "add_numbers"
    assert json.loads(arguments) == {"a": 2, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_output_gets_an_answer(client):
    # The round trip as a client sends it: the call with its id, then the tool's output.
    case = next(c for c in CASES if c["messages"][-1]["role"] == "tool")
    question = case["messages"][0]["content"]
    call = call_of(question)
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": call["call"]["name"], "arguments": json.dumps(call["call"]["arguments"])}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": call["result"]},
    ]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, tools=list(TOOLS.values()), temperature=0, max_tokens=200
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.tool_calls is None
    assert choice.message.content == answer_of(case)


def test_responses_api_function_call(client):
    # The Responses API's function-tool shape, unconstrained.
    tool = TOOLS["get_weather"]["function"]
    resp = client.responses.create(
        model=MODEL,
        input="Is it raining in London?",
        tools=[{"type": "function", "name": tool["name"], "description": tool["description"],
                "parameters": tool["parameters"], "strict": False}],
        temperature=0,
        max_output_tokens=200,
    )
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "London"}


@pytest.mark.parametrize("case", [c for c in CASES if not c["tools"]], ids=lambda c: c["messages"][-1]["content"])
def test_json_object_parses(client, case):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=case["messages"],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
        extra_body={"chat_template_kwargs": {"enable_thinking": case["enable_thinking"]}},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    value = json.loads(choice.message.content)
    assert isinstance(value, dict)
    assert value == json.loads(answer_of(case))
