"""An agent framework on its default path against `nebula serve`: openai-agents' `Agent(model=...)` with a function
tool, run by `Runner` through its default model provider (the Responses API, `OpenAIResponsesModel`) with the
client it builds from `OPENAI_BASE_URL` and `OPENAI_API_KEY`. Offline: tracing export is off
(`OPENAI_AGENTS_DISABLE_TRACING=1`) and the only network is the loopback server. Run with scripts/test_sdk.sh.

The demo model knows few answers, so the first turn forces the tool (`tool_choice`); the framework then resets the
choice, sends the tool's output back in the history, and the model's text becomes the final output.
"""

import os
from typing import Literal

import pytest
from openai.types.shared import Reasoning

from conftest import AGENT_KEY


@pytest.fixture()
def agents_env(agent_server, monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", f"{agent_server}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", AGENT_KEY)
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    import agents

    agents.set_tracing_disabled(True)
    return agents


def test_openai_agents_runs_a_function_tool(agents_env):
    agents = agents_env
    calls = []

    # An enum argument: a free string from the demo model may not end.
    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    agent = agents.Agent(
        name="demo",
        instructions="Answer briefly.",
        model="gpt-5-mini",
        tools=[get_weather],
        # Thinking off (effort none): the demo model's thinking on an unfamiliar prompt can run long.
        model_settings=agents.ModelSettings(
            tool_choice="get_weather", temperature=0, reasoning=Reasoning(effort="none")
        ),
    )
    result = agents.Runner.run_sync(agent, "What is the capital of France?", max_turns=4)
    assert len(calls) == 1 and calls[0] in ("Paris", "Tokyo")
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds and kinds[-1] == "message_output_item"
    # Every model call went through the Responses API of this server.
    assert all(r.response_id and r.response_id.startswith("resp_") for r in result.raw_responses)
    assert os.environ["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")
