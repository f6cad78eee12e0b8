#!/usr/bin/env python3
"""Writes tests/fixtures/agents/*.json: requests in the shapes two coding agents send, for the replay tests in
tests/sdk/test_agent_replays.py.

The shapes (paths, headers, field names and their nesting, the kinds of items and blocks, which fields are present
or absent) follow what Claude Code sends to POST /v1/messages and what the Codex CLI sends to POST /v1/responses;
every text, name, id and value is written here in our own words. Ids and signatures that came from another server
(a thinking `signature`, a reasoning `encrypted_content`) are opaque strings this server cannot open, as in a real
replay after switching servers.

    python3 scripts/make_agent_fixtures.py    # rewrites the fixtures; no network, no inputs
"""

import json
import pathlib

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "agents"
DRAFT = "https://json-schema.org/draft/2020-12/schema"


def schema(properties, required):
    return {"$schema": DRAFT, "type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def claude_code():
    s = {"type": "string"}
    tools = [
        ("Task", "Start a helper agent for a multi-step job.", {"description": s, "prompt": s}, ["description", "prompt"]),
        ("Bash", "Run a shell command and return its output.", {"command": s, "timeout": {"type": "number"}}, ["command"]),
        ("Glob", "Find files whose paths match a pattern.", {"pattern": s, "path": s}, ["pattern"]),
        ("Grep", "Search file contents with a regular expression.", {"pattern": s, "path": s}, ["pattern"]),
        ("Read", "Read a file from the local disk.", {"file_path": s, "offset": {"type": "integer"}}, ["file_path"]),
        ("Edit", "Replace one string with another in a file.",
         {"file_path": s, "old_string": s, "new_string": s}, ["file_path", "old_string", "new_string"]),
        ("Write", "Write a whole file.", {"file_path": s, "content": s}, ["file_path", "content"]),
        ("WebFetch", "Fetch a URL and answer a question about it.", {"url": s, "prompt": s}, ["url", "prompt"]),
        ("TodoWrite", "Keep the task list of this session.",
         {"todos": {"type": "array", "items": {"type": "object", "properties": {"content": s, "status": s},
                                               "required": ["content", "status"]}}}, ["todos"]),
        ("WebSearch", "Search the web.", {"query": s}, ["query"]),
        ("BashOutput", "Read the output of a background shell.",
         {"bash_id": {"type": "string", "enum": ["shell_1", "shell_2"]}}, ["bash_id"]),
        ("NotebookEdit", "Edit a cell of a Jupyter notebook.", {"notebook_path": s, "new_source": s},
         ["notebook_path", "new_source"]),
    ]
    tool_defs = []
    for i, (name, description, props, required) in enumerate(tools):
        tool = {"name": name, "description": description, "input_schema": schema(props, required)}
        if name == "NotebookEdit":
            tool["defer_loading"] = True
        if i == len(tools) - 1:
            tool["cache_control"] = {"type": "ephemeral"}
        tool_defs.append(tool)
    body = {
        "model": "claude-opus-4-1-20250805",
        "max_tokens": 64000,
        "stream": True,
        "system": [
            {"type": "text", "text": "You are a command-line coding assistant.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Work in small steps. Use the tools to look before you answer. Keep replies "
                                     "short.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<reminder>The project is a small Rust crate.</reminder>"},
                {"type": "text", "text": "What is 2 + 2? Look at notes.txt first."},
            ]},
            {"role": "system", "content": [{"type": "text", "text": "The working directory is /home/dev/demo."}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "", "signature": "c2lnbmVkLWJ5LWFub3RoZXItc2VydmVyLTAwMQ=="},
                {"type": "text", "text": "I will read the notes."},
                {"type": "tool_use", "id": "toolu_demo_0001", "name": "Read",
                 "input": {"file_path": "/home/dev/demo/notes.txt"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_demo_0001",
                 "content": [{"type": "text", "text": "1\tarithmetic: 2 + 2 = 4"}],
                 "cache_control": {"type": "ephemeral"}},
            ]},
            {"role": "system", "content": "The notes file is short; answer from it."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?",
                                          "cache_control": {"type": "ephemeral"}}]},
        ],
        "tools": tool_defs,
        "metadata": {"user_id": "user_0f3a_account_77c1_session_5d2e"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    headers = {
        "x-api-key": "$KEY",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": ",".join([
            "claude-code-20250219", "oauth-2025-04-20", "interleaved-thinking-2025-05-14",
            "fine-grained-tool-streaming-2025-05-14", "context-management-2025-06-27", "effort-2025-11-24",
            "advanced-tool-use-2025-11-20", "unknown-future-beta-2099-01-01",
        ]),
        "anthropic-dangerous-direct-browser-access": "true",
        "user-agent": "claude-cli/2.0.0 (external, cli)",
        "x-app": "cli",
        "content-type": "application/json",
        "accept": "application/json",
    }
    return {"path": "/v1/messages?beta=true", "headers": headers, "body": body}


