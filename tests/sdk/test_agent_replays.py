"""Replays of the requests two coding agents send (tests/fixtures/agents/, written by scripts/make_agent_fixtures.py):
Claude Code's streamed POST /v1/messages?beta=true and the Codex CLI's streamed POST /v1/responses, each through a
real `nebula serve` with an API key and `serve_any_model` (the agents ask for their own model names).

Each replay checks the event grammar of the stream (every event type in its place, ids and indices consistent,
every event and the final object valid for the official SDK's types), then makes a tool round trip: the model's
tool call (forced by `tool_choice`, with thinking off, so that the demo model's calls are well-formed and short) goes back with a result in the
next turn, with the history replayed as the agent replays it. Run with scripts/test_sdk.sh.
"""

import copy
import json
import pathlib

import urllib.error
import urllib.request

import anthropic
import openai
import pydantic
import pytest

from conftest import AGENT_KEY

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "agents"
RESPONSE_EVENT = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
MESSAGE_EVENT = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)


def load(name):
    fixture = json.loads((FIXTURES / name).read_text())
    fixture["headers"] = {k: v.replace("$KEY", AGENT_KEY) for k, v in fixture["headers"].items()}
    return fixture


def post(base, fixture, body, headers=None):
    req = urllib.request.Request(
        base + fixture["path"], data=json.dumps(body).encode(), headers=headers or fixture["headers"], method="POST"
    )
    return urllib.request.urlopen(req, timeout=300)


def sse(base, fixture, body):
    """POSTs `body` as the fixture's agent does and returns the (event name, data) pairs of the stream."""
    events = []
    with post(base, fixture, body) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        name = None
        for raw in resp:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name, (name, data)
                events.append((name, data))
                name = None
    return events


# --- Claude Code: POST /v1/messages?beta=true ---------------------------------------------------------------------


def check_message_stream(events):
    """The Messages event grammar; returns the message the events build."""
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert names[-2] == "message_delta"
    assert "ping" in names
    for name, data in events:
        if name != "ping":  # the SDK reads pings apart from the typed events
            MESSAGE_EVENT.validate_python(data)
    message = events[0][1]["message"]
    assert message["id"].startswith("msg_") and message["content"] == [] and message["stop_reason"] is None
    blocks, open_index = [], None
    for name, data in events[1:-2]:
        if name == "ping":
            continue
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append({**data["content_block"], "_json": ""})
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = blocks[open_index], data["delta"]
            expected = {"text": ["text_delta"], "thinking": ["thinking_delta", "signature_delta"],
                        "tool_use": ["input_json_delta"]}[block["type"]]
            assert delta["type"] in expected, (block["type"], delta)
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] += delta["signature"]
            else:
                block["_json"] += delta["partial_json"]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            raise AssertionError(f"unexpected event {name}")
    assert open_index is None
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["_json"])
            assert isinstance(block["input"], dict)
        if block["type"] == "thinking":
            assert block["signature"], "every thinking block is signed"
        del block["_json"]
    end = events[-2][1]
    message.update(content=blocks, stop_reason=end["delta"]["stop_reason"], stop_sequence=end["delta"]["stop_sequence"])
    message["usage"].update(end["usage"])
    anthropic.types.Message.model_validate(message)
    assert (message["stop_reason"] == "tool_use") == any(b["type"] == "tool_use" for b in blocks)
    return message


def test_claude_code_replay(agent_server):
    fixture = load("claude_code_messages.json")
    body = fixture["body"]
    message = check_message_stream(sse(agent_server, fixture, body))
    assert message["model"] == body["model"]
    # display: omitted: thinking blocks carry no text, only the signature.
    assert all(b["thinking"] == "" for b in message["content"] if b["type"] == "thinking")
    assert message["usage"]["output_tokens"] > 0

    # A tool call (forced: the demo model's own calls may be malformed), then its result on the way back.
    # Forced, thinking off, a tool whose input is an enum: the demo model's thinking on this unfamiliar prompt does
    # not end, nor does a free string it writes.
    forced = copy.deepcopy(body)
    forced["tool_choice"] = {"type": "tool", "name": "BashOutput"}
    forced["thinking"] = {"type": "disabled"}
    forced["max_tokens"] = 128000
    call_turn = check_message_stream(sse(agent_server, fixture, forced))
    assert call_turn["stop_reason"] == "tool_use"
    (call,) = [b for b in call_turn["content"] if b["type"] == "tool_use"]
    assert call["name"] == "BashOutput" and call["input"] == {"bash_id": call["input"]["bash_id"]}
    assert call["input"]["bash_id"] in ("shell_1", "shell_2")
    follow = copy.deepcopy(body)
    follow["messages"] += [
        {"role": "assistant", "content": call_turn["content"]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call["id"], "content": "1\t4", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Thanks."},
        ]},
    ]
    follow_turn = check_message_stream(sse(agent_server, fixture, follow))
    assert follow_turn["content"]
    # The replayed history hit the prefix cache.
    assert follow_turn["usage"]["cache_read_input_tokens"] > 0


