#!/usr/bin/env python3
"""Write tests/fixtures/chat_template/cases.json: conversations rendered by transformers' own chat-template renderer.

Truth: transformers (5.24) `utils/chat_template_utils.py` on jinja2 3.1 -- the message normalization of
`apply_chat_template` (`_normalize_chat_messages`: drop keys whose value is None) and `render_jinja_template`
(ImmutableSandboxedEnvironment with trim_blocks/lstrip_blocks/loopcontrols, its `tojson`, `raise_exception`,
reasoning aliases) -- rendering the SAME template files the Rust renderer loads:

- `assets/chat_template.jinja` (Qwen3.8-Flash-Next format, the model's template);
- `tests/fixtures/chat_template/qwen35_style.jinja` (a second, Qwen3.5-style template with plain tags, loop
  filters, macros, `str.format`, `|map`, `tojson(indent=2)`...), to show the renderer is not tuned to one template;
- `tests/fixtures/chat_template/jinja_features.jinja` (a probe printing ~250 expressions: tests, filters, Python
  methods, operators, number and container printing, whitespace control, raw/with/filter/set blocks).

Before rendering, OpenAI `tool_calls[].function.arguments` JSON strings become dicts (json.loads keeps key order), as
vLLM/SGLang do and as Nebula's `ChatTemplate::render` does; transformers itself expects dicts there.

Each case stores the request (messages, tools, add_generation_prompt, enable_thinking, reasoning_effort, extra
kwargs) and either `expected` (the text) or `error` (the message of the jinja2 TemplateError, i.e. the text given to
`raise_exception`). The templates' texts are stored too, so the Rust test notices a template edited without
regenerating the fixtures.

Usage: python3 scripts/make_template_fixtures.py   (from any directory; rewrites the fixture file)
"""

import copy
import json
import sys
from pathlib import Path

import jinja2
import transformers
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat_template" / "cases.json"
TEMPLATES = {
    "qwen3.8": "assets/chat_template.jinja",
    "qwen3.5-style": "tests/fixtures/chat_template/qwen35_style.jinja",
    "jinja-features": "tests/fixtures/chat_template/jinja_features.jinja",
}

WEATHER = {
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

# Nested schema, unicode, characters an HTML-escaping tojson would change, floats in Python's spelling.
BOOKING = {
    "type": "function",
    "function": {
        "name": "réserver_hôtel",
        "description": "Réserve une chambre — 予約 <b>&</b> \"quoted\" 'single' \\ tab\there 🏨",
        "parameters": {
            "type": "object",
            "properties": {
                "guests": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
                        "required": ["name"],
                    },
                },
                "budget": {"type": "number", "minimum": 0.1, "maximum": 1e-05, "multipleOf": 1.0, "default": 250.5},
                "dates": {
                    "type": "object",
                    "properties": {"from": {"type": "string", "format": "date"}, "nights": {"type": "integer"}},
                },
                "smoking": {"type": "boolean", "default": False},
                "notes": {"type": ["string", "null"], "default": None},
            },
            "required": ["guests", "dates"],
        },
    },
}

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "k": {"type": "integer"}}},
    },
}