def codex():
    s = {"type": "string"}
    def function(name, description, props, required):
        return {"type": "function", "name": name, "description": description, "strict": False,
                "parameters": {"type": "object", "properties": props, "required": required,
                               "additionalProperties": False}}
    docs = [
        function("search", "Search the project documentation.", {"query": s}, ["query"]),
        function("fetch_page", "Fetch one documentation page.", {"page": s}, ["page"]),
        function("list_pages", "List the documentation pages.", {}, []),
        function("page_outline", "The headings of a page.",
                 {"page": {"type": "string", "enum": ["intro", "install", "api"]}}, ["page"]),
        function("related", "Pages related to a page.", {"page": s}, ["page"]),
    ]
    for f in docs:
        del f["strict"]
    body = {
        "model": "gpt-5-codex",
        "input": [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<permissions>Commands run in a sandbox; writes stay in the "
                                               "workspace.</permissions>"}]},
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<style>Answer in plain text. Prefer short replies.</style>"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context><cwd>/home/dev/demo</cwd><shell>bash</shell>"
                                               "</environment_context>"}]},
            {"type": "message", "role": "user", "id": "msg_demo_user_0001", "content": [
                {"type": "input_text", "text": "List the files here."}]},
            {"type": "reasoning", "id": "rs_demo_0001", "summary": [{"type": "summary_text",
                                                                     "text": "**Listing the files**"}],
             "content": None, "encrypted_content": "c2VhbGVkLWJ5LWFub3RoZXItc2VydmVyLTAwMDE="},
            {"type": "function_call", "id": "fc_demo_0001", "name": "shell_command",
             "arguments": "{\"command\":\"ls\",\"workdir\":\"/home/dev/demo\"}", "call_id": "call_demo_0001"},
            {"type": "function_call_output", "call_id": "call_demo_0001", "output": "Cargo.toml\nnotes.txt\nsrc\n"},
            {"type": "message", "role": "assistant", "id": "msg_demo_asst_0001", "content": [
                {"type": "output_text", "text": "Three entries: Cargo.toml, notes.txt and src."}]},
            {"type": "message", "role": "user", "id": "msg_demo_user_0002", "content": [
                {"type": "input_text", "text": "What is 2 + 2?"}]},
        ],
        "tools": [
            function("shell_command", "Run a shell command and return its output.",
                     {"command": s, "workdir": s, "timeout_ms": {"type": "number"}}, ["command"]),
            function("update_plan", "Update the task plan.",
                     {"explanation": s, "plan": {"type": "array", "items": {
                         "type": "object", "properties": {"step": s, "status": s}, "required": ["step", "status"],
                         "additionalProperties": False}}}, ["plan"]),
            function("view_image", "Attach a local image to the conversation.", {"path": s}, ["path"]),
            {"type": "namespace", "name": "mcp__docs__", "description": "Tools of the docs MCP server.",
             "tools": docs},
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "5b7d2f0e-1c4a-4e8b-9a61-3f2d7c9e0b15",
        "text": {"verbosity": "medium"},
        "client_metadata": {"originator": "codex_cli_rs", "terminal": "xterm-256color"},
    }
    headers = {
        "authorization": "Bearer $KEY",
        "originator": "codex_cli_rs",
        "version": "0.60.0",
        "session_id": "5b7d2f0e-1c4a-4e8b-9a61-3f2d7c9e0b15",
        "user-agent": "codex_cli_rs/0.60.0 (Linux; x86_64) xterm-256color",
        "content-type": "application/json",
        "accept": "text/event-stream",
    }
    return {"path": "/v1/responses", "headers": headers, "body": body}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name, make in [("claude_code_messages.json", claude_code), ("codex_responses.json", codex)]:
        (OUT / name).write_text(json.dumps(make(), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