# --- Codex CLI: POST /v1/responses --------------------------------------------------------------------------------


def check_response_stream(events):
    """The Responses event grammar; returns the final response object."""
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"], names[:3]
    assert names[-1] in ("response.completed", "response.incomplete"), names[-1]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    for _, data in events:
        RESPONSE_EVENT.validate_python(data)
    response_id = events[0][1]["response"]["id"]
    assert all(d["response"]["id"] == response_id for n, d in events if "response" in d)
    items, texts = {}, {}
    for name, data in events[2:-1]:
        index = data["output_index"]
        if name == "response.output_item.added":
            assert index == len(items)
            items[index] = data["item"]
            texts[index] = ""
            continue
        item = items[index]
        if "item_id" in data:
            assert data["item_id"] == item["id"]
        if name.endswith(".delta"):
            texts[index] += data["delta"]
        elif name == "response.output_text.done":
            assert data["text"] == texts[index]
        elif name == "response.function_call_arguments.done":
            assert data["arguments"] == texts[index]
            assert isinstance(json.loads(data["arguments"]), dict)
        elif name == "response.output_item.done":
            assert data["item"]["id"] == item["id"] and data["item"]["type"] == item["type"]
            items[index] = data["item"]
    final = events[-1][1]["response"]
    assert [i["id"] for i in final["output"]] == [items[i]["id"] for i in sorted(items)]
    openai.types.responses.Response.model_validate(final)
    usage = final["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    return final


def test_codex_replay(agent_server):
    fixture = load("codex_responses.json")
    body = fixture["body"]
    final = check_response_stream(sse(agent_server, fixture, body))
    assert final["model"] == body["model"] and final["store"] is False
    # web_search is a hosted tool: left out, the rest echoed.
    assert [t["type"] for t in final["tools"]] == ["function", "function", "function", "namespace"]
    for item in final["output"]:
        if item["type"] == "reasoning":
            assert item["encrypted_content"] and item["summary"]

    # A namespaced tool call (forced), its output replayed with the whole history.
    forced = copy.deepcopy(body)
    forced["tool_choice"] = {"type": "function", "name": "page_outline", "namespace": "mcp__docs__"}
    forced["reasoning"] = {"effort": "none", "summary": "auto"}
    call_turn = check_response_stream(sse(agent_server, fixture, forced))
    (call,) = [i for i in call_turn["output"] if i["type"] == "function_call"]
    assert call["name"] == "page_outline" and call["namespace"] == "mcp__docs__"
    assert json.loads(call["arguments"])["page"] in ("intro", "install", "api")
    follow = copy.deepcopy(body)
    follow["input"] += call_turn["output"] + [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "No results."},
    ]
    follow_turn = check_response_stream(sse(agent_server, fixture, follow))
    assert follow_turn["output"]
    assert follow_turn["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_agents_without_the_key_are_refused(agent_server):
    for name, status_field in [("claude_code_messages.json", "type"), ("codex_responses.json", "error")]:
        fixture = load(name)
        headers = {k: v for k, v in fixture["headers"].items() if k not in ("x-api-key", "authorization")}
        with pytest.raises(urllib.error.HTTPError) as e:
            post(agent_server, fixture, fixture["body"], headers)
        assert e.value.code == 401
        body = json.load(e.value)
        if name.startswith("claude"):
            assert body == {"type": "error", "error": {"type": "authentication_error", "message": body["error"]["message"]}}
        else:
            assert body["error"]["code"] == "invalid_api_key"
        assert status_field in body