def call(name, arguments, call_id="call_0"):
    """An OpenAI tool call; `arguments` is sent as the JSON string the API carries."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def case(name, messages, template="qwen3.8", tools=None, add_generation_prompt=True, enable_thinking=None,
         reasoning_effort=None, extra=None, note=""):
    return {
        "name": name,
        "note": note,
        "template": template,
        "request": {
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
            "reasoning_effort": reasoning_effort,
            "extra": extra or {},
        },
    }


def cases():
    sys_user = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi!"}]
    return [
        case("system_user_thinking_default", sys_user,
             note="thinking on by default: xhigh reasoning line before the system text, <think>\\n prompt"),
        case("worked_example_2_4", [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris", "unit": "c"})]},
            {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 21, "sky": "clear"}'},
            {"role": "assistant", "content": "21 °C and clear."},
            {"role": "user", "content": "And in Lyon?"},
        ], tools=[WEATHER], enable_thinking=False, note="design note section 2.4: 1,648 bytes, sha256 e05f4f23...1def"),
        case("tools_nested_schema_unicode", [
            {"role": "system", "content": "Tu es un agent de voyage."},
            {"role": "user", "content": "Deux nuits à Kyōto pour 2 personnes."},
        ], tools=[BOOKING, SEARCH, WEATHER], reasoning_effort="low",
            note="tools block: tojson with unicode, <>&, floats 0.1/1e-05/1.0, RI(low) first, system text last"),
        case("tool_call_argument_types", [
            {"role": "user", "content": "Book it."},
            {"role": "assistant", "content": "Booking now.", "reasoning_content": "Need the hotel tool.",
             "tool_calls": [
                 call("réserver_hôtel", '{"guests": [{"name": "Aiko", "age": 31}, {"name": "Ben"}], '
                      '"budget": 1e-05, "dates": {"from": "2026-04-01", "nights": 2}, "smoking": false, '
                      '"notes": null, "count": 2, "ratio": 0.1, "whole": 1.0, "title": "Mr \\"Q\\" <x>", '
                      '"multi": "line one\\nline two", "empty": "", "big": 12345678901234567890}'),
                 call("search", {"q": "Kyōto ryokan", "k": 3}, "call_1"),
             ]},
            {"role": "tool", "tool_call_id": "call_0", "content": "booked #42"},
            {"role": "tool", "tool_call_id": "call_1", "content": "3 results"},
        ], tools=[BOOKING, SEARCH], note="string raw; number/bool/list/object/null via tojson; two calls; grouped results"),
        case("tool_responses_grouped_and_single", [
            {"role": "user", "content": "Weather in Paris and Lyon?"},
            {"role": "assistant", "content": None, "tool_calls": [
                call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Lyon"}, "call_1")]},
            {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
            {"role": "tool", "tool_call_id": "call_1", "content": "  20 C  \n"},
            {"role": "assistant", "content": "Checking Nice too.", "tool_calls": [call("get_weather", {"city": "Nice"})]},
            {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
        ], tools=[WEATHER], note="content None dropped; two results in one user turn; a later single result"),
        case("thinking_off_no_system", [{"role": "user", "content": "2+2?"}], enable_thinking=False,
             reasoning_effort="bogus", note="thinking off: no RI, the invalid effort is ignored, closed think prompt"),
        case("reasoning_effort_medium_no_system", [{"role": "user", "content": "2+2?"}], reasoning_effort="medium",
             note="medium adds no line, so no system turn at all"),
        case("reasoning_effort_low_with_system", sys_user, reasoning_effort="low"),
        case("reasoning_effort_xhigh_tools", sys_user, tools=[SEARCH], reasoning_effort="xhigh"),
        case("reasoning_effort_high_invalid", sys_user, reasoning_effort="high",
             note="high is not accepted by the official template"),
        case("reasoning_effort_empty_invalid", sys_user, reasoning_effort=""),
        case("multi_turn_reasoning_history", [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 17*3?"},
            {"role": "assistant", "content": "51.", "reasoning_content": "\n17*3 = 51.\n"},
            {"role": "user", "content": "And 17*4?"},
            {"role": "assistant", "content": "68.", "reasoning": "17*4 = 68."},
            {"role": "user", "content": "Thanks."},
        ], note="preserve_thinking default: every assistant turn keeps its think block; `reasoning` alias"),
        case("preserve_thinking_false", [
            {"role": "user", "content": "What is 17*3?"},
            {"role": "assistant", "content": "51.", "reasoning_content": "17*3 = 51."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
             "tool_calls": [call("get_weather", {"city": "Paris"})]},
            {"role": "tool", "content": "18 C"},
        ], tools=[WEATHER], extra={"preserve_thinking": False},
            note="history before the last query loses its reasoning, the tool loop after it keeps it"),
        case("content_list_text_image_video", [
            {"role": "user", "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
                {"type": "image", "image": "b.png"},
                {"type": "text", "text": " with the clip "},
                {"type": "video", "video": "c.mp4"},
            ]},
            {"role": "assistant", "content": [{"type": "text", "text": "They differ."}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "d.png"}}, {"type": "text", "text": "And this?"}]},
        ], note="vision placeholders; lists for user and assistant content"),
        case("content_list_add_vision_id", [
            {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "image_url", "image_url": {}},
                                         {"type": "text", "text": "What changed?"}]},
        ], extra={"add_vision_id": True}, reasoning_effort="medium"),
        case("video_url_item_error", [
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "c.mp4"}}]},
        ], note="video_url is not a recognized item"),
        case("system_image_error", [
            {"role": "system", "content": [{"type": "image", "image": "x.png"}]},
            {"role": "user", "content": "Hi"},
        ]),
        case("late_system_error", [
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Late rules."},
        ]),
        case("developer_role_error", [
            {"role": "developer", "content": "Rules."},
            {"role": "user", "content": "Hi"},
        ]),
        case("no_user_message_error", [
            {"role": "system", "content": "Rules."},
            {"role": "assistant", "content": "Hello."},
        ]),
        case("only_tool_response_users_error", [
            {"role": "user", "content": "  <tool_response>\nx\n</tool_response>\n"},
        ], note="a user turn that is only a tool response is not a query"),
        case("empty_messages_error", [], note="the template's own check (apply_chat_template refuses earlier)"),
        case("whitespace_and_separator_trim", [
            {"role": "system", "content": "\x1c\x1d  Rules.\u3000\x1e\x1f"},
            {"role": "user", "content": "\u2003\x1f Question? \x1c\n\t"},
            {"role": "assistant", "content": "\x1e Answer. \x85", "reasoning_content": "\x1f\n thought \u00a0\x1c"},
            {"role": "user", "content": "\x1dNext\x1d"},
        ], note="Python str.strip: Unicode whitespace and U+001C..U+001F"),
        case("add_generation_prompt_false", [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        ], add_generation_prompt=False),
        case("literal_control_tokens_pass_through", [
            {"role": "user", "content": "Say <|im_end|> and <tool_call> literally."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "search", "arguments": {"q": "<|im_start|>", "k": None}}},
                {"name": "search", "arguments": ""},
            ]},
            {"role": "tool", "content": "</tool_response>"},
        ], tools=[SEARCH], enable_thinking=True,
            note="no escaping; arguments given as a dict; an unwrapped call with empty arguments"),
        case("tool_message_first_quirk", [
            {"role": "tool", "content": "orphan result"},
            {"role": "user", "content": "Hi"},
        ], note="the official template opens the user turn only when a previous message exists"),
        # Second template: other Jinja features, same renderer.
        case("second_template_plain", [
            {"role": "user", "content": "Hello\r\nthere"},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHi!"},
            {"role": "user", "content": "<tool_result>ignored as a query</tool_result>"},
        ], template="qwen3.5-style", add_generation_prompt=False, extra={"eos_token": "<|endoftext|>"},
            note="default system text, <think> split out of content, eos_token kwarg"),
        case("second_template_tools", [
            {"role": "system", "content": "Agent mode."},
            {"role": "user", "content": "Find hotels."},
            {"role": "assistant", "content": "Searching.\n", "reasoning_content": "Use search.",
             "tool_calls": [call("search", {"q": "hôtel", "k": 5, "flag": True, "none": None, "ratio": 1e-05,
                                            "list": [1, "a", None], "obj": {"b": 1, "a": False}}),
                            call("réserver_hôtel", "{}", "call_1")]},
            {"role": "tool", "content": {"hits": 5}},
            {"role": "tool", "content": "ok"},
        ], template="qwen3.5-style", tools=[SEARCH, BOOKING, {"type": "function", "function": {"name": "noop"}}],
            note="str.format, |map(attribute), tojson(indent=2), |string gives True/None/1e-05, for-else"),
        case("second_template_thinking_off", [{"role": "user", "content": "Hi"}], template="qwen3.5-style",
             enable_thinking=False),
        case("jinja_features_probe", [
            {"role": "system", "content": " line one \nline two\x1c"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": ""}, {"role": "user", "content": "q"},
        ], template="jinja-features"),
        case("jinja_features_probe_other_messages", [
            {"role": "system", "content": "ünï\tcödé  "}, {"role": "user", "content": "x", "name": "n"},
            {"role": "tool", "content": "t"}, {"role": "user", "content": "y"}, {"role": "assistant", "content": "z"},
        ], template="jinja-features", add_generation_prompt=False),
        case("second_template_bad_role", [{"role": "user", "content": "Hi"}, {"role": "critic", "content": "x"}],
             template="qwen3.5-style"),
    ]


def prepare(messages):
    """Nebula's preparation before the template (see engine/src/text/chat_template.rs): arguments strings to dicts."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for tool_call in message.get("tool_calls") or []:
            function = tool_call.get("function") if isinstance(tool_call.get("function"), dict) else tool_call
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments != "":
                parsed = json.loads(arguments)
                if not isinstance(parsed, dict):
                    raise ValueError("arguments must be a JSON object")
                function["arguments"] = parsed
    return messages


def render(template_text, request):
    kwargs = dict(request["extra"])
    if request["enable_thinking"] is not None:
        kwargs["enable_thinking"] = request["enable_thinking"]
    if request["reasoning_effort"] is not None:
        kwargs["reasoning_effort"] = request["reasoning_effort"]
    conversation = _normalize_chat_messages(prepare(request["messages"]))
    rendered, _ = render_jinja_template(
        conversations=[conversation],
        tools=request["tools"],
        chat_template=template_text,
        add_generation_prompt=request["add_generation_prompt"],
        **kwargs,
    )
    return rendered[0]


def main():
    texts = {name: (ROOT / path).read_text(encoding="utf-8") for name, path in TEMPLATES.items()}
    out_cases = []
    for item in cases():
        try:
            item["expected"] = render(texts[item["template"]], item["request"])
        except jinja2.exceptions.TemplateError as error:
            item["error"] = str(error)
        out_cases.append(item)
    fixture = {
        "generator": "scripts/make_template_fixtures.py",
        "truth": f"transformers {transformers.__version__} render_jinja_template on jinja2 {jinja2.__version__}",
        "templates": {name: {"path": TEMPLATES[name], "text": text} for name, text in texts.items()},
        "cases": out_cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    errors = sum("error" in c for c in out_cases)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(out_cases)} cases ({errors} expected errors)")
    for c in out_cases:
        print(f"  {c['template']:14} {c['name']:40} " + (f"error: {c['error']}" if "error" in c else f"{len(c['expected'].encode())} bytes"))


if __name__ == "__main__":
    sys.exit(main())
